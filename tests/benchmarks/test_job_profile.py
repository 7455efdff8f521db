"""benchmarks/job_profile.py: a real job profiled in a fresh worker process, and a fresh process's
device start and exit, here on MLX's CPU backend (the H200 numbers come from `device_lab.sh PROFILE=`)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

from benchmarks import job_profile


def test_driver_times_each_step_and_the_exit() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks.job_profile", "driver", "--alloc-gib", "0.01"],
        capture_output=True, text=True, timeout=120, check=True,
    ).stdout  # fmt: skip
    for exit_kind in ("normal exit", "os._exit"):
        block = out.split(f"a fresh process, {exit_kind}:")[1].split("-- ")[0]
        steps = dict((name, float(s)) for s, name in re.findall(r"^\s*([\d.]+) s  (.+)$", block, re.M))
        assert "import mlx.core" in steps and "exit, as the parent sees it" in steps, block
        assert any(name.startswith("mx.default_device()") for name in steps)
        assert all(0.0 <= s < 60.0 for s in steps.values()), steps


def test_show_prints_the_phases_and_the_job_functions(tmp_path: Path) -> None:
    job = {
        "run_id": "profile", "sweep": "profile", "job_key": "qmm-32", "case": "qmm", "case_name": "qmm",
        "params": {"tokens": 32, "n": 256, "k": 512, "dtype": "float32"}, "arms": ["native", "affine"],
        "device": "cpu", "backend": "cpu", "repetitions": 3,
        "warmup": 1, "seed": 1, "lock": {"path": str(tmp_path / "gpu.lock")},
    }  # fmt: skip
    (tmp_path / "job.json").write_text(json.dumps(job))
    prof, parquet = tmp_path / "job.prof", tmp_path / "job.parquet"
    subprocess.run(
        [sys.executable, "-m", "cProfile", "-o", str(prof), "-m", "workers", "run", str(tmp_path / "job.json"),
         "--out", str(parquet)],
        capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip
    text = subprocess.run(
        [sys.executable, "-m", "benchmarks.job_profile", "show", str(prof), str(parquet), "--top", "20"],
        capture_output=True, text=True, timeout=60, check=True,
    ).stdout  # fmt: skip
    first = text.splitlines()[0]
    assert first.startswith("phases (s):") and "timed" in first and "fingerprint" in first, first
    assert "run_job" in text and "cumulative" in text and "tottime" in text
    assert job_profile.main(["show", str(prof), "--top", "1"]) == 0  # no fragment: the functions alone
