"""`orchestrate run` end to end on this machine: embedded Ray, the smoke sweep, real Parquet.

The dataset is then read by DuckDB and Polars in a separate Python process that imports nothing
of this package, and must give the row count `orchestrate results` reports.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from orchestrator.errors import EXIT_LOCK_TIMEOUT
from orchestrator.run.plan import expand
from orchestrator.specs.sweep import load_inventory, load_sweep
from orchestrator.store.dataset import read_rows
from orchestrator.store.fragments import ResultStore
from orchestrator.store.incoming import check_fragment
from tests.conftest import REPO, child_env, until_clean
from workers.contract import META_PHASES
from workers.proc.table import is_descendant, pid_alive

pytestmark = pytest.mark.slow

INTEROP = r"""
import json, sys
import duckdb, pandas as pd, polars as pl, pyarrow.dataset as ds
root = sys.argv[1]
glob = root + "/**/*.parquet"
n_duck, n_ok, n_dev = duckdb.sql(
    f"select count(*), count(*) filter (where status = 'ok'), count(distinct device) "
    f"from read_parquet('{glob}', hive_partitioning = true)"
).fetchall()[0]
df = pl.read_parquet(glob, hive_partitioning=True)
err = df.filter((pl.col("metric") == "rel_error") & (pl.col("arm") == "native"))
print(json.dumps({
    "duckdb": n_duck, "ok": n_ok, "devices": n_dev, "polars": df.height,
    "pandas": len(pd.read_parquet(root)), "polars_dir": pl.read_parquet(root).height,
    "pyarrow": ds.dataset(root, partitioning="hive").count_rows(),
    "dates": sorted(str(d) for d in df["date"].unique().to_list()),
    "native_rel_error_max": err["value"].max(),
    "backends": sorted(df["backend"].unique().to_list()),
    "cases": sorted(df["case"].unique().to_list()),
}))
"""


def older_night(results: Path, fragments: list[Path], days: int) -> Path:
    """The stored night copied as a run `days` ago (its own run id, in that date's partition)."""
    store = ResultStore(results)
    day = dt.datetime.now(dt.UTC).date() - dt.timedelta(days=days)
    run_id = f"{day.strftime('%Y%m%d')}T020000Z-old{days}"
    for path in fragments:
        table, _ = check_fragment(store, path)
        column = table.schema.get_field_index("run_id")
        table = table.set_column(column, table.field(column), pa.array([run_id] * table.num_rows, pa.string()))
        key = table["job_key"][0].as_py()
        store.write(table, sweep="smoke", date=day, device="cpu", run_id=run_id, job_key=key)
    return store.partition_dir(sweep="smoke", date=day.isoformat(), device="cpu")


def _run(args: list[str], cwd: Path, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    env = child_env()
    env.pop("ORCHESTRATE_RESULTS", None)  # the default: ./results under cwd
    return subprocess.run(args, cwd=cwd, capture_output=True, text=True, env=env, timeout=timeout)


def test_smoke_sweep_end_to_end(tmp_path: Path, orchestrate_bin: str) -> None:
    work = tmp_path / "work"
    work.mkdir()
    smoke = load_sweep("smoke")
    n_jobs = len(expand(smoke, load_inventory(None), ["cpu"], run_id="x", version="x"))
    last, runs = until_clean(lambda: _run([orchestrate_bin, "run"], work))
    first = runs[0]
    assert last.returncode == 0, last.stdout + last.stderr
    assert f"{n_jobs} jobs ran (0 failed" in first.stdout
    assert "baseline affine" in last.stdout  # the comparison table, with verdicts
    assert re.search(r"\b(FASTER|SLOWER|SAME|AMBIGUOUS)\b", last.stdout)
    assert "Next:" in last.stdout and "orchestrate compare --sweep smoke" in last.stdout
    fragments = sorted((work / "results").rglob("part-*.parquet"))
    # a job measured again after contention keeps its contended fragment beside the clean one
    contended = sum(int(m) for r in runs[:-1] for m in re.findall(r"(\d+) contended\)", r.stdout))
    assert len(fragments) == n_jobs + contended
    assert all("sweep=smoke" in str(f) and "device=cpu" in str(f) for f in fragments)

    # Last week's night of the sweep (a copy of this one under another run): the next run compacts it.
    old = [older_night(work / "results", fragments, days) for days in (3, 4)]
    copied = sum(len(list(leaf.iterdir())) for leaf in old)  # one per job key (a clean and a contended: one)
    kept = _run([orchestrate_bin, "run", "--no-compact"], work)
    assert kept.returncode == 0 and "compacted" not in kept.stdout, kept.stdout + kept.stderr
    again = _run([orchestrate_bin, "run"], work)
    assert again.returncode == 0, again.stderr
    assert f"Nothing to do: all {n_jobs} jobs of sweep 'smoke' are complete" in again.stdout
    assert f"compacted 2 partitions of sweep smoke dated 2 or more days ago ({copied} fragments" in again.stdout
    assert all([p.name.split("-")[0] for p in leaf.iterdir()] == ["compact"] for leaf in old)
    assert sorted((work / "results").rglob("part-*.parquet")) == fragments  # today's: as the run wrote them

    res = _run([orchestrate_bin, "results", "--sweep", "smoke", "--all-runs"], work)  # every run: as DuckDB reads it
    assert res.returncode == 0, res.stderr
    reported = int(re.search(r"^sweep smoke: (\d+) rows", res.stdout, re.M).group(1))  # type: ignore[union-attr]

    interop = subprocess.run(
        [sys.executable, "-c", INTEROP, str(work / "results")], capture_output=True, text=True, timeout=120,
        cwd=tmp_path,  # not the repo: nothing of this package is importable by accident
    )  # fmt: skip
    assert interop.returncode == 0, interop.stderr
    got = json.loads(interop.stdout)
    assert got["duckdb"] == got["polars"] == reported
    assert got["pandas"] == got["polars_dir"] == got["pyarrow"] == reported  # their default calls on the directory
    assert got["ok"] == reported  # every row of the smoke sweep passed
    assert got["devices"] == 1 and got["backends"] == ["cpu"]  # a CPU run says so
    assert set(got["cases"]) == {c.case for c in smoke.cases}
    assert got["native_rel_error_max"] < 1e-4  # float32 NVFP4 vs the NumPy reference

    q = _run([orchestrate_bin, "query", "select count(*) as n from results", "--format", "csv"], work)
    assert q.returncode == 0, q.stderr
    assert q.stdout.strip().splitlines() == ["n", str(reported)]


@pytest.mark.parametrize("host", ["localhost", "127.0.0.1", socket.gethostname()])
def test_an_inventory_naming_this_machine_runs_here_and_starts_ray(
    host: str, tmp_path: Path, orchestrate_bin: str
) -> None:
    """The counterpart of issue 15's refusals: this machine, however it is named, runs its jobs here
    (and Ray's temp dir appears, which the bad-input tests check is absent)."""
    inv = tmp_path / "here.toml"
    inv.write_text(f'[[hosts]]\nname = "here"\nhost = "{host}"\ndevice = "cpu"\nbackend = "cpu"\n')
    sweep = tmp_path / "tiny.toml"
    sweep.write_text(
        'name = "tiny"\nrepetitions = 2\nwarmup = 0\n[[cases]]\ncase = "qmm"\narms = ["native"]\n'
        "params = { tokens = 1, n = 32, k = 64 }\n"
    )
    results = tmp_path / "results"
    ray_tmp = Path(tempfile.mkdtemp(prefix="r-", dir="/tmp"))  # short: Ray's socket paths must fit 107 bytes
    try:
        proc, _ = until_clean(lambda: subprocess.run(
            [orchestrate_bin, "run", "--inventory", str(inv), "--sweep", str(sweep), "--results", str(results)],
            capture_output=True, text=True, env=child_env(RAY_TMPDIR=str(ray_tmp)), timeout=600,
        ))  # fmt: skip
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert any(ray_tmp.rglob("session_*"))  # Ray started, under the temp dir RAY_TMPDIR names
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    table = read_rows(ResultStore(results), sweep="tiny")
    assert set(table.column("host").to_pylist()) == {"here"} and set(table.column("status").to_pylist()) == {"ok"}


def test_a_gpu_lock_that_stays_busy_ends_the_run_with_its_exit_code(tmp_path: Path, orchestrate_bin: str) -> None:
    """Another process holds this machine's GPU lock past the host's `max_wait`: the job's rows say
    so, its footer names the kind (`ErrorKind.LOCK_BUSY`), and `run` exits as the shell guard does."""
    lock = tmp_path / "gpu.lock"
    helper = str(REPO / "tests" / "workers" / "lock_helper.py")
    holder = subprocess.Popen([sys.executable, helper, "hold", str(lock), "0"], stdout=subprocess.PIPE, text=True,
                              cwd=REPO, env=child_env())  # fmt: skip
    inv = tmp_path / "here.toml"
    inv.write_text(
        f'[[hosts]]\nname = "here"\nhost = "localhost"\ndevice = "cpu"\nbackend = "cpu"\nlock = "{lock}"\n'
        "max_wait = 0.5\n"
    )
    sweep = tmp_path / "tiny.toml"
    sweep.write_text(
        'name = "tiny"\nrepetitions = 1\nwarmup = 0\n[[cases]]\ncase = "qmm"\narms = ["native"]\n'
        "params = { tokens = 1, n = 32, k = 64 }\n"
    )
    results = tmp_path / "results"
    try:
        assert holder.stdout is not None and holder.stdout.readline().startswith("held")
        proc = subprocess.run(
            [orchestrate_bin, "run", "--inventory", str(inv), "--sweep", str(sweep), "--results", str(results)],
            capture_output=True, text=True, env=child_env(), timeout=600,
        )  # fmt: skip
    finally:
        holder.kill()
        holder.wait()
    assert proc.returncode == EXIT_LOCK_TIMEOUT, proc.stdout + proc.stderr
    table = read_rows(ResultStore(results), sweep="tiny")
    assert set(table.column("status").to_pylist()) == {"failed"}
    assert f"gave up waiting for GPU lock {lock}" in table.column("error")[0].as_py()


def test_embedded_jobs_are_forked_from_the_fork_server_with_every_core(tmp_path: Path, orchestrate_bin: str) -> None:
    """The embedded node offers Ray one CPU (one worker started ahead, the one its slot needs);
    the jobs still run with the host's cores, each forked from the fork server. (The quiet gate is
    set out of reach: this test is about the process, not the contention, so it cannot be skipped.)"""
    inv = tmp_path / "here.toml"
    inv.write_text(
        '[[hosts]]\nname = "here"\ndevice = "cpu"\nbackend = "cpu"\n'
        f'lock = "{tmp_path / "gpu.lock"}"\ncpu_busy_threshold = 1e9\n'
    )
    sweep = tmp_path / "tiny.toml"
    sweep.write_text(
        'name = "tiny"\nrepetitions = 2\nwarmup = 0\n[[cases]]\ncase = "qmm"\narms = ["native"]\n'
        "params = { tokens = [1, 2], n = 32, k = 64 }\n"
    )
    results = tmp_path / "results"
    proc = subprocess.Popen(
        [orchestrate_bin, "run", "--inventory", str(inv), "--sweep", str(sweep), "--results", str(results)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=child_env(),
    )  # fmt: skip
    assert proc.stdout is not None
    lines, tree = [], set()
    for line in proc.stdout:
        lines.append(line)
        if line.startswith("[1/2]"):  # Ray's daemons and worker, the worker's fork server
            tree = {p for p in map(int, filter(str.isdigit, os.listdir("/proc"))) if is_descendant(p, proc.pid)}
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, "".join(lines) + out + err
    deadline = time.monotonic() + 30  # Ray stopped after the report, before the exit (its daemons' last exits)
    while time.monotonic() < deadline and any(pid_alive(p) for p in tree):
        time.sleep(0.2)
    assert tree and not [p for p in tree if pid_alive(p)]
    store = ResultStore(results)
    table = read_rows(store, sweep="tiny")
    assert set(table.column("threads").to_pylist()) == {os.cpu_count()}
    assert set(table.column("status").to_pylist()) == {"ok"}
    processes = [json.loads(pq.read_metadata(f).metadata[META_PHASES])["process"] for f in store.fragment_files()]
    # each from the node's fork server (which refuses to fork with a thread running: it would end,
    # and the jobs would start in fresh interpreters)
    assert len(processes) == 2 and all(p.startswith("forked from a fork server (mlx preloaded;") for p in processes), (
        processes
    )
