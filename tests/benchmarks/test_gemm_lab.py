"""benchmarks/gemm_lab.py's plumbing on the CPU (its kernels need CUDA; MLX's own paths run here)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from benchmarks import gemm_lab
from kernels.cuda import cuda_backend_available
from kernels.cuda.gemm_layout import VARIANTS, parse_rule


def test_paths_are_checked_against_float64_and_timed_side_by_side() -> None:
    prob = gemm_lab.Problem(64, 128)
    flushed: list[list[str]] = []

    def flush(block: dict[str, Any]) -> None:
        flushed.append([p["path"] for p in block["paths"]])

    block = gemm_lab.run_m(prob, 24, ["b128x256k64s4"], 790.0, flush)
    paths = [*gemm_lab.BASELINES, "b128x256k64s4"]
    assert flushed == [paths[:i] for i in range(len(paths))]  # on disk before each next path starts
    by = {p["path"]: p for p in block["paths"]}
    assert set(by) == {*gemm_lab.BASELINES, "b128x256k64s4"}
    for name in gemm_lab.BASELINES:
        p = by[name]
        assert p["nan"] == 0 and p["seconds"] > 0 and p["calls"] >= 2
        # bf16 outputs of the NVFP4 weights; affine adds its 4-bit g64 requantization
        assert p["rel_error"] < (0.2 if name == "affine" else 2e-2), (name, p["rel_error"])
        assert p["x_affine"] == pytest.approx(by["affine"]["seconds"] / p["seconds"])
        assert p["peak_extra_bytes"] >= 0
    if not cuda_backend_available():
        assert "no CUDA device" in by["b128x256k64s4"]["skipped"]
    wrong = gemm_lab.check(gemm_lab.mx.zeros((24, 64), dtype=gemm_lab.mx.bfloat16), np.arange(3), np.ones((3, 64)), 1.0)
    assert wrong["rel_error"] == pytest.approx(1.0)  # a zero output is caught


def test_the_recommended_rule_is_the_fastest_correct_variant_per_m() -> None:
    a, b, c = list(VARIANTS)[:3]

    def path(name: str, s: float, err: float = 1e-3, nan: int = 0) -> dict[str, object]:
        return {"path": name, "seconds": s, "rel_error": err, "nan": nan}

    per_m = [
        {"m": 512, "paths": [path("native", 0.1), path(a, 2.0), path(b, 1.0, err=0.5)]},  # b is wrong
        {"m": 2048, "paths": [path(a, 2.0), path(b, 1.0, nan=3)]},  # b left outputs unwritten
        {"m": 4096, "paths": [path(a, 2.0), path(c, 1.0)]},
        {"m": 16384, "paths": [path(a, 2.0), path(c, 1.0)]},
    ]
    rule = gemm_lab.recommend(per_m, 1e-2)
    assert rule == f"{a}@2048,{c}"
    assert parse_rule(rule) == [(2048, a), (None, c)]  # the library accepts what the lab prints
    assert gemm_lab.recommend([{"m": 512, "paths": [path("native", 1.0)]}], 1e-2) == ""
    # the wgmma child's blocks come after all of this process's: one M's blocks are pooled (unpooled,
    # a rule can keep a slower variant up to the largest M beside a faster wgmma one)
    child = [{"m": m, "paths": [path(b, 0.5)]} for m in (512, 2048, 4096, 16384)]
    assert gemm_lab.recommend(per_m + child, 1e-2) == b


@pytest.mark.skipif(cuda_backend_available(), reason="checks the refusal off CUDA")
def test_without_cuda_the_lab_says_so_and_exits_3(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert gemm_lab.main(["--out", str(tmp_path / "lab")]) == 3
    assert "CUDA" in capsys.readouterr().err and not (tmp_path / "lab").exists()


@pytest.mark.skipif(cuda_backend_available(), reason="checks the refusal off CUDA")
def test_the_wgmma_child_reports_what_went_wrong_instead_of_failing_the_lab(tmp_path: Path) -> None:
    out = gemm_lab.run_child(tmp_path / "wgmma", ["g128x256k64s4"], "16", "64,128")
    assert out["error"].startswith("exit 3") and "CUDA" in out["error"]


def test_the_warp_specialised_and_register_sourced_variants_get_a_child_of_their_own() -> None:
    groups = gemm_lab.child_groups(list(VARIANTS))
    assert list(groups) == ["wgmma_rs", "wgmma", "wgmma_ws"]  # the register-sourced kernel first
    assert all(VARIANTS[v].wgmma and not (VARIANTS[v].producer or VARIANTS[v].rs) for v in groups["wgmma"])
    assert groups["wgmma_ws"] == [v for v, cfg in VARIANTS.items() if cfg.producer] and groups["wgmma_ws"]
    assert groups["wgmma_rs"] == [v for v, cfg in VARIANTS.items() if cfg.rs] and groups["wgmma_rs"]
    assert "g128x256k64s4" in groups["wgmma"]
    assert gemm_lab.child_groups(["b128x256k64s4", "g128x256k64s4"]) == {"wgmma": ["g128x256k64s4"]}


def test_a_child_that_hangs_keeps_what_it_wrote_and_names_where(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "wgmma_ws"

    def hangs(cmd: list[str], **kwargs: object) -> None:  # stands in for a kernel that never returns
        out.mkdir(parents=True)
        (out / "gemm_lab.json").write_text(json.dumps({"per_m": [{"m": 512, "paths": [{"path": "dense"}]}]}))
        raise subprocess.TimeoutExpired(cmd, 150.0, stderr=b"M=512 dense: 0.2 ms\nM=512 g192x256k64s3p: ...\n")

    monkeypatch.setattr(gemm_lab.subprocess, "run", hangs)
    got = gemm_lab.run_child(out, ["g192x256k64s3p"], "512", "21504,5376")
    assert got["per_m"][0]["paths"] == [{"path": "dense"}]
    assert got["error"] == "timed out after 150 s: M=512 g192x256k64s3p: ..."


@pytest.mark.skipif(cuda_backend_available(), reason="checks the refusal off CUDA")
def test_the_twin_check_does_not_pass_where_it_checked_nothing() -> None:
    from benchmarks import gemm_twin_check

    assert gemm_twin_check.main() == 3


def test_the_qmm_check_sweep_is_the_nvfp4_prefill_sweeps_qmm_case() -> None:
    from orchestrator.specs.sweep import load_sweep

    check = load_sweep(str(Path(__file__).parents[2] / "benchmarks" / "qmm-check.toml"))
    builtin = next(case for case in load_sweep("nvfp4-prefill").cases if case.case == "qmm")
    assert [case.model_dump() for case in check.cases] == [builtin.model_dump()]
    prefill = load_sweep("nvfp4-prefill")
    assert (check.repetitions, check.precision, check.max_seconds) == (
        prefill.repetitions,
        prefill.precision,
        prefill.max_seconds,
    )


def test_the_rounds_give_every_path_the_same_mean_place() -> None:
    names = ["dense", "native", "affine", "dequant-gemm", "a", "b"]
    orders = gemm_lab.round_orders(names, 4)
    assert orders[0] == names and orders[1] == names[::-1] and all(sorted(o) == sorted(names) for o in orders)
    mean_place = {n: np.mean([o.index(n) for o in orders]) for n in names}
    assert set(mean_place.values()) == {(len(names) - 1) / 2}
    assert gemm_lab.round_orders(names, 1) == [names]


def test_interleaved_rounds_take_a_drifting_clock_off_the_ratios(monkeypatch: pytest.MonkeyPatch) -> None:
    # Two identical paths on a card that slows by 1 % per timed path (it heats up): one pass in the
    # checked order makes the second 1 % slower than the first; four interleaved rounds nearly even it.
    clock = {"calls": 0}

    def drifting(fn: object, target_s: float = 0.03, batches: int = 5) -> dict[str, float]:
        clock["calls"] += 1
        return {"seconds": 1e-3 * 1.01 ** clock["calls"], "min": 0.0, "max": 0.0, "calls": 2}

    monkeypatch.setattr(gemm_lab, "seconds_per_call", drifting)

    def pair(rounds: int) -> float:
        clock["calls"] = 0
        timed = {name: {"path": name, **drifting(None)} for name in ("dense", "twin")}
        if rounds > 1:
            gemm_lab.retime(timed, {"dense": lambda: None, "twin": lambda: None}, rounds, 512, 64, 128, 790.0)  # type: ignore[dict-item]
            assert len(timed["twin"]["rounds_s"]) == rounds
            assert timed["twin"]["seconds"] == pytest.approx(np.median(timed["twin"]["rounds_s"]))
            assert timed["twin"]["ms"] == pytest.approx(timed["twin"]["seconds"] * 1e3)
        return timed["twin"]["seconds"] / timed["dense"]["seconds"]

    assert pair(1) == pytest.approx(1.01)
    assert abs(pair(4) - 1.0) < 0.004


def test_run_m_with_rounds_times_every_path_each_round() -> None:
    prob = gemm_lab.Problem(64, 128)
    block = gemm_lab.run_m(prob, 24, [], 790.0, None, rounds=3)
    by = {p["path"]: p for p in block["paths"]}
    for name in gemm_lab.BASELINES:
        p = by[name]
        assert len(p["rounds_s"]) == 3 and p["seconds"] == pytest.approx(np.median(p["rounds_s"]))
        assert p["x_dense"] == pytest.approx(by["dense"]["seconds"] / p["seconds"])
        assert p["tflop_s"] == pytest.approx(2 * 24 * 64 * 128 / p["seconds"] / 1e12)
