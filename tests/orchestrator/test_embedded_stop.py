"""The embedded Ray instance leaves no process behind once it stops, whether the run waits for the
stop or reports its rows while Ray stops in a thread (`shutdown(wait=False)`, then `wait_stopped`).
Real Ray: its daemons are this process's descendants while it runs."""

from __future__ import annotations

import os
import time

import pytest

from orchestrator.run.executor import RayExecutor
from orchestrator.specs.sweep import load_inventory
from workers.proc.table import is_descendant, pid_alive, process_cmdline


def _ours() -> list[int]:
    me = os.getpid()
    return [p for p in map(int, filter(str.isdigit, os.listdir("/proc"))) if p != me and is_descendant(p, me)]


@pytest.mark.parametrize("wait", [True, False])
def test_an_embedded_instance_leaves_no_process_once_stopped(wait: bool) -> None:
    import ray

    executor = RayExecutor(load_inventory(None), gpus=[])
    executor.start()
    try:
        assert ray.get(ray.remote(num_cpus=0)(lambda: 6 * 7).remote()) == 42
        tree = _ours()
        argvs = " ".join(" ".join(process_cmdline(p)) for p in tree)
        assert "raylet" in argvs and "gcs_server" in argvs, argvs  # what must go
    finally:
        executor.shutdown(wait=wait)
        executor.wait_stopped()
    assert not ray.is_initialized()
    deadline = time.monotonic() + 10  # a daemon killed at the stop may take a moment to be reaped
    while time.monotonic() < deadline and any(pid_alive(p) for p in tree):
        time.sleep(0.1)
    left = [f"{p} {' '.join(process_cmdline(p))[:80]}" for p in tree if pid_alive(p)]
    assert not left, left
