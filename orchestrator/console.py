"""Terminal output: rich tables and live progress on a terminal, plain lines otherwise.

Everything printed is data (sweep and parameter names, a benchmark's stderr, host errors), so
the console reads no Rich markup and no emoji codes: `[/]` or `:x:` in data is printed as is,
never a `MarkupError` or a dropped word. `plain` makes text safe for a renderable that parses
markup on its own (a progress column's description).
"""

from __future__ import annotations

import sys

from rich.console import Console
from rich.table import Table
from rich.text import Text

from orchestrator.summary import ArmSummary, format_value


def console() -> Console:
    """The console for stdout; plain (no colour, no live display) when not a terminal."""
    tty = sys.stdout.isatty()
    return Console(
        highlight=False,
        markup=False,
        emoji=False,
        soft_wrap=not tty,
        force_terminal=None if tty else False,
        width=None if tty else 200,
    )


def plain(text: object) -> Text:
    """`text` as a Rich `Text` that no markup or emoji parsing touches."""
    return Text(str(text))


def summary_table(lines: list[ArmSummary], baseline: str | None, title: str) -> Table:
    """The `orchestrate results` table."""
    table = Table(title=title, title_justify="left")
    for name in ("device", "backend", "case", "params", "arm", "metric", "median", "IQR %", "n"):
        table.add_column(name, justify="right" if name in ("median", "IQR %", "n") else "left")
    table.add_column(f"vs {baseline}" if baseline else "vs baseline", justify="right")
    for s in lines:
        ratio = "" if s.vs_baseline is None else f"{s.vs_baseline:.3f}x"
        table.add_row(
            s.device,
            s.backend,
            s.case,
            s.params,
            s.arm,
            s.metric,
            format_value(s.median, s.unit),
            f"{s.spread_pct:.1f}",
            str(s.n),
            ratio,
        )
    return table
