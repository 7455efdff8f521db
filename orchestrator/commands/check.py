"""`orchestrate check`: judge a sweep's acceptance criteria on its stored results."""

from __future__ import annotations

from pathlib import Path

import typer

from orchestrator.commands.run import results_root
from orchestrator.compare import select_results
from orchestrator.criteria import evaluate_criteria, exit_code_for, render_verdicts
from orchestrator.errors import InputError
from orchestrator.store import ResultStore


def register(app: typer.Typer) -> None:
    @app.command("check")
    def check(
        sweep: str | None = typer.Option(
            None, "--sweep", "-s", help="built-in sweep or sweep TOML with the criteria (default: the stored one)"
        ),
        run: str | None = typer.Option(None, "--run", help="only this run id"),
        all_runs: bool = typer.Option(False, "--all-runs", help="pool samples of every run, not the newest"),
        results_dir: Path | None = typer.Option(None, "--results", "-r", help="results directory (default ./results)"),
    ) -> None:
        """PASS, FAIL or AMBIGUOUS per criterion; exit 0 all pass, 1 one fails, 4 one is ambiguous."""
        store = ResultStore(results_root(results_dir))
        table, spec = select_results(store, sweep, run, all_runs=all_runs)
        if spec is None:
            name = table["sweep"][0].as_py()
            raise InputError(f"sweep {name!r} is not built in: give its file with --sweep PATH.toml")
        if not spec.criteria:
            raise InputError(f"sweep {spec.name!r} declares no [[criteria]]")
        verdicts = evaluate_criteria(table, spec)
        print(render_verdicts(verdicts))
        raise typer.Exit(exit_code_for(verdicts))
