"""What a report's inline SVG charts show, read back from their text: titles, axis labels, ticks, legend.

The report marks each chart's suptitle, every panel's title and axis labels and the figure legend
with ids (`<chart>-suptitle`, `<chart>-a<i>-title`, ...); this module parses each `<svg
class="chart">` with ElementTree and returns those facts, so tests can assert on what a reader
sees instead of on how the code built it.
"""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field

SVG = re.compile(r'<svg class="chart".*?</svg>', re.S)
STROKE = re.compile(r"stroke: (#[0-9a-fA-F]{6})")


@dataclass
class Panel:
    """One panel (axes) of a chart."""

    title: str
    xlabel: str
    ylabel: str
    xticks: list[str]
    yticks: list[str]
    y_texts: int  # every text drawn by the y axis (ticks, label, an offset such as `1e6` if any)
    texts: list[str]  # every other text inside the panel (annotations such as a bound's label)
    element: ET.Element


@dataclass
class LegendEntry:
    """A legend label with the colour and dash of its handle."""

    label: str
    colour: str | None
    dashed: bool


@dataclass
class Chart:
    """One chart of the report."""

    uid: str
    title: str
    suptitle: str
    panels: list[Panel] = field(default_factory=list)
    legend: list[LegendEntry] = field(default_factory=list)


def _text(el: ET.Element | None) -> str:
    return "".join(el.itertext()).strip() if el is not None else ""


def _ticks(axis: ET.Element | None, kind: str) -> list[str]:
    if axis is None:
        return []
    return [_text(g) for g in axis.iter() if re.search(rf"-{kind}tick_\d+$", g.get("id", ""))]


def charts(document: str) -> list[Chart]:
    """Every chart of an HTML report, in page order."""
    out = []
    for markup in SVG.findall(document):
        root = ET.fromstring(markup)
        by_id = {el.get("id"): el for el in root.iter() if el.get("id")}
        parents = {child: parent for parent in root.iter() for child in parent}
        uid = root.get("aria-labelledby", "").removesuffix("-title")
        title = next((_text(el) for el in root if el.tag.endswith("title")), "")
        chart = Chart(uid, title, _text(by_id.get(f"{uid}-suptitle")))
        i = 0
        while f"{uid}-a{i}-title" in by_id:
            title_el = by_id[f"{uid}-a{i}-title"]
            axes = parents[title_el]
            xlabel, ylabel = by_id.get(f"{uid}-a{i}-xlabel"), by_id.get(f"{uid}-a{i}-ylabel")
            xaxis = parents.get(xlabel) if xlabel is not None else None
            yaxis = parents.get(ylabel) if ylabel is not None else None
            skip = {id(el) for axis in (xaxis, yaxis) if axis is not None for el in axis.iter()}
            skip |= {id(el) for el in title_el.iter()}
            others = [_text(el) for el in axes.iter() if el.tag.endswith("text") and id(el) not in skip]
            y_texts = sum(1 for el in yaxis.iter() if el.tag.endswith("text")) if yaxis is not None else 0
            chart.panels.append(Panel(_text(title_el), _text(xlabel), _text(ylabel), _ticks(xaxis, "x"),
                                      _ticks(yaxis, "y"), y_texts, others, axes))  # fmt: skip
            i += 1
        legend = by_id.get(f"{uid}-legend")
        if legend is not None:
            colour, dashed = None, False
            for el in legend.iter():
                style = el.get("style", "")
                m = STROKE.search(style)
                if m and not el.tag.endswith("text"):
                    colour = m.group(1).upper()
                    dashed = dashed or "stroke-dasharray" in style
                if el.tag.endswith("text"):
                    chart.legend.append(LegendEntry(_text(el), colour, dashed))
                    colour, dashed = None, False
        out.append(chart)
    return out


def paths(panel: Panel) -> list[str]:
    """The style attributes of every path drawn inside a panel."""
    return [el.get("style", "") for el in panel.element.iter() if el.tag.endswith("path")]
