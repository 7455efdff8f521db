"""A host with several GPUs, end to end on this machine: `orchestrate run` with embedded Ray, one
real Ray node per "GPU", jobs spread over them, the per-GPU locks, a lost worker and a lost node.

There is no GPU here: the host is a CPU host whose inventory names `gpus = [0, 1, 2]`, and the
test-only `ORCHESTRATE_TEST_FAKE_GPUS=3` makes `workers.host.gpus` list three fake GPUs for it
(`fake-gpu-<i>`, so no row can pass for a real GPU's). Everything else is real: three Ray nodes
(the embedded instance and two `ray start` nodes joined to it), the jobs' processes, the flocks,
the Parquet read back.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from orchestrator.store.fragments import ResultStore
from tests.conftest import child_env
from tests.e2e.test_cluster import SWEEP  # the same two-arm qmm sweep
from workers.contract import META_JOB_SECONDS, META_PHASES

pytestmark = pytest.mark.slow

TOKENS = [64, 65, 66, 67, 68, 69]

INVENTORY = """
[[hosts]]
name = "local"
device = "cpu"
backend = "cpu"
lock = "{lock}"
gpus = {gpus}
# the CPU-quiet gate is not under test (test_run_gpu_host tests it): three jobs share two cores here
cpu_busy_threshold = 1e9
"""


def _setup(tmp_path: Path, name: str, reps: int, gpus: str = "[0, 1, 2]") -> tuple[list[str], dict[str, str]]:
    lock = tmp_path / "gpu.lock"
    (tmp_path / "inv.toml").write_text(INVENTORY.format(lock=lock, gpus=gpus))
    (tmp_path / f"{name}.toml").write_text(SWEEP.format(tokens=TOKENS, n=512, name=name, reps=reps))
    argv = ["run", "--inventory", str(tmp_path / "inv.toml"), "--sweep", str(tmp_path / f"{name}.toml")]
    env = child_env(ORCHESTRATE_TEST_FAKE_GPUS="3", ORCHESTRATE_LOCK_PATH=str(lock))
    return [*argv, "-r", str(tmp_path / "results")], env


def _orchestrate(bin: str, argv: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([bin, *argv], capture_output=True, text=True, env=env, cwd=cwd, timeout=600)


def _jobs(results: Path) -> dict[str, dict[str, object]]:
    """Per stored job: its GPUs, UUIDs, fingerprints, statuses and the span its work took."""
    jobs: dict[str, dict[str, object]] = {}
    for frag in ResultStore(results).fragments():
        table = pq.read_table(frag.path)
        meta = table.schema.metadata or {}
        start: dt.datetime = table.column("started_at")[0].as_py()
        phases = json.loads(meta[META_PHASES])
        seconds = float(meta[META_JOB_SECONDS]) - float(phases.get("fingerprint", 0.0))  # started_at: after it
        jobs[frag.job_key] = {
            "gpus": set(table.column("gpu_index").to_pylist()),
            "uuids": set(table.column("gpu_uuid").to_pylist()),
            "fingerprints": set(table.column("fingerprint_id").to_pylist()),
            "status": set(table.column("status").to_pylist()),
            "span": (start.timestamp(), start.timestamp() + seconds),
        }
    return jobs


def test_jobs_spread_over_every_gpu_slot_each_under_its_gpus_lock(tmp_path: Path, orchestrate_bin: str) -> None:
    argv, env = _setup(tmp_path, "spread", reps=5)
    last = _orchestrate(orchestrate_bin, argv, env, tmp_path)
    assert last.returncode == 0, last.stdout + last.stderr
    jobs = _jobs(tmp_path / "results")
    assert len(jobs) == 6 and all(j["status"] == {"ok"} for j in jobs.values())
    for job in jobs.values():  # each job ran on one GPU, and its rows say which
        (gpu,) = job["gpus"]  # type: ignore[misc]
        assert gpu in (0, 1, 2) and job["uuids"] == {f"fake-gpu-{gpu}"}
    used = {next(iter(j["gpus"])) for j in jobs.values()}  # type: ignore[call-overload]
    assert len(used) >= 2, jobs  # Ray spread the sweep over several GPU slots
    # ... at the same time: two jobs on different GPUs overlapped
    pairs = [(a, b) for a in jobs.values() for b in jobs.values() if a["gpus"] != b["gpus"]]
    assert any(a["span"][0] < b["span"][1] and b["span"][0] < a["span"][1] for a, b in pairs), jobs  # type: ignore[index]
    by_gpu = {next(iter(j["gpus"])): j["fingerprints"] for j in jobs.values()}  # type: ignore[call-overload]
    assert len(set().union(*by_gpu.values())) == len(by_gpu)  # one fingerprint per GPU
    # each GPU's own lock file was taken beside the host's (and every one is free again)
    lock = tmp_path / "gpu.lock"
    assert {int(p.name.rsplit("gpu", 1)[1]) for p in tmp_path.glob("gpu.lock.gpu*") if ".holder" not in p.name} >= used
    status = _orchestrate(orchestrate_bin, ["lock", "status", "--lock", str(lock)], env, tmp_path)
    assert status.returncode == 0 and status.stdout.startswith(f"free: {lock}\n"), status.stdout
    assert all(ln.startswith("free: ") for ln in status.stdout.splitlines()), status.stdout

    again = _orchestrate(orchestrate_bin, argv, env, tmp_path)
    assert again.returncode == 0 and "Nothing to do: all 6 jobs" in again.stdout, again.stdout + again.stderr


def test_a_gpu_this_host_lacks_is_bad_input_and_nothing_starts(tmp_path: Path, orchestrate_bin: str) -> None:
    argv, env = _setup(tmp_path, "missing", reps=2, gpus="[0, 7]")
    bad = _orchestrate(orchestrate_bin, argv, env, tmp_path)
    assert bad.returncode == 2, bad.stdout + bad.stderr
    assert "gpus = [0, 7]: GPU 7 not found (this host has: 0, 1, 2)" in bad.stderr
    assert not (tmp_path / "results").exists()


def _ancestor_ray_worker(pid: int) -> int:
    """The Ray worker process a job's process descends from (its title starts with `ray::`)."""
    while pid > 1:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            if f.read().startswith(b"ray::"):
                return pid
        with open(f"/proc/{pid}/stat", "rb") as f:
            pid = int(f.read().rsplit(b")", 1)[1].split()[1])
    raise AssertionError("no Ray worker above the job")


def _gpu_node(head: int, index: int) -> int:
    """The `ray start --block` of GPU `index`'s node: a child of the head, in a session of its own."""
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    argv = f.read().split(b"\0")
                with open(f"/proc/{entry}/stat", "rb") as f:
                    parent = int(f.read().rsplit(b")", 1)[1].split()[1])
            except OSError:
                continue
            if parent == head and b"start" in argv and any(f"gpu-index={index},".encode() in a + b"," for a in argv):
                return int(entry)
    raise AssertionError(f"no Ray node of GPU {index}")


def _holder(path: Path) -> dict[str, str]:
    return dict(ln.split("=", 1) for ln in path.read_text().splitlines() if "=" in ln)


def test_a_lost_worker_and_a_lost_gpu_node_have_their_jobs_finished_elsewhere(
    tmp_path: Path, orchestrate_bin: str
) -> None:
    argv, env = _setup(tmp_path, "loss", reps=20)
    log = (tmp_path / "run.log").open("w")
    proc = subprocess.Popen([orchestrate_bin, *argv], stdout=log, stderr=subprocess.STDOUT, env=env, cwd=tmp_path)
    try:
        holders = [tmp_path / f"gpu.lock.gpu{i}.holder" for i in (1, 2)]
        deadline = time.monotonic() + 300
        while not all(p.exists() for p in holders):
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "run.log").read_text()
            time.sleep(0.1)
        running = {i: _holder(p) for i, p in zip((1, 2), holders, strict=True)}
        keys = {i: h["cmd"].rsplit("/", 1)[-1] for i, h in running.items()}
        os.kill(_ancestor_ray_worker(int(running[1]["pid"])), signal.SIGKILL)  # GPU 1's worker process
        os.killpg(_gpu_node(proc.pid, 2), signal.SIGKILL)  # GPU 2's whole Ray node: raylet, workers, the job
        code = proc.wait(600)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()
    out = (tmp_path / "run.log").read_text()
    assert code == 0, out
    jobs = _jobs(tmp_path / "results")
    # Both killed jobs were run again to the end; the one whose GPU's node is gone, on another GPU.
    assert jobs[keys[1]]["status"] == {"ok"} and jobs[keys[2]]["status"] == {"ok"}, out
    assert jobs[keys[2]]["gpus"] & {0, 1} and 2 not in jobs[keys[2]]["gpus"]  # type: ignore[operator]
    # Nothing lost: every job stored once, whole, and a rerun has nothing to do.
    assert len(jobs) == 6 and all(j["status"] == {"ok"} for j in jobs.values())
    assert len(ResultStore(tmp_path / "results").fragments()) == 6  # the lost attempts stored nothing
    final = _orchestrate(orchestrate_bin, argv, env, tmp_path)
    assert "Nothing to do: all 6 jobs" in final.stdout, final.stdout + final.stderr
