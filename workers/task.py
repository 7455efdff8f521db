"""The body of one Ray task: run a job in a fresh worker process and return its rows.

The job runs as `python -m workers run JOB.json --out FILE.parquet` in a subprocess, so that a
crash inside a kernel cannot take the Ray worker down, each job starts cold, and the thread
count is set explicitly (Ray would pin OMP_NUM_THREADS to the task's `num_cpus`). The Parquet
file it writes is the host's spool: it stays on the host's disk until the head has stored it,
and `orchestrate collect` can fetch it from there.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from workers.contract import JobSpec, LockSettings, failed_job_table
from workers.spool import DEFAULT_SPOOL as DEFAULT_SPOOL  # re-exported: workers.model_runner uses it
from workers.spool import fragment_name, spool_root


def spool_dir(job: JobSpec) -> Path:
    """Where this host keeps the job's files: the job's spool dir, or the host default."""
    path = spool_root(job.spool_dir) / job.sweep / job.run_id
    path.mkdir(parents=True, exist_ok=True)
    return path


def localise(job: JobSpec) -> JobSpec:
    """Apply this host's own settings, set when its Ray node was started: its name and its GPU
    lock settings (`ORCHESTRATE_LOCK`, JSON), the lock path alone (`ORCHESTRATE_LOCK_PATH`) last."""
    update: dict[str, Any] = {}
    if os.environ.get("ORCHESTRATE_HOST"):
        update["host"] = os.environ["ORCHESTRATE_HOST"]
    lock = job.lock
    if os.environ.get("ORCHESTRATE_LOCK"):
        lock = LockSettings.model_validate_json(os.environ["ORCHESTRATE_LOCK"]).model_copy(
            update={"enabled": job.lock.enabled}
        )
    if os.environ.get("ORCHESTRATE_LOCK_PATH"):
        lock = lock.model_copy(update={"path": os.environ["ORCHESTRATE_LOCK_PATH"]})
    if lock != job.lock:
        update["lock"] = lock
    return job.model_copy(update=update) if update else job


def execute_job(job_json: str, timeout: float | None = None) -> pa.Table:
    """Run one job (JSON of a `JobSpec`) in a subprocess and return its rows as an Arrow table."""
    job = localise(JobSpec.model_validate_json(job_json))
    spool = spool_dir(job)
    job_file = spool / f"{job.job_key}.json"
    out = spool / fragment_name(job.run_id, job.job_key)
    job_file.write_text(job.model_dump_json())
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = str(os.cpu_count() or 1)
    env.setdefault("PYTHONUNBUFFERED", "1")
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "workers", "run", str(job_file), "--out", str(out)],
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        detail = proc.stderr.strip().splitlines()[-1:] if proc.returncode else []
        error = f"worker exited {proc.returncode}: {' '.join(detail)}" if proc.returncode else None
    except subprocess.TimeoutExpired:
        error = f"worker timed out after {timeout} s"
    if error is None and out.exists():
        return pq.read_table(out)
    return failed_table(job, error or "worker wrote no rows")


def failed_table(job: JobSpec, error: str) -> pa.Table:
    """Rows for a job whose worker died: one failed row per arm, with the reason."""
    from workers.fingerprint import host_fingerprint

    return failed_job_table(job, host_fingerprint(), error)
