"""The warm fork server: jobs forked with imports done, killed on timeout or when their client goes,
ended with the server's parent; and the Ray task body uses it (phases and rows say so)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest

from tests.conftest import REPO, child_env
from tests.workers import fork_probe
from workers.contract import META_PHASES, JobSpec, LockSettings
from workers.host.gpus import FAKE_GPUS_ENV
from workers.job.task import execute_job, job_env
from workers.proc import forkserver, prestart
from workers.proc import spawn as forkclient
from workers.proc.table import pid_alive

pytestmark = pytest.mark.slow


def _job(tmp_path: Path, reps: int = 3, n: int = 64) -> JobSpec:
    return JobSpec(
        run_id="run1", sweep="fork", job_key=f"k{reps}", case="qmm", case_name="qmm",
        params={"tokens": 16, "n": n, "k": n, "dtype": "float32"}, arms=["native"], device="cpu",
        repetitions=reps, warmup=0, lock=LockSettings(path=str(tmp_path / "gpu.lock"), cpu_busy_threshold=1e9),
        spool_dir=str(tmp_path / "spool"),
    )  # fmt: skip


def _gone(pid: int, within: float = 10.0) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if not pid_alive(pid):
            return True
        time.sleep(0.05)
    return False


@pytest.fixture(scope="module")
def server() -> forkclient.ForkServer:
    srv = forkclient.ForkServer.start(job_env())
    yield srv
    srv.close()


def test_a_forked_child_runs_an_entry_with_its_env(server: forkclient.ForkServer, tmp_path: Path) -> None:
    assert server.note == "mlx preloaded"  # MLX's CPU backend forks safely: the server checked it
    out = tmp_path / "out.txt"
    with out.open("wb") as fh:
        code, how = forkclient.run_entry(
            "workers", ["device"], env={}, changes={"MLX_SOMETHING": "1"}, stdout=fh.fileno(), stderr=fh.fileno(),
            timeout=60, server=server,
        )  # fmt: skip
    assert code == 0 and how.startswith("forked from a warm server (mlx preloaded")
    assert json.loads(out.read_text().strip().splitlines()[-1]) == {"device": "cpu", "backend": "cpu"}


def test_a_timeout_kills_the_child(server: forkclient.ForkServer, tmp_path: Path) -> None:
    job = tmp_path / "job.json"
    job.write_text(_job(tmp_path, reps=100000, n=512).model_dump_json())
    with (tmp_path / "log").open("wb") as fh:
        proc = server.spawn("workers", ["run", str(job), "--out", str(tmp_path / "o.parquet")], env={},
                            stdout=fh.fileno(), stderr=fh.fileno())  # fmt: skip
        with pytest.raises(subprocess.TimeoutExpired):
            proc.wait(timeout=1.0)
        assert pid_alive(proc.pid)
        proc.kill()
        assert proc.wait(timeout=30) == -signal.SIGKILL
    assert _gone(proc.pid)


def test_a_client_that_goes_away_takes_its_child_with_it(server: forkclient.ForkServer, tmp_path: Path) -> None:
    job = tmp_path / "job.json"
    job.write_text(_job(tmp_path, reps=100000, n=512).model_dump_json())
    with (tmp_path / "log").open("wb") as fh:
        proc = server.spawn("workers", ["run", str(job), "--out", str(tmp_path / "o.parquet")], env={},
                            stdout=fh.fileno(), stderr=fh.fileno())  # fmt: skip
    time.sleep(0.5)
    assert pid_alive(proc.pid)
    proc._conn.close()  # the Ray worker that asked for it died
    assert _gone(proc.pid)


def test_a_childs_exit_reaches_its_client_at_once(server: forkclient.ForkServer, tmp_path: Path) -> None:
    """The server hears of a child's exit from SIGCHLD, not from its once-a-second poll: one after
    the other, short children would each wait for the next poll (a second) if the wakeup broke."""
    trips = []
    with (tmp_path / "log").open("wb") as fh:
        for _ in range(5):
            t0 = time.perf_counter()
            code, _ = forkclient.run_entry(
                "workers", ["--help"], env={}, changes={}, stdout=fh.fileno(), stderr=fh.fileno(), timeout=60,
                server=server,
            )  # fmt: skip
            trips.append(time.perf_counter() - t0)
            assert code == 0
    assert sorted(trips)[2] < forkserver.WAKE_POLL_S / 2, trips


def test_the_server_ends_with_its_parent(tmp_path: Path) -> None:
    parent = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from workers.proc.spawn import ForkServer; "
         "s = ForkServer.start({**__import__('os').environ}, preload='none'); print(s.proc.pid, flush=True); "
         "time.sleep(600)"],
        cwd=REPO, env=child_env(), stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert parent.stdout is not None
    pid = int(parent.stdout.readline())
    assert pid_alive(pid)
    parent.kill()
    parent.wait()
    assert _gone(pid)


def test_a_server_that_preloads_only_mlxs_native_library_serves_jobs(tmp_path: Path) -> None:
    """The CUDA backend's fallback (its Python module opens the GPU on import): the server maps
    libmlx.so and what it links but has no MLX module, and its children import MLX and run jobs."""
    srv = forkclient.ForkServer.start(job_env(), preload="mlx-library")
    try:
        assert srv.note == "mlx's native library preloaded"
        assert srv.proc is not None
        maps = Path(f"/proc/{srv.proc.pid}/maps").read_text()
        assert "/libmlx.so" in maps and "/mlx/core.cpython" not in maps  # the library, not MLX's module
        out = tmp_path / "out.txt"
        with out.open("wb") as fh:
            code, _ = forkclient.run_entry(
                "workers", ["device"], env={}, changes={}, stdout=fh.fileno(), stderr=fh.fileno(), timeout=60,
                server=srv,
            )  # fmt: skip
        assert code == 0 and json.loads(out.read_text().splitlines()[-1]) == {"device": "cpu", "backend": "cpu"}
    finally:
        srv.close()


def test_an_mlx_without_a_native_library_falls_back_to_preloading_nothing(tmp_path: Path) -> None:
    # an MLX package (here a stand-in shadowing the real one) that has no lib/libmlx.so
    (tmp_path / "mlx").mkdir()
    (tmp_path / "mlx" / "__init__.py").write_text("")
    env = {**job_env(), "PYTHONPATH": f"{tmp_path}{os.pathsep}{job_env().get('PYTHONPATH', REPO)}"}
    srv = forkclient.ForkServer.start(env, preload="mlx-library")
    try:
        assert srv.note == "mlx not preloaded"
    finally:
        srv.close()


def test_device_files_are_seen(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(forkserver, "DEVICE_FILES", ("/dev/null",))
    fd = os.open("/dev/null", os.O_RDONLY)
    try:
        assert "/dev/null" in forkserver.device_files_open()
    finally:
        os.close(fd)


def test_the_ray_task_body_forks_the_job_and_records_its_phases(tmp_path: Path) -> None:
    table = execute_job(_job(tmp_path).model_dump_json())
    meta = table.schema.metadata or {}
    assert meta[b"orchestrate.job_status"] == b"ok"
    phases = json.loads(meta[META_PHASES])
    assert phases["process"].startswith("forked from a warm server")
    for name in ("worker_start", "fingerprint", "build", "reference", "warmup", "timed", "other", "task_overhead"):
        assert phases[name] >= 0, name
    assert phases["worker_start"] < 5.0  # a fork, not an interpreter's start-up and imports
    inside = sum(
        v
        for k, v in phases.items()
        if isinstance(v, float) and k not in ("worker_start", "task_overhead", "spool_read")
    )
    assert inside == pytest.approx(float(meta[b"orchestrate.job_seconds"]), rel=0.02)
    spooled = next((tmp_path / "spool").rglob("part-*.parquet"))
    assert pq.read_table(spooled).num_rows == table.num_rows  # the host's copy, kept until the head stores it


def test_fresh_interpreters_on_request(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ORCHESTRATE_FRESH_INTERPRETERS", "1")
    table = execute_job(_job(tmp_path).model_dump_json())
    phases = json.loads((table.schema.metadata or {})[META_PHASES])
    assert phases["process"] == "fresh interpreter"
    assert table.num_rows > 0


def test_a_timed_out_sample_is_ended_with_what_left_its_group(tmp_path: Path) -> None:
    # a sample process that started a helper in a session of its own (out of its process group):
    # killing the group alone would leave the helper running, holding the GPU past the job
    script = (
        "import subprocess, sys, time\n"
        "p = subprocess.Popen(['sleep', '300'], start_new_session=True)\n"
        "print(p.pid, flush=True)\n"
        "time.sleep(300)\n"
    )
    root = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, start_new_session=True)
    assert root.stdout is not None
    helper = int(root.stdout.readline())
    assert os.getpgid(helper) != os.getpgid(root.pid)
    forkserver.end_tree(root.pid)
    assert root.wait(timeout=30) == -signal.SIGKILL
    assert _gone(helper)


# ------------------------------------------------------- what one child leaves for the next: nothing


@pytest.fixture
def probe_server() -> Iterator[Callable[[dict[str, str]], forkclient.ForkServer]]:
    """Start real fork servers that also offer the test entry `probe` (tests/workers/fork_probe.py)."""
    started: list[forkclient.ForkServer] = []

    def start(env: dict[str, str]) -> forkclient.ForkServer:
        started.append(fork_probe.start_server(env, "probe"))
        return started[-1]

    yield start
    for srv in started:
        srv.close()


def _probe(
    srv: forkclient.ForkServer, tmp_path: Path, *args: str, changes: dict[str, str | None] | None = None
) -> dict[str, Any]:
    out = tmp_path / f"probe-{time.monotonic_ns()}.json"
    with (tmp_path / "probe.log").open("ab") as log:
        proc = srv.spawn("probe", [args[0], str(out), *args[1:]], env=changes or {}, stdout=log.fileno(),
                         stderr=log.fileno())  # fmt: skip
        assert proc.wait(timeout=120) == 0, (tmp_path / "probe.log").read_text()
    return json.loads(out.read_text())


def test_a_job_forked_after_another_sees_none_of_its_state(probe_server: Callable, tmp_path: Path) -> None:
    """The warm server keeps imports, never state: a second child of the same server sees no MLX
    array, memory, environment variable, phase or module global that the first one left."""
    srv = probe_server(child_env())
    assert srv.note == "mlx preloaded"
    first = _probe(srv, tmp_path, "dirty")
    assert first["env"] == "1" and first["active"] > 0 and first["kept"] == 1 and "leak" in first["phases"]
    second = _probe(srv, tmp_path, "look")
    assert second["pid"] != first["pid"]
    assert second["env"] is None and second["kept"] == 0 and "leak" not in second["phases"]
    assert second["active"] == 0 and second["peak"] == 0  # no MLX allocation ever, in the server either


def test_host_facts_are_read_once_per_server_and_per_job_facts_in_each_job(
    probe_server: Callable, tmp_path: Path
) -> None:
    """The facts that cannot change within a run (GPU name, driver, CPU, memory) come from the
    server, read when it started; the job's thread count and its own GPU are read in each job,
    and a new server (the next run) reads the facts again. (`nvidia-smi` here is a fake, as the
    machine has no NVIDIA GPU: it answers from a file.)"""
    fake = tmp_path / "bin"
    fake.mkdir()
    driver = tmp_path / "driver"
    driver.write_text("1.0")
    (fake / "nvidia-smi").write_text(
        f'#!/bin/sh\ncase "$*" in\n*--id=*) echo "NVIDIA FAKE-1, $(cat {driver})";;\n'
        f'*) echo "NVIDIA FAKE-0, $(cat {driver})";;\nesac\n'
    )
    (fake / "nvidia-smi").chmod(0o755)
    env = child_env(PATH=f"{fake}:{os.environ['PATH']}")
    srv = probe_server(env)
    assert _probe(srv, tmp_path, "fingerprint", changes={"OMP_NUM_THREADS": "3"}) == {
        "gpu": "NVIDIA FAKE-0", "driver": "1.0", "threads": 3,
    }  # fmt: skip
    driver.write_text("2.0")
    assert _probe(srv, tmp_path, "fingerprint", changes={"OMP_NUM_THREADS": "5"}) == {
        "gpu": "NVIDIA FAKE-0", "driver": "1.0", "threads": 5,
    }  # fmt: skip
    pinned = _probe(srv, tmp_path, "fingerprint", "pinned")
    assert (pinned["gpu"], pinned["driver"]) == ("NVIDIA FAKE-1", "2.0")  # the job's own GPU: read in the job
    assert _probe(probe_server(env), tmp_path, "fingerprint")["driver"] == "2.0"


def test_a_job_forked_from_the_server_imports_nothing_it_could_have_preloaded(
    probe_server: Callable, tmp_path: Path
) -> None:
    """Each module a job imports anew costs every job its import (pandas, which pyarrow imports on
    a job's first table, was 0.45 s of each trivial job): the server imports them once. Only
    kernel modules that make MLX arrays at import may be left to the job."""
    srv = probe_server(child_env())
    job = tmp_path / "job.json"
    job.write_text(_job(tmp_path).model_dump_json())
    out = _probe(srv, tmp_path, "job", str(job))
    assert out["status"] == "ok"
    assert [m for m in out["imported"] if not m.startswith("kernels.")] == []


def test_a_server_the_head_prestarted_is_adopted_for_its_key_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The embedded head starts the first node's server beside Ray's start; the Ray worker adopts
    it only for the same key, sends each job its own (the worker's) whole environment, and leaves
    the server to the head, which alone removes it."""
    from workers.job import task

    monkeypatch.setattr(task, "_server", None)
    monkeypatch.setattr(task, "_server_key", None)
    job = _job(tmp_path)
    head = task.prestart_server(job)
    assert head is not None
    try:
        assert prestart.adopt(("another code version", "1", sys.executable, "")) is None
        monkeypatch.setenv("ORCHESTRATE_SET_AFTER_THE_SERVER", "1")  # in the worker's env, not the server's
        sent: list[dict[str, Any]] = []
        spawn = forkclient.ForkServer.spawn

        def spy(self: forkclient.ForkServer, entry: str, args: list[str], **kw: Any) -> forkclient.WarmProcess:
            sent.append(kw["env"])
            return spawn(self, entry, args, **kw)

        monkeypatch.setattr(forkclient.ForkServer, "spawn", spy)
        table = execute_job(job.model_dump_json())
        phases = json.loads((table.schema.metadata or {})[META_PHASES])
        assert (table.schema.metadata or {})[b"orchestrate.job_status"] == b"ok"
        assert phases["process"].startswith("forked from a warm server (mlx preloaded, started beside Ray's start")
        assert task._server is not None and task._server.adopted and task._server.path == head.path
        assert sent and sent[0]["ORCHESTRATE_SET_AFTER_THE_SERVER"] == "1"
        assert prestart.PRESTARTED_ENV not in sent[0]  # the job's process is not told of it
        task._server.close()  # the worker's handle: the head's server stays
        assert head.server is not None and head.server.proc is not None
        assert os.path.exists(head.path) and pid_alive(head.server.proc.pid)
    finally:
        prestart.withdraw(head)
    assert not os.path.exists(os.path.dirname(head.path)) and head.server.proc.poll() is not None


def test_a_child_of_an_adopted_server_has_its_clients_whole_environment_and_no_other(tmp_path: Path) -> None:
    """A server started with another process's environment (the head's) gives a child exactly its
    client's: a key only the head had is gone, not inherited from the server. A server started with
    the client's own environment applies the changes alone, so the same key stays (the contrast)."""
    head_env = {**job_env(), FAKE_GPUS_ENV: "3"}  # the head's environment: a key the worker's lacks
    started = forkclient.ForkServer.start(head_env)
    try:
        seen = {}
        for adopted in (True, False):
            handle = forkclient.ForkServer(started.path, note=started.note, adopted=adopted)
            out = tmp_path / f"gpus-{adopted}.txt"
            with out.open("wb") as fh:
                code, how = forkclient.run_entry(
                    "workers", ["gpus", "cpu"], env=job_env(), changes={}, stdout=fh.fileno(), stderr=fh.fileno(),
                    timeout=60, server=handle,
                )  # fmt: skip
            assert code == 0 and how.startswith("forked from a warm server"), out.read_text()
            seen[adopted] = json.loads(out.read_text().strip().splitlines()[-1])
        assert seen[True] == []  # the CPU backend's GPUs: none; the head's fake ones did not reach the child
        assert [g["uuid"] for g in seen[False]] == ["fake-gpu-0", "fake-gpu-1", "fake-gpu-2"]
    finally:
        started.close()


def test_a_prestarted_server_that_did_not_start_is_not_waited_for() -> None:
    """A server that ends before it is ready (here: killed as it starts) is seen as failed at once,
    and the head's `withdraw` leaves nothing behind."""
    key = ("v", "1", sys.executable, "")
    started = prestart.launch(job_env(), key)
    deadline = time.monotonic() + 30
    while started.process is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert started.process is not None
    started.process.kill()
    try:
        t0 = time.monotonic()
        assert prestart.adopt(key, timeout=60) is None
        assert time.monotonic() - t0 < 5  # seen as failed, not waited for until the timeout
    finally:
        prestart.withdraw(started)
    assert prestart.PRESTARTED_ENV not in os.environ and not os.path.exists(os.path.dirname(started.path))


def test_a_server_still_starting_is_ended_by_withdraw() -> None:
    started = prestart.launch(job_env(), ("v", "1", sys.executable, ""))
    prestart.withdraw(started)  # at once: the head's Ray start failed
    assert started.process is None or started.process.poll() is not None
    assert not os.path.exists(os.path.dirname(started.path))
