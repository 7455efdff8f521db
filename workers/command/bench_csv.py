"""The CSV rows mlxcel's `scripts/bench_decode.sh` prints, read by their column names.

The script writes one row per model on stdout (`tee`d into its CSV file, whose first line is the
header); its columns grew over the engine's versions, and a row is read by what each column is
called, never by where a version put it:

* 14 columns: `model, model_path, prompt_tokens, generated_tokens, prefill_ms, prefill_tok_s,
  decode_ms, decode_tok_s, date, hardware, mlx_version, build_type, max_tokens, prompt`;
* 15: then `prompt_target_len` (the `--prompt-tokens` target, empty for the short prompt);
* 16: then `commit` (the engine's commit, for a while);
* 17 (Metal and CUDA since 2026-09): `mlx_version` renamed `mlxcel_version` (it always held the
  engine's version), then `mlxcel_commit, mlx_commit` (the engine's commit and its MLX pin);
* 19 (ROCm): the 17, then `mlx_rocm_overlay_commit, hip_version`.

A header line (`model,model_path,...`, as the CSV file starts) names the columns of the rows
after it, whatever their number; without one, the count picks a layout above. A trailing field
`SKIP:<why>` (a capacity exclusion: `SKIP:oom_estimate`, `SKIP:oom`) makes the sample unsupported,
`FAIL:<why>` failed, the model named. The engine's versions and commits a row reports, its model
and any column this parser does not know are kept with the sample (`ParsedOutput.extra`).
"""

from __future__ import annotations

import csv
import re

from workers.command.parsed import OutputParseError, OutputSkipped, ParsedOutput

_BASE = (
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
)
_TAIL = ("build_type", "max_tokens", "prompt")
LAYOUTS: dict[int, tuple[str, ...]] = {
    14: (*_BASE, "mlx_version", *_TAIL),
    15: (*_BASE, "mlx_version", *_TAIL, "prompt_target_len"),
    16: (*_BASE, "mlx_version", *_TAIL, "prompt_target_len", "commit"),
    17: (*_BASE, "mlxcel_version", *_TAIL, "prompt_target_len", "mlxcel_commit", "mlx_commit"),
    19: (
        *_BASE,
        "mlxcel_version",
        *_TAIL,
        "prompt_target_len",
        "mlxcel_commit",
        "mlx_commit",
        "mlx_rocm_overlay_commit",
        "hip_version",
    ),
}
CSV_COLUMNS = LAYOUTS[17]  # what the script writes on Metal and CUDA today

# Columns read and not kept: the numbers become metrics; the rest describe the script's own run.
_READ = {*_BASE, *_TAIL, "prompt_target_len"} - {"model"}
_STATUS_RE = re.compile(r"^(SKIP|FAIL):[\w.-]+$")
_METRICS = (
    ("prompt_tokens", "prompt_tokens", "tokens", 1.0),
    ("generated_tokens", "generated_tokens", "tokens", 1.0),
    ("prefill_ms", "prefill_seconds", "seconds", 1e-3),
    ("prefill_tok_s", "prefill_tok_s", "tok/s", 1.0),
    ("decode_ms", "decode_seconds", "seconds", 1e-3),
    ("decode_tok_s", "decode_tok_s", "tok/s", 1.0),
)
_KNOWN = ", ".join(str(n) for n in LAYOUTS)


def _named(fields: list[str], header: tuple[str, ...] | None, number: int) -> tuple[dict[str, str], str | None]:
    """The row's values by column name, and its trailing status field (or None)."""
    status = fields[-1] if fields and _STATUS_RE.match(fields[-1].strip()) else None
    values = fields[:-1] if status else fields
    if header is not None:
        if status is not None and len(fields) == len(header):
            values, status = fields, None  # a column of the header holds it, not a trailing field
        if len(values) != len(header):
            raise OutputParseError(
                f"line {number}: a bench_decode.sh row of {len(fields)} fields under a header of "
                f"{len(header)} columns (plus a SKIP:/FAIL: field at most)"
            )
        columns = header
    else:
        if len(values) not in LAYOUTS:
            raise OutputParseError(
                f"line {number}: not a bench_decode.sh CSV row ({len(fields)} fields and no header line; "
                f"the layouts known are {_KNOWN} columns, plus a trailing SKIP:/FAIL: field)"
            )
        columns = LAYOUTS[len(values)]
    return dict(zip(columns, values, strict=True)), status.strip() if status else None


def _keep(parsed: ParsedOutput, row: dict[str, str]) -> None:
    """The row's engine facts, model and unknown columns into `parsed.extra` (rows that disagree: all, joined)."""
    for column, raw in row.items():
        value = raw.strip()
        if not value or column in _READ:
            continue
        seen = parsed.extra.get(column)
        if seen is None:
            parsed.extra[column] = value
        elif value not in seen.split(","):
            parsed.extra[column] = f"{seen},{value}"


def parse_bench_decode_csv(output: str) -> ParsedOutput:
    """Parse the CSV rows `scripts/bench_decode.sh` prints on stdout (one per model), by column name.

    Returns:
        prompt_tokens, generated_tokens, prefill_seconds, prefill_tok_s, decode_seconds and
        decode_tok_s of every row; in `extra`, the engine's versions and commits the rows report
        (`mlxcel_version`, `mlxcel_commit`, `mlx_commit`, `mlx_rocm_overlay_commit`,
        `hip_version`; `mlx_version`/`commit` of older layouts), `model` and unknown columns.

    Raises:
        OutputSkipped: the script skipped the model (`SKIP:oom_estimate`, `SKIP:oom`, ...).
        OutputParseError: no row, a line that is no such row (a field count no layout has and no
            header), a `FAIL:*` row, or an empty number.
    """
    parsed = ParsedOutput()
    header: tuple[str, ...] | None = None
    rows = 0
    for number, line in enumerate(output.splitlines(), start=1):
        if not line.strip():
            continue
        fields = next(csv.reader([line]))
        if [f.strip() for f in fields[:2]] == ["model", "model_path"]:
            header = tuple(f.strip() for f in fields)
            continue
        row, status = _named(fields, header, number)
        model = row.get("model", "?")
        if status is not None and status.startswith("SKIP:"):
            raise OutputSkipped(f"bench_decode.sh skipped {model}: {status}")
        if status is not None:
            raise OutputParseError(f"bench_decode.sh reported {status} for {model}")
        for column, metric, unit, scale in _METRICS:
            raw = row.get(column, "").strip()
            try:
                value = float(raw)
            except ValueError:
                raise OutputParseError(f"line {number}: {column} {raw!r} is not a number") from None
            parsed.add(metric, value * scale, unit)
        _keep(parsed, row)
        rows += 1
    if rows == 0:
        raise OutputParseError("no bench_decode.sh CSV row in the output")
    return parsed
