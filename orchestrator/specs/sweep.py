"""The files users write: sweeps (here) and host inventories (`orchestrator.specs.inventory`, re-exported).

`load_sweep` and `load_inventory` turn every problem into one `InputError` line that names the
file and the field, what was found and what is allowed, so `orchestrate` exits 2 before anything
starts. Reading the file is `orchestrator.specs.toml`'s part; what names may be,
`orchestrator.specs.names`'; a case, its size and its points against its kind's rule are
`orchestrator.specs.case`'s; criteria, `orchestrator.specs.criterion`'s; a sweep against an
inventory's devices (kinds, jobs, memory), `orchestrator.specs.checks`'s; ProxyJump chains and
which host is this machine are `orchestrator.cluster.reach`'s.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from orchestrator.errors import InputError
from orchestrator.specs.case import CaseEntry, CommandDefaults, check_size
from orchestrator.specs.criterion import Criterion, check_baseline, check_criterion
from orchestrator.specs.inventory import (
    LOCAL_INVENTORY,
    HeadSpec,
    HostDefaults,
    HostSpec,
    InventorySpec,
    default_inventory_path,
    load_inventory,
)
from orchestrator.specs.names import Strict, check_name
from orchestrator.specs.toml import load_model, read_toml, validation_message

__all__ = [  # the inventory's and the cases' models, the inventory's loader and the loaders' helpers, re-exported
    "LOCAL_INVENTORY",
    "CaseEntry",
    "Criterion",
    "HeadSpec",
    "HostDefaults",
    "HostSpec",
    "InventorySpec",
    "default_inventory_path",
    "load_inventory",
    "read_toml",
    "validation_message",
]

# ----------------------------------------------------------------------------------------- sweeps


class SweepSpec(Strict):
    """A sweep file: cases x parameter axes x arms, on some device kinds."""

    name: str
    description: str = ""
    devices: list[str] = Field(default_factory=list)
    repetitions: int = Field(default=10, ge=1)
    warmup: int = Field(default=3, ge=0)
    # the relative half-width every arm's 95 % interval to the baseline must reach at each point,
    # within `max_seconds` of sampling per point (None: exactly `repetitions` rounds)
    precision: float | None = Field(default=None, gt=0, lt=1)
    max_seconds: float | None = Field(default=None, gt=0)
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
        check_size(sum(c.point_count() for c in self.cases), f"sweep {self.name!r}")
        check_baseline(self.cases, self.baseline)
        for i, criterion in enumerate(self.criteria):
            check_criterion(self.cases, self.baseline, i, criterion)
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
