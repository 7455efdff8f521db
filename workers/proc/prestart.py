"""A fork server started by the embedded head beside Ray's start, adopted by its node's Ray worker;
and the host's warming for the first job (`Warming`, `workers.job.warm`), started there too.

A Ray worker starts its fork server (`workers.proc.forkserver`) when its first job arrives: the
server's imports and MLX's fork check (about a second on the 2-core CPU machine) came after Ray's
start. With embedded Ray the head knows the first node's server key before Ray starts (the code
version, the thread count, the interpreter, the node's GPU), so it `launch`es that server first
(`ForkServer.start` in a thread of its own, falling back through the preload modes as ever) and
names it in `PRESTARTED_ENV`, which the node's raylet and so its Ray worker inherit. The worker
`adopt`s it for a job with the same key alone, and sends each job its own whole environment (the
server was started with the head's). It is the same server, preloading the same modules, never
touching the device; the head owns it and removes it after Ray has stopped (`withdraw`).
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
import threading
import time

from workers.proc.forkserver import NOTE_SUFFIX, PARENT_ENV, end_tree
from workers.proc.spawn import ForkServer, new_socket_path
from workers.proc.table import pid_alive

# JSON {"path", "pid" (the head's), "key"}: the server the head starts, for a worker of that key
PRESTARTED_ENV = "ORCHESTRATE_PRESTARTED_SERVER"
ADOPTED_NOTE = "started beside Ray's start"
FAILED_SUFFIX = ".failed"  # beside the socket: the server did not start (an adopter stops waiting)
WARM_ENV = "ORCHESTRATE_WARM"  # `workers.job.warm` beside Ray's start: 1 / 0; unset: on GPU backends
WARM_TIMEOUT_S = 120.0  # the head waits this long for it at most (a cold JIT cache took 9 s on the H200)


class Prestarted:
    """The head's handle on a server starting, or started, in a thread of its own.

    The thread stays until `withdraw`: a server ends with the thread that started it (its parent
    death signal, `PR_SET_PDEATHSIG`, follows the thread), not only with the head.
    """

    def __init__(self, env: dict[str, str]) -> None:
        self.path = new_socket_path()
        self.server: ForkServer | None = None
        self.process: subprocess.Popen[bytes] | None = None  # the latest process `ForkServer.start` made
        self._settled = threading.Event()  # the start returned: a server, or none
        self._release = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(env,), name="fork-server-prestart", daemon=True)
        self._thread.start()

    def _run(self, env: dict[str, str]) -> None:
        try:
            self.server = ForkServer.start(env, path=self.path, on_process=self._started)
        except OSError:
            with contextlib.suppress(OSError), open(self.path + FAILED_SUFFIX, "w"):
                pass
        self._settled.set()
        self._release.wait()

    def _started(self, proc: subprocess.Popen[bytes]) -> None:
        self.process = proc

    def stop(self) -> None:
        """End the server (ready or still starting) and its thread; remove its directory."""
        if self.server is None and self.process is not None and self.process.poll() is None:
            self.process.kill()  # still starting: its start in the thread then returns at once
        self._settled.wait(timeout=60)
        if self.server is not None:
            self.server.close()
        self._release.set()
        self._thread.join(timeout=10)
        for name in (self.path, self.path + NOTE_SUFFIX, self.path + FAILED_SUFFIX):
            with contextlib.suppress(OSError):
                os.unlink(name)
        with contextlib.suppress(OSError):
            os.rmdir(os.path.dirname(self.path))


def launch(env: dict[str, str], key: tuple[str, ...]) -> Prestarted:
    """Start a server with `env`, returning at once; named in `PRESTARTED_ENV` for `key`'s jobs."""
    started = Prestarted(env)
    os.environ[PRESTARTED_ENV] = json.dumps({"path": started.path, "pid": os.getpid(), "key": list(key)})
    return started


def adopt(key: tuple[str, ...], timeout: float = 300.0) -> ForkServer | None:
    """The server `PRESTARTED_ENV` names, once ready, when it was started for `key`; None when it
    was not (no server, another key), when it did not start or its head is gone, or when it is not
    ready within `timeout`."""
    try:
        info = json.loads(os.environ.get(PRESTARTED_ENV, ""))
        path, head, its_key = str(info["path"]), int(info["pid"]), tuple(info["key"])
    except (ValueError, KeyError, TypeError):
        return None
    if its_key != key:
        return None
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):  # the server binds its socket once its imports and checks are done
        if os.path.exists(path + FAILED_SUFFIX) or not pid_alive(head) or time.monotonic() > deadline:
            return None
        time.sleep(0.01)
    try:
        with open(path + NOTE_SUFFIX) as f:
            note = f.read().strip()
    except OSError:
        return None
    return ForkServer(path, note=f"{note}, {ADOPTED_NOTE}", adopted=True)


def withdraw(started: Prestarted | None) -> None:
    """In the head, after Ray has stopped: stop naming the server, and end it."""
    os.environ.pop(PRESTARTED_ENV, None)
    if started is not None:
        started.stop()


class Warming:
    """`python -m workers warm` for a run's first job, started by the embedded head beside Ray's
    start (`workers.job.warm`: the host's peak probes and the first job's kernels compiled, under the
    GPU lock); the head `settle`s it before submitting any job, so no job waits on its lock."""

    def __init__(self, job_json: str, env: dict[str, str]) -> None:
        fd, self.path = tempfile.mkstemp(prefix="orchestrate-warm-", suffix=".json")
        with os.fdopen(fd, "w") as f:
            f.write(job_json)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "workers", "warm", self.path],
            env={**env, PARENT_ENV: str(os.getpid())},
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
        )

    def settle(self, timeout: float = WARM_TIMEOUT_S) -> str:
        """Wait for it (at most `timeout` s, then end it); its line, e.g. `peaks 0.31 s, kernels 1.20 s (12 calls)`."""
        try:
            out, _ = self.proc.communicate(timeout=timeout)
            line = out.decode(errors="replace").strip().splitlines()[-1:] or [""]
            text = line[0]
        except subprocess.TimeoutExpired:
            text = f"ended after {timeout:.0f} s"
        self.stop()
        return text

    def stop(self) -> None:
        """End it if it still runs; remove its job file."""
        if self.proc.poll() is None:
            end_tree(self.proc.pid)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=10)
        with contextlib.suppress(OSError):
            os.unlink(self.path)


def warming_wanted(backend: str) -> bool:
    """`ORCHESTRATE_WARM` (1 / 0); unset: on GPU backends (on the CPU there is no JIT cache to fill
    and the probes are quick, and it would share the cores with Ray's start)."""
    wanted = os.environ.get(WARM_ENV, "").strip()
    if wanted in ("0", "1"):
        return wanted == "1"
    return backend != "cpu"
