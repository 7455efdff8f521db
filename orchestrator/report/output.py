"""Where and how a command's data goes: `--format table|md|csv|json` and `--output FILE`.

Tables go through Rich (on the console, or as plain text into a file), Markdown through tabulate
(GitHub pipe tables, `|` escaped), CSV and JSON through DuckDB's writers from an Arrow table
(typed numbers, empty CSV cells and JSON nulls for missing values, one JSON array of records).
A file named with `--output` is written whole or not at all (`workers.files.atomic_file`).
"""

from __future__ import annotations

import json
import math
import sys
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from enum import StrEnum
from pathlib import Path
from typing import IO, Any

import pyarrow as pa
from rich.console import Console

from orchestrator.errors import InputError
from orchestrator.report.console import console, grid, print_wide
from workers.files import atomic_file


class Format(StrEnum):
    """The formats every data-printing command offers."""

    table = "table"
    md = "md"
    csv = "csv"
    json = "json"


@contextmanager
def destination(output: Path | None) -> Iterator[IO[str]]:
    """A text stream for the command's output: stdout, or a temp file renamed onto `output` when done."""
    if output is None:
        yield sys.stdout
        sys.stdout.flush()
        return
    parent = output.parent if str(output.parent) else Path(".")
    if not parent.is_dir():
        raise InputError("the directory of --output does not exist", where=str(output))
    with atomic_file(output, text=True) as fh:
        yield fh


def output_console(stream: IO[str]) -> Console:
    """The console a table is printed on: the terminal's, or plain text for a file."""
    return console(stream)


def markdown(headers: Sequence[str], rows: Sequence[Sequence[Any]], numeric: Sequence[bool] | None = None) -> str:
    """A GitHub pipe table, columns aligned, `|` in cells escaped."""
    from tabulate import tabulate  # the writers' libraries are imported by the format that uses them

    def cell(value: Any) -> str:
        return ("" if value is None else str(value)).replace("|", "\\|").replace("\n", " ")

    align = ["right" if n else "left" for n in numeric] if numeric is not None else None
    return tabulate(
        [[cell(v) for v in r] for r in rows],
        headers=[cell(h) for h in headers],
        tablefmt="github",
        colalign=align,
        disable_numparse=True,
    )


def finite_or_null(table: pa.Table) -> pa.Table:
    """NaN and infinities as nulls (JSON has no NaN; a CSV reader would read `nan` as text)."""
    import pyarrow.compute as pc  # kept out of the query verb's start (tests/orchestrator/test_cli.py)

    for i, f in enumerate(table.schema):
        if pa.types.is_floating(f.type):
            col = table.column(i)
            table = table.set_column(i, f, pc.if_else(pc.is_finite(col), col, pa.scalar(None, f.type)))
    return table


def write_records(table: pa.Table, fmt: Format, stream: IO[str]) -> None:
    """An Arrow table as CSV (header, empty cells for nulls) or a JSON array of records, by DuckDB."""
    import duckdb  # DuckDB: only for the CSV and JSON formats

    options = "FORMAT csv, HEADER true" if fmt is Format.csv else "FORMAT json, ARRAY true"
    con = duckdb.connect()
    con.execute("SET TimeZone = 'UTC'")
    con.register("records", finite_or_null(table))
    with tempfile.TemporaryDirectory(prefix="orchestrate-out-") as tmp:
        path = Path(tmp) / f"records.{fmt.value}"
        con.execute(f"COPY records TO '{path}' ({options})")
        text = path.read_text(encoding="utf-8")
    con.close()
    stream.write(text if text.endswith("\n") else text + "\n")


def plain_cell(value: Any) -> str:
    """A generic cell for tables of arbitrary query results: numbers compact, maps and lists as JSON."""
    if value is None:
        return ""
    if isinstance(value, float):
        return "nan" if math.isnan(value) else f"{value:.6g}"
    if isinstance(value, list) and value and all(isinstance(v, tuple) and len(v) == 2 for v in value):
        value = dict(value)  # a map, as pyarrow gives it
    if isinstance(value, dict | list):
        return json.dumps(value, default=str)
    return str(value)


def write_table(
    table: pa.Table, fmt: Format, stream: IO[str], *, title: str | None = None, max_rows: int = 1000
) -> None:
    """Any Arrow table in any format: a terminal table (the first `max_rows` rows), Markdown, CSV or JSON."""
    if fmt in (Format.csv, Format.json):
        write_records(table, fmt, stream)
        return
    numeric = [pa.types.is_integer(f.type) or pa.types.is_floating(f.type) for f in table.schema]
    shown = table.slice(0, max_rows) if fmt is Format.table else table
    columns = [c.to_pylist() for c in shown.columns]
    rows = [[plain_cell(v) for v in row] for row in zip(*columns, strict=True)] if columns else []
    if fmt is Format.md:
        stream.write(markdown(table.column_names, rows, numeric) + "\n")
        return
    out = output_console(stream)
    rendered = grid(title, table.column_names, rows, numeric)
    if stream.isatty():
        out.print(rendered)
    else:
        print_wide(out, rendered)
    if table.num_rows > len(rows):
        out.print(f"... {table.num_rows - len(rows)} more rows (all of them: --format csv --output FILE)")
    out.print(f"({table.num_rows} rows)")
