"""The timing method (`kernels.timing`) on real MLX at tiny sizes: what the clock covers, one call
count, weights rotated for a cold cache, a warm-up measured in time."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

from kernels import timing
from kernels.registry import ArmPath, bound_path
from kernels.timing import ArmTimer, Method, Sample

X = (mx.ones((4, 16)),)


def _address(a: mx.array) -> int:
    """Where an (evaluated, CPU-visible) array's buffer lives."""
    return int(np.asarray(memoryview(a)).ctypes.data)


def test_the_python_graph_is_built_before_the_clock_and_kept_as_host_cost() -> None:
    """A path that spends 5 ms in Python per call but almost nothing on the device: its time is
    the device's, its graph cost is recorded apart. Timed together, each call would read >= 5 ms."""

    def run(x: mx.array) -> mx.array:
        time.sleep(0.005)
        return x + 1

    timer = ArmTimer(ArmPath(run, 1e-6, "sleepy"), Method(llc_bytes=2**20))
    sample = timer.sample(X, 4)
    assert sample.host_seconds >= 0.005
    assert sample.seconds < sample.host_seconds / 3


def _recording_path(nbytes: int, used: list[int]) -> ArmPath:
    w = mx.array(np.arange(nbytes // 4, dtype=np.float32))
    mx.eval(w)

    def make(weights: tuple[Any, ...]) -> Callable[[mx.array], mx.array]:
        (wc,) = weights

        def run(x: mx.array) -> mx.array:
            used.append(_address(wc))
            return x + wc[:16]

        return run

    return bound_path(make, (w,), tolerance=1e-6, route="x + w")


def test_cold_rotates_the_weights_over_distinct_copies_call_by_call() -> None:
    used: list[int] = []
    path = _recording_path(4096, used)
    timer = ArmTimer(path, Method(cache="cold", llc_bytes=16 * 2**10))
    assert timer.copies == 16  # ceil(4 x 16 KiB / 4 KiB)
    buffers = [_address(a) for a in timer.arrays]
    assert len(set(buffers)) == 16  # real copies, not views of one buffer
    for copy in timer.arrays:
        assert np.array_equal(np.array(copy), np.array(path.weights[0]))
    timer.sample(X, 20)
    timer.sample(X, 8)
    assert used == [buffers[i % 16] for i in range(28)]  # call by call, continuing across samples
    outs = {np.array(run(X[0])).tobytes() for run in timer.runs}
    assert len(outs) == 1  # every copy computes the same output
    assert timer.record() == {"cache": "cold", "weight_copies": "16", "weight_bytes": "4096", "llc_bytes": "16384"}


def test_hot_reuses_one_buffer_and_capped_copies_say_warm() -> None:
    used: list[int] = []
    hot = ArmTimer(_recording_path(4096, used), Method(cache="hot", llc_bytes=16 * 2**10))
    assert hot.copies == 1 and hot.cache == "hot"
    # 24 KiB against a 1 MiB cache: 64 copies (the cap, 1.5 MiB) pass the cache but not twice it
    warm = ArmTimer(_recording_path(24 * 2**10, used), Method(cache="cold", llc_bytes=2**20))
    assert warm.copies == timing.MAX_COPIES and warm.cache == "warm"
    # 1 KiB against 1 MiB: even 64 copies stay resident together, so none is made (one, warm)
    resident = ArmTimer(_recording_path(1024, used), Method(cache="cold", llc_bytes=2**20))
    assert resident.copies == 1 and resident.cache == "warm"
    undeclared = ArmTimer(ArmPath(lambda x: x + 1, 1e-6, "no weights"), Method(llc_bytes=2**20))
    assert undeclared.copies == 1 and undeclared.cache == "unrotated"


@pytest.mark.parametrize(
    ("nbytes", "copies"),
    [
        (58_000_000, 5),
        (231_000_000, 2),
        (400_000_000, 1),
        (2_000_000, timing.MAX_COPIES),  # 128 MB: cold
        (1_000_000, 64),  # 64 MB: past the cache, not twice it (warm)
        (900_000, 1),  # 57.6 MB: 64 copies would all fit: none made
        (2_000, 1),
    ],
)
def test_copies_at_the_h200s_60_mb_l2(nbytes: int, copies: int) -> None:
    """The seeds' GEMV weights (58 MB NVFP4, 231 MB dense bf16) and an MoE's 400 MB of experts."""
    assert timing.weight_copies(nbytes, Method(llc_bytes=60_000_000)) == copies
    assert timing.weight_copies(nbytes, Method(cache="hot", llc_bytes=60_000_000)) == 1


def test_one_call_count_for_every_arm() -> None:
    method = Method(llc_bytes=2**20)
    assert timing.common_calls({"gemv": 20e-6, "dense": 60e-6}, method) == 64  # 2 ms over 20 us, capped
    assert timing.common_calls({"fast": 1e-4, "slow": 2e-3}, method) == 20
    assert timing.common_calls({"fast": 1e-4, "very slow": 0.2}, method) == 1  # the slow arm's sample stays short


class ScriptedTimer:
    """A stand-in for `ArmTimer` whose samples take the times a test scripts (no device)."""

    def __init__(self, times: list[float]) -> None:
        self.times = iter(times)
        self.copies = 3
        self.calls: list[int] = []

    def sample(self, inputs: tuple[Any, ...], calls: int) -> Sample:
        self.calls.append(calls)
        return Sample(next(self.times), 0.0)


def test_calibration_takes_the_median_of_the_later_passes_not_the_last_call() -> None:
    timer = ScriptedTimer([1.0, 0.01, 0.01, 0.01, 0.5])
    estimates, errors = timing.warm_up({"a": timer}, [X], Method(llc_bytes=2**20, warmup_seconds=0.0, warmup_passes=4))  # type: ignore[dict-item]
    assert errors == {} and estimates == {"a": 0.01}
    assert timer.calls[0] == 3  # the first pass touches every weight copy once


def test_warm_up_lasts_long_enough_in_time() -> None:
    count = {"n": 0}

    def run(x: mx.array) -> mx.array:
        count["n"] += 1
        return x + 1

    timers = {"a": ArmTimer(ArmPath(run, 1e-6, "x+1"), Method(llc_bytes=2**20))}
    t0 = time.perf_counter()
    estimates, _ = timing.warm_up(timers, [X], Method(llc_bytes=2**20, warmup_seconds=0.3, warmup_passes=1))
    assert time.perf_counter() - t0 >= 0.3
    assert count["n"] > 2 and estimates["a"] > 0  # far more than one call per warm-up pass


def test_a_path_that_raises_is_reported_and_the_others_go_on() -> None:
    timers = {
        "ok": ArmTimer(ArmPath(lambda x: x + 1, 1e-6, "x+1"), Method(llc_bytes=2**20)),
        "boom": ArmTimer(ArmPath(lambda x: 1 / 0, 1e-6, "boom"), Method(llc_bytes=2**20)),
    }
    estimates, errors = timing.warm_up(timers, [X], Method(llc_bytes=2**20, warmup_seconds=0.0))
    assert set(estimates) == {"ok"} and errors["boom"].startswith("ZeroDivisionError")


def test_the_last_level_cache_is_read_from_the_device() -> None:
    llc = timing.last_level_cache_bytes()
    if mx.default_device() == mx.cpu and timing._cpu_llc_bytes() is not None:
        assert llc == timing._cpu_llc_bytes()
    assert 2**20 <= llc <= 2**31
    with pytest.raises(ValueError, match="cache 'tepid'"):
        Method(cache="tepid")


@pytest.mark.cuda
@pytest.mark.skipif(not mx.cuda.is_available(), reason="needs MLX's CUDA backend (an NVIDIA GPU)")
def test_the_cuda_l2_comes_from_the_driver() -> None:
    """Read through libcuda: 50-64 MB on Hopper cards, within these bounds on other NVIDIA GPUs."""
    l2 = timing._cuda_l2_bytes()
    assert l2 is not None and 40e6 <= l2 <= 130e6
    assert timing.last_level_cache_bytes() == l2
