"""Command cases against a real git repository made by the test, with a real shell benchmark."""

from __future__ import annotations

import datetime as dt
import hashlib
import re
import subprocess
import time
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from workers.command.case import CommandCaseError, RefNotFoundError, plan_commits, render, template_fields
from workers.command.job import run_command_job
from workers.contract import HostFingerprint, JobContext, JobSpec, RowBuilder
from workers.lock.gpu import GpuLock
from workers.proc.table import pid_alive

# The script prints its speed (from speed.txt, scaled by $SPEED_SCALE) as an engine-bench line,
# appends its arm to a log so the test sees the order, and prints its generated text.
BENCH = """#!/usr/bin/env bash
set -eu
echo "$1" >> "$ORDER_LOG"
speed=$(awk -v s="$(cat speed.txt)" -v f="${SPEED_SCALE:-1}" 'BEGIN { print s * f }')
echo "loading"
echo "[engine-bench] {\\"decode_tok_s\\": $speed, \\"prompt_tokens\\": $2, \\"text\\": \\"greedy $(cat speed.txt)\\"}"
"""


def git(repo: Path, *args: str) -> str:
    env = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@e", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@e", "HOME": str(repo.parent), "PATH": "/usr/bin:/bin"}  # fmt: skip
    return subprocess.run(["git", *args], cwd=repo, env=env, check=True, capture_output=True, text=True).stdout.strip()


def commit_speed(repo: Path, speed: float, message: str) -> str:
    (repo / "speed.txt").write_text(f"{speed}\n")
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", message)
    return git(repo, "rev-parse", "HEAD")


@pytest.fixture
def bench_repo(tmp_path: Path) -> Path:
    repo = tmp_path / "engine"
    repo.mkdir()
    git(repo, "init", "-q", "-b", "main")
    (repo / "bench.sh").write_text(BENCH)
    (repo / "bench.sh").chmod(0o755)
    return repo


FINGERPRINT = HostFingerprint(  # a fixed fingerprint: this test is about the command runner
    hostname="test-host", os="Linux", machine="x86_64", cpu="test cpu", cpu_count=2, memory_bytes=2**34,
    mlx_version="0.32.4", mlx_device="Device(cpu, 0)", backend="cpu", threads=2, fingerprint_id="fp-test",
)  # fmt: skip


def make_job(repo: Path, tmp_path: Path, **options: Any) -> JobSpec:
    opts: dict[str, Any] = {
        "repo": str(repo),
        "ref": "main",
        "build": f"echo {{commit}} >> {tmp_path / 'builds.log'}",
        "run": "./bench.sh {arm} {prompt_tokens}",
        "parse": "engine-bench",
        "timeout": 20,
        "cache_dir": str(tmp_path / "cache"),
    }
    arms = options.pop("arms", ["native", "affine"])
    opts.update(options)
    return JobSpec(
        run_id="r1", sweep="nightly", job_key="k1", case="command", case_name="bench", params={"prompt_tokens": 512},
        arms=arms, arm_env={"affine": {"SPEED_SCALE": "0.5"}}, options=opts, device="cpu",
        repetitions=2, warmup=1,
    )  # fmt: skip


def run(job: JobSpec) -> tuple[str, list[dict[str, Any]]]:
    context = JobContext(started_at=dt.datetime.now(dt.UTC))
    rows = RowBuilder(job, FINGERPRINT, context)
    status = run_command_job(job, rows, context)
    table: pa.Table = rows.table(status)
    return status, table.to_pylist()


@pytest.fixture(autouse=True)
def order_log(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    log = tmp_path / "order.log"
    monkeypatch.setenv("ORDER_LOG", str(log))
    monkeypatch.setenv("HOME", str(tmp_path))
    return log


def test_runs_each_arm_with_its_env_abba_and_records_commit(bench_repo: Path, tmp_path: Path, order_log: Path) -> None:
    commit = commit_speed(bench_repo, 100.0, "first")
    status, rows = run(make_job(bench_repo, tmp_path))
    assert status == "ok"
    assert {r["commit"] for r in rows} == {commit}
    decode = {(r["arm"], r["sample"]): r["value"] for r in rows if r["metric"] == "decode_tok_s"}
    assert decode == {("native", 0): 100.0, ("native", 1): 100.0, ("affine", 0): 50.0, ("affine", 1): 50.0}
    assert {r["unit"] for r in rows if r["metric"] == "decode_tok_s"} == {"tok/s"}
    # warm-up round, then ABBA: native affine | affine native | native affine
    assert order_log.read_text().split() == ["native", "affine", "affine", "native", "native", "affine"]
    build = [r for r in rows if r["metric"] == "build_seconds"]
    assert len(build) == 2 and all(r["value"] >= 0 and dict(r["extra"])["build_cache"] == "miss" for r in build)
    digest = hashlib.sha256(b"greedy 100.0").hexdigest()
    measured = [r for r in rows if r["metric"] == "decode_tok_s"]
    assert {dict(r["extra"])["output_sha256"] for r in measured} == {digest}
    assert all(r["status"] == "ok" and r["error"] is None for r in rows)
    assert dict(next(r for r in rows if r["arm"] == "affine")["env"]) == {"SPEED_SCALE": "0.5"}


def test_build_cache_hits_on_second_run_of_a_commit_and_ref_is_resolved_afresh(
    bench_repo: Path, tmp_path: Path
) -> None:
    first = commit_speed(bench_repo, 100.0, "first")
    job = make_job(bench_repo, tmp_path, build=f"sleep 0.2; echo {{commit}} >> {tmp_path / 'builds.log'}")
    run(job)
    status, rows = run(job)
    assert status == "ok"
    assert (tmp_path / "builds.log").read_text().split() == [first]  # built once
    build = [r for r in rows if r["metric"] == "build_seconds"]
    assert {dict(r["extra"])["build_cache"] for r in build} == {"hit"}
    assert all(r["value"] >= 0.2 for r in build)  # the original build time, recorded
    second = commit_speed(bench_repo, 80.0, "slower")
    status, rows = run(job)  # same run: the commit pinned by its first job
    assert {r["commit"] for r in rows} == {first}
    job = job.model_copy(update={"run_id": "r2"})  # the next run resolves the ref afresh
    status, rows = run(job)
    assert {r["commit"] for r in rows} == {second}
    assert {r["value"] for r in rows if r["metric"] == "decode_tok_s" and r["arm"] == "native"} == {80.0}
    assert (tmp_path / "builds.log").read_text().split() == [first, second]


@pytest.mark.parametrize(
    ("run_cmd", "timeout", "expected"),
    [
        ("echo boom >&2; exit 3", 20, "exited with 3; stderr: boom"),
        ("echo started >&2; sleep 30", 0.5, "timed out after 0.5 s; stderr: started"),
        ("echo '[engine-bench] {{garbled'; echo warn >&2", 20, "output did not parse (line 1: not valid JSON"),
        ("true", 20, "output did not parse (empty output)"),
        ("./bench.sh {arm} {missing}", 20, "run: template field {missing} is not a parameter"),
        ("echo ${HOME}", 20, "run: template field {HOME} is not a parameter"),
        ("echo {unclosed", 20, "run: malformed template"),
    ],
)
def test_failures_become_failed_rows(bench_repo: Path, tmp_path: Path, run_cmd: str, timeout: float,
                                     expected: str) -> None:  # fmt: skip
    commit_speed(bench_repo, 100.0, "first")
    status, rows = run(make_job(bench_repo, tmp_path, run=run_cmd, timeout=timeout))
    assert status == "failed"
    failed = [r for r in rows if r["status"] == "failed"]
    assert {r["arm"] for r in failed} == {"native", "affine"}
    assert all(expected in r["error"] for r in failed), failed[0]["error"]
    if timeout < 1:
        assert all(r["value"] < 5 for r in failed)  # killed, not waited for


def test_unknown_ref_and_failed_build_are_failed_rows(bench_repo: Path, tmp_path: Path) -> None:
    commit_speed(bench_repo, 100.0, "first")
    status, rows = run(make_job(bench_repo, tmp_path, ref="no-such-branch"))
    assert status == "failed"
    assert {r["error"] for r in rows} == {f"ref 'no-such-branch' not found in {bench_repo.resolve()}"}
    status, rows = run(make_job(bench_repo, tmp_path, build="echo compile error >&2; exit 1"))
    assert status == "failed"
    assert all("build exited with 1; stderr: compile error" in r["error"] for r in rows)
    assert {r["metric"] for r in rows} == {"build_seconds"}


def test_the_head_plans_commits_and_refuses_only_a_ref_the_repo_lacks(bench_repo: Path, tmp_path: Path) -> None:
    first = commit_speed(bench_repo, 100.0, "first")
    options = make_job(bench_repo, tmp_path).options
    assert plan_commits(options) == {"main": first}
    with pytest.raises(RefNotFoundError, match=f"ref 'no-such-branch' not found in {bench_repo.resolve()}"):
        plan_commits({**options, "ref": "no-such-branch"})
    not_a_repo = tmp_path / "not-a-repo"  # the head cannot read it: the hosts resolve the refs
    not_a_repo.mkdir()
    assert plan_commits({**options, "repo": str(not_a_repo)}) == {}


def test_template_fields() -> None:
    assert template_fields("./b {checkpoint} --p {prompt_tokens} {arm}") == {"checkpoint", "prompt_tokens", "arm"}
    assert template_fields("echo $${{HOME}} {p}") == {"p"}  # a shell's ${VAR}, braces doubled


@pytest.mark.parametrize("field", ["{p!r}", "{p!s}", "{p:.3}", "{p:>20}", "{p[0]}", "{p.upper}", "{0}", "{}"])
def test_fields_that_would_rewrite_the_quoted_value_are_refused(field: str) -> None:
    # `{p!r}` of the quoted "a b" is "\"'a b'\"" and `{p:.3}` is "'a " (the closing quote cut off): both
    # hand the shell an unquoted or half-quoted value, so no template may carry them.
    with pytest.raises(ValueError, match=re.escape(f"template field {field} is not a plain {{name}}")):
        template_fields(f"./b {field}")
    with pytest.raises(CommandCaseError, match=re.escape(f"run: template field {field}")):
        render(f"./b {field}", {"p": "a b; rm -rf ~"}, "run")
    assert render("./b {p}", {"p": "a b; rm -rf ~"}, "run") == "./b 'a b; rm -rf ~'"


def test_sweep_validation_checks_command_settings() -> None:
    from pydantic import ValidationError

    from orchestrator.specs.sweep import SweepSpec

    def sweep(**case: Any) -> SweepSpec:
        entry = {
            "case": "command",
            "name": "bench",
            "arms": {"native": {}, "affine": {"env": {"X": "1"}}},
            "repo": "../engine",
            "run": "./b {prompt_tokens}",
            "params": {"prompt_tokens": [512, 1024]},
        }
        return SweepSpec.model_validate({"name": "s", "cases": [{**entry, **case}]})

    assert sweep().cases[0].arm_env() == {"affine": {"X": "1"}}
    for case, message in [
        ({"run": None}, "run: a command case needs `run`"),
        ({"repo": None}, "repo: a command case needs `repo`"),
        ({"run": "./b {checkpoint}"}, "run: template field {checkpoint} is not a parameter"),
        ({"build": "cargo build --features {prompt_tokens}"}, "build: template field {prompt_tokens}"),
        ({"parse": "csv"}, "unknown parser 'csv'"),
    ]:
        with pytest.raises(ValidationError, match=re.escape(message)):
            sweep(**case)


def test_a_timeout_kills_the_whole_tree_even_a_setsid_descendant_holding_stdout(
    bench_repo: Path, tmp_path: Path
) -> None:
    commit_speed(bench_repo, 100.0, "first")
    pids = tmp_path / "pids"
    # The benchmark daemonises a helper into its own session that keeps stdout open: killing the
    # process group and reading the pipe to its end waited for the helper (12 s for a 2 s timeout).
    run_cmd = f"setsid sleep 30 & echo $! >> {pids}; sleep 30"
    start = time.monotonic()
    status, rows = run(make_job(bench_repo, tmp_path, run=run_cmd, timeout=1, arms=["native"]))
    assert status == "failed" and time.monotonic() - start < 10
    assert all("timed out after 1 s" in r["error"] for r in rows if r["status"] == "failed")
    for pid in map(int, pids.read_text().split()):
        assert not pid_alive(pid), "a descendant outlived the job's timeout"


def test_output_is_parsed_from_its_file_and_a_flood_is_stopped(
    bench_repo: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    commit_speed(bench_repo, 100.0, "first")
    # 8 MB of log lines before the result line: parsed whole, from the stream's file.
    noisy = "head -c 8000000 /dev/zero | tr '\\0' 'x' | fold -w 100; ./bench.sh {arm} {prompt_tokens}"
    status, rows = run(make_job(bench_repo, tmp_path, run=noisy))
    assert status == "ok", [r["error"] for r in rows if r["error"]]
    assert {r["value"] for r in rows if r["metric"] == "decode_tok_s" and r["arm"] == "native"} == {100.0}
    monkeypatch.setenv("ORCHESTRATE_MAX_OUTPUT_MB", "1")
    start = time.monotonic()
    status, rows = run(make_job(bench_repo, tmp_path, run="yes flood", timeout=60))
    assert status == "failed" and time.monotonic() - start < 20
    failed = [r for r in rows if r["status"] == "failed"]
    assert all("printed more than 1 MiB on stdout; stopped" in r["error"] for r in failed), failed[0]["error"]


def test_the_benchmark_gets_no_ray_variables_but_its_arm_env(
    bench_repo: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    commit_speed(bench_repo, 100.0, "first")
    token = tmp_path / "auth_token"
    token.write_text("s3cret")
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(token))
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")
    monkeypatch.setenv("RAY_AUTH_MODE", "token")
    seen = tmp_path / "env.txt"
    lock = GpuLock(str(tmp_path / "gpu.lock"), mode="job", cmd="env test").acquire()
    try:
        status, _ = run(make_job(bench_repo, tmp_path, run=f"env > {seen}; ./bench.sh {{arm}} {{prompt_tokens}}"))
    finally:
        lock.release()
    assert status == "ok"
    env = dict(line.split("=", 1) for line in seen.read_text().splitlines() if "=" in line)
    assert not [k for k in env if k.startswith("RAY_")]
    assert str(token) not in seen.read_text()
    assert env["SPEED_SCALE"] == "0.5"  # the last arm written was affine's
