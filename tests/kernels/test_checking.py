"""The subset reference: where the float64 product costs more than the measurement, a stratified
subset of the output is checked. It must still catch a wrong kernel, and say what it checked."""

from __future__ import annotations

import dataclasses
import math

import mlx.core as mx
import numpy as np
import pytest

from kernels import checking, moe, product_reference, qmm
from kernels.checking import ReferenceSubset, relative_error, stratified
from kernels.registry import ArmPath


@pytest.mark.parametrize(("size", "count"), [(16384, 256), (21504, 1024), (1856, 145), (100, 7), (5, 10)])
def test_stratified_indices_cover_every_stratum_and_both_ends(size: int, count: int) -> None:
    idx = stratified(size, count, np.random.default_rng(size))
    assert idx[0] == 0 and idx[-1] == size - 1 and np.all(np.diff(idx) > 0)
    if count >= size:
        assert len(idx) == size
        return
    assert count - 1 <= len(idx) <= count
    gap = math.ceil(size / count)
    assert np.max(np.diff(idx)) < 2 * gap  # no tile of `gap` indices is ever left unchecked
    edges = np.ceil(np.linspace(0, size, count + 1)).astype(int)
    hit = np.searchsorted(edges, idx, side="right") - 1
    assert len(set(hit.tolist())) >= count - 1  # one index per stratum


def test_a_wrong_shape_or_nan_is_infinitely_wrong() -> None:
    ref = ReferenceSubset(np.ones((2, 2)), np.ix_([0, 3], [1, 2]), (4, 4), "2 of 4 rows x 2 of 4 columns")
    assert relative_error(np.ones((4, 4)), ref) == 0.0
    assert relative_error(np.ones((4, 3)), ref) == math.inf
    bad = np.ones((4, 4))
    bad[3, 2] = np.nan
    assert relative_error(bad, ref) == math.inf


def _qmm(monkeypatch: pytest.MonkeyPatch, tokens: int, n: int, k: int) -> qmm.Workload:
    monkeypatch.setattr(checking, "FULL_REFERENCE_MACS", 1.0)  # the seeds' regime at a CPU-sized shape
    monkeypatch.setattr(checking, "MAX_ROWS", 16)
    monkeypatch.setattr(checking, "MAX_COLS", 24)
    rng = np.random.default_rng(7)
    return qmm.build({"tokens": tokens, "n": n, "k": k, "dtype": "float32"}, ["native", "affine", "dense"], rng)


def test_qmm_checks_a_subset_that_passes_every_right_arm(monkeypatch: pytest.MonkeyPatch) -> None:
    wl = _qmm(monkeypatch, 96, 384, 128)
    (x,) = wl.make_inputs(np.random.default_rng(1))
    for arm, path in wl.arms.items():
        ref = wl.reference(arm, x)
        assert isinstance(ref, ReferenceSubset)
        assert ref.describe() == "16 of 96 rows x 24 of 384 columns"
        full = product_reference.to_float64(x) @ np.array(path.run(mx.eye(128)).astype(mx.float32), dtype=np.float64)
        assert np.allclose(ref.values, full[ref.index], rtol=1e-5, atol=1e-5), arm  # the subset of the true product
        assert relative_error(np.array(path.run(x)), ref) <= path.tolerance, arm


@pytest.mark.parametrize("tile", [(0, 0), (32, 64), (80, 320), (95, 383)])
def test_qmm_subset_catches_one_wrong_tile(monkeypatch: pytest.MonkeyPatch, tile: tuple[int, int]) -> None:
    """A kernel that gets one 16 x 32 output tile wrong (anywhere, edges included) fails the check."""
    wl = _qmm(monkeypatch, 96, 384, 128)
    native = wl.arms["native"]
    r0, c0 = (min(tile[0], 96 - 16) // 16) * 16, (min(tile[1], 384 - 32) // 32) * 32

    def broken(x: mx.array) -> mx.array:
        y = np.array(native.run(x))
        y[r0 : r0 + 16, c0 : c0 + 32] *= 1.5  # a wrong scale in one tile
        return mx.array(y)

    (x,) = wl.make_inputs(np.random.default_rng(2))
    ref = wl.reference("native", x)
    assert relative_error(np.array(native.run(x)), ref) <= native.tolerance
    assert relative_error(np.array(broken(x)), ref) > 50 * native.tolerance


def test_measure_records_what_the_subset_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    import datetime as dt

    from workers.contract import JobContext, JobSpec, LockSettings, RowBuilder
    from workers.host.fingerprint import host_fingerprint
    from workers.job.measure import measure_workload

    built = _qmm(monkeypatch, 96, 384, 128)
    good = built.arms["native"]
    broken = ArmPath(run=lambda x: good.run(x) * 1.01, tolerance=good.tolerance, route="broken")  # 1 % off
    wl = dataclasses.replace(
        built,
        arms={**built.arms, "broken": broken},
        reference=lambda arm, *inputs: built.reference("native" if arm == "broken" else arm, *inputs),
    )
    job = JobSpec(
        run_id="r", sweep="s", job_key="k", case="qmm", case_name="qmm", params={"tokens": 96},
        arms=["native", "broken"], device="cpu", repetitions=2, warmup=0, lock=LockSettings(enabled=False),
    )  # fmt: skip
    rows = RowBuilder(job, host_fingerprint(), JobContext(started_at=dt.datetime.now(dt.UTC)))
    assert measure_workload(job, wl, rows, np.random.default_rng(3)) == "failed"
    errors = {r["arm"]: r for r in rows.rows if r["metric"] == "rel_error"}
    assert errors["native"]["status"] == "ok" and errors["broken"]["status"] == "failed"
    assert dict(errors["native"]["extra"])["reference_subset"] == "16 of 96 rows x 24 of 384 columns"


def test_moe_subset_catches_a_wrong_expert_scale(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(checking, "FULL_REFERENCE_MACS", 1.0)
    monkeypatch.setattr(moe, "REFERENCE_WEIGHTS", 8 * 64 * 256)  # 64 of the 128 output features
    params = {"experts": 8, "top_k": 2, "tokens": 32, "hidden": 256, "expert_width": 128, "dtype": "float32"}
    wl = moe.build(params, ["native-unsorted"], np.random.default_rng(5))
    x, idx = wl.make_inputs(np.random.default_rng(6))
    ref = wl.reference("native-unsorted", x, idx)
    assert isinstance(ref, ReferenceSubset) and ref.describe() == "64 of 128 output features, every routed row"
    path = wl.arms["native-unsorted"]
    y = np.array(path.run(x, idx))
    assert relative_error(y, ref) <= path.tolerance
    hit = np.array(idx) == int(np.array(idx)[0, 0])  # every pair routed to one expert
    y[hit] *= 1.1  # that expert's global scale 10 % off
    assert relative_error(y, ref) > 10 * path.tolerance


@pytest.mark.parametrize("layout", ["ix", "ellipsis"])
def test_an_mlx_output_is_checked_at_the_subset_on_the_device(layout: str) -> None:
    """The same error as the NumPy path, from the picked elements only; a NaN outside the subset
    still fails; a wrong shape is infinitely wrong."""
    rng = np.random.default_rng(3)
    full = rng.standard_normal((6, 4, 40))
    rows, cols = np.array([0, 2, 5]), np.array([0, 7, 19, 39])
    if layout == "ix":
        full = full[:, 0, :]
        index: tuple[object, ...] = np.ix_(rows, cols)
    else:
        index = (Ellipsis, cols)
    ref = ReferenceSubset(full[index], index, full.shape, "subset")
    noisy = full + 1e-3 * rng.standard_normal(full.shape)
    out = mx.array(noisy.astype(np.float32))
    expected = relative_error(noisy.astype(np.float32), ref)
    assert 1e-4 < expected < 1e-2
    assert relative_error(out, ref) == pytest.approx(expected, rel=1e-6)
    assert checking.device_pick(out, ref).shape == ref.values.shape  # type: ignore[union-attr]
    poisoned = noisy.copy()
    poisoned.flat[1] = np.nan  # never among the picked elements
    assert not np.isnan(poisoned[index]).any()
    assert relative_error(mx.array(poisoned.astype(np.float32)), ref) == math.inf
    assert relative_error(out[:-1], ref) == math.inf
    wrong = noisy.copy()
    wrong[index] += 1.0
    assert relative_error(mx.array(wrong.astype(np.float32)), ref) > 0.3


def test_an_index_of_another_form_falls_back_to_the_whole_output() -> None:
    full = np.arange(24, dtype=np.float64).reshape(4, 6) + 1
    index = (np.array([0, 3]), np.array([1, 5]))  # zipped pairs, not an outer product
    ref = ReferenceSubset(full[index], index, full.shape, "pairs")
    assert relative_error(mx.array(full.astype(np.float32)), ref) == 0.0
    assert checking._outer_axes(index, 2) is None


def test_a_decode_point_with_many_weights_checks_a_column_subset_that_catches_a_wrong_block(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """One token: the product is cheap, but over `FULL_REFERENCE_WEIGHTS` the weights are not all
    decoded on the host; the one row is checked at a stratified subset of the columns, which still
    sees a GEMV that gets one block of 32 outputs wrong, wherever it is."""
    monkeypatch.setattr(checking, "FULL_REFERENCE_WEIGHTS", 1000)  # the seeds' 115 M at a CPU-sized shape
    monkeypatch.setattr(checking, "MAX_COLS", 24)
    wl = qmm.build({"tokens": 1, "n": 384, "k": 128, "dtype": "float32"}, ["native", "affine", "dense"],
                   np.random.default_rng(7))  # fmt: skip
    (x,) = wl.make_inputs(np.random.default_rng(1))
    for arm, path in wl.arms.items():
        ref = wl.reference(arm, x)
        assert isinstance(ref, ReferenceSubset) and ref.describe() == "1 of 1 rows x 24 of 384 columns", arm
        assert relative_error(np.array(path.run(x)), ref) <= path.tolerance, arm
    native, ref = wl.arms["native"], wl.reference("native", x)
    for c0 in (0, 160, 352):
        y = np.array(native.run(x))
        y[:, c0 : c0 + 32] *= 1.5
        assert relative_error(y, ref) > 50 * native.tolerance, c0
    # under the limit (and the product's), the whole output is checked
    monkeypatch.setattr(checking, "FULL_REFERENCE_WEIGHTS", 384 * 128)
    whole = qmm.build({"tokens": 1, "n": 384, "k": 128, "dtype": "float32"}, ["native"], np.random.default_rng(7))
    assert not isinstance(whole.reference("native", x), ReferenceSubset)
