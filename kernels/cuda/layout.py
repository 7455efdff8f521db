"""Shared-memory layout of the stream GEMV (`gemv_nvfp4.cu`), in bytes.

Kept free of MLX so that `benchmarks.gemv_lab` (plain nvcc builds on the GPU machine) sizes its
launches from the same numbers as `kernels.gemv_nvfp4`.
"""

from __future__ import annotations


def scale_row_bytes(chunk: int) -> int:
    """A row's E4M3 scale bytes in one ring slot, padded against bank conflicts (the kernel's SROW)."""
    return 48 if chunk == 4 else 16


def stream_smem_bytes(m: int, k: int, warps: int, chunk: int, stages: int) -> int:
    """Dynamic shared memory of the stream kernel: x as f16 in fragment order (padded rows), the
    warps' rings of `stages` slots (16 rows of codes, then of scales), the split tiles' partial sums."""
    x_row = ((k // 8 + 7) // 8 * 8 + 2) * 16
    slot = 16 * chunk * 64 + 16 * scale_row_bytes(chunk)
    return m * x_row + warps * stages * slot + warps * 2 * 128 * 4
