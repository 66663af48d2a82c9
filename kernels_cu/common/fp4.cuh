// NVFP4 codecs (SPEC §5): E2M1 elements (round to nearest, ties to even, saturating at 6) and E4M3
// block scales (through cuda_fp8.h, which rounds to nearest even and saturates). Bit-exact with
// sagecupy.reference.fp4. Hopper has no E2M1 conversion instruction (cvt ... e2m1x2 is sm_100+), so
// the element rounding is done with comparisons against the exact midpoints of the E2M1 grid.
#pragma once
#include <cuda_fp8.h>

#include "numeric.cuh"

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

// Quantize 16 values: the scale code, and the 16 E2M1 codes packed two per byte (element 2i in the low
// nibble) into two 32-bit words. A scale that decodes to 0 (zero or underflowed block) gives +0 codes.
__device__ __forceinline__ unsigned nvfp4_block(const float (&x)[16], unsigned (&packed)[2]) {
  float amax = 0.f;
  bool bad = false;
#pragma unroll
  for (int i = 0; i < 16; ++i) {
    bad |= (x[i] != x[i]);
    amax = fmaxf(amax, fabsf(x[i]));
  }
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

}  // namespace sage
