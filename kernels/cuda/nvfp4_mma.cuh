// NVFP4 tensor-core building blocks for the custom GEMV and MoE kernels.
//
// Passed as the `header` of `mx.fast.cuda_kernel` (MLX prepends its own utils.cuh, which brings
// cuda_bf16.h, cuda_fp16.h and the fixed-width integer types). Two exact decodes:
//
// * the bf16 route (sm_80+: the MoE kernel and gemv_nvfp4_ksplit.cu), integer bit tricks below;
// * the f16 route (sm_89+: gemv_nvfp4.cu), through the hardware E4M3 -> f16x2 conversion, at the
//   end of this file: fewer integer instructions per weight, which is what bounds a decode GEMV.
//
// bf16 decode (Marlin-style, exact): an E2M1 code placed with its sign on bf16 bit 15 and its three
// magnitude bits on bits 8..6 is the bf16 whose value is E2M1 * 2^-126 (code 1, 0.5, lands on a
// bf16 subnormal; bf16 FMA keeps subnormals). One bf16x2 FMA by the group scale times 2^64 turns
// it into E2M1 * E4M3 * 2^-62, exact (at most 6 significant bits, far inside bf16's range). The
// tensor cores accumulate in fp32 and the epilogue multiplies by 2^62 (and the global scale).
//
// The k-order inside a thread's 32 codes is permuted so that each 32-bit word of codes becomes
// four bf16x2 registers with no shuffles: register j of word i pairs codes (8i+j, 8i+j+4), and the
// activation fragment is permuted the same way with two byte-permutes. A sum does not care.


namespace nvfp4 {

// 2^62: undoes the 2^-126 of the raw decode and the 2^64 folded into the group scale.
#define NVFP4_EPILOGUE_SCALE 4611686018427387904.0f

// Codes at nibble 3 of each 16-bit half of `t` (bits 12..15 and 28..31) -> bf16x2 of E2M1*2^-126.
__device__ __forceinline__ uint32_t e2m1_pair_raw(uint32_t t) {
  return (t & 0x80008000u) | ((t >> 6) & 0x01C001C0u);
}

// E4M3 bits -> bf16 of E4M3 * 2^64 (exact), in both halves of the result.
__device__ __forceinline__ uint32_t e4m3_scale_splat(uint32_t b) {
  const uint32_t mag = b & 0x7Fu;
  const uint32_t e = mag >> 3;
  // normal: bf16 exponent field = e - 7 + 127 + 64 = e + 184, mantissa = the 3 E4M3 bits
  const uint32_t normal = (mag << 4) + (184u << 7);
  // subnormal: m * 2^-9 * 2^64 = m * 2^55; m has at most 3 significant bits, so the cut is exact
  const uint32_t sub = __float_as_uint(static_cast<float>(mag & 7u) * 36028797018963968.0f) >> 16;
  uint32_t bits = (e != 0u ? normal : sub) | ((b & 0x80u) << 8);
  return bits | (bits << 16);
}

__device__ __forceinline__ uint32_t bf16x2_mul(uint32_t a, uint32_t b) {
  uint32_t d;
  // -0.0 addend: x * s + (-0) == x * s for every x, signed zeros included
  asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(0x80008000u));
  return d;
}

__device__ __forceinline__ void mma_bf16(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2,
                                         uint32_t a3, uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
      "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// Weights are streamed once: keep them out of L1 so the activations stay there.
__device__ __forceinline__ uint4 ld_stream_v4(const uint32_t* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

__device__ __forceinline__ uint32_t ld_stream_u16(const uint8_t* p) {
  unsigned short v;
  asm volatile("ld.global.nc.L1::no_allocate.u16 %0, [%1];\n" : "=h"(v) : "l"(p));
  return static_cast<uint32_t>(v);
}

// Asynchronous global -> shared copies (sm_80+): 16 bytes bypass L1 (.cg); 8 go through it (.ca,
// the only form for fewer than 16 bytes). Where `pred` is false the destination is zero-filled and
// nothing is read.
__device__ __forceinline__ void cp_async_16(void* smem, const void* gmem, bool pred) {
  const uint32_t dst = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n"
               :: "r"(dst), "l"(gmem), "r"(pred ? 16 : 0) : "memory");
}

// 16-byte slot from `src_bytes` (0, 4, 8 or 16) bytes of global memory; the rest zero-filled.
__device__ __forceinline__ void cp_async_16n(void* smem, const void* gmem, int src_bytes) {
  const uint32_t dst = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n"
               :: "r"(dst), "l"(gmem), "r"(src_bytes) : "memory");
}

__device__ __forceinline__ void cp_async_8(void* smem, const void* gmem, bool pred) {
  const uint32_t dst = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;\n"
               :: "r"(dst), "l"(gmem), "r"(pred ? 8 : 0) : "memory");
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }

// Wait until at most `PENDING` of this thread's committed groups are still in flight.
template <int PENDING>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" :: "n"(PENDING) : "memory");
}

// One step's loads of a lane (the K-split GEMV and the MoE kernel): the 16 bytes of codes and the
// 2 bytes of scales of rows g (wa, sa) and g+8 (wb, sb) from code k0 on; zeros where `live` is
// false (a step past the last, or codes past K in a partial last step).
__device__ __forceinline__ void load_step(const uint32_t* wa, const uint32_t* wb, const uint8_t* sa,
                                          const uint8_t* sb, int k0, bool live, uint4& qa, uint4& qb,
                                          uint32_t& ra, uint32_t& rb) {
  if (live) {
    qa = ld_stream_v4(wa + k0 / 8);
    qb = ld_stream_v4(wb + k0 / 8);
    ra = ld_stream_u16(sa + k0 / 16);
    rb = ld_stream_u16(sb + k0 / 16);
  } else {
    qa = make_uint4(0u, 0u, 0u, 0u);
    qb = make_uint4(0u, 0u, 0u, 0u);
    ra = 0u;
    rb = 0u;
  }
}

__device__ __forceinline__ uint32_t pack_bf16x2(float lo, float hi) {
  uint32_t d;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo));
  return d;
}

// Two E4M3 scales (bits 0-7, 8-15) -> their bf16x2 splats, one e4m3_scale_splat each (any GPU).
__device__ __forceinline__ void e4m3_scale_splats(uint32_t r, uint32_t& lo, uint32_t& hi) {
  lo = e4m3_scale_splat(r & 0xFFu);
  hi = e4m3_scale_splat(r >> 8);
}

// Two E4M3 scales (bits 0-7: the first group's, bits 8-15: the second's) -> their bf16x2 splats
// times 2^64, exactly: one hardware conversion (sm_89+) to f16x2, then f32 and bf16 (4 significant
// bits survive every step). Fewer integer instructions than two e4m3_scale_splat calls.
__device__ __forceinline__ void e4m3x2_scale_splats(uint32_t r, uint32_t& lo, uint32_t& hi) {
  uint32_t h2;
  const unsigned short pair = static_cast<unsigned short>(r & 0xFFFFu);
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h2) : "h"(pair));
  const unsigned short h_lo = static_cast<unsigned short>(h2 & 0xFFFFu);
  const unsigned short h_hi = static_cast<unsigned short>(h2 >> 16);
  float f_lo, f_hi;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f_lo) : "h"(h_lo));
  asm("cvt.f32.f16 %0, %1;" : "=f"(f_hi) : "h"(h_hi));
  f_lo *= 18446744073709551616.0f;  // 2^64
  f_hi *= 18446744073709551616.0f;
  lo = pack_bf16x2(f_lo, f_lo);
  hi = pack_bf16x2(f_hi, f_hi);
}

__device__ __forceinline__ float bf16_lo(uint32_t v) { return __uint_as_float(v << 16); }
__device__ __forceinline__ float bf16_hi(uint32_t v) { return __uint_as_float(v & 0xFFFF0000u); }

// Eight activations x[0..7] as four bf16x2 words (hi), and, where SPLIT, the bf16 remainders
// (lo) so that hi + lo carries float32/float16 inputs to about 2^-16 relative.
template <typename T, bool SPLIT>
__device__ __forceinline__ void load_x8(const T* p, uint32_t (&hi)[4], uint32_t (&lo)[4]) {
  if constexpr (sizeof(T) == 2 && !SPLIT) {
    // bfloat16: the words are the activations themselves
    const uint4 v = *reinterpret_cast<const uint4*>(p);
    hi[0] = v.x; hi[1] = v.y; hi[2] = v.z; hi[3] = v.w;
  } else {
    float f[8];
    if constexpr (sizeof(T) == 4) {
      const float4 a = *reinterpret_cast<const float4*>(p);
      const float4 b = *reinterpret_cast<const float4*>(p + 4);
      f[0] = a.x; f[1] = a.y; f[2] = a.z; f[3] = a.w;
      f[4] = b.x; f[5] = b.y; f[6] = b.z; f[7] = b.w;
    } else {
#pragma unroll
      for (int i = 0; i < 8; ++i) f[i] = static_cast<float>(p[i]);
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      hi[i] = pack_bf16x2(f[2 * i], f[2 * i + 1]);
      if constexpr (SPLIT) {
        lo[i] = pack_bf16x2(f[2 * i] - bf16_lo(hi[i]), f[2 * i + 1] - bf16_hi(hi[i]));
      }
    }
  }
}

// One 32-bit word of codes (8 codes of one 16-group) of rows g (`wa`) and g+8 (`wb`) -> the eight
// bf16x2 A-fragment registers of two m16n8k16 MMAs. `sa`, `sb`: the rows' scale splats.
// Pair j holds codes (j, j+4): shifting the word left by 12 - 4j puts them on nibble 3 of each half.
__device__ __forceinline__ void decode_word(uint32_t wa, uint32_t wb, uint32_t sa, uint32_t sb,
                                            uint32_t (&a)[8]) {
  a[0] = bf16x2_mul(e2m1_pair_raw(wa << 12), sa);  // row g,   pair 0
  a[1] = bf16x2_mul(e2m1_pair_raw(wb << 12), sb);  // row g+8, pair 0
  a[2] = bf16x2_mul(e2m1_pair_raw(wa << 8), sa);   // row g,   pair 1
  a[3] = bf16x2_mul(e2m1_pair_raw(wb << 8), sb);
  a[4] = bf16x2_mul(e2m1_pair_raw(wa << 4), sa);   // row g,   pair 2
  a[5] = bf16x2_mul(e2m1_pair_raw(wb << 4), sb);
  a[6] = bf16x2_mul(e2m1_pair_raw(wa), sa);        // row g,   pair 3
  a[7] = bf16x2_mul(e2m1_pair_raw(wb), sb);
}

// The two MMAs of one decoded word against eight activations of this lane's column (load_x8's
// words), permuted like the codes: (x0,x4) (x1,x5) | (x2,x6) (x3,x7).
__device__ __forceinline__ void mma_word(float (&c)[4], const uint32_t (&a)[8],
                                         const uint32_t (&xw)[4]) {
  mma_bf16(c, a[0], a[1], a[2], a[3], __byte_perm(xw[0], xw[2], 0x5410),
           __byte_perm(xw[0], xw[2], 0x7632));
  mma_bf16(c, a[4], a[5], a[6], a[7], __byte_perm(xw[1], xw[3], 0x5410),
           __byte_perm(xw[1], xw[3], 0x7632));
}

// ---- the f16 route (sm_89+): E2M1 codes and E4M3 scales through the hardware FP8 conversion

// Two E4M3 bytes (bits 0-7, 8-15) -> f16x2, exactly (every E4M3 value is an f16).
__device__ __forceinline__ uint32_t e4m3x2_to_f16x2(uint32_t r) {
  uint32_t h;
  const unsigned short pair = static_cast<unsigned short>(r & 0xFFFFu);
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h) : "h"(pair));
  return h;
}

// One 32-bit word of E2M1 codes (code i at bits 4i..4i+3) -> four f16x2 registers holding codes
// (0, 2), (4, 6), (1, 3), (5, 7) as E2M1 * 2^-6, exactly. Each nibble s.e1.e0.m becomes the E4M3
// byte s.00.e1.e0.m.00, whose value is E2M1 * 2^-6 (E4M3 subnormals included: code 1, 0.5, is
// the E4M3 subnormal 4 * 2^-9), and the hardware converts two such bytes to f16x2 at once.
__device__ __forceinline__ void e2m1_word_to_f16(uint32_t w, uint32_t (&h)[4]) {
  // high nibbles: the sign is already bit 7 of its byte; magnitude bits 6..4 -> 4..2 (the shift as
  // a multiply-high, which runs on the FMA pipe and leaves the integer pipe to the masks)
  const uint32_t hi = (w & 0x80808080u) | __umulhi(w & 0x70707070u, 0x40000000u);
  // low nibbles: magnitude bits 2..0 -> 4..2, sign bit 3 -> 7
  const uint32_t lo = ((w << 2) & 0x1C1C1C1Cu) | ((w << 4) & 0x80808080u);
  // each 16-bit half as its own .b16 operand, so no shift moves the upper half down
  asm("{\n .reg .b16 l, u;\n mov.b32 {l, u}, %4;\n cvt.rn.f16x2.e4m3x2 %0, l;\n cvt.rn.f16x2.e4m3x2 %1, u;\n"
      " mov.b32 {l, u}, %5;\n cvt.rn.f16x2.e4m3x2 %2, l;\n cvt.rn.f16x2.e4m3x2 %3, u;\n}\n"
      : "=r"(h[0]), "=r"(h[1]), "=r"(h[2]), "=r"(h[3])  // codes (0, 2) (4, 6) (1, 3) (5, 7)
      : "r"(lo), "r"(hi));
}

__device__ __forceinline__ void mma_f16(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                        uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
      "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// a * (s.half, s.half) for HALF 0 (low) or 1 (high): the broadcast is an operand selector of the
// f16x2 multiply (HMUL2 R, R, R.H0_H0), not an instruction of its own.
template <int HALF>
__device__ __forceinline__ uint32_t f16x2_mul_bcast(uint32_t a, uint32_t s) {
  const __half2 av = *reinterpret_cast<const __half2*>(&a);
  const __half2 sv = *reinterpret_cast<const __half2*>(&s);
  const __half2 r = __hmul2(av, HALF == 0 ? __low2half2(sv) : __high2half2(sv));
  return *reinterpret_cast<const uint32_t*>(&r);
}

// One code word of rows g (wa) and g+8 (wb), scaled by their group's f16 scale (half HALF of sa,
// sb), times x in fragment order xp = ((x0,x2), (x4,x6), (x1,x3), (x5,x7)): two f16 MMAs.
template <int HALF>
__device__ __forceinline__ void mma_word_f16(float (&c)[4], uint32_t wa, uint32_t wb, uint32_t sa, uint32_t sb,
                                             const uint4& xp) {
  uint32_t ha[4], hb[4];
  e2m1_word_to_f16(wa, ha);
  e2m1_word_to_f16(wb, hb);
  mma_f16(c, f16x2_mul_bcast<HALF>(ha[0], sa), f16x2_mul_bcast<HALF>(hb[0], sb), f16x2_mul_bcast<HALF>(ha[1], sa),
          f16x2_mul_bcast<HALF>(hb[1], sb), xp.x, xp.y);
  mma_f16(c, f16x2_mul_bcast<HALF>(ha[2], sa), f16x2_mul_bcast<HALF>(hb[2], sb), f16x2_mul_bcast<HALF>(ha[3], sa),
          f16x2_mul_bcast<HALF>(hb[3], sb), xp.z, xp.w);
}

}  // namespace nvfp4
