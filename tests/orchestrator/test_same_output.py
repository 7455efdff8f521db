"""The same-output criterion on rows made through the real RowBuilder: arms and commits of a
command case, each run's greedy-output digest in `extra`, as `workers.command.job` writes them."""

from __future__ import annotations

import datetime as dt
import hashlib
from typing import Any

import pyarrow as pa
import pytest
from pydantic import ValidationError

from orchestrator.analysis.criteria import describe, evaluate_criteria, validate_criteria
from orchestrator.analysis.verdicts import Outcome, exit_code_for
from orchestrator.commands.check import check_records
from orchestrator.report.html import build_report
from orchestrator.report.tables import applies, criteria_table, device_verdict, overview_table
from orchestrator.specs.sweep import SweepSpec
from tests.orchestrator.synthetic_rows import concat, fingerprint
from workers.contract import JobContext, JobSpec, RowBuilder

ARMS = ["opt-out", "default", "other"]
BASE, HEAD = ("base", "b" * 40), ("head", "c" * 40)


def sweep(*criteria: dict[str, Any], arms: list[str] = ARMS, lengths: list[int] | None = None) -> SweepSpec:
    case = {
        "case": "command", "name": "greedy", "repo": "../engine", "run": "./gen {prompt_tokens}",
        "arms": {a: {} for a in arms}, "params": {"prompt_tokens": lengths or [512]},
    }  # fmt: skip
    return SweepSpec.model_validate({"name": "s", "baseline": "opt-out", "cases": [case], "criteria": list(criteria)})


def job(
    outputs: dict[str, list[str | None]],
    *,
    sides: list[tuple[str, str]] | None = None,
    prompt_tokens: int = 512,
    failed: dict[str, str] | None = None,
) -> pa.Table:
    """One job: per arm the text of each run (None: no text), at every side (ref, commit) given."""
    sides = sides or [BASE]
    spec = JobSpec(
        run_id="r1", sweep="s", job_key=f"k{prompt_tokens}", case="command", case_name="greedy",
        params={"prompt_tokens": prompt_tokens}, arms=list(outputs), device="gfx1151", repetitions=2, warmup=0,
    )  # fmt: skip
    rows = RowBuilder(spec, fingerprint("gfx1151"), JobContext(started_at=dt.datetime(2026, 12, 1, tzinfo=dt.UTC)))
    for index, (ref, commit) in enumerate(sides):
        side = {"ref": ref} | ({"ref_index": str(index), "refs": str(len(sides))} if len(sides) > 1 else {})
        for arm, texts in outputs.items():
            if failed and arm in failed:
                rows.add(arm, "wall_seconds", 1.0, "seconds", status="failed", error=failed[arm], extra=side,
                         commit=commit)  # fmt: skip
                continue
            for sample, text in enumerate(texts):
                text = f"{text} at {ref}" if text and text.endswith("@ref") else text
                extra = dict(side)
                if text is not None:
                    extra["output_sha256"] = hashlib.sha256(text.encode()).hexdigest()
                for metric in ("wall_seconds", "decode_tok_s"):
                    rows.add(arm, metric, 1.0, "seconds", sample=sample, extra=extra, commit=commit)
    return rows.table("ok")


SAME_ARMS = {"name": "same output", "kind": "same-output", "case": "greedy"}
SAME_COMMITS = {"name": "unchanged", "kind": "same-output", "case": "greedy", "across": "commits"}


def verdict(table: pa.Table, spec: SweepSpec) -> Any:
    (v,) = evaluate_criteria(table, spec)
    return v


def test_identical_arms_pass_and_the_first_differing_arm_fails_the_point() -> None:
    spec = sweep(SAME_ARMS)
    same = verdict(job({a: ["Paris", "Paris"] for a in ARMS}), spec)
    assert same.outcome is Outcome.PASS
    assert "1 of 1 points identical" in describe(same)[0]
    # `other` differs, `default` is identical: `other` is named
    v = verdict(job({"opt-out": ["Paris", "Paris"], "default": ["Paris", "Paris"], "other": ["Lyon", "Lyon"]}), spec)
    assert v.outcome is Outcome.FAIL and v.outputs[0].differing == "other"
    # both differ: the first in the case's arm order is named; one differing run of two is enough
    v = verdict(job({"opt-out": ["Paris", "Paris"], "default": ["Paris", "Lyon"], "other": ["Rome", "Rome"]}), spec)
    assert v.outcome is Outcome.FAIL and v.outputs[0].differing == "default"
    line = describe(v)[1]
    lyon, paris = (hashlib.sha256(t.encode()).hexdigest()[:12] for t in ("Lyon", "Paris"))
    assert line.split()[0] == "FAIL" and "gfx1151 greedy" in line
    assert f"default ({', '.join(sorted([lyon, paris]))}) differs from opt-out ({paris})" in line
    assert exit_code_for([v]) == 1


def test_an_unstable_reference_is_ambiguous_not_a_failure() -> None:
    v = verdict(job({"opt-out": ["Paris", "Lyon"], "default": ["Rome", "Rome"], "other": ["Rome", "Rome"]}),
                sweep(SAME_ARMS))  # fmt: skip
    assert v.outcome is Outcome.AMBIGUOUS
    assert "opt-out is not run-to-run stable (2 outputs in 2 runs)" in describe(v)[1]
    assert exit_code_for([v]) == 4


def test_missing_output_and_missing_points_are_named() -> None:
    spec = sweep(SAME_ARMS, lengths=[512, 4096])
    table = job({"opt-out": ["Paris", "Paris"], "default": [None, None], "other": ["Paris", "Paris"]})
    v = verdict(table, spec)
    assert v.outcome is Outcome.AMBIGUOUS
    lines = describe(v)
    assert any("prompt_tokens=512: no greedy output of default at base@bbbbbbbbbbbb (the parser found no text)" in x
               for x in lines)  # fmt: skip
    assert any("prompt_tokens=4096: not run" in x for x in lines)
    failed = job({a: ["Paris", "Paris"] for a in ARMS}, failed={"default": "run 0: exited with 1\nTraceback..."})
    lines = describe(verdict(failed, sweep(SAME_ARMS)))
    assert any("(failed: run 0: exited with 1)" in x for x in lines)  # the error's first line only


def test_one_arm_against_the_baseline() -> None:
    spec = sweep({**SAME_ARMS, "arm": "default"})
    v = verdict(job({"opt-out": ["Paris", "Paris"], "default": ["Paris", "Paris"], "other": ["Lyon", "Lyon"]}), spec)
    assert v.outcome is Outcome.PASS  # `other` is not this criterion's arm


def test_across_commits_compares_each_arm_with_base() -> None:
    spec = sweep(SAME_COMMITS)
    one = verdict(job({a: ["Paris", "Paris"] for a in ARMS}), spec)
    assert one.outcome is Outcome.SKIPPED and exit_code_for([one]) == 0
    assert "the rows hold one commit" in describe(one)[0]
    same = verdict(job({a: ["Paris", "Paris"] for a in ARMS}, sides=[BASE, HEAD]), spec)
    assert same.outcome is Outcome.PASS and len(same.outputs) == 3
    changed = {"opt-out": ["Paris", "Paris"], "default": ["Paris@ref", "Paris@ref"], "other": ["Paris", "Paris"]}
    v = verdict(job(changed, sides=[BASE, HEAD]), spec)
    assert v.outcome is Outcome.FAIL
    (bad,) = [p for p in v.outputs if p.outcome is Outcome.FAIL]
    assert (bad.where, bad.differing) == ("default", "head@cccccccccccc")
    assert "differs from BASE base@bbbbbbbbbbbb" in bad.detail


def test_across_arms_judges_every_commit_of_a_comparison() -> None:
    outputs = {"opt-out": ["Paris@ref"] * 2, "default": ["Paris@ref"] * 2, "other": ["Paris@ref"] * 2}
    v = verdict(job(outputs, sides=[BASE, HEAD]), sweep(SAME_ARMS))
    assert v.outcome is Outcome.PASS and {p.where for p in v.outputs} == {"base@bbbbbbbbbbbb", "head@cccccccccccc"}


def test_same_output_criteria_are_checked_before_anything_runs() -> None:
    validate_criteria(sweep(SAME_ARMS, SAME_COMMITS))
    # refused as the sweep is loaded (orchestrator.specs.checks), before anything else looks at it
    with pytest.raises(ValidationError, match="arm 'nope' is not an arm of any case"):
        sweep({**SAME_ARMS, "arm": "nope"})
    with pytest.raises(ValidationError, match="no case has two arms or more to compare"):
        sweep(SAME_ARMS, arms=["opt-out"])
    validate_criteria(sweep(SAME_COMMITS, arms=["opt-out"]))  # one arm across commits is fine
    with pytest.raises(ValidationError, match="where names 'tokens', not a parameter of its cases"):
        sweep({**SAME_ARMS, "where": "tokens >= 4096"})


def test_ratio_criteria_judge_head_alone_in_a_commit_comparison() -> None:
    case = {"case": "command", "name": "greedy", "repo": "../e", "run": "./b", "arms": {"opt-out": {}, "default": {}}}
    criterion = {"name": "faster", "case": "greedy", "metric": "decode_tok_s", "arm": "default", "min_ratio": 1.5}
    spec = SweepSpec.model_validate({"name": "s", "baseline": "opt-out", "cases": [case], "criteria": [criterion]})
    spec_job = JobSpec(run_id="r1", sweep="s", job_key="k", case="command", case_name="greedy", params={},
                       arms=["opt-out", "default"], device="cpu", repetitions=5, warmup=0)  # fmt: skip
    rows = RowBuilder(spec_job, fingerprint("cpu"), JobContext(started_at=dt.datetime(2026, 12, 1, tzinfo=dt.UTC)))
    for index, (ref, commit) in enumerate([BASE, HEAD]):
        extra = {"ref": ref, "ref_index": str(index), "refs": "2"}
        for i in range(5):  # fewer than 5 samples per arm are too few to judge
            rows.add("opt-out", "decode_tok_s", 100.0 + i, "tok/s", sample=i, extra=extra, commit=commit)
            speed = (100.0 if index == 0 else 200.0) + i  # BASE: no gain; HEAD: 2x
            rows.add("default", "decode_tok_s", speed, "tok/s", sample=i, extra=extra, commit=commit)
    (v,) = evaluate_criteria(concat([rows.table("ok")]), spec)
    assert v.outcome is Outcome.PASS and v.points[0].ratio.n_a == 5  # HEAD's 5 samples, not BASE's too


def test_the_html_report_shows_same_output_verdicts() -> None:
    spec = sweep(SAME_ARMS, SAME_COMMITS)
    table = job({"opt-out": ["Paris", "Paris"], "default": ["Lyon", "Lyon"], "other": ["Paris", "Paris"]})
    verdicts = evaluate_criteria(table, spec)
    on_device = [device_verdict(v, "gfx1151") for v in verdicts]
    assert [v.outcome for v in on_device] == [Outcome.FAIL, Outcome.SKIPPED]
    assert all(applies(v) for v in on_device) and not applies(device_verdict(verdicts[0], "cpu"))
    rows = criteria_table(on_device).rows
    assert [r[0].text for r in rows] == ["FAIL", "SKIPPED"]
    assert rows[0][1].sub.startswith("byte-identical greedy output, every arm against opt-out")
    assert "default (" in rows[0][3].text and "differs from opt-out" in rows[0][3].text
    assert "the rows hold one commit" in rows[1][4].text
    overview = overview_table(verdicts, ["gfx1151", "cpu"]).rows
    assert [[c.text for c in r[1:]] for r in overview] == [["FAIL", "does not apply"], ["SKIPPED", "SKIPPED"]]
    html = build_report(table, spec=spec, resamples=100)
    assert "byte-identical greedy output, every arm against opt-out" in html and 'class="verdict FAIL"' in html


def test_check_records_carry_same_output_points() -> None:
    """`orchestrate check --format csv|json`: a same-output criterion's points are records too, with
    the first differing arm (not only the ratio criteria's points)."""
    spec = sweep(SAME_ARMS)
    v = verdict(job({"opt-out": ["Paris", "Paris"], "default": ["Paris", "Paris"], "other": ["Lyon", "Lyon"]}), spec)
    (rec,) = check_records([v]).to_pylist()
    assert (rec["criterion"], rec["kind"], rec["outcome"], rec["point_outcome"]) == (
        "same output", "same-output", "FAIL", "FAIL",
    )  # fmt: skip
    assert rec["differing"] == "other" and rec["case"] == "greedy" and rec["reason"]
