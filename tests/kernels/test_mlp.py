"""The `mlp` case: every activation path agrees with the float64 block, and a broken scale fails."""

from __future__ import annotations

import dataclasses
import datetime as dt
from collections.abc import Callable

import mlx.core as mx
import numpy as np
import pytest

from kernels import checking, mlp, nvfp4, qmm, registry
from kernels.checking import ReferenceSubset
from kernels.registry import Workload
from workers.contract import HostFingerprint, JobContext, JobSpec, RowBuilder, Status
from workers.job.measure import measure_workload, relative_error

SHAPE = {"tokens": 8, "hidden": 128, "intermediate": 256}


def _build(dtype: str = "float32", seed: int = 0) -> tuple[Workload, tuple[mx.array, ...]]:
    rng = np.random.default_rng(seed)
    workload = mlp.build({**SHAPE, "dtype": dtype}, list(mlp.ARMS), rng)
    return workload, workload.make_inputs(rng)


def _out(fn: Callable[[mx.array], mx.array], x: mx.array) -> np.ndarray:
    y = fn(x)
    mx.eval(y)
    return np.array(y.astype(mx.float32), dtype=np.float64)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_every_arm_matches_the_float64_block(dtype: str) -> None:
    workload, (x,) = _build(dtype)
    ref = workload.reference("fused", x)
    assert ref.dtype == np.float64 and ref.shape == (SHAPE["tokens"], SHAPE["hidden"])
    assert np.linalg.norm(ref) > 0
    for arm, path in workload.arms.items():
        err = relative_error(_out(path.run, x), ref)
        assert err <= path.tolerance, (arm, err, path.tolerance)
    if dtype == "float32":
        # Exact weights, float32 arithmetic: the error is rounding alone, far below the tolerance.
        assert all(relative_error(_out(p.run, x), ref) < 1e-5 for p in workload.arms.values())


@pytest.mark.parametrize("which", ["gate", "down"])
def test_over_the_full_reference_size_a_subset_still_catches_a_broken_scale(
    monkeypatch: pytest.MonkeyPatch, which: str
) -> None:
    """The seeds' regime at a CPU-sized shape: a stratified subset of tokens and output features,
    computed once for every arm; it agrees with the whole block and catches a wrong scale."""
    monkeypatch.setattr(checking, "FULL_REFERENCE_MACS", 1.0)
    monkeypatch.setattr(checking, "MAX_ROWS", 4)
    monkeypatch.setattr(checking, "MAX_COLS", 16)
    shape = {"tokens": 32, "hidden": 128, "intermediate": 256}
    rng = np.random.default_rng(5)
    workload = mlp.build({**shape, "dtype": "float32"}, list(mlp.ARMS), rng)
    (x,) = workload.make_inputs(rng)
    ref = workload.reference("fused", x)
    assert isinstance(ref, ReferenceSubset) and ref.values.shape == (4, 16)
    assert ref.describe() == "4 of 32 rows x 16 of 128 columns"
    assert workload.reference("eager", x) is ref  # one float64 product for every arm
    assert isinstance(workload.reference, mlp.BlockReference)
    whole = mlp.reference(workload.reference.weights, np.array(x))
    np.testing.assert_allclose(ref.values, whole[ref.index], rtol=1e-12, atol=1e-12 * np.abs(whole).max())
    for arm, path in workload.arms.items():
        assert relative_error(path.run(x), ref) <= path.tolerance, arm
    weights = workload.reference.weights
    proj = getattr(weights, which)
    broken = dataclasses.replace(
        weights, **{which: dataclasses.replace(proj, global_scale=proj.global_scale / nvfp4.MLX_GLOBAL_SCALE_DIVISOR)}
    )
    assert relative_error(mlp.arm_function("fused", broken)(x), ref) > 0.5


def test_reference_weights_are_what_mlx_decodes() -> None:
    """The reference's dense weights equal MLX's own dequantization with the global scale."""
    rng = np.random.default_rng(3)
    weights = mlp.make_weights(64, 128, rng)
    for proj in (weights.gate, weights.up, weights.down):
        mine = proj.dense()
        theirs = mx.dequantize(proj.packed, proj.scales, group_size=16, bits=4, mode="nvfp4", dtype=mx.float32)
        theirs64 = np.array(theirs, dtype=np.float64) * proj.decode_scale
        np.testing.assert_allclose(mine, theirs64, rtol=1e-6, atol=1e-12)
        # The global scale is about the tensor's absolute maximum (MLX's convention).
        assert proj.global_scale == pytest.approx(float(np.max(np.abs(mine))), rel=0.1)


@pytest.mark.parametrize("which", ["gate", "up", "down"])
@pytest.mark.parametrize("arm", mlp.ARMS)
def test_a_broken_global_scale_fails_the_reference(arm: str, which: str) -> None:
    """ModelOpt's decode scale passed where MLX's is expected: every arm must notice."""
    rng = np.random.default_rng(1)
    weights = mlp.make_weights(SHAPE["hidden"], SHAPE["intermediate"], rng)
    x = mx.array(rng.standard_normal((SHAPE["tokens"], SHAPE["hidden"])).astype(np.float32))
    ref = mlp.reference(weights, np.array(x))
    tol = mlp.tolerance("float32", SHAPE["hidden"], SHAPE["intermediate"], qmm.mlx_backend())
    assert relative_error(_out(mlp.arm_function(arm, weights), x), ref) <= tol
    proj = getattr(weights, which)
    broken_proj = dataclasses.replace(proj, global_scale=proj.global_scale / nvfp4.MLX_GLOBAL_SCALE_DIVISOR)
    broken = dataclasses.replace(weights, **{which: broken_proj})
    err = relative_error(_out(mlp.arm_function(arm, broken), x), ref)
    assert err > 0.5, err


def test_fused_and_op_at_a_time_run_different_graphs_to_the_same_answer() -> None:
    """The fused arm folds the up and down scales into one multiply; op-at-a-time keeps three."""
    workload, (x,) = _build()
    fused = _out(workload.arms["fused"].run, x)
    eager = _out(workload.arms["eager"].run, x)
    assert relative_error(fused, eager) < 1e-5
    assert "folded" in workload.arms["fused"].route
    assert "mx.compile(gelu" in workload.arms["op-at-a-time"].route
    assert "eager" in workload.arms["eager"].route


def test_workload_accounting() -> None:
    workload, _ = _build()
    t, h, i = SHAPE["tokens"], SHAPE["hidden"], SHAPE["intermediate"]
    assert workload.flops == 2 * t * h * i * 3
    # three 4-bit weight matrices (half a byte each) plus one E4M3 byte per 16 weights, x and y in float32
    assert workload.bytes_moved == pytest.approx(3 * h * i * (0.5 + 1 / 16) + 2 * t * h * 4)
    assert workload.tokens == t


def test_registered_and_measured_through_the_worker_loop() -> None:
    """The case as a sweep runs it: registry -> build -> measure_workload -> rows."""
    spec = registry.get_case("mlp")
    assert spec is not None and spec.kind == "kernel" and spec.arms == mlp.ARMS
    job = JobSpec(
        run_id="r1",
        sweep="nvfp4-prefill",
        job_key="k1",
        case="mlp",
        case_name="mlp",
        params={**SHAPE, "dtype": "float32"},
        arms=list(mlp.ARMS),
        device="cpu",
        repetitions=2,
        warmup=1,
    )
    fp = HostFingerprint(
        hostname="h",
        os="linux",
        machine="x86_64",
        cpu="cpu",
        cpu_count=2,
        memory_bytes=1,
        mlx_version=str(getattr(mx, "__version__", "unknown")),
        mlx_device=str(mx.default_device()),
        backend="cpu",
        threads=2,
        fingerprint_id="f",
    )
    rows = RowBuilder(job, fp, JobContext(started_at=dt.datetime.now(dt.UTC)))
    rng = np.random.default_rng(job.seed)
    workload = registry.load_case("mlp").build({**spec.defaults, **job.params}, job.arms, rng)
    assert measure_workload(job, workload, rows, rng) == Status.OK
    table = rows.table(Status.OK).to_pylist()
    for arm in mlp.ARMS:
        rel = [r for r in table if r["arm"] == arm and r["metric"] == "rel_error"]
        assert len(rel) == 1 and rel[0]["status"] == Status.OK and rel[0]["value"] < 1e-5
        tok_s = [r["value"] for r in table if r["arm"] == arm and r["metric"] == "prefill_tok_s"]
        assert len(tok_s) == 2 and all(v > 0 for v in tok_s)
    assert not [r for r in table if r["status"] == Status.FAILED]
