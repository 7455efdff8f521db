"""`orchestrate compare`: the first seed's table rebuilt from stored rows, every format, other
comparison axes, the cross-device share of peak, and the CLI end to end on a real store."""

from __future__ import annotations

import csv
import datetime as dt
import io
import json
import re
import subprocess
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from rich.console import Console

from orchestrator.analysis.compare import CompareResult, compare_results
from orchestrator.analysis.cross_device import CrossDeviceRow, cross_device, over_peak
from orchestrator.analysis.records import RECORD_SCHEMA
from orchestrator.analysis.selection import select_results
from orchestrator.analysis.stats import Verdict
from orchestrator.errors import InputError
from orchestrator.report.cross import write_cross
from orchestrator.report.output import Format
from orchestrator.report.text import (
    case_tables,
    fitted_tables,
    print_comparison,
    write_comparison,
)
from orchestrator.store.fragments import ResultStore
from tests.conftest import child_env
from tests.orchestrator.synthetic_rows import concat, job_table, noisy

# The first seed's measurements (M1 Ultra, gemma-4-31b-it-nvfp4, main 80b4729ad).
SEED1 = {
    # prompt: (affine prefill, native prefill, affine decode, native decode, affine GB, native GB, affine s, native s)
    512: (121.77, 118.15, 4.92, 13.14, 40.44, 37.17, 229.8, 82.6),
    1024: (128.72, 118.66, 5.02, 13.18, 41.61, 37.17, 221.4, 82.0),
    2048: (126.47, 115.29, 4.95, 13.20, 44.83, 37.17, 226.2, 84.1),
    4096: (121.69, 112.20, 4.87, 12.77, 47.76, 37.43, 224.5, 82.8),
    8192: (118.62, 109.79, 4.73, 12.20, 49.11, 37.91, 222.6, 82.7),
    16384: (114.19, 107.45, 4.44, 11.54, 52.60, 39.70, 222.0, 83.4),
}


def render_text(
    result: CompareResult, fmt: str, cross: list[CrossDeviceRow] | None = None, metrics: Sequence[str] | None = None
) -> str:
    """The comparison as `orchestrate compare -f md|csv|json` writes it."""
    buf = io.StringIO()
    write_comparison(result, Format(fmt), buf, cross, metrics)
    return buf.getvalue()


def seed1_table(*, n: int = 9, noise: float = 0.0005, run_id: str = "run1", scale: float = 1.0) -> pa.Table:
    rng = np.random.default_rng(1)
    tables = []
    for prompt, (ap, np_, ad, nd, am, nm, al, nl) in SEED1.items():
        values = {
            "affine": {
                "prefill_tok_s": noisy(rng, ap, noise, n),
                "decode_tok_s": noisy(rng, ad, noise, n),
                "peak_memory_bytes": [am * 1e9],
                "load_seconds": [al],
            },
            "native": {
                "prefill_tok_s": noisy(rng, np_ * scale, noise, n),
                "decode_tok_s": noisy(rng, nd * scale, noise, n),
                "peak_memory_bytes": [nm * 1e9],
                "load_seconds": [nl],
            },
        }
        tables.append(
            job_table(
                values,
                params={"prompt_tokens": prompt, "checkpoint": "models/gemma-4-31b-it-nvfp4"},
                case="command",
                case_name="bench-decode",
                sweep="seed1",
                run_id=run_id,
            )
        )
    return concat(tables)


def md_tables(md: str) -> dict[str, list[list[str]]]:
    """Each Markdown table of a comparison as rows of cells (the header first, no rule), by its case."""
    out: dict[str, list[list[str]]] = {}
    case = ""
    for line in md.splitlines():
        if line.startswith("### "):
            case = line[4:].split(" ")[0].rstrip(",")
        elif line.startswith("|") and not line.startswith("|--") and case:
            out.setdefault(case, []).append([c.strip() for c in line.strip("|").split("|")])
    return out


def test_the_first_seeds_table_is_rebuilt() -> None:
    result = compare_results(seed1_table(), baseline="affine")
    assert result.baseline == "affine" and result.sides == ["affine", "native"]
    assert result.varying == {"bench-decode": ["prompt_tokens"]}  # the checkpoint is the same everywhere
    assert [dict(r.point)["prompt_tokens"] for r in result.rows] == [str(p) for p in SEED1]  # numeric order
    row = result.rows[0]
    assert row.dims == {"device": "cpu"}
    assert row.values[("prefill_tok_s", "affine")].median == pytest.approx(121.77, rel=0.003)
    gap = row.comparisons[("prefill_tok_s", "native")]
    assert gap.ratio.ratio - 1 == pytest.approx(118.15 / 121.77 - 1, abs=0.003)  # -3.0 %
    assert gap.verdict is Verdict.SLOWER and gap.ratio.ci_high < 1
    decode = row.comparisons[("decode_tok_s", "native")]
    assert decode.ratio.ratio == pytest.approx(2.67, abs=0.02) and decode.verdict is Verdict.FASTER
    memory = row.comparisons[("peak_memory_bytes", "native")]
    assert memory.ratio.ratio == pytest.approx(37.17 / 40.44) and memory.verdict is Verdict.FASTER
    assert row.values[("load_seconds", "native")].median == 82.6
    # Each side's samples come ordered by sample, with the job and run they belong to (pairs can be formed).
    group = row.samples[("prefill_tok_s", "native")]
    assert list(group.samples) == list(range(9)) and set(group.run_ids) == {"run1"} and len(set(group.job_keys)) == 1

    md = render_text(result, "md")
    assert md.startswith("### bench-decode on cpu, baseline affine; checkpoint=models/gemma-4-31b-it-nvfp4\n")
    table = md_tables(md)["bench-decode"]
    # The seed's columns, in its order (peak and load per arm, without a ratio column, as the seed has).
    assert table[0] == [
        "prompt_tokens", "affine prefill tok/s", "native prefill tok/s", "native prefill gap",
        "affine decode tok/s", "native decode tok/s", "native decode speedup", "affine peak memory",
        "native peak memory", "affine load time", "native load time",
    ]  # fmt: skip
    cells = next(r for r in table[1:] if r[0] == "512")
    assert re.fullmatch(r"-3\.0% \[-3\.\d,-[23]\.\d\] SLOWER", cells[3]), cells[3]
    assert re.fullmatch(r"2\.67x \[2\.6\d,2\.[67]\d\] FASTER", cells[6]), cells[6]
    assert cells[1:3] == ["121.8", "118.1"] and cells[4:6] == ["4.920", "13.14"]
    assert cells[7:] == ["40.44 GB", "37.17 GB", "229.8 s", "82.60 s"]
    cells_2048 = next(r for r in table[1:] if r[0] == "2048")
    # the median per-pair ratio: the seed's -8.8 % within noise
    assert re.match(r"-8\.[89]% \[", cells_2048[3]), cells_2048
    assert "] AMBIGUOUS" not in md and "(1)" not in md  # 9 samples at 0.05 % noise settle every gap


def test_csv_and_json_are_tidy_records_with_one_schema() -> None:
    """One record per point, arm and metric, every column typed and documented, the same for every case."""
    result = compare_results(seed1_table(), baseline="affine")
    rows = list(csv.DictReader(io.StringIO(render_text(result, "csv"))))
    assert list(rows[0]) == RECORD_SCHEMA.names  # a stable header, whatever the cases
    assert len(rows) == 6 * 2 * 4  # points x arms x metrics
    first = next(
        r for r in rows if r["prompt_tokens"] == "512" and r["arm"] == "affine" and r["metric"] == "prefill_tok_s"
    )
    assert first["device"] == "cpu" and first["side"] == "affine" and first["baseline"] == "affine"
    assert float(first["value"]) == pytest.approx(121.77, rel=0.003) and first["unit"] == "tok/s"
    assert float(first["ci_low"]) < float(first["value"]) < float(first["ci_high"])
    assert first["n_samples"] == "9" and first["ratio"] == "" and first["verdict"] == ""  # the baseline: no ratio
    assert first["run_id"] == "run1" and first["code_version"] == "abc123"

    doc = json.loads(render_text(result, "json"))
    assert isinstance(doc, list) and len(doc) == 48 and set(doc[0]) == set(RECORD_SCHEMA.names)
    gap = next(
        r for r in doc if r["prompt_tokens"] == 16384 and r["arm"] == "native" and r["metric"] == "prefill_tok_s"
    )
    assert gap["ratio"] == pytest.approx(107.45 / 114.19, abs=0.004) and gap["verdict"] == "SLOWER"
    assert json.loads(gap["params"]) == {"checkpoint": "models/gemma-4-31b-it-nvfp4", "prompt_tokens": 16384}
    load = next(r for r in doc if r["arm"] == "affine" and r["metric"] == "load_seconds")
    assert load["cv"] is None and load["unit"] == "seconds"  # one sample: no spread, written as null
    memory = [r for r in doc if r["metric"] == "peak_memory_bytes" and r["arm"] == "native"]
    assert {r["verdict"] for r in memory} == {"LOWER"}  # never FASTER for a memory


def test_compare_two_runs_and_two_devices() -> None:
    old = seed1_table(run_id="before")
    new = seed1_table(run_id="after", scale=1.06)  # native 6 % faster after the fix
    result = compare_results(concat([old, new]), by="run", baseline="before")
    assert result.sides == ["before", "after"]
    native = [r for r in result.rows if r.dims["arm"] == "native"]
    assert len(native) == 6
    assert all(r.comparisons[("prefill_tok_s", "after")].verdict is Verdict.FASTER for r in native)
    affine = [r for r in result.rows if r.dims["arm"] == "affine"]
    assert all(r.comparisons[("prefill_tok_s", "after")].verdict is Verdict.SAME for r in affine)

    gpu = concat([seed1_table()]).to_pylist()
    for row in gpu:
        row["device"] = "m1-ultra"
    both = concat([seed1_table(), pa.Table.from_pylist(gpu, schema=seed1_table().schema)])
    by_device = compare_results(both, by="device", baseline="cpu")
    assert {tuple(r.dims.items()) for r in by_device.rows} == {(("arm", "affine"),), (("arm", "native"),)}
    assert by_device.rows[0].comparisons[("prefill_tok_s", "m1-ultra")].verdict is Verdict.SAME


def test_cross_device_puts_each_value_beside_its_own_peak() -> None:
    rng = np.random.default_rng(5)
    point = {"tokens": 4096, "n": 256, "k": 256}
    cpu = job_table({"native": {"gb_per_s": noisy(rng, 3.0, 0.01, 5)}}, params=point, peaks=(12.0, 0.05))
    h200 = job_table(
        {"native": {"gb_per_s": noisy(rng, 2400.0, 0.01, 5)}}, params=point, device="h200", peaks=(4000.0, 700.0)
    )
    (row,) = cross_device(concat([cpu, h200]))
    assert row.cells["cpu"].fraction == pytest.approx(0.25, rel=0.02)
    assert row.cells["h200"].fraction == pytest.approx(0.60, rel=0.02)
    assert row.cells["h200"].peak == 4000.0
    assert over_peak([row]) == []


def test_a_rate_above_the_probed_peak_raises_the_peak_and_is_named() -> None:
    """A dense GEMM measured 771 TFLOP/s on a device whose probe read 768: the device's peak
    becomes the best median measured there (it demonstrably does that much), every share of that
    device is of it (none above 100 %), and the view names the rows that beat the probe. Another
    device, whose probe nothing beat, keeps its probe."""
    rng = np.random.default_rng(6)
    point = {"tokens": 4096}
    h100 = job_table(
        {
            "dense": {"tflop_per_s": noisy(rng, 771.0, 0.002, 7)},
            "affine": {"tflop_per_s": noisy(rng, 769.0, 0.002, 7)},
            "native": {"tflop_per_s": noisy(rng, 384.0, 0.002, 7)},
        },
        params=point,
        device="h100",
        peaks=(3300.0, 768.0),
    )
    h200 = job_table(
        {"dense": {"tflop_per_s": noisy(rng, 700.0, 0.002, 7)}}, params=point, device="h200", peaks=(4000.0, 790.0)
    )
    rows = cross_device(concat([h100, h200]))
    cells = {r.arm: r.cells for r in rows}
    best = cells["dense"]["h100"].summary.median
    assert best == pytest.approx(771.0, rel=0.003)
    for arm in ("dense", "affine", "native"):
        cell = cells[arm]["h100"]
        assert (cell.peak, cell.probed) == (best, 768.0)
        assert cell.fraction == pytest.approx(cell.summary.median / best) and cell.fraction <= 1.0
    assert cells["native"]["h100"].fraction == pytest.approx(384.0 / 771.0, rel=0.005)
    assert [arm for arm in cells if cells[arm]["h100"].beat_probe] == ["affine", "dense"]
    assert (cells["dense"]["h200"].peak, cells["dense"]["h200"].probed) == (790.0, None)
    (warning,) = over_peak(rows)
    assert warning.startswith(
        "warning: h100 tflop_per_s: 2 rows beat the device's probed peak (768), so its shares are of the best "
        f"median measured there ({best:.4g}): qmm tokens=4096 dense {best:.4g}; qmm tokens=4096 affine"
    )
    assert "ORCHESTRATE_REPROBE_PEAKS=1" in warning
    md, js = io.StringIO(), io.StringIO()
    write_cross(rows, Format.md, md)
    write_cross(rows, Format.json, js)
    assert warning in md.getvalue()
    records = {(r["arm"], r["device"]): r for r in json.loads(js.getvalue())}
    assert records[("dense", "h100")]["over_peak"] is True and records[("native", "h100")]["over_peak"] is False
    assert records[("native", "h100")]["peak"] == best


def test_unknown_baseline_and_empty_data_are_input_errors(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="baseline 'dense'"):
        compare_results(seed1_table(), baseline="dense")
    with pytest.raises(InputError, match="no results stored"):
        select_results(ResultStore(tmp_path / "empty"), None, None)


def store_rows(root: Path, table: pa.Table) -> None:
    store = ResultStore(root)
    for i, key in enumerate(sorted(set(table["job_key"].to_pylist()))):
        part = table.filter(pa.compute.equal(table["job_key"], key))
        store.write(part, sweep="seed1", date=dt.date(2026, 11, 30), device="cpu", run_id="run1", job_key=f"j{i}")


SWEEP_TOML = """
name = "seed1"
baseline = "affine"

[[cases]]
case = "command"
name = "bench-decode"
repo = "../mlxcel"
build = "cargo build --release --bin mlxcel-bench-decode"
run = "./scripts/bench_decode.sh {checkpoint} --prompt-tokens {prompt_tokens}"
parse = "bench-decode"
params = { prompt_tokens = [512, 1024, 2048, 4096, 8192, 16384], checkpoint = "models/gemma-4-31b-it-nvfp4" }
arms = { native = {}, affine = { env = { MLXCEL_NVFP4_DENSE_REPACK = "1" } } }

[[criteria]]
name = "native prefill within 3 % of affine where prompt_tokens >= 4096"
metric = "prefill_tok_s"
arm = "native"
where = "prompt_tokens >= 4096"
min_ratio = 0.97

[[criteria]]
name = "native decode at least 2x affine"
metric = "decode_tok_s"
arm = "native"
min_ratio = 2.0

[[criteria]]
name = "native peak memory below affine"
metric = "peak_memory_bytes"
arm = "native"
max_ratio = 1.0
"""


@pytest.mark.parametrize(("scale", "code"), [(1.0, 1), (1.08, 0)])
def test_cli_compare_and_check_on_a_real_store(tmp_path: Path, orchestrate_bin: str, scale: float, code: int) -> None:
    """Seed 1 as measured fails its prefill criterion (exit 1); 8 % faster native prefill passes."""
    root = tmp_path / "results"
    store_rows(root, seed1_table(scale=scale))
    sweep = tmp_path / "seed1.toml"
    sweep.write_text(SWEEP_TOML)
    env = child_env()
    out = subprocess.run(
        [orchestrate_bin, "compare", "--results", str(root), "--format", "csv"],
        capture_output=True, text=True, env=env, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    rows = list(csv.DictReader(io.StringIO(out.stdout)))
    native = [r for r in rows if r["arm"] == "native" and r["metric"] == "prefill_tok_s"]
    assert [r["prompt_tokens"] for r in native] == [str(p) for p in SEED1]
    check = subprocess.run(
        [orchestrate_bin, "check", "--sweep", str(sweep), "--results", str(root)],
        capture_output=True, text=True, env=env, timeout=120,
    )  # fmt: skip
    assert check.returncode == code, check.stdout + check.stderr
    first = check.stdout.splitlines()[0]
    assert first.startswith("FAIL" if code else "PASS")
    assert "native decode at least 2x affine" in check.stdout
    records = subprocess.run(
        [orchestrate_bin, "check", "--sweep", str(sweep), "--results", str(root), "-f", "json"],
        capture_output=True, text=True, env=env, timeout=120,
    )  # fmt: skip
    assert records.returncode == code
    verdicts = json.loads(records.stdout)
    prefill = [r for r in verdicts if r["metric"] == "prefill_tok_s"]
    assert {json.loads(r["params"])["prompt_tokens"] for r in prefill} == {4096, 8192, 16384}  # where >= 4096
    assert {r["outcome"] for r in prefill} == {"FAIL" if code else "PASS"} and all(
        r["min_ratio"] == 0.97 for r in prefill
    )
    assert all(r["ratio_ci_low"] <= r["ratio"] <= r["ratio_ci_high"] for r in verdicts)


def test_cli_errors_are_one_line(tmp_path: Path, orchestrate_bin: str) -> None:
    out = subprocess.run(
        [orchestrate_bin, "compare", "--results", str(tmp_path / "nothing")],
        capture_output=True, text=True, env=child_env(), timeout=120,
    )  # fmt: skip
    assert out.returncode == 2
    assert out.stderr.strip().count("\n") == 0 and "no results stored" in out.stderr


def test_each_case_has_its_own_arms_and_baseline() -> None:
    """The smoke sweep's shape: qmm (native, affine) and moe-gather (*-sorted), baseline `affine`."""
    rng = np.random.default_rng(2)
    qmm = job_table(
        {"native": {"seconds": noisy(rng, 1.0, 0.01, 6)}, "affine": {"seconds": noisy(rng, 1.2, 0.01, 6)}},
        params={"tokens": 32, "n": 64, "k": 64},
    )
    moe = job_table(
        {
            "native-sorted": {"seconds": noisy(rng, 2.0, 0.01, 6)},
            "affine-sorted": {"seconds": noisy(rng, 3.0, 0.01, 6)},
        },
        params={"experts": 8, "top_k": 2, "tokens": 32},
        case="moe-gather",
    )
    result = compare_results(concat([qmm, moe]), baseline="affine")
    assert result.sides_of("qmm") == ["affine", "native"]
    assert result.sides_of("moe-gather") == ["affine-sorted", "native-sorted"]
    assert result.baseline_of("moe-gather") == "affine-sorted"
    moe_row = next(r for r in result.rows if r.case_name == "moe-gather")
    c = moe_row.comparisons[("seconds", "native-sorted")]
    assert c.ratio.ratio == pytest.approx(2 / 3, rel=0.02) and c.verdict is Verdict.FASTER
    md = render_text(result, "md")
    # A case measuring none of the seeds' metrics shows its time, with the ratio to its own baseline.
    assert "### moe-gather on cpu, baseline affine-sorted; experts=8 top_k=2" in md
    tables = md_tables(md)
    assert tables["moe-gather"][0] == ["tokens", "affine-sorted time", "native-sorted time", "native-sorted time ratio"]
    assert tables["qmm"][0] == ["tokens", "affine time", "native time", "native time ratio"]
    assert re.fullmatch(r"0\.6\dx \[0\.6\d,0\.\d\d\] FASTER", tables["moe-gather"][1][3])


def test_cli_cross_device_view_and_commit_comparison(tmp_path: Path, orchestrate_bin: str) -> None:
    rng = np.random.default_rng(6)
    point = {"tokens": 512, "n": 64, "k": 64}
    tables = []
    for device, peak, rate in (("cpu", 10.0, 2.0), ("h200", 4000.0, 2400.0)):
        for commit, f in (("aaa111", 1.0), ("bbb222", 1.1)):
            tables.append(
                job_table(
                    {"native": {"gb_per_s": noisy(rng, rate * f, 0.005, 6)}},
                    params=point,
                    device=device,
                    peaks=(peak, 1.0),
                    run_id=f"run-{commit}",
                    code_version=commit,
                )
            )
    table = concat(tables)
    root = tmp_path / "results"
    store = ResultStore(root)
    for i, key in enumerate(sorted(set(table["job_key"].to_pylist()))):
        part = table.filter(pa.compute.equal(table["job_key"], key))
        dev, run = part["device"][0].as_py(), part["run_id"][0].as_py()
        store.write(part, sweep="seed1", date=dt.date(2026, 11, 30), device=dev, run_id=run, job_key=f"j{i}")
    env = child_env()
    view = subprocess.run(
        [orchestrate_bin, "compare", "-r", str(root), "--view", "devices", "--format", "json"],
        capture_output=True, text=True, env=env, timeout=120,
    )  # fmt: skip
    assert view.returncode == 0, view.stderr
    recs = {r["device"]: r for r in json.loads(view.stdout)}
    # The newest run per point (bbb222, 10 % faster) is what counts by default.
    assert recs["cpu"]["fraction_of_peak"] == pytest.approx(0.22, rel=0.02)
    assert recs["h200"]["fraction_of_peak"] == pytest.approx(0.66, rel=0.02)
    by_commit = subprocess.run(
        [orchestrate_bin, "compare", "-r", str(root), "--by", "commit", "--baseline", "aaa111", "--format", "json"],
        capture_output=True, text=True, env=env, timeout=120,
    )  # fmt: skip
    assert by_commit.returncode == 0, by_commit.stderr
    rows = [r for r in json.loads(by_commit.stdout) if r["metric"] == "gb_per_s" and r["side"] == "bbb222"]
    assert {r["device"] for r in rows} == {"cpu", "h200"}
    assert all(r["baseline"] == "aaa111" and r["code_version"] == "bbb222" for r in rows)
    assert all(r["verdict"] == "FASTER" and r["ratio"] == pytest.approx(1.1, rel=0.02) for r in rows)


# ------------------------------------------------------------------------ the readable table

KERNEL_ARMS = {"native": 0.5, "affine": 1.0, "dequant-gemm": 1.25, "dense": 1.01}  # time relative to affine


def kernel_table(devices: tuple[str, ...] = ("cpu",), *, n: int = 5) -> pa.Table:
    """A qmm-like kernel case as the worker writes it: four arms, every kernel metric, tokens 1..16384.

    Tokens 1 measures decode tok/s, longer prompts prefill tok/s; `dense` is within the noise of
    `affine` (5 %, 5 samples), so its verdicts are AMBIGUOUS and need more samples.
    """
    rng = np.random.default_rng(11)
    tables = []
    for device in devices:
        for tokens in (1, 512, 4096, 16384):
            values: dict[str, dict[str, list[float]]] = {}
            for arm, rel in KERNEL_ARMS.items():
                seconds = noisy(rng, 1e-3 * tokens**0.5 * rel, 0.05, n)
                rate = "decode_tok_s" if tokens == 1 else "prefill_tok_s"
                values[arm] = {
                    "seconds": seconds,
                    rate: [tokens / s for s in seconds],
                    "gb_per_s": [0.1 / s for s in seconds],
                    "tflop_per_s": [2e-3 / s for s in seconds],
                    "rel_error": [1e-7 * (1 + rel)],
                    "peak_memory_bytes": [2e6 * (2 if arm == "dequant-gemm" else 1)],
                    "build_seconds": [0.5],
                }
            params = {"tokens": tokens, "n": 256, "k": 512, "dtype": "float32"}
            tables.append(job_table(values, params=params, device=device, peaks=(400.0, 8.0), sweep="seed1"))
    return concat(tables)


def test_model_and_kernel_cases_show_the_seeds_metrics_they_measure() -> None:
    """The seed's command case shows prefill, decode, peak and load; a kernel case shows what it
    measures of them (no load time), never its time, bandwidth, FLOP rate, error or build time."""
    result = compare_results(concat([seed1_table(), kernel_table()]), baseline="affine")
    tables = md_tables(render_text(result, "md"))
    model_head, kernel_head = tables["bench-decode"][0], tables["qmm"][0]
    assert model_head[1:] == [
        "affine prefill tok/s", "native prefill tok/s", "native prefill gap",
        "affine decode tok/s", "native decode tok/s", "native decode speedup",
        "affine peak memory", "native peak memory", "affine load time", "native load time",
    ]  # fmt: skip
    arms = ["affine", "native", "dequant-gemm", "dense"]  # the baseline, then the order they were measured in
    assert kernel_head == [
        "tokens",
        *[f"{a} prefill tok/s" for a in arms], *[f"{a} prefill gap" for a in arms[1:]],
        *[f"{a} decode tok/s" for a in arms], *[f"{a} decode speedup" for a in arms[1:]],
        *[f"{a} peak memory" for a in arms],
    ]  # fmt: skip
    assert not any(word in " ".join(kernel_head) for word in ("load", "time", "GB/s", "TFLOP/s", "error"))
    by_tokens = {row[0]: row for row in tables["qmm"][1:]}
    assert list(by_tokens) == ["1", "512", "4096", "16384"]
    col = kernel_head.index
    # Tokens 1 is a decode point: its prefill cells are empty, its decode speedup is native's 2x.
    assert by_tokens["1"][1:8] == ["-"] * 7
    speedup = by_tokens["1"][col("native decode speedup")]
    assert re.fullmatch(r"[12]\.\d\dx \[\d\.\d\d,\d\.\d\d\] FASTER", speedup), speedup
    gap = by_tokens["512"][col("native prefill gap")]
    assert re.fullmatch(r"\+\d+\.\d% \[\+\d+\.\d,\+\d+\.\d\] FASTER", gap), gap
    gap = by_tokens["4096"][col("dequant-gemm prefill gap")]
    assert re.fullmatch(r"-2\d\.\d% \[-\d+\.\d,-\d+\.\d\] SLOWER", gap), gap
    assert by_tokens["512"][-4:] == ["2.000 MB", "2.000 MB", "4.000 MB", "2.000 MB"]


def test_an_ambiguous_verdict_is_short_and_its_samples_go_to_a_footnote() -> None:
    result = compare_results(kernel_table(), baseline="affine")
    md = render_text(result, "md")
    head, *rows = md_tables(md)["qmm"]
    dense_gaps = [row[head.index("dense prefill gap")] for row in rows[1:]]  # tokens 512..16384
    assert any("AMBIGUOUS" in cell for cell in dense_gaps)
    notes = re.findall(r"^\((\d+)\) (.*?)  $", md, re.M)
    assert notes, md
    for cell in dense_gaps:
        if "AMBIGUOUS" in cell:
            match = re.fullmatch(r"[+-]\d+\.\d% \[[+-]\d+\.\d,[+-]\d+\.\d\] AMBIGUOUS \((\d+)\)", cell)
            assert match, cell
            number, text = notes[int(match[1]) - 1]
            assert number == match[1] and "dense vs affine prefill tok/s: " in text
            assert re.search(r"about \d+ more samples per side would settle it$", text) or re.search(
                r"the estimate \([+-]\d+\.\d%, ±\d+\.\d%\) sits on the band's edge", text
            ), text
    assert "more samples" not in "".join(cell for row in rows for cell in row)
    # CSV keeps every field: the verdict and the samples it needs, per comparison.
    records = list(csv.DictReader(io.StringIO(render_text(result, "csv"))))
    dense = [r for r in records if r["side"] == "dense" and r["metric"] == "prefill_tok_s"]
    ambiguous = [r for r in dense if r["verdict"] == "AMBIGUOUS"]
    assert ambiguous and all(int(r["more_samples"] or 0) > 0 or "edge" in r["note"] for r in ambiguous)
    native = {r["metric"] for r in records if r["side"] == "native" and r["ratio"]}
    assert {"gb_per_s", "rel_error", "tflop_per_s", "seconds"} <= native


def test_metrics_and_arms_are_chosen() -> None:
    result = compare_results(kernel_table(), arms=["native", "affine"], metrics=["seconds", "gb_per_s", "rel_error"])
    assert result.sides == ["affine", "native"] and result.metrics == ["seconds", "gb_per_s", "rel_error"]
    (table,) = md_tables(render_text(result, "md", metrics=result.metrics)).values()
    assert table[0] == [
        "tokens", "affine time", "native time", "native time ratio",
        "affine GB/s", "native GB/s", "native GB/s ratio", "affine rel. error", "native rel. error",
    ]  # fmt: skip
    assert all(re.fullmatch(r"0\.\d\dx \[0\.\d\d,0\.\d\d\] FASTER", row[3]) for row in table[1:])
    assert all(re.fullmatch(r"[12]\.\d\dx \[\S+\] FASTER", row[6]) for row in table[1:])
    assert all(re.fullmatch(r"\d\.\de-\d\d", row[7]) for row in table[1:])  # errors in scientific notation
    # Without the sweep's baseline, the first named arm is it.
    alone = compare_results(kernel_table(), arms=["native", "dense"])
    assert alone.sides == ["native", "dense"] and alone.baseline == "native"
    with pytest.raises(InputError, match=r"--arms fast: no clean rows of it \(there are: affine, dense"):
        compare_results(kernel_table(), arms=["fast"])
    with pytest.raises(InputError, match="--metric joules"):
        compare_results(kernel_table(), metrics=["joules"])


def test_sides_follow_the_sweeps_order_and_only_changed_hides_same() -> None:
    table = kernel_table()
    assert compare_results(table).sides == ["affine", "native", "dequant-gemm", "dense"]  # as measured
    ordered = compare_results(table, order=["dense", "dequant-gemm", "native", "affine"], baseline="affine")
    assert ordered.sides == ["affine", "dense", "dequant-gemm", "native"]  # the baseline first, then the sweep's
    same = compare_results(concat([seed1_table(), seed1_table(run_id="run2")]), by="run", baseline="run1")
    # one load per run and point: too few to judge (issue 14); every other change is SAME
    verdicts = {(m, c.verdict) for r in same.rows for (m, _), c in r.comparisons.items()}
    assert {v for m, v in verdicts if m != "load_seconds"} == {Verdict.SAME}
    assert {v for m, v in verdicts if m == "load_seconds"} == {Verdict.TOO_FEW}
    buf = io.StringIO()
    print_comparison(Console(file=buf, width=120, force_terminal=False), same, only_changed=True)
    assert "nothing changed beyond the 3% threshold" in buf.getvalue()
    assert "121.8" not in buf.getvalue()
    buf = io.StringIO()
    write_comparison(same, Format.json, buf, only_changed=True)
    kept = json.loads(buf.getvalue())
    # the baseline's values, and the loads too few to judge: every change was SAME
    assert kept and {r["side"] for r in kept if r["verdict"] != "TOO FEW"} == {"run1"}
    assert {r["metric"] for r in kept if r["side"] == "run2"} == {"load_seconds"}


def write_store(root: Path, table: pa.Table) -> None:
    store = ResultStore(root)
    for i, key in enumerate(sorted(set(table["job_key"].to_pylist()))):
        part = table.filter(pa.compute.equal(table["job_key"], key))
        store.write(
            part, sweep="seed1", date=dt.date(2026, 11, 30), device=part["device"][0].as_py(), run_id="run1",
            job_key=f"j{i}",
        )  # fmt: skip


def in_order(line: str, cells: list[str]) -> bool:
    """Every cell appears in the line, in order."""
    at = 0
    for cell in cells:
        at = line.find(cell, at)
        if at < 0:
            return False
        at += len(cell)
    return True


def row_lines(lines: list[str], tables: list) -> None:
    """Every data row of the tables is exactly one of the lines, with all its cells in order."""
    for t in tables:
        for cells in t.plain_rows():
            cells = [c for c in cells if c]
            assert sum(in_order(line, cells) for line in lines) == 1, (cells, "\n".join(lines))


def test_cli_table_fits_the_terminal_and_wide_shows_everything(tmp_path: Path, orchestrate_bin: str) -> None:
    """At COLUMNS=120 (a pipe honours it too) no line is wider and no row is folded -- the seed's case
    and a four-arm kernel case on two devices; `--wide` prints the full tables at their own width."""
    table = concat([seed1_table(), kernel_table(("cpu", "h200"))])
    root = tmp_path / "results"
    write_store(root, table)
    result = compare_results(table, baseline="affine")
    for columns in ("120", "90"):
        out = subprocess.run(
            [orchestrate_bin, "compare", "-r", str(root)],
            capture_output=True, text=True, env=child_env(COLUMNS=columns), timeout=120,
        )  # fmt: skip
        assert out.returncode == 0, out.stderr
        lines = out.stdout.splitlines()
        assert max(len(line) for line in lines) <= int(columns), out.stdout
        row_lines(lines, fitted_tables(Console(width=int(columns)), result))
        assert "Intervals left out to fit the terminal" in out.stdout
        # Two devices: the share-of-peak view follows the arms' table.
        assert "across devices: share of each device's measured peak" in out.stdout
    wide = subprocess.run(
        [orchestrate_bin, "compare", "-r", str(root), "--wide"],
        capture_output=True, text=True, env=child_env(COLUMNS="80"), timeout=120,
    )  # fmt: skip
    assert wide.returncode == 0, wide.stderr
    lines = wide.stdout.splitlines()
    assert max(len(line) for line in lines) > 200  # the kernel table at its natural width, not folded
    row_lines(lines, case_tables(result))
    assert re.search(r"qmm .* native +GB/s +\d+\.\d+ GB/s \(\d+% of 400\.0 GB/s\)", wide.stdout)


def test_verdicts_are_coloured_on_a_terminal_only() -> None:
    result = compare_results(seed1_table(), baseline="affine")
    colour = io.StringIO()
    print_comparison(Console(file=colour, width=200, force_terminal=True, color_system="standard"), result)
    assert "\x1b[1;31m-3.0%" in colour.getvalue()  # SLOWER in bold red
    assert "\x1b[1;32m2.67x" in colour.getvalue()  # FASTER in bold green
    plain = io.StringIO()
    print_comparison(Console(file=plain, width=200, force_terminal=False), result)
    assert "\x1b[" not in plain.getvalue()


def test_a_narrow_console_gets_a_narrower_layout_not_folded_rows() -> None:
    result = compare_results(kernel_table(), baseline="affine")
    for width in (120, 80, 60):
        buf = io.StringIO()
        out = Console(file=buf, width=width, force_terminal=False, highlight=False)
        print_comparison(out, result)
        tables = fitted_tables(out, result)
        table_lines = [line for line in buf.getvalue().splitlines() if "  " in line]
        row_lines(table_lines, tables)
        assert all(len(line) <= width for line in table_lines), buf.getvalue()
    assert "across devices" not in buf.getvalue()  # one device: no cross-device view unless asked
    assert render_text(result, "md").count("across devices") == 0


def test_a_point_without_clean_samples_is_named_not_silently_dropped() -> None:
    contended = job_table(
        {arm: {"prefill_tok_s": [1.0, 2.0]} for arm in KERNEL_ARMS},
        params={"tokens": 2048, "n": 256, "k": 512, "dtype": "float32"},
        contended=True,
        sweep="seed1",
    )
    result = compare_results(concat([kernel_table(), contended]), baseline="affine")
    assert result.left_out == ["qmm cpu tokens=2048: contended"]
    assert "2048" not in [r.point[-1][1] for r in result.rows]
    assert "Left out, no clean sample: qmm cpu tokens=2048: contended." in render_text(result, "md")
    assert not any(
        r["prompt_tokens"] == 2048 or '"tokens": 2048' in r["params"] for r in json.loads(render_text(result, "json"))
    )


def test_cli_arms_without_the_sweeps_baseline(tmp_path: Path, orchestrate_bin: str) -> None:
    root = tmp_path / "results"
    write_store(root, kernel_table())
    out = subprocess.run(
        [orchestrate_bin, "compare", "-r", str(root), "--arms", "native,dense", "-m", "seconds", "-f", "md"],
        capture_output=True, text=True, env=child_env(), timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    (table,) = md_tables(out.stdout).values()
    assert "### qmm on cpu, baseline native; dtype=float32 k=512 n=256" in out.stdout
    assert table[0] == ["tokens", "native time", "dense time", "dense time ratio"]
    assert all(re.fullmatch(r"[12]\.\d\dx \[\S+\] SLOWER", row[3]) for row in table[1:]), table
    bad = subprocess.run(
        [orchestrate_bin, "compare", "-r", str(root), "--arms", "native,fast"],
        capture_output=True, text=True, env=child_env(), timeout=120,
    )  # fmt: skip
    assert bad.returncode == 2 and "--arms fast: no clean rows of it" in bad.stderr


def test_results_and_compare_agree_on_which_run_counts(tmp_path: Path, orchestrate_bin: str) -> None:
    """A point measured again: `results`, like `compare`, shows the newest run (the older one's
    samples are not pooled in); `--all-runs` pools both, and the title says which."""
    root = tmp_path / "results"
    old = job_table({"native": {"seconds": [1.0] * 5}, "affine": {"seconds": [1.0] * 5}}, params={"tokens": 1},
                    run_id="run-old", started_at=dt.datetime(2026, 11, 1, tzinfo=dt.UTC))  # fmt: skip
    new = job_table({"native": {"seconds": [2.0] * 5}, "affine": {"seconds": [1.0] * 5}}, params={"tokens": 1},
                    run_id="run-new", started_at=dt.datetime(2026, 11, 2, tzinfo=dt.UTC))  # fmt: skip
    store_rows(root, concat([old, new]))
    env = child_env()

    def cli(*args: str) -> str:
        out = subprocess.run([orchestrate_bin, *args, "--results", str(root)], capture_output=True, text=True,
                             env=env, timeout=120)  # fmt: skip
        assert out.returncode == 0, out.stderr
        return out.stdout

    newest = cli("results", "--baseline", "affine")
    # native's median over affine's in seconds: 2.0 (newest) -> 2.000x; pooled, median 1.5 -> 1.500x
    assert "each point's newest run" in newest and "2.000x affine" in newest and "1.500x" not in newest
    pooled = cli("results", "--baseline", "affine", "--all-runs")
    assert "every run pooled" in pooled and "1.500x affine" in pooled
    compared = json.loads(cli("compare", "--format", "json", "--metric", "seconds"))
    assert next(r for r in compared if r["side"] == "native")["value"] == 2.0


def test_cli_two_chosen_runs_and_nothing_to_compare(tmp_path: Path, orchestrate_bin: str) -> None:
    """`--by run` with one run says there is nothing to compare (exit 2); `--baseline R --contender R`
    (unique prefixes) compares exactly those two of three runs; `--output` writes the file, not stdout."""
    root = tmp_path / "results"
    store = ResultStore(root)
    day = dt.date(2026, 11, 30)
    for i, (run, scale) in enumerate((("20261130T010000Z-aaaa", 1.0), ("20261201T010000Z-bbbb", 1.0))):
        for j, key in enumerate(sorted(set(seed1_table()["job_key"].to_pylist()))):
            t = seed1_table(run_id=run, scale=scale)
            part = t.filter(pa.compute.equal(t["job_key"], key.replace("run1", run)))
            store.write(
                part, sweep="seed1", date=day + dt.timedelta(days=i), device="cpu", run_id=run, job_key=f"{i}{j:015x}"
            )
        if i == 0:
            one = subprocess.run(
                [orchestrate_bin, "compare", "-r", str(root), "--by", "run"],
                capture_output=True, text=True, env=child_env(), timeout=120,
            )  # fmt: skip
            assert one.returncode == 2, one.stdout
            assert "only one run in the selected rows (20261130T010000Z-aaaa): nothing to compare" in one.stderr
    third = seed1_table(run_id="20261202T010000Z-cccc", scale=1.10)
    for j, key in enumerate(sorted(set(third["job_key"].to_pylist()))):
        part = third.filter(pa.compute.equal(third["job_key"], key))
        store.write(
            part,
            sweep="seed1",
            date=day + dt.timedelta(days=2),
            device="cpu",
            run_id="20261202T010000Z-cccc",
            job_key=f"2{j:015x}",
        )
    path = tmp_path / "out" / "cmp.json"
    path.parent.mkdir()
    two = subprocess.run(
        [orchestrate_bin, "compare", "-r", str(root), "--by", "run", "-b", "20261130", "--contender", "20261202",
         "-f", "json", "-o", str(path)],
        capture_output=True, text=True, env=child_env(), timeout=120,
    )  # fmt: skip
    assert two.returncode == 0, two.stderr
    assert two.stdout == "" and not list(path.parent.glob(".*"))  # no temp file left
    records = json.loads(path.read_text())
    assert {r["side"] for r in records} == {"20261130T010000Z-aaaa", "20261202T010000Z-cccc"}
    native = [r for r in records if r["arm"] == "native" and r["metric"] == "prefill_tok_s" and r["ratio"]]
    assert len(native) == 6 and all(
        r["ratio"] == pytest.approx(1.10, rel=0.01) and r["verdict"] == "FASTER" for r in native
    )
    ambiguous = subprocess.run(
        [orchestrate_bin, "compare", "-r", str(root), "--by", "run", "-b", "2026"],
        capture_output=True, text=True, env=child_env(), timeout=120,
    )  # fmt: skip
    assert ambiguous.returncode == 2 and "run '2026' is ambiguous" in ambiguous.stderr
