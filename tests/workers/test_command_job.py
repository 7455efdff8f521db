"""A command job's commit comparison, correctness gate, host paths and the shell guard's nesting,
against a real git repository with shell benchmarks (the Cargo engine is in tests/e2e)."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest

from tests.engine_repo import GUARD_SH, git
from tests.workers.test_command import run
from workers.command.build import prune_builds
from workers.command.job import command_env
from workers.contract import JobSpec, LockSettings
from workers.lock.gpu import GUARD_ENV, GpuLock

# Speed from speed.txt, halved for the opt-out arm; the arm, commit and env go to $ORDER_LOG.
BENCH = """#!/usr/bin/env bash
set -eu
echo "$1 $(cat speed.txt)" >> "$ORDER_LOG"
speed=$(awk -v s="$(cat speed.txt)" -v o="${OPT_OUT:-}" 'BEGIN { print (o == "1") ? s / 2 : s }')
echo "[engine-bench] {\\"prefill_tok_s\\": $speed, \\"text\\": \\"$(cat text.txt)\\"}"
"""
# A cargo-test-like gate: fails when tests.txt says so, as cargo prints it (the panic, then a long
# backtrace under RUST_BACKTRACE=1, the summary; the build log and the rerun hint on stderr).
GATE = """#!/usr/bin/env bash
echo "   Compiling mlxcel v0.1.0" >&2
echo "running 2 tests"
if [ "$(cat tests.txt)" = pass ]; then echo "test result: ok. 2 passed; 0 failed"; exit 0; fi
echo "test sorted_gather_route ... FAILED"
echo "---- sorted_gather_route stdout ----"
echo "thread 'sorted_gather_route' panicked at tests/rocm_nvfp4_quant.rs:4:5:"
echo "route output differs from the CPU reference at tolerance()"
echo "stack backtrace:"
for i in $(seq 1 80); do echo "  $i: core::ops::function::FnOnce::call_once at library/core/src/ops/fn.rs:250"; done
echo "test result: FAILED. 1 passed; 1 failed"
echo "error: test failed, to rerun pass '--test rocm_nvfp4_quant'" >&2
exit 101
"""


class Repo:
    def __init__(self, path: Path) -> None:
        self.path = path
        path.mkdir()
        git(path, "init", "-q", "-b", "main")
        for name, text in {"bench.sh": BENCH, "gate.sh": GATE, "guard.sh": GUARD_SH}.items():
            (path / name).write_text(text)
            (path / name).chmod(0o755)

    def commit(self, speed: float, text: str = "greedy", tests: str = "pass") -> str:
        (self.path / "speed.txt").write_text(f"{speed}\n")
        (self.path / "text.txt").write_text(f"{text}\n")
        (self.path / "tests.txt").write_text(f"{tests}\n")
        git(self.path, "add", "-A")
        git(self.path, "commit", "-q", "-m", f"speed {speed}")
        return git(self.path, "rev-parse", "HEAD")


@pytest.fixture
def repo(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Repo:
    monkeypatch.setenv("ORDER_LOG", str(tmp_path / "order.log"))
    return Repo(tmp_path / "engine")


def job(
    repo: Repo, tmp_path: Path, run_id: str = "r1", params: dict[str, Any] | None = None, **options: Any
) -> JobSpec:
    opts: dict[str, Any] = {"repo": str(repo.path), "ref": "main", "run": "./bench.sh {arm}", "parse": "engine-bench",
                            "timeout": 20, "cache_dir": str(tmp_path / "cache")}  # fmt: skip
    opts.update(options)
    return JobSpec(
        run_id=run_id, sweep="s", job_key="k1", case="command", case_name="bench", params=params or {},
        arms=["default", "opt-out"], arm_env={"opt-out": {"OPT_OUT": "1"}}, options=opts, device="cpu",
        repetitions=2, warmup=0, lock=LockSettings(path=str(tmp_path / "gpu.lock")),
    )  # fmt: skip


def first_error(rows: list[dict[str, Any]]) -> str | None:
    return next((r["error"] for r in rows if r["error"]), None)


def test_two_refs_interleave_arms_and_commits_abba_in_one_job(repo: Repo, tmp_path: Path) -> None:
    base = repo.commit(100.0)
    git(repo.path, "tag", "v1")
    head = repo.commit(80.0)
    status, rows = run(job(repo, tmp_path, ref=None, refs=["v1", "main"]))
    assert status == "ok"
    # (arm, commit) pairs: default@v1 default@main opt-out@v1 opt-out@main, then reversed
    order = (tmp_path / "order.log").read_text().split("\n")[:-1]
    assert order == ["default 100.0", "default 80.0", "opt-out 100.0", "opt-out 80.0",
                     "opt-out 80.0", "opt-out 100.0", "default 80.0", "default 100.0"]  # fmt: skip
    measured = {(r["arm"], r["commit"], r["sample"]): r["value"] for r in rows if r["metric"] == "prefill_tok_s"}
    expected = {("default", base): 100.0, ("default", head): 80.0, ("opt-out", base): 50.0, ("opt-out", head): 40.0}
    assert measured == {(arm, commit, i): v for (arm, commit), v in expected.items() for i in (0, 1)}
    sides = {
        (r["commit"], dict(r["extra"])["ref"], dict(r["extra"])["ref_index"], dict(r["extra"])["refs"]) for r in rows
    }
    assert sides == {(base, "v1", "0", "2"), (head, "main", "1", "2")}
    builds = [r for r in rows if r["metric"] == "build_seconds"]
    assert len(builds) == 4 and {r["commit"] for r in builds} == {base, head}


def test_gate_runs_once_per_commit_and_run_and_a_failure_stops_timing(repo: Repo, tmp_path: Path) -> None:
    good = repo.commit(100.0)
    status, rows = run(job(repo, tmp_path, gate="./gate.sh"))
    gates = [r for r in rows if r["metric"] == "gate_seconds"]
    assert status == "ok" and {dict(r["extra"])["gate_cache"] for r in gates} == {"miss"} and len(gates) == 2
    assert all(r["status"] == "ok" and r["value"] > 0 and r["commit"] == good for r in gates)
    status, rows = run(job(repo, tmp_path, gate="./gate.sh"))  # the run's second job: the gate's pass is kept
    assert {dict(r["extra"])["gate_cache"] for r in rows if r["metric"] == "gate_seconds"} == {"hit"}

    broken = repo.commit(100.0, tests="fail")
    (tmp_path / "order.log").unlink()
    status, rows = run(job(repo, tmp_path, run_id="r2", gate="./gate.sh"))
    assert status == "failed"
    assert not (tmp_path / "order.log").exists()  # nothing was timed
    assert {r["metric"] for r in rows} == {"build_seconds", "gate_seconds"}
    failed = [r for r in rows if r["status"] == "failed"]
    assert {r["arm"] for r in failed} == {"default", "opt-out"} and {r["commit"] for r in failed} == {broken}
    error = failed[0]["error"]
    assert error.startswith("gate `./gate.sh` exited with 101:")
    assert "route output differs from the CPU reference" in error and "test result: FAILED" in error
    assert "to rerun pass '--test rocm_nvfp4_quant'" in error and f"(at main {broken[:12]})" in error
    log = next((tmp_path / "cache" / "builds").rglob(f"{broken[:16]}-*.gate-*.log"))
    assert "test result: FAILED" in log.read_text()


def test_gate_of_either_commit_fails_a_comparison(repo: Repo, tmp_path: Path) -> None:
    repo.commit(100.0)
    git(repo.path, "tag", "v1")
    repo.commit(90.0, tests="fail")
    status, rows = run(job(repo, tmp_path, ref=None, refs=["v1", "main"], gate="./gate.sh"))
    assert status == "failed"
    by_ref = {dict(r["extra"])["ref"]: r["status"] for r in rows if r["metric"] == "gate_seconds"}
    assert by_ref == {"v1": "ok", "main": "failed"}
    assert not any(r["metric"] == "prefill_tok_s" for r in rows)


def test_checkpoint_is_a_host_path_and_a_missing_one_is_unsupported(repo: Repo, tmp_path: Path) -> None:
    repo.commit(100.0)
    status, rows = run(job(repo, tmp_path, params={"checkpoint": str(tmp_path / "no-such-model")}))
    assert status == "unsupported"
    assert {r["status"] for r in rows} == {"unsupported"}
    assert "not found on this host" in rows[0]["error"]
    assert not (tmp_path / "cache" / "builds").exists()  # nothing built for a host without the model
    (Path(os.environ["HOME"]) / "models" / "m").mkdir(parents=True)
    spec = job(repo, tmp_path, params={"checkpoint": "~/models/m"}, run="test -d {checkpoint} && ./bench.sh {arm}")
    status, rows = run(spec)
    assert status == "ok", first_error(rows)
    assert {dict(r["params"])["checkpoint"] for r in rows} == {"~/models/m"}  # recorded as written


def test_benchmark_skipping_an_arm_makes_it_unsupported(repo: Repo, tmp_path: Path) -> None:
    repo.commit(100.0)
    skip_row = 'echo "m,/m,,,,,,,2026-10-12,h,0.1,release,100,\\"x\\",512,SKIP:oom_estimate"'
    ok_row = 'echo "m,/m,512,100,4.0,128.0,8.0,12.5,d,h,v,release,100,\\"x\\",512"'
    run_cmd = f'if [ "{{arm}}" = opt-out ]; then {skip_row}; else {ok_row}; fi'
    status, rows = run(job(repo, tmp_path, run=run_cmd, parse="bench-decode-csv"))
    assert status == "ok"  # the other arm measured: the job is fine, the skipped arm says why
    skipped = [r for r in rows if r["status"] != "ok"]
    assert [(r["arm"], r["metric"], r["status"]) for r in skipped] == [("opt-out", "wall_seconds", "unsupported")]
    assert "bench_decode.sh skipped m: SKIP:oom_estimate" in skipped[0]["error"]
    assert [(r["arm"], r["value"]) for r in rows if r["metric"] == "prefill_tok_s"] == [("default", 128.0)] * 2
    status, rows = run(job(repo, tmp_path, run=skip_row, parse="bench-decode-csv"))
    assert status == "unsupported"  # every arm skipped


def test_guard_nests_inside_a_job_holding_its_lock(repo: Repo, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    repo.commit(100.0)
    trace = tmp_path / "guard.trace"
    monkeypatch.setenv("ROCM_GPU_GUARD_TRACE", str(trace))
    lock = tmp_path / "gpu.lock"
    monkeypatch.setenv("ROCM_GPU_GUARD_LOCK", str(lock))  # the job's lock is the guard's
    spec = job(repo, tmp_path, run="./guard.sh --hold -- ./bench.sh {arm}", timeout=15)
    with GpuLock(str(lock), mode="job"):  # as workers.job.runner holds it around the job
        status, rows = run(spec)
    assert status == "ok", first_error(rows)  # a deadlock would have timed out
    assert trace.read_text().splitlines() == [f"nested: lock held by outer guard {os.getpid()}, not taking {lock}"] * 4


def test_guard_takes_its_own_lock_when_the_job_holds_another(
    repo: Repo, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    repo.commit(100.0)
    trace = tmp_path / "guard.trace"
    monkeypatch.setenv("ROCM_GPU_GUARD_TRACE", str(trace))
    guard_lock = tmp_path / "guard.lock"
    monkeypatch.setenv("ROCM_GPU_GUARD_LOCK", str(guard_lock))
    spec = job(repo, tmp_path, run="./guard.sh --hold -- ./bench.sh {arm}", timeout=15)
    with GpuLock(str(tmp_path / "gpu.lock"), mode="job"):
        assert os.environ[GUARD_ENV] == str(os.getpid())
        assert GUARD_ENV not in command_env(spec)  # it names a lock the guard does not use
        status, rows = run(spec)
    assert status == "ok", first_error(rows)
    assert trace.read_text().splitlines() == [f"acquired guard lock {guard_lock}"] * 4
    shared = spec.model_copy(update={"lock": LockSettings(path=str(guard_lock))})
    with GpuLock(str(guard_lock), mode="job"):
        assert command_env(shared)[GUARD_ENV] == str(os.getpid())


def test_old_builds_are_pruned_beyond_the_newest_few(repo: Repo, tmp_path: Path) -> None:
    builds = tmp_path / "builds"
    builds.mkdir()
    day = 24 * 3600
    for i in range(7):  # build i was last used i days ago
        (builds / f"c{i}").mkdir()
        (builds / f"c{i}" / "target").write_text("gigabytes")
        (builds / f"c{i}.build.log").write_text("log")
        marker = builds / f"c{i}.build.json"
        marker.write_text("{}")
        os.utime(marker, (time.time() - i * day - 60, time.time() - i * day - 60))
    with GpuLock(str(builds / "c5.lock"), mode="job"):  # another job is using build 5
        removed = prune_builds(builds, keep=3)
    assert sorted(p.name for p in removed) == ["c3", "c4", "c6"]
    assert sorted(p.name for p in builds.iterdir() if p.is_dir()) == ["c0", "c1", "c2", "c5"]
    assert not (builds / "c6.build.log").exists() and (builds / "c5.build.log").exists()
    assert prune_builds(builds, keep=1, recent_s=6 * day) == []  # every one left was used within 6 days
    assert [p.name for p in prune_builds(builds, keep=1, recent_s=3 * day)] == ["c5"]  # c0..c2: within 3 days
    # through a job: the second commit's build prunes the first (keep 1, no recency) only when it is old
    first = repo.commit(100.0)
    run(job(repo, tmp_path))
    old = next((tmp_path / "cache" / "builds").rglob(f"{first[:16]}-*.build.json"))
    os.utime(old, (time.time() - 2 * day, time.time() - 2 * day))
    repo.commit(90.0)
    os.environ["ORCHESTRATE_KEEP_BUILDS"] = "1"
    try:
        status, _ = run(job(repo, tmp_path, run_id="r2"))
    finally:
        del os.environ["ORCHESTRATE_KEEP_BUILDS"]
    assert status == "ok"
    assert not old.exists() and not old.with_name(old.name.removesuffix(".build.json")).exists()
