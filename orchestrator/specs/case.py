"""A sweep's cases: one `[[cases]]` table each, its arms and its parameter axes.

A case is checked against its kind's registration (`kernels.registry`): the arms and parameters
it may name, each value's type, and every point against the kind's own rule. A case is counted
before it is expanded: at most `MAX_JOBS` jobs (parameter points x device kinds), so a typo that
makes 10^9 jobs is an error naming the count, not a `MemoryError`.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from kernels import registry
from kernels.registry import did_you_mean
from orchestrator.specs.names import Strict, check_env, check_name
from workers.command.case import FIELD_RE, check_case_settings

ParamValue = int | float | str | bool
MAX_JOBS = 10_000


def check_size(points: int, what: str) -> None:
    """Refuse more than `MAX_JOBS` jobs, before any is made."""
    if points > MAX_JOBS:
        raise ValueError(
            f"{what} has {points:,} jobs, more than the limit of {MAX_JOBS:,}: give fewer values per axis "
            "or split it into several sweeps"
        )


class ArmSpec(Strict):
    """An arm of a case: its environment overrides, and for kernel cases the registered path it
    runs (`path`; default: the arm's own name). Two arms of one path are an A/A comparison: the
    baseline against itself under another name shows what the method calls a difference."""

    env: dict[str, str] = Field(default_factory=dict)
    path: str | None = None

    @field_validator("env")
    @classmethod
    def _env(cls, v: dict[str, str]) -> dict[str, str]:
        return check_env(v)


class CaseEntry(Strict):
    """One `[[cases]]` table: a case, its arms and its parameter axes."""

    case: str
    name: str | None = None
    arms: list[str] | dict[str, ArmSpec]
    params: dict[str, ParamValue | list[ParamValue]] = Field(default_factory=dict)
    devices: list[str] | None = None
    repetitions: int | None = Field(default=None, ge=1)
    warmup: int | None = Field(default=None, ge=0)
    # sampling until the point is precise (the sweep's, when the case sets none): `repetitions`
    # is then the minimum (`workers.contract.precision`)
    precision: float | None = Field(default=None, gt=0, lt=1)
    max_seconds: float | None = Field(default=None, gt=0)
    # kernel cases: weights rotated past the last-level cache ("cold", the default) or reused ("hot")
    cache: Literal["cold", "hot"] | None = None
    # command cases (external benchmarks built at a commit)
    repo: str | None = None
    ref: str | None = None
    refs: list[str] | None = None  # several commits compared in one job, BASE first
    build: str | None = None
    gate: str | None = None  # the engine's own tests: must pass at the commit before any timing
    run: str | None = None
    parse: str | dict[str, Any] | None = None
    timeout: float | None = Field(default=None, gt=0)

    @property
    def label(self) -> str:
        return self.name or self.case

    def arm_names(self) -> list[str]:
        return list(self.arms) if isinstance(self.arms, list) else list(self.arms.keys())

    def arm_paths(self) -> dict[str, str]:
        """The arms that run another registered path than their own name: arm -> path."""
        if isinstance(self.arms, list):
            return {}
        return {arm: spec.path for arm, spec in self.arms.items() if spec.path is not None and spec.path != arm}

    def arm_env(self) -> dict[str, dict[str, str]]:
        if isinstance(self.arms, list):
            return {}
        return {arm: spec.env for arm, spec in self.arms.items() if spec.env}

    def axes(self) -> dict[str, list[ParamValue]]:
        """Every parameter as a list of values (a scalar is an axis of one)."""
        out: dict[str, list[ParamValue]] = {}
        for key, value in self.params.items():
            out[key] = list(value) if isinstance(value, list) else [value]
        return out

    def point_count(self) -> int:
        """How many parameter points the axes make, without making them."""
        return math.prod(len(v) for v in self.axes().values())

    def points(self) -> Iterator[dict[str, ParamValue]]:
        """The cartesian product of the parameter axes, in file order."""
        axes = self.axes()
        keys = list(axes)
        for combo in itertools.product(*(axes[k] for k in keys)):
            yield dict(zip(keys, combo, strict=True))

    @model_validator(mode="after")
    def _check(self) -> CaseEntry:
        if self.name is not None:
            check_name(self.name, "case name")
        spec = registry.get_case(self.case)
        if spec is None:
            known = sorted(registry.CASES)
            raise ValueError(f"unknown case {self.case!r} (known: {', '.join(known)}){did_you_mean(self.case, known)}")
        arms = self.arm_names()
        if not arms:
            raise ValueError("arms: at least one arm is needed")
        if len(set(arms)) != len(arms):
            raise ValueError("arms: an arm is named twice")
        paths = self.arm_paths()
        if paths and spec.kind != registry.CaseKind.KERNEL:
            raise ValueError(f"arms: `path` names a kernel path; case {self.case!r} is not a kernel case")
        for arm, path in paths.items():
            if path not in spec.arms:
                raise ValueError(
                    f"arms.{arm}.path: unknown arm {path!r} for case {self.case!r} (known: {', '.join(spec.arms)})"
                    + did_you_mean(path, spec.arms)
                )
            if arm in spec.arms:
                raise ValueError(f"arms.{arm}.path: {arm!r} is an arm of case {self.case!r}; name the copy apart")
        for arm in arms:
            if spec.arms and arm not in spec.arms and arm not in paths:
                raise ValueError(
                    f"arms: unknown arm {arm!r} for case {self.case!r} (known: {', '.join(spec.arms)})"
                    + did_you_mean(arm, spec.arms)
                )
            check_name(arm, "arm name")
        for kind in self.devices or []:
            check_name(kind, "device kind")
        for key, values in self.axes().items():
            if not values:
                raise ValueError(f"params.{key}: empty axis")
            if spec.params and key not in spec.params:
                raise ValueError(
                    f"params.{key}: unknown parameter for case {self.case!r} (known: {', '.join(spec.params)})"
                    + did_you_mean(key, spec.params)
                )
            if not FIELD_RE.fullmatch(key):  # a `{param}` of a template, a name in `where`
                raise ValueError(f"params: {key!r} is not a parameter name (letters, digits and '_')")
            want = spec.params.get(key)
            for v in values:
                if want is not None and not _type_ok(v, want):
                    raise ValueError(f"params.{key}: {v!r} is not {want.__name__}")
        for key in spec.required:
            if key not in self.params:
                raise ValueError(f"params.{key}: required by case {self.case!r}")
        if self.cache is not None and spec.kind != registry.CaseKind.KERNEL:
            raise ValueError(f"cache: only kernel cases time with a chosen cache state, not {self.case!r}")
        if spec.kind == registry.CaseKind.COMMAND:
            settings = {f: getattr(self, f) for f in COMMAND_FIELDS}
            check_case_settings(settings, set(self.params))
        else:
            for f in COMMAND_FIELDS:
                if getattr(self, f) is not None:
                    raise ValueError(f"{f}: only a command case takes `{f}`")
        check_size(self.point_count(), f"case {self.label!r}")
        for point in self.points():
            try:
                registry.check_point(self.case, point)
            except ValueError as exc:
                raise ValueError(f"params of case {self.label!r}: {exc}") from None
        return self


COMMAND_FIELDS = ("repo", "ref", "refs", "build", "gate", "run", "parse")


class CommandDefaults(Strict):
    """A sweep's `[command]` table: what its command cases share (a case's own value wins).

    The one place to edit the engine's repository, ref and build, and shared parameters such
    as the checkpoint (merged under each case's `params`).
    """

    repo: str | None = None
    ref: str | None = None
    refs: list[str] | None = None
    build: str | None = None
    gate: str | None = None
    parse: str | dict[str, Any] | None = None
    timeout: float | None = Field(default=None, gt=0)
    params: dict[str, ParamValue | list[ParamValue]] = Field(default_factory=dict)


def _type_ok(value: ParamValue, want: type) -> bool:
    if want is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if want is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, want)
