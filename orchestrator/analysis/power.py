"""How sure a comparison is, and how many samples would make it surer (pure functions, log scale).

**p-values from the interval's own draws.** `past_p_value` reads the bootstrap draws behind a
comparison's interval: the p-value of "the change lies within [lower, upper]" is twice the share
of draws on the inner side of the nearer edge, where a share is read off the same interpolated
quantile function (`numpy.quantile`'s linear one) that gives the interval's ends. So p < 0.05
exactly when the 95 % interval lies wholly past that edge: a verdict and its p-value never
disagree, and Benjamini-Hochberg over a table (`orchestrator.analysis.fdr`) demotes only verdicts
whose evidence is weak across the table. With every draw past the edge the share is 0: the
p-value is then floored at 1 / (draws + 1), the least a finite set of draws can show (below
0.05 from 20 draws, so the floor never crosses the verdict's line).

**Samples that settle it, by precision.** The interval's half-width falls as 1 / sqrt(n), so
`n * (half_width / target)**2` samples reach a target half-width (planned with `PLAN_MARGIN`,
since the half-width at a few blocks is itself uncertain). The target is the sweep's precision
when it has one, else the distance from the estimate to the band edge it straddles. Where that
distance is under `EDGE_SHARE` of the half-width, or under the precision target, the estimate
sits on the edge: a plan there is mostly noise (taking the estimate for the truth, it asks for
thousands of samples that settle nothing), so no count is given and `Settle` says so.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

# Reaching a target half-width needs the half-width now, itself estimated from a few blocks: by
# simulation (tests) planning on 1.5x the scaled count reaches the target 85-95 % of the time from
# 10 samples at 2-5 % noise (about two thirds from 6); on the scaled count alone, about half.
PLAN_MARGIN = 1.5
# Nearer the edge than this share of the half-width, the verdict is a coin toss at any n.
EDGE_SHARE = 0.25


def _share_at_or_below(ordered: np.ndarray, x: float) -> float:
    """sup{a : quantile(draws, a) <= x} for numpy's linear quantile of the sorted draws."""
    r = len(ordered)
    j = int(np.searchsorted(ordered, x, side="right"))  # draws <= x
    if j == 0:
        return 0.0
    if j == r or r == 1:
        return 1.0
    lo, hi = float(ordered[j - 1]), float(ordered[j])
    return (j - 1 + (x - lo) / (hi - lo)) / (r - 1)


def _share_at_or_above(ordered: np.ndarray, x: float) -> float:
    """1 - inf{a : quantile(draws, a) >= x}: the mirror of `_share_at_or_below`."""
    return _share_at_or_below(-ordered[::-1], -x)


def past_p_value(draws: np.ndarray, lower: float, upper: float) -> float:
    """Two-sided p-value of "the change lies within [lower, upper]" from sorted bootstrap draws.

    p < 1 - level exactly when the level's percentile interval of the same draws lies wholly
    above `upper` or wholly below `lower` (an edge may be infinite: one-sided bounds). nan
    without draws.
    """
    if len(draws) < 2:
        return math.nan
    inside = min(
        _share_at_or_below(draws, upper) if math.isfinite(upper) else 1.0,
        _share_at_or_above(draws, lower) if math.isfinite(lower) else 1.0,
    )
    return min(1.0, max(2 * inside, 1 / (len(draws) + 1)))


@dataclass(frozen=True)
class Settle:
    """What more sampling would do for an open comparison.

    Attributes:
        more: about how many more samples per side reach the target half-width (None: on the edge
            or nothing known of the spread).
        on_edge: the estimate sits on the edge: no sample count settles it.
        change: the estimate as a relative change (`-0.031`), for the edge's message.
        half_width: the interval's relative half-width now, for the edge's message.
    """

    more: int | None
    on_edge: bool = False
    change: float = math.nan
    half_width: float = math.nan

    def edge_note(self) -> str | None:
        """Why no sample count settles it, when the estimate sits on the edge (else None)."""
        if not self.on_edge:
            return None
        return (
            f"the estimate ({self.change:+.1%}, ±{self.half_width:.1%}) sits on the band's edge: "
            "no sample count can be planned to settle it"
        )

    def describe(self) -> str | None:
        """`about 12 more samples per side would settle it`, the edge's note, or None."""
        if self.on_edge:
            return self.edge_note()
        if self.more:
            return f"about {self.more} more samples per side would settle it"
        return None


def samples_to_settle(
    point: float, lo: float, hi: float, n: int, edge: float, precision: float | None = None
) -> Settle:
    """More samples per side for the interval `[lo, hi]` (log, at `n` samples per side) around
    `point` to settle against `edge` (log), the bound it straddles (see the module docstring).

    Args:
        point, lo, hi: the log estimate and its interval.
        n: samples per side the interval rests on.
        edge: the log bound nearest the estimate.
        precision: the sweep's target relative half-width, when it has one.
    """
    change = math.expm1(point) if math.isfinite(point) else math.nan
    half = (hi - lo) / 2
    if not (math.isfinite(half) and math.isfinite(point)) or half <= 0 or n < 1:
        return Settle(None, change=change)
    distance = abs(point - edge)
    target = distance if precision is None else math.log1p(precision)
    if distance < EDGE_SHARE * half or distance < (0.0 if precision is None else target):
        return Settle(None, on_edge=True, change=change, half_width=math.expm1(half))
    needed = PLAN_MARGIN * n * (half / target) ** 2
    return Settle(max(math.ceil(needed) - n, 1), change=change)
