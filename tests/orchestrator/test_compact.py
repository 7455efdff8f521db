"""`orchestrate compact`: one file per partition, atomic for readers, safe to interrupt, idempotent."""

from __future__ import annotations

import datetime as dt
import subprocess
import threading
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from orchestrator import compact as compaction
from orchestrator.compact import compact
from orchestrator.dataset import read_rows
from orchestrator.store import ResultStore
from tests.conftest import child_env
from tests.orchestrator.test_dataset import DAY, key, write_job


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


def test_a_crash_before_or_after_the_swap_loses_and_duplicates_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = nightly_store(tmp_path / "results", nights=2)
    before = rows_of(store)

    def crash(a: Path, b: Path) -> None:
        raise KeyboardInterrupt("power cut before the swap")

    with monkeypatch.context() as m:
        m.setattr(compaction, "exchange", crash)
        with pytest.raises(KeyboardInterrupt):
            compact(store)
    assert rows_of(store) == before and not list(store.root.rglob("compact-*"))
    assert list((store.side / "work").iterdir())  # the merged file it was about to swap in

    real_rmtree = compaction.shutil.rmtree
    calls = []

    def crash_after_swap(path: Path, ignore_errors: bool = False) -> None:
        calls.append(path)
        raise KeyboardInterrupt("power cut after the swap")

    with monkeypatch.context() as m:
        m.setattr(compaction.shutil, "rmtree", crash_after_swap)
        m.setattr(compaction, "clear_leftovers", lambda store: 0)
        with pytest.raises(KeyboardInterrupt):
            compact(store)
    assert len(calls) == 1 and rows_of(store) == before  # one partition swapped, its old files parked aside
    assert len(list(store.root.rglob("compact-*"))) == 1
    compaction.shutil.rmtree = real_rmtree
    report = compact(store)  # clears what the crashes left, then finishes
    assert report.partitions == 1 and report.unchanged == 1
    assert rows_of(store) == before and not list((store.side / "work").iterdir())


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


def test_a_fragment_written_while_compacting_is_carried_along(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = nightly_store(tmp_path / "results", nights=1, jobs=3)
    real = compaction._read_part
    written = []

    def read_then_a_writer_arrives(*args: object) -> object:
        out = real(*args)  # type: ignore[arg-type]
        if not written:
            written.append(write_job(store, 50, run_id="20261130T050000Z-race"))
        return out

    monkeypatch.setattr(compaction, "_read_part", read_then_a_writer_arrives)
    compact(store)
    leaf = written[0].parent
    assert sorted(p.name.split("-")[0] for p in leaf.iterdir()) == ["compact", "part"]
    assert written[0].is_file() and key(50) in store.complete_job_keys()
    assert read_rows(store).num_rows == 4 * 6


def test_an_imported_job_already_compacted_is_not_stored_twice(tmp_path: Path) -> None:
    store = nightly_store(tmp_path / "results", nights=1, jobs=2)
    copy = tmp_path / "copy.parquet"
    copy.write_bytes(next(store.root.rglob("part-*.parquet")).read_bytes())
    compact(store)
    store.import_fragment(copy)
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
