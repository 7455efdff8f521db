"""Build, check and time the custom NVFP4 kernels against MLX's built-in paths on an NVIDIA GPU.

    python3 -m benchmarks.gpu_kernels --out DIR [--quick]

Run on MLX's CUDA backend (an NVIDIA GPU; installing there: docs/gpu-hosts.md). One call does
everything and writes `DIR/gpu_kernels.json`, then prints a short table:

* the card's copy ceiling: a large device-to-device copy through PyTorch (MLX's own `a + 0`, a
  lower bound, where PyTorch is missing), bytes read plus written, the median of several copies;
* the decode GEMV (N=21504, K=5376, bfloat16, M = 1..8): the custom kernel's launch shapes tuned
  at M = 1 and 8, then every M: relative error against a float64 NumPy reference on sampled rows
  (and the whole output against the MLX twin), time per call, GB/s over the minimum bytes (packed
  weights, E4M3 scales, x and y once each), the fraction of the copy ceiling, and the ratio to
  `mx.quantized_matmul(nvfp4)` timed the same way;
* the sorted-gather MoE prefill (E=128, top-6, 512 tokens, D=2688, F=1856, per-expert global
  scale; the up projection and, for the K % 128 tail, the down projection): the same figures
  against `mx.gather_qmm(nvfp4, sorted_indices=True)`, plus a check that rows routed past the last
  expert come back zero;
* qmm prefill points (tokens 512, 2048), the `auto` arm's candidates there: native, dequant-gemm
  and the custom kernel (the prefill GEMM, `kernels.gemm_nvfp4`; also the MoE kernel with one
  expert it replaced), time per call (`benchmarks.gemm_lab` compares the GEMM's variants).

`--probe` (run under `ncu`) launches each kernel a few times for Nsight Compute's durations;
`--jobs COMMIT` writes JobSpec files for `python -m workers run` on the same machine.

Timing: each path is called L times inside one `mx.eval` (rotating over weight copies larger than
the 60 MB L2 where one copy is smaller than 4x L2), synchronised around; the time per call is the
slope between L1 and L2 launches (which removes the fixed cost of an eval), the median of REPEATS.
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import hashlib
import json
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from benchmarks.gpu_cases import (
    GEMV_K,
    GEMV_N,
    MOE,
    MOE_CONFIGS,
    gemv_section,
    moe_projection,
    moe_weights,
    qmm_prefill_section,
    routing,
)
from benchmarks.gpu_method import L1, L2, copy_ceiling_gb_s, device_facts, log
from kernels import moe_nvfp4
from kernels.gemv_nvfp4 import GemvConfig, gemv_nvfp4_cuda
from kernels.moe_nvfp4 import MoeConfig, moe_gather_nvfp4_cuda
from workers.contract import JobSpec, LockSettings

# --------------------------------------------------------------------- ncu probe and worker jobs


def ncu_probe(calls: int = 3) -> None:
    """Each path a few times, one eval each, between cuProfilerStart/Stop: run under
    `ncu --profile-from-start off --metrics gpu__time_duration.sum` it gives the kernels' own
    durations (ncu flushes the caches before each, so weights come from HBM), free of host cost."""
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
        for cfg in (GemvConfig("stream"), GemvConfig("ksplit", warps=2, unroll=3)):
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
    """JobSpec files for `python -m workers run` on the GPU: the built-in sweeps' points with the
    issue-7 arms (qmm decode, M=8 and a 512-token prefill; the moe-gather seed shape)."""
    folder.mkdir(parents=True, exist_ok=True)
    qmm_arms = ["native", "dequant-gemm", "custom", "custom-ksplit", "auto"]
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
            host="h200-host",
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
                f"{e['config'].get('label', e['config'])} |"
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
