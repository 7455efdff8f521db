"""NVFP4 weights drawn and quantized on the device MLX runs on, for the kernel cases' workloads.

At the seeds' shapes a weight matrix is 115 million values (21504 x 5376), an MoE's experts over a
billion: drawn and quantized by NumPy on the host they cost each job more than the few seconds of
its measurement (BENCHMARKS.md). Here the draws come from MLX's generator on the device, from a
key taken from the job's generator, and `mx.quantize(mode="nvfp4")` makes the codes and E4M3
scales where every arm reads them: milliseconds on a GPU.

The packed codes and scales are the weights: every arm is built from them, and the float64
reference decodes them on the host with the NumPy definition (`kernels.nvfp4.dequantize`, not
MLX's), reading back only the rows it checks (`rows`). So the check stays independent of MLX's
arithmetic while the weights never exist on the host in full.

Reproducibility: the same seed gives the same weights on every host of one backend. MLX's random
bits are the same on every backend (threefry), but the normal and uniform transforms round in the
backend's float32 arithmetic, so a code whose value sits on a rounding boundary may differ between,
say, a CPU and a GPU; the speed of a kernel does not depend on it, and each host checks its own.

Who quantizes: on a GPU, `mx.quantize`. MLX's CPU backend quantizes on one core (several times
slower than NumPy on all cores at the seeds' shape), so there the draws are quantized by the
NumPy reference on all the host's cores, with the GPU kernels' rounding
(`nvfp4.quantize(like="mlx-gpu")`, equal to MLX's GPU codes bit for bit): the same draws give
the same codes on either.

Tensors are drawn in blocks along the leading axis (an eighth of it, at most `BLOCK_VALUES` values),
each from its own key, so the float32 draws in memory at any time stay near the size of the NVFP4
weights themselves (a job's memory estimate, `kernels.shapes`, stays within 3x of its peak).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import numpy as np

from kernels import nvfp4

BLOCK_VALUES = 1 << 26  # float32 draws per block at most (256 MiB); fixed: the weights depend on it
BLOCKS = 8  # ... and at most an eighth of the leading axis: the draws in memory stay near the weights' size
HOST_ROWS = 1024  # rows per thread when the host quantizes

# draw(key, shape) -> float32 weights of that shape, on the device
Draw = Callable[[mx.array, tuple[int, ...]], mx.array]


def in_parallel(fn: Callable[[int], Any], count: int) -> list[Any]:
    """`[fn(i) for i in range(count)]` on all the host's cores (for NumPy work, which frees the GIL)."""
    with ThreadPoolExecutor(max_workers=max(1, min(count, os.cpu_count() or 1))) as pool:
        return list(pool.map(fn, range(count)))


def key_from(rng: np.random.Generator) -> mx.array:
    """An MLX key from the job's generator (so the weights follow the job's seed)."""
    return mx.random.key(int(rng.integers(2**63)))


def normal(scale: float = 1.0) -> Draw:
    """Draws N(0, scale^2)."""

    def draw(key: mx.array, shape: tuple[int, ...]) -> mx.array:
        w = mx.random.normal(shape, dtype=mx.float32, key=key)
        return w if scale == 1.0 else w * scale

    return draw


def uniform(bound: float) -> Draw:
    """Draws uniform in [-bound, bound)."""

    def draw(key: mx.array, shape: tuple[int, ...]) -> mx.array:
        return mx.random.uniform(-bound, bound, shape, dtype=mx.float32, key=key)

    return draw


@dataclass(frozen=True)
class DeviceWeights:
    """NVFP4 weights on the device: MLX-packed codes uint32 [..., rows, k/8], E4M3 scale bits uint8
    [..., rows, k/16], and the MLX-convention global scale (float32, one per leading index; None
    without)."""

    packed: mx.array
    scales: mx.array
    global_scale: mx.array | None

    @property
    def shape(self) -> tuple[int, ...]:
        """The weights' shape [..., rows, k]."""
        return (*self.packed.shape[:-1], self.packed.shape[-1] * 8)

    def at(self, index: int) -> DeviceWeights:
        """The weights of one leading index (an MoE's expert), with its own global scale."""
        gs = self.global_scale
        if gs is not None and gs.ndim > 0:
            gs = gs[index]
        return DeviceWeights(self.packed[index], self.scales[index], gs)

    def host(self, rows: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(codes uint8 [..., r, k], scale bits uint8 [..., r, k/16]) of `rows` (all without),
        read back from the device."""
        packed, scales = self._read(rows)
        return nvfp4.unpack_codes(packed), scales

    def _read(self, rows: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
        """(packed uint32, scale bits uint8) of `rows` (all without), read back from the device."""
        packed, scales = self.packed, self.scales
        if rows is not None:
            at = mx.array(np.asarray(rows, dtype=np.int32))
            packed, scales = mx.take(packed, at, axis=-2), mx.take(scales, at, axis=-2)
        return np.array(packed), np.array(scales)

    def global_scales(self) -> np.ndarray | None:
        """The global scales as float32 NumPy (shape of the leading axes), or None."""
        return None if self.global_scale is None else np.array(self.global_scale).astype(np.float32)

    def dequantized(self, rows: np.ndarray | None = None) -> np.ndarray:
        """The float64 weights of `rows` (all without), decoded by the NumPy definition (its tables:
        `nvfp4.dequantize_packed`)."""
        return self.dequantizer(rows)()

    def dequantizer(self, rows: np.ndarray | None = None) -> Callable[[], np.ndarray]:
        """`dequantized(rows)` in two parts: the codes and scales are read back from the device now,
        and the returned function decodes them (NumPy only: it may run on another thread)."""
        packed, scales = self._read(rows)
        gs = self.global_scales()
        return lambda: _decode(packed, scales, gs)


def _decode(packed: np.ndarray, scales: np.ndarray, gs: np.ndarray | None) -> np.ndarray:
    """The float64 weights of packed codes and scale bits read back, with their global scales."""
    if gs is None:
        return nvfp4.dequantize_packed(packed, scales)
    if gs.ndim == 0:
        return nvfp4.dequantize_packed(packed, scales, np.float32(gs))
    lead = gs.reshape(-1)
    flat_packed = packed.reshape(lead.size, *packed.shape[-2:])
    flat_scales = scales.reshape(lead.size, *scales.shape[-2:])
    out = np.stack([nvfp4.dequantize_packed(p, s, g) for p, s, g in zip(flat_packed, flat_scales, lead, strict=True)])
    return out.reshape(*packed.shape[:-1], packed.shape[-1] * 8)


def _blocks(shape: tuple[int, ...]) -> list[tuple[int, int]]:
    """Blocks along the leading axis: at most `BLOCK_VALUES` values and an eighth of the axis each
    (at least one index)."""
    per_index = int(np.prod(shape[1:])) if len(shape) > 1 else 1
    step = max(1, min(BLOCK_VALUES // max(per_index, 1), -(-shape[0] // BLOCKS)))
    return [(lo, min(lo + step, shape[0])) for lo in range(0, shape[0], step)]


def _block_values(
    shape: tuple[int, ...],
    rng: np.random.Generator,
    draw: Draw,
    magnitude: Callable[[mx.array, int], mx.array] | None,
) -> tuple[list[tuple[int, int]], Callable[[int], mx.array]]:
    """The blocks along the leading axis, and block b's float32 draws (lazy: drawn when evaluated)."""
    blocks = _blocks(shape)
    keys = mx.random.split(key_from(rng), 2 * len(blocks))

    def values(b: int) -> mx.array:
        lo, hi = blocks[b]
        w = draw(keys[2 * b], (hi - lo, *shape[1:]))
        if magnitude is not None:
            w = w * magnitude(keys[2 * b + 1], hi - lo)
        return w

    return blocks, values


def draw_values(
    shape: tuple[int, ...],
    rng: np.random.Generator,
    draw: Draw,
    magnitude: Callable[[mx.array, int], mx.array] | None = None,
) -> mx.array:
    """The float32 draws `draw_weights` quantizes for the same arguments (a generator in the same
    state), whole: what the weights were before quantization."""
    blocks, values = _block_values(shape, rng, draw, magnitude)
    return _joined([values(b) for b in range(len(blocks))])


def draw_weights(
    shape: tuple[int, ...],
    rng: np.random.Generator,
    draw: Draw,
    *,
    global_scale: str = "none",
    magnitude: Callable[[mx.array, int], mx.array] | None = None,
) -> DeviceWeights:
    """Weights of `shape` [..., rows, k] drawn by `draw` on the device and quantized to NVFP4 there.

    Args:
        shape: the weights' shape; k divisible by 16.
        rng: the job's generator (one key is taken from it).
        draw: the distribution (`normal`, `uniform`).
        global_scale: "none" (no global scale, as `mx.quantized_matmul` takes none), "tensor" (one
            for the whole tensor: its absolute maximum, the natural scale) or "leading" (one per
            index of the leading axis, each its slice's absolute maximum: an MoE's experts).
        magnitude: optional (key, block size) -> factors [block, 1, ...] multiplying each leading
            index's draws (an MoE's experts differing in size).

    Returns:
        The packed codes, scales and global scale, evaluated on the device.
    """
    if shape[-1] % nvfp4.GROUP_SIZE:
        raise ValueError(f"weights {shape}: the last axis must be divisible by {nvfp4.GROUP_SIZE}")
    if global_scale not in ("none", "tensor", "leading"):
        raise ValueError(f"global_scale {global_scale!r}: expected none, tensor or leading")
    blocks, values = _block_values(shape, rng, draw, magnitude)
    gs: mx.array | None = None
    if global_scale == "tensor":  # a first pass for the amax: drawing again is cheaper than keeping the draws
        gs = mx.max(mx.stack([mx.max(mx.abs(values(b))) for b in range(len(blocks))]))
        mx.eval(gs)
    packed, scales, leading = [], [], []
    for b in range(len(blocks)):
        w = values(b)
        if global_scale == "leading":
            g = mx.max(mx.abs(w.reshape(w.shape[0], -1)), axis=1)
            leading.append(g)
            q, s = _quantize_each(w, g)
        else:
            q, s = quantize(w, gs)
        mx.eval(q, s)
        packed.append(q)
        scales.append(s)
        del w
    if global_scale == "leading":
        gs = mx.concatenate(leading)
    out = DeviceWeights(_joined(packed), _joined(scales), gs)
    mx.eval(out.packed, out.scales, *([] if gs is None else [gs]))
    return out


def quantize(w: mx.array, global_scale: mx.array | None) -> tuple[mx.array, mx.array]:
    """`w` [..., k] to MLX-packed NVFP4 codes and E4M3 scales: `mx.quantize` on a GPU, the NumPy
    reference on the host's cores on MLX's CPU backend (the module docstring says why)."""
    if mx.default_device() == mx.gpu:
        out = mx.quantize(w, group_size=nvfp4.GROUP_SIZE, bits=4, mode="nvfp4", global_scale=global_scale)
        return out[0], out[1]  # nvfp4 has no biases
    host = np.array(w).reshape(-1, w.shape[-1])
    gs = None if global_scale is None else np.float32(np.array(global_scale))
    packed = np.empty((host.shape[0], host.shape[1] // 8), dtype=np.uint32)
    scales = np.empty((host.shape[0], host.shape[1] // nvfp4.GROUP_SIZE), dtype=np.uint8)
    starts = range(0, host.shape[0], HOST_ROWS)

    def one(i: int) -> None:
        lo = starts[i]
        hi = min(lo + HOST_ROWS, host.shape[0])
        codes, scales[lo:hi] = nvfp4.quantize(host[lo:hi], gs)
        packed[lo:hi] = nvfp4.pack_codes(codes)

    in_parallel(one, len(starts))
    lead = tuple(w.shape[:-1])
    return mx.array(packed.reshape(*lead, -1)), mx.array(scales.reshape(*lead, -1))


def _quantize_each(w: mx.array, g: mx.array) -> tuple[mx.array, mx.array]:
    """Quantize each leading index of `w` with its own global scale `g[i]` (one scale per call)."""
    qs, ss = [], []
    for i in range(w.shape[0]):
        q, s = quantize(w[i], g[i])
        qs.append(q)
        ss.append(s)
    return mx.stack(qs), mx.stack(ss)


def _joined(parts: list[mx.array]) -> mx.array:
    return parts[0] if len(parts) == 1 else mx.concatenate(parts)
