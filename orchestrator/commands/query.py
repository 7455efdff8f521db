"""`orchestrate query`: read-only DuckDB SQL over the result dataset (see `orchestrator.store.query`).

Its own module, so that a query (a count over a year of results) starts with DuckDB and the
output's writers alone, not the comparison's statistics or the sweep files' models.
"""

from __future__ import annotations

from pathlib import Path

import typer

from orchestrator.commands.options import format_option, output_option, results_option
from orchestrator.report.console import warn_broken
from orchestrator.report.output import Format, destination, write_table
from orchestrator.store.fragments import ResultStore
from orchestrator.store.query import run_query


def register(app: typer.Typer) -> None:
    @app.command("query")
    def query(
        sql: str = typer.Argument(..., help="one read-only SQL statement over the table `results`"),
        fmt: Format = format_option("the result"),
        output: Path | None = output_option(),
        results: Path = results_option(),
    ) -> None:
        """Run read-only DuckDB SQL over the result dataset (table `results`; COPY, ATTACH, SET ... are refused)."""
        store = ResultStore(results)
        table = run_query(store, sql)
        with destination(output) as stream:
            write_table(table, fmt, stream)
        warn_broken(store.broken)
