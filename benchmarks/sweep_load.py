"""What checking a sweep before anything starts costs: loading sweeps of 1 to 10,000 points.

Every point passes its case's rule (`kernels.shapes`), every criterion is matched against the
points, and a sweep over the limit is refused by counting alone. Times are the median of
`--rounds` loads after one warm-up, in this process (Python start-up and imports excluded).

    .venv/bin/python -m benchmarks.sweep_load --rounds 7
"""

from __future__ import annotations

import argparse
import contextlib
import platform
import statistics
import time
from typing import Any

from pydantic import ValidationError

from orchestrator.specs.sweep import SweepSpec


def sweep(points_per_axis: int, where: str) -> dict[str, Any]:
    """A qmm sweep of points_per_axis^2 points (tokens x n) with one criterion."""
    return {
        "name": "load",
        "baseline": "affine",
        "cases": [
            {
                "case": "qmm",
                "arms": ["native", "affine"],
                "params": {
                    "tokens": list(range(1, points_per_axis + 1)),
                    "n": list(range(16, 16 * (points_per_axis + 1), 16)),
                    "k": 64,
                },
            }
        ],
        "criteria": [{"name": "c", "metric": "seconds", "arm": "native", "where": where, "min_ratio": 1.0}],
    }


def timed(data: dict[str, Any], rounds: int) -> float:
    """Median seconds of one `SweepSpec.model_validate` (refused or not), after one warm-up."""

    def once() -> float:
        t0 = time.perf_counter()
        with contextlib.suppress(ValidationError):
            SweepSpec.model_validate(data)
        return time.perf_counter() - t0

    once()
    return statistics.median(once() for _ in range(rounds))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    print(
        f"machine: {platform.machine()} {platform.processor() or platform.system()}, Python {platform.python_version()}"
    )
    print("| sweep | median load (ms) |\n|---|---|")
    for side in (1, 10, 100):
        last = f"tokens >= {side} and n >= {16 * side}"  # the one point a criterion finds last
        ms = timed(sweep(side, last), args.rounds) * 1e3
        points = f"{side * side:,} point" + ("s" if side > 1 else "")
        print(f"| {points}, a criterion matching only the last point | {ms:.2f} |")
    axes = {f"p{i}": list(range(10)) for i in range(9)}
    nine = {"name": "big", "cases": [{"case": "command", "repo": ".", "run": "./b", "parse": "json-lines",
                                      "arms": ["a"], "params": axes}]}  # fmt: skip
    print(f"| 10^9 points (9 axes of 10), refused by counting | {timed(nine, args.rounds) * 1e3:.2f} |")


if __name__ == "__main__":
    main()
