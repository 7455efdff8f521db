"""`python -m workers warm JOB.json`: ready this host for a run's first job while Ray starts.

Two costs fall on whichever job a fresh host runs first, and on no other: the host's peak probes
(once per host fingerprint, `workers.host.peaks`: 0.3 s on the H200) and the first compile of every
kernel the job's arms use (MLX's JIT writes them to its on-disk cache, `/tmp/mlx`, which every
later process reads: 0.7-9 s on the H200, by how much of that cache an earlier run left). On the
H200 they made the sweep's first qmm job a third, not half, warm-up and timed samples. The
embedded head (`orchestrator.run.executor`) starts this process beside Ray's start, which takes
seconds on any host, and waits for it before the first job: under the host's GPU lock it probes
the peaks where none are stored, builds the first job's case and calls each of its arms and
`auto` candidates once (nothing is timed or checked; nothing is kept: its arrays go with the
process), so the first job finds the peaks stored and the kernels compiled, as every job after
it does. Prints one line: `peaks S s, kernels S s (N calls)`. A failure here fails no job: the first
job then does the same work itself, as before. Exit 0 always unless the job file is unreadable (2,
`workers.__main__`).
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

from workers.contract import JobSpec

LOCK_WAIT_S = 30.0  # a lock held by someone else longer than this: leave the work to the first job


def rehearse(job: JobSpec) -> int:
    """Build `job`'s kernel case and call every arm and auto candidate once; the calls made."""
    import mlx.core as mx

    from kernels import registry
    from workers.job.runner import job_rng, kernel_workload

    spec = registry.get_case(job.case)
    if spec is None or spec.kind != "kernel":
        return 0
    rng = job_rng(job)
    workload = kernel_workload(job, rng)
    inputs = workload.make_inputs(rng)
    calls = 0
    for path in workload.arms.values():
        for each in [path, *(path.auto.candidates.values() if path.auto is not None else [])]:
            try:
                mx.eval(each.run(*inputs))
                calls += 1
            except Exception:  # an arm that fails here fails in the job, with its own error
                continue
    mx.synchronize()
    return calls


def warm(job: JobSpec) -> dict[str, Any]:
    """Probe the peaks (where none are stored) and rehearse `job`, under the host's GPU lock."""
    from workers.host.fingerprint import host_fingerprint
    from workers.host.peaks import host_peaks
    from workers.job.runner import job_lock
    from workers.lock.gpu import LockBusyError

    done: dict[str, Any] = {"peaks": 0.0, "kernels": 0.0, "calls": 0}
    fp = host_fingerprint(job.gpu)
    lock = job_lock(job, max_wait=LOCK_WAIT_S, cmd=f"{job.sweep}/warm")  # the lock the job itself takes
    try:
        with lock if job.lock.enabled else contextlib.nullcontext():
            t0 = time.perf_counter()
            host_peaks(fp, run_id=job.run_id)
            t1 = time.perf_counter()
            done["calls"] = rehearse(job)
            done["peaks"], done["kernels"] = t1 - t0, time.perf_counter() - t1
    except LockBusyError:
        done["skipped"] = "the GPU lock stayed busy"
    return done


def main(job: JobSpec) -> int:
    """The `warm` verb (after `workers.__main__` read the job file): prints its line, exits 0
    whatever happened to the warming itself (the first job then does that work)."""
    try:
        done = warm(job)
    except Exception as exc:
        print(f"failed ({type(exc).__name__}: {exc})")
        return 0
    extra = f"; {done['skipped']}" if "skipped" in done else ""
    print(f"peaks {done['peaks']:.2f} s, kernels {done['kernels']:.2f} s ({done['calls']} calls){extra}")
    return 0
