"""The command-case output parsers on fixture outputs: good, truncated, garbled and empty."""

from __future__ import annotations

from pathlib import Path

import pytest

from workers.command.parsers import OutputParseError, parse_bench_decode, parse_json_lines, parse_regex, parser_for

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "bench"


def fixture(name: str) -> str:
    return (FIXTURES / name).read_text(encoding="utf-8", errors="replace")


def values(parsed: object) -> dict[str, tuple[float, str]]:
    return {m.metric: (m.value, m.unit) for m in parsed.measurements}  # type: ignore[attr-defined]


def test_bench_decode_block() -> None:
    parsed = parse_bench_decode(fixture("bench_decode_ok.txt"))
    got = values(parsed)
    assert got["load_seconds"] == (82.6, "seconds")
    assert got["load_peak_memory_bytes"] == (pytest.approx(37.17e9), "bytes")
    assert got["prompt_tokens"] == (512.0, "tokens")
    assert got["generated_tokens"] == (128.0, "tokens")
    assert got["prefill_tok_s"] == (118.15, "tok/s")
    assert got["prefill_seconds"] == (pytest.approx(4.3335), "seconds")
    assert got["decode_tok_s"] == (13.14, "tok/s")
    assert got["decode_seconds"] == (pytest.approx(9.7412), "seconds")
    assert got["peak_memory_bytes"] == (pytest.approx(37.17e9), "bytes")
    assert parsed.text == (
        "The capital of France is Paris. It is known for the Eiffel Tower,\nthe Louvre, and its cafés."
    )


def test_bench_decode_binary_units_and_no_load_line() -> None:
    out = "hi\n[Profile Results]\n  Decode: 100 ms (10.0 tok/s)\n  MLX peak memory: 2 GiB\n"
    got = values(parse_bench_decode(out))
    assert got["peak_memory_bytes"] == (2.0 * 2**30, "bytes")
    assert "load_seconds" not in got and "prefill_tok_s" not in got
    assert parse_bench_decode(out).text == "hi"
    logged = "[Load] wall: 1 s\n[Prompt] 512 tokens in 3.2 ms\n[Sampler] greedy\nthe text\n\n" + out.split("\n", 1)[1]
    assert parse_bench_decode(logged).text == "the text"


@pytest.mark.parametrize(
    ("name", "reason"),
    [
        ("bench_decode_truncated.txt", "no 'Prefill"),
        ("bench_decode_garbled.txt", "no 'Prefill"),
        ("empty.txt", "empty output"),
        ("engine_bench_ok.txt", "no [Profile Results]"),
    ],
)
def test_bench_decode_refuses_bad_output(name: str, reason: str) -> None:
    with pytest.raises(OutputParseError, match=reason.replace("[", r"\[")):
        parse_bench_decode(fixture(name))


def test_prefixed_json_lines() -> None:
    parsed = parser_for("engine-bench")(fixture("engine_bench_ok.txt"))
    got = values(parsed)
    assert got == {
        "load_seconds": (12.5, "seconds"),
        "prefill_tok_s": (121.77, "tok/s"),
        "decode_tok_s": (4.92, "tok/s"),
        "peak_memory_bytes": (40440000000.0, "bytes"),
    }
    assert parsed.text == "Paris is the capital."


@pytest.mark.parametrize(
    ("name", "reason"),
    [
        ("engine_bench_truncated.txt", "line 4: not valid JSON"),
        ("engine_bench_garbled.txt", "line 2: not valid JSON"),
        ("empty.txt", "empty output"),
        ("json_lines_ok.txt", r"no '\[engine-bench\]' JSON lines"),
    ],
)
def test_prefixed_json_refuses_bad_output(name: str, reason: str) -> None:
    with pytest.raises(OutputParseError, match=reason):
        parse_json_lines(fixture(name), "[engine-bench]")


def test_plain_json_lines_keep_every_value_in_order() -> None:
    parsed = parser_for("json-lines")(fixture("json_lines_ok.txt"))
    assert [(m.metric, m.value) for m in parsed.measurements] == [
        ("decode_tok_s", 13.2),
        ("prefill_tok_s", 116.1),
        ("decode_tok_s", 13.0),
        ("prefill_tok_s", 115.9),
    ]
    assert parsed.text == "greedy text"
    with pytest.raises(OutputParseError, match="no JSON lines"):
        parse_json_lines("just text\n")
    with pytest.raises(OutputParseError, match="line 1: not valid JSON"):
        parse_json_lines('{"decode_tok_s": 1')
    with pytest.raises(OutputParseError, match="not a finite number"):
        parse_json_lines('{"decode_tok_s": NaN}')


def test_named_regexes() -> None:
    spec = {
        "kind": "regex",
        "patterns": {
            "throughput_tok_s": r"(?P<value>[\d.]+) tokens/sec",
            "latency_ms": r"latency ([\d.]+) ms",
        },
        "text": r"<out>(.*)</out>",
    }
    parsed = parser_for(spec)(fixture("regex_ok.txt"))
    assert [(m.metric, m.value, m.unit) for m in parsed.measurements] == [
        ("throughput_tok_s", 1234.5, "tok/s"),
        ("throughput_tok_s", 1240.0, "tok/s"),
        ("latency_ms", 8.10, "ms"),
        ("latency_ms", 8.06, "ms"),
    ]
    assert parsed.text == "hello world"
    with pytest.raises(OutputParseError, match=r"latency_ms: pattern .* matched nothing"):
        parse_regex("run 1: 5 tokens/sec\n", {"latency_ms": r"latency ([\d.]+) ms"})
    with pytest.raises(OutputParseError, match="not a number"):
        parse_regex("latency abc ms", {"latency_ms": r"latency (\w+) ms"})
    with pytest.raises(OutputParseError, match="empty output"):
        parse_regex(fixture("empty.txt"), {"latency_ms": "x"})


def test_bad_parse_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="unknown parser 'csv'"):
        parser_for("csv")
    with pytest.raises(ValueError, match=r"parse\.patterns\.x: bad regular expression"):
        parser_for({"kind": "regex", "patterns": {"x": "("}})
    with pytest.raises(ValueError, match=r"parse\.prefix"):
        parser_for({"kind": "prefixed-json"})
    with pytest.raises(ValueError, match=r"parse\.kind"):
        parser_for({"kind": "xml"})
