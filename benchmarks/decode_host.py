"""Where a pipelined decode step's time goes, per arm of the `model` case, in one process.

    python3 -m benchmarks.decode_host --out DIR [--windows 6] [--trace] [--tiny]

For the decoder of the nvfp4-prefill model point (4 Gemma-3-27B-wide layers, NVFP4, bfloat16;
`--tiny`: a 2-layer, 256-wide one that runs in seconds on a CPU):

* `launch`: the host's cost of one op in MLX's evaluation, by kind of op: an elementwise multiply,
  affine and native `mx.quantized_matmul`, and our decode GEMV as the `custom` linears bind it
  (`kernels.nvfp4_linear.bound_matmul`), 200 chained calls at M = 1 on a square weight: `build_us`
  (Python building the graph), `encode_us` (`mx.async_eval` handing it to the device) and
  `total_us` per op, the best of 3. At a small width the device has almost nothing to do, so the
  total is the host's. `custom GEMV, plain cubin` is the same launch from the uncompressed cubin
  (`kernels.cuda.fatbin`).
* `decode`: every arm loaded in one process and decoding windows of 128 tokens from the same
  8-token prompt, ABBA, as the `model` case takes them (`workers.job.steady.ArmRunner`): median
  tok/s, milliseconds per step (`step_ms`), and of it the host's (`host_ms`, building and queueing)
  and building alone (`build_ms`).
* `--trace`: the device's busy time per step of each arm (the sum of its kernels' durations over
  a 32-token window, read by PyTorch's CUPTI profiler, which sees MLX's kernels too), and the
  kernels that fill it. Needs PyTorch with CUDA in the same environment.

A step is bound by the host where `host_ms` is above the device's busy time: a faster kernel then
buys nothing until the host's cost per step falls. Writes `DIR/decode_host.json` and prints it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from unittest import mock

import mlx.core as mx
import numpy as np

from kernels import gemv_nvfp4
from kernels.checkpoint import DecoderConfig, write_checkpoint
from kernels.cuda import fatbin, nvrtc
from kernels.model import load_decoder
from kernels.nvfp4_linear import bound_matmul
from workers.job.steady import ArmRunner

MODEL = {"hidden": 5376, "intermediate": 21504, "layers": 4, "heads": 32, "kv_heads": 16, "head_dim": 128}
TINY = {"hidden": 256, "intermediate": 512, "layers": 2, "heads": 4}
ARMS = ("affine", "native", "custom")
CHAIN = 200
PROMPT = 8  # decode GEMVs only: a longer prompt would build the prefill GEMM's variants first
WINDOW = 128
TRACE_WINDOW = 32


def _per_op(fn: Callable[[mx.array], mx.array], x: mx.array) -> dict[str, float]:
    """Microseconds per op of `CHAIN` chained calls of `fn`: build, encode, total (best of 3)."""
    mx.eval(fn(x))
    best: dict[str, float] = {}
    for _ in range(3):
        mx.synchronize()
        t0 = time.perf_counter()
        y = x
        for _ in range(CHAIN):
            y = fn(y)
        t1 = time.perf_counter()
        mx.async_eval(y)
        t2 = time.perf_counter()
        mx.eval(y)
        t3 = time.perf_counter()
        got = {"build_us": t1 - t0, "encode_us": t2 - t1, "total_us": t3 - t0}
        if not best or got["total_us"] < best["total_us"]:
            best = got
    return {k: round(1e6 * v / CHAIN, 2) for k, v in best.items()}


def launch_costs(dim: int) -> dict[str, dict[str, float]]:
    """The host's cost per op of each kind of op (module docstring) at a `dim` x `dim` weight."""
    rng = np.random.default_rng(0)
    x = mx.array(rng.standard_normal((1, dim)).astype(np.float32) * 0.01).astype(mx.bfloat16)
    w = mx.array(rng.standard_normal((dim, dim)).astype(np.float32) * 0.02)
    wa, sa, ba = mx.quantize(w, group_size=64, bits=4)
    wn, sn = mx.quantize(w, group_size=16, bits=4, mode="nvfp4")[:2]
    gsv = gemv_nvfp4.kernel_multiplier(None)
    custom = bound_matmul((1,), dim, dim, mx.bfloat16)
    plain = _from_plain_cubin(dim)
    ops: dict[str, Callable[[mx.array], mx.array]] = {
        "multiply": lambda y: y * 1.0001,
        "affine quantized_matmul": lambda y: mx.quantized_matmul(y, wa, sa, ba, group_size=64, bits=4),
        "native quantized_matmul": lambda y: mx.quantized_matmul(y, wn, sn, group_size=16, bits=4, mode="nvfp4"),
        "custom GEMV": lambda y: custom(y, wn, sn, gsv),
        "custom GEMV, plain cubin": lambda y: plain(y, wn, sn, gsv),
    }
    return {name: _per_op(fn, x) for name, fn in ops.items()}


def _from_plain_cubin(dim: int) -> Callable[..., mx.array]:
    """The custom GEMV's launch from its uncompressed cubin (`kernels.cuda.fatbin` off): beside
    the compressed one, what the compression buys per launch."""
    caches = (nvrtc.build, gemv_nvfp4.launcher)
    for cache in caches:
        cache.cache_clear()
    with mock.patch.object(fatbin, "compress", lambda cubin, arch: cubin):
        call = bound_matmul((1,), dim, dim, mx.bfloat16)
    for cache in caches:
        cache.cache_clear()
    return call


def decode_windows(runners: dict[str, ArmRunner], windows: int) -> dict[str, dict[str, Any]]:
    """Median tok/s and step/host/build milliseconds per step of `windows` ABBA windows per arm."""
    for runner in runners.values():
        runner.window(8)
    taken: dict[str, list[tuple[float, float, float, float]]] = {arm: [] for arm in runners}
    names = list(runners)
    for i in range(windows):
        for arm in names if i % 2 == 0 else names[::-1]:
            _, wall, host, build = runners[arm].window(WINDOW)
            taken[arm].append((WINDOW / wall, 1e3 * wall / WINDOW, 1e3 * host / WINDOW, 1e3 * build / WINDOW))
    out = {}
    for arm, rows in taken.items():
        tok_s, *per_step = (statistics.median(c) for c in zip(*rows, strict=True))
        out[arm] = {"tok_s": round(tok_s, 1)} | {
            name: round(ms, 4) for name, ms in zip(("step_ms", "host_ms", "build_ms"), per_step, strict=True)
        }
    return out


def device_busy(runners: dict[str, ArmRunner]) -> dict[str, dict[str, Any]]:
    """Each arm's kernels over a window, per step, as CUPTI times them (`--trace`)."""
    from torch.profiler import ProfilerActivity, profile  # optional: on GPU hosts with PyTorch

    out = {}
    for arm, runner in runners.items():
        runner.window(8)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            runner.window(TRACE_WINDOW)
            mx.synchronize()
        kernels = [e for e in prof.events() if e.device_type.name == "CUDA"]
        by_name: dict[str, float] = {}
        for e in kernels:
            by_name[e.name[:60]] = by_name.get(e.name[:60], 0.0) + e.device_time / TRACE_WINDOW
        top = sorted(by_name.items(), key=lambda kv: -kv[1])[:8]
        out[arm] = {
            "kernels_per_step": round(len(kernels) / TRACE_WINDOW, 1),
            "busy_us_per_step": round(sum(e.device_time for e in kernels) / TRACE_WINDOW, 1),
            "top_us_per_step": {name: round(us, 1) for name, us in top},
        }
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--windows", type=int, default=6)
    parser.add_argument("--trace", action="store_true")
    parser.add_argument("--tiny", action="store_true")
    args = parser.parse_args(argv)
    shape = TINY if args.tiny else MODEL
    result: dict[str, Any] = {"device": str(mx.default_device()), "model": shape, "window_tokens": WINDOW}
    result["launch"] = launch_costs(shape["hidden"] if args.tiny else 1024)
    with tempfile.TemporaryDirectory() as tmp:
        config = DecoderConfig(architecture="gemma", vocab=32768 if not args.tiny else 1024, dtype="bfloat16", **shape)
        path = write_checkpoint(config, 7, Path(tmp) / "decoder")
        stream = mx.new_stream(mx.default_device())
        runners = {}
        for arm in ARMS:
            loaded = load_decoder(path, arm)
            prompt = mx.array(np.random.default_rng(1).integers(0, loaded.vocab, PROMPT), dtype=mx.int32)
            runners[arm] = ArmRunner(loaded.model, prompt, stream)
        result["decode"] = decode_windows(runners, args.windows)
        if args.trace:
            result["trace"] = device_busy(runners)
    args.out.mkdir(parents=True, exist_ok=True)
    text = json.dumps(result, indent=2)
    (args.out / "decode_host.json").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
