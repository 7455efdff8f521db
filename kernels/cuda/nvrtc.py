"""Kernels MLX's own build cannot make: NVRTC through ctypes, for a target MLX does not ask for.

MLX 0.32's `mx.fast.cuda_kernel` compiles with `--gpu-architecture=sm_<major><minor>` (sm_90 on
an H100/H200), which rejects Hopper's arch-specific instructions (wgmma, setmaxnreg need sm_90a).
`compile_cubin` builds a whole translation unit for another target with the NVRTC library the
machine already has (the one MLX's JIT loaded, else the CUDA toolkit's or a pip wheel's), and
`mx.fast.precompiled_cuda_kernel` loads the cubin (compressed into a fatbin where nvFatbin is
here: `kernels.cuda.fatbin`). Builds are cached per source and target in this process and on disk
(`kernels.cuda.build_cache`).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
from pathlib import Path

from kernels.cuda import (
    CudaKernelSource,
    TemplateValue,
    build_cache,
    cuda_device,
    fatbin,
    libraries,
    precompiled_source,
)

NVRTC_ENV = "ORCHESTRATE_NVRTC"  # an explicit libnvrtc.so path

# NVRTC has no C++ standard library: the fixed-width types the kernels use, then the CUDA headers
# (found on the include path given to the compile).
PRELUDE = """typedef unsigned char uint8_t;
typedef unsigned short uint16_t;
typedef unsigned int uint32_t;
typedef int int32_t;
typedef unsigned long long uint64_t;
typedef decltype(sizeof(0)) size_t;
#include <cuda_bf16.h>
#include <cuda_fp16.h>
"""


@functools.cache
def library() -> ctypes.CDLL | None:
    """The NVRTC library, or None where none loads."""
    return libraries.load("nvrtc", NVRTC_ENV, "nvrtcVersion")


def version() -> tuple[int, int] | None:
    """NVRTC's (major, minor), or None without it."""
    return libraries.version(library(), "nvrtcVersion")


def include_dirs() -> list[str]:
    """The CUDA toolkit's headers (as MLX's JIT finds them) and MLX's CCCL, where present."""
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda"
    dirs = [f"{home}/include"]
    try:
        import mlx.core  # optional heavy dependency: its CCCL headers, where MLX is installed

        dirs.append(str(Path(str(mlx.core.__file__)).resolve().parent / "include" / "cccl"))
    except ImportError:
        pass
    return [d for d in dirs if Path(d).is_dir()]


def device_arch() -> str | None:
    """The SASS target of device 0 (e.g. "sm_90"), where a CUDA device and NVRTC are both here."""
    device = cuda_device()
    if device is None or library() is None:
        return None
    major, minor = device.compute_capability
    return f"sm_{major}{minor}"


@functools.cache
def build(
    source: CudaKernelSource,
    inputs: tuple[tuple[str, str], ...],
    outputs: tuple[tuple[str, str], ...],
    template: tuple[tuple[str, TemplateValue], ...],
    arch: str,
    max_threads: int = 0,
) -> tuple[str, bytes]:
    """(kernel name, module image) of `source` at `template` for `arch`, for `precompiled_launch`:
    the cubin, compressed into a fatbin where nvFatbin is here (`kernels.cuda.fatbin`: MLX hashes
    the image at every launch).

    MLX's `mx.fast.cuda_kernel` compiles a kernel again in every process (its on-disk cache holds
    MLX's own kernels): seconds per shape, paid by every cold model sample's warm-up. This build
    goes through `compile_cubin`'s disk cache instead. `inputs`/`outputs`: (name, dtype name)
    pairs in call order; `template`: the constants MLX would declare; `max_threads`: the block
    size, where ptxas must keep to its registers (`precompiled_source`).
    """
    args = (source, dict(inputs), dict(outputs), dict(template))
    placeholder = precompiled_source(*args, "KERNEL", prelude=PRELUDE, max_threads=max_threads)
    fn = kernel_name(Path(source.body_file).stem, placeholder, arch)
    cubin = compile_cubin(precompiled_source(*args, fn, prelude=PRELUDE, max_threads=max_threads), arch)
    return fn, fatbin.compress(cubin, arch)


def route(kernel: str, arch: str | None) -> str:
    """A CUDA kernel's `route` in the rows: `precompiled <arch>(kernel)`, our build for `arch`, or
    `cuda_kernel(kernel)`, MLX's per-process JIT, where `arch` is None (no NVRTC library here)."""
    return f"{'precompiled ' + arch if arch else 'cuda_kernel'}({kernel})"


def kernel_name(stem: str, source: str, arch: str) -> str:
    """A name unique to the source and target (MLX caches loaded modules by kernel name)."""
    return f"{stem}_{hashlib.sha256((arch + source).encode()).hexdigest()[:12]}"


@functools.cache
def compile_cubin(source: str, arch: str) -> bytes:
    """`source` compiled by NVRTC for `arch` (e.g. "sm_90a"): the cubin's bytes.

    Kept in this process and in the per-user disk cache (`kernels.cuda.build_cache`), keyed by
    the source, the target, NVRTC's version and the compile options, so a fresh process (a cold
    model sample) loads it instead of compiling it again.

    Raises:
        RuntimeError: no NVRTC, or the compile failed (with the end of NVRTC's log).
    """
    lib = library()
    if lib is None:
        tried = ", ".join(libraries.candidates("nvrtc", NVRTC_ENV)[:6])
        raise RuntimeError(f"no NVRTC library found (tried {tried}; set {NVRTC_ENV})")
    opts = [f"--gpu-architecture={arch}", "--std=c++17", *(f"--include-path={d}" for d in include_dirs())]
    key = "\0".join(["cubin", f"nvrtc {version()}", *opts, source])
    return build_cache.cached(key, lambda: _compile(lib, source, opts, arch))


def _compile(lib: ctypes.CDLL, source: str, opts: list[str], arch: str) -> bytes:
    prog = ctypes.c_void_p()

    def check(result: int, what: str) -> None:
        if result != 0:
            raise RuntimeError(f"NVRTC {what} failed with error {result}")

    check(lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), b"kernel.cu", 0, None, None), "create")
    try:
        argv = (ctypes.c_char_p * len(opts))(*(o.encode() for o in opts))
        result = lib.nvrtcCompileProgram(prog, len(opts), argv)
        if result != 0:
            size = ctypes.c_size_t()
            lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
            log = ctypes.create_string_buffer(size.value + 1)
            lib.nvrtcGetProgramLog(prog, log)
            text = log.value.decode(errors="replace")
            raise RuntimeError(f"NVRTC compile for {arch} failed ({result}): {text[-3000:]}")
        size = ctypes.c_size_t()
        check(lib.nvrtcGetCUBINSize(prog, ctypes.byref(size)), "cubin size")
        cubin = ctypes.create_string_buffer(size.value)
        check(lib.nvrtcGetCUBIN(prog, cubin), "cubin")
        return cubin.raw
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))
