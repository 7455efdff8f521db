// Body of the NVFP4 sorted-gather MoE kernel, expert-batched:
//   y[r, :] = x[lhs[r], :] @ dequant(w[rhs[r]])^T * gsv[rhs[r]]   for rhs[r] < E, else 0.
// (A kernel body for mx.fast.cuda_kernel: MLX writes the signature; nvfp4_mma.cuh is the header.)
//
// Inputs:  x [TOK, K] T, lhs [R] uint32 (x row of each routed row), rhs [R] uint32 (its expert,
//          sorted ascending), w [E, N, K/8] uint32, scales [E, N, K/16] uint8,
//          gsv [E] float (global_scale / 2688 per expert, or ones).
// Output:  y [R, N] T.
// Template constants: N, K, E, R, WARPS, UNROLL, NT, SPLIT (bool), T.
// Launch:  grid (ceil(N / (16 * WARPS)) * 32 * WARPS, E + 1, 1) threads, threadgroup 32 * WARPS.
//          Block (bx, e) finds expert e's run [lo, hi) of sorted rows by binary search; each warp
//          owns 16 weight rows and walks all of K once per 8 * NT rows of the run, so each routed
//          expert's weights are read once per run (runs longer than 8 * NT rows re-read them, from
//          L2 mostly). The decoded fragment of a code word feeds NT MMAs (one per 8 rows).
//          Blocks with e == E zero the rows routed past the last expert.
constexpr int KW = K / 8;
constexpr int KS = K / 16;
constexpr int STEPS = (K + 127) / 128;
constexpr int CHUNK = 8 * NT;
const int lane = threadIdx.x & 31;
const int warp = threadIdx.x >> 5;
const int g = lane >> 2;
const int t = lane & 3;
const int e = blockIdx.y;
const int tile = blockIdx.x * WARPS + warp;
if (tile * 16 >= N) return;  // no block-wide barrier below, so idle warps may leave
const int row = tile * 16 + g;

int lo = 0;
{
  int hi_ = R;
  while (lo < hi_) {
    const int mid = (lo + hi_) >> 1;
    if (rhs[mid] < static_cast<uint32_t>(e)) lo = mid + 1; else hi_ = mid;
  }
}
int hi = R;
if (e < E) {
  int lo_ = lo;
  while (lo_ < hi) {
    const int mid = (lo_ + hi) >> 1;
    if (rhs[mid] < static_cast<uint32_t>(e + 1)) lo_ = mid + 1; else hi = mid;
  }
} else {
  // rows routed past the last expert: zero this warp's 16 columns of them
  for (int i = lo * 16 + lane; i < R * 16; i += 32) {
    y[static_cast<size_t>(i / 16) * N + tile * 16 + (i % 16)] = T(0.f);
  }
  return;
}
if (lo >= hi) return;

const uint32_t* wa = w + (static_cast<size_t>(e) * N + row) * KW;
const uint32_t* wb = wa + 8 * KW;
const uint8_t* sa = scales + (static_cast<size_t>(e) * N + row) * KS;
const uint8_t* sb = sa + 8 * KS;
const float mult = NVFP4_EPILOGUE_SCALE * gsv[e];

for (int r0 = lo; r0 < hi; r0 += CHUNK) {
  const int ntiles = min(NT, (hi - r0 + 7) / 8);  // warp-uniform
  float acc[NT][4];
  const T* xr[NT];
  bool xv[NT];
#pragma unroll
  for (int n = 0; n < NT; ++n) {
    const int r = r0 + n * 8 + g;
    xv[n] = r < hi;
    xr[n] = x + static_cast<size_t>(xv[n] ? lhs[r] : 0u) * K;
#pragma unroll
    for (int c = 0; c < 4; ++c) acc[n][c] = 0.f;
  }
  for (int s0 = 0; s0 < STEPS; s0 += UNROLL) {
    uint4 qa[UNROLL], qb[UNROLL];
    uint32_t ra[UNROLL], rb[UNROLL];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const int k0 = (s0 + u) * 128 + t * 32;
      nvfp4::load_step(wa, wb, sa, sb, k0, s0 + u < STEPS && k0 < K, qa[u], qb[u], ra[u], rb[u]);
    }
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      if (s0 + u >= STEPS) break;  // warp-uniform
      const int k0 = (s0 + u) * 128 + t * 32;
      const bool kvalid = k0 < K;
      uint32_t sa_lo, sa_hi, sb_lo, sb_hi;
      nvfp4::e4m3_scale_splats(ra[u], sa_lo, sa_hi);
      nvfp4::e4m3_scale_splats(rb[u], sb_lo, sb_hi);
      const uint32_t qaw[4] = {qa[u].x, qa[u].y, qa[u].z, qa[u].w};
      const uint32_t qbw[4] = {qb[u].x, qb[u].y, qb[u].z, qb[u].w};
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        uint32_t a[8];
        nvfp4::decode_word(qaw[i], qbw[i], i < 2 ? sa_lo : sa_hi, i < 2 ? sb_lo : sb_hi, a);
#pragma unroll
        for (int n = 0; n < NT; ++n) {
          if (n < ntiles) {
            uint32_t xh[4] = {0u, 0u, 0u, 0u};
            uint32_t xl[4] = {0u, 0u, 0u, 0u};
            if (xv[n] && kvalid) {
              nvfp4::load_x8<T, SPLIT>(xr[n] + k0 + 8 * i, xh, xl);
            }
            nvfp4::mma_word(acc[n], a, xh);
            if constexpr (SPLIT) {
              nvfp4::mma_word(acc[n], a, xl);
            }
          }
        }
      }
    }
  }
  // C fragment: c0, c1 = (weight row g, routed rows 2t, 2t+1 of the tile), c2, c3 = row g+8
#pragma unroll
  for (int n = 0; n < NT; ++n) {
    const int r = r0 + n * 8 + 2 * t;
    if (r < hi) {
      y[static_cast<size_t>(r) * N + row] = T(acc[n][0] * mult);
      y[static_cast<size_t>(r) * N + row + 8] = T(acc[n][2] * mult);
    }
    if (r + 1 < hi) {
      y[static_cast<size_t>(r + 1) * N + row] = T(acc[n][1] * mult);
      y[static_cast<size_t>(r + 1) * N + row + 8] = T(acc[n][3] * mult);
    }
  }
}
