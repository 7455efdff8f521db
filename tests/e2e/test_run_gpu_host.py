"""`orchestrate run` as a GPU host's user runs it: the head holds no device, contended jobs are
reported and measured again, and a signal stops the run cleanly. All through the real CLI,
embedded Ray, real processes (the CPU-quiet gate stands in for the GPU-user probes here)."""

from __future__ import annotations

import fcntl
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import child_env
from workers.proc.table import is_descendant, pid_alive

pytestmark = pytest.mark.slow

BUSY = "import time\nend = time.monotonic() + 300\nwhile time.monotonic() < end: pass\n"

# Runs the real CLI and records, at exit, which modules the head's process imported.
HEAD = """
import atexit, sys
out = sys.argv.pop(1)
atexit.register(lambda: open(out, "w").write("\\n".join(sorted(sys.modules))))
from orchestrator.cli import main
sys.argv[0] = "orchestrate"
main()
"""


def _files(tmp_path: Path, *, reps: int, tokens: list[int], n: int = 256, threshold: float = 30.0) -> list[str]:
    sweep = tmp_path / "sweep.toml"
    sweep.write_text(
        f'name = "gpuhost"\nrepetitions = {reps}\nwarmup = 1\nbaseline = "native"\n'
        '[[cases]]\ncase = "qmm"\narms = ["native"]\n'
        f'params = {{ tokens = {tokens}, n = {n}, k = {n}, dtype = "float32" }}\n'
    )
    inventory = tmp_path / "local.toml"
    inventory.write_text(
        f'[[hosts]]\nname = "local"\ndevice = "cpu"\nbackend = "cpu"\nlock = "{tmp_path / "gpu.lock"}"\n'
        f"cpu_busy_threshold = {threshold}\nmax_attempts = 2\n"
    )
    return ["--sweep", str(sweep), "--inventory", str(inventory), "--results", str(tmp_path / "results")]


def _env(tmp_path: Path) -> dict[str, str]:
    env = child_env()
    env.pop("ORCHESTRATE_LOCK_PATH", None)  # the inventory's lock, which this test checks
    return env


def test_the_head_never_imports_mlx_and_auto_resolves_elsewhere(tmp_path: Path) -> None:
    modules = tmp_path / "modules.txt"
    sweep = tmp_path / "sweep.toml"
    sweep.write_text(
        'name = "nomlx"\nrepetitions = 2\nwarmup = 0\nbaseline = "native"\n'
        '[[cases]]\ncase = "qmm"\narms = ["native"]\nparams = { tokens = 1, n = 64, k = 64 }\n'
    )
    # the embedded default: device = "auto", resolved through a short-lived `python -m workers device`
    done = subprocess.run(
        [sys.executable, "-c", HEAD, str(modules), "run", "--sweep", str(sweep), "--results", str(tmp_path / "r")],
        env=child_env(), capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode in (0, 5), done.stdout + done.stderr
    assert "1 jobs ran" in done.stdout
    imported = modules.read_text().split()
    assert "orchestrator.cli" in imported and "ray" in imported  # the record is of the head itself
    assert not [m for m in imported if m == "mlx" or m.startswith(("mlx.", "mlx_lm"))]


def test_a_contended_job_is_reported_not_complete_and_measured_again(tmp_path: Path, orchestrate_bin: str) -> None:
    args = _files(tmp_path, reps=10, tokens=[1])
    stranger = subprocess.Popen([sys.executable, "-c", BUSY])  # not ours: started outside the head's tree
    try:
        time.sleep(0.5)
        first = subprocess.run([orchestrate_bin, "run", *args], env=_env(tmp_path), capture_output=True, text=True,
                               timeout=600)  # fmt: skip
    finally:
        stranger.kill()
        stranger.wait()
    assert first.returncode == 5, first.stdout + first.stderr  # contended points left
    line = next(x for x in first.stdout.splitlines() if x.startswith("[1/1] cpu qmm tokens=1 "))
    # the line names the process the gate caught (the stranger) and the knob that governs the gate
    assert re.search(rf": contended 10/10 samples, retried 1x: .*\bpid {stranger.pid}\b.*; gate .* in ", line), line
    assert "(0 failed, 1 contended)" in first.stdout
    assert "not complete: run the same command again" in first.stdout
    again = subprocess.run([orchestrate_bin, "run", *args], env=_env(tmp_path), capture_output=True, text=True,
                           timeout=600)  # fmt: skip
    assert "Nothing to do" not in again.stdout  # no --force needed: the contended job runs again
    assert "1 jobs ran" in again.stdout, again.stdout + again.stderr


def _tree(root: int) -> set[int]:
    return {int(p) for p in os.listdir("/proc") if p.isdigit() and int(p) != root and is_descendant(int(p), root)}


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_stops_the_run_in_one_line_and_a_rerun_resumes(
    tmp_path: Path, orchestrate_bin: str, signum: int
) -> None:
    args = _files(tmp_path, reps=40, tokens=[8, 16, 24, 32, 40, 48], n=512, threshold=1e9)
    proc = subprocess.Popen([orchestrate_bin, "run", *args], env=_env(tmp_path), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)  # fmt: skip
    assert proc.stdout is not None
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if line.startswith("[1/6]"):
            break
    tree = _tree(proc.pid)  # Ray's daemons, its workers, the fork server, the running job
    os.kill(proc.pid, signum)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signum, "".join(lines) + out + err
    assert re.fullmatch(r"interrupted: \d of 6 jobs stored; rerun to resume\n", err), err
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and any(os.path.exists(f"/proc/{p}") for p in tree):
        time.sleep(0.2)
    left = [p for p in tree if pid_alive(p)]
    assert not left, f"processes outlived the run: {left}"
    fd = os.open(tmp_path / "gpu.lock", os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # the GPU lock is free
    finally:
        os.close(fd)
    stored = int(re.match(r"interrupted: (\d)", err).group(1))  # type: ignore[union-attr]
    again = subprocess.run([orchestrate_bin, "run", *args], env=_env(tmp_path), capture_output=True, text=True,
                           timeout=600)  # fmt: skip
    assert again.returncode == 0, again.stdout + again.stderr
    assert f"{6 - stored} jobs ran (0 failed), {stored} already complete" in again.stdout
