"""`orchestrate history CASE [--metric M]`: the trend per device, in the terminal and as a PNG."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.table import Table

from orchestrator.commands.run import results_root
from orchestrator.console import console
from orchestrator.errors import InputError
from orchestrator.history import THRESHOLD, WINDOW, default_metric, plot_trends, sparkline, trends
from orchestrator.store import ResultStore


def register(app: typer.Typer) -> None:
    @app.command("history")
    def history(
        case: str = typer.Argument(..., help="case name in the sweep (or case kind), e.g. bench-decode, qmm"),
        metric: str | None = typer.Option(None, "--metric", "-m", help="metric (default: decode_tok_s, ...)"),
        sweep: str | None = typer.Option(None, "--sweep", "-s", help="only this sweep's results"),
        results: Path | None = typer.Option(None, "--results", "-r", help="results directory (default ./results)"),
        png: Path | None = typer.Option(None, "--png", help="where the plot goes (default history-CASE-METRIC.png)"),
        window: int = typer.Option(WINDOW, "--window", min=2, help="nights that estimate the night-to-night noise"),
        threshold: float = typer.Option(THRESHOLD, "--threshold", min=0.0, help="smallest change that counts"),
    ) -> None:
        """Show how a case's metric moved across runs, per device and host, with regressions marked."""
        store = ResultStore(results_root(results))
        table = store.read(sweep=sweep)
        chosen = metric or default_metric(table, case)
        if chosen is None:
            raise InputError(f"no stored rows of case {case!r}", where=str(store.root))
        items = trends(table, case, chosen, window=window, threshold=threshold)
        if not items:
            raise InputError(f"no clean rows of case {case!r} with metric {chosen!r}", where=str(store.root))
        out = console()
        grid = Table(title=f"history of {case}: {chosen}", title_justify="left")
        for name in ("device", "host", "arm", "params", "runs", "first", "latest", "change", "trend", "flagged"):
            grid.add_column(name, justify="right" if name in ("runs", "first", "latest", "change") else "left")
        for t in items:
            first, last = t.points[0].median, t.points[-1].median
            flagged = ", ".join(
                f"{f.verdict} {(f.since_commit or f.commit or f.run_id)[:10]} x{f.ratio:.3f}" for f in t.changes
            )  # fmt: skip
            grid.add_row(t.series.device, t.series.host, t.series.arm, t.series.params,
                         str(len(t.points)), f"{first:.4g}", f"{last:.4g}", f"{(last / first - 1):+.1%}",
                         sparkline([p.median for p in t.points]), flagged or "-")  # fmt: skip
        out.print(grid)
        path = plot_trends(items, png or Path(f"history-{case}-{chosen}.png"), f"{case}: {chosen}")
        out.print(f"plot: {path}")
        for path_, reason in store.broken:
            out.print(f"warning: skipped broken fragment {path_}: {reason}")
