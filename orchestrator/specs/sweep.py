"""The files users write: sweeps (here) and host inventories (`orchestrator.specs.inventory`, re-exported).

`load_sweep` and `load_inventory` turn every problem into one `InputError` line that names the
file and the field, what was found and what is allowed, so `orchestrate` exits 2 before anything
starts. Reading the file is `orchestrator.specs.toml`'s part; what names may be,
`orchestrator.specs.names`'; a sweep's size, its points against each case's own rule and its criteria
are `orchestrator.specs.checks`'s; ProxyJump chains and which host is this machine are
`orchestrator.cluster.reach`'s.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator
from importlib import resources
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from kernels import registry
from kernels.registry import did_you_mean
from orchestrator.errors import InputError
from orchestrator.specs import checks as sweepcheck
from orchestrator.specs.inventory import (
    LOCAL_INVENTORY,
    HeadSpec,
    HostDefaults,
    HostSpec,
    InventorySpec,
    default_inventory_path,
    load_inventory,
)
from orchestrator.specs.names import Strict, check_env, check_name
from orchestrator.specs.toml import load_model, read_toml, validation_message
from orchestrator.specs.where import parse_where
from workers.command.case import FIELD_RE, check_case_settings

__all__ = [  # the inventory's models and loader, and the loaders' helpers, re-exported
    "LOCAL_INVENTORY",
    "HeadSpec",
    "HostDefaults",
    "HostSpec",
    "InventorySpec",
    "default_inventory_path",
    "load_inventory",
    "read_toml",
    "validation_message",
]

ParamValue = int | float | str | bool


# ----------------------------------------------------------------------------------------- sweeps


class ArmSpec(Strict):
    """An arm of a case: its environment overrides (and, for command cases, nothing else)."""

    env: dict[str, str] = Field(default_factory=dict)

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
        for arm in arms:
            if spec.arms and arm not in spec.arms:
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
        if self.cache is not None and spec.kind != "kernel":
            raise ValueError(f"cache: only kernel cases time with a chosen cache state, not {self.case!r}")
        if spec.kind == "command":
            settings = {f: getattr(self, f) for f in COMMAND_FIELDS}
            check_case_settings(settings, set(self.params))
        else:
            for f in COMMAND_FIELDS:
                if getattr(self, f) is not None:
                    raise ValueError(f"{f}: only a command case takes `{f}`")
        sweepcheck.check_size(self.point_count(), f"case {self.label!r}")
        sweepcheck.check_points(self)
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


class SweepSpec(Strict):
    """A sweep file: cases x parameter axes x arms, on some device kinds."""

    name: str
    description: str = ""
    devices: list[str] = Field(default_factory=list)
    repetitions: int = Field(default=10, ge=1)
    warmup: int = Field(default=3, ge=0)
    cache: Literal["cold", "hot"] = "cold"  # kernel cases' default cache state (a case may set its own)
    baseline: str | None = None
    seed: int = 0
    command: CommandDefaults | None = None
    cases: list[CaseEntry] = Field(min_length=1)
    criteria: list[Criterion] = Field(default_factory=list)

    @model_validator(mode="before")
    @classmethod
    def _command_defaults(cls, data: Any) -> Any:
        """Merge the `[command]` table into every command case before the cases are checked."""
        if not isinstance(data, dict) or not isinstance(data.get("command"), dict):
            return data
        shared = data["command"]
        cases = data.get("cases")
        if not isinstance(cases, list):
            return data
        merged = []
        for entry in cases:
            if isinstance(entry, dict) and entry.get("case") == "command":
                own = dict(entry)
                for key, value in shared.items():
                    if key == "params" and isinstance(value, dict):
                        own["params"] = {**value, **(own.get("params") or {})}
                    elif key in ("ref", "refs") and ("ref" in own or "refs" in own):
                        continue  # the case names its own commit(s)
                    else:
                        own.setdefault(key, value)
                entry = own
            merged.append(entry)
        return {**data, "cases": merged}

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        return check_name(v, "sweep name")

    @field_validator("devices")
    @classmethod
    def _devices(cls, v: list[str]) -> list[str]:
        for kind in v:
            check_name(kind, "device kind")
        return v

    @model_validator(mode="after")
    def _labels(self) -> SweepSpec:
        labels = [c.label for c in self.cases]
        dupes = {x for x in labels if labels.count(x) > 1}
        if dupes:
            raise ValueError(f"cases: two cases named {sorted(dupes)[0]!r}; give them distinct `name`s")
        sweepcheck.check_size(sum(c.point_count() for c in self.cases), f"sweep {self.name!r}")
        sweepcheck.check_baseline(self)
        for i, criterion in enumerate(self.criteria):
            sweepcheck.check_criterion(self, i, criterion)
        return self


# ------------------------------------------------------------------------------------ file loading


def builtin_sweeps() -> dict[str, Path]:
    """The sweeps shipped in `orchestrator/sweeps/`, by name."""
    root = resources.files("orchestrator") / "sweeps"
    return {Path(p.name).stem: Path(str(p)) for p in root.iterdir() if p.name.endswith(".toml")}


def resolve_sweep_path(name_or_path: str) -> Path:
    """A built-in sweep's name, or a path to a sweep file."""
    path = Path(name_or_path)
    if name_or_path.endswith(".toml") or path.exists() or "/" in name_or_path:
        return path
    builtins = builtin_sweeps()
    if name_or_path in builtins:
        return builtins[name_or_path]
    raise InputError(f"unknown sweep {name_or_path!r} (built-in: {', '.join(sorted(builtins))}; or give a .toml path)")


def load_sweep(name_or_path: str) -> SweepSpec:
    """Load and validate a sweep, by built-in name or path."""
    return load_model(resolve_sweep_path(name_or_path), "sweep", SweepSpec)


def check_sweep_against_inventory(sweep: SweepSpec, inventory: InventorySpec, where: str) -> list[str]:
    """The device kinds the sweep runs on, checked before anything starts.

    Raises:
        InputError: a kind no host has, more jobs than `sweepcheck.MAX_JOBS`, or a point whose
            arrays exceed the known memory of a device kind it runs on.
    """
    kinds = inventory.device_kinds()
    wanted = sweep.devices or kinds
    for field, listed in [
        ("devices", wanted),
        *((f"cases.{i}.devices", c.devices or []) for i, c in enumerate(sweep.cases)),
    ]:
        for kind in listed:
            if kind not in kinds:
                raise InputError(
                    f"field {field}: device kind {kind!r} has no host in the inventory (it has: {', '.join(kinds)})"
                    + did_you_mean(kind, kinds),
                    where=where,
                )
    try:
        sweepcheck.check_size(sweepcheck.job_count(sweep, list(wanted)), f"sweep {sweep.name!r} on {', '.join(wanted)}")
    except ValueError as exc:
        raise InputError(str(exc), where=where) from None
    sweepcheck.check_memory(sweep, inventory, list(wanted), where)
    return list(wanted)
