"""Acceptance criteria: the first seed's three criteria judged on intervals, missing points named,
exit codes, and the `where` language (parsed, never evaluated as Python)."""

from __future__ import annotations

import math
import re
import subprocess
from pathlib import Path
from typing import get_args

import numpy as np
import pyarrow as pa
import pytest
from pydantic import ValidationError

from orchestrator.analysis.compare import compare_results
from orchestrator.analysis.criteria import KINDS, evaluate_criteria, render_verdicts, validate_criteria
from orchestrator.analysis.stats import Verdict
from orchestrator.analysis.verdicts import Outcome, exit_code_for
from orchestrator.errors import EXIT_CONTENDED, InputError
from orchestrator.specs.sweep import Criterion, SweepSpec, load_sweep
from orchestrator.specs.where import parse_where
from orchestrator.store.dataset import read_rows
from orchestrator.store.fragments import ResultStore
from tests.conftest import child_env
from tests.orchestrator.synthetic_rows import concat, job_table, noisy

TOKENS = [1, 512, 4096, 8192]
SEED_CRITERIA = [
    {
        "name": "native prefill within 3 % of affine on long prompts",
        "metric": "prefill_tok_s",
        "arm": "native",
        "where": "tokens >= 4096",
        "min_ratio": 0.97,
    },
    {
        "name": "native decode at least 2x affine",
        "metric": "decode_tok_s",
        "arm": "native",
        "where": "tokens == 1",
        "min_ratio": 2.0,
    },
    {"name": "native peak memory below affine", "metric": "peak_memory_bytes", "arm": "native", "max_ratio": 1.0},
]


def sweep(criteria: list[dict[str, object]] | None = None) -> SweepSpec:
    return SweepSpec.model_validate(
        {
            "name": "seed1",
            "baseline": "affine",
            "cases": [{"case": "qmm", "arms": ["native", "affine"], "params": {"tokens": TOKENS, "n": 64, "k": 64}}],
            "criteria": SEED_CRITERIA if criteria is None else criteria,
        }
    )


def seed_rows(
    *,
    prefill_ratio: dict[int, float] | None = None,
    noise: float = 0.005,
    n: int = 10,
    skip: tuple[int, ...] = (),
    failed: tuple[int, ...] = (),
    seed: int = 0,
) -> pa.Table:
    """Rows like seed 1's after the fix: decode 2.6x, prefill at `prefill_ratio` of affine, memory lower."""
    rng = np.random.default_rng(seed)
    ratios = prefill_ratio or {}
    tables = []
    for tokens in TOKENS:
        if tokens in skip:
            continue
        params = {"tokens": tokens, "n": 64, "k": 64}
        if tokens == 1:
            native = {"decode_tok_s": noisy(rng, 12.8, noise, n), "peak_memory_bytes": [37.4e9]}
            affine = {"decode_tok_s": noisy(rng, 4.9, noise, n), "peak_memory_bytes": [47.8e9]}
        else:
            base = 121.7
            native = {"prefill_tok_s": noisy(rng, base * ratios.get(tokens, 0.99), noise, n)}
            affine = {"prefill_tok_s": noisy(rng, base, noise, n)}
            native["peak_memory_bytes"], affine["peak_memory_bytes"] = [37.4e9], [47.8e9]
        bad = tokens in failed
        tables.append(
            job_table(
                {"native": native, "affine": affine},
                params=params,
                status="failed" if bad else "ok",
                error="rel_error 0.4 over tolerance 0.01" if bad else None,
            )
        )
    return concat(tables)


def test_seed_criteria_pass_when_the_gap_is_closed() -> None:
    verdicts = evaluate_criteria(seed_rows(), sweep())
    assert [v.outcome for v in verdicts] == [Outcome.PASS] * 3
    prefill, decode, memory = verdicts
    assert {dict(p.point)["tokens"] for p in prefill.points} == {"4096", "8192"}  # where applied
    assert [dict(p.point)["tokens"] for p in decode.points] == ["1"]  # decode exists only at M=1
    assert 2.5 < decode.points[0].ratio.ci_low < 2.7
    assert len(memory.points) == 4 and memory.points[0].ratio.ratio == pytest.approx(37.4 / 47.8)
    assert not any(v.missing for v in verdicts)
    assert exit_code_for(verdicts) == 0


def test_a_clear_gap_fails_and_the_failing_point_is_named() -> None:
    # 7.8 % slower at 4096 (seed 1's measured gap); 512 is outside `where` and may be anything.
    verdicts = evaluate_criteria(seed_rows(prefill_ratio={512: 0.5, 4096: 0.922}), sweep())
    prefill = verdicts[0]
    assert prefill.outcome is Outcome.FAIL
    (bad,) = [p for p in prefill.points if p.outcome is Outcome.FAIL]
    assert dict(bad.point)["tokens"] == "4096"
    assert bad.ratio.ci_high < 0.97
    assert exit_code_for(verdicts) == 1
    text = render_verdicts(verdicts)
    assert "FAIL" in text and "tokens=4096" in text and "tokens=512" not in text


def test_a_gap_at_the_threshold_is_ambiguous_with_a_sample_estimate() -> None:
    rows = seed_rows(prefill_ratio={4096: 0.97, 8192: 1.1}, noise=0.02, n=5, seed=1)
    verdicts = evaluate_criteria(rows, sweep())
    prefill = verdicts[0]
    assert prefill.outcome is Outcome.AMBIGUOUS
    (amb,) = [p for p in prefill.points if p.outcome is Outcome.AMBIGUOUS]
    assert amb.ratio.ci_low < 0.97 < amb.ratio.ci_high
    # planned for the half-width that clears the bound: n x (half-width / distance)^2 x 1.5
    lo, hi, r = (math.log(x) for x in (amb.ratio.ci_low, amb.ratio.ci_high, amb.ratio.ratio))
    planned = 1.5 * 5 * ((hi - lo) / 2 / abs(r - math.log(0.97))) ** 2
    assert amb.more_samples == math.ceil(planned) - 5
    assert exit_code_for(verdicts) == 4
    assert "more samples" in render_verdicts(verdicts)


def test_an_estimate_on_the_bound_says_no_sample_count_settles_it() -> None:
    verdicts = evaluate_criteria(seed_rows(prefill_ratio={4096: 0.975, 8192: 1.1}, noise=0.02, n=6), sweep())
    (amb,) = [p for p in verdicts[0].points if p.outcome is Outcome.AMBIGUOUS]
    assert amb.ratio.ci_low < 0.97 < amb.ratio.ci_high and abs(amb.ratio.ratio / 0.97 - 1) < 0.005
    assert amb.settle is not None and amb.settle.on_edge and amb.more_samples is None
    assert "sits on the band's edge: no sample count can be planned to settle it" in render_verdicts(verdicts)


def test_compare_and_check_reach_the_same_verdict_on_the_same_rows() -> None:
    """One table, 60 points whose true gap lies between -7 % and +1 % (many near the 3 % edge),
    2 % noise, samples paired in ABBA blocks: `compare` at a 3 % band and a criterion `>= 1/1.03`
    (the band's lower edge) see one interval and one p-value per point, and SLOWER is FAIL,
    SAME or FASTER is PASS, AMBIGUOUS below is AMBIGUOUS, after multiplicity control on both sides
    (it demotes some SLOWER verdicts here, on both sides alike)."""
    rng = np.random.default_rng(32)
    tokens = [64 * (i + 1) for i in range(60)]
    gaps = rng.uniform(-0.07, 0.01, len(tokens))
    tables = []
    for t, gap in zip(tokens, gaps, strict=True):
        values = {
            "native": {"prefill_tok_s": noisy(rng, 100 * (1 + gap), 0.02, 10)},
            "affine": {"prefill_tok_s": noisy(rng, 100.0, 0.02, 10)},
        }
        tables.append(job_table(values, params={"tokens": t, "n": 64, "k": 64}))
    table = concat(tables)
    edge = 1 / 1.03
    spec = sweep([{"name": "band", "metric": "prefill_tok_s", "arm": "native", "min_ratio": edge}])
    spec.cases[0].params["tokens"] = tokens
    (verdict,) = evaluate_criteria(table, spec)
    checked = {dict(p.point)["tokens"]: p for p in verdict.points}
    compared = {
        dict(row.point)["tokens"]: row.comparisons[("prefill_tok_s", "native")]
        for row in compare_results(table, baseline="affine", threshold=0.03, metrics=["prefill_tok_s"]).rows
    }
    assert checked.keys() == compared.keys() and len(checked) == 60
    expected = {Verdict.SLOWER: Outcome.FAIL, Verdict.SAME: Outcome.PASS, Verdict.FASTER: Outcome.PASS}
    seen = set()
    for t, c in compared.items():
        p = checked[t]
        assert (p.ratio.ratio, p.ratio.ci_low, p.ratio.ci_high) == (c.ratio.ratio, c.ratio.ci_low, c.ratio.ci_high)
        if c.verdict is Verdict.AMBIGUOUS:
            want = Outcome.AMBIGUOUS if c.ratio.ci_low < edge else Outcome.PASS  # below: open; above: passes
        else:
            want = expected[c.verdict]
        assert p.outcome is want, (t, c.verdict, p.outcome, c.ratio, c.note, p.note)
        seen.add(c.verdict)
    assert {Verdict.SLOWER, Verdict.SAME, Verdict.AMBIGUOUS} <= seen  # the points really straddle the edge
    assert any(c.note and c.note.startswith("p=") for c in compared.values())  # the control was exercised


def test_missing_and_failed_points_are_named_not_passed() -> None:
    verdicts = evaluate_criteria(seed_rows(skip=(8192,), failed=(4096,)), sweep())
    prefill = verdicts[0]
    assert prefill.outcome is Outcome.AMBIGUOUS
    assert prefill.points == []
    missing = {dict(m.point)["tokens"]: m.reason for m in prefill.missing}
    assert missing["8192"] == "not run"
    assert "rel_error 0.4 over tolerance" in missing["4096"]
    text = render_verdicts(verdicts)
    assert "MISSING   cpu qmm tokens=8192: not run" in text
    # The decode criterion still passes: its only point (tokens=1) is there.
    assert verdicts[1].outcome is Outcome.PASS
    assert exit_code_for(verdicts) == 4
    # Without `where`, a point that never ran might have measured decode: it is named too, while
    # the points that ran cleanly without a decode metric are not.
    loose = {**SEED_CRITERIA[1], "where": None}
    (decode,) = evaluate_criteria(seed_rows(skip=(8192,), failed=(4096,)), sweep([loose]))
    assert decode.outcome is Outcome.AMBIGUOUS
    assert sorted(dict(m.point)["tokens"] for m in decode.missing) == ["4096", "8192"]


def test_a_decode_point_missing_is_named() -> None:
    verdicts = evaluate_criteria(seed_rows(skip=(1,)), sweep())
    decode = verdicts[1]
    assert decode.outcome is Outcome.AMBIGUOUS
    assert [dict(m.point)["tokens"] for m in decode.missing] == ["1"]


def test_contended_rows_do_not_count() -> None:
    rows = seed_rows(skip=(8192,))
    contended = job_table(
        {"native": {"prefill_tok_s": [120.0] * 5}, "affine": {"prefill_tok_s": [121.0] * 5}},
        params={"tokens": 8192, "n": 64, "k": 64},
        contended=True,
    )
    verdict = evaluate_criteria(concat([rows, contended]), sweep())[0]
    assert verdict.outcome is Outcome.AMBIGUOUS
    assert [m.reason for m in verdict.missing] == ["native contended; affine contended"]


def test_criteria_that_fit_no_case_are_input_errors() -> None:
    bad_where = [
        {"name": "x", "metric": "prefill_tok_s", "arm": "native", "where": "prompt_tokens > 1", "min_ratio": 1}
    ]
    # refused when the sweep is loaded (orchestrator.specs.checks), before any row is read
    with pytest.raises(ValidationError, match=r"criteria\.0 \('x'\).*'prompt_tokens', not a parameter"):
        sweep(bad_where)
    bad_arm = [{"name": "y", "metric": "prefill_tok_s", "arm": "dense", "min_ratio": 1}]
    with pytest.raises(ValidationError, match=r"criteria\.0 \('y'\): arm 'dense' is not an arm of any case"):
        sweep(bad_arm)


def test_exit_codes() -> None:
    assert exit_code_for([]) == 0


@pytest.mark.parametrize(
    ("text", "point", "expected"),
    [
        ("prompt_tokens >= 4096", {"prompt_tokens": "4096"}, True),
        ("prompt_tokens >= 4096", {"prompt_tokens": "2048"}, False),
        ("tokens > 1 and dtype == bfloat16", {"tokens": "512", "dtype": "bfloat16"}, True),
        ("tokens > 1 and dtype == 'float32'", {"tokens": "512", "dtype": "bfloat16"}, False),
        ("n != 64", {"n": "64"}, False),
        ("tokens<=1", {"tokens": "1"}, True),
        ("", {"tokens": "1"}, True),
        ("experts == 128", {"tokens": "1"}, False),
    ],
)
def test_where_language(text: str, point: dict[str, str], expected: bool) -> None:
    assert parse_where(text).matches(point) is expected


@pytest.mark.parametrize(
    "text",
    ["tokens >=", "tokens = 3", "__import__('os').system('true') == 0", "a > 1 or b < 2", "a > 1 and", "> 3"],
)
def test_where_rejects_anything_else(text: str) -> None:
    with pytest.raises(InputError, match="where"):
        parse_where(text)


def test_builtin_sweep_carries_the_first_seeds_criteria() -> None:
    spec = load_sweep("nvfp4-prefill")
    by_metric = {c.metric: c for c in spec.criteria if c.arm == "native"}
    assert by_metric["prefill_tok_s"].min_ratio == 0.97 and by_metric["prefill_tok_s"].where == "tokens >= 4096"
    assert by_metric["decode_tok_s"].min_ratio == 2.0
    assert by_metric["peak_memory_bytes"].max_ratio == 1.0
    # the same questions asked of our kernels (issue 20), against the same baseline
    assert {c.arm for c in spec.criteria} == {"native", "custom"} and spec.baseline == "affine"


E2E_SWEEP = """
name = "criteria-e2e"
repetitions = 5
warmup = 1
baseline = "affine"

[[cases]]
case = "qmm"
arms = ["native", "affine"]
params = { tokens = [1, 16], n = 64, k = 128, dtype = "float32" }

[[criteria]]
name = "native time within 1000x of affine"
metric = "seconds"
arm = "native"
max_ratio = 1000.0

[[criteria]]
name = "native prefill 1000x affine"
metric = "prefill_tok_s"
arm = "native"
where = "tokens >= 16"
min_ratio = 1000.0
"""


@pytest.mark.slow
def test_run_ends_with_the_criteria_and_their_exit_code(tmp_path: Path, orchestrate_bin: str) -> None:
    """`orchestrate run` on real MLX through embedded Ray ends with the verdicts and their exit code;
    `orchestrate check` and `orchestrate report` agree on the stored rows.

    Clean rows: the time criterion passes and the 1000x prefill criterion fails -> exit 1. A job
    the contention monitor flagged (other processes busy on this CPU) must instead be named as
    missing and make its criteria AMBIGUOUS -> exit 4, never pass.
    """
    sweep_file = tmp_path / "criteria-e2e.toml"
    sweep_file.write_text(E2E_SWEEP)
    results = tmp_path / "results"
    env = child_env()
    env.pop("RAY_AUTH_TOKEN_PATH", None)  # Ray keeps its token under the test's HOME instead

    def orchestrate(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([orchestrate_bin, *args], capture_output=True, text=True, env=env, timeout=600)

    run = orchestrate("run", "--sweep", str(sweep_file), "--results", str(results))
    ran = re.search(r"2 jobs ran \(0 failed(?:, ([12]) contended)?\)", run.stdout)
    assert ran, run.stdout + run.stderr
    table = read_rows(ResultStore(results), sweep="criteria-e2e")
    # the points the criteria miss: an arm with no clean timed sample there (a job retried after a
    # contended attempt keeps both attempts' rows; only a point with nothing clean is missing)
    clean = {
        (int(t), a)
        for t, a, c, n in zip(
            table["tokens"].to_pylist(), table["arm"].to_pylist(), table["contended"].to_pylist(),
            table["sample"].to_pylist(), strict=True,
        )
        if not c and n is not None and n >= 0
    }  # fmt: skip
    contended = {t for t in (1, 16) if not {(t, "native"), (t, "affine")} <= clean}
    time_line = re.search(
        r"^(\w+) +native time within 1000x of affine: seconds native/affine <= 1000", run.stdout, re.M
    )
    prefill_line = re.search(
        r"^(\w+) +native prefill 1000x affine: prefill_tok_s native/affine >= 1000", run.stdout, re.M
    )
    assert time_line and prefill_line, run.stdout
    assert time_line.group(1) == ("AMBIGUOUS" if contended else "PASS")
    assert prefill_line.group(1) == ("AMBIGUOUS" if 16 in contended else "FAIL")
    for tokens in contended:
        assert re.search(rf"^ +MISSING +cpu qmm tokens={tokens}: .*contended", run.stdout, re.M), run.stdout
    expected_code = 4 if 16 in contended else 1
    # `run` says first that jobs are left unmeasured (5: run it again); `check` judges what is stored
    want = EXIT_CONTENDED if ran.group(1) else expected_code
    assert run.returncode == want, run.stdout + run.stderr

    check = orchestrate("check", "--sweep", str(sweep_file), "--results", str(results))
    assert check.returncode == expected_code, check.stdout + check.stderr
    assert check.stdout.splitlines()[0].startswith(time_line.group(1))

    html_file = tmp_path / "report.html"
    report = orchestrate("report", "--html", str(html_file), "--sweep", str(sweep_file), "--results", str(results))
    assert report.returncode == 0, report.stderr
    doc = html_file.read_text()
    if contended == {1, 16}:  # every job was flagged: nothing clean to plot, and the report says so
        assert "No clean samples" in doc
    else:  # cpu: the criteria's headline chart, metrics and gap, and the rates against the measured peaks
        assert doc.count('<svg class="chart"') == 4
    verdict = prefill_line.group(1)
    assert f'<td class="verdict {verdict}">{verdict}</td><td class="">native prefill 1000x affine' in doc


def test_bad_where_is_refused_when_the_sweep_is_loaded(tmp_path: Path) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(E2E_SWEEP.replace('where = "tokens >= 16"', 'where = "tokens => 16"'))
    with pytest.raises(InputError, match=r"bad\.toml: field criteria\.1\.where: "):
        load_sweep(str(path))


def test_a_criterion_no_case_can_answer_is_refused_before_running() -> None:
    with pytest.raises(ValidationError, match=r"criteria\.0 \('z'\): arm 'custom' is not an arm of any case"):
        sweep([{"name": "z", "metric": "prefill_tok_s", "arm": "custom", "min_ratio": 1}])
    validate_criteria(sweep())  # the seed's criteria fit


def test_every_criterion_kind_a_sweep_may_name_is_registered() -> None:
    """`Criterion.kind`'s values and the registry's kinds are the same set: a kind added to the
    sweep format without a judge (or a judge no sweep can name) fails here."""
    assert set(get_args(Criterion.model_fields["kind"].annotation)) == set(KINDS)
