"""Rendering of a `CompareResult`: a terminal table, Markdown, CSV or JSON.

The table and Markdown read like the first seed's table: one row per case, point and device;
per metric each arm's median, then for each compared arm its ratio to the baseline -- the prefill
gap in % (`-3.0% [-3.1,-2.9] SLOWER`), the decode speedup as a factor (`2.67x [2.60,2.74] FASTER`)
-- with the 95 % interval and verdict; "about N more samples" of an AMBIGUOUS verdict goes to a
numbered footnote under the table, so every cell stays short. By default a case shows what the
seeds report and it measures: prefill and decode tok/s, peak memory, load time (a kernel case
measuring none of them shows its first metric, its time); `metrics` picks others.

CSV and JSON carry every number flat: medians, intervals, CVs, counts, ratios, verdicts, the
samples an AMBIGUOUS verdict needs.

A table is never folded to fit: when stdout is not a terminal (or the terminal is narrower than
the table), the console is widened to the table's natural width, so each row stays one line.
"""

from __future__ import annotations

import csv
import io
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from rich import box
from rich.console import Console
from rich.measure import Measurement
from rich.table import Table
from rich.text import Text

from orchestrator.compare import CompareResult, CrossDeviceRow, over_peak
from orchestrator.stats import Comparison, Verdict

FORMATS = ("table", "md", "csv", "json")
# What the seeds' table reports, in its order; a case shows those of them it measures.
DEFAULT_METRICS = ("prefill_tok_s", "decode_tok_s", "peak_memory_bytes", "load_seconds")
# Shown per arm without a ratio column, as in the seeds' table: one sample per job (memory, load
# and build time) or an accuracy check (rel_error) -- CSV and JSON still carry their ratios.
VALUE_ONLY = frozenset({"peak_memory_bytes", "load_seconds", "build_seconds", "rel_error"})
# The ratio column of a metric: its label, and whether it reads as a gap in % or a factor.
RATIO_LABELS = {"prefill_tok_s": ("prefill gap", True), "decode_tok_s": ("decode speedup", False)}
METRIC_LABELS = {
    "prefill_tok_s": "prefill tok/s",
    "decode_tok_s": "decode tok/s",
    "peak_memory_bytes": "peak",
    "load_seconds": "load",
    "build_seconds": "build",
    "seconds": "time",
    "gb_per_s": "GB/s",
    "tflop_per_s": "TFLOP/s",
    "rel_error": "rel err",
}


def metric_label(metric: str) -> str:
    """A short column label for a metric."""
    return METRIC_LABELS.get(metric, metric)


def ratio_label(metric: str) -> tuple[str, bool]:
    """The label of a metric's ratio column and whether its cells are a gap in % (else a factor)."""
    return RATIO_LABELS.get(metric, (f"{metric_label(metric)} ratio", False))


def _digits(value: float, n: int) -> str:
    """`n` significant digits with their trailing zeros (`8.00 ms` beside `7.75 ms`), no dangling point."""
    return f"{value:#.{n}g}".rstrip(".")


def format_value(metric: str, value: float) -> str:
    """A metric's value in the seeds' units: tok/s with 2 decimals, GB, s/ms/us, else 4 significant digits."""
    if value is None or not math.isfinite(value):
        return "-"
    if metric.endswith("_bytes"):
        for scale, unit in ((1e9, "GB"), (1e6, "MB"), (1e3, "kB")):
            if abs(value) >= scale:
                return f"{value / scale:.2f} {unit}"
        return f"{value:.0f} B"
    if metric == "load_seconds" or metric.endswith("_seconds"):
        return f"{value:.1f}s"
    if metric == "seconds":
        if value >= 1:
            return f"{_digits(value, 3)} s"
        return f"{_digits(value * 1e3, 3)} ms" if value >= 1e-3 else f"{_digits(value * 1e6, 3)} us"
    if metric == "rel_error":
        return f"{value:.1e}"
    if abs(value) >= 100 or metric.endswith("_tok_s"):
        return f"{value:.2f}"
    return _digits(value, 4)


def verdict_label(verdict: Verdict, metric: str) -> str:
    """FASTER/SLOWER for times and rates; LOWER/HIGHER (better/worse) for memory and errors."""
    if metric.endswith("_bytes") or metric == "rel_error":
        return {Verdict.FASTER: "LOWER", Verdict.SLOWER: "HIGHER"}.get(verdict, verdict.value)
    return verdict.value


def format_comparison(metric: str, c: Comparison, *, hint: bool = True) -> str:
    """`-3.0% [-3.1,-2.9] SLOWER` (a gap), or `2.67x [2.60,2.74] FASTER` (a factor).

    `hint` appends an AMBIGUOUS verdict's `(~N more samples)`; tables put it in a footnote instead.
    """
    r = c.ratio
    if not math.isfinite(r.ratio):
        return "-"
    gap = ratio_label(metric)[1]
    text = f"{(r.ratio - 1) * 100:+.1f}%" if gap else f"{r.ratio:.2f}x"
    if c.verdict is Verdict.TOO_FEW:
        return f"{text} ({c.note})"
    if gap:
        text += f" [{(r.ci_low - 1) * 100:+.1f},{(r.ci_high - 1) * 100:+.1f}]"
    else:
        text += f" [{r.ci_low:.2f},{r.ci_high:.2f}]"
    text += f" {verdict_label(c.verdict, metric)}"
    if hint and c.verdict is Verdict.AMBIGUOUS and c.more_samples:
        text += f" (~{c.more_samples} more samples)"
    return text


@dataclass
class CaseTable:
    """One case's table as text cells: headers as (side, label), rows, footnotes."""

    case: str
    title: str
    heads: list[tuple[str, str]]
    rows: list[list[str]]
    notes: list[str] = field(default_factory=list)
    numeric: list[bool] = field(default_factory=list)  # per column: right-justified

    def header(self, i: int, sep: str = " ") -> str:
        """Column `i`'s header, its side and label joined by `sep` (a newline in a terminal)."""
        return sep.join(part for part in self.heads[i] if part)


def shown_metrics(result: CompareResult, case: str, metrics: Sequence[str] | None = None) -> list[str]:
    """The metrics a case's table shows: `metrics` (all computed when None) that the case measures.

    With `metrics` None the seeds' `DEFAULT_METRICS`; a case measuring none of them shows its
    first metric (a kernel case's time).
    """
    have = result.metrics_of(case)
    if metrics is not None:
        return [m for m in metrics if m in have]
    return [m for m in DEFAULT_METRICS if m in have] or have[:1]


def case_tables(
    result: CompareResult, metrics: Sequence[str] | None = None, *, footnotes: bool = True
) -> list[CaseTable]:
    """Per case: headers, cells and footnotes of the seeds' layout.

    Args:
        result: the comparison.
        metrics: the metrics to show, where a case measures them (None: `DEFAULT_METRICS`).
        footnotes: put an AMBIGUOUS verdict's sample estimate in a numbered footnote (else inline).
    """
    out = []
    for case in result.varying:
        rows = [r for r in result.rows if r.case_name == case]
        sides, base = result.sides_of(case), result.baseline_of(case)
        params = result.varying.get(case, [])
        dims = list(rows[0].dims) if rows else []
        chosen = shown_metrics(result, case, metrics)
        heads = [("", k) for k in [*dims, *params]]
        numeric = [False] * len(dims) + [True] * len(params)
        for metric in chosen:
            heads += [(side, metric_label(metric)) for side in sides]
            numeric += [True] * len(sides)
            if metric not in VALUE_ONLY:
                heads += [(side, ratio_label(metric)[0]) for side in sides[1:]]
                numeric += [False] * (len(sides) - 1)
        table = CaseTable(case, f"{case} (baseline: {base})", heads, [], numeric=numeric)
        for row in rows:
            point = result.row_params(row)
            cells = [*row.dims.values(), *[point.get(k, "") for k in params]]
            where = " ".join([*row.dims.values(), *(f"{k}={point[k]}" for k in params if k in point)])
            for metric in chosen:
                for side in sides:
                    s = row.values.get((metric, side))
                    cells.append(format_value(metric, s.median) if s else "-")
                if metric in VALUE_ONLY:
                    continue
                for side in sides[1:]:
                    c = row.comparisons.get((metric, side))
                    text = format_comparison(metric, c, hint=not footnotes) if c else "-"
                    if footnotes and c and c.verdict is Verdict.AMBIGUOUS and c.more_samples:
                        table.notes.append(
                            f"{where}, {side} vs {base} {metric_label(metric)}: about {c.more_samples} more "
                            "samples per arm would settle it"
                        )
                        text += f" ({len(table.notes)})"
                    cells.append(text)
            table.rows.append(cells)
        out.append(table)
    return out


def legend(result: CompareResult) -> list[str]:
    """What the cells mean, and which points have no clean sample: printed once under the tables."""
    lines = [
        "Values are medians of clean samples. gap: the arm's median over the baseline's, minus 1; speedup and "
        "ratio: the same as a factor; [95 % bootstrap interval, over ABBA pairs where the sides share a job]; "
        f"FASTER/SLOWER: the whole interval past a {result.threshold:.0%} band around 1, SAME: inside it, "
        "AMBIGUOUS: across its edge; TOO FEW: under 5 samples per side."
    ]
    if result.fdr is not None and result.fdr.hypotheses:
        lines.append(result.fdr.describe())
    lines += [f"Heavy tails: {w}." for w in result.heavy_tails]
    if result.left_out:
        lines.append(f"Left out, no clean sample: {'; '.join(result.left_out)}.")
    return lines


def display_rows(result: CompareResult) -> dict[str, tuple[list[str], list[list[str]]]]:
    """Per case: the header and the cells of every row, every computed metric (the HTML report).

    An AMBIGUOUS cell carries its sample estimate inline (there is no footnote to point to).
    """
    return {
        t.case: ([t.header(i) for i in range(len(t.heads))], t.rows)
        for t in case_tables(result, result.metrics, footnotes=False)
    }


def records(result: CompareResult) -> list[dict[str, Any]]:
    """Flat records (one per row) with every number: for CSV, JSON and tests."""
    out = []
    for row in result.rows:
        rec: dict[str, Any] = {"case": row.case_name, **row.dims, **dict(row.point)}
        for (metric, side), s in sorted(row.values.items()):
            p = f"{side}.{metric}"
            rec.update({f"{p}.median": s.median, f"{p}.ci_low": s.ci_low, f"{p}.ci_high": s.ci_high})
            rec.update({f"{p}.cv": s.cv, f"{p}.n": s.n})
        for (metric, side), c in sorted(row.comparisons.items()):
            p = f"{side}/{result.baseline_of(row.case_name)}.{metric}"
            rec.update({f"{p}.ratio": c.ratio.ratio, f"{p}.ci_low": c.ratio.ci_low})
            rec.update({f"{p}.ci_high": c.ratio.ci_high, f"{p}.verdict": c.verdict.value})
            rec[f"{p}.more_samples"] = c.more_samples
            rec.update({f"{p}.paired": c.ratio.paired, f"{p}.p_value": c.p_value, f"{p}.note": c.note})
        out.append(rec)
    return out


def _json_safe(value: Any) -> Any:
    return None if isinstance(value, float) and not math.isfinite(value) else value


def _markdown(heads: list[str], body: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(heads) + " |", "|" + "---|" * len(heads)]
    return lines + ["| " + " | ".join(cells) + " |" for cells in body]


def render_text(
    result: CompareResult,
    fmt: str,
    cross: list[CrossDeviceRow] | None = None,
    metrics: Sequence[str] | None = None,
) -> str:
    """The comparison as Markdown, CSV or JSON text (`metrics`: the Markdown's columns)."""
    if fmt == "json":
        recs = [{k: _json_safe(v) for k, v in r.items()} for r in records(result)]
        doc: dict[str, Any] = {"by": result.by, "baseline": result.baseline, "rows": recs, "left_out": result.left_out}
        doc["fdr"] = result.fdr.describe() if result.fdr is not None else None
        doc["heavy_tails"] = result.heavy_tails
        if cross:
            doc["cross_device"] = cross_records(cross)
        return json.dumps(doc, indent=1)
    if fmt == "csv":
        return _csv(records(result))
    if fmt == "md":
        parts = []
        for t in case_tables(result, metrics):
            parts.append(f"### {t.title}\n")
            parts += _markdown([t.header(i) for i in range(len(t.heads))], t.rows)
            parts += ["", *(f"({i}) {note}  " for i, note in enumerate(t.notes, 1))]
            if t.notes:
                parts.append("")
        parts += [f"{line}  " for line in legend(result)] + [""]
        if cross:
            parts.append("### across devices (fraction of each device's measured peak)\n")
            parts += _markdown(*cross_display(cross))
            parts += ["", *over_peak(cross)]
        return "\n".join(parts) + "\n"
    raise ValueError(f"unknown format {fmt!r}")


def _csv(recs: list[dict[str, Any]]) -> str:
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=list(dict.fromkeys(k for r in recs for k in r)), lineterminator="\n")
    writer.writeheader()
    writer.writerows(recs)
    return buf.getvalue()


def rich_table(t: CaseTable) -> Table:
    """A case's table for the terminal: two-line headers (side over metric), cells never wrapped."""
    table = Table(title=t.title, title_justify="left", box=box.SIMPLE_HEAD, show_edge=False)
    for i, right in enumerate(t.numeric):
        table.add_column(Text(t.header(i, "\n")), justify="right" if right else "left", no_wrap=True)
    for cells in t.rows:
        table.add_row(*(Text(c) for c in cells))
    return table


def print_wide(out: Console, renderable: Table) -> None:
    """Print a table at its natural width, widening the console rather than folding cells."""
    needed = Measurement.get(out, out.options.update_width(100_000), renderable).maximum
    width = out.width
    out.width = max(width, needed)
    try:
        out.print(renderable)
    finally:
        out.width = width


def print_comparison(
    out: Console,
    result: CompareResult,
    cross: list[CrossDeviceRow] | None = None,
    metrics: Sequence[str] | None = None,
) -> None:
    """The comparison on a console: per case its table and footnotes, the legend, the cross-device view."""
    for t in case_tables(result, metrics):
        print_wide(out, rich_table(t))
        for i, note in enumerate(t.notes, 1):
            out.print(Text(f"({i}) {note}"))
        out.print()
    for line in legend(result):
        out.print(Text(line))
    if cross:
        out.print()
        print_cross(out, cross)


def print_cross(out: Console, cross: list[CrossDeviceRow]) -> None:
    """The cross-device view on a console, then a warning for every share above 100 %."""
    print_wide(out, cross_table(cross))
    for line in over_peak(cross):
        out.print(Text(line))


def cross_display(rows: list[CrossDeviceRow]) -> tuple[list[str], list[list[str]]]:
    """Header and cells of the cross-device view: `412.3 (52% of 790)` per device."""
    devices = sorted({d for r in rows for d in r.cells})
    heads = ["case", "point", "arm", "metric", *devices]
    body = []
    for r in rows:
        cells = [r.case_name, ", ".join(f"{k}={v}" for k, v in r.point), r.arm, metric_label(r.metric)]
        for dev in devices:
            cell = r.cells.get(dev)
            if cell is None:
                cells.append("-")
            elif cell.fraction is None:
                cells.append(f"{format_value(r.metric, cell.summary.median)} (no peak)")
            else:
                peak = format_value(r.metric, cell.peak or math.nan)
                cells.append(f"{format_value(r.metric, cell.summary.median)} ({cell.fraction:.0%} of {peak})")
        body.append(cells)
    return heads, body


def cross_records(rows: list[CrossDeviceRow]) -> list[dict[str, Any]]:
    """Flat records of the cross-device view."""
    out = []
    for r in rows:
        for dev, cell in sorted(r.cells.items()):
            out.append(
                {
                    "case": r.case_name,
                    **dict(r.point),
                    "arm": r.arm,
                    "metric": r.metric,
                    "device": dev,
                    "median": _json_safe(cell.summary.median),
                    "peak": cell.peak,
                    "fraction_of_peak": cell.fraction,
                    "over_peak": cell.fraction is not None and cell.fraction > 1.0,
                }
            )
    return out


def render_cross_text(rows: list[CrossDeviceRow], fmt: str) -> str:
    """The cross-device view alone as Markdown, CSV or JSON."""
    if fmt == "json":
        return json.dumps(cross_records(rows), indent=1) + "\n"
    if fmt == "csv":
        return _csv(cross_records(rows))
    return "\n".join([*_markdown(*cross_display(rows)), "", *over_peak(rows)]) + "\n"


def cross_table(rows: list[CrossDeviceRow]) -> Table:
    """The cross-device view as a rich table (cells never wrapped)."""
    heads, body = cross_display(rows)
    t = Table(
        title="across devices: share of each device's measured peak",
        title_justify="left",
        box=box.SIMPLE_HEAD,
        show_edge=False,
    )
    for h in heads:
        t.add_column(h, no_wrap=True)
    for cells in body:
        t.add_row(*(Text(c) for c in cells))
    return t
