"""The host's spool: every job's rows stay on the worker's disk until the head has stored them.

`workers.job.task` writes each job's Parquet fragment into the spool before returning the rows to the
head, so rows outlive a lost head or a dropped connection; `orchestrate collect` fetches the
fragments the head never stored. Layout (one place for both sides):

    <spool root>/<sweep>/<run_id>/part-<run_id>-<job_key>.parquet   (and <job_key>.json, the job)

The root is `$ORCHESTRATE_SPOOL` (set per host by `orchestrate cluster up`), else the job's
`spool_dir`, else `~/.orchestrate/spool`.
"""

from __future__ import annotations

import os
from pathlib import Path

SPOOL_ENV = "ORCHESTRATE_SPOOL"
DEFAULT_SPOOL = "~/.orchestrate/spool"
PREFIX = "part-"
SUFFIX = ".parquet"


def spool_root(job_spool_dir: str | None = None) -> Path:
    """This host's spool root: `$ORCHESTRATE_SPOOL`, the job's `spool_dir`, or the default."""
    return Path(os.environ.get(SPOOL_ENV) or job_spool_dir or DEFAULT_SPOOL).expanduser()


def fragment_name(run_id: str, job_key: str) -> str:
    """The file name of one job's fragment (the same name the result store uses)."""
    return f"{PREFIX}{run_id}-{job_key}{SUFFIX}"


def parse_fragment_name(name: str) -> tuple[str, str] | None:
    """`(run_id, job_key)` of a fragment's file name, or None for any other file."""
    base = name.rsplit("/", 1)[-1]
    if not (base.startswith(PREFIX) and base.endswith(SUFFIX)):
        return None
    run_id, sep, job_key = base[len(PREFIX) : -len(SUFFIX)].rpartition("-")
    if not sep or not run_id or not job_key:
        return None
    return run_id, job_key
