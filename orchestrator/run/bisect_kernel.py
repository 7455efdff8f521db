"""A kernel case bisected over this project's commits: its command-case twin.

The code under test is this repository, so `--good` and `--bad` are its commits. The twin is a
command case whose repo is this project: each host checks every tested commit out once (a worktree
per commit, cached as any command case's builds), and each sample runs that commit's own worker on
the kernel job (`PYTHONPATH=<checkout> python -m workers run JOB --out FILE`), its kernels, timing
and checks, with the GPU lock left to the outer job that holds it. The `workers-rows` parser turns
the job's rows into one sample per metric (the median of its timed rounds), so the commits are
interleaved ABBA in one lock window as an engine's are. A commit whose worker cannot read today's
job (its job format differs) or whose kernels fail their check is skipped like one that does not
build.
"""

from __future__ import annotations

import shlex
import sys
from dataclasses import replace
from pathlib import Path

from orchestrator.errors import InputError
from orchestrator.run.bisect_target import Target
from orchestrator.run.code_version import code_version
from orchestrator.run.plan import expand
from orchestrator.specs.case import CaseEntry
from orchestrator.specs.sweep import InventorySpec, SweepSpec
from workers.command.case import CommandCaseError, git

JOB_FILE = "orchestrate-job.json"
ROWS_FILE = "orchestrate-rows.parquet"
TIMEOUT = 600.0


def project_repo() -> str:
    """This project's git checkout (the repository its kernel cases measure).

    Raises:
        InputError: this orchestrate does not run from a git checkout.
    """
    here = Path(__file__).resolve().parents[2]
    try:
        return git("rev-parse", "--show-toplevel", cwd=here)
    except CommandCaseError:
        raise InputError(f"bisecting a kernel case needs this project as a git checkout ({here} is not one)") from None


def _python(inventory: InventorySpec, kind: str) -> str:
    """The Python a host of `kind` runs workers with (this one's on the embedded instance)."""
    if inventory.embedded:
        return sys.executable
    return next(h.python for h in inventory.hosts if h.device == kind)


def kernel_target(sweep: SweepSpec, target: Target, inventory: InventorySpec, repo: str | None = None) -> Target:
    """The target with its kernel case replaced by the command-case twin (module docstring)."""
    case = target.case
    arms = {target.arm: case.arms[target.arm]} if isinstance(case.arms, dict) else [target.arm]
    # one job of the kernel case at the point, planned as `run` plans it, its sampling fixed: one
    # process is one sample, so a precision target would only make each sample longer
    one = case.model_copy(update={"params": dict(target.point), "arms": arms, "devices": None, "precision": None,
                                  "max_seconds": None})  # fmt: skip
    spec = sweep.model_copy(update={"cases": [one], "devices": [target.device], "precision": None, "criteria": []})
    job = expand(spec, inventory, [target.device], run_id="bisect", version=code_version())[0]
    job = job.model_copy(update={"lock": job.lock.model_copy(update={"enabled": False}), "spool_dir": None})
    python = shlex.quote(_python(inventory, target.device))
    run = (
        f"printf '%s' {shlex.quote(job.model_dump_json())} > {JOB_FILE} && "
        f'PYTHONPATH="$PWD" {python} -m workers run {JOB_FILE} --out "$PWD/{ROWS_FILE}"'
    )
    twin = CaseEntry(
        case="command",
        name=case.label,
        arms=[target.arm],
        params=dict(target.point),
        repo=repo or project_repo(),
        run=run.replace("{", "{{").replace("}", "}}"),  # the job's JSON braces are not template fields
        parse="workers-rows",
        timeout=TIMEOUT,
        warmup=0,  # the job warms its kernels up itself
    )
    return replace(target, case=twin)
