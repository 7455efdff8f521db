"""`orchestrate run --budget`: an open point short of its precision target gets more rounds in the
same run, pooled into its one fragment; an A/A pair (the baseline's own path under another name)
is the comparison whose verdict stays open against a criterion at exactly 1.0."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pyarrow.compute as pc
import pytest

from orchestrator.errors import EXIT_USAGE
from orchestrator.store.dataset import read_rows
from orchestrator.store.fragments import ResultStore
from tests.conftest import child_env, until_clean

pytestmark = pytest.mark.slow

SWEEP = """
name = "topup"
repetitions = 4
warmup = 1
baseline = "affine"
precision = 0.0001   # far tighter than a CPU gives in 50 ms: every point falls short, its interval wide
max_seconds = 0.05

[[cases]]
case = "qmm"
arms = { affine = {}, "affine-again" = { path = "affine" } }
params = { tokens = 1, n = 64, k = 128, dtype = "float32" }

[[criteria]]
name = "the copy at least as fast as itself"
metric = "decode_tok_s"
arm = "affine-again"
min_ratio = 1.0      # the true ratio sits on the bound: the verdict stays open
"""


def _run(args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, cwd=cwd, capture_output=True, text=True, env=child_env(), timeout=600)


def _timed(results: Path) -> list[dict[str, object]]:
    table = read_rows(ResultStore(results), sweep="topup", newest=True)  # a contended run is measured again
    timed = table.filter(pc.and_(pc.equal(table["metric"], "seconds"), pc.greater_equal(table["sample"], 0)))
    return timed.to_pylist()


def test_budget_tops_up_the_open_point_and_pools_its_rounds(tmp_path: Path, orchestrate_bin: str) -> None:
    sweep = tmp_path / "topup.toml"
    sweep.write_text(SWEEP)
    plain = tmp_path / "plain"
    once = [orchestrate_bin, "run", "--sweep", str(sweep), "--results", str(plain)]
    last, _ = until_clean(lambda: _run(once, tmp_path))
    assert last.returncode == 4, last.stdout + last.stderr  # the criterion is AMBIGUOUS
    assert "topped up" not in last.stdout and "--budget" in last.stdout  # the shortfall says how to go on
    assert "stopped short of their precision target" in last.stdout
    first = _timed(plain)
    first_rounds = {int(dict(r["extra"])["rounds"]) for r in first}
    assert len(first_rounds) == 1

    budget = tmp_path / "budget"
    args = [orchestrate_bin, "run", "--sweep", str(sweep), "--results", str(budget), "--budget", "20s"]
    done, _ = until_clean(lambda: _run(args, tmp_path))
    assert done.returncode in (0, 4), done.stdout + done.stderr  # more rounds may settle the criterion
    assert "topped up 1 open point(s) within --budget" in done.stdout, done.stdout
    rows = _timed(budget)
    extras = [dict(r["extra"]) for r in rows]
    rounds = {int(e["rounds"]) for e in extras}
    assert len(rounds) == 1  # the old rows were brought up to date with the pooled rounds
    (n,) = rounds
    samples = {arm: sorted(int(r["sample"]) for r in rows if r["arm"] == arm) for arm in ("affine", "affine-again")}
    assert samples["affine"] == samples["affine-again"] == list(range(n))  # every round paired, numbered on
    assert n % 2 == 0 and n > max(first_rounds)  # more than one pass alone would have taken
    assert {e["stop_reason"] for e in extras} <= {"budget", "max_rounds"}
    run_ids = {r["run_id"] for r in rows}
    assert len(run_ids) == 1 and len(list(budget.rglob(f"part-{run_ids.pop()}-*.parquet"))) == 1  # rewritten whole
    copy = [e for e, r in zip(extras, rows, strict=True) if r["arm"] == "affine-again"]
    # an A/A pair (the same code under two names) has an interval: microsecond kernels on a machine the
    # test shares make it wide, not missing
    assert 0 < float(copy[0]["half_width"]) < 0.5

    check = _run([orchestrate_bin, "check", "--sweep", str(sweep), "--results", str(budget)], tmp_path)
    assert check.returncode == done.returncode, check.stdout + check.stderr
    assert "stopped short of their precision target" in check.stdout


def test_a_budget_that_is_no_duration_is_refused(tmp_path: Path, orchestrate_bin: str) -> None:
    bad = _run([orchestrate_bin, "run", "--budget", "ten minutes", "--results", str(tmp_path / "r")], tmp_path)
    assert bad.returncode == EXIT_USAGE
    assert "--budget" in bad.stderr and "not a duration" in bad.stderr and len(bad.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "r").exists()  # nothing written
