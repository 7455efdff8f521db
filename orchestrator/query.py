"""DuckDB over the result dataset: `orchestrate query "SQL"` with the table name `results`."""

from __future__ import annotations

import csv
import io
import json

import duckdb

from orchestrator.errors import InputError
from orchestrator.store import ResultStore


def connect(store: ResultStore) -> duckdb.DuckDBPyConnection:
    """A DuckDB connection with the view `results` over every readable fragment."""
    files = [str(p) for p in store.fragment_files()]
    if not files:
        raise InputError("no results stored", where=str(store.root))
    con = duckdb.connect()
    listing = ", ".join("'" + f.replace("'", "''") + "'" for f in files)
    options = "hive_partitioning = true, union_by_name = true"
    con.execute(f"CREATE VIEW results AS SELECT * FROM read_parquet([{listing}], {options})")
    return con


def run_query(store: ResultStore, sql: str, fmt: str = "table") -> str:
    """Run `sql` and render its result as a table, CSV or JSON lines."""
    con = connect(store)
    try:
        rel = con.sql(sql)
    except duckdb.Error as exc:
        raise InputError(f"query failed: {str(exc).splitlines()[0]}") from None
    if rel is None:
        return ""
    columns = list(rel.columns)
    rows = rel.fetchall()
    if fmt == "json":
        return "\n".join(json.dumps(dict(zip(columns, r, strict=True)), default=str) for r in rows)
    if fmt == "csv":
        buf = io.StringIO()
        writer = csv.writer(buf)
        writer.writerow(columns)
        writer.writerows(rows)
        return buf.getvalue().rstrip("\n")
    widths = [
        max(len(str(c)), *(len(_cell(r[i])) for r in rows)) if rows else len(str(c)) for i, c in enumerate(columns)
    ]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(columns, widths, strict=True))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(_cell(v).ljust(w) for v, w in zip(r, widths, strict=True)) for r in rows]
    return "\n".join(lines)


def _cell(value: object) -> str:
    if isinstance(value, float):
        return f"{value:.6g}"
    return "" if value is None else str(value)
