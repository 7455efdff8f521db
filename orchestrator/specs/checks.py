"""What a sweep must satisfy on an inventory's devices, checked before anything starts.

* Kinds: every device kind the sweep (or a case) names has a host in the inventory.
* Size: the jobs the sweep expands to on those kinds (parameter points x device kinds) stay within
  `orchestrator.specs.case.MAX_JOBS`.
* Memory: where the inventory (`memory_gib`) or this machine's fingerprint knows a device kind's
  memory, every point's arrays (`kernels.registry.device_bytes`, a lower bound) fit in it.

What a sweep must satisfy on its own (its cases' points, its criteria) is checked as it is
loaded (`orchestrator.specs.case`, `orchestrator.specs.criterion`). Each check here raises an
`InputError` whose message names the field.
"""

from __future__ import annotations

from kernels import registry
from kernels.registry import did_you_mean
from orchestrator.errors import InputError
from orchestrator.specs.case import check_size
from orchestrator.specs.inventory import HostSpec, InventorySpec
from orchestrator.specs.sweep import SweepSpec
from workers.host.fingerprint import device_memory_bytes

GIB = 1024**3


def job_count(sweep: SweepSpec, kinds: list[str]) -> int:
    """Jobs the sweep expands to on `kinds`: each case's points times its device kinds."""
    return sum(case.point_count() * len(case.devices or kinds) for case in sweep.cases)


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


def check_sweep_against_inventory(sweep: SweepSpec, inventory: InventorySpec, where: str) -> list[str]:
    """The device kinds the sweep runs on, checked before anything starts.

    Raises:
        InputError: a kind no host has, more jobs than `MAX_JOBS`, or a point whose
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
        check_size(job_count(sweep, list(wanted)), f"sweep {sweep.name!r} on {', '.join(wanted)}")
    except ValueError as exc:
        raise InputError(str(exc), where=where) from None
    check_memory(sweep, inventory, list(wanted), where)
    return list(wanted)
