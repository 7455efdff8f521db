"""Contention a user can act on: a real foreign busy process caught by the CPU-quiet gate is named
(pid, command, share of a core) on the job's line and in its rows with the knob that governs the
gate; a host's `ignore_processes` naming it lets the job measure clean and is recorded in the rows."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pyarrow.compute as pc
import pytest

from orchestrator.store.dataset import read_rows
from orchestrator.store.fragments import ResultStore
from tests.conftest import EXIT_CONTENDED, child_env, until_clean

SWEEP = """name = "spin"
devices = ["cpu"]
repetitions = 5
warmup = 1

[[cases]]
case = "qmm"
arms = ["native", "affine"]
params = { tokens = 1, n = 256, k = 512, dtype = "float32" }
"""


def inventory(path: Path, extra: str) -> Path:
    path.write_text(f'[[hosts]]\nname = "local"\ndevice = "cpu"\nbackend = "cpu"\nmax_attempts = 1\n{extra}\n')
    return path


@pytest.fixture
def spinner(tmp_path: Path) -> Iterator[tuple[int, str]]:
    """A busy process the test starts outside the job's tree, under a name of its own."""
    program = tmp_path / "busyspin"
    program.symlink_to(sys.executable)
    out = subprocess.run(
        ["setsid", "sh", "-c", f"{program} -c 'while True: pass' </dev/null >/dev/null 2>&1 & echo $!"],
        capture_output=True,
        text=True,
        check=True,
        timeout=10,
    ).stdout
    pid = int(out.strip())
    yield pid, "busyspin -c while True: pass"
    os.kill(pid, signal.SIGKILL)


def run(bin_: str, sweep: Path, inv: Path, results: Path) -> subprocess.CompletedProcess[str]:
    args = [bin_, "run", "--sweep", str(sweep), "--inventory", str(inv), "-r", str(results)]
    return subprocess.run(args, capture_output=True, text=True, env=child_env(COLUMNS="400"), timeout=600)


def test_a_contended_job_names_the_foreign_process_and_the_knob(
    tmp_path: Path, orchestrate_bin: str, spinner: tuple[int, str]
) -> None:
    pid, command = spinner
    sweep = tmp_path / "spin.toml"
    sweep.write_text(SWEEP)
    caught = run(orchestrate_bin, sweep, inventory(tmp_path / "busy.toml", "cpu_busy_threshold = 20"), tmp_path / "a")
    assert caught.returncode == EXIT_CONTENDED, caught.stdout + caught.stderr
    line = next(x for x in caught.stdout.splitlines() if ": contended " in x)
    assert f"pid {pid} ({command}, " in line and "% of a core)" in line
    assert "gate cpu-quiet: a foreign process above cpu_busy_threshold = 20 (% of one core)" in line
    assert 'ignore_processes = ["NAME"]' in line
    rows = read_rows(ResultStore(tmp_path / "a"), sweep="spin")
    extras = [dict(e) for e in rows["extra"].to_pylist()]
    assert all(f"pid {pid} ({command}, " in e["foreign_processes"] for e in extras)
    assert all("cpu_busy_threshold = 20" in e["contention_gate"] for e in extras)
    assert all(pid in pids for pids in rows["foreign_pids"].to_pylist())

    # The same spinner, named in the host's ignore_processes: never foreign, and the rows say so.
    quiet = inventory(tmp_path / "quiet.toml", 'ignore_processes = ["busyspin"]')
    clean, _ = until_clean(lambda: run(orchestrate_bin, sweep, quiet, tmp_path / "b"))
    assert clean.returncode == 0, clean.stdout + clean.stderr
    # a contended attempt that `until_clean` ran again keeps its rows: the clean run is the newest
    rows = read_rows(ResultStore(tmp_path / "b"), sweep="spin", newest=True)
    assert not pc.any(rows["contended"]).as_py()
    assert {dict(e).get("ignored_processes") for e in rows["extra"].to_pylist()} == {"busyspin"}
    assert all(pid not in (pids or []) for pids in rows["foreign_pids"].to_pylist())
