"""The `workers-rows` parser: a worker's job run as one sample of a command case."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from orchestrator.run.plan import expand
from orchestrator.specs.sweep import load_inventory, load_sweep
from workers.command.parsers import OutputParseError, parser_for

ROOT = Path(__file__).resolve().parents[2]


def test_a_real_job_becomes_one_sample_per_metric_the_median_of_its_rounds(tmp_path: Path) -> None:
    sweep = load_sweep("smoke")
    qmm = sweep.cases[0].model_copy(update={"params": {"tokens": 1, "n": 64, "k": 128, "dtype": "float32"},
                                            "arms": ["native"]})  # fmt: skip
    inventory = load_inventory(None)
    job = expand(sweep.model_copy(update={"cases": [qmm]}), inventory, inventory.device_kinds(), run_id="r",
                 version="v")[0]  # fmt: skip
    job = job.model_copy(update={"lock": job.lock.model_copy(update={"enabled": False}), "repetitions": 5})
    (tmp_path / "job.json").write_text(job.model_dump_json())
    out = tmp_path / "rows.parquet"
    command = [sys.executable, "-m", "workers", "run", "job.json", "--out", str(out)]
    env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    ran = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, env=env)
    assert ran.returncode == 0, ran.stderr
    parsed = parser_for("workers-rows")(ran.stdout)
    rows = pq.read_table(out).to_pylist()
    seconds = sorted(r["value"] for r in rows if r["metric"] == "seconds" and r["sample"] >= 0)
    assert len(seconds) == 5
    got = {m.metric: (m.value, m.unit) for m in parsed.measurements}
    assert got["seconds"] == (seconds[2], "seconds") and "rel_error" not in got  # timed rounds only


def test_a_failed_job_or_a_missing_file_does_not_parse(tmp_path: Path) -> None:
    with pytest.raises(OutputParseError, match="python -m workers run"):
        parser_for("workers-rows")("something else\n")
    path = tmp_path / "rows.parquet"
    pq.write_table(pa.table({"status": ["failed"], "error": ["wrong output: rel_error 0.3 > 0.02\nmore"],
                             "sample": [-1], "contended": [False], "metric": ["rel_error"], "value": [0.3],
                             "unit": [""]}), path)  # fmt: skip
    with pytest.raises(OutputParseError, match=r"rows are failed: wrong output: rel_error 0.3 > 0.02$"):
        parser_for("workers-rows")(f"workers: qmm k: 1 rows, job failed -> {path}\n")
    with pytest.raises(OutputParseError, match="cannot read"):
        parser_for("workers-rows")(f"workers: qmm k: 1 rows, job ok -> {tmp_path / 'gone.parquet'}\n")
