"""The `model` case end to end on the CPU: real checkpoints on disk, real fresh processes."""

from __future__ import annotations

import datetime as dt
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from kernels.checkpoint import DecoderConfig, write_checkpoint
from workers.contract import META_JOB_STATUS, JobContext, JobSpec, LockSettings, RowBuilder, Status
from workers.host.fingerprint import host_fingerprint
from workers.job.model import METRICS, model_cache_root, run_model_job
from workers.job.model_sample import greedy_digest
from workers.job.runner import run_job

TINY: dict[str, Any] = {"hidden": 128, "intermediate": 256, "layers": 2, "heads": 2, "vocab": 256}
PROMPT, DECODE = 48, 6


def _job(tmp_path: Path, *, arms: list[str], reps: int = 2, seed: int = 0, **params: Any) -> JobSpec:
    return JobSpec(
        run_id="run1",
        sweep="nvfp4-prefill",
        job_key=f"key-{seed}",
        case="model",
        case_name="model",
        params={"prompt_tokens": PROMPT, "decode_tokens": DECODE, **TINY, **params},
        arms=arms,
        device="cpu",
        repetitions=reps,
        warmup=1,
        seed=seed,
        # the CPU-quiet gate is not under test here: a busy shared machine would flag the job contended
        lock=LockSettings(path=str(tmp_path / "gpu.lock"), cpu_busy_threshold=1e9),
        spool_dir=str(tmp_path / "spool"),
    )


def _run(job: JobSpec) -> tuple[str, list[dict[str, Any]]]:
    ctx = JobContext(started_at=dt.datetime.now(dt.UTC))
    rows = RowBuilder(job, host_fingerprint(), ctx)
    status = run_model_job(job, rows, ctx)
    return status, rows.table(status).to_pylist()


def _by(rows: list[dict[str, Any]], arm: str, metric: str) -> list[dict[str, Any]]:
    return sorted((r for r in rows if r["arm"] == arm and r["metric"] == metric), key=lambda r: r["sample"])


def test_a_job_measures_load_prefill_decode_memory_and_digest(tmp_path: Path) -> None:
    """Through the lead's `run_job` (GPU lock, fingerprint, dispatch by kind), as a sweep runs it."""
    job = _job(tmp_path, arms=["native", "affine"])
    table = run_job(job)
    assert isinstance(table, pa.Table)
    assert (table.schema.metadata or {})[META_JOB_STATUS] == Status.OK.encode()
    rows = table.to_pylist()
    # arms x samples x metrics, one row per sample, and one layer check per arm
    assert len(rows) == 2 * 2 * len(METRICS) + 2
    assert {r["status"] for r in rows} == {Status.OK}
    units = {r["metric"]: r["unit"] for r in rows}
    assert units == {"load_seconds": "seconds", "prefill_tok_s": "tok/s", "decode_tok_s": "tok/s"} | {
        "peak_memory_bytes": "bytes",
        "rel_error": "ratio",
    }
    checks = {r["arm"]: r for r in rows if r["metric"] == "rel_error"}
    assert checks["native"]["value"] < 1e-5 and checks["native"]["sample"] == -1  # float32, same weights
    assert 0.02 < checks["affine"]["value"] < float(dict(checks["affine"]["extra"])["tolerance"])
    ckpt_bytes = sum(p.stat().st_size for p in (model_cache_root(job)).glob("*/model.safetensors"))
    assert ckpt_bytes > 100_000  # the generated checkpoint is on disk under the host spool
    for arm in ("native", "affine"):
        load = _by(rows, arm, "load_seconds")
        assert [r["sample"] for r in load] == [0, 1]
        assert all(0 < r["value"] < 60 for r in load)
        # A 48-token prompt through a 2-layer, 128-wide decoder: faster than 10 tok/s on any CPU,
        # and no CPU does 10 million.
        assert all(10 < r["value"] < 1e7 for r in _by(rows, arm, "prefill_tok_s"))
        assert all(1 < r["value"] < 1e6 for r in _by(rows, arm, "decode_tok_s"))
        # The peak holds at least the weights read from disk (float32 embeddings: 256 x 128 x 4).
        assert all(256 * 128 * 4 < r["value"] < 4 << 30 for r in _by(rows, arm, "peak_memory_bytes"))
        digests = {dict(r["extra"])["greedy_digest"] for r in rows if r["arm"] == arm}
        assert len(digests) == 1 and len(next(iter(digests))) == 16  # same weights, same tokens
        assert {r["prompt_tokens"] for r in rows} == {PROMPT}
    native_route = {r["route"] for r in rows if r["arm"] == "native"}
    affine_route = {r["route"] for r in rows if r["arm"] == "affine"}
    assert len(native_route) == 1 and "nvfp4" in native_route.pop()
    assert len(affine_route) == 1 and "repacked from NVFP4" in affine_route.pop()


def test_the_custom_arm_runs_our_kernels_on_every_projection_and_checks_out(tmp_path: Path) -> None:
    """Issue 20's whole-model arm: NVFP4 as stored, linears swapped for our kernels (their MLX twins
    here: the route says so), checked layer by layer, the same greedy tokens in every sample."""
    status, rows = _run(_job(tmp_path, arms=["custom"], reps=2))
    assert status == Status.OK and {r["status"] for r in rows} == {Status.OK}
    check = next(r for r in rows if r["metric"] == "rel_error")
    assert check["value"] < 1e-5 and "(M=" in dict(check["extra"])["layer"]  # both kernels' row counts
    routes = {r["route"] for r in rows}
    assert len(routes) == 1
    route = routes.pop()
    assert route.startswith("custom nvfp4 x14: decode ") and "prefill " in route
    assert ("mlx-twin" in route) != ("(gemv_nvfp4_" in route)
    digests = {dict(r["extra"])["greedy_digest"] for r in rows}
    assert len(digests) == 1
    assert all(10 < r["value"] < 1e7 for r in _by(rows, "custom", "prefill_tok_s"))


def test_a_sample_process_pays_no_transformers_import(tmp_path: Path) -> None:
    """Issue 13: mlx-lm's package start-up (transformers, and torch where installed: seconds of each
    fresh sample, BENCHMARKS.md) is not in a sample; its imports are timed apart from the load."""
    path = write_checkpoint(DecoderConfig(**TINY), 0, tmp_path / "ckpt")
    req = {"checkpoint": str(path), "arm": "native", "prompt_tokens": 8, "decode_tokens": 2, "warmup": 0,
           "seed": 0, "check": False}  # fmt: skip
    code = (
        "import json, sys\n"
        "from workers.job.model_sample import SampleRequest, measure_sample\n"
        f"s = measure_sample(SampleRequest(**json.loads({json.dumps(req)!r})))\n"
        "heavy = [m for m in ('transformers', 'torch') if m in sys.modules]\n"
        "print(json.dumps([s.imports_seconds, s.load_seconds, heavy]))"
    )
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    imports, load, heavy = json.loads(out.stdout.strip().splitlines()[-1])
    assert heavy == []
    assert 0 < imports < 60 and 0 < load < 60


def test_the_digest_is_stable_for_the_same_weights_and_changes_with_them(tmp_path: Path) -> None:
    status_a, rows_a = _run(_job(tmp_path, arms=["native"], reps=1, seed=0))
    status_b, rows_b = _run(_job(tmp_path, arms=["native"], reps=1, seed=0))
    status_c, rows_c = _run(_job(tmp_path, arms=["native"], reps=1, seed=5))
    assert status_a == status_b == status_c == Status.OK

    def digest(rows: list[dict[str, Any]]) -> str:
        (d,) = {dict(r["extra"])["greedy_digest"] for r in rows}
        return d

    assert digest(rows_a) == digest(rows_b)
    assert digest(rows_a) != digest(rows_c)  # other weights (and prompt), other greedy tokens
    assert len(list(model_cache_root(_job(tmp_path, arms=["native"])).iterdir())) == 2  # one per seed


def test_a_missing_checkpoint_is_unsupported_not_a_crash(tmp_path: Path) -> None:
    missing = tmp_path / "models" / "gemma-4-31b-it-nvfp4"
    status, rows = _run(_job(tmp_path, arms=["native", "affine"], checkpoint=str(missing)))
    assert status == Status.UNSUPPORTED
    assert {r["status"] for r in rows} == {Status.UNSUPPORTED}
    assert {r["arm"] for r in rows} == {"native", "affine"}
    assert all(r["value"] is None and str(missing) in r["error"] for r in rows)
    assert {r["checkpoint"] for r in rows} == {str(missing)}


def test_a_named_checkpoint_is_used_as_it_is(tmp_path: Path) -> None:
    ckpt = write_checkpoint(DecoderConfig(architecture="llama", **TINY), 3, tmp_path / "my-model")
    status, rows = _run(_job(tmp_path, arms=["native"], reps=1, checkpoint=str(ckpt)))
    assert status == Status.OK
    assert {dict(r["extra"])["checkpoint"] for r in rows} == {str(ckpt)}
    assert not model_cache_root(_job(tmp_path, arms=["native"])).exists()  # nothing generated


def test_a_broken_checkpoint_fails_with_the_reason(tmp_path: Path) -> None:
    ckpt = write_checkpoint(DecoderConfig(**TINY), 0, tmp_path / "broken")
    (ckpt / "model.safetensors").write_bytes(b"not a safetensors file")
    status, rows = _run(_job(tmp_path, arms=["native", "affine"], reps=2, checkpoint=str(ckpt)))
    assert status == Status.FAILED
    assert {r["status"] for r in rows} == {Status.FAILED}
    assert all(r["error"] and r["error"].startswith("exit 1") for r in rows)
    assert len(rows) == 2 * len(METRICS)  # a failed arm is not retried in every repetition


def test_greedy_digest_is_of_the_token_ids() -> None:
    assert greedy_digest([1, 2, 3]) == greedy_digest([1, 2, 3])
    assert greedy_digest([1, 2, 3]) != greedy_digest([1, 2, 4])
    assert greedy_digest([12, 3]) != greedy_digest([1, 23])


@pytest.mark.parametrize("arms", [["native", "affine"]])
def test_unknown_architecture_fails_the_job_cleanly(tmp_path: Path, arms: list[str]) -> None:
    status, rows = _run(_job(tmp_path, arms=arms, reps=1, architecture="mamba"))
    assert status == Status.FAILED
    assert all("architecture" in r["error"] for r in rows)


def test_an_arm_over_its_layer_tolerance_fails_all_its_rows(tmp_path: Path) -> None:
    """A check over tolerance fails the arm's timing rows too: a wrong model is not a fast one."""
    from workers.job.model import _arm_rows
    from workers.job.model_sample import Sample

    job = _job(tmp_path, arms=["native"])
    rows = RowBuilder(job, host_fingerprint(), JobContext(started_at=dt.datetime.now(dt.UTC)))
    common = dict(load_seconds=1.0, prefill_tok_s=100.0, decode_tok_s=10.0, peak_memory_bytes=1e6)
    good = Sample(**common, greedy_digest="a" * 16, route="r", device="cpu")  # type: ignore[arg-type]
    bad = Sample(**common, greedy_digest="a" * 16, route="r", device="cpu", rel_error=0.99, tolerance=0.01)  # type: ignore[arg-type]
    bad.checked = "model.layers.0.mlp.up_proj (worst of 14)"
    assert _arm_rows(rows, "native", [(0, bad, (0.0, 1.0)), (1, good, (1.0, 2.0))], "/ckpt") == Status.FAILED
    assert {r["status"] for r in rows.rows} == {Status.FAILED}
    assert all("rel_error 0.99 over tolerance 0.01 at model.layers.0.mlp.up_proj" in r["error"] for r in rows.rows)
    rows.rows.clear()
    flaky = Sample(**common, greedy_digest="b" * 16, route="r", device="cpu")  # type: ignore[arg-type]
    # greedy output that differs between samples is recorded on every row, each sample keeping its own
    assert _arm_rows(rows, "native", [(0, good, (0.0, 1.0)), (1, flaky, (1.0, 2.0))], "/ckpt") == Status.OK
    assert {r["status"] for r in rows.rows} == {Status.OK}
    assert all(dict(r["extra"])["greedy_digests"] == "a" * 16 + "," + "b" * 16 for r in rows.rows)
    assert {dict(r["extra"])["greedy_digest"] for r in rows.rows if r["sample"] == 1} == {"b" * 16}
