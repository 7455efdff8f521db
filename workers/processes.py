"""The process table, as the GPU lock and the GPU-user probes need it.

Linux reads `/proc`; elsewhere (macOS) `ps` answers. A zombie (exited, not yet reaped) counts
as gone.
"""

from __future__ import annotations

import os
import subprocess
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
