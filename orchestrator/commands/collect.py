"""`orchestrate collect`: fetch rows that workers spooled but the head never stored."""

from __future__ import annotations

from pathlib import Path

import typer

from orchestrator.commands.options import results_option
from orchestrator.commands.run import results_root
from orchestrator.errors import InfrastructureError
from orchestrator.report.console import console
from orchestrator.specs.sweep import load_inventory
from orchestrator.store.fragments import ResultStore


def register(app: typer.Typer) -> None:
    @app.command("collect")
    def collect(
        inventory: Path = typer.Option(..., "--inventory", "-i", help="host inventory TOML"),
        results: Path = results_option(),
    ) -> None:
        """Copy each host's spooled fragments that are missing from the results store into it."""
        from orchestrator.cluster.collect import collect_spooled  # SSH: imported only when collecting

        inv = load_inventory(inventory)
        store = ResultStore(results_root(results))
        out = console()
        found = collect_spooled(inv, store)
        for host in found:
            line = f"{host.name}: {host.spooled} spooled, {len(host.fetched)} fetched"
            out.print(line + (f" (error: {host.error})" if host.error else ""))
        total = sum(len(h.fetched) for h in found)
        out.print(f"collected {total} fragments into {store.root}")
        failed = [h for h in found if h.error]
        if failed:
            raise InfrastructureError(f"could not collect from {', '.join(h.name for h in failed)}")
