"""The `workers-rows` parser: a job run by `python -m workers run JOB --out FILE` as one sample.

A kernel case bisected over this project's commits runs, per sample, the commit's own worker on a
job in the commit's checkout (`orchestrator.run.bisect_kernel`). That worker writes its rows to a
Parquet file and prints `workers: CASE KEY: N rows, job STATUS -> FILE`; this parser reads the file
and reports each metric's median over the job's timed samples, so one process is one sample of
the command case, interleaved with the other commit's.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pyarrow.compute as pc
import pyarrow.parquet as pq

from workers.command.parsed import OutputParseError, ParsedOutput

WRITTEN = re.compile(r"^workers: .* -> (?P<path>/\S+\.parquet)\s*$", re.M)


def parse_job_rows(out: str) -> ParsedOutput:
    """Each metric's median over the timed, clean rows of the Parquet file the worker named.

    Raises:
        OutputParseError: no such line, an unreadable file, or a job whose rows failed.
    """
    found = list(WRITTEN.finditer(out))
    if not found:
        raise OutputParseError("no `workers: ... -> /path/rows.parquet` line: is the command `python -m workers run`?")
    path = Path(found[-1].group("path"))
    try:
        table = pq.read_table(path)
    except (OSError, ValueError) as exc:
        raise OutputParseError(f"{path}: cannot read the job's rows ({exc})") from None
    failed = table.filter(pc.not_equal(table["status"], "ok"))
    if failed.num_rows:
        error = next((e for e in failed["error"].to_pylist() if e), "no error given")
        raise OutputParseError(f"the job's rows are {failed['status'][0].as_py()}: {error.splitlines()[0]}")
    timed = table.filter(pc.and_(pc.greater_equal(table["sample"], 0), pc.invert(table["contended"])))
    parsed = ParsedOutput()
    for metric in dict.fromkeys(timed["metric"].to_pylist()):
        rows = timed.filter(pc.equal(timed["metric"], metric))
        parsed.add(metric, float(np.median(rows["value"].to_numpy(zero_copy_only=False))), rows["unit"][0].as_py())
    if not parsed.measurements:
        raise OutputParseError(f"{path}: the job has no timed rows")
    return parsed
