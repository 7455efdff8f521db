"""How long `orchestrate` takes to start: each verb's help, in fresh processes, beside another checkout's.

    .venv/bin/python -m benchmarks.cli_start --vs-code /tmp/main-tree [--rounds 15]

`VERB -h` costs what every run of the verb costs before it does anything: the interpreter, the
imports of the CLI and of the verb's module, and the parsing. Each command line runs `--rounds`
times after one warm-up, this checkout and `--vs-code DIR` (`git archive main | tar -x -C DIR`)
taking turns call by call, so both see the same load; printed are the medians of wall and CPU
seconds (user + system) and the ratios this / other.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
from pathlib import Path

from benchmarks.store_scale import BIN, REPO, timed

LINES = [["--version"], ["query", "-h"], ["compare", "-h"], ["check", "-h"], ["results", "-h"], ["--help"]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vs-code", type=Path, required=True, help="the other checkout")
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    codes = {"this": REPO, "other": args.vs_code.resolve()}
    print(f"machine: {platform.node()} {platform.machine()} {os.cpu_count()} cores, Python {platform.python_version()}")
    orch = str(BIN / "orchestrate")
    for line in LINES:
        for code in codes.values():
            timed([orch, *line], code)  # warm-up: the page cache, .pyc files
        runs: dict[str, list[tuple[float, float, float]]] = {label: [] for label in codes}
        for _ in range(args.rounds):
            for label, code in codes.items():
                runs[label].append(timed([orch, *line], code))
        wall = {label: statistics.median(w for w, _, _ in r) for label, r in runs.items()}
        cpu = {label: statistics.median(c for _, c, _ in r) for label, r in runs.items()}
        print(
            f"orchestrate {' '.join(line):<12} this {wall['this']:5.2f} s ({cpu['this']:5.2f} s CPU)  "
            f"other {wall['other']:5.2f} s ({cpu['other']:5.2f} s CPU)  ratio {wall['this'] / wall['other']:.2f} "
            f"(CPU {cpu['this'] / cpu['other']:.2f})  load {os.getloadavg()[0]:.1f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
