"""The Hopper (sm_90a) variants of the NVFP4 prefill GEMM: their builds, and the warp-specialised pipeline.

Without a GPU: every `wgmma` variant compiles for sm_90a through nvcc (and NVRTC, where a library is
found) without spills, within the registers its block is launched with, and its SASS holds the
warpgroup MMAs, the proxy fences, the mbarrier handoff and setmaxnreg where the variant uses them;
no ptxas remark that it serialised the MMAs, fenced them itself or ignored setmaxnreg. The
warp-specialised variants (`*p`) run in `gemm_ws_emulator`, producer and consumers as coroutines
meeting only at mbarriers, under every interleaving policy and both timings of the asynchronous
copies and MMAs, against float64; every planted protocol bug fails there; every byte of the rings
is written once per k-tile it carries. On CUDA, test_gemm_nvfp4.py runs them against the twin.
"""

from __future__ import annotations

import dataclasses
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from kernels import nvfp4
from kernels.cuda import nvrtc, precompiled_source, read_source
from kernels.cuda.gemm_layout import CONSUMER_REGS, MAX_SHARED_BYTES, REGISTERS, VARIANTS
from kernels.gemm_nvfp4 import source_of
from tests.kernels import gemm_ws_emulator as gw
from tests.kernels.test_gemm_nvfp4 import random_problem

WGMMA = [name for name, cfg in VARIANTS.items() if cfg.wgmma]
WS = [name for name, cfg in VARIANTS.items() if cfg.producer]
SCHEDULES = [gw.Schedule(policy, late) for policy in ("round-robin", "producer-first", "consumers-first", "random")
             for late in (False, True)] + [gw.Schedule("random", True, seed) for seed in (1, 2)]  # fmt: skip
# M = 70: consumer warpgroup 1 partly and 2 not at all in M; N = 264: a second block of 8 rows;
# K = 7 k-tiles: the decoded ring (3) wraps twice, parity flipping, the code ring (4) once
SHAPE = (70, 264, 7 * 64)


def test_the_mirrored_ws_lines_are_the_sources() -> None:
    body = read_source("gemm_nvfp4.cu") + read_source("gemm_nvfp4.cuh")
    for line in (
        "const uint32_t csw = ((pt >> 2) & 1) << 4;",
        "const size_t skip = ok ? static_cast<size_t>(128 * q) : 0;",
        "nvfp4g::cp_async<16>(cs + r * 32 + (16 ^ csw), src + 16, ok);",
        "nvfp4g::cp_async<4>(cs + BN * 32 + r * 4, ps + skip * (K / 16) + kt * SROW, ok);",
        "const uint4 cw = nvfp4g::lds128(cs + r * 32 + ((16 * u) ^ csw));",
        "nvfp4g::sts128(drow + (((4 * u + 2) ^ (r & 7)) << 4), nvfp4g::decode_word_natural<F16>(cw.z, s1));",
        "produce_issue(kt + CSTAGES - 1, code.prev());  // kt - 1's slot, which this thread decoded",
        "nvfp4::cp_async_wait<CSTAGES - 1>();  // k-tile kt's codes have landed (this thread's own)",
        "nvfp4g::mbar_wait(sbase + WS_BAR + 8 * (DSTAGES + dec.slot), dec.phase ^ 1);  // kt - DSTAGES is done",
        "nvfp4g::mbar_arrive(sbase + WS_BAR + 8 * dec.slot);  // ... and to the consumers",
        "int prev() const { return slot == 0 ? SIZE - 1 : slot - 1; }",
        "phase ^= slot == 0 ? 1u : 0u;",
        "const uint32_t cdst = cwg * WX_BYTES + crow * 128 + ((cu ^ (crow & 7)) << 4);",
        "const bool ok = m0 + 64 * cwg + crow + 16 * p < M;",
        "nvfp4::cp_async_wait<STAGES - 2>();  // k-tile kt's x rows have landed (this thread's) ...",
        "nvfp4g::mbar_wait(sbase + WS_BAR + 8 * dec.slot, dec.phase);  // k-tile kt's decoded tile",
        "nvfp4g::wgmma_desc(db + 128 * 128 + ks * 32));",
        "nvfp4g::wgmma_wait<1>();  // k-tile kt - 1's MMAs are done: its decoded tile and x slot are free",
        "if (kt > 0 && lane == 0) nvfp4g::mbar_arrive(sbase + WS_BAR + 8 * (DSTAGES + dec.prev()));  // one a warp",
        "consume_issue(kt + STAGES - 1, xr.prev());",
        "nvfp4g::mbar_init(sbase + WS_BAR + 8 * b, 128);                   // full: the producer's threads",
        "nvfp4g::mbar_init(sbase + WS_BAR + 8 * (DSTAGES + b), 4 * NC);    // empty: the consumer warps",
    ):
        assert line in body, line


@pytest.mark.parametrize("schedule", SCHEDULES, ids=str)
@pytest.mark.parametrize("name", WS)
def test_the_ws_pipeline_matches_float64_under_every_interleaving(name: str, schedule: gw.Schedule) -> None:
    m, n, k = SHAPE
    xv, xb, codes, scales = random_problem(m, n, k, False, 5)
    emu = gw.WsGemmEmulator(VARIANTS[name], n, k, False, schedule=schedule)
    y, written = emu.run(xb, nvfp4.pack_codes(codes), scales, 0.375)
    ref = xv @ nvfp4.dequantize(codes, scales).T * 0.375
    assert (written == 1).all()
    np.testing.assert_allclose(y, ref, rtol=1e-12, atol=1e-12 * np.abs(ref).max())


@pytest.mark.parametrize("mutation", gw.MUTATIONS)
def test_every_planted_protocol_bug_fails_under_some_interleaving(mutation: str) -> None:
    m, n, k = SHAPE
    xv, xb, codes, scales = random_problem(m, n, k, False, 6)
    ref = xv @ nvfp4.dequantize(codes, scales).T
    caught = []
    for schedule in SCHEDULES:
        emu = gw.WsGemmEmulator(VARIANTS["g192x256k64s3p"], n, k, False, schedule=schedule, mutation=mutation)
        try:
            y, _ = emu.run(xb, nvfp4.pack_codes(codes), scales, 1.0)
        except AssertionError as exc:
            caught.append(str(exc))
            continue
        if not np.allclose(y, ref, rtol=1e-12, atol=1e-12 * np.abs(ref).max()):
            caught.append("a wrong product")
    assert caught, f"{mutation} passed every schedule"


def test_a_decoded_ring_of_one_tile_deadlocks_and_is_refused() -> None:
    cfg = dataclasses.replace(VARIANTS["g128x256k64s4p"], dstages=1)
    assert "at least 2" in (cfg.reason(21504, 5376) or "")
    m, n, k = SHAPE
    _, xb, codes, scales = random_problem(m, n, k, False, 7)
    with pytest.raises(AssertionError, match="deadlock"):
        gw.WsGemmEmulator(cfg, n, k, False).run(xb, nvfp4.pack_codes(codes), scales, 1.0)


@pytest.mark.parametrize("name", WS)
def test_the_ws_rings_get_every_byte_once_per_k_tile(name: str) -> None:
    cfg = VARIANTS[name]
    m, n, k = cfg.bm, cfg.bn, 5 * cfg.bk
    _, xb, codes, scales = random_problem(m, n, k, True, 8)
    emu = gw.WsGemmEmulator(cfg, n, k, True, log=True)
    emu.run(xb, nvfp4.pack_codes(codes), scales, 1.0)
    copied = np.zeros(cfg.smem_bytes(), dtype=int)
    for dst, nbytes in emu.copies:
        np.add.at(copied, dst[:, None] + np.arange(nbytes), 1)
    decoded = np.zeros(cfg.smem_bytes(), dtype=int)
    for a in emu.accesses:
        if a.kind == "sts128-decode":
            np.add.at(decoded, a.addrs[:, None] + np.arange(16), 1)
    kts = np.arange(emu.KT)
    want_copied = np.zeros_like(copied)
    for s in range(cfg.stages):  # x: the consumers' slots
        want_copied[s * emu.XS : (s + 1) * emu.XS] = np.count_nonzero(kts % cfg.stages == s)
    for c in range(cfg.cstages):  # codes and scales: the producer's slots
        base = emu.WS_CODE + c * emu.CSTAGE
        want_copied[base : base + emu.CSTAGE] = np.count_nonzero(kts % cfg.cstages == c)
    np.testing.assert_array_equal(copied, want_copied)
    want_decoded = np.zeros_like(decoded)
    for d in range(cfg.dstages):
        base = emu.WS_DEC + d * emu.DS
        want_decoded[base : base + emu.DS] = np.count_nonzero(kts % cfg.dstages == d)
    np.testing.assert_array_equal(decoded, want_decoded)


def test_the_launch_budgets_of_the_hopper_variants() -> None:
    for name in WGMMA:
        cfg = VARIANTS[name]
        launch, consumer, producer = cfg.registers()
        assert cfg.threads * launch <= REGISTERS and cfg.smem_bytes() <= MAX_SHARED_BYTES, name
        assert (cfg.wm // 4 * consumer + (producer if cfg.producer else 0)) * 128 <= REGISTERS, name
        assert cfg.launch_bound == (cfg.threads if cfg.threads > 256 else 0), name
    # 512 threads launch with 128 registers each: the consumers take 160 from the producer (which
    # keeps 32), and each k16 step is two m64n128k16 (ptxas refuses m64n256k16 under 154)
    assert VARIANTS["g192x256k64s3p"].registers() == (128, CONSUMER_REGS, 32)
    assert VARIANTS["g192x256k64s3p"].wgmma_n() == 128
    assert VARIANTS["g128x256k64s4p"].registers() == (168, 168, 168) and VARIANTS["g128x256k64s4p"].wgmma_n() == 256
    assert VARIANTS["g192x256k64s4"].threads == 384 and VARIANTS["g192x256k64s4"].template(256, 64, False)["CREGS"] == 0


# ------------------------------------------------------------------- the sm_90a builds


def wgmma_source(name: str, dtype: str, prelude: str | None = None) -> str:
    consts = {"T": dtype, **VARIANTS[name].template(21504, 5376, dtype == "float16")}
    sig = ({"x": dtype, "w": "uint32", "scales": "uint8", "gsv": "float32"}, {"y": dtype})
    extra = {} if prelude is None else {"prelude": prelude}
    cfg, fn = VARIANTS[name], f"gemm_{name}_{dtype}"
    return precompiled_source(source_of(cfg), *sig, consts, fn, max_threads=cfg.launch_bound, **extra)


def check_sass(fn: str, name: str) -> None:
    """What the SASS of one wgmma kernel must hold (cuobjdump's text of its function)."""
    cfg = VARIANTS[name]
    if cfg.rs:  # one m64n{BM}k16 per k16 step, A from registers, NB - 1 steps (NB = 8, 12: a k-tile) in flight
        assert fn.count(f"HGMMA.64x{cfg.bm}x16.F32") == 4, name
        held = 1 if cfg.abufs >= 8 else cfg.abufs - 1  # a k-tile of MMAs (NB = 8, 12) or NB - 1 steps in flight
        assert f"WARPGROUP.DEPBAR.LE gsb0, 0x{held}" in fn and "FENCE.VIEW.ASYNC.S" in fn, name
        assert "SYNCS.ARRIVE" not in fn and "USETMAXREG" not in fn, name
        return
    steps = "HGMMA.64x256x16.F32" if cfg.wgmma_n() == 256 else "HGMMA.64x128x16.F32"
    assert fn.count(steps) == 4 * 256 // cfg.wgmma_n(), name  # the k16 steps of one k-tile
    assert "FENCE.VIEW.ASYNC.S" in fn and "WARPGROUP.ARRIVE" in fn, name
    held = "WARPGROUP.DEPBAR.LE gsb0, 0x1" in fn  # one k-tile of MMAs in flight
    assert held == (cfg.deep or cfg.producer), name
    assert ("SYNCS.ARRIVE" in fn and "SYNCS.PHASECHK" in fn) == cfg.producer, name  # the mbarriers
    assert ("USETMAXREG" in fn) == (cfg.registers()[1] != cfg.registers()[0]), name


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc (the CUDA toolkit) for the offline compile check")
def test_the_wgmma_variants_compile_for_sm90a_with_the_warpgroup_mma_and_proxy_fences(tmp_path: Path) -> None:
    src = tmp_path / "wgmma.cu"
    kernels = [(name, dtype) for name in WGMMA for dtype in ("bfloat16", "float16")]
    src.write_text(wgmma_source(*kernels[0]) + "".join(
        wgmma_source(n, d).split('extern "C"', 1)[1].join(['\nextern "C"', ""]) for n, d in kernels[1:]
    ))  # fmt: skip
    cubin = tmp_path / "wgmma.cubin"
    res = subprocess.run(
        ["nvcc", "-gencode=arch=compute_90a,code=sm_90a", "-std=c++17", "-cubin", "-Xptxas", "-v", str(src),
         "-o", str(cubin)],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stderr.count(" 0 bytes spill stores, 0 bytes spill loads") == len(kernels), res.stderr
    assert "warning" not in res.stderr.lower(), res.stderr
    # C7508 setmaxnreg ignored, C7512 wgmma serialised, C7519 a warpgroup.arrive injected by ptxas
    assert not re.search(r"\(C75(08|12|19)\)", res.stderr), res.stderr
    used = dict(re.findall(r"Compiling entry function '(\w+)'.*?Used (\d+) registers", res.stderr, re.S))
    assert len(used) == len(kernels)
    for fn, regs in used.items():
        assert int(regs) <= VARIANTS[fn.removeprefix("gemm_").rsplit("_", 1)[0]].registers()[0], (fn, regs)
    if shutil.which("cuobjdump") is None:
        pytest.skip("compiled without spills; cuobjdump (for the SASS check) is not installed")
    sass = subprocess.run(["cuobjdump", "-sass", str(cubin)], capture_output=True, text=True, check=True).stdout
    functions = re.split(r"\n\s*Function : ", sass)[1:]
    assert len(functions) == len(kernels)
    for fn in functions:
        check_sass(fn, fn.split("\n", 1)[0].removeprefix("gemm_").rsplit("_", 1)[0])


@pytest.mark.skipif(nvrtc.library() is None, reason=f"needs an NVRTC library (none found; {nvrtc.NVRTC_ENV} names one)")
@pytest.mark.parametrize("name", WGMMA)
def test_nvrtc_builds_the_wgmma_variants_for_sm90a(name: str, tmp_path: Path) -> None:
    cubin = nvrtc.compile_cubin(wgmma_source(name, "bfloat16", nvrtc.PRELUDE), "sm_90a")
    assert cubin[:4] == b"\x7fELF" and len(cubin) > 10_000
    with pytest.raises(RuntimeError, match="sm_90"):  # what MLX's own build meets: no wgmma on sm_90
        nvrtc.compile_cubin(wgmma_source(name, "bfloat16", nvrtc.PRELUDE), "sm_90")
    if shutil.which("cuobjdump") is None:
        pytest.skip("NVRTC built it; cuobjdump (for its registers and SASS) is not installed")
    path = tmp_path / "k.cubin"
    path.write_bytes(cubin)
    usage = subprocess.run(["cuobjdump", "-res-usage", str(path)], capture_output=True, text=True, check=True).stdout
    regs, stack = re.search(r"REG:(\d+) STACK:(\d+)", usage).groups()  # type: ignore[union-attr]
    assert int(regs) <= VARIANTS[name].registers()[0] and int(stack) == 0, usage  # no spills
    assert "LOCAL:0" in usage, usage
    sass = subprocess.run(["cuobjdump", "-sass", str(path)], capture_output=True, text=True, check=True).stdout
    check_sass(sass, name)
