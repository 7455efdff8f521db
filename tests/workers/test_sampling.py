"""Sampling to a precision target: the stop rule, the rows it leaves, and what it promises."""

from __future__ import annotations

import datetime as dt
import math
import time

import mlx.core as mx
import numpy as np
import pytest

from kernels.registry import ArmPath, Workload
from tests.workers.tiny_job import tiny_job
from workers.contract import JobContext, JobSpec, RowBuilder
from workers.contract.precision import MIN_BLOCKS, StopReason, Target, block_log_ratios, median_interval, seed_for
from workers.host.fingerprint import host_fingerprint
from workers.job.measure import measure_workload
from workers.job.sampling import Rounds


def _job(reps: int = 4, **options: object) -> JobSpec:
    return tiny_job(["base", "twice"], reps, options=dict(options))


def _simulate(rounds: Rounds, rng: np.random.Generator, ratio: float, noise: float, pause: float = 0.0) -> None:
    """Feed `rounds` lognormal samples: `twice` takes `ratio` times `base`'s time (a round lasts `pause`)."""
    for r in rounds:
        time.sleep(pause)
        drift = rng.normal(0, noise)  # what a round shares: both arms see it
        rounds.record(r, "base", math.exp(drift + rng.normal(0, noise)))
        rounds.record(r, "twice", ratio * math.exp(drift + rng.normal(0, noise)))


def test_without_a_target_exactly_the_repetitions() -> None:
    rounds = Rounds(_job(reps=5), ["base", "twice"])
    _simulate(rounds, np.random.default_rng(0), 2.0, 0.02)
    assert rounds.reason is StopReason.FIXED
    assert rounds.rounds_taken() == 5
    assert rounds.extras("twice") == {"stop_reason": "fixed", "rounds": "5"}


def test_loose_target_stops_at_the_minimum_tight_one_runs_to_the_budget() -> None:
    loose = Rounds(_job(reps=6, precision=0.2, baseline="base"), ["base", "twice"])
    _simulate(loose, np.random.default_rng(1), 2.0, 0.02)
    assert loose.reason is StopReason.PRECISION
    assert loose.rounds_taken() == 2 * MIN_BLOCKS  # the first interval that may stop it
    assert float(loose.extras("twice")["half_width"]) <= 0.2

    tight = Rounds(_job(reps=6, precision=1e-6, baseline="base", max_seconds=0.2), ["base", "twice"])
    _simulate(tight, np.random.default_rng(2), 2.0, 0.02, pause=0.002)
    assert tight.reason is StopReason.BUDGET
    assert tight.rounds_taken() % 2 == 0 and tight.rounds_taken() > 6
    assert 0.2 <= tight.seconds < 1.0
    extra = tight.extras("base")
    assert extra["stop_reason"] == "budget" and float(extra["half_width"]) > 1e-6
    assert extra["precision"] == "1e-06"


def test_round_limit() -> None:
    target = Target(min_rounds=4, precision=0.01, max_rounds=10)
    assert target.stop(9, 0.0, [0.5]) is None  # never in the middle of a block
    assert target.stop(10, 0.0, [0.5]) is StopReason.MAX_ROUNDS
    assert target.stop(10, 0.0, [0.005]) is StopReason.PRECISION
    assert target.stop(2, 0.0, [0.005]) is None  # the minimum comes first


def test_a_failed_arm_is_owed_no_precision() -> None:
    rounds = Rounds(_job(reps=4, precision=0.05, baseline="base"), ["base", "twice"])
    rounds.exclude("twice")
    assert rounds.compared() == []
    _simulate(rounds, np.random.default_rng(3), 2.0, 0.5)
    assert rounds.reason is StopReason.FIXED and rounds.rounds_taken() == 4


def test_a_top_up_pools_the_earlier_rounds() -> None:
    rng = np.random.default_rng(4)
    first = Rounds(_job(reps=6, precision=0.002, baseline="base", max_seconds=0.05), ["base", "twice"])
    _simulate(first, rng, 1.5, 0.03)
    taken = first.rounds_taken()
    prior = {"seconds": {arm: {str(r): v for r, v in first.values[arm].items()} for arm in ("base", "twice")}}
    more = Rounds(
        _job(reps=6, precision=0.002, baseline="base", max_seconds=0.05, first_round=taken, prior=prior),
        ["base", "twice"],
    )
    _simulate(more, rng, 1.5, 0.03)
    assert min(more.values["twice"]) == 0 and more.rounds_taken() > taken
    new_rounds = set(more.values["twice"]) - set(first.values["twice"])
    assert min(new_rounds) == taken  # the numbering goes on: pairs and blocks stay whole
    assert float(more.extras("twice")["half_width"]) < float(first.extras("twice")["half_width"])


def test_stopping_on_precision_keeps_the_interval_honest() -> None:
    """At 3 % noise per sample, stopping once the interval is ±1.5 % wide still covers the true
    ratio about 95 % of the time (the rule looks at the width, never at where the estimate lies)."""
    rng = np.random.default_rng(5)
    truth = math.log(1.05)
    covered, widths, taken = 0, [], []
    trials = 200
    for _ in range(trials):
        rounds = Rounds(_job(reps=6, precision=0.015, baseline="base", max_seconds=30), ["base", "twice"])
        _simulate(rounds, rng, 1.05, 0.03)
        base, twice = rounds.values["base"], rounds.values["twice"]
        order = sorted(base)
        logs = block_log_ratios(order, [twice[r] for r in order], [base[r] for r in order])
        interval = median_interval(logs, seed=seed_for("twice", "seconds"))  # the rule's own draws
        covered += interval.lo <= truth <= interval.hi
        widths.append(interval.half_width)
        taken.append(rounds.rounds_taken())
        assert rounds.reason is StopReason.PRECISION
    assert max(widths) <= 0.015
    assert 0.90 <= covered / trials <= 0.99
    assert 6 < float(np.median(taken)) < 60  # it did sample past the minimum, and not forever


@pytest.mark.parametrize(("precision", "reason"), [(0.9, "precision"), (1e-7, "budget")])
def test_a_real_job_says_how_its_sampling_ended(precision: float, reason: str) -> None:
    w = np.random.default_rng(0).standard_normal((8, 16)).astype(np.float32)
    wm = mx.array(w)
    workload = Workload(
        arms={
            "base": ArmPath(lambda x: x @ wm.T, 1e-4, "matmul"),
            "twice": ArmPath(lambda x: (x @ wm.T + x @ wm.T) / 2, 1e-4, "matmul twice"),
        },
        make_inputs=lambda rng: (mx.array(rng.standard_normal((4, 16)).astype(np.float32)),),
        reference=lambda arm, x: np.array(x, dtype=np.float64) @ w.astype(np.float64).T,
        flops=2 * 4 * 8 * 16,
        bytes_moved=4 * (8 * 16 + 4 * 16 + 4 * 8),
        tokens=4,
    )
    job = _job(reps=4, precision=precision, baseline="base", max_seconds=0.5)
    rows = RowBuilder(job, host_fingerprint(), JobContext(started_at=dt.datetime.now(dt.UTC)))
    assert measure_workload(job, workload, rows, np.random.default_rng(1)) == "ok"
    timed = [r for r in rows.table("ok").to_pylist() if r["metric"] == "seconds"]
    extras = [dict(r["extra"]) for r in timed]
    assert {e["stop_reason"] for e in extras} == {reason}
    samples = sorted({r["sample"] for r in timed})
    assert samples == list(range(len(samples))) and len(samples) % 2 == 0 and len(samples) >= 4
    assert {e["rounds"] for e in extras} == {str(len(samples))}
    if reason == "budget":
        assert len(samples) > 4
    twice = {e["half_width"] for e, r in zip(extras, timed, strict=True) if r["arm"] == "twice"}
    assert len(twice) == 1 and 0 < float(twice.pop()) < 10


def test_a_throttled_round_is_left_out_of_the_rule_but_counted_as_taken() -> None:
    rounds = Rounds(_job(reps=4, precision=0.5, baseline="base"), ["base", "twice"])
    rng = np.random.default_rng(6)
    for r in rounds:
        rounds.record(r, "base", 1.0 + rng.normal(0, 0.01))
        rounds.record(r, "twice", 2.0 + rng.normal(0, 0.01))
        if r == 2 * MIN_BLOCKS - 1:  # the last round before the first possible stop: dropped
            rounds.drop(r)
    assert 2 * MIN_BLOCKS - 1 not in rounds.values["base"] and 2 * MIN_BLOCKS - 1 not in rounds.values["twice"]
    assert rounds.rounds_taken() >= 2 * MIN_BLOCKS and rounds.reason is StopReason.PRECISION


def test_a_point_stopped_before_it_could_stop_on_precision_still_says_how_wide_it_is() -> None:
    rounds = Rounds(_job(reps=6, precision=0.01, baseline="base", max_seconds=0.001), ["base", "twice"])
    _simulate(rounds, np.random.default_rng(7), 1.5, 0.05, pause=0.002)
    assert rounds.reason is StopReason.BUDGET and rounds.rounds_taken() == 6  # 3 blocks: too few to stop on
    assert 0.01 < float(rounds.extras("twice")["half_width"]) < 1  # the rows still report the interval's width
