"""Stored rows as groups of samples: what `orchestrator.analysis.stats` compares.

A group is one (device, case, point, arm, metric) (`GroupKey`; grouped in DuckDB by
`orchestrator.analysis.samples`), each sample with the key that pairs it with the other arms'
samples of the same job, (run, job, sample). Only clean rows count: status ok, not contended,
not throttled, a finite value. Samples of two arms pair on their key and fall into ABBA blocks (`paired_samples`,
`block_values`). Which way each metric is better (`higher_is_better`) and which are exact numbers
(`EXACT_METRICS`) is said here too, once for every reader of the groups.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from workers.contract import Status
from workers.contract.precision import ROUNDS_PER_BLOCK

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


def block_of(key: Hashable) -> Hashable:
    """The ABBA block of a pairing key: (run, job, sample) -> (run, job, sample // 2)."""
    if isinstance(key, tuple) and key and isinstance(key[-1], int | np.integer):
        return (*key[:-1], key[-1] // ROUNDS_PER_BLOCK)
    if isinstance(key, int | np.integer):
        return key // ROUNDS_PER_BLOCK
    return key


def block_values(keys: Sequence[Hashable], d: np.ndarray) -> np.ndarray:
    """Per ABBA block, the mean of its pairs' log ratios `d`, blocks in key order.

    `workers.contract.precision.block_log_ratios` for pairs of several runs and jobs: pairs keyed
    (run, job, sample) fall in block (run, job, sample // 2).
    """
    sums: dict[Hashable, list[float]] = {}
    for k, v in zip(keys, d, strict=True):
        sums.setdefault(block_of(k), []).append(float(v))
    return np.asarray([sum(vs) / len(vs) for _, vs in sorted(sums.items(), key=lambda kv: _order(kv[0]))])


def _order(key: Hashable) -> tuple[str, Hashable]:
    """A sort key for pairing keys of any one kind (tuples or numbers compare among themselves)."""
    return (type(key).__name__, key)


def paired_samples(
    a: np.ndarray, b: np.ndarray, a_keys: Sequence[Hashable] | None, b_keys: Sequence[Hashable] | None
) -> tuple[list[Hashable], np.ndarray, np.ndarray] | None:
    """The samples of `a` and `b` that share a pairing key, ordered by key (None: no keys)."""
    if a_keys is None or b_keys is None:
        return None
    partner = {k: v for k, v in zip(b_keys, b, strict=True)}
    matched = sorted(
        ((k, v, partner[k]) for k, v in zip(a_keys, a, strict=True) if k in partner), key=lambda m: _order(m[0])
    )
    if not matched:
        return None
    keys, pa_, pb_ = zip(*matched, strict=True)
    return list(keys), np.asarray(pa_), np.asarray(pb_)
