"""The Ray head on this machine and its token: start, stop, reach, authenticate.

`orchestrate cluster up` runs on the head machine: `start_head` starts `ray start --head --block`
in its own process group (pid in `<head workdir>/head.pid`, log beside it) unless a head already
listens at the inventory's address, with Ray's token authentication on. The token is Ray's own
file (`$RAY_AUTH_TOKEN_PATH`, else `~/.ray/auth_token`), made here with mode 0600 and 256 random
bits, and never printed or logged. `stop_head` stops only the head `start_head` started.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from orchestrator.errors import InfrastructureError
from orchestrator.specs import InventorySpec
from workers.processes import pid_alive

RAY_CLI = ["-m", "ray.scripts.scripts"]
HEAD_PID = "head.pid"
HEAD_LOG = "head.log"
JOINED = "Ray runtime started."  # what `ray start` prints once its node has joined the cluster


# ------------------------------------------------------------------------------------ the token


def token_path() -> Path:
    """Where the head keeps Ray's token: `$RAY_AUTH_TOKEN_PATH`, else `~/.ray/auth_token`."""
    raw = os.environ.get("RAY_AUTH_TOKEN_PATH")
    return Path(raw).expanduser() if raw else Path.home() / ".ray" / "auth_token"


def ensure_token() -> Path:
    """The head's token file, created (mode 0600, 256 random bits) when missing."""
    path = token_path()
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(secrets.token_hex(32))
    return path


def enable_token_auth() -> None:
    """Make this process (and its children) use Ray's token authentication with the head's token."""
    path = token_path()
    if not path.exists():
        raise InfrastructureError(f"no Ray token at {path}: start the cluster with `orchestrate cluster up`")
    os.environ["RAY_AUTH_MODE"] = "token"
    os.environ.setdefault("RAY_AUTH_TOKEN_PATH", str(path))
    try:  # Ray caches the token per process; a test or a second inventory may point elsewhere.
        from ray._raylet import AuthenticationTokenLoader, Config  # type: ignore[attr-defined]

        Config.initialize("")
        AuthenticationTokenLoader.instance().reset_cache()
    except (ImportError, AttributeError):
        pass


def head_address(inventory: InventorySpec) -> str:
    """`address:port` of the inventory's Ray head."""
    if inventory.head.address is None:
        raise InfrastructureError("the inventory has no [head] address: it runs on an embedded local Ray instance")
    return f"{inventory.head.address}:{inventory.head.ray_port}"


# ------------------------------------------------------------------------------------- the head


def require_head(inventory: InventorySpec, timeout: float = 3.0) -> None:
    """Fail fast when no Ray head listens at the inventory's address (`ray.init` would hang for minutes)."""
    head = inventory.head
    assert head.address is not None
    if not listening(head.address, head.ray_port, timeout):
        raise InfrastructureError(
            f"no Ray head answers at {head_address(inventory)}: start the cluster with `orchestrate cluster up`"
        )


def listening(address: str, port: int, timeout: float = 1.0) -> bool:
    try:
        with socket.create_connection((address, port), timeout=timeout):
            return True
    except OSError:
        return False


def _read_pid(path: Path) -> int | None:
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None


def start_head(inventory: InventorySpec, *, timeout: float = 60.0) -> bool:
    """Start the Ray head on this machine unless one listens already; True when we started it."""
    head = inventory.head
    assert head.address is not None
    if listening(head.address, head.ray_port):
        return False
    try:  # Ray wants an IP address for the node, not a host name
        ip = head.node_ip or socket.gethostbyname(head.address)
    except OSError:
        raise InfrastructureError(
            f"cannot resolve the head address {head.address!r}; set [head] node_ip to this machine's IP"
        ) from None
    workdir = Path(head.workdir).expanduser()
    workdir.mkdir(parents=True, exist_ok=True, mode=0o700)
    argv = [
        sys.executable, *RAY_CLI, "start", "--head", "--block", "--port", str(head.ray_port),
        "--node-ip-address", ip, "--temp-dir", str(workdir / "ray"), "--num-cpus", "0",
        "--disable-usage-stats", "--dashboard-agent-listen-port", "0",
        "--include-dashboard", "true" if head.dashboard else "false",
        "--dashboard-port", str(head.dashboard_port), "--dashboard-host", ip,
    ]  # fmt: skip
    env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(ensure_token())}
    with (workdir / HEAD_LOG).open("ab") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=log, stdin=subprocess.DEVNULL, env=env, start_new_session=True)
    (workdir / HEAD_PID).write_text(f"{proc.pid}\n")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = (workdir / HEAD_LOG).read_text(errors="replace").strip().splitlines()[-1:]
            raise InfrastructureError(f"the Ray head exited at start ({' '.join(tail)}); log: {workdir / HEAD_LOG}")
        if listening(head.address, head.ray_port, 0.5) and JOINED in (workdir / HEAD_LOG).read_text(errors="replace"):
            return True
        time.sleep(0.3)
    raise InfrastructureError(f"the Ray head did not start within {timeout:g} s; log: {workdir / HEAD_LOG}")


def stop_head(inventory: InventorySpec, *, grace: float = 5.0) -> bool:
    """Stop the head `start_head` started (by its process group); True when one was stopped."""
    pidfile = Path(inventory.head.workdir).expanduser() / HEAD_PID
    pid = _read_pid(pidfile)
    if pid is None:
        return False
    stopped = pid_alive(pid)
    if stopped:
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and pid_alive(pid):
            time.sleep(0.1)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)
        with contextlib.suppress(ChildProcessError):  # reap it when it is our child
            os.waitpid(pid, os.WNOHANG)
    pidfile.unlink(missing_ok=True)
    return stopped
