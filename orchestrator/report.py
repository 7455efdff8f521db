"""`orchestrate report --html FILE`: one self-contained HTML file that answers the seeds.

Sections: the criteria verdicts; the comparison table; per device and case, each metric against
the prompt length per arm with confidence bands and the gap chart; achieved bandwidth and FLOP
rate as a share of each device's measured peak; the host fingerprints. Plots are matplotlib SVGs
embedded as `data:` URIs; there is no script and no external resource, so the file opens
anywhere, offline, as it is.
"""

from __future__ import annotations

import datetime as dt
import html
from collections import defaultdict
from pathlib import Path

import pyarrow as pa

from orchestrator import report_plots as plots
from orchestrator import stats
from orchestrator.compare import METRIC_ORDER, compare_results, default_baseline, device_peaks, varying_params
from orchestrator.compare_render import display_rows, format_value, metric_label
from orchestrator.criteria import CriterionVerdict, describe, evaluate_criteria
from orchestrator.errors import InputError
from orchestrator.specs import Criterion, SweepSpec
from orchestrator.stats import GroupKey, Point, Summary

LENGTH_PARAMS = ("prompt_tokens", "tokens")
GAP_METRICS = ("prefill_tok_s", "decode_tok_s")
PEAK_METRICS = {"gb_per_s": "peak_copy_gb_s", "tflop_per_s": "peak_tflop_s"}
UNITS = {
    "prefill_tok_s": "tok/s",
    "decode_tok_s": "tok/s",
    "seconds": "s",
    "gb_per_s": "GB/s",
    "tflop_per_s": "TFLOP/s",
    "peak_memory_bytes": "bytes",
    "load_seconds": "s",
    "build_seconds": "s",
    "rel_error": "relative error",
}
FINGERPRINT_COLUMNS = (
    "fingerprint_id", "device", "backend", "hostname", "os", "cpu", "cpu_count", "memory_bytes",
    "gpu", "gpu_driver", "mlx_version", "mlx_device", "blas", "threads",
)  # fmt: skip
CSS = """
body { font-family: system-ui, sans-serif; margin: 2em; color: #222; }
table { border-collapse: collapse; margin: 0.5em 0 1.5em; font-size: 0.85em; }
th, td { border: 1px solid #ccc; padding: 0.25em 0.5em; text-align: left; vertical-align: top; }
th { background: #f2f2f2; }
.PASS { background: #d9f2d9; } .FAIL { background: #f7d4d4; } .AMBIGUOUS { background: #fbefc8; }
img { max-width: 100%; display: block; margin: 0.5em 0 1.5em; }
pre { background: #f7f7f7; padding: 0.5em; white-space: pre-wrap; }
.wide { overflow-x: auto; }
table.criteria td:last-child { white-space: pre-line; font-family: monospace; }
"""


def _x_param(points: list[Point]) -> str | None:
    """The parameter on the x axis: a length if it varies, else the first numeric varying one."""
    names = varying_params(points)
    for name in names:
        values = {v for p in points for k, v in p if k == name}
        if all(_is_number(v) for v in values) and (name in LENGTH_PARAMS or len(values) > 1):
            return name
    return None


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _series_label(arm: str, point: Point, others: list[str]) -> str:
    extra = [f"{k}={v}" for k, v in point if k in others]
    return " ".join([arm, *extra])


class ReportData:
    """Summaries of every group, indexed for the figures."""

    def __init__(self, table: pa.Table, resamples: int) -> None:
        self.table = table
        self.groups = stats.sample_groups(table)
        self.summaries: dict[GroupKey, Summary] = stats.summarize_groups(self.groups, resamples=resamples)
        self.resamples = resamples
        self.by_case: dict[tuple[str, str], list[GroupKey]] = defaultdict(list)
        for key in self.groups:
            self.by_case[(key.device, key.case_name)].append(key)
        self.peaks = device_peaks(table)

    def case_points(self, case_name: str) -> list[Point]:
        return sorted({k.point for k in self.groups if k.case_name == case_name})

    def axis(self, case_name: str) -> tuple[str | None, list[str]]:
        points = self.case_points(case_name)
        x = _x_param(points)
        return x, [n for n in varying_params(points) if n != x]


def _x_of(point: Point, xparam: str | None) -> float:
    return float(dict(point)[xparam]) if xparam else 0.0


def metric_section(data: ReportData, device: str, case_name: str) -> str:
    """Each metric against the x parameter, a line per arm, with bootstrap bands."""
    xparam, others = data.axis(case_name)
    keys = data.by_case[(device, case_name)]
    metrics = sorted(
        {k.metric for k in keys},
        key=lambda m: (m not in METRIC_ORDER, METRIC_ORDER.index(m) if m in METRIC_ORDER else 0, m),
    )
    panels: dict[str, tuple[str, list[plots.Series]]] = {}
    for metric in metrics:
        lines: dict[str, list[tuple[float, Summary]]] = defaultdict(list)
        for k in keys:
            if k.metric == metric:
                lines[_series_label(k.arm, k.point, others)].append((_x_of(k.point, xparam), data.summaries[k]))
        panels[metric_label(metric)] = (
            UNITS.get(metric, metric),
            [plots.series_of(lbl, pts) for lbl, pts in sorted(lines.items())],
        )
    uri = plots.metric_figure(f"{device}: {case_name}", xparam or "point", panels)
    return _img(uri, f"{device} {case_name}: metrics per arm")


def gap_section(
    data: ReportData,
    device: str,
    case_name: str,
    baseline: str,
    threshold: float,
    bounds: dict[str, list[tuple[str, float]]],
) -> str:
    """The gap of each arm to the baseline per length, with intervals and the criteria's bounds."""
    xparam, others = data.axis(case_name)
    keys = data.by_case[(device, case_name)]
    present = {k.metric for k in keys}
    metrics = [m for m in GAP_METRICS if m in present] or [m for m in ("seconds",) if m in present]
    panels: dict[str, list[plots.Series]] = {}
    for metric in metrics:
        lines: dict[str, list[tuple[float, stats.Ratio]]] = defaultdict(list)
        for k in keys:
            if k.metric != metric or k.arm == baseline:
                continue
            base = data.groups.get(GroupKey(k.device, k.case_name, k.point, baseline, metric))
            if not base:
                continue
            c = stats.compare_samples(
                data.groups[k],
                base,
                metric=metric,
                threshold=threshold,
                seed=stats.seed_for(k, baseline),
                resamples=data.resamples,
            )
            lines[_series_label(k.arm, k.point, others)].append((_x_of(k.point, xparam), c.speedup))
        if lines:
            panels[metric_label(metric)] = [plots.ratio_series(lbl, pts) for lbl, pts in sorted(lines.items())]
    if not panels:
        return ""
    label_bounds = {metric_label(m): b for m, b in bounds.items()}
    uri = plots.gap_figure(
        f"{device}: {case_name}, gap to {baseline} (positive: better)",
        xparam or "point",
        panels,
        threshold=threshold,
        bounds=label_bounds,
    )
    return _img(uri, f"{device} {case_name}: gap to {baseline}")


def peak_section(data: ReportData, case_name: str) -> str:
    """Achieved GB/s and TFLOP/s per device and arm as a share of that device's measured peak."""
    xparam, others = data.axis(case_name)
    keys = [k for k in data.groups if k.case_name == case_name and k.metric in PEAK_METRICS]
    if not keys:
        return ""
    with_peaks = any(data.peaks.get(k.device, {}).get(PEAK_METRICS[k.metric]) for k in keys)
    panels: dict[str, list[plots.Series]] = {}
    for metric, peak_col in PEAK_METRICS.items():
        lines: dict[str, list[tuple[float, Summary]]] = defaultdict(list)
        for k in keys:
            if k.metric != metric:
                continue
            s = data.summaries[k]
            peak = data.peaks.get(k.device, {}).get(peak_col)
            if with_peaks:
                if not peak:
                    continue
                s = Summary(s.n, s.median / peak * 100, s.ci_low / peak * 100, s.ci_high / peak * 100, s.cv)
            lines[f"{k.device} {_series_label(k.arm, k.point, others)}"].append((_x_of(k.point, xparam), s))
        if lines:
            panels[metric_label(metric)] = [plots.series_of(lbl, pts) for lbl, pts in sorted(lines.items())]
    if not panels:
        return ""
    title = f"{case_name}: share of each device's measured peak" if with_peaks else f"{case_name}: achieved rates"
    uri = plots.peak_figure(title, xparam or "point", panels, fraction=with_peaks)
    return _img(uri, title)


def _img(uri: str, alt: str) -> str:
    return f'<img class="plot" alt="{html.escape(alt)}" src="{uri}">'


def _table(heads: list[str], rows: list[list[str]], row_classes: list[str] | None = None, css: str = "") -> str:
    cls_attr = f' class="{css}"' if css else ""
    out = [f"<table{cls_attr}><tr>" + "".join(f"<th>{html.escape(h)}</th>" for h in heads) + "</tr>"]
    for i, cells in enumerate(rows):
        cls = f' class="{row_classes[i]}"' if row_classes else ""
        out.append(f"<tr{cls}>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in cells) + "</tr>")
    return "\n".join(out) + "</table>"


def criteria_bounds(
    criteria: list[Criterion], case_name: str, spec: SweepSpec | None
) -> dict[str, list[tuple[str, float]]]:
    """Per metric, the bounds of the criteria that apply to a case, oriented like the gap chart."""
    kinds = {c.label: c.case for c in spec.cases} if spec is not None else {}
    out: dict[str, list[tuple[str, float]]] = defaultdict(list)
    for c in criteria:
        if c.case is not None and c.case not in (case_name, kinds.get(case_name)):
            continue
        for bound in (c.min_ratio, c.max_ratio):
            if bound is not None:
                out[c.metric].append((c.name, bound if stats.higher_is_better(c.metric) else 1 / bound))
    return out


def criteria_section(verdicts: list[CriterionVerdict]) -> str:
    """The verdicts table, then every non-passing point and every missing one."""
    rows, classes = [], []
    for v in verdicts:
        lines = describe(v)
        rows.append(
            [v.outcome.value, v.criterion.name, lines[0].split(": ", 1)[-1], "\n".join(x.strip() for x in lines[1:])]
        )
        classes.append(v.outcome.value)
    return _table(["verdict", "criterion", "measured", "points not passing / missing"], rows, classes, "criteria")


def fingerprint_section(table: pa.Table) -> str:
    """One row per host fingerprint, with the peaks measured on it."""
    cols = [c for c in FINGERPRINT_COLUMNS if c in table.column_names]
    seen: dict[str, list[str]] = {}
    data = table.select([*cols, "peak_copy_gb_s", "peak_tflop_s"]).to_pylist()
    for row in data:
        fid = str(row["fingerprint_id"])
        if fid in seen:
            continue
        cells = [str(row[c]) if row[c] is not None else "" for c in cols]
        cells.append(format_value("gb_per_s", row["peak_copy_gb_s"]) if row["peak_copy_gb_s"] else "not measured")
        cells.append(format_value("tflop_per_s", row["peak_tflop_s"]) if row["peak_tflop_s"] else "not measured")
        seen[fid] = cells
    return _table([*cols, "peak copy GB/s", "peak TFLOP/s"], list(seen.values()))


def build_report(
    table: pa.Table,
    *,
    spec: SweepSpec | None = None,
    threshold: float = stats.THRESHOLD,
    resamples: int = stats.RESAMPLES,
) -> str:
    """The whole report as one HTML document (see the module docstring).

    Args:
        table: the stored rows of one sweep (`ResultStore.read`).
        spec: the sweep, for its baseline and criteria; None: baseline guessed, no criteria.
        threshold: the relevance threshold of the comparison verdicts.
        resamples: bootstrap resamples.

    Raises:
        InputError: the table has no rows at all.
    """
    if table.num_rows == 0:
        raise InputError("no result rows to report on")
    clean = stats.clean_rows(table)
    data = ReportData(table, resamples)
    arms = sorted({k.arm for k in data.groups}) or sorted(set(table["arm"].to_pylist()))
    baseline = default_baseline(arms, spec.baseline if spec else None)
    sweep_names = sorted(set(table["sweep"].to_pylist()))
    runs = sorted(set(table["run_id"].to_pylist()))
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        '<link rel="icon" href="data:,">',
        f"<title>orchestrate report: {html.escape(', '.join(sweep_names))}</title>",
        f"<style>{CSS}</style></head><body>",
        f"<h1>Sweep {html.escape(', '.join(sweep_names))}</h1>",
        f"<p>{clean.num_rows} clean samples of {table.num_rows} rows (failed, unsupported and contended rows never "
        f"count); runs {html.escape(', '.join(runs))}; baseline arm <b>{html.escape(baseline)}</b>; verdict "
        f"threshold {threshold:.0%}; 95 % bootstrap intervals of the median ({resamples} resamples). Generated "
        f"{dt.datetime.now(dt.UTC):%Y-%m-%d %H:%M} UTC.</p>",
    ]
    criteria = spec.criteria if spec is not None else []
    if spec is not None and spec.criteria:
        verdicts = evaluate_criteria(table, spec, resamples=resamples)
        parts += ["<h2>Acceptance criteria</h2>", criteria_section(verdicts)]
    if clean.num_rows == 0:  # every row failed, was unsupported or contended: say so, plot nothing
        parts.append("<p><b>No clean samples</b>: every row failed, was unsupported or was contended.</p>")
        parts += ["<h2>Hosts</h2>", fingerprint_section(table), "</body></html>"]
        return "\n".join(parts)
    result = compare_results(table, baseline=baseline, threshold=threshold, resamples=resamples)
    parts.append("<h2>Comparison</h2>")
    for case, (heads, body) in display_rows(result).items():
        title = f"{case} (baseline: {result.baseline_of(case)})"
        parts += [f"<h3>{html.escape(title)}</h3>", '<div class="wide">', _table(heads, body), "</div>"]
    for device in sorted({k.device for k in data.groups}):
        parts.append(f"<h2>Device {html.escape(device)}</h2>")
        for dev, case_name in sorted(data.by_case):
            if dev != device:
                continue
            parts.append(f"<h3>{html.escape(case_name)}</h3>")
            parts.append(metric_section(data, device, case_name))
            case_base = result.baseline_of(case_name)
            bounds = criteria_bounds(criteria, case_name, spec)
            parts.append(gap_section(data, device, case_name, case_base, threshold, bounds))
    peak_parts = [peak_section(data, case) for case in sorted({k.case_name for k in data.groups})]
    if any(peak_parts):
        parts += ["<h2>Bandwidth and FLOP rate against each device's measured peak</h2>", *peak_parts]
    parts += ["<h2>Hosts</h2>", fingerprint_section(table), "</body></html>"]
    return "\n".join(p for p in parts if p)


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
