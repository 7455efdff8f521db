"""The measured cases of the device script: decode GEMV, sorted-gather MoE, qmm prefill.

Each section builds its weights on the GPU, checks the custom kernel against the float64 NumPy
reference (sampled rows) and its MLX twin (whole output), and times it beside MLX's built-in
path with `benchmarks.gpu_method.per_call_seconds`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import mlx.core as mx
import numpy as np

from benchmarks.gpu_method import L1, L2, L2_BYTES, dequant_rows, log, per_call_seconds, rel_error, to_np
from kernels import gemv_nvfp4, nvfp4
from kernels.gemv_nvfp4 import GemvConfig, gemv_nvfp4_cuda, gemv_nvfp4_twin
from kernels.moe_nvfp4 import MoeConfig, moe_gather_nvfp4_cuda, moe_gather_nvfp4_twin
from kernels.nvfp4_linear import nvfp4_matmul

GEMV_N, GEMV_K = 21504, 5376
MOE = {"experts": 128, "top_k": 6, "tokens": 512, "hidden": 2688, "expert_width": 1856}
GEMV_CONFIGS = [
    GemvConfig("stream", warps=12), GemvConfig("stream", warps=8),
    GemvConfig("ksplit", warps=4, unroll=2), GemvConfig("ksplit", warps=2, unroll=3),
]  # fmt: skip
MOE_CONFIGS = [MoeConfig(4, 1, 4), MoeConfig(4, 1, 3), MoeConfig(2, 1, 4), MoeConfig(4, 2, 4)]


# ----------------------------------------------------------------------------------------- GEMV


def gemv_section(ceiling: float, quick: bool) -> dict[str, Any]:
    """Decode GEMV at N=21504, K=5376, bfloat16: tune, check and time M = 1..8."""
    n, k = GEMV_N, GEMV_K
    wbytes = n * k // 2 + n * k // 16
    copies = max(1, int(np.ceil(4 * L2_BYTES / wbytes)))
    weights = []
    for _ in range(copies):
        wq, sc = mx.quantize(mx.random.normal((n, k)).astype(mx.bfloat16), mode="nvfp4")[:2]
        mx.eval(wq, sc)
        weights.append((wq, sc))
    rng = np.random.default_rng(7)
    rows = np.sort(rng.choice(n, 512, replace=False))
    w_ref = dequant_rows(weights[0][0], weights[0][1], rows)
    out: dict[str, Any] = {"n": n, "k": k, "dtype": "bfloat16", "weight_copies": copies, "per_m": []}

    def custom(x: mx.array, cfg: GemvConfig) -> Callable[[int], mx.array]:
        return lambda i: gemv_nvfp4_cuda(x, *weights[i % copies], None, cfg)

    def native(x: mx.array) -> Callable[[int], mx.array]:
        return lambda i: mx.quantized_matmul(x, *weights[i % copies], transpose=True, mode="nvfp4")

    # launch-shape tuning at M = 1 and 8
    tuning: dict[str, Any] = {}
    best: dict[int, GemvConfig] = {}
    for m in (1, 8):
        x = mx.random.normal((m, k)).astype(mx.bfloat16)
        results = []
        want = to_np(gemv_nvfp4_twin(x, *weights[0], None))
        for cfg in GEMV_CONFIGS[:1] + GEMV_CONFIGS[-1:] if quick else GEMV_CONFIGS:
            try:
                diff = rel_error(to_np(gemv_nvfp4_cuda(x, *weights[0], None, cfg)), want)
                if not diff < 1e-3:
                    log(f"gemv M={m} {cfg}: WRONG, rel. difference {diff:.2e} from the twin")
                    continue
                t = per_call_seconds(custom(x, cfg), L1, L2, repeats=3)["seconds"]
            except Exception as exc:
                log(f"gemv M={m} {cfg}: {exc}")
                continue
            results.append((t, cfg))
            log(f"gemv tune M={m} {cfg}: {t * 1e6:.1f} us")
        tuning[str(m)] = [{**vars(c), "label": str(c), "seconds": t} for t, c in results]
        best[m] = min(results, key=lambda r: r[0])[1]
    out["tuning"] = tuning

    for m in range(1, 9):
        cfg = best[1] if m <= 4 else best[8]
        x = mx.random.normal((m, k)).astype(mx.bfloat16)
        wq, sc = weights[0]
        y = gemv_nvfp4_cuda(x, wq, sc, None, cfg)
        y_native = mx.quantized_matmul(x, wq, sc, transpose=True, mode="nvfp4")
        y_twin = gemv_nvfp4_twin(x, wq, sc, None)
        mx.eval(y, y_native, y_twin)
        ref = to_np(x) @ w_ref.T
        gs_check = None
        if m in (1, 8):  # the global-scale epilogue: a tensor scale of 300 (MLX convention)
            y_gs = gemv_nvfp4_cuda(x, wq, sc, 300.0, cfg)
            gs_check = rel_error(to_np(y_gs)[:, rows], ref * 300.0 / nvfp4.MLX_GLOBAL_SCALE_DIVISOR)
        nbytes = wbytes + m * k * 2 + m * n * 2
        t_custom = per_call_seconds(custom(x, cfg), L1, L2)
        t_native = per_call_seconds(native(x), L1, L2)
        entry: dict[str, Any] = {
            "m": m,
            "config": {**vars(cfg), "label": str(cfg)},
            "bytes": nbytes,
            "rel_error_custom": rel_error(to_np(y)[:, rows], ref),
            "rel_error_native": rel_error(to_np(y_native)[:, rows], ref),
            "rel_error_custom_global_scale": gs_check,
            "rel_diff_custom_vs_twin_all": rel_error(to_np(y), to_np(y_twin)),
            "custom": t_custom,
            "native": t_native,
            "custom_gb_s": nbytes / t_custom["seconds"] / 1e9,
            "native_gb_s": nbytes / t_native["seconds"] / 1e9,
        }
        entry["custom_fraction_of_copy"] = entry["custom_gb_s"] / ceiling
        entry["native_fraction_of_copy"] = entry["native_gb_s"] / ceiling
        entry["speedup_vs_native"] = t_native["seconds"] / t_custom["seconds"]
        if m in (1, 8):

            def dq(i: int, x: mx.array = x) -> mx.array:
                wq_i, sc_i = weights[i % copies]
                return x @ mx.dequantize(wq_i, sc_i, mode="nvfp4", dtype=x.dtype).T

            entry["dequant_gemm"] = per_call_seconds(dq, 4, 20)
        out["per_m"].append(entry)
        log(
            f"gemv M={m}: custom {t_custom['seconds'] * 1e6:.1f} us {entry['custom_gb_s']:.0f} GB/s "
            f"({entry['custom_fraction_of_copy']:.0%}) native {t_native['seconds'] * 1e6:.1f} us "
            f"err {entry['rel_error_custom']:.2e}/{entry['rel_error_native']:.2e} "
            f"twin {entry['rel_diff_custom_vs_twin_all']:.1e}"
        )
    # the host's share: the same kernel with its call assembled afresh each time (no mx.compile)
    overhead = {}
    for m in (1, 8):
        x = mx.random.normal((m, k)).astype(mx.bfloat16)
        gemv_nvfp4.COMPILE_LAUNCH = False
        gemv_nvfp4.launcher.cache_clear()
        try:
            overhead[str(m)] = per_call_seconds(custom(x, best[1] if m <= 4 else best[8]), L1, L2)
        finally:
            gemv_nvfp4.COMPILE_LAUNCH = True
            gemv_nvfp4.launcher.cache_clear()
        log(f"gemv M={m} without mx.compile: {overhead[str(m)]['seconds'] * 1e6:.1f} us")
    out["custom_uncompiled_launch"] = overhead
    return out


# ------------------------------------------------------------------------------------------ MoE


def moe_weights(e: int, n: int, k: int, rng: np.random.Generator) -> tuple[mx.array, mx.array, mx.array]:
    """E experts [n, k], each a random power of ten in [0.1, 10] times N(0,1), NVFP4 with a global
    scale each (its absolute maximum, MLX's convention), quantized by MLX on the GPU."""
    mags = (10.0 ** rng.uniform(-1, 1, e)).astype(np.float32)
    codes, scales, gss = [], [], []
    for i in range(e):
        w = mx.random.normal((n, k)) * float(mags[i])
        gs = mx.max(mx.abs(w))
        wq, sc = mx.quantize(w, mode="nvfp4", global_scale=gs)[:2]
        codes.append(wq)
        scales.append(sc)
        gss.append(gs)
    wq, sc, gs = mx.stack(codes), mx.stack(scales), mx.stack(gss).astype(mx.float32)
    mx.eval(wq, sc, gs)
    return wq, sc, gs


def routing(tokens: int, experts: int, top_k: int, rng: np.random.Generator) -> tuple[mx.array, mx.array]:
    """Random distinct top-k experts per token, sorted by expert: (lhs token rows, rhs experts)."""
    idx = np.argsort(rng.random((tokens, experts)), axis=1)[:, :top_k].astype(np.uint32).reshape(-1)
    order = np.argsort(idx, kind="stable")
    return mx.array((order // top_k).astype(np.uint32)), mx.array(idx[order])


def moe_reference(
    x: mx.array,
    wq: mx.array,
    sc: mx.array,
    gs: mx.array,
    lhs: mx.array,
    rhs: mx.array,
    experts_checked: np.ndarray,
) -> tuple[np.ndarray, np.ndarray]:
    """float64 rows of y for the routed rows of some experts: (row indices, their reference)."""
    lhs_np, rhs_np = np.array(lhs), np.array(rhs)
    x64 = to_np(x)
    gs_np = np.array(gs)
    rows_all, refs = [], []
    for e in experts_checked:
        rows = np.nonzero(rhs_np == e)[0]
        if rows.size == 0:
            continue
        w = nvfp4.dequantize(nvfp4.unpack_codes(np.array(wq[int(e)])), np.array(sc[int(e)]), float(gs_np[e]))
        rows_all.append(rows)
        refs.append(x64[lhs_np[rows]] @ w.T)
    return np.concatenate(rows_all), np.concatenate(refs)


def moe_projection(
    name: str, n: int, k: int, ceiling: float, quick: bool, rng: np.random.Generator, configs: list[MoeConfig]
) -> dict[str, Any]:
    """One expert projection (weights [E, n, k]) of the MoE prefill: tune, check, time."""
    e, top_k, t = MOE["experts"], MOE["top_k"], MOE["tokens"]
    wq, sc, gs = moe_weights(e, n, k, rng)
    x = mx.random.normal((t, k)).astype(mx.bfloat16)
    lhs, rhs = routing(t, e, top_k, rng)
    mx.eval(x, lhs, rhs)
    rows_n = t * top_k
    touched = len(np.unique(np.array(rhs)))
    nbytes = touched * (n * k // 2 + n * k // 16 + 4) + t * k * 2 + rows_n * n * 2 + rows_n * 4 * 2
    flops = 2.0 * rows_n * n * k

    def native(i: int) -> mx.array:
        return mx.gather_qmm(
            x[lhs][:, None, :], wq, sc, rhs_indices=rhs, transpose=True, mode="nvfp4",
            global_scale=gs, sorted_indices=True,
        )  # fmt: skip

    def native_prepared() -> Callable[[int], mx.array]:
        xs = x[lhs][:, None, :]
        mx.eval(xs)
        return lambda i: mx.gather_qmm(
            xs, wq, sc, rhs_indices=rhs, transpose=True, mode="nvfp4", global_scale=gs, sorted_indices=True
        )

    results = []
    for cfg in configs[:2] if quick else configs:
        try:
            call = functools.partial(lambda i, c: moe_gather_nvfp4_cuda(x, wq, sc, gs, lhs, rhs, c), c=cfg)
            tt = per_call_seconds(call, 2, 10, 3)
        except Exception as exc:
            log(f"moe {name} {cfg}: {exc}")
            continue
        results.append((tt["seconds"], cfg))
        log(f"moe {name} tune {cfg}: {tt['seconds'] * 1e6:.1f} us")
    cfg = min(results, key=lambda r: r[0])[1]

    y = moe_gather_nvfp4_cuda(x, wq, sc, gs, lhs, rhs, cfg)
    y_native = native(0)[:, 0, :]
    y_twin = moe_gather_nvfp4_twin(x, wq, sc, gs, lhs, rhs)
    mx.eval(y, y_native, y_twin)
    checked = rng.choice(e, min(12, e), replace=False)
    rows, ref = moe_reference(x, wq, sc, gs, lhs, rhs, checked)
    # rows routed past the last expert: the last `past` sorted rows sent to expert E
    past = min(40, rows_n // 4)
    rhs_past = mx.concatenate([rhs[:-past], mx.full((past,), e, dtype=mx.uint32)])
    y_past = moe_gather_nvfp4_cuda(x, wq, sc, gs, lhs, rhs_past, cfg)
    mx.eval(y_past)
    y_past_np = to_np(y_past)
    past_zero = bool(np.all(y_past_np[-past:] == 0.0))
    kept_rows = rows[rows < rows_n - past]
    past_rest = rel_error(y_past_np[kept_rows], to_np(y)[kept_rows])

    t_custom = per_call_seconds(lambda i: moe_gather_nvfp4_cuda(x, wq, sc, gs, lhs, rhs, cfg), 2, 10)
    t_native = per_call_seconds(native, 2, 6)
    t_native_prepared = per_call_seconds(native_prepared(), 2, 6)
    entry: dict[str, Any] = {
        "projection": name,
        "n": n,
        "k": k,
        **MOE,
        "experts_touched": touched,
        "config": {"warps": cfg.warps, "unroll": cfg.unroll, "n_tiles": cfg.n_tiles},
        "tuning": [{"warps": c.warps, "unroll": c.unroll, "n_tiles": c.n_tiles, "seconds": s} for s, c in results],
        "bytes": nbytes,
        "flops": flops,
        "rel_error_custom": rel_error(to_np(y)[rows], ref),
        "rel_error_native": rel_error(to_np(y_native)[rows], ref),
        "rel_diff_custom_vs_twin_all": rel_error(to_np(y), to_np(y_twin)),
        "rows_past_last_expert_zero": past_zero,
        "rows_before_unchanged_rel_diff": past_rest,
        "custom": t_custom,
        "native_sorted_gather_qmm": t_native,
        "native_sorted_gather_qmm_x_pregathered": t_native_prepared,
        "custom_gb_s": nbytes / t_custom["seconds"] / 1e9,
        "custom_tflop_s": flops / t_custom["seconds"] / 1e12,
        "native_gb_s": nbytes / t_native["seconds"] / 1e9,
    }
    entry["custom_fraction_of_copy"] = entry["custom_gb_s"] / ceiling
    entry["speedup_vs_native"] = t_native["seconds"] / t_custom["seconds"]
    log(
        f"moe {name}: custom {t_custom['seconds'] * 1e6:.1f} us ({entry['custom_gb_s']:.0f} GB/s, "
        f"{entry['custom_tflop_s']:.1f} TFLOP/s) native {t_native['seconds'] * 1e6:.1f} us "
        f"x{entry['speedup_vs_native']:.1f}; err {entry['rel_error_custom']:.2e}/{entry['rel_error_native']:.2e} "
        f"twin {entry['rel_diff_custom_vs_twin_all']:.1e} past-zero {past_zero} rest {past_rest:.1e}"
    )
    return entry


# ------------------------------------------------------------------------------------ qmm prefill


def prefill_paths(
    x: mx.array, lhs: mx.array, rhs: mx.array, weights: tuple[mx.array, mx.array, mx.array, mx.array]
) -> dict[str, Callable[[int], mx.array]]:
    """The qmm prefill candidates on one input (weights: packed, scales, and both as one expert):
    `custom` is what the qmm arm runs (the prefill GEMM of issue 20), `moe-one-expert` the MoE
    kernel it replaced there."""
    wq, sc, w3, s3 = weights
    return {
        "native": lambda i: mx.quantized_matmul(x, wq, sc, transpose=True, mode="nvfp4"),
        "dequant-gemm": lambda i: x @ mx.dequantize(wq, sc, mode="nvfp4", dtype=x.dtype).T,
        "custom": lambda i: nvfp4_matmul(x, wq, sc),
        "moe-one-expert": lambda i: moe_gather_nvfp4_cuda(x, w3, s3, None, lhs, rhs),
    }


def qmm_prefill_section(tokens_list: list[int]) -> list[dict[str, Any]]:
    """Native, dequant-gemm, the custom kernel (the prefill GEMM) and the one-expert MoE kernel at prefill sizes."""
    n, k = GEMV_N, GEMV_K
    wq, sc = mx.quantize(mx.random.normal((n, k)).astype(mx.bfloat16), mode="nvfp4")[:2]
    w3, s3 = wq[None], sc[None]
    mx.eval(wq, sc, w3, s3)
    out = []
    for m in tokens_list:
        x = mx.random.normal((m, k)).astype(mx.bfloat16)
        lhs = mx.arange(m, dtype=mx.uint32)
        rhs = mx.zeros((m,), dtype=mx.uint32)
        mx.eval(x, lhs, rhs)
        paths = prefill_paths(x, lhs, rhs, (wq, sc, w3, s3))
        ref = paths["dequant-gemm"](0)
        entry: dict[str, Any] = {"tokens": m, "n": n, "k": k, "flops": 2.0 * m * n * k}
        for name, fn in paths.items():
            got = fn(0)
            mx.eval(got, ref)
            diff = rel_error(to_np(got), to_np(ref))
            timing = per_call_seconds(fn, 1, 4, repeats=3)
            entry[name] = {
                **timing,
                "rel_diff_vs_dequant_gemm": diff,
                "tflop_s": entry["flops"] / timing["seconds"] / 1e12,
            }
            log(
                f"qmm tokens={m} {name}: {timing['seconds'] * 1e3:.3f} ms "
                f"({entry[name]['tflop_s']:.0f} TFLOP/s) diff {diff:.1e}"
            )
        out.append(entry)
    return out
