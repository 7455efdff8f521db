"""CUDA: compute processes through NVML (nvidia-ml-py), else `nvidia-smi --query-compute-apps`.

Their pids are not checked for liveness here: NVML lists only running processes, and a pid
invisible here belongs to another pid namespace (a container), which is exactly a foreign user.
Pinned to one GPU (a host with several), only that GPU's processes count (NVML by UUID,
`nvidia-smi --id`): a job on the next GPU is not contention.
"""

from __future__ import annotations

import os
import shutil
import subprocess

from workers.contract import GpuPin, LockSettings
from workers.lock.probes.base import GpuUserProbe, ProbeSample, ProbeUnavailableError, backend_probe, ours
from workers.proc.table import process_name


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
            import pynvml  # optional (nvidia-ml-py): hosts without it use nvidia-smi
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


@backend_probe("cuda")
def cuda_probe(settings: LockSettings, gpu: GpuPin | None) -> GpuUserProbe:
    """NVML where it is installed and answers, else nvidia-smi.

    Raises:
        ProbeUnavailableError: neither can see this host's GPU users (both reasons given).
    """
    try:
        return NvmlProbe(gpu)
    except ProbeUnavailableError as nvml_error:
        try:
            return NvidiaSmiProbe(gpu=gpu)
        except ProbeUnavailableError as smi_error:
            raise ProbeUnavailableError(f"no way to see CUDA GPU users: {nvml_error}; {smi_error}") from smi_error
