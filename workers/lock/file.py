"""The GPU lock's file: opening it safely, the flock probes, the holder file beside it, its status.

`workers.lock.gpu` takes and holds the lock; this module is what it and `orchestrate lock status`
share: `open_lock_file` (read-only, no links followed, regular files only), `try_flock`,
`names_file` (whether a path still names an open file), `holds_flock` (whether a process holds
it), the `<lock>.holder` file (`write_holder`, `Holder`, `read_holder`), and `lock_status` (free,
held, shared or stale; never takes the lock).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import errno
import fcntl
import logging
import os
import stat
import sys
from dataclasses import dataclass, field
from pathlib import Path

from workers.files import write_atomic
from workers.proc.table import open_files, pid_alive, process_name

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


def try_flock(fd: int, operation: int) -> bool:
    try:
        fcntl.flock(fd, operation | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    except OSError as exc:
        if exc.errno in (errno.EAGAIN, errno.EACCES):
            return False
        raise
    return True


def names_file(fd: int, path: str) -> bool:
    """Whether `path` (not followed) still names the file `fd` is open on."""
    try:
        now = os.stat(path, follow_symlinks=False)
    except OSError:
        return False
    info = os.fstat(fd)
    return (now.st_dev, now.st_ino) == (info.st_dev, info.st_ino)


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
        state: `free`, `held`, `shared` (held shared: by the jobs of a host with several GPUs,
            each on its own `<lock>.gpu<i>`), or `stale` (a holder file naming a process that is
            gone, or that no longer holds the lock).
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
        if self.state == "shared":
            who = ", ".join(f"pid={p} ({process_name(p)})" for p in self.lockers)
            return f"shared: {self.path}; held shared by {who} (jobs on single GPUs: see {self.path}.gpu<i>)"
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


def write_holder(path: str, mode: str, cmd: str) -> bool:
    """Say in `<lock>.holder` that this process holds the lock (`pid=`, `start=`, `mode=`, `cmd=`
    lines), atomically; False (with a warning) when it cannot be written: the file only informs
    `status`, the flock is what counts."""
    start = dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    text = f"pid={os.getpid()}\nstart={start}\nmode={mode}\ncmd={' '.join(cmd.split())}\n"
    try:  # not fsynced: after a reboot no lock is held anyway
        write_atomic(Path(holder_path(path)), text, mode=0o644, durable=False)
    except OSError as exc:
        log.warning("could not write GPU lock holder file %s: %s", holder_path(path), exc)
        return False
    return True


def holds_flock(pid: int, dev: int, ino: int) -> bool:
    """Whether process `pid` holds an flock on the file (`dev`, `ino`).

    Linux: one of its descriptors is open on that file and `/proc/<pid>/fdinfo` lists an FLOCK
    on it (flock belongs to the open file, so this is exact). Elsewhere (macOS, no fdinfo): the
    process has the file open (the lock itself is checked by the caller's failed flock).
    """
    if not sys.platform.startswith("linux"):
        return any(_names(name, dev, ino) for name in open_files(pid))
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return False
    for name in fds:
        if not _names(f"/proc/{pid}/fd/{name}", dev, ino):
            continue
        try:
            with open(f"/proc/{pid}/fdinfo/{name}", encoding="ascii", errors="replace") as f:
                if any(line.startswith("lock:") and " FLOCK " in line for line in f):
                    return True
        except OSError:
            continue
    return False


def _names(path: str, dev: int, ino: int) -> bool:
    try:
        info = os.stat(path)
    except OSError:
        return False
    return (info.st_dev, info.st_ino) == (dev, ino)


def kernel_lockers(fd: int, kind: str | None = None) -> list[int]:
    """Pids `/proc/locks` shows holding an flock on this file (Linux only; else empty); `kind`:
    only `READ` (shared) or `WRITE` (exclusive) ones."""
    info = os.fstat(fd)
    try:
        with open("/proc/locks", encoding="ascii", errors="replace") as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    pids = []
    for line in lines:
        fields = line.split()
        if len(fields) < 6 or fields[1] == "->" or fields[1] != "FLOCK" or kind not in (None, fields[3]):
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
    sharers: list[int] = []
    try:
        busy = not try_flock(fd, fcntl.LOCK_SH)  # a shared probe; let go at once
        lockers = kernel_lockers(fd) if busy else []
        if not busy:
            fcntl.flock(fd, fcntl.LOCK_UN)
            sharers = kernel_lockers(fd, "READ")  # our own probe has let go already
    finally:
        os.close(fd)
    if not busy and sharers:
        return LockStatus(path, "shared", True, holder, sharers)
    if holder is None:
        return LockStatus(path, "held" if busy else "free", busy, None, lockers)
    if busy and holder.alive:
        return LockStatus(path, "held", busy, holder, lockers)
    return LockStatus(path, "stale", busy, holder, lockers)
