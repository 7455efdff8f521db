"""What a parser makes of a benchmark's output: measurements, the generated text, or why not.

Shared by `workers.command.parsers` (generic formats and the dispatch) and `workers.command.mlxcel` (the
mlxcel engine's own formats).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

# GB as the seeds' tools print it is decimal (1e9); GiB/MiB are binary.
MEMORY_UNITS = {
    "B": 1.0,
    "KB": 1e3,
    "MB": 1e6,
    "GB": 1e9,
    "TB": 1e12,
    "KIB": 2.0**10,
    "MIB": 2.0**20,
    "GIB": 2.0**30,
    "TIB": 2.0**40,
}
NUM = r"([-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?)"


class OutputParseError(ValueError):
    """The benchmark's output does not hold what its parser expects."""


class OutputSkipped(OutputParseError):
    """The benchmark itself declined the point (e.g. `SKIP:oom_estimate`): unsupported, not broken."""


@dataclass(frozen=True)
class Measurement:
    """One value a benchmark printed."""

    metric: str
    value: float
    unit: str


@dataclass
class ParsedOutput:
    """What a parser found: the measurements in order, the generated text if printed, and facts.

    `extra` holds what the output says about the program that printed it (its version, commits,
    the model it ran): strings the command case stores in each sample's `extra` map.
    """

    measurements: list[Measurement] = field(default_factory=list)
    text: str | None = None
    extra: dict[str, str] = field(default_factory=dict)

    def add(self, metric: str, value: float, unit: str) -> None:
        """Append one value; a non-finite one is an `OutputParseError`."""
        if not math.isfinite(value):
            raise OutputParseError(f"{metric}: value {value!r} is not a finite number")
        self.measurements.append(Measurement(metric, value, unit))


def unit_for(metric: str) -> str:
    """The unit a metric's name implies (`decode_tok_s` -> `tok/s`), or "" when it says none."""
    for suffix, unit in (
        ("_tok_s", "tok/s"),
        ("_bytes", "bytes"),
        ("_seconds", "seconds"),
        ("_ms", "ms"),
        ("_gb_per_s", "GB/s"),
        ("_tflop_per_s", "TFLOP/s"),
        ("_tokens", "tokens"),
        ("_s", "seconds"),
    ):
        if metric.endswith(suffix):
            return unit
    return ""


def memory_bytes(number: str, unit: str) -> float:
    """`37.17`, `GB` -> bytes (GB decimal, GiB binary)."""
    return float(number) * MEMORY_UNITS[unit.upper()]
