"""The terminal: a console that fits it, tables that fit the console, verdicts in colour.

Width: `$COLUMNS` when set, else the terminal's, else 120 columns when the output is a file or a
pipe. Colour only on a terminal (and never with `$NO_COLOR`). `fit` picks the first of several
renderings of a table that fits the width; `--wide` prints one at its natural width instead.

Everything printed is data (sweep and parameter names, a benchmark's stderr, host errors), so
the console reads no Rich markup and no emoji codes: `[/]` or `:x:` in data is printed as is,
never a `MarkupError` or a dropped word. `plain` makes text safe for a renderable that parses
markup on its own (a progress column's description).
"""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Sequence
from typing import IO

from rich import box
from rich.console import Console, RenderableType
from rich.measure import Measurement
from rich.table import Table
from rich.text import Text

PIPE_WIDTH = 120
VERDICT_STYLES = {
    "FASTER": "bold green",
    "LOWER": "bold green",
    "SLOWER": "bold red",
    "HIGHER": "bold red",
    "AMBIGUOUS": "yellow",
    "TOO FEW": "yellow",
    "SAME": "dim",
    "PASS": "bold green",
    "FAIL": "bold red",
    "MISSING": "yellow",
    "SKIPPED": "dim",
    "regression": "bold red",
    "improvement": "bold green",
    "unclear": "yellow",
    "environment": "yellow",
}


def terminal_width(file: IO[str] | None = None) -> int:
    """`$COLUMNS`, else the terminal's width, else `PIPE_WIDTH`."""
    columns = os.environ.get("COLUMNS", "")
    if columns.isdigit() and int(columns) > 0:
        return int(columns)
    stream = file or sys.stdout
    if stream.isatty():
        return shutil.get_terminal_size((PIPE_WIDTH, 24)).columns
    return PIPE_WIDTH


def console(file: IO[str] | None = None, *, stderr: bool = False) -> Console:
    """A console on stdout (or `file`, or stderr) as wide as `terminal_width` says; colour only on a terminal."""
    stream = file or (sys.stderr if stderr else sys.stdout)
    tty = stream.isatty()
    return Console(
        file=stream,
        width=terminal_width(stream),
        highlight=False,
        soft_wrap=False,
        force_terminal=None if tty else False,
        no_color=not tty or "NO_COLOR" in os.environ,
        emoji=False,
        markup=False,
    )


def plain(text: object) -> Text:
    """`text` as a Rich `Text` that no markup or emoji parsing touches."""
    return Text(str(text))


def natural_width(out: Console, renderable: RenderableType) -> int:
    """The columns a renderable takes when nothing is folded."""
    return Measurement.get(out, out.options.update_width(100_000), renderable).maximum


def fit(out: Console, candidates: Sequence[RenderableType]) -> RenderableType:
    """The first candidate that fits the console's width (the last one when none does)."""
    for candidate in candidates:
        if natural_width(out, candidate) <= out.width:
            return candidate
    return candidates[-1]


def print_fitted(out: Console, candidates: Sequence[RenderableType]) -> None:
    """Print the first candidate that fits the console; when none does, the last at its natural
    width: a cell is never cut short (`affine-unsor...`, `x0.7...`)."""
    print_wide(out, fit(out, candidates))


def print_wide(out: Console, renderable: RenderableType) -> None:
    """Print at the renderable's natural width, widening the console rather than folding cells (`--wide`)."""
    width = out.width
    out.width = max(width, natural_width(out, renderable))
    try:
        out.print(renderable)
    finally:
        out.width = width


def verdict_text(label: str, text: str | None = None) -> Text:
    """`text` (default: the label) styled by the verdict it carries."""
    return Text(text if text is not None else label, style=VERDICT_STYLES.get(label, ""))


def grid(
    title: str | None, headers: Sequence[str], rows: Sequence[Sequence[str | Text]], numeric: Sequence[bool]
) -> Table:
    """A compact table: one header line per column, no outer box, cells never wrapped."""
    table = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False)
    for head, right in zip(headers, numeric, strict=True):
        table.add_column(head, justify="right" if right else "left", no_wrap=True)
    for cells in rows:
        table.add_row(*(c if isinstance(c, Text) else Text(c) for c in cells))
    return table


def warn(message: str) -> None:
    """One warning line on stderr."""
    print(f"orchestrate: warning: {message}", file=sys.stderr, flush=True)


def warn_broken(broken: Sequence[tuple[object, str]]) -> None:
    """One warning per file a read skipped."""
    for path, reason in broken:
        warn(f"skipped unreadable file {path}: {reason} (`orchestrate compact` sets it aside)")
