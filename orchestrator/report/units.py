"""Units, labels and the one value formatter every command uses.

A metric's unit is what its rows say (`unit`), else what its name says (`*_seconds` seconds,
`*_bytes` bytes, `*_tok_s` tok/s). Values read the same everywhere: four significant digits,
times scaled to s, ms, µs or ns, sizes in decimal kB, MB, GB (as the bandwidths' GB/s), rates
with thousands separators instead of exponents, and relative errors in scientific notation.
"""

from __future__ import annotations

import math

METRIC_UNITS = {
    "seconds": "seconds",
    "prefill_tok_s": "tok/s",
    "decode_tok_s": "tok/s",
    "gb_per_s": "GB/s",
    "tflop_per_s": "TFLOP/s",
    "rel_error": "ratio",
}
METRIC_LABELS = {
    "prefill_tok_s": "prefill tok/s",
    "decode_tok_s": "decode tok/s",
    "peak_memory_bytes": "peak memory",
    "load_peak_memory_bytes": "load peak memory",
    "load_seconds": "load time",
    "build_seconds": "build time",
    "seconds": "time",
    "gb_per_s": "GB/s",
    "tflop_per_s": "TFLOP/s",
    "rel_error": "rel. error",
}
_TIME_SCALES = ((1.0, "s"), (1e-3, "ms"), (1e-6, "µs"), (1e-9, "ns"))
_SIZE_SCALES = ((1e12, "TB"), (1e9, "GB"), (1e6, "MB"), (1e3, "kB"))


def unit_of(metric: str, unit: str | None = None) -> str:
    """The unit of a metric: the one its name implies, else the rows' own ('' when neither says)."""
    if metric in METRIC_UNITS:
        return METRIC_UNITS[metric]
    for suffix, implied in (("_seconds", "seconds"), ("_bytes", "bytes"), ("_tok_s", "tok/s")):
        if metric.endswith(suffix):
            return implied
    return unit or ""


def metric_label(metric: str) -> str:
    """A short column label for a metric (`prefill tok/s`, `peak memory`)."""
    return METRIC_LABELS.get(metric, metric.replace("_", " "))


def header_unit(unit: str) -> str:
    """The unit a column header carries (rates); '' where each cell carries its own scaled unit."""
    return "" if unit in ("seconds", "bytes", "ratio", "") else unit


def significant(value: float, digits: int = 4) -> str:
    """`value` with `digits` significant digits in fixed point (thousands separated, never an exponent)."""
    if value == 0:
        return "0"
    magnitude = math.floor(math.log10(abs(value)))
    if magnitude >= digits - 1:
        return f"{value:,.0f}"
    if magnitude < -4:
        return f"{value:.{digits - 1}e}"
    return f"{value:.{digits - 1 - magnitude}f}"


def format_value(value: float | None, unit: str, *, with_unit: bool = True) -> str:
    """One value in its unit: `28.03 ms`, `40.44 GB`, `121.8 tok/s` (`121.8` without the unit), `1.2e-03`.

    Times and sizes always carry their (scaled) unit; `with_unit=False` drops only a rate's.
    """
    if value is None or not math.isfinite(value):
        return "-"
    if unit == "seconds":
        for scale, name in _TIME_SCALES:
            if abs(value) >= scale or scale == _TIME_SCALES[-1][0]:
                return f"{significant(value / scale)} {name}"
    if unit == "bytes":
        for scale, name in _SIZE_SCALES:
            if abs(value) >= scale:
                return f"{significant(value / scale)} {name}"
        return f"{value:.0f} B"
    if unit == "ratio":
        return f"{value:.1e}"
    text = significant(value)
    return f"{text} {unit}" if with_unit and unit else text
