"""`orchestrate query "SQL"`: read-only DuckDB SQL over the store (the view `results`), and `orchestrate runs`.

Read-only twice over: only SELECT statements are run (`WITH`, `DESCRIBE`, `SUMMARIZE`, `SHOW`, a
plain `EXPLAIN`), and the connection may reach no file outside the store, changes no setting and
loads no extension -- so `COPY ... TO`, `ATTACH`, `INSTALL`, `EXPORT`, `PRAGMA` and `SET` are
refused with a message, not run. DuckDB's own errors are passed on whole (a binder error's
"Candidate bindings" included).
"""

from __future__ import annotations

import re

import duckdb
import pyarrow as pa

from orchestrator.errors import InputError
from orchestrator.store.fragments import ResultStore
from orchestrator.store.scan import CACHED_FOOTERS, StoreScan
from workers.contract import SCHEMA_VERSION

ALLOWED = {duckdb.StatementType.SELECT, duckdb.StatementType.EXPLAIN}
ANALYZE = re.compile(r"\bANALY[SZ]E\b", re.IGNORECASE)


def check_read_only(sql: str) -> None:
    """Refuse anything but one read-only statement.

    Raises:
        InputError: the SQL does not parse, holds several statements, or one that could write.
    """
    try:
        statements = duckdb.extract_statements(sql)
    except duckdb.Error as exc:
        raise InputError(f"query failed: {exc}") from None
    if not statements:
        raise InputError("the query is empty")
    if len(statements) > 1:
        raise InputError(f"one statement at a time, please (got {len(statements)})")
    (statement,) = statements
    if statement.type not in ALLOWED or (
        statement.type is duckdb.StatementType.EXPLAIN and ANALYZE.search(statement.query)
    ):
        raise InputError(
            f"orchestrate query is read-only: {statement.type.name} statements are refused "
            "(SELECT, WITH ... SELECT, DESCRIBE, SUMMARIZE, SHOW and EXPLAIN are run)"
        )


def run_query(store: ResultStore, sql: str) -> pa.Table:
    """Run one read-only statement over the view `results`; files it cannot read are skipped (`store.broken`).

    Raises:
        InputError: nothing is stored, the SQL is refused or fails, or a file has a newer schema version.
    """
    check_read_only(sql)
    scan = StoreScan(store, read_only=True, cache_footers=True)
    if not scan.files:
        raise InputError("no results stored", where=str(store.root))
    refuse_newer(store, scan)
    try:
        return scan.arrow(sql)
    except duckdb.Error as exc:
        raise InputError(f"query failed: {exc}") from None


def refuse_newer(store: ResultStore, scan: StoreScan) -> None:
    """Refuse a store holding rows of a newer schema version, naming a file that has them.

    A compacted store has few files: DuckDB reads their `schema_version` (the footers it parses
    are kept for the query that follows, so the two cost one pass). A store of many fragments is
    asked through the point index instead, which knows each file's version without that pass.

    Raises:
        InputError: some row was written with a newer schema version.
    """
    if len(scan.files) <= CACHED_FOOTERS:
        found = scan.rows(
            "SELECT filename, schema_version FROM results_files WHERE schema_version > $v LIMIT 1",
            {"v": SCHEMA_VERSION},
        )
    else:
        import pyarrow.compute as pc  # kept out of the query verb's start (tests/orchestrator/test_cli.py)

        from orchestrator.store.index import whole_index  # a store of many fragments only

        index = whole_index(store)
        newer = index.filter(pc.greater(index["schema_version"], SCHEMA_VERSION)).slice(0, 1)
        found = list(zip(newer["file"].to_pylist(), newer["schema_version"].to_pylist(), strict=True))
    if found:
        (where, version), *_ = found
        raise InputError(
            f"written with schema version {version}, newer than this orchestrate reads ({SCHEMA_VERSION}): "
            "upgrade orchestrate to read it",
            where=where,
        )


RUNS_SQL = """
SELECT run_id, sweep, min(started_at) AS started_at, list_sort(list_distinct(list(date::VARCHAR))) AS dates,
    list_sort(list_distinct(list(device))) AS devices, count(DISTINCT job_key) AS jobs,
    count(DISTINCT job_key) FILTER (status = 'failed') AS failed_jobs,
    count(DISTINCT job_key) FILTER (status = 'ok' AND coalesce(contended, false)) AS contended_jobs,
    count(*) AS rows, list_sort(list_distinct(list(code_version))) AS code_versions
FROM results GROUP BY run_id, sweep ORDER BY started_at NULLS FIRST, run_id
"""


def stored_runs(store: ResultStore, sweep: str | None = None) -> pa.Table:
    """Every stored run (of one sweep): when it started, its dates, devices, jobs, failures, rows and commits.

    Raises:
        InputError: nothing is stored.
    """
    scan = StoreScan(store, sweep=sweep)
    if not scan.files:
        raise InputError("no results stored" + (f" for sweep {sweep!r}" if sweep else ""), where=str(store.root))
    return scan.arrow(RUNS_SQL)
