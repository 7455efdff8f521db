"""The GPUs of this host, as the backend lists them, and how a job is pinned to one.

A host that names its GPUs (`gpus = [0, 1]` or `"all"` in the inventory) becomes one Ray node per
GPU; each job runs pinned to its node's GPU. The list comes from the driver's own tool, never
from a device context (the head and the Ray daemons must never be GPU users):

* CUDA: `nvidia-smi --query-gpu=index,uuid,name` (NVML's indices: PCI bus order, which is why a
  job is pinned by UUID, never by CUDA's own "fastest first" order);
* ROCm: the KFD topology (`/sys/class/kfd/kfd/topology/nodes/*`), the nodes with a `gpu_id`, in
  node order as ROCr enumerates them; the UUID is ROCr's (`GPU-<unique_id in hex>`);
* Metal: one GPU, index 0 (an Apple machine has one);
* CPU: none (there is nothing to pin a job to).

`ORCHESTRATE_TEST_FAKE_GPUS=N` (test-only, named so) makes any backend list N GPUs named
`fake-gpu-<i>`, so that CI can run a host with several slots on a machine without GPUs; the rows
then say `gpu_uuid = fake-gpu-<i>`, never a real GPU's identity.

Pinning (`visibility_env`): CUDA jobs get `CUDA_VISIBLE_DEVICES=<uuid>` and
`CUDA_DEVICE_ORDER=PCI_BUS_ID`; ROCm jobs `ROCR_VISIBLE_DEVICES=<uuid or index>` with
`HIP_VISIBLE_DEVICES` and `CUDA_VISIBLE_DEVICES` removed (HIP would apply them again, relative to
the one device ROCr leaves visible); every pinned job gets `ORCHESTRATE_GPU_INDEX` and
`ORCHESTRATE_GPU_UUID` (for a command case's own scripts), and a thread count of the host's
cores divided among its GPUs' nodes (`ORCHESTRATE_GPU_SLOTS`, set on each node: eight jobs that
each ran a NumPy reference check on every core would only fight for them). Ray never sets these itself: our
tasks ask for the custom resource `gpu_slot`, not `num_gpus`, so Ray's accelerator code leaves
the variables alone (unless `RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO=1`, which the job's own values
override anyway).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

from pydantic import ConfigDict

from workers.contract import GpuPin

FAKE_GPUS_ENV = "ORCHESTRATE_TEST_FAKE_GPUS"  # test-only: N fake GPUs on any backend
GPU_INDEX_ENV = "ORCHESTRATE_GPU_INDEX"
GPU_UUID_ENV = "ORCHESTRATE_GPU_UUID"
GPU_SLOTS_ENV = "ORCHESTRATE_GPU_SLOTS"  # on a GPU's node: how many GPUs' nodes share the host (its cores)
KFD_TOPOLOGY = "/sys/class/kfd/kfd/topology/nodes"
LIST_TIMEOUT_S = 30.0


class GpuInfo(GpuPin):
    """A GPU as the host lists it: its pin, plus what the listing knows besides."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str | None = None
    kfd_id: int | None = None  # ROCm: the KFD topology's gpu_id (the per-GPU files of its process list)

    def pin(self) -> GpuPin:
        """Just the index and UUID (what a job and its rows carry)."""
        return GpuPin(index=self.index, uuid=self.uuid)


class GpuListError(Exception):
    """The backend's GPUs cannot be listed here, or the inventory names GPUs the host lacks."""


class GpuNotFoundError(GpuListError):
    """The inventory names GPUs the host lacks (`select_gpus`)."""


def list_gpus(backend: str, *, kfd_topology: str = KFD_TOPOLOGY) -> list[GpuInfo]:
    """Every GPU of `backend` on this host, by index (empty on the CPU backend).

    Raises:
        GpuListError: the backend's tool is missing or failed (CUDA: nvidia-smi; ROCm: KFD).
    """
    fake = os.environ.get(FAKE_GPUS_ENV, "").strip()
    if fake:
        if not fake.isdigit():
            raise GpuListError(f"{FAKE_GPUS_ENV}={fake!r} is not a count")
        return [GpuInfo(index=i, uuid=f"fake-gpu-{i}", name="fake GPU (test-only)") for i in range(int(fake))]
    if backend == "cuda":
        return _nvidia_gpus()
    if backend == "rocm":
        return kfd_gpus(kfd_topology)
    if backend == "metal":
        return [GpuInfo(index=0, uuid=None, name="Apple GPU")]
    return []


def _nvidia_gpus() -> list[GpuInfo]:
    exe = shutil.which("nvidia-smi")
    if exe is None:
        raise GpuListError("nvidia-smi is not on PATH (it lists the CUDA GPUs)")
    argv = [exe, "--query-gpu=index,uuid,name", "--format=csv,noheader"]
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=LIST_TIMEOUT_S, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise GpuListError(f"nvidia-smi failed: {exc}") from None
    if done.returncode != 0:
        why = (done.stderr or done.stdout).strip().splitlines()
        raise GpuListError(f"nvidia-smi exited {done.returncode}: {why[0] if why else 'no output'}")
    return parse_nvidia_gpus(done.stdout)


def parse_nvidia_gpus(text: str) -> list[GpuInfo]:
    """Parse `nvidia-smi --query-gpu=index,uuid,name --format=csv,noheader`."""
    found = []
    for line in text.splitlines():
        fields = [f.strip() for f in line.split(",", 2)]
        if len(fields) == 3 and fields[0].isdigit():
            found.append(GpuInfo(index=int(fields[0]), uuid=fields[1] or None, name=fields[2] or None))
    return found


def kfd_gpus(topology: str = KFD_TOPOLOGY) -> list[GpuInfo]:
    """ROCm GPUs from the KFD topology: nodes with a non-zero `gpu_id`, in node order (ROCr's order).

    Raises:
        GpuListError: no KFD topology here (the amdgpu driver is not loaded).
    """
    root = Path(topology)
    if not root.is_dir():
        raise GpuListError(f"KFD topology {topology} is not a directory (is the amdgpu driver loaded?)")
    found: list[GpuInfo] = []
    nodes = sorted((p for p in root.iterdir() if p.name.isdigit()), key=lambda p: int(p.name))
    for node in nodes:
        gpu_id = _read_int(node / "gpu_id")
        if not gpu_id:
            continue  # a CPU node
        props = _properties(node / "properties")
        unique = props.get("unique_id")
        name = (node / "name").read_text().strip() if (node / "name").is_file() else None
        found.append(
            GpuInfo(index=len(found), uuid=f"GPU-{unique:016x}" if unique else None, name=name or None, kfd_id=gpu_id)
        )
    return found


def _read_int(path: Path) -> int:
    try:
        text = path.read_text().strip()
    except OSError:
        return 0
    return int(text) if text.isdigit() else 0


def _properties(path: Path) -> dict[str, int]:
    out: dict[str, int] = {}
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return out
    for line in lines:
        key, _, value = line.strip().partition(" ")
        if value.strip().isdigit():
            out[key] = int(value.strip())
    return out


def select_gpus(requested: list[int] | str, found: list[GpuInfo], *, backend: str) -> list[GpuInfo]:
    """The GPUs an inventory's `gpus` names, from what the host has (`"all"`: every one).

    Raises:
        GpuNotFoundError: an index the host does not have, or `gpus = [...]` on a host with none.
    """
    if isinstance(requested, str):  # "all", as the inventory checked
        return list(found)
    by_index = {g.index: g for g in found}
    missing = [i for i in requested if i not in by_index]
    if missing:
        have = ", ".join(str(g.index) for g in found) or "none"
        what = "GPU" if len(missing) == 1 else "GPUs"
        why = " (the cpu backend has no GPUs: remove `gpus`)" if backend == "cpu" and not found else ""
        raise GpuNotFoundError(
            f"gpus = {list(requested)}: {what} {', '.join(map(str, missing))} not found (this host has: {have}){why}"
        )
    return [by_index[i] for i in requested]


def visibility_env(backend: str, pin: GpuPin) -> dict[str, str | None]:
    """The variables that pin a job's process to `pin` (None: remove the variable)."""
    env: dict[str, str | None] = {GPU_INDEX_ENV: str(pin.index), GPU_UUID_ENV: pin.uuid}
    if backend == "cuda":
        env["CUDA_VISIBLE_DEVICES"] = pin.uuid or str(pin.index)
        env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"  # an index means nvidia-smi's (PCI) order, not CUDA's default
    elif backend == "rocm":
        env["ROCR_VISIBLE_DEVICES"] = pin.uuid or str(pin.index)
        env["HIP_VISIBLE_DEVICES"] = None
        env["CUDA_VISIBLE_DEVICES"] = None
    return env


LABEL_INDEX = "gpu-index"  # Ray node labels of a GPU's node
LABEL_UUID = "gpu-uuid"
_LABEL_RE = re.compile(r"[A-Za-z0-9]([A-Za-z0-9_.-]{0,61}[A-Za-z0-9])?")


def pin_labels(pin: GpuPin) -> dict[str, str]:
    """The Ray node labels of `pin`'s node (the UUID only where it is a valid label value)."""
    labels = {LABEL_INDEX: str(pin.index)}
    if pin.uuid and _LABEL_RE.fullmatch(pin.uuid):
        labels[LABEL_UUID] = pin.uuid
    return labels


def pin_from_labels(labels: dict[str, str]) -> GpuPin | None:
    """The GPU a node with these labels is pinned to (None: a node of a host without `gpus`)."""
    raw = labels.get(LABEL_INDEX, "")
    if not raw.isdigit():
        return None
    return GpuPin(index=int(raw), uuid=labels.get(LABEL_UUID) or None)
