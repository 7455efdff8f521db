"""`orchestrate run`: run a sweep on the inventory's hosts and print the comparison."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import typer
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from orchestrator.analysis.criteria import judge_stored, validate_criteria
from orchestrator.commands.options import compact_after_option, no_compact_option, results_option
from orchestrator.errors import EXIT_CONTENDED, EXIT_LOCK_TIMEOUT, InputError
from orchestrator.report.console import console, warn
from orchestrator.report.summary import render_run_end
from orchestrator.run.account import run_account
from orchestrator.run.plan import with_refs
from orchestrator.run.sweep import JobOutcome, RunSummary, job_label, run_sweep
from orchestrator.specs.sweep import SweepSpec, load_inventory, load_sweep, resolve_sweep_path
from orchestrator.store.compact import compact_after_run
from orchestrator.store.fragments import ResultStore
from workers.contract import ErrorKind, JobSpec, Status

DEFAULT_RESULTS = "results"


def results_root(value: Path | None) -> Path:
    """`--results`, else $ORCHESTRATE_RESULTS, else ./results."""
    return value or Path(os.environ.get("ORCHESTRATE_RESULTS", DEFAULT_RESULTS))


class ProgressView:
    """Live progress: a bar with the running job and an ETA on a terminal, one line per job otherwise.

    Ray runs each device kind's jobs in submission order on its free slots, so the running jobs
    are the first unfinished ones of each kind (one per host's slot).
    """

    def __init__(self) -> None:
        self.console = console()
        self.live = self.console.is_terminal
        self.queued: list[JobSpec] = []
        self.finished: set[str] = set()
        self.outcomes: list[JobOutcome] = []
        self.bar: Progress | None = None
        self.task: TaskID | None = None

    def __call__(self, event: str, job: JobSpec, outcome: JobOutcome | None) -> None:
        if event == "starting":
            self.console.print("Starting Ray and checking the hosts ...", markup=False, highlight=False)
            return
        if event == "queued":
            self.queued.append(job)
            if self.live and self.bar is None:
                self.bar = Progress(
                    TextColumn("{task.description}", markup=False),
                    BarColumn(),
                    MofNCompleteColumn(),
                    TimeElapsedColumn(),
                    TextColumn("ETA"),
                    TimeRemainingColumn(),
                    console=self.console,
                    transient=True,
                )
                self.bar.start()
                self.task = self.bar.add_task("jobs", total=None)
            if self.bar is not None and self.task is not None:
                self.bar.update(self.task, total=len(self.queued), description=self._running())
            return
        assert outcome is not None
        self.finished.add(job.job_key)
        self.outcomes.append(outcome)
        count = f"[{len(self.finished)}/{len(self.queued)}]"
        line = f"{count} {job_label(job)}: {outcome.describe()} in {outcome.seconds:.1f} s"
        if self.bar is not None and self.task is not None:
            self.bar.update(self.task, advance=1, description=self._running())
            self.bar.console.print(line, markup=False, highlight=False)
        else:
            print(line, flush=True)

    def _running(self) -> str:
        running = [j for j in self.queued if j.job_key not in self.finished][:1]
        return f"running: {job_label(running[0])}" if running else "finishing"

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()
            self.bar = None

    def slowest(self, count: int = 3) -> str:
        """`slowest: h200 qmm tokens=16384 ... 41.2 s, ...` for the end of the run."""
        top = sorted(self.outcomes, key=lambda o: -o.seconds)[:count]
        return "slowest: " + "; ".join(f"{job_label(o.job)} {o.seconds:.1f} s" for o in top) if top else ""


def report_summary(
    summary: RunSummary, store: ResultStore, sweep: SweepSpec, view: ProgressView, results: Path | None = None
) -> None:
    """Print what ran and where the time went, then the sweep's comparison and the next commands."""
    out = console()
    if summary.ran == 0 and not summary.interrupted:
        out.print(
            f"Nothing to do: all {summary.planned} jobs of sweep {summary.sweep!r} are complete in {store.root} "
            "(use --force to run them again).",
            markup=False,
        )
    else:
        counts = f"{summary.failed} failed" + (f", {summary.contended} contended" if summary.contended else "")
        out.print(
            f"Run {summary.run_id}: {summary.ran} jobs ran ({counts}), "
            f"{summary.skipped} already complete, in {summary.wall_seconds:.1f} s; results in {store.root}",
            markup=False,
        )
        account = run_account(summary.phase_totals(), summary.wall_seconds, summary.startup_seconds)
        if account:
            out.print(
                f"sweep {summary.sweep}: {account} (per job: orchestrate phases --run {summary.run_id})", markup=False
            )
        if len(view.outcomes) > 1:
            out.print(view.slowest(), markup=False)
        if summary.contended:
            out.print(
                f"{summary.contended} jobs saw a foreign GPU user and are not complete: "
                "run the same command again to measure them again.",
                markup=False,
            )
        if summary.top_ups is not None:
            for line in summary.top_ups.lines() or ["--budget: no open point was short of its precision target"]:
                out.print(line, markup=False)
    render_run_end(store, sweep, out, results=results, run_id=summary.run_id)


DURATION = re.compile(r"(?:(\d+(?:\.\d+)?)h)?(?:(\d+(?:\.\d+)?)m)?(?:(\d+(?:\.\d+)?)s?)?")


def parse_duration(text: str, where: str) -> float:
    """Seconds in `90`, `90s`, `10m`, `1h30m`; an InputError naming `where` otherwise."""
    match = DURATION.fullmatch(text.strip())
    if not text.strip() or match is None:
        raise InputError(f"{text!r} is not a duration (write 90s, 10m or 1h30m)", where=where)
    hours, minutes, secs = (float(g) if g else 0.0 for g in match.groups())
    total = hours * 3600 + minutes * 60 + secs
    if total <= 0:
        raise InputError(f"{text!r}: a duration must be longer than zero", where=where)
    return total


def register(app: typer.Typer) -> None:
    @app.command("run")
    def run(
        inventory: Path | None = typer.Option(
            None, "--inventory", "-i", help="host inventory TOML (default: this machine)"
        ),
        sweep: str = typer.Option("smoke", "--sweep", "-s", help="built-in sweep name or sweep TOML path"),
        results: Path = results_option(),
        force: bool = typer.Option(False, "--force", help="run jobs again even when complete in the store"),
        job_timeout: float | None = typer.Option(None, "--job-timeout", min=1, help="seconds before a job is failed"),
        ref: list[str] | None = typer.Option(
            None, "--ref", help="build the command cases at this git ref; twice (BASE, then HEAD): compare two commits"
        ),
        budget: str | None = typer.Option(
            None,
            "--budget",
            metavar="DURATION",
            help="the whole run's time (90s, 10m, 1h30m): what is left after the first pass goes to more "
            "rounds where a verdict is still open and short of its precision target",
        ),
        compact_after: int = compact_after_option(),
        no_compact: bool = no_compact_option(),
    ) -> None:
        """Run a sweep: every job not yet complete, one per host's GPU at a time."""
        seconds = None if budget is None else parse_duration(budget, "--budget")
        spec = with_refs(load_sweep(sweep), list(ref or []))
        validate_criteria(spec)  # a criterion no case can answer is refused before anything runs
        inv = load_inventory(inventory)
        store = ResultStore(results_root(results))
        view = ProgressView()
        try:
            summary = run_sweep(
                spec,
                inv,
                store,
                sweep_where=str(resolve_sweep_path(sweep)),
                force=force,
                progress=view,
                job_timeout=job_timeout,
                stop_in_background=True,  # the rows are reported while Ray stops
                budget=seconds,
            )
        finally:
            view.close()
        try:
            _report(summary, store, spec, view, results, compact_after=compact_after, no_compact=no_compact)
        finally:
            summary.wait_stopped()  # no Ray process outlives the command


def _report(
    summary: RunSummary,
    store: ResultStore,
    spec: SweepSpec,
    view: ProgressView,
    results: Path | None,
    *,
    compact_after: int,
    no_compact: bool,
) -> None:
    """What `run` prints and its exit code, once the sweep's rows are stored."""
    if summary.interrupted:
        stored = sum(1 for o in summary.outcomes if o.status == Status.OK)
        print(
            f"interrupted: {stored} of {summary.planned - summary.skipped} jobs stored"
            f"{f' ({summary.skipped} were complete before)' if summary.skipped else ''}; rerun to resume",
            file=sys.stderr,
            flush=True,
        )
        raise typer.Exit(128 + summary.interrupted)  # as a shell reports a process ended by that signal
    report_summary(summary, store, spec, view, results)
    verdicts, verdict_code = judge_stored(store, spec)  # the sweep's [[criteria]], on intervals
    if verdicts:
        print(verdicts, flush=True)
    if not no_compact and (line := compact_after_run(store, spec.name, after_days=compact_after, warn=warn)):
        print(line, flush=True)
    if any(o.error_kind is ErrorKind.LOCK_BUSY for o in summary.outcomes):
        raise typer.Exit(EXIT_LOCK_TIMEOUT)  # a host's GPU lock stayed busy past its max wait
    if summary.failed:
        raise typer.Exit(1)  # a job failed (wrong output, crash, lost host): its rows say why
    if summary.contended:
        raise typer.Exit(EXIT_CONTENDED)  # points left unmeasured: a foreign GPU user was there
    if verdict_code:
        raise typer.Exit(verdict_code)  # 1: a criterion failed; 4: none failed, one ambiguous
