"""A workload's whole process tree: started, followed, ended, and only then let go.

A benchmark is rarely one process: a shell script starts the engine, the engine forks helpers,
a helper calls `setsid` and daemonises. Killing the first process (or its process group) leaves
the rest running on the GPU with the lock already free, and a descendant that keeps stdout open
makes a pipe reader wait long past any timeout. `ProcessTree` follows every descendant instead.

* Linux: the workload runs under a keeper (`workers/proc/keeper.py`, a small stdlib script)
  that is a child subreaper (`prctl(PR_SET_CHILD_SUBREAPER)`): a descendant whose parent exits
  is re-parented to the keeper, not to init, so the keeper's descendants are exactly the tree,
  whatever they do (`setsid`, double forks, a cleared environment). The keeper is tied to this
  process by a socket: when this process closes it (to end the tree) or dies (a SIGKILLed
  worker, a killed `orchestrate lock hold`), the keeper SIGKILLs every descendant and exits.
* Elsewhere (macOS has no subreaper): the tree is followed by polling the process table for the
  root's descendants (parent links) and its process group, remembering every member seen; a
  descendant that leaves the group and whose parent exits between two polls (50 ms) is
  re-parented to launchd and escapes. Nothing ends the tree when this process is SIGKILLed.

Either way the GPU lock holds while any of the tree runs, because the workload inherits the
lock's descriptor (`pass_fds`, as `flock(1)` does; see `workers.lock.gpu`). A cgroup would also
contain the tree, but hosts rarely delegate a writable one to the benchmark user (a Ray node runs
in a login session's scope), and the keeper catches the same processes; none is used.

Ending a tree signals members through pidfds (never a pid reused by someone else) and returns
only when every member is gone (exited, or a zombie: it holds no files). `workers.command.workload`
builds the one-call form on it (`run_tree`: output to files, a timeout, leftovers ended).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import select
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import IO

from workers.proc.table import ProcessEntry, descendants, process_table, signal_process

KEEPER = Path(__file__).with_name("keeper.py")
KILL_WAIT_S = 30.0  # how long `end` waits for SIGKILLed members to go (a D-state process may linger)
POLL_S = 0.05


def keeper_supported() -> bool:
    """Whether trees run under a subreaper keeper here (Linux)."""
    return sys.platform.startswith("linux")


class ProcessTree:
    """One workload's process tree.

    Example:
        with ProcessTree(["bash", "-c", script], stdout=log, stderr=log) as tree:
            code = tree.wait(timeout=60)   # None: still running after 60 s
        # leaving the block ends whatever is left of the tree and returns once it is gone

    Args:
        argv: The root command.
        cwd, env, stdin, stdout, stderr: As for `subprocess.Popen` (`env` None: this process's).
        pass_fds: Descriptors the workload inherits (the GPU lock's, so the workload holds it).
        session: True: the tree gets a new session (no controlling terminal); False: a new
            process group in this session (a foreground job on a terminal, for `lock hold`).

    Attributes:
        seconds: The root's run time (from just before it was spawned to its exit), once known.
    """

    def __init__(
        self,
        argv: Sequence[str],
        *,
        cwd: str | Path | None = None,
        env: Mapping[str, str] | None = None,
        stdin: int | IO[bytes] | None = None,
        stdout: int | IO[bytes] | None = None,
        stderr: int | IO[bytes] | None = None,
        pass_fds: Sequence[int] = (),
        session: bool = True,
    ) -> None:
        self.argv = list(argv)
        self._env = dict(os.environ if env is None else env)
        self._popen_kw = {"cwd": cwd, "stdin": stdin, "stdout": stdout, "stderr": stderr}
        self._pass_fds = tuple(pass_fds)
        self._session = session
        self._keeper = keeper_supported()
        self._proc: subprocess.Popen[bytes] | None = None
        self._sock: socket.socket | None = None
        self._buffer = b""
        self._root = -1
        self._code: int | None = None
        self._seen: dict[int, float] = {}  # polled trees: pid -> start time of every member seen
        self._started = 0.0
        self.seconds: float | None = None

    # ---------------------------------------------------------------------------------- running

    def start(self) -> ProcessTree:
        """Start the tree.

        Raises:
            OSError: The command cannot be started (FileNotFoundError, PermissionError, ...).
        """
        group: dict[str, object] = {"start_new_session": True} if self._session else {"process_group": 0}
        self._started = time.monotonic()
        if not self._keeper:
            self._proc = subprocess.Popen(
                self.argv,
                env=self._env,
                pass_fds=self._pass_fds,
                **self._popen_kw,
                **group,  # type: ignore[call-overload]
            )
            self._root = self._proc.pid
            self.members()
            return self
        ours, theirs = socket.socketpair()
        try:
            argv = [sys.executable, "-S", "-I", str(KEEPER), str(theirs.fileno()), "--", *self.argv]
            self._proc = subprocess.Popen(
                argv,
                env=self._env,
                pass_fds=(theirs.fileno(), *self._pass_fds),
                **self._popen_kw,
                **group,  # type: ignore[call-overload]
            )
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        self._sock = ours
        first = self._message(None)
        if first is None or first[0] != "root":
            self._proc.wait()
            ours.close()
            self._sock = None
            errno, _, why = (first[1] if first and first[0] == "error" else "0 the tree keeper exited").partition(" ")
            raise OSError(int(errno), why or "cannot start", self.argv[0])
        self._root = int(first[1])
        return self

    def _message(self, timeout: float | None) -> tuple[str, str] | None:
        """The keeper's next line (`kind`, `rest`; `eof` when it is gone), None when none came in time."""
        assert self._sock is not None
        deadline = None if timeout is None else time.monotonic() + timeout
        while b"\n" not in self._buffer:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready, _, _ = select.select([self._sock], [], [], left)
            if not ready:
                return None
            chunk = self._sock.recv(4096)
            if not chunk:
                return "eof", ""
            self._buffer += chunk
        line, _, self._buffer = self._buffer.partition(b"\n")
        kind, _, rest = line.decode().partition(" ")
        return kind, rest

    @property
    def pid(self) -> int:
        """The workload's root process."""
        return self._root

    @property
    def pgid(self) -> int:
        """The tree's process group (the keeper's on Linux, else the root's)."""
        assert self._proc is not None, "the tree was not started"
        return self._proc.pid

    def poll(self) -> int | None:
        """The root's exit status (negative: the signal that killed it), None while it runs."""
        return self.wait(0)

    def wait(self, timeout: float | None = None) -> int | None:
        """Wait for the root to exit (following the tree meanwhile); None when `timeout` ran out."""
        assert self._proc is not None, "the tree was not started"
        if self._code is not None:
            return self._code
        if not self._keeper:
            deadline = None if timeout is None else time.monotonic() + timeout
            while (code := self._proc.poll()) is None:
                self.members()
                if deadline is not None and time.monotonic() >= deadline:
                    return None
                time.sleep(POLL_S if deadline is None else max(0.0, min(POLL_S, deadline - time.monotonic())))
            self._code, self.seconds = code, time.monotonic() - self._started
            return code
        if self._sock is None:  # the tree was ended before its root reported an exit: it was killed
            self._code = -signal.SIGKILL
            return self._code
        message = self._message(timeout)
        if message is None:
            return None
        kind, rest = message
        if kind == "exit":
            status, _, seconds = rest.partition(" ")
            self._code, self.seconds = int(status), float(seconds)
        elif kind == "eof":  # the keeper itself was killed: its tree went with it (or is going)
            self._proc.wait()
            self._code = -signal.SIGKILL
        return self._code

    # ---------------------------------------------------------------------------------- members

    def members(self) -> list[ProcessEntry]:
        """Every live process of the workload's tree now (the keeper not included)."""
        assert self._proc is not None, "the tree was not started"
        table = process_table()
        if self._keeper:
            if self._proc.poll() is not None:  # the keeper is gone, and its pid may be another's now
                return []
            return sorted(descendants(self._proc.pid, table), key=lambda e: e.pid)
        grouped = self._proc.returncode is None  # the root's group id is reserved until it is reaped
        roots = [
            e
            for e in table.values()
            if not e.zombie
            and (self._seen.get(e.pid) == e.start or (grouped and (e.pid == self._root or e.pgid == self._root)))
        ]
        live = {e.pid: e for e in roots}
        for entry in roots:
            live.update((d.pid, d) for d in descendants(entry.pid, table))
        self._seen.update((e.pid, e.start) for e in live.values())
        return sorted(live.values(), key=lambda e: e.pid)

    def signal(self, signum: int) -> int:
        """Send `signum` to every live member; returns how many got it."""
        return sum(signal_process(entry, signum) for entry in self.members())

    def end(self, grace: float = 0.0, *, kill_wait: float = KILL_WAIT_S) -> list[int]:
        """End the whole tree: SIGTERM (and `grace` seconds to exit) when `grace` > 0, then SIGKILL
        until every member is gone.

        Returns:
            The pids that were still running when `end` was called (empty: nothing was left).
        """
        if self._proc is None:
            return []
        if self._sock is not None and self.wait(0) is not None:
            # The keeper exits by itself once the root and every descendant are gone.
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._proc.wait(timeout=0.05)
            if self._proc.returncode is not None:
                self._sock.close()
                self._sock = None
                return []
        first = self.members()
        _terminate(self.members, first, grace)
        deadline = time.monotonic() + kill_wait
        if self._sock is not None:
            self.wait(0)  # collect the root's exit report before the socket goes
            self._sock.close()  # EOF: the keeper SIGKILLs what is left, reaps it, and exits
            self._sock = None
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._proc.wait(timeout=kill_wait)
        _kill(self.members, deadline)  # polled trees, or a keeper that did not finish in time
        if self._proc.poll() is None:
            self._proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        if self._code is None and not self._keeper:
            self._code = self._proc.returncode
        return [e.pid for e in first]

    # ------------------------------------------------------------------------------- lifecycle

    def close(self) -> None:
        """End what is left of the tree."""
        self.end()

    def __enter__(self) -> ProcessTree:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


# ------------------------------------------------------------------- trees not started here


def become_subreaper() -> bool:
    """Make this process a child subreaper (Linux): orphans among its descendants are re-parented
    to it instead of to init, so its descendants stay findable. For a job that a fork server
    forks (no `ProcessTree` there): call it first thing in the forked job, and the server can
    then end the job's whole tree with `end_descendants(job)`. False where there is no subreaper.

    The setting is process-wide and lasts until exit; exited orphans become this process's
    zombies to reap (a Python process reaps them with `os.waitpid`, `subprocess` does not).
    """
    if not keeper_supported():
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    return int(libc.prctl(36, 1, 0, 0, 0)) == 0  # PR_SET_CHILD_SUBREAPER


def end_descendants(*roots: int, grace: float = 0.0, group: bool = False, kill_wait: float = KILL_WAIT_S) -> list[int]:
    """End processes `roots` and every descendant they have, as `ProcessTree.end` does: SIGTERM
    (and SIGCONT) to all of them and `grace` seconds to exit when `grace` > 0; then the roots are
    stopped (they can fork no more), what is below them is SIGKILLed until none is left, and the
    roots last. With `group`, every process still in a root's process group (a root is its
    group's leader) is ended with them.

    Descendants are found through parent links: when a root is a subreaper (`become_subreaper`),
    that is all of them, also what left its session; otherwise an orphan re-parented to init is
    missed, unless `group` finds it in its root's group. A root itself is not reaped (its parent's
    `wait` gets its status), and this process is never ended, also when it is a root.

    Returns:
        The pids that were ended.
    """
    me, wanted = os.getpid(), set(roots)

    def members(with_roots: bool) -> Callable[[], list[ProcessEntry]]:
        def live() -> list[ProcessEntry]:
            table = process_table()
            found = {d.pid: d for root in roots for d in descendants(root, table)}
            found.update(
                (e.pid, e)
                for e in table.values()
                if e.pid != me and not e.zombie and (e.pid in wanted or (group and e.pgid in wanted))
            )
            return [e for e in found.values() if with_roots or e.pid not in wanted]

        return live

    alive, below = members(True), members(False)
    first = alive()
    _terminate(alive, first, grace)
    heads = [e for e in first if e.pid in wanted]
    for entry in heads:
        signal_process(entry, signal.SIGSTOP)  # still the reaper of its tree, but forking no more
    deadline = time.monotonic() + kill_wait
    _kill(below, deadline)
    for entry in heads:
        signal_process(entry, signal.SIGKILL)
    _kill(alive, deadline)
    return [e.pid for e in first]


def _terminate(members: Callable[[], list[ProcessEntry]], first: list[ProcessEntry], grace: float) -> None:
    """SIGTERM (and SIGCONT: a stopped process cannot act on it) to `first`, then up to `grace`
    seconds for every member to go."""
    if grace <= 0 or not first:
        return
    for entry in first:
        signal_process(entry, signal.SIGTERM)
        signal_process(entry, signal.SIGCONT)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and members():
        time.sleep(POLL_S)


def _kill(members: Callable[[], list[ProcessEntry]], deadline: float) -> None:
    """SIGKILL every member until none is left (or the deadline passes)."""
    while (live := members()) and time.monotonic() < deadline:
        for entry in live:
            signal_process(entry, signal.SIGKILL)
        time.sleep(0.01)
