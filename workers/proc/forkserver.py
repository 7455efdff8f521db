"""The fork server: a process that jobs and model samples are forked from, imports done, no device.

The method asks for a fresh process per job and per cold model sample, not for Python's start-up
and the imports (NumPy, pyarrow, pydantic, MLX, mlx-lm's model classes) each time: so each host's
Ray worker keeps one server that has done the imports once (`workers.proc.preload`) and forks a
child per job or sample. Each child is still a process of its own with no MLX state: the server
never touches the device (no context, no arrays, no compiled kernels in memory; MLX's on-disk JIT
cache is shared). It starts no thread (one `select` loop, woken by SIGCHLD) and forks from one
thread only (`workers.proc.fork`): a server that finds another thread refuses to start, or ends,
and its callers start fresh interpreters.

Protocol, over a Unix socket (mode 0600, in a 0700 directory): a client sends one JSON line
`{"entry", "args", "env", "cwd"}` with its stdout and stderr descriptors (SCM_RIGHTS); the server
forks, applies `env` to the child's environment (None removes a key), answers `{"pid": N}`, and
`{"exit": CODE}` when the child ends (negative: the signal). A client that goes away first has its
child's process group killed. The server ends with its parent (`PR_SET_PDEATHSIG`), and its
children with it. Linux only (`workers.proc.fork.supported`): elsewhere callers start fresh
interpreters. This module is the server's process; `workers.proc.spawn` is what a client uses to
start, reach and use one.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import select
import signal
import socket
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

from workers.proc.fork import ThreadedFork, detach, end_leftovers, end_with_parent, fork
from workers.proc.preload import (
    MLX_PRELOAD,
    PRELOAD_MODES,
    PRELOAD_NOTES,
    device_files_open,
    forked_child_works,
    import_modules,
    load_mlx_library,
    preload_base,
)
from workers.proc.tree import end_descendants

SOCKET_ENV = "ORCHESTRATE_FORK_SERVER"  # the socket of the server a job's own children may use
NOTE_ENV = "ORCHESTRATE_FORK_SERVER_NOTE"  # what that server preloaded
FORKED_ENV = "ORCHESTRATE_FORKED"  # set in a forked child: "1"
# Entry points a child may run: name -> module whose `main(argv) -> int` it calls.
ENTRIES = {"workers": "workers.__main__", "model_sample": "workers.job.model_sample"}
WAKE_POLL_S = 1.0  # the server's loop also looks for ended children this often (a missed wakeup)


# ------------------------------------------------------------------------------------ the server


def _child(request: dict[str, Any], fds: list[int], closing: list[socket.socket]) -> None:
    """In the forked child: become the requested process, run its entry, exit. Never returns."""
    code = 1
    try:
        detach(closing)
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.dup2(fds[0], 1)
        os.dup2(fds[1], 2)
        for fd in (devnull, *fds):
            os.close(fd)
        for key, value in (request.get("env") or {}).items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        os.environ[FORKED_ENV] = "1"
        if request.get("cwd"):
            os.chdir(request["cwd"])
        sys.argv = [request["entry"], *request["args"]]
        main: Callable[[list[str]], int] = importlib.import_module(ENTRIES[request["entry"]]).main
        code = int(main(list(request["args"])) or 0)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        with contextlib.suppress(Exception):
            end_leftovers()
        os._exit(code)


def serve(path: str, preload: str) -> int:
    """Run the server at socket `path` until its parent dies or it is told to stop (SIGTERM);
    `preload`: one of PRELOAD_MODES.

    Raises:
        ThreadedFork: A thread appeared in the server after its start (it ends; its clients' next
            requests fail, and they start fresh interpreters).
    """
    end_with_parent()
    t0 = time.perf_counter()
    preload_base()
    # The host facts that cannot change within a run (CPU model, memory, GPU name and driver),
    # read once here and inherited by every child; what can change per job stays per job.
    # Imported after the preload: it imports pyarrow, which must see the jemalloc setting first.
    from workers.host.fingerprint import read_static_facts

    read_static_facts()
    if preload == "mlx":
        import_modules(MLX_PRELOAD)
    elif preload == "mlx-library" and not load_mlx_library():
        print("unsafe: this MLX has no native library to preload", flush=True)
        return 3
    opened = device_files_open() if preload != "none" else []
    if opened:  # a forked child could not use a device its parent's import opened
        print(f"unsafe {' '.join(opened)}", flush=True)
        return 3
    try:
        works = forked_child_works(mlx=preload != "none")
    except ThreadedFork as exc:  # a preloaded module started a thread: no fork is safe here
        print(f"unsafe: {exc}", flush=True)
        return 3
    if not works:
        print("unsafe: MLX failed or hung in a forked child", flush=True)
        return 3
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    os.chmod(path, 0o600)
    listener.listen(16)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    print(f"ready {os.getpid()} {time.perf_counter() - t0:.3f} {PRELOAD_NOTES[preload]}", flush=True)
    clients: dict[int, socket.socket] = {}  # child pid -> its client's connection
    conns: set[socket.socket] = set()  # open client connections
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)  # nobody reads the pipe the ready line went to
    os.close(devnull)
    # A child's exit wakes the loop (SIGCHLD through Python's wakeup fd), so its client hears of it
    # at once rather than at the next poll.
    wake, waker = socket.socketpair()
    for end in (wake, waker):
        end.setblocking(False)
    signal.set_wakeup_fd(waker.fileno(), warn_on_full_buffer=False)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    while True:
        readable, _, _ = select.select([listener, wake, *conns], [], [], WAKE_POLL_S)
        for sock in readable:
            if sock is wake:
                with contextlib.suppress(BlockingIOError):
                    while wake.recv(4096):
                        pass
                continue
            if sock is listener:
                conn, _ = listener.accept()
                conns.add(conn)
                continue
            try:
                data, fds, _flags, _addr = socket.recv_fds(sock, 65536, 2)
            except OSError:
                data, fds = b"", []
            if not data:  # the client left: its child (if any) goes too
                conns.discard(sock)
                for pid, conn in list(clients.items()):
                    if conn is sock:
                        end_tree(pid)
                sock.close()
                continue
            if not data.endswith(b"\n") or len(fds) != 2:  # one request per message, with two fds
                for fd in fds:
                    os.close(fd)
                conns.discard(sock)
                sock.close()
                continue
            request = json.loads(data)
            pid = fork()
            if pid == 0:
                _child(request, fds, [listener, wake, waker, *conns])
            for fd in fds:
                os.close(fd)
            clients[pid] = sock
            sock.sendall(json.dumps({"pid": pid}).encode() + b"\n")
        _reap(clients, conns)


def _reap(clients: dict[int, socket.socket], conns: set[socket.socket]) -> None:
    """Reap every ended child, telling each one's client its exit code."""
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        conn = clients.pop(pid, None)
        if conn is not None and conn in conns:
            code = os.waitstatus_to_exitcode(status)
            with contextlib.suppress(OSError):
                conn.sendall(json.dumps({"exit": code}).encode() + b"\n")


def end_tree(pid: int) -> None:
    """End process `pid` and every descendant (`workers.proc.tree`: the root is stopped first, so
    nothing is orphaned past it), then whatever is left of its process group."""
    end_descendants(pid, group=True, kill_wait=10.0)


def main(argv: list[str] | None = None) -> int:
    """`python -m workers.proc.forkserver SOCKET MODE` (MODE: one of PRELOAD_MODES)."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2 or args[1] not in PRELOAD_MODES:
        print(f"usage: python -m workers.proc.forkserver SOCKET {'|'.join(PRELOAD_MODES)}", file=sys.stderr)
        return 2
    return serve(args[0], preload=args[1])


if __name__ == "__main__":
    sys.exit(main())
