"""The Ray head on this machine: start, stop, reach, and make sure it is ours.

`orchestrate cluster up` runs on the head machine: `start_head` starts `ray start --head --block`
in its own process group (pid in `<head workdir>/head.pid`, log beside it) with Ray's token
authentication on (the token: `orchestrator.cluster.token`) and, with `[head] tls = true`, Ray's TLS
(`orchestrator.cluster.tls`). Something that already listens on the head's port is trusted only when it
is that head: the listening process must belong to the `ray start --head` of `head.pid`, with
this inventory's temp dir; anything else (a port squatter, another user's Ray, a head started by
hand) is refused before a node sends it the token. `stop_head` stops only the head `start_head`
started, and never a process that merely reuses a stale pid file's pid.

Ray binds where it lets us: the node's IP (`--node-ip-address`), the dashboard on that IP, and
none of the Prometheus endpoints that listened on every interface without authentication (the
per-node metrics exporter: `RAY_enable_metrics_collection=0`; the head's autoscaler monitor,
which a static cluster does not need: `--no-monitor`; the dashboard process's: see
`RAY_BIND_ENV`). What Ray 2.60 still binds on every interface: the GCS port and each raylet's,
dashboard agent's and worker's gRPC ports, all behind the token (and TLS when enabled).
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

from orchestrator.cluster.tls import head_tls_env
from orchestrator.cluster.token import enable_token_auth, ensure_token
from orchestrator.errors import InfrastructureError
from orchestrator.specs.sweep import InventorySpec
from workers.proc.table import is_descendant, listening_pids, pid_alive, process_cmdline, process_name
from workers.proc.tree import end_descendants

RAY_CLI = ["-m", "ray.scripts.scripts"]
HEAD_PID = "head.pid"
HEAD_LOG = "head.log"
JOINED = "Ray runtime started."  # what `ray start` prints once its node has joined the cluster


def head_address(inventory: InventorySpec) -> str:
    """`address:port` of the inventory's Ray head."""
    if inventory.head.address is None:
        raise InfrastructureError("the inventory has no [head] address: it runs on an embedded local Ray instance")
    return f"{inventory.head.address}:{inventory.head.ray_port}"


# ------------------------------------------------------------------------------------- the head


# Ray's per-node metrics exporter, the head's autoscaler monitor and its dashboard process serve
# Prometheus metrics on every interface, unauthenticated; a static cluster needs none of them and
# we read no metrics. Ray has no switch for the dashboard's: a port past 65535 makes that server
# fail to start, which Ray logs and goes on (tests/e2e/test_cluster_security.py checks it stays off).
RAY_BIND_ENV = {"RAY_enable_metrics_collection": "0", "DASHBOARD_METRIC_PORT": "65536"}
RAY_HEAD_BIND_ARGS = ["--no-monitor"]


def require_head(inventory: InventorySpec, timeout: float = 3.0) -> None:
    """Fail fast when no Ray head listens at the inventory's address (`ray.init` would hang for
    minutes), or when what listens on this machine is not the head `cluster up` started.

    Raises:
        InfrastructureError: nothing answers, or a process that is not our head does.
    """
    head = inventory.head
    assert head.address is not None
    if not listening(head.address, head.ray_port, timeout):
        raise InfrastructureError(
            f"no Ray head answers at {head_address(inventory)}: start the cluster with `orchestrate cluster up`"
        )
    if listening_pids(head.ray_port) is not None:  # a head on this machine: it must be ours
        check_head_is_ours(inventory)


def connect_env(inventory: InventorySpec) -> None:
    """Set this process up to join the inventory's cluster as a driver: the token, and TLS."""
    os.environ.update(head_tls_env(inventory))  # before the token: that re-reads Ray's config
    enable_token_auth()


def listening(address: str, port: int, timeout: float = 1.0) -> bool:
    """Whether something accepts TCP connections at `address:port`."""
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


def _temp_dir(inventory: InventorySpec) -> Path:
    return Path(inventory.head.workdir).expanduser() / "ray"


def our_head_pid(inventory: InventorySpec) -> int | None:
    """The pid of the `ray start --head` that `start_head` started for this inventory, if it still
    runs (a pid file naming a process that reused the pid, or anything else, gives None)."""
    pid = _read_pid(Path(inventory.head.workdir).expanduser() / HEAD_PID)
    if pid is None or not pid_alive(pid):
        return None
    argv = process_cmdline(pid)
    ours = "start" in argv and "--head" in argv and str(_temp_dir(inventory)) in argv
    port = str(inventory.head.ray_port)
    return pid if ours and port in argv else None


def check_head_is_ours(inventory: InventorySpec) -> None:
    """Refuse a listener on the head's port that is not the head `start_head` started.

    Raises:
        InfrastructureError: naming the process that listens (or saying it is not visible).
    """
    port = inventory.head.ray_port
    listeners = listening_pids(port) or []
    head = our_head_pid(inventory)
    if head is not None and listeners and all(is_descendant(pid, head) for pid in listeners):
        return
    who = ", ".join(f"pid {pid} ({process_name(pid)})" for pid in listeners) or "a process this user cannot see"
    raise InfrastructureError(
        f"port {port} of this machine is taken by {who}, not by the Ray head `orchestrate cluster up` started "
        f"(pid file {Path(inventory.head.workdir).expanduser() / HEAD_PID}); no token is sent to it: stop it, "
        "or set another [head] ray_port"
    )


def start_head(inventory: InventorySpec, *, timeout: float = 60.0) -> bool:
    """Start the Ray head on this machine unless ours runs already; True when we started it.

    Raises:
        InfrastructureError: something that is not our head holds the port, or the head did not start.
    """
    head = inventory.head
    assert head.address is not None
    if listening(head.address, head.ray_port) or listening_pids(head.ray_port) is not None:
        check_head_is_ours(inventory)
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
        "--node-ip-address", ip, "--temp-dir", str(_temp_dir(inventory)), "--num-cpus", "0",
        "--disable-usage-stats", "--dashboard-agent-listen-port", "0", *RAY_HEAD_BIND_ARGS,
        "--include-dashboard", "true" if head.dashboard else "false",
        "--dashboard-port", str(head.dashboard_port), "--dashboard-host", ip,
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "RAY_AUTH_TOKEN"}
    env.update({"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(ensure_token()), **RAY_BIND_ENV})
    env.update(head_tls_env(inventory, ip=ip))
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


def stop_head(inventory: InventorySpec, *, grace: float = 5.0) -> str:
    """Stop the head `start_head` started: its process tree and process group (SIGTERM, `grace`
    seconds, then SIGKILL; `workers.proc.tree.end_descendants`).

    Returns:
        `stopped`, `not running` (no pid file, or its process is gone), or `stale pid file` (the
        pid now names another process, which is left alone).
    """
    pidfile = Path(inventory.head.workdir).expanduser() / HEAD_PID
    pid = _read_pid(pidfile)
    if pid is None:
        return "not running"
    if our_head_pid(inventory) != pid:
        pidfile.unlink(missing_ok=True)
        return "stale pid file" if pid_alive(pid) else "not running"
    end_descendants(pid, grace=grace, group=True)
    with contextlib.suppress(ChildProcessError):  # reap it when it is our child
        os.waitpid(pid, os.WNOHANG)
    pidfile.unlink(missing_ok=True)
    return "stopped"
