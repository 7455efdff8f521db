"""`orchestrate results` (the quick look) and `orchestrate runs` (what is stored); `query` is `commands/query.py`."""

from __future__ import annotations

from pathlib import Path

import typer

from orchestrator.analysis.commits import head_rows
from orchestrator.analysis.selection import resolve_sweep
from orchestrator.commands.options import format_option, output_option, results_option, sweep_option
from orchestrator.errors import InputError
from orchestrator.report.console import console, print_fitted, print_wide, warn, warn_broken
from orchestrator.report.output import Format, destination, write_table
from orchestrator.report.summary import left_out, results_markdown, results_table, summarize, summary_records
from orchestrator.store.dataset import read_rows
from orchestrator.store.fragments import ResultStore
from orchestrator.store.query import stored_runs


def register(app: typer.Typer) -> None:
    @app.command("results")
    def results_(
        sweep: str | None = sweep_option(),
        run: str | None = typer.Option(None, "--run", help="only this run id (default: each point's newest run)"),
        all_runs: bool = typer.Option(False, "--all-runs", help="pool samples of every run, not the newest"),
        baseline: str | None = typer.Option(
            None, "--baseline", "-b", help="arm to compare with (default: the sweep's baseline)"
        ),
        fmt: Format = format_option("the summary"),
        output: Path | None = output_option(),
        results: Path = results_option(),
    ) -> None:
        """Per device, case, point and arm: median, spread, samples, ratio to the case's baseline arm.

        As `orchestrate compare`: each point's newest run counts (`--all-runs` pools them), and of
        a commit comparison HEAD alone (`compare --by commit` puts it beside BASE).
        """
        store = ResultStore(results)
        name, spec = resolve_sweep(store, sweep)
        table = read_rows(store, sweep=name, runs=[run] if run else None, newest=run is None and not all_runs)
        if table.num_rows == 0:
            what = (f" for sweep {name!r}" if name else "") + (f" and run {run!r}" if run else "")
            raise InputError(f"no results stored{what}", where=str(store.root))
        lines = summarize(head_rows(table), baseline=baseline or (spec.baseline if spec else None))
        note = left_out(table)
        which = f"run {run}" if run else "every run pooled" if all_runs else "each point's newest run"
        title = f"sweep {name}: {table.num_rows} rows, {which}"
        with destination(output) as stream:
            if fmt is Format.md:
                stream.write(results_markdown(lines, title))
            elif fmt is Format.table:
                out = console(stream)
                layouts = [results_table(lines, title), results_table(lines, title, compact=True)]
                if output is None:
                    print_fitted(out, layouts)
                else:
                    print_wide(out, layouts[0])
                if note:
                    out.print(note)
            else:
                write_table(summary_records(lines), fmt, stream)
        if fmt is not Format.table and note:
            warn(note)
        warn_broken(store.broken)

    @app.command("runs")
    def runs(
        sweep: str | None = typer.Option(None, "--sweep", "-s", help="only this sweep's runs"),
        fmt: Format = format_option("the runs"),
        output: Path | None = output_option(),
        results: Path = results_option(),
    ) -> None:
        """The stored runs, oldest first: when, which sweep, dates, devices, jobs (failed), rows, commits."""
        store = ResultStore(results)
        name = resolve_sweep(store, sweep)[0] if sweep else None
        table = stored_runs(store, name)
        with destination(output) as stream:
            write_table(table, fmt, stream, title=f"runs in {store.root}")
        warn_broken(store.broken)
