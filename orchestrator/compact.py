"""`orchestrate compact`: merge each partition's job fragments into one file, atomically.

One fragment per job makes a year of nightly sweeps tens of thousands of small files, and every
reader pays for opening each. Compaction rewrites one (sweep, date, device) partition at a time as
one `compact-<id>.parquet` in the same directory (the hive layout stays), its rows sorted by case
and run (a job's rows keep their measured order) and its footer indexing every job it holds
(`orchestrate.jobs`: the fragment's name, job key, status, run and the rest of its footer), so
resume and `collect` still know each job without reading data.

Atomic: the merged file is written into a new directory in the side directory, then the store's
lock is taken alone for an instant (writers wait), fragments that arrived meanwhile are linked in,
and the two directories are swapped in one system call (`renameat2(RENAME_EXCHANGE)` on Linux,
`renamex_np(RENAME_SWAP)` on macOS). A reader sees the old files or the new ones, never both or
neither; a crash at any point leaves one of the two whole, and the next compaction clears what is
left in the side directory. Idempotent: a partition that is one current compacted file is left
alone. A fragment that cannot be read whole is set aside (moved to `<side>/broken/`, with why)
and named in a warning; an older schema's fragment is migrated; a newer one is refused.
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
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from orchestrator.errors import InputError
from orchestrator.store import COMPACT_PREFIX, ResultStore, compact_index, packed_index
from workers.contract import (
    META_JOBS,
    META_RUN_ID,
    META_SCHEMA_VERSION,
    SCHEMA_VERSION,
    SchemaVersionError,
    fragment_version,
    restored_table,
    stored_table,
)
from workers.spool import parse_fragment_name

ROW_GROUP_ROWS = 64 * 1024
SORT_KEYS = [("case_name", "ascending"), ("run_id", "ascending"), ("job_key", "ascending")]
# Footer keys that describe the file, not a job: not copied into the index.
FILE_KEYS = {META_SCHEMA_VERSION, META_JOBS, b"ARROW:schema"}


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


@contextlib.contextmanager
def compaction_lock(store: ResultStore) -> Iterator[None]:
    """One compaction at a time per store (a lock file in the side directory, never through a link)."""
    path = store.side / "compact.lock"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise InputError("the compaction lock is not a regular file", where=str(path))
        fcntl.flock(fd, fcntl.LOCK_EX)
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


def _job_entry(name: str, meta: dict[bytes, bytes], num_rows: int) -> dict[str, str]:
    entry = {k.decode(): v.decode() for k, v in meta.items() if k.startswith(b"orchestrate.") and k not in FILE_KEYS}
    entry = {k.removeprefix("orchestrate."): v for k, v in entry.items()}
    parsed = parse_fragment_name(name)
    if "run_id" not in entry and parsed is not None:  # version 1 did not write it: the name says it
        entry["run_id"] = parsed[0]
    return {"file": name, **entry, "num_rows": str(num_rows)}


def _read_part(store: ResultStore, path: Path, sweep: str, device: str) -> tuple[pa.Table, list[dict[str, str]], int]:
    """One file's rows (in `SCHEMA`), its index entries and its schema version; raises on a broken file."""
    table = pq.read_table(path)  # every page decoded: a corrupt one raises here, not in a reader later
    meta = dict(table.schema.metadata or {})
    version = fragment_version(meta)
    rows = restored_table(table, sweep=sweep, device=device)
    if path.name.startswith(COMPACT_PREFIX):
        return rows, compact_index(meta), version
    return rows, [_job_entry(path.name, meta, table.num_rows)], version


def compact_partition(
    store: ResultStore, sweep: str, date: str, device: str, report: CompactReport, warn: Callable[[str], None]
) -> None:
    """Merge one partition's files into one compacted file and swap it in (see the module docstring)."""
    leaf = store.partition_dir(sweep=sweep, date=date, device=device)
    files = sorted(p for p in leaf.glob("*.parquet") if not p.name.startswith("."))
    if len(files) == 1 and files[0].name.startswith(COMPACT_PREFIX):
        meta = store.footer(files[0])
        if meta is not None and fragment_version(meta) == SCHEMA_VERSION:
            report.unchanged += 1
            return
    tables, index, merged, migrated = [], [], [], 0
    for path in files:
        try:
            rows, entries, version = _read_part(store, path, sweep, device)
        except SchemaVersionError as exc:
            raise InputError(f"not compacted: {exc}", where=str(path)) from None
        except (OSError, pa.ArrowException) as exc:
            why = str(exc).splitlines()[0]
            moved = store.set_aside(path, why)
            report.set_aside.append((path, moved, why))
            warn(f"set aside broken file {path} ({why}) -> {moved}")
            continue
        tables.append(rows)
        index += entries
        merged.append(path)
        migrated += version < SCHEMA_VERSION and not path.name.startswith(COMPACT_PREFIX)
    if not tables:
        return
    table = pa.concat_tables(tables)
    table = table.take(pc.sort_indices(table, sort_keys=SORT_KEYS))  # stable: a job's rows keep their order
    body = stored_table(table.replace_schema_metadata(None), sweep=sweep, device=device, date=date, run_id="")
    meta = {k: v for k, v in (body.schema.metadata or {}).items() if k != META_RUN_ID}  # many runs: see the index
    meta[META_JOBS] = packed_index(index)
    body = body.replace_schema_metadata(meta)

    work = store.side / "work" / uuid.uuid4().hex
    fresh = work / "partition"
    fresh.mkdir(parents=True)
    name = f"{COMPACT_PREFIX}{uuid.uuid4().hex[:12]}.parquet"
    with open(fresh / name, "wb") as fh:  # nobody sees the work directory: no temp file needed
        pq.write_table(body, fh, compression="zstd", row_group_size=ROW_GROUP_ROWS)
        fh.flush()
        os.fsync(fh.fileno())
    with store.locked(exclusive=True):
        for path in sorted(leaf.glob("*.parquet")):  # arrived since the listing: carried along as they are
            if path not in merged:
                os.link(path, fresh / path.name)
        exchange(leaf, fresh)
    shutil.rmtree(work, ignore_errors=True)
    report.partitions += 1
    report.fragments += sum(1 for p in merged if not p.name.startswith(COMPACT_PREFIX))
    report.migrated += migrated


def compact(
    store: ResultStore,
    *,
    sweep: str | None = None,
    before: dt.date | None = None,
    warn: Callable[[str], None] = lambda line: None,
) -> CompactReport:
    """Compact every partition (of one sweep, of dates before `before`); see the module docstring.

    Raises:
        InputError: nothing is stored, or a file was written by a newer schema version.
    """
    if not store.root.is_dir():
        raise InputError("no results stored", where=str(store.root))
    store.ensure_writable()
    report = CompactReport()
    with compaction_lock(store):
        clear_leftovers(store)
        for sweep_name, date, device, _ in store.partitions(sweep):
            if before is not None and date >= before.isoformat():
                continue
            compact_partition(store, sweep_name, date, device, report, warn)
    return report
