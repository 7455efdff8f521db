"""`orchestrate results` and `orchestrate query`."""

from __future__ import annotations

import typer


def register(app: typer.Typer) -> None:
    @app.command("results")
    def results() -> None:
        """Summarise stored results (being written)."""
        raise typer.Exit(3)
