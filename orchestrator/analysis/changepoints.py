"""Level changes in a nightly series: pure functions over per-night log medians.

One value per night: the log of the night's median, oriented so that lower is worse, with its
within-night standard error. Night-to-night noise (clocks, thermal state, neighbours, the OS) is
larger than the within-night error and is what decides whether a night is unusual, so it is
estimated from the nights themselves: the pooled standard deviation of every night in the last
`window` around the mean of its own level (a level is the run of nights between two changes), at
least the within-night error. Each judgement is then a t test against the current level with the
degrees of freedom that pool has, so a series with few nights needs a larger step.

A change is called (`judge_series`) when

* one night lies past the level by more than a two-sided p = `P_ONE` (1e-4) allows, or
* a run of 2..`RUN_NIGHTS` consecutive nights lies past it together by more than p = `P_RUN`
  (1.2e-3) allows (a run starts at a night past the relevance threshold and `FOLLOW_Z` standard
  errors, and goes on while the nights stay `FOLLOW_Z` off in the same direction), or
* the level's last `RUN_NIGHTS` nights lie past the rest of it together by as much (a step whose
  first nights fell too near the level to start a run),

and in every case by more than the relevance threshold (default 2 %: a 3 % criterion needs a
detector that sees 3 %). A night called alone and followed by a night back at the level was a
one-off: it raises that one call and is left out of every later baseline, so no "improvement"
follows it. A change that is called starts a new level at its first night, so a step is called
once; if the next night lies nearer the old level than the new one, the run was transient (one
bad night beside a low one) and the old level comes back, again without a second call. A night
where the host's environment changed (driver, OS, MLX, ...) starts a new level at once: the
change is known, it needs no detection, and its size is reported as such.

By simulation (tests/orchestrator/test_history.py; 1000 series each): at 1 % night-to-night
noise (a ratio series: `orchestrator.analysis.history.series_of`), a 3 % step after 60 nights
is called within its first three nights 93 % of the time, and 4.4 % of stable 60-night series
get any call; at 3 % noise, P(any false call in 30 stable nights) stays under 5 %, and a 10 %
step after 60 nights of history is called on its first or second night >= 90 % of the time (after
30 nights, by its third); one bad night (20 % slower) that returns raises at most one call >= 95 %
of the time; a series 6 % slower on 30 % of nights gets a call in under 15 % of 30-night
stretches. The blamed night is the run's first: a night just before the step that happened to be
low already is named with it (the report lists the run's commits).
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from statistics import NormalDist

THRESHOLD = 0.02
WINDOW = 60  # nights whose scatter estimates the night-to-night noise
MIN_DF = 6  # degrees of freedom of that estimate before anything is judged (7 nights)
P_ONE = 1e-4  # two-sided: one night alone
P_RUN = 1.2e-3  # two-sided: 2-3 consecutive nights together
RUN_NIGHTS = 3
FOLLOW_Z = 1.0
_NORMAL = NormalDist()

NO_HISTORY = "no-history"
STEADY = "steady"
CHANGE = "change"
ENVIRONMENT = "environment"


def t_quantile(p: float, df: int) -> float:
    """Student's t quantile by the Cornish-Fisher expansion (within 0.5 % of the exact one for
    df >= 6 at p <= 0.99985, checked against scipy in the tests; `MIN_DF` keeps df there)."""
    z = _NORMAL.inv_cdf(p)
    return (
        z
        + (z**3 + z) / (4 * df)
        + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * df**2)
        + (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / (384 * df**3)
        + (79 * z**9 + 776 * z**7 + 1482 * z**5 - 1920 * z**3 - 945 * z) / (92160 * df**4)
    )


@dataclass(frozen=True)
class Call:
    """What one night says about its series.

    Attributes:
        kind: `no-history`, `steady`, `change` (a new level, called at this night) or
            `environment` (the host changed here; a new level starts without detection).
        since: the night the change began (its commit is the one to look at); this night otherwise.
        shift: the log change of the night (or the run of nights) against the level (> 0 better).
        lo, hi: its 95 % interval.
        tolerance: the smallest |shift| that would have been called here (log).
        baseline: the nights of the level it was judged against.
    """

    kind: str
    since: int
    shift: float = math.nan
    lo: float = math.nan
    hi: float = math.nan
    tolerance: float = math.nan
    baseline: tuple[int, ...] = ()


class _Series:
    """The detector's state while it walks one series night by night."""

    def __init__(self, y: Sequence[float], se: Sequence[float], window: int, threshold: float) -> None:
        self.y, self.se, self.window = y, se, window
        self.relevant = math.log1p(threshold)
        self.level: list[int] = []  # nights of the current level
        self.levels: list[list[int]] = []  # earlier levels, newest last
        self.one_offs: set[int] = set()  # nights called alone that did not last: in no baseline
        self.run: list[int] = []  # consecutive unusual nights, not yet a change
        self.run_called = False  # the run's first night was called on its own
        self.just_changed = False  # the previous night started a new level

    def base(self) -> list[int]:
        return [i for i in self.level if i not in self.one_offs]

    def mean(self, nights: Sequence[int]) -> float:
        return sum(self.y[i] for i in nights) / len(nights)

    def noise(self, now: int) -> tuple[float, int]:
        """Pooled night-to-night standard deviation over the window and its degrees of freedom."""
        squares, df = 0.0, 0
        for nights in [*self.levels, self.level]:
            kept = [i for i in nights if i >= now - self.window and i not in self.one_offs]
            if len(kept) > 1:
                centre = self.mean(kept)
                squares += sum((self.y[i] - centre) ** 2 for i in kept)
                df += len(kept) - 1
        inside = sorted(self.se[i] for i in self.level if i >= now - self.window)
        floor = inside[len(inside) // 2] if inside else 0.0
        return (max(math.sqrt(squares / df), floor) if df else floor), df

    def new_level(self, nights: list[int]) -> None:
        self.levels.append(self.level)
        self.level, self.run, self.run_called = nights, [], False

    def end_run(self) -> None:
        """The run stops: a night called alone becomes a one-off; the others rejoin their level."""
        if self.run_called and len(self.run) == 1:
            self.one_offs.add(self.run[0])
        else:
            self.level.extend(self.run)
        self.run, self.run_called = [], False

    def back_at_old_level(self, t: int) -> bool:
        """The night after a new level began is nearer the old level than the new one: the run was
        transient (one bad night beside a low one). The old level comes back, the run's nights
        become one-offs, and no "improvement" is called for a change that never lasted."""
        old = [i for i in self.levels[-1] if i not in self.one_offs]
        if not old or abs(self.y[t] - self.mean(old)) >= abs(self.y[t] - self.mean(self.level)):
            return False
        self.one_offs.update(self.level)
        self.level = self.levels.pop()
        return True

    def judge(self, t: int) -> Call:
        """The call for night `t` (it joins its level or the run as it goes)."""
        y = self.y
        sigma, df = self.noise(t)
        if self.just_changed:
            self.just_changed = False
            if self.back_at_old_level(t):
                sigma, df = self.noise(t)
        base = self.base()
        if df < MIN_DF or not base or sigma <= 0:
            self.level.append(t)
            return Call(NO_HISTORY, t)
        mean = self.mean(base)
        z = (y[t] - mean) / (sigma * math.sqrt(1 + 1 / len(base)))
        same_way = bool(self.run) and (y[t] - mean) * (y[self.run[0]] - mean) > 0
        if self.run and same_way and abs(z) > FOLLOW_Z:
            self.run.append(t)  # the run goes on
        else:
            self.end_run()
            # a run starts only at a night off the level on its own, past the noise and the
            # relevance threshold: a mildly low night does not drag a later one into a "change"
            if abs(z) > FOLLOW_Z and abs(y[t] - mean) > self.relevant:
                self.run = [t]
        call = self.judge_run(t, mean, sigma, df, base)
        if t not in self.run and t not in self.level:
            self.level.append(t)
        if call.kind == STEADY and not self.run:
            return self.window_change(t, sigma, df) or call
        return call

    def window_change(self, t: int, sigma: float, df: int) -> Call | None:
        """A change among the level's last `RUN_NIGHTS` nights, judged together against the rest of
        the level: a step whose first nights were too near the level to start a run of their own
        (a 3 % step at 1 % noise puts one of its first nights under 2 % a quarter of the time)."""
        recent = self.level[-RUN_NIGHTS:]
        if recent != list(range(t - RUN_NIGHTS + 1, t + 1)) or self.one_offs.intersection(recent):
            return None
        base = [i for i in self.level[:-RUN_NIGHTS] if i not in self.one_offs]
        if len(base) < 2:
            return None
        shift = self.mean(recent) - self.mean(base)
        se_k = sigma * math.sqrt(1 / RUN_NIGHTS + 1 / len(base))
        tolerance = max(t_quantile(1 - P_RUN / 2, df) * se_k, self.relevant)
        if abs(shift) <= tolerance:
            return None
        half = t_quantile(0.975, df) * se_k
        self.level = self.level[:-RUN_NIGHTS]
        self.new_level(recent)
        self.just_changed = True
        return Call(CHANGE, recent[0], shift, shift - half, shift + half, tolerance, tuple(base))

    def judge_run(self, t: int, mean: float, sigma: float, df: int, base: list[int]) -> Call:
        """The call for night `t` given the run of unusual nights that ends at it (maybe none)."""
        run = self.run
        k = len(run)
        se_k = sigma * math.sqrt(1 / max(k, 1) + 1 / len(base))
        crit = t_quantile(1 - (P_ONE if k <= 1 else P_RUN) / 2, df)
        shift = self.mean(run) - mean if k else self.y[t] - mean
        half = t_quantile(0.975, df) * se_k
        tolerance = max(crit * se_k, self.relevant)
        steady = Call(STEADY, t, shift, shift - half, shift + half, tolerance, tuple(base))
        if not k or abs(shift) <= tolerance:
            if k >= RUN_NIGHTS:  # the oldest night rejoins the level; a slower change is looked for further on
                self.level.append(run.pop(0))
            return steady
        called_already = self.run_called
        if k > 1:  # a lasting change: a new level from the run's first night
            self.new_level(list(run))
            self.just_changed = True
        else:
            self.run_called = True
        if called_already:
            return steady  # called on its first night; this night confirms it
        return Call(CHANGE, run[0] if k else t, shift, steady.lo, steady.hi, tolerance, tuple(base))

    def environment(self, t: int) -> Call:
        """The host changed at night `t`: a new level starts here; the night against the old level."""
        self.end_run()
        sigma, df = self.noise(t)
        base = self.base()
        shift = self.y[t] - self.mean(base)
        if df < MIN_DF or sigma <= 0:  # little history: the night's own error, as if the noise were known
            sigma, df = max(self.se[t], 1e-12), 1_000
        half = t_quantile(0.975, df) * sigma * math.sqrt(1 + 1 / len(base))
        self.new_level([t])
        return Call(ENVIRONMENT, t, shift, shift - half, shift + half, math.nan, tuple(base))


def judge_series(
    y: Sequence[float],
    se: Sequence[float],
    environment_changes: Collection[int] = (),
    *,
    window: int = WINDOW,
    threshold: float = THRESHOLD,
) -> list[Call]:
    """Judge every night of one series in order (see the module docstring).

    Args:
        y: per night, the oriented log median (> 0 differences mean better).
        se: per night, the standard error of that log median within the night.
        environment_changes: nights whose host environment differs from the night before.
        window: nights that estimate the noise.
        threshold: the smallest relative change worth a call.

    Returns:
        One call per night.
    """
    series = _Series(y, se, window, threshold)
    calls = []
    for t in range(len(y)):
        if t in environment_changes and series.base():
            calls.append(series.environment(t))
        else:
            calls.append(series.judge(t))
    return calls
