"""The report's charts, each a grid of panels returned as inline SVG (`report_style.chart`).

* `metric_chart`: one device and case; each metric's median against the x parameter, a series
  per arm with its 95 % bootstrap interval (a band along three or more x values, dodged error
  bars otherwise), in the unit the tables print.
* `ratio_chart`: ratios to the baseline in the tables' unit (a gap in % or a factor), with
  intervals; the baseline's parity line in its own style; the SAME band; each criterion's bound
  drawn only on its arm, its metric and the points it judges, and labelled. The headline uses it
  for the criteria (points it could not judge marked as missing), the details for the gap charts.
* `share_chart`: the device-by-device view: per arm, each device's rate as a share of that
  device's own measured peak (raised to the best rate measured there where a rate beat the probe:
  `orchestrator.analysis.cross_device`).
* `history_chart`: per host, run medians over time, per arm, with the flagged steps marked.
"""

from __future__ import annotations

import datetime as dt
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import matplotlib
from markupsafe import Markup
from matplotlib.axes import Axes
from matplotlib.dates import AutoDateLocator, ConciseDateFormatter
from matplotlib.figure import Figure

from orchestrator.analysis.groups import higher_is_better
from orchestrator.report.style import (
    BASELINE_COLOUR,
    DEVICE_STYLES,
    MARKERS,
    QUANTITIES,
    RC,
    ArmStyles,
    XAxis,
    axis_label,
    axis_unit,
    chart,
    figure,
    plain_numbers,
    svg_markup,
    x_axis,
)
from orchestrator.report.text import ratio_label


@dataclass
class Series:
    """One arm's values (or ratios) along x, with interval ends; `variant` tells apart other parameters."""

    arm: str
    label: str
    xs: list[float]
    ys: list[float]
    lows: list[float]
    highs: list[float]
    variant: int = 0


@dataclass
class Bound:
    """A criterion's bound on one arm: `ratio op value` at the x values it judges."""

    arm: str
    value: float  # a raw ratio arm / baseline
    op: str  # ">=" or "<="
    xs: list[float]


@dataclass
class RatioPanel:
    """One metric's ratios to the baseline (raw `arm / baseline`)."""

    title: str
    metric: str
    xparam: str | None
    baseline: str
    series: list[Series]
    bounds: list[Bound] = field(default_factory=list)
    missing: list[float] = field(default_factory=list)  # x values the criterion could not judge
    threshold: float | None = None  # draw the SAME band of the verdicts


def _finite(v: float, fallback: float) -> float:
    return v if math.isfinite(v) else fallback


def _draw(ax: Axes, axis: XAxis, series: Sequence[Series], styles: ArmStyles, *, band: bool, scale: float) -> None:
    """Each series in its arm's style: a line with a band, or dodged error bars."""
    for slot, s in enumerate(series):
        style = styles[s.arm].line()
        if s.variant:
            style["marker"] = MARKERS[(MARKERS.index(style["marker"]) + s.variant) % len(MARKERS)]
        ys = [y / scale for y in s.ys]
        lows = [_finite(lo, y) / scale for lo, y in zip(s.lows, s.ys, strict=True)]
        highs = [_finite(hi, y) / scale for hi, y in zip(s.highs, s.ys, strict=True)]
        xs = [axis.pos(x, slot, len(series)) for x in s.xs]
        if band and axis.kind != "category" and len(s.xs) > 1:
            ax.plot(xs, ys, markersize=3.5, label=s.label, **style)
            ax.fill_between(xs, lows, highs, color=style["color"], alpha=0.18, linewidth=0)
            continue
        err = [[max(y - lo, 0.0) for y, lo in zip(ys, lows, strict=True)]]
        err.append([max(hi - y, 0.0) for y, hi in zip(ys, highs, strict=True)])
        if axis.kind == "category" or not band:  # a line would run across points that were not measured
            style["linestyle"] = "none"
        ax.errorbar(xs, ys, yerr=err, capsize=2.5, markersize=4, linewidth=1, elinewidth=1, label=s.label, **style)


@dataclass
class MetricPanel:
    """One metric's medians along x, per arm."""

    metric: str
    title: str
    xparam: str | None
    series: list[Series]


def metric_chart(title: str, panels: list[MetricPanel], styles: ArmStyles, *, uid: str) -> Markup:
    """Each metric against x per arm with its interval (see the module docstring)."""

    def draw(ax: Axes, i: int) -> None:
        p = panels[i]
        axis = x_axis(p.xparam, [x for s in p.series for x in s.xs])
        scale, unit = axis_unit(p.metric, [v for s in p.series for v in (*s.ys, *s.highs)])
        _draw(ax, axis, p.series, styles, band=True, scale=scale)
        axis.apply(ax)
        plain_numbers(ax)
        ax.set_title(p.title)
        ax.set_ylabel(axis_label(p.metric, unit))

    return chart(title, len(panels), draw, uid=uid)


def ratio_unit(metric: str, baseline: str) -> tuple[bool, str]:
    """(percent?, y label): a gap in % or a factor, as the metric's table column reads."""
    name, percent = ratio_label(metric)
    better = "↑ better" if higher_is_better(metric) else "↓ better"
    return percent, f"{name} to {baseline} ({'%' if percent else '×'}, {better})"


def _shown(value: float, percent: bool) -> float:
    return (value - 1) * 100 if percent else value


def _all_shown(values: list[float], percent: bool) -> list[float]:
    return [_shown(v, percent) for v in values]


def _bound_text(bound: Bound, percent: bool) -> str:
    op = "≥" if bound.op == ">=" else "≤"
    if percent:
        return f"{op} {_shown(bound.value, True):+.1f} % (ratio {bound.value:g})"
    return f"{op} {bound.value:g}×"


def ratio_chart(
    title: str,
    panels: list[RatioPanel],
    styles: ArmStyles,
    *,
    uid: str,
    cols: int = 3,
    size: tuple[float, float] = (4.1, 2.7),
) -> Markup:
    """Ratios to the baseline with intervals, parity, SAME band and bounds (module docstring)."""

    def draw(ax: Axes, i: int) -> None:
        p = panels[i]
        percent, ylabel = ratio_unit(p.metric, p.baseline)
        xs = [x for s in p.series for x in s.xs] + [x for b in p.bounds for x in b.xs] + p.missing
        axis = x_axis(p.xparam, xs)
        shown = [
            Series(
                s.arm,
                s.label,
                s.xs,
                _all_shown(s.ys, percent),
                _all_shown(s.lows, percent),
                _all_shown(s.highs, percent),
                s.variant,
            )
            for s in p.series
        ]
        parity = 0.0 if percent else 1.0
        ax.axhline(parity, color=BASELINE_COLOUR, linestyle="--", linewidth=1.0, label=f"{p.baseline} (baseline)")
        if p.threshold is not None:
            lo, hi = _shown(1 / (1 + p.threshold), percent), _shown(1 + p.threshold, percent)
            ax.axhspan(lo, hi, color="grey", alpha=0.15, linewidth=0, label=f"SAME band (±{p.threshold:.0%})")
        _draw(ax, axis, shown, styles, band=False, scale=1.0)
        slots = {s.arm: slot for slot, s in enumerate(shown)}
        for b in p.bounds:
            _draw_bound(ax, axis, b, styles, percent, slots.get(b.arm, 0), len(shown))
        if p.missing:
            ax.plot(
                [axis.pos(x) for x in p.missing],
                [0.04] * len(p.missing),
                transform=ax.get_xaxis_transform(),
                marker="x",
                color="grey",
                linestyle="none",
                label="missing point (not judged)",
            )
        axis.apply(ax)
        plain_numbers(ax)
        ax.set_title(p.title)
        ax.set_ylabel(ylabel)

    return chart(title, len(panels), draw, uid=uid, cols=cols, size=size)


def _draw_bound(ax: Axes, axis: XAxis, b: Bound, styles: ArmStyles, percent: bool, slot: int, slots: int) -> None:
    """A criterion's bound: a dash-dot segment in its arm's colour over the points it judges, labelled."""
    y = _shown(b.value, percent)
    pos = sorted(axis.pos(x, slot, slots) for x in b.xs) or [axis.pos(axis.values[0])]
    if axis.kind == "category":
        lo, hi = pos[0] - 0.22, pos[-1] + 0.22
    elif axis.kind == "log":
        lo, hi = pos[0] / 2**0.25, pos[-1] * 2**0.25
    else:
        pad = (axis.values[-1] - axis.values[0]) * 0.04 or 0.5
        lo, hi = pos[0] - pad, pos[-1] + pad
    colour = styles.colour(b.arm)
    text = _bound_text(b, percent)
    ax.plot([lo, hi], [y, y], color=colour, linestyle="-.", linewidth=1.6, label=f"{b.arm}: criterion's bound")
    ax.annotate(
        f"{b.arm} {text}",
        (lo, y),
        xytext=(1, 2),
        textcoords="offset points",
        color=colour,
        fontsize=7,
        va="bottom",
        bbox={"boxstyle": "square,pad=0.1", "facecolor": "white", "edgecolor": "none", "alpha": 0.8},
    )


@dataclass
class SharePanel:
    """One arm and metric: each device's median as a % of that device's measured peak."""

    arm: str
    metric: str
    xparam: str | None
    devices: list[Series]  # label: the device


def share_chart(title: str, panels: list[SharePanel], styles: ArmStyles, *, uid: str) -> Markup:
    """Per arm, the devices side by side as shares of their own peaks (module docstring)."""

    def draw(ax: Axes, i: int) -> None:
        p = panels[i]
        axis = x_axis(p.xparam, [x for s in p.devices for x in s.xs])
        colour = styles.colour(p.arm)
        for slot, s in enumerate(p.devices):
            marker, dash = DEVICE_STYLES[slot % len(DEVICE_STYLES)]
            xs = [axis.pos(x, slot, len(p.devices)) for x in s.xs]
            err = [[max(y - _finite(lo, y), 0.0) for y, lo in zip(s.ys, s.lows, strict=True)]]
            err.append([max(_finite(hi, y) - y, 0.0) for y, hi in zip(s.ys, s.highs, strict=True)])
            ax.errorbar(
                xs,
                s.ys,
                yerr=err,
                color=colour,
                marker=marker,
                markersize=4,
                capsize=2.5,
                linestyle="none" if axis.kind == "category" else dash,
                linewidth=1,
            )
            ax.plot([], [], color="grey", marker=marker, linestyle=dash, label=s.label)  # the device, not the arm
        ax.axhline(100, color=BASELINE_COLOUR, linestyle="--", linewidth=1.0, label="the device's measured peak")
        axis.apply(ax)
        plain_numbers(ax)
        ax.set_ylim(bottom=0)
        ax.set_title(f"{p.arm}: {QUANTITIES.get(p.metric, p.metric)}")
        ax.set_ylabel("share of the device's measured peak (%)")

    return chart(title, len(panels), draw, uid=uid, cols=4, size=(3.2, 2.4))


@dataclass
class HistoryLine:
    """One arm's run medians over time, with the runs flagged as steps."""

    arm: str
    label: str
    times: list[dt.datetime]
    medians: list[float]
    flagged: list[tuple[dt.datetime, float, str]]  # (when, median, "regression" or "improvement")


@dataclass
class HistoryPanel:
    """One point of one case on one host."""

    title: str
    metric: str
    lines: list[HistoryLine]


def history_chart(title: str, panels: list[HistoryPanel], styles: ArmStyles, *, uid: str) -> Markup:
    """`history_figure` as an inline `<svg>` for the report."""
    with matplotlib.rc_context(RC):  # type: ignore[arg-type]
        return svg_markup(history_figure(title, panels, styles), title=title, uid=uid)


def history_figure(title: str, panels: list[HistoryPanel], styles: ArmStyles) -> Figure:
    """Run medians over time per arm, regressions and improvements marked (module docstring)."""

    def draw(ax: Axes, i: int) -> None:
        p = panels[i]
        scale, unit = axis_unit(p.metric, [v for line in p.lines for v in line.medians])
        for line in p.lines:
            ax.plot(
                line.times,  # type: ignore[arg-type]
                [v / scale for v in line.medians],
                markersize=3.5,
                label=line.label,
                **styles[line.arm].line(),
            )
            for when, median, verdict in line.flagged:
                ax.plot(
                    [when],  # type: ignore[arg-type]
                    [median / scale],
                    marker="v" if verdict == "regression" else "^",
                    markersize=10,
                    markerfacecolor="none",
                    markeredgecolor=BASELINE_COLOUR,
                    markeredgewidth=1.5,
                    linestyle="none",
                    label=f"{verdict} (flagged step)",
                )
        locator = AutoDateLocator(maxticks=6)
        ax.xaxis.set_major_locator(locator)
        ax.xaxis.set_major_formatter(ConciseDateFormatter(locator))
        plain_numbers(ax)
        ax.set_title(p.title)
        ax.set_xlabel("run start (UTC)")
        ax.set_ylabel(axis_label(p.metric, unit))

    return figure(title, len(panels), draw, cols=3, size=(4.1, 2.5))
