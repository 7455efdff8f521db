"""Clean samples grouped in DuckDB, each group ordered so that pairs can be formed.

`grouped_samples(rows, keys)` groups the clean rows of an Arrow table (status ok, not contended, a
finite value; see `orchestrator.analysis.groups.clean_rows`) by the named columns and returns, per group,
its values ordered by (run, job, sample) together with each value's `sample` index, `job_key`
and `run_id`: two arms measured in one job (ABBA-interleaved) pair up by (job_key, sample); and
the precision its rows were sampled to (`extra.precision`), which plans further samples. The
first row of each group keeps its position, so sides can be listed in the order they were
measured (a sweep's arm order) rather than alphabetically.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import duckdb
import numpy as np
import pyarrow as pa

from orchestrator.analysis import groups


@dataclass(frozen=True)
class SampleSet:
    """One group's clean samples and where each came from."""

    values: np.ndarray  # float64, ordered by (run_id, job_key, sample)
    samples: np.ndarray  # int: each value's repetition index (-1: a once-per-arm value)
    job_keys: tuple[str, ...]
    run_ids: tuple[str, ...]
    first_row: int  # the position of the group's first row in the table it came from
    unit: str
    code_versions: tuple[str, ...]  # distinct, sorted
    commits: tuple[str, ...]  # distinct external commits (command cases), sorted
    precision: float | None = None  # the tightest target half-width its rows were sampled to (`extra.precision`)

    def pair_keys(self) -> list[tuple[str, str, int]]:
        """Each value's pairing key, (run, job, sample): arms of one job share it (`stats.compare_samples`)."""
        return [(str(r), str(j), int(s)) for r, j, s in zip(self.run_ids, self.job_keys, self.samples, strict=True)]

    def target_with(self, other: SampleSet) -> float | None:
        """The precision target of a comparison of this group with `other`: the tighter of the two."""
        targets = [p for p in (self.precision, other.precision) if p is not None]
        return min(targets) if targets else None

    def one(self, what: tuple[str, ...]) -> str | None:
        """The single value of a distinct tuple, or None when there are none or several."""
        return what[0] if len(what) == 1 else None


GROUP_SQL = """
SELECT {keys},
    list(value ORDER BY run_id, job_key, sample, _row) AS "values",
    list(sample ORDER BY run_id, job_key, sample, _row) AS samples,
    list(job_key ORDER BY run_id, job_key, sample, _row) AS job_keys,
    list(run_id ORDER BY run_id, job_key, sample, _row) AS run_ids,
    min(_row) AS first_row,
    any_value(unit) AS unit,
    list_sort(list_distinct(list(code_version))) AS code_versions,
    list_sort(list_distinct(list("commit"))) AS commits,
    min(try_cast(map_extract(extra, 'precision')[1] AS DOUBLE)) AS "precision"
FROM grouped GROUP BY ALL ORDER BY first_row
"""


def clean_in_duckdb(rows: pa.Table, name: str) -> duckdb.DuckDBPyConnection | None:
    """A DuckDB connection with the clean rows of `rows` as table `name`, each with its position `_row`.

    None when no row is clean.
    """
    clean = groups.clean_rows(rows)
    if clean.num_rows == 0:
        return None
    con = duckdb.connect()
    con.register(name, clean.append_column("_row", pa.array(np.arange(clean.num_rows), pa.int64())))
    return con


def grouped_samples(rows: pa.Table, keys: Sequence[str]) -> list[tuple[tuple[Any, ...], SampleSet]]:
    """The clean samples of `rows` grouped by `keys` (column names), groups in order of first appearance.

    A `params` key comes back as a `Point` (sorted `(name, value)` pairs); other keys as stored.
    """
    con = clean_in_duckdb(rows, "grouped")
    if con is None:
        return []
    listed = ", ".join(f'"{k}"' for k in keys)
    out = []
    for record in con.sql(GROUP_SQL.format(keys=listed)).fetchall():
        key = tuple(groups.point_of(v) if k == "params" else v for k, v in zip(keys, record, strict=False))
        values, samples, job_keys, run_ids, first, unit, versions, commits, precision = record[len(keys) :]
        out.append(
            (
                key,
                SampleSet(
                    np.asarray(values, dtype=np.float64),
                    np.asarray([-1 if s is None else s for s in samples], dtype=np.int64),
                    tuple(job_keys),
                    tuple(run_ids),
                    int(first),
                    unit or "",
                    tuple(v for v in versions if v is not None),
                    tuple(c for c in commits if c is not None),
                    None if precision is None else float(precision),
                ),
            )
        )
    con.close()
    return out
