"""`run_sweep`: the library function behind `orchestrate run`.

Load -> check -> expand -> skip complete jobs -> run on Ray -> store each job's rows as it
finishes. Nothing is started or written before the inputs, the results directory and the
cluster have been checked.
"""

from __future__ import annotations

import datetime as dt
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa

from orchestrator.executor import RayExecutor
from orchestrator.plan import code_version, expand, new_run_id
from orchestrator.specs import InventorySpec, SweepSpec, check_sweep_against_inventory
from orchestrator.store import ResultStore
from workers.contract import STATUS_OK, JobSpec


@dataclass
class JobOutcome:
    """What became of one job."""

    job: JobSpec
    status: str
    rows: int
    path: Path
    error: str | None = None


@dataclass
class RunSummary:
    """The outcome of one `run_sweep`."""

    run_id: str
    sweep: str
    planned: int
    skipped: int
    outcomes: list[JobOutcome] = field(default_factory=list)
    wall_seconds: float = 0.0

    @property
    def ran(self) -> int:
        return len(self.outcomes)

    @property
    def failed(self) -> int:
        return sum(1 for o in self.outcomes if o.status != STATUS_OK)


Progress = Callable[[str, JobSpec, JobOutcome | None], None]


def _first_error(table: pa.Table) -> str | None:
    errors = [e for e in table.column("error").to_pylist() if e]
    return errors[0] if errors else None


def run_sweep(
    sweep: SweepSpec,
    inventory: InventorySpec,
    store: ResultStore,
    *,
    sweep_where: str = "sweep",
    force: bool = False,
    progress: Progress | None = None,
    spool_dir: str | None = None,
    job_timeout: float | None = None,
) -> RunSummary:
    """Run every job of `sweep` not already complete in `store`; return what happened."""
    t0 = time.perf_counter()
    kinds = check_sweep_against_inventory(sweep, inventory, sweep_where)
    store.ensure_writable()
    run_id = new_run_id()
    jobs = expand(sweep, inventory, kinds, run_id=run_id, version=code_version(), spool_dir=spool_dir)
    done = set() if force else store.complete_job_keys(sweep.name)
    todo = [j for j in jobs if j.job_key not in done]
    summary = RunSummary(run_id=run_id, sweep=sweep.name, planned=len(jobs), skipped=len(jobs) - len(todo))
    if not todo:
        summary.wall_seconds = time.perf_counter() - t0
        return summary
    today = dt.datetime.now(dt.UTC).date()

    def on_done(job: JobSpec, table: pa.Table) -> None:
        status = (table.schema.metadata or {}).get(b"orchestrate.job_status", b"failed").decode()
        path = store.write(table, sweep=job.sweep, date=today, device=job.device, run_id=run_id, job_key=job.job_key)
        outcome = JobOutcome(job, status, table.num_rows, path, None if status == STATUS_OK else _first_error(table))
        summary.outcomes.append(outcome)
        if progress:
            progress("done", job, outcome)

    with RayExecutor(inventory, job_timeout=job_timeout) as executor:
        executor.check_kinds({j.device for j in todo})
        if progress:
            for job in todo:
                progress("queued", job, None)
        executor.run(todo, on_done)
    summary.wall_seconds = time.perf_counter() - t0
    return summary
