// Test kernel for int8/int8_quant.cu's psi_quot (tests/gpu/test_int8.py::test_psi_exact_matches_division): the quotient
// the exact code path divides with, against __fdiv_rn (div.rn), for every pair (x[i], s[i]) with psi_exact_ok(s).
#include "int8/int8_quant.cu"

// bad[0]: pairs whose codes differ (rint of the two quotients); bad[1]: pairs with |x / s| >= 1/4 whose quotients
// differ in any bit; bad[2]: pairs checked. first[0..1]: an index of each kind of mismatch (or -1).
extern "C" __global__ void psi_quot_vs_div(const float* __restrict__ x, const float* __restrict__ s, long long n,
                                          unsigned long long* __restrict__ bad, long long* __restrict__ first) {
  unsigned long long codes = 0, bits = 0, seen = 0;
  for (long long i = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<long long>(gridDim.x) * blockDim.x) {
    const float si = s[i], xi = x[i];
    if (!psi_exact_ok(si)) continue;
    ++seen;
    const float q = psi_quot(xi, si, psi_recip(si)), d = __fdiv_rn(xi, si);
    if (__float2int_rn(q) != __float2int_rn(d)) {
      ++codes;
      atomicCAS(reinterpret_cast<unsigned long long*>(first), static_cast<unsigned long long>(-1LL),
                static_cast<unsigned long long>(i));
    }
    if (fabsf(d) >= 0.25f && __float_as_uint(q) != __float_as_uint(d)) {
      ++bits;
      atomicCAS(reinterpret_cast<unsigned long long*>(first + 1), static_cast<unsigned long long>(-1LL),
                static_cast<unsigned long long>(i));
    }
  }
  atomicAdd(bad, codes);
  atomicAdd(bad + 1, bits);
  atomicAdd(bad + 2, seen);
}
