"""benchmarks/store_scale.py's synthetic store: its fast path writes what the real row builder would.

The build makes most jobs' rows from a template (`templated`) instead of the row builder; were the
two to differ in any column or footer key, the benchmark would time a store no run makes.
"""

from __future__ import annotations

import datetime as dt
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

from benchmarks import store_scale
from orchestrator.store.dataset import read_rows
from orchestrator.store.fragments import ResultStore
from workers.contract import META_DATE


def test_templated_rows_are_the_row_builders_column_for_column() -> None:
    date = dt.date(2026, 11, 3)
    rng = np.random.default_rng(0)
    templates = {j: store_scale.job_rows("wide", j, date, store_scale.job_samples(rng)) for j in (0, 1)}
    for j in (2, 3, 98, 501, 999):
        values = store_scale.job_samples(rng)
        made = store_scale.templated(templates[j % 2], "wide", j, date, values)
        real = store_scale.job_rows("wide", j, date, values)
        assert made.equals(real, check_metadata=True), j


def test_a_built_night_is_every_job_once_in_the_stores_own_format(tmp_path: Path) -> None:
    today = dt.date(2026, 12, 1)
    assert store_scale.night((str(tmp_path / "s"), "nightly-a", 6, 1, today.isoformat())) == 6
    store = ResultStore(tmp_path / "s")
    date = today - dt.timedelta(days=1)
    assert set(store.complete_job_keys("nightly-a")) == {store_scale.job_key("nightly-a", j, date) for j in range(6)}
    rows = read_rows(store, sweep="nightly-a")
    assert rows.num_rows == 6 * 25 and sorted(set(rows["tokens"].to_pylist())) == [16, 32, 48]
    for path in store.root.rglob("*.parquet"):
        meta = pq.read_metadata(path).metadata
        assert path.name.endswith(f"-{meta[b'orchestrate.job_key'].decode()}.parquet")
        assert meta[META_DATE] == date.isoformat().encode()
