"""What a fork server imports before it forks, and whether a forked child can use it.

A fresh `python -m workers run` pays Python's start-up and the imports of NumPy, pyarrow,
pydantic, MLX and mlx-lm's model classes before any work (mlx-lm's package start-up, which imports
transformers and torch, is skipped everywhere: `kernels.mlx_lm_classes`). The fork server
(`workers.proc.forkserver`) does them once: `preload_base` the modules every job imports, then one
of `PRELOAD_MODES` of MLX. It refuses to preload MLX where the import alone opened a GPU device (a
forked child could not use it: `device_files_open`). There (MLX's CUDA backend: its import opens
/dev/nvidia*) it loads only MLX's native library and the CUDA libraries it links (cuBLAS, cuDNN,
NVRTC: no device opened). `forked_child_works` tries what was loaded in a forked child, once.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import importlib.util
import os
import signal
import time

from kernels import mlx_lm_classes
from workers.proc.fork import fork

# Everything a job's process imports on its way (a module first imported in the child costs every
# job its import: pandas, which pyarrow imports on a job's first `Table.from_pylist`, most of all).
BASE_PRELOAD = (
    "numpy",
    "pyarrow",
    "pyarrow.parquet",
    "pyarrow.compute",
    "pydantic",
    "workers.__main__",
    "workers.job.runner",
    "workers.job.model",
    "workers.job.model_sample",
    "workers.lock.gpu",
    "workers.lock.slot",
    "workers.lock.probes",
    "workers.host.peaks",
)
OPTIONAL_PRELOAD = ("pandas", "pyarrow.pandas_compat", "pyarrow.vendored.version")  # pyarrow with pandas
MLX_PRELOAD = (
    "mlx.core",
    "mlx.nn",
    "kernels.qmm",
    "kernels.moe",
    "kernels.mlp",
    "kernels.checkpoint",
    "kernels.model",
    "kernels.dispatch",
    "mlx_lm.models.cache",
    "mlx_lm.models.llama",
    "mlx_lm.models.gemma3_text",
)
# What a server preloads of MLX, tried in this order until a forked child can use what it loaded:
# everything (MLX_PRELOAD); only MLX's native library and what it links (`libmlx.so` opened by
# the dynamic loader, no Python module: MLX's module start opens the GPU); nothing.
PRELOAD_MODES = ("mlx", "mlx-library", "none")
PRELOAD_NOTES = {"mlx": "mlx preloaded", "mlx-library": "mlx's native library preloaded", "none": "mlx not preloaded"}
# Not preloaded: modules that make MLX arrays when imported (`kernels.gemv_nvfp4`'s lookup tables,
# and what imports it), which every child would inherit (tests/workers/test_forkserver.py checks).
DEVICE_FILES = ("/dev/nvidia", "/dev/kfd", "/dev/dri")
# Arrow's bundled jemalloc starts a background purging thread when pyarrow loads; the server sets
# this while it preloads (and then removes it: a child does not inherit the setting).
ARROW_JEMALLOC_ENV = "JE_ARROW_MALLOC_CONF"
NO_BACKGROUND_THREAD = "background_thread:false"


def preload_base() -> None:
    """Import `BASE_PRELOAD` (and what of `OPTIONAL_PRELOAD` is installed) with Arrow's jemalloc
    told to start no background thread."""
    given = os.environ.get(ARROW_JEMALLOC_ENV)
    os.environ[ARROW_JEMALLOC_ENV] = f"{given},{NO_BACKGROUND_THREAD}" if given else NO_BACKGROUND_THREAD
    import_modules(BASE_PRELOAD, optional=OPTIONAL_PRELOAD)
    if given is None:
        del os.environ[ARROW_JEMALLOC_ENV]
    else:
        os.environ[ARROW_JEMALLOC_ENV] = given


def device_files_open() -> list[str]:
    """GPU device files this process has open (an import that opened the device shows here)."""
    found = []
    with contextlib.suppress(OSError):
        for fd in os.listdir("/proc/self/fd"):
            with contextlib.suppress(OSError):
                target = os.readlink(f"/proc/self/fd/{fd}")
                if target.startswith(DEVICE_FILES):
                    found.append(target)
    return sorted(set(found))


def import_modules(modules: tuple[str, ...], *, optional: tuple[str, ...] = ()) -> None:
    """Import `modules`, and those of `optional` that are installed.

    mlx-lm's model classes come without its package start-up (transformers, torch): the samples
    never need those, and a child that does (a real checkpoint's loader) imports them itself.
    """
    mlx_lm_classes.install()
    for name in modules:
        importlib.import_module(name)
    for name in optional:
        with contextlib.suppress(ImportError):
            importlib.import_module(name)


def load_mlx_library() -> bool:
    """Open MLX's native library (and, through the dynamic loader, the CUDA libraries it links)
    without importing MLX's Python module; False where this MLX has no such library."""
    spec = importlib.util.find_spec("mlx")
    for folder in (spec and spec.submodule_search_locations) or []:
        library = os.path.join(folder, "lib", "libmlx.so")
        if os.path.exists(library):
            ctypes.CDLL(library, mode=ctypes.RTLD_GLOBAL)
            return True
    return False


def forked_child_works(mlx: bool, timeout: float = 120.0) -> bool:
    """Fork a child (that runs one small MLX op on the default device, with `mlx`); True when it
    succeeded in time.

    A backend whose import left state a forked child cannot use (a thread, a driver handle) shows
    here once, at the server's start, instead of as a hung or crashed job.

    Raises:
        ThreadedFork: The server had another thread when it forked.
    """
    pid = fork()
    if pid == 0:
        code = 1
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, 1)
            os.dup2(devnull, 2)
            if mlx:
                import mlx.core as mx  # MLX: only in this trial child, where the server preloaded it

                code = 0 if mx.sum(mx.ones((64, 64)) @ mx.ones((64, 64))).item() == 64.0**3 else 1
            else:
                code = 0
        finally:
            os._exit(code)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status) == 0
        time.sleep(0.02)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    return False
