"""DuckDB over the result store: how every reader gets its rows.

`StoreScan` opens one DuckDB connection with the view `results` over the store's files (of one
sweep, when named): hive partitions typed (`sweep`, `device` text, `date` a DATE), columns matched
by name across schema versions (DuckDB takes the first file's columns; where another file lacks
one, the view is made again with `union_by_name`, which costs a second look at every footer).
Selection and grouping run in DuckDB, which reads only the columns and files a query needs.
A file DuckDB cannot read (a bad footer, a corrupt data page) is dropped from the view and the
query run again: each such file is noted once in `store.broken`, and never makes a read fail. A
file that vanished under a read (a compaction swapped its partition) makes the scan list the
files again.

`read_rows` is the readers' common query: rows in `SCHEMA`, of some runs, cases and metrics, or
only the newest run of each (device, case, point) -- resumed sweeps keep older runs' points, and a
point measured again replaces its older rows instead of pooling samples from other code. Which
files hold each point's newest run comes from a small index beside the store
(`orchestrator.store.index`), so such a read opens only those files.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import duckdb
import pyarrow as pa

from orchestrator.errors import InputError
from orchestrator.store.fragments import ResultStore
from workers.contract import SCHEMA, SCHEMA_VERSION

FILES_VARIABLE = "orchestrate_files"
HIVE_TYPES = "{'sweep': VARCHAR, 'date': DATE, 'device': VARCHAR}"
# A quoted path in a DuckDB error: `Failed to read file "x.parquet": ...`, `No magic bytes ... 'x.parquet'`.
ERROR_PATH = re.compile(r"""["']([^"']+\.parquet)["']""")
VANISHED = ("No files found that match the pattern", "No such file or directory")
MISMATCH = "schema mismatch"
# Errors of the SQL itself, never of a file: no search for a bad file after these.
SQL_ERRORS = (
    duckdb.ParserException,
    duckdb.BinderException,
    duckdb.CatalogException,
    duckdb.SyntaxException,
    duckdb.PermissionException,
    duckdb.ConversionException,
    duckdb.OutOfRangeException,
    duckdb.NotImplementedException,
)
DECODE_ALL = "SELECT bit_xor(hash(COLUMNS(*))) FROM read_parquet($files, union_by_name = true)"
MAX_RETRIES = 200
CACHED_FOOTERS = 5000  # a compacted store's files, not a year of fragments (a parsed footer is ~70 kB)
RESULTS_VIEW = "CREATE OR REPLACE TEMP VIEW results AS SELECT * EXCLUDE (filename, file_row_number) FROM results_files"


class StaleListing(Exception):
    """A file of an explicit listing vanished (a compaction swapped its partition): choose the files again."""


class StoreScan:
    """A DuckDB connection with the views `results` (the rows) and `results_files` (with `filename`).

    Args:
        store: the result store.
        sweep: only this sweep's files (None: all).
        files: only these files (absolute paths); one that vanishes raises `StaleListing`.
        read_only: refuse file access outside the store (for user SQL; see `orchestrator.store.query`).
        cache_footers: keep the files' parsed footers for the connection's later queries, where
            they are few enough (`CACHED_FOOTERS`): several queries then cost one pass over them.
    """

    def __init__(
        self,
        store: ResultStore,
        *,
        sweep: str | None = None,
        files: Sequence[str] | None = None,
        read_only: bool = False,
        cache_footers: bool = False,
    ) -> None:
        self.store = store
        self.sweep = sweep
        self.given = list(files) if files is not None else None
        self.con = duckdb.connect(config={"autoinstall_known_extensions": False, "autoload_known_extensions": False})
        self.con.execute("SET TimeZone = 'UTC'")
        self.files = self._listing()
        if cache_footers and len(self.files) <= CACHED_FOOTERS:
            self.con.execute("SET parquet_metadata_cache = true")
        self.union = False  # union_by_name: only once files are seen to differ in their columns
        self._bind()
        if read_only:
            self.con.execute("SET allowed_directories = ?", [[str(store.root.resolve()) + "/"]])
            self.con.execute("SET enable_external_access = false")
            self.con.execute("SET lock_configuration = true")

    def _listing(self) -> list[str]:
        skipped = {str(p) for p, _ in self.store.broken}
        if self.given is not None:
            return [f for f in self.given if f not in skipped]
        return [str(f.path) for f in self.store.files(self.sweep) if str(f.path) not in skipped]

    def _bind(self) -> None:
        """(Re)create the views over `self.files` (an empty table in `SCHEMA` when there are none)."""
        for _ in range(MAX_RETRIES):
            if not self.files:
                empty = SCHEMA.empty_table().append_column("date", pa.array([], pa.date32()))
                empty = empty.append_column("filename", pa.array([], pa.string()))
                empty = empty.append_column("file_row_number", pa.array([], pa.int64()))
                self.con.register("orchestrate_empty", empty)
                self.con.execute("CREATE OR REPLACE TEMP VIEW results_files AS SELECT * FROM orchestrate_empty")
                break
            self.con.execute(f"SET VARIABLE {FILES_VARIABLE} = ?", [self.files])
            try:
                self.con.execute(
                    "CREATE OR REPLACE TEMP VIEW results_files AS SELECT * FROM read_parquet("
                    f"getvariable('{FILES_VARIABLE}'), hive_partitioning = true, union_by_name = {self.union}, "
                    f"hive_types = {HIVE_TYPES}, filename = true, file_row_number = true)"
                )
                self.con.execute(RESULTS_VIEW)  # binds the view above again: files are looked at once more
                return
            except duckdb.Error as exc:
                if not self._recover(exc):
                    raise
        self.con.execute(RESULTS_VIEW)

    def _recover(self, exc: duckdb.Error) -> bool:
        """After an error naming a file: union by name (columns differ), list again (vanished) or drop it
        (broken); False when the error names none of the files. The caller binds the views again."""
        message = str(exc)
        named = [p for p in ERROR_PATH.findall(message) if p in self.files]
        if not named and not isinstance(exc, SQL_ERRORS):
            named = self._undecodable(self.files)  # a decoder error that names no file: find it
        if not named:
            return False
        if MISMATCH in message and not self.union:
            self.union = True
        elif any(v in message for v in VANISHED):
            if self.given is not None:
                raise StaleListing(named[0])
            self.files = self._listing()
        else:
            for path in named:
                self.store.note_broken(Path(path), message.splitlines()[0])
            self.files = [f for f in self.files if f not in named]
        return True

    def _undecodable(self, files: list[str]) -> list[str]:
        """The first file of `files` whose pages do not all decode, by bisection ([] when they all do)."""
        probe = duckdb.connect()
        try:
            while files:
                try:
                    probe.execute(DECODE_ALL, {"files": files}).fetchall()
                    return []
                except duckdb.Error:
                    if len(files) == 1:
                        return files
                    half = files[: len(files) // 2]
                    try:
                        probe.execute(DECODE_ALL, {"files": half}).fetchall()
                        files = files[len(files) // 2 :]
                    except duckdb.Error:
                        files = half
            return []
        finally:
            probe.close()

    def columns(self) -> list[str]:
        """The columns of the view `results` (every column any file has, and the partitions)."""
        return [r[0] for r in self.rows("DESCRIBE results")]

    def _retry(self, run: Any) -> Any:
        for _ in range(MAX_RETRIES):
            try:
                return run()
            except duckdb.Error as exc:
                if not self._recover(exc):
                    raise
                self._bind()
        raise InputError(f"gave up after skipping {MAX_RETRIES} unreadable files", where=str(self.store.root))

    def arrow(self, sql: str, params: dict[str, Any] | None = None) -> pa.Table:
        """Run `sql` over the views; the result as an Arrow table (unreadable files skipped)."""
        return self._retry(lambda: self.con.sql(sql, params=params).to_arrow_table())

    def rows(self, sql: str, params: dict[str, Any] | None = None) -> list[tuple[Any, ...]]:
        """Run `sql` over the views; the result as Python tuples."""
        return self._retry(lambda: self.con.sql(sql, params=params).fetchall())


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
    from orchestrator.store.index import newest_points

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
    import pyarrow.compute as pc

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
