"""Compaction after a run (`orchestrate run`, nightly schedules): old dates only, atomic, idempotent, never fatal."""

from __future__ import annotations

import datetime as dt
import errno
import json
import subprocess
from pathlib import Path

import pytest

from orchestrator.errors import InputError
from orchestrator.run.schedules import load_schedule
from orchestrator.store import compact as compaction
from orchestrator.store import merge as compact_merge
from orchestrator.store.compact import compact_after_run, compact_old, compaction_lock
from orchestrator.store.fragments import ResultStore
from tests.conftest import child_env
from tests.orchestrator.test_compact import STEPS, PowerCut, rows_of
from tests.orchestrator.test_dataset import key, write_job

TODAY = dt.datetime.now(dt.UTC).date()  # as `compact_after_run` sees it
FIRST = TODAY - dt.timedelta(days=4)


def five_nights(root: Path) -> ResultStore:
    """Nights FIRST .. TODAY of sweep `nightly`, 3 jobs each, and two old nights of another sweep."""
    store = ResultStore(root)
    for d in range(5):
        for j in range(3):
            write_job(store, d * 3 + j, day=FIRST + dt.timedelta(days=d), run_id=f"2026113{d}T020000Z-aaaa")
    for d in range(2):
        write_job(store, 100 + d, sweep="other", day=FIRST + dt.timedelta(days=d), run_id=f"2026113{d}T030000Z-bbbb")
    return store


def layout(store: ResultStore) -> dict[str, tuple[str, int]]:
    """Each data file, relative to the root: (kind, mtime_ns) -- what a rewrite would change."""
    return {
        str(p.relative_to(store.root)): (p.name.split("-")[0], p.stat().st_mtime_ns)
        for p in sorted(store.root.rglob("*.parquet"))
    }


def kinds(store: ResultStore, sweep: str) -> dict[str, list[str]]:
    """Per date of a sweep, the kinds of its files (`compact` or `part`)."""
    out: dict[str, list[str]] = {}
    for p in sorted((store.root / f"sweep={sweep}").rglob("*.parquet")):
        out.setdefault(p.parent.parent.name.removeprefix("date="), []).append(p.name.split("-")[0])
    return out


def test_dates_two_days_old_or_older_are_compacted_and_the_rest_left(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = five_nights(tmp_path / "results")
    before = rows_of(store)
    report = compact_old(store, "nightly", after_days=2, today=TODAY)
    assert report is not None and (report.partitions, report.fragments) == (3, 9)
    day = [(FIRST + dt.timedelta(days=d)).isoformat() for d in range(5)]
    assert kinds(store, "nightly") == {
        day[0]: ["compact"], day[1]: ["compact"], day[2]: ["compact"],  # TODAY - 2 and older
        day[3]: ["part"] * 3, day[4]: ["part"] * 3,  # yesterday and today, as the run left them
    }  # fmt: skip
    assert kinds(store, "other") == {day[0]: ["part"], day[1]: ["part"]}  # only the sweep that ran
    assert rows_of(store) == before
    assert {key(i) for i in range(15)} <= set(store.complete_job_keys("nightly"))  # resume still knows every job
    # Idempotent, and a partition that is one compacted file is not even opened the next night.
    files = layout(store)
    with monkeypatch.context() as m:
        m.setattr(compact_merge, "read_footers", lambda *a: pytest.fail("an unchanged partition was read"))
        m.setattr(ResultStore, "footer", lambda *a: pytest.fail("a compacted partition's footer was read"))
        again = compact_old(store, "nightly", after_days=2, today=TODAY)
    assert again is not None and (again.partitions, again.unchanged) == (0, 3)
    assert layout(store) == files
    # A day later yesterday's partition is old enough; a job added to a compacted day is merged in.
    write_job(store, 50, day=FIRST, run_id="20261204T090000Z-late")
    later = compact_old(store, "nightly", after_days=2, today=TODAY + dt.timedelta(days=1))
    assert later is not None and (later.partitions, later.fragments) == (2, 4)
    assert kinds(store, "nightly")[day[3]] == kinds(store, "nightly")[day[0]] == ["compact"]
    assert kinds(store, "nightly")[day[4]] == ["part"] * 3
    assert compact_old(store, "nightly", after_days=0, today=TODAY) is not None  # 0: today's too
    assert all(v == ["compact"] for v in kinds(store, "nightly").values())
    with pytest.raises(InputError, match="--compact-after -1"):
        compact_old(store, "nightly", after_days=-1)


def test_a_compaction_already_running_is_not_waited_for(tmp_path: Path) -> None:
    store = five_nights(tmp_path / "results")
    files = layout(store)
    with compaction_lock(store):  # `orchestrate compact` of the same store, in another command
        assert compact_old(store, "nightly", after_days=2, today=TODAY) is None
        assert compact_after_run(store, "nightly", after_days=2) == (
            "not compacted: another compaction of this store is running"
        )
    assert layout(store) == files


@pytest.mark.parametrize("step", ["writing the merged file", "swapping", "just after the swap"])
def test_a_crash_while_compacting_after_a_run_loses_nothing_and_the_next_run_finishes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, step: str
) -> None:
    store = five_nights(tmp_path / "results")
    before = rows_of(store)
    with monkeypatch.context() as m:
        STEPS[step](m)
        with pytest.raises(PowerCut):
            compact_old(store, "nightly", after_days=2, today=TODAY)
    assert rows_of(store) == before
    for leaf in {p.parent for p in store.root.rglob("*.parquet")}:  # each partition whole: old or new
        names = sorted(p.name.split("-")[0] for p in leaf.iterdir())
        assert set(names) == {"part"} or names == ["compact"], (leaf, names)
    report = compact_old(store, "nightly", after_days=2, today=TODAY)
    assert report is not None and report.partitions + report.unchanged == 3
    assert rows_of(store) == before and not list((store.side / "work").iterdir())


def test_what_stops_a_compaction_is_said_and_never_fails_the_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = five_nights(tmp_path / "results")
    before, files = rows_of(store), layout(store)

    def full_disk(*args: object, **kwargs: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(compaction, "write_merged", full_disk)
    line = compact_after_run(store, "nightly", after_days=2)
    assert line.startswith("not compacted: [Errno 28] No space left on device") and "rows are stored" in line
    assert rows_of(store) == before and layout(store) == files
    assert compact_after_run(store, "no-such-sweep", after_days=2) == ""  # nothing stored for it: nothing to say


def test_a_schedule_compacts_unless_added_with_no_compact_and_so_do_older_records(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, orchestrate_bin: str
) -> None:
    config = tmp_path / "config"
    monkeypatch.setenv("ORCHESTRATE_CONFIG_DIR", str(config))
    cron = tmp_path / "crontab"
    for name, flags in (("default", []), ("later", ["--compact-after", "7"]), ("off", ["--no-compact"])):
        added = subprocess.run(
            [orchestrate_bin, "schedule", "add", name, "--sweep", "smoke", "--crontab-file", str(cron), *flags],
            capture_output=True, text=True, env=child_env(ORCHESTRATE_CONFIG_DIR=str(config)), timeout=120,
        )  # fmt: skip
        assert added.returncode == 0, added.stderr
    assert [load_schedule(n).compact_after for n in ("default", "later", "off")] == [2, 7, None]
    record = json.loads((config / "schedules" / "default.json").read_text())
    del record["compact_after"]  # a record written before the field existed
    (config / "schedules" / "default.json").write_text(json.dumps(record))
    assert load_schedule("default").compact_after == compaction.COMPACT_AFTER_DAYS == 2
