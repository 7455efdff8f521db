"""A bisection step's verdict: a commit against the good commit, from paired samples in one window.

Each step of `orchestrate bisect` measures the tested commit and the good commit interleaved in one
lock window (`--ref GOOD --ref COMMIT`): the command job runs the two ABBA, so sample i of each
side was taken side by side. The evidence is the precision rule's (`workers.contract.precision`):
the median of per-block log ratios COMMIT / GOOD with its smoothed-bootstrap interval, the blocks
of every job at that pair pooled (a block never spans two jobs, so each keeps its own pairing).

The first step measures BAD itself and decides whether there is anything to bisect: `classify`
against the relevance band `1 ± threshold` (3 %, as `compare` uses it). SAME: no regression
between GOOD and BAD. Past the band: the flagged change, whose direction and size set the band of
every later step: a commit is **bad** when its whole interval lies past the edge in the direction
of the change, **good** when its whole interval lies on GOOD's side of that edge (a commit faster
than GOOD carries no slowdown), else **undecided**. The edge is the threshold, or half the change
where the change is smaller than twice the threshold, so a commit that carries the whole change is
as far from the edge as one that carries none of it.
"""

from __future__ import annotations

import math
import shlex
from dataclasses import dataclass
from enum import StrEnum

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from orchestrator.analysis.commits import extra_value
from orchestrator.analysis.history import IMPROVEMENT, REGRESSION
from orchestrator.analysis.stats import LogRatio, Verdict, classify
from orchestrator.analysis.trends import Trend
from workers.contract.precision import MIN_BLOCKS, block_log_ratios, median_interval, seed_for


class StepVerdict(StrEnum):
    """What one tested commit is."""

    GOOD = "good"
    BAD = "bad"
    UNDECIDED = "undecided"
    SKIPPED = "skipped"  # it did not build, pass its gate or run: not measured (git bisect skip)


@dataclass(frozen=True)
class Evidence:
    """A commit's ratio to GOOD (raw, not oriented) with its 95 % interval, and what it rests on.

    Attributes:
        log: the median per-block log ratio COMMIT / GOOD, `lo` and `hi` its interval (nan: none).
        blocks: ABBA blocks pooled over the pair's jobs.
        samples: samples per side (pairs).
        jobs: the jobs (lock windows) the samples came from.
    """

    log: float
    lo: float
    hi: float
    blocks: int
    samples: int
    jobs: int

    @property
    def ratio(self) -> float:
        return math.exp(self.log) if math.isfinite(self.log) else math.nan

    @property
    def half_width(self) -> float:
        """Half the interval's width as a relative change (nan: no interval yet)."""
        if not (math.isfinite(self.lo) and math.isfinite(self.hi)):
            return math.nan
        return math.expm1((self.hi - self.lo) / 2)

    def describe(self) -> str:
        """`0.951 [0.942, 0.960]`."""
        if not math.isfinite(self.log):
            return "-"
        if not (math.isfinite(self.lo) and math.isfinite(self.hi)):
            return f"{self.ratio:.3f}"
        return f"{self.ratio:.3f} [{math.exp(self.lo):.3f}, {math.exp(self.hi):.3f}]"


def clean(rows: pa.Table, metric: str, arm: str) -> pa.Table:
    """The timed, clean samples of one metric and arm."""
    keep = pc.and_(pc.equal(rows["metric"], metric), pc.equal(rows["arm"], arm))
    keep = pc.and_(keep, pc.equal(rows["status"], "ok"))
    keep = pc.and_(keep, pc.greater_equal(rows["sample"], 0))
    keep = pc.and_(keep, pc.invert(pc.fill_null(rows["contended"], False)))
    return rows.filter(pc.fill_null(keep, False))


def evidence(rows: pa.Table, metric: str, arm: str, good: str, commit: str) -> Evidence:
    """`commit` against `good` from the rows of the jobs that measured the two together.

    Args:
        rows: stored rows (any jobs: only those with `good` as BASE and `commit` as HEAD count).
        metric, arm: what is followed.
        good, commit: full commit ids.
    """
    table = clean(rows, metric, arm)
    side = extra_value(table, "ref_index").to_pylist()
    per_job: dict[tuple[str, str], tuple[dict[int, float], dict[int, float]]] = {}
    for run_id, job_key, row_commit, index, sample, value in zip(
        table["run_id"].to_pylist(),
        table["job_key"].to_pylist(),
        table["commit"].to_pylist(),
        side,
        table["sample"].to_pylist(),
        table["value"].to_pylist(),
        strict=True,
    ):
        base, head = per_job.setdefault((run_id, job_key), ({}, {}))
        if row_commit == good and index == "0":
            base[int(sample)] = float(value)
        elif row_commit == commit and index == "1":
            head[int(sample)] = float(value)
    logs: list[np.ndarray] = []
    pairs = jobs = 0
    for base, head in per_job.values():
        rounds = sorted(set(base) & set(head))
        if not rounds:
            continue
        jobs += 1
        pairs += len(rounds)
        # each job's blocks are its own: rounds of two lock windows never form a block
        logs.append(block_log_ratios(rounds, [head[r] for r in rounds], [base[r] for r in rounds]))
    blocks = np.concatenate(logs) if logs else np.empty(0)
    if len(blocks) == 0:
        return Evidence(math.nan, math.nan, math.nan, 0, 0, jobs)
    interval = median_interval(blocks, seed=seed_for(good, commit, len(blocks)))
    return Evidence(interval.point, interval.lo, interval.hi, len(blocks), pairs, jobs)


@dataclass(frozen=True)
class Change:
    """The flagged change, BAD against GOOD: its direction (+1: BAD higher) and the step band's edge."""

    direction: int
    edge: float  # on the log scale

    @classmethod
    def of(cls, bad: Evidence, threshold: float) -> Change:
        edge = min(math.log1p(threshold), abs(bad.log) / 2)
        return cls(1 if bad.log > 0 else -1, edge)


def enough(edge: float) -> float:
    """The half-width past which more samples of an undecided commit are not taken: a quarter of the
    edge. An interval that narrow and still reaching across the edge is a commit whose change is
    about the edge's size (part of the flagged change, or a step of a slow drift)."""
    return math.expm1(edge) / 4


def judge_range(bad: Evidence, threshold: float) -> Verdict:
    """BAD against GOOD: SLOWER/FASTER (past the band: something to bisect), SAME (nothing), AMBIGUOUS."""
    if bad.blocks < MIN_BLOCKS:
        return Verdict.AMBIGUOUS
    return classify(LogRatio(bad.log, bad.lo, bad.hi, bad.samples, bad.samples, True, bad.blocks), threshold)


def judge_step(step: Evidence, change: Change) -> StepVerdict:
    """A tested commit: bad past the edge in the change's direction, good on GOOD's side of it."""
    if step.blocks < MIN_BLOCKS or not (math.isfinite(step.lo) and math.isfinite(step.hi)):
        return StepVerdict.UNDECIDED
    near, far = sorted((change.direction * step.lo, change.direction * step.hi))
    if near > change.edge:
        return StepVerdict.BAD
    if far < change.edge:
        return StepVerdict.GOOD
    return StepVerdict.UNDECIDED


def bisect_command(sweep: str, good: str, bad: str, *, point: str, arm: str, metric: str, device: str,
                   **more: str | None) -> str:  # fmt: skip
    """The `orchestrate bisect ...` line for these arguments (shell-quoted; `more`: other options)."""
    args = ["orchestrate", "bisect", "--sweep", sweep, "--good", good, "--bad", bad]
    if point:
        args += ["--point", point]
    args += ["--arm", arm, "--metric", metric, "--device", device]
    for name, value in more.items():
        if value is not None:
            args += [f"--{name.replace('_', '-')}", value]
    return shlex.join(args)


def history_bisect_lines(items: list[Trend], rows: pa.Table) -> list[str]:
    """`bisect: orchestrate bisect ...` for each regression or improvement the history flags where
    its rows carry engine commits: GOOD the commit of the night before the change, BAD the night's."""
    sweep_of = dict(zip(rows["run_id"].to_pylist(), rows["sweep"].to_pylist(), strict=True))
    lines = []
    for trend in items:
        points = sorted(trend.points, key=lambda p: p.started_at)
        for finding in trend.changes:
            if finding.verdict not in (REGRESSION, IMPROVEMENT) or not finding.since_commit:
                continue
            runs = [p.run_id for p in points]
            if finding.since_run not in runs or finding.since_run not in sweep_of:
                continue
            before = points[: runs.index(finding.since_run)]
            good = before[-1].commit if before else None
            if not good or good == finding.since_commit:
                continue
            s = trend.series
            command = bisect_command(sweep_of[finding.since_run], good, finding.since_commit,
                                     point=s.params.replace(" ", ","), arm=s.arm, metric=s.metric, device=s.device,
                                     case=s.case_name)  # fmt: skip
            line = f"bisect the {finding.verdict} of {s.device} {s.case_name} {s.arm} {s.params}: {command}"
            if line not in lines:  # hosts of one kind flag the same step
                lines.append(line)
    return lines
