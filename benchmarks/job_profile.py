"""Where one job's process spends its time, function by function (issue 13's per-job overhead).

    python3 -m benchmarks.job_profile driver [--alloc-gib G]     # a fresh process's device start and exit
    python3 -m benchmarks.job_profile show JOB.prof JOB.parquet   # the job's phases, then its hottest functions

`device_lab.sh` (`PROFILE=1,512`) plans the built-in nvfp4-prefill sweep, runs its qmm jobs at those
token counts twice each under cProfile (`python -m workers run`, a fresh interpreter: the first run
on a fresh machine also pays the peak probes and the kernels' first compile, the second does not) and
writes `show`'s text beside each profile. `driver` times what every job's fresh process pays before
its first kernel: the CUDA driver's start, the context and MLX's first op.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import pstats
import subprocess
import sys
import time
from pathlib import Path

from workers.contract import META_PHASES


def driver_child(alloc_gib: float, hard_exit: bool) -> None:
    """One fresh process's steps to its first MLX result on the GPU, printed as JSON lines
    (`[name, seconds since start]`), then `alloc_gib` GiB kept live and its exit (the wall clock
    just before it, for the parent to time the teardown)."""
    t0 = time.perf_counter()

    def mark(name: str) -> None:
        print(json.dumps([name, time.perf_counter() - t0]), flush=True)

    try:
        cuda = ctypes.CDLL("libcuda.so.1")
        mark("dlopen libcuda")
        rc = cuda.cuInit(0)
        mark(f"cuInit (rc {rc})")
        dev = ctypes.c_int()
        cuda.cuDeviceGet(ctypes.byref(dev), 0)
        ctx = ctypes.c_void_p()
        rc = cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev)
        mark(f"primary context (rc {rc})")
    except OSError as exc:
        mark(f"no libcuda ({exc})")
    import mlx.core as mx  # MLX: its import is one of the steps timed here

    mark("import mlx.core")
    device = mx.default_device()
    mark(f"mx.default_device() = {device}")
    mx.eval(mx.ones((64, 64)) @ mx.ones((64, 64)))
    mark("first matmul")
    keep = [mx.random.normal((int(alloc_gib * 2**28),)) for _ in range(1)] if alloc_gib > 0 else []
    mx.eval(*keep)
    mark(f"first random, {alloc_gib:g} GiB live")
    print(json.dumps(["exit at", time.time()]), flush=True)
    if hard_exit:
        os._exit(0)
    sys.exit(0)


def driver(alloc_gib: float) -> None:
    """Run `driver_child` in fresh processes (a normal exit, then `os._exit`, as forked jobs end)
    and print each step's seconds, with the exit's teardown as this parent sees it."""
    for hard in (False, True):
        argv = [sys.executable, "-m", "benchmarks.job_profile", "driver-child", "--alloc-gib", str(alloc_gib)]
        proc = subprocess.Popen([*argv, *(["--hard-exit"] if hard else [])], stdout=subprocess.PIPE, text=True)
        assert proc.stdout is not None
        lines = [json.loads(line) for line in proc.stdout if line.startswith("[")]
        proc.wait()
        ended = time.time()
        print(f"-- a fresh process, {'os._exit' if hard else 'normal exit'}:")
        prev = 0.0
        for name, at in lines[:-1]:
            print(f"{at - prev:8.3f} s  {name}")
            prev = at
        if lines and lines[-1][0] == "exit at":
            print(f"{ended - lines[-1][1]:8.3f} s  exit, as the parent sees it")


def show(prof: Path, parquet: Path | None, top: int) -> None:
    """Print the job's phases (its fragment's footer) and the top functions by cumulative and own time."""
    if parquet is not None and parquet.exists():
        import pyarrow.parquet as pq  # Parquet's reader: only when a fragment is shown

        meta = pq.read_schema(parquet).metadata or {}
        spent = json.loads(meta.get(META_PHASES, b"{}"))
        print("phases (s):", ", ".join(f"{k} {v:.3f}" for k, v in sorted(spent.items(), key=lambda kv: -kv[1])))
    stats = pstats.Stats(str(prof), stream=sys.stdout)
    stats.sort_stats("cumulative").print_stats(top)
    stats.sort_stats("tottime").print_stats(top)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="benchmarks.job_profile", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    d = sub.add_parser("driver", help="a fresh process's device start and exit, step by step")
    d.add_argument("--alloc-gib", type=float, default=4.0, help="GiB live at the exit")
    c = sub.add_parser("driver-child")
    c.add_argument("--alloc-gib", type=float, default=4.0)
    c.add_argument("--hard-exit", action="store_true")
    p = sub.add_parser("show", help="a job's phases and its hottest functions")
    p.add_argument("prof", type=Path)
    p.add_argument("parquet", type=Path, nargs="?")
    p.add_argument("--top", type=int, default=45)
    args = parser.parse_args(argv)
    if args.command == "driver":
        driver(args.alloc_gib)
    elif args.command == "driver-child":
        driver_child(args.alloc_gib, args.hard_exit)
    else:
        show(args.prof, args.parquet, args.top)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
