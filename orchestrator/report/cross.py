"""The cross-device view as text: each device's share of its own measured peak, per point and arm.

`orchestrator.analysis.cross_device` computes the shares; here they become a terminal table that
fits (the full cells, else compact ones with the peaks said once under the table), Markdown, or
the tidy CSV/JSON records of `orchestrator.analysis.records`, each followed by a warning for a
peak probe that a rate beat.
"""

from __future__ import annotations

from typing import IO

import pyarrow as pa
from rich.console import Console
from rich.table import Table
from rich.text import Text

from orchestrator.analysis.compare import varying_params
from orchestrator.analysis.cross_device import CrossDeviceRow, over_peak
from orchestrator.analysis.records import CROSS_SCHEMA, cross_records
from orchestrator.report.console import fit, grid, print_wide
from orchestrator.report.output import Format, markdown, write_records
from orchestrator.report.units import format_value as format_in_unit
from orchestrator.report.units import metric_label, unit_of


def print_cross(out: Console, cross: list[CrossDeviceRow], *, wide: bool = False) -> None:
    """The cross-device view on a console, then a warning for every probed peak a rate beat: the
    full view when it fits (or `wide`), else the compact one with the peaks said once."""
    full = cross_table(cross)
    chosen = full if wide else fit(out, [full, cross_table(cross, compact=True)])
    print_wide(out, chosen)
    if chosen is not full:
        out.print(Text(f"measured peaks: {cross_peaks(cross)}"))
    for line in over_peak(cross):
        out.print(Text(line))


def cross_display(rows: list[CrossDeviceRow], *, compact: bool = False) -> tuple[list[str], list[list[str]]]:
    """Header and cells of the cross-device view: `412.3 GB/s (52% of 790.0 GB/s)` per device
    (`compact`: `412.3 GB/s (52%)`, only the parameters that vary within a case, the peaks said
    once under the table: `cross_peaks`)."""
    devices = sorted({d for r in rows for d in r.cells})
    heads = ["case", "point", "arm", "metric", *devices]
    varying = {c: varying_params(r.point for r in rows if r.case_name == c) for c in {r.case_name for r in rows}}
    body = []
    for r in rows:
        point = " ".join(f"{k}={v}" for k, v in r.point if not compact or k in varying[r.case_name])
        cells = [r.case_name, point, r.arm, metric_label(r.metric)]
        for dev in devices:
            cell = r.cells.get(dev)
            if cell is None:
                cells.append("-")
                continue
            value = format_in_unit(cell.summary.median, unit_of(r.metric))
            if cell.fraction is None:
                cells.append(f"{value} (no peak)")
            elif compact:
                cells.append(f"{value} ({cell.fraction:.0%})")
            else:
                cells.append(f"{value} ({cell.fraction:.0%} of {format_in_unit(cell.peak, unit_of(r.metric))})")
        body.append(cells)
    return heads, body


def write_cross(rows: list[CrossDeviceRow], fmt: Format, stream: IO[str]) -> None:
    """The cross-device view alone as Markdown, CSV or JSON."""
    if fmt in (Format.csv, Format.json):
        write_records(pa.Table.from_pylist(cross_records(rows), schema=CROSS_SCHEMA), fmt, stream)
    else:
        stream.write("\n".join([markdown(*cross_display(rows)), *(f"\n{line}" for line in over_peak(rows))]) + "\n")


def cross_peaks(rows: list[CrossDeviceRow]) -> str:
    """`cpu 400.0 GB/s; h200 4.80 TB/s, 989.0 TFLOP/s`: each device's measured peaks, once."""
    peaks: dict[str, dict[str, str]] = {}
    for r in rows:
        for dev, cell in r.cells.items():
            if cell.peak is not None:
                peaks.setdefault(dev, {})[r.metric] = format_in_unit(cell.peak, unit_of(r.metric))
    return "; ".join(f"{dev} {', '.join(by_metric.values())}" for dev, by_metric in sorted(peaks.items()))


def cross_table(rows: list[CrossDeviceRow], *, compact: bool = False) -> Table:
    """The cross-device view as a rich table (cells never wrapped; `compact`: see `cross_display`)."""
    heads, body = cross_display(rows, compact=compact)
    return grid(
        "across devices: share of each device's measured peak", heads, body, [False] * 4 + [True] * (len(heads) - 4)
    )
