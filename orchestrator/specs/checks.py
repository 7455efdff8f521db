"""What a sweep must satisfy beyond its fields' types, checked before anything starts.

* Size: a sweep is counted before it is expanded: at most `MAX_JOBS` jobs (parameter points x
  device kinds), so a typo that makes 10^9 jobs is an error naming the count, not a `MemoryError`.
* Points: every point of every case passes the case's own rule (`kernels.registry.check_point`).
* Memory: where the inventory (`memory_gib`) or this machine's fingerprint knows a device kind's
  memory, every point's arrays (`kernels.registry.device_bytes`, a lower bound) fit in it.
* Criteria: each names arms the sweep has and selects at least one point (a `where` typo that
  selects nothing is an error naming the criterion, not a verdict about nothing).

Each check raises `ValueError` (inside pydantic validation) or `InputError` (against an
inventory) whose message names the field.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from kernels import registry
from kernels.registry import did_you_mean
from orchestrator.errors import InputError
from orchestrator.specs.where import Comparison, as_number, parse_where

if TYPE_CHECKING:
    from orchestrator.specs.sweep import CaseEntry, Criterion, HostSpec, InventorySpec, SweepSpec

MAX_JOBS = 10_000
GIB = 1024**3


def check_size(points: int, what: str) -> None:
    """Refuse more than `MAX_JOBS` jobs, before any is made."""
    if points > MAX_JOBS:
        raise ValueError(
            f"{what} has {points:,} jobs, more than the limit of {MAX_JOBS:,}: give fewer values per axis "
            "or split it into several sweeps"
        )


def job_count(sweep: SweepSpec, kinds: list[str]) -> int:
    """Jobs the sweep expands to on `kinds`: each case's points times its device kinds."""
    return sum(case.point_count() * len(case.devices or kinds) for case in sweep.cases)


def check_points(case: CaseEntry) -> None:
    """Every point of the case passes the case's own rule."""
    for point in case.points():
        try:
            registry.check_point(case.case, point)
        except ValueError as exc:
            raise ValueError(f"params of case {case.label!r}: {exc}") from None


# ----------------------------------------------------------------------------------------- memory


def _size(n: float) -> str:
    for unit, scale in (("TiB", 1024**4), ("GiB", GIB), ("MiB", 1024**2)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n:.0f} bytes"


def host_memory(host: HostSpec) -> tuple[int, str] | None:
    """The bytes a host's device offers a job and where that is known from: its `memory_gib`, else
    this machine's fingerprint (RAM, or the GPU's memory), else None."""
    if host.memory_gib is not None:
        return int(host.memory_gib * GIB), "its memory_gib"
    if host.this_machine:
        from workers.host.fingerprint import device_memory_bytes

        found = device_memory_bytes(host.backend)
        return (found, "this machine's " + ("RAM" if host.backend in ("cpu", "metal") else "GPU")) if found else None
    return None


def check_memory(sweep: SweepSpec, inventory: InventorySpec, kinds: list[str], where: str) -> None:
    """Refuse a point whose arrays alone exceed the memory of a device kind it runs on."""
    smallest: dict[str, tuple[int, str]] = {}
    for host in inventory.hosts:
        known = host_memory(host)
        if known and (host.device not in smallest or known[0] < smallest[host.device][0]):
            smallest[host.device] = (
                known[0],
                f"host {host.name!r} (device kind {host.device}) has {_size(known[0])}, {known[1]}",
            )
    for i, case in enumerate(sweep.cases):
        measured = [k for k in (case.devices or kinds) if k in smallest]
        if not measured:
            continue
        arms = case.arm_names()
        need, point = max(((registry.device_bytes(case.case, p, arms), p) for p in case.points()), key=lambda t: t[0])
        for kind in measured:
            memory, has = smallest[kind]
            if need > memory:
                shown = ", ".join(f"{k}={v}" for k, v in point.items())
                raise InputError(
                    f"field cases.{i}.params: {case.label} at {shown} needs at least {_size(need)} of device "
                    f"memory for its arrays; {has}",
                    where=where,
                )


# --------------------------------------------------------------------------------------- criteria


def _values(cases: Iterable[CaseEntry], name: str) -> list[str]:
    seen: dict[str, None] = {}
    for case in cases:
        for v in case.axes().get(name, []):
            seen.setdefault(str(v), None)
    return list(seen)


def _check_comparison(c: Comparison, values: list[str], what: str) -> None:
    if values and all(as_number(v) is not None for v in values) and as_number(c.value) is None:
        raise ValueError(f"{what}: {c.name} is a number ({', '.join(values)}), {c.value!r} is not")


def check_criterion(sweep: SweepSpec, index: int, criterion: Criterion) -> None:
    """The criterion's arms exist, its `case` and `where` fit a case, and it selects a point.

    A ratio criterion needs its arm and a baseline in one case; a same-output one its arm (if it
    names one) and, across arms, two arms or more (`orchestrator.analysis.same_output`).
    """
    what = f"field criteria.{index} ({criterion.name!r})"
    arms = _arm_list(sweep.cases)
    same_output = criterion.kind == "same-output"
    for field, arm in (("arm", criterion.arm or None), ("baseline", criterion.baseline)):
        if arm is not None and arm not in arms:
            raise ValueError(
                f"{what}: {field} {arm!r} is not an arm of any case (arms: {', '.join(arms)}){did_you_mean(arm, arms)}"
            )
    baseline = criterion.baseline or sweep.baseline
    if baseline is None and not same_output:
        raise ValueError(f"{what}: no baseline arm (set `baseline` in the sweep or the criterion)")
    labels = list(dict.fromkeys(x for case in sweep.cases for x in (case.label, case.case)))
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

    cases = [case for case in sweep.cases if fits(case)]
    if not cases:
        if not same_output:
            wanted = f"both arms {criterion.arm!r} and {baseline!r}"
        else:  # as orchestrator.analysis.same_output says it
            wanted = f"arm {criterion.arm!r}" if criterion.arm else "two arms or more to compare"
        raise ValueError(f"{what}: no case has {wanted}")
    condition = parse_where(criterion.where or "", what=f"{what}: where")
    axes = list(dict.fromkeys(k for case in cases for k in case.axes()))
    for comparison in condition.parts:
        if comparison.name not in axes:
            hint = did_you_mean(comparison.name, axes)
            raise ValueError(
                f"{what}: where names {comparison.name!r}, not a parameter of its cases "
                f"(parameters: {', '.join(axes)}){hint}"
            )
        _check_comparison(comparison, _values(cases, comparison.name), f"{what}: where {criterion.where!r}")
    names = condition.names()
    for case in cases:
        if names <= set(case.axes()) and any(
            condition.matches({k: str(v) for k, v in p.items()}) for p in case.points()
        ):
            return
    shown = "; ".join(f"{n}: {', '.join(_values(cases, n))}" for n in sorted(names))
    raise ValueError(f"{what}: where {criterion.where!r} selects no point of the sweep ({shown})")


def _arm_list(cases: Iterable[CaseEntry]) -> list[str]:
    return list(dict.fromkeys(a for case in cases for a in case.arm_names()))


def check_baseline(sweep: SweepSpec) -> None:
    """The sweep's baseline is an arm of one of its cases."""
    arms = _arm_list(sweep.cases)
    if sweep.baseline is not None and sweep.baseline not in arms:
        raise ValueError(
            f"field baseline: {sweep.baseline!r} is not an arm of any case (arms: {', '.join(arms)})"
            + did_you_mean(sweep.baseline, arms)
        )
