"""What the head sends a worker (`JobSpec` and its settings) and the statuses it gets back.

A `JobSpec` goes to a worker as JSON; the host it ran on is described by a `HostFingerprint`.
A row and a job each have a `Status`; a failed job may say why in an `ErrorKind`.
"""

from __future__ import annotations

import hashlib
from enum import StrEnum
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from workers.contract.schema import SCHEMA_VERSION

ParamValue = int | float | str | bool


class Status(StrEnum):
    """A row's status (the `status` column) and a job's (the footer's `META_JOB_STATUS`).

    The values are what the Parquet files hold.
    """

    OK = "ok"
    FAILED = "failed"
    UNSUPPORTED = "unsupported"  # the host or the case cannot run this arm or point
    # A job status only, never a row status: the job ran, but a foreign GPU user was seen during
    # some of its samples (rows flagged `contended`). Such a job is not complete: the next plain
    # run measures it again.
    CONTENDED = "contended"


class ErrorKind(StrEnum):
    """Why a failed job failed, where the head acts on the kind (the footer's `META_ERROR_KIND`)."""

    LOCK_BUSY = "lock_busy"  # the host's GPU lock, or its idle gate, stayed busy past the job's max wait


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
    # process names every gate of the host lets pass (the inventory's `ignore_processes`): a choice
    # the rows record (`extra.ignored_processes`), since their samples may share the host with them
    ignore_processes: list[str] = Field(default_factory=list)


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
            [
                self.hostname,
                self.os,
                self.machine,
                self.cpu,
                str(self.memory_bytes),
                self.gpu or "",
                self.gpu_driver or "",
                self.backend,
                self.mlx_version,
            ]
        )
        if self.gpu_index is not None:  # one fingerprint per GPU of a host with several (unpinned ids unchanged)
            stable += f"|gpu {self.gpu_index} {self.gpu_uuid or ''}"
        return self.model_copy(update={"fingerprint_id": hashlib.sha256(stable.encode()).hexdigest()[:16]})

    @classmethod
    def unknown(cls, backend: str) -> HostFingerprint:
        """For rows of a job whose host was lost before it could say what it is."""
        return cls(
            hostname="unknown",
            os="unknown",
            machine="unknown",
            cpu="unknown",
            cpu_count=0,
            memory_bytes=0,
            mlx_version="unknown",
            mlx_device="unknown",
            backend=backend,
            threads=0,
            fingerprint_id="unknown",
        )
