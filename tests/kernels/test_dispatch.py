"""The `auto` arm's choice (`kernels.dispatch`) on real MLX: checked candidates, chosen by the
measurement's own method, the evidence in the route."""

from __future__ import annotations

import time
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

from kernels import dispatch, timing
from kernels.registry import ArmPath, AutoSpec

A = mx.array(np.random.default_rng(0).standard_normal((384, 384)).astype(np.float32))


def ones(x: mx.array) -> mx.array:
    return x * 0 + 1


def device_heavy(x: mx.array) -> mx.array:
    """Ones, after two 384^3 products on the device (milliseconds on MLX's CPU backend)."""
    return x * 0 + 1 + 0 * mx.sum((A @ A) @ A)


def host_heavy(x: mx.array) -> mx.array:
    """Ones, after 20 ms in Python building the graph (nothing on the device)."""
    time.sleep(0.02)
    return x * 0 + 1


def spec(candidates: dict[str, ArmPath]) -> AutoSpec:
    return AutoSpec(
        ("test", len(candidates)),
        candidates,
        lambda name, x: np.ones(x.shape),
        lambda rng: (mx.array(rng.standard_normal((2, 3)).astype(np.float32)),),
    )


POOL = [(mx.ones((2, 3)),), (mx.full((2, 3), 2.0),), (mx.full((2, 3), 3.0),)]
FAST = timing.Method(llc_bytes=2**20, warmup_seconds=0.05)


def test_calibrate_picks_the_fastest_correct_path_and_rejects_wrong_ones() -> None:
    candidates = {
        "slow": ArmPath(device_heavy, 1e-6, "slow-route"),
        "fast-but-wrong": ArmPath(lambda x: x * 0 + 2, 1e-6, "wrong"),
        "fast": ArmPath(ones, 1e-6, "fast-route"),
        "raises": ArmPath(lambda x: 1 / 0, 1.0, "boom"),
    }
    choice = dispatch.calibrate(spec(candidates), POOL, FAST)
    assert choice.chosen == "fast"
    assert set(choice.seconds) == {"slow", "fast"} and choice.seconds["slow"] > 3 * choice.seconds["fast"]
    assert "over tolerance" in choice.rejected["fast-but-wrong"]
    assert "ZeroDivisionError" in choice.rejected["raises"]
    route = choice.describe("fast-route")
    assert route.startswith("auto:fast[fast-route] fast=") and "fast-but-wrong:rejected" in route
    assert route.endswith(f"({dispatch.AUTO_SAMPLES} samples x {choice.calls} calls, unrotated)")


def test_the_choice_is_made_on_device_time_as_the_measurement_times_it() -> None:
    """A path whose Python graph costs 20 ms but whose device work is nothing beats one with
    milliseconds of device work: the measurement times evaluation, not graph building (the old
    calibration, with Python inside the clock, chose the other)."""
    candidates = {"host-heavy": ArmPath(host_heavy, 1e-6, "H"), "device-heavy": ArmPath(device_heavy, 1e-6, "D")}
    choice = dispatch.calibrate(spec(candidates), POOL, FAST)
    assert choice.chosen == "host-heavy", choice.seconds


def test_candidates_are_interleaved_and_every_input_set_is_used() -> None:
    seen: list[tuple[str, float]] = []

    def recording(name: str) -> ArmPath:
        def run(x: mx.array) -> mx.array:
            seen.append((name, float(x[0, 0].item())))
            return x * 0 + 1

        return ArmPath(run, 1e-6, name)

    timers = {n: timing.ArmTimer(recording(n), FAST) for n in ("a", "b")}
    dispatch.choose(timers, POOL, 1, {}, samples=4)
    assert [n for n, _ in seen] == ["a", "b", "b", "a", "a", "b", "b", "a"]  # ABBA
    assert {v for _, v in seen} == {1.0, 2.0, 3.0}  # rotated input sets


def test_without_a_correct_candidate_there_is_no_choice() -> None:
    with pytest.raises(ValueError, match="no correct candidate"):
        dispatch.calibrate(spec({"bad": ArmPath(lambda x: x * 0 + 3, 1e-6, "bad")}), POOL, FAST)


def test_outside_a_job_the_arm_resolves_once_per_key() -> None:
    dispatch.forget_choices()
    calls = {"n": 0}

    def make_inputs(rng: np.random.Generator) -> tuple[mx.array, ...]:
        calls["n"] += 1
        return (mx.ones((1, 2)),)

    cands = {"a": ArmPath(ones, 1e-6, "A")}
    first = dispatch.auto_path(("k", 1), cands, make_inputs, lambda n, x: np.ones((1, 2)))
    second = dispatch.auto_path(("k", 1), cands, make_inputs, lambda n, x: np.ones((1, 2)))
    assert first.route == "auto(unresolved)" and first.auto is not None
    out: Any = first.run(mx.ones((1, 2)))
    second.run(mx.ones((1, 2)))
    assert np.array_equal(np.array(out), np.ones((1, 2)))
    assert calls["n"] == dispatch.STANDALONE_INPUTS  # one calibration for both
    assert dispatch.resolve_standalone(first.auto).route.startswith("auto:a[A]")
    dispatch.forget_choices()
