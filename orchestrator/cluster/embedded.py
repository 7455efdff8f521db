"""The embedded local Ray instance: this machine alone, one Ray node per GPU it names.

Without `gpus`, `ray.init(address="local")` starts one node with one `gpu_slot`, as it always
did. With `gpus` (`inventories/local.toml` says `"all"`), the head lists this machine's GPUs the
way a worker host does (`workers.host.gpus.list_gpus`: `nvidia-smi` or the KFD topology, in a
short-lived process or from sysfs: never a device context in the head). The first GPU is the
node `ray.init` starts; each further GPU gets a node of its own, `ray start --block --address
<this instance>` as a child of the head, labelled `gpu-index` and `gpu-uuid`, offering one
`gpu_slot`, with a Ray directory of its own (`/tmp/ray-gpu<i>` beside `/tmp/ray`). So a GPU is
a Ray node everywhere (here and on `cluster up`'s hosts): Ray spreads a
sweep's jobs over all of them, and a node lost mid-job has its job retried on another (Ray's own
`max_retries`). The extra nodes end with the head (their process group, before `ray.shutdown`;
`PR_SET_PDEATHSIG` if the head is killed). The CPU backend has no GPUs: `"all"` there is the one
unpinned slot of before.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from orchestrator.cluster.head import RAY_BIND_ENV, RAY_CLI
from orchestrator.errors import InfrastructureError, InputError
from orchestrator.specs.inventory import HostSpec, InventorySpec
from workers.host.gpus import GPU_SLOTS_ENV, GpuInfo, GpuListError, GpuNotFoundError, list_gpus, pin_labels, select_gpus
from workers.proc.tree import end_descendants

JOIN_TIMEOUT_S = 180.0  # a raylet's start on a loaded small machine takes seconds; on an 8-GPU box, several at once
NODE_OBJECT_STORE_BYTES = 2**30  # per extra node: rows are small, and N nodes share one /dev/shm
STOP_GRACE_S = 10.0
LOG_TAIL_LINES = 5
# The CPUs each embedded node tells Ray it has. Our tasks take none (`num_cpus=0`, one `gpu_slot`)
# and set the job's thread count themselves (`workers.job.task.job_env`), so the count only decides
# how many Python workers Ray starts ahead when the run's driver connects: one per CPU. A slot runs
# one job at a time and needs one; each further one would be Ray's import (about a CPU second)
# competing with the first job's start, once per core of a many-core GPU host.
NODE_CPUS = 1


def local_gpus(inventory: InventorySpec) -> list[GpuInfo]:
    """The GPUs the embedded inventory's host names, as this machine lists them (empty: unpinned).

    Raises:
        InputError: `gpus` names a GPU this machine does not have (exit 2, nothing started).
        InfrastructureError: the backend's GPUs cannot be listed (no nvidia-smi, no KFD).
    """
    host = inventory.hosts[0]
    if host.gpus is None:
        return []
    try:
        return select_gpus(host.gpus, list_gpus(host.backend), backend=host.backend)
    except GpuNotFoundError as exc:
        raise InputError(f"field hosts.0.gpus (host {host.name!r}): {exc}") from None
    except GpuListError as exc:
        raise InfrastructureError(f"host {host.name!r}: cannot list its {host.backend} GPUs: {exc}") from None


def node_labels(host: HostSpec, gpu: GpuInfo | None) -> dict[str, str]:
    """The labels of this machine's node for `gpu` (None: the one unpinned node)."""
    labels = {"device-kind": host.device, "backend": host.backend, "host": host.name}
    return {**labels, **(pin_labels(gpu) if gpu is not None else {})}


# Linux: SIGTERM (which `ray start --block` turns into stopping its node) when the head is gone,
# set by a launcher that then execs `ray start` (the setting survives exec; a `preexec_fn` would not
# be safe in the head, which runs threads). Elsewhere the launcher only execs.
_LAUNCH = (
    "import ctypes, os, signal, sys\n"
    "if sys.platform.startswith('linux'):\n"
    "    ctypes.CDLL(None).prctl(1, signal.SIGTERM, 0, 0, 0)\n"
    "    if os.getppid() != int(sys.argv[1]): sys.exit(1)\n"
    "os.execv(sys.argv[2], sys.argv[2:])\n"
)


class GpuNodes:
    """The extra nodes of an embedded instance: one per GPU after the first."""

    def __init__(self) -> None:
        self.procs: dict[int, tuple[subprocess.Popen[bytes], Path]] = {}  # GPU index -> (ray start, its log)

    def start(self, host: HostSpec, gpus: list[GpuInfo], address: dict[str, Any]) -> None:
        """Start a node per GPU in `gpus`, joining the instance `ray.init` returned (`address`),
        and wait until each is alive in the node table.

        Raises:
            InfrastructureError: a node exited or did not join in time (its log's last lines).
        """
        session = Path(str(address["session_dir"]))
        logs = session / "logs"
        env = {**os.environ, **RAY_BIND_ENV, GPU_SLOTS_ENV: str(len(gpus) + 1)}
        for gpu in gpus:
            labels = node_labels(host, gpu)
            argv = [
                sys.executable, "-c", _LAUNCH, str(os.getpid()),
                sys.executable, *RAY_CLI, "start", "--block", "--address", str(address["gcs_address"]),
                "--node-ip-address", str(address["node_ip_address"]),
                # a Ray directory of its own (`/tmp/ray-gpu1`): nodes started together in one
                # session directory pick the same socket and log names and fail to bind
                "--temp-dir", f"{session.parent}-gpu{gpu.index}",
                "--labels", ",".join(f"{k}={v}" for k, v in labels.items()),
                "--resources", json.dumps({"gpu_slot": 1}), "--num-cpus", str(NODE_CPUS),
                "--object-store-memory", str(NODE_OBJECT_STORE_BYTES),
                "--disable-usage-stats", "--dashboard-agent-listen-port", "0",
            ]  # fmt: skip
            log = logs / f"orchestrate-node-gpu{gpu.index}.log"
            with log.open("wb") as out:
                proc = subprocess.Popen(
                    argv,
                    env=env,
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            self.procs[gpu.index] = (proc, log)
        self._wait_joined(JOIN_TIMEOUT_S)

    def _wait_joined(self, timeout: float) -> None:
        import ray  # Ray: only when extra nodes are started

        deadline = time.monotonic() + timeout
        waiting = set(self.procs)
        while waiting:
            alive = {
                (n.get("Labels") or {}).get("gpu-index")
                for n in ray.nodes()
                if n.get("Alive") and (n.get("Resources") or {}).get("gpu_slot")
            }
            waiting = {i for i in waiting if str(i) not in alive}
            for index in sorted(waiting):
                proc, log = self.procs[index]
                if proc.poll() is not None:
                    raise InfrastructureError(
                        f"the Ray node of GPU {index} exited ({proc.returncode}) before it joined; "
                        f"last lines of {log}: {_tail(log)}"
                    )
            if waiting and time.monotonic() > deadline:
                index = min(waiting)
                raise InfrastructureError(
                    f"the Ray node of GPU {index} did not join within {timeout:g} s; last lines of "
                    f"{self.procs[index][1]}: {_tail(self.procs[index][1])}"
                )
            if waiting:
                time.sleep(0.2)

    def stop(self) -> None:
        """End every extra node (its process tree and group: raylet, agents, workers, jobs), all at once."""
        end_descendants(*(proc.pid for proc, _ in self.procs.values()), grace=STOP_GRACE_S, group=True)
        for proc, _ in self.procs.values():
            with contextlib.suppress(subprocess.TimeoutExpired):  # reap it
                proc.wait(5)
        self.procs = {}


def _tail(log: Path) -> str:
    try:
        lines = [ln.strip() for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return "(no log)"
    return " | ".join(lines[-LOG_TAIL_LINES:]) or "(empty)"
