"""Watching a probe: the idle gate before a job (`wait_idle`) and the contention monitor during its
measurement (`ContentionMonitor`), which says when a foreign user may have been there.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from workers.lock.gpu import LockBusyError
from workers.lock.probes.base import GpuUserProbe, ProbeSample


def wait_idle(probe: GpuUserProbe, idle_secs: float, *, max_wait: float = 0.0, interval: float = 1.0) -> float:
    """Wait until the probe has seen no foreign user for `idle_secs` in a row.

    Args:
        probe: The backend's probe.
        idle_secs: Quiet time required; 0 returns at once without sampling.
        max_wait: Give up after this many seconds; 0 waits without limit.
        interval: Seconds between samples (shortened for short `idle_secs`).

    Returns:
        Seconds waited.

    Raises:
        LockBusyError: The device was still in use by others when `max_wait` ran out.
    """
    if idle_secs <= 0:
        return 0.0
    start = time.monotonic()
    step = min(interval, max(idle_secs / 4, 0.05))
    quiet_since: float | None = None
    last_busy = ProbeSample()
    probe.prime()
    while True:
        seen = probe.sample()
        now = time.monotonic()
        if seen.busy:
            quiet_since, last_busy = None, seen
        elif quiet_since is None:
            quiet_since = now
        if quiet_since is not None and now - quiet_since >= idle_secs:
            return now - start
        if max_wait > 0 and now - start >= max_wait:
            raise LockBusyError(
                f"gave up waiting for an idle device after {now - start:.1f} s (max_wait {max_wait:g} s, "
                f"{probe.name}): {last_busy.describe()}",
                waited=now - start,
            )
        time.sleep(step)


@dataclass
class ContentionReport:
    """What the monitor saw during one measurement.

    Attributes:
        contended: A foreign user was seen in at least one sample, or a sample failed (a window
            nobody could check is not clean).
        samples: Samples taken (at least one).
        busy_samples: Samples that saw a foreign user.
        foreign_pids: Every foreign pid seen, sorted.
        foreign: Every foreign user seen, pid -> its description (command, share of a core or the
            GPU) as first seen: taken when caught, since the process may be gone by the job's end.
        detail: The foreign users or the probe error, for a log line.
        busy_windows: When a foreign user may have been there (monotonic seconds): for each busy
            or failed look, from the look before it to the look after it, since the user may have
            come just after the last clean look and left just before the next one.
    """

    contended: bool = False
    samples: int = 0
    busy_samples: int = 0
    foreign_pids: list[int] = field(default_factory=list)
    foreign: dict[int, str] = field(default_factory=dict)
    detail: str = ""
    errors: list[str] = field(default_factory=list)
    busy_windows: list[tuple[float, float]] = field(default_factory=list)


class ContentionMonitor:
    """Samples a probe in a background thread during a measurement.

    Example:
        monitor = ContentionMonitor(probe, interval=1.0)
        monitor.start()
        ...measure...
        report = monitor.stop()
    """

    def __init__(self, probe: GpuUserProbe, interval: float = 1.0) -> None:
        self.probe = probe
        self.interval = interval
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._report = ContentionReport()
        self._pids: set[int] = set()
        self._looks: list[tuple[float, bool]] = []  # (monotonic time, busy or failed)

    def start(self) -> None:
        """Begin sampling about every `interval` seconds."""
        self._looks = [(time.monotonic(), False)]
        self.probe.prime()
        self._thread = threading.Thread(target=self._run, name="contention-monitor", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self._take()

    def _take(self) -> None:
        report = self._report
        report.samples += 1
        try:
            seen = self.probe.sample()
        except Exception as exc:  # a failed look is recorded, and the window is not called clean
            report.errors.append(f"{self.probe.name}: {exc}")
            report.contended = True
            report.detail = report.errors[-1]
            self._looks.append((time.monotonic(), True))
            return
        self._looks.append((time.monotonic(), seen.busy))
        if seen.busy:
            report.busy_samples += 1
            report.contended = True
            self._pids.update(seen.foreign)
            for pid, what in seen.foreign.items():
                report.foreign.setdefault(pid, what)
            report.detail = seen.describe()

    def stop(self) -> ContentionReport:
        """Stop sampling, take a last sample covering the tail, and return what was seen."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self._take()
        self._report.foreign_pids = sorted(self._pids)
        looks = self._looks
        self._report.busy_windows = [
            (looks[i - 1][0] if i > 0 else t, looks[i + 1][0] if i + 1 < len(looks) else t)
            for i, (t, busy) in enumerate(looks)
            if busy
        ]
        return self._report
