"""The reference computed on a thread beside the warm-up, and the check after the warm-up (real MLX)."""

from __future__ import annotations

import dataclasses
import datetime as dt
import threading
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

from kernels import device_nvfp4, dispatch, qmm
from kernels.registry import ArmPath, Workload
from workers.contract import JobContext, JobSpec, LockSettings, RowBuilder
from workers.host.fingerprint import host_fingerprint
from workers.job.measure import measure_workload
from workers.job.reference_ahead import THREAD_NAME, ReferenceAhead

QMM = {"tokens": 4, "n": 32, "k": 64, "dtype": "float32"}


def _job(arms: list[str], params: dict[str, Any], case: str = "qmm", reps: int = 2) -> JobSpec:
    return JobSpec(
        run_id="r",
        sweep="t",
        job_key="k",
        case=case,
        case_name=case,
        params=params,
        arms=arms,
        device="cpu",
        repetitions=reps,
        warmup=1,
        lock=LockSettings(enabled=False),
    )


def _measure(job: JobSpec, workload: Workload, seed: int = 3) -> tuple[str, list[dict[str, Any]]]:
    rows = RowBuilder(job, host_fingerprint(), JobContext(started_at=dt.datetime.now(dt.UTC)))
    status = measure_workload(job, workload, rows, np.random.default_rng(seed))
    return status, rows.table(status).to_pylist()


def _ours() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith(THREAD_NAME)]


def test_qmm_offers_its_reference_ahead_and_it_equals_the_synchronous_one() -> None:
    arms = ["native", "affine", "dense", "auto"]
    x = mx.array(np.random.default_rng(5).standard_normal((4, 64)).astype(np.float32))
    ahead = qmm.build(QMM, arms, np.random.default_rng(0))
    sync = qmm.build(QMM, arms, np.random.default_rng(0))
    assert ahead.prepare_reference is not None
    with ReferenceAhead(ahead, arms, (x,)) as job:
        assert job.started
    for arm in arms:
        np.testing.assert_array_equal(np.asarray(ahead.reference(arm, x)), np.asarray(sync.reference(arm, x)))
    assert ahead.reference("native", x) is ahead.reference("dense", x)  # still one product per matrix


def test_rows_are_the_same_with_the_reference_ahead_or_synchronous() -> None:
    """The smoke shape of qmm: every arm's rel_error row is the same number either way, every row ok."""
    params = {"tokens": 32, "n": 256, "k": 512, "dtype": "float32"}
    arms = ["native", "affine", "dequant-gemm", "dense", "custom", "auto"]
    job = _job(arms, params)
    tables = {}
    for ahead in (True, False):
        workload = qmm.build(params, arms, np.random.default_rng(0))
        if not ahead:
            workload.prepare_reference = None
        status, table = _measure(job, workload)
        assert status == "ok", [r["error"] for r in table if r["error"]]
        tables[ahead] = table
    kinds = {ahead: sorted({(r["arm"], r["metric"], r["status"]) for r in t}) for ahead, t in tables.items()}
    assert kinds[True] == kinds[False]
    for arm in arms:
        assert {m for a, m, _ in kinds[True] if a == arm} == {
            "rel_error",
            "peak_memory_bytes",
            "build_seconds",
            "seconds",
            "prefill_tok_s",
            "gb_per_s",
            "tflop_per_s",
        }
    errors = {ahead: {r["arm"]: r["value"] for r in t if r["metric"] == "rel_error"} for ahead, t in tables.items()}
    assert {a: e for a, e in errors[True].items() if a != "auto"} == {
        a: e for a, e in errors[False].items() if a != "auto"
    }
    assert not _ours()


@pytest.mark.parametrize(
    ("case", "params", "arms"),
    [
        (
            "moe-gather",
            {"experts": 4, "top_k": 2, "tokens": 8, "hidden": 64, "expert_width": 32, "dtype": "float32"},
            ["native-sorted", "affine-unsorted", "custom-sorted", "auto-sorted"],
        ),
        ("mlp", {"tokens": 8, "hidden": 64, "intermediate": 128, "dtype": "float32"}, ["fused", "eager"]),
    ],
)
def test_cases_without_the_ahead_form_are_checked_synchronously(
    case: str, params: dict[str, Any], arms: list[str]
) -> None:
    from kernels import registry

    workload = registry.load_case(case).build(
        {**registry.CASES[case].defaults, **params}, arms, np.random.default_rng(0)
    )
    assert workload.prepare_reference is None
    status, table = _measure(_job(arms, params, case), workload)
    assert status == "ok", [r["error"] for r in table if r["error"]]
    checks = {r["arm"]: r for r in table if r["metric"] == "rel_error"}
    assert set(checks) == set(arms) and all(r["status"] == "ok" for r in checks.values())


def test_an_exception_in_the_reference_thread_fails_that_arm_with_its_message(monkeypatch: pytest.MonkeyPatch) -> None:
    workload = qmm.build(QMM, ["native", "affine", "dense"], np.random.default_rng(0))
    reference = workload.reference
    assert isinstance(reference, qmm.ProductReference)
    affine_w = reference._resolved()["affine"]  # (decoded here first, to know which matrix to break)
    product = qmm.ProductReference._product
    threads: list[str] = []

    def broken(self: qmm.ProductReference, xs: np.ndarray, w: np.ndarray) -> Any:
        threads.append(threading.current_thread().name)
        if w is affine_w:
            raise RuntimeError("affine reference: boom")
        return product(self, xs, w)

    monkeypatch.setattr(qmm.ProductReference, "_product", broken)
    before = {t.ident for t in threading.enumerate()}
    status, table = _measure(_job(["native", "affine", "dense"], QMM), workload)
    assert status == "failed"
    assert threads and all(name.startswith(THREAD_NAME) for name in threads)  # computed ahead, once per matrix
    checks = {r["arm"]: r for r in table if r["metric"] == "rel_error"}
    assert checks["affine"]["status"] == "failed"
    assert checks["affine"]["error"] == "RuntimeError: affine reference: boom"
    assert checks["native"]["status"] == "ok" and checks["dense"]["status"] == "ok"
    # an arm whose check raised is not timed (as a path that raises); the others are
    timed = {r["arm"] for r in table if r["metric"] == "seconds"}
    assert timed == {"native", "dense"}
    assert not _ours() and {t.ident for t in threading.enumerate()} <= before  # no thread outlives the job


def test_the_reference_weights_are_read_back_in_the_job_and_decoded_on_the_reference_thread(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """qmm's float64 weights (the NVFP4 decode, the affine decode, the dense copy widened) are read back
    from the device when the workload is built, and decoded beside the warm-up, not before it."""
    decoded: list[tuple[str, str]] = []
    for module, name in ((device_nvfp4, "_decode"), (qmm, "_affine_decode")):
        real = getattr(module, name)

        def spy(*args: Any, _real: Any = real, _name: str = name) -> Any:
            decoded.append((_name, threading.current_thread().name))
            return _real(*args)

        monkeypatch.setattr(module, name, spy)
    widened: list[str] = []
    real_later = qmm.float64_later

    def later(a: Any) -> Any:
        values = real_later(a)
        return lambda: (widened.append(threading.current_thread().name), values())[1]

    monkeypatch.setattr(qmm, "float64_later", later)
    workload = qmm.build(QMM, ["native", "affine", "dense", "auto"], np.random.default_rng(0))
    assert decoded == [] and widened == []  # built: read back, nothing decoded yet
    status, table = _measure(_job(["native", "affine", "dense", "auto"], QMM), workload)
    assert status == "ok", [r["error"] for r in table if r["error"]]
    assert sorted(n for n, _ in decoded) == ["_affine_decode", "_decode"]  # each source once, for every arm
    assert all(t.startswith(THREAD_NAME) for _, t in decoded) and widened and widened[0].startswith(THREAD_NAME)


def test_a_host_part_that_fails_as_a_whole_falls_back_to_the_synchronous_reference() -> None:
    workload = qmm.build(QMM, ["native"], np.random.default_rng(0))

    def prepare(arms: list[str], x: Any) -> Any:
        def host_part() -> None:
            raise MemoryError("no room")

        return host_part

    workload.prepare_reference = prepare
    status, table = _measure(_job(["native"], QMM), workload)
    assert status == "ok"
    assert next(r for r in table if r["metric"] == "rel_error")["value"] < 1e-5
    assert not _ours()


def _wrong_fast_candidate() -> tuple[Workload, list[str]]:
    """An auto arm whose fastest candidate is wrong (10 % off) and one good, slower candidate."""
    w = np.random.default_rng(0).standard_normal((8, 16)).astype(np.float32)
    wm = mx.array(w)
    a = mx.array(np.random.default_rng(1).standard_normal((256, 256)).astype(np.float32))

    def good(x: mx.array) -> mx.array:
        return x @ wm.T + 0 * mx.sum((a @ a) @ a)

    def wrong(x: mx.array) -> mx.array:
        return (x @ wm.T) * 1.1

    def make_inputs(rng: np.random.Generator) -> tuple[mx.array, ...]:
        return (mx.array(rng.standard_normal((4, 16)).astype(np.float32)),)

    def reference(arm: str, x: Any) -> np.ndarray:
        return np.array(x, dtype=np.float64) @ w.astype(np.float64).T

    candidates = {"wrong": ArmPath(wrong, 1e-3, "x*1.1"), "good": ArmPath(good, 1e-4, "matmul+work")}
    auto = dispatch.auto_path(("t-wrong",), candidates, make_inputs, reference)
    arms = {"good": ArmPath(good, 1e-4, "matmul+work"), "auto": auto}
    return Workload(arms, make_inputs, reference, flops=1.0, bytes_moved=1.0, tokens=4), list(arms)


def test_auto_never_picks_a_wrong_candidate_even_the_fastest() -> None:
    workload, arms = _wrong_fast_candidate()
    status, table = _measure(_job(arms, QMM, reps=4), workload)
    assert status == "ok", [r["error"] for r in table if r["error"]]
    routes = {r["route"] for r in table if r["arm"] == "auto" and r["metric"] == "seconds"}
    (route,) = routes
    assert str(route).startswith("auto:good[") and "wrong:rejected" in str(route)
    check = next(r for r in table if r["arm"] == "auto" and r["metric"] == "rel_error")
    assert check["status"] == "ok" and check["value"] < 1e-5


def test_auto_with_no_correct_candidate_fails_and_a_raising_arm_fails_in_the_warm_up() -> None:
    workload, _ = _wrong_fast_candidate()
    spec = workload.arms["auto"].auto
    assert spec is not None

    def raises(x: mx.array) -> mx.array:
        raise ValueError("cannot run here")

    only_wrong = dataclasses.replace(
        spec, candidates={"wrong": spec.candidates["wrong"], "raises": ArmPath(raises, 1e-3, "r")}
    )
    workload.arms = {
        "good": workload.arms["good"],
        "auto": dataclasses.replace(workload.arms["auto"], auto=only_wrong),
        "broken": ArmPath(raises, 1e-3, "raises"),
    }
    status, table = _measure(_job(["good", "auto", "broken"], QMM), workload)
    assert status == "failed"
    checks = {r["arm"]: r for r in table if r["metric"] == "rel_error"}
    assert checks["good"]["status"] == "ok"
    auto_error = str(checks["auto"]["error"])
    assert auto_error.startswith("auto: no correct candidate (")
    assert "wrong: rel_error" in auto_error and "raises: ValueError: cannot run here" in auto_error
    assert checks["broken"]["status"] == "failed" and checks["broken"]["error"] == "ValueError: cannot run here"
    assert {r["arm"] for r in table if r["metric"] == "seconds"} == {"good"}
    assert not _ours()
