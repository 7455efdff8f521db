"""`orchestrate schedule add|list|remove|run-now`: nightly sweeps with regression checks."""

from __future__ import annotations

from enum import StrEnum
from pathlib import Path

import typer
from rich.table import Table

from orchestrator.analysis.history import THRESHOLD, WINDOW
from orchestrator.commands.options import compact_after_option, no_compact_option, results_option
from orchestrator.commands.run import results_root
from orchestrator.report.console import console
from orchestrator.run.nightly import run_now
from orchestrator.run.schedules import (
    Schedule,
    add_schedule,
    check_name,
    choose_backend,
    cron_expression,
    list_schedules,
    remove_schedule,
)
from orchestrator.specs.checks import check_sweep_against_inventory
from orchestrator.specs.sweep import load_inventory, load_sweep, resolve_sweep_path


class Scheduler(StrEnum):
    """What installs a schedule."""

    auto = "auto"
    systemd = "systemd"
    cron = "cron"


BACKEND = typer.Option(
    Scheduler.auto, "--backend", case_sensitive=False, help="what installs it: systemd where it runs, else cron"
)
CRONTAB_FILE = typer.Option(
    None, "--crontab-file", envvar="ORCHESTRATE_CRONTAB_FILE", help="edit this crontab file, not `crontab`"
)
UNIT_DIR = typer.Option(None, "--unit-dir", envvar="ORCHESTRATE_SYSTEMD_UNIT_DIR", help="systemd user unit dir")


def register(app: typer.Typer) -> None:
    group = typer.Typer(help="Nightly sweeps: install, list, remove, run now.", no_args_is_help=True)
    app.add_typer(group, name="schedule")

    @group.command("add")
    def add(
        name: str = typer.Argument(..., help="schedule name"),
        sweep: str = typer.Option(..., "--sweep", "-s", help="built-in sweep name or sweep TOML path"),
        inventory: Path | None = typer.Option(None, "--inventory", "-i", help="host inventory (default: this machine)"),
        at: str = typer.Option("02:00", "--at", help="HH:MM daily, or five cron fields"),
        results: Path = results_option(),
        window: int = typer.Option(WINDOW, "--window", min=2, help="nights that estimate the night-to-night noise"),
        threshold: float = typer.Option(THRESHOLD, "--threshold", min=0.0, help="smallest change that counts"),
        backend: Scheduler = BACKEND,
        crontab_file: Path | None = CRONTAB_FILE,
        unit_dir: Path | None = UNIT_DIR,
        compact_after: int = compact_after_option(),
        no_compact: bool = no_compact_option(),
    ) -> None:
        """Install a nightly run of a sweep, compared with its history after each run."""
        cron = cron_expression(at)
        check_name(name)
        spec = load_sweep(sweep)  # refuse a bad file now, not at 02:00
        check_sweep_against_inventory(spec, load_inventory(inventory), str(resolve_sweep_path(sweep)))
        sched = Schedule(
            name=name,
            sweep=str(resolve_sweep_path(sweep).resolve()),
            inventory=str(inventory.resolve()) if inventory else None,
            results=str(results_root(results).resolve()),
            at=at,
            cron=cron,
            window=window,
            threshold=threshold,
            workdir=str(Path.cwd()),
            compact_after=None if no_compact else compact_after,
        )
        chosen = choose_backend(backend, crontab_file=crontab_file, unit_dir=unit_dir)
        where = add_schedule(sched, chosen)
        console().print(f"schedule {name}: {chosen.kind} ({cron}) -> {where}")

    @group.command("list")
    def list_(
        backend: Scheduler = BACKEND, crontab_file: Path | None = CRONTAB_FILE, unit_dir: Path | None = UNIT_DIR
    ) -> None:
        """List the schedules and whether each is installed."""
        chosen = choose_backend(backend, crontab_file=crontab_file, unit_dir=unit_dir)
        installed = chosen.installed()
        schedules = list_schedules()
        grid = Table(title=f"schedules ({chosen.kind})", title_justify="left")
        for column in ("name", "when", "state", "sweep", "inventory", "results"):
            grid.add_column(column)
        for s in schedules:
            state = "installed" if s.name in installed else "NOT installed"
            grid.add_row(s.name, s.cron, state, s.sweep, s.inventory or "local", s.results)
        for name in sorted(set(installed) - {s.name for s in schedules}):
            grid.add_row(name, "?", "installed, no record", "", "", "")
        console().print(grid if grid.rows else "no schedules")

    @group.command("remove")
    def remove(
        name: str = typer.Argument(..., help="schedule name"),
        backend: Scheduler = BACKEND,
        crontab_file: Path | None = CRONTAB_FILE,
        unit_dir: Path | None = UNIT_DIR,
    ) -> None:
        """Uninstall a schedule."""
        remove_schedule(name, choose_backend(backend, crontab_file=crontab_file, unit_dir=unit_dir))
        console().print(f"schedule {name}: removed")

    @group.command("run-now")
    def run_now_(name: str = typer.Argument(..., help="schedule name")) -> None:
        """Run a schedule's sweep now and compare it with the history.

        Exit 1 on a regression or a failed job, 4 when a series was measured only under contention.
        """
        result = run_now(name)
        out = console()
        assert result.report is not None
        out.print(result.report.read_text())
        out.print(f"report: {result.report}")
        if result.compacted:
            out.print(result.compacted)
        if result.regressions:
            out.print(f"REGRESSION: {len(result.regressions)} series regressed in run {result.run_id}")
        elif result.contended:
            out.print(f"NOT JUDGED: {len(result.contended)} series were measured only under contention")
        raise typer.Exit(result.exit_code)
