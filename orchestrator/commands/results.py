"""`orchestrate results` (the quick summary) and `orchestrate query` (DuckDB SQL)."""

from __future__ import annotations

from pathlib import Path

import typer

from orchestrator.commands.run import results_root
from orchestrator.console import console, summary_table
from orchestrator.errors import InputError, OrchestratorError
from orchestrator.query import run_query
from orchestrator.specs import builtin_sweeps, load_sweep
from orchestrator.stats import latest_runs
from orchestrator.store import ResultStore
from orchestrator.summary import left_out, summarize


def _baseline_for(sweep: str | None, given: str | None) -> str | None:
    if given or sweep is None:
        return given
    if sweep in builtin_sweeps():
        return load_sweep(sweep).baseline
    return None


def register(app: typer.Typer) -> None:
    @app.command("results")
    def results(
        sweep: str | None = typer.Option(None, "--sweep", "-s", help="only this sweep"),
        run: str | None = typer.Option(None, "--run", help="only this run id"),
        baseline: str | None = typer.Option(None, "--baseline", help="arm to compare with (default: the sweep's)"),
        all_runs: bool = typer.Option(False, "--all-runs", help="pool samples of every run, not the newest"),
        results_dir: Path | None = typer.Option(None, "--results", "-r", help="results directory (default ./results)"),
    ) -> None:
        """Per device, case, parameters and arm: median, spread, samples, ratio to the baseline.

        As `orchestrate compare`: each point's newest run counts (`--all-runs` pools them).
        """
        store = ResultStore(results_root(results_dir))
        table = store.read(sweep=sweep, run=run)
        if table.num_rows == 0:
            raise InputError("no results stored" + (f" for sweep {sweep!r}" if sweep else ""), where=str(store.root))
        if run is None and not all_runs:
            table = latest_runs(table)
        which = f"run {run}" if run else "every run pooled" if all_runs else "each point's newest run"
        base = _baseline_for(sweep, baseline)
        out = console()
        title = f"{table.num_rows} rows in {store.root} ({which})"
        out.print(summary_table(summarize(table, baseline=base), base, title))
        note = left_out(table)
        if note:
            out.print(note)
        out.print(f"rows: {table.num_rows}")
        for path, reason in store.broken:
            out.print(f"warning: skipped broken fragment {path}: {reason}")

    @app.command("query")
    def query(
        sql: str = typer.Argument(..., help="SQL over the table `results`"),
        results_dir: Path | None = typer.Option(None, "--results", "-r", help="results directory (default ./results)"),
        fmt: str = typer.Option("table", "--format", "-f", help="table, csv or json"),
    ) -> None:
        """Run DuckDB SQL over the result dataset (table name `results`)."""
        store = ResultStore(results_root(results_dir))
        if fmt not in ("table", "csv", "json"):
            raise InputError(f"--format {fmt!r}: expected table, csv or json")
        try:
            print(run_query(store, sql, fmt))
        except OrchestratorError:
            raise
