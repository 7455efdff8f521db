"""ROCm: the KFD process list (`/sys/class/kfd/kfd/proc`, one directory per process with a GPU
context).

Entries whose process is gone are ignored (KFD drops an entry only after the process is reaped).
Pinned to one GPU, a process counts when its directory has that GPU's files (`vram_<gpu_id>`,
`stats_<gpu_id>`, ...; the gpu_id from the KFD topology) or no per-GPU files at all (an older
kernel: it cannot be told apart, so it counts).
"""

from __future__ import annotations

import os

from workers.contract import GpuPin, LockSettings
from workers.host.gpus import GpuListError, kfd_gpus
from workers.lock.probes.base import ProbeSample, ProbeUnavailableError, backend_probe, ours
from workers.proc.table import pid_alive, process_name


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
    topology = os.path.join(os.path.dirname(os.path.normpath(proc_dir)), "topology", "nodes")
    try:
        found = kfd_gpus(topology)
    except GpuListError:
        return None
    return found[index].kfd_id if index < len(found) else None


@backend_probe("rocm")
def kfd_probe(settings: LockSettings, gpu: GpuPin | None) -> KfdProbe:
    """The KFD list named by the job's lock settings (`kfd_proc`)."""
    return KfdProbe(settings.kfd_proc, gpu)
