"""Rendering of a `CompareResult`: a terminal table, Markdown, CSV or JSON.

Medians are shown with their interval's half-width (`121.77 ±0.8%`); a comparison to the
baseline reads like the seeds' tables -- a gap in % near parity (`-3.0%`), a factor further out
(`2.67x`) -- with its interval and verdict, and for AMBIGUOUS about how many more samples settle it.
CSV and JSON carry every number flat: medians, intervals, CVs, counts, ratios, verdicts.
"""

from __future__ import annotations

import csv
import io
import json
import math
from typing import Any

from rich.table import Table

from orchestrator.compare import CompareResult, CompareRow, CrossDeviceRow
from orchestrator.stats import Comparison, Summary, Verdict

FORMATS = ("table", "md", "csv", "json")
METRIC_LABELS = {
    "prefill_tok_s": "prefill tok/s",
    "decode_tok_s": "decode tok/s",
    "peak_memory_bytes": "peak",
    "load_seconds": "load",
    "seconds": "time",
    "gb_per_s": "GB/s",
    "tflop_per_s": "TFLOP/s",
    "rel_error": "rel err",
}


def metric_label(metric: str) -> str:
    """A short column label for a metric."""
    return METRIC_LABELS.get(metric, metric)


def format_value(metric: str, value: float) -> str:
    """A metric's value in the seeds' units: tok/s with 2 decimals, GB, seconds, ms."""
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
        return f"{value * 1e3:.3g} ms" if value >= 1e-3 else f"{value * 1e6:.3g} us"
    if metric == "rel_error":
        return f"{value:.1e}"
    if abs(value) >= 100:
        return f"{value:.2f}"
    return f"{value:.4g}"


def format_summary(metric: str, s: Summary) -> str:
    """`median ±half-width%` (the interval's half-width relative to the median)."""
    text = format_value(metric, s.median)
    if s.n > 1 and s.median and math.isfinite(s.ci_low) and math.isfinite(s.ci_high):
        half = (s.ci_high - s.ci_low) / 2 / abs(s.median) * 100
        text += f" ±{half:.1f}%"
    return text


def verdict_label(verdict: Verdict, metric: str) -> str:
    """FASTER/SLOWER for times and rates; LOWER/HIGHER (better/worse) for memory and errors."""
    if metric.endswith("_bytes") or metric == "rel_error":
        return {Verdict.FASTER: "LOWER", Verdict.SLOWER: "HIGHER"}.get(verdict, verdict.value)
    return verdict.value


def format_comparison(metric: str, c: Comparison, *, compact: bool = False) -> str:
    """`-3.0% [-4.1, -1.9] SLOWER`, or `2.67x [2.60, 2.74] FASTER` for large changes.

    `compact` gives the interval as a half-width: `-3.0% ±1.1 SLOWER` (terminal tables).
    """
    r = c.ratio
    if not math.isfinite(r.ratio):
        return "-"
    pct = 0.5 <= r.ratio <= 1.5
    if compact:
        half = (r.ci_high - r.ci_low) / 2
        text = f"{(r.ratio - 1) * 100:+.1f}% ±{half * 100:.1f}" if pct else f"{r.ratio:.2f}x ±{half:.2f}"
    elif pct:
        text = f"{(r.ratio - 1) * 100:+.1f}% [{(r.ci_low - 1) * 100:+.1f}, {(r.ci_high - 1) * 100:+.1f}]"
    else:
        text = f"{r.ratio:.2f}x [{r.ci_low:.2f}, {r.ci_high:.2f}]"
    text += f" {verdict_label(c.verdict, metric)}"
    if c.verdict is Verdict.AMBIGUOUS and c.more_samples:
        text += f" (~{c.more_samples} more samples)"
    return text


def _headers(result: CompareResult, case: str, rows: list[CompareRow]) -> list[str]:
    dims = list(rows[0].dims) if rows else []
    heads = [*dims, *result.varying.get(case, [])]
    sides, base = result.sides_of(case), result.baseline_of(case)
    for metric in result.metrics:
        if not any((metric, side) in r.values for r in rows for side in sides):
            continue
        heads += [f"{side} {metric_label(metric)}" for side in sides]
        heads += [f"{side}/{base} {metric_label(metric)}" for side in sides[1:]]
    return heads


def display_rows(result: CompareResult, *, compact: bool = False) -> dict[str, tuple[list[str], list[list[str]]]]:
    """Per case: the header and the formatted cells of every row (`compact`: for a terminal)."""
    out: dict[str, tuple[list[str], list[list[str]]]] = {}
    for case in result.varying:
        rows = [r for r in result.rows if r.case_name == case]
        heads = _headers(result, case, rows)
        sides = result.sides_of(case)
        body = []
        for row in rows:
            params = result.row_params(row)
            cells = [*row.dims.values(), *[params.get(k, "") for k in result.varying.get(case, [])]]
            for metric in result.metrics:
                if not any((metric, side) in r.values for r in rows for side in sides):
                    continue
                for side in sides:
                    s = row.values.get((metric, side))
                    text = (format_value(metric, s.median) if compact else format_summary(metric, s)) if s else "-"
                    cells.append(text)
                for side in sides[1:]:
                    c = row.comparisons.get((metric, side))
                    cells.append(format_comparison(metric, c, compact=compact) if c else "-")
            body.append(cells)
        out[case] = (heads, body)
    return out


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
        out.append(rec)
    return out


def _json_safe(value: Any) -> Any:
    return None if isinstance(value, float) and not math.isfinite(value) else value


def render_text(result: CompareResult, fmt: str, cross: list[CrossDeviceRow] | None = None) -> str:
    """The comparison as Markdown, CSV or JSON text."""
    if fmt == "json":
        recs = [{k: _json_safe(v) for k, v in r.items()} for r in records(result)]
        doc: dict[str, Any] = {"by": result.by, "baseline": result.baseline, "rows": recs}
        if cross:
            doc["cross_device"] = cross_records(cross)
        return json.dumps(doc, indent=1)
    if fmt == "csv":
        recs = records(result)
        fields = list(dict.fromkeys(k for r in recs for k in r))
        buf = io.StringIO()
        writer = csv.DictWriter(buf, fieldnames=fields, lineterminator="\n")
        writer.writeheader()
        writer.writerows(recs)
        return buf.getvalue()
    if fmt == "md":
        parts = []
        for case, (heads, body) in display_rows(result).items():
            parts.append(f"### {case} (baseline: {result.baseline_of(case)})\n")
            parts.append("| " + " | ".join(heads) + " |")
            parts.append("|" + "---|" * len(heads))
            parts += ["| " + " | ".join(cells) + " |" for cells in body]
            parts.append("")
        if cross:
            heads, body = cross_display(cross)
            parts.append("### across devices (fraction of each device's measured peak)\n")
            parts.append("| " + " | ".join(heads) + " |")
            parts.append("|" + "---|" * len(heads))
            parts += ["| " + " | ".join(cells) + " |" for cells in body]
        return "\n".join(parts) + "\n"
    raise ValueError(f"unknown format {fmt!r}")


def render_tables(result: CompareResult, cross: list[CrossDeviceRow] | None = None) -> list[Table]:
    """The comparison as rich tables for the terminal (one per case, then the cross-device view)."""
    tables = []
    for case, (heads, body) in display_rows(result, compact=True).items():
        t = Table(title=f"{case} (baseline: {result.baseline_of(case)})", show_lines=False)
        for h in heads:
            t.add_column(h, overflow="fold")
        for cells in body:
            t.add_row(*cells)
        tables.append(t)
    if cross:
        tables.append(cross_table(cross))
    return tables


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
                }
            )
    return out


def render_cross_text(rows: list[CrossDeviceRow], fmt: str) -> str:
    """The cross-device view alone as Markdown, CSV or JSON."""
    if fmt == "json":
        return json.dumps(cross_records(rows), indent=1) + "\n"
    if fmt == "csv":
        recs = cross_records(rows)
        buf = io.StringIO()
        writer = csv.DictWriter(buf, fieldnames=list(dict.fromkeys(k for r in recs for k in r)), lineterminator="\n")
        writer.writeheader()
        writer.writerows(recs)
        return buf.getvalue()
    heads, body = cross_display(rows)
    lines = ["| " + " | ".join(heads) + " |", "|" + "---|" * len(heads)]
    lines += ["| " + " | ".join(cells) + " |" for cells in body]
    return "\n".join(lines) + "\n"


def cross_table(rows: list[CrossDeviceRow]) -> Table:
    """The cross-device view as a rich table."""
    heads, body = cross_display(rows)
    t = Table(title="across devices: share of each device's measured peak")
    for h in heads:
        t.add_column(h, overflow="fold")
    for cells in body:
        t.add_row(*cells)
    return t
