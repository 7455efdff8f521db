"""Regression detection over the history, fed by real command-case runs over successive commits."""

from __future__ import annotations

import datetime as dt
import math
from pathlib import Path
from typing import Any

import pytest

from orchestrator.history import (
    IMPROVEMENT,
    NO_HISTORY,
    REGRESSION,
    STEADY,
    RunPoint,
    SeriesKey,
    detect,
    findings_for_run,
    judge,
    regressions,
    report_markdown,
    series_of,
    unjudged,
)
from orchestrator.store import ResultStore
from tests.orchestrator.bench_repo import bench_script, git
from workers.command_job import run_command_job
from workers.contract import HostFingerprint, JobContext, JobSpec, RowBuilder

# A benchmark whose speed is in speed.txt, with a deterministic +-2 % wobble from a call counter.
BENCH = bench_script(0.02)


def fingerprint(fid: str) -> HostFingerprint:
    """A fixed fingerprint per simulated host (this test is about history, not fingerprinting)."""
    return HostFingerprint(
        hostname=fid, os="Linux", machine="x86_64", cpu="cpu", cpu_count=2, memory_bytes=2**34,
        mlx_version="0.32.4", mlx_device="Device(cpu, 0)", backend="cpu", threads=2, fingerprint_id=fid,
    )  # fmt: skip


def nightly(
    store: ResultStore, repo: Path, tmp_path: Path, run_id: str, fid: str = "fp-a", contended: bool = False
) -> None:
    """One scheduled run of the command case at `main`, stored like the head stores it."""
    job = JobSpec(
        run_id=run_id, sweep="nightly", job_key=f"k-{run_id}-{fid}", case="command", case_name="engine",
        params={"prompt_tokens": 512}, arms=["native"], device="cpu", repetitions=3, warmup=0,
        options={"repo": str(repo), "ref": "main", "run": "./bench.sh", "parse": "engine-bench",
                 "cache_dir": str(tmp_path / "cache"), "timeout": 20},
    )  # fmt: skip
    context = JobContext(started_at=dt.datetime.now(dt.UTC), contended=contended)
    rows = RowBuilder(job, fingerprint(fid), context)
    status = run_command_job(job, rows, context)
    assert status == "ok", rows.rows[-1]["error"]
    rows.apply_contention([(float("-inf"), float("inf"))] if contended else [])  # a foreign user all along
    store.write(rows.table(status), sweep="nightly", date=dt.date.today(), device="cpu", run_id=run_id,
                job_key=job.job_key)  # fmt: skip


def test_nightly_runs_flag_exactly_the_commit_that_slowed_down(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COUNTER", str(tmp_path / "counter"))
    repo = tmp_path / "engine"
    repo.mkdir()
    git(repo, "init", "-q", "-b", "main")
    (repo / "bench.sh").write_text(BENCH)
    (repo / "bench.sh").chmod(0o755)
    store = ResultStore(tmp_path / "results")
    speeds = [100.0, 100.0, 100.0, 100.0, 80.0, 80.0, 80.0, 80.0]
    commits: dict[str, str] = {}
    for night, speed in enumerate(speeds):
        (repo / "speed.txt").write_text(f"{speed}\n")
        (repo / "NEWS").write_text(f"night {night}\n")  # every night a new commit, speed changed or not
        git(repo, "add", "-A")
        git(repo, "commit", "-q", "-m", f"night {night}")
        run_id = f"2026113{night}T020000Z"
        commits[run_id] = git(repo, "rev-parse", "HEAD")
        nightly(store, repo, tmp_path, run_id)
        if night < 4:  # another host, much slower: another fingerprint, never a baseline for fp-a
            nightly(store, repo, tmp_path, run_id, fid="fp-slow-host")

    table = store.read(sweep="nightly")
    flagged = {}
    for run_id in commits:
        for f in regressions(findings_for_run(table, run_id)):
            flagged[(run_id, f.series.fingerprint_id, f.series.metric)] = f
    slow_run = "20261134T020000Z"
    assert set(flagged) == {(slow_run, "fp-a", "decode_tok_s")}
    finding = flagged[(slow_run, "fp-a", "decode_tok_s")]
    assert finding.commit == commits[slow_run]
    assert finding.ratio == pytest.approx(0.8, abs=0.03)
    assert finding.ci_high < 1
    assert finding.baseline_runs == tuple(sorted(commits)[:4])
    # the series of the other host stayed its own
    series = series_of(table, metric="decode_tok_s")
    assert {k.fingerprint_id: len(v) for k, v in series.items()} == {"fp-a": 8, "fp-slow-host": 4}
    assert unjudged(table, slow_run) == []
    nightly(store, repo, tmp_path, "20261138T020000Z", contended=True)  # a foreign GPU user was seen
    table = store.read(sweep="nightly")
    assert findings_for_run(table, "20261138T020000Z") == []
    assert unjudged(table, "20261138T020000Z") == ["cpu engine native prompt_tokens=512 decode_tok_s"]
    report = report_markdown("nightly", slow_run, findings_for_run(table, slow_run))
    assert (
        f"| regression | cpu | engine | native | prompt_tokens=512 | decode_tok_s | {commits[slow_run][:12]} |"
        in report
    )


KEY = SeriesKey("cpu", "fp", "engine", "native", "", "decode_tok_s", "tok/s")
T0 = dt.datetime(2026, 11, 1, 2, tzinfo=dt.UTC)


def points(medians: list[float], wobble: float = 0.005) -> list[RunPoint]:
    """Runs of 5 samples around each median (+-wobble)."""
    return [
        RunPoint(f"r{i:02d}", T0 + dt.timedelta(days=i), f"c{i}", [m * (1 + wobble * s) for s in (-1, -0.5, 0, 0.5, 1)])
        for i, m in enumerate(medians)
    ]


def verdicts(medians: list[float], **kw: Any) -> list[str]:
    return [f.verdict for f in detect(KEY, points(medians), **kw)]


def test_step_is_flagged_once_and_the_new_level_becomes_the_baseline() -> None:
    assert verdicts([100, 100, 100, 100, 120, 120, 120]) == [NO_HISTORY, STEADY, STEADY, STEADY, IMPROVEMENT,
                                                             STEADY, STEADY]  # fmt: skip
    assert verdicts([100, 100, 90, 90, 90, 100]) == [NO_HISTORY, STEADY, REGRESSION, STEADY, STEADY, IMPROVEMENT]


def test_noisy_history_needs_a_bigger_step() -> None:
    quiet = [100, 100.5, 99.5, 100, 100.2, 94]
    noisy = [100, 104, 96, 103, 97, 94]
    assert verdicts(quiet)[-1] == REGRESSION
    assert REGRESSION not in verdicts(noisy)  # 6 % is within 3x the night-to-night noise
    f = detect(KEY, points(noisy))[-1]
    assert f.tolerance == pytest.approx(3 * 1.4826 * 3 / 100, rel=0.01)
    assert verdicts([*noisy, 80])[-1] == REGRESSION


def test_times_regress_upwards_and_small_changes_are_steady() -> None:
    key = SeriesKey("cpu", "fp", "engine", "native", "", "load_seconds", "seconds")
    base = points([10, 10, 10])
    assert judge(key, points([12])[0], base).verdict == REGRESSION  # slower load
    assert judge(key, points([8])[0], base).verdict == IMPROVEMENT
    assert judge(key, points([10.2])[0], base).verdict == STEADY  # 2 % < 5 % threshold
    assert math.isnan(judge(key, points([10])[0], []).ratio)
