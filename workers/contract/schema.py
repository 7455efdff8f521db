"""The Arrow schema of the rows a job returns and the footer keys of a stored fragment.

Tidy rows, one measured value per row, in one versioned schema, `SCHEMA`. The schema version is
written into every Parquet file's footer (`META_SCHEMA_VERSION`); a change to the columns bumps
`SCHEMA_VERSION`. A stored fragment leaves its hive partition columns out of its body and keeps
them in its footer (`stored_table`); `restored_table` reads any readable version back into `SCHEMA`.
"""

from __future__ import annotations

import pyarrow as pa

SCHEMA_VERSION = 2
OLDEST_READABLE_VERSION = 1  # version-1 fragments are read (and migrated by `orchestrate compact`)

# Parameters that get a typed column of their own; every parameter is also in the `params` map.
TYPED_PARAMS: dict[str, pa.DataType] = {
    "tokens": pa.int64(),
    "n": pa.int64(),
    "k": pa.int64(),
    "dtype": pa.string(),
    "experts": pa.int64(),
    "top_k": pa.int64(),
    "hidden": pa.int64(),
    "expert_width": pa.int64(),
    "prompt_tokens": pa.int64(),
    "checkpoint": pa.string(),
}

# Footer keys (Parquet key-value metadata) of a fragment; every key starts with META_PREFIX.
META_PREFIX = b"orchestrate."
META_SCHEMA_VERSION = META_PREFIX + b"schema_version"
META_JOB_KEY = META_PREFIX + b"job_key"
META_JOB_STATUS = META_PREFIX + b"job_status"
META_JOB_SECONDS = META_PREFIX + b"job_seconds"  # the worker's wall time for the whole job
META_PHASES = META_PREFIX + b"phases"  # JSON: seconds per phase of the job (workers.job.phases)
# Where a stored fragment belongs (its hive partition values and run), kept in the footer.
META_SWEEP = META_PREFIX + b"sweep"
META_DEVICE = META_PREFIX + b"device"
META_DATE = META_PREFIX + b"date"
META_RUN_ID = META_PREFIX + b"run_id"
# A compacted file's index: JSON list of every job it holds, each with its fragment's footer facts.
META_JOBS = META_PREFIX + b"jobs"
# Why a failed job failed, where the head acts on the kind (`ErrorKind`); absent otherwise.
META_ERROR_KIND = META_PREFIX + b"error_kind"
# The sweep the run ran, as loaded after its edits (canonical JSON of the head's validated spec),
# its digest and the file it came from: written by the head on every fragment of the run, so the
# run is judged by what it ran, whatever the file of that name says later (and compaction's index
# and `import` carry them as they carry every job's footer keys).
META_SWEEP_DEFINITION = META_PREFIX + b"sweep_definition"
META_SWEEP_DIGEST = META_PREFIX + b"sweep_digest"
META_SWEEP_SOURCE = META_PREFIX + b"sweep_source"

SCHEMA = pa.schema(
    [
        pa.field("schema_version", pa.int32(), nullable=False),
        pa.field("run_id", pa.string(), nullable=False),
        pa.field("sweep", pa.string(), nullable=False),
        pa.field("job_key", pa.string(), nullable=False),
        pa.field("case", pa.string(), nullable=False),
        pa.field("case_name", pa.string(), nullable=False),
        pa.field("arm", pa.string(), nullable=False),
        pa.field("device", pa.string(), nullable=False),
        pa.field("backend", pa.string()),
        pa.field("host", pa.string()),
        *[pa.field(name, dtype) for name, dtype in TYPED_PARAMS.items()],
        pa.field("params", pa.map_(pa.string(), pa.string())),
        pa.field("metric", pa.string(), nullable=False),
        pa.field("value", pa.float64()),
        pa.field("unit", pa.string()),
        pa.field("sample", pa.int32()),  # -1 for once-per-arm metrics (rel_error, peak memory)
        pa.field("status", pa.string(), nullable=False),
        pa.field("contended", pa.bool_()),
        pa.field("error", pa.string()),
        pa.field("started_at", pa.timestamp("us", tz="UTC")),
        pa.field("lock_wait_s", pa.float64()),
        pa.field("lock_attempts", pa.int32()),
        pa.field("contention_samples", pa.int32()),
        pa.field("foreign_pids", pa.list_(pa.int64())),
        pa.field("env", pa.map_(pa.string(), pa.string())),
        pa.field("mlx_version", pa.string()),
        pa.field("code_version", pa.string()),
        pa.field("route", pa.string()),  # which implementation an arm really took
        pa.field("commit", pa.string()),  # external code's commit (command cases)
        pa.field("flops", pa.float64()),
        pa.field("bytes_moved", pa.float64()),
        pa.field("peak_copy_gb_s", pa.float64()),
        pa.field("peak_tflop_s", pa.float64()),
        pa.field("hostname", pa.string()),
        pa.field("os", pa.string()),
        pa.field("cpu", pa.string()),
        pa.field("cpu_count", pa.int32()),
        pa.field("memory_bytes", pa.int64()),
        pa.field("gpu", pa.string()),
        pa.field("gpu_driver", pa.string()),
        pa.field("gpu_index", pa.int32()),  # the job's GPU on a host with several (`gpus` in the inventory)
        pa.field("gpu_uuid", pa.string()),
        pa.field("mlx_device", pa.string()),
        pa.field("blas", pa.string()),
        pa.field("threads", pa.int32()),
        pa.field("fingerprint_id", pa.string()),
        pa.field("extra", pa.map_(pa.string(), pa.string())),
    ],
    metadata={META_SCHEMA_VERSION: str(SCHEMA_VERSION).encode()},
)

# The hive partition columns: in the path (and footer) of a stored fragment, not in its body.
PARTITION_COLUMNS = ("sweep", "device")
STORED_SCHEMA = pa.schema(
    [f for f in SCHEMA if f.name not in PARTITION_COLUMNS], metadata={META_SCHEMA_VERSION: str(SCHEMA_VERSION).encode()}
)


class SchemaVersionError(ValueError):
    """A fragment written by a newer orchestrate (or with no readable version)."""


def fragment_version(meta: dict[bytes, bytes] | None) -> int:
    """The schema version a fragment's footer states (1 when absent: the first files had it, too)."""
    raw = (meta or {}).get(META_SCHEMA_VERSION, b"1")
    try:
        return int(raw)
    except ValueError:
        raise SchemaVersionError(f"unreadable schema version {raw!r}") from None


def check_readable(version: int) -> None:
    """Refuse a schema this code does not know.

    Raises:
        SchemaVersionError: `version` is newer than `SCHEMA_VERSION` or older than the oldest read.
    """
    if version > SCHEMA_VERSION:
        raise SchemaVersionError(
            f"schema version {version} is newer than this orchestrate reads ({SCHEMA_VERSION}): upgrade orchestrate"
        )
    if version < OLDEST_READABLE_VERSION:
        raise SchemaVersionError(f"schema version {version} is older than any this orchestrate reads")


def stored_table(table: pa.Table, *, sweep: str, device: str, date: str, run_id: str) -> pa.Table:
    """`table` (in `SCHEMA`) as a stored fragment's body: no partition columns, where it belongs in the footer."""
    meta = dict(table.schema.metadata or {})
    meta.update(
        {
            META_SCHEMA_VERSION: str(SCHEMA_VERSION).encode(),
            META_SWEEP: sweep.encode(),
            META_DEVICE: device.encode(),
            META_DATE: date.encode(),
            META_RUN_ID: run_id.encode(),
        }
    )
    body = table.drop_columns([c for c in PARTITION_COLUMNS if c in table.column_names])
    body = body.cast(pa.schema([STORED_SCHEMA.field(n) for n in body.column_names]))
    return body.select(STORED_SCHEMA.names).replace_schema_metadata(meta)


def restored_table(body: pa.Table, *, sweep: str | None = None, device: str | None = None) -> pa.Table:
    """A fragment's rows in `SCHEMA`, whatever version wrote them; the footer's metadata is kept.

    A version-1 body carries `sweep` and `device` itself; a version-2 body takes them from the
    arguments, else from its footer.

    Raises:
        SchemaVersionError: a newer schema, or a version-2 body that does not say where it belongs.
    """
    meta = dict(body.schema.metadata or {})
    check_readable(fragment_version(meta))
    given = {"sweep": sweep, "device": device}
    keys = {"sweep": META_SWEEP, "device": META_DEVICE}
    for name in PARTITION_COLUMNS:
        if name in body.column_names:
            continue
        value = given[name] or meta.get(keys[name], b"").decode()
        if not value:
            raise SchemaVersionError(f"the fragment has no {name!r} column and its footer names none")
        body = body.append_column(name, pa.array([value] * body.num_rows, pa.string()))
    missing = [f for f in SCHEMA if f.name not in body.column_names]
    for f in missing:  # a column added after the fragment was written (new columns are nullable)
        body = body.append_column(f.name, pa.nulls(body.num_rows, f.type))
    return body.select(SCHEMA.names).cast(SCHEMA).replace_schema_metadata(meta)
