"""A job's timed rounds: ABBA rounds until its point's precision target is reached.

The head puts a point's target in the job's options (`orchestrator.run.plan`): `precision` (the
relative half-width every arm's 95 % interval to `baseline` must reach), `max_seconds` (the
sampling budget of the point) and, for a top-up of a point measured before in the same run,
`first_round` and `prior` (the earlier rounds' values, `{metric: {arm: {round: value}}}`, so the
rule judges the pooled samples). `repetitions` is the minimum. Without `precision`, exactly `repetitions` rounds.

`Rounds` hands out round numbers and decides, after each block of two rounds, whether to go on
(`workers.contract.precision.Target.stop`); the interval is recomputed on a widening cadence
(every eighth of the rounds so far), so the bootstrap costs a few percent of the sampling at most
however long the point samples. Every timed row then says how its point's sampling ended
(`extras`): `stop_reason`, `half_width` (the arm's own ratio to the baseline; the baseline's rows
carry the widest of the point), `precision`, `baseline` (the arm the intervals are to) and
`rounds`.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from typing import Any

from workers.contract import JobSpec
from workers.contract.precision import (
    DEFAULT_MAX_ROUNDS,
    MIN_BLOCKS,
    ROUNDS_PER_BLOCK,
    StopReason,
    Target,
    paired_half_width,
    seed_for,
)

CHECK_FRACTION = 8  # the interval is recomputed after every 1/8 more rounds


def target_of(job: JobSpec) -> Target:
    """The sampling target of a job (module docstring). A top-up takes at least one more block
    and may go on for `DEFAULT_MAX_ROUNDS` more rounds."""
    precision = job.options.get("precision")
    max_seconds = job.options.get("max_seconds")
    first = int(job.options.get("first_round", 0))
    return Target(
        min_rounds=max(job.repetitions, first + ROUNDS_PER_BLOCK) if first else job.repetitions,
        precision=None if precision is None else float(precision),
        max_seconds=None if max_seconds is None else float(max_seconds),
        max_rounds=first + DEFAULT_MAX_ROUNDS,
    )


class Rounds:
    """The rounds of one job: iterate for round numbers, `record` each arm's value of each round."""

    def __init__(self, job: JobSpec, arms: list[str], *, metric: str = "seconds") -> None:
        self.target = target_of(job)
        self.metric = metric
        wanted = job.options.get("baseline")
        self.baseline = wanted if wanted in arms else None
        self.first = int(job.options.get("first_round", 0))
        prior: dict[str, Any] = (job.options.get("prior") or {}).get(metric) or {}
        self.values: dict[str, dict[int, float]] = {
            arm: {int(r): float(v) for r, v in (prior.get(arm) or {}).items()} for arm in arms
        }
        self.excluded: set[str] = set()
        self.widths: dict[str, float] = {}
        self.reason: StopReason | None = None
        self.next_round = self.first  # a round dropped at the end still counts as taken
        self.seconds = 0.0

    def exclude(self, arm: str) -> None:
        """Leave `arm` out of the stop rule (it failed its check: no precision is owed on it)."""
        self.excluded.add(arm)

    def record(self, round_: int, arm: str, value: float) -> None:
        self.values.setdefault(arm, {})[round_] = value

    def resume_after(self, round_: int) -> None:
        """Go on from the round after `round_`, whose values were taken and recorded apart (the
        rounds' time budget counts from the first round handed out here)."""
        self.first = self.next_round = round_ + 1

    def drop(self, round_: int) -> None:
        """Leave a round out of the rule (taken under a throttle: its rows are not clean)."""
        for values in self.values.values():
            values.pop(round_, None)

    def compared(self) -> list[str]:
        """The arms whose interval to the baseline the rule waits for."""
        if self.baseline is None:
            return []
        return [a for a in self.values if a != self.baseline and a not in self.excluded]

    def measure_widths(self, min_blocks: int = MIN_BLOCKS) -> dict[str, float]:
        """Every compared arm's relative half-width to the baseline now (nan under `min_blocks`)."""
        base = self.values.get(self.baseline or "", {})
        out = {}
        for arm in self.compared():
            mine = self.values[arm]
            rounds = sorted(set(mine) & set(base))
            out[arm] = paired_half_width(
                rounds,
                [mine[r] for r in rounds],
                [base[r] for r in rounds],
                seed=seed_for(arm, self.metric),
                min_blocks=min_blocks,
            )
        self.widths = out
        return out

    def __iter__(self) -> Iterator[int]:
        start = time.perf_counter()
        round_ = self.first
        next_check = 0
        while True:
            taken = round_  # rounds are numbered across the point: a top-up goes on from `first_round`
            due = self.target.adaptive and taken >= max(self.target.min_rounds, next_check)
            if due and taken % ROUNDS_PER_BLOCK == 0:
                self.measure_widths()
                next_check = taken + max(ROUNDS_PER_BLOCK, _even(taken // CHECK_FRACTION))
            widths = [self.widths.get(a, math.nan) for a in self.compared()]
            reason = self.target.stop(taken, time.perf_counter() - start, widths)
            if reason is not None:
                self.reason = reason
                break
            yield round_
            round_ += 1
            self.next_round = round_
        self.seconds = time.perf_counter() - start
        if self.target.adaptive:  # what the rows report: an interval from 2 blocks on, too few to stop on
            self.measure_widths(min_blocks=2)

    def extras(self, arm: str) -> dict[str, str]:
        """What a timed row of `arm` says about how its point's sampling ended."""
        reason = self.reason or StopReason.FIXED
        out = {"stop_reason": str(reason), "rounds": str(self.rounds_taken())}
        if self.target.precision is not None:
            out["precision"] = f"{self.target.precision:g}"
        if self.baseline is not None:
            out["baseline"] = self.baseline
        widths = [w for w in self.widths.values() if math.isfinite(w)]
        width = self.widths.get(arm) if arm != self.baseline else (max(widths) if widths else None)
        if width is not None and math.isfinite(width):
            out["half_width"] = f"{width:.4g}"
        return out

    def rounds_taken(self) -> int:
        """Rounds of the point, earlier jobs' included."""
        taken = {r for v in self.values.values() for r in v}
        return max(self.next_round, max(taken) + 1 if taken else self.first)


def _even(n: int) -> int:
    return n - n % ROUNDS_PER_BLOCK
