"""Each host's own measured limits: a copy-bandwidth probe and a matrix-throughput probe (MLX).

Results from an M1 Ultra, a gfx1151 and an NVIDIA GPU only compare fairly as fractions of what each
device can do. The probes run under the job's GPU lock, on the device the job runs on, are kept
as a small JSON file per host fingerprint on the worker host (`$ORCHESTRATE_PEAKS_DIR`, default
`~/.orchestrate/peaks/`), and are stamped onto every row of every job (`peak_copy_gb_s`,
`peak_tflop_s`), so the dataset carries them to the head.

* Copy: the best copy the host offers, bytes read plus written: MLX's elementwise `x + 1` and
  its copy kernel (`mx.array(x)`) always; the driver's device-to-device `cuMemcpyDtoD` with MLX's
  CUDA backend (on a Hopper card MLX's `x + 1` stays well below a device copy, so shares of a
  peak taken from it would read too high; BENCHMARKS.md); NumPy's `copyto` (memcpy) where MLX runs
  on the CPU. The fastest wins and its name is kept (`copy_method`, each candidate's rate beside).
* Matrix: dense square products in the backend's usual compute type (bfloat16 on GPUs, float32
  on MLX's CPU backend, which is slow in 16-bit types) at several sizes, each timed `repeats`
  times; TFLOP/s = 2 n^3 / seconds, the best of all (`matmul_n` the size that reached it, each
  size's best beside in `matmul_candidates`). One size is not enough on a GPU: a small product
  leaves the device partly idle, and a large one, run back to back, draws the board to its power
  cap and lowers its clocks, so a workload of short bursts beat a probe of one large size. The
  peak is the device's best, and a workload must not beat it (BENCHMARKS.md).

They are probed again when the fingerprint changes (a new driver, OS, MLX or host is a new
fingerprint), when the stored probe was disturbed (its repeats spread by more than `UNSTEADY`,
or the job it ran in was flagged contended: a CPU probe taken on a busy machine read so low
that a kernel showed at "3140 % of peak"), and on request: `ORCHESTRATE_REPROBE_PEAKS=1` in the
worker's environment (an inventory host's `env`) probes again once per run. A disturbed record
is merged with the next probe (each rate the best either saw: contention only lowers a rate),
and a host that stays busy keeps the best of `MAX_PROBES` probes instead of probing every job.

On the CPU backend these measure MLX as shipped (the Linux wheel's reference BLAS), not the
processor's limits; the row's `blas` column says which.
"""

from __future__ import annotations

import ctypes
import datetime as dt
import json
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
from pydantic import BaseModel, ConfigDict, Field

from workers.contract import HostFingerprint, Status
from workers.files import write_atomic
from workers.job import phases

ENV_DIR = "ORCHESTRATE_PEAKS_DIR"
ENV_REPROBE = "ORCHESTRATE_REPROBE_PEAKS"
PEAKS_VERSION = 3
UNSTEADY = 1.25  # slowest / fastest repeat of a quiet probe stays under this
MAX_PROBES = 3  # a host that stays busy keeps the best of this many disturbed probes
# Probe sizes per backend: large enough to leave the caches and keep the GPU busy, small enough
# to take seconds, not minutes, on MLX's CPU backend. On a GPU the products are cheap (tens of
# milliseconds each at most), so many repeats of every size cost well under a second; the copy
# is as large as it is because smaller copies stay below what the driver's copy reaches.
SIZES: dict[str, dict[str, Any]] = {
    "cpu": {"copy_mib": 64, "matmul_sizes": (256, 512), "dtype": "float32", "matmul_repeats": 5},
    "gpu": {"copy_mib": 2048, "matmul_sizes": (4096, 8192, 12288, 16384), "dtype": "bfloat16", "matmul_repeats": 20},
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
    matmul_n: int  # the size that reached `tflop_s`
    dtype: str
    repeats: int
    measured_at: dt.datetime
    copy_method: str = ""
    copy_candidates: dict[str, float] = Field(default_factory=dict)  # method -> best GB/s
    matmul_candidates: dict[str, float] = Field(default_factory=dict)  # size n -> best TFLOP/s
    disturbed: str | None = None  # why this probe cannot be trusted (then it is probed again)
    probes: int = 1  # probes merged into this record (each rate is the best any of them saw)
    run_id: str = ""

    def merged(self, earlier: HostPeaks | None) -> HostPeaks:
        """This probe with an earlier one of the same fingerprint: each rate the best either saw
        (contention only ever lowers a rate, so the best is the closer to the ceiling)."""
        if earlier is None or earlier.fingerprint_id != self.fingerprint_id or earlier.version != self.version:
            return self
        copy = self if self.copy_gb_s >= earlier.copy_gb_s else earlier
        matmul = self if self.tflop_s >= earlier.tflop_s else earlier
        return self.model_copy(
            update={
                "copy_gb_s": copy.copy_gb_s,
                "copy_method": copy.copy_method,
                "copy_candidates": copy.copy_candidates,
                "tflop_s": matmul.tflop_s,
                "matmul_n": matmul.matmul_n,
                "matmul_candidates": matmul.matmul_candidates,
                "probes": earlier.probes + 1,
            }
        )


def _timings(fn: Callable[[], Any], repeats: int, wait: Callable[[], None]) -> list[float]:
    fn()  # warm-up: allocation, JIT
    wait()
    out = []
    for _ in range(repeats):
        wait()
        t0 = time.perf_counter()
        fn()
        wait()
        out.append(time.perf_counter() - t0)
    return out


def _mlx_timings(make: Callable[[], Any], repeats: int) -> list[float]:
    import mlx.core as mx  # optional heavy dependency: the head stamps no peaks

    return _timings(lambda: mx.eval(make()), repeats, mx.synchronize)


def _best_seconds(fn: Any, repeats: int) -> float:
    return min(_mlx_timings(fn, repeats))


class CopyProbe(BaseModel):
    """The copy candidates' best rates, the winner, and how steady its repeats were."""

    gb_s: float
    method: str
    candidates: dict[str, float]
    spread: float  # slowest / fastest repeat of the winner


def _numpy_copy(nbytes: int, repeats: int) -> list[float]:
    src = np.ones(nbytes, dtype=np.uint8)
    dst = np.empty_like(src)
    return _timings(lambda: np.copyto(dst, src), repeats, lambda: None)


def _cuda_memcpy(nbytes: int, repeats: int) -> list[float] | None:
    """The driver's device-to-device copy (`cuMemcpyDtoD`) on MLX's device, through libcuda."""
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    dev, ctx = ctypes.c_int(), ctypes.c_void_p()
    src, dst = ctypes.c_uint64(), ctypes.c_uint64()
    if cuda.cuInit(0) or cuda.cuDeviceGet(ctypes.byref(dev), 0):
        return None
    if cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev):
        return None
    try:
        if cuda.cuCtxPushCurrent_v2(ctx):
            return None
        try:
            if cuda.cuMemAlloc_v2(ctypes.byref(src), ctypes.c_size_t(nbytes)):
                return None
            if cuda.cuMemAlloc_v2(ctypes.byref(dst), ctypes.c_size_t(nbytes)):
                cuda.cuMemFree_v2(src)
                return None
            try:
                cuda.cuMemsetD8_v2(src, ctypes.c_ubyte(1), ctypes.c_size_t(nbytes))
                return _timings(
                    lambda: cuda.cuMemcpyDtoD_v2(dst, src, ctypes.c_size_t(nbytes)), repeats, cuda.cuCtxSynchronize
                )
            finally:
                cuda.cuMemFree_v2(src)
                cuda.cuMemFree_v2(dst)
        finally:
            cuda.cuCtxPopCurrent_v2(ctypes.byref(ctypes.c_void_p()))
    finally:
        cuda.cuDevicePrimaryCtxRelease_v2(dev)


def measure_copy(copy_mib: int, repeats: int = 5) -> CopyProbe:
    """Best copy bandwidth in GB/s (read + write) over every copy this host offers (module docstring)."""
    import mlx.core as mx  # optional heavy dependency: the head stamps no peaks

    nbytes = copy_mib * 2**20
    x = mx.zeros((nbytes // 4,), dtype=mx.float32)
    mx.eval(x)
    timings: dict[str, list[float] | None] = {
        "mlx x+1": _mlx_timings(lambda: x + 1.0, repeats),
        "mlx copy": _mlx_timings(lambda: mx.array(x), repeats),
    }
    if mx.default_device() == mx.cpu:
        timings["numpy copyto"] = _numpy_copy(nbytes, repeats)
    elif mx.cuda.is_available():
        timings["cuda memcpy DtoD"] = _cuda_memcpy(nbytes, repeats)
    rates = {name: 2 * nbytes / min(t) / 1e9 for name, t in timings.items() if t}
    best = max(rates, key=lambda name: rates[name])
    winner = timings[best] or [1.0]
    return CopyProbe(gb_s=rates[best], method=best, candidates=rates, spread=max(winner) / min(winner))


class MatmulProbe(BaseModel):
    """The best dense-product rate over the probed sizes, the size that reached it, and each size's best."""

    tflop_s: float
    n: int
    candidates: dict[str, float]  # size n -> best TFLOP/s


def measure_tflop_s(matmul_sizes: Sequence[int], dtype: str, repeats: int = 5) -> MatmulProbe:
    """Best dense matrix-product rate in TFLOP/s over n x n x n products in `dtype`, one per size."""
    import mlx.core as mx  # optional heavy dependency: the head stamps no peaks

    dt_ = getattr(mx, dtype)
    rates: dict[str, float] = {}
    for n in matmul_sizes:
        ka, kb = mx.random.split(mx.random.key(n))
        a = mx.random.normal((n, n), key=ka).astype(dt_)
        b = mx.random.normal((n, n), key=kb).astype(dt_)
        mx.eval(a, b)
        rates[str(n)] = 2 * n**3 / _best_seconds(lambda a=a, b=b: a @ b, repeats) / 1e12
        del a, b  # the next size's operands replace these (16384^2 bfloat16: 0.5 GiB each)
    best = max(rates, key=lambda n: rates[n])
    return MatmulProbe(tflop_s=rates[best], n=int(best), candidates=rates)


def measure_peaks(
    fingerprint: HostFingerprint,
    *,
    copy_mib: int | None = None,
    matmul_sizes: Sequence[int] | None = None,
    dtype: str | None = None,
    repeats: int = 5,
    matmul_repeats: int | None = None,
    run_id: str = "",
) -> HostPeaks:
    """Run both probes on MLX's default device (sizes and the products' repeats default per device
    kind, see `SIZES`; `repeats` is the copies', whose spread also tells a disturbed probe)."""
    import mlx.core as mx  # optional heavy dependency: the head stamps no peaks

    # The device MLX really runs on decides the sizes, not the fingerprint's label.
    sizes = SIZES["gpu" if mx.default_device() == mx.gpu else "cpu"]
    copy_mib = copy_mib or sizes["copy_mib"]
    matmul_sizes = matmul_sizes or sizes["matmul_sizes"]
    dtype = dtype or sizes["dtype"]
    copy = measure_copy(copy_mib, repeats)
    matmul = measure_tflop_s(matmul_sizes, dtype, matmul_repeats or sizes["matmul_repeats"])
    disturbed = None
    if copy.spread > UNSTEADY:
        disturbed = f"copy repeats spread {copy.spread:.2f}x (quiet: under {UNSTEADY}x)"
    return HostPeaks(
        fingerprint_id=fingerprint.fingerprint_id,
        backend=fingerprint.backend,
        copy_gb_s=copy.gb_s,
        tflop_s=matmul.tflop_s,
        copy_bytes=copy_mib * 2**20,
        matmul_n=matmul.n,
        dtype=dtype,
        repeats=repeats,
        measured_at=dt.datetime.now(dt.UTC),
        copy_method=copy.method,
        copy_candidates=copy.candidates,
        matmul_candidates=matmul.candidates,
        disturbed=disturbed,
        run_id=run_id,
    )


def peaks_dir() -> Path:
    """`$ORCHESTRATE_PEAKS_DIR`, else `~/.orchestrate/peaks`."""
    return Path(os.environ.get(ENV_DIR) or Path.home() / ".orchestrate" / "peaks")


def peaks_path(fingerprint_id: str, directory: Path | None = None) -> Path:
    """The JSON file of one fingerprint's peaks."""
    return (directory or peaks_dir()) / f"peaks-{fingerprint_id}.json"


def read_peaks(fingerprint_id: str, directory: Path | None = None) -> HostPeaks | None:
    """The stored record of a fingerprint, as it is (None: absent, unreadable or another version)."""
    try:
        peaks = HostPeaks.model_validate(json.loads(peaks_path(fingerprint_id, directory).read_text()))
    except (OSError, ValueError):
        return None
    ok = peaks.version == PEAKS_VERSION and peaks.fingerprint_id == fingerprint_id
    return peaks if ok and peaks.copy_gb_s > 0 and peaks.tflop_s > 0 else None


def load_peaks(fingerprint_id: str, directory: Path | None = None, *, run_id: str = "") -> HostPeaks | None:
    """The stored peaks of a fingerprint when they can be used as they are, else None: absent,
    unreadable, of another version, disturbed (fewer than `MAX_PROBES` times so far), or
    re-probing was asked for (`ORCHESTRATE_REPROBE_PEAKS`) and they are not from this run."""
    peaks = read_peaks(fingerprint_id, directory)
    if peaks is None or (peaks.disturbed is not None and peaks.probes < MAX_PROBES):
        return None
    if os.environ.get(ENV_REPROBE, "").strip() not in ("", "0") and (not run_id or peaks.run_id != run_id):
        return None
    return peaks


def save_peaks(peaks: HostPeaks, directory: Path | None = None) -> Path:
    """Store peaks atomically (`workers.files.write_atomic`) beside the others."""
    return write_atomic(peaks_path(peaks.fingerprint_id, directory), peaks.model_dump_json(indent=1))


def host_peaks(
    fingerprint: HostFingerprint, directory: Path | None = None, *, run_id: str = "", **sizes: Any
) -> HostPeaks:
    """This host's peaks: the stored ones for its fingerprint, else measured now and stored.

    Call it while holding the GPU lock (the probes load the device like a job does).
    """
    stored = load_peaks(fingerprint.fingerprint_id, directory, run_id=run_id)
    if stored is not None:
        return stored
    peaks = measure_peaks(fingerprint, run_id=run_id, **sizes)
    earlier = read_peaks(fingerprint.fingerprint_id, directory)
    if earlier is not None and earlier.disturbed is not None:  # a busy host: keep the best seen so far
        peaks = peaks.merged(earlier)
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


Dispatch = Callable[[Any, Any, Any], Status]


class PeakStamp:
    """Measures (or loads) the host's peaks inside a job's GPU-lock window and stamps its rows.

    `workers.job.runner` wraps the job's dispatch with `wrap` (so the probes run under the lock, at
    most once per fingerprint and host) and passes the finished table through `stamp`. A probe
    that fails leaves the peak columns empty; it never fails the job. A probe taken in a job
    whose rows came out contended is stored as disturbed, so the next job probes again.
    """

    def __init__(self, fingerprint: HostFingerprint, directory: Path | None = None) -> None:
        self.fingerprint = fingerprint
        self.directory = directory
        self.peaks: HostPeaks | None = None
        self.error: str | None = None
        self.probed_here = False

    def wrap(self, dispatch: Dispatch) -> Dispatch:
        """`dispatch`, preceded by the peak probes the first time it runs."""

        def run(job: Any, rows: Any, context: Any) -> Status:
            if self.peaks is None and self.error is None:
                try:
                    started = dt.datetime.now(dt.UTC)
                    with phases.span("peaks"):
                        run_id = str(getattr(job, "run_id", ""))
                        self.peaks = host_peaks(self.fingerprint, self.directory, run_id=run_id)
                    self.probed_here = self.peaks.measured_at >= started
                except Exception as exc:  # a probe must never fail the job it rides on
                    self.error = f"{type(exc).__name__}: {exc}"
            return dispatch(job, rows, context)

        return run

    def stamp(self, table: pa.Table) -> pa.Table:
        """The job's table with the peaks filled in (unchanged when none were measured)."""
        if self.peaks is not None and self.probed_here and table.num_rows and any(table["contended"].to_pylist()):
            self.peaks = self.peaks.model_copy(update={"disturbed": "taken while the job was contended"})
            try:
                save_peaks(self.peaks, self.directory)
            except OSError as exc:  # never fail the job for it
                self.error = f"{type(exc).__name__}: {exc}"
        return with_peaks(table, self.peaks)
