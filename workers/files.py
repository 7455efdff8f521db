"""Atomic Parquet writes: a file is either whole or absent, never half-written.

A written file gets the mode any new file gets under the process's umask (0644 under the usual
022), so a team's analytics user can read the results; a stricter umask (077) keeps them private.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

import pyarrow as pa
import pyarrow.parquet as pq


def write_atomic(path: Path, write: Callable[[BinaryIO], object], *, mode: int | None = None) -> Path:
    """Write a file through a temp file in the same directory, fsync, then rename over `path`.

    Args:
        path: The file.
        write: Writes the content into the open temp file.
        mode: The file's mode, set before any byte is written; None: what the umask gives.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, 0o666 & ~current_umask() if mode is None else mode)  # mkstemp alone makes 0600
        with os.fdopen(fd, "wb") as fh:
            write(fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def write_parquet_atomic(table: pa.Table, path: Path) -> Path:
    """Write `table` to `path` atomically (see `write_atomic`), zstd-compressed."""
    return write_atomic(path, lambda fh: pq.write_table(table, fh, compression="zstd"))


def current_umask() -> int:
    """This process's umask (read from `/proc` on Linux; elsewhere set and restored at once)."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask
