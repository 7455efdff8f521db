"""`orchestrate run`'s start: the device probe started beside the CLI's imports, and a Ray start
that fails leaving nothing behind (the fork server the head started beside it included)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from orchestrator.cli import early_probe
from orchestrator.cluster import localhost
from orchestrator.errors import InfrastructureError
from orchestrator.run.executor import RayExecutor
from orchestrator.specs.sweep import load_inventory
from tests.conftest import REPO, child_env
from workers.contract import JobSpec, LockSettings
from workers.job import task
from workers.proc import prestart
from workers.proc.prestart import Prestarted
from workers.proc.table import pid_alive


@pytest.mark.parametrize(
    ("args", "early"),
    [
        (["run"], True),
        (["run", "--sweep", "smoke", "--force"], True),
        (["run", "--inventory", "h200.toml"], False),
        (["run", "-i", "h200.toml"], False),
        (["run", "--inventory=h200.toml"], False),
        (["run", "--help"], False),
        (["plan", "--sweep", "smoke"], False),
        ([], False),
    ],
)
def test_the_probe_starts_early_only_for_a_run_on_the_default_inventory(args: list[str], early: bool) -> None:
    assert early_probe(args) is early


def test_the_early_probe_is_the_answer_local_device_reads() -> None:
    localhost.local_device.cache_clear()
    try:
        localhost.probe_early()
        proc = localhost._early
        assert proc is not None
        assert localhost.local_device() == ("cpu", "cpu")  # this machine: MLX's CPU backend
        assert localhost._early is None and proc.returncode == 0  # read, not started twice
    finally:
        localhost.local_device.cache_clear()


def test_an_early_probe_nobody_read_ends_with_the_command() -> None:
    code = "from orchestrator import localhost; localhost.probe_early(); print(localhost._early.pid, flush=True)"
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=child_env(), capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr
    pid = int(done.stdout.split()[0])
    deadline = time.monotonic() + 10
    while pid_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not pid_alive(pid)


def test_a_ray_start_that_fails_is_one_error_and_ends_the_prestarted_fork_server(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`ray.init` is replaced by one that fails (a stand-in: a real start fails only on a broken
    machine); the error is the one-line infrastructure error, and the fork server the head started
    for the first node beside it is gone, with its socket directory."""
    import ray

    def failing_init(*args: object, **kwargs: object) -> None:
        raise RuntimeError("raylet did not start")

    started: list[Prestarted] = []
    real = task.prestart_server

    def spy(job: JobSpec) -> Prestarted | None:
        server = real(job)
        started.extend([server] if server else [])
        return server

    monkeypatch.setattr(ray, "init", failing_init)
    monkeypatch.setattr(task, "prestart_server", spy)
    monkeypatch.delenv(prestart.PRESTARTED_ENV, raising=False)
    inventory = load_inventory(None)
    job = JobSpec(
        run_id="r", sweep="s", job_key="k", case="qmm", case_name="qmm", params={"tokens": 1}, arms=["native"],
        device=inventory.hosts[0].device, repetitions=1, warmup=0, lock=LockSettings(path=str(tmp_path / "gpu.lock")),
    )  # fmt: skip
    executor = RayExecutor(inventory, gpus=[], first_job=job)
    with pytest.raises(InfrastructureError, match=r"^cannot start or reach Ray: raylet did not start$"):
        executor.start()
    assert len(started) == 1  # it was started beside the failed start
    server = started[0]
    assert server.process is None or server.process.poll() is not None
    assert not os.path.exists(os.path.dirname(server.path))
    assert prestart.PRESTARTED_ENV not in os.environ
