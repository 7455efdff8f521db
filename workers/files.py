"""Atomic file writes on the worker side: the project's one writer (`kernels.files`) and Parquet on it.

`write_atomic` and `atomic_file` live in `kernels.files`, at the bottom of the import order, so
the kernels' build cache writes through them as well; they are re-exported here for the head and
the workers. `write_parquet_atomic` writes a zstd-compressed Parquet file through them. Importing
this module is cheap: pyarrow's Parquet writer is imported by the first Parquet write.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from kernels.files import atomic_file, write_atomic

if TYPE_CHECKING:
    import pyarrow as pa

__all__ = ["atomic_file", "write_atomic", "write_parquet_atomic"]


def write_parquet_atomic(table: pa.Table, path: Path) -> Path:
    """Write `table` to `path` atomically (see `kernels.files.atomic_file`), zstd-compressed."""
    import pyarrow.parquet as pq  # Parquet's writer: loaded by the first write (module docstring)

    return write_atomic(path, lambda fh: pq.write_table(table, fh, compression="zstd"))
