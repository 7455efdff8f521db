"""The per-host peak probes: real MLX at small sizes, the best copy the host offers, stored per
fingerprint, probed again when disturbed or asked, stamped on rows."""

from __future__ import annotations

import datetime as dt
import json
from pathlib import Path

import mlx.core as mx
import pytest

from tests.orchestrator.synthetic_rows import job_table
from workers.contract import JobSpec, LockSettings
from workers.host import peaks as peaks_mod
from workers.host.fingerprint import host_fingerprint
from workers.host.peaks import (
    CopyProbe,
    MatmulProbe,
    PeakStamp,
    host_peaks,
    load_peaks,
    peaks_path,
    read_peaks,
    with_peaks,
)
from workers.job.runner import run_job


def test_the_copy_probe_takes_the_best_copy_the_host_offers(tmp_path: Path) -> None:
    fp = host_fingerprint()
    first = host_peaks(fp, tmp_path, copy_mib=16, matmul_sizes=(64, 128), repeats=3)
    # MLX's CPU backend here: about 3-40 GB/s copy, about 6 GFLOP/s (reference BLAS); a GPU far more.
    assert 0.1 < first.copy_gb_s < 20_000
    assert 1e-4 < first.tflop_s < 5_000
    assert (first.copy_bytes, first.fingerprint_id) == (16 * 2**20, fp.fingerprint_id)
    assert set(first.matmul_candidates) == {"64", "128"}  # every size probed, the best kept with its size
    assert first.tflop_s == first.matmul_candidates[str(first.matmul_n)] == max(first.matmul_candidates.values())
    want = {"mlx x+1", "mlx copy", "numpy copyto" if mx.default_device() == mx.cpu else "cuda memcpy DtoD"}
    assert want <= set(first.copy_candidates) or mx.metal.is_available()
    assert first.copy_gb_s == max(first.copy_candidates.values())  # not `x + 1` alone
    assert first.copy_method == max(first.copy_candidates, key=lambda m: first.copy_candidates[m])
    stored = json.loads(peaks_path(fp.fingerprint_id, tmp_path).read_text())
    assert stored["copy_gb_s"] == first.copy_gb_s and stored["copy_method"] == first.copy_method


def test_the_matrix_probe_takes_the_best_size_not_the_largest(monkeypatch: pytest.MonkeyPatch) -> None:
    """A small product leaves a GPU partly idle and a large one, back to back, runs at the board's
    power cap: the peak is the best rate of any size (real MLX products, the clock scripted)."""
    seconds = {64: 2 * 64**3 / 500e12, 128: 2 * 128**3 / 790e12, 256: 2 * 256**3 / 734e12}
    sizes: list[int] = []

    def best_seconds(fn: object, repeats: int) -> float:
        n = (64, 128, 256)[len(sizes)]
        sizes.append(n)
        return seconds[n]

    monkeypatch.setattr(peaks_mod, "_best_seconds", best_seconds)
    probe = peaks_mod.measure_tflop_s((64, 128, 256), "float32", repeats=2)
    assert sizes == [64, 128, 256]
    assert (probe.n, round(probe.tflop_s)) == (128, 790)
    assert {n: round(r) for n, r in probe.candidates.items()} == {"64": 500, "128": 790, "256": 734}


def test_a_probe_of_the_previous_version_is_probed_again(tmp_path: Path) -> None:
    fp = host_fingerprint()
    peaks = host_peaks(fp, tmp_path, copy_mib=4, matmul_sizes=(64,), repeats=2)
    old = peaks.model_copy(update={"version": peaks_mod.PEAKS_VERSION - 1})
    peaks_path(fp.fingerprint_id, tmp_path).write_text(old.model_dump_json())
    assert load_peaks(fp.fingerprint_id, tmp_path) is None


def _scripted(monkeypatch: pytest.MonkeyPatch, rates: list[tuple[float, float]]) -> list[int]:
    """Copy probes that report the scripted (GB/s, spread) in turn: a stand-in for a busy or a
    quiet host (the real probe is tested above)."""
    calls: list[int] = []

    def probe(copy_mib: int, repeats: int = 5) -> CopyProbe:
        gb_s, spread = rates[len(calls)]
        calls.append(copy_mib)
        return CopyProbe(gb_s=gb_s, method="scripted", candidates={"scripted": gb_s}, spread=spread)

    monkeypatch.setattr(peaks_mod, "measure_copy", probe)
    monkeypatch.setattr(
        peaks_mod,
        "measure_tflop_s",
        lambda sizes, dtype, repeats=5: MatmulProbe(tflop_s=1.0, n=sizes[0], candidates={}),
    )
    return calls


def test_a_quiet_probe_is_stored_once_per_fingerprint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _scripted(monkeypatch, [(100.0, 1.05), (200.0, 1.0)])
    fp = host_fingerprint()
    first = host_peaks(fp, tmp_path, copy_mib=4, matmul_sizes=(64,), repeats=2)
    assert host_peaks(fp, tmp_path) == first and len(calls) == 1
    # a new driver, OS, MLX or host is a new fingerprint: probed again
    other = host_peaks(fp.model_copy(update={"fingerprint_id": "new-driver"}), tmp_path, copy_mib=4, matmul_sizes=(64,))
    assert len(calls) == 2 and other.copy_gb_s == 200.0


def test_a_disturbed_probe_is_probed_again_and_the_best_is_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A CPU probe on a busy machine reads far too low (a kernel then shows at 3140 % of peak):
    its repeats spread, so it is stored as disturbed, probed again, and merged as the best."""
    calls = _scripted(monkeypatch, [(3.0, 4.0), (40.0, 1.6), (35.0, 1.7), (99.0, 1.0)])
    fp = host_fingerprint()
    busy = host_peaks(fp, tmp_path, copy_mib=4, matmul_sizes=(64,))
    assert busy.disturbed is not None and "spread 4.00x" in busy.disturbed
    assert load_peaks(fp.fingerprint_id, tmp_path) is None  # not trusted as it is
    second = host_peaks(fp, tmp_path, copy_mib=4, matmul_sizes=(64,))
    assert second.copy_gb_s == 40.0 and second.probes == 2
    third = host_peaks(fp, tmp_path, copy_mib=4, matmul_sizes=(64,))
    assert third.copy_gb_s == 40.0 and third.probes == peaks_mod.MAX_PROBES  # the best of the busy probes
    assert host_peaks(fp, tmp_path) == third and len(calls) == 3  # a host that stays busy stops probing


def test_peaks_are_probed_again_on_request_once_per_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _scripted(monkeypatch, [(100.0, 1.0), (150.0, 1.0)])
    fp = host_fingerprint()
    host_peaks(fp, tmp_path, run_id="run-1", copy_mib=4, matmul_sizes=(64,))
    monkeypatch.setenv(peaks_mod.ENV_REPROBE, "1")
    again = host_peaks(fp, tmp_path, run_id="run-2", copy_mib=4, matmul_sizes=(64,))
    assert again.copy_gb_s == 150.0 and again.run_id == "run-2"
    assert host_peaks(fp, tmp_path, run_id="run-2") == again and len(calls) == 2  # once per run


def test_a_probe_taken_in_a_contended_job_is_not_trusted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _scripted(monkeypatch, [(100.0, 1.0)])
    stamp = PeakStamp(host_fingerprint(), tmp_path)
    stamp.wrap(lambda job, rows, context: "ok")(None, None, None)
    table = job_table({"native": {"seconds": [1.0, 2.0]}}, params={"tokens": 1}, contended=True)
    stamp.stamp(table)
    stored = read_peaks(host_fingerprint().fingerprint_id, tmp_path)
    assert stored is not None and stored.disturbed == "taken while the job was contended"
    assert load_peaks(stored.fingerprint_id, tmp_path) is None


def test_unreadable_or_foreign_files_are_measured_again(tmp_path: Path) -> None:
    path = peaks_path("abc", tmp_path)
    path.write_text("{ not json")
    assert load_peaks("abc", tmp_path) is None
    path.write_text(json.dumps({"fingerprint_id": "other"}))
    assert load_peaks("abc", tmp_path) is None


def test_peaks_are_stamped_on_every_row(tmp_path: Path) -> None:
    fp = host_fingerprint()
    peaks = host_peaks(fp, tmp_path, copy_mib=4, matmul_sizes=(64,), repeats=2)
    table = job_table({"native": {"seconds": [1.0, 2.0]}, "affine": {"seconds": [1.5]}}, params={"tokens": 1})
    stamped = with_peaks(table, peaks)
    assert stamped.schema == table.schema and stamped.schema.metadata == table.schema.metadata
    assert stamped["peak_copy_gb_s"].to_pylist() == [peaks.copy_gb_s] * 3
    assert stamped["peak_tflop_s"].to_pylist() == [peaks.tflop_s] * 3
    assert with_peaks(table, None) is table


def test_every_row_of_a_real_job_carries_the_hosts_peaks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Through `run_job`: the probes run inside the job's window and stamp every row."""
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
    t0 = dt.datetime.now(dt.UTC)
    table = run_job(job, fp)
    stored = read_peaks(fp.fingerprint_id)
    assert stored is not None and stored.measured_at >= t0 and set(table["status"].to_pylist()) == {"ok"}
    assert set(table["peak_copy_gb_s"].to_pylist()) == {stored.copy_gb_s}
    assert set(table["peak_tflop_s"].to_pylist()) == {stored.tflop_s}


@pytest.mark.cuda
@pytest.mark.skipif(not mx.cuda.is_available(), reason="needs MLX's CUDA backend (an NVIDIA GPU)")
def test_on_cuda_the_drivers_device_copy_is_the_copy_peak() -> None:
    """On CUDA the driver's device-to-device copy beats MLX's `x + 1` (BENCHMARKS.md)."""
    probe = peaks_mod.measure_copy(2048, repeats=5)
    assert "cuda memcpy DtoD" in probe.candidates
    assert probe.candidates["cuda memcpy DtoD"] > probe.candidates["mlx x+1"]
    assert probe.method == "cuda memcpy DtoD"
