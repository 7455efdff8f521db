"""The fair view across machines: achieved bandwidth and FLOP rate beside their fraction of each
device's own measured peak (`peak_copy_gb_s`, `peak_tflop_s`, stamped on the rows by the worker
from `workers.host.peaks`), one row per case, point, arm and metric with a cell per device.

A probe is a lower bound on what the device can do, and a workload can beat it (a probe taken on
a busy machine, or a clock the probe did not reach). Where a row's median beats its device's
probe, that device's peak for the metric is raised to the best median measured there (the device
demonstrably reaches it), so every share stays a share of something the device did; the cells
keep the probe's value (`DeviceCell.probed`) and `over_peak` names each raised peak and the rows
that beat the probe.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import duckdb
import pyarrow as pa

from orchestrator.analysis import groups, stats
from orchestrator.analysis.commits import head_rows
from orchestrator.analysis.compare import point_sort_key
from orchestrator.analysis.groups import Point
from orchestrator.analysis.samples import grouped_samples
from orchestrator.analysis.stats import Summary
from workers.contract.precision import seed_for

PEAK_COLUMNS = {"gb_per_s": "peak_copy_gb_s", "tflop_per_s": "peak_tflop_s"}


def device_peaks(table: pa.Table) -> dict[str, dict[str, float]]:
    """Each device's measured peaks (`peak_copy_gb_s`, `peak_tflop_s`) from its rows."""
    con = duckdb.connect()
    con.register("peaks", table.select(["device", *PEAK_COLUMNS.values()]))
    out: dict[str, dict[str, float]] = {}
    for col in PEAK_COLUMNS.values():
        sql = f"SELECT device, max({col}) FROM peaks WHERE isfinite({col}) AND {col} > 0 GROUP BY device"
        for device, peak in con.sql(sql).fetchall():
            out.setdefault(device, {})[col] = float(peak)
    con.close()
    return out


@dataclass
class DeviceCell:
    """One device's median of a metric and its share of that device's own peak."""

    summary: Summary
    peak: float | None  # the probe's, or the best median measured on the device where that beat it
    fraction: float | None
    probed: float | None = None  # the probe's value where `peak` was raised above it

    @property
    def beat_probe(self) -> bool:
        """True when this cell's median is above its device's probed peak."""
        return self.probed is not None and self.summary.median > self.probed


@dataclass
class CrossDeviceRow:
    """One case, point and arm across every device."""

    case_name: str
    point: Point
    arm: str
    metric: str
    cells: dict[str, DeviceCell]


def cross_device(table: pa.Table, *, resamples: int = stats.RESAMPLES) -> list[CrossDeviceRow]:
    """Bandwidth and FLOP rate per device beside their fraction of that device's measured peak."""
    table = head_rows(table)  # a commit comparison's HEAD, as every view but `--by commit`
    peaks = device_peaks(table)
    rows: dict[tuple[str, Point, str, str], CrossDeviceRow] = {}
    for (device, case_name, point, arm, metric), group in grouped_samples(
        table, ["device", "case_name", "params", "arm", "metric"]
    ):
        if metric not in PEAK_COLUMNS:
            continue
        key = groups.GroupKey(device, case_name, point, arm, metric)
        summary = stats.summarize(group.values, seed=seed_for(key), resamples=resamples)
        peak = peaks.get(device, {}).get(PEAK_COLUMNS[metric])
        fraction = summary.median / peak if peak else None
        row = rows.setdefault((case_name, point, arm, metric), CrossDeviceRow(case_name, point, arm, metric, {}))
        row.cells[device] = DeviceCell(summary, peak, fraction)
    out = sorted(rows.values(), key=lambda r: (r.case_name, r.metric, r.arm, point_sort_key(r.point)))
    _raise_beaten_peaks(out)
    return out


def _raise_beaten_peaks(rows: list[CrossDeviceRow]) -> None:
    """Where a median beats its device's probe, that device's peak of the metric becomes the best
    median measured there (module docstring)."""
    best: dict[tuple[str, str], float] = {}
    for r in rows:
        for device, cell in r.cells.items():
            if cell.peak and math.isfinite(cell.summary.median) and cell.summary.median > cell.peak:
                key = (device, r.metric)
                best[key] = max(best.get(key, 0.0), cell.summary.median)
    for r in rows:
        for device, cell in r.cells.items():
            raised = best.get((device, r.metric))
            if raised is not None:
                cell.probed, cell.peak, cell.fraction = cell.peak, raised, cell.summary.median / raised


def over_peak(rows: list[CrossDeviceRow]) -> list[str]:
    """A note for every device and metric whose probed peak a row beat: the peak its shares use
    instead, and which rows beat the probe (the probe was too low: taken on a busy machine, or it
    missed the device's best clocks)."""
    beaten: dict[tuple[str, str], list[tuple[CrossDeviceRow, DeviceCell]]] = {}
    for r in rows:
        for device, cell in sorted(r.cells.items()):
            if cell.beat_probe:
                beaten.setdefault((device, r.metric), []).append((r, cell))
    out = []
    for (device, metric), cells in sorted(beaten.items()):
        cells.sort(key=lambda rc: -rc[1].summary.median)
        probed, peak = cells[0][1].probed or math.nan, cells[0][1].peak or math.nan
        which = "; ".join(
            f"{' '.join([r.case_name, *(f'{k}={v}' for k, v in r.point), r.arm])} {c.summary.median:.4g}"
            for r, c in cells
        )
        out.append(
            f"warning: {device} {metric}: {len(cells)} row{'s' if len(cells) > 1 else ''} beat the device's probed "
            f"peak ({probed:.4g}), so its shares are of the best median measured there ({peak:.4g}): {which}. "
            "Probe it again with ORCHESTRATE_REPROBE_PEAKS=1 on that host"
        )
    return out
