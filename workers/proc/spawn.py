"""The client side of the fork server (`workers.proc.forkserver`): start or reach a server, fork a job's
process from it, wait for it, end it; or a fresh interpreter where there is no server.

`ForkServer.start` launches `python -m workers.proc.forkserver` (trying its preload modes in turn);
`ForkServer.from_env` reaches the server a job's own process was forked from; `run_entry` runs an
entry point in a process of its own either way.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import time

from workers.proc.fork import PARENT_ENV
from workers.proc.forkserver import ENTRIES, NOTE_ENV, SOCKET_ENV, end_tree
from workers.proc.preload import PRELOAD_MODES


class ForkedChild:
    """A child forked by the server, seen from the client: its pid, its exit code, killing it."""

    def __init__(self, conn: socket.socket, pid: int) -> None:
        self._conn = conn
        self.pid = pid
        self.returncode: int | None = None
        self._pending = b""

    def wait(self, timeout: float | None = None) -> int:
        """The child's exit code (negative: the signal that ended it).

        Raises:
            subprocess.TimeoutExpired: It was still running after `timeout` seconds.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.returncode is None:
            left = None if deadline is None else max(deadline - time.monotonic(), 0.0)
            if left == 0.0 or not select.select([self._conn], [], [], left)[0]:
                raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout or 0.0)
            data = self._conn.recv(4096)
            if not data:  # the server died: so did the child (PDEATHSIG)
                self.returncode = -int(signal.SIGKILL)
                break
            self._pending += data
            while b"\n" in self._pending:
                line, self._pending = self._pending.split(b"\n", 1)
                message = json.loads(line)
                if "exit" in message:
                    self.returncode = int(message["exit"])
        self._conn.close()
        return self.returncode

    def kill(self) -> None:
        """Kill the child and its whole tree (it is a subreaper: also what left its group)."""
        end_tree(self.pid)


class ForkServer:
    """The client's handle on a running server (started here, or inherited through `SOCKET_ENV`)."""

    def __init__(self, path: str, proc: subprocess.Popen[bytes] | None = None, note: str = "") -> None:
        self.path = path
        self.proc = proc
        self.note = note  # what the server preloaded, for the rows

    @classmethod
    def start(
        cls,
        env: dict[str, str],
        *,
        preload: str = "mlx",
        timeout: float = 300.0,
    ) -> ForkServer:
        """Start a server with `env`; where what `preload` loads of MLX left the server unsafe to
        fork from (it opened the device, or a thread runs in it), start one with the next of
        PRELOAD_MODES.

        Raises:
            OSError: The server could not start (the caller falls back to fresh interpreters).
        """
        path = new_socket_path()
        argv = [sys.executable, "-m", "workers.proc.forkserver", path]
        modes = PRELOAD_MODES[PRELOAD_MODES.index(preload) :]
        for mode in modes:
            proc = subprocess.Popen([*argv, mode], env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE)
            assert proc.stdout is not None
            ready, _, _ = select.select([proc.stdout], [], [], timeout)
            line = proc.stdout.readline().decode().strip() if ready else ""
            if line.startswith("ready"):
                return cls(path, proc, line.split(" ", 3)[-1])
            if not line.startswith("unsafe") or mode == modes[-1]:
                break
            proc.wait()  # it exits by itself: try the next mode
        proc.kill()
        proc.wait()
        with contextlib.suppress(OSError):
            os.rmdir(os.path.dirname(path))
        raise OSError(f"fork server did not start ({line or 'no answer'})")

    @classmethod
    def from_env(cls) -> ForkServer | None:
        """The server this process was forked from, for its own children (None when there is none)."""
        path = os.environ.get(SOCKET_ENV)
        return cls(path, note=os.environ.get(NOTE_ENV, "")) if path and os.path.exists(path) else None

    def alive(self) -> bool:
        """Whether the server answers."""
        if self.proc is not None and self.proc.poll() is not None:
            return False
        return os.path.exists(self.path)

    def spawn(
        self,
        entry: str,
        args: list[str],
        *,
        env: dict[str, str | None],
        stdout: int,
        stderr: int,
        cwd: str = "",
    ) -> ForkedChild:
        """Fork a child running `entry`'s `main(args)` with `env` applied (None removes a key) to the
        server's environment.

        Raises:
            OSError: The server is gone.
        """
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            conn.connect(self.path)
            request = {
                "entry": entry,
                "args": args,
                "env": {**env, SOCKET_ENV: self.path, NOTE_ENV: self.note},
                "cwd": cwd,
            }
            socket.send_fds(conn, [json.dumps(request).encode() + b"\n"], [stdout, stderr])
            line = b""
            while not line.endswith(b"\n"):
                chunk = conn.recv(4096)
                if not chunk:
                    raise OSError("the fork server closed the connection")
                line += chunk
        except OSError:
            conn.close()
            raise
        first, _, rest = line.partition(b"\n")
        answer = json.loads(first)
        proc = ForkedChild(conn, int(answer["pid"]))
        proc._pending = rest
        return proc

    def close(self) -> None:
        """Stop a server started here (its children are killed with it)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc is None:
            return  # not ours to remove: the process that started it does
        with contextlib.suppress(OSError):
            os.unlink(self.path)
        with contextlib.suppress(OSError):
            os.rmdir(os.path.dirname(self.path))


def run_entry(
    entry: str,
    args: list[str],
    *,
    env: dict[str, str],
    changes: dict[str, str],
    stdout: int,
    stderr: int,
    timeout: float | None,
    server: ForkServer | None,
) -> tuple[int | None, str]:
    """Run `entry`'s `main(args)` in a process of its own; (exit code, how it was started).

    Forked from `server` when one is given and answers (only `changes` applied to the server's
    environment, which is `env`), else a fresh interpreter with `env` (+ `changes`). A timeout kills
    the process's group and gives exit code None.
    """
    proc: ForkedChild | subprocess.Popen[bytes] | None = None
    how = "fresh interpreter"
    if server is not None:
        try:
            proc = server.spawn(entry, args, env=dict(changes), stdout=stdout, stderr=stderr)
            how = f"forked from a fork server ({server.note}; no device state, no weights)"
        except OSError:
            proc = None
    if proc is None:
        module = ENTRIES[entry].removesuffix(".__main__")
        proc = subprocess.Popen(
            [sys.executable, "-m", module, *args],
            env={**env, **changes, PARENT_ENV: str(os.getpid())},
            stdin=subprocess.DEVNULL,
            stdout=stdout,
            stderr=stderr,
            start_new_session=True,
        )
    try:
        return proc.wait(timeout=timeout), how
    except subprocess.TimeoutExpired:
        if isinstance(proc, ForkedChild):
            proc.kill()
        else:
            end_tree(proc.pid)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=10)
        return None, how


def new_socket_path() -> str:
    """A server's socket path, in a fresh directory of mode 0700."""
    return os.path.join(tempfile.mkdtemp(prefix="orchestrate-fork-"), "socket")
