"""The point facts in a fragment's footer: the same facts as its rows give, the index built from them alone.

Real fragments written through `ResultStore.write` and read back by DuckDB: once from their
footers (`orchestrator.store.footer`), once from their rows (`point_index.FACTS_SQL`, what the
index was built from before), and the two must agree row for row, parameters no MAP printer can
confuse included; a file without the footer key, or one that does not read, falls back to the rows.
"""

from __future__ import annotations

import datetime as dt
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from orchestrator.store import index as point_index
from orchestrator.store.dataset import read_rows
from orchestrator.store.footer import META_POINTS, footer_facts
from orchestrator.store.fragments import ResultStore
from orchestrator.store.index import FACTS_SQL, index_path, refreshed
from orchestrator.store.scan import StoreScan
from tests.orchestrator.synthetic_rows import job_table
from tests.orchestrator.test_dataset import DAY, key, write_job

AWKWARD = {
    "checkpoint": "mlx-community/Qwen3 8B, 4bit='x' {a=b}",
    "quote": 'it\'s "quoted"',
    "empty": "",
    "unicode": "ünïcode [1, 2]",
    "tokens": 512,
    "flag": True,
}
COLUMNS = ["file", "case_name", "case", "point", "run_id", "started_at", "schema_version"]


def facts_from_rows(store: ResultStore, files: list[str]) -> list[tuple[object, ...]]:
    table = StoreScan(store, files=files).arrow(FACTS_SQL).select(COLUMNS)
    return sorted(zip(*(table[c].to_pylist() for c in COLUMNS), strict=True), key=repr)


def facts_from_footers(files: list[str]) -> tuple[list[tuple[object, ...]], list[str]]:
    table, unread = footer_facts(files)
    rows = sorted(zip(*(table.select(COLUMNS)[c].to_pylist() for c in COLUMNS), strict=True), key=repr)
    return rows, unread


def test_footer_facts_equal_the_facts_of_the_rows(tmp_path: Path) -> None:
    store = ResultStore(tmp_path / "results")
    for i in range(3):
        write_job(store, i, run_id=f"2026113{i}T020000Z-aaaa", day=DAY + dt.timedelta(days=i))
    # a job whose parameters are hard to print, and one whose rows hold two cases and two starts
    awkward = job_table({"native": {"seconds": [1.0, 1.1]}}, params=AWKWARD, sweep="nightly", run_id="r-awk")
    store.write(awkward, sweep="nightly", date=DAY, device="cpu", run_id="r-awk", job_key=key(10))
    first = job_table({"native": {"seconds": [1.0]}}, params={"tokens": 1}, sweep="nightly", run_id="r-two",
                      started_at=dt.datetime(2026, 11, 30, 1, tzinfo=dt.UTC))  # fmt: skip
    later = job_table({"affine": {"seconds": [2.0]}}, params={"tokens": 1}, sweep="nightly", run_id="r-two",
                      case="moe-gather", started_at=dt.datetime(2026, 11, 30, 3, tzinfo=dt.UTC))  # fmt: skip
    again = job_table({"native": {"seconds": [3.0]}}, params={"tokens": 1}, sweep="nightly", run_id="r-two",
                      started_at=dt.datetime(2026, 11, 30, 5, tzinfo=dt.UTC))  # fmt: skip
    mixed = pa.concat_tables([first, later, again])
    store.write(mixed, sweep="nightly", date=DAY, device="cpu", run_id="r-two", job_key=key(11))
    files = sorted(str(p) for p in store.root.rglob("*.parquet"))
    from_footers, unread = facts_from_footers(files)
    assert unread == []
    assert from_footers == facts_from_rows(store, files)
    assert len(from_footers) == 3 + 1 + 2  # the mixed job: two (case, point, run) groups
    newest = max(r[5] for r in from_footers if r[4] == "r-two" and r[2] == "qmm")
    assert newest == dt.datetime(2026, 11, 30, 5, tzinfo=dt.UTC)  # the group's newest start, as max() gives it


def strip_points(path: Path) -> None:
    """Rewrite a fragment as one written before fragments carried their facts (no `orchestrate.points`)."""
    table = pq.read_table(path, partitioning=None)
    meta = {k: v for k, v in (table.schema.metadata or {}).items() if k != META_POINTS}
    pq.write_table(table.replace_schema_metadata(meta), path)


def test_the_index_of_new_fragments_is_built_from_footers_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = ResultStore(tmp_path / "results")
    for i in range(4):
        write_job(store, i)
    write_job(store, 0, run_id="20261201T020000Z-bbbb", day=DAY + dt.timedelta(days=1))

    def no_row_scan(*args: object, **kwargs: object) -> None:
        raise AssertionError("the index read rows of files whose footers carry their facts")

    with monkeypatch.context() as m:
        m.setattr(point_index, "StoreScan", no_row_scan)
        built = refreshed(store, "nightly")
    assert built.num_rows == 5
    index_path(store, "nightly").unlink()
    old = sorted(store.root.rglob("*.parquet"))[:2]
    for path in old:  # written by an older orchestrate: read from the rows, the others still from footers
        strip_points(path)
    rebuilt = refreshed(store, "nightly")
    assert sorted(rebuilt.drop_columns(["size", "mtime_ns"]).to_pylist(), key=str) == sorted(
        built.drop_columns(["size", "mtime_ns"]).to_pylist(), key=str
    )
    newest = read_rows(store, sweep="nightly", newest=True)
    assert sorted(set(newest["run_id"].to_pylist())) == ["20261130T020000Z-aaaa", "20261201T020000Z-bbbb"]
    assert newest.num_rows == 4 * 6


def test_an_unreadable_footer_is_left_to_the_row_scan_which_skips_it(tmp_path: Path) -> None:
    store = ResultStore(tmp_path / "results")
    for i in range(3):
        write_job(store, i)
    good = sorted(str(p) for p in store.root.rglob("*.parquet"))
    bad = store.partition_dir(sweep="nightly", date=DAY.isoformat(), device="cpu") / "part-x-00000000000000ff.parquet"
    bad.write_bytes(b"PAR1 not parquet at all")
    facts, unread = footer_facts([*good, str(bad)])
    assert unread == [str(bad)] and sorted(set(facts["file"].to_pylist())) == good
    index = refreshed(store, "nightly")  # the row scan notes it broken; the read goes on
    assert sorted(set(index["file"].to_pylist())) == sorted(str(Path(g).relative_to(store.root)) for g in good)
    assert [p for p, _ in store.broken] == [bad]


def test_an_index_printed_by_another_duckdb_is_built_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Its points are DuckDB's text of a MAP: another version may print them otherwise and miss rows."""
    store = ResultStore(tmp_path / "results")
    for i in range(2):
        write_job(store, i)
    refreshed(store, "nightly")
    path = index_path(store, "nightly")
    assert pq.read_metadata(path).metadata[point_index.META_DUCKDB] == point_index.duckdb_version()
    table = pq.read_table(path)
    pq.write_table(table.replace_schema_metadata({point_index.META_DUCKDB: b"0.0.1"}), path)
    calls = []
    real = point_index.footer_facts
    monkeypatch.setattr(point_index, "footer_facts", lambda files: calls.append(len(files)) or real(files))
    assert refreshed(store, "nightly").num_rows == 2
    assert calls == [2]  # both files read again
    assert refreshed(store, "nightly").num_rows == 2 and calls == [2]  # and the index is current after that
