"""Case `qmm`: y = x @ W^T with W in NVFP4, the MLP projection of a prefill (tokens > 1) or decode.

x is [tokens, k] in the case's dtype; W is [n, k], standard normal draws quantized to NVFP4 with
no global scale (`mx.quantized_matmul` takes none; a tensor scale is one more multiply after it),
both on the device from a key of the job's generator (`kernels.device_nvfp4`). Every arm is built
from those codes and scales, so every arm computes the same product up to its own rounding:

* `native`: `mx.quantized_matmul(mode="nvfp4")` on the packed codes and E4M3 scales.
* `affine`: the NVFP4-dequantized weights re-quantized to affine 4-bit, group 64 (the fallback an
  engine without NVFP4 uses), `mx.quantized_matmul(mode="affine")`.
* `dequant-gemm`: `mx.dequantize` to the dtype, then one matmul, both inside the timed call.
* `dense`: the NVFP4-dequantized weights held in the dtype, one matmul: the upper bound.
* `custom`: the hand-written kernels (`kernels.gemv_nvfp4` for tokens <= 8: its stream kernel
  where it applies, else its K-split kernel; above, the prefill GEMM `kernels.gemm_nvfp4` of
  issue 20 for bfloat16/float16, the expert-batched `kernels.moe_nvfp4` with one expert for
  float32 on CUDA; their MLX twins without CUDA).
* `custom-ksplit`: the same, with the GEMV's K-split kernel wherever the CUDA path runs (so a
  sweep compares the two GEMV kernels).
* `auto`: per shape, the fastest correct of native, dequant-gemm, custom and custom-ksplit,
  measured at build time (`kernels.dispatch`); its route names the choice.

Each arm's reference is the float64 NumPy product of x with the weights that arm really holds
(the NVFP4 reference dequantization for native and dequant-gemm, the affine dequantization for
affine, the dense weights for dense), so the relative error measures the kernel's arithmetic
alone. `tolerance` states how much of it each path and dtype may show, and why. Where the whole
float64 product would cost more than the measurement (over `kernels.checking.FULL_REFERENCE_MACS`
multiply-adds, or weights to decode on the host over `FULL_REFERENCE_WEIGHTS`: the seeds' shape at
any token count), a stratified subset of its rows and columns is checked instead (every 64-row and
21-column tile of the seeds' shape has checked elements), and only those rows of the weights are
read back and decoded on the host by the NumPy definition: the rows record what was checked
(`reference_subset`).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

import mlx.core as mx
import numpy as np

from kernels import activations, checking, device_nvfp4, dispatch, gemv_nvfp4, nvfp4
from kernels.dispatch import Reference as AutoReference
from kernels.nvfp4_linear import matmul_route, nvfp4_matmul
from kernels.product_reference import HostWeights, ProductReference, affine_decoder, float64_later
from kernels.registry import ArmPath, Workload, bound_path, check_point
from kernels.shapes import AFFINE_BITS, AFFINE_GROUP

MLX_DTYPES: dict[str, mx.Dtype] = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}
UNIT_ROUNDOFF = {"float32": 2.0**-24, "bfloat16": 2.0**-9, "float16": 2.0**-11}


def mlx_backend() -> str:
    """What MLX's default device really runs on: "cpu", "cuda" or "metal"."""
    if mx.default_device().type == mx.DeviceType.cpu:
        return "cpu"
    return "cuda" if mx.cuda.is_available() else "metal"


def tolerance(path: str, dtype: str, k: int, backend: str) -> float:
    """The largest relative error (Frobenius, against the float64 product) a path may show.

    Two terms, each an error model with a margin of about 2 over what was measured (float32,
    float16 and bfloat16 at k = 256..4096 on MLX's CPU backend):

    * rounding, 4 u: the output rounded to the dtype (RMS u/sqrt(3)) and the weights' scales
      rounded in the kernel. u is the dtype's unit roundoff (float32 2^-24, float16 2^-11,
      bfloat16 2^-9), except float32 on CUDA, where products may run on TF32 tensor cores
      (10-bit mantissa, u = 2^-11).
    * accumulation, c u_acc sqrt(k/16): a sum of k/16 group partials rounded at every step grows
      like sqrt(k). u_acc is the dtype's u where the sum is kept in the dtype: float32 always,
      and MLX's CPU quantized matmuls (`fp_qmm_t`, `_qmm_t` accumulate in T, so bfloat16 at
      k=4096 reaches 2e-2 native, 8e-2 affine); GPU kernels and BLAS accumulate in float32.
      c = 4 for affine (its bias term makes partial sums larger: 2.5x native's error), 2 otherwise.

    Seen on CUDA (a Hopper GPU, MLX 0.32.4) at the seeds' shape n=21504, k=5376 in bfloat16: native
    4.2e-3 at tokens=1 and 1.7e-3 at 512..16384 (tolerance 7.8e-3), affine 4.3e-3 / 2.0e-3;
    float32 dense and dequant-gemm 2.1e-4 (TF32; tolerance 2.0e-3) where native shows 1.1e-6.
    A wrong global scale, layout or expert gives a relative error near 1, far above all of these.
    """
    u = UNIT_ROUNDOFF[dtype]
    rounding_u = 2.0**-11 if dtype == "float32" and backend == "cuda" else u
    quantized = path not in ("dense", "dequant-gemm")
    in_dtype = dtype == "float32" or (backend == "cpu" and quantized)
    acc_u = u if in_dtype else UNIT_ROUNDOFF["float32"]
    c = 4.0 if path.startswith("affine") else 2.0
    return 4.0 * rounding_u + c * acc_u * math.sqrt(k / nvfp4.GROUP_SIZE)


def nvfp4_weights(n: int, k: int, rng: np.random.Generator) -> device_nvfp4.DeviceWeights:
    """W [n, k]: standard normal draws quantized to NVFP4 (no global scale), on the device."""
    return device_nvfp4.draw_weights((n, k), rng, device_nvfp4.normal())


def _timed_build(make: Callable[[], tuple[Any, ...]]) -> tuple[tuple[Any, ...], float]:
    t0 = time.perf_counter()
    arrays = make()
    mx.eval(*arrays)
    return arrays, time.perf_counter() - t0


Run = Callable[[mx.array], mx.array]


def native_run(w: tuple[mx.array, ...]) -> Run:
    """`mx.quantized_matmul(nvfp4)` over packed codes and E4M3 scales `w`."""
    wq, scales = w
    return lambda x: mx.quantized_matmul(x, wq, scales, transpose=True, mode="nvfp4")


def dequant_gemm_run(w: tuple[mx.array, ...]) -> Run:
    """`mx.dequantize(nvfp4)` to x's dtype, then one matmul, both inside the call."""
    wq, scales = w
    return lambda x: x @ mx.dequantize(wq, scales, mode="nvfp4", dtype=x.dtype).T


def affine_run(w: tuple[mx.array, ...]) -> Run:
    """`mx.quantized_matmul(affine, g64, 4 bits)` over (codes, scales, biases) `w`."""
    aq, scales, biases = w
    return lambda x: mx.quantized_matmul(
        x, aq, scales, biases, transpose=True, group_size=AFFINE_GROUP, bits=AFFINE_BITS, mode="affine"
    )


def dense_run(w: tuple[mx.array, ...]) -> Run:
    """One matmul with the dense weights `w`."""
    (wd,) = w
    return lambda x: x @ wd.T


def qmm_custom_path(
    wq: Any, scales: Any, m: int, n: int, k: int, dtype_name: str, kernel: str | None = None
) -> ArmPath:
    """The qmm case's `custom` arm on packed NVFP4 weights [n, k/8] and E4M3 scales [n, k/16]
    (`custom-ksplit`: `kernel="ksplit"`).

    `kernels.nvfp4_linear.nvfp4_matmul`: M <= 8, the decode GEMV kernel (the stream kernel where
    it applies, else K-split; K-split for `custom-ksplit`); larger M, the prefill GEMM
    (`kernels.gemm_nvfp4`, bfloat16 and float16 on sm_89+), or where it cannot run on CUDA
    (float32), the expert-batched MoE kernel with one expert. Without MLX's CUDA backend: the
    twins. The first call (NVRTC compile) is timed as the build.
    """

    def make(w: tuple[Any, ...]) -> Callable[..., Any]:
        wq_, scales_ = w
        return lambda x: nvfp4_matmul(x, wq_, scales_, kernel=kernel)

    route = matmul_route(m, n, k, dtype_name, kernel)
    dtype = getattr(mx, dtype_name)
    t0 = time.perf_counter()
    mx.eval(make((wq, scales))(mx.zeros((m, k), dtype=dtype)))
    build = time.perf_counter() - t0
    return bound_path(make, (wq, scales), tolerance=gemv_nvfp4.TOLERANCE[dtype_name], route=route, build_seconds=build)


def qmm_auto_path(
    wq: Any,
    scales: Any,
    params: tuple[int, int, int, str, str],
    make_inputs: Callable[[np.random.Generator], tuple[Any, ...]],
    reference: AutoReference,
) -> ArmPath:
    """The qmm case's `auto` arm: the fastest correct of native, dequant-gemm, custom and (where
    it is a different kernel) custom-ksplit.

    Args:
        wq, scales: the packed NVFP4 weights and E4M3 scales the case built.
        params: (m, n, k, dtype name, backend).
        make_inputs: the case's input generator.
        reference: the float64 reference of the weights every candidate holds (`reference(x)`).
    """
    m, n, k, dtype_name, backend = params
    candidates = {
        "native": bound_path(
            native_run,
            (wq, scales),
            tolerance=tolerance("native", dtype_name, k, backend),
            route="mx.quantized_matmul(nvfp4)",
        ),
        "dequant-gemm": bound_path(
            dequant_gemm_run,
            (wq, scales),
            tolerance=tolerance("dequant-gemm", dtype_name, k, backend),
            route="mx.dequantize(nvfp4)+matmul",
        ),
        "custom": qmm_custom_path(wq, scales, m, n, k, dtype_name),
    }
    # where the K-split GEMV is a second kernel here (not the same path again), it competes too
    if m <= gemv_nvfp4.MAX_ROWS and gemv_nvfp4.route(m, n, k, dtype_name, "ksplit") != candidates["custom"].route:
        candidates["custom-ksplit"] = qmm_custom_path(wq, scales, m, n, k, dtype_name, "ksplit")
    return dispatch.auto_path(
        ("qmm", m, n, k, dtype_name, backend),
        candidates,
        make_inputs,
        lambda name, *inputs: reference(*inputs),
    )


def build(params: dict[str, Any], arms: list[str], rng: np.random.Generator) -> Workload:
    """Build the `qmm` workload at one parameter point.

    Args:
        params: tokens (M), n (N), k (K), dtype ("float32", "bfloat16" or "float16").
        arms: the arms to build, in the sweep's order.
        rng: the job's generator (weights now, inputs in `make_inputs`).

    Returns:
        The workload: arms, inputs, the float64 reference, FLOPs and minimum bytes.
    """
    point = check_point("qmm", params)  # the case's own rule (kernels.shapes), as the head checked it
    m, n, k = int(point["tokens"]), int(point["n"]), int(point["k"])
    dtype_name = str(point["dtype"])
    dtype = MLX_DTYPES[dtype_name]
    backend = mlx_backend()

    t_draw = time.perf_counter()
    w = nvfp4_weights(n, k, rng)
    native_build = time.perf_counter() - t_draw
    wq, wscales = w.packed, w.scales
    # the reference's rows and columns: all of them, or a stratified subset (kernels.checking)
    subset = checking.grid_subset(m, n, m * n * k, rng, weights=n * k)
    rows, cols = subset if subset is not None else (None, np.arange(n))
    w_nvfp4 = w.dequantizer(None if subset is None else cols)  # float64, exact: what every NVFP4 arm holds
    dense: list[mx.array] = []  # the NVFP4 values in the dtype (exact), made on the device once

    def dense_weights() -> mx.array:
        if not dense:
            dense.append(mx.dequantize(wq, wscales, mode="nvfp4", dtype=dtype))
            mx.eval(dense[0])
        return dense[0]

    paths: dict[str, ArmPath] = {}
    weights: dict[str, np.ndarray | HostWeights] = {}  # the reference's, decoded at its first product
    unsupported: dict[str, str] = {}
    for arm in arms:
        if arm == "native":
            paths[arm] = bound_path(
                native_run,
                (wq, wscales),
                tolerance=tolerance("native", dtype_name, k, backend),
                route="mx.quantized_matmul(nvfp4)",
                build_seconds=native_build,
            )
            weights[arm] = w_nvfp4
        elif arm == "dequant-gemm":
            paths[arm] = bound_path(
                dequant_gemm_run,
                (wq, wscales),
                tolerance=tolerance("dequant-gemm", dtype_name, k, backend),
                route="mx.dequantize(nvfp4)+matmul",
                build_seconds=native_build,
            )
            weights[arm] = w_nvfp4
        elif arm == "affine":
            if k % AFFINE_GROUP:
                unsupported[arm] = f"affine group {AFFINE_GROUP} needs k divisible by {AFFINE_GROUP} (k={k})"
                continue
            affine, seconds = _timed_build(
                lambda: tuple(mx.quantize(dense_weights(), group_size=AFFINE_GROUP, bits=AFFINE_BITS))
            )
            aq, ascales, abiases = affine
            paths[arm] = bound_path(
                affine_run,
                affine,
                tolerance=tolerance("affine", dtype_name, k, backend),
                route=f"mx.quantized_matmul(affine,g{AFFINE_GROUP},b{AFFINE_BITS})",
                build_seconds=seconds,
            )
            at = mx.array(cols.astype(np.int32))
            weights[arm] = affine_decoder(aq[at], ascales[at], abiases[at])
        elif arm == "dense":
            (wd,), seconds = _timed_build(lambda: (dense_weights(),))
            paths[arm] = bound_path(
                dense_run,
                (wd,),
                tolerance=tolerance("dense", dtype_name, k, backend),
                route="matmul(dense)",
                build_seconds=seconds,
            )
            weights[arm] = float64_later(wd[mx.array(cols.astype(np.int32))])
        elif arm == "custom":  # kernels.gemv_nvfp4 (M <= 8) / kernels.gemm_nvfp4 (M > 8)
            paths[arm] = qmm_custom_path(wq, wscales, m, n, k, dtype_name)
            weights[arm] = w_nvfp4
        elif arm == "custom-ksplit":  # the same with the GEMV's K-split kernel
            paths[arm] = qmm_custom_path(wq, wscales, m, n, k, dtype_name, "ksplit")
            weights[arm] = w_nvfp4
        elif arm == "auto":  # issue 7: built below, once the inputs and the reference exist
            weights[arm] = w_nvfp4
        else:
            raise ValueError(f"qmm: unknown arm {arm!r}")
    dense.clear()  # the dense arm keeps its own reference; nothing else holds the dequantized copy

    reference = ProductReference(weights, shape=(m, n), rows=rows, cols=None if rows is None else cols)

    def make_inputs(gen: np.random.Generator) -> tuple[Any, ...]:
        return (activations.standard_normal(gen, (m, k), dtype),)

    if "auto" in arms:  # the fastest correct of native, dequant-gemm and the custom kernels, measured here
        paths["auto"] = qmm_auto_path(
            wq, wscales, (m, n, k, dtype_name, backend), make_inputs, lambda x: reference("auto", x)
        )
        paths = {a: paths[a] for a in arms if a in paths}

    return Workload(
        arms=paths,
        make_inputs=make_inputs,
        reference=reference,
        flops=qmm_flops(m, n, k),
        bytes_moved=qmm_bytes(m, n, k, dtype.size),
        tokens=m,
        unsupported=unsupported,
    )


def qmm_flops(m: int, n: int, k: int) -> float:
    """Floating-point operations of one y = x @ W^T: a multiply and an add per (m, n, k)."""
    return 2.0 * m * n * k


def qmm_bytes(m: int, n: int, k: int, itemsize: int) -> float:
    """The fewest bytes one native NVFP4 call must move, each operand once.

    Packed weights (half a byte per weight) + E4M3 scales (one byte per 16 weights) + x and y in
    the dtype. Every arm is measured against this same count (the NVFP4 path's minimum), so GB/s
    compares arms on one scale (a dense arm really moves 2-8x the weight bytes, but is credited
    with the NVFP4 count: its GB/s says how close it gets to what NVFP4 needs, not to the roofline).
    """
    return n * k / 2 + n * k / nvfp4.GROUP_SIZE + m * k * itemsize + m * n * itemsize
