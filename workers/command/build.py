"""A command case's build and gate on the worker host (steps 2 and 3 of `workers.command.case`).

`build_commit` checks a commit out once per (host, commit, build command) and builds it once (a
marker beside the checkout records the build time, so a later job of that commit is a cache hit);
`prune_builds` keeps a host's builds of one repository to the newest few (`keep_builds`), never
one in use or used within the day. `run_gate` runs the engine's own tests in that checkout once per
(host, commit, run) before anything is timed; a failure names the failing tests or panic.
"""

from __future__ import annotations

import fcntl
import glob
import hashlib
import json
import os
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from workers.command.case import (
    CommandCase,
    CommandCaseError,
    cache_root,
    file_lock,
    git,
    render,
    run_shell,
    safe_name,
    tail_of,
)
from workers.command.predates import explain


@dataclass(frozen=True)
class BuildResult:
    """A checkout of one commit, built: where, how long the build took, whether it was cached."""

    path: Path
    seconds: float
    cache_hit: bool


def build_commit(case: CommandCase, mirror: Path, commit: str, values: dict[str, Any]) -> BuildResult:
    """Check out `commit` and run the build command there, once per host, commit and command.

    Raises:
        CommandCaseError: the checkout or the build failed or timed out (with stderr's tail).
    """
    command = render(case.build, values, "build") if case.build else ""
    key = hashlib.sha256(command.encode()).hexdigest()[:10]
    path = mirror.parent.parent / "builds" / mirror.stem / f"{commit[:16]}-{key}"
    marker = path.with_name(path.name + ".build.json")
    with file_lock(path.with_name(path.name + ".lock")):
        if marker.exists():
            record = json.loads(marker.read_text())
            os.utime(marker)  # used now: the pruning below keeps the builds used last
            return BuildResult(path, float(record["build_seconds"]), cache_hit=True)
        if not (path / ".git").exists():
            git("clone", "--quiet", "--no-checkout", str(mirror), str(path))
        git("checkout", "--quiet", "--detach", "--force", commit, cwd=path)
        seconds = 0.0
        if command:
            outcome = run_shell(command, path, dict(os.environ), case.timeout)
            seconds = outcome.seconds
            path.with_name(path.name + ".build.log").write_text(outcome.stdout + outcome.stderr)  # stderr's tail
            if outcome.failure:
                why = explain(outcome.stderr, command, path, commit)
                raise CommandCaseError(why or f"build {outcome.failure}")
        marker.write_text(json.dumps({"commit": commit, "build": command, "build_seconds": seconds}))
    prune_builds(path.parent, keep_builds())
    return BuildResult(path, seconds, cache_hit=False)


KEEP_BUILDS = 4
RECENT_S = 24 * 3600.0


def keep_builds() -> int:
    """How many builds of one repository a host keeps (`$ORCHESTRATE_KEEP_BUILDS`, default 4)."""
    raw = os.environ.get("ORCHESTRATE_KEEP_BUILDS", "")
    return int(raw) if raw.isdigit() and int(raw) > 0 else KEEP_BUILDS


def prune_builds(builds: Path, keep: int, *, recent_s: float = RECENT_S) -> list[Path]:
    """Remove a repository's least recently used builds beyond the newest `keep`.

    An engine's build is gigabytes and a nightly sweep makes one per commit; this keeps a host's
    disk bounded. A build used within `recent_s` (this run's BASE and HEAD, say) or held by
    another job (its lock is taken) is never removed.

    Returns:
        The checkouts removed.
    """
    markers = sorted(builds.glob("*.build.json"), key=lambda m: m.stat().st_mtime, reverse=True)
    removed = []
    for marker in markers[keep:]:
        if time.time() - marker.stat().st_mtime < recent_s:
            continue
        path = marker.with_name(marker.name.removesuffix(".build.json"))
        fd = os.open(path.with_name(path.name + ".lock"), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # in use by another job
            marker.unlink()
            shutil.rmtree(path, ignore_errors=True)
            for log in builds.glob(f"{glob.escape(path.name)}.*.log"):
                log.unlink(missing_ok=True)
            removed.append(path)
        finally:
            os.close(fd)
    return removed


_FAILURE_LINE = re.compile(r"panicked at|^test .* FAILED$|^test result:|^FAILED |^E  |^error(\[|:)", re.M)


def _failure_summary(output: str) -> str:
    """The lines that say what failed (a panic and its message, FAILED tests), then the output's tail.

    A test runner's backtrace or build log can push the failure out of a plain tail.
    """
    lines = output.splitlines()
    picked: list[str] = []
    for i, line in enumerate(lines):
        if _FAILURE_LINE.search(line):
            picked.append(line.strip())
            if "panicked at" in line and i + 1 < len(lines):
                picked.append(lines[i + 1].strip())  # the panic's message
    head = "; ".join(dict.fromkeys(picked[:12]))
    tail = tail_of(output) or "no output"
    return f"{head}\n... {tail}" if head and head not in tail else tail


@dataclass(frozen=True)
class GateResult:
    """The correctness gate at one commit: how long it took, whether this run had it already, why it failed."""

    seconds: float
    cache_hit: bool
    failure: str | None  # None: passed; else the command, how it ended and its output's tail
    explained: bool = False  # the failure is one line naming the commit and what it lacks (`predates`)


def run_gate(
    case: CommandCase, build: BuildResult, values: dict[str, Any], env: dict[str, str], run_id: str | None
) -> GateResult:
    """Run the case's `gate` in the built checkout, once per host, commit and run.

    Its outcome (pass or fail) is kept for the run's later jobs on this host, which report the
    original time as a cache hit; the next run tests again. The output is kept beside the build
    (`<checkout>.gate-<key>.log`).

    Raises:
        CommandCaseError: the gate template names an unknown field.
    """
    assert case.gate is not None
    command = render(case.gate, values, "gate")
    key = hashlib.sha256(command.encode()).hexdigest()[:10]
    marker = None
    if run_id:
        run_slug = safe_name(run_id)
        marker = cache_root(case) / "gates" / run_slug / f"{build.path.name}-{key}.json"
    with file_lock(build.path.with_name(build.path.name + ".lock")):
        if marker is not None and marker.exists():
            record = json.loads(marker.read_text())
            return GateResult(float(record["seconds"]), True, record["failure"], bool(record.get("explained")))
        outcome = run_shell(command, build.path, env, case.timeout)
        output = outcome.stdout + ("\n" if outcome.stdout and outcome.stderr else "") + outcome.stderr
        build.path.with_name(f"{build.path.name}.gate-{key}.log").write_text(output)
        failure = None
        why = None
        if outcome.failure is not None:
            how = outcome.failure.split("; stderr:")[0]
            why = explain(output, command, build.path, str(values.get("commit", "")))
            failure = why or f"gate `{command}` {how}: {_failure_summary(output)}"
        if marker is not None:
            marker.parent.mkdir(parents=True, exist_ok=True)
            record = {"command": command, "seconds": outcome.seconds, "failure": failure, "explained": why is not None}
            marker.write_text(json.dumps(record))
        return GateResult(outcome.seconds, False, failure, why is not None)
