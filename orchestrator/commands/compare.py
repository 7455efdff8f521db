"""`orchestrate compare`: the seeds' comparison table for any stored sweep.

By default the table shows prefill and decode tok/s, peak memory and load time where a case
measures them (`--metric` picks others), every arm (`--arms` some, in the given order), and the
cross-device share-of-peak view only when the rows span several devices (or `--view devices`).
"""

from __future__ import annotations

from pathlib import Path

import typer

from orchestrator import stats
from orchestrator.commands.run import results_root
from orchestrator.compare import compare_results, cross_device, select_results
from orchestrator.compare_render import (
    FORMATS,
    print_comparison,
    print_cross,
    render_cross_text,
    render_text,
)
from orchestrator.console import console
from orchestrator.errors import InputError
from orchestrator.store import ResultStore

VIEWS = ("arms", "devices")


def register(app: typer.Typer) -> None:
    @app.command("compare")
    def compare(
        sweep: str | None = typer.Option(None, "--sweep", "-s", help="stored sweep name, built-in sweep or TOML"),
        run: str | None = typer.Option(None, "--run", help="only this run id"),
        fmt: str = typer.Option("table", "--format", "-f", help="table, md, csv or json"),
        by: str = typer.Option("arm", "--by", help="what is compared: arm, run, commit or device"),
        baseline: str | None = typer.Option(None, "--baseline", help="the side compared with (default: sweep's)"),
        threshold: float = typer.Option(stats.THRESHOLD, "--threshold", help="smallest relative change that counts"),
        view: str = typer.Option("arms", "--view", help="arms (the seeds' table) or devices (share of peak)"),
        metric: list[str] | None = typer.Option(
            None, "--metric", "-m", help="show this metric (repeatable): seconds, gb_per_s, tflop_per_s, rel_error..."
        ),
        arms: str | None = typer.Option(None, "--arms", help="only these arms, comma-separated, e.g. native,affine"),
        all_runs: bool = typer.Option(False, "--all-runs", help="pool samples of every run, not the newest"),
        results_dir: Path | None = typer.Option(None, "--results", "-r", help="results directory (default ./results)"),
    ) -> None:
        """Per point and device: each arm's medians, the gap to the baseline with its interval and verdict."""
        if fmt not in FORMATS:
            raise InputError(f"--format {fmt!r}: expected one of {', '.join(FORMATS)}")
        if view not in VIEWS:
            raise InputError(f"--view {view!r}: expected one of {', '.join(VIEWS)}")
        if not 0 < threshold < 1:
            raise InputError(f"--threshold {threshold}: expected a fraction between 0 and 1, e.g. 0.03")
        store = ResultStore(results_root(results_dir))
        table, spec = select_results(store, sweep, run, all_runs=all_runs or by in ("run", "commit"))
        arm_list = [a.strip() for a in arms.split(",") if a.strip()] if arms else None
        metrics = list(dict.fromkeys(metric)) if metric else None
        out = console()
        if view == "devices":
            cross = cross_device(table)
            if not cross:
                raise InputError("no GB/s or TFLOP/s rows to put against device peaks")
            if fmt == "table":
                print_cross(out, cross)
            else:
                print(render_cross_text(cross, fmt), end="")
            return
        preferred = baseline or (spec.baseline if spec is not None and by == "arm" else None)
        if baseline is None and arm_list and preferred not in arm_list:
            preferred = None  # the sweep's baseline is left out: `affine` or the first of --arms
        result = compare_results(table, by=by, baseline=preferred, threshold=threshold, arms=arm_list, metrics=metrics)
        cross = cross_device(table) if len(set(table["device"].to_pylist())) > 1 else []
        if fmt == "table":
            print_comparison(out, result, cross, metrics)
        else:
            print(render_text(result, fmt, cross, metrics), end="")
        for path, reason in store.broken:
            out.print(f"warning: skipped broken fragment {path}: {reason}")
