"""Whole decoders for the `model` case: a checkpoint loaded as an engine would for one arm, and checked.

The checkpoints are mlx-lm model directories: the generated NVFP4 ones of `kernels.checkpoint`
(`DecoderConfig`, `write_checkpoint`) or any other.

`load_decoder(path, arm)` loads a checkpoint as an engine would for one arm:

* `native`: NVFP4 stays NVFP4; each layer runs `mx.quantized_matmul(mode="nvfp4")` and then its
  tensor-scale multiply (mlx-lm's `QuantizedLinear` takes no global scale: the "sidecar" route).
* `affine`: the fallback an engine takes where native NVFP4 is slow: each NVFP4 layer is
  dequantized (global scale included) and repacked at load time to affine 4-bit, group 64. The
  repack is part of the load, as it is in the engine, so it shows in load time and peak memory.
* `custom`: NVFP4 as stored, every NVFP4 linear of the decoder swapped at load for
  `kernels.nvfp4_linear.Nvfp4Linear` (the same arrays): our decode GEMV for M <= 8 rows (decode
  steps), our prefill GEMM above, the global scale fused into their epilogue; the kernels' MLX
  twins where MLX has no CUDA backend (the route says which).

Any mlx-lm checkpoint directory (e.g. an `-nvfp4` conversion) loads through `mlx_lm` as it is;
`native` then needs NVFP4 layers in it and says so with `ArmUnsupported` when there are none.

`check_layers` is the case's correctness check: the loaded layers of the first and last block
against the checkpoint's codes and scales read back from disk and decoded by `kernels.nvfp4`
(for `custom` at a decode and at a prefill row count, one per kernel).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

from kernels import mlx_lm_classes, nvfp4, qmm, shapes
from kernels.checkpoint import model_classes
from kernels.gemv_nvfp4 import TOLERANCE as KERNEL_TOLERANCE
from kernels.nvfp4 import MLX_GLOBAL_SCALE_DIVISOR
from kernels.nvfp4_linear import Nvfp4Linear, matmul_route

ARMS = ("native", "affine", "custom")
AFFINE_GROUP_SIZE = shapes.AFFINE_GROUP
AFFINE_BITS = shapes.AFFINE_BITS
AFFINE_TOLERANCE = 0.3  # an affine-repacked layer against the NVFP4 reference (see check_layers)
PREFILL_CHECK_ROWS = 64  # rows of the custom arm's second layer check: the prefill GEMM's path


class ArmUnsupported(Exception):
    """This arm cannot run on this checkpoint (the reason is the message)."""


class TensorScaledLinear(nn.Module):
    """An NVFP4 linear layer whose per-tensor global scale is one multiply after the product."""

    def __init__(self, inner: nn.QuantizedLinear, global_scale: mx.array) -> None:
        super().__init__()
        self.inner = inner
        self.global_scale = global_scale.astype(mx.float32).reshape(())  # MLX's convention, as stored
        self.decode_scale = self.global_scale / MLX_GLOBAL_SCALE_DIVISOR
        self.freeze()

    def __call__(self, x: mx.array) -> mx.array:
        return self.inner(x) * self.decode_scale.astype(x.dtype)


@dataclass
class LoadedDecoder:
    """A model ready to run one arm, and what it really runs."""

    model: nn.Module
    config: dict[str, Any]
    route: str
    vocab: int
    parts: dict[str, float] = field(default_factory=dict)  # seconds of each part of the load (`LOAD_PARTS`)


def _load_generated(path: Path, config: dict[str, Any], clock: _PartClock) -> nn.Module:
    weights = _stored(path)
    mx.eval(weights)  # read here, so that the disk's share is its own part
    clock.lap("reading")
    suffix = ".global_scale"
    tensor_scales = {k[: -len(suffix)]: weights.pop(k) for k in list(weights) if k.endswith(suffix)}
    model_class, args_class = model_classes(config)
    model = model_class(args_class.from_dict(config))
    weights = model.sanitize(weights)
    quant = config["quantization"]
    nn.quantize(
        model,
        group_size=quant["group_size"],
        bits=quant["bits"],
        mode=quant["mode"],
        class_predicate=lambda p, m: hasattr(m, "to_quantized") and f"{p}.scales" in weights,
    )
    model.eval()
    model.load_weights(list(weights.items()), strict=True)
    modules = dict(model.named_modules())
    missing = sorted(set(tensor_scales) - set(modules))
    if missing:
        raise ValueError(f"{path}: global scales for unknown layers {missing[:3]}")
    scaled = [(p, TensorScaledLinear(modules[p], gs)) for p, gs in tensor_scales.items()]
    model.update_modules(tree_unflatten(scaled))
    clock.lap("building")
    return model


# The parts of a load, in order: the checkpoint's arrays read from disk; the model's modules made
# and the arrays put in them; the arm's conversion (affine's repack to 4-bit g64, custom's swap to
# our layers); everything left evaluated on the device. An mlx-lm checkpoint is read lazily by
# mlx-lm's loader: its reads fall in `evaluating`.
LOAD_PARTS = ("reading", "building", "repacking", "evaluating")


class _PartClock:
    """Seconds per part of a load: each `lap` closes the part that ran since the previous one."""

    def __init__(self) -> None:
        self.parts = dict.fromkeys(LOAD_PARTS, 0.0)
        self._mark = time.perf_counter()

    def lap(self, part: str) -> None:
        now = time.perf_counter()
        self.parts[part] += now - self._mark
        self._mark = now


@dataclass
class LayerCheck:
    """How far an arm's loaded layers are from the NVFP4 reference (the worst layer)."""

    rel_error: float
    layer: str
    layers: int
    tolerance: float


def _stored(path: Path) -> dict[str, mx.array]:
    stored: dict[str, mx.array] = {}
    for shard in sorted(path.glob("model*.safetensors")):
        stored.update(mx.load(str(shard)))  # type: ignore[arg-type]
    return stored


def check_layers(
    model: nn.Module, path: Path, arm: str, rng: np.random.Generator, rows: int = 8, out_rows: int = 256
) -> LayerCheck:
    """Each NVFP4 linear of the first and last decoder block, as loaded for `arm`, against the reference.

    The reference is the checkpoint's own codes and scales read back from disk and decoded by
    `kernels.nvfp4` in float64 (global scale included where stored), times random activations:
    independent of the loader it checks, and at the layer, where a wrong or dropped global scale
    gives an error near 1 (Gemma's sandwich norms hide such a scale from the logits). `native`
    may show rounding (`kernels.qmm.tolerance`, plus 2 u where the tensor scale is one more
    multiply in the dtype), `custom` that or its kernels' own bound (`kernels.gemv_nvfp4.TOLERANCE`),
    checked at `rows` (the decode GEMV) and `PREFILL_CHECK_ROWS` (the prefill GEMM); `affine` also
    its requantization to 4-bit g64, which on these weights stays near 0.1 (`AFFINE_TOLERANCE`
    allows 0.3).
    """
    stored = _stored(path)
    modules = dict(model.named_modules())
    layer_ids = sorted({int(k.split(".layers.")[1].split(".")[0]) for k in stored if ".layers." in k})
    blocks = {f".layers.{layer_ids[0]}.", f".layers.{layer_ids[-1]}."} if layer_ids else set()
    checked: list[tuple[float, float, str]] = []  # (relative error, tolerance, layer)
    dtype = _model_dtype(model)
    dtype_name = {mx.float32: "float32", mx.bfloat16: "bfloat16", mx.float16: "float16"}.get(dtype, "float32")
    for name in sorted(stored):
        layer = name.removesuffix(".scales")
        if not name.endswith(".scales") or not any(b in f".{layer}." for b in blocks) or layer not in modules:
            continue
        scales = np.array(stored[name])
        if scales.dtype != np.uint8 or stored[f"{layer}.weight"].shape[-1] * 8 != scales.shape[-1] * 16:
            continue  # not NVFP4 on disk
        gs = float(np.array(stored[f"{layer}.global_scale"])) if f"{layer}.global_scale" in stored else None
        # A random subset of output rows keeps the float64 decode cheap at 5376 x 21504; a wrong
        # scale or layout shows in any of them.
        picked = np.sort(rng.choice(scales.shape[0], size=min(scales.shape[0], out_rows), replace=False))
        packed = np.array(stored[f"{layer}.weight"])[picked]
        w = nvfp4.dequantize_packed(packed, scales[picked], gs)
        if arm == "affine":
            tol = AFFINE_TOLERANCE
        else:
            tol = qmm.tolerance("native", dtype_name, w.shape[1], qmm.mlx_backend())
            if isinstance(modules[layer], TensorScaledLinear):
                tol += 2 * qmm.UNIT_ROUNDOFF[dtype_name]  # the scale and its product rounded to the dtype
            if isinstance(modules[layer], Nvfp4Linear):  # our kernels' own bound (the GEMV's
                tol = max(tol, KERNEL_TOLERANCE[dtype_name])  # float32 x: a bf16 pair, 2^-16)
        # the custom layers route by row count: check the decode GEMV and the prefill GEMM
        row_counts = (rows, PREFILL_CHECK_ROWS) if isinstance(modules[layer], Nvfp4Linear) else (rows,)
        for count in row_counts:
            x_mx = mx.array(rng.standard_normal((count, w.shape[1])).astype(np.float32)).astype(dtype)
            ref = np.array(x_mx.astype(mx.float32), dtype=np.float64) @ w.T
            got = np.array(modules[layer](x_mx).astype(mx.float32), dtype=np.float64)[:, picked]
            rel = float(np.linalg.norm(got - ref) / max(float(np.linalg.norm(ref)), 1e-30))
            checked.append(
                (
                    rel if np.isfinite(rel) else float("inf"),
                    tol,
                    f"{layer} (M={count})" if len(row_counts) > 1 else layer,
                )
            )
    if not checked:
        return LayerCheck(0.0, "", 0, 0.0)
    rel, tol, layer = max(checked, key=lambda c: c[0] / c[1])
    return LayerCheck(rel, layer, len(checked), tol)


def _nvfp4_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Every NVFP4 layer: generated (tensor-scaled) linears, and plain mlx-lm linears and embeddings."""
    out: list[tuple[str, nn.Module]] = []
    for path, module in model.named_modules():
        if path.endswith(".inner"):
            continue  # the QuantizedLinear inside a TensorScaledLinear
        if isinstance(module, TensorScaledLinear) or (
            isinstance(module, nn.QuantizedLinear | nn.QuantizedEmbedding) and module.mode == "nvfp4"
        ):
            out.append((path, module))
    return out


def _repack_affine(model: nn.Module, layers: list[tuple[str, nn.Module]], dtype: mx.Dtype) -> None:
    """Dequantize each NVFP4 layer (global scale included) and requantize it to affine, in place."""
    for path, module in layers:
        inner = module.inner if isinstance(module, TensorScaledLinear) else module
        w = mx.dequantize(inner.weight, inner.scales, group_size=16, bits=4, mode="nvfp4", dtype=mx.float32)
        if isinstance(module, TensorScaledLinear):
            w = w * module.decode_scale
        out_dims, in_dims = w.shape
        affine: nn.Module
        if isinstance(inner, nn.QuantizedEmbedding):
            table = nn.Embedding(out_dims, in_dims)
            table.weight = w.astype(dtype)
            affine = nn.QuantizedEmbedding.from_embedding(table, AFFINE_GROUP_SIZE, AFFINE_BITS, mode="affine")
        else:
            dense = nn.Linear(in_dims, out_dims, bias="bias" in inner)
            dense.weight = w.astype(dtype)
            if "bias" in inner:
                dense.bias = inner.bias
            affine = nn.QuantizedLinear.from_linear(dense, AFFINE_GROUP_SIZE, AFFINE_BITS, mode="affine")
        mx.eval(affine.parameters())  # one layer at a time, as an engine's load-time repack
        model.update_modules(tree_unflatten([(path, affine)]))


def _swap_custom(model: nn.Module, layers: list[tuple[str, nn.Module]]) -> list[Any]:
    """Every NVFP4 linear (generated tensor-scaled ones and mlx-lm's own, lm_head included) ->
    `Nvfp4Linear`, on the same arrays; NVFP4 embeddings stay as they are. Returns the new layers."""
    swapped: list[tuple[str, nn.Module]] = []
    for path, module in layers:
        if isinstance(module, TensorScaledLinear):
            swapped.append((path, Nvfp4Linear.from_quantized(module.inner, module.global_scale)))
        elif isinstance(module, nn.QuantizedLinear):
            swapped.append((path, Nvfp4Linear.from_quantized(module)))
    if swapped:
        model.update_modules(tree_unflatten(swapped))
    return [m for _, m in swapped]


def _custom_route(swapped: list[Any], dtype: mx.Dtype) -> str:
    """The custom arm's route: what decode steps and prefill chunks of the first layer run."""
    n, k = swapped[0].shape
    name = {mx.float32: "float32", mx.bfloat16: "bfloat16", mx.float16: "float16"}.get(dtype, "float32")
    decode, prefill = matmul_route(1, n, k, name), matmul_route(512, n, k, name)
    scaled = sum("global_scale" in m for m in swapped)
    fused = f", global scale in the epilogue x{scaled}" if scaled else ""
    return f"custom nvfp4 x{len(swapped)}: decode {decode}, prefill {prefill}{fused}"


def _model_dtype(model: nn.Module) -> mx.Dtype:
    """The dtype the model computes in: that of its first floating parameter (norms, embeddings)."""
    params: list[tuple[str, mx.array]] = tree_flatten(model.parameters())  # type: ignore[assignment]
    for _, value in params:
        if mx.issubdtype(value.dtype, mx.floating):
            return value.dtype
    return mx.float32


def load_decoder(path: Path, arm: str) -> LoadedDecoder:
    """Load a checkpoint for one arm (see the module docstring) and evaluate its weights; the result's
    `parts` say how long each part of the load took (`LOAD_PARTS`).

    Raises:
        ArmUnsupported: `native` on a checkpoint without NVFP4 layers.
        ValueError: an unknown arm or a malformed checkpoint.
    """
    if arm not in ARMS:
        raise ValueError(f"unknown arm {arm!r} (known: {', '.join(ARMS)})")
    clock = _PartClock()
    config = json.loads((path / "config.json").read_text())
    if "orchestrate" in config:
        model = _load_generated(path, config, clock)
    else:
        # a real mlx-lm checkpoint, loaded as mlx-lm does
        model, config = mlx_lm_classes.import_full("utils").load_model(path, lazy=True)
        clock.lap("building")
    layers = _nvfp4_layers(model)
    scaled = sum(isinstance(m, TensorScaledLinear) for _, m in layers)
    if arm in ("native", "custom") and not layers:
        raise ArmUnsupported(f"{path} has no NVFP4 layers (quantization: {config.get('quantization')})")
    if arm == "native":
        route = f"nvfp4 quantized_matmul x{len(layers)}" + (
            f", tensor-scale multiply after the product x{scaled}" if scaled else ""
        )
    elif arm == "custom":
        swapped = _swap_custom(model, layers)
        if not swapped:
            raise ArmUnsupported(f"{path} has NVFP4 embeddings but no NVFP4 linear layers")
        route = _custom_route(swapped, _model_dtype(model))
    elif layers:
        _repack_affine(model, layers, _model_dtype(model))
        route = f"affine {AFFINE_BITS}-bit g{AFFINE_GROUP_SIZE}, repacked from NVFP4 at load x{len(layers)}"
    else:
        route = f"as stored (quantization: {config.get('quantization')})"
    clock.lap("repacking")
    mx.eval(model.parameters())
    mx.synchronize()
    clock.lap("evaluating")
    vocab = int(config.get("vocab_size") or config.get("text_config", {}).get("vocab_size", 0))
    return LoadedDecoder(model=model, config=config, route=route, vocab=vocab, parts=clock.parts)
