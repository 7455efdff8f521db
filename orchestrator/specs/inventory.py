"""Host inventories: the Ray head and the worker hosts, how to reach them and what they have.

An inventory means what it says: without a `[head]` it is this machine alone (`orchestrator.cluster.reach`
says which hosts are this machine), and a host that is another machine needs a head whose cluster
it joins. ProxyJump chains are resolved through the inventory at load.

A host may name its GPUs (`gpus = [0, 1, 2, 3]` or `gpus = "all"`): it is then one Ray node per
GPU, each job pinned to one. The field is checked here (non-negative, unique integers, or
"all"); which GPUs exist is the host's to say (`workers.host.gpus`), when its nodes start.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from kernels.registry import did_you_mean
from orchestrator.cluster.localhost import local_device
from orchestrator.cluster.reach import DEFAULT_SSH_PORT, is_this_machine, jump_chain, parse_hop
from orchestrator.specs.names import BACKENDS, Strict, check_env, check_ip, check_label, check_safe
from orchestrator.specs.toml import load_model

MAX_GPUS = 64  # GPUs one host may name: each is a Ray node of its own


class HeadSpec(Strict):
    """The Ray head. No address: an embedded local Ray instance on this machine."""

    address: str | None = None
    ray_port: int = Field(default=6379, ge=1, le=65535)
    dashboard_port: int = Field(default=8265, ge=1, le=65535)
    node_ip: str | None = None  # the address worker nodes reach the head on
    workdir: str = "~/.orchestrate/head"  # where `cluster up` keeps the head's pid, log and Ray temp dir
    dashboard: bool = True  # start Ray's dashboard with the head (`cluster up`)
    tls: bool = False  # Ray's own traffic over mutual TLS with a CA `cluster up` makes (orchestrator.cluster.tls)

    @field_validator("address", "node_ip")
    @classmethod
    def _safe(cls, v: str | None) -> str | None:
        return check_safe(v, "address")

    @field_validator("node_ip")
    @classmethod
    def _ip(cls, v: str | None) -> str | None:
        return check_ip(v, "node_ip")


class HostSettings(Strict):
    """What a host has and how jobs run there: each host's own, or inherited from `[defaults]`."""

    user: str | None = None
    port: int = Field(default=22, ge=1, le=65535)
    identity_file: str | None = None
    known_hosts: str | None = None
    python: str = "python3"
    workdir: str = "~/.orchestrate"
    lock: str = "/tmp/orchestrate-gpu.lock"
    max_wait: float = Field(default=0.0, ge=0)
    idle_secs: float = Field(default=0.0, ge=0)
    max_attempts: int = Field(default=2, ge=1)  # measurements of a contended job
    cpu_busy_threshold: float = Field(default=50.0, ge=0)  # % of one core: the CPU/Metal quiet gate
    ignore_processes: list[str] = Field(default_factory=list)  # process names no gate counts as foreign
    kfd_proc: str = "/sys/class/kfd/kfd/proc"  # ROCm's list of GPU users
    connect_timeout: float = Field(default=10.0, gt=0)
    env: dict[str, str] = Field(default_factory=dict)
    num_cpus: int | None = Field(default=None, ge=1)  # CPUs the Ray node offers (default: Ray's count)
    memory_gib: float | None = Field(default=None, gt=0)  # the device's memory for one job (unified: the RAM)
    gpus: list[int] | Literal["all"] | None = None  # one Ray node, slot and lock per GPU (workers.host.gpus)

    @field_validator("user", "identity_file", "known_hosts", "python", "workdir", "lock")
    @classmethod
    def _safe(cls, v: str | None) -> str | None:
        return check_safe(v, "value")

    @field_validator("env")
    @classmethod
    def _env(cls, v: dict[str, str]) -> dict[str, str]:
        return check_env(v)

    @field_validator("ignore_processes")
    @classmethod
    def _ignored(cls, v: list[str]) -> list[str]:
        for name in v:
            if not name.strip() or name != name.strip() or "/" in name:
                raise ValueError(
                    f'ignore_processes {name!r} is not a process name (as `ps -o comm` shows it, e.g. "mds_stores")'
                )
        return v

    @field_validator("gpus", mode="before")
    @classmethod
    def _gpus(cls, v: Any) -> Any:
        if v is None or v == "all":
            return v
        if isinstance(v, str):
            raise ValueError(f'gpus {v!r} is neither "all" nor a list of GPU indices such as [0, 1]')
        if not isinstance(v, list) or not v:
            raise ValueError(f'gpus must be "all" or a non-empty list of GPU indices such as [0, 1], not {v!r}')
        for i in v:
            if isinstance(i, bool) or not isinstance(i, int) or i < 0:
                raise ValueError(f"gpus {v!r}: {i!r} is not a GPU index (a whole number >= 0)")
        if len(v) > MAX_GPUS:
            raise ValueError(f"gpus names {len(v)} GPUs; a host has at most {MAX_GPUS} (one Ray node each)")
        dup = sorted({i for i in v if v.count(i) > 1})
        if dup:
            raise ValueError(f"gpus {v!r} names GPU {dup[0]} twice")
        return v

    @field_validator("lock")
    @classmethod
    def _lock(cls, v: str) -> str:
        if not v.startswith("/"):
            raise ValueError(
                f"lock {v!r} is not an absolute path (every job, and the shell guard, must open the same file "
                "whatever its working directory)"
            )
        return v


class HostDefaults(HostSettings):
    """Settings every host inherits unless it sets its own."""

    proxy_jump: str | list[str] | None = None


class HostSpec(HostSettings):
    """One worker host: how to reach it over SSH and what it has."""

    name: str
    host: str | None = None  # SSH address; None: this machine (embedded)
    proxy_jump: list[str] = Field(default_factory=list)
    device: str
    backend: str = "cpu"
    labels: dict[str, str] = Field(default_factory=dict)
    node_ip: str | None = None  # the address the head reaches this host's Ray node on (default: Ray's guess)

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
        return check_label(v, "host name" if info.field_name == "name" else "device kind")

    @model_validator(mode="before")
    @classmethod
    def _auto(cls, data: Any) -> Any:
        """`device = "auto"` / `backend = "auto"` on this machine: what MLX runs on here."""
        if isinstance(data, dict) and not data.get("host") and "auto" in (data.get("device"), data.get("backend")):
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

    @field_validator("host", "node_ip")
    @classmethod
    def _safe_address(cls, v: str | None) -> str | None:
        return check_safe(v, "value")

    @field_validator("node_ip")
    @classmethod
    def _ip(cls, v: str | None) -> str | None:
        return check_ip(v, "node_ip")

    @field_validator("labels")
    @classmethod
    def _labels(cls, v: dict[str, str]) -> dict[str, str]:
        for key, value in v.items():
            check_label(key, "label")
            check_label(value, f"value of label {key}")
            if key in ("device-kind", "backend", "host", "gpu-index", "gpu-uuid"):
                raise ValueError(f"label {key!r} is set by orchestrate itself (from the host's fields)")
        return v

    @field_validator("proxy_jump")
    @classmethod
    def _safe_jumps(cls, v: list[str]) -> list[str]:
        for j in v:
            check_safe(j, "proxy_jump")
            parse_hop(j)
        return v

    @property
    def this_machine(self) -> bool:
        """Whether this host is the machine `orchestrate` runs on (`orchestrator.cluster.reach`)."""
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


def default_inventory_path() -> Path:
    """`inventories/local.toml` beside the package, or the packaged copy's equivalent."""
    here = Path(__file__).resolve().parents[2] / "inventories" / "local.toml"
    return here


LOCAL_INVENTORY = {"hosts": [{"name": "local", "device": "cpu", "backend": "cpu"}]}


def load_inventory(path: str | Path | None) -> InventorySpec:
    """Load and validate an inventory; None means the embedded local one."""
    if path is None:
        p = default_inventory_path()
        if not p.exists():
            return InventorySpec.model_validate(LOCAL_INVENTORY)
        path = p
    return load_model(Path(path), "inventory", InventorySpec)
