"""The process table, as the GPU lock, the GPU-user probes and the process trees need it.

Everything here asks psutil, which reads `/proc` on Linux and the kernel's process list on macOS,
so one code answers on both. A zombie (exited, not yet reaped) counts as gone: it runs nothing and
holds no files. A process this user may not inspect answers what psutil lets it see: it is alive,
and its name or command line is unknown (`?`, `[]`).

A pid alone may name another process by the time it is used; `ProcessEntry` carries the start
time too, and `signal_process` signals only the process that entry saw.
"""

from __future__ import annotations

import os
import signal
from typing import NamedTuple

import psutil

_GONE = (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD)


def pid_alive(pid: int) -> bool:
    """Whether a process with this pid exists (in this pid namespace) and has not exited."""
    if pid <= 0:
        return False
    try:
        return psutil.Process(pid).status() not in _GONE
    except psutil.NoSuchProcess:  # a zombie psutil cannot read counts as gone too
        return False
    except psutil.AccessDenied:
        return True


def process_name(pid: int) -> str:
    """The short name of a process, or `?`."""
    try:
        return psutil.Process(pid).name() or "?"
    except psutil.Error:
        return "?"


def process_cmdline(pid: int) -> list[str]:
    """A process's command line as its argv; [] when it is gone or not ours to read."""
    try:
        return psutil.Process(pid).cmdline()
    except psutil.Error:
        return []


def parent_pid(pid: int) -> int | None:
    """The parent of `pid`, or None when it is gone."""
    try:
        return psutil.Process(pid).ppid()
    except psutil.Error:
        return None


def is_descendant(pid: int, ancestor: int) -> bool:
    """Whether `ancestor` is `pid` itself or one of its ancestors."""
    seen = 0
    current: int | None = pid
    while current is not None and current > 0 and seen < 512:
        if current == ancestor:
            return True
        if current == 1:
            return False
        current = parent_pid(current)
        seen += 1
    return False


def open_files(pid: int) -> list[str]:
    """The paths of the regular files a process has open; [] when it is gone or not ours to read."""
    try:
        return [f.path for f in psutil.Process(pid).open_files()]
    except psutil.Error:
        return []


def cpu_times() -> dict[int, tuple[int, float, str]]:
    """Every process: pid -> (parent pid, CPU seconds used so far (user and system), name)."""
    out: dict[int, tuple[int, float, str]] = {}
    for proc in psutil.process_iter(["ppid", "cpu_times", "name"]):
        info = proc.info
        if info["ppid"] is not None and info["cpu_times"] is not None:
            out[proc.pid] = (info["ppid"], info["cpu_times"].user + info["cpu_times"].system, info["name"] or "?")
    return out


def listening_pids(port: int) -> list[int] | None:
    """Pids of the processes of this machine listening on TCP `port` (any address).

    Only processes this user may inspect are named: a listener of another user shows as an
    empty list (macOS lists only this user's sockets unless run as root).

    Returns:
        The pids (empty: a listener no visible process owns), or None when nothing listens.
    """
    try:
        sockets = [(c.pid, c) for c in psutil.net_connections(kind="tcp")]
    except psutil.AccessDenied:  # macOS: the whole socket table is root's; each process's is its owner's
        sockets = []
        for proc in psutil.process_iter():
            try:
                sockets += [(proc.pid, c) for c in proc.net_connections(kind="tcp")]
            except psutil.Error:
                continue
    found = [pid for pid, c in sockets if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port]
    return sorted({pid for pid in found if pid is not None}) if found else None


# ------------------------------------------------------------------------ the whole process table


class ProcessEntry(NamedTuple):
    """One process as the table shows it.

    Attributes:
        pid, ppid, pgid: It, its parent, its process group.
        start: When it started (seconds since the epoch, as psutil gives it), so that a pid reused
            by another process is never taken for the one seen before.
        zombie: It has exited and waits for its parent to reap it (it holds no files any more).
    """

    pid: int
    ppid: int
    pgid: int
    start: float
    zombie: bool


def process_table() -> dict[int, ProcessEntry]:
    """Every process of this pid namespace, by pid."""
    out: dict[int, ProcessEntry] = {}
    for proc in psutil.process_iter(["ppid", "create_time", "status"]):
        entry = _entry(proc.pid, proc.info["ppid"], proc.info["create_time"], proc.info["status"])
        if entry is not None:
            out[entry.pid] = entry
    return out


def process_entry(pid: int) -> ProcessEntry | None:
    """One process's table entry, or None when it is gone."""
    try:
        proc = psutil.Process(pid)
        with proc.oneshot():
            return _entry(pid, proc.ppid(), proc.create_time(), proc.status())
    except psutil.Error:
        return None


def _entry(pid: int, ppid: int | None, start: float | None, status: str | None) -> ProcessEntry | None:
    if start is None:
        return None
    try:
        pgid = os.getpgid(pid)
    except OSError:  # gone meanwhile
        return None
    return ProcessEntry(pid, ppid or 0, pgid, start, status in _GONE)


def signal_process(entry: ProcessEntry, signum: int) -> bool:
    """Send `signum` to the process `entry` names, never to another that reused its pid.

    On Linux the process is pinned by a pidfd and its start time checked before the signal goes;
    elsewhere the start time is checked just before `kill` (a narrow window remains).

    Returns:
        True when the signal was delivered.
    """
    if hasattr(os, "pidfd_open") and hasattr(signal, "pidfd_send_signal"):
        try:
            fd = os.pidfd_open(entry.pid)
        except OSError:
            return False
        try:
            now = process_entry(entry.pid)
            if now is None or now.start != entry.start:
                return False
            signal.pidfd_send_signal(fd, signum)
            return True
        except OSError:
            return False
        finally:
            os.close(fd)
    now = process_entry(entry.pid)
    if now is None or now.start != entry.start:
        return False
    try:
        os.kill(entry.pid, signum)
    except OSError:
        return False
    return True


def descendants(root: int, table: dict[int, ProcessEntry] | None = None) -> list[ProcessEntry]:
    """Every live process below `root` in the table's parent links (never this process itself)."""
    table = process_table() if table is None else table
    children: dict[int, list[int]] = {}
    for entry in table.values():
        children.setdefault(entry.ppid, []).append(entry.pid)
    me, found, stack = os.getpid(), set(), [root]
    while stack:
        for child in children.get(stack.pop(), []):
            if child not in found and child != me:
                found.add(child)
                stack.append(child)
    return [table[pid] for pid in found if not table[pid].zombie]
