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
from collections.abc import Callable, Set
from dataclasses import dataclass, field
from typing import Protocol

from workers.contract import GpuPin, LockSettings
from workers.lock.gpu import nesting_pid
from workers.lock.own_processes import OwnProcesses, own_processes
from workers.proc.table import process_cmdline, process_name

COMMAND_CHARS = 80  # of a foreign process's command line in a description


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


def command_of(pid: int) -> str:
    """A process's command line, its program by file name, shortened (its name where the line cannot
    be read), as seen now: the process may be gone by the time anyone reads the job's line, so it
    is taken when caught."""
    argv = process_cmdline(pid)
    line = " ".join([os.path.basename(argv[0]), *argv[1:]]) if argv else process_name(pid)
    line = " ".join(line.split())  # one line: an argument may hold newlines (`python -c` with a script)
    return line if len(line) <= COMMAND_CHARS else line[: COMMAND_CHARS - 3] + "..."


def ignored(pid: int, names: Set[str]) -> bool:
    """Whether a process is one the host lets pass: its name, or its program's file name, is listed."""
    if not names:
        return False
    argv = process_cmdline(pid)
    return process_name(pid) in names or (bool(argv) and os.path.basename(argv[0]) in names)


class IgnoringProbe:
    """A probe that lets the host's `ignore_processes` pass (by name), whatever the backend."""

    def __init__(self, probe: GpuUserProbe, names: Set[str]) -> None:
        self.probe = probe
        self.names = names
        self.name = probe.name

    def prime(self) -> None:
        """The wrapped probe's."""
        self.probe.prime()

    def sample(self) -> ProbeSample:
        """The wrapped probe's sample, less the processes the host ignores."""
        seen = self.probe.sample()
        return ProbeSample({pid: what for pid, what in seen.foreign.items() if not ignored(pid, self.names)})


def gate_knob(probe_name: str, settings: LockSettings) -> str:
    """What governs a gate, in the inventory's words, for the line of a job it flagged."""
    listed = f" (ignored now: {', '.join(settings.ignore_processes)})" if settings.ignore_processes else ""
    let_pass = f'ignore_processes = ["NAME"] in the inventory host lets a process pass{listed}'
    if probe_name == "cpu-quiet":
        return (
            f"gate {probe_name}: a foreign process above cpu_busy_threshold = {settings.cpu_busy_threshold:g} "
            f"(% of one core) of the inventory host; {let_pass}"
        )
    return f"gate {probe_name}: any foreign user of the GPU; {let_pass}"


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
    probe = factory(settings, gpu)
    return IgnoringProbe(probe, frozenset(settings.ignore_processes)) if settings.ignore_processes else probe
