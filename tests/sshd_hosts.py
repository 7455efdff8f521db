"""Real OpenSSH `sshd` test hosts on loopback addresses (127.0.0.2, 127.0.0.3, ...).

Each `SshdHost` is its own `sshd -D` process with its own host key, listening on one loopback
address and a free port, accepting only the keys in its own authorized_keys file. Everything lives
under a temp dir; nothing of the machine's own SSH setup (/etc/ssh, ~/.ssh) is read or changed.
Needs Debian's openssh-server (tests/setup-system.sh installs it) and root (sshd's privilege
separation); tests skip with the reason where either is missing.
"""

from __future__ import annotations

import getpass
import os
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

SSHD = shutil.which("sshd") or "/usr/sbin/sshd"


def require_sshd() -> None:
    """Skip the calling test (with the reason) where a real sshd cannot run."""
    if not Path(SSHD).exists():
        pytest.skip("openssh-server is not installed (run tests/setup-system.sh)")
    if os.geteuid() != 0:
        pytest.skip("sshd test hosts need root (privilege separation)")


def make_key(path: Path) -> str:
    """Generate an ed25519 key pair at `path`; return the public key line."""
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(path)], check=True)
    return Path(f"{path}.pub").read_text().strip()


def free_port(address: str) -> int:
    """A TCP port that is free on `address` right now."""
    with socket.socket() as s:
        s.bind((address, 0))
        return int(s.getsockname()[1])


@dataclass
class SshdHost:
    """One running sshd: where it listens, its host key, who may log in."""

    address: str
    root: Path
    port: int = 0
    user: str = field(default_factory=getpass.getuser)
    proc: subprocess.Popen[bytes] | None = None

    @property
    def host_key_pub(self) -> str:
        return (self.root / "host_ed25519.pub").read_text().strip()

    def known_hosts_line(self) -> str:
        """This host's line for a known_hosts file (`[addr]:port type key`)."""
        kind, key = self.host_key_pub.split()[:2]
        return f"[{self.address}]:{self.port} {kind} {key}"

    def start(self, authorized: list[str]) -> SshdHost:
        """Write the config and keys, start sshd, wait until it accepts connections."""
        self.root.mkdir(parents=True, exist_ok=True)
        Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)  # sshd's privilege-separation dir
        if not (self.root / "host_ed25519").exists():
            make_key(self.root / "host_ed25519")
        (self.root / "authorized_keys").write_text("\n".join(authorized) + "\n")
        (self.root / "authorized_keys").chmod(0o600)
        self.port = self.port or free_port(self.address)
        config = self.root / "sshd_config"
        config.write_text(
            "\n".join(
                [
                    f"ListenAddress {self.address}:{self.port}",
                    f"HostKey {self.root / 'host_ed25519'}",
                    f"PidFile {self.root / 'sshd.pid'}",
                    f"AuthorizedKeysFile {self.root / 'authorized_keys'}",
                    "PubkeyAuthentication yes",
                    "PasswordAuthentication no",
                    "KbdInteractiveAuthentication no",
                    "PermitRootLogin prohibit-password",
                    "UsePAM no",
                    "StrictModes no",
                    "AllowTcpForwarding yes",
                    "MaxStartups 50",
                    "Subsystem sftp internal-sftp",
                    "LogLevel ERROR",
                    "",
                ]
            )
        )
        log = (self.root / "sshd.log").open("ab")
        self.proc = subprocess.Popen([SSHD, "-D", "-e", "-f", str(config)], stdout=log, stderr=log)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"sshd on {self.address} exited: {(self.root / 'sshd.log').read_text()[-500:]}")
            try:
                with socket.create_connection((self.address, self.port), timeout=0.5):
                    return self
            except OSError:
                time.sleep(0.05)
        raise RuntimeError(f"sshd on {self.address}:{self.port} did not start")

    def stop(self) -> None:
        """Stop this sshd (only the process this object started)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.proc = None


@dataclass
class SshLab:
    """Several sshd hosts sharing one client key and one known_hosts file."""

    root: Path
    hosts: list[SshdHost]
    client_key: Path
    known_hosts: Path

    def stop(self) -> None:
        for host in self.hosts:
            host.stop()


def start_lab(root: Path, addresses: list[str]) -> SshLab:
    """Start one sshd per address, all trusting one fresh client key; write their known_hosts."""
    root.mkdir(parents=True, exist_ok=True)
    client_key = root / "client_ed25519"
    public = make_key(client_key)
    hosts: list[SshdHost] = []
    try:
        for i, address in enumerate(addresses):
            hosts.append(SshdHost(address, root / f"sshd{i}").start([public]))
    except BaseException:
        for h in hosts:
            h.stop()
        raise
    known = root / "known_hosts"
    known.write_text("".join(h.known_hosts_line() + "\n" for h in hosts))
    return SshLab(root, hosts, client_key, known)
