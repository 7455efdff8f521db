"""`orchestrate run --budget DURATION`: more rounds, in the same run, where a verdict is still open.

After every job has run once, the head reads the run's rows as `compare` and `check` would and
finds the points whose comparison or criterion is AMBIGUOUS and whose sampling stopped short of its
precision target (`orchestrator.analysis.shortfall`). Each such job is submitted again with the
same job key and the rounds it has (`first_round`, and `prior`: every timed value so far, so the
worker's stop rule judges the pooled samples, `workers.job.sampling`); its new rounds go on from
the old numbering, so ABBA pairs and blocks stay whole. The new timed rows are pooled with the old
ones into the job's one fragment, written again atomically; the old rows' sampling extras are
brought up to date, so every row of a point says how its sampling ended. A point goes on being
topped up while it stays open and short and the run's budget lasts (`MAX_PASSES` at most).

Top-ups never start past the budget: each job's sampling gets a share of what is left
(`max_seconds`), and a job whose previous measurement took longer than its share is left open.
What it topped up and what it left open, the run's summary says.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

import pyarrow as pa
import pyarrow.compute as pc

from orchestrator.analysis.compare import compare_results
from orchestrator.analysis.criteria import evaluate_criteria
from orchestrator.analysis.groups import Point, point_of
from orchestrator.analysis.shortfall import shortfalls
from orchestrator.analysis.stats import Verdict
from orchestrator.analysis.verdicts import Outcome
from orchestrator.errors import InputError
from orchestrator.specs.sweep import SweepSpec
from workers.contract import JobSpec, Status, footer_status

MAX_PASSES = 3
# Extras that describe a point's sampling as a whole: the pooled rounds rewrite them on old rows.
SAMPLING_EXTRAS = ("stop_reason", "rounds", "precision", "half_width", "baseline")

PointKey = tuple[str, str, Point]  # (device, case, point)


@dataclass
class TopUps:
    """What the top-ups of a run did (for its summary)."""

    topped_up: dict[str, int] = field(default_factory=dict)  # job_key -> rounds it has now
    left_open: dict[str, str] = field(default_factory=dict)  # job_key -> why it got no more
    labels: dict[str, str] = field(default_factory=dict)  # job_key -> `h100 qmm tokens=512`

    def lines(self) -> list[str]:
        """`topped up 3 open points: ...` and `left open: ...` for the end of the run."""
        out = []
        if self.topped_up:
            done = "; ".join(f"{self.labels[k]} ({n} rounds)" for k, n in self.topped_up.items())
            out.append(f"topped up {len(self.topped_up)} open point(s) within --budget: {done}")
        if self.left_open:
            left = "; ".join(f"{self.labels[k]}: {why}" for k, why in self.left_open.items())
            out.append(f"left open: {left}")
        return out


def open_points(table: pa.Table, sweep: SweepSpec) -> set[PointKey]:
    """Points whose comparison to the baseline (as `orchestrate run` prints it) or whose criterion
    is AMBIGUOUS on `table`."""
    out: set[PointKey] = set()
    order = [arm for case in sweep.cases for arm in case.arm_names()]
    try:
        result = compare_results(table, baseline=sweep.baseline, order=order)
    except InputError:
        return out
    for row in result.rows:
        if any(c.verdict == Verdict.AMBIGUOUS for c in row.comparisons.values()):
            out.add((row.dims.get("device", ""), row.case_name, row.point))
    for verdict in evaluate_criteria(table, sweep):
        out |= {(p.device, p.case_name, p.point) for p in verdict.points if p.outcome == Outcome.AMBIGUOUS}
    return out


def point_key(job: JobSpec) -> PointKey:
    return (job.device, job.case_name, point_of({k: str(v) for k, v in job.params.items()}))


def wanted(jobs: Iterable[tuple[JobSpec, pa.Table]], sweep: SweepSpec) -> list[tuple[JobSpec, pa.Table]]:
    """The jobs worth more rounds: measured cleanly, open, and short of their precision target."""
    measured = [(j, t) for j, t in jobs if "precision" in j.options and footer_status(t) == Status.OK]
    if not measured:
        return []
    short = {s.job_key for _, t in measured for s in shortfalls(t)}
    candidates = [(j, t) for j, t in measured if j.job_key in short]
    if not candidates:
        return []
    table = pa.concat_tables([t for _, t in candidates], promote_options="default")
    still_open = open_points(table, sweep)
    return [(j, t) for j, t in candidates if point_key(j) in still_open]


def prior_of(table: pa.Table) -> tuple[int, dict[str, dict[str, dict[str, float]]]]:
    """(the next round's number, `{metric: {arm: {round: value}}}` of every clean timed value)."""
    timed = table.filter(pc.and_(pc.greater_equal(table["sample"], 0), pc.equal(table["status"], "ok")))
    prior: dict[str, dict[str, dict[str, float]]] = {}
    for metric, arm, sample, value in zip(
        *(timed[c].to_pylist() for c in ("metric", "arm", "sample", "value")), strict=True
    ):
        if value is not None and math.isfinite(value):
            prior.setdefault(metric, {}).setdefault(arm, {})[str(sample)] = float(value)
    last = pc.max(table["sample"]).as_py()
    return (int(last) + 1 if last is not None and last >= 0 else 0), prior


def top_up_job(job: JobSpec, table: pa.Table, seconds: float) -> JobSpec:
    """`job` again, to go on from the rounds in `table` for at most `seconds` of sampling."""
    first, prior = prior_of(table)
    options = {**job.options, "first_round": first, "prior": prior, "max_seconds": seconds}
    return job.model_copy(update={"options": options})


def pooled(old: pa.Table, new: pa.Table) -> pa.Table:
    """The job's rows with a top-up's timed rows added (its untimed rows, checks and build times
    already in `old`, are dropped) and every timed row's sampling extras taken from the top-up."""
    fresh = new.filter(pc.greater_equal(new["sample"], 0))
    latest: dict[str, dict[str, str]] = {}
    for arm, extra in zip(fresh["arm"].to_pylist(), fresh["extra"].to_pylist(), strict=True):
        latest.setdefault(arm, {k: v for k, v in (extra or []) if k in SAMPLING_EXTRAS})
    extras = []
    for arm, sample, extra in zip(
        old["arm"].to_pylist(), old["sample"].to_pylist(), old["extra"].to_pylist(), strict=True
    ):
        mine = dict(extra or [])
        if sample is not None and sample >= 0 and arm in latest:
            mine = {**mine, **latest[arm]}
        extras.append(list(mine.items()))
    index = old.column_names.index("extra")
    old = old.set_column(index, "extra", pa.array(extras, type=old.schema.field("extra").type))
    merged = pa.concat_tables([old, fresh.cast(old.schema)])
    return merged.replace_schema_metadata(old.schema.metadata)
