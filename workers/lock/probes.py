"""Foreign GPU users, per backend: the idle gate before a job and the contention monitor during it.

One narrow interface, `GpuUserProbe` (`prime()`, `sample() -> ProbeSample`), with one real
implementation per backend:

* ROCm: `KfdProbe`, the KFD process list (`/sys/class/kfd/kfd/proc`, one directory per process
  with a GPU context). Entries whose process is gone are ignored (KFD drops an entry only after
  the process is reaped). Pinned to one GPU, a process counts when its directory has that GPU's
  files (`vram_<gpu_id>`, `stats_<gpu_id>`, ...; the gpu_id from the KFD topology) or no per-GPU
  files at all (an older kernel: it cannot be told apart, so it counts).
* CUDA: `NvmlProbe`, compute processes through NVML (nvidia-ml-py), else `NvidiaSmiProbe`,
  `nvidia-smi --query-compute-apps`. Their pids are not checked for liveness here: NVML lists
  only running processes, and a pid invisible here belongs to another pid namespace (a container),
  which is exactly a foreign user. Pinned to one GPU (a host with several), only that GPU's
  processes count (NVML by UUID, `nvidia-smi --id`): a job on the next GPU is not contention.
* CPU and Metal: `CpuQuietProbe`, a CPU-quiet gate: the busiest foreign process must stay under a
  threshold (percent of one core). Metal exposes no per-process GPU list to an unprivileged user.

"Foreign" means not one of the orchestrator's own processes on this host (`workers.lock.own_processes`):
the job's tree (the lock holder named by `ROCM_GPU_GUARD_LOCK_HELD` when it is a real ancestor,
else this process, and their descendants), the Ray node the job runs on (its starter, daemons and
workers) and an embedded run's head. Everything else is foreign, whatever its name.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Protocol

from workers.contract import GpuPin, LockSettings
from workers.lock.gpu import LockBusyError, nesting_pid
from workers.lock.own_processes import OwnProcesses, own_processes
from workers.proc.table import pid_alive, process_name


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


class KfdProbe:
    """ROCm: processes with a KFD context (`/sys/class/kfd/kfd/proc/<pid>`)."""

    name = "kfd"

    def __init__(self, proc_dir: str = "/sys/class/kfd/kfd/proc", gpu: GpuPin | None = None) -> None:
        if not os.path.isdir(proc_dir):
            raise ProbeUnavailableError(
                f"KFD process list {proc_dir} is not a directory (is the amdgpu driver loaded?)"
            )
        self.proc_dir = proc_dir
        self.gpu_id = None if gpu is None else _kfd_gpu_id(proc_dir, gpu.index)
        if self.gpu_id is not None:
            self.name = f"kfd gpu_id {self.gpu_id}"

    def prime(self) -> None:
        """Nothing to prime: the list is read fresh each time."""

    def sample(self) -> ProbeSample:
        """Live processes in the KFD list that are not ours."""
        own = ours()
        foreign: dict[int, str] = {}
        try:
            entries = os.listdir(self.proc_dir)
        except OSError as exc:
            raise ProbeUnavailableError(f"cannot read KFD process list {self.proc_dir}: {exc}") from exc
        for entry in entries:
            if not entry.isdigit():
                continue
            pid = int(entry)
            if not pid_alive(pid) or own.contains(pid) or not self._on_our_gpu(entry):
                continue
            foreign[pid] = f"{process_name(pid)}, KFD context"
        return ProbeSample(foreign)

    def _on_our_gpu(self, entry: str) -> bool:
        if self.gpu_id is None:
            return True
        try:
            names = os.listdir(os.path.join(self.proc_dir, entry))
        except OSError:
            return True  # unreadable: it cannot be ruled out
        ids = {n.rpartition("_")[2] for n in names if n.rpartition("_")[2].isdigit()}
        return not ids or str(self.gpu_id) in ids


def _kfd_gpu_id(proc_dir: str, index: int) -> int | None:
    """The KFD gpu_id of ROCm GPU `index`, from the topology beside the process list (None: unknown)."""
    from workers.host.gpus import GpuListError, kfd_gpus

    topology = os.path.join(os.path.dirname(os.path.normpath(proc_dir)), "topology", "nodes")
    try:
        found = kfd_gpus(topology)
    except GpuListError:
        return None
    return found[index].kfd_id if index < len(found) else None


def parse_compute_apps(text: str) -> dict[int, str]:
    """Parse `nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv,noheader,nounits`.

    Lines that do not start with a pid (`No running processes found`, blank lines) are skipped;
    `[N/A]` memory is kept as text.
    """
    apps: dict[int, str] = {}
    for line in text.splitlines():
        fields = [f.strip() for f in line.split(",")]
        if not fields or not fields[0].isdigit():
            continue
        name = fields[1] if len(fields) > 1 and fields[1] else "?"
        memory = fields[2] if len(fields) > 2 else "?"
        unit = " MiB" if memory.isdigit() else ""
        apps[int(fields[0])] = f"{os.path.basename(name)}, {memory}{unit} GPU memory"
    return apps


class NvidiaSmiProbe:
    """CUDA: compute processes as `nvidia-smi` lists them."""

    name = "nvidia-smi"

    def __init__(self, executable: str = "nvidia-smi", timeout: float = 10.0, gpu: GpuPin | None = None) -> None:
        found = shutil.which(executable)
        if found is None:
            raise ProbeUnavailableError(f"{executable} is not on PATH")
        self.executable = found
        self.timeout = timeout
        self.which = [] if gpu is None else [f"--id={gpu.uuid or gpu.index}"]

    def prime(self) -> None:
        """Nothing to prime."""

    def sample(self) -> ProbeSample:
        """Compute processes that are not ours."""
        cmd = [
            self.executable,
            *self.which,
            "--query-compute-apps=pid,process_name,used_memory",
            "--format=csv,noheader,nounits",
        ]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=self.timeout, check=False)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise ProbeUnavailableError(f"{self.executable} failed: {exc}") from exc
        if done.returncode != 0:
            why = (done.stderr or done.stdout).strip().splitlines()
            raise ProbeUnavailableError(f"{self.executable} exited {done.returncode}: {why[0] if why else 'no output'}")
        own = ours()
        apps = parse_compute_apps(done.stdout)
        return ProbeSample({pid: what for pid, what in apps.items() if not own.contains(pid)})


class NvmlProbe:
    """CUDA: compute processes through NVML (nvidia-ml-py)."""

    name = "nvml"

    def __init__(self, gpu: GpuPin | None = None) -> None:
        try:
            import pynvml
        except ImportError as exc:
            raise ProbeUnavailableError("nvidia-ml-py (pynvml) is not installed") from exc
        try:
            pynvml.nvmlInit()
            if gpu is None:
                count = pynvml.nvmlDeviceGetCount()
                self._handles = {i: pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)}
            elif gpu.uuid:  # NVML's own indices are nvidia-smi's; the UUID is exact whatever the order
                self._handles = {gpu.index: pynvml.nvmlDeviceGetHandleByUUID(gpu.uuid)}
            else:
                self._handles = {gpu.index: pynvml.nvmlDeviceGetHandleByIndex(gpu.index)}
        except pynvml.NVMLError as exc:
            raise ProbeUnavailableError(f"NVML: {exc}") from exc
        self._nvml = pynvml

    def prime(self) -> None:
        """Nothing to prime."""

    def sample(self) -> ProbeSample:
        """Compute processes on any GPU of this host (or the pinned one) that are not ours."""
        own = ours()
        foreign: dict[int, str] = {}
        for index, handle in self._handles.items():
            try:
                procs = self._nvml.nvmlDeviceGetComputeRunningProcesses(handle)
            except self._nvml.NVMLError as exc:
                raise ProbeUnavailableError(f"NVML on GPU {index}: {exc}") from exc
            for proc in procs:
                if own.contains(proc.pid):
                    continue
                memory = proc.usedGpuMemory
                size = f"{memory / 2**20:.0f} MiB" if isinstance(memory, int) else "? MiB"
                foreign[proc.pid] = f"{process_name(proc.pid)} on GPU {index}, {size}"
        return ProbeSample(foreign)


def cpu_times() -> dict[int, tuple[int, float, str]]:
    """Every process: pid -> (parent pid, CPU seconds used so far, name).

    Linux reads `/proc/<pid>/stat`; elsewhere (macOS) `ps` gives a cumulative `time` column.
    """
    return _proc_cpu_times() if sys.platform.startswith("linux") else _ps_cpu_times()


def _proc_cpu_times() -> dict[int, tuple[int, float, str]]:
    table: dict[int, tuple[int, float, str]] = {}
    tick = float(os.sysconf("SC_CLK_TCK"))
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat", "rb") as f:
                data = f.read()
        except OSError:
            continue  # gone meanwhile
        close = data.rindex(b")")
        rest = data[close + 2 :].split()
        name = data[data.index(b"(") + 1 : close].decode(errors="replace")
        table[int(entry.name)] = (int(rest[1]), (int(rest[11]) + int(rest[12])) / tick, name)
    return table


def _ps_cpu_times() -> dict[int, tuple[int, float, str]]:
    table: dict[int, tuple[int, float, str]] = {}
    out = subprocess.run(
        ["ps", "-A", "-o", "pid=,ppid=,time=,comm="], capture_output=True, text=True, timeout=10, check=False
    ).stdout
    for line in out.splitlines():
        parts = line.split(None, 3)
        if len(parts) == 4 and parts[0].isdigit() and parts[1].isdigit():
            table[int(parts[0])] = (int(parts[1]), _ps_seconds(parts[2]), os.path.basename(parts[3]))
    return table


def _ps_seconds(text: str) -> float:
    """`[[dd-]hh:]mm:ss[.cc]` as seconds."""
    days, _, clock = text.rpartition("-")
    total = 0.0
    for part in clock.split(":"):
        total = total * 60 + float(part)
    return total + (int(days) * 86400 if days.isdigit() else 0)


class CpuQuietProbe:
    """CPU and Metal: foreign processes busier than `threshold` percent of one core.

    Usage is measured between consecutive readings (at least `min_window` seconds apart, so that
    the clock tick's granularity cannot make a blip look busy).
    """

    name = "cpu-quiet"

    def __init__(self, threshold: float = 50.0, min_window: float = 0.25) -> None:
        self.threshold = threshold
        self.min_window = min_window
        self._last: dict[int, tuple[int, float, str]] | None = None
        self._last_t = 0.0

    def prime(self) -> None:
        """Take the reading the next sample is measured from."""
        self._last = cpu_times()
        self._last_t = time.monotonic()

    def sample(self) -> ProbeSample:
        """Foreign processes above the threshold since the previous reading."""
        if self._last is None:
            self.prime()
        short = self.min_window - (time.monotonic() - self._last_t)
        if short > 0:
            time.sleep(short)
        before, t0 = self._last or {}, self._last_t
        now, t1 = cpu_times(), time.monotonic()
        self._last, self._last_t = now, t1
        window = max(t1 - t0, 1e-6)
        own = ours()
        foreign: dict[int, str] = {}
        for pid, (_ppid, used, name) in now.items():
            prev = before.get(pid)
            percent = 100.0 * (used - (prev[1] if prev else 0.0)) / window
            if percent < self.threshold or own.contains(pid, now):
                continue
            foreign[pid] = f"{name}, {percent:.0f}% CPU"
        return ProbeSample(foreign)


def probe_for(backend: str, settings: LockSettings, gpu: GpuPin | None = None) -> GpuUserProbe:
    """The foreign-GPU-user probe for `backend` (cpu, cuda, metal, rocm); `gpu`: watch that GPU only.

    Raises:
        ProbeUnavailableError: This host cannot see the backend's GPU users; the message says what
            is missing.
        ValueError: An unknown backend.
    """
    if backend == "rocm":
        return KfdProbe(settings.kfd_proc, gpu)
    if backend == "cuda":
        try:
            return NvmlProbe(gpu)
        except ProbeUnavailableError as nvml_error:
            try:
                return NvidiaSmiProbe(gpu=gpu)
            except ProbeUnavailableError as smi_error:
                raise ProbeUnavailableError(f"no way to see CUDA GPU users: {nvml_error}; {smi_error}") from smi_error
    if backend in ("cpu", "metal"):
        return CpuQuietProbe(settings.cpu_busy_threshold)
    raise ValueError(f"unknown backend {backend!r}: expected cpu, cuda, metal or rocm")


def wait_idle(probe: GpuUserProbe, idle_secs: float, *, max_wait: float = 0.0, interval: float = 1.0) -> float:
    """Wait until the probe has seen no foreign user for `idle_secs` in a row.

    Args:
        probe: The backend's probe.
        idle_secs: Quiet time required; 0 returns at once without sampling.
        max_wait: Give up after this many seconds; 0 waits without limit.
        interval: Seconds between samples (shortened for short `idle_secs`).

    Returns:
        Seconds waited.

    Raises:
        LockBusyError: The device was still in use by others when `max_wait` ran out.
    """
    if idle_secs <= 0:
        return 0.0
    start = time.monotonic()
    step = min(interval, max(idle_secs / 4, 0.05))
    quiet_since: float | None = None
    last_busy = ProbeSample()
    probe.prime()
    while True:
        seen = probe.sample()
        now = time.monotonic()
        if seen.busy:
            quiet_since, last_busy = None, seen
        elif quiet_since is None:
            quiet_since = now
        if quiet_since is not None and now - quiet_since >= idle_secs:
            return now - start
        if max_wait > 0 and now - start >= max_wait:
            raise LockBusyError(
                f"gave up waiting for an idle device after {now - start:.1f} s (max_wait {max_wait:g} s, "
                f"{probe.name}): {last_busy.describe()}",
                waited=now - start,
            )
        time.sleep(step)


@dataclass
class ContentionReport:
    """What the monitor saw during one measurement.

    Attributes:
        contended: A foreign user was seen in at least one sample, or a sample failed (a window
            nobody could check is not clean).
        samples: Samples taken (at least one).
        busy_samples: Samples that saw a foreign user.
        foreign_pids: Every foreign pid seen, sorted.
        detail: The foreign users or the probe error, for a log line.
        busy_windows: When a foreign user may have been there (monotonic seconds): for each busy
            or failed look, from the look before it to the look after it, since the user may have
            come just after the last clean look and left just before the next one.
    """

    contended: bool = False
    samples: int = 0
    busy_samples: int = 0
    foreign_pids: list[int] = field(default_factory=list)
    detail: str = ""
    errors: list[str] = field(default_factory=list)
    busy_windows: list[tuple[float, float]] = field(default_factory=list)


class ContentionMonitor:
    """Samples a probe in a background thread during a measurement.

    Example:
        monitor = ContentionMonitor(probe, interval=1.0)
        monitor.start()
        ...measure...
        report = monitor.stop()
    """

    def __init__(self, probe: GpuUserProbe, interval: float = 1.0) -> None:
        self.probe = probe
        self.interval = interval
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._report = ContentionReport()
        self._pids: set[int] = set()
        self._looks: list[tuple[float, bool]] = []  # (monotonic time, busy or failed)

    def start(self) -> None:
        """Begin sampling about every `interval` seconds."""
        self._looks = [(time.monotonic(), False)]
        self.probe.prime()
        self._thread = threading.Thread(target=self._run, name="contention-monitor", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self._take()

    def _take(self) -> None:
        report = self._report
        report.samples += 1
        try:
            seen = self.probe.sample()
        except Exception as exc:  # a failed look is recorded, and the window is not called clean
            report.errors.append(f"{self.probe.name}: {exc}")
            report.contended = True
            report.detail = report.errors[-1]
            self._looks.append((time.monotonic(), True))
            return
        self._looks.append((time.monotonic(), seen.busy))
        if seen.busy:
            report.busy_samples += 1
            report.contended = True
            self._pids.update(seen.foreign)
            report.detail = seen.describe()

    def stop(self) -> ContentionReport:
        """Stop sampling, take a last sample covering the tail, and return what was seen."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self._take()
        self._report.foreign_pids = sorted(self._pids)
        looks = self._looks
        self._report.busy_windows = [
            (looks[i - 1][0] if i > 0 else t, looks[i + 1][0] if i + 1 < len(looks) else t)
            for i, (t, busy) in enumerate(looks)
            if busy
        ]
        return self._report
