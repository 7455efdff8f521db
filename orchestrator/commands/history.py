"""`orchestrate history CASE [--metric M]`: how a case's metric moved across runs, per device and host."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import typer
from rich.table import Table
from rich.text import Text

from orchestrator.analysis.bisection import history_bisect_lines
from orchestrator.analysis.history import RATIO_UNIT, THRESHOLD, WINDOW
from orchestrator.analysis.selection import choose_sweep
from orchestrator.analysis.trends import Trend, default_metric, sparkline, trends
from orchestrator.commands.options import format_option, output_option, results_option
from orchestrator.errors import InputError
from orchestrator.report.console import console, grid, print_fitted, print_wide, verdict_text, warn, warn_broken
from orchestrator.report.output import Format, destination, write_table
from orchestrator.report.units import format_value, unit_of
from orchestrator.store.dataset import read_rows
from orchestrator.store.fragments import ResultStore

HISTORY_SCHEMA = pa.schema(
    [
        pa.field("device", pa.string()),
        pa.field("host", pa.string()),
        pa.field("case", pa.string()),
        pa.field("arm", pa.string()),
        pa.field("params", pa.string()),
        pa.field("metric", pa.string()),
        pa.field("unit", pa.string()),
        pa.field("run_id", pa.string()),
        pa.field("started_at", pa.timestamp("us", tz="UTC")),
        pa.field("commit", pa.string()),
        pa.field("median", pa.float64()),
        pa.field("n", pa.int64()),
        pa.field("verdict", pa.string()),
        pa.field("ratio", pa.float64()),
        pa.field("ci_low", pa.float64()),
        pa.field("ci_high", pa.float64()),
    ]
)


def history_records(items: list[Trend]) -> pa.Table:
    """One record per series and run: its median and the verdict on it (see `HISTORY_SCHEMA`)."""
    recs = []
    for t in items:
        s = t.series
        for p, f in zip(t.points, t.findings, strict=True):
            recs.append(
                {
                    "device": s.device,
                    "host": s.host,
                    "case": s.case_name,
                    "arm": s.arm,
                    "params": s.params,
                    "metric": s.metric,
                    "unit": s.unit,
                    "run_id": p.run_id,
                    "started_at": p.started_at,
                    "commit": p.commit,
                    "median": p.median,
                    "n": len(p.values),
                    "verdict": f.verdict,
                    "ratio": f.ratio,
                    "ci_low": f.ci_low,
                    "ci_high": f.ci_high,
                }
            )
    return pa.Table.from_pylist(recs, schema=HISTORY_SCHEMA)


def history_table(items: list[Trend], title: str, *, compact: bool = False) -> Table:
    """One line per series: runs, first and latest median, change, a sparkline, the flagged runs.

    `compact` leaves out the first median and the sparkline (for a narrow terminal).
    """
    heads = ["device", "host", "arm", "params", "runs", "first", "latest", "change", "trend", "flagged"]
    rows = []
    for t in items:
        first, last = t.points[0].median, t.points[-1].median
        unit = t.series.unit if t.series.unit == RATIO_UNIT else unit_of(t.series.metric, t.series.unit)
        flagged = Text(", ").join(
            verdict_text(f.verdict, f"{f.verdict} {(f.since_commit or f.commit or f.run_id)[:10]} x{f.ratio:.3f}")
            for f in t.changes
        )
        rows.append(
            [
                t.series.device,
                t.series.host,
                t.series.arm,
                t.series.params,
                str(len(t.points)),
                format_value(first, unit),
                format_value(last, unit),
                f"{(last / first - 1):+.1%}",
                sparkline([p.median for p in t.points]),
                flagged if t.changes else "-",
            ]
        )
    if compact:
        keep = [i for i, h in enumerate(heads) if h not in ("first", "trend")]
        heads, rows = [heads[i] for i in keep], [[r[i] for i in keep] for r in rows]
    numeric = [h in ("runs", "first", "latest", "change") for h in heads]
    return grid(title, heads, rows, numeric)


def register(app: typer.Typer) -> None:
    @app.command("history")
    def history(
        case: str = typer.Argument(..., help="case name in the sweep (or case kind), e.g. bench-decode, qmm"),
        metric: str | None = typer.Option(None, "--metric", "-m", help="metric (default: decode_tok_s, ...)"),
        sweep: str | None = typer.Option(None, "--sweep", "-s", help="only this sweep's results"),
        png: Path | None = typer.Option(None, "--png", dir_okay=False, help="also draw the trend into this PNG"),
        window: int = typer.Option(WINDOW, "--window", min=2, help="nights that estimate the night-to-night noise"),
        threshold: float = typer.Option(THRESHOLD, "--threshold", min=0.0, help="smallest change that counts"),
        fmt: Format = format_option("the trends"),
        output: Path | None = output_option(),
        results: Path = results_option(),
    ) -> None:
        """Show how a case's metric moved across runs, per device and host, with regressions marked:
        each arm's own series and its ratio to the baseline arm (`native/affine`), which a board's
        clock moves less."""
        store = ResultStore(results)
        if sweep is not None:  # a file's or a stored name; the note says when the two disagree
            choice = choose_sweep(store, sweep)
            sweep = choice.name
            if choice.note:
                warn(choice.note)
        table = read_rows(store, sweep=sweep, cases=[case], metrics=[metric] if metric else None)
        chosen = metric or default_metric(table, case)
        if chosen is None:
            raise InputError(f"no stored rows of case {case!r}", where=str(store.root))
        table = table.filter(pc.equal(table["metric"], chosen))
        items = trends(table, case, chosen, window=window, threshold=threshold)
        if not items:
            raise InputError(f"no clean rows of case {case!r} with metric {chosen!r}", where=str(store.root))
        with destination(output) as stream:
            if fmt is Format.table:
                out = console(stream)
                title = f"history of {case}: {chosen}"
                if output is None:
                    print_fitted(out, [history_table(items, title), history_table(items, title, compact=True)])
                else:
                    print_wide(out, history_table(items, title))
                for line in history_bisect_lines(items, table):
                    out.print(line, markup=False, soft_wrap=True)
            else:
                write_table(history_records(items), fmt, stream)
        if png is not None:
            from orchestrator.report.history import history_png  # matplotlib: only when a chart is asked for

            path = history_png(items, png, f"{case}: {chosen}")
            console(stderr=fmt is not Format.table).print(f"plot: {path}")
        warn_broken(store.broken)
