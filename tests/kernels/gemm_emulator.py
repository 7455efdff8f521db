"""A NumPy model of `kernels/cuda/gemm_nvfp4.cu`, line by line, for the tests without a GPU.

Shared memory is a byte array; the copies, the decode, ldmatrix, the fragment reads, the MMAs
(PTX fragment layouts of mma.m16n8k16) and the epilogue stores use the kernel's own index
formulas, transcribed one to one (`test_gemm_nvfp4.py` pins the transcribed lines to the source),
so a wrong swizzle, fragment map, ring slot or decode gives a wrong product. Values are carried in
float64: the kernel's products are exact, so the model differs from the float64 reference only by
float64 rounding, and the real kernel only by fp32 accumulation.

Every shared-memory access is also logged per warp instruction (`accesses`), so the tests can
check bank conflicts on exactly the addresses the kernel computes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from kernels import nvfp4
from kernels.cuda.gemm_layout import GemmConfig

E4M3 = nvfp4.decode_e4m3(np.arange(256, dtype=np.uint8)).astype(np.float64)
U32 = np.uint32


# ----------------------------------------------------------------------- 16-bit values and bits


def value16(bits: np.ndarray, f16: bool) -> np.ndarray:
    """16-bit patterns (in uint32) -> their bf16 or f16 values as float64."""
    b = np.asarray(bits, dtype=U32) & U32(0xFFFF)
    if f16:
        return b.astype(np.uint16).view(np.float16).astype(np.float64)
    return (b << U32(16)).view(np.float32).astype(np.float64)


def bits16(values: np.ndarray, f16: bool) -> np.ndarray:
    """float64 values exactly representable in bf16 / f16 -> their bit patterns (uint32)."""
    v = np.asarray(values, dtype=np.float64)
    if f16:
        h = v.astype(np.float16)
        assert np.array_equal(h.astype(np.float64), v, equal_nan=True), "not an f16 value"
        return h.view(np.uint16).astype(U32)
    f = v.astype(np.float32)
    assert np.array_equal(f.astype(np.float64), v, equal_nan=True), "not a bf16 value"
    b = f.view(U32)
    assert not np.any(b & U32(0xFFFF)), "not a bf16 value"
    return b >> U32(16)


def halves(words: np.ndarray, f16: bool) -> tuple[np.ndarray, np.ndarray]:
    """A packed pair's (low, high) values."""
    w = np.asarray(words, dtype=U32)
    return value16(w, f16), value16(w >> U32(16), f16)


def pack(lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    return (np.asarray(lo, dtype=U32) & U32(0xFFFF)) | (np.asarray(hi, dtype=U32) << U32(16))


def byte_perm(x: np.ndarray, y: np.ndarray, sel: int) -> np.ndarray:
    """CUDA's __byte_perm for selectors without the sign-replicate bit."""
    x, y = np.asarray(x, dtype=np.uint64), np.asarray(y, dtype=np.uint64)
    src = (y << np.uint64(32)) | x
    out = np.zeros(np.broadcast(x, y).shape, dtype=np.uint64)
    for i in range(4):
        b = (sel >> (4 * i)) & 0x7
        out |= ((src >> np.uint64(8 * b)) & np.uint64(0xFF)) << np.uint64(8 * i)
    return out.astype(U32)


# ------------------------------------------------------------------ gemm_nvfp4.cuh, mirrored


def e2m1_pair(t: np.ndarray, f16: bool) -> np.ndarray:
    t = np.asarray(t, dtype=U32)
    if f16:
        return (t & U32(0x80008000)) | ((t >> U32(3)) & U32(0x0E000E00))
    return (t & U32(0x80008000)) | ((t >> U32(6)) & U32(0x01C001C0))


def mul2(a: np.ndarray, s: np.ndarray, f16: bool) -> np.ndarray:
    """The packed multiply; asserts it is exact (bits16 refuses a rounded product)."""
    alo, ahi = halves(a, f16)
    slo, shi = halves(s, f16)
    return pack(bits16(alo * slo, f16), bits16(ahi * shi, f16))


def scale_splat(b: np.ndarray, f16: bool) -> np.ndarray:
    """One E4M3 byte -> f16 E4M3 or bf16 E4M3 * 2^100, in both halves."""
    v = E4M3[np.asarray(b, dtype=U32) & U32(0xFF)] * (1.0 if f16 else 2.0**100)
    h = bits16(v, f16)
    return pack(h, h)


def decode_word(w: np.ndarray, s: np.ndarray, f16: bool) -> list[np.ndarray]:
    w = np.asarray(w, dtype=U32)
    return [mul2(e2m1_pair(w << U32(12 - 4 * j), f16), s, f16) for j in range(4)]


def decode_word_natural(w: np.ndarray, s: np.ndarray, f16: bool) -> list[np.ndarray]:
    d = decode_word(w, s, f16)
    return [
        byte_perm(d[0], d[1], 0x5410),
        byte_perm(d[2], d[3], 0x5410),
        byte_perm(d[0], d[1], 0x7632),
        byte_perm(d[2], d[3], 0x7632),
    ]


def permute_x8(v: list[np.ndarray]) -> list[np.ndarray]:
    return [
        byte_perm(v[0], v[2], 0x5410),
        byte_perm(v[0], v[2], 0x7632),
        byte_perm(v[1], v[3], 0x5410),
        byte_perm(v[1], v[3], 0x7632),
    ]


# ---------------------------------------------------------------------------- fragments and MMA


def lane_gt() -> tuple[np.ndarray, np.ndarray]:
    lane = np.arange(32)
    return lane >> 2, lane & 3


def fragments_to_a(regs: np.ndarray, f16: bool) -> np.ndarray:
    """A operand [..., 32 lanes, 4 regs] -> [..., 16, 16] (row = g + 8 (r & 1), col = 2t + 8 (r >> 1) + half)."""
    g, t = lane_gt()
    out = np.zeros((*regs.shape[:-2], 16, 16))
    for r in range(4):
        lo, hi = halves(regs[..., r], f16)
        row, col = g + 8 * (r & 1), 2 * t + 8 * (r >> 1)
        out[..., row, col] = lo
        out[..., row, col + 1] = hi
    return out


def fragments_to_b(regs: np.ndarray, f16: bool) -> np.ndarray:
    """B operand [..., 32 lanes, 2 regs] -> [..., 16 (k), 8 (n)] (k = 2t + 8 r + half, n = g)."""
    g, t = lane_gt()
    out = np.zeros((*regs.shape[:-2], 16, 8))
    for r in range(2):
        lo, hi = halves(regs[..., r], f16)
        out[..., 2 * t + 8 * r, g] = lo
        out[..., 2 * t + 8 * r + 1, g] = hi
    return out


def c_fragment(c: np.ndarray) -> np.ndarray:
    """Accumulator [..., 16, 8] -> per-lane registers [..., 32, 4] (c0, c1 row g; c2, c3 row g + 8)."""
    g, t = lane_gt()
    return np.stack([c[..., g, 2 * t], c[..., g, 2 * t + 1], c[..., g + 8, 2 * t], c[..., g + 8, 2 * t + 1]], axis=-1)


# ---------------------------------------------------------------------------------- the kernel


@dataclass
class Access:
    """One warp instruction's shared-memory access: kind, bytes per lane, the lanes' addresses."""

    kind: str
    width: int
    addrs: np.ndarray  # [32]


def raster(bid: int, m: int, bm: int, bn: int, num_n: int, group_m: int) -> tuple[int, int]:
    """The block's tile (m0, n0): GROUP_M row tiles per column group, rows fastest (both kernels)."""
    num_m = -(-m // bm)
    per_group = group_m * num_n
    group = bid // per_group
    first_m = group * group_m
    gsize = min(num_m - first_m, group_m)
    in_group = bid - group * per_group
    return (first_m + in_group % gsize) * bm, (in_group // gsize) * bn


class SharedMemory:
    """A block's shared memory as bytes (`smem`), the global arrays as bytes, and the access log."""

    smem: np.ndarray
    log: bool
    accesses: list[Access]

    def _read(self, addr: np.ndarray, nbytes: int) -> np.ndarray:
        idx = np.asarray(addr)[..., None] + np.arange(nbytes)
        return self.smem[idx]

    def _words(self, addr: np.ndarray, count: int, kind: str) -> list[np.ndarray]:
        b = self._read(addr, 4 * count).astype(U32)
        self._note(kind, 4 * count, addr)
        return [
            b[..., 4 * i]
            | (b[..., 4 * i + 1] << U32(8))
            | (b[..., 4 * i + 2] << U32(16))
            | (b[..., 4 * i + 3] << U32(24))
            for i in range(count)
        ]

    def _note(self, kind: str, width: int, addr: np.ndarray) -> None:
        if self.log:
            flat = np.asarray(addr).reshape(-1, 32)  # one row per warp instruction
            self.accesses.extend(Access(kind, width, row.copy()) for row in flat)

    def load(self, xbits: np.ndarray, packed: np.ndarray, scales: np.ndarray) -> None:
        """The global arrays as bytes: x [M, K] (16-bit patterns), codes [N, K/8], scales [N, K/16]."""
        self.M = xbits.shape[0]
        self.xg = xbits.astype(np.uint16).reshape(-1).view(np.uint8)  # x as bytes, row-major
        self.wg = packed.astype(U32).reshape(-1).view(np.uint8)
        self.sg = scales.astype(np.uint8).reshape(-1)


@dataclass
class GemmEmulator(SharedMemory):
    """gemm_nvfp4.cu at one launch shape, for N, K and 16-bit type of x (f16 or bf16)."""

    cfg: GemmConfig
    n: int
    k: int
    f16: bool
    log: bool = False
    accesses: list[Access] = field(default_factory=list)  # shared-memory reads and writes (with log)
    copies: list[tuple[np.ndarray, int]] = field(default_factory=list)  # cp.async destinations (with log)

    def __post_init__(self) -> None:
        c = self.cfg
        self.WM, self.WN, self.TM, self.TN, self.KH = c.wm, c.wn, c.tm, c.tn, c.kh
        self.STAGES, self.BDEC, self.GROUP_M = c.stages, c.bdec, c.group_m
        self.WGMMA, self.HELD = c.wgmma, 1 if c.deep else 0
        self.NBUF = 2 + self.HELD
        self.NT = 32 * c.wm * c.wn
        self.BM, self.BN, self.BK = c.bm, c.bn, c.bk
        self.KT = self.k // self.BK
        self.XS, self.WS, self.SROW = self.BM * 128, self.BN * 32, 4 * self.KH
        self.STAGE = self.KH * (self.XS + self.WS) + self.BN * self.SROW
        self.DS = self.BN * 128
        self.NUM_N = -(-self.n // self.BN)
        self.XCOPIES = self.BM * 8 * self.KH // self.NT
        self.WCOPIES = -(-self.BN * 2 * self.KH // self.NT)
        self.SCOPIES = -(-self.BN // self.NT)
        self.ITEMS = -(-self.BN * 4 * self.KH // self.NT)
        self.WEVEN = (self.BN * 2 * self.KH) % self.NT == 0
        self.IEVEN = (self.BN * 4 * self.KH) % self.NT == 0
        self.KSTEPS = 4 * self.KH
        self.XROWS, self.WROWS = self.NT // (8 * self.KH), self.NT // (2 * self.KH)
        self.IROWS = self.NT // 4
        assert c.stage_bytes() == self.STAGE
        if not c.producer:
            assert c.smem_bytes() == self.STAGES * self.STAGE + (self.NBUF * self.KH * self.DS if self.BDEC else 0)

    # -- memory
    def _write_words(self, addr: np.ndarray, words: list[np.ndarray], kind: str) -> None:
        self._note(kind, 4 * len(words), addr)
        for i, wv in enumerate(words):
            for byte in range(4):
                self.smem[np.asarray(addr) + 4 * i + byte] = ((wv >> U32(8 * byte)) & U32(0xFF)).astype(np.uint8)

    # -- the block's tile
    def tile(self, bid: int, m: int) -> tuple[int, int]:
        return raster(bid, m, self.BM, self.BN, self.NUM_N, self.GROUP_M)

    def run(
        self, xbits: np.ndarray, packed: np.ndarray, scales: np.ndarray, gsv: float
    ) -> tuple[np.ndarray, np.ndarray]:
        """y [M, N] in float64 (before the kernel's rounding to T) and how often each was written."""
        self.load(xbits, packed, scales)
        m = self.M
        y = np.zeros((m, self.n))
        written = np.zeros((m, self.n), dtype=int)
        for bid in range(self.cfg.blocks(m, self.n)):
            self.block(bid, gsv, y, written)
        return y, written

    def block(self, bid: int, gsv: float, y: np.ndarray, written: np.ndarray) -> None:
        self.setup(bid)
        S, HELD = self.STAGES, self.HELD
        for s in range(S - 1 - HELD):
            self.issue(s, s)
        slot, refill, buf = 0, S - 1 - HELD, 0
        if self.BDEC:
            for p in range(self.ITEMS):
                self.decode_item(0, 0, p)
        for kt in range(self.KT):
            self.issue(kt + S - 1 - HELD, refill)
            nxt = 0 if slot + 1 == S else slot + 1
            nbuf = 0 if buf + 1 == self.NBUF else buf + 1
            if self.WGMMA:
                self.compute_wgmma(slot, buf, nxt, nbuf)
            elif self.BDEC:
                self.compute_block(slot, buf, nxt, nbuf)
            else:
                self.compute_warp(slot)
            refill = 0 if refill + 1 == S else refill + 1
            slot, buf = nxt, nbuf
        self.epilogue(gsv, y, written)

    def setup(self, bid: int) -> None:
        """The block's tile, fresh shared memory (never zeros) and every thread's fixed offsets."""
        M, N, K, KH, NT = self.M, self.n, self.k, self.KH, self.NT
        self.m0, self.n0 = m0, n0 = self.tile(bid, M)
        self.smem = np.full(self.cfg.smem_bytes(), 0xA5, dtype=np.uint8)  # never zeros
        tid = np.arange(NT)
        self.lane, self.warp = tid & 31, tid >> 5
        self.g, self.t = self.lane >> 2, self.lane & 3
        self.wm, self.wn = self.warp // self.WN, self.warp % self.WN
        self.acc = np.zeros((NT // 32, self.TM, self.TN, 16, 8))
        # copy geometry
        self.xrow, self.xu = tid // (8 * KH), tid % (8 * KH)
        self.xsrc = np.minimum(m0 + self.xrow, M - 1) * K + self.xu * 8  # in elements of x
        self.xdst = (self.xu // 8) * self.XS + self.xrow * 128 + (((self.xu % 8) ^ (self.xrow & 7)) << 4)
        self.wrow, self.wu = tid // (2 * KH), tid % (2 * KH)
        self.wsrc = np.minimum(n0 + self.wrow, N - 1) * (K // 2) + self.wu * 16  # in bytes
        self.wdst = KH * self.XS + (self.wu // 2) * self.WS + self.wrow * 32 + (self.wu % 2) * 16
        # decode geometry
        self.dbase = self.STAGES * self.STAGE
        irow, igq = tid // 4, tid % 4
        self.icode = KH * self.XS + irow * 32 + igq * 8
        self.iscale = KH * (self.XS + self.WS) + irow * self.SROW + igq
        self.idec0 = irow * 128 + (((2 * igq) ^ (irow & 7)) << 4)
        self.idec1 = irow * 128 + (((2 * igq + 1) ^ (irow & 7)) << 4)
        lane = self.lane
        arow = self.wm * 16 * self.TM + (lane & 7) + ((lane >> 3) & 1) * 8
        self.aoff = arow * 128 + (((lane >> 4) ^ (arow & 7)) << 4)
        brow = self.wn * 8 * self.TN + (lane & 7) + (lane >> 4) * 8
        self.boff = brow * 128 + ((((lane >> 3) & 1) ^ (brow & 7)) << 4)
        g, t = self.g, self.t
        self.xoff = (self.wm * 16 * self.TM + g) * 128
        self.woff = KH * self.XS + (self.wn * 8 * self.TN + g) * 32 + t * 8
        self.soff = KH * (self.XS + self.WS) + (self.wn * 8 * self.TN + g) * self.SROW + t

    def issue(self, kt: int, slot: int) -> None:
        if kt >= self.KT:
            return
        M, N, K, BK = self.M, self.n, self.k, self.BK
        st = slot * self.STAGE
        for p in range(self.XCOPIES):
            ok = self.m0 + self.xrow + p * self.XROWS < M
            src = self.xsrc + np.where(ok, p * self.XROWS * K, 0) + kt * BK
            self._copy(st + self.xdst + p * self.XROWS * 128, 2 * src, ok, 16, self.xg)
        for p in range(self.WCOPIES):
            live = self.WEVEN | (self.wrow + p * self.WROWS < self.BN)  # the partial last pass
            ok = self.n0 + self.wrow + p * self.WROWS < N
            src = self.wsrc + np.where(ok, p * self.WROWS * (K // 2), 0) + kt * (BK // 2)
            self._copy((st + self.wdst + p * self.WROWS * 32)[live], src[live], ok[live], 16, self.wg)
        for p in range(self.SCOPIES):
            row = np.arange(self.NT) + self.NT * p
            live = row < self.BN
            row = row[live]
            ok = self.n0 + row < N
            src = np.minimum(self.n0 + row, N - 1) * (K // 16) + kt * self.SROW
            self._copy(st + self.KH * (self.XS + self.WS) + row * self.SROW, src, ok, self.SROW, self.sg)

    def _copy(self, dst: np.ndarray, src: np.ndarray, ok: np.ndarray, nbytes: int, glob: np.ndarray) -> None:
        data = glob[np.asarray(src)[:, None] + np.arange(nbytes)]
        data[~ok] = 0  # zero-filled, nothing read
        self.smem[np.asarray(dst)[:, None] + np.arange(nbytes)] = data
        if self.log:
            self.copies.append((np.asarray(dst).copy(), nbytes))

    def decode_item(self, slot: int, buf: int, p: int) -> None:
        live = self.IEVEN | (p * self.NT + np.arange(self.NT) < self.BN * 4 * self.KH)  # whole warps
        h = p * self.NT // (self.BN * 4)
        r = p * self.NT % (self.BN * 4) // 4
        st = slot * self.STAGE
        cw = self._words((st + self.icode + h * self.WS + r * 32)[live], 2, "lds64-decode")
        addr = (st + self.iscale + r * self.SROW + 4 * h)[live]
        b = self._read(addr, 1)[:, 0]
        self._note("lds8-decode", 1, addr)
        s = scale_splat(b, self.f16)
        db = self.dbase + (buf * self.KH + h) * self.DS + r * 128
        self._write_words((db + self.idec0)[live], decode_word_natural(cw[0], s, self.f16), "sts128-decode")
        self._write_words((db + self.idec1)[live], decode_word_natural(cw[1], s, self.f16), "sts128-decode")

    def ldmatrix_x4(self, addr: np.ndarray) -> np.ndarray:
        """addr [NT] (lane L of each warp: row L % 8 of matrix L // 8) -> regs [warps, 32, 4]."""
        a = np.asarray(addr).reshape(-1, 32)
        self._note("ldmatrix", 16, a)
        regs = np.zeros((a.shape[0], 32, 4), dtype=U32)
        lanes = np.arange(32)
        for i in range(4):
            src = a[:, 8 * i + (lanes >> 2)] + 4 * (lanes & 3)
            b = self._read(src, 4).astype(U32)
            regs[:, :, i] = b[..., 0] | (b[..., 1] << U32(8)) | (b[..., 2] << U32(16)) | (b[..., 3] << U32(24))
        return regs

    def compute_block(self, slot: int, buf: int, nxt: int, nbuf: int) -> None:
        xs = slot * self.STAGE
        db = self.dbase + buf * self.KH * self.DS
        for ks in range(self.KSTEPS):
            h, flip = ks // 4, (ks % 4) << 5
            abase = (xs + h * self.XS + self.aoff) ^ flip
            a = np.stack([self.ldmatrix_x4(abase + i * 16 * 128) for i in range(self.TM)], axis=1)
            bbase = db + ((h * self.DS + self.boff) ^ flip)
            b = np.zeros((self.NT // 32, self.TN, 32, 2), dtype=U32)
            for jj in range(self.TN // 2):
                r = self.ldmatrix_x4(bbase + jj * 16 * 128)
                b[:, 2 * jj] = r[:, :, 0:2]
                b[:, 2 * jj + 1] = r[:, :, 2:4]
            for p in range(self.ITEMS):
                if p * self.KSTEPS // self.ITEMS == ks:
                    self.decode_item(nxt, nbuf, p)
            am = fragments_to_a(a, self.f16)  # [warps, TM, 16, 16]
            bm = fragments_to_b(b, self.f16)  # [warps, TN, 16, 8]
            self.acc += np.einsum("wirk,wjkc->wijrc", am, bm)

    def wgmma_operand(self, start: int, rows: int) -> np.ndarray:
        """A K-major 128-byte-swizzled operand of `rows` x 16 as wgmma reads it from a descriptor's
        start address: row r, element k at start + (r // 8) * 1024 + (r % 8) * 128 + 2 k, its
        address bits 4-6 XORed with bits 7-9 (the swizzle), so the tile base must be 1024-aligned."""
        r = np.arange(rows)[:, None]
        addr = start + (r // 8) * 1024 + (r % 8) * 128 + 2 * np.arange(16)[None, :]
        assert (start - start % 128) % 1024 == 0, "tile base off the swizzle's 1024-byte period"
        phys = addr ^ (((addr >> 7) & 7) << 4)
        lo, hi = self.smem[phys].astype(U32), self.smem[phys + 1].astype(U32)
        return value16(lo | (hi << U32(8)), self.f16)

    def compute_wgmma(self, slot: int, buf: int, nxt: int, nbuf: int) -> None:
        """Each warpgroup: wgmma.m64n256k16 per k-step on descriptors (the body's start addresses),
        D in the m16n8 order per warp (warp 4 wg + q holds rows 16 q.. of the warpgroup's 64)."""
        groups = self.NT // 128
        for ks in range(self.KSTEPS):
            h, kofs = ks // 4, (ks % 4) * 32
            for wg in range(groups):
                xs = slot * self.STAGE + wg * 64 * 128
                a = self.wgmma_operand(xs + h * self.XS + kofs, 64)
                b = self.wgmma_operand(self.dbase + buf * self.KH * self.DS + h * self.DS + kofs, self.BN)
                d = a @ b.T  # [64 x rows, 256 weight rows]
                for q in range(4):
                    self.acc[4 * wg + q, 0] += d[16 * q : 16 * q + 16].reshape(16, self.TN, 8).transpose(1, 0, 2)
            for p in range(self.ITEMS):
                if self.IEVEN and p * self.KSTEPS // self.ITEMS == ks:
                    self.decode_item(nxt, nbuf, p)
        if not self.IEVEN:  # the partial item's branch: after the last wgmma (gemm_nvfp4.cu)
            for p in range(self.ITEMS):
                self.decode_item(nxt, nbuf, p)

    def compute_warp(self, slot: int) -> None:
        st = slot * self.STAGE
        f16, g, t = self.f16, self.g, self.t
        warps = self.NT // 32
        for h in range(self.KH):
            sp, cw = [], []
            for j in range(self.TN):
                addr = st + self.soff + j * 8 * self.SROW + 4 * h
                self._note("lds8-scale", 1, addr)
                sp.append(scale_splat(self._read(addr, 1)[:, 0], f16))
                cw.append(self._words(st + self.woff + h * self.WS + j * 8 * 32, 2, "lds64-code"))
            for kk in range(2):
                xp = st + h * self.XS + self.xoff + (((2 * t + kk) ^ g) << 4)
                a = np.zeros((warps, self.TM, 32, 2, 4), dtype=U32)  # [.., row g / g + 8, pair]
                for i in range(self.TM):
                    for half, off in enumerate((0, 8 * 128)):
                        v = self._words(xp + i * 16 * 128 + off, 4, "lds128-x")
                        a[:, i, :, half, :] = np.stack(permute_x8(v), axis=-1).reshape(warps, 32, 4)
                for j in range(self.TN):
                    d = np.stack(decode_word(cw[j][kk], sp[j], f16), axis=-1).reshape(warps, 32, 4)
                    for sub in range(2):
                        bregs = d[:, :, 2 * sub : 2 * sub + 2]
                        bm = fragments_to_b(bregs, f16)
                        aregs = np.stack(
                            [
                                a[:, :, :, 0, 2 * sub],
                                a[:, :, :, 1, 2 * sub],
                                a[:, :, :, 0, 2 * sub + 1],
                                a[:, :, :, 1, 2 * sub + 1],
                            ],
                            axis=-1,
                        )
                        am = fragments_to_a(aregs, f16)
                        self.acc[:, :, j] += np.einsum("wirk,wkc->wirc", am, bm)

    def epilogue(self, gsv: float, y: np.ndarray, written: np.ndarray) -> None:
        mult = gsv * (2.0**14 if self.f16 else 2.0**26)
        creg = c_fragment(self.acc)  # [warps, TM, TN, 32, 4]
        for w in range(self.NT // 32):
            wm, wn = w // self.WN, w % self.WN
            for lane in range(32):
                g, t = lane >> 2, lane & 3
                for i in range(self.TM):
                    for hf in range(2):
                        row = self.m0 + wm * 16 * self.TM + 16 * i + g + 8 * hf
                        if row >= self.M:
                            continue
                        for j in range(self.TN):
                            col = self.n0 + wn * 8 * self.TN + 8 * j + 2 * t
                            if col >= self.n:
                                continue
                            y[row, col] = creg[w, i, j, lane, 2 * hf] * mult
                            y[row, col + 1] = creg[w, i, j, lane, 2 * hf + 1] * mult
                            written[row, col : col + 2] += 1
