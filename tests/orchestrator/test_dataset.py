"""The store as data: the four readers' default calls, broken files, schema versions, resume's index.

Real Parquet written through `ResultStore.write`, read back by pandas, Polars, DuckDB and pyarrow
exactly as their users call them, before and after `orchestrate compact`.
"""

from __future__ import annotations

import datetime as dt
import os
import subprocess
from pathlib import Path

import duckdb
import pandas as pd
import polars as pl
import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest

from orchestrator.errors import InputError
from orchestrator.store.compact import compact
from orchestrator.store.dataset import read_rows
from orchestrator.store.fragments import ResultStore
from orchestrator.store.incoming import import_fragment
from orchestrator.store.index import index_path
from tests.conftest import child_env
from tests.orchestrator.synthetic_rows import job_table
from workers.contract import (
    META_JOB_KEY,
    META_JOB_STATUS,
    META_JOBS,
    META_SCHEMA_VERSION,
    META_SWEEP,
    PARTITION_COLUMNS,
    SCHEMA,
    STORED_SCHEMA,
)

DAY = dt.date(2026, 11, 30)


def key(i: int) -> str:
    """A job key as the planner makes them: 16 hex digits."""
    return f"{i:016x}"


def write_job(
    store: ResultStore,
    i: int,
    *,
    sweep: str = "nightly",
    device: str = "cpu",
    day: dt.date = DAY,
    run_id: str = "20261130T020000Z-aaaa",
    status: str = "ok",
    samples: int = 3,
) -> Path:
    """One job of two arms and `samples` samples each (2 x samples rows)."""
    table = job_table(
        {"native": {"seconds": [1.0 + i] * samples}, "affine": {"seconds": [2.0 + i] * samples}},
        params={"tokens": i + 1, "n": 64, "k": 64},
        device=device,
        sweep=sweep,
        run_id=run_id,
        status=status,
        started_at=dt.datetime.combine(day, dt.time(2), tzinfo=dt.UTC),
    )
    meta = dict(table.schema.metadata or {})
    meta[META_JOB_KEY] = key(i).encode()
    column = table.schema.get_field_index("job_key")
    table = table.set_column(column, SCHEMA.field("job_key"), pa.array([key(i)] * table.num_rows, pa.string()))
    table = table.replace_schema_metadata(meta)
    return store.write(table, sweep=sweep, date=day, device=device, run_id=run_id, job_key=key(i))


def small_store(root: Path) -> ResultStore:
    """2 sweeps x 2 dates x 2 devices x 3 jobs = 24 fragments of 6 rows."""
    store = ResultStore(root)
    i = 0
    for sweep in ("nightly", "smoke"):
        for d in range(2):
            for device in ("cpu", "h200"):
                for _ in range(3):
                    day = DAY + dt.timedelta(days=d)
                    write_job(store, i, sweep=sweep, device=device, day=day, run_id=f"2026120{d}T020000Z-{sweep[:4]}")
                    i += 1
    return store


def read_four_ways(root: Path) -> dict[str, tuple[int, set[tuple[str, str, str]]]]:
    """Rows and (sweep, date, device) partitions as each library's default call gives them."""
    frame = pd.read_parquet(root)
    polars = pl.read_parquet(root)
    duck = duckdb.sql(f"SELECT sweep, date::VARCHAR AS date, device FROM '{root}/**/*.parquet'").fetchall()
    arrow = ds.dataset(root, partitioning="hive").to_table()
    return {
        "pandas": (
            len(frame),
            {(str(s), str(d), str(v)) for s, d, v in zip(frame.sweep, frame.date, frame.device, strict=True)},
        ),
        "polars": (polars.height, {(s, str(d), v) for s, d, v in polars.select("sweep", "date", "device").iter_rows()}),
        "duckdb": (len(duck), set(duck)),
        "pyarrow": (
            arrow.num_rows,
            set(zip(*(arrow[c].to_pylist() for c in ("sweep", "date", "device")), strict=True)),
        ),
    }


def test_pandas_polars_duckdb_and_pyarrow_read_the_store_with_their_default_calls(tmp_path: Path) -> None:
    store = small_store(tmp_path / "results")
    expected = {
        (s, (DAY + dt.timedelta(days=d)).isoformat(), v)
        for s in ("nightly", "smoke")
        for d in range(2)
        for v in ("cpu", "h200")
    }
    # Nothing but the hive tree of Parquet files under the root (staging and side files live beside it).
    files = [Path(d) / f for d, _, fs in os.walk(store.root) for f in fs]
    assert files and all(f.suffix == ".parquet" and f.name.startswith("part-") for f in files)
    body = pq.read_schema(files[0])
    assert not set(PARTITION_COLUMNS) & set(body.names)  # the partitions are in the path, not the body
    assert pq.read_metadata(files[0]).metadata[META_SWEEP] in (b"nightly", b"smoke")  # and the footer
    for when in ("before", "after"):
        seen = read_four_ways(store.root)
        for reader, (rows, partitions) in seen.items():
            assert rows == 24 * 6, (when, reader)
            assert partitions == expected, (when, reader)
        if when == "before":
            report = compact(store)
            assert report.partitions == 8 and report.fragments == 24
    assert len(list(store.root.rglob("*.parquet"))) == 8  # one file per partition
    # Our own reader returns every column of SCHEMA, typed as SCHEMA says.
    table = read_rows(store)
    assert table.schema == SCHEMA and table.num_rows == 144
    assert sorted(set(table["sweep"].to_pylist())) == ["nightly", "smoke"]


def test_newest_run_per_point_and_arms_in_measured_order(tmp_path: Path) -> None:
    store = ResultStore(tmp_path / "results")
    write_job(store, 0, run_id="20261130T020000Z-aaaa")
    write_job(store, 1, run_id="20261130T020000Z-aaaa")
    write_job(store, 0, run_id="20261201T020000Z-bbbb", day=DAY + dt.timedelta(days=1))  # point 0 measured again
    newest = read_rows(store, sweep="nightly", newest=True)
    runs = {(t, r) for t, r in zip(newest["tokens"].to_pylist(), newest["run_id"].to_pylist(), strict=True)}
    assert runs == {(1, "20261201T020000Z-bbbb"), (2, "20261130T020000Z-aaaa")}
    assert newest.num_rows == 12
    assert newest["arm"].to_pylist()[:4] == ["native", "native", "native", "affine"]  # as the job wrote them
    assert read_rows(store, sweep="nightly").num_rows == 18
    assert read_rows(store, runs=["20261130T020000Z-aaaa"]).num_rows == 12
    # The point index beside the store follows new files: point 1 measured again is now newest.
    assert index_path(store, "nightly").is_file() and not index_path(store, "nightly").is_relative_to(store.root)
    write_job(store, 1, run_id="20261202T020000Z-cccc", day=DAY + dt.timedelta(days=2))
    again = read_rows(store, sweep="nightly", newest=True)
    assert set(again["run_id"].to_pylist()) == {"20261201T020000Z-bbbb", "20261202T020000Z-cccc"}
    assert pq.read_table(index_path(store, "nightly")).num_rows == 4  # one row per file and point


def corrupt_data_page(path: Path, column: str = "value") -> None:
    """Overwrite the header of one column's data page: the footer still reads, that column does not decode."""
    group = pq.read_metadata(path).row_group(0)
    (start,) = [c.data_page_offset for c in map(group.column, range(group.num_columns)) if c.path_in_schema == column]
    data = bytearray(path.read_bytes())
    data[start + 1 : start + 9] = b"\x0e" * 8
    path.write_bytes(bytes(data))


def test_broken_files_are_skipped_with_one_warning_each_by_every_reader(tmp_path: Path, orchestrate_bin: str) -> None:
    store = ResultStore(tmp_path / "results")
    for i in range(4):
        write_job(store, i, samples=400)  # big enough that a column spans pages
    paths = sorted(store.root.rglob("*.parquet"))
    leaf = paths[0].parent
    truncated = leaf / "part-20261130T020000Z-aaaa-00000000000000ff.parquet"
    truncated.write_bytes(paths[0].read_bytes()[:-100])
    garbage = leaf / "part-20261130T020000Z-aaaa-00000000000000fe.parquet"
    garbage.write_bytes(b"PAR1 not parquet at all")
    corrupt_data_page(paths[1])
    assert pq.read_metadata(paths[1]).num_rows == 800  # its footer is fine
    table = read_rows(store)
    assert table.num_rows == 3 * 800
    assert sorted(p.name for p, _ in store.broken) == sorted([truncated.name, garbage.name, paths[1].name])
    env = child_env()
    for sql in ("select count(*) from results where status = 'ok'", "select sum(value) from results"):
        out = subprocess.run(
            [orchestrate_bin, "query", sql, "-r", str(store.root), "-f", "csv"],
            capture_output=True, text=True, env=env, timeout=120,
        )  # fmt: skip
        assert out.returncode == 0, out.stderr
        warnings = [line for line in out.stderr.splitlines() if "skipped unreadable file" in line]
        assert len({w.split("file ")[1].split(":")[0] for w in warnings}) == len(warnings)  # one each
        assert any(garbage.name in w for w in warnings) and any(truncated.name in w for w in warnings)
    assert paths[1].name in out.stderr  # the corrupt data page: found once a query reads the values
    total = float(out.stdout.splitlines()[1])
    assert total == pytest.approx(sum(800 / 2 * ((1.0 + i) + (2.0 + i)) for i in (0, 2, 3)))
    # compact sets all three aside (with why), and then the default calls of the four libraries work.
    report = compact(store, warn=lambda line: None)
    assert {p.name for p, _, _ in report.set_aside} == {truncated.name, garbage.name, paths[1].name}
    for _, moved, _ in report.set_aside:
        assert moved.is_file() and not moved.is_relative_to(store.root) and Path(f"{moved}.why").read_text()
    assert {n for n, _ in read_four_ways(store.root).values()} == {3 * 800}


def v1_fragment(store: ResultStore, i: int) -> Path:
    """A fragment as version 1 wrote it: partition columns in the body too, version 1 in the footer."""
    table = job_table({"native": {"seconds": [1.0, 1.1]}}, params={"tokens": 100 + i}, sweep="nightly", run_id="r-old")
    meta = {**(table.schema.metadata or {}), META_SCHEMA_VERSION: b"1", META_JOB_KEY: key(100 + i).encode()}
    table = table.set_column(0, SCHEMA.field("schema_version"), pa.array([1] * table.num_rows, pa.int32()))
    path = (
        store.partition_dir(sweep="nightly", date=DAY.isoformat(), device="cpu") / f"part-r-old-{key(100 + i)}.parquet"
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table.replace_schema_metadata(meta), path)
    return path


def test_an_older_schema_is_read_and_migrated_by_compact(tmp_path: Path) -> None:
    store = ResultStore(tmp_path / "results")
    old = v1_fragment(store, 0)
    write_job(store, 0)
    assert "sweep" in pq.read_schema(old).names
    table = read_rows(store, sweep="nightly")
    assert table.num_rows == 2 + 6 and set(table["device"].to_pylist()) == {"cpu"}
    assert sorted(set(table["schema_version"].to_pylist())) == [1, 2]
    assert store.complete_job_keys("nightly") >= {key(100), key(0)}
    report = compact(store)
    assert report.migrated == 1 and report.fragments == 2
    (merged,) = store.root.rglob("*.parquet")
    assert pq.read_schema(merged).names == STORED_SCHEMA.names
    assert pq.read_metadata(merged).metadata[META_SCHEMA_VERSION] == b"2"
    assert read_rows(store, sweep="nightly").num_rows == 8
    assert len(pd.read_parquet(store.root)) == 8  # pandas reads the migrated store
    # The merged file's index still names both jobs' fragments (resume, collect and import use them).
    assert store.compacted_names(merged.parent) == {old.name, f"part-20261130T020000Z-aaaa-{key(0)}.parquet"}
    assert pq.read_metadata(merged).metadata[META_JOBS].startswith(b"zlib:")


def test_a_newer_schema_is_refused_with_a_message(tmp_path: Path, orchestrate_bin: str) -> None:
    store = ResultStore(tmp_path / "results")
    write_job(store, 0)
    path = write_job(store, 1)
    table = pq.read_table(path)
    meta = {**(table.schema.metadata or {}), META_SCHEMA_VERSION: b"3"}
    table = table.set_column(0, table.schema.field("schema_version"), pa.array([3] * table.num_rows, pa.int32()))
    pq.write_table(table.replace_schema_metadata(meta), path)
    with pytest.raises(InputError, match=r"schema version 3, newer than this orchestrate reads \(2\): upgrade") as err:
        read_rows(store)
    assert err.value.where == str(path)
    with pytest.raises(InputError, match="newer than this orchestrate reads"):
        compact(store)
    assert len(list(store.root.rglob("*.parquet"))) == 2  # nothing was merged or moved
    out = subprocess.run(
        [orchestrate_bin, "query", "select count(*) from results", "-r", str(store.root)],
        capture_output=True, text=True, env=child_env(), timeout=120,
    )  # fmt: skip
    assert out.returncode == 2 and "schema version 3" in out.stderr and path.name in out.stderr
    with pytest.raises(InputError, match="newer than this orchestrate reads"):
        import_fragment(ResultStore(tmp_path / "other"), path)


def test_resume_knows_complete_jobs_from_names_and_footers_compacted_or_not(tmp_path: Path) -> None:
    store = ResultStore(tmp_path / "results")
    write_job(store, 0)
    write_job(store, 1, status="failed")
    write_job(store, 2, sweep="other")
    done = store.complete_job_keys("nightly")
    assert key(0) in done and key(1) not in done and key(2) not in done and "nonsense" not in done
    assert set(store.complete_job_keys()) == {key(0), key(2)}
    write_job(store, 1, run_id="20261130T030000Z-bbbb")  # the failed job, run again: now complete
    assert key(1) in store.complete_job_keys("nightly")
    compact(store)
    after = store.complete_job_keys("nightly")
    assert set(after) == {key(0), key(1)} and key(1) in after
    frags = {f.path.name: f for f in store.fragments()}
    assert frags[f"part-20261130T020000Z-aaaa-{key(1)}.parquet"].job_status == "failed"
    assert frags[f"part-20261130T030000Z-bbbb-{key(1)}.parquet"].num_rows == 6
    assert frags[f"part-20261130T020000Z-aaaa-{key(1)}.parquet"].meta[META_JOB_STATUS] == b"failed"
    assert store.run_ids("nightly") == {"20261130T020000Z-aaaa", "20261130T030000Z-bbbb"}
