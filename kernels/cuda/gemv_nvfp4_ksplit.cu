// Body of the NVFP4 decode GEMV: y[M, N] = x[M, K] @ dequant(w)[N, K]^T, M <= 8.
// (A kernel body for mx.fast.cuda_kernel: MLX writes the signature; nvfp4_mma.cuh is the header.)
//
// Inputs:  x [M, K] T, w [N, K/8] uint32 (E2M1 codes, MLX layout), scales [N, K/16] uint8 (E4M3),
//          gsv [1] float (global_scale / 2688, or 1 without one).
// Output:  y [M, N] T.
// Template constants: N, K, M, WARPS, UNROLL, SPLIT (bool), CVT_SCALES (bool), T.
// Launch:  grid (N / 16 * 32 * WARPS) threads, threadgroup 32 * WARPS: one block per 16 rows; its
//          warps split K in 128-wide steps (step s goes to warp s % WARPS) and add up in shared memory.
//
// Lane (g = lane / 4, t = lane % 4) owns rows g and g+8 of the tile and codes [32 t, 32 t + 32) of
// each step; the MMA's activation column g is x row g (zero where g >= M). Each warp issues the
// 16-byte code loads of UNROLL steps before decoding the first, so several are in flight per lane.
constexpr int KW = K / 8;
constexpr int KS = K / 16;
constexpr int STEPS = (K + 127) / 128;
const int lane = threadIdx.x & 31;
const int warp = threadIdx.x >> 5;
const int g = lane >> 2;
const int t = lane & 3;
const int row = blockIdx.x * 16 + g;
const uint32_t* wa = w + static_cast<size_t>(row) * KW;
const uint32_t* wb = wa + 8 * KW;
const uint8_t* sa = scales + static_cast<size_t>(row) * KS;
const uint8_t* sb = sa + 8 * KS;
const bool has_x = g < M;
const T* xr = x + static_cast<size_t>(has_x ? g : 0) * K;

float acc[4] = {0.f, 0.f, 0.f, 0.f};
for (int s0 = warp; s0 < STEPS; s0 += WARPS * UNROLL) {
  uint4 qa[UNROLL], qb[UNROLL];
  uint32_t ra[UNROLL], rb[UNROLL];
#pragma unroll
  for (int u = 0; u < UNROLL; ++u) {
    const int k0 = (s0 + u * WARPS) * 128 + t * 32;
    nvfp4::load_step(wa, wb, sa, sb, k0, s0 + u * WARPS < STEPS && k0 < K, qa[u], qb[u], ra[u], rb[u]);
  }
#pragma unroll
  for (int u = 0; u < UNROLL; ++u) {
    if (s0 + u * WARPS >= STEPS) break;  // warp-uniform: MMAs need the whole warp
    const int k0 = (s0 + u * WARPS) * 128 + t * 32;
    const bool kvalid = k0 < K;  // only in a partial last step (K % 128 != 0)
    uint32_t sa_lo, sa_hi, sb_lo, sb_hi;
    if constexpr (CVT_SCALES) {  // hardware E4M3 conversion (sm_89+)
      nvfp4::e4m3x2_scale_splats(ra[u], sa_lo, sa_hi);
      nvfp4::e4m3x2_scale_splats(rb[u], sb_lo, sb_hi);
    } else {
      nvfp4::e4m3_scale_splats(ra[u], sa_lo, sa_hi);
      nvfp4::e4m3_scale_splats(rb[u], sb_lo, sb_hi);
    }
    const uint32_t qaw[4] = {qa[u].x, qa[u].y, qa[u].z, qa[u].w};
    const uint32_t qbw[4] = {qb[u].x, qb[u].y, qb[u].z, qb[u].w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      uint32_t a[8];
      nvfp4::decode_word(qaw[i], qbw[i], i < 2 ? sa_lo : sa_hi, i < 2 ? sb_lo : sb_hi, a);
      uint32_t xh[4] = {0u, 0u, 0u, 0u};
      uint32_t xl[4] = {0u, 0u, 0u, 0u};
      if (has_x && kvalid) {
        nvfp4::load_x8<T, SPLIT>(xr + k0 + 8 * i, xh, xl);
      }
      nvfp4::mma_word(acc, a, xh);
      if constexpr (SPLIT) {
        nvfp4::mma_word(acc, a, xl);
      }
    }
  }
}

if constexpr (WARPS > 1) {
  __shared__ float red[WARPS][4][32];
#pragma unroll
  for (int c = 0; c < 4; ++c) red[warp][c][lane] = acc[c];
  __syncthreads();
  if (warp != 0) return;
#pragma unroll
  for (int c = 0; c < 4; ++c) {
    float s = 0.f;
#pragma unroll
    for (int v = 0; v < WARPS; ++v) s += red[v][c][lane];
    acc[c] = s;
  }
}
// C fragment: c0, c1 = (row g, columns 2t, 2t+1), c2, c3 = (row g+8, the same columns)
const float mult = NVFP4_EPILOGUE_SCALE * gsv[0];
const int m0 = 2 * t;
if (m0 < M) {
  y[static_cast<size_t>(m0) * N + row] = T(acc[0] * mult);
  y[static_cast<size_t>(m0) * N + row + 8] = T(acc[2] * mult);
}
if (m0 + 1 < M) {
  y[static_cast<size_t>(m0 + 1) * N + row] = T(acc[1] * mult);
  y[static_cast<size_t>(m0 + 1) * N + row + 8] = T(acc[3] * mult);
}
