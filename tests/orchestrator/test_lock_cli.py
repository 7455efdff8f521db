"""`orchestrate lock status|hold` through the real console script, with real processes and signals."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from workers.lock.file import holder_path, lock_status
from workers.lock.gpu import GUARD_ENV
from workers.proc.table import pid_alive


@pytest.fixture
def lock(tmp_path: Path) -> str:
    return str(tmp_path / "gpu.lock")


@pytest.fixture
def env() -> dict[str, str]:
    clean = dict(os.environ)
    clean.pop(GUARD_ENV, None)  # a suite run under a hold must still exercise the lock
    clean.pop("ORCHESTRATE_LOCK_PATH", None)
    clean.pop("ROCM_GPU_GUARD_LOCK", None)
    return clean


def run(bin_: str, *args: str, env: dict[str, str], **kw: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run([bin_, *args], capture_output=True, text=True, env=env, timeout=60, **kw)  # type: ignore[call-overload, no-any-return]


def start_hold(bin_: str, lock: str, *cmd: str, env: dict[str, str]) -> subprocess.Popen[str]:
    """`orchestrate lock hold` in the background, returned once it holds the lock."""
    proc = subprocess.Popen(
        [bin_, "lock", "hold", "--lock", lock, "--", *cmd], env=env, stderr=subprocess.PIPE, text=True
    )
    deadline = time.monotonic() + 30
    while not (lock_status(lock).busy and os.path.exists(holder_path(lock))):
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "lock hold never took the lock"
        time.sleep(0.05)
    return proc


def wait_lines(path: Path, n: int) -> None:
    """Wait until the command has written its `n` pids into `path`."""
    deadline = time.monotonic() + 10
    while not (path.exists() and len(path.read_text().split()) == n):
        assert time.monotonic() < deadline, f"{path} never got {n} lines"
        time.sleep(0.05)


def wait_gone(pid: int) -> bool:
    deadline = time.monotonic() + 5
    while os.path.exists(f"/proc/{pid}"):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_status_free_held_stale(orchestrate_bin: str, lock: str, env: dict[str, str]) -> None:
    free = run(orchestrate_bin, "lock", "status", "--lock", lock, env=env)
    assert (free.returncode, free.stdout.strip()) == (0, f"free: {lock}")
    holder = start_hold(orchestrate_bin, lock, "sleep", "30", env=env)
    try:
        held = run(orchestrate_bin, "lock", "status", "--lock", lock, env=env)
        assert held.returncode == 1
        assert held.stdout.startswith(f"held: {lock}; held by pid={holder.pid} mode=hold since=20")
        assert held.stdout.rstrip().endswith("cmd=sleep 30")
    finally:
        holder.kill()  # SIGKILL: no cleanup, the holder file stays behind
        holder.wait()
    stale = run(orchestrate_bin, "lock", "status", "--lock", lock, "--json", env=env)
    assert stale.returncode == 0  # the flock went with the process: the lock is free to take
    assert '"state": "stale"' in stale.stdout and f'"pid": {holder.pid}' in stale.stdout


def test_hold_passes_the_exit_code_stdin_and_the_variable(orchestrate_bin: str, lock: str, env: dict[str, str]) -> None:
    hold = subprocess.Popen(
        [orchestrate_bin, "lock", "hold", "--lock", lock, "--", "sh", "-c", f'cat; echo "held=${GUARD_ENV}"; exit 3'],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
    out, err = hold.communicate("piped\n", timeout=60)
    assert hold.returncode == 3, err
    lines = out.splitlines()
    assert lines[0] == "piped"
    assert lines[1] == f"held={hold.pid}"  # the variable names the holder
    assert not lock_status(lock).busy and not os.path.exists(holder_path(lock))
    killed = run(orchestrate_bin, "lock", "hold", "--lock", lock, "--", "sh", "-c", "kill -9 $$", env=env)
    assert killed.returncode == 128 + 9
    missing = run(orchestrate_bin, "lock", "hold", "--lock", lock, "--", "no-such-command-xyz", env=env)
    assert missing.returncode == 127 and "command not found" in missing.stderr


def test_max_wait_timeout_exits_75_without_running(
    orchestrate_bin: str, lock: str, env: dict[str, str], tmp_path: Path
) -> None:
    holder = start_hold(orchestrate_bin, lock, "sleep", "30", env=env)
    marker = tmp_path / "ran"
    try:
        start = time.monotonic()
        done = run(
            orchestrate_bin, "lock", "hold", "--lock", lock, "--max-wait", "0.5", "--", "touch", str(marker), env=env
        )
        assert done.returncode == 75, done.stderr
        assert time.monotonic() - start < 10
        assert "waiting for GPU lock" in done.stderr
        assert f"gave up waiting for GPU lock {lock}" in done.stderr and f"pid={holder.pid}" in done.stderr
        assert not marker.exists()
        assert holder.poll() is None  # the first hold was not disturbed
    finally:
        holder.kill()
        holder.wait()


def test_nested_hold_finishes(orchestrate_bin: str, lock: str, env: dict[str, str]) -> None:
    inner = f"{orchestrate_bin} lock hold --lock {lock} --max-wait 5 -- sh -c 'exit 4'; echo inner=$?"
    start = time.monotonic()
    done = run(orchestrate_bin, "lock", "hold", "--lock", lock, "--max-wait", "5", "--", "sh", "-c", inner, env=env)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "inner=4"
    assert "held by an outer holder" in done.stderr
    assert "waiting for GPU lock" not in done.stderr
    assert time.monotonic() - start < 30
    assert not lock_status(lock).busy


@pytest.mark.parametrize(("signum", "code"), [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_signal_ends_the_command_group_and_frees_the_lock(
    orchestrate_bin: str, lock: str, env: dict[str, str], tmp_path: Path, signum: int, code: int
) -> None:
    pids = tmp_path / "pids"
    marker = tmp_path / "survived"
    # A command with a grandchild of its own: the whole group must go.
    script = f"sleep 30 & echo $! >> {pids}; echo $$ >> {pids}; wait; touch {marker}"
    holder = start_hold(orchestrate_bin, lock, "sh", "-c", script, env=env)
    wait_lines(pids, 2)
    holder.send_signal(signum)
    _, err = holder.communicate(timeout=30)
    assert holder.returncode == code, err
    assert f"caught {signal.Signals(signum).name}" in err
    assert all(wait_gone(int(pid)) for pid in pids.read_text().split())
    assert not marker.exists()
    assert not lock_status(lock).busy


def test_sigterm_while_waiting_exits_143(orchestrate_bin: str, lock: str, env: dict[str, str], tmp_path: Path) -> None:
    holder = start_hold(orchestrate_bin, lock, "sleep", "30", env=env)
    marker = tmp_path / "ran"
    try:
        waiter = subprocess.Popen(
            [orchestrate_bin, "lock", "hold", "--lock", lock, "--", "touch", str(marker)],
            env=env,
            stderr=subprocess.PIPE,
            text=True,
        )
        assert waiter.stderr is not None
        assert "waiting for GPU lock" in waiter.stderr.readline()
        waiter.terminate()
        _, err = waiter.communicate(timeout=30)
        assert waiter.returncode == 143, err
        assert not marker.exists()
    finally:
        holder.kill()
        holder.wait()


def test_bad_lock_path_is_a_usage_error(orchestrate_bin: str, tmp_path: Path, env: dict[str, str]) -> None:
    link = tmp_path / "link.lock"
    link.symlink_to(tmp_path / "elsewhere")
    for verb in (["status"], ["hold", "--max-wait", "1", "--", "true"]):
        done = run(orchestrate_bin, "lock", verb[0], "--lock", str(link), *verb[1:], env=env)
        assert done.returncode == 2, done.stderr
        assert done.stderr.strip() == f"orchestrate: error: lock {link} is a symbolic link; refusing to follow it"
    assert not (tmp_path / "elsewhere").exists()


def test_hold_without_a_command_is_a_usage_error(orchestrate_bin: str, lock: str, env: dict[str, str]) -> None:
    done = run(orchestrate_bin, "lock", "hold", "--lock", lock, env=env)
    assert done.returncode == 2
    assert "Missing argument" in done.stderr and "Traceback" not in done.stderr
    assert not os.path.exists(lock)  # nothing was taken or created


def test_the_shell_guards_lock_variable_picks_the_lock(orchestrate_bin: str, lock: str, env: dict[str, str]) -> None:
    env = {**env, "ROCM_GPU_GUARD_LOCK": lock}
    done = run(orchestrate_bin, "lock", "hold", "--", "cat", holder_path(lock), env=env)
    assert done.returncode == 0, done.stderr
    assert "mode=hold" in done.stdout and f"cmd=cat {holder_path(lock)}" in done.stdout
    done = run(orchestrate_bin, "lock", "status", env={**env, "ORCHESTRATE_LOCK_PATH": lock + ".other"})
    assert done.stdout.strip() == f"free: {lock}.other"  # the node's own setting comes first


def test_a_killed_holder_takes_the_command_tree_with_it_and_the_lock_outlasts_every_process(
    orchestrate_bin: str, lock: str, env: dict[str, str], tmp_path: Path
) -> None:
    pids = tmp_path / "pids"
    # A command whose helper left its session: killing only the holder would free the lock at once
    # while the command ran on, reparented to init.
    script = f"echo $$ >> {pids}; setsid sleep 60 & echo $! >> {pids}; sleep 60"
    holder = start_hold(orchestrate_bin, lock, "sh", "-c", script, env=env)
    wait_lines(pids, 2)
    command = [int(p) for p in pids.read_text().split()]
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    deadline = time.monotonic() + 15
    while any(os.path.exists(f"/proc/{p}") for p in command):
        assert time.monotonic() < deadline, "the command outlived its killed holder"
        if not lock_status(lock).busy:
            assert not any(os.path.exists(f"/proc/{p}") for p in command), "the lock was free while the command ran"
        time.sleep(0.01)
    while lock_status(lock).busy:
        assert time.monotonic() < deadline, "the lock stayed taken after the command was gone"
        time.sleep(0.05)


def test_what_the_command_leaves_running_is_ended_before_the_lock_goes(
    orchestrate_bin: str, lock: str, env: dict[str, str], tmp_path: Path
) -> None:
    pidfile = tmp_path / "daemon.pid"
    script = f"setsid sh -c 'echo $$ > {pidfile}; exec sleep 60' & sleep 0.5; exit 5"
    done = run(orchestrate_bin, "lock", "hold", "--lock", lock, "--", "sh", "-c", script, env=env)
    assert done.returncode == 5, done.stderr
    daemon = int(pidfile.read_text())
    assert f"ended 1 process(es) the command left running (pid {daemon})" in done.stderr
    assert not pid_alive(daemon)
    assert not lock_status(lock).busy
