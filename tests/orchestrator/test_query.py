"""`orchestrate query`: read-only, errors whole, every format from DuckDB's result as is."""

from __future__ import annotations

import csv
import io
import json
import subprocess
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from orchestrator.errors import InputError
from orchestrator.store import query
from orchestrator.store.fragments import ResultStore
from orchestrator.store.query import run_query
from tests.conftest import child_env
from tests.orchestrator.test_dataset import write_job
from workers.contract import META_SCHEMA_VERSION


@pytest.fixture
def store(tmp_path: Path) -> ResultStore:
    store = ResultStore(tmp_path / "results")
    for i in range(3):
        write_job(store, i)
    return store


@pytest.mark.parametrize(
    "sql",
    [
        "COPY (SELECT * FROM results) TO '{root}/sweep=x/date=2026-01-01/device=cpu/evil.parquet'",
        "COPY results TO '/tmp/out.csv'",
        "ATTACH '{root}/x.db' AS x",
        "INSTALL httpfs",
        "LOAD httpfs",
        "SET enable_external_access = true",
        "SET VARIABLE orchestrate_files = ['/etc/passwd']",
        "PRAGMA enable_profiling",
        "EXPORT DATABASE '{root}/dump'",
        "CREATE TABLE t AS SELECT 1",
        "EXPLAIN ANALYZE COPY (SELECT 1) TO '{root}/x.csv'",
        "SELECT 1; COPY (SELECT 1) TO '{root}/x.csv'",
    ],
)
def test_query_refuses_anything_that_could_write(store: ResultStore, sql: str) -> None:
    before = sorted(p for p in store.root.rglob("*"))
    with pytest.raises(InputError, match=r"read-only|one statement at a time"):
        run_query(store, sql.format(root=store.root))
    assert sorted(p for p in store.root.rglob("*")) == before


def test_query_reads_only_the_store(store: ResultStore) -> None:
    assert run_query(store, "SELECT count(*) AS n FROM results").to_pylist() == [{"n": 18}]
    assert run_query(store, "DESCRIBE results").num_rows > 50
    assert (
        run_query(store, "WITH a AS (SELECT DISTINCT arm FROM results) SELECT count(*) AS n FROM a")["n"][0].as_py()
        == 2
    )
    with pytest.raises(InputError, match="file system operations are disabled"):
        run_query(store, "SELECT * FROM read_csv('/etc/passwd')")


def test_query_errors_are_whole(store: ResultStore, orchestrate_bin: str) -> None:
    with pytest.raises(InputError) as err:
        run_query(store, "SELECT armm FROM results")
    assert 'Referenced column "armm" not found' in str(err.value) and "Candidate bindings" in str(err.value)
    out = subprocess.run(
        [orchestrate_bin, "query", "select armm from results", "-r", str(store.root)],
        capture_output=True, text=True, env=child_env(), timeout=120,
    )  # fmt: skip
    assert out.returncode == 2 and "Candidate bindings" in out.stderr and '"arm"' in out.stderr
    assert out.stderr.startswith("orchestrate: error: query failed: Binder Error")


def test_query_formats_print_maps_as_maps_and_numbers_as_numbers(store: ResultStore, orchestrate_bin: str) -> None:
    sql = "select arm, params, value, sample from results where sample = 0 order by arm, value"
    env = child_env(COLUMNS="200")
    runs = {
        fmt: subprocess.run(
            [orchestrate_bin, "query", sql, "-r", str(store.root), "-f", fmt],
            capture_output=True,
            text=True,
            env=env,
            timeout=120,
        )
        for fmt in ("table", "json", "csv", "md")
    }
    for fmt, out in runs.items():
        assert out.returncode == 0, (fmt, out.stderr)
    records = json.loads(runs["json"].stdout)
    assert records[0] == {"arm": "affine", "params": {"k": "64", "n": "64", "tokens": "1"}, "value": 2.0, "sample": 0}
    rows = list(csv.DictReader(io.StringIO(runs["csv"].stdout)))
    assert len(rows) == 6 and float(rows[0]["value"]) == 2.0
    assert '{"k": "64", "n": "64", "tokens": "1"}' in runs["table"].stdout  # not a Python repr of a list
    assert "[('k'" not in runs["table"].stdout + runs["md"].stdout
    md = runs["md"].stdout.splitlines()
    assert md[0].startswith("| arm") and set(md[1]) <= {"|", "-", ":"} and len(md) == 8


@pytest.mark.parametrize("cached", [5000, 0])
def test_a_newer_schema_is_refused_from_few_files_or_many(
    store: ResultStore, monkeypatch: pytest.MonkeyPatch, cached: int
) -> None:
    """Few (compacted) files: DuckDB reads their versions; many: the point index knows them. Either names the file."""
    monkeypatch.setattr(query, "CACHED_FOOTERS", cached)
    assert run_query(store, "select count(*) as n from results")["n"].to_pylist() == [18]
    path = sorted(store.root.rglob("*.parquet"))[1]
    table = pq.read_table(path)
    meta = {**(table.schema.metadata or {}), META_SCHEMA_VERSION: b"3"}
    table = table.set_column(0, table.schema.field("schema_version"), pa.array([3] * table.num_rows, pa.int32()))
    pq.write_table(table.replace_schema_metadata(meta), path)
    with pytest.raises(InputError, match=r"schema version 3, newer than this orchestrate reads \(2\)") as err:
        run_query(store, "select count(*) from results")
    assert err.value.where == str(path)
