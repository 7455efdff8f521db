"""The measurement loop for kernel cases.

Method (see DESIGN.md, "Measurement method"):

* correctness first: every arm's output on fresh random inputs is compared with the case's NumPy
  reference; the relative error is a recorded metric, and an arm over its tolerance is failed,
  however fast it is (its timing rows carry status `failed`, so no comparison ever uses them);
* warm-up calls, then `repetitions` samples per arm, the arms interleaved in ABBA order (A B, B A,
  A B, ...) so that drift and thermal state hit every arm alike;
* a pool of input sets generated afresh per job and rotated per sample, so no sample reuses the
  previous sample's inputs from cache;
* the device synchronised before and after the timed region;
* several calls per sample when one call is too short to time (calibrated during warm-up, the
  count recorded), and one row per sample: `seconds`, and the derived tok/s, GB/s and TFLOP/s.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from kernels.checking import describe as describe_reference
from kernels.checking import relative_error
from kernels.registry import ArmPath, Workload
from workers import phases
from workers.contract import STATUS_FAILED, STATUS_OK, STATUS_UNSUPPORTED, JobSpec, RowBuilder

INPUT_POOL = 3  # input sets rotated across samples
MIN_SAMPLE_SECONDS = 2e-3  # a sample shorter than this times several calls together
MAX_CALLS_PER_SAMPLE = 64


def abba_order(arms: Sequence[str], rep: int) -> list[str]:
    """The arms in the order of repetition `rep`: forward on even, reversed on odd."""
    return list(arms) if rep % 2 == 0 else list(reversed(arms))


def _to_numpy(out: Any) -> np.ndarray:
    import mlx.core as mx

    if isinstance(out, mx.array):
        return np.array(out.astype(mx.float32))
    return np.asarray(out)


def _timed(run: Callable[..., Any], inputs: tuple[Any, ...], calls: int) -> float:
    """Seconds per call: `calls` calls evaluated together, the device synchronised around them."""
    import mlx.core as mx

    mx.synchronize()
    t0 = time.perf_counter()
    outs = [run(*inputs) for _ in range(calls)]
    mx.eval(outs)
    mx.synchronize()
    return (time.perf_counter() - t0) / calls


def measure_workload(job: JobSpec, workload: Workload, rows: RowBuilder, rng: np.random.Generator) -> str:
    """Check and time every arm of `workload`, adding rows; returns the job status."""
    status = STATUS_OK
    for arm in job.arms:
        if arm in workload.unsupported:
            rows.add(arm, "unsupported", None, "", status=STATUS_UNSUPPORTED, error=workload.unsupported[arm])
    arms = [a for a in job.arms if a in workload.arms]
    with phases.span("build"):
        pool = [workload.make_inputs(rng) for _ in range(INPUT_POOL)]
    failed: dict[str, str] = {}
    with phases.span("reference"):
        for arm in arms:
            path = workload.arms[arm]
            err = _check_arm(arm, path, workload, pool[0], rows)
            if err:
                failed[arm] = err
                status = STATUS_FAILED
    timed = [a for a in arms if a not in failed or failed[a].startswith("rel_error")]
    calls = {a: 1 for a in timed}
    broken: set[str] = set()
    t_warm = time.perf_counter()
    for w in range(job.warmup + 1):  # at least one warm-up call, used to calibrate calls/sample
        for arm in abba_order(timed, w):
            if arm in broken:
                continue
            try:
                t = _timed(workload.arms[arm].run, pool[w % INPUT_POOL], 1)
            except Exception as exc:  # a path that raises fails, the others go on
                broken.add(arm)
                failed[arm] = f"{type(exc).__name__}: {exc}"
                rows.add(arm, "seconds", None, "seconds", status=STATUS_FAILED, error=failed[arm])
                status = STATUS_FAILED
                continue
            calls[arm] = max(1, min(MAX_CALLS_PER_SAMPLE, math.ceil(MIN_SAMPLE_SECONDS / max(t, 1e-9))))
    phases.current().add("warmup", time.perf_counter() - t_warm)
    timed = [a for a in timed if a not in broken]
    with phases.span("timed"):
        for rep in range(job.repetitions):
            for arm in abba_order(timed, rep):
                path = workload.arms[arm]
                seconds = _timed(path.run, pool[rep % INPUT_POOL], calls[arm])
                _sample_rows(rows, arm, rep, seconds, workload, path, failed.get(arm), calls[arm])
    return status


def _check_arm(arm: str, path: ArmPath, workload: Workload, inputs: tuple[Any, ...], rows: RowBuilder) -> str | None:
    """Run one arm once against the reference; record rel_error and peak memory; error or None."""
    import mlx.core as mx

    try:
        mx.synchronize()
        mx.reset_peak_memory()
        out = path.run(*inputs)
        mx.eval(out)
        mx.synchronize()
        peak = mx.get_peak_memory()
        got = _to_numpy(out)
    except Exception as exc:
        msg = f"{type(exc).__name__}: {exc}"
        rows.add(arm, "rel_error", None, "ratio", status=STATUS_FAILED, error=msg, route=path.route)
        return msg
    ref = workload.reference(arm, *inputs)
    rel = relative_error(got, ref)
    ok = rel <= path.tolerance
    err = None if ok else f"rel_error {rel:.3g} over tolerance {path.tolerance:.3g}"
    st = STATUS_OK if ok else STATUS_FAILED
    rows.add(
        arm,
        "rel_error",
        rel if math.isfinite(rel) else None,
        "ratio",
        status=st,
        error=err,
        route=path.route,
        extra={"tolerance": repr(path.tolerance), "reference_subset": describe_reference(ref)},
    )
    rows.add(arm, "peak_memory_bytes", float(peak), "bytes", status=st, error=err, route=path.route)
    rows.add(arm, "build_seconds", path.build_seconds, "seconds", status=st, error=err, route=path.route)
    return err


def _sample_rows(
    rows: RowBuilder,
    arm: str,
    rep: int,
    seconds: float,
    workload: Workload,
    path: ArmPath,
    error: str | None,
    calls: int,
) -> None:
    st = STATUS_FAILED if error else STATUS_OK
    common: dict[str, Any] = {
        "sample": rep,
        "status": st,
        "error": error,
        "route": path.route,
        "flops": workload.flops,
        "bytes_moved": workload.bytes_moved,
        "extra": {"calls_per_sample": str(calls)},
    }
    rows.add(arm, "seconds", seconds, "seconds", **common)
    if workload.tokens > 0:
        metric = "decode_tok_s" if workload.tokens == 1 else "prefill_tok_s"
        rows.add(arm, metric, workload.tokens / seconds, "tok/s", **common)
    if workload.bytes_moved > 0:
        rows.add(arm, "gb_per_s", workload.bytes_moved / seconds / 1e9, "GB/s", **common)
    if workload.flops > 0:
        rows.add(arm, "tflop_per_s", workload.flops / seconds / 1e12, "TFLOP/s", **common)
