"""The report's tables as plain cells for the template: text, CSS class, an arm's colour swatch.

Every number goes through the report's one value formatter (`compare_render.format_value`) and
every ratio through `format_comparison`, so a cell reads as it does in `orchestrate compare`.
Arms are rows (one row per point and arm) so a table of seven arms still fits a 1400 px window;
numbers are right-aligned, verdict cells carry their verdict as a class (coloured by the CSS).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import pyarrow as pa

from orchestrator.analysis.compare import CompareResult, point_sort_key, varying_params
from orchestrator.analysis.criteria import bound_text
from orchestrator.analysis.cross_device import CrossDeviceRow
from orchestrator.analysis.groups import Point
from orchestrator.analysis.same_output import OutputVerdict, rule_text
from orchestrator.analysis.verdicts import CriterionVerdict, Outcome, PointResult, overall
from orchestrator.report.style import ArmStyles, with_unit
from orchestrator.report.text import (
    VALUE_ONLY,
    format_comparison,
    format_value,
    metric_label,
    ratio_label,
    shown_metrics,
)

FINGERPRINT_COLUMNS = (
    "device",
    "backend",
    "hostname",
    "gpu",
    "gpu_driver",
    "cpu",
    "cpu_count",
    "memory_bytes",
    "os",
    "mlx_version",
    "mlx_device",
    "fingerprint_id",
)
NUMERIC_FINGERPRINT = frozenset({"cpu_count", "memory_bytes"})


@dataclass
class Cell:
    """One table cell."""

    text: str
    cls: str = ""  # "num" right-aligns; a verdict name colours it
    swatch: str | None = None  # an arm's colour, shown before the text
    group: bool = False  # the first row of a new point (a rule above it)
    sub: str = ""  # a second, smaller line
    more: list[str] = field(default_factory=list)  # lines folded under a <details> disclosure (no script)


@dataclass
class TableView:
    """Headers and rows of one table."""

    heads: list[Cell]
    rows: list[list[Cell]]
    cls: str = ""
    notes: list[str] = field(default_factory=list)


def _params_text(point: Point, names: list[str]) -> list[str]:
    values = dict(point)
    return [values.get(n, "") for n in names]


def comparison_table(result: CompareResult, case: str, device: str, styles: ArmStyles) -> TableView:
    """One case on one device: a row per point and arm, each shown metric's median and ratio."""
    rows = [r for r in result.rows if r.case_name == case and r.dims.get("device") == device]
    sides, base = result.sides_of(case), result.baseline_of(case)
    params = result.varying.get(case, [])
    metrics = shown_metrics(result, case)
    heads = [Cell(p, "num") for p in params] + [Cell("arm")]
    for metric in metrics:
        heads.append(Cell(metric_label(metric), "num"))
        if metric not in VALUE_ONLY:
            heads.append(Cell(f"{ratio_label(metric)[0]} vs {base}", "num"))
    body: list[list[Cell]] = []
    for row in rows:
        first = True
        for side in sides:
            if not any((m, side) in row.values for m in metrics):
                continue
            cells = [Cell(t if first else "", "num", group=first) for t in _params_text(row.point, params)]
            cells.append(Cell(side, "arm", swatch=styles.colour(side), group=first))
            for metric in metrics:
                s = row.values.get((metric, side))
                cells.append(Cell(format_value(metric, s.median) if s else "-", "num", group=first))
                if metric in VALUE_ONLY:
                    continue
                c = row.comparisons.get((metric, side))
                if side == base:
                    cells.append(Cell("baseline" if s else "-", "num muted", group=first))
                elif c is None:
                    cells.append(Cell("-", "num", group=first))
                else:
                    cells.append(Cell(format_comparison(metric, c), f"num {c.verdict.value}", group=first))
            body.append(cells)
            first = False
    return TableView(heads, body, "compare")


def device_verdict(v: CriterionVerdict, device: str) -> CriterionVerdict:
    """A criterion's verdict on one device's points alone (the rule of `criteria.evaluate_criterion`)."""
    missing = [m for m in v.missing if m.device == device]
    if isinstance(v, OutputVerdict):
        outputs = [p for p in v.outputs if p.device == device]
        outcome = (
            v.outcome
            if v.outcome is Outcome.SKIPPED
            else overall({p.outcome for p in outputs}, bool(missing) or not outputs)
        )
        return OutputVerdict(v.criterion, v.baseline, outcome, [], missing, v.shown, outputs, v.note)
    points = [p for p in v.points if p.device == device]
    return CriterionVerdict(
        v.criterion,
        v.baseline,
        overall({p.outcome for p in points}, bool(missing) or not points),
        points,
        missing,
        v.shown,
    )


def applies(v: CriterionVerdict) -> bool:
    """Whether a (device's) verdict has anything to show: points judged or missing, or a reason it was skipped."""
    judged = v.outputs if isinstance(v, OutputVerdict) else v.points
    return bool(judged or v.missing or v.outcome is Outcome.SKIPPED)


def criteria_table(verdicts: list[CriterionVerdict]) -> TableView:
    """Verdict, criterion, its rule, how many points it judged, the worst one and every non-passing point."""
    heads = [Cell("verdict"), Cell("criterion and its rule"), Cell("points judged", "num"), Cell("worst point", "num")]
    heads.append(Cell("points not passing, missing"))
    body = []
    for v in verdicts:
        c = v.criterion
        if isinstance(v, OutputVerdict):
            body.append(_output_row(v))
            continue
        rule = f"{c.arm} / {v.baseline} {metric_label(c.metric)} {bound_text(c)}"
        rule += f" where {c.where}" if c.where else ""
        rule += f" (case {c.case})" if c.case else ""
        worst = v.worst()
        worst_text = "-"
        if worst is not None:
            r = worst.ratio
            worst_text = f"{r.ratio:.3f} [{r.ci_low:.3f}, {r.ci_high:.3f}] at {_short_label(v, worst)}"
        failing = sum(p.outcome is not Outcome.PASS for p in v.points)
        summary = ", ".join(
            part
            for part in (f"{failing} not passing" if failing else "", f"{len(v.missing)} missing" if v.missing else "")
            if part
        )
        judged = f"{len(v.points)} of {len(v.points) + len(v.missing)}"
        body.append(
            [
                Cell(v.outcome.value, f"verdict {v.outcome.value}"),
                Cell(c.name, sub=rule),
                Cell(judged, "num"),
                Cell(worst_text, "num"),
                Cell(summary or "every point passes", "details", more=criterion_details(v) if summary else []),
            ]
        )
    return TableView(heads, body, "criteria")


def _output_row(v: OutputVerdict) -> list[Cell]:
    """A same-output criterion's row: outputs compared instead of ratios."""
    c = v.criterion
    rule = rule_text(v) + (f" where {c.where}" if c.where else "") + (f" (case {c.case})" if c.case else "")
    failing = [p for p in v.outputs if p.outcome is not Outcome.PASS]
    first = next((p for p in failing if p.outcome is Outcome.FAIL), failing[0] if failing else None)
    worst = f"{first.detail} at {_short_label_of(v, first.case_name, first.point)}" if first else "-"
    parts = [f"{len(failing)} not passing" if failing else "", f"{len(v.missing)} missing" if v.missing else ""]
    summary = ", ".join(p for p in parts if p) or (v.note if v.outcome is Outcome.SKIPPED else "")
    lines = [f"{p.outcome.value} {_short_label_of(v, p.case_name, p.point)} ({p.where}): {p.detail}" for p in failing]
    lines += [f"MISSING {_short_label_of(v, m.case_name, m.point)}: {m.reason}" for m in v.missing]
    judged = "-" if v.outcome is Outcome.SKIPPED else f"{len(v.outputs)} of {len(v.outputs) + len(v.missing)}"
    return [
        Cell(v.outcome.value, f"verdict {v.outcome.value}"),
        Cell(c.name, sub=rule),
        Cell(judged, "num"),
        Cell(worst, "num"),
        Cell(summary or "every point identical", "details", more=lines),
    ]


def criterion_details(v: CriterionVerdict) -> list[str]:
    """Each point that does not pass with its ratio, then the missing ones grouped by why, compactly."""
    lines = []
    for p in v.points:
        if p.outcome is not Outcome.PASS:
            r = p.ratio
            more = f", ~{p.more_samples} more samples" if p.more_samples else f" ({p.note})" if p.note else ""
            lines.append(
                f"{p.outcome.value} {_short_label(v, p)}: {r.ratio:.3f} [{r.ci_low:.3f}, {r.ci_high:.3f}] "
                f"n={r.n_a}/{r.n_b}{more}"
            )
    missing: dict[tuple[str, str], list[Point]] = {}
    for m in v.missing:
        missing.setdefault((m.case_name, m.reason), []).append(m.point)
    for (case, reason), pts in missing.items():
        names = v.shown.get(case) or sorted({k for p in pts for k, _ in p})
        if len(names) == 1:
            where = f"{case} {names[0]}=" + ", ".join(dict(p).get(names[0], "?") for p in pts)
        else:
            where = "; ".join(_short_label_of(v, case, p) for p in pts)
        lines.append(f"MISSING {where}: {reason}")
    return lines or ["all pass"]


def overview_table(verdicts: list[CriterionVerdict], devices: list[str]) -> TableView:
    """Criteria down, devices across: each criterion's verdict on each device's points alone."""
    heads = [Cell("criterion")] + [Cell(d) for d in devices]
    body = []
    for v in verdicts:
        cells = [Cell(v.criterion.name)]
        for device in devices:
            dv = device_verdict(v, device)
            if not applies(dv):
                cells.append(Cell("does not apply", "muted"))
                continue
            worst = dv.worst()
            text = dv.outcome.value + (f" (worst {worst.ratio.ratio:.3f})" if worst is not None else "")
            cells.append(Cell(text, f"verdict {dv.outcome.value}"))
        body.append(cells)
    return TableView(heads, body, "overview")


def _short_label(v: CriterionVerdict, p: PointResult) -> str:
    """`qmm tokens=4096`: a point without its device (the section names the device)."""
    return _short_label_of(v, p.case_name, p.point)


def _short_label_of(v: CriterionVerdict, case: str, point: Point) -> str:
    return v.label("", case, point).strip()


def cross_table(rows: list[CrossDeviceRow], styles: ArmStyles) -> TableView:
    """One case across devices: each device's median and its share of that device's measured peak."""
    devices = sorted({d for r in rows for d in r.cells})
    params = varying_params(r.point for r in rows)
    heads = [Cell(p, "num") for p in params] + [Cell("arm"), Cell("metric")]
    heads += [Cell(f"{d}: median, share of its peak", "num") for d in devices]
    body = []
    notes = []
    for r in sorted(rows, key=lambda r: (r.metric, point_sort_key(r.point), r.arm)):
        cells = [Cell(t, "num") for t in _params_text(r.point, params)]
        cells += [Cell(r.arm, "arm", swatch=styles.colour(r.arm)), Cell(metric_label(r.metric))]
        for dev in devices:
            cell = r.cells.get(dev)
            if cell is None:
                cells.append(Cell("-", "num"))
                continue
            value = with_unit(r.metric, cell.summary.median)
            if cell.fraction is None:
                cells.append(Cell(f"{value} (no measured peak)", "num"))
                continue
            share = f"{cell.fraction:.0%}" if cell.fraction >= 0.1 else f"{cell.fraction:.1%}"
            text = f"{value}: {share} of {format_value(r.metric, cell.peak or math.nan)}"
            cls = "num"
            if cell.beat_probe:
                cls += " warn"
                where = " ".join(f"{k}={v}" for k, v in r.point if k in params)
                notes.append(
                    f"{dev} {r.case_name} {where} {r.arm}: {metric_label(r.metric)} beat the device's probed peak "
                    f"({format_value(r.metric, cell.probed or math.nan)}), so that device's shares are of the best "
                    "rate measured there: its probe was too low (taken while the machine was busy, or short of its "
                    "best clocks)"
                )
            cells.append(Cell(text, cls))
        body.append(cells)
    return TableView(heads, body, "cross", notes)


def hosts_table(table: pa.Table) -> TableView:
    """One row per host fingerprint, with the peaks measured on it."""
    cols = [c for c in FINGERPRINT_COLUMNS if c in table.column_names]
    heads = [Cell(c.replace("_", " "), "num" if c in NUMERIC_FINGERPRINT else "") for c in cols]
    heads += [Cell("peak copy", "num"), Cell("peak FLOP rate", "num")]
    seen: dict[str, list[Cell]] = {}
    for row in table.select([*cols, "peak_copy_gb_s", "peak_tflop_s"]).to_pylist():
        fid = str(row["fingerprint_id"])
        if fid in seen:
            continue
        cells = []
        for c in cols:
            value = row[c]
            if c == "memory_bytes" and value is not None:
                cells.append(Cell(format_value("memory_bytes", float(value)), "num"))
            else:
                cells.append(Cell("" if value is None else str(value), "num" if c in NUMERIC_FINGERPRINT else ""))
        for metric, col in (("gb_per_s", "peak_copy_gb_s"), ("tflop_per_s", "peak_tflop_s")):
            cells.append(Cell(with_unit(metric, row[col]) if row[col] else "not measured", "num"))
        seen[fid] = cells
    return TableView(heads, list(seen.values()), "hosts")
