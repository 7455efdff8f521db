"""Build, check and time the custom NVFP4 kernels against MLX's built-in paths on an NVIDIA GPU.

    python3 -m benchmarks.gpu_kernels --out DIR [--quick]

Run on MLX's CUDA backend (the H200 of issue 7; `../shared/device/mlx-cuda.sh` prepares MLX for
it). One call does everything and writes `DIR/gpu_kernels.json`, then prints a short table:

* the card's copy ceiling: a large device-to-device copy through PyTorch (CuPy, then MLX, where
  PyTorch is missing), bytes read plus written, the median of several copies;
* the decode GEMV (N=21504, K=5376, bfloat16, M = 1..8): the custom kernel's launch shapes tuned
  at M = 1 and 8, then every M: relative error against a float64 NumPy reference on sampled rows
  (and the whole output against the MLX twin), time per call, GB/s over the minimum bytes (packed
  weights, E4M3 scales, x and y once each), the fraction of the copy ceiling, and the ratio to
  `mx.quantized_matmul(nvfp4)` timed the same way;
* the sorted-gather MoE prefill (E=128, top-6, 512 tokens, D=2688, F=1856, per-expert global
  scale; the up projection and, for the K % 128 tail, the down projection): the same figures
  against `mx.gather_qmm(nvfp4, sorted_indices=True)`, plus a check that rows routed past the last
  expert come back zero;
* qmm prefill points (tokens 512, 2048) for the `auto` arm's table: native, dequant-gemm and the
  custom kernel (the MoE kernel with one expert), time per call.

Timing: each path is called L times inside one `mx.eval` (rotating over weight copies larger than
the 60 MB L2 where one copy is smaller than 4x L2), synchronised around; the time per call is the
slope between L1 and L2 launches (which removes the fixed cost of an eval), the median of REPEATS.
"""

from __future__ import annotations

import argparse
import functools
import json
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from kernels import gemv_nvfp4, moe_nvfp4, nvfp4
from kernels.gemv_nvfp4 import GemvConfig, gemv_nvfp4_cuda, gemv_nvfp4_twin
from kernels.moe_nvfp4 import MoeConfig, moe_gather_nvfp4_cuda, moe_gather_nvfp4_twin

L2_BYTES = 60e6
REPEATS = 7
L1, L2 = 20, 200  # GEMV calls per eval: time per call = slope between the two
GEMV_N, GEMV_K = 21504, 5376
MOE = {"experts": 128, "top_k": 6, "tokens": 512, "hidden": 2688, "expert_width": 1856}
GEMV_CONFIGS = [
    GemvConfig(4, 2), GemvConfig(2, 3), GemvConfig(3, 3), GemvConfig(4, 1),
    GemvConfig(4, 2, True), GemvConfig(2, 3, True), GemvConfig(3, 3, True), GemvConfig(4, 1, True),
]  # fmt: skip
MOE_CONFIGS = [MoeConfig(4, 1, 4), MoeConfig(4, 1, 3), MoeConfig(2, 1, 4), MoeConfig(4, 2, 4)]


def log(msg: str) -> None:
    """A progress line on stderr (the reply carries the tail of the output)."""
    print(msg, file=sys.stderr, flush=True)


def device_facts() -> dict[str, Any]:
    """GPU name and driver (nvidia-smi), MLX version and device, Python."""
    facts: dict[str, Any] = {
        "mlx_version": str(getattr(mx, "__version__", "unknown")),
        "mlx_device": str(mx.default_device()),
        "backend": "cuda" if mx.cuda.is_available() else "cpu",
        "python": platform.python_version(),
    }
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.max.sm", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=20, check=True,
        ).stdout.strip().splitlines()[0]  # fmt: skip
        name, driver, memory, clock = (s.strip() for s in out.split(","))
        facts.update(gpu=name, gpu_driver=driver, gpu_memory=memory, sm_clock_max=clock)
    except (OSError, subprocess.SubprocessError, ValueError, IndexError) as exc:
        facts["gpu_error"] = str(exc)
    return facts


def copy_ceiling_gb_s(nbytes: int = 4 << 30) -> dict[str, Any]:
    """Device-to-device copy bandwidth, bytes read + written, through PyTorch (else CuPy, else MLX)."""
    try:
        import torch

        src = torch.empty(nbytes, dtype=torch.uint8, device="cuda").random_(0, 255)
        dst = torch.empty_like(src)
        times = []
        for i in range(13):
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src)
            stop.record()
            stop.synchronize()
            if i >= 3:
                times.append(start.elapsed_time(stop) / 1e3)
        del src, dst
        torch.cuda.empty_cache()
        t = statistics.median(times)
        return {"gb_s": 2 * nbytes / t / 1e9, "bytes": nbytes, "seconds": t, "via": f"torch {torch.__version__}"}
    except Exception as exc:  # no torch: MLX's own copy (a lower bound of the ceiling)
        log(f"copy through torch failed ({exc}); using MLX")
    a = mx.random.randint(0, 255, (nbytes // 4,), dtype=mx.uint32)
    mx.eval(a)
    times = []
    for _ in range(10):
        mx.synchronize()
        t0 = time.perf_counter()
        mx.eval(a + 0)
        mx.synchronize()
        times.append(time.perf_counter() - t0)
    t = statistics.median(times)
    return {"gb_s": 2 * nbytes / t / 1e9, "bytes": nbytes, "seconds": t, "via": "mlx a + 0"}


def per_call_seconds(call: Callable[[int], Any], l1: int, l2: int, repeats: int = REPEATS) -> dict[str, float]:
    """Time per call: L calls (call(i) for i < L) in one eval, slope between L1 and L2, median."""

    def batch(calls: int) -> float:
        mx.synchronize()
        t0 = time.perf_counter()
        mx.eval([call(i) for i in range(calls)])
        mx.synchronize()
        return time.perf_counter() - t0

    batch(l2)  # warm-up (and first-call compile)
    slopes, plain = [], []
    for _ in range(repeats):
        t1, t2 = batch(l1), batch(l2)
        slopes.append((t2 - t1) / (l2 - l1))
        plain.append(t2 / l2)
    return {
        "seconds": statistics.median(slopes),
        "seconds_min": min(slopes),
        "seconds_max": max(slopes),
        "seconds_whole_eval": statistics.median(plain),
        "calls": l2,
    }


def rel_error(got: np.ndarray, ref: np.ndarray) -> float:
    """||got - ref|| / ||ref|| in float64; inf where got is not finite."""
    got = np.asarray(got, dtype=np.float64)
    if not np.all(np.isfinite(got)):
        return float("inf")
    denom = float(np.linalg.norm(ref))
    return float(np.linalg.norm(got - ref)) / max(denom, 1e-300)


def to_np(a: mx.array) -> np.ndarray:
    """An MLX array as float64 NumPy."""
    return np.array(a.astype(mx.float32)).astype(np.float64)


def dequant_rows(wq: mx.array, scales: mx.array, rows: np.ndarray) -> np.ndarray:
    """float64 weights of some rows, by the NumPy reference (kernels.nvfp4)."""
    codes = nvfp4.unpack_codes(np.array(wq[mx.array(rows)]))
    return nvfp4.dequantize(codes, np.array(scales[mx.array(rows)]))


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
        for cfg in GEMV_CONFIGS[:2] if quick else GEMV_CONFIGS:
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
        tuning[str(m)] = [{**vars(c), "seconds": t} for t, c in results]
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
            "config": vars(cfg),
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
        gemv_nvfp4._launcher.cache_clear()
        try:
            overhead[str(m)] = per_call_seconds(custom(x, best[1] if m <= 4 else best[8]), L1, L2)
        finally:
            gemv_nvfp4.COMPILE_LAUNCH = True
            gemv_nvfp4._launcher.cache_clear()
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
    """The three qmm prefill candidates on one input (weights: packed, scales, and both as one expert)."""
    wq, sc, w3, s3 = weights
    return {
        "native": lambda i: mx.quantized_matmul(x, wq, sc, transpose=True, mode="nvfp4"),
        "dequant-gemm": lambda i: x @ mx.dequantize(wq, sc, mode="nvfp4", dtype=x.dtype).T,
        "custom": lambda i: moe_gather_nvfp4_cuda(x, w3, s3, None, lhs, rhs),
    }


def qmm_prefill_section(tokens_list: list[int]) -> list[dict[str, Any]]:
    """Native, dequant-gemm and the custom kernel (MoE kernel, one expert) at prefill sizes."""
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


# --------------------------------------------------------------------- ncu probe and worker jobs


def ncu_probe(calls: int = 3) -> None:
    """Each path a few times, one eval each, between cuProfilerStart/Stop: run under
    `ncu --profile-from-start off --metrics gpu__time_duration.sum` it gives the kernels' own
    durations (ncu flushes the caches before each, so weights come from HBM), free of host cost."""
    import ctypes

    cuda = ctypes.CDLL("libcuda.so.1")
    n, k = GEMV_N, GEMV_K
    wq, sc = mx.quantize(mx.random.normal((n, k)).astype(mx.bfloat16), mode="nvfp4")[:2]
    xs = {m: mx.random.normal((m, k)).astype(mx.bfloat16) for m in (1, 4, 8)}
    e, f, d = MOE["experts"], MOE["expert_width"], MOE["hidden"]
    rng = np.random.default_rng(5)
    mw, ms, mg = moe_weights(e, f, d, rng)
    x = mx.random.normal((MOE["tokens"], d)).astype(mx.bfloat16)
    lhs, rhs = routing(MOE["tokens"], e, MOE["top_k"], rng)
    xg = x[lhs][:, None, :]
    paths: list[tuple[str, Callable[[], mx.array]]] = []
    for m, xm in xs.items():
        for cfg in (GemvConfig(2, 3), GemvConfig(2, 4)):
            paths.append((f"gemv-custom M={m} {cfg}", functools.partial(gemv_nvfp4_cuda, xm, wq, sc, None, cfg)))
        paths.append((f"gemv-native M={m}", functools.partial(mx.quantized_matmul, xm, wq, sc, mode="nvfp4")))
    paths.append(("moe-custom", lambda: moe_gather_nvfp4_cuda(x, mw, ms, mg, lhs, rhs, MoeConfig(4, 1, 4))))
    paths.append(
        ("moe-native", lambda: mx.gather_qmm(xg, mw, ms, rhs_indices=rhs, transpose=True, mode="nvfp4",
                                            global_scale=mg, sorted_indices=True))
    )  # fmt: skip
    for _, fn in paths:  # compile and warm outside the profiled range
        mx.eval(fn())
    mx.eval(xg)
    mx.synchronize()
    cuda.cuProfilerStart()
    for name, fn in paths:
        for _ in range(calls):
            print(f"PROBE {name}", flush=True)
            mx.eval(fn())
            mx.synchronize()
    cuda.cuProfilerStop()


def write_jobs(folder: Path, code_version: str) -> list[Path]:
    """JobSpec files for `python -m workers run` on the H200: the built-in sweeps' points with the
    issue-7 arms (qmm decode, M=8 and a 512-token prefill; the moe-gather seed shape)."""
    import hashlib

    from workers.contract import JobSpec, LockSettings

    folder.mkdir(parents=True, exist_ok=True)
    qmm_arms = ["native", "dequant-gemm", "custom", "auto"]
    specs: list[tuple[str, str, dict[str, int | float | str | bool], list[str]]] = [
        ("nvfp4-prefill", "qmm", {"tokens": 1, "n": GEMV_N, "k": GEMV_K, "dtype": "bfloat16"}, qmm_arms),
        ("nvfp4-prefill", "qmm", {"tokens": 8, "n": GEMV_N, "k": GEMV_K, "dtype": "bfloat16"}, qmm_arms),
        ("nvfp4-prefill", "qmm", {"tokens": 512, "n": GEMV_N, "k": GEMV_K, "dtype": "bfloat16"}, qmm_arms),
        (
            "moe-gather",
            "moe-gather",
            {**MOE, "dtype": "bfloat16", "global_scale": True},
            ["native-sorted", "native-unsorted", "custom-sorted", "auto-sorted"],
        ),
    ]
    run_id = time.strftime("h200-%Y%m%dT%H%M%S", time.gmtime())
    paths = []
    for sweep, case, params, arms in specs:
        content = {"sweep": sweep, "case": case, "params": params, "arms": arms, "device": "h200", "code": code_version}
        key = hashlib.sha256(json.dumps(content, sort_keys=True).encode()).hexdigest()[:16]
        job = JobSpec(
            run_id=run_id,
            sweep=sweep,
            job_key=key,
            case=case,
            case_name=case,
            params=params,
            arms=arms,
            device="h200",
            backend="cuda",
            host="h200-lent",
            repetitions=10,
            warmup=3,
            seed=int(key[:8], 16),
            code_version=code_version,
            lock=LockSettings(path="/tmp/orchestrate-gpu.lock", enabled=False),
        )
        path = folder / f"{case}-{params['tokens']}.json"
        path.write_text(job.model_dump_json(indent=1))
        paths.append(path)
    return paths


def main(argv: list[str] | None = None) -> int:
    """Entry point."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for gpu_kernels.json")
    parser.add_argument("--quick", action="store_true", help="fewer launch shapes (a smoke run)")
    parser.add_argument("--skip", nargs="*", default=[], choices=["gemv", "moe", "qmm"])
    parser.add_argument("--moe-fixed", action="store_true", help="MoE: up projection, default launch shape only")
    parser.add_argument("--probe", action="store_true", help="only the ncu probe (run it under ncu)")
    parser.add_argument("--jobs", metavar="CODE_VERSION", help="only write worker job files to --out")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.probe:
        ncu_probe()
        return 0
    if args.jobs:
        for p in write_jobs(args.out, args.jobs):
            print(p)
        return 0
    results: dict[str, Any] = {
        "device": device_facts(),
        "command": " ".join(["python3 -m benchmarks.gpu_kernels", *sys.argv[1:]]),
    }
    log(json.dumps(results["device"]))
    path = args.out / "gpu_kernels.json"

    def save() -> None:
        path.write_text(json.dumps(results, indent=1, default=str))

    results["copy"] = copy_ceiling_gb_s()
    ceiling = results["copy"]["gb_s"]
    log(f"copy ceiling {ceiling:.0f} GB/s via {results['copy']['via']}")
    save()
    rng = np.random.default_rng(11)
    for section in ("gemv", "moe", "qmm"):
        if section in args.skip:
            continue
        t0 = time.perf_counter()
        try:
            if section == "gemv":
                results["gemv"] = gemv_section(ceiling, args.quick)
            elif section == "moe":
                f, d = MOE["expert_width"], MOE["hidden"]
                configs = [moe_nvfp4.DEFAULT_CONFIG] if args.moe_fixed else MOE_CONFIGS
                up = moe_projection("up", f, d, ceiling, args.quick, rng, configs)
                results["moe"] = [up]
                save()
                if not (args.quick or args.moe_fixed):  # the K % 128 tail; the up projection's launch shape
                    best = MoeConfig(**up["config"])
                    results["moe"].append(moe_projection("down", d, f, ceiling, args.quick, rng, [best]))
            else:
                results["qmm_prefill"] = qmm_prefill_section([512, 2048])
        except Exception as exc:
            import traceback

            results[f"{section}_error"] = traceback.format_exc()
            log(f"{section} FAILED: {exc}")
        results[f"{section}_wall_s"] = time.perf_counter() - t0
        save()
    print_table(results)
    return 0


def print_table(results: dict[str, Any]) -> None:
    """The short summary (stdout)."""
    dev = results["device"]
    print(f"\n{dev.get('gpu')} driver {dev.get('gpu_driver')} mlx {dev['mlx_version']} ({dev['backend']})")
    print(f"copy ceiling {results['copy']['gb_s']:.0f} GB/s ({results['copy']['via']})")
    for e in results.get("gemv", {}).get("per_m", []):
        print(
            f"GEMV M={e['m']}: custom {e['custom']['seconds'] * 1e6:6.1f} us {e['custom_gb_s']:5.0f} GB/s "
            f"{e['custom_fraction_of_copy']:4.0%} | native {e['native']['seconds'] * 1e6:6.1f} us "
            f"{e['native_gb_s']:5.0f} GB/s | x{e['speedup_vs_native']:.2f} | err {e['rel_error_custom']:.1e} "
            f"(native {e['rel_error_native']:.1e})"
        )
    for e in results.get("moe", []):
        print(
            f"MoE {e['projection']} [{e['n']}x{e['k']}]: custom {e['custom']['seconds'] * 1e6:7.1f} us "
            f"{e['custom_gb_s']:5.0f} GB/s {e['custom_tflop_s']:5.1f} TFLOP/s | gather_qmm "
            f"{e['native_sorted_gather_qmm']['seconds'] * 1e6:7.1f} us | x{e['speedup_vs_native']:.1f} | "
            f"err {e['rel_error_custom']:.1e} (native {e['rel_error_native']:.1e}) "
            f"zero-past {e['rows_past_last_expert_zero']}"
        )
    for e in results.get("qmm_prefill", []):
        cells = " | ".join(f"{p} {e[p]['seconds'] * 1e3:.3f} ms" for p in ("native", "dequant-gemm", "custom"))
        print(f"qmm tokens={e['tokens']}: {cells}")
    for key in ("gemv_error", "moe_error", "qmm_error"):
        if key in results:
            print(f"{key}: {results[key].strip().splitlines()[-1]}")


def markdown(results: dict[str, Any]) -> str:
    """The H200 section of BENCHMARKS.md from a gpu_kernels.json."""
    dev, copy = results["device"], results["copy"]
    ceiling = copy["gb_s"]
    lines = [
        f"Device: {dev.get('gpu')} (driver {dev.get('gpu_driver')}), "
        f"MLX {dev['mlx_version']} {dev['backend']} backend, "
        f"bfloat16 activations. Copy ceiling (device-to-device copy through {copy['via']}, bytes read + "
        f"written): **{ceiling:.0f} GB/s**. Times are per call: the slope between {L1} and {L2} calls "
        "(MoE: 2 and 10) inside one `mx.eval`, weights rotated over copies larger than the 60 MB L2, "
        "median of 7. GB/s counts packed weights, E4M3 scales, x and y once each.",
        "",
    ]
    gemv = results.get("gemv")
    if gemv:
        lines += [
            f"### NVFP4 decode GEMV, N={gemv['n']}, K={gemv['k']} (`kernels/cuda/gemv_nvfp4.cu`)",
            "",
            "| M | custom us | custom GB/s | of copy | native us | native GB/s | custom / native speed-up |"
            " rel. error custom (native) | launch |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for e in gemv["per_m"]:
            lines.append(
                f"| {e['m']} | {e['custom']['seconds'] * 1e6:.1f} | {e['custom_gb_s']:.0f} | "
                f"{e['custom_fraction_of_copy']:.0%} | {e['native']['seconds'] * 1e6:.1f} | {e['native_gb_s']:.0f} | "
                f"{e['speedup_vs_native']:.2f}x | {e['rel_error_custom']:.1e} ({e['rel_error_native']:.1e}) | "
                f"warps {e['config']['warps']}, unroll {e['config']['unroll']}"
                f"{', cvt scales' if e['config'].get('cvt_scales') else ''} |"
            )
        lines.append("")
    for e in results.get("moe", []):
        nat = e["native_sorted_gather_qmm"]["seconds"]
        lines += [
            f"### NVFP4 sorted-gather MoE, {e['projection']} projection: E={e['experts']}, top-{e['top_k']}, "
            f"{e['tokens']} tokens, weights [{e['experts']}, {e['n']}, {e['k']}] (`kernels/cuda/moe_nvfp4.cu`)",
            "",
            "| path | time us | GB/s | of copy | TFLOP/s | speed-up vs gather_qmm | rel. error |",
            "|---|---|---|---|---|---|---|",
            f"| custom (expert-batched) | {e['custom']['seconds'] * 1e6:.1f} | {e['custom_gb_s']:.0f} | "
            f"{e['custom_fraction_of_copy']:.0%} | {e['custom_tflop_s']:.1f} | {e['speedup_vs_native']:.1f}x | "
            f"{e['rel_error_custom']:.1e} |",
            f"| mx.gather_qmm nvfp4 sorted | {nat * 1e6:.1f} | {e['native_gb_s']:.0f} | "
            f"{e['native_gb_s'] / ceiling:.0%} | {e['flops'] / nat / 1e12:.1f} | 1.0x | {e['rel_error_native']:.1e} |",
            "",
            f"Rows routed past the last expert come back zero: {e['rows_past_last_expert_zero']}.",
            "",
        ]
    prefill = results.get("qmm_prefill")
    if prefill:
        lines += [
            "### qmm prefill (the `auto` arm's candidates), N=21504, K=5376",
            "",
            "| tokens | native ms (TFLOP/s) | dequant-gemm ms (TFLOP/s) | custom ms (TFLOP/s) |",
            "|---|---|---|---|",
        ]
        for e in prefill:
            cells = " | ".join(
                f"{e[p]['seconds'] * 1e3:.3f} ({e[p]['tflop_s']:.0f})" for p in ("native", "dequant-gemm", "custom")
            )
            lines.append(f"| {e['tokens']} | {cells} |")
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
