"""Which samplings fell short of their precision target, as compare, check and the report name them."""

from __future__ import annotations

import datetime as dt

import pyarrow as pa

from orchestrator.analysis.shortfall import shortfall_lines, shortfalls
from tests.orchestrator.synthetic_rows import concat, fingerprint
from workers.contract import JobContext, JobSpec, RowBuilder


def _rows(case: str, params: dict[str, int], samplings: dict[str, tuple[list[str], int, dict[str, str]]]) -> pa.Table:
    """One job's rows: `samplings[name] = (metrics, rounds, extra)` for every arm, the baseline
    `affine` carrying the widest width of its point as the worker writes it."""
    job = JobSpec(
        run_id="run1", sweep="s", job_key=f"{case}-job", case=case, case_name=case, params=params,
        arms=["affine", "custom"], device="h200", repetitions=5, warmup=1,
    )  # fmt: skip
    rows = RowBuilder(job, fingerprint("h200"), JobContext(started_at=dt.datetime(2026, 12, 7, tzinfo=dt.UTC)))
    for metrics, rounds, extra in samplings.values():
        for arm in ("affine", "custom"):
            for metric in metrics:
                for r in range(rounds):
                    common = {
                        "stop_reason": extra["stop_reason"],
                        "rounds": str(rounds),
                        "precision": extra["precision"],
                    }
                    rows.add(arm, metric, 1.0 + r, "x", sample=r, extra={**common, "baseline": "affine",
                             "half_width": extra["half_width"]})  # fmt: skip
    return rows.table("ok")


def test_each_sampling_of_a_job_that_fell_short_is_named_with_its_metric() -> None:
    """A model job samples its cold loads, prefill and decode apart: the load and the decode that ran
    out of time are both named (not only the sampling with the most rounds), the prefill that met its
    target is not; a kernel job's metrics of one sampling are named once, by its rate."""
    budget = {"stop_reason": "budget", "precision": "0.015"}
    model = _rows(
        "model",
        {"prompt_tokens": 2048},
        {
            "loads": (["load_seconds", "peak_memory_bytes"], 6, budget | {"half_width": "0.074"}),
            "prefill": (
                ["prefill_tok_s"],
                16,
                {"stop_reason": "precision", "precision": "0.015", "half_width": "0.008"},
            ),
            "decode": (["decode_tok_s"], 36, budget | {"half_width": "0.0163"}),
        },
    )
    qmm = _rows(
        "qmm",
        {"tokens": 1},
        {"rounds": (["seconds", "decode_tok_s", "gb_per_s"], 40, {"stop_reason": "max_rounds", "precision": "0.01",
                                                                  "half_width": "0.012"})},
    )  # fmt: skip
    found = shortfalls(concat([model, qmm]))
    got = [(s.case_name, s.arm, s.metric, s.rounds, round(s.half_width, 4), s.stop_reason) for s in found]
    assert got == [
        ("model", "custom", "decode_tok_s", 36, 0.0163, "budget"),
        ("model", "custom", "load_seconds", 6, 0.074, "budget"),
        ("qmm", "custom", "decode_tok_s", 40, 0.012, "max_rounds"),
    ]
    lines = shortfall_lines(concat([model, qmm]))
    assert lines[0].startswith("2 point(s) stopped short")
    assert "h200 model prompt_tokens=2048 custom load_seconds: ±7.40% after 6 rounds (target ±1.50%)" in lines[2]
