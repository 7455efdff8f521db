"""Many hosts, end to end: real sshd hosts on loopback addresses, a real Ray head here and a real
Ray worker node on each host, all started by `orchestrate cluster up` and driven through the CLI.

Three hosts: `a1` and `a2` of device kind `alpha`, `b1` of kind `beta` (reached over SSH through
a ProxyJump via a1's sshd). The Ray head runs on 127.0.0.1; each node on its own loopback address
with its own work dir, lock and spool.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from orchestrator.store.dataset import read_rows
from orchestrator.store.fragments import ResultStore
from tests.conftest import BIN, child_env
from tests.sshd_hosts import SshLab, free_port, make_key, require_sshd, start_lab

pytestmark = pytest.mark.slow

HOSTS = {"a1": ("127.0.0.2", "alpha"), "a2": ("127.0.0.3", "alpha"), "b1": ("127.0.0.4", "beta")}
ORCHESTRATE = str(BIN / "orchestrate")


def inventory_toml(root: Path, lab: SshLab, port: int, hosts: dict[str, dict[str, object]]) -> str:
    """An inventory for the lab's hosts; `hosts` maps a name to its overrides (`sshd` = lab index,
    `env` = variables beside the host's own HOME)."""
    lines = [
        "[head]",
        'address = "127.0.0.1"',
        f"ray_port = {port}",
        f'workdir = "{root / "head"}"',
        "dashboard = false",
        "[defaults]",
        f'user = "{lab.hosts[0].user}"',
        f'identity_file = "{lab.client_key}"',
        f'known_hosts = "{lab.known_hosts}"',
        f'python = "{BIN / "python"}"',
        "num_cpus = 1",
        "connect_timeout = 5",
        # The CPU-quiet gate is not under test here (test_run_gpu_host and test_own_processes test it):
        # these hosts share one machine with the test runner and its sshd servers.
        "cpu_busy_threshold = 1e9",
    ]
    for name, over in hosts.items():
        sshd = lab.hosts[int(over.pop("sshd"))]  # type: ignore[call-overload]
        env = {"HOME": str(root / name), **over.pop("env", {})}  # type: ignore[dict-item]
        fields: dict[str, object] = {
            "name": name, "host": sshd.address, "port": sshd.port, "node_ip": sshd.address,
            "workdir": str(root / name), "lock": str(root / name / "gpu.lock"),
        }  # fmt: skip
        fields.update(over)
        lines.append("[[hosts]]")
        lines += [f"{k} = {_toml(v)}" for k, v in fields.items()]
        # the test hosts' HOME: never the real one
        lines.append("env = { " + ", ".join(f"{k} = {_toml(v)}" for k, v in env.items()) + " }")
    return "\n".join(lines) + "\n"


def _toml(value: object) -> str:
    return str(value) if isinstance(value, int | float) else f'"{value}"'


SWEEP = """
name = "{name}"
repetitions = {reps}
warmup = 1
baseline = "affine"

[[cases]]
case = "qmm"
arms = ["native", "affine"]
params = {{ tokens = {tokens}, n = {n}, k = {n}, dtype = "float32" }}
"""


@dataclass
class Cluster:
    root: Path
    inventory: Path
    env: dict[str, str]
    lab: SshLab

    def orchestrate(self, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
        env = {**self.env, "COLUMNS": "250"}  # host tables one line per host: the tests read them by line
        return subprocess.run(
            [ORCHESTRATE, *args], capture_output=True, text=True, env=env, timeout=timeout, cwd=self.root
        )

    def sweep(self, name: str, *, tokens: list[int], n: int, reps: int) -> Path:
        path = self.root / f"{name}.toml"
        path.write_text(SWEEP.format(name=name, tokens=tokens, n=n, reps=reps))
        return path

    def node_pid(self, host: str) -> int:
        return int((self.root / host / "ray-node.pid").read_text())


@pytest.fixture(scope="module")
def lab() -> Iterator[tuple[Path, SshLab]]:
    require_sshd()
    # A short root: Ray's unix socket paths under each node's temp dir must stay under 107 bytes.
    root = Path(tempfile.mkdtemp(prefix="o4-", dir="/tmp"))
    lab = start_lab(root / "ssh", [address for address, _ in HOSTS.values()])
    yield root, lab
    lab.stop()
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def cluster(lab: tuple[Path, SshLab]) -> Iterator[Cluster]:
    root, sshd = lab
    hosts: dict[str, dict[str, object]] = {
        name: {"sshd": i, "device": kind} for i, (name, (_, kind)) in enumerate(HOSTS.items())
    }
    jump = sshd.hosts[0]
    hosts["b1"]["proxy_jump"] = f"{jump.user}@{jump.address}:{jump.port}"  # b1's SSH goes through a1's sshd
    inv = root / "lab.toml"
    inv.write_text(inventory_toml(root, sshd, free_port("127.0.0.1"), hosts))
    home = root / "home"
    home.mkdir(exist_ok=True)
    env = child_env(HOME=str(home), RAY_AUTH_TOKEN_PATH=str(home / ".ray" / "auth_token"))
    for key in ("ORCHESTRATE_SPOOL", "RAY_AUTH_MODE", "RAY_ADDRESS"):
        env.pop(key, None)
    c = Cluster(root, inv, env, sshd)
    try:
        up = c.orchestrate("cluster", "up", "--inventory", str(inv))
        assert up.returncode == 0, up.stdout + up.stderr
        yield c
    finally:
        down = c.orchestrate("cluster", "down", "--inventory", str(inv))
        for pidfile in [root / name / "ray-node.pid" for name in HOSTS] + [root / "head" / "head.pid"]:
            # a safety net: nothing this module started may outlive it
            if pidfile.exists():
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.killpg(int(pidfile.read_text()), signal.SIGKILL)
        assert down.returncode == 0, down.stdout + down.stderr


def stored(results: Path) -> ResultStore:
    store = ResultStore(results)
    assert store.fragments(), f"no fragments under {results}"
    return store


def test_status_then_sweep_over_two_kinds_puts_rows_on_the_right_hosts_and_collect_refetches(
    cluster: Cluster,
) -> None:
    token = Path(cluster.env["RAY_AUTH_TOKEN_PATH"])
    assert token.stat().st_mode & 0o777 == 0o600
    for name in HOSTS:
        copied = cluster.root / name / "auth_token"
        assert copied.stat().st_mode & 0o777 == 0o600 and copied.read_bytes() == token.read_bytes()

    status = cluster.orchestrate("cluster", "status", "--inventory", str(cluster.inventory))
    assert status.returncode == 0, status.stderr
    for name in HOSTS:
        line = next(ln for ln in status.stdout.splitlines() if ln.strip(" │|").startswith(name))
        assert "alive" in line and "free" in line, status.stdout
    assert token.read_text() not in status.stdout + status.stderr  # the token is never printed

    sweep = cluster.sweep("two-kinds", tokens=[1, 2, 3, 4], n=64, reps=3)
    results = cluster.root / "results-1"
    run = cluster.orchestrate("run", "--inventory", str(cluster.inventory), "--sweep", str(sweep), "-r", str(results))
    assert run.returncode == 0, run.stdout + run.stderr
    table = read_rows(stored(results), sweep="two-kinds")
    assert set(table.column("status").to_pylist()) == {"ok"}
    by_kind: dict[str, set[str]] = {}
    for device, host in zip(table.column("device").to_pylist(), table.column("host").to_pylist(), strict=True):
        by_kind.setdefault(device, set()).add(host)
    assert by_kind == {"alpha": {"a1", "a2"}, "beta": {"b1"}}  # alpha's 4 jobs spread over both alpha hosts
    assert len(set(table.column("job_key").to_pylist())) == 8

    # A fragment the head never stored (here: removed) comes back from the worker's spool.
    store = ResultStore(results)
    victim = store.fragments()[0]
    original = pq.read_table(victim.path)
    victim.path.unlink()
    collect = cluster.orchestrate("collect", "--inventory", str(cluster.inventory), "-r", str(results))
    assert collect.returncode == 0, collect.stdout + collect.stderr
    assert "collected 1 fragments" in collect.stdout
    back = pq.read_table(victim.path)
    assert back.num_rows == original.num_rows and back.column("value").equals(original.column("value"))
    again = cluster.orchestrate("collect", "--inventory", str(cluster.inventory), "-r", str(results))
    assert "collected 0 fragments" in again.stdout
    # The same job stored complete under another run (a rerun measured it): not imported twice.
    victim.path.rename(victim.path.with_name(f"part-20991231T000000Z-beef-{victim.job_key}.parquet"))
    dupes = cluster.orchestrate("collect", "--inventory", str(cluster.inventory), "-r", str(results))
    assert "collected 0 fragments" in dupes.stdout, dupes.stdout

    status = cluster.orchestrate("cluster", "status", "--inventory", str(cluster.inventory))
    for name in HOSTS:  # each host's last job is one of this sweep's
        line = next(ln for ln in status.stdout.splitlines() if ln.strip(" │|").startswith(name))
        assert any(key in line for key in set(table.column("job_key").to_pylist())), status.stdout

    logs = cluster.root / "logs"
    got = cluster.orchestrate("cluster", "logs", "--inventory", str(cluster.inventory), "--out", str(logs))
    assert got.returncode == 0, got.stdout + got.stderr
    secret = token.read_text()
    assert "Ray runtime started." in (logs / "head" / "head.log").read_text()
    for name in HOSTS:
        node_log = (logs / name / "ray-node.log").read_text()
        raylet = (logs / name / "raylet.out").read_text()
        assert "Ray runtime started." in node_log and HOSTS[name][0] in raylet
        assert secret not in node_log + raylet  # the token is never logged


def wait_for(predicate: Callable[[], bool], timeout: float, what: str, *, poll: float = 0.1) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(poll)
    raise AssertionError(f"timed out waiting for {what}")


def test_host_killed_mid_sweep_retries_on_its_kind_or_fails_with_the_reason(cluster: Cluster) -> None:
    sweep = cluster.sweep("host-loss", tokens=[64, 65, 66], n=1024, reps=8)
    results = cluster.root / "results-2"
    proc = subprocess.Popen(
        [ORCHESTRATE, "run", "--inventory", str(cluster.inventory), "--sweep", str(sweep), "-r", str(results)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=cluster.env, cwd=cluster.root,
    )  # fmt: skip
    try:
        # Kill a1's and b1's whole Ray nodes (raylet, workers, the job) each as soon as its first job
        # holds the lock. Waiting for both to hold it at once raced: a job is about a second, so b1 could
        # finish its first job (an ok beta row) before a1's began.
        holders = {h: cluster.root / h / "gpu.lock.holder" for h in ("a1", "b1")}
        killed: set[str] = set()

        def kill_those_running() -> bool:
            for host, holder in holders.items():
                if host not in killed and holder.exists():
                    os.killpg(cluster.node_pid(host), signal.SIGKILL)
                    killed.add(host)
            return len(killed) == len(holders)

        wait_for(kill_those_running, 120, "jobs running on a1 and b1", poll=0.02)
        # the holder file names the job each lost host was running: `cmd=<sweep>/<case>/<job key>`
        running = {
            host: next(ln for ln in p.read_text().splitlines() if ln.startswith("cmd=")).rsplit("/", 1)[-1]
            for host, p in holders.items()
        }
        out, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    try:
        assert proc.returncode == 1, out  # beta's jobs failed: no beta host is left
        table = read_rows(stored(results), sweep="host-loss")
        alpha = table.filter(pc.equal(table.column("device"), "alpha"))
        beta = table.filter(pc.equal(table.column("device"), "beta"))
        # Every alpha job finished ok (the one on a1 was retried on a2); no finished row was lost.
        assert set(alpha.column("status").to_pylist()) == {"ok"}
        assert len(set(alpha.column("job_key").to_pylist())) == 3
        # The job that was running on a1 when it died was run again, to the end, on a2.
        lost_job = alpha.filter(pc.equal(alpha.column("job_key"), running["a1"]))
        assert lost_job.num_rows > 0 and set(lost_job.column("host").to_pylist()) == {"a2"}
        # Every beta job is recorded as failed, with the reason.
        assert len(set(beta.column("job_key").to_pylist())) == 3
        assert set(beta.column("status").to_pylist()) == {"failed"}
        assert set(beta.column("error").to_pylist()) == {
            "no live node of device kind 'beta' is left to run or retry it (lost: b1)"
        }
    finally:  # bring the lost nodes back for the tests after this one
        up = cluster.orchestrate("cluster", "up", "--inventory", str(cluster.inventory))
        assert up.returncode == 0, up.stdout + up.stderr
        assert "a1: started" in up.stdout and "b1: started" in up.stdout and "a2: running" in up.stdout
        status = cluster.orchestrate("cluster", "status", "--inventory", str(cluster.inventory))
        for name in ("a1", "b1"):  # the lock a killed job held is free again (its holder file, where the
            # job's process died before removing it, is reported as stale; one that outlived its
            # node long enough to finish removes it itself)
            line = next(ln for ln in status.stdout.splitlines() if ln.strip(" │|").startswith(name))
            assert "alive" in line and "│ free" in line, status.stdout


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGKILL], ids=["SIGINT", "SIGKILL"])
def test_head_killed_mid_sweep_then_rerun_runs_only_missing_jobs(cluster: Cluster, sig: signal.Signals) -> None:
    name = f"resume-{sig.name.lower()}"
    sweep = cluster.sweep(name, tokens=[1, 2, 3, 4, 5, 6], n=64, reps=3)
    results = cluster.root / f"results-{name}"
    argv = [ORCHESTRATE, "run", "--inventory", str(cluster.inventory), "--sweep", str(sweep), "-r", str(results)]
    log = cluster.root / f"{name}.log"
    with log.open("w") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=cluster.env)
    try:
        wait_for(lambda: any(results.rglob("part-*.parquet")) or proc.poll() is not None, 240, "a stored fragment")
        assert proc.poll() is None, log.read_text()  # still running: the head is stopped mid-sweep
        proc.send_signal(sig)
        code = proc.wait(30)
        assert code == (130 if sig == signal.SIGINT else -signal.SIGKILL), log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
    first = {f.job_key for f in ResultStore(results).fragments() if f.job_status == "ok"}
    assert 1 <= len(first) < 12
    rerun = cluster.orchestrate(*argv[1:])
    versions = set(read_rows(ResultStore(results), sweep=name).column("code_version").to_pylist())
    if len(versions) > 1:  # the job key includes the code version: another commit or edit landed
        pytest.skip(f"the checkout changed between the two runs ({', '.join(sorted(versions))})")
    assert rerun.returncode == 0, rerun.stdout + rerun.stderr
    frags = ResultStore(results).fragments()
    keys = [f.job_key for f in frags if f.job_status == "ok"]
    assert len(set(keys)) == 12
    assert f"{12 - len(first)} jobs ran" in rerun.stdout and f"{len(first)} already complete" in rerun.stdout
    assert sorted(keys) == sorted(set(keys))  # no job was run (and stored) twice


# ------------------------------------------------------- hosts that cannot join: nothing starts


def silent_listener(address: str) -> tuple[socket.socket, threading.Event]:
    """A TCP port that accepts and never answers (a hung host)."""
    sock = socket.socket()
    sock.bind((address, 0))
    sock.listen(8)
    sock.settimeout(0.2)
    stop = threading.Event()
    held: list[socket.socket] = []

    def loop() -> None:
        while not stop.is_set():
            try:
                held.append(sock.accept()[0])
            except OSError:
                continue
        for s in held:
            s.close()
        sock.close()

    threading.Thread(target=loop, daemon=True).start()
    return sock, stop


def failing_up(lab: tuple[Path, SshLab], tmp: str, **over: object) -> tuple[subprocess.CompletedProcess[str], float]:
    root, sshd = lab
    work = root / tmp
    work.mkdir()
    inv = work / "inv.toml"
    inv.write_text(inventory_toml(work, sshd, free_port("127.0.0.1"), {"x1": {"sshd": 0, "device": "alpha", **over}}))
    env = child_env(HOME=str(work), RAY_AUTH_TOKEN_PATH=str(work / "token"))
    t0 = time.monotonic()
    proc = subprocess.run(
        [ORCHESTRATE, "cluster", "up", "--inventory", str(inv)], capture_output=True, text=True, env=env, timeout=120
    )
    elapsed = time.monotonic() - t0
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert "nothing started" in proc.stdout
    assert not (work / "head").exists() and not (work / "x1").exists()  # no head, no node, no token copied
    return proc, elapsed


def test_version_mismatch_is_reported_before_anything_starts(lab: tuple[Path, SshLab]) -> None:
    system = shutil.which("python3", path="/usr/bin")
    if system is None:
        pytest.skip("no /usr/bin/python3 to stand for a host with other versions")
    theirs = subprocess.run([system, "-c", "import platform; print(platform.python_version())"],
                            capture_output=True, text=True, check=True).stdout.strip()  # fmt: skip
    proc, _ = failing_up(lab, "mismatch", python=system)
    assert "1 of 1 hosts cannot join the cluster: x1:" in proc.stderr
    assert "Ray not installed (head has 2.60.0)" in proc.stderr
    ours = subprocess.run([str(BIN / "python"), "-c", "import platform; print(platform.python_version())"],
                          capture_output=True, text=True, check=True).stdout.strip()  # fmt: skip
    if theirs != ours:
        assert f"Python {theirs} != head {ours}" in proc.stderr
    assert theirs in proc.stdout  # the table shows the host's own version


def test_unknown_host_key_is_refused(lab: tuple[Path, SshLab]) -> None:
    root, _ = lab
    empty = root / "empty_known_hosts"
    empty.write_text("")
    proc, _ = failing_up(lab, "unknown-key", known_hosts=str(empty))
    assert "x1: host 'x1' (127.0.0.2:" in proc.stderr and "unknown host key ssh-ed25519 SHA256:" in proc.stderr


def test_wrong_user_key_is_refused(lab: tuple[Path, SshLab]) -> None:
    root, _ = lab
    stranger = root / "stranger_key"
    make_key(stranger)
    proc, _ = failing_up(lab, "wrong-key", identity_file=str(stranger))
    assert f"authentication as user {lab[1].hosts[0].user} with key file {stranger} was refused" in proc.stderr


def test_unreachable_host_is_reported_within_the_connect_timeout(lab: tuple[Path, SshLab]) -> None:
    sock, stop = silent_listener("127.0.0.5")
    try:
        proc, elapsed = failing_up(lab, "unreachable", host="127.0.0.5", port=sock.getsockname()[1], connect_timeout=2)
    finally:
        stop.set()
    assert "host 'x1' (127.0.0.5:" in proc.stderr and "within the connect timeout (2 s)" in proc.stderr
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1  # one line, no noise
    assert elapsed < 2 + 8  # the timeout plus the CLI's own start-up


def test_sweep_whose_kind_has_no_live_node_is_refused_before_anything_runs(cluster: Cluster) -> None:
    # The same cluster, plus a host of kind `gamma` in the inventory whose node was never started.
    inv = cluster.root / "with-gamma.toml"
    inv.write_text(
        cluster.inventory.read_text()
        + f'[[hosts]]\nname = "g1"\nhost = "127.0.0.2"\nport = {cluster.lab.hosts[0].port}\ndevice = "gamma"\n'
    )
    sweep = cluster.root / "gamma.toml"
    sweep.write_text(
        'name = "gamma"\ndevices = ["gamma"]\n[[cases]]\ncase = "qmm"\narms = ["native"]\n'
        'params = { tokens = 1, n = 64, k = 64, dtype = "float32" }\n'
    )
    results = cluster.root / "results-gamma"
    run = cluster.orchestrate("run", "--inventory", str(inv), "--sweep", str(sweep), "-r", str(results), timeout=120)
    assert run.returncode == 3, run.stdout + run.stderr
    assert "no live Ray node of device kind 'gamma'" in run.stderr
    assert not list(results.rglob("*.parquet"))  # nothing ran


def test_install_puts_the_worker_packages_on_a_bare_host_then_it_runs_jobs(lab: tuple[Path, SshLab]) -> None:
    root, sshd = lab
    work = root / "install"
    work.mkdir()
    # A bare venv with the head's Python. It borrows the shared venv's third-party packages (Ray,
    # MLX, ...) through a .pth so that nothing is downloaded; orchestrate itself is not there.
    bare = work / "venv"
    subprocess.run([str(BIN / "python"), "-m", "venv", str(bare)], check=True)
    purelib = subprocess.run(
        [str(bare / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    shared = subprocess.run(
        [str(BIN / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    Path(purelib, "shared-venv.pth").write_text(shared + "\n")
    inv = work / "inv.toml"
    inv.write_text(
        inventory_toml(
            work, sshd, free_port("127.0.0.1"), {"x1": {"sshd": 0, "device": "alpha", "python": bare / "bin/python"}}
        )
    )
    env = child_env(HOME=str(work), RAY_AUTH_TOKEN_PATH=str(work / "token"))
    for key in ("ORCHESTRATE_SPOOL", "ORCHESTRATE_LOCK_PATH", "RAY_AUTH_MODE"):
        env.pop(key, None)

    def orchestrate(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([ORCHESTRATE, *args], capture_output=True, text=True, env=env, timeout=600, cwd=work)

    plain = orchestrate("cluster", "up", "--inventory", str(inv))
    assert plain.returncode == 3 and "`cluster up --install` installs them" in plain.stderr, plain.stderr
    try:
        up = orchestrate("cluster", "up", "--inventory", str(inv), "--install")
        assert up.returncode == 0, up.stdout + up.stderr
        assert "x1: installed" in up.stdout and "x1: started" in up.stdout
        assert (Path(purelib) / "workers" / "job" / "task.py").exists()  # a real install, not the checkout
        sweep = work / "tiny.toml"
        sweep.write_text(SWEEP.format(name="installed", tokens=[1], n=64, reps=2))
        run = orchestrate("run", "--inventory", str(inv), "--sweep", str(sweep), "-r", str(work / "results"))
        assert run.returncode == 0, run.stdout + run.stderr
        table = read_rows(ResultStore(work / "results"), sweep="installed")
        assert set(table.column("host").to_pylist()) == {"x1"} and set(table.column("status").to_pylist()) == {"ok"}
    finally:
        down = orchestrate("cluster", "down", "--inventory", str(inv))
        assert down.returncode == 0, down.stdout + down.stderr


# ------------------------------------------------ `cluster up` reports what really happened


def _up(work: Path, env: dict[str, str], inv: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [ORCHESTRATE, "cluster", *extra, "--inventory", str(inv)], capture_output=True, text=True, env=env, timeout=300
    )


def _stop_everything(work: Path, env: dict[str, str], inv: Path, pidfiles: list[Path]) -> None:
    down = _up(work, env, inv, "down")
    for pidfile in pidfiles:  # a safety net: nothing this test started may outlive it
        if pidfile.exists():
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.killpg(int(pidfile.read_text()), signal.SIGKILL)
    assert down.returncode == 0, down.stdout + down.stderr


def test_a_host_sharing_another_hosts_ray_dir_is_reported_not_joined(lab: tuple[Path, SshLab]) -> None:
    root, sshd = lab
    work = root / "shared"
    work.mkdir()
    (work / "x2").mkdir()  # x2's HOME; its workdir is x1's
    port = free_port("127.0.0.1")
    shared = str(work / "x1")
    one = work / "one.toml"
    one.write_text(inventory_toml(work, sshd, port, {"x1": {"sshd": 0, "device": "alpha"}}))
    both = work / "both.toml"
    both.write_text(
        inventory_toml(work, sshd, port, {"x1": {"sshd": 0, "device": "alpha"}, "x2": {"sshd": 1, "device": "alpha",
                                                                                      "workdir": shared}})
    )  # fmt: skip
    env = child_env(HOME=str(work), RAY_AUTH_TOKEN_PATH=str(work / "token"))
    try:
        first = _up(work, env, one, "up")
        assert first.returncode == 0 and "x1: started" in first.stdout, first.stdout + first.stderr
        t0 = time.monotonic()
        second = _up(work, env, both, "up", "--join-timeout", "10")
        # x2 finds a live node process behind the pid file in its (shared) dir: x1's. Its log says
        # "Ray runtime started." too. Only the head's node table says that x2 never joined.
        assert second.returncode == 3, second.stdout + second.stderr
        assert "x1: running" in second.stdout and "x2: not joined" in second.stdout, second.stdout
        err = second.stderr.strip().splitlines()
        assert len(err) == 1 and "Traceback" not in second.stderr, second.stderr
        assert err[0].startswith(f"orchestrate: error: 1 of 2 nodes did not join the head at 127.0.0.1:{port}: x2: ")
        assert f"not registered with the head within 10 s; last lines of {shared}/ray-node.log: " in err[0]
        log = re.sub(r"\x1b\[[0-9;]*[A-Za-z]", "", (work / "x1" / "ray-node.log").read_text())
        assert "Ray runtime started." in log  # the log says "started": only registration with the head counts
        assert [ln.strip() for ln in log.splitlines() if ln.strip()][-1] in err[0]  # its last lines, plain
        assert time.monotonic() - t0 < 10 + 60  # the join timeout, plus SSH, probes and Ray's driver start
        status = _up(work, env, both, "status")
        line = next(ln for ln in status.stdout.splitlines() if ln.strip(" │|").startswith("x2"))
        assert "not joined" in line, status.stdout
    finally:
        _stop_everything(work, env, both, [work / "x1" / "ray-node.pid", work / "head" / "head.pid"])


def test_a_node_whose_ray_start_exits_is_reported_at_once_with_its_log(lab: tuple[Path, SshLab]) -> None:
    root, sshd = lab
    work = root / "exits"
    work.mkdir()
    # A host whose Python answers the version probe but whose `ray start` exits at once (as a
    # broken Ray install or a refused option would): a wrapper around the real interpreter.
    wrapper = work / "python"
    wrapper.write_text(
        '#!/bin/sh\ncase "$*" in *ray.scripts.scripts\\ start*)\n'
        '  echo "ray start: cannot bind the node manager port" >&2; echo "node exiting" >&2; exit 1;;\nesac\n'
        f'exec {BIN / "python"} "$@"\n'
    )
    wrapper.chmod(0o755)
    inv = work / "inv.toml"
    inv.write_text(
        inventory_toml(work, sshd, free_port("127.0.0.1"), {"x1": {"sshd": 0, "device": "alpha", "python": wrapper}})
    )
    env = child_env(HOME=str(work), RAY_AUTH_TOKEN_PATH=str(work / "token"))
    try:
        t0 = time.monotonic()
        up = _up(work, env, inv, "up", "--join-timeout", "120")
        assert up.returncode == 3, up.stdout + up.stderr
        assert "x1: failed" in up.stdout
        assert (
            f"x1: failed: ray start exited; last lines of {work / 'x1'}/ray-node.log: "
            "ray start: cannot bind the node manager port | node exiting"
        ) in up.stderr, up.stderr
        assert time.monotonic() - t0 < 90  # found when the process exits, not at the 120 s join timeout
    finally:
        _stop_everything(work, env, inv, [work / "x1" / "ray-node.pid", work / "head" / "head.pid"])
