// Body of the NVFP4 prefill GEMM: y[M, N] = x[M, K] @ dequant(w)[N, K]^T * gsv, for M > 8.
// (A kernel body for mx.fast.cuda_kernel: MLX writes the signature; the header is nvfp4_mma.cuh
// followed by gemm_nvfp4.cuh.)
//
// Inputs:  x [M, K] T (bfloat16 or float16), w [N, K/8] uint32 (E2M1 codes, MLX layout),
//          scales [N, K/16] uint8 (E4M3), gsv [1] float (global_scale / 2688, or 1).
// Output:  y [M, N] T.
// Template constants (kernels/cuda/gemm_layout.py writes them): T, XF16 (T is float16), N (a
//          multiple of 8), K (a multiple of 64 * KH), WM x WN warps, each TM x TN tiles of 16 x 8
//          outputs (block tile BM = 16 TM WM rows of x by BN = 8 TN WN rows of w), KH (k64 halves
//          per stage: BK = 64 KH), STAGES (cp.async ring depth), BDEC (bool: decode into shared
//          memory once per block, else in registers per warp), GROUP_M (raster group height),
//          WGMMA (bool: Hopper's warpgroup MMA instead of mma.sync; sm_90a builds only, see below),
//          DEEP (bool, wgmma only: keep one k-tile's MMAs in flight across the barrier), WS
//          (bool, wgmma only: warp specialisation, below) with DSTAGES, CSTAGES (its decoded-tile
//          and code rings) and CREGS, PREGS (registers per thread of its consumer and producer
//          warpgroups after setmaxnreg; 0: as launched). M is read at run time from x's shape.
// Launch:  ceil(M / BM) * ceil(N / BN) blocks of 32 WM WN threads (WS: 128 more, the producer),
//          dynamic shared memory gemm_layout.smem_bytes(...).
//
// Each block owns one BM x BN tile of y (blocks walk GROUP_M row tiles down before moving to the
// next BN columns, so a wave's x rows and weight rows stay in L2) and all of K, in BK steps
// through a STAGES-deep ring filled by cp.async: x as BM rows of 64 values per k64 half (128 B a
// row, 16-byte units XOR-swizzled by row & 7), codes as BN rows of 32 bytes, scales as BN rows of
// 4 KH bytes. Nothing but the packed weights is ever read; no dequantized copy exists outside the
// block's shared memory and registers. The MMAs are mma.sync m16n8k16 (A = x, B = the weights,
// fp32 accumulators), nvfp4::mma_bf16 / mma_f16; decode as gemm_nvfp4.cuh says.
//
// BDEC = false (warp decode): lane (g = lane / 4, t = lane % 4) of a warp owns, in each k64 half,
//   k in [16 t, 16 t + 16): code words 2t and 2t+1 of each of its TN weight rows (one E4M3 scale:
//   group t), and the same 16 values of its x rows, read as two 16-byte pieces and byte-permuted
//   into pairs (x_j, x_j+4) to match the decoded pairs (code j, code j+4). The k order inside an
//   MMA is thereby permuted the same way on both sides; a sum does not care.
// BDEC = true (block decode): the block's threads decode the next k-tile's codes (one 16-code
//   group each, E4M3 scale applied) into a shared BN x BK tile of the 16-bit type, in natural
//   order, swizzled like x, double-buffered, interleaved with the MMAs of the current k-tile;
//   both operands then come by ldmatrix. Each weight is decoded once per block instead of once
//   per warp row, at the price of the tile's shared-memory writes and reads.
//
// WGMMA = true (sm_90a, built by kernels/cuda/nvrtc.py and launched through
//   mx.fast.precompiled_cuda_kernel; MLX's own sm_90 build discards these branches): block decode as
//   above, then each warpgroup (4 warps) runs wgmma.m64n256k16 on its 64 x rows against all 256
//   decoded weight rows, both operands read from shared memory through descriptors (the x tile and
//   the decoded tile are already the 128-byte-swizzled K-major layout wgmma reads), accumulators
//   in registers in mma.sync's order (so the epilogue is shared). cp.async and st.shared write
//   through the generic proxy: each thread fences them to the async proxy before the barrier.
//   DEEP: a warpgroup waits only for the previous k-tile's MMAs before the barrier, so the tensor
//   cores do not drain at every k-tile; the MMAs in flight still read their ring slot and decoded
//   tile, so there are three decoded tiles and the refill lags one slot more (STAGES >= 5 to keep
//   two k-tiles of copies ahead).
//
// WS = true (warp specialisation, wgmma only): warpgroups 0 .. WM/4 - 1 are consumers, one more
//   (warpgroup WM/4) the producer; no block-wide barrier after the start. The producer's 128
//   threads each own weight rows pt and pt + 128: they copy those rows' codes and scales through
//   their own CSTAGES-deep cp.async ring (CSTAGES - 1 k-tiles ahead) and decode them into a ring of
//   DSTAGES decoded tiles; nothing one producer thread copies is read by another, so only
//   cp.async.wait_group orders it. A decoded tile is handed over through mbarriers: full[d] (128
//   producer arrivals after a proxy fence) and empty[d] (one arrival per consumer warp once the
//   MMAs that read it are done). Each consumer warpgroup copies its own 64 x rows through its own
//   STAGES-deep cp.async ring (a named barrier over its 128 threads stands for __syncthreads) and
//   only issues wgmma, keeping one k-tile of MMAs in flight: after committing k-tile kt it waits for
//   kt - 1, then frees kt - 1's decoded tile and refills kt - 1's x slot. setmaxnreg moves the
//   producer's spare registers to the consumers (CREGS, PREGS).
//
// Ring discipline: one barrier per k-tile. After it, the ring slot of k-tile kt - 1 is refilled
// (every warp has finished reading it) and the k-tile kt is computed; the block-decode variant
// also decodes k-tile kt + 1, so it waits for one k-tile more (STAGES >= 3).
constexpr bool F16 = XF16;
constexpr int NWARPS = WM * WN;
constexpr int NT = 32 * NWARPS;
constexpr int BM = 16 * TM * WM;
constexpr int BN = 8 * TN * WN;
constexpr int BK = 64 * KH;
constexpr int KT = K / BK;
constexpr int XS_BYTES = BM * 128;  // one k64 half of x
constexpr int WS_BYTES = BN * 32;   // one k64 half of codes
constexpr int SROW = 4 * KH;        // a row's scale bytes per stage
constexpr int STAGE_BYTES = KH * (XS_BYTES + WS_BYTES) + BN * SROW;
constexpr int DS_BYTES = BN * 128;  // one k64 half of decoded weights (block decode)
constexpr int NUM_N = (N + BN - 1) / BN;
constexpr int XCOPIES = BM * 8 * KH / NT;  // 16-byte copies of x per thread per stage
constexpr int WCOPIES = (BN * 2 * KH + NT - 1) / NT;  // ... of codes (the last pass partial where NT
constexpr int SCOPIES = (BN + NT - 1) / NT;           // does not divide them), scale rows
constexpr int ITEMS = (BN * 4 * KH + NT - 1) / NT;    // 16-code groups each thread decodes per k-tile
constexpr bool WEVEN = (BN * 2 * KH) % NT == 0;       // every thread copies WCOPIES code pieces
constexpr bool IEVEN = (BN * 4 * KH) % NT == 0;       // ... decodes ITEMS groups
constexpr int KSTEPS = 4 * KH;             // MMA k-steps per k-tile
constexpr int LEAD = BDEC ? 1 : 0;         // k-tiles the decode runs ahead of the MMAs
constexpr int HELD = DEEP ? 1 : 0;         // k-tiles whose MMAs may still run after the barrier
constexpr int NBUF = 2 + HELD;             // decoded tiles (block decode)
static_assert(sizeof(T) == 2, "x must be bfloat16 or float16");
static_assert(K % BK == 0 && KT >= 1, "K must be a multiple of 64 * KH");
static_assert(N % 8 == 0, "N must be a multiple of 8");
static_assert(TN % 2 == 0, "TN must be even (ldmatrix reads two 8-row weight tiles at once)");
static_assert(WS || STAGES >= 2 + LEAD + HELD, "the ring needs STAGES >= 2 (3 with block decode, 4 with DEEP)");
static_assert(!DEEP || WGMMA, "DEEP is for the warpgroup MMA");
static_assert((BM * 8 * KH) % NT == 0, "x copies must split evenly");
static_assert(!BDEC || IEVEN || KH == 1, "decode items split unevenly only with one k64 half per stage");
static_assert(STAGE_BYTES % 128 == 0, "ring slots must keep the 128-byte swizzle period");
static_assert(!WGMMA || (BDEC && WN == 1 && TM == 1 && TN == 32 && WM % 4 == 0),
              "wgmma: block decode, warpgroups of 4 warps along M, each 64 x rows by 256 weight rows");
static_assert(!WGMMA || (STAGE_BYTES % 1024 == 0 && XS_BYTES % 1024 == 0),
              "wgmma: tiles must start on the 1024-byte period of the 128-byte swizzle");
static_assert(!WS || (WGMMA && !DEEP && KH == 1 && BN % 128 == 0 && STAGES >= 2 && DSTAGES >= 2 && CSTAGES >= 1),
              "warp specialisation: wgmma, one k64 half per stage, producer rows BN / 128, rings of >= 2");
static_assert(!WS || WM / 4 * 128 * (CREGS ? CREGS : 65536 / (NT + 128) / 8 * 8) +
                             128 * (PREGS ? PREGS : 65536 / (NT + 128) / 8 * 8) <= 65536,
              "setmaxnreg: the warpgroups' registers must fit the multiprocessor's 64K");
extern __shared__ __align__(WGMMA ? 1024 : 128) uint8_t smem[];  // wgmma: the swizzle period
const uint32_t sbase = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
const int M = x_shape[0];
const int tid = threadIdx.x;
const int lane = tid & 31;
const int warp = tid >> 5;
const int g = lane >> 2;
const int t = lane & 3;
const int wm = warp / WN;
const int wn = warp % WN;

// ---- the block's tile (gemm_nvfp4.cuh's raster)
const int2 tile = nvfp4g::raster(static_cast<int>(blockIdx.x), M, BM, BN, NUM_N, GROUP_M);
const int m0 = tile.x;
const int n0 = tile.y;

// ---- copies of k-tile kt into ring slot `slot` (an empty group past the last k-tile). Each
// thread's copies keep their rows and units from k-tile to k-tile: copy p of a kind moves row
// row0 + p * ROWS, so only its source advances (by BK). Rows past M or N are zero-filled from a
// clamped (valid) address.
constexpr int XROWS = NT / (8 * KH);  // x rows one pass of the block's threads covers
constexpr int WROWS = NT / (2 * KH);  // ... code rows
static_assert(XROWS % 8 == 0 && WROWS % 8 == 0, "copy passes must keep row & 7");
const int xrow = tid / (8 * KH);
const int xu = tid % (8 * KH);
const T* const xsrc = x + static_cast<size_t>(min(m0 + xrow, M - 1)) * K + xu * 8;
const uint32_t xdst = (xu / 8) * XS_BYTES + xrow * 128 + (((xu % 8) ^ (xrow & 7)) << 4);
const int wrow = tid / (2 * KH);
const int wu = tid % (2 * KH);
const uint8_t* const wsrc =
    reinterpret_cast<const uint8_t*>(w) + static_cast<size_t>(min(n0 + wrow, N - 1)) * (K / 2) + wu * 16;
const uint32_t wdst = KH * XS_BYTES + (wu / 2) * WS_BYTES + wrow * 32 + (wu % 2) * 16;
auto issue = [&](int kt, int slot) {
  if (kt < KT) {
    const uint32_t st = sbase + slot * STAGE_BYTES;
#pragma unroll
    for (int p = 0; p < XCOPIES; ++p) {
      const bool ok = m0 + xrow + p * XROWS < M;
      const T* src = xsrc + (ok ? static_cast<size_t>(p * XROWS) * K : 0) + kt * BK;
      nvfp4g::cp_async<16>(st + xdst + p * XROWS * 128, src, ok);
    }
#pragma unroll
    for (int p = 0; p < WCOPIES; ++p) {
      if (!WEVEN && wrow + p * WROWS >= BN) break;  // the partial last pass (whole warps drop out)
      const bool ok = n0 + wrow + p * WROWS < N;
      const uint8_t* src = wsrc + (ok ? static_cast<size_t>(p * WROWS) * (K / 2) : 0) + kt * (BK / 2);
      nvfp4g::cp_async<16>(st + wdst + p * WROWS * 32, src, ok);
    }
#pragma unroll
    for (int p = 0; p < SCOPIES; ++p) {
      const int row = tid + NT * p;
      if (BN % NT == 0 || row < BN) {
        const bool ok = n0 + row < N;
        const uint8_t* src = scales + static_cast<size_t>(min(n0 + row, N - 1)) * (K / 16) + kt * SROW;
        nvfp4g::cp_async<SROW>(st + KH * (XS_BYTES + WS_BYTES) + row * SROW, src, ok);
      }
    }
  }
  nvfp4::cp_async_commit();
};

float acc[TM][TN][4];
#pragma unroll
for (int i = 0; i < TM; ++i)
#pragma unroll
  for (int j = 0; j < TN; ++j)
#pragma unroll
    for (int c = 0; c < 4; ++c) acc[i][j][c] = 0.f;

// ---- block decode: item p of this thread (one 16-code group: half h, row, group gq) of the
// k-tile in ring slot `slot`, into decoded buffer `buf`: the block's item p NT + tid of the k-tile
// (half, then row, then group, fastest). Items p and p + 1 are NT / 4 rows apart (row & 7 kept), so
// their addresses differ by constants; where NT does not divide the k-tile's BN * 4 groups (KH = 1),
// the last item is left to the first threads (whole warps).
constexpr int IROWS = NT / 4;
static_assert(!BDEC || IROWS % 8 == 0, "decode items must keep row & 7");
const uint32_t dbase = sbase + STAGES * STAGE_BYTES;  // NBUF buffers of KH halves of DS_BYTES
const int irow = tid / 4;
const int igq = tid % 4;
const uint32_t icode = KH * XS_BYTES + irow * 32 + igq * 8;
const uint32_t iscale = KH * (XS_BYTES + WS_BYTES) + irow * SROW + igq;
const uint32_t idec0 = irow * 128 + (((2 * igq) ^ (irow & 7)) << 4);
const uint32_t idec1 = irow * 128 + (((2 * igq + 1) ^ (irow & 7)) << 4);
auto decode_item = [&](int slot, int buf, int p) {
  if (!IEVEN && p == ITEMS - 1 && p * NT + tid >= BN * 4 * KH) return;
  const int h = p * NT / (BN * 4);
  const int r = p * NT % (BN * 4) / 4;
  const uint32_t st = sbase + slot * STAGE_BYTES;
  const uint2 cw = nvfp4g::lds64(st + icode + h * WS_BYTES + r * 32);
  const uint32_t s = nvfp4g::scale_splat<F16>(nvfp4g::lds8(st + iscale + r * SROW + 4 * h));
  const uint32_t db = dbase + (buf * KH + h) * DS_BYTES + r * 128;
  nvfp4g::sts128(db + idec0, nvfp4g::decode_word_natural<F16>(cw.x, s));
  nvfp4g::sts128(db + idec1, nvfp4g::decode_word_natural<F16>(cw.y, s));
};

// ldmatrix lane offsets (k-step 0 of a k64 half; k-step s flips bits 5-6: unit 2s + c is
// (c ^ row & 7) ^ 2s for c in {0, 1}); m tile i adds 16 rows, weight tile pair jj 16 rows.
const int arow = wm * 16 * TM + (lane & 7) + ((lane >> 3) & 1) * 8;
const uint32_t aoff = arow * 128 + (((lane >> 4) ^ (arow & 7)) << 4);
const int brow = wn * 8 * TN + (lane & 7) + (lane >> 4) * 8;
const uint32_t boff = brow * 128 + ((((lane >> 3) & 1) ^ (brow & 7)) << 4);

// Block decode: the MMAs of the k-tile in `slot` from decoded buffer `buf`, and, spread over its
// k-steps, the decode of the next k-tile (ring slot `next`) into buffer `nbuf`. After the last
// k-tile that decode reads a slot no copy is filling and writes a buffer nothing reads: harmless,
// and unconditional, so the compiler can interleave it with the MMAs (no branch between them).
auto compute_block = [&](int slot, int buf, int next, int nbuf) {
  const uint32_t xs = slot * STAGE_BYTES;
  const uint32_t db = dbase + buf * KH * DS_BYTES;
#pragma unroll
  for (int ks = 0; ks < KSTEPS; ++ks) {
    const int h = ks / 4;
    const uint32_t flip = (ks % 4) << 5;
    uint32_t a[TM][4];
    uint32_t b[TN][2];
    const uint32_t abase = sbase + ((xs + h * XS_BYTES + aoff) ^ flip);
#pragma unroll
    for (int i = 0; i < TM; ++i) nvfp4g::ldmatrix_x4(a[i], abase + i * 16 * 128);
    const uint32_t bbase = db + ((h * DS_BYTES + boff) ^ flip);
#pragma unroll
    for (int jj = 0; jj < TN / 2; ++jj) {
      uint32_t r[4];
      nvfp4g::ldmatrix_x4(r, bbase + jj * 16 * 128);
      b[2 * jj][0] = r[0];
      b[2 * jj][1] = r[1];
      b[2 * jj + 1][0] = r[2];
      b[2 * jj + 1][1] = r[3];
    }
#pragma unroll
    for (int p = 0; p < ITEMS; ++p) {
      if (p * KSTEPS / ITEMS == ks) decode_item(next, nbuf, p);
    }
#pragma unroll
    for (int i = 0; i < TM; ++i)
#pragma unroll
      for (int j = 0; j < TN; ++j) nvfp4g::mma<F16>(acc[i][j], a[i][0], a[i][1], a[i][2], a[i][3], b[j][0], b[j][1]);
  }
};

// Warpgroup MMA (WGMMA): the k-tile in `slot` against decoded buffer `buf`, and the decode of the
// next k-tile (ring slot `next`) into buffer `nbuf` while the MMAs run.
auto compute_wgmma = [&](int slot, int buf, int next, int nbuf) {
  if constexpr (WGMMA) {
    float(&d)[128] = *reinterpret_cast<float(*)[128]>(&acc[0][0][0]);
    const uint32_t xs = sbase + slot * STAGE_BYTES + (warp / 4) * 64 * 128;  // this warpgroup's x rows
    const uint32_t db = dbase + buf * KH * DS_BYTES;
#pragma unroll
    for (int c = 0; c < 128; ++c) nvfp4g::fence_operand(d[c]);
    nvfp4g::wgmma_fence();
#pragma unroll
    for (int ks = 0; ks < KSTEPS; ++ks) {
      const int h = ks / 4;
      const uint32_t kofs = (ks % 4) * 32;  // a k16 step inside the 128-byte swizzled rows
      nvfp4g::wgmma_m64n256k16<F16>(d, nvfp4g::wgmma_desc(xs + h * XS_BYTES + kofs),
                                    nvfp4g::wgmma_desc(db + h * DS_BYTES + kofs));
#pragma unroll
      for (int p = 0; p < ITEMS; ++p) {
        if (IEVEN && p * KSTEPS / ITEMS == ks) decode_item(next, nbuf, p);
      }
    }
    nvfp4g::wgmma_commit();
    if constexpr (!IEVEN) {  // (the partial item's branch between two wgmma would make ptxas
#pragma unroll               // fence them, C7519: the decode follows the last one instead)
      for (int p = 0; p < ITEMS; ++p) decode_item(next, nbuf, p);
    }
    nvfp4g::wgmma_wait<HELD>();  // before the barrier: the slot and buffer it frees are refilled
#pragma unroll
    for (int c = 0; c < 128; ++c) nvfp4g::fence_operand(d[c]);
  }
};

// Warp decode: lane offsets of its x pieces (rows g, g + 8 of m tile 0: row & 7 == g), code
// words and scales (weight row g of tile 0).
const uint32_t xoff = (wm * 16 * TM + g) * 128;
const uint32_t woff = KH * XS_BYTES + (wn * 8 * TN + g) * 32 + t * 8;
const uint32_t soff = KH * (XS_BYTES + WS_BYTES) + (wn * 8 * TN + g) * SROW + t;

// Warp decode: the MMAs of the k-tile in `slot`, codes decoded in registers.
auto compute_warp = [&](int slot) {
  const uint32_t st = sbase + slot * STAGE_BYTES;
#pragma unroll
  for (int h = 0; h < KH; ++h) {
    uint32_t sp[TN];
    uint2 cw[TN];  // code words 2t, 2t + 1 of weight row g of each tile (one 8-byte read: a
                   // half-warp's reads cover 4 rows x 32 contiguous bytes, conflict-free)
#pragma unroll
    for (int j = 0; j < TN; ++j) {
      sp[j] = nvfp4g::scale_splat<F16>(nvfp4g::lds8(st + soff + j * 8 * SROW + 4 * h));
      cw[j] = nvfp4g::lds64(st + woff + h * WS_BYTES + j * 8 * 32);
    }
#pragma unroll
    for (int kk = 0; kk < 2; ++kk) {
      uint32_t a[TM][2][4];  // [m tile][row g, row g + 8][pair j: (x_j, x_j+4)]
      const uint32_t xp = st + h * XS_BYTES + xoff + (((2 * t + kk) ^ g) << 4);
#pragma unroll
      for (int i = 0; i < TM; ++i) {
        nvfp4g::permute_x8(nvfp4g::lds128(xp + i * 16 * 128), a[i][0]);
        nvfp4g::permute_x8(nvfp4g::lds128(xp + i * 16 * 128 + 8 * 128), a[i][1]);
      }
#pragma unroll
      for (int j = 0; j < TN; ++j) {
        uint32_t d[4];
        nvfp4g::decode_word<F16>(kk == 0 ? cw[j].x : cw[j].y, sp[j], d);
#pragma unroll
        for (int sub = 0; sub < 2; ++sub)
#pragma unroll
          for (int i = 0; i < TM; ++i)
            nvfp4g::mma<F16>(acc[i][j], a[i][0][2 * sub], a[i][1][2 * sub], a[i][0][2 * sub + 1],
                             a[i][1][2 * sub + 1], d[2 * sub], d[2 * sub + 1]);
      }
    }
  }
};

// ---- warp specialisation (WS). Shared memory: the x ring (STAGES slots of BM rows, consumer
// warpgroup c's 64 rows at c * WX_BYTES), the decoded ring (DSTAGES tiles of BN rows), the code ring
// (CSTAGES slots: BN rows of 32 bytes of codes, then BN rows of 4 scale bytes), then the mbarriers
// full[DSTAGES] and empty[DSTAGES].
constexpr int NC = WS ? WM / 4 : 1;  // consumer warpgroups
constexpr int WX_BYTES = 64 * 128;   // one consumer's x rows of one k-tile
constexpr int CSTAGE_BYTES = BN * (32 + 4);
constexpr int PROWS = BN / 128;  // weight rows per producer thread
// rows decoded one after the other where the producer keeps few registers (setmaxnreg)
constexpr int PUNROLL = PREGS != 0 && PREGS < 64 ? 1 : PROWS;
constexpr uint32_t WS_DEC = STAGES * XS_BYTES;
constexpr uint32_t WS_CODE = WS_DEC + DSTAGES * DS_BYTES;
constexpr uint32_t WS_BAR = WS_CODE + CSTAGES * CSTAGE_BYTES;
static_assert(!WS || (XS_BYTES % 1024 == 0 && WS_BAR % 8 == 0), "WS: tiles on the swizzle period, mbarriers on 8 bytes");

// The producer (thread pt of warpgroup NC): weight rows pt + 128 q of the block's BN, their code
// pieces stored with 16-byte unit u at (u ^ (pt >> 2 & 1)) so that a warp's 16-byte reads of 32
// rows are conflict-free; decoded exactly as decode_item does, into the decoded ring.
const int pt = tid - NT;  // (negative in the consumers, which use none of this)
const uint32_t csw = ((pt >> 2) & 1) << 4;
const size_t prow = static_cast<size_t>(min(n0 + max(pt, 0), N - 1));
const uint8_t* const pw = reinterpret_cast<const uint8_t*>(w) + prow * (K / 2);
const uint8_t* const ps = scales + prow * (K / 16);
auto produce_issue = [&](int kt, int cslot) {
  if (kt < KT) {
    const uint32_t cs = sbase + WS_CODE + cslot * CSTAGE_BYTES;
#pragma unroll
    for (int q = 0; q < PROWS; ++q) {
      const int r = pt + 128 * q;
      const bool ok = n0 + r < N;  // rows past N: nothing read (from row pt's address), zeros
      const size_t skip = ok ? static_cast<size_t>(128 * q) : 0;
      const uint8_t* src = pw + skip * (K / 2) + kt * (BK / 2);
      nvfp4g::cp_async<16>(cs + r * 32 + csw, src, ok);
      nvfp4g::cp_async<16>(cs + r * 32 + (16 ^ csw), src + 16, ok);
      nvfp4g::cp_async<4>(cs + BN * 32 + r * 4, ps + skip * (K / 16) + kt * SROW, ok);
    }
  }
  nvfp4::cp_async_commit();
};
auto produce_decode = [&](int cslot, int dslot) {
  const uint32_t cs = sbase + WS_CODE + cslot * CSTAGE_BYTES;
  const uint32_t ds = sbase + WS_DEC + dslot * DS_BYTES;
#pragma unroll PUNROLL
  for (int q = 0; q < PROWS; ++q) {
    const int r = pt + 128 * q;
    const uint32_t sc = nvfp4g::lds32(cs + BN * 32 + r * 4);  // the row's four group scales
    const uint32_t drow = ds + r * 128;
#pragma unroll
    for (int u = 0; u < 2; ++u) {  // code unit u: words 4u .. 4u + 3 (groups 2u, 2u + 1)
      const uint4 cw = nvfp4g::lds128(cs + r * 32 + ((16 * u) ^ csw));
      const uint32_t s0 = nvfp4g::scale_splat<F16>(sc >> (16 * u));
      const uint32_t s1 = nvfp4g::scale_splat<F16>(sc >> (16 * u + 8));
      nvfp4g::sts128(drow + (((4 * u) ^ (r & 7)) << 4), nvfp4g::decode_word_natural<F16>(cw.x, s0));
      nvfp4g::sts128(drow + (((4 * u + 1) ^ (r & 7)) << 4), nvfp4g::decode_word_natural<F16>(cw.y, s0));
      nvfp4g::sts128(drow + (((4 * u + 2) ^ (r & 7)) << 4), nvfp4g::decode_word_natural<F16>(cw.z, s1));
      nvfp4g::sts128(drow + (((4 * u + 3) ^ (r & 7)) << 4), nvfp4g::decode_word_natural<F16>(cw.w, s1));
    }
  }
};
auto produce = [&]() {
#pragma unroll
  for (int c = 0; c < CSTAGES - 1; ++c) produce_issue(c, c);
  nvfp4g::Ring<CSTAGES> code;  // k-tile kt's code slot
  nvfp4g::Ring<DSTAGES> dec;   // ... decoded tile
  for (int kt = 0; kt < KT; ++kt) {
    produce_issue(kt + CSTAGES - 1, code.prev());  // kt - 1's slot, which this thread decoded
    nvfp4::cp_async_wait<CSTAGES - 1>();  // k-tile kt's codes have landed (this thread's own)
    nvfp4g::mbar_wait(sbase + WS_BAR + 8 * (DSTAGES + dec.slot), dec.phase ^ 1);  // kt - DSTAGES is done
    produce_decode(code.slot, dec.slot);
    nvfp4g::fence_proxy_async();  // the decoded tile, to the MMAs' proxy ...
    nvfp4g::mbar_arrive(sbase + WS_BAR + 8 * dec.slot);  // ... and to the consumers
    code.advance();
    dec.advance();
  }
  nvfp4::cp_async_wait<0>();
};

// A consumer (warpgroup cwg, thread ct): its 64 x rows, copied by its own threads as issue() does.
const int cwg = warp / 4;
const int ct = tid % 128;
const int crow = ct / 8;
const int cu = ct % 8;
const T* const csrc = x + static_cast<size_t>(min(m0 + 64 * cwg + crow, M - 1)) * K + cu * 8;
const uint32_t cdst = cwg * WX_BYTES + crow * 128 + ((cu ^ (crow & 7)) << 4);
auto consume_issue = [&](int kt, int slot) {
  if (kt < KT) {
    const uint32_t st = sbase + slot * XS_BYTES;
#pragma unroll
    for (int p = 0; p < 4; ++p) {
      const bool ok = m0 + 64 * cwg + crow + 16 * p < M;
      const T* src = csrc + (ok ? static_cast<size_t>(16 * p) * K : 0) + kt * BK;
      nvfp4g::cp_async<16>(st + cdst + p * 16 * 128, src, ok);
    }
  }
  nvfp4::cp_async_commit();
};
auto consume = [&]() {
  if constexpr (WS) {
    float(&d)[128] = *reinterpret_cast<float(*)[128]>(&acc[0][0][0]);
#pragma unroll
    for (int c = 0; c < 128; ++c) d[c] = 0.f;  // (again: nothing of it lives across setmaxnreg)
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) consume_issue(s, s);
    nvfp4g::Ring<STAGES> xr;    // k-tile kt's x slot
    nvfp4g::Ring<DSTAGES> dec;  // ... decoded tile
    for (int kt = 0; kt < KT; ++kt) {
      nvfp4::cp_async_wait<STAGES - 2>();  // k-tile kt's x rows have landed (this thread's) ...
      nvfp4g::fence_proxy_async();         // ... for the MMAs' proxy ...
      nvfp4g::bar_warpgroup(1 + cwg);       // ... and this warpgroup's other threads
      nvfp4g::mbar_wait(sbase + WS_BAR + 8 * dec.slot, dec.phase);  // k-tile kt's decoded tile
#pragma unroll
      for (int c = 0; c < 128; ++c) nvfp4g::fence_operand(d[c]);
      nvfp4g::wgmma_fence();
      const uint32_t xs = sbase + xr.slot * XS_BYTES + cwg * WX_BYTES;
      const uint32_t db = sbase + WS_DEC + dec.slot * DS_BYTES;
#pragma unroll
      for (int ks = 0; ks < 4; ++ks) {
        if constexpr (WGN == 256) {
          nvfp4g::wgmma_m64n256k16<F16>(d, nvfp4g::wgmma_desc(xs + ks * 32), nvfp4g::wgmma_desc(db + ks * 32));
        } else {  // two halves of the weight rows (128 rows are 16 KB of the decoded tile)
          nvfp4g::wgmma_m64n128k16<F16>(d, nvfp4g::wgmma_desc(xs + ks * 32), nvfp4g::wgmma_desc(db + ks * 32));
          nvfp4g::wgmma_m64n128k16<F16>(d + 64, nvfp4g::wgmma_desc(xs + ks * 32),
                                        nvfp4g::wgmma_desc(db + 128 * 128 + ks * 32));
        }
      }
      nvfp4g::wgmma_commit();
      nvfp4g::wgmma_wait<1>();  // k-tile kt - 1's MMAs are done: its decoded tile and x slot are free
#pragma unroll
      for (int c = 0; c < 128; ++c) nvfp4g::fence_operand(d[c]);
      if (kt > 0 && lane == 0) nvfp4g::mbar_arrive(sbase + WS_BAR + 8 * (DSTAGES + dec.prev()));  // one a warp
      consume_issue(kt + STAGES - 1, xr.prev());
      xr.advance();
      dec.advance();
    }
    nvfp4::cp_async_wait<0>();
    nvfp4g::wgmma_wait<0>();
#pragma unroll
    for (int c = 0; c < 128; ++c) nvfp4g::fence_operand(d[c]);
  }
};

// ---- the pipeline
if constexpr (WS) {
  if (tid == 0) {
#pragma unroll
    for (int b = 0; b < DSTAGES; ++b) {
      nvfp4g::mbar_init(sbase + WS_BAR + 8 * b, 128);                   // full: the producer's threads
      nvfp4g::mbar_init(sbase + WS_BAR + 8 * (DSTAGES + b), 4 * NC);    // empty: the consumer warps
    }
  }
  __syncthreads();  // the barriers are initialised (the last block-wide barrier)
  if (warp >= NWARPS) {
    if constexpr (PREGS != 0) nvfp4g::setmaxnreg_dec<PREGS>();
    produce();
    return;  // the producer writes no output
  }
  if constexpr (CREGS != 0) nvfp4g::setmaxnreg_inc<CREGS>();
  consume();
} else {
  // ring slots and decoded buffers as counters (k-tile kt: slot kt % STAGES, buffer kt % NBUF)
#pragma unroll
  for (int s = 0; s < STAGES - 1 - HELD; ++s) issue(s, s);
  int slot = 0;                    // k-tile kt's slot
  int refill = STAGES - 1 - HELD;  // slot of k-tile kt + STAGES - 1 - HELD (that of kt - 1 - HELD)
  int buf = 0;                     // k-tile kt's decoded buffer
  if constexpr (BDEC) {
    nvfp4::cp_async_wait<STAGES - 2 - HELD>();  // k-tile 0 has landed (this thread's copies) ...
    __syncthreads();                            // ... and everyone's
#pragma unroll
    for (int p = 0; p < ITEMS; ++p) decode_item(0, 0, p);
  }
  for (int kt = 0; kt < KT; ++kt) {
    nvfp4::cp_async_wait<STAGES - 2 - LEAD - HELD>();  // k-tile kt + LEAD has landed
    if constexpr (WGMMA) nvfp4g::fence_proxy_async();  // it and the last decode, to the MMAs' proxy
    __syncthreads();  // ... for every thread; and every warp is done with k-tile kt - 1 - HELD
    issue(kt + STAGES - 1 - HELD, refill);
    const int next = slot + 1 == STAGES ? 0 : slot + 1;
    const int nbuf = buf + 1 == NBUF ? 0 : buf + 1;
    if constexpr (WGMMA) {
      compute_wgmma(slot, buf, next, nbuf);
    } else if constexpr (BDEC) {
      compute_block(slot, buf, next, nbuf);
    } else {
      compute_warp(slot);
    }
    refill = refill + 1 == STAGES ? 0 : refill + 1;
    slot = next;
    buf = nbuf;
  }
  nvfp4::cp_async_wait<0>();
  if constexpr (WGMMA) {
    nvfp4g::wgmma_wait<0>();
    float(&d)[128] = *reinterpret_cast<float(*)[128]>(&acc[0][0][0]);
#pragma unroll
    for (int c = 0; c < 128; ++c) nvfp4g::fence_operand(d[c]);
  }
}

// ---- epilogue: c0, c1 = (x row g, weight rows 2t, 2t+1), c2, c3 = x row g + 8
const float mult = gsv[0] * (F16 ? NVFP4G_EPILOGUE_F16 : NVFP4G_EPILOGUE_BF16);
#pragma unroll
for (int i = 0; i < TM; ++i) {
#pragma unroll
  for (int hf = 0; hf < 2; ++hf) {
    const int row = m0 + wm * 16 * TM + 16 * i + g + 8 * hf;
    if (row >= M) continue;
    T* const yrow = y + static_cast<size_t>(row) * N;
#pragma unroll
    for (int j = 0; j < TN; ++j) {
      const int col = n0 + wn * 8 * TN + 8 * j + 2 * t;
      if (col >= N) continue;
      const float lo = acc[i][j][2 * hf] * mult;
      const float hi = acc[i][j][2 * hf + 1] * mult;
      if constexpr (F16) {
        *reinterpret_cast<__half2*>(yrow + col) = __floats2half2_rn(lo, hi);
      } else {
        *reinterpret_cast<__nv_bfloat162*>(yrow + col) = __floats2bfloat162_rn(lo, hi);
      }
    }
  }
}
