"""Random activations for a workload's inputs, drawn on the device from the job's generator.

At the seeds' shapes an input is tens of millions of values (16384 x 5376 tokens by features):
NumPy's generator draws them on one core in about a second per input set, three sets per job,
and then they cross to the device. MLX draws them where they are used, in milliseconds on a GPU,
from a key taken from the job's generator, so a job's inputs stay reproducible from its seed.
The reference reads back only the rows it checks (`kernels.checking`).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np


def standard_normal(gen: np.random.Generator, shape: tuple[int, ...], dtype: mx.Dtype) -> mx.array:
    """Standard normal draws of `shape` in `dtype`, from a key drawn from `gen` (evaluated)."""
    key = mx.random.key(int(gen.integers(2**32)))
    x = mx.random.normal(shape, dtype=mx.float32, key=key).astype(dtype)
    mx.eval(x)
    return x
