"""The comparison of any sweep: per point and device, each arm (or run, commit, device) against a baseline.

`compare_results(table, by="arm", baseline="affine")` answers: one row per case, parameter point
and device (or arm, when devices are compared); for each metric the sides' medians with their
bootstrap intervals and, for every side but the baseline, the ratio of medians to the baseline
with its interval and verdict. `by` can also be `run`, `commit` or `device`, to compare two runs,
two commits (an external benchmark's, `ref@commit`, BASE first, from `--ref BASE --ref HEAD`; for
kernel cases this checkout's code version) or two machines on the same points. Every view but
`commit` sees a commit comparison's HEAD alone (`orchestrator.analysis.commits.head_rows`).

`arms` and `metrics` narrow the comparison to the named arms (in that order, the baseline first)
and metrics; which of the computed metrics a table shows by default is `compare_render`'s choice.
The rows are grouped in DuckDB (`orchestrator.analysis.samples`): each side's samples come ordered by run,
job and sample, with their job keys and runs, so that samples of one job pair up (ABBA pairs);
Benjamini-Hochberg across the table keeps the false FASTER/SLOWER verdicts in check
(`orchestrator.analysis.fdr`).

`orchestrator.analysis.cross_device` is the fair view across machines.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import duckdb
import pyarrow as pa
import pyarrow.compute as pc

from orchestrator.analysis import groups, stats
from orchestrator.analysis.commits import COMMIT_SIDE, base_side, head_rows, match_side, with_commit_sides
from orchestrator.analysis.fdr import FdrControl, control_fdr
from orchestrator.analysis.groups import Point
from orchestrator.analysis.samples import SampleSet, grouped_samples
from orchestrator.analysis.stats import Comparison, Summary
from orchestrator.errors import InputError
from workers.contract.precision import seed_for

# The seeds' order: prefill, decode, memory, load; then the kernel metrics.
METRIC_ORDER = (
    "prefill_tok_s",
    "decode_tok_s",
    "token_latency_ms",
    "peak_memory_bytes",
    "load_seconds",
    "seconds",
    "gb_per_s",
    "tflop_per_s",
    "rel_error",
)
SIDE_COLUMNS = {"arm": "arm", "run": "run_id", "commit": COMMIT_SIDE, "device": "device"}
# Parameters that read as a prompt length, preferred on the x axis and as the first column.
LENGTH_PARAMS = ("prompt_tokens", "tokens")


@dataclass
class CompareRow:
    """One point of one case on one device (or arm): every side's metrics against the baseline."""

    case_name: str
    point: Point
    dims: dict[str, str]
    values: dict[tuple[str, str], Summary] = field(default_factory=dict)  # (metric, side)
    comparisons: dict[tuple[str, str], Comparison] = field(default_factory=dict)
    samples: dict[tuple[str, str], SampleSet] = field(default_factory=dict)  # the samples behind `values`


@dataclass
class CompareResult:
    """The whole comparison, ready to render in any format."""

    by: str
    baseline: str
    sides: list[str]
    metrics: list[str]
    rows: list[CompareRow]
    varying: dict[str, list[str]]  # case -> the parameters that change across its points
    case_sides: dict[str, list[str]] = field(default_factory=dict)  # case -> its sides, baseline first
    case_baselines: dict[str, str] = field(default_factory=dict)
    threshold: float = stats.THRESHOLD
    left_out: list[str] = field(default_factory=list)  # points without a clean sample, and why
    units: dict[str, str] = field(default_factory=dict)  # metric -> the unit its rows give
    sweep: str | None = None
    fdr: FdrControl | None = None  # how false discoveries were controlled across the table
    heavy_tails: list[str] = field(default_factory=list)  # groups with outliers (hyperfine's warning)

    def metrics_of(self, case: str) -> list[str]:
        """The metrics a case measures (any side, any point), in `metrics` order."""
        have = {m for r in self.rows if r.case_name == case for m, _ in r.values}
        return [m for m in self.metrics if m in have]

    def sides_of(self, case: str) -> list[str]:
        """The sides a case has, its baseline first."""
        return self.case_sides.get(case, self.sides)

    def baseline_of(self, case: str) -> str:
        """The baseline of a case: the chosen one, or, where the case lacks it, `affine` or its first side."""
        return self.case_baselines.get(case, self.baseline)

    def row_params(self, row: CompareRow) -> dict[str, str]:
        """The parameters of a row that vary within its case (what tells its rows apart)."""
        shown = self.varying.get(row.case_name) or []
        return {k: v for k, v in row.point if k in shown}


def _sort_value(text: str) -> tuple[int, float, str]:
    try:
        return (0, float(text), "")
    except ValueError:
        return (1, 0.0, text)


def point_sort_key(point: Point) -> tuple[tuple[str, tuple[int, float, str]], ...]:
    """Points ordered numerically (512 before 1024), length parameters first."""
    ordered = sorted(point, key=lambda kv: (kv[0] not in LENGTH_PARAMS, kv[0]))
    return tuple((k, _sort_value(v)) for k, v in ordered)


def varying_params(points: Iterable[Point]) -> list[str]:
    """The parameter names whose value is not the same at every point (a length first)."""
    seen: dict[str, set[str]] = {}
    for point in points:
        for k, v in point:
            seen.setdefault(k, set()).add(v)
    names = [k for k, vals in seen.items() if len(vals) > 1]
    if not names:
        names = [k for k in LENGTH_PARAMS if k in seen][:1]
    return sorted(names, key=lambda k: (k not in LENGTH_PARAMS, k))


def default_baseline(sides: list[str], preferred: str | None) -> str:
    """A case's baseline among its sides: the preferred one (the sweep's), else its variant
    (`affine` -> `affine-sorted`), else `affine` or its variant, else the first side."""
    for candidate in dict.fromkeys(c for c in (preferred, "affine") if c):
        if candidate in sides:
            return candidate
        variants = [s for s in sides if s.startswith(f"{candidate}-")]
        if variants:
            return variants[0]
    return sides[0]


def _only(rows: pa.Table, column: str, wanted: Sequence[str] | None, option: str) -> pa.Table:
    """The rows whose `column` is one of `wanted` (all when None); an unknown value is an input error."""
    if not wanted:
        return rows
    have = set(rows[column].to_pylist())
    missing = [w for w in wanted if w not in have]
    if missing:
        raise InputError(f"{option} {','.join(missing)}: no clean rows of it (there are: {', '.join(sorted(have))})")
    return rows.filter(pc.is_in(rows[column], value_set=pa.array(list(wanted), pa.string())))


LEFT_OUT_SQL = """
SELECT case_name, device, params, list_distinct(list(CASE WHEN status <> 'ok' THEN status
    WHEN coalesce(contended, false) THEN 'contended' ELSE 'no finite value' END)) AS why
FROM chosen c WHERE NOT EXISTS (SELECT 1 FROM clean k
    WHERE k.case_name = c.case_name AND k.device = c.device AND k.params = c.params)
GROUP BY ALL
"""


def left_out_points(table: pa.Table, clean: pa.Table) -> list[str]:
    """The (case, device, point)s of `table` with no clean sample, each with why: `qmm cpu tokens=1: contended`."""
    cols = ["case_name", "device", "params", "status", "contended"]
    con = duckdb.connect()
    con.register("chosen", table.select(cols))
    con.register("clean", clean.select(cols))
    why = {(c, d, groups.point_of(p)): reasons for c, d, p, reasons in con.sql(LEFT_OUT_SQL).fetchall()}
    points = {
        (c, d, groups.point_of(p))
        for c, d, p in con.sql("SELECT DISTINCT case_name, device, params FROM chosen").fetchall()
    }
    con.close()
    out = []
    for case_name, device, point in sorted(why, key=lambda k: (k[0], k[1], point_sort_key(k[2]))):
        shown = varying_params(k[2] for k in points if k[0] == case_name)
        where = " ".join(f"{k}={v}" for k, v in point if k in shown)
        out.append(f"{case_name} {device} {where}: {', '.join(sorted(why[(case_name, device, point)]))}")
    return out


def compare_results(
    table: pa.Table,
    *,
    by: str = "arm",
    baseline: str | None = None,
    threshold: float = stats.THRESHOLD,
    resamples: int = stats.RESAMPLES,
    arms: Sequence[str] | None = None,
    metrics: Sequence[str] | None = None,
    order: Sequence[str] | None = None,
    sides: Sequence[str] | None = None,
) -> CompareResult:
    """Build the comparison table from stored rows.

    Args:
        table: rows in `workers.contract.SCHEMA` (only clean samples count).
        by: what the sides are: `arm`, `run`, `commit` or `device`.
        baseline: the side the others are compared with (default: `affine` or the first side).
        threshold: the smallest relative change a verdict calls a difference.
        resamples: bootstrap resamples.
        arms: only these arms (None: all); with `by="arm"` they are the sides, in this order.
        metrics: only these metrics, in this order (None: every metric, in `METRIC_ORDER`).
        order: the preferred order of the sides (a sweep's arms); others follow as first measured.
        sides: only these sides (values of the `by` dimension; None: all).

    Returns:
        The comparison, one row per case, point and remaining dimension.

    Raises:
        InputError: `by` is unknown, there are no clean rows, an arm or metric has none, or the
            baseline is not a side.
    """
    if by not in SIDE_COLUMNS:
        raise InputError(f"--by {by!r} is not one of {', '.join(SIDE_COLUMNS)}")
    # Commit comparisons: `--by commit` puts BASE and HEAD side by side (the engine's commit, or
    # this checkout's code version for kernel cases); every other view sees HEAD alone.
    table = with_commit_sides(table) if by == "commit" else head_rows(table)
    if by == "commit":
        baseline = base_side(table) if baseline is None else match_side(table, baseline)
        sides = [match_side(table, s) for s in sides] if sides else sides
    side_col = SIDE_COLUMNS[by]
    row_dims = [d for d in ("device", "arm") if d != side_col]
    rows = groups.clean_rows(table)
    if rows.num_rows == 0:
        raise InputError("no clean result rows to compare (status ok, not contended)")
    rows = _only(_only(rows, "arm", arms, "--arms"), "metric", metrics, "--metric")
    rows = _only(rows, side_col, sides, f"--by {by}: side")
    chosen = table if not arms else table.filter(pc.is_in(table["arm"], value_set=pa.array(list(arms), pa.string())))
    left_out = left_out_points(chosen, groups.clean_rows(chosen))
    sample_sets = grouped_samples(rows, ["case_name", "params", *row_dims, "metric", side_col])
    samples: dict[tuple[str, Point, tuple[str, ...], str, str], SampleSet] = {}
    units: dict[str, str] = {}
    sides_seen: list[str] = []
    for (case_name, point, *dim_values, metric, side), group in sample_sets:
        side = str(side)
        if side not in sides_seen:
            sides_seen.append(side)
        samples[(case_name, point, tuple(str(d) for d in dim_values), metric, side)] = group
        units.setdefault(metric, group.unit)
    rank = {s: i for i, s in enumerate(order or [])}
    sides_seen.sort(key=lambda s: rank.get(s, len(rank)))  # stable: unranked sides stay as first measured
    sides = list(arms) if by == "arm" and arms else sides_seen
    sides = [s for s in sides if s in sides_seen]
    base = default_baseline(sides, baseline)
    if baseline is not None and baseline not in sides:
        raise InputError(f"baseline {baseline!r} has no clean rows (sides: {', '.join(sides)})")
    sides = [base] + [s for s in sides if s != base]
    case_sides: dict[str, list[str]] = {}
    for case_name, _, _, _, side in samples:
        case_sides.setdefault(case_name, [])
        if side not in case_sides[case_name]:
            case_sides[case_name].append(side)
    case_base = {case: default_baseline([s for s in sides if s in have], base) for case, have in case_sides.items()}
    case_sides = {
        case: [case_base[case]] + [s for s in sides if s in have and s != case_base[case]]
        for case, have in case_sides.items()
    }
    metrics_seen = {k[3] for k in samples}
    order = list(metrics) if metrics else [*METRIC_ORDER, *sorted(metrics_seen - set(METRIC_ORDER))]
    metric_list = [m for m in order if m in metrics_seen]

    by_row: dict[tuple[str, Point, tuple[str, ...]], CompareRow] = {}
    comparisons: dict[tuple[tuple[str, Point, tuple[str, ...]], str, str], Comparison] = {}
    for (case_name, point, dims, metric, side), group in samples.items():
        rkey = (case_name, point, dims)
        row = by_row.get(rkey)
        if row is None:
            row = by_row[rkey] = CompareRow(case_name, point, dict(zip(row_dims, dims, strict=True)))
        row.samples[(metric, side)] = group
        # one seed per group of samples (not per metric): seconds and tok/s of the same samples agree
        row.values[(metric, side)] = stats.summarize(group.values, seed=seed_for(rkey, side), resamples=resamples)
        cbase = case_base[case_name]
        against = samples.get((case_name, point, dims, metric, cbase))
        if side != cbase and against is not None:
            comparisons[(rkey, metric, side)] = stats.compare_samples(
                group.values,
                against.values,
                metric=metric,
                threshold=threshold,
                seed=stats.comparison_seed(case_name, point, dims, side, cbase),
                resamples=resamples,
                a_keys=group.pair_keys(),
                b_keys=against.pair_keys(),
                precision=group.target_with(against),
            )
    controlled, fdr_control = control_fdr(comparisons, lambda key: (key[0], key[2]))
    for (rkey, metric, side), c in controlled.items():
        by_row[rkey].comparisons[(metric, side)] = c
    ordered = sorted(by_row.values(), key=lambda r: (r.case_name, tuple(r.dims.values()), point_sort_key(r.point)))
    varying = {
        case: varying_params(r.point for r in ordered if r.case_name == case)
        for case in dict.fromkeys(r.case_name for r in ordered)
    }
    sweeps = pc.unique(table["sweep"]).to_pylist() if table.num_rows else []
    return CompareResult(
        by,
        base,
        sides,
        metric_list,
        ordered,
        varying,
        case_sides,
        case_base,
        threshold,
        left_out,
        units,
        sweeps[0] if len(sweeps) == 1 else None,
        fdr=fdr_control,
        heavy_tails=heavy_tails(ordered, varying),
    )


def heavy_tails(rows: list[CompareRow], varying: dict[str, list[str]]) -> list[str]:
    """One warning per group of samples with outliers (as hyperfine warns): `qmm cpu tokens=1
    native: 2 of 10 samples far from the rest (seconds, prefill_tok_s)`."""
    found: dict[tuple[str, str, int, int], list[str]] = {}
    for row in rows:
        shown = varying.get(row.case_name) or []
        where = " ".join([row.case_name, *row.dims.values(), *(f"{k}={v}" for k, v in row.point if k in shown)])
        for (metric, side), s in row.values.items():
            if s.heavy_tailed:
                found.setdefault((where, side, s.outliers, s.n), []).append(metric)
    return [
        f"{where} {side}: {k} of {n} samples far from the rest ({', '.join(metrics)}); its median stands, "
        "but re-run on a quiet machine to trust the spread"
        for (where, side, k, n), metrics in found.items()
    ]
