"""One value formatter for every command, and what the end of `orchestrate run` prints."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
from rich.console import Console

from orchestrator.report.summary import render_run_end
from orchestrator.report.units import format_value, unit_of
from orchestrator.specs.sweep import SweepSpec
from orchestrator.store.fragments import ResultStore
from tests.orchestrator.test_dataset import write_job


@pytest.mark.parametrize(
    ("value", "unit", "text"),
    [
        (0.028, "seconds", "28.00 ms"),  # never `0.0s` for 28 ms
        (229.8, "seconds", "229.8 s"),
        (3.2e-6, "seconds", "3.200 µs"),
        (40.44e9, "bytes", "40.44 GB"),
        (2_000_000, "bytes", "2.000 MB"),
        (11770.4, "tok/s", "11,770 tok/s"),  # never 1.177e+04
        (121.77, "tok/s", "121.8 tok/s"),
        (4.92, "tok/s", "4.920 tok/s"),
        (1.2e-3, "ratio", "1.2e-03"),
        (float("nan"), "seconds", "-"),
        (None, "bytes", "-"),
    ],
)
def test_one_formatter_one_reading(value: float | None, unit: str, text: str) -> None:
    assert format_value(value, unit) == text


def test_units_come_from_the_metric_name_first() -> None:
    assert unit_of("load_seconds", "tok/s") == "seconds"
    assert unit_of("peak_memory_bytes") == "bytes" and unit_of("decode_tok_s") == "tok/s"
    assert unit_of("joules", "J") == "J" and unit_of("joules") == ""


def test_the_end_of_a_run_prints_the_fitted_comparison_and_the_next_commands(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("ORCHESTRATE_RESULTS")
    store = ResultStore(tmp_path / "results")
    for i in range(3):
        write_job(store, i, samples=6)
    sweep = SweepSpec.model_validate(
        {"name": "nightly", "baseline": "affine", "repetitions": 6, "warmup": 0,
         "cases": [{"case": "qmm", "arms": ["native", "affine"], "params": {"tokens": [1, 2, 3], "n": 64, "k": 64}}]}
    )  # fmt: skip
    buf = io.StringIO()
    render_run_end(store, sweep, Console(file=buf, width=100, force_terminal=False), results=tmp_path / "results")
    text = buf.getvalue()
    assert "qmm on cpu, baseline affine; k=64 n=64" in text
    assert max(len(line) for line in text.split("Next:")[0].splitlines()) <= 100
    assert "0.50x" in text and "FASTER" in text  # native at tokens=1: 1 s against 2 s
    assert f"orchestrate compare --sweep nightly --results {tmp_path / 'results'}" in text
    assert "--html nightly.html" in text and "orchestrate runs" in text
    empty = io.StringIO()
    one_arm = sweep.model_copy(update={"name": "nothing-here"})
    render_run_end(ResultStore(tmp_path / "none"), one_arm, Console(file=empty, width=100))
    assert "Nothing to compare: no results stored" in empty.getvalue()
