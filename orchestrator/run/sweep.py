"""`run_sweep`: the library function behind `orchestrate run`.

Load -> check -> expand -> skip complete jobs -> run on Ray -> store each job's rows as it
finishes -> within `budget`, top up the points whose verdict is still open
(`orchestrator.run.topup`). Nothing is started or written before the inputs, the results
directory and the cluster have been checked.
"""

from __future__ import annotations

import datetime as dt
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc

from orchestrator.cluster.embedded import local_gpus
from orchestrator.run.code_version import code_version
from orchestrator.run.executor import Interrupted, RayExecutor
from orchestrator.run.plan import expand, new_run_id
from orchestrator.run.topup import MAX_PASSES, TopUps, pooled, top_up_job, wanted
from orchestrator.specs.checks import check_sweep_against_inventory
from orchestrator.specs.definition import definition_footer
from orchestrator.specs.sweep import InventorySpec, SweepSpec
from orchestrator.store.fragments import ResultStore
from orchestrator.store.lock import LOCK_DIR, hold_store
from workers.contract import META_PHASES, ErrorKind, JobSpec, Status, footer_error_kind, footer_status


@dataclass
class JobOutcome:
    """What became of one job.

    Attributes:
        status: The job's status: ok, failed, unsupported, or contended (measured, but a foreign
            GPU user was seen during `contended_samples` of its `samples`: not complete).
        attempts: Measurements made (a contended one is repeated up to the host's `max_attempts`).
        seconds: The job's wall time as the head saw it (submission order aside: from the previous
            job's end or the start, to this one's), for the progress display.
        phases: Seconds per phase of the job (`workers.job.phases`), from its fragment's footer.
    """

    job: JobSpec
    status: Status
    rows: int
    path: Path
    error: str | None = None
    error_kind: ErrorKind | None = None  # why it failed, where the worker told (a busy GPU lock)
    contended_samples: int = 0
    samples: int = 0
    attempts: int = 1
    seconds: float = 0.0
    phases: dict[str, float] = field(default_factory=dict)
    foreign: str = ""  # the foreign processes the gate caught: `pid 123 (command, 97% of a core)`
    gate: str = ""  # what governs that gate (its inventory knob)

    def describe(self) -> str:
        """`ok`, `failed (why)`, `contended 10/10 samples, retried 1x: pid 123 (...); gate ...`."""
        if self.status == Status.CONTENDED:
            retried = f", retried {self.attempts - 1}x" if self.attempts > 1 else ""
            caught = f": {self.foreign}" if self.foreign else ""
            gate = f"; {self.gate}" if self.gate else ""
            return f"contended {self.contended_samples}/{self.samples} samples{retried}{caught}{gate}"
        return str(self.status) if self.status == Status.OK or not self.error else f"{self.status} ({self.error})"


@dataclass
class RunSummary:
    """The outcome of one `run_sweep`."""

    run_id: str
    sweep: str
    planned: int
    skipped: int
    outcomes: list[JobOutcome] = field(default_factory=list)
    wall_seconds: float = 0.0
    startup_seconds: float = 0.0  # from the call to the cluster ready (Ray's start, planning, resume)
    interrupted: int | None = None  # the signal (SIGINT, SIGTERM) that stopped the run early
    wait_stopped: Callable[[], None] = lambda: None  # returns once Ray has stopped (`stop_in_background`)
    top_ups: TopUps | None = None  # what `--budget` topped up and left open (None: no budget)

    @property
    def ran(self) -> int:
        return len(self.outcomes)

    @property
    def failed(self) -> int:
        """Jobs that did not measure cleanly for another reason than contention."""
        return sum(1 for o in self.outcomes if o.status not in (Status.OK, Status.CONTENDED))

    @property
    def contended(self) -> int:
        """Jobs whose measurement saw a foreign GPU user (the next plain run measures them again)."""
        return sum(1 for o in self.outcomes if o.status == Status.CONTENDED)

    def phase_totals(self) -> dict[str, float]:
        """Seconds per phase over every job of this run."""
        totals: dict[str, float] = {}
        for outcome in self.outcomes:
            for name, seconds in outcome.phases.items():
                totals[name] = totals.get(name, 0.0) + seconds
        return totals


Progress = Callable[[str, JobSpec, JobOutcome | None], None]


def job_label(job: JobSpec) -> str:
    """`h200 qmm tokens=512 n=21504 ...`: a job as the progress lines and the run's summary name it."""
    return f"{job.device} {job.case_name} " + " ".join(f"{k}={v}" for k, v in job.params.items())


def _first_error(table: pa.Table) -> str | None:
    errors = [e for e in table.column("error").to_pylist() if e]
    return errors[0] if errors else None


def sample_contention(table: pa.Table) -> tuple[int, int]:
    """(contended, all) samples of a job's rows: a sample is one arm's repetition (`sample` >= 0)."""
    timed = table.filter(pc.greater_equal(table["sample"], 0)).select(["arm", "sample", "contended"])
    if timed.num_rows == 0:
        return 0, 0
    per_sample = timed.group_by(["arm", "sample"]).aggregate([("contended", "any")])
    return int(pc.sum(per_sample["contended_any"].fill_null(False)).as_py() or 0), per_sample.num_rows


def job_extra(table: pa.Table) -> dict[str, str]:
    """The job-level facts of its rows' `extra` (the same on every row: the first row's)."""
    if table.num_rows == 0 or "extra" not in table.column_names:
        return {}
    return dict(table["extra"][0].as_py() or [])


def job_phases(table: pa.Table) -> dict[str, float]:
    """The numeric phases of a job's footer (`orchestrate.phases`)."""
    raw = json.loads((table.schema.metadata or {}).get(META_PHASES, b"{}"))
    return {k: float(v) for k, v in raw.items() if isinstance(v, int | float)}


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
    stop_in_background: bool = False,
    budget: float | None = None,
) -> RunSummary:
    """Run every job of `sweep` not already complete in `store`; return what happened.

    `budget`: seconds the whole run may take; what the first pass leaves of it goes to more rounds
    where a verdict is still open and short of its precision target (`orchestrator.run.topup`).

    `stop_in_background`: once every job's rows are stored, Ray stops in a thread while the caller
    reports them; the caller then calls `summary.wait_stopped()` before it exits.
    """
    t0 = time.perf_counter()
    kinds = check_sweep_against_inventory(sweep, inventory, sweep_where)
    gpus = local_gpus(inventory) if inventory.embedded else None  # a `gpus` this machine lacks: exit 2 here
    store.ensure_writable()
    # one run per sweep and results dir: a second one waits, then resumes
    hold_store(store.root, sweep.name, store.side / LOCK_DIR)
    run_id = new_run_id()
    jobs = expand(sweep, inventory, kinds, run_id=run_id, version=code_version(), spool_dir=spool_dir)
    done = set() if force else store.complete_job_keys(sweep.name)
    todo = [j for j in jobs if j.job_key not in done]
    summary = RunSummary(run_id=run_id, sweep=sweep.name, planned=len(jobs), skipped=len(jobs) - len(todo))
    if not todo:
        summary.wall_seconds = time.perf_counter() - t0
        return summary
    today = dt.datetime.now(dt.UTC).date()
    last_done = time.perf_counter()
    # The sweep as this run ran it (after `--ref` and any other edit), on every fragment of the run:
    # in each job's own footer rather than a file beside them, so a compaction's index and `import`
    # carry it with the rows and no reader of the dataset meets a file that is not Parquet.
    definition = definition_footer(sweep, sweep_where)

    measured: dict[str, tuple[JobSpec, pa.Table]] = {}  # job_key -> its rows, as stored

    def on_done(job: JobSpec, table: pa.Table) -> None:
        nonlocal last_done
        status = footer_status(table)
        table = table.replace_schema_metadata({**(table.schema.metadata or {}), **definition})
        path = store.write(table, sweep=job.sweep, date=today, device=job.device, run_id=run_id, job_key=job.job_key)
        measured[job.job_key] = (job, table)
        contended, samples = sample_contention(table)
        extra = job_extra(table)
        attempts = table["lock_attempts"][0].as_py() if table.num_rows else 1
        now = time.perf_counter()
        outcome = JobOutcome(
            job,
            status,
            table.num_rows,
            path,
            None if status == Status.OK else _first_error(table),
            error_kind=footer_error_kind(table),
            contended_samples=contended,
            samples=samples,
            attempts=int(attempts or 1),
            seconds=now - last_done,
            phases=job_phases(table),
            foreign=extra.get("foreign_processes", "") if status == Status.CONTENDED else "",
            gate=extra.get("contention_gate", "") if status == Status.CONTENDED else "",
        )
        last_done = now
        summary.outcomes.append(outcome)
        if progress:
            progress("done", job, outcome)

    if progress:
        progress("starting", todo[0], None)
    executor = RayExecutor(inventory, job_timeout=job_timeout, gpus=gpus)
    try:
        executor.start()
        executor.check_kinds({j.device for j in todo})
        last_done = time.perf_counter()
        summary.startup_seconds = last_done - t0
        if progress:
            for job in todo:
                progress("queued", job, None)
        executor.run(todo, on_done)
        if budget is not None:
            summary.top_ups = _top_up(executor, sweep, store, measured, budget - (time.perf_counter() - t0), today)
    except Interrupted as stop:
        summary.interrupted = stop.signum  # what finished is stored; the caller says so and how to resume
        executor.shutdown()
    except BaseException:
        executor.shutdown(quiet=True)  # the caller's one-line error is what the user reads
        raise
    else:  # every job ended and its rows are stored
        executor.shutdown(wait=not stop_in_background)
        summary.wait_stopped = executor.wait_stopped
    summary.wall_seconds = time.perf_counter() - t0
    return summary


def _top_up(
    executor: RayExecutor,
    sweep: SweepSpec,
    store: ResultStore,
    measured: dict[str, tuple[JobSpec, pa.Table]],
    left: float,
    today: dt.date,
) -> TopUps:
    """More rounds for the open points short of their target, in passes, within `left` seconds."""
    done = TopUps()
    deadline = time.perf_counter() + left
    for _ in range(MAX_PASSES):
        todo = wanted(measured.values(), sweep)
        if not todo:
            return done
        done.labels.update({job.job_key: job_label(job) for job, _ in todo})
        jobs = _within(todo, deadline - time.perf_counter(), done)
        if not jobs:
            return done

        def on_topped(job: JobSpec, table: pa.Table) -> None:
            old_job, old = measured[job.job_key]
            if footer_status(table) != Status.OK:
                done.left_open[job.job_key] = f"its top-up ended {footer_status(table)}: {_first_error(table)}"
                return
            merged = pooled(old, table)
            store.write(merged, sweep=job.sweep, date=today, device=job.device, run_id=job.run_id, job_key=job.job_key)
            measured[job.job_key] = (old_job, merged)
            done.left_open.pop(job.job_key, None)
            done.topped_up[job.job_key] = int(pc.max(merged["sample"]).as_py()) + 1

        executor.run(jobs, on_topped)
    for job, _ in wanted(measured.values(), sweep):
        done.left_open.setdefault(job.job_key, f"still open after {MAX_PASSES} top-ups")
    return done


def _within(todo: list[tuple[JobSpec, pa.Table]], left: float, done: TopUps) -> list[JobSpec]:
    """The top-up jobs that fit in `left` seconds, each with its share of the sampling time.

    A kind's jobs may run one after another on one host: each gets `(left - their overheads) / n`
    of sampling, at most its point's own `max_seconds`; the overhead of a job (start, warm-up,
    checks) is what its first measurement spent outside its timed rounds.
    """
    by_kind: dict[str, list[tuple[JobSpec, pa.Table]]] = {}
    for job, table in todo:
        by_kind.setdefault(job.device, []).append((job, table))
    out = []
    for jobs in by_kind.values():
        overheads = sum(v for _, t in jobs for k, v in job_phases(t).items() if k != "timed")
        share = (left - overheads) / len(jobs)
        for job, table in jobs:
            cap = float(job.options.get("max_seconds") or share)
            if share < min(1.0, cap):
                done.left_open[job.job_key] = "the run's --budget is spent"
                continue
            out.append(top_up_job(job, table, min(share, cap)))
    return out
