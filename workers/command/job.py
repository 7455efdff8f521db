"""The job of a command case: every arm at every commit, interleaved, under the host's GPU lock.

`workers.job.runner` calls `run_command_job` with the host's GPU lock held, so the builds, the gate
and every timed run of the job are one lock window. With `refs = [BASE, HEAD]` (or `orchestrate
run --ref BASE --ref HEAD`) the job resolves and builds both commits, gates both, then runs the
(arm, commit) pairs interleaved ABBA for warm-up + repetitions rounds: drift in the machine hits
both commits alike. Rows carry their commit (`commit`), the ref as given (`extra['ref']`) and,
in a comparison, the ref's position (`extra['ref_index']`, 0 = BASE, of `extra['refs']`).

Host paths among the parameters (`checkpoint`) are the worker host's: `~` is expanded there, and
a checkpoint the host does not have makes the job `unsupported` (as a `model` case's does) before
anything is built. A relative checkpoint starts in the build checkout.

The shell guard nests inside the job: `ROCM_GPU_GUARD_LOCK_HELD` (exported by the lock) stays in
the commands' environment only when the lock the job holds is the guard's own lock file
(`$ROCM_GPU_GUARD_LOCK`, default `/tmp/mlxcel-rocm-gpu-guard.lock`). Holding another file, the
variable would make `rocm_gpu_guard.sh` skip a lock nobody holds, so it is removed and the guard
takes its own lock (a different file: no deadlock).
"""

from __future__ import annotations

import hashlib
import os
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from workers.command.build import BuildResult, build_commit, run_gate
from workers.command.case import CommandCase, CommandCaseError, render, resolve_commit, run_shell, with_stderr
from workers.command.parsers import OutputParseError, OutputSkipped, ParsedOutput, parser_for
from workers.command.predates import explain
from workers.contract import JobContext, JobSpec, RowBuilder, Status
from workers.job import phases
from workers.lock.gpu import GUARD_ENV

GUARD_LOCK_ENV = "ROCM_GPU_GUARD_LOCK"
GUARD_DEFAULT_LOCK = "/tmp/mlxcel-rocm-gpu-guard.lock"
HOST_PATH_PARAMS = ("checkpoint",)


@dataclass
class Side:
    """One commit of the job, built."""

    index: int
    ref: str
    commit: str
    build: BuildResult
    extra: dict[str, str] = field(default_factory=dict)


def _same_file(a: str, b: str) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return os.path.realpath(a) == os.path.realpath(b)


def command_env(job: JobSpec) -> dict[str, str]:
    """The environment every command of the job starts from (arm overrides go on top).

    The GPU lock's nesting variable is kept only where the lock held is the shell guard's.
    """
    env = dict(os.environ)
    guard_lock = env.get(GUARD_LOCK_ENV) or GUARD_DEFAULT_LOCK
    ours = env.get(GUARD_ENV) == str(os.getpid())
    if job.lock.enabled and ours and not _same_file(job.lock.path, guard_lock):
        env.pop(GUARD_ENV, None)
    return env


def host_params(params: dict[str, Any]) -> dict[str, Any]:
    """The job's parameters with the host paths among them expanded (`~` is this host's)."""
    out = dict(params)
    for key in HOST_PATH_PARAMS:
        if isinstance(out.get(key), str):
            out[key] = os.path.expanduser(out[key])
    return out


def missing_checkpoint(params: dict[str, Any], checkouts: list[Path]) -> str | None:
    """Why the job's checkpoint cannot be used on this host, or None (no checkpoint, or it exists)."""
    raw = params.get("checkpoint")
    if not isinstance(raw, str) or not raw:
        return None
    path = Path(raw)
    places = [path] if path.is_absolute() else [c / path for c in checkouts]
    if not places or all(p.exists() for p in places):
        return None
    where = "" if path.is_absolute() else " (a relative path starts in the build checkout; give an absolute one)"
    return f"checkpoint {raw!r} not found on this host{where}"


def _unit_order(units: list[tuple[int, str]], rounds: int) -> Iterator[tuple[int, tuple[int, str]]]:
    """ABBA: even rounds in order, odd rounds reversed."""
    for r in range(rounds):
        for unit in units if r % 2 == 0 else list(reversed(units)):
            yield r, unit


class _Job:
    """The rows of one command job as its steps add them."""

    def __init__(self, job: JobSpec, rows: RowBuilder) -> None:
        self.job = job
        self.rows = rows

    def fail(self, error: str, metric: str, sides: list[Side] | None = None, status: Status = Status.FAILED) -> Status:
        """One row per arm (per side, where there are sides) with the error; returns the status."""
        targets: list[Side | None] = list(sides) if sides else [None]
        for side in targets:
            for arm in self.job.arms:
                extra = side.extra if side else {}
                commit = side.commit if side else None
                self.rows.add(arm, metric, None, "seconds", status=status, error=error, extra=extra, commit=commit)
        return status


def _resolve_sides(case: CommandCase, job: JobSpec, values: dict[str, Any]) -> list[Side]:
    sides = []
    for index, ref in enumerate(case.refs):
        mirror, commit = resolve_commit(case.for_ref(ref), job.run_id)
        build = build_commit(case, mirror, commit, {**values, "commit": commit})
        extra = {"repo": case.repo, "ref": ref, "build_cache": "hit" if build.cache_hit else "miss"}
        if len(case.refs) > 1:
            extra |= {"ref_index": str(index), "refs": str(len(case.refs))}
        sides.append(Side(index, ref, commit, build, extra))
    return sides


def run_command_job(job: JobSpec, rows: RowBuilder, context: JobContext) -> Status:
    """Build the case's repo at each ref, gate it, and run its command per arm and commit.

    Args:
        job: the job; `options` holds repo/ref(s)/build/gate/run/parse/timeout, `arm_env` the env per arm.
        rows: where the rows go.
        context: the job's context; its `commit` is set to the (last) resolved commit.

    Returns:
        "ok" when every arm ran and parsed at every commit; "unsupported" when the host lacks the
        checkpoint or the benchmark skipped every point; else "failed".
    """
    out = _Job(job, rows)
    base: dict[str, Any] = {"backend": job.backend, "device": job.device, "host": job.host}
    params = host_params(job.params)
    try:
        case = CommandCase.from_options(job.options)
        parse = parser_for(case.parse)
    except (CommandCaseError, ValueError) as exc:
        return out.fail(str(exc), "build_seconds")
    missing = missing_checkpoint(params, [])
    if missing:
        return out.fail(missing, "build_seconds", status=Status.UNSUPPORTED)
    try:
        with phases.span("build"):
            sides = _resolve_sides(case, job, base)
    except CommandCaseError as exc:
        return out.fail(str(exc), "build_seconds")
    context.commit = sides[-1].commit
    missing = missing_checkpoint(params, [s.build.path for s in sides])
    if missing:
        return out.fail(missing, "build_seconds", sides, status=Status.UNSUPPORTED)
    for side in sides:
        for arm in job.arms:
            rows.add(arm, "build_seconds", side.build.seconds, "seconds", extra=side.extra, commit=side.commit)
    env = command_env(job)
    if case.gate:
        for side in sides:
            try:
                with phases.span("reference"):  # the gate is a command case's correctness check
                    gate = run_gate(case, side.build, {**base, "commit": side.commit}, env, job.run_id)
            except CommandCaseError as exc:
                return out.fail(str(exc), "gate_seconds", sides)
            extra = side.extra | {"gate_cache": "hit" if gate.cache_hit else "miss"}
            if gate.failure is not None:  # nothing is timed on a commit whose own tests fail
                for arm in job.arms:
                    rows.add(
                        arm,
                        "gate_seconds",
                        gate.seconds,
                        "seconds",
                        status=Status.FAILED,
                        error=gate.failure if gate.explained else f"{gate.failure} (at {side.ref} {side.commit[:12]})",
                        extra=extra,
                        commit=side.commit,
                    )
                return Status.FAILED
            for arm in job.arms:
                rows.add(arm, "gate_seconds", gate.seconds, "seconds", extra=extra, commit=side.commit)
    return _measure(job, case, parse, sides, {**params, **base}, env, rows)


def _measure(
    job: JobSpec,
    case: CommandCase,
    parse: Callable[[str], ParsedOutput],
    sides: list[Side],
    values: dict[str, Any],
    env: dict[str, str],
    rows: RowBuilder,
) -> Status:
    """The timed rounds: (arm, commit) pairs interleaved ABBA; one row per parsed value."""
    units = [(side.index, arm) for arm in job.arms for side in sides]
    failed: set[tuple[int, str]] = set()
    skipped: set[tuple[int, str]] = set()
    samples: Counter[tuple[int, str, str]] = Counter()
    for round_, (index, arm) in _unit_order(units, job.warmup + job.repetitions):
        if (index, arm) in failed | skipped:
            continue
        side = sides[index]
        warming_up = round_ < job.warmup
        phase = "warm-up" if warming_up else "run"
        try:
            command = render(case.run, {**values, "arm": arm, "commit": side.commit}, "run")
        except CommandCaseError as exc:
            rows.add(
                arm,
                "wall_seconds",
                None,
                "seconds",
                status=Status.FAILED,
                error=str(exc),
                extra=side.extra,
                commit=side.commit,
            )
            failed.add((index, arm))
            continue
        with phases.span("warmup" if warming_up else "timed"):
            outcome = run_shell(command, side.build.path, {**env, **job.arm_env.get(arm, {})}, case.timeout)
        error = outcome.failure
        if error is not None:
            error = explain(outcome.stderr, command, side.build.path, side.commit) or error
        parsed: ParsedOutput | None = None
        if error is None:
            try:
                parsed = parse(outcome.stdout)
            except OutputSkipped as exc:
                rows.add(
                    arm,
                    "wall_seconds",
                    outcome.seconds,
                    "seconds",
                    status=Status.UNSUPPORTED,
                    error=f"{phase} {round_}: {exc}",
                    extra=side.extra,
                    commit=side.commit,
                )
                skipped.add((index, arm))
                continue
            except OutputParseError as exc:
                error = with_stderr(f"output did not parse ({exc})", outcome.stderr)
        if error is not None or parsed is None:
            rows.add(
                arm,
                "wall_seconds",
                outcome.seconds,
                "seconds",
                status=Status.FAILED,
                error=f"{phase} {round_}: {error}",
                extra=side.extra,
                commit=side.commit,
            )
            failed.add((index, arm))
            continue
        if warming_up:
            continue
        extra = parsed.extra | side.extra  # the job's own facts win a name both use
        if parsed.text is not None:
            extra["output_sha256"] = hashlib.sha256(parsed.text.encode()).hexdigest()
            extra["output_chars"] = str(len(parsed.text))
        route = f"command@{side.commit[:12]}"
        for metric, value, unit in [("wall_seconds", outcome.seconds, "seconds")] + [
            (m.metric, m.value, m.unit) for m in parsed.measurements
        ]:
            key = (index, arm, metric)
            rows.add(arm, metric, value, unit, sample=samples[key], route=route, extra=extra, commit=side.commit)
            samples[key] += 1
    if failed:
        return Status.FAILED
    return Status.UNSUPPORTED if skipped == set(units) else Status.OK
