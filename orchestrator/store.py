"""The result store: hive-partitioned Parquet that DuckDB, Polars, pandas and Spark read directly.

Layout: `<root>/sweep=<name>/date=<YYYY-MM-DD>/device=<kind>/part-<run>-<job>.parquet`, one
fragment per finished job, written atomically (temp file + rename). Each fragment's footer holds
the schema version, the job key and the job's status, so resume reads footers, not data. A
broken fragment (truncated, not Parquet) is reported and skipped, never fatal to a query.
"""

from __future__ import annotations

import datetime as dt
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from orchestrator.errors import InfrastructureError, InputError
from orchestrator.names import NAME_RE
from workers.contract import META_JOB_KEY, META_JOB_STATUS, META_SCHEMA_VERSION, SCHEMA, STATUS_OK
from workers.files import write_parquet_atomic


@dataclass(frozen=True)
class Fragment:
    """One stored job: its file and what its footer says."""

    path: Path
    sweep: str
    date: str
    device: str
    job_key: str
    job_status: str
    schema_version: int
    num_rows: int


def _partition_values(path: Path) -> dict[str, str]:
    out: dict[str, str] = {}
    for part in path.parts:
        key, sep, value = part.partition("=")
        if sep:
            out[key] = value
    return out


class ResultStore:
    """The hive-partitioned Parquet dataset under `root`."""

    def __init__(self, root: Path | str) -> None:
        self.root = Path(root)
        self.broken: list[tuple[Path, str]] = []

    def ensure_writable(self) -> None:
        """Create the root if needed and prove it writable; an `InputError` otherwise."""
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            fd, probe = tempfile.mkstemp(prefix=".write-probe-", dir=self.root)
            os.close(fd)
            os.unlink(probe)
        except OSError as exc:
            raise InputError(f"results directory is not writable: {exc.strerror}", where=str(self.root)) from None

    def fragment_path(self, *, sweep: str, date: dt.date, device: str, run_id: str, job_key: str) -> Path:
        """Where the fragment of one job goes."""
        return (
            self.root
            / f"sweep={sweep}"
            / f"date={date.isoformat()}"
            / f"device={device}"
            / f"part-{run_id}-{job_key}.parquet"
        )

    def write(self, table: pa.Table, *, sweep: str, date: dt.date, device: str, run_id: str, job_key: str) -> Path:
        """Store one job's rows atomically."""
        path = self.fragment_path(sweep=sweep, date=date, device=device, run_id=run_id, job_key=job_key)
        try:
            return write_parquet_atomic(table, path)
        except OSError as exc:  # a full disk, a quota: exit 3; every fragment written before stays whole
            raise InfrastructureError(
                f"cannot store job {job_key}'s rows: {exc.strerror or exc}; the jobs stored before are kept, "
                "and the next `orchestrate run` runs the rest",
                where=str(self.root),
            ) from None

    def check_fragment(self, source: Path) -> tuple[pa.Table, Path]:
        """Read a fragment written elsewhere and say where it would go, refusing what is unsafe.

        The destination is built from the fragment's own `sweep`, `device`, `run_id` and job key,
        so each must pass the sweep loader's name rule (`orchestrator.names.NAME_RE`: no `/`, no
        `..`), and every row must carry the same values: a fragment from a compromised host or a
        handed-over file can never write outside the store or into another job's place.

        Raises:
            InputError: not a readable fragment, or a value that is not a safe name (naming it).
        """
        try:
            table = pq.read_table(source)
        except (OSError, pa.ArrowException) as exc:
            raise InputError(
                f"not a readable Parquet fragment: {str(exc).splitlines()[0]}", where=str(source)
            ) from None
        meta = table.schema.metadata or {}
        if table.num_rows == 0 or META_JOB_KEY not in meta:
            raise InputError("not an orchestrate result fragment", where=str(source))
        values = {"job key": meta[META_JOB_KEY].decode(errors="replace")}
        for column in ("sweep", "device", "run_id", "job_key"):
            if column not in table.column_names:
                raise InputError(f"not an orchestrate result fragment (no column {column!r})", where=str(source))
            found = set(table.column(column).to_pylist())
            if len(found) != 1:
                shown = ", ".join(sorted(repr(v) for v in found)[:3])
                raise InputError(f"fragment mixes several values of {column} ({shown}); refused", where=str(source))
            values[column] = next(iter(found))
        if values["job_key"] != values["job key"]:
            raise InputError("fragment's rows and footer name different job keys; refused", where=str(source))
        for name, value in values.items():
            if not isinstance(value, str) or not NAME_RE.fullmatch(value):
                raise InputError(
                    f"fragment's {name} {value!r} is not a safe name (letters, digits, '.', '_' or '-'); refused",
                    where=str(source),
                )
        started = table.column("started_at")[0].as_py() if "started_at" in table.column_names else None
        started = started if isinstance(started, dt.datetime) else dt.datetime.now(dt.UTC)
        dest = self.fragment_path(
            sweep=values["sweep"], date=started.date(), device=values["device"], run_id=values["run_id"],
            job_key=values["job_key"],
        )  # fmt: skip
        return table, dest

    def import_fragment(self, source: Path) -> Path:
        """Copy a fragment written elsewhere (another host, a worker's spool) into the store,
        after `check_fragment`."""
        table, dest = self.check_fragment(source)
        return write_parquet_atomic(table, dest)

    def fragments(self) -> list[Fragment]:
        """Every readable fragment; unreadable ones are listed in `self.broken`."""
        self.broken = []
        out: list[Fragment] = []
        if not self.root.is_dir():
            return out
        for path in sorted(self.root.rglob("part-*.parquet")):
            try:
                meta = pq.read_metadata(path)
            except (OSError, pa.ArrowException) as exc:
                self.broken.append((path, str(exc).splitlines()[0]))
                continue
            kv = meta.metadata or {}
            parts = _partition_values(path.relative_to(self.root))
            out.append(
                Fragment(
                    path=path,
                    sweep=parts.get("sweep", ""),
                    date=parts.get("date", ""),
                    device=parts.get("device", ""),
                    job_key=kv.get(META_JOB_KEY, b"").decode(),
                    job_status=kv.get(META_JOB_STATUS, b"").decode(),
                    schema_version=int(kv.get(META_SCHEMA_VERSION, b"0") or 0),
                    num_rows=meta.num_rows,
                )
            )
        return out

    def complete_job_keys(self, sweep: str | None = None) -> set[str]:
        """Job keys with a stored fragment whose job finished ok (resume skips these)."""
        return {
            f.job_key for f in self.fragments() if f.job_status == STATUS_OK and (sweep is None or f.sweep == sweep)
        }

    def read(self, sweep: str | None = None, run: str | None = None) -> pa.Table:
        """All stored rows (of one sweep and/or run), in `SCHEMA`; broken fragments skipped."""
        tables = []
        for frag in self.fragments():
            if sweep is not None and frag.sweep != sweep:
                continue
            if run is not None and f"part-{run}-" not in frag.path.name:
                continue
            try:
                t = pq.read_table(frag.path, schema=SCHEMA)
            except (OSError, pa.ArrowException) as exc:
                self.broken.append((frag.path, str(exc).splitlines()[0]))
                continue
            tables.append(t.replace_schema_metadata(SCHEMA.metadata))
        if not tables:
            return SCHEMA.empty_table()
        return pa.concat_tables(tables)

    def fragment_files(self, sweep: str | None = None) -> list[Path]:
        """Paths of the readable fragments (for DuckDB's `read_parquet`)."""
        return [f.path for f in self.fragments() if sweep is None or f.sweep == sweep]
