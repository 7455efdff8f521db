"""CPU and Metal: a CPU-quiet gate, since Metal exposes no per-process GPU list to an unprivileged
user: the busiest foreign process must stay under a threshold (percent of one core).
"""

from __future__ import annotations

import time

from workers.contract import GpuPin, LockSettings
from workers.lock.probes.base import ProbeSample, backend_probe, command_of, ours
from workers.proc.table import cpu_times


class CpuQuietProbe:
    """CPU and Metal: foreign processes busier than `threshold` percent of one core.

    Usage is measured between consecutive readings (at least `min_window` seconds apart, so that
    the clock tick's granularity cannot make a blip look busy).
    """

    name = "cpu-quiet"

    def __init__(self, threshold: float = 50.0, min_window: float = 0.25) -> None:
        self.threshold = threshold
        self.min_window = min_window
        self._last: dict[int, tuple[int, float, str]] | None = None
        self._last_t = 0.0

    def prime(self) -> None:
        """Take the reading the next sample is measured from."""
        self._last = cpu_times()
        self._last_t = time.monotonic()

    def sample(self) -> ProbeSample:
        """Foreign processes above the threshold since the previous reading."""
        if self._last is None:
            self.prime()
        short = self.min_window - (time.monotonic() - self._last_t)
        if short > 0:
            time.sleep(short)
        before, t0 = self._last or {}, self._last_t
        now, t1 = cpu_times(), time.monotonic()
        self._last, self._last_t = now, t1
        window = max(t1 - t0, 1e-6)
        own = ours()
        foreign: dict[int, str] = {}
        for pid, (_ppid, used, _name) in now.items():
            prev = before.get(pid)
            percent = 100.0 * (used - (prev[1] if prev else 0.0)) / window
            if percent < self.threshold or own.contains(pid, now):
                continue
            foreign[pid] = f"{command_of(pid)}, {percent:.0f}% of a core"
        return ProbeSample(foreign)


@backend_probe("cpu", "metal")
def cpu_quiet_probe(settings: LockSettings, gpu: GpuPin | None) -> CpuQuietProbe:
    """The gate at the job's `cpu_busy_threshold` (one device: a pin changes nothing)."""
    return CpuQuietProbe(settings.cpu_busy_threshold)
