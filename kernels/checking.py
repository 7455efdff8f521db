"""How an arm's output is checked against its float64 reference: over all of it, or a subset.

At the seeds' shapes a float64 NumPy product costs more than the whole measurement (16384 x 5376
by 5376 x 21504 is 3.8 TFLOP), so a case may check a stratified subset of the output instead: the
index range of each checked axis is cut into equal strata and one random index is drawn in each
(the first and last index always included), so every tile a kernel writes, at any tile size down
to the stratum's width, has checked elements in it. A wrong layout, scale, expert or tile shows
there as it does in the whole output; the relative error over the subset estimates the whole's.
The subset's size is recorded with the error (`ReferenceSubset.describe`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

FULL_REFERENCE_MACS = 2e9  # a float64 product of this many multiply-adds takes about a second: check it all
# ... and a matrix of this many weights is decoded whole on the host (134 MB as float64, 0.1 s per
# arm's copy). A decode-sized product is cheap, but the seeds' 21504 x 5376 weights are 115 M, which
# each fresh job process decoded for the native, affine and dense arms: 2.8 GB and seconds per job.
FULL_REFERENCE_WEIGHTS = 2**24
MAX_ROWS = 256  # strata along the token axis when the product is larger
MAX_COLS = 1024  # strata along the output-feature axis


def stratified(size: int, count: int, rng: np.random.Generator) -> np.ndarray:
    """`count` sorted indices into range(size), one random index per equal stratum (all when count >= size),
    with 0 and size - 1 always among them."""
    if count >= size:
        return np.arange(size)
    edges = np.linspace(0, size, count + 1)
    lo, hi = np.ceil(edges[:-1]).astype(np.int64), np.ceil(edges[1:]).astype(np.int64)
    picks = lo + (rng.random(count) * (hi - lo)).astype(np.int64)
    picks[0], picks[-1] = 0, size - 1
    return np.unique(np.clip(picks, 0, size - 1))


@dataclass(frozen=True)
class ReferenceSubset:
    """The reference at a subset of the output: `values` = full_reference[index].

    Attributes:
        values: The float64 reference at the checked elements.
        index: A NumPy index into the full output (e.g. an `np.ix_` of rows and columns).
        shape: The full output's shape.
        what: What was checked, for the record (`"256 of 16384 rows x 1024 of 21504 columns"`).
    """

    values: np.ndarray
    index: tuple[Any, ...]
    shape: tuple[int, ...]
    what: str

    def pick(self, out: np.ndarray) -> np.ndarray | None:
        """The output at the checked elements (None when the output has the wrong shape)."""
        return out[self.index] if out.shape == self.shape else None

    def describe(self) -> str:
        """What was checked."""
        return self.what

    @classmethod
    def grid(cls, values: np.ndarray, rows: np.ndarray, cols: np.ndarray, shape: tuple[int, int]) -> ReferenceSubset:
        """The reference at `rows` x `cols` (`grid_subset`'s picks) of an output of `shape`."""
        what = f"{len(rows)} of {shape[0]} rows x {len(cols)} of {shape[1]} columns"
        return cls(values, np.ix_(rows, cols), shape, what)


Reference = np.ndarray | ReferenceSubset


def grid_subset(
    m: int, n: int, macs: float, rng: np.random.Generator, *, weights: float = 0
) -> tuple[np.ndarray, np.ndarray] | None:
    """The rows and columns of an m x n output to check where its float64 product costs `macs`
    multiply-adds, over `FULL_REFERENCE_MACS`, or needs `weights` decoded on the host, over
    `FULL_REFERENCE_WEIGHTS` (stratified, from a child of `rng`); None: check all."""
    if macs <= FULL_REFERENCE_MACS and weights <= FULL_REFERENCE_WEIGHTS:
        return None
    pick = np.random.default_rng(rng.integers(2**63))
    return stratified(m, MAX_ROWS, pick), stratified(n, MAX_COLS, pick)


def take_rows(x: Any, rows: np.ndarray) -> np.ndarray:
    """`x[rows]` as float64; of an MLX array only those rows leave the device."""
    if _is_mlx(x):
        import mlx.core as mx  # optional heavy dependency: NumPy outputs are checked without MLX

        return np.array(mx.take(x, mx.array(rows.astype(np.int32)), axis=0).astype(mx.float32), dtype=np.float64)
    return np.asarray(x, dtype=np.float64)[rows]


def _outer_axes(index: tuple[Any, ...], ndim: int) -> list[np.ndarray | None] | None:
    """Per axis, the indices an `np.ix_`-style index (or one with `...`) keeps (None: all of the
    axis); None for an index of any other form."""
    parts = list(index)
    dots = [i for i, p in enumerate(parts) if p is Ellipsis]  # `is`: `in` would compare arrays
    if len(dots) > 1:
        return None
    if dots:
        parts[dots[0] : dots[0] + 1] = [slice(None)] * (ndim - len(parts) + 1)
    if len(parts) != ndim:
        return None
    axes: list[np.ndarray | None] = []
    arrays = [np.asarray(p) for p in parts if not isinstance(p, slice)]
    for axis, part in enumerate(parts):
        if isinstance(part, slice):
            if part != slice(None):
                return None
            axes.append(None)
            continue
        a = np.asarray(part)
        outer = a.ndim == ndim and all(d == 1 for i, d in enumerate(a.shape) if i != axis)  # np.ix_'s form
        if not (outer or (a.ndim == 1 and len(arrays) == 1)) or a.dtype.kind not in "iu":
            return None
        axes.append(a.ravel())
    return axes


def device_pick(out: Any, ref: ReferenceSubset) -> np.ndarray | None:
    """An MLX output at `ref`'s elements, gathered on the device, as float64; None for a wrong shape.

    At the seeds' shapes the whole output is hundreds of millions of elements (2.8 GB as float64
    at 16384 x 21504): only the checked ones leave the device. A NaN or inf anywhere in the output
    still fails the check: it is looked for over the whole output, on the device, and reported as
    an inf in the picked values.
    """
    import mlx.core as mx  # optional heavy dependency: NumPy outputs are checked without MLX

    if tuple(out.shape) != ref.shape:
        return None
    axes = _outer_axes(ref.index, out.ndim)
    if axes is None:
        return np.array(out.astype(mx.float32), dtype=np.float64)[ref.index]
    finite = mx.all(mx.isfinite(out))
    picked = out
    for axis, keep in enumerate(axes):
        if keep is not None:
            picked = mx.take(picked, mx.array(keep.astype(np.int32)), axis=axis)
    values = np.array(picked.astype(mx.float32), dtype=np.float64)
    if not bool(finite.item()):
        values.flat[0] = math.inf
    return values


def _is_mlx(out: Any) -> bool:
    return type(out).__module__.startswith("mlx")


def relative_error(out: Any, ref: Reference) -> float:
    """||out - ref|| / ||ref|| in float64 over what `ref` covers (NaN, inf or a wrong shape: inf).

    `out` is a NumPy array or an MLX array; an MLX one is compared at `ref`'s subset without
    copying the rest of it off the device (`device_pick`).
    """
    if isinstance(ref, ReferenceSubset) and _is_mlx(out):
        picked = device_pick(out, ref)
        if picked is None:
            return math.inf
        return _relative(picked, ref.values)
    if _is_mlx(out):
        import mlx.core as mx  # optional heavy dependency: NumPy outputs are checked without MLX

        out = np.array(out.astype(mx.float32))
    out64 = np.asarray(out, dtype=np.float64)
    if isinstance(ref, ReferenceSubset):
        picked = ref.pick(out64)
        if picked is None:
            return math.inf
        out64, ref = picked, ref.values
    return _relative(out64, ref)


def _relative(out64: np.ndarray, ref: np.ndarray) -> float:
    if out64.shape != ref.shape or not np.all(np.isfinite(out64)):
        return math.inf
    denom = float(np.linalg.norm(ref))
    return float(np.linalg.norm(out64 - ref) / (denom if denom > 0 else 1.0))


def describe(ref: Reference) -> str:
    """`all 512 x 21504` or the subset's description."""
    return ref.describe() if isinstance(ref, ReferenceSubset) else "all " + " x ".join(map(str, ref.shape))
