"""A comparison as text: terminal tables that fit, Markdown, and tidy CSV/JSON records.

On a terminal each case is one table, in the first layout that fits the width (`$COLUMNS`):

1. points as rows, each side's value beside the others and the gap to the baseline (the layout
   of the users' own tables: prompt length, affine prefill, native prefill, gap, ...), with the
   gaps' 95 % intervals; then the same without the intervals;
2. sides as rows (one line per point and arm, as llama-bench prints one line per test), with
   the intervals, then without; then with fewer metrics.

`--wide` prints layout 1 with everything, whatever its width; Markdown is that layout too.
Verdicts are coloured on a terminal; `only_changed` hides what is SAME (as asv's `--only-changed`).

CSV and JSON are the tidy records of `orchestrator.analysis.records` (one fixed schema,
documented in `docs/results.md`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import IO

import pyarrow.compute as pc
from rich.console import Console, RenderableType
from rich.table import Table
from rich.text import Text

from orchestrator.analysis.compare import CompareResult, CompareRow
from orchestrator.analysis.cross_device import CrossDeviceRow, over_peak
from orchestrator.analysis.records import records_table, verdict_label
from orchestrator.analysis.stats import Comparison, Verdict
from orchestrator.report.console import fit, grid, print_fitted, print_wide, verdict_text
from orchestrator.report.cross import cross_display, print_cross
from orchestrator.report.output import Format, markdown, write_records
from orchestrator.report.units import format_value as format_in_unit
from orchestrator.report.units import header_unit, metric_label, unit_of

# The metrics a table shows by default (the users' tables), where a case measures them.
DEFAULT_METRICS = ("prefill_tok_s", "decode_tok_s", "peak_memory_bytes", "load_seconds")
# Shown per side without a ratio column: one sample per job (memory, load and build time) or an
# accuracy check (rel_error) -- CSV and JSON still carry their ratios.
VALUE_ONLY = frozenset({"peak_memory_bytes", "load_seconds", "build_seconds", "rel_error"})
# The ratio column of a metric: its label, and whether it reads as a gap in % (else a factor).
RATIO_LABELS = {"prefill_tok_s": ("prefill gap", True), "decode_tok_s": ("decode speedup", False)}


def format_value(metric: str, value: float | None) -> str:
    """A metric's value in its unit (see `orchestrator.report.units.format_value`, the one formatter)."""
    return format_in_unit(value, unit_of(metric))


def ratio_label(metric: str) -> tuple[str, bool]:
    """The label of a metric's ratio column and whether its cells are a gap in % (else a factor)."""
    return RATIO_LABELS.get(metric, (f"{metric_label(metric)} ratio", False))


def format_comparison(metric: str, c: Comparison, *, interval: bool = True, hint: bool = True) -> str:
    """`-3.0% [-3.1,-2.9] SLOWER` (a gap) or `2.67x [2.60,2.74] FASTER` (a factor); `interval=False` drops the [..].

    Too few samples to judge: the ratio and why, `0.95x (n=1: too few to judge)`. `hint` appends
    an AMBIGUOUS verdict's `(~N more samples)`; tables put it in a footnote instead.
    """
    r = c.ratio
    if not math.isfinite(r.ratio):
        return "-"
    gap = ratio_label(metric)[1]
    text = f"{(r.ratio - 1) * 100:+.1f}%" if gap else f"{r.ratio:.2f}x"
    if c.verdict is Verdict.TOO_FEW:
        return f"{text} ({c.note})"
    if interval and gap:
        text += f" [{(r.ci_low - 1) * 100:+.1f},{(r.ci_high - 1) * 100:+.1f}]"
    elif interval:
        text += f" [{r.ci_low:.2f},{r.ci_high:.2f}]"
    text += f" {verdict_label(c.verdict, metric)}"
    if hint and c.verdict is Verdict.AMBIGUOUS and c.settle is not None:
        if c.settle.on_edge:
            text += " (on the band's edge)"
        elif c.more_samples:
            text += f" (~{c.more_samples} more samples)"
    return text


def comparison_cell(metric: str, c: Comparison | None, *, interval: bool, note: str = "") -> Text:
    """A ratio cell with its verdict coloured."""
    if c is None:
        return Text("-")
    text = format_comparison(metric, c, interval=interval, hint=False) + note
    return verdict_text(verdict_label(c.verdict, metric), text)


# ------------------------------------------------------------------------------------ layouts


@dataclass
class CaseTable:
    """One case's table as cells: headers as (top, bottom) lines, rows, footnotes."""

    case: str
    title: str
    heads: list[tuple[str, str]]
    rows: list[list[Text]]
    notes: list[str] = field(default_factory=list)
    numeric: list[bool] = field(default_factory=list)  # per column: right-justified
    interval: bool = True  # the ratio cells show their intervals

    def header(self, i: int, sep: str = " ") -> str:
        """Column `i`'s header, its two lines joined by `sep` (a newline in a terminal)."""
        return sep.join(part for part in self.heads[i] if part)

    def plain_rows(self) -> list[list[str]]:
        """The cells as plain text."""
        return [[c.plain for c in row] for row in self.rows]

    def rich(self) -> Table:
        """The table for a console: two-line headers, cells never wrapped."""
        return grid(self.title, [self.header(i, "\n") for i in range(len(self.heads))], self.rows, self.numeric)


def shown_metrics(result: CompareResult, case: str, metrics: Sequence[str] | None = None) -> list[str]:
    """The metrics a case's table shows: `metrics` (None: `DEFAULT_METRICS`) that the case measures.

    A case measuring none of the defaults shows its first metric (a kernel case's time).
    """
    have = result.metrics_of(case)
    if metrics is not None:
        return [m for m in metrics if m in have]
    return [m for m in DEFAULT_METRICS if m in have] or have[:1]


def _changed(row: CompareRow, metrics: Sequence[str], sides: Sequence[str]) -> bool:
    """Whether any shown comparison of `sides` at this row is not SAME (a missing one counts as changed)."""
    return any(
        (c := row.comparisons.get((m, s))) is None or c.verdict is not Verdict.SAME
        for m in metrics
        if m not in VALUE_ONLY
        for s in sides
    )


def _title(result: CompareResult, case: str, rows: list[CompareRow], shown_dims: list[str]) -> str:
    """`qmm on cpu, baseline affine; n=256 k=512 dtype=float32` (what every row of the case shares)."""
    where = " ".join(v for d, v in (rows[0].dims.items() if rows else []) if d not in shown_dims)
    fixed = [kv for kv in (rows[0].point if rows else ()) if kv[0] not in result.varying.get(case, [])]
    head = f"{case}{f' on {where}' if where else ''}, baseline {result.baseline_of(case)}"
    return head + (f"; {' '.join(f'{k}={v}' for k, v in fixed)}" if fixed else "")


def _varying_dims(rows: list[CompareRow]) -> list[str]:
    dims = list(rows[0].dims) if rows else []
    return [d for d in dims if len({r.dims[d] for r in rows}) > 1]


def _header_label(result: CompareResult, metric: str) -> str:
    unit = header_unit(unit_of(metric, result.units.get(metric)))
    label = metric_label(metric)
    return label if not unit or unit in label else f"{label} ({unit})"


def _value(result: CompareResult, row: CompareRow, metric: str, side: str) -> Text:
    s = row.values.get((metric, side))
    unit = unit_of(metric, result.units.get(metric))
    return Text(format_in_unit(s.median, unit, with_unit=False) if s else "-")


def _ratio(table: CaseTable, row: CompareRow, metric: str, side: str, where: str, footnotes: bool) -> Text:
    """A side's ratio cell at a row; an AMBIGUOUS verdict's sample estimate goes to a footnote."""
    c = row.comparisons.get((metric, side))
    note = _footnote(table, c, f"{where} {metric_label(metric)}") if footnotes else ""
    return comparison_cell(metric, c, interval=table.interval, note=note)


def _footnote(table: CaseTable, c: Comparison | None, where: str) -> str:
    said = c.settle.describe() if c is not None and c.verdict is Verdict.AMBIGUOUS and c.settle else None
    if said is None:
        return ""
    table.notes.append(f"{where}: {said}")
    return f" ({len(table.notes)})"


@dataclass
class CaseLayout:
    """What both layouts of one case start from: its rows, sides, baseline, metrics and label columns."""

    rows: list[CompareRow]
    sides: list[str]
    base: str
    metrics: list[str]
    dims: list[str]  # the row dimensions (device, arm) that vary within the case
    params: list[str]  # the parameters that vary within the case

    @classmethod
    def of(cls, result: CompareResult, case: str, metrics: Sequence[str] | None, only_changed: bool) -> CaseLayout:
        rows = [r for r in result.rows if r.case_name == case]
        sides, chosen = result.sides_of(case), shown_metrics(result, case, metrics)
        if only_changed:
            rows = [r for r in rows if _changed(r, chosen, sides[1:])]
        return cls(rows, sides, result.baseline_of(case), chosen, _varying_dims(rows), result.varying.get(case, []))

    def lead(self, row: CompareRow, point: dict[str, str]) -> tuple[list[Text], str]:
        """A row's label cells, and the same as `device k=v` for footnotes."""
        cells = [Text(row.dims[d]) for d in self.dims] + [Text(point.get(k, "")) for k in self.params]
        where = " ".join([*(row.dims[d] for d in self.dims), *(f"{k}={point[k]}" for k in self.params if k in point)])
        return cells, where


def sides_table(
    result: CompareResult,
    case: str,
    metrics: Sequence[str] | None = None,
    *,
    interval: bool = True,
    footnotes: bool = True,
    only_changed: bool = False,
) -> CaseTable:
    """Points as rows, each side's value of each metric side by side, then the gaps to the baseline."""
    lay = CaseLayout.of(result, case, metrics, only_changed)
    sides, base = lay.sides, lay.base
    heads = [("", k) for k in [*lay.dims, *lay.params]]
    numeric = [False] * len(lay.dims) + [True] * len(lay.params)
    for metric in lay.metrics:
        heads += [(side, _header_label(result, metric)) for side in sides]
        numeric += [True] * len(sides)
        if metric not in VALUE_ONLY:
            heads += [(side, ratio_label(metric)[0]) for side in sides[1:]]
            numeric += [True] * (len(sides) - 1)
    table = CaseTable(case, _title(result, case, lay.rows, lay.dims), heads, [], numeric=numeric, interval=interval)
    for row in lay.rows:
        cells, where = lay.lead(row, result.row_params(row))
        for metric in lay.metrics:
            cells += [_value(result, row, metric, side) for side in sides]
            if metric in VALUE_ONLY:
                continue
            cells += [_ratio(table, row, metric, side, f"{where} {side} vs {base}", footnotes) for side in sides[1:]]
        table.rows.append(cells)
    return table


def rows_table(
    result: CompareResult,
    case: str,
    metrics: Sequence[str] | None = None,
    *,
    interval: bool = True,
    footnotes: bool = True,
    only_changed: bool = False,
) -> CaseTable:
    """Sides as rows: one line per point and side, each metric's value and the ratio to the baseline."""
    lay = CaseLayout.of(result, case, metrics, only_changed=False)
    sides, base = lay.sides, lay.base
    heads = [("", k) for k in [*lay.dims, *lay.params, result.by]]
    numeric = [False] * len(lay.dims) + [True] * len(lay.params) + [False]
    for metric in lay.metrics:
        heads.append(("", _header_label(result, metric)))
        numeric.append(True)
        if metric not in VALUE_ONLY:
            heads.append((f"vs {base}", ratio_label(metric)[0]))
            numeric.append(True)
    table = CaseTable(case, _title(result, case, lay.rows, lay.dims), heads, [], numeric=numeric, interval=interval)
    for row in lay.rows:
        kept = [s for s in sides[1:] if not only_changed or _changed(row, lay.metrics, [s])]
        if only_changed and not kept:
            continue
        lead, where = lay.lead(row, result.row_params(row))
        for i, side in enumerate([base, *kept]):
            if not any((m, side) in row.values for m in lay.metrics):
                continue
            cells = (lead if i == 0 else [Text("") for _ in lead]) + [Text(side, style="bold" if i == 0 else "")]
            for metric in lay.metrics:
                cells.append(_value(result, row, metric, side))
                if metric in VALUE_ONLY:
                    continue
                if side == base:
                    cells.append(Text("baseline", style="dim"))
                    continue
                cells.append(_ratio(table, row, metric, side, f"{where} {side}", footnotes))
            table.rows.append(cells)
    return table


def case_tables(
    result: CompareResult,
    metrics: Sequence[str] | None = None,
    *,
    footnotes: bool = True,
    interval: bool = True,
    only_changed: bool = False,
) -> list[CaseTable]:
    """Every case's table in the points-as-rows layout (Markdown, HTML, `--wide`)."""
    return [
        sides_table(result, case, metrics, interval=interval, footnotes=footnotes, only_changed=only_changed)
        for case in result.varying
    ]


def fitted_tables(
    out: Console, result: CompareResult, metrics: Sequence[str] | None = None, *, only_changed: bool = False
) -> list[CaseTable]:
    """Per case, the first layout that fits the console (see the module docstring)."""
    chosen = []
    for case in result.varying:
        candidates = [
            layout(result, case, metrics, interval=interval, only_changed=only_changed)
            for layout in (sides_table, rows_table)
            for interval in (True, False)
        ]
        shown = shown_metrics(result, case, metrics)
        candidates += [
            rows_table(result, case, shown[:keep], interval=False, only_changed=only_changed)
            for keep in range(len(shown) - 1, 0, -1)
        ]
        rendered: list[RenderableType] = [t.rich() for t in candidates]
        best = fit(out, rendered)
        chosen.append(candidates[next(i for i, r in enumerate(rendered) if r is best)])
    return chosen


def legend(result: CompareResult, *, intervals: bool = True) -> list[str]:
    """What the cells mean, and which points have no clean sample: printed once under the tables."""
    lines = [
        "Medians of clean samples. gap: a side's median over its case's baseline, minus 1; speedup and ratio: "
        "the same as a factor"
        + (", [95 % bootstrap interval, over ABBA pairs where the sides share a job]" if intervals else "")
        + f"; FASTER/SLOWER: the whole interval past a {result.threshold:.0%} band around 1, SAME: inside it, "
        "AMBIGUOUS: across its edge; TOO FEW: under 5 samples per side."
    ]
    if not intervals:
        lines.append("Intervals left out to fit the terminal: --wide or --format md shows them.")
    if result.fdr is not None and result.fdr.hypotheses:
        lines.append(result.fdr.describe())
    lines += [f"Heavy tails: {w}." for w in result.heavy_tails]
    if result.left_out:
        lines.append(f"Left out, no clean sample: {'; '.join(result.left_out)}.")
    return lines


def print_comparison(
    out: Console,
    result: CompareResult,
    cross: list[CrossDeviceRow] | None = None,
    metrics: Sequence[str] | None = None,
    *,
    wide: bool = False,
    only_changed: bool = False,
) -> None:
    """The comparison on a console: per case its table and footnotes, the legend, the cross-device view."""
    if wide:
        tables = case_tables(result, metrics, only_changed=only_changed)
    else:
        tables = fitted_tables(out, result, metrics, only_changed=only_changed)
    for t in tables:
        if not t.rows:
            out.print(Text(f"{t.title}: nothing changed beyond the {result.threshold:.0%} threshold"))
            continue
        (print_wide if wide else _print)(out, t.rich())
        for i, note in enumerate(t.notes, 1):
            out.print(Text(f"({i}) {note}"))
        out.print()
    for line in legend(result, intervals=all(t.interval for t in tables)):
        out.print(Text(line))
    if cross:
        out.print()
        print_cross(out, cross, wide=wide)


def _print(out: Console, renderable: RenderableType) -> None:
    """A fitted table: at the console's width when it fits, else at its own (never a cell cut short)."""
    print_fitted(out, [renderable])


def write_comparison(
    result: CompareResult,
    fmt: Format,
    stream: IO[str],
    cross: list[CrossDeviceRow] | None = None,
    metrics: Sequence[str] | None = None,
    *,
    only_changed: bool = False,
) -> None:
    """The comparison as Markdown (the points-as-rows tables), CSV or JSON records (see the module docstring)."""
    if fmt in (Format.csv, Format.json):
        table = records_table(result)
        if only_changed:
            table = table.filter(pc.invert(pc.fill_null(pc.equal(table["verdict"], "SAME"), False)))
        write_records(table, fmt, stream)
        return
    parts = []
    for t in case_tables(result, metrics, only_changed=only_changed):
        parts += [f"### {t.title}", "", markdown([t.header(i) for i in range(len(t.heads))], t.plain_rows(), t.numeric)]
        parts += ["", *(f"({i}) {note}  " for i, note in enumerate(t.notes, 1))]
    parts += [f"{line}  " for line in legend(result)]
    if cross:
        parts += ["", "### across devices (share of each device's measured peak)", "", markdown(*cross_display(cross))]
        parts += ["", *(f"{line}  " for line in over_peak(cross))]
    stream.write("\n".join(parts).rstrip() + "\n")
