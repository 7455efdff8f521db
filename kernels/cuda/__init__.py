"""CUDA sources of the custom NVFP4 kernels, and how they become `mx.fast.cuda_kernel` builds.

The `.cu` files hold kernel *bodies* (MLX writes the signature from the input and output names);
`nvfp4_mma.cuh` is the shared header (the GEMM adds `gemm_nvfp4.cuh`). `CudaKernelSource` joins a
body with its headers, names the
compiled kernel after a hash of the text (MLX caches compiled PTX by kernel name, so a changed
source must never reuse an old name), and can render the whole translation unit the way MLX does,
so that `nvcc` can check it on a machine without a GPU (`standalone_source`).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SOURCE_DIR = Path(__file__).resolve().parent
HEADER_FILE = "nvfp4_mma.cuh"

# What MLX's custom-kernel builder puts before the header (mlx/backend/cuda/custom_kernel.cpp);
# for an offline nvcc check the MLX include is replaced by the CUDA headers it brings.
_STANDALONE_PRELUDE = """#include <cstdint>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cooperative_groups.h>
#ifndef MLX_STANDALONE_SHAPE
#define MLX_STANDALONE_SHAPE
// MLX passes `<input>_shape` as a fixed-size array of int32 (mlx/backend/cuda/device/config.h)
struct Shape {
  int32_t v[10];
  __device__ int32_t operator[](int i) const { return v[i]; }
};
#endif
"""

CUDA_TYPES = {"float32": "float", "float16": "__half", "bfloat16": "__nv_bfloat16"}
_ARRAY_TYPES = {"uint32": "uint32_t", "uint8": "uint8_t", "float32": "float", **CUDA_TYPES}

TemplateValue = int | bool | str  # str: a dtype name, e.g. "bfloat16"


@functools.cache
def read_source(name: str) -> str:
    """The text of one file of this folder."""
    return (SOURCE_DIR / name).read_text()


def template_lines(template: dict[str, TemplateValue]) -> list[str]:
    """The template constants as MLX declares them at the top of a kernel body."""
    lines = []
    for key, value in template.items():
        if isinstance(value, bool):
            lines.append(f"  constexpr bool {key} = {'true' if value else 'false'};")
        elif isinstance(value, int):
            lines.append(f"  constexpr int {key} = {value};")
        else:
            lines.append(f"  using {key} = {CUDA_TYPES[value]};")
    return lines


@dataclass(frozen=True)
class CudaKernelSource:
    """One kernel: its body file, input and output names, and the shared header.

    Attributes:
        body_file: the `.cu` file holding the kernel body.
        inputs: input pointer names, in call order.
        outputs: output pointer names.
        headers: the header files, in order (joined into MLX's `header`).
    """

    body_file: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    headers: tuple[str, ...] = (HEADER_FILE,)

    @property
    def body(self) -> str:
        """The kernel body."""
        return read_source(self.body_file)

    @property
    def header(self) -> str:
        """The header passed to MLX (helpers outside the kernel function)."""
        return "\n".join(read_source(h) for h in self.headers)

    @property
    def name(self) -> str:
        """Kernel name: the body's stem plus a hash of body and header (a cache key for MLX)."""
        digest = hashlib.sha256((self.header + self.body).encode()).hexdigest()[:12]
        return f"{Path(self.body_file).stem}_{digest}"

    def standalone_source(
        self,
        input_dtypes: dict[str, str],
        output_dtypes: dict[str, str],
        template: dict[str, TemplateValue],
        function_name: str | None = None,
        prelude: bool = True,
    ) -> str:
        """The whole translation unit as MLX builds it, compilable by plain `nvcc -c`.

        Args:
            input_dtypes: input name -> MLX dtype name (e.g. "uint32").
            output_dtypes: output name -> MLX dtype name.
            template: the template constants (ints, bools, dtype names) MLX would declare.
            function_name: the kernel's name (default: `name`); several instantiations of one body
                in one file need distinct names.
            prelude: False leaves out the includes and the header (for the second and later
                instantiations in one file).
        """
        params = []
        for n in self.inputs:
            params.append(f"    const {_ARRAY_TYPES[input_dtypes[n]]}* {n}")
            if f"{n}_shape" in self.body:  # as MLX does: the shape follows its array
                params.append(f"    const __grid_constant__ Shape {n}_shape")
        params += [f"    {_ARRAY_TYPES[output_dtypes[n]]}* {n}" for n in self.outputs]
        consts = template_lines(template)
        return (
            (_STANDALONE_PRELUDE + self.header if prelude else "")
            + "\nnamespace mlx::core::cu {\n\n__global__ void "
            + (function_name or self.name)
            + "(\n"
            + ",\n".join(params)
            + ") {\n"
            + "\n".join(consts)
            + "\n\n"
            + self.body
            + "\n}\n\n}  // namespace mlx::core::cu\n"
        )


def precompiled_source(
    source: CudaKernelSource,
    input_dtypes: dict[str, str],
    output_dtypes: dict[str, str],
    template: dict[str, TemplateValue],
    function_name: str,
    prelude: str = _STANDALONE_PRELUDE,
    max_threads: int = 0,
) -> str:
    """A body as a whole `extern "C"` kernel for `mx.fast.precompiled_cuda_kernel`: inputs, outputs,
    then one int per input whose body reads `<input>_shape[0]` (MLX passes no shapes to
    precompiled kernels; the body sees a one-element array). `max_threads` (where not 0): the
    block size, as `__launch_bounds__(max_threads, 1)`, so that ptxas keeps to the registers a
    block of that many threads can have (64K / max_threads each)."""
    params = [f"const {_ARRAY_TYPES[input_dtypes[n]]}* {n}" for n in source.inputs]
    params += [f"{_ARRAY_TYPES[output_dtypes[n]]}* {n}" for n in source.outputs]
    shaped = [n for n in source.inputs if f"{n}_shape" in source.body]
    params += [f"int {n}_rows" for n in shaped]
    lines = [f"  const int {n}_shape[1] = {{{n}_rows}};" for n in shaped] + template_lines(template)
    bounds = f"__launch_bounds__({max_threads}, 1) " if max_threads else ""
    return (
        prelude
        + source.header
        + f'\nextern "C" __global__ void {bounds}{function_name}('
        + ", ".join(params)
        + ") {\n"
        + "\n".join(lines)
        + "\n\n"
        + source.body
        + "\n}\n"
    )


@dataclass(frozen=True)
class CudaDevice:
    """What the launch shapes depend on, read from the CUDA driver for device 0."""

    name: str
    multiprocessors: int
    compute_capability: tuple[int, int]
    max_shared_per_block: int  # bytes one block may have, opting in (227 KB on sm_90)


@functools.cache
def cuda_device() -> CudaDevice | None:
    """Device 0 through the driver API (libcuda, present wherever the NVIDIA driver is); None
    without a driver or device."""
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    dev = ctypes.c_int()
    if cuda.cuInit(0) != 0 or cuda.cuDeviceGet(ctypes.byref(dev), 0) != 0:
        return None

    def attribute(code: int) -> int:
        value = ctypes.c_int()
        if cuda.cuDeviceGetAttribute(ctypes.byref(value), code, dev) != 0:
            raise RuntimeError(f"cuDeviceGetAttribute({code}) failed")
        return value.value

    name = ctypes.create_string_buffer(256)
    cuda.cuDeviceGetName(name, 256, dev)
    # CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT 16, COMPUTE_CAPABILITY_MAJOR 75 / MINOR 76,
    # MAX_SHARED_MEMORY_PER_BLOCK_OPTIN 97
    return CudaDevice(
        name=name.value.decode(errors="replace"),
        multiprocessors=attribute(16),
        compute_capability=(attribute(75), attribute(76)),
        max_shared_per_block=attribute(97),
    )


# MLX's CUDA allocator (0.32) serves arrays of at most 8 bytes from one pool of unified memory
# advised read-mostly. A kernel that reads such an array pays for it at every launch: the stream
# GEMV at N=21504, K=5376 took 38.3 us per launch with MLX's 4-byte multiplier against 24.0 us with
# the same value in a cudaMalloc buffer (a Hopper GPU, benchmarks/gemv_mlx_gap.py, BENCHMARKS.md).
SMALL_POOL_BYTES = 8


def off_small_pool(a: Any) -> Any:
    """`a` (an mx.array), or where it is small enough for MLX's small-buffer pool, its elements
    followed by zeros in a 16-byte array (the kernels read only the leading elements)."""
    import mlx.core as mx  # optional heavy dependency: the sources render and check without MLX

    if a.nbytes > SMALL_POOL_BYTES:
        return a
    pad = mx.zeros((16 // a.itemsize - a.size,), dtype=a.dtype)
    return mx.concatenate([a.reshape(-1), pad])


def cuda_backend_available() -> bool:
    """True where MLX runs on its CUDA backend (an NVIDIA GPU); False on CPU and Metal."""
    import mlx.core as mx  # optional heavy dependency: the sources render and check without MLX

    try:
        if not mx.cuda.is_available():
            return False
    except AttributeError:  # an MLX built without the CUDA module
        return False
    return bool(mx.default_device() == mx.gpu)


@functools.cache
def compiled_kernel(source: CudaKernelSource, shared_memory: int = 0) -> Any:
    """The `mx.fast.cuda_kernel` for a source and dynamic shared memory size (MLX compiles it
    through NVRTC at first call, and lifts the 48 KB default where more is asked)."""
    import mlx.core as mx  # optional heavy dependency: the sources render and check without MLX

    return mx.fast.cuda_kernel(
        name=source.name,
        input_names=list(source.inputs),
        output_names=list(source.outputs),
        source=source.body,
        header=source.header,
        ensure_row_contiguous=True,
        shared_memory=shared_memory,
    )


def single_output_launch(
    kernel: Any,
    template: list[tuple[str, Any]],
    grid: tuple[int, int, int],
    threadgroup: tuple[int, int, int],
    shape: tuple[int, ...],
    dtype: Any,
    *,
    compiled: bool,
    init_value: float | None = None,
) -> Callable[..., Any]:
    """`kernel`'s call on its inputs, returning its one output; traced once by `mx.compile` where
    `compiled` (later calls replay the graph instead of assembling the call in Python and C++, tens
    of microseconds, more than a decode kernel takes). `init_value` fills the output first."""
    import mlx.core as mx  # optional heavy dependency: the sources render and check without MLX

    def launch(*inputs: Any) -> Any:
        (y,) = kernel(
            inputs=list(inputs),
            template=template,
            grid=grid,
            threadgroup=threadgroup,
            output_shapes=[shape],
            output_dtypes=[dtype],
            init_value=init_value,
        )
        return y

    return mx.compile(launch) if compiled else launch


def precompiled_launch(
    name: str,
    cubin: bytes,
    grid: tuple[int, int, int],
    threadgroup: tuple[int, int, int],
    shape: tuple[int, ...],
    dtype: Any,
    *,
    shared_memory: int,
    scalars: list[int],
    compiled: bool,
    init_value: float | None = None,
) -> Callable[..., Any]:
    """A cubin's kernel `name` (see `kernels.cuda.nvrtc`) called on its inputs through
    `mx.fast.precompiled_cuda_kernel`, returning its one output (traced by `mx.compile` where
    `compiled`). The kernel takes the inputs, the output, then `scalars` (ints)."""
    import mlx.core as mx  # optional heavy dependency: the sources render and check without MLX

    def launch(*inputs: Any) -> Any:
        (y,) = mx.fast.precompiled_cuda_kernel(
            name=name,
            compiled_source=cubin,
            inputs=list(inputs),
            output_shapes=[shape],
            output_dtypes=[dtype],
            scalars=list(scalars),
            grid=grid,
            threadgroup=threadgroup,
            shared_memory=shared_memory,
            init_value=init_value,
            ensure_row_contiguous=True,
        )
        return y

    return mx.compile(launch) if compiled else launch
