"""NVFP4 prefill GEMM (M > 8 rows) as a custom CUDA kernel, with its pure-MLX twin.

`gemm_nvfp4(x, w, scales, global_scale)` computes `x @ dequant(w)^T` (times MLX's
`global_scale / 2688` where one is given) for weights in MLX's nvfp4 layout (uint32 codes
[N, K/8], uint8 E4M3 scales [N, K/16]) and bfloat16 or float16 activations. On MLX's CUDA backend
(sm_89+: the kernel converts E4M3 scales in hardware) it runs `kernels/cuda/gemm_nvfp4.cu`: tiles
of x and of the packed weights stream through a cp.async ring in shared memory, the codes are
decoded exactly into the tensor cores' 16-bit type on the fly (E4M3 group scale applied), and
mma.sync m16n8k16 accumulates in fp32; the global scale is one multiply in the epilogue. No
dequantized copy of the weights ever exists in device memory. Launch shapes are the named
variants of `kernels.cuda.gemm_layout` (by default `gemm_layout.variant_for(M)`, which the
environment can override).

Elsewhere, or where a shape or dtype is outside the kernel's limits, it runs `gemm_nvfp4_twin`:
the same function in MLX ops (exactly dequantized weights, x as given, fp32 products), the
kernel's correctness check and the fallback. Kernel and twin agree to fp32 summation order.
Hopper's own warpgroup MMA (wgmma) needs an `sm_90a` build, which MLX 0.32's `mx.fast.cuda_kernel`
does not make (it compiles for `sm_90`): the `wgmma` variants are built by `kernels.cuda.nvrtc`
(the machine's NVRTC through ctypes) and loaded by `mx.fast.precompiled_cuda_kernel`, on compute
capability 9.0 exactly (what sm_90a code runs on).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable

import mlx.core as mx

from kernels import gemv_nvfp4
from kernels.cuda import (
    HEADER_FILE,
    CudaKernelSource,
    compiled_kernel,
    cuda_backend_available,
    cuda_device,
    nvrtc,
    precompiled_launch,
    single_output_launch,
)
from kernels.cuda.gemm_layout import VARIANTS, GemmConfig, variant_for
from kernels.gemv_nvfp4 import (
    SIGNATURE,
    TOLERANCE,
    dequantize_exact,
    dtype_name,
    global_multiplier,
    kernel_multiplier,
)

GEMM_SOURCE = CudaKernelSource(
    body_file="gemm_nvfp4.cu",
    inputs=("x", "w", "scales", "gsv"),
    outputs=("y",),
    headers=(HEADER_FILE, "gemm_nvfp4.cuh"),
)
# the register-sourced kernel (`gemm_layout` variants with `rs`): the same inputs, output and header
GEMM_RS_SOURCE = CudaKernelSource(
    body_file="gemm_nvfp4_rs.cu", inputs=GEMM_SOURCE.inputs, outputs=GEMM_SOURCE.outputs, headers=GEMM_SOURCE.headers
)
MIN_ROWS = 9  # below, the decode GEMV (kernels.gemv_nvfp4) is the kernel for the job
DTYPES = ("bfloat16", "float16")
__all__ = ["DTYPES", "MIN_ROWS", "TOLERANCE", "gemm_nvfp4", "gemm_nvfp4_cuda", "gemm_nvfp4_twin", "route"]


@functools.cache
def wgmma_runs_here() -> bool:
    """Whether this device runs the `wgmma` variants (compute capability 9.0 and an NVRTC to build
    sm_90a code): the library's default rule takes them then, else the portable one."""
    device = cuda_device()
    return device is not None and device.compute_capability == (9, 0) and nvrtc.library() is not None


def library_variant(m: int) -> str:
    """The variant the library launches for M = m on this device (`gemm_layout.variant_for`)."""
    return variant_for(m, wgmma_runs_here())


@functools.cache
def kernel_supports(m: int, n: int, k: int, dtype: str, variant: str | None = None) -> str | None:
    """Why the CUDA kernel at `variant` (default: the library's for M) cannot take this call here,
    or None when it can (cached: the answer depends on the shape and the device only)."""
    name = variant or library_variant(m)
    if name not in VARIANTS:
        return f"unknown GEMM variant {name!r}"
    if m < 1:
        return f"M={m}"
    if dtype not in DTYPES:
        return f"{dtype} activations (the GEMM takes {' or '.join(DTYPES)})"
    cfg = VARIANTS[name]
    reason = cfg.reason(n, k)
    if reason is not None:
        return reason
    device = cuda_device()
    if device is None:
        return "no CUDA device"
    if device.compute_capability < (8, 9):
        return f"compute capability {device.compute_capability} has no E4M3 conversion (needs 8.9)"
    if cfg.wgmma and device.compute_capability != (9, 0):
        return f"{name}: wgmma code (sm_90a) runs on compute capability 9.0 only, not {device.compute_capability}"
    if cfg.wgmma and nvrtc.library() is None:
        return f"{name}: no NVRTC library to build sm_90a code (set {nvrtc.NVRTC_ENV})"
    if cfg.smem_bytes() > device.max_shared_per_block:
        allowed = device.max_shared_per_block
        return f"{name} needs {cfg.smem_bytes()} bytes of shared memory per block, the device allows {allowed}"
    return None


def gemm_nvfp4_twin(
    x: mx.array, w: mx.array, scales: mx.array, global_scale: mx.array | float | None = None
) -> mx.array:
    """The kernel's function in MLX ops: `x @ dequant(w)^T * global_scale / 2688`, fp32 products."""
    return twin_scaled(x, w, scales, global_multiplier(global_scale))


def twin_scaled(x: mx.array, w: mx.array, scales: mx.array, multiplier: mx.array) -> mx.array:
    """`gemm_nvfp4_twin` given the multiplier as the kernels take it (its first element is used)."""
    weights = dequantize_exact(w, scales)
    y = x.astype(mx.float32) @ weights.T
    return (y * multiplier[:1]).astype(x.dtype)


def gemm_nvfp4_cuda(
    x: mx.array,
    w: mx.array,
    scales: mx.array,
    global_scale: mx.array | float | None = None,
    variant: str | None = None,
    poison: bool = False,
    gsv: mx.array | None = None,
) -> mx.array:
    """The CUDA kernel (MLX's CUDA backend only) at `variant` (default: the library's for M);
    `poison` fills the output with NaN before the kernel runs (checks that every element is
    written); `gsv`: as in `kernels.gemv_nvfp4.gemv_nvfp4`, the multiplier computed once."""
    m, k = x.shape
    n = w.shape[0]
    name = variant or library_variant(m)
    reason = kernel_supports(m, n, k, dtype_name(x.dtype), name)
    if reason is not None:
        raise ValueError(f"gemm_nvfp4 kernel: {reason}")
    mult = gsv if gsv is not None else kernel_multiplier(global_scale)
    return _launcher(m, n, k, x.dtype, name, poison)(x, w, scales, mult)


def launcher(m: int, n: int, k: int, dtype: mx.Dtype) -> Callable[..., mx.array]:
    """The library variant's kernel call for one shape, `(x, w, scales, multiplier) -> y` (its
    support already checked by `kernel_supports`)."""
    return _launcher(m, n, k, dtype, library_variant(m), False)


@functools.cache
def _launcher(m: int, n: int, k: int, dtype: mx.Dtype, name: str, poison: bool) -> Callable[..., mx.array]:
    """The kernel call for one shape (see kernels.gemv_nvfp4). M is read by the kernel from x's
    shape, so every M shares one NVRTC build per (N, K, dtype, variant). Our NVRTC build where
    NVRTC is here (`build_image`, kept in the disk cache for the next process), else MLX's JIT,
    which compiles again in every process."""
    cfg: GemmConfig = VARIANTS[name]
    grid = (cfg.blocks(m, n) * cfg.threads, 1, 1)
    threads = (cfg.threads, 1, 1)
    init = float("nan") if poison else None
    arch = build_arch(cfg)
    if arch is not None:
        fn, image = build_image(n, k, dtype_name(dtype), name, arch)
        smem = cfg.smem_bytes()
        compiled = gemv_nvfp4.COMPILE_LAUNCH
        return precompiled_launch(
            fn, image, grid, threads, (m, n), dtype, shared_memory=smem, scalars=[m], compiled=compiled, init_value=init
        )
    kernel = compiled_kernel(GEMM_SOURCE, cfg.smem_bytes())
    template: list[tuple[str, int | bool | mx.Dtype]] = [("T", dtype)]
    template += cfg.template(n, k, dtype == mx.float16).items()
    return single_output_launch(
        kernel, template, grid, threads, (m, n), dtype, compiled=gemv_nvfp4.COMPILE_LAUNCH, init_value=init
    )


def source_of(cfg: GemmConfig) -> CudaKernelSource:
    """The kernel body a variant runs: gemm_nvfp4.cu, or gemm_nvfp4_rs.cu for the register-sourced ones."""
    return GEMM_RS_SOURCE if cfg.rs else GEMM_SOURCE


def build_arch(cfg: GemmConfig) -> str | None:
    """The target our NVRTC builds a variant for (sm_90a for wgmma), or None: MLX's JIT builds it."""
    return "sm_90a" if cfg.wgmma else nvrtc.device_arch()


def build_image(n: int, k: int, dtype: str, name: str, arch: str) -> tuple[str, bytes]:
    """(kernel name, module image) of a variant for N, K and dtype on `arch` (sm_90a for the wgmma
    variants), built by NVRTC once per host (`nvrtc.build`: kept in the disk cache)."""
    cfg = VARIANTS[name]
    template = (("T", dtype), *cfg.template(n, k, dtype == "float16").items())
    return nvrtc.build(source_of(cfg), (("x", dtype), *SIGNATURE), (("y", dtype),), template, arch, cfg.launch_bound)


def gemm_nvfp4(
    x: mx.array,
    w: mx.array,
    scales: mx.array,
    global_scale: mx.array | float | None = None,
    variant: str | None = None,
    gsv: mx.array | None = None,
) -> mx.array:
    """`x[M, K] @ dequant(w)^T`: the CUDA kernel where it applies, else the MLX twin."""
    m, k = x.shape
    if cuda_backend_available() and kernel_supports(m, w.shape[0], k, dtype_name(x.dtype), variant) is None:
        return gemm_nvfp4_cuda(x, w, scales, global_scale, variant, gsv=gsv)
    return gemm_nvfp4_twin(x, w, scales, global_scale)


def route(m: int, n: int, k: int, dtype: str = "bfloat16", variant: str | None = None) -> str:
    """What `gemm_nvfp4(..., variant=variant)` runs for this shape here (a row's `route`)."""
    name = variant or library_variant(m)
    if cuda_backend_available() and kernel_supports(m, n, k, dtype, name) is None:
        return nvrtc.route(f"gemm_nvfp4:{name}", build_arch(VARIANTS[name]))
    return "mlx-twin(x @ dequantize_exact)"


def build_seconds(x: mx.array, w: mx.array, scales: mx.array, global_scale: float | None) -> float:
    """Compile (first call) and run once; the seconds it took (a job's build time)."""
    start = time.perf_counter()
    mx.eval(gemm_nvfp4(x, w, scales, global_scale))
    return time.perf_counter() - start
