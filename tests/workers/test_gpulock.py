"""The guarded GPU lock with real processes: exclusion, SIGKILL, flock(1), nesting, bad paths, status."""

from __future__ import annotations

import itertools
import json
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from workers.lock.file import holder_path, lock_status, read_holder
from workers.lock.gpu import GUARD_ENV, GpuLock, LockBusyError, LockPathError

HELPER = str(Path(__file__).with_name("lock_helper.py"))


@pytest.fixture(autouse=True)
def _no_outer_holder(monkeypatch: pytest.MonkeyPatch) -> None:
    # A suite run under `orchestrate lock hold` must still exercise the lock itself.
    monkeypatch.delenv(GUARD_ENV, raising=False)


@pytest.fixture
def lock_path(tmp_path: Path) -> str:
    return str(tmp_path / "gpu.lock")


def start_holder(lock: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    """A separate process that takes the lock and keeps it until killed."""
    proc = subprocess.Popen([sys.executable, HELPER, "hold", lock, "0"], stdout=subprocess.PIPE, text=True, env=env)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line.startswith("held nested=False"), line
    return proc


def start_flock(lock: str) -> subprocess.Popen[bytes]:
    """`flock LOCK sleep 60` in its own session (its sleep inherits the locked descriptor)."""
    proc = subprocess.Popen(["flock", lock, "sleep", "60"], start_new_session=True)
    deadline = time.monotonic() + 10
    while not lock_status(lock).busy:
        assert time.monotonic() < deadline, "flock(1) never took the lock"
        time.sleep(0.02)
    return proc


def stop_group(proc: subprocess.Popen[bytes]) -> None:
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def test_eight_processes_240_acquisitions_never_overlap(lock_path: str, tmp_path: Path) -> None:
    counter = tmp_path / "counter"
    counter.write_text("0")
    procs, outs = [], []
    for i in range(8):
        out = tmp_path / f"spans-{i}.json"
        outs.append(out)
        # Half wait without limit (blocking flock), half with a bound (polling): both must exclude.
        max_wait = "0" if i % 2 else "120"
        procs.append(
            subprocess.Popen([sys.executable, HELPER, "contend", lock_path, "30", str(out), str(counter), max_wait])
        )
    for proc in procs:
        assert proc.wait(timeout=180) == 0
    spans = sorted(tuple(span) for out in outs for span in json.loads(out.read_text()))
    assert len(spans) == 240
    overlaps = [(a, b) for a, b in itertools.pairwise(spans) if b[0] < a[1]]
    assert overlaps == []
    assert int(counter.read_text()) == 240  # no read-modify-write was lost
    assert not os.path.exists(holder_path(lock_path))  # every holder cleaned up after itself
    assert stat.S_IMODE(os.stat(lock_path).st_mode) == 0o666  # shared by every user, despite the umask


def test_sigkilled_holder_frees_the_lock_at_once(lock_path: str) -> None:
    holder = start_holder(lock_path)
    assert read_holder(lock_path) is not None and read_holder(lock_path).pid == holder.pid  # type: ignore[union-attr]
    with pytest.raises(LockBusyError, match=f"pid={holder.pid} mode=test"):
        GpuLock(lock_path, max_wait=0.2).acquire()
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    status = lock_status(lock_path)
    assert (status.state, status.busy) == ("stale", False)  # its holder file names a dead pid
    assert "is gone" in status.describe()
    start = time.monotonic()
    with GpuLock(lock_path, max_wait=5, mode="job", cmd="after kill") as lock:
        assert time.monotonic() - start < 0.5
        assert lock.wait_s < 0.5
        assert read_holder(lock_path).cmd == "after kill"  # type: ignore[union-attr]


def test_flock_1_holder_blocks_the_lock(lock_path: str) -> None:
    holder = start_flock(lock_path)
    try:
        status = lock_status(lock_path)
        assert status.state == "held" and status.holder is None
        assert holder.pid in status.lockers  # /proc/locks names flock(1)
        assert f"pid={holder.pid} (flock)" in status.describe()
        assert "no holder file" in status.describe()
        start = time.monotonic()
        with pytest.raises(LockBusyError, match="gave up waiting"):
            GpuLock(lock_path, max_wait=0.3).acquire()
        assert 0.3 <= time.monotonic() - start < 2
    finally:
        stop_group(holder)
    with GpuLock(lock_path, max_wait=2) as lock:
        assert not lock.nested


def test_lock_blocks_flock_1(lock_path: str) -> None:
    with GpuLock(lock_path, mode="job", cmd="k"):
        assert subprocess.run(["flock", "-n", lock_path, "true"]).returncode == 1
        assert subprocess.run(["flock", "-w", "0.2", lock_path, "true"]).returncode == 1
    assert subprocess.run(["flock", "-n", lock_path, "true"]).returncode == 0


def test_a_job_left_daemon_does_not_keep_the_lock(lock_path: str, tmp_path: Path) -> None:
    pidfile = tmp_path / "daemon.pid"
    with GpuLock(lock_path):
        cmd = f"sleep 30 </dev/null >/dev/null 2>&1 & echo $! > {pidfile}"
        subprocess.run(["sh", "-c", cmd], check=True)
    daemon = int(pidfile.read_text())
    try:
        assert not lock_status(lock_path).busy
    finally:
        os.kill(daemon, signal.SIGKILL)


def test_symlink_directory_and_fifo_paths_are_refused(tmp_path: Path) -> None:
    target = tmp_path / "target"
    target.write_text("")
    link = tmp_path / "link.lock"
    link.symlink_to(target)
    dangling = tmp_path / "dangling.lock"
    dangling.symlink_to(tmp_path / "nowhere")
    directory = tmp_path / "dir.lock"
    directory.mkdir()
    fifo = tmp_path / "fifo.lock"
    os.mkfifo(fifo)
    cases = [(link, "symbolic link"), (dangling, "symbolic link"), (directory, "directory"), (fifo, "regular")]
    for path, why in cases:
        with pytest.raises(LockPathError, match=why):
            GpuLock(str(path), max_wait=1).acquire()
        with pytest.raises(LockPathError, match=why):
            lock_status(str(path))
    assert not (tmp_path / "nowhere").exists()  # the dangling link's target was not created
    with pytest.raises(LockPathError, match="does not exist"):
        GpuLock(str(tmp_path / "missing" / "gpu.lock")).acquire()


def test_nesting_honours_only_an_ancestor(lock_path: str) -> None:
    with GpuLock(lock_path, mode="job", cmd="outer") as outer:
        assert os.environ[GUARD_ENV] == str(os.getpid())
        # A child of the holder nests at once.
        done = subprocess.run(
            [sys.executable, HELPER, "once", lock_path, "5"], capture_output=True, text=True, timeout=30
        )
        assert done.returncode == 0 and done.stdout.startswith("held nested=True"), done.stdout
        # So does a second request in the holder itself.
        with GpuLock(lock_path, max_wait=1) as inner:
            assert inner.nested and inner.wait_s == 0
        assert outer.held and read_holder(lock_path).cmd == "outer"  # type: ignore[union-attr]
        # A variable naming a live non-ancestor, pid 1, or garbage is ignored: the wait runs out.
        sibling = subprocess.Popen(["sleep", "30"])
        try:
            for value in (str(sibling.pid), "1", "self"):
                env = {**os.environ, GUARD_ENV: value}
                done = subprocess.run(
                    [sys.executable, HELPER, "once", lock_path, "0.3"],
                    capture_output=True,
                    text=True,
                    env=env,
                    timeout=30,
                )
                assert done.returncode == 75, (value, done.stdout)
                assert "gave up waiting" in done.stdout
        finally:
            sibling.kill()
            sibling.wait()
    assert GUARD_ENV not in os.environ


def test_status_free_held_and_holder_file_lines(lock_path: str) -> None:
    assert lock_status(lock_path).state == "free"
    assert not os.path.exists(lock_path)  # status never creates the lock
    with GpuLock(lock_path, mode="hold", cmd="bench\n--prompt 512"):
        lines = Path(holder_path(lock_path)).read_text().splitlines()
        assert lines[0] == f"pid={os.getpid()}"
        assert lines[1].startswith("start=20") and lines[1].endswith("Z")
        assert lines[2:] == ["mode=hold", "cmd=bench --prompt 512"]
        status = lock_status(lock_path)
        assert (status.state, status.busy) == ("held", True)
        assert status.holder is not None and status.holder.pid == os.getpid()
        assert f"pid={os.getpid()} mode=hold" in status.describe()
    assert lock_status(lock_path).state == "free"
    assert not os.path.exists(holder_path(lock_path))


def _line_within(proc: subprocess.Popen[str], timeout: float) -> str | None:
    """The next stdout line of `proc` if one comes within `timeout` seconds."""
    import select

    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    return proc.stdout.readline() if ready else None


@pytest.mark.parametrize("how", ["replaced", "deleted"])
def test_a_waiter_whose_lock_file_went_away_never_shares_the_lock(lock_path: str, tmp_path: Path, how: str) -> None:
    first = start_holder(lock_path)
    hold = [sys.executable, HELPER, "hold", lock_path, "60"]
    waiter = subprocess.Popen(hold, stdout=subprocess.PIPE, text=True)  # blocks on the file as it was
    procs = [first, waiter]
    try:
        time.sleep(0.5)
        if how == "replaced":
            fresh = tmp_path / "fresh.lock"
            fresh.write_text("")
            os.rename(fresh, lock_path)
        else:
            os.unlink(lock_path)
        time.sleep(0.5)
        newcomer = subprocess.Popen(hold, stdout=subprocess.PIPE, text=True)  # opens what the path names now
        procs.append(newcomer)
        time.sleep(0.5)
        first.kill()
        first.wait()
        # The waiter then gets the flock of a file the path no longer names; taking that for the
        # lock would let it run beside the newcomer. Exactly one of the two may hold it.
        got = {p.pid: _line_within(p, 5) for p in (waiter, newcomer)}
        holders = [pid for pid, line in got.items() if line]
        assert len(holders) == 1, f"{len(holders)} processes held the GPU lock at once"
        holder = next(p for p in (waiter, newcomer) if p.pid == holders[0])
        other = newcomer if holder is waiter else waiter
        assert got[holder.pid].startswith("held nested=False")  # type: ignore[union-attr]
        holder.kill()
        holder.wait()
        line = _line_within(other, 10)
        assert line is not None and line.startswith("held nested=False"), line  # then the other, on the same file
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def test_deleting_the_lock_file_while_held_does_not_let_a_second_holder_in(lock_path: str) -> None:
    with GpuLock(lock_path, mode="job", cmd="holder") as lock:
        os.unlink(lock_path)  # a cleaner, or a user, removes the file
        time.sleep(0.8)  # the holder's guard notices and takes the new file
        done = subprocess.run([sys.executable, HELPER, "once", lock_path, "0.5"], capture_output=True, text=True,
                              timeout=30, env={k: v for k, v in os.environ.items() if k != GUARD_ENV})  # fmt: skip
        assert done.returncode == 75, done.stdout  # without the guard: "held", a second holder
        assert lock.intact
    assert subprocess.run(["flock", "-n", lock_path, "true"]).returncode == 0  # both files let go


def test_the_nesting_variable_counts_only_for_the_lock_its_ancestor_holds(lock_path: str, tmp_path: Path) -> None:
    other = str(tmp_path / "other-gpu.lock")
    holder = start_holder(other)  # a stranger holds the second GPU's lock
    try:
        with GpuLock(lock_path, mode="job", cmd="gpu0"):
            # Our child names us, and we are its ancestor, but we hold gpu0's lock, not this one.
            done = subprocess.run([sys.executable, HELPER, "once", other, "0.5"], capture_output=True, text=True,
                                  timeout=30)  # fmt: skip
            assert done.returncode == 75, done.stdout  # it waited for the stranger; it did not "nest"
            mine = subprocess.run([sys.executable, HELPER, "once", lock_path, "5"], capture_output=True, text=True,
                                  timeout=30)  # fmt: skip
            assert mine.stdout.startswith("held nested=True"), mine.stdout
        # An ancestor that holds no lock at all (a stale export) does not make a waiter nest either.
        env = {**os.environ, GUARD_ENV: str(os.getpid())}
        done = subprocess.run([sys.executable, HELPER, "once", other, "0.5"], capture_output=True, text=True,
                              timeout=30, env=env)  # fmt: skip
        assert done.returncode == 75, done.stdout
    finally:
        holder.kill()
        holder.wait()
