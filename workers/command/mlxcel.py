"""The mlxcel engine's own output formats, as its tools print them (the seeds' workflows).

* `mlxcel-bench-decode` (stdout): `[Load] wall: 82.600 s  MLX peak: 37.17 GB`, then
  `[Profile Results]` with `  Prompt tokens:    512`, `  Generated tokens: 32`,
  `  Prefill:          4333.50 ms (118.15 tok/s)`, `  Decode: ... ms (... tok/s)` and
  `  MLX peak memory:  37.17 GB`. It prints no generated text; `[long-prompt] ...` goes to stderr.
* `mlxcel generate` (stdout): loader lines, `Generating...`, the prompt and the generated text,
  two newlines, then `[Generated N tokens in X.XXs = Y.YY tok/s]` or, with `--profile`, the
  `[Profile Results]` block. The greedy text is what follows `Generating...` up to that block,
  as the engine's own `scripts/ab_output_equality.sh` compares it.
* Newer `mlxcel-bench-decode`s add a `Decode path: ...` line and `[Memory] <phase>: ...` lines;
  they are neither text nor metrics here.
* `scripts/bench_decode.sh` (stdout): one CSV row per model, read by column name in
  `workers.command.bench_csv` (its 14- to 19-column layouts and SKIP:/FAIL: fields are described
  there); `parse_bench_decode_csv` and `CSV_COLUMNS` are re-exported from here.
"""

from __future__ import annotations

import re

from workers.command.bench_csv import CSV_COLUMNS, parse_bench_decode_csv
from workers.command.parsed import NUM, OutputParseError, ParsedOutput, memory_bytes

__all__ = ["CSV_COLUMNS", "parse_bench_decode", "parse_bench_decode_csv", "parse_generate"]

_LOAD_RE = re.compile(rf"^\[Load\]\s*wall:\s*{NUM}\s*s(?:.*?MLX peak:\s*{NUM}\s*([KMGT]i?B))?", re.M | re.I)
_PROFILE_RE = re.compile(r"^\[Profile Results\]\s*$", re.M)
_PHASE_RE = re.compile(rf"^\s*(Prefill|Decode):\s*{NUM}\s*ms\s*\(\s*{NUM}\s*tok/s\s*\)", re.M)
_COUNT_RE = re.compile(r"^\s*(Prompt|Generated) tokens:\s*(\d+)\s*$", re.M)
_LOG_LINE_RE = re.compile(r"^(?:\[[A-Za-z][\w ./-]*\]|\s*Decode path:)")  # log lines, not text
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
    while lines and _LOG_LINE_RE.match(lines[0]):  # `[Prompt] ...`/`[Memory] ...`/`Decode path:` lines
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
