"""Statistics over ordered samples: medians with bootstrap intervals, paired ratios, verdicts.

Pure functions over arrays of samples; the data layer hands them over in sample order, with each
sample's pairing key where it has one. Only clean samples count: rows with `status == "ok"`, not
`contended`, and a finite value.

**Intervals.** A group's median has a percentile interval from a *smoothed* bootstrap (each
resample jittered by h = IQR / 1.349 / sqrt(n), Silverman and Young's remedy for the median's
lumpy bootstrap distribution): by simulation it covers 91-96 % at n = 5..30 under normal and
heavy-tailed noise, where the plain percentile interval dips to 89 %. 2000 resamples.

**Comparisons are paired where the samples are, in ABBA blocks.** Arms of one job are measured
interleaved in ABBA order (`workers.job.measure`), so sample i of arm A and sample i of the
baseline were taken side by side: they pair by (run, job, sample). Two consecutive rounds form a
block (A B, B A; `workers.contract.precision`), keyed (run, job, sample // 2); a block's value is
the mean of its pairs' log ratios, which cancels whatever the first slot of a round gains or
loses, and the comparison is the median of the block values with the smoothed-bootstrap interval
over blocks (`precision.median_interval`: the worker stops sampling on the same interval). With
an odd number of rounds the median of per-pair ratios keeps a 3 % slot effect as a bias of
1.5-2 %; the block statistic keeps under a third of that (the lone last round is a block of its
own; the worker's adaptive sampling ends on whole blocks; tests). Drift across the job (clocks, heat, a
neighbour) cancels in each pair; treated as independent samples it widens both sides' intervals
(an 8 % drift made identical arms AMBIGUOUS 91 % of the time). Samples without a partner
(another run, another device) are compared unpaired: the difference of the two sides' log
medians, each side resampled on its own. Either way the samples are put in a canonical order
(pairs by key, unpaired values sorted) before the bootstrap, so the same samples give the same
interval whatever order a reader hands them over in (`compare` and `check` agree).

**One seed per group of samples.** Everything is computed on the oriented log ratio (> 0: `a` is
better), and the bootstrap is seeded by the group, not the metric, so `seconds`, `prefill_tok_s`,
`gb_per_s` and `tflop_per_s` from the same samples get the same interval and verdict.

**Verdicts** (`classify`), with a relevance threshold `t` (default 3 %) as a band
[1/(1+t), 1+t] around 1, as criterion.rs does it:

* FASTER / SLOWER: the whole interval lies past the band (the change is larger than `t`);
* SAME: the whole interval lies inside the band (any change is smaller than `t`);
* AMBIGUOUS: the interval reaches across an edge of the band; `settle` says about how many
  samples per side bring the interval to the target half-width, or that the estimate sits on
  the edge (`orchestrator.analysis.power.samples_to_settle`);
* TOO FEW: fewer than `MIN_SAMPLES` (5) samples per side, where an interval covers 50-78 %
  instead of 95 % (`n=3: too few to judge`). The count is of samples (a sweep's minimum
  repetitions); the interval itself rests on the blocks they make (5 samples: 3 blocks).
  Metrics measured once per arm by construction (`EXACT_METRICS`: peak memory, relative error)
  are compared as exact numbers instead.

**A table of comparisons** is a family of tests: `orchestrator.analysis.fdr.control_fdr` keeps a
FASTER/SLOWER only where Benjamini-Hochberg at q = 5 % over the table rejects "the change lies
within the band", with p-values read off the same bootstrap draws as the interval
(`orchestrator.analysis.power.past_p_value`: p < 0.05 exactly when the interval lies past the
band). **Heavy tails** (a few samples far from the rest, as on a shared
GPU) are counted per group (`Summary.outliers`), as hyperfine warns, never silently absorbed.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from enum import StrEnum

import numpy as np

from orchestrator.analysis.groups import EXACT_METRICS, Point, block_values, higher_is_better, paired_samples
from orchestrator.analysis.power import Settle, past_p_value, samples_to_settle
from workers.contract.precision import LEVEL, RESAMPLES, median_interval, seed_for, smoothed_medians

THRESHOLD = 0.03
MIN_SAMPLES = 5
# A sample is an outlier more than 2x (or under half) the group's median, or with a modified
# z-score (on log values, robust spread 1.4826 MAD) over hyperfine's 14: at 2-10 % noise a 3x
# sample is always caught; normal noise of 10 % never reaches 2x.
OUTLIER_FACTOR = 2.0
OUTLIER_Z = 14.0


class Verdict(StrEnum):
    """The outcome of comparing one side with another."""

    FASTER = "FASTER"
    SLOWER = "SLOWER"
    SAME = "SAME"
    AMBIGUOUS = "AMBIGUOUS"
    TOO_FEW = "TOO FEW"


@dataclass(frozen=True)
class Summary:
    """The median of a group's clean samples with its bootstrap interval, spread and outliers."""

    n: int
    median: float
    ci_low: float
    ci_high: float
    cv: float  # standard deviation / mean (ddof=1); nan for fewer than two samples
    outliers: int = 0  # samples far from the rest (see OUTLIER_FACTOR, OUTLIER_Z)

    @property
    def heavy_tailed(self) -> bool:
        """True when the group has outliers: its median stands, but the machine was not quiet."""
        return self.outliers > 0


@dataclass(frozen=True)
class Ratio:
    """`a / b` with its bootstrap interval: the median per-pair ratio when paired, else the ratio
    of medians."""

    ratio: float
    ci_low: float
    ci_high: float
    n_a: int
    n_b: int
    paired: bool = False

    @property
    def n(self) -> int:
        """Samples per side the interval rests on (pairs when paired, else the larger side)."""
        return min(self.n_a, self.n_b) if self.paired else max(self.n_a, self.n_b)


@dataclass(frozen=True)
class Comparison:
    """A ratio and what it says, oriented so that > 1 means `a` is better.

    Attributes:
        ratio: the raw ratio `a / b` with its interval.
        speedup: the ratio turned so that > 1 is better (inverted for times and memory).
        verdict: see the module docstring.
        threshold: the relevance threshold `t`.
        settle: AMBIGUOUS / TOO FEW: what more samples would do (`power.Settle`).
        p_value: two-sided, for "the change lies within the band" (nan: exact or too few).
        note: why there is no verdict (`n=3: too few to judge`, or FDR's demotion).
        precision: the target relative half-width the samples were taken to, if any (plans `settle`).
        draws: the sorted bootstrap draws of the raw log ratio `log(a / b)` behind the interval
            (empty: exact); every p-value of this comparison is read off them.
    """

    ratio: Ratio
    speedup: Ratio
    verdict: Verdict
    threshold: float
    settle: Settle | None
    p_value: float = math.nan
    note: str | None = None
    draws: np.ndarray = field(default_factory=lambda: np.empty(0), compare=False, repr=False)
    precision: float | None = None

    @property
    def more_samples(self) -> int | None:
        """About how many more samples per side settle it (None: settled, or on the band's edge)."""
        return self.settle.more if self.settle else None


def comparison_seed(case_name: str, point: Point, dims: tuple[str, ...], side: str, baseline: str) -> int:
    """The bootstrap seed of one comparison (`side` against `baseline` at a case's point, on the
    row's other dimensions, e.g. the device): the same for every metric of its samples, and the
    same for `compare` and `check`, so the two give one interval and one p-value."""
    return seed_for((case_name, point, tuple(dims)), side, baseline)


def _clean_values(values: Iterable[float]) -> np.ndarray:
    arr = np.asarray(list(values) if not isinstance(values, np.ndarray) else values, dtype=np.float64)
    return arr[np.isfinite(arr)]


def count_outliers(values: Iterable[float]) -> int:
    """Samples more than `OUTLIER_FACTOR` from the median, or past hyperfine's modified z of 14."""
    x = _clean_values(values)
    if len(x) < 3 or np.any(x <= 0):  # times and rates are positive; "2x the median" means nothing otherwise
        return 0
    logs = np.log(x)
    dev = np.abs(logs - np.median(logs))
    spread = 1.4826 * float(np.median(dev))
    far = dev > math.log(OUTLIER_FACTOR)
    if spread > 0:
        far |= dev / spread > OUTLIER_Z
    return int(np.count_nonzero(far))


def summarize(values: Iterable[float], *, seed: int = 0, resamples: int = RESAMPLES, level: float = LEVEL) -> Summary:
    """Median, smoothed-bootstrap interval of the median, coefficient of variation, count, outliers.

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
    meds = smoothed_medians(x, np.random.default_rng(seed), resamples)
    alpha = (1 - level) / 2
    lo, hi = np.quantile(meds, [alpha, 1 - alpha])
    mean = float(np.mean(x))
    cv = float(np.std(x, ddof=1) / mean) if mean != 0 else math.nan
    return Summary(n, med, float(lo), float(hi), cv, count_outliers(x))


# ------------------------------------------------------------------------------- comparisons


@dataclass(frozen=True)
class LogRatio:
    """The oriented log ratio of two sides (> 0: `a` is better) with its bootstrap interval."""

    point: float
    lo: float
    hi: float
    n_a: int
    n_b: int
    paired: bool
    blocks: int = 0  # ABBA blocks the paired interval rests on (0: unpaired)
    draws: np.ndarray = field(default_factory=lambda: np.empty(0), compare=False, repr=False)  # sorted

    @property
    def n(self) -> int:
        """Samples per side that the interval rests on (pairs when paired)."""
        return min(self.n_a, self.n_b) if self.paired else max(self.n_a, self.n_b)


def _oriented_logs(values: np.ndarray, higher: bool) -> np.ndarray:
    """log values, negated for lower-is-better metrics: > 0 differences always mean better."""
    return np.log(values) if higher else -np.log(values)


def log_ratio(
    a: Iterable[float],
    b: Iterable[float],
    *,
    higher: bool = True,
    seed: int = 0,
    resamples: int = RESAMPLES,
    level: float = LEVEL,
    a_keys: Sequence[Hashable] | None = None,
    b_keys: Sequence[Hashable] | None = None,
) -> LogRatio:
    """The oriented log ratio of `a` over `b`, paired in ABBA blocks where the keys pair them.

    Args:
        a, b: samples (non-finite and non-positive values are dropped); their order is not used.
        higher: the metric's orientation (`higher_is_better`).
        seed: seeds the bootstrap: pass the same seed for every metric of the same samples.
        resamples: bootstrap resamples.
        level: confidence level.
        a_keys, b_keys: each sample's pairing key, (run, job, sample); samples whose key appears
            on both sides are pairs, and pairs of one (run, job, sample // 2) are a block. Paired
            when at least `MIN_SAMPLES` pairs exist, or every sample of the smaller side has its
            partner.
    """
    xa, xb = np.asarray(list(a), dtype=np.float64), np.asarray(list(b), dtype=np.float64)
    ok_a, ok_b = np.isfinite(xa) & (xa > 0), np.isfinite(xb) & (xb > 0)
    keys_a = None if a_keys is None else [k for k, ok in zip(a_keys, ok_a, strict=True) if ok]
    keys_b = None if b_keys is None else [k for k, ok in zip(b_keys, ok_b, strict=True) if ok]
    xa, xb = xa[ok_a], xb[ok_b]
    if len(xa) == 0 or len(xb) == 0:
        return LogRatio(math.nan, math.nan, math.nan, len(xa), len(xb), False)
    pairs = paired_samples(xa, xb, keys_a, keys_b)
    if pairs is not None and (len(pairs[0]) >= MIN_SAMPLES or len(pairs[0]) == min(len(xa), len(xb))):
        keys, pa_, pb_ = pairs
        blocks = block_values(keys, _oriented_logs(pa_, higher) - _oriented_logs(pb_, higher))
        interval = median_interval(blocks, seed=seed, resamples=resamples, level=level)
        draws = np.sort(interval.draws)
        lo, hi = (interval.lo, interval.hi) if len(blocks) > 1 else (interval.point, interval.point)
        return LogRatio(interval.point, lo, hi, len(pa_), len(pb_), True, len(blocks), draws)
    ua, ub = np.sort(_oriented_logs(xa, higher)), np.sort(_oriented_logs(xb, higher))
    rng = np.random.default_rng(seed)
    draws = np.sort(smoothed_medians(ua, rng, resamples) - smoothed_medians(ub, rng, resamples))
    alpha = (1 - level) / 2
    lo, hi = (float(v) for v in np.quantile(draws, [alpha, 1 - alpha]))
    return LogRatio(float(np.median(ua) - np.median(ub)), lo, hi, len(xa), len(xb), False, 0, draws)


def _as_ratio(log: LogRatio, higher: bool) -> tuple[Ratio, Ratio]:
    """(raw ratio a/b, oriented speedup), each with its interval."""
    speedup = Ratio(math.exp(log.point), math.exp(log.lo), math.exp(log.hi), log.n_a, log.n_b, log.paired)
    if higher:
        return speedup, speedup
    raw = Ratio(math.exp(-log.point), math.exp(-log.hi), math.exp(-log.lo), log.n_a, log.n_b, log.paired)
    return raw, speedup


def classify(log: LogRatio, threshold: float = THRESHOLD) -> Verdict:
    """FASTER / SLOWER / SAME / AMBIGUOUS of an oriented log ratio against the band `1 ± t`."""
    edge = math.log1p(threshold)
    if not (math.isfinite(log.lo) and math.isfinite(log.hi)):
        return Verdict.AMBIGUOUS
    if log.lo > edge:
        return Verdict.FASTER
    if log.hi < -edge:
        return Verdict.SLOWER
    if log.lo >= -edge and log.hi <= edge:
        return Verdict.SAME
    return Verdict.AMBIGUOUS


def compare_samples(
    a: Iterable[float],
    b: Iterable[float],
    *,
    metric: str = "prefill_tok_s",
    threshold: float = THRESHOLD,
    seed: int = 0,
    resamples: int = RESAMPLES,
    a_keys: Sequence[Hashable] | None = None,
    b_keys: Sequence[Hashable] | None = None,
    precision: float | None = None,
) -> Comparison:
    """Compare side `a` with side `b` (the baseline) on one metric (see the module docstring).

    Args:
        a: clean samples of the compared side.
        b: clean samples of the baseline.
        metric: decides the orientation (times and memory: lower is better) and exactness.
        threshold: the smallest relative change that matters.
        seed: seeds the bootstrap: one seed per group of samples, not per metric.
        resamples: bootstrap resamples.
        a_keys, b_keys: pairing keys per sample (`log_ratio`); None: unpaired.
        precision: the sweep's target relative half-width, if it has one (`power.samples_to_settle`).

    Returns:
        The raw ratio, the oriented speedup, the verdict and, when AMBIGUOUS or TOO FEW, what more
        samples would do.
    """
    higher = higher_is_better(metric)
    xa, xb = _clean_values(a), _clean_values(b)
    if metric in EXACT_METRICS and 0 < min(len(xa), len(xb)) < MIN_SAMPLES:
        return _exact(float(np.median(xa)), float(np.median(xb)), len(xa), len(xb), higher, threshold)
    log = log_ratio(a, b, higher=higher, seed=seed, resamples=resamples, a_keys=a_keys, b_keys=b_keys)
    raw, speedup = _as_ratio(log, higher)
    raw_draws = log.draws if higher else -log.draws[::-1]
    if log.n < MIN_SAMPLES:
        settle = Settle(MIN_SAMPLES - log.n)
        return Comparison(
            raw, speedup, Verdict.TOO_FEW, threshold, settle, note=f"n={log.n}: too few to judge", draws=raw_draws
        )
    verdict = classify(log, threshold)
    edge = math.log1p(threshold)
    p = past_p_value(log.draws, -edge, edge)
    c = Comparison(raw, speedup, verdict, threshold, None, p, draws=raw_draws, precision=precision)
    if verdict is not Verdict.AMBIGUOUS:
        return c
    settle = settle_of(c)
    return replace(c, settle=settle, note=settle.edge_note())


def settle_of(c: Comparison, *, bound: float | None = None) -> Settle:
    """What more samples would do for an open comparison: against `bound` (a raw ratio a criterion
    straddles), else the band edge nearest its estimate (`power.samples_to_settle`)."""
    r = c.ratio
    if not (r.ratio > 0 and r.ci_low > 0 and r.ci_high > 0):
        return Settle(None)
    point = math.log(r.ratio)
    edge = math.log(bound) if bound else math.copysign(math.log1p(c.threshold), point)
    return samples_to_settle(point, math.log(r.ci_low), math.log(r.ci_high), r.n, edge, c.precision)


def _exact(a: float, b: float, n_a: int, n_b: int, higher: bool, threshold: float) -> Comparison:
    """Two numbers measured once by construction: their ratio has no interval to speak of."""
    point = a / b if b != 0 else math.nan
    raw = Ratio(point, point, point, n_a, n_b)
    turned = point if higher or not point else 1 / point
    speedup = Ratio(turned, turned, turned, n_a, n_b)
    log = math.log(turned) if turned > 0 and math.isfinite(turned) else math.nan
    verdict = classify(LogRatio(log, log, log, n_a, n_b, False), threshold)
    return Comparison(raw, speedup, verdict, threshold, None)
