"""The measurement loop on real MLX with a tiny hand-made workload."""

from __future__ import annotations

import datetime as dt

import mlx.core as mx
import numpy as np

from kernels.registry import ArmPath, Workload
from workers.contract import JobContext, JobSpec, LockSettings, RowBuilder
from workers.fingerprint import host_fingerprint
from workers.measure import abba_order, measure_workload, relative_error


def _job(arms: list[str], reps: int = 4) -> JobSpec:
    return JobSpec(
        run_id="r",
        sweep="t",
        job_key="k",
        case="qmm",
        case_name="qmm",
        params={"tokens": 4, "n": 8, "k": 16},
        arms=arms,
        device="cpu",
        repetitions=reps,
        warmup=1,
        lock=LockSettings(enabled=False),
    )


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
    # correctness check, then at least two warm-up passes, before the four samples
    assert calls.count("good") >= 1 + 2 + 4
