"""One `orchestrate run` at a time per sweep and results directory.

Two runs of one sweep into one results directory would each see the same jobs missing and run
them all twice. `hold_store` takes an `flock(2)` on `<sweep>.lock` in the store's side directory
(`locks/` in `.<results>.orchestrate/` beside the results: the dataset itself holds nothing but
Parquet), opened without following links, before a run reads which jobs are complete; a second run
waits, saying which run holds it, and then resumes: it finds the first run's jobs complete and
runs only what is still missing. Runs of other sweeps, or into other directories, go on side
by side (the hosts' GPU locks still take their jobs one at a time).

The lock is held until the process exits (one CLI run is one process); the kernel drops it the
moment its holder dies. A process that runs several sweeps holds each of its locks once
(re-entrant).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import errno
import fcntl
import os
import sys
import threading
from pathlib import Path

from orchestrator.errors import InfrastructureError
from orchestrator.specs.names import NAME_RE

LOCK_DIR = "locks"  # in the store's side directory (`ResultStore.side`)
_HELD: dict[Path, int] = {}
_GUARD = threading.Lock()


def _say(message: str) -> None:
    print(f"orchestrate: {message}", file=sys.stderr, flush=True)


def hold_store(root: Path, sweep: str, lock_dir: Path) -> Path:
    """Hold this process's lock on running `sweep` into the results at `root`; wait while another
    run holds it.

    Args:
        root: the results directory (named in the waiting message).
        sweep: the sweep's name (the lock file's).
        lock_dir: where the lock files are (`ResultStore.side / LOCK_DIR`).

    Returns:
        The lock file.

    Raises:
        InfrastructureError: the lock file cannot be made or opened (a symlink, a directory).
    """
    if not NAME_RE.fullmatch(sweep):
        raise InfrastructureError(f"sweep name {sweep!r} cannot name a lock file")
    path = (lock_dir / f"{sweep}.lock").absolute()
    with _GUARD:
        if path in _HELD:
            return path
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            why = "it is a symbolic link" if exc.errno == errno.ELOOP else exc.strerror
            raise InfrastructureError(f"cannot open the run lock {path}: {why}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = "another run"
            with contextlib.suppress(OSError):
                holder = os.pread(fd, 256, 0).decode(errors="replace").strip() or holder
            _say(f"waiting for {holder} to finish writing sweep {sweep!r} into {root}")
            fcntl.flock(fd, fcntl.LOCK_EX)
        stamp = dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"orchestrate run pid {os.getpid()} (since {stamp})\n".encode(), 0)
        _HELD[path] = fd
        return path
