"""`orchestrate run` on this machine (embedded Ray) under attack and fault: a client without the
token, third-party code looking for the token, markup in data, a ref that moved, two runs into
one results directory, a full results disk."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from orchestrator.store.dataset import read_rows
from orchestrator.store.fragments import ResultStore
from tests.conftest import child_env
from tests.orchestrator.bench_repo import git

pytestmark = pytest.mark.slow

CONNECT = "import ray, sys; ray.init(address=sys.argv[1], logging_level='ERROR'); print('CONNECTED', len(ray.nodes()))"


def test_the_embedded_instance_is_token_authenticated_whatever_ray_auth_mode_says(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import ray

    from orchestrator.run.executor import RayExecutor
    from orchestrator.specs.sweep import load_inventory

    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")  # the user's environment turns Ray's auth off
    token = Path(os.environ["HOME"]) / ".ray" / "auth_token"
    assert not token.exists()
    with RayExecutor(load_inventory(None)):
        gcs = ray.get_runtime_context().gcs_address
        assert token.stat().st_mode & 0o777 == 0o600  # ours, made before Ray could make a 0644 one
        stranger = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
        stranger.update(HOME=str(tmp_path / "stranger"), RAY_AUTH_MODE="disabled")
        refused = subprocess.run([sys.executable, "-c", CONNECT, gcs], capture_output=True, text=True,
                                 env=stranger, timeout=180)  # fmt: skip
        assert refused.returncode != 0 and "CONNECTED" not in refused.stdout, refused.stdout
        holder = {**stranger, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token)}
        admitted = subprocess.run([sys.executable, "-c", CONNECT, gcs], capture_output=True, text=True,
                                  env=holder, timeout=180)  # fmt: skip
        assert "CONNECTED 1" in admitted.stdout, admitted.stderr[-2000:]


# The benchmark: records its environment, prints a result line, and for the `broken` arm fails
# with Rich markup and an emoji code on stderr.
BENCH = """#!/usr/bin/env bash
set -eu
env > "$ENV_DUMP"
if [ -n "${BREAK:-}" ]; then echo "[/] boom [bold]loud[/bold] :thumbs_up:" >&2; exit 3; fi
echo "[engine-bench] {\\"decode_tok_s\\": $(cat speed.txt)}"
"""

SWEEP = """
name = "ext"
repetitions = 2
warmup = 0

[[cases]]
case = "command"
name = "good"
repo = "{repo}"
ref = "main"
run = "./bench.sh"
parse = "engine-bench"
params = {{ tag = ["v[/x]", "plain"] }}
arms = {{ native = {{}} }}

[[cases]]
case = "command"
name = "bad"
repo = "{repo}"
ref = "main"
run = "./bench.sh"
parse = "engine-bench"
params = {{ tag = "v[/x]" }}
arms = {{ broken = {{ env = {{ BREAK = "1" }} }} }}
"""


def make_repo(root: Path, speed: float) -> Path:
    repo = root / "engine"
    repo.mkdir()
    git(repo, "init", "-q", "-b", "main")
    (repo / "bench.sh").write_text(BENCH)
    (repo / "bench.sh").chmod(0o755)
    (repo / "speed.txt").write_text(f"{speed}\n")
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "first")
    return repo


# This machine alone, with the CPU-quiet gate out of the way: the tests here run two embedded Ray
# instances side by side and share the machine with the test runner (the gate is tested elsewhere).
QUIET_LOCAL = '[[hosts]]\nname = "local"\ndevice = "cpu"\nbackend = "cpu"\ncpu_busy_threshold = 1e9\n'


def orchestrate(bin_: str, cwd: Path, *args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    if args[0] == "run":
        (cwd / "quiet-local.toml").write_text(QUIET_LOCAL)
        args = (*args, "--inventory", str(cwd / "quiet-local.toml"))
    return subprocess.run([bin_, *args], cwd=cwd, capture_output=True, text=True, env=env, timeout=600)


def test_a_command_case_sees_no_token_markup_in_data_prints_as_is_and_a_moved_ref_runs_again(
    tmp_path: Path, orchestrate_bin: str
) -> None:
    repo = make_repo(tmp_path, 100.0)
    sweep = tmp_path / "ext.toml"
    sweep.write_text(SWEEP.format(repo=repo))
    dump = tmp_path / "env.txt"
    env = child_env(ENV_DUMP=str(dump))
    results = tmp_path / "results"
    first = orchestrate(orchestrate_bin, tmp_path, "run", "--sweep", str(sweep), "-r", str(results), env=env)
    assert first.returncode == 1, first.stdout + first.stderr  # the broken arm failed; nothing crashed
    assert "Traceback" not in first.stderr and "MarkupError" not in first.stderr
    assert "[/] boom [bold]loud[/bold] :thumbs_up:" in first.stdout  # the error as the benchmark wrote it
    assert "tag=v[/x]" in first.stdout
    seen = dict(line.split("=", 1) for line in dump.read_text().splitlines() if "=" in line)
    token = Path(env["HOME"]) / ".ray" / "auth_token"
    assert token.exists() and not [k for k in seen if k.startswith("RAY_")]  # no token path, no address
    assert str(token) not in dump.read_text() and token.read_text() not in dump.read_text()

    shown = orchestrate(orchestrate_bin, tmp_path, "results", "--sweep", "ext", "-r", str(results), env=env)
    assert shown.returncode == 0, shown.stdout + shown.stderr
    assert "tag=v[/x]" in shown.stdout

    store = ResultStore(results)
    first_commit = git(repo, "rev-parse", "HEAD")
    (repo / "speed.txt").write_text("80.0\n")
    git(repo, "commit", "-qam", "slower")
    second = orchestrate(orchestrate_bin, tmp_path, "run", "--sweep", str(sweep), "-r", str(results), env=env)
    assert second.returncode == 1, second.stdout + second.stderr
    assert "3 jobs ran" in second.stdout, second.stdout  # main moved: the good jobs are measured again
    table = read_rows(store, sweep="ext")
    rows = [r for r in table.to_pylist() if r["case"] == "command" and r["metric"] == "decode_tok_s"]
    by_commit = {(r["commit"], r["value"]) for r in rows}
    assert by_commit == {(first_commit, 100.0), (git(repo, "rev-parse", "HEAD"), 80.0)}


CONCURRENT = """
name = "slow"
repetitions = 1
warmup = 0

[[cases]]
case = "command"
repo = "{repo}"
ref = "main"
run = "sleep 2; ./bench.sh"
parse = "engine-bench"
params = {{ point = [1, 2, 3] }}
arms = {{ native = {{}} }}
"""


def test_two_runs_into_one_results_directory_do_each_job_once(tmp_path: Path, orchestrate_bin: str) -> None:
    repo = make_repo(tmp_path, 1.0)
    sweep = tmp_path / "slow.toml"
    sweep.write_text(CONCURRENT.format(repo=repo))
    results = tmp_path / "results"
    env = child_env(ENV_DUMP=str(tmp_path / "env.txt"))
    (tmp_path / "quiet-local.toml").write_text(QUIET_LOCAL)
    argv = [orchestrate_bin, "run", "--sweep", str(sweep), "-r", str(results)]
    inventory = ["--inventory", str(tmp_path / "quiet-local.toml")]
    first = subprocess.Popen([*argv, *inventory], cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, env=env)  # fmt: skip
    lock = ResultStore(results).side / "locks" / "slow.lock"  # beside the results: they hold only Parquet
    deadline = time.monotonic() + 120
    while not (lock.exists() and subprocess.run(["flock", "-n", str(lock), "true"]).returncode == 1):
        assert first.poll() is None and time.monotonic() < deadline, "the first run never took the store"
        time.sleep(0.1)
    second = orchestrate(orchestrate_bin, tmp_path, *argv[1:], env=env)
    out, err = first.communicate(timeout=600)
    assert first.returncode == 0, out + err
    assert second.returncode == 0, second.stdout + second.stderr
    assert "waiting for orchestrate run pid" in second.stderr and "to finish writing sweep 'slow'" in second.stderr
    assert "Nothing to do: all 3 jobs" in second.stdout  # it resumed after the first: no job twice
    keys = [f.job_key for f in ResultStore(results).fragments()]
    assert len(keys) == 3 == len(set(keys))


def test_a_full_results_disk_is_exit_3_with_the_stored_jobs_kept(tmp_path: Path, orchestrate_bin: str) -> None:
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    disk = tmp_path / "disk"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(disk)]).returncode != 0:
        pytest.skip("cannot mount a tmpfs here")
    try:
        repo = make_repo(tmp_path, 1.0)
        sweep = tmp_path / "slow.toml"
        quick = CONCURRENT.format(repo=repo).replace("sleep 2; ", "")
        sweep.write_text(quick.replace("[1, 2, 3]", "[1, 2, 3, 4, 5, 6]"))
        results = disk / "results"
        results.mkdir()
        filler = disk / "filler"
        run = None
        # Fill the disk but for room for a couple of fragments, then run six jobs into it.
        for room in (60_000, 40_000, 25_000):
            filler.unlink(missing_ok=True)
            free = os.statvfs(disk).f_bavail * os.statvfs(disk).f_frsize
            filler.write_bytes(b"\0" * max(0, free - room))
            run = orchestrate(orchestrate_bin, tmp_path, "run", "--sweep", str(sweep), "-r", str(results),
                              env=child_env(ENV_DUMP=str(tmp_path / "env.txt")))  # fmt: skip
            if run.returncode == 3:
                break
        assert run is not None and run.returncode == 3, run.stdout + run.stderr if run else ""
        assert "Traceback" not in run.stderr and len(run.stderr.strip().splitlines()) == 1, run.stderr
        assert "No space left on device; the jobs stored before are kept" in run.stderr
        store = ResultStore(results)
        kept = store.fragments()
        assert store.broken == [] and len(kept) < 6  # what was stored is whole; the rest is missing
        assert not [p for p in results.rglob("*") if p.name.endswith(".tmp")]  # no half-written file
        assert read_rows(store, sweep="slow").num_rows == sum(f.num_rows for f in kept)
    finally:
        subprocess.run(["umount", str(disk)], check=False)
