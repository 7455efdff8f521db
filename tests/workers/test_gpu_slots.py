"""One GPU of a host with several, on the worker: listing, pinning, the per-GPU lock, the probes.

No GPU here: `nvidia-smi` is a small fake executable on PATH and the KFD topology and process
list are directories the test makes (both named as such); the locks are real flocks taken by real
processes, and `flock(1)` stands for the shell guard.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.workers.test_probes import fake_nvidia_smi, spawn_foreign
from workers.contract import GpuPin, JobSpec, LockSettings
from workers.host.fingerprint import static_fingerprint
from workers.host.gpus import (
    FAKE_GPUS_ENV,
    GpuListError,
    kfd_gpus,
    list_gpus,
    parse_nvidia_gpus,
    pin_from_labels,
    pin_labels,
    select_gpus,
    visibility_env,
)
from workers.lock.file import lock_status
from workers.lock.gpu import GUARD_ENV, LockBusyError
from workers.lock.probes import KfdProbe, NvidiaSmiProbe, probe_for
from workers.lock.slot import SlotLock, gpu_lock_path

UUID0 = "GPU-8f3c1e2a-1111-2222-3333-444455556666"
UUID1 = "GPU-0b9d7c6e-aaaa-bbbb-cccc-ddddeeeeffff"
SMI_GPUS = f"0, {UUID0}, NVIDIA H200\n1, {UUID1}, NVIDIA H200\n"


@pytest.fixture(autouse=True)
def _no_outer_holder(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(GUARD_ENV, raising=False)
    monkeypatch.delenv(FAKE_GPUS_ENV, raising=False)


# ----------------------------------------------------------------------------- listing, pinning


def test_nvidia_gpus_are_listed_by_index_and_uuid(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake_nvidia_smi(tmp_path / "bin", f'[ "$1" = "--query-gpu=index,uuid,name" ] || exit 7\nprintf "{SMI_GPUS}"')
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:{os.environ['PATH']}")
    found = list_gpus("cuda")
    assert [(g.index, g.uuid, g.name) for g in found] == [(0, UUID0, "NVIDIA H200"), (1, UUID1, "NVIDIA H200")]
    assert parse_nvidia_gpus("No devices were found\n") == []
    assert [g.index for g in select_gpus("all", found, backend="cuda")] == [0, 1]
    assert [g.uuid for g in select_gpus([1], found, backend="cuda")] == [UUID1]
    with pytest.raises(GpuListError, match=r"gpus = \[1, 3\]: GPU 3 not found \(this host has: 0, 1\)"):
        select_gpus([1, 3], found, backend="cuda")
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with pytest.raises(GpuListError, match="nvidia-smi is not on PATH"):
        list_gpus("cuda")


def test_the_cpu_backend_has_no_gpus_and_the_test_only_fake_is_named_so(monkeypatch: pytest.MonkeyPatch) -> None:
    assert list_gpus("cpu") == []
    assert select_gpus("all", [], backend="cpu") == []
    with pytest.raises(GpuListError, match="the cpu backend has no GPUs: remove `gpus`"):
        select_gpus([0, 1], [], backend="cpu")
    assert [(g.index, g.uuid) for g in list_gpus("metal")] == [(0, None)]
    monkeypatch.setenv(FAKE_GPUS_ENV, "3")
    assert [g.uuid for g in list_gpus("cpu")] == ["fake-gpu-0", "fake-gpu-1", "fake-gpu-2"]


def test_kfd_topology_lists_rocm_gpus_in_node_order(tmp_path: Path) -> None:
    nodes = tmp_path / "topology" / "nodes"
    for n, gpu_id, unique in [(0, 0, 0), (1, 4321, 0x1A2B), (2, 8765, 0x3C4D), (10, 1111, 0)]:
        (nodes / str(n)).mkdir(parents=True)
        (nodes / str(n) / "gpu_id").write_text(f"{gpu_id}\n")
        (nodes / str(n) / "properties").write_text(f"cpu_cores_count 0\nunique_id {unique}\n")
    found = kfd_gpus(str(nodes))
    assert [(g.index, g.kfd_id, g.uuid) for g in found] == [
        (0, 4321, "GPU-0000000000001a2b"), (1, 8765, "GPU-0000000000003c4d"), (2, 1111, None),
    ]  # fmt: skip  # node 0 is the CPU; node 10 sorts after 2 (by number, not by name)
    with pytest.raises(GpuListError, match="is not a directory"):
        kfd_gpus(str(tmp_path / "none"))


def test_a_pinned_job_sees_only_its_gpu() -> None:
    pin = GpuPin(index=1, uuid=UUID1)
    assert visibility_env("cuda", pin) == {
        "ORCHESTRATE_GPU_INDEX": "1", "ORCHESTRATE_GPU_UUID": UUID1,
        "CUDA_VISIBLE_DEVICES": UUID1, "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
    }  # fmt: skip
    rocm = visibility_env("rocm", GpuPin(index=2))
    assert rocm["ROCR_VISIBLE_DEVICES"] == "2" and rocm["HIP_VISIBLE_DEVICES"] is None
    assert "CUDA_VISIBLE_DEVICES" not in visibility_env("cpu", pin)
    assert pin_from_labels({**pin_labels(pin), "host": "x"}) == pin
    assert pin_from_labels({"host": "x"}) is None


def test_job_env_pins_the_process_and_the_fork_server_is_kept_per_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    from workers.job import task

    monkeypatch.setenv("HIP_VISIBLE_DEVICES", "0")
    job = JobSpec(
        run_id="r", sweep="s", job_key="k", case="qmm", case_name="qmm", params={}, arms=["native"],
        device="mi300", backend="rocm", repetitions=1, warmup=0, gpu=GpuPin(index=3, uuid="GPU-00000000000000ff"),
    )  # fmt: skip
    env = task.job_env(job)
    assert env["ROCR_VISIBLE_DEVICES"] == "GPU-00000000000000ff" and "HIP_VISIBLE_DEVICES" not in env
    assert env["ORCHESTRATE_GPU_INDEX"] == "3"
    assert "ROCR_VISIBLE_DEVICES" not in task.job_env(job.model_copy(update={"gpu": None}))
    cores = os.cpu_count() or 1
    monkeypatch.setenv("ORCHESTRATE_GPU_SLOTS", "4")  # four GPUs' nodes on this host share its cores
    assert task.job_env(job)["OMP_NUM_THREADS"] == str(max(cores // 4, 1))
    assert task.job_env(job.model_copy(update={"gpu": None}))["OMP_NUM_THREADS"] == str(cores)
    monkeypatch.delenv("ORCHESTRATE_GPU_SLOTS")

    started: list[dict[str, str]] = []

    class Server:
        def __init__(self, env: dict[str, str]) -> None:
            self.env = env

        def alive(self) -> bool:
            return True

        def close(self) -> None:
            pass

    def start(env: dict[str, str]) -> Server:
        started.append(env)
        return Server(env)

    monkeypatch.setattr(task.forkclient.ForkServer, "start", staticmethod(start))
    monkeypatch.setattr(task, "_server", None)
    monkeypatch.delenv(task.FRESH_ENV, raising=False)
    other = job.model_copy(update={"gpu": GpuPin(index=4, uuid="GPU-00000000000000aa")})
    for j in (job, job, other):
        task.fork_server(j, task.job_env(j))
    # one start per pin: a job is never forked from a server whose environment named another GPU
    assert [e["ROCR_VISIBLE_DEVICES"] for e in started] == ["GPU-00000000000000ff", "GPU-00000000000000aa"]


def test_the_fingerprint_tells_the_gpus_apart() -> None:
    plain = static_fingerprint("cpu")
    gpu0 = static_fingerprint("cpu", pin=GpuPin(index=0, uuid="fake-gpu-0"))
    gpu1 = static_fingerprint("cpu", pin=GpuPin(index=1, uuid="fake-gpu-1"))
    assert (gpu0.gpu_index, gpu0.gpu_uuid, gpu1.gpu_index) == (0, "fake-gpu-0", 1)
    assert len({plain.fingerprint_id, gpu0.fingerprint_id, gpu1.fingerprint_id}) == 3
    assert plain.gpu_index is None and plain == static_fingerprint("cpu")  # an unpinned host keeps its id


# ----------------------------------------------------------------------------- the lock per GPU


def _hold(lock: str, *args: str) -> subprocess.Popen[str]:
    """`orchestrate lock hold [--gpu N] -- sleep`, announced on stdout once it holds."""
    argv = [str(Path(sys.executable).parent / "orchestrate"), "lock", "hold", "--lock", lock, *args, "--"]
    proc = subprocess.Popen([*argv, "sh", "-c", "echo held; exec sleep 60"], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
    return proc


def _stop(proc: subprocess.Popen[str]) -> None:
    proc.send_signal(signal.SIGTERM)
    proc.wait(30)


def test_jobs_on_different_gpus_share_the_host_lock_and_exclude_each_other_per_gpu(tmp_path: Path) -> None:
    lock = str(tmp_path / "gpu.lock")
    assert gpu_lock_path(lock, 1) == f"{lock}.gpu1"
    gpu1 = _hold(lock, "--gpu", "1")
    try:
        with SlotLock(lock, 0, max_wait=5, cmd="job on gpu0") as mine:  # another GPU: at once
            assert mine.wait_s < 2 and not mine.nested
            assert lock_status(f"{lock}.gpu0").state == "held"
            assert lock_status(lock).state == "shared"  # two holders, shared
        with pytest.raises(LockBusyError, match=r"GPU lock .*gpu\.lock\.gpu1"):
            SlotLock(lock, 1, max_wait=0.5).acquire()  # the same GPU: waits, then gives up
        # the shell guard's way (an exclusive flock on the host's file) waits for every GPU's job
        guard = subprocess.run(["flock", "-w", "0.5", lock, "true"], check=False, timeout=30)
        assert guard.returncode == 1
        assert lock_status(lock).lockers == [gpu1.pid]  # `lock status` names who shares the host's lock
    finally:
        _stop(gpu1)
    assert lock_status(lock).state == "free" and lock_status(f"{lock}.gpu1").state == "free"
    guard = subprocess.Popen(["flock", lock, "sh", "-c", "echo held; exec sleep 60"], stdout=subprocess.PIPE, text=True)
    try:  # and while the guard holds the host, no GPU's job starts
        assert guard.stdout is not None and guard.stdout.readline().strip() == "held"
        with pytest.raises(LockBusyError, match=r"gave up waiting for GPU lock .*gpu\.lock after"):
            SlotLock(lock, 0, max_wait=0.5).acquire()
        assert lock_status(f"{lock}.gpu0").state == "free"  # nothing half-taken is left behind
    finally:
        guard.kill()
        guard.wait()


def test_a_job_under_an_outer_hold_of_its_gpu_nests_and_the_workload_keeps_both_locks(tmp_path: Path) -> None:
    lock = str(tmp_path / "gpu.lock")
    with SlotLock(lock, 2, max_wait=5) as outer:
        fds = outer.inherited_fds()
        assert len(fds) == 2
        # a child that nests (the variable names us, an ancestor holding both files) takes nothing
        probe = "from workers.lock.slot import SlotLock; l = SlotLock({!r}, 2, max_wait=1).acquire(); print(l.nested)"
        out = subprocess.run(
            [sys.executable, "-c", probe.format(lock)], capture_output=True, text=True, check=True, timeout=60
        ).stdout
        assert out.strip() == "True"
        # a workload that inherited both descriptors keeps both locks after we let go
        keeper = subprocess.Popen(["sleep", "30"], pass_fds=fds)
    try:
        assert lock_status(f"{lock}.gpu2").busy and lock_status(lock).state == "shared"
        with pytest.raises(LockBusyError):
            SlotLock(lock, 2, max_wait=0.3).acquire()
    finally:
        keeper.kill()
        keeper.wait()
    with SlotLock(lock, 2, max_wait=5):
        pass


# ----------------------------------------------------------------------------- probes per GPU


def test_nvidia_smi_probe_asks_for_the_pinned_gpu_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The fake prints GPU 1's process only when asked about GPU 1 by UUID, every process otherwise.
    body = (
        f'case "$1" in --id={UUID1}) echo "4242, python, 100";; --id=*) echo "No running processes found";; '
        '*) echo "4242, python, 100"; echo "77, other, 5";; esac'
    )
    fake_nvidia_smi(tmp_path / "bin", body)
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:{os.environ['PATH']}")
    on_1 = probe_for("cuda", LockSettings(), GpuPin(index=1, uuid=UUID1))
    assert isinstance(on_1, NvidiaSmiProbe)
    assert sorted(on_1.sample().foreign) == [4242]
    assert probe_for("cuda", LockSettings(), GpuPin(index=0, uuid=UUID0)).sample().foreign == {}
    assert sorted(probe_for("cuda", LockSettings()).sample().foreign) == [77, 4242]


def test_kfd_probe_watches_the_pinned_gpu_only(tmp_path: Path) -> None:
    kfd = tmp_path / "kfd"
    for n, gpu_id in [(0, 0), (1, 4321), (2, 8765)]:
        (kfd / "topology" / "nodes" / str(n)).mkdir(parents=True)
        (kfd / "topology" / "nodes" / str(n) / "gpu_id").write_text(f"{gpu_id}\n")
    proc = kfd / "proc"
    on_gpu1, on_gpu0, unknown = (spawn_foreign("sleep 60") for _ in range(3))
    try:
        for pid, files in [(on_gpu1, ["vram_8765", "sdma_8765"]), (on_gpu0, ["vram_4321"]), (unknown, [])]:
            (proc / str(pid)).mkdir(parents=True)
            for name in files:
                (proc / str(pid) / name).write_text("0\n")
        probe = KfdProbe(str(proc), GpuPin(index=1))
        assert probe.gpu_id == 8765
        # another GPU's user is not contention; one whose GPU cannot be told counts
        assert sorted(probe.sample().foreign) == sorted([on_gpu1, unknown])
        assert sorted(KfdProbe(str(proc)).sample().foreign) == sorted([on_gpu1, on_gpu0, unknown])
    finally:
        for pid in (on_gpu1, on_gpu0, unknown):
            os.kill(pid, signal.SIGKILL)
