"""Where a cold model sample's time goes: each part of each sample, the way `run_model_job` runs it.

    python -m benchmarks.model_sample [--prompt-tokens 512] [--arms native,affine,custom]
        [--samples 3] [--profile] [--sweep nvfp4-prefill]

Takes the `model` case of a built-in sweep (its decoder, decode tokens and warm-up), generates or
reuses its checkpoint in the host's model cache, starts the fork server a Ray worker would
start, and runs `--samples` samples per arm through `workers.job.model._sample` (the job's own
path: forked from the server where it can be, else a fresh interpreter). The first sample of each
arm does the layer check, as in a job. For every sample it prints the wall time from the request
to the result and its parts: process start (fork or interpreter, and the imports before the
load), the cold load, warm-up, the timed prefill and decode, the layer check, and the rest (exit,
result); "beyond load" is the wall time less the load and the timed part. `--profile` then runs
one more checked sample of each arm under cProfile and prints its 25 costliest calls.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from orchestrator.specs.sweep import load_sweep
from workers.contract import JobSpec
from workers.job import phases
from workers.job.model import _checkpoint, _sample, sample_phases
from workers.job.model_sample import Sample, SampleRequest
from workers.proc import fork, forkserver
from workers.proc import spawn as forkclient

# the job's phases of a sample (`workers.job.model.sample_phases`), as this table heads them
PARTS = {"sample_start": "start", "load": "load", "warmup": "warmup", "timed": "timed", "reference": "check",
         "sample_other": "rest"}  # fmt: skip


def _job(sweep: str, prompt_tokens: int) -> tuple[JobSpec, dict[str, Any]]:
    spec = load_sweep(sweep)
    case = next(c for c in spec.cases if c.case == "model")
    params = {k: (v[0] if isinstance(v, list) else v) for k, v in case.params.items()}
    params["prompt_tokens"] = prompt_tokens
    job = JobSpec(
        run_id="bench", sweep=sweep, job_key="bench", case="model", case_name=case.name or "model",
        params=params, arms=list(case.arms), device="auto", repetitions=1,
        warmup=case.warmup if case.warmup is not None else spec.warmup,
    )  # fmt: skip
    return job, params


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.model_sample")
    parser.add_argument("--sweep", default="nvfp4-prefill")
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--arms", default="")
    parser.add_argument("--samples", type=int, default=3)
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args(argv)
    job, params = _job(args.sweep, args.prompt_tokens)
    arms = [a for a in args.arms.split(",") if a] or job.arms
    server = None
    if fork.supported():
        try:
            server = forkclient.ForkServer.start(dict(os.environ))
            os.environ[forkserver.SOCKET_ENV], os.environ[forkserver.NOTE_ENV] = server.path, server.note
        except OSError as exc:
            print(f"no fork server ({exc}): fresh interpreters")
    try:
        phases.reset()  # `_sample` adds to this process's phases; the table below is per sample
        t0 = time.perf_counter()
        path = _checkpoint(job, params, 3600.0)
        if not isinstance(path, Path):
            print(f"checkpoint: {path.message}")
            return 1
        print(f"checkpoint {path} ready in {time.perf_counter() - t0:.1f} s; server: {server and server.note}")

        def request(arm: str, check: bool) -> SampleRequest:
            return SampleRequest(
                checkpoint=str(path), arm=arm, prompt_tokens=args.prompt_tokens,
                decode_tokens=int(params["decode_tokens"]), warmup=job.warmup, seed=0, check=check,
            )  # fmt: skip

        print(f"{'arm':8} {'sample':>6} {'wall':>7} " + " ".join(f"{p:>7}" for p in PARTS.values()) + "  beyond load")
        beyond: dict[str, list[float]] = {arm: [] for arm in arms}
        for rep in range(args.samples):
            for arm in arms:
                asked = time.time()
                got = _sample(job, request(arm, rep == 0), 3600.0)
                wall = time.time() - asked
                if not isinstance(got, Sample):
                    print(f"{arm:8} {rep:>6} failed: {got.message}")
                    continue
                parts = sample_phases(got, asked, wall)
                extra = wall - parts["load"] - parts["timed"]
                beyond[arm].append(extra)
                cells = " ".join(f"{parts[p]:7.2f}" for p in PARTS)
                print(f"{arm:8} {rep:>6} {wall:7.2f} {cells}  {extra:.2f} ({got.process})")
        for arm, values in beyond.items():
            if values:
                print(f"{arm}: beyond the load and the timed part, median {statistics.median(values):.2f} s")
        if args.profile:
            for arm in arms:
                req = request(arm, True)
                code = (
                    "import cProfile, json, pstats, sys\n"
                    "from workers.job.model_sample import SampleRequest, measure_sample\n"
                    f"req = SampleRequest(**json.loads({json.dumps(asdict(req))!r}))\n"
                    "cProfile.run('measure_sample(req)', '/tmp/model_sample.prof')\n"
                    "pstats.Stats('/tmp/model_sample.prof').sort_stats('cumulative').print_stats(25)\n"
                )
                print(f"== cProfile of one checked {arm} sample (fresh interpreter)")
                out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
                print("\n".join(out.stdout.splitlines()[:60]) or out.stderr[-2000:])
    finally:
        if server is not None:
            server.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
