"""`orchestrate run`'s start: this machine's device asked of a short-lived process, and a Ray start
that fails leaving nothing behind."""

from __future__ import annotations

import pytest

from orchestrator.cluster import localhost
from orchestrator.errors import InfrastructureError
from orchestrator.run.executor import RayExecutor
from orchestrator.specs.sweep import load_inventory


def test_local_device_asks_a_short_lived_process() -> None:
    localhost.local_device.cache_clear()
    try:
        assert localhost.local_device() == ("cpu", "cpu")  # this machine: MLX's CPU backend
    finally:
        localhost.local_device.cache_clear()


def test_a_ray_start_that_fails_is_one_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """`ray.init` is replaced by one that fails (a stand-in: a real start fails only on a broken
    machine); the error is the one-line infrastructure error."""
    import ray

    def failing_init(*args: object, **kwargs: object) -> None:
        raise RuntimeError("raylet did not start")

    monkeypatch.setattr(ray, "init", failing_init)
    inventory = load_inventory(None)
    executor = RayExecutor(inventory, gpus=[])
    with pytest.raises(InfrastructureError, match=r"^cannot start or reach Ray: raylet did not start$"):
        executor.start()
