"""The job/record contract between the head and the workers.

A `JobSpec` goes to a worker as JSON; the worker answers with tidy rows (one measured value per
row) in one versioned Arrow schema, `SCHEMA`. The schema version is written into every Parquet
file's metadata (`orchestrate.schema_version`); a change to the columns bumps `SCHEMA_VERSION`.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import time
from collections.abc import Sequence
from typing import Any

import pyarrow as pa
from pydantic import BaseModel, ConfigDict, Field

SCHEMA_VERSION = 2
OLDEST_READABLE_VERSION = 1  # version-1 fragments are read (and migrated by `orchestrate compact`)

ParamValue = int | float | str | bool

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

STATUS_OK = "ok"
STATUS_FAILED = "failed"
STATUS_UNSUPPORTED = "unsupported"
# A job status only (the fragment footer's `orchestrate.job_status`), never a row status: the job
# ran, but a foreign GPU user was seen during some of its samples (rows flagged `contended`). Such
# a job is not complete: the next plain run measures it again.
STATUS_CONTENDED = "contended"

Window = tuple[float, float]  # (start, end) in time.monotonic() seconds of this host


class LockSettings(BaseModel):
    """How a job takes the host's guarded GPU lock (see `workers.lock.gpu`)."""

    model_config = ConfigDict(extra="forbid")

    path: str = "/tmp/orchestrate-gpu.lock"
    max_wait: float = Field(default=0.0, ge=0)  # seconds; 0 = no limit
    idle_secs: float = Field(default=0.0, ge=0)  # quiet time required before a job starts
    max_attempts: int = Field(default=2, ge=1)  # measurements of a contended job
    enabled: bool = True
    kfd_proc: str = "/sys/class/kfd/kfd/proc"
    cpu_busy_threshold: float = Field(default=50.0, ge=0)  # percent of one core, CPU/Metal gate


class GpuPin(BaseModel):
    """The one GPU a job runs on, on a host with several (`gpus` in the inventory; `workers.host.gpus`).

    `index` is the backend tool's (nvidia-smi's, PCI order; ROCm: KFD topology order), `uuid` the
    driver's (None where there is none: Metal).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    index: int = Field(ge=0)
    uuid: str | None = None


class JobSpec(BaseModel):
    """One job: one case at one parameter point, all its arms, on one device kind."""

    model_config = ConfigDict(extra="forbid")

    schema_version: int = SCHEMA_VERSION
    run_id: str
    sweep: str
    job_key: str
    case: str  # the case kind: qmm, moe-gather, command, model, mlp, ...
    case_name: str  # the case's name within the sweep (defaults to `case`)
    params: dict[str, ParamValue]
    arms: list[str]
    arm_env: dict[str, dict[str, str]] = Field(default_factory=dict)
    options: dict[str, Any] = Field(default_factory=dict)  # case-specific settings
    device: str
    backend: str = "cpu"
    host: str = "local"
    repetitions: int = Field(ge=1)
    warmup: int = Field(ge=0)
    seed: int = 0
    code_version: str = "unknown"
    lock: LockSettings = Field(default_factory=LockSettings)
    spool_dir: str | None = None
    gpu: GpuPin | None = None  # set on the worker from its node's labels (`workers.job.task.localise`)


class HostFingerprint(BaseModel):
    """What a number was measured on. `fingerprint_id` hashes the stable fields."""

    model_config = ConfigDict(extra="forbid")

    hostname: str
    os: str
    machine: str
    cpu: str
    cpu_count: int
    memory_bytes: int
    gpu: str | None = None
    gpu_driver: str | None = None
    mlx_version: str
    mlx_device: str  # MLX's default device, e.g. "Device(gpu, 0)"
    backend: str  # cpu, cuda, metal, rocm: what MLX really runs on
    blas: str | None = None
    threads: int
    fingerprint_id: str
    gpu_index: int | None = None  # the job's GPU on a host with several (else None)
    gpu_uuid: str | None = None

    def with_id(self) -> HostFingerprint:
        """This fingerprint with `fingerprint_id` hashed from everything a number depends on
        besides the code: host name, OS release, hardware, GPU and driver, backend, MLX version
        (a new driver, kernel, OS or MLX, another machine, another GPU of a host with several:
        another fingerprint; peaks are probed again and the history reports the change as such)."""
        stable = "|".join(
            [self.hostname, self.os, self.machine, self.cpu, str(self.memory_bytes), self.gpu or "",
             self.gpu_driver or "", self.backend, self.mlx_version]
        )  # fmt: skip
        if self.gpu_index is not None:  # one fingerprint per GPU of a host with several (unpinned ids unchanged)
            stable += f"|gpu {self.gpu_index} {self.gpu_uuid or ''}"
        return self.model_copy(update={"fingerprint_id": hashlib.sha256(stable.encode()).hexdigest()[:16]})

    @classmethod
    def unknown(cls, backend: str) -> HostFingerprint:
        """For rows of a job whose host was lost before it could say what it is."""
        return cls(
            hostname="unknown", os="unknown", machine="unknown", cpu="unknown", cpu_count=0, memory_bytes=0,
            mlx_version="unknown", mlx_device="unknown", backend=backend, threads=0, fingerprint_id="unknown",
        )  # fmt: skip


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
    metadata={"orchestrate.schema_version": str(SCHEMA_VERSION)},
)

META_SCHEMA_VERSION = b"orchestrate.schema_version"
META_JOB_KEY = b"orchestrate.job_key"
META_JOB_STATUS = b"orchestrate.job_status"
META_JOB_SECONDS = b"orchestrate.job_seconds"  # the worker's wall time for the whole job
META_PHASES = b"orchestrate.phases"  # JSON: seconds per phase of the job (workers.job.phases)
# Where a stored fragment belongs (its hive partition values and run), kept in the footer.
META_SWEEP = b"orchestrate.sweep"
META_DEVICE = b"orchestrate.device"
META_DATE = b"orchestrate.date"
META_RUN_ID = b"orchestrate.run_id"
# A compacted file's index: JSON list of every job it holds, each with its fragment's footer facts.
META_JOBS = b"orchestrate.jobs"

# The hive partition columns: in the path (and footer) of a stored fragment, not in its body.
PARTITION_COLUMNS = ("sweep", "device")
STORED_SCHEMA = pa.schema(
    [f for f in SCHEMA if f.name not in PARTITION_COLUMNS], metadata={"orchestrate.schema_version": str(SCHEMA_VERSION)}
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


class JobContext(BaseModel):
    """Per-job facts copied into every row: lock outcome, route, commit."""

    model_config = ConfigDict(extra="forbid")

    started_at: dt.datetime
    lock_wait_s: float = 0.0
    lock_attempts: int = 1
    contention_samples: int = 0
    contended: bool = False  # some sample of the job's last measurement was contended
    contended_samples: int = 0
    samples: int = 0
    foreign_pids: list[int] = Field(default_factory=list)
    commit: str | None = None


class RowBuilder:
    """Makes rows for one job: the common columns once, the measured value per call."""

    def __init__(self, job: JobSpec, fingerprint: HostFingerprint, context: JobContext) -> None:
        self.job = job
        self.fingerprint = fingerprint
        self.context = context
        self.rows: list[dict[str, Any]] = []
        self.windows: list[Window] = []  # when each row's value was measured (see `add`)
        self._mark = time.monotonic()

    def add(
        self,
        arm: str,
        metric: str,
        value: float | None,
        unit: str,
        *,
        sample: int = -1,
        status: str = STATUS_OK,
        error: str | None = None,
        route: str | None = None,
        flops: float | None = None,
        bytes_moved: float | None = None,
        extra: dict[str, str] | None = None,
        window: Window | None = None,
        commit: str | None = None,
    ) -> None:
        """Append one row: one measured value of one arm.

        `window` is when the value was measured (monotonic seconds); by default, the time since
        the previous row was added, which covers a sample measured just before its rows are added.
        `commit` is the commit of the code it ran (one side of a commit comparison), else the job's.
        """
        now = time.monotonic()
        self.windows.append(window or (self._mark, now))
        self._mark = now
        job, fp = self.job, self.fingerprint
        row: dict[str, Any] = {
            "schema_version": SCHEMA_VERSION,
            "run_id": job.run_id,
            "sweep": job.sweep,
            "job_key": job.job_key,
            "case": job.case,
            "case_name": job.case_name,
            "arm": arm,
            "device": job.device,
            "backend": fp.backend,
            "host": job.host,
            "params": [(k, str(v)) for k, v in sorted(job.params.items())],
            "metric": metric,
            "value": None if value is None else float(value),
            "unit": unit,
            "sample": sample,
            "status": status,
            "contended": False,
            "error": error,
            "env": sorted(job.arm_env.get(arm, {}).items()),
            "mlx_version": fp.mlx_version,
            "code_version": job.code_version,
            "route": route,
            "commit": commit,
            "flops": flops,
            "bytes_moved": bytes_moved,
            "peak_copy_gb_s": None,
            "peak_tflop_s": None,
            "hostname": fp.hostname,
            "os": fp.os,
            "cpu": fp.cpu,
            "cpu_count": fp.cpu_count,
            "memory_bytes": fp.memory_bytes,
            "gpu": fp.gpu,
            "gpu_driver": fp.gpu_driver,
            "gpu_index": fp.gpu_index,
            "gpu_uuid": fp.gpu_uuid,
            "mlx_device": fp.mlx_device,
            "blas": fp.blas,
            "threads": fp.threads,
            "fingerprint_id": fp.fingerprint_id,
            "extra": sorted((extra or {}).items()),
        }
        for name in TYPED_PARAMS:
            raw = job.params.get(name)
            row[name] = raw
        self.rows.append(row)

    def clear(self) -> None:
        """Drop every row (a measurement about to be repeated)."""
        self.rows.clear()
        self.windows.clear()
        self._mark = time.monotonic()

    def apply_contention(self, busy: Sequence[Window]) -> tuple[int, int]:
        """Flag the rows measured while a foreign GPU user was seen; return (contended, all) samples.

        A sample (one arm's repetition: every row with that arm and `sample` >= 0) is contended
        when the span of its rows' windows overlaps any busy window; a once-per-arm row
        (`sample` = -1) by its own window.
        """
        spans: dict[tuple[str, int], Window] = {}
        for row, (start, end) in zip(self.rows, self.windows, strict=True):
            if row["sample"] is not None and row["sample"] >= 0:
                key = (row["arm"], row["sample"])
                lo, hi = spans.get(key, (start, end))
                spans[key] = (min(lo, start), max(hi, end))

        def hit(window: Window) -> bool:
            return any(b0 <= window[1] and window[0] <= b1 for b0, b1 in busy)

        flagged = {key for key, span in spans.items() if hit(span)}
        for row, window in zip(self.rows, self.windows, strict=True):
            sample = row["sample"]
            row["contended"] = (row["arm"], sample) in flagged if sample is not None and sample >= 0 else hit(window)
        return len(flagged), len(spans)

    def fail_all(self, error: str) -> None:
        """Replace the rows with one failed row per arm carrying `error` (the job did not run)."""
        self.clear()
        for arm in self.job.arms:
            self.add(arm, "seconds", None, "seconds", status=STATUS_FAILED, error=error)

    def table(self, job_status: str) -> pa.Table:
        """All rows so far as one Arrow table in `SCHEMA`, the job status in its metadata.

        The job-level facts (lock wait, attempts, contention, commit) are taken from the context
        now, at the end of the job, when they are known; a row's own commit (one side of a commit
        comparison) wins over the job's.
        """
        ctx = self.context
        for row in self.rows:
            row["started_at"] = ctx.started_at
            row["lock_wait_s"] = ctx.lock_wait_s
            row["lock_attempts"] = ctx.lock_attempts
            row["contention_samples"] = ctx.contention_samples
            row["foreign_pids"] = list(ctx.foreign_pids)
            row["commit"] = row.get("commit") or ctx.commit
        return rows_to_table(self.rows, job_key=self.job.job_key, job_status=job_status)


def rows_to_table(rows: list[dict[str, Any]], *, job_key: str, job_status: str) -> pa.Table:
    """Rows (dicts keyed by column) as an Arrow table in `SCHEMA` with the job's metadata."""
    table = pa.Table.from_pylist(rows, schema=SCHEMA)
    meta = dict(SCHEMA.metadata or {})
    meta[META_JOB_KEY] = job_key.encode()
    meta[META_JOB_STATUS] = job_status.encode()
    return table.replace_schema_metadata(meta)


def failed_job_table(job: JobSpec, fingerprint: HostFingerprint, error: str) -> pa.Table:
    """The rows of a job that could not run: one failed row per arm, with the reason."""
    rows = RowBuilder(job, fingerprint, JobContext(started_at=dt.datetime.now(dt.UTC)))
    rows.fail_all(error)
    return rows.table(STATUS_FAILED)
