"""A NumPy model of `kernels/cuda/gemm_nvfp4_rs.cu` (the register-sourced `r*` variants), line by line.

As `gemm_emulator` does for gemm_nvfp4.cu: shared memory is a byte array; the copies, the decode of
each thread's A fragments (byte permute, the 0x01001000 multiply, e2m1_pair, the packed scale
multiply), wgmma's descriptor reads of the x tile and the epilogue stores use the kernel's own index
formulas, so a wrong swizzle, fragment map, byte, scale, ring slot or store gives a wrong product.

The pipeline's timing is modelled too: a cp.async lands only at the `cp.async.wait_group` that
retires its group (until then its slot keeps what it held), and a wgmma reads its x tile when it is
retired by `wgmma.wait_group` (the latest it may), so a read before a copy landed, or a slot refilled
under a running MMA, gives a wrong product or fails the slot-tag assertion.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from kernels.cuda.gemm_layout import GemmConfig
from tests.kernels.gemm_emulator import (
    U32,
    Access,
    SharedMemory,
    e2m1_pair,
    fragments_to_a,
    mul2,
    raster,
    scale_splat,
    value16,
)


def byte_perm_lanes(x: np.ndarray, y: np.ndarray, sel: np.ndarray) -> np.ndarray:
    """__byte_perm with a selector per lane (no sign-replicate bit), as `gemm_emulator.byte_perm`."""
    src = (np.asarray(y, dtype=np.uint64) << np.uint64(32)) | np.asarray(x, dtype=np.uint64)
    sel = np.asarray(sel, dtype=np.uint64)
    out = np.zeros(src.shape, dtype=np.uint64)
    for i in range(4):
        b = (sel >> np.uint64(4 * i)) & np.uint64(7)
        out |= ((src >> (np.uint64(8) * b)) & np.uint64(0xFF)) << np.uint64(8 * i)
    return out.astype(U32)


def decode_byte_pair(word: np.ndarray, sel: np.ndarray, s: np.ndarray, f16: bool) -> np.ndarray:
    """gemm_nvfp4.cuh's decode_byte_pair: byte `sel & 3` of `word` -> the scaled (lo, hi) pair."""
    b = byte_perm_lanes(word, np.zeros_like(word), sel)
    return mul2(e2m1_pair((b * U32(0x01001000)).astype(U32), f16), s, f16)


@dataclass
class RsGemmEmulator(SharedMemory):
    """gemm_nvfp4_rs.cu at one launch shape, for N, K and the 16-bit type of x."""

    cfg: GemmConfig
    n: int
    k: int
    f16: bool
    log: bool = False
    accesses: list[Access] = field(default_factory=list)
    copies: list[tuple[np.ndarray, int]] = field(default_factory=list)

    def __post_init__(self) -> None:
        c = self.cfg
        assert c.rs
        self.WG, self.BT, self.STAGES, self.GROUP_M, self.NB = c.wm // 4, c.bm, c.stages, c.group_m, c.abufs

        self.NT, self.BN, self.KT = 128 * self.WG, 64 * self.WG, self.k // 64
        # NB >= 8: sets of a k-tile's four A fragments; NB = 12 decodes the next k-tile before its wait
        self.sets, self.decode_first = max(1, self.NB // 4), self.NB == 12
        self.early = c.early  # a k-tile's MMAs before its barrier's wait and refill
        self.XS, self.CS, self.SS = self.BT * 128, self.BN * 32, self.BN * 4
        self.STAGE = -(-(self.XS + self.CS + self.SS) // 1024) * 1024
        self.NUM_N = -(-self.n // self.BN)
        self.XCOPIES, self.XROWS = self.BT * 8 // self.NT, self.NT // 8
        assert c.stage_bytes() == self.STAGE and c.smem_bytes() == self.STAGES * self.STAGE

    def tile(self, bid: int, m: int) -> tuple[int, int]:
        return raster(bid, m, self.BT, self.BN, self.NUM_N, self.GROUP_M)

    def run(
        self, xbits: np.ndarray, packed: np.ndarray, scales: np.ndarray, gsv: float
    ) -> tuple[np.ndarray, np.ndarray]:
        """y [M, N] in float64 (before the kernel's rounding to T) and how often each was written."""
        self.load(xbits, packed, scales)
        y = np.zeros((self.M, self.n))
        written = np.zeros((self.M, self.n), dtype=int)
        for bid in range(self.cfg.blocks(self.M, self.n)):
            self.block(bid, gsv, y, written)
        return y, written

    # -- the block
    def setup(self, bid: int) -> None:
        M, N, K = self.M, self.n, self.k
        self.m0, self.n0 = m0, n0 = self.tile(bid, M)
        self.smem = np.full(self.cfg.smem_bytes(), 0xA5, dtype=np.uint8)  # never zeros
        tid = np.arange(self.NT)
        self.tid, lane, self.warp = tid, tid & 31, tid >> 5
        self.g, self.t = lane >> 2, lane & 3
        self.xrow, self.xu = tid // 8, tid % 8
        self.xsrc = np.minimum(m0 + self.xrow, M - 1) * K + self.xu * 8  # elements of x
        self.xdst = self.xrow * 128 + ((self.xu ^ (self.xrow & 7)) << 4)
        self.wrow = tid // 2
        self.wok = n0 + self.wrow < N
        self.wsrc = np.minimum(n0 + self.wrow, N - 1) * (K // 2) + (tid % 2) * 16  # bytes
        self.wdst = self.XS + self.wrow * 32 + (tid % 2) * 16
        self.sok = (tid < self.BN) & (n0 + tid < N)
        self.ssrc = np.minimum(n0 + tid, N - 1) * (K // 16)
        self.sdst = self.XS + self.CS + tid * 4
        wg = self.warp // 4
        self.arow = 64 * wg + 16 * (self.warp % 4) + self.g
        self.acode = self.XS + self.arow * 32
        self.ascale = self.XS + self.CS + self.arow * 4
        self.sel = 0x4440 | self.t
        self.acc = np.zeros((self.WG, 64, self.BT))  # D = W x^T per warpgroup
        self.pending: list[list[Callable[[], None]]] = []  # committed cp.async groups, not yet landed
        self.slot_holds: dict[int, int] = {}  # the k-tile each slot was last filled with (at issue)
        self.mmas: list[list[tuple[int, int, int, np.ndarray]]] = [[] for _ in range(self.WG)]

    def issue(self, kt: int, slot: int) -> None:
        group: list[Callable[[], None]] = []
        if kt < self.KT:
            M, K = self.M, self.k
            st = slot * self.STAGE
            for p in range(self.XCOPIES):
                ok = self.m0 + self.xrow + p * self.XROWS < M
                src = self.xsrc + np.where(ok, p * self.XROWS * K, 0) + kt * 64
                group.append(self._bind(st + self.xdst + p * self.XROWS * 128, 2 * src, ok, 16, self.xg))
            group.append(self._bind(st + self.wdst, self.wsrc + kt * 32, self.wok, 16, self.wg))
            live = self.tid < self.BN
            group.append(self._bind((st + self.sdst)[live], (self.ssrc + kt * 4)[live], self.sok[live], 4, self.sg))
            self.slot_holds[slot] = kt
        self.pending.append(group)

    def _bind(
        self, dst: np.ndarray, src: np.ndarray, ok: np.ndarray, nbytes: int, glob: np.ndarray
    ) -> Callable[[], None]:
        if self.log:
            self.copies.append((np.asarray(dst).copy(), nbytes))

        def land() -> None:
            data = glob[np.asarray(src)[:, None] + np.arange(nbytes)]
            data[~ok] = 0  # zero-filled, nothing read
            self.smem[np.asarray(dst)[:, None] + np.arange(nbytes)] = data

        return land

    def cp_async_wait(self, allowed: int) -> None:
        while len(self.pending) > allowed:
            for land in self.pending.pop(0):
                land()

    def load_scales(self, slot: int) -> None:
        st = slot * self.STAGE
        self.sc = [
            self._words(st + self.ascale, 1, "lds32-scale")[0],
            self._words(st + self.ascale + 32, 1, "lds32-scale")[0],
        ]

    def decode_step(self, slot: int, s: int, kt: int) -> np.ndarray:
        """The A fragments [NT, 4] of step s of the k-tile in `slot` (asserted to hold k-tile kt)."""
        if kt < self.KT:
            assert self.slot_holds.get(slot) == kt, (
                f"decode of k-tile {kt}: slot {slot} holds {self.slot_holds.get(slot)}"
            )
        st = slot * self.STAGE
        c0 = self._words(st + self.acode + 8 * s, 2, "lds64-code")
        c1 = self._words(st + self.acode + 8 * 32 + 8 * s, 2, "lds64-code")
        s0 = scale_splat(self.sc[0] >> U32(8 * s), self.f16)
        s1 = scale_splat(self.sc[1] >> U32(8 * s), self.f16)
        f16, sel = self.f16, self.sel
        return np.stack(
            [
                decode_byte_pair(c0[0], sel, s0, f16),
                decode_byte_pair(c1[0], sel, s1, f16),
                decode_byte_pair(c0[1], sel, s0, f16),
                decode_byte_pair(c1[1], sel, s1, f16),
            ],
            axis=-1,
        )

    def x_operand(self, start: int) -> np.ndarray:
        """wgmma's B from its descriptor: BT rows x 16 of the K-major 128-byte-swizzled x tile."""
        r = np.arange(self.BT)[:, None]
        addr = start + (r // 8) * 1024 + (r % 8) * 128 + 2 * np.arange(16)[None, :]
        assert (start - start % 128) % 1024 == 0, "tile base off the swizzle's 1024-byte period"
        phys = addr ^ (((addr >> 7) & 7) << 4)
        lo, hi = self.smem[phys].astype(U32), self.smem[phys + 1].astype(U32)
        return value16(lo | (hi << U32(8)), self.f16)

    def wgmma(self, buf: int, slot: int, s: int, kt: int) -> None:
        """Commit one step per warpgroup on A buffer `buf`; it reads its registers and its x tile when
        it retires (`wgmma_wait`), the latest it may."""
        for w in range(self.WG):
            self.mmas[w].append((slot, s, kt, buf))

    def wgmma_wait(self, allowed: int) -> None:
        for w in range(self.WG):
            while len(self.mmas[w]) > allowed:
                slot, s, kt, buf = self.mmas[w].pop(0)
                assert self.slot_holds.get(slot) == kt, f"an MMA of k-tile {kt} read slot {slot}, refilled"
                regs = self.afrag[buf].reshape(self.WG, 4, 32, 4)[w]
                a = fragments_to_a(regs, self.f16).reshape(64, 16)  # warp q: rows 16 q ..
                self.acc[w] += a @ self.x_operand(slot * self.STAGE + s * 32).T

    def block(self, bid: int, gsv: float, y: np.ndarray, written: np.ndarray) -> None:
        self.setup(bid)
        S = self.STAGES
        for s in range(S - 2):
            self.issue(s, s)
        self.cp_async_wait(S - 3)
        self.load_scales(0)
        self.afrag = [np.zeros((self.NT, 4), dtype=U32)] * self.NB
        for s in range(4 if self.NB >= 8 else 1):
            self.afrag[s] = self.decode_step(0, s, 0)
        slot = 0
        for kt in range(self.KT):
            base = 4 * (kt % self.sets)
            if self.early:
                for s in range(4):
                    self.wgmma(base + s, slot, s, kt)
            self.cp_async_wait(S - 4)
            nxt = 0 if slot + 1 == S else slot + 1
            self.issue(kt + S - 2, slot - 2 if slot >= 2 else slot + S - 2)
            if self.NB >= 8:  # the k-tile's MMAs as one group; the next k-tile into the next set
                if not self.early:
                    for s in range(4):
                        self.wgmma(base + s, slot, s, kt)
                if not self.decode_first:
                    self.wgmma_wait(4)  # (one group of four: at most the k-tile's own four still run)
                self.load_scales(nxt)
                for s in range(4):  # NB = 12: into k-tile kt - 2's set, k-tiles kt - 1 and kt still running
                    self.afrag[(base + 4 + s) % (4 * self.sets)] = self.decode_step(nxt, s, kt + 1)
                if self.decode_first:
                    self.wgmma_wait(4)
                slot = nxt
                continue
            for s in range(4):
                self.wgmma(s % self.NB, slot, s, kt)
                self.wgmma_wait(self.NB - 1)
                if s < 3:
                    self.afrag[(s + 1) % self.NB] = self.decode_step(slot, s + 1, kt)
                else:
                    self.load_scales(nxt)
                    self.afrag[0] = self.decode_step(nxt, 0, kt + 1)
            slot = nxt
        self.cp_async_wait(0)
        self.wgmma_wait(0)
        if self.cfg.ystage:
            self.epilogue_staged(gsv, y, written)
        else:
            self.epilogue(gsv, y, written)

    def epilogue(self, gsv: float, y: np.ndarray, written: np.ndarray) -> None:
        """d[4j + c] of thread (warp q, g, t): weight row arow + 8 (c >> 1), x row 8 j + 2 t + (c & 1)."""
        mult = gsv * (2.0**14 if self.f16 else 2.0**26)
        for tid in range(self.NT):
            w, q, g, t = tid // 128, (tid // 32) % 4, (tid % 32) >> 2, tid & 3
            for hf in range(2):
                col = self.n0 + int(self.arow[tid]) + 8 * hf
                if col >= self.n:
                    continue
                for j in range(self.BT // 8):
                    for c in range(2):
                        row = self.m0 + 8 * j + 2 * t + c
                        if row >= self.M:
                            continue
                        y[row, col] = self.acc[w, 16 * q + g + 8 * hf, 8 * j + 2 * t + c] * mult
                        written[row, col] += 1

    def epilogue_staged(self, gsv: float, y: np.ndarray, written: np.ndarray) -> None:
        """YS: each value to its 16-bit place in the ring's tile of y (row pitch 2 BN + 16 bytes), then
        16-byte pieces to y. The staged tile holds float64 per 2-byte place (before the rounding to T),
        each place written once and every piece's bytes read from places written in this block."""
        mult = gsv * (2.0**14 if self.f16 else 2.0**26)
        pitch = 2 * self.BN + 16
        assert self.BT * pitch <= self.cfg.smem_bytes(), "the staged y tile overruns the ring"
        staged = np.full(self.cfg.smem_bytes() // 2, np.nan)
        tid = np.arange(self.NT)
        w, q = tid // 128, (tid // 32) % 4
        for hf in range(2):
            for j in range(self.BT // 8):
                for c in range(2):
                    at = (8 * j + 2 * self.t + c) * pitch + (self.arow + 8 * hf) * 2
                    assert np.isnan(staged[at // 2]).all(), "a place of the staged tile written twice"
                    staged[at // 2] = self.acc[w, 16 * q + self.g + 8 * hf, 8 * j + 2 * self.t + c] * mult
                    self._log_warps("sts16-y", 2, at)
        pieces = self.BN // 8
        for first in range(0, self.BT * pieces, self.NT):  # piece i is thread i % NT's
            i = first + tid
            i = i[i < self.BT * pieces]
            r, p = i // pieces, i % pieces
            at = r * pitch + p * 16
            self._log_warps("lds128-y", 16, at)
            for k in range(len(i)):
                row, col = self.m0 + int(r[k]), self.n0 + 8 * int(p[k])
                if row < self.M and col < self.n:
                    vals = staged[at[k] // 2 : at[k] // 2 + 8]
                    assert not np.isnan(vals).any(), f"piece {int(i[k])} reads places never written"
                    y[row, col : col + 8] = vals
                    written[row, col : col + 8] += 1

    def _log_warps(self, kind: str, width: int, addrs: np.ndarray) -> None:
        if self.log:
            for start in range(0, len(addrs), 32):
                self.accesses.append(Access(kind, width, np.asarray(addrs[start : start + 32])))
