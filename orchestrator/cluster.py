"""Hosts as Ray worker nodes: `orchestrate cluster up|down|status` as library functions.

`cluster_up` runs on the head machine. It checks every host first (reachable over SSH, Python and
Ray versions equal to the head's, the worker packages importable) and reports every problem in
one table before anything is started; then it starts the Ray head here (unless one already
listens on the inventory's address), copies the head's Ray token to each host with mode 0600 over
SFTP and starts `ray start --block` there in its own process group, with the labels `device-kind`,
`backend`, `host` (plus the host's own) and the resource `gpu_slot=1`, and waits until the node's
log says it joined. Each started process's pid is kept in a file beside it, so `cluster_down`
stops exactly what `cluster_up` started (never `ray stop`, which kills every Ray on a machine).

The token is never printed or logged: it lives in a 0600 file on the head (Ray's own default,
`~/.ray/auth_token`, or `$RAY_AUTH_TOKEN_PATH`) and in `<workdir>/auth_token` on each host.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import platform
import secrets
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from orchestrator.errors import InfrastructureError
from orchestrator.hostprobe import HostProbe, last_job, lock_holder, probe, probe_host, version_problems
from orchestrator.specs import HostSpec, InventorySpec
from orchestrator.ssh import RemoteShell, SshTarget, command_line, shell_path

RAY_CLI = ["-m", "ray.scripts.scripts"]
NODE_PID = "ray-node.pid"
NODE_LOG = "ray-node.log"
TOKEN_FILE = "auth_token"
HEAD_PID = "head.pid"
HEAD_LOG = "head.log"
JOINED = "Ray runtime started."

Log = Callable[[str], None]


def _quiet(_: str) -> None:
    pass


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
    if not _listening(head.address, head.ray_port, timeout):
        raise InfrastructureError(
            f"no Ray head answers at {head_address(inventory)}: start the cluster with `orchestrate cluster up`"
        )


def _listening(address: str, port: int, timeout: float = 1.0) -> bool:
    try:
        with socket.create_connection((address, port), timeout=timeout):
            return True
    except OSError:
        return False


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _read_pid(path: Path) -> int | None:
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None


def start_head(inventory: InventorySpec, *, timeout: float = 60.0) -> bool:
    """Start the Ray head on this machine unless one listens already; True when we started it."""
    head = inventory.head
    assert head.address is not None
    if _listening(head.address, head.ray_port):
        return False
    workdir = Path(head.workdir).expanduser()
    workdir.mkdir(parents=True, exist_ok=True, mode=0o700)
    ip = head.node_ip or head.address
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
        if _listening(head.address, head.ray_port, 0.5) and JOINED in (workdir / HEAD_LOG).read_text(errors="replace"):
            return True
        time.sleep(0.3)
    raise InfrastructureError(f"the Ray head did not start within {timeout:g} s; log: {workdir / HEAD_LOG}")


def stop_head(inventory: InventorySpec, *, grace: float = 5.0) -> bool:
    """Stop the head `start_head` started (by its process group); True when one was stopped."""
    pidfile = Path(inventory.head.workdir).expanduser() / HEAD_PID
    pid = _read_pid(pidfile)
    if pid is None:
        return False
    stopped = _pid_alive(pid)
    if stopped:
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and _pid_alive(pid):
            time.sleep(0.1)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)
        with contextlib.suppress(ChildProcessError):  # reap it when it is our child
            os.waitpid(pid, os.WNOHANG)
    pidfile.unlink(missing_ok=True)
    return stopped


# ------------------------------------------------------------------------------------ the nodes


@dataclass
class HostState:
    """What `cluster up/down/status` found or did on one host."""

    name: str
    device: str
    address: str
    probe: HostProbe | None = None
    node: str = "-"  # started, running, stopped, not running, failed, alive, dead
    lock: str = "-"
    last_job: str = "-"
    notes: list[str] = field(default_factory=list)


def _paths(host: HostSpec, home: str) -> dict[str, str]:
    wd = host.workdir if not host.workdir.startswith("~") else home + host.workdir[1:]
    return {"workdir": wd, "pid": f"{wd}/{NODE_PID}", "log": f"{wd}/{NODE_LOG}", "token": f"{wd}/{TOKEN_FILE}"}


def node_command(host: HostSpec, inventory: InventorySpec, paths: dict[str, str], os_name: str) -> list[str]:
    """The `ray start` command line (after `env ...`) that makes `host` a worker node."""
    labels = {"device-kind": host.device, "backend": host.backend, "host": host.name, **host.labels}
    argv = [
        host.python, *RAY_CLI, "start", "--block", "--address", head_address(inventory),
        "--temp-dir", f"{paths['workdir']}/ray", "--labels", ",".join(f"{k}={v}" for k, v in labels.items()),
        "--resources", json.dumps({"gpu_slot": 1}), "--disable-usage-stats", "--dashboard-agent-listen-port", "0",
    ]  # fmt: skip
    if host.node_ip:
        argv += ["--node-ip-address", host.node_ip]
    if host.num_cpus:
        argv += ["--num-cpus", str(host.num_cpus)]
    return argv


def node_env(host: HostSpec, paths: dict[str, str], os_name: str) -> dict[str, str]:
    """The node's environment: token auth, this host's settings for `workers.task`, the host's env."""
    env = {
        "RAY_AUTH_MODE": "token",
        "RAY_AUTH_TOKEN_PATH": paths["token"],
        "ORCHESTRATE_HOST": host.name,
        "ORCHESTRATE_LOCK_PATH": host.lock,
        "ORCHESTRATE_SPOOL": f"{paths['workdir']}/spool",
    }
    if os_name == "Darwin":
        env["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "1"  # Ray refuses multi-node on macOS without it
    return {**env, **host.env}


def _start_node(shell: RemoteShell, host: HostSpec, inventory: InventorySpec, probe: HostProbe, timeout: float) -> str:
    paths = _paths(host, probe.home)
    running = shell.run_script(f'kill -0 "$(cat {shell_path(paths["pid"])} 2>/dev/null)" 2>/dev/null')
    if running.ok:
        return "running"
    shell.mkdir_p(paths["workdir"])
    shell.put_bytes(token_path().read_bytes(), paths["token"], mode=0o600)
    env = node_env(host, paths, probe.os)
    line = command_line(node_command(host, inventory, paths, probe.os), env)
    inner = (
        f"set -m; cd {shell_path(paths['workdir'])} || exit 1; "
        f"nohup {line} > {shell_path(paths['log'])} 2>&1 < /dev/null & echo $! > {shell_path(paths['pid'])}"
    )
    shell.run_script(f"bash -c {shlex.quote(inner)}", check=True, what="ray start")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        log = shell.run_script(f"cat {shell_path(paths['log'])}").stdout
        if JOINED in log:
            return "started"
        alive = shell.run_script(f'kill -0 "$(cat {shell_path(paths["pid"])})" 2>/dev/null').ok
        if not alive:
            tail = [ln for ln in log.splitlines() if ln.strip()][-1:] or ["no output"]
            raise InfrastructureError(f"host {host.name!r}: ray start exited: {tail[0].strip()} (log: {paths['log']})")
        time.sleep(0.5)
    raise InfrastructureError(
        f"host {host.name!r}: the Ray node did not join within {timeout:g} s (log: {paths['log']})"
    )


def _stop_node(shell: RemoteShell, host: HostSpec, home: str, grace: float) -> str:
    paths = _paths(host, home)
    pid = shell_path(paths["pid"])
    script = (
        f'p=$(cat {pid} 2>/dev/null) || exit 3; rm -f {pid}; kill -0 "$p" 2>/dev/null || exit 4; '
        f'kill -TERM "$p"; n=0; while kill -0 "$p" 2>/dev/null && [ $n -lt {int(grace * 10)} ]; '
        "do sleep 0.1; n=$((n+1)); done; "
        f'kill -9 -"$p" 2>/dev/null; exit 0'
    )
    code = shell.run_script(f"sh -c {shlex.quote(script)}", timeout=grace + 30, what="stopping the Ray node").exit_code
    return {0: "stopped", 3: "not started here", 4: "not running"}.get(code, f"stop failed (exit {code})")


# ------------------------------------------------------------------------------- the operations


def _each_host(inventory: InventorySpec, fn: Callable[[HostSpec], HostState]) -> list[HostState]:
    with ThreadPoolExecutor(max_workers=min(16, len(inventory.hosts))) as pool:
        return list(pool.map(fn, inventory.hosts))


def _remote_hosts(inventory: InventorySpec) -> None:
    if inventory.embedded:
        raise InfrastructureError("the inventory has no [head] address: `orchestrate run` starts Ray itself")
    for h in inventory.hosts:
        if h.host is None:
            raise InfrastructureError(f"host {h.name!r} has no SSH address (field hosts.{h.name}.host)")


class ClusterCheckError(InfrastructureError):
    """Hosts that cannot join; `states` holds the table of every host."""

    def __init__(self, message: str, states: list[HostState]) -> None:
        super().__init__(message)
        self.states = states


def check_hosts(inventory: InventorySpec) -> list[HostState]:
    """Reach and probe every host; raise `ClusterCheckError` listing every problem at once."""
    _remote_hosts(inventory)
    head_python, head_ray = platform.python_version(), _ray_version()

    def check(host: HostSpec) -> HostState:
        state = HostState(host.name, host.device, f"{host.host}:{host.port}")
        state.probe = probe_host(host)
        state.notes += version_problems(state.probe, head_python, head_ray)
        return state

    states = _each_host(inventory, check)
    bad = [s for s in states if s.notes]
    if bad:
        detail = "; ".join(f"{s.name}: {', '.join(s.notes)}" for s in bad)
        raise ClusterCheckError(f"{len(bad)} of {len(states)} hosts cannot join the cluster: {detail}", states)
    return states


def _ray_version() -> str:
    import ray

    return str(ray.__version__)


def cluster_up(inventory: InventorySpec, *, join_timeout: float = 90.0, log: Log = _quiet) -> list[HostState]:
    """Check every host, start the head here if needed, then start a Ray worker node on each host."""
    states = check_hosts(inventory)
    ensure_token()
    if start_head(inventory):
        log(f"started the Ray head at {head_address(inventory)}")
    by_name = {s.name: s for s in states}

    def up(host: HostSpec) -> HostState:
        state = by_name[host.name]
        assert state.probe is not None
        try:
            with RemoteShell.connect(SshTarget.from_host(host)) as shell:
                state.node = _start_node(shell, host, inventory, state.probe, join_timeout)
        except InfrastructureError as exc:
            state.node = "failed"
            state.notes.append(exc.message)
        log(f"{host.name}: {state.node}")
        return state

    states = _each_host(inventory, up)
    failed = [s for s in states if s.node == "failed"]
    if failed:
        raise ClusterCheckError("; ".join(n for s in failed for n in s.notes), states)
    return states


def cluster_down(inventory: InventorySpec, *, grace: float = 5.0, log: Log = _quiet) -> list[HostState]:
    """Stop the Ray nodes `cluster_up` started on each host, then the head it started here."""
    _remote_hosts(inventory)

    def down(host: HostSpec) -> HostState:
        state = HostState(host.name, host.device, f"{host.host}:{host.port}")
        try:
            with RemoteShell.connect(SshTarget.from_host(host)) as shell:
                home = shell.run(["sh", "-c", 'printf %s "$HOME"']).stdout
                state.node = _stop_node(shell, host, home, grace)
        except InfrastructureError as exc:
            state.node = "unreachable"
            state.notes.append(exc.message)
        log(f"{host.name}: {state.node}")
        return state

    states = _each_host(inventory, down)
    if stop_head(inventory):
        log("stopped the Ray head")
    return states


def spool_dir(host: HostSpec, home: str) -> str:
    """Where a host's Ray node spools rows (`ORCHESTRATE_SPOOL` as `cluster up` sets it)."""
    raw = host.env.get("ORCHESTRATE_SPOOL") or f"{host.workdir}/spool"
    return home + raw[1:] if raw.startswith("~") else raw


def ray_nodes(inventory: InventorySpec) -> dict[str, bool] | None:
    """Ray's view from the head: inventory host name -> node alive (None: no head answers)."""
    head = inventory.head
    assert head.address is not None
    if not _listening(head.address, head.ray_port):
        return None
    import ray

    connected_here = not ray.is_initialized()
    if connected_here:
        enable_token_auth()
        ray.init(address=head_address(inventory), logging_level=logging.ERROR, log_to_driver=False)
    try:
        seen: dict[str, bool] = {}
        for node in ray.nodes():
            name = (node.get("Labels") or {}).get("host")
            if name:
                seen[name] = seen.get(name, False) or bool(node.get("Alive"))
        return seen
    finally:
        if connected_here:
            ray.shutdown()


def cluster_status(inventory: InventorySpec) -> list[HostState]:
    """Per host: reachable, versions, Ray node alive (as the head sees it), lock holder, last job."""
    _remote_hosts(inventory)
    nodes = ray_nodes(inventory)

    def status(host: HostSpec) -> HostState:
        state = HostState(host.name, host.device, f"{host.host}:{host.port}")
        if nodes is None:
            state.node = "no head"
        else:
            state.node = {True: "alive", False: "dead"}.get(nodes.get(host.name), "not joined")  # type: ignore[arg-type]
        try:
            with RemoteShell.connect(SshTarget.from_host(host)) as shell:
                state.probe = probe(shell, host)
                state.lock = lock_holder(shell, host)
                state.last_job = last_job(shell, spool_dir(host, state.probe.home))
        except InfrastructureError as exc:
            state.probe = HostProbe(host.name, reachable=False, error=exc.message)
        return state

    return _each_host(inventory, status)
