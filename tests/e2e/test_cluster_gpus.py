"""A cluster host with several GPUs, end to end: a real sshd host, a real Ray head here and one
real Ray node per GPU on the host, all started by `orchestrate cluster up` and driven by the CLI.

No GPU here: the host's inventory entry names `gpus` and its environment sets the test-only
`ORCHESTRATE_TEST_FAKE_GPUS=2`, so `python -m workers gpus` lists two fake GPUs there
(`fake-gpu-<i>`). The nodes, the jobs, the locks and the Parquet are real.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pyarrow.compute as pc
import pytest

from orchestrator.store.dataset import read_rows
from orchestrator.store.fragments import ResultStore
from tests.conftest import BIN, child_env
from tests.e2e.test_cluster import SWEEP  # the same two-arm qmm sweep
from tests.sshd_hosts import SshLab, free_port, require_sshd, start_lab

pytestmark = pytest.mark.slow

TOKENS = [64, 65, 66, 67]

ORCHESTRATE = str(BIN / "orchestrate")
ADDRESS = "127.0.0.6"


def inventory(root: Path, lab: SshLab, port: int, gpus: str) -> str:
    host = lab.hosts[0]
    return f"""
[head]
address = "127.0.0.1"
ray_port = {port}
workdir = "{root / "head"}"
dashboard = false

[[hosts]]
name = "g1"
host = "{host.address}"
port = {host.port}
node_ip = "{host.address}"
user = "{host.user}"
identity_file = "{lab.client_key}"
known_hosts = "{lab.known_hosts}"
python = "{BIN / "python"}"
device = "gamma"
workdir = "{root / "g1"}"
lock = "{root / "g1" / "gpu.lock"}"
gpus = {gpus}
num_cpus = 1
connect_timeout = 5
cpu_busy_threshold = 1e9   # the CPU-quiet gate is not under test: two jobs share this machine's cores
env = {{ HOME = "{root / "g1"}", ORCHESTRATE_TEST_FAKE_GPUS = "2" }}
"""


class Lab:
    def __init__(self, root: Path, sshd: SshLab) -> None:
        self.root = root
        self.sshd = sshd
        self.port = free_port("127.0.0.1")
        home = root / "home"
        home.mkdir(exist_ok=True)
        self.env = child_env(HOME=str(home), RAY_AUTH_TOKEN_PATH=str(home / ".ray" / "auth_token"))
        for key in ("ORCHESTRATE_SPOOL", "ORCHESTRATE_LOCK_PATH", "RAY_AUTH_MODE", "RAY_ADDRESS"):
            self.env.pop(key, None)

    def inventory(self, gpus: str) -> Path:
        path = self.root / f"inv-{len(list(self.root.glob('inv-*.toml')))}.toml"
        path.write_text(inventory(self.root, self.sshd, self.port, gpus))
        return path

    def orchestrate(self, *args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
        env = {**self.env, "COLUMNS": "250"}  # host tables one line per host: the tests read them by line
        return subprocess.run(
            [ORCHESTRATE, *args], capture_output=True, text=True, env=env, timeout=timeout, cwd=self.root
        )

    def node_pid(self, gpu: int) -> int:
        return int((self.root / "g1" / f"ray-node-gpu{gpu}.pid").read_text())


@pytest.fixture(scope="module")
def lab() -> Iterator[Lab]:
    require_sshd()
    root = Path(tempfile.mkdtemp(prefix="o5-", dir="/tmp"))  # short: Ray's socket paths stay under 107 bytes
    (root / "g1").mkdir()
    sshd = start_lab(root / "ssh", [ADDRESS])
    lab = Lab(root, sshd)
    try:
        yield lab
    finally:
        down = lab.orchestrate("cluster", "down", "--inventory", str(lab.inventory("[0, 1]")))
        for pidfile in [*(root / "g1").glob("ray-node*.pid"), root / "head" / "head.pid"]:
            with contextlib.suppress(ProcessLookupError, ValueError, FileNotFoundError):  # nothing may outlive us
                os.killpg(int(pidfile.read_text()), signal.SIGKILL)
        sshd.stop()
        shutil.rmtree(root, ignore_errors=True)
        assert down.returncode == 0, down.stdout + down.stderr


def _line(out: str, name: str) -> str:
    return next(ln for ln in out.splitlines() if ln.strip(" │|").startswith(name))


def test_a_gpu_the_host_lacks_is_reported_before_any_node_starts(lab: Lab) -> None:
    up = lab.orchestrate("cluster", "up", "--inventory", str(lab.inventory("[0, 5]")))
    assert up.returncode == 3, up.stdout + up.stderr
    assert "g1: gpus = [0, 5]: GPU 5 not found (this host has: 0, 1)" in up.stderr
    assert not list((lab.root / "g1").glob("ray-node*.pid"))


def test_one_node_per_gpu_jobs_spread_a_lost_gpu_node_is_retried_on_the_other(lab: Lab) -> None:
    inv = str(lab.inventory("[0, 1]"))
    up = lab.orchestrate("cluster", "up", "--inventory", inv)
    assert up.returncode == 0, up.stdout + up.stderr
    assert "g1: started (2 GPUs)" in up.stdout
    status = lab.orchestrate("cluster", "status", "--inventory", inv)
    assert "alive 2/2 GPUs" in _line(status.stdout, "g1") and "free" in _line(status.stdout, "g1"), status.stdout

    # A sweep spreads over both GPUs of the host; each row names its GPU.
    (lab.root / "spread.toml").write_text(SWEEP.format(tokens=TOKENS, n=512, name="spread", reps=4))
    results = lab.root / "results-1"
    run = lab.orchestrate("run", "--inventory", inv, "--sweep", str(lab.root / "spread.toml"), "-r", str(results))
    assert run.returncode == 0, run.stdout + run.stderr
    table = read_rows(ResultStore(results), sweep="spread")
    assert set(table.column("status").to_pylist()) == {"ok"} and set(table.column("host").to_pylist()) == {"g1"}
    pairs = set(zip(table.column("gpu_index").to_pylist(), table.column("gpu_uuid").to_pylist(), strict=True))
    assert pairs == {(0, "fake-gpu-0"), (1, "fake-gpu-1")}, pairs

    # GPU 1's whole node is killed while it runs a job: the job is run again, to the end, on GPU 0.
    (lab.root / "loss.toml").write_text(SWEEP.format(tokens=TOKENS, n=512, name="loss", reps=20))
    results = lab.root / "results-2"
    argv = [ORCHESTRATE, "run", "--inventory", inv, "--sweep", str(lab.root / "loss.toml"), "-r", str(results)]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=lab.env)
    try:
        holder = lab.root / "g1" / "gpu.lock.gpu1.holder"
        deadline = time.monotonic() + 300
        while not holder.exists():
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0]
            time.sleep(0.1)
        lost = next(ln for ln in holder.read_text().splitlines() if ln.startswith("cmd=")).rsplit("/", 1)[-1]
        os.killpg(lab.node_pid(1), signal.SIGKILL)
        out, _ = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, out
    store = ResultStore(results)
    table = read_rows(store, sweep="loss")
    assert set(table.column("status").to_pylist()) == {"ok"} and len(store.fragments()) == 4  # nothing lost
    retried = table.filter(pc.equal(table.column("job_key"), lost))
    assert retried.num_rows > 0 and set(retried.column("gpu_index").to_pylist()) == {0}
    again = lab.orchestrate(*argv[1:])
    assert "Nothing to do: all 4 jobs" in again.stdout, again.stdout + again.stderr

    # Ray's GCS declares a killed node dead after its health checks fail (seconds); the sweep can
    # finish, retried on GPU 0, before that: status says so once the GCS has
    deadline = time.monotonic() + 90
    while True:
        status = lab.orchestrate("cluster", "status", "--inventory", inv)
        if "alive 1/2 GPUs (gpu1 dead)" in _line(status.stdout, "g1") or time.monotonic() > deadline:
            break
        time.sleep(2)
    assert "alive 1/2 GPUs (gpu1 dead)" in _line(status.stdout, "g1"), status.stdout
    back = lab.orchestrate("cluster", "up", "--inventory", inv)  # brings the lost GPU's node back
    assert back.returncode == 0 and "g1: gpu0 running, gpu1 started" in back.stdout, back.stdout + back.stderr

    # The inventory names GPU 0 alone now: `up` stops GPU 1's node, and `down` stops the rest.
    gpu1 = lab.node_pid(1)
    one = lab.orchestrate("cluster", "up", "--inventory", str(lab.inventory("[0]")))
    assert one.returncode == 0 and "g1: running (1 GPU)" in one.stdout, one.stdout + one.stderr
    assert not (lab.root / "g1" / "ray-node-gpu1.pid").exists()
    with pytest.raises(ProcessLookupError):
        os.kill(gpu1, 0)
    down = lab.orchestrate("cluster", "down", "--inventory", inv)
    assert down.returncode == 0 and "g1: stopped (1 GPU)" in down.stdout, down.stdout + down.stderr
    assert not list((lab.root / "g1").glob("ray-node*.pid"))
