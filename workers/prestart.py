"""A fork server started by the embedded head beside Ray's start, adopted by its node's Ray worker.

A Ray worker starts its fork server (`workers.forkserver`) when its first job arrives: the
server's imports and MLX's fork check (about a second on the 2-core CPU machine) came after Ray's
start. With embedded Ray the head knows the first node's server key before Ray starts (the code
version, the thread count, the interpreter, the node's GPU), so it `launch`es that server first
and names it in `PRESTARTED_ENV`, which the node's raylet and so its Ray worker inherit. The worker
`adopt`s it for a job with the same key alone, and sends each job its own whole environment (the
server was started with the head's). It is the same server, preloading the same modules, never
touching the device; the head owns it and removes it after Ray has stopped.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

from workers.forkserver import NOTE_SUFFIX, ForkServer, new_socket_path
from workers.processes import pid_alive

# JSON {"path", "pid", "key"}: the server the head started, for a Ray worker of that key to adopt
PRESTARTED_ENV = "ORCHESTRATE_PRESTARTED_SERVER"
ADOPTED_NOTE = "started beside Ray's start"


def launch(env: dict[str, str], key: tuple[str, ...]) -> ForkServer | None:
    """Start a server with `env` and return at once, named in `PRESTARTED_ENV` for `key`'s jobs
    (None: its process could not start)."""
    path = new_socket_path()
    argv = [sys.executable, "-m", "workers.forkserver", path, "mlx"]
    try:
        proc = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
    except OSError:
        os.rmdir(os.path.dirname(path))
        return None
    os.environ[PRESTARTED_ENV] = json.dumps({"path": path, "pid": proc.pid, "key": list(key)})
    return ForkServer(path, proc)


def adopt(key: tuple[str, ...], timeout: float = 300.0) -> ForkServer | None:
    """The server `PRESTARTED_ENV` names, once ready, when it was started for `key`; None when it
    was not (no server, another key), or it ended first (it found MLX unsafe to fork, or failed),
    or is not ready within `timeout`."""
    try:
        info = json.loads(os.environ.get(PRESTARTED_ENV, ""))
        path, pid, its_key = str(info["path"]), int(info["pid"]), tuple(info["key"])
    except (ValueError, KeyError, TypeError):
        return None
    if its_key != key:
        return None
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):  # the server binds its socket once its imports and checks are done
        if time.monotonic() > deadline or not pid_alive(pid):
            return None
        time.sleep(0.01)
    try:
        with open(path + NOTE_SUFFIX) as f:
            note = f.read().strip()
    except OSError:
        return None
    return ForkServer(path, note=f"{note}, {ADOPTED_NOTE}", adopted=True)


def withdraw(server: ForkServer | None) -> None:
    """In the head, after Ray has stopped: stop the server `launch` started and stop naming it."""
    os.environ.pop(PRESTARTED_ENV, None)
    if server is not None:
        server.close()
