"""A job's process forked ahead, with its device already opened, while the previous job winds down.

Every job runs in a fresh process, and on a GPU a fresh process pays the driver's start before its
first kernel: on the H200 MLX's import opens the device and took 0.21-0.28 s of each job (its
`fingerprint` phase), a sixth of a 512-token qmm job. That start does not depend on the job. So as
soon as a job has left the GPU lock (its measurement done; what is left is writing its rows and
exiting) it asks the fork server (`workers.proc.forkserver`) for a *standby*: a child forked now that
opens the device (`workers.host.fingerprint.detect_backend`: MLX's import and its default device, and
one 1-element array made and freed so that the context exists; no buffer kept, peak memory reset,
no weights) and then waits for a job. The next job's request is handed to the
standby instead of forking a new child, so the driver's start runs in the gap between the two jobs
(the previous process's exit, the Ray task's return, the next task's dispatch) instead of inside the
next job. The method is unchanged: each job still has a process of its own, with no state from any
other job, and it measures under the lock as ever; the rows' `process` phase says the device was
opened ahead.

A standby is used only by a `workers` job (never a model sample, whose cold start is what it
measures) whose environment agrees with the standby's on everything that can reach the device or
MLX at start (`device_env`); otherwise the job is forked as before. One that no job claims within
`WAIT_S` (10 s; `ORCHESTRATE_STANDBY_WAIT_S`) is dropped by the server (and exits), and it ends with
the server. `ORCHESTRATE_STANDBY`: `1` always, `0`
never; unset: where the host has a GPU device file (an NVIDIA or AMD GPU), as the CPU backend has
no driver to start.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import socket
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

ENV = "ORCHESTRATE_STANDBY"
WAIT_ENV = "ORCHESTRATE_STANDBY_WAIT_S"
# a standby no job claims within this is dropped (its context is not left open for long)
WAIT_S = float(os.environ.get(WAIT_ENV, "") or 10.0)
NOTE = "its device opened ahead, between jobs"
# What may reach the device, the driver or MLX when a process starts: these must agree between a
# standby and the job handed to it. Everything else (Ray's own variables, the job's start time) is
# read by the job's code after the handover, from the environment it then gets.
DEVICE_PREFIXES = (
    "CUDA", "MLX", "NVIDIA", "NCCL", "HIP", "ROCR", "ROCM", "HSA", "GPU", "OMP", "MKL", "OPENBLAS", "LD_",
    "PYTHON", "XDG_", "TMP", "TEMP", "ORCHESTRATE_FAKE_GPUS",
)  # fmt: skip
DEVICE_KEYS = ("HOME", "PATH")
NOT_DEVICE = ("PYTHONBREAKPOINT",)  # Ray sets it in its workers; only `breakpoint()` reads it
GPU_DEVICE_FILES = ("/dev/nvidiactl", "/dev/kfd")
REQUEST = b'{"standby": true}\n'
AHEAD_ENV = "ORCHESTRATE_DEVICE_OPENED_AHEAD_S"  # in a job handed to a standby: how long its device took to open


def enabled() -> bool:
    """Whether this host's fork server keeps standbys (`ORCHESTRATE_STANDBY`, else a GPU device file)."""
    wanted = os.environ.get(ENV, "").strip()
    if wanted in ("0", "1"):
        return wanted == "1"
    return any(os.path.exists(path) for path in GPU_DEVICE_FILES)


def device_env(env: Mapping[str, str]) -> dict[str, str]:
    """The part of an environment a process's device start can depend on."""
    return {k: v for k, v in env.items() if (k in DEVICE_KEYS or k.startswith(DEVICE_PREFIXES)) and k not in NOT_DEVICE}


@dataclass
class Standby:
    """The server's handle on a standby: its pid, its end of the control pair, its device environment."""

    pid: int
    ctl: socket.socket
    key: dict[str, str]
    since: float  # time.monotonic() at its fork

    def expired(self) -> bool:
        """Whether no job claimed it within WAIT_S (the server then drops it)."""
        return time.monotonic() - self.since > WAIT_S

    def serves(self, env: Mapping[str, str]) -> bool:
        """Whether a job with this whole environment may be handed to this standby."""
        return device_env(env) == self.key

    def hand_over(self, data: bytes, fds: list[int]) -> bool:
        """Send a fork request (and its stdout and stderr) to the standby; False if it is gone."""
        try:
            socket.send_fds(self.ctl, [data], fds)
            return True
        except OSError:
            return False
        finally:
            self.ctl.close()

    def drop(self) -> None:
        """Let it go: closing its control end tells it to exit (the server reaps it)."""
        with contextlib.suppress(OSError):
            self.ctl.close()


def fork(env: Mapping[str, str], closing: list[socket.socket], become: Callable[..., None]) -> Standby:
    """Fork a standby that starts with `env` as its whole environment (`closing`: the server's
    sockets, which it closes); `become(request, fds, closing)` is what it turns into when a job
    is handed to it (`workers.proc.forkserver._child`, which detaches it from the server once more:
    harmless)."""
    mine, theirs = socket.socketpair()
    pid = os.fork()
    if pid == 0:
        mine.close()
        _wait(dict(env), theirs, closing, become)  # never returns
    theirs.close()
    return Standby(pid, mine, device_env(env), time.monotonic())


def _wait(env: dict[str, str], ctl: socket.socket, closing: list[socket.socket], become: Callable[..., None]) -> None:
    """In the standby: open the device, wait for a job (at most WAIT_S), become it. Never returns."""
    code = 0
    try:
        from workers.proc.forkserver import detach

        detach(closing)
        os.environ.clear()
        os.environ.update(env)
        t0 = time.perf_counter()
        with open(os.devnull, "w") as quiet, contextlib.redirect_stdout(quiet), contextlib.redirect_stderr(quiet):
            import mlx.core as mx

            from workers.host.fingerprint import detect_backend

            detect_backend()  # MLX's import and its default device: the driver's start
            mx.eval(mx.zeros((1,)))  # and the context, where the backend makes it at the first array
            mx.synchronize()
            mx.clear_cache()  # that array is gone: no buffer kept, no peak left for the job
            mx.reset_peak_memory()
        opened = time.perf_counter() - t0
        # The server decides when it has waited long enough (it drops it: the pair closes), so a job
        # is never handed to a standby on its way out; this wait is only in case the server hangs.
        if not select.select([ctl], [], [], 3 * WAIT_S)[0]:
            os._exit(0)
        data, fds, _flags, _addr = socket.recv_fds(ctl, 65536, 2)
        if not data or len(fds) != 2:  # dropped
            os._exit(0)
        request = json.loads(data)
        request.setdefault("env", {})[AHEAD_ENV] = f"{opened:.6f}"
        become(request, fds, [ctl])  # never returns
    except BaseException:
        code = 1
    os._exit(code)


def ask() -> bool:
    """From a job's process, once it has left the GPU lock: ask the server it was forked from for a
    standby for the next job. False where there is none to ask (a fresh interpreter) or it refused."""
    from workers.proc.forkserver import FORKED_ENV, SOCKET_ENV

    path = os.environ.get(SOCKET_ENV, "")
    if os.environ.get(FORKED_ENV) != "1" or not path or not enabled():
        return False
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.settimeout(5.0)
            conn.connect(path)
            conn.sendall(REQUEST)
            answer = conn.recv(4096)
    except OSError:
        return False
    with contextlib.suppress(ValueError):
        return bool(json.loads(answer.split(b"\n", 1)[0]).get("standby"))
    return False
