"""Parsers that turn an external benchmark's output into metrics (command cases).

A command case names its parser with `parse`, either a string or a table:

* `"bench-decode"`: the text block the seeds' `scripts/bench_decode.sh` (mlxcel-bench-decode)
  prints: `[Load] wall: X s  MLX peak: Y GB`, the generated text, then `[Profile Results]`
  with `Prompt tokens:`, `Generated tokens:`, `Prefill: N ms (N tok/s)`, `Decode: N ms (N tok/s)`
  and `MLX peak memory: X GB`.
* `"engine-bench"` or `{ kind = "prefixed-json", prefix = "[engine-bench]" }`: JSON objects on
  lines behind a prefix; other lines are ignored.
* `"json-lines"`: every line that starts with `{` is a JSON object.
* `{ kind = "regex", patterns = { decode_tok_s = 'Decode: .*\\((?P<value>[\\d.]+) tok/s' },
  units = { decode_tok_s = "tok/s" }, text = '(?s)<out>(.*)</out>' }`: named regular expressions,
  one per metric; every match is one value, the `value` group (or the first group) its number.

A JSON object is either `{"metric": "decode_tok_s", "value": 12.5, "unit": "tok/s"}` or a flat
object of numbers (`{"decode_tok_s": 12.5, "peak_memory_bytes": 3.9e10}`); a string under
`text`, `output` or `generated_text` is the generated text. Units of flat objects come from the
name's suffix (`_tok_s`: tok/s, `_bytes`: bytes, `_seconds`/`_s`: seconds, `_ms`: ms).

Output that does not parse (empty, truncated, garbled) raises `OutputParseError` with a one-line
reason; `workers.command` turns it into a failed row.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

# GB as the seeds' tools print it is decimal (1e9); GiB/MiB are binary.
_MEMORY_UNITS = {
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
_TEXT_KEYS = ("text", "output", "generated_text")
_NUM = r"([-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?)"


class OutputParseError(ValueError):
    """The benchmark's output does not hold what its parser expects."""


@dataclass(frozen=True)
class Measurement:
    """One value a benchmark printed."""

    metric: str
    value: float
    unit: str


@dataclass
class ParsedOutput:
    """What a parser found: the measurements in order, and the generated text if printed."""

    measurements: list[Measurement] = field(default_factory=list)
    text: str | None = None

    def add(self, metric: str, value: float, unit: str) -> None:
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


def _memory_bytes(number: str, unit: str) -> float:
    return float(number) * _MEMORY_UNITS[unit.upper()]


# ------------------------------------------------------------------------------------ bench-decode

_LOAD_RE = re.compile(rf"^\[Load\]\s*wall:\s*{_NUM}\s*s(?:.*?MLX peak:\s*{_NUM}\s*([KMGT]i?B))?", re.M | re.I)
_PROFILE_RE = re.compile(r"^\[Profile Results\]\s*$", re.M)
_PHASE_RE = re.compile(rf"^\s*(Prefill|Decode):\s*{_NUM}\s*ms\s*\(\s*{_NUM}\s*tok/s\s*\)", re.M)
_COUNT_RE = re.compile(r"^\s*(Prompt|Generated) tokens:\s*(\d+)\s*$", re.M)
_LOG_LINE_RE = re.compile(r"^\[[A-Za-z][\w ./-]*\]")
_PEAK_RE = re.compile(rf"^\s*MLX peak memory:\s*{_NUM}\s*([KMGT]i?B)\b", re.M | re.I)


def parse_bench_decode(output: str) -> ParsedOutput:
    """Parse mlxcel-bench-decode's `[Load]` line and `[Profile Results]` block.

    Args:
        output: the command's standard output.

    Returns:
        load_seconds, load_peak_memory_bytes, prompt_tokens, generated_tokens, prefill_seconds,
        prefill_tok_s, decode_seconds, decode_tok_s and peak_memory_bytes (those printed), and the
        generated text (what stands between the `[Load]` line and `[Profile Results]`).

    Raises:
        OutputParseError: no `[Profile Results]` block, or one without a Prefill/Decode line.
    """
    if not output.strip():
        raise OutputParseError("empty output")
    profile = _PROFILE_RE.search(output)
    if profile is None:
        raise OutputParseError("no [Profile Results] block (output truncated or not bench-decode)")
    parsed = ParsedOutput()
    load = _LOAD_RE.search(output, 0, profile.start())
    if load is not None:
        parsed.add("load_seconds", float(load.group(1)), "seconds")
        if load.group(2) is not None:
            parsed.add("load_peak_memory_bytes", _memory_bytes(load.group(2), load.group(3)), "bytes")
    block = output[profile.end() :]
    for m in _COUNT_RE.finditer(block):
        parsed.add(f"{m.group(1).lower()}_tokens", float(m.group(2)), "tokens")
    phases = 0
    for m in _PHASE_RE.finditer(block):
        phase = m.group(1).lower()
        parsed.add(f"{phase}_seconds", float(m.group(2)) / 1000.0, "seconds")
        parsed.add(f"{phase}_tok_s", float(m.group(3)), "tok/s")
        phases += 1
    if phases == 0:
        raise OutputParseError("[Profile Results] has no 'Prefill: N ms (N tok/s)' or 'Decode: ...' line")
    peak = _PEAK_RE.search(block)
    if peak is not None:
        parsed.add("peak_memory_bytes", _memory_bytes(peak.group(1), peak.group(2)), "bytes")
    text_start = output.find("\n", load.end()) + 1 if load is not None else 0
    lines = output[text_start : profile.start()].split("\n")
    while lines and _LOG_LINE_RE.match(lines[0]):  # `[Prompt] ...`-style log lines before the text
        lines.pop(0)
    text = "\n".join(lines).strip("\n")
    parsed.text = text if text.strip() else None
    return parsed


# -------------------------------------------------------------------------------------- JSON lines


def _take_object(parsed: ParsedOutput, obj: Any, where: str) -> None:
    if not isinstance(obj, dict):
        raise OutputParseError(f"{where}: a JSON line must hold an object")
    if "metric" in obj and "value" in obj:
        value = obj["value"]
        if not isinstance(value, int | float) or isinstance(value, bool):
            raise OutputParseError(f"{where}: value of {obj['metric']!r} is not a number")
        metric = str(obj["metric"])
        parsed.add(metric, float(value), str(obj.get("unit") or unit_for(metric)))
        return
    for key, value in obj.items():
        if key in _TEXT_KEYS and isinstance(value, str):
            parsed.text = value if parsed.text is None else parsed.text + value
        elif isinstance(value, int | float) and not isinstance(value, bool):
            parsed.add(key, float(value), unit_for(key))


def parse_json_lines(output: str, prefix: str | None = None) -> ParsedOutput:
    """Parse JSON objects, one per line, optionally behind a prefix such as `[engine-bench]`.

    Args:
        output: the command's standard output.
        prefix: lines that start with it carry JSON; None: lines that start with `{`.

    Raises:
        OutputParseError: a marked line that is not a JSON object (garbled or truncated), or no
            numeric value at all.
    """
    if not output.strip():
        raise OutputParseError("empty output")
    parsed = ParsedOutput()
    for number, line in enumerate(output.splitlines(), start=1):
        stripped = line.strip()
        if prefix is not None:
            if not stripped.startswith(prefix):
                continue
            payload = stripped[len(prefix) :].strip()
        elif stripped.startswith("{"):
            payload = stripped
        else:
            continue
        try:
            obj = json.loads(payload)
        except json.JSONDecodeError as exc:
            raise OutputParseError(f"line {number}: not valid JSON ({exc.msg})") from None
        _take_object(parsed, obj, f"line {number}")
    if not parsed.measurements:
        marker = f"'{prefix}' JSON lines" if prefix else "JSON lines"
        raise OutputParseError(f"no {marker} with numeric values in the output")
    return parsed


# ------------------------------------------------------------------------------------------ regex


def parse_regex(
    output: str, patterns: dict[str, str], units: dict[str, str] | None = None, text: str | None = None
) -> ParsedOutput:
    """Parse with named regular expressions: one pattern per metric, every match one value.

    Args:
        output: the command's standard output.
        patterns: metric name -> regex; its `value` group (or first group) is the number.
        units: metric name -> unit (default: from the name's suffix).
        text: a regex whose first group is the generated text.

    Raises:
        OutputParseError: a pattern that matches nothing, or matches something that is no number.
    """
    if not output.strip():
        raise OutputParseError("empty output")
    units = units or {}
    parsed = ParsedOutput()
    for metric, pattern in patterns.items():
        regex = re.compile(pattern, re.M)
        found = 0
        for m in regex.finditer(output):
            raw = m.group("value") if "value" in regex.groupindex else m.group(1 if regex.groups else 0)
            try:
                value = float(raw)
            except (TypeError, ValueError):
                raise OutputParseError(f"{metric}: matched {raw!r}, which is not a number") from None
            parsed.add(metric, value, units.get(metric, unit_for(metric)))
            found += 1
        if not found:
            raise OutputParseError(f"{metric}: pattern {pattern!r} matched nothing")
    if text is not None:
        found_text = re.search(text, output, re.M)
        if found_text is not None:
            parsed.text = found_text.group(1 if found_text.re.groups else 0)
    return parsed


# ------------------------------------------------------------------------------------------ dispatch


def _from_table(spec: dict[str, Any]) -> Callable[[str], ParsedOutput]:
    kind = spec.get("kind")
    if kind == "bench-decode":
        return parse_bench_decode
    if kind == "json-lines":
        return lambda out: parse_json_lines(out, None)
    if kind == "prefixed-json":
        prefix = spec.get("prefix")
        if not isinstance(prefix, str) or not prefix:
            raise ValueError("parse.prefix: a non-empty string is needed for kind 'prefixed-json'")
        return lambda out: parse_json_lines(out, prefix)
    if kind == "regex":
        patterns = spec.get("patterns")
        if not isinstance(patterns, dict) or not patterns:
            raise ValueError("parse.patterns: a table of metric = 'regex' is needed for kind 'regex'")
        for metric, pattern in patterns.items():
            try:
                re.compile(str(pattern))
            except re.error as exc:
                raise ValueError(f"parse.patterns.{metric}: bad regular expression ({exc})") from None
        units = spec.get("units") or {}
        text = spec.get("text")
        return lambda out: parse_regex(
            out,
            {str(k): str(v) for k, v in patterns.items()},
            {str(k): str(v) for k, v in units.items()},
            text,
        )
    raise ValueError(f"parse.kind: {kind!r} is not one of bench-decode, json-lines, prefixed-json, regex")


NAMED = {
    "bench-decode": {"kind": "bench-decode"},
    "engine-bench": {"kind": "prefixed-json", "prefix": "[engine-bench]"},
    "json-lines": {"kind": "json-lines"},
}


def parser_for(spec: str | dict[str, Any] | None) -> Callable[[str], ParsedOutput]:
    """The parse function a case's `parse` setting names.

    Args:
        spec: a built-in name (`bench-decode`, `engine-bench`, `json-lines`) or a table with `kind`;
            None means `json-lines`.

    Raises:
        ValueError: an unknown name or kind, or a table that misses what its kind needs.
    """
    if spec is None:
        spec = "json-lines"
    if isinstance(spec, str):
        if spec not in NAMED:
            raise ValueError(f"parse: unknown parser {spec!r} (built-in: {', '.join(NAMED)}; or a table)")
        spec = NAMED[spec]
    return _from_table(spec)
