"""The float64 reference computed on the host while the device warms up.

A kernel job's check needs, for its first input set, the float64 reference of every arm and auto
candidate. At the seeds' shapes that is host work (reading the checked rows back, NumPy products)
of a few tenths of a second, during which the device used to sit idle. Where the case offers it
(`Workload.prepare_reference`), the device part (reading x's rows) runs here in the job's thread,
and the host part (NumPy only: MLX is never called from two threads) on one background thread,
started as soon as the input pool exists and joined before the check; the warm-up runs meanwhile.

What the host part raised for one reference is stored with it and raised again when the check
asks for that reference, so it fails that arm (or rejects that candidate) exactly as a synchronous
reference would. Should the host part fail as a whole, or a case not offer it, the references are
computed when asked, as before. The thread never outlives the job: `ReferenceAhead` is a context
manager whose exit waits for it.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from types import TracebackType
from typing import Any

from kernels.registry import Workload

THREAD_NAME = "orchestrate-reference"


class ReferenceAhead:
    """The host part of a workload's references for one input set, running on its own thread."""

    def __init__(self, workload: Workload, arms: Sequence[str], inputs: tuple[Any, ...]) -> None:
        """Gather what the references of `arms` on `inputs` need (this thread) and start the host part.

        Args:
            workload: the case's workload (without `prepare_reference` nothing is started).
            arms: the job's arms (a case's auto candidates are checked against their arm's reference).
            inputs: the input set the arms are checked on.
        """
        self._executor: ThreadPoolExecutor | None = None
        self._future: Future[None] | None = None
        if workload.prepare_reference is None:
            return
        try:
            host_part = workload.prepare_reference(list(arms), *inputs)
        except Exception:  # nothing stored: each reference is computed, and raises, when asked
            return
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=THREAD_NAME)
        self._future = self._executor.submit(host_part)

    @property
    def started(self) -> bool:
        """Whether a host part was started (the case offers one)."""
        return self._future is not None

    def join(self) -> None:
        """Wait for the host part and end its thread (idempotent).

        An exception that escaped the host part as a whole is not raised here: the references it
        did not store are computed when the check asks for them, in the job's thread, and fail
        their arm there.
        """
        if self._executor is None:
            return
        if self._future is not None:
            wait([self._future])
        self._executor.shutdown(wait=True)
        self._executor = None

    def __enter__(self) -> ReferenceAhead:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.join()
