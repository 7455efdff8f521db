"""The fork server: jobs forked with imports done, killed on timeout or when their client goes,
ended with the server's parent; and the Ray task body uses it (phases and rows say so)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest

from tests.conftest import REPO, child_env
from tests.workers import fork_probe
from workers.contract import META_JOB_SECONDS, META_JOB_STATUS, META_PHASES, JobSpec, LockSettings
from workers.job.task import execute_job, job_env
from workers.proc import forkserver, preload
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
    assert code == 0 and how.startswith("forked from a fork server (mlx preloaded")
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
    monkeypatch.setattr(preload, "DEVICE_FILES", ("/dev/null",))
    fd = os.open("/dev/null", os.O_RDONLY)
    try:
        assert "/dev/null" in preload.device_files_open()
    finally:
        os.close(fd)


def test_the_ray_task_body_forks_the_job_and_records_its_phases(tmp_path: Path) -> None:
    table = execute_job(_job(tmp_path).model_dump_json())
    meta = table.schema.metadata or {}
    assert meta[META_JOB_STATUS] == b"ok"
    phases = json.loads(meta[META_PHASES])
    assert phases["process"].startswith("forked from a fork server")
    for name in ("worker_start", "fingerprint", "build", "reference", "warmup", "timed", "other", "task_overhead"):
        assert phases[name] >= 0, name
    assert phases["worker_start"] < 5.0  # a fork, not an interpreter's start-up and imports
    inside = sum(
        v
        for k, v in phases.items()
        if isinstance(v, float) and k not in ("worker_start", "task_overhead", "spool_read")
    )
    assert inside == pytest.approx(float(meta[META_JOB_SECONDS]), rel=0.02)
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
    """The fork server keeps imports, never state: a second child of the same server sees no MLX
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


# ------------------------------------------------------------ forks from a single-threaded server only


def _threads(pid: int) -> list[str]:
    return sorted(Path(f"/proc/{pid}/task/{t}/comm").read_text().strip() for t in os.listdir(f"/proc/{pid}/task"))


def _start_raw(tmp_path: Path, code: str, mode: str, python: str = sys.executable, *flags: str) -> subprocess.Popen:
    """A server process started by `code` (which ends in `forkserver.main`), its stderr in tmp_path/server.err."""
    path = os.path.join(tempfile.mkdtemp(prefix="orchestrate-fork-test-"), "socket")  # short: AF_UNIX limit
    with (tmp_path / "server.err").open("wb") as err:
        return subprocess.Popen(
            [python, *flags, "-c", code, path, mode], cwd=REPO, env=child_env(PYTHONPATH=str(REPO)),
            stdout=subprocess.PIPE, stderr=err, text=True,
        )  # fmt: skip


def test_the_server_runs_one_thread_while_it_serves(server: forkclient.ForkServer, tmp_path: Path) -> None:
    """Every preloaded module included (NumPy's BLAS pool, Arrow's allocator), the server forks jobs
    with one thread: the thread count CPython 3.12+ checks for its fork warning, here and in /proc."""
    job = tmp_path / "job.json"
    job.write_text(_job(tmp_path).model_dump_json())
    with (tmp_path / "log").open("wb") as fh:
        code, how = forkclient.run_entry(
            "workers", ["run", str(job), "--out", str(tmp_path / "o.parquet")], env={}, changes={},
            stdout=fh.fileno(), stderr=fh.fileno(), timeout=120, server=server,
        )  # fmt: skip
    assert code == 0 and how.startswith("forked from a fork server (mlx preloaded"), (tmp_path / "log").read_text()
    assert server.proc is not None and len(_threads(server.proc.pid)) == 1, _threads(server.proc.pid)


def test_a_server_with_a_thread_refuses_to_start(tmp_path: Path) -> None:
    """A thread running in the server when it forks (here one started before `main`) makes it refuse
    to serve: `ForkServer.start` then tries the next preload mode, and at the last its callers
    start fresh interpreters."""
    code = (
        "import sys, threading; from workers.proc import forkserver; "
        "threading.Thread(target=threading.Event().wait, daemon=True).start(); "
        "sys.exit(forkserver.main(sys.argv[1:]))"
    )
    proc = _start_raw(tmp_path, code, "none")
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "unsafe: the fork server had 2 threads when it forked"
    assert proc.wait(timeout=60) == 3


def test_a_thread_that_appears_in_a_serving_server_ends_it(tmp_path: Path) -> None:
    """A thread started in the server after its start (here: once the first child is reaped) makes
    the next fork refuse: that child is killed, the server ends, and the client's job runs in a fresh
    interpreter instead."""
    code = (
        "import sys, threading; from workers.proc import forkserver; reap = forkserver._reap\n"
        "def _reap(clients, conns):\n"
        "    had = len(clients)\n"
        "    reap(clients, conns)\n"
        "    if had and not clients and threading.active_count() == 1:\n"
        "        threading.Thread(target=threading.Event().wait, daemon=True).start()\n"
        "forkserver._reap = _reap\n"
        "sys.exit(forkserver.main(sys.argv[1:]))"
    )
    proc = _start_raw(tmp_path, code, "none")
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line.startswith("ready"), line
    srv = forkclient.ForkServer(proc.args[-2], proc, line.split(" ", 3)[-1].strip())
    try:
        hows = []
        with (tmp_path / "log").open("wb") as fh:
            for _ in range(2):
                code_, how = forkclient.run_entry(
                    "workers", ["--help"], env=job_env(), changes={}, stdout=fh.fileno(), stderr=fh.fileno(),
                    timeout=60, server=srv,
                )  # fmt: skip
                assert code_ == 0
                hows.append(how)
        assert hows[0].startswith("forked from a fork server") and hows[1] == "fresh interpreter"
        assert proc.wait(timeout=30) != 0
        assert "ThreadedFork: the fork server had 2 threads when it forked" in (tmp_path / "server.err").read_text()
    finally:
        srv.close()


def _python_312_with_the_servers_imports() -> str | None:
    """An interpreter of Python 3.12 or later (where CPython warns of a multi-threaded fork) that
    can import what the server preloads: this one, the one `tests/setup-py312.sh` made, or a
    `python3.1x` on PATH."""
    candidates = [sys.executable] if sys.version_info >= (3, 12) else []
    candidates += [str(made)] if (made := REPO / ".venv312" / "bin" / "python").exists() else []
    candidates += [p for v in ("3.14", "3.13", "3.12") if (p := shutil.which(f"python{v}"))]
    check = "import numpy, pyarrow, pydantic, mlx.core; import workers.proc.forkserver"
    for python in candidates:
        done = subprocess.run([python, "-c", check], cwd=REPO, env=child_env(PYTHONPATH=str(REPO)),
                              capture_output=True, timeout=120)  # fmt: skip
        if done.returncode == 0:
            return python
    return None


def test_python_312_sees_no_multi_threaded_fork(tmp_path: Path) -> None:
    """Under Python 3.12+ the server and the job it forks raise no `DeprecationWarning: This process
    ... is multi-threaded, use of fork() may lead to deadlocks in the child`. (CPython swallows that
    warning under `-W error`, so `-W always` shows it on the server's stderr instead.)"""
    python = _python_312_with_the_servers_imports()
    if python is None:
        pytest.skip("no Python 3.12+ here that can import numpy, pyarrow, pydantic and mlx (the venv is older)")
    code = "import sys; from workers.proc import forkserver; sys.exit(forkserver.main(sys.argv[1:]))"
    proc = _start_raw(tmp_path, code, "mlx", python, "-W", "always::DeprecationWarning")
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line.startswith("ready"), (tmp_path / "server.err").read_text()
    srv = forkclient.ForkServer(proc.args[-2], proc, line.split(" ", 3)[-1].strip())
    try:
        with (tmp_path / "log").open("wb") as fh:
            code_, how = forkclient.run_entry(
                "workers", ["device"], env=job_env(), changes={}, stdout=fh.fileno(), stderr=fh.fileno(),
                timeout=120, server=srv,
            )  # fmt: skip
        assert code_ == 0 and how.startswith("forked from a fork server"), (tmp_path / "log").read_text()
    finally:
        srv.close()
    assert "multi-threaded" not in (tmp_path / "server.err").read_text()
