// Body of the NVFP4 decode GEMV: y[M, N] = x[M, K] @ dequant(w)[N, K]^T, M <= 8, sm_89+.
// (A kernel body for mx.fast.cuda_kernel: MLX writes the signature; nvfp4_mma.cuh is the header.)
//
// Inputs:  x [M, K] T, w [N, K/8] uint32 (E2M1 codes, MLX layout), scales [N, K/16] uint8 (E4M3),
//          gsv [1] float (global_scale / 2688, or 1 without one).
// Output:  y [M, N] T.
// Template constants: N (a multiple of 8), K (a multiple of 128), M, WARPS, BLOCKS, CHUNK (2 or
//          4), STAGES, XF16 (bool: T is float16), T (bfloat16 or float16).
// Launch:  grid BLOCKS * 32 * WARPS threads, threadgroup 32 * WARPS, dynamic shared memory
//          gemv_nvfp4.smem_bytes(M, K, WARPS, CHUNK, STAGES).
//
// Arithmetic: the weights are decoded exactly to f16 (nvfp4_mma.cuh: E2M1 * 2^-6 through the
// hardware E4M3 -> f16 conversion, times the E4M3 group scale, also converted exactly: every
// product of an E2M1 and an E4M3 value is an f16), and the MMAs are f16 x f16 -> f32. Activations
// enter as f16: float16 as they are, bfloat16 scaled by 2^e, one power of two for the whole x,
// chosen from max |x| so that the largest lands below 2^15; the epilogue multiplies by 2^(6 - e).
// A bfloat16 value is an f16 after that scaling unless it is more than 2^39 below max |x|, where
// it is rounded to f16's subnormal step: an error below 2^-39 of max |x| per term.
//
// Persistent and balanced: BLOCKS (one per multiprocessor) split the N rows in units of 8, so no
// block has more than 8 rows of work above another and there is no second wave. A block's rows
// form 16-row tiles (the last may be 8 rows: its upper half is masked); each tile is CPT chunks of
// CHUNK steps of 128 codes, and the block's WARPS warps split the block's chunks evenly,
// tile-major. A warp that owns a whole tile writes it; tiles split between warps are added up in
// shared memory, in warp order (deterministic), by the last of its warps to finish.
//
// Memory: x is staged once per block into shared memory, already in the MMA's activation order,
// padded and swizzled against bank conflicts. The weights stream through a per-warp ring of
// STAGES chunks filled by cp.async: a chunk is 16 rows x CHUNK steps, 64 * CHUNK contiguous code
// bytes per row (each copy instruction moves whole 128- or 256-byte runs of rows: long runs per
// DRAM page) and 8 * CHUNK scale bytes per row; code rows are XOR-swizzled in 16-byte units and
// scale rows padded, so the fragment reads hit distinct banks.
//
// Per 128-wide step, lane (g = lane / 4, t = lane % 4) decodes codes [32 t, 32 t + 32) of the
// tile's rows g and g+8; the MMA's activation column g is x row g. Lanes with g >= M read x row
// M-1 instead: their column is computed and never stored.
constexpr int KS = K / 16;
constexpr int STEPS = K / 128;
constexpr int CPT = (STEPS + CHUNK - 1) / CHUNK;    // chunks per tile
constexpr int XCH = K / 8;                          // 16-byte pieces of an x row
constexpr int XRS = ((XCH + 7) / 8 * 8 + 2) * 16;   // x row stride, bytes: 2 pieces mod 8 of padding
constexpr int ROWB = CHUNK * 64;                    // a row's code bytes in a chunk
constexpr int SROW = CHUNK == 4 ? 48 : 16;          // a row's scale bytes in a chunk, padded
constexpr int SLOT = 16 * ROWB + 16 * SROW;         // codes, then scales
constexpr int LPR = CHUNK * 4;                      // copy lanes per row (16 bytes each)
constexpr int RPI = 32 / LPR;                       // rows per copy instruction
constexpr int NTHREADS = WARPS * 32;
constexpr bool SCALE_X = !XF16;  // bfloat16 activations are scaled into f16's range
static_assert(CHUNK == 2 || CHUNK == 4, "CHUNK must be 2 or 4");
static_assert(K % 128 == 0, "K must be a multiple of 128");
static_assert(N % 8 == 0, "N must be a multiple of 8");
static_assert(sizeof(T) == 2, "x must be bfloat16 or float16");
// (the launch keeps units >= WARPS: every warp has at least one chunk)
extern __shared__ __align__(16) uint8_t smem[];
uint8_t* const xs = smem;
uint8_t* const rings = smem + M * XRS;
float* const part = reinterpret_cast<float*>(rings + WARPS * STAGES * SLOT);
__shared__ float xmax_warp[WARPS];
constexpr int MAXT = ((N / 8 + BLOCKS - 1) / BLOCKS + 1) / 2 + 1;  // tiles a block can have
__shared__ int arrived[MAXT];  // warps done with each split tile

const int lane = threadIdx.x & 31;
const int warp = static_cast<int>(threadIdx.x >> 5);
const int g = lane >> 2;
const int t = lane & 3;
// this block's rows [r0, r1): units of 8 rows split as evenly as integers allow
const int r0 = 8 * static_cast<int>(static_cast<long long>(blockIdx.x) * (N / 8) / BLOCKS);
const int r1 = 8 * static_cast<int>(static_cast<long long>(blockIdx.x + 1) * (N / 8) / BLOCKS);
const int units = (r1 - r0 + 15) / 16 * CPT;
const int u_begin = warp * units / WARPS;
const int u_end = (warp + 1) * units / WARPS;

// ---- copy side: chunk u (tile u / CPT, steps CHUNK (u % CPT) ..) into ring slot (u - u_begin) % STAGES
const int crow = lane / LPR;                 // instruction i moves rows RPI i + crow ...
const int cq = lane % LPR;                   // ... 16-byte unit cq of the row's chunk
const int cstep = cq >> 2;                   // which holds step cstep of the chunk
const int cdst = crow * ROWB + ((cq ^ ((crow & 1) << 2)) * 16);  // swizzled (RPI is even)
const int srow = lane >> 1;                  // scales: row srow, bytes [4 CHUNK shalf, +4 CHUNK)
const int shalf = lane & 1;
uint8_t* const my_ring = rings + warp * STAGES * SLOT;
const uint8_t* const wlane = reinterpret_cast<const uint8_t*>(w) + static_cast<size_t>(r0 + crow) * (K / 2) + cq * 16;
const uint8_t* const slane = scales + static_cast<size_t>(r0 + srow) * KS + (CHUNK / 2) * shalf * 8;
auto issue = [&](int u) {
  uint8_t* slot = my_ring + ((u - u_begin) % STAGES) * SLOT;
  const bool live = u < u_end;  // past the end: an empty group (zero-fills, reads nothing)
  const int tile = u / CPT;
  const int s0 = (u - tile * CPT) * CHUNK;
  const bool full = r0 + 16 * tile + 16 <= r1;  // else the upper 8 rows are past the block's end
  const bool step_on = live && s0 + cstep < STEPS;
  const uint8_t* src = wlane + static_cast<size_t>(tile) * 16 * (K / 2) + s0 * 64;
#pragma unroll
  for (int i = 0; i < 16 / RPI; ++i) {
    nvfp4::cp_async_16(slot + RPI * i * ROWB + cdst, src + static_cast<size_t>(RPI * i) * (K / 2),
                       step_on && (RPI * i < 8 || full));
  }
  const int s_first = s0 + (CHUNK / 2) * shalf;  // this lane's scale bytes: steps s_first ..
  const bool s_on = live && (srow < 8 || full) && s_first < STEPS;
  const uint8_t* ssrc = slane + static_cast<size_t>(tile) * 16 * KS + s0 * 8;
  uint8_t* sdst = slot + 16 * ROWB + srow * SROW + shalf * 4 * CHUNK;
  if constexpr (CHUNK == 4 && KS % 16 == 0) {  // 16-byte aligned rows of scales (K % 256 == 0)
    nvfp4::cp_async_16n(sdst, ssrc, s_on ? (s_first + 1 < STEPS ? 16 : 8) : 0);
  } else if constexpr (CHUNK == 4) {  // 8-byte aligned only (K % 128 == 0): two copies
    nvfp4::cp_async_8(sdst, ssrc, s_on);
    nvfp4::cp_async_8(sdst + 8, ssrc + 8, s_on && s_first + 1 < STEPS);
  } else {
    nvfp4::cp_async_8(sdst, ssrc, s_on);
  }
  nvfp4::cp_async_commit();
};
for (int i = threadIdx.x; i < MAXT; i += NTHREADS) arrived[i] = 0;  // ordered by the barrier below
// ---- x into shared memory as f16, in activation-fragment order. Its loads go out before the
// weight prologue's copies, so they do not queue behind them.
constexpr int XPT = (M * XCH + NTHREADS - 1) / NTHREADS;  // 16-byte pieces of x per thread
uint4 xv[XPT];
#pragma unroll
for (int q = 0; q < XPT; ++q) {
  const int i = threadIdx.x + q * NTHREADS;
  xv[q] = i < M * XCH ? *reinterpret_cast<const uint4*>(x + static_cast<size_t>(i) * 8) : make_uint4(0u, 0u, 0u, 0u);
}
// STAGES - 1 chunks in flight while x is staged; each iteration issues the next before waiting.
// (Filling every slot here and refilling a slot right after reading it was slower on the H200:
// 23.96 against 23.39 us at M=1, 27.53 against 26.09 at M=8, same run; BENCHMARKS.md.)
#pragma unroll
for (int i = 0; i < STAGES - 1; ++i) issue(u_begin + i);
int xexp = 0;  // x is held as x * 2^xexp (xexp in [-113, 127]: 2^xexp is a normal float)
if constexpr (SCALE_X) {
  float mx = 0.f;
#pragma unroll
  for (int q = 0; q < XPT; ++q) {
    const uint32_t wv[4] = {xv[q].x, xv[q].y, xv[q].z, xv[q].w};
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      mx = fmaxf(mx, fabsf(__uint_as_float(wv[e] << 16)));
      mx = fmaxf(mx, fabsf(__uint_as_float(wv[e] & 0xFFFF0000u)));
    }
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xFFFFFFFFu, mx, o));
  if (lane == 0) xmax_warp[warp] = mx;
  __syncthreads();
  mx = 0.f;
#pragma unroll
  for (int v = 0; v < WARPS; ++v) mx = fmaxf(mx, xmax_warp[v]);
  if (mx > 0.f && mx <= 3.0e38f) {  // an infinite or NaN x stays unscaled: the result is not finite
    int ex;
    frexpf(mx, &ex);  // mx < 2^ex
    // at most 127: for max |x| < 2^-112 the largest lands below 2^15 all the same, and every
    // bfloat16 (>= 2^-133) at or above 2^-6, an f16 normal: still exact
    xexp = 15 - ex < 127 ? 15 - ex : 127;
  }
}
const float xscale = __int_as_float((xexp + 127) << 23);  // 2^xexp: one exact multiply a value
#pragma unroll
for (int q = 0; q < XPT; ++q) {
  const int i = threadIdx.x + q * NTHREADS;
  if (i >= M * XCH) break;
  const int m = i / XCH;
  const int c = i - m * XCH;
  uint32_t h[4];  // (x0, x1) (x2, x3) (x4, x5) (x6, x7) as f16x2
  const uint32_t wv[4] = {xv[q].x, xv[q].y, xv[q].z, xv[q].w};
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    if constexpr (SCALE_X) {
      const float lo = __uint_as_float(wv[e] << 16) * xscale;  // ldexpf took 4 multiplies: 0.4-0.7 us
      const float hi = __uint_as_float(wv[e] & 0xFFFF0000u) * xscale;  // slower at M = 4 and 8 (H200)
      const __half2 p = __floats2half2_rn(lo, hi);
      h[e] = *reinterpret_cast<const uint32_t*>(&p);
    } else {
      h[e] = wv[e];
    }
  }
  uint4 o;  // fragment order: (x0, x2) (x4, x6) (x1, x3) (x5, x7)
  o.x = __byte_perm(h[0], h[1], 0x5410);
  o.y = __byte_perm(h[2], h[3], 0x5410);
  o.z = __byte_perm(h[0], h[1], 0x7632);
  o.w = __byte_perm(h[2], h[3], 0x7632);
  *reinterpret_cast<uint4*>(xs + m * XRS + (c ^ ((c >> 3) & 1)) * 16) = o;
}
__syncthreads();
// this lane's x pieces of a step: c = 16 step + 4 t + i, swizzled c ^ ((c >> 3) & 1) = 16 step + 4 t + (i ^ (t >> 1))
const uint8_t* const xrow = xs + (g < M ? g : M - 1) * XRS + t * 64;
const int xi0 = (0 ^ (t >> 1)) * 16, xi1 = (1 ^ (t >> 1)) * 16, xi2 = (2 ^ (t >> 1)) * 16, xi3 = (3 ^ (t >> 1)) * 16;
// this lane's code bytes of step j of a chunk: row g's unit 4 j + t, swizzled to 4 (j ^ (g & 1)) + t
const int gpar = g & 1;
const int coff_a = g * ROWB + t * 16;
const int coff_b = (g + 8) * ROWB + t * 16;
const int soff_a = 16 * ROWB + g * SROW + t * 2;
const int soff_b = 16 * ROWB + (g + 8) * SROW + t * 2;

// ---- compute side
const float gmul = gsv[0];
const int yexp = 6 - xexp;
auto store = [&](int tile, const float (&c)[4]) {
  // C fragment: c0, c1 = (row g, columns 2t, 2t+1), c2, c3 = (row g+8, the same columns)
  const int row = r0 + 16 * tile + g;
  const int m0 = 2 * t;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = row + 8 * h;
    if (r >= r1) continue;
    if (m0 < M) y[static_cast<size_t>(m0) * N + r] = T(ldexpf(c[2 * h] * gmul, yexp));
    if (m0 + 1 < M) y[static_cast<size_t>(m0 + 1) * N + r] = T(ldexpf(c[2 * h + 1] * gmul, yexp));
  }
};
const int head_tile = u_begin / CPT;
// the warp holding chunk c: the last v with v * units / WARPS <= c (units >= WARPS: none is empty)
auto owner = [&](int c) { return ((c + 1) * WARPS - 1) / units; };
// A tile split between warps: each writes its part to its slot (0: its first tile, 1: its last)
// and counts itself in; the last to arrive adds the parts up in warp order (the result does not
// depend on which warp that is) and stores the tile. No block-wide barrier: warps leave when done.
auto finish_split = [&](int tile, const float (&c)[4]) {
  float* p = part + (warp * 2 + (tile == head_tile ? 0 : 1)) * 128;
#pragma unroll
  for (int q = 0; q < 4; ++q) p[q * 32 + lane] = c[q];
  __threadfence_block();
  __syncwarp();
  const int v0 = owner(tile * CPT), v1 = owner((tile + 1) * CPT - 1);
  int last = 0;
  if (lane == 0) last = atomicAdd(&arrived[tile], 1) == v1 - v0;
  last = __shfl_sync(0xFFFFFFFFu, last, 0);
  if (!last) return;
  __threadfence_block();
  float sum[4] = {0.f, 0.f, 0.f, 0.f};
  for (int v = v0; v <= v1; ++v) {
    const float* pv = part + (v * 2 + (v * units / WARPS >= tile * CPT ? 0 : 1)) * 128;
#pragma unroll
    for (int q = 0; q < 4; ++q) sum[q] += pv[q * 32 + lane];
  }
  store(tile, sum);
};
auto flush = [&](int tile, float (&acc)[2][4]) {
  float c[4];
#pragma unroll
  for (int q = 0; q < 4; ++q) c[q] = acc[0][q] + acc[1][q];
  if (tile * CPT >= u_begin && (tile + 1) * CPT <= u_end) {
    store(tile, c);
  } else {
    finish_split(tile, c);
  }
};

float acc[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
int cur = head_tile;
for (int u = u_begin; u < u_end; ++u) {
  issue(u + STAGES - 1);
  nvfp4::cp_async_wait<STAGES - 1>();  // chunk u has landed (this lane's copies) ...
  __syncwarp();                        // ... and every other lane's
  const int tile = u / CPT;
  if (tile != cur) {
    flush(cur, acc);
#pragma unroll
    for (int q = 0; q < 4; ++q) acc[0][q] = acc[1][q] = 0.f;
    cur = tile;
  }
  const uint8_t* slot = my_ring + ((u - u_begin) % STAGES) * SLOT;
  const int s0 = (u - tile * CPT) * CHUNK;
#pragma unroll
  for (int j = 0; j < CHUNK; ++j) {
    if (STEPS % CHUNK != 0 && s0 + j >= STEPS) break;  // warp-uniform
    const uint8_t* xstep = xrow + (s0 + j) * 256;
    const uint4 xp0 = *reinterpret_cast<const uint4*>(xstep + xi0);
    const uint4 xp1 = *reinterpret_cast<const uint4*>(xstep + xi1);
    const uint4 xp2 = *reinterpret_cast<const uint4*>(xstep + xi2);
    const uint4 xp3 = *reinterpret_cast<const uint4*>(xstep + xi3);
    const int jo = (j ^ gpar) * 64;
    const uint4 ca = *reinterpret_cast<const uint4*>(slot + coff_a + jo);
    const uint4 cb = *reinterpret_cast<const uint4*>(slot + coff_b + jo);
    // the two groups of this lane's 32 codes (words 0-1, 2-3): E4M3 -> f16x2, exactly
    const uint32_t sa = nvfp4::e4m3x2_to_f16x2(*reinterpret_cast<const uint16_t*>(slot + soff_a + j * 8));
    const uint32_t sb = nvfp4::e4m3x2_to_f16x2(*reinterpret_cast<const uint16_t*>(slot + soff_b + j * 8));
    nvfp4::mma_word_f16<0>(acc[0], ca.x, cb.x, sa, sb, xp0);  // two accumulators: half the
    nvfp4::mma_word_f16<0>(acc[1], ca.y, cb.y, sa, sb, xp1);  // MMA dependency chain
    nvfp4::mma_word_f16<1>(acc[0], ca.z, cb.z, sa, sb, xp2);
    nvfp4::mma_word_f16<1>(acc[1], ca.w, cb.w, sa, sb, xp3);
  }
  __syncwarp();  // every lane has read the slot before any lane refills it
}
nvfp4::cp_async_wait<0>();
if (u_end > u_begin) flush(cur, acc);
