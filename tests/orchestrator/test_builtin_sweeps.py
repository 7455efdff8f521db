"""Every built-in sweep loads, validates its criteria and expands to the jobs its file describes."""

from __future__ import annotations

import pytest

from orchestrator.analysis.criteria import validate_criteria
from orchestrator.run.plan import expand
from orchestrator.specs.sweep import builtin_sweeps, load_inventory, load_sweep

EXPECTED_JOBS = {
    "smoke": 5,
    "nvfp4-prefill": 7 + 6 + 2,
    "moe-gather": 1,
    "mlxcel-prefill": 6 + 2 + 1,
    "mlxcel-moe": 1 + 1,
}


def test_the_builtin_sweeps_ship() -> None:
    assert set(builtin_sweeps()) == set(EXPECTED_JOBS)


@pytest.mark.parametrize("name", sorted(EXPECTED_JOBS))
def test_builtin_sweep_expands(name: str) -> None:
    sweep = load_sweep(name)
    validate_criteria(sweep)
    jobs = expand(sweep, load_inventory(None), ["cpu"], run_id="r", version="v", digest="d")
    assert len(jobs) == EXPECTED_JOBS[name]
    assert len({j.job_key for j in jobs}) == len(jobs)


def test_seed_shapes_and_criteria() -> None:
    prefill = load_sweep("nvfp4-prefill")
    qmm = next(c for c in prefill.cases if c.case == "qmm")
    assert qmm.axes()["tokens"] == [1, 512, 1024, 2048, 4096, 8192, 16384]
    assert (qmm.params["n"], qmm.params["k"], prefill.baseline) == (21504, 5376, "affine")
    bounds = {(c.metric, c.where, c.min_ratio, c.max_ratio) for c in prefill.criteria if c.case is None}
    assert ("prefill_tok_s", "tokens >= 4096", 0.97, None) in bounds
    assert ("decode_tok_s", "tokens == 1", 2.0, None) in bounds
    assert ("peak_memory_bytes", None, None, 1.0) in bounds
    moe = load_sweep("moe-gather").cases[0]
    assert (moe.params["experts"], moe.params["top_k"], moe.params["tokens"]) == (128, 6, 512)
