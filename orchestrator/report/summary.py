"""`orchestrate results` and the end of `orchestrate run`: the quick look at a sweep's numbers.

`summarize` groups the clean samples (status ok, not contended, not throttled, finite) in DuckDB: per device,
case, point, arm and metric the median, the interquartile range, the count, and the ratio of the
arm's median to its case's baseline arm at the same point (`orchestrate compare` adds intervals
and verdicts). Like `orchestrate compare`, the command passes each point's newest run only unless
asked to pool them (`--all-runs`). `results_table` lays them out one line per value, as
llama-bench prints one line per test, with only the columns that differ between lines.
`render_run_end` is what a finished run prints: the comparison in the first layout that fits the
terminal, and the commands to go on.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import duckdb
import pyarrow as pa
from rich.console import Console
from rich.table import Table
from rich.text import Text

from orchestrator.analysis.commits import compared_refs
from orchestrator.analysis.compare import (
    compare_results,
    default_baseline,
    point_sort_key,
    varying_params,
)
from orchestrator.analysis.groups import Point, point_of
from orchestrator.analysis.records import typed
from orchestrator.analysis.samples import clean_in_duckdb
from orchestrator.analysis.selection import select_results
from orchestrator.analysis.shortfall import shortfall_lines
from orchestrator.errors import InputError
from orchestrator.report.console import console, grid, warn_broken
from orchestrator.report.output import markdown
from orchestrator.report.text import print_comparison
from orchestrator.report.units import format_value, metric_label, unit_of
from orchestrator.specs.sweep import SweepSpec
from orchestrator.store.dataset import read_rows
from orchestrator.store.fragments import ResultStore

DEFAULT_METRICS = ("seconds", "prefill_tok_s", "decode_tok_s", "peak_memory_bytes", "load_seconds", "rel_error")


@dataclass
class ArmSummary:
    """One line of the summary."""

    device: str
    backend: str
    case: str
    point: Point
    arm: str
    metric: str
    unit: str
    median: float
    p25: float
    p75: float
    n: int
    baseline: str | None  # the case's baseline arm at this point
    vs_baseline: float | None  # median / the baseline's median (None for the baseline, or no baseline)

    @property
    def spread_pct(self) -> float:
        """The interquartile range as a percentage of the median."""
        return 100.0 * (self.p75 - self.p25) / abs(self.median) if self.median else 0.0


SUMMARY_SQL = """
SELECT device, any_value(backend), case_name, params, arm, metric, any_value(unit), median(value),
    quantile_cont(value, 0.25), quantile_cont(value, 0.75), count(*), min(_row) AS first
FROM clean WHERE list_contains($metrics, metric) GROUP BY device, case_name, params, arm, metric ORDER BY first
"""


def summarize(table: pa.Table, *, baseline: str | None, metrics: Sequence[str] = DEFAULT_METRICS) -> list[ArmSummary]:
    """Group clean samples (in DuckDB) and compare each arm with its case's baseline arm at the same point."""
    con = clean_in_duckdb(table, "clean")
    if con is None:
        return []
    groups = con.sql(SUMMARY_SQL, params={"metrics": list(metrics)}).fetchall()
    con.close()
    lines = [
        ArmSummary(
            dev,
            backend or "",
            case,
            point_of(params),
            arm,
            metric,
            unit_of(metric, unit),
            med,
            p25,
            p75,
            n,
            None,
            None,
        )
        for dev, backend, case, params, arm, metric, unit, med, p25, p75, n, _ in groups
    ]
    arms: dict[tuple[str, str, Point], list[str]] = {}
    for s in lines:
        arms.setdefault((s.device, s.case, s.point), [])
        if s.arm not in arms[(s.device, s.case, s.point)]:
            arms[(s.device, s.case, s.point)].append(s.arm)
    medians = {(s.device, s.case, s.point, s.arm, s.metric): s.median for s in lines}
    for s in lines:
        s.baseline = default_baseline(arms[(s.device, s.case, s.point)], baseline)
        base = medians.get((s.device, s.case, s.point, s.baseline, s.metric))
        if s.arm != s.baseline and base:
            s.vs_baseline = s.median / base
    order = {m: i for i, m in enumerate(metrics)}

    def arm_rank(s: ArmSummary) -> int:  # the baseline first, then as measured
        return -1 if s.arm == s.baseline else arms[(s.device, s.case, s.point)].index(s.arm)

    return sorted(
        lines, key=lambda s: (s.device, s.case, point_sort_key(s.point), order.get(s.metric, 99), arm_rank(s))
    )


def left_out(table: pa.Table) -> str | None:
    """Why rows are not in the summary: how many are contended, throttled, failed or unsupported (or None)."""
    con = duckdb.connect()
    con.register("rows", table.select(["status", "contended", "extra"]))
    sql = (
        "SELECT count(*) FILTER (status = 'ok' AND coalesce(contended, false)), "
        "count(*) FILTER (status = 'ok' AND NOT coalesce(contended, false) AND extra['throttled'] = 'true'), "
        "count(*) FILTER (status = 'failed'), count(*) FILTER (status = 'unsupported') FROM rows"
    )
    ((contended, throttled, failed, unsupported),) = con.sql(sql).fetchall()
    con.close()
    counts = {
        "contended (a foreign process used the device during the measurement)": contended,
        "throttled (the GPU slowed itself for heat or power)": throttled,
        "failed": failed,
        "unsupported": unsupported,
    }
    parts = [f"{n} {why}" for why, n in counts.items() if n]
    return f"left out: {', '.join(parts)}" if parts else None


def results_table(lines: list[ArmSummary], title: str, *, compact: bool = False) -> Table:
    """One line per value: only the columns whose value differs between lines (the rest go in the title).

    `compact` leaves out the spread and the count (for a narrow terminal).
    """
    return grid(*results_cells(lines, title, compact=compact))


def results_markdown(lines: list[ArmSummary], title: str) -> str:
    """The same table in Markdown, under its title."""
    head, heads, rows, numeric = results_cells(lines, title)
    plain = [[c.plain if isinstance(c, Text) else c for c in r] for r in rows]
    return f"### {head}\n\n{markdown(heads, plain, numeric)}\n"


def results_cells(
    lines: list[ArmSummary], title: str, *, compact: bool = False
) -> tuple[str, list[str], list[list[str | Text]], list[bool]]:
    """Title, headers, cells and right-alignment of the results table."""
    varying = {case: varying_params(s.point for s in lines if s.case == case) for case in {s.case for s in lines}}
    fixed = [name for name in ("device", "backend", "case") if len({getattr(s, name) for s in lines}) == 1]
    shared = [f"{lines[0].device}" if "device" in fixed else "", lines[0].case if "case" in fixed else ""]
    heads = [h for h in ("device", "case") if h not in fixed] + ["point", "arm", "metric", "median", "IQR", "n"]
    heads.append("vs baseline")
    rows = []
    for s in lines:
        point = " ".join(f"{k}={v}" for k, v in s.point if k in varying[s.case])
        cells: list[str | Text] = [getattr(s, h) for h in ("device", "case") if h not in fixed]
        cells += [point, s.arm, metric_label(s.metric), format_value(s.median, s.unit)]
        cells += [f"{s.spread_pct:.1f}%" if s.n > 1 else "", str(s.n)]
        if s.arm == s.baseline:
            cells.append(Text("baseline", style="dim"))
        else:
            cells.append("" if s.vs_baseline is None else f"{s.vs_baseline:.3f}x {s.baseline}")
        rows.append(cells)
    if compact:
        keep = [i for i, h in enumerate(heads) if h not in ("IQR", "n")]
        heads, rows = [heads[i] for i in keep], [[r[i] for i in keep] for r in rows]
    numeric = [h in ("median", "IQR", "n", "vs baseline") for h in heads]
    where = " ".join(x for x in shared if x)
    return f"{title}{f' ({where})' if where else ''}", heads, rows, numeric


SUMMARY_SCHEMA = pa.schema(
    [
        pa.field("device", pa.string()),
        pa.field("backend", pa.string()),
        pa.field("case", pa.string()),
        pa.field("params", pa.string()),
        pa.field("arm", pa.string()),
        pa.field("metric", pa.string()),
        pa.field("unit", pa.string()),
        pa.field("median", pa.float64()),
        pa.field("p25", pa.float64()),
        pa.field("p75", pa.float64()),
        pa.field("n", pa.int64()),
        pa.field("baseline", pa.string()),
        pa.field("ratio", pa.float64()),
    ]
)


def summary_records(lines: list[ArmSummary]) -> pa.Table:
    """The summary as tidy records (`SUMMARY_SCHEMA`): parameters as a JSON object of typed values."""
    return pa.Table.from_pylist(
        [
            {
                "device": s.device,
                "backend": s.backend,
                "case": s.case,
                "params": json.dumps({k: typed(v) for k, v in s.point}, sort_keys=True),
                "arm": s.arm,
                "metric": s.metric,
                "unit": s.unit,
                "median": s.median,
                "p25": s.p25,
                "p75": s.p75,
                "n": s.n,
                "baseline": s.baseline,
                "ratio": s.vs_baseline,
            }
            for s in lines
        ],
        schema=SUMMARY_SCHEMA,
    )


def next_commands(sweep: str, results: Path | None, *, commits: bool = False) -> list[tuple[str, str]]:
    """What to run next on a sweep's results, and what each gives (with `--results` unless it is the default).

    `commits`: the run compared commits (`--ref BASE --ref HEAD`), so `compare --by commit` comes first.
    """
    default = Path(os.environ.get("ORCHESTRATE_RESULTS") or "results")
    where = f" --results {results}" if results is not None and results != default else ""
    by_commit = [(f"orchestrate compare --sweep {sweep} --by commit{where}", "HEAD against BASE, point by point")]
    return [
        *(by_commit if commits else []),
        (f"orchestrate compare --sweep {sweep}{where}", "intervals and verdicts (--wide, --format md|csv|json)"),
        (f"orchestrate report --sweep {sweep}{where} --html {sweep}.html", "plots and tables in one HTML file"),
        (f"orchestrate runs{where}", "the stored runs; two compared: compare --by run --baseline R1 --contender R2"),
    ]


def render_run_end(
    store: ResultStore,
    sweep: SweepSpec,
    out: Console | None = None,
    *,
    results: Path | None = None,
    run_id: str | None = None,
) -> None:
    """The end of `orchestrate run`: the sweep's comparison in the first layout that fits, then the next commands.

    A run that compared commits (`--ref BASE --ref HEAD`) also shows HEAD against BASE on its own rows.

    Args:
        store: the store the run wrote to.
        sweep: the sweep that ran (its baseline and arm order are used).
        out: the console (default: stdout's).
        results: the `--results` the user gave, echoed in the next commands (None: the default).
        run_id: the run that just ended (its commit comparison is shown).
    """
    out = out or console()
    try:
        table, _ = select_results(store, sweep.name, None)
        order = [arm for case in sweep.cases for arm in case.arm_names()]
        result = compare_results(table, baseline=sweep.baseline, order=order)  # HEAD alone (`head_rows`)
    except InputError as exc:
        out.print(Text(f"Nothing to compare: {exc.message}"))
    else:
        print_comparison(out, result)
        note = left_out(table)
        if note:
            out.print(Text(note))
        for line in shortfall_lines(table, result.varying):
            out.print(Text(line))
    this_run = read_rows(store, sweep=sweep.name, runs=[run_id]) if run_id else None
    commits = this_run is not None and this_run.num_rows > 0 and compared_refs(this_run) > 1
    if this_run is not None and commits:
        out.print()
        out.print(Text("HEAD against BASE (this run's commits, interleaved in each job's lock window):"))
        try:
            print_comparison(out, compare_results(this_run, by="commit"))
        except InputError as exc:  # no clean sample of either commit: the table above says why
            out.print(Text(f"no commit comparison: {exc.message}"))
    warn_broken(store.broken)
    out.print()
    out.print(Text("Next:", style="bold"))
    for command, what in next_commands(sweep.name, results, commits=commits):  # never folded: for copying
        out.print(Text.assemble(f"  {command}", ("  # " + what, "dim")), soft_wrap=True)
