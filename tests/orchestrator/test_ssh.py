"""`RemoteShell` against real OpenSSH sshd processes on 127.0.0.2 and 127.0.0.3."""

from __future__ import annotations

import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from orchestrator.cluster.ssh import RemoteShell, command_line, sftp_path, shell_path
from orchestrator.cluster.target import SshTarget
from orchestrator.errors import InfrastructureError
from orchestrator.specs.sweep import HostSpec
from tests.sshd_hosts import SshLab, make_key, require_sshd, start_lab

# ------------------------------------------------------------------------------ no sshd needed


def test_command_line_quotes_every_argument() -> None:
    line = command_line(["/opt/py/bin/python", "-c", "print('a b')", "$(rm -rf /)"], {"A": "x y;z"}, cwd="/tmp/w d")
    assert line == ("cd '/tmp/w d' && env 'A=x y;z' /opt/py/bin/python -c 'print('\"'\"'a b'\"'\"')' '$(rm -rf /)'")


def test_home_relative_paths_keep_meaning_home() -> None:
    assert shell_path("~/.venvs/o/bin/python") == '"$HOME"/.venvs/o/bin/python'
    assert shell_path("/tmp/a b") == "'/tmp/a b'"
    assert sftp_path("~/.orchestrate/spool") == ".orchestrate/spool"
    assert sftp_path("/abs") == "/abs"


def test_ssh_config_supplies_what_the_inventory_leaves_out(tmp_path: Path) -> None:
    config = tmp_path / "config"
    config.write_text(
        "Host studio\n  HostName 10.1.2.3\n  Port 2200\n  User bench\n  IdentityFile ~/.ssh/lab\n"
        "  ProxyJump jumper@bastion:2222\n\nHost bastion\n  HostName 10.0.0.1\n"
    )
    host = HostSpec(name="studio", host="studio", device="m1-ultra", backend="metal")
    target = SshTarget.from_host(host, ssh_config=config)
    assert (target.hop.hostname, target.hop.port, target.hop.user) == ("10.1.2.3", 2200, "bench")
    assert target.hop.identity_file is not None and target.hop.identity_file.endswith("/.ssh/lab")
    assert [(j.hostname, j.port, j.user) for j in target.jumps] == [("10.0.0.1", 2222, "jumper")]
    explicit = HostSpec(name="studio", host="studio", port=22, user="me", device="m1-ultra", proxy_jump=[])
    target = SshTarget.from_host(explicit, ssh_config=config)
    assert (target.hop.port, target.hop.user) == (22, "me")  # the inventory's explicit fields win


# ---------------------------------------------------------------------------- real sshd hosts


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SshLab]:
    require_sshd()
    lab = start_lab(tmp_path_factory.mktemp("ssh"), ["127.0.0.2", "127.0.0.3"])
    yield lab
    lab.stop()


def host_spec(lab: SshLab, i: int = 0, **over: object) -> HostSpec:
    h = lab.hosts[i]
    fields: dict[str, object] = {
        "name": f"h{i}", "host": h.address, "port": h.port, "user": h.user, "identity_file": str(lab.client_key),
        "known_hosts": str(lab.known_hosts), "device": "cpu", "connect_timeout": 3.0,
    }  # fmt: skip
    fields.update(over)
    return HostSpec.model_validate(fields)


def connect(spec: HostSpec) -> RemoteShell:
    return RemoteShell.connect(SshTarget.from_host(spec))


@pytest.mark.slow
def test_run_keeps_exit_code_stdout_stderr_and_quotes_arguments(lab: SshLab) -> None:
    with connect(host_spec(lab)) as shell:
        res = shell.run(["echo", "a  b; echo injected", "$HOME"])
        assert (res.exit_code, res.stdout) == (0, "a  b; echo injected $HOME\n")
        res = shell.run(["sh", "-c", "echo out; echo oops >&2; exit 7"])
        assert (res.exit_code, res.stdout, res.stderr) == (7, "out\n", "oops\n")
        with pytest.raises(InfrastructureError, match=r"host 'h0': sh failed \(exit 7\): oops"):
            shell.run(["sh", "-c", "echo oops >&2; exit 7"], check=True)
        res = shell.run(["sh", "-c", 'printf %s "$GREETING"'], env={"GREETING": "hi there"})
        assert res.stdout == "hi there"


@pytest.mark.slow
def test_every_command_has_a_timeout(lab: SshLab) -> None:
    with connect(host_spec(lab)) as shell:
        t0 = time.monotonic()
        with pytest.raises(InfrastructureError, match=r"host 'h0': sleep did not finish within 0.5 s"):
            shell.run(["sleep", "30"], timeout=0.5)
        assert time.monotonic() - t0 < 3
        assert shell.run(["true"]).ok  # the connection is still usable


@pytest.mark.slow
def test_sftp_put_sets_mode_before_writing_and_get_round_trips(lab: SshLab, tmp_path: Path) -> None:
    remote = tmp_path / "remote"
    remote.mkdir()
    with connect(host_spec(lab)) as shell:
        shell.put_bytes(b"not-a-real-token", str(remote / "auth_token"), mode=0o600)
        assert (remote / "auth_token").stat().st_mode & 0o777 == 0o600
        assert (remote / "auth_token").read_bytes() == b"not-a-real-token"
        (remote / "data.bin").write_bytes(bytes(range(256)) * 10)
        shell.get(str(remote / "data.bin"), tmp_path / "back.bin")
        assert (tmp_path / "back.bin").read_bytes() == bytes(range(256)) * 10
        (remote / "d" / "e").mkdir(parents=True)
        (remote / "d" / "e" / "x.parquet").write_bytes(b"")
        (remote / "d" / "y.txt").write_bytes(b"")
        assert shell.walk_files(str(remote / "d"), ".parquet") == [str(remote / "d" / "e" / "x.parquet")]
        assert shell.walk_files(str(remote / "missing")) == []


@pytest.mark.slow
def test_proxy_jump_goes_through_the_jump_host(lab: SshLab, tmp_path: Path) -> None:
    jump = lab.hosts[0]
    spec = host_spec(lab, 1, proxy_jump=[f"{jump.user}@{jump.address}:{jump.port}"])
    with connect(spec) as shell:
        # sshd puts the client's address in SSH_CONNECTION: through the jump host it is the jump's sshd.
        assert shell.run(["sh", "-c", 'printf %s "$SSH_CONNECTION"']).stdout.split()[2] == "127.0.0.3"
    jump.stop()
    try:
        with pytest.raises(InfrastructureError, match=r"host 'h1' \(127\.0\.0\.3:\d+\) \(jump host 127\.0\.0\.2:\d+\)"):
            connect(spec)
        connect(host_spec(lab, 1)).close()  # the host itself is up: the failure was the jump host
    finally:
        jump.start([lab.client_key.with_name("client_ed25519.pub").read_text().strip()])


@pytest.mark.slow
def test_unknown_host_key_is_refused_with_its_fingerprint(lab: SshLab, tmp_path: Path) -> None:
    empty = tmp_path / "known_hosts"
    empty.write_text("")
    host = lab.hosts[0]
    expected = subprocess.run(
        ["ssh-keygen", "-l", "-E", "sha256", "-f", str(host.root / "host_ed25519.pub")],
        capture_output=True, text=True, check=True,
    ).stdout.split()[1]  # fmt: skip
    with pytest.raises(InfrastructureError) as err:
        connect(host_spec(lab, known_hosts=str(empty)))
    msg = str(err.value)
    assert f"host 'h0' ({host.address}:{host.port})" in msg
    assert f"unknown host key ssh-ed25519 {expected}" in msg
    assert f"ssh-keyscan -p {host.port} {host.address} >> {empty}" in msg


@pytest.mark.slow
def test_changed_host_key_is_refused(lab: SshLab, tmp_path: Path) -> None:
    other = tmp_path / "other"
    public = make_key(other)
    host = lab.hosts[0]
    known = tmp_path / "known_hosts"
    known.write_text(f"[{host.address}]:{host.port} {' '.join(public.split()[:2])}\n")
    with pytest.raises(InfrastructureError, match=r"host 'h0' .*host key CHANGED.*ssh-keygen -R"):
        connect(host_spec(lab, known_hosts=str(known)))


@pytest.mark.slow
def test_wrong_user_key_is_refused(lab: SshLab, tmp_path: Path) -> None:
    stranger = tmp_path / "stranger"
    make_key(stranger)
    t0 = time.monotonic()
    with pytest.raises(InfrastructureError, match=r"host 'h0' .*authentication as user \w+ with key file .*stranger"):
        connect(host_spec(lab, identity_file=str(stranger)))
    assert time.monotonic() - t0 < 5


@pytest.mark.slow
def test_unreachable_host_is_reported_within_the_connect_timeout(lab: SshLab) -> None:
    # A host that accepts TCP but never speaks SSH (hung sshd, firewall that swallows packets).
    silent = socket.socket()
    silent.bind(("127.0.0.4", 0))
    silent.listen(8)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        silent.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(silent.accept()[0])
            except OSError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        spec = host_spec(lab, host="127.0.0.4", port=silent.getsockname()[1], connect_timeout=1.5)
        t0 = time.monotonic()
        with pytest.raises(InfrastructureError, match=r"host 'h0' \(127\.0\.0\.4:\d+\): .*within the connect timeout"):
            connect(spec)
        assert time.monotonic() - t0 < 1.5 + 1.0
    finally:
        stop.set()
        thread.join()
        for s in held:
            s.close()
        silent.close()
    closed = host_spec(lab, host="127.0.0.4", port=lab.hosts[0].port, connect_timeout=1.5)
    with pytest.raises(
        InfrastructureError, match=r"host 'h0' \(127\.0\.0\.4:\d+\): cannot connect: Connection refused"
    ):
        connect(closed)
