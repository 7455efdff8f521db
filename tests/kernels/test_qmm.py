"""Case `qmm` on real MLX at tiny shapes: every arm against its float64 reference, broken arms
over tolerance, and the FLOP and byte counts by hand."""

from __future__ import annotations

import secrets

import mlx.core as mx
import numpy as np
import pytest

from kernels import device_nvfp4, nvfp4, product_reference, qmm
from kernels.registry import CASES, Workload
from kernels.shapes import AFFINE_BITS, AFFINE_GROUP

# The MLX arms this module builds; custom/auto are issue 7's (tested there).
RUNNABLE = ["native", "affine", "dequant-gemm", "dense"]


def rel_error(out: mx.array, ref: np.ndarray) -> float:
    got = np.array(out.astype(mx.float32), dtype=np.float64)
    return float(np.linalg.norm(got - ref) / np.linalg.norm(ref))


def build(tokens: int, n: int, k: int, dtype: str = "float32", seed: int | None = None) -> Workload:
    rng = np.random.default_rng(secrets.randbits(32) if seed is None else seed)
    return qmm.build({"tokens": tokens, "n": n, "k": k, "dtype": dtype}, RUNNABLE, rng)


@pytest.mark.parametrize(("tokens", "n", "k"), [(1, 64, 256), (8, 96, 128), (5, 32, 512)])
def test_every_arm_within_tolerance_of_its_reference(tokens: int, n: int, k: int) -> None:
    wl = build(tokens, n, k)
    assert list(wl.arms) == RUNNABLE
    rng = np.random.default_rng()
    for _ in range(2):  # fresh inputs each time
        (x,) = wl.make_inputs(rng)
        assert x.shape == (tokens, k) and x.dtype == mx.float32
        for arm, path in wl.arms.items():
            out = path.run(x)
            ref = wl.reference(arm, x)
            assert ref.dtype == np.float64 and ref.shape == (tokens, n)
            err = rel_error(out, ref)
            assert err <= path.tolerance, f"{arm}: {err:.3g} > {path.tolerance:.3g}"
            if qmm.mlx_backend() != "cuda":  # CUDA may run float32 on TF32 tensor cores
                assert path.tolerance < 1e-4  # float32: tight enough to see a 0.01 % bug


def test_bfloat16_arms_pass_and_inputs_are_bfloat16() -> None:
    wl = build(2, 32, 128, dtype="bfloat16")
    (x,) = wl.make_inputs(np.random.default_rng())
    assert x.dtype == mx.bfloat16
    for arm, path in wl.arms.items():
        out = path.run(x)
        assert out.dtype == mx.bfloat16
        assert rel_error(out, wl.reference(arm, x)) <= path.tolerance, arm


def test_arms_hold_the_reference_weights() -> None:
    """native and dequant-gemm hold the NVFP4 reference values exactly; affine its requantization."""
    seed = secrets.randbits(32)
    n, k = 48, 128
    wl = build(3, n, k, seed=seed)
    w_ref = qmm.nvfp4_weights(n, k, np.random.default_rng(seed)).dequantized()  # build() draws W first
    eye = mx.eye(k)  # x = I reads the weights back out: y = W^T
    for arm in ("native", "dequant-gemm", "dense"):
        np.testing.assert_array_equal(np.array(wl.arms[arm].run(eye)).T, w_ref, err_msg=arm)
    affine = np.array(wl.arms["affine"].run(eye)).T
    close = 1e-6 if qmm.mlx_backend() != "cuda" else 2e-3  # TF32
    np.testing.assert_allclose(affine, wl.reference("affine", eye).T, rtol=close, atol=close)
    # affine 4-bit g64 of the NVFP4 values is a second, coarser rounding: close, never equal
    requant = float(np.linalg.norm(affine - w_ref) / np.linalg.norm(w_ref))
    assert 1e-3 < requant < 0.3


def test_broken_arms_are_over_tolerance() -> None:
    """A path with a wrong nibble order, wrong scale rows, or a 0.1 % scale error fails the check."""
    seed = secrets.randbits(32)
    n, k = 64, 256
    wl = build(4, n, k, seed=seed)
    codes, scales = qmm.nvfp4_weights(n, k, np.random.default_rng(seed)).host()
    (x,) = wl.make_inputs(np.random.default_rng())
    ref = wl.reference("native", x)
    tol = wl.arms["native"].tolerance

    def native(c: np.ndarray, s: np.ndarray) -> mx.array:
        q = mx.array(nvfp4.pack_codes(c))
        return mx.quantized_matmul(x, q, mx.array(s), transpose=True, mode="nvfp4")

    assert rel_error(native(codes, scales), ref) <= tol
    nibbles_swapped = codes.reshape(n, k // 2, 2)[..., ::-1].reshape(n, k)
    assert rel_error(native(nibbles_swapped, scales), ref) > 0.5
    assert rel_error(native(codes, np.roll(scales, 1, axis=0)), ref) > 0.1  # rows have similar scales
    assert rel_error(wl.arms["native"].run(x) * (1 + 2 * tol), ref) > tol
    # the dense arm is checked against the weights it holds, not against the unquantized ones
    w_true = device_nvfp4.draw_values((n, k), np.random.default_rng(seed), device_nvfp4.normal())
    np.testing.assert_array_equal(nvfp4.quantize(np.array(w_true))[0], codes)  # the draws W was quantized from
    dense_unquantized = x @ w_true.T
    assert rel_error(dense_unquantized, wl.reference("dense", x)) > 20 * wl.arms["dense"].tolerance


def test_flops_bytes_tokens_by_hand() -> None:
    wl = build(2, 32, 64)
    assert wl.flops == 2 * 2 * 32 * 64 == 8192
    # packed weights 32*64/2 + scales 32*64/16 + x 2*64*4 + y 2*32*4
    assert wl.bytes_moved == 1024 + 128 + 512 + 256 == 1920
    assert wl.tokens == 2
    bf16 = build(2, 32, 64, dtype="bfloat16")
    assert bf16.bytes_moved == 1024 + 128 + 256 + 128


def test_registered_arms_include_these() -> None:
    assert set(RUNNABLE) < set(CASES["qmm"].arms)


def test_affine_needs_k_divisible_by_64() -> None:
    wl = build(1, 32, 48)
    assert "affine" in wl.unsupported and "64" in wl.unsupported["affine"]
    assert set(wl.arms) == {"native", "dequant-gemm", "dense"}


def test_bad_parameters_raise() -> None:
    rng = np.random.default_rng(0)
    with pytest.raises(ValueError, match="dtype"):
        qmm.build({"tokens": 1, "n": 32, "k": 64, "dtype": "float64"}, ["native"], rng)
    with pytest.raises(ValueError, match="k = 40: not a multiple of 16, the NVFP4 group size"):
        qmm.build({"tokens": 1, "n": 32, "k": 40}, ["native"], rng)
    with pytest.raises(ValueError, match="unknown arm"):
        qmm.build({"tokens": 1, "n": 32, "k": 64}, ["turbo"], rng)


def test_tolerances_grow_with_k_and_shrink_where_sums_are_float32() -> None:
    cpu = qmm.tolerance("native", "bfloat16", 4096, "cpu")
    gpu = qmm.tolerance("native", "bfloat16", 4096, "metal")
    assert gpu < cpu  # GPU kernels accumulate in float32; MLX's CPU qmm in bfloat16
    assert qmm.tolerance("native", "bfloat16", 256, "cpu") < cpu
    assert qmm.tolerance("affine", "bfloat16", 4096, "cpu") > cpu
    assert qmm.tolerance("dense", "float32", 4096, "cuda") > qmm.tolerance("dense", "float32", 4096, "metal")
    assert qmm.tolerance("native", "float32", 256, "cpu") < 1e-5
    assert all(qmm.tolerance("affine", d, 16384, "cpu") < 0.5 for d in qmm.MLX_DTYPES)


def test_reference_is_shared_by_arms_holding_the_same_weights() -> None:
    wl = build(2, 32, 64)
    (x,) = wl.make_inputs(np.random.default_rng())
    assert wl.reference("native", x) is wl.reference("dequant-gemm", x)
    assert wl.reference("native", x) is wl.reference("dense", x)  # float32 holds NVFP4 values exactly
    (x2,) = wl.make_inputs(np.random.default_rng())
    assert not np.array_equal(wl.reference("native", x2), wl.reference("native", x))


def test_affine_weights_are_scale_times_level_plus_bias_bit_for_bit() -> None:
    """The table route of `affine_weights` against the plain unpacking, group by group."""
    seed = secrets.randbits(32)
    w = mx.array(np.random.default_rng(seed).standard_normal((96, 512)).astype(np.float32)).astype(mx.bfloat16)
    aq, scales, biases = mx.quantize(w, group_size=AFFINE_GROUP, bits=AFFINE_BITS)
    levels = product_reference.unpack_affine(np.array(aq)).astype(np.float64).reshape(96, -1, AFFINE_GROUP)
    s = np.array(scales.astype(mx.float32), dtype=np.float64)[..., None]
    b = np.array(biases.astype(mx.float32), dtype=np.float64)[..., None]
    want = (levels * s + b).reshape(96, 512)
    got = product_reference.affine_weights(aq, scales, biases)
    np.testing.assert_array_equal(got, want, err_msg=f"seed {seed}")
    # what the affine arm computes with is checked against these in test_arms_hold_the_reference_weights
