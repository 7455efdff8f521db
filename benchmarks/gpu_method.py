"""How the device script measures: device facts, the copy ceiling, time per call, errors.

Used by `benchmarks.gpu_kernels` (see its docstring for the method); everything here runs on the
machine being measured.
"""

from __future__ import annotations

import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import mlx.core as mx
import numpy as np

from kernels import nvfp4

L2_BYTES = 60e6
REPEATS = 7
L1, L2 = 20, 200  # GEMV calls per eval: time per call = slope between the two


def log(msg: str) -> None:
    """A progress line on stderr (the reply carries the tail of the output)."""
    print(msg, file=sys.stderr, flush=True)


def device_facts() -> dict[str, Any]:
    """GPU name and driver (nvidia-smi), MLX version and device, Python."""
    facts: dict[str, Any] = {
        "mlx_version": str(getattr(mx, "__version__", "unknown")),
        "mlx_device": str(mx.default_device()),
        "backend": "cuda" if mx.cuda.is_available() else "cpu",
        "python": platform.python_version(),
    }
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.max.sm", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=20, check=True,
        ).stdout.strip().splitlines()[0]  # fmt: skip
        name, driver, memory, clock = (s.strip() for s in out.split(","))
        facts.update(gpu=name, gpu_driver=driver, gpu_memory=memory, sm_clock_max=clock)
    except (OSError, subprocess.SubprocessError, ValueError, IndexError) as exc:
        facts["gpu_error"] = str(exc)
    return facts


def copy_ceiling_gb_s(nbytes: int = 4 << 30) -> dict[str, Any]:
    """Device-to-device copy bandwidth, bytes read + written, through PyTorch (else CuPy, else MLX)."""
    try:
        import torch  # optional: PyTorch where installed, else the next way

        src = torch.empty(nbytes, dtype=torch.uint8, device="cuda").random_(0, 255)
        dst = torch.empty_like(src)
        times = []
        for i in range(13):
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src)
            stop.record()
            stop.synchronize()
            if i >= 3:
                times.append(start.elapsed_time(stop) / 1e3)
        del src, dst
        torch.cuda.empty_cache()
        t = statistics.median(times)
        return {"gb_s": 2 * nbytes / t / 1e9, "bytes": nbytes, "seconds": t, "via": f"torch {torch.__version__}"}
    except Exception as exc:  # no torch: MLX's own copy (a lower bound of the ceiling)
        log(f"copy through torch failed ({exc}); using MLX")
    a = mx.random.randint(0, 255, (nbytes // 4,), dtype=mx.uint32)
    mx.eval(a)
    times = []
    for _ in range(10):
        mx.synchronize()
        t0 = time.perf_counter()
        mx.eval(a + 0)
        mx.synchronize()
        times.append(time.perf_counter() - t0)
    t = statistics.median(times)
    return {"gb_s": 2 * nbytes / t / 1e9, "bytes": nbytes, "seconds": t, "via": "mlx a + 0"}


def per_call_seconds(call: Callable[[int], Any], l1: int, l2: int, repeats: int = REPEATS) -> dict[str, float]:
    """Time per call: L calls (call(i) for i < L) in one eval, slope between L1 and L2, median."""

    def batch(calls: int) -> float:
        mx.synchronize()
        t0 = time.perf_counter()
        mx.eval([call(i) for i in range(calls)])
        mx.synchronize()
        return time.perf_counter() - t0

    batch(l2)  # warm-up (and first-call compile)
    slopes, plain = [], []
    for _ in range(repeats):
        t1, t2 = batch(l1), batch(l2)
        slopes.append((t2 - t1) / (l2 - l1))
        plain.append(t2 / l2)
    return {
        "seconds": statistics.median(slopes),
        "seconds_min": min(slopes),
        "seconds_max": max(slopes),
        "seconds_whole_eval": statistics.median(plain),
        "calls": l2,
    }


def rel_error(got: np.ndarray, ref: np.ndarray) -> float:
    """||got - ref|| / ||ref|| in float64; inf where got is not finite."""
    got = np.asarray(got, dtype=np.float64)
    if not np.all(np.isfinite(got)):
        return float("inf")
    denom = float(np.linalg.norm(ref))
    return float(np.linalg.norm(got - ref)) / max(denom, 1e-300)


def to_np(a: mx.array) -> np.ndarray:
    """An MLX array as float64 NumPy."""
    return np.array(a.astype(mx.float32)).astype(np.float64)


def dequant_rows(wq: mx.array, scales: mx.array, rows: np.ndarray) -> np.ndarray:
    """float64 weights of some rows, by the NumPy reference (kernels.nvfp4)."""
    codes = nvfp4.unpack_codes(np.array(wq[mx.array(rows)]))
    return nvfp4.dequantize(codes, np.array(scales[mx.array(rows)]))
