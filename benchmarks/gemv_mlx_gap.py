"""Where the stream GEMV loses time inside MLX's process: the same kernel, three ways, one process.

    python3 -m benchmarks.gemv_mlx_gap --out DIR [--m 1,8] [--mlx-only]

Runs on the GPU machine with MLX's CUDA build and CuPy. The decode GEMV (N=21504, K=5376, bf16)
runs at about 23 us per launch in `benchmarks.gemv_lab` (plain CUDA launches, cudaMalloc buffers)
and took about 33 us per call through MLX. This script separates the suspects:

* `mlx`: through `mx.fast.cuda_kernel` as users run it (MLX's CUDA graphs, its unified-memory
  buffers), time per call as `benchmarks.gpu_kernels` takes it (slope between 20 and 200 calls in
  one `mx.eval`, weights rotated over 4 copies);
* `cupy-mlx-buffers`: the same kernel body built by nvcc, launched by CuPy one by one on MLX's own
  buffers (their pointers: MLX's unified memory is addressable from the host);
* `cupy-own-buffers`: the same launches on cudaMalloc copies of those buffers;
* `cupy-mlx-weights`: MLX's weight buffers, CuPy's x, scale and output (MLX keeps scalars in a
  read-mostly unified-memory pool);
* `mlx-gsv-4-bytes`: through MLX with a 4-byte multiplier array, as the library passed it before
  `kernels.cuda.off_small_pool` (MLX serves it from its read-mostly pool of small buffers);
* `*-advised`: the same after the weights are advised to live on the GPU and prefetched there
  (cuMemAdvise SET_PREFERRED_LOCATION + cuMemPrefetchAsync).

`--configs w6b264c4s2,...` times more launch shapes through MLX; `--floor` the same path at N=256
(almost no GPU work: the host's cost per call). `--mlx-only` times the `mlx` ways alone (under
`MLX_MAX_OPS_PER_BUFFER=1` that serialises the kernels: one graph per launch). `--trace` records
the `mlx` way's kernels (and `mx.quantized_matmul`'s) with PyTorch's CUPTI profiler: durations,
overlap, busy time per call, and that time's GB/s against the copy ceiling measured in the same
process. Writes `DIR/gemv_mlx_gap_<MLX_MAX_OPS_PER_BUFFER or default>.json` and prints a table.
"""

from __future__ import annotations

import argparse
import ctypes
import itertools
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from benchmarks.gpu_method import L1, L2, copy_ceiling_gb_s, log, per_call_seconds
from kernels.cuda import cuda_device
from kernels.gemv_nvfp4 import GEMV_SOURCE, STREAM_CONFIG, GemvConfig, gemv_nvfp4_cuda, launcher, stream_constants

N, K = 21504, 5376
COPIES = 4
LAUNCHES, REPS = 48, 11


def mlx_pointer(a: mx.array) -> int:
    """The device address of an evaluated MLX array (unified memory: the host sees the same address)."""
    mx.eval(a)
    view = np.frombuffer(memoryview(a), dtype=np.uint8)  # no copy: a view of MLX's buffer
    return int(view.ctypes.data)


def pointer_kind(ptr: int) -> str:
    import cupy as cp  # CuPy: optional, only for the CuPy measurements

    kinds = {0: "unregistered", 1: "host", 2: "device", 3: "managed"}
    return kinds.get(int(cp.cuda.runtime.pointerGetAttributes(ptr).type), "?")


class Driver:
    """The few driver calls CuPy does not wrap the same way on every CUDA version."""

    def __init__(self) -> None:
        self.lib = ctypes.CDLL("libcuda.so.1")

    def advise_gpu(self, ptr: int, size: int) -> str:
        """SET_PREFERRED_LOCATION (3) and SET_ACCESSED_BY (5) to device 0, then prefetch there."""
        ptr_t, size_t = ctypes.c_uint64(ptr), ctypes.c_size_t(size)
        results = []
        for advice in (3, 5):
            results.append(self.lib.cuMemAdvise(ptr_t, size_t, ctypes.c_int(advice), ctypes.c_int(0)))
        results.append(self.lib.cuMemPrefetchAsync(ptr_t, size_t, ctypes.c_int(0), ctypes.c_void_p(0)))
        self.lib.cuCtxSynchronize()
        return ",".join(str(r) for r in results)

    def range_attributes(self, ptr: int, size: int) -> dict[str, int]:
        """READ_MOSTLY (1), PREFERRED_LOCATION (2), LAST_PREFETCH_LOCATION (4); -2: not managed."""
        out = {}
        for name, attr in (("read_mostly", 1), ("preferred_location", 2), ("last_prefetch_location", 4)):
            value = ctypes.c_int(-2)
            rc = self.lib.cuMemRangeGetAttribute(
                ctypes.byref(value), ctypes.c_size_t(4), ctypes.c_int(attr), ctypes.c_uint64(ptr), ctypes.c_size_t(size)
            )
            out[name] = value.value if rc == 0 else -1000 - rc
        return out


def build_module(m: int, workdir: Path) -> tuple[Any, int, int, int]:
    """The stream kernel for M rows, built by nvcc as `gemv_lab` builds it; (function, blocks, threads, smem)."""
    import cupy as cp  # CuPy: optional, only for the CuPy measurements

    device = cuda_device()
    assert device is not None
    consts, smem = stream_constants(m, N, K, STREAM_CONFIG, device.multiprocessors, False)
    template: dict[str, int | bool | str] = {"T": "bfloat16", **consts}
    name = f"gap_stream_m{m}"
    dtypes = ({"x": "bfloat16", "w": "uint32", "scales": "uint8", "gsv": "float32"}, {"y": "bfloat16"})
    src = workdir / f"{name}.cu"
    src.write_text(GEMV_SOURCE.standalone_source(*dtypes, template, function_name=name))
    cubin = workdir / f"{name}.cubin"
    subprocess.run(["nvcc", "-O3", "-arch=sm_90", "-std=c++17", "-cubin", "-o", str(cubin), str(src)], check=True)
    symbol = re.search(rb"_ZN3mlx4core2cu\d+" + name.encode() + rb"E[A-Za-z0-9_]+", cubin.read_bytes())
    assert symbol is not None, "kernel symbol not found in the cubin"
    fn = cp.RawModule(path=str(cubin)).get_function(symbol.group().decode())
    fn.max_dynamic_shared_size_bytes = smem
    return fn, int(consts["BLOCKS"]), 32 * int(consts["WARPS"]), smem


def time_cupy(fn: Any, grid: tuple[int, int, int], args: list[tuple[Any, ...]]) -> dict[str, float]:
    """Median of REPS batches of LAUNCHES plain launches on one stream, rotating over the arg sets."""
    import cupy as cp  # CuPy: optional, only for the CuPy measurements

    blocks, threads, smem = grid
    stream = cp.cuda.Stream(non_blocking=True)
    times = []
    with stream:
        for i in range(16):
            fn((blocks,), (threads,), args[i % len(args)], shared_mem=smem)
        stream.synchronize()
        for _ in range(REPS):
            e0, e1 = cp.cuda.Event(), cp.cuda.Event()
            e0.record(stream)
            for i in range(LAUNCHES):
                fn((blocks,), (threads,), args[i % len(args)], shared_mem=smem)
            e1.record(stream)
            e1.synchronize()
            times.append(cp.cuda.get_elapsed_time(e0, e1) / LAUNCHES * 1e3)
    return {"us": statistics.median(times), "us_min": min(times), "us_max": max(times)}


def time_mlx(
    x: mx.array, weights: list[tuple[mx.array, mx.array]], gsv: mx.array | None = None, cfg: GemvConfig = STREAM_CONFIG
) -> dict[str, float]:
    """Per call through MLX (`gemv_nvfp4_cuda`); with `gsv`, the kernel gets that multiplier array
    instead of the library's (a 4-byte one lands in MLX's read-mostly pool of small buffers)."""
    if gsv is None:
        call = lambda i: gemv_nvfp4_cuda(x, *weights[i % len(weights)], None, cfg)  # noqa: E731
    else:
        launch = launcher(x.shape[0], weights[0][0].shape[0], K, x.dtype, cfg)
        call = lambda i: launch(x, *weights[i % len(weights)], gsv)  # noqa: E731
    return in_us(per_call_seconds(call, L1, L2))


def in_us(t: dict[str, float]) -> dict[str, float]:
    """`per_call_seconds`'s median, min and max in microseconds."""
    return {"us": t["seconds"] * 1e6, "us_min": t["seconds_min"] * 1e6, "us_max": t["seconds_max"] * 1e6}


def parse_config(text: str) -> GemvConfig:
    """`w12b0c4s2` -> GemvConfig(warps=12, blocks=0, chunk=4, stages=2) (blocks 0: one per SM)."""
    found = re.fullmatch(r"w(\d+)b(\d+)c(\d+)s(\d+)", text)
    if found is None:
        raise SystemExit(f"--configs: {text!r} is not wWbBcCsS")
    warps, blocks, chunk, stages = (int(v) for v in found.groups())
    return GemvConfig(warps=warps, blocks=blocks, chunk=chunk, stages=stages)


def busy_us(kernels: list[tuple[float, float]]) -> float:
    """Time covered by at least one of the (start, duration) intervals."""
    total, reach = 0.0, float("-inf")
    for start, dur in sorted(kernels):
        end = start + dur
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def trace_mlx(call: Callable[[int], mx.array], name_part: str, calls: int = 200) -> dict[str, Any]:
    """`calls` calls in one eval under PyTorch's CUPTI profiler: the kernels' durations, how many
    overlap (MLX's graphs run independent calls concurrently), the span from the first start to
    the last end, and the busy time (covered by at least one of them; idle gaps left while the host
    assembles the next graph excluded), each per call."""
    # PyTorch: optional, only for its profiler
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.init()
    mx.eval([call(i) for i in range(calls)])
    mx.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        mx.eval([call(i) for i in range(calls)])
        mx.synchronize()
    kernels = []
    for ev in prof.events():
        if name_part in ev.name and ev.device_type.name == "CUDA":
            kernels.append((ev.time_range.start, ev.time_range.end - ev.time_range.start))
    kernels.sort()
    if not kernels:
        return {"kernels": 0, "names": sorted({ev.name for ev in prof.events()})[:20]}
    durs = [d for _, d in kernels]
    overlaps = sum(1 for (s0, d0), (s1, _) in itertools.pairwise(kernels) if s1 < s0 + d0)
    span = kernels[-1][0] + kernels[-1][1] - kernels[0][0]
    return {
        "kernels": len(kernels),
        "duration_us_median": statistics.median(durs),
        "duration_us_min": min(durs),
        "duration_us_max": max(durs),
        "overlapping_pairs": overlaps,
        "span_us_per_kernel": span / len(kernels),
        "busy_us_per_kernel": busy_us(kernels) / len(kernels),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--m", default="1,8")
    parser.add_argument("--mlx-only", action="store_true")
    parser.add_argument("--trace", action="store_true")
    parser.add_argument("--floor", action="store_true", help="also time N=256 (the host's cost per call)")
    parser.add_argument("--configs", default="", help="more stream launch shapes through MLX, e.g. w6b264c4s2")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    ms = [int(v) for v in args.m.split(",")]
    env = os.environ.get("MLX_MAX_OPS_PER_BUFFER", "default")
    weights = []
    for _ in range(COPIES):
        wq, sc = mx.quantize(mx.random.normal((N, K)).astype(mx.bfloat16), mode="nvfp4")[:2]
        mx.eval(wq, sc)
        weights.append((wq, sc))
    small = [tuple(mx.quantize(mx.random.normal((256, K)).astype(mx.bfloat16), mode="nvfp4")[:2])]
    mx.eval(small)
    results: dict[str, Any] = {"max_ops_per_buffer": env, "per_m": []}
    if args.trace:  # the ceiling the busy times are read against, measured in this process
        results["copy_ceiling"] = copy_ceiling_gb_s()
        log(f"copy ceiling {results['copy_ceiling']['gb_s']:.0f} GB/s ({results['copy_ceiling']['via']})")
    for m in ms:
        x = mx.random.normal((m, K)).astype(mx.bfloat16)
        mx.eval(x)
        row: dict[str, Any] = {"m": m, "mlx": time_mlx(x, weights)}
        row["mlx-gsv-4-bytes"] = time_mlx(x, weights, mx.array([1.0], dtype=mx.float32))
        log(f"M={m} mlx ({env}): {row['mlx']['us']:.1f} us; 4-byte gsv {row['mlx-gsv-4-bytes']['us']:.1f} us")
        for text in [c for c in args.configs.split(",") if c]:
            row[f"mlx-{text}"] = time_mlx(x, weights, cfg=parse_config(text))
            log(f"M={m} mlx {text}: {row[f'mlx-{text}']['us']:.1f} us")
        if args.floor:  # almost no GPU work: the host's cost per call, and where it goes
            launch = launcher(m, 256, K, x.dtype, STREAM_CONFIG)  # the traced call, no Python wrapper
            gsv = mx.zeros((4,), dtype=mx.float32)
            floors = {
                "mlx-n256-floor": lambda i, x=x: gemv_nvfp4_cuda(x, *small[0], None, STREAM_CONFIG),
                "mlx-n256-traced-call-only": lambda i, x=x, launch=launch, gsv=gsv: launch(x, *small[0], gsv),
                "mlx-builtin-add": lambda i, x=x: x + 1,  # one built-in elementwise op
            }
            for label, call in floors.items():
                row[label] = in_us(per_call_seconds(call, L1, L2))
                log(f"M={m} {label}: {row[label]['us']:.1f} us")
        if args.trace:
            ways = {
                "trace": (lambda i, x=x: gemv_nvfp4_cuda(x, *weights[i % COPIES], None, STREAM_CONFIG), "gemv_nvfp4"),
                "trace_native": (
                    lambda i, x=x: mx.quantized_matmul(x, *weights[i % COPIES], transpose=True, mode="nvfp4"),
                    "qm",  # qmv_kernel, qmm_sm80_kernel
                ),
            }
            for label, (call, name_part) in ways.items():
                try:
                    row[label] = trace_mlx(call, name_part)
                except Exception as exc:  # the trace is a diagnostic: report, go on
                    row[label] = {"error": f"{type(exc).__name__}: {exc}"}
                log(f"M={m} {label}: {row[label]}")
        if not args.mlx_only:
            row.update(cupy_ways(m, x, weights))
        if args.trace and "busy_us_per_kernel" in row["trace"]:
            nbytes = N * K // 2 + N * K // 16 + m * K * 2 + m * N * 2  # weights, scales, x, y once each
            gb_s = nbytes / row["trace"]["busy_us_per_kernel"] / 1e3
            row["busy_gb_s"] = gb_s
            row["busy_fraction_of_copy"] = gb_s / results["copy_ceiling"]["gb_s"]
            busy = row["trace"]["busy_us_per_kernel"]
            log(f"M={m} busy {busy:.2f} us: {gb_s:.0f} GB/s, {row['busy_fraction_of_copy']:.1%} of the copy")
        results["per_m"].append(row)
    (args.out / f"gemv_mlx_gap_{env}.json").write_text(json.dumps(results, indent=1))
    for row in results["per_m"]:
        for key, value in row.items():
            if isinstance(value, dict) and "us" in value:
                print(f"M={row['m']} {key:<28} {value['us']:7.2f} us  [{value['us_min']:.2f}, {value['us_max']:.2f}]")
            elif key != "m":
                print(f"M={row['m']} {key:<28} {value}")
    return 0


def cupy_ways(m: int, x: mx.array, weights: list[tuple[mx.array, mx.array]]) -> dict[str, Any]:
    """The kernel launched by CuPy on MLX's buffers and on its own; before and after advising."""
    import cupy as cp  # CuPy: optional, only for the CuPy measurements

    drv = Driver()
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        fn, blocks, threads, smem = build_module(m, Path(tmp))
    grid = (blocks, threads, smem)
    xs = x.view(mx.uint16)
    gsv = mx.array([1.0], dtype=mx.float32)
    y_mlx = mx.zeros((m, N), dtype=mx.uint16)
    wp = [(mlx_pointer(w), mlx_pointer(s)) for w, s in weights]
    xp, gp, yp = mlx_pointer(xs), mlx_pointer(gsv), mlx_pointer(y_mlx)
    out["pointer_kinds"] = {"w": pointer_kind(wp[0][0]), "x": pointer_kind(xp), "gsv": pointer_kind(gp)}
    out["weight_range_attributes"] = drv.range_attributes(wp[0][0], N * K // 2)
    out["gsv_range_attributes"] = drv.range_attributes(gp, 4)
    # own buffers: cudaMalloc copies (CuPy's pool allocates with cudaMalloc)
    own_w = []
    for w, s in wp:
        cw, cs = cp.empty(N * K // 2, dtype=cp.uint8), cp.empty(N * K // 16, dtype=cp.uint8)
        cp.cuda.runtime.memcpy(cw.data.ptr, w, N * K // 2, cp.cuda.runtime.memcpyDeviceToDevice)
        cp.cuda.runtime.memcpy(cs.data.ptr, s, N * K // 16, cp.cuda.runtime.memcpyDeviceToDevice)
        own_w.append((cw, cs))
    cx = cp.empty(m * K, dtype=cp.uint16)
    cp.cuda.runtime.memcpy(cx.data.ptr, xp, m * K * 2, cp.cuda.runtime.memcpyDeviceToDevice)
    cg = cp.ones(1, dtype=cp.float32)
    cy = cp.empty(m * N, dtype=cp.uint16)
    u64 = np.uint64
    mlx_args = [(u64(xp), u64(w), u64(s), u64(gp), u64(yp)) for w, s in wp]
    own_args = [(cx, cw, cs, cg, cy) for cw, cs in own_w]
    mixed_args = [(cx, u64(w), u64(s), cg, cy) for w, s in wp]
    # the same output from every way (and from MLX itself)
    want = np.array(gemv_nvfp4_cuda(x, *weights[0], None, STREAM_CONFIG).view(mx.uint16)).reshape(-1)
    fn((blocks,), (threads,), own_args[0], shared_mem=smem)
    fn((blocks,), (threads,), mlx_args[0], shared_mem=smem)
    cp.cuda.runtime.deviceSynchronize()
    out["own_equals_mlx"] = bool(np.array_equal(cy.get()[: want.size], want))
    # the host reads MLX's output buffer (its pages move to the host; the warm-up moves them back)
    out["mlx_buffers_equal_mlx"] = bool(np.array_equal(np.frombuffer(memoryview(y_mlx), dtype=np.uint16), want))
    ways = {"cupy-mlx-buffers": mlx_args, "cupy-own-buffers": own_args, "cupy-mlx-weights": mixed_args}
    for label, arg_sets in ways.items():
        out[label] = time_cupy(fn, grid, arg_sets)
        log(f"M={m} {label}: {out[label]['us']:.2f} us")
    for w, s in wp:
        out["advise_rc"] = drv.advise_gpu(w, N * K // 2) + "/" + drv.advise_gpu(s, N * K // 16)
    out["weight_range_attributes_advised"] = drv.range_attributes(wp[0][0], N * K // 2)
    out["cupy-mlx-buffers-advised"] = time_cupy(fn, grid, mlx_args)
    out["mlx-advised"] = time_mlx(x, weights)
    log(f"M={m} advised: cupy {out['cupy-mlx-buffers-advised']['us']:.2f}, mlx {out['mlx-advised']['us']:.2f} us")
    return out


if __name__ == "__main__":
    sys.exit(main())
