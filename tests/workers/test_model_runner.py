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
from workers.job.runner import run_job
from workers.job.steady import digest as greedy_digest

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
    # arms x rounds x metrics (cold loads: 2 metrics, steady state: 3), and one layer check per arm
    assert len(rows) == 2 * 2 * len(METRICS) + 2
    assert {r["status"] for r in rows} == {Status.OK}
    units = {r["metric"]: r["unit"] for r in rows}
    assert units == {"load_seconds": "seconds", "prefill_tok_s": "tok/s", "decode_tok_s": "tok/s"} | {
        "peak_memory_bytes": "bytes",
        "token_latency_ms": "ms",
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
        for r in load:  # the parts of the load add up to it (less the calls between them)
            parts = {k: float(v) for k, v in r["extra"] if k.startswith("load_") and k.endswith("_s")}
            assert set(parts) == {"load_reading_s", "load_building_s", "load_repacking_s", "load_evaluating_s"}
            assert all(v >= 0 for v in parts.values()) and 0.8 * r["value"] < sum(parts.values()) <= r["value"]
        # A 48-token prompt through a 2-layer, 128-wide decoder: faster than 10 tok/s on any CPU,
        # and no CPU does 10 million.
        assert all(10 < r["value"] < 1e7 for r in _by(rows, arm, "prefill_tok_s"))
        decode = _by(rows, arm, "decode_tok_s")
        assert [r["sample"] for r in decode] == [0, 1]
        for r in decode:
            extra = dict(r["extra"])
            assert 1 < r["value"] < 1e6 and extra["window_tokens"] == str(DECODE)
            assert 0 < float(extra["host_share"]) <= 1
            assert 0 < float(extra["build_ms_per_step"]) <= float(extra["host_ms_per_step"])
            # a window's tokens per second is its tokens over its wall time, which holds the host's part
            assert float(extra["host_ms_per_step"]) <= 1e3 / r["value"] * 1.001
            assert extra["stop_reason"] == "fixed" and extra["rounds"] == "2"
        latency = _by(rows, arm, "token_latency_ms")
        assert [r["sample"] for r in latency] == [0, 1] and all(0 < r["value"] < 1e4 for r in latency)
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
    req = {"checkpoint": str(path), "arm": "native", "prompt_tokens": 8, "seed": 0}
    code = (
        "import json, sys\n"
        "from workers.job.model_sample import LoadRequest, measure_load\n"
        f"s = measure_load(LoadRequest(**json.loads({json.dumps(req)!r})))\n"
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
    from workers.job.model import Loads, _arm_rows
    from workers.job.model_sample import LoadSample
    from workers.job.steady import ArmOutcome, SteadyResult, Timed

    job = _job(tmp_path, arms=["native"])
    rows = RowBuilder(job, host_fingerprint(), JobContext(started_at=dt.datetime.now(dt.UTC)))
    load = LoadSample(load_seconds=1.0, parts={"reading": 0.5}, peak_memory_bytes=1e6, route="r", device="cpu")
    loads = Loads([(0, load, (0.0, 1.0))])

    def steady(outcome: ArmOutcome, digests: list[str]) -> SteadyResult:
        timed = [Timed("decode_tok_s", "native", i, 10.0, (2.0 + i, 3.0 + i), {"greedy_digest": d})
                 for i, d in enumerate(digests)]  # fmt: skip
        outcome.digests = digests
        extras = {"decode_tok_s": {"native": {"stop_reason": "fixed"}}}
        return SteadyResult(timed, {"native": outcome}, extras, {}, "cpu")

    bad = ArmOutcome(route="r", rel_error=0.99, tolerance=0.01, checked="model.layers.0.mlp.up_proj (worst of 14)")
    assert _arm_rows(rows, "native", loads, {}, steady(bad, ["a" * 16] * 2), "/ckpt") == Status.FAILED
    assert len(rows.rows) == 2 + 1 + 2  # load and peak memory, the check, two windows
    assert {r["status"] for r in rows.rows} == {Status.FAILED}
    assert all("rel_error 0.99 over tolerance 0.01 at model.layers.0.mlp.up_proj" in r["error"] for r in rows.rows)
    rows.rows.clear()
    good = ArmOutcome(route="r", rel_error=0.001, tolerance=0.01)
    # greedy output that differs between windows is recorded on every row, each window keeping its own
    assert _arm_rows(rows, "native", loads, {}, steady(good, ["a" * 16, "b" * 16]), "/ckpt") == Status.OK
    assert {r["status"] for r in rows.rows} == {Status.OK}
    assert all(dict(r["extra"])["greedy_digests"] == "a" * 16 + "," + "b" * 16 for r in rows.rows)
    assert {dict(r["extra"])["greedy_digest"] for r in rows.rows if r["sample"] == 1} == {"b" * 16}


def _windows(job: JobSpec) -> tuple[str, list[dict[str, Any]], list[tuple[float, float]]]:
    ctx = JobContext(started_at=dt.datetime.now(dt.UTC))
    rows = RowBuilder(job, host_fingerprint(), ctx)
    status = run_model_job(job, rows, ctx)
    return status, rows.table(status).to_pylist(), rows.windows


def test_steady_rounds_are_abba_and_stop_at_the_precision_target(tmp_path: Path) -> None:
    """A loose target is met as soon as the interval can be trusted (`MIN_BLOCKS` blocks): every
    timed value says so, with its half-width; prefills and decode windows alternate ABBA in time."""
    from workers.contract.precision import MIN_BLOCKS, ROUNDS_PER_BLOCK
    from workers.job.steady import measure_steady

    ckpt = write_checkpoint(DecoderConfig(**TINY), 0, tmp_path / "ckpt")
    job = _job(tmp_path, arms=["native", "affine"])
    job.options = {"precision": 0.5, "max_seconds": 300, "baseline": "affine"}
    params = {"prompt_tokens": PROMPT, "decode_tokens": DECODE}
    result = measure_steady(job, ckpt, ["native", "affine"], params, 0.0)
    rounds = MIN_BLOCKS * ROUNDS_PER_BLOCK
    abba = [arm for r in range(rounds) for arm in (["native", "affine"] if r % 2 == 0 else ["affine", "native"])]
    for metric in ("prefill_tok_s", "decode_tok_s", "token_latency_ms"):
        timed = sorted((t for t in result.timed if t.metric == metric), key=lambda t: t.window)
        assert [t.arm for t in timed] == abba, metric
        assert [t.round for t in timed] == [r for r in range(rounds) for _ in range(2)]
        for arm in ("native", "affine"):
            extra = result.extras[metric][arm]
            assert extra["stop_reason"] == "precision" and extra["rounds"] == str(rounds), metric
            assert 0 < float(extra["half_width"]) <= 0.5
    # every window of an arm decodes the same prefilled state: one digest per arm, in every window
    assert {len(set(o.digests)) for o in result.arms.values()} == {1}
    assert all(len(o.digests) == rounds for o in result.arms.values())
    assert all(t.value > 0 for t in result.timed)


def test_a_sampling_phase_gets_a_third_of_the_budget_and_what_the_one_before_left(tmp_path: Path) -> None:
    from workers.job.steady import budget_share

    job = _job(tmp_path, arms=["native", "affine"])
    job.options = {"precision": 0.01, "max_seconds": 90, "baseline": "affine"}
    assert budget_share(job).options["max_seconds"] == 30
    assert budget_share(job, 12.5).options["max_seconds"] == 42.5  # the prefill stopped 12.5 s early
    assert budget_share(job, -2.0).options["max_seconds"] == 30  # it overran its share: nothing is taken back
    assert budget_share(job).options["precision"] == 0.01 and job.options["max_seconds"] == 90
    job.options = {}
    assert budget_share(job, 5.0).options == {}  # no budget: the minimum rounds, or the target


def test_an_unreachable_target_samples_until_its_budget(tmp_path: Path) -> None:
    """A target no run can reach: each sampling phase takes its share of the budget (the cold loads
    what the others left), then stops on a whole ABBA block; cold loads alternate ABBA too."""
    job = _job(tmp_path, arms=["native", "affine"])
    job.options = {"precision": 1e-9, "max_seconds": 3, "baseline": "affine"}
    status, rows, windows = _windows(job)
    assert status == Status.OK
    loads = sorted(
        (w, r["arm"], r["sample"]) for w, r in zip(windows, rows, strict=True) if r["metric"] == "load_seconds"
    )
    abba = [("native", r) if i % 2 == (r % 2) else ("affine", r) for r in range(len(loads) // 2) for i in range(2)]
    assert [(arm, sample) for _, arm, sample in loads] == abba
    # peak memory comes from the loads of the minimum rounds, which run the model after loading it
    peaks = sorted((r["arm"], r["sample"]) for r in rows if r["metric"] == "peak_memory_bytes")
    assert peaks == sorted((arm, s) for _, arm, s in loads if s < job.repetitions)
    for metric in ("load_seconds", "prefill_tok_s", "decode_tok_s", "token_latency_ms"):
        timed = [r for r in rows if r["metric"] == metric]
        reasons = {dict(r["extra"])["stop_reason"] for r in timed}
        (taken,) = {int(dict(r["extra"])["rounds"]) for r in timed}
        assert reasons == {"budget"}, metric
        assert taken >= 2 and taken % 2 == 0 and len(timed) == 2 * taken  # whole ABBA blocks
