"""Which run measured each point, per stored file: a small index so readers open only the files they need.

"Each point's newest run" needs, for every file of a sweep, the (device, case, point, run) it
holds; asking DuckDB means opening every file's footer, which dominates a read of thousands of
fragments. The index keeps those facts per file -- one row per (file, device, case, point, run),
with the file's size and modification time -- in `<side>/index/sweep=<name>.parquet`, outside the
dataset (the default readers never see it). Every read brings it up to date: files that are new
or changed are scanned (their facts added), files gone are dropped, so it is never the source of
truth, only a shortcut to it; a store a reader cannot write to is simply scanned each time. A new
fragment's facts come from its footer (`orchestrator.store.footer`: one footer query per core, no
data read); only files without them are read from their rows. The index names the DuckDB version
that printed its points, and another version builds it again.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from importlib.metadata import version
from pathlib import Path

import duckdb
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from orchestrator.store.footer import footer_facts
from orchestrator.store.fragments import ResultStore
from orchestrator.store.scan import StaleListing, StoreScan
from workers.contract import META_PREFIX
from workers.files import write_parquet_atomic

INDEX_SCHEMA = pa.schema(
    [
        pa.field("file", pa.string()),  # relative to the root
        pa.field("size", pa.int64()),
        pa.field("mtime_ns", pa.int64()),
        pa.field("device", pa.string()),
        pa.field("case_name", pa.string()),
        pa.field("case", pa.string()),
        pa.field("point", pa.string()),  # the `params` map as DuckDB prints it
        pa.field("run_id", pa.string()),
        pa.field("started_at", pa.timestamp("us", tz="UTC")),
        pa.field("schema_version", pa.int32()),  # the newest any of these rows was written with
    ]
)
META_DUCKDB = META_PREFIX + b"duckdb_version"  # the index's: which DuckDB printed its points
FACTS_SQL = """
SELECT filename AS file, device, case_name, "case", params::VARCHAR AS point, run_id, max(started_at) AS started_at,
    max(schema_version) AS schema_version
FROM results_files GROUP BY filename, device, case_name, "case", params, run_id
"""


def index_path(store: ResultStore, sweep: str) -> Path:
    """Where one sweep's index lives."""
    return store.side / "index" / f"sweep={sweep}.parquet"


def _stats(store: ResultStore, sweep: str) -> tuple[dict[str, tuple[int, int]], dict[str, str]]:
    """`{relative path: (size, mtime_ns)}` of the sweep's data files now, and each one's device partition."""
    out, devices = {}, {}
    for f in store.files(sweep):
        try:
            st = f.path.stat()
        except FileNotFoundError:
            continue
        rel = str(f.path.relative_to(store.root))
        out[rel], devices[rel] = (st.st_size, st.st_mtime_ns), f.device
    return out, devices


def _located(
    store: ResultStore, found: pa.Table, stats: dict[str, tuple[int, int]], devices: dict[str, str]
) -> pa.Table:
    """Facts of files (absolute `file`) as index rows: the path relative to the root, its size and mtime,
    and, where the facts lack it (from a footer), its device partition."""
    rel = [str(Path(p).relative_to(store.root)) for p in found["file"].to_pylist()]
    found = found.set_column(found.schema.get_field_index("file"), "file", pa.array(rel, pa.string()))
    found = found.append_column("size", pa.array([stats[r][0] for r in rel], pa.int64()))
    found = found.append_column("mtime_ns", pa.array([stats[r][1] for r in rel], pa.int64()))
    if "device" not in found.column_names:
        found = found.append_column("device", pa.array([devices[r] for r in rel], pa.string()))
    return found.select(INDEX_SCHEMA.names).cast(INDEX_SCHEMA)


def _load(path: Path) -> pa.Table:
    """The stored index, or an empty one when it is unreadable, of an older layout or of another DuckDB.

    Its `point` is DuckDB's text for a MAP: another DuckDB version might print one differently,
    and a point that no longer matches its rows' `params::VARCHAR` would drop them from reads.
    """
    try:
        with pq.ParquetFile(path) as file:  # not `read_table`: pyarrow.dataset would import pandas
            table = file.read()
        if (table.schema.metadata or {}).get(META_DUCKDB) != duckdb_version():
            return INDEX_SCHEMA.empty_table()
        return table.select(INDEX_SCHEMA.names).cast(INDEX_SCHEMA)
    except (OSError, pa.ArrowException, KeyError):
        return INDEX_SCHEMA.empty_table()  # unreadable, or of an older layout: built again


def duckdb_version() -> bytes:
    """The DuckDB version that prints this process's points."""
    return version("duckdb").encode()


def _save(store: ResultStore, path: Path, table: pa.Table) -> None:
    """Replace the index atomically; a store this process cannot write to keeps the old one."""
    with contextlib.suppress(OSError):  # read-only, or full: the index is a shortcut; the next read scans
        write_parquet_atomic(table.replace_schema_metadata({META_DUCKDB: duckdb_version()}), path)


def refreshed(store: ResultStore, sweep: str) -> pa.Table:
    """The sweep's index, brought up to date with its files (new and changed ones scanned in DuckDB)."""
    for _ in range(3):
        try:
            return _refresh(store, sweep)
        except StaleListing:
            continue  # a compaction swapped a partition while its files were scanned: list them again
    return _refresh(store, sweep)


def _refresh(store: ResultStore, sweep: str) -> pa.Table:
    stats, devices = _stats(store, sweep)
    path = index_path(store, sweep)
    old = _load(path) if path.is_file() else INDEX_SCHEMA.empty_table()
    # a file's rows all carry its size and mtime (no `group_by`: pyarrow's imports pyarrow.dataset)
    sizes = zip(old["size"].to_pylist(), old["mtime_ns"].to_pylist(), strict=True)
    recorded = dict(zip(old["file"].to_pylist(), sizes, strict=True))
    have = {f for f, sm in recorded.items() if stats.get(f) == sm}
    kept = old.filter(pc.is_in(old["file"], pa.array(sorted(have), pa.string()))) if old.num_rows else old
    fresh = sorted(f for f in stats if f not in have)
    if not fresh and kept.num_rows == old.num_rows:
        return kept
    tables = [kept]
    if fresh:
        from_footers, unread = footer_facts([str(store.root / f) for f in fresh])
        tables.append(_located(store, from_footers, stats, devices))
        if unread:  # written before fragments carried their facts (or unreadable): read from the rows
            tables.append(_located(store, StoreScan(store, files=unread).arrow(FACTS_SQL), stats, devices))
    table = pa.concat_tables(tables)
    _save(store, path, table)
    return table


def record_facts(store: ResultStore, sweep: str, facts: pa.Table, gone: set[str]) -> None:
    """Put the facts of newly written files into the sweep's index and drop those of files `gone`.

    `compact` calls this once per sweep with the merged files' facts (taken as it wrote them), so
    the first read after a compaction scans nothing; the facts' `size` and `mtime_ns` are the new
    files', so the next refresh keeps them.
    """
    path = index_path(store, sweep)
    old = _load(path) if path.is_file() else INDEX_SCHEMA.empty_table()
    drop = pa.array(sorted(gone | set(facts["file"].to_pylist())), pa.string())
    kept = old.filter(pc.invert(pc.is_in(old["file"], drop))) if old.num_rows else old
    _save(store, path, pa.concat_tables([kept, facts.select(INDEX_SCHEMA.names).cast(INDEX_SCHEMA)]))


def whole_index(store: ResultStore, sweep: str | None = None) -> pa.Table:
    """The index of every sweep (or one), up to date, its `file` column absolute paths."""
    sweeps = [sweep] if sweep is not None else store.sweep_names()
    tables = [refreshed(store, s) for s in sweeps if (store.root / f"sweep={s}").is_dir()]
    index = pa.concat_tables(tables) if tables else INDEX_SCHEMA.empty_table()
    return index.set_column(0, "file", pc.binary_join_element_wise(str(store.root), index["file"], "/"))


def newest_points(
    store: ResultStore,
    sweep: str | None,
    runs: Sequence[str] | None = None,
    cases: Sequence[str] | None = None,
) -> pa.Table:
    """Per (device, case, point) of the sweep(s), the newest run (of `runs`, of `cases`) and its files."""
    index = whole_index(store, sweep)
    if runs:
        index = index.filter(pc.is_in(index["run_id"], pa.array(list(runs), pa.string())))
    if cases:
        wanted = pa.array(list(cases), pa.string())
        index = index.filter(pc.or_(pc.is_in(index["case_name"], wanted), pc.is_in(index["case"], wanted)))
    con = duckdb.connect()
    con.register("idx", index)
    chosen = con.sql(
        "SELECT device, case_name, point, arg_max(run_id, (coalesce(epoch_us(started_at), -1), run_id)) AS run_id "
        "FROM (SELECT device, case_name, point, run_id, max(started_at) AS started_at FROM idx GROUP BY ALL) "
        "GROUP BY device, case_name, point"
    ).to_arrow_table()
    con.register("chosen", chosen)
    out = con.sql(
        "SELECT c.device, c.case_name, c.point, c.run_id, list(DISTINCT i.file ORDER BY i.file) AS files "
        "FROM chosen c JOIN idx i USING (device, case_name, point, run_id) GROUP BY ALL"
    ).to_arrow_table()
    con.close()
    return out
