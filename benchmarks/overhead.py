"""Orchestration overhead per job, and the smoke sweep's wall time, on this machine.

    .venv/bin/python -m benchmarks.overhead [--jobs 12] [--rounds 3]

Overhead per job = (wall time of a sweep of N jobs - the work they measured) / N, where "the work
they measured" is the sum of every timed sample (seconds x calls per sample). A second figure
subtracts the workers' whole in-process job time instead (footer `orchestrate.job_seconds`), which
leaves what the orchestrator itself adds: Ray start, scheduling, the worker's process (forked from
the warm server, or a fresh interpreter) and the Parquet writes. Both include the embedded Ray
instance's start, shared by the N jobs; the third figure leaves it out: the slope between a sweep
of N and one of 2N jobs, (wall(2N) - wall(N) - (job time(2N) - job time(N))) / N, is what each
further job costs. Each figure is the median of `--rounds` runs, each with fresh results and spool
dirs; a round of N jobs and one of 2N run side by side.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import pyarrow.compute as pc
import pyarrow.parquet as pq

from orchestrator.specs import SweepSpec, load_inventory, load_sweep
from orchestrator.store import ResultStore
from orchestrator.sweep import run_sweep
from workers.contract import META_JOB_SECONDS


def tiny_sweep(n_jobs: int) -> SweepSpec:
    """N jobs whose measured work is a few milliseconds each."""
    return SweepSpec.model_validate(
        {
            "name": "overhead",
            "repetitions": 3,
            "warmup": 0,
            "baseline": "native",
            "cases": [
                {"case": "qmm", "arms": ["native"], "params": {"tokens": list(range(1, n_jobs + 1)), "n": 64, "k": 64}}
            ],
        }
    )


def one_round(sweep: SweepSpec) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["ORCHESTRATE_SPOOL"] = f"{tmp}/spool"
        os.environ["ORCHESTRATE_LOCK_PATH"] = f"{tmp}/gpu.lock"
        store = ResultStore(Path(tmp) / "results")
        t0 = time.perf_counter()
        summary = run_sweep(sweep, load_inventory(None), store, force=True)
        wall = time.perf_counter() - t0
        assert summary.failed == 0, [o.error for o in summary.outcomes if o.error]
        table = store.read()
        secs = table.filter(pc.equal(table["metric"], "seconds"))
        calls = [int(dict(e or []).get("calls_per_sample", "1")) for e in secs["extra"].to_pylist()]
        measured = sum(v * c for v, c in zip(secs["value"].to_pylist(), calls, strict=True))
        job_secs = sum(float((pq.read_metadata(f).metadata or {})[META_JOB_SECONDS]) for f in store.fragment_files())
        n = summary.ran
        return {
            "wall": wall,
            "jobs": n,
            "job_seconds": job_secs,
            "overhead_vs_measured": (wall - measured) / n,
            "overhead_vs_worker": (wall - job_secs) / n,
        }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--jobs", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--smoke-rounds", type=int, default=3)
    args = parser.parse_args()
    # One HOME for the whole process: Ray caches its auth token per process.
    home = tempfile.mkdtemp(prefix="orchestrate-bench-")
    os.environ["HOME"] = home
    os.environ.pop("RAY_AUTH_TOKEN_PATH", None)
    print(f"machine: {platform.node()} {platform.processor() or platform.machine()}, {os.cpu_count()} cores")
    rounds, doubled = [], []
    for _ in range(args.rounds):  # N and 2N side by side, so drift hits both
        rounds.append(one_round(tiny_sweep(args.jobs)))
        doubled.append(one_round(tiny_sweep(2 * args.jobs)))
    for r, d in zip(rounds, doubled, strict=True):
        print(f"  round: {r}\n  round: {d}")
    slopes = [
        ((d["wall"] - r["wall"]) - (d["job_seconds"] - r["job_seconds"])) / args.jobs
        for r, d in zip(rounds, doubled, strict=True)
    ]
    print(f"sweep of {args.jobs} jobs: wall median {statistics.median(r['wall'] for r in rounds):.2f} s")
    print(
        f"overhead per job (wall - measured samples)/N: median "
        f"{statistics.median(r['overhead_vs_measured'] for r in rounds):.3f} s"
    )
    print(
        f"overhead per job (wall - worker job time)/N: median "
        f"{statistics.median(r['overhead_vs_worker'] for r in rounds):.3f} s"
    )
    print(
        f"overhead per further job, Ray's start left out (slope N -> 2N): median {statistics.median(slopes):.3f} s "
        f"(rounds: {', '.join(f'{s:.3f}' for s in slopes)})"
    )
    smoke = load_sweep("smoke")
    walls = [one_round(smoke)["wall"] for _ in range(args.smoke_rounds)]
    print(
        f"smoke sweep wall time: median {statistics.median(walls):.1f} s (runs: {', '.join(f'{w:.1f}' for w in walls)})"
    )


if __name__ == "__main__":
    main()
