"""Regression detection over the history, fed by real command-case runs over successive commits."""

from __future__ import annotations

import datetime as dt
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import scipy.stats as ss

from orchestrator.analysis import changepoints
from orchestrator.analysis.history import (
    ENVIRONMENT_CHANGE,
    IMPROVEMENT,
    NO_HISTORY,
    RATIO_UNIT,
    REGRESSION,
    STEADY,
    RunPoint,
    SeriesKey,
    detect,
    findings_for_run,
    regressions,
    report_markdown,
    series_of,
    unjudged,
)
from orchestrator.analysis.trends import trends
from orchestrator.commands.history import history_records
from orchestrator.store.dataset import read_rows
from orchestrator.store.fragments import ResultStore
from tests.orchestrator.bench_repo import bench_script, git
from tests.orchestrator.synthetic_rows import concat, job_table, noisy
from workers.command.job import run_command_job
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
    speeds = [100.0] * 7 + [80.0] * 3
    commits: dict[str, str] = {}
    for night, speed in enumerate(speeds):
        (repo / "speed.txt").write_text(f"{speed}\n")
        (repo / "NEWS").write_text(f"night {night}\n")  # every night a new commit, speed changed or not
        git(repo, "add", "-A")
        git(repo, "commit", "-q", "-m", f"night {night}")
        run_id = f"202611{night + 10:02d}T020000Z"
        commits[run_id] = git(repo, "rev-parse", "HEAD")
        nightly(store, repo, tmp_path, run_id)
        if night < 4:  # another host, much slower: a series of its own, never a baseline for fp-a
            nightly(store, repo, tmp_path, run_id, fid="fp-slow-host")

    table = read_rows(store, sweep="nightly")
    flagged = {}
    for run_id in commits:
        for f in regressions(findings_for_run(table, run_id)):
            flagged[(run_id, f.series.host, f.series.metric)] = f
    slow_run = "20261117T020000Z"
    assert set(flagged) == {(slow_run, "fp-a", "decode_tok_s")}  # once, at the step, not on later nights
    finding = flagged[(slow_run, "fp-a", "decode_tok_s")]
    assert finding.since_commit == commits[slow_run] and finding.since_run == slow_run
    assert finding.ratio == pytest.approx(0.8, abs=0.03)
    assert finding.ci_high < 0.95
    assert finding.baseline_runs == tuple(sorted(commits)[:7])
    # the series of the other host stayed its own
    series = series_of(table, metric="decode_tok_s")
    assert {k.host: len(v) for k, v in series.items()} == {"fp-a": 10, "fp-slow-host": 4}
    assert unjudged(table, slow_run) == []
    nightly(store, repo, tmp_path, "20261120T020000Z", contended=True)  # a foreign GPU user was seen
    table = read_rows(store, sweep="nightly")
    assert findings_for_run(table, "20261120T020000Z") == []
    assert unjudged(table, "20261120T020000Z") == ["cpu engine native prompt_tokens=512 decode_tok_s"]
    report = report_markdown("nightly", slow_run, findings_for_run(table, slow_run))
    assert f"| regression | cpu | fp-a | engine | native | prompt_tokens=512 | decode_tok_s | {slow_run} (" in report
    assert commits[slow_run][:12] in report


KEY = SeriesKey("cpu", "host", "engine", "native", "", "decode_tok_s", "tok/s")
T0 = dt.datetime(2026, 11, 1, 2, tzinfo=dt.UTC)


def points(
    medians: list[float], wobble: float = 0.005, environments: list[dict[str, str]] | None = None
) -> list[RunPoint]:
    """Runs of 5 samples around each median (+-wobble)."""
    return [
        RunPoint(
            f"r{i:02d}",
            T0 + dt.timedelta(days=i),
            f"c{i}",
            [m * (1 + wobble * s) for s in (-1, -0.5, 0, 0.5, 1)],
            environments[i] if environments else {},
        )
        for i, m in enumerate(medians)
    ]


def verdicts(medians: list[float], **kw: Any) -> list[str]:
    return [f.verdict for f in detect(KEY, points(medians), **kw)]


def night_medians(
    rng: np.random.Generator, nights: int, noise: float, level: np.ndarray | None = None
) -> tuple[list[float], list[float]]:
    """Log medians of `nights` nights: night-to-night noise plus a 2 % within-night noise over 10 samples."""
    within = 0.02 * 1.25 / np.sqrt(10)
    base = np.zeros(nights) if level is None else level
    return list(base + noise * rng.standard_normal(nights) + within * rng.standard_normal(nights)), [within] * nights


SERIES = 1000


def _calls(y: list[float], se: list[float]) -> list[changepoints.Call]:
    return changepoints.judge_series(y, se)


@pytest.mark.parametrize(("noise", "limit"), [(0.03, 0.05), (0.02, 0.05)])
def test_thirty_stable_nights_raise_no_alarm_in_95_percent_of_series(noise: float, limit: float) -> None:
    """At 3 % night-to-night noise, P(any regression or improvement in 30 stable nights) <= 5 %
    (an interval of the ratio of medians against a few earlier runs alarms on 46-94 % of them)."""
    rng = np.random.default_rng(30)
    alarmed = sum(
        any(c.kind == changepoints.CHANGE for c in _calls(*night_medians(rng, 30, noise))) for _ in range(SERIES)
    )
    assert alarmed / SERIES <= limit, alarmed / SERIES


@pytest.mark.parametrize(("history", "nights", "rate"), [(60, 2, 0.9), (30, 3, 0.9)])
def test_a_ten_percent_step_is_found_within_two_nights(history: int, nights: int, rate: float) -> None:
    """After two months of nightly history, a 10 % step at 3 % noise is flagged on its first or
    second night >= 90 % of the time; after 30 nights of history, by its third night."""
    rng = np.random.default_rng(history)
    found = 0
    for _ in range(SERIES):
        level = np.zeros(history + 3)
        level[history:] = np.log(0.9)
        calls = _calls(*night_medians(rng, history + 3, 0.03, level))
        found += any(c.kind == changepoints.CHANGE and c.shift < 0 for c in calls[history : history + nights])
    assert found / SERIES >= rate, found / SERIES


def test_one_bad_night_that_returns_raises_at_most_one_note() -> None:
    """One night 20 % slower, then back: at most one call (today: a regression and an improvement
    in 198 of 200 series)."""
    rng = np.random.default_rng(20)
    clean = 0
    for _ in range(SERIES):
        level = np.zeros(30)
        level[20] = np.log(0.8)
        calls = _calls(*night_medians(rng, 30, 0.03, level))
        clean += sum(c.kind == changepoints.CHANGE for c in calls[20:]) <= 1
    assert clean / SERIES >= 0.95, clean / SERIES


def test_a_bimodal_series_does_not_alarm_every_few_nights() -> None:
    """30 % of nights 6 % slower (two clock states): a call in under 15 % of 30-night stretches."""
    rng = np.random.default_rng(6)
    stretches = calls = 0
    for _ in range(SERIES):
        level = np.where(rng.random(30) < 0.3, np.log(0.94), 0.0)
        n = sum(c.kind == changepoints.CHANGE for c in _calls(*night_medians(rng, 30, 0.01, level)))
        stretches += n > 0
        calls += n
    assert stretches / SERIES <= 0.15 and calls / SERIES <= 0.3, (stretches / SERIES, calls / SERIES)


@pytest.mark.parametrize("df", [6, 8, 13, 30, 59])
@pytest.mark.parametrize("p", [0.975, 0.99925, 0.99985])
def test_the_t_quantile_matches_scipy(df: int, p: float) -> None:
    assert changepoints.t_quantile(p, df) == pytest.approx(ss.t.ppf(p, df), rel=0.01)


def test_a_step_is_flagged_once_and_the_new_level_becomes_the_baseline() -> None:
    got = verdicts([100, 101, 99, 100, 100.5, 99.5, 100, 100.2, 99.8, 80, 80, 80.4, 79.6, 80, 80])
    assert got[:7] == [NO_HISTORY] * 7 and got[7:9] == [STEADY, STEADY]
    assert got[9] == REGRESSION and got[10:] == [STEADY] * 5
    up = verdicts([100, 101, 99, 100, 100.5, 99.5, 100, 100.2, 99.8, 120, 120, 120])
    assert up[9] == IMPROVEMENT and up[10:] == [STEADY, STEADY]


def test_noisy_history_needs_a_bigger_step() -> None:
    quiet = [100, 100.5, 99.5, 100, 100.2, 99.8, 100.1, 100.3, 93]
    noisy = [100, 104, 96, 103, 97, 104, 96, 102, 93]
    assert verdicts(quiet)[-1] == REGRESSION
    assert REGRESSION not in verdicts(noisy)  # 7 % is inside this series' night-to-night noise
    f = detect(KEY, points(noisy))[-1]
    assert f.tolerance > 0.07 and f.ci_low < 0.93 < f.ci_high


def test_times_regress_upwards_and_small_changes_are_steady() -> None:
    key = SeriesKey("cpu", "host", "engine", "native", "", "load_seconds", "seconds")
    base = [10, 10.1, 9.9, 10, 10.05, 9.95, 10, 10.02]
    assert detect(key, points([*base, 13, 13]))[-2].verdict == REGRESSION  # slower load
    assert detect(key, points([*base, 7, 7]))[-2].verdict == IMPROVEMENT
    assert detect(key, points([*base, 10.2]))[-1].verdict == STEADY  # 2 % < 5 % threshold


def test_an_environment_change_is_reported_as_such_and_the_series_goes_on() -> None:
    """The GPU driver moves from 580 to 590 and the series drops 7 %: an environment finding with
    its ratio and interval, no regression blamed on the night's commit, no silent restart."""
    env = [{"gpu_driver": "580.65", "mlx_version": "0.32.4"}] * 10 + [
        {"gpu_driver": "590.12", "mlx_version": "0.32.4"}
    ] * 6
    medians = [100, 101, 99, 100.5, 99.5, 100, 101, 99, 100, 100.3, 93, 93.5, 92.5, 93, 93.2, 92.8]
    findings = detect(KEY, points(medians, environments=env))
    assert [f.verdict for f in findings[10:]] == [ENVIRONMENT_CHANGE] + [STEADY] * 5
    f = findings[10]
    assert f.environment == "driver 580.65 -> 590.12" and f.ratio == pytest.approx(0.93, abs=0.01)
    assert f.ci_low < 0.93 < f.ci_high < 0.97
    assert f.describe().startswith("driver 580.65 -> 590.12: ratio 0.93 [")
    assert REGRESSION not in {x.verdict for x in findings}
    report = report_markdown("nightly", f.run_id, [f])
    assert "| environment |" in report and "not blamed on a commit" in report
    # the same drop without a change of environment is a regression of that night's commit
    plain = detect(KEY, points(medians))
    assert plain[10].verdict == REGRESSION and plain[10].since_commit == "c10"


def ratio_nights(
    rng: np.random.Generator, nights: int, noise: float, step_at: int | None = None, step: float = 0.0
) -> list[RunPoint]:
    """Nights of a ratio series: 10 block ratios a night (0.5 % within the night) around a level
    that moves `noise` from night to night, `step` lower from night `step_at` on."""
    out = []
    for i in range(nights):
        level = math.exp(noise * rng.standard_normal()) * (1 - step if step_at is not None and i >= step_at else 1)
        values = list(level * np.exp(0.005 * rng.standard_normal(10)))
        out.append(RunPoint(f"r{i:03d}", T0 + dt.timedelta(days=i), f"c{i}", values, {}))
    return out


RATIO_KEY = SeriesKey("cuda", "host", "qmm", "native/affine", "tokens=512", "prefill_tok_s", RATIO_UNIT)
NIGHT_SERIES = 1000


def test_a_three_percent_step_at_one_percent_noise_is_found_within_three_nights() -> None:
    """Through `detect` (what the nightly run and `orchestrate history` call): after 60 nights at
    1 % night-to-night noise, a 3 % step is flagged on its first, second or third night >= 90 %
    of the time (at the old 5 % threshold: 7-10 %)."""
    rng = np.random.default_rng(3)
    found = 0
    for _ in range(NIGHT_SERIES):
        findings = detect(RATIO_KEY, ratio_nights(rng, 63, 0.01, step_at=60, step=0.03))
        found += any(f.verdict == REGRESSION for f in findings[60:])
    assert found / NIGHT_SERIES >= 0.9, found / NIGHT_SERIES


def test_sixty_stable_nights_at_one_percent_noise_are_rarely_flagged() -> None:
    """The other side of the 3 % threshold: at most 6 % of stable 60-night series get any call."""
    rng = np.random.default_rng(60)
    flagged = sum(
        any(f.verdict in (REGRESSION, IMPROVEMENT) for f in detect(RATIO_KEY, ratio_nights(rng, 60, 0.01)))
        for _ in range(NIGHT_SERIES)
    )
    assert flagged / NIGHT_SERIES <= 0.06, flagged / NIGHT_SERIES


def test_the_ratio_to_the_baseline_arm_sees_a_step_that_the_board_clock_hides() -> None:
    """Both arms move together by 4 % from night to night (the board's clock); native's own speed
    drops 3 % at night 40. Its own series cannot tell that from the clock; its ratio to affine
    (ABBA blocks of one job, the clock cancelled) flags the night it happened, and
    `orchestrate history` lists the ratio series beside the arms' own."""
    rng = np.random.default_rng(41)
    tables = []
    for night in range(44):
        clock = math.exp(0.04 * rng.standard_normal())
        native = 100 * clock * (0.97 if night >= 40 else 1.0)
        values = {
            "native": {"prefill_tok_s": noisy(rng, native * math.exp(0.01 * rng.standard_normal()), 0.01, 10)},
            "affine": {"prefill_tok_s": noisy(rng, 100 * clock, 0.01, 10)},
        }
        started = T0 + dt.timedelta(days=night)
        tables.append(job_table(values, params={"tokens": 512}, run_id=f"r{night:02d}", started_at=started))
    table = concat(tables)
    by_arm = {t.series.arm: t for t in trends(table, "qmm", "prefill_tok_s")}
    assert set(by_arm) == {"native", "affine", "native/affine"}
    ratio = by_arm["native/affine"]
    assert ratio.series.unit == RATIO_UNIT and len(ratio.points) == 44
    assert ratio.points[0].median == pytest.approx(1.0, abs=0.03) and len(ratio.points[0].values) == 5  # blocks
    (step,) = ratio.changes
    assert step.verdict == REGRESSION and step.since_run == "r40" and step.run_id in ("r40", "r41", "r42")
    assert step.ratio == pytest.approx(0.97, abs=0.015)
    assert not by_arm["native"].changes  # 3 % inside the clock's 4 % scatter
    # the nightly run judges the ratio series with the arms' own
    assert {f.series.arm for f in findings_for_run(table, step.run_id)} == set(by_arm)
    shown = history_records([ratio])
    assert set(shown["arm"].to_pylist()) == {"native/affine"} and set(shown["unit"].to_pylist()) == {"x"}
