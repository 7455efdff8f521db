"""Fragments written elsewhere (another host, a worker's spool, another store) brought into the store.

A fragment from outside names its own sweep, device, run, date and job key, and those become the
path it is stored under: `check_fragment` refuses any that is not a safe name, so a fragment from
a compromised host or a handed-over file can never write outside the store or into another job's
place; `import_fragment` then stores it like a fragment the run wrote itself.
"""

from __future__ import annotations

import datetime as dt
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from orchestrator.errors import InputError
from orchestrator.specs.names import NAME_RE
from orchestrator.store.fragments import ResultStore
from workers.contract import META_DATE, META_JOB_KEY, SchemaVersionError, restored_table


def check_fragment(store: ResultStore, source: Path) -> tuple[pa.Table, Path]:
    """Read a fragment written elsewhere and say where it would go, refusing what is unsafe.

    The fragment's rows come back in `SCHEMA`, whatever schema version wrote them (a version-2
    body takes its `sweep` and `device` from its footer). The destination is built from the
    fragment's own `sweep`, `device`, `run_id`, date and job key, so each must pass the sweep
    loader's name rule (`orchestrator.specs.names.NAME_RE`: no `/`, no `..`), the date must be a
    date, and every row must carry the same values: a fragment from a compromised host or a
    handed-over file can never write outside the store or into another job's place.

    Raises:
        InputError: not a readable fragment, a newer schema, or a value that is not a safe name
            (naming it).
    """
    try:
        table = pq.read_table(source)
    except (OSError, pa.ArrowException) as exc:
        raise InputError(f"not a readable Parquet fragment: {str(exc).splitlines()[0]}", where=str(source)) from None
    meta = table.schema.metadata or {}
    if table.num_rows == 0 or META_JOB_KEY not in meta:
        raise InputError("not an orchestrate result fragment", where=str(source))
    for column in ("run_id", "job_key"):  # in every schema's body (sweep and device may be in the footer)
        if column not in table.column_names:
            raise InputError(f"not an orchestrate result fragment (no column {column!r})", where=str(source))
    try:
        table = restored_table(table)
    except SchemaVersionError as exc:
        raise InputError(str(exc), where=str(source)) from None
    values = {"job key": meta[META_JOB_KEY].decode(errors="replace")}
    for column in ("sweep", "device", "run_id", "job_key"):
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
    stamp = meta.get(META_DATE, b"").decode(errors="replace")
    if stamp:
        try:
            date = dt.date.fromisoformat(stamp)
        except ValueError:
            raise InputError(f"fragment's date {stamp!r} is not a date; refused", where=str(source)) from None
    else:
        started = table.column("started_at")[0].as_py()
        date = (started if isinstance(started, dt.datetime) else dt.datetime.now(dt.UTC)).date()
    dest = store.fragment_path(
        sweep=values["sweep"],
        date=date,
        device=values["device"],
        run_id=values["run_id"],
        job_key=values["job_key"],
    )
    return table, dest


def import_fragment(store: ResultStore, source: Path) -> Path:
    """Copy a fragment written elsewhere (another host, a worker's spool, another store) into the
    store, after `check_fragment`.

    A job already stored under the same run, compacted or not, is not stored twice.
    """
    table, dest = check_fragment(store, source)
    if dest.name in store.compacted_names(dest.parent):
        return dest
    row = table.slice(0, 1).to_pylist()[0]
    date = dt.date.fromisoformat(dest.parent.parent.name.removeprefix("date="))
    return store.write(
        table, sweep=row["sweep"], date=date, device=row["device"], run_id=row["run_id"], job_key=row["job_key"]
    )
