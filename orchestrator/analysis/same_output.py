"""The same-output criterion: byte-identical greedy output, per point, judged on the rows' digests.

A command case whose parser finds the generated text records its sha256 on every row of the run
(`extra['output_sha256']`; a `model` case: `extra['greedy_digest']`). A criterion of
`kind = "same-output"` compares those digests at every point (device, case, parameters) it selects:

* `across = "arms"`: at each commit, every arm (or `arm`) against the baseline arm;
* `across = "commits"`: each arm (or `arm`) at every commit of a commit comparison against its
  output at BASE.

As the engine's own `scripts/ab_output_equality.sh` does, the reference must agree with itself:
when its runs at a point produced more than one output, nothing can be attributed to the others
and the point is AMBIGUOUS (give the case `repetitions >= 2` so there is a control). Otherwise a
point FAILs naming the first differing arm (or commit), and PASSes when all are identical. A
point with no digest of a side (the run failed, or printed no text) is missing. A criterion over
commits on rows of one commit only is SKIPPED: there is nothing to compare (`--ref BASE --ref HEAD`).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa

from orchestrator.analysis import groups
from orchestrator.analysis.commits import commit_label
from orchestrator.analysis.groups import Point
from orchestrator.analysis.verdicts import CriterionVerdict, MissingPoint, Outcome, overall
from orchestrator.errors import InputError
from orchestrator.run.plan import points as case_points
from orchestrator.specs.case import CaseEntry
from orchestrator.specs.criterion import Criterion
from orchestrator.specs.sweep import SweepSpec
from orchestrator.specs.where import parse_where
from workers.contract import Status

DIGEST_KEYS = ("output_sha256", "greedy_digest")


@dataclass(frozen=True)
class OutputPoint:
    """One point's outcome: what was compared and, on FAIL, the first side that differs."""

    device: str
    case_name: str
    point: Point
    where: str  # the commit (across arms) or the arm (across commits) the comparison ran at
    outcome: Outcome
    detail: str
    differing: str | None = None


@dataclass
class OutputVerdict(CriterionVerdict):
    """A same-output criterion's verdict: its points are compared outputs (`outputs`), not ratios.

    `baseline` is the reference arm (across arms) or "BASE" (across commits).
    """

    outputs: list[OutputPoint] = field(default_factory=list)
    note: str = ""  # why the criterion was SKIPPED


def _entries(sweep: SweepSpec, criterion: Criterion) -> list[CaseEntry]:
    return [e for e in sweep.cases if criterion.case is None or criterion.case in (e.label, e.case)]


def reference_arm(sweep: SweepSpec, criterion: Criterion, entry: CaseEntry) -> str:
    """The arm the others are compared with: the criterion's baseline, the sweep's, else the first."""
    arms = entry.arm_names()
    for candidate in (criterion.baseline, sweep.baseline):
        if candidate and candidate in arms:
            return candidate
    return arms[0]


def validate(sweep: SweepSpec, criterion: Criterion) -> None:
    """Refuse, before anything runs, a same-output criterion no case of the sweep can answer.

    Raises:
        InputError: no case matches, the arms are not the case's, or `where` names no parameter.
    """
    condition = parse_where(criterion.where or "", what=f"criteria {criterion.name!r}: where")
    fits = []
    for entry in _entries(sweep, criterion):
        arms = entry.arm_names()
        if criterion.arm and criterion.arm not in arms:
            continue
        if criterion.across == "arms" and (len(arms) < 2 or (criterion.baseline and criterion.baseline not in arms)):
            continue
        if condition.names() <= set(entry.axes()):
            fits.append(entry)
    if not fits:
        what = f"arm {criterion.arm!r}" if criterion.arm else "two arms or more" if criterion.across == "arms" else "it"
        raise InputError(
            f"criteria {criterion.name!r}: no case of sweep {sweep.name!r} has {what}"
            + (f" and the parameters of where {criterion.where!r}" if criterion.where else "")
        )


def _digests(table: pa.Table) -> tuple[dict[tuple[Any, ...], dict[str, int]], dict[tuple[Any, ...], str]]:
    """Per (device, case, point, side, arm): each distinct output digest and in how many runs.

    Also per (device, case, point, side, arm) the first error of its failed rows (why it is missing).
    """
    cols = ["device", "case_name", "params", "arm", "commit", "extra", "status", "error", "run_id", "job_key", "sample"]
    outputs: dict[tuple[Any, ...], dict[str, int]] = defaultdict(dict)
    errors: dict[tuple[Any, ...], str] = {}
    seen: set[tuple[Any, ...]] = set()
    for row in table.select(cols).to_pylist():
        extra = dict(row["extra"] or [])
        side = (int(extra.get("ref_index", 0)), _side_label(extra.get("ref"), row["commit"]))
        key = (row["device"], row["case_name"], groups.point_of(row["params"]), side, row["arm"])
        if row["status"] != Status.OK:
            first_line = (row["error"] or "no error recorded").strip().splitlines()[0]
            errors.setdefault(key, f"{row['status']}: {first_line}")
            continue
        digest = next((extra[k] for k in DIGEST_KEYS if extra.get(k)), None)
        run = (row["run_id"], row["job_key"], side, row["arm"], row["sample"])
        if digest is None or run in seen:
            continue
        seen.add(run)
        outputs[key][digest] = outputs[key].get(digest, 0) + 1
    return outputs, errors


def _side_label(ref: str | None, commit: str | None) -> str:
    if commit:
        return commit_label(ref, commit)
    return ref or "(no commit)"  # the ref did not resolve or build


def _short(digests: dict[str, int]) -> str:
    return ", ".join(d[:12] for d in sorted(digests))


def _compare(
    reference: str, ref: dict[str, int], others: list[tuple[str, dict[str, int]]]
) -> tuple[Outcome, str, str | None]:
    """The outcome of one point: the reference's stability, then the first other that differs."""
    runs = sum(ref.values())
    if len(ref) > 1:
        return Outcome.AMBIGUOUS, f"{reference} is not run-to-run stable ({len(ref)} outputs in {runs} runs)", None
    for name, digests in others:
        if set(digests) != set(ref):
            return Outcome.FAIL, f"{name} ({_short(digests)}) differs from {reference} ({_short(ref)})", name
    names = ", ".join(n for n, _ in others)
    control = "" if runs > 1 else "; no control run of the reference (repetitions >= 2)"
    return Outcome.PASS, f"{names} identical to {reference} ({_short(ref)}){control}", None


def evaluate(table: pa.Table, sweep: SweepSpec, criterion: Criterion) -> OutputVerdict:
    """Judge one same-output criterion on stored rows (the newest run of each point, every commit)."""
    outputs, errors = _digests(table)
    condition = parse_where(criterion.where or "", what=f"criteria {criterion.name!r}: where")
    seen_devices = sorted(set(table["device"].to_pylist())) if table.num_rows else []
    sides_of: dict[tuple[str, str, Point], set[tuple[int, str]]] = defaultdict(set)
    for device, case_name, point, side, _ in [*outputs, *errors]:
        sides_of[(device, case_name, point)].add(side)
    verdict = OutputVerdict(criterion, "BASE", Outcome.PASS)
    multi = any(len(s) > 1 for s in sides_of.values())
    if criterion.across == "commits" and not multi:
        verdict.outcome = Outcome.SKIPPED
        verdict.note = (
            "the rows hold one commit; this criterion compares commits (orchestrate run --ref BASE --ref HEAD)"
        )
        return verdict
    for entry in _entries(sweep, criterion):
        arms = entry.arm_names()
        if criterion.arm and criterion.arm not in arms:
            continue
        reference = reference_arm(sweep, criterion, entry)
        verdict.baseline = reference if criterion.across == "arms" else "BASE"
        axes = entry.axes()
        verdict.shown[entry.label] = [k for k, v in axes.items() if len(v) > 1] or list(axes)
        if not condition.names() <= set(axes):
            continue
        for params in case_points(entry):
            point = groups.point_of({k: str(v) for k, v in params.items()})
            if not condition.matches(dict(point)):
                continue
            for device in entry.devices or sweep.devices or seen_devices or ["(any device)"]:
                sides = sorted(sides_of.get((device, entry.label, point), set()))
                _judge_point(verdict, criterion, device, entry.label, point, sides, arms, reference, outputs, errors)
    verdict.outcome = overall({p.outcome for p in verdict.outputs}, bool(verdict.missing) or not verdict.outputs)
    return verdict


def _judge_point(
    verdict: OutputVerdict,
    criterion: Criterion,
    device: str,
    case_name: str,
    point: Point,
    sides: list[tuple[int, str]],
    arms: list[str],
    reference: str,
    outputs: dict[tuple[Any, ...], dict[str, int]],
    errors: dict[tuple[Any, ...], str],
) -> None:
    def get(side: tuple[int, str], arm: str) -> dict[str, int]:
        return outputs.get((device, case_name, point, side, arm), {})

    def why(side: tuple[int, str], arm: str) -> str:
        error = errors.get((device, case_name, point, side, arm))
        return f"no greedy output of {arm} at {side[1]}" + (f" ({error})" if error else " (the parser found no text)")

    if not sides:
        verdict.missing.append(MissingPoint(device, case_name, point, "not run"))
        return
    if criterion.across == "commits":
        if len(sides) < 2:
            verdict.missing.append(MissingPoint(device, case_name, point, f"only one commit measured ({sides[0][1]})"))
            return
        base = sides[0]
        for arm in [criterion.arm] if criterion.arm else arms:
            ref = get(base, arm)
            if not ref:
                verdict.missing.append(MissingPoint(device, case_name, point, why(base, arm)))
                continue
            others = [(side[1], get(side, arm)) for side in sides[1:]]
            gaps = [why(side, arm) for side, (_, d) in zip(sides[1:], others, strict=True) if not d]
            if gaps:
                verdict.missing.append(MissingPoint(device, case_name, point, gaps[0]))
                continue
            outcome, detail, differing = _compare(f"BASE {base[1]}", ref, others)
            verdict.outputs.append(OutputPoint(device, case_name, point, arm, outcome, detail, differing))
        return
    compared = [criterion.arm] if criterion.arm else [a for a in arms if a != reference]
    for side in sides:
        ref = get(side, reference)
        gaps = [why(side, a) for a in [reference, *compared] if not get(side, a)]
        if gaps:
            verdict.missing.append(MissingPoint(device, case_name, point, gaps[0]))
            continue
        outcome, detail, differing = _compare(reference, ref, [(a, get(side, a)) for a in compared])
        verdict.outputs.append(OutputPoint(device, case_name, point, side[1], outcome, detail, differing))


def rule_text(v: OutputVerdict) -> str:
    """`byte-identical greedy output, every arm against opt-out`: what the criterion compares."""
    c, arms = v.criterion, v.criterion.arm or "every arm"
    what = f"{arms} against {v.baseline}" if c.across == "arms" else f"{arms} at every commit against BASE"
    return f"byte-identical greedy output, {what}"


def describe(v: CriterionVerdict) -> list[str]:
    """Human lines for one verdict (an `OutputVerdict`): the headline, then every non-passing and missing point."""
    if not isinstance(v, OutputVerdict):
        raise TypeError(f"a same-output criterion's verdict is an OutputVerdict, not {type(v).__name__}")
    c = v.criterion
    head = f"{v.outcome.value:<9} {c.name}: {rule_text(v)}"
    if v.note:
        return [f"{head}; {v.note}"]
    passed = sum(1 for p in v.outputs if p.outcome is Outcome.PASS)
    head += f"; {passed} of {len(v.outputs) + len(v.missing)} points identical"
    lines = [head]
    for p in v.outputs:
        if p.outcome is not Outcome.PASS:
            lines.append(f"    {p.outcome.value:<9} {v.label(p.device, p.case_name, p.point)} ({p.where}): {p.detail}")
    for m in v.missing:
        lines.append(f"    MISSING   {v.label(m.device, m.case_name, m.point)}: {m.reason}")
    if not v.outputs and not v.missing:
        lines.append("    no point of the sweep matches this criterion")
    return lines
