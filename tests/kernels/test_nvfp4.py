"""The NumPy NVFP4 reference against MLX's own `mx.quantize` / `mx.dequantize` (mode nvfp4).

Inputs are fresh random draws on every run (the seed is in each failure message), at several
shapes and magnitudes, with and without a global scale, in float32, bfloat16 and float16.
"""

from __future__ import annotations

import secrets

import mlx.core as mx
import numpy as np
import pytest

from kernels import nvfp4

ON_CPU = mx.default_device().type == mx.DeviceType.cpu
CUDA = not ON_CPU and mx.cuda.is_available()
# MLX's CPU backend rounds exact E2M1 ties toward zero and works in the weights' dtype; its GPU
# kernels round ties to even and work in float32 (see kernels/nvfp4.py).
LIKE: nvfp4.Quantizer = "mlx-cpu" if ON_CPU else "mlx-gpu"
MX_DTYPES = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}


def fresh_rng() -> tuple[np.random.Generator, int]:
    seed = secrets.randbits(32)
    return np.random.default_rng(seed), seed


def scale_array(global_scale: np.float32 | None) -> mx.array | None:
    return None if global_scale is None else mx.array(float(global_scale), dtype=mx.float32)


def mlx_quantize(w: mx.array, global_scale: np.float32 | None) -> tuple[np.ndarray, np.ndarray]:
    out = mx.quantize(w, mode="nvfp4", global_scale=scale_array(global_scale))
    return np.array(out[0]), np.array(out[1])


def mlx_dequantize(q: np.ndarray, s: np.ndarray, global_scale: np.float32 | None) -> np.ndarray:
    gs = scale_array(global_scale)
    return np.array(mx.dequantize(mx.array(q), mx.array(s), mode="nvfp4", global_scale=gs, dtype=mx.float32))


@pytest.mark.parametrize("shape", [(4, 64), (16, 256), (2, 3, 128), (1, 2048)])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("global_scale", ["none", "amax", "off-amax"])
def test_codes_scales_and_values_equal_mlx(shape: tuple[int, ...], dtype: str, global_scale: str) -> None:
    rng, seed = fresh_rng()
    magnitude = float(rng.choice([1e-3, 1.0, 40.0]))
    w32 = rng.standard_normal(shape, dtype=np.float32) * np.float32(magnitude)
    w_mx = mx.array(w32).astype(MX_DTYPES[dtype])
    w = np.array(w_mx.astype(mx.float32))  # the values MLX quantizes, exactly
    gs: np.float32 | None = None
    if global_scale != "none":
        gs = nvfp4.natural_global_scale(w)
        if global_scale == "off-amax":  # any positive scale must agree, not just the natural one
            gs = np.float32(gs * rng.uniform(0.3, 3.0))

    codes, scales = nvfp4.quantize(w, gs, like=LIKE, precision=dtype)  # type: ignore[arg-type]
    q_mlx, s_mlx = mlx_quantize(w_mx, gs)

    where = f"seed={seed} shape={shape} dtype={dtype} gs={gs} magnitude={magnitude}"
    assert codes.shape == w.shape and scales.shape == (*shape[:-1], shape[-1] // 16)
    np.testing.assert_array_equal(scales, s_mlx, err_msg=where)
    mlx_codes = nvfp4.unpack_codes(q_mlx)
    if CUDA:  # a block whose scale is 0 decodes to 0 whatever its codes; CUDA writes ±6 there
        live = np.repeat(nvfp4.decode_e4m3(scales) != 0, 16, axis=-1)
        np.testing.assert_array_equal(mlx_codes[live], codes[live], err_msg=where)
    else:
        np.testing.assert_array_equal(nvfp4.pack_codes(codes), q_mlx, err_msg=where)
        np.testing.assert_array_equal(mlx_codes, codes, err_msg=where)
    np.testing.assert_array_equal(
        nvfp4.dequantize(codes, scales, gs, dtype=np.float32), mlx_dequantize(q_mlx, s_mlx, gs), err_msg=where
    )


def test_a_block_whose_scale_rounds_to_zero_decodes_to_zero() -> None:
    w = np.zeros((2, 32), dtype=np.float32)
    w[0, :16] = 1e-5  # amax / 6 is far below E4M3's smallest subnormal, 2^-9
    w[1, 16:] = -1e-5
    codes, scales = nvfp4.quantize(w, like=LIKE)
    assert scales.tolist() == [[0, 0], [0, 0]] and not codes.any()
    q_mlx, s_mlx = mlx_quantize(mx.array(w), None)
    np.testing.assert_array_equal(s_mlx, scales)
    np.testing.assert_array_equal(mlx_dequantize(q_mlx, s_mlx, None), np.zeros_like(w))
    np.testing.assert_array_equal(nvfp4.dequantize(codes, scales), np.zeros_like(w))


def test_dequantize_is_the_format_definition() -> None:
    """One group by hand: code 7 (6.0) x scale 0x38 (1.0), code 9 (-0.5) x 0x30 (0.5)."""
    codes = np.zeros((1, 32), dtype=np.uint8)
    codes[0, 0], codes[0, 16], codes[0, 17] = 7, 9, 0xF
    scales = np.array([[0x38, 0x30]], dtype=np.uint8)
    out = nvfp4.dequantize(codes, scales)
    assert out[0, 0] == 6.0 and out[0, 16] == -0.25 and out[0, 17] == -3.0
    assert np.count_nonzero(out) == 3
    with_gs = nvfp4.dequantize(codes, scales, global_scale=2688.0 * 2)
    assert with_gs[0, 0] == 12.0  # raw * global_scale / 2688


def test_e2m1_code_points() -> None:
    assert nvfp4.E2M1_VALUES[:8].tolist() == [0, 0.5, 1, 1.5, 2, 3, 4, 6]
    assert nvfp4.E2M1_VALUES[8:].tolist() == [-0.0, -0.5, -1, -1.5, -2, -3, -4, -6]
    # every code point encodes to itself; beyond 6 saturates
    np.testing.assert_array_equal(nvfp4.encode_e2m1(nvfp4.E2M1_VALUES), np.arange(16, dtype=np.uint8))
    assert nvfp4.encode_e2m1(np.array([100.0, -7.0], dtype=np.float32)).tolist() == [7, 15]


def test_e4m3_every_bit_pattern_round_trips_and_matches_mlx() -> None:
    bits = np.arange(256, dtype=np.uint8)
    values = nvfp4.decode_e4m3(bits)
    finite = ~np.isnan(values)
    assert int(np.count_nonzero(~finite)) == 2  # 0x7F and 0xFF are NaN; E4M3 has no infinity
    np.testing.assert_array_equal(nvfp4.encode_e4m3(values[finite]), bits[finite])
    np.testing.assert_array_equal(values[finite], np.array(mx.from_fp8(mx.array(bits[finite]), dtype=mx.float32)))
    assert values[0x7E] == 448.0 and values[0x01] == 2.0**-9 and values[0x38] == 1.0
    # rounding of arbitrary floats, saturation and subnormals, against MLX's own conversion
    rng, seed = fresh_rng()
    x = np.concatenate(
        [
            rng.standard_normal(4000).astype(np.float32) * np.float32(100),
            rng.uniform(-0.02, 0.02, 4000).astype(np.float32),
            np.array([448.0, 463.9, 464.0, 1e6, -1e6, 2.0**-10, 0.0], dtype=np.float32),
        ]
    )
    np.testing.assert_array_equal(nvfp4.encode_e4m3(x), np.array(mx.to_fp8(mx.array(x))), err_msg=f"seed={seed}")


@pytest.mark.skipif(not ON_CPU, reason="pins the tie rule of MLX's CPU backend")
def test_exact_ties_follow_mlx_cpu_and_differ_from_nearest_even() -> None:
    ties = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.75, -3.5, -0.1], dtype=np.float32)
    w = np.zeros((1, 32), dtype=np.float32)
    w[0, 0] = 6.0  # block scale exactly 1.0
    w[0, 1 : 1 + ties.size] = ties
    q_mlx, _ = mlx_quantize(mx.array(w), None)
    cpu_codes, _ = nvfp4.quantize(w, like="mlx-cpu")
    np.testing.assert_array_equal(nvfp4.pack_codes(cpu_codes), q_mlx)
    rne = nvfp4.E2M1_VALUES[nvfp4.quantize(w, like="mlx-gpu")[0][0, 1 : 1 + ties.size]]
    down = nvfp4.E2M1_VALUES[cpu_codes[0, 1 : 1 + ties.size]]
    assert rne.tolist() == [0, 1, 1, 2, 2, 4, 4, -1, -4, -0.0]
    assert down.tolist() == [0, 0.5, 1, 1.5, 2, 3, 4, -0.5, -3, 0]


def test_pack_layout_is_low_nibble_first() -> None:
    codes = np.arange(1, 9, dtype=np.uint8)[None, :]
    assert nvfp4.pack_codes(codes).tolist() == [[0x87654321]]
    rng, _ = fresh_rng()
    many = rng.integers(0, 16, size=(3, 5, 64), dtype=np.uint8)
    np.testing.assert_array_equal(nvfp4.unpack_codes(nvfp4.pack_codes(many)), many)


def test_global_scale_convention_round_trip() -> None:
    """A ModelOpt checkpoint stores weight_scale_2 = amax / 2688 (its decode scale). Converted, it
    round-trips through MLX; passed straight in as MLX's global_scale it is wrong by ~100 %."""
    rng, seed = fresh_rng()
    w = rng.standard_normal((32, 256), dtype=np.float32) * np.float32(0.05)
    weight_scale_2 = np.float32(np.abs(w).max() / 2688.0)
    gs = nvfp4.global_scale_from_modelopt(weight_scale_2)
    assert np.isclose(gs, np.abs(w).max(), rtol=1e-6)
    codes, scales = nvfp4.quantize(w, gs, like=LIKE)
    q, s = mx.array(nvfp4.pack_codes(codes)), mx.array(scales)

    def rel(a: np.ndarray) -> float:
        return float(np.linalg.norm(a - w) / np.linalg.norm(w))

    right = np.array(mx.dequantize(q, s, mode="nvfp4", global_scale=scale_array(gs), dtype=mx.float32))
    wrong = np.array(mx.dequantize(q, s, mode="nvfp4", global_scale=scale_array(weight_scale_2), dtype=mx.float32))
    assert rel(right) < 0.15, f"seed={seed}"  # NVFP4's own quantization error on Gaussian weights
    assert rel(wrong) > 0.99, f"seed={seed}"
    assert rel(nvfp4.dequantize(codes, scales, weight_scale_2)) > 0.99
    np.testing.assert_array_equal(nvfp4.dequantize(codes, scales, gs, dtype=np.float32), right)
    # and MLX quantizing with the converted scale makes the same codes as the reference
    q_mlx, s_mlx = mlx_quantize(mx.array(w), gs)
    np.testing.assert_array_equal(s_mlx, scales)
    np.testing.assert_array_equal(q_mlx, nvfp4.pack_codes(codes))


def test_rejects_a_last_axis_not_divisible_by_16() -> None:
    with pytest.raises(ValueError, match="divisible by 16"):
        nvfp4.quantize(np.ones((2, 24), dtype=np.float32))


@pytest.mark.parametrize("global_scale", [None, 3.7])
@pytest.mark.parametrize("dtype", [np.float64, np.float32, np.float16])
def test_dequantize_packed_is_dequantize_of_the_unpacked_codes_bit_for_bit(
    global_scale: float | None, dtype: type
) -> None:
    """The table route (what the float64 references use) against the definition: every word,
    every one of the 256 scale bit patterns (NaN, subnormals, negative scales included), the
    sign of each zero too, over a leading axis as an MoE's experts have."""
    rng, seed = fresh_rng()
    packed = rng.integers(0, 2**32, size=(3, 256, 64), dtype=np.uint32)  # k = 512: 32 groups per row
    scales = rng.integers(0, 256, size=(3, 256, 32), dtype=np.uint8)
    scales[0, :8] = np.arange(256, dtype=np.uint8).reshape(8, 32)  # every bit pattern at least once
    want = nvfp4.dequantize(nvfp4.unpack_codes(packed), scales, global_scale, dtype)
    got = nvfp4.dequantize_packed(packed, scales, global_scale, dtype)
    assert got.dtype == want.dtype and got.shape == want.shape == (3, 256, 512), seed
    np.testing.assert_array_equal(got, want, err_msg=f"seed {seed}")
    assert np.array_equal(np.signbit(got), np.signbit(want)), seed
    assert np.isnan(got).any() and (got != 0).any()  # the NaN scales decode as NaN: nothing was skipped


def test_dequantize_packed_refuses_scales_of_another_shape() -> None:
    with pytest.raises(ValueError, match="does not match"):
        nvfp4.dequantize_packed(np.zeros((4, 8), dtype=np.uint32), np.zeros((4, 3), dtype=np.uint8))
