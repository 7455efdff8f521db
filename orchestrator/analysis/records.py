"""A comparison as tidy records: one fixed schema for CSV, JSON and Arrow (`orchestrate compare
--format csv|json`), documented in `docs/results.md`.

`records` gives one record per case, point, device, arm, side and metric, with the median, its
interval, the ratio to the case's own baseline with its interval and verdict, the unit, the run and
the commit; numbers typed, missing values null (`RECORD_SCHEMA`). `cross_records` does the same for
the cross-device view (`CROSS_SCHEMA`). `orchestrator.report.text` draws the same comparison as
terminal and Markdown tables.
"""

from __future__ import annotations

import json
import math
from typing import Any

import pyarrow as pa

from orchestrator.analysis.compare import CompareResult
from orchestrator.analysis.cross_device import CrossDeviceRow
from orchestrator.analysis.stats import Verdict
from orchestrator.report.units import unit_of
from workers.contract import TYPED_PARAMS


def verdict_label(verdict: Verdict, metric: str) -> str:
    """FASTER/SLOWER for times and rates; LOWER/HIGHER for memory and errors (lower is better there)."""
    if metric.endswith("_bytes") or metric == "rel_error":
        return {Verdict.FASTER: "LOWER", Verdict.SLOWER: "HIGHER"}.get(verdict, verdict.value)
    return verdict.value


RECORD_SCHEMA = pa.schema(
    [
        pa.field("sweep", pa.string()),
        pa.field("case", pa.string()),
        pa.field("by", pa.string()),
        pa.field("side", pa.string()),
        pa.field("baseline", pa.string()),
        pa.field("device", pa.string()),
        pa.field("arm", pa.string()),
        *[pa.field(name, dtype) for name, dtype in TYPED_PARAMS.items()],
        pa.field("params", pa.string()),
        pa.field("metric", pa.string()),
        pa.field("unit", pa.string()),
        pa.field("n_samples", pa.int64()),
        pa.field("value", pa.float64()),
        pa.field("ci_low", pa.float64()),
        pa.field("ci_high", pa.float64()),
        pa.field("cv", pa.float64()),
        pa.field("ratio", pa.float64()),
        pa.field("ratio_ci_low", pa.float64()),
        pa.field("ratio_ci_high", pa.float64()),
        pa.field("verdict", pa.string()),
        pa.field("more_samples", pa.int64()),
        pa.field("paired", pa.bool_()),
        pa.field("p_value", pa.float64()),
        pa.field("note", pa.string()),
        pa.field("outliers", pa.int64()),
        pa.field("run_id", pa.string()),
        pa.field("code_version", pa.string()),
        pa.field("commit", pa.string()),
    ]
)


def typed(value: str) -> int | float | bool | str:
    """A parameter's text as the number or flag it reads as."""
    if value in ("True", "False", "true", "false"):
        return value.lower() == "true"
    for kind in (int, float):
        try:
            return kind(value)
        except ValueError:
            pass
    return value


def finite(value: float | None) -> float | None:
    return None if value is None or not math.isfinite(value) else float(value)


def records(result: CompareResult) -> list[dict[str, Any]]:
    """Tidy records (see `RECORD_SCHEMA`): one per case, point, device, arm, side and metric."""
    # The record's own column for the side; a commit side (`ref@commit`) is `side`, with the
    # group's `commit` and `code_version` beside it.
    column = {"arm": "arm", "run": "run_id", "device": "device"}.get(result.by)
    out = []
    for row in result.rows:
        base = result.baseline_of(row.case_name)
        point = dict(row.point)
        params = {k: typed(v) for k, v in point.items()}
        ordered = [(m, side) for m in result.metrics for side in result.sides_of(row.case_name)]
        for metric, side in [k for k in ordered if k in row.values]:  # metric by metric, the baseline first
            s = row.values[(metric, side)]
            group = row.samples.get((metric, side))
            c = row.comparisons.get((metric, side))
            rec: dict[str, Any] = {
                "sweep": result.sweep,
                "case": row.case_name,
                "by": result.by,
                "side": side,
                "baseline": base,
                "device": row.dims.get("device"),
                "arm": row.dims.get("arm"),
                **{k: (params[k] if k in params and TYPED_PARAMS[k] == pa.string() else None) for k in TYPED_PARAMS},
                "params": json.dumps(params, sort_keys=True),
                "metric": metric,
                "unit": unit_of(metric, result.units.get(metric)),
                "n_samples": s.n,
                "value": finite(s.median),
                "ci_low": finite(s.ci_low),
                "ci_high": finite(s.ci_high),
                "cv": finite(s.cv),
                "ratio": finite(c.ratio.ratio) if c else None,
                "ratio_ci_low": finite(c.ratio.ci_low) if c else None,
                "ratio_ci_high": finite(c.ratio.ci_high) if c else None,
                "verdict": verdict_label(c.verdict, metric) if c else None,
                "more_samples": c.more_samples if c else None,
                "paired": c.ratio.paired if c else None,
                "p_value": finite(c.p_value) if c else None,
                "note": c.note if c else None,
                "outliers": s.outliers,
                "run_id": group.one(tuple(sorted(set(group.run_ids)))) if group else None,
                "code_version": group.one(group.code_versions) if group else None,
                "commit": group.one(group.commits) if group else None,
            }
            for k, dtype in TYPED_PARAMS.items():
                if k in params and dtype != pa.string() and isinstance(params[k], int | float):
                    rec[k] = int(params[k])
            if column is not None:
                rec[column] = side
            out.append(rec)
    return out


def records_table(result: CompareResult) -> pa.Table:
    """The tidy records as an Arrow table in `RECORD_SCHEMA`."""
    return pa.Table.from_pylist(records(result), schema=RECORD_SCHEMA)


CROSS_SCHEMA = pa.schema(
    [
        pa.field("case", pa.string()),
        pa.field("params", pa.string()),
        pa.field("arm", pa.string()),
        pa.field("metric", pa.string()),
        pa.field("unit", pa.string()),
        pa.field("device", pa.string()),
        pa.field("value", pa.float64()),
        pa.field("peak", pa.float64()),
        pa.field("fraction_of_peak", pa.float64()),
        pa.field("over_peak", pa.bool_()),
    ]
)


def cross_records(rows: list[CrossDeviceRow]) -> list[dict[str, Any]]:
    """Tidy records of the cross-device view (see `CROSS_SCHEMA`)."""
    out = []
    for r in rows:
        params = json.dumps({k: typed(v) for k, v in r.point}, sort_keys=True)
        for dev, cell in sorted(r.cells.items()):
            out.append(
                {
                    "case": r.case_name,
                    "params": params,
                    "arm": r.arm,
                    "metric": r.metric,
                    "unit": unit_of(r.metric),
                    "device": dev,
                    "value": finite(cell.summary.median),
                    "peak": cell.peak,
                    "fraction_of_peak": cell.fraction,
                    "over_peak": cell.beat_probe,
                }
            )
    return out
