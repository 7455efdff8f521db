"""`python -m workers warm`: a run's first job's host readied beside Ray's start (its peaks probed
and stored, every arm and auto candidate of its case called once, under the GPU lock), and the
embedded head running it before the first job, whose own peak probe is then a stored read.

Real processes, real MLX (CPU backend), a real lock held by another process."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from tests.conftest import REPO, child_env
from workers.contract import META_PHASES, JobSpec, LockSettings
from workers.job import warm

pytestmark = pytest.mark.slow


def _job(tmp_path: Path, arms: list[str]) -> JobSpec:
    return JobSpec(
        run_id="run1", sweep="warm", job_key="k1", case="qmm", case_name="qmm",
        params={"tokens": 16, "n": 64, "k": 64, "dtype": "float32"}, arms=arms, device="cpu",
        repetitions=3, warmup=0, lock=LockSettings(path=str(tmp_path / "gpu.lock"), cpu_busy_threshold=1e9),
    )  # fmt: skip


def test_warm_probes_the_peaks_and_calls_every_arm_and_candidate(tmp_path: Path) -> None:
    job = tmp_path / "job.json"
    job.write_text(_job(tmp_path, ["native", "affine", "custom", "auto"]).model_dump_json())
    out = subprocess.run(
        [sys.executable, "-m", "workers", "warm", str(job)], cwd=REPO, env=child_env(), capture_output=True,
        text=True, timeout=300, check=True,
    ).stdout.strip()  # fmt: skip
    found = re.fullmatch(r"peaks ([\d.]+) s, kernels ([\d.]+) s \((\d+) calls\)", out)
    assert found, out
    from kernels import qmm

    workload = qmm.build({"tokens": 16, "n": 64, "k": 64, "dtype": "float32"}, ["native", "affine", "custom", "auto"],
                         __import__("numpy").random.default_rng(0))  # fmt: skip
    auto = workload.arms["auto"].auto
    assert auto is not None
    assert int(found.group(3)) == 4 + len(auto.candidates)  # three arms, auto, and each of auto's candidates
    stored = list((Path.home() / ".orchestrate" / "peaks").glob("*.json"))
    assert len(stored) == 1
    first = json.loads(stored[0].read_text())
    assert first["tflop_s"] > 0 and first["probes"] == 1
    again = subprocess.run(
        [sys.executable, "-m", "workers", "warm", str(job)], cwd=REPO, env=child_env(), capture_output=True,
        text=True, timeout=300, check=True,
    ).stdout  # fmt: skip
    second = json.loads(stored[0].read_text())
    if first["disturbed"] is None:  # a quiet probe is read, not taken again
        assert second == first and float(again.split()[1]) < float(found.group(1)) / 2
    else:  # this shared CPU disturbed it: probed again, as a job would (`workers.host.peaks`)
        assert second["probes"] == 2


def test_warm_leaves_the_work_to_the_first_job_when_the_lock_stays_busy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    lock = tmp_path / "gpu.lock"
    holder = subprocess.Popen(
        [sys.executable, str(REPO / "tests" / "workers" / "lock_helper.py"), "hold", str(lock), "0"],
        cwd=REPO, env=child_env(PYTHONPATH=str(REPO)), stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout is not None and holder.stdout.readline().startswith("held")
        monkeypatch.setattr(warm, "LOCK_WAIT_S", 0.5)
        done = warm.warm(_job(tmp_path, ["native"]))
        assert done["skipped"] == "the GPU lock stayed busy" and done["calls"] == 0
        assert not list((Path.home() / ".orchestrate" / "peaks").glob("*.json"))  # nothing probed outside the lock
    finally:
        holder.kill()
        holder.wait()


def test_a_bad_job_file_is_a_one_line_error(tmp_path: Path) -> None:
    bad = tmp_path / "job.json"
    bad.write_text("{not json")
    res = subprocess.run([sys.executable, "-m", "workers", "warm", str(bad)], cwd=REPO, env=child_env(),
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert res.returncode == 2 and res.stdout == ""
    assert res.stderr.startswith(f"workers: error: {bad}:") and len(res.stderr.strip().splitlines()) == 1


def test_the_embedded_head_readies_the_host_before_the_first_job(orchestrate_bin: str, tmp_path: Path) -> None:
    """With warming on, `orchestrate run` says what it did beside Ray's start, and the first job
    finds the peaks stored (its own probe only reads them)."""
    res = subprocess.run(
        [orchestrate_bin, "run", "-s", "smoke"], env=child_env(ORCHESTRATE_WARM="1"), capture_output=True,
        text=True, timeout=600,
    )  # fmt: skip
    assert res.returncode in (0, 5), res.stdout + res.stderr  # 5: contended on this shared machine
    line = next(x for x in res.stdout.splitlines() if x.startswith("host readied for the first job"))
    probed = float(re.search(r"peaks ([\d.]+) s", line).group(1))  # type: ignore[union-attr]
    assert probed > 0  # this test's HOME had no stored peaks
    jobs = [json.loads(pq.read_schema(p).metadata[META_PHASES]) for p in (tmp_path / "results").rglob("*.parquet")]
    assert len(jobs) == 5
    [stored] = (Path.home() / ".orchestrate" / "peaks").glob("*.json")
    if json.loads(stored.read_text())["probes"] == 1:  # quiet: no job probed again (without warming, the first does)
        assert max(j.get("peaks", 0.0) for j in jobs) < probed / 2
