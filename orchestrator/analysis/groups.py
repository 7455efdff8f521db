"""Stored rows as groups of samples: what `orchestrator.analysis.stats` compares.

A group is one (device, case, point, arm, metric), optionally kept apart per run and code
version; its samples come in row order, each with the key that pairs it with the other arms'
samples of the same job (`PairKey`). Only clean rows count: status ok, not contended, not
throttled, a finite value. Which way each metric is better (`higher_is_better`) and which are
exact numbers (`EXACT_METRICS`) is said here too, once for every reader of the groups.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from workers.contract import Status

# Metrics where a smaller value is the better one; every other metric is a rate (higher is better).
LOWER_IS_BETTER = frozenset(
    {"seconds", "host_seconds", "load_seconds", "peak_memory_bytes", "rel_error", "lock_wait_s", "token_latency_ms"}
)
# Measured once per arm and job, deterministic by construction: compared as exact numbers.
EXACT_METRICS = frozenset({"peak_memory_bytes", "rel_error"})


def higher_is_better(metric: str) -> bool:
    """True for rates (tok/s, GB/s, TFLOP/s); False for times, memory and errors."""
    return metric not in LOWER_IS_BETTER and not metric.endswith("_seconds") and not metric.endswith("_bytes")


def clean_rows(table: pa.Table) -> pa.Table:
    """Only the rows that count as samples: status ok, not contended, not throttled (taken while the
    GPU slowed itself for heat or a power emergency: `extra.throttled`, `workers.host.device_state`),
    a finite value."""
    if table.num_rows == 0:
        return table
    ok = pc.equal(table["status"], Status.OK.value)
    not_contended = pc.invert(pc.fill_null(table["contended"], False))
    not_throttled = pc.invert(
        pc.fill_null(pc.equal(pc.map_lookup(table["extra"], "throttled", "first"), "true"), False)
    )
    finite = pc.and_(pc.is_valid(table["value"]), pc.is_finite(pc.fill_null(table["value"], 0.0)))
    return table.filter(pc.and_(pc.and_(ok, not_contended), pc.and_(not_throttled, finite)))


Point = tuple[tuple[str, str], ...]


def point_of(params: Sequence[tuple[str, str]] | dict[str, str] | None) -> Point:
    """A parameter point as a sorted tuple of (name, value-as-text) pairs."""
    if params is None:
        return ()
    items = params.items() if isinstance(params, dict) else params
    return tuple(sorted((str(k), str(v)) for k, v in items))


@dataclass(frozen=True)
class GroupKey:
    """What a set of samples is of."""

    device: str
    case_name: str
    point: Point
    arm: str
    metric: str
    run_id: str | None = None
    code_version: str | None = None


PairKey = tuple[str, str, int]  # (run_id, job_key, sample): arms of one job pair on it
KeyedSamples = tuple[list[float], list[PairKey]]


def keyed_sample_groups(table: pa.Table, *, split_runs: bool = False) -> dict[GroupKey, KeyedSamples]:
    """Clean samples by group, in row order, each with its pairing key (`compare_samples`)."""
    rows = clean_rows(table)
    names = ("device", "case_name", "params", "arm", "metric", "value", "run_id", "code_version", "job_key", "sample")
    cols: dict[str, list[Any]] = {name: rows[name].to_pylist() for name in names}
    out: dict[GroupKey, KeyedSamples] = {}
    for i in range(rows.num_rows):
        key = GroupKey(
            cols["device"][i],
            cols["case_name"][i],
            point_of(cols["params"][i]),
            cols["arm"][i],
            cols["metric"][i],
            cols["run_id"][i] if split_runs else None,
            cols["code_version"][i] if split_runs else None,
        )
        values, keys = out.setdefault(key, ([], []))
        values.append(float(cols["value"][i]))
        sample = cols["sample"][i]
        keys.append((str(cols["run_id"][i]), str(cols["job_key"][i]), -1 if sample is None else int(sample)))
    return out


def sample_groups(table: pa.Table, *, split_runs: bool = False) -> dict[GroupKey, list[float]]:
    """Clean samples by group. `split_runs` keeps runs and code versions apart."""
    return {key: values for key, (values, _) in keyed_sample_groups(table, split_runs=split_runs).items()}
