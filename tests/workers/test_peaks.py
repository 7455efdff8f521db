"""The per-host peak probes: real MLX at small sizes, stored once per fingerprint, stamped on rows."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.orchestrator.synthetic_rows import job_table
from workers import peaks as peaks_mod
from workers.contract import JobSpec, LockSettings
from workers.fingerprint import host_fingerprint
from workers.peaks import host_peaks, load_peaks, peaks_path, with_peaks
from workers.runner import run_job


def test_probes_measure_plausible_limits_and_are_stored_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ORCHESTRATE_PEAKS_DIR", str(tmp_path / "peaks"))
    fp = host_fingerprint()
    first = host_peaks(fp, copy_mib=16, matmul_n=128, repeats=3)
    # MLX's CPU backend here: about 3-40 GB/s copy, about 6 GFLOP/s (reference BLAS); a GPU far more.
    assert 0.1 < first.copy_gb_s < 20_000
    assert 1e-4 < first.tflop_s < 5_000
    assert (first.matmul_n, first.copy_bytes, first.fingerprint_id) == (128, 16 * 2**20, fp.fingerprint_id)
    path = peaks_path(fp.fingerprint_id)
    assert path.parent == tmp_path / "peaks" and json.loads(path.read_text())["copy_gb_s"] == first.copy_gb_s

    def no_second_measurement(*args: object, **kwargs: object) -> None:
        raise AssertionError("measured again although stored for this fingerprint")

    monkeypatch.setattr(peaks_mod, "measure_peaks", no_second_measurement)
    assert host_peaks(fp) == first


def test_unreadable_or_foreign_files_are_measured_again(tmp_path: Path) -> None:
    path = peaks_path("abc", tmp_path)
    path.write_text("{ not json")
    assert load_peaks("abc", tmp_path) is None
    path.write_text(json.dumps({"fingerprint_id": "other"}))
    assert load_peaks("abc", tmp_path) is None


def test_peaks_are_stamped_on_every_row(tmp_path: Path) -> None:
    fp = host_fingerprint()
    peaks = host_peaks(fp, tmp_path, copy_mib=4, matmul_n=64, repeats=2)
    table = job_table({"native": {"seconds": [1.0, 2.0]}, "affine": {"seconds": [1.5]}}, params={"tokens": 1})
    stamped = with_peaks(table, peaks)
    assert stamped.schema == table.schema and stamped.schema.metadata == table.schema.metadata
    assert stamped["peak_copy_gb_s"].to_pylist() == [peaks.copy_gb_s] * 3
    assert stamped["peak_tflop_s"].to_pylist() == [peaks.tflop_s] * 3
    assert with_peaks(table, None) is table


def test_every_row_of_a_real_job_carries_the_hosts_peaks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Through `run_job`: the probes run inside the job's window, once, and stamp every row."""
    monkeypatch.setenv("ORCHESTRATE_PEAKS_DIR", str(tmp_path / "peaks"))
    job = JobSpec(
        run_id="r",
        sweep="t",
        job_key="k",
        case="qmm",
        case_name="qmm",
        params={"tokens": 4, "n": 32, "k": 64, "dtype": "float32"},
        arms=["native", "affine"],
        device="cpu",
        repetitions=2,
        warmup=1,
        lock=LockSettings(enabled=False),
    )
    fp = host_fingerprint()
    table = run_job(job, fp)
    stored = load_peaks(fp.fingerprint_id)
    assert stored is not None and set(table["status"].to_pylist()) == {"ok"}
    assert set(table["peak_copy_gb_s"].to_pylist()) == {stored.copy_gb_s}
    assert set(table["peak_tflop_s"].to_pylist()) == {stored.tflop_s}
    again = run_job(job, fp)  # the second job reads the stored peaks
    assert set(again["peak_copy_gb_s"].to_pylist()) == {stored.copy_gb_s}
