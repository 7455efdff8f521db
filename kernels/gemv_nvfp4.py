"""NVFP4 decode GEMV (M = 1..8 rows) as a custom CUDA kernel, with its pure-MLX twin.

`gemv_nvfp4(x, w, scales, global_scale)` computes `x @ dequant(w)^T` for weights in MLX's nvfp4
layout (`mx.quantize(..., mode="nvfp4")`: uint32 codes [N, K/8], uint8 E4M3 scales [N, K/16], an
optional MLX-convention global scale). On MLX's CUDA backend it runs one of two kernels, both
tensor-core MMAs on exactly dequantized weights with fp32 accumulation:

* `kernels/cuda/gemv_nvfp4.cu` ("stream"): sm_89+, bfloat16/float16 activations, K % 128 == 0,
  N % 8 == 0. Persistent (one block per multiprocessor), weights streamed through shared memory
  by cp.async in 256-byte row runs, decoded to f16 through the hardware E4M3 conversion;
* `kernels/cuda/gemv_nvfp4_ksplit.cu` ("ksplit"): everything else the CUDA path takes (float32
  activations, K % 32, older GPUs): bf16 decode by integer bit tricks, warps splitting K.

Elsewhere, or where the shape is outside both kernels' limits, it runs `gemv_nvfp4_twin`, which
computes the same function with MLX array ops: the same exactly-dequantized weights and the same
rounding of the activations (to bf16, or to a bf16 pair hi + lo for float32/float16 inputs), so
kernel and twin agree to fp32 summation order. (The stream kernel carries bfloat16 activations as
f16 times one power of two chosen from max |x|: exact except for values more than 2^39 below max
|x|, an error far below the output's bf16 rounding.) The twin is the correctness check for the
kernels and the fallback without CUDA. (On CUDA, MLX runs the twin's float32 matmul on TF32
tensor cores, 2e-4 off: for float32 activations there the float64 reference is the yardstick.)
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from kernels.cuda import (
    CudaKernelSource,
    compiled_kernel,
    cuda_backend_available,
    cuda_device,
    nvrtc,
    off_small_pool,
    precompiled_launch,
    single_output_launch,
)
from kernels.cuda.layout import stream_smem_bytes
from kernels.nvfp4 import E2M1_VALUES, MLX_GLOBAL_SCALE_DIVISOR, decode_e4m3

GEMV_SOURCE = CudaKernelSource(body_file="gemv_nvfp4.cu", inputs=("x", "w", "scales", "gsv"), outputs=("y",))
KSPLIT_SOURCE = CudaKernelSource(body_file="gemv_nvfp4_ksplit.cu", inputs=("x", "w", "scales", "gsv"), outputs=("y",))
SIGNATURE = (("w", "uint32"), ("scales", "uint8"), ("gsv", "float32"))  # after x, in call order
MAX_ROWS = 8  # the MMA's column count: M <= 8 activation rows per call
# Largest relative error (against a float64 reference) of the kernel and the twin: bf16 activations
# give about 2e-3; hi + lo pairs (float32/float16 inputs) about 1e-5 plus the output's rounding.
TOLERANCE = {"bfloat16": 1e-2, "float16": 2e-3, "float32": 1e-4}


@functools.cache
def _decode_tables() -> tuple[mx.array, mx.array]:
    """The E2M1 and E4M3 lookup tables, made on first use: importing this module allocates nothing
    on the device, so a fork server may preload it and its children start with no MLX memory."""
    return mx.array(E2M1_VALUES), mx.array(decode_e4m3(np.arange(256, dtype=np.uint8)))


@dataclass(frozen=True)
class GemvConfig:
    """Launch shape of one of the two CUDA kernels.

    kernel "stream" (gemv_nvfp4.cu): `warps` per block, `chunk` steps of 128 codes per copied
    chunk (2 or 4), `stages` chunks in each warp's ring, `blocks` (0: one per multiprocessor).
    kernel "ksplit" (gemv_nvfp4_ksplit.cu): `warps` splitting K per 16-row block, `unroll` steps of
    code loads in flight per warp, `cvt_scales`: E4M3 scales through the hardware conversion.
    """

    kernel: str = "stream"
    warps: int = 12
    chunk: int = 4
    stages: int = 2
    blocks: int = 0
    unroll: int = 3
    cvt_scales: bool = False

    def __str__(self) -> str:
        if self.kernel == "stream":
            blocks = self.blocks or "SMs"
            return f"stream(warps={self.warps}, chunk={self.chunk}, stages={self.stages}, blocks={blocks})"
        return f"ksplit(warps={self.warps}, unroll={self.unroll}, cvt_scales={self.cvt_scales})"


# Measured on a Hopper GPU (benchmarks/gemv_lab.py, BENCHMARKS.md): the stream kernel's fastest shape at
# M = 1, 4 and 8 on the decode shape is 12 warps, 4-step chunks, 2 stages (8, 10, 16 and 20 warps,
# 3 stages, 2-step chunks and 8-step chunks of 512-byte runs at 6-10 warps were slower); the
# K-split kernel's were 4 warps x 2 steps (M <= 4) and 2 x 3 (M > 4).
STREAM_CONFIG = GemvConfig()
KSPLIT_CONFIGS = {True: GemvConfig("ksplit", warps=4, unroll=2), False: GemvConfig("ksplit", warps=2, unroll=3)}
STREAM_DTYPES = ("bfloat16", "float16")


def stream_launch(m: int, n: int, k: int, cfg: GemvConfig, sms: int) -> tuple[int, int, int]:
    """(blocks, warps, dynamic shared bytes) for a shape: blocks never outnumber the 8-row units,
    and every warp gets at least one chunk (the kernel's split-tile bookkeeping relies on it)."""
    blocks = min(cfg.blocks or sms, n // 8)
    rows_min = 8 * ((n // 8) // blocks)
    units_min = -(-rows_min // 16) * -(-(k // 128) // cfg.chunk)
    warps = max(1, min(cfg.warps, units_min))
    return blocks, warps, stream_smem_bytes(m, k, warps, cfg.chunk, cfg.stages)


def stream_constants(
    m: int, n: int, k: int, cfg: GemvConfig, sms: int, xf16: bool
) -> tuple[dict[str, int | bool], int]:
    """The stream kernel's template constants after T, in the order MLX declares them, and its
    dynamic shared memory bytes (the launch of `stream_launch`)."""
    blocks, warps, smem = stream_launch(m, n, k, cfg, sms)
    consts: dict[str, int | bool] = {"N": n, "K": k, "M": m, "WARPS": warps, "BLOCKS": blocks}
    consts |= {"CHUNK": cfg.chunk, "STAGES": cfg.stages, "XF16": xf16}
    return consts, smem


def _shape_reason(m: int, n: int, k: int) -> str | None:
    if not 1 <= m <= MAX_ROWS:
        return f"M={m} is outside 1..{MAX_ROWS}"
    if n % 8:
        return f"N={n} is not a multiple of 8"
    if k % 32:
        return f"K={k} is not a multiple of 32"
    return None


@functools.cache
def stream_supports(m: int, n: int, k: int, dtype: str, cfg: GemvConfig = STREAM_CONFIG) -> str | None:
    """Why the stream kernel at launch shape `cfg` cannot take this call here, or None when it can
    (cached: the answer depends on the shape and the device only, and a decode call is too short
    to ask twice)."""
    reason = _shape_reason(m, n, k)
    if reason is not None:
        return reason
    if dtype not in STREAM_DTYPES:
        return f"{dtype} activations (the stream kernel takes {' or '.join(STREAM_DTYPES)})"
    if k % 128:
        return f"K={k} is not a multiple of 128"
    device = cuda_device()
    if device is None:
        return "no CUDA device"
    if device.compute_capability < (8, 9):
        return f"compute capability {device.compute_capability} has no E4M3 conversion (needs 8.9)"
    if cfg.chunk not in (2, 4):
        return f"chunk={cfg.chunk} (the stream kernel takes 2 or 4)"
    blocks, warps, smem = stream_launch(m, n, k, cfg, device.multiprocessors)
    tiles = ((n // 8 + blocks - 1) // blocks + 1) // 2 + 1  # the kernel's MAXT
    need = smem + 4 * (warps + tiles)  # dynamic, then the static per-warp maxima and tile counters
    if need > device.max_shared_per_block:
        allowed = device.max_shared_per_block
        return f"needs {need} bytes of shared memory per block at {cfg}, the device allows {allowed}"
    return None


@functools.cache
def ksplit_supports(m: int, n: int, k: int) -> str | None:
    """Why the K-split kernel cannot take this shape, or None when it can."""
    reason = _shape_reason(m, n, k)
    if reason is None and n % 16:
        return f"N={n} is not a multiple of 16"
    return reason


@functools.cache
def kernel_supports(m: int, n: int, k: int, dtype: str = "bfloat16") -> str | None:
    """Why neither CUDA kernel can take this call, or None when one can."""
    if stream_supports(m, n, k, dtype) is None:
        return None
    return ksplit_supports(m, n, k)


def config_supports(cfg: GemvConfig, m: int, n: int, k: int, dtype: str) -> str | None:
    """Why `cfg`'s kernel cannot take this call here, or None when it can."""
    return stream_supports(m, n, k, dtype, cfg) if cfg.kernel == "stream" else ksplit_supports(m, n, k)


@functools.cache
def choose_config(m: int, n: int, k: int, dtype: str, kernel: str | None = None) -> GemvConfig:
    """The launch shape `gemv_nvfp4` uses: the stream kernel where it applies, else K-split;
    `kernel="ksplit"` asks for the K-split kernel wherever the CUDA path runs."""
    if kernel != "ksplit" and stream_supports(m, n, k, dtype) is None:
        return STREAM_CONFIG
    return KSPLIT_CONFIGS[m <= 4]


@functools.cache
def _constant_multiplier(global_scale: float | None) -> mx.array:
    value = 1.0 if global_scale is None else float(global_scale) / MLX_GLOBAL_SCALE_DIVISOR
    out = mx.array([value], dtype=mx.float32)
    mx.eval(out)
    return out


@functools.cache
def _kernel_constant_multiplier(global_scale: float | None) -> mx.array:
    out = off_small_pool(_constant_multiplier(global_scale))
    mx.eval(out)
    return out


def kernel_multiplier(global_scale: mx.array | float | None) -> mx.array:
    """The multiplier as the kernels take it: a buffer outside MLX's small-buffer pool."""
    if not isinstance(global_scale, mx.array):
        return _kernel_constant_multiplier(global_scale)
    return off_small_pool(global_multiplier(global_scale))


def global_multiplier(global_scale: mx.array | float | None) -> mx.array:
    """global_scale / 2688 as a float32 [1] (ones without); a Python number's is built once."""
    if not isinstance(global_scale, mx.array):
        return _constant_multiplier(global_scale)
    return global_scale.astype(mx.float32).reshape(-1)[:1] / MLX_GLOBAL_SCALE_DIVISOR


def dequantize_exact(w: mx.array, scales: mx.array) -> mx.array:
    """NVFP4 codes and E4M3 scales -> float32 weights [..., K], exactly (no global scale)."""
    shifts = mx.arange(0, 32, 4, dtype=mx.uint32)
    codes = (w[..., None] >> shifts) & mx.array(0xF, dtype=mx.uint32)
    codes = codes.reshape(*w.shape[:-1], w.shape[-1] * 8)
    e2m1, e4m3 = _decode_tables()
    values = mx.take(e2m1, codes)
    per_group = mx.take(e4m3, scales.astype(mx.uint32))
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
    return twin_scaled(x, w, scales, global_multiplier(global_scale))


def twin_scaled(x: mx.array, w: mx.array, scales: mx.array, multiplier: mx.array) -> mx.array:
    """`gemv_nvfp4_twin` given the multiplier (global_scale / 2688) as the kernels take it: its
    first element is used, so `kernel_multiplier`'s padded buffer serves both."""
    weights = dequantize_exact(w, scales)
    y = activations_as_kernel_sees_them(x) @ weights.T
    return (y * multiplier[:1]).astype(x.dtype)


def gemv_nvfp4_cuda(
    x: mx.array,
    w: mx.array,
    scales: mx.array,
    global_scale: mx.array | float | None = None,
    config: GemvConfig | None = None,
) -> mx.array:
    """A CUDA kernel (MLX's CUDA backend only): `config`'s, or `choose_config`'s for the shape."""
    m, k = x.shape
    n = w.shape[0]
    dtype = _dtype_name(x)
    cfg = config or choose_config(m, n, k, dtype)
    reason = config_supports(cfg, m, n, k, dtype)
    if reason is not None:
        raise ValueError(f"gemv_nvfp4 {cfg.kernel} kernel: {reason}")
    return _launch(x, w, scales, global_scale, cfg)


def dtype_name(dtype: mx.Dtype) -> str:
    """MLX's dtype as the kernels and rows name it ("bfloat16")."""
    return str(dtype).removeprefix("mlx.core.")


def _dtype_name(x: mx.array) -> str:
    return dtype_name(x.dtype)


def _launch(
    x: mx.array,
    w: mx.array,
    scales: mx.array,
    global_scale: mx.array | float | None,
    cfg: GemvConfig,
    gsv: mx.array | None = None,
) -> mx.array:
    """Run `cfg`'s kernel, its support already checked (`gsv`: the precomputed multiplier)."""
    m, k = x.shape
    mult = gsv if gsv is not None else kernel_multiplier(global_scale)
    return launcher(m, w.shape[0], k, x.dtype, cfg)(x, w, scales, mult)


@functools.cache
def launcher(
    m: int, n: int, k: int, dtype: mx.Dtype, cfg: GemvConfig, lead: tuple[int, ...] = ()
) -> Callable[..., mx.array]:
    """The kernel call for one shape, `(x, w, scales, multiplier) -> y` (its support already checked),
    traced once by `mx.compile`: later calls replay the traced graph instead of re-assembling the
    kernel source in Python and C++ (tens of microseconds a call, more than the kernel itself takes
    at decode sizes). `lead`: the leading dimensions of x and y, whose product is `m` (default
    `(m,)`): the kernels read no shapes, so a decoder's `[1, 1, K]` needs no reshape around them."""
    template: list[tuple[str, int | bool]] = []
    out_shape = (*(lead or (m,)), n)
    if cfg.kernel == "stream":
        device = cuda_device()
        assert device is not None  # stream_supports checked
        consts, smem = stream_constants(m, n, k, cfg, device.multiprocessors, dtype == mx.float16)
        source = GEMV_SOURCE
        template += consts.items()
        threads = 32 * int(consts["WARPS"])
        grid = int(consts["BLOCKS"]) * threads
    else:
        source, smem = KSPLIT_SOURCE, 0
        template += [("N", n), ("K", k), ("M", m)]
        template += [("WARPS", cfg.warps), ("UNROLL", cfg.unroll), ("SPLIT", dtype != mx.bfloat16)]
        template += [("CVT_SCALES", cfg.cvt_scales)]
        grid, threads = n // 16 * 32 * cfg.warps, 32 * cfg.warps
    arch = nvrtc.device_arch()
    if arch is not None:  # our NVRTC build, from the disk cache after the first process (nvrtc.build)
        name = dtype_name(dtype)
        fn, cubin = nvrtc.build(source, (("x", name), *SIGNATURE), (("y", name),), (("T", name), *template), arch)
        return precompiled_launch(
            fn,
            cubin,
            (grid, 1, 1),
            (threads, 1, 1),
            out_shape,
            dtype,
            shared_memory=smem,
            scalars=[],
            compiled=COMPILE_LAUNCH,
        )
    kernel = compiled_kernel(source, smem)
    return single_output_launch(
        kernel,
        [("T", dtype), *template],
        (grid, 1, 1),
        (threads, 1, 1),
        out_shape,
        dtype,
        compiled=COMPILE_LAUNCH,
    )


COMPILE_LAUNCH = True  # False: assemble the kernel call afresh every call (the benchmark compares)


def gemv_nvfp4(
    x: mx.array,
    w: mx.array,
    scales: mx.array,
    global_scale: mx.array | float | None = None,
    config: GemvConfig | None = None,
    kernel: str | None = None,
    gsv: mx.array | None = None,
) -> mx.array:
    """`x[M, K] @ dequant(w)^T`: a CUDA kernel where one applies, else the MLX twin. `config`
    fixes the launch shape; `kernel="ksplit"` asks for the K-split kernel (default: the stream
    kernel where it applies); `gsv`, `kernel_multiplier(global_scale)` computed once by the
    caller, spares the kernels that small computation per call (the twin uses `global_scale`)."""
    m, k = x.shape
    n = w.shape[0]
    dtype = _dtype_name(x)
    cfg = config or choose_config(m, n, k, dtype, kernel)
    if cuda_backend_available() and config_supports(cfg, m, n, k, dtype) is None:
        return _launch(x, w, scales, global_scale, cfg, gsv)
    return gemv_nvfp4_twin(x, w, scales, global_scale)


def route(m: int, n: int, k: int, dtype: str = "bfloat16", kernel: str | None = None) -> str:
    """What `gemv_nvfp4(..., kernel=kernel)` runs for this shape here (a row's `route`)."""
    if cuda_backend_available():
        cfg = choose_config(m, n, k, dtype, kernel)
        if config_supports(cfg, m, n, k, dtype) is None:
            return nvrtc.route(f"gemv_nvfp4_{cfg.kernel}", nvrtc.device_arch())
    return "mlx-twin(dequantize_exact @ x)"


def build_seconds(x: mx.array, w: mx.array, scales: mx.array, global_scale: float | None) -> float:
    """Compile (first call) and run once; the seconds it took, which a job records as build time."""
    start = time.perf_counter()
    mx.eval(gemv_nvfp4(x, w, scales, global_scale))
    return time.perf_counter() - start
