"""The guarded GPU lock: one GPU job per host, also against people and scripts outside orchestrate.

The lock is an `flock(2)` on one host-wide file (default `/tmp/orchestrate-gpu.lock`), so the
kernel drops it the moment its holder dies, and `flock(1)` users of the same file (the shell guard
`rocm_gpu_guard.sh`, `flock /tmp/x.lock cmd`) and orchestrate exclude each other. The file is opened
read-only without following links and refused unless it is a regular file; when missing it is
created mode 0666 so every user of the host can share it. The descriptor is close-on-exec: a
daemon left behind by a job never keeps the lock.

Beside it, `<lock>.holder` (written atomically, removed on release) says who holds it: `pid=`,
`start=`, `mode=`, `cmd=` lines, for `orchestrate lock status`.

Nesting: the holder exports `ROCM_GPU_GUARD_LOCK_HELD=<its pid>` to its children; a lock request
in a process whose ancestor (or itself) is that pid succeeds at once instead of deadlocking. The
variable is honoured only when the pid really is an ancestor and the lock really is held.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import errno
import fcntl
import logging
import os
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from types import TracebackType

from workers.processes import is_descendant, pid_alive, process_name

DEFAULT_LOCK_PATH = "/tmp/orchestrate-gpu.lock"
GUARD_ENV = "ROCM_GPU_GUARD_LOCK_HELD"  # the shell guard's name, so both nest inside each other

log = logging.getLogger(__name__)


class GpuLockError(Exception):
    """Base of the lock's errors."""


class LockPathError(GpuLockError):
    """The lock path cannot be used: a symlink, a directory, a FIFO, or a missing directory."""


class LockBusyError(GpuLockError):
    """The lock (or the GPU, for the idle gate) stayed busy past `max_wait`; `waited`: seconds waited."""

    def __init__(self, message: str, *, waited: float = 0.0) -> None:
        super().__init__(message)
        self.waited = waited


def open_lock_file(path: str, *, create: bool = True) -> int:
    """Open the lock file read-only, without following links, refusing anything but a regular file.

    A missing file is created mode 0666 (when `create`), so that every user of the host can lock
    it; an existing one is opened without `O_CREAT`, which Linux's `protected_regular` would refuse
    in a sticky `/tmp` for a file another user made.

    Returns:
        A close-on-exec descriptor.

    Raises:
        LockPathError: The path is a symlink, a directory or another non-regular file, or its
            directory does not exist.
        FileNotFoundError: The file is missing and `create` is false.
    """
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC | getattr(os, "O_NOCTTY", 0)
    fd = -1
    if create:
        try:
            fd = os.open(path, flags | os.O_CREAT | os.O_EXCL, 0o666)
            os.fchmod(fd, 0o666)  # the umask would narrow it
        except FileExistsError:
            fd = -1
        except FileNotFoundError as exc:
            raise LockPathError(f"lock {path}: directory {os.path.dirname(path) or '.'} does not exist") from exc
        except OSError as exc:
            raise LockPathError(f"lock {path}: cannot create it ({exc.strerror})") from exc
    if fd < 0:
        try:
            fd = os.open(path, flags)
        except FileNotFoundError:
            raise
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise LockPathError(f"lock {path} is a symbolic link; refusing to follow it") from exc
            raise LockPathError(f"lock {path}: cannot open it ({exc.strerror})") from exc
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        os.close(fd)
        kind = "a directory" if stat.S_ISDIR(info.st_mode) else "not a regular file"
        raise LockPathError(f"lock {path} is {kind}; it must be a regular file")
    return fd


@dataclass(frozen=True)
class Holder:
    """What `<lock>.holder` says: who holds the lock, since when, doing what."""

    pid: int | None
    start: str = ""
    mode: str = ""
    cmd: str = ""

    @property
    def alive(self) -> bool:
        """Whether the named process still exists."""
        return self.pid is not None and pid_alive(self.pid)

    def describe(self) -> str:
        """`pid=.. mode=.. since=.. cmd=..` on one line."""
        return f"pid={self.pid} mode={self.mode or '?'} since={self.start or '?'} cmd={self.cmd or '?'}"


@dataclass(frozen=True)
class LockStatus:
    """The lock's state for `orchestrate lock status`.

    Attributes:
        state: `free`, `held`, or `stale` (a holder file naming a process that is gone, or that
            no longer holds the lock).
        busy: Whether some process holds the flock right now.
        holder: The holder file's content, if any.
        lockers: Pids the kernel lists as holding the flock (Linux `/proc/locks`); for a lock taken
            by `flock(1)` without a holder file.
    """

    path: str
    state: str
    busy: bool
    holder: Holder | None = None
    lockers: list[int] = field(default_factory=list)

    def describe(self) -> str:
        """One line: the state word first, then who and what."""
        if self.state == "free":
            return f"free: {self.path}"
        parts = [f"{self.state}: {self.path}"]
        if self.holder is not None and self.state == "held":
            parts.append(f"held by {self.holder.describe()}")
        elif self.holder is not None:
            gone = "is gone" if not self.holder.alive else "does not hold the lock"
            parts.append(f"holder file names pid {self.holder.pid}, which {gone} ({self.holder.describe()})")
        if self.busy and (self.holder is None or self.state == "stale"):
            who = ", ".join(f"pid={p} ({process_name(p)})" for p in self.lockers) or "an unknown process"
            parts.append(f"held by {who} (no holder file: flock(1) or another tool)")
        return "; ".join(parts)


def holder_path(path: str) -> str:
    """The holder file beside the lock file."""
    return f"{os.fspath(path)}.holder"


def read_holder(path: str) -> Holder | None:
    """Parse `<lock>.holder`; None when it is missing or unreadable."""
    try:
        with open(holder_path(path), encoding="utf-8", errors="replace") as f:
            text = f.read(64 * 1024)
    except OSError:
        return None
    fields: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition("=")
        if sep:
            fields.setdefault(key.strip(), value.strip())
    raw = fields.get("pid", "")
    return Holder(
        pid=int(raw) if raw.isdigit() else None,
        start=fields.get("start", ""),
        mode=fields.get("mode", ""),
        cmd=fields.get("cmd", ""),
    )


def _kernel_lockers(fd: int) -> list[int]:
    """Pids `/proc/locks` shows holding an flock on this file (Linux only; else empty)."""
    info = os.fstat(fd)
    try:
        with open("/proc/locks", encoding="ascii", errors="replace") as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    pids = []
    for line in lines:
        fields = line.split()
        if len(fields) < 6 or fields[1] == "->" or fields[1] != "FLOCK":
            continue
        dev_inode = fields[5].split(":")
        if len(dev_inode) == 3 and dev_inode[2].isdigit() and int(dev_inode[2]) == info.st_ino:
            with contextlib.suppress(ValueError):
                pids.append(int(fields[4]))
    return sorted(set(pids))


def lock_status(path: str) -> LockStatus:
    """Whether the lock is free, held (and by whom) or stale; never creates or takes the lock.

    Raises:
        LockPathError: The path is a symlink, a directory or another non-regular file.
    """
    path = os.fspath(path)
    holder = read_holder(path)
    try:
        fd = open_lock_file(path, create=False)
    except FileNotFoundError:
        return LockStatus(path, "stale" if holder is not None else "free", False, holder)
    try:
        busy = not _try_flock(fd, fcntl.LOCK_SH)  # a shared probe; let go at once
        lockers = _kernel_lockers(fd) if busy else []
        if not busy:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)
    if holder is None:
        return LockStatus(path, "held" if busy else "free", busy, None, lockers)
    if busy and holder.alive:
        return LockStatus(path, "held", busy, holder, lockers)
    return LockStatus(path, "stale", busy, holder, lockers)


def nesting_pid() -> int | None:
    """The pid named by `ROCM_GPU_GUARD_LOCK_HELD` when it is this process or one of its ancestors.

    Anything else (not a number, pid 1, a pid that is not an ancestor: a reused pid or an export
    leaked by a daemon) is ignored and None returned.
    """
    raw = os.environ.get(GUARD_ENV, "").strip()
    if not raw.isdigit():
        return None
    pid = int(raw)
    if pid <= 1 or not is_descendant(os.getpid(), pid):
        return None
    return pid


def _try_flock(fd: int, operation: int) -> bool:
    try:
        fcntl.flock(fd, operation | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    except OSError as exc:
        if exc.errno in (errno.EAGAIN, errno.EACCES):
            return False
        raise
    return True


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

    Attributes:
        wait_s: Seconds spent waiting for the lock.
        nested: True when an ancestor holds the lock and this one took nothing.

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
    ) -> None:
        self.path = os.fspath(path)
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
        fd = open_lock_file(self.path)
        try:
            if _try_flock(fd, fcntl.LOCK_EX):
                return self._take(fd)
            outer = nesting_pid()
            if outer is not None:
                os.close(fd)
                self.nested = True
                log.info("GPU lock %s held by outer holder pid %d; running nested", self.path, outer)
                return self
            if self.on_wait is not None:
                self.on_wait(lock_status(self.path))
            self._wait(fd, start)
        except BaseException:
            if self._fd is None:
                os.close(fd)
            raise
        self.wait_s = time.monotonic() - start
        return self._take(fd)

    def _wait(self, fd: int, start: float) -> None:
        if self.max_wait == 0:
            fcntl.flock(fd, fcntl.LOCK_EX)  # blocking: the kernel wakes waiters in turn
            return
        delay = min(0.01, self.poll_interval)
        while True:
            if _try_flock(fd, fcntl.LOCK_EX):
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
            self._write_holder()
            if self.export_env:
                self._saved_env = os.environ.get(GUARD_ENV)
                os.environ[GUARD_ENV] = str(os.getpid())
                self._exported = True
        except BaseException:  # e.g. a signal's exception: never leave the lock taken behind a failed enter
            self.release()
            raise
        return self

    def _write_holder(self) -> None:
        target = holder_path(self.path)
        start = dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        text = f"pid={os.getpid()}\nstart={start}\nmode={self.mode}\ncmd={self.cmd}\n"
        tmp = f"{target}.{os.getpid()}.tmp"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
            try:
                os.fchmod(fd, 0o644)
                os.write(fd, text.encode())
            finally:
                os.close(fd)
            os.replace(tmp, target)
            self._wrote_holder = True
        except OSError as exc:  # the holder file only informs `status`; the flock is what counts
            log.warning("could not write GPU lock holder file %s: %s", target, exc)
            with contextlib.suppress(OSError):
                os.unlink(tmp)

    def release(self) -> None:
        """Give the lock back (a no-op when not held); removes the holder file if it is ours."""
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
        fd, self._fd = self._fd, None
        with contextlib.suppress(OSError):
            fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)

    def __enter__(self) -> GpuLock:
        return self.acquire()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release()
