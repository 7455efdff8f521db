"""The GPU-user probe's interface (`GpuUserProbe`), the registry of one probe per backend, and
what counts as foreign.

Each backend's module registers the factory of its probe with `backend_probe`; `probe_for` builds
the probe of a job's backend. "Foreign" means not one of the orchestrator's own processes on this
host (`workers.lock.own_processes`): the job's tree (the lock holder named by
`ROCM_GPU_GUARD_LOCK_HELD` when it is a real ancestor, else this process, and their descendants),
the Ray node the job runs on (its starter, daemons and workers) and an embedded run's head.
Everything else is foreign, whatever its name.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from workers.contract import GpuPin, LockSettings
from workers.lock.gpu import nesting_pid
from workers.lock.own_processes import OwnProcesses, own_processes


class ProbeUnavailableError(Exception):
    """No way to see this backend's GPU users on this host (no KFD list, no NVML nor nvidia-smi)."""


@dataclass(frozen=True)
class ProbeSample:
    """One look at the device: the foreign users seen, pid -> a short description."""

    foreign: dict[int, str] = field(default_factory=dict)

    @property
    def busy(self) -> bool:
        """Whether any foreign user was seen."""
        return bool(self.foreign)

    def describe(self) -> str:
        """`pid 123 (python, 97% CPU), ...` or `idle`."""
        if not self.foreign:
            return "idle"
        return ", ".join(f"pid {pid} ({what})" for pid, what in sorted(self.foreign.items()))


class GpuUserProbe(Protocol):
    """Looks for processes outside our own tree that use the device."""

    name: str

    def prime(self) -> None:
        """Start a sampling window (the CPU gate measures usage between calls)."""

    def sample(self) -> ProbeSample:
        """The foreign users now (or since the last call, for the CPU gate)."""
        ...


def own_root() -> int:
    """The root of the job's own process tree: the outer lock holder if it is an ancestor, else us."""
    return nesting_pid() or os.getpid()


def ours() -> OwnProcesses:
    """The orchestrator's own processes on this host, as seen now (the job's tree, its Ray node, the head)."""
    return own_processes(own_root())


# Builds a backend's probe for a job's lock settings, watching one GPU where a pin is given.
ProbeFactory = Callable[[LockSettings, GpuPin | None], GpuUserProbe]
PROBES: dict[str, ProbeFactory] = {}  # backend (cpu, cuda, metal, rocm) -> its probe's factory


def backend_probe(*backends: str) -> Callable[[ProbeFactory], ProbeFactory]:
    """Register the decorated factory as the probe of `backends` (a backend has one probe)."""

    def register(factory: ProbeFactory) -> ProbeFactory:
        for backend in backends:
            if backend in PROBES:
                raise ValueError(f"backend {backend!r} has a probe already")
            PROBES[backend] = factory
        return factory

    return register


def probe_for(backend: str, settings: LockSettings, gpu: GpuPin | None = None) -> GpuUserProbe:
    """The foreign-GPU-user probe for `backend` (cpu, cuda, metal, rocm); `gpu`: watch that GPU only.

    Raises:
        ProbeUnavailableError: This host cannot see the backend's GPU users; the message says what
            is missing.
        ValueError: An unknown backend.
    """
    factory = PROBES.get(backend)
    if factory is None:
        raise ValueError(f"unknown backend {backend!r}: expected one of {', '.join(sorted(PROBES))}")
    return factory(settings, gpu)
