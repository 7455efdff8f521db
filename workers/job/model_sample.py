"""One sample of the `model` case, in a process of its own: load, warm up, prefill, decode, check.

`workers.job.model` asks for each sample with `python -m workers.job.model_sample sample REQUEST`
(forked from the job's fork server, or a fresh interpreter) and reads the `Sample` back from the
line marked `RESULT_MARK`; `write` generates a checkpoint the same way. MLX is imported only in
that process, never by the module's import: the parent imports this module for its types.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kernels import mlx_lm_classes

PREFILL_STEP = 2048  # mlx-lm's prefill_step_size
RESULT_MARK = "ORCHESTRATE-MODEL-SAMPLE "


@dataclass(frozen=True)
class SampleRequest:
    """What the fresh process is asked to measure (sent to it as JSON)."""

    checkpoint: str
    arm: str
    prompt_tokens: int
    decode_tokens: int
    warmup: int
    seed: int
    check: bool  # also check the loaded layers against the NVFP4 reference (once per arm)


@dataclass
class Sample:
    """What one fresh process measured for one arm."""

    load_seconds: float
    prefill_tok_s: float
    decode_tok_s: float
    peak_memory_bytes: float
    greedy_digest: str
    route: str
    device: str
    rel_error: float | None = None  # the worst checked layer against the reference
    tolerance: float | None = None
    checked: str = ""  # which layer was worst, of how many
    started_at: float = 0.0  # wall-clock time the process began measuring (after its start-up)
    imports_seconds: float = 0.0  # MLX, mlx-lm's model classes and ours, before the load
    warmup_seconds: float = 0.0
    timed_seconds: float = 0.0  # the timed prefill and decode
    check_seconds: float = 0.0  # the layer check against the reference
    process: str = ""  # how the sample's process was started (set by the parent)


def greedy_digest(token_ids: list[int]) -> str:
    """A short, stable digest of a greedy token sequence."""
    return hashlib.sha256(",".join(map(str, token_ids)).encode()).hexdigest()[:16]


def measure_sample(req: SampleRequest) -> Sample:
    """Load, warm up, prefill and decode once in this process (meant to be a fresh one).

    With `req.check`, after everything is measured (peak memory included), the loaded layers are
    checked against the NVFP4 reference (`kernels.model.check_layers`).
    """
    started_at, t_imports = time.time(), time.perf_counter()
    # MLX and our decoders are imported here, in the sample's own process, and timed as its imports
    import mlx.core as mx

    from kernels.model import check_layers, load_decoder

    make_prompt_cache = mlx_lm_classes.import_models("cache").make_prompt_cache

    imports_seconds = time.perf_counter() - t_imports
    prompt_tokens, decode_tokens = req.prompt_tokens, req.decode_tokens
    mx.reset_peak_memory()
    t0 = time.perf_counter()
    loaded = load_decoder(Path(req.checkpoint), req.arm)
    mx.synchronize()
    load_seconds = time.perf_counter() - t0
    model = loaded.model
    prompt = mx.array(np.random.default_rng(req.seed).integers(0, loaded.vocab, prompt_tokens), dtype=mx.int32)

    def prefill(cache: list[Any]) -> mx.array:
        for start in range(0, prompt_tokens, PREFILL_STEP):
            logits = model(prompt[None, start : start + PREFILL_STEP], cache=cache)
            if start + PREFILL_STEP < prompt_tokens:
                mx.eval([c.state for c in cache])
        token = mx.argmax(logits[0, -1])
        mx.eval(token)
        return token

    def decode(token: mx.array, cache: list[Any], steps: int) -> list[int]:
        tokens = [token]
        for _ in range(steps):
            token = mx.argmax(model(token.reshape(1, 1), cache=cache)[0, -1])
            mx.eval(token)  # one token at a time, as a chat user waits for it
            tokens.append(token)
        return np.array(mx.stack(tokens)).astype(np.int64).tolist()

    t_warm = time.perf_counter()
    for _ in range(req.warmup):
        cache = make_prompt_cache(model)
        decode(prefill(cache), cache, min(decode_tokens, 4))
    warmup_seconds = time.perf_counter() - t_warm
    cache = make_prompt_cache(model)
    mx.synchronize()
    t0 = time.perf_counter()
    first = prefill(cache)
    mx.synchronize()
    prefill_seconds = time.perf_counter() - t0
    t0 = time.perf_counter()
    ids = decode(first, cache, decode_tokens)
    mx.synchronize()
    decode_seconds = time.perf_counter() - t0
    sample = Sample(
        load_seconds=load_seconds,
        prefill_tok_s=prompt_tokens / prefill_seconds,
        decode_tok_s=decode_tokens / decode_seconds if decode_tokens else 0.0,
        peak_memory_bytes=float(mx.get_peak_memory()),
        greedy_digest=greedy_digest(ids),
        route=loaded.route,
        device=str(mx.default_device()),
        started_at=started_at,
        imports_seconds=imports_seconds,
        warmup_seconds=warmup_seconds,
        timed_seconds=prefill_seconds + decode_seconds,
    )
    if req.check:
        t_check = time.perf_counter()
        check = check_layers(model, Path(req.checkpoint), req.arm, np.random.default_rng(req.seed))
        if check.layers:
            sample.rel_error, sample.tolerance = check.rel_error, check.tolerance
            sample.checked = f"{check.layer} (worst of {check.layers})"
        sample.check_seconds = time.perf_counter() - t_check
    return sample


def main(argv: list[str] | None = None) -> int:
    """`python -m workers.job.model_sample write|sample SPEC_JSON`."""
    parser = argparse.ArgumentParser(prog="python -m workers.job.model_sample")
    parser.add_argument("verb", choices=("write", "sample"))
    parser.add_argument("spec", help="the request, as JSON")
    args = parser.parse_args(argv)
    spec = json.loads(args.spec)
    if args.verb == "write":
        from kernels.checkpoint import DecoderConfig, write_checkpoint  # MLX: in this process only

        write_checkpoint(DecoderConfig(**spec["config"]), int(spec["seed"]), Path(spec["dest"]))
        return 0
    from kernels.model import ArmUnsupported  # MLX: in this process only

    try:
        sample = measure_sample(SampleRequest(**spec))
    except ArmUnsupported as exc:
        print(RESULT_MARK + json.dumps({"unsupported": str(exc)}), flush=True)
        return 0
    print(RESULT_MARK + json.dumps(asdict(sample)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
