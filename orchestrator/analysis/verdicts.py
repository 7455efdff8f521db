"""What judging a criterion produces: outcomes, per-point results and a criterion's verdict.

Both criterion kinds (`orchestrator.analysis.criteria`'s ratio and
`orchestrator.analysis.same_output`'s byte-identical output) build these, and the report and the
`check` command read them, so they sit below both kinds.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

from orchestrator.analysis.groups import Point
from orchestrator.analysis.power import Settle
from orchestrator.analysis.stats import Ratio
from orchestrator.errors import EXIT_AMBIGUOUS, EXIT_CRITERION_FAILED, EXIT_OK
from orchestrator.specs.criterion import Criterion


class Outcome(StrEnum):
    """A criterion's (or one point's) result."""

    PASS = "PASS"
    FAIL = "FAIL"
    AMBIGUOUS = "AMBIGUOUS"
    SKIPPED = "SKIPPED"  # nothing to judge by design (a comparison of commits on rows of one commit)


@dataclass(frozen=True)
class PointResult:
    """The ratio at one point on one device and what it says."""

    device: str
    case_name: str
    point: Point
    ratio: Ratio
    outcome: Outcome
    settle: Settle | None = None  # what more samples per arm would do for an AMBIGUOUS point
    note: str | None = None  # why there is no verdict (too few samples, on the bound, multiplicity)

    @property
    def more_samples(self) -> int | None:
        """About how many more samples per arm settle it (None: settled, or on the bound)."""
        return self.settle.more if self.settle else None


@dataclass(frozen=True)
class MissingPoint:
    """A point the criterion needs but the data cannot judge, and why."""

    device: str
    case_name: str
    point: Point
    reason: str


@dataclass
class CriterionVerdict:
    """One criterion's verdict with every point behind it."""

    criterion: Criterion
    baseline: str
    outcome: Outcome
    points: list[PointResult] = field(default_factory=list)
    missing: list[MissingPoint] = field(default_factory=list)
    shown: dict[str, list[str]] = field(default_factory=dict)  # case -> parameters that tell points apart

    def label(self, device: str, case_name: str, point: Point) -> str:
        """`h200 qmm tokens=4096`: the device, the case and the parameters that vary in it."""
        names = self.shown.get(case_name)
        return point_label(device, case_name, tuple(kv for kv in point if names is None or kv[0] in names))

    def worst(self) -> PointResult | None:
        """The point closest to failing (lowest interval for min_ratio, highest for max_ratio)."""
        if not self.points:
            return None
        if self.criterion.min_ratio is not None:
            return min(self.points, key=lambda p: p.ratio.ci_low)
        return max(self.points, key=lambda p: p.ratio.ci_high)


def overall(outcomes: set[Outcome], incomplete: bool) -> Outcome:
    """A criterion's outcome from its points': FAIL when one fails, else AMBIGUOUS when one is or
    the points are `incomplete` (one is missing, or none was judged), else PASS."""
    if Outcome.FAIL in outcomes:
        return Outcome.FAIL
    if Outcome.AMBIGUOUS in outcomes or incomplete:
        return Outcome.AMBIGUOUS
    return Outcome.PASS


def exit_code_for(verdicts: list[CriterionVerdict]) -> int:
    """0 when all pass (or there are none), 1 when one fails, 4 when none fails but one is ambiguous."""
    outcomes = {v.outcome for v in verdicts}
    if Outcome.FAIL in outcomes:
        return EXIT_CRITERION_FAILED
    if Outcome.AMBIGUOUS in outcomes:
        return EXIT_AMBIGUOUS
    return EXIT_OK


def point_label(device: str, case_name: str, point: Point) -> str:
    """`cpu qmm tokens=4096 n=256` for messages."""
    return " ".join([device, case_name, *(f"{k}={v}" for k, v in point)])
