"""The NVFP4 prefill GEMM (`kernels/cuda/gemm_nvfp4.cu`) on a machine without a GPU, and on CUDA.

Without a GPU its logic is checked through NumPy mirrors of its lines (tests/kernels/gemm_emulator.py):
the decode of `gemm_nvfp4.cuh` exhaustively against the NVFP4 reference; the shared-memory layout
on the addresses the kernel computes (every ring byte written once per k-tile, no bank conflict in
any fragment read or decode write); the raster (every output tile once); the ring discipline (no
slot or decoded tile read before it landed or while it is rewritten); and the whole kernel, lane
by lane, against the float64 reference at every variant, both 16-bit types, with tails in M, N and
K. The MLX twin (the fallback) is checked against float64. Where nvcc is installed every variant
compiles for sm_90 as MLX assembles it, without register spills, and (with cuobjdump) its SASS holds
the tensor-core MMAs and the asynchronous copies (the sm_90a wgmma builds and the warp-specialised
pipeline: test_gemm_wgmma.py). With MLX's CUDA backend the kernel runs against
its twin on NaN-poisoned outputs (marked `cuda`, skipped with the reason elsewhere).
"""

from __future__ import annotations

import dataclasses
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from benchmarks.gemm_twin_check import twin_error
from kernels import gemm_nvfp4, nvfp4
from kernels.cuda import CudaDevice, cuda_backend_available, nvrtc, read_source
from kernels.cuda.gemm_layout import DEFAULT_VARIANT, VARIANT_ENV, VARIANTS, GemmConfig, parse_rule, variant_for
from kernels.gemm_nvfp4 import GEMM_SOURCE, gemm_nvfp4_twin
from tests.kernels import gemm_emulator as ge
from tests.kernels.gemm_ws_emulator import emulator

needs_cuda = pytest.mark.skipif(not cuda_backend_available(), reason="needs MLX's CUDA backend (an NVIDIA GPU)")
E4M3 = ge.E4M3
FINITE = np.array([b for b in range(256) if b & 0x7F != 0x7F], dtype=np.uint32)
OFFSET = {True: 2.0**-14, False: 2.0**-26}  # decoded weight = E2M1 * E4M3 * OFFSET (f16, bf16)


def test_the_mirrored_lines_are_the_sources() -> None:
    header, body = read_source("gemm_nvfp4.cuh"), read_source("gemm_nvfp4.cu")
    for line in (
        "return (t & 0x80008000u) | ((t >> 3) & 0x0E000E00u);",
        "return (t & 0x80008000u) | ((t >> 6) & 0x01C001C0u);",
        "f *= 1267650600228229401496703205376.0f;  // 2^100",
        "#define NVFP4G_EPILOGUE_BF16 67108864.0f  // 2^26",
        "#define NVFP4G_EPILOGUE_F16 16384.0f",
        "return static_cast<uint64_t>((addr & 0x3FFFFu) >> 4) | (1ull << 16) | "
        "(static_cast<uint64_t>(1024 >> 4) << 32) |",
        "(1ull << 62);",
        "d[0] = mul2<F16>(e2m1_pair<F16>(w << 12), s);",
        "d[3] = mul2<F16>(e2m1_pair<F16>(w), s);",
        "return make_uint4(__byte_perm(d[0], d[1], 0x5410), __byte_perm(d[2], d[3], 0x5410),",
        "__byte_perm(d[0], d[1], 0x7632), __byte_perm(d[2], d[3], 0x7632));",
        "p[1] = __byte_perm(v.x, v.z, 0x7632);",
        "p[2] = __byte_perm(v.y, v.w, 0x5410);",
        "const int gsize = min(num_m - first_m, group_m);",
        "return make_int2((first_m + in_group % gsize) * bm, (in_group / gsize) * bn);",
    ):
        assert line in header, line
    for line in (
        "const int2 tile = nvfp4g::raster(static_cast<int>(blockIdx.x), M, BM, BN, NUM_N, GROUP_M);",
        "const T* const xsrc = x + static_cast<size_t>(min(m0 + xrow, M - 1)) * K + xu * 8;",
        "const uint32_t xdst = (xu / 8) * XS_BYTES + xrow * 128 + (((xu % 8) ^ (xrow & 7)) << 4);",
        "const uint32_t wdst = KH * XS_BYTES + (wu / 2) * WS_BYTES + wrow * 32 + (wu % 2) * 16;",
        "const uint32_t idec1 = irow * 128 + (((2 * igq + 1) ^ (irow & 7)) << 4);",
        "const uint32_t aoff = arow * 128 + (((lane >> 4) ^ (arow & 7)) << 4);",
        "const uint32_t boff = brow * 128 + ((((lane >> 3) & 1) ^ (brow & 7)) << 4);",
        "const uint32_t abase = sbase + ((xs + h * XS_BYTES + aoff) ^ flip);",
        "if (p * KSTEPS / ITEMS == ks) decode_item(next, nbuf, p);",
        "if (IEVEN && p * KSTEPS / ITEMS == ks) decode_item(next, nbuf, p);",
        "for (int p = 0; p < ITEMS; ++p) decode_item(next, nbuf, p);",
        "if (!IEVEN && p == ITEMS - 1 && p * NT + tid >= BN * 4 * KH) return;",
        "const int h = p * NT / (BN * 4);",
        "const int r = p * NT % (BN * 4) / 4;",
        "if (!WEVEN && wrow + p * WROWS >= BN) break;  // the partial last pass (whole warps drop out)",
        "compute_block(slot, buf, next, nbuf);",
        "compute_wgmma(slot, buf, next, nbuf);",
        "nvfp4g::wgmma_desc(db + h * DS_BYTES + kofs));",
        "const uint32_t xs = sbase + slot * STAGE_BYTES + (warp / 4) * 64 * 128;  // this warpgroup's x rows",
        "const uint32_t xp = st + h * XS_BYTES + xoff + (((2 * t + kk) ^ g) << 4);",
        "const uint32_t soff = KH * (XS_BYTES + WS_BYTES) + (wn * 8 * TN + g) * SROW + t;",
        "cw[j] = nvfp4g::lds64(st + woff + h * WS_BYTES + j * 8 * 32);",
        "nvfp4g::decode_word<F16>(kk == 0 ? cw[j].x : cw[j].y, sp[j], d);",
        "nvfp4::cp_async_wait<STAGES - 2 - LEAD - HELD>();  // k-tile kt + LEAD has landed",
        "issue(kt + STAGES - 1 - HELD, refill);",
        "int refill = STAGES - 1 - HELD;  // slot of k-tile kt + STAGES - 1 - HELD (that of kt - 1 - HELD)",
        "nvfp4g::wgmma_wait<HELD>();  // before the barrier: the slot and buffer it frees are refilled",
        "const int col = n0 + wn * 8 * TN + 8 * j + 2 * t;",
    ):
        assert line in body, line


# ------------------------------------------------------------------------------------ decode


@pytest.mark.parametrize("f16", [False, True])
def test_e2m1_pairs_are_exact_for_every_code_at_every_nibble(f16: bool) -> None:
    words = np.arange(1 << 16, dtype=np.uint32)
    words = words | (words[::-1] << np.uint32(16))  # every nibble pattern in both halves
    codes = nvfp4.unpack_codes(words[:, None])
    raw_offset = 2.0**-14 if f16 else 2.0**-126
    for j in range(4):
        lo, hi = ge.halves(ge.e2m1_pair(words << np.uint32(12 - 4 * j), f16), f16)
        np.testing.assert_array_equal(lo, nvfp4.E2M1_VALUES[codes[:, j]] * raw_offset)
        np.testing.assert_array_equal(hi, nvfp4.E2M1_VALUES[codes[:, j + 4]] * raw_offset)


@pytest.mark.parametrize("f16", [False, True])
def test_every_scaled_weight_is_exact_and_in_range(f16: bool) -> None:
    # every code times every finite E4M3 scale: ge.mul2 refuses any product the type would round
    words = np.repeat(np.uint32(0x76543210), FINITE.size)  # codes 0..7 (and their negations below)
    for w in (words, words | np.uint32(0x88888888)):
        s = ge.scale_splat(FINITE, f16)
        lo, hi = ge.halves(s, f16)
        np.testing.assert_array_equal(lo, E4M3[FINITE] * (1.0 if f16 else 2.0**100))
        assert np.array_equal(lo, hi)
        d = ge.decode_word(w, s, f16)
        codes = nvfp4.unpack_codes(w[:1, None])[0]
        for j in range(4):
            got_lo, got_hi = ge.halves(d[j], f16)
            np.testing.assert_array_equal(got_lo, nvfp4.E2M1_VALUES[codes[j]] * E4M3[FINITE] * OFFSET[f16])
            np.testing.assert_array_equal(got_hi, nvfp4.E2M1_VALUES[codes[j + 4]] * E4M3[FINITE] * OFFSET[f16])


@pytest.mark.parametrize("f16", [False, True])
def test_natural_order_and_the_x_permutation_match_the_pairs(f16: bool) -> None:
    rng = np.random.default_rng(3)
    w = rng.integers(0, 2**32, 4096, dtype=np.uint64).astype(np.uint32)
    s = ge.scale_splat(np.full(w.shape, 0x38, dtype=np.uint32), f16)  # E4M3 1.0
    codes = nvfp4.unpack_codes(w[:, None])
    natural = ge.decode_word_natural(w, s, f16)
    for i in range(4):  # unit word i holds codes 2i, 2i + 1
        lo, hi = ge.halves(natural[i], f16)
        np.testing.assert_array_equal(lo / OFFSET[f16], nvfp4.E2M1_VALUES[codes[:, 2 * i]])
        np.testing.assert_array_equal(hi / OFFSET[f16], nvfp4.E2M1_VALUES[codes[:, 2 * i + 1]])
    # x values 0..7 as they arrive in a 16-byte piece; the warp decode multiplies pair j of x with
    # decode_word's pair j, (code j, code j + 4)
    xv = np.arange(1, 9, dtype=np.float64)
    xw = [ge.pack(ge.bits16(xv[2 * i : 2 * i + 1], f16), ge.bits16(xv[2 * i + 1 : 2 * i + 2], f16)) for i in range(4)]
    for j, p in enumerate(ge.permute_x8(xw)):
        lo, hi = ge.halves(p, f16)
        assert (lo[0], hi[0]) == (xv[j], xv[j + 4])


def test_bf16_offset_keeps_every_sum_finite_and_small_products_normal() -> None:
    fp32_max = float(np.finfo(np.float32).max)
    bf16_max = float(np.array([0x7F7F0000], dtype=np.uint32).view(np.float32)[0])
    assert bf16_max * 2688.0 * OFFSET[False] * 24576 < fp32_max  # the header's range claim
    assert 2.0**-100 * OFFSET[False] >= float(np.finfo(np.float32).tiny)  # |x w| >= 2^-100: normal
    assert 65504.0 * 2688.0 * OFFSET[True] < 2.0**14 and 2.0**-24 * 2.0**-10 * OFFSET[True] >= 2.0**-48


# ------------------------------------------------------------------ the whole kernel, emulated


def random_problem(
    m: int, n: int, k: int, f16: bool, seed: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """x as exact 16-bit values (several octaves), NVFP4 weights: (x values, x bits, codes, scales)."""
    rng = np.random.default_rng(seed)
    codes, scales = nvfp4.quantize(
        (rng.standard_normal((n, k)) * 2.0 ** rng.integers(-3, 4, (n, 1))).astype(np.float32)
    )
    x = (rng.standard_normal((m, k)) * 2.0 ** rng.integers(-4, 5, (m, k))).astype(np.float32)
    if f16:
        xv = x.astype(np.float16).astype(np.float64)
    else:
        xv = (x.view(np.uint32) & np.uint32(0xFFFF0000)).view(np.float32).astype(np.float64)
    return xv, ge.bits16(xv, f16), codes, scales


EMULATED = [(name, False, 20, 264) for name in VARIANTS] + [
    ("b128x256k64s4", True, 20, 264),
    ("w128x256k64s4", True, 20, 264),
    ("w128x256k128s3", True, 20, 264),
    ("b256x128k64s4", True, 20, 264),
    ("g128x256k64s5d", True, 20, 264),
    ("g192x256k64s4", True, 20, 264),
    ("g192x256k64s3p", True, 20, 264),
    ("g192x256k64s4", False, 200, 264),  # all three warpgroups' rows, the last tile partial
]


@pytest.mark.parametrize(("name", "f16", "m", "n"), EMULATED)
def test_emulated_kernel_matches_the_float64_reference(name: str, f16: bool, m: int, n: int) -> None:
    cfg = VARIANTS[name]
    k = 3 * cfg.bk  # k-tiles: 3, against rings of 3 and 4 slots
    xv, xb, codes, scales = random_problem(m, n, k, f16, hash(name) % 1000)
    y, written = emulator(cfg, n, k, f16).run(xb, nvfp4.pack_codes(codes), scales, 0.375)
    ref = xv @ nvfp4.dequantize(codes, scales).T * 0.375
    assert (written == 1).all()
    np.testing.assert_allclose(y, ref, rtol=1e-12, atol=1e-12 * np.abs(ref).max())


@pytest.mark.parametrize(("name", "group_m"), [("b128x256k64s4", 2), ("w128x128k64s4", 3)])
def test_emulated_kernel_over_many_row_tiles_and_one_k_tile(name: str, group_m: int) -> None:
    cfg = dataclasses.replace(VARIANTS[name], group_m=group_m)
    m, n, k = 3 * cfg.bm + 5, 2 * cfg.bn + 8, cfg.bk
    xv, xb, codes, scales = random_problem(m, n, k, False, 7)
    y, written = ge.GemmEmulator(cfg, n, k, False).run(xb, nvfp4.pack_codes(codes), scales, 1.0)
    assert (written == 1).all()
    ref = xv @ nvfp4.dequantize(codes, scales).T
    np.testing.assert_allclose(y, ref, rtol=1e-12, atol=1e-12 * np.abs(ref).max())


# ------------------------------------------------------------ layout, banks, raster and ring


def _conflicts(access: ge.Access) -> int:
    """Extra shared-memory wavefronts of one warp access (0: conflict-free or broadcast)."""
    per_phase = 32 if access.width < 4 else 128 // access.width
    extra = 0
    for start in range(0, 32, per_phase):
        addrs = access.addrs[start : start + per_phase]
        words = {int(a) // 4 + i for a in addrs for i in range(max(1, access.width // 4))}
        banks: dict[int, set[int]] = {}
        for word in words:
            banks.setdefault(word % 32, set()).add(word)
        extra += max(len(v) for v in banks.values()) - 1
    return extra


@pytest.mark.parametrize("name", list(VARIANTS))
def test_no_bank_conflicts_in_any_fragment_read_or_decode_write(name: str) -> None:
    cfg = VARIANTS[name]
    emu = emulator(cfg, cfg.bn, cfg.bk * 2, False, log=True)
    _, xb, codes, scales = random_problem(cfg.bm, cfg.bn, cfg.bk * 2, False, 1)
    emu.run(xb, nvfp4.pack_codes(codes), scales, 1.0)
    kinds = {a.kind for a in emu.accesses}
    if cfg.rs:  # each thread decodes its A fragments from 8-byte code reads and its rows' scale words
        assert kinds >= {"lds64-code", "lds32-scale"}
    elif cfg.producer:  # its decode reads whole 16-byte code units and the row's 4 scale bytes
        assert kinds >= {"lds128-codes", "lds32-scales", "sts128-decode"}
    elif cfg.bdec:  # (wgmma reads its operands itself, through descriptors)
        assert kinds >= {"lds64-decode", "sts128-decode", "lds8-decode"} | (set() if cfg.wgmma else {"ldmatrix"})
    else:
        assert kinds >= {"lds128-x", "lds64-code", "lds8-scale"}
    bad = [(a.kind, _conflicts(a)) for a in emu.accesses if _conflicts(a)]
    assert not bad, bad[:5]


# WS and rs: their own tests (test_gemm_wgmma, test_gemm_rs)
@pytest.mark.parametrize("name", [name for name, cfg in VARIANTS.items() if not (cfg.producer or cfg.rs)])
def test_one_issue_writes_every_byte_of_its_ring_slot_once(name: str) -> None:
    cfg = VARIANTS[name]
    emu = ge.GemmEmulator(cfg, cfg.bn + 8, 2 * cfg.bk, False, log=True)
    _, xb, codes, scales = random_problem(cfg.bm - 3, cfg.bn + 8, 2 * cfg.bk, False, 2)
    emu.load(xb, nvfp4.pack_codes(codes), scales)
    emu.setup(bid=0)
    for slot in range(cfg.stages):
        emu.copies = []
        emu.issue(1, slot)
        count = np.zeros(cfg.smem_bytes(), dtype=int)
        for dst, nbytes in emu.copies:
            np.add.at(count, dst[:, None] + np.arange(nbytes), 1)
        stage = cfg.stage_bytes()
        assert (count[slot * stage : (slot + 1) * stage] == 1).all()
        assert count.sum() == stage


@pytest.mark.parametrize("name", [name for name, cfg in VARIANTS.items() if cfg.bdec and not (cfg.producer or cfg.rs)])
def test_one_decode_writes_every_byte_of_its_tile_once(name: str) -> None:
    cfg = VARIANTS[name]  # (with 384 threads the last of 3 items is the first 256 threads')
    emu = ge.GemmEmulator(cfg, cfg.bn, cfg.bk, False, log=True)
    _, xb, codes, scales = random_problem(cfg.bm, cfg.bn, cfg.bk, False, 4)
    emu.load(xb, nvfp4.pack_codes(codes), scales)
    emu.setup(bid=0)
    emu.issue(0, 0)
    for buf in range(emu.NBUF):
        emu.accesses = []
        for p in range(emu.ITEMS):
            emu.decode_item(0, buf, p)
        count = np.zeros(cfg.smem_bytes(), dtype=int)
        for a in emu.accesses:
            if a.kind == "sts128-decode":
                np.add.at(count, a.addrs[:, None] + np.arange(16), 1)
        tile = emu.dbase + buf * cfg.kh * cfg.bn * 128
        assert (count[tile : tile + cfg.kh * cfg.bn * 128] == 1).all() and count.sum() == cfg.kh * cfg.bn * 128


@pytest.mark.parametrize("group_m", [1, 3, 8])
@pytest.mark.parametrize("m", [1, 127, 128 * 13 + 5, 4096])
def test_raster_gives_every_output_tile_to_one_block(m: int, group_m: int) -> None:
    cfg = dataclasses.replace(GemmConfig(), group_m=group_m)
    emu = ge.GemmEmulator(cfg, 21504 + 64, 5376, False)
    tiles = [emu.tile(bid, m) for bid in range(cfg.blocks(m, emu.n))]
    want = {(i * cfg.bm, j * cfg.bn) for i in range(-(-m // cfg.bm)) for j in range(-(-emu.n // cfg.bn))}
    assert len(tiles) == len(set(tiles)) and set(tiles) == want


def ring_schedule(stages: int, bdec: bool, kt_count: int, deep: bool = False) -> None:
    """Mirror of the kernel's pipeline lines under cp.async's rules, asserting the ring discipline.

    Between two barriers every thread may be anywhere: a slot or decoded tile written in an
    interval must not be read in it, and what is read must have landed (its group waited for by
    every thread) before the interval's barrier. With `deep`, a k-tile's MMAs (asynchronous) still
    read their slot and decoded tile in the next interval.
    """
    lead, held = (1 if bdec else 0), (1 if deep else 0)
    nbufs = 2 + held
    groups: list[tuple[int, int] | None] = []  # committed groups: (k-tile, slot) or empty
    landed: set[tuple[int, int]] = set()  # groups complete at the last barrier
    slot_holds: dict[int, int] = {}  # what each ring slot was last filled with
    dec_holds: dict[int, int] = {}  # what each decoded buffer was last written with
    interval: dict[str, set[tuple[str, int]]] = {"w": set(), "r": set()}
    carry: set[tuple[str, int]] = set()  # reads of MMAs still running after the next barrier

    def barrier(pending: int) -> None:
        nonlocal interval, carry
        assert not (interval["w"] & interval["r"]), f"read and rewritten between two barriers: {interval}"
        done = groups[: len(groups) - pending] if pending else groups
        landed.update(gr for gr in done if gr is not None)
        interval, carry = {"w": set(), "r": set(carry)}, set()

    def issue(kt: int, slot: int) -> None:
        groups.append((kt, slot) if kt < kt_count else None)
        if kt < kt_count:
            interval["w"].add(("slot", slot))
            slot_holds[slot] = kt

    def read_slot(slot: int, kt: int, mma: bool = False) -> None:
        assert slot_holds.get(slot) == kt and (kt, slot) in landed, f"k-tile {kt} not in slot {slot}"
        interval["r"].add(("slot", slot))
        if mma and deep:
            carry.add(("slot", slot))

    def decode(slot: int, buf: int, kt: int) -> None:
        if kt < kt_count:
            read_slot(slot, kt)
        else:  # past the last k-tile: whatever the slot holds, into a buffer nothing reads again
            interval["r"].add(("slot", slot))
        interval["w"].add(("dec", buf))
        dec_holds[buf] = kt

    for s in range(stages - 1 - held):  # the kernel's lines, in order
        issue(s, s)
    slot, refill, buf = 0, stages - 1 - held, 0
    if bdec:
        barrier(stages - 2 - held)
        decode(0, 0, 0)
    for kt in range(kt_count):
        barrier(stages - 2 - lead - held)
        issue(kt + stages - 1 - held, refill)
        nxt = 0 if slot + 1 == stages else slot + 1
        nbuf = 0 if buf + 1 == nbufs else buf + 1
        if bdec:
            assert dec_holds.get(buf) == kt
            interval["r"].add(("dec", buf))
            if deep:
                carry.add(("dec", buf))
            read_slot(slot, kt, mma=True)
            decode(nxt, nbuf, kt + 1)
        else:
            read_slot(slot, kt, mma=True)
        refill = 0 if refill + 1 == stages else refill + 1
        slot, buf = nxt, nbuf
    barrier(0)


@pytest.mark.parametrize("kt_count", [1, 2, 3, 4, 9])
@pytest.mark.parametrize(
    ("stages", "bdec", "deep"),
    [(2, False, False), (3, False, False), (4, False, False), (3, True, False), (4, True, False), (5, True, False),
     (4, True, True), (5, True, True)],
)  # fmt: skip
def test_ring_discipline(stages: int, bdec: bool, deep: bool, kt_count: int) -> None:
    ring_schedule(stages, bdec, kt_count, deep)


def test_the_ring_check_fails_on_a_ring_one_slot_short() -> None:
    with pytest.raises(AssertionError):
        ring_schedule(2, True, 4)  # block decode needs a third slot: decode reads what is refilled
    with pytest.raises(AssertionError):
        ring_schedule(3, True, 4, deep=True)  # MMAs in flight across the barrier hold one slot more


# ------------------------------------------------------------------------ variants and support


def test_variant_table_fits_the_seed_shape_and_the_default_is_in_it(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, cfg in VARIANTS.items():
        assert cfg.reason(21504, 5376) is None, name
        assert cfg.reason(1004, 5376) is not None  # N % 8
    assert DEFAULT_VARIANT in VARIANTS and variant_for(512) in VARIANTS
    monkeypatch.delenv(VARIANT_ENV, raising=False)
    # Hopper: the register-sourced wgmma kernel at every M (the lab's winner there, BENCHMARKS.md)
    assert [variant_for(m) for m in (16, 512, 513, 16384)] == ["r256x128k64s5qey"] * 4
    portable = [variant_for(m, wgmma=False) for m in (512, 513, 16384)]
    assert portable == ["b128x128k64s3", "b256x128k64s4", "b256x128k64s4"]
    monkeypatch.setenv(VARIANT_ENV, "w128x256k64s4")
    assert variant_for(16) == variant_for(16384) == "w128x256k64s4"
    monkeypatch.setenv(VARIANT_ENV, "b128x128k64s3@1024, w128x128k64s4@4096,b256x128k64s4")
    assert [variant_for(m) for m in (9, 1024, 1025, 4096, 4097)] == ["b128x128k64s3"] * 2 + ["w128x128k64s4"] * 2 + [
        "b256x128k64s4"
    ]
    for bad, match in (("nope", "nope"), ("b128x256k64s4@x", "bound"), ("b128x256k64s4@512", "last entry")):
        monkeypatch.setenv(VARIANT_ENV, bad)
        with pytest.raises(ValueError, match=match):
            variant_for(512)
    assert parse_rule("b128x256k64s4") == [(None, "b128x256k64s4")]
    assert "K=160" in (GemmConfig().reason(256, 160) or "")
    assert "shared memory" in (GemmConfig(stages=9).reason(256, 512) or "")


@pytest.fixture
def fake_h200(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(gemm_nvfp4, "cuda_device", lambda: CudaDevice("fake H200", 132, (9, 0), 232448))
    gemm_nvfp4.kernel_supports.cache_clear()
    gemm_nvfp4.wgmma_runs_here.cache_clear()
    yield
    gemm_nvfp4.kernel_supports.cache_clear()
    gemm_nvfp4.wgmma_runs_here.cache_clear()


def test_kernel_supports_16_bit_activations_on_sm89_plus(monkeypatch: pytest.MonkeyPatch, fake_h200: None) -> None:
    assert gemm_nvfp4.kernel_supports(512, 21504, 5376, "bfloat16") is None
    assert gemm_nvfp4.kernel_supports(9, 64, 128, "float16") is None
    assert "float32" in (gemm_nvfp4.kernel_supports(512, 21504, 5376, "float32") or "")
    assert "K=" in (gemm_nvfp4.kernel_supports(512, 256, 160, "bfloat16") or "")
    assert "unknown" in (gemm_nvfp4.kernel_supports(512, 256, 256, "bfloat16", "b1x1") or "")
    monkeypatch.setattr(gemm_nvfp4, "cuda_device", lambda: CudaDevice("fake A100", 108, (8, 0), 166912))
    gemm_nvfp4.kernel_supports.cache_clear()
    assert "8.9" in (gemm_nvfp4.kernel_supports(512, 21504, 5376, "bfloat16") or "")
    monkeypatch.setattr(gemm_nvfp4, "cuda_device", lambda: CudaDevice("fake L4", 58, (8, 9), 101376))
    gemm_nvfp4.kernel_supports.cache_clear()
    assert "shared memory" in (gemm_nvfp4.kernel_supports(512, 21504, 5376, "bfloat16", "b128x256k64s4") or "")
    gemm_nvfp4.wgmma_runs_here.cache_clear()
    assert gemm_nvfp4.kernel_supports(512, 21504, 5376, "bfloat16") is None  # the portable default fits


# --------------------------------------------------------------------------------- the twin


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16, mx.float32])
@pytest.mark.parametrize("global_scale", [None, 3.5])
def test_twin_matches_the_float64_reference(dtype: mx.Dtype, global_scale: float | None) -> None:
    rng = np.random.default_rng(11)
    m, n, k = 24, 48, 128
    w = rng.standard_normal((n, k)).astype(np.float32)
    codes, scales = nvfp4.quantize(w, global_scale)
    x = mx.array(rng.standard_normal((m, k)).astype(np.float32)).astype(dtype)
    x64 = np.array(x.astype(mx.float32)).astype(np.float64)
    got = gemm_nvfp4_twin(x, mx.array(nvfp4.pack_codes(codes)), mx.array(scales), global_scale)
    assert got.dtype == dtype and got.shape == (m, n)
    ref = x64 @ nvfp4.dequantize(codes, scales, global_scale).T
    rel = np.linalg.norm(np.array(got.astype(mx.float32)) - ref) / np.linalg.norm(ref)
    assert rel < gemm_nvfp4.TOLERANCE[str(dtype).removeprefix("mlx.core.")] / 4
    if global_scale is not None:  # the global scale matters: dropping it is far off
        wrong = gemm_nvfp4_twin(x, mx.array(nvfp4.pack_codes(codes)), mx.array(scales), None)
        assert np.linalg.norm(np.array(wrong.astype(mx.float32)) - ref) / np.linalg.norm(ref) > 0.5


@pytest.mark.skipif(cuda_backend_available(), reason="checks the fallback off CUDA")
def test_without_cuda_the_twin_runs_and_the_route_says_so() -> None:
    assert gemm_nvfp4.route(512, 21504, 5376) == "mlx-twin(x @ dequantize_exact)"
    rng = np.random.default_rng(5)
    codes, scales = nvfp4.quantize(rng.standard_normal((16, 64)).astype(np.float32))
    x = mx.array(rng.standard_normal((10, 64)).astype(np.float32)).astype(mx.bfloat16)
    wq, sc = mx.array(nvfp4.pack_codes(codes)), mx.array(scales)
    assert np.array_equal(np.array(gemm_nvfp4.gemm_nvfp4(x, wq, sc).astype(mx.float32)),
                          np.array(gemm_nvfp4_twin(x, wq, sc).astype(mx.float32)))  # fmt: skip


# ---------------------------------------------------------------- compile here, run on CUDA


COMPILED = [(name, "bfloat16") for name, cfg in VARIANTS.items() if not cfg.wgmma]
COMPILED += [("b128x256k64s4", "float16"), ("w128x256k128s3", "float16")]


def standalone_unit(kernels: list[tuple[str, str]]) -> str:
    """Variants (name, dtype) as MLX assembles them, in one translation unit for one nvcc call."""
    parts = []
    for i, (name, dtype) in enumerate(kernels):
        consts = {"T": dtype, **VARIANTS[name].template(21504, 5376, dtype == "float16")}
        sig = ({"x": dtype, "w": "uint32", "scales": "uint8", "gsv": "float32"}, {"y": dtype})
        fn = f"gemm_{name}_{dtype}"
        parts.append(GEMM_SOURCE.standalone_source(*sig, consts, function_name=fn, prelude=i == 0))
    return "\n".join(parts)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc (the CUDA toolkit) for the offline compile check")
def test_every_variant_compiles_for_sm90_without_spills(tmp_path: Path) -> None:
    src = tmp_path / "gemm.cu"
    src.write_text(standalone_unit(COMPILED))
    cubin = tmp_path / "gemm.cubin"
    res = subprocess.run(
        ["nvcc", "-arch=sm_90", "-std=c++17", "-cubin", "-Xptxas", "-v", str(src), "-o", str(cubin)],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    reports = re.findall(r"Compiling entry function '(\w+)'.*?Used (\d+) registers", res.stderr, re.S)
    assert len(reports) == len(COMPILED)
    assert res.stderr.count(" 0 bytes spill stores, 0 bytes spill loads") == len(reports), res.stderr
    assert all(int(regs) <= 255 for _, regs in reports)
    if shutil.which("cuobjdump") is None:
        pytest.skip("compiled without spills; cuobjdump (for the SASS check) is not installed")
    sass = subprocess.run(["cuobjdump", "-sass", str(cubin)], capture_output=True, text=True, check=True).stdout
    for fn in re.split(r"\n\s*Function : ", sass)[1:]:
        name = fn.split("\n", 1)[0]
        assert "HMMA.16816.F32.BF16" in fn or "HMMA.16816.F32" in fn, name
        assert "LDGSTS" in fn and "BAR.SYNC" in fn, name
        assert ("LDSM" in fn) == ("_b" in name.split("gemm")[-1][:2]), name  # ldmatrix: block decode only


def test_wgmma_variants_need_compute_capability_9_0_and_nvrtc(monkeypatch: pytest.MonkeyPatch, fake_h200: None) -> None:
    name = "g128x256k64s4"
    monkeypatch.setattr(nvrtc, "library", lambda: object())
    gemm_nvfp4.kernel_supports.cache_clear()
    assert gemm_nvfp4.kernel_supports(512, 21504, 5376, "bfloat16", name) is None
    monkeypatch.setattr(nvrtc, "library", lambda: None)
    gemm_nvfp4.kernel_supports.cache_clear()
    assert "NVRTC" in (gemm_nvfp4.kernel_supports(512, 21504, 5376, "bfloat16", name) or "")
    monkeypatch.setattr(gemm_nvfp4, "cuda_device", lambda: CudaDevice("fake L40S", 142, (8, 9), 101376))
    gemm_nvfp4.kernel_supports.cache_clear()
    assert "9.0 only" in (gemm_nvfp4.kernel_supports(512, 21504, 5376, "bfloat16", name) or "")
    assert GemmConfig(wm=8, wn=1, tm=1, tn=32, wgmma=True, deep=True, stages=4).reason(21504, 5376) is None
    assert "too few" in (GemmConfig(wm=8, wn=1, tm=1, tn=32, wgmma=True, deep=True, stages=3).reason(21504, 5376) or "")
    assert "wgmma needs" in (GemmConfig(wgmma=True).reason(21504, 5376) or "")


# every variant at the seed's shape and at tails in M, N and K (bfloat16); float16 for one variant
# of each kind (each new N, K or dtype is one NVRTC build on the GPU)
CUDA_CASES = [(name, mx.bfloat16, shape) for name in VARIANTS for shape in ((300, 520, 256), (512, 21504, 5376))]
F16_CASES = ("b128x256k64s4", "w128x256k64s4", "g128x256k64s5d", "g192x256k64s4", "g192x256k64s3p", "g128x256k64s4p",
             "r256x128k64s6", "r128x256k64s6")  # fmt: skip
CUDA_CASES += [(name, mx.float16, (20, 264, 384)) for name in F16_CASES]
# the rings of the warp-specialised variants wrap several times (K = 1536: 24 k-tiles), every
# consumer warpgroup's rows in play and the last tile partial in M and N
CUDA_CASES += [(name, mx.bfloat16, (200, 264, 1536)) for name, cfg in VARIANTS.items() if cfg.wgmma]


@needs_cuda
@pytest.mark.cuda
@pytest.mark.parametrize(("name", "dtype", "shape"), CUDA_CASES)
def test_kernel_matches_its_twin_on_cuda(name: str, dtype: mx.Dtype, shape: tuple[int, int, int]) -> None:
    m, n, k = shape
    reason = gemm_nvfp4.kernel_supports(m, n, k, str(dtype).removeprefix("mlx.core."), name)
    if reason is not None:
        pytest.skip(reason)
    err, nan = twin_error(name, dtype, m, n, k)  # the output NaN before the kernel
    assert nan == 0, "unwritten (NaN) outputs"
    assert err < gemm_nvfp4.TOLERANCE[str(dtype).removeprefix("mlx.core.")]
    arch = "sm_90a" if VARIANTS[name].wgmma else nvrtc.device_arch()  # our NVRTC build, else MLX's JIT
    build = f"precompiled {arch}" if arch else "cuda_kernel"
    assert gemm_nvfp4.route(m, n, k, str(dtype).removeprefix("mlx.core."), name) == f"{build}(gemm_nvfp4:{name})"


@needs_cuda
@pytest.mark.cuda
def test_the_qmm_custom_arm_runs_the_gemm_at_prefill_on_cuda() -> None:
    from kernels import qmm
    from kernels.checking import relative_error

    rng = np.random.default_rng(3)
    wl = qmm.build({"tokens": 512, "n": 2048, "k": 1024, "dtype": "bfloat16"}, ["custom", "auto"], rng)
    (x,) = wl.make_inputs(rng)
    route = wl.arms["custom"].route
    assert "(gemm_nvfp4:" in route, route
    got = np.array(wl.arms["custom"].run(x).astype(mx.float32)).astype(np.float64)
    assert relative_error(got, wl.reference("custom", x)) < wl.arms["custom"].tolerance
