"""Where a job's time goes: named phases, summed per job, written to its fragment's footer.

The job's process keeps one `Phases` (`current()`), reset when a job starts; code that does a
phase's work wraps it in `span(name)`. At the end of the job the sums go into the fragment's
footer as JSON (`orchestrate.phases`, see docs/results.md), with the Ray task's own view added
by `workers.job.task`. Phase names:

* `worker_start`: from the Ray task asking for the job's process to the job starting in it
  (fork from the fork server, or a fresh interpreter's start-up and imports);
* `imports`: importing the case's modules (MLX and the kernels, where not preloaded);
* `fingerprint`, `peaks`: describing the host, probing its copy and matrix peaks (once per host);
* `lock_wait`, `idle_gate`: waiting for the GPU lock and for foreign GPU users to leave;
* `build`: the case's inputs, weights, kernels or checkpoint (a command case: fetch and build);
* `reference`: the correctness check of every arm and auto candidate against the reference (one
  warm call each, after the warm-up);
* `warmup`: warm-up calls (every arm's and candidate's cold first call included), calibration and
  the auto arms' choice;
* `timed`: the timed samples themselves;
* `sample_start`, `load`, `sample_other`: a model case's fresh sample processes: their start-up
  (fork or interpreter, and the imports before the load), the cold loads they measure, and the
  rest of their life (reading the request, writing the result, exit); their warm-up, timed part
  and layer check count under `warmup`, `timed` and `reference`;
* `other`: the rest of the job's process; `task_overhead`, `spool_read`: the Ray task's own.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager


class Phases:
    """Seconds per phase name, summed over every span of that name."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    def add(self, name: str, seconds: float) -> None:
        """Add `seconds` to phase `name`."""
        self.seconds[name] = self.seconds.get(name, 0.0) + max(seconds, 0.0)

    @contextmanager
    def span(self, name: str) -> Iterator[None]:
        """Time the enclosed block as phase `name`."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.add(name, time.perf_counter() - t0)

    def total(self) -> float:
        """The sum of every phase."""
        return sum(self.seconds.values())


_current = Phases()


def current() -> Phases:
    """This process's phases for the job it runs."""
    return _current


def reset() -> Phases:
    """Start a new job's phases."""
    global _current
    _current = Phases()
    return _current


def span(name: str) -> AbstractContextManager[None]:
    """`current().span(name)`."""
    return _current.span(name)
