"""The embedded instance's head node: `ray start --head --block` as a child of the run, then joined.

`ray.init(address="local")` starts the head in the driver with everything a cluster may need, and
no switch for what this single-machine instance does not: the autoscaler monitor (a Python process,
and 1.1 s of Ray's stop on the 2-core CPU machine), the log monitor (the run reads no worker logs:
`log_to_driver=False`), and a raylet that waits for its dashboard agent to report the ports it
picked (1.3-1.5 s there). `ray start` has the options for each (Ray 2.60's own CLI, pinned in
pyproject.toml): `--no-monitor` (hidden in its help, kept for the autoscaler's own use, as `cluster
up` uses it), `--include-log-monitor false`, and the agents' ports given (`--dashboard-agent-*-port`,
`--runtime-env-agent-port`, `--metrics-export-port`) with Ray's metrics off
(`RAY_enable_metrics_collection=0`, `head.RAY_BIND_ENV`): then the raylet needs no port report and
registers as soon as its agents answer. The run then joins it as a driver (`ray.init(address=...)`).
Side by side on the CPU machine (BENCHMARKS.md): the first task ran 0.7-1.0 s sooner.

What stays as with `ray.init`: the node's labels, its one `gpu_slot`, one CPU, token authentication
(the head's token, inherited through the environment), and its end with the run. The launcher sets
`PR_SET_PDEATHSIG` (`embedded._LAUNCH`), so a head killed outright still stops its node; `stop`
ends the node (SIGTERM to `ray start --block`, which stops every process it started; SIGKILL to
its process group after a grace period, for anything left).

The ports are picked free just before the start (bound to port 0 together, then released). Another
process may take one in between: the node then exits at start, and the start is tried once more
with fresh ports. `ray start` also starts its Ray Client server whenever grpc is installed, with no
switch to leave it out; it gets a picked port too, not Ray's fixed 10001 (which another Ray on the
machine may hold).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from orchestrator.errors import InfrastructureError
from orchestrator.head import JOINED, RAY_BIND_ENV, RAY_CLI

START_TIMEOUT_S = 120.0  # a loaded 2-core machine takes seconds; 8 GPUs' nodes starting beside it, more
STOP_GRACE_S = 10.0
STARTS = 2  # the second with fresh ports: a picked port may be taken before Ray binds it
LOG_TAIL_LINES = 5
POLL_S = 0.05
LOG = "ray-start.log"
_COLOURS = re.compile(r"\x1b\[[0-9;]*m")
_PORT_OPTIONS = (
    "--port",
    "--ray-client-server-port",
    "--dashboard-agent-listen-port",
    "--dashboard-agent-grpc-port",
    "--runtime-env-agent-port",
    "--metrics-export-port",
)


def free_ports(count: int) -> list[int]:
    """`count` distinct TCP ports that were free a moment ago (bound together to port 0, then closed)."""
    socks = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(count)]
    try:
        for sock in socks:
            sock.bind(("", 0))
        return [int(sock.getsockname()[1]) for sock in socks]
    finally:
        for sock in socks:
            sock.close()


def tail(log: Path, lines: int = LOG_TAIL_LINES) -> str:
    """The last non-empty lines of a log, joined with ` | ` (`(no log)` when it cannot be read)."""
    try:
        text = _COLOURS.sub("", log.read_text(errors="replace"))  # `ray start` colours its output, even into a file
        kept = [ln.strip() for ln in text.splitlines() if ln.strip()]
    except OSError:
        return "(no log)"
    return " | ".join(kept[-lines:]) or "(empty)"


class EmbeddedHead:
    """The head node of an embedded instance, started by `ray start` in a process group of its own."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen[bytes] | None = None
        self.address: str | None = None  # `127.0.0.1:<GCS port>` once started
        self._dir: Path | None = None  # holds the log of `ray start`
        self._labels: dict[str, str] = {}
        self._cpus = 1
        self._attempt = 0
        self._port = 0

    def start(self, labels: dict[str, str], *, num_cpus: int, timeout: float = START_TIMEOUT_S) -> str:
        """`launch`, then `wait`: start the node and return the GCS address a driver joins."""
        self.launch(labels, num_cpus=num_cpus)
        return self.wait(timeout)

    def launch(self, labels: dict[str, str], *, num_cpus: int) -> None:
        """Launch `ray start` for a node with `labels`, one `gpu_slot` and `num_cpus` CPUs; return at once."""
        self._dir = Path(tempfile.mkdtemp(prefix="orchestrate-head-"))
        self._labels, self._cpus, self._attempt = dict(labels), num_cpus, 1
        self._spawn()

    def _spawn(self) -> None:
        from orchestrator.embedded import _LAUNCH  # the launcher the extra GPU nodes use

        assert self._dir is not None
        ports = free_ports(len(_PORT_OPTIONS))
        argv = [
            sys.executable, "-c", _LAUNCH, str(os.getpid()),
            sys.executable, *RAY_CLI, "start", "--head", "--block",
            *[arg for option, port in zip(_PORT_OPTIONS, ports, strict=True) for arg in (option, str(port))],
            "--num-cpus", str(self._cpus), "--resources", json.dumps({"gpu_slot": 1}),
            "--labels", ",".join(f"{k}={v}" for k, v in self._labels.items()),
            "--include-dashboard", "false", "--include-log-monitor", "false", "--no-monitor",
            "--disable-usage-stats",
        ]  # fmt: skip
        with (self._dir / LOG).open("wb") as out:
            self.proc = subprocess.Popen(
                argv, env={**os.environ, **RAY_BIND_ENV}, stdin=subprocess.DEVNULL, stdout=out,
                stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip
        self._port = ports[0]

    def wait(self, timeout: float = START_TIMEOUT_S) -> str:
        """Wait until the launched node runs (launching it once more with fresh ports when it exits
        at start); return the GCS address a driver joins.

        Raises:
            InfrastructureError: the node exited at start (twice) or did not start in time; nothing
                of it is left running.
        """
        assert self.proc is not None and self._dir is not None
        log = self._dir / LOG
        deadline = time.monotonic() + timeout
        while not self._wait_started(log, deadline):
            if self._attempt >= STARTS:
                message = f"the Ray head node exited at start ({self.proc.returncode}); last lines of `ray start`: "
                message += tail(log)  # before `stop` removes it
                self.stop()
                raise InfrastructureError(message)
            self._attempt += 1
            self._spawn()
        self.address = f"127.0.0.1:{self._port}"
        return self.address

    def _wait_started(self, log: Path, deadline: float) -> bool:
        """True once `ray start` says its node runs; False when it exited first.

        Raises:
            InfrastructureError: neither within the deadline (the node is stopped).
        """
        assert self.proc is not None
        while True:
            with contextlib.suppress(OSError):
                if JOINED in log.read_text(errors="replace"):
                    return True
            if self.proc.poll() is not None:
                return False
            if time.monotonic() > deadline:
                text = tail(log)
                self.stop()
                raise InfrastructureError(f"the Ray head node did not start in time; last lines of `ray start`: {text}")
            time.sleep(POLL_S)

    def stop(self) -> None:
        """End the node's whole process group (GCS, raylet, agents, workers, jobs) and its log."""
        proc, self.proc, self.address = self.proc, None, None
        if proc is not None:
            # `ray start` alone: it stops its processes in 0.7 s; SIGTERM to its whole group at once
            # kept it waiting on them for 10-30 s on the CPU machine
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(proc.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(STOP_GRACE_S)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)  # what ignored the SIGTERM, or outlived its `ray start`
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(5)
        if self._dir is not None:
            for path in self._dir.iterdir():
                path.unlink(missing_ok=True)
            self._dir.rmdir()
            self._dir = None
