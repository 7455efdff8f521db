"""`orchestrate phases`: where each stored job's time went (from the fragments' footers)."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.table import Table

from orchestrator.commands.options import results_option
from orchestrator.commands.run import results_root
from orchestrator.errors import InputError
from orchestrator.report.console import console
from orchestrator.run.account import LABELS, MEASURED, WARMED, job_labels, job_phases_table, label
from orchestrator.store.fragments import ResultStore

ORDER = tuple(LABELS)  # phases in the order a job goes through them


def register(app: typer.Typer) -> None:
    @app.command("phases")
    def phases(
        sweep: str | None = typer.Option(None, "--sweep", "-s", help="only this sweep"),
        run: str | None = typer.Option(None, "--run", help="only this run id"),
        results_dir: Path = results_option(),
    ) -> None:
        """Per stored job: its wall time and the seconds of each phase (timed samples, reference check, ...).

        Each job is named by its case and the parameters that tell it apart (`qmm tokens=512`), with
        the first characters of its key; the last columns are the shares of its wall time in timed
        samples (and measured cold loads), and in those with the warm-up."""
        store = ResultStore(results_root(results_dir))
        jobs = job_phases_table(store, sweep, run)
        if not jobs:
            raise InputError("no jobs stored" + (f" for sweep {sweep!r}" if sweep else ""), where=str(store.root))
        seen = {name for job in jobs for name, v in job.phases.items() if v >= 0.005}
        shown = [p for p in ORDER if p in seen] + sorted(seen - set(ORDER))
        labels = job_labels(store, sweep, run)
        table = Table(title=f"phases of {len(jobs)} jobs (seconds)", title_justify="left")
        widest = max((len(v) for v in labels.values()), default=3)
        for name in ("device", "job", "key", "total", *(label(p) for p in shown), "timed %", "warm-up + timed %"):
            if name == "job":  # whole, on one line: the name is what the row is read by
                table.add_column(name, no_wrap=True, min_width=min(widest, 40))
            else:
                table.add_column(name, justify="left" if name in ("device", "key") else "right")
        for job in sorted(jobs, key=lambda j: -j.seconds):
            total = sum(job.phases.values())
            shares = (
                f"{100.0 * sum(job.phases.get(p, 0.0) for p in part) / total:.0f}" if total else "-"
                for part in (MEASURED, WARMED)
            )
            cells = (f"{job.phases.get(p, 0.0):.2f}" for p in shown)
            what = labels.get((job.run_id, job.job_key), "?")
            table.add_row(job.device, what, job.job_key[:8], f"{total:.2f}", *cells, *shares)
        console().print(table)
