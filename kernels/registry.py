"""The explicit registry of benchmark cases.

Each case declares, without importing MLX, its arms, the parameters it takes and the rule its
parameter points must follow (`kernels.shapes`: e.g. `k` a multiple of the NVFP4 group size),
with the fewest bytes a point's arrays hold on the device, so that the head can validate a sweep
file, point by point and against the memory of the devices it runs on, before anything starts.
`load_case(name)` imports the implementing module of a kernel case, which must expose
`build(params, arms, rng) -> Workload`; a case of another `CaseKind` is run by that kind's runner
(`workers.job.runner.RUNNERS`).
"""

from __future__ import annotations

import difflib
import importlib
from collections.abc import Callable, Hashable, Iterable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from types import ModuleType
from typing import TYPE_CHECKING, Any

from kernels import shapes

if TYPE_CHECKING:
    from kernels.checking import Reference

ParamType = type[int] | type[float] | type[str] | type[bool]
PointCheck = Callable[[Mapping[str, Any]], None]
PointBytes = Callable[[Mapping[str, Any], Iterable[str]], int]


class CaseKind(StrEnum):
    """How a case is run (`workers.job.runner.RUNNERS` has one runner per kind)."""

    KERNEL = "kernel"  # `build(params, arms, rng) -> Workload`, timed by `workers.job.measure`
    COMMAND = "command"  # an external benchmark built at a commit (`workers.command.job`)
    MODEL = "model"  # a whole model's prefill and decode (`workers.job.model`)


@dataclass(frozen=True)
class CaseSpec:
    """What a case is called, which arms it has and which parameters it takes."""

    name: str
    module: str
    kind: CaseKind
    arms: tuple[str, ...]  # empty: the sweep names its arms freely (command cases)
    params: dict[str, ParamType]
    required: tuple[str, ...]
    description: str = ""
    defaults: dict[str, Any] = field(default_factory=dict)
    check: PointCheck | None = None  # raises ValueError for a point the case cannot run
    device_bytes: PointBytes | None = None  # the fewest bytes a point's arrays hold on the device


CASES: dict[str, CaseSpec] = {}


def register(spec: CaseSpec) -> CaseSpec:
    """Add a case to the registry (a name registered twice is a bug)."""
    if spec.name in CASES:
        raise ValueError(f"case {spec.name!r} registered twice")
    CASES[spec.name] = spec
    return spec


register(
    CaseSpec(
        name="qmm",
        module="kernels.qmm",
        kind=CaseKind.KERNEL,
        arms=("native", "affine", "dequant-gemm", "dense", "custom", "custom-ksplit", "auto"),
        params={"tokens": int, "n": int, "k": int, "dtype": str},
        required=("tokens", "n", "k"),
        defaults={"dtype": "float32"},
        description="y = x @ W^T with W in NVFP4: decode GEMV (tokens=1) and prefill GEMM",
        check=shapes.qmm_check,
        device_bytes=shapes.qmm_bytes,
    )
)
register(
    CaseSpec(
        name="moe-gather",
        module="kernels.moe",
        kind=CaseKind.KERNEL,
        arms=(
            "native-sorted",
            "native-unsorted",
            "affine-sorted",
            "affine-unsorted",
            "custom-sorted",
            "auto-sorted",
        ),
        params={
            "experts": int,
            "top_k": int,
            "tokens": int,
            "hidden": int,
            "expert_width": int,
            "dtype": str,
            "global_scale": bool,
        },
        required=("experts", "top_k", "tokens", "hidden", "expert_width"),
        defaults={"dtype": "float32", "global_scale": True},
        description="MoE prefill through mx.gather_qmm, sorted and unsorted, per-expert global scale",
        check=shapes.moe_check,
        device_bytes=shapes.moe_bytes,
    )
)
register(
    CaseSpec(
        name="command",
        module="workers.command.job",
        kind=CaseKind.COMMAND,
        arms=(),
        params={},
        required=(),
        description="an external benchmark built at a git commit and run per arm (repo/ref/build/run/parse)",
    )
)
register(
    CaseSpec(
        name="model",
        module="workers.job.model",
        kind=CaseKind.MODEL,
        arms=("native", "affine", "custom"),
        params={
            "prompt_tokens": int,
            "decode_tokens": int,
            "architecture": str,
            "hidden": int,
            "intermediate": int,
            "layers": int,
            "heads": int,
            "kv_heads": int,
            "head_dim": int,
            "vocab": int,
            "dtype": str,
            "checkpoint": str,
        },
        required=("prompt_tokens",),
        defaults={
            "decode_tokens": 128,  # a decode window (`workers.job.steady`)
            "architecture": "gemma",
            "hidden": 256,
            "intermediate": 1024,
            "layers": 2,
            "heads": 4,
            "kv_heads": 0,
            "head_dim": 0,
            "vocab": 1024,
            "dtype": "float32",
            "checkpoint": "",
        },
        description="whole decoder: cold load, prefill and decode tok/s, peak memory, greedy digest",
        check=shapes.model_check,
        device_bytes=shapes.model_bytes,
    )
)
register(
    CaseSpec(
        name="mlp",
        module="kernels.mlp",
        kind=CaseKind.KERNEL,
        arms=("fused", "op-at-a-time", "eager"),
        params={"tokens": int, "hidden": int, "intermediate": int, "dtype": str},
        required=("tokens", "hidden", "intermediate"),
        defaults={"dtype": "float32"},
        description="Gemma GeGLU MLP block in NVFP4 with tensor global scales: fused, op-at-a-time, eager",
        check=shapes.mlp_check,
        device_bytes=shapes.mlp_bytes,
    )
)


def get_case(name: str) -> CaseSpec | None:
    """The registered case of that name, or None."""
    return CASES.get(name)


def check_point(name: str, params: Mapping[str, Any]) -> dict[str, Any]:
    """Check one parameter point against its case's own rule; return it with the defaults filled in.

    Raises:
        ValueError: the point cannot run (the message names the parameter, its value and what
            the case allows).
    """
    spec = CASES[name]
    point = {**spec.defaults, **params}
    if spec.check is not None:
        spec.check(point)
    return point


def device_bytes(name: str, params: Mapping[str, Any], arms: Iterable[str]) -> int:
    """The fewest bytes one job of the case holds on its device at `params` with `arms` (0: unknown)."""
    spec = CASES[name]
    if spec.device_bytes is None:
        return 0
    return spec.device_bytes({**spec.defaults, **params}, arms)


def did_you_mean(value: str, choices: Iterable[str]) -> str:
    """` (did you mean 'x'?)` for the nearest of `choices` to a misspelt `value`, else ``."""
    close = difflib.get_close_matches(value, list(choices), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def load_case(name: str) -> ModuleType:
    """Import the module that implements a case."""
    return importlib.import_module(CASES[name].module)


@dataclass
class ArmPath:
    """One arm ready to time: `run(*inputs)` returns the output (lazy MLX array).

    `weights` are the arrays every call reads besides its inputs (the arm's own, counted in its
    peak memory), and `rebind(copies)` makes the same `run` over other copies of them, so the
    measurement can rotate weights past the last-level cache (`kernels.timing`). An arm that
    declares none is timed with its weights as they are (its rows say `cache=unrotated`).
    `auto` marks an arm that is chosen among candidates by measurement (`kernels.dispatch`).
    """

    run: Callable[..., Any]
    tolerance: float  # largest relative error against the NumPy reference this path may show
    route: str  # what the arm really runs, e.g. "mx.quantized_matmul(nvfp4)"
    build_seconds: float = 0.0
    weights: tuple[Any, ...] = ()
    rebind: Callable[[tuple[Any, ...]], Callable[..., Any]] | None = None
    auto: AutoSpec | None = None


def bound_path(
    make: Callable[[tuple[Any, ...]], Callable[..., Any]],
    weights: tuple[Any, ...],
    *,
    tolerance: float,
    route: str,
    build_seconds: float = 0.0,
) -> ArmPath:
    """An arm whose `run` is `make(weights)`: rotatable over weight copies, its weights declared."""
    return ArmPath(make(weights), tolerance, route, build_seconds, weights=weights, rebind=make)


@dataclass(frozen=True)
class AutoSpec:
    """What an `auto` arm chooses among: candidate paths, checked and timed by the job's method.

    Attributes:
        key: identifies the shape and setting (case, parameters, dtype, backend).
        candidates: name -> path, as the case built them.
        reference: `reference(name, *inputs)` -> the float64 output that candidate must give.
        make_inputs: the case's input generator (for a choice made outside a job).
    """

    key: Hashable
    candidates: dict[str, ArmPath]
    reference: Callable[..., Reference]
    make_inputs: Callable[[Any], tuple[Any, ...]]


@dataclass
class Workload:
    """One parameter point of a kernel case, built and ready to measure.

    Attributes:
        arms: the arm name -> its path, in the sweep's order.
        make_inputs: fresh random inputs (MLX arrays) from a NumPy generator.
        reference: called as `reference(arm, *inputs)`, the NumPy reference output (float64
            array) for those inputs, computed with the weights that arm really holds (its
            quantization is the arm's choice; the reference checks the arm's arithmetic).
        flops: floating-point operations of one call.
        bytes_moved: the fewest bytes one call must move (weights, scales, input, output once).
        tokens: tokens one call processes (for tok/s), 0 where that means nothing.
        unsupported: arm -> reason, for arms this backend cannot run (recorded, not timed).
    """

    arms: dict[str, ArmPath]
    make_inputs: Callable[[Any], tuple[Any, ...]]
    reference: Callable[..., Reference]  # (arm, *inputs) -> float64 array, or a checked subset of it
    flops: float
    bytes_moved: float
    tokens: int
    unsupported: dict[str, str] = field(default_factory=dict)
