"""Regressions found in the history: each run compared with earlier runs on the same host fingerprint.

A *series* is one (device, host fingerprint, case, arm, parameter point, metric); its points are
the runs that measured it, in time order, each with its clean samples (status ok, not contended,
finite). Only runs with the same `fingerprint_id` are compared: a number from another machine, OS
or driver is another series, never a baseline.

The test is sequential and tolerant of noise. Each run is compared with the last `window` runs
*since the series' last change point*, on the bootstrap interval of the ratio of medians
(`orchestrator.stats.ratio_of_medians`), oriented so that > 1 is better:

* regression: the whole interval lies below 1 and the point ratio is below `1 - t`;
* improvement: the whole interval lies above 1 and the point ratio is above `1 + t`;
* unclear: the point ratio is past `1 ± t` but the interval holds 1 (more repetitions settle it);
* steady: anything else.

`t` is the larger of `threshold` (default 5 %) and three times the run-to-run noise of the
baseline (the robust spread of its per-run medians), so a series that wanders by 4 % from night to
night needs a bigger step to be flagged. A regression or improvement is a change point: later
runs are compared with the new level only, so a step is flagged once, at the run (and commit)
where it happened, and not again on every later night.
"""

from __future__ import annotations

import datetime as dt
import math
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from orchestrator.stats import higher_is_better, ratio_of_medians, seed_for

WINDOW = 5
THRESHOLD = 0.05
NOISE_FACTOR = 3.0
# Not judged: build times (a cache hit repeats the first build's time), token counts, and a command's
# wall time (process start-up and loading; the benchmark's own numbers are what it parses). Their
# trends still show in `orchestrate history CASE --metric wall_seconds`.
IGNORED_METRICS = frozenset({"build_seconds", "wall_seconds", "lock_wait_s", "prompt_tokens", "generated_tokens"})

REGRESSION = "regression"
IMPROVEMENT = "improvement"
UNCLEAR = "unclear"
STEADY = "steady"
NO_HISTORY = "no-history"


@dataclass(frozen=True)
class SeriesKey:
    """What one series measures, and where."""

    device: str
    fingerprint_id: str
    case_name: str
    arm: str
    params: str  # `k=v k=v`, sorted
    metric: str
    unit: str

    def label(self) -> str:
        return f"{self.device} {self.case_name} {self.arm} {self.params} {self.metric}".replace("  ", " ")


@dataclass
class RunPoint:
    """One run's samples of one series."""

    run_id: str
    started_at: dt.datetime
    commit: str | None
    values: list[float] = field(default_factory=list)

    @property
    def median(self) -> float:
        return float(np.median(self.values)) if self.values else math.nan


@dataclass(frozen=True)
class Finding:
    """The verdict on one run of one series against its baseline."""

    series: SeriesKey
    run_id: str
    commit: str | None
    started_at: dt.datetime
    verdict: str
    median: float
    baseline_median: float = math.nan
    ratio: float = math.nan  # median / baseline median, raw (not oriented)
    ci_low: float = math.nan
    ci_high: float = math.nan
    tolerance: float = math.nan  # the threshold that applied (threshold or noise-based)
    baseline_runs: tuple[str, ...] = ()


def _params_key(entries: Any) -> str:
    return " ".join(f"{k}={v}" for k, v in sorted(entries or []))


def series_of(
    table: pa.Table, *, case: str | None = None, metric: str | None = None
) -> dict[SeriesKey, list[RunPoint]]:
    """Group clean rows into series of run points, each series in time order.

    Args:
        table: rows in the contract's schema (e.g. `ResultStore.read(sweep)`).
        case: keep one case (matched against `case_name`, then `case`).
        metric: keep one metric.
    """
    mask = pc.and_(pc.equal(table["status"], "ok"), pc.invert(pc.fill_null(table["contended"], False)))
    if case is not None:
        mask = pc.and_(mask, pc.or_(pc.equal(table["case_name"], case), pc.equal(table["case"], case)))
    if metric is not None:
        mask = pc.and_(mask, pc.equal(table["metric"], metric))
    cols = ["device", "fingerprint_id", "case_name", "arm", "params", "metric", "unit", "run_id", "started_at",
            "commit", "value"]  # fmt: skip
    points: dict[SeriesKey, dict[str, RunPoint]] = defaultdict(dict)
    for row in table.filter(mask).select(cols).to_pylist():
        value = row["value"]
        if (metric is None and row["metric"] in IGNORED_METRICS) or value is None or not math.isfinite(value):
            continue
        key = SeriesKey(row["device"], row["fingerprint_id"] or "", row["case_name"], row["arm"],
                        _params_key(row["params"]), row["metric"], row["unit"] or "")  # fmt: skip
        point = points[key].get(row["run_id"])
        if point is None:
            point = points[key][row["run_id"]] = RunPoint(row["run_id"], row["started_at"], row["commit"])
        point.started_at = min(point.started_at, row["started_at"])
        point.values.append(float(value))
    ordered = sorted(points, key=lambda k: k.label())
    return {k: sorted(points[k].values(), key=lambda p: (p.started_at, p.run_id)) for k in ordered}


def _noise(baseline: list[RunPoint]) -> float:
    """Run-to-run noise: the robust relative spread (1.4826 MAD / median) of per-run medians."""
    meds = np.array([p.median for p in baseline])
    if len(meds) < 2:
        return 0.0
    centre = float(np.median(meds))
    if centre == 0:
        return 0.0
    return float(1.4826 * np.median(np.abs(meds - centre)) / abs(centre))


def judge(key: SeriesKey, current: RunPoint, baseline: list[RunPoint], *, threshold: float = THRESHOLD) -> Finding:
    """The verdict on `current` against `baseline` runs (see the module's docstring)."""
    if not baseline:
        return Finding(key, current.run_id, current.commit, current.started_at, NO_HISTORY, current.median)
    pooled = [v for p in baseline for v in p.values]
    r = ratio_of_medians(current.values, pooled, seed=seed_for(key, current.run_id))
    tol = max(threshold, NOISE_FACTOR * _noise(baseline))
    higher = higher_is_better(key.metric)
    # oriented: > 1 is better
    point, lo, hi = (r.ratio, r.ci_low, r.ci_high) if higher else (1 / r.ratio, 1 / r.ci_high, 1 / r.ci_low)
    if not (math.isfinite(point) and math.isfinite(lo) and math.isfinite(hi)):
        verdict = UNCLEAR
    elif hi < 1 and point < 1 - tol:
        verdict = REGRESSION
    elif lo > 1 and point > 1 + tol:
        verdict = IMPROVEMENT
    elif point < 1 - tol or point > 1 + tol:
        verdict = UNCLEAR
    else:
        verdict = STEADY
    return Finding(
        key,
        current.run_id,
        current.commit,
        current.started_at,
        verdict,
        current.median,
        baseline_median=float(np.median(pooled)),
        ratio=r.ratio,
        ci_low=r.ci_low,
        ci_high=r.ci_high,
        tolerance=tol,
        baseline_runs=tuple(p.run_id for p in baseline),
    )


def detect(
    key: SeriesKey, points: list[RunPoint], *, window: int = WINDOW, threshold: float = THRESHOLD
) -> list[Finding]:
    """Judge every run of a series in order; a regression or improvement starts a new level.

    Returns:
        One finding per run (the first is `no-history`).
    """
    findings: list[Finding] = []
    level_start = 0
    for i, point in enumerate(points):
        baseline = points[max(level_start, i - window) : i]
        finding = judge(key, point, baseline, threshold=threshold)
        findings.append(finding)
        if finding.verdict in (REGRESSION, IMPROVEMENT):
            level_start = i
    return findings


def findings_for_run(
    table: pa.Table, run_id: str, *, window: int = WINDOW, threshold: float = THRESHOLD
) -> list[Finding]:
    """The verdicts on one run: every series it measured, against that series' own history.

    Args:
        table: the sweep's stored rows (all runs; only the same fingerprint's are compared).
        run_id: the run to judge (usually the one that just finished).
    """
    out = []
    for key, points in series_of(table).items():
        for finding in detect(key, points, window=window, threshold=threshold):
            if finding.run_id == run_id:
                out.append(finding)
    return out


def unjudged(table: pa.Table, run_id: str) -> list[str]:
    """Series the run measured only under contention (foreign GPU/CPU users): they cannot be judged."""
    rows = table.filter(pc.and_(pc.equal(table["run_id"], run_id), pc.equal(table["status"], "ok")))
    clean: set[tuple[str, ...]] = set()
    contended: set[tuple[str, ...]] = set()
    for row in rows.select(["device", "case_name", "arm", "params", "metric", "contended"]).to_pylist():
        if row["metric"] in IGNORED_METRICS:
            continue
        key = (row["device"], row["case_name"], row["arm"], _params_key(row["params"]), row["metric"])
        (contended if row["contended"] else clean).add(key)
    return [" ".join(x for x in key if x) for key in sorted(contended - clean)]


def regressions(findings: list[Finding]) -> list[Finding]:
    """The findings that are regressions."""
    return [f for f in findings if f.verdict == REGRESSION]


def _fmt(v: float) -> str:
    return "-" if not math.isfinite(v) else f"{v:.4g}"


def report_markdown(sweep: str, run_id: str, findings: list[Finding]) -> str:
    """A Markdown report of one run's verdicts, regressions first."""
    order = {REGRESSION: 0, UNCLEAR: 1, IMPROVEMENT: 2, STEADY: 3, NO_HISTORY: 4}
    counts = {v: sum(1 for f in findings if f.verdict == v) for v in order}
    lines = [
        f"# Regression check: sweep {sweep}, run {run_id}",
        "",
        ", ".join(f"{n} {v}" for v, n in counts.items() if n) or "no measured series",
        "",
        "| verdict | device | case | arm | params | metric | commit | median | baseline | ratio [95% CI] | tol |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for f in sorted(findings, key=lambda f: (order[f.verdict], f.series.label())):
        s = f.series
        ci = f"{_fmt(f.ratio)} [{_fmt(f.ci_low)}, {_fmt(f.ci_high)}]"
        tol = "-" if not math.isfinite(f.tolerance) else f"{f.tolerance:.1%}"
        cells = [f.verdict, s.device, s.case_name, s.arm, s.params, s.metric, (f.commit or "-")[:12]]
        cells += [_fmt(f.median), _fmt(f.baseline_median), ci, tol]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------- trend and plot

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
        return [f for f in self.findings if f.verdict in (REGRESSION, IMPROVEMENT)]


def trends(
    table: pa.Table, case: str, metric: str, *, window: int = WINDOW, threshold: float = THRESHOLD
) -> list[Trend]:
    """Every series of one case and metric, per device and host fingerprint, with its change points."""
    return [
        Trend(key, pts, detect(key, pts, window=window, threshold=threshold))
        for key, pts in series_of(table, case=case, metric=metric).items()
    ]


def plot_trends(items: list[Trend], path: str | Path, title: str) -> Path:
    """Draw run medians over time, one panel per device, regressions as red triangles (PNG, Agg)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    devices = sorted({t.series.device for t in items})
    fig = Figure(figsize=(9, 2.8 * max(len(devices), 1) + 0.6), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(max(len(devices), 1), 1, squeeze=False)[:, 0]
    fingerprints = {t.series.fingerprint_id for t in items}
    for ax, device in zip(axes, devices, strict=False):
        for t in (t for t in items if t.series.device == device):
            label = " ".join(x for x in (t.series.arm, t.series.params) if x)
            if len(fingerprints) > 1:
                label += f" [{t.series.fingerprint_id[:8]}]"
            ax.plot([p.started_at for p in t.points], [p.median for p in t.points], marker="o", ms=3, label=label)
            bad = [f for f in t.findings if f.verdict == REGRESSION]
            if bad:
                labelled = "regression" in ax.get_legend_handles_labels()[1]
                ax.scatter([f.started_at for f in bad], [f.median for f in bad], marker="v", s=70, color="red",
                           zorder=3, label="_" if labelled else "regression")  # fmt: skip
        unit = next((t.series.unit for t in items if t.series.device == device), "")
        ax.set_title(device, fontsize=10)
        ax.set_ylabel(f"{items[0].series.metric} ({unit})" if unit else items[0].series.metric, fontsize=8)
        ax.legend(fontsize=7, loc="best")
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
    fig.suptitle(title, fontsize=11)
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    return out
