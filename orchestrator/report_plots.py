"""The report's figures (matplotlib, Agg, no pyplot state): each returned as an SVG data URI.

* `metric_figure`: one device and case; each metric against the prompt length, a line per arm
  with its bootstrap band.
* `gap_figure`: each compared arm's gap to the baseline in %, with intervals, the verdict band
  and the criteria's bounds.
* `peak_figure`: achieved GB/s and TFLOP/s as a share of each device's own measured peak.
"""

from __future__ import annotations

import base64
import io
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import matplotlib
from matplotlib.axes import Axes
from matplotlib.figure import Figure

from orchestrator.stats import Ratio, Summary

matplotlib.use("Agg")

RC: dict[str, Any] = {"svg.fonttype": "none", "svg.hashsalt": "orchestrate", "font.size": 9}


@dataclass
class Series:
    """One line: x values with the summary (or ratio) at each."""

    label: str
    xs: list[float]
    ys: list[float]
    lows: list[float]
    highs: list[float]


def svg_data_uri(fig: Figure) -> str:
    """Render a figure as an SVG `data:` URI (self-contained, no external fonts or files)."""
    buf = io.BytesIO()
    with matplotlib.rc_context(RC):  # type: ignore[arg-type]
        fig.savefig(buf, format="svg", bbox_inches="tight")
    return "data:image/svg+xml;base64," + base64.b64encode(buf.getvalue()).decode()


def series_of(label: str, points: Sequence[tuple[float, Summary]]) -> Series:
    """A series from (x, summary) pairs, sorted by x."""
    pts = sorted(points, key=lambda p: p[0])
    return Series(
        label, [p[0] for p in pts], [p[1].median for p in pts], [p[1].ci_low for p in pts], [p[1].ci_high for p in pts]
    )


def ratio_series(label: str, points: Sequence[tuple[float, Ratio]], *, percent: bool = True) -> Series:
    """A series of ratios as gaps in % (ratio - 1) or as factors."""
    pts = sorted(points, key=lambda p: p[0])

    def f(v: float) -> float:
        return (v - 1) * 100 if percent else v

    return Series(
        label,
        [p[0] for p in pts],
        [f(p[1].ratio) for p in pts],
        [f(p[1].ci_low) for p in pts],
        [f(p[1].ci_high) for p in pts],
    )


def _log_x(ax: Axes, xs: Sequence[float]) -> None:
    positive = [x for x in xs if x > 0]
    if len(positive) == len(xs) and len(set(positive)) > 2 and max(positive) / min(positive) >= 16:
        ax.set_xscale("log", base=2)
        ticks = sorted(set(positive))
        ax.set_xticks(ticks, [f"{t:g}" for t in ticks])
        ax.minorticks_off()


def _draw(ax: Axes, series: Sequence[Series], *, band: bool) -> None:
    for s in series:
        (line,) = ax.plot(s.xs, s.ys, marker="o", markersize=3, label=s.label)
        lows = [lo if math.isfinite(lo) else y for lo, y in zip(s.lows, s.ys, strict=True)]
        highs = [hi if math.isfinite(hi) else y for hi, y in zip(s.highs, s.ys, strict=True)]
        if band and len(s.xs) > 1:
            ax.fill_between(s.xs, lows, highs, alpha=0.25, color=line.get_color(), linewidth=0)
        else:
            err = [[max(y - lo, 0) for y, lo in zip(s.ys, lows, strict=True)]]
            err.append([max(hi - y, 0) for y, hi in zip(s.ys, highs, strict=True)])
            ax.errorbar(s.xs, s.ys, yerr=err, fmt="none", ecolor=line.get_color(), capsize=3)


def _grid(n: int) -> tuple[Figure, list[Axes]]:
    cols = min(n, 3)
    rows = math.ceil(n / cols)
    fig = Figure(figsize=(4.2 * cols, 3.0 * rows), layout="constrained")
    axes = [fig.add_subplot(rows, cols, i + 1) for i in range(n)]
    return fig, axes


def metric_figure(title: str, xlabel: str, panels: dict[str, tuple[str, list[Series]]]) -> str:
    """Each metric (a panel: its unit label and series) against the x parameter, with CI bands."""
    fig, axes = _grid(len(panels))
    for ax, (metric, (unit, series)) in zip(axes, panels.items(), strict=True):
        _draw(ax, series, band=True)
        _log_x(ax, [x for s in series for x in s.xs])
        ax.set_title(metric)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(unit)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(title)
    return svg_data_uri(fig)


def gap_figure(
    title: str,
    xlabel: str,
    panels: dict[str, list[Series]],
    *,
    threshold: float,
    bounds: dict[str, list[tuple[str, float]]],
) -> str:
    """Gaps to the baseline in % per metric, the SAME band shaded and criteria bounds dashed."""
    fig, axes = _grid(len(panels))
    for ax, (metric, series) in zip(axes, panels.items(), strict=True):
        _draw(ax, series, band=False)
        _log_x(ax, [x for s in series for x in s.xs])
        ax.axhline(0, color="black", linewidth=0.8)
        ax.axhspan((1 / (1 + threshold) - 1) * 100, threshold * 100, color="grey", alpha=0.15, label="SAME band")
        for name, bound in bounds.get(metric, []):
            ax.axhline((bound - 1) * 100, color="red", linestyle="--", linewidth=1, label=name)
        ax.set_title(f"{metric}: gap to baseline")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("% vs baseline")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(title)
    return svg_data_uri(fig)


def peak_figure(title: str, xlabel: str, panels: dict[str, list[Series]], *, fraction: bool) -> str:
    """Achieved bandwidth and FLOP rate per device and arm, as a share of the device's own peak."""
    fig, axes = _grid(len(panels))
    for ax, (metric, series) in zip(axes, panels.items(), strict=True):
        _draw(ax, series, band=True)
        _log_x(ax, [x for s in series for x in s.xs])
        if fraction:
            ax.axhline(100, color="black", linewidth=0.8, linestyle=":")
            ax.set_ylabel("% of the device's measured peak")
        else:
            ax.set_ylabel(metric + " (no measured peak)")
        ax.set_title(metric)
        ax.set_xlabel(xlabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(title)
    return svg_data_uri(fig)
