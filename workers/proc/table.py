"""The process table, as the GPU lock, the GPU-user probes and the process trees need it.

Linux reads `/proc`; elsewhere (macOS) `ps` answers. A zombie (exited, not yet reaped) counts
as gone. `workers.proc.tree` builds the workloads' process trees on `process_table`, and its
keeper imports this module at every workload's start, so it imports only what is cheap (no
dataclasses, typing or subprocess at import time).
"""

from __future__ import annotations

import os
import sys


def pid_alive(pid: int) -> bool:
    """Whether a process with this pid exists (in this pid namespace)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    if sys.platform.startswith("linux"):  # an exited process its parent has not reaped yet is gone too
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                data = f.read()
            return data[data.rindex(b")") + 2 : data.rindex(b")") + 3] != b"Z"
        except (OSError, ValueError):
            return False
    return True


def process_name(pid: int) -> str:
    """The short name of a process (`/proc/<pid>/comm`, elsewhere `ps`), or `?`."""
    try:
        with open(f"/proc/{pid}/comm", encoding="utf-8", errors="replace") as f:
            return f.read().strip() or "?"
    except OSError:
        pass
    return "?" if sys.platform.startswith("linux") else os.path.basename(_ps_field(pid, "comm")) or "?"


def _ps_field(pid: int, name: str) -> str:
    """One `ps -o NAME=` value of a process, '' when it is gone (the process table off Linux)."""
    import subprocess

    argv = ["ps", "-o", f"{name}=", "-p", str(pid)]
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=5, check=False).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def parent_pid(pid: int) -> int | None:
    """The parent of `pid`, or None when it is gone (Linux `/proc`, elsewhere `ps`)."""
    if not sys.platform.startswith("linux"):
        return _ps_parent_pid(pid)
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    return int(data[data.rindex(b")") + 2 :].split()[1])


def _ps_parent_pid(pid: int) -> int | None:
    out = _ps_field(pid, "ppid")
    return int(out) if out.isdigit() else None


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


# ------------------------------------------------------------------------ the whole process table


class ProcessEntry:
    """One process as the table shows it.

    Attributes:
        start: When it started (Linux: clock ticks since boot; elsewhere `ps`'s start time), so
            that a pid reused by another process is never taken for the one seen before.
        sid: Its session id (Linux only; 0 elsewhere).
        zombie: It has exited and waits for its parent to reap it (it holds no files any more).
    """

    __slots__ = ("pgid", "pid", "ppid", "sid", "start", "zombie")

    def __init__(self, pid: int, ppid: int, pgid: int, sid: int, start: str, zombie: bool) -> None:
        self.pid, self.ppid, self.pgid, self.sid, self.start, self.zombie = pid, ppid, pgid, sid, start, zombie

    def __repr__(self) -> str:
        return f"ProcessEntry(pid={self.pid}, ppid={self.ppid}, start={self.start}, zombie={self.zombie})"


def process_table() -> dict[int, ProcessEntry]:
    """Every process of this pid namespace, by pid (Linux `/proc`, elsewhere one `ps` call)."""
    if not sys.platform.startswith("linux"):
        return _ps_table()
    out: dict[int, ProcessEntry] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            entry = _proc_entry(int(name))
            if entry is not None:
                out[entry.pid] = entry
    return out


def _proc_entry(pid: int) -> ProcessEntry | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    fields = data[data.rindex(b")") + 2 :].split()
    # fields[0] is the state, then ppid, pgrp, session, ...; the start time is field 22 of stat
    return ProcessEntry(
        pid=pid,
        ppid=int(fields[1]),
        pgid=int(fields[2]),
        sid=int(fields[3]),
        start=fields[19].decode(),
        zombie=fields[0] in (b"Z", b"X"),
    )


def _ps_table() -> dict[int, ProcessEntry]:
    import subprocess

    argv = ["ps", "-A", "-o", "pid=,ppid=,pgid=,stat=,lstart="]
    try:
        text = subprocess.run(argv, capture_output=True, text=True, timeout=10, check=False).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    out: dict[int, ProcessEntry] = {}
    for line in text.splitlines():
        parts = line.split(None, 4)
        if len(parts) == 5 and parts[0].isdigit() and parts[1].isdigit() and parts[2].isdigit():
            pid = int(parts[0])
            out[pid] = ProcessEntry(pid, int(parts[1]), int(parts[2]), 0, parts[4].strip(), parts[3].startswith("Z"))
    return out


def process_entry(pid: int) -> ProcessEntry | None:
    """One process's table entry, or None when it is gone."""
    if sys.platform.startswith("linux"):
        return _proc_entry(pid)
    return _ps_table().get(pid)


def signal_process(entry: ProcessEntry, signum: int) -> bool:
    """Send `signum` to the process `entry` names, never to another that reused its pid.

    On Linux the process is pinned by a pidfd and its start time checked before the signal goes;
    elsewhere the start time is checked just before `kill` (a narrow window remains).

    Returns:
        True when the signal was delivered.
    """
    import signal

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


def process_cmdline(pid: int) -> list[str]:
    """A process's command line as its argv (`/proc/<pid>/cmdline`, elsewhere `ps`); [] when unknown."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            raw = f.read()
        return [part.decode(errors="replace") for part in raw.split(b"\0") if part]
    except OSError:
        pass
    if sys.platform.startswith("linux"):
        return []
    text = _ps_field(pid, "command")
    return text.split() if text else []


def listening_pids(port: int) -> list[int] | None:
    """Pids of the processes of this machine listening on TCP `port` (any address).

    Linux: `/proc/net/tcp{,6}` and each process's descriptors (only processes this user may
    inspect are found: a listener of another user shows as an empty list); elsewhere `lsof`.

    Returns:
        The pids (empty: a listener no visible process owns), or None when nothing listens.
    """
    if not sys.platform.startswith("linux"):
        return _lsof_listeners(port)
    inodes: set[str] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table, encoding="ascii") as f:
                lines = f.read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) > 9 and fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(fields[9])  # 0A: LISTEN
    if not inodes:
        return None
    wanted = {f"socket:[{inode}]" for inode in inodes}
    pids = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            fds = os.listdir(f"/proc/{name}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                if os.readlink(f"/proc/{name}/fd/{fd}") in wanted:
                    pids.append(int(name))
                    break
            except OSError:
                continue
    return sorted(pids)


def _lsof_listeners(port: int) -> list[int] | None:
    import subprocess

    argv = ["lsof", "-nP", f"-iTCP:{port}", "-sTCP:LISTEN", "-t"]
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=10, check=False).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    pids = sorted({int(p) for p in out.split() if p.isdigit()})
    return pids or None


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
