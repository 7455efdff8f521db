"""`orchestrate bisect` end to end: a planted regression traced to its commit on a two-kind cluster.

Two real sshd hosts on loopback addresses, `a1` of kind `alpha` and `b1` of kind `beta`, each a Ray
node started by `orchestrate cluster up`. The engine (`tests/engine_repo.py`, a real Cargo
workspace) has 16 commits: decode 5 % slower from `c10` on, `c7` does not compile, and every speed
it reports carries noise with a 2 % standard deviation. The bisection runs on `beta` alone, builds
and measures each tested commit against GOOD in one lock window there, skips `c7` and names `c10`
in at most log2(16) + 2 measured commits; a range before the regression has none. A kernel case
is bisected over commits of this project (a clone of this checkout with a slower `qmm` planted),
each sample that commit's own worker on the kernel job.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from orchestrator.store.dataset import read_rows
from orchestrator.store.fragments import ResultStore
from tests.conftest import BIN, child_env
from tests.e2e.test_cluster import inventory_toml
from tests.engine_repo import CARGO, EngineRepo, Knobs, cargo_env, git, make_checkpoint
from tests.sshd_hosts import SshLab, free_port, require_sshd, start_lab

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(CARGO is None, reason="cargo is not installed: the engine repository is a Cargo workspace"),
]

HOSTS = {"a1": ("127.0.0.2", "alpha"), "b1": ("127.0.0.3", "beta")}
ORCHESTRATE = str(BIN / "orchestrate")
ROOT = Path(__file__).resolve().parents[2]  # this project: the repository its kernel cases measure
PLANTED, BROKEN = 10, 7
SWEEP = """name = "decode-nightly"
devices = ["alpha", "beta"]
repetitions = 16
warmup = 1

[[cases]]
case = "command"
name = "bench-decode"
repo = "{repo}"
ref = "main"
build = "cargo build --release --bin mlxcel-bench-decode"
run = "./target/release/mlxcel-bench-decode -m {{checkpoint}} -p 'Hello' --prompt-tokens {{prompt_tokens}} -n 32"
parse = "bench-decode"
params = {{ checkpoint = "{checkpoint}", prompt_tokens = [512, 2048] }}
arms = {{ native = {{}}, affine = {{ env = {{ MLXCEL_NVFP4_DENSE_REPACK = "1" }} }} }}
"""


def bisect_inventory(root: Path, lab: SshLab, port: int) -> str:
    """The two-kind inventory; each host builds with cargo's toolchain and runs this checkout's workers."""
    cargo = cargo_env()
    env = {key: cargo[key] for key in ("RUSTUP_HOME", "CARGO_HOME", "PATH")} | {"PYTHONPATH": str(ROOT)}
    hosts = {name: {"sshd": i, "device": kind, "env": env} for i, (name, (_, kind)) in enumerate(HOSTS.items())}
    return inventory_toml(root, lab, port, hosts)


@dataclass
class Lab:
    root: Path
    inventory: Path
    sweep: Path
    results: Path
    env: dict[str, str]
    commits: list[str]

    def orchestrate(self, *args: str, timeout: float = 900) -> subprocess.CompletedProcess[str]:
        env = {**self.env, "COLUMNS": "250"}
        return subprocess.run(
            [ORCHESTRATE, *args], capture_output=True, text=True, env=env, timeout=timeout, cwd=self.root
        )

    def bisect_args(self, good: str, bad: str) -> list[str]:
        return [
            ORCHESTRATE, "bisect", "--sweep", str(self.sweep), "--good", good, "--bad", bad, "--point",
            "prompt_tokens=512", "--arm", "native", "--metric", "decode_tok_s", "--device", "beta", "--inventory",
            str(self.inventory), "--results", str(self.results),
        ]  # fmt: skip

    def bisect(self, good: str, bad: str) -> tuple[subprocess.CompletedProcess[str], float]:
        t0 = time.perf_counter()
        out = self.orchestrate(*self.bisect_args(good, bad)[1:])
        return out, time.perf_counter() - t0

    def interrupted_bisect(self, good: str, bad: str, steps: int) -> tuple[int, str]:
        """Ctrl-C once the bisection starts measuring its `steps + 1`-th commit: (exit code, stdout)."""
        env = {**self.env, "COLUMNS": "250"}
        proc = subprocess.Popen(self.bisect_args(good, bad), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, env=env, cwd=self.root)  # fmt: skip
        assert proc.stdout is not None
        seen = []
        for line in proc.stdout:
            seen.append(line)
            if len({ln.split()[1] for ln in seen if ln.startswith("measuring ")}) > steps:  # distinct commits
                proc.send_signal(signal.SIGINT)
                break
        rest, _ = proc.communicate(timeout=300)
        return proc.returncode, "".join(seen) + rest


@pytest.fixture(scope="module")
def lab() -> Iterator[Lab]:
    require_sshd()
    root = Path(tempfile.mkdtemp(prefix="ob-", dir="/tmp"))  # short: Ray's socket paths stay under 107 bytes
    sshd = start_lab(root / "ssh", [address for address, _ in HOSTS.values()])
    repo = EngineRepo(root / "mlxcel")
    noise = 0.02 * math.sqrt(3)  # uniform within ±3.46 %: a standard deviation of 2 %
    commits = [
        repo.commit(f"c{i}", Knobs(decode=13.1 * (0.95 if i >= PLANTED else 1.0), builds=i != BROKEN, noise=noise))
        for i in range(16)
    ]
    checkpoint = make_checkpoint(root / "models" / "nemotron-nvfp4")
    sweep = root / "decode-nightly.toml"
    sweep.write_text(SWEEP.format(repo=repo.path, checkpoint=checkpoint))
    inventory = root / "lab.toml"
    inventory.write_text(bisect_inventory(root, sshd, free_port("127.0.0.1")))
    home = root / "home"
    home.mkdir()
    env = child_env(HOME=str(home), RAY_AUTH_TOKEN_PATH=str(home / ".ray" / "auth_token"), **cargo_env())
    for key in ("ORCHESTRATE_SPOOL", "RAY_AUTH_MODE", "RAY_ADDRESS"):
        env.pop(key, None)
    lab = Lab(root, inventory, sweep, root / "results", env, commits)
    try:
        up = lab.orchestrate("cluster", "up", "--inventory", str(inventory))
        assert up.returncode == 0, up.stdout + up.stderr
        yield lab
    finally:
        lab.orchestrate("cluster", "down", "--inventory", str(inventory))
        for pidfile in [root / name / "ray-node.pid" for name in HOSTS] + [root / "head" / "head.pid"]:
            if pidfile.exists():  # nothing this module started may outlive it
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.killpg(int(pidfile.read_text()), signal.SIGKILL)
        sshd.stop()
        shutil.rmtree(root, ignore_errors=True)


def evidence_rows(stdout: str) -> dict[str, str]:
    """The evidence table's lines by the commit (12 characters) they start with."""
    return {m.group(1): line for line in stdout.splitlines() if (m := re.match(r"\s*([0-9a-f]{12})\s", line))}


def test_bisect_names_the_planted_commit_on_the_named_kind_and_skips_one_that_does_not_build(lab: Lab) -> None:
    c = lab.commits
    # stopped by Ctrl-C while it measures its third commit (BAD settled, c7 skipped), then resumed
    code, stopped = lab.interrupted_bisect(c[0], c[15], steps=2)
    assert code == 130 and "run the same command to resume" in stopped, stopped
    out, seconds = lab.bisect(c[0], c[15])
    assert out.returncode == 0, out.stdout + out.stderr
    assert "resuming bisection" in out.stdout and "2 commits settled" in out.stdout, out.stdout
    assert f"first bad commit: {c[PLANTED]} c{PLANTED} (t <t@e>, " in out.stdout, out.stdout
    table = evidence_rows(out.stdout)
    measured = [commit for commit, line in table.items() if " skipped" not in line]
    assert len(measured) <= math.log2(16) + 2, out.stdout
    assert c[PLANTED][:12] in measured and c[15][:12] in measured, out.stdout
    assert " bad " in table[c[PLANTED][:12]] and " bad " in table[c[15][:12]], out.stdout
    for i in range(PLANTED):  # every commit before the regression that was measured is good
        if c[i][:12] in measured:
            assert " good " in table[c[i][:12]], table[c[i][:12]]
    assert "skipped (build exited with 101" in table[c[BROKEN][:12]], out.stdout
    ratio = re.search(r"\s(0\.\d{3}) \[(0\.\d{3}), (0\.\d{3})\]", table[c[PLANTED][:12]])
    # about 0.95, the whole interval below 1 (how far below is the band's business: it is bad)
    assert ratio is not None and 0.92 < float(ratio.group(1)) < 0.98 and float(ratio.group(3)) < 1, out.stdout
    rerun = next(line for line in out.stdout.splitlines() if line.startswith("rerun: orchestrate bisect"))
    assert f"--good {c[0]} --bad {c[15]}" in rerun and "--device beta" in rerun
    name = re.search(r"orchestrate compare --sweep (\S+) --by commit --all-runs", out.stdout)
    assert name is not None
    print(f"bisect, resumed: {len(measured)} commits measured, {len(table) - len(measured)} skipped, {seconds:.1f} s")

    # every step's rows are one bisection's, measured on the beta host alone, GOOD beside each commit
    rows = read_rows(ResultStore(lab.results), sweep=name.group(1)).to_pylist()
    assert {(r["device"], r["host"]) for r in rows} == {("beta", "b1")}
    timed = [r for r in rows if r["metric"] == "decode_tok_s"]
    assert {r["commit"][:12] for r in timed} == set(measured) | {c[0][:12]}
    assert {r["prompt_tokens"] for r in timed} == {512} and {r["arm"] for r in timed} == {"native"}
    compare = ["compare", "--sweep", name.group(1), "--by", "commit", "--all-runs", "-m", "decode_tok_s", "-f", "json"]
    records = json.loads(lab.orchestrate(*compare, "--results", str(lab.results)).stdout)
    ratios = {r["side"].split("@")[-1]: r["ratio"] for r in records if r["side"] != r["baseline"]}
    assert set(ratios) == set(measured)  # each tested commit against GOOD, as the table showed it
    assert 0.92 < ratios[c[PLANTED][:12]] < 0.98 and 0.92 < ratios[c[15][:12]] < 0.98

    # run again, the same command: the settled bisection is read back, nothing is measured again
    again, _ = lab.bisect(c[0], c[15])
    assert again.returncode == 0, again.stdout + again.stderr
    assert "resuming bisection" in again.stdout and f"first bad commit: {c[PLANTED]}" in again.stdout
    assert len(read_rows(ResultStore(lab.results), sweep=name.group(1))) == len(rows)


def test_bisect_says_no_regression_where_the_range_has_none(lab: Lab) -> None:
    c = lab.commits
    out, _ = lab.bisect(c[0], c[6])
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"no regression between GOOD {c[0][:12]} and BAD {c[6][:12]}" in out.stdout
    assert list(evidence_rows(out.stdout)) == [c[6][:12]]  # BAD alone was measured


KERNEL_SWEEP = """name = "kernel-nightly"
devices = ["alpha", "beta"]
repetitions = 3
warmup = 1

[[cases]]
case = "qmm"
arms = ["native", "affine"]
params = { tokens = 1, n = 256, k = 512, dtype = "float32" }
"""
NATIVE = 'return lambda x: mx.quantized_matmul(x, wq, scales, transpose=True, mode="nvfp4")'


def test_bisect_a_kernel_case_over_this_projects_commits(lab: Lab) -> None:
    project = lab.root / "project"
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True, check=True)
    subprocess.run(["git", "clone", "-q", "--no-checkout", str(ROOT), str(project)], check=True)
    good = head.stdout.strip()
    git(project, "checkout", "-q", "-b", "nightly", good)
    qmm = project / "kernels" / "qmm.py"
    assert NATIVE in qmm.read_text()
    # the same product four times over: the same output, four times the work
    qmm.write_text(qmm.read_text().replace(NATIVE, NATIVE.replace("return lambda x: ", "return lambda x: sum(")
                                           + " for _ in range(4)) / 4"))  # fmt: skip
    git(project, "commit", "-q", "-am", "qmm: native four times")
    planted = git(project, "rev-parse", "HEAD")
    (project / "NOTES").write_text("a note\n")
    git(project, "add", "NOTES")
    git(project, "commit", "-q", "-m", "notes")
    bad = git(project, "rev-parse", "HEAD")
    sweep = lab.root / "kernel-nightly.toml"
    sweep.write_text(KERNEL_SWEEP)
    out = lab.orchestrate(
        "bisect", "--sweep", str(sweep), "--good", good, "--bad", bad, "--arm", "native", "--metric", "seconds",
        "--device", "beta", "--repo", str(project), "--inventory", str(lab.inventory), "--results", str(lab.results),
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"first bad commit: {planted} qmm: native four times (t <t@e>, " in out.stdout
    table = evidence_rows(out.stdout)
    assert set(table) == {planted[:12], bad[:12]}  # BAD, then the midpoint: the planted commit
    ratio = re.search(r"\s(\d\.\d{3}) \[", table[planted[:12]])
    assert ratio is not None and 2.5 < float(ratio.group(1)) < 6  # seconds: about 4x
    name = re.search(r"orchestrate compare --sweep (\S+) --by commit --all-runs", out.stdout)
    assert name is not None
    rows = read_rows(ResultStore(lab.results), sweep=name.group(1)).to_pylist()
    assert {(r["device"], r["host"]) for r in rows} == {("beta", "b1")}
    timed = {r["commit"] for r in rows if r["metric"] == "seconds" and r["status"] == "ok"}
    assert timed == {good, planted, bad}
