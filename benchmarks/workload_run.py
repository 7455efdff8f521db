"""What running a workload as a whole process tree costs, against a plain `subprocess.run`.

    .venv/bin/python -m benchmarks.workload_run [--rounds 15] [--output-mb 50]

Side by side in one run, alternating (ABAB) so drift hits both: the wall time of a command that
does nothing (`true`: the fixed cost per run: the keeper's start, the pipes, the pumps) and of
one that prints `--output-mb` MB (the cost per byte of streaming to a file instead of holding the
output in memory), each as `subprocess.run(..., capture_output=True)` (all held in memory) and as
`workers.command.workload.run_tree` (the tree's keeper on Linux, output pumped into a file), plus the
peak memory of each way (VmHWM of a fresh interpreter, Linux). Medians; the ratio is tree/plain.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from workers.command.workload import run_tree

PEAK = """
import subprocess, sys
from pathlib import Path
from workers.command.workload import run_tree
argv = ["bash", "-c", sys.argv[2]]
if sys.argv[1] == "plain":
    subprocess.run(argv, capture_output=True, check=True)
else:
    run_tree(argv, stdout=Path(sys.argv[3]), max_output=2**40)
print(next(line.split()[1] for line in open("/proc/self/status") if line.startswith("VmHWM:")))
"""


def plain(argv: list[str]) -> float:
    t0 = time.perf_counter()
    subprocess.run(argv, capture_output=True, check=True)
    return time.perf_counter() - t0


def tree(argv: list[str], out: Path) -> float:
    t0 = time.perf_counter()
    result = run_tree(argv, stdout=out, max_output=2**40)
    assert result.ok, result
    return time.perf_counter() - t0


def peak_mib(way: str, script: str, out: Path) -> float:
    argv = [sys.executable, "-c", PEAK, way, script, str(out)]
    done = subprocess.run(argv, capture_output=True, text=True, check=True)
    return int(done.stdout.strip()) / 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--output-mb", type=int, default=50)
    args = parser.parse_args()
    flood = f"head -c {args.output_mb * 1_000_000} /dev/zero"
    cases = {"true": ["true"], f"{args.output_mb} MB of stdout": ["bash", "-c", flood]}
    print(f"machine: {platform.node()} {platform.machine()} {platform.system()} {platform.release()}; "
          f"python {platform.python_version()}; {args.rounds} rounds, medians")  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out"
        for name, argv in cases.items():
            for _ in range(2):  # warm-up
                plain(argv)
                tree(argv, out)
            a, b = [], []
            for _ in range(args.rounds):
                a.append(plain(argv))
                b.append(tree(argv, out))
            pa, pb = statistics.median(a), statistics.median(b)
            print(f"{name:>20}: plain {pa * 1e3:8.1f} ms   tree {pb * 1e3:8.1f} ms   tree/plain {pb / pa:5.2f}x")
        if sys.platform.startswith("linux"):
            script = cases[f"{args.output_mb} MB of stdout"][2]
            print(f"{'peak memory':>20}: plain {peak_mib('plain', script, out):8.0f} MiB "
                  f"tree {peak_mib('tree', script, out):8.0f} MiB")  # fmt: skip


if __name__ == "__main__":
    main()
