"""Each case's own parameter rule and its device-memory estimate, checked against real MLX.

The rule (`kernels.shapes`, reached through `kernels.registry.check_point`) is the one the head
applies at load and the one the case's `build` applies on the worker; the estimate is a lower
bound on what the arrays really take, measured here with MLX's own allocator counters.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np
import pytest

from kernels import registry, shapes


@pytest.mark.parametrize(
    ("case", "params", "message"),
    [
        ("qmm", {"tokens": 1, "n": 32, "k": 100}, "k = 100: not a multiple of 16, the NVFP4 group size"),
        ("qmm", {"tokens": 1, "n": 32, "k": 24}, "(nearest: 16 or 32)"),
        ("qmm", {"tokens": 1, "n": 32, "k": 8}, "(nearest: 16)"),
        ("qmm", {"tokens": 0, "n": 32, "k": 64}, "tokens = 0: must be at least 1"),
        (
            "qmm",
            {"tokens": 1, "n": 32, "k": 64, "dtype": "fp8"},
            "dtype = 'fp8': not one of float32, bfloat16, float16",
        ),
        ("moe-gather", {"experts": 4, "top_k": 5, "tokens": 1, "hidden": 64, "expert_width": 8}, "top_k = 5: more"),
        ("moe-gather", {"experts": 4, "top_k": 2, "tokens": 1, "hidden": 72, "expert_width": 8}, "hidden = 72"),
        ("mlp", {"tokens": 1, "hidden": 64, "intermediate": 40}, "intermediate = 40: not a multiple of 16"),
        ("mlp", {"tokens": 1, "hidden": 33, "intermediate": 64}, "hidden = 33"),
        ("model", {"prompt_tokens": 8, "hidden": 96}, "hidden = 96: not a multiple of 64"),
        (
            "model",
            {"prompt_tokens": 8, "heads": 6, "kv_heads": 4, "head_dim": 64},
            "heads = 6: not a multiple of kv_heads = 4",
        ),
        ("model", {"prompt_tokens": 8, "architecture": "mamba"}, "architecture = 'mamba': not one of llama, gemma"),
        ("model", {"prompt_tokens": 0}, "prompt_tokens = 0: must be at least 1"),
    ],
)
def test_each_case_refuses_points_it_cannot_run(case: str, params: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        registry.check_point(case, params)


def test_the_rule_fills_defaults_and_a_named_checkpoint_skips_the_shape() -> None:
    assert registry.check_point("qmm", {"tokens": 1, "n": 32, "k": 64})["dtype"] == "float32"
    registry.check_point("model", {"prompt_tokens": 8, "hidden": 96, "checkpoint": "/models/gemma"})
    assert registry.device_bytes("model", {"prompt_tokens": 8, "checkpoint": "/models/gemma"}, ["native"]) == 0
    registry.check_point("command", {"anything": 1})  # command cases have no shape rule


def test_build_applies_the_same_rule_as_the_head() -> None:
    from kernels import mlp, moe, qmm

    rng = np.random.default_rng(0)
    for module, case, params in [
        (qmm, "qmm", {"tokens": 1, "n": 32, "k": 40}),
        (moe, "moe-gather", {"experts": 2, "top_k": 3, "tokens": 1, "hidden": 64, "expert_width": 8}),
        (mlp, "mlp", {"tokens": 1, "hidden": 64, "intermediate": 24}),
    ]:
        with pytest.raises(ValueError) as head:
            registry.check_point(case, params)
        with pytest.raises(ValueError) as worker:
            module.build(params, [registry.CASES[case].arms[0]], rng)
        assert str(worker.value) == str(head.value)


def test_qmm_estimate_by_hand() -> None:
    # NVFP4 W [1024, 1024]: 1024*1024/2 codes + 1024*1024/16 scales; x [1, 1024] and y [1, 1024] float32
    assert shapes.qmm_bytes({"tokens": 1, "n": 1024, "k": 1024, "dtype": "float32"}, ["native"]) == 589824 + 8192
    # the dense arm adds W in bfloat16 (2 MiB)
    dense = shapes.qmm_bytes({"tokens": 1, "n": 1024, "k": 1024, "dtype": "bfloat16"}, ["native", "dense"])
    assert dense == 589824 + 4096 + 2 * 1024 * 1024


def _peak_bytes(case: str, params: dict[str, Any], arms: list[str]) -> int:
    """What building the point and running each arm once really allocates (MLX's counters)."""
    module = registry.load_case(case)
    mx.clear_cache()
    before = mx.get_active_memory()
    mx.reset_peak_memory()
    workload = module.build(params, arms, np.random.default_rng(0))
    inputs = workload.make_inputs(np.random.default_rng(1))
    for arm in workload.arms.values():
        mx.eval(arm.run(*inputs))
    return int(mx.get_peak_memory() - before)


@pytest.mark.parametrize(
    ("case", "params", "arms"),
    [
        ("qmm", {"tokens": 16, "n": 1024, "k": 1024}, ["native"]),
        ("qmm", {"tokens": 16, "n": 1024, "k": 1024}, ["native", "dense", "dequant-gemm", "affine"]),
        ("qmm", {"tokens": 512, "n": 256, "k": 2048, "dtype": "bfloat16"}, ["native", "dense"]),
        ("moe-gather", {"experts": 8, "top_k": 2, "tokens": 64, "hidden": 512, "expert_width": 256}, ["native-sorted"]),
        (
            "moe-gather",
            {"experts": 8, "top_k": 2, "tokens": 64, "hidden": 512, "expert_width": 256},
            ["native-sorted", "affine-unsorted"],
        ),
        ("mlp", {"tokens": 64, "hidden": 512, "intermediate": 1024}, ["fused", "eager"]),
    ],
)
def test_the_estimate_is_a_lower_bound_of_what_mlx_allocates(
    case: str, params: dict[str, Any], arms: list[str]
) -> None:
    estimate = registry.device_bytes(case, params, arms)
    peak = _peak_bytes(case, params, arms)
    assert estimate <= peak <= 3 * estimate, (estimate, peak)  # below, and not so far below as to mean nothing
