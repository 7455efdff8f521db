"""One partition's files merged into one sorted Parquet file, in DuckDB, in bounded memory.

`orchestrator.store.compact` decides what to merge and swaps the result in; this module does the
reading and writing. The footers of all the partition's files come from DuckDB's
`parquet_kv_metadata` / `parquet_file_metadata` / `parquet_schema` in three queries (never one
`pyarrow` open per file: at 100,000 fragments that alone took most of an hour), the rows from one
`read_parquet` over the file list, sorted in DuckDB (which spills to disk past its memory limit),
and streamed in record batches into a `pyarrow` Parquet writer: the merged file is written in the
store's own format (`STORED_SCHEMA`, zstd), whatever schema version each input was. On the way,
each batch's point facts (which run measured which point: `orchestrator.store.index`) are taken,
so the first read after a compaction need not scan the new file again.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

import duckdb
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from orchestrator.store.footer import META_POINTS, compact_index, packed_index
from orchestrator.store.fragments import COMPACT_PREFIX
from workers.contract import (
    META_JOBS,
    META_PREFIX,
    META_SCHEMA_VERSION,
    PARTITION_COLUMNS,
    SCHEMA_VERSION,
    STORED_SCHEMA,
    check_readable,
    fragment_version,
)
from workers.job.spool import parse_fragment_name

ROW_GROUP_ROWS = 64 * 1024
SORT = "case_name, run_id, job_key, filename, file_row_number"  # a job's rows keep their measured order
MEMORY_LIMIT = "384MB"  # DuckDB's own; the sort spills past it (the batches in flight add a little)
# Footer keys that describe the file, not a job: not copied into the index.
FILE_KEYS = {META_SCHEMA_VERSION, META_JOBS, META_POINTS, b"ARROW:schema"}
BATCH_FACTS = """
SELECT case_name, "case", params::VARCHAR AS point, run_id, max(started_at) AS started_at,
    max(schema_version) AS schema_version
FROM batch GROUP BY case_name, "case", params, run_id
"""


@dataclass
class Footers:
    """What the partition's files say of themselves, read in DuckDB."""

    meta: dict[str, dict[bytes, bytes]] = field(default_factory=dict)  # path -> key-value footer
    shapes: set[str] = field(default_factory=set)  # distinct column layouts (names and types)
    columns: set[str] = field(default_factory=set)  # every top-level column some file has


def connect(spill: Path) -> duckdb.DuckDBPyConnection:
    """A DuckDB connection for merging: UTC, bounded memory, spilling into `spill`, footers cached."""
    con = duckdb.connect(config={"autoinstall_known_extensions": False, "autoload_known_extensions": False})
    con.execute("SET TimeZone = 'UTC'")
    con.execute(f"SET memory_limit = '{MEMORY_LIMIT}'")
    con.execute("SET temp_directory = ?", [str(spill)])
    con.execute("SET parquet_metadata_cache = true")  # each footer parsed once for the three reads
    return con


def read_footers(con: duckdb.DuckDBPyConnection, files: list[str]) -> Footers:
    """The key-value footers and column layouts of `files` (raises `duckdb.Error` on a bad one).

    One pass over the footers: a file written by pyarrow (every fragment) carries its Arrow schema
    in its footer, which says its columns; only a file without one is asked for its Parquet schema.
    """
    out = Footers()
    for name, key, value in con.execute("SELECT * FROM parquet_kv_metadata($files)", {"files": files}).fetchall():
        out.meta.setdefault(name, {})[bytes(key)] = bytes(value)
    bare = []
    for path in files:
        raw = out.meta.setdefault(path, {}).get(b"ARROW:schema")
        if raw is None:
            bare.append(path)
            continue
        try:
            schema = pa.ipc.read_schema(pa.py_buffer(base64.b64decode(raw)))
        except (ValueError, pa.ArrowException):
            bare.append(path)
            continue
        out.shapes.add(repr([(f.name, str(f.type)) for f in schema]))
        out.columns.update(schema.names)
    if bare:
        shapes = con.execute(
            "SELECT DISTINCT list((name, coalesce(num_children, 0), duckdb_type, repetition_type) ORDER BY column_id) "
            "FROM parquet_schema($files) GROUP BY file_name",
            {"files": bare},
        ).fetchall()
        for (shape,) in shapes:
            out.shapes.add(repr(shape))
            out.columns.update(_top_level(shape))
    return out


def _top_level(shape: list[tuple[str, int, str, str]]) -> list[str]:
    """The top-level column names of a flattened Parquet schema (its root first, each node's children after it)."""
    names, at = [], 1

    def skip(i: int) -> int:  # the index after node i's subtree
        children, i = shape[i][1], i + 1
        for _ in range(children):
            i = skip(i)
        return i

    for _ in range(shape[0][1] if shape else 0):
        names.append(shape[at][0])
        at = skip(at)
    return names


def versions(footers: Footers) -> dict[str, int]:
    """Each file's schema version (raises `SchemaVersionError` for a newer or unreadable one)."""
    out = {}
    for path, meta in footers.meta.items():
        out[path] = fragment_version(meta)
        check_readable(out[path])
    return out


def job_entries(path: str, meta: dict[bytes, bytes], num_rows: int) -> list[dict[str, str]]:
    """The index entries a file contributes: a compacted file's own index, or one job's footer facts."""
    name = Path(path).name
    if name.startswith(COMPACT_PREFIX):
        return compact_index(meta)
    entry = {k.decode(): v.decode() for k, v in meta.items() if k.startswith(META_PREFIX) and k not in FILE_KEYS}
    entry = {k.removeprefix("orchestrate."): v for k, v in entry.items()}
    parsed = parse_fragment_name(name)
    if "run_id" not in entry and parsed is not None:  # version 1 did not write it: the name says it
        entry["run_id"] = parsed[0]
    return [{"file": name, **entry, "num_rows": str(num_rows)}]


def _stored(batch: pa.RecordBatch, schema: pa.Schema) -> pa.Table:
    """A batch of DuckDB's rows in the stored schema (absent columns null, partition columns dropped)."""
    table = pa.Table.from_batches([batch])
    for f in schema:
        if f.name not in table.column_names:  # a column added after every file here was written
            table = table.append_column(f.name, pa.nulls(table.num_rows, f.type))
    return table.select(schema.names).cast(schema)


def _combined(side: duckdb.DuckDBPyConnection, facts: list[pa.Table]) -> pa.Table:
    if len(facts) == 1:
        return facts[0]
    if not facts:
        side.register("batch", STORED_SCHEMA.empty_table())
        return side.sql(BATCH_FACTS).to_arrow_table()
    side.register("facts", pa.concat_tables(facts))
    return side.sql(
        'SELECT case_name, "case", point, run_id, max(started_at) AS started_at, max(schema_version) AS '
        'schema_version FROM facts GROUP BY case_name, "case", point, run_id'
    ).to_arrow_table()


def write_merged(
    con: duckdb.DuckDBPyConnection,
    files: list[str],
    footers: Footers,
    sink: BinaryIO,
    *,
    partition: dict[bytes, bytes],
) -> pa.Table:
    """Write the rows of `files`, sorted, to `sink` as one Parquet file; return their point facts.

    The file's footer holds `partition` (its sweep, device and date), the schema version and,
    added once every row is written (their counts per job come from the rows themselves),
    `orchestrate.jobs`, the index of the jobs it holds. The facts (case_name, case, point, run_id,
    started_at, schema_version) are `FACTS_SQL`'s of `orchestrator.store.index` for the merged
    file, less its device and name.
    """
    schema = STORED_SCHEMA.with_metadata({META_SCHEMA_VERSION: str(SCHEMA_VERSION).encode(), **partition})
    wanted = [n for n in schema.names if n in footers.columns and n not in PARTITION_COLUMNS]
    select = ", ".join(f'"{n}"' for n in wanted)
    union = "true" if len(footers.shapes) > 1 else "false"  # only where files differ: it costs a second look
    reader = con.sql(
        f"SELECT {select}, filename FROM read_parquet($files, hive_partitioning = false, union_by_name = {union}, "
        f"filename = true, file_row_number = true) ORDER BY {SORT}",
        params={"files": files},
    ).to_arrow_reader(ROW_GROUP_ROWS)
    side = con.cursor()  # the facts of each batch, while the main connection streams
    facts, pending, counts = [], [], dict.fromkeys(files, 0)
    with pq.ParquetWriter(sink, schema, compression="zstd") as writer:
        for batch in reader:
            for entry in pc.value_counts(batch.column("filename")).to_pylist():
                counts[entry["values"]] += entry["counts"]
            table = _stored(batch, schema)
            side.register("batch", table)
            facts.append(side.sql(BATCH_FACTS).to_arrow_table())
            pending.append(table)
            held = sum(t.num_rows for t in pending)
            if held >= ROW_GROUP_ROWS:  # whole row groups as they fill; the rest waits for more rows
                rows = pa.concat_tables(pending)
                full = held - held % ROW_GROUP_ROWS
                writer.write_table(rows.slice(0, full), row_group_size=ROW_GROUP_ROWS)
                pending = [rows.slice(full)]
        if pending and (rows := pa.concat_tables(pending)).num_rows:
            writer.write_table(rows, row_group_size=ROW_GROUP_ROWS)
        index = [e for f in files for e in job_entries(f, footers.meta[f], counts[f])]
        writer.add_key_value_metadata({META_JOBS: packed_index(index)})
    return _combined(side, facts)


def unreadable(path: str) -> str | None:
    """Why a file cannot be read whole, by pyarrow and by DuckDB (every page decoded); None when it can."""
    probe = duckdb.connect()
    try:
        pq.read_table(path)
        probe.execute("SELECT bit_xor(hash(COLUMNS(*))) FROM read_parquet($f)", {"f": [path]}).fetchall()
    except (OSError, pa.ArrowException, duckdb.Error) as exc:
        return str(exc).splitlines()[0]
    finally:
        probe.close()
    return None
