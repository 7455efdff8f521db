"""How sure a comparison is, and how many samples would make it surer (pure functions, log scale).

`band_p_value` turns a bootstrap interval into a p-value for "the change lies within the
threshold band", for Benjamini-Hochberg over a table (`orchestrator.analysis.fdr`); `samples_to_settle`
and `samples_to_clear` are the power calculations behind "about N more samples would settle it".
"""

from __future__ import annotations

import math
from statistics import NormalDist

LEVEL = 0.95
POWER = 0.80
# Planned at 90 % at the estimate: the estimate itself is off, and by simulation (tests) a plan
# at 80 % settled only 74-81 % of AMBIGUOUS comparisons; planned this way 84-98 % settle.
PLAN_MARGIN = 0.10
NORMAL = NormalDist()


def band_p_value(point: float, se: float, threshold: float) -> float:
    """Two-sided p-value of "the change lies within the band" (normal tail at the bootstrap's se).

    Below 0.05 where the 95 % interval lies past the band; continuous, so Benjamini-Hochberg can
    rank comparisons the bootstrap's 2000 resamples could not tell apart.
    """
    if not (math.isfinite(point) and math.isfinite(se)):
        return math.nan
    beyond = abs(point) - math.log1p(threshold)
    if se <= 0:
        return 0.0 if beyond > 0 else 1.0
    return min(1.0, 2 * NORMAL.cdf(-beyond / se))


def samples_to_settle(point: float, se: float, n: int, threshold: float) -> int | None:
    """About how many more samples per side give an 80 % chance of an interval off the band edge
    nearest the estimate (`samples_to_clear`)."""
    return samples_to_clear(abs(abs(point) - math.log1p(threshold)), se, n)


def samples_to_clear(distance: float, se: float, n: int, *, power: float = POWER) -> int | None:
    """More samples per side for a 95 % interval to clear an edge `distance` away (log scale).

    The interval's standard error `se` (at `n` samples per side) falls as 1/sqrt(n); with the
    change equal to the estimate, the interval clears the edge with probability `power` once the
    edge is z_0.975 + z_power standard errors away (planned with `PLAN_MARGIN`). None when the
    estimate sits on the edge or nothing is known of the spread.
    """
    if not (math.isfinite(distance) and math.isfinite(se)) or se <= 0 or n < 1 or distance < 1e-9:
        return None
    z = NORMAL.inv_cdf(1 - (1 - LEVEL) / 2) + NORMAL.inv_cdf(power + PLAN_MARGIN)
    needed = n * (z * se / distance) ** 2
    return max(math.ceil(needed) - n, 1)
