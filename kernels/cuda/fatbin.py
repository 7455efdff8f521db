"""Our cubins as compressed fatbins: fewer bytes for MLX to hash at every launch.

MLX 0.32's `CustomKernel::eval_gpu` finds a precompiled kernel's loaded module by hashing the
whole module image it was given (`std::hash` over the bytes), on every launch. A decode GEMV's
cubin is 27-45 KB of SASS, so that hash is more than half of what handing our kernel to the
device costs the host, paid 28 times per generated token by a 4-layer decoder, in the step the
host must build ahead of the device (`python3 -m benchmarks.decode_host` times one launch from
the fatbin beside one from the plain cubin). The driver loads a fatbin as it loads a cubin
(`cuModuleLoadDataEx` takes either) and decompresses it once, at load; NVIDIA's nvFatbin library
compresses a cubin into one at about a third of its size.

`compress(cubin, arch)` returns that fatbin, or the cubin as it is where no nvFatbin library
loads (the kernels run the same; only the per-launch hash is longer).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib

from kernels.cuda import build_cache, libraries

FATBIN_ENV = "ORCHESTRATE_NVFATBIN"  # an explicit libnvfatbin.so path
# the default compression mode: `-compress-mode=size` saves another tenth of the bytes, and costs
# the driver more to decompress at load
OPTIONS = (b"-64", b"-compress-all")


@functools.cache
def library() -> ctypes.CDLL | None:
    """The nvFatbin library (CUDA 12.4+: the toolkit's or the `nvidia-nvfatbin` wheel's), or None."""
    return libraries.load("nvfatbin", FATBIN_ENV, "nvFatbinVersion")


def version() -> tuple[int, int] | None:
    """nvFatbin's (major, minor), or None without it."""
    return libraries.version(library(), "nvFatbinVersion")


def compress(cubin: bytes, arch: str) -> bytes:
    """`cubin` (built for `arch`, e.g. "sm_90a") as a compressed fatbin, or as it is without
    nvFatbin; kept in the disk cache (`build_cache`) like the cubin itself.

    Raises:
        RuntimeError: nvFatbin refused the cubin (with its error code).
    """
    lib = library()
    if lib is None:
        return cubin
    digest = hashlib.sha256(cubin).hexdigest()
    key = "\0".join(["fatbin", f"nvfatbin {version()}", *(o.decode() for o in OPTIONS), arch, digest])
    return build_cache.cached(key, lambda: _compress(lib, cubin, arch.removeprefix("sm_")))


def _compress(lib: ctypes.CDLL, cubin: bytes, arch: str) -> bytes:
    def check(result: int, what: str) -> None:
        if result != 0:
            raise RuntimeError(f"nvFatbin {what} failed with error {result} (arch {arch})")

    handle = ctypes.c_void_p()
    options = (ctypes.c_char_p * len(OPTIONS))(*OPTIONS)
    check(lib.nvFatbinCreate(ctypes.byref(handle), options, ctypes.c_size_t(len(OPTIONS))), "create")
    try:
        check(lib.nvFatbinAddCubin(handle, cubin, ctypes.c_size_t(len(cubin)), arch.encode(), b"kernel"), "add")
        size = ctypes.c_size_t()
        check(lib.nvFatbinSize(handle, ctypes.byref(size)), "size")
        out = ctypes.create_string_buffer(size.value)
        check(lib.nvFatbinGet(handle, out), "get")
        return out.raw
    finally:
        lib.nvFatbinDestroy(ctypes.byref(handle))
