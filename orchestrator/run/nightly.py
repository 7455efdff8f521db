"""A nightly run: `orchestrate schedule run-now NAME`, what a schedule's timer or crontab line starts.

The schedule (`orchestrator.run.schedules`) names the sweep, the inventory and the results root.
A run

1. takes `locks/NAME.lock` with a non-blocking `flock(2)`: a second start while one runs exits at
   once (exit 75) and says which pid holds it since when;
2. runs the sweep with `force` (the ref of a command case is resolved afresh; resume must not
   skip a job whose key has not changed while the repo's branch moved);
3. judges the run against the history of the same host fingerprint (`orchestrator.analysis.history`:
   each arm's series and its ratio to the sweep's baseline arm),
   writes `reports/NAME/RUN.md` and exits 1 when something regressed or a job failed, 4 when a
   series was measured only under contention (foreign GPU users: not judged), else 0;
4. compacts the sweep's partitions dated `compact_after` (2) or more days ago (`orchestrator.store.compact`;
   `schedule add --no-compact` leaves them), whatever the exit code.
"""

from __future__ import annotations

import datetime as dt
import fcntl
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from orchestrator.analysis.history import (
    Finding,
    findings_for_run,
    regressions,
    report_markdown,
    unjudged,
)
from orchestrator.errors import (
    EXIT_AMBIGUOUS,
    EXIT_CRITERION_FAILED,
    EXIT_LOCK_TIMEOUT,
    EXIT_OK,
    OrchestratorError,
)
from orchestrator.run.schedules import check_name, config_dir, load_schedule
from orchestrator.run.sweep import run_sweep
from orchestrator.specs.sweep import load_inventory, load_sweep
from orchestrator.store.compact import compact_after_run
from orchestrator.store.dataset import read_rows
from orchestrator.store.fragments import ResultStore
from workers.contract import Status


class ScheduleBusyError(OrchestratorError):
    """The schedule's previous run still holds its overlap lock. Exit 75."""

    exit_code = EXIT_LOCK_TIMEOUT


@contextmanager
def overlap_guard(name: str) -> Iterator[None]:
    """Hold `locks/NAME.lock` (non-blocking flock) for one run; a second start raises at once."""
    path = config_dir() / "locks" / f"{check_name(name)}.lock"
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "another process"
            raise ScheduleBusyError(f"schedule {name!r} is already running ({holder}); this start exits") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} since {dt.datetime.now(dt.UTC):%Y-%m-%d %H:%M:%S} UTC\n".encode(), 0)
        yield
    finally:
        os.close(fd)


@dataclass
class NightlyResult:
    """What a scheduled run did and found."""

    run_id: str
    findings: list[Finding]
    failed_jobs: list[str] = field(default_factory=list)
    contended: list[str] = field(default_factory=list)  # series measured only under contention
    report: Path | None = None
    compacted: str = ""  # what the compaction after the run did ('' when nothing, or not asked for)

    @property
    def regressions(self) -> list[Finding]:
        return regressions(self.findings)

    @property
    def exit_code(self) -> int:
        """1: a series regressed or a job failed; 4: a series was only measured contended; else 0."""
        if self.regressions or self.failed_jobs:
            return EXIT_CRITERION_FAILED
        return EXIT_AMBIGUOUS if self.contended else EXIT_OK


def run_now(name: str, *, progress: Any = None) -> NightlyResult:
    """Run a schedule's sweep now (forced, refs resolved afresh) and judge it against the history.

    Raises:
        ScheduleBusyError: the schedule's previous run is still going.
    """
    sched = load_schedule(name)
    if sched.workdir and Path(sched.workdir).is_dir():
        os.chdir(sched.workdir)  # a run from cron or a timer starts in $HOME; relative repo paths start here
    with overlap_guard(name):
        spec = load_sweep(sched.sweep)
        inventory = load_inventory(sched.inventory)
        store = ResultStore(sched.results)
        summary = run_sweep(spec, inventory, store, sweep_where=sched.sweep, force=True, progress=progress)
        table = read_rows(store, sweep=spec.name)
        findings = findings_for_run(
            table, summary.run_id, window=sched.window, threshold=sched.threshold, reference=spec.baseline
        )
        failed = [
            f"{o.job.device} {o.job.case_name} {o.job.params}: {o.error}"
            for o in summary.outcomes
            if o.status != Status.OK
        ]
        result = NightlyResult(summary.run_id, findings, failed, unjudged(table, summary.run_id))
        text = report_markdown(spec.name, summary.run_id, findings)
        if failed:
            text += "\n## Failed jobs\n\n" + "".join(f"- {line}\n" for line in failed)
        if result.contended:
            text += "\n## Not judged: measured only under contention (run again when the host is quiet)\n\n"
            text += "".join(f"- {line}\n" for line in result.contended)
        path = config_dir() / "reports" / name / f"{summary.run_id}.md"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        result.report = path
        if sched.compact_after is not None:  # the night's rows are stored and judged: old dates merged
            result.compacted = compact_after_run(store, spec.name, after_days=sched.compact_after)
        return result
