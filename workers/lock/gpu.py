"""The guarded GPU lock: one GPU job per host, also against people and scripts outside orchestrate.

The lock is an `flock(2)` on one host-wide file (default `/tmp/orchestrate-gpu.lock`), so the
kernel drops it the moment its holder dies, and `flock(1)` users of the same file (the shell guard
`rocm_gpu_guard.sh`, `flock /tmp/x.lock cmd`) and orchestrate exclude each other. The file is opened
read-only without following links and refused unless it is a regular file; when missing it is
created mode 0666 so every user of the host can share it. The descriptor is close-on-exec: a
daemon left behind by a job never keeps the lock.

Beside it, `<lock>.holder` (written atomically, removed on release) says who holds it: `pid=`,
`start=`, `mode=`, `cmd=` lines, for `orchestrate lock status` (`workers.lock.file`: the file's
opening, probes, holder file and status, shared with that command).

The path must still name the locked file when the lock is taken: a waiter that got the flock
on a file someone deleted or replaced meanwhile closes it and locks the file the path names now.
While held, a guard thread re-checks the path every `GUARD_INTERVAL_S`; when the file was deleted
or replaced it creates (or opens) the new one and locks that too, so a newcomer waits again
(`intact` turns False, with a warning, when someone else got the new file first).

Workloads hold the lock as `flock(1)` users do: `held_lock_fds()` lists this process's locked
descriptors, which `workers.proc.tree` passes to the workload's tree, so the lock stays taken
until the last process of the tree is gone, even when the process that took it is killed.

Nesting: the holder exports `ROCM_GPU_GUARD_LOCK_HELD=<its pid>` to its children, as the shell
guard does (the value stays a bare pid, so the guard's own check of it keeps working); a lock
request in a process whose ancestor (or itself) is that pid succeeds at once instead of
deadlocking. The variable is honoured only for the lock it stands for: the named process, or one
between it and the requester, must hold an flock on this very file (same device and inode;
`workers.lock.file.holds_flock`: Linux reads `/proc/<pid>/fdinfo`, macOS asks whether the process
has the file open). A stale export, a reused pid, or an export made for another lock file is ignored.

A host with several GPUs (`SlotLock`): a job on GPU i takes the host's lock *shared*, then
`<lock>.gpu<i>` exclusively. Jobs on different GPUs run side by side; two on one GPU exclude each
other; and whoever takes the host's lock itself, exclusively as `flock(1)` and the shell guard do
(or `orchestrate lock hold` without `--gpu`, or an orchestrate of a host without `gpus`), waits
for every GPU's job and keeps all of them out: the lock file the shell guard shares keeps its
meaning, the whole host. Both are taken in that order (host, then GPU), so no two holders wait
on each other. `flock(1)` cannot tell a waiting exclusive holder from none, so a host kept busy
on every GPU can make it wait for long: give such a guard a `--max-wait`.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import threading
import time
from collections.abc import Callable
from types import TracebackType

from workers.lock.file import (
    GpuLockError,
    LockBusyError,
    LockPathError,
    LockStatus,
    holder_path,
    holds_flock,
    lock_status,
    names_file,
    open_lock_file,
    read_holder,
    try_flock,
    write_holder,
)
from workers.proc.table import is_descendant, parent_pid

# The lock's errors live with its file (`workers.lock.file`) and are the lock's too.
__all__ = [
    "DEFAULT_LOCK_PATH",
    "GUARD_ENV",
    "GpuLock",
    "GpuLockError",
    "LockBusyError",
    "LockPathError",
    "held_lock_fds",
    "nesting_pid",
]

DEFAULT_LOCK_PATH = "/tmp/orchestrate-gpu.lock"
GUARD_ENV = "ROCM_GPU_GUARD_LOCK_HELD"  # the shell guard's name, so both nest inside each other
GUARD_INTERVAL_S = 0.25  # how often a held lock checks that its path still names the locked file

log = logging.getLogger(__name__)


def nesting_pid(fd: int | None = None) -> int | None:
    """The pid named by `ROCM_GPU_GUARD_LOCK_HELD` when it stands for this lock.

    The pid must be this process or one of its ancestors, and it (or a process between it and
    this one) must hold an flock on the file `fd` is open on. Anything else (not a number,
    pid 1, a pid that is not an ancestor, an ancestor that holds another lock or none: a reused
    pid, a stale export, an export for another lock file) is ignored and None returned.

    Args:
        fd: A descriptor open on the lock file; None only checks the ancestry (no lock named).
    """
    raw = os.environ.get(GUARD_ENV, "").strip()
    if not raw.isdigit():
        return None
    pid = int(raw)
    if pid <= 1 or not is_descendant(os.getpid(), pid):
        return None
    if fd is None:
        return pid
    info = os.fstat(fd)
    current: int | None = os.getpid()
    while current is not None and current > 1:
        if holds_flock(current, info.st_dev, info.st_ino):
            return pid
        if current == pid:
            return None
        current = parent_pid(current)
    return None


_HELD: dict[int, GpuLock] = {}  # descriptor -> the lock holding it, in this process
_HELD_LOCK = threading.Lock()


def held_lock_fds() -> list[int]:
    """The descriptors of every GPU lock this process holds (for a workload to inherit)."""
    with _HELD_LOCK:
        return sorted(_HELD)


class GpuLock:
    """The host-wide GPU lock, as a context manager.

    Example:
        with GpuLock("/tmp/orchestrate-gpu.lock", max_wait=600, mode="job", cmd=job_key) as lock:
            print(lock.wait_s, lock.nested)

    Args:
        path: The lock file (from the inventory; share the shell guard's file to share its lock).
        max_wait: Seconds to wait for the lock; 0 waits without limit.
        mode: What holds it (`job`, `hold`, ...), written to the holder file.
        cmd: The job key or command, written to the holder file.
        on_wait: Called once with the lock's status when the lock is found busy.
        export_env: Set `ROCM_GPU_GUARD_LOCK_HELD` in `os.environ` while held, so the children of
            this process nest inside the lock.
        shared: Take a shared flock (many holders at once; an exclusive one waits for them all),
            and write no holder file.

    Attributes:
        wait_s: Seconds spent waiting for the lock.
        nested: True when an ancestor holds the lock and this one took nothing.
        intact: False once the lock file was replaced while held and another process locked the
            new one (exclusion was lost for a while; measurements then are suspect).

    Within one process the lock is re-entrant (a second request while it is held runs nested),
    so it serialises processes, not threads: the runner takes it in the job's own process.
    """

    def __init__(
        self,
        path: str = DEFAULT_LOCK_PATH,
        *,
        max_wait: float = 0.0,
        mode: str = "job",
        cmd: str = "",
        on_wait: Callable[[LockStatus], None] | None = None,
        export_env: bool = True,
        poll_interval: float = 0.05,
        shared: bool = False,
    ) -> None:
        self.path = os.fspath(path)
        self.shared = shared  # a shared flock (the host lock under a `SlotLock`): no holder file
        self._op = fcntl.LOCK_SH if shared else fcntl.LOCK_EX
        self.max_wait = max(0.0, float(max_wait))
        self.mode = mode
        self.cmd = " ".join(cmd.split())  # one line in the holder file
        self.on_wait = on_wait
        self.export_env = export_env
        self.poll_interval = poll_interval
        self.wait_s = 0.0
        self.nested = False
        self._fd: int | None = None
        self._wrote_holder = False
        self._saved_env: str | None = None
        self._exported = False
        self._extra: list[int] = []  # files locked because the path was re-made while held
        self._stop_guard = threading.Event()
        self._guard: threading.Thread | None = None
        self.intact = True

    @property
    def held(self) -> bool:
        """Whether this object holds the lock (or runs nested inside an ancestor's)."""
        return self._fd is not None or self.nested

    def child_env(self, base: dict[str, str] | None = None) -> dict[str, str]:
        """An environment for a child process that nests inside this lock."""
        env = dict(os.environ if base is None else base)
        if self._fd is not None:
            env[GUARD_ENV] = str(os.getpid())
        return env

    def acquire(self) -> GpuLock:
        """Take the lock, waiting at most `max_wait` seconds.

        Raises:
            LockBusyError: Still held by another process when the wait ran out.
            LockPathError: The lock path cannot be used.
        """
        if self.held:
            raise RuntimeError(f"GpuLock({self.path}) acquired twice")
        start = time.monotonic()
        announced = False
        while True:
            fd = open_lock_file(self.path)
            try:
                if not try_flock(fd, self._op):
                    outer = nesting_pid(fd)
                    if outer is not None:
                        os.close(fd)
                        self.nested = True
                        log.info("GPU lock %s held by outer holder pid %d; running nested", self.path, outer)
                        return self
                    if self.on_wait is not None and not announced:
                        announced = True
                        self.on_wait(lock_status(self.path))
                    self._wait(fd, start)
                if names_file(fd, self.path):
                    break
                # Deleted or replaced while we waited: this flock guards nothing; lock what the path names.
                log.warning("GPU lock %s was deleted or replaced while waiting; locking the new file", self.path)
                os.close(fd)
            except BaseException:
                if self._fd != fd:
                    os.close(fd)
                raise
        self.wait_s = time.monotonic() - start
        return self._take(fd)

    def _wait(self, fd: int, start: float) -> None:
        if self.max_wait == 0:
            fcntl.flock(fd, self._op)  # blocking: the kernel wakes waiters in turn
            return
        delay = min(0.01, self.poll_interval)
        while True:
            if try_flock(fd, self._op):
                return
            waited = time.monotonic() - start
            if waited >= self.max_wait:
                raise LockBusyError(
                    f"gave up waiting for GPU lock {self.path} after {waited:.1f} s (max_wait "
                    f"{self.max_wait:g} s): {lock_status(self.path).describe()}",
                    waited=waited,
                )
            time.sleep(min(delay, self.max_wait - waited))
            delay = min(delay * 2, self.poll_interval)

    def _take(self, fd: int) -> GpuLock:
        self._fd = fd
        try:
            with _HELD_LOCK:
                _HELD[fd] = self
            self._write_holder()
            if self.export_env:
                self._saved_env = os.environ.get(GUARD_ENV)
                os.environ[GUARD_ENV] = str(os.getpid())
                self._exported = True
            self._stop_guard = threading.Event()
            self._guard = threading.Thread(target=self._guard_path, name=f"gpulock-guard {self.path}", daemon=True)
            self._guard.start()
        except BaseException:  # e.g. a signal's exception: never leave the lock taken behind a failed enter
            self.release()
            raise
        return self

    def fileno(self) -> int:
        """The locked descriptor (for a workload to inherit, as `flock(1)` passes it).

        Raises:
            RuntimeError: The lock is not held by this object (not taken, or nested).
        """
        if self._fd is None:
            raise RuntimeError(f"GpuLock({self.path}) is not held here")
        return self._fd

    def _guard_path(self) -> None:
        """While held: when the path stops naming a locked file, lock what it names now."""
        while not self._stop_guard.wait(GUARD_INTERVAL_S):
            if self._fd is None:
                return
            if any(names_file(fd, self.path) for fd in [self._fd, *self._extra]):
                continue
            try:
                fd = open_lock_file(self.path)
            except (GpuLockError, OSError) as exc:
                log.warning("GPU lock %s was deleted or replaced while held and cannot be re-made: %s", self.path, exc)
                continue
            if try_flock(fd, self._op) and names_file(fd, self.path):
                self._extra.append(fd)
                log.warning("GPU lock %s was deleted or replaced while held; locked the new file too", self.path)
                self._write_holder()
            else:
                os.close(fd)
                if self.intact:
                    log.error("GPU lock %s was replaced while held and another process holds the new file", self.path)
                self.intact = False

    def inherited_fds(self) -> tuple[int, ...]:
        """The descriptors a workload inherits to hold this lock (none when running nested)."""
        return () if self._fd is None else (self._fd,)

    def _write_holder(self) -> None:
        if not self.shared:  # many hold it at once: the GPU locks' holder files say who
            self._wrote_holder = write_holder(self.path, self.mode, self.cmd) or self._wrote_holder

    def release(self) -> None:
        """Give the lock back (a no-op when not held); removes the holder file if it is ours.

        The descriptor is closed, not unlocked, so the flock ends when the last process holding
        it (this one, or a workload that inherited it) is gone.
        """
        if self.nested:
            self.nested = False
            return
        if self._fd is None:
            return
        if self._wrote_holder:
            holder = read_holder(self.path)
            if holder is not None and holder.pid == os.getpid():
                with contextlib.suppress(OSError):
                    os.unlink(holder_path(self.path))
            self._wrote_holder = False
        if self._exported:
            if self._saved_env is None:
                os.environ.pop(GUARD_ENV, None)
            else:
                os.environ[GUARD_ENV] = self._saved_env
            self._exported = False
        self._stop_guard.set()
        if self._guard is not None and self._guard is not threading.current_thread():
            self._guard.join()
        self._guard = None
        fd, self._fd = self._fd, None
        with _HELD_LOCK:
            _HELD.pop(fd, None)
        # Closed, not unlocked: a workload that inherited the descriptor keeps the lock until it exits.
        for held in [fd, *self._extra]:
            os.close(held)
        self._extra = []

    def __enter__(self) -> GpuLock:
        return self.acquire()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release()
