"""How an inventory's hosts are reached: ProxyJump hops and chains, and which host is this machine.

A ProxyJump hop is `[user@]host[:port]` (as `ssh -J` takes it), the port 1-65535. A hop that names
another host of the inventory (by its `name` or its `host`) goes through that host's own jumps
first, as `ssh` does through its config: the whole chain is resolved at load, so a loop of any
length (a -> b -> c -> a) and a chain longer than `MAX_JUMPS` hops are refused before anything
connects.

A host is this machine when it has no `host` field, or its `host` is `localhost`, a loopback
address or this machine's own name (`socket.gethostname()`, with or without its domain), reached
directly (no `proxy_jump`) on SSH's port 22. Any other host is another machine: an inventory that
lists one needs a `[head]` whose Ray cluster it joins (`orchestrate cluster up`), and its jobs
never run here.
"""

from __future__ import annotations

import ipaddress
import re
import socket
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

MAX_JUMPS = 8  # hops before a host, its jump hosts' own chains included
DEFAULT_SSH_PORT = 22
_HOP_RE = re.compile(r"(?:(?P<user>[^@:\s]+)@)?(?P<host>[^@:\s]+)(?::(?P<port>[^@:\s]*))?")


@dataclass(frozen=True)
class JumpHop:
    """One ProxyJump hop: `[user@]host[:port]`."""

    host: str
    port: int | None = None
    user: str | None = None

    def __str__(self) -> str:
        user = f"{self.user}@" if self.user else ""
        port = f":{self.port}" if self.port is not None else ""
        return f"{user}{self.host}{port}"


def parse_hop(spec: str) -> JumpHop:
    """Parse `[user@]host[:port]`.

    Raises:
        ValueError: not of that form, or a port that is not a number in 1-65535.
    """
    m = _HOP_RE.fullmatch(spec)
    if m is None:
        raise ValueError(f"{spec!r} is not [user@]host[:port]")
    port_text = m.group("port")
    port: int | None = None
    if port_text is not None:
        if not port_text.isascii() or not port_text.isdigit() or not 1 <= int(port_text) <= 65535:
            raise ValueError(f"{spec!r}: port {port_text!r} is not a number from 1 to 65535")
        port = int(port_text)
    return JumpHop(m.group("host"), port, m.group("user"))


class Reachable(Protocol):
    """What `jump_chain` needs of a host (an inventory `HostSpec`)."""

    name: str
    host: str | None
    port: int
    user: str | None
    proxy_jump: list[str]


def jump_chain(start: Reachable, hosts: Sequence[Reachable]) -> list[str]:
    """Every hop on the way to `start`, its jump hosts' own jumps resolved through the inventory.

    A hop naming an inventory host by its `name` becomes that host's SSH address (its user and
    port unless the hop gives them).

    Raises:
        ValueError: a malformed hop, a loop (the chain comes back to a host already on it) or more
            than `MAX_JUMPS` hops.
    """
    by_key: dict[str, Reachable] = {}
    for h in hosts:
        by_key.setdefault(h.name, h)
        if h.host:
            by_key.setdefault(h.host, h)
    chain: list[str] = []
    seen = {start.name, *([start.host] if start.host else [])}

    def visit(host: Reachable, trail: list[str]) -> None:
        for spec in host.proxy_jump:
            hop = parse_hop(spec)
            via = by_key.get(hop.host)
            label = via.name if via is not None else hop.host
            keys = {label, hop.host, *([via.host] if via is not None and via.host else [])}
            if keys & seen:
                raise ValueError(f"a ProxyJump loop: {' -> '.join([*trail, label])}")
            seen.update(keys)
            if len(trail) + len(chain) > MAX_JUMPS:  # the hops above this one come after it
                raise ValueError(f"a ProxyJump chain of more than {MAX_JUMPS} hops (at most {MAX_JUMPS})")
            if via is not None:
                visit(via, [*trail, label])
                if hop.host == via.name and via.host:
                    port = hop.port or (via.port if via.port != DEFAULT_SSH_PORT else None)
                    spec = str(JumpHop(via.host, port, hop.user or via.user))
            chain.append(spec)

    visit(start, [start.name])
    return chain


def local_names() -> set[str]:
    """The names this machine answers to: localhost and its host name, with and without a domain."""
    names = {"localhost", "localhost.localdomain"}
    for name in (socket.gethostname(), socket.getfqdn()):
        if name:
            names |= {name.lower(), name.lower().split(".")[0]}
    return names


def is_loopback(address: str) -> bool:
    """True for 127.0.0.0/8 and ::1."""
    try:
        return ipaddress.ip_address(address.strip("[]")).is_loopback
    except ValueError:
        return False


def is_this_machine(host: str | None, port: int = DEFAULT_SSH_PORT, proxy_jump: Sequence[str] = ()) -> bool:
    """Whether an inventory host is this machine (the module docstring says how that is decided)."""
    if host is None:
        return True
    if proxy_jump or port != DEFAULT_SSH_PORT:
        return False
    return is_loopback(host) or host.lower() in local_names()
