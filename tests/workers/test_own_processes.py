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
from workers.own_processes import OwnProcesses, own_processes

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
        own = OwnProcesses(roots=(os.getpid(),), session_dir=b"/tmp/ray/session_2026-12-01_00-00-00_000000_1")
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
    assert own.roots == (os.getpid(),) and own.session_dir is None
    assert not own.contains(os.getppid())  # whoever started us is not ours
