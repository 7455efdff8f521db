"""Sweep expansion and job keys; the Parquet store's atomic writes, resume keys and broken files."""

from __future__ import annotations

import datetime as dt
from pathlib import Path

import duckdb
import pytest

from orchestrator.run.plan import expand, job_key, points
from orchestrator.specs.sweep import InventorySpec, SweepSpec
from orchestrator.store.dataset import read_rows
from orchestrator.store.fragments import ResultStore
from workers.contract import HostFingerprint, JobContext, JobSpec, RowBuilder, Status

# two device kinds need two nodes: a cluster inventory (with a head), as `orchestrate run` would require
INV = InventorySpec.model_validate(
    {"head": {"address": "127.0.0.1"}, "hosts": [{"name": "a", "device": "cpu"}, {"name": "b", "device": "m1-ultra"}]}
)


def _sweep(**over: object) -> SweepSpec:
    data: dict[str, object] = {
        "name": "s",
        "cases": [
            {"case": "qmm", "arms": ["native", "affine"], "params": {"tokens": [1, 8, 64], "n": 32, "k": [64, 128]}}
        ],
    }
    data.update(over)
    return SweepSpec.model_validate(data)


def test_points_are_the_cartesian_product_in_order() -> None:
    pts = points(_sweep().cases[0])
    assert len(pts) == 6
    assert pts[0] == {"tokens": 1, "n": 32, "k": 64}
    assert pts[-1] == {"tokens": 64, "n": 32, "k": 128}


def test_expand_every_kind_and_stable_keys() -> None:
    a = expand(_sweep(), INV, ["cpu", "m1-ultra"], run_id="r1", version="v1", digest="d1")
    b = expand(_sweep(), INV, ["cpu", "m1-ultra"], run_id="r2", version="v2", digest="d1")
    assert len(a) == 12
    assert {j.device for j in a} == {"cpu", "m1-ultra"}
    assert [j.job_key for j in a] == [j.job_key for j in b]  # neither the run id nor the commit is content
    assert len({j.job_key for j in a}) == 12
    assert a[0].seed != b[0].seed  # fresh random inputs per run
    assert a[0].code_version == "v1" and b[0].code_version == "v2"  # the commit is recorded
    c = expand(_sweep(), INV, ["cpu"], run_id="r1", version="v1", digest="d2")
    assert c[0].job_key != a[0].job_key  # new measuring code, new measurement
    d = expand(_sweep(repetitions=3), INV, ["cpu"], run_id="r1", version="v1", digest="d1")
    assert d[0].job_key != a[0].job_key


def test_the_cache_state_is_a_choice_of_the_sweep_and_part_of_the_job() -> None:
    """`cache = "cold" | "hot"` (top level, or per case): in every kernel job's options and key."""
    cold = expand(_sweep(), INV, ["cpu"], run_id="r1", version="v1", digest="d1")
    hot = expand(_sweep(cache="hot"), INV, ["cpu"], run_id="r1", version="v1", digest="d1")
    assert {j.options["cache"] for j in cold} == {"cold"} and {j.options["cache"] for j in hot} == {"hot"}
    assert cold[0].job_key != hot[0].job_key  # another cache state is another measurement
    case = {"case": "qmm", "arms": ["native"], "params": {"tokens": 1, "n": 32, "k": 64}, "cache": "hot"}
    mixed = expand(_sweep(cases=[case]), INV, ["cpu"], run_id="r1", version="v1", digest="d1")
    assert mixed[0].options["cache"] == "hot"
    with pytest.raises(ValueError, match="cache"):
        _sweep(cache="tepid")
    with pytest.raises(ValueError, match="only kernel cases"):
        _sweep(cases=[{"case": "model", "arms": ["native"], "params": {"prompt_tokens": 8}, "cache": "hot"}])


def test_job_key_ignores_dict_order() -> None:
    assert job_key({"a": 1, "b": [1, 2]}) == job_key({"b": [1, 2], "a": 1})


def _table(job_key: str, status: str, n: int = 3) -> object:
    job = JobSpec(
        run_id="r1", sweep="s", job_key=job_key, case="qmm", case_name="qmm", params={"tokens": 1, "n": 32, "k": 64},
        arms=["native"], device="cpu", repetitions=n, warmup=0,
    )  # fmt: skip
    fp = HostFingerprint(
        hostname="h", os="Linux", machine="x86_64", cpu="c", cpu_count=2, memory_bytes=1, mlx_version="0",
        mlx_device="cpu", backend="cpu", threads=2, fingerprint_id="f",
    )  # fmt: skip
    rows = RowBuilder(job, fp, JobContext(started_at=dt.datetime(2026, 11, 30, tzinfo=dt.UTC)))
    for i in range(n):
        rows.add("native", "seconds", 0.001 * (i + 1), "seconds", sample=i)
    return rows.table(status)


def test_store_write_read_resume_and_broken_fragment(tmp_path: Path) -> None:
    store = ResultStore(tmp_path / "results")
    day = dt.date(2026, 11, 30)
    p1 = store.write(_table("k1", Status.OK), sweep="s", date=day, device="cpu", run_id="r1", job_key="k1")  # type: ignore[arg-type]
    store.write(_table("k2", Status.FAILED), sweep="s", date=day, device="cpu", run_id="r1", job_key="k2")  # type: ignore[arg-type]
    assert p1 == tmp_path / "results/sweep=s/date=2026-11-30/device=cpu/part-r1-k1.parquet"
    assert not list(p1.parent.glob(".*.tmp"))  # no temp file left behind
    assert store.complete_job_keys() == {"k1"}  # a failed job runs again on resume
    broken = p1.parent / "part-r9-bad.parquet"
    broken.write_bytes(b"PAR1 this is not parquet")
    table = read_rows(store, sweep="s")
    assert table.num_rows == 6
    assert [b[0] for b in store.broken] == [broken]
    # DuckDB over the files the store lists sees the same rows and the hive partitions
    files = [str(p) for p in store.fragment_files()]
    n, dates = duckdb.sql(
        f"select count(*), count(distinct date) from read_parquet({files}, hive_partitioning=true)"
    ).fetchall()[0]
    assert (n, dates) == (6, 1)


def test_unwritable_store_is_an_input_error(tmp_path: Path) -> None:
    from orchestrator.errors import InputError

    blocker = tmp_path / "f"
    blocker.write_text("x")
    with pytest.raises(InputError, match="not writable"):
        ResultStore(blocker / "r").ensure_writable()


def test_lock_settings_come_from_the_host_and_each_node_applies_its_own(monkeypatch: pytest.MonkeyPatch) -> None:
    from workers.job.task import localise

    inv = InventorySpec.model_validate(
        {
            "head": {"address": "127.0.0.1"},
            "defaults": {"max_attempts": 3, "cpu_busy_threshold": 80.0},
            "hosts": [
                {"name": "a", "device": "cpu", "lock": "/tmp/a.lock", "max_wait": 30, "idle_secs": 2},
                {"name": "b", "device": "cpu", "lock": "/tmp/b.lock", "kfd_proc": "/tmp/kfd", "max_attempts": 1},
            ],
        }
    )
    job = expand(_sweep(), inv, ["cpu"], run_id="r", version="v", digest="d")[0]
    assert (job.lock.path, job.lock.max_wait, job.lock.idle_secs) == ("/tmp/a.lock", 30, 2)
    assert (job.lock.max_attempts, job.lock.cpu_busy_threshold) == (3, 80.0)
    # on host b's node, `cluster up` exported b's settings: the job takes b's lock as b says
    from orchestrator.run.plan import lock_settings

    monkeypatch.delenv("ORCHESTRATE_LOCK_PATH", raising=False)
    monkeypatch.setenv("ORCHESTRATE_LOCK", lock_settings(inv.hosts[1]).model_dump_json())
    monkeypatch.setenv("ORCHESTRATE_HOST", "b")
    local = localise(job)
    assert local.host == "b"
    assert (local.lock.path, local.lock.kfd_proc, local.lock.max_attempts) == ("/tmp/b.lock", "/tmp/kfd", 1)
    assert local.lock.cpu_busy_threshold == 80.0  # b inherits the defaults
    monkeypatch.setenv("ORCHESTRATE_LOCK_PATH", "/tmp/override.lock")
    assert localise(job).lock.path == "/tmp/override.lock"


def test_summary_names_what_it_leaves_out() -> None:
    import pyarrow as pa

    from orchestrator.report.summary import left_out, summarize

    ok = _table("k1", Status.OK)
    failed = _table("k2", Status.FAILED)
    rows = ok.to_pylist() + failed.to_pylist()  # type: ignore[attr-defined]
    for r in rows[3:]:
        r["status"] = "failed"
    rows[0]["contended"] = True
    table = pa.Table.from_pylist(rows, schema=ok.schema)  # type: ignore[attr-defined]
    assert left_out(table) == (
        "left out: 1 contended (a foreign process used the device during the measurement), 3 failed"
    )
    (line,) = summarize(table, baseline=None)
    assert line.n == 2 and line.median == 0.0025  # the two clean samples of 1, 2, 3 ms
    assert left_out(ok) is None  # type: ignore[arg-type]
