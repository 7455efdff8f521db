"""`orchestrate compact`: merge each partition's job fragments into one file (see `orchestrator.store.compact`)."""

from __future__ import annotations

import datetime as dt
from pathlib import Path

import typer

from orchestrator.commands.options import results_option
from orchestrator.errors import InputError
from orchestrator.report.console import warn
from orchestrator.store.compact import compact
from orchestrator.store.fragments import ResultStore


def register(app: typer.Typer) -> None:
    @app.command("compact")
    def compact_(
        sweep: str | None = typer.Option(None, "--sweep", "-s", help="only this sweep's partitions"),
        before: str | None = typer.Option(
            None, "--before", help="only dates before this one, YYYY-MM-DD (e.g. leave today's running sweep alone)"
        ),
        results: Path = results_option(),
    ) -> None:
        """Merge each (sweep, date, device) partition into one file, atomically; readers see old or new, never both."""
        try:
            cutoff = dt.date.fromisoformat(before) if before else None
        except ValueError:
            raise InputError(f"--before {before!r}: expected a date, YYYY-MM-DD") from None
        store = ResultStore(results)
        if sweep is not None and sweep not in store.sweep_names():
            raise InputError(f"no results stored for sweep {sweep!r}", where=str(store.root))
        report = compact(store, sweep=sweep, before=cutoff, warn=warn)
        print(
            f"compacted {report.partitions} partitions ({report.fragments} fragments merged, {report.migrated} "
            f"migrated from an older schema); {report.unchanged} already compact; "
            f"{len(report.set_aside)} broken files set aside"
        )
