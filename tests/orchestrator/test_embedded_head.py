"""The embedded instance's head node (`ray start --head --block` as the run's child, then joined):
started with the node's labels and slot and without the processes this instance does not need,
token-authenticated, and gone without a trace when the run stops, when its start fails, and when
it does not start in time. Real Ray throughout."""

from __future__ import annotations

import os
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from orchestrator import embedded_head
from orchestrator.auth_token import ensure_token
from orchestrator.embedded_head import EmbeddedHead
from orchestrator.errors import InfrastructureError
from orchestrator.executor import RayExecutor
from orchestrator.specs import load_inventory
from workers.processes import is_descendant, pid_alive, process_cmdline


def _tree(root: int) -> list[int]:
    return [p for p in map(int, filter(str.isdigit, os.listdir("/proc"))) if is_descendant(p, root)]


def _gone(pids: list[int], timeout: float = 10.0) -> list[int]:
    """The pids still alive after `timeout` (zombies of ours reaped meanwhile are not alive)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(pid_alive(p) for p in pids):
        time.sleep(0.1)
    return [p for p in pids if pid_alive(p)]


class Spy:
    """Records every `ray start` the head launches (the real Popen runs; `subprocess.Popen` is one
    object for every module, so other children are let through unrecorded)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.procs: list[subprocess.Popen[bytes]] = []
        real = subprocess.Popen

        def popen(*args: object, **kwargs: object) -> subprocess.Popen[bytes]:
            proc = real(*args, **kwargs)  # type: ignore[call-overload]
            if "ray.scripts.scripts" in (args[0] if args else kwargs.get("args", ())):  # not the device probe
                self.procs.append(proc)
            return proc

        monkeypatch.setattr(embedded_head.subprocess, "Popen", popen)


@pytest.fixture
def token(monkeypatch: pytest.MonkeyPatch) -> None:
    """The head's token (this test's HOME), as `RayExecutor.start` sets it up before the head starts."""
    monkeypatch.setenv("RAY_AUTH_MODE", "token")
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(ensure_token()))


def test_an_embedded_run_starts_its_head_lean_and_leaves_no_process(monkeypatch: pytest.MonkeyPatch) -> None:
    import ray

    spy = Spy(monkeypatch)
    inventory = load_inventory(None)
    host = inventory.hosts[0]
    executor = RayExecutor(inventory, gpus=[])
    executor.start()
    try:
        assert len(spy.procs) == 1
        (node,) = [n for n in ray.nodes() if n.get("Alive")]
        assert node["Resources"].get("gpu_slot") == 1.0 and node["Resources"].get("CPU") == 1.0
        assert node["Labels"]["device-kind"] == host.device and node["Labels"]["host"] == host.name
        assert executor.live_kinds() == {host.device}
        tree = _tree(spy.procs[0].pid)
        argvs = [" ".join(process_cmdline(p)) for p in tree]
        assert any("raylet" in a for a in argvs) and any("gcs_server" in a for a in argvs)
        # what `ray.init(address="local")` started and this instance does not need
        assert not [a for a in argvs if "autoscaler/_private/monitor.py" in a or "log_monitor.py" in a], argvs
        assert ray.get(ray.remote(num_cpus=0)(lambda: 6 * 7).remote()) == 42  # the node runs tasks
        log_dir = Path(executor._head._dir)  # type: ignore[union-attr]
        assert log_dir.is_dir()
    finally:
        executor.shutdown()
    assert not ray.is_initialized()
    assert _gone(tree) == [], "Ray processes outlived the run"
    assert not log_dir.exists()


@pytest.mark.usefixtures("token")
def test_a_head_that_exits_at_start_is_tried_again_then_one_error_leaving_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A label Ray refuses makes the real `ray start` exit at start (the head checks its labels
    before, so here only this test gets one past it)."""
    spy = Spy(monkeypatch)
    made: list[str] = []
    real_mkdtemp = tempfile.mkdtemp
    monkeypatch.setattr(embedded_head.tempfile, "mkdtemp", lambda **kw: made.append(real_mkdtemp(**kw)) or made[-1])
    head = EmbeddedHead()
    with pytest.raises(
        InfrastructureError, match=r"^the Ray head node exited at start \(\d+\); last lines of `ray start`: .*bad key"
    ):
        head.start({"device-kind": "cpu", "bad key!": "x"}, num_cpus=1)
    assert len(spy.procs) == embedded_head.STARTS  # once more with fresh ports
    assert all(p.poll() is not None for p in spy.procs)
    assert head.proc is None and made and not Path(made[0]).exists()


@pytest.mark.usefixtures("token")
def test_a_head_that_does_not_start_in_time_is_stopped_with_its_node(monkeypatch: pytest.MonkeyPatch) -> None:
    spy = Spy(monkeypatch)
    head = EmbeddedHead()
    with pytest.raises(InfrastructureError, match=r"^the Ray head node did not start in time; last lines of `ray st"):
        head.start({"device-kind": "cpu"}, num_cpus=1, timeout=1.5)  # Ray needs 3 s or more here
    (proc,) = spy.procs
    assert proc.poll() is not None
    assert head._dir is None
    # whatever it had started (GCS, dashboard, ...) went with its process group
    leftover = [p for p in map(int, filter(str.isdigit, os.listdir("/proc"))) if _pgid(p) == proc.pid]
    assert _gone(leftover) == []


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except OSError:
        return None


def test_free_ports_are_distinct_and_bindable() -> None:
    import socket

    ports = embedded_head.free_ports(6)
    assert len(set(ports)) == 6 and all(1024 <= p <= 65535 for p in ports)
    for port in ports:
        with socket.socket() as sock:
            sock.bind(("", port))
