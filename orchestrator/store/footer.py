"""Which points and runs a fragment holds, written into its own footer so an index is built from footers.

The point index (`orchestrator.store.index`) needs, for every file of a sweep, the (case, point,
run) groups it holds. Reading them from the rows means decoding data pages of every file, which
dominates a read of a large sweep (BENCHMARKS.md). So `ResultStore.write` puts them in the
fragment's footer (`orchestrate.points`, a JSON list, one entry per group: case name and kind, the
parameters as key/value pairs in their stored order, run, newest start in microseconds since the
epoch and schema version), and the index reads them back with one `parquet_kv_metadata` query per
core over the files, in threads -- footers only, about three times cheaper per file.

The footer holds the parameters, not DuckDB's text for them: the index's `point` is made from
them by the same DuckDB that compares it with a row's `params::VARCHAR`, so the two always agree
(a MAP of the same pairs in the same order prints the same). A file without the key (written
by a version without it, or by another tool) is read from its rows instead.

A compacted file's footer indexes the jobs it holds instead (`compact_index`, `packed_index`):
what listing, resume and compaction read where a fragment would have its own footer.
"""

from __future__ import annotations

import base64
import json
import os
import re
import zlib
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

import pyarrow as pa

from workers.contract import META_JOBS, META_PREFIX, META_SCHEMA_VERSION
from workers.job.spool import fragment_name

if TYPE_CHECKING:
    import duckdb

META_POINTS = META_PREFIX + b"points"
# A quoted path in a DuckDB error: `Failed to read file "x.parquet": ...`, `No magic bytes ... 'x.parquet'`.
ERROR_PATH = re.compile(r"""["']([^"']+\.parquet)["']""")
POINT_COLUMNS = ("case_name", "case", "params", "run_id", "started_at", "schema_version")
FACT_TYPE = (
    '[{"case_name": "VARCHAR", "case": "VARCHAR", "params": [{"key": "VARCHAR", "value": "VARCHAR"}], '
    '"run_id": "VARCHAR", "started_at": "BIGINT", "schema_version": "INTEGER"}]'
)
# One row per (file, case, point, run), as `point_index.FACTS_SQL` gives it from the rows; the
# schema version is also the footer's own (what any version writes, so a newer file is never missed).
FOOTER_FACTS_SQL = f"""
SELECT file, f.case_name, f."case", map_from_entries(f.params)::VARCHAR AS point, f.run_id,
    make_timestamp(f.started_at)::TIMESTAMPTZ AS started_at, greatest(f.schema_version, version) AS schema_version
FROM (SELECT file, version, unnest(from_json(doc, '{FACT_TYPE}')) AS f FROM footers_ok)
"""
KV_SQL = """
SELECT file_name AS file, max(decode(value)) FILTER (key = $points) AS doc,
    coalesce(try_cast(max(decode(value)) FILTER (key = $version) AS INTEGER), 1) AS version
FROM parquet_kv_metadata($files) WHERE key IN ($points, $version) GROUP BY file_name
"""
MAX_RETRIES = 20  # files named in errors before the rest are left to the row scan too
MIN_FILES_PER_THREAD = 500  # below this, one query: a thread's start costs more than it saves


def points_footer(body: pa.Table) -> bytes:
    """The `orchestrate.points` footer value of a fragment's rows (its groups, in first-seen order)."""
    columns = [body.column(c) for c in POINT_COLUMNS]
    columns[4] = columns[4].cast(pa.int64())  # microseconds since the epoch (the column is UTC, in us)
    groups: dict[tuple[object, ...], dict[str, object]] = {}
    for case_name, case, params, run_id, started, version in zip(*(c.to_pylist() for c in columns), strict=True):
        key = (case_name, case, None if params is None else tuple(params), run_id)
        entry = groups.get(key)
        if entry is None:
            pairs = None if params is None else [{"key": k, "value": v} for k, v in params]
            groups[key] = {
                "case_name": case_name,
                "case": case,
                "params": pairs,
                "run_id": run_id,
                "started_at": started,
                "schema_version": version,
            }
            continue
        for name, value in (("started_at", started), ("schema_version", version)):  # max, nulls ignored (SQL's)
            if value is not None and (entry[name] is None or value > entry[name]):
                entry[name] = value
    return json.dumps(list(groups.values()), separators=(",", ":")).encode()


def _footers(con: duckdb.DuckDBPyConnection, files: Sequence[str]) -> tuple[pa.Table | None, list[str]]:
    """`(file, doc)` of the files whose footer has the key, and the files it could not read.

    A file DuckDB names in an error (a bad footer, a file gone) is left to the row scan, which
    sets it aside or lists the files again; an error naming none leaves all of them to it.
    """
    import duckdb  # the writer needs `points_footer` alone

    cursor, todo, unread = con.cursor(), list(files), list[str]()
    for _ in range(MAX_RETRIES):
        try:
            found = cursor.sql(KV_SQL, params={"files": todo, "points": META_POINTS, "version": META_SCHEMA_VERSION})
            return found.to_arrow_table(), unread
        except duckdb.Error as exc:
            named = set(ERROR_PATH.findall(str(exc))) & set(todo)
            if not named:
                break
            unread += sorted(named)
            todo = [f for f in todo if f not in named]
            if not todo:
                return None, unread
    return None, unread + todo


def footer_facts(files: Sequence[str]) -> tuple[pa.Table, list[str]]:
    """The point facts of `files` from their footers, and the files that must be read from their rows.

    Returns:
        A table of `file, case_name, case, point, run_id, started_at, schema_version` (absolute
        paths, as given), and the files without the footer key or whose footer could not be read.
    """
    import duckdb  # the writer needs `points_footer` alone

    con = duckdb.connect(config={"autoinstall_known_extensions": False, "autoload_known_extensions": False})
    con.execute("SET TimeZone = 'UTC'")
    try:
        threads = max(1, min(os.cpu_count() or 1, len(files) // MIN_FILES_PER_THREAD))
        chunks = [files[i::threads] for i in range(threads)]
        if threads == 1:
            found = [_footers(con, files)]
        else:  # parquet_kv_metadata reads one file at a time: one query per core, each on its own cursor
            with ThreadPoolExecutor(threads) as pool:
                found = list(pool.map(lambda chunk: _footers(con, chunk), chunks))
        tables = [t for t, _ in found if t is not None]
        unread = [f for _, missed in found for f in missed]
        if tables:
            con.register("footers", pa.concat_tables(tables))
        else:
            con.execute("CREATE TEMP TABLE footers (file VARCHAR, doc VARCHAR, version INTEGER)")
        con.execute("CREATE OR REPLACE TEMP VIEW footers_ok AS SELECT * FROM footers WHERE json_valid(doc)")
        facts = con.sql(FOOTER_FACTS_SQL).to_arrow_table()
        have = {f for (f,) in con.sql("SELECT file FROM footers_ok").fetchall()}
    finally:
        con.close()
    skipped = set(unread)
    return facts, unread + [f for f in files if f not in have and f not in skipped]


def compact_index(meta: dict[bytes, bytes]) -> list[dict[str, str]]:
    """The jobs a compacted file holds: one dict of footer facts per job (`file`, `job_key`, ...).

    Stored as zlib-compressed JSON (`zlib:` + base64), without what every job of the file shares
    (its partition) or what its name says (`file`): footers stay small for every reader.
    """
    raw = meta.get(META_JOBS)
    if not raw:
        return []
    if raw.startswith(b"zlib:"):
        raw = zlib.decompress(base64.b64decode(raw[5:]))
    jobs = [{str(k): str(v) for k, v in job.items()} for job in json.loads(raw)]
    for job in jobs:
        if "file" not in job and job.get("run_id") and job.get("job_key"):
            job["file"] = fragment_name(job["run_id"], job["job_key"])
    return jobs


def packed_index(jobs: list[dict[str, str]]) -> bytes:
    """`compact_index`'s stored form of a list of per-job facts."""
    slim = [
        {
            k: v
            for k, v in job.items()
            if k not in ("sweep", "device", "date")
            and not (k == "file" and v == fragment_name(job.get("run_id", ""), job.get("job_key", "")))
        }
        for job in jobs
    ]
    return b"zlib:" + base64.b64encode(zlib.compress(json.dumps(slim, sort_keys=True).encode(), 9))
