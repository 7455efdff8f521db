"""Weights drawn and quantized on the device: reproducible, the codes of their own draws, decoded on
the host exactly as MLX decodes them, with each global-scale convention."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from kernels import device_nvfp4, nvfp4
from kernels.device_nvfp4 import DeviceWeights


def _mlx_values(w: DeviceWeights) -> np.ndarray:
    """MLX's own float32 decode of `w` (per leading index where the global scale is per index)."""
    gs = w.global_scale
    if gs is None or gs.ndim == 0:
        return np.array(mx.dequantize(w.packed, w.scales, mode="nvfp4", global_scale=gs, dtype=mx.float32))
    return np.stack([_mlx_values(w.at(i)) for i in range(w.packed.shape[0])])


def test_the_same_seed_gives_the_same_weights_and_another_seed_others() -> None:
    a = device_nvfp4.draw_weights((32, 64), np.random.default_rng(5), device_nvfp4.normal())
    b = device_nvfp4.draw_weights((32, 64), np.random.default_rng(5), device_nvfp4.normal())
    c = device_nvfp4.draw_weights((32, 64), np.random.default_rng(6), device_nvfp4.normal())
    assert np.array_equal(np.array(a.packed), np.array(b.packed))
    assert np.array_equal(np.array(a.scales), np.array(b.scales))
    assert np.mean(np.array(a.packed) != np.array(c.packed)) > 0.9
    assert a.shape == (32, 64) and a.packed.dtype == mx.uint32 and a.scales.dtype == mx.uint8


@pytest.mark.parametrize("convention", ["none", "tensor"])
def test_codes_are_the_reference_quantization_of_the_draws(convention: str) -> None:
    """The device's codes and scales are what the NumPy definition makes of the same draws, and the
    host decode equals MLX's, bit for bit in float32."""
    draw = device_nvfp4.uniform(0.25) if convention == "tensor" else device_nvfp4.normal()
    w = device_nvfp4.draw_weights((48, 128), np.random.default_rng(11), draw, global_scale=convention)
    values = np.array(device_nvfp4.draw_values((48, 128), np.random.default_rng(11), draw))
    gs = w.global_scales()
    if convention == "tensor":
        assert gs is not None and gs == np.float32(np.max(np.abs(values)))  # the natural scale
    else:
        assert gs is None
    codes, scales = nvfp4.quantize(values, gs)
    got_codes, got_scales = w.host()
    np.testing.assert_array_equal(got_scales, scales)
    np.testing.assert_array_equal(got_codes, codes)
    np.testing.assert_array_equal(w.dequantized().astype(np.float32), _mlx_values(w))
    # quantization error of a 4-bit format: a few percent, not zero, not wild
    err = np.linalg.norm(w.dequantized() - values) / np.linalg.norm(values)
    assert 0.02 < err < 0.2


def test_experts_each_have_their_own_scale_and_magnitude() -> None:
    def magnitude(key: mx.array, count: int) -> mx.array:
        return mx.power(10.0, mx.random.uniform(-1.0, 1.0, (count, 1, 1), key=key))

    rng = np.random.default_rng(2)
    w = device_nvfp4.draw_weights((6, 16, 64), rng, device_nvfp4.normal(), global_scale="leading", magnitude=magnitude)
    values = np.array(
        device_nvfp4.draw_values((6, 16, 64), np.random.default_rng(2), device_nvfp4.normal(), magnitude=magnitude)
    )
    gs = w.global_scales()
    assert gs is not None and gs.shape == (6,)
    np.testing.assert_array_equal(gs, np.max(np.abs(values), axis=(1, 2)))
    assert gs.max() / gs.min() > 2  # magnitudes differ by expert
    deq = w.dequantized()
    np.testing.assert_array_equal(deq.astype(np.float32), _mlx_values(w))
    for e in range(6):
        np.testing.assert_array_equal(w.at(e).dequantized(), deq[e])
        codes, _ = nvfp4.quantize(values[e], gs[e])
        np.testing.assert_array_equal(w.at(e).host()[0], codes)


def test_rows_read_back_are_those_rows() -> None:
    w = device_nvfp4.draw_weights((40, 32), np.random.default_rng(3), device_nvfp4.normal())
    rows = np.array([0, 7, 39, 12])
    np.testing.assert_array_equal(w.dequantized(rows), w.dequantized()[rows])
    e = device_nvfp4.draw_weights((3, 40, 32), np.random.default_rng(3), device_nvfp4.normal(), global_scale="leading")
    np.testing.assert_array_equal(e.at(1).dequantized(rows), e.dequantized()[1][rows])


def test_blocks_and_host_threads_change_nothing_but_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    """Drawn in many blocks (each its own key), the tensor's global scale is still its amax over all
    blocks; quantized in many host chunks, the codes are those of one call."""
    monkeypatch.setattr(device_nvfp4, "BLOCK_VALUES", 10 * 64)
    monkeypatch.setattr(device_nvfp4, "HOST_ROWS", 3)
    draw = device_nvfp4.uniform(1.0)
    w = device_nvfp4.draw_weights((45, 64), np.random.default_rng(4), draw, global_scale="tensor")
    values = np.array(device_nvfp4.draw_values((45, 64), np.random.default_rng(4), draw))
    gs = np.float32(np.max(np.abs(values)))
    assert w.global_scales() == gs
    codes, scales = nvfp4.quantize(values, gs)
    np.testing.assert_array_equal(w.host()[0], codes)
    np.testing.assert_array_equal(w.host()[1], scales)
    assert w.packed.shape == (45, 8)


def test_bad_shapes_and_conventions_are_refused() -> None:
    with pytest.raises(ValueError, match="divisible by 16"):
        device_nvfp4.draw_weights((4, 40), np.random.default_rng(0), device_nvfp4.normal())
    with pytest.raises(ValueError, match="global_scale"):
        device_nvfp4.draw_weights((4, 32), np.random.default_rng(0), device_nvfp4.normal(), global_scale="row")
