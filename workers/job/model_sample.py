"""The `model` case's own processes: a cold load of one arm, the steady-state rounds, a checkpoint.

`workers.job.model` runs `python -m workers.job.model_sample VERB REQUEST` (forked from the job's
fork server, or a fresh interpreter) and reads the answer back from the line marked
`RESULT_MARK`:

* `load`: one cold load of one arm into a process with no MLX state (`LoadSample`): its seconds
  and their parts (`kernels.model.LOAD_PARTS`), then one untimed prefill of the prompt and a few
  decode steps, so that the process's peak memory is that of the arm loaded and running;
* `steady`: every arm loaded in this one process, checked, then prefill and decode rounds
  (`workers.job.steady`);
* `write`: generate a checkpoint.

MLX is imported only in that process, never by this module's import: the parent imports it for
its types.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from kernels import mlx_lm_classes
from workers.contract import JobSpec

RESULT_MARK = "ORCHESTRATE-MODEL-SAMPLE "
PEAK_DECODE_STEPS = 2  # decode steps after the load's prefill: the cache grows, as in use


@dataclass(frozen=True)
class LoadRequest:
    """One cold load (sent to the fresh process as JSON)."""

    checkpoint: str
    arm: str
    prompt_tokens: int
    seed: int
    run: bool = True  # run the loaded model once (a prefill and a few decode steps) for its peak memory


@dataclass
class LoadSample:
    """What one fresh process measured for one arm's cold load."""

    load_seconds: float
    parts: dict[str, float]  # seconds of each part of the load (`kernels.model.LOAD_PARTS`)
    peak_memory_bytes: float | None  # since the process began: loaded, one prefill and a few decode steps
    route: str
    device: str
    started_at: float = 0.0  # wall-clock time the process began measuring (after its start-up)
    imports_seconds: float = 0.0  # MLX, mlx-lm's model classes and ours, before the load
    run_seconds: float = 0.0  # the untimed prefill and decode steps after the load
    process: str = ""  # how the process was started (set by the parent)


def measure_load(req: LoadRequest) -> LoadSample:
    """Load `req.arm` cold in this process (meant to be a fresh one), then run it once untimed."""
    started_at, t_imports = time.time(), time.perf_counter()
    # MLX and our decoders are imported here, in the sample's own process, and timed as its imports
    import mlx.core as mx

    from kernels.model import load_decoder

    make_prompt_cache = mlx_lm_classes.import_models("cache").make_prompt_cache
    imports_seconds = time.perf_counter() - t_imports
    mx.reset_peak_memory()
    t0 = time.perf_counter()
    loaded = load_decoder(Path(req.checkpoint), req.arm)
    load_seconds = time.perf_counter() - t0  # load_decoder ends synchronised
    if req.run:
        ids = np.random.default_rng(req.seed).integers(0, loaded.vocab, req.prompt_tokens)
        cache = make_prompt_cache(loaded.model)
        token = mx.argmax(loaded.model(mx.array(ids, dtype=mx.int32)[None], cache=cache)[:, -1, :], axis=-1)
        for _ in range(PEAK_DECODE_STEPS):
            mx.eval(token)
            token = mx.argmax(loaded.model(token[None], cache=cache)[:, -1, :], axis=-1)
        mx.eval(token)
    return LoadSample(
        load_seconds=load_seconds,
        parts=loaded.parts,
        peak_memory_bytes=float(mx.get_peak_memory()) if req.run else None,
        route=loaded.route,
        device=str(mx.default_device()),
        started_at=started_at,
        imports_seconds=imports_seconds,
        run_seconds=time.perf_counter() - t0 - load_seconds,
    )


@dataclass(frozen=True)
class SteadyRequest:
    """The steady-state rounds of a job (sent as JSON; the job travels as its own JSON)."""

    job: str
    checkpoint: str
    arms: list[str]
    params: dict[str, Any] = field(default_factory=dict)


def _steady(req: SteadyRequest) -> dict[str, Any]:
    t_imports = time.perf_counter()
    from workers.job.steady import measure_steady  # MLX: in this process only

    imports = time.perf_counter() - t_imports
    job = JobSpec.model_validate_json(req.job)
    return asdict(measure_steady(job, Path(req.checkpoint), req.arms, req.params, imports))


def main(argv: list[str] | None = None) -> int:
    """`python -m workers.job.model_sample write|load|steady SPEC_JSON`."""
    parser = argparse.ArgumentParser(prog="python -m workers.job.model_sample")
    parser.add_argument("verb", choices=("write", "load", "steady"))
    parser.add_argument("spec", help="the request, as JSON")
    args = parser.parse_args(argv)
    spec = json.loads(args.spec)
    if args.verb == "write":
        from kernels.checkpoint import DecoderConfig, write_checkpoint  # MLX: in this process only

        write_checkpoint(DecoderConfig(**spec["config"]), int(spec["seed"]), Path(spec["dest"]))
        return 0
    if args.verb == "steady":
        print(RESULT_MARK + json.dumps(_steady(SteadyRequest(**spec))), flush=True)
        return 0
    from kernels.model import ArmUnsupported  # MLX: in this process only

    try:
        sample = measure_load(LoadRequest(**spec))
    except ArmUnsupported as exc:
        print(RESULT_MARK + json.dumps({"unsupported": str(exc)}), flush=True)
        return 0
    print(RESULT_MARK + json.dumps(asdict(sample)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
