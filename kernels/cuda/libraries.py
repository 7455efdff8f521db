"""NVIDIA's user-space libraries that our builds call through ctypes (NVRTC, nvFatbin), found where
they are on this host: named by an environment variable, already loaded by MLX, on the loader's
path, in the CUDA toolkit, or in a pip wheel (`nvidia-*` packages put them in `nvidia/*/lib`,
which is not on the loader's path).
"""

from __future__ import annotations

import contextlib
import ctypes
import glob
import os
import sys
from pathlib import Path


def candidates(stem: str, env: str) -> list[str]:
    """Where lib<stem>.so may be, best first: explicit (`env`), already loaded (by MLX), system,
    the CUDA toolkit's, pip wheels'."""
    lib = f"lib{stem}.so"
    out = [os.environ.get(env, "")]
    try:
        maps = Path("/proc/self/maps").read_text()
        loaded = {line.split()[-1] for line in maps.splitlines() if lib in line}
        out += sorted(loaded)
    except OSError:
        pass
    out += [f"{lib}.13", f"{lib}.12", lib]
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda"
    out += sorted(glob.glob(f"{home}/lib64/{lib}*"))
    for site in sys.path:
        out += sorted(glob.glob(f"{site}/nvidia/*/lib/{lib}*"))
    return [c for c in out if c and "builtins" not in c and not c.endswith(".alt")]


def load(stem: str, env: str, version_symbol: str) -> ctypes.CDLL | None:
    """The first of `candidates` that loads and has `version_symbol`, or None."""
    for path in candidates(stem, env):
        # NVRTC dlopens its builtins library by name: from a wheel's folder (not on the loader's
        # path) it only finds one already loaded
        for builtins in sorted(glob.glob(f"{Path(path).parent}/lib{stem}-builtins.so*")) if "/" in path else []:
            with contextlib.suppress(OSError):
                ctypes.CDLL(builtins, mode=ctypes.RTLD_GLOBAL)
        try:
            lib = ctypes.CDLL(path)
            getattr(lib, version_symbol)
        except (OSError, AttributeError):
            continue
        return lib
    return None


def version(lib: ctypes.CDLL | None, symbol: str) -> tuple[int, int] | None:
    """A library's (major, minor) from its `symbol(&major, &minor)`, or None without the library."""
    if lib is None:
        return None
    major, minor = ctypes.c_int(), ctypes.c_int()
    getattr(lib, symbol)(ctypes.byref(major), ctypes.byref(minor))
    return major.value, minor.value
