"""What a bisection follows, and over which commits: one point, arm and metric of one command case
(or kernel case: `orchestrator.run.bisect_kernel`) on one device kind, and the commits of its
repository from GOOD (excluded) to BAD.

Defaults come from the sweep: the metric and arm of its first ratio criterion (of the metric, where
`--metric` is given), that criterion's case, the case's single value of each axis, the device kind
the case or the sweep names alone. What cannot be defaulted is asked for, with the choices.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kernels import registry
from orchestrator.errors import InputError
from orchestrator.specs.case import CaseEntry
from orchestrator.specs.sweep import SweepSpec
from workers.command.case import CommandCase, CommandCaseError, git, resolve_commit


@dataclass(frozen=True)
class Target:
    """The case, point, arm, metric and device kind a bisection measures."""

    case: CaseEntry
    point: dict[str, Any]
    arm: str
    metric: str
    device: str

    def point_text(self) -> str:
        """`prompt_tokens=512` (as `--point` takes it)."""
        return ",".join(f"{k}={v}" for k, v in self.point.items())


def parse_point(text: str | None) -> dict[str, str]:
    """`prompt_tokens=512,checkpoint=x` -> its fields (values as written)."""
    if not text:
        return {}
    out: dict[str, str] = {}
    for part in text.split(","):
        key, sep, value = part.partition("=")
        if not sep or not key.strip():
            raise InputError(f"--point {text!r}: write NAME=VALUE[,NAME=VALUE], e.g. prompt_tokens=512")
        out[key.strip()] = value.strip()
    return out


def _criterion(sweep: SweepSpec, metric: str | None) -> tuple[str | None, str | None, str | None]:
    """(case, arm, metric) of the first ratio criterion (of `metric`, when given)."""
    for c in sweep.criteria:
        if c.kind == "ratio" and (metric is None or c.metric == metric):
            return c.case, c.arm, c.metric
    return None, None, metric


def _case(sweep: SweepSpec, named: str | None, point: dict[str, str]) -> CaseEntry:
    kinds = (registry.CaseKind.COMMAND, registry.CaseKind.KERNEL)
    commands = [c for c in sweep.cases if registry.CASES[c.case].kind in kinds]
    if not commands:
        raise InputError(f"sweep {sweep.name!r} has no command or kernel case: bisect builds code at each commit")
    if named is not None:
        hits = [c for c in commands if c.label == named]
        if hits:
            return hits[0]
    fitting = [c for c in commands if set(point) <= set(c.axes())] if point else commands
    if len(fitting) != 1:
        names = ", ".join(c.label for c in fitting or commands)
        raise InputError(f"sweep {sweep.name!r}: name the case with --case (one of {names})")
    return fitting[0]


def _point(case: CaseEntry, given: dict[str, str]) -> dict[str, Any]:
    axes = case.axes()
    unknown = sorted(set(given) - set(axes))
    if unknown:
        raise InputError(f"--point: case {case.label!r} has no parameter {unknown[0]!r} (it has {', '.join(axes)})")
    point: dict[str, Any] = {}
    for key, values in axes.items():
        if key in given:
            match = [v for v in values if str(v) == given[key]]
            if not match:
                listed = ", ".join(str(v) for v in values)
                raise InputError(f"--point {key}={given[key]}: case {case.label!r} measures {key} at {listed}")
            point[key] = match[0]
        elif len(values) == 1:
            point[key] = values[0]
        else:
            listed = ", ".join(str(v) for v in values)
            raise InputError(f"--point: give {key}= one of {listed} (case {case.label!r} measures several)")
    return point


def choose_target(
    sweep: SweepSpec,
    *,
    case: str | None = None,
    point: str | None = None,
    arm: str | None = None,
    metric: str | None = None,
    device: str | None = None,
) -> Target:
    """The target of a bisection, its defaults taken from the sweep (module docstring).

    Raises:
        InputError: nothing to default from, or a choice the sweep does not have.
    """
    given = parse_point(point)
    crit_case, crit_arm, crit_metric = _criterion(sweep, metric)
    chosen = _case(sweep, case or crit_case, given)
    arms = chosen.arm_names()
    arm = arm or (crit_arm if crit_arm in arms else None) or (arms[0] if len(arms) == 1 else None)
    if arm is None or arm not in arms:
        raise InputError(f"--arm: case {chosen.label!r} has arms {', '.join(arms)}; name the one to follow")
    if crit_metric is None:
        raise InputError(f"--metric: sweep {sweep.name!r} has no ratio criterion to take it from (e.g. decode_tok_s)")
    kinds = chosen.devices or sweep.devices
    device = device or (kinds[0] if len(kinds) == 1 else None)
    if device is None:
        raise InputError(f"--device: sweep {sweep.name!r} runs on {', '.join(kinds) or 'every kind'}; name one")
    return Target(chosen, _point(chosen, given), arm, crit_metric, device)


@dataclass(frozen=True)
class CommitRange:
    """GOOD's commit and the commits after it up to BAD (oldest first; BAD last), with their lines."""

    good: str
    commits: list[str]
    lines: dict[str, str]  # commit -> `subject (Author <mail>, date)`

    @property
    def bad(self) -> str:
        return self.commits[-1]


def commit_range(case: CaseEntry, good: str, bad: str) -> CommitRange:
    """Resolve GOOD and BAD in the case's repo (mirrored on this machine) and list the commits between.

    The first-parent chain from GOOD to BAD: a merge counts as one commit, as a nightly saw it.

    Raises:
        InputError: the repo cannot be reached here, a ref is unknown, or BAD does not descend from GOOD.
    """
    options = {"repo": case.repo, "run": case.run or "true", "ref": good, "base_dir": None}
    try:
        command = CommandCase.from_options(options)
        mirror, good_commit = resolve_commit(command)
        _, bad_commit = resolve_commit(command.for_ref(bad))
    except CommandCaseError as exc:
        raise InputError(f"bisect: {exc}") from None
    where = ("--git-dir", str(mirror))
    try:
        git(*where, "merge-base", "--is-ancestor", good_commit, bad_commit)
    except CommandCaseError:
        why = f"--bad {bad}: {bad_commit[:12]} does not descend from --good {good} ({good_commit[:12]})"
        raise InputError(why) from None
    listed = git(*where, "rev-list", "--reverse", "--first-parent", f"{good_commit}..{bad_commit}").split()
    if not listed:
        raise InputError(f"--good {good} and --bad {bad} are the same commit ({good_commit[:12]}): nothing to bisect")
    fmt = "--format=%H%x09%s (%an <%ae>, %ad)"
    log = git(*where, "log", "--no-walk=unsorted", fmt, "--date=short", good_commit, *listed)
    lines = dict(line.split("\t", 1) for line in log.splitlines() if "\t" in line)
    return CommitRange(good_commit, listed, lines)
