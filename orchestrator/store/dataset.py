"""The rows of the result store, as every reader gets them.

`read_rows` is the readers' common query over a `StoreScan` (`orchestrator.store.scan`): rows in
`SCHEMA`, of some runs, cases and metrics, or only the newest run of each (device, case, point) --
resumed sweeps keep older runs' points, and a point measured again replaces its older rows
instead of pooling samples from other code. Selection and grouping run in DuckDB, which reads
only the columns and files a query needs. Which files hold each point's newest run comes from a
small index beside the store (`orchestrator.store.index`), so such a read opens only those files.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from orchestrator.errors import InputError
from orchestrator.store.fragments import ResultStore
from orchestrator.store.index import newest_points
from orchestrator.store.scan import StaleListing, StoreScan
from workers.contract import SCHEMA, SCHEMA_VERSION


def where_clause(
    runs: Sequence[str] | None = None,
    cases: Sequence[str] | None = None,
    metrics: Sequence[str] | None = None,
    *,
    prefix: str = "",
) -> tuple[str, dict[str, Any]]:
    """A DuckDB `WHERE` condition and its parameters: only these runs, cases (name or kind) and metrics."""
    clauses, params = ["true"], {}
    if runs:
        clauses.append(f"list_contains($runs, {prefix}run_id)")
        params["runs"] = list(runs)
    if cases:
        clauses.append(f'(list_contains($cases, {prefix}case_name) OR list_contains($cases, {prefix}"case"))')
        params["cases"] = list(cases)
    if metrics:
        clauses.append(f"list_contains($metrics, {prefix}metric)")
        params["metrics"] = list(metrics)
    return " AND ".join(clauses), params


def read_rows(
    store: ResultStore,
    *,
    sweep: str | None = None,
    runs: Sequence[str] | None = None,
    cases: Sequence[str] | None = None,
    metrics: Sequence[str] | None = None,
    newest: bool = False,
) -> pa.Table:
    """Stored rows in `SCHEMA`, selected in DuckDB, in file order (a job's arms as it measured them).

    Args:
        store: the result store (files it cannot read are skipped and listed in `store.broken`).
        sweep: one sweep (None: all).
        runs: only these run ids.
        cases: only these cases (by name in the sweep, or by kind).
        metrics: only these metrics.
        newest: per (device, case, point), only the rows of the newest run that measured it.

    Raises:
        InputError: a file was written by a newer orchestrate (its schema version is higher).
    """
    for _ in range(3):
        try:
            return _read(store, sweep, runs, cases, metrics, newest)
        except StaleListing:
            continue  # a compaction swapped a partition under the read: choose the files again
    return _read(store, sweep, runs, cases, metrics, newest)


def _read(
    store: ResultStore,
    sweep: str | None,
    runs: Sequence[str] | None,
    cases: Sequence[str] | None,
    metrics: Sequence[str] | None,
    newest: bool,
) -> pa.Table:
    where, params = where_clause(runs, cases, metrics, prefix="r.")
    if newest:
        chosen = newest_points(store, sweep, runs, cases)
        scan = StoreScan(store, files=sorted({f for files in chosen["files"].to_pylist() for f in files}))
        scan.con.register("chosen", chosen.drop_columns(["files"]))
        join = (
            "SEMI JOIN chosen c ON r.device = c.device AND r.case_name = c.case_name "
            "AND r.params::VARCHAR = c.point AND r.run_id = c.run_id"
        )
    else:
        scan = StoreScan(store, sweep=sweep)
        join = ""
    have = set(scan.columns())
    select = ", ".join(f'r."{c}"' for c in SCHEMA.names if c in have)
    sql = (
        f"SELECT {select}, r.filename FROM results_files r {join} WHERE {where} ORDER BY r.filename, r.file_row_number"
    )
    return _in_schema(scan.arrow(sql, params), store)


def _in_schema(table: pa.Table, store: ResultStore) -> pa.Table:
    """The selected rows in `SCHEMA`: newer schema versions refused, absent (newer, nullable) columns null."""
    if table.num_rows:
        newer = table.filter(pc.greater(table["schema_version"], SCHEMA_VERSION))
        if newer.num_rows:
            version = newer["schema_version"][0].as_py()
            raise InputError(
                f"written with schema version {version}, newer than this orchestrate reads ({SCHEMA_VERSION}): "
                "upgrade orchestrate to read it",
                where=newer["filename"][0].as_py(),
            )
    table = table.drop_columns(["filename"])
    for f in SCHEMA:
        if f.name not in table.column_names:
            table = table.append_column(f.name, pa.nulls(table.num_rows, f.type))
    return table.select(SCHEMA.names).cast(SCHEMA)
