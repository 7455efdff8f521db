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

The token (see `orchestrator.cluster.token`) is never printed or logged; each host keeps its copy in
`<workdir>/auth_token`, mode 0600, and with `[head] tls = true` its TLS files in `<workdir>/tls/`
(`orchestrator.cluster.tls`); `cluster_down` removes both. A pid file is trusted only when its process
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

import platform
import shutil
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from orchestrator.cluster.head import (
    HEAD_LOG,
    head_address,
    listening,
    our_head_pid,
    start_head,
    stop_head,
)
from orchestrator.cluster.hostprobe import HostProbe, last_job, lock_holder, probe, probe_host, version_problems
from orchestrator.cluster.install import install_worker_packages, installable, source_archive
from orchestrator.cluster.nodes import (
    HostState,
    NodeTable,
    join_node,
    launch_node,
    list_host_gpus,
    node_gpus,
    node_paths,
    node_summary,
    stop_node,
    stop_other_nodes,
)
from orchestrator.cluster.ssh import RemoteShell, SftpError
from orchestrator.cluster.target import SshTarget
from orchestrator.cluster.token import ensure_token, rotate_token, token_path, token_problem
from orchestrator.errors import InfrastructureError, InputError
from orchestrator.specs.sweep import HostSpec, InventorySpec
from workers.host.gpus import GpuInfo, GpuListError, select_gpus

POLL_S = 0.5

Log = Callable[[str], None]


def _quiet(_: str) -> None:
    pass


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

    With `install_from` (a source archive, see `orchestrator.cluster.install`), a host whose only
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


def _ray_version() -> str:
    import ray  # Ray: only when a host's versions are compared

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
                stop_other_nodes(shell, host, state.probe.home, gpus)
                for gpu in gpus:  # every GPU's node launched first, then each one's join awaited
                    slots = None if gpu is None else len(gpus)
                    state.node = launch_node(shell, host, inventory, state.probe, gpu, slots)
                    outcomes.append(state.node)
                for i, gpu in enumerate(gpus):
                    state.node = outcomes[i]
                    join_node(shell, host, state, table, join_timeout, deadline, gpu)
                    outcomes[i] = state.node
        except InfrastructureError as exc:
            outcomes.append("failed")
            state.notes.append(exc.message)
        state.node = node_summary(outcomes, [None if g is None else g.index for g in gpus])
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


def cluster_down(inventory: InventorySpec, *, grace: float = 5.0, log: Log = _quiet) -> list[HostState]:
    """Stop the Ray nodes `cluster_up` started on each host, then the head it started here."""
    require_ssh_hosts(inventory)

    def down(host: HostSpec) -> HostState:
        state = HostState(host.name, host.device, f"{host.host}:{host.port}")
        try:
            with RemoteShell.connect(SshTarget.from_host(host)) as shell:
                home = shell.run(["sh", "-c", 'printf %s "$HOME"']).stdout
                nodes = node_gpus(shell, host, home) or [None]
                stopped = [stop_node(shell, host, home, grace, gpu) for gpu in nodes]
                state.node = node_summary(stopped, nodes)
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
                for gpu in node_gpus(shell, host, home) or [None]:
                    paths = node_paths(host, home, gpu)
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
