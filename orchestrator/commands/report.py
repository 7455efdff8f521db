"""`orchestrate report --html FILE`: one self-contained HTML report of a stored sweep."""

from __future__ import annotations

from pathlib import Path

import typer

from orchestrator.analysis import stats
from orchestrator.analysis.selection import select_results
from orchestrator.commands.options import results_option
from orchestrator.commands.run import results_root
from orchestrator.report.console import console, warn, warn_broken
from orchestrator.store.dataset import read_rows
from orchestrator.store.fragments import ResultStore


def register(app: typer.Typer) -> None:
    @app.command("report")
    def report(
        html: Path = typer.Option(..., "--html", help="the HTML file to write"),
        sweep: str | None = typer.Option(None, "--sweep", "-s", help="stored sweep name, built-in sweep or TOML"),
        run: str | None = typer.Option(None, "--run", help="only this run id"),
        threshold: float = typer.Option(stats.THRESHOLD, "--threshold", help="smallest relative change that counts"),
        all_runs: bool = typer.Option(False, "--all-runs", help="pool samples of every run, not the newest"),
        results_dir: Path = results_option(),
    ) -> None:
        """Per device the criteria and main comparison first, then tables and charts; peak shares, history, hosts."""
        from orchestrator.report.html import build_report, write_report  # matplotlib: only when reporting

        store = ResultStore(results_root(results_dir))
        table, spec = select_results(store, sweep, run, all_runs=all_runs, say=warn)
        # The trend charts need every stored run of the sweep, not only the newest one per point.
        history = read_rows(store, sweep=table["sweep"][0].as_py()) if run is None and not all_runs else table
        path = write_report(html, build_report(table, spec=spec, threshold=threshold, history=history))
        console().print(f"Report written to {path} ({path.stat().st_size / 1e3:.0f} kB)")
        warn_broken(store.broken)
