"""The stream GEMV kernel (`kernels/cuda/gemv_nvfp4.cu`) on a machine without a GPU.

Its logic is checked through NumPy mirrors of its lines: the E2M1 -> E4M3 -> f16 decode of
`nvfp4_mma.cuh` exhaustively; the bookkeeping (rows per block, chunks per warp, split tiles and who
adds them up, the copy lanes, the swizzles and the bank-conflict freedom of the fragment reads)
over many shapes; the activation scaling; and the whole kernel, lane by lane with the MMA's
fragment layouts, against the float64 reference. The kernel itself runs against its twin in
test_custom_kernels.py where there is CUDA.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import mlx.core as mx
import numpy as np
import pytest

from kernels import gemv_nvfp4, nvfp4
from kernels.cuda import SMALL_POOL_BYTES, CudaDevice, off_small_pool, read_source
from kernels.cuda.layout import scale_row_bytes, stream_smem_bytes
from kernels.gemv_nvfp4 import STREAM_CONFIG, GemvConfig, stream_launch

E4M3 = nvfp4.decode_e4m3(np.arange(256, dtype=np.uint8)).astype(np.float64)


# ----------------------------------------------------------------------------- decode mirrors


def e4m3_bytes(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Mirror of the two lines of nvfp4::e2m1_word_to_f16 (umulhi(v, 2^30) is v >> 2)."""
    w = w.astype(np.uint32)
    hi = (w & np.uint32(0x80808080)) | ((w & np.uint32(0x70707070)) >> np.uint32(2))
    lo = ((w << np.uint32(2)) & np.uint32(0x1C1C1C1C)) | ((w << np.uint32(4)) & np.uint32(0x80808080))
    return lo, hi


def f16_pairs(w: np.ndarray) -> np.ndarray:
    """The four f16x2 registers of a code word as values [..., 4, 2]: (0,2) (4,6) (1,3) (5,7)."""
    lo, hi = e4m3_bytes(w)
    out = np.zeros((*w.shape, 4, 2))
    for reg, (word, half) in enumerate([(lo, 0), (lo, 1), (hi, 0), (hi, 1)]):
        for h in range(2):
            byte = (word >> np.uint32(16 * half + 8 * h)) & np.uint32(0xFF)
            out[..., reg, h] = E4M3[byte]
    return out


def test_the_mirrored_lines_are_the_header_s() -> None:
    header = read_source("nvfp4_mma.cuh")
    assert "const uint32_t hi = (w & 0x80808080u) | __umulhi(w & 0x70707070u, 0x40000000u);" in header
    assert "const uint32_t lo = ((w << 2) & 0x1C1C1C1Cu) | ((w << 4) & 0x80808080u);" in header
    assert "cvt.rn.f16x2.e4m3x2" in header
    body = read_source("gemv_nvfp4.cu")
    assert "o.x = __byte_perm(h[0], h[1], 0x5410);" in body and "o.w = __byte_perm(h[2], h[3], 0x7632);" in body


def test_e2m1_to_f16_decode_is_exact_for_every_code_at_every_nibble() -> None:
    rng = np.random.default_rng(1)
    order = [(0, 2), (4, 6), (1, 3), (5, 7)]
    for pos in range(8):
        for code in range(16):
            w = rng.integers(0, 2**32, 64, dtype=np.uint64).astype(np.uint32)
            w = (w & np.uint32(~(0xF << (4 * pos)) & 0xFFFFFFFF)) | np.uint32(code << (4 * pos))
            got = f16_pairs(w)
            reg, half = next((r, h) for r, pair in enumerate(order) for h, c in enumerate(pair) if c == pos)
            np.testing.assert_array_equal(got[:, reg, half], nvfp4.E2M1_VALUES[code] * 2.0**-6)


def test_every_scaled_weight_is_an_f16() -> None:
    # E2M1 * 2^-6 times every finite E4M3 scale: exact in f16 (subnormals included), so the
    # kernel's f16 multiply rounds nothing
    finite = E4M3[np.isfinite(E4M3)]
    assert np.array_equal(finite.astype(np.float16).astype(np.float64), finite)
    prod = (nvfp4.E2M1_VALUES.astype(np.float64) * 2.0**-6)[:, None] * finite[None, :]
    assert np.array_equal(prod.astype(np.float16).astype(np.float64), prod)


def x_exponent(x: np.ndarray) -> int:
    """Mirror of the kernel's choice of 2^xexp for bfloat16 activations."""
    mx_ = float(np.abs(x).max())
    if not (0.0 < mx_ <= 3.0e38):
        return 0
    return min(15 - int(np.frexp(mx_)[1]), 127)


@pytest.mark.parametrize("octave", [-126, -120, -60, -20, 0, 14, 15, 16, 60, 120])
def test_activation_scaling_keeps_every_value_within_2_to_the_minus_39_of_max(octave: int) -> None:
    rng = np.random.default_rng(octave + 200)
    x32 = ((rng.standard_normal(4096) * 2.0 ** rng.integers(-50, 1, 4096)) * 2.0**octave).astype(np.float32)
    x = (x32.view(np.uint32) & np.uint32(0xFFFF0000)).view(np.float32).astype(np.float64)  # bfloat16 values
    e = x_exponent(x)
    assert -113 <= e <= 127  # 2^e is a normal float32: the kernel's one multiply per value is exact
    scaled = np.ldexp(x, e)
    back = np.ldexp(scaled.astype(np.float16).astype(np.float64), -e)
    if e < 127:
        assert 2.0**14 <= np.abs(scaled).max() < 2.0**15
    else:  # max |x| < 2^-112: every nonzero bfloat16 (>= 2^-133) lands on an f16 normal
        assert np.abs(scaled).max() < 2.0**15 and np.abs(scaled[x != 0]).min() >= 2.0**-6
        assert np.array_equal(back, x)
    normal = np.abs(scaled) >= 2.0**-14  # f16 normals hold a bfloat16's 8 bits exactly
    assert normal.any() and np.array_equal(back[normal], x[normal])
    assert np.abs(back - x).max() <= np.abs(x).max() * 2.0**-39


# ------------------------------------------------------------------------- the bookkeeping


Block = tuple[int, int, int, list[tuple[int, int]], int]  # r0, r1, units, warp ranges, chunks per tile


def partition(n: int, k: int, blocks: int, warps: int, chunk: int) -> list[Block]:
    """Mirror of the kernel's split of rows and chunks (its lines, in Python), one entry a block."""
    steps = k // 128
    cpt = -(-steps // chunk)
    result: list[Block] = []
    for b in range(blocks):
        r0 = 8 * (b * (n // 8) // blocks)
        r1 = 8 * ((b + 1) * (n // 8) // blocks)
        units = (r1 - r0 + 15) // 16 * cpt
        ranges = [(w * units // warps, (w + 1) * units // warps) for w in range(warps)]
        result.append((r0, r1, units, ranges, cpt))
    return result


def owner(c: int, units: int, warps: int) -> int:
    return ((c + 1) * warps - 1) // units


SHAPES = [(21504, 5376), (1000, 384), (256, 640), (4096, 4096), (2048, 1024), (72, 128), (16, 256), (8, 128)]


@pytest.mark.parametrize(("n", "k"), SHAPES)
@pytest.mark.parametrize("sms", [132, 114, 16])
def test_every_row_and_step_is_computed_once_and_every_tile_stored_once(n: int, k: int, sms: int) -> None:
    blocks, warps, _ = stream_launch(1, n, k, STREAM_CONFIG, sms)
    assert 1 <= blocks <= min(sms, n // 8)
    part = partition(n, k, blocks, warps, STREAM_CONFIG.chunk)
    covered = np.zeros((n, k // 128), dtype=int)
    stored = np.zeros(n, dtype=int)
    maxt = ((n // 8 + blocks - 1) // blocks + 1) // 2 + 1
    for r0, r1, units, ranges, cpt in part:
        assert r1 > r0 and units >= warps, "every warp has a chunk (the owner formula relies on it)"
        assert (r1 - r0 + 15) // 16 <= maxt
        for u in range(units):  # the owner formula is the warp whose range holds the chunk
            assert [w for w, (a, e) in enumerate(ranges) if a <= u < e] == [owner(u, units, warps)]
        for a, e in ranges:
            for u in range(a, e):
                tile, c = divmod(u, cpt)
                for s in range(c * STREAM_CONFIG.chunk, min((c + 1) * STREAM_CONFIG.chunk, k // 128)):
                    rows = range(r0 + 16 * tile, min(r0 + 16 * tile + 16, r1))
                    covered[list(rows), s] += 1
        for tile in range((r1 - r0 + 15) // 16):
            first, last = tile * cpt, (tile + 1) * cpt - 1
            v0, v1 = owner(first, units, warps), owner(last, units, warps)
            parts = [v for v in range(v0, v1 + 1) if ranges[v][0] < ranges[v][1]]
            assert parts == list(range(v0, v1 + 1))
            # each contributing warp's slot: 0 where the tile is its first, else 1 (flush's rule),
            # and the finishing warp reads the same slots back
            for v in parts:
                head = ranges[v][0] // cpt
                slot = 0 if tile == head else 1
                assert slot == (0 if ranges[v][0] >= tile * cpt else 1)
            rows = range(r0 + 16 * tile, min(r0 + 16 * tile + 16, r1))
            stored[list(rows)] += 1
    assert (covered == 1).all() and (stored == 1).all()


@pytest.mark.parametrize("chunk", [2, 4])
def test_copy_lanes_fill_each_slot_once_and_fragment_reads_find_their_codes(chunk: int) -> None:
    lpr, rowb = chunk * 4, chunk * 64
    rpi = 32 // lpr
    written: dict[int, tuple[int, int]] = {}  # slot byte offset (16-byte unit) -> (row, source unit)
    for lane in range(32):
        crow, cq = lane // lpr, lane % lpr
        cdst = crow * rowb + (cq ^ ((crow & 1) << 2)) * 16
        for i in range(16 // rpi):
            off = rpi * i * rowb + cdst
            assert off not in written
            written[off] = (rpi * i + crow, cq)
    assert len(written) == 16 * lpr
    for g, t, j in itertools.product(range(8), range(4), range(chunk)):
        jo = (j ^ (g & 1)) * 64
        for row in (g, g + 8):
            # the lane's 16 bytes of step j are source unit 4 j + t of its row
            assert written[row * rowb + t * 16 + jo] == (row, 4 * j + t)
    # each quarter-warp's 16-byte reads of one step land in 8 distinct bank groups
    for j in range(chunk):
        for quarter in range(4):
            lanes = range(8 * quarter, 8 * quarter + 8)
            groups = {((lane >> 2) * rowb + (lane & 3) * 16 + (j ^ ((lane >> 2) & 1)) * 64) // 16 % 8 for lane in lanes}
            assert len(groups) == 8


@pytest.mark.parametrize("k", [128, 384, 5376])
@pytest.mark.parametrize("m", [1, 2, 5, 8])
def test_x_pieces_land_where_the_fragment_reads_look_and_banks_do_not_collide(m: int, k: int) -> None:
    xch = k // 8
    xrs = ((xch + 7) // 8 * 8 + 2) * 16
    for s, t, i in itertools.product(range(k // 128), range(4), range(4)):
        c = 16 * s + 4 * t + i
        assert (c ^ ((c >> 3) & 1)) == 16 * s + 4 * t + (i ^ (t >> 1))
    for s, i in itertools.product(range(k // 128), range(4)):
        for quarter in range(4):
            addrs = set()
            for lane in range(8 * quarter, 8 * quarter + 8):
                g, t = lane >> 2, lane & 3
                row = min(g, m - 1)
                addrs.add(row * xrs + t * 64 + s * 256 + (i ^ (t >> 1)) * 16)
            groups = {a // 16 % 8 for a in addrs}
            assert len(groups) == len(addrs), "distinct pieces in one bank group"


@pytest.mark.parametrize("chunk", [2, 4])
def test_scale_copies_and_reads_agree(chunk: int) -> None:
    srow_b = scale_row_bytes(chunk)
    slot: dict[int, tuple[int, int]] = {}
    for lane in range(32):
        srow, shalf = lane >> 1, lane & 1
        for byte in range(4 * chunk):
            assert srow * srow_b + shalf * 4 * chunk + byte not in slot
            slot[srow * srow_b + shalf * 4 * chunk + byte] = (srow, (chunk // 2) * shalf * 8 + byte)
    assert all(off + 1 <= 16 * srow_b for off in slot)
    for g, t, j in itertools.product(range(16), range(4), range(chunk)):
        for b in range(2):  # the lane's two scale bytes of step j: groups 2t, 2t+1 of the step
            assert slot[g * srow_b + j * 8 + t * 2 + b] == (g, j * 8 + t * 2 + b)
    # the 8 rows g of one step's reads fall in distinct 4-byte banks
    assert len({(g * srow_b) // 4 % 32 for g in range(8)}) == 8


# ------------------------------------------------------------- the whole kernel, lane by lane


def mma_f16(c: np.ndarray, a: np.ndarray, b: np.ndarray) -> None:
    """mma.sync.m16n8k16 with f16 operands given as values: a [32, 4, 2], b [32, 2, 2]."""
    am = np.zeros((16, 16))
    bm = np.zeros((16, 8))
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        for reg, (row, col) in enumerate([(g, 2 * t), (g + 8, 2 * t), (g, 2 * t + 8), (g + 8, 2 * t + 8)]):
            am[row, col], am[row, col + 1] = a[lane, reg]
        for reg, krow in enumerate([2 * t, 2 * t + 8]):
            bm[krow, g], bm[krow + 1, g] = b[lane, reg]
    cm = am @ bm
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        c[lane] += [cm[g, 2 * t], cm[g, 2 * t + 1], cm[g + 8, 2 * t], cm[g + 8, 2 * t + 1]]


def emulate_stream(x: np.ndarray, packed: np.ndarray, scales: np.ndarray, gsv: float) -> np.ndarray:
    """gemv_nvfp4.cu's arithmetic for one 16-row tile at a time (its partition is checked above):
    x as f16 times 2^xexp in fragment order, codes decoded per word, scaled, two f16 MMAs a word."""
    m, k = x.shape
    n = packed.shape[0]
    e = x_exponent(x)
    xf = np.ldexp(x.astype(np.float64), e).astype(np.float16).astype(np.float64)
    y = np.zeros((m, n))
    for r0 in range(0, n, 16):
        acc = np.zeros((32, 4))
        for s in range(k // 128):
            for i in range(4):  # the four words of this lane's 32 codes
                a = np.zeros((32, 2, 4, 2))  # [lane][row g / g+8][reg][half]
                b = np.zeros((32, 4, 2))
                for lane in range(32):
                    g, t = lane >> 2, lane & 3
                    k0 = s * 128 + t * 32 + 8 * i
                    for h, row in enumerate((r0 + g, r0 + g + 8)):
                        if row < n:
                            scale = E4M3[scales[row, k0 // 16]]
                            a[lane, h] = f16_pairs(np.array([packed[row, k0 // 8]], dtype=np.uint32))[0] * scale
                    xr = xf[min(g, m - 1), k0 : k0 + 8]
                    b[lane] = [(xr[0], xr[2]), (xr[4], xr[6]), (xr[1], xr[3]), (xr[5], xr[7])]
                for first in (0, 2):  # mma_word_f16: registers P0 P1, then P2 P3
                    regs = np.stack([a[:, 0, first], a[:, 1, first], a[:, 0, first + 1], a[:, 1, first + 1]], axis=1)
                    mma_f16(acc, regs, b[:, first : first + 2])
        for lane in range(32):
            g, t = lane >> 2, lane & 3
            for cidx, (mm, rr) in enumerate([(2 * t, g), (2 * t + 1, g), (2 * t, g + 8), (2 * t + 1, g + 8)]):
                if mm < m and r0 + rr < n:
                    y[mm, r0 + rr] = acc[lane, cidx] * gsv * 2.0 ** (6 - e)
    return y


@pytest.mark.parametrize(("m", "n", "k", "x_octave"), [(1, 16, 128, 0), (3, 24, 256, -40), (8, 16, 128, 30)])
def test_emulated_stream_kernel_matches_the_float64_reference(m: int, n: int, k: int, x_octave: int) -> None:
    rng = np.random.default_rng(m + n + k)
    codes, scales = nvfp4.quantize(rng.standard_normal((n, k)).astype(np.float32))
    x32 = (rng.standard_normal((m, k)) * 2.0**x_octave).astype(np.float32)
    xb = (x32.view(np.uint32) & np.uint32(0xFFFF0000)).view(np.float32).astype(np.float64)  # bfloat16 values
    got = emulate_stream(xb, nvfp4.pack_codes(codes), scales, 0.5)
    ref = xb @ nvfp4.dequantize(codes, scales).T * 0.5
    np.testing.assert_allclose(got, ref, rtol=1e-9, atol=1e-9 * np.abs(ref).max())


# ------------------------------------------------------------------ which kernel runs where


@pytest.fixture
def fake_device(monkeypatch: pytest.MonkeyPatch) -> Iterator[CudaDevice]:
    device = CudaDevice("fake H200", 132, (9, 0), 232448)
    monkeypatch.setattr(gemv_nvfp4, "cuda_device", lambda: device)
    for fn in (gemv_nvfp4.stream_supports, gemv_nvfp4.ksplit_supports, gemv_nvfp4.kernel_supports):
        fn.cache_clear()
    gemv_nvfp4.choose_config.cache_clear()
    yield device
    for fn in (gemv_nvfp4.stream_supports, gemv_nvfp4.ksplit_supports, gemv_nvfp4.kernel_supports):
        fn.cache_clear()
    gemv_nvfp4.choose_config.cache_clear()


def test_the_stream_kernel_takes_bf16_and_f16_at_k_multiple_of_128(fake_device: CudaDevice) -> None:
    assert gemv_nvfp4.stream_supports(1, 21504, 5376, "bfloat16") is None
    assert gemv_nvfp4.stream_supports(8, 1000, 384, "float16") is None
    assert "float32" in (gemv_nvfp4.stream_supports(1, 21504, 5376, "float32") or "")
    assert "K=160" in (gemv_nvfp4.stream_supports(1, 64, 160, "bfloat16") or "")
    assert "N=" in (gemv_nvfp4.stream_supports(1, 20, 128, "bfloat16") or "")
    assert gemv_nvfp4.choose_config(1, 21504, 5376, "bfloat16") == STREAM_CONFIG
    assert gemv_nvfp4.choose_config(1, 21504, 5376, "bfloat16", "ksplit").kernel == "ksplit"
    assert gemv_nvfp4.choose_config(1, 21504, 5376, "float32").kernel == "ksplit"
    # N % 16 == 8: only the stream kernel (its 8-row half tiles) takes it
    assert gemv_nvfp4.kernel_supports(1, 1000, 384, "bfloat16") is None
    assert gemv_nvfp4.kernel_supports(1, 1000, 384, "float32") is not None


def test_no_stream_kernel_without_the_fp8_conversion_or_enough_shared_memory(
    monkeypatch: pytest.MonkeyPatch, fake_device: CudaDevice
) -> None:
    old = CudaDevice("fake A100", 108, (8, 0), 166912)
    monkeypatch.setattr(gemv_nvfp4, "cuda_device", lambda: old)
    gemv_nvfp4.stream_supports.cache_clear()
    assert "8.9" in (gemv_nvfp4.stream_supports(1, 21504, 5376, "bfloat16") or "")
    small = CudaDevice("fake L4", 58, (8, 9), 101376)
    monkeypatch.setattr(gemv_nvfp4, "cuda_device", lambda: small)
    gemv_nvfp4.stream_supports.cache_clear()
    assert "shared memory" in (gemv_nvfp4.stream_supports(8, 21504, 5376, "bfloat16") or "")
    assert gemv_nvfp4.stream_supports(1, 21504, 5376, "bfloat16", GemvConfig(warps=4)) is None
    # and a launch shape too large for the H200 is refused before MLX would try it
    monkeypatch.setattr(gemv_nvfp4, "cuda_device", lambda: fake_device)
    gemv_nvfp4.stream_supports.cache_clear()
    assert "shared memory" in (gemv_nvfp4.stream_supports(8, 21504, 5376, "bfloat16", GemvConfig(warps=20)) or "")
    assert gemv_nvfp4.stream_supports(8, 21504, 5376, "bfloat16") is None


def test_launch_shape_never_leaves_a_warp_without_work() -> None:
    for n, k in SHAPES:
        for m in (1, 8):
            blocks, warps, smem = stream_launch(m, n, k, GemvConfig(), 132)
            part = partition(n, k, blocks, warps, 4)
            assert min(units for _, _, units, _, _ in part) >= warps
            assert smem == stream_smem_bytes(m, k, warps, 4, 2)


# ------------------------------------------------- inputs kept out of MLX's small-buffer pool


def test_small_inputs_are_padded_out_of_mlx_s_small_buffer_pool() -> None:
    # MLX's CUDA allocator serves <= 8-byte arrays from a read-mostly unified-memory pool that
    # makes each GEMV launch slower (BENCHMARKS.md); kernels get 16 bytes instead
    one = mx.array([3.5], dtype=mx.float32)
    padded = off_small_pool(one)
    assert padded.nbytes == 16 and np.array(padded).tolist() == [3.5, 0.0, 0.0, 0.0]
    idx = off_small_pool(mx.array([7, 9], dtype=mx.uint32))
    assert np.array(idx).tolist() == [7, 9, 0, 0]
    big = mx.array([1.0, 2.0, 3.0], dtype=mx.float32)  # 12 bytes: already outside the pool
    assert off_small_pool(big) is big
    for gs, want in ((None, 1.0), (5376.0, 2.0), (mx.array([5376.0]), 2.0)):
        mult = gemv_nvfp4.kernel_multiplier(gs)
        assert mult.nbytes > SMALL_POOL_BYTES and float(mult[0]) == want
