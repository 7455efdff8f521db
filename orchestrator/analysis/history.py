"""Regressions found in the history: each run compared with the earlier runs of the same series.

A *series* is one (device, host, case, arm, parameter point, metric); its points are the runs
that measured it, in time order, each with its clean samples (status ok, not contended, finite)
and the host environment it ran in (GPU driver, OS release, MLX version, BLAS, threads, ...:
the host fingerprint's fields). Each night is judged against the series' current level by
`orchestrator.analysis.changepoints` (its docstring gives the rule, and the false-alarm and detection
rates measured by simulation):

* regression / improvement: one night far past the level, or 2-3 nights together past it, by
  more than the night-to-night noise allows (a t test on the noise of the last `window` nights,
  so a noisy series needs a bigger step) and by more than `threshold` (2 %). The finding names
  the run and commit where the change began (`since_run`, `since_commit`); the new level is the
  baseline from then on, so a step is flagged once, and one bad night that returns is flagged
  at most once (not as a regression and then an improvement);
* environment: the host's environment changed at this run ("driver 580 -> 590: ratio 0.93
  [0.91, 0.95]"). The change is reported as such, with its ratio to the old level, never blamed
  on the run's commit, and the series goes on from a new level instead of starting over;
* steady, or no-history while there are too few nights to know the noise (7).

Besides each arm's own series, each arm has a ratio series to the reference arm (the sweep's
baseline; `series_of`): a board's clock or heat moves both arms of a job and cancels in the
ratio, whose nights scatter less, so a 3 % step stands out of it.

Why not an interval of the ratio of medians against a few earlier runs: that interval only knows
the noise within a night, while nights differ by more (clocks, heat, neighbours); over 30 stable
nights with 2-3 % night-to-night noise, 46-94 % of series raised an alarm that way.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import math
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from orchestrator.analysis import changepoints
from orchestrator.analysis.commits import head_rows
from orchestrator.analysis.compare import default_baseline
from orchestrator.analysis.groups import block_values, higher_is_better
from workers.contract import Status

WINDOW = changepoints.WINDOW
THRESHOLD = changepoints.THRESHOLD
# Not judged: build times (a cache hit repeats the first build's time), token counts, and a command's
# wall time (process start-up and loading; the benchmark's own numbers are what it parses). Their
# trends still show in `orchestrate history CASE --metric wall_seconds`.
IGNORED_METRICS = frozenset({"build_seconds", "wall_seconds", "lock_wait_s", "prompt_tokens", "generated_tokens"})
# The host environment a run measured in (row columns -> how a change is named).
ENVIRONMENT = {
    "gpu_driver": "driver",
    "os": "os",
    "mlx_version": "mlx",
    "mlx_device": "mlx device",
    "blas": "blas",
    "threads": "threads",
    "gpu": "gpu",
    "cpu": "cpu",
    "memory_bytes": "memory",
}

RATIO_UNIT = "x"  # the unit of a ratio series (`native/affine`, `1.023 x`): see `series_of`
REGRESSION = "regression"
IMPROVEMENT = "improvement"
STEADY = "steady"
NO_HISTORY = "no-history"
ENVIRONMENT_CHANGE = "environment"


@dataclass(frozen=True)
class SeriesKey:
    """What one series measures, and where."""

    device: str
    host: str
    case_name: str
    arm: str
    params: str  # `k=v k=v`, sorted
    metric: str
    unit: str

    def label(self) -> str:
        return f"{self.device} {self.case_name} {self.arm} {self.params} {self.metric}".replace("  ", " ")


@dataclass
class RunPoint:
    """One run's samples of one series, and the environment it ran in."""

    run_id: str
    started_at: dt.datetime
    commit: str | None
    values: list[float] = field(default_factory=list)
    environment: dict[str, str] = field(default_factory=dict)

    @property
    def median(self) -> float:
        return float(np.median(self.values)) if self.values else math.nan

    def log_error(self) -> float:
        """The standard error of the log median within the run (robust: 1.25 x 1.4826 MAD / sqrt n)."""
        x = np.asarray([v for v in self.values if v > 0], dtype=np.float64)
        if len(x) < 2:
            return 0.0
        logs = np.log(x)
        return float(1.2533 * 1.4826 * np.median(np.abs(logs - np.median(logs))) / math.sqrt(len(x)))


@dataclass(frozen=True)
class Finding:
    """The verdict on one run of one series against its level."""

    series: SeriesKey
    run_id: str
    commit: str | None
    started_at: dt.datetime
    verdict: str
    median: float
    baseline_median: float = math.nan
    ratio: float = math.nan  # against the level, raw (not oriented): the run's (or the change's nights') median
    ci_low: float = math.nan
    ci_high: float = math.nan
    tolerance: float = math.nan  # the smallest relative change that would have been flagged here
    baseline_runs: tuple[str, ...] = ()
    since_run: str | None = None  # where the change began (regression, improvement)
    since_commit: str | None = None
    environment: str | None = None  # `driver 580 -> 590` (environment changes)

    def describe(self) -> str:
        """`driver 580 -> 590: ratio 0.93 [0.91, 0.95]`, `regression since run R (commit C): ...`."""
        what = f"ratio {_fmt(self.ratio, 3)} [{_fmt(self.ci_low, 3)}, {_fmt(self.ci_high, 3)}]"
        if self.verdict == ENVIRONMENT_CHANGE:
            return f"{self.environment}: {what}"
        if self.verdict in (REGRESSION, IMPROVEMENT):
            return f"{self.verdict} since run {self.since_run} (commit {(self.since_commit or '-')[:12]}): {what}"
        return f"{self.verdict}: {what}"


def _params_key(entries: Any) -> str:
    return " ".join(f"{k}={v}" for k, v in sorted(entries or []))


def series_of(
    table: pa.Table, *, case: str | None = None, metric: str | None = None, reference: str | None = None
) -> dict[SeriesKey, list[RunPoint]]:
    """Group clean rows into series of run points, each series in time order.

    Besides each arm's own series, every arm measured in the same jobs as the reference arm has a
    **ratio series** (`arm/reference`, unit `x`): per run, the arm's ABBA block ratios to the
    reference (`orchestrator.analysis.groups.block_values`), whose median is the run's ratio. A
    board's clock or heat moves both arms of a job alike and cancels in the ratio, so its nights
    scatter less than either arm's own and a smaller change stands out.

    Args:
        table: rows in the contract's schema (e.g. `read_rows(store, sweep=...)`).
        case: keep one case (matched against `case_name`, then `case`).
        metric: keep one metric.
        reference: the arm the ratios are to (a sweep's baseline); None: `affine` where a case has
            it, else its first arm (`orchestrator.analysis.compare.default_baseline`).
    """
    table = head_rows(table)  # a commit comparison's BASE rows share HEAD's run: only HEAD is the run's point
    mask = pc.and_(pc.equal(table["status"], Status.OK.value), pc.invert(pc.fill_null(table["contended"], False)))
    if case is not None:
        mask = pc.and_(mask, pc.or_(pc.equal(table["case_name"], case), pc.equal(table["case"], case)))
    if metric is not None:
        mask = pc.and_(mask, pc.equal(table["metric"], metric))
    cols = [
        "device",
        "hostname",
        "case_name",
        "arm",
        "params",
        "metric",
        "unit",
        "run_id",
        "started_at",
        "commit",
        "value",
        "job_key",
        "sample",
        *ENVIRONMENT,
    ]
    points: dict[SeriesKey, dict[str, RunPoint]] = defaultdict(dict)
    paired: dict[SeriesKey, dict[str, dict[tuple[str, str, int], float]]] = defaultdict(lambda: defaultdict(dict))
    for row in table.filter(mask).select(cols).to_pylist():
        value = row["value"]
        if (metric is None and row["metric"] in IGNORED_METRICS) or value is None or not math.isfinite(value):
            continue
        key = SeriesKey(
            row["device"],
            row["hostname"] or "",
            row["case_name"],
            row["arm"],
            _params_key(row["params"]),
            row["metric"],
            row["unit"] or "",
        )
        point = points[key].get(row["run_id"])
        if point is None:
            env = {name: "" if row[name] is None else str(row[name]) for name in ENVIRONMENT}
            point = points[key][row["run_id"]] = RunPoint(row["run_id"], row["started_at"], row["commit"], [], env)
        point.started_at = min(point.started_at, row["started_at"])
        point.values.append(float(value))
        sample = -1 if row["sample"] is None else int(row["sample"])
        paired[key][row["run_id"]][(row["run_id"], str(row["job_key"]), sample)] = float(value)
    points.update(_ratio_series(points, paired, reference))
    ordered = sorted(points, key=lambda k: (k.label(), k.host))
    return {k: sorted(points[k].values(), key=lambda p: (p.started_at, p.run_id)) for k in ordered}


def _ratio_series(
    points: dict[SeriesKey, dict[str, RunPoint]],
    paired: dict[SeriesKey, dict[str, dict[tuple[str, str, int], float]]],
    reference: str | None,
) -> dict[SeriesKey, dict[str, RunPoint]]:
    """Each arm's series over the reference arm's, per run from the samples the two share a job and
    sample index with (see `series_of`)."""
    arms: dict[SeriesKey, list[str]] = defaultdict(list)
    for key in points:
        arms[dataclasses.replace(key, arm="")].append(key.arm)
    out: dict[SeriesKey, dict[str, RunPoint]] = {}
    for where, names in arms.items():
        ref = default_baseline(names, reference)
        ref_key = dataclasses.replace(where, arm=ref)
        for arm in names:
            if arm == ref:
                continue
            key = dataclasses.replace(where, arm=arm)
            ratio_key = dataclasses.replace(where, arm=f"{arm}/{ref}", unit=RATIO_UNIT)
            for run_id, mine in paired[key].items():
                theirs = paired[ref_key].get(run_id, {})
                shared = sorted(k for k in mine if k in theirs and mine[k] > 0 and theirs[k] > 0)
                if not shared:
                    continue
                logs = np.log([mine[k] for k in shared]) - np.log([theirs[k] for k in shared])
                ratios = [float(v) for v in np.exp(block_values(shared, logs))]
                p = points[key][run_id]
                out.setdefault(ratio_key, {})[run_id] = RunPoint(run_id, p.started_at, p.commit, ratios, p.environment)
    return out


def environment_change(before: dict[str, str], after: dict[str, str]) -> str | None:
    """`driver 580.65 -> 590.12; mlx 0.32.4 -> 0.33.0`, or None when nothing changed."""
    parts = [
        f"{label} {before.get(name) or '-'} -> {after.get(name) or '-'}"
        for name, label in ENVIRONMENT.items()
        if before.get(name, "") != after.get(name, "")
    ]
    return "; ".join(parts) or None


def detect(
    key: SeriesKey, points: list[RunPoint], *, window: int = WINDOW, threshold: float = THRESHOLD
) -> list[Finding]:
    """Judge every run of a series in order (see the module docstring).

    Returns:
        One finding per run (the first ones are `no-history`).
    """
    medians = [p.median for p in points]
    keep = [i for i, m in enumerate(medians) if m > 0 and math.isfinite(m)]
    higher = higher_is_better(key.metric)
    sign = 1.0 if higher else -1.0
    y = [sign * math.log(medians[i]) for i in keep]
    se = [points[i].log_error() for i in keep]
    changes = [
        j
        for j in range(1, len(keep))
        if environment_change(points[keep[j - 1]].environment, points[keep[j]].environment)
    ]
    calls = changepoints.judge_series(y, se, set(changes), window=window, threshold=threshold)
    out: dict[int, Finding] = {}
    for j, call in enumerate(calls):
        i = keep[j]
        out[i] = _finding(key, points, keep, j, call, sign)
    return [
        out.get(i) or Finding(key, p.run_id, p.commit, p.started_at, NO_HISTORY, p.median) for i, p in enumerate(points)
    ]


def _finding(
    key: SeriesKey, points: list[RunPoint], keep: list[int], j: int, call: changepoints.Call, sign: float
) -> Finding:
    """One night's call as a finding, in the metric's own orientation."""
    point = points[keep[j]]
    base = [points[keep[b]] for b in call.baseline]
    verdict = {
        changepoints.NO_HISTORY: NO_HISTORY,
        changepoints.STEADY: STEADY,
        changepoints.ENVIRONMENT: ENVIRONMENT_CHANGE,
    }.get(call.kind)
    if verdict is None:
        verdict = REGRESSION if call.shift < 0 else IMPROVEMENT
    ends = sorted(math.exp(sign * v) for v in (call.lo, call.hi)) if math.isfinite(call.lo) else [math.nan, math.nan]
    since = points[keep[call.since]]
    level = float(np.exp(np.mean([math.log(p.median) for p in base]))) if base else math.nan
    return Finding(
        key,
        point.run_id,
        point.commit,
        point.started_at,
        verdict,
        point.median,
        baseline_median=level,
        ratio=math.exp(sign * call.shift) if math.isfinite(call.shift) else math.nan,
        ci_low=ends[0],
        ci_high=ends[1],
        tolerance=math.expm1(call.tolerance) if math.isfinite(call.tolerance) else math.nan,
        baseline_runs=tuple(p.run_id for p in base),
        since_run=since.run_id if verdict in (REGRESSION, IMPROVEMENT) else None,
        since_commit=since.commit if verdict in (REGRESSION, IMPROVEMENT) else None,
        environment=environment_change(points[keep[j - 1]].environment, point.environment)
        if verdict == ENVIRONMENT_CHANGE
        else None,
    )


def findings_for_run(
    table: pa.Table,
    run_id: str,
    *,
    window: int = WINDOW,
    threshold: float = THRESHOLD,
    reference: str | None = None,
) -> list[Finding]:
    """The verdicts on one run: every series it measured, against that series' own history.

    Args:
        table: the sweep's stored rows (all runs; each host's series are its own).
        run_id: the run to judge (usually the one that just finished).
        window: nights that estimate the noise.
        threshold: the smallest relative change worth a call.
        reference: the arm of the ratio series (`series_of`; the sweep's baseline).
    """
    out = []
    for key, points in series_of(table, reference=reference).items():
        if not any(p.run_id == run_id for p in points):
            continue
        for finding in detect(key, points, window=window, threshold=threshold):
            if finding.run_id == run_id:
                out.append(finding)
    return out


def unjudged(table: pa.Table, run_id: str) -> list[str]:
    """Series the run measured only under contention (foreign GPU/CPU users): they cannot be judged."""
    rows = table.filter(pc.and_(pc.equal(table["run_id"], run_id), pc.equal(table["status"], Status.OK.value)))
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


def _fmt(v: float, digits: int = 4) -> str:
    return "-" if not math.isfinite(v) else f"{v:.{digits}g}"


def report_markdown(sweep: str, run_id: str, findings: list[Finding]) -> str:
    """A Markdown report of one run's verdicts, regressions first, environment changes named."""
    order = {REGRESSION: 0, ENVIRONMENT_CHANGE: 1, IMPROVEMENT: 2, STEADY: 3, NO_HISTORY: 4}
    counts = {v: sum(1 for f in findings if f.verdict == v) for v in order}
    lines = [
        f"# Regression check: sweep {sweep}, run {run_id}",
        "",
        ", ".join(f"{n} {v}" for v, n in counts.items() if n) or "no measured series",
        "",
        "| verdict | device | host | case | arm | params | metric | since (commit) | median | level | ratio [95% CI] "
        "| tol | what changed |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for f in sorted(findings, key=lambda f: (order[f.verdict], f.series.label())):
        s = f.series
        ci = f"{_fmt(f.ratio)} [{_fmt(f.ci_low)}, {_fmt(f.ci_high)}]"
        tol = "-" if not math.isfinite(f.tolerance) else f"{f.tolerance:.1%}"
        since = f"{f.since_run} ({(f.since_commit or '-')[:12]})" if f.since_run else (f.commit or "-")[:12]
        cells = [f.verdict, s.device, s.host, s.case_name, s.arm, s.params, s.metric, since]
        cells += [_fmt(f.median), _fmt(f.baseline_median), ci, tol, f.environment or ""]
        lines.append("| " + " | ".join(cells) + " |")
    changed = [f for f in findings if f.verdict == ENVIRONMENT_CHANGE]
    if changed:
        lines += ["", "Environment changes (not blamed on a commit; each series goes on from a new level):", ""]
        lines += [f"- {f.series.label()}: {f.describe()}" for f in changed]
    return "\n".join(lines) + "\n"
