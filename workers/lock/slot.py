"""The lock of one GPU of a host with several: the host's lock shared, then `<lock>.gpu<i>`.

See `workers.lock.gpu` (its last paragraph) for how this keeps the shell guard's meaning: a holder
of the host's lock itself excludes every GPU's jobs, and jobs on different GPUs share it.
"""

from __future__ import annotations

from collections.abc import Callable

from workers.lock.file import LockStatus
from workers.lock.gpu import GpuLock


def gpu_lock_path(path: str, gpu_index: int) -> str:
    """The lock file of GPU `gpu_index` beside the host's lock `path` (`/tmp/x.lock` -> `/tmp/x.lock.gpu1`)."""
    return f"{path}.gpu{gpu_index}"


class SlotLock:
    """One GPU's lock, as a context manager with `GpuLock`'s surface.

    Example:
        with SlotLock("/tmp/orchestrate-gpu.lock", 1, max_wait=600, cmd=job_key) as lock:
            ...  # holds /tmp/orchestrate-gpu.lock shared and /tmp/orchestrate-gpu.lock.gpu1

    Args:
        path: The host's lock file (the inventory's `lock`).
        gpu_index: The GPU.
        max_wait: Seconds to wait for both together; 0 waits without limit.
        mode, cmd, on_wait, export_env: As for `GpuLock` (the holder file is the GPU lock's).
    """

    def __init__(
        self,
        path: str,
        gpu_index: int,
        *,
        max_wait: float = 0.0,
        mode: str = "job",
        cmd: str = "",
        on_wait: Callable[[LockStatus], None] | None = None,
        export_env: bool = True,
    ) -> None:
        self.max_wait = max(0.0, float(max_wait))
        # Only the GPU's lock exports the nesting variable: it names this process, which holds both
        # files, so a guard nested on either finds it (the host's own export would hide an outer
        # holder of the GPU from the GPU's lock).
        self.host = GpuLock(path, max_wait=max_wait, mode=mode, cmd=cmd, on_wait=on_wait, export_env=False, shared=True)
        self.gpu = GpuLock(
            gpu_lock_path(path, gpu_index),
            max_wait=max_wait,
            mode=mode,
            cmd=cmd,
            on_wait=on_wait,
            export_env=export_env,
        )
        self.path = self.gpu.path
        self.wait_s = 0.0

    @property
    def nested(self) -> bool:
        """True when an outer holder holds this GPU's lock and this one took nothing of its own."""
        return self.gpu.nested

    @property
    def intact(self) -> bool:
        """False once either file was replaced while held and someone else locked the new one."""
        return self.host.intact and self.gpu.intact

    @property
    def held(self) -> bool:
        """Whether both are held (or run nested)."""
        return self.host.held and self.gpu.held

    def acquire(self) -> SlotLock:
        """Take the host's lock shared, then the GPU's, within one `max_wait`.

        Raises:
            LockBusyError: Either stayed busy past the wait.
            LockPathError: Either path cannot be used.
        """
        self.host.acquire()
        try:
            if self.max_wait > 0:
                self.gpu.max_wait = max(self.max_wait - self.host.wait_s, 1e-3)
            self.gpu.acquire()
        except BaseException:
            self.host.release()
            raise
        self.wait_s = self.host.wait_s + self.gpu.wait_s
        return self

    def release(self) -> None:
        """Give both back, the GPU's first."""
        try:
            self.gpu.release()
        finally:
            self.host.release()

    def inherited_fds(self) -> tuple[int, ...]:
        """Both descriptors, for a workload to hold the locks as `flock(1)` passes them."""
        return self.host.inherited_fds() + self.gpu.inherited_fds()

    def child_env(self, base: dict[str, str] | None = None) -> dict[str, str]:
        """An environment for a child process that nests inside both."""
        return self.gpu.child_env(self.host.child_env(base))

    def __enter__(self) -> SlotLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()
