"""NVFP4 sorted-gather MoE prefill, expert-batched, as a custom CUDA kernel with its MLX twin.

`moe_gather_nvfp4(x, w, scales, global_scale, lhs_indices, rhs_indices)` computes, for every routed
row r (rows sorted by expert, `rhs_indices` ascending),

    y[r] = x[lhs_indices[r]] @ dequant(w[rhs_indices[r]])^T * global_scale[rhs_indices[r]] / 2688

and zero for rows routed past the last expert (`rhs_indices[r] >= E`), the second seed's
contract. `w` [E, N, K/8] uint32 and `scales` [E, N, K/16] uint8 are MLX's nvfp4 layout;
`global_scale` [E] is MLX's per-expert convention (about each expert's absolute maximum) or None.

On MLX's CUDA backend this runs `kernels/cuda/moe_nvfp4.cu`: one block per (expert, 16 x WARPS
weight rows) finds its expert's run of sorted rows by binary search and reads those weights once
per run of up to 8 x NT rows, feeding each decoded code word to NT tensor-core MMAs. Elsewhere it
runs `moe_gather_nvfp4_twin` (the same function, expert by expert, on exactly dequantized
weights), the kernel's correctness check and its fallback.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import numpy as np

from kernels import gemv_nvfp4
from kernels.cuda import (
    CudaKernelSource,
    compiled_kernel,
    cuda_backend_available,
    nvrtc,
    off_small_pool,
    precompiled_launch,
    single_output_launch,
)
from kernels.gemv_nvfp4 import TOLERANCE, activations_as_kernel_sees_them, dequantize_exact
from kernels.nvfp4 import MLX_GLOBAL_SCALE_DIVISOR
from kernels.registry import ArmPath, bound_path

MOE_SOURCE = CudaKernelSource(
    body_file="moe_nvfp4.cu",
    inputs=("x", "lhs", "rhs", "w", "scales", "gsv"),
    outputs=("y",),
)
# the inputs after x, with their dtypes, in call order
SIGNATURE = (("lhs", "uint32"), ("rhs", "uint32"), ("w", "uint32"), ("scales", "uint8"), ("gsv", "float32"))
__all__ = ["TOLERANCE", "MoeConfig", "kernel_supports", "moe_custom_path", "moe_gather_nvfp4", "moe_gather_nvfp4_twin"]


@dataclass(frozen=True)
class MoeConfig:
    """Launch shape: warps (16 weight rows each) per block, code loads in flight, 8-row MMA tiles."""

    warps: int = 4
    unroll: int = 1
    n_tiles: int = 4


DEFAULT_CONFIG = MoeConfig()  # the fastest of 6 launch shapes on a Hopper GPU (benchmarks/gpu_kernels.py)


def kernel_supports(n: int, k: int) -> str | None:
    """Why the CUDA kernel cannot take these weights, or None when it can."""
    if n % 16:
        return f"N={n} is not a multiple of 16"
    if k % 32:
        return f"K={k} is not a multiple of 32"
    return None


def expert_multipliers(global_scale: mx.array | None, experts: int) -> mx.array:
    """Per-expert factor of the products: global_scale / 2688, or ones without a global scale."""
    if global_scale is None:
        return mx.ones((experts,), dtype=mx.float32)
    return global_scale.astype(mx.float32).reshape(experts) / MLX_GLOBAL_SCALE_DIVISOR


def moe_gather_nvfp4_twin(
    x: mx.array,
    w: mx.array,
    scales: mx.array,
    global_scale: mx.array | None,
    lhs_indices: mx.array,
    rhs_indices: mx.array,
) -> mx.array:
    """The kernel's function in MLX ops: expert by expert over the sorted runs, one matmul each on
    exactly dequantized weights; rows routed past the last expert are zero.

    Plain matmuls, not `mx.gather_mm`: on a Hopper GPU, MLX 0.32.4's CUDA `gather_mm` (sorted, one row
    per batch) returned wrong products (relative difference 1.4 against this kernel and against
    `gather_qmm`, which agree with the float64 reference), while its CPU backend was right.

    Raises:
        ValueError: if `rhs_indices` is not sorted ascending.
    """
    experts = w.shape[0]
    rhs = np.array(rhs_indices.astype(mx.uint32)).astype(np.int64)
    if np.any(np.diff(rhs) < 0):
        raise ValueError("moe_gather_nvfp4: rhs_indices must be sorted ascending")
    bounds = np.searchsorted(rhs, np.arange(experts + 1), side="left")
    mult = expert_multipliers(global_scale, experts)
    rows = activations_as_kernel_sees_them(x)[lhs_indices.astype(mx.uint32)]
    pieces = []
    for e in range(experts):
        lo, hi = int(bounds[e]), int(bounds[e + 1])
        if hi > lo:
            pieces.append((rows[lo:hi] @ dequantize_exact(w[e], scales[e]).T) * mult[e])
    past = rhs.size - int(bounds[experts])
    pieces.append(mx.zeros((past, w.shape[1]), dtype=mx.float32))
    return mx.concatenate(pieces, axis=0).astype(x.dtype)


def moe_gather_nvfp4_cuda(
    x: mx.array,
    w: mx.array,
    scales: mx.array,
    global_scale: mx.array | None,
    lhs_indices: mx.array,
    rhs_indices: mx.array,
    config: MoeConfig | None = None,
) -> mx.array:
    """The CUDA kernel (MLX's CUDA backend only); `kernel_supports` must accept the weights."""
    experts, n, k_words = w.shape
    k = k_words * 8
    reason = kernel_supports(n, k)
    if reason is not None:
        raise ValueError(f"moe_gather_nvfp4 kernel: {reason}")
    cfg = config or DEFAULT_CONFIG
    launch = _launcher(experts, n, k, rhs_indices.size, x.dtype, cfg)
    lhs, rhs = off_small_pool(lhs_indices.astype(mx.uint32)), off_small_pool(rhs_indices.astype(mx.uint32))
    return launch(x, lhs, rhs, w, scales, off_small_pool(expert_multipliers(global_scale, experts)))


@functools.cache
def _launcher(experts: int, n: int, k: int, rows: int, dtype: mx.Dtype, cfg: MoeConfig) -> Callable[..., mx.array]:
    """The kernel call for one shape, traced once by `mx.compile` (see kernels.gemv_nvfp4): our NVRTC
    build where NVRTC is here (`nvrtc.build`, kept in the disk cache, so a fresh process such as a
    cold model sample loads it instead of compiling it), else MLX's per-process JIT."""
    blocks = -(-(n // 16) // cfg.warps)
    consts: list[tuple[str, int | bool]] = [("N", n), ("K", k), ("E", experts), ("R", rows)]
    consts += [("WARPS", cfg.warps), ("UNROLL", cfg.unroll), ("NT", cfg.n_tiles), ("SPLIT", dtype != mx.bfloat16)]
    grid = (blocks * 32 * cfg.warps, experts + 1, 1)
    threads = (32 * cfg.warps, 1, 1)
    arch = nvrtc.device_arch()
    if arch is not None:
        name = gemv_nvfp4.dtype_name(dtype)
        fn, image = nvrtc.build(MOE_SOURCE, (("x", name), *SIGNATURE), (("y", name),), (("T", name), *consts), arch)
        return precompiled_launch(
            fn, image, grid, threads, (rows, n), dtype, shared_memory=0, scalars=[], compiled=gemv_nvfp4.COMPILE_LAUNCH
        )
    template: list[tuple[str, int | bool | mx.Dtype]] = [("T", dtype), *consts]
    kernel = compiled_kernel(MOE_SOURCE)
    return single_output_launch(kernel, template, grid, threads, (rows, n), dtype, compiled=gemv_nvfp4.COMPILE_LAUNCH)


def moe_gather_nvfp4(
    x: mx.array,
    w: mx.array,
    scales: mx.array,
    global_scale: mx.array | None,
    lhs_indices: mx.array,
    rhs_indices: mx.array,
    config: MoeConfig | None = None,
) -> mx.array:
    """Sorted-gather NVFP4 MoE: the CUDA kernel where it applies, else the MLX twin."""
    if cuda_backend_available() and kernel_supports(w.shape[1], w.shape[2] * 8) is None:
        return moe_gather_nvfp4_cuda(x, w, scales, global_scale, lhs_indices, rhs_indices, config)
    return moe_gather_nvfp4_twin(x, w, scales, global_scale, lhs_indices, rhs_indices)


def route(n: int, k: int) -> str:
    """What `moe_gather_nvfp4` runs for these weights here (recorded in a row's `route`)."""
    if cuda_backend_available() and kernel_supports(n, k) is None:
        return nvrtc.route("moe_nvfp4_expert_batched", nvrtc.device_arch())
    return "mlx-twin(expert-by-expert matmul on dequantize_exact)"


def moe_custom_path(wq: Any, scales: Any, global_scales: Any, dtype_name: str, shape: tuple[int, int, int]) -> ArmPath:
    """The moe-gather case's `custom-sorted` arm: the sorted route of `kernels.moe.run_sorted`
    (pairs sorted by expert, rows scattered back, all inside the call) with the expert-batched
    kernel (MLX twin without CUDA) in place of `gather_qmm`.

    Args:
        wq, scales, global_scales: the experts' packed codes, E4M3 scales and global scales.
        dtype_name: the activations' dtype.
        shape: (tokens, top_k, hidden); the first call at this shape (NVRTC compile) is the build.
    """

    def make(w: tuple[Any, ...]) -> Callable[..., Any]:
        wq_, scales_, *gs = w

        def run(x: Any, indices: Any) -> Any:
            t, top_k = indices.shape
            flat = indices.flatten()
            order = mx.argsort(flat)
            inverse = mx.argsort(order)
            lhs = (order // top_k).astype(mx.uint32)
            y = moe_gather_nvfp4(x, wq_, scales_, gs[0] if gs else None, lhs, flat[order])
            return y[inverse].reshape(t, top_k, -1)

        return run

    weights = (wq, scales) if global_scales is None else (wq, scales, global_scales)
    tokens, top_k, hidden = shape
    t0 = time.perf_counter()
    zeros = (mx.zeros((tokens, hidden), dtype=getattr(mx, dtype_name)), mx.zeros((tokens, top_k), dtype=mx.uint32))
    mx.eval(make(weights)(*zeros))
    return bound_path(
        make,
        weights,
        tolerance=TOLERANCE[dtype_name],
        route=route(wq.shape[1], hidden) + ",sorted",
        build_seconds=time.perf_counter() - t0,
    )
