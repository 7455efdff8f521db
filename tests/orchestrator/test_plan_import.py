"""`orchestrate plan` -> `python -m workers run` (no Ray) -> `orchestrate import` -> `results`."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

from tests.conftest import child_env

SWEEP = """
name = "offline"
repetitions = 3
warmup = 1
baseline = "affine"
[[cases]]
case = "qmm"
arms = ["native", "affine"]
params = { tokens = [1, 8], n = 64, k = 128, dtype = "float32" }
"""


def test_jobs_run_standalone_then_import_into_results(tmp_path: Path, orchestrate_bin: str) -> None:
    sweep = tmp_path / "offline.toml"
    sweep.write_text(SWEEP)
    jobs = tmp_path / "jobs"
    lock = tmp_path / "far.lock"
    out = subprocess.run(
        [orchestrate_bin, "plan", "--sweep", str(sweep), "--device", "far-gpu", "--backend", "cpu",
         "--out", str(jobs), "--lock", str(lock)],
        capture_output=True, text=True, env=child_env(), timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    files = sorted(jobs.glob("*.json"))
    assert len(files) == 2
    spec = json.loads(files[0].read_text())
    assert spec["device"] == "far-gpu" and spec["lock"]["path"] == str(lock) and spec["arms"] == ["native", "affine"]

    parts = []
    for f in files:
        part = tmp_path / f"{f.stem}.parquet"
        run = subprocess.run(
            [sys.executable, "-m", "workers", "run", str(f), "--out", str(part)],
            capture_output=True, text=True, env=child_env(), timeout=300,
        )  # fmt: skip
        assert run.returncode == 0, run.stderr
        parts.append(part)

    results = tmp_path / "results"
    imp = subprocess.run(
        [orchestrate_bin, "import", *map(str, parts), "--results", str(results)],
        capture_output=True, text=True, env=child_env(), timeout=120,
    )  # fmt: skip
    assert imp.returncode == 0, imp.stderr
    stored = sorted(results.rglob("part-*.parquet"))
    assert len(stored) == 2 and all("sweep=offline" in str(p) and "device=far-gpu" in str(p) for p in stored)

    res = subprocess.run(
        [orchestrate_bin, "results", "--sweep", "offline", "--results", str(results)],
        capture_output=True, text=True, env=child_env(), timeout=120,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    rows = int(re.search(r"^sweep offline: (\d+) rows", res.stdout, re.M).group(1))  # type: ignore[union-attr]
    # per job: 2 arms x (3 samples x 4 per-sample metrics + rel_error, peak memory, build time)
    assert rows == 2 * 2 * (3 * 5 + 3)  # per sample: seconds, host_seconds (decode sizes), tok/s, GB/s, TFLOP/s

    bad = tmp_path / "bad.parquet"
    bad.write_text("not parquet")
    fail = subprocess.run(
        [orchestrate_bin, "import", str(bad), "--results", str(results)],
        capture_output=True, text=True, env=child_env(), timeout=120,
    )  # fmt: skip
    assert fail.returncode == 2
    assert str(bad) in fail.stderr and "not a readable Parquet fragment" in fail.stderr
