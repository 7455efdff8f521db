"""benchmarks/before_after.py's comparison: each side's files pooled, intervals from a two-stage bootstrap.

The simulations draw samples the way a GPU host gives them: within one worker process a lognormal
noise of 1.5 %, and between processes of the same code a random shift of 1.75 % (each process
draws, allocates and clocks differently). An interval from one process's samples alone ignores the
second, so an A/A comparison often reports intervals that do not overlap; resampling the processes
first, then the samples within each, does not, and still sees a real 10 % slowdown.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from benchmarks import before_after

WITHIN = 0.015  # lognormal sd of the samples of one process
BETWEEN = 0.0175  # sd of a process's shift
SAMPLES = 10  # per process, as in the job files
SIMULATIONS = 200
DRAWS = 500  # bootstrap draws per side in these tests (the module's default is 2000)


def process(rng: np.random.Generator, level: float) -> np.ndarray:
    """One worker process's samples: its own shift, then each sample's noise."""
    shift = np.exp(rng.normal(0.0, BETWEEN))
    return level * shift * np.exp(rng.normal(0.0, WITHIN, SAMPLES))


def outcomes(processes: int, slowdown: float, seed: int) -> list[before_after.ArmComparison]:
    """`SIMULATIONS` comparisons of `processes` processes per side, the new side `slowdown` slower."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(SIMULATIONS):
        before = [process(rng, 1e-3) for _ in range(processes)]
        after = [process(rng, 1e-3 * slowdown) for _ in range(processes)]
        out.append(before_after.compare_arm(("qmm-2048", "affine"), before, after, rng, DRAWS))
    return out


def no_rate(results: list[before_after.ArmComparison]) -> float:
    return sum(not r.overlap for r in results) / len(results)


def write_result(path: Path, job: str, arm: str, values: list[float], extra: bool = True) -> Path:
    """A result file with the columns `medians` reads; `extra` adds rows it must skip."""
    rows = [{"job_key": job, "arm": arm, "metric": "seconds", "status": "ok", "contended": False, "value": v}
            for v in values]  # fmt: skip
    if extra:
        rows += [
            {"job_key": job, "arm": arm, "metric": "seconds", "status": "ok", "contended": True, "value": 9.0},
            {"job_key": job, "arm": arm, "metric": "seconds", "status": "error", "contended": False, "value": 9.0},
            {"job_key": job, "arm": arm, "metric": "tflops", "status": "ok", "contended": False, "value": 9.0},
        ]
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def table_rows(table: str) -> list[list[str]]:
    return [[cell.strip() for cell in line.strip("|").split("|")] for line in table.splitlines()[2:]]


def test_a_a_intervals_from_four_processes_a_side_overlap_where_one_processs_do_not() -> None:
    hierarchical = no_rate(outcomes(processes=4, slowdown=1.0, seed=1))
    one_process = no_rate(outcomes(processes=1, slowdown=1.0, seed=2))  # one process (one file) a side
    print(f"A/A 'NO' rate: one process a side {one_process:.1%}, four processes a side {hierarchical:.1%}")
    assert hierarchical < 0.10
    assert one_process > 0.25 and one_process > 3 * hierarchical


def test_a_ten_percent_slowdown_is_seen_with_four_processes_a_side() -> None:
    results = outcomes(processes=4, slowdown=1.10, seed=3)
    detected = sum(not r.overlap and r.ratio.low > 1.0 for r in results) / len(results)
    print(f"10 % slowdown detected (NO, ratio interval above 1): {detected:.1%}")
    assert detected > 0.80
    assert 1.08 < float(np.median([r.ratio.point for r in results])) < 1.12


def test_each_sides_files_are_pooled_not_overwritten(tmp_path: Path) -> None:
    # the two files of a side differ by half: the pooled median lies between their medians
    old = [write_result(tmp_path / "old-0.parquet", "qmm-2048", "native", [1e-3] * 10),
           write_result(tmp_path / "old-1.parquet", "qmm-2048", "native", [3e-3] * 10)]  # fmt: skip
    new = [write_result(tmp_path / "new-0.parquet", "qmm-2048", "native", [2e-3] * 10),
           write_result(tmp_path / "new-1.parquet", "qmm-2048", "native", [2e-3] * 10, extra=False)]  # fmt: skip
    (row,) = table_rows(before_after.compare(old, new, draws=DRAWS))
    assert row[:3] == ["qmm-2048", "native", "2/2"]
    assert row[3] == "2.000 [1.000, 3.000]"  # the last file alone would be 3.000 [3.000, 3.000]
    assert row[4] == "2.000 [2.000, 2.000]" and row[5].startswith("1.000 [") and row[6] == "yes"
    (c,) = before_after.compare_files(old, new, draws=DRAWS)
    assert (c.runs_before, c.runs_after, c.before.point, c.after.point) == (2, 2, 2e-3, 2e-3)


def test_one_file_a_side_is_the_bootstrap_of_one_processs_median(tmp_path: Path) -> None:
    rng = np.random.default_rng(4)
    before, after = process(rng, 1e-3), process(rng, 1e-3)
    old = [write_result(tmp_path / "old.parquet", "moe-512", "native-sorted", before.tolist())]
    new = [write_result(tmp_path / "new.parquet", "moe-512", "native-sorted", after.tolist())]
    (c,) = before_after.compare_files(old, new, draws=4000)
    plain = np.median(rng.choice(before, (4000, len(before))), axis=1)
    assert (c.runs_before, c.runs_after) == (1, 1) and c.before.point == float(np.median(before))
    assert abs(c.before.low - np.quantile(plain, 0.025)) < 2e-6
    assert abs(c.before.high - np.quantile(plain, 0.975)) < 2e-6
    (row,) = table_rows(before_after.compare(old, new, draws=DRAWS))
    assert row[2] == "1/1"


def test_one_outlier_of_five_times_in_a_process_does_not_move_the_median() -> None:
    rng = np.random.default_rng(5)
    before = [process(rng, 1e-3) for _ in range(4)]
    after = [p.copy() for p in before]
    after[2][7] *= 5.0
    clean = before_after.compare_arm(("k", "a"), before, before, np.random.default_rng(6), DRAWS)
    tail = before_after.compare_arm(("k", "a"), before, after, np.random.default_rng(6), DRAWS)
    assert abs(tail.after.point / clean.after.point - 1) < 0.005
    assert abs(tail.after.low / clean.after.low - 1) < 0.01
    assert abs(tail.after.high / clean.after.high - 1) < 0.01
    assert tail.overlap and 0.98 < tail.ratio.point < 1.02
