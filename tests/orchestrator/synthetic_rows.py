"""Result rows made through the real `RowBuilder`, with values the test chooses.

Statistics, comparison, criteria and report tests run on these tables: the same schema, columns
and metadata a worker writes, without running kernels.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping, Sequence

import numpy as np
import pyarrow as pa

from orchestrator.report.units import unit_of
from workers.contract import SCHEMA, HostFingerprint, JobContext, JobSpec, RowBuilder


def fingerprint(device: str) -> HostFingerprint:
    """A plausible host fingerprint for `device`."""
    return HostFingerprint(
        hostname=f"{device}-host",
        os="Linux-6.1",
        machine="x86_64",
        cpu="Test CPU",
        cpu_count=2,
        memory_bytes=24 * 2**30,
        gpu=None if device == "cpu" else f"{device} GPU",
        mlx_version="0.32.4",
        mlx_device="Device(cpu, 0)" if device == "cpu" else "Device(gpu, 0)",
        backend="cpu" if device == "cpu" else "cuda",
        threads=2,
        fingerprint_id=f"fp-{device}",
    )


def job_table(
    values: Mapping[str, Mapping[str, Sequence[float]]],
    *,
    params: Mapping[str, int | float | str | bool],
    device: str = "cpu",
    case: str = "qmm",
    case_name: str | None = None,
    sweep: str = "test-sweep",
    run_id: str = "run1",
    status: str = "ok",
    contended: bool = False,
    error: str | None = None,
    peaks: tuple[float, float] | None = None,
    started_at: dt.datetime | None = None,
    code_version: str = "abc123",
) -> pa.Table:
    """One job's rows: `values[arm][metric]` is the list of samples (one value: sample -1)."""
    job = JobSpec(
        run_id=run_id,
        sweep=sweep,
        job_key=f"{device}-{case_name or case}-{sorted(params.items())}-{run_id}",
        case=case,
        case_name=case_name or case,
        params=dict(params),
        arms=list(values),
        device=device,
        repetitions=10,
        warmup=1,
        code_version=code_version,
    )
    context = JobContext(started_at=started_at or dt.datetime(2026, 11, 30, 10, 0, tzinfo=dt.UTC))
    context.contended = contended
    rows = RowBuilder(job, fingerprint(device), context)
    busy = [(float("-inf"), float("inf"))] if contended else []  # a foreign user there all along
    for arm, metrics in values.items():
        for metric, samples in metrics.items():
            for i, v in enumerate(samples):
                rows.add(
                    arm,
                    metric,
                    v,
                    unit_of(metric, "tok/s"),
                    sample=i if len(samples) > 1 else -1,
                    status=status,
                    error=error,
                    flops=2.0 * 1e9,
                    bytes_moved=1e8,
                )
    rows.apply_contention(busy)
    table = rows.table(status)
    if peaks is not None:
        n = table.num_rows
        table = table.set_column(
            table.schema.get_field_index("peak_copy_gb_s"), "peak_copy_gb_s", pa.array([peaks[0]] * n, pa.float64())
        )
        table = table.set_column(
            table.schema.get_field_index("peak_tflop_s"), "peak_tflop_s", pa.array([peaks[1]] * n, pa.float64())
        )
    return table


def concat(tables: Sequence[pa.Table]) -> pa.Table:
    """Tables in `SCHEMA` as one (metadata of the schema, as the store's `read` gives)."""
    if not tables:
        return SCHEMA.empty_table()
    return pa.concat_tables([t.replace_schema_metadata(SCHEMA.metadata) for t in tables])


def noisy(rng: np.random.Generator, centre: float, rel_noise: float, n: int) -> list[float]:
    """`n` samples around `centre` with a relative normal noise."""
    return list(centre * (1 + rel_noise * rng.standard_normal(n)))
