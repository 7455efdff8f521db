"""Kernel lab for the NVFP4 prefill GEMM: every launch variant built, checked and timed through MLX.

    python3 -m benchmarks.gemm_lab --out DIR [--m 512,2048,4096,16384] [--only NAME,...] [--rounds R]
    python3 -m benchmarks.gemm_lab --out DIR --ncu NAME [--m 4096]    # Nsight Compute, one variant

Runs on MLX's CUDA backend (an NVIDIA GPU; installing there: docs/gpu-hosts.md). One call,
a few minutes, writes `DIR/gemm_lab.json` (every number) and `DIR/gemm_lab.txt` (the table it
prints last):

* the card: `nvidia-smi` facts, and the bf16 matrix peak measured through MLX (8192^3 products);
* the weights: N x K standard normal draws in bfloat16, quantized to NVFP4 with a global scale by
  `mx.quantize`; the float64 reference decodes them with `kernels.nvfp4` (independent of MLX);
* per M: every variant of `kernels.cuda.gemm_layout.VARIANTS` (built by NVRTC at its first call,
  M read at run time, so one build per variant) and MLX's paths on the same weights: dense bf16
  (`x @ w.T` on the NVFP4-dequantized weights), native (`mx.quantized_matmul` nvfp4, timed without
  the tensor-scale multiply, as the qmm case runs it), affine (4-bit g64 repack) and dequant-gemm
  (`mx.dequantize` + matmul inside the call). Each is checked first: outputs poisoned to NaN (the
  custom kernels; MLX's own allocate fresh), the NaN count over the whole output, the relative
  error of 48 sampled rows (first and last included) against float64 on fresh random x; then
  timed: L calls per `mx.eval` (L for at least 30 ms), the median of 5 such batches, synchronised
  around; and the peak memory a call adds above what is live before it. With `--rounds R`, every
  path of the M is then timed R - 1 times more, every other round in the reverse order (ABBA),
  and its seconds are the median of the R rounds (the ratios to the baselines too): the card's clock
  drifts through a call, and one pass times dense first and the last variant last;
* float16 activations: every variant checked once at the first M;
* the wgmma variants (sm_90a, built by NVRTC, `mx.fast.precompiled_cuda_kernel`) run afterwards in
  a child process (`DIR/wgmma/`, same method, its own baselines side by side), so that a fault in
  them cannot take the CUDA context, and the numbers already written, with it; the warp-specialised
  ones (`*p`: mbarrier handoff, where a protocol fault would hang the kernel) in another
  (`DIR/wgmma_ws/`), and the register-sourced ones (`r*`, gemm_nvfp4_rs.cu) first, in their own
  (`DIR/wgmma_rs/`); each child's JSON is written after every path, and kept when it times out;
* the recommended variant rule for `ORCHESTRATE_GEMM_VARIANT` (the fastest correct variant per M).

TFLOP/s count 2 M N K per call; "of peak" is against 790 TFLOP/s (the bf16 rate measured on these
machines, KINDS.md) and against this run's own 8192^3 measurement.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from benchmarks.gpu_method import device_facts, log, rel_error, to_np
from kernels import gemm_nvfp4, nvfp4
from kernels.cuda import cuda_backend_available
from kernels.cuda.gemm_layout import VARIANT_ENV, VARIANTS, describe

N, K = 21504, 5376
MS = (512, 2048, 4096, 16384)
PEAK_TFLOPS = 790.0
BASELINES = ("dense", "native", "affine", "dequant-gemm")
CHECK_ROWS = 48
BUDGET_S = 150.0  # stop adding M values past this, so the files are written inside a few minutes
CHILD_TIMEOUT_S = 150.0


def seconds_per_call(fn: Callable[[], mx.array], target_s: float = 0.03, batches: int = 5) -> dict[str, float]:
    """Median seconds per call of `fn` over `batches` evals of L calls (L calls last >= target_s)."""
    mx.eval(fn())
    mx.synchronize()
    t0 = time.perf_counter()
    mx.eval(fn())
    mx.synchronize()
    one = max(time.perf_counter() - t0, 1e-6)
    calls = int(min(50, max(2, target_s / one)))
    samples = []
    for _ in range(batches):
        mx.synchronize()
        t0 = time.perf_counter()
        mx.eval([fn() for _ in range(calls)])
        mx.synchronize()
        samples.append((time.perf_counter() - t0) / calls)
    return {"seconds": statistics.median(samples), "min": min(samples), "max": max(samples), "calls": calls}


def peak_extra_bytes(fn: Callable[[], mx.array]) -> int:
    """Memory one call adds at its peak above what is live before it (outputs and temporaries)."""
    mx.synchronize()
    before = mx.get_active_memory()
    mx.reset_peak_memory()
    out = fn()
    mx.eval(out)
    mx.synchronize()
    extra = mx.get_peak_memory() - before
    del out
    return int(extra)


def matrix_peak_tflops() -> float:
    """bf16 8192^3 products through MLX on random data: the card's matrix rate as MLX reaches it."""
    a = mx.random.normal((8192, 8192), key=mx.random.key(1)).astype(mx.bfloat16)
    b = mx.random.normal((8192, 8192), key=mx.random.key(2)).astype(mx.bfloat16)
    mx.eval(a, b)
    t = seconds_per_call(lambda: a @ b, target_s=0.05)
    return 2 * 8192**3 / t["seconds"] / 1e12


class Problem:
    """The weights in every form the paths hold, and the float64 reference of their product."""

    def __init__(self, n: int, k: int) -> None:
        w = mx.random.normal((n, k), key=mx.random.key(20)).astype(mx.bfloat16)
        self.gs = mx.max(mx.abs(w)).astype(mx.float32)
        self.wq, self.sc = mx.quantize(w, mode="nvfp4", global_scale=self.gs)[:2]
        self.mult = self.gs / nvfp4.MLX_GLOBAL_SCALE_DIVISOR
        self.dense = mx.dequantize(self.wq, self.sc, mode="nvfp4", global_scale=self.gs, dtype=mx.bfloat16)
        self.aq, self.asc, self.ab = mx.quantize(self.dense, group_size=64, bits=4, mode="affine")
        mx.eval(self.wq, self.sc, self.gs, self.mult, self.dense, self.aq, self.asc, self.ab)
        del w
        self.n, self.k = n, k
        codes = nvfp4.unpack_codes(np.array(self.wq))
        self.w64 = nvfp4.dequantize(codes, np.array(self.sc), float(np.array(self.gs)))

    def baseline(self, name: str, x: mx.array) -> Callable[[], mx.array]:
        """MLX's own paths (native without its tensor-scale multiply: `scale` says what it misses)."""
        if name == "dense":
            return lambda: x @ self.dense.T
        if name == "native":
            return lambda: mx.quantized_matmul(x, self.wq, self.sc, transpose=True, mode="nvfp4")
        if name == "affine":
            return lambda: mx.quantized_matmul(x, self.aq, self.asc, self.ab, transpose=True, group_size=64, bits=4)
        return lambda: x @ mx.dequantize(self.wq, self.sc, mode="nvfp4", global_scale=self.gs, dtype=x.dtype).T

    def scale(self, name: str) -> float:
        return float(np.array(self.mult)) if name == "native" else 1.0


def sample_rows(m: int, seed: int) -> np.ndarray:
    """CHECK_ROWS rows of M spread over every row tile, the first and the last included."""
    picked = np.random.default_rng(seed).choice(m, min(m, CHECK_ROWS - 2), replace=False)
    return np.unique(np.concatenate([[0, m - 1], picked]))


def check(out: mx.array, rows: np.ndarray, ref: np.ndarray, scale: float) -> dict[str, Any]:
    """NaN count over the whole output, relative error of the sampled rows against float64."""
    nan = int(np.asarray(mx.sum(mx.isnan(out))))
    got = to_np(out[mx.array(rows)]) * scale
    return {"nan": nan, "rel_error": rel_error(got, ref)}


def entry(name: str, t: dict[str, float], m: int, n: int, k: int, peak: float) -> dict[str, Any]:
    tflops = 2.0 * m * n * k / t["seconds"] / 1e12
    return {"path": name, **t, "ms": t["seconds"] * 1e3, "tflop_s": tflops, "of_790": tflops / PEAK_TFLOPS,
            "of_measured_peak": tflops / peak}  # fmt: skip


def run_m(
    prob: Problem,
    m: int,
    variants: list[str],
    peak: float,
    flush: Callable[[dict[str, Any]], None] | None = None,
    rounds: int = 1,
) -> dict[str, Any]:
    """Every path at one M: check, peak memory, time; then the ratios. `flush` is handed the block
    so far after every path (a kernel that hangs leaves the paths before it on disk). `rounds` > 1
    times every path again in rounds - 1 more passes, reversed every other time (`round_orders`), so
    that a clock that drifts through the call (the card heating up) falls on every path alike; a
    path's seconds are then the median of its rounds' medians, each round's kept in `rounds_s`."""
    x = mx.random.normal((m, prob.k), key=mx.random.key(m)).astype(mx.bfloat16)
    mx.eval(x)
    rows = sample_rows(m, m)
    ref = to_np(x[mx.array(rows)]) @ prob.w64.T
    paths: list[dict[str, Any]] = []
    fns: dict[str, Callable[[], mx.array]] = {}
    for name in (*BASELINES, *variants):
        if flush is not None:
            flush({"m": m, "paths": paths})
        log(f"M={m} {name}: ...")  # (the last line a timed-out child leaves names the path it hung in)
        try:
            if name in BASELINES:
                fn, out, scale = prob.baseline(name, x), prob.baseline(name, x)(), prob.scale(name)
            else:
                reason = gemm_nvfp4.kernel_supports(m, prob.n, prob.k, "bfloat16", name)
                if reason is not None:
                    paths.append({"path": name, "skipped": reason})
                    continue
                t0 = time.perf_counter()
                out = gemm_nvfp4.gemm_nvfp4_cuda(x, prob.wq, prob.sc, prob.gs, name, poison=True)
                mx.eval(out)
                build = time.perf_counter() - t0

                def fn(name: str = name) -> mx.array:
                    return gemm_nvfp4.gemm_nvfp4_cuda(x, prob.wq, prob.sc, prob.gs, name)

                scale = 1.0
            checked = check(out, rows, ref, scale)
            del out
            e = entry(name, seconds_per_call(fn), m, prob.n, prob.k, peak) | checked
            e["peak_extra_bytes"] = peak_extra_bytes(fn)
            if name not in BASELINES:
                e["first_call_s"] = build
            paths.append(e)
            fns[name] = fn
            log(f"M={m} {name}: {e['ms']:.3f} ms {e['tflop_s']:.0f} TFLOP/s err {e['rel_error']:.1e} nan {e['nan']}")
        except Exception as exc:  # a path that fails is reported, the rest still run
            paths.append({"path": name, "error": f"{type(exc).__name__}: {exc}"})
            log(f"M={m} {name}: FAILED {exc}")
    timed = {p["path"]: p for p in paths if "seconds" in p}
    if rounds > 1 and timed:
        retime(timed, fns, rounds, m, prob.n, prob.k, peak)
    for p in timed.values():
        for base in BASELINES:
            if base in timed:
                p[f"x_{base}"] = timed[base]["seconds"] / p["seconds"]  # speed-up over the baseline
    return {"m": m, "paths": paths}


def round_orders(names: list[str], rounds: int) -> list[list[str]]:
    """The order of each round: as checked, then reversed, and so on in turn (ABBA): over an even
    number of rounds every path's mean place in its rounds is the same, so a clock drifting at a
    steady rate through the call slows every path alike."""
    return [list(names) if r % 2 == 0 else names[::-1] for r in range(rounds)]


def retime(
    timed: dict[str, dict[str, Any]], fns: dict[str, Callable[[], mx.array]], rounds: int, m: int, n: int, k: int,
    peak: float,
) -> None:  # fmt: skip
    """`run_m`'s further rounds: every timed path again per round in `round_orders`' order; each path's
    seconds become the median of its rounds' medians (its entry's rates recomputed from them)."""
    per_round = {name: [p["seconds"]] for name, p in timed.items()}
    for order in round_orders(list(timed), rounds)[1:]:
        for name in order:
            per_round[name].append(seconds_per_call(fns[name])["seconds"])
    for name, p in timed.items():
        seconds = statistics.median(per_round[name])
        rates = entry(name, {"seconds": seconds}, m, n, k, peak)
        p.update({key: rates[key] for key in ("seconds", "ms", "tflop_s", "of_790", "of_measured_peak")})
        p["rounds_s"] = per_round[name]


def check_float16(prob: Problem, m: int, variants: list[str]) -> list[dict[str, Any]]:
    """Every variant once with float16 activations (the f16 decode route), against float64."""
    x = mx.random.normal((m, prob.k), key=mx.random.key(m + 1)).astype(mx.float16)
    rows = sample_rows(m, m + 1)
    ref = to_np(x[mx.array(rows)]) @ prob.w64.T
    out = []
    for name in variants:
        try:
            y = gemm_nvfp4.gemm_nvfp4_cuda(x, prob.wq, prob.sc, prob.gs, name, poison=True)
            out.append({"path": name, **check(y, rows, ref, 1.0)})
        except Exception as exc:
            out.append({"path": name, "error": f"{type(exc).__name__}: {exc}"})
    return out


def recommend(per_m: list[dict[str, Any]], tolerance: float) -> str:
    """The variant rule ("name@max_m,...,name") of the fastest correct variant at each M."""
    paths: dict[int, list[dict[str, Any]]] = {}  # blocks of one M (this process's and the wgmma child's) pooled
    for block in per_m:
        paths.setdefault(int(block["m"]), []).extend(block["paths"])
    best: list[tuple[int, str]] = []
    for m in sorted(paths):
        ok = [p for p in paths[m] if p["path"] in VARIANTS and "seconds" in p]
        ok = [p for p in ok if p["nan"] == 0 and p["rel_error"] <= tolerance]
        if ok:
            best.append((m, min(ok, key=lambda p: p["seconds"])["path"]))
    if not best:
        return ""
    merged: list[tuple[int, str]] = []
    for m, name in best:
        if merged and merged[-1][1] == name:
            merged[-1] = (m, name)
        else:
            merged.append((m, name))
    return ",".join([f"{name}@{m}" for m, name in merged[:-1]] + [merged[-1][1]])


def table(results: dict[str, Any]) -> str:
    """The printed summary: one line per path per M, ratios to the baselines."""
    peak = results["matrix_peak_tflops"]
    lines = [
        f"{results['device'].get('gpu')} | MLX {results['device']['mlx_version']} | N={results['n']} K={results['k']}"
        f" bf16 | bf16 matrix peak through MLX {peak:.0f} TFLOP/s",
        f"{'M':>5} {'path':<15} {'ms':>8} {'TFLOP/s':>7} {'/790':>5} {'x aff':>6} {'x nat':>6} {'x dqg':>6}"
        f" {'x dense':>7} {'rel err':>8} {'NaN':>4} {'+peak MB':>8}",
    ]
    for block in results["per_m"]:
        for p in block["paths"]:
            if "seconds" not in p:
                lines.append(f"{block['m']:>5} {p['path']:<15} {p.get('skipped') or p.get('error')}")
                continue
            ratios = " ".join(f"{p.get(f'x_{b}', float('nan')):>6.2f}" for b in ("affine", "native", "dequant-gemm"))
            lines.append(
                f"{block['m']:>5} {p['path']:<15} {p['ms']:>8.3f} {p['tflop_s']:>7.0f} {p['of_790']:>5.0%} {ratios}"
                f" {p.get('x_dense', float('nan')):>7.2f} {p['rel_error']:>8.1e} {p['nan']:>4} "
                f"{p['peak_extra_bytes'] / 1e6:>8.0f}"
            )
    f16 = results.get("float16", [])
    if f16:
        cells = " ".join(f"{p['path']}={p.get('rel_error', float('nan')):.1e}/{p.get('nan', '?')}" for p in f16)
        lines.append(f"float16 check (rel err / NaN): {cells}")
    lines.append(f"recommended: {results['rule_env']}={results['recommended_rule']!r}")
    return "\n".join(lines)


def probe(name: str, m: int) -> None:
    """A few calls of one variant (run under ncu: `--ncu`)."""
    prob = Problem(N, K)
    x = mx.random.normal((m, K), key=mx.random.key(m)).astype(mx.bfloat16)
    for _ in range(4):
        mx.eval(gemm_nvfp4.gemm_nvfp4_cuda(x, prob.wq, prob.sc, prob.gs, name))
        mx.synchronize()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--m", default=",".join(map(str, MS)), help="activation rows, comma-separated")
    parser.add_argument("--only", default="", help="variant names, comma-separated (default: all)")
    parser.add_argument("--shape", default=f"{N},{K}", help="N,K (default: the seed's projection)")
    parser.add_argument("--ncu", default="", help="profile this variant's kernel under Nsight Compute")
    parser.add_argument("--probe", default="", help=argparse.SUPPRESS)
    parser.add_argument("--in-process", action="store_true", help="run wgmma variants here, not in a child")
    parser.add_argument("--rounds", type=int, default=1, help="time every path this many times, interleaved")
    args = parser.parse_args(argv)
    ms = [int(v) for v in args.m.split(",")]
    n, k = (int(v) for v in args.shape.split(","))
    chosen = [v for v in VARIANTS if not args.only or v in args.only.split(",")]
    variants = chosen if args.in_process else [v for v in chosen if not VARIANTS[v].wgmma]
    children = {} if args.in_process else child_groups(chosen)
    if args.probe:
        probe(args.probe, ms[0])
        return 0
    if not cuda_backend_available():
        print("gemm_lab: needs MLX's CUDA backend (an NVIDIA GPU)", file=sys.stderr)
        return 3
    args.out.mkdir(parents=True, exist_ok=True)
    if args.ncu:
        cmd = ["ncu", "--clock-control", "none", "-k", "regex:gemm_nvfp4", "--launch-skip", "2", "--launch-count", "1"]
        cmd += ["--set", "full", sys.executable, "-m", "benchmarks.gemm_lab", "--out", str(args.out)]
        cmd += ["--probe", args.ncu, "--m", str(ms[0])]
        # the sections' bodies too: the warp stall reasons behind "warp cycles per issued instruction"
        detailed = [cmd[0], "--print-details", "all", *cmd[1:]]
        prof = subprocess.run(detailed, capture_output=True, text=True, check=False, env=os.environ)
        if prof.returncode and "print-details" in prof.stderr:  # an ncu without the option
            prof = subprocess.run(cmd, capture_output=True, text=True, check=False, env=os.environ)
        (args.out / f"ncu_{args.ncu}_m{ms[0]}.txt").write_text(prof.stdout + prof.stderr)
        print(prof.stdout[-6000:], prof.stderr[-2000:])
        return prof.returncode
    started = time.perf_counter()
    results: dict[str, Any] = {"device": device_facts(), "n": n, "k": k, "command": " ".join(sys.argv)}
    results["variants"] = [describe(v) for v in variants]
    results["matrix_peak_tflops"] = matrix_peak_tflops()
    log(f"bf16 matrix peak through MLX: {results['matrix_peak_tflops']:.0f} TFLOP/s")
    prob = Problem(n, k)
    results["per_m"] = []
    path = args.out / "gemm_lab.json"
    tolerance = gemm_nvfp4.TOLERANCE["bfloat16"]
    results["rule_env"], results["recommended_rule"] = VARIANT_ENV, ""

    def flush(block: dict[str, Any]) -> None:
        path.write_text(json.dumps(results | {"per_m": [*results["per_m"], block]}, indent=1, default=str))

    for i, m in enumerate(ms):
        if time.perf_counter() - started > BUDGET_S * args.rounds:
            results.setdefault("skipped_m", []).append(m)
            continue
        results["per_m"].append(run_m(prob, m, variants, results["matrix_peak_tflops"], flush, args.rounds))
        if i == 0:
            results["float16"] = check_float16(prob, m, variants)
        results["recommended_rule"] = recommend(results["per_m"], tolerance)
        path.write_text(json.dumps(results, indent=1, default=str))
    results["wall_s"] = time.perf_counter() - started
    path.write_text(json.dumps(results, indent=1, default=str))
    text = table(results)
    report = args.out / "gemm_lab.txt"  # (rewritten after each child: an outer timeout keeps the rest)
    report.write_text(text + "\n")
    pooled = list(results["per_m"])
    for key, group in children.items():
        child = run_child(args.out / key, group, args.m, args.shape, args.rounds)
        results[key] = child
        kind = {"wgmma_ws": ", warp-specialised", "wgmma_rs": ", register-sourced"}.get(key, "")
        what = "wgmma variants (sm_90a through NVRTC)" + kind
        if "per_m" in child:
            pooled += child["per_m"]
            results["recommended_rule"] = recommend(pooled, tolerance)
            text += f"\n\n{what}, a child process:\n" + table(child | {"recommended_rule": results["recommended_rule"]})
            if "error" in child:
                text += f"\n{key} child: {child['error']}"
        else:
            text += f"\n\n{what}: {child.get('error')}"
        path.write_text(json.dumps(results, indent=1, default=str))
        report.write_text(text + "\n")
    print(text)
    return 0


def child_groups(chosen: list[str]) -> dict[str, list[str]]:
    """The variants each child process runs (its folder name -> names): the wgmma ones apart from
    this process's, the register-sourced ones (a kernel of its own) first, and the warp-specialised
    ones (mbarriers: a protocol fault hangs the kernel, and the child with it) apart from the rest."""
    groups = {"wgmma_rs": [v for v in chosen if VARIANTS[v].rs]}
    groups["wgmma"] = [v for v in chosen if VARIANTS[v].wgmma and not (VARIANTS[v].producer or VARIANTS[v].rs)]
    groups["wgmma_ws"] = [v for v in chosen if VARIANTS[v].producer]
    return {key: names for key, names in groups.items() if names}


def run_child(out: Path, variants: list[str], ms: str, shape: str, rounds: int = 1) -> dict[str, Any]:
    """The given variants in a fresh process (`--in-process`), its JSON, or what went wrong."""
    cmd = [sys.executable, "-m", "benchmarks.gemm_lab", "--out", str(out), "--only", ",".join(variants)]
    cmd += ["--m", ms, "--shape", shape, "--in-process", "--rounds", str(rounds)]
    child = out / "gemm_lab.json"
    limit = CHILD_TIMEOUT_S * max(rounds, 1)  # each further round times every path again
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=limit, check=False)
        stderr, failed = proc.stderr, f"exit {proc.returncode}" if proc.returncode != 0 else ""
    except subprocess.TimeoutExpired as exc:  # a kernel that hangs: what it wrote before stays
        raw = exc.stderr or b""
        stderr = raw.decode(errors="replace") if isinstance(raw, bytes) else raw
        failed = f"timed out after {limit:.0f} s"
    log(stderr[-3000:])
    last = stderr.strip().splitlines()[-1:] or ["no output"]
    if not child.is_file():
        return {"error": f"{failed or 'no results'}: {last[0]}"}
    loaded: dict[str, Any] = json.loads(child.read_text())  # written after every path: a crash keeps the rest
    if failed:
        loaded["error"] = f"{failed}: {last[0]}"
    return loaded


if __name__ == "__main__":
    sys.exit(main())
