"""Each host's own measured limits: a copy-bandwidth probe and a matrix-throughput probe (MLX).

Results from an M1 Ultra, a gfx1151 and an H200 only compare fairly as fractions of what each
device can do. The probes run once per host fingerprint (under the job's GPU lock, on the
device the job runs on), are kept as a small JSON file per fingerprint on the worker host
(`$ORCHESTRATE_PEAKS_DIR`, default `~/.orchestrate/peaks/`), and are stamped onto every row of
every job (`peak_copy_gb_s`, `peak_tflop_s`), so the dataset carries them to the head.

* Copy: `y = x + 1` over a large float32 array -- it reads and writes every byte once, so
  GB/s = 2 x bytes / seconds; the best of several timed calls.
* Matrix: a dense square product in the backend's usual compute type (bfloat16 on GPUs, float32
  on MLX's CPU backend, which is slow in 16-bit types); TFLOP/s = 2 n^3 / seconds, best of several.

On the CPU backend these measure MLX as shipped (the Linux wheel's reference BLAS), not the
processor's limits; the row's `blas` column says which.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow as pa
from pydantic import BaseModel, ConfigDict

from workers import phases
from workers.contract import HostFingerprint

ENV_DIR = "ORCHESTRATE_PEAKS_DIR"
PEAKS_VERSION = 1
# Probe sizes per backend: large enough to leave the caches and keep the GPU busy, small enough
# to take seconds, not minutes, on MLX's CPU backend.
SIZES: dict[str, dict[str, Any]] = {
    "cpu": {"copy_mib": 64, "matmul_n": 512, "dtype": "float32"},
    # H200 (MLX 0.32.4, CUDA): 1 GiB copy 3.3 TB/s, 4 GiB 3.7 TB/s (PyTorch's copy: 4.2 TB/s);
    # bf16 n=8192 703 TFLOP/s, n=16384 753 TFLOP/s (PyTorch: about 790).
    "gpu": {"copy_mib": 2048, "matmul_n": 16384, "dtype": "bfloat16"},
}


class HostPeaks(BaseModel):
    """What one host measured as its limits, and how."""

    model_config = ConfigDict(extra="forbid")

    version: int = PEAKS_VERSION
    fingerprint_id: str
    backend: str
    copy_gb_s: float
    tflop_s: float
    copy_bytes: int
    matmul_n: int
    dtype: str
    repeats: int
    measured_at: dt.datetime


def _best_seconds(fn: Any, repeats: int) -> float:
    import mlx.core as mx

    mx.eval(fn())  # warm-up: allocation, JIT
    mx.synchronize()
    best = float("inf")
    for _ in range(repeats):
        mx.synchronize()
        t0 = time.perf_counter()
        mx.eval(fn())
        mx.synchronize()
        best = min(best, time.perf_counter() - t0)
    return best


def measure_copy_gb_s(copy_mib: int, repeats: int = 5) -> float:
    """Best copy bandwidth in GB/s: `x + 1` over `copy_mib` MiB of float32 (read + write)."""
    import mlx.core as mx

    n = copy_mib * 2**20 // 4
    x = mx.zeros((n,), dtype=mx.float32)
    mx.eval(x)
    seconds = _best_seconds(lambda: x + 1.0, repeats)
    return 2 * n * 4 / seconds / 1e9


def measure_tflop_s(matmul_n: int, dtype: str, repeats: int = 5) -> float:
    """Best dense matrix-product rate in TFLOP/s for an n x n x n product in `dtype`."""
    import mlx.core as mx

    dt_ = getattr(mx, dtype)
    key = mx.random.key(0)
    ka, kb = mx.random.split(key)
    a = mx.random.normal((matmul_n, matmul_n), key=ka).astype(dt_)
    b = mx.random.normal((matmul_n, matmul_n), key=kb).astype(dt_)
    mx.eval(a, b)
    seconds = _best_seconds(lambda: a @ b, repeats)
    return 2 * matmul_n**3 / seconds / 1e12


def measure_peaks(
    fingerprint: HostFingerprint,
    *,
    copy_mib: int | None = None,
    matmul_n: int | None = None,
    dtype: str | None = None,
    repeats: int = 5,
) -> HostPeaks:
    """Run both probes on MLX's default device (sizes default per device kind, see `SIZES`)."""
    import mlx.core as mx

    # The device MLX really runs on decides the sizes, not the fingerprint's label.
    sizes = SIZES["gpu" if mx.default_device() == mx.gpu else "cpu"]
    copy_mib = copy_mib or sizes["copy_mib"]
    matmul_n = matmul_n or sizes["matmul_n"]
    dtype = dtype or sizes["dtype"]
    return HostPeaks(
        fingerprint_id=fingerprint.fingerprint_id,
        backend=fingerprint.backend,
        copy_gb_s=measure_copy_gb_s(copy_mib, repeats),
        tflop_s=measure_tflop_s(matmul_n, dtype, repeats),
        copy_bytes=copy_mib * 2**20,
        matmul_n=matmul_n,
        dtype=dtype,
        repeats=repeats,
        measured_at=dt.datetime.now(dt.UTC),
    )


def peaks_dir() -> Path:
    """`$ORCHESTRATE_PEAKS_DIR`, else `~/.orchestrate/peaks`."""
    return Path(os.environ.get(ENV_DIR) or Path.home() / ".orchestrate" / "peaks")


def peaks_path(fingerprint_id: str, directory: Path | None = None) -> Path:
    """The JSON file of one fingerprint's peaks."""
    return (directory or peaks_dir()) / f"peaks-{fingerprint_id}.json"


def load_peaks(fingerprint_id: str, directory: Path | None = None) -> HostPeaks | None:
    """The stored peaks of a fingerprint, or None (absent, unreadable or of another version)."""
    path = peaks_path(fingerprint_id, directory)
    try:
        peaks = HostPeaks.model_validate(json.loads(path.read_text()))
    except (OSError, ValueError):
        return None
    ok = peaks.version == PEAKS_VERSION and peaks.fingerprint_id == fingerprint_id
    return peaks if ok and peaks.copy_gb_s > 0 and peaks.tflop_s > 0 else None


def save_peaks(peaks: HostPeaks, directory: Path | None = None) -> Path:
    """Store peaks atomically (temp file + rename) beside the others."""
    path = peaks_path(peaks.fingerprint_id, directory)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as fh:
            fh.write(peaks.model_dump_json(indent=1))
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def host_peaks(fingerprint: HostFingerprint, directory: Path | None = None, **sizes: Any) -> HostPeaks:
    """This host's peaks: the stored ones for its fingerprint, else measured now and stored.

    Call it while holding the GPU lock (the probes load the device like a job does).
    """
    stored = load_peaks(fingerprint.fingerprint_id, directory)
    if stored is not None:
        return stored
    peaks = measure_peaks(fingerprint, **sizes)
    save_peaks(peaks, directory)
    return peaks


def with_peaks(table: pa.Table, peaks: HostPeaks | None) -> pa.Table:
    """`table` with `peak_copy_gb_s` and `peak_tflop_s` filled in on every row."""
    if peaks is None or table.num_rows == 0:
        return table
    for name, value in (("peak_copy_gb_s", peaks.copy_gb_s), ("peak_tflop_s", peaks.tflop_s)):
        i = table.schema.get_field_index(name)
        table = table.set_column(i, table.schema.field(i), pa.array([value] * table.num_rows, pa.float64()))
    return table


Dispatch = Callable[[Any, Any, Any], str]


class PeakStamp:
    """Measures (or loads) the host's peaks inside a job's GPU-lock window and stamps its rows.

    `workers.runner` wraps the job's dispatch with `wrap` (so the probes run under the lock, at
    most once per fingerprint and host) and passes the finished table through `stamp`. A probe
    that fails leaves the peak columns empty; it never fails the job.
    """

    def __init__(self, fingerprint: HostFingerprint, directory: Path | None = None) -> None:
        self.fingerprint = fingerprint
        self.directory = directory
        self.peaks: HostPeaks | None = None
        self.error: str | None = None

    def wrap(self, dispatch: Dispatch) -> Dispatch:
        """`dispatch`, preceded by the peak probes the first time it runs."""

        def run(job: Any, rows: Any, context: Any) -> str:
            if self.peaks is None and self.error is None:
                try:
                    with phases.span("peaks"):
                        self.peaks = host_peaks(self.fingerprint, self.directory)
                except Exception as exc:  # a probe must never fail the job it rides on
                    self.error = f"{type(exc).__name__}: {exc}"
            return dispatch(job, rows, context)

        return run

    def stamp(self, table: pa.Table) -> pa.Table:
        """The job's table with the peaks filled in (unchanged when none were measured)."""
        return with_peaks(table, self.peaks)
