"""Run one job on this host: take the GPU lock, fingerprint, build, measure, return rows.

A job never raises for a problem of its own: a case that fails, a lock that stays busy or an
exception inside a kernel becomes rows with status `failed` and the error, so the sweep goes on.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import time
import traceback
from collections.abc import Callable

import numpy as np
import pyarrow as pa

from kernels import registry
from kernels.registry import CaseKind
from workers.command.job import run_command_job
from workers.contract import (
    META_JOB_SECONDS,
    META_PHASES,
    ErrorKind,
    HostFingerprint,
    JobContext,
    JobSpec,
    RowBuilder,
    Status,
)
from workers.host.fingerprint import host_fingerprint
from workers.host.peaks import PeakStamp
from workers.job import phases
from workers.job.measure import measure_workload
from workers.job.model import run_model_job
from workers.lock.gpu import GpuLock, LockBusyError
from workers.lock.probes import ContentionMonitor, gate_knob, probe_for, wait_idle
from workers.lock.slot import SlotLock

Dispatch = Callable[[JobSpec, RowBuilder, JobContext], Status]


def job_rng(job: JobSpec) -> np.random.Generator:
    """Fresh random inputs per job and run, reproducible from the recorded seed."""
    return np.random.default_rng(job.seed)


def kernel_workload(job: JobSpec, rng: np.random.Generator) -> registry.Workload:
    """The kernel case's workload at the job's point (its module imported, its arms built).

    An arm that runs another arm's path (`options.arm_paths`, an A/A copy) gets that path's
    callable under its own name: the same code, timed and checked as an arm of its own.
    """
    with phases.span("imports"):
        module = registry.load_case(job.case)
    params = {**registry.CASES[job.case].defaults, **job.params}
    aliases: dict[str, str] = job.options.get("arm_paths") or {}
    built = list(dict.fromkeys(aliases.get(a, a) for a in job.arms))
    with phases.span("build"):
        workload: registry.Workload = module.build(params, built, rng)
    if aliases:
        reference = workload.reference
        workload.reference = lambda arm, *inputs: reference(aliases.get(arm, arm), *inputs)
        for arm, path in aliases.items():
            if path in workload.arms:
                workload.arms[arm] = workload.arms[path]
            if path in workload.unsupported:
                workload.unsupported[arm] = workload.unsupported[path]
        workload.arms = {a: workload.arms[a] for a in job.arms if a in workload.arms}  # the sweep's order
    return workload


def _run_kernel_case(job: JobSpec, rows: RowBuilder, context: JobContext) -> Status:
    rng = job_rng(job)
    return measure_workload(job, kernel_workload(job, rng), rows, rng)


# The runner of each case kind (`CaseSpec.kind`): one entry per kind.
RUNNERS: dict[CaseKind, Dispatch] = {
    CaseKind.KERNEL: _run_kernel_case,
    CaseKind.COMMAND: run_command_job,
    CaseKind.MODEL: run_model_job,
}


def _dispatcher(job: JobSpec) -> Dispatch:
    spec = registry.get_case(job.case)
    if spec is None:
        raise ValueError(f"unknown case {job.case!r}")
    return RUNNERS[spec.kind]


def run_job(job: JobSpec, fingerprint: HostFingerprint | None = None) -> pa.Table:
    """Run `job` under the host's GPU lock and return its rows (never raises for job errors)."""
    t0 = time.perf_counter()
    spent = phases.reset()
    spawned = os.environ.pop("ORCHESTRATE_SPAWNED_AT", "")
    if spawned:  # set by workers.job.task: when the Ray task asked for this process
        spent.add("worker_start", time.time() - float(spawned))
    with spent.span("fingerprint"):
        fp = fingerprint or host_fingerprint(job.gpu)
    context = JobContext(started_at=dt.datetime.now(dt.UTC))
    rows = RowBuilder(job, fp, context)
    status = Status.FAILED
    peaks = PeakStamp(fp)  # the host's measured copy/matrix peaks, probed under the lock once per fingerprint
    try:
        dispatch = peaks.wrap(_dispatcher(job))
        status = _run_guarded(job, fp.backend, dispatch, rows, context)
    except Exception as exc:
        last = traceback.format_exception_only(type(exc), exc)[-1].strip()
        rows.fail_all(last, ErrorKind.LOCK_BUSY if isinstance(exc, LockBusyError) else None)
        status = Status.FAILED
    if not rows.rows:
        rows.fail_all("the case produced no rows")
        status = Status.FAILED
    table = peaks.stamp(rows.table(status))
    job_seconds = time.perf_counter() - t0
    inside = {k: v for k, v in spent.seconds.items() if k != "worker_start"}
    spent.add("other", job_seconds - sum(inside.values()))
    meta = {
        **(table.schema.metadata or {}),
        META_JOB_SECONDS: f"{job_seconds:.6f}".encode(),
        META_PHASES: json.dumps({k: round(v, 6) for k, v in spent.seconds.items()}).encode(),
    }
    return table.replace_schema_metadata(meta)


def job_lock(job: JobSpec, *, max_wait: float, cmd: str) -> GpuLock | SlotLock:
    """The lock `job` measures under: the host's GPU lock, or its GPU's slot on a host with several."""
    if job.gpu is None:
        return GpuLock(job.lock.path, max_wait=max_wait, mode="job", cmd=cmd)
    return SlotLock(job.lock.path, job.gpu.index, max_wait=max_wait, mode="job", cmd=cmd)


# GPU LOCK: the guarded lock around the whole job (build and measurement), with the idle gate
# before and the contention monitor during it; a contended measurement is repeated. A job pinned
# to one GPU of a host with several takes that GPU's lock (`workers.lock.slot`) and watches that
# GPU only.
def _run_guarded(job: JobSpec, backend: str, dispatch: Dispatch, rows: RowBuilder, context: JobContext) -> Status:
    if not job.lock.enabled:
        return dispatch(job, rows, context)
    settings = job.lock
    context.ignored_processes = list(settings.ignore_processes)
    status = Status.OK
    lock = job_lock(job, max_wait=settings.max_wait, cmd=f"{job.sweep}/{job.case_name}/{job.job_key}")
    with lock:
        phases.current().add("lock_wait", lock.wait_s)
        probe = probe_for(backend, settings, job.gpu)
        # One budget, as the shell guard's --max-wait: the lock wait and the idle wait together.
        budget = max(settings.max_wait - lock.wait_s, 1e-3) if settings.max_wait > 0 else 0.0
        with phases.span("idle_gate"):
            context.lock_wait_s = lock.wait_s + wait_idle(probe, settings.idle_secs, max_wait=budget)
        for attempt in range(1, settings.max_attempts + 1):
            if attempt > 1:  # a retry waits for the foreign user to leave; if it stays, keep the flagged rows
                try:
                    wait_idle(probe, settings.idle_secs, max_wait=settings.max_wait)
                except LockBusyError:
                    break
            rows.clear()
            monitor = ContentionMonitor(probe, interval=1.0)
            monitor.start()
            try:
                status = dispatch(job, rows, context)
            finally:
                report = monitor.stop()
            context.lock_attempts = attempt
            context.contention_samples = report.samples
            context.contended_samples, context.samples = rows.apply_contention(report.busy_windows)
            context.contended = context.contended_samples > 0
            context.foreign_pids = list(report.foreign_pids)
            context.foreign = dict(report.foreign)
            context.gate = gate_knob(probe.name, settings) if report.foreign else None
            if not context.contended:
                break
    if context.contended and status == Status.OK:
        return Status.CONTENDED  # measured, but not clean: not complete, a plain rerun measures it again
    return status
