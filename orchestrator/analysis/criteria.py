"""Acceptance criteria: a sweep's `[[criteria]]` judged on confidence intervals.

A criterion compares one arm with the baseline arm on one metric at every point of the sweep
that its `case` and `where` select, on every device: the ratio of medians `arm / baseline` with
its bootstrap interval. At one point, with `min_ratio` m: PASS when the whole interval is >= m,
FAIL when it is wholly below m, AMBIGUOUS when it straddles m (and about how many more samples
would settle it); `max_ratio` mirrors that. A criterion PASSes when every point passes, FAILs
when one point fails, and is AMBIGUOUS otherwise -- including when points are missing (a job
that never ran, failed, or was contended): those are named, never passed over.

`orchestrator.analysis.verdicts.exit_code_for` maps the verdicts onto `orchestrate`'s exit codes:
0 all pass, 1 one fails, 4 none fails but one is ambiguous. Each criterion kind (`KINDS`: ratio,
same output) is registered once with how it is checked, judged and told.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass

import pyarrow as pa

from orchestrator.analysis import groups, same_output, stats
from orchestrator.analysis.commits import head_rows
from orchestrator.analysis.fdr import benjamini_hochberg
from orchestrator.analysis.groups import Point
from orchestrator.analysis.power import Settle, past_p_value
from orchestrator.analysis.samples import grouped_samples
from orchestrator.analysis.stats import Comparison
from orchestrator.analysis.verdicts import CriterionVerdict, MissingPoint, Outcome, PointResult, exit_code_for, overall
from orchestrator.errors import EXIT_OK, InputError
from orchestrator.run.plan import points as case_points
from orchestrator.specs.criterion import Criterion
from orchestrator.specs.sweep import SweepSpec
from orchestrator.specs.where import Condition, parse_where
from orchestrator.store.dataset import read_rows
from orchestrator.store.fragments import ResultStore
from workers.contract import Status


def judge_ratio(comparison: Comparison, criterion: Criterion) -> tuple[Outcome, Settle | None, str | None]:
    """PASS, FAIL or AMBIGUOUS for one comparison against the criterion's bounds, with what more
    samples per arm would do for an AMBIGUOUS one (`stats.settle_of` against the bound it
    straddles, at the sweep's precision when the rows carry one) and why there is no verdict
    where there is none (`n=3: too few to judge`, or the estimate sitting on the bound)."""
    if comparison.verdict is stats.Verdict.TOO_FEW:
        return Outcome.AMBIGUOUS, comparison.settle, comparison.note
    ratio = comparison.ratio
    lo, hi = ratio.ci_low, ratio.ci_high
    if not (math.isfinite(lo) and math.isfinite(hi)):
        return Outcome.AMBIGUOUS, None, None
    outcomes: list[tuple[Outcome, Settle | None]] = []
    for bound, passes, fails in (
        (criterion.min_ratio, lo >= (criterion.min_ratio or 0), hi < (criterion.min_ratio or 0)),
        (criterion.max_ratio, hi <= (criterion.max_ratio or 0), lo > (criterion.max_ratio or 0)),
    ):
        if bound is None:
            continue
        if passes:
            outcomes.append((Outcome.PASS, None))
        elif fails:
            outcomes.append((Outcome.FAIL, None))
        else:
            outcomes.append((Outcome.AMBIGUOUS, stats.settle_of(comparison, bound=bound)))
    for wanted in (Outcome.FAIL, Outcome.AMBIGUOUS):
        for outcome, settle in outcomes:
            if outcome is wanted:
                return outcome, settle, settle.edge_note() if settle else None
    return Outcome.PASS, None, None


def fail_p_value(comparison: Comparison, criterion: Criterion) -> float:
    """Two-sided p-value of "the ratio lies within the criterion's bounds", read off the bootstrap
    draws behind the interval (`power.past_p_value`): below 0.05 exactly at a failing point."""
    lower = math.log(criterion.min_ratio) if criterion.min_ratio else -math.inf
    upper = math.log(criterion.max_ratio) if criterion.max_ratio else math.inf
    return past_p_value(comparison.draws, lower, upper)


def expected_points(sweep: SweepSpec, criterion: Criterion, baseline: str) -> list[tuple[str, list[str], Point]]:
    """(case label, case devices, point) for every point the criterion applies to.

    Raises:
        InputError: no case of the sweep has both arms, or `where` names no parameter of any case.
    """
    condition: Condition = parse_where(criterion.where or "", what=f"criteria {criterion.name!r}: where")
    out: list[tuple[str, list[str], Point]] = []
    applicable = 0
    for entry in sweep.cases:
        if criterion.case is not None and criterion.case not in (entry.label, entry.case):
            continue
        arms = entry.arm_names()
        if criterion.arm not in arms or baseline not in arms:
            continue
        if not condition.names() <= set(entry.axes()):
            continue
        applicable += 1
        for params in case_points(entry):
            point = groups.point_of({k: str(v) for k, v in params.items()})
            if condition.matches(dict(point)):
                out.append((entry.label, list(entry.devices or sweep.devices), point))
    if applicable == 0:
        raise InputError(
            f"criteria {criterion.name!r}: no case of sweep {sweep.name!r} has arms {criterion.arm!r} and "
            f"{baseline!r}" + (f" and the parameters of where {criterion.where!r}" if criterion.where else "")
        )
    return out


def _varying_axes(sweep: SweepSpec) -> dict[str, list[str]]:
    """Per case label, its axes of more than one value (else all of them): what names a point."""
    out = {}
    for entry in sweep.cases:
        axes = entry.axes()
        out[entry.label] = [k for k, v in axes.items() if len(v) > 1] or list(axes)
    return out


def _why_missing(table_rows: list[dict[str, object]], arm: str, baseline: str, metric: str) -> str:
    """Why a point has no clean samples of `arm` or `baseline` (failed, contended, absent)."""
    reasons = []
    for side in (arm, baseline):
        rows = [r for r in table_rows if r["arm"] == side]
        if not rows:
            reasons.append(f"no {side} rows")
            continue
        bad = [r for r in rows if r["status"] != Status.OK]
        if bad:
            reasons.append(f"{side} {bad[0]['status']}: {bad[0]['error'] or 'no error recorded'}")
        elif any(r["contended"] for r in rows):
            reasons.append(f"{side} contended")
        elif not any(r["metric"] == metric for r in rows):
            reasons.append(f"no {side} {metric}")
    return "; ".join(reasons) or "no clean samples"


def evaluate_ratio(table: pa.Table, sweep: SweepSpec, criterion: Criterion, resamples: int) -> CriterionVerdict:
    """Judge one ratio criterion on stored rows of the sweep (see the module docstring): HEAD alone
    where the rows hold a commit comparison."""
    table = head_rows(table)
    baseline = criterion.baseline or sweep.baseline
    if baseline is None:
        raise InputError(f"criteria {criterion.name!r}: no baseline arm (set `baseline` in the sweep or criterion)")
    expected = expected_points(sweep, criterion, baseline)
    samples = {
        groups.GroupKey(*key): group
        for key, group in grouped_samples(table, ["device", "case_name", "params", "arm", "metric"])
    }
    seen_devices = sorted(set(table["device"].to_pylist())) if table.num_rows else []
    # Every row (clean or not) of each (device, case, point): to tell a missing point from one
    # that does not measure this metric (decode_tok_s only exists at tokens=1).
    slim = table.select(["device", "case_name", "params", "arm", "metric", "status", "contended", "error"])
    by_point: dict[tuple[str, str, Point], list[dict[str, object]]] = {}
    for row in slim.to_pylist():
        key = (str(row["device"]), str(row["case_name"]), groups.point_of(row["params"]))
        by_point.setdefault(key, []).append(row)
    verdict = CriterionVerdict(criterion, baseline, Outcome.PASS, shown=_varying_axes(sweep))
    comparisons: list[Comparison] = []
    for case_name, devices, point in expected:
        for device in devices or seen_devices or ["(any device)"]:
            rows_here = by_point.get((device, case_name, point), [])
            key_a = groups.GroupKey(device, case_name, point, criterion.arm, criterion.metric)
            key_b = groups.GroupKey(device, case_name, point, baseline, criterion.metric)
            a, b = samples.get(key_a), samples.get(key_b)
            if a and b:
                c = stats.compare_samples(
                    a.values,
                    b.values,
                    metric=criterion.metric,
                    seed=stats.comparison_seed(case_name, point, (device,), criterion.arm, baseline),
                    resamples=resamples,
                    a_keys=a.pair_keys(),
                    b_keys=b.pair_keys(),
                    precision=a.target_with(b),
                )
                outcome, settle, note = judge_ratio(c, criterion)
                verdict.points.append(PointResult(device, case_name, point, c.ratio, outcome, settle, note))
                comparisons.append(c)
                continue
            measured_elsewhere = rows_here and all(r["status"] == "ok" and not r["contended"] for r in rows_here)
            if measured_elsewhere and not any(r["metric"] == criterion.metric for r in rows_here):
                continue  # the point ran cleanly and simply does not measure this metric
            reason = _why_missing(rows_here, criterion.arm, baseline, criterion.metric) if rows_here else "not run"
            verdict.missing.append(MissingPoint(device, case_name, point, reason))
    _control_failures(verdict, comparisons)
    verdict.outcome = overall({p.outcome for p in verdict.points}, bool(verdict.missing) or not verdict.points)
    return verdict


def _control_failures(verdict: CriterionVerdict, comparisons: list[Comparison]) -> None:
    """A criterion FAILs on any one of its points, so each point is one more chance of a false
    FAIL: a failing point counts only where Benjamini-Hochberg at q = 5 % over the criterion's
    points rejects "the bound holds there"; the others become AMBIGUOUS."""
    failing = [i for i, p in enumerate(verdict.points) if p.outcome is Outcome.FAIL]
    if not failing:
        return
    p_values = [fail_p_value(comparisons[i], verdict.criterion) for i in range(len(verdict.points))]
    tested = [i for i, p in enumerate(p_values) if not math.isnan(p)]
    rejected = dict(zip(tested, benjamini_hochberg([p_values[i] for i in tested]), strict=True))
    for i in failing:
        if not rejected.get(i, True):
            note = f"p={p_values[i]:.2g}: not significant over the criterion's {len(tested)} points"
            verdict.points[i] = dataclasses.replace(verdict.points[i], outcome=Outcome.AMBIGUOUS, note=note)


def validate_ratio(sweep: SweepSpec, criterion: Criterion) -> None:
    """Refuse a ratio criterion without a baseline, or whose arms or `where` fit no case."""
    baseline = criterion.baseline or sweep.baseline
    if baseline is None:
        raise InputError(f"criteria {criterion.name!r}: no baseline arm (set `baseline` in the sweep or criterion)")
    expected_points(sweep, criterion, baseline)


def validate_criteria(sweep: SweepSpec) -> None:
    """Refuse, before anything runs, a criterion that no case of the sweep can answer.

    Raises:
        InputError: a criterion without a baseline, or whose arms or `where` fit no case.
    """
    for criterion in sweep.criteria:
        KINDS[criterion.kind].validate(sweep, criterion)


def evaluate_criterion(
    table: pa.Table, sweep: SweepSpec, criterion: Criterion, *, resamples: int = stats.RESAMPLES
) -> CriterionVerdict:
    """Judge one criterion on stored rows of the sweep, by its kind."""
    return KINDS[criterion.kind].evaluate(table, sweep, criterion, resamples)


def evaluate_criteria(table: pa.Table, sweep: SweepSpec, *, resamples: int = stats.RESAMPLES) -> list[CriterionVerdict]:
    """Judge every criterion of `sweep` on its stored rows (pass the rows of this sweep only)."""
    return [evaluate_criterion(table, sweep, c, resamples=resamples) for c in sweep.criteria]


def bound_text(c: Criterion) -> str:
    """`native/affine prefill_tok_s >= 0.97` for a criterion."""
    parts = []
    if c.min_ratio is not None:
        parts.append(f">= {c.min_ratio:g}")
    if c.max_ratio is not None:
        parts.append(f"<= {c.max_ratio:g}")
    return " and ".join(parts)


def describe(v: CriterionVerdict) -> list[str]:
    """Human lines for one verdict, by its criterion's kind."""
    return KINDS[v.criterion.kind].describe(v)


def describe_ratio(v: CriterionVerdict) -> list[str]:
    """Human lines for a ratio verdict: the headline, then ambiguous, failing and missing points."""
    c = v.criterion
    head = f"{v.outcome.value:<9} {c.name}: {c.metric} {c.arm}/{v.baseline} {bound_text(c)}"
    worst = v.worst()
    if worst is not None:
        r = worst.ratio
        head += (
            f"; {len(v.points)} points, worst {r.ratio:.3f} [{r.ci_low:.3f}, {r.ci_high:.3f}] at "
            f"{v.label(worst.device, worst.case_name, worst.point)}"
        )
    lines = [head]
    for p in v.points:
        if p.outcome is Outcome.PASS:
            continue
        r = p.ratio
        note = f" (about {p.more_samples} more samples per arm would settle it)" if p.more_samples else ""
        note = f" ({p.note})" + note if p.note else note
        lines.append(
            f"    {p.outcome.value:<9} {v.label(p.device, p.case_name, p.point)}: "
            f"{r.ratio:.3f} [{r.ci_low:.3f}, {r.ci_high:.3f}], n={r.n_a}/{r.n_b}{note}"
        )
    for m in v.missing:
        lines.append(f"    MISSING   {v.label(m.device, m.case_name, m.point)}: {m.reason}")
    if not v.points and not v.missing:
        lines.append("    no point of the sweep matches this criterion")
    return lines


@dataclass(frozen=True)
class CriterionKind:
    """What one `kind` of criterion (`Criterion.kind`) does: refuse a criterion no case can answer
    before a run, judge stored rows, and tell its verdict in text."""

    validate: Callable[[SweepSpec, Criterion], None]
    evaluate: Callable[[pa.Table, SweepSpec, Criterion, int], CriterionVerdict]
    describe: Callable[[CriterionVerdict], list[str]]


# Every kind a sweep may name (`Criterion.kind`'s values); a new kind is one entry here.
KINDS: dict[str, CriterionKind] = {
    "ratio": CriterionKind(validate_ratio, evaluate_ratio, describe_ratio),
    "same-output": CriterionKind(
        same_output.validate,
        lambda table, sweep, c, _resamples: same_output.evaluate(table, sweep, c),
        same_output.describe,
    ),
}


def judge_stored(store: ResultStore, sweep: SweepSpec) -> tuple[str, int]:
    """`orchestrate run`'s last step: the sweep's criteria on its newest stored rows.

    Returns:
        The rendered verdicts (empty when the sweep declares none) and the exit code for them.
    """
    if not sweep.criteria:
        return "", EXIT_OK
    verdicts = evaluate_criteria(read_rows(store, sweep=sweep.name, newest=True), sweep)
    return "Acceptance criteria:\n" + render_verdicts(verdicts), exit_code_for(verdicts)


def render_verdicts(verdicts: list[CriterionVerdict]) -> str:
    """All verdicts as text, one block per criterion."""
    if not verdicts:
        return "No acceptance criteria in this sweep."
    return "\n".join(line for v in verdicts for line in describe(v))
