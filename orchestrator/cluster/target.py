"""Where an SSH connection goes: an inventory host merged with `~/.ssh/config`, hop by hop.

`SshTarget.from_host` takes HostName, Port, User, IdentityFile, UserKnownHostsFile and ProxyJump
from the SSH config like `ssh` does, the inventory's explicit fields winning; a ProxyJump chain
becomes the `Hop`s before the host. `orchestrator.cluster.ssh.RemoteShell` connects through them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import paramiko

from orchestrator.specs.sweep import HostSpec


@dataclass(frozen=True)
class Hop:
    """One SSH endpoint on the way to a host (a jump host or the host itself)."""

    hostname: str
    port: int = 22
    user: str | None = None
    identity_file: str | None = None

    @property
    def address(self) -> str:
        return f"{self.hostname}:{self.port}"


@dataclass(frozen=True)
class SshTarget:
    """How to reach one inventory host: its name, the hop itself and the jumps before it."""

    name: str
    hop: Hop
    jumps: tuple[Hop, ...] = ()
    known_hosts: str = "~/.ssh/known_hosts"
    connect_timeout: float = 10.0
    env: Mapping[str, str] = field(default_factory=dict)

    @classmethod
    def from_host(cls, host: HostSpec, ssh_config: Path | None = None) -> SshTarget:
        """Merge an inventory host with `~/.ssh/config` (the inventory's explicit fields win)."""
        config = _load_ssh_config(ssh_config)
        alias = host.host or host.name
        found = config.lookup(alias) if config else {}
        explicit = host.model_fields_set
        hop = Hop(
            hostname=str(found.get("hostname", alias)),
            port=host.port if "port" in explicit or "port" not in found else int(found["port"]),
            user=host.user or found.get("user"),
            identity_file=host.identity_file or _first(found.get("identityfile")),
        )
        jump_specs = list(host.proxy_jump)
        if not jump_specs and found.get("proxyjump") and str(found["proxyjump"]).lower() != "none":
            jump_specs = [j for j in str(found["proxyjump"]).split(",") if j]
        jumps = tuple(_jump_hop(spec, config, hop.identity_file) for spec in jump_specs)
        known = host.known_hosts or _first(found.get("userknownhostsfile")) or "~/.ssh/known_hosts"
        return cls(host.name, hop, jumps, known, host.connect_timeout, dict(host.env))


def _first(value: Any) -> str | None:
    if isinstance(value, list):
        return str(value[0]) if value else None
    return None if value is None else str(value)


def _load_ssh_config(path: Path | None) -> paramiko.SSHConfig | None:
    path = path or Path("~/.ssh/config").expanduser()
    if not path.is_file():
        return None
    return paramiko.SSHConfig.from_path(str(path))


def _jump_hop(spec: str, config: paramiko.SSHConfig | None, identity: str | None) -> Hop:
    """`[user@]host[:port]`, looked up in the SSH config like `ssh -J` does."""
    user, _, rest = spec.rpartition("@")
    name, _, port = rest.partition(":")
    found = config.lookup(name) if config else {}
    return Hop(
        hostname=str(found.get("hostname", name)),
        port=int(port or found.get("port", 22)),
        user=user or found.get("user"),
        identity_file=_first(found.get("identityfile")) or identity,
    )


def known_hosts_name(hop: Hop) -> str:
    """The name a known_hosts line uses for this endpoint (`host` or `[host]:port`)."""
    return hop.hostname if hop.port == 22 else f"[{hop.hostname}]:{hop.port}"
