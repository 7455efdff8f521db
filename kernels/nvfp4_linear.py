"""Our NVFP4 kernels as one matmul and as an mlx-lm linear layer (the `custom` arms).

`nvfp4_matmul(x, w, scales, global_scale)` is `x[M, K] @ dequant(w)^T` (times MLX's
`global_scale / 2688`) through the kernel for the job: the decode GEMV (`kernels.gemv_nvfp4`) for
M <= 8, the prefill GEMM (`kernels.gemm_nvfp4`) above for bfloat16/float16 activations, the
expert-batched MoE kernel with one expert where the GEMM cannot run on CUDA (float32), and the
kernels' MLX twins without CUDA. `matmul_route` names what it runs.

`Nvfp4Linear` holds an NVFP4 layer as stored (codes, E4M3 scales, the optional global scale
fused into the kernels' epilogue, bias) and runs the same choice on the flattened activations;
`kernels.model` swaps mlx-lm's quantized linears for it at load (the whole-model `custom` arm).

A decoder calls its linears hundreds of times per generated token, and the Python that builds a
step's graph is paid on every token, ahead of the device in a pipelined decode (`mx.async_eval`).
So a layer resolves its call once per activation shape and dtype (`bound_matmul`: the kernel's
compiled launch, or the twin under `mx.compile`) and later calls go straight to it: no support
checks, no cache lookups keyed by launch configurations, no per-call multiplier arithmetic.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from kernels import gemm_nvfp4, gemv_nvfp4, moe_nvfp4
from kernels.cuda import cuda_backend_available


def _uses_moe(m: int, n: int, k: int, dtype: str) -> bool:
    """The one-expert MoE kernel: CUDA, prefill rows, and a shape or dtype the GEMM refuses."""
    return (
        m > gemv_nvfp4.MAX_ROWS
        and cuda_backend_available()
        and gemm_nvfp4.kernel_supports(m, n, k, dtype) is not None
        and moe_nvfp4.kernel_supports(n, k) is None
    )


def nvfp4_matmul(
    x: mx.array,
    w: mx.array,
    scales: mx.array,
    global_scale: mx.array | float | None = None,
    kernel: str | None = None,
    gsv: mx.array | None = None,
) -> mx.array:
    """`x[M, K] @ dequant(w)^T` through the kernel for M (module docstring).

    Args:
        x: activations [M, K].
        w, scales: packed codes [N, K/8] and E4M3 scales [N, K/16] (MLX's nvfp4 layout).
        global_scale: MLX's convention (about the tensor's absolute maximum), or None.
        kernel: "ksplit" asks the decode GEMV for its K-split kernel.
        gsv: `gemv_nvfp4.kernel_multiplier(global_scale)`, precomputed by a caller that calls often.
    """
    m, k = x.shape
    n = w.shape[0]
    if m <= gemv_nvfp4.MAX_ROWS:
        return gemv_nvfp4.gemv_nvfp4(x, w, scales, global_scale, kernel=kernel, gsv=gsv)
    dtype = gemv_nvfp4.dtype_name(x.dtype)
    if _uses_moe(m, n, k, dtype):
        lhs = mx.arange(m, dtype=mx.uint32)
        gs = None if global_scale is None else mx.array(global_scale, dtype=mx.float32).reshape(1)
        return moe_nvfp4.moe_gather_nvfp4(x, w[None], scales[None], gs, lhs, mx.zeros_like(lhs))
    return gemm_nvfp4.gemm_nvfp4(x, w, scales, global_scale, gsv=gsv)


# (x [M, K], codes, scales, the kernels' multiplier `gemv_nvfp4.kernel_multiplier`) -> y [M, N]
BoundMatmul = Callable[[mx.array, mx.array, mx.array, mx.array], mx.array]


def bound_matmul(
    lead: tuple[int, ...], n: int, k: int, dtype: mx.Dtype, global_scale: mx.array | None = None
) -> BoundMatmul:
    """`nvfp4_matmul` for activations of shape `(*lead, k)` and one dtype on this process's device,
    its kernel chosen now (module docstring): the CUDA launch traced by `mx.compile`, or the twin
    compiled (one graph node per call instead of a dozen ops built in Python). The decode GEMV and
    the twins take the leading dimensions as they come; the prefill kernels get the rows flattened.
    `global_scale` is the layer's, for the one kernel that takes it as it is stored (the one-expert
    MoE kernel)."""
    m = math.prod(lead)
    name = gemv_nvfp4.dtype_name(dtype)
    if m <= gemv_nvfp4.MAX_ROWS:
        cfg = gemv_nvfp4.choose_config(m, n, k, name)
        if cuda_backend_available() and gemv_nvfp4.config_supports(cfg, m, n, k, name) is None:
            return gemv_nvfp4.launcher(m, n, k, dtype, cfg, lead)
        return _compiled_twin(gemv_nvfp4.twin_scaled)
    call: BoundMatmul
    if _uses_moe(m, n, k, name):
        call = lambda x, w, scales, gsv: nvfp4_matmul(x, w, scales, global_scale)  # noqa: E731
    elif cuda_backend_available() and gemm_nvfp4.kernel_supports(m, n, k, name) is None:
        call = gemm_nvfp4.launcher(m, n, k, dtype)
    else:
        return _compiled_twin(gemm_nvfp4.twin_scaled)
    if len(lead) == 1:
        return call

    def call_flattened(x: mx.array, w: mx.array, scales: mx.array, gsv: mx.array) -> mx.array:
        return call(x.reshape(m, k), w, scales, gsv).reshape(*lead, n)

    return call_flattened


@functools.cache
def _compiled_twin(twin: BoundMatmul) -> BoundMatmul:
    return mx.compile(twin)


def matmul_route(m: int, n: int, k: int, dtype: str, kernel: str | None = None) -> str:
    """What `nvfp4_matmul` runs for this shape here (a row's `route`)."""
    if m <= gemv_nvfp4.MAX_ROWS:
        return gemv_nvfp4.route(m, n, k, dtype, kernel)
    if _uses_moe(m, n, k, dtype):
        return moe_nvfp4.route(n, k) + "[one expert]"
    return gemm_nvfp4.route(m, n, k, dtype)


class Nvfp4Linear(nn.Module):
    """An NVFP4 linear layer run by our kernels, its global scale applied in their epilogue.

    Its arrays are fixed at construction (the layer is frozen): the calls it binds per activation
    shape (`bound_matmul`) take them as arguments, and the kernels' multiplier is derived once.
    """

    def __init__(
        self, weight: mx.array, scales: mx.array, global_scale: mx.array | None, bias: mx.array | None
    ) -> None:
        super().__init__()
        self.weight = weight
        self.scales = scales
        if global_scale is not None:
            self.global_scale = global_scale.astype(mx.float32).reshape(())
        if bias is not None:
            self.bias = bias
        self.freeze()
        # the kernels' multiplier, once (not a parameter: derived, and padded for the kernels)
        self._gsv = gemv_nvfp4.kernel_multiplier(self._global_scale())
        # plain attributes, outside the module's parameter tree: (activation shape, dtype) -> call
        object.__setattr__(self, "_calls", {})
        object.__setattr__(self, "_has_bias", bias is not None)

    def _global_scale(self) -> mx.array | None:
        return self.get("global_scale")

    @classmethod
    def from_quantized(cls, layer: Any, global_scale: mx.array | None = None) -> Nvfp4Linear:
        """From an mlx-lm `QuantizedLinear` in nvfp4 mode (its arrays, not copies)."""
        if getattr(layer, "mode", None) != "nvfp4":
            raise ValueError(f"not an nvfp4 layer: {type(layer).__name__} mode {getattr(layer, 'mode', None)!r}")
        return cls(layer.weight, layer.scales, global_scale, layer.get("bias"))

    @property
    def shape(self) -> tuple[int, int]:
        """(output dims, input dims)."""
        return self.weight.shape[0], self.weight.shape[1] * 8

    def __call__(self, x: mx.array) -> mx.array:
        key = (x.shape, x.dtype)
        call = self._calls.get(key)
        if call is None:
            out_dims, in_dims = self.shape
            call = self._calls[key] = bound_matmul(x.shape[:-1], out_dims, in_dims, x.dtype, self._global_scale())
        y = call(x, self["weight"], self["scales"], self["_gsv"])
        return y + self["bias"] if self._has_bias else y
