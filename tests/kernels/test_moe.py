"""Case `moe-gather` on real MLX at tiny shapes: every arm against its float64 reference, the
per-expert global-scale route, broken arms over tolerance, FLOPs and bytes by hand."""

from __future__ import annotations

import secrets

import mlx.core as mx
import numpy as np
import pytest

from kernels import moe
from kernels.registry import CASES, Workload

ON_CPU = mx.default_device().type == mx.DeviceType.cpu
# The gather_qmm arms this module builds; custom-sorted/auto-sorted are issue 7's (tested there).
RUNNABLE = ["native-sorted", "native-unsorted", "affine-sorted", "affine-unsorted"]
SMALL = {"experts": 8, "top_k": 3, "tokens": 12, "hidden": 128, "expert_width": 32}


def rel_error(out: mx.array, ref: np.ndarray) -> float:
    got = np.array(out.astype(mx.float32), dtype=np.float64)
    return float(np.linalg.norm(got - ref) / np.linalg.norm(ref))


def build(seed: int, **params: object) -> Workload:
    return moe.build({**SMALL, **params}, RUNNABLE, np.random.default_rng(seed))


@pytest.mark.parametrize("global_scale", [True, False])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_every_arm_within_tolerance_of_its_reference(global_scale: bool, dtype: str) -> None:
    seed = secrets.randbits(32)
    wl = build(seed, global_scale=global_scale, dtype=dtype)
    assert list(wl.arms) == RUNNABLE
    rng = np.random.default_rng()
    for _ in range(2):
        x, idx = wl.make_inputs(rng)
        assert x.shape == (12, 128) and idx.shape == (12, 3) and idx.dtype == mx.uint32
        for arm, path in wl.arms.items():
            ref = wl.reference(arm, x, idx)
            assert ref.shape == (12, 3, 32) and ref.dtype == np.float64
            err = rel_error(path.run(x, idx), ref)
            assert err <= path.tolerance, f"seed={seed} {arm}: {err:.3g} > {path.tolerance:.3g}"


def test_routes_say_how_the_global_scale_was_applied() -> None:
    wl = build(1)
    native = wl.arms["native-sorted"].route
    if ON_CPU:
        assert native == f"{moe.ROUTE_POST_SCALE},sorted"
    else:
        assert native == f"{moe.ROUTE_FUSED},sorted"
    assert wl.arms["native-unsorted"].route.endswith(",unsorted")
    assert wl.arms["affine-sorted"].route == "gather_qmm(affine,g64,b4),sorted"
    assert build(1, global_scale=False).arms["native-sorted"].route == "gather_qmm(nvfp4),sorted"


@pytest.mark.skipif(not ON_CPU, reason="pins MLX 0.32.4's CPU refusal of gather_qmm's global_scale")
def test_cpu_refuses_the_fused_global_scale() -> None:
    """Why the CPU route post-scales: if MLX starts accepting it, this says to switch."""
    ew = moe.expert_weights(2, 16, 64, np.random.default_rng(0), global_scale=True)
    assert ew.global_scale is not None
    fused = moe.nvfp4_projection(ew.packed, ew.scales, ew.global_scale, fused=True)
    with pytest.raises(ValueError, match="only supported on the GPU"):
        mx.eval(moe.run_unsorted(fused, mx.ones((3, 64)), mx.zeros((3, 1), dtype=mx.uint32)))


@pytest.mark.skipif(ON_CPU, reason="needs a GPU: gather_qmm's global_scale is GPU-only in MLX 0.32.4")
def test_fused_and_post_scale_routes_agree_on_gpu() -> None:
    ew = moe.expert_weights(8, 32, 128, np.random.default_rng(0), global_scale=True)
    assert ew.global_scale is not None
    q, s, gs = ew.packed, ew.scales, ew.global_scale
    x = mx.random.normal((12, 128))
    idx = mx.array(moe.route(np.random.default_rng(1), 12, 8, 3))
    fused = moe.run_sorted(moe.nvfp4_projection(q, s, gs, fused=True), x, idx)
    twin = moe.run_sorted(moe.nvfp4_projection(q, s, gs, fused=False), x, idx)
    assert rel_error(fused, np.array(twin, dtype=np.float64)) < 1e-5


def test_broken_arms_are_over_tolerance() -> None:
    """A wrong global-scale convention, a wrong expert offset, a missing unsort or shifted expert
    indices all give errors far over the native tolerance."""
    seed = secrets.randbits(32)
    wl = build(seed)
    # build() draws the experts first from the job's generator: the same experts again
    ew = moe.expert_weights(8, 32, 128, np.random.default_rng(seed), global_scale=True)
    gs = ew.global_scales()
    assert gs is not None
    q, s = ew.packed, ew.scales
    x, idx = wl.make_inputs(np.random.default_rng())
    ref = wl.reference("native-sorted", x, idx)
    tol = wl.arms["native-sorted"].tolerance

    def err(global_scales: np.ndarray, runner: object = moe.run_sorted, indices: mx.array = idx) -> float:
        project = moe.nvfp4_projection(q, s, mx.array(global_scales), fused=not ON_CPU)
        return rel_error(runner(project, x, indices), ref)  # type: ignore[operator]

    assert err(gs) <= tol
    assert err(gs / np.float32(2688)) > 0.99  # ModelOpt's decode scale passed as MLX's global_scale
    assert err(np.roll(gs, 1)) > 100 * tol  # the neighbouring expert's scale
    shifted = (idx + 1) % 8
    assert err(gs, indices=shifted.astype(mx.uint32)) > 100 * tol

    def sorted_without_unsort(project: moe.Projection, xs: mx.array, ids: mx.array) -> mx.array:
        t, k = ids.shape
        flat = ids.flatten()
        order = mx.argsort(flat)
        return project(xs[order // k][:, None, :], flat[order], True).reshape(t, k, -1)

    assert err(gs, runner=sorted_without_unsort) > 100 * tol
    assert rel_error(wl.arms["native-unsorted"].run(x, idx) * (1 + 2 * tol), ref) > tol


def test_sorted_and_unsorted_compute_the_same_rows() -> None:
    wl = build(7)
    x, idx = wl.make_inputs(np.random.default_rng())
    for kind in ("native", "affine"):
        a = np.array(wl.arms[f"{kind}-sorted"].run(x, idx))
        b = np.array(wl.arms[f"{kind}-unsorted"].run(x, idx))
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * float(np.abs(b).max()))


def test_reference_by_hand() -> None:
    """y[t, j] = W[e(t, j)] @ x[t], checked with a plain loop over every routed pair."""
    wl = build(3, experts=4, top_k=2, tokens=5)
    ew = moe.expert_weights(4, 32, 128, np.random.default_rng(3), global_scale=True)
    x, idx = wl.make_inputs(np.random.default_rng())
    ref = wl.reference("native-unsorted", x, idx)
    x64, ids = np.array(x, dtype=np.float64), np.array(idx)
    for t in range(5):
        for j in range(2):
            want = ew.at(int(ids[t, j])).dequantized() @ x64[t]
            # Two float64 sums in different orders: a row that cancels to near zero differs by a few
            # ulps of the row's scale, not of its own value, so the bound is relative to the row.
            np.testing.assert_allclose(ref[t, j], want, rtol=1e-12, atol=1e-12 * np.abs(want).max())


def test_routing_is_top_k_distinct_and_fresh() -> None:
    gen = np.random.default_rng()
    a = moe.route(gen, 64, 16, 6)
    assert a.shape == (64, 6) and a.dtype == np.uint32 and a.max() < 16
    assert all(len(set(row)) == 6 for row in a.tolist())
    assert not np.array_equal(a, moe.route(gen, 64, 16, 6))
    assert len(np.unique(a)) == 16  # 384 picks reach every expert (chance of missing one ~1e-10)


def test_flops_and_bytes_by_hand() -> None:
    wl = build(0, experts=4, top_k=2, tokens=3, hidden=64, expert_width=32)
    assert wl.flops == 2 * 3 * 2 * 32 * 64 == 24576
    assert wl.tokens == 3
    # expected experts touched: 4 (1 - (1 - 2/4)^3) = 3.5; each: codes 32*64/2 + scales 32*64/16 + gs 4
    touched, per_expert = 3.5, 1024 + 128 + 4
    x_bytes, y_bytes, idx_bytes = 3 * 64 * 4, 3 * 2 * 32 * 4, 3 * 2 * 4
    assert wl.bytes_moved == pytest.approx(touched * per_expert + x_bytes + y_bytes + idx_bytes)
    assert moe.expected_experts_touched(128, 6, 512) == pytest.approx(128, rel=1e-6)
    no_gs = build(0, experts=4, top_k=2, tokens=3, hidden=64, expert_width=32, global_scale=False)
    assert wl.bytes_moved - no_gs.bytes_moved == pytest.approx(3.5 * 4)


def test_bad_input_raises() -> None:
    assert set(RUNNABLE) < set(CASES["moe-gather"].arms)
    rng = np.random.default_rng(0)
    with pytest.raises(ValueError, match="unknown arm"):
        moe.build(SMALL, ["native-shuffled"], rng)
    with pytest.raises(ValueError, match="top_k"):
        moe.build({**SMALL, "top_k": 9}, ["native-sorted"], rng)
    with pytest.raises(ValueError, match="dtype"):
        moe.build({**SMALL, "dtype": "int8"}, ["native-sorted"], rng)
    narrow = moe.build({**SMALL, "hidden": 48}, RUNNABLE, rng)
    assert set(narrow.arms) == {"native-sorted", "native-unsorted"}
    assert "64" in narrow.unsupported["affine-sorted"]


def test_reference_is_shared_by_sorted_and_unsorted() -> None:
    wl = build(5)
    x, idx = wl.make_inputs(np.random.default_rng())
    assert wl.reference("native-sorted", x, idx) is wl.reference("native-unsorted", x, idx)
    assert wl.reference("affine-sorted", x, idx) is wl.reference("affine-unsorted", x, idx)
    assert wl.reference("affine-sorted", x, idx) is not wl.reference("native-sorted", x, idx)
