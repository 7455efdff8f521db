"""`orchestrate compact`: one file per partition, atomic for readers, safe to interrupt, idempotent."""

from __future__ import annotations

import datetime as dt
import os
import shutil
import subprocess
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from orchestrator.store import compact as compaction
from orchestrator.store import index as point_index
from orchestrator.store import merge as compact_merge
from orchestrator.store.compact import compact
from orchestrator.store.dataset import read_rows
from orchestrator.store.footer import compact_index
from orchestrator.store.fragments import ResultStore
from orchestrator.store.incoming import import_fragment
from orchestrator.store.index import index_path, refreshed
from tests.conftest import child_env
from tests.orchestrator.test_dataset import DAY, key, write_job
from workers.contract import STORED_SCHEMA


def nightly_store(root: Path, nights: int = 3, jobs: int = 4) -> ResultStore:
    store = ResultStore(root)
    for d in range(nights):
        for j in range(jobs):
            write_job(store, d * jobs + j, day=DAY + dt.timedelta(days=d), run_id=f"2026113{d}T020000Z-aaaa")
    return store


def rows_of(store: ResultStore) -> list[tuple[str, str, str, int]]:
    table = read_rows(store)
    return sorted(zip(*(table[c].to_pylist() for c in ("job_key", "arm", "run_id", "sample")), strict=True))


def test_compaction_merges_each_partition_once_and_keeps_every_row(tmp_path: Path) -> None:
    store = nightly_store(tmp_path / "results")
    before = rows_of(store)
    report = compact(store, before=DAY + dt.timedelta(days=2))  # the last night is left alone
    assert (report.partitions, report.fragments, report.unchanged) == (2, 8, 0)
    leaves = {p.parent.name + "/" + p.parent.parent.name: p.name for p in store.root.rglob("*.parquet")}
    assert len(list(store.root.rglob("compact-*.parquet"))) == 2
    assert len(list(store.root.rglob("part-*.parquet"))) == 4
    assert rows_of(store) == before
    again = compact(store, before=DAY + dt.timedelta(days=2))
    assert (again.partitions, again.unchanged) == (0, 2)  # idempotent: nothing rewritten
    assert {p.parent.name + "/" + p.parent.parent.name: p.name for p in store.root.rglob("*.parquet")} == leaves
    # A job's rows keep their measured order (arms as the job interleaved them) in the merged file.
    merged = next(store.root.rglob("compact-*.parquet"))
    table = pq.read_table(merged)
    arms = [a for a, k in zip(table["arm"].to_pylist(), table["job_key"].to_pylist(), strict=True) if k == key(0)]
    assert arms == ["native"] * 3 + ["affine"] * 3 and table.num_rows == 4 * 6
    # A fragment arriving later in a compacted partition sits beside the merged file; compacting merges it.
    write_job(store, 99, run_id="20261130T090000Z-late")
    assert compact(store, sweep="nightly", before=DAY + dt.timedelta(days=1)).partitions == 1
    assert len(list(store.partition_dir(sweep="nightly", date=DAY.isoformat(), device="cpu").iterdir())) == 1
    assert key(99) in store.complete_job_keys("nightly")


class PowerCut(BaseException):
    """A crash: nothing in the code under test catches it (as nothing survives a lost process)."""


def cut_on_call(real: Callable[..., Any], call: int, *, after: bool = False) -> Callable[..., Any]:
    """`real`, except that its `call`-th call crashes (before doing anything, or `after` doing it)."""
    seen = [0]

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        seen[0] += 1
        if seen[0] == call and not after:
            raise PowerCut(real.__name__)
        out = real(*args, **kwargs)
        if seen[0] == call:
            raise PowerCut(real.__name__)
        return out

    return wrapper


def half_written(con: Any, files: Any, footers: Any, sink: Any, **kwargs: Any) -> Any:
    sink.write(b"PAR1 half a merged file")
    raise PowerCut("mid-write")


STEPS: dict[str, Callable[[pytest.MonkeyPatch], None]] = {
    # Every step of one partition's compaction, crashed at the second partition (the first is swapped).
    "reading footers": lambda m: m.setattr(compaction, "read_footers", cut_on_call(compaction.read_footers, 2)),
    "writing the merged file": lambda m: m.setattr(
        compaction, "write_merged", cut_on_call(compaction.write_merged, 2, after=True)
    ),
    "half-way through the merged file": lambda m: m.setattr(compaction, "write_merged", half_written),
    "syncing it": lambda m: m.setattr(compaction.os, "fsync", cut_on_call(os.fsync, 2)),
    "taking the lock": lambda m: m.setattr(ResultStore, "locked", cut_on_call(ResultStore.locked, 2)),
    "swapping": lambda m: m.setattr(compaction, "exchange", cut_on_call(compaction.exchange, 2)),
    "just after the swap": lambda m: m.setattr(compaction, "exchange", cut_on_call(compaction.exchange, 2, after=True)),
    "removing the old files": lambda m: m.setattr(compaction.shutil, "rmtree", cut_on_call(shutil.rmtree, 1)),
    "saving the point index": lambda m: m.setattr(compaction, "record_facts", cut_on_call(compaction.record_facts, 1)),
}


@pytest.mark.parametrize("step", list(STEPS))
def test_a_crash_at_any_step_loses_and_duplicates_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, step: str
) -> None:
    store = nightly_store(tmp_path / "results", nights=3)
    before = rows_of(store)
    index_before = rebuilt_index(store)
    with monkeypatch.context() as m:
        STEPS[step](m)
        with pytest.raises(PowerCut):
            compact(store)
    assert rows_of(store) == before  # every row once: old files or new, never both or neither
    for leaf in {p.parent for p in store.root.rglob("*.parquet")}:
        names = [p.name for p in leaf.iterdir()]
        assert all(n.startswith("part-") for n in names) or (names[0].startswith("compact-") and len(names) == 1)
    assert resolved_index(store) == index_before  # whatever the index says, a read brings it right
    report = compact(store)  # the next compaction clears what the crash left, then finishes
    assert report.partitions + report.unchanged == 3 and not report.set_aside
    assert rows_of(store) == before and len(list(store.root.rglob("*.parquet"))) == 3
    assert not list((store.side / "work").iterdir())
    assert not list(store.side.rglob("*.parquet")) or all("index" in p.parts for p in store.side.rglob("*.parquet"))
    assert resolved_index(store) == index_before
    assert set(store.complete_job_keys("nightly")) == {key(i) for i in range(12)}


def rebuilt_index(store: ResultStore) -> list[tuple[object, ...]]:
    """The point index as a scan of every file gives it (no cache), without the file names."""
    index_path(store, "nightly").unlink(missing_ok=True)
    return resolved_index(store)


def resolved_index(store: ResultStore) -> list[tuple[object, ...]]:
    table = refreshed(store, "nightly").drop_columns(["file", "size", "mtime_ns"])
    return sorted(tuple(r.values()) for r in table.to_pylist())


def test_the_point_index_is_written_by_compact_so_the_next_read_scans_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = nightly_store(tmp_path / "results", nights=3)
    write_job(store, 40, run_id="20261130T090000Z-late", samples=5)  # a point of night 0 measured again
    newest = read_rows(store, sweep="nightly", newest=True)
    facts = pq.read_table(index_path(store, "nightly"))
    compact(store)
    written = pq.read_table(index_path(store, "nightly"))
    assert set(written["file"].to_pylist()) == {str(p.relative_to(store.root)) for p in store.root.rglob("*.parquet")}

    def no_scan(*args: object, **kwargs: object) -> None:
        raise AssertionError("the index was scanned again after compaction")

    with monkeypatch.context() as m:
        m.setattr(point_index, "StoreScan", no_scan)
        fresh = refreshed(store, "nightly")
    assert fresh.num_rows == written.num_rows == facts.num_rows
    # Exactly the facts a scan of the merged files finds (the same points, runs, times, versions).
    index_path(store, "nightly").unlink()
    assert sorted(refreshed(store, "nightly").to_pylist(), key=str) == sorted(fresh.to_pylist(), key=str)
    again = read_rows(store, sweep="nightly", newest=True)
    assert sorted(again.to_pylist(), key=str) == sorted(newest.to_pylist(), key=str)


def test_a_fragment_written_while_compacting_is_carried_along(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = nightly_store(tmp_path / "results", nights=1, jobs=3)
    real = compaction.write_merged
    written: list[Path] = []

    def merge_then_a_writer_arrives(*args: Any, **kwargs: Any) -> Any:
        out = real(*args, **kwargs)
        if not written:
            written.append(write_job(store, 50, run_id="20261130T050000Z-race"))
        return out

    monkeypatch.setattr(compaction, "write_merged", merge_then_a_writer_arrives)
    compact(store)
    leaf = written[0].parent
    assert sorted(p.name.split("-")[0] for p in leaf.iterdir()) == ["compact", "part"]
    assert written[0].is_file() and key(50) in store.complete_job_keys()
    assert read_rows(store).num_rows == 4 * 6


def test_files_of_different_columns_row_groups_and_footer_caches(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A column only later files have survives (DuckDB's first-file schema would drop it); row groups
    fill to their size whatever the batches; a partition of more files than one connection caches."""
    store = nightly_store(tmp_path / "results", nights=1, jobs=6)
    first = sorted(store.root.rglob("part-*.parquet"))[0]
    table = pq.read_table(first)
    pq.write_table(table.drop_columns(["gpu_uuid", "gpu_index"]).replace_schema_metadata(table.schema.metadata), first)
    later = write_job(store, 7, run_id="20261130T090000Z-zzzz")
    table = pq.read_table(later)
    column = table.schema.get_field_index("gpu_uuid")
    table = table.set_column(column, table.schema.field(column), pa.array(["GPU-7"] * table.num_rows, pa.string()))
    pq.write_table(table, later)
    before = rows_of(store)
    monkeypatch.setattr(compact_merge, "ROW_GROUP_ROWS", 10)
    monkeypatch.setattr(compaction, "FOOTERS_PER_CONNECTION", 3)
    compact(store)
    (merged,) = store.root.rglob("*.parquet")
    meta = pq.read_metadata(merged)
    assert [meta.row_group(i).num_rows for i in range(meta.num_row_groups)] == [10, 10, 10, 10, 2]
    assert rows_of(store) == before
    body = pq.read_table(merged)
    assert body.schema.remove_metadata() == STORED_SCHEMA.remove_metadata()
    assert set(body.filter(pc.equal(body["job_key"], key(7)))["gpu_uuid"].to_pylist()) == {"GPU-7"}
    assert body.filter(pc.is_valid(body["gpu_uuid"])).num_rows == 6
    # Sorted by case and run, each job's rows in the order it measured them.
    runs = body["run_id"].to_pylist()
    assert runs == sorted(runs) and body["arm"].to_pylist()[:6] == ["native"] * 3 + ["affine"] * 3
    jobs = {j["file"]: j for j in store_index(merged)}
    assert len(jobs) == 7 and {j["num_rows"] for j in jobs.values()} == {"6"}


def store_index(path: Path) -> list[dict[str, str]]:
    return compact_index(dict(pq.read_metadata(path).metadata))


def test_readers_see_the_old_files_or_the_new_never_both_or_neither(tmp_path: Path) -> None:
    store = nightly_store(tmp_path / "results", nights=12, jobs=3)
    expected = len(rows_of(store))
    counts: list[int] = []
    stop = threading.Event()

    def reader() -> None:
        while not stop.is_set():
            counts.append(read_rows(ResultStore(store.root)).num_rows)

    thread = threading.Thread(target=reader)
    thread.start()
    try:
        compact(store)
    finally:
        stop.set()
        thread.join(timeout=120)
    assert counts and set(counts) == {expected}, counts


def test_an_imported_job_already_compacted_is_not_stored_twice(tmp_path: Path) -> None:
    store = nightly_store(tmp_path / "results", nights=1, jobs=2)
    copy = tmp_path / "copy.parquet"
    copy.write_bytes(next(store.root.rglob("part-*.parquet")).read_bytes())
    compact(store)
    import_fragment(store, copy)
    assert read_rows(store).num_rows == 2 * 6
    assert len(list(store.root.rglob("*.parquet"))) == 1


def test_cli_compact(tmp_path: Path, orchestrate_bin: str) -> None:
    store = nightly_store(tmp_path / "results", nights=2, jobs=2)
    (store.partition_dir(sweep="nightly", date=DAY.isoformat(), device="cpu") / "part-x-bad.parquet").write_bytes(b"x")
    out = subprocess.run(
        [orchestrate_bin, "compact", "-r", str(store.root), "--before", (DAY + dt.timedelta(days=1)).isoformat()],
        capture_output=True, text=True, env=child_env(), timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "compacted 1 partitions (2 fragments merged" in out.stdout and "1 broken files set aside" in out.stdout
    assert "set aside broken file" in out.stderr and "part-x-bad.parquet" in out.stderr
    bad = subprocess.run(
        [orchestrate_bin, "compact", "-r", str(store.root), "--before", "yesterday"],
        capture_output=True, text=True, env=child_env(), timeout=120,
    )  # fmt: skip
    assert bad.returncode == 2 and "--before 'yesterday': expected a date" in bad.stderr
