"""`orchestrate run`: expand a sweep into jobs, run them on Ray, store the rows, print the comparison."""

from __future__ import annotations

import typer


def register(app: typer.Typer) -> None:
    @app.command("run")
    def run() -> None:
        """Run a sweep (being written)."""
        raise typer.Exit(3)
