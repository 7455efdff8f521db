"""`orchestrate compact`: merge each partition's job fragments into one file, atomically.

One fragment per job makes a year of nightly sweeps tens of thousands of small files, and every
reader pays for opening each. Compaction rewrites one (sweep, date, device) partition at a time as
one `compact-<id>.parquet` in the same directory (the hive layout stays), its rows sorted by case
and run (a job's rows keep their measured order) and its footer indexing every job it holds
(`orchestrate.jobs`: the fragment's name, job key, status, run and the rest of its footer), so
resume and `collect` still know each job without reading data. The reading and writing is
`orchestrator.store.merge` (DuckDB over the partition's file list, streamed into the writer, in
bounded memory); the point facts of each merged file go into the point index once per sweep.

Atomic: the merged file is written (and synced) into a new directory in the side directory, then
the store's lock is taken alone for an instant (writers wait), fragments that arrived meanwhile
are linked in, and the two directories are swapped in one system call
(`renameat2(RENAME_EXCHANGE)` on Linux, `renamex_np(RENAME_SWAP)` on macOS). A reader sees the old
files or the new ones, never both or neither. Before its swap a work directory holds only the
merged file; after it, only the old files, which a background thread removes while the next
partition merges. A crash at any point leaves each partition whole, old or new, and the next
compaction clears what is left in the side directory. Idempotent: a partition that is one current
compacted file is left alone. `orchestrate run` and nightly schedules compact their sweep's
partitions dated two or more days ago once their rows are stored (`compact_old`; `--compact-after
DAYS`, `--no-compact`). A file that cannot be read whole (by pyarrow and by DuckDB) is set
aside (moved to `<side>/broken/`, with why) and named in a warning; an older schema's fragment is
migrated; a newer one is refused.
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime as dt
import errno
import fcntl
import os
import shutil
import stat
import sys
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import duckdb
import pyarrow as pa

from orchestrator.errors import InfrastructureError, InputError, OrchestratorError
from orchestrator.store.fragments import COMPACT_PREFIX, ResultStore
from orchestrator.store.index import record_facts
from orchestrator.store.merge import (
    connect,
    read_footers,
    unreadable,
    versions,
    write_merged,
)
from workers.contract import META_DATE, META_DEVICE, META_SWEEP, SCHEMA_VERSION, SchemaVersionError, fragment_version

COMPACT_AFTER_DAYS = 2  # what `run` and schedules compact: dates this many days ago or older
FOOTERS_PER_CONNECTION = 2000  # parsed footers (~70 kB each) one DuckDB connection keeps before it is made afresh


@dataclass
class CompactReport:
    """What a compaction did."""

    partitions: int = 0  # partitions rewritten
    fragments: int = 0  # fragments merged into them
    migrated: int = 0  # of those, written by an older schema version
    unchanged: int = 0  # partitions already one compacted file
    set_aside: list[tuple[Path, Path, str]] = field(default_factory=list)  # (from, to, why)


# ------------------------------------------------------------------------------ atomic swap


def exchange(a: Path, b: Path) -> None:
    """Swap two directories in one step, where the system can; else in two renames, as fast as they go."""
    libc = ctypes.CDLL(None, use_errno=True)
    if sys.platform.startswith("linux") and hasattr(libc, "renameat2"):
        at_fdcwd, rename_exchange = -100, 2
        if libc.renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
            return
        code = ctypes.get_errno()
        if code not in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP):
            raise OSError(code, os.strerror(code), str(a))
    elif sys.platform == "darwin" and hasattr(libc, "renamex_np"):
        rename_swap = 0x2
        if libc.renamex_np(os.fsencode(a), os.fsencode(b), rename_swap) == 0:
            return
        code = ctypes.get_errno()
        if code not in (errno.EINVAL, errno.ENOTSUP):
            raise OSError(code, os.strerror(code), str(a))
    parked = b.with_name(b.name + ".parked")  # no atomic swap here: the partition is absent for an instant
    os.rename(a, parked)
    os.rename(b, a)
    os.rename(parked, b)


class CompactionBusy(Exception):
    """Another compaction holds the store's compaction lock (only where it was not to be waited for)."""


@contextlib.contextmanager
def compaction_lock(store: ResultStore, *, wait: bool = True) -> Iterator[None]:
    """One compaction at a time per store (a lock file in the side directory, never through a link).

    Raises:
        CompactionBusy: `wait` is False and another compaction holds the lock.
    """
    path = store.side / "compact.lock"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise InputError("the compaction lock is not a regular file", where=str(path))
        try:
            fcntl.flock(fd, fcntl.LOCK_EX if wait else fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise CompactionBusy(str(path)) from None
        yield
    finally:
        os.close(fd)


def clear_leftovers(store: ResultStore) -> int:
    """Remove what an interrupted compaction left in the side directory (safe: see the module docstring).

    Before its swap a work directory holds only the merged file (the partition is untouched); after
    it, only the old fragments (links to any carried along stay in the partition). Either way it goes.
    """
    work = store.side / "work"
    if not work.is_dir():
        return 0
    leftovers = list(work.iterdir())
    for entry in leftovers:
        shutil.rmtree(entry, ignore_errors=True)
    return len(leftovers)


# ------------------------------------------------------------------------------ one partition


@dataclass
class Compaction:
    """One `compact` call's state: its DuckDB connection, the old partitions being removed, new index facts."""

    store: ResultStore
    report: CompactReport
    warn: Callable[[str], None]
    work: Path
    con: duckdb.DuckDBPyConnection | None = None
    read: int = 0  # footers DuckDB has cached since it connected
    remover: ThreadPoolExecutor = field(default_factory=lambda: ThreadPoolExecutor(1))
    removing: list[Future[None]] = field(default_factory=list)
    facts: list[pa.Table] = field(default_factory=list)  # point facts of the files written, per sweep
    gone: set[str] = field(default_factory=set)  # files (relative to the root) the swaps took out

    def connection(self, files: int) -> duckdb.DuckDBPyConnection:
        """The merging connection, made afresh once its footer cache would hold too many files."""
        if self.con is None or self.read + files > FOOTERS_PER_CONNECTION:
            if self.con is not None:
                self.con.close()
            self.con, self.read = connect(self.work / "spill"), 0
        self.read += files
        if self.read > FOOTERS_PER_CONNECTION:  # one partition of more files than that: read them uncached
            self.con.execute("SET parquet_metadata_cache = false")
        return self.con


def _merge(
    job: Compaction, files: list[Path], fresh: Path, sweep: str, date: str, device: str
) -> tuple[Path, pa.Table, dict[str, int]]:
    """Write the merged file of `files` into `fresh`: its path, point facts and the files' schema versions.

    Raises:
        duckdb.Error: a file is not whole.
        InputError: a file was written by a newer schema version.
    """
    names = [str(p) for p in files]
    con = job.connection(len(names))
    footers = read_footers(con, names)
    try:
        found = versions(footers)
    except SchemaVersionError as exc:
        raise InputError(f"not compacted: {exc}", where=str(fresh.parent)) from None
    partition = {META_SWEEP: sweep.encode(), META_DEVICE: device.encode(), META_DATE: date.encode()}
    target = fresh / f"{COMPACT_PREFIX}{uuid.uuid4().hex[:12]}.parquet"
    with open(target, "wb") as fh:  # nobody sees the work directory: no temp file needed
        facts = write_merged(con, names, footers, fh, partition=partition)
        fh.flush()
        os.fsync(fh.fileno())
    return target, facts, found


def compact_partition(job: Compaction, sweep: str, date: str, device: str) -> None:
    """Merge one partition's files into one compacted file and swap it in (see the module docstring)."""
    store, report = job.store, job.report
    leaf = store.partition_dir(sweep=sweep, date=date, device=device)
    files = sorted(p for p in leaf.glob("*.parquet") if not p.name.startswith("."))
    if len(files) == 1 and files[0].name.startswith(COMPACT_PREFIX):
        meta = store.footer(files[0])
        if meta is not None and fragment_version(meta) == SCHEMA_VERSION:
            report.unchanged += 1
            return
    work = job.work / uuid.uuid4().hex
    fresh = work / "partition"
    fresh.mkdir(parents=True)
    while True:
        if not files:
            shutil.rmtree(work, ignore_errors=True)
            return
        try:
            target, facts, found = _merge(job, files, fresh, sweep, date, device)
            break
        except duckdb.Error as exc:  # some file is not whole: find which, set it aside, merge the rest
            for stale in fresh.iterdir():
                stale.unlink()
            broken = [(p, why) for p in files if (why := unreadable(str(p))) is not None]
            if not broken:
                raise InfrastructureError(f"cannot compact: {str(exc).splitlines()[0]}", where=str(leaf)) from None
            for path, why in broken:
                moved = store.set_aside(path, why)
                report.set_aside.append((path, moved, why))
                job.warn(f"set aside broken file {path} ({why}) -> {moved}")
            gone = {b for b, _ in broken}
            files = [p for p in files if p not in gone]
    merged = set(files)
    with store.locked(exclusive=True):
        for path in sorted(leaf.glob("*.parquet")):  # arrived since the listing: carried along as they are
            if path not in merged and not path.name.startswith("."):
                os.link(path, fresh / path.name)
        exchange(leaf, fresh)
    job.removing.append(job.remover.submit(shutil.rmtree, work, ignore_errors=True))  # the old files, meanwhile
    st = (leaf / target.name).stat()
    rel = str((leaf / target.name).relative_to(store.root))
    facts = facts.append_column("device", pa.array([device] * facts.num_rows, pa.string()))
    facts = facts.append_column("file", pa.array([rel] * facts.num_rows, pa.string()))
    facts = facts.append_column("size", pa.array([st.st_size] * facts.num_rows, pa.int64()))
    job.facts.append(facts.append_column("mtime_ns", pa.array([st.st_mtime_ns] * facts.num_rows, pa.int64())))
    job.gone.update(str(p.relative_to(store.root)) for p in files)
    report.partitions += 1
    report.fragments += sum(1 for p in files if not p.name.startswith(COMPACT_PREFIX))
    report.migrated += sum(1 for p in files if found[str(p)] < SCHEMA_VERSION and not p.name.startswith(COMPACT_PREFIX))


def loose(leaf: Path) -> bool:
    """Whether a partition holds anything but one compacted file (a fragment, or several files)."""
    names = [n for n in os.listdir(leaf) if n.endswith(".parquet") and not n.startswith(".")]
    return len(names) != 1 or not names[0].startswith(COMPACT_PREFIX)


def compact(
    store: ResultStore,
    *,
    sweep: str | None = None,
    before: dt.date | None = None,
    warn: Callable[[str], None] = lambda line: None,
    loose_only: bool = False,
    wait: bool = True,
) -> CompactReport:
    """Compact every partition (of one sweep, of dates before `before`); see the module docstring.

    Args:
        store: the result store.
        sweep: only this sweep's partitions (None: every sweep's).
        before: only partitions dated before this day (None: all).
        warn: called with one line per file set aside.
        loose_only: only partitions holding a fragment; one that is a single compacted file is not
            opened, not even to migrate it from an older schema (what `compact_old` does nightly).
        wait: wait for another compaction of the store to finish; False: raise `CompactionBusy`.

    Raises:
        InputError: nothing is stored, or a file was written by a newer schema version.
        CompactionBusy: `wait` is False and another compaction is running.
    """
    if not store.root.is_dir():
        raise InputError("no results stored", where=str(store.root))
    store.ensure_writable()
    report = CompactReport()
    with compaction_lock(store, wait=wait):
        clear_leftovers(store)
        job = Compaction(store, report, warn, store.side / "work")
        try:
            for sweep_name in [sweep] if sweep is not None else store.sweep_names():
                for _, date, device, leaf in store.partitions(sweep_name):
                    if before is not None and date >= before.isoformat():
                        continue
                    if loose_only and not loose(leaf):
                        report.unchanged += 1
                        continue
                    compact_partition(job, sweep_name, date, device)
                if job.facts:  # once per sweep, not per partition: the index is rewritten whole
                    record_facts(store, sweep_name, pa.concat_tables(job.facts), job.gone)
                job.facts, job.gone = [], set()
        finally:
            if job.con is not None:
                job.con.close()
            shutil.rmtree(job.work / "spill", ignore_errors=True)
            job.remover.shutdown(wait=True)
            for done in job.removing:
                done.result()
    return report


def compact_old(
    store: ResultStore,
    sweep: str,
    *,
    after_days: int,
    today: dt.date | None = None,
    warn: Callable[[str], None] = lambda line: None,
) -> CompactReport | None:
    """What `orchestrate run` and a nightly schedule do once a sweep's rows are stored: compact
    the sweep's partitions dated `after_days` or more days before today that hold fragments.

    Today's and the last few days' partitions stay as they are (a resumed run may still add to
    them); a partition that is one compacted file is not opened. Atomic and idempotent as
    `compact` is; a compaction already running (another command's) is not waited for.

    Returns:
        What was done, or None when another compaction held the store.

    Raises:
        InputError: a file was written by a newer schema version.
    """
    if after_days < 0:
        raise InputError(f"--compact-after {after_days}: expected a number of days, 0 or more")
    if not (store.root / f"sweep={sweep}").is_dir():
        return CompactReport()
    cutoff = (today or dt.datetime.now(dt.UTC).date()) - dt.timedelta(days=after_days - 1)
    try:
        return compact(store, sweep=sweep, before=cutoff, warn=warn, loose_only=True, wait=False)
    except CompactionBusy:
        return None


def compact_after_run(
    store: ResultStore, sweep: str, *, after_days: int, warn: Callable[[str], None] = lambda line: None
) -> str:
    """`compact_old` once a run's rows are stored, never failing the run: the line to print ('' when
    there was nothing to compact). What stops it (a newer file, a full disk) is said, not raised."""
    try:
        report = compact_old(store, sweep, after_days=after_days, warn=warn)
    except (OrchestratorError, OSError) as exc:
        return f"not compacted: {exc} (the run's rows are stored; `orchestrate compact` to try again)"
    if report is None:
        return "not compacted: another compaction of this store is running"
    if not report.partitions:
        return ""
    return (
        f"compacted {report.partitions} partitions of sweep {sweep} dated {after_days} or more days ago "
        f"({report.fragments} fragments merged; --no-compact leaves them)"
    )
