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


def test_mlxcel_bench_decode_with_memory_and_decode_path_lines() -> None:
    # newer engines print `[Memory] <phase>:` lines and the decode path around the block: neither is
    # generated text, and the metrics are those of the plain output
    parsed = parse("bench-decode", "mlxcel_bench_decode_paths.txt")
    assert values(parsed) == values(parse("bench-decode", "mlxcel_bench_decode.txt"))
    assert parsed.text is None


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


# bench_decode.sh's layouts, rows copied from the engine's committed CSVs (benchmarks/ in
# lablup/mlxcel): metal_m5max_2026-09-03.csv (17 columns, and its earlier 16-column version),
# rocm_strixhalo-gfx1151_2026-09-30.csv (19), cuda_gb10_2026-07-12.csv (15, `mlxcel_version`
# header) and cuda_v100_2026-08-31.csv (15, no header). No ROCm sweep committed a skipped row: the
# ROCm SKIP row is one of that file's rows as the script writes a skip (numbers empty, the 19
# columns, then SKIP:oom_estimate: 20 fields).


def facts(parsed: ParsedOutput) -> dict[str, str]:
    return dict(parsed.extra)


def test_bench_decode_sh_17_columns_metal_with_and_without_the_header() -> None:
    text = (FIXTURES / "bench_decode_sh_metal17.csv").read_text()
    for output in (text, text.split("\n", 1)[1]):  # the CSV file, and the rows the script prints
        parsed = parser_for("bench-decode-csv")(output)
        got = [(m.metric, m.value) for m in parsed.measurements]
        assert got == [
            ("prompt_tokens", 66.0),
            ("generated_tokens", 40.0),
            ("prefill_seconds", pytest.approx(0.05086)),
            ("prefill_tok_s", 1297.71),
            ("decode_seconds", pytest.approx(0.35437)),
            ("decode_tok_s", 112.88),
            ("prompt_tokens", 8.0),
            ("generated_tokens", 100.0),
            ("prefill_seconds", pytest.approx(0.03508)),
            ("prefill_tok_s", 228.05),
            ("decode_seconds", pytest.approx(0.89626)),
            ("decode_tok_s", 111.57),
        ]
        assert facts(parsed) == {
            "model": "apertus-8b-instruct-2509-4bit,aya-expanse-8b-4bit",
            "mlxcel_version": "0.7.0-beta.1",
            "mlxcel_commit": "b2ff1eee",
            "mlx_commit": "9a795735",
        }


def test_bench_decode_sh_19_columns_rocm() -> None:
    text = (FIXTURES / "bench_decode_sh_rocm19.csv").read_text()
    for output in (text, text.split("\n", 1)[1]):
        parsed = parser_for("bench-decode-csv")(output)
        assert values(parsed) == {
            "prompt_tokens": (512.0, "tokens"),
            "generated_tokens": (128.0, "tokens"),
            "prefill_seconds": (pytest.approx(1.85745), "seconds"),
            "prefill_tok_s": (275.65, "tok/s"),
            "decode_seconds": (pytest.approx(2.07049), "seconds"),
            "decode_tok_s": (61.82, "tok/s"),
        }
        assert facts(parsed) == {
            "model": "Qwen3-30B-A3B-4bit",
            "mlxcel_version": "0.7.0",
            "mlxcel_commit": "2fcdbe5f",
            "mlx_commit": "81ba1c6a",
            "mlx_rocm_overlay_commit": "75915908",
            "hip_version": "7.15.26333",
        }


def test_bench_decode_sh_15_and_16_columns_cuda_and_metal() -> None:
    gb10 = parse("bench-decode-csv", "bench_decode_sh_cuda15.csv")  # header says `mlxcel_version`
    assert values(gb10)["decode_tok_s"] == (28.42, "tok/s") and values(gb10)["prompt_tokens"] == (15.0, "tokens")
    assert facts(gb10) == {"model": "mixtral-8x7b-4bit", "mlxcel_version": "0.4.0-rc.1"}
    v100 = parse("bench-decode-csv", "bench_decode_sh_cuda15_v100.csv")  # no header: the 15-column layout
    assert values(v100)["prefill_seconds"] == (pytest.approx(2.17867), "seconds")
    assert facts(v100) == {"model": "gemma-4-26b-a4b-it-4bit", "mlx_version": "0.6.0"}
    m5 = parse("bench-decode-csv", "bench_decode_sh_metal16.csv")
    assert values(m5)["decode_tok_s"] == (173.19, "tok/s")
    assert facts(m5) == {"model": "gpt-oss-20b-mxfp4", "mlx_version": "0.6.0", "commit": "b2ff1eee"}


def test_bench_decode_sh_status_fields_of_every_layout() -> None:
    with pytest.raises(OutputSkipped, match=r"skipped Mixtral-8x7B-Instruct-v0\.1-4bit: SKIP:oom_estimate$"):
        parse("bench-decode-csv", "bench_decode_sh_rocm19_skip.csv")  # 20 fields
    with pytest.raises(OutputSkipped, match="skipped deepseek-v3-4bit: SKIP:oom_estimate"):
        parse("bench-decode-csv", "bench_decode_sh_metal17_skip.csv")  # 18 fields
    text = (FIXTURES / "bench_decode_sh_metal17_fail.csv").read_text()
    for output in (text, text.split("\n", 1)[1]):
        with pytest.raises(OutputParseError, match=r"reported FAIL:bench for docling-layout-heron-mlx-bf16$") as e:
            parser_for("bench-decode-csv")(output)
        assert not isinstance(e.value, OutputSkipped)


def test_bench_decode_sh_header_names_the_columns_and_unknown_ones_are_kept() -> None:
    # a later version adds a column and moves one: read by name, the extra column kept
    output = (
        "model,model_path,prompt_tokens,generated_tokens,prefill_ms,prefill_tok_s,decode_ms,decode_tok_s,"
        "kv_cache_mode,date,hardware,mlxcel_version,build_type,max_tokens,prompt,prompt_target_len,mlxcel_commit\n"
        'm,p,512,128,100.0,5120.0,2000.0,64.0,int8,2026-10-01,H,0.8.0,release,128,"Hi, there",512,0badc0de\n'
    )
    parsed = parser_for("bench-decode-csv")(output)
    assert values(parsed)["decode_tok_s"] == (64.0, "tok/s") and values(parsed)["prefill_seconds"] == (0.1, "seconds")
    assert facts(parsed) == {
        "model": "m",
        "kv_cache_mode": "int8",
        "mlxcel_version": "0.8.0",
        "mlxcel_commit": "0badc0de",
    }


def test_bench_decode_sh_unknown_layout_is_one_line_naming_the_count() -> None:
    row = (FIXTURES / "bench_decode_sh_rocm19.csv").read_text().splitlines()[1]
    with pytest.raises(OutputParseError) as e:
        parser_for("bench-decode-csv")(row + ",extra1,extra2\n")  # 21 fields, no header
    assert str(e.value) == (
        "line 1: not a bench_decode.sh CSV row (21 fields and no header line; the layouts known are "
        "14, 15, 16, 17, 19 columns, plus a trailing SKIP:/FAIL: field)"
    )
    header = (FIXTURES / "bench_decode_sh_rocm19.csv").read_text().splitlines()[0]
    with pytest.raises(OutputParseError, match=r"^line 2: a bench_decode.sh row of 17 fields under a header of 19"):
        parser_for("bench-decode-csv")(
            header + "\n" + (FIXTURES / "bench_decode_sh_metal17.csv").read_text().split("\n")[1]
        )
