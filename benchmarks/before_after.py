"""The same jobs measured by two versions of the worker, side by side in one run: do the medians agree?

    python3 -m benchmarks.before_after write JOBS_DIR           # the job files (qmm and moe-gather)
    python3 -m benchmarks.before_after compare --old OLD.parquet... --new NEW.parquet...

`write` writes job files at the seeds' shapes that any version of `workers` since the first
session reads (only the fields every version has). Run each with both versions (`PYTHONPATH` at an
older checkout's `workers/` and `kernels/`, e.g. from `git archive`), alternately, then `compare`:
per case, point and arm, the median `seconds` of each with a 95 % bootstrap interval of the
median, the ratio new/old with its interval, and whether the two intervals overlap. A faster
orchestrator must not change what a sample measures; a change of method (how a sample is timed)
may, and is named in BENCHMARKS.md where it does.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

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


def interval(samples: np.ndarray, rng: np.random.Generator) -> tuple[float, float, float]:
    """(median, 2.5 %, 97.5 %) of the median by bootstrap."""
    boots = np.median(rng.choice(samples, size=(BOOTSTRAP, len(samples))), axis=1)
    return float(np.median(samples)), float(np.quantile(boots, 0.025)), float(np.quantile(boots, 0.975))


def compare(old: list[Path], new: list[Path]) -> str:
    """The table of medians, intervals and ratios of old against new."""
    rng = np.random.default_rng(0)
    before: dict[tuple[str, str], np.ndarray] = {}
    after: dict[tuple[str, str], np.ndarray] = {}
    for p in old:
        before.update(medians(p))
    for p in new:
        after.update(medians(p))
    lines = [
        "| job | arm | before (ms) [95 %] | after (ms) [95 %] | after / before | intervals overlap |",
        "|---|---|---|---|---|---|",
    ]
    for key in sorted(set(before) & set(after)):
        b, a = interval(before[key], rng), interval(after[key], rng)
        ratio = np.median(rng.choice(after[key], (BOOTSTRAP, len(after[key]))), axis=1) / np.median(
            rng.choice(before[key], (BOOTSTRAP, len(before[key]))), axis=1
        )
        overlap = a[1] <= b[2] and b[1] <= a[2]
        lines.append(
            f"| {key[0]} | {key[1]} | {b[0] * 1e3:.3f} [{b[1] * 1e3:.3f}, {b[2] * 1e3:.3f}] | "
            f"{a[0] * 1e3:.3f} [{a[1] * 1e3:.3f}, {a[2] * 1e3:.3f}] | {a[0] / b[0]:.3f} "
            f"[{np.quantile(ratio, 0.025):.3f}, {np.quantile(ratio, 0.975):.3f}] | {'yes' if overlap else 'NO'} |"
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
