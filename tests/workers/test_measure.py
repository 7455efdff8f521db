"""The measurement loop on real MLX with a tiny hand-made workload."""

from __future__ import annotations

import datetime as dt

import mlx.core as mx
import numpy as np
import pytest

from kernels import timing
from kernels.registry import ArmPath, Workload
from tests.workers.tiny_job import tiny_job
from workers.contract import JobContext, JobSpec, RowBuilder
from workers.host.fingerprint import host_fingerprint
from workers.job.measure import abba_order, measure_workload, relative_error


def _job(arms: list[str], reps: int = 4) -> JobSpec:
    return tiny_job(arms, reps)


def _workload(calls: list[str]) -> Workload:
    w = np.random.default_rng(0).standard_normal((8, 16)).astype(np.float32)
    wm = mx.array(w)

    def good(x: mx.array) -> mx.array:
        calls.append("good")
        return x @ wm.T

    def wrong(x: mx.array) -> mx.array:
        calls.append("wrong")
        return (x @ wm.T) * 1.1  # 10 % off: must fail a 1e-3 tolerance

    return Workload(
        arms={"good": ArmPath(good, 1e-4, "matmul"), "wrong": ArmPath(wrong, 1e-3, "matmul*1.1")},
        make_inputs=lambda rng: (mx.array(rng.standard_normal((4, 16)).astype(np.float32)),),
        reference=lambda arm, x: np.array(x, dtype=np.float64) @ w.astype(np.float64).T,
        flops=2 * 4 * 8 * 16,
        bytes_moved=4 * (8 * 16 + 4 * 16 + 4 * 8),
        tokens=4,
        unsupported={"custom": "no CUDA here"},
    )


def test_abba_alternates_direction() -> None:
    assert abba_order(["a", "b"], 0) == ["a", "b"]
    assert abba_order(["a", "b"], 1) == ["b", "a"]
    assert [abba_order(["a", "b"], r) for r in range(4)] == [["a", "b"], ["b", "a"], ["a", "b"], ["b", "a"]]


def test_relative_error_values() -> None:
    ref = np.array([3.0, 4.0])
    assert relative_error(np.array([3.0, 4.0]), ref) == 0.0
    assert abs(relative_error(np.array([3.0, 4.5]), ref) - 0.1) < 1e-12
    assert relative_error(np.array([np.nan, 4.0]), ref) == float("inf")
    assert relative_error(np.array([1.0]), ref) == float("inf")


def test_wrong_arm_fails_job_and_good_arm_is_timed() -> None:
    calls: list[str] = []
    job = _job(["good", "wrong", "custom"])
    rows = RowBuilder(job, host_fingerprint(), JobContext(started_at=dt.datetime.now(dt.UTC)))
    status = measure_workload(job, _workload(calls), rows, np.random.default_rng(1))
    assert status == "failed"
    table = rows.table(status).to_pylist()
    by = {(r["arm"], r["metric"], r["sample"]): r for r in table}
    assert by[("good", "rel_error", -1)]["status"] == "ok"
    assert by[("good", "rel_error", -1)]["value"] < 1e-5
    bad = by[("wrong", "rel_error", -1)]
    assert bad["status"] == "failed" and abs(bad["value"] - 0.1) < 1e-3
    assert "over tolerance" in bad["error"]
    # every timing row of the wrong arm is failed, so no comparison can use it
    assert {r["status"] for r in table if r["arm"] == "wrong" and r["metric"] == "seconds"} == {"failed"}
    good_secs = [r for r in table if r["arm"] == "good" and r["metric"] == "seconds"]
    assert sorted(r["sample"] for r in good_secs) == [0, 1, 2, 3]
    assert all(r["value"] > 0 for r in good_secs)
    # derived metrics agree with the sample's seconds
    for r in good_secs:
        tok = by[("good", "prefill_tok_s", r["sample"])]["value"]
        assert abs(tok - 4 / r["value"]) / tok < 1e-9
    assert by[("custom", "unsupported", -1)]["status"] == "unsupported"
    assert by[("custom", "unsupported", -1)]["error"] == "no CUDA here"


def test_arms_interleaved_in_abba_order() -> None:
    calls: list[str] = []
    job = _job(["good", "wrong"], reps=4)
    rows = RowBuilder(job, host_fingerprint(), JobContext(started_at=dt.datetime.now(dt.UTC)))
    measure_workload(job, _workload(calls), rows, np.random.default_rng(2))
    # rows are appended in the order the samples were taken
    order = [(r["arm"], r["sample"]) for r in rows.rows if r["metric"] == "seconds"]
    assert order == [
        ("good", 0),
        ("wrong", 0),
        ("wrong", 1),
        ("good", 1),
        ("good", 2),
        ("wrong", 2),
        ("wrong", 3),
        ("good", 3),
    ]
    # at least two warm-up passes, then the correctness check, before the four samples
    assert calls.count("good") >= 1 + 2 + 4


def _rows(job: JobSpec, workload: Workload, seed: int = 3) -> list[dict[str, object]]:
    rows = RowBuilder(job, host_fingerprint(), JobContext(started_at=dt.datetime.now(dt.UTC)))
    status = measure_workload(job, workload, rows, np.random.default_rng(seed))
    assert status == "ok", [r["error"] for r in rows.rows if r["error"]]
    return rows.table(status).to_pylist()


A = mx.array(np.random.default_rng(0).standard_normal((256, 256)).astype(np.float32))


def _speeds_workload(tokens: int = 4) -> Workload:
    """Two correct arms, one a hundred times slower on the device than the other."""

    def fast(x: mx.array) -> mx.array:
        return x + 0

    def slow(x: mx.array) -> mx.array:
        return x + 0 * mx.sum((A @ A) @ A)

    return Workload(
        arms={"fast": ArmPath(fast, 1e-6, "x"), "slow": ArmPath(slow, 1e-6, "x + 0 * work")},
        make_inputs=lambda rng: (mx.array(rng.standard_normal((tokens, 16)).astype(np.float32)),),
        reference=lambda arm, x: np.array(x, dtype=np.float64),
        flops=1.0,
        bytes_moved=1.0,
        tokens=tokens,
    )


def test_every_arm_of_a_job_is_timed_with_one_call_count() -> None:
    table = _rows(_job(["fast", "slow"], reps=4), _speeds_workload())
    secs = [r for r in table if r["metric"] == "seconds"]
    counts = {r["extra"] and dict(r["extra"])["calls_per_sample"] for r in secs}  # type: ignore[arg-type]
    assert len(counts) == 1  # not one count per arm
    fast = np.median([r["value"] for r in secs if r["arm"] == "fast"])
    slow = np.median([r["value"] for r in secs if r["arm"] == "slow"])
    assert slow > 5 * fast
    # decode sizes carry the Python graph cost per call as its own metric
    assert {r["arm"] for r in table if r["metric"] == "host_seconds"} == {"fast", "slow"}


def test_lazily_built_inputs_are_materialised_before_the_first_timed_sample(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each input set costs two 512^3 products to build, lazily. With one warm-up pass, the third
    set is first used by the third timed sample: unless it is built first, that sample carries it."""
    monkeypatch.setattr(timing, "WARMUP_SECONDS", 0.0)
    big = mx.array(np.random.default_rng(1).standard_normal((512, 512)).astype(np.float32))

    def lazy_inputs(rng: np.random.Generator) -> tuple[mx.array, ...]:
        x = mx.array(rng.standard_normal((4, 16)).astype(np.float32))
        return (x + 0 * mx.sum((big @ big) @ big),)

    workload = _speeds_workload()
    workload.arms = {"fast": workload.arms["fast"]}
    workload.make_inputs = lazy_inputs
    job = _job(["fast"], reps=6)
    table = _rows(job.model_copy(update={"warmup": 1}), workload)
    secs = [float(r["value"]) for r in table if r["metric"] == "seconds"]  # type: ignore[arg-type]
    assert max(secs) < 50 * float(np.median(secs)), secs


def test_cache_state_is_an_explicit_recorded_choice() -> None:
    from kernels import qmm

    params = {"tokens": 2, "n": 32, "k": 64, "dtype": "float32"}
    cold = _job(["native", "dense"], reps=2).model_copy(update={"params": params})
    hot = cold.model_copy(update={"options": {"cache": "hot"}})
    for job, want in ((cold, {"cold", "warm"}), (hot, {"hot"})):
        workload = qmm.build(params, ["native", "dense"], np.random.default_rng(0))
        extras = [dict(r["extra"]) for r in _rows(job, workload) if r["metric"] == "seconds"]  # type: ignore[arg-type]
        assert {e["cache"] for e in extras} <= want and {e["cache_requested"] for e in extras} == {
            job.options.get("cache", "cold")
        }
        for e in extras:  # cold: the copies the device's cache asks for, and the state they reach
            copies, nbytes, llc = int(e["weight_copies"]), int(e["weight_bytes"]), int(e["llc_bytes"])
            if job is hot:
                assert copies == 1
            else:
                assert copies == timing.weight_copies(nbytes, timing.Method(llc_bytes=llc))
                assert e["cache"] == ("cold" if copies * nbytes >= 2 * llc else "warm")
        assert all(int(e["weight_bytes"]) > 0 and int(e["llc_bytes"]) > 0 for e in extras)


def _peaks(arms: list[str]) -> dict[str, float]:
    from kernels import qmm

    params = {"tokens": 4, "n": 64, "k": 128, "dtype": "float32"}
    job = _job(arms, reps=1).model_copy(update={"params": params})
    workload = qmm.build(params, arms, np.random.default_rng(0))
    return {str(r["arm"]): float(r["value"]) for r in _rows(job, workload) if r["metric"] == "peak_memory_bytes"}  # type: ignore[arg-type]


def test_adding_an_arm_does_not_change_another_arms_peak_memory() -> None:
    two = _peaks(["native", "affine"])
    three = _peaks(["native", "affine", "dense"])
    assert two["native"] == three["native"] and two["affine"] == three["affine"]
    # each peak is its own: native's packed codes + E4M3 scales + x + y, affine's codes + scales + biases
    io = 4 * 128 * 4 + 4 * 64 * 4
    assert 64 * 128 // 2 + 64 * 8 + io <= two["native"] <= 64 * 128 // 2 + 64 * 8 + 2 * io + 4096
    assert two["affine"] - two["native"] == pytest.approx(64 * 2 * 4 * 2 - 64 * 8, abs=512)
    assert three["dense"] > two["native"]  # dense float32 weights: 32 KiB


def test_auto_is_chosen_with_the_jobs_call_count_and_matches_its_measurement() -> None:
    from kernels import dispatch

    workload = _speeds_workload()
    auto = dispatch.auto_path(
        ("t",), dict(workload.arms), workload.make_inputs, lambda name, x: np.array(x, dtype=np.float64)
    )
    workload.arms = {**workload.arms, "auto": auto}
    table = _rows(_job(["fast", "slow", "auto"], reps=4), workload)
    secs = [r for r in table if r["metric"] == "seconds"]
    calls = {dict(r["extra"])["calls_per_sample"] for r in secs}  # type: ignore[arg-type]
    (route,) = {r["route"] for r in secs if r["arm"] == "auto"}
    assert str(route).startswith("auto:fast[x]") and f"x {calls.pop()} calls" in str(route)
    medians = {a: np.median([r["value"] for r in secs if r["arm"] == a]) for a in ("fast", "slow")}
    assert min(medians, key=lambda a: medians[a]) == "fast"
