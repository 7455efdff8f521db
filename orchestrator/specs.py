"""The files users write: sweeps and host inventories (pydantic, `extra="forbid"`, TOML).

`load_sweep` and `load_inventory` turn every problem into one `InputError` line that names the
file and the field, what was found and what is allowed, so `orchestrate` exits 2 before anything
starts. Reading the file is `orchestrator.tomlfile`'s part; a sweep's size, its points against each
case's own rule and its criteria are `orchestrator.sweepcheck`'s; ProxyJump chains and which host
is this machine are `orchestrator.reach`'s. Names are matched whole (`fullmatch`: a trailing
newline is not a name).
"""

from __future__ import annotations

import ipaddress
import itertools
import math
import re
from collections.abc import Iterator
from importlib import resources
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator

from kernels import registry
from kernels.registry import did_you_mean
from orchestrator import sweepcheck
from orchestrator.errors import InputError
from orchestrator.reach import DEFAULT_SSH_PORT, is_this_machine, jump_chain, parse_hop
from orchestrator.tomlfile import read_toml, validation_message
from orchestrator.where import parse_where
from workers.command import FIELD_RE, check_case_settings

__all__ = ["read_toml", "validation_message"]  # re-exported: the loaders' helpers

ParamValue = int | float | str | bool
NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
ENV_KEY_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# Host names, users and paths go into remote shell commands (quoted, but refused up front too).
SAFE_RE = re.compile(r"[A-Za-z0-9_./~@:+-]+")
# Host names, device kinds and labels become Ray node labels: Ray refuses others at `ray start`.
RAY_LABEL_RE = re.compile(r"[A-Za-z0-9]([A-Za-z0-9_.-]{0,61}[A-Za-z0-9])?")
BACKENDS = ("cpu", "cuda", "metal", "rocm")


def _check_name(value: str, what: str) -> str:
    if not NAME_RE.fullmatch(value):
        raise ValueError(f"{what} {value!r} must be letters, digits, '.', '_' or '-' (starting with a letter or digit)")
    return value


def _check_label(value: str, what: str) -> str:
    if not RAY_LABEL_RE.fullmatch(value):
        raise ValueError(
            f"{what} {value!r} must be at most 63 letters, digits, '.', '_' or '-', starting and ending with a letter "
            "or digit (it is a Ray node label)"
        )
    return value


def _check_ip(value: str | None, what: str) -> str | None:
    if value is not None:
        try:
            ipaddress.ip_address(value)
        except ValueError:
            raise ValueError(
                f"{what} {value!r} is not an IP address (Ray wants the node's IP, not a host name)"
            ) from None
    return value


def _check_safe(value: str | None, what: str) -> str | None:
    if value is not None and not SAFE_RE.fullmatch(value):
        raise ValueError(f"{what} {value!r} contains shell metacharacters, spaces or control characters")
    return value


def _check_env(env: dict[str, str]) -> dict[str, str]:
    """Environment variable names are `[A-Za-z_][A-Za-z0-9_]*`; no value holds a NUL byte."""
    for key, value in env.items():
        if not ENV_KEY_RE.fullmatch(key):
            raise ValueError(
                f"environment variable name {key!r} is not valid (letters, digits and '_', not starting with a digit)"
            )
        if "\0" in value:
            raise ValueError(f"environment variable {key}: the value holds a NUL byte")
    return env


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)  # `nan` and `inf` are TOML floats, never a setting


# ----------------------------------------------------------------------------------------- sweeps


class ArmSpec(Strict):
    """An arm of a case: its environment overrides (and, for command cases, nothing else)."""

    env: dict[str, str] = Field(default_factory=dict)

    @field_validator("env")
    @classmethod
    def _env(cls, v: dict[str, str]) -> dict[str, str]:
        return _check_env(v)


class CaseEntry(Strict):
    """One `[[cases]]` table: a case, its arms and its parameter axes."""

    case: str
    name: str | None = None
    arms: list[str] | dict[str, ArmSpec]
    params: dict[str, ParamValue | list[ParamValue]] = Field(default_factory=dict)
    devices: list[str] | None = None
    repetitions: int | None = Field(default=None, ge=1)
    warmup: int | None = Field(default=None, ge=0)
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
            _check_name(self.name, "case name")
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
            _check_name(arm, "arm name")
        for kind in self.devices or []:
            _check_name(kind, "device kind")
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
        if not v.strip() or not v.isprintable():
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
        return _check_name(v, "sweep name")

    @field_validator("devices")
    @classmethod
    def _devices(cls, v: list[str]) -> list[str]:
        for kind in v:
            _check_name(kind, "device kind")
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


# -------------------------------------------------------------------------------------- inventory


class HeadSpec(Strict):
    """The Ray head. No address: an embedded local Ray instance on this machine."""

    address: str | None = None
    ray_port: int = Field(default=6379, ge=1, le=65535)
    dashboard_port: int = Field(default=8265, ge=1, le=65535)
    node_ip: str | None = None  # the address worker nodes reach the head on
    workdir: str = "~/.orchestrate/head"  # where `cluster up` keeps the head's pid, log and Ray temp dir
    dashboard: bool = True  # start Ray's dashboard with the head (`cluster up`)

    @field_validator("address", "node_ip")
    @classmethod
    def _safe(cls, v: str | None) -> str | None:
        return _check_safe(v, "address")

    @field_validator("node_ip")
    @classmethod
    def _ip(cls, v: str | None) -> str | None:
        return _check_ip(v, "node_ip")


class HostDefaults(Strict):
    """Settings every host inherits unless it sets its own."""

    user: str | None = None
    port: int = Field(default=22, ge=1, le=65535)
    identity_file: str | None = None
    known_hosts: str | None = None
    proxy_jump: str | list[str] | None = None
    python: str = "python3"
    workdir: str = "~/.orchestrate"
    lock: str = "/tmp/orchestrate-gpu.lock"
    max_wait: float = Field(default=0.0, ge=0)
    idle_secs: float = Field(default=0.0, ge=0)
    max_attempts: int = Field(default=2, ge=1)  # measurements of a contended job
    cpu_busy_threshold: float = Field(default=50.0, ge=0)  # % of one core: the CPU/Metal quiet gate
    kfd_proc: str = "/sys/class/kfd/kfd/proc"  # ROCm's list of GPU users
    connect_timeout: float = Field(default=10.0, gt=0)
    env: dict[str, str] = Field(default_factory=dict)
    num_cpus: int | None = Field(default=None, ge=1)
    memory_gib: float | None = Field(default=None, gt=0)


class HostSpec(Strict):
    """One worker host: how to reach it over SSH and what it has."""

    name: str
    host: str | None = None  # SSH address; None: this machine (embedded)
    port: int = Field(default=22, ge=1, le=65535)
    user: str | None = None
    identity_file: str | None = None
    known_hosts: str | None = None
    proxy_jump: list[str] = Field(default_factory=list)
    device: str
    backend: str = "cpu"
    python: str = "python3"
    workdir: str = "~/.orchestrate"
    lock: str = "/tmp/orchestrate-gpu.lock"
    max_wait: float = Field(default=0.0, ge=0)
    idle_secs: float = Field(default=0.0, ge=0)
    max_attempts: int = Field(default=2, ge=1)  # measurements of a contended job
    cpu_busy_threshold: float = Field(default=50.0, ge=0)  # % of one core: the CPU/Metal quiet gate
    kfd_proc: str = "/sys/class/kfd/kfd/proc"  # ROCm's list of GPU users
    connect_timeout: float = Field(default=10.0, gt=0)
    labels: dict[str, str] = Field(default_factory=dict)
    env: dict[str, str] = Field(default_factory=dict)
    node_ip: str | None = None  # the address the head reaches this host's Ray node on (default: Ray's guess)
    num_cpus: int | None = Field(default=None, ge=1)  # CPUs the Ray node offers (default: Ray's count)
    memory_gib: float | None = Field(default=None, gt=0)  # the device's memory for one job (unified: the RAM)

    @field_validator("proxy_jump", mode="before")
    @classmethod
    def _jumps(cls, v: Any) -> Any:
        if v is None:
            return []
        if isinstance(v, str):
            return [j for j in v.split(",") if j]
        return v

    @field_validator("name", "device")
    @classmethod
    def _names(cls, v: str, info: ValidationInfo) -> str:
        return _check_label(v, "host name" if info.field_name == "name" else "device kind")

    @model_validator(mode="before")
    @classmethod
    def _auto(cls, data: Any) -> Any:
        """`device = "auto"` / `backend = "auto"` on this machine: what MLX runs on here."""
        if isinstance(data, dict) and not data.get("host") and "auto" in (data.get("device"), data.get("backend")):
            from orchestrator.localhost import local_device  # asked of a short-lived process

            kind, backend = local_device()
            data = {**data}
            if data.get("device") == "auto":
                data["device"] = kind
            if data.get("backend", "auto") == "auto":
                data["backend"] = backend
        return data

    @field_validator("backend")
    @classmethod
    def _backend(cls, v: str) -> str:
        if v not in BACKENDS:
            raise ValueError(f"backend {v!r} is not one of {', '.join(BACKENDS)}{did_you_mean(v, BACKENDS)}")
        return v

    @field_validator("host", "user", "identity_file", "known_hosts", "python", "workdir", "lock", "node_ip")
    @classmethod
    def _safe(cls, v: str | None) -> str | None:
        return _check_safe(v, "value")

    @field_validator("node_ip")
    @classmethod
    def _ip(cls, v: str | None) -> str | None:
        return _check_ip(v, "node_ip")

    @field_validator("labels")
    @classmethod
    def _labels(cls, v: dict[str, str]) -> dict[str, str]:
        for key, value in v.items():
            _check_label(key, "label")
            _check_label(value, f"value of label {key}")
            if key in ("device-kind", "backend", "host"):
                raise ValueError(f"label {key!r} is set by orchestrate itself (from the host's fields)")
        return v

    @field_validator("env")
    @classmethod
    def _env(cls, v: dict[str, str]) -> dict[str, str]:
        return _check_env(v)

    @field_validator("lock")
    @classmethod
    def _lock(cls, v: str) -> str:
        if not v.startswith("/"):
            raise ValueError(
                f"lock {v!r} is not an absolute path (every job, and the shell guard, must open the same file "
                "whatever its working directory)"
            )
        return v

    @field_validator("proxy_jump")
    @classmethod
    def _safe_jumps(cls, v: list[str]) -> list[str]:
        for j in v:
            _check_safe(j, "proxy_jump")
            parse_hop(j)
        return v

    @property
    def this_machine(self) -> bool:
        """Whether this host is the machine `orchestrate` runs on (`orchestrator.reach`)."""
        return is_this_machine(self.host, self.port, self.proxy_jump)


class InventorySpec(Strict):
    """A host inventory: the head and the worker hosts."""

    head: HeadSpec = Field(default_factory=HeadSpec)
    defaults: HostDefaults = Field(default_factory=HostDefaults)
    hosts: list[HostSpec] = Field(min_length=1)

    @model_validator(mode="before")
    @classmethod
    def _inherit(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        defaults = data.get("defaults") or {}
        hosts = data.get("hosts")
        if isinstance(defaults, dict) and isinstance(hosts, list):
            merged = []
            for h in hosts:
                if isinstance(h, dict):
                    h = {**{k: v for k, v in defaults.items() if k != "env"}, **h}
                    if "env" in defaults:
                        h["env"] = {**defaults["env"], **h.get("env", {})}
                merged.append(h)
            data = {**data, "hosts": merged}
        return data

    @model_validator(mode="after")
    def _unique(self) -> InventorySpec:
        names = [h.name for h in self.hosts]
        for n in names:
            if names.count(n) > 1:
                raise ValueError(f"hosts: the host name {n!r} is used twice")
        chains = {}
        for i, h in enumerate(self.hosts):
            try:
                chains[h.name] = jump_chain(h, self.hosts)
            except ValueError as exc:
                raise ValueError(f"field hosts.{i}.proxy_jump (host {h.name!r}): {exc}") from None
        for h in self.hosts:
            h.proxy_jump = chains[h.name]
        if self.embedded:
            self._only_this_machine()
        return self

    def _only_this_machine(self) -> None:
        """Without a [head], the inventory is this machine alone: never run another host's jobs here."""
        for i, h in enumerate(self.hosts):
            if not h.this_machine:
                port = f":{h.port}" if h.port != DEFAULT_SSH_PORT else ""
                via = f" through {', '.join(h.proxy_jump)}" if h.proxy_jump else ""
                raise ValueError(
                    f"field hosts.{i}.host (host {h.name!r}): {h.host}{port}{via} is not this machine, and the "
                    "inventory has no [head]: "
                    "add [head] address = the address its hosts reach this machine on, then start them with "
                    "`orchestrate cluster up`"
                )
        if len(self.hosts) > 1:
            raise ValueError(
                f"field hosts: an inventory without [head] is this machine alone, one host; this one lists "
                f"{len(self.hosts)} ({', '.join(h.name for h in self.hosts)})"
            )

    @property
    def embedded(self) -> bool:
        """True when the head is an embedded local Ray instance on this machine."""
        return self.head.address is None

    def device_kinds(self) -> list[str]:
        return sorted({h.device for h in self.hosts})


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
    path = resolve_sweep_path(name_or_path)
    data = read_toml(path, "sweep")
    try:
        return SweepSpec.model_validate(data)
    except ValidationError as exc:
        raise InputError(validation_message(exc, SweepSpec), where=str(path)) from None


def default_inventory_path() -> Path:
    """`inventories/local.toml` beside the package, or the packaged copy's equivalent."""
    here = Path(__file__).resolve().parent.parent / "inventories" / "local.toml"
    return here


LOCAL_INVENTORY = {"hosts": [{"name": "local", "device": "cpu", "backend": "cpu"}]}


def load_inventory(path: str | Path | None) -> InventorySpec:
    """Load and validate an inventory; None means the embedded local one."""
    if path is None:
        p = default_inventory_path()
        if not p.exists():
            return InventorySpec.model_validate(LOCAL_INVENTORY)
        path = p
    path = Path(path)
    data = read_toml(path, "inventory")
    try:
        return InventorySpec.model_validate(data)
    except ValidationError as exc:
        raise InputError(validation_message(exc, InventorySpec), where=str(path)) from None


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
