"""Commit comparisons: the sweep fields and `--ref`, and the rows' two sides in compare and criteria."""

from __future__ import annotations

import datetime as dt
import re
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest
from pydantic import ValidationError

from orchestrator.analysis.commits import base_side, head_rows, match_side, with_commit_sides
from orchestrator.analysis.compare import compare_results
from orchestrator.analysis.history import series_of
from orchestrator.analysis.records import records
from orchestrator.analysis.selection import compare_stored
from orchestrator.analysis.stats import Verdict
from orchestrator.errors import InputError
from orchestrator.report.summary import summarize
from orchestrator.run.plan import expand, with_refs
from orchestrator.specs.sweep import SweepSpec, load_inventory
from orchestrator.store.fragments import ResultStore
from tests.orchestrator.synthetic_rows import concat, fingerprint, job_table, noisy
from workers.contract import JobContext, JobSpec, RowBuilder

BASE, HEAD = ("v1", "b" * 40), ("main", "c" * 40)


def comparison(effects: dict[str, float], rel_noise: float, n: int = 10, seed: int = 0) -> pa.Table:
    """One command job at BASE and HEAD: per arm, HEAD's prefill is BASE's times `effects[arm]`."""
    rng = np.random.default_rng(seed)
    spec = JobSpec(
        run_id="r1", sweep="s", job_key="k", case="command", case_name="bench", params={"prompt_tokens": 512},
        arms=list(effects), device="gfx1151", repetitions=n, warmup=0,
    )  # fmt: skip
    rows = RowBuilder(spec, fingerprint("gfx1151"), JobContext(started_at=dt.datetime(2026, 12, 1, tzinfo=dt.UTC)))
    for index, (ref, commit) in enumerate([BASE, HEAD]):
        extra = {"ref": ref, "ref_index": str(index), "refs": "2"}
        for arm, effect in effects.items():
            for i, v in enumerate(noisy(rng, 120.0 * (effect if index else 1.0), rel_noise, n)):
                rows.add(arm, "prefill_tok_s", v, "tok/s", sample=i, extra=extra, commit=commit)
    return concat([rows.table("ok")])


@pytest.mark.parametrize("rel_noise", [0.02, 0.05, 0.10])
def test_compare_by_commit_puts_head_against_base_and_finds_a_slower_commit(rel_noise: float) -> None:
    table = comparison({"native": 0.80, "affine": 1.0}, rel_noise)
    result = compare_results(table, by="commit")
    base, head = f"v1@{'b' * 12}", f"main@{'c' * 12}"
    assert (result.baseline, result.sides) == (base, [base, head])
    found = {r.dims["arm"]: r.comparisons[("prefill_tok_s", head)] for r in result.rows}
    assert found["native"].verdict is Verdict.SLOWER  # a 20 % drop is found at 2-10 % noise
    assert 0.7 < found["native"].ratio.ratio < 0.9
    assert found["affine"].verdict is not Verdict.SLOWER and found["affine"].verdict is not Verdict.FASTER
    if rel_noise <= 0.02:  # 10 samples make 5 ABBA blocks: the unchanged arm is known to a few percent
        r = found["affine"].ratio
        assert 0.96 < r.ci_low < 1 < r.ci_high < 1.04


def test_no_effect_is_rarely_called_a_difference() -> None:
    """A/A over 40 seeded comparisons at 5 % noise: a verdict of SLOWER or FASTER stays rare."""
    wrong = 0
    for seed in range(40):
        c = compare_results(comparison({"native": 1.0}, 0.05, seed=seed), by="commit").rows[0].comparisons
        wrong += next(iter(c.values())).verdict in (Verdict.SLOWER, Verdict.FASTER)
    assert wrong <= 4


def test_views_of_arms_see_head_alone() -> None:
    table = comparison({"native": 0.80, "affine": 1.0}, 0.02)
    assert head_rows(table).num_rows == table.num_rows // 2
    assert set(head_rows(table)["commit"].to_pylist()) == {"c" * 40}
    by_arm = compare_results(table, by="arm", baseline="affine")
    assert {s.n for r in by_arm.rows for s in r.values.values()} == {10}  # not BASE's 10 more
    (gap,) = [c.ratio.ratio for r in by_arm.rows for c in r.comparisons.values()]
    assert 0.75 < gap < 0.85  # HEAD's native against HEAD's affine


def test_commit_sides_of_kernel_rows_are_the_code_version() -> None:
    kernel = job_table({"native": {"seconds": [1.0, 1.1]}}, params={"tokens": 1}, code_version="1fe7518abcde")
    sides = with_commit_sides(concat([kernel, comparison({"native": 1.0}, 0.02)]))
    assert set(sides["commit_side"].to_pylist()) == {"1fe7518abcde", f"v1@{'b' * 12}", f"main@{'c' * 12}"}
    assert base_side(sides) == f"v1@{'b' * 12}"
    assert base_side(with_commit_sides(kernel)) is None
    assert match_side(sides, "main") == match_side(sides, "cccccc") == f"main@{'c' * 12}"
    assert match_side(sides, "nope") == "nope"  # compare then says which sides there are
    assert head_rows(kernel).num_rows == kernel.num_rows


def command_sweep(**extra: Any) -> dict[str, Any]:
    return {
        "name": "s",
        "command": {"repo": "../engine", "ref": "main", "build": "make", "gate": "make test",
                    "params": {"checkpoint": "~/m", "prompt_tokens": 512}},
        "cases": [
            {"case": "command", "name": "a", "run": "./b {checkpoint} {prompt_tokens}", "arms": ["x", "y"]},
            {"case": "command", "name": "b", "run": "./g {checkpoint}", "ref": "v2", "arms": ["x"],
             "params": {"prompt_tokens": [1, 2]}},
            {"case": "qmm", "arms": ["native"], "params": {"tokens": 1, "n": 64, "k": 64, "dtype": "float32"}},
        ],
        **extra,
    }  # fmt: skip


def test_command_table_is_shared_by_the_command_cases() -> None:
    spec = SweepSpec.model_validate(command_sweep())
    a, b, qmm = spec.cases
    assert (a.repo, a.ref, a.build, a.gate, a.params) == ("../engine", "main", "make", "make test",
                                                          {"checkpoint": "~/m", "prompt_tokens": 512})  # fmt: skip
    assert (b.ref, b.params["prompt_tokens"], b.params["checkpoint"]) == ("v2", [1, 2], "~/m")  # its own win
    assert qmm.repo is None and "checkpoint" not in qmm.params


def test_refs_fields_and_their_errors() -> None:
    spec = with_refs(SweepSpec.model_validate(command_sweep()), ["v1", "main"])
    assert [(c.ref, c.refs) for c in spec.cases[:2]] == [(None, ["v1", "main"])] * 2
    jobs = expand(spec, load_inventory(None), ["cpu"], run_id="r", version="v", digest="d")
    assert {tuple(j.options["refs"]) for j in jobs if j.case == "command"} == {("v1", "main")}
    assert {j.options["gate"] for j in jobs if j.case == "command"} == {"make test"}
    plain = expand(SweepSpec.model_validate(command_sweep()), load_inventory(None), ["cpu"], run_id="r", version="v",
                   digest="d")  # fmt: skip
    assert {j.job_key for j in jobs}.isdisjoint({j.job_key for j in plain if j.case == "command"})
    assert with_refs(spec, ["v3"]).cases[0].ref == "v3"
    for refs, message in [(["a", "a"], "distinct"), (["a", " "], "non-empty")]:
        with pytest.raises(InputError, match=message):
            with_refs(spec, refs)
    kernel_only = SweepSpec.model_validate({"name": "k", "cases": [command_sweep()["cases"][2]]})
    with pytest.raises(InputError, match="has no command case"):
        with_refs(kernel_only, ["main"])
    bad = command_sweep()
    bad["cases"][0] |= {"ref": "x", "refs": ["a", "b"]}
    with pytest.raises(ValidationError, match="give `ref` \\(one commit\\) or `refs`"):
        SweepSpec.model_validate(bad)
    bad = command_sweep()
    bad["cases"][2]["gate"] = "make test"
    with pytest.raises(ValidationError, match="only a command case takes `gate`"):
        SweepSpec.model_validate(bad)
    bad = command_sweep()
    bad["command"]["gate"] = "cargo test --features {nope}"
    with pytest.raises(ValidationError, match=re.escape("gate: template field {nope} is not a parameter")):
        SweepSpec.model_validate(bad)


def test_criterion_kinds_are_checked() -> None:
    def criterion(**fields: Any) -> None:
        SweepSpec.model_validate(command_sweep(criteria=[{"name": "c", **fields}]))

    criterion(kind="same-output", case="a")
    criterion(kind="same-output", case="a", across="commits", arm="x")
    for fields, message in [
        ({"kind": "same-output", "min_ratio": 1.0}, "takes no `min_ratio`"),
        ({"kind": "same-output", "metric": "decode_tok_s"}, "takes no `metric`"),
        ({"metric": "decode_tok_s", "min_ratio": 1.0}, "a ratio criterion needs `arm`"),
        ({"arm": "x", "min_ratio": 1.0}, "a ratio criterion needs `metric`"),
        ({"metric": "m", "arm": "x", "min_ratio": 1.0, "across": "commits"}, "only a same-output criterion"),
        ({"kind": "identical"}, "kind"),
    ]:
        with pytest.raises(ValidationError, match=re.escape(message)):
            criterion(**fields)


def stored_comparison(root: Path, effects: dict[str, float]) -> ResultStore:
    """`comparison` stored as its job's fragment (sweep `s`, run `r1`), as `orchestrate run` stores it."""
    store = ResultStore(root)
    store.write(comparison(effects, 0.02), sweep="s", date=dt.date(2026, 12, 1), device="gfx1151", run_id="r1",
                job_key="k")  # fmt: skip
    return store


def test_compare_stored_by_commit_names_sides_by_ref_or_commit_prefix(tmp_path: Path) -> None:
    """`compare --by commit --baseline main --contender v1`: a ref's name or a commit prefix picks a
    side of the stored rows (the sides are labels made from them, not a column of the files)."""
    store = stored_comparison(tmp_path / "results", {"native": 0.80})
    base, head = f"v1@{'b' * 12}", f"main@{'c' * 12}"
    result, _, _ = compare_stored(store, by="commit")
    assert (result.baseline, result.sides) == (base, [base, head])  # BASE by default
    flipped, _, _ = compare_stored(store, by="commit", baseline="main", contenders=["bbbbbb"])
    assert (flipped.baseline, flipped.sides) == (head, [head, base])
    (c,) = flipped.rows[0].comparisons.values()
    assert c.verdict is Verdict.FASTER and 1.15 < c.ratio.ratio < 1.35  # BASE is 1/0.8 of HEAD
    with pytest.raises(InputError, match="commit 'nope': none stored"):
        compare_stored(store, by="commit", baseline="nope")
    # the records keep each side's own commit and this checkout's code version, the label in `side`
    recs = {r["side"]: r for r in records(result)}
    assert recs[head]["commit"] == "c" * 40 and recs[base]["commit"] == "b" * 40
    assert recs[head]["code_version"] == recs[base]["code_version"] != head


def test_history_and_results_take_head_alone(tmp_path: Path) -> None:
    """A commit comparison's BASE rows share HEAD's run: the run's point in the history is HEAD's
    (not a median pooled over both commits), as in `results`."""
    table = comparison({"native": 0.80}, 0.02)
    (series,) = series_of(table, case="bench", metric="prefill_tok_s").values()
    (point,) = series
    assert len(point.values) == 10 and point.commit == "c" * 40
    assert 0.78 < point.median / 120.0 < 0.82  # HEAD's 0.8 x BASE, not a median over both
    (line,) = summarize(head_rows(table), baseline=None)
    assert line.n == 10 and 0.78 < line.median / 120.0 < 0.82
