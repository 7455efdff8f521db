"""`orchestrate results`: per device, case, parameters and arm, the median, the spread, the
sample count and the arm's speed relative to the sweep's baseline arm.

Only clean samples count: status ok and not contended; like `orchestrate compare`, the command
passes each point's newest run only unless asked to pool them (`--all-runs`). (`orchestrate
compare` adds confidence intervals and verdicts; this is the quick look.)
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

HIGHER_IS_BETTER = {"prefill_tok_s", "decode_tok_s", "gb_per_s", "tflop_per_s"}
DEFAULT_METRICS = ("seconds", "prefill_tok_s", "decode_tok_s", "load_seconds", "rel_error")


@dataclass
class ArmSummary:
    """One line of the summary."""

    device: str
    backend: str
    case: str
    params: str
    arm: str
    metric: str
    unit: str
    median: float
    p25: float
    p75: float
    n: int
    vs_baseline: float | None  # >1: better than the baseline (faster, or more tok/s)

    @property
    def spread_pct(self) -> float:
        """The interquartile range as a percentage of the median."""
        return 100.0 * (self.p75 - self.p25) / self.median if self.median else 0.0


def params_label(params: list[tuple[str, str]] | None) -> str:
    """`k=v k=v` for a row's parameter map."""
    return " ".join(f"{k}={v}" for k, v in (params or []))


def summarize(table: pa.Table, *, baseline: str | None, metrics: tuple[str, ...] = DEFAULT_METRICS) -> list[ArmSummary]:
    """Group clean samples and compare each arm with the baseline arm of the same point."""
    cols = table.select(
        ["device", "backend", "case_name", "params", "arm", "metric", "unit", "value", "status", "contended"]
    )
    groups: dict[tuple[str, str, str, str, str], list[float]] = defaultdict(list)
    meta: dict[tuple[str, str, str, str, str], tuple[str, str]] = {}
    for row in cols.to_pylist():
        if row["status"] != "ok" or row["contended"] or row["value"] is None or row["metric"] not in metrics:
            continue
        key = (row["device"], row["case_name"], params_label(row["params"]), row["arm"], row["metric"])
        groups[key].append(row["value"])
        meta[key] = (row["backend"] or "", row["unit"] or "")
    medians = {k: float(np.median(v)) for k, v in groups.items()}
    arms_of: dict[tuple[str, str, str], set[str]] = defaultdict(set)
    for device, case, params, arm, _ in groups:
        arms_of[(device, case, params)].add(arm)
    out: list[ArmSummary] = []
    for key in sorted(groups, key=lambda k: (k[0], k[1], _natural(k[2]), k[4], k[3])):
        device, case, params, arm, metric = key
        values = np.asarray(groups[key])
        ratio = None
        base_arm = baseline_arm(baseline, arms_of[(device, case, params)])
        base = medians.get((device, case, params, base_arm, metric)) if base_arm else None
        if base and metric != "rel_error" and medians[key] > 0:
            ratio = medians[key] / base if metric in HIGHER_IS_BETTER else base / medians[key]
        out.append(
            ArmSummary(
                device=device,
                backend=meta[key][0],
                case=case,
                params=params,
                arm=arm,
                metric=metric,
                unit=meta[key][1],
                median=medians[key],
                p25=float(np.percentile(values, 25)),
                p75=float(np.percentile(values, 75)),
                n=len(values),
                vs_baseline=ratio,
            )
        )
    return out


def left_out(table: pa.Table) -> str | None:
    """Why rows are not in the summary: how many are contended, failed or unsupported (or None)."""
    status = table.column("status").to_pylist()
    contended = table.column("contended").to_pylist()
    counts = {
        "contended (a foreign process used the device during the measurement)": sum(
            1 for st, c in zip(status, contended, strict=True) if st == "ok" and c
        ),
        "failed": status.count("failed"),
        "unsupported": status.count("unsupported"),
    }
    parts = [f"{n} {why}" for why, n in counts.items() if n]
    return f"left out: {', '.join(parts)}" if parts else None


def baseline_arm(baseline: str | None, arms: set[str]) -> str | None:
    """The sweep's baseline arm, or the case's variant of it (`affine` -> `affine-sorted`)."""
    if baseline is None or baseline in arms:
        return baseline
    variants = sorted(a for a in arms if a.startswith(f"{baseline}-"))
    return variants[0] if variants else None


def _natural(label: str) -> list[object]:
    """Sort `tokens=512` before `tokens=1024`."""
    out: list[object] = []
    for part in label.split():
        k, _, v = part.partition("=")
        out.append((k, int(v)) if v.isdigit() else (k, 0, v))
    return out


def format_value(value: float, unit: str) -> str:
    """A human reading of a value in its unit."""
    if unit == "seconds":
        if value < 1e-3:
            return f"{value * 1e6:.1f} us"
        if value < 1:
            return f"{value * 1e3:.2f} ms"
        return f"{value:.3f} s"
    if unit == "bytes":
        return f"{value / 2**30:.2f} GiB" if value >= 2**30 else f"{value / 2**20:.1f} MiB"
    if unit == "ratio":
        return f"{value:.2e}"
    return f"{value:.4g} {unit}"
