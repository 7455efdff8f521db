"""Data printed through the console is never read as Rich markup or emoji codes."""

from __future__ import annotations

import io

from rich.table import Table

from orchestrator.report.console import console, plain


def test_markup_and_emoji_codes_in_data_print_as_written() -> None:
    out = console()
    out.file = io.StringIO()
    data = "[/] boom [bold]loud[/bold] v[/x] :thumbs_up: [red]"
    out.print(data)  # a benchmark's stderr: MarkupError before
    table = Table("params")
    table.add_row("tag=v[/x]")
    out.print(table)
    out.print(plain(data))
    text = out.file.getvalue()
    assert text.count(data) == 2 and "tag=v[/x]" in text
