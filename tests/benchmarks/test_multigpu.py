"""benchmarks/multigpu.py's parts on the CPU: the sweeps it writes and the summary's arithmetic.

The summary reads stored fragments made here with the real row builder and schema, at known job
start times, durations and per-GPU samples, so its throughput ratio and per-GPU verdicts have
known answers. (`benchmarks/device_multigpu.sh` itself runs on a machine with several GPUs.)
"""

from __future__ import annotations

import datetime as dt
import json
import re
from pathlib import Path

import numpy as np

from benchmarks import multigpu
from orchestrator.run.plan import expand
from orchestrator.specs.sweep import InventorySpec, load_sweep
from orchestrator.store.fragments import ResultStore
from workers.contract import META_JOB_SECONDS, META_PHASES, JobContext, JobSpec, RowBuilder, Status
from workers.host.fingerprint import static_fingerprint

T0 = dt.datetime(2026, 12, 1, 12, 0, tzinfo=dt.UTC)


def test_the_sweeps_are_identical_jobs_with_distinct_keys(tmp_path: Path) -> None:
    paths = {p.stem: p for p in multigpu.write_sweeps(tmp_path, gpus=4, per_gpu=2, one_gpu=3)}
    inv = InventorySpec.model_validate({"hosts": [{"name": "l", "device": "h200", "backend": "cuda"}]})
    counts = {}
    for name, path in paths.items():
        jobs = expand(load_sweep(str(path)), inv, ["h200"], run_id="r", version="v", digest="d")
        counts[name] = len({j.job_key for j in jobs})
        assert len({json.dumps(j.params, sort_keys=True) for j in jobs}) == 1  # one point, repeated
        assert len({tuple(j.arms) for j in jobs}) == 1
    assert counts == {"mg1-qmm": 3, "mg1-moe": 3, "mgN-qmm": 8, "mgN-moe": 8, "mg-loss": 5}
    qmm = expand(load_sweep(str(paths["mgN-qmm"])), inv, ["h200"], run_id="r", version="v", digest="d")[0]
    assert qmm.params == {"tokens": 4096, "n": 21504, "k": 5376, "dtype": "bfloat16"}  # the seed's shape
    assert qmm.arms == ["native", "affine", "dequant-gemm", "dense", "custom", "auto"]


def _store_job(store: ResultStore, sweep: str, key: str, gpu: int, start_s: float, seconds: float, values: list[float]):
    job = JobSpec(
        run_id="20261201T120000Z-abcd", sweep=sweep, job_key=key, case="qmm", case_name="qmm-r0",
        params={"tokens": 4096}, arms=["native"], device="h200", backend="cuda", repetitions=len(values), warmup=0,
    )  # fmt: skip
    fp = static_fingerprint("cpu").model_copy(update={"gpu_index": gpu, "gpu_uuid": f"fake-gpu-{gpu}"})
    rows = RowBuilder(job, fp, JobContext(started_at=T0 + dt.timedelta(seconds=start_s)))
    for i, v in enumerate(values):
        rows.add("native", "seconds", v, "seconds", sample=i)
    table = rows.table(Status.OK)
    meta = {**(table.schema.metadata or {}), META_JOB_SECONDS: f"{seconds + 0.5}".encode()}
    meta[META_PHASES] = json.dumps({"fingerprint": 0.5}).encode()  # started_at is taken after it
    store.write(table.replace_schema_metadata(meta), sweep=sweep, date=T0.date(), device="h200",
                run_id=job.run_id, job_key=key)  # fmt: skip


def test_the_summary_judges_throughput_and_tells_the_gpus_apart(tmp_path: Path) -> None:
    store = ResultStore(tmp_path)
    rng = np.random.default_rng(7)
    for i in range(2):  # one GPU: two 30 s jobs back to back = 60 s
        _store_job(store, "mg1-qmm", f"a{i}", 0, 30.0 * i, 30.0, list(1e-3 * (1 + 0.03 * rng.standard_normal(10))))
    for i in range(4):  # two GPUs, two jobs each, 31 s apiece: 62 s; GPU 1 is 10 % slower per sample
        gpu, slot = i % 2, i // 2
        scale = 1.10 if gpu == 1 else 1.0
        samples = list(1e-3 * scale * (1 + 0.03 * rng.standard_normal(10)))
        _store_job(store, "mgN-qmm", f"b{i}", gpu, 31.0 * slot, 31.0, samples)
    lines = multigpu.summary(tmp_path, gpus=2, killed=None)
    qmm = next(ln for ln in lines if ln.startswith("throughput qmm"))
    # 4 jobs / 62 s over 2 jobs / 60 s = 1.935 >= 0.9 x 2
    assert "1 GPU 2 jobs in 60.0 s" in qmm and "2 GPUs 4 jobs in 62.0 s" in qmm
    assert "ratio 1.935 vs 0.9 x 2 = 1.80: PASS" in qmm
    assert any(ln.startswith("throughput moe: missing") for ln in lines)  # not measured: not judged
    assert lines[-1] == "throughput criterion: FAIL or not judged"
    gpu1 = next(ln for ln in lines if "native seconds gpu1" in ln)
    ratio, low, high = (float(x) for x in re.search(r"vs gpu0: ([\d.]+) \[([\d.]+), ([\d.]+)\]", gpu1).groups())  # type: ignore[union-attr]
    assert gpu1.endswith("SLOWER") and 1.06 < ratio < 1.14 and low > 1.03 and low < ratio < high, gpu1
    assert "gpus: 0=fake-gpu-0, 1=fake-gpu-1" in lines

    for i in range(2):  # the other sweep too, with GPUs alike: its medians per GPU are the SAME
        _store_job(store, "mg1-moe", f"c{i}", 0, 40.0 * i, 40.0, [1e-3] * 10)
    for i in range(4):
        _store_job(
            store, "mgN-moe", f"d{i}", i % 2, 50.0 * (i // 2), 50.0, list(1e-3 * (1 + 0.005 * rng.standard_normal(10)))
        )
    lines = multigpu.summary(tmp_path, gpus=2, killed=None)
    moe = next(ln for ln in lines if ln.startswith("throughput moe"))
    assert "ratio 1.600 vs 0.9 x 2 = 1.80: FAIL" in moe  # 4 / 100 s against 2 / 80 s
    alike = next(ln for ln in lines[lines.index("-- medians per GPU, mgN-moe") :] if "seconds gpu1" in ln)
    assert alike.endswith("SAME"), alike
    assert lines[-1] == "throughput criterion: FAIL or not judged"
