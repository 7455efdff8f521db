"""The project's one atomic file writer: a file is either whole or absent, never half-written.

Every file the project replaces in place (result fragments, the point index, a command's
`--output`, a crontab file, host peaks, the GPU lock's holder file, compiled kernels, TLS keys and
the cluster token) is written here: into a temporary file of a unique name in the same directory,
flushed and fsynced, then renamed over the target. A reader sees the old file or the new one; a
write that fails removes its temporary file; two writers of one path never share a temporary file,
so the last rename wins with a whole file. It lives at the bottom of the import order
(`orchestrator -> workers -> kernels`) so that the kernels' build cache uses it too;
`workers.files` adds the Parquet writer on top.

A written file gets the mode any new file gets under the process's umask (0644 under the usual
022), so a team's analytics user can read the results; a stricter umask (077) keeps them private;
`mode` sets it outright (a key: 0600).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any, BinaryIO, cast


@contextmanager
def atomic_file(path: Path, *, text: bool = False, mode: int | None = None, durable: bool = True) -> Iterator[IO[Any]]:
    """An open temporary file beside `path` that replaces `path` when the block ends without error.

    Example:
        with atomic_file(out, text=True) as fh:
            fh.write(report)

    Args:
        path: The file (its directory is created when missing).
        text: A text stream (UTF-8, newlines written as given) instead of a binary one.
        mode: The file's mode, set before any byte is written; None: what the umask gives.
        durable: fsync before the rename, so a power loss leaves the old file or the new one. False
            for a file that means nothing after a reboot (a lock's holder file).

    An exception in the block removes the temporary file and leaves `path` as it was.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="") if text else os.fdopen(fd, "wb") as fh:
            os.fchmod(fd, 0o666 & ~current_umask() if mode is None else mode)  # mkstemp alone makes 0600
            yield fh
            fh.flush()
            if durable:
                os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_atomic(
    path: Path,
    content: bytes | str | Callable[[BinaryIO], object],
    *,
    mode: int | None = None,
    durable: bool = True,
) -> Path:
    """Write `path` atomically (see `atomic_file`).

    Args:
        path: The file.
        content: The bytes, the text (written as UTF-8), or a function that writes the content into
            the open binary file (pyarrow's and DuckDB's writers take one).
        mode, durable: As for `atomic_file`.
    """
    with atomic_file(path, mode=mode, durable=durable) as fh:
        if callable(content):
            content(cast(BinaryIO, fh))
        else:
            fh.write(content.encode() if isinstance(content, str) else content)
    return path


def current_umask() -> int:
    """This process's umask (read from `/proc` on Linux; elsewhere set and restored at once)."""
    try:
        with open("/proc/self/status", "rb") as f:  # bytes: no codec to import in a forked job
            for line in f:
                if line.startswith(b"Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask
