"""Case `moe-gather`: one expert projection of an MoE prefill through `mx.gather_qmm`.

T tokens x [T, D] are routed each to `top_k` distinct experts (uniformly at random, drawn afresh
with every input set); expert weights W [E, F, D] are NVFP4 with one FP32 global scale per expert
(MLX's convention, `global_scale / 2688`; `global_scale = false` quantizes without one). Experts
differ in magnitude (each a random power of ten in [0.1, 10]), so a path that applies the wrong
expert's scale is wrong by far more than any tolerance. Output y [T, top_k, F] with
y[t, j] = W[e(t, j)] @ x[t].

Arms, as an engine runs them (mlx-lm's `SwitchGLU`):

* `*-unsorted`: x as [T, 1, 1, D], `rhs_indices` the routing [T, top_k] as the router made it.
* `*-sorted`: the (token, expert) pairs sorted by expert, x gathered into that order, one
  `gather_qmm(..., sorted_indices=True)`, the rows scattered back. The sort, gather and scatter are
  inside the timed call: they are the price of the sorted route.
* `native-*`: mode nvfp4. The per-expert global scale goes into `gather_qmm(global_scale=[E])` on a
  GPU; MLX's CPU backend refuses it ("Global scale is only supported on the GPU"), so there each
  output row is multiplied by its expert's `global_scale / 2688` after the product (the pure-MLX
  twin). `ArmPath.route` says which ran.
* `affine-*`: each expert's NVFP4 values re-quantized to affine 4-bit, group 64.
* `custom-sorted`: the sorted route with issue 7's expert-batched kernel (`kernels.moe_nvfp4`, its
  MLX twin without CUDA) in place of gather_qmm.
* `auto-sorted`: the faster correct of native-sorted and custom-sorted, measured at build time
  (`kernels.dispatch`); its route names the choice.

The reference is NumPy float64: each routed row times the float64 weights the arm holds. Where the
whole product would cost more than the measurement (`kernels.checking.FULL_REFERENCE_MACS`), a
stratified subset of the output features is checked, on every routed row (only those rows of each
expert's weights are read back and decoded on the host); the rows record what was checked. Experts
are drawn and quantized on the device from a key of the job's generator (`kernels.device_nvfp4`);
the affine arms re-quantize them there too.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

import mlx.core as mx
import numpy as np

from kernels import checking, device_nvfp4, dispatch, moe_nvfp4, nvfp4
from kernels.checking import Reference, ReferenceSubset
from kernels.device_nvfp4 import DeviceWeights, in_parallel
from kernels.dispatch import Reference as AutoReference
from kernels.product_reference import affine_weights, to_float64
from kernels.qmm import MLX_DTYPES, mlx_backend, tolerance
from kernels.registry import ArmPath, Workload, bound_path, check_point
from kernels.shapes import AFFINE_BITS, AFFINE_GROUP

REFERENCE_WEIGHTS = 5e7  # weights of all experts dequantized for a subset reference, at most

# project(x_rows, rhs_indices, sorted_indices) -> y rows: one gather_qmm and what goes with it
Projection = Callable[[mx.array, mx.array, bool], mx.array]
ROUTE_FUSED = "gather_qmm(nvfp4,global_scale)"
ROUTE_POST_SCALE = "gather_qmm(nvfp4)+post-scale"


def expert_weights(
    experts: int, width: int, hidden: int, rng: np.random.Generator, global_scale: bool
) -> DeviceWeights:
    """E experts [F, D], each a random power of ten in [0.1, 10] times N(0, 1), quantized on the
    device, each with its own global scale (its absolute maximum) when `global_scale`."""

    def magnitude(key: mx.array, count: int) -> mx.array:
        return mx.power(10.0, mx.random.uniform(-1.0, 1.0, (count, 1, 1), key=key))

    return device_nvfp4.draw_weights(
        (experts, width, hidden),
        rng,
        device_nvfp4.normal(),
        global_scale="leading" if global_scale else "none",
        magnitude=magnitude,
    )


class ExpertRows:
    """Each expert's float64 weights (its `rows`, or all), read back and decoded once, on demand."""

    def __init__(self, weights: DeviceWeights, rows: np.ndarray | None) -> None:
        self.weights, self.rows = weights, rows
        self._done: dict[int, np.ndarray] = {}

    def __call__(self, expert: int) -> np.ndarray:
        hit = self._done.get(expert)
        if hit is None:
            hit = self._done[expert] = self.weights.at(expert).dequantized(self.rows)
        return hit


def route(gen: np.random.Generator, tokens: int, experts: int, top_k: int) -> np.ndarray:
    """A router's choice: `top_k` distinct experts per token, uniformly at random, uint32 [T, k]."""
    keys = gen.random((tokens, experts))
    return np.argsort(keys, axis=1)[:, :top_k].astype(np.uint32)


def run_unsorted(project: Projection, x: mx.array, indices: mx.array) -> mx.array:
    """Every (token, expert) pair in router order: y [T, k, F]."""
    t, k = indices.shape
    y = project(x[:, None, None, :], indices, False)  # [T, k, 1, F]
    return y.reshape(t, k, -1)


def run_sorted(project: Projection, x: mx.array, indices: mx.array) -> mx.array:
    """The pairs sorted by expert, one sorted gather_qmm, rows scattered back: y [T, k, F]."""
    t, k = indices.shape
    flat = indices.flatten()
    order = mx.argsort(flat)
    inverse = mx.argsort(order)
    y = project(x[order // k][:, None, :], flat[order], True)  # [T*k, 1, F]
    return y[inverse].reshape(t, k, -1)


def nvfp4_projection(wq: mx.array, scales: mx.array, global_scales: mx.array | None, fused: bool) -> Projection:
    """gather_qmm in mode nvfp4, the per-expert global scale fused (GPU) or applied after (CPU)."""

    def project(xr: mx.array, idx: mx.array, sorted_indices: bool) -> mx.array:
        if global_scales is not None and fused:
            return mx.gather_qmm(
                xr,
                wq,
                scales,
                rhs_indices=idx,
                transpose=True,
                mode="nvfp4",
                global_scale=global_scales,
                sorted_indices=sorted_indices,
            )
        y = mx.gather_qmm(xr, wq, scales, rhs_indices=idx, transpose=True, mode="nvfp4", sorted_indices=sorted_indices)
        if global_scales is None:
            return y
        decode = (global_scales / nvfp4.MLX_GLOBAL_SCALE_DIVISOR)[idx].astype(y.dtype)
        return y * decode.reshape(*idx.shape, *([1] * (y.ndim - idx.ndim)))

    return project


def affine_projection(wq: mx.array, scales: mx.array, biases: mx.array) -> Projection:
    """gather_qmm in mode affine (4-bit, group 64)."""

    def project(xr: mx.array, idx: mx.array, sorted_indices: bool) -> mx.array:
        return mx.gather_qmm(
            xr,
            wq,
            scales,
            biases,
            rhs_indices=idx,
            transpose=True,
            group_size=AFFINE_GROUP,
            bits=AFFINE_BITS,
            mode="affine",
            sorted_indices=sorted_indices,
        )

    return project


def gathered_reference(weights: Callable[[int], np.ndarray], x: mx.array, indices: mx.array) -> np.ndarray:
    """float64 y [T, k, F'] (F' the rows `weights` gives): each routed row times its expert's
    weights, experts on all cores."""
    x64 = to_float64(x)
    idx = np.array(indices)
    experts = [int(e) for e in np.unique(idx)]
    width = weights(experts[0]).shape[0]
    out = np.zeros((*idx.shape, width), dtype=np.float64)

    def one(i: int) -> None:
        e = experts[i]
        t, j = np.nonzero(idx == e)
        out[t, j] = x64[t] @ weights(e).T

    in_parallel(one, len(experts))
    return out


def build(params: dict[str, Any], arms: list[str], rng: np.random.Generator) -> Workload:
    """Build the `moe-gather` workload at one parameter point.

    Args:
        params: experts (E), top_k, tokens (T), hidden (D), expert_width (F), dtype, global_scale.
        arms: the arms to build, in the sweep's order.
        rng: the job's generator (weights now, inputs and routing in `make_inputs`).

    Returns:
        The workload: arms, inputs (x, routing), the float64 reference, FLOPs and minimum bytes.
    """
    point = check_point("moe-gather", params)  # the case's own rule (kernels.shapes), as the head checked it
    e, top_k, t = int(point["experts"]), int(point["top_k"]), int(point["tokens"])
    d, f = int(point["hidden"]), int(point["expert_width"])
    dtype_name = str(point["dtype"])
    use_gs = bool(point["global_scale"])
    dtype = MLX_DTYPES[dtype_name]
    backend = mlx_backend()
    fused = backend != "cpu"  # gather_qmm's global_scale is GPU-only in MLX 0.32.4

    ew = expert_weights(e, f, d, rng, use_gs)
    # the output features the reference checks: all, or a stratified subset (kernels.checking)
    cols: np.ndarray | None = None
    if t * top_k * f * d > checking.FULL_REFERENCE_MACS:
        count = max(64, int(REFERENCE_WEIGHTS / (e * d)))
        cols = checking.stratified(f, count, np.random.default_rng(rng.integers(2**63)))
    wq, wscales, gs = ew.packed, ew.scales, ew.global_scale
    native_weights: tuple[mx.array, ...] = (wq, wscales) if gs is None else (wq, wscales, gs)
    native_route = "gather_qmm(nvfp4)" if gs is None else (ROUTE_FUSED if fused else ROUTE_POST_SCALE)

    def native_projection(w: tuple[mx.array, ...]) -> Projection:
        return nvfp4_projection(w[0], w[1], w[2] if len(w) > 2 else None, fused)

    native_holds = ExpertRows(ew, cols)  # one function, so the reference can share its product

    affine: tuple[tuple[mx.array, ...], Callable[[int], np.ndarray]] | None = None
    paths: dict[str, ArmPath] = {}
    weights: dict[str, Callable[[int], np.ndarray]] = {}
    unsupported: dict[str, str] = {}
    for arm in arms:
        kind, _, order = arm.partition("-")
        if kind == "custom" and order == "sorted":  # issue 7: kernels.moe_nvfp4 (MLX twin without CUDA)
            paths[arm] = moe_nvfp4.moe_custom_path(wq, wscales, gs, dtype_name, (t, top_k, d))
            weights[arm] = native_holds
            continue
        if kind == "auto" and order == "sorted":  # issue 7: built below, once inputs and reference exist
            weights[arm] = native_holds
            continue
        if kind not in ("native", "affine") or order not in ("sorted", "unsorted"):
            raise ValueError(f"moe-gather: unknown arm {arm!r}")
        runner = run_sorted if order == "sorted" else run_unsorted
        holds: Callable[[int], np.ndarray]
        projection: Callable[[tuple[mx.array, ...]], Projection]
        if kind == "native":
            projection, arrays, holds, route_name = native_projection, native_weights, native_holds, native_route
        else:
            if d % AFFINE_GROUP:
                unsupported[arm] = f"affine group {AFFINE_GROUP} needs hidden divisible by {AFFINE_GROUP} (hidden={d})"
                continue
            if affine is None:
                affine = _affine_experts(ew, dtype, cols)
            arrays, holds = affine
            projection = _affine_projection_of
            route_name = f"gather_qmm(affine,g{AFFINE_GROUP},b{AFFINE_BITS})"
        paths[arm] = bound_path(
            _arm_run(runner, projection),
            arrays,
            tolerance=tolerance(kind, dtype_name, d, backend),
            route=f"{route_name},{order}",
        )
        weights[arm] = holds

    def make_inputs(gen: np.random.Generator) -> tuple[Any, ...]:
        x = gen.standard_normal((t, d), dtype=np.float32)
        return mx.array(x).astype(dtype), mx.array(route(gen, t, e, top_k))

    last: dict[int, tuple[mx.array, mx.array, Reference]] = {}

    def reference(arm: str, x: mx.array, indices: mx.array) -> Reference:
        # sorted and unsorted arms hold the same weights: one float64 product serves both
        holds = weights[arm]
        hit = last.get(id(holds))
        if hit is not None and hit[0] is x and hit[1] is indices:
            return hit[2]
        full = gathered_reference(holds, x, indices)
        y: Reference = full
        if cols is not None:
            what = f"{len(cols)} of {f} output features, every routed row"
            y = ReferenceSubset(full, (Ellipsis, cols), (t, top_k, f), what)
        last[id(holds)] = (x, indices, y)
        return y

    if "auto-sorted" in arms:  # the faster correct of native-sorted and custom-sorted, measured here
        native_sorted = bound_path(
            _arm_run(run_sorted, native_projection),
            native_weights,
            tolerance=tolerance("native", dtype_name, d, backend),
            route=f"{native_route},sorted",
        )
        custom_sorted = moe_nvfp4.moe_custom_path(wq, wscales, gs, dtype_name, (t, top_k, d))
        paths["auto-sorted"] = moe_auto_path(
            native_sorted,
            custom_sorted,
            (e, top_k, t, d, f, dtype_name, use_gs, backend),
            make_inputs,
            lambda x, idx: reference("auto-sorted", x, idx),
        )
        paths = {a: paths[a] for a in arms if a in paths}

    return Workload(
        arms=paths,
        make_inputs=make_inputs,
        reference=reference,
        flops=moe_flops(t, top_k, f, d),
        bytes_moved=moe_bytes(e, top_k, t, d, f, dtype.size, use_gs),
        tokens=t,
        unsupported=unsupported,
    )


def moe_auto_path(
    native_sorted: ArmPath,
    custom_sorted: ArmPath,
    key: Hashable,
    make_inputs: Callable[[np.random.Generator], tuple[Any, ...]],
    reference: AutoReference,
) -> ArmPath:
    """The moe-gather case's `auto-sorted` arm: the faster correct of native-sorted (gather_qmm)
    and custom-sorted; `reference(x, indices)` is the float64 output both must give."""
    return dispatch.auto_path(
        ("moe-gather", key),
        {"native-sorted": native_sorted, "custom-sorted": custom_sorted},
        make_inputs,
        lambda name, *inputs: reference(*inputs),
    )


def _arm_run(
    runner: Callable[[Projection, mx.array, mx.array], mx.array],
    projection: Callable[[tuple[mx.array, ...]], Projection],
) -> Callable[[tuple[mx.array, ...]], Callable[[mx.array, mx.array], mx.array]]:
    """An arm's run factory: `runner` (sorted or unsorted) over the projection of given weights."""

    def make(w: tuple[mx.array, ...]) -> Callable[[mx.array, mx.array], mx.array]:
        project = projection(w)
        return lambda x, idx: runner(project, x, idx)

    return make


def _affine_projection_of(w: tuple[mx.array, ...]) -> Projection:
    return affine_projection(*w)


def _affine_experts(
    ew: DeviceWeights, dtype: mx.Dtype, cols: np.ndarray | None
) -> tuple[tuple[mx.array, ...], Callable[[int], np.ndarray]]:
    """Re-quantize every expert's NVFP4 values (global scale included) to affine 4-bit, group 64, on
    the device: the (codes, scales, biases) arrays, and the float64 weights each expert then holds
    (its `cols` rows, when given) for the reference."""
    values = []
    for i in range(ew.packed.shape[0]):  # MLX's float32 values (the NumPy definition's, bit for bit)
        one = ew.at(i)
        v = mx.dequantize(one.packed, one.scales, mode="nvfp4", global_scale=one.global_scale, dtype=mx.float32)
        values.append(v.astype(dtype))
        mx.eval(values[-1])
    w = mx.stack(values)
    del values
    aq, ascales, abiases = mx.quantize(w, group_size=AFFINE_GROUP, bits=AFFINE_BITS)
    mx.eval(aq, ascales, abiases)
    at = None if cols is None else mx.array(cols.astype(np.int32))

    def holds(i: int) -> np.ndarray:
        if at is None:
            return affine_weights(aq[i], ascales[i], abiases[i])
        return affine_weights(aq[i][at], ascales[i][at], abiases[i][at])

    return (aq, ascales, abiases), holds


def expected_experts_touched(experts: int, top_k: int, tokens: int) -> float:
    """Expected distinct experts T tokens route to (top_k distinct each, uniform): E(1-(1-k/E)^T)."""
    return experts * (1.0 - (1.0 - top_k / experts) ** tokens)


def moe_flops(tokens: int, top_k: int, width: int, hidden: int) -> float:
    """A multiply and an add per (routed pair, output, input): 2 T k F D."""
    return 2.0 * tokens * top_k * width * hidden


def moe_bytes(
    experts: int, top_k: int, tokens: int, hidden: int, width: int, itemsize: int, global_scale: bool
) -> float:
    """The fewest bytes one call must move, in the native NVFP4 layout, each thing once.

    Each routed expert's weights once (packed codes F D / 2 + E4M3 scales F D / 16 + its 4-byte
    global scale), for the expected number of distinct experts the routing touches (the routing is
    drawn afresh per input set; at prefill sizes T k >> E it is all E); x [T, D] and y [T, k, F] in
    the dtype once; the routing indices [T, k] as uint32.
    """
    per_expert = width * hidden / 2 + width * hidden / nvfp4.GROUP_SIZE + (4 if global_scale else 0)
    touched = expected_experts_touched(experts, top_k, tokens)
    activations = tokens * hidden * itemsize + tokens * top_k * width * itemsize
    return touched * per_expert + activations + tokens * top_k * 4
