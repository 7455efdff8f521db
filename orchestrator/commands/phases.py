"""`orchestrate phases`: where each stored job's time went (from the fragments' footers)."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.table import Table

from orchestrator.commands.options import results_option
from orchestrator.commands.run import results_root
from orchestrator.console import console
from orchestrator.errors import InputError
from orchestrator.store import ResultStore
from orchestrator.timing import LABELS, MEASURED, job_phases_table, label

ORDER = tuple(LABELS)  # phases in the order a job goes through them


def register(app: typer.Typer) -> None:
    @app.command("phases")
    def phases(
        sweep: str | None = typer.Option(None, "--sweep", "-s", help="only this sweep"),
        run: str | None = typer.Option(None, "--run", help="only this run id"),
        results_dir: Path = results_option(),
    ) -> None:
        """Per stored job: its wall time and the seconds of each phase (timed samples, reference check, ...)."""
        store = ResultStore(results_root(results_dir))
        jobs = job_phases_table(store, sweep, run)
        if not jobs:
            raise InputError("no jobs stored" + (f" for sweep {sweep!r}" if sweep else ""), where=str(store.root))
        seen = {name for job in jobs for name, v in job.phases.items() if v >= 0.005}
        shown = [p for p in ORDER if p in seen] + sorted(seen - set(ORDER))
        table = Table(title=f"phases of {len(jobs)} jobs (seconds)", title_justify="left")
        for name in ("device", "job", "total", *(label(p) for p in shown), "timed %"):
            table.add_column(name, justify="left" if name in ("device", "job") else "right")
        for job in sorted(jobs, key=lambda j: -j.seconds):
            measured = sum(job.phases.get(p, 0.0) for p in MEASURED)
            total = sum(job.phases.values())
            share = f"{100.0 * measured / total:.0f}" if total else "-"
            cells = (f"{job.phases.get(p, 0.0):.2f}" for p in shown)
            table.add_row(job.device, job.job_key, f"{total:.2f}", *cells, share)
        console().print(table)
