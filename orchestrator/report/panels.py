"""The report's panels from the comparison and the criteria: what each chart shows, not how.

`CaseAxes` fixes, per case, the x parameter (a prompt length where one varies) and numbers the
combinations of the other varying parameters, so a series is one arm at one such combination in
every chart. `headline_panels` turns a device's criteria into the headline chart's panels (ratio
per point with its interval, each bound on its arm and points, the points it could not judge);
`gap_panels` and `metric_panels` make the details' charts of one case on one device;
`share_panels` the device-by-device view.
"""

from __future__ import annotations

from collections import defaultdict

from orchestrator.analysis.compare import CompareResult, varying_params
from orchestrator.analysis.cross_device import CrossDeviceRow
from orchestrator.analysis.groups import Point
from orchestrator.analysis.verdicts import CriterionVerdict, Outcome, PointResult
from orchestrator.report.plots import Bound, MetricPanel, RatioPanel, Series, SharePanel
from orchestrator.report.text import VALUE_ONLY, metric_label, shown_metrics

LENGTH_PARAMS = ("prompt_tokens", "tokens")
# (x, y, interval low, interval high) per (arm, point)
Entries = dict[tuple[str, Point], list[tuple[float, float, float, float]]]


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def x_param(points: list[Point]) -> str | None:
    """The parameter on a case's x axis: a length if it varies, else the first numeric one that does."""
    for name in varying_params(points):
        values = {v for p in points for k, v in p if k == name}
        if all(_is_number(v) for v in values) and (name in LENGTH_PARAMS or len(values) > 1):
            return name
    return None


class CaseAxes:
    """Per case: the x parameter, and an index for each combination of the other varying parameters."""

    def __init__(self, result: CompareResult) -> None:
        self.xparam: dict[str, str | None] = {}
        self.others: dict[str, list[str]] = {}
        self.variants: dict[str, dict[Point, int]] = {}
        for case in result.varying:
            points = sorted({r.point for r in result.rows if r.case_name == case})
            x = self.xparam[case] = x_param(points)
            self.others[case] = [n for n in result.varying[case] if n != x]
            extras = sorted({self.extra(case, p) for p in points})
            self.variants[case] = {e: i for i, e in enumerate(extras)}

    def extra(self, case: str, point: Point) -> Point:
        """The point's values of the varying parameters besides x."""
        return tuple(kv for kv in point if kv[0] in self.others.get(case, []))

    def x(self, case: str, point: Point) -> float:
        """The point's x value (0 for a case without an x parameter)."""
        name = self.xparam.get(case)
        values = dict(point)
        return float(values[name]) if name and name in values else 0.0

    def series(self, case: str, entries: Entries) -> list[Series]:
        """Series from `(arm, point) -> [(x, y, low, high)]`, one per arm and variant, x sorted."""
        grouped: Entries = defaultdict(list)
        for (arm, point), values in entries.items():
            grouped[(arm, self.extra(case, point))].extend(values)
        out = []
        for (arm, extra), values in grouped.items():
            values.sort()
            label = " ".join([arm, *(f"{k}={v}" for k, v in extra)])
            xs, ys, lows, highs = (list(c) for c in zip(*values, strict=True))
            out.append(Series(arm, label, xs, ys, lows, highs, self.variants[case].get(extra, 0)))
        return out


def criterion_bounds(verdict: CriterionVerdict, case: str, axes: CaseAxes) -> list[Bound]:
    """A criterion's bounds on one case: on its arm, at the x values of the points it judges there."""
    c = verdict.criterion
    xs = [axes.x(case, p.point) for p in verdict.points if p.case_name == case]
    xs += [axes.x(case, m.point) for m in verdict.missing if m.case_name == case]
    out: list[Bound] = []
    for value, op in ((c.min_ratio, ">="), (c.max_ratio, "<=")):
        if value is not None and xs:
            out.append(Bound(c.arm, value, op, sorted(set(xs))))
    return out


def _ratio_entries(points: list[PointResult], case: str, arm: str, axes: CaseAxes) -> Entries:
    entries: Entries = defaultdict(list)
    for p in points:
        if p.case_name == case:
            entries[(arm, p.point)].append((axes.x(case, p.point), p.ratio.ratio, p.ratio.ci_low, p.ratio.ci_high))
    return entries


def headline_panels(verdicts: list[CriterionVerdict], axes: CaseAxes) -> list[RatioPanel]:
    """One panel per case, metric and baseline the criteria judge on a device: ratios, bounds, missing points."""
    panels: dict[tuple[str, str, str], RatioPanel] = {}
    outcomes: dict[tuple[str, str, str], set[Outcome]] = defaultdict(set)
    for v in verdicts:
        c = v.criterion
        if c.kind != "ratio":
            continue  # a same-output criterion compares outputs: no ratio to chart
        for case in dict.fromkeys([p.case_name for p in v.points] + [m.case_name for m in v.missing]):
            key = (case, c.metric, v.baseline)
            panel = panels.setdefault(key, RatioPanel("", c.metric, axes.xparam.get(case), v.baseline, []))
            outcomes[key].add(v.outcome)
            have = {s.label for s in panel.series}
            new = axes.series(case, _ratio_entries(v.points, case, c.arm, axes))
            panel.series += [s for s in new if s.label not in have]
            panel.bounds += criterion_bounds(v, case, axes)
            panel.missing += [axes.x(case, m.point) for m in v.missing if m.case_name == case]
    for (case, metric, baseline), panel in panels.items():
        seen = outcomes[(case, metric, baseline)]
        worst = next(o for o in (Outcome.FAIL, Outcome.AMBIGUOUS, Outcome.PASS) if o in seen)
        arms = "/".join(dict.fromkeys(b.arm for b in panel.bounds))
        panel.title = f"{case}: {arms} {metric_label(metric)} — {worst.value}"
    return list(panels.values())


def gap_panels(
    result: CompareResult, case: str, device: str, axes: CaseAxes, bounds: dict[str, list[Bound]], threshold: float
) -> list[RatioPanel]:
    """The gap chart's panels: each compared metric's ratio to the baseline per arm, its bounds drawn."""
    rows = [r for r in result.rows if r.case_name == case and r.dims.get("device") == device]
    metrics = [m for m in shown_metrics(result, case) if m not in VALUE_ONLY]
    metrics += [m for m in bounds if m not in metrics]
    base = result.baseline_of(case)
    panels = []
    for metric in metrics:
        entries: Entries = defaultdict(list)
        for row in rows:
            for (m, side), c in row.comparisons.items():
                if m == metric:
                    r = c.ratio
                    entries[(side, row.point)].append((axes.x(case, row.point), r.ratio, r.ci_low, r.ci_high))
        order = {s: i for i, s in enumerate(result.sides_of(case))}
        series = sorted(axes.series(case, entries), key=lambda s: (order.get(s.arm, 99), s.label))
        if series:
            title = f"{metric_label(metric)}: each arm to {base}"
            panels.append(
                RatioPanel(
                    title, metric, axes.xparam.get(case), base, series, bounds.get(metric, []), threshold=threshold
                )
            )
    return panels


def metric_panels(result: CompareResult, case: str, device: str, axes: CaseAxes) -> list[MetricPanel]:
    """Every metric of a case on a device: medians with intervals per arm."""
    rows = [r for r in result.rows if r.case_name == case and r.dims.get("device") == device]
    order = {s: i for i, s in enumerate(result.sides_of(case))}
    panels = []
    for metric in result.metrics_of(case):
        entries: Entries = defaultdict(list)
        for row in rows:
            for (m, side), s in row.values.items():
                if m == metric:
                    entries[(side, row.point)].append((axes.x(case, row.point), s.median, s.ci_low, s.ci_high))
        series = sorted(axes.series(case, entries), key=lambda s: (order.get(s.arm, 99), s.label))
        if series:
            panels.append(MetricPanel(metric, metric_label(metric), axes.xparam.get(case), series))
    return panels


def share_panels(rows: list[CrossDeviceRow], case: str, axes: CaseAxes, arm_order: list[str]) -> list[SharePanel]:
    """Per metric and arm of a case: each device's median as a % of that device's measured peak."""
    order = {a: i for i, a in enumerate(arm_order)}
    panels: dict[tuple[str, str], dict[str, list[tuple[float, float, float, float]]]] = {}
    for r in rows:
        if r.case_name != case:
            continue
        for device, cell in r.cells.items():
            if not cell.peak:
                continue
            label = " ".join([device, *(f"{k}={v}" for k, v in axes.extra(case, r.point))])
            s, peak = cell.summary, cell.peak / 100
            values = (axes.x(case, r.point), s.median / peak, s.ci_low / peak, s.ci_high / peak)
            panels.setdefault((r.metric, r.arm), {}).setdefault(label, []).append(values)
    out = []
    for (metric, arm), by_device in sorted(panels.items(), key=lambda kv: (kv[0][0], order.get(kv[0][1], 99))):
        series = []
        for label, points in sorted(by_device.items()):
            points.sort()
            xs, ys, lows, highs = (list(c) for c in zip(*points, strict=True))
            series.append(Series(arm, label, xs, ys, lows, highs))
        out.append(SharePanel(arm, metric, axes.xparam.get(case), series))
    return out
