"""`orchestrate compare`: the first seed's table rebuilt from stored rows, every format, other
comparison axes, the cross-device share of peak, and the CLI end to end on a real store."""

from __future__ import annotations

import csv
import datetime as dt
import io
import json
import subprocess
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from orchestrator.compare import compare_results, cross_device, select_results
from orchestrator.compare_render import render_text
from orchestrator.errors import InputError
from orchestrator.stats import Verdict
from orchestrator.store import ResultStore
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

    md = render_text(result, "md")
    header = md.splitlines()[2]
    assert header.startswith("| device | prompt_tokens | affine prefill tok/s | native prefill tok/s |")
    line_512 = next(line for line in md.splitlines() if line.startswith("| cpu | 512 |"))
    assert "-3.0% [" in line_512 and "SLOWER" in line_512
    assert "2.67x [" in line_512 and "FASTER" in line_512
    assert "40.44 GB" in line_512 and "37.17 GB" in line_512 and "229.8s" in line_512 and "LOWER" in line_512
    line_2048 = next(line for line in md.splitlines() if line.startswith("| cpu | 2048 |"))
    assert "-8.8% [" in line_2048


def test_csv_and_json_carry_every_number() -> None:
    result = compare_results(seed1_table(), baseline="affine")
    rows = list(csv.DictReader(io.StringIO(render_text(result, "csv"))))
    assert len(rows) == 6
    first = rows[0]
    assert first["prompt_tokens"] == "512" and first["device"] == "cpu"
    assert float(first["affine.prefill_tok_s.median"]) == pytest.approx(121.77, rel=0.003)
    assert float(first["affine.prefill_tok_s.ci_low"]) < float(first["affine.prefill_tok_s.ci_high"])
    assert first["affine.prefill_tok_s.n"] == "9"
    assert first["native/affine.decode_tok_s.verdict"] == "FASTER"
    doc = json.loads(render_text(result, "json"))
    assert doc["baseline"] == "affine" and len(doc["rows"]) == 6
    last = doc["rows"][-1]
    assert last["prompt_tokens"] == "16384"
    assert last["native/affine.prefill_tok_s.ratio"] == pytest.approx(107.45 / 114.19, abs=0.004)
    assert last["affine.load_seconds.cv"] is None  # one sample: no spread, written as null


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
    assert [r["prompt_tokens"] for r in rows] == [str(p) for p in SEED1]
    check = subprocess.run(
        [orchestrate_bin, "check", "--sweep", str(sweep), "--results", str(root)],
        capture_output=True, text=True, env=env, timeout=120,
    )  # fmt: skip
    assert check.returncode == code, check.stdout + check.stderr
    first = check.stdout.splitlines()[0]
    assert first.startswith("FAIL" if code else "PASS")
    assert "native decode at least 2x affine" in check.stdout


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
    assert "### moe-gather (baseline: affine-sorted)" in md and "native-sorted/affine-sorted time" in md
    assert "| device | tokens | affine time | native time | native/affine time |" in md


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
    rows = json.loads(by_commit.stdout)["rows"]
    assert {r["device"] for r in rows} == {"cpu", "h200"}
    assert all(r["bbb222/aaa111.gb_per_s.verdict"] == "FASTER" for r in rows)
    assert all(r["bbb222/aaa111.gb_per_s.ratio"] == pytest.approx(1.1, rel=0.02) for r in rows)
