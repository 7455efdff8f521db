"""How kernel cases are timed: one method, used by the measurement (`workers.job.measure`) and by the
`auto` arm's choice (`kernels.dispatch`), so that `auto` picks what the measurement will find.

What is timed. MLX is lazy: calling an arm only builds a graph in Python; nothing runs until
`mx.eval`. A sample builds the graphs of all its calls first, then starts the clock, evaluates them
together and synchronises the device, so its time is what MLX's scheduler and the device spend
(kernel launches included), not the Python that built the graph. At decode sizes that Python costs
as much as the kernel (tens of microseconds per call against a 20 us GEMV): timed together, the
host's overhead would decide the comparison. The graph's cost is kept, per call, as its own number
(`Sample.host_seconds`, the `host_seconds` rows at decode sizes).

One call count per job. Several calls are evaluated per sample when one is too short to time
(`MIN_SAMPLE_SECONDS`); the count is chosen once for all arms of a job from the fastest arm's
warm-up times (capped so the slowest arm's sample stays under `MAX_SAMPLE_SECONDS`), so every arm
is timed under the same amortisation of the per-evaluation cost.

Cache state, an explicit choice (`cache`, recorded in every row). `cold` (the default): an arm
whose weights are small enough to stay in the last-level cache between calls rotates over copies
of them, call by call, until the copies together exceed `ROTATION` x the cache (with a 60 MB L2,
as on Hopper, a 58 MB GEMV weight is timed over 5 copies), so no call finds its weights in the cache.
`hot`: the same weights every call, as in a loop that reuses one layer. Activations rotate over the
job's input sets sample by sample either way. Where the copies are capped (`MAX_COPIES`,
`MAX_ROTATION_BYTES`) before they reach twice the cache the row says `warm`, not `cold`; where the
capped copies would not even exceed the cache together, the arm is not rotated at all (one copy,
`warm`: they would all stay resident); an arm that declares no weights (`ArmPath.weights`) cannot
be rotated and says `unrotated`.

The clock still holds one `mx.eval` and one synchronisation per sample (a few microseconds):
with one call count for all arms that cost is the same for each, and with at least 2 ms per
sample (`MIN_SAMPLE_SECONDS`) it is under 1 % of any sample.

Warm-up is measured in time, not calls: every arm's every weight copy is touched once, then the
arms are run interleaved until both `warmup` passes and `WARMUP_SECONDS` have gone by (JIT
compiles, allocations, GPU clocks settling). The call count is calibrated on the median of the
later half of those passes, not the last call alone. The checks that follow the warm-up let the
device idle and clocks fall, so the timed rounds start after `settle`: the timed arms again,
untimed, for `WARMUP_SECONDS`, at the job's call count.
"""

from __future__ import annotations

import ctypes
import math
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kernels.registry import ArmPath

MIN_SAMPLE_SECONDS = 2e-3  # a sample shorter than this times several calls together
MAX_SAMPLE_SECONDS = 0.25  # ... but the slowest arm's sample stays under this
MAX_CALLS = 64
WARMUP_SECONDS = 0.3  # JIT, allocation and GPU clocks settle within this (on a Hopper GPU, well under 0.1 s)
ROTATION = 4  # cold: weight copies together exceed this many times the last-level cache
MAX_COPIES = 64
MAX_ROTATION_BYTES = 4 * 2**30
CACHE_MODES = ("cold", "hot")
# Where the device cannot say: the largest last-level caches of the devices this project targets
# (Apple M1/M2 Ultra 96 MB system cache, H200 60 MB L2), rounded up, so a guess errs towards cold.
DEFAULT_LLC_BYTES = 128 * 2**20
APPLE_SLC_BYTES = {"ultra": 96 * 2**20, "max": 48 * 2**20, "pro": 24 * 2**20}
CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE = 38


def abba_order(arms: Sequence[str], rep: int) -> list[str]:
    """The arms in the order of repetition `rep`: forward on even, reversed on odd."""
    return list(arms) if rep % 2 == 0 else list(reversed(arms))


def _cuda_l2_bytes() -> int | None:
    """The L2 size of CUDA device 0 (MLX's), from the driver API; None without a driver."""
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
        dev, size = ctypes.c_int(), ctypes.c_int()
        if cuda.cuInit(0) or cuda.cuDeviceGet(ctypes.byref(dev), 0):
            return None
        if cuda.cuDeviceGetAttribute(ctypes.byref(size), CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE, dev):
            return None
        return int(size.value) or None
    except (OSError, AttributeError):
        return None


def _cpu_llc_bytes() -> int | None:
    """The largest cache level of CPU 0 (Linux sysfs), e.g. a shared L3."""
    best: tuple[int, int] | None = None
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            level = int((index / "level").read_text())
            text = (index / "size").read_text().strip().upper()
        except (OSError, ValueError):
            continue
        scale = {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1:], 1)
        digits = text.rstrip("KMG")
        if digits.isdigit() and (best is None or level > best[0]):
            best = (level, int(digits) * scale)
    return best[1] if best else None


def last_level_cache_bytes() -> int:
    """The last-level cache of the device MLX runs on (CUDA L2, Apple system cache, CPU L3)."""
    import mlx.core as mx  # optional heavy dependency: the timing plan (calls, ABBA order) needs no MLX

    if mx.default_device() == mx.gpu:
        if mx.cuda.is_available():
            return _cuda_l2_bytes() or DEFAULT_LLC_BYTES
        if mx.metal.is_available():
            name = str(mx.metal.device_info().get("device_name", "")).lower()
            return next((v for k, v in APPLE_SLC_BYTES.items() if k in name), 8 * 2**20)
        return DEFAULT_LLC_BYTES
    return _cpu_llc_bytes() or DEFAULT_LLC_BYTES


@dataclass(frozen=True)
class Method:
    """The settings of the timing method (the module's docstring says why each is what it is)."""

    cache: str = "cold"
    llc_bytes: int = 0  # 0: ask the device (`last_level_cache_bytes`)
    min_sample_seconds: float = MIN_SAMPLE_SECONDS
    max_sample_seconds: float = MAX_SAMPLE_SECONDS
    max_calls: int = MAX_CALLS
    warmup_seconds: float = WARMUP_SECONDS
    warmup_passes: int = 1

    def __post_init__(self) -> None:
        if self.cache not in CACHE_MODES:
            raise ValueError(f"cache {self.cache!r}: expected one of {', '.join(CACHE_MODES)}")

    def resolved(self) -> Method:
        """This method with the device's last-level cache filled in."""
        if self.llc_bytes > 0:
            return self
        return Method(**{**self.__dict__, "llc_bytes": last_level_cache_bytes()})


def weight_copies(nbytes: int, method: Method) -> int:
    """How many copies of `nbytes` of weights a cold arm rotates over.

    1 where one copy already exceeds the cache, and also where the capped copies would all fit in
    it together: rotating over copies that stay resident changes no cache state at the last level,
    only costs a call per copy in the warm-up (at the smoke shapes on a CPU, 64 calls of 3 ms per
    arm). Such an arm is timed `warm` over its one copy.
    """
    if method.cache == "hot" or nbytes <= 0:
        return 1
    wanted = math.ceil(ROTATION * method.llc_bytes / nbytes)
    copies = max(1, min(wanted, MAX_COPIES, MAX_ROTATION_BYTES // nbytes))
    return copies if copies * nbytes > method.llc_bytes else 1


def copy_arrays(arrays: tuple[Any, ...]) -> tuple[Any, ...]:
    """New buffers holding the same values (`mx.array(a)` copies; evaluated here, not when timed)."""
    import mlx.core as mx  # optional heavy dependency: the timing plan (calls, ABBA order) needs no MLX

    out = tuple(mx.array(a) for a in arrays)
    mx.eval(*out)
    return out


@dataclass(frozen=True)
class Sample:
    """One timed sample: seconds per call on the device side, and the Python graph cost per call."""

    seconds: float
    host_seconds: float


class ArmTimer:
    """One arm ready to time: its run functions over its weight copies, rotated call by call."""

    def __init__(self, path: ArmPath, method: Method) -> None:
        self.path = path
        self.weight_bytes = int(sum(int(w.nbytes) for w in path.weights))
        copies = weight_copies(self.weight_bytes, method) if path.rebind is not None else 1
        self.runs: list[Callable[..., Any]] = [path.run]
        self.arrays: list[Any] = list(path.weights)
        rebind = path.rebind
        for _ in range(copies - 1):
            assert rebind is not None
            weights = copy_arrays(path.weights)
            self.arrays.extend(weights)
            self.runs.append(rebind(weights))
        self._next = 0
        rotated = self.weight_bytes * len(self.runs)
        if method.cache == "hot":
            self.cache = "hot"
        elif not path.weights:
            self.cache = "unrotated"  # the path declares no weights to rotate
        else:  # the copies together are past twice the cache, or they were capped inside it
            self.cache = "cold" if rotated >= 2 * method.llc_bytes else "warm"
        self.llc_bytes = method.llc_bytes

    @property
    def copies(self) -> int:
        """The weight copies this arm rotates over."""
        return len(self.runs)

    def record(self) -> dict[str, str]:
        """What a row says about the cache state this arm was timed in."""
        return {
            "cache": self.cache,
            "weight_copies": str(self.copies),
            "weight_bytes": str(self.weight_bytes),
            "llc_bytes": str(self.llc_bytes),
        }

    def sample(self, inputs: tuple[Any, ...], calls: int) -> Sample:
        """Build `calls` calls' graphs (untimed), then time their evaluation, synchronised."""
        import mlx.core as mx  # optional heavy dependency: the timing plan (calls, ABBA order) needs no MLX

        mx.synchronize()
        n = len(self.runs)
        t0 = time.perf_counter()
        outs = [self.runs[(self._next + j) % n](*inputs) for j in range(calls)]
        t1 = time.perf_counter()
        mx.eval(outs)
        mx.synchronize()
        t2 = time.perf_counter()
        self._next = (self._next + calls) % n
        del outs
        return Sample((t2 - t1) / calls, (t1 - t0) / calls)


def warm_up(
    timers: dict[str, ArmTimer], pool: Sequence[tuple[Any, ...]], method: Method
) -> tuple[dict[str, float], dict[str, str]]:
    """Run every arm until the warm-up is long enough (see the module docstring).

    Returns:
        (per-call seconds of each arm that ran: the median of its later warm-up passes,
        arm -> the error of each arm that raised; those arms are left out of the estimates).
    """
    errors: dict[str, str] = {}
    seen: dict[str, list[float]] = {name: [] for name in timers}
    names = list(timers)
    start = time.perf_counter()
    passes = 0
    while True:
        for name in abba_order(names, passes):
            if name in errors:
                continue
            timer = timers[name]
            if passes == 0:
                calls = timer.copies  # every weight copy once, before anything is timed
            else:
                last = seen[name][-1]
                calls = max(1, min(method.max_calls, math.ceil(method.min_sample_seconds / max(last, 1e-9))))
            try:
                seen[name].append(timer.sample(pool[passes % len(pool)], calls).seconds)
            except Exception as exc:  # a path that raises fails, the others go on
                errors[name] = f"{type(exc).__name__}: {exc}"
        passes += 1
        if passes > method.warmup_passes and time.perf_counter() - start >= method.warmup_seconds:
            break
        if len(errors) == len(names):
            break
    estimates = {
        name: statistics.median(times[len(times) // 2 :]) for name, times in seen.items() if name not in errors
    }
    return estimates, errors


def settle(timers: dict[str, ArmTimer], pool: Sequence[tuple[Any, ...]], calls: int, seconds: float) -> None:
    """Untimed samples of every arm, interleaved, for one pass and at least `seconds`: the state
    the timed rounds start in (clocks up, caches and allocator as the rounds will find them) is
    not left to the checks and the choices that ran since the warm-up."""
    names = list(timers)
    start = time.perf_counter()
    passes = 0
    while passes == 0 or time.perf_counter() - start < seconds:
        for name in abba_order(names, passes):
            timers[name].sample(pool[passes % len(pool)], calls)
        passes += 1


def common_calls(per_call: dict[str, float], method: Method) -> int:
    """One call count for every arm: enough for the fastest arm's sample to reach
    `min_sample_seconds`, few enough for the slowest one's to stay under `max_sample_seconds`."""
    if not per_call:
        return 1
    fastest, slowest = min(per_call.values()), max(per_call.values())
    calls = max(1, min(method.max_calls, math.ceil(method.min_sample_seconds / max(fastest, 1e-9))))
    return max(1, min(calls, math.floor(method.max_sample_seconds / max(slowest, 1e-9))))


def interleaved(
    timers: dict[str, ArmTimer], pool: Sequence[tuple[Any, ...]], calls: int, repetitions: int
) -> Iterator[tuple[int, str, Sample]]:
    """(repetition, arm, sample) for `repetitions` ABBA rounds, the input set rotating per round."""
    names = list(timers)
    for rep in range(repetitions):
        inputs = pool[rep % len(pool)]
        for name in abba_order(names, rep):
            yield rep, name, timers[name].sample(inputs, calls)
