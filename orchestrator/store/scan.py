"""A DuckDB connection over the result store's files, robust to files broken or swapped under a read.

`StoreScan` opens one DuckDB connection with the view `results` over the store's files (of one
sweep, when named): hive partitions typed (`sweep`, `device` text, `date` a DATE), columns matched
by name across schema versions (DuckDB takes the first file's columns; where another file lacks
one, the view is made again with `union_by_name`, which costs a second look at every footer).
A file DuckDB cannot read (a bad footer, a corrupt data page) is dropped from the view and the
query run again: each such file is noted once in `store.broken`, and never makes a read fail. A
file that vanished under a read (a compaction swapped its partition) makes the scan list the
files again. The readers' common query over it is `orchestrator.store.dataset.read_rows`.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import duckdb
import pyarrow as pa

from orchestrator.errors import InputError
from orchestrator.store.footer import ERROR_PATH
from orchestrator.store.fragments import ResultStore
from workers.contract import SCHEMA

FILES_VARIABLE = "orchestrate_files"
HIVE_TYPES = "{'sweep': VARCHAR, 'date': DATE, 'device': VARCHAR}"
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
