"""Statistics: medians with bootstrap intervals, ratios, verdicts -- validated by simulation and
against classical statistics (scipy.stats)."""

from __future__ import annotations

import math
import time

import numpy as np
import pytest
import scipy.stats as ss

from orchestrator import stats
from orchestrator.stats import Verdict
from tests.orchestrator.synthetic_rows import concat, job_table

SIMS = 200


def test_summary_matches_numpy_and_scipy() -> None:
    rng = np.random.default_rng(3)
    x = rng.normal(100.0, 2.0, 25)
    s = stats.summarize(x, seed=1)
    assert s.n == 25
    assert s.median == pytest.approx(float(np.median(x)))
    assert s.cv == pytest.approx(float(ss.variation(x, ddof=1)))
    assert s.ci_low < s.median < s.ci_high
    # The same seed gives the same interval; the width is about that of a median of 25 samples.
    assert stats.summarize(x, seed=1) == s
    assert 0.5 < (s.ci_high - s.ci_low) < 3.5


def test_bootstrap_median_interval_agrees_with_the_order_statistic_interval() -> None:
    """The classical distribution-free interval of the median: order statistics from Binomial(n, 1/2)."""
    rng = np.random.default_rng(11)
    n = 200
    x = rng.normal(0.0, 1.0, n)
    s = stats.summarize(x, seed=5)
    j = int(ss.binom.ppf(0.025, n, 0.5))
    xs = np.sort(x)
    lo, hi = xs[j - 1], xs[n - j]
    assert s.ci_low == pytest.approx(lo, abs=0.06)
    assert s.ci_high == pytest.approx(hi, abs=0.06)


def test_degenerate_groups() -> None:
    assert stats.summarize([]).n == 0 and math.isnan(stats.summarize([]).median)
    one = stats.summarize([4.0])
    assert (one.n, one.median, one.ci_low, one.ci_high) == (1, 4.0, 4.0, 4.0)
    assert stats.summarize([1.0, float("nan"), 3.0]).n == 2  # non-finite values never count
    r = stats.ratio_of_medians([2.0], [4.0])
    assert (r.ratio, r.ci_low, r.ci_high) == (0.5, 0.5, 0.5)


def test_aa_comparison_is_same_in_at_least_95_percent_of_200_simulations() -> None:
    rng = np.random.default_rng(2026)
    verdicts = []
    for i in range(SIMS):
        a = rng.normal(100.0, 1.0, 10)
        b = rng.normal(100.0, 1.0, 10)
        verdicts.append(stats.compare_samples(a, b, metric="prefill_tok_s", seed=i).verdict)
    same = sum(v is Verdict.SAME for v in verdicts) / SIMS
    assert same >= 0.95, f"A/A gave SAME in only {same:.1%}"


@pytest.mark.parametrize("metric", ["prefill_tok_s", "seconds"])
def test_five_percent_slowdown_is_slower_in_at_least_95_percent(metric: str) -> None:
    """10 samples per arm, 1 % noise, the compared arm 5 % slower (lower rate, or longer time)."""
    rng = np.random.default_rng(99)
    slower = 0
    for i in range(SIMS):
        base = rng.normal(1.0, 0.01, 10)
        # a time 5 % longer, or a rate 5 % lower
        centre = 1.05 if metric == "seconds" else 0.95
        arm = rng.normal(centre, 0.01 * centre, 10)
        c = stats.compare_samples(arm, base, metric=metric, seed=i)
        slower += c.verdict is Verdict.SLOWER
    assert slower / SIMS >= 0.95, f"5 % slowdown gave SLOWER in only {slower / SIMS:.1%}"


def test_faster_and_speedup_orientation() -> None:
    rng = np.random.default_rng(4)
    native = rng.normal(13.1, 0.1, 10)  # decode tok/s, seed 1's numbers
    affine = rng.normal(4.92, 0.05, 10)
    c = stats.compare_samples(native, affine, metric="decode_tok_s", seed=1)
    assert c.verdict is Verdict.FASTER
    assert c.ratio.ratio == pytest.approx(np.median(native) / np.median(affine))
    assert 2.6 < c.ratio.ci_low < c.ratio.ratio < c.ratio.ci_high < 2.75
    # Peak memory: lower is better, so a ratio below 1 is the better side (speedup > 1).
    m = stats.compare_samples([37.17e9], [40.44e9], metric="peak_memory_bytes")
    assert m.ratio.ratio == pytest.approx(37.17 / 40.44)
    assert m.speedup.ratio == pytest.approx(40.44 / 37.17)
    assert m.verdict is Verdict.FASTER


def test_significance_agrees_with_mann_whitney() -> None:
    """Where the classical rank test applies (two independent samples, a shift), the interval
    excluding 1 agrees with Mann-Whitney U at 5 % in most cases and always for clear effects."""
    rng = np.random.default_rng(8)
    agree = total = 0
    for effect in (0.0, 0.005, 0.01, 0.02, 0.05):
        clear = effect >= 0.02
        for i in range(40):
            a = rng.normal(1 + effect, 0.01, 30)
            b = rng.normal(1.0, 0.01, 30)
            r = stats.ratio_of_medians(a, b, seed=i)
            ours = r.ci_low > 1 or r.ci_high < 1
            theirs = ss.mannwhitneyu(a, b).pvalue < 0.05
            if clear:
                assert ours and theirs
            agree += ours == theirs
            total += 1
    assert agree / total >= 0.88


def test_ambiguous_says_how_many_more_samples_settle_it() -> None:
    rng = np.random.default_rng(12)
    ambiguous = settled = 0
    for i in range(100):
        a, b = rng.normal(1.05, 0.03, 5), rng.normal(1.0, 0.03, 5)
        c = stats.compare_samples(a, b, seed=i)
        if c.verdict is not Verdict.AMBIGUOUS:
            continue
        ambiguous += 1
        assert c.more_samples is not None and c.more_samples >= 1
        more = c.more_samples
        a2 = np.concatenate([a, rng.normal(1.05, 0.03, more)])
        b2 = np.concatenate([b, rng.normal(1.0, 0.03, more)])
        settled += stats.compare_samples(a2, b2, seed=i).verdict is not Verdict.AMBIGUOUS
    assert ambiguous >= 20  # 5 samples at 3 % noise often cannot tell
    assert settled / ambiguous >= 0.6, f"only {settled}/{ambiguous} settled with the suggested samples"


def test_clean_rows_drop_failed_contended_and_missing_values() -> None:
    point = {"tokens": 512, "n": 64, "k": 64}
    good = job_table({"native": {"seconds": [1.0, 1.1, 1.2]}}, params=point)
    failed = job_table({"native": {"seconds": [9.0, 9.0]}}, params=point, status="failed", run_id="r2")
    contended = job_table({"native": {"seconds": [8.0, 8.0]}}, params=point, contended=True, run_id="r3")
    nan = job_table({"native": {"seconds": [float("nan"), 7.0]}}, params=point, run_id="r4")
    table = concat([good, failed, contended, nan])
    clean = stats.clean_rows(table)
    assert sorted(clean["value"].to_pylist()) == [1.0, 1.1, 1.2, 7.0]
    groups = stats.sample_groups(table)
    (key,) = groups
    assert key.point == (("k", "64"), ("n", "64"), ("tokens", "512"))
    assert sorted(groups[key]) == [1.0, 1.1, 1.2, 7.0]
    split = stats.sample_groups(table, split_runs=True)
    assert {k.run_id for k in split} == {"run1", "r4"}


def test_bootstrap_is_fast() -> None:
    rng = np.random.default_rng(0)
    data = [rng.normal(size=50) for _ in range(50)]
    t0 = time.perf_counter()
    for i, x in enumerate(data):
        stats.compare_samples(x + 10, data[-1 - i] + 10, seed=i)
    assert time.perf_counter() - t0 < 5.0  # 50 comparisons x 2 x 2000 resamples
