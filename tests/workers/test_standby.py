"""Standbys (`workers.proc.standby`): the next job's process forked while the previous one winds down, its
device opened then, handed the next job only where their environments agree on what reaches the
device, never left open for long, and carrying none of the previous job's state.

Real fork servers (the test entry `tests/workers/fork_probe.py` stands in for `workers` so that a
child can report what it sees); MLX's CPU backend here, where there is no driver to start, so
`ORCHESTRATE_STANDBY=1` turns standbys on (on a GPU host they are on by default).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest

from tests.conftest import child_env
from tests.workers import fork_probe
from workers.contract import META_PHASES, JobSpec, LockSettings
from workers.proc import spawn as forkclient
from workers.proc import standby
from workers.proc.table import pid_alive

pytestmark = pytest.mark.slow


@pytest.fixture
def probe_server() -> Iterator[Callable[..., forkclient.ForkServer]]:
    """Real fork servers whose `workers` entry is the test probe."""
    started: list[forkclient.ForkServer] = []

    def start(**env: str) -> forkclient.ForkServer:
        started.append(fork_probe.start_server(child_env(**env), "workers"))
        return started[-1]

    yield start
    for srv in started:
        srv.close()


def _job(srv: forkclient.ForkServer, tmp_path: Path, what: str, **changes: str) -> tuple[dict[str, Any], bool]:
    """Run the probe as a job; (its report, whether it was handed to a standby)."""
    out = tmp_path / f"probe-{time.monotonic_ns()}.json"
    with (tmp_path / "probe.log").open("ab") as log:
        proc = srv.spawn("workers", [what, str(out)], env=dict(changes), stdout=log.fileno(), stderr=log.fileno())
        assert proc.wait(timeout=120) == 0, (tmp_path / "probe.log").read_text()
    return json.loads(out.read_text()), proc.ahead


def _children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(p) for p in f.read().split()]


def _settled_children(srv: forkclient.ForkServer, want: int, within: float = 10.0) -> list[int]:
    """The server's children once there are `want` of them (or what there is after `within` s)."""
    assert srv.proc is not None
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        found = _children(srv.proc.pid)
        if len(found) == want:
            return found
        time.sleep(0.05)
    return _children(srv.proc.pid)


def test_the_next_job_is_handed_to_the_standby_with_none_of_the_last_jobs_state(
    probe_server: Callable[..., forkclient.ForkServer], tmp_path: Path
) -> None:
    srv = probe_server(ORCHESTRATE_STANDBY="1")
    [ready] = _settled_children(srv, 1)  # the server's first standby, for the first job
    first, ahead = _job(srv, tmp_path, "dirty", LEAK_MARK="1")
    assert ahead and first["pid"] == ready and float(first["ahead"]) >= 0.0
    assert first["env"] == "1" and first["kept"] == 1
    [ready] = _settled_children(srv, 1)  # the one the first job asked for as it ended
    assert ready != first["pid"]
    second, ahead = _job(srv, tmp_path, "look")
    assert ahead and second["pid"] == ready
    # the first job's request set LEAK_MARK and it kept an array: the standby was forked from the
    # server with the first job's environment, and the second job gets its own whole environment
    assert second["env"] is None and second["kept"] == 0 and "leak" not in second["phases"]
    assert second["active"] == 0 and second["peak"] == 0  # the standby's one array is gone, its peak reset


def test_a_job_whose_device_environment_differs_is_forked_and_the_standby_dropped(
    probe_server: Callable[..., forkclient.ForkServer], tmp_path: Path
) -> None:
    srv = probe_server(ORCHESTRATE_STANDBY="1", OMP_NUM_THREADS="2")
    [ready] = _settled_children(srv, 1)
    report, ahead = _job(srv, tmp_path, "look", OMP_NUM_THREADS="3")  # MLX reads it at start: not the standby's
    assert not ahead and report["pid"] != ready and report["ahead"] is None
    assert not pid_alive(ready) or _settled_children(srv, 1) != [ready]
    [asked] = _settled_children(srv, 1)  # the job asked for one, with its own environment (3 threads)
    report, ahead = _job(srv, tmp_path, "look", OMP_NUM_THREADS="3")
    assert ahead and report["pid"] == asked
    report, ahead = _job(srv, tmp_path, "look", UNRELATED="x")  # back to the server's 2 threads: forked
    assert not ahead


def test_an_unclaimed_standby_is_dropped_and_none_kept_where_they_are_off(
    probe_server: Callable[..., forkclient.ForkServer], tmp_path: Path
) -> None:
    srv = probe_server(ORCHESTRATE_STANDBY="1", ORCHESTRATE_STANDBY_WAIT_S="1")
    [ready] = _settled_children(srv, 1)
    assert _settled_children(srv, 0, within=10.0) == []  # no job came for it within a second
    assert not pid_alive(ready)
    report, ahead = _job(srv, tmp_path, "look")
    assert not ahead and report["ahead"] is None
    off = probe_server(ORCHESTRATE_STANDBY="0")
    _job(off, tmp_path, "look")
    time.sleep(0.5)
    assert _settled_children(off, 0) == []
    report, ahead = _job(off, tmp_path, "look")
    assert not ahead
    assert standby.ask() is False  # this test process was not forked from a server: nobody to ask


def test_the_ray_task_body_runs_jobs_in_standbys_and_says_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Real jobs through the Ray task's body: from the second job on, each runs in the standby the
    one before it asked for, its phases say so, and its rows are the same kind of rows."""
    from workers.job import task

    monkeypatch.setenv("ORCHESTRATE_STANDBY", "1")
    monkeypatch.setattr(task, "_server", None)
    notes, opened = [], []
    try:
        for i in range(3):
            job = JobSpec(
                run_id="run1", sweep="standby", job_key=f"k{i}", case="qmm", case_name="qmm",
                params={"tokens": 16, "n": 64, "k": 64, "dtype": "float32"}, arms=["native"], device="cpu",
                repetitions=3, warmup=0, spool_dir=str(tmp_path / "spool"),
                lock=LockSettings(path=str(tmp_path / "gpu.lock"), cpu_busy_threshold=1e9),
            )  # fmt: skip
            table = task.execute_job(job.model_dump_json())
            meta = table.schema.metadata or {}
            assert meta[b"orchestrate.job_status"] == b"ok"
            phases = json.loads(meta[META_PHASES])
            notes.append(phases["process"])
            opened.append(phases.get("device_opened_ahead"))
            assert table.num_rows == pq.read_table(next((tmp_path / "spool").rglob(f"part-*{i}*.parquet"))).num_rows
    finally:
        if task._server is not None:
            task._server.close()
    assert all(standby.NOTE in note for note in notes[1:]), notes
    assert all(o is not None and o["seconds"] >= 0 for o in opened[1:]), opened
