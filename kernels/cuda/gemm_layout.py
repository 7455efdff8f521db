"""Launch shapes of the NVFP4 prefill GEMM (`gemm_nvfp4.cu`): the variant table and its arithmetic.

Kept free of MLX so that `benchmarks.gemm_lab` sizes its launches from the same numbers as
`kernels.gemm_nvfp4`. A variant is a named `GemmConfig`; `VARIANTS` holds every one the lab
compares; `DEFAULT_RULE` says which one the library launches at each M (set it from the lab's
table: BENCHMARKS.md), and `ORCHESTRATE_GEMM_VARIANT` in the environment overrides it for a run.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass

MAX_SHARED_BYTES = 232448  # what one block may opt in to on sm_90 (227 KB)
REGISTERS = 65536  # 32-bit registers of one multiprocessor (and at most of one block)
# Registers per thread a warp-specialised consumer warpgroup asks for when launched with fewer:
# 128 accumulators (64 x 256 fp32 over 128 threads) and what the loop and epilogue address with.
CONSUMER_REGS = 160


@dataclass(frozen=True)
class GemmConfig:
    """One launch shape of the GEMM kernel (the template constants after T, N and K).

    Attributes:
        wm, wn: warps along M (x rows) and N (weight rows).
        tm, tn: 16-row m tiles and 8-row n tiles per warp (warp tile 16 tm x 8 tn).
        kh: 64-wide k halves per pipeline stage (BK = 64 kh).
        stages: cp.async ring depth.
        bdec: decode each k-tile's weights once per block into shared memory (else per warp, in
            registers).
        group_m: row tiles a column group walks before the next BN columns (L2 reuse).
        wgmma: Hopper's warpgroup MMA (sm_90a: built by `kernels.cuda.nvrtc`, not by MLX);
            needs wm % 4 == 0, wn == 1, tm == 1, tn == 32 and block decode.
        deep: (wgmma) one k-tile's MMAs stay in flight across the barrier: a third decoded tile,
            and the ring refills one slot later.
        producer: (wgmma) warp specialisation: one more warpgroup copies and decodes the weights
            into a ring of `dstages` decoded tiles (through its own `cstages`-deep ring of codes);
            the wm / 4 consumer warpgroups copy their own x rows (a `stages`-deep ring each) and
            only issue wgmma, one k-tile of it in flight; mbarriers hand the tiles over.
        dstages, cstages: (producer) the decoded-tile and code rings.
        rs: (wgmma) the register-sourced kernel, `gemm_nvfp4_rs.cu`: the weights are the MMA's A
            operand, decoded straight into registers, x its B operand from shared memory; wm / 4
            warpgroups of 64 weight rows each (BN = 16 wm) by BM = 8 tn x rows (128, 192 or 256,
            the wgmma's n); wn = tm = 1, BK = 64, no decoded tile (bdec and the producer fields unused).
        abufs: (rs) A-fragment buffers: 2 or 4 of one k16 step each (the MMAs left queued while the next
            is decoded, + 1), or 8: two k-tiles', a k-tile's MMAs issued as one group; or 12: three
            k-tiles', the next k-tile decoded into the set two k-tiles back before the wait for the
            last one, so two k-tiles' MMAs stay queued under the decode.
        early: (rs, abufs 8 or 12) a k-tile's MMAs issued before its barrier rather than after it (its
            x tile and fragments are ready at the barrier before), so two k-tiles' MMAs stay queued
            across each barrier.
        ystage: (rs) the epilogue stages the block's tile of y in the idle ring and stores it in
            16-byte pieces (whole rows of the tile per warp) instead of element by element.
    """

    wm: int = 2
    wn: int = 4
    tm: int = 4
    tn: int = 8
    kh: int = 1
    stages: int = 4
    bdec: bool = True
    group_m: int = 8
    wgmma: bool = False
    deep: bool = False
    producer: bool = False
    dstages: int = 3
    cstages: int = 4
    rs: bool = False
    abufs: int = 4
    early: bool = False
    ystage: bool = False

    @property
    def bm(self) -> int:
        """Rows of x per block."""
        return 8 * self.tn if self.rs else 16 * self.tm * self.wm

    @property
    def bn(self) -> int:
        """Weight rows per block."""
        return 16 * self.wm if self.rs else 8 * self.tn * self.wn

    @property
    def bk(self) -> int:
        """K per pipeline stage."""
        return 64 * self.kh

    @property
    def threads(self) -> int:
        """Threads per block (the producer warpgroup included)."""
        return 32 * self.wm * self.wn + (128 if self.producer else 0)

    def registers(self) -> tuple[int, int, int]:
        """(at launch, consumer, producer) registers per thread: at launch what 64K registers give
        every thread of the block (ptxas is held to it by `__launch_bounds__`); a warp-specialised
        block launched with fewer than CONSUMER_REGS moves the producer's spare registers to its
        consumers (setmaxnreg); else all three are the launch count."""
        launch = min(255, REGISTERS // self.threads) // 8 * 8
        if not self.producer or launch >= CONSUMER_REGS:
            return launch, launch, launch
        consumers = self.wm * self.wn * 32
        return launch, CONSUMER_REGS, (REGISTERS - consumers * CONSUMER_REGS) // 128 // 8 * 8

    @property
    def launch_bound(self) -> int:
        """The block size to hold ptxas to (`__launch_bounds__`), where a block at the default cap of
        255 registers a thread would not fit the multiprocessor's 64K; else 0 (no bound, the
        code ptxas made for the variants measured so far)."""
        return self.threads if self.threads * 255 > REGISTERS else 0

    def wgmma_n(self) -> int:
        """Weight rows per wgmma instruction: 256 (one m64n256k16 per k16 step), or 128 (two
        m64n128k16) where the block is launched with fewer than 160 registers a thread, in which
        ptxas cannot build the 128-accumulator m64n256k16 (C7602), setmaxnreg or not."""
        return 256 if self.registers()[0] >= 160 else 128

    def stage_bytes(self) -> int:
        """One ring slot: x (BM x BK, 16-bit), codes (BN x BK / 2) and scales (BN x BK / 16); the
        register-sourced kernel's padded to the swizzle's 1024-byte period."""
        if self.rs:
            return -(-(self.bm * 128 + self.bn * 36) // 1024) * 1024
        return self.kh * (self.bm * 128 + self.bn * 32) + self.bn * 4 * self.kh

    def smem_bytes(self) -> int:
        """Dynamic shared memory of a block: the ring, and the two decoded tiles of block decode (a
        producer's: the x ring, its decoded and code rings, two mbarriers per decoded tile)."""
        if self.rs:
            return self.stages * self.stage_bytes()
        if self.producer:
            rings = self.stages * self.bm * 128 + self.dstages * self.bn * 128 + self.cstages * self.bn * 36
            return rings + 16 * self.dstages
        decoded = (3 if self.deep else 2) * self.kh * self.bn * 128 if self.bdec else 0
        return self.stages * self.stage_bytes() + decoded

    def blocks(self, m: int, n: int) -> int:
        """Blocks of the launch for M = m, N = n."""
        return -(-m // self.bm) * -(-n // self.bn)

    def template(self, n: int, k: int, xf16: bool) -> dict[str, int | bool]:
        """The template constants after T, in the order MLX declares them."""
        if self.rs:
            return {
                "XF16": xf16,
                "N": n,
                "K": k,
                "WG": self.wm // 4,
                "BT": self.bm,
                "STAGES": self.stages,
                "GROUP_M": self.group_m,
                "NB": self.abufs,
                "EARLY": self.early,
                "YS": self.ystage,
            }
        consts: dict[str, int | bool] = {"XF16": xf16, "N": n, "K": k, "WM": self.wm, "WN": self.wn}
        consts |= {"TM": self.tm, "TN": self.tn, "KH": self.kh, "STAGES": self.stages}
        consts |= {"BDEC": self.bdec, "GROUP_M": self.group_m, "WGMMA": self.wgmma, "DEEP": self.deep}
        launch, consumer, producer = self.registers()
        consts |= {"WS": self.producer, "DSTAGES": self.dstages, "CSTAGES": self.cstages}
        consts |= {"CREGS": 0 if consumer == launch else consumer, "PREGS": 0 if producer == launch else producer}
        consts["WGN"] = self.wgmma_n()
        return consts

    def reason(self, n: int, k: int) -> str | None:
        """Why this shape cannot run N = n, K = k (the kernel's static_asserts), or None."""
        if n % 8:
            return f"N={n} is not a multiple of 8"
        if k % self.bk:
            return f"K={k} is not a multiple of {self.bk}"
        specific = self._rs_reason() if self.rs else self._smem_decode_reason()
        if specific is not None:
            return specific
        if self.threads > 1024:
            return f"{self}: {self.threads} threads in a block (at most 1024)"
        _, consumer, producer = self.registers()
        if self.producer and (self.wm // 4 * consumer + producer) * 128 > REGISTERS:
            return f"{self}: consumers at {consumer} and the producer at {producer} registers exceed {REGISTERS}"
        if self.smem_bytes() > MAX_SHARED_BYTES:
            return f"{self} needs {self.smem_bytes()} bytes of shared memory (at most {MAX_SHARED_BYTES})"
        return None

    def _smem_decode_reason(self) -> str | None:
        """`reason`'s checks of gemm_nvfp4.cu's own static_asserts (the block, warp and producer decode)."""
        threads = self.wm * self.wn * 32  # the ones that copy and decode together (no producer)
        if self.tn % 2:
            return f"tn={self.tn} is odd"
        if self.producer:
            if not self.wgmma or self.deep or self.kh != 1 or self.bn % 128:
                return f"{self}: a producer warpgroup needs wgmma (not deep), BK = 64 and BN a multiple of 128"
            if self.stages < 2 or self.dstages < 2 or self.cstages < 1:
                return f"{self}: the x and decoded rings need at least 2 slots, the code ring 1"
        elif self.stages < (3 if self.bdec else 2) + (1 if self.deep else 0):
            return f"stages={self.stages} is too few"
        if self.deep and not self.wgmma:
            return "deep is for the warpgroup MMA"
        if (self.bm * 8 * self.kh) % threads or (threads // (2 * self.kh)) % 8 or (threads // (8 * self.kh)) % 8:
            return f"{self} copies do not split evenly over {threads} threads"
        if self.bdec and (self.bn * 4 * self.kh) % threads and self.kh != 1:
            return f"{self} decode groups do not split evenly over {threads} threads"
        if self.wgmma and not (self.bdec and self.wn == 1 and self.tm == 1 and self.tn == 32 and self.wm % 4 == 0):
            return f"{self}: wgmma needs warpgroups along M of 64 x rows by 256 weight rows, block decode"
        return None

    def _rs_reason(self) -> str | None:
        """`reason`'s checks of gemm_nvfp4_rs.cu's own static_asserts (the register-sourced kernel)."""
        if (
            not self.wgmma
            or self.wm % 4
            or self.wn != 1
            or self.tm != 1
            or self.kh != 1
            or self.bm not in (128, 192, 256)
        ):
            return f"{self}: wgmma, warpgroups of 64 weight rows, 128, 192 or 256 x rows, BK = 64"
        if self.stages < 4 or self.abufs not in (2, 4, 8, 12):
            return f"{self}: the ring needs 4 slots or more, the A fragments 2, 4, 8 or 12 buffers"
        if self.early and self.abufs < 8:
            return f"{self}: early MMAs are a whole k-tile's group (8 or 12 A buffers)"
        if self.ystage and self.bm * (2 * self.bn + 16) > self.smem_bytes():
            return f"{self}: the staged tile of y does not fit in the ring"
        if (self.bm * 8) % self.threads or (self.threads // 8) % 8:
            return f"{self} copies do not split evenly over {self.threads} threads"
        return None

    def __str__(self) -> str:
        if self.rs:
            return (
                f"gemm-rs({self.bm}x{self.bn}x64, {self.wm // 4} warpgroups, {self.stages} stages, "
                f"{self.abufs} A buffers{', early MMAs' if self.early else ''}"
                f"{', y staged' if self.ystage else ''}, group {self.group_m})"
            )
        dec = "producer" if self.producer else "block" if self.bdec else "warp"
        mma = (", wgmma, deep" if self.deep else ", wgmma") if self.wgmma else ""
        return (
            f"gemm({self.bm}x{self.bn}x{self.bk}, warps {self.wm}x{self.wn}, {self.stages} stages, "
            f"{dec} decode{mma}, group {self.group_m})"
        )


# The variants the lab times side by side (benchmarks/gemm_lab.py). Names: b|w (block or warp
# decode; g: wgmma with block decode), BMxBN, k BK, s STAGES, d (deep), p (a producer warpgroup).
VARIANTS: dict[str, GemmConfig] = {
    "b128x256k64s4": GemmConfig(),
    "b128x256k64s3": GemmConfig(stages=3),
    "w128x256k64s4": GemmConfig(bdec=False),
    "w128x256k128s3": GemmConfig(bdec=False, kh=2, stages=3),
    "b256x128k64s4": GemmConfig(wm=4, wn=2),
    "w256x128k64s4": GemmConfig(wm=4, wn=2, bdec=False),
    # 4 warps and under 114 KB of shared memory: two blocks per multiprocessor
    "b128x128k64s3": GemmConfig(wm=2, wn=2, stages=3),
    "w128x128k64s4": GemmConfig(wm=2, wn=2, bdec=False),
    # Hopper's warpgroup MMA (sm_90a through kernels.cuda.nvrtc): 2 warpgroups x 64 rows, 256 weight rows
    "g128x256k64s4": GemmConfig(wm=8, wn=1, tm=1, tn=32, wgmma=True),
    "g128x256k64s5d": GemmConfig(wm=8, wn=1, tm=1, tn=32, wgmma=True, stages=5, deep=True),
    # aimed at 0.8x dense (BENCHMARKS.md, "design"): the decode of a k-tile
    # (fixed by BN x BK) amortised over 192 rows of MMAs; and moved off the MMA warps into a
    # producer warpgroup (p: warp specialisation, mbarrier handoff, setmaxnreg), at 128 and 192 rows
    "g192x256k64s4": GemmConfig(wm=12, wn=1, tm=1, tn=32, wgmma=True),
    "g192x256k64s3p": GemmConfig(wm=12, wn=1, tm=1, tn=32, wgmma=True, stages=3, producer=True),
    "g128x256k64s4p": GemmConfig(wm=8, wn=1, tm=1, tn=32, wgmma=True, stages=4, producer=True),
    # the register-sourced kernel (r: gemm_nvfp4_rs.cu, BM x rows by BN weight rows): each weight
    # decoded once per block into wgmma's A registers, against 256 (128) x rows, no decoded tile
    "r256x128k64s6": GemmConfig(wm=8, wn=1, tm=1, tn=32, wgmma=True, rs=True, stages=6),
    "r256x128k64s5": GemmConfig(wm=8, wn=1, tm=1, tn=32, wgmma=True, rs=True, stages=5),
    "r256x128k64s6b2": GemmConfig(wm=8, wn=1, tm=1, tn=32, wgmma=True, rs=True, stages=6, abufs=2),
    "r128x256k64s6": GemmConfig(wm=16, wn=1, tm=1, tn=16, wgmma=True, rs=True, stages=6),
    "r128x128k64s6": GemmConfig(wm=8, wn=1, tm=1, tn=16, wgmma=True, rs=True, stages=6),
    # (k: a k-tile's four MMAs issued as one group, the next k-tile decoded under them)
    "r256x128k64s6k": GemmConfig(wm=8, wn=1, tm=1, tn=32, wgmma=True, rs=True, stages=6, abufs=8),
    "r256x128k64s5k": GemmConfig(wm=8, wn=1, tm=1, tn=32, wgmma=True, rs=True, stages=5, abufs=8),
    "r128x256k64s6k": GemmConfig(wm=16, wn=1, tm=1, tn=16, wgmma=True, rs=True, stages=6, abufs=8),
    # 192 x rows: at N = 21504 (168 column tiles) 11 row tiles are 14 whole waves of 132 blocks (M = 2048),
    # 22 are 28 (M = 4096), where 256-row tiles leave the last wave 18 % full at M = 2048
    "r192x128k64s6k": GemmConfig(wm=8, wn=1, tm=1, tn=24, wgmma=True, rs=True, stages=6, abufs=8),
    "r192x128k64s7k": GemmConfig(wm=8, wn=1, tm=1, tn=24, wgmma=True, rs=True, stages=7, abufs=8),
    # (q: three k-tiles of A fragments; the next k-tile is decoded before the wait for the last one, under
    # two k-tiles' MMAs where k has one: the tensor cores idle less while the warps decode. A wait for two
    # k-tiles instead, ptxas serialises the MMAs: C7513)
    "r256x128k64s6q": GemmConfig(wm=8, wn=1, tm=1, tn=32, wgmma=True, rs=True, stages=6, abufs=12),
    "r256x128k64s5q": GemmConfig(wm=8, wn=1, tm=1, tn=32, wgmma=True, rs=True, stages=5, abufs=12),
    # (e: each k-tile's MMAs issued before its barrier, so two k-tiles' are queued across it)
    "r256x128k64s5ke": GemmConfig(wm=8, wn=1, tm=1, tn=32, wgmma=True, rs=True, stages=5, abufs=8, early=True),
    "r256x128k64s5qe": GemmConfig(wm=8, wn=1, tm=1, tn=32, wgmma=True, rs=True, stages=5, abufs=12, early=True),
    "r256x128k64s6qe": GemmConfig(wm=8, wn=1, tm=1, tn=32, wgmma=True, rs=True, stages=6, abufs=12, early=True),
    # (y: the epilogue through shared memory, 16-byte stores of whole rows, since element-wise 16-bit
    # stores of y use half of each 32-byte sector, and the tensor cores idle through a block's epilogue)
    "r256x128k64s5ky": GemmConfig(wm=8, wn=1, tm=1, tn=32, wgmma=True, rs=True, stages=5, abufs=8, ystage=True),
    "r256x128k64s5key": GemmConfig(
        wm=8, wn=1, tm=1, tn=32, wgmma=True, rs=True, stages=5, abufs=8, early=True, ystage=True
    ),
    "r256x128k64s5qey": GemmConfig(
        wm=8, wn=1, tm=1, tn=32, wgmma=True, rs=True, stages=5, abufs=12, early=True, ystage=True
    ),
}
# Which variant the library launches at each M: "name@max_m" entries apply, in order, to calls of
# at most max_m rows; a bare name takes the rest. Set from the lab's table (BENCHMARKS.md); the
# environment variable overrides it for a run without a code change, e.g.
#   ORCHESTRATE_GEMM_VARIANT="b128x128k64s3@1024,b128x256k64s4"
# Why this rule: benchmarks/gemm_lab.py on an H200 (BENCHMARKS.md, "Kernel lab") finds the
# register-sourced r256x128k64s5qey (three k-tiles of A fragments, each k-tile's MMAs issued before
# its barrier, the tile of y stored through shared memory) the fastest correct variant at every M
# from 512 to 16384 rows; where wgmma cannot run (not compute capability 9.0, or no NVRTC) the
# fastest of the mma.sync variants.
DEFAULT_RULE = "r256x128k64s5qey"
PORTABLE_RULE = "b128x128k64s3@512,b256x128k64s4"
DEFAULT_VARIANT = DEFAULT_RULE.rsplit(",", 1)[-1]
VARIANT_ENV = "ORCHESTRATE_GEMM_VARIANT"


def parse_rule(rule: str, origin: str = "rule") -> list[tuple[int | None, str]]:
    """`"name@max_m,...,name"` -> [(max_m or None, name)], every name checked against VARIANTS.

    Raises:
        ValueError: an unknown variant, a bad bound, or no entry for the largest M (naming `origin`).
    """
    entries: list[tuple[int | None, str]] = []
    for item in (part.strip() for part in rule.split(",")):
        name, _, bound = item.partition("@")
        if name not in VARIANTS:
            raise ValueError(f"{origin}: {name!r} is not a GEMM variant (one of {', '.join(VARIANTS)})")
        if bound and not bound.isdigit():
            raise ValueError(f"{origin}: {item!r}: the bound after @ must be a row count")
        entries.append((int(bound) if bound else None, name))
    if entries[-1][0] is not None:
        raise ValueError(f"{origin}: {rule!r} ends with a bound; the last entry must be a bare variant name")
    return entries


def variant_for(m: int, wgmma: bool = True) -> str:
    """The variant the library launches for M = m: `$ORCHESTRATE_GEMM_VARIANT`'s rule if set,
    else DEFAULT_RULE's where `wgmma` variants can run here, else PORTABLE_RULE's.

    Raises:
        ValueError: the environment's rule is malformed (see `parse_rule`).
    """
    env = os.environ.get(VARIANT_ENV, "")
    if env:
        rule = parse_rule(env, VARIANT_ENV)
    else:
        rule = parse_rule(DEFAULT_RULE, "DEFAULT_RULE") if wgmma else parse_rule(PORTABLE_RULE, "PORTABLE_RULE")
    return next(name for bound, name in rule if bound is None or m <= bound)


def describe(name: str) -> dict[str, object]:
    """A variant's fields and derived sizes, for the lab's JSON."""
    cfg = VARIANTS[name]
    return {"name": name, **asdict(cfg), "bm": cfg.bm, "bn": cfg.bn, "bk": cfg.bk, "smem": cfg.smem_bytes()}
