"""A command that fails because its commit is older than what the sweep names: one line naming the
commit and the option or target it lacks (`workers/command/predates.py`), in the gate and in the
timed run; and the facts a benchmark reports about itself (bench_decode.sh's commits) in each row."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.engine_repo import guard_script
from tests.workers.test_command import run
from tests.workers.test_command_job import Repo, first_error, job
from workers.command.predates import explain

# `cargo test --test NAME` where the target does not exist at the commit: cargo's own complaint
CARGO_NO_TARGET = """#!/usr/bin/env bash
echo "error: no test target named \\`$2\\` in default-run packages" >&2
echo "help: available test targets:" >&2
echo "    dead_doc_pointers" >&2
exit 101
"""


@pytest.fixture
def old(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Repo:
    """An engine whose guard predates `--hold` and whose tests lack `rocm_nvfp4_quant`."""
    monkeypatch.setenv("ORDER_LOG", str(tmp_path / "order.log"))
    monkeypatch.setenv("ROCM_GPU_GUARD_LOCK", str(tmp_path / "guard.lock"))
    repo = Repo(tmp_path / "engine")
    for name, text in {"guard.sh": guard_script(hold=False), "cargo-test.sh": CARGO_NO_TARGET}.items():
        (repo.path / name).write_text(text)
        (repo.path / name).chmod(0o755)
    return repo


def test_gate_with_an_option_the_commits_guard_does_not_know(old: Repo, tmp_path: Path) -> None:
    commit = old.commit(100.0)
    status, rows = run(job(old, tmp_path, gate="./guard.sh --hold -- ./gate.sh"))
    assert status == "failed"
    errors = {r["error"] for r in rows if r["metric"] == "gate_seconds"}
    assert errors == {
        f"guard.sh at {commit[:8]} does not know --hold (this commit predates it): "
        "pick a newer ref or drop --hold from the sweep's build/gate/run"
    }
    assert not (tmp_path / "order.log").exists()  # nothing was timed


def test_gate_naming_a_test_target_the_commit_lacks(old: Repo, tmp_path: Path) -> None:
    commit = old.commit(100.0)
    status, rows = run(job(old, tmp_path, gate="./cargo-test.sh --test rocm_nvfp4_quant"))
    assert status == "failed"
    assert first_error(rows) == (
        f"cargo target `--test rocm_nvfp4_quant` does not exist at {commit[:8]} (this commit predates it): "
        "pick a newer ref or drop `--test rocm_nvfp4_quant` from the sweep's build/gate/run"
    )


def test_timed_run_with_an_option_the_commits_guard_does_not_know(old: Repo, tmp_path: Path) -> None:
    commit = old.commit(100.0)
    status, rows = run(job(old, tmp_path, run="./guard.sh --hold -- ./bench.sh {arm}"))
    assert status == "failed"
    failed = {r["error"] for r in rows if r["status"] == "failed"}
    assert failed == {f"run 0: guard.sh at {commit[:8]} does not know --hold (this commit predates it): "
                      "pick a newer ref or drop --hold from the sweep's build/gate/run"}  # fmt: skip


def test_an_option_the_script_knows_is_not_explained_away(tmp_path: Path) -> None:
    (tmp_path / "guard.sh").write_text(guard_script(hold=True))
    said = "rocm_gpu_guard: unknown option --hold\n"
    assert explain(said, "./guard.sh --hold -- x", tmp_path, "1a2b3c4d5e") is None  # it knows --hold
    assert explain(said, "./other.sh --hold", tmp_path, "1a2b3c4d5e") == (
        "other.sh at 1a2b3c4d does not know --hold (this commit predates it): "
        "pick a newer ref or drop --hold from the sweep's build/gate/run"
    )
    assert explain(said, "./guard.sh -- cargo test --hold", tmp_path, "1a2b3c4d") is None  # not the script's
    assert explain("error: something else\n", "./guard.sh --hold", tmp_path, "1a2b3c4d") is None


def test_bench_decode_rows_carry_the_engines_versions_and_commits(old: Repo, tmp_path: Path) -> None:
    commit = old.commit(100.0)
    header = (
        "model,model_path,prompt_tokens,generated_tokens,prefill_ms,prefill_tok_s,decode_ms,decode_tok_s,date,"
        "hardware,mlxcel_version,build_type,max_tokens,prompt,prompt_target_len,mlxcel_commit,mlx_commit,"
        "mlx_rocm_overlay_commit,hip_version"
    )
    row = (
        'm,/m,512,128,100.0,5120.0,2000.0,64.0,d,h,0.7.0,release,128,\\"x\\",512,2fcdbe5f,81ba1c6a,75915908,7.15.26333'
    )
    status, rows = run(job(old, tmp_path, run=f'echo "{header}"; echo "{row}"', parse="bench-decode-csv"))
    assert status == "ok", first_error(rows)
    measured = [r for r in rows if r["metric"] == "decode_tok_s"]
    assert [r["value"] for r in measured] == [64.0] * 4
    for r in measured:
        extra = dict(r["extra"])
        assert {k: extra[k] for k in ("mlxcel_version", "mlxcel_commit", "mlx_commit")} == {
            "mlxcel_version": "0.7.0", "mlxcel_commit": "2fcdbe5f", "mlx_commit": "81ba1c6a"}  # fmt: skip
        assert (extra["mlx_rocm_overlay_commit"], extra["hip_version"], extra["model"]) == (
            "75915908",
            "7.15.26333",
            "m",
        )
        assert extra["ref"] == "main" and r["commit"] == commit  # the job's own facts stay beside them
