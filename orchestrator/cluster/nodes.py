"""The Ray worker nodes of `orchestrate cluster`: each host's node (one per GPU of a host with
`gpus`), its files, command line and environment, launching it over SSH, waiting until the head's
node table has it, and stopping exactly what was started (see `orchestrator.cluster.lifecycle`).
"""

from __future__ import annotations

import json
import re
import shlex
import time
from dataclasses import dataclass, field
from typing import Any

from orchestrator.cluster.head import RAY_BIND_ENV, RAY_CLI, connect_env, head_address
from orchestrator.cluster.hostprobe import HostProbe
from orchestrator.cluster.ssh import RemoteShell, command_line, shell_path
from orchestrator.cluster.target import SshTarget
from orchestrator.cluster.tls import NODE_FILES, issue, tls_env
from orchestrator.cluster.token import token_path
from orchestrator.errors import InfrastructureError
from orchestrator.run.plan import lock_settings
from orchestrator.specs.sweep import HostSpec, InventorySpec
from workers.host.gpus import GPU_SLOTS_ENV, GpuInfo, GpuListError, pin_labels

NODE_PID = "ray-node.pid"
NODE_LOG = "ray-node.log"
GPU_NODE_OBJECT_STORE_BYTES = 2**30  # per GPU's node: rows are small, and N nodes share one /dev/shm
TOKEN_FILE = "auth_token"
LOG_TAIL_LINES = 5  # of a node's log, in the report of a node that did not join
ANSI_RE = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")  # Ray colours its log; a report is plain text
POLL_S = 0.5


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


def node_paths(host: HostSpec, home: str, gpu: int | None = None) -> dict[str, str]:
    """The host's files; those of GPU `gpu`'s node where it has several."""
    wd = host.workdir if not host.workdir.startswith("~") else home + host.workdir[1:]
    node = "ray-node" if gpu is None else f"ray-node-gpu{gpu}"
    return {
        "workdir": wd,
        "pid": f"{wd}/{node}.pid",
        "log": f"{wd}/{node}.log",
        "token": f"{wd}/{TOKEN_FILE}",
        "tls": f"{wd}/tls",
        "temp": f"{wd}/ray" if gpu is None else f"{wd}/ray-gpu{gpu}",
    }


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
        "--temp-dir", paths.get("temp", f"{paths['workdir']}/ray"),
        "--labels", ",".join(f"{k}={v}" for k, v in labels.items()),
        "--resources", json.dumps({"gpu_slot": 1}), "--disable-usage-stats", "--dashboard-agent-listen-port", "0",
    ]  # fmt: skip
    if gpu is not None:
        argv += ["--object-store-memory", str(GPU_NODE_OBJECT_STORE_BYTES)]
    if host.node_ip:
        argv += ["--node-ip-address", host.node_ip]
    if host.num_cpus:
        argv += ["--num-cpus", str(host.num_cpus)]
    return argv


def node_env(
    host: HostSpec, paths: dict[str, str], os_name: str, *, tls: bool = False, slots: int | None = None
) -> dict[str, str]:
    """The node's environment: token auth (and TLS), Ray's binding, this host's settings for
    `workers.job.task` (`slots`: how many GPUs' nodes share the host), the host's env."""
    env = {
        "RAY_AUTH_MODE": "token",
        "RAY_AUTH_TOKEN_PATH": paths["token"],
        **RAY_BIND_ENV,
        "ORCHESTRATE_HOST": host.name,
        "ORCHESTRATE_LOCK_PATH": host.lock,
        "ORCHESTRATE_LOCK": lock_settings(host).model_dump_json(),
        "ORCHESTRATE_SPOOL": f"{paths['workdir']}/spool",
    }
    if slots is not None:
        env[GPU_SLOTS_ENV] = str(slots)
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


def launch_node(
    shell: RemoteShell,
    host: HostSpec,
    inventory: InventorySpec,
    probe: HostProbe,
    gpu: GpuInfo | None = None,
    slots: int | None = None,
) -> str:
    """Start `ray start --block` on the host (for GPU `gpu`) in the background: "launched", or
    "running" when the process its pid file names is alive already (whether it joined is the node
    table's to say)."""
    paths = node_paths(host, probe.home, None if gpu is None else gpu.index)
    if shell.run_script(f"sh -c {shlex.quote(_our_node_script(paths))}").ok:
        return "running"
    shell.mkdir_p(paths["workdir"])
    shell.put_bytes(token_path().read_bytes(), paths["token"], mode=0o600)
    if inventory.head.tls:
        _put_tls(shell, host, inventory, paths)
    env = node_env(host, paths, probe.os, tls=inventory.head.tls, slots=slots)
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
        from ray._raylet import GcsClient  # type: ignore[attr-defined]  # Ray: only when nodes are watched

        connect_env(inventory)  # the token, and TLS where the head uses it
        self.address = head_address(inventory)
        try:
            self._client = GcsClient(address=self.address)
        except Exception as exc:  # as in refresh
            raise InfrastructureError(f"cannot reach the Ray head at {self.address}: {exc}") from None
        self.nodes: list[dict[str, Any]] = []

    def refresh(self) -> None:
        from ray.core.generated.gcs_pb2 import GcsNodeInfo  # type: ignore[attr-defined]  # Ray, as above

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


def join_node(
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
    paths = node_paths(host, state.probe.home, None if gpu is None else gpu.index)
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


def stop_node(
    shell: RemoteShell, host: HostSpec, home: str, grace: float, gpu: int | None = None, *, forget_token: bool = True
) -> str:
    """Stop the node `up` started (for GPU `gpu`; never a process that reused a stale pid file's
    pid), after removing the host's token and TLS files (unless `forget_token` is false: other
    nodes of the host go on)."""
    paths = node_paths(host, home, gpu)
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


def node_summary(outcomes: list[str], gpus: list[int | None]) -> str:
    """What became of a host's nodes: one word when they agree (`started`, `stopped (2 GPUs)`),
    else each GPU's (`gpu0 running, gpu1 started`); `gpus`: the GPU of each (None: the one
    unpinned node); an outcome past them (a failure before the next node) is named last."""
    if len(set(outcomes)) == 1:
        many = f"{len(gpus)} GPU{'s' if len(gpus) != 1 else ''}"
        return outcomes[0] if gpus == [None] else f"{outcomes[0]} ({many})"
    named = [f"gpu{g} {o}" if g is not None else o for g, o in zip(gpus, outcomes, strict=False)]
    return ", ".join(named + outcomes[len(gpus) :])


def node_gpus(shell: RemoteShell, host: HostSpec, home: str) -> list[int | None]:
    """The nodes whose pid files `up` left in the host's work dir: None for the host's one node,
    else each GPU's index."""
    wd = node_paths(host, home)["workdir"]
    out = shell.run_script(f"cd {shell_path(wd)} 2>/dev/null && ls -1").stdout.split()
    found: list[int | None] = [None] if NODE_PID in out else []
    found += sorted(int(m.group(1)) for n in out if (m := re.fullmatch(r"ray-node-gpu(\d+)\.pid", n)))
    return found


def stop_other_nodes(shell: RemoteShell, host: HostSpec, home: str, gpus: list[GpuInfo | None]) -> None:
    """Stop the nodes an earlier `up` left for GPUs (or for the unpinned host) no longer named."""
    wanted = {None if g is None else g.index for g in gpus}
    for gpu in node_gpus(shell, host, home):
        if gpu not in wanted:
            stop_node(shell, host, home, 5.0, gpu, forget_token=False)
