"""The register-sourced NVFP4 prefill GEMM (`kernels/cuda/gemm_nvfp4_rs.cu`, the `r*` variants) without a GPU.

Its logic runs in `gemm_rs_emulator` (the kernel's lines mirrored, pinned here to the source) against
float64 for every `r*` variant, both types, tails in M, N and K and a ring that wraps: exact to float64
rounding, every output written once. The pipeline's timing is part of the model (copies land at the
wait that retires them, MMAs read their x tile when they retire), so a ring refilled one slot early, a
wait for one k-tile too few or a wrong A buffer fails; so does a wrong byte, row or scale of the
decode. Fragment reads are free of bank conflicts; one issue writes every byte of its slot once. The
sm_90a build (nvcc, NVRTC) is checked in test_gemm_wgmma.py with the other Hopper variants; on CUDA,
test_gemm_nvfp4.py runs them against the twin.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from kernels import nvfp4
from kernels.cuda import read_source
from kernels.cuda.gemm_layout import VARIANTS
from tests.kernels import gemm_rs_emulator as gr
from tests.kernels.test_gemm_nvfp4 import _conflicts, random_problem

RS = [name for name, cfg in VARIANTS.items() if cfg.rs]
# M = 300: a second, partial x tile (of 256; three of 128); N = 200: a partial weight tile (of 128;
# one of 256 with a warpgroup past N); K = 7 k-tiles: the rings of 5 and 6 slots wrap
SHAPE = (300, 200, 7 * 64)


def test_the_mirrored_rs_lines_are_the_source() -> None:
    body, header = read_source("gemm_nvfp4_rs.cu"), read_source("gemm_nvfp4.cuh")
    for line in (
        "const int2 tile = nvfp4g::raster(static_cast<int>(blockIdx.x), M, BT, BN, NUM_N, GROUP_M);",
        "const uint32_t xdst = xrow * 128 + ((xu ^ (xrow & 7)) << 4);",
        "const uint32_t wdst = XS_BYTES + wrow * 32 + (tid % 2) * 16;",
        "const bool sok = tid < BN && n0 + tid < N;",
        "const uint32_t sdst = XS_BYTES + CS_BYTES + tid * 4;",
        "const int arow = 64 * wg + 16 * (warp % 4) + g;  // and arow + 8",
        "const uint32_t sel = 0x4440u | static_cast<uint32_t>(t);  // byte t, zero-extended",
        "sc[1] = nvfp4g::lds32(st + ascale + 8 * 4);",
        "const uint2 c1 = nvfp4g::lds64(st + acode + 8 * 32 + 8 * s);",
        "afrag[b][1] = nvfp4g::decode_byte_pair<F16>(c1.x, sel, s1);  // row g + 8",
        "afrag[b][2] = nvfp4g::decode_byte_pair<F16>(c0.y, sel, s0);  // row g, k 2t + 8, 2t + 9",
        "constexpr int KSETS = NB >= 8 ? NB / 4 : 1;",
        "for (int s = 0; s < STAGES - 2; ++s) issue(s, s);",
        "nvfp4::cp_async_wait<STAGES - 3>();  // k-tile 0 has landed (this thread's copies) ...",
        # every x tile an MMA reads was fenced for the async proxy after it landed, k-tile 0 too (EARLY
        # issues its MMAs before the loop's first fence; the model has no proxies, so the source says it)
        "nvfp4::cp_async_wait<STAGES - 3>();  // k-tile 0 has landed (this thread's copies) ...\n"
        "nvfp4g::fence_proxy_async();",
        "nvfp4::cp_async_wait<STAGES - 4>();  // k-tile kt + 1 has landed",
        "issue(kt + STAGES - 2, slot >= 2 ? slot - 2 : slot + STAGES - 2);",
        "nvfp4g::wgmma_rs_m64n256k16<F16>(d, a, nvfp4g::wgmma_desc(xs + s * 32));",
        "mma(s, afrag[s % NB]);",
        "for (int s = 0; s < 4; ++s) mma(s, afrag[base + s]);",
        "nvfp4g::wgmma_wait<1>();  // k-tile kt - 1's MMAs are done: the other half of the buffers is free",
        "for (int s = 0; s < 4; ++s) decode_step(next, s, (base + 4 + s) % NB);  // NB = 12: k-tile kt - 2's set",
        "nvfp4g::wgmma_wait<1>();  // k-tile kt - 1's MMAs are done: its set is free for k-tile kt + 2",
        "for (int kt = 0; kt < KT; kt += KSETS == 3 ? 3 : 2) {",
        "if (kt + 1 < KT) ktile(kt + 1, 4);",
        "if (kt + 2 < KT) ktile(kt + 2, 8);",
        "if constexpr (EARLY) mma_group();    // before the barrier: k-tile kt's tile and fragments are ready",
        "if constexpr (!EARLY) mma_group();",
        "nvfp4g::wgmma_wait<NB - 1>();  // step i - NB + 1 is done: its A buffer, (s + 1) % NB, is free",
        "decode_step(slot, s + 1, (s + 1) % NB);",
        "const int row = m0 + 8 * j + 2 * t + c;",
        "const float v = d[4 * j + 2 * hf + c] * mult;",
        "constexpr int YPITCH = 2 * BN + 16;",
        "const int at = (8 * j + 2 * t + c) * YPITCH + (arow + 8 * hf) * 2;",
        "const int r = i / (BN / 8);",
        "const int p = i % (BN / 8);",
        "const int col = n0 + 8 * p;",
        "*reinterpret_cast<const uint4*>(smem + r * YPITCH + p * 16);",
        "for (int i = tid; i < BT * BN / 8; i += NT) {",
    ):
        assert line in body, line
    assert "return mul2<F16>(e2m1_pair<F16>(b * 0x01001000u), s);" in header


@pytest.mark.parametrize("f16", [False, True], ids=["bf16", "f16"])
@pytest.mark.parametrize("name", RS)
def test_the_emulated_rs_kernel_matches_float64(name: str, f16: bool) -> None:
    m, n, k = SHAPE
    xv, xb, codes, scales = random_problem(m, n, k, f16, 11)
    y, written = gr.RsGemmEmulator(VARIANTS[name], n, k, f16).run(xb, nvfp4.pack_codes(codes), scales, 0.375)
    ref = xv @ nvfp4.dequantize(codes, scales).T * 0.375
    assert (written == 1).all()
    np.testing.assert_allclose(y, ref, rtol=1e-12, atol=1e-12 * np.abs(ref).max())


def test_one_k_tile_and_many_row_tiles() -> None:
    cfg = dataclasses.replace(VARIANTS["r256x128k64s6"], group_m=3)
    m, n, k = 5 * 256 + 7, 2 * 128 + 8, 64
    xv, xb, codes, scales = random_problem(m, n, k, False, 5)
    y, written = gr.RsGemmEmulator(cfg, n, k, False).run(xb, nvfp4.pack_codes(codes), scales, 1.0)
    assert (written == 1).all()
    ref = xv @ nvfp4.dequantize(codes, scales).T
    np.testing.assert_allclose(y, ref, rtol=1e-12, atol=1e-12 * np.abs(ref).max())


class EarlyRefill(gr.RsGemmEmulator):
    """The ring refilled one k-tile early: the slot of k-tile kt - 1, whose MMAs may still run."""

    def issue(self, kt: int, slot: int) -> None:
        if kt >= self.STAGES - 2:  # in the loop: kt + STAGES - 2 into kt - 1's slot
            slot = (slot + 1) % self.STAGES
            kt = kt + 1
        super().issue(kt, slot)


class ShortWait(gr.RsGemmEmulator):
    """Each k-tile waits for one group less: k-tile kt + 1's codes may not have landed."""

    def cp_async_wait(self, allowed: int) -> None:
        super().cp_async_wait(allowed + 1)


class OneBuffer(gr.RsGemmEmulator):
    """One wait too few: the next fragments decoded into a buffer a running MMA still reads."""

    def wgmma_wait(self, allowed: int) -> None:
        super().wgmma_wait(allowed + (4 if self.NB >= 8 else 1) if allowed else 0)


class TwoSetsDecodedFirst(gr.RsGemmEmulator):
    """The q schedule (the next k-tile decoded before the wait) with two sets of A fragments, not three:
    the decode overwrites k-tile kt - 1's fragments while its MMAs may still run."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self.sets = 2


class WrongByte(gr.RsGemmEmulator):
    """Byte t + 1 of each code word (a wrong k pair)."""

    def setup(self, bid: int) -> None:
        super().setup(bid)
        self.sel = 0x4440 | ((self.t + 1) & 3)


class WrongScaleRow(gr.RsGemmEmulator):
    """Row arow's scales for both of the thread's rows."""

    def load_scales(self, slot: int) -> None:
        super().load_scales(slot)
        self.sc = [self.sc[0], self.sc[0]]


Planted = list[tuple[type[gr.RsGemmEmulator], str]]
PLANTED: Planted = [(bug, name) for name in ("r256x128k64s6", "r256x128k64s6k", "r256x128k64s5q", "r256x128k64s5qe")
           for bug in (EarlyRefill, ShortWait, OneBuffer, WrongByte, WrongScaleRow)]  # fmt: skip
PLANTED.append((TwoSetsDecodedFirst, "r256x128k64s5q"))  # a bug of the q schedule only


class StagedPieceShifted(gr.RsGemmEmulator):
    """YS: each value staged 8 columns further right (a piece reads its neighbour's values)."""

    def setup(self, bid: int) -> None:
        super().setup(bid)
        self.arow = (self.arow + 8) % self.BN


class StagedPitchShort(gr.RsGemmEmulator):
    """YS: the staged rows' pitch 16 bytes short of 2 BN + 16: rows overlap their neighbours."""

    def epilogue_staged(self, gsv: float, y: np.ndarray, written: np.ndarray) -> None:
        self.BN -= 16  # (the pitch is 2 BN + 16, pieces BN / 8: both of the short row)
        try:
            super().epilogue_staged(gsv, y, written)
        finally:
            self.BN += 16


PLANTED += [(bug, "r256x128k64s5key") for bug in (StagedPieceShifted, StagedPitchShort, WrongByte)]


@pytest.mark.parametrize(("broken", "name"), PLANTED, ids=lambda v: v if isinstance(v, str) else v.__name__)
def test_every_planted_bug_fails(broken: type[gr.RsGemmEmulator], name: str) -> None:
    m, n, k = SHAPE
    xv, xb, codes, scales = random_problem(m, n, k, False, 12)
    ref = xv @ nvfp4.dequantize(codes, scales).T
    try:
        y, _ = broken(VARIANTS[name], n, k, False).run(xb, nvfp4.pack_codes(codes), scales, 1.0)
    except AssertionError:  # the slot-tag check of the model (a slot refilled under its MMAs)
        return
    assert not np.allclose(y, ref, rtol=1e-6, atol=1e-6 * np.abs(ref).max())


@pytest.mark.parametrize("name", RS)
def test_one_issue_writes_every_byte_of_its_rs_slot_once(name: str) -> None:
    cfg = VARIANTS[name]
    emu = gr.RsGemmEmulator(cfg, cfg.bn + 8, 128, False, log=True)
    _, xb, codes, scales = random_problem(cfg.bm - 3, cfg.bn + 8, 128, False, 2)
    emu.load(xb, nvfp4.pack_codes(codes), scales)
    emu.setup(bid=0)
    used = cfg.bm * 128 + cfg.bn * 36  # the slot before its padding to 1024 bytes
    for slot in range(cfg.stages):
        emu.copies = []
        emu.issue(1, slot)
        count = np.zeros(cfg.smem_bytes(), dtype=int)
        for dst, nbytes in emu.copies:
            np.add.at(count, dst[:, None] + np.arange(nbytes), 1)
        base = slot * cfg.stage_bytes()
        assert (count[base : base + used] == 1).all() and count.sum() == used


@pytest.mark.parametrize("name", RS)
def test_the_rs_decode_reads_and_staged_y_are_free_of_bank_conflicts(name: str) -> None:
    cfg = VARIANTS[name]
    emu = gr.RsGemmEmulator(cfg, cfg.bn, 128, False, log=True)
    _, xb, codes, scales = random_problem(cfg.bm, cfg.bn, 128, False, 1)
    emu.run(xb, nvfp4.pack_codes(codes), scales, 1.0)
    staged = {"sts16-y", "lds128-y"} if cfg.ystage else set()  # YS: the tile of y through shared memory
    assert {a.kind for a in emu.accesses} == {"lds64-code", "lds32-scale"} | staged
    bad = [(a.kind, _conflicts(a)) for a in emu.accesses if _conflicts(a)]
    assert not bad, bad[:5]
