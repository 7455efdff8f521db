"""The fair view across machines: achieved bandwidth and FLOP rate beside their fraction of each
device's own measured peak (`peak_copy_gb_s`, `peak_tflop_s`, stamped on the rows by the worker
from `workers.host.peaks`), one row per case, point, arm and metric with a cell per device.
"""

from __future__ import annotations

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
    peak: float | None
    fraction: float | None


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
    return sorted(rows.values(), key=lambda r: (r.case_name, r.metric, r.arm, point_sort_key(r.point)))


def over_peak(rows: list[CrossDeviceRow]) -> list[str]:
    """A warning for every share of a device's measured peak above 100 %: the peak probe was too
    low (taken on a busy machine, or with a weak copy), not the kernel faster than the device."""
    out = []
    for r in rows:
        for device, cell in sorted(r.cells.items()):
            if cell.fraction is not None and cell.fraction > 1.0:
                where = " ".join([r.case_name, *(f"{k}={v}" for k, v in r.point), r.arm, r.metric])
                out.append(
                    f"warning: {device} {where} at {cell.fraction:.0%} of the device's measured peak "
                    f"({cell.peak:.4g}): that peak is too low; probe it again with ORCHESTRATE_REPROBE_PEAKS=1 "
                    "on that host"
                )
    return out
