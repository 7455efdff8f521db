"""Statistics: medians with bootstrap intervals, ratios, verdicts -- validated by simulation and
against classical statistics (scipy.stats)."""

from __future__ import annotations

import math
import time

import numpy as np
import pytest
import scipy.stats as ss

from orchestrator.analysis import fdr, groups, stats
from orchestrator.analysis.compare import compare_results
from orchestrator.analysis.samples import grouped_samples
from orchestrator.analysis.stats import Verdict
from tests.orchestrator.synthetic_rows import concat, job_table
from workers.contract import precision

SIMS = 200
KEYS = list(range(10))
MOVED = (Verdict.FASTER, Verdict.SLOWER)


def abba_job(
    rng: np.random.Generator, n: int, noise: float, *, drift: float = 0.0, effect: float = 0.0, tail: float = 0.0
) -> tuple[np.ndarray, np.ndarray]:
    """One job's `seconds` of an arm and its baseline, measured in ABBA order (A B, B A, ...).

    `drift`: the machine slows down linearly by this much from the first sample to the last;
    `effect`: the arm is this much slower; `tail`: this share of samples is 3x slower (a shared GPU).
    """
    order = [side for r in range(n) for side in ((0, 1) if r % 2 == 0 else (1, 0))]
    slot = {0: [i for i, s in enumerate(order) if s == 0], 1: [i for i, s in enumerate(order) if s == 1]}
    out = []
    for side in (0, 1):
        t = np.array(slot[side]) / (2 * n - 1)
        x = (1 + drift * t) * (1 + effect * side) * (1 + noise * rng.standard_normal(n))
        x[rng.random(n) < tail] *= 3
        out.append(x)
    return out[1], out[0]


def verdict_rates(
    n: int = 10, sims: int = SIMS, paired: bool = True, threshold: float = 0.03, **job: float
) -> dict[Verdict, float]:
    """How often each verdict comes out over `sims` simulated jobs (seconds, arm vs baseline)."""
    rng = np.random.default_rng(2026)
    keys = list(range(n)) if paired else None
    counts = dict.fromkeys(Verdict, 0)
    for i in range(sims):
        a, b = abba_job(rng, n, **job)
        c = stats.compare_samples(a, b, metric="seconds", threshold=threshold, seed=i, a_keys=keys, b_keys=keys)
        counts[c.verdict] += 1
    return {v: k / sims for v, k in counts.items()}


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
    r = stats.compare_samples([2.0], [4.0]).ratio
    assert (r.ratio, r.ci_low, r.ci_high) == (0.5, 0.5, 0.5)


def test_faster_and_speedup_orientation() -> None:
    rng = np.random.default_rng(4)
    native = rng.normal(13.1, 0.1, 10)  # decode tok/s, seed 1's numbers
    affine = rng.normal(4.92, 0.05, 10)
    c = stats.compare_samples(native, affine, metric="decode_tok_s", seed=1)
    assert c.verdict is Verdict.FASTER
    assert c.ratio.ratio == pytest.approx(np.median(native) / np.median(affine), rel=1e-3)
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
            r = stats.compare_samples(a, b, seed=i).ratio  # no pairing keys: two independent samples
            ours = r.ci_low > 1 or r.ci_high < 1
            theirs = ss.mannwhitneyu(a, b).pvalue < 0.05
            if clear:
                assert ours and theirs
            agree += ours == theirs
            total += 1
    assert agree / total >= 0.88


def test_clean_rows_drop_failed_contended_and_missing_values() -> None:
    point = {"tokens": 512, "n": 64, "k": 64}
    good = job_table({"native": {"seconds": [1.0, 1.1, 1.2]}}, params=point)
    failed = job_table({"native": {"seconds": [9.0, 9.0]}}, params=point, status="failed", run_id="r2")
    contended = job_table({"native": {"seconds": [8.0, 8.0]}}, params=point, contended=True, run_id="r3")
    nan = job_table({"native": {"seconds": [float("nan"), 7.0]}}, params=point, run_id="r4")
    table = concat([good, failed, contended, nan])
    clean = groups.clean_rows(table)
    assert sorted(clean["value"].to_pylist()) == [1.0, 1.1, 1.2, 7.0]
    ((key, group),) = grouped_samples(table, ["device", "case_name", "params", "arm", "metric"])
    assert key[2] == (("k", "64"), ("n", "64"), ("tokens", "512"))
    assert sorted(group.values) == [1.0, 1.1, 1.2, 7.0]
    assert set(group.run_ids) == {"run1", "r4"} and group.precision is None


def test_bootstrap_is_fast() -> None:
    rng = np.random.default_rng(0)
    data = [rng.normal(size=50) for _ in range(50)]
    t0 = time.perf_counter()
    for i, x in enumerate(data):
        stats.compare_samples(x + 10, data[-1 - i] + 10, seed=i)
    assert time.perf_counter() - t0 < 5.0  # 50 comparisons x 2 x 2000 resamples


def test_ab_ba_pairs_cancel_an_8_percent_drift() -> None:
    """Identical arms, the machine 8 % slower by the end of the job, 1 % noise: paired, SAME; as
    independent samples the drift widens both sides and the verdict is AMBIGUOUS."""
    paired = verdict_rates(noise=0.01, drift=0.08)
    assert paired[Verdict.SAME] >= 0.95, paired
    unpaired = verdict_rates(noise=0.01, drift=0.08, paired=False)
    assert unpaired[Verdict.AMBIGUOUS] >= 0.8, unpaired


def test_ab_ba_pairs_find_a_real_slowdown_under_drift() -> None:
    """A 5 % slowdown (threshold 3 %) under the same drift: paired, SLOWER; unpaired, rarely."""
    paired = verdict_rates(noise=0.01, drift=0.08, effect=0.05)
    assert paired[Verdict.SLOWER] >= 0.9, paired
    assert verdict_rates(noise=0.01, drift=0.08, effect=0.05, paired=False)[Verdict.SLOWER] < 0.3


@pytest.mark.parametrize("noise", [0.02, 0.05, 0.10])
def test_identical_arms_are_never_called_faster_or_slower(noise: float) -> None:
    """A/A at realistic noise with drift and heavy tails (10 % of samples 3x): at most 5 % claims."""
    rates = verdict_rates(noise=noise, drift=0.08, tail=0.1)
    assert rates[Verdict.FASTER] + rates[Verdict.SLOWER] <= 0.05, rates


@pytest.mark.parametrize("noise", [0.02, 0.05, 0.10])
def test_a_change_below_the_threshold_is_not_called_slower(noise: float) -> None:
    """A true 2 % slowdown at a 3 % threshold: SLOWER only when the whole interval lies past the
    band (criterion.rs), so at most 5 % of the time (an interval off 1 alone said so 59 % of it)."""
    rates = verdict_rates(noise=noise, effect=0.02)
    assert rates[Verdict.SLOWER] <= 0.05, rates


def test_a_real_effect_with_heavy_tails_is_still_found() -> None:
    """A 10 % slowdown with 10 % of samples 3x (so a fifth of the pairs and a third of the ABBA
    blocks hit): the median of the blocks stands. A block averages its two pairs, so one spoiled
    pair spoils it: at 10 blocks (20 samples) half of such comparisons stay AMBIGUOUS, at 20
    blocks few do; the heavy-tail flag says why, and a precision target samples on."""
    rates = verdict_rates(n=40, noise=0.02, drift=0.08, effect=0.10, tail=0.1)
    assert rates[Verdict.SLOWER] >= 0.85, rates


def _seed1_like_job(rng: np.random.Generator, point: int, effect: float, noise: float) -> object:
    """A kernel job's rows: seconds and the metrics derived from the same samples."""
    tokens, flops, nbytes = 512, 2e9, 1e8
    values = {}
    for arm, centre in (("affine", 1e-3), ("native", 1e-3 * (1 + effect))):
        secs = centre * (1 + noise * rng.standard_normal(10))
        values[arm] = {
            "seconds": list(secs),
            "prefill_tok_s": list(tokens / secs),
            "gb_per_s": list(nbytes / secs / 1e9),
            "tflop_per_s": list(flops / secs / 1e12),
        }
    return job_table(values, params={"tokens": point, "n": 64, "k": 64})


def test_metrics_derived_from_the_same_samples_never_disagree() -> None:
    """One seed per group of samples and one oriented statistic: seconds, tok/s, GB/s and TFLOP/s
    get the same verdict and reciprocal intervals at every point (4.4 % disagreed with a seed per
    metric)."""
    rng = np.random.default_rng(44)
    effects = rng.uniform(-0.06, 0.06, 120)  # many near the 3 % band's edges
    table = concat([_seed1_like_job(rng, p, e, 0.02) for p, e in enumerate(effects)])  # type: ignore[misc]
    result = compare_results(table, baseline="affine")
    assert len(result.rows) == 120
    kinds = set()
    for row in result.rows:
        got = {m: row.comparisons[(m, "native")] for m in ("seconds", "prefill_tok_s", "gb_per_s", "tflop_per_s")}
        assert len({c.verdict for c in got.values()}) == 1, {m: c.verdict for m, c in got.items()}
        kinds.add(got["seconds"].verdict)
        s, t = got["seconds"].speedup, got["prefill_tok_s"].speedup
        assert (s.ci_low, s.ci_high) == pytest.approx((t.ci_low, t.ci_high), rel=1e-9)
        assert got["seconds"].ratio.ratio == pytest.approx(1 / got["prefill_tok_s"].ratio.ratio, rel=1e-9)
    assert {Verdict.SAME, Verdict.AMBIGUOUS} <= kinds  # the points really straddle the edges


def test_fewer_than_five_samples_are_too_few_to_judge() -> None:
    rng = np.random.default_rng(3)
    c = stats.compare_samples(rng.normal(2.0, 0.01, 3), rng.normal(1.0, 0.01, 3), a_keys=[0, 1, 2], b_keys=[0, 1, 2])
    assert c.verdict is Verdict.TOO_FEW and c.note == "n=3: too few to judge" and c.more_samples == 2
    assert c.ratio.ratio == pytest.approx(2.0, rel=0.05)  # the estimate is still shown
    # measured once per arm by construction: an exact comparison, not "too few"
    m = stats.compare_samples([37.0e9], [40.0e9], metric="peak_memory_bytes")
    assert m.verdict is Verdict.FASTER and m.ratio.ci_low == m.ratio.ci_high == pytest.approx(37 / 40)
    assert stats.compare_samples([1e9], [1.01e9], metric="peak_memory_bytes").verdict is Verdict.SAME


@pytest.mark.parametrize("tail", [0.0, 0.1])
@pytest.mark.parametrize("n", [5, 10, 20])
def test_paired_intervals_cover_the_true_ratio_from_five_samples(n: int, tail: float) -> None:
    """From 10 samples (5 ABBA blocks) the paired interval covers a known 4 % slowdown about 95 %
    of the time (>= 90 % here, normal and heavy-tailed noise); at 5 samples (3 blocks) >= 80 %;
    below 5 it cannot, which is why those say TOO FEW (and why a precision stop needs 8 blocks)."""
    rng = np.random.default_rng(n)
    keys = list(range(n))
    covered = 0
    for i in range(SIMS):
        a, b = abba_job(rng, n, 0.03, drift=0.08, effect=0.04, tail=tail)
        r = stats.compare_samples(a, b, metric="seconds", seed=i, a_keys=keys, b_keys=keys).ratio
        covered += r.ci_low <= 1.04 <= r.ci_high
    assert covered / SIMS >= (0.8 if n < 10 else 0.9), covered / SIMS


def test_benjamini_hochberg_agrees_with_scipy() -> None:
    rng = np.random.default_rng(5)
    p = list(np.concatenate([rng.uniform(0, 0.01, 10), rng.uniform(0, 1, 40)]))
    want = list(ss.false_discovery_control(p, method="bh") <= 0.05)
    assert fdr.benjamini_hochberg(p, 0.05) == want


def _table_of_noise(rng: np.random.Generator, noise: float, effects: np.ndarray) -> object:
    """50 points x 6 arms (5 compared with `base`), `seconds` only; `effects[p, arm]` true changes."""
    tables = []
    for p in range(effects.shape[0]):
        values = {"base": {"seconds": list(1e-3 * (1 + noise * rng.standard_normal(10)))}}
        for arm in range(effects.shape[1]):
            values[f"arm{arm}"] = {
                "seconds": list(1e-3 * (1 + effects[p, arm]) * (1 + noise * rng.standard_normal(10)))
            }
        tables.append(job_table(values, params={"tokens": p, "n": 64, "k": 64}))
    return concat(tables)


def _claims(result: object, effects: np.ndarray) -> tuple[int, int]:
    """(false, true) FASTER/SLOWER verdicts of a comparison table."""
    false = true = 0
    for row in result.rows:  # type: ignore[attr-defined]
        p = int(dict(row.point)["tokens"])
        for (_, side), c in row.comparisons.items():
            if c.verdict in MOVED:
                if effects[p, int(side[3:])] == 0:
                    false += 1
                else:
                    true += 1
    return false, true


@pytest.mark.parametrize("noise", [0.02, 0.05])
def test_a_table_of_pure_noise_makes_almost_no_claims(noise: float) -> None:
    """50 points x 6 arms of pure noise (10-12 false FASTER/SLOWER verdicts before): with the band
    rule and Benjamini-Hochberg over the table, fewer than one in two tables has a single one."""
    rng = np.random.default_rng(int(noise * 1000))
    effects = np.zeros((50, 5))
    tables_with_claims = 0
    for _ in range(6):
        result = compare_results(_table_of_noise(rng, noise, effects), baseline="base")  # type: ignore[arg-type]
        false, _ = _claims(result, effects)
        tables_with_claims += false > 0
        assert result.fdr is not None and result.fdr.hypotheses == 250
        assert "Benjamini-Hochberg at q = 5%" in result.fdr.describe()
    assert tables_with_claims <= 2


def test_false_discoveries_stay_under_five_percent_with_real_effects_in_the_table() -> None:
    rng = np.random.default_rng(77)
    false_share = []
    found = 0
    real = 0
    for _ in range(4):
        effects = np.where(rng.random((50, 5)) < 0.2, 0.10, 0.0)  # a fifth of the arms 10 % slower
        false, true = _claims(compare_results(_table_of_noise(rng, 0.03, effects), baseline="base"), effects)  # type: ignore[arg-type]
        false_share.append(false / max(false + true, 1))
        found += true
        real += int(np.count_nonzero(effects))
    assert np.mean(false_share) <= 0.05
    assert found / real >= 0.6  # control costs some power, not all of it


def _topped_up(
    effect: float, noise: float, precision: float | None, n: int = 10, sims: int = 150
) -> tuple[list[stats.Comparison], list[float], list[float]]:
    """AMBIGUOUS comparisons of `n` paired samples, and for each one not on the edge, the target
    half-width it planned for and the half-width reached after drawing its `more` samples per side."""
    rng = np.random.default_rng(12)
    ambiguous, targets, reached = [], [], []
    keys = list(range(n))
    for i in range(sims):
        a, b = abba_job(rng, n, noise, effect=effect)
        c = stats.compare_samples(a, b, metric="seconds", seed=i, a_keys=keys, b_keys=keys, precision=precision)
        if c.verdict is not Verdict.AMBIGUOUS:
            continue
        ambiguous.append(c)
        assert c.settle is not None
        if c.settle.on_edge:
            assert c.more_samples is None and c.note is not None and "edge" in c.note
            continue
        assert c.more_samples is not None and c.more_samples >= 1
        a2, b2 = abba_job(rng, c.more_samples, noise, effect=effect)
        more_keys = list(range(n + c.more_samples))
        again = stats.compare_samples(
            np.r_[a, a2], np.r_[b, b2], metric="seconds", seed=i, a_keys=more_keys, b_keys=more_keys
        )
        distance = abs(abs(math.log(c.ratio.ratio)) - math.log1p(c.threshold))
        targets.append(precision if precision is not None else math.expm1(distance))
        reached.append(precision_of(again))
    return ambiguous, targets, reached


def precision_of(c: stats.Comparison) -> float:
    """The relative half-width of a comparison's interval."""
    return precision.relative_half_width(math.log(c.ratio.ci_low), math.log(c.ratio.ci_high))


@pytest.mark.parametrize(
    ("effect", "noise", "target"), [(0.06, 0.03, None), (0.0, 0.02, None), (0.10, 0.05, None), (0.0, 0.02, 0.01)]
)
def test_the_suggested_samples_reach_the_target_half_width(effect: float, noise: float, target: float | None) -> None:
    """'About N more samples would settle it' plans for a half-width: the sweep's precision, or
    the distance from the estimate to the band edge. Drawing the N suggested samples per side
    (10 samples to start, 2-5 % noise, the truth off the edge) reaches that half-width at least
    80 % of the time."""
    _, targets, reached = _topped_up(effect, noise, target)
    assert len(reached) >= 30, len(reached)
    hits = sum(r <= t for r, t in zip(reached, targets, strict=True)) / len(reached)
    assert hits >= 0.8, hits


def test_an_estimate_on_the_band_edge_is_said_to_be_there() -> None:
    """A true change of exactly 3 % at a 3 % band, 5 % noise: no sample count settles it. A plan
    that takes the estimate for the truth asks for a median 126 and a 90th percentile of
    thousands of samples here; a good share are said to sit on the edge instead, and the rest ask
    for a bounded number (at most 1.5 x 16 x n, by the edge share)."""
    ambiguous, _, _ = _topped_up(0.03, 0.05, None, sims=200)
    on_edge = [c for c in ambiguous if c.settle is not None and c.settle.on_edge]
    asks = [c.more_samples for c in ambiguous if c.more_samples is not None]
    assert len(ambiguous) >= 150
    assert len(on_edge) / len(ambiguous) >= 0.3, len(on_edge) / len(ambiguous)
    assert max(asks) <= 24 * 10 and np.percentile(asks, 90) <= 200, np.percentile(asks, [50, 90])
    with_target = _topped_up(0.03, 0.02, 0.01, sims=100)[0]
    assert sum(c.settle is not None and c.settle.on_edge for c in with_target) / len(with_target) >= 0.5


@pytest.mark.parametrize("rounds", [5, 7, 9])
def test_abba_blocks_remove_a_first_slot_effect_at_odd_round_counts(rounds: int) -> None:
    """Identical arms, the first slot of every round 3 % slower, 1 % noise, an odd number of ABBA
    rounds: the median of per-round ratios keeps much of the slot effect (the arm that went first
    more often looks slower); the median of ABBA blocks keeps at most a third of that, well under
    1 % (what it keeps comes from the lone last round, a block of its own; adaptive sampling
    ends on whole blocks)."""
    rng = np.random.default_rng(rounds)
    keys = list(range(rounds))
    blocks, per_round = [], []
    for i in range(SIMS):
        a_first = np.arange(rounds) % 2 == 0  # ABBA: the arm leads even rounds, the baseline odd ones
        a = np.where(a_first, 1.03, 1.0) * (1 + 0.01 * rng.standard_normal(rounds))
        b = np.where(a_first, 1.0, 1.03) * (1 + 0.01 * rng.standard_normal(rounds))
        c = stats.compare_samples(a, b, metric="seconds", seed=i, a_keys=keys, b_keys=keys)
        blocks.append(c.ratio.ratio)
        per_round.append(float(np.exp(np.median(np.log(a) - np.log(b)))))
    kept, before = abs(np.median(blocks) - 1), np.median(per_round) - 1
    assert before > 0.01, before  # what the blocks take away
    assert kept < 0.007 and kept < before / 3, (kept, before)


def test_the_p_value_and_the_verdict_never_disagree() -> None:
    """The p-value is read off the interval's own bootstrap draws: p < 0.05 exactly where the
    interval lies past the band (FASTER or SLOWER), for paired and unpaired samples near the edges."""
    rng = np.random.default_rng(32)
    moved = 0
    for i in range(300):
        n = int(rng.integers(5, 16))
        a, b = abba_job(rng, n, float(rng.uniform(0.01, 0.05)), effect=float(rng.uniform(-0.08, 0.08)))
        keys = list(range(n)) if i % 2 else None
        c = stats.compare_samples(a, b, metric="seconds", seed=i, a_keys=keys, b_keys=keys)
        assert (c.p_value < 0.05) == (c.verdict in MOVED), (c.verdict, c.p_value, c.ratio)
        moved += c.verdict in MOVED
    assert 30 <= moved <= 270  # both kinds of verdict were tested


@pytest.mark.parametrize("noise", [0.02, 0.05, 0.10])
def test_heavy_tails_are_flagged_per_group(noise: float) -> None:
    rng = np.random.default_rng(int(noise * 100))
    flagged = quiet = 0
    for _ in range(300):
        x = 1 + noise * rng.standard_normal(10)
        quiet += stats.summarize(x).heavy_tailed
        x[:2] *= 3  # two samples 3x slower, as when a neighbour grabs the GPU
        flagged += stats.summarize(x).heavy_tailed
    assert flagged / 300 >= 0.99 and quiet / 300 <= 0.01
    values = {"native": {"seconds": [1e-3 * v for v in (1, 1.01, 0.99, 3.1, 1.0, 1.02, 0.98, 1.0, 1.01, 0.99)]},
              "affine": {"seconds": [1e-3] * 10}}  # fmt: skip
    result = compare_results(job_table(values, params={"tokens": 1, "n": 64, "k": 64}), baseline="affine")
    assert (
        result.heavy_tails
        and result.heavy_tails[0].startswith("qmm cpu")
        and "native: 1 of 10" in result.heavy_tails[0]
    )


def test_row_medians_are_numpys_medians_value_for_value() -> None:
    """The bootstrap's medians by a sort (faster) must be np.median's, bit for bit, so the intervals are too."""
    rng = np.random.default_rng(3)
    for n in (1, 2, 3, 4, 5, 12, 13, 30, 101):
        draws = rng.standard_normal((500, n)) * 10.0 ** rng.integers(-6, 6, size=(500, 1)) + 1000.0
        draws[::7, : max(1, n // 2)] = draws[::7, :1]  # ties, as resampling makes them
        assert np.array_equal(precision.row_medians(draws), np.median(draws, axis=1)), n
