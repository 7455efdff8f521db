"""`RemoteShell`: the one narrow interface to a host over SSH (paramiko).

Strict host-key checking: keys come from the host's known_hosts file only and an unknown host is
refused (`RejectPolicy`); an unknown or changed key is an `InfrastructureError` that names the host,
the key's fingerprint and the command that would trust it. `~/.ssh/config` is consulted for
HostName, Port, User, IdentityFile, UserKnownHostsFile and ProxyJump; a ProxyJump chain is followed
hop by hop through `direct-tcpip` channels. Keys come from the identity file and the SSH agent.
Every connect and every command has a timeout; every remote argument is shell-quoted; nothing
secret (the token, key material) is ever printed or logged. Where a host is and the hops to it
are `orchestrator.cluster.target`'s.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import logging
import select
import shlex
import stat
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import paramiko

from orchestrator.cluster.target import Hop, SshTarget, known_hosts_name
from orchestrator.errors import InfrastructureError

DEFAULT_COMMAND_TIMEOUT = 60.0

# paramiko logs a failed handshake (a silent host, a refused key) as an ERROR with its traceback;
# that reason reaches the user as one `InfrastructureError` line instead, so its logger stays quiet.
_paramiko_log = logging.getLogger("paramiko")
_paramiko_log.addHandler(logging.NullHandler())
_paramiko_log.propagate = False


@dataclass(frozen=True)
class CommandResult:
    """What one remote command did."""

    exit_code: int
    stdout: str
    stderr: str

    @property
    def ok(self) -> bool:
        return self.exit_code == 0

    def last_error_line(self) -> str:
        """The last non-empty stderr line (or stdout line), for one-line messages."""
        for text in (self.stderr, self.stdout):
            lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
            if lines:
                return lines[-1]
        return f"exit code {self.exit_code}"


def key_fingerprint(key: paramiko.PKey) -> str:
    """The key's fingerprint as `ssh-keygen -l` prints it: `SHA256:<base64>`."""
    digest = hashlib.sha256(key.asbytes()).digest()
    return "SHA256:" + base64.b64encode(digest).decode().rstrip("=")


class SftpError(InfrastructureError):
    """A file transfer to or from a host failed (the message names the host, the file and why)."""


class _UnknownHostKey(Exception):
    def __init__(self, key: paramiko.PKey) -> None:
        super().__init__("unknown host key")
        self.key = key


class _RejectUnknown(paramiko.RejectPolicy):
    """`RejectPolicy` that keeps the offered key, so the error can show its fingerprint."""

    def missing_host_key(self, client: paramiko.SSHClient, hostname: str, key: paramiko.PKey) -> None:
        raise _UnknownHostKey(key)


def shell_path(path: str) -> str:
    """A remote path, quoted for the shell, with a leading `~/` still meaning the home directory."""
    if path == "~":
        return '"$HOME"'
    if path.startswith("~/"):
        return '"$HOME"/' + shlex.quote(path[2:])
    return shlex.quote(path)


def sftp_path(path: str) -> str:
    """A remote path for SFTP, which starts in the home directory and knows no `~`."""
    if path == "~":
        return "."
    return path[2:] if path.startswith("~/") else path


def command_line(argv: Sequence[str], env: Mapping[str, str] | None = None, cwd: str | None = None) -> str:
    """`[cd DIR &&] [env K=V ...] ARGV...`, every part shell-quoted."""
    parts: list[str] = []
    if env:
        parts += ["env", *[shlex.quote(f"{k}={v}") for k, v in env.items()]]
    parts += [shell_path(argv[0]), *(shlex.quote(a) for a in argv[1:])]
    line = " ".join(parts)
    return f"cd {shell_path(cwd)} && {line}" if cwd else line


class RemoteShell:
    """An open SSH connection to one host: run commands, put and get files."""

    def __init__(self, target: SshTarget, clients: list[paramiko.SSHClient]) -> None:
        self.target = target
        self._clients = clients
        self._sftp: paramiko.SFTPClient | None = None

    @classmethod
    def connect(cls, target: SshTarget) -> RemoteShell:
        """Connect through every jump to the host; an `InfrastructureError` names what failed."""
        clients: list[paramiko.SSHClient] = []
        sock: Any = None
        deadline = time.monotonic() + target.connect_timeout
        try:
            for hop in (*target.jumps, target.hop):
                if clients:
                    transport = clients[-1].get_transport()
                    assert transport is not None
                    try:
                        sock = transport.open_channel(
                            "direct-tcpip", (hop.hostname, hop.port), ("127.0.0.1", 0), timeout=_left(deadline)
                        )
                    except (paramiko.SSHException, OSError) as exc:
                        raise _fail(target, hop, f"the jump host cannot open a channel to it: {exc}") from None
                clients.append(_open_client(target, hop, sock, deadline))
        except BaseException:
            for c in reversed(clients):
                c.close()
            raise
        return cls(target, clients)

    def __enter__(self) -> RemoteShell:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the SFTP session and every hop's connection."""
        if self._sftp is not None:
            self._sftp.close()
            self._sftp = None
        for c in reversed(self._clients):
            c.close()
        self._clients = []

    def _transport(self) -> paramiko.Transport:
        transport = self._clients[-1].get_transport() if self._clients else None
        if transport is None or not transport.is_active():
            raise InfrastructureError(f"host {self.target.name!r}: the SSH connection was lost")
        return transport

    def run(
        self,
        argv: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        timeout: float | None = None,
        check: bool = False,
    ) -> CommandResult:
        """Run one command (each argument quoted); `check` turns a non-zero exit into an error."""
        merged = {**self.target.env, **(env or {})}
        return self.run_script(command_line(argv, merged, cwd), timeout=timeout, check=check, what=argv[0])

    def run_script(
        self, script: str, *, timeout: float | None = None, check: bool = False, what: str = "command"
    ) -> CommandResult:
        """Run a shell line the caller composed from quoted parts (see `command_line`)."""
        limit = timeout or DEFAULT_COMMAND_TIMEOUT
        chan = self._transport().open_session(timeout=limit)
        try:
            chan.exec_command(script)
            chan.shutdown_write()
            out, err = bytearray(), bytearray()
            deadline = time.monotonic() + limit
            while True:
                while chan.recv_ready():
                    out += chan.recv(65536)
                while chan.recv_stderr_ready():
                    err += chan.recv_stderr(65536)
                if chan.exit_status_ready() and not chan.recv_ready() and not chan.recv_stderr_ready():
                    break
                if time.monotonic() > deadline:
                    raise InfrastructureError(f"host {self.target.name!r}: {what} did not finish within {limit:g} s")
                select.select([chan], [], [], 0.05)
            code = chan.recv_exit_status()
        finally:
            chan.close()
        result = CommandResult(code, out.decode(errors="replace"), err.decode(errors="replace"))
        if check and not result.ok:
            raise InfrastructureError(
                f"host {self.target.name!r}: {what} failed (exit {code}): {result.last_error_line()}"
            )
        return result

    def sftp(self) -> paramiko.SFTPClient:
        """The host's SFTP session (opened once)."""
        if self._sftp is None:
            with self._sftp_errors("open an SFTP session", ""):
                self._sftp = self._clients[-1].open_sftp()
            channel = self._sftp.get_channel()
            if channel is not None:
                channel.settimeout(DEFAULT_COMMAND_TIMEOUT)
        return self._sftp

    @contextlib.contextmanager
    def _sftp_errors(self, what: str, remote: str) -> Iterator[None]:
        """An SFTP failure (a missing file, a full disk, a dropped session) as one `SftpError` line."""
        try:
            yield
        except (OSError, paramiko.SSHException, EOFError) as exc:
            reason = getattr(exc, "strerror", None) or str(exc).strip() or type(exc).__name__
            where = f" {remote}" if remote else ""
            raise SftpError(f"host {self.target.name!r}: SFTP could not {what}{where}: {reason}") from None

    def put_bytes(self, data: bytes, remote: str, *, mode: int = 0o600) -> None:
        """Write `data` to a remote file whose mode is set before any byte is written."""
        sftp = self.sftp()
        path = sftp_path(remote)
        with self._sftp_errors("write", remote), sftp.open(path, "w") as fh:
            sftp.chmod(path, mode)
            fh.write(data)

    def put(self, local: Path, remote: str, *, mode: int | None = None) -> None:
        """Copy a local file to the host (optionally setting its mode)."""
        with self._sftp_errors("write", remote):
            self.sftp().put(str(local), sftp_path(remote))
            if mode is not None:
                self.sftp().chmod(sftp_path(remote), mode)

    def get(self, remote: str, local: Path) -> None:
        """Copy a remote file to this machine."""
        with self._sftp_errors("read", remote):
            self.sftp().get(sftp_path(remote), str(local))

    def mkdir_p(self, remote: str, mode: int = 0o700) -> None:
        """Create a remote directory and its parents."""
        path = shell_path(remote)
        self.run_script(f"mkdir -p {path} && chmod {mode:o} {path}", check=True, what="mkdir")

    def walk(self, remote: str) -> list[tuple[str, paramiko.SFTPAttributes]]:
        """Every file under a remote directory with its attributes (SFTP paths); empty when absent."""
        sftp = self.sftp()
        out: list[tuple[str, paramiko.SFTPAttributes]] = []
        stack = [sftp_path(remote)]
        while stack:
            top = stack.pop()
            try:
                entries = sftp.listdir_attr(top)
            except OSError:
                continue
            for entry in entries:
                path = f"{top}/{entry.filename}"
                if entry.st_mode is not None and stat.S_ISDIR(entry.st_mode):
                    stack.append(path)
                else:
                    out.append((path, entry))
        return out

    def walk_files(self, remote: str, suffix: str = "") -> list[str]:
        """Every file under a remote directory (SFTP paths) ending in `suffix`, sorted."""
        return sorted(path for path, _ in self.walk(remote) if path.endswith(suffix))


def _left(deadline: float) -> float:
    return max(0.1, deadline - time.monotonic())


def _fail(target: SshTarget, hop: Hop, why: str) -> InfrastructureError:
    via = "" if hop == target.hop else f" (jump host {hop.address})"
    return InfrastructureError(f"host {target.name!r} ({target.hop.address}){via}: {why}")


def _open_client(target: SshTarget, hop: Hop, sock: Any, deadline: float) -> paramiko.SSHClient:
    client = paramiko.SSHClient()
    known = Path(target.known_hosts).expanduser()
    if known.is_file():
        client.load_host_keys(str(known))
    client.set_missing_host_key_policy(_RejectUnknown())
    key_file = str(Path(hop.identity_file).expanduser()) if hop.identity_file else None
    timeout = _left(deadline)
    try:
        client.connect(
            hop.hostname,
            port=hop.port,
            username=hop.user,
            key_filename=key_file,
            timeout=timeout,
            banner_timeout=timeout,
            auth_timeout=timeout,
            channel_timeout=timeout,
            sock=sock,
            allow_agent=True,
            look_for_keys=key_file is None,
        )
    except _UnknownHostKey as exc:
        client.close()
        raise _fail(
            target,
            hop,
            f"unknown host key {exc.key.get_name()} {key_fingerprint(exc.key)} (not in {target.known_hosts}); "
            "if that is the host's key, trust it with: "
            f"ssh-keyscan -p {hop.port} {hop.hostname} >> {target.known_hosts}",
        ) from None
    except paramiko.BadHostKeyException as exc:
        client.close()
        raise _fail(
            target,
            hop,
            f"host key CHANGED: offered {exc.key.get_name()} {key_fingerprint(exc.key)}, "
            f"known_hosts has {key_fingerprint(exc.expected_key)}; if the host was reinstalled, "
            f"remove the old key with: ssh-keygen -R '{known_hosts_name(hop)}' -f {target.known_hosts}",
        ) from None
    except paramiko.AuthenticationException:
        client.close()
        how = f"key file {hop.identity_file}" if hop.identity_file else "the SSH agent and default keys"
        raise _fail(target, hop, f"authentication as user {hop.user or '(default)'} with {how} was refused") from None
    except TimeoutError:
        client.close()
        raise _fail(target, hop, f"no answer within the connect timeout ({target.connect_timeout:g} s)") from None
    except paramiko.SSHException as exc:
        client.close()
        text = str(exc)
        timed_out = time.monotonic() >= deadline - 0.1  # paramiko words a banner timeout several ways
        if timed_out or "banner" in text.lower() or "timed out" in text.lower():
            text = f"no SSH answer within the connect timeout ({target.connect_timeout:g} s)"
        raise _fail(target, hop, text) from None
    except OSError as exc:
        client.close()
        causes = list(getattr(exc, "errors", {}).values())  # paramiko's NoValidConnectionsError
        why = next((c.strerror for c in causes if getattr(c, "strerror", None)), None) or exc.strerror or str(exc)
        if isinstance(exc, TimeoutError) or "timed out" in why:
            why = f"no answer within the connect timeout ({target.connect_timeout:g} s)"
            raise _fail(target, hop, why) from None
        raise _fail(target, hop, f"cannot connect: {why}") from None
    return client
