"""Parsers that turn an external benchmark's output into metrics (command cases).

A command case names its parser with `parse`, either a string or a table with `kind`:

* `"bench-decode"`: mlxcel-bench-decode's `[Load]` line and `[Profile Results]` block (also
  `mlxcel generate --profile`'s); `"bench-decode-csv"`: the CSV rows `scripts/bench_decode.sh`
  prints; `"mlxcel-generate"`: `mlxcel generate`'s greedy text and timing line. The formats, as
  the engine prints them, are described in `workers.command.mlxcel`.
* `"engine-bench"`: mlxcel-bench-engine's `[engine-bench] {json}` lines (its text lines behind
  the prefix are skipped); it reports `cli` and `server` paths, so a run printing both needs
  `{ kind = "engine-bench", select = { path = "cli" } }`. `{ kind = "prefixed-json", prefix =
  "[x]" }`: JSON objects behind any prefix; other lines are ignored.
* `"json-lines"`: every line that starts with `{` is a JSON object (`select` filters here too).
* `"workers-rows"`: the rows `python -m workers run JOB --out FILE` wrote, each metric's median
  (`workers.command.job_rows`: a kernel case bisected over this project's commits).
* `{ kind = "regex", patterns = { decode_tok_s = 'Decode: .*\\((?P<value>[\\d.]+) tok/s' },
  units = { decode_tok_s = "tok/s" }, text = '(?s)<out>(.*)</out>' }`: named regular expressions,
  one per metric; every match is one value, the `value` group (or the first group) its number.

A JSON object is either `{"metric": "decode_tok_s", "value": 12.5, "unit": "tok/s"}` or a flat
object of numbers (`{"decode_tok_s": 12.5, "peak_memory_bytes": 3.9e10}`); a string under
`text`, `output` or `generated_text` is the generated text. Units of flat objects come from the
name's suffix (`_tok_s`: tok/s, `_bytes`: bytes, `_seconds`/`_s`: seconds, `_ms`: ms).

Output that does not parse (empty, truncated, garbled) raises `OutputParseError` with a one-line
reason, output declining the point (`SKIP:oom`) `OutputSkipped`; the command case turns them into
failed and unsupported rows.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

from workers.command.job_rows import parse_job_rows
from workers.command.mlxcel import parse_bench_decode, parse_bench_decode_csv, parse_generate
from workers.command.parsed import Measurement, OutputParseError, OutputSkipped, ParsedOutput, unit_for

__all__ = [
    "Measurement",
    "OutputParseError",
    "OutputSkipped",
    "ParsedOutput",
    "parse_bench_decode",
    "parse_json_lines",
    "parse_regex",
    "parser_for",
    "unit_for",
]

_TEXT_KEYS = ("text", "output", "generated_text")


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


def parse_json_lines(
    output: str,
    prefix: str | None = None,
    *,
    select: dict[str, Any] | None = None,
    one_of: str | None = None,
) -> ParsedOutput:
    """Parse JSON objects, one per line, optionally behind a prefix such as `[engine-bench]`.

    Args:
        output: the command's standard output.
        prefix: lines that start with it and then `{` carry JSON (other lines behind the prefix,
            such as mlxcel-bench-engine's `summary` header, are text); None: lines starting with `{`.
        select: only objects whose fields have these values (e.g. `{"path": "cli"}`).
        one_of: a field whose value must be the same in every object kept (mlxcel-bench-engine's
            `path`): samples of two decode paths must not pool.

    Raises:
        OutputParseError: a marked line that is not a JSON object (garbled or truncated), objects
            of several `one_of` values, or no numeric value at all.
    """
    if not output.strip():
        raise OutputParseError("empty output")
    parsed = ParsedOutput()
    kinds: dict[str, int] = {}
    for number, line in enumerate(output.splitlines(), start=1):
        stripped = line.strip()
        if prefix is not None:
            if not stripped.startswith(prefix):
                continue
            payload = stripped[len(prefix) :].strip()
            if not payload.startswith("{"):
                continue
        elif stripped.startswith("{"):
            payload = stripped
        else:
            continue
        try:
            obj = json.loads(payload)
        except json.JSONDecodeError as exc:
            raise OutputParseError(f"line {number}: not valid JSON ({exc.msg})") from None
        if select and (not isinstance(obj, dict) or any(obj.get(k) != v for k, v in select.items())):
            continue
        if one_of is not None and isinstance(obj, dict) and one_of in obj:
            kinds.setdefault(str(obj[one_of]), number)
        _take_object(parsed, obj, f"line {number}")
    if len(kinds) > 1:
        names = ", ".join(sorted(kinds))
        raise OutputParseError(
            f"the output holds several {one_of}s ({names}); choose one with parse = "
            f'{{ kind = "engine-bench", select = {{ {one_of} = "{sorted(kinds)[0]}" }} }}'
        )
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


def _json_options(spec: dict[str, Any]) -> dict[str, Any]:
    select = spec.get("select")
    if select is not None and (not isinstance(select, dict) or not select):
        raise ValueError('parse.select: a table of field = value, e.g. { path = "cli" }')
    return {"select": select, "one_of": spec.get("one_of")}


def _from_table(spec: dict[str, Any]) -> Callable[[str], ParsedOutput]:
    kind = spec.get("kind")
    fixed = {
        "bench-decode": parse_bench_decode,
        "bench-decode-csv": parse_bench_decode_csv,
        "mlxcel-generate": parse_generate,
        "workers-rows": parse_job_rows,
    }
    if kind in fixed:
        return fixed[kind]
    if kind == "json-lines":
        options = _json_options(spec)
        return lambda out: parse_json_lines(out, None, **options)
    if kind in ("prefixed-json", "engine-bench"):
        prefix = spec.get("prefix", "[engine-bench]" if kind == "engine-bench" else None)
        if not isinstance(prefix, str) or not prefix:
            raise ValueError("parse.prefix: a non-empty string is needed for kind 'prefixed-json'")
        options = _json_options(spec)
        if kind == "engine-bench":
            options["one_of"] = options["one_of"] or "path"
        return lambda out: parse_json_lines(out, prefix, **options)
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
    raise ValueError(f"parse.kind: {kind!r} is not one of {', '.join(KINDS)}")


KINDS = (
    "bench-decode",
    "bench-decode-csv",
    "mlxcel-generate",
    "engine-bench",
    "json-lines",
    "prefixed-json",
    "regex",
    "workers-rows",
)
NAMED = {
    name: {"kind": name}
    for name in ("bench-decode", "bench-decode-csv", "mlxcel-generate", "engine-bench", "json-lines", "workers-rows")
}


def parser_for(spec: str | dict[str, Any] | None) -> Callable[[str], ParsedOutput]:
    """The parse function a case's `parse` setting names.

    Args:
        spec: a built-in name (`bench-decode`, `bench-decode-csv`, `mlxcel-generate`,
            `engine-bench`, `json-lines`, `workers-rows`) or a table with `kind`; None means `json-lines`.

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
