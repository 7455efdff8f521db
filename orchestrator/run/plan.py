"""Sweep expansion: a sweep and an inventory become jobs keyed by a hash of their content.

A job is one case at one point of its parameter axes, with all its arms, on one device kind.
Its key hashes everything that changes what it measures (sweep, case, parameters, arms and their
environment, case options, repetitions, warm-up, code version, device kind), so a stored job
with the same key is the same measurement and resume may skip it. A command case's refs are
resolved to commits here, when the head can reach the repo, and the commits are one of its
options: a branch that moved makes new keys, so the next run measures the new commit.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import secrets
from pathlib import Path
from typing import Any

from kernels import registry
from orchestrator.analysis.compare import default_baseline
from orchestrator.errors import InputError
from orchestrator.specs.case import CaseEntry, check_size
from orchestrator.specs.checks import job_count
from orchestrator.specs.sweep import HostSpec, InventorySpec, SweepSpec
from workers.command.case import CommandCaseError, plan_commits
from workers.contract import JobSpec, LockSettings

OPTION_FIELDS = ("repo", "ref", "refs", "build", "gate", "run", "parse", "timeout")


def new_run_id(now: dt.datetime | None = None) -> str:
    """A sortable, unique run id such as `20261130T104512Z-3fa9`."""
    now = now or dt.datetime.now(dt.UTC)
    return f"{now.strftime('%Y%m%dT%H%M%SZ')}-{secrets.token_hex(2)}"


def source_digest() -> str:
    """A hash of the code that decides what a job measures: `workers/` and `kernels/`.

    Job keys use this rather than the git commit, so that a change to the README or to the head's
    reporting does not invalidate stored measurements, while any change to a kernel or to the
    measurement loop does.
    """
    root = Path(__file__).resolve().parents[2]
    digest = hashlib.sha256()
    for package in ("workers", "kernels"):
        for path in sorted((root / package).rglob("*")):
            if path.suffix in (".py", ".cu", ".cuh", ".metal") and "__pycache__" not in path.parts:
                digest.update(str(path.relative_to(root)).encode())
                digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def points(case: CaseEntry) -> list[dict[str, Any]]:
    """The cartesian product of a case's parameter axes, in file order."""
    return list(case.points())


def job_key(content: dict[str, Any]) -> str:
    """A stable hash of a job's content."""
    blob = json.dumps(content, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def with_refs(sweep: SweepSpec, refs: list[str]) -> SweepSpec:
    """The sweep with every command case at `refs` (`orchestrate run --ref BASE --ref HEAD`).

    One ref replaces the cases' `ref`; several make each job a commit comparison: every commit
    built and gated, arms and commits interleaved in one lock window, BASE (the first) against
    HEAD (the last).

    Raises:
        InputError: no command case in the sweep, an empty or repeated ref.
    """
    if not refs:
        return sweep
    if any(not r.strip() for r in refs) or len(set(refs)) != len(refs):
        raise InputError(f"--ref {' --ref '.join(refs)}: give distinct, non-empty git refs, BASE first")
    if not any(c.case == "command" for c in sweep.cases):
        raise InputError(f"--ref: sweep {sweep.name!r} has no command case (only those build a repository at a ref)")
    cases = [
        c.model_copy(update={"ref": refs[0], "refs": None} if len(refs) == 1 else {"ref": None, "refs": list(refs)})
        if c.case == "command"
        else c
        for c in sweep.cases
    ]
    return sweep.model_copy(update={"cases": cases})


def lock_settings(host: HostSpec) -> LockSettings:
    """How jobs take the GPU lock on `host` (its inventory entry)."""
    return LockSettings(
        path=host.lock,
        max_wait=host.max_wait,
        idle_secs=host.idle_secs,
        max_attempts=host.max_attempts,
        cpu_busy_threshold=host.cpu_busy_threshold,
        ignore_processes=list(host.ignore_processes),
        kfd_proc=host.kfd_proc,
    )


def _lock_for(inventory: InventorySpec, kind: str) -> LockSettings:
    """The first host of a kind's settings; each node applies its own (`workers.job.task.localise`)."""
    return lock_settings(next(h for h in inventory.hosts if h.device == kind))


def _pin_refs(case: CaseEntry, options: dict[str, Any]) -> dict[str, Any]:
    """A command case's options with `commits`: each ref as the repo has it now (when reachable)."""
    try:
        commits = plan_commits(options)
    except CommandCaseError as exc:
        raise InputError(f"field cases.{case.label}.ref: {exc}") from None
    return {**options, "commits": commits} if commits else options


def _sampling(case: CaseEntry, sweep: SweepSpec) -> dict[str, Any]:
    """A case's precision target (`workers.contract.precision.Target`): its own, else the sweep's,
    with the arm every other arm's interval is judged against (the one `compare` takes)."""
    precision = case.precision or sweep.precision
    if precision is None:
        return {}
    out: dict[str, Any] = {"precision": precision, "baseline": default_baseline(case.arm_names(), sweep.baseline)}
    max_seconds = case.max_seconds or sweep.max_seconds
    if max_seconds is not None:
        out["max_seconds"] = max_seconds
    return out


def expand(
    sweep: SweepSpec,
    inventory: InventorySpec,
    kinds: list[str],
    *,
    run_id: str,
    version: str,
    spool_dir: str | None = None,
    digest: str | None = None,
) -> list[JobSpec]:
    """Every job of the sweep on every device kind it runs on.

    `version` (the commit) is recorded in every row; `digest` (default: `source_digest()`) is what
    the job key depends on.
    """
    try:  # counted before expanding: 10^9 jobs would be a MemoryError, not a message
        check_size(job_count(sweep, kinds), f"sweep {sweep.name!r} on {', '.join(kinds)}")
    except ValueError as exc:
        raise InputError(str(exc)) from None
    digest = digest or source_digest()
    # The embedded inventory's one host is this machine: its rows carry its name. (On a cluster,
    # each node's worker sets its own host, `workers.job.task.localise`.)
    host = inventory.hosts[0].name if inventory.embedded else JobSpec.model_fields["host"].default
    jobs: list[JobSpec] = []
    for case in sweep.cases:
        case_kinds = case.devices or kinds
        options = {f: getattr(case, f) for f in OPTION_FIELDS if getattr(case, f) is not None}
        if case.repo is not None:
            options = _pin_refs(case, options)
        kind_of_case = registry.CASES[case.case].kind
        if kind_of_case == registry.CaseKind.KERNEL:  # the cache state is part of what a job measures
            options["cache"] = case.cache or sweep.cache
            if case.arm_paths():
                options["arm_paths"] = case.arm_paths()
        if kind_of_case != registry.CaseKind.COMMAND:
            options.update(_sampling(case, sweep))
        reps = case.repetitions or sweep.repetitions
        warmup = case.warmup if case.warmup is not None else sweep.warmup
        for kind in case_kinds:
            backend = next(h.backend for h in inventory.hosts if h.device == kind)
            for params in points(case):
                content = {
                    "sweep": sweep.name,
                    "case": case.case,
                    "case_name": case.label,
                    "params": params,
                    "arms": case.arm_names(),
                    "arm_env": case.arm_env(),
                    "options": options,
                    "repetitions": reps,
                    "warmup": warmup,
                    "code": digest,
                    "device": kind,
                }
                key = job_key(content)
                jobs.append(
                    JobSpec(
                        run_id=run_id,
                        sweep=sweep.name,
                        job_key=key,
                        case=case.case,
                        case_name=case.label,
                        params=params,
                        arms=case.arm_names(),
                        arm_env=case.arm_env(),
                        options=options,
                        device=kind,
                        backend=backend,
                        repetitions=reps,
                        warmup=warmup,
                        # fresh inputs each run, reproducible from the recorded run id and key
                        seed=(sweep.seed * 1_000_003 + int(key[:8], 16) + int(run_id.encode().hex()[-8:], 16)) % 2**32,
                        code_version=version,
                        lock=_lock_for(inventory, kind),
                        host=host,
                        spool_dir=spool_dir,
                    )
                )
    return jobs
