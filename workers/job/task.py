"""The body of one Ray task: run a job in a fresh worker process and return its rows.

The job runs in a process of its own (`python -m workers run JOB.json --out FILE.parquet`), so
that a crash inside a kernel cannot take the Ray worker down, each job starts with no MLX state,
and the thread count is set explicitly (Ray would pin OMP_NUM_THREADS to the task's `num_cpus`).
On Linux that process is forked from this Ray worker's fork server (`workers.proc.forkserver`: the
imports done, no device touched), which saves Python's start-up and the imports per job; set
`ORCHESTRATE_FRESH_INTERPRETERS=1` on a host to start every job in a fresh interpreter instead.
The job's stdout and stderr go to a log file beside the job in the spool (read back as a bounded
tail for errors), never into memory. A job's timeout kills its whole process group.

The Parquet file the job writes is the host's spool: it stays on the host's disk until the head
has stored it, and `orchestrate collect` can fetch it from there.

On a host with several GPUs each GPU is a Ray node of its own, labelled `gpu-index` (and
`gpu-uuid`); the task reads its node's labels (`localise`) and pins the job's process to that
GPU (`workers.host.gpus.visibility_env`: set in the process's environment before anything imports
MLX). The fork server is kept per pin: it is started with the pinned environment, so a job is
never forked from a server whose environment named another GPU (one Ray worker belongs to one
node, so in practice each GPU's workers keep their own server and never switch).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from workers.contract import META_PHASES, GpuPin, JobSpec, LockSettings, failed_job_table
from workers.host.fingerprint import static_fingerprint
from workers.host.gpus import GPU_SLOTS_ENV, pin_from_labels, visibility_env
from workers.job.spool import DEFAULT_SPOOL as DEFAULT_SPOOL  # re-exported: workers.job.model uses it
from workers.job.spool import fragment_name, spool_root
from workers.lock.own_processes import HEAD_AT_ENV
from workers.proc import fork
from workers.proc import spawn as forkclient

FRESH_ENV = "ORCHESTRATE_FRESH_INTERPRETERS"
SPAWNED_AT_ENV = "ORCHESTRATE_SPAWNED_AT"  # wall-clock time the job's process was asked for
TAIL_BYTES = 4096

_server: forkclient.ForkServer | None = None
_server_key: tuple[str, ...] | None = None


def spool_dir(job: JobSpec) -> Path:
    """Where this host keeps the job's files: the job's spool dir, or the host default."""
    path = spool_root(job.spool_dir) / job.sweep / job.run_id
    path.mkdir(parents=True, exist_ok=True)
    return path


def node_pin() -> GpuPin | None:
    """The GPU of the Ray node this task runs on (its `gpu-index` label), or None: a node of a
    host without `gpus`, or no Ray here."""
    try:
        import ray  # Ray: only inside a Ray task; the job runs without it too

        if not ray.is_initialized():
            return None
        labels: dict[str, Any] = dict(ray.get_runtime_context().get_node_labels())  # str -> str (typed as lists)
        return pin_from_labels({k: str(v) for k, v in labels.items()})
    except Exception:  # outside a Ray worker (a test calling execute_job directly)
        return None


def localise(job: JobSpec) -> JobSpec:
    """Apply this host's own settings, set when its Ray node was started: its name and its GPU
    lock settings (`ORCHESTRATE_LOCK`, JSON), the lock path alone (`ORCHESTRATE_LOCK_PATH`) last,
    and the node's GPU (`node_pin`)."""
    update: dict[str, Any] = {}
    pin = node_pin()
    if pin is not None:
        update["gpu"] = pin
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


def job_env(job: JobSpec | None = None) -> dict[str, str]:
    """The environment of a job's process: this worker's, with the host's thread count, pinned
    to the job's GPU where it has one."""
    env = dict(os.environ)
    cores = os.cpu_count() or 1
    env["OMP_NUM_THREADS"] = str(cores)
    env.setdefault("PYTHONUNBUFFERED", "1")
    if job is not None and job.gpu is not None:
        slots = os.environ.get(GPU_SLOTS_ENV, "")
        if slots.isdigit() and int(slots) > 1:  # the host's cores shared among its GPUs' jobs
            env["OMP_NUM_THREADS"] = str(max(cores // int(slots), 1))
        for key, value in visibility_env(job.backend, job.gpu).items():
            if value is None:
                env.pop(key, None)
            else:
                env[key] = value
    return env


def fork_server(job: JobSpec, env: dict[str, str]) -> forkclient.ForkServer | None:
    """This Ray worker's fork server for `job`'s code version (started or restarted as needed).

    None where jobs start in fresh interpreters: off Linux, with `ORCHESTRATE_FRESH_INTERPRETERS=1`,
    or when the server cannot start.
    """
    global _server, _server_key
    if not forks_jobs():
        return None
    key = server_key(job, env)
    if _server is not None and _server_key == key and _server.alive():
        return _server
    if _server is not None:
        _server.close()
    try:
        _server, _server_key = forkclient.ForkServer.start(env), key
    except OSError:
        return None
    return _server


def forks_jobs() -> bool:
    """Whether jobs here are forked from a fork server (not off Linux or with `ORCHESTRATE_FRESH_INTERPRETERS=1`)."""
    return fork.supported() and os.environ.get(FRESH_ENV) != "1"


def server_key(job: JobSpec, env: dict[str, str]) -> tuple[str, ...]:
    """What a job's fork server must share with it: the code version, thread count, interpreter, GPU."""
    pin = "" if job.gpu is None else f"{job.gpu.index}:{job.gpu.uuid}"
    return (job.code_version, env["OMP_NUM_THREADS"], sys.executable, pin)


def _run_process(job: JobSpec, argv: list[str], log: Path, timeout: float | None) -> tuple[int | None, str]:
    """Run the job's process (forked from the fork server, or a fresh interpreter); (exit code, how).

    A timeout kills its process group and gives exit code None.
    """
    env = job_env(job)
    server = fork_server(job, env)
    changes = {SPAWNED_AT_ENV: repr(time.time())}
    with log.open("wb") as out:
        return forkclient.run_entry(
            "workers",
            argv,
            env=env,
            changes=changes,
            stdout=out.fileno(),
            stderr=out.fileno(),
            timeout=timeout,
            server=server,
        )


def log_tail(path: Path, limit: int = TAIL_BYTES) -> str:
    """The last `limit` bytes of a log file, as text."""
    try:
        with path.open("rb") as fh:
            fh.seek(max(path.stat().st_size - limit, 0))
            return fh.read().decode(errors="replace")
    except OSError:
        return ""


def execute_job(job_json: str, timeout: float | None = None, head: str | None = None) -> pa.Table:
    """Run one job (JSON of a `JobSpec`) in its own process and return its rows as an Arrow table.

    `head` (`hostname:pid`) names the head that submitted it, which the job's GPU-user probes then
    know as one of ours (`workers.lock.own_processes`).
    """
    t0 = time.perf_counter()
    if head:
        os.environ[HEAD_AT_ENV] = head
    job = localise(JobSpec.model_validate_json(job_json))
    spool = spool_dir(job)
    job_file = spool / f"{job.job_key}.json"
    out = spool / fragment_name(job.run_id, job.job_key)
    log = spool / f"{job.job_key}.log"
    job_file.write_text(job.model_dump_json())
    code, how = _run_process(job, ["run", str(job_file), "--out", str(out)], log, timeout)
    t_ran = time.perf_counter()
    if code is None:
        error: str | None = f"worker timed out after {timeout} s"
    elif code:
        detail = log_tail(log).strip().splitlines()[-1:]
        error = f"worker exited {code}: {' '.join(detail)}"
    else:
        error = None
    if error is None and out.exists():
        with pq.ParquetFile(out) as fragment:  # not `read_table`: pyarrow.dataset imports pandas (0.3 s)
            table = fragment.read()
        return with_task_phases(table, how, t_ran - t0, time.perf_counter() - t_ran)
    return failed_table(job, error or "worker wrote no rows")


def with_task_phases(table: pa.Table, how: str, process_s: float, read_s: float) -> pa.Table:
    """The job's phases (footer `orchestrate.phases`) with what the Ray task saw around its process."""
    meta = dict(table.schema.metadata or {})
    phases = json.loads(meta.get(META_PHASES, b"{}"))
    inside = sum(v for k, v in phases.items() if k != "worker_start" and isinstance(v, int | float))
    phases["task_overhead"] = round(max(process_s - inside - float(phases.get("worker_start", 0.0)), 0.0), 6)
    phases["spool_read"] = round(read_s, 6)
    phases["process"] = how
    meta[META_PHASES] = json.dumps(phases).encode()
    return table.replace_schema_metadata(meta)


def failed_table(job: JobSpec, error: str) -> pa.Table:
    """Rows for a job whose worker died: one failed row per arm, with the reason.

    The host is described without MLX (this Ray worker never opens a device context).
    """
    return failed_job_table(job, static_fingerprint(job.backend, pin=job.gpu), error)
