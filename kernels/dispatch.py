"""The `auto` arm: per shape, the fastest correct path, chosen from measurements on this host.

A case builds its `auto` arm with `auto_path(key, candidates, make_inputs, reference)`: an
`ArmPath` whose `auto` names the candidates (qmm: native, dequant-gemm, custom and, where it is a
second kernel, custom-ksplit; moe-gather: native-sorted, custom-sorted). The job resolves it
before anything is timed (`workers.job.measure`), by the measurement's own method
(`kernels.timing`): each candidate is warmed up with the job's arms (its cold first call counts
there), checked once after it, against the case's float64 reference (a path over its own tolerance,
or one that raises, is never chosen), then the correct ones are timed with the job's one call
count, the job's cache state (weights rotated or not), the job's rotated input sets and the
candidates interleaved in ABBA order; the median of `AUTO_SAMPLES` samples per candidate decides.
(`calibrate`, outside a job, still checks first and warms up the correct candidates only.) (A
cheaper choice, a few calls on one input, candidates one after another and the Python graph
inside the clock, measures something other than the job times and can pick the slower kernel.)

The resolved arm's `route` names the choice and the evidence, e.g.
`auto:custom[cuda_kernel(gemv_nvfp4_stream)] custom=2.1e-05s native=6.5e-05s (5 samples x 64
calls, cold)`, so every row says what really ran. Used outside a job, the arm resolves itself on
its first call with the default method and caches the choice per key for the life of the process.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kernels import timing
from kernels.checking import Reference as ReferenceValue
from kernels.checking import relative_error
from kernels.registry import ArmPath, AutoSpec

Reference = Callable[..., ReferenceValue]
AUTO_SAMPLES = 5  # ABBA samples per candidate; their median decides
STANDALONE_INPUTS = 3  # input sets a calibration outside a job rotates over


@dataclass(frozen=True)
class RouteChoice:
    """The outcome of one calibration.

    Attributes:
        chosen: the candidate picked (the fastest correct one).
        seconds: candidate -> median seconds per call (correct candidates only).
        rejected: candidate -> why it was not eligible (over tolerance, or the exception).
        calls: calls per sample the candidates were timed with.
        samples: samples per candidate.
        cache: the cache state they were timed in (`kernels.timing`).
    """

    chosen: str
    seconds: dict[str, float]
    rejected: dict[str, str] = field(default_factory=dict)
    calls: int = 1
    samples: int = AUTO_SAMPLES
    cache: str = "cold"

    def describe(self, route: str) -> str:
        """The `route` string of the auto arm: the choice, what it runs, and the evidence."""
        times = " ".join(f"{name}={s:.3g}s" for name, s in sorted(self.seconds.items(), key=lambda kv: kv[1]))
        rejected = "".join(f" {name}:rejected" for name in sorted(self.rejected))
        how = f" ({self.samples} samples x {self.calls} calls, {self.cache})"
        return f"auto:{self.chosen}[{route}] {times}{rejected}{how}"


_CHOICES: dict[Hashable, RouteChoice] = {}


def check_candidates(spec: AutoSpec, inputs: tuple[Any, ...]) -> tuple[dict[str, ArmPath], dict[str, str]]:
    """The candidates that are correct on `inputs`, and why each other one is not.

    Returns:
        (name -> path of the correct ones, name -> why rejected).
    """
    correct: dict[str, ArmPath] = {}
    rejected: dict[str, str] = {}
    for name, path in spec.candidates.items():
        try:
            err = relative_error(path.run(*inputs), spec.reference(name, *inputs))
        except Exception as exc:  # a path that cannot run here is simply not a candidate
            rejected[name] = f"{type(exc).__name__}: {exc}"
            continue
        if not err <= path.tolerance:
            rejected[name] = f"rel_error {err:.3g} over tolerance {path.tolerance:.3g}"
        else:
            correct[name] = path
    return correct, rejected


def choose(
    timers: dict[str, timing.ArmTimer],
    pool: list[tuple[Any, ...]],
    calls: int,
    rejected: dict[str, str],
    *,
    samples: int = AUTO_SAMPLES,
) -> RouteChoice:
    """Time warmed-up candidates as the measurement does and pick the one with the lowest median.

    Args:
        timers: candidate -> its timer (warmed up, weight copies made).
        pool: the job's input sets (rotated per sample).
        calls: the job's calls per sample.
        rejected: candidates left out already, and why (carried into the choice).
        samples: ABBA samples per candidate.

    Raises:
        ValueError: when no candidate is left.
    """
    if not timers:
        raise ValueError(f"auto: no correct candidate ({'; '.join(f'{k}: {v}' for k, v in rejected.items())})")
    times: dict[str, list[float]] = {name: [] for name in timers}
    for _, name, sample in timing.interleaved(timers, pool, calls, samples):
        times[name].append(sample.seconds)
    seconds = {name: statistics.median(v) for name, v in times.items()}
    cache = next(iter(timers.values())).cache
    return RouteChoice(min(seconds, key=lambda n: seconds[n]), seconds, rejected, calls, samples, cache)


def calibrate(
    spec: AutoSpec,
    pool: list[tuple[Any, ...]],
    method: timing.Method | None = None,
    *,
    samples: int = AUTO_SAMPLES,
) -> RouteChoice:
    """Check, warm up and time every candidate on its own (outside a job): the fastest correct wins.

    The call count is chosen over the candidates alone; inside a job, `workers.job.measure` uses the
    job's count instead (the same rule over all of the job's arms).

    Raises:
        ValueError: when no candidate is correct.
    """
    method = (method or timing.Method()).resolved()
    correct, rejected = check_candidates(spec, pool[0])
    timers = {name: timing.ArmTimer(path, method) for name, path in correct.items()}
    estimates, errors = timing.warm_up(timers, pool, method)
    rejected = {**rejected, **errors}
    timers = {name: t for name, t in timers.items() if name not in errors}
    return choose(timers, pool, timing.common_calls(estimates, method), rejected, samples=samples)


def chosen_path(spec: AutoSpec, choice: RouteChoice, build_seconds: float) -> ArmPath:
    """The auto arm once chosen: the winner's run and weights, its route naming the choice."""
    chosen = spec.candidates[choice.chosen]
    return ArmPath(
        run=chosen.run,
        tolerance=chosen.tolerance,
        route=choice.describe(chosen.route),
        build_seconds=sum(p.build_seconds for p in spec.candidates.values()) + build_seconds,
        weights=chosen.weights,
        rebind=chosen.rebind,
    )


def auto_path(
    key: Hashable,
    candidates: dict[str, ArmPath],
    make_inputs: Callable[[np.random.Generator], tuple[Any, ...]],
    reference: Reference,
) -> ArmPath:
    """The `auto` arm for one shape, to be resolved by the job that times it (see the module docstring).

    Args:
        key: what identifies the shape and setting (case, parameters, dtype, backend).
        candidates: name -> path, as the case built them.
        make_inputs: the case's input generator (a standalone calibration draws its own input sets).
        reference: `reference(name, *inputs)` -> float64 output.
    """
    spec = AutoSpec(key, candidates, reference, make_inputs)
    resolved: list[ArmPath] = []

    def run(*inputs: Any) -> Any:  # outside a job: resolve once (the choice cached per key)
        if not resolved:
            resolved.append(resolve_standalone(spec))
        return resolved[0].run(*inputs)

    return ArmPath(
        run=run,
        tolerance=max(p.tolerance for p in candidates.values()),
        route="auto(unresolved)",
        auto=spec,
    )


def resolve_standalone(spec: AutoSpec, method: timing.Method | None = None) -> ArmPath:
    """An auto arm resolved outside a job: `calibrate` on its own input sets, cached per key."""
    t0 = time.perf_counter()
    choice = _CHOICES.get((spec.key, method))
    if choice is None:
        rng = np.random.default_rng(0xA070)
        pool = [spec.make_inputs(rng) for _ in range(STANDALONE_INPUTS)]
        choice = _CHOICES[(spec.key, method)] = calibrate(spec, pool, method)
    return chosen_path(spec, choice, time.perf_counter() - t0)


def forget_choices() -> None:
    """Drop every cached choice (a new calibration per key follows)."""
    _CHOICES.clear()
