"""`orchestrate cluster up|down|status`: bootstrap the inventory's hosts as Ray worker nodes."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import typer
from rich.table import Table

from orchestrator.errors import InputError
from orchestrator.report.console import console
from orchestrator.specs.sweep import InventorySpec, load_inventory

if TYPE_CHECKING:  # SSH (paramiko) is imported only by the commands that use it: every other start stays quick
    from orchestrator.cluster.lifecycle import HostState

INVENTORY = typer.Option(..., "--inventory", "-i", help="host inventory TOML with a [head] address")


def hosts_table(states: list[HostState], title: str) -> Table:
    """One row per host: reachability, versions, Ray node, lock holder, last job, problems."""
    table = Table(title=title, title_justify="left")
    for name in (
        "host",
        "device",
        "address",
        "reachable",
        "os",
        "python",
        "ray",
        "node",
        "lock",
        "last job",
        "problem",
    ):
        table.add_column(name)
    for s in states:
        p = s.probe
        reachable = "-" if p is None else ("yes" if p.reachable else "no")
        problem = "; ".join(s.notes) or (p.error if p is not None and p.error else "")
        table.add_row(
            s.name,
            s.device,
            s.address,
            reachable,
            p.os if p else "-",
            (p.python or "-") if p else "-",
            (p.ray or "-") if p else "-",
            s.node,
            s.lock,
            s.last_job,
            problem,
        )
    return table


def load_cluster_inventory(path: Path) -> InventorySpec:
    """The inventory, refused (exit 2, naming the file) without a head or an SSH address per host."""
    from orchestrator.cluster.lifecycle import require_ssh_hosts  # SSH (paramiko): only when a cluster verb runs

    inv = load_inventory(path)
    try:
        require_ssh_hosts(inv)
    except InputError as exc:
        raise InputError(exc.message, where=str(path)) from None
    return inv


def register(app: typer.Typer) -> None:
    cluster = typer.Typer(
        help="Start, stop and inspect the inventory's Ray worker nodes over SSH.", no_args_is_help=True
    )
    app.add_typer(cluster, name="cluster")

    @cluster.command("up")
    def up(
        inventory: Path = INVENTORY,
        join_timeout: float = typer.Option(
            90.0, "--join-timeout", min=1, help="seconds each node may take to register with the head"
        ),
        install: bool = typer.Option(
            False, "--install", help="pip-install this commit of orchestrate (and its pins) where it is missing"
        ),
        rotate_token: bool = typer.Option(
            False, "--rotate-token", help="make a new Ray token first (the head must be down: `cluster down`)"
        ),
    ) -> None:
        """Check every host, start the Ray head here if needed and a worker node on each host."""
        from orchestrator.cluster.lifecycle import ClusterCheckError, cluster_up  # SSH: as above

        inv = load_cluster_inventory(inventory)
        out = console()
        try:
            states = cluster_up(
                inv, join_timeout=join_timeout, install=install, rotate_token=rotate_token, log=out.print
            )
        except ClusterCheckError as exc:
            started = any(s.node != "-" for s in exc.states)  # "-": the checks stopped it before any node
            out.print(hosts_table(exc.states, f"cluster {inventory}" + ("" if started else ": nothing started")))
            raise
        out.print(hosts_table(states, f"cluster {inventory}: {len(states)} nodes up"))

    @cluster.command("down")
    def down(inventory: Path = INVENTORY) -> None:
        """Stop the Ray nodes (and head) that `cluster up` started, nothing else; remove the hosts' token."""
        from orchestrator.cluster.lifecycle import cluster_down  # SSH: as above

        inv = load_cluster_inventory(inventory)
        out = console()
        states = cluster_down(inv, log=out.print)
        out.print(hosts_table(states, f"cluster {inventory}: down"))

    @cluster.command("status")
    def status(inventory: Path = INVENTORY) -> None:
        """Per host: reachable, versions, Ray node alive, lock holder, last job."""
        from orchestrator.cluster.lifecycle import cluster_status  # SSH: as above

        inv = load_cluster_inventory(inventory)
        out = console()
        out.print(hosts_table(cluster_status(inv), f"cluster {inventory}"))

    @cluster.command("logs")
    def logs(
        inventory: Path = INVENTORY,
        out: Path = typer.Option(Path("cluster-logs"), "--out", "-o", help="directory to copy the logs into"),
    ) -> None:
        """Copy each host's Ray node logs (and the head's) into OUT/<host>/."""
        from orchestrator.cluster.lifecycle import cluster_logs  # SSH: as above

        inv = load_cluster_inventory(inventory)
        states = cluster_logs(inv, out)
        console().print(hosts_table(states, f"cluster {inventory}: logs in {out}"))
