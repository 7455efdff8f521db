"""The float64 reference of a product y = x @ W^T, from the weights each arm really holds.

The weights are read back from the device and decoded on the host by the NumPy definition:
NVFP4 (`kernels.device_nvfp4`), affine 4-bit (`affine_weights`), or a dtype's values widened
(`to_float64`). `ProductReference` computes x @ W^T per arm, over all of the output or the
stratified subset of `kernels.checking`, and shares one product among arms that hold the same
weights.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import mlx.core as mx
import numpy as np
import numpy.typing as npt

from kernels import checking
from kernels.checking import Reference, ReferenceSubset
from kernels.shapes import AFFINE_BITS, AFFINE_GROUP

# A reference's float64 weights still to be decoded from what was read back (NumPy only), decoded
# when the first reference is asked for
HostWeights = Callable[[], np.ndarray]


def unpack_affine(packed: npt.ArrayLike, bits: int = AFFINE_BITS) -> npt.NDArray[np.uint8]:
    """Unpack MLX's affine uint32 words (low bits first) into one integer level per uint8."""
    p = np.asarray(packed, dtype=np.uint32)
    per_word = 32 // bits
    shifts = np.arange(0, 32, bits, dtype=np.uint32)
    levels = (p[..., None] >> shifts) & np.uint32((1 << bits) - 1)
    return levels.reshape(*p.shape[:-1], p.shape[-1] * per_word).astype(np.uint8)


# 4-bit levels: a byte of MLX's words holds two (the low nibble first), tabulated as float64
_LEVEL_PAIRS = np.stack([np.arange(256) & 0xF, np.arange(256) >> 4], axis=-1).astype(np.float64)


def affine_weights(packed: Any, scales: Any, biases: Any, group: int = AFFINE_GROUP) -> np.ndarray:
    """The float64 weights an affine-quantized matrix holds: scale * level + bias, per group.

    4-bit levels are read a byte (two levels) at a time from a table, and scaled in place: the
    values of `unpack_affine`'s route, bit for bit, in about a third of its time.
    """
    return affine_decoder(packed, scales, biases, group)()


def affine_decoder(packed: Any, scales: Any, biases: Any, group: int = AFFINE_GROUP) -> HostWeights:
    """`affine_weights` in two parts: read back from the device now; the returned function decodes
    (NumPy only: it may run on another thread)."""
    s32 = np.array(scales.astype(mx.float32))
    b32 = np.array(biases.astype(mx.float32))
    words = np.ascontiguousarray(np.array(packed), dtype=np.uint32)
    return lambda: _affine_decode(words, s32, b32, group)


def _affine_decode(words: np.ndarray, s32: np.ndarray, b32: np.ndarray, group: int) -> np.ndarray:
    s, b = s32.astype(np.float64), b32.astype(np.float64)
    if AFFINE_BITS == 4 and np.little_endian:
        levels = np.take(_LEVEL_PAIRS, words.view(np.uint8), axis=0).reshape(*s.shape, group)
    else:
        levels = unpack_affine(words).astype(np.float64).reshape(*s.shape, group)
    levels *= s[..., None]
    levels += b[..., None]
    return levels.reshape(*s.shape[:-1], s.shape[-1] * group)


def to_float64(a: Any) -> np.ndarray:
    """An MLX array (any float dtype) as a float64 NumPy array, exactly."""
    return np.array(a.astype(mx.float32), dtype=np.float64)


def float64_later(a: Any) -> HostWeights:
    """`to_float64(a)` in two parts: read back now (float32, exact for every 16-bit type), widened later."""
    values = np.array(a.astype(mx.float32))
    return lambda: values.astype(np.float64)


class ProductReference:
    """float64 x @ W^T per arm, remembering the last product per weight matrix.

    Arms that hold the same weights (native, dequant-gemm, and dense when the dtype represents the
    NVFP4 values exactly) share one matrix, so one product serves them all. With `rows` (token
    indices) and `cols` (output features, the weights' rows), the weights given are those rows
    only, and the product is the subset `kernels.checking.ReferenceSubset`. A weight given as a
    function (`HostWeights`: read back from the device already, decoded when called) is decoded at
    the first product.
    """

    def __init__(
        self,
        weights: dict[str, np.ndarray | HostWeights],
        *,
        shape: tuple[int, int],
        rows: np.ndarray | None = None,
        cols: np.ndarray | None = None,
    ) -> None:
        self._sources = dict(weights)
        self._weights: dict[str, np.ndarray] | None = None
        self._last: dict[int, tuple[Any, Reference]] = {}
        self.shape, self.rows, self.cols = shape, rows, cols

    def _resolved(self) -> dict[str, np.ndarray]:
        """Every arm's float64 weights, decoded once (NumPy only); arms with equal weights share one matrix."""
        if self._weights is None:
            made: dict[int, np.ndarray] = {}  # one decode per source, however many arms hold it
            resolved: dict[str, np.ndarray] = {}
            for arm, src in self._sources.items():
                w = made.get(id(src))
                if w is None:
                    w = made[id(src)] = src() if callable(src) else src
                same = next(
                    (v for v in resolved.values() if v is w or (v.shape == w.shape and np.array_equal(v, w))), None
                )
                resolved[arm] = same if same is not None else w
            self._weights = resolved
        return self._weights

    def __call__(self, arm: str, x: Any) -> Reference:
        w = self._resolved()[arm]
        cached = self._last.get(id(w))
        if cached is not None and cached[0] is x:
            return cached[1]
        ref = self._product(self._host_rows(x), w)
        self._last[id(w)] = (x, ref)
        return ref

    def _host_rows(self, x: Any) -> np.ndarray:
        """x (all of it, or the checked rows) as float64 on the host."""
        return to_float64(x) if self.rows is None else checking.take_rows(x, self.rows)

    def _product(self, xs: np.ndarray, w: np.ndarray) -> Reference:
        if self.rows is None or self.cols is None:
            return xs @ w.T
        return ReferenceSubset.grid(xs @ w.T, self.rows, self.cols, self.shape)
