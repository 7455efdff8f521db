"""The mlxcel engine's own output formats, as its tools print them (the seeds' workflows).

* `mlxcel-bench-decode` (stdout): `[Load] wall: 82.600 s  MLX peak: 37.17 GB`, then
  `[Profile Results]` with `  Prompt tokens:    512`, `  Generated tokens: 32`,
  `  Prefill:          4333.50 ms (118.15 tok/s)`, `  Decode: ... ms (... tok/s)` and
  `  MLX peak memory:  37.17 GB`. It prints no generated text; `[long-prompt] ...` goes to stderr.
* `mlxcel generate` (stdout): loader lines, `Generating...`, the prompt and the generated text,
  two newlines, then `[Generated N tokens in X.XXs = Y.YY tok/s]` or, with `--profile`, the
  `[Profile Results]` block. The greedy text is what follows `Generating...` up to that block,
  as the engine's own `scripts/ab_output_equality.sh` compares it.
* `scripts/bench_decode.sh` (stdout): one CSV row per model, `model,model_path,prompt_tokens,
  generated_tokens,prefill_ms,prefill_tok_s,decode_ms,decode_tok_s,date,hardware,mlx_version,
  build_type,max_tokens,"prompt",prompt_target_len` and a trailing `SKIP:*`/`FAIL:*` token when the
  run was skipped (a capacity exclusion) or failed; the header goes only to its CSV file, progress
  to stderr. Older scripts lack `prompt_target_len`.
"""

from __future__ import annotations

import csv
import re

from workers.command.parsed import NUM, OutputParseError, OutputSkipped, ParsedOutput, memory_bytes

_LOAD_RE = re.compile(rf"^\[Load\]\s*wall:\s*{NUM}\s*s(?:.*?MLX peak:\s*{NUM}\s*([KMGT]i?B))?", re.M | re.I)
_PROFILE_RE = re.compile(r"^\[Profile Results\]\s*$", re.M)
_PHASE_RE = re.compile(rf"^\s*(Prefill|Decode):\s*{NUM}\s*ms\s*\(\s*{NUM}\s*tok/s\s*\)", re.M)
_COUNT_RE = re.compile(r"^\s*(Prompt|Generated) tokens:\s*(\d+)\s*$", re.M)
_LOG_LINE_RE = re.compile(r"^\[[A-Za-z][\w ./-]*\]")
_PEAK_RE = re.compile(rf"^\s*MLX peak memory:\s*{NUM}\s*([KMGT]i?B)\b", re.M | re.I)
_GENERATING_RE = re.compile(r"^Generating\.\.\.[ \t]*\n", re.M)
_GENERATED_RE = re.compile(rf"^\[Generated (\d+) tokens in {NUM}s = {NUM} tok/s\]\s*$", re.M)
_REASONING_RE = re.compile(r"^\[All \d+ generated tokens went to the reasoning channel;.*$\n?", re.M)


def _profile_block(parsed: ParsedOutput, block: str) -> None:
    """The `[Profile Results]` lines: token counts, prefill/decode ms and tok/s, MLX peak memory."""
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
        parsed.add("peak_memory_bytes", memory_bytes(peak.group(1), peak.group(2)), "bytes")


def _clean_text(text: str) -> str | None:
    text = _REASONING_RE.sub("", text).rstrip("\n")
    return text if text.strip() else None


def parse_bench_decode(output: str) -> ParsedOutput:
    """Parse mlxcel-bench-decode's `[Load]` line and `[Profile Results]` block (or `generate --profile`'s).

    Returns:
        load_seconds, load_peak_memory_bytes, prompt_tokens, generated_tokens, prefill_seconds,
        prefill_tok_s, decode_seconds, decode_tok_s and peak_memory_bytes (those printed); the
        generated text where the output has one (after `Generating...`, else between `[Load]`
        and the block).

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
            parsed.add("load_peak_memory_bytes", memory_bytes(load.group(2), load.group(3)), "bytes")
    _profile_block(parsed, output[profile.end() :])
    generating = _GENERATING_RE.search(output, 0, profile.start())
    if generating is not None:
        parsed.text = _clean_text(output[generating.end() : profile.start()])
        return parsed
    text_start = output.find("\n", load.end()) + 1 if load is not None else 0
    lines = output[text_start : profile.start()].split("\n")
    while lines and _LOG_LINE_RE.match(lines[0]):  # `[Prompt] ...`-style log lines before the text
        lines.pop(0)
    parsed.text = _clean_text("\n".join(lines).strip("\n"))
    return parsed


def parse_generate(output: str) -> ParsedOutput:
    """Parse `mlxcel generate` (greedy text and its timing line, or its `--profile` block).

    Returns:
        generated_tokens, decode_seconds and decode_tok_s (from `[Generated ...]`), or the profile
        block's metrics; the text after `Generating...` (the prompt echo and the generation).

    Raises:
        OutputParseError: no `Generating...` line, no timing line after it (truncated), or no
            generated token.
    """
    if not output.strip():
        raise OutputParseError("empty output")
    generating = _GENERATING_RE.search(output)
    if generating is None:
        raise OutputParseError("no 'Generating...' line (not `mlxcel generate` output)")
    candidates = (_GENERATED_RE.search(output, generating.end()), _PROFILE_RE.search(output, generating.end()))
    found = [m for m in candidates if m is not None]
    if not found:
        raise OutputParseError("no '[Generated N tokens ...]' line or [Profile Results] block (output truncated)")
    end = min(found, key=lambda m: m.start())
    parsed = ParsedOutput()
    if end.re is _GENERATED_RE:
        tokens = int(end.group(1))
        parsed.add("generated_tokens", float(tokens), "tokens")
        parsed.add("decode_seconds", float(end.group(2)), "seconds")
        parsed.add("decode_tok_s", float(end.group(3)), "tok/s")
    else:
        _profile_block(parsed, output[end.end() :])
        tokens = int(next((m.value for m in parsed.measurements if m.metric == "generated_tokens"), 1))
    if tokens == 0:
        raise OutputParseError("the engine generated 0 tokens")
    parsed.text = _clean_text(output[generating.end() : end.start()])
    if parsed.text is None:
        raise OutputParseError("no generated text after 'Generating...'")
    return parsed


CSV_COLUMNS = (
    "model",
    "model_path",
    "prompt_tokens",
    "generated_tokens",
    "prefill_ms",
    "prefill_tok_s",
    "decode_ms",
    "decode_tok_s",
    "date",
    "hardware",
    "mlx_version",
    "build_type",
    "max_tokens",
    "prompt",
    "prompt_target_len",
)
_CLASS_RE = re.compile(r"^(SKIP|FAIL):[\w.-]+$")
_CSV_METRICS = (
    ("prompt_tokens", "prompt_tokens", "tokens", 1.0),
    ("generated_tokens", "generated_tokens", "tokens", 1.0),
    ("prefill_ms", "prefill_seconds", "seconds", 1e-3),
    ("prefill_tok_s", "prefill_tok_s", "tok/s", 1.0),
    ("decode_ms", "decode_seconds", "seconds", 1e-3),
    ("decode_tok_s", "decode_tok_s", "tok/s", 1.0),
)


def parse_bench_decode_csv(output: str) -> ParsedOutput:
    """Parse the CSV rows `scripts/bench_decode.sh` prints on stdout (one per model).

    Returns:
        prompt_tokens, generated_tokens, prefill_seconds, prefill_tok_s, decode_seconds and
        decode_tok_s of every row.

    Raises:
        OutputSkipped: the script skipped the model (`SKIP:oom_estimate`, `SKIP:oom`, ...).
        OutputParseError: no row, a line that is no such row, a `FAIL:*` row, or an empty number.
    """
    parsed = ParsedOutput()
    rows = 0
    for number, line in enumerate(output.splitlines(), start=1):
        if not line.strip():
            continue
        fields = next(csv.reader([line]))
        if fields[:2] == ["model", "model_path"]:
            continue  # a header, where a version prints one
        status = fields[-1] if len(fields) > len(CSV_COLUMNS) - 1 and _CLASS_RE.match(fields[-1]) else None
        values = fields[:-1] if status else fields
        if len(values) not in (len(CSV_COLUMNS) - 1, len(CSV_COLUMNS)):
            raise OutputParseError(
                f"line {number}: not a bench_decode.sh CSV row ({len(fields)} fields, expected {len(CSV_COLUMNS)})"
            )
        row = dict(zip(CSV_COLUMNS, values, strict=False))
        if status is not None and status.startswith("SKIP:"):
            raise OutputSkipped(f"bench_decode.sh skipped {row['model']}: {status}")
        if status is not None:
            raise OutputParseError(f"bench_decode.sh reported {status} for {row['model']}")
        for column, metric, unit, scale in _CSV_METRICS:
            raw = row[column].strip()
            try:
                value = float(raw)
            except ValueError:
                raise OutputParseError(f"line {number}: {column} {raw!r} is not a number") from None
            parsed.add(metric, value * scale, unit)
        rows += 1
    if rows == 0:
        raise OutputParseError("no bench_decode.sh CSV row in the output")
    return parsed
