"""A case's series over time, for `orchestrate history` and the report: each series with the runs
where `orchestrator.analysis.history` flagged a change, its default metric, and a sparkline."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.compute as pc

from orchestrator.analysis.history import (
    ENVIRONMENT_CHANGE,
    IGNORED_METRICS,
    IMPROVEMENT,
    REGRESSION,
    THRESHOLD,
    WINDOW,
    Finding,
    RunPoint,
    SeriesKey,
    detect,
    series_of,
)

PREFERRED_METRICS = ("decode_tok_s", "prefill_tok_s", "tflop_per_s", "gb_per_s", "seconds")
_SPARK = "▁▂▃▄▅▆▇█"


def default_metric(table: pa.Table, case: str) -> str | None:
    """The metric `orchestrate history CASE` shows when none is given."""
    rows = table.filter(pc.or_(pc.equal(table["case_name"], case), pc.equal(table["case"], case)))
    metrics = set(pc.unique(rows["metric"]).to_pylist()) - IGNORED_METRICS
    for metric in PREFERRED_METRICS:
        if metric in metrics:
            return metric
    return min(metrics) if metrics else None


def sparkline(values: list[float]) -> str:
    """A one-line trend of run medians (▁ lowest, █ highest)."""
    finite = [v for v in values if math.isfinite(v)]
    if not finite:
        return ""
    lo, hi = min(finite), max(finite)
    span = hi - lo or 1.0
    return "".join(_SPARK[round((v - lo) / span * (len(_SPARK) - 1))] if math.isfinite(v) else " " for v in values)


@dataclass(frozen=True)
class Trend:
    """One series over its runs, with the runs where it changed."""

    series: SeriesKey
    points: list[RunPoint]
    findings: list[Finding]

    @property
    def changes(self) -> list[Finding]:
        """Regressions, improvements and environment changes (each where it was flagged)."""
        return [f for f in self.findings if f.verdict in (REGRESSION, IMPROVEMENT, ENVIRONMENT_CHANGE)]


def trends(
    table: pa.Table,
    case: str,
    metric: str,
    *,
    window: int = WINDOW,
    threshold: float = THRESHOLD,
    reference: str | None = None,
) -> list[Trend]:
    """Every series of one case and metric, per device and host, with its change points: each
    arm's own and each arm's ratio to the reference arm (`series_of`)."""
    return [
        Trend(key, pts, detect(key, pts, window=window, threshold=threshold))
        for key, pts in series_of(table, case=case, metric=metric, reference=reference).items()
    ]
