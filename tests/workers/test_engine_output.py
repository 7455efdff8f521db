"""The mlxcel engine's own output formats, as its tools print them (fixtures copied from the formats
in `workers/command/mlxcel.py`): mlxcel-bench-decode, `mlxcel generate`, bench_decode.sh's CSV rows
and mlxcel-bench-engine's `[engine-bench]` lines."""

from __future__ import annotations

from pathlib import Path

import pytest

from workers.command.parsers import OutputParseError, OutputSkipped, ParsedOutput, parser_for

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "bench"


def parse(kind: str | dict[str, object], name: str) -> ParsedOutput:
    return parser_for(kind)((FIXTURES / name).read_text())  # type: ignore[arg-type]


def values(parsed: ParsedOutput) -> dict[str, tuple[float, str]]:
    return {m.metric: (m.value, m.unit) for m in parsed.measurements}


def test_mlxcel_bench_decode_as_printed() -> None:
    parsed = parse("bench-decode", "mlxcel_bench_decode.txt")
    got = values(parsed)
    assert got == {
        "load_seconds": (82.6, "seconds"),
        "load_peak_memory_bytes": (pytest.approx(36.67e9), "bytes"),
        "prompt_tokens": (2048.0, "tokens"),
        "generated_tokens": (32.0, "tokens"),
        "prefill_seconds": (pytest.approx(17.64014), "seconds"),
        "prefill_tok_s": (116.10, "tok/s"),
        "decode_seconds": (pytest.approx(2.46343), "seconds"),
        "decode_tok_s": (12.99, "tok/s"),
        "peak_memory_bytes": (pytest.approx(37.17e9), "bytes"),
    }
    assert parsed.text is None  # the bench prints no generated text


def test_mlxcel_generate_text_and_timing() -> None:
    parsed = parse("mlxcel-generate", "mlxcel_generate.txt")
    assert values(parsed) == {
        "generated_tokens": (19.0, "tokens"),
        "decode_seconds": (1.46, "seconds"),
        "decode_tok_s": (13.01, "tok/s"),
    }
    # what ab_output_equality.sh compares: everything after `Generating...`, trailing blank lines off
    assert parsed.text == "The capital of France is Paris. It is the largest city in France,\nand it sits on the Seine."


def test_mlxcel_generate_profile_gives_the_same_text() -> None:
    plain = parse("mlxcel-generate", "mlxcel_generate.txt")
    profiled = parse("mlxcel-generate", "mlxcel_generate_profile.txt")
    assert profiled.text == plain.text
    assert values(profiled)["prefill_tok_s"] == (116.05, "tok/s")
    # bench-decode reads the same profile block and takes the text after `Generating...` too
    assert parse("bench-decode", "mlxcel_generate_profile.txt").text == plain.text


def test_mlxcel_generate_refuses_truncated_empty_and_reasoning_only_output() -> None:
    text = (FIXTURES / "mlxcel_generate.txt").read_text()
    with pytest.raises(OutputParseError, match="truncated"):
        parser_for("mlxcel-generate")(text.split("[Generated")[0])
    with pytest.raises(OutputParseError, match=r"no 'Generating\.\.\.' line"):
        parser_for("mlxcel-generate")((FIXTURES / "mlxcel_bench_decode.txt").read_text())
    with pytest.raises(OutputParseError, match="generated 0 tokens"):
        parser_for("mlxcel-generate")("Generating...\nhi\n\n[Generated 0 tokens in 0.00s = 0.00 tok/s]\n")
    # the reasoning notice is not generated text: the prompt echo alone is what stays
    assert parse("mlxcel-generate", "mlxcel_generate_reasoning_only.txt").text == "Think about it"


def test_bench_decode_sh_rows() -> None:
    got = values(parse("bench-decode-csv", "bench_decode_sh.csv"))
    assert got == {
        "prompt_tokens": (512.0, "tokens"),
        "generated_tokens": (100.0, "tokens"),
        "prefill_seconds": (pytest.approx(4.3335), "seconds"),
        "prefill_tok_s": (118.15, "tok/s"),
        "decode_seconds": (pytest.approx(7.61035), "seconds"),
        "decode_tok_s": (13.14, "tok/s"),
    }
    old = values(parse("bench-decode-csv", "bench_decode_sh_old.csv"))  # the 14-column schema
    assert old["decode_tok_s"] == (195.15, "tok/s") and old["prompt_tokens"] == (12.0, "tokens")


def test_bench_decode_sh_classifications() -> None:
    with pytest.raises(OutputSkipped, match="skipped Nemotron-Cascade-2-30B-A3B-nvfp4: SKIP:oom_estimate"):
        parse("bench-decode-csv", "bench_decode_sh_skip.csv")
    with pytest.raises(OutputParseError, match="reported FAIL:bench") as failed:
        parse("bench-decode-csv", "bench_decode_sh_fail.csv")
    assert not isinstance(failed.value, OutputSkipped)
    for bad, reason in [
        ("", "no bench_decode.sh CSV row"),
        ("Output: benchmarks/x.csv\n", "not a bench_decode.sh CSV row"),
        ('m,p,512,100,1.0,oops,2.0,3.0,d,h,v,release,100,"x",512\n', "prefill_tok_s 'oops' is not a number"),
    ]:
        with pytest.raises(OutputParseError, match=reason):
            parser_for("bench-decode-csv")(bad)


def test_engine_bench_real_lines_need_a_path_when_both_are_printed() -> None:
    with pytest.raises(OutputParseError, match="several paths \\(cli, server\\)"):
        parse("engine-bench", "engine_bench_two_paths.txt")  # the summary line is skipped, not garbled
    cli = values(parse({"kind": "engine-bench", "select": {"path": "cli"}}, "engine_bench_two_paths.txt"))
    server = values(parse({"kind": "engine-bench", "select": {"path": "server"}}, "engine_bench_two_paths.txt"))
    assert (cli["decode_tok_s"], cli["ttft_ms"]) == ((13.14, "tok/s"), (4333.5, "ms"))
    assert (server["decode_tok_s"], server["prefill_tok_s"]) == ((13.06, "tok/s"), (116.33, "tok/s"))
    assert "server_prompt_eval_ms" not in cli  # null in the cli object
    with pytest.raises(ValueError, match=r"parse\.select"):
        parser_for({"kind": "engine-bench", "select": "cli"})
