"""A bisection step's verdict (`orchestrator.analysis.bisection`), checked by simulation.

Rows are what a `--ref GOOD --ref COMMIT` command job stores: each round one sample of GOOD
(ref_index 0) and one of the tested commit (ref_index 1), ABBA, with 2 % noise per sample (normal)
and a drift across the lock window that both sides share. The rates asserted are those of the
rule at 16 rounds a job (the fewest a bisection step takes), over 300 simulated steps each.
"""

from __future__ import annotations

import datetime as dt
import math
from collections import Counter
from collections.abc import Callable
from typing import Any

import numpy as np
import pyarrow as pa
import pytest

from orchestrator.analysis.bisection import (
    Change,
    Evidence,
    StepVerdict,
    enough,
    evidence,
    history_bisect_lines,
    judge_range,
    judge_step,
)
from orchestrator.analysis.history import RunPoint, SeriesKey, detect
from orchestrator.analysis.stats import Verdict
from orchestrator.analysis.trends import Trend
from orchestrator.errors import InputError
from orchestrator.run.bisect import MAX_JOBS, _next
from orchestrator.run.bisect_target import choose_target
from orchestrator.specs.sweep import load_sweep

GOOD, MID = "a" * 40, "b" * 40
NOISE = 0.02
SIMULATIONS = 300


def job_rows(rng: np.random.Generator, ratio: float, *, run_id: str, rounds: int = 16, commit: str = MID) -> dict:
    """One job's rows: GOOD and `commit` interleaved ABBA, a shared drift of up to 4 % over the window."""
    cols: dict[str, list] = {k: [] for k in ("run_id", "job_key", "commit", "extra", "sample", "value", "metric",
                                              "arm", "status", "contended")}  # fmt: skip
    for r in range(rounds):
        drift = 1 + 0.04 * r / rounds
        sides = [(GOOD, "0", 13.1), (commit, "1", 13.1 * ratio)]
        for c, index, level in sides if r % 2 == 0 else sides[::-1]:
            cols["run_id"].append(run_id)
            cols["job_key"].append("k" + run_id)
            cols["commit"].append(c)
            cols["extra"].append([("ref_index", index), ("refs", "2")])
            cols["sample"].append(r)
            cols["value"].append(level * drift * (1 + NOISE * rng.standard_normal()))
            cols["metric"].append("decode_tok_s")
            cols["arm"].append("native")
            cols["status"].append("ok")
            cols["contended"].append(False)
    return cols


def table(*jobs: dict) -> pa.Table:
    merged = {k: [v for job in jobs for v in job[k]] for k in jobs[0]}
    types = {"extra": pa.map_(pa.string(), pa.string()), "sample": pa.int64(), "contended": pa.bool_()}
    return pa.table({k: pa.array(v, types.get(k)) for k, v in merged.items()})


def settle_rates(
    ratio: float, decide: Callable[[Evidence], Any], precision: float, seed: int
) -> tuple[Counter[Any], Counter[Any]]:
    """(verdict rates after one job, after the jobs a step adds while undecided), as `_settle` adds
    them: up to `MAX_JOBS`, stopping early where the interval is within `precision`."""
    rng = np.random.default_rng(seed)
    first: Counter[Any] = Counter()
    final: Counter[Any] = Counter()
    for i in range(SIMULATIONS):
        jobs = [job_rows(rng, ratio, run_id=f"r{i}.0")]
        while True:
            ev = evidence(table(*jobs), "decode_tok_s", "native", GOOD, MID)
            verdict = decide(ev)
            if len(jobs) == 1:
                first[verdict] += 1 / SIMULATIONS
            if verdict not in (StepVerdict.UNDECIDED, Verdict.AMBIGUOUS) or len(jobs) == MAX_JOBS:
                break
            if ev.half_width <= precision:
                break
            jobs.append(job_rows(rng, ratio, run_id=f"r{i}.{len(jobs)}"))
        final[verdict] += 1 / SIMULATIONS
    return first, final


def step_rates(ratio: float, change: Change, seed: int) -> tuple[Counter[Any], Counter[Any]]:
    return settle_rates(ratio, lambda ev: judge_step(ev, change), enough(change.edge), seed)


FIVE_PERCENT_SLOWER = Change(direction=-1, edge=math.log(0.95) / -2)


@pytest.mark.parametrize(
    ("ratio", "right", "wrong"),
    [(1.0, StepVerdict.GOOD, StepVerdict.BAD), (0.95, StepVerdict.BAD, StepVerdict.GOOD)],
)
def test_a_step_at_two_percent_noise_names_the_commit_and_almost_never_the_opposite(
    ratio: float, right: StepVerdict, wrong: StepVerdict
) -> None:
    first, final = step_rates(ratio, FIVE_PERCENT_SLOWER, seed=int(ratio * 100))
    assert first[right] >= 0.8, first  # the rest is undecided: another job at the same pair
    assert final[wrong] <= 0.01, final  # a wrong verdict sends the bisection into the wrong half
    assert final[right] >= 0.98, final


def test_a_faster_commit_is_good_and_the_band_edge_is_half_a_small_change() -> None:
    _, final = step_rates(1.05, FIVE_PERCENT_SLOWER, seed=7)
    assert final[StepVerdict.GOOD] >= 0.98 and final[StepVerdict.BAD] == 0
    bad = Evidence(math.log(0.95), math.log(0.94), math.log(0.96), 8, 16, 1)
    assert Change.of(bad, 0.03).edge == pytest.approx(-math.log(0.95) / 2)  # 2.5 %: half the change
    big = Evidence(math.log(0.7), math.log(0.69), math.log(0.71), 8, 16, 1)
    assert Change.of(big, 0.03) == Change(-1, math.log1p(0.03))  # a large change: the 3 % band
    assert Change.of(Evidence(math.log(1.2), 0.17, 0.19, 8, 16, 1), 0.03).direction == 1


def test_the_first_step_says_no_regression_within_the_band_and_past_it_otherwise() -> None:
    band = enough(math.log1p(0.03))
    for ratio, right, wrong in [(1.0, Verdict.SAME, Verdict.SLOWER), (0.95, Verdict.SLOWER, Verdict.SAME)]:
        first, final = settle_rates(ratio, lambda ev: judge_range(ev, 0.03), band, seed=int(ratio * 100) + 1)
        assert first[right] >= 0.7 and first[wrong] == 0, first  # the rest: AMBIGUOUS, more jobs
        assert final[right] >= 0.99 and final[wrong] == 0, final


def test_jobs_pool_by_block_and_other_rows_do_not_count() -> None:
    rng = np.random.default_rng(3)
    one = evidence(table(job_rows(rng, 0.95, run_id="r1")), "decode_tok_s", "native", GOOD, MID)
    assert (one.jobs, one.blocks, one.samples) == (1, 8, 16)
    other = job_rows(rng, 0.5, run_id="r3", commit="c" * 40)  # another commit's job
    noisy = job_rows(rng, 0.5, run_id="r4")
    noisy["contended"] = [True] * len(noisy["contended"])  # a foreign GPU user: not clean
    two = evidence(
        table(job_rows(rng, 0.95, run_id="r1"), job_rows(rng, 0.95, run_id="r2"), other, noisy),
        "decode_tok_s",
        "native",
        GOOD,
        MID,
    )
    assert (two.jobs, two.blocks, two.samples) == (2, 16, 32)
    assert 0.93 < two.ratio < 0.97 and two.half_width < one.half_width * 1.2
    few = evidence(table(job_rows(rng, 0.95, run_id="r5", rounds=6)), "decode_tok_s", "native", GOOD, MID)
    assert judge_step(few, FIVE_PERCENT_SLOWER) is StepVerdict.UNDECIDED  # 3 blocks are too few to stop on


def test_the_next_commit_is_the_untried_one_nearest_the_middle() -> None:
    commits = [f"c{i}" for i in range(15)]
    assert _next(commits, -1, 14, set()) == 6
    assert _next(commits, -1, 14, {"c6"}) == 7  # a skipped midpoint: its nearest neighbour
    assert _next(commits, 6, 8, {"c7"}) is None  # nothing left between: the range stands


def test_history_prints_the_bisect_command_of_a_flagged_step_with_the_two_nights_commits() -> None:
    key = SeriesKey("gfx1151", "strix", "bench-decode", "native", "prompt_tokens=512", "decode_tok_s", "tok/s")
    t0 = dt.datetime(2026, 11, 1, 2, tzinfo=dt.UTC)
    medians = [13.1] * 10 + [12.5] * 3  # 4.6 % slower from night 10 on
    nights = [
        RunPoint(f"r{i:02d}", t0 + dt.timedelta(days=i), f"c{i}", [m * (1 + 0.004 * s) for s in (-1, -0.5, 0, 0.5, 1)])
        for i, m in enumerate(medians)
    ]
    trend = Trend(key, nights, detect(key, nights, threshold=0.03))
    rows = pa.table({"run_id": [p.run_id for p in nights], "sweep": ["mlxcel-prefill"] * len(nights)})
    assert history_bisect_lines([trend, trend], rows) == [  # hosts of one kind flagging one step: one line
        "bisect the regression of gfx1151 bench-decode native prompt_tokens=512: orchestrate bisect --sweep "
        "mlxcel-prefill --good c9 --bad c10 --point prompt_tokens=512 --arm native --metric decode_tok_s "
        "--device gfx1151 --case bench-decode"
    ]
    kernel = [RunPoint(p.run_id, p.started_at, None, p.values) for p in nights]  # no engine commit: no line
    assert history_bisect_lines([Trend(key, kernel, detect(key, kernel, threshold=0.03))], rows) == []


def test_the_target_defaults_come_from_the_sweeps_criteria_and_single_values() -> None:
    sweep = load_sweep("mlxcel-prefill")
    target = choose_target(sweep, metric="decode_tok_s", point="prompt_tokens=2048")
    assert (target.case.label, target.arm, target.metric, target.device) == ("bench-decode", "native",
                                                                              "decode_tok_s", "m1-ultra")  # fmt: skip
    assert target.point == {"checkpoint": "~/mlxcel/models/gemma-4-31b-it-nvfp4", "prompt_tokens": 2048}
    assert choose_target(sweep, point="prompt_tokens=512").metric == "prefill_tok_s"  # the first criterion's
    with pytest.raises(InputError, match=r"give prompt_tokens= one of 512, 1024, 2048, 4096, 8192, 16384"):
        choose_target(sweep, metric="decode_tok_s")
    with pytest.raises(InputError, match="measures prompt_tokens at"):
        choose_target(sweep, metric="decode_tok_s", point="prompt_tokens=500")
    with pytest.raises(InputError, match=r"name the case with --case \(one of qmm, moe-gather, mlp\)"):
        choose_target(load_sweep("smoke"), metric="seconds")  # kernel cases (not `model`): which one is asked
    with pytest.raises(InputError, match="--arm: case 'qmm' has arms native, affine"):
        choose_target(load_sweep("smoke"), case="qmm", metric="seconds")
    smoke = choose_target(load_sweep("smoke"), case="qmm", metric="seconds", arm="native", device="cpu",
                          point="tokens=32")  # fmt: skip
    assert (smoke.case.case, smoke.point) == ("qmm", {"tokens": 32, "n": 256, "k": 512, "dtype": "float32"})
