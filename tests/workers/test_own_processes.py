"""The probes know the orchestrator's own processes (head, Ray's daemons, the job) and nothing else.

With real Ray started as `orchestrate run` starts it, a busy head, and a busy foreign process that
this test starts outside the head's tree: every probe (the CPU-quiet gate for real; the KFD list
and nvidia-smi through small fakes, as no AMD or NVIDIA GPU is here) calls exactly the foreign one
foreign.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, child_env
from workers.lock.own_processes import OwnProcesses, own_processes

pytestmark = pytest.mark.slow

BUSY = "import time\nend = time.monotonic() + 120\nwhile time.monotonic() < end: pass\n"


def test_head_and_ray_daemons_are_ours_a_busy_stranger_is_not(tmp_path: Path) -> None:
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    stranger = subprocess.Popen([sys.executable, "-c", BUSY])
    try:
        done = subprocess.run(
            [sys.executable, "-m", "tests.workers.probe_head", str(stranger.pid), str(fake_bin)],
            cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=300,
        )  # fmt: skip
    finally:
        stranger.kill()
        stranger.wait()
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["head"] in got["ours"] and len(got["ours"]) >= 4  # head, raylet, GCS, the task's worker...
    assert got["kfd"] == [stranger.pid]
    assert got["nvidia_smi"] == [stranger.pid]
    assert stranger.pid in got["cpu"]  # spinning: over the 5 % threshold even on a loaded machine
    assert not set(got["cpu"]) & set(got["ours"])  # the spinning head and Ray's daemons are not foreign


def test_a_process_outside_every_root_is_foreign_whatever_its_name(tmp_path: Path) -> None:
    fake = tmp_path / "raylet"  # named like Ray's daemon, but started by nobody of ours
    fake.write_text(f"#!{sys.executable}\nimport time\ntime.sleep(60)\n")
    fake.chmod(0o755)
    # started through a shell that exits at once: it is reparented away from this test's tree
    pid = int(subprocess.run(["sh", "-c", f"{fake} >/dev/null 2>&1 & echo $!"], capture_output=True, text=True).stdout)
    try:
        own = OwnProcesses(roots=(os.getpid(),), session="session_2026-12-01_00-00-00_000000_1")
        assert not own.contains(pid)
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        try:
            assert own.contains(child.pid)  # a descendant of a root is ours
        finally:
            child.kill()
            child.wait()
    finally:
        os.kill(pid, 9)


def test_outside_ray_only_the_job_tree_is_ours(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RAY_RAYLET_PID", raising=False)
    own = own_processes(os.getpid())
    assert own.roots == (os.getpid(),) and own.session is None
    assert not own.contains(os.getppid())  # whoever started us is not ours


def _stranger(tmp_path: Path, *args: str) -> int:
    """A sleeping process outside this test's tree (its shell exits at once), with `args` in its command line."""
    script = tmp_path / "sleeper.py"
    script.write_text("import time\ntime.sleep(60)\n")
    quoted = " ".join(f"'{a}'" for a in args)
    out = subprocess.run(["sh", "-c", f"{sys.executable} {script} {quoted} >/dev/null 2>&1 & echo $!"],
                         capture_output=True, text=True)  # fmt: skip
    return int(out.stdout)


def test_daemons_of_our_ray_session_are_ours_on_any_node(tmp_path: Path) -> None:
    """A head or another node on this host runs its daemons under the cluster's one session name."""
    ours = _stranger(tmp_path, "--log_dir=/var/tmp/node-b/session_2026-12-01_10-00-00_123456_42/logs")
    other = _stranger(tmp_path, "--log_dir=/tmp/ray/session_2026-12-01_11-11-11_654321_7/logs")
    try:
        own = OwnProcesses(roots=(os.getpid(),), session="session_2026-12-01_10-00-00_123456_42")
        assert own.contains(ours)
        assert not own.contains(other)  # another cluster's Ray on the same host is foreign
    finally:
        os.kill(ours, 9)
        os.kill(other, 9)


def test_the_head_named_for_this_host_is_ours(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import socket

    head = _stranger(tmp_path)
    try:
        monkeypatch.setenv("ORCHESTRATE_HEAD", f"{socket.gethostname()}:{head}")
        assert own_processes(os.getpid()).contains(head)
        monkeypatch.setenv("ORCHESTRATE_HEAD", f"another-host.example:{head}")  # the same pid elsewhere
        assert not own_processes(os.getpid()).contains(head)
    finally:
        os.kill(head, 9)
