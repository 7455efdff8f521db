// Body of the NVFP4 prefill GEMM with the weights in registers: y[M, N] = x[M, K] @ dequant(w)[N, K]^T * gsv.
// (sm_90a only, built by kernels/cuda/nvrtc.py and launched through mx.fast.precompiled_cuda_kernel;
// the header is nvfp4_mma.cuh followed by gemm_nvfp4.cuh. Same inputs and output as gemm_nvfp4.cu.)
//
// Template constants (kernels/cuda/gemm_layout.py writes them): T, XF16 (T is float16), N (a
//          multiple of 8), K (a multiple of 64), WG (warpgroups: the block's weight rows BN = 64 WG),
//          BT (x rows, tokens, per block: 128, 192 or 256, the wgmma's n), STAGES (ring depth, >= 4),
//          GROUP_M (raster group height), NB (A-fragment buffers: 2, 4, 8 or 12), EARLY (NB >= 8: a k-tile's
//          MMAs issued before its barrier), YS (the y tile staged in shared memory, then stored in
//          16-byte pieces). M is read from x's shape.
// Launch:  ceil(M / BT) * ceil(N / BN) blocks of 128 WG threads, dynamic shared memory
//          STAGES * gemm_layout.stage_bytes().
//
// The roles of gemm_nvfp4.cu's wgmma variants swapped: D = W x^T. Each warpgroup owns 64 weight
// rows and all BT x rows of the block: per k16 step one wgmma.m64n{BT}k16 whose A operand (the
// weights, 64 x 16) its threads decode from the codes straight into registers, in the m16n8k16 A
// fragment order (thread g, t of warp q: rows 16 q + g, + 8, k 2t, 2t + 1 and 2t + 8, 2t + 9: byte t
// of code words 2s and 2s + 1 of the two rows in step s), and whose B operand is the x tile in shared
// memory (K-major, 128-byte swizzle, as gemm_nvfp4.cu copies it). Every weight is decoded once per
// block (by one thread, no shared-memory round trip, no barrier between the decode and its MMAs) and
// feeds BT x rows' MMAs, against BM = 128..192 in gemm_nvfp4.cu's block decode.
//
// Pipeline: a ring of STAGES slots (x tile, code rows, scale rows) filled by cp.async, one block
// barrier per k-tile. NB = 2 or 4: each k16 step's MMA is its own commit group; after committing step i
// a thread waits until at most NB - 1 groups run (step i - NB + 1 done), then decodes step i + 1 into
// the A buffer step i - NB + 1 used, so NB - 1 MMAs stay queued while the next fragment is decoded,
// across k-tiles and barriers. NB = 8: a k-tile's four MMAs are one group (one fence, issued back to
// back, as dense GEMMs do), and the next k-tile's 16 fragment registers are decoded while they run,
// after a wait for the k-tile before, whose buffers they reuse. NB = 12: three k-tiles' buffers; the next
// k-tile is decoded into those of k-tile kt - 2 (retired by k-tile kt - 1's wait) before the wait for
// kt - 1, so two k-tiles' MMAs stay queued while the warps decode, one across the barrier.
// EARLY (NB >= 8): k-tile kt's MMAs are issued before k-tile kt's barrier, not after it: its x tile landed
// and was fenced and made visible at k-tile kt - 1's barrier, and its fragments were decoded at the end
// of kt - 1, so the barrier only orders what comes after it (the refill, the decode of kt + 1); the
// tensor cores then have k-tiles kt - 1 and kt queued across the barrier where they had kt - 1 alone.
// Ring discipline: at k-tile kt's barrier every thread has decoded from k-tile kt - 1 at the latest,
// and its MMAs still in flight are of k-tiles kt - 1 and kt (NB - 1 <= 3 steps; NB = 8, 12: k-tile
// kt - 1), so the slot of k-tile kt - 2 is free: it is refilled with k-tile kt + STAGES - 2, and k-tile
// kt + 1 (whose codes the end of kt decodes) must have landed (STAGES >= 4).
//
// Epilogue: accumulator d[4j + c] is weight row 16 q + g + 8 (c >> 1) by x row 8 j + 2 t + (c & 1); y is
// written element by element (16-bit stores: a warp's store covers 16 contiguous bytes of 4 rows of y,
// half of each 32-byte sector), or, YS, through shared memory: the BT x BN tile of y row-major in the idle
// ring (row pitch 2 BN + 16 bytes: a warp's 16-bit stores fall in distinct banks), then 16-byte pieces, a
// warp's covering two whole rows of the tile (ncu: the direct stores used 16 of each sector's 32 bytes).
constexpr bool F16 = XF16;
constexpr int NT = 128 * WG;
constexpr int BN = 64 * WG;
constexpr int KT = K / 64;
constexpr int XS_BYTES = BT * 128;   // the x tile: BT rows of 64 values
constexpr int CS_BYTES = BN * 32;    // the code rows: 64 codes each
constexpr int SS_BYTES = BN * 4;     // the scale rows: 4 groups each
constexpr int STAGE_BYTES = (XS_BYTES + CS_BYTES + SS_BYTES + 1023) / 1024 * 1024;  // the swizzle period
constexpr int ACC = BT / 2;          // accumulators per thread (64 x BT over 128 threads)
constexpr int NUM_N = (N + BN - 1) / BN;
constexpr int XCOPIES = BT * 8 / NT;  // 16-byte copies of x per thread per k-tile
constexpr int XROWS = NT / 8;         // x rows one pass of the block's threads covers
constexpr int KSETS = NB >= 8 ? NB / 4 : 1;  // k-tiles of A fragments held (NB >= 8: a k-tile's MMAs one group)
constexpr int YPITCH = 2 * BN + 16;    // YS: bytes per row of the staged y tile
static_assert(sizeof(T) == 2, "x must be bfloat16 or float16");
static_assert(K % 64 == 0 && KT >= 1, "K must be a multiple of 64");
static_assert(N % 8 == 0, "N must be a multiple of 8");
static_assert(BT == 128 || BT == 192 || BT == 256, "BT (the wgmma's n) is 128, 192 or 256");
static_assert(STAGES >= 4, "the ring needs STAGES >= 4 (MMAs of k-tile kt - 1 in flight, kt + 1 decoded)");
static_assert(NB == 2 || NB == 4 || NB == 8 || NB == 12, "NB: 2 or 4 buffers of one step each, or 8 / 12 (two / three k-tiles)");
static_assert(!EARLY || NB >= 8, "EARLY issues a whole k-tile's MMAs as one group (NB = 8 or 12)");
static_assert((BT * 8) % NT == 0 && XROWS % 8 == 0, "x copies must split evenly and keep row & 7");
static_assert(!YS || BT * YPITCH <= STAGES * STAGE_BYTES, "the staged y tile must fit in the ring");
extern __shared__ __align__(1024) uint8_t smem[];
const uint32_t sbase = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
const int M = x_shape[0];
const int tid = threadIdx.x;
const int lane = tid & 31;
const int warp = tid >> 5;
const int g = lane >> 2;
const int t = lane & 3;

// ---- the block's tile (gemm_nvfp4.cuh's raster)
const int2 tile = nvfp4g::raster(static_cast<int>(blockIdx.x), M, BT, BN, NUM_N, GROUP_M);
const int m0 = tile.x;
const int n0 = tile.y;

// ---- copies of k-tile kt into ring slot `slot` (an empty group past the last k-tile): x as in
// gemm_nvfp4.cu (row xrow + p XROWS, 16-byte unit xu XOR-swizzled by row & 7), code row tid / 2
// (16-byte half tid % 2; BN * 2 = NT pieces, one each), scale row tid (the first BN threads).
// Rows past M or N are zero-filled from a clamped (valid) address.
const int xrow = tid / 8;
const int xu = tid % 8;
const T* const xsrc = x + static_cast<size_t>(min(m0 + xrow, M - 1)) * K + xu * 8;
const uint32_t xdst = xrow * 128 + ((xu ^ (xrow & 7)) << 4);
const int wrow = tid / 2;
const bool wok = n0 + wrow < N;
const uint8_t* const wsrc = reinterpret_cast<const uint8_t*>(w) + static_cast<size_t>(min(n0 + wrow, N - 1)) * (K / 2) + (tid % 2) * 16;
const uint32_t wdst = XS_BYTES + wrow * 32 + (tid % 2) * 16;
const bool sok = tid < BN && n0 + tid < N;
const uint8_t* const ssrc = scales + static_cast<size_t>(min(n0 + tid, N - 1)) * (K / 16);
const uint32_t sdst = XS_BYTES + CS_BYTES + tid * 4;
auto issue = [&](int kt, int slot) {
  if (kt < KT) {
    const uint32_t st = sbase + slot * STAGE_BYTES;
#pragma unroll
    for (int p = 0; p < XCOPIES; ++p) {
      const bool ok = m0 + xrow + p * XROWS < M;
      const T* src = xsrc + (ok ? static_cast<size_t>(p * XROWS) * K : 0) + kt * 64;
      nvfp4g::cp_async<16>(st + xdst + p * XROWS * 128, src, ok);
    }
    nvfp4g::cp_async<16>(st + wdst, wsrc + kt * 32, wok);
    if (tid < BN) nvfp4g::cp_async<4>(st + sdst, ssrc + kt * 4, sok);
  }
  nvfp4::cp_async_commit();
};

// ---- this thread's weight rows (of the block's BN) and its A fragments
const int wg = warp / 4;
const int arow = 64 * wg + 16 * (warp % 4) + g;  // and arow + 8
const uint32_t acode = XS_BYTES + arow * 32;       // the row's code bytes in a slot
const uint32_t ascale = XS_BYTES + CS_BYTES + arow * 4;
const uint32_t sel = 0x4440u | static_cast<uint32_t>(t);  // byte t, zero-extended
uint32_t afrag[NB][4];
uint32_t sc[2];  // the two rows' four group scales of the k-tile being decoded
auto load_scales = [&](int slot) {
  const uint32_t st = sbase + slot * STAGE_BYTES;
  sc[0] = nvfp4g::lds32(st + ascale);
  sc[1] = nvfp4g::lds32(st + ascale + 8 * 4);
};
// Step s (group s) of the k-tile in `slot` into A buffer `b`: code words 2s, 2s + 1 of rows arow, arow + 8.
auto decode_step = [&](int slot, int s, int b) {
  const uint32_t st = sbase + slot * STAGE_BYTES;
  const uint2 c0 = nvfp4g::lds64(st + acode + 8 * s);
  const uint2 c1 = nvfp4g::lds64(st + acode + 8 * 32 + 8 * s);
  const uint32_t s0 = nvfp4g::scale_splat<F16>(sc[0] >> (8 * s));
  const uint32_t s1 = nvfp4g::scale_splat<F16>(sc[1] >> (8 * s));
  afrag[b][0] = nvfp4g::decode_byte_pair<F16>(c0.x, sel, s0);  // row g, k 2t, 2t + 1
  afrag[b][1] = nvfp4g::decode_byte_pair<F16>(c1.x, sel, s1);  // row g + 8
  afrag[b][2] = nvfp4g::decode_byte_pair<F16>(c0.y, sel, s0);  // row g, k 2t + 8, 2t + 9
  afrag[b][3] = nvfp4g::decode_byte_pair<F16>(c1.y, sel, s1);  // row g + 8
};

float d[ACC];
#pragma unroll
for (int c = 0; c < ACC; ++c) d[c] = 0.f;

// ---- the pipeline (k-tile kt: slot kt % STAGES)
#pragma unroll
for (int s = 0; s < STAGES - 2; ++s) issue(s, s);
nvfp4::cp_async_wait<STAGES - 3>();  // k-tile 0 has landed (this thread's copies) ...
nvfp4g::fence_proxy_async();         // ... for the MMAs' proxy (EARLY issues k-tile 0's before any barrier of the loop) ...
__syncthreads();                     // ... and everyone's
load_scales(0);
#pragma unroll
for (int s = 0; s < (NB >= 8 ? 4 : 1); ++s) decode_step(0, s, s);
int slot = 0;
// One k-tile, its A fragments in buffers base .. base + 3 (NB = 8 / 12: the k-tiles take the KSETS sets of
// buffers in turn, so the loop below runs them in pairs / threes to keep every register index static).
auto ktile = [&](int kt, int base) {
  const uint32_t xs = sbase + slot * STAGE_BYTES;
  auto mma = [&](int s, const uint32_t (&a)[4]) {
    if constexpr (BT == 256) {
      nvfp4g::wgmma_rs_m64n256k16<F16>(d, a, nvfp4g::wgmma_desc(xs + s * 32));
    } else if constexpr (BT == 192) {
      nvfp4g::wgmma_rs_m64n192k16<F16>(d, a, nvfp4g::wgmma_desc(xs + s * 32));
    } else {
      nvfp4g::wgmma_rs_m64n128k16<F16>(d, a, nvfp4g::wgmma_desc(xs + s * 32));
    }
  };
  auto mma_group = [&]() {  // (NB >= 8) the k-tile's four MMAs as one commit group
#pragma unroll
    for (int c = 0; c < ACC; ++c) nvfp4g::fence_operand(d[c]);
    nvfp4g::wgmma_fence();
#pragma unroll
    for (int s = 0; s < 4; ++s) mma(s, afrag[base + s]);
    nvfp4g::wgmma_commit();
  };
  if constexpr (EARLY) mma_group();    // before the barrier: k-tile kt's tile and fragments are ready
  nvfp4::cp_async_wait<STAGES - 4>();  // k-tile kt + 1 has landed
  nvfp4g::fence_proxy_async();         // ... for the MMAs' proxy (the x tiles) ...
  __syncthreads();                     // ... and every thread; k-tile kt - 2's slot is free
  const int next = slot + 1 == STAGES ? 0 : slot + 1;
  issue(kt + STAGES - 2, slot >= 2 ? slot - 2 : slot + STAGES - 2);
  if constexpr (NB >= 8) {  // the k-tile's four MMAs as one group, the next k-tile decoded under them
    if constexpr (!EARLY) mma_group();
    if constexpr (NB == 8) {
      nvfp4g::wgmma_wait<1>();  // k-tile kt - 1's MMAs are done: the other half of the buffers is free
#pragma unroll
      for (int c = 0; c < ACC; ++c) nvfp4g::fence_operand(d[c]);
    }
    load_scales(next);  // (past the last k-tile: a stale slot, never used)
#pragma unroll
    for (int s = 0; s < 4; ++s) decode_step(next, s, (base + 4 + s) % NB);  // NB = 12: k-tile kt - 2's set
    if constexpr (NB == 12) {
      nvfp4g::wgmma_wait<1>();  // k-tile kt - 1's MMAs are done: its set is free for k-tile kt + 2
#pragma unroll
      for (int c = 0; c < ACC; ++c) nvfp4g::fence_operand(d[c]);
    }
  } else {
#pragma unroll
    for (int s = 0; s < 4; ++s) {
#pragma unroll
      for (int c = 0; c < ACC; ++c) nvfp4g::fence_operand(d[c]);
      nvfp4g::wgmma_fence();
      mma(s, afrag[s % NB]);
      nvfp4g::wgmma_commit();
      nvfp4g::wgmma_wait<NB - 1>();  // step i - NB + 1 is done: its A buffer, (s + 1) % NB, is free
#pragma unroll
      for (int c = 0; c < ACC; ++c) nvfp4g::fence_operand(d[c]);
      if (s < 3) {
        decode_step(slot, s + 1, (s + 1) % NB);
      } else {  // the next k-tile's first step (past the last k-tile: a stale slot, never used)
        load_scales(next);
        decode_step(next, 0, 0);
      }
    }
  }
  slot = next;
};
for (int kt = 0; kt < KT; kt += KSETS == 3 ? 3 : 2) {
  ktile(kt, 0);
  if (kt + 1 < KT) ktile(kt + 1, 4);
  if constexpr (KSETS == 3) {
    if (kt + 2 < KT) ktile(kt + 2, 8);
  }
}
nvfp4::cp_async_wait<0>();
nvfp4g::wgmma_wait<0>();
#pragma unroll
for (int c = 0; c < ACC; ++c) nvfp4g::fence_operand(d[c]);

// ---- epilogue: d[4j + c] = (weight row arow + 8 (c >> 1), x row 8 j + 2 t + (c & 1))
const float mult = gsv[0] * (F16 ? NVFP4G_EPILOGUE_F16 : NVFP4G_EPILOGUE_BF16);
if constexpr (YS) {
  // Every copy of this thread has landed and its MMAs have retired; after the barrier, everyone's: the
  // ring is free for the tile of y.
  __syncthreads();
#pragma unroll
  for (int hf = 0; hf < 2; ++hf) {
#pragma unroll
    for (int j = 0; j < BT / 8; ++j) {
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        const int at = (8 * j + 2 * t + c) * YPITCH + (arow + 8 * hf) * 2;
        const float v = d[4 * j + 2 * hf + c] * mult;
        if constexpr (F16) {
          *reinterpret_cast<__half*>(smem + at) = __float2half_rn(v);
        } else {
          *reinterpret_cast<__nv_bfloat16*>(smem + at) = __float2bfloat16_rn(v);
        }
      }
    }
  }
  __syncthreads();
  // Piece i: tile row i / (BN / 8), columns 8 (i % (BN / 8)) ..+ 8 (N is a multiple of 8: all in or all out)
#pragma unroll 4
  for (int i = tid; i < BT * BN / 8; i += NT) {
    const int r = i / (BN / 8);
    const int p = i % (BN / 8);
    const int row = m0 + r;
    const int col = n0 + 8 * p;
    if (row < M && col < N) {
      *reinterpret_cast<uint4*>(y + static_cast<size_t>(row) * N + col) =
          *reinterpret_cast<const uint4*>(smem + r * YPITCH + p * 16);
    }
  }
} else {
#pragma unroll
  for (int hf = 0; hf < 2; ++hf) {
    const int col = n0 + arow + 8 * hf;
    if (col >= N) continue;
#pragma unroll
    for (int j = 0; j < BT / 8; ++j) {
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        const int row = m0 + 8 * j + 2 * t + c;
        if (row >= M) continue;
        const float v = d[4 * j + 2 * hf + c] * mult;
        if constexpr (F16) {
          *reinterpret_cast<__half*>(y + static_cast<size_t>(row) * N + col) = __float2half_rn(v);
        } else {
          *reinterpret_cast<__nv_bfloat16*>(y + static_cast<size_t>(row) * N + col) = __float2bfloat16_rn(v);
        }
      }
    }
  }
}
