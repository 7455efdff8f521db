"""The result store: hive-partitioned Parquet that DuckDB, Polars, pandas and Spark read directly.

Layout: `<root>/sweep=<name>/date=<YYYY-MM-DD>/device=<kind>/` holds one fragment per finished job,
`part-<run>-<job>.parquet`, and, once `orchestrate compact` has merged a partition, one
`compact-<id>.parquet` whose footer indexes the jobs it holds. Nothing else lives under the root,
so every reader's default call (`pandas.read_parquet(root)`, `polars.read_parquet(root)`,
`pyarrow.dataset.dataset(root, partitioning="hive")`, DuckDB's `read_parquet('root/**/*.parquet')`)
reads it. Temp files of writes, fragments set aside as broken, compaction's work and the run locks
(`orchestrator.store.lock`) live in a side directory beside the root
(`<parent>/.<root name>.orchestrate/`; inside the root, as `.orchestrate/`, only where the parent
is not writable or on another file system).

Writes are atomic (a whole file is staged in the side directory, then renamed into place) and
take the store's lock shared; compaction takes it exclusively for the instant it swaps a
partition (`orchestrator.store.compact`). Resume reads footers (job key, status), never data. A
fragment brought in from elsewhere (`import`, `collect`) is stored only when its sweep, device,
run and job key are safe names (`check_fragment`): no file it names can land outside the store.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import fcntl
import os
import tempfile
import uuid
from collections.abc import Iterator, Set
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import pyarrow as pa

from orchestrator.errors import InfrastructureError, InputError
from orchestrator.store.footer import META_POINTS, compact_index, points_footer
from workers.contract import (
    META_DEVICE,
    META_JOB_KEY,
    META_JOB_STATUS,
    META_SWEEP,
    SchemaVersionError,
    Status,
    fragment_version,
    stored_table,
)
from workers.files import write_parquet_atomic
from workers.job.spool import fragment_name, parse_fragment_name

if TYPE_CHECKING:
    import pyarrow.parquet as pq

COMPACT_PREFIX = "compact-"
SIDE_NAME = ".orchestrate"


@dataclass(frozen=True)
class StoreFile:
    """One data file under the root and the partition it sits in."""

    path: Path
    sweep: str
    date: str
    device: str

    @property
    def compacted(self) -> bool:
        """True for a merged partition file (`compact-*.parquet`), False for one job's fragment."""
        return self.path.name.startswith(COMPACT_PREFIX)


@dataclass(frozen=True)
class Fragment:
    """One stored job: where it is and what its footer (or its compacted file's index) says.

    `path` is the job's fragment path in its partition; once compacted, the job lives in `file`.
    """

    path: Path
    sweep: str
    date: str
    device: str
    job_key: str
    job_status: str
    schema_version: int
    num_rows: int
    file: Path
    meta: dict[bytes, bytes] = field(default_factory=dict, compare=False)  # the job's footer keys


def _dirs(parent: Path, key: str) -> list[tuple[str, Path]]:
    """`(value, path)` of the `key=value` directories in `parent`, sorted."""
    prefix = f"{key}="
    try:
        entries = list(os.scandir(parent))
    except (FileNotFoundError, NotADirectoryError):
        return []
    return sorted((e.name[len(prefix) :], Path(e.path)) for e in entries if e.name.startswith(prefix) and e.is_dir())


class JobIndex(Set[str]):
    """The complete job keys of a store (or one sweep), looked up lazily.

    A fragment's job key is in its file name, so a lookup reads the footers of only the fragments
    named for that key, plus, once, the indexes of the compacted files; `in` is what resume asks.
    """

    def __init__(self, store: ResultStore, sweep: str | None) -> None:
        self._store = store
        self._by_key: dict[str, list[Path]] = {}
        self._compacted: list[Path] = []
        for f in store.files(sweep=sweep):
            if f.compacted:
                self._compacted.append(f.path)
                continue
            parsed = parse_fragment_name(f.path.name)
            if parsed is not None:
                self._by_key.setdefault(parsed[1], []).append(f.path)
        self._known: dict[str, bool] = {}
        self._from_compacted: set[str] | None = None

    def _compacted_keys(self) -> set[str]:
        if self._from_compacted is None:
            keys: set[str] = set()
            for path in self._compacted:
                meta = self._store.footer(path)
                if meta is not None:
                    keys.update(j["job_key"] for j in compact_index(meta) if j.get("job_status") == Status.OK)
            self._from_compacted = keys
        return self._from_compacted

    def __contains__(self, key: object) -> bool:
        if not isinstance(key, str):
            return False
        if key not in self._known:
            ok = False
            for path in self._by_key.get(key, []):
                meta = self._store.footer(path)
                if meta is not None and meta.get(META_JOB_KEY, b"").decode() == key:
                    ok = ok or meta.get(META_JOB_STATUS, b"").decode() == Status.OK
            self._known[key] = ok or key in self._compacted_keys()
        return self._known[key]

    def _all(self) -> set[str]:
        return {k for k in self._by_key if k in self} | self._compacted_keys()

    def __iter__(self) -> Iterator[str]:
        return iter(sorted(self._all()))

    def __len__(self) -> int:
        return len(self._all())


class ResultStore:
    """The hive-partitioned Parquet dataset under `root`."""

    def __init__(self, root: Path | str) -> None:
        self.root = Path(root)
        self.broken: list[tuple[Path, str]] = []  # files a read skipped, and why (one warning each)

    # ------------------------------------------------------------------------------- places

    @property
    def side(self) -> Path:
        """The side directory: staged writes, fragments set aside, compaction's work (creates the root)."""
        self.root.mkdir(parents=True, exist_ok=True)
        root = self.root.resolve()
        sibling, inside = root.parent / f".{root.name}{SIDE_NAME}", root / SIDE_NAME
        if sibling.is_dir() or inside.is_dir():
            return sibling if sibling.is_dir() else inside
        try:
            same_fs = os.stat(root.parent).st_dev == os.stat(root).st_dev
        except OSError:
            same_fs = False
        return sibling if same_fs and os.access(root.parent, os.W_OK) else inside

    def ensure_writable(self) -> None:
        """Create the root and side directory if needed and prove them writable; an `InputError` otherwise."""
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            for where in (self.root, self.side):
                where.mkdir(parents=True, exist_ok=True)
                fd, probe = tempfile.mkstemp(prefix=".write-probe-", dir=where)
                os.close(fd)
                os.unlink(probe)
        except OSError as exc:
            raise InputError(f"results directory is not writable: {exc.strerror}", where=str(self.root)) from None

    def staging(self) -> Path:
        """Where whole files are written before they are renamed into the dataset."""
        path = self.side / "staging"
        path.mkdir(parents=True, exist_ok=True)
        return path

    def partition_dir(self, *, sweep: str, date: str, device: str) -> Path:
        """The leaf directory of one (sweep, date, device) partition."""
        return self.root / f"sweep={sweep}" / f"date={date}" / f"device={device}"

    def fragment_path(self, *, sweep: str, date: dt.date, device: str, run_id: str, job_key: str) -> Path:
        """Where the fragment of one job goes."""
        leaf = self.partition_dir(sweep=sweep, date=date.isoformat(), device=device)
        return leaf / fragment_name(run_id, job_key)

    @contextlib.contextmanager
    def locked(self, *, exclusive: bool = False) -> Iterator[None]:
        """The store's lock (`flock` on the root directory): writers share it, a partition swap holds it alone."""
        self.root.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
            yield
        finally:
            os.close(fd)  # closing drops the lock

    # ------------------------------------------------------------------------------- writes

    def write(self, table: pa.Table, *, sweep: str, date: dt.date, device: str, run_id: str, job_key: str) -> Path:
        """Store one job's rows (in `SCHEMA`) atomically as a fragment; return its path."""
        path = self.fragment_path(sweep=sweep, date=date, device=device, run_id=run_id, job_key=job_key)
        body = stored_table(table, sweep=sweep, device=device, date=date.isoformat(), run_id=run_id)
        body = body.replace_schema_metadata({**(body.schema.metadata or {}), META_POINTS: points_footer(body)})
        try:
            staged = write_parquet_atomic(body, self.staging() / f"{uuid.uuid4().hex}.parquet")
        except OSError as exc:  # a full disk, a quota: exit 3; every fragment written before stays whole
            raise InfrastructureError(
                f"cannot store job {job_key}'s rows: {exc.strerror or exc}; the jobs stored before are kept, "
                "and the next `orchestrate run` runs the rest",
                where=str(self.root),
            ) from None
        try:
            with self.locked():
                path.parent.mkdir(parents=True, exist_ok=True)
                os.replace(staged, path)
        except BaseException:
            staged.unlink(missing_ok=True)
            raise
        return path

    def set_aside(self, path: Path, reason: str) -> Path:
        """Move a broken file out of the dataset into the side directory (with why); return where it went."""
        rel = path.resolve().relative_to(self.root.resolve())
        target = self.side / "broken" / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        os.replace(path, target)
        target.with_name(target.name + ".why").write_text(reason + "\n")
        return target

    # ------------------------------------------------------------------------------- listing

    def partitions(self, sweep: str | None = None) -> list[tuple[str, str, str, Path]]:
        """`(sweep, date, device, leaf directory)` of every partition (of one sweep), sorted."""
        out = []
        sweeps = [(sweep, self.root / f"sweep={sweep}")] if sweep is not None else _dirs(self.root, "sweep")
        for sweep_name, sweep_dir in sweeps:
            for date, date_dir in _dirs(sweep_dir, "date"):
                for device, leaf in _dirs(date_dir, "device"):
                    out.append((sweep_name, date, device, leaf))
        return out

    def sweep_names(self) -> list[str]:
        """The sweeps with a partition in the store (from the directory names alone)."""
        return [name for name, _ in _dirs(self.root, "sweep")]

    def files(self, sweep: str | None = None) -> list[StoreFile]:
        """Every data file under the root (of one sweep): fragments and compacted files, by path."""
        out = []
        for sweep_name, date, device, leaf in self.partitions(sweep):
            try:
                names = sorted(e.name for e in os.scandir(leaf) if e.name.endswith(".parquet") and e.is_file())
            except FileNotFoundError:
                continue  # swapped away by a compaction this instant; its replacement is listed next time
            out += [StoreFile(leaf / n, sweep_name, date, device) for n in names if not n.startswith(".")]
        return out

    def metadata(self, path: Path) -> pq.FileMetaData | None:
        """A file's Parquet footer, or None (and the file noted in `broken`) when it is unreadable."""
        import pyarrow.parquet as pq  # loaded on the first footer read, not by a command that only lists

        try:
            return pq.read_metadata(path)
        except (OSError, pa.ArrowException) as exc:
            self.note_broken(path, str(exc).splitlines()[0])
            return None

    def footer(self, path: Path) -> dict[bytes, bytes] | None:
        """A file's footer key-value metadata, or None when it is unreadable (see `metadata`)."""
        md = self.metadata(path)
        return None if md is None else dict(md.metadata or {})

    def note_broken(self, path: Path, reason: str) -> None:
        """Remember a file a read had to skip (listed once in `broken`)."""
        if all(p != path for p, _ in self.broken):
            self.broken.append((path, reason))

    def compacted_names(self, leaf: Path) -> set[str]:
        """The fragment names the compacted files of one partition hold."""
        names: set[str] = set()
        for path in leaf.glob(f"{COMPACT_PREFIX}*.parquet"):
            meta = self.footer(path)
            if meta is not None:
                names.update(j.get("file", "") for j in compact_index(meta))
        return names

    def fragments(self) -> list[Fragment]:
        """Every stored job with its footer facts (a compacted job's from its file's index).

        Unreadable files are listed in `broken`.
        """
        self.broken = []
        out: list[Fragment] = []
        for f in self.files():
            md = self.metadata(f.path)
            if md is None:
                continue
            meta = dict(md.metadata or {})
            try:
                version = fragment_version(meta)
            except SchemaVersionError as exc:
                self.note_broken(f.path, str(exc))
                continue
            if f.compacted:
                for job in compact_index(meta):
                    facts = {f"orchestrate.{k}".encode(): v.encode() for k, v in job.items()}
                    out.append(
                        Fragment(
                            f.path.parent / job.get("file", ""),
                            f.sweep,
                            f.date,
                            f.device,
                            job.get("job_key", ""),
                            job.get("job_status", ""),
                            version,
                            int(job.get("num_rows", 0)),
                            f.path,
                            facts,
                        )
                    )
                continue
            sweep = meta.get(META_SWEEP, f.sweep.encode()).decode()
            device = meta.get(META_DEVICE, f.device.encode()).decode()
            out.append(
                Fragment(
                    f.path,
                    sweep,
                    f.date,
                    device,
                    meta.get(META_JOB_KEY, b"").decode(),
                    meta.get(META_JOB_STATUS, b"").decode(),
                    version,
                    md.num_rows,
                    f.path,
                    meta,
                )
            )
        return out

    def run_ids(self, sweep: str | None = None) -> set[str]:
        """The runs with a stored job (of one sweep): from fragment names and compacted files' indexes."""
        runs: set[str] = set()
        for f in self.files(sweep):
            if f.compacted:
                meta = self.footer(f.path)
                runs.update(j.get("run_id", "") for j in compact_index(meta or {}))
            elif (parsed := parse_fragment_name(f.path.name)) is not None:
                runs.add(parsed[0])
        return runs - {""}

    def complete_job_keys(self, sweep: str | None = None) -> JobIndex:
        """Job keys with a stored job that finished ok (resume skips these); a lazy set."""
        return JobIndex(self, sweep)

    def fragment_files(self, sweep: str | None = None) -> list[Path]:
        """Paths of the data files with a readable footer (fragments and compacted files); others go to `broken`."""
        return [f.path for f in self.files(sweep=sweep) if self.metadata(f.path) is not None]
