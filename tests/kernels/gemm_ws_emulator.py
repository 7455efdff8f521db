"""A NumPy model of the warp-specialised path of `kernels/cuda/gemm_nvfp4.cu` (WS: the `*p` variants).

The producer warpgroup and each consumer warpgroup run as coroutines on the kernel's own lines and
index formulas (`test_gemm_nvfp4.py` pins them to the source): they meet only at the mbarriers,
modelled with the hardware's phase-parity rule, so a `Schedule` may interleave them in any order
the barriers allow (round-robin, producer first, consumers first, random). The asynchronous parts
are timed at either end of what the PTX allows: cp.async data lands at issue or only at its
`wait_group`, and wgmma reads its shared-memory operands at issue or only when a later
`wait_group` retires it. Every region (a consumer's x slot, a decoded tile, a code slot) carries
the k-tile it holds, and the model asserts that what is read has landed and is the k-tile meant,
and that nothing is written while an unretired wgmma may still read it, so a wrong ring slot,
parity or release point fails here as it would corrupt the product on the GPU. A warpgroup's 128
threads move together (its named barrier and wgmma are warpgroup-wide); the order inside one
warpgroup is the program order of the kernel.

`mutation` plants a known protocol bug (for the tests that show the model catches them).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import numpy as np

from kernels.cuda.gemm_layout import GemmConfig
from tests.kernels.gemm_emulator import GemmEmulator, decode_word_natural, scale_splat
from tests.kernels.gemm_rs_emulator import RsGemmEmulator

Region = tuple[str, int, int]  # ("x", consumer, slot) | ("dec", 0, tile) | ("code", 0, slot)
Wait = tuple["Mbarrier", int] | None  # what a warpgroup waits for at a yield: (barrier, parity)

MUTATIONS = (
    "release-before-wait",  # a consumer frees k-tile kt's decoded tile before waiting for its MMAs
    "no-empty-wait",  # the producer decodes without waiting for the consumers to free the tile
    "parity-flipped",  # the consumers wait for the other phase of full[]
    "x-refill-early",  # a consumer refills kt - 1's x slot before its MMAs retire
    "x-wait-short",  # a consumer waits for one cp.async group too few before its MMAs
    "code-wait-short",  # the producer decodes with its last code group possibly in flight
)


class Mbarrier:
    """mbarrier.init / arrive / try_wait.parity: phase k completes at the count-th arrival of it."""

    def __init__(self, count: int) -> None:
        self.count, self.left, self.phase = count, count, 0

    def arrive(self, arrivals: int) -> None:
        for _ in range(arrivals):
            self.left -= 1
            if self.left == 0:
                self.phase, self.left = self.phase + 1, self.count

    def passed(self, parity: int) -> bool:
        """try_wait.parity: true once the phase of that parity has completed (phase "-1" at first)."""
        return (self.phase & 1) != parity


@dataclass(frozen=True)
class Schedule:
    """How the model interleaves the warpgroups and times the asynchronous copies and MMAs."""

    policy: str = "round-robin"  # | "producer-first" | "consumers-first" | "random"
    late: bool = False  # copies land at their wait_group, wgmma reads at its retirement
    seed: int = 0


@dataclass
class WsGemmEmulator(GemmEmulator):
    """gemm_nvfp4.cu with WS = true at one launch shape, under one `Schedule`."""

    schedule: Schedule = field(default_factory=Schedule)
    mutation: str | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        c = self.cfg
        assert c.producer and self.mutation in (None, *MUTATIONS)
        self.NC, self.XW, self.CSTAGE, self.PROWS = c.wm // 4, 64 * 128, self.BN * 36, self.BN // 128
        self.DSTAGES, self.CSTAGES, self.WGN = c.dstages, c.cstages, c.wgmma_n()
        self.WS_DEC = self.STAGES * self.XS
        self.WS_CODE = self.WS_DEC + self.DSTAGES * self.DS
        self.WS_BAR = self.WS_CODE + self.CSTAGES * self.CSTAGE
        assert c.smem_bytes() == self.WS_BAR + 16 * self.DSTAGES

    # -- the asynchronous state of one block
    def block(self, bid: int, gsv: float, y: np.ndarray, written: np.ndarray) -> None:
        self.setup(bid)
        self.rng = np.random.default_rng(self.schedule.seed + bid)
        self.holds: dict[Region, int] = {}  # the k-tile each region holds (landed or written)
        self.pending_writes: dict[Region, int] = {}  # cp.async groups issued into it, not landed
        self.reads: dict[Region, int] = {}  # unretired wgmma that read it
        self.full = [Mbarrier(128) for _ in range(self.DSTAGES)]  # the kernel's mbar_init counts
        self.empty = [Mbarrier(4 * self.NC) for _ in range(self.DSTAGES)]
        procs = [self.produce(), *(self.consume(c) for c in range(self.NC))]
        self.interleave(procs)
        self.epilogue(gsv, y, written)

    def interleave(self, procs: list[Iterator[Wait]]) -> None:
        """Advance the warpgroups, one yield at a time, in the schedule's order; a state where none
        can go on before all are done is a deadlock."""
        waits: list[Wait] = [None] * len(procs)
        alive = list(range(len(procs)))
        while alive:
            ready = [i for i in alive if waits[i] is None or waits[i][0].passed(waits[i][1])]  # type: ignore[index]
            assert ready, f"deadlock: every warpgroup waits ({waits})"
            policy = self.schedule.policy
            if policy == "random":
                i = int(self.rng.choice(ready))
            elif policy == "producer-first":
                i = ready[0]
            elif policy == "consumers-first":
                i = ready[1] if len(ready) > 1 and ready[0] == 0 else ready[0]
            else:  # round-robin: the one after the last that ran
                i = ready[0]
                alive.append(alive.pop(alive.index(i)))
            try:
                waits[i] = next(procs[i])
            except StopIteration:
                alive.remove(i)

    # -- cp.async groups: a committed group is a list of copies, landed at issue or at its wait
    def copy_group(self, copies: list[tuple[Region, int, Callable[[], None]]], groups: list[list]) -> None:
        for region, _, _ in copies:
            assert not self.reads.get(region), f"cp.async into {region} while a wgmma may still read it"
            self.pending_writes[region] = self.pending_writes.get(region, 0) + 1
        groups.append(copies)
        if not self.schedule.late:
            self.land(copies)
            groups[-1] = []

    def land(self, copies: list[tuple[Region, int, Callable[[], None]]]) -> None:
        for region, kt, write in copies:
            write()
            self.holds[region] = kt
            self.pending_writes[region] -= 1

    def wait_group(self, groups: list[list], pending: int) -> None:
        while len(groups) > pending:
            self.land(groups.pop(0))

    def expect(self, region: Region, kt: int) -> None:
        assert not self.pending_writes.get(region), f"{region} read before its copies landed"
        assert self.holds.get(region) == kt, f"{region} holds k-tile {self.holds.get(region)}, not {kt}"

    # -- the producer warpgroup (gemm_nvfp4.cu: produce_issue, produce_decode, produce)
    def produce(self) -> Iterator[Wait]:
        pt = np.arange(128)
        N, K, BN, KT = self.n, self.k, self.BN, self.KT
        csw = ((pt >> 2) & 1) << 4
        pw = np.minimum(self.n0 + pt, N - 1) * (K // 2)  # byte offsets of row pt's codes
        ps = np.minimum(self.n0 + pt, N - 1) * (K // 16)
        groups: list[list] = []

        def issue(kt: int, cslot: int) -> None:
            copies = []
            if kt < KT:
                cs = self.WS_CODE + cslot * self.CSTAGE
                for q in range(self.PROWS):
                    r = pt + 128 * q
                    ok = self.n0 + r < N
                    skip = np.where(ok, 128 * q, 0)
                    src = pw + skip * (K // 2) + kt * (self.BK // 2)
                    sc = ps + skip * (K // 16) + kt * self.SROW
                    copies += [
                        (("code", 0, cslot), kt, self._bind(cs + r * 32 + csw, src, ok, 16, self.wg)),
                        (("code", 0, cslot), kt, self._bind(cs + r * 32 + (16 ^ csw), src + 16, ok, 16, self.wg)),
                        (("code", 0, cslot), kt, self._bind(cs + BN * 32 + r * 4, sc, ok, 4, self.sg)),
                    ]
            self.copy_group(copies, groups)

        def decode(cslot: int, dslot: int, kt: int) -> None:
            self.expect(("code", 0, cslot), kt)
            assert not self.reads.get(("dec", 0, dslot)), f"decoded tile {dslot} rewritten under a wgmma"
            cs, ds = self.WS_CODE + cslot * self.CSTAGE, self.WS_DEC + dslot * self.DS
            for q in range(self.PROWS):
                r = pt + 128 * q
                sc = self._words(cs + BN * 32 + r * 4, 1, "lds32-scales")[0]
                drow = ds + r * 128
                for u in range(2):
                    cw = self._words(cs + r * 32 + ((16 * u) ^ csw), 4, "lds128-codes")
                    s0 = scale_splat(sc >> np.uint32(16 * u), self.f16)
                    s1 = scale_splat(sc >> np.uint32(16 * u + 8), self.f16)
                    for i, s in enumerate((s0, s0, s1, s1)):
                        dst = drow + (((4 * u + i) ^ (r & 7)) << 4)
                        self._write_words(dst, decode_word_natural(cw[i], s, self.f16), "sts128-decode")
            self.holds[("dec", 0, dslot)] = kt

        for c in range(self.CSTAGES - 1):
            issue(c, c)
        cslot = dslot = phase = 0
        for kt in range(KT):
            issue(kt + self.CSTAGES - 1, self.CSTAGES - 1 if cslot == 0 else cslot - 1)
            yield None
            self.wait_group(groups, self.CSTAGES - (0 if self.mutation == "code-wait-short" else 1))
            if self.mutation != "no-empty-wait":
                yield (self.empty[dslot], phase ^ 1)
            decode(cslot, dslot, kt)
            self.full[dslot].arrive(128)  # every producer thread
            yield None
            cslot = 0 if cslot + 1 == self.CSTAGES else cslot + 1
            dslot = 0 if dslot + 1 == self.DSTAGES else dslot + 1
            phase ^= 1 if dslot == 0 else 0
        self.wait_group(groups, 0)

    # -- a consumer warpgroup (gemm_nvfp4.cu: consume_issue, consume)
    def consume(self, cwg: int) -> Iterator[Wait]:
        ct = np.arange(128)
        crow, cu = ct // 8, ct % 8
        K, KT, S = self.k, self.KT, self.STAGES
        csrc = np.minimum(self.m0 + 64 * cwg + crow, self.M - 1) * K + cu * 8  # elements of x
        cdst = cwg * self.XW + crow * 128 + ((cu ^ (crow & 7)) << 4)
        lane = ct & 31
        groups: list[list] = []
        inflight: list[tuple[int, int, int]] = []  # committed wgmma groups: (k-tile, x slot, tile)
        self.acc[4 * cwg : 4 * cwg + 4] = 0.0

        def issue(kt: int, slot: int) -> None:
            copies = []
            if kt < KT:
                st = slot * self.XS
                for p in range(4):
                    ok = self.m0 + 64 * cwg + crow + 16 * p < self.M
                    src = csrc + np.where(ok, 16 * p * K, 0) + kt * self.BK
                    dst = st + cdst + p * 16 * 128
                    copies.append((("x", cwg, slot), kt, self._bind(dst, 2 * src, ok, 16, self.xg)))
            self.copy_group(copies, groups)

        def mma(kt: int, slot: int, dslot: int) -> None:
            xs, db = slot * self.XS + cwg * self.XW, self.WS_DEC + dslot * self.DS
            for ks in range(4):
                a = self.wgmma_operand(xs + ks * 32, 64)
                if self.WGN == 256:
                    b = self.wgmma_operand(db + ks * 32, 256)
                else:  # two m64n128k16: weight rows 0..127, then 128..255 (16 KB further)
                    b = np.concatenate([self.wgmma_operand(db + ks * 32, 128),
                                        self.wgmma_operand(db + 128 * 128 + ks * 32, 128)])  # fmt: skip
                d = a @ b.T
                for q in range(4):
                    self.acc[4 * cwg + q, 0] += d[16 * q : 16 * q + 16].reshape(16, self.TN, 8).transpose(1, 0, 2)

        def retire(keep: int) -> None:  # wgmma.wait_group keep
            while len(inflight) > keep:
                kt, slot, dslot = inflight.pop(0)
                if self.schedule.late:
                    self.expect(("x", cwg, slot), kt)
                    self.expect(("dec", 0, dslot), kt)
                    mma(kt, slot, dslot)
                for region in (("x", cwg, slot), ("dec", 0, dslot)):
                    self.reads[region] -= 1

        for s in range(S - 1):
            issue(s, s)
        slot = dslot = phase = 0
        for kt in range(KT):
            self.wait_group(groups, S - (1 if self.mutation == "x-wait-short" else 2))
            yield None  # bar_warpgroup: this warpgroup's threads are modelled together
            yield (self.full[dslot], phase ^ (1 if self.mutation == "parity-flipped" else 0))
            self.expect(("x", cwg, slot), kt)
            self.expect(("dec", 0, dslot), kt)
            for region in (("x", cwg, slot), ("dec", 0, dslot)):
                self.reads[region] = self.reads.get(region, 0) + 1
            inflight.append((kt, slot, dslot))
            if not self.schedule.late:
                mma(kt, slot, dslot)
            prev = S - 1 if slot == 0 else slot - 1
            pdslot = self.DSTAGES - 1 if dslot == 0 else dslot - 1
            if self.mutation == "release-before-wait":  # the bug: kt's tile freed with its MMAs running
                self.empty[dslot].arrive(int(np.count_nonzero(lane == 0)))
                yield None
            if self.mutation == "x-refill-early":  # the bug: kt - 1's slot refilled before its MMAs retire
                issue(kt + S - 1, prev)
            retire(1)
            if kt > 0 and self.mutation != "release-before-wait":
                self.empty[pdslot].arrive(int(np.count_nonzero(lane == 0)))  # lane 0 of each warp
            if self.mutation != "x-refill-early":
                issue(kt + S - 1, prev)
            yield None
            slot = 0 if slot + 1 == S else slot + 1
            dslot = 0 if dslot + 1 == self.DSTAGES else dslot + 1
            phase ^= 1 if dslot == 0 else 0
        self.wait_group(groups, 0)
        retire(0)

    def _bind(self, dst: np.ndarray, src: np.ndarray, ok: np.ndarray, n: int, glob: np.ndarray) -> Callable[[], None]:
        """A cp.async, for when it lands."""
        return lambda: self._copy(dst, src, ok, n, glob)


def emulator(cfg: GemmConfig, n: int, k: int, f16: bool, **kwargs: object) -> GemmEmulator | RsGemmEmulator:
    """The model of the kernel at `cfg`: register-sourced (gemm_nvfp4_rs.cu), warp-specialised or
    neither (`kwargs`: the dataclasses' fields)."""
    if cfg.rs:
        return RsGemmEmulator(cfg, n, k, f16, **kwargs)  # type: ignore[arg-type]
    return WsGemmEmulator(cfg, n, k, f16, **kwargs) if cfg.producer else GemmEmulator(cfg, n, k, f16, **kwargs)  # type: ignore[arg-type]
