"""NVFP4 decode GEMV (M = 1..8 rows) as a custom CUDA kernel, with its pure-MLX twin.

`gemv_nvfp4(x, w, scales, global_scale)` computes `x @ dequant(w)^T` for weights in MLX's nvfp4
layout (`mx.quantize(..., mode="nvfp4")`: uint32 codes [N, K/8], uint8 E4M3 scales [N, K/16], an
optional MLX-convention global scale). On MLX's CUDA backend it runs `kernels/cuda/gemv_nvfp4.cu`
(tensor-core MMAs on weights decoded exactly to bf16, fp32 accumulation); elsewhere, or where the
shape is outside the kernel's limits, it runs `gemv_nvfp4_twin`, which computes the same function
with MLX array ops: the same exactly-dequantized weights and the same rounding of the activations
(to bf16, or to a bf16 pair hi + lo for float32/float16 inputs), so the two agree to fp32
summation order. The twin is the correctness check for the kernel and the fallback without CUDA.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from kernels.cuda import CudaKernelSource, compiled_kernel, cuda_backend_available
from kernels.nvfp4 import E2M1_VALUES, MLX_GLOBAL_SCALE_DIVISOR, decode_e4m3

GEMV_SOURCE = CudaKernelSource(body_file="gemv_nvfp4.cu", inputs=("x", "w", "scales", "gsv"), outputs=("y",))
MAX_ROWS = 8  # the MMA's column count: M <= 8 activation rows per call
# Largest relative error (against a float64 reference) of the kernel and the twin: bf16 activations
# give about 2e-3; hi + lo pairs (float32/float16 inputs) about 1e-5 plus the output's rounding.
TOLERANCE = {"bfloat16": 1e-2, "float16": 2e-3, "float32": 1e-4}

_E2M1 = mx.array(E2M1_VALUES)
_E4M3 = mx.array(decode_e4m3(np.arange(256, dtype=np.uint8)))


@dataclass(frozen=True)
class GemvConfig:
    """Launch shape: warps per 16-row block (they split K), code loads in flight per warp, and
    whether the E4M3 scales go through the hardware conversion (sm_89+) or integer bit tricks."""

    warps: int = 2
    unroll: int = 3
    cvt_scales: bool = False


# Measured on the H200 (benchmarks/gpu_kernels.py, BENCHMARKS.md): the fastest of 6 launch shapes at
# M=1 (used for M <= 4) and at M=8 (used above) on the decode shape; other shapes take DEFAULT_CONFIG.
TUNED_CONFIGS: dict[tuple[int, int, int], GemvConfig] = {
    (m, 21504, 5376): GemvConfig(4, 2) if m <= 4 else GemvConfig(2, 3) for m in range(1, MAX_ROWS + 1)
}
DEFAULT_CONFIG = GemvConfig()


def kernel_supports(m: int, n: int, k: int) -> str | None:
    """Why the CUDA kernel cannot take this shape, or None when it can."""
    if not 1 <= m <= MAX_ROWS:
        return f"M={m} is outside 1..{MAX_ROWS}"
    if n % 16:
        return f"N={n} is not a multiple of 16"
    if k % 32:
        return f"K={k} is not a multiple of 32"
    return None


@functools.cache
def _constant_multiplier(global_scale: float | None) -> mx.array:
    value = 1.0 if global_scale is None else float(global_scale) / MLX_GLOBAL_SCALE_DIVISOR
    out = mx.array([value], dtype=mx.float32)
    mx.eval(out)
    return out


def _global_multiplier(global_scale: mx.array | float | None) -> mx.array:
    """global_scale / 2688 as a float32 [1] (ones without); a Python number's is built once."""
    if not isinstance(global_scale, mx.array):
        return _constant_multiplier(global_scale)
    return global_scale.astype(mx.float32).reshape(-1)[:1] / MLX_GLOBAL_SCALE_DIVISOR


def dequantize_exact(w: mx.array, scales: mx.array) -> mx.array:
    """NVFP4 codes and E4M3 scales -> float32 weights [..., K], exactly (no global scale)."""
    shifts = mx.arange(0, 32, 4, dtype=mx.uint32)
    codes = (w[..., None] >> shifts) & mx.array(0xF, dtype=mx.uint32)
    codes = codes.reshape(*w.shape[:-1], w.shape[-1] * 8)
    values = mx.take(_E2M1, codes)
    per_group = mx.take(_E4M3, scales.astype(mx.uint32))
    grouped = values.reshape(*scales.shape, 16) * per_group[..., None]
    return grouped.reshape(values.shape)


def activations_as_kernel_sees_them(x: mx.array) -> mx.array:
    """x rounded as the kernel rounds it, in float32: bf16, or a bf16 pair hi + lo for wider types."""
    hi = x.astype(mx.bfloat16).astype(mx.float32)
    if x.dtype == mx.bfloat16:
        return hi
    lo = (x.astype(mx.float32) - hi).astype(mx.bfloat16).astype(mx.float32)
    return hi + lo


def gemv_nvfp4_twin(
    x: mx.array, w: mx.array, scales: mx.array, global_scale: mx.array | float | None = None
) -> mx.array:
    """The kernel's function in MLX ops: `x @ dequant(w)^T * global_scale / 2688`, fp32 accumulate."""
    weights = dequantize_exact(w, scales)
    y = activations_as_kernel_sees_them(x) @ weights.T
    return (y * _global_multiplier(global_scale)).astype(x.dtype)


def gemv_nvfp4_cuda(
    x: mx.array,
    w: mx.array,
    scales: mx.array,
    global_scale: mx.array | float | None = None,
    config: GemvConfig | None = None,
) -> mx.array:
    """The CUDA kernel (MLX's CUDA backend only); `kernel_supports` must accept the shape."""
    m, k = x.shape
    n = w.shape[0]
    reason = kernel_supports(m, n, k)
    if reason is not None:
        raise ValueError(f"gemv_nvfp4 kernel: {reason}")
    cfg = config or TUNED_CONFIGS.get((m, n, k), DEFAULT_CONFIG)
    launch = _launcher(m, n, k, x.dtype, cfg)
    return launch(x, w, scales, _global_multiplier(global_scale))


@functools.cache
def _launcher(m: int, n: int, k: int, dtype: mx.Dtype, cfg: GemvConfig) -> Callable[..., mx.array]:
    """The kernel call for one shape, traced once by `mx.compile`: later calls replay the traced
    graph instead of re-assembling the kernel source in Python and C++ (tens of microseconds a
    call, more than the kernel itself takes at decode sizes)."""
    kernel = compiled_kernel(GEMV_SOURCE)
    template: list[tuple[str, int | bool | mx.Dtype]] = [
        ("T", dtype),
        ("N", n),
        ("K", k),
        ("M", m),
        ("WARPS", cfg.warps),
        ("UNROLL", cfg.unroll),
        ("SPLIT", dtype != mx.bfloat16),
        ("CVT_SCALES", cfg.cvt_scales),
    ]

    def launch(x: mx.array, w: mx.array, scales: mx.array, gsv: mx.array) -> mx.array:
        (y,) = kernel(
            inputs=[x, w, scales, gsv],
            template=template,
            grid=(n // 16 * 32 * cfg.warps, 1, 1),
            threadgroup=(32 * cfg.warps, 1, 1),
            output_shapes=[(m, n)],
            output_dtypes=[dtype],
        )
        return y

    return mx.compile(launch) if COMPILE_LAUNCH else launch


COMPILE_LAUNCH = True  # False: assemble the kernel call afresh every call (the benchmark compares)


def gemv_nvfp4(
    x: mx.array,
    w: mx.array,
    scales: mx.array,
    global_scale: mx.array | float | None = None,
    config: GemvConfig | None = None,
) -> mx.array:
    """`x[M, K] @ dequant(w)^T`: the CUDA kernel where it applies, else the MLX twin."""
    if cuda_backend_available() and kernel_supports(x.shape[0], w.shape[0], x.shape[1]) is None:
        return gemv_nvfp4_cuda(x, w, scales, global_scale, config)
    return gemv_nvfp4_twin(x, w, scales, global_scale)


def route(m: int, n: int, k: int) -> str:
    """What `gemv_nvfp4` runs for this shape here (recorded in a row's `route`)."""
    if cuda_backend_available() and kernel_supports(m, n, k) is None:
        return "cuda_kernel(gemv_nvfp4_mma)"
    return "mlx-twin(dequantize_exact @ x)"


def build_seconds(x: mx.array, w: mx.array, scales: mx.array, global_scale: float | None) -> float:
    """Compile (first call) and run once; the seconds it took, which a job records as build time."""
    start = time.perf_counter()
    mx.eval(gemv_nvfp4(x, w, scales, global_scale))
    return time.perf_counter() - start
