"""The host fingerprint: what every number was measured on.

Stated plainly in every row: the host name, the OS (kernel release and distribution), CPU or chip
model, memory, GPU name and driver where known, the MLX version, MLX's default device and the
backend it really runs on, the BLAS that MLX's CPU backend ships with, and the thread count the
job ran with. `fingerprint_id` hashes the host name, OS release, hardware, GPU driver, backend
and MLX version: any of them changing is a new fingerprint. On a host with several GPUs the job's
own GPU (`gpu_index`, `gpu_uuid`; its name and driver from `nvidia-smi --id`) is part of it, so
each GPU has its own fingerprint (and its own measured peaks).
"""

from __future__ import annotations

import functools
import os
import platform
import re
import shutil
import socket
import subprocess
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from workers.contract import GpuPin, HostFingerprint


def _cpu_model() -> str:
    if platform.system() == "Darwin":
        out = _command(["sysctl", "-n", "machdep.cpu.brand_string"])
        if out:
            return out
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith(("model name", "hardware", "cpu model")):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _memory_bytes() -> int:
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        out = _command(["sysctl", "-n", "hw.memsize"])
        return int(out) if out and out.isdigit() else 0


def _command(argv: list[str]) -> str | None:
    if shutil.which(argv[0]) is None:
        return None
    try:
        res = subprocess.run(argv, capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return res.stdout.strip() if res.returncode == 0 else None


def _nvidia_gpu(gpu: str | None = None) -> tuple[str | None, str | None]:
    """(name, driver) of the first NVIDIA GPU, or of `gpu` (an index or UUID)."""
    which = [f"--id={gpu}"] if gpu else []
    out = _command(["nvidia-smi", *which, "--query-gpu=name,driver_version", "--format=csv,noheader"])
    if not out:
        return None, None
    name, _, driver = out.splitlines()[0].partition(",")
    return name.strip() or None, driver.strip() or None


def device_memory_bytes(backend: str) -> int | None:
    """The memory one job's arrays can live in on this machine's device of `backend`, or None.

    CPU and Metal (unified memory): the RAM. CUDA: the first GPU's total memory as `nvidia-smi`
    reports it (NVML; no device context is opened). ROCm and anything else: None (unknown here;
    an inventory states it with `memory_gib`).
    """
    if backend in ("cpu", "metal"):
        return _memory_bytes() or None
    if backend == "cuda":
        out = _command(["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"])
        first = out.splitlines()[0].strip() if out else ""
        return int(first) * 1024 * 1024 if first.isdigit() else None
    return None


def _blas() -> str | None:
    """The BLAS MLX's CPU backend links (the Linux wheel bundles netlib's reference BLAS)."""
    try:
        import mlx  # optional heavy dependency: only its installed files are read here

        for base in mlx.__path__:
            libs = Path(base).parent / "mlx_cpu.libs"
            if libs.is_dir():
                names = sorted(p.name for p in libs.iterdir() if p.name.startswith(("libblas", "libopenblas")))
                if names:
                    return f"bundled {names[0]} (netlib reference BLAS)" if "libblas" in names[0] else names[0]
    except ImportError:
        return None
    if platform.system() == "Darwin":
        return "Accelerate"
    return None


def _os_release() -> str:
    """`Linux 6.8.0-45-generic (Ubuntu 24.04.1 LTS)`, `Darwin 24.1.0 (macOS 15.1)`: kernel and distribution."""
    text = f"{platform.system()} {platform.release()}"
    if platform.system() == "Darwin" and platform.mac_ver()[0]:
        return f"{text} (macOS {platform.mac_ver()[0]})"
    try:
        pretty = platform.freedesktop_os_release().get("PRETTY_NAME")
    except OSError:
        pretty = None
    return f"{text} ({pretty})" if pretty else text


def detect_backend() -> str:
    """The backend MLX really runs on here: cuda, metal or cpu."""
    import mlx.core as mx  # optional heavy dependency: the head fingerprints no device

    if mx.default_device() == mx.gpu:
        if mx.cuda.is_available():
            return "cuda"
        if mx.metal.is_available():
            return "metal"
        return "gpu"
    return "cpu"


def _mlx_version() -> str:
    """MLX's version from its installed metadata, without importing it."""
    try:
        return version("mlx")
    except PackageNotFoundError:
        return "unknown"


@functools.lru_cache(maxsize=1)
def _static_facts() -> tuple[str, int, str | None, str | None]:
    """(CPU model, memory, NVIDIA GPU name, driver): read once per process (a fork server's
    children inherit them: `read_static_facts`)."""
    gpu, driver = _nvidia_gpu()
    return _cpu_model(), _memory_bytes(), gpu, driver


def read_static_facts() -> None:
    """Read the host facts that cannot change within a run (CPU model, memory, GPU name, driver)
    now, in a fork server, so that each job forked from it inherits them instead of reading them
    again (`nvidia-smi` is tens of milliseconds). Nothing that can change per job is cached: the
    thread count, MLX's device and backend, the job's own GPU and every probe are read in the job.
    A server lives as long as its Ray worker, one run; the next run reads the facts again."""
    _static_facts()


@functools.lru_cache(maxsize=8)
def _pinned_gpu(gpu: str) -> tuple[str | None, str | None]:
    return _nvidia_gpu(gpu)


def static_fingerprint(
    backend: str, *, mlx_version: str | None = None, mlx_device: str = "unknown", pin: GpuPin | None = None
) -> HostFingerprint:
    """This host as it is known without opening a device: for a process that must not hold a
    GPU context (the head, a Ray worker) and as the base of `host_fingerprint`. `pin`: the job's
    GPU on a host with several."""
    cpu, memory, gpu, driver = _static_facts()
    if pin is not None and backend == "cuda":
        gpu, driver = _pinned_gpu(pin.uuid or str(pin.index))
    if backend == "metal":
        gpu, driver = gpu or "Apple GPU", f"macOS {platform.mac_ver()[0]}"
    elif backend != "cuda":
        gpu, driver = None, None
    version = mlx_version or _mlx_version()
    threads = int(os.environ.get("OMP_NUM_THREADS") or os.cpu_count() or 1)
    hostname = socket.gethostname()
    os_release = _os_release()
    return HostFingerprint(
        hostname=hostname,
        os=os_release,
        machine=platform.machine(),
        cpu=cpu,
        cpu_count=os.cpu_count() or 1,
        memory_bytes=memory,
        gpu=gpu,
        gpu_driver=driver,
        mlx_version=version,
        mlx_device=mlx_device,
        backend=backend,
        blas=_blas() if backend == "cpu" else None,
        threads=threads,
        fingerprint_id="",
        gpu_index=None if pin is None else pin.index,
        gpu_uuid=None if pin is None else pin.uuid,
    ).with_id()


def host_fingerprint(pin: GpuPin | None = None) -> HostFingerprint:
    """Fingerprint this host as MLX sees it now (opens MLX's device: worker processes only); `pin`:
    the job's GPU on a host with several (its process sees only that one)."""
    import mlx.core as mx  # optional heavy dependency: the head fingerprints no device

    backend = detect_backend()
    fp = static_fingerprint(
        backend, mlx_version=str(getattr(mx, "__version__", "unknown")), mlx_device=str(mx.default_device()), pin=pin
    )
    if backend == "metal":
        info = mx.metal.device_info()
        gpu = str(info.get("device_name") or info.get("architecture") or "Apple GPU")
        fp = fp.model_copy(update={"gpu": gpu}).with_id()
    return fp


VENDOR_WORDS = {"apple", "nvidia", "geforce", "amd", "radeon", "graphics", "tesla"}


def device_kind_slug(gpu_name: str) -> str:
    """A device kind from a GPU's name: `Apple M1 Ultra` -> `m1-ultra`, `NVIDIA H200` -> `h200`."""
    words = [w for w in re.split(r"[^a-z0-9]+", gpu_name.lower()) if w and w not in VENDOR_WORDS]
    return "-".join(words) or "gpu"


def local_device() -> tuple[str, str]:
    """This machine's (device kind, backend) as MLX runs here: `cpu` where MLX has no GPU backend.

    Opens MLX's device: the head asks a short-lived process for it (`python -m workers device`).
    """
    backend = detect_backend()
    if backend == "cpu":
        return "cpu", "cpu"
    fp = host_fingerprint()
    return device_kind_slug(fp.gpu or backend), backend
