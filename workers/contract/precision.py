"""How precise a paired comparison is, and when sampling may stop: one rule for worker and head.

Arms of a job are sampled in rounds, in ABBA order (`kernels.timing.abba_order`: forward on even
rounds, reversed on odd ones). Two consecutive rounds form a **block** (A B, B A): the mean of the
block's two log ratios cancels whatever the first slot of a round gains or loses (a 3 % slot
effect biases the median of per-round ratios by +2.4 % at five rounds; the block mean, by
nothing). The comparison of an arm with its baseline is the median of its per-block log ratios,
with a smoothed-bootstrap interval (see `orchestrator.analysis.stats` for why smoothed); its
**half-width** is half that interval's width on the log scale, expressed as a relative change
(`0.01`: the ratio is known to about ±1 %).

The worker samples until every arm's half-width is within the point's `precision`, or its
`max_seconds` or `max_rounds` run out (`stop_reason`); the head reads the same numbers back from
the rows and tops up the points that fell short where the verdict is still open. Both compute the
interval here, from the same draws.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

import numpy as np

LEVEL = 0.95
RESAMPLES = 2000
CHUNK_VALUES = 1 << 22  # bootstrap draws held at once (32 MiB of float64)
ROUNDS_PER_BLOCK = 2
# A precision stop needs this many blocks. The median's bootstrap interval over 3-4 blocks covers
# 85-87 % instead of 95 %, and stopping the first time an interval is narrow enough picks the
# narrow ones: from 8 blocks on, the stopped intervals still cover 92 % or more (tests simulate it).
MIN_BLOCKS = 8
# Without a target the rounds are the sweep's `repetitions`; with one, at most this many.
DEFAULT_MAX_ROUNDS = 400


class StopReason(StrEnum):
    """Why a point's sampling ended (every timed row's `extra.stop_reason`)."""

    PRECISION = "precision"  # every arm's interval reached the target
    BUDGET = "budget"  # `max_seconds` of sampling ran out first
    MAX_ROUNDS = "max_rounds"  # the round limit came first
    FIXED = "fixed"  # no target: the sweep's repetitions, as asked


@dataclass(frozen=True)
class Target:
    """A point's sampling plan: at least `min_rounds`, then until `precision` is reached (relative
    half-width of every arm's 95 % interval to the baseline), within `max_seconds` and `max_rounds`.
    `precision` None: exactly `min_rounds`."""

    min_rounds: int
    precision: float | None = None
    max_seconds: float | None = None
    max_rounds: int = DEFAULT_MAX_ROUNDS

    @property
    def adaptive(self) -> bool:
        return self.precision is not None

    def stop(self, rounds: int, elapsed: float, widths: Sequence[float]) -> StopReason | None:
        """Why to stop after `rounds` rounds and `elapsed` seconds of sampling, or None to go on.

        `widths`: every compared arm's half-width now (nan: not yet known). Rounds end on whole
        blocks, so a stopped point never keeps the first-slot effect of a lone round.
        """
        if not self.adaptive:
            return StopReason.FIXED if rounds >= self.min_rounds else None
        if rounds < self.min_rounds or rounds % ROUNDS_PER_BLOCK:
            return None
        if widths and all(math.isfinite(w) and w <= (self.precision or 0.0) for w in widths):
            return StopReason.PRECISION
        if not widths:
            return StopReason.FIXED  # one arm, nothing to compare: the minimum is all there is to do
        if self.max_seconds is not None and elapsed >= self.max_seconds:
            return StopReason.BUDGET
        if rounds >= max(self.max_rounds, self.min_rounds):
            return StopReason.MAX_ROUNDS
        return None


def seed_for(*key: object) -> int:
    """A stable seed from a group key (same data, same interval, every time)."""
    return zlib.crc32(repr(key).encode())


def row_medians(draws: np.ndarray) -> np.ndarray:
    """`np.median(draws, axis=1)` of finite draws, by one sort (faster on a bootstrap's short rows)."""
    n = draws.shape[1]
    ordered = np.sort(draws, axis=1)
    if n % 2:
        return ordered[:, n // 2]
    return (ordered[:, n // 2 - 1] + ordered[:, n // 2]) / 2


def smoothed_medians(values: np.ndarray, rng: np.random.Generator, resamples: int = RESAMPLES) -> np.ndarray:
    """Medians of `resamples` smoothed bootstrap resamples of `values` (vectorised, bounded memory).

    Each resampled value is jittered by a normal of sd IQR / 1.349 / sqrt(n): the median's plain
    bootstrap distribution is lumpy at small n, and its percentile interval under-covers.
    """
    n = len(values)
    q1, q3 = np.quantile(values, [0.25, 0.75])
    h = (q3 - q1) / 1.349 / math.sqrt(n)
    out = np.empty(resamples)
    step = max(1, CHUNK_VALUES // n)
    for start in range(0, resamples, step):
        rows = min(step, resamples - start)
        draws = values[rng.integers(0, n, size=(rows, n))]
        if h > 0:
            draws = draws + h * rng.standard_normal((rows, n))
        out[start : start + rows] = row_medians(draws)
    return out


def block_log_ratios(rounds: Sequence[int], a: Sequence[float], b: Sequence[float]) -> np.ndarray:
    """Per-block mean log ratios `log(a / b)` of paired samples taken in rounds `rounds`.

    Round r belongs to block r // 2; a block's value is the mean of its rounds' log ratios (a
    block with one round left, as in a series cut short, keeps that round's ratio alone).
    Non-finite or non-positive pairs are dropped.
    """
    r = np.asarray(rounds, dtype=np.int64)
    xa, xb = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    ok = np.isfinite(xa) & np.isfinite(xb) & (xa > 0) & (xb > 0)
    if not ok.any():
        return np.empty(0)
    logs = np.log(xa[ok]) - np.log(xb[ok])
    blocks, index = np.unique(r[ok] // ROUNDS_PER_BLOCK, return_inverse=True)
    sums = np.bincount(index, weights=logs, minlength=len(blocks))
    counts = np.bincount(index, minlength=len(blocks))
    return sums / counts


@dataclass(frozen=True)
class Interval:
    """The median of per-block log ratios with its bootstrap interval, and the draws behind it."""

    point: float
    lo: float
    hi: float
    blocks: int
    draws: np.ndarray

    @property
    def half_width(self) -> float:
        """Half the interval's width as a relative change (nan: no interval)."""
        return relative_half_width(self.lo, self.hi)


def relative_half_width(lo: float, hi: float) -> float:
    """Half of a log-scale interval's width, as a relative change."""
    if not (math.isfinite(lo) and math.isfinite(hi)):
        return math.nan
    return math.expm1((hi - lo) / 2)


def median_interval(values: np.ndarray, *, seed: int = 0, resamples: int = RESAMPLES, level: float = LEVEL) -> Interval:
    """The median of `values` (log ratios) with its smoothed-bootstrap percentile interval."""
    x = np.asarray(values, dtype=np.float64)
    x = x[np.isfinite(x)]
    n = len(x)
    if n == 0:
        return Interval(math.nan, math.nan, math.nan, 0, np.empty(0))
    point = float(np.median(x))
    if n == 1:
        return Interval(point, math.nan, math.nan, 1, np.full(1, point))
    draws = smoothed_medians(x, np.random.default_rng(seed), resamples)
    alpha = (1 - level) / 2
    lo, hi = (float(v) for v in np.quantile(draws, [alpha, 1 - alpha]))
    return Interval(point, lo, hi, n, draws)


def paired_half_width(
    rounds: Sequence[int], a: Sequence[float], b: Sequence[float], *, seed: int = 0, min_blocks: int = MIN_BLOCKS
) -> float:
    """The relative half-width of `a`'s ratio to `b` from paired rounds (nan: under `min_blocks`)."""
    d = block_log_ratios(rounds, a, b)
    if len(d) < max(min_blocks, 2):
        return math.nan
    return median_interval(d, seed=seed).half_width
