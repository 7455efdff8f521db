"""Where a sweep's wall time went: the run's one-line account and the per-job breakdown.

Each job's fragment carries its phases in its footer (`orchestrate.phases`, `workers.job.phases`);
`run_account` turns a finished run into one line (`timed 61 % of 212 s; largest other: reference
14 %`), `job_phases_table` reads the footers of stored jobs for `orchestrate phases`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from orchestrator.store.fragments import ResultStore
from orchestrator.store.scan import StoreScan
from workers.contract import META_JOB_SECONDS, META_PHASES

MEASURED = ("timed", "load")  # what the jobs were run for: timed samples and measured cold loads
WARMED = ("warmup", *MEASURED)  # the measurement with its warm-up (issue 13's share: at least half of a job)
LABELS = {
    "worker_start": "worker start",
    "imports": "imports",
    "fingerprint": "host fingerprint",
    "peaks": "peak probes",
    "lock_wait": "GPU lock wait",
    "idle_gate": "idle gate",
    "build": "building inputs and weights",
    "reference": "reference check",
    "warmup": "warm-up",
    "timed": "timed samples",
    "sample_start": "sample process start",
    "load": "cold loads",
    "sample_other": "sample processes' rest",
    "other": "rest of the job",
    "task_overhead": "Ray task",
    "spool_read": "spool read",
    "startup": "Ray start and planning",
    "head": "head (scheduling, storing)",
}


def label(phase: str) -> str:
    """The phase's name for people."""
    return LABELS.get(phase, phase.replace("_", " "))


def run_account(phases: dict[str, float], wall_seconds: float, startup_seconds: float) -> str:
    """One line: the measured share of the run's wall time and the largest other phase.

    `phases` are the summed job phases of the run; what they do not cover of the wall time after
    `startup_seconds` is the head's own time (scheduling, storing fragments, waiting).
    """
    if wall_seconds <= 0:
        return ""
    jobs = {k: v for k, v in phases.items() if v > 0}
    jobs["startup"] = startup_seconds
    jobs["head"] = max(wall_seconds - startup_seconds - sum(phases.values()), 0.0)
    measured = sum(jobs.pop(k, 0.0) for k in MEASURED)
    share = 100.0 * measured / wall_seconds
    line = (
        f"timed {share:.0f} % of {wall_seconds:.0f} s"
        if wall_seconds >= 10
        else (f"timed {share:.0f} % of {wall_seconds:.1f} s")
    )
    if jobs:
        name, seconds = max(jobs.items(), key=lambda kv: kv[1])
        line += f"; largest other: {label(name)} {100.0 * seconds / wall_seconds:.0f} %"
    return line


@dataclass(frozen=True)
class JobPhases:
    """One stored job's phases."""

    sweep: str
    device: str
    job_key: str
    run_id: str
    seconds: float
    process: str
    phases: dict[str, float]


def job_phases_table(store: ResultStore, sweep: str | None = None, run: str | None = None) -> list[JobPhases]:
    """The phases of every stored job (of one sweep and/or run), from the fragments' footers only."""
    out: list[JobPhases] = []
    for frag in store.fragments():
        if (sweep is not None and frag.sweep != sweep) or (run is not None and f"part-{run}-" not in frag.path.name):
            continue
        meta = frag.meta  # the job's footer (a compacted job's from its file's index)
        raw = json.loads(meta.get(META_PHASES, b"{}"))
        numbers = {k: float(v) for k, v in raw.items() if isinstance(v, int | float)}
        run_id = frag.path.name.removeprefix("part-").rsplit("-", 1)[0]
        seconds = float(meta.get(META_JOB_SECONDS, b"0") or 0)
        out.append(
            JobPhases(frag.sweep, frag.device, frag.job_key, run_id, seconds, str(raw.get("process", "")), numbers)
        )
    return out


def job_labels(store: ResultStore, sweep: str | None = None, run: str | None = None) -> dict[tuple[str, str], str]:
    """(run id, job key) -> the job for people: its case name and the parameters that tell it apart
    from the other listed jobs of the same case (`qmm tokens=512`), read from the rows (a compacted
    job's footer facts do not carry its point)."""
    where, params = ("WHERE run_id = $run", {"run": run}) if run else ("", None)
    sql = f"SELECT DISTINCT run_id, job_key, case_name, map_keys(params), map_values(params) FROM results_files {where}"
    found = StoreScan(store, sweep=sweep).rows(sql, params)
    values: dict[tuple[str, str], set[str]] = {}  # (case name, parameter) -> the values the jobs take
    for _, _, case, keys, vals in found:
        for key, value in zip(keys or [], vals or [], strict=True):
            values.setdefault((case, key), set()).add(value)
    labels: dict[tuple[str, str], str] = {}
    for run_id, job_key, case, keys, vals in found:
        told = [f"{k}={v}" for k, v in zip(keys or [], vals or [], strict=True) if len(values[(case, k)]) > 1]
        labels[(run_id, job_key)] = " ".join([case, *told])
    return labels
