"""Generated NVFP4 decoder checkpoints and their load paths (native, affine repack, custom kernels)."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten, tree_unflatten

from kernels import nvfp4
from kernels.checkpoint import DecoderConfig, write_checkpoint
from kernels.cuda import cuda_backend_available
from kernels.model import (
    AFFINE_GROUP_SIZE,
    AFFINE_TOLERANCE,
    PREFILL_CHECK_ROWS,
    ArmUnsupported,
    TensorScaledLinear,
    check_layers,
    load_decoder,
)
from kernels.nvfp4_linear import Nvfp4Linear

TINY = {"hidden": 128, "intermediate": 256, "layers": 2, "heads": 2, "vocab": 256}
PROMPT = mx.array([[3, 14, 15, 92, 65, 35, 89, 79]])
LONG_PROMPT = mx.array([[(7 * i + 3) % 256 for i in range(40)]])  # 40 rows: the prefill GEMM's path


def _logits(model: nn.Module, prompt: mx.array = PROMPT) -> np.ndarray:
    out = model(prompt)
    mx.eval(out)
    return np.array(out.astype(mx.float32), dtype=np.float64)


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def _dense_twin(path: Path) -> nn.Module:
    """The same decoder with every NVFP4 layer decoded by the NumPy reference, in float32."""
    import importlib

    config = json.loads((path / "config.json").read_text())
    module = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
    model = module.Model(module.ModelArgs.from_dict(config))
    stored = mx.load(str(path / "model.safetensors"))
    assert isinstance(stored, dict)
    weights: dict[str, mx.array] = {}
    for name, value in stored.items():
        if name.endswith((".scales", ".global_scale")):
            continue
        layer = name.removesuffix(".weight")
        if f"{layer}.scales" in stored:
            codes = nvfp4.unpack_codes(np.array(value))
            scales = np.array(stored[f"{layer}.scales"])
            gs = float(np.array(stored[f"{layer}.global_scale"]))
            value = mx.array(nvfp4.dequantize(codes, scales, gs, dtype=np.float32))
        weights[name] = value
    weights = model.sanitize(weights)
    model.load_weights(list(weights.items()), strict=True)
    model.eval()
    return model


@pytest.mark.parametrize("architecture", ["gemma", "llama"])
def test_checkpoint_is_a_real_nvfp4_checkpoint_on_disk(tmp_path: Path, architecture: str) -> None:
    config = DecoderConfig(architecture=architecture, **TINY)
    dest = write_checkpoint(config, 7, tmp_path / "ckpt")
    assert sorted(p.name for p in dest.iterdir()) == ["config.json", "model.safetensors"]
    cfg = json.loads((dest / "config.json").read_text())
    assert cfg["model_type"] == {"gemma": "gemma3_text", "llama": "llama"}[architecture]
    assert cfg["hidden_size"] == 128 and cfg["num_hidden_layers"] == 2 and cfg["vocab_size"] == 256
    assert cfg["quantization"] == {"group_size": 16, "bits": 4, "mode": "nvfp4"}
    assert cfg["orchestrate"]["global_scale"] == "mlx"
    stored = mx.load(str(dest / "model.safetensors"))
    assert isinstance(stored, dict)
    gate = "model.layers.1.mlp.gate_proj"
    assert stored[f"{gate}.weight"].dtype == mx.uint32 and stored[f"{gate}.weight"].shape == (256, 128 // 8)
    assert stored[f"{gate}.scales"].dtype == mx.uint8 and stored[f"{gate}.scales"].shape == (256, 128 // 16)
    # The global scale is in MLX's convention: about the layer's absolute maximum, not amax / 2688.
    codes = nvfp4.unpack_codes(np.array(stored[f"{gate}.weight"]))
    gs = float(np.array(stored[f"{gate}.global_scale"]))
    dense = nvfp4.dequantize(codes, np.array(stored[f"{gate}.scales"]), gs)
    assert gs == pytest.approx(float(np.abs(dense).max()), rel=0.1)
    assert stored["model.embed_tokens.weight"].dtype == mx.float32  # embeddings stay dense
    assert "model.embed_tokens.scales" not in stored


def test_plain_mlx_lm_refuses_rather_than_dropping_the_scales(tmp_path: Path) -> None:
    from mlx_lm.utils import load_model

    dest = write_checkpoint(DecoderConfig(**TINY), 0, tmp_path / "ckpt")
    with pytest.raises(ValueError, match="global_scale"):
        load_model(dest)


def test_checkpoint_is_written_once_per_config_and_seed(tmp_path: Path) -> None:
    config = DecoderConfig(**TINY)
    assert config.cache_key(0) == DecoderConfig(**TINY).cache_key(0)
    assert config.cache_key(0) != config.cache_key(1)
    assert config.cache_key(0) != DecoderConfig(**{**TINY, "layers": 3}).cache_key(0)
    first = write_checkpoint(config, 0, tmp_path / "a")
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    write_checkpoint(config, 0, tmp_path / "a")
    assert (first / "model.safetensors").stat().st_mtime_ns == stamp
    other = write_checkpoint(config, 1, tmp_path / "b")
    assert (first / "model.safetensors").read_bytes() != (other / "model.safetensors").read_bytes()
    again = write_checkpoint(config, 0, tmp_path / "c")
    assert (first / "model.safetensors").read_bytes() == (again / "model.safetensors").read_bytes()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp dirs left


@pytest.mark.parametrize("architecture", ["gemma", "llama"])
def test_native_is_the_nvfp4_model_and_affine_is_a_repack(tmp_path: Path, architecture: str) -> None:
    dest = write_checkpoint(DecoderConfig(architecture=architecture, **TINY), 0, tmp_path / "ckpt")
    truth = _logits(_dense_twin(dest))

    native = load_decoder(dest, "native")
    layers = [m for _, m in native.model.named_modules() if isinstance(m, TensorScaledLinear)]
    assert len(layers) == 2 * 7  # q, k, v, o, gate, up, down per layer
    assert "tensor-scale multiply" in native.route and native.vocab == 256
    native_err = _rel(_logits(native.model), truth)
    assert native_err < 1e-4, native_err  # the same weights, float32 rounding only

    affine = load_decoder(dest, "affine")
    modes = {m.mode for _, m in affine.model.named_modules() if isinstance(m, nn.QuantizedLinear)}
    assert modes == {"affine"}
    groups = {m.group_size for _, m in affine.model.named_modules() if isinstance(m, nn.QuantizedLinear)}
    assert groups == {AFFINE_GROUP_SIZE}
    assert "repacked from NVFP4" in affine.route
    affine_err = _rel(_logits(affine.model), truth)
    # Requantizing to affine 4-bit loses accuracy (the point of comparing), but it is the same model.
    assert 1e-3 < affine_err < 0.5, affine_err


def _param_bytes(model: nn.Module) -> int:
    return sum(v.nbytes for _, v in tree_flatten(model.parameters()))


@pytest.mark.parametrize("architecture", ["gemma", "llama"])
def test_custom_swaps_every_nvfp4_linear_for_our_kernels_on_the_stored_arrays(
    tmp_path: Path, architecture: str
) -> None:
    dest = write_checkpoint(DecoderConfig(architecture=architecture, **TINY), 0, tmp_path / "ckpt")
    twin = _dense_twin(dest)
    custom = load_decoder(dest, "custom")
    modules = [m for _, m in custom.model.named_modules()]
    assert sum(isinstance(m, Nvfp4Linear) for m in modules) == 2 * 7
    assert not any(isinstance(m, TensorScaledLinear | nn.QuantizedLinear) for m in modules)
    assert custom.route.startswith("custom nvfp4 x14: decode ") and custom.route.endswith("epilogue x14")
    # the decode GEMV (8 rows) and the prefill GEMM (40 rows) paths, against the float32 decode
    for prompt in (PROMPT, LONG_PROMPT):
        err = _rel(_logits(custom.model, prompt), _logits(twin, prompt))
        assert err < 1e-4, err
    # the same arrays as stored: no dequantized or repacked copy (native also keeps a decode scale)
    assert _param_bytes(custom.model) <= _param_bytes(load_decoder(dest, "native").model)


def test_a_dropped_global_scale_is_not_the_same_model(tmp_path: Path) -> None:
    """The global scale matters: the raw NVFP4 products without it give another model entirely."""
    dest = write_checkpoint(DecoderConfig(architecture="llama", **TINY), 0, tmp_path / "ckpt")
    truth = _logits(_dense_twin(dest))
    native = load_decoder(dest, "native")
    for _, module in native.model.named_modules():
        if isinstance(module, TensorScaledLinear):
            module.decode_scale = mx.array(1.0)
    assert _rel(_logits(native.model), truth) > 0.5


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_layer_check_passes_both_arms_and_catches_a_wrong_global_scale(tmp_path: Path, dtype: str) -> None:
    dest = write_checkpoint(DecoderConfig(architecture="gemma", dtype=dtype, **TINY), 0, tmp_path / "ckpt")
    native = check_layers(load_decoder(dest, "native").model, dest, "native", np.random.default_rng(0))
    assert native.layers == 2 * 7  # every NVFP4 linear of the first and the last block
    assert native.rel_error <= native.tolerance
    assert native.rel_error < (1e-5 if dtype == "float32" else 3e-2)
    affine = check_layers(load_decoder(dest, "affine").model, dest, "affine", np.random.default_rng(0))
    assert affine.tolerance == AFFINE_TOLERANCE
    assert 0.02 < affine.rel_error < AFFINE_TOLERANCE  # 4-bit g64 requantization, not rounding
    # ModelOpt's decode scale (amax / 2688) where MLX's (amax) belongs: the classic bug.
    model = load_decoder(dest, "native").model
    for _, module in model.named_modules():
        if isinstance(module, TensorScaledLinear):
            module.decode_scale = module.decode_scale / nvfp4.MLX_GLOBAL_SCALE_DIVISOR
    broken = check_layers(model, dest, "native", np.random.default_rng(0))
    assert broken.rel_error > 0.99 and broken.rel_error > broken.tolerance


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_layer_check_of_custom_covers_both_kernels_and_catches_a_wrong_global_scale(tmp_path: Path, dtype: str) -> None:
    dest = write_checkpoint(DecoderConfig(architecture="gemma", dtype=dtype, **TINY), 0, tmp_path / "ckpt")
    model = load_decoder(dest, "custom").model
    check = check_layers(model, dest, "custom", np.random.default_rng(0))
    assert check.layers == 2 * 7 * 2  # every NVFP4 linear of the first and last block, at 8 and 64 rows
    assert check.rel_error <= check.tolerance and check.rel_error < (1e-5 if dtype == "float32" else 3e-2)
    assert PREFILL_CHECK_ROWS > 8
    # the classic ModelOpt-for-MLX global scale mix-up, in one layer, is caught at its layer
    path, layer = next(
        (p, m) for p, m in model.named_modules() if isinstance(m, Nvfp4Linear) and ".layers.1." in f".{p}"
    )
    wrong = layer.global_scale / nvfp4.MLX_GLOBAL_SCALE_DIVISOR
    model.update_modules(tree_unflatten([(path, Nvfp4Linear(layer.weight, layer.scales, wrong, None))]))
    broken = check_layers(model, dest, "custom", np.random.default_rng(0))
    assert broken.rel_error > 0.99 and broken.layer.startswith(path)


def _mlx_lm_checkpoint(path: Path, mode: str) -> Path:
    """A checkpoint as `mlx_lm.convert -q --q-mode MODE` writes it, from a tiny Llama."""
    from mlx_lm.models import llama
    from mlx_lm.utils import quantize_model, save_config, save_model

    cfg = DecoderConfig(architecture="llama", **TINY).mlx_lm_config()
    mx.random.seed(0)
    model = llama.Model(llama.ModelArgs.from_dict(cfg))
    model, cfg = quantize_model(model, cfg, None, None, mode=mode)
    save_model(path, model)
    save_config(cfg, path / "config.json")
    return path


def test_a_real_mlx_lm_nvfp4_checkpoint_loads_as_it_is(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    dest = _mlx_lm_checkpoint(tmp_path / "nvfp4", "nvfp4")
    native = load_decoder(dest, "native")
    assert native.route.startswith("nvfp4 quantized_matmul") and "tensor-scale" not in native.route
    affine = load_decoder(dest, "affine")
    flat = dict(tree_flatten(affine.model.parameters()))
    assert not [k for k, v in flat.items() if k.endswith(".scales") and v.dtype == mx.uint8]  # no NVFP4 left
    err = _rel(_logits(affine.model), _logits(native.model))
    assert 1e-4 < err < 0.5, err
    custom = load_decoder(dest, "custom")  # mlx-lm's own nvfp4 layers (lm_head too), no global scale
    assert custom.route.startswith("custom nvfp4 x15: ") and "global scale" not in custom.route
    for prompt in (PROMPT, LONG_PROMPT):
        assert _rel(_logits(custom.model, prompt), _logits(native.model, prompt)) < 1e-4


def test_native_on_an_affine_checkpoint_is_unsupported(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    dest = _mlx_lm_checkpoint(tmp_path / "affine", "affine")
    for arm in ("native", "custom"):
        with pytest.raises(ArmUnsupported, match="no NVFP4 layers"):
            load_decoder(dest, arm)
    assert load_decoder(dest, "affine").route.startswith("as stored")


def test_config_validation() -> None:
    with pytest.raises(ValueError, match="architecture"):
        DecoderConfig(architecture="mamba")
    with pytest.raises(ValueError, match="multiple of 64"):
        DecoderConfig(hidden=100)
    assert (
        DecoderConfig(hidden=5376, intermediate=21504, heads=32, kv_heads=16, head_dim=128).mlx_lm_config()[
            "intermediate_size"
        ]
        == 21504
    )


@pytest.mark.cuda
@pytest.mark.skipif(not cuda_backend_available(), reason="needs MLX's CUDA backend (an NVIDIA GPU)")
def test_custom_runs_our_cuda_kernels_and_checks_out_on_cuda(tmp_path: Path) -> None:
    dest = write_checkpoint(DecoderConfig(architecture="gemma", dtype="bfloat16", **TINY), 0, tmp_path / "ckpt")
    custom = load_decoder(dest, "custom")
    assert "(gemv_nvfp4_" in custom.route and "(gemm_nvfp4:" in custom.route, custom.route
    check = check_layers(custom.model, dest, "custom", np.random.default_rng(0))
    assert check.layers == 2 * 7 * 2 and check.rel_error <= check.tolerance
    first, again = _logits(custom.model, LONG_PROMPT), _logits(load_decoder(dest, "custom").model, LONG_PROMPT)
    assert np.array_equal(first, again)  # deterministic: the same greedy tokens in every sample


@pytest.mark.parametrize(("lead", "dtype"), [((1, 1), mx.bfloat16), ((3, 12), mx.float32), ((5,), mx.bfloat16)])
def test_a_custom_layer_resolves_its_kernel_once_per_shape(
    lead: tuple[int, ...], dtype: mx.Dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A decode step calls each linear once per token: after the first call of a shape, the layer
    goes straight to its bound call (no kernel choice again) and computes what `nvfp4_matmul` does."""
    from kernels import nvfp4_linear

    rng = np.random.default_rng(3)
    w = mx.array(rng.standard_normal((48, 64)).astype(np.float32))
    packed, scales = mx.quantize(w, group_size=16, bits=4, mode="nvfp4")[:2]
    bias = mx.array(rng.standard_normal(48).astype(np.float32)).astype(dtype)
    layer = Nvfp4Linear(packed, scales, mx.array(2.5), bias)
    x = mx.array(rng.standard_normal((*lead, 64)).astype(np.float32)).astype(dtype)
    first = layer(x)
    monkeypatch.setattr(nvfp4_linear, "bound_matmul", lambda *a: pytest.fail("kernel chosen again"))
    again = layer(x)
    flat = nvfp4_linear.nvfp4_matmul(x.reshape(-1, 64), packed, scales, mx.array(2.5))
    want = flat.reshape(*lead, 48) + layer.bias
    assert first.shape == (*lead, 48) and first.dtype == dtype
    assert np.array_equal(np.array(first.astype(mx.float32)), np.array(again.astype(mx.float32)))
    np.testing.assert_allclose(np.array(first.astype(mx.float32)), np.array(want.astype(mx.float32)), rtol=1e-6)
