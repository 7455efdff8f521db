"""Whole process trees with real processes: timeouts, setsid'd and double-forked descendants,
bounded output, an owner that is SIGKILLed, and the GPU lock held until the tree is gone."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from workers.command.workload import run_tree, workload_env
from workers.lock.file import lock_status
from workers.lock.gpu import GUARD_ENV
from workers.proc.table import (
    cpu_times,
    descendants,
    is_descendant,
    listening_pids,
    parent_pid,
    pid_alive,
    process_cmdline,
    process_entry,
    process_name,
    process_table,
    signal_process,
)
from workers.proc.tree import end_descendants, keeper_supported

linux_only = pytest.mark.skipif(not keeper_supported(), reason="the subreaper keeper needs Linux")


def read_pids(path: Path, n: int, timeout: float = 10) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists():
            pids = [int(p) for p in path.read_text().split()]
            if len(pids) >= n:
                return pids
        time.sleep(0.02)
    raise AssertionError(f"{path} never listed {n} pids")


def gone(pids: list[int], timeout: float = 5) -> bool:
    deadline = time.monotonic() + timeout
    while any(pid_alive(p) for p in pids):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def test_timeout_kills_a_setsid_descendant_that_keeps_stdout_open(tmp_path: Path) -> None:
    pids = tmp_path / "pids"
    # The descendant leaves the session and keeps stdout: a pipe reader would wait for its 60 s.
    script = f"setsid sleep 60 & echo $! >> {pids}; echo started; sleep 60"
    start = time.monotonic()
    result = run_tree(["bash", "-c", script], timeout=1.5)
    elapsed = time.monotonic() - start
    assert result.timed_out and result.returncode is None
    assert result.failure(1.5, 1) == "timed out after 1.5 s"
    assert 1.5 <= elapsed < 6, elapsed
    assert result.stdout_tail == "started\n"
    assert gone(read_pids(pids, 1), timeout=0.5)  # already gone when run_tree returned


@linux_only
def test_a_double_forked_daemon_with_a_cleared_environment_is_ended_when_the_root_exits(tmp_path: Path) -> None:
    pids = tmp_path / "pids"
    # The daemon's parent exits at once, it leaves the session and drops every variable: only a
    # subreaper still sees it as part of the tree.
    script = f"(setsid env -i sleep 61 & echo $! >> {pids}); echo done; exit 3"
    result = run_tree(["bash", "-c", script], timeout=30)
    daemon = read_pids(pids, 1)[0]
    assert result.returncode == 3 and result.failure(30, 1) == "exited with 3"
    assert daemon in result.leftovers
    assert not pid_alive(daemon)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads VmHWM from /proc")
def test_output_is_streamed_to_a_file_and_memory_stays_bounded(tmp_path: Path) -> None:
    out = tmp_path / "out.txt"
    # 200 MB of stdout, then the line a parser needs; a fresh interpreter's peak RSS (VmHWM: its
    # own, not the forking parent's as ru_maxrss would count) stays far below the output's size.
    probe = textwrap.dedent(f"""
        from pathlib import Path
        from workers.command.workload import run_tree
        r = run_tree(["bash", "-c", "head -c 200000000 /dev/zero | tr '\\\\0' x; echo; echo '[engine-bench] {{}}'"],
                     stdout=Path({str(out)!r}), max_output=300 * 2**20, timeout=120)
        hwm = next(line.split()[1] for line in open("/proc/self/status") if line.startswith("VmHWM:"))
        print(r.returncode, hwm)
        print(r.stdout_tail.splitlines()[-1])
    """)
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=180, check=True)
    first, last = done.stdout.splitlines()
    code, hwm_kib = first.split()
    assert code == "0" and last == "[engine-bench] {}"
    assert out.stat().st_size == 200_000_000 + len("\n[engine-bench] {}\n"), out.stat().st_size
    assert int(hwm_kib) < 80 * 1024, f"peak RSS {int(hwm_kib) / 1024:.0f} MiB for 200 MB of output"


def test_output_past_the_limit_stops_the_whole_tree(tmp_path: Path) -> None:
    pids = tmp_path / "pids"
    start = time.monotonic()
    result = run_tree(["bash", "-c", f"echo $$ >> {pids}; yes"], max_output=2**20, timeout=60)
    assert result.overflow == "stdout" and result.returncode is None
    assert result.failure(60, 2**20) == "printed more than 1 MiB on stdout; stopped"
    assert time.monotonic() - start < 10
    assert not pid_alive(read_pids(pids, 1)[0])


def test_a_command_that_cannot_start_raises_what_popen_raises(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        run_tree([str(tmp_path / "no-such-program")])
    script = tmp_path / "not-executable"
    script.write_text("#!/bin/sh\n")
    with pytest.raises(PermissionError):
        run_tree([str(script)])


OWNER = textwrap.dedent("""
    import sys, time
    from workers.lock.gpu import GpuLock, held_lock_fds
    from workers.proc.tree import ProcessTree
    lock = GpuLock(sys.argv[1], mode="test", cmd="owner").acquire()
    script = sys.argv[2].replace("LOCKFD", str(lock.fileno()))
    tree = ProcessTree(["bash", "-c", script], pass_fds=held_lock_fds()).start()
    print("started", flush=True)
    time.sleep(120)
""")


@linux_only
def test_a_sigkilled_owner_takes_its_tree_with_it_and_the_lock_holds_until_the_tree_is_gone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(GUARD_ENV, raising=False)
    lock, pids = str(tmp_path / "gpu.lock"), tmp_path / "pids"
    # A workload with a descendant that left the session and closed the lock's descriptor, and
    # one that ignores SIGTERM: neither may run on once the lock is free.
    script = (
        f"echo $$ >> {pids}; setsid sleep 60 LOCKFD>&- & echo $! >> {pids}; "
        f"(trap '' TERM; sleep 60) & echo $! >> {pids}; wait"
    )
    owner = subprocess.Popen([sys.executable, "-c", OWNER, lock, script], stdout=subprocess.PIPE, text=True)
    assert owner.stdout is not None and owner.stdout.readline() == "started\n"
    workload = read_pids(pids, 3)
    assert lock_status(lock).busy
    owner.send_signal(signal.SIGKILL)
    owner.wait()
    # From the kill on, the lock is never free while a process of the workload runs.
    deadline = time.monotonic() + 10
    while any(pid_alive(p) for p in workload):
        assert time.monotonic() < deadline, "the workload outlived its owner"
        if not lock_status(lock).busy:
            assert not any(pid_alive(p) for p in workload), "the lock was free while the workload ran"
        time.sleep(0.01)
    while lock_status(lock).busy:  # then the keeper, the last holder of the descriptor, exits
        assert time.monotonic() < deadline, "the lock stayed taken after the workload was gone"
        time.sleep(0.01)


def test_workloads_get_no_ray_variables() -> None:
    base = {"PATH": "/bin", "RAY_AUTH_TOKEN_PATH": "/x/auth_token", "RAY_ADDRESS": "h:1", "HF_HOME": "/h"}
    assert workload_env(base, {"MY_FLAG": "1"}) == {"PATH": "/bin", "HF_HOME": "/h", "MY_FLAG": "1"}
    env = os.environ.copy()
    env["RAY_AUTH_TOKEN"] = "secret"
    shown = run_tree(["env"], env=workload_env(env)).stdout_tail
    assert "RAY_" not in shown and "secret" not in shown and "PATH=" in shown


SERVER = textwrap.dedent("""
    import os, sys, time
    from workers.proc.tree import become_subreaper, end_descendants
    job = os.fork()
    if job == 0:  # a forked job (first thing: its tree's reaper) whose helper double-forks out of its session
        assert become_subreaper()
        os.system(f"(setsid sleep 61 & echo $! > {sys.argv[1]})")
        time.sleep(120)
        os._exit(0)
    while not os.path.exists(sys.argv[1]) or not open(sys.argv[1]).read().strip():
        time.sleep(0.02)
    ended = end_descendants(job)
    os.waitpid(job, 0)
    print(" ".join(map(str, sorted(ended))))
""")


@linux_only
def test_a_fork_server_as_subreaper_ends_a_forked_jobs_orphans_too(tmp_path: Path) -> None:
    pidfile = tmp_path / "orphan"
    done = subprocess.run([sys.executable, "-c", SERVER, str(pidfile)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    orphan = int(pidfile.read_text())
    assert orphan in map(int, done.stdout.split())  # found, re-parented to the job, and ended
    assert not pid_alive(orphan)


def test_ending_a_group_leader_ends_its_tree_and_what_left_the_tree_in_its_group(tmp_path: Path) -> None:
    log, pids = tmp_path / "log", tmp_path / "pids"
    # An orphan that left the tree (its parent, a subshell, exited) but not the group, and a child
    # that ignores SIGTERM; the root itself exits on SIGTERM.
    script = (
        f"trap 'echo term >> {log}; exit 0' TERM; (sleep 61 & echo $! >> {pids}); "
        f"(trap '' TERM; sleep 62) & echo $! >> {pids}; wait"
    )
    root = subprocess.Popen(["bash", "-c", script], start_new_session=True)
    other = subprocess.Popen(["sleep", "63"], start_new_session=True)  # a second root, ended in the same call
    try:
        orphan, stubborn = read_pids(pids, 2)
        assert not is_descendant(orphan, root.pid)  # only its process group ties it to the root
        ended = end_descendants(root.pid, other.pid, grace=1.0, group=True)
        assert {root.pid, other.pid, orphan, stubborn} <= set(ended)
        assert log.read_text() == "term\n"  # SIGTERM first, and the grace to act on it
        assert root.wait(5) == 0 and other.wait(5) == -signal.SIGTERM
        assert gone([orphan, stubborn], timeout=0.5)
    finally:
        for proc in (root, other):
            proc.kill()
            proc.wait()


def test_the_process_table_knows_this_process_and_counts_a_zombie_as_gone() -> None:
    me = os.getpid()
    entry = process_table()[me]
    assert entry == process_entry(me)
    assert (entry.ppid, entry.pgid, entry.zombie) == (os.getppid(), os.getpgrp(), False)
    assert parent_pid(me) == os.getppid() and is_descendant(me, os.getppid())
    ppid, used, name = cpu_times()[me]
    assert ppid == os.getppid() and name == process_name(me) != "?"
    assert abs(used - sum(os.times()[:2])) < 0.5
    assert process_cmdline(me) and os.path.basename(process_cmdline(me)[0]).startswith(("python", "pytest"))
    child = subprocess.Popen(["true"])
    deadline = time.monotonic() + 5
    while not (process_entry(child.pid) or entry).zombie:  # exited, not yet reaped
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert not pid_alive(child.pid) and child.pid not in [e.pid for e in descendants(me)]
    child.wait()
    assert process_entry(child.pid) is None and parent_pid(child.pid) is None
    assert process_name(child.pid) == "?" and process_cmdline(child.pid) == []


def test_a_signal_never_reaches_a_process_that_reused_the_pid() -> None:
    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        entry = process_entry(sleeper.pid)
        assert entry is not None
        assert not signal_process(entry._replace(start=entry.start - 1), signal.SIGKILL)  # another start time
        assert sleeper.poll() is None
        assert signal_process(entry, signal.SIGKILL)
        assert sleeper.wait(5) == -signal.SIGKILL
    finally:
        sleeper.kill()
        sleeper.wait()


def test_listening_pids_names_this_process_for_its_listening_socket() -> None:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        port = listener.getsockname()[1]
        assert listening_pids(port) is None  # bound, not listening
        listener.listen()
        assert listening_pids(port) == [os.getpid()]
    assert listening_pids(port) is None
