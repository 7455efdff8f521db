"""A small, fixed set of H200 numbers for the `nvfp4-prefill` sweep, as result rows.

Per point and arm ONE value, the median an early H200 run of the sweep measured (the mlp table
gives means), stored as a single sample, so that the report and its tests have GPU-shaped numbers
without reading a store. The report made from them shows no intervals, and its timing comparisons
and criteria say `n=1: too few to judge` (peak memory, exact by construction, is judged); the real
rows in `docs/h200-results/` make the published screenshot (see `report_screenshot`). Each row
says where it comes from: run `benchmarks-md-h200`, code version `transcribed from BENCHMARKS.md`.

Derived metrics are computed as the worker computes them from the same sample
(`workers/job/measure.py`): seconds = tokens / tok/s (qmm decode: the published time per call), and
qmm's GB/s and TFLOP/s from `kernels.qmm`'s byte and FLOP counts. The device's peaks are the ones
the worker's probes stamped on that H200's rows (copy 3560 GB/s, 774 TFLOP/s bf16).
"""

from __future__ import annotations

import datetime as dt
from typing import Any

import pyarrow as pa

from kernels.qmm import qmm_bytes, qmm_flops
from orchestrator.run.plan import points
from orchestrator.specs.sweep import SweepSpec, load_sweep
from tests.orchestrator.synthetic_rows import concat
from workers.contract import HostFingerprint, JobContext, JobSpec, RowBuilder

RUN_ID = "benchmarks-md-h200"
PEAK_COPY_GB_S = 3560.0
PEAK_TFLOP_S = 774.0
FINGERPRINT = HostFingerprint(
    hostname="h200-host",
    os="Linux",
    machine="x86_64",
    cpu="not recorded in BENCHMARKS.md",
    cpu_count=16,
    memory_bytes=128 * 2**30,
    gpu="NVIDIA H200",
    gpu_driver="580.159.04",
    mlx_version="0.32.4",
    mlx_device="Device(gpu, 0)",
    backend="cuda",
    threads=16,
    fingerprint_id="h200-benchmarks-md",
)
# qmm, N=21504, K=5376, bfloat16: prefill tok/s and peak memory at 4096 and 16384 tokens; the
# decode GEMV's time per call at tokens=1.
QMM_PREFILL = {4096: {"affine": 599_883, "native": 460_167}, 16384: {"affine": 624_140, "native": 491_937}}
QMM_PEAK = {4096: {"affine": 526e6, "native": 615e6}, 16384: {"affine": 1.72e9, "native": 2.07e9}}
QMM_DECODE_SECONDS = {"affine": 71.0e-6, "native": 74.7e-6, "dequant-gemm": 418e-6}
# mlp (GeGLU 5376 -> 21504, bf16): prefill tok/s, the means of 20 samples.
MLP_PREFILL = {
    2048: {"fused": 148_431, "op-at-a-time": 148_276, "eager": 142_171},
    8192: {"fused": 157_594, "op-at-a-time": 156_761, "eager": 151_572},
}
# model (a generated Gemma-3-27B-wide decoder, 4 layers, 64 decode tokens): per prompt length.
MODEL = {
    512: {
        "affine": {"prefill_tok_s": 30_489, "decode_tok_s": 417, "peak_memory_bytes": 2.56e9, "load_seconds": 0.74},
        "native": {"prefill_tok_s": 25_515, "decode_tok_s": 370, "peak_memory_bytes": 2.12e9, "load_seconds": 0.65},
    },
    4096: {
        "affine": {"prefill_tok_s": 40_911, "decode_tok_s": 405, "peak_memory_bytes": 6.19e9, "load_seconds": 0.74},
        "native": {"prefill_tok_s": 32_530, "decode_tok_s": 390, "peak_memory_bytes": 6.19e9, "load_seconds": 0.61},
    },
}
UNITS = {
    "prefill_tok_s": "tok/s",
    "decode_tok_s": "tok/s",
    "peak_memory_bytes": "bytes",
    "load_seconds": "seconds",
    "seconds": "seconds",
}


def _job(spec: SweepSpec, case: str, params: dict[str, Any], arms: list[str]) -> RowBuilder:
    job = JobSpec(
        run_id=RUN_ID,
        sweep=spec.name,
        job_key=f"{case}-{sorted(params.items())}",
        case=case,
        case_name=case,
        params=params,
        arms=arms,
        device="h200",
        repetitions=1,
        warmup=0,
        code_version="transcribed from BENCHMARKS.md",
    )
    context = JobContext(started_at=dt.datetime(2026, 11, 30, 12, 0, tzinfo=dt.UTC))
    return RowBuilder(job, FINGERPRINT, context)


def _with_peaks(table: pa.Table) -> pa.Table:
    for name, value in (("peak_copy_gb_s", PEAK_COPY_GB_S), ("peak_tflop_s", PEAK_TFLOP_S)):
        column = pa.array([value] * table.num_rows, pa.float64())
        table = table.set_column(table.schema.get_field_index(name), name, column)
    return table


def _point(spec: SweepSpec, case: str, length_param: str, length: int) -> dict[str, Any]:
    entry = next(e for e in spec.cases if e.case == case)
    return next(p for p in points(entry) if p[length_param] == length)


def _qmm(spec: SweepSpec) -> list[pa.Table]:
    out = []
    for tokens in (1, *QMM_PREFILL):
        params = _point(spec, "qmm", "tokens", tokens)
        n, k = int(params["n"]), int(params["k"])
        flops, moved = qmm_flops(tokens, n, k), qmm_bytes(tokens, n, k, 2)
        seconds = QMM_DECODE_SECONDS if tokens == 1 else {arm: tokens / v for arm, v in QMM_PREFILL[tokens].items()}
        rows = _job(spec, "qmm", params, list(seconds))
        for arm, s in seconds.items():
            common: dict[str, Any] = {"sample": 0, "flops": flops, "bytes_moved": moved}
            rows.add(arm, "seconds", s, "seconds", **common)
            rows.add(arm, "decode_tok_s" if tokens == 1 else "prefill_tok_s", tokens / s, "tok/s", **common)
            rows.add(arm, "gb_per_s", moved / s / 1e9, "GB/s", **common)
            rows.add(arm, "tflop_per_s", flops / s / 1e12, "TFLOP/s", **common)
            if tokens in QMM_PEAK:
                rows.add(arm, "peak_memory_bytes", QMM_PEAK[tokens][arm], "bytes")
        out.append(_with_peaks(rows.table("ok")))
    return out


def _jobs(
    spec: SweepSpec, case: str, length_param: str, data: dict[int, dict[str, dict[str, float]]]
) -> list[pa.Table]:
    """One job per length: `data[length][arm][metric]` as one sample each."""
    out = []
    for length, arms in data.items():
        rows = _job(spec, case, _point(spec, case, length_param, length), list(arms))
        for arm, metrics in arms.items():
            for metric, value in metrics.items():
                rows.add(arm, metric, float(value), UNITS[metric], sample=0)
        out.append(_with_peaks(rows.table("ok")))
    return out


def h200_rows() -> tuple[pa.Table, SweepSpec]:
    """BENCHMARKS.md's H200 numbers of the first seed's sweep as rows, with that sweep's spec."""
    spec = load_sweep("nvfp4-prefill")
    mlp = {
        tokens: {arm: {"prefill_tok_s": v, "seconds": tokens / v} for arm, v in arms.items()}
        for tokens, arms in MLP_PREFILL.items()
    }
    return concat(
        [*_qmm(spec), *_jobs(spec, "mlp", "tokens", mlp), *_jobs(spec, "model", "prompt_tokens", MODEL)]
    ), spec
