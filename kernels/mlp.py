"""The `mlp` case: the Gemma GeGLU MLP block in NVFP4, three ways to run its activation path.

    y = down( gelu_tanh(gate(x)) * up(x) )

Gate, up ([intermediate, hidden]) and down ([hidden, intermediate]) are NVFP4 weights, each with
its own per-tensor global scale in MLX's convention (a layer decodes `raw * global_scale / 2688`,
see `kernels.nvfp4`). `mx.quantized_matmul` takes no global scale, so each projection's product
needs one more multiply by `global_scale / 2688`; the arms are the first seed's activation paths:

* `fused`: the whole block under `mx.compile`, the three global scales folded into the compiled
  graph as constants: the gate's scale joins the GeLU's input, the up and down scales (the down
  projection is linear) become one multiply of the output;
* `op-at-a-time`: each projection, then its own scale multiply, eagerly; only the GeGLU
  activation (`gelu_tanh(g) * u`) is compiled;
* `eager`: the same graph as `op-at-a-time` with nothing compiled.

The weights are drawn and quantized on the device (`kernels.device_nvfp4`); the float64 reference
decodes those same codes and scales on the host by the NumPy definition (`kernels.nvfp4`), so
every arm and the reference hold bit-identical weights; the reference checks the arms'
arithmetic, including where the global scales enter.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import numpy as np

from kernels import activations, checking, device_nvfp4, nvfp4, qmm
from kernels.checking import Reference, ReferenceSubset
from kernels.device_nvfp4 import DeviceWeights
from kernels.registry import ArmPath, Workload, bound_path, check_point

ARMS = ("fused", "op-at-a-time", "eager")
DTYPES = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}
GELU_C = math.sqrt(2.0 / math.pi)


@dataclass(frozen=True)
class Projection:
    """One NVFP4 projection: MLX-packed codes, E4M3 scale bits and its MLX-convention global scale."""

    packed: mx.array  # uint32 [out, in/8]
    scales: mx.array  # uint8 [out, in/16]
    global_scale: float
    weights: DeviceWeights  # the same codes and scales, read back for the reference

    @property
    def decode_scale(self) -> float:
        """What one product is multiplied by: `global_scale / 2688`."""
        return self.global_scale / nvfp4.MLX_GLOBAL_SCALE_DIVISOR

    def dense(self, rows: np.ndarray | None = None) -> np.ndarray:
        """The weights in float64 (those `rows`, or all), global scale included."""
        return self.weights.dequantized(rows)

    def product(self, x: mx.array) -> mx.array:
        """`x @ raw^T` without the global scale (the native NVFP4 quantized matmul)."""
        return mx.quantized_matmul(x, self.packed, self.scales, transpose=True, group_size=16, bits=4, mode="nvfp4")


@dataclass(frozen=True)
class MlpWeights:
    """The block's three projections."""

    gate: Projection
    up: Projection
    down: Projection

    def arrays(self) -> tuple[mx.array, ...]:
        """The MLX arrays every call reads: each projection's packed codes and scales."""
        return tuple(a for p in (self.gate, self.up, self.down) for a in (p.packed, p.scales))

    def over(self, arrays: tuple[mx.array, ...]) -> MlpWeights:
        """The same weights held in other buffers (`arrays` in the order of `arrays()`)."""
        gate, up, down = (
            dataclasses.replace(p, packed=arrays[2 * i], scales=arrays[2 * i + 1])
            for i, p in enumerate((self.gate, self.up, self.down))
        )
        return MlpWeights(gate, up, down)


def _arm_over(arm: str, weights: MlpWeights, arrays: tuple[mx.array, ...]) -> Callable[[mx.array], mx.array]:
    """`arm`'s block over `weights` held in `arrays` (a copy for a cold cache, or the originals)."""
    return arm_function(arm, weights.over(arrays))


def make_projection(out_dims: int, in_dims: int, rng: np.random.Generator) -> Projection:
    """Weights [out, in] at a Linear layer's usual scale (uniform in ±1/sqrt(in)), quantized on the
    device with their natural global scale (the tensor's absolute maximum)."""
    w = device_nvfp4.draw_weights(
        (out_dims, in_dims), rng, device_nvfp4.uniform(1.0 / math.sqrt(in_dims)), global_scale="tensor"
    )
    gs = w.global_scales()
    assert gs is not None
    return Projection(packed=w.packed, scales=w.scales, global_scale=float(gs), weights=w)


def make_weights(hidden: int, intermediate: int, rng: np.random.Generator) -> MlpWeights:
    """The block's three projections, drawn from the job's generator."""
    return MlpWeights(
        gate=make_projection(intermediate, hidden, rng),
        up=make_projection(intermediate, hidden, rng),
        down=make_projection(hidden, intermediate, rng),
    )


def gelu_tanh(x: mx.array) -> mx.array:
    """GeLU, tanh approximation (Gemma's `gelu_pytorch_tanh`), as plain ops: nothing compiled."""
    return 0.5 * x * (1.0 + mx.tanh(GELU_C * (x + 0.044715 * x * x * x)))


def _geglu(g: mx.array, u: mx.array) -> mx.array:
    return gelu_tanh(g) * u


def arm_function(arm: str, weights: MlpWeights) -> Callable[[mx.array], mx.array]:
    """The block as `arm` runs it: x [tokens, hidden] -> y [tokens, hidden]."""
    gate, up, down = weights.gate, weights.up, weights.down
    if arm == "fused":
        s_gate = gate.decode_scale
        s_out = up.decode_scale * down.decode_scale

        def fused(x: mx.array) -> mx.array:
            g = gate.product(x) * s_gate
            h = gelu_tanh(g) * up.product(x)
            return down.product(h) * s_out

        return mx.compile(fused)  # the scales are Python floats: constants of the compiled graph
    if arm in ("op-at-a-time", "eager"):
        activation = mx.compile(_geglu) if arm == "op-at-a-time" else _geglu

        def op_at_a_time(x: mx.array) -> mx.array:
            g = gate.product(x) * gate.decode_scale
            u = up.product(x) * up.decode_scale
            return down.product(activation(g, u)) * down.decode_scale

        return op_at_a_time
    raise ValueError(f"unknown arm {arm!r} (known: {', '.join(ARMS)})")


ROUTES = {
    "fused": "mx.compile(block): 3x quantized_matmul(nvfp4), scales folded (gate in, up*down out)",
    "op-at-a-time": "3x quantized_matmul(nvfp4) + scale multiply each, mx.compile(gelu_tanh(g)*u)",
    "eager": "3x quantized_matmul(nvfp4) + scale multiply each, gelu_tanh(g)*u eager",
}


def reference(weights: MlpWeights, x: np.ndarray, cols: np.ndarray | None = None) -> np.ndarray:
    """The block in float64 NumPy from the NVFP4 definition: the truth every arm is checked against.

    With `cols`, only those output features (the down projection's rows); each token's row of the
    output depends on that token alone, so a subset of tokens is the reference of `x`'s rows.
    """
    x64 = np.asarray(x, dtype=np.float64)
    g = x64 @ weights.gate.dense().T
    u = x64 @ weights.up.dense().T
    h = 0.5 * g * (1.0 + np.tanh(GELU_C * (g + 0.044715 * g**3))) * u
    return h @ weights.down.dense(cols).T


class BlockReference:
    """The float64 block for an input, once for every arm that is checked on that input.

    Over `kernels.checking.FULL_REFERENCE_MACS` (the seeds' 8192 x 5376 x 21504 block is 2.8 T
    multiply-adds, minutes of float64 NumPy) a stratified subset of tokens and output features is
    checked instead (`kernels.checking.ReferenceSubset`), as `qmm` does.
    """

    def __init__(self, weights: MlpWeights, tokens: int, hidden: int, intermediate: int, rng: np.random.Generator):
        self.weights, self.shape = weights, (tokens, hidden)
        self.subset = checking.grid_subset(tokens, hidden, 3 * tokens * hidden * intermediate, rng)
        self._last: tuple[Any, Reference] | None = None

    def __call__(self, arm: str, x: Any) -> Reference:
        if self._last is not None and self._last[0] is x:
            return self._last[1]
        ref: Reference
        if self.subset is None:
            ref = reference(self.weights, _to_numpy(x))
        else:
            rows, cols = self.subset
            ref = ReferenceSubset.grid(
                reference(self.weights, checking.take_rows(x, rows), cols), rows, cols, self.shape
            )
        self._last = (x, ref)
        return ref


def tolerance(dtype: str, hidden: int, intermediate: int, backend: str) -> float:
    """The largest relative error (Frobenius, against the float64 block) an arm may show.

    The weights are exact (the reference holds the same codes), so the error is rounding: each
    projection's own (`kernels.qmm.tolerance` for a native NVFP4 product at its reduction length,
    gate and up over `hidden`, down over `intermediate`), which a chain adds up to first order,
    plus the GeGLU intermediate rounded to the dtype (4 u). A wrong or missing global scale gives
    an error near 1 (or far above), far over this.
    """
    products = 2 * qmm.tolerance("native", dtype, hidden, backend)
    products += qmm.tolerance("native", dtype, intermediate, backend)
    return products + 4.0 * qmm.UNIT_ROUNDOFF[dtype]


def _to_numpy(x: Any) -> np.ndarray:
    if isinstance(x, mx.array):
        return np.array(x.astype(mx.float32))
    return np.asarray(x)


def build(params: dict[str, Any], arms: list[str], rng: np.random.Generator) -> Workload:
    """One parameter point: `tokens` x `hidden` activations through a `hidden`/`intermediate` block."""
    point = check_point("mlp", params)  # the case's own rule (kernels.shapes), as the head checked it
    tokens, hidden, intermediate = int(point["tokens"]), int(point["hidden"]), int(point["intermediate"])
    dtype_name = str(point["dtype"])
    dtype = DTYPES[dtype_name]
    weights = make_weights(hidden, intermediate, rng)
    mx.eval(weights.gate.packed, weights.up.packed, weights.down.packed)
    tol = tolerance(dtype_name, hidden, intermediate, qmm.mlx_backend())
    paths: dict[str, ArmPath] = {}
    arrays = weights.arrays()
    for arm in arms:
        t0 = time.perf_counter()
        make = functools.partial(_arm_over, arm, weights)
        paths[arm] = bound_path(make, arrays, tolerance=tol, route=ROUTES[arm], build_seconds=time.perf_counter() - t0)

    def make_inputs(gen: np.random.Generator) -> tuple[mx.array, ...]:
        return (activations.standard_normal(gen, (tokens, hidden), dtype),)

    weight_bytes = 3 * hidden * intermediate * (0.5 + 1 / nvfp4.GROUP_SIZE)
    io_bytes = 2 * tokens * hidden * np.dtype(np.float32 if dtype_name == "float32" else np.float16).itemsize
    return Workload(
        arms=paths,
        make_inputs=make_inputs,
        reference=BlockReference(weights, tokens, hidden, intermediate, rng),
        flops=2.0 * tokens * hidden * intermediate * 3,
        bytes_moved=weight_bytes + io_bytes,
        tokens=tokens,
    )
