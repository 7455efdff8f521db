"""The host side of a seeds'-shape qmm job's reference check, in fresh processes, beside another checkout's.

    .venv/bin/python -m benchmarks.reference_decode --vs-code /tmp/main-tree [--rounds 5]

What each fresh job process does on the host before its arms are checked, at N=21504, K=5376
(the columns `kernels.checking.grid_subset` picks for 2048 tokens: 1024 of them): read back and
decode the NVFP4 rows (`DeviceWeights.dequantized`) and the affine arm's rows (`product_reference.affine_weights`),
each timed alone after one warm-up call. The weights are random words standing in for drawn ones
(drawing 115 M values takes MLX's CPU backend 5-6 s and is not what is measured). This checkout and
`--vs-code DIR` take turns round by round, so both see the same load; printed are the medians (ms).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
N, K, TOKENS = 21504, 5376, 2048

PROBE = """
import json, time
import mlx.core as mx, numpy as np
from kernels import checking, device_nvfp4, product_reference, qmm
rng = np.random.default_rng(7)
subset = checking.grid_subset(%(tokens)d, %(n)d, %(tokens)d * %(n)d * %(k)d, rng)
cols = subset[1]
packed = mx.array(rng.integers(0, 2**32, size=(%(n)d, %(k)d // 8), dtype=np.uint32))
scales = mx.array(rng.integers(0x30, 0x48, size=(%(n)d, %(k)d // 16), dtype=np.uint8))
w = device_nvfp4.DeviceWeights(packed, scales, None)
at = mx.array(cols.astype(np.int32))
dense = mx.dequantize(packed[at], scales[at], mode="nvfp4", dtype=mx.bfloat16)
aq, asc, ab = mx.quantize(dense, group_size=64, bits=4)
mx.eval(packed, scales, aq, asc, ab)
def timed(fn):
    fn()
    t0 = time.perf_counter(); fn(); return time.perf_counter() - t0
print(json.dumps({"columns": len(cols), "nvfp4": timed(lambda: w.dequantized(cols)),
                  "affine": timed(lambda: product_reference.affine_weights(aq, asc, ab))}))
"""


def one(code: Path) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": str(code)}
    out = subprocess.run([sys.executable, "-c", PROBE % {"tokens": TOKENS, "n": N, "k": K}], env=env, cwd=code,
                         capture_output=True, text=True, check=True).stdout  # fmt: skip
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vs-code", type=Path, required=True, help="the other checkout")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    codes = {"this": REPO, "other": args.vs_code.resolve()}
    got: dict[str, list[dict[str, float]]] = {name: [] for name in codes}
    for _ in range(args.rounds):
        for name, code in codes.items():
            got[name].append(one(code))
    print(f"load average {os.getloadavg()[0]:.1f}; {got['this'][0]['columns']:.0f} columns of N={N}, K={K}")
    for part in ("nvfp4", "affine"):
        this = statistics.median(r[part] for r in got["this"]) * 1e3
        other = statistics.median(r[part] for r in got["other"]) * 1e3
        rounds = ", ".join(f"{r[part] * 1e3:.0f}" for r in got["this"])
        print(f"{part}: this {this:.1f} ms ({rounds}), other {other:.1f} ms, this / other {this / other:.2f}")


if __name__ == "__main__":
    main()
