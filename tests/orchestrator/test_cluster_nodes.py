"""The Ray nodes of a host with several GPUs, seen from the head: their command lines, labels,
registration, and the embedded instance's GPU list (no Ray started here; the e2e tests start it).
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from orchestrator.cluster.embedded import local_gpus
from orchestrator.cluster.nodes import node_command, node_labels, node_paths, node_summary, registration
from orchestrator.errors import InfrastructureError, InputError
from orchestrator.specs.sweep import InventorySpec
from workers.host.gpus import FAKE_GPUS_ENV, GpuInfo

INVENTORY = {
    "head": {"address": "10.0.0.1"},
    "hosts": [{"name": "box", "host": "10.0.0.9", "device": "h200", "backend": "cuda", "gpus": [0, 1]}],
}
GPU1 = GpuInfo(index=1, uuid="GPU-0b9d7c6e-aaaa-bbbb-cccc-ddddeeeeffff", name="NVIDIA H200")


def test_each_gpu_is_a_node_of_its_own_with_its_labels_and_directory() -> None:
    inv = InventorySpec.model_validate(INVENTORY)
    box = inv.hosts[0]
    paths = node_paths(box, "/home/bench", 1)
    assert (paths["pid"], paths["log"], paths["temp"]) == (
        "/home/bench/.orchestrate/ray-node-gpu1.pid", "/home/bench/.orchestrate/ray-node-gpu1.log",
        "/home/bench/.orchestrate/ray-gpu1",
    )  # fmt: skip
    assert node_paths(box, "/home/bench")["pid"] == "/home/bench/.orchestrate/ray-node.pid"  # a host without gpus
    argv = node_command(box, inv, paths, "Linux", GPU1)
    labels = argv[argv.index("--labels") + 1]
    assert labels == f"device-kind=h200,backend=cuda,host=box,gpu-index=1,gpu-uuid={GPU1.uuid}"
    assert argv[argv.index("--temp-dir") + 1] == "/home/bench/.orchestrate/ray-gpu1"
    assert argv[argv.index("--resources") + 1] == '{"gpu_slot": 1}'  # one slot per GPU's node
    assert "--object-store-memory" in argv  # N nodes share one /dev/shm


def test_a_gpu_node_joins_only_as_itself() -> None:
    box = InventorySpec.model_validate(INVENTORY).hosts[0]
    gpu0 = GpuInfo(index=0, uuid="GPU-8f3c1e2a-1111-2222-3333-444455556666")

    def node(gpu: GpuInfo | None, alive: bool = True) -> dict[str, object]:
        return {"Alive": alive, "Labels": node_labels(box, gpu), "Resources": {"gpu_slot": 1.0}}

    assert registration([node(gpu0)], box, gpu0) == (True, "")
    assert registration([node(gpu0)], box, GPU1) == (False, "")  # GPU 0's node is not GPU 1's
    assert registration([node(GPU1, alive=False), node(gpu0)], box, GPU1) == (False, "")
    assert registration([node(None)], box, GPU1) == (False, "")  # an unpinned node of the same host
    wrong = {**node(GPU1), "Labels": {**node_labels(box, GPU1), "gpu-uuid": "GPU-other"}}
    assert registration([wrong], box, GPU1)[1].startswith("a node registered as host 'box' with labels {'gpu-uuid'")


def test_what_up_and_down_say_per_host() -> None:
    assert node_summary(["started"], [None]) == "started"
    assert node_summary(["started", "started"], [0, 1]) == "started (2 GPUs)"
    assert node_summary(["running", "started"], [0, 1]) == "gpu0 running, gpu1 started"
    assert node_summary(["running", "failed"], [0, 1]) == "gpu0 running, gpu1 failed"
    assert node_summary(["stopped"], [3]) == "stopped (1 GPU)"


def test_the_embedded_host_lists_its_gpus_here_without_mlx(monkeypatch: pytest.MonkeyPatch) -> None:
    def local(gpus: object, backend: str = "cpu") -> InventorySpec:
        return InventorySpec.model_validate(
            {"hosts": [{"name": "local", "device": "x", "backend": backend, "gpus": gpus}]}
        )

    monkeypatch.delenv(FAKE_GPUS_ENV, raising=False)
    assert local_gpus(local("all")) == []  # the CPU backend has no GPU: one unpinned slot
    with pytest.raises(InputError, match=r"field hosts.0.gpus \(host 'local'\): gpus = \[0, 1\]: GPUs 0, 1 not found"):
        local_gpus(local([0, 1]))
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(InfrastructureError, match="cannot list its cuda GPUs: nvidia-smi is not on PATH"):
        local_gpus(local("all", "cuda"))
    monkeypatch.setenv(FAKE_GPUS_ENV, "4")
    assert [g.index for g in local_gpus(local([3, 1]))] == [3, 1]
    assert local_gpus(InventorySpec.model_validate({"hosts": [{"name": "l", "device": "x"}]})) == []  # no `gpus`
    # the head lists them without loading MLX (which would open a device context in it)
    probe = (
        "import sys; from orchestrator.cluster.embedded import local_gpus; "
        "from orchestrator.specs.sweep import InventorySpec; "
        "inv = InventorySpec.model_validate({'hosts': [{'name': 'l', 'device': 'x', 'gpus': 'all'}]}); "
        "print(len(local_gpus(inv)), any(m.split('.')[0] == 'mlx' for m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.split() == ["4", "False"]
