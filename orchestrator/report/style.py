"""The report's one visual vocabulary, shared by every chart in it.

* `ArmStyles`: one colour per arm for the whole report (Okabe and Ito's colour-blind-safe
  palette), a marker per arm as a second cue, and one style for every baseline (black, dashed,
  hollow square), whichever chart it is in.
* `XAxis`: the x axis of a panel. Fewer than three values: categories, the arms dodged side by
  side so none hides another. Values that keep doubling (prompt lengths): a log-2 scale with a
  tick at each. Else linear. Error-bar points are dodged on every kind.
* `axis_unit`: the divisor and unit of a y axis, chosen by the report's value formatter so a chart
  and the table beside it say the same unit (ms, MB or GiB, whatever the tables print).
* `chart`: a grid of panels drawn inside this module's rc settings and returned as inline SVG
  markup, every id prefixed so that many charts can share one HTML document.
"""

from __future__ import annotations

import io
import itertools
import math
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import matplotlib
from markupsafe import Markup, escape
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator

from orchestrator.report.text import format_value

matplotlib.use("Agg")

RC: dict[str, Any] = {
    "svg.fonttype": "none",  # text stays text: searchable, and checked by the browser test
    "svg.hashsalt": "orchestrate",  # the same data gives the same file
    "font.size": 8,
    "text.parse_math": False,  # arm and case names are data: `$x$` is not mathtext
    "axes.titlesize": 8.5,
    "axes.labelsize": 8,
    "legend.fontsize": 7.5,
    "xtick.labelsize": 7.5,
    "ytick.labelsize": 7.5,
}
# Okabe & Ito (2008), black reserved for the baseline; yellow last (weak on white).
PALETTE = ("#E69F00", "#56B4E9", "#009E73", "#0072B2", "#D55E00", "#CC79A7", "#F0E442")
BASELINE_COLOUR = "#000000"
MARKERS = ("o", "^", "D", "v", "P", "X", "<", ">", "h")
# Arms beyond the palette's seven reuse its colours with another dash.
DASHES: tuple[Any, ...] = ("-", (0, (1, 1.2)), (0, (4, 1, 1, 1)))
DEVICE_STYLES: tuple[tuple[str, Any], ...] = (("o", "-"), ("s", "--"), ("^", ":"), ("D", "-."), ("v", (0, (5, 1))))
# What a unit token printed by `format_value` divides by.
UNIT_DIVISORS = {
    "B": 1.0, "kB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12,
    "KiB": 2.0**10, "MiB": 2.0**20, "GiB": 2.0**30, "TiB": 2.0**40,
    "s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9,
}  # fmt: skip
UNITS = {
    "prefill_tok_s": "tok/s",
    "decode_tok_s": "tok/s",
    "seconds": "s",
    "load_seconds": "s",
    "build_seconds": "s",
    "gb_per_s": "GB/s",
    "tflop_per_s": "TFLOP/s",
    "peak_memory_bytes": "B",
    "rel_error": "dimensionless",
}
QUANTITIES = {
    "prefill_tok_s": "prefill throughput",
    "decode_tok_s": "decode throughput",
    "seconds": "time per call",
    "load_seconds": "load time",
    "build_seconds": "build time",
    "gb_per_s": "achieved bandwidth",
    "tflop_per_s": "achieved FLOP rate",
    "peak_memory_bytes": "peak memory",
    "rel_error": "relative error to the reference",
}
X_LABELS = {"tokens": "tokens per call (rows of x)", "prompt_tokens": "prompt length (tokens)"}


@dataclass(frozen=True)
class ArmStyle:
    """How one arm is drawn everywhere in the report."""

    colour: str
    marker: str
    linestyle: Any
    baseline: bool = False

    def line(self) -> dict[str, Any]:
        """Keyword arguments of `Axes.plot` / `errorbar` for this arm."""
        face = "white" if self.baseline else self.colour
        return {
            "color": self.colour,
            "marker": self.marker,
            "linestyle": self.linestyle,
            "markerfacecolor": face,
            "markeredgecolor": self.colour,
        }


class ArmStyles:
    """The report's fixed `{arm: style}` map: built once from every arm, in the sweep's order.

    Arms that share a case (a chart) never share a style: each arm takes the first palette colour
    (then dash) that no arm of its cases holds yet, so arms of different cases may reuse a colour
    and a case of up to seven compared arms gets seven distinct colours.
    """

    def __init__(self, arms: Iterable[str], baselines: Iterable[str], cases: Iterable[Iterable[str]] = ()) -> None:
        self.baselines = set(baselines)
        self.styles: dict[str, ArmStyle] = {}
        together: dict[str, set[str]] = {}
        for group in cases:
            members = set(group)
            for arm in members:
                together.setdefault(arm, set()).update(members - {arm})
        choices = [(c, d) for d in range(len(DASHES)) for c in range(len(PALETTE))]
        taken: dict[str, int] = {}
        for arm in dict.fromkeys(arms):
            if arm in self.baselines:
                self.styles[arm] = ArmStyle(BASELINE_COLOUR, "s", "--", baseline=True)
                continue
            used = {taken[other] for other in together.get(arm, ()) if other in taken}
            k = next((i for i in range(len(choices)) if i not in used), len(taken) % len(choices))
            taken[arm] = k
            colour, dash = choices[k]
            self.styles[arm] = ArmStyle(PALETTE[colour], MARKERS[k % len(MARKERS)], DASHES[dash])

    def __getitem__(self, arm: str) -> ArmStyle:
        return self.styles[arm]

    def colour(self, arm: str) -> str:
        """The arm's colour (for the tables' swatches)."""
        return self.styles[arm].colour


@dataclass(frozen=True)
class XAxis:
    """A panel's x axis: its label, its values and how they are spaced."""

    label: str
    values: tuple[float, ...]
    kind: str  # "category", "log" or "linear"
    names: tuple[str, ...] = ()  # tick labels of a category axis (default: the values)

    def pos(self, x: float, slot: int = 0, slots: int = 1) -> float:
        """Where a point of series `slot` of `slots` goes: dodged around its x value."""
        slots = max(slots, 1)  # 0: a bound drawn where no series is shown
        offset = slot - (slots - 1) / 2
        if self.kind == "category":
            return self.values.index(x) + offset * min(0.6 / slots, 0.16)
        if slots == 1 or len(self.values) < 2:
            return x
        if self.kind == "log":
            gap = min(math.log2(b / a) for a, b in itertools.pairwise(self.values))
            return float(x * 2 ** (offset * gap * 0.3 / slots))
        gap = min(b - a for a, b in itertools.pairwise(self.values))
        return x + offset * gap * 0.3 / slots

    def apply(self, ax: Axes) -> None:
        """Scale, ticks and label of the axis on `ax`."""
        ticks = list(self.names) or [f"{v:g}" for v in self.values]
        if self.kind == "category":
            ax.xaxis.set_major_locator(FixedLocator(list(range(len(self.values)))))
            ax.set_xticklabels(ticks)
            ax.set_xlim(-0.5, len(self.values) - 0.5)
        elif self.kind == "log":
            ax.set_xscale("log", base=2)
            ax.xaxis.set_major_locator(FixedLocator(list(self.values)))
            ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
            ax.xaxis.set_minor_locator(NullLocator())
        ax.set_xlabel(self.label + (", log scale" if self.kind == "log" else ""))


def x_axis(param: str | None, values: Iterable[float]) -> XAxis:
    """The axis for a parameter's values (see the module docstring); None: one unnamed point."""
    vals = tuple(sorted(set(values)))
    if param is None:  # no numeric parameter varies: every point at one place, told apart by the legend
        return XAxis("point (no numeric parameter varies)", (0.0,), "category", ("all points",))
    label = X_LABELS.get(param, param)
    if len(vals) < 3:
        return XAxis(label, vals or (0.0,), "category")
    if vals[0] > 0 and all(b / a >= 1.5 for a, b in itertools.pairwise(vals)):
        return XAxis(label, vals, "log")
    return XAxis(label, vals, "linear")


def axis_unit(metric: str, values: Iterable[float]) -> tuple[float, str]:
    """(divisor, unit) for a metric's axis, the unit the report's formatter prints for the largest value."""
    finite = [abs(v) for v in values if math.isfinite(v)]
    if finite:
        m = re.search(r"(?:^|[\d\s])([A-Za-zµ]+)$", format_value(metric, max(finite)))  # `2.07 GB`, `0.7s`
        if m and m.group(1) in UNIT_DIVISORS:
            return UNIT_DIVISORS[m.group(1)], m.group(1)
    return 1.0, UNITS.get(metric, "")


def with_unit(metric: str, value: float | None) -> str:
    """The formatter's text for a value, with the metric's unit where the formatter leaves it out (rates)."""
    if value is None:
        return "-"
    text = format_value(metric, value)
    unit = UNITS.get(metric, "")
    if not unit or unit in ("B", "s", "dimensionless") or text == "-" or text.endswith(unit):
        return text
    return f"{text} {unit}"


def axis_label(metric: str, unit: str) -> str:
    """`peak memory (MB)`: what the axis measures and its unit."""
    return f"{QUANTITIES.get(metric, metric)} ({unit or 'dimensionless'})"


def plain_numbers(ax: Axes) -> None:
    """Tick labels as plain numbers with thousands separators: no offset, no `1e6` above the axis."""
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:,.6g}"))


def svg_markup(fig: Figure, *, title: str, uid: str) -> Markup:
    """The figure as an inline `<svg>` element with a `<title>`; every id prefixed with `uid`."""
    buf = io.BytesIO()
    fig.savefig(buf, format="svg", metadata={"Date": None})
    text = buf.getvalue().decode()
    text = text[text.index("<svg") :]
    text = re.sub(r"\s*<metadata>.*?</metadata>", "", text, flags=re.S)
    text = re.sub(r'\bid="', f'id="{uid}-', text)
    text = text.replace("url(#", f"url(#{uid}-").replace('href="#', f'href="#{uid}-')
    head_end = text.index(">")
    opening = text[:head_end].replace("<svg", f'<svg class="chart" role="img" aria-labelledby="{uid}-title"', 1)
    body = text[head_end + 1 :]
    return Markup(f'{opening}>\n <title id="{uid}-title">{escape(title)}</title>{body}')


def chart(
    title: str,
    panels: int,
    draw: Callable[[Axes, int], None],
    *,
    uid: str,
    cols: int = 3,
    size: tuple[float, float] = (4.1, 2.7),
) -> Markup:
    """`figure` as an inline `<svg>` for the report."""
    with matplotlib.rc_context(RC):  # type: ignore[arg-type]
        return svg_markup(figure(title, panels, draw, cols=cols, size=size), title=title, uid=uid)


def figure(
    title: str,
    panels: int,
    draw: Callable[[Axes, int], None],
    *,
    cols: int = 3,
    size: tuple[float, float] = (4.1, 2.7),
) -> Figure:
    """A figure of `panels` panels, each drawn by `draw(ax, i)`, with one legend for the figure.

    Each panel must set its title and y label; gids mark the suptitle, every panel's title, axis
    labels and the legend so the browser test can find them.
    """
    with matplotlib.rc_context(RC):  # type: ignore[arg-type]
        cols = max(1, min(cols, panels))
        rows = math.ceil(panels / cols)
        fig = Figure(figsize=(max(size[0] * cols, 6.4), size[1] * rows + 0.9), layout="constrained")
        axes: Sequence[Axes] = fig.subplots(rows, cols, squeeze=False).ravel().tolist()
        handles: dict[str, Any] = {}
        for i, ax in enumerate(axes):
            if i >= panels:
                ax.set_visible(False)
                continue
            draw(ax, i)
            ax.grid(alpha=0.3)
            ax.title.set_gid(f"a{i}-title")
            ax.xaxis.label.set_gid(f"a{i}-xlabel")
            ax.yaxis.label.set_gid(f"a{i}-ylabel")
            for handle, label in zip(*ax.get_legend_handles_labels(), strict=True):
                handles.setdefault(label, handle)
        fig.suptitle(title, fontsize=10).set_gid("suptitle")
        # As many legend columns as fit the figure's width (a wider legend would be cut off).
        widest = max((0.55 + 0.062 * len(label) for label in handles), default=1.0)
        ncols = max(1, min(len(handles), int(fig.get_figwidth() / widest), 6))
        legend = fig.legend(list(handles.values()), list(handles), loc="outside lower center", ncols=ncols)
        legend.set_gid("legend")
        return fig


def save_png(fig: Figure, path: Path) -> Path:
    """Write a figure of `figure` to `path` as a PNG, in the report's style."""
    with matplotlib.rc_context(RC):  # type: ignore[arg-type]
        fig.savefig(path, format="png")
    return path
