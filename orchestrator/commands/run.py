"""`orchestrate run`: run a sweep on the inventory's hosts and print the comparison."""

from __future__ import annotations

import os
from pathlib import Path

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn, TimeElapsedColumn

from orchestrator.console import console, summary_table
from orchestrator.criteria import judge_stored, validate_criteria
from orchestrator.errors import EXIT_LOCK_TIMEOUT
from orchestrator.specs import load_inventory, load_sweep, resolve_sweep_path
from orchestrator.store import ResultStore
from orchestrator.summary import left_out, summarize
from orchestrator.sweep import JobOutcome, RunSummary, run_sweep
from workers.contract import JobSpec

DEFAULT_RESULTS = "results"


def results_root(value: Path | None) -> Path:
    """`--results`, else $ORCHESTRATE_RESULTS, else ./results."""
    return value or Path(os.environ.get("ORCHESTRATE_RESULTS", DEFAULT_RESULTS))


class ProgressView:
    """Live progress: a rich bar on a terminal, one plain line per finished job otherwise."""

    def __init__(self) -> None:
        self.console = console()
        self.live = self.console.is_terminal
        self.total = 0
        self.finished = 0
        self.bar: Progress | None = None
        self.task: TaskID | None = None

    def __call__(self, event: str, job: JobSpec, outcome: JobOutcome | None) -> None:
        label = f"{job.device} {job.case_name} " + " ".join(f"{k}={v}" for k, v in job.params.items())
        if event == "queued":
            self.total += 1
            if self.live and self.bar is None:
                self.bar = Progress(
                    TextColumn("{task.description}"),
                    BarColumn(),
                    MofNCompleteColumn(),
                    TimeElapsedColumn(),
                    console=self.console,
                    transient=True,
                )
                self.bar.start()
                self.task = self.bar.add_task("jobs", total=None)
            if self.bar is not None and self.task is not None:
                self.bar.update(self.task, total=self.total)
            return
        assert outcome is not None
        self.finished += 1
        note = "" if outcome.status == "ok" else f" ({outcome.error})"
        line = f"[{self.finished}/{self.total}] {label}: {outcome.status}{note}"
        if self.bar is not None and self.task is not None:
            self.bar.update(self.task, advance=1, description=label)
            self.bar.console.print(line)
        else:
            print(line, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()


def report_summary(summary: RunSummary, store: ResultStore, baseline: str | None) -> None:
    """Print what ran and the comparison table of the sweep's stored results."""
    out = console()
    if summary.ran == 0:
        out.print(
            f"Nothing to do: all {summary.planned} jobs of sweep {summary.sweep!r} are complete in {store.root} "
            "(use --force to run them again)."
        )
    else:
        out.print(
            f"Run {summary.run_id}: {summary.ran} jobs ran ({summary.failed} failed), "
            f"{summary.skipped} already complete, in {summary.wall_seconds:.1f} s; results in {store.root}"
        )
    table = store.read(sweep=summary.sweep)
    lines = summarize(table, baseline=baseline)
    out.print(summary_table(lines, baseline, f"sweep {summary.sweep}: {table.num_rows} rows"))
    note = left_out(table)
    if note:
        out.print(note)
    for path, reason in store.broken:
        out.print(f"warning: skipped broken fragment {path}: {reason}")


def register(app: typer.Typer) -> None:
    @app.command("run")
    def run(
        inventory: Path | None = typer.Option(
            None, "--inventory", "-i", help="host inventory TOML (default: this machine)"
        ),
        sweep: str = typer.Option("smoke", "--sweep", "-s", help="built-in sweep name or sweep TOML path"),
        results: Path | None = typer.Option(None, "--results", "-r", help="results directory (default ./results)"),
        force: bool = typer.Option(False, "--force", help="run jobs again even when complete in the store"),
        job_timeout: float | None = typer.Option(None, "--job-timeout", help="seconds before a job is failed"),
    ) -> None:
        """Run a sweep: every job not yet complete, one per host's GPU at a time."""
        spec = load_sweep(sweep)
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
            )
        finally:
            view.close()
        report_summary(summary, store, spec.baseline)
        verdicts, verdict_code = judge_stored(store, spec)  # the sweep's [[criteria]], on intervals
        if verdicts:
            print(verdicts, flush=True)
        if any(o.error and "LockBusyError" in o.error for o in summary.outcomes):
            raise typer.Exit(EXIT_LOCK_TIMEOUT)  # a host's GPU lock stayed busy past its max wait
        if summary.failed:
            raise typer.Exit(1)  # a job failed (wrong output, crash, lost host): its rows say why
        if verdict_code:
            raise typer.Exit(verdict_code)  # 1: a criterion failed; 4: none failed, one ambiguous
