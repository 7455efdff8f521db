"""A per-user disk cache of compiled kernels, so a fresh process does not compile them again.

MLX caches the kernels its own JIT builds (`/tmp/mlx/<version>/ptx`, keyed by kernel name, and
our names carry a hash of their source); the sm_90a builds `kernels.cuda.nvrtc` makes itself were
cached only in memory, so every fresh process (every cold model sample) compiled each GEMM variant
again, seconds each. `cached(key, build)` returns the bytes stored under `key`, or builds, stores
and returns them.

The key must name everything the bytes depend on (source, target, compiler version, options): a
hit is trusted as it is. A cubin is code this process runs, so the cache is only used where nobody
else can write it: a directory of ours, mode 0700, not a symlink, each entry a plain file of ours
opened without following links; otherwise the build is used uncached. Entries are written
atomically (`kernels.files.write_atomic`), so a reader sees a whole entry or none, and concurrent
writers of one key both leave a whole one.

Where: `$ORCHESTRATE_KERNEL_CACHE`, else `$XDG_CACHE_HOME/orchestrate/kernels`, else
`~/.cache/orchestrate/kernels`. Setting `ORCHESTRATE_KERNEL_CACHE=off` turns it off.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import stat
from collections.abc import Callable
from pathlib import Path

from kernels.files import write_atomic

CACHE_ENV = "ORCHESTRATE_KERNEL_CACHE"


def cache_root() -> Path | None:
    """The cache directory this process may use (created 0700), or None where it is off or unsafe."""
    raw = os.environ.get(CACHE_ENV, "")
    if raw.lower() in ("off", "0", "none"):
        return None
    if raw:
        root = Path(raw).expanduser()
    else:
        base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
        root = Path(base) / "orchestrate" / "kernels"
    try:
        root.mkdir(parents=True, exist_ok=True, mode=0o700)
        info = root.lstat()
    except OSError:
        return None
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
        return None  # a symlink, someone else's, or writable by others: not trusted
    return root


def entry_name(key: str) -> str:
    """The file name of a key's entry."""
    return hashlib.sha256(key.encode()).hexdigest()[:32] + ".bin"


def _read(path: Path) -> bytes | None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as f:
        info = os.fstat(f.fileno())
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid() or info.st_size == 0:
            return None
        return f.read()


def cached(key: str, build: Callable[[], bytes]) -> bytes:
    """The bytes stored under `key`, else `build()`'s, stored for the next process."""
    root = cache_root()
    if root is None:
        return build()
    path = root / entry_name(key)
    hit = _read(path)
    if hit is not None:
        return hit
    data = build()
    with contextlib.suppress(OSError):  # a full disk only costs the next process a build
        write_atomic(path, data, mode=0o600)
    return data
