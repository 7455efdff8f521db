"""Points whose sampling ended short of their precision target, and why.

A point with a `precision` target samples until every arm's 95 % interval to the baseline is that
narrow (`workers.job.sampling`); when its `max_seconds` or the round limit comes first, its timed
rows say so (`extra.stop_reason` = `budget` or `max_rounds`, with the `half_width` reached). A
verdict on such a point rests on a wider interval than the sweep asked for: `compare`, `check`
and the report name these points, and `orchestrate run --budget` tops up the ones whose verdict
is still open (`orchestrator.run.topup`).

The newest sampling of a point speaks for it: a top-up rewrites its rows' extras, and a later run
of the same point is judged on its own rows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.compute as pc

from orchestrator.analysis.groups import Point, point_of

SHORT_REASONS = ("budget", "max_rounds")
WHY = {"budget": "its max_seconds ran out", "max_rounds": "it reached the round limit"}


@dataclass(frozen=True)
class Shortfall:
    """One arm at one point whose interval stayed wider than its target."""

    device: str
    case_name: str
    point: Point
    arm: str
    metric: str  # the headline metric of those sampled together (`_headline`)
    run_id: str
    job_key: str
    stop_reason: str
    half_width: float
    precision: float
    rounds: int

    def describe(self, shown: list[str] | None = None) -> str:
        """`h100 qmm tokens=512 native prefill_tok_s: ±1.4 % after 400 rounds (target ±1 %): it reached
        the round limit`."""
        params = " ".join(f"{k}={v}" for k, v in self.point if shown is None or k in shown)
        where = " ".join(p for p in (self.device, self.case_name, params, self.arm, self.metric) if p)
        return (
            f"{where}: ±{self.half_width:.2%} after {self.rounds} rounds (target ±{self.precision:.2%}): "
            f"{WHY.get(self.stop_reason, self.stop_reason)}"
        )


def _number(extra: dict[str, str], key: str) -> float:
    try:
        return float(extra.get(key, "nan"))
    except ValueError:
        return math.nan


def _headline(metrics: set[str]) -> str:
    """The metric that names a sampling several metrics share (a kernel's seconds, its tok/s and its
    rates come from the same rounds): a rate in tok/s where there is one, else the first by name."""
    return min(metrics, key=lambda m: (not m.endswith("_tok_s"), m))


def shortfalls(table: pa.Table) -> list[Shortfall]:
    """Every (job, arm, sampling) of `table` that stopped short of its precision target.

    Read from the timed rows' extras (per job, arm and metric: the newest sample's, which a top-up
    rewrote). A job may sample its metrics apart (the `model` case's cold loads, prefill and decode
    rounds each go to the target on their own): each such sampling is named with its metric; the
    metrics of one sampling (the same stop, rounds and width) are named once. The baseline itself is
    never named: its rows repeat the widest of its point's arms.
    """
    needed = {"extra", "sample", "status", "device", "case_name", "params", "arm", "run_id", "job_key", "metric"}
    if table.num_rows == 0 or not needed <= set(table.column_names):
        return []
    timed = table.filter(pc.and_(pc.greater_equal(table["sample"], 0), pc.equal(table["status"], "ok")))
    names = ("extra", "sample", "device", "case_name", "params", "arm", "run_id", "job_key", "metric")
    cols = {n: timed[n].to_pylist() for n in names}
    newest: dict[tuple[str, str, str, str], tuple[int, dict[str, str]]] = {}
    where: dict[tuple[str, str, str, str], tuple[str, str, Point]] = {}
    for i in range(timed.num_rows):
        extra = dict(cols["extra"][i] or [])
        if extra.get("stop_reason") not in SHORT_REASONS or extra.get("baseline") == cols["arm"][i]:
            continue  # the baseline's rows repeat the widest of its point's arms
        key = (str(cols["run_id"][i]), str(cols["job_key"][i]), str(cols["arm"][i]), str(cols["metric"][i]))
        sample = int(cols["sample"][i])
        if key not in newest or sample > newest[key][0]:
            newest[key] = (sample, extra)
            where[key] = (str(cols["device"][i]), str(cols["case_name"][i]), point_of(cols["params"][i]))
    # (run, job, arm, stop reason, rounds, width, target) -> the metrics sampled that way
    samplings: dict[tuple[str, str, str, str, int, float, float], set[str]] = {}
    for (run_id, job_key, arm, metric), (_, extra) in newest.items():
        width, target = _number(extra, "half_width"), _number(extra, "precision")
        if not (math.isfinite(width) and math.isfinite(target)) or width <= target:
            continue
        rounds = _number(extra, "rounds")
        how = (run_id, job_key, arm, extra["stop_reason"], int(rounds) if math.isfinite(rounds) else 0, width, target)
        samplings.setdefault(how, set()).add(metric)
    out = []
    for (run_id, job_key, arm, reason, taken, width, target), metrics in samplings.items():
        metric = _headline(metrics)
        device, case_name, point = where[(run_id, job_key, arm, metric)]
        out.append(Shortfall(device, case_name, point, arm, metric, run_id, job_key, reason, width, target, taken))
    return sorted(out, key=lambda s: (s.device, s.case_name, s.point, s.arm, s.metric))


def shortfall_lines(table: pa.Table, shown: dict[str, list[str]] | None = None) -> list[str]:
    """What a table or verdict prints about the points that fell short (nothing when none did)."""
    found = shortfalls(table)
    if not found:
        return []
    points = {(s.device, s.case_name, s.point) for s in found}
    head = (
        f"{len(points)} point(s) stopped short of their precision target "
        "(their verdicts rest on wider intervals; `orchestrate run --budget DURATION` tops up the open ones):"
    )
    return [head, *(f"  {s.describe((shown or {}).get(s.case_name))}" for s in found)]
