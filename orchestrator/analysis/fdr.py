"""False-discovery control across one table of comparisons (Benjamini-Hochberg).

A comparison table of 50 points x 6 arms is 250 tests: at 95 % each, pure noise alone gives a
dozen FASTER/SLOWER verdicts. `control_fdr` keeps a FASTER/SLOWER only where Benjamini and
Hochberg's step-up procedure at q = 5 %, over every comparison of the table, rejects "the change
lies within the band" (p-values read off each comparison's own bootstrap draws,
`orchestrator.analysis.power.past_p_value`: p < 0.05 exactly where the 95 % interval lies past the
band, so a table of one comparison keeps every verdict it had); metrics derived from the same
samples (`seconds`, `prefill_tok_s`, `gb_per_s`, ...) are one hypothesis, not four. The
rest become AMBIGUOUS, with what more samples would do for them; `FdrControl.describe` is the line
the table prints about it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TypeVar

from orchestrator.analysis.stats import Comparison, Verdict, settle_of

FDR_Q = 0.05

K = TypeVar("K", bound=Hashable)


@dataclass(frozen=True)
class FdrControl:
    """How false discoveries were controlled across one table of comparisons."""

    q: float
    hypotheses: int  # distinct tests (metrics derived from the same samples count once)
    kept: int  # FASTER/SLOWER verdicts that survive
    demoted: int  # FASTER/SLOWER verdicts turned AMBIGUOUS

    def describe(self) -> str:
        """One line for the table's legend."""
        return (
            f"False discoveries controlled by Benjamini-Hochberg at q = {self.q:.0%} over the "
            f"{self.hypotheses} comparisons of this table (metrics derived from the same samples count once): "
            f"{self.kept} FASTER/SLOWER kept, {self.demoted} turned AMBIGUOUS."
        )


def benjamini_hochberg(p_values: Sequence[float], q: float = FDR_Q) -> list[bool]:
    """Which hypotheses Benjamini-Hochberg rejects at false-discovery rate `q` (step-up)."""
    m = len(p_values)
    order = sorted(range(m), key=lambda i: p_values[i])
    last = -1
    for rank, i in enumerate(order, start=1):
        if p_values[i] <= rank * q / m:
            last = rank
    rejected = [False] * m
    for rank, i in enumerate(order, start=1):
        rejected[i] = rank <= last
    return rejected


def control_fdr(
    comparisons: Mapping[K, Comparison], test_of: Callable[[K], Hashable], *, q: float = FDR_Q
) -> tuple[dict[K, Comparison], FdrControl]:
    """Keep FASTER/SLOWER only where Benjamini-Hochberg over the table rejects "within the band".

    Args:
        comparisons: every comparison of one table.
        test_of: what a comparison tests besides its evidence (e.g. case, point, side): two
            comparisons with the same `test_of` and the same estimate and p-value (metrics
            derived from the same samples) are one hypothesis.
        q: the false-discovery rate.

    Returns:
        The comparisons, demoted where BH does not reject, and how it went. Exact and TOO FEW
        comparisons are not tests (no p-value) and are left as they are.
    """
    tests: dict[Hashable, float] = {}
    test_key: dict[K, Hashable] = {}
    for key, c in comparisons.items():
        if math.isnan(c.p_value):
            continue
        evidence = (
            test_of(key),
            round(math.log(c.speedup.ratio), 9) if c.speedup.ratio > 0 else None,
            round(c.p_value, 12),
        )
        test_key[key] = evidence
        tests.setdefault(evidence, c.p_value)
    names = list(tests)
    rejected = dict(zip(names, benjamini_hochberg([tests[t] for t in names], q), strict=True))
    out: dict[K, Comparison] = {}
    kept = demoted = 0
    counted: set[Hashable] = set()
    for key, c in comparisons.items():
        if c.verdict in (Verdict.FASTER, Verdict.SLOWER) and key in test_key:
            first = test_key[key] not in counted
            counted.add(test_key[key])
            if rejected[test_key[key]]:
                kept += first
            else:
                demoted += first
                settle = settle_of(c)
                note = f"p={c.p_value:.2g}: not significant once {len(names)} comparisons are controlled"
                note = "; ".join(filter(None, (note, settle.edge_note())))
                c = replace(c, verdict=Verdict.AMBIGUOUS, settle=settle, note=note)
        out[key] = c
    return out, FdrControl(q, len(names), kept, demoted)
