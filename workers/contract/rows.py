"""A job's rows: `RowBuilder` makes them in `SCHEMA`, one measured value per row, with the job's
facts (`JobContext`), and turns them into the Arrow table a worker returns, its status in the footer.
"""

from __future__ import annotations

import datetime as dt
import time
from collections.abc import Sequence
from typing import Any

import pyarrow as pa
from pydantic import BaseModel, ConfigDict, Field

from workers.contract.jobs import ErrorKind, HostFingerprint, JobSpec, Status
from workers.contract.schema import META_ERROR_KIND, META_JOB_KEY, META_JOB_STATUS, SCHEMA, SCHEMA_VERSION, TYPED_PARAMS

Window = tuple[float, float]  # (start, end) in time.monotonic() seconds of this host


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
    # pid -> command and share of a core or the GPU, as the gate saw it when it caught the process
    foreign: dict[int, str] = Field(default_factory=dict)
    gate: str | None = None  # what governs the gate that flagged the job (its inventory knob)
    ignored_processes: list[str] = Field(default_factory=list)  # the host's `ignore_processes`
    commit: str | None = None

    def extra(self) -> dict[str, str]:
        """The contention facts every row of the job carries in `extra`."""
        out = {}
        if self.foreign:
            out["foreign_processes"] = "; ".join(f"pid {pid} ({what})" for pid, what in sorted(self.foreign.items()))
        if self.foreign and self.gate:
            out["contention_gate"] = self.gate
        if self.ignored_processes:
            out["ignored_processes"] = ", ".join(self.ignored_processes)
        return out


class RowBuilder:
    """Makes rows for one job: the common columns once, the measured value per call."""

    def __init__(self, job: JobSpec, fingerprint: HostFingerprint, context: JobContext) -> None:
        self.job = job
        self.fingerprint = fingerprint
        self.context = context
        self.rows: list[dict[str, Any]] = []
        self.windows: list[Window] = []  # when each row's value was measured (see `add`)
        self.error_kind: ErrorKind | None = None  # why the job failed, where `fail_all` was told
        self._mark = time.monotonic()

    def add(
        self,
        arm: str,
        metric: str,
        value: float | None,
        unit: str,
        *,
        sample: int = -1,
        status: Status = Status.OK,
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

    def annotate(self, first: int, by_arm: dict[str, dict[str, str]]) -> None:
        """Add `by_arm[arm]` to the `extra` of every row from index `first` on: what is known only
        once a job's rounds have ended (how its sampling stopped)."""
        for row in self.rows[first:]:
            more = by_arm.get(row["arm"])
            if more:
                row["extra"] = sorted({**dict(row["extra"]), **more}.items())

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

    def fail_all(self, error: str, kind: ErrorKind | None = None) -> None:
        """Replace the rows with one failed row per arm carrying `error` (the job did not run);
        `kind` goes into the table's footer for the head to act on."""
        self.clear()
        self.error_kind = kind
        for arm in self.job.arms:
            self.add(arm, "seconds", None, "seconds", status=Status.FAILED, error=error)

    def table(self, job_status: Status) -> pa.Table:
        """All rows so far as one Arrow table in `SCHEMA`, the job status (and error kind) in its metadata.

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
            if facts := ctx.extra():
                row["extra"] = sorted({**dict(row.get("extra") or []), **facts}.items())
            row["commit"] = row.get("commit") or ctx.commit
        return rows_to_table(self.rows, job_key=self.job.job_key, job_status=job_status, error_kind=self.error_kind)


def rows_to_table(
    rows: list[dict[str, Any]], *, job_key: str, job_status: Status, error_kind: ErrorKind | None = None
) -> pa.Table:
    """Rows (dicts keyed by column) as an Arrow table in `SCHEMA` with the job's metadata."""
    table = pa.Table.from_pylist(rows, schema=SCHEMA)
    meta = dict(SCHEMA.metadata or {})
    meta[META_JOB_KEY] = job_key.encode()
    meta[META_JOB_STATUS] = Status(job_status).value.encode()  # a valid status, or ValueError
    if error_kind is not None:
        meta[META_ERROR_KIND] = ErrorKind(error_kind).value.encode()
    return table.replace_schema_metadata(meta)


def footer_status(table: pa.Table) -> Status:
    """The job status a table's footer states (failed where it states none)."""
    return Status((table.schema.metadata or {}).get(META_JOB_STATUS, Status.FAILED.encode()).decode())


def footer_error_kind(table: pa.Table) -> ErrorKind | None:
    """Why the job of a table failed, where its footer says (`RowBuilder.fail_all`'s kind)."""
    raw = (table.schema.metadata or {}).get(META_ERROR_KIND)
    return ErrorKind(raw.decode()) if raw else None


def failed_job_table(job: JobSpec, fingerprint: HostFingerprint, error: str, kind: ErrorKind | None = None) -> pa.Table:
    """The rows of a job that could not run: one failed row per arm, with the reason."""
    rows = RowBuilder(job, fingerprint, JobContext(started_at=dt.datetime.now(dt.UTC)))
    rows.fail_all(error, kind)
    return rows.table(Status.FAILED)
