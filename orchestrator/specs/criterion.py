"""A sweep's acceptance criteria (`[[criteria]]`) and what each must satisfy before anything runs.

Each criterion names arms the sweep has and selects at least one point: a `where` typo that
selects nothing is an error naming the criterion, not a verdict about nothing. How a criterion
is judged on stored rows is `orchestrator.analysis.criteria`'s.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from kernels.registry import did_you_mean
from orchestrator.errors import InputError
from orchestrator.specs.case import CaseEntry
from orchestrator.specs.names import Strict
from orchestrator.specs.where import Comparison, as_number, parse_where


class Criterion(Strict):
    """An acceptance criterion.

    `kind = "ratio"` (the default): `arm`'s metric over the baseline's, judged on its CI.
    `kind = "same-output"`: byte-identical greedy output (the rows' `output_sha256`) of `arm`
    (empty: every arm of the case) and the baseline at every point (`across = "arms"`), or of each
    arm at every commit of a commit comparison and at its BASE (`across = "commits"`).
    """

    name: str
    kind: Literal["ratio", "same-output"] = "ratio"
    metric: str = ""
    arm: str = ""
    baseline: str | None = None  # default: the sweep's baseline arm
    case: str | None = None  # default: every case that measures `metric`
    where: str | None = None  # e.g. "prompt_tokens >= 4096"
    min_ratio: float | None = Field(default=None, gt=0)
    max_ratio: float | None = Field(default=None, gt=0)
    across: Literal["arms", "commits"] = "arms"  # same-output only

    @field_validator("name", "metric")
    @classmethod
    def _printable(cls, v: str, info: ValidationInfo) -> str:
        if not v.isprintable() or (info.field_name == "name" and not v.strip()):
            raise ValueError(f"{info.field_name} {v!r} must be printable text on one line")
        return v

    @model_validator(mode="after")
    def _bounds(self) -> Criterion:
        if self.kind == "same-output":
            for name in ("metric", "min_ratio", "max_ratio"):
                if getattr(self, name):
                    raise ValueError(f"{name}: a same-output criterion compares greedy output, it takes no `{name}`")
            return self
        if self.across != "arms":
            raise ValueError("across: only a same-output criterion compares across commits")
        for name in ("metric", "arm"):
            if not getattr(self, name):
                raise ValueError(f"{name}: a ratio criterion needs `{name}`")
        if self.min_ratio is None and self.max_ratio is None:
            raise ValueError("a criterion needs min_ratio or max_ratio")
        return self

    @field_validator("where")
    @classmethod
    def _where(cls, v: str | None) -> str | None:
        if v is not None:
            try:
                parse_where(v, what=repr(v))
            except InputError as exc:
                raise ValueError(exc.message) from None
        return v


def _values(cases: Iterable[CaseEntry], name: str) -> list[str]:
    seen: dict[str, None] = {}
    for case in cases:
        for v in case.axes().get(name, []):
            seen.setdefault(str(v), None)
    return list(seen)


def _check_comparison(c: Comparison, values: list[str], what: str) -> None:
    if values and all(as_number(v) is not None for v in values) and as_number(c.value) is None:
        raise ValueError(f"{what}: {c.name} is a number ({', '.join(values)}), {c.value!r} is not")


def check_criterion(cases: list[CaseEntry], sweep_baseline: str | None, index: int, criterion: Criterion) -> None:
    """The criterion's arms exist, its `case` and `where` fit a case, and it selects a point.

    A ratio criterion needs its arm and a baseline in one case; a same-output one its arm (if it
    names one) and, across arms, two arms or more (`orchestrator.analysis.same_output`).
    """
    what = f"field criteria.{index} ({criterion.name!r})"
    arms = _arm_list(cases)
    same_output = criterion.kind == "same-output"
    for field, arm in (("arm", criterion.arm or None), ("baseline", criterion.baseline)):
        if arm is not None and arm not in arms:
            raise ValueError(
                f"{what}: {field} {arm!r} is not an arm of any case (arms: {', '.join(arms)}){did_you_mean(arm, arms)}"
            )
    baseline = criterion.baseline or sweep_baseline
    if baseline is None and not same_output:
        raise ValueError(f"{what}: no baseline arm (set `baseline` in the sweep or the criterion)")
    labels = list(dict.fromkeys(x for case in cases for x in (case.label, case.case)))
    if criterion.case is not None and criterion.case not in labels:
        hint = did_you_mean(criterion.case, labels)
        raise ValueError(
            f"{what}: case {criterion.case!r} is not a case of the sweep (cases: {', '.join(labels)})" + hint
        )

    def fits(case: CaseEntry) -> bool:
        own = case.arm_names()
        if criterion.case is not None and criterion.case not in (case.label, case.case):
            return False
        if not same_output:
            return {criterion.arm, baseline} <= set(own)
        if criterion.arm and criterion.arm not in own:
            return False
        return criterion.across != "arms" or (len(own) > 1 and (not criterion.baseline or criterion.baseline in own))

    fitting = [case for case in cases if fits(case)]
    if not fitting:
        if not same_output:
            wanted = f"both arms {criterion.arm!r} and {baseline!r}"
        else:  # as orchestrator.analysis.same_output says it
            wanted = f"arm {criterion.arm!r}" if criterion.arm else "two arms or more to compare"
        raise ValueError(f"{what}: no case has {wanted}")
    condition = parse_where(criterion.where or "", what=f"{what}: where")
    axes = list(dict.fromkeys(k for case in fitting for k in case.axes()))
    for comparison in condition.parts:
        if comparison.name not in axes:
            hint = did_you_mean(comparison.name, axes)
            raise ValueError(
                f"{what}: where names {comparison.name!r}, not a parameter of its cases "
                f"(parameters: {', '.join(axes)}){hint}"
            )
        _check_comparison(comparison, _values(fitting, comparison.name), f"{what}: where {criterion.where!r}")
    names = condition.names()
    for case in fitting:
        if names <= set(case.axes()) and any(
            condition.matches({k: str(v) for k, v in p.items()}) for p in case.points()
        ):
            return
    shown = "; ".join(f"{n}: {', '.join(_values(fitting, n))}" for n in sorted(names))
    raise ValueError(f"{what}: where {criterion.where!r} selects no point of the sweep ({shown})")


def _arm_list(cases: Iterable[CaseEntry]) -> list[str]:
    return list(dict.fromkeys(a for case in cases for a in case.arm_names()))


def check_baseline(cases: list[CaseEntry], baseline: str | None) -> None:
    """The sweep's baseline is an arm of one of its cases."""
    arms = _arm_list(cases)
    if baseline is not None and baseline not in arms:
        raise ValueError(
            f"field baseline: {baseline!r} is not an arm of any case (arms: {', '.join(arms)})"
            + did_you_mean(baseline, arms)
        )
