"""A warm process that jobs and model samples are forked from: imports done, no device, no weights.

A fresh `python -m workers run` pays Python's start-up and the imports of NumPy, pyarrow,
pydantic, MLX and mlx-lm's model classes before any work (mlx-lm's package start-up, which imports
transformers and torch, is skipped everywhere: `kernels.mlx_lm_classes`). The method asks for a
fresh process per job and per cold model sample, not for those imports: so each host's Ray worker
keeps one server that has done the imports once and forks a child per job or sample. Each child is
still a process of its own with no MLX state: the server never touches the device (no context, no
arrays, no compiled kernels in memory; MLX's on-disk JIT cache is shared), and it refuses to
preload MLX where the import alone opened a GPU device (a forked child could not use it). There
(MLX's CUDA backend: its import opens /dev/nvidia*) it loads only MLX's native library and the
CUDA libraries it links (cuBLAS, cuDNN, NVRTC: no device opened).

The server forks from one thread only: a lock that another thread holds at the fork (an
allocator's, the import lock) stays held forever in the child, which may deadlock (Python 3.12
warns of such a fork). It starts no thread (one `select` loop, woken by SIGCHLD), keeps Arrow's
jemalloc from starting its background thread, and counts its threads at every fork (`fork`): a
server that finds another refuses to start, or ends, and its callers start fresh interpreters.

Protocol, over a Unix socket (mode 0600, in a 0700 directory): a client sends one JSON line
`{"entry", "args", "env", "cwd"}` with its stdout and stderr descriptors (SCM_RIGHTS); the server
forks, applies `env` to the child's environment (None removes a key), answers `{"pid": N}`, and
`{"exit": CODE}` when the child ends (negative: the signal). A client that goes away first has its
child's process group killed. The server ends with its parent (`PR_SET_PDEATHSIG`), and its
children with it. Linux only: elsewhere (macOS, where forking after Apple's frameworks load is
unsafe) callers start fresh interpreters. This module is the server's process;
`workers.proc.spawn` is what a client uses to start, reach and use one.
"""

from __future__ import annotations

import contextlib
import ctypes
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

from workers.proc.tree import become_subreaper, end_descendants

SOCKET_ENV = "ORCHESTRATE_FORK_SERVER"  # the socket of the server a job's own children may use
NOTE_ENV = "ORCHESTRATE_FORK_SERVER_NOTE"  # what that server preloaded
FORKED_ENV = "ORCHESTRATE_FORKED"  # set in a forked child: "1"
PARENT_ENV = "ORCHESTRATE_PARENT_PID"  # a fresh interpreter ends with this process (`die_with_parent`)
# Entry points a child may run: name -> module whose `main(argv) -> int` it calls.
ENTRIES = {"workers": "workers.__main__", "model_runner": "workers.job.model"}
# Everything a job's process imports on its way (a module first imported in the child costs every
# job its import: pandas, which pyarrow imports on a job's first `Table.from_pylist`, most of all).
BASE_PRELOAD = (
    "numpy",
    "pyarrow",
    "pyarrow.parquet",
    "pyarrow.compute",
    "pydantic",
    "workers.__main__",
    "workers.job.runner",
    "workers.job.model",
    "workers.lock.gpu",
    "workers.lock.slot",
    "workers.lock.probes",
    "workers.host.peaks",
)
OPTIONAL_PRELOAD = ("pandas", "pyarrow.pandas_compat", "pyarrow.vendored.version")  # pyarrow with pandas
MLX_PRELOAD = (
    "mlx.core",
    "mlx.nn",
    "kernels.qmm",
    "kernels.moe",
    "kernels.mlp",
    "kernels.model",
    "kernels.dispatch",
    "mlx_lm.models.cache",
    "mlx_lm.models.llama",
    "mlx_lm.models.gemma3_text",
)
# What a server preloads of MLX, tried in this order until a forked child can use what it loaded:
# everything (MLX_PRELOAD); only MLX's native library and what it links (`libmlx.so` opened by
# the dynamic loader, no Python module: MLX's module start opens the GPU); nothing.
PRELOAD_MODES = ("mlx", "mlx-library", "none")
PRELOAD_NOTES = {"mlx": "mlx preloaded", "mlx-library": "mlx's native library preloaded", "none": "mlx not preloaded"}
# Not preloaded: modules that make MLX arrays when imported (`kernels.gemv_nvfp4`'s lookup tables,
# and what imports it), which every child would inherit (tests/workers/test_forkserver.py checks).
DEVICE_FILES = ("/dev/nvidia", "/dev/kfd", "/dev/dri")
PR_SET_PDEATHSIG = 1
WAKE_POLL_S = 1.0  # the server's loop also looks for ended children this often (a missed wakeup)
# Arrow's bundled jemalloc starts a background purging thread when pyarrow loads; the server sets
# this while it preloads (and then removes it: a child does not inherit the setting).
ARROW_JEMALLOC_ENV = "JE_ARROW_MALLOC_CONF"
NO_BACKGROUND_THREAD = "background_thread:false"


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
    """Whether this platform forks jobs from a warm server (Linux); elsewhere fresh interpreters."""
    return sys.platform.startswith("linux")


def _die_with_parent() -> None:
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def die_with_parent() -> None:
    """In a job's fresh interpreter: end when the Ray worker that started it ends (Linux).

    The parent is named by `ORCHESTRATE_PARENT_PID`; if it is gone already, exit at once.
    """
    raw = os.environ.pop(PARENT_ENV, "")
    if not raw.isdigit() or not supported():
        return
    _die_with_parent()
    if os.getppid() != int(raw):
        os._exit(1)


def device_files_open() -> list[str]:
    """GPU device files this process has open (an import that opened the device shows here)."""
    found = []
    with contextlib.suppress(OSError):
        for fd in os.listdir("/proc/self/fd"):
            with contextlib.suppress(OSError):
                target = os.readlink(f"/proc/self/fd/{fd}")
                if target.startswith(DEVICE_FILES):
                    found.append(target)
    return sorted(set(found))


def _preload(modules: tuple[str, ...], *, optional: tuple[str, ...] = ()) -> None:
    # mlx-lm's model classes without its package start-up (transformers, torch): the samples
    # never need those, and a child that does (a real checkpoint's loader) imports them itself.
    from kernels import mlx_lm_classes

    mlx_lm_classes.install()
    for name in modules:
        importlib.import_module(name)
    for name in optional:
        with contextlib.suppress(ImportError):
            importlib.import_module(name)


def _load_mlx_library() -> bool:
    """Open MLX's native library (and, through the dynamic loader, the CUDA libraries it links)
    without importing MLX's Python module; False where this MLX has no such library."""
    import importlib.util

    spec = importlib.util.find_spec("mlx")
    for folder in (spec and spec.submodule_search_locations) or []:
        library = os.path.join(folder, "lib", "libmlx.so")
        if os.path.exists(library):
            ctypes.CDLL(library, mode=ctypes.RTLD_GLOBAL)
            return True
    return False


# ------------------------------------------------------------------------------------ the server


def _forked_child_works(mlx: bool, timeout: float = 120.0) -> bool:
    """Fork a child (that runs one small MLX op on the default device, with `mlx`); True when it
    succeeded in time.

    A backend whose import left state a forked child cannot use (a thread, a driver handle) shows
    here once, at the server's start, instead of as a hung or crashed job.

    Raises:
        ThreadedFork: The server had another thread when it forked.
    """
    pid = fork()
    if pid == 0:
        code = 1
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, 1)
            os.dup2(devnull, 2)
            if mlx:
                import mlx.core as mx

                code = 0 if mx.sum(mx.ones((64, 64)) @ mx.ones((64, 64))).item() == 64.0**3 else 1
            else:
                code = 0
        finally:
            os._exit(code)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status) == 0
        time.sleep(0.02)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    return False


def _detach(closing: list[socket.socket]) -> None:
    """In a child just forked from the server: drop the server's sockets (`closing`), wakeup fd and
    signal handlers; a process group of its own, ended with the server, a subreaper."""
    signal.set_wakeup_fd(-1)  # the server's: not the child's
    for sock in closing:
        sock.close()
    os.setpgid(0, 0)
    _die_with_parent()
    become_subreaper()  # whatever the job starts stays below it, found and ended with it
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _child(request: dict[str, Any], fds: list[int], closing: list[socket.socket]) -> None:
    """In the forked child: become the requested process, run its entry, exit. Never returns."""
    code = 1
    try:
        _detach(closing)
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
            _end_leftovers()
        os._exit(code)


def _end_leftovers() -> None:
    """End what the job left running (a subreaper: its orphans are its children now)."""
    me = os.getpid()
    try:
        with open(f"/proc/{me}/task/{me}/children") as f:  # cheap: no process table walk when empty
            if not f.read().split():
                return
    except OSError:
        pass  # no such file (not Linux): walk the table
    end_descendants(me, kill_wait=5.0)


def serve(path: str, preload: str) -> int:
    """Run the server at socket `path` until its parent dies or it is told to stop (SIGTERM);
    `preload`: one of PRELOAD_MODES.

    Raises:
        ThreadedFork: A thread appeared in the server after its start (it ends; its clients' next
            requests fail, and they start fresh interpreters).
    """
    _die_with_parent()
    t0 = time.perf_counter()
    given = os.environ.get(ARROW_JEMALLOC_ENV)
    os.environ[ARROW_JEMALLOC_ENV] = f"{given},{NO_BACKGROUND_THREAD}" if given else NO_BACKGROUND_THREAD
    _preload(BASE_PRELOAD, optional=OPTIONAL_PRELOAD)
    if given is None:
        del os.environ[ARROW_JEMALLOC_ENV]
    else:
        os.environ[ARROW_JEMALLOC_ENV] = given
    # The host facts that cannot change within a run (CPU model, memory, GPU name and driver),
    # read once here and inherited by every child; what can change per job stays per job.
    from workers.host.fingerprint import warm_static_facts

    warm_static_facts()
    if preload == "mlx":
        _preload(MLX_PRELOAD)
    elif preload == "mlx-library" and not _load_mlx_library():
        print("unsafe: this MLX has no native library to preload", flush=True)
        return 3
    opened = device_files_open() if preload != "none" else []
    if opened:  # a forked child could not use a device its parent's import opened
        print(f"unsafe {' '.join(opened)}", flush=True)
        return 3
    try:
        works = _forked_child_works(mlx=preload != "none")
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
