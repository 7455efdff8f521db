"""A kernel job at a tiny qmm point, for tests of the measurement loop (not collected: no `test_`)."""

from __future__ import annotations

from typing import Any

from workers.contract import JobSpec, LockSettings


def tiny_job(arms: list[str], reps: int = 4, **fields: Any) -> JobSpec:
    """A qmm job at tokens=4, n=8, k=16 on the CPU, lock off; `fields` override any other field."""
    spec: dict[str, Any] = {
        "run_id": "r",
        "sweep": "t",
        "job_key": "k",
        "case": "qmm",
        "case_name": "qmm",
        "params": {"tokens": 4, "n": 8, "k": 16},
        "arms": arms,
        "device": "cpu",
        "repetitions": reps,
        "warmup": 1,
        "lock": LockSettings(enabled=False),
    }
    return JobSpec(**(spec | fields))
