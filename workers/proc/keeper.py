"""The keeper of one workload's process tree (Linux), run as a script by `workers.proc.tree`.

    python -S -I keeper.py FD -- COMMAND [ARG ...]

The keeper makes itself a child subreaper (`prctl(PR_SET_CHILD_SUBREAPER)`), so every descendant
of the workload whose parent exits is re-parented to it instead of to init: the keeper's
descendants are exactly the workload's tree, whatever they do (`setsid`, double forks, a cleared
environment). It spawns COMMAND (which inherits its session, process group, descriptors and
environment, with default signal handling), then reports over the socket FD:

    root <pid>                      the command was started
    exit <status> <seconds>         the command exited (status < 0: killed by that signal)
    error <errno> <message>         the command could not be started (the keeper exits 127)

and reaps every process of the tree as it exits. When the socket reaches EOF (the orchestrating
process closed it to end the tree, or died), the keeper SIGKILLs its descendants until none is
left, then exits; it also exits by itself once the command and every descendant are gone. It
ignores the terminal's and the session's signals (its caller forwards what the tree should get).
It starts before every workload, so it imports only cheap modules: `_signal` rather than
`signal`, a raw descriptor rather than `socket`, and no process table (psutil's import would
cost more than the keeper's whole start): its children are listed by the kernel
(`/proc/<pid>/task/<pid>/children`), and a subreaper's descendants all become its children as
their parents die.
"""

from __future__ import annotations

import _signal as signal  # the C module: `signal` would import enum (most of the start-up time)
import ctypes
import os
import select
import sys
import time

PR_SET_CHILD_SUBREAPER = 36
IGNORED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGTSTP, signal.SIGPIPE)


def _reap(root: int, report: int, started: float) -> bool:
    """Reap every exited child; report the root's exit. False once no child is left."""
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return False
        if pid == 0:
            return True
        if pid == root:
            code = os.waitstatus_to_exitcode(status)
            _send(report, f"exit {code} {time.monotonic() - started:.6f}")


def _kill_all() -> None:
    """SIGKILL the keeper's children until it has none. The children of a killed child are
    re-parented to the keeper (a subreaper), so they come next; and a child's pid cannot name
    another process before the keeper reaps it, so no other process is ever signalled."""
    children = f"/proc/{os.getpid()}/task/{os.getpid()}/children"  # one thread: every child is its
    while True:
        try:
            while os.waitpid(-1, os.WNOHANG)[0] != 0:
                pass
        except ChildProcessError:
            return
        try:
            with open(children) as f:
                pids = f.read().split()
        except OSError:
            pids = []
        for pid in pids:
            try:  # noqa: SIM105 (contextlib costs 10 ms at every workload's start)
                os.kill(int(pid), signal.SIGKILL)
            except OSError:
                pass
        time.sleep(0.01)


def _send(report: int, line: str) -> None:
    try:  # noqa: SIM105 (contextlib costs 10 ms at every workload's start)
        os.write(report, line.encode() + b"\n")
    except OSError:  # the caller is gone; the socket's EOF ends the tree
        pass


def main(argv: list[str]) -> int:
    report = int(argv[0])  # one end of a socketpair, used as a plain descriptor
    command = argv[argv.index("--") + 1 :]
    os.set_inheritable(report, False)
    for signum in IGNORED:
        signal.signal(signum, signal.SIG_IGN)
    # A child's exit wakes the loop at once (its run time is reported, so no poll delay in it).
    wake_r, wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    signal.set_wakeup_fd(wake_w, warn_on_full_buffer=False)
    signal.signal(signal.SIGCHLD, lambda signum, frame: None)
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        err = ctypes.get_errno()
        _send(report, f"error {err} prctl(PR_SET_CHILD_SUBREAPER): {os.strerror(err)}")
        return 127
    started = time.monotonic()
    try:
        root = os.posix_spawnp(command[0], command, os.environ, setsigdef=IGNORED)
    except OSError as exc:
        _send(report, f"error {exc.errno or 0} {exc.strerror or exc}")
        return 127
    _send(report, f"root {root}")
    while _reap(root, report, started):
        ready, _, _ = select.select([report, wake_r], [], [], 1.0)
        if wake_r in ready:
            os.read(wake_r, 4096)
        if report in ready and not os.read(report, 4096):  # EOF: end the tree
            _kill_all()
            return 0
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
