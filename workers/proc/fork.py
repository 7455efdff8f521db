"""Forking a job's process safely: from one thread only, and tied to the process that asked for it.

A lock that another thread holds at a fork (an allocator's, the import lock) stays held forever in
the child, which may deadlock (Python 3.12 warns of such a fork). `fork` counts the threads at
every fork and refuses a multi-threaded parent (`ThreadedFork`). A forked child or a fresh
interpreter ends with its parent (`PR_SET_PDEATHSIG`, `die_with_parent`). Linux only: elsewhere
(macOS, where forking after Apple's frameworks load is unsafe) callers start fresh interpreters.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
import sys

from workers.proc.tree import become_subreaper, end_descendants

PARENT_ENV = "ORCHESTRATE_PARENT_PID"  # a fresh interpreter ends with this process (`die_with_parent`)
PR_SET_PDEATHSIG = 1


class ThreadedFork(RuntimeError):
    """The server had another thread when it forked: the child was killed, and the server stops."""


def os_threads() -> int:
    """This process's threads as the kernel counts them (what CPython 3.12+ counts for its fork
    warning: every thread, native ones included); 0 where it cannot be read (not Linux)."""
    try:
        with open("/proc/self/stat", "rb") as f:
            stat = f.read()
        return int(stat[stat.rindex(b")") + 2 :].split()[17])  # field 20: num_threads
    except (OSError, ValueError, IndexError):
        return 0


def fork() -> int:
    """`os.fork()` that refuses a multi-threaded server: 0 in the child, its pid in the parent.

    The threads are counted in the parent right after the fork, as CPython counts them for its
    warning: after the fork handlers ran (OpenBLAS, which NumPy loads, stops its thread pool in
    its own `pthread_atfork` handler, so a count before the fork would see that pool).

    Raises:
        ThreadedFork: The server had another thread; the child was killed and reaped.
    """
    sys.stdout.flush()
    pid = os.fork()
    if pid == 0:
        return 0
    threads = os_threads()
    if threads > 1:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        raise ThreadedFork(f"the fork server had {threads} threads when it forked")
    return pid


def supported() -> bool:
    """Whether this platform forks jobs from a fork server (Linux); elsewhere fresh interpreters."""
    return sys.platform.startswith("linux")


def end_with_parent() -> None:
    """End this process (SIGKILL) when its parent ends (Linux)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def die_with_parent() -> None:
    """In a job's fresh interpreter: end when the Ray worker that started it ends (Linux).

    The parent is named by `ORCHESTRATE_PARENT_PID`; if it is gone already, exit at once.
    """
    raw = os.environ.pop(PARENT_ENV, "")
    if not raw.isdigit() or not supported():
        return
    end_with_parent()
    if os.getppid() != int(raw):
        os._exit(1)


def detach(closing: list[socket.socket]) -> None:
    """In a child just forked from the server: drop the server's sockets (`closing`), wakeup fd and
    signal handlers; a process group of its own, ended with the server, a subreaper."""
    signal.set_wakeup_fd(-1)  # the server's: not the child's
    for sock in closing:
        sock.close()
    os.setpgid(0, 0)
    end_with_parent()
    become_subreaper()  # whatever the job starts stays below it, found and ended with it
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def end_leftovers() -> None:
    """End what the job left running (a subreaper: its orphans are its children now)."""
    me = os.getpid()
    try:
        with open(f"/proc/{me}/task/{me}/children") as f:  # cheap: no process table walk when empty
            if not f.read().split():
                return
    except OSError:
        pass  # no such file (not Linux): walk the table
    end_descendants(me, kill_wait=5.0)
