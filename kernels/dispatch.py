"""The `auto` arm: per shape, the fastest correct path, chosen from measurements on this host.

`auto_path` takes the candidate paths a case built (qmm: native, dequant-gemm, custom; moe-gather:
native-sorted, custom-sorted), checks each once against the case's float64 reference on fresh
inputs (a path over its own tolerance, or one that raises, is never chosen), times the correct
ones (`calls` calls per evaluation, the median of `repeats`, the device synchronised around), and
returns an `ArmPath` that runs the fastest. Its `route` names the choice and the measured times,
e.g. `auto:custom[cuda_kernel(gemv_nvfp4_stream)] custom=2.1e-05s native=6.5e-05s`, so every row of
the arm says what it really ran. Choices are cached per key (case, shape, dtype, backend) for the
life of the process; the calibration time is part of the arm's build time.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kernels.checking import Reference as ReferenceValue
from kernels.checking import relative_error
from kernels.registry import ArmPath

Reference = Callable[..., ReferenceValue]


@dataclass(frozen=True)
class RouteChoice:
    """The outcome of one calibration.

    Attributes:
        chosen: the candidate picked (the fastest correct one).
        seconds: candidate -> measured seconds per call (correct candidates only).
        rejected: candidate -> why it was not eligible (over tolerance, or the exception).
    """

    chosen: str
    seconds: dict[str, float]
    rejected: dict[str, str] = field(default_factory=dict)

    def describe(self, route: str) -> str:
        """The `route` string of the auto arm: the choice, what it runs, and the evidence."""
        times = " ".join(f"{name}={s:.3g}s" for name, s in sorted(self.seconds.items(), key=lambda kv: kv[1]))
        rejected = "".join(f" {name}:rejected" for name in sorted(self.rejected))
        return f"auto:{self.chosen}[{route}] {times}{rejected}"


_CHOICES: dict[Hashable, RouteChoice] = {}


def _seconds_per_call(run: Callable[..., Any], inputs: tuple[Any, ...], calls: int, repeats: int) -> float:
    import mlx.core as mx

    mx.eval(run(*inputs))  # warm-up: compiles, allocates
    samples = []
    for _ in range(repeats):
        mx.synchronize()
        t0 = time.perf_counter()
        mx.eval([run(*inputs) for _ in range(calls)])
        mx.synchronize()
        samples.append((time.perf_counter() - t0) / calls)
    return statistics.median(samples)


def _as_numpy(out: Any) -> np.ndarray:
    import mlx.core as mx

    return np.array(out.astype(mx.float32)).astype(np.float64)


def calibrate(
    candidates: dict[str, ArmPath],
    inputs: tuple[Any, ...],
    reference: Reference,
    *,
    calls: int = 8,
    repeats: int = 3,
) -> RouteChoice:
    """Check and time every candidate on `inputs`; the fastest correct one wins.

    Args:
        candidates: name -> path (each with its own tolerance).
        inputs: one input set of the case (fresh random data).
        reference: `reference(name, *inputs)` -> the float64 output that candidate must give.
        calls: calls per timed evaluation.
        repeats: timed evaluations per candidate (the median counts).

    Raises:
        ValueError: when no candidate is correct.
    """
    seconds: dict[str, float] = {}
    rejected: dict[str, str] = {}
    for name, path in candidates.items():
        try:
            err = relative_error(_as_numpy(path.run(*inputs)), reference(name, *inputs))
            if not err <= path.tolerance:
                rejected[name] = f"rel_error {err:.3g} over tolerance {path.tolerance:.3g}"
                continue
            seconds[name] = _seconds_per_call(path.run, inputs, calls, repeats)
        except Exception as exc:  # a path that cannot run here is simply not a candidate
            rejected[name] = f"{type(exc).__name__}: {exc}"
    if not seconds:
        raise ValueError(f"auto: no correct candidate ({'; '.join(f'{k}: {v}' for k, v in rejected.items())})")
    return RouteChoice(min(seconds, key=lambda n: seconds[n]), seconds, rejected)


def auto_path(
    key: Hashable,
    candidates: dict[str, ArmPath],
    make_inputs: Callable[[np.random.Generator], tuple[Any, ...]],
    reference: Reference,
    rng: np.random.Generator,
) -> ArmPath:
    """The `auto` arm for one shape: calibrate once per `key`, then run the chosen path.

    Args:
        key: what identifies the shape and setting (case, parameters, dtype, backend).
        candidates: name -> path, as the case built them.
        make_inputs: the case's input generator (calibration draws its own input set).
        reference: `reference(name, *inputs)` -> float64 output.
        rng: generator for the calibration inputs.
    """
    t0 = time.perf_counter()
    choice = _CHOICES.get(key)
    if choice is None:
        choice = calibrate(candidates, make_inputs(rng), reference)
        _CHOICES[key] = choice
    chosen = candidates[choice.chosen]
    build = sum(p.build_seconds for p in candidates.values()) + time.perf_counter() - t0
    return ArmPath(
        run=chosen.run,
        tolerance=chosen.tolerance,
        route=choice.describe(chosen.route),
        build_seconds=build,
    )


def forget_choices() -> None:
    """Drop every cached choice (a new calibration per key follows)."""
    _CHOICES.clear()


# ----------------------------------------------------------------- the arms of the cases


def qmm_custom_path(
    wq: Any, scales: Any, m: int, n: int, k: int, dtype_name: str, kernel: str | None = None
) -> ArmPath:
    """The qmm case's `custom` arm on packed NVFP4 weights [n, k/8] and E4M3 scales [n, k/16]
    (`custom-ksplit`: `kernel="ksplit"`).

    `kernels.nvfp4_linear.nvfp4_matmul`: M <= 8, the decode GEMV kernel (the stream kernel where
    it applies, else K-split; K-split for `custom-ksplit`); larger M, the prefill GEMM
    (`kernels.gemm_nvfp4`, bfloat16 and float16 on sm_89+), or where it cannot run on CUDA
    (float32), the expert-batched MoE kernel with one expert. Without MLX's CUDA backend: the
    twins. The first call (NVRTC compile) is timed as the build.
    """
    import mlx.core as mx

    from kernels import gemv_nvfp4
    from kernels.nvfp4_linear import matmul_route, nvfp4_matmul

    def run(x: Any) -> Any:
        return nvfp4_matmul(x, wq, scales, kernel=kernel)

    route = matmul_route(m, n, k, dtype_name, kernel)
    dtype = getattr(mx, dtype_name)
    t0 = time.perf_counter()
    mx.eval(run(mx.zeros((m, k), dtype=dtype)))
    build = time.perf_counter() - t0
    return ArmPath(run=run, tolerance=gemv_nvfp4.TOLERANCE[dtype_name], route=route, build_seconds=build)


def qmm_auto_path(
    wq: Any,
    scales: Any,
    params: tuple[int, int, int, str, str],
    make_inputs: Callable[[np.random.Generator], tuple[Any, ...]],
    reference: Reference,
) -> ArmPath:
    """The qmm case's `auto` arm: the fastest correct of native, dequant-gemm, custom and (where
    it is a different kernel) custom-ksplit.

    Args:
        wq, scales: the packed NVFP4 weights and E4M3 scales the case built.
        params: (m, n, k, dtype name, backend).
        make_inputs: the case's input generator.
        reference: the float64 reference of the weights every candidate holds (`reference(x)`).
    """
    import mlx.core as mx

    from kernels import gemv_nvfp4
    from kernels.qmm import tolerance

    m, n, k, dtype_name, backend = params
    candidates = {
        "native": ArmPath(
            run=lambda x: mx.quantized_matmul(x, wq, scales, transpose=True, mode="nvfp4"),
            tolerance=tolerance("native", dtype_name, k, backend),
            route="mx.quantized_matmul(nvfp4)",
        ),
        "dequant-gemm": ArmPath(
            run=lambda x: x @ mx.dequantize(wq, scales, mode="nvfp4", dtype=x.dtype).T,
            tolerance=tolerance("dequant-gemm", dtype_name, k, backend),
            route="mx.dequantize(nvfp4)+matmul",
        ),
        "custom": qmm_custom_path(wq, scales, m, n, k, dtype_name),
    }
    # where the K-split GEMV is a second kernel here (not the same path again), it competes too
    if m <= gemv_nvfp4.MAX_ROWS and gemv_nvfp4.route(m, n, k, dtype_name, "ksplit") != candidates["custom"].route:
        candidates["custom-ksplit"] = qmm_custom_path(wq, scales, m, n, k, dtype_name, "ksplit")
    return auto_path(
        ("qmm", m, n, k, dtype_name, backend),
        candidates,
        make_inputs,
        lambda name, *inputs: reference(*inputs),
        np.random.default_rng(0xA070),
    )


def moe_custom_path(wq: Any, scales: Any, global_scales: Any, dtype_name: str, shape: tuple[int, int, int]) -> ArmPath:
    """The moe-gather case's `custom-sorted` arm: the sorted route of `kernels.moe.run_sorted`
    (pairs sorted by expert, rows scattered back, all inside the call) with the expert-batched
    kernel (MLX twin without CUDA) in place of `gather_qmm`.

    Args:
        wq, scales, global_scales: the experts' packed codes, E4M3 scales and global scales.
        dtype_name: the activations' dtype.
        shape: (tokens, top_k, hidden); the first call at this shape (NVRTC compile) is the build.
    """
    import mlx.core as mx

    from kernels import gemv_nvfp4, moe_nvfp4

    def run(x: Any, indices: Any) -> Any:
        t, top_k = indices.shape
        flat = indices.flatten()
        order = mx.argsort(flat)
        inverse = mx.argsort(order)
        lhs = (order // top_k).astype(mx.uint32)
        y = moe_nvfp4.moe_gather_nvfp4(x, wq, scales, global_scales, lhs, flat[order])
        return y[inverse].reshape(t, top_k, -1)

    tokens, top_k, hidden = shape
    t0 = time.perf_counter()
    mx.eval(run(mx.zeros((tokens, hidden), dtype=getattr(mx, dtype_name)), mx.zeros((tokens, top_k), dtype=mx.uint32)))
    return ArmPath(
        run=run,
        tolerance=gemv_nvfp4.TOLERANCE[dtype_name],
        route=moe_nvfp4.route(wq.shape[1], hidden) + ",sorted",
        build_seconds=time.perf_counter() - t0,
    )


def moe_auto_path(
    native_sorted: ArmPath,
    custom_sorted: ArmPath,
    key: Hashable,
    make_inputs: Callable[[np.random.Generator], tuple[Any, ...]],
    reference: Reference,
) -> ArmPath:
    """The moe-gather case's `auto-sorted` arm: the faster correct of native-sorted (gather_qmm)
    and custom-sorted; `reference(x, indices)` is the float64 output both must give."""
    return auto_path(
        ("moe-gather", key),
        {"native-sorted": native_sorted, "custom-sorted": custom_sorted},
        make_inputs,
        lambda name, *inputs: reference(*inputs),
        np.random.default_rng(0xA070),
    )
