"""`orchestrate phases`: each stored job by name, its phases and its measured shares.

On the real H200 store in `docs/h200-results` (compacted: a job's footer facts carry no point, so the
names come from the rows) and on a store of fresh fragments written here.
"""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq

from orchestrator.run.account import MEASURED, WARMED, job_labels, job_phases_table
from orchestrator.store.fragments import ResultStore
from tests.orchestrator.test_cli import orchestrate
from tests.orchestrator.test_dataset import write_job
from workers.contract import META_JOB_SECONDS, META_PHASES

H200 = Path(__file__).resolve().parents[2] / "docs" / "h200-results"
RUN = "20261202T080023Z-475f"  # nvfp4-prefill with r256x128k64s5qey: 7 qmm, 6 model and 2 mlp jobs
WARM_RUN = "20261202T111742Z-f25c"  # the same sweep with standbys and warming, on a host whose caches were warm


def rows_of(out: str) -> dict[str, list[str]]:
    """The table's body rows by their job column (rich's box drawing split off)."""
    rows: dict[str, list[str]] = {}
    for line in out.splitlines():
        cells = [c.strip() for c in line.split("│")[1:-1]]
        if len(cells) > 3 and cells[1]:
            rows[cells[1]] = cells
    return rows


def test_the_h200_jobs_are_named_by_what_tells_them_apart_and_their_shares_are_the_footers(
    orchestrate_bin: str,
) -> None:
    store = ResultStore(H200)
    labels = {k: v for k, v in job_labels(store, "nvfp4-prefill", RUN).items() if k[0] == RUN}
    assert sorted(labels.values()) == sorted(
        [f"qmm tokens={t}" for t in (1, 512, 1024, 2048, 4096, 8192, 16384)]
        + [f"model prompt_tokens={t}" for t in (512, 1024, 2048, 4096, 8192, 16384)]
        + ["mlp tokens=2048", "mlp tokens=8192"]
    )  # n, k, dtype and the model's shape are the same in every job of their case: left out

    done = orchestrate(
        orchestrate_bin, "phases", "--sweep", "nvfp4-prefill", "--run", RUN, "-r", str(H200), columns="400"
    )
    assert done.returncode == 0, done.stderr
    rows = rows_of(done.stdout)
    assert set(rows) >= set(labels.values()) and f"phases of {len(labels)} jobs" in done.stdout
    header = next(line for line in done.stdout.splitlines() if "device" in line and "job" in line)
    assert "warm-up" in done.stdout and "timed %" in done.stdout and "key" in header
    for job in job_phases_table(store, "nvfp4-prefill", RUN):
        total = sum(job.phases.values())
        timed, warmed = (round(100 * sum(job.phases.get(p, 0.0) for p in part) / total) for part in (MEASURED, WARMED))
        cells = rows[labels[(job.run_id, job.job_key)]]
        assert cells[2] == job.job_key[:8] and float(cells[3]) == round(total, 2)
        assert (int(cells[-2]), int(cells[-1])) == (timed, warmed), (cells[1], cells[-2:])
    # the shares this stored run holds: the 512-token qmm job 49 %, 16384 tokens 69 %
    assert rows["qmm tokens=512"][-1] == "49" and rows["qmm tokens=16384"][-1] == "69"


def test_the_h200_run_with_standbys_and_warming_has_every_qmm_job_at_least_half_measured(
    orchestrate_bin: str,
) -> None:
    """The stored run on a warm host (made by code that opened each job's device ahead and warmed the
    first job's kernels beside Ray's start): each qmm job's warm-up and timed samples at least half
    its wall time, 54-74 %; on a fresh machine the GEMM's first compile falls into the 512-token
    job's warm-up, so that run is not the one checked."""
    done = orchestrate(
        orchestrate_bin, "phases", "--sweep", "nvfp4-prefill", "--run", WARM_RUN, "-r", str(H200), columns="400"
    )
    assert done.returncode == 0, done.stderr
    rows = rows_of(done.stdout)
    shares = {name: int(cells[-1]) for name, cells in rows.items() if name.startswith("qmm tokens=")}
    assert len(shares) == 7 and min(shares.values()) >= 50, shares
    assert shares["qmm tokens=512"] == 60 and shares["qmm tokens=1"] == 65  # as the stored run holds them
    store = ResultStore(H200)
    for job in job_phases_table(store, "nvfp4-prefill", WARM_RUN):
        assert "its device opened ahead" in job.process  # every job, the first included, ran in a standby


def test_fresh_fragments_are_named_from_their_rows(tmp_path: Path, orchestrate_bin: str) -> None:
    store = ResultStore(tmp_path / "results")
    run = "20261130T020000Z-aaaa"
    for i, phases in enumerate(
        ({"warmup": 1.0, "timed": 1.0, "build": 2.0}, {"warmup": 0.5, "timed": 2.5, "reference": 1.0})
    ):
        path = write_job(store, i, run_id=run)
        table = pq.read_table(path)  # add the phases a worker writes in the footer
        meta = {**(table.schema.metadata or {}), META_PHASES: json.dumps(phases).encode()}
        meta[META_JOB_SECONDS] = str(sum(phases.values())).encode()
        pq.write_table(table.replace_schema_metadata(meta), path)
    assert sorted(job_labels(store, run=run).values()) == ["qmm tokens=1", "qmm tokens=2"]

    done = orchestrate(orchestrate_bin, "phases", "-r", str(store.root), columns="300")
    assert done.returncode == 0, done.stderr
    rows = rows_of(done.stdout)
    assert (rows["qmm tokens=1"][-2], rows["qmm tokens=1"][-1]) == ("25", "50")  # 1 of 4 s timed, 2 with warm-up
    assert (rows["qmm tokens=2"][-2], rows["qmm tokens=2"][-1]) == ("62", "75")  # 2.5 and 3 of 4 s
    assert rows["qmm tokens=2"][2] == "00000000" and "0000000000000001" not in done.stdout  # the key, cut to 8
