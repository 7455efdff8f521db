"""The report's history section: per host, the nightly series' trends with their flagged steps.

A series (device, host fingerprint, case, arm, point, metric) has history once two or more runs
measured it on the same fingerprint; `orchestrator.analysis.history` judges each run against its own past
and flags the steps (regressions and improvements). Per host and case one chart: a panel per
point and metric (the throughputs, else the case's default metric), a line per arm, the flagged
steps marked; then a table of every flagged step with its run, commit and ratio.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
from markupsafe import Markup

from orchestrator.analysis.history import (
    ENVIRONMENT_CHANGE,
    IMPROVEMENT,
    RATIO_UNIT,
    REGRESSION,
    Finding,
)
from orchestrator.analysis.trends import Trend, default_metric, trends
from orchestrator.report.plots import HistoryLine, HistoryPanel, history_chart, history_figure
from orchestrator.report.style import ArmStyles, save_png
from orchestrator.report.tables import Cell, TableView
from orchestrator.report.text import metric_label

THROUGHPUTS = ("prefill_tok_s", "decode_tok_s")


@dataclass
class HostHistory:
    """One host fingerprint's trends."""

    anchor: str
    title: str
    device: str
    charts: list[Markup] = field(default_factory=list)


@dataclass
class HistoryView:
    """Every host's trends and the flagged steps."""

    hosts: list[HostHistory]
    flagged: TableView
    series: int
    runs: int
    steps: int


def _metrics(table: pa.Table, case: str) -> list[str]:
    present = set(pc.unique(table.filter(pc.equal(table["case_name"], case))["metric"]).to_pylist())
    chosen = [m for m in THROUGHPUTS if m in present]
    fallback = default_metric(table, case)
    return chosen or ([fallback] if fallback else [])


def history_view(table: pa.Table, styles: ArmStyles, uid: Callable[[], str], *, anchor: str) -> HistoryView | None:
    """The history section (its hosts' anchors start with `anchor`), or None when no series has two runs yet."""
    if table.num_rows == 0:
        return None
    by_host: dict[tuple[str, str], dict[str, list[Trend]]] = {}
    for case in sorted(set(table["case_name"].to_pylist())):
        for metric in _metrics(table, case):
            for t in trends(table, case, metric):
                # the charts draw each arm's own medians in the arms' colours; the ratio series
                # are judged by the nightly run and shown by `orchestrate history`
                if len(t.points) >= 2 and t.series.unit != RATIO_UNIT:
                    by_host.setdefault((t.series.device, t.series.host), {}).setdefault(case, []).append(t)
    if not by_host:
        return None
    hosts: list[HostHistory] = []
    flagged_rows: list[list[Cell]] = []
    runs: set[str] = set()
    series = 0
    for (device, host_name), cases in sorted(by_host.items()):
        # a series is one host's, across its environment changes (driver, OS, MLX: marked in it)
        title = f"{device} on {host_name or 'an unnamed host'}"
        host = HostHistory(f"{anchor}-{len(hosts)}", title, device)
        for case, items in cases.items():
            series += len(items)
            for t in items:
                runs.update(p.run_id for p in t.points)
                flagged_rows += [_flagged_row(host.title, case, t, f, styles) for f in t.changes]
            title = f"{host.title}: {case}, run medians over time (flagged steps marked)"
            host.charts.append(history_chart(title, history_panels(items), styles, uid=uid()))
        hosts.append(host)
    heads = [Cell("host"), Cell("case"), Cell("arm"), Cell("point"), Cell("metric"), Cell("step"), Cell("run")]
    heads += [Cell("commit"), Cell("ratio to the earlier runs [95 % CI]", "num")]
    return HistoryView(hosts, TableView(heads, flagged_rows, "flagged"), series, len(runs), len(flagged_rows))


def history_panels(items: list[Trend], *, by_host: bool = False) -> list[HistoryPanel]:
    """A panel per metric and point (and per device and host, `by_host`), a line per arm."""
    panels: dict[tuple[str, ...], HistoryPanel] = {}
    for t in items:
        s = t.series
        title = f"{metric_label(s.metric)}{' ratio to the baseline' if s.unit == RATIO_UNIT else ''}, {s.params}"
        key: tuple[str, ...] = (s.metric, s.params, s.unit)
        if by_host:
            key, title = (s.device, s.host, *key), f"{s.device} on {s.host or 'an unnamed host'}: {title}"
        panel = panels.setdefault(key, HistoryPanel(title, s.metric, []))
        flagged = [(f.started_at, f.median, f.verdict) for f in t.changes]
        panel.lines.append(
            HistoryLine(s.arm, s.arm, [p.started_at for p in t.points], [p.median for p in t.points], flagged)
        )
    return list(panels.values())


def history_png(items: list[Trend], path: Path, title: str) -> Path:
    """`orchestrate history --png`: the report's history chart of one case's trends, a panel per
    device, host and point."""
    styles = ArmStyles(dict.fromkeys(t.series.arm for t in items), [])
    return save_png(history_figure(title, history_panels(items, by_host=True), styles), path)


def _flagged_row(host: str, case: str, t: Trend, f: Finding, styles: ArmStyles) -> list[Cell]:
    cls = {REGRESSION: "SLOWER", IMPROVEMENT: "FASTER"}.get(f.verdict, "")
    return [
        Cell(host),
        Cell(case),
        Cell(t.series.arm, "arm", swatch=styles.colour(t.series.arm)),
        Cell(t.series.params),
        Cell(metric_label(t.series.metric)),
        Cell(f.verdict, f"verdict {cls}"),
        Cell(f.since_run or f.run_id),  # where the change began (the environment's: the run it changed in)
        Cell((f.since_commit or f.commit or "-")[:12] if f.verdict != ENVIRONMENT_CHANGE else f.environment or "-"),
        Cell(f"{f.ratio:.3f} [{f.ci_low:.3f}, {f.ci_high:.3f}]", "num"),
    ]
