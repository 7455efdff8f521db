"""`orchestrate report --html FILE`: one self-contained HTML file, the sweep's answer for a person.

In the order a reader needs it, per sweep and, inside it, per device:

1. the headline: the sweep's acceptance criteria with their verdicts on that device, then one
   chart of the main comparison (each criterion's arm against the baseline along the prompt
   length, with intervals and the criterion's bound; without criteria, the first case's first
   compared metric);
2. the details, per case: a table with one row per point and arm (medians, ratios with their
   intervals and coloured verdicts), each metric against x per arm, the gap chart;
3. the device-by-device view: per arm, every device's bandwidth and FLOP rate as a share of its
   own measured peak (a peak that a rate beat is raised to the best rate measured, and warned about);
4. the history per host, when series have two or more runs, with the flagged steps;
5. the host fingerprints.

The page is rendered from `templates/report.html.j2` by Jinja2 with autoescape; charts are inline
SVG (`report_plots`), one colour per arm for the whole report; there is no script and no
external resource, so the file opens anywhere, offline, as it is.
"""

from __future__ import annotations

import datetime as dt
import itertools
import re
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import jinja2
import pyarrow as pa
import pyarrow.compute as pc
from markupsafe import Markup

from orchestrator.analysis import groups, stats
from orchestrator.analysis.compare import CompareResult, compare_results, default_baseline
from orchestrator.analysis.criteria import evaluate_criteria
from orchestrator.analysis.cross_device import cross_device
from orchestrator.analysis.shortfall import shortfall_lines
from orchestrator.analysis.verdicts import CriterionVerdict
from orchestrator.errors import InputError
from orchestrator.report.history import HistoryView, history_view
from orchestrator.report.panels import (
    CaseAxes,
    criterion_bounds,
    gap_panels,
    headline_panels,
    metric_panels,
    share_panels,
)
from orchestrator.report.plots import Bound, metric_chart, ratio_chart, share_chart
from orchestrator.report.style import ArmStyles
from orchestrator.report.tables import (
    TableView,
    applies,
    comparison_table,
    criteria_table,
    cross_table,
    device_verdict,
    hosts_table,
    overview_table,
)
from orchestrator.report.text import legend, metric_label
from orchestrator.specs.sweep import SweepSpec

_ENV = jinja2.Environment(
    loader=jinja2.PackageLoader("orchestrator", "templates"),
    autoescape=True,
    undefined=jinja2.StrictUndefined,
    trim_blocks=True,
    lstrip_blocks=True,
)


@dataclass
class CaseView:
    """One case on one device: its table and charts."""

    name: str
    baseline: str
    table: TableView
    charts: list[Markup]


@dataclass
class DeviceView:
    """One device's headline and details."""

    name: str
    anchor: str
    about: str
    criteria: TableView | None
    headline: Markup | None
    headline_note: str
    cases: list[CaseView] = field(default_factory=list)
    history_anchor: str | None = None


@dataclass
class CrossView:
    """One case across devices."""

    case: str
    chart: Markup | None
    table: TableView


@dataclass
class SweepView:
    """One sweep's whole report."""

    name: str
    anchor: str
    description: str
    summary: str
    devices: list[DeviceView]
    left_out: list[str]
    cross: list[CrossView]
    history: HistoryView | None
    hosts: TableView
    no_clean: bool = False
    criteria: TableView | None = None  # only when nothing is clean: the verdicts, all devices together
    overview: TableView | None = None  # several devices: criteria down, devices across
    warnings: list[str] = field(default_factory=list)  # shown at the top


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "x"


def arm_order(table: pa.Table, spec: SweepSpec | None) -> list[str]:
    """Every arm: the sweep's order first (case by case), then the others alphabetically."""
    listed = [a for entry in spec.cases for a in entry.arm_names()] if spec is not None else []
    return list(dict.fromkeys([*listed, *sorted(set(table["arm"].to_pylist()))]))


def device_order(table: pa.Table, devices: set[str], spec: SweepSpec | None) -> list[str]:
    """The sweep's `devices` order, then accelerators before CPUs, then by name."""
    listed = spec.devices if spec is not None else []
    backends = dict(zip(table["device"].to_pylist(), table["backend"].to_pylist(), strict=True))
    return sorted(devices, key=lambda d: (listed.index(d) if d in listed else len(listed), backends.get(d) == "cpu", d))


def case_order(result: CompareResult, spec: SweepSpec | None) -> list[str]:
    """The cases in the sweep file's order, then any others by name."""
    listed = [entry.label for entry in spec.cases] if spec is not None else []
    return sorted(result.varying, key=lambda c: (listed.index(c) if c in listed else len(listed), c))


def _about(table: pa.Table, device: str) -> str:
    """`NVIDIA H200, cuda backend, MLX 0.32.4, host h200-1`: what one device's rows were measured on."""
    rows = table.filter(pc.equal(table["device"], device)).select(["backend", "gpu", "cpu", "hostname", "mlx_version"])
    first = rows.slice(0, 1).to_pylist()[0] if rows.num_rows else {}
    hosts = sorted({h for h in rows["hostname"].to_pylist() if h})
    parts = [first.get("gpu") or first.get("cpu") or "", f"{first.get('backend')} backend"]
    parts.append(f"MLX {first.get('mlx_version')}" if first.get("mlx_version") else "")
    parts.append(("host " if len(hosts) == 1 else "hosts ") + ", ".join(hosts) if hosts else "")
    return ", ".join(p for p in parts if p)


def _device_view(
    device: str,
    about: str,
    result: CompareResult,
    cases: list[str],
    verdicts: list[CriterionVerdict],
    axes: CaseAxes,
    styles: ArmStyles,
    threshold: float,
    uid: Callable[[], str],
) -> DeviceView:
    mine = [dv for dv in (device_verdict(v, device) for v in verdicts) if applies(dv)]
    view = DeviceView(device, f"device-{_slug(device)}", about, criteria_table(mine) if mine else None, None, "")
    if mine:
        panels = headline_panels(mine, axes)
        title = f"{device}: the criteria's ratios to the baseline, 95 % bootstrap intervals, bounds dash-dotted"
        view.headline = ratio_chart(title, panels, styles, uid=uid(), cols=4, size=(3.3, 1.95)) if panels else None
    elif verdicts:
        view.headline_note = "No criterion of the sweep applies to this device."
    for case in cases:
        if not any(r.case_name == case and r.dims.get("device") == device for r in result.rows):
            continue
        bounds: dict[str, list[Bound]] = defaultdict(list)
        for v in mine:
            bounds[v.criterion.metric] += criterion_bounds(v, case, axes)
        gaps = gap_panels(result, case, device, axes, {m: b for m, b in bounds.items() if b}, threshold)
        if view.headline is None and not verdicts and gaps:  # no criteria: the main comparison heads the section
            main = gaps[0]
            title = f"{device}: {case} {metric_label(main.metric)}, each arm to {main.baseline} (95 % intervals)"
            view.headline = ratio_chart(title, [main], styles, uid=uid(), cols=1)
            view.headline_note = "The sweep declares no acceptance criteria; its main comparison:"
        charts = []
        metrics = metric_panels(result, case, device, axes)
        if metrics:
            title = f"{device}: {case}, medians per arm with 95 % bootstrap intervals"
            charts.append(metric_chart(title, metrics, styles, uid=uid()))
        if gaps:
            title = f"{device}: {case}, ratio of medians to {result.baseline_of(case)} per arm (criteria dash-dotted)"
            charts.append(ratio_chart(title, gaps, styles, uid=uid()))
        table = comparison_table(result, case, device, styles)
        view.cases.append(CaseView(case, result.baseline_of(case), table, charts))
    return view


def _cross_views(
    table: pa.Table, axes: CaseAxes, styles: ArmStyles, order: list[str], resamples: int, uid: Callable[[], str]
) -> tuple[list[CrossView], list[str]]:
    """The device-by-device view per case, and a warning per device whose probed peak a rate beat."""
    rows = cross_device(table, resamples=resamples)
    over: dict[str, int] = defaultdict(int)
    for r in rows:
        for device, cell in r.cells.items():
            over[device] += cell.beat_probe
    warnings = [
        f"{device}: {n} rate{'s' if n > 1 else ''} above the device's probed peak. The probe was too low (taken "
        "while the machine was busy, or short of the device's best clocks), so its shares are of the best rate "
        "measured there instead; probe it again with ORCHESTRATE_REPROBE_PEAKS=1."
        for device, n in sorted(over.items())
        if n
    ]
    out = []
    for case in dict.fromkeys(r.case_name for r in rows):
        mine = [r for r in rows if r.case_name == case]
        panels = share_panels(mine, case, axes, order)
        devices = sorted({d for r in mine for d in r.cells})
        what = "device by device" if len(devices) > 1 else devices[0]
        title = f"{case}: {what}, each arm's rate as a share of the device's own measured peak"
        chart = share_chart(title, panels, styles, uid=uid()) if panels else None
        out.append(CrossView(case, chart, cross_table(mine, styles)))
    return out, warnings


def sweep_view(
    table: pa.Table,
    spec: SweepSpec | None,
    history: pa.Table,
    *,
    threshold: float,
    resamples: int,
    uid: Callable[[], str],
) -> SweepView:
    """One sweep's sections (see the module docstring)."""
    name = ", ".join(sorted(set(table["sweep"].to_pylist())))
    clean = groups.clean_rows(table)
    order = arm_order(table, spec)
    verdicts = evaluate_criteria(table, spec, resamples=resamples) if spec is not None and spec.criteria else []
    runs = sorted(set(table["run_id"].to_pylist()))
    summary = (
        f"{clean.num_rows} clean samples of {table.num_rows} rows (failed, unsupported and contended rows never "
        f"count); runs {', '.join(runs)}; verdicts at a {threshold:.0%} threshold on 95 % bootstrap intervals of "
        f"the median ({resamples} resamples)."
    )
    description = spec.description if spec is not None else ""
    view = SweepView(name, f"sweep-{_slug(name)}", description, summary, [], [], [], None, hosts_table(table))
    if clean.num_rows == 0:
        view.no_clean = True
        view.criteria = criteria_table(verdicts) if verdicts else None
        return view
    baseline = default_baseline(order, spec.baseline if spec else None)
    result = compare_results(table, baseline=baseline, threshold=threshold, resamples=resamples)
    rank = {arm: i for i, arm in enumerate(order)}
    for case, sides in result.case_sides.items():  # the sweep's order of arms, its baseline first
        result.case_sides[case] = [sides[0], *sorted(sides[1:], key=lambda s: rank.get(s, len(rank)))]
    cases = case_order(result, spec)
    baselines = {result.baseline_of(c) for c in result.varying} | {v.baseline for v in verdicts}
    styles = ArmStyles(order, baselines, [result.sides_of(c) for c in result.varying])
    axes = CaseAxes(result)
    devices = device_order(table, {r.dims["device"] for r in result.rows}, spec)
    view.devices = [
        _device_view(d, _about(table, d), result, cases, verdicts, axes, styles, threshold, uid) for d in devices
    ]
    if verdicts and len(devices) > 1:
        view.overview = overview_table(verdicts, devices)
    view.left_out = legend(result) + shortfall_lines(table, result.varying)
    view.cross, view.warnings = _cross_views(table, axes, styles, order, resamples, uid)
    view.history = history_view(history, styles, uid, anchor=f"{view.anchor}-history")
    if view.history is not None:
        for device in view.devices:
            device.history_anchor = next((h.anchor for h in view.history.hosts if h.device == device.name), None)
    return view


def build_report(
    table: pa.Table,
    *,
    spec: SweepSpec | None = None,
    threshold: float = stats.THRESHOLD,
    resamples: int = stats.RESAMPLES,
    history: pa.Table | None = None,
) -> str:
    """The whole report as one HTML document (see the module docstring).

    Args:
        table: the stored rows to report on (`orchestrator.analysis.selection.select_results`: one sweep, newest runs).
        spec: the sweep, for its arms' order, baseline and criteria; None: baseline guessed, no
            criteria (a sweep whose name differs from the spec's gets no criteria either).
        threshold: the relevance threshold of the comparison verdicts.
        resamples: bootstrap resamples.
        history: every stored run of the sweep, for the trend charts (default: `table` itself).

    Raises:
        InputError: the table has no rows at all.
    """
    if table.num_rows == 0:
        raise InputError("no result rows to report on")
    counter = itertools.count()

    def uid() -> str:
        return f"c{next(counter)}"

    history = table if history is None else history
    names = sorted(set(table["sweep"].to_pylist()))
    sweeps = []
    for name in names:
        rows = table.filter(pc.equal(table["sweep"], name))
        past = history.filter(pc.equal(history["sweep"], name)) if history.num_rows else history
        own = spec if spec is not None and (spec.name == name or len(names) == 1) else None
        sweeps.append(sweep_view(rows, own, past, threshold=threshold, resamples=resamples, uid=uid))
    generated = f"{dt.datetime.now(dt.UTC):%Y-%m-%d %H:%M} UTC"
    return _ENV.get_template("report.html.j2").render(sweeps=sweeps, generated=generated)


def write_report(path: Path, document: str) -> Path:
    """Write the report atomically; an `InputError` names a path that cannot be written."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(document, encoding="utf-8")
        tmp.replace(path)
    except OSError as exc:
        raise InputError(f"cannot write the report: {exc.strerror}", where=str(path)) from None
    return path
