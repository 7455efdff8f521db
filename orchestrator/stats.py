"""Statistics over tidy result rows: medians with bootstrap intervals, ratios of medians, verdicts.

Only clean samples count: rows with `status == "ok"`, not `contended`, and a finite value. A
group is one (device, case, parameter point, arm, metric) -- or, when two runs, commits or
devices are compared, the same key with that dimension left out.

Intervals are percentile bootstraps of the median (vectorised NumPy, 2000 resamples by default),
seeded from the group's key so the same data always gives the same interval. A ratio of medians
resamples both sides independently.

Verdicts of a comparison (`classify`), with a relevance threshold `t` (default 3 %, the gap the
sweeps are sized to resolve) and the ratio oriented so that > 1 is better:

* SAME: the whole interval lies inside [1/(1+t), 1+t] -- any difference is smaller than `t`.
* FASTER / SLOWER: the whole interval lies above / below 1 (the direction is settled) and it
  reaches past the band (the change may matter).
* AMBIGUOUS: the interval holds 1 and reaches past the band -- it straddles the threshold; the
  comparison then estimates how many more samples per side would settle it.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

RESAMPLES = 2000
LEVEL = 0.95
THRESHOLD = 0.03

# Metrics where a smaller value is the better one; every other metric is a rate (higher is better).
LOWER_IS_BETTER = frozenset({"seconds", "load_seconds", "peak_memory_bytes", "rel_error", "lock_wait_s"})

# The columns that name a group besides the parameter point.
GROUP_COLUMNS = ("device", "case", "case_name", "arm", "metric", "run_id", "code_version")


def higher_is_better(metric: str) -> bool:
    """True for rates (tok/s, GB/s, TFLOP/s); False for times, memory and errors."""
    return metric not in LOWER_IS_BETTER and not metric.endswith("_seconds") and not metric.endswith("_bytes")


class Verdict(StrEnum):
    """The outcome of comparing one side with another."""

    FASTER = "FASTER"
    SLOWER = "SLOWER"
    SAME = "SAME"
    AMBIGUOUS = "AMBIGUOUS"


@dataclass(frozen=True)
class Summary:
    """The median of a group's clean samples with its bootstrap interval and spread."""

    n: int
    median: float
    ci_low: float
    ci_high: float
    cv: float  # standard deviation / mean (ddof=1); nan for fewer than two samples


@dataclass(frozen=True)
class Ratio:
    """`median(a) / median(b)` with its bootstrap interval."""

    ratio: float
    ci_low: float
    ci_high: float
    n_a: int
    n_b: int


@dataclass(frozen=True)
class Comparison:
    """A ratio of medians and what it says, oriented so that > 1 means `a` is better."""

    ratio: Ratio
    speedup: Ratio  # the ratio turned so that > 1 is better (inverted for times and memory)
    verdict: Verdict
    threshold: float
    more_samples: int | None  # AMBIGUOUS only: about how many more samples per side settle it


def seed_for(*key: object) -> int:
    """A stable seed from a group key (same data, same interval, every time)."""
    return zlib.crc32(repr(key).encode())


def _clean_values(values: Iterable[float]) -> np.ndarray:
    arr = np.asarray(list(values) if not isinstance(values, np.ndarray) else values, dtype=np.float64)
    return arr[np.isfinite(arr)]


def bootstrap_medians(values: np.ndarray, rng: np.random.Generator, resamples: int = RESAMPLES) -> np.ndarray:
    """Medians of `resamples` bootstrap resamples of `values` (one vectorised draw)."""
    n = len(values)
    idx = rng.integers(0, n, size=(resamples, n))
    return np.median(values[idx], axis=1)


def summarize(values: Iterable[float], *, seed: int = 0, resamples: int = RESAMPLES, level: float = LEVEL) -> Summary:
    """Median, bootstrap interval of the median, coefficient of variation and count.

    Args:
        values: the clean samples of one group (non-finite values are dropped).
        seed: seeds the bootstrap; `seed_for(key)` makes it reproducible per group.
        resamples: bootstrap resamples.
        level: confidence level of the interval.

    Returns:
        The summary; one sample gives an interval of that value alone, none gives nan.
    """
    x = _clean_values(values)
    n = len(x)
    if n == 0:
        return Summary(0, math.nan, math.nan, math.nan, math.nan)
    med = float(np.median(x))
    if n == 1:
        return Summary(1, med, med, med, math.nan)
    meds = bootstrap_medians(x, np.random.default_rng(seed), resamples)
    alpha = (1 - level) / 2
    lo, hi = np.quantile(meds, [alpha, 1 - alpha])
    mean = float(np.mean(x))
    cv = float(np.std(x, ddof=1) / mean) if mean != 0 else math.nan
    return Summary(n, med, float(lo), float(hi), cv)


def ratio_of_medians(
    a: Iterable[float],
    b: Iterable[float],
    *,
    seed: int = 0,
    resamples: int = RESAMPLES,
    level: float = LEVEL,
) -> Ratio:
    """`median(a) / median(b)` with a bootstrap interval that resamples both sides independently."""
    xa, xb = _clean_values(a), _clean_values(b)
    if len(xa) == 0 or len(xb) == 0:
        return Ratio(math.nan, math.nan, math.nan, len(xa), len(xb))
    point = float(np.median(xa) / np.median(xb)) if np.median(xb) != 0 else math.nan
    if len(xa) == 1 and len(xb) == 1:
        return Ratio(point, point, point, 1, 1)
    rng = np.random.default_rng(seed)
    ra = bootstrap_medians(xa, rng, resamples)
    rb = bootstrap_medians(xb, rng, resamples)
    with np.errstate(divide="ignore", invalid="ignore"):
        ratios = ra / rb
    ratios = ratios[np.isfinite(ratios)]
    if len(ratios) == 0:
        return Ratio(point, math.nan, math.nan, len(xa), len(xb))
    alpha = (1 - level) / 2
    lo, hi = np.quantile(ratios, [alpha, 1 - alpha])
    return Ratio(point, float(lo), float(hi), len(xa), len(xb))


def more_samples_needed(ratio: Ratio, boundary: float) -> int | None:
    """About how many more samples per side shrink the interval off `boundary`.

    The interval's half-width falls as 1/sqrt(n) (in log space); it must fall below the distance
    from the point estimate to the boundary. None when the estimate sits on the boundary.
    """
    if not (ratio.ratio > 0 and ratio.ci_low > 0 and ratio.ci_high > 0 and boundary > 0):
        return None
    centre = math.log(ratio.ratio)
    half = (math.log(ratio.ci_high) - math.log(ratio.ci_low)) / 2
    distance = abs(centre - math.log(boundary))
    if distance < 1e-12 or half <= 0:
        return None
    n = max(ratio.n_a, ratio.n_b)
    needed = math.ceil(n * (half / distance) ** 2)
    return max(needed - n, 1)


def _oriented(ratio: Ratio, higher: bool) -> Ratio:
    if higher:
        return ratio
    inv = [1 / v if v and math.isfinite(v) else math.nan for v in (ratio.ratio, ratio.ci_high, ratio.ci_low)]
    return Ratio(inv[0], inv[1], inv[2], ratio.n_a, ratio.n_b)


def classify(speedup: Ratio, threshold: float = THRESHOLD) -> tuple[Verdict, int | None]:
    """The verdict of an oriented ratio (> 1 is better) and, if AMBIGUOUS, samples to settle it."""
    lo, hi = speedup.ci_low, speedup.ci_high
    band_lo, band_hi = 1 / (1 + threshold), 1 + threshold
    if not (math.isfinite(lo) and math.isfinite(hi)):
        return Verdict.AMBIGUOUS, None
    if lo >= band_lo and hi <= band_hi:
        return Verdict.SAME, None
    if lo > 1:
        return Verdict.FASTER, None
    if hi < 1:
        return Verdict.SLOWER, None
    # The interval holds 1 and reaches past the band: settle it either by leaving 1 or by
    # fitting in the band, whichever needs fewer samples.
    edge = band_hi if speedup.ratio >= 1 else band_lo
    options = [m for m in (more_samples_needed(speedup, 1.0), _to_fit_band(speedup, edge)) if m is not None]
    return Verdict.AMBIGUOUS, min(options) if options else None


def _to_fit_band(speedup: Ratio, edge: float) -> int | None:
    """More samples per side for the whole interval to fit inside the band edge."""
    if not (speedup.ratio > 0 and speedup.ci_low > 0):
        return None
    room = abs(math.log(edge)) - abs(math.log(speedup.ratio))
    half = (math.log(speedup.ci_high) - math.log(speedup.ci_low)) / 2
    if room <= 1e-12 or half <= 0:
        return None
    n = max(speedup.n_a, speedup.n_b)
    return max(math.ceil(n * (half / room) ** 2) - n, 1)


def compare_samples(
    a: Iterable[float],
    b: Iterable[float],
    *,
    metric: str = "prefill_tok_s",
    threshold: float = THRESHOLD,
    seed: int = 0,
    resamples: int = RESAMPLES,
) -> Comparison:
    """Compare side `a` with side `b` (the baseline) on one metric.

    Args:
        a: clean samples of the compared side.
        b: clean samples of the baseline.
        metric: decides the orientation (times and memory: lower is better).
        threshold: the smallest relative change that matters.
        seed: seeds the bootstrap.
        resamples: bootstrap resamples.

    Returns:
        The raw ratio `median(a)/median(b)`, the oriented speedup, the verdict and, when
        AMBIGUOUS, about how many more samples per side would settle it.
    """
    ratio = ratio_of_medians(a, b, seed=seed, resamples=resamples)
    speedup = _oriented(ratio, higher_is_better(metric))
    verdict, more = classify(speedup, threshold)
    return Comparison(ratio, speedup, verdict, threshold, more)


# ------------------------------------------------------------------------------------ tables


def clean_rows(table: pa.Table) -> pa.Table:
    """Only the rows that count as samples: status ok, not contended, a finite value."""
    if table.num_rows == 0:
        return table
    ok = pc.equal(table["status"], "ok")
    not_contended = pc.invert(pc.fill_null(table["contended"], False))
    finite = pc.and_(pc.is_valid(table["value"]), pc.is_finite(pc.fill_null(table["value"], 0.0)))
    return table.filter(pc.and_(pc.and_(ok, not_contended), finite))


Point = tuple[tuple[str, str], ...]


def point_of(params: Sequence[tuple[str, str]] | dict[str, str] | None) -> Point:
    """A parameter point as a sorted tuple of (name, value-as-text) pairs."""
    if params is None:
        return ()
    items = params.items() if isinstance(params, dict) else params
    return tuple(sorted((str(k), str(v)) for k, v in items))


@dataclass(frozen=True)
class GroupKey:
    """What a set of samples is of."""

    device: str
    case_name: str
    point: Point
    arm: str
    metric: str
    run_id: str | None = None
    code_version: str | None = None


def sample_groups(table: pa.Table, *, split_runs: bool = False) -> dict[GroupKey, list[float]]:
    """Clean samples by group. `split_runs` keeps runs and code versions apart."""
    rows = clean_rows(table)
    cols: dict[str, list[Any]] = {
        name: rows[name].to_pylist()
        for name in ("device", "case_name", "params", "arm", "metric", "value", "run_id", "code_version")
    }
    out: dict[GroupKey, list[float]] = {}
    for i in range(rows.num_rows):
        key = GroupKey(
            cols["device"][i],
            cols["case_name"][i],
            point_of(cols["params"][i]),
            cols["arm"][i],
            cols["metric"][i],
            cols["run_id"][i] if split_runs else None,
            cols["code_version"][i] if split_runs else None,
        )
        out.setdefault(key, []).append(float(cols["value"][i]))
    return out


def summarize_groups(groups: dict[GroupKey, list[float]], *, resamples: int = RESAMPLES) -> dict[GroupKey, Summary]:
    """`summarize` for every group, seeded by its key."""
    return {key: summarize(vals, seed=seed_for(key), resamples=resamples) for key, vals in groups.items()}


def latest_runs(table: pa.Table) -> pa.Table:
    """Per (device, case, point), only the rows of the newest run that measured it.

    Resumed sweeps keep the older run's points; a point measured again replaces its older rows
    instead of pooling samples from different code or conditions.
    """
    if table.num_rows == 0:
        return table
    cols = {c: table[c].to_pylist() for c in ("device", "case_name", "params", "run_id", "started_at")}
    newest: dict[tuple[str, str, Point], tuple[Any, str]] = {}
    keys = []
    for i in range(table.num_rows):
        key = (cols["device"][i], cols["case_name"][i], point_of(cols["params"][i]))
        keys.append(key)
        stamp = (cols["started_at"][i] is not None, cols["started_at"][i] or 0, cols["run_id"][i])
        best = newest.get(key)
        if best is None or stamp > best[0]:
            newest[key] = (stamp, cols["run_id"][i])
    mask = [cols["run_id"][i] == newest[keys[i]][1] for i in range(table.num_rows)]
    return table.filter(pa.array(mask, pa.bool_()))
