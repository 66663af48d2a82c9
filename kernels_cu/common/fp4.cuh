// NVFP4 codecs (docs/algorithms.md §5): E2M1 elements (round to nearest, ties to even, saturating at 6) and E4M3
// block scales (through cuda_fp8.h, which rounds to nearest even and saturates). Bit-exact with
// sagecupy.reference.fp4. Hopper has no E2M1 conversion instruction (cvt ... e2m1x2 is sm_100+), so
// the element rounding is done with comparisons against the exact midpoints of the E2M1 grid.
#pragma once
#include <cuda_fp8.h>

#include "common/numeric.cuh"

namespace sage {

// E2M1 code of x (already divided by its block scale): sign << 3 | index into {0,.5,1,1.5,2,3,4,6}.
// Midpoints 0.25 0.75 1.25 1.75 2.5 3.5 5 round to the even code; |x| > 6 saturates; NaN -> 7 (+6,
// as cvt.satfinite does; the block's NaN scale marks it), -0 and small negatives keep the sign bit.
__device__ __forceinline__ unsigned e2m1_code(float x) {
  if (x != x) return 7u;
  const float a = fabsf(x);
  unsigned m;
  if (a <= 0.25f) m = 0;
  else if (a < 0.75f) m = 1;
  else if (a <= 1.25f) m = 2;
  else if (a < 1.75f) m = 3;
  else if (a <= 2.5f) m = 4;
  else if (a < 3.5f) m = 5;
  else if (a <= 5.0f) m = 6;
  else m = 7;
  return (signbit(x) ? 8u : 0u) | m;
}

// E4M3 code of a block's scale max|x| / 6: nearest even, saturating at 448; a block holding NaN or
// +-Inf gets the NaN code 0x7F (never a finite scale), a zero block 0.
__device__ __forceinline__ unsigned e4m3_scale_code(float amax) {
  if (amax != amax || amax == INFINITY) return 0x7Fu;
  return static_cast<unsigned>(__nv_cvt_float_to_fp8(amax / 6.0f, __NV_SATFINITE, __NV_E4M3));
}

__device__ __forceinline__ float e4m3_decode(unsigned code) {
  const __half_raw h = __nv_cvt_fp8_to_halfraw(static_cast<__nv_fp8_storage_t>(code), __NV_E4M3);
  return __half2float(__half(h));
}

// max(a, b) that returns NaN when either is NaN (max.NaN.f32, sm_80+; fmaxf drops NaNs).
__device__ __forceinline__ float fmax_nan(float a, float b) {
  float d;
  asm("max.NaN.f32 %0, %1, %2;" : "=f"(d) : "f"(a), "f"(b));
  return d;
}

// max |x| over a 16-block, NaN if it holds a NaN (Inf if an Inf and no NaN).
__device__ __forceinline__ float block_absmax_nan(const float (&x)[16]) {
  float amax = 0.f;
#pragma unroll
  for (int i = 0; i < 16; ++i) amax = fmax_nan(amax, fabsf(x[i]));
  return amax;
}

// max |x| over a 16-block and whether it holds a NaN (fmaxf drops NaNs, so they are tracked apart).
__device__ __forceinline__ void block_amax(const float (&x)[16], float& amax, bool& bad) {
  amax = 0.f;
  bad = false;
#pragma unroll
  for (int i = 0; i < 16; ++i) {
    bad |= (x[i] != x[i]);
    amax = fmaxf(amax, fabsf(x[i]));
  }
}

// Quantize 16 values: the scale code, and the 16 E2M1 codes packed two per byte (element 2i in the low
// nibble) into two 32-bit words. A scale that decodes to 0 (zero or underflowed block) gives +0 codes.
__device__ __forceinline__ unsigned nvfp4_block(const float (&x)[16], unsigned (&packed)[2]) {
  float amax;
  bool bad;
  block_amax(x, amax, bad);
  const unsigned sc = e4m3_scale_code(bad ? __int_as_float(0x7fffffff) : amax);
  const float s = e4m3_decode(sc);
  packed[0] = packed[1] = 0u;
#pragma unroll
  for (int i = 0; i < 16; ++i) {
    const unsigned c = (s == 0.f) ? 0u : e2m1_code(__fdiv_rn(x[i], s));
    packed[i >> 3] |= c << (4 * (i & 7));
  }
  return sc;
}

// nvfp4_block for general fp32 values (K - mean), without its 16 IEEE divisions: the same scale, and each code from
// exact comparisons of |x| with the midpoints' thresholds m s (m s has at most 7 significant bits: exact in fp32),
// which is what the reference's float64 quotient decides (and nvfp4_block's fp32 one: an fp32 x beside m s is at
// least an ulp of x away, so its rounded quotient never lands on m). Ties: the grid's codes k - 1 and k meet at
// midpoint k, and the even one of the two wins (k even: |x| >= m_k s; k odd: |x| > m_k s). The block maximum with
// max.NaN (NaN or Inf: the NaN scale 0x7F, every code 7); a zero scale gives +0 codes (both selected at the end).
__device__ __forceinline__ unsigned nvfp4_block_cmp(const float (&x)[16], unsigned (&packed)[2]) {
  const float amax = block_absmax_nan(x);
  const bool bad = !(amax <= 3.402823466e38f);  // NaN or Inf in the block
  const unsigned sc = bad ? 0x7Fu : e4m3_scale_code(amax);
  const float s = e4m3_decode(sc);
  const float t1 = 0.25f * s, t2 = 0.75f * s, t3 = 1.25f * s, t4 = 1.75f * s, t5 = 2.5f * s, t6 = 3.5f * s,
              t7 = 5.0f * s;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    unsigned w = 0u;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const float xv = x[8 * h + i], a = fabsf(xv);
      // The thresholds a passes are a prefix t1 .. tm (increasing, each test monotone in a), so m by a binary search:
      // m >= 4, then m >= 6 or m >= 2, then the odd threshold between: three tests instead of seven, the same codes
      // (H200: the 4K call 1.468 -> 1.460 ms, causal 0.915 -> 0.898; docs/experiments.md).
      const bool b1 = a >= t4, b2 = a >= (b1 ? t6 : t2);
      const float t_odd = b1 ? (b2 ? t7 : t5) : (b2 ? t3 : t1);
      const unsigned m = (b1 ? 4u : 0u) + (b2 ? 2u : 0u) + (a > t_odd ? 1u : 0u);
      w |= (m | ((__float_as_uint(xv) >> 28) & 8u)) << (4 * i);
    }
    packed[h] = bad ? 0x77777777u : (s == 0.f ? 0u : w);
  }
  return sc;
}

}  // namespace sage

namespace sage {

// ---- In-register NVFP4 for the attention kernels (dequantization of packed operands, P quantization) ----

// Two E2M1 codes (the low byte of `b`: element 2i in the low nibble) -> two E4M3 bytes whose values are
// the E2M1 values times 2^-6: sign to bit 7, the 3 magnitude bits (e e m) to bits 4..2. E4M3 with
// exponent field e has value 2^(e-7)(1 + m/2) = 2^-6 * 2^(e-1)(1 + m/2), and its subnormal (e = 0)
// m * 2^-7 = 2^-6 * (m / 2): exactly E2M1 * 2^-6 in both cases.
__device__ __forceinline__ unsigned e2m1x4_to_e4m3_lo(unsigned w) {  // low nibbles of the 4 bytes of w
  return ((w & 0x07070707u) << 2) | ((w & 0x08080808u) << 4);
}
__device__ __forceinline__ unsigned e2m1x4_to_e4m3_hi(unsigned w) {  // high nibbles of the 4 bytes of w
  return ((w >> 2) & 0x1C1C1C1Cu) | (w & 0x80808080u);
}

__device__ __forceinline__ unsigned e4m3x2_to_half2_bits(unsigned short x) {
  const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(x), __NV_E4M3);
  return static_cast<unsigned>(h.x) | (static_cast<unsigned>(h.y) << 16);
}

// 16 packed E2M1 codes (w.x: elements 0..7, w.y: 8..15) and their E4M3 scale code -> 16 fp16 values
// s * x^ as 8 half2 (out[i] = elements 2i, 2i+1). Exact: E2M1 * 2^-6 is exact in E4M3 and fp16, s * 2^6
// (at most 448 * 64 = 28672) is exact in fp16, and their product has at most 6 significant bits in
// [2^-10, 2688]. A NaN scale (0x7F) gives 16 NaNs.
// The block scale s * 2^6 as a half2 (both halves), from its E4M3 code.
__device__ __forceinline__ __half2 e4m3_scale_x64(unsigned scale_code) {
  const unsigned sh = e4m3x2_to_half2_bits(static_cast<unsigned short>(scale_code | (scale_code << 8)));
  return __hmul2(*reinterpret_cast<const __half2*>(&sh), __float2half2_rn(64.f));
}

// 8 packed E2M1 codes (one word: elements 0..7) times s (s64 = e4m3_scale_x64) -> 4 half2 (out[i]: 2i, 2i+1).
__device__ __forceinline__ void dequant8_half(unsigned word, __half2 s64, unsigned (&out)[4]) {
  const unsigned lo = e2m1x4_to_e4m3_lo(word), hi = e2m1x4_to_e4m3_hi(word);
  const unsigned p01 = __byte_perm(lo, hi, 0x5140), p23 = __byte_perm(lo, hi, 0x7362);
  const unsigned parts[4] = {p01 & 0xFFFFu, p01 >> 16, p23 & 0xFFFFu, p23 >> 16};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const unsigned v = e4m3x2_to_half2_bits(static_cast<unsigned short>(parts[i]));
    const __half2 r = __hmul2(*reinterpret_cast<const __half2*>(&v), s64);
    out[i] = *reinterpret_cast<const unsigned*>(&r);
  }
}

__device__ __forceinline__ void dequant16_half(uint2 w, unsigned scale_code, unsigned (&out)[8]) {
  const __half2 s64 = e4m3_scale_x64(scale_code);
  dequant8_half(w.x, s64, reinterpret_cast<unsigned(&)[4]>(out[0]));
  dequant8_half(w.y, s64, reinterpret_cast<unsigned(&)[4]>(out[4]));
}

// Round a (>= 0, already divided by its block scale) to the E2M1 grid {0, .5, 1, 1.5, 2, 3, 4, 6}:
// nearest, ties to even, saturating at 6. The grid step is 0.5 below 2 and 2^(e-1) in the binade [2^e, 2^(e+1))
// from there on, so a + M - M with M = 2^(22 + max(e, 0)) rounds to it (M's fp32 ulp is that step; the adds
// round to nearest even); a >= 8 rounds to at least 8 and saturates. Five instructions (AND, add-max, two
// FADD, FMNMX). Identical to the previous form (two magic-number paths and a select) for every fp32 value in
// [0, 64) and for Inf/NaN (checked exhaustively in numpy; docs/experiments.md). NaN and Inf give 6 (a NaN exponent
// field makes M negative as an int, so the max picks 2^22; fminf drops the NaN): callers carry NaN another way
// (the attention row sums do).
// e2m1_round_nonneg without the saturation (a >= 7 rounds to 8 or more, Inf to Inf, NaN to NaN): for callers that
// saturate later, two at a time in fp16 (min 6 after the conversion is the same: 6 and every grid point are fp16
// values, and the conversion is monotone).
// LOG2S < 0: the same for a already multiplied by 2^LOG2S (the grid times 2^LOG2S): M * 2^LOG2S = 2^(22 + LOG2S +
// max(e, 0)); the additions round the same at every power-of-two scale as long as the values that round to a nonzero
// grid point stay clear of fp32's subnormals (2^-8 for LOG2S = -6).
template <int LOG2S = 0>
__device__ __forceinline__ float e2m1_round_nonneg_unsat(float a) {
  static_assert(LOG2S <= 0 && LOG2S > -100, "a power-of-two scale 2^LOG2S <= 1");
  const int e = static_cast<int>(__float_as_uint(a) & 0x7F800000u);
  const float m = __int_as_float(max(e + (22 << 23), (127 + 22 + LOG2S) << 23));  // 2^(22 + LOG2S)
  return __fsub_rn(__fadd_rn(a, m), m);
}
__device__ __forceinline__ float e2m1_round_nonneg(float a) { return fminf(e2m1_round_nonneg_unsat(a), 6.f); }

// E4M3 block scale of a block maximum (max / 6 rounded to E4M3, saturating), as a float, for in-kernel
// quantization of P: max / 6 as amax * fp32(1/6) (within an ulp of the quotient; P is an fp32
// approximation anyway), hardware conversions. NaN gives the NaN code.
__device__ __forceinline__ float e4m3_block_scale_fast(float amax) {
  const unsigned code = __nv_cvt_float_to_fp8(amax * (1.0f / 6.0f), __NV_SATFINITE, __NV_E4M3);
  return e4m3_decode(code);
}

// e4m3_block_scale_fast of two block maxima with one conversion each way (the same rounding per element): the
// scales as floats and as a half2 (.x: a0's; exact, every E4M3 value is an fp16 value).
__device__ __forceinline__ __half2 e4m3_block_scale_fast2(float a0, float a1, float (&sc)[2]) {
  const __nv_fp8x2_storage_t c =
      __nv_cvt_float2_to_fp8x2(make_float2(a0 * (1.0f / 6.0f), a1 * (1.0f / 6.0f)), __NV_SATFINITE, __NV_E4M3);
  const __half2 h = __half2(__nv_cvt_fp8x2_to_halfraw2(c, __NV_E4M3));  // low byte (a0) -> .x
  const float2 f = __half22float2(h);
  sc[0] = f.x;
  sc[1] = f.y;
  return h;
}

// Fake quantization of one 16-block (fp32 values of fp16/bf16 inputs) straight to its NVFP4 values as fp16
// (out[i]: elements 2i, 2i+1): bit for bit dequant16_half of nvfp4_block's codes and scale, without 16 IEEE
// divisions and the midpoint comparisons. The block scale s as nvfp4_block; per element, with r = 1/s correctly
// rounded, y = |x| r is within 2^-23 (relative) of |x| / s. An input of at most 11 significant bits divided by a
// 4-bit scale is either exactly an E2M1 midpoint (a tie) or at least 2^-11 away from every midpoint, so rounding y
// to 16 significant bits (+0x40, clear the low 7 bits) lands exactly on the midpoint in the first case and on
// the quotient's side of it in the second; e2m1_round_nonneg then rounds as the reference does, and q s is exact
// in fp16 (at most 6 significant bits in [2^-10, 2688]). Checked exhaustively against the reference for every
// fp16 value and every fp32-normal bf16 value with every nonzero E4M3 scale (docs/experiments.md). The
// sign is copied back (-0 and small negatives stay negative, as their codes keep the sign bit); a zero scale
// gives +0 (nvfp4_block's +0 codes), a NaN scale (NaN/Inf in the block) NaN.
struct FqScale {
  float s, r;  // the block scale and its correctly rounded reciprocal
  bool zero;   // s == 0: every value +0
};

// The scale of a 16-block from its max |x| and whether it holds a NaN (as nvfp4_block).
__device__ __forceinline__ FqScale nvfp4_fq_scale(float amax, bool bad) {
  const float s = e4m3_decode(e4m3_scale_code(bad ? __int_as_float(0x7fffffff) : amax));
  return {s, __frcp_rn(s), s == 0.f};
}

// |x| / s rounded to the E2M1 grid, from r = 1/s (correctly rounded) and exact fp16/bf16 inputs: |x| r rounded
// to 16 significant bits, then e2m1_round_nonneg (why this is exact: the comment above nvfp4_fq_scale).
__device__ __forceinline__ float e2m1_round_by_rcp(float x, float r) {
  return e2m1_round_nonneg(__uint_as_float((__float_as_uint(fabsf(x) * r) + 0x40u) & ~0x7Fu));
}

// 8 values of a block with scale f -> their NVFP4 values as 4 half2 words (out[i]: elements 2i, 2i+1).
__device__ __forceinline__ void nvfp4_fq8(const float* x, const FqScale& f, unsigned (&out)[4]) {
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    float q[2];
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const float xv = x[2 * i + e];
      q[e] = f.zero ? 0.f : copysignf(e2m1_round_by_rcp(xv, f.r) * f.s, xv);
    }
    const __half2 h = __floats2half2_rn(q[0], q[1]);
    out[i] = *reinterpret_cast<const unsigned*>(&h);
  }
}

__device__ __forceinline__ void nvfp4_fq16(const float (&x)[16], unsigned (&out)[8]) {
  float amax;
  bool bad;
  block_amax(x, amax, bad);
  const FqScale f = nvfp4_fq_scale(amax, bad);
  nvfp4_fq8(x, f, reinterpret_cast<unsigned(&)[4]>(out[0]));
  nvfp4_fq8(x + 8, f, reinterpret_cast<unsigned(&)[4]>(out[4]));
}

// Four E4M3 bytes (one per element, sign in bit 7, the E2M1 magnitude bits in bits 4..2: the E4M3 number
// E2M1 * 2^-6, as e2m1x4_to_e4m3_lo makes them) -> their four E2M1 codes as two bytes: element 0 | element 1 << 4
// in bits 0..7, element 2 | element 3 << 4 in bits 16..23 (take them with __byte_perm).
__device__ __forceinline__ unsigned e4m3x4_to_e2m1_pairs(unsigned w) {
  const unsigned c = ((w >> 2) & 0x07070707u) | ((w >> 4) & 0x08080808u);  // byte i: element i's code
  return c | (c >> 4);
}

// nvfp4_block for values that are exactly fp16 or bf16 numbers (no smoothing subtracted): the same scale and
// codes without divisions, comparisons or branches.
// - The block maximum with max.NaN (a NaN anywhere gives NaN, an Inf gives Inf: both the NaN scale code 0x7F).
// - The scale E4M3(amax / 6) from amax * fp32(1/6): the same code as the correctly rounded quotient for every fp16
//   and bf16 amax (an 11-bit amax over 6 is either an E4M3 rounding midpoint, which the product also hits exactly,
//   or at least 2^-12 (relative) away from one; checked exhaustively by bench/tools/fp4_fast_rounding_check.py).
// - Each element by nvfp4_fq8's rounding (multiplication by 1/s, 16-bit snap; see there why it is exact for such
//   inputs), with 2^-6 folded into 1/s and the magic number (e2m1_round_nonneg_unsat<-6>); the signed result is the
//   E4M3 number E2M1 * 2^-6, whose byte holds the code: four elements per two conversions. Checked exhaustively
//   against the reference encoder (same tool) for every fp16 and fp32-normal bf16 value, both signs, every nonzero
//   scale.
// - A zero scale gives +0 codes, a NaN scale 0x77777777 (as nvfp4_block's x / NaN), both selected at the end.
__device__ __forceinline__ unsigned nvfp4_block_exact16(const float (&x)[16], unsigned (&packed)[2]) {
  const float amax = block_absmax_nan(x);
  const bool bad = !(amax <= 3.402823466e38f);  // NaN or Inf in the block
  const unsigned sc =
      bad ? 0x7Fu : static_cast<unsigned>(__nv_cvt_float_to_fp8(amax * (1.0f / 6.0f), __NV_SATFINITE, __NV_E4M3));
  const float s = e4m3_decode(sc), r6 = __frcp_rn(s) * 0.015625f;  // 1/s * 2^-6 (exact scaling)
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    unsigned pairs[2];
#pragma unroll
    for (int g = 0; g < 2; ++g) {
      unsigned short p[2];
#pragma unroll
      for (int k = 0; k < 2; ++k) {
        float q[2];
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const float xv = x[8 * h + 4 * g + 2 * k + e];
          const float y = __uint_as_float((__float_as_uint(fabsf(xv) * r6) + 0x40u) & ~0x7Fu);  // 16-bit snap
          q[e] = copysignf(fminf(e2m1_round_nonneg_unsat<-6>(y), 0.09375f), xv);  // saturate at 6 * 2^-6
        }
        p[k] = __nv_cvt_float2_to_fp8x2(make_float2(q[0], q[1]), __NV_SATFINITE, __NV_E4M3);  // .x: low byte
      }
      pairs[g] = e4m3x4_to_e2m1_pairs(static_cast<unsigned>(p[0]) | (static_cast<unsigned>(p[1]) << 16));
    }
    const unsigned w = __byte_perm(pairs[0], pairs[1], 0x6420);
    packed[h] = bad ? 0x77777777u : (s == 0.f ? 0u : w);
  }
  return sc;
}

// Two fp16 values (a half2 word) that are exactly bf16 values (fake-quantized: at most 6 significant bits, in
// bf16's range) -> the same two values as bf16 bits.
__device__ __forceinline__ unsigned half2_to_bf16x2_exact(unsigned w) {
  const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&w));
  return (__float_as_uint(f.x) >> 16) | (__float_as_uint(f.y) & 0xFFFF0000u);
}

// Approximate reciprocal (MUFU.RCP, within an ulp), 0 for 0.
__device__ __forceinline__ float rcp_approx(float x) {
  float y;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return x > 0.f ? y : 0.f;
}

// Raw 16-bit inputs to fp32 (the quantizers' loads: nvfp4_quant.cu and the warp-specialized forward's Q).
template <typename T>
__device__ __forceinline__ T bits_to(unsigned short b);
template <>
__device__ __forceinline__ __half bits_to<__half>(unsigned short b) {
  return __ushort_as_half(b);
}
template <>
__device__ __forceinline__ __nv_bfloat16 bits_to<__nv_bfloat16>(unsigned short b) {
  return __ushort_as_bfloat16(b);
}

// Two 16-byte words of 8 T values each -> 16 floats (element 2i of a 32-bit word in its low half).
template <typename T>
__device__ __forceinline__ void unpack16(const uint4 (&w)[2], float (&v)[16]) {
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    const unsigned u[4] = {w[j].x, w[j].y, w[j].z, w[j].w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      v[8 * j + 2 * i] = to_float(bits_to<T>(static_cast<unsigned short>(u[i] & 0xFFFFu)));
      v[8 * j + 2 * i + 1] = to_float(bits_to<T>(static_cast<unsigned short>(u[i] >> 16)));
    }
  }
}

// 16 consecutive elements from src as floats: two 16-byte loads where src is 16-byte aligned (a warp's loads then
// cover whole lines once; with 2-byte loads each of the 16 instructions touched 32 sectors), else 16 scalar loads.
template <typename T>
__device__ __forceinline__ void load16(const T* src, float (&v)[16]) {
  if ((reinterpret_cast<unsigned long long>(src) & 15ull) == 0) {
    const uint4 w[2] = {__ldg(reinterpret_cast<const uint4*>(src)), __ldg(reinterpret_cast<const uint4*>(src) + 1)};
    unpack16<T>(w, v);
  } else {
#pragma unroll
    for (int i = 0; i < 16; ++i) v[i] = to_float(src[i]);
  }
}

// 16 consecutive fp32 values from src (16-byte aligned: four 16-byte loads).
__device__ __forceinline__ void load16f(const float* src, float (&v)[16]) {
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const float4 w = __ldg(reinterpret_cast<const float4*>(src) + j);
    v[4 * j] = w.x;
    v[4 * j + 1] = w.y;
    v[4 * j + 2] = w.z;
    v[4 * j + 3] = w.w;
  }
}

}  // namespace sage
