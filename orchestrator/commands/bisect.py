"""`orchestrate bisect`: the first commit of a regression, on hosts of the kind that regressed.

Prints each step as it settles, then the first bad commit (hash, subject, author line), the evidence
table (each tested commit, its ratio to GOOD with the interval, the verdict, the samples), and the
command that reruns it. Exit 0 when it named one commit or found no regression, 1 when it stopped at
a range, 128 + the signal when interrupted (the same command resumes).
"""

from __future__ import annotations

import sys
from pathlib import Path

import typer
from rich.console import Console

from orchestrator.analysis.bisection import StepVerdict, bisect_command
from orchestrator.analysis.selection import choose_sweep
from orchestrator.analysis.stats import THRESHOLD
from orchestrator.commands.options import results_option
from orchestrator.commands.run import ProgressView, parse_duration, results_root
from orchestrator.report.console import console, grid
from orchestrator.run.bisect import Bisection, BisectResult, run_bisect
from orchestrator.run.bisect_kernel import kernel_target
from orchestrator.run.bisect_target import choose_target, commit_range
from orchestrator.specs.sweep import load_inventory, load_sweep
from orchestrator.store.fragments import ResultStore


def print_result(out: Console, result: BisectResult, rerun: str) -> None:
    """The answer, the evidence table and the rerun command."""
    t = result.target
    what = f"{t.metric} of {t.case.label} {t.arm} {t.point_text()} on {t.device}".replace("  ", " ")
    good, bad = result.good[:12], result.bad[:12]
    if result.outcome == "no-regression":
        out.print(
            f"no regression between GOOD {good} and BAD {bad}: {what} within the band", markup=False, soft_wrap=True
        )
    elif result.outcome == "found" and result.first_bad:
        line = result.lines.get(result.first_bad, "")
        out.print(f"first bad commit: {result.first_bad} {line}", markup=False, soft_wrap=True)
        out.print(f"  {what}: BAD / GOOD {result.change:.3f}", markup=False, soft_wrap=True)
    elif result.outcome == "range":
        out.print(
            f"the first bad commit is one of {len(result.candidates)}: {result.reason}", markup=False, soft_wrap=True
        )
        for commit in result.candidates:
            out.print(f"  {commit} {result.lines.get(commit, '')}", markup=False, soft_wrap=True)
    else:
        out.print(f"no answer: {result.reason}", markup=False, soft_wrap=True)
    rows = []
    for step in result.steps:
        verdict = f"{step.verdict} ({step.note})" if step.note else str(step.verdict)
        subject = result.lines.get(step.commit, "").split(" (")[0]
        samples = str(step.evidence.samples) if step.verdict is not StepVerdict.SKIPPED else "-"
        rows.append([step.commit[:12], step.evidence.describe(), verdict, samples, subject])
    headers = ["commit", "ratio to GOOD [95 % CI]", "verdict", "samples", "subject"]
    out.print(grid(f"bisection {result.name} (GOOD {good})", headers, rows, [False, True, False, True, False]))
    out.print(
        f"{result.measured} commits measured, {len(result.steps) - result.measured} skipped, "
        f"in {result.wall_seconds:.1f} s; rows: orchestrate compare --sweep {result.name} --by commit --all-runs",
        markup=False,
        soft_wrap=True,
    )
    out.print(f"rerun: {rerun}", markup=False, soft_wrap=True)


def register(app: typer.Typer) -> None:
    @app.command("bisect")
    def bisect(
        sweep: str = typer.Option(..., "--sweep", "-s", help="a sweep: built-in or stored name, or TOML path"),
        good: str = typer.Option(..., "--good", help="a git ref before the change (the case's repo)"),
        bad: str = typer.Option(..., "--bad", help="a git ref with the change"),
        point: str | None = typer.Option(None, "--point", help="the point to follow, e.g. prompt_tokens=512"),
        case: str | None = typer.Option(None, "--case", help="the command or kernel case (default: the criteria's)"),
        arm: str | None = typer.Option(None, "--arm", help="the arm to follow (default: the criteria's)"),
        metric: str | None = typer.Option(None, "--metric", "-m", help="e.g. decode_tok_s (default: the criteria's)"),
        device: str | None = typer.Option(None, "--device", help="the device kind to measure on"),
        inventory: Path | None = typer.Option(None, "--inventory", "-i", help="host inventory TOML"),
        repo: str | None = typer.Option(
            None,
            "--repo",
            help="kernel cases: this project's repository as hosts reach it (default: this checkout)",
        ),
        results: Path = results_option(),
        budget: str | None = typer.Option(
            None, "--budget", metavar="DURATION", help="the whole bisection's time (90s, 10m, 1h30m)"
        ),
        threshold: float = typer.Option(THRESHOLD, "--threshold", help="smallest relative change that counts"),
        force: bool = typer.Option(False, "--force", help="measure again from the start, not resume"),
    ) -> None:
        """Find the first commit of a regression: each step the midpoint against GOOD, in one lock window."""
        seconds = None if budget is None else parse_duration(budget, "--budget")
        store = ResultStore(results_root(results))
        spec = choose_sweep(store, sweep).spec or load_sweep(sweep)  # a stored name: the definition that ran
        target = choose_target(spec, case=case, point=point, arm=arm, metric=metric, device=device)
        inv = load_inventory(inventory)
        if target.case.case != "command":  # a kernel case: this project's commits
            target = kernel_target(spec, target, inv, repo)
        span = commit_range(target.case, good, bad)
        view = ProgressView()
        out = console()
        job = Bisection(spec, target, span, inv, store, threshold, seconds, view,
                        say=lambda line: out.print(line, markup=False, soft_wrap=True))  # fmt: skip
        try:
            result = run_bisect(job, fresh=force)
        finally:
            view.close()
        if result.interrupted:
            print(f"interrupted: run the same command to resume {result.name}", file=sys.stderr, flush=True)
            raise typer.Exit(128 + result.interrupted)
        more = {"case": case, "repo": repo, "inventory": str(inventory) if inventory else None, "budget": budget,
                "threshold": None if threshold == THRESHOLD else str(threshold), "results": str(results)}  # fmt: skip
        rerun = bisect_command(sweep, good, bad, point=point or "", arm=target.arm,
                              metric=target.metric, device=target.device, **more)  # fmt: skip
        print_result(out, result, rerun)
        if result.outcome not in ("found", "no-regression"):
            raise typer.Exit(1)
