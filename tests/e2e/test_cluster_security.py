"""The cluster's security promises with real sshd hosts and a real Ray head and node.

A port squatter never gets the token; `collect` refuses a fragment that would write outside the
store and reports SFTP failures in one line; a TLS cluster runs a sweep over mutual TLS only,
serves no unauthenticated metrics, tolerates stale pid files, replaces a leaked token, removes
the hosts' token and keys on `down`, and rotates the token on request.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import ssl
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from ray._private.services import _find_address_from_flag

from orchestrator.store.dataset import read_rows
from orchestrator.store.fragments import ResultStore
from tests.conftest import child_env
from tests.e2e.test_cluster import ORCHESTRATE, SWEEP, inventory_toml
from tests.sshd_hosts import SshLab, free_port, require_sshd, start_lab
from workers.contract import HostFingerprint, JobSpec, failed_job_table
from workers.proc.table import is_descendant, listening_pids, process_name

pytestmark = pytest.mark.slow


def live_gcs_addresses() -> set[str]:
    """The GCS addresses of the raylets running now (Ray's `find_gcs_addresses` caches any non-empty
    answer for the life of the process, so another cluster on this machine would freeze it)."""
    return set(_find_address_from_flag("--gcs-address"))


@pytest.fixture(scope="module")
def lab() -> Iterator[tuple[Path, SshLab]]:
    require_sshd()
    root = Path(tempfile.mkdtemp(prefix="o6-", dir="/tmp"))  # short: Ray's socket paths must stay short
    lab = start_lab(root / "ssh", ["127.0.0.6", "127.0.0.7"])
    yield root, lab
    lab.stop()
    shutil.rmtree(root, ignore_errors=True)


def setup(
    lab: tuple[Path, SshLab], name: str, hosts: dict[str, dict[str, object]], *, port: int = 0, tls: bool = False
) -> tuple[Path, Path, dict[str, str]]:
    root, sshd = lab
    work = root / name
    work.mkdir()
    text = inventory_toml(work, sshd, port or free_port("127.0.0.1"), hosts)
    inv = work / "inv.toml"
    inv.write_text(text.replace("dashboard = false\n", "dashboard = false\ntls = true\n") if tls else text)
    env = child_env(HOME=str(work / "home"), RAY_AUTH_TOKEN_PATH=str(work / "home" / ".ray" / "auth_token"))
    for key in ("ORCHESTRATE_SPOOL", "RAY_AUTH_MODE", "RAY_ADDRESS", "ORCHESTRATE_LOCK_PATH"):
        env.pop(key, None)
    return work, inv, env


def orchestrate(env: dict[str, str], *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([ORCHESTRATE, *args], capture_output=True, text=True, env=env, timeout=timeout)


class Squatter:
    """A TCP listener that is not a Ray head; keeps every byte it is sent."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.sock.settimeout(0.2)
        self.port = self.sock.getsockname()[1]
        self.received = b""
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while not self.stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            conn.settimeout(2)
            try:
                while chunk := conn.recv(65536):
                    self.received += chunk
            except OSError:
                pass
            conn.close()

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)
        self.sock.close()


def test_a_port_squatter_is_refused_and_never_gets_the_token(lab: tuple[Path, SshLab]) -> None:
    squatter = Squatter()
    work, inv, env = setup(lab, "squat", {"x1": {"sshd": 0, "device": "alpha"}}, port=squatter.port)
    try:
        up = orchestrate(env, "cluster", "up", "--inventory", str(inv))
        assert up.returncode == 3, up.stdout + up.stderr
        assert f"port {squatter.port} of this machine is taken by pid {os.getpid()}" in up.stderr
        assert "not by the Ray head `orchestrate cluster up` started" in up.stderr
        assert not (work / "x1" / "auth_token").exists() and not (work / "x1" / "ray-node.pid").exists()
        sweep = work / "s.toml"
        sweep.write_text(SWEEP.format(name="squat", tokens=[1], n=64, reps=1))
        run = orchestrate(env, "run", "--inventory", str(inv), "--sweep", str(sweep), "-r", str(work / "res"))
        assert run.returncode == 3 and f"taken by pid {os.getpid()}" in run.stderr, run.stderr
        token = (work / "home" / ".ray" / "auth_token").read_bytes()
        assert token not in squatter.received  # neither `up` nor the driver sent it the token
    finally:
        squatter.close()


def fragment(sweep: str, run_id: str, key: str) -> pa.Table:
    job = JobSpec(run_id=run_id, sweep="ok", job_key=key, case="qmm", case_name="qmm", params={"tokens": 1},
                  arms=["native"], device="alpha", repetitions=1, warmup=0)  # fmt: skip
    table = failed_job_table(job, HostFingerprint.unknown("cpu"), "x")
    return table.set_column(table.schema.get_field_index("sweep"), "sweep", pa.array([sweep] * table.num_rows))


def test_collect_refuses_a_fragment_that_would_escape_the_store_and_reports_sftp_errors_in_one_line(
    lab: tuple[Path, SshLab],
) -> None:
    work, inv, env = setup(lab, "collect", {"x1": {"sshd": 0, "device": "alpha"}, "x2": {"sshd": 1, "device": "alpha"}})
    evil = work / "x1" / "spool" / "ok" / "r1"
    evil.mkdir(parents=True)
    pq.write_table(fragment("../../../escaped", "r1", "k1"), evil / "part-r1-k1.parquet")
    broken = work / "x2" / "spool" / "ok" / "r2"
    broken.mkdir(parents=True)
    (broken / "part-r2-k2.parquet").symlink_to(work / "nowhere")  # listed, but SFTP cannot read it
    results = work / "results"
    done = orchestrate(env, "collect", "--inventory", str(inv), "-r", str(results))
    assert done.returncode == 3, done.stdout + done.stderr
    assert "x1: 1 spooled, 0 fetched (error: part-r1-k1.parquet: " in done.stdout
    assert "fragment's sweep '../../../escaped' is not a safe name" in done.stdout
    assert "x2: 1 spooled, 0 fetched (error: host 'x2': SFTP could not read " in done.stdout
    assert "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) == 1
    assert not [p for p in lab[0].rglob("*escaped*")]  # nothing was written outside the store
    assert not list(results.rglob("*.parquet"))


def _address(hexip: str) -> str:
    """An address as /proc/net/tcp{,6} writes it (32-bit words in host order)."""
    raw = bytes.fromhex(hexip)
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    if len(raw) == 4:
        return socket.inet_ntop(socket.AF_INET, words)
    if words[:12] == b"\0" * 10 + b"\xff\xff":  # ::ffff:a.b.c.d, an IPv4 listener on a v6 socket
        return socket.inet_ntop(socket.AF_INET, words[12:])
    return socket.inet_ntop(socket.AF_INET6, words)


def listeners_of(roots: list[int]) -> list[tuple[int, str, str, int]]:
    """(pid, name, address, port) of every TCP listener owned by the process trees of `roots`."""
    sockets: dict[str, tuple[str, int]] = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A":
                hexip, hexport = fields[1].split(":")
                sockets[f"socket:[{fields[9]}]"] = (_address(hexip), int(hexport, 16))
    out = []
    for pid in (int(p) for p in os.listdir("/proc") if p.isdigit()):
        if not any(is_descendant(pid, r) for r in roots):
            continue
        try:
            links = [os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")]
        except OSError:
            continue
        out += [(pid, process_name(pid), *sockets[link]) for link in links if link in sockets]
    return out


def answers_metrics(address: str, port: int) -> bool:
    """Whether an HTTP GET at address:port returns Prometheus text."""
    try:
        with socket.create_connection((address, port), timeout=2) as conn:
            conn.sendall(b"GET /metrics HTTP/1.0\r\n\r\n")
            conn.settimeout(2)
            data = b""
            while len(data) < 4096 and (chunk := conn.recv(4096)):
                data += chunk
    except OSError:
        return False
    return b"# TYPE" in data or b"# HELP" in data


def tls_peer(address: str, port: int, tls: Path, *, client_cert: bool) -> str:
    """The common name of the certificate the server at address:port shows, after a mutual TLS
    handshake with this cluster's CA (and the head's certificate as the client's, if asked)."""
    context = ssl.create_default_context(cafile=str(tls / "ca.crt"))
    context.set_alpn_protocols(["h2"])
    if client_cert:
        context.load_cert_chain(str(tls / "head.crt"), str(tls / "head.key"))
    with (
        socket.create_connection((address, port), timeout=5) as raw,
        context.wrap_socket(raw, server_hostname=address) as conn,
    ):
        subject = dict(x[0] for x in conn.getpeercert()["subject"])  # type: ignore[index, misc]
        conn.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00")
        conn.settimeout(5)
        if not conn.recv(64):  # a server that refuses our certificate ends the connection here
            raise ConnectionError("the server closed the connection")
        return str(subject["commonName"])


def test_a_tls_cluster_speaks_only_mutual_tls_serves_no_open_metrics_and_cleans_up(
    lab: tuple[Path, SshLab],
) -> None:
    work, inv, env = setup(lab, "tls", {"x1": {"sshd": 0, "device": "alpha"}}, tls=True)
    port = int(next(ln for ln in inv.read_text().splitlines() if ln.startswith("ray_port")).split("=")[1])
    token = work / "home" / ".ray" / "auth_token"
    token.parent.mkdir(parents=True)
    token.write_text("0" * 64)
    token.chmod(0o644)  # made readable by others: must be treated as leaked
    bystander = subprocess.Popen(["sleep", "600"])
    (work / "head").mkdir()
    (work / "x1").mkdir()
    (work / "x1" / "auth_token").mkdir()  # the host cannot take the token: one SFTP error line
    try:
        failed = orchestrate(env, "cluster", "up", "--inventory", str(inv))
        assert failed.returncode == 3, failed.stdout + failed.stderr
        assert "host 'x1': SFTP could not write " in failed.stderr and "Traceback" not in failed.stderr
        assert "readable by other users (mode 0644): treated as leaked and replaced" in failed.stderr
        assert token.read_text() != "0" * 64 and token.stat().st_mode & 0o777 == 0o600
        (work / "x1" / "auth_token").rmdir()
        # Stale pid files: the head's and the node's name a live process that is not ours.
        (work / "x1" / "ray-node.pid").write_text(f"{bystander.pid}\n")
        up = orchestrate(env, "cluster", "up", "--inventory", str(inv))
        assert up.returncode == 0, up.stdout + up.stderr
        assert "x1: started" in up.stdout  # not taken for "running" by the stale pid
        for name in ("auth_token", "tls/node.key", "tls/node.crt", "tls/ca.crt"):
            assert (work / "x1" / name).stat().st_mode & 0o777 == 0o600, name
        assert not (work / "x1" / "tls" / "ca.key").exists()  # the CA's key never leaves the head

        sweep = work / "s.toml"
        sweep.write_text(SWEEP.format(name="tls", tokens=[1, 2], n=64, reps=2))
        results = work / "results"
        run = orchestrate(env, "run", "--inventory", str(inv), "--sweep", str(sweep), "-r", str(results))
        assert run.returncode == 0, run.stdout + run.stderr
        table = read_rows(ResultStore(results), sweep="tls")
        assert set(table.column("host").to_pylist()) == {"x1"} and set(table.column("status").to_pylist()) == {"ok"}

        head_pid = int((work / "head" / "head.pid").read_text())
        node_pid = int((work / "x1" / "ray-node.pid").read_text())
        tls = work / "head" / "tls"
        assert tls_peer("127.0.0.1", port, tls, client_cert=True) == "head"  # the GCS, mutual TLS
        with pytest.raises((ssl.SSLError, ConnectionError)):
            tls_peer("127.0.0.1", port, tls, client_cert=False)  # no certificate from our CA: refused
        with socket.create_connection(("127.0.0.1", port), timeout=5) as plain:  # plaintext gRPC: no
            plain.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
            plain.settimeout(5)
            reply = plain.recv(64)
            assert reply[3:4] != b"\x04", reply  # never an HTTP/2 SETTINGS frame
        node_listeners = listeners_of([node_pid])
        raylet = [(a, p) for pid, name, a, p in node_listeners if name == "raylet" and a == "::"]
        assert raylet and all(tls_peer("127.0.0.6", p, tls, client_cert=True) == "x1" for _, p in raylet)
        reachable = [  # every listener not limited to this machine's own loopback address
            (name, "127.0.0.6" if a in ("::", "0.0.0.0") else a, p)
            for _, name, a, p in listeners_of([head_pid]) + node_listeners
            if a not in ("127.0.0.1", "::1")
        ]
        assert any(name == "gcs_server" for name, _, _ in reachable)  # the listing does see the cluster
        assert [r for r in reachable if answers_metrics(r[1], r[2])] == []  # no open Prometheus endpoint

        (work / "head" / "head.pid").write_text(f"{bystander.pid}\n")  # the head's pid file goes stale
        (work / "head" / "head.pid.real").write_text(f"{head_pid}\n")
        down = orchestrate(env, "cluster", "down", "--inventory", str(inv))
        assert down.returncode == 0, down.stdout + down.stderr
        assert "Ray head: stale pid file" in down.stdout and bystander.poll() is None  # left alone
        assert "x1: stopped" in down.stdout
        assert not (work / "x1" / "auth_token").exists() and not (work / "x1" / "tls").exists()
        os.killpg(head_pid, signal.SIGTERM)  # the real head, which the stale pid file hid
        time.sleep(5)  # as `stop_head` does: a grace period, then SIGKILL (Ray's GCS can outlive SIGTERM by 20 s)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(head_pid, signal.SIGKILL)
        deadline = time.monotonic() + 60
        while listening_pids(port) is not None or any(a.endswith(f":{port}") for a in live_gcs_addresses()):
            assert time.monotonic() < deadline, "the head's port stayed taken"  # or its GCS process lived on,
            time.sleep(0.2)  # which `ray start --head` takes for a running cluster
        before = token.read_text()
        rotated = orchestrate(env, "cluster", "up", "--inventory", str(inv), "--rotate-token", timeout=300)
        assert rotated.returncode == 0, rotated.stdout + rotated.stderr
        assert token.read_text() != before and (work / "x1" / "auth_token").read_bytes() == token.read_bytes()
        assert before not in rotated.stdout + rotated.stderr
    finally:
        orchestrate(env, "cluster", "down", "--inventory", str(inv))
        for pidfile in (work / "head" / "head.pid", work / "head" / "head.pid.real", work / "x1" / "ray-node.pid"):
            pid = int(pidfile.read_text()) if pidfile.exists() else bystander.pid
            if pid != bystander.pid:  # a safety net: nothing this test started may outlive it
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(pid, signal.SIGKILL)
        bystander.kill()
        bystander.wait()
