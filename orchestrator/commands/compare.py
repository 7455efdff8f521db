"""`orchestrate compare`: each point's arms (or runs, commits, devices) against a baseline, with verdicts.

By default the table shows prefill and decode tok/s, peak memory and load time where a case
measures them (`--metric` picks others), every arm in the sweep's order (`--arms` some, in the
order given), and the cross-device share-of-peak view only when the rows span several devices (or
`--view devices`). The table fits the terminal; `--wide` shows every column at any width.
"""

from __future__ import annotations

from pathlib import Path

import typer

from orchestrator.analysis import stats
from orchestrator.analysis.cross_device import cross_device
from orchestrator.analysis.selection import compare_stored, select_results
from orchestrator.analysis.shortfall import shortfall_lines
from orchestrator.commands.options import (
    By,
    View,
    format_option,
    list_option,
    output_option,
    results_option,
    split_list,
    sweep_option,
)
from orchestrator.errors import InputError
from orchestrator.report.console import console, warn, warn_broken
from orchestrator.report.cross import print_cross, write_cross
from orchestrator.report.output import Format, destination
from orchestrator.report.text import print_comparison, write_comparison
from orchestrator.store.fragments import ResultStore


def register(app: typer.Typer) -> None:
    @app.command("compare")
    def compare(
        sweep: str | None = sweep_option(),
        run: str | None = typer.Option(
            None, "--run", metavar="RUN", help="only this run id (default: each point's newest run)"
        ),
        by: By = typer.Option(By.arm, "--by", case_sensitive=False, help="what is put side by side"),
        baseline: str | None = typer.Option(
            None,
            "--baseline",
            "-b",
            metavar="SIDE",
            help="the side the others are compared with: an arm, or with --by run|commit|device a run id, commit "
            "or device kind (a unique prefix will do; default: the sweep's baseline arm, the oldest run)",
        ),
        contender: list[str] | None = list_option("--contender", "only these sides against the baseline", "-c", "SIDE"),
        metric: list[str] | None = list_option("--metric", "only these metrics, e.g. seconds,gb_per_s", "-m", "METRIC"),
        arms: list[str] | None = list_option(
            "--arms", "only these arms, in this order, e.g. native,affine", None, "ARM"
        ),
        threshold: float = typer.Option(stats.THRESHOLD, "--threshold", help="smallest relative change that counts"),
        only_changed: bool = typer.Option(False, "--only-changed", help="hide what is SAME within the threshold"),
        all_runs: bool = typer.Option(False, "--all-runs", help="pool samples of every run, not the newest"),
        view: View = typer.Option(View.arms, "--view", case_sensitive=False, help="arms, or devices: share of peak"),
        wide: bool = typer.Option(False, "--wide", help="every column and interval, however wide the table"),
        fmt: Format = format_option("the comparison"),
        output: Path | None = output_option(),
        results: Path = results_option(),
    ) -> None:
        """Per point and device: each arm's medians, the gap to the baseline with its interval and verdict."""
        if not 0 < threshold < 1:
            raise InputError(f"--threshold {threshold}: expected a fraction between 0 and 1, e.g. 0.03")
        if run is not None and by is By.run:
            raise InputError("--run and --by run: name the runs with --baseline RUN --contender RUN instead")
        store = ResultStore(results)
        metrics = split_list(metric)
        if view is View.devices:
            table, _ = select_results(store, sweep, run, all_runs=all_runs, say=warn)
            cross = cross_device(table)
            if not cross:
                raise InputError("no GB/s or TFLOP/s rows to put against device peaks")
            with destination(output) as stream:
                if fmt is Format.table:
                    print_cross(console(stream), cross, wide=wide or output is not None)
                else:
                    write_cross(cross, fmt, stream)
            warn_broken(store.broken)
            return
        result, table, _ = compare_stored(
            store,
            sweep=sweep,
            run=run,
            by=by.value,
            baseline=baseline,
            contenders=split_list(contender),
            arms=split_list(arms),
            metrics=metrics,
            threshold=threshold,
            all_runs=all_runs,
            say=warn,
        )
        several = fmt in (Format.table, Format.md) and len(set(table["device"].to_pylist())) > 1
        cross = cross_device(table) if several else []  # CSV and JSON records carry no share-of-peak view
        with destination(output) as stream:
            if fmt is Format.table:
                print_comparison(
                    console(stream), result, cross, metrics, wide=wide or output is not None, only_changed=only_changed
                )
            else:
                write_comparison(
                    result, fmt, stream, cross if fmt is Format.md else None, metrics, only_changed=only_changed
                )
            if fmt in (Format.table, Format.md):
                for line in shortfall_lines(table, result.varying):
                    stream.write(line + "\n")
        if fmt in (Format.csv, Format.json):  # the records carry the verdicts; what the legend says goes to stderr
            if result.left_out:
                warn(f"left out, no clean sample: {'; '.join(result.left_out)}")
            for line in result.heavy_tails:
                warn(f"heavy tails: {line}")
            for line in shortfall_lines(table, result.varying):
                warn(line)
        warn_broken(store.broken)
