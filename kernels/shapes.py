"""Which parameter points each case can run, and the fewest bytes its arrays hold on the device.

Pure Python (no MLX), so the head checks every point of a sweep before anything starts; each
case's own `build` applies the same rule, so there is one rule per case with two callers. A rule
raises `ValueError` naming the parameter, the value found and what is allowed. A `*_bytes`
function is a lower bound: the arrays one job must hold on its device at the same time (weights of
every arm it builds, inputs, outputs), never the NumPy reference's copies on the host, so a point
it refuses cannot run on a device of that memory whatever else is going on.

Each function takes the point's parameters with the case's defaults filled in
(`kernels.registry.check_point` does that).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from kernels.nvfp4 import GROUP_SIZE

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
AFFINE_GROUP = 64  # the affine fallback's group: 4-bit levels, one scale and one bias per 64 weights
AFFINE_BITS = 4
NVFP4_BYTES_PER_WEIGHT = 0.5 + 1 / GROUP_SIZE  # a 4-bit code plus its share of one E4M3 scale

Params = Mapping[str, Any]


def _at_least(params: Params, names: Iterable[str], low: int = 1) -> None:
    for name in names:
        value = params[name]
        if value < low:
            raise ValueError(f"{name} = {value}: must be at least {low}")


def _dtype(params: Params) -> int:
    """The dtype's bytes per element; an unknown dtype is a `ValueError` listing the known ones."""
    name = params["dtype"]
    if name not in DTYPE_BYTES:
        raise ValueError(f"dtype = {name!r}: not one of {', '.join(DTYPE_BYTES)}")
    return DTYPE_BYTES[name]


def _multiple(params: Params, name: str, of: int, why: str) -> None:
    value = params[name]
    if value % of:
        lower, upper = value - value % of, value - value % of + of
        nearest = f"{lower} or {upper}" if lower else str(upper)
        raise ValueError(f"{name} = {value}: not a multiple of {of}, {why} (nearest: {nearest})")


def _affine_bytes(weights: int, itemsize: int) -> int:
    return weights * AFFINE_BITS // 8 + 2 * (weights // AFFINE_GROUP) * itemsize


# ------------------------------------------------------------------------------------------- qmm


def qmm_check(params: Params) -> None:
    """`qmm`: tokens, n, k >= 1; k (the reduction axis) a multiple of the NVFP4 group; a known dtype."""
    _at_least(params, ("tokens", "n", "k"))
    _multiple(params, "k", GROUP_SIZE, "the NVFP4 group size (one E4M3 scale per 16 weights along k)")
    _dtype(params)


def qmm_bytes(params: Params, arms: Iterable[str]) -> int:
    """NVFP4 weights, x and y, plus each arm's own copy (dense, affine, dequantized)."""
    m, n, k, s = params["tokens"], params["n"], params["k"], _dtype(params)
    arms = set(arms)
    total = int(n * k * NVFP4_BYTES_PER_WEIGHT) + m * k * s + m * n * s
    if "dense" in arms:
        total += n * k * s
    if "dequant-gemm" in arms:  # the dequantized matrix lives for the length of each call
        total += n * k * s
    if "affine" in arms and k % AFFINE_GROUP == 0:
        total += _affine_bytes(n * k, s)
    return total


# ------------------------------------------------------------------------------------ moe-gather


def moe_check(params: Params) -> None:
    """`moe-gather`: every size >= 1, top_k <= experts, hidden a multiple of the NVFP4 group."""
    _at_least(params, ("experts", "top_k", "tokens", "hidden", "expert_width"))
    if params["top_k"] > params["experts"]:
        raise ValueError(
            f"top_k = {params['top_k']}: more than experts = {params['experts']} "
            "(each token is routed to top_k distinct experts)"
        )
    _multiple(params, "hidden", GROUP_SIZE, "the NVFP4 group size (one E4M3 scale per 16 weights along hidden)")
    _dtype(params)


def moe_bytes(params: Params, arms: Iterable[str]) -> int:
    """Every expert's NVFP4 weights (and the affine copy), then the larger of: x, the routing and
    y [T, top_k, F] while it runs, or the dense copy of the experts the affine arms are built from."""
    e, k, t = params["experts"], params["top_k"], params["tokens"]
    d, f, s = params["hidden"], params["expert_width"], _dtype(params)
    weights = e * f * d
    held = int(weights * NVFP4_BYTES_PER_WEIGHT) + 4 * e
    building = 0
    if any(a.startswith("affine") for a in arms) and d % AFFINE_GROUP == 0:
        held += _affine_bytes(weights, s)
        building = weights * s
    running = t * d * s + t * k * 4 + t * k * f * s
    return held + max(running, building)


# ------------------------------------------------------------------------------------------- mlp


def mlp_check(params: Params) -> None:
    """`mlp`: tokens, hidden, intermediate >= 1; hidden and intermediate multiples of the NVFP4 group."""
    _at_least(params, ("tokens", "hidden", "intermediate"))
    for name in ("hidden", "intermediate"):
        _multiple(params, name, GROUP_SIZE, "the NVFP4 group size (gate, up and down are NVFP4)")
    _dtype(params)


def mlp_bytes(params: Params, arms: Iterable[str]) -> int:
    """Gate, up and down in NVFP4, x and y [T, H], the two [T, I] projections."""
    t, h, i, s = params["tokens"], params["hidden"], params["intermediate"], _dtype(params)
    return int(3 * h * i * NVFP4_BYTES_PER_WEIGHT) + 2 * t * h * s + 2 * t * i * s


# ----------------------------------------------------------------------------------------- model

ARCHITECTURES = ("llama", "gemma")


def decoder_check(params: Params) -> None:
    """A generated decoder's shape (`kernels.model.DecoderConfig` applies this same rule).

    hidden, intermediate and heads x head_dim multiples of the affine group (64, which the NVFP4
    group divides), heads a multiple of kv_heads; `kv_heads`/`head_dim` of 0 mean heads/2 and
    hidden/heads.
    """
    if params["architecture"] not in ARCHITECTURES:
        raise ValueError(f"architecture = {params['architecture']!r}: not one of {', '.join(ARCHITECTURES)}")
    _dtype(params)
    _at_least(params, ("hidden", "intermediate", "layers", "heads", "vocab"))
    _at_least(params, ("kv_heads", "head_dim"), 0)
    why = "the affine group size (the affine arm repacks every layer)"
    for name in ("hidden", "intermediate"):
        _multiple(params, name, AFFINE_GROUP, why)
    heads, kv, head_dim = _heads(params)
    if (heads * head_dim) % AFFINE_GROUP:
        raise ValueError(f"heads x head_dim = {heads * head_dim}: not a multiple of {AFFINE_GROUP}, {why}")
    if heads % kv:
        raise ValueError(f"heads = {heads}: not a multiple of kv_heads = {kv}")


def _heads(params: Params) -> tuple[int, int, int]:
    heads = int(params["heads"])
    kv = int(params["kv_heads"]) or max(1, heads // 2)
    head_dim = int(params["head_dim"]) or int(params["hidden"]) // heads
    return heads, kv, head_dim


def model_check(params: Params) -> None:
    """`model`: prompt_tokens >= 1, decode_tokens >= 1; the decoder's shape unless a checkpoint is named."""
    _at_least(params, ("prompt_tokens", "decode_tokens"))
    if not params.get("checkpoint"):
        decoder_check(params)


def model_bytes(params: Params, arms: Iterable[str]) -> int:
    """A generated decoder's NVFP4 weights and KV caches for the prompt and a decode window, once
    per arm: the steady-state rounds hold every arm loaded in one process, each with its kept
    prefilled cache and a window's copy (0 for a named checkpoint: its size is only known on the
    host)."""
    if params.get("checkpoint"):
        return 0
    h, i, layers, vocab, s = params["hidden"], params["intermediate"], params["layers"], params["vocab"], _dtype(params)
    heads, kv, head_dim = _heads(params)
    per_layer = 2 * h * heads * head_dim + 2 * h * kv * head_dim + 3 * h * i
    weights = layers * per_layer + vocab * h
    tokens = params["prompt_tokens"] + params["decode_tokens"]
    kv_cache = layers * 2 * kv * head_dim * tokens * s
    return max(1, len(list(arms))) * (int(weights * NVFP4_BYTES_PER_WEIGHT) + 2 * kv_cache)
