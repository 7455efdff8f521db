"""The NVFP4 prefill GEMM's register-sourced variants against their MLX twin on the GPU, at tails.

    python3 -m benchmarks.gemm_twin_check      # exit 1 if any case is off or leaves a NaN, 3 if none ran

The cases of tests/kernels/test_gemm_nvfp4.py's CUDA test, which runs `twin_error` too (the device
bundle has no pytest): each `r*`
variant of `kernels.cuda.gemm_layout` and g192x256k64s4 at tails in M, N and K and at the seed's
shape, bfloat16, and float16 at one shape; outputs poisoned with NaN before the kernel runs.
"""

from __future__ import annotations

import sys

import mlx.core as mx
import numpy as np

from kernels import gemm_nvfp4
from kernels.cuda.gemm_layout import VARIANTS

SHAPES = [(300, 520, 256), (200, 264, 1536), (70, 200, 448), (512, 21504, 5376), (1000, 2048, 5376)]
F16_SHAPE = (200, 264, 1536)


def twin_error(name: str, dtype: mx.Dtype, m: int, n: int, k: int) -> tuple[float, int]:
    """(relative error against the twin, NaN count) of `name` at M x N x K: random bf16 weights
    quantized to NVFP4 with a global scale, random x of `dtype`, the output NaN before the kernel."""
    rng = np.random.default_rng(m + n)
    w = mx.random.normal((n, k), key=mx.random.key(n)).astype(mx.bfloat16)
    gs = mx.max(mx.abs(w)).astype(mx.float32)
    wq, sc = mx.quantize(w, mode="nvfp4", global_scale=gs)[:2]
    x = mx.array(rng.standard_normal((m, k)).astype(np.float32)).astype(dtype)
    got = np.array(gemm_nvfp4.gemm_nvfp4_cuda(x, wq, sc, gs, name, poison=True).astype(mx.float32)).astype(np.float64)
    want = np.array(gemm_nvfp4.gemm_nvfp4_twin(x, wq, sc, gs).astype(mx.float32)).astype(np.float64)
    err = float(np.linalg.norm(np.nan_to_num(got) - want) / np.linalg.norm(want))
    return err, int((~np.isfinite(got)).sum())


def check(name: str, dtype: mx.Dtype, m: int, n: int, k: int) -> str:
    """One case: 'OK ...', 'BAD ...' or 'SKIP reason'."""
    dn = str(dtype).removeprefix("mlx.core.")
    reason = gemm_nvfp4.kernel_supports(m, n, k, dn, name)
    if reason:
        return f"SKIP {reason}"
    err, nan = twin_error(name, dtype, m, n, k)
    ok = nan == 0 and err < gemm_nvfp4.TOLERANCE[dn]
    return f"{'OK' if ok else 'BAD'} err {err:.2e} nan {nan}"


def main() -> int:
    names = [name for name, cfg in VARIANTS.items() if cfg.rs] + ["g192x256k64s4"]
    cases = [(mx.bfloat16, shape) for shape in SHAPES] + [(mx.float16, F16_SHAPE)]
    bad = ran = 0
    for name in names:
        for dtype, (m, n, k) in cases:
            try:
                line = check(name, dtype, m, n, k)
            except Exception as exc:  # a kernel that fails to build or launch is a failed case
                line = f"BAD {type(exc).__name__}: {exc}"
            bad += line.startswith("BAD")
            ran += not line.startswith("SKIP")
            print(name, str(dtype).removeprefix("mlx.core."), (m, n, k), line, flush=True)
    print(f"{ran} cases checked, {bad} bad")
    if not ran:
        print("gemm_twin_check: nothing checked (needs MLX's CUDA backend on compute capability 9.0)", file=sys.stderr)
        return 3
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
