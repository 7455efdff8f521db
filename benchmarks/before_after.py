"""The same jobs measured by two versions of the worker, side by side in one run: do the medians agree?

    python3 -m benchmarks.before_after write JOBS_DIR           # the job files (qmm and moe-gather)
    python3 -m benchmarks.before_after compare --old OLD.parquet... --new NEW.parquet...

`write` writes job files at the seeds' shapes that every version of `workers` reads (only the
fields every version has). Run each several times with both versions (`PYTHONPATH` at an older
checkout's `workers/` and `kernels/`, e.g. from `git archive`), in ABBA
order (old, new, new, old, ...: benchmarks/device_lab.sh's ROUNDS), one result file per worker
process, then `compare` them all.

`compare` pools each side's files per (job, arm): the median `seconds` of all of a side's samples,
with a 95 % interval from a two-stage (hierarchical) bootstrap: resample the side's processes (its
files) with replacement, then the samples within each chosen process, and take the median of the
pooled resample. The first stage is why: each process draws, allocates and clocks differently, and
on a GPU a shift of 1-3 % between two processes of the same code is normal, so an interval from
the samples of one process alone is too narrow and an A/A comparison often fails to overlap. With
one file per side the first stage has nothing to choose and this is the plain bootstrap of one
process's median (the table's `runs` column says how many processes each side had). Beside them:
the ratio after / before of the pooled medians, with the interval of the ratio of the two sides'
bootstrap medians, and whether the two sides' intervals overlap. A faster orchestrator must not
change what a sample measures; a change of method (how a sample is timed) may, and is named in
BENCHMARKS.md where it does.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import numpy as np
import pyarrow.parquet as pq

JOBS = {
    "qmm-2048": {
        "case": "qmm",
        "params": {"tokens": 2048, "n": 21504, "k": 5376, "dtype": "bfloat16"},
        "arms": ["native", "affine", "dequant-gemm", "dense"],
    },
    "moe-512": {
        "case": "moe-gather",
        "params": {"experts": 128, "top_k": 6, "tokens": 512, "hidden": 2688, "expert_width": 1856,
                   "dtype": "bfloat16", "global_scale": True},
        "arms": ["native-sorted", "affine-sorted", "custom-sorted"],
    },
}  # fmt: skip
BOOTSTRAP = 2000


def write_jobs(directory: Path, lock: str) -> list[Path]:
    """One job file per entry of `JOBS` (10 samples, 3 warm-up, the lock at `lock`)."""
    directory.mkdir(parents=True, exist_ok=True)
    out = []
    for name, spec in JOBS.items():
        job = {
            "run_id": "before-after", "sweep": "before-after", "job_key": name, "case": spec["case"],
            "case_name": spec["case"], "params": spec["params"], "arms": spec["arms"], "device": "gpu",
            "backend": "cuda", "repetitions": 10, "warmup": 3, "seed": 12345, "lock": {"path": lock},
        }  # fmt: skip
        path = directory / f"{name}.json"
        path.write_text(json.dumps(job))
        out.append(path)
    return out


def medians(path: Path) -> dict[tuple[str, str], np.ndarray]:
    """(job, arm) -> the clean `seconds` samples of one result file."""
    t = pq.read_table(path).to_pylist()
    out: dict[tuple[str, str], list[float]] = {}
    for row in t:
        if row["metric"] == "seconds" and row["status"] == "ok" and not row["contended"] and row["value"]:
            out.setdefault((row["job_key"], row["arm"]), []).append(float(row["value"]))
    return {k: np.array(v) for k, v in out.items()}


def side_runs(paths: Sequence[Path]) -> dict[tuple[str, str], list[np.ndarray]]:
    """(job, arm) -> the clean `seconds` samples of each of one side's result files (one per process)."""
    out: dict[tuple[str, str], list[np.ndarray]] = {}
    for path in paths:
        for key, samples in medians(path).items():
            out.setdefault(key, []).append(samples)
    return out


class Interval(NamedTuple):
    """A point estimate and its 95 % bootstrap interval."""

    point: float
    low: float
    high: float


@dataclass(frozen=True)
class ArmComparison:
    """One (job, arm) of the table: each side's median and the ratio after / before, with intervals."""

    job: str
    arm: str
    runs_before: int
    runs_after: int
    before: Interval
    after: Interval
    ratio: Interval

    @property
    def overlap(self) -> bool:
        """Whether the before and after intervals share a point."""
        return self.after.low <= self.before.high and self.before.low <= self.after.high


def bootstrap_medians(runs: Sequence[np.ndarray], draws: int, rng: np.random.Generator) -> np.ndarray:
    """`draws` medians of two-stage resamples of one side: its processes, then each one's samples.

    Each draw chooses `len(runs)` processes with replacement; each chosen process contributes as
    many samples as it has, drawn with replacement from its own; the draw's value is the median of
    all of them together. With one process this is the ordinary bootstrap of its median.
    """
    lengths = np.array([len(r) for r in runs])
    width = int(lengths.max())
    padded = np.full((len(runs), width), np.nan)
    for i, r in enumerate(runs):
        padded[i, : len(r)] = r
    chosen = rng.integers(0, len(runs), size=(draws, len(runs)))
    n = lengths[chosen][..., None]
    picks = rng.integers(0, n, size=(draws, len(runs), width))
    values = padded[chosen[..., None], picks]
    values[np.arange(width) >= n] = np.nan  # a shorter process fills fewer slots
    return np.nanmedian(values.reshape(draws, -1), axis=1)


def percentile_interval(point: float, draws: np.ndarray) -> Interval:
    """`point` with the 2.5 % and 97.5 % quantiles of its bootstrap `draws`."""
    return Interval(point, float(np.quantile(draws, 0.025)), float(np.quantile(draws, 0.975)))


def compare_arm(
    key: tuple[str, str],
    before: Sequence[np.ndarray],
    after: Sequence[np.ndarray],
    rng: np.random.Generator,
    draws: int = BOOTSTRAP,
) -> ArmComparison:
    """One (job, arm) from each side's samples, one array per process (result file).

    Args:
        key: (job, arm).
        before: the older worker's samples, one array per process.
        after: the newer worker's samples, one array per process.
        rng: the bootstrap's generator.
        draws: bootstrap resamples per side (the ratio divides the two sides' draws pairwise).
    """
    b_draws, a_draws = bootstrap_medians(before, draws, rng), bootstrap_medians(after, draws, rng)
    b_point, a_point = float(np.median(np.concatenate(before))), float(np.median(np.concatenate(after)))
    return ArmComparison(
        job=key[0],
        arm=key[1],
        runs_before=len(before),
        runs_after=len(after),
        before=percentile_interval(b_point, b_draws),
        after=percentile_interval(a_point, a_draws),
        ratio=percentile_interval(a_point / b_point, a_draws / b_draws),
    )


def compare_files(old: Sequence[Path], new: Sequence[Path], draws: int = BOOTSTRAP) -> list[ArmComparison]:
    """Every (job, arm) both sides measured, each side's files pooled, in key order."""
    rng = np.random.default_rng(0)
    before, after = side_runs(old), side_runs(new)
    return [compare_arm(key, before[key], after[key], rng, draws) for key in sorted(set(before) & set(after))]


def compare(old: Sequence[Path], new: Sequence[Path], draws: int = BOOTSTRAP) -> str:
    """The Markdown table of medians, intervals and ratios of old against new, each side's files pooled."""
    lines = [
        "| job | arm | runs (before/after) | before (ms) [95 %] | after (ms) [95 %] | after / before "
        "| intervals overlap |",
        "|---|---|---|---|---|---|---|",
    ]
    for c in compare_files(old, new, draws):
        b, a, r = c.before, c.after, c.ratio
        lines.append(
            f"| {c.job} | {c.arm} | {c.runs_before}/{c.runs_after} | "
            f"{b.point * 1e3:.3f} [{b.low * 1e3:.3f}, {b.high * 1e3:.3f}] | "
            f"{a.point * 1e3:.3f} [{a.low * 1e3:.3f}, {a.high * 1e3:.3f}] | "
            f"{r.point:.3f} [{r.low:.3f}, {r.high:.3f}] | {'yes' if c.overlap else 'NO'} |"
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(prog="python3 -m benchmarks.before_after")
    sub = parser.add_subparsers(dest="verb", required=True)
    w = sub.add_parser("write")
    w.add_argument("dir", type=Path)
    w.add_argument("--lock", default="/tmp/orchestrate-gpu.lock")
    c = sub.add_parser("compare")
    c.add_argument("--old", type=Path, nargs="+", required=True, help="result files of the older worker")
    c.add_argument("--new", type=Path, nargs="+", required=True, help="result files of the newer worker")
    args = parser.parse_args()
    if args.verb == "write":
        for path in write_jobs(args.dir, args.lock):
            print(path)
        return 0
    print(compare(args.old, args.new))
    return 0


if __name__ == "__main__":
    sys.exit(main())
