"""The files users write: sweeps and host inventories (pydantic, `extra="forbid"`, TOML).

`load_sweep` and `load_inventory` turn every problem into one `InputError` line that names the
file and the field, so `orchestrate` exits 2 before anything starts.
"""

from __future__ import annotations

import re
import tomllib
from importlib import resources
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from kernels import registry
from orchestrator.errors import InputError
from orchestrator.where import parse_where
from workers.command import check_case_settings

ParamValue = int | float | str | bool
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
# Host names, users and paths go into remote shell commands (quoted, but refused up front too).
SAFE_RE = re.compile(r"^[A-Za-z0-9_./~@:+-]+$")


def _check_name(value: str, what: str) -> str:
    if not NAME_RE.match(value):
        raise ValueError(f"{what} {value!r} must be letters, digits, '.', '_' or '-'")
    return value


def _check_safe(value: str | None, what: str) -> str | None:
    if value is not None and not SAFE_RE.match(value):
        raise ValueError(f"{what} {value!r} contains shell metacharacters or spaces")
    return value


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


# ----------------------------------------------------------------------------------------- sweeps


class ArmSpec(Strict):
    """An arm of a case: its environment overrides (and, for command cases, nothing else)."""

    env: dict[str, str] = Field(default_factory=dict)


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

    @model_validator(mode="after")
    def _check(self) -> CaseEntry:
        if self.name is not None:
            _check_name(self.name, "case name")
        spec = registry.get_case(self.case)
        if spec is None:
            known = ", ".join(sorted(registry.CASES))
            raise ValueError(f"unknown case {self.case!r} (known: {known})")
        arms = self.arm_names()
        if not arms:
            raise ValueError("arms: at least one arm is needed")
        if len(set(arms)) != len(arms):
            raise ValueError("arms: an arm is named twice")
        if spec.arms:
            for arm in arms:
                if arm not in spec.arms:
                    raise ValueError(
                        f"arms: unknown arm {arm!r} for case {self.case!r} (known: {', '.join(spec.arms)})"
                    )
        for key, values in self.axes().items():
            if not values:
                raise ValueError(f"params.{key}: empty axis")
            if spec.params and key not in spec.params:
                raise ValueError(f"params.{key}: unknown parameter for case {self.case!r}")
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
                parse_where(v)
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
        return _check_name(v, "sweep name")

    @model_validator(mode="after")
    def _labels(self) -> SweepSpec:
        labels = [c.label for c in self.cases]
        dupes = {x for x in labels if labels.count(x) > 1}
        if dupes:
            raise ValueError(f"cases: two cases named {sorted(dupes)[0]!r}; give them distinct `name`s")
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
    def _names(cls, v: str) -> str:
        return _check_name(v, "name")

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
        if v not in ("cpu", "cuda", "metal", "rocm"):
            raise ValueError(f"backend {v!r} is not one of cpu, cuda, metal, rocm")
        return v

    @field_validator("host", "user", "identity_file", "known_hosts", "python", "workdir", "lock", "node_ip")
    @classmethod
    def _safe(cls, v: str | None) -> str | None:
        return _check_safe(v, "value")

    @field_validator("labels")
    @classmethod
    def _labels(cls, v: dict[str, str]) -> dict[str, str]:
        for key, value in v.items():
            _check_name(key, "label")
            _check_name(value, f"value of label {key}")
        return v

    @field_validator("env")
    @classmethod
    def _env(cls, v: dict[str, str]) -> dict[str, str]:
        for key in v:
            if not re.match(r"^[A-Za-z_][A-Za-z0-9_]*$", key):
                raise ValueError(f"environment variable name {key!r} is not valid")
        return v

    @field_validator("proxy_jump")
    @classmethod
    def _safe_jumps(cls, v: list[str]) -> list[str]:
        for j in v:
            _check_safe(j, "proxy_jump")
        return v


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
        by_name = {h.name: h for h in self.hosts}
        for h in self.hosts:
            _check_jump_loop(h, by_name)
        return self

    @property
    def embedded(self) -> bool:
        """True when the head is an embedded local Ray instance on this machine."""
        return self.head.address is None

    def device_kinds(self) -> list[str]:
        return sorted({h.device for h in self.hosts})


def _check_jump_loop(host: HostSpec, by_name: dict[str, HostSpec]) -> None:
    """A ProxyJump chain that reaches its own host again is refused."""
    seen = {host.host or host.name, host.name}
    for jump in host.proxy_jump:
        target = jump.split("@")[-1].split(":")[0]
        if target in seen:
            raise ValueError(f"hosts.{host.name}.proxy_jump: a ProxyJump loop through {target!r}")
        seen.add(target)
        nested = by_name.get(target)
        if nested is not None and nested.proxy_jump:
            for j in nested.proxy_jump:
                t = j.split("@")[-1].split(":")[0]
                if t in seen:
                    raise ValueError(f"hosts.{host.name}.proxy_jump: a ProxyJump loop through {t!r}")


# ------------------------------------------------------------------------------------ file loading


def read_toml(path: Path, what: str) -> dict[str, Any]:
    """Parse a TOML file; a missing or malformed file is an `InputError` naming it."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise InputError(f"{what} file not found", where=str(path)) from None
    except OSError as exc:
        raise InputError(f"cannot read {what} file: {exc.strerror}", where=str(path)) from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise InputError(f"malformed TOML: {exc}", where=str(path)) from None


def validation_message(exc: ValidationError) -> str:
    """The first pydantic error as `field a.b: message`."""
    err = exc.errors()[0]
    loc = ".".join(str(p) for p in err["loc"])
    msg = err["msg"].removeprefix("Value error, ")
    if err["type"] == "extra_forbidden":
        msg = "unknown field"
    return f"field {loc}: {msg}" if loc else msg


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
        raise InputError(validation_message(exc), where=str(path)) from None


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
        raise InputError(validation_message(exc), where=str(path)) from None


def check_sweep_against_inventory(sweep: SweepSpec, inventory: InventorySpec, where: str) -> list[str]:
    """The device kinds the sweep runs on; a kind no host has is an `InputError`."""
    kinds = inventory.device_kinds()
    wanted = sweep.devices or kinds
    for kind in wanted:
        if kind not in kinds:
            raise InputError(
                f"field devices: device kind {kind!r} has no host in the inventory (it has: {', '.join(kinds)})",
                where=where,
            )
    for case in sweep.cases:
        for kind in case.devices or []:
            if kind not in kinds:
                raise InputError(
                    f"field cases.{case.label}.devices: device kind {kind!r} has no host in the inventory",
                    where=where,
                )
    return list(wanted)
