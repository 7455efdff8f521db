"""`orchestrate check`: judge a sweep's acceptance criteria on its stored results."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import typer

from orchestrator.analysis.criteria import evaluate_criteria, render_verdicts
from orchestrator.analysis.records import typed
from orchestrator.analysis.same_output import OutputVerdict
from orchestrator.analysis.selection import select_results
from orchestrator.analysis.shortfall import shortfall_lines
from orchestrator.analysis.verdicts import CriterionVerdict, exit_code_for
from orchestrator.commands.options import format_option, output_option, results_option
from orchestrator.errors import InputError
from orchestrator.report.console import warn, warn_broken
from orchestrator.report.output import Format, destination, write_table
from orchestrator.store.fragments import ResultStore

CHECK_SCHEMA = pa.schema(
    [
        pa.field("criterion", pa.string()),
        pa.field("kind", pa.string()),  # ratio, or same-output
        pa.field("outcome", pa.string()),  # the criterion's
        pa.field("metric", pa.string()),
        pa.field("arm", pa.string()),
        pa.field("baseline", pa.string()),
        pa.field("min_ratio", pa.float64()),
        pa.field("max_ratio", pa.float64()),
        pa.field("where", pa.string()),
        pa.field("device", pa.string()),
        pa.field("case", pa.string()),
        pa.field("params", pa.string()),
        pa.field("point_outcome", pa.string()),  # PASS, FAIL, AMBIGUOUS, SKIPPED or MISSING
        pa.field("ratio", pa.float64()),
        pa.field("ratio_ci_low", pa.float64()),
        pa.field("ratio_ci_high", pa.float64()),
        pa.field("more_samples", pa.int64()),
        pa.field("reason", pa.string()),  # why a point is missing, why it has no verdict, what was compared
        pa.field("compared_at", pa.string()),  # same-output: the commit (across arms) or arm (across commits)
        pa.field("differing", pa.string()),  # same-output: the first side whose output differs
    ]
)


def check_records(verdicts: list[CriterionVerdict]) -> pa.Table:
    """One record per criterion and point it judged or misses (see `CHECK_SCHEMA`)."""
    recs = []
    for v in verdicts:
        c = v.criterion
        head = {
            "criterion": c.name,
            "kind": c.kind,
            "outcome": v.outcome.value,
            "metric": c.metric,
            "arm": c.arm,
            "baseline": v.baseline,
            "min_ratio": c.min_ratio,
            "max_ratio": c.max_ratio,
            "where": c.where or None,
        }
        for p in v.points:
            recs.append(
                {
                    **head,
                    "device": p.device,
                    "case": p.case_name,
                    "params": json.dumps({k: typed(x) for k, x in p.point}, sort_keys=True),
                    "point_outcome": p.outcome.value,
                    "ratio": p.ratio.ratio,
                    "ratio_ci_low": p.ratio.ci_low,
                    "ratio_ci_high": p.ratio.ci_high,
                    "more_samples": p.more_samples,
                    "reason": p.note,
                }
            )
        for o in v.outputs if isinstance(v, OutputVerdict) else []:
            recs.append(
                {
                    **head,
                    "device": o.device,
                    "case": o.case_name,
                    "params": json.dumps({k: typed(x) for k, x in o.point}, sort_keys=True),
                    "point_outcome": o.outcome.value,
                    "reason": o.detail,
                    "compared_at": o.where,
                    "differing": o.differing,
                }
            )
        for m in v.missing:
            recs.append(
                {
                    **head,
                    "device": m.device,
                    "case": m.case_name,
                    "params": json.dumps({k: typed(x) for k, x in m.point}, sort_keys=True),
                    "point_outcome": "MISSING",
                    "reason": m.reason,
                }
            )
    return pa.Table.from_pylist(recs, schema=CHECK_SCHEMA)


def register(app: typer.Typer) -> None:
    @app.command("check")
    def check(
        sweep: str | None = typer.Option(
            None,
            "--sweep",
            "-s",
            metavar="NAME|FILE",
            help="built-in sweep or sweep TOML with the criteria (default: the stored one)",
        ),
        run: str | None = typer.Option(
            None, "--run", metavar="RUN", help="only this run id (default: each point's newest run)"
        ),
        all_runs: bool = typer.Option(False, "--all-runs", help="pool samples of every run, not the newest"),
        fmt: Format = format_option("the verdicts"),
        output: Path | None = output_option(),
        results: Path = results_option(),
    ) -> None:
        """PASS, FAIL or AMBIGUOUS per criterion; exit 0 all pass, 1 one fails, 4 one is ambiguous."""
        store = ResultStore(results)
        table, spec = select_results(store, sweep, run, all_runs=all_runs, say=warn)
        if spec is None:
            name = table["sweep"][0].as_py()
            raise InputError(f"sweep {name!r} is not built in: give its file with --sweep PATH.toml")
        if not spec.criteria:
            raise InputError(f"sweep {spec.name!r} declares no [[criteria]]")
        verdicts = evaluate_criteria(table, spec)
        with destination(output) as stream:
            short = shortfall_lines(table)
            if fmt is Format.table:
                stream.write("\n".join([render_verdicts(verdicts), *short]) + "\n")
            else:
                write_table(check_records(verdicts), fmt, stream)
                for line in short:
                    warn(line)
        warn_broken(store.broken)
        raise typer.Exit(exit_code_for(verdicts))
