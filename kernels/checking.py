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


Reference = np.ndarray | ReferenceSubset


def relative_error(out: Any, ref: Reference) -> float:
    """||out - ref|| / ||ref|| in float64 over what `ref` covers (NaN, inf or a wrong shape: inf)."""
    out64 = np.asarray(out, dtype=np.float64)
    if isinstance(ref, ReferenceSubset):
        picked = ref.pick(out64)
        if picked is None:
            return math.inf
        out64, ref = picked, ref.values
    if out64.shape != ref.shape or not np.all(np.isfinite(out64)):
        return math.inf
    denom = float(np.linalg.norm(ref))
    return float(np.linalg.norm(out64 - ref) / (denom if denom > 0 else 1.0))


def describe(ref: Reference) -> str:
    """`all 512 x 21504` or the subset's description."""
    return ref.describe() if isinstance(ref, ReferenceSubset) else "all " + " x ".join(map(str, ref.shape))
