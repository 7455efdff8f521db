"""Generated decoders for the `model` case: their shape (`DecoderConfig`) and their NVFP4 checkpoint.

A `DecoderConfig` describes a Llama- or Gemma-style decoder built from mlx-lm's own model classes
(`mlx_lm.models.llama`, `mlx_lm.models.gemma3_text`: the Gemma GeGLU MLP). `write_checkpoint`
generates its weights locally from a seed and saves a real checkpoint in mlx-lm's layout
(`model.safetensors` + `config.json`), quantized as a ModelOpt export is: every linear layer of the
decoder blocks in NVFP4 with its per-tensor global scale, embeddings and norms left in the model
dtype. The global scale is stored as `<layer>.global_scale` in MLX's convention (about the
tensor's absolute maximum; the layer decodes `raw * global_scale / 2688`, see MLX-NOTES.md), and
`config.json` says so under `"orchestrate"`. Plain `mlx_lm.load` refuses such a checkpoint
(unknown `global_scale` parameters) rather than running it with the scales silently dropped.
`kernels.model` loads such a checkpoint (or any mlx-lm one) for an arm.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from kernels import mlx_lm_classes, shapes

MODEL_TYPES = {"llama": "llama", "gemma": "gemma3_text"}
DTYPES = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}
CHECKPOINT_FORMAT = 1  # bump when the generated layout changes (invalidates cached checkpoints)


@dataclass(frozen=True)
class DecoderConfig:
    """The shape of a generated decoder. `kv_heads`/`head_dim` of 0 mean heads/2 and hidden/heads."""

    architecture: str = "gemma"
    hidden: int = 256
    intermediate: int = 1024
    layers: int = 2
    heads: int = 4
    kv_heads: int = 0
    head_dim: int = 0
    vocab: int = 1024
    dtype: str = "float32"

    def __post_init__(self) -> None:
        shapes.decoder_check(asdict(self))  # the rule the head checked the sweep's points with

    @property
    def resolved_kv_heads(self) -> int:
        return self.kv_heads or max(1, self.heads // 2)

    @property
    def resolved_head_dim(self) -> int:
        return self.head_dim or self.hidden // self.heads

    def mlx_lm_config(self) -> dict[str, Any]:
        """The model's `config.json` as mlx-lm reads it (without the quantization keys)."""
        common: dict[str, Any] = {
            "model_type": MODEL_TYPES[self.architecture],
            "hidden_size": self.hidden,
            "intermediate_size": self.intermediate,
            "num_hidden_layers": self.layers,
            "num_attention_heads": self.heads,
            "num_key_value_heads": self.resolved_kv_heads,
            "head_dim": self.resolved_head_dim,
            "vocab_size": self.vocab,
            "rms_norm_eps": 1e-6,
            "max_position_embeddings": 131072,
            "torch_dtype": self.dtype,
        }
        if self.architecture == "gemma":
            # Gemma 3 layout: 5 sliding-window layers per global one (fewer in a model of fewer than
            # 6 layers: mlx-lm needs the pattern's global layer to exist), GeGLU MLP, tied embeddings.
            common |= {
                "query_pre_attn_scalar": self.resolved_head_dim,
                "sliding_window": 1024,
                "sliding_window_pattern": min(6, self.layers),
                "rope_theta": 1_000_000.0,
            }
        else:
            common |= {"rope_theta": 500_000.0, "tie_word_embeddings": False}
        return common

    def cache_key(self, seed: int) -> str:
        """A short hash naming the checkpoint of this config and seed."""
        blob = json.dumps({"config": asdict(self), "seed": seed, "format": CHECKPOINT_FORMAT}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


def model_classes(config: dict[str, Any]) -> tuple[Any, Any]:
    module = mlx_lm_classes.import_models(config["model_type"])
    return module.Model, module.ModelArgs


def _is_block_linear(path: str, module: nn.Module) -> bool:
    # ModelOpt NVFP4 exports quantize the decoder blocks' linears; embeddings and lm_head stay dense.
    return isinstance(module, nn.Linear) and ".layers." in f".{path}"


def write_checkpoint(config: DecoderConfig, seed: int, dest: Path) -> Path:
    """Generate a decoder's weights from `seed` and save them as an NVFP4 checkpoint at `dest`.

    Written into a temporary directory beside `dest` and renamed into place, so a reader never
    sees half a checkpoint; when `dest` already exists it is returned untouched.

    Returns:
        `dest`.
    """
    if (dest / "config.json").exists():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.parent / f".{dest.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        mx.random.seed(seed)
        cfg = config.mlx_lm_config()
        model_class, args_class = model_classes(cfg)
        model = model_class(args_class.from_dict(cfg))
        dtype = DTYPES[config.dtype]
        weights: dict[str, mx.array] = {}
        blocks = {p for p, m in model.named_modules() if _is_block_linear(p, m)}
        params: list[tuple[str, mx.array]] = tree_flatten(model.parameters())  # type: ignore[assignment]
        for name, value in params:
            layer = name.rsplit(".", 1)[0]
            if layer in blocks and name.endswith(".weight"):
                w = value.astype(mx.float32)
                gs = mx.max(mx.abs(w))
                packed, scales, *_ = mx.quantize(w, mode="nvfp4", global_scale=gs)
                weights[f"{layer}.weight"], weights[f"{layer}.scales"] = packed, scales
                weights[f"{layer}.global_scale"] = gs
                mx.eval(packed, scales, gs)  # one layer at a time keeps the peak small
            else:
                weights[name] = value.astype(dtype)
                mx.eval(weights[name])
        mx.save_safetensors(str(tmp / "model.safetensors"), weights, metadata={"format": "mlx"})
        quantization = {"group_size": 16, "bits": 4, "mode": "nvfp4"}
        cfg |= {
            "quantization": quantization,
            "quantization_config": quantization,
            "orchestrate": {
                "generator": "kernels.checkpoint",
                "format": CHECKPOINT_FORMAT,
                "seed": seed,
                "global_scale": "mlx",  # <layer>.global_scale, decoded as raw * gs / 2688
            },
        }
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True))
        try:
            os.rename(tmp, dest)
        except OSError:
            if not (dest / "config.json").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest
