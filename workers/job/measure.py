"""The measurement loop for kernel cases.

Method (see DESIGN.md, "Measurement method", and `kernels.timing` for the why of each step):

* every input set and every arm's weights are materialised first (MLX builds lazily; a lazy
  input would otherwise be computed inside the first timed sample);
* warm-up first, of every arm and every `auto` candidate: a time-based warm-up of all of them
  together (a cold first call, JIT load and allocations, is warm-up by definition, so it must not
  fall into the check);
* then correctness: every arm's output on fresh random inputs, one call after the warm-up, is compared with the
  case's NumPy reference; the relative error is a recorded metric, and an arm over its tolerance
  is failed, however fast it is (its timing rows carry status `failed`, so no comparison ever uses
  them); an arm that raised (in the warm-up, or its reference) fails and is not timed;
* peak memory per arm as if only that arm's arrays were alive: the call's own allocations
  (output and temporaries, above what was live before it) plus the weights the arm declares and
  its inputs. MLX counts every live array, so a raw reading would include every other arm's
  weights and the whole input pool, and would change when an arm is added to the job;
* `auto` arms are chosen here, among their CORRECT candidates only, by this same method
  (`kernels.dispatch`), with the warm-up's estimates; the chosen path is checked once more;
* ONE call count per sample for every arm of the job (from the warm-up's estimates of the arms
  that are timed); the timed arms run again, untimed, right before the rounds (`timing.settle`);
  then rounds of one sample per arm, the arms interleaved in ABBA order (A B, B A, ...) so drift
  and thermal state hit every arm alike, the input set rotating per round and, with
  `cache = "cold"` (the default), the weights rotating per call over copies larger than the
  last-level cache; `repetitions` rounds, or, with a precision target, at least that many and
  then until every arm's interval to the baseline is precise enough (`workers.job.sampling`);
* a sample times `mx.eval` of its calls' graphs, built before the clock starts; the Python graph
  cost per call is recorded as its own metric (`host_seconds`) at decode sizes.

One row per sample: `seconds`, and the derived tok/s, GB/s and TFLOP/s. Each row's `extra` says
how it was timed: `calls_per_sample`, `cache` (cold, warm, hot or unrotated: the state achieved),
`cache_requested`, `weight_copies`, `weight_bytes` and `llc_bytes`; and how its point's sampling
ended: `stop_reason`, `rounds`, `half_width` and `precision` (`workers.job.sampling`); on CUDA, the
device's state right after the sample's round: `sm_clock_mhz`, `temp_c`, `power_w`, `throttle` and
`throttled` (`workers.host.device_state`; nothing on CPU and Metal).
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any

import numpy as np

from kernels import dispatch, timing
from kernels.checking import describe as describe_reference
from kernels.checking import relative_error
from kernels.registry import ArmPath, AutoSpec, Workload
from kernels.timing import abba_order
from workers.contract import JobSpec, RowBuilder, Status
from workers.host import device_state
from workers.job import phases, sampling

INPUT_POOL = 3  # input sets rotated across samples
HOST_COST_TOKENS = 8  # decode sizes: record the Python graph cost per call (`host_seconds`)

__all__ = ["INPUT_POOL", "abba_order", "measure_workload", "method_for", "relative_error"]


def method_for(job: JobSpec) -> timing.Method:
    """The timing method of a job: its cache choice (`options.cache`) and warm-up passes."""
    cache = str(job.options.get("cache", "cold"))
    return timing.Method(cache=cache, warmup_passes=max(1, job.warmup), warmup_seconds=timing.WARMUP_SECONDS).resolved()


def _materialise(pool: list[tuple[Any, ...]], paths: dict[str, ArmPath]) -> None:
    import mlx.core as mx  # MLX: in the job's process only (the fork server preloads this module)

    arrays = [a for inputs in pool for a in inputs]
    for path in paths.values():
        arrays.extend(path.weights)
        if path.auto is not None:
            arrays.extend(w for c in path.auto.candidates.values() for w in c.weights)
    mx.eval(*arrays)


def measure_workload(job: JobSpec, workload: Workload, rows: RowBuilder, rng: np.random.Generator) -> Status:
    """Check and time every arm of `workload`, adding rows; returns the job status."""
    for arm in job.arms:
        if arm in workload.unsupported:
            rows.add(arm, "unsupported", None, "", status=Status.UNSUPPORTED, error=workload.unsupported[arm])
    arms = [a for a in job.arms if a in workload.arms]
    paths = {a: workload.arms[a] for a in arms}
    with phases.span("build"):
        pool = [workload.make_inputs(rng) for _ in range(INPUT_POOL)]
        _materialise(pool, paths)
    return _measure(job, workload, rows, arms, paths, pool)


def _measure(
    job: JobSpec,
    workload: Workload,
    rows: RowBuilder,
    arms: list[str],
    paths: dict[str, ArmPath],
    pool: list[tuple[Any, ...]],
) -> Status:
    method = method_for(job)
    specs = {a: spec for a in arms if (spec := paths[a].auto) is not None}
    with phases.span("warmup"):  # every arm and candidate, cold first calls included
        timers = {a: timing.ArmTimer(paths[a], method) for a in arms if a not in specs}
        for arm, spec in specs.items():
            timers.update({f"{arm}/{name}": timing.ArmTimer(path, method) for name, path in spec.candidates.items()})
        estimates, errors = timing.warm_up(timers, pool, method)
    failed: dict[str, str] = {}
    autos: dict[str, tuple[dict[str, ArmPath], dict[str, str]]] = {}  # arm -> (correct, why each other is not)
    with phases.span("reference"):
        for arm in arms:
            spec = specs.get(arm)
            if spec is not None:
                autos[arm] = _check_candidates(arm, spec, errors, pool[0])
                if not autos[arm][0]:
                    why = "; ".join(f"{k}: {v}" for k, v in autos[arm][1].items())
                    failed[arm] = f"auto: no correct candidate ({why})"
                    rows.add(arm, "rel_error", None, "ratio", status=Status.FAILED, error=failed[arm])
                continue
            if arm in errors:  # its first call raised: recorded as the check records a path that raises
                failed[arm] = msg = errors[arm]
                rows.add(arm, "rel_error", None, "ratio", status=Status.FAILED, error=msg, route=paths[arm].route)
                continue
            err = _check_arm(arm, paths[arm], workload, pool[0], rows)
            if err:
                failed[arm] = err
    timeable = {a for a in arms if a not in specs and _timeable(failed.get(a))}
    timeable |= {f"{arm}/{name}" for arm, (correct, _) in autos.items() if arm not in failed for name in correct}
    calls = timing.common_calls({name: s for name, s in estimates.items() if name in timeable}, method)
    chosen: list[str] = []
    with phases.span("warmup"):  # auto's choice among its correct candidates, by the job's method
        for arm, (correct, rejected) in autos.items():
            if arm in failed:
                continue
            t0 = time.perf_counter()
            candidates = {name: timers[f"{arm}/{name}"] for name in correct}
            choice = dispatch.choose(candidates, pool, calls, rejected)
            paths[arm] = dispatch.chosen_path(specs[arm], choice, time.perf_counter() - t0)
            timers[arm] = candidates[choice.chosen]
            chosen.append(arm)
    with phases.span("reference"):
        for arm in chosen:
            err = _check_arm(arm, paths[arm], workload, pool[0], rows)
            if err:
                failed[arm] = err
    status = Status.FAILED if any(a in failed for a in arms) else Status.OK
    timed = {a: timers[a] for a in arms if a in timers and (a not in failed or _timeable(failed[a]))}
    rounds = sampling.Rounds(job, list(timed))
    for arm in failed:
        rounds.exclude(arm)
    with phases.span("warmup"):  # right before the rounds: the checks above let the device idle
        timing.settle(timed, pool, calls, method.warmup_seconds)
    first_row = len(rows.rows)
    device = device_state.for_job(job)
    with phases.span("timed"):
        for rep in rounds:
            inputs = pool[rep % len(pool)]
            round_row = len(rows.rows)
            for arm in abba_order(list(timed), rep):
                sample = timed[arm].sample(inputs, calls)
                rounds.record(rep, arm, sample.seconds)
                extra = {"calls_per_sample": str(calls), "cache_requested": method.cache, **timed[arm].record()}
                _sample_rows(rows, arm, rep, sample, workload, paths[arm], failed.get(arm), extra)
            state = device.extra()  # once per round, right after it (`workers.host.device_state`)
            rows.annotate(round_row, dict.fromkeys(timed, state))
            if state.get("throttled") == "true":
                rounds.drop(rep)  # not clean (`orchestrator.analysis.groups`): no precision is owed to it
    rows.annotate(first_row, {arm: rounds.extras(arm) for arm in timed})
    return status


def _check_candidates(
    arm: str, spec: AutoSpec, errors: dict[str, str], inputs: tuple[Any, ...]
) -> tuple[dict[str, ArmPath], dict[str, str]]:
    """An auto arm's candidates checked after the warm-up: (the correct ones, why each other one is
    not); a candidate that raised in the warm-up is rejected with its exception."""
    raised = {name: errors[f"{arm}/{name}"] for name in spec.candidates if f"{arm}/{name}" in errors}
    runnable = {name: path for name, path in spec.candidates.items() if name not in raised}
    correct, rejected = dispatch.check_candidates(dataclasses.replace(spec, candidates=runnable), inputs)
    return correct, {name: raised.get(name) or rejected[name] for name in spec.candidates if name not in correct}


def _timeable(error: str | None) -> bool:
    """Arms that ran but were wrong are still timed (their rows are failed); arms that raised are not."""
    return error is None or error.startswith("rel_error")


def _check_arm(arm: str, path: ArmPath, workload: Workload, inputs: tuple[Any, ...], rows: RowBuilder) -> str | None:
    """Run one arm once against the reference; record rel_error and peak memory; error or None."""
    import mlx.core as mx  # MLX: as in _materialise

    try:
        mx.synchronize()
        live = mx.get_active_memory()  # every arm's weights, the input pool, ...
        mx.reset_peak_memory()
        out = path.run(*inputs)
        mx.eval(out)
        mx.synchronize()
        own = sum(int(w.nbytes) for w in path.weights) + sum(int(x.nbytes) for x in inputs)
        peak = own + max(0, mx.get_peak_memory() - live)
        ref = workload.reference(arm, *inputs)
    except Exception as exc:  # the path, or its reference, raised: this arm fails, the others go on
        msg = f"{type(exc).__name__}: {exc}"
        rows.add(arm, "rel_error", None, "ratio", status=Status.FAILED, error=msg, route=path.route)
        return msg
    rel = relative_error(out, ref)  # an MLX output is compared at the reference's subset on the device
    ok = rel <= path.tolerance
    err = None if ok else f"rel_error {rel:.3g} over tolerance {path.tolerance:.3g}"
    st = Status.OK if ok else Status.FAILED
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
    memory = {"peak_of": "this arm's weights and inputs + the call's own allocations"}
    rows.add(arm, "peak_memory_bytes", float(peak), "bytes", status=st, error=err, route=path.route, extra=memory)
    rows.add(arm, "build_seconds", path.build_seconds, "seconds", status=st, error=err, route=path.route)
    return err


def _sample_rows(
    rows: RowBuilder,
    arm: str,
    rep: int,
    sample: timing.Sample,
    workload: Workload,
    path: ArmPath,
    error: str | None,
    extra: dict[str, str],
) -> None:
    st = Status.FAILED if error else Status.OK
    common: dict[str, Any] = {
        "sample": rep,
        "status": st,
        "error": error,
        "route": path.route,
        "flops": workload.flops,
        "bytes_moved": workload.bytes_moved,
        "extra": extra,
    }
    seconds = sample.seconds
    rows.add(arm, "seconds", seconds, "seconds", **common)
    if 0 < workload.tokens <= HOST_COST_TOKENS:
        rows.add(arm, "host_seconds", sample.host_seconds, "seconds", **common)
    if workload.tokens > 0:
        metric = "decode_tok_s" if workload.tokens == 1 else "prefill_tok_s"
        rows.add(arm, metric, workload.tokens / seconds, "tok/s", **common)
    if workload.bytes_moved > 0:
        rows.add(arm, "gb_per_s", workload.bytes_moved / seconds / 1e9, "GB/s", **common)
    if workload.flops > 0:
        rows.add(arm, "tflop_per_s", workload.flops / seconds / 1e12, "TFLOP/s", **common)
