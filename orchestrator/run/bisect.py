"""`bisect`: the first commit of a regression, measured on the device kind that regressed.

Each step is one job through `run_sweep` (the inventory, Ray, the host's lock, builds cached per
host and commit): the tested commit and GOOD built, gated and measured interleaved in one lock
window (`--ref GOOD --ref COMMIT`), at least `MIN_BLOCKS` ABBA blocks. The first step measures BAD:
no change past the band means nothing to bisect; otherwise its direction and size set each later
step's band (`orchestrator.analysis.bisection`). An undecided step takes another job at the same
pair, pooled, while its interval is wider than the step's precision, the budget lasts and
`MAX_JOBS` allow; a commit still undecided ends the bisection with the range it narrowed to. A
commit whose build, gate or run fails is skipped (as `git bisect skip`), and the next is the
untested commit nearest the middle.

Every step's rows are stored under one sweep name, `<sweep>.bisect-<id>`, so `compare --sweep
<that> --by commit --all-runs` shows every tested commit against GOOD and `query` selects them. A
small JSON state file in the results' side directory (written atomically) holds the bisection's
definition, its commits and each settled verdict; the samples are read back from the stored rows,
so an interrupted bisection, run again with the same arguments, resumes where it stopped.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from orchestrator.analysis.bisection import Change, Evidence, StepVerdict, enough, evidence, judge_range, judge_step
from orchestrator.analysis.stats import THRESHOLD, Verdict
from orchestrator.errors import InputError
from orchestrator.run.bisect_target import CommitRange, Target
from orchestrator.run.plan import new_run_id
from orchestrator.run.sweep import Progress, run_sweep
from orchestrator.specs.sweep import InventorySpec, SweepSpec
from orchestrator.store.dataset import read_rows
from orchestrator.store.fragments import ResultStore
from workers.contract import Status
from workers.contract.precision import MIN_BLOCKS, ROUNDS_PER_BLOCK

STATE_DIR = "bisect"
STATE_VERSION = 1
# Jobs (lock windows) one commit may take before it is left undecided: each is at least
# MIN_BLOCKS blocks, so the last one's interval rests on 4x the first one's samples (half its width).
MAX_JOBS = 4


@dataclass
class Step:
    """One tested commit: its evidence against GOOD and its verdict (skipped: why)."""

    commit: str
    verdict: StepVerdict
    evidence: Evidence
    note: str = ""


@dataclass
class BisectResult:
    """How a bisection ended.

    Attributes:
        outcome: `found` (first bad commit), `range` (skipped or undecided commits leave several),
            `no-regression` (BAD within the band of GOOD), `unclear` (BAD could not be told apart).
        first_bad: the first bad commit (`found`), else the newest candidate.
        candidates: the commits the first bad one is among (one when found), oldest first.
        steps: every tested commit, in the order tested.
        reason: why it stopped short of one commit (empty when found or no regression).
    """

    name: str
    good: str
    bad: str
    target: Target
    outcome: str
    first_bad: str | None
    candidates: list[str]
    steps: list[Step]
    lines: dict[str, str]
    reason: str = ""
    change: float = math.nan  # BAD / GOOD
    wall_seconds: float = 0.0
    interrupted: int | None = None

    @property
    def measured(self) -> int:
        """Commits measured (skipped ones are not)."""
        return sum(1 for s in self.steps if s.verdict is not StepVerdict.SKIPPED)


@dataclass
class Bisection:
    """The inputs of a bisection, resolved."""

    sweep: SweepSpec
    target: Target
    span: CommitRange
    inventory: InventorySpec
    store: ResultStore
    threshold: float = THRESHOLD
    budget: float | None = None
    progress: Progress | None = None
    say: Callable[[str], None] = lambda _: None
    state: dict[str, Any] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return str(self.state["name"])

    def key(self) -> str:
        """What makes two bisections the same one (their state file)."""
        t = self.target
        content = [self.sweep.name, t.case.label, t.point_text(), t.arm, t.metric, t.device, self.span.good,
                   self.span.bad, self.threshold]  # fmt: skip
        return hashlib.sha256(json.dumps(content, default=str).encode()).hexdigest()[:16]

    def state_path(self) -> Path:
        return self.store.side / STATE_DIR / f"{self.key()}.json"

    def load(self, fresh: bool) -> None:
        """The state of this bisection as stored (none, or `fresh`: a new one under a new name)."""
        path = self.state_path()
        if path.exists() and not fresh:
            self.state = json.loads(path.read_text())
            if self.state.get("version") == STATE_VERSION:
                self.say(f"resuming bisection {self.name}: {len(self.state['verdicts'])} commits settled")
                return
        stamp = new_run_id()
        self.state = {"version": STATE_VERSION, "name": f"{self.sweep.name}.bisect-{stamp}", "verdicts": {},
                      "good": self.span.good, "commits": self.span.commits}  # fmt: skip
        self.save()

    def save(self) -> None:
        """Write the state atomically (a whole file, renamed into place)."""
        path = self.state_path()
        path.parent.mkdir(parents=True, exist_ok=True)
        staged = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        staged.write_text(json.dumps(self.state, indent=1, sort_keys=True))
        os.replace(staged, path)

    def step_sweep(self, commit: str, repetitions: int) -> SweepSpec:
        """One job: the target's point and arm, GOOD against `commit` in one lock window."""
        t = self.target
        arms: list[str] | dict[str, Any] = {t.arm: t.case.arms[t.arm]} if isinstance(t.case.arms, dict) else [t.arm]
        case = t.case.model_copy(
            update={"params": dict(t.point), "arms": arms, "devices": None, "ref": None,
                    "refs": [self.span.good[:12], commit[:12]], "repetitions": repetitions, "name": t.case.label}
        )  # fmt: skip
        return SweepSpec(
            name=self.name,
            description=f"bisect {t.metric} of {t.case.label} {t.arm} {t.point_text()} on {t.device}",
            devices=[t.device],
            repetitions=repetitions,
            warmup=t.case.warmup if t.case.warmup is not None else self.sweep.warmup,
            seed=self.sweep.seed,
            cases=[case],
        )


class Stopped(Exception):
    """The bisection was interrupted by a signal; its state and rows are stored."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def _repetitions(b: Bisection) -> int:
    """Rounds per job: the case's, at least `MIN_BLOCKS` whole blocks (what a verdict needs)."""
    own = b.target.case.repetitions or b.sweep.repetitions
    return max(own + own % ROUNDS_PER_BLOCK, MIN_BLOCKS * ROUNDS_PER_BLOCK)


def _measure_once(b: Bisection, commit: str) -> str | None:
    """Run one job of GOOD against `commit`; why it failed, or None."""
    sweep = b.step_sweep(commit, _repetitions(b))
    summary = run_sweep(sweep, b.inventory, b.store, sweep_where=f"bisect of {b.sweep.name}", force=True,
                        progress=b.progress)  # fmt: skip
    if summary.interrupted:
        raise Stopped(summary.interrupted)
    failed = [o for o in summary.outcomes if o.status not in (Status.OK, Status.CONTENDED)]
    return (failed[0].error or str(failed[0].status)) if failed else None


def _rows_evidence(b: Bisection, commit: str) -> Evidence:
    rows = read_rows(b.store, sweep=b.name, metrics=[b.target.metric])
    return evidence(rows, b.target.metric, b.target.arm, b.span.good, commit)


def _settle(b: Bisection, commit: str, decide: Callable[[Evidence], StepVerdict], precision: float, t0: float) -> Step:
    """Measure `commit` until its verdict is decided, or its sampling may go no further."""
    settled = b.state["verdicts"].get(commit)
    if settled is not None:
        return Step(commit, StepVerdict(settled["verdict"]), _rows_evidence(b, commit), settled.get("note", ""))
    ev = _rows_evidence(b, commit)  # jobs of an interrupted bisection count
    note = ""
    tries = 0  # this call's jobs: a contended one adds no clean samples, and still counts
    while True:
        verdict = decide(ev) if ev.jobs else StepVerdict.UNDECIDED
        if verdict is not StepVerdict.UNDECIDED:
            break
        if max(ev.jobs, tries) >= MAX_JOBS:
            note = f"still undecided after {ev.jobs} jobs ({ev.samples} samples per side)"
            break
        if ev.blocks >= MIN_BLOCKS and ev.half_width <= precision:
            note = f"its interval is within ±{precision:.1%} and still reaches across the band's edge"
            break
        if b.budget is not None and time.perf_counter() - t0 >= b.budget:
            note = "the --budget is spent"
            break
        b.say(f"measuring {commit[:12]} against GOOD {b.span.good[:12]} (job {ev.jobs + 1})")
        failure = _measure_once(b, commit)
        tries += 1
        if failure is not None:
            if not ev.jobs and not b.state["verdicts"]:
                why = first_line(failure, 300)
                raise InputError(f"bisect: the first step, GOOD against BAD {commit[:12]}, failed: {why}")
            verdict, note = StepVerdict.SKIPPED, first_line(failure)
            break
        ev = _rows_evidence(b, commit)
    step = Step(commit, verdict, ev, note)
    if verdict is not StepVerdict.UNDECIDED:
        b.state["verdicts"][commit] = {"verdict": str(verdict), "note": note}
        b.save()
    return step


def first_line(error: str, width: int = 100) -> str:
    """An error's first line, cut to `width` (the stored rows keep all of it)."""
    line = error.strip().splitlines()[0] if error.strip() else error
    return line if len(line) <= width else line[: width - 3] + "..."


def _next(commits: list[str], lo: int, hi: int, tried: set[str]) -> int | None:
    """The untried commit between `lo` and `hi` (exclusive) nearest the middle, or None."""
    middle = (lo + hi) / 2
    left = [i for i in range(lo + 1, hi) if commits[i] not in tried]
    return min(left, key=lambda i: (abs(i - middle), i)) if left else None


def run_bisect(b: Bisection, *, fresh: bool = False) -> BisectResult:
    """Bisect `b.span` for the first commit past the band of GOOD (module docstring)."""
    t0 = time.perf_counter()
    b.load(fresh)
    commits = b.span.commits
    result = BisectResult(b.name, b.span.good, b.span.bad, b.target, "unclear", None, [], [], b.span.lines)
    try:
        _bisect(b, commits, result, t0)
    except Stopped as stop:
        result.interrupted = stop.signum
    except KeyboardInterrupt:  # between two jobs: what settled is stored, as when a job is stopped
        result.interrupted = signal.SIGINT
    result.wall_seconds = time.perf_counter() - t0
    return result


def _bisect(b: Bisection, commits: list[str], result: BisectResult, t0: float) -> None:
    range_verdict: dict[str, Verdict] = {}

    def first(ev: Evidence) -> StepVerdict:
        range_verdict["v"] = judge_range(ev, b.threshold)
        return {Verdict.SAME: StepVerdict.GOOD, Verdict.AMBIGUOUS: StepVerdict.UNDECIDED}.get(
            range_verdict["v"], StepVerdict.BAD
        )

    top = _settle(b, b.span.bad, first, enough(math.log1p(b.threshold)), t0)
    result.steps.append(top)
    result.change = top.evidence.ratio
    if top.verdict is StepVerdict.GOOD:
        result.outcome, result.candidates = "no-regression", []
        return
    if top.verdict is not StepVerdict.BAD:
        result.reason = f"BAD {b.span.bad[:12]} could not be told apart from the band of GOOD: {top.note}"
        return
    change = Change.of(top.evidence, b.threshold)
    lo, hi = -1, len(commits) - 1
    skipped: set[str] = set()
    while (mid := _next(commits, lo, hi, skipped)) is not None:
        step = _settle(b, commits[mid], lambda ev: judge_step(ev, change), enough(change.edge), t0)
        result.steps.append(step)
        if step.verdict is StepVerdict.GOOD:
            lo = mid
        elif step.verdict is StepVerdict.BAD:
            hi = mid
        elif step.verdict is StepVerdict.SKIPPED:
            skipped.add(commits[mid])
        else:
            result.reason = f"{commits[mid][:12]} stayed undecided: {step.note}"
            break
    result.candidates = commits[lo + 1 : hi + 1]
    if len(result.candidates) == 1:
        result.outcome, result.first_bad = "found", commits[hi]
        return
    result.outcome, result.first_bad = "range", commits[hi]
    if not result.reason:
        named = ", ".join(c[:12] for c in result.candidates if c in skipped)
        result.reason = f"{named} could not be tested (skipped)"
