// Conversions and small numeric helpers shared by the kernels.
#pragma once
#include <cuda_fp16.h>
#include <cuda_bf16.h>

// NVRTC has no <math.h>: INFINITY comes from here.
#ifndef INFINITY
#define INFINITY __int_as_float(0x7f800000)
#endif

namespace sage {

// Programmatic dependent launch (sm_90; the host's SAGECUPY_PDL): a kernel launched with the programmatic stream
// serialization attribute may start while the kernel before it in the stream still runs. grid_dep_wait() returns once
// that kernel has completed and its memory writes are visible; a kernel launched without the attribute returns at once.
// A kernel calls it before its first access to global memory that another kernel of the call wrote or may read (so
// nothing that overlaps its predecessor touches global memory), and calls grid_dep_launch_dependents() only after
// it: the next kernel's CTAs may then be scheduled, and its own grid_dep_wait() still waits for this one to complete.
__device__ __forceinline__ void grid_dep_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void grid_dep_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

template <typename T> __device__ __forceinline__ float to_float(T x);
template <> __device__ __forceinline__ float to_float<__half>(__half x) { return __half2float(x); }
template <> __device__ __forceinline__ float to_float<__nv_bfloat16>(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

// Two floats -> packed pair of T (low half = a).
template <typename T> __device__ __forceinline__ unsigned pack2(float a, float b);
template <> __device__ __forceinline__ unsigned pack2<__half>(float a, float b) {
  __half2 h = __floats2half2_rn(a, b);
  return *reinterpret_cast<unsigned*>(&h);
}
template <> __device__ __forceinline__ unsigned pack2<__nv_bfloat16>(float a, float b) {
  __nv_bfloat162 h = __floats2bfloat162_rn(a, b);
  return *reinterpret_cast<unsigned*>(&h);
}

// int32 -> float, exact for |x| < 2^22 (the kernels' products stay below, see their static_asserts).
// sm_90: one I2FP instruction, measured 1.18x on the whole INT8 forward against the integer form below
// (docs/experiments.md, E-I8F-I2FP). Older GPUs convert on a quarter-rate unit, so there 0x4B400000 (1.5 * 2^23) is added
// to x's bit pattern, which puts x in the mantissa, and 1.5 * 2^23 is subtracted (two full-rate operations).
__device__ __forceinline__ float i2f_small(int x) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  return __int2float_rn(x);
#else
  return __int_as_float(x + 0x4B400000) - 12582912.0f;
#endif
}

// Eight int8 codes (the bytes of lo, then of hi, lowest first) as eight bf16 values in the same order: exact, since
// an integer of magnitude <= 128 has at most 8 significant bits.
__device__ __forceinline__ uint4 s8x8_to_bf16(unsigned lo, unsigned hi) {
  const unsigned w[2] = {lo, hi};
  unsigned out[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const unsigned x = w[i / 2] >> (16 * (i % 2));
    out[i] = pack2<__nv_bfloat16>(i2f_small(static_cast<signed char>(x & 0xffu)),
                                  i2f_small(static_cast<signed char>((x >> 8) & 0xffu)));
  }
  return make_uint4(out[0], out[1], out[2], out[3]);
}

// The bits of fma(a, b, 1.5 * 2^23): the FMA rounds a * b half-to-even at the integer position, and for
// |round-half-even(a * b)| < 2^22 the word's low byte is that integer's 8-bit two's-complement code (the
// constant's low byte is 0), so one FFMA quantizes and pack4_low_bytes gathers the codes without masking.
__device__ __forceinline__ unsigned rn_fma_bits(float a, float b) { return __float_as_uint(fmaf(a, b, 12582912.0f)); }

// Low bytes of x0..x3 -> one word (x0 in byte 0): three byte permutes.
__device__ __forceinline__ unsigned pack4_low_bytes(unsigned x0, unsigned x1, unsigned x2, unsigned x3) {
  return __byte_perm(__byte_perm(x0, x1, 0x0040), __byte_perm(x2, x3, 0x0040), 0x5410);
}

// 2^x on the special-function unit (flush-to-zero; exp2(-inf) = 0).
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// 1/x on the special-function unit (rcp.approx.ftz: within an ulp of 1/x; 1/+-0 and denormal x -> +-inf,
// |x| > 2^126 (a denormal result) and 1/+-inf -> +-0).
__device__ __forceinline__ float fast_rcp(float x) {
  float y;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// log2(x) on the special-function unit (lg2.approx.ftz: absolute error within 2^-22 near 1, relative elsewhere).
__device__ __forceinline__ float fast_log2(float x) {
  float y;
  asm("lg2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// max that propagates NaN (fmaxf drops it): a NaN input must reach the outputs, never a finite value.
// One instruction on sm_80+ (max.NaN returns the canonical NaN), three without it.
__device__ __forceinline__ float nan_max(float a, float b) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  float d;
  asm("max.NaN.f32 %0, %1, %2;" : "=f"(d) : "f"(a), "f"(b));
  return d;
#else
  return (a != a) ? a : ((b != b) ? b : fmaxf(a, b));
#endif
}

__device__ __forceinline__ float warp_max_xor(float v, int lanemask_from, int lanemask_to) {
  for (int m = lanemask_from; m <= lanemask_to; m <<= 1) v = nan_max(v, __shfl_xor_sync(0xffffffffu, v, m));
  return v;
}
__device__ __forceinline__ float quad_max(float v) {
  v = nan_max(v, __shfl_xor_sync(0xffffffffu, v, 1));
  return nan_max(v, __shfl_xor_sync(0xffffffffu, v, 2));
}
// Folds t[0 .. N) into t[0] as a tree (short dependency chain): level w = N / 2, N / 4, .., 1 folds t[i + w] into
// t[i] for i < w, with op(t[i], t[i + w]). N a power of two. The loops have constant trip counts: written as
// `for (w = N / 2; w >= 1; w >>= 1)`, nvcc kept the N = 16 tree a loop over a local-memory array (the INT8 forward
// with 128-key tiles: LDL/STL on every tile, docs/experiments.md E-I8F-BKV128).
template <int N, typename Op>
__device__ __forceinline__ void tree_fold(float (&t)[N], Op op) {
  static_assert(N >= 1 && (N & (N - 1)) == 0, "a power of two");
#pragma unroll
  for (int lv = 1; (N >> lv) >= 1; ++lv)
#pragma unroll
    for (int i = 0; i < N / 2; ++i)
      if (i < (N >> lv)) t[i] = op(t[i], t[i + (N >> lv)]);
}
struct FMaxOp {
  __device__ __forceinline__ float operator()(float a, float b) const { return fmaxf(a, b); }
};
struct FAddOp {
  __device__ __forceinline__ float operator()(float a, float b) const { return a + b; }
};

// Maximum of one row half of a thread's 16 x 8NT accumulator tile (R = 0: elements 0, 1 of each 8-column
// group; R = 1: elements 2, 3) as a tree (short dependency chain); fmaxf: a NaN is dropped unless all are NaN.
template <int NT, int R>
__device__ __forceinline__ float acc_row_max(const float (&s)[NT][4]) {
  float t[NT];
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) t[nt] = fmaxf(s[nt][2 * R], s[nt][2 * R + 1]);
  tree_fold(t, FMaxOp());
  return t[0];
}
__device__ __forceinline__ float quad_sum(float v) {
  v += __shfl_xor_sync(0xffffffffu, v, 1);
  return v + __shfl_xor_sync(0xffffffffu, v, 2);
}

// Position of key j inside its 32-key group in the "mma-permuted" order: the order in which an
// m16n8 accumulator tile pair, re-packed as the A operand of m16n8k32, presents its columns.
// Thread t of a quad holds columns {2t, 2t+1, 8+2t, 9+2t} of a 16-column half and packs them as
// k = 4t..4t+3, so operands that meet a re-packed accumulator along k are stored in this order.
__host__ __device__ __forceinline__ int mma_perm32(int j) {
  int half16 = (j >> 4) & 1, jj = j & 15;
  int t = (jj & 7) >> 1, q = ((jj >> 3) << 1) | (jj & 1);
  return (half16 << 4) | (t << 2) | q;
}

// Place the 8-bit codes of accumulator n-tiles 2 np and 2 np + 1 of a 16 x 64 tile into the m16n8k32 A
// fragments a[k-step][0..3] of that tile, columns in the mma-permuted order. ev / od: the even / odd
// n-tile's four values as rn_fma_bits words (codes in the low bytes; [0], [1]: row g, columns 2t, 2t+1;
// [2], [3]: row g+8). n-tiles 4k+0/1 go to a0 (row g) / a1 (row g+8), 4k+2/3 to a2 / a3, the even n-tile
// in the low two bytes.
template <int KST>
__device__ __forceinline__ void pack_acc_pair_as_a(unsigned (&a)[KST][4], int np, const unsigned (&ev)[4],
                                                   const unsigned (&od)[4]) {
  const int kst = np >> 1, half = np & 1;
  a[kst][2 * half] = pack4_low_bytes(ev[0], ev[1], od[0], od[1]);
  a[kst][2 * half + 1] = pack4_low_bytes(ev[2], ev[3], od[2], od[3]);
}

// Inverse of mma_perm32: the key stored at position p of a 32-key group.
__host__ __device__ __forceinline__ int mma_perm32_inv(int p) {
  int half16 = (p >> 4) & 1, t = (p & 15) >> 2, q = p & 3;
  return (half16 << 4) | ((q >> 1) << 3) | (t << 1) | (q & 1);
}

}  // namespace sage
