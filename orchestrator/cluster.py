"""Hosts as Ray worker nodes: `orchestrate cluster up|down|status` as library functions.

`cluster_up` runs on the head machine. It checks every host first (reachable over SSH, Python and
Ray versions equal to the head's, the worker packages importable) and reports every problem in
one table before anything is started; then it starts the Ray head here (unless one already
listens on the inventory's address), copies the head's Ray token to each host with mode 0600 over
SFTP and starts `ray start --block` there in its own process group, with the labels `device-kind`,
`backend`, `host` (plus the host's own) and the resource `gpu_slot=1`. It then waits until each
node is registered with the head: alive in Ray's node table with exactly the labels it was given
(a log line saying "started" proves nothing: two hosts sharing one Ray directory both read it).
A node that did not join in time, or whose `ray start` exited, is reported with the last lines of
its log, and `cluster up` exits 3. Each started process's pid is kept in a file beside it, so
`cluster_down` stops exactly what `cluster_up` started (never `ray stop`, which kills every Ray
on a machine).

The token (see `orchestrator.auth_token`) is never printed or logged; each host keeps its copy in
`<workdir>/auth_token`, mode 0600, and with `[head] tls = true` its TLS files in `<workdir>/tls/`
(`orchestrator.tls`); `cluster_down` removes both. A pid file is trusted only when its process
is the `ray start` of that host's work dir: a stale one naming a process that reused the pid
makes `up` start the node and `down` leave that process alone.

A host with `gpus` is one node per GPU (`ray-node-gpu<i>.pid`, `.log`, Ray temp dir
`<workdir>/ray-gpu<i>`), each labelled `gpu-index` and `gpu-uuid` and offering one `gpu_slot`:
the GPUs are listed on the host itself (`python -m workers gpus BACKEND`: nvidia-smi or the KFD
topology) while it is checked, and an index the host lacks is reported with the others. `up`
stops a node left from an earlier `up` for a GPU the inventory no longer names; `down` stops
every node `up` started on the host.
"""

from __future__ import annotations

import json
import platform
import re
import shlex
import shutil
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from orchestrator.auth_token import ensure_token, rotate_token, token_path, token_problem
from orchestrator.errors import InfrastructureError, InputError
from orchestrator.head import (
    HEAD_LOG,
    RAY_BIND_ENV,
    RAY_CLI,
    connect_env,
    head_address,
    listening,
    our_head_pid,
    start_head,
    stop_head,
)
from orchestrator.hostprobe import HostProbe, last_job, lock_holder, probe, probe_host, version_problems
from orchestrator.plan import lock_settings
from orchestrator.specs import HostSpec, InventorySpec
from orchestrator.ssh import RemoteShell, SftpError, SshTarget, command_line, shell_path
from orchestrator.tls import NODE_FILES, issue, tls_env
from orchestrator.workerenv import install_worker_packages, installable, source_archive
from workers.gpus import GpuInfo, GpuListError, pin_labels, select_gpus

NODE_PID = "ray-node.pid"
NODE_LOG = "ray-node.log"
GPU_NODE_OBJECT_STORE_BYTES = 2**30  # per GPU's node: rows are small, and N nodes share one /dev/shm
TOKEN_FILE = "auth_token"
LOG_TAIL_LINES = 5  # of a node's log, in the report of a node that did not join
ANSI_RE = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")  # Ray colours its log; a report is plain text
POLL_S = 0.5

Log = Callable[[str], None]


def _quiet(_: str) -> None:
    pass


# ------------------------------------------------------------------------------------ the nodes


@dataclass
class HostState:
    """What `cluster up/down/status` found or did on one host."""

    name: str
    device: str
    address: str
    probe: HostProbe | None = None
    node: str = "-"  # launched, started, running, not joined, failed; stopped, not running; alive, dead
    lock: str = "-"
    last_job: str = "-"
    notes: list[str] = field(default_factory=list)
    gpus: list[GpuInfo] | None = None  # the GPUs the host's `gpus` names, as the host listed them
    joined: bool = False  # every node `up` wanted on the host is registered with the head


def _paths(host: HostSpec, home: str, gpu: int | None = None) -> dict[str, str]:
    """The host's files; those of GPU `gpu`'s node where it has several."""
    wd = host.workdir if not host.workdir.startswith("~") else home + host.workdir[1:]
    node = "ray-node" if gpu is None else f"ray-node-gpu{gpu}"
    return {
        "workdir": wd, "pid": f"{wd}/{node}.pid", "log": f"{wd}/{node}.log", "token": f"{wd}/{TOKEN_FILE}",
        "tls": f"{wd}/tls", "temp": f"{wd}/ray" if gpu is None else f"{wd}/ray-gpu{gpu}",
    }  # fmt: skip


def _our_node_script(paths: dict[str, str]) -> str:
    """Shell that sets `p` to the node's pid and succeeds only when that process is the `ray start`
    of this work dir and node (not a stale pid file's pid reused by another process)."""
    marker = shlex.quote(f"--temp-dir {paths['temp']} --labels")
    return (
        f'p=$(cat {shell_path(paths["pid"])} 2>/dev/null) && kill -0 "$p" 2>/dev/null && '
        f'case "$(ps -ww -o command= -p "$p" 2>/dev/null)" in *ray.scripts.scripts*{marker}*) true;; *) false;; esac'
    )


def node_labels(host: HostSpec, gpu: GpuInfo | None = None) -> dict[str, str]:
    """The labels `host`'s Ray node (of GPU `gpu`, on a host with `gpus`) is started with, and must
    be registered with."""
    pinned = pin_labels(gpu) if gpu is not None else {}
    return {"device-kind": host.device, "backend": host.backend, "host": host.name, **pinned, **host.labels}


def node_command(
    host: HostSpec, inventory: InventorySpec, paths: dict[str, str], os_name: str, gpu: GpuInfo | None = None
) -> list[str]:
    """The `ray start` command line (after `env ...`) that makes `host` (or its GPU `gpu`) a worker node."""
    labels = node_labels(host, gpu)
    argv = [
        host.python, *RAY_CLI, "start", "--block", "--address", head_address(inventory),
        "--temp-dir", paths["temp"], "--labels", ",".join(f"{k}={v}" for k, v in labels.items()),
        "--resources", json.dumps({"gpu_slot": 1}), "--disable-usage-stats", "--dashboard-agent-listen-port", "0",
    ]  # fmt: skip
    if gpu is not None:
        argv += ["--object-store-memory", str(GPU_NODE_OBJECT_STORE_BYTES)]
    if host.node_ip:
        argv += ["--node-ip-address", host.node_ip]
    if host.num_cpus:
        argv += ["--num-cpus", str(host.num_cpus)]
    return argv


def node_env(host: HostSpec, paths: dict[str, str], os_name: str, *, tls: bool = False) -> dict[str, str]:
    """The node's environment: token auth (and TLS), Ray's binding, this host's settings for
    `workers.task`, the host's env."""
    env = {
        "RAY_AUTH_MODE": "token",
        "RAY_AUTH_TOKEN_PATH": paths["token"],
        **RAY_BIND_ENV,
        "ORCHESTRATE_HOST": host.name,
        "ORCHESTRATE_LOCK_PATH": host.lock,
        "ORCHESTRATE_LOCK": lock_settings(host).model_dump_json(),
        "ORCHESTRATE_SPOOL": f"{paths['workdir']}/spool",
    }
    if tls:
        tls_dir = paths["tls"]
        env.update(tls_env(f"{tls_dir}/ca.crt", f"{tls_dir}/node.crt", f"{tls_dir}/node.key"))
    if os_name == "Darwin":
        env["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "1"  # Ray refuses multi-node on macOS without it
    return {**env, **host.env}


def _node_ip(shell: RemoteShell, host: HostSpec) -> str:
    """The IP the host's Ray node will use, as Ray itself works it out there (`node_ip`, with a
    loopback address replaced by the host's own; without `node_ip`, Ray's guess)."""
    pick = (
        "import sys; from ray._private.services import get_node_ip_address, resolve_ip_for_localhost; "
        "print(resolve_ip_for_localhost(sys.argv[1]) if sys.argv[1] else get_node_ip_address())"
    )
    return shell.run([host.python, "-c", pick, host.node_ip or ""], check=True, timeout=120).stdout.strip()


def _put_tls(shell: RemoteShell, host: HostSpec, inventory: InventorySpec, paths: dict[str, str]) -> None:
    """Give the host its TLS files: the CA's certificate, its own certificate and key (0600)."""
    addresses = [_node_ip(shell, host), *(a for a in (host.node_ip, host.host) if a)]
    files = dict(zip(NODE_FILES, issue(inventory, host.name, addresses), strict=True))
    shell.mkdir_p(paths["tls"])
    for name, data in files.items():
        shell.put_bytes(data, f"{paths['tls']}/{name}", mode=0o600)


def _launch_node(
    shell: RemoteShell, host: HostSpec, inventory: InventorySpec, probe: HostProbe, gpu: GpuInfo | None = None
) -> str:
    """Start `ray start --block` on the host (for GPU `gpu`) in the background: "launched", or
    "running" when the process its pid file names is alive already (whether it joined is the node
    table's to say)."""
    paths = _paths(host, probe.home, None if gpu is None else gpu.index)
    if shell.run_script(f"sh -c {shlex.quote(_our_node_script(paths))}").ok:
        return "running"
    shell.mkdir_p(paths["workdir"])
    shell.put_bytes(token_path().read_bytes(), paths["token"], mode=0o600)
    if inventory.head.tls:
        _put_tls(shell, host, inventory, paths)
    env = node_env(host, paths, probe.os, tls=inventory.head.tls)
    line = command_line(node_command(host, inventory, paths, probe.os, gpu), env)
    inner = (
        f"set -m; cd {shell_path(paths['workdir'])} || exit 1; "
        f"nohup {line} > {shell_path(paths['log'])} 2>&1 < /dev/null & echo $! > {shell_path(paths['pid'])}"
    )
    shell.run_script(f"bash -c {shlex.quote(inner)}", check=True, what="ray start")
    return "launched"


def _node_alive(shell: RemoteShell, paths: dict[str, str]) -> bool:
    return shell.run_script(f'kill -0 "$(cat {shell_path(paths["pid"])} 2>/dev/null)" 2>/dev/null').ok


def _log_tail(shell: RemoteShell, paths: dict[str, str]) -> str:
    """The last lines of the node's log, joined into one line."""
    out = shell.run_script(f"tail -n {LOG_TAIL_LINES} {shell_path(paths['log'])} 2>/dev/null").stdout
    lines = [ln.strip() for ln in ANSI_RE.sub("", out).splitlines() if ln.strip()]
    return " | ".join(lines) or "(empty)"


def registration(nodes: list[dict[str, Any]], host: HostSpec, gpu: GpuInfo | None = None) -> tuple[bool, str]:
    """Whether `host`'s node (of GPU `gpu`) is alive in Ray's node table with its labels and a GPU slot.

    Returns:
        (joined, why not): the reason names a node of that host registered with other labels.
    """
    want = node_labels(host, gpu)
    why = ""
    for node in nodes:
        labels = node.get("Labels") or {}
        if not node.get("Alive") or labels.get("host") != host.name:
            continue
        if labels.get("gpu-index") != want.get("gpu-index"):  # another GPU's node of this host
            continue
        wrong = {k: labels.get(k) for k, v in want.items() if labels.get(k) != v}
        slot = (node.get("Resources") or {}).get("gpu_slot")
        if not wrong and slot:
            return True, ""
        expected = {k: want[k] for k in wrong}
        why = f"a node registered as host {host.name!r} with " + (
            f"labels {wrong} where {expected} was expected" if wrong else "no gpu_slot"
        )
    return False, why


class NodeTable:
    """Ray's node table as the head's GCS holds it, in `ray.nodes()`'s shape, read without joining
    the cluster as a driver.

    `ray.init` as a driver takes seconds and prints every node death the GCS announces into our
    output; Ray's own GCS client (`ray._raylet.GcsClient`, internal: Ray is pinned) reads the
    table in about a millisecond. `refresh` is called from one thread.
    """

    def __init__(self, inventory: InventorySpec) -> None:
        from ray._raylet import GcsClient  # type: ignore[attr-defined]

        connect_env(inventory)  # the token, and TLS where the head uses it
        self.address = head_address(inventory)
        try:
            self._client = GcsClient(address=self.address)
        except Exception as exc:  # as in refresh
            raise InfrastructureError(f"cannot reach the Ray head at {self.address}: {exc}") from None
        self.nodes: list[dict[str, Any]] = []

    def refresh(self) -> None:
        from ray.core.generated.gcs_pb2 import GcsNodeInfo  # type: ignore[attr-defined]

        try:
            infos = self._client.get_all_node_info(timeout=10)
        except Exception as exc:  # the GCS client raises Ray's RpcError and plain RuntimeErrors
            raise InfrastructureError(f"cannot read the node table of the Ray head at {self.address}: {exc}") from None
        self.nodes = [
            {
                "Alive": info.state == GcsNodeInfo.GcsNodeState.ALIVE,
                "Labels": dict(info.labels),
                "Resources": dict(info.resources_total),
                "NodeManagerAddress": info.node_manager_address,
            }
            for info in infos.values()
        ]


def _join(
    shell: RemoteShell,
    host: HostSpec,
    state: HostState,
    table: NodeTable,
    timeout: float,
    deadline: float,
    gpu: GpuInfo | None = None,
) -> None:
    """Wait until the host's node (of GPU `gpu`) is in the node table; else say why not, with its
    log's last lines."""
    assert state.probe is not None
    paths = _paths(host, state.probe.home, None if gpu is None else gpu.index)
    launched = state.node == "launched"
    checked = 0.0
    while True:
        joined, why = registration(table.nodes, host, gpu)
        if joined:
            state.node = "started" if launched else "running"
            return
        now = time.monotonic()
        if now - checked >= 2.0:  # a node whose `ray start` exited will never join
            checked = now
            if not _node_alive(shell, paths):
                state.node = "failed"
                state.notes.append(f"ray start exited; last lines of {paths['log']}: {_log_tail(shell, paths)}")
                return
        if now > deadline:
            state.node = "not joined"
            reason = why or f"not registered with the head within {timeout:g} s"
            state.notes.append(f"{reason}; last lines of {paths['log']}: {_log_tail(shell, paths)}")
            return
        time.sleep(POLL_S)


def _stop_node(
    shell: RemoteShell, host: HostSpec, home: str, grace: float, gpu: int | None = None, *, forget_token: bool = True
) -> str:
    """Stop the node `up` started (for GPU `gpu`; never a process that reused a stale pid file's
    pid), after removing the host's token and TLS files (unless `forget_token` is false: other
    nodes of the host go on)."""
    paths = _paths(host, home, gpu)
    pid = shell_path(paths["pid"])
    forget = f"rm -rf {shell_path(paths['token'])} {shell_path(paths['tls'])}; " if forget_token else ""
    script = (
        f"{forget}[ -e {pid} ] || exit 3; "
        f'if ! {_our_node_script(paths)}; then kill -0 "$p" 2>/dev/null && c=5 || c=4; rm -f {pid}; exit $c; fi; '
        f'rm -f {pid}; kill -TERM "$p"; n=0; while kill -0 "$p" 2>/dev/null && [ $n -lt {int(grace * 10)} ]; '
        "do sleep 0.1; n=$((n+1)); done; "
        f'kill -9 -"$p" 2>/dev/null; exit 0'
    )
    code = shell.run_script(f"sh -c {shlex.quote(script)}", timeout=grace + 30, what="stopping the Ray node").exit_code
    states = {0: "stopped", 3: "not started here", 4: "not running", 5: "stale pid file (its pid is another process)"}
    return states.get(code, f"stop failed (exit {code})")


# ------------------------------------------------------------------------------- the operations


def _each_host(inventory: InventorySpec, fn: Callable[[HostSpec], HostState]) -> list[HostState]:
    with ThreadPoolExecutor(max_workers=min(16, len(inventory.hosts))) as pool:
        return list(pool.map(fn, inventory.hosts))


def require_ssh_hosts(inventory: InventorySpec) -> None:
    """`cluster` verbs need a head and an SSH address per host: their absence is bad input (exit 2)."""
    if inventory.embedded:
        raise InputError("the inventory has no [head] address: `orchestrate run` starts Ray itself")
    for i, h in enumerate(inventory.hosts):
        if h.host is None:
            raise InputError(f"field hosts.{i}.host: host {h.name!r} has no SSH address, which `cluster` needs")


class ClusterCheckError(InfrastructureError):
    """Hosts that cannot join; `states` holds the table of every host."""

    def __init__(self, message: str, states: list[HostState]) -> None:
        super().__init__(message)
        self.states = states


def check_hosts(inventory: InventorySpec, *, install_from: Path | None = None, log: Log = _quiet) -> list[HostState]:
    """Reach and probe every host; raise `ClusterCheckError` listing every problem at once.

    With `install_from` (a source archive, see `orchestrator.workerenv`), a host whose only
    problems are missing or mismatched packages gets them installed and is probed again.
    """
    require_ssh_hosts(inventory)
    head_python, head_ray = platform.python_version(), _ray_version()

    def check(host: HostSpec) -> HostState:
        state = HostState(host.name, host.device, f"{host.host}:{host.port}")
        state.probe = probe_host(host)
        state.notes += version_problems(state.probe, head_python, head_ray)
        if state.notes and install_from is not None and installable(state.probe, head_python):
            log(f"{host.name}: installing orchestrate ({'; '.join(state.notes)})")
            try:
                install_worker_packages(host, state.probe, install_from)
            except InfrastructureError as exc:
                state.notes = [exc.message]
                return state
            state.probe = probe_host(host)
            state.notes = version_problems(state.probe, head_python, head_ray)
            log(f"{host.name}: installed" if not state.notes else f"{host.name}: still {'; '.join(state.notes)}")
        return state

    def check_gpus(host: HostSpec, state: HostState) -> None:
        if host.gpus is None or state.notes:
            return
        try:
            state.gpus = select_gpus(host.gpus, list_host_gpus(host), backend=host.backend)
        except GpuListError as exc:
            state.notes.append(str(exc))
            return
        if not state.gpus:
            state.notes.append(f'gpus = "all": the host lists no {host.backend} GPU')

    def check_all(host: HostSpec) -> HostState:
        state = check(host)
        check_gpus(host, state)
        return state

    states = _each_host(inventory, check_all)
    bad = [s for s in states if s.notes]
    if bad:
        detail = "; ".join(f"{s.name}: {', '.join(s.notes)}" for s in bad)
        raise ClusterCheckError(f"{len(bad)} of {len(states)} hosts cannot join the cluster: {detail}", states)
    return states


def list_host_gpus(host: HostSpec) -> list[GpuInfo]:
    """The host's GPUs of its backend, as it lists them itself (`python -m workers gpus`).

    Raises:
        GpuListError: the host cannot list them (the reason is the host's own).
    """
    try:
        with RemoteShell.connect(SshTarget.from_host(host)) as shell:
            done = shell.run([host.python, "-m", "workers", "gpus", host.backend], timeout=host.connect_timeout + 60)
    except InfrastructureError as exc:
        raise GpuListError(exc.message) from None
    if done.exit_code != 0:
        raise GpuListError(f"cannot list its {host.backend} GPUs: {done.last_error_line()}")
    try:
        return [GpuInfo.model_validate(g) for g in json.loads(done.stdout.strip().splitlines()[-1])]
    except (IndexError, ValueError) as exc:
        raise GpuListError(f"`python -m workers gpus` answered what is not a GPU list: {exc}") from None


def _ray_version() -> str:
    import ray

    return str(ray.__version__)


def _prepare_token(inventory: InventorySpec, rotate: bool, log: Log) -> None:
    """Make, check, or replace the head's token before any host gets it."""
    if (rotate or token_problem() is not None) and our_head_pid(inventory) is not None:
        why = "to rotate the token" if rotate else f"the Ray token {token_path()} {token_problem()}:"
        raise InfrastructureError(
            f"{why} the running head must stop first (it keeps the old one): run `orchestrate cluster down`, then `up`"
        )
    if rotate:
        rotate_token()
        log(f"made a new Ray token at {token_path()}")
    else:
        ensure_token()


def cluster_up(
    inventory: InventorySpec,
    *,
    join_timeout: float = 90.0,
    install: bool = False,
    rotate_token: bool = False,
    log: Log = _quiet,
) -> list[HostState]:
    """Check every host (installing the worker packages where asked), start the head here if
    needed (with a new token when `rotate_token`), then start a Ray worker node on each host."""
    if install:
        with tempfile.TemporaryDirectory(prefix="orchestrate-install-") as tmp:
            states = check_hosts(inventory, install_from=source_archive(Path(tmp)), log=log)
    else:
        states = check_hosts(inventory)
    _prepare_token(inventory, rotate_token, log)
    if start_head(inventory):
        log(f"started the Ray head at {head_address(inventory)}")
    by_name = {s.name: s for s in states}
    table = NodeTable(inventory)
    table.refresh()

    def up(host: HostSpec, deadline: float) -> HostState:
        state = by_name[host.name]
        assert state.probe is not None
        gpus: list[GpuInfo | None] = list(state.gpus) if state.gpus is not None else [None]
        outcomes: list[str] = []
        try:
            with RemoteShell.connect(SshTarget.from_host(host)) as shell:
                _stop_other_nodes(shell, host, state.probe.home, gpus)
                for gpu in gpus:  # every GPU's node launched first, then each one's join awaited
                    state.node = _launch_node(shell, host, inventory, state.probe, gpu)
                    outcomes.append(state.node)
                for i, gpu in enumerate(gpus):
                    state.node = outcomes[i]
                    _join(shell, host, state, table, join_timeout, deadline, gpu)
                    outcomes[i] = state.node
        except InfrastructureError as exc:
            outcomes.append("failed")
            state.notes.append(exc.message)
        state.node = _summary(outcomes, gpus)
        state.joined = len(outcomes) == len(gpus) and all(o in ("started", "running") for o in outcomes)
        log(f"{host.name}: {state.node}")
        return state

    with ThreadPoolExecutor(max_workers=min(16, len(inventory.hosts))) as pool:
        deadline = time.monotonic() + join_timeout
        futures = [pool.submit(up, host, deadline) for host in inventory.hosts]
        while not all(f.done() for f in futures):  # the node table is read here, the hosts wait in threads
            table.refresh()
            time.sleep(POLL_S)
        states = [f.result() for f in futures]
    missing = [s for s in states if not s.joined]
    if missing:
        detail = "; ".join(f"{s.name}: {s.node}: {'; '.join(s.notes)}" for s in missing)
        raise ClusterCheckError(
            f"{len(missing)} of {len(states)} nodes did not join the head at {head_address(inventory)}: {detail}",
            states,
        )
    return states


def _summary(outcomes: list[str], gpus: list[GpuInfo | None]) -> str:
    """One word for a host's nodes when they agree (`started`, `running`, ...), else each GPU's."""
    if len(set(outcomes)) == 1:
        word = outcomes[0]
        return word if gpus == [None] or word not in ("started", "running") else f"{word} ({len(gpus)} GPUs)"
    named = [f"gpu{g.index} {o}" if g is not None else o for g, o in zip(gpus, outcomes, strict=False)]
    return ", ".join(named + outcomes[len(gpus) :])


def _node_gpus(shell: RemoteShell, host: HostSpec, home: str) -> list[int | None]:
    """The nodes whose pid files `up` left in the host's work dir: None for the host's one node,
    else each GPU's index."""
    wd = _paths(host, home)["workdir"]
    out = shell.run_script(f"cd {shell_path(wd)} 2>/dev/null && ls -1").stdout.split()
    found: list[int | None] = [None] if NODE_PID in out else []
    found += sorted(int(m.group(1)) for n in out if (m := re.fullmatch(r"ray-node-gpu(\d+)\.pid", n)))
    return found


def _stop_other_nodes(shell: RemoteShell, host: HostSpec, home: str, gpus: list[GpuInfo | None]) -> None:
    """Stop the nodes an earlier `up` left for GPUs (or for the unpinned host) no longer named."""
    wanted = {None if g is None else g.index for g in gpus}
    for gpu in _node_gpus(shell, host, home):
        if gpu not in wanted:
            _stop_node(shell, host, home, 5.0, gpu, forget_token=False)


def cluster_down(inventory: InventorySpec, *, grace: float = 5.0, log: Log = _quiet) -> list[HostState]:
    """Stop the Ray nodes `cluster_up` started on each host, then the head it started here."""
    require_ssh_hosts(inventory)

    def down(host: HostSpec) -> HostState:
        state = HostState(host.name, host.device, f"{host.host}:{host.port}")
        try:
            with RemoteShell.connect(SshTarget.from_host(host)) as shell:
                home = shell.run(["sh", "-c", 'printf %s "$HOME"']).stdout
                nodes = _node_gpus(shell, host, home) or [None]
                stopped = [_stop_node(shell, host, home, grace, gpu) for gpu in nodes]
                named = [f"gpu{g} {o}" for g, o in zip(nodes, stopped, strict=True) if g is not None]
                state.node = stopped[0] if len(set(stopped)) == 1 and len(nodes) == 1 else ", ".join(named or stopped)
        except InfrastructureError as exc:
            state.node = "unreachable"
            state.notes.append(exc.message)
        log(f"{host.name}: {state.node}")
        return state

    states = _each_host(inventory, down)
    head = stop_head(inventory)
    if head != "not running":
        log(f"Ray head: {head}")
    return states


def spool_dir(host: HostSpec, home: str) -> str:
    """Where a host's Ray node spools rows (`ORCHESTRATE_SPOOL` as `cluster up` sets it)."""
    raw = host.env.get("ORCHESTRATE_SPOOL") or f"{host.workdir}/spool"
    return home + raw[1:] if raw.startswith("~") else raw


def ray_nodes(inventory: InventorySpec) -> dict[str, str] | None:
    """Ray's view from the head: inventory host name -> `alive`, `dead`, or for a host with
    several GPUs' nodes `alive 3/4 GPUs (gpu2 dead)` (None: no head answers)."""
    head = inventory.head
    assert head.address is not None
    if not listening(head.address, head.ray_port):
        return None
    table = NodeTable(inventory)
    table.refresh()
    seen: dict[str, dict[str | None, bool]] = {}  # host -> gpu index label -> any such node alive
    for node in table.nodes:
        labels = node.get("Labels") or {}
        name = labels.get("host")
        if name:
            per = seen.setdefault(name, {})
            gpu = labels.get("gpu-index")
            per[gpu] = per.get(gpu, False) or bool(node.get("Alive"))
    out = {}
    for name, per in seen.items():
        alive = sum(per.values())
        if None in per and len(per) == 1:
            out[name] = "alive" if alive else "dead"
        else:
            dead = ", ".join(f"gpu{g} dead" for g, ok in sorted(per.items(), key=lambda kv: str(kv[0])) if not ok)
            word = "alive" if alive else "dead"
            out[name] = f"{word} {alive}/{len(per)} GPUs" + (f" ({dead})" if dead and alive else "")
    return out


def cluster_status(inventory: InventorySpec) -> list[HostState]:
    """Per host: reachable, versions, Ray node alive (as the head sees it), lock holder, last job."""
    require_ssh_hosts(inventory)
    nodes = ray_nodes(inventory)

    def status(host: HostSpec) -> HostState:
        state = HostState(host.name, host.device, f"{host.host}:{host.port}")
        if nodes is None:
            state.node = "no head"
        else:
            state.node = nodes.get(host.name, "not joined")
        try:
            with RemoteShell.connect(SshTarget.from_host(host)) as shell:
                state.probe = probe(shell, host)
                state.lock = lock_holder(shell, host)
                state.last_job = last_job(shell, spool_dir(host, state.probe.home))
        except InfrastructureError as exc:
            state.probe = HostProbe(host.name, reachable=False, error=exc.message)
        return state

    return _each_host(inventory, status)


NODE_LOGS = ("raylet.out", "raylet.err")  # from the node's Ray session, beside `ray start`'s own log


def cluster_logs(inventory: InventorySpec, out: Path) -> list[HostState]:
    """Copy each host's node logs (and the head's log) under `out/<host>/`; a lost host is noted."""
    require_ssh_hosts(inventory)
    head_log = Path(inventory.head.workdir).expanduser() / HEAD_LOG
    if head_log.exists():
        (out / "head").mkdir(parents=True, exist_ok=True)
        shutil.copyfile(head_log, out / "head" / HEAD_LOG)

    def fetch(host: HostSpec) -> HostState:
        state = HostState(host.name, host.device, f"{host.host}:{host.port}")
        try:
            with RemoteShell.connect(SshTarget.from_host(host)) as shell:
                home = shell.run(["sh", "-c", 'printf %s "$HOME"']).stdout
                wanted: list[tuple[str, str]] = []  # (remote path, local name)
                for gpu in _node_gpus(shell, host, home) or [None]:
                    paths = _paths(host, home, gpu)
                    prefix = "" if gpu is None else f"gpu{gpu}-"
                    logs = f"{paths['temp']}/session_latest/logs"
                    wanted.append((paths["log"], paths["log"].rsplit("/", 1)[-1]))
                    wanted += [(f"{logs}/{name}", prefix + name) for name in NODE_LOGS]
                (out / host.name).mkdir(parents=True, exist_ok=True)
                fetched = []
                for remote, name in wanted:
                    try:
                        shell.get(remote, out / host.name / name)
                        fetched.append(name)
                    except SftpError:
                        state.notes.append(f"no {remote}")
                state.node = f"{len(fetched)} logs"
        except InfrastructureError as exc:
            state.node = "unreachable"
            state.notes.append(exc.message)
        return state

    return _each_host(inventory, fetch)
