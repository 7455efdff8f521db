"""The Ray executor: one Ray task per job, scheduled by device kind.

Each worker node carries the labels `device-kind`, `backend` and `host` and offers exactly one
`gpu_slot`, so Ray runs one GPU job per node at a time and only on nodes of the job's kind. A host
with several GPUs (`gpus` in the inventory) is one node per GPU, labelled `gpu-index` too: Ray
spreads a sweep's jobs over every GPU of every host of the kind, and the task pins its job to its
node's GPU (`workers.job.task`). With an embedded inventory, Ray is started here
(`ray.init(address="local", ...)`, plus a node per further GPU: `orchestrator.cluster.embedded`) with this
machine's labels from `inventories/local.toml`.

A job whose node (a host, or one GPU's node) or worker process is lost mid-job is retried by Ray
(`max_retries`) on a live node of its kind: another GPU when its node is gone; any free slot,
which may be the same GPU, when only its worker process died. Its finished rows are never lost:
each job's rows are stored as it finishes, and a rerun skips the stored jobs.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import sys
import threading
from collections.abc import Callable, Iterable, Iterator
from types import FrameType
from typing import Any

import pyarrow as pa

from orchestrator.cluster.embedded import NODE_CPUS, GpuNodes, local_gpus, node_labels
from orchestrator.cluster.head import connect_env, require_head
from orchestrator.cluster.token import ensure_token, use_token
from orchestrator.errors import InfrastructureError
from orchestrator.specs.sweep import InventorySpec
from workers.contract import HostFingerprint, JobSpec, failed_job_table
from workers.host.gpus import GPU_SLOTS_ENV, GpuInfo
from workers.job.task import execute_job

OnDone = Callable[[JobSpec, pa.Table], None]
LIVENESS_POLL_S = 1.0  # how often a waiting sweep checks for a signal and that each pending job's kind has a node


class Interrupted(Exception):
    """SIGINT or SIGTERM reached the head while a sweep ran; `signum` says which."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"signal {signum}")
        self.signum = signum


class _StopOnSignal:
    """While a sweep runs: the first SIGINT or SIGTERM asks the run to stop (`stopping`), which the
    run loop turns into `Interrupted` at its next poll; later ones are ignored. (Raising from the
    handler itself would surface inside Ray's C++ `wait` as a SystemError.) Installed after
    `ray.init`, so it also replaces the stack-dumping handler Ray's core worker puts on SIGTERM."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self) -> None:
        self._saved: dict[int, Any] = {}
        self.stopping: int | None = None

    def install(self) -> None:
        if threading.current_thread() is threading.main_thread():
            self._saved = {sig: signal.signal(sig, self._handle) for sig in self.SIGNALS}

    def restore(self) -> None:
        for sig, handler in self._saved.items():
            signal.signal(sig, handler)
        self._saved = {}

    def check(self) -> None:
        """Raise `Interrupted` once a signal came."""
        if self.stopping is not None:
            raise Interrupted(self.stopping)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.stopping is None:
            self.stopping = signum


def lost_job_table(job: JobSpec, error: str) -> pa.Table:
    """Failed rows for a job whose host or worker was lost (no host fingerprint is known)."""
    return failed_job_table(job, HostFingerprint.unknown(job.backend), error)


@contextlib.contextmanager
def _stderr_silenced() -> Iterator[None]:
    """File descriptor 2 on /dev/null for the block (C++ threads write to it, not to sys.stderr)."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "wb") as null:
            os.dup2(null.fileno(), 2)
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)


class RayExecutor:
    """Runs jobs as Ray tasks on the inventory's cluster (or an embedded local instance)."""

    def __init__(
        self,
        inventory: InventorySpec,
        *,
        job_timeout: float | None = None,
        gpus: list[GpuInfo] | None = None,
    ) -> None:
        """`gpus`: the embedded host's GPUs when the caller resolved them already (`local_gpus`)."""
        self.inventory = inventory
        self.job_timeout = job_timeout
        self._gpus = gpus
        self._nodes = GpuNodes()
        self._started = False
        self._signals = _StopOnSignal()
        self._stopping: threading.Thread | None = None

    def __enter__(self) -> RayExecutor:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def start(self) -> None:
        """Start the embedded Ray instance, or connect to the inventory's head."""
        loaded = sys.modules.get("ray")
        if loaded is not None and loaded.is_initialized():
            self._started = False
            return
        host = self.inventory.hosts[0]
        gpus: list[GpuInfo] = []
        if self.inventory.embedded:
            gpus = local_gpus(self.inventory) if self._gpus is None else self._gpus
            if gpus:  # the node Ray starts here inherits it: its jobs share the cores with the others'
                os.environ[GPU_SLOTS_ENV] = str(len(gpus))
        # Ray: imported when a sweep's jobs start, not by the commands that only plan or read
        import ray
        from ray.exceptions import RayError

        common: dict[str, Any] = {"logging_level": "ERROR", "log_to_driver": False, "configure_logging": True}
        try:
            if self.inventory.embedded:
                # Ray's node processes inherit this: the probes on this host know them as ours
                os.environ["ORCHESTRATE_HEAD_PID"] = str(os.getpid())
                use_token(ensure_token())  # ours (0600) before Ray makes one; token auth whatever RAY_AUTH_MODE says
                context = ray.init(
                    address="local",
                    labels=node_labels(host, gpus[0] if gpus else None),
                    resources={"gpu_slot": 1},
                    num_cpus=NODE_CPUS,  # one Python worker started ahead: the one the slot needs
                    include_dashboard=False,
                    **common,
                )
                self._started = True
                if len(gpus) > 1:
                    self._nodes.start(host, gpus[1:], context.address_info)  # type: ignore[attr-defined]
            else:
                head = self.inventory.head
                require_head(self.inventory)  # and, when it runs here, that it is our head
                connect_env(self.inventory)  # the head's token (`orchestrate cluster up` made it), TLS
                ray.init(address=f"{head.address}:{head.ray_port}", **common)
        except (ConnectionError, RuntimeError, ValueError, RayError) as exc:
            self.shutdown()
            hint = "" if self.inventory.embedded else " (is the cluster up? `orchestrate cluster up --inventory ...`)"
            raise InfrastructureError(f"cannot start or reach Ray: {exc}{hint}") from None
        except InfrastructureError:
            self.shutdown()  # an extra GPU node that did not join: stop what did start
            raise
        self._started = True
        self._signals.install()

    def shutdown(self, *, wait: bool = True, quiet: bool = False) -> None:
        """Stop what `start` started (an embedded instance, or our connection to the head).

        Ending the driver ends its tasks: Ray kills the worker processes running them, and with
        each its fork server and job processes (they die with their parent), so no job outlives
        the run and every GPU lock is free.

        Args:
            wait: False: our signal handlers go now, and Ray stops in a thread of its own (its
                autoscaler monitor's exit takes a second or more) while the caller reports the
                stored rows; `wait_stopped` joins it. Only once every job
                has ended: the processes it stops run no job then.
            quiet: the run stops on an error of its own: Ray's C++ core, which writes to the
                process's stderr, is silenced while it stops. It reports the tasks it abandons,
                which says nothing to the user, and the run's one-line error must stay one line.
        """
        self._signals.restore()  # in this thread: Python sets handlers in the main thread only
        if wait:
            with _stderr_silenced() if quiet else contextlib.nullcontext():
                self._stop()
            return
        self._stopping = threading.Thread(target=self._stop, name="ray-shutdown")  # not a daemon: exit waits
        self._stopping.start()

    def wait_stopped(self) -> None:
        """Return once a `shutdown(wait=False)` has stopped Ray (at once when none is under way)."""
        if self._stopping is not None:
            self._stopping.join()
            self._stopping = None

    def _stop(self) -> None:
        import ray  # Ray: as in start

        try:
            self._nodes.stop()  # before the instance they joined: they stop in about a second then
            if self._started and ray.is_initialized():
                ray.shutdown()
        finally:
            self._started = False

    def live_kinds(self) -> set[str]:
        """Device kinds with at least one live node offering a GPU slot."""
        import ray  # Ray: as in start

        kinds: set[str] = set()
        for node in ray.nodes():
            if node.get("Alive") and node.get("Resources", {}).get("gpu_slot"):
                kind = (node.get("Labels") or {}).get("device-kind")
                if kind:
                    kinds.add(kind)
        return kinds

    def check_kinds(self, kinds: Iterable[str]) -> None:
        """Refuse, before anything runs, a sweep whose device kind has no live node."""
        live = self.live_kinds()
        missing = sorted(set(kinds) - live)
        if missing:
            have = ", ".join(sorted(live)) or "none"
            raise InfrastructureError(
                f"no live Ray node of device kind {missing[0]!r} (live kinds: {have}); "
                "start its hosts with `orchestrate cluster up`"
            )

    def run(self, jobs: list[JobSpec], on_done: OnDone) -> None:
        """Submit every job, call `on_done(job, rows)` as each finishes (in completion order)."""
        # Ray: as in start
        import ray
        from ray.exceptions import RayError

        remote = ray.remote(execute_job)
        head = f"{socket.gethostname()}:{os.getpid()}"  # the jobs' probes know this process as ours
        pending: dict[Any, JobSpec] = {}
        for job in jobs:
            ref = remote.options(
                label_selector={"device-kind": job.device},
                resources={"gpu_slot": 1},
                num_cpus=0,
                max_retries=3,  # a lost node: Ray retries on another live node of the same kind
                name=f"{job.case_name}:{job.job_key}",
            ).remote(job.model_dump_json(), self.job_timeout, head)
            pending[ref] = job
        while pending:
            self._signals.check()
            done, _ = ray.wait(list(pending), num_returns=1, timeout=LIVENESS_POLL_S)
            self._signals.check()
            if not done:
                self._fail_stranded(pending, on_done)
                continue
            for ref in done:
                job = pending.pop(ref)
                try:
                    table = ray.get(ref)
                except RayError as exc:
                    reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
                    table = lost_job_table(job, f"{type(exc).__name__}: {reason}")
                on_done(job, table)

    def _fail_stranded(self, pending: dict[Any, JobSpec], on_done: OnDone) -> None:
        """Fail the jobs whose device kind has no live node left: Ray would keep them pending forever."""
        import ray  # Ray: as in start

        live = self.live_kinds()
        for ref, job in list(pending.items()):
            if job.device in live:
                continue
            del pending[ref]
            with contextlib.suppress(Exception):
                ray.cancel(ref, force=True)
            lost = ", ".join(
                sorted(
                    {
                        str((n.get("Labels") or {}).get("host", n.get("NodeManagerAddress", "?")))
                        for n in ray.nodes()
                        if not n.get("Alive") and (n.get("Labels") or {}).get("device-kind") == job.device
                    }
                )
            )
            reason = f"no live node of device kind {job.device!r} is left to run or retry it (lost: {lost or '?'})"
            on_done(job, lost_job_table(job, reason))
