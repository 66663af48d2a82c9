// INT8 pre-processing for SageBwd (docs/algorithms.md §2-4): K-smoothing mean, per-token / per-block row
// quantization of Q and K, transposed (mma-permuted) quantization of V and dO (with delta = rowsum(dO*O)),
// and int8 transposes of the saved Q/K codes for the backward.
//
// psi over a block: s = max|x| / 127, code = clamp(rint(x / s), -127, 127); a zero block has s = 0
// and codes 0; a block holding NaN or +-Inf gets s = NaN and codes 0 (never a silent finite value).
// All outputs are padded: rows (tokens) up to a multiple of the attention tile, padding rows have
// code 0 and scale 0.
#include "common/numeric.cuh"
#include "int8/bwd_img.cuh"

namespace sage {

__device__ __forceinline__ float absmax_or_nan(float m, float x) {
  // NaN-propagating running max of |x|: max.NaN gives the canonical NaN when either operand is NaN (fmaxf would
  // drop it). One instruction (the |x| is an operand modifier).
  float r;
  asm("max.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(m), "f"(fabsf(x)));
  return r;
}

__device__ __forceinline__ float psi_scale(float amax, float qmax) {
  if (amax != amax || amax == INFINITY) return __int_as_float(0x7fffffff);
  return amax / qmax;
}

// A scale that codes can be computed with (0 < s < inf); otherwise (zero block, NaN or Inf in it) every code is 0.
__device__ __forceinline__ bool psi_valid(float s) { return s > 0.0f && s != INFINITY; }

// psi's code of x as the low byte of the returned word (two's complement; the other bytes are not zero):
// rint(x / s) with the correctly rounded quotient, as the reference computes it (fp32 mode), for a psi_valid s and
// |x| <= 127 s (x in the block s was taken over).
// inv_s = psi_rcp(s), computed once per block: x * inv_s is within 3e-5 of fl32(x / s) for |x / s| <= 128
// (the reciprocal's 2^-23, the product's 2^-24 and fl32's own 2^-24, relative), so its rint is the reference's unless it lies
// within that of a tie (k + 0.5): only then (rare) is the quotient divided out exactly (ncu: the row quantization
// 119 -> 115 us against a division per element at B=4, H=16, N=4K, D=128).
// rint by the addend M = 1.5 * 2^23: fl(q + M) rounds to nearest even, and for |q| < 2^22 its low mantissa bits
// hold rint(q) in two's complement, so neither a conversion nor a clamp is needed (|rint(q)| <= 127 here).
// (CuPy compiles with -ftz=true: a subnormal s is flushed to 0 by psi_scale already, so 1/s cannot overflow.)
__device__ __forceinline__ unsigned psi_code_word(float x, float s, float inv_s) {
  constexpr float M = 12582912.0f;
  const float q = x * inv_s;
  float t = q + M;
  if (!(fabsf(q - (t - M)) <= 0.499f)) t = __fdiv_rn(x, s) + M;  // near a tie
  return __float_as_uint(t);
}

// The reciprocal psi_code_word and psi_code_words take: one MUFU.RCP (rcp.approx.ftz, at most 1 ulp, 2^-23 relative,
// for the normal s that psi_valid lets through; 1/s is normal too, as s <= FLT_MAX / 127) instead of __frcp_rn's
// correctly rounded ~10 instructions. Their arguments need x * inv_s within 1e-4 (psi_code_words) or 1e-3
// (psi_code_word) of fl32(x / s) for |x / s| <= 127 (1 + 2^-24): the approximation adds at most 127 * 2^-23 = 1.5e-5
// to the roundings counted there (~3e-5 in all), so every code is the same (an emulation with inv_s the correctly
// rounded 1/s and 1 ulp off it, 615 M values near ties, uniform and at +-127 s, found no code that differs).
__device__ __forceinline__ float psi_rcp(float s) {
  float r;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(s));
  return r;
}

// psi's codes of N values sharing the scale s (psi_valid) as low bytes of cw[]: psi_code_word's result, with one
// branch per N values instead of one per value (the per-value tie branch was 3 of the row quantization's ~29
// instructions per element, docs/experiments.md). t = fma(x, 1/s, M) rounds the exact product
// x * inv_s to an integer k; the exact quotient and fl32(x / s) both lie within ~3e-5 of that product (inv_s's 2^-23
// relative, psi_rcp, and the quotient's own rounding, 2^-24, at |x / s| <= 127), so where
// |x * inv_s - k| <= 0.4999 (the FMA's residual, off by at most 2^-25), rint(fl32(x / s)) is k as well. Otherwise
// (a value within 1e-4 of a tie: ~2e-4 of random values) the N values take psi_code_word's path, which re-divides
// exactly near a tie.
template <int N>
__device__ __forceinline__ void psi_code_words(const float (&x)[N], float s, float inv_s, unsigned (&cw)[N]) {
  constexpr float M = 12582912.0f;
  float dev = 0.f;
#pragma unroll
  for (int i = 0; i < N; ++i) {
    const float t = __fmaf_rn(x[i], inv_s, M);
    dev = fmaxf(dev, fabsf(__fmaf_rn(x[i], inv_s, M - t)));
    cw[i] = __float_as_uint(t);
  }
  if (!(dev <= 0.4999f)) {
#pragma unroll
    for (int i = 0; i < N; ++i) cw[i] = psi_code_word(x[i], s, inv_s);
  }
}

// The exact alternative to psi_code_words: each code from the correctly rounded quotient itself, four instructions
// per value and no branch. psi_quot is the arithmetic of CUDA's div.rn (MUFU.RCP; e = fma(-s, r, 1);
// y = fma(e, r, r); q0 = fma(y, x, 0); rho = fma(q0, -s, x); q = fma(y, rho, q0), in non-ftz FMAs as ptxas
// expands it) with the reciprocal's refinement (psi_recip) done once per scale, and without the range check that
// sends div.rn to its slow path; in psi_exact_ok's range that check does not apply: s is normal and far from both
// ends of the exponent range, and a value whose code can be nonzero has |x| >= s / 2, so q0 s, rho and the quotient
// stay normal (tests/gpu/test_int8.py::test_psi_exact_matches_division compares it with __fdiv_rn near ties and
// over the whole range). psi_code_words' tie test flags about a third of Q's warp steps on bf16 data (a value at
// max / 2 lands within 1e-5 of 63.5), and each flagged step re-checks all of its lanes' values: ~20% of the Q rows'
// instructions (ncu, docs/experiments.md). Q's per-token rows (quant_rows_qk, quant_qkv) and the transposed blocks
// (V, dO) take the exact path: the forward pre-pass 153.5 -> 139.7 us at D = 128, 4K (with the unpacking and division
// changes below; 148.9 without the exact path, 142.8 with Q's alone). K's rows and quant_rows (the per-block configs'
// pass) keep the tie test: K - mu is not on the bf16 grid, trips it far less often, and exact K rows measured no
// better.
__device__ __forceinline__ bool psi_exact_ok(float s) { return s >= 0x1p-79f && s <= 0x1p+99f; }

__device__ __forceinline__ float psi_recip(float s) {
  const float r = psi_rcp(s);
  float e, y;
  asm("fma.rn.f32 %0, %1, %2, 0f3F800000;" : "=f"(e) : "f"(-s), "f"(r));
  asm("fma.rn.f32 %0, %1, %2, %2;" : "=f"(y) : "f"(e), "f"(r));
  return y;
}

// fl32(x / s) for psi_exact_ok(s) and |x| <= 128 s, y = psi_recip(s).
__device__ __forceinline__ float psi_quot(float x, float s, float y) {
  float q0, rho, q;
  asm("fma.rn.f32 %0, %1, %2, 0f00000000;" : "=f"(q0) : "f"(y), "f"(x));
  asm("fma.rn.f32 %0, %1, %2, %3;" : "=f"(rho) : "f"(q0), "f"(-s), "f"(x));
  asm("fma.rn.f32 %0, %1, %2, %3;" : "=f"(q) : "f"(y), "f"(rho), "f"(q0));
  return q;
}

// psi_code_words' result (the codes as low bytes) from psi_quot: rint by the addend M, as psi_code_word does.
// Outside psi_exact_ok's range (rows or channels at the ends of the exponent range) each value is divided by
// __fdiv_rn, the reference's quotient itself.
template <int N>
__device__ __forceinline__ void psi_code_words_exact(const float (&x)[N], float s, unsigned (&cw)[N]) {
  constexpr float M = 12582912.0f;
  if (psi_exact_ok(s)) {
    const float y = psi_recip(s);
#pragma unroll
    for (int i = 0; i < N; ++i) cw[i] = __float_as_uint(__fadd_rn(psi_quot(x[i], s, y), M));
  } else {
#pragma unroll
    for (int i = 0; i < N; ++i) cw[i] = __float_as_uint(__fadd_rn(__fdiv_rn(x[i], s), M));
  }
}

// unpack8: eight packed 16-bit values as floats. bf16 by shifts and masks (the same bits as __bfloat162float, which
// nvcc compiles to a byte permute and a shift for each odd element).
template <typename T>
__device__ __forceinline__ void unpack8(const uint4& u, float (&f)[8]) {
  const T* e = reinterpret_cast<const T*>(&u);
#pragma unroll
  for (int i = 0; i < 8; ++i) f[i] = to_float(e[i]);
}
template <>
__device__ __forceinline__ void unpack8<__nv_bfloat16>(const uint4& u, float (&f)[8]) {
  const unsigned w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    f[2 * i] = __uint_as_float(w[i] << 16);
    f[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
  }
}

// Eight consecutive elements (16-byte aligned) as floats, through one 16-byte load.
template <typename T>
__device__ __forceinline__ void load8(const T* p, float (&f)[8]) {
  unpack8<T>(*reinterpret_cast<const uint4*>(p), f);
}


}  // namespace sage

using namespace sage;

// Column statistics over tokens in two deterministic passes (no atomics on sums, so the mean and the
// codes that depend on it are bitwise repeatable). Pass 1: CTA (chunk, h, b) reduces CHUNK tokens into
// part[b, h, chunk, d] (sum, or NaN-propagating absmax when ABSMAX). Pass 2 reduces the chunks in order.
// grid (ceil(n / CHUNK), H, B), block 256; rows 16-byte aligned.
constexpr int STAT_CHUNK = 256;
// Loads in flight per thread of column_partial_body (one was 70% of DRAM bandwidth at two CTAs per SM; 8 measured
// the same as 4).
constexpr int kStatUnroll = 4;
// Minimum CTAs per SM of column_partial_kv: 4 (61 registers) measured the forward pre-pass 158.3 -> 153.5 us at
// D = 128, 4K against 2 (84 registers; 3: 155.1), docs/experiments.md: the pass is latency-bound.
constexpr int kStatMinCtas = 4;

// Sums accumulate in double (the mean is then rounded once to fp32, as the reference does), maxima in float.
template <bool ABSMAX> struct StatAcc { using type = double; };
template <> struct StatAcc<true> { using type = float; };

// Shared memory column_partial_body reduces in: a kernel that computes both statistics (column_partial_kv) passes
// one buffer of the larger accumulator's size to either (16 KB at D = 128 instead of 24).
template <int D, typename Acc = double>
struct StatRed {
  __align__(16) Acc v[256 / (D / 8)][D];
};

// Each thread owns 8 consecutive channels (one 16-byte load per token); the block's 256 threads cover
// 256 / (D / 8) tokens at a time; the partial of a channel is summed over those token lanes in order.
template <typename T, int D, bool ABSMAX, typename RED>
__device__ __forceinline__ void column_partial_body(const T* __restrict__ x, long long sb, long long sh, long long sn,
                                                    int n, typename StatAcc<ABSMAX>::type* __restrict__ part,
                                                    int chunk, int h, int b, int H, int nchunk, RED& smem) {
  using Acc = typename StatAcc<ABSMAX>::type;
  constexpr int LPR = D / 8, R = 256 / LPR;  // threads per token, tokens in parallel
  static_assert(sizeof(smem.v) >= sizeof(Acc[R][D]), "the reduction's buffer");
  Acc(&red)[R][D] = *reinterpret_cast<Acc(*)[R][D]>(&smem.v);
  const int cl = threadIdx.x % LPR, row0 = threadIdx.x / LPR;
  const int t0 = chunk * STAT_CHUNK, t1 = min(n, t0 + STAT_CHUNK);
  Acc acc[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) acc[i] = 0;
  const T* base = x + b * sb + h * sh + cl * 8;
  // Unrolled: kStatUnroll loads in flight per thread.
#pragma unroll kStatUnroll
  for (int t = t0 + row0; t < t1; t += R) {
    float f[8];
    load8(base + t * sn, f);
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      if (ABSMAX) acc[i] = absmax_or_nan(static_cast<float>(acc[i]), f[i]);
      else acc[i] += static_cast<Acc>(f[i]);
    }
  }
#pragma unroll
  for (int i = 0; i < 8; ++i) red[row0][cl * 8 + i] = acc[i];
  __syncthreads();
  if (threadIdx.x < D) {
    Acc a = 0;
    for (int r = 0; r < R; ++r) {
      if (ABSMAX) a = nan_max(static_cast<float>(a), static_cast<float>(red[r][threadIdx.x]));
      else a += red[r][threadIdx.x];
    }
    part[((static_cast<long long>(b) * H + h) * nchunk + chunk) * D + threadIdx.x] = a;
  }
}

template <typename T, int D, bool ABSMAX>
__global__ void __launch_bounds__(256, 1) column_partial(const T* __restrict__ x, long long sb, long long sh, long long sn,
                                                      int n, typename StatAcc<ABSMAX>::type* __restrict__ part) {
  __shared__ StatRed<D, typename StatAcc<ABSMAX>::type> red;
  column_partial_body<T, D, ABSMAX>(x, sb, sh, sn, n, part, blockIdx.x, blockIdx.y, blockIdx.z, gridDim.y, gridDim.x,
                                    red);
}

// column_partial_kv reads the batches last to first, each batch's V then K, so that what it read last (batch 0's K
// and V) may still be in L2 (50 MB on the H200; 32 MB of K and V per batch at B = 4, H = 16, N = 4K, D = 128) when
// the quantization pass that follows reads batch 0 first. The same bytes as in batch order (each CTA's work does not
// depend on the order). Inference pre-pass, back to back: 135.2 -> 132.0 us at 4K, 139.0 -> 137.6 at 16K
// (docs/experiments.md; quant_qkv's heads reordered too, K and V before Q, measured 133.9 and 136.8 with 12 bytes of
// spills, and was not kept).

// The forward's two statistics in one launch: K's channel sums and V's channel maxima, one batch each per z.
// grid (ceil(n / CHUNK), H, 2 B), block 256.
template <typename T, int D>
__global__ void __launch_bounds__(256, kStatMinCtas) column_partial_kv(const T* __restrict__ k, long long ksb, long long ksh,
                                                         long long ksn, const T* __restrict__ v, long long vsb,
                                                         long long vsh, long long vsn, int n,
                                                         double* __restrict__ part_k, float* __restrict__ part_v) {
  grid_dep_wait();
  grid_dep_launch_dependents();
  const int B = gridDim.z / 2, z = blockIdx.z;
  // (is K, batch): the last z is batch 0's K, the one before it batch 0's V
  const int zz = 2 * B - 1 - z;
  const bool is_k = zz % 2 == 0;
  const int b = zz / 2;
  __shared__ StatRed<D> red;
  if (is_k)
    column_partial_body<T, D, false>(k, ksb, ksh, ksn, n, part_k, blockIdx.x, blockIdx.y, b, gridDim.y, gridDim.x,
                                     red);
  else
    column_partial_body<T, D, true>(v, vsb, vsh, vsn, n, part_v, blockIdx.x, blockIdx.y, b, gridDim.y, gridDim.x,
                                    red);
}

// out[bh, d] = mean (sum / n) or psi scale (absmax / 127) of the chunk partials. grid (BH), block d.
template <bool ABSMAX>
__device__ __forceinline__ void column_finish_body(const typename StatAcc<ABSMAX>::type* __restrict__ part, int nchunk,
                                                   int n, int d, float* __restrict__ out, long long bh) {
  using Acc = typename StatAcc<ABSMAX>::type;
  const int c = threadIdx.x;
  Acc s = 0;
  for (int k = 0; k < nchunk; ++k) {
    const Acc v = part[(bh * nchunk + k) * d + c];
    if (ABSMAX) s = absmax_or_nan(static_cast<float>(s), static_cast<float>(v));
    else s += v;
  }
  out[bh * d + c] = ABSMAX ? psi_scale(static_cast<float>(s), 127.f) : static_cast<float>(s / static_cast<double>(n));
}

template <bool ABSMAX>
__global__ void column_finish(const typename StatAcc<ABSMAX>::type* __restrict__ part, int nchunk, int n, int d,
                              float* __restrict__ out) {
  column_finish_body<ABSMAX>(part, nchunk, n, d, out, blockIdx.x);
}

// Both of column_partial_kv's results: K's mean (blocks < BH) and V's psi scales. grid (2 BH), block d.
__global__ void column_finish_kv(const double* __restrict__ part_k, const float* __restrict__ part_v, int nchunk, int n,
                                 int d, float* __restrict__ mu_k, float* __restrict__ v_scale) {
  grid_dep_wait();
  grid_dep_launch_dependents();
  const int bh_count = gridDim.x / 2;
  if (static_cast<int>(blockIdx.x) < bh_count) column_finish_body<false>(part_k, nchunk, n, d, mu_k, blockIdx.x);
  else column_finish_body<true>(part_v, nchunk, n, d, v_scale, blockIdx.x - bh_count);
}

// Row quantization: codes[b, h, r, :] = psi(mult * (x[b, h, r, :] - mu[b, h_mu, :])) over groups of
// GROUP rows, all in fp32 (the reference's fp32 mode gives the same codes); the stored scale is
// s * scale_mult (log2 e for Q, so the attention kernels work in base 2), and
// groups are GROUP rows (GROUP = 1: per token; GROUP = 8 * RPW: the CTA's rows share one scale).
// Each of the 8 warps owns RPW rows; LPR = D / (8 C) lanes share a row, each with C pieces of 8 consecutive
// columns (16-byte loads; rows 16-byte aligned): piece j of lane l holds columns 8 (j LPR + l) .. + 7, so that one
// load instruction reads whole 16 LPR-byte row segments.
// Optional: dot[b, h, r] = dot_mult * <x[b, h, r, :], dot_vec[b, h_dot, :]> (the LSE correction of K-smoothing).
// grid (ceil(n_pad / (8 * RPW)), H, B), block 256. Rows >= n are written as padding.
//
// C (pieces per lane, quant_rows_cpl): the per-row work (the row max's shuffles, the scale's division and
// reciprocal with their range checks, the stores' addresses and branches) is shared by D / LPR = 8 C elements per
// lane. With C = 1 (16 lanes per row at D = 128) it was much of the ~28 instructions per element a profile counted.
// QROWS_MAX_CPL caps C: 2 measured the forward pre-pass 179.8 -> 168.7 us at D = 128, N = 4K against 1 (C = 4, with
// 84 registers: 186.7; docs/experiments.md).
constexpr int QROWS_MAX_CPL = 2;
template <int D, int RPW, bool GROUPED>
__host__ __device__ constexpr int quant_rows_cpl() {
  // the largest C <= the cap with 32 / LPR = 256 C / D rows per warp step dividing RPW; grouped rows (one scale
  // per CTA: no per-row scale work to share) keep C = 1 (C = 4 took the 16-row-per-warp build to 168 registers)
  int c = GROUPED ? 1 : (QROWS_MAX_CPL < D / 8 ? QROWS_MAX_CPL : D / 8);
  while (c > 1 && (256 * c / D > RPW || RPW % (256 * c / D) != 0)) c /= 2;
  return c;
}

template <typename T, int D, int RPW, bool GROUPED, bool EXACT = false>
__device__ __forceinline__ void quant_rows_body(const T* __restrict__ x, long long sb, long long sh, long long sn, int n,
                                                int n_pad, const float* __restrict__ mu, int mu_group, float mult,
                                                signed char* __restrict__ codes, float* __restrict__ scales,
                                                float scale_mult, const float* __restrict__ dot_vec, int dot_group,
                                                float dot_mult, float* __restrict__ dot, int bx, int h, int b, int H,
                                                char* __restrict__ kv_img = nullptr) {
  constexpr int C = quant_rows_cpl<D, RPW, GROUPED>(), E = 8 * C;  // pieces and elements per lane and row
  constexpr int LPR = D / E, RPI = 32 / LPR, STEPS = RPW / RPI;  // lanes per row, rows per step
  static_assert(LPR * E == D && RPI * LPR == 32 && RPW % RPI == 0, "whole steps");
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, sub = lane / LPR, cl = lane % LPR;
  const int row_base = bx * 8 * RPW + warp * RPW;
  const long long bh = static_cast<long long>(b) * H + h;
  float v[STEPS][E];
  float amax[STEPS];
  float muv[E], dv[E];  // this lane's columns of mu and of dot_vec, loaded once for all its rows
  // Row b (H / group) + h / group = (b H + h) / group of the (B, H / group, D) vectors (group divides H): one unsigned
  // division (two signed ones were ~74 instructions per thread, 8% of the Q rows' work).
  const float* mu_row = mu ? mu + static_cast<long long>(static_cast<unsigned>(b * H + h) / static_cast<unsigned>(mu_group)) * D
                           : nullptr;
  const float* dv_row =
      dot_vec ? dot_vec + static_cast<long long>(static_cast<unsigned>(b * H + h) / static_cast<unsigned>(dot_group)) * D
              : nullptr;
#pragma unroll
  for (int j = 0; j < 2 * C; ++j) {  // 16-byte loads (mu, dot_vec: the package's own 16-byte aligned (.., D) rows)
    const int col = ((j / 2) * LPR + cl) * 8 + 4 * (j % 2);
    const float4 m4 = mu_row ? *reinterpret_cast<const float4*>(mu_row + col) : make_float4(0.f, 0.f, 0.f, 0.f);
    const float4 d4 = dv_row ? *reinterpret_cast<const float4*>(dv_row + col) : make_float4(0.f, 0.f, 0.f, 0.f);
    muv[4 * j] = m4.x, muv[4 * j + 1] = m4.y, muv[4 * j + 2] = m4.z, muv[4 * j + 3] = m4.w;
    dv[4 * j] = d4.x, dv[4 * j + 1] = d4.y, dv[4 * j + 2] = d4.z, dv[4 * j + 3] = d4.w;
  }
  // Every row's load first (all in flight together), then the arithmetic.
#pragma unroll
  for (int st = 0; st < STEPS; ++st) {
    const int row = row_base + st * RPI + sub;
#pragma unroll
    for (int j = 0; j < C; ++j) {
      uint4 u = make_uint4(0u, 0u, 0u, 0u);  // rows >= n: zeros (one predicated load, then the same conversions)
      if (row < n) u = *reinterpret_cast<const uint4*>(x + b * sb + h * sh + row * sn + (j * LPR + cl) * 8);
      float f[8];
      unpack8<T>(u, f);
#pragma unroll
      for (int c = 0; c < 8; ++c) v[st][8 * j + c] = f[c];
    }
  }
#pragma unroll
  for (int st = 0; st < STEPS; ++st) {
    const int row = row_base + st * RPI + sub;
    float a = 0.f, dp[C];
#pragma unroll
    for (int j = 0; j < C; ++j) dp[j] = 0.f;
#pragma unroll
    for (int c = 0; c < E; ++c) {
      if (dot_vec) dp[c / 8] += v[st][c] * dv[c];  // the input is 0 beyond n
      v[st][c] = mu_row ? (v[st][c] - muv[c]) * mult : v[st][c] * mult;  // (x - +0 is x, -0 and denormals included)
      a = absmax_or_nan(a, v[st][c]);
    }
    if (dot) {
      // The addition tree of one 8-column piece per lane (C = 1), so the sum is bitwise independent of C: piece j
      // of this lane is piece j LPR + cl of that mapping, whose first log2 C shuffle levels added piece p to
      // piece p + D / 16, i.e. here j to j + C / 2 (fp32 addition commutes, so every lane's order is the same).
      tree_fold(dp, FAddOp());
      float dacc = dp[0];
      for (int m = LPR / 2; m >= 1; m >>= 1) dacc += __shfl_xor_sync(0xffffffffu, dacc, m);
      if (cl == 0 && row < n_pad) dot[bh * n_pad + row] = row < n ? dacc * dot_mult : 0.f;
    }
    // rows >= n hold -mu * mult: they count as 0 (their codes are written as 0 below)
    a = warp_max_xor(a, 1, LPR / 2);  // (every lane: the shuffles need the whole warp)
    amax[st] = row < n ? a : 0.f;
  }
  if (GROUPED) {
    __shared__ float wmax[8];
    float a = amax[0];
#pragma unroll
    for (int st = 1; st < STEPS; ++st) a = nan_max(a, amax[st]);
    a = warp_max_xor(a, LPR, 16);
    if (lane == 0) wmax[warp] = a;
    __syncthreads();
    a = wmax[0];
    for (int w = 1; w < 8; ++w) a = nan_max(a, wmax[w]);
#pragma unroll
    for (int st = 0; st < STEPS; ++st) amax[st] = a;
  }
#pragma unroll
  for (int st = 0; st < STEPS; ++st) {
    const int row = row_base + st * RPI + sub;
    if (row >= n_pad) continue;
    const float s = psi_scale(amax[st], 127.f), inv_s = psi_rcp(s);
    unsigned w[2 * C];
#pragma unroll
    for (int i = 0; i < 2 * C; ++i) w[i] = 0u;
    if (row < n && psi_valid(s)) {
      unsigned cw[E];
      if (EXACT) psi_code_words_exact<E>(v[st], s, cw);
      else psi_code_words<E>(v[st], s, inv_s, cw);
#pragma unroll
      for (int i = 0; i < 2 * C; ++i) w[i] = pack4_low_bytes(cw[4 * i], cw[4 * i + 1], cw[4 * i + 2], cw[4 * i + 3]);
    }
    // codes / scales null (K for the inference forward, sage_attention): only the stage images are written
    if (codes) {
      signed char* crow = codes + (bh * n_pad + row) * D;
#pragma unroll
      for (int j = 0; j < C; ++j)
        *reinterpret_cast<uint2*>(crow + (j * LPR + cl) * 8) = make_uint2(w[2 * j], w[2 * j + 1]);
    }
    const float stored = row < n ? s * scale_mult : 0.f;
    if (cl == 0 && scales) scales[bh * n_pad + row] = stored;
    if (kv_img) {  // K^ for the wgmma forward's stage images (int8/bwd_img.cuh FwdImg): the same bytes, swizzled
      char* img = kv_img + (bh * (n_pad / 64) + row / 64) * static_cast<long long>(FwdImg<D>::STAGE);
#pragma unroll
      for (int j = 0; j < C; ++j) {
        const int piece = j * LPR + cl;
        *reinterpret_cast<uint2*>(img + FwdImg<D>::K + swz<D>(row % 64, piece / 2) + 8 * (piece % 2)) =
            make_uint2(w[2 * j], w[2 * j + 1]);
      }
      if (cl == 0) reinterpret_cast<float*>(img + FwdImg<D>::KS)[row % 64] = stored;
    }
  }
}

template <typename T, int D, int RPW, bool GROUPED>
__global__ void __launch_bounds__(256, 1)
quant_rows(const T* __restrict__ x, long long sb, long long sh, long long sn, int n, int n_pad,
           const float* __restrict__ mu, int mu_group, float mult,
           signed char* __restrict__ codes, float* __restrict__ scales, float scale_mult,
           const float* __restrict__ dot_vec, int dot_group, float dot_mult, float* __restrict__ dot,
           char* __restrict__ kv_img) {
  quant_rows_body<T, D, RPW, GROUPED>(x, sb, sh, sn, n, n_pad, mu, mu_group, mult, codes, scales, scale_mult, dot_vec,
                                      dot_group, dot_mult, dot, blockIdx.x, blockIdx.y, blockIdx.z, gridDim.y, kv_img);
}

// The forward's per-token quantization of Q and K in one launch (the same arithmetic as two quant_rows
// launches): heads y < Hq are Q's (psi(q_mult * Q), scale * q_scale_mult, qmk = q_mult * q . mu_K of the
// head's KV head), the others K's (psi(K - mu_K)). grid (max(nq_pad, nk_pad) / (8 RPW), Hq + Hkv, B).
// 4 CTAs per SM (64 registers; ptxas then saves 2-3 registers on the stack around the rare __fdiv_rn slow path):
// quant_rows_qk 83 -> 72 us at D = 128, 4K against 3 (77 registers); 5 spills 400 bytes (docs/experiments.md).
// quant_qkv is built for the same.
constexpr int kQrowsQkMinCtas = 4;
template <typename T, int D, int RPW>
__global__ void __launch_bounds__(256, kQrowsQkMinCtas)
quant_rows_qk(const T* __restrict__ q, long long qsb, long long qsh, long long qsn, int nq, int nq_pad, float q_mult,
              signed char* __restrict__ q_codes, float* __restrict__ q_scales, float q_scale_mult,
              float* __restrict__ qmk, const T* __restrict__ k, long long ksb, long long ksh, long long ksn, int nk,
              int nk_pad, signed char* __restrict__ k_codes, float* __restrict__ k_scales,
              const float* __restrict__ mu_k, int Hq, int Hkv, char* __restrict__ kv_img) {
  const int y = blockIdx.y, bx = blockIdx.x, rows = 8 * RPW;
  if (y < Hq) {
    if (bx * rows >= nq_pad) return;
    quant_rows_body<T, D, RPW, false, true>(q, qsb, qsh, qsn, nq, nq_pad, nullptr, 1, q_mult, q_codes, q_scales,
                                            q_scale_mult, mu_k, Hq / Hkv, q_mult, qmk, bx, y, blockIdx.z, Hq);
  } else {
    if (bx * rows >= nk_pad) return;
    quant_rows_body<T, D, RPW, false, false>(k, ksb, ksh, ksn, nk, nk_pad, mu_k, 1, 1.f, k_codes, k_scales, 1.f,
                                             nullptr, 1, 0.f, nullptr, bx, y - Hq, blockIdx.z, Hkv, kv_img);
  }
}

// Transposed, mma-permuted quantization of a (tokens x D) operand that meets a re-packed
// accumulator along the token dimension (V in P.V, dO in P^T.dO):
//   out[b, h, d, blk*64 + mma_perm32-position of token] = psi(x[b, h, token, d]) for 64-token blocks.
// MODE 0: per-channel scale given in `scale_in` (b, h, d) (computed over the whole sequence);
// MODE 1: per (64-token block, channel) scale, computed here;  MODE 2: one scale per 64-token block.
// Scales written to scale_out[b, h, blk, d] (MODE 1, 2; MODE 2 repeats the block scale over d).
// tile_major = 0: out is (B, H, D, n_pad) (a channel's row runs over the whole sequence); 1: (B, H, n_pad / 64, D,
// 64), each 64-token block's D x 64 bytes contiguous, so that a kernel's copy of one block reads whole 128-byte
// lines (rows of 64 bytes n_pad apart each cost a request of their own and half-empty shared-memory wavefronts).
// grid (n_pad / 64, H, B), block 2 * D; rows 16-byte aligned.
// DELTA (the backward's dO): also delta[b, h, token] = sum_d dO * O in fp32 (0 for tokens >= n) from O (strides
// osb, osh, osn; rows 16-byte aligned), so that dO is read once for both (a separate rowdot pass read it again:
// 45 us of the backward's 160 us of pre-passes at B = 4, H = 16, N = 4K, D = 128). Per token: the 8 products of
// each 16-byte chunk of the row in order, then the row's chunks by a shuffle tree.
// IMG = 1 (with DELTA; the wgmma backward): out is the query-side stage images (int8/bwd_img.cuh) and the block's
// dO^^T, its scales, delta (also into `delta`) and dO itself (the caller's values, K128-swizzled) go into its image.
// IMG = 2 (the wgmma forward's V): out is the K/V stage images (FwdImg) and the V^^T codes go into their VT part.
// IMG = 3 (with DELTA; the wgmma backward with ds_int8=False, whose dV and dK read no dO codes): as 1 without the
// codes: dO and delta only, and the dO scales set to zero.
// IMG = 4 (with DELTA; the mma.sync backward with dv_int8=False, which reads no dO codes): delta only.
// The block's rows are first staged in shared memory with row-contiguous loads: per-thread loads of 4 tokens x 8
// channels read 16 rows x 32 bytes per warp instruction (~2 TB/s; docs/experiments.md).
template <typename T, int D, int MODE, bool DELTA, int IMG = 0>
__device__ __forceinline__ void quant_transpose_perm_body(const T* __restrict__ x, long long sb, long long sh,
                                                          long long sn, int n, int n_pad,
                                                          const float* __restrict__ scale_in,
                                                          float* __restrict__ scale_out, signed char* __restrict__ out,
                                                          int tile_major, const T* __restrict__ o, long long osb,
                                                          long long osh, long long osn, float* __restrict__ delta,
                                                          int blk, int h, int b, int H) {
  // Warp w owns channels 16 w .. 16 w + 15 (two 8-channel chunks, one per half-warp); lane tg = lane % 16 owns
  // the tokens {2t, 2t+1, 2t+8, 2t+9} + 16 hf of the block (hf = tg / 4, t = tg % 4): mma-permuted positions
  // 16 hf + 4t .. 16 hf + 4t + 3, so each of its 8 channels gives one 32-bit word of the output row.
  constexpr int WARPS = D / 16;
  __shared__ __align__(16) unsigned words[D][16];  // output rows: 64 bytes per channel
  __shared__ float wmax[WARPS];
  const long long bh = static_cast<long long>(b) * H + h;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, tg = lane % 16, c0 = warp * 16 + (lane / 16) * 8;
  const int hf = tg / 4, t = tg % 4;
  float v[4][8];
  using Img = BwdImg<D>;
  constexpr int IMG_STAGE = IMG == 1 || IMG == 3 ? Img::Q_STAGE : FwdImg<D>::STAGE;
  char* img = (IMG >= 1 && IMG <= 3)
                  ? reinterpret_cast<char*>(out) + (bh * (n_pad / 64) + blk) * static_cast<long long>(IMG_STAGE)
                  : nullptr;
  // The block's 64 rows staged as they lie (16-byte chunks, consecutive threads along a row: each warp load reads
  // 512 contiguous bytes at D = 128), then each thread's 4 tokens x 8 channels read back from shared memory. Rows
  // are padded by 16 bytes: the read-back (16 lanes, 16 rows, one column) then hits each bank at most twice.
  constexpr int CPR = D / 8, RS = 2 * D + 16, PASSES = 64 * CPR / (2 * D);
  __shared__ __align__(16) char stile[64 * RS];
#pragma unroll
  for (int j = 0; j < PASSES; ++j) {
    const int idx = threadIdx.x + j * 2 * D, r = idx / CPR, c = idx % CPR, tok = blk * 64 + r;
    const bool ok = tok < n;
    const uint4 u = ok ? *reinterpret_cast<const uint4*>(x + b * sb + h * sh + tok * sn + 8 * c)
                       : make_uint4(0u, 0u, 0u, 0u);
    if constexpr (IMG != 3 && IMG != 4) *reinterpret_cast<uint4*>(stile + r * RS + 16 * c) = u;
    if constexpr (IMG == 1 || IMG == 3) *reinterpret_cast<uint4*>(img + Img::Q_DO + k128_offset(r, c)) = u;
    if constexpr (DELTA) {  // delta of row r: this lane's 8 products, then the row's CPR lanes (consecutive)
      float f[8], g8[8];
      const uint4 uo = ok ? *reinterpret_cast<const uint4*>(o + b * osb + h * osh + tok * osn + 8 * c)
                          : make_uint4(0u, 0u, 0u, 0u);
      const T* e = reinterpret_cast<const T*>(&u);
      const T* eo = reinterpret_cast<const T*>(&uo);
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        f[i] = to_float(e[i]);
        g8[i] = to_float(eo[i]);
      }
      float d = 0.f;
#pragma unroll
      for (int i = 0; i < 8; ++i) d = fmaf(f[i], g8[i], d);
#pragma unroll
      for (int m = 1; m < CPR; m <<= 1) d += __shfl_xor_sync(0xffffffffu, d, m);
      if (c == 0) {
        delta[bh * n_pad + blk * 64 + r] = d;  // 0 beyond n
        if constexpr (IMG == 1 || IMG == 3) reinterpret_cast<float*>(img + Img::Q_DELTA)[r] = d;
      }
    }
  }
  if constexpr (IMG == 3) {  // no codes: the dO scales zero, so that every byte of the image is written
    if (threadIdx.x < D / 4) reinterpret_cast<float4*>(img + Img::Q_DOS)[threadIdx.x] = make_float4(0.f, 0.f, 0.f, 0.f);
    return;
  }
  if constexpr (IMG == 4) return;
  __syncthreads();
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    unpack8<T>(*reinterpret_cast<const uint4*>(stile + (16 * hf + 2 * t + (k & 1) + 8 * (k >> 1)) * RS + 2 * c0), v[k]);
  }
  float sc[8];
  if (MODE == 0) {
#pragma unroll
    for (int c = 0; c < 8; ++c) sc[c] = scale_in[bh * D + c0 + c];
  } else if (MODE == 1) {  // per channel over the block's 64 tokens: the 16 lanes of this half-warp
#pragma unroll
    for (int c = 0; c < 8; ++c) {
      float a = 0.f;
#pragma unroll
      for (int k = 0; k < 4; ++k) a = absmax_or_nan(a, v[k][c]);
      a = warp_max_xor(a, 1, 8);
      sc[c] = psi_scale(a, 127.f);
    }
  } else {  // one scale per block
    float a = 0.f;
#pragma unroll
    for (int k = 0; k < 4; ++k)
#pragma unroll
      for (int c = 0; c < 8; ++c) a = absmax_or_nan(a, v[k][c]);
    a = warp_max_xor(a, 1, 16);
    if (lane == 0) wmax[warp] = a;
    __syncthreads();
    a = wmax[0];
    for (int w = 1; w < WARPS; ++w) a = nan_max(a, wmax[w]);
    const float s = psi_scale(a, 127.f);
#pragma unroll
    for (int c = 0; c < 8; ++c) sc[c] = s;
  }
  if (MODE != 0 && tg == 0) {
    float* so = IMG == 1 ? reinterpret_cast<float*>(img + Img::Q_DOS) : scale_out + (bh * (n_pad / 64) + blk) * D;
#pragma unroll
    for (int c = 0; c < 8; ++c) so[c0 + c] = sc[c];
  }
#pragma unroll
  for (int c = 0; c < 8; ++c) {
    unsigned w = 0u;
    if (psi_valid(sc[c])) {
      const float xc[4] = {v[0][c], v[1][c], v[2][c], v[3][c]};
      unsigned cw[4];
      psi_code_words_exact<4>(xc, sc[c], cw);
      w = pack4_low_bytes(cw[0], cw[1], cw[2], cw[3]);
    }
    words[c0 + c][tg] = w;
  }
  __syncthreads();
  // D rows x 4 chunks of 16 bytes; 8 consecutive lanes read two whole rows (conflict-free).
#pragma unroll
  for (int i = threadIdx.x; i < D * 4; i += 2 * D) {
    const int c = i / 4, q = i % 4;
    if constexpr (IMG != 0) {
      *reinterpret_cast<uint4*>(img + (IMG == 1 ? Img::Q_DOT : FwdImg<D>::VT) + swz<64>(c, q)) =
          *reinterpret_cast<const uint4*>(&words[c][4 * q]);
    } else {
      const long long at = tile_major ? ((bh * (n_pad / 64) + blk) * D + c) * 64 + 16 * q
                                      : (bh * D + c) * n_pad + blk * 64 + 16 * q;
      *reinterpret_cast<uint4*>(out + at) = *reinterpret_cast<const uint4*>(&words[c][4 * q]);
    }
  }
}

template <typename T, int D, int MODE>
__global__ void __launch_bounds__(2 * D)
quant_transpose_perm(const T* __restrict__ x, long long sb, long long sh, long long sn, int n, int n_pad,
                     const float* __restrict__ scale_in, float* __restrict__ scale_out, signed char* __restrict__ out,
                     int tile_major) {
  quant_transpose_perm_body<T, D, MODE, false>(x, sb, sh, sn, n, n_pad, scale_in, scale_out, out, tile_major, nullptr,
                                               0, 0, 0, nullptr, blockIdx.x, blockIdx.y, blockIdx.z, gridDim.y);
}

// The wgmma forward's V pass (block_kv = 64): quant_transpose_perm's V^^T codes (MODE 0 or 2; scales of MODE 2 into
// scale_out as there) written into the K/V stage images kv_img (B, H, n_pad / 64, FwdImg<D>::STAGE bytes).
// grid (n_pad / 64, H, B), block 2 * D. (At D = 128 the kernel fits 4 CTAs per SM in 64 registers as it is; asking
// for 5 spills.)
template <typename T, int D, int MODE>
__global__ void __launch_bounds__(2 * D, 1)
fwd_v_image(const T* __restrict__ x, long long sb, long long sh, long long sn, int n, int n_pad,
            const float* __restrict__ scale_in, float* __restrict__ scale_out, char* __restrict__ kv_img) {
  quant_transpose_perm_body<T, D, MODE, false, 2>(x, sb, sh, sn, n, n_pad, scale_in, scale_out,
                                                  reinterpret_cast<signed char*>(kv_img), 1, nullptr, 0, 0, 0, nullptr,
                                                  blockIdx.x, blockIdx.y, blockIdx.z, gridDim.y);
}

// The backward's dO pass: quant_transpose_perm (MODE 1 or 2, tile-major) and delta = rowsum(dO * O) in one launch.
// grid (n_pad / 64, H, B), block 2 * D. (The minimum of one CTA lets ptxas take 80 registers at D = 64, where it
// chose 72 with 24 bytes of spills.)
template <typename T, int D, int MODE>
__global__ void __launch_bounds__(2 * D, 1)
quant_transpose_perm_delta(const T* __restrict__ x, long long sb, long long sh, long long sn, int n, int n_pad,
                           float* __restrict__ scale_out, signed char* __restrict__ out, const T* __restrict__ o,
                           long long osb, long long osh, long long osn, float* __restrict__ delta) {
  quant_transpose_perm_body<T, D, MODE, true>(x, sb, sh, sn, n, n_pad, nullptr, scale_out, out, 1, o, osb, osh, osn,
                                              delta, blockIdx.x, blockIdx.y, blockIdx.z, gridDim.y);
}

// The wgmma backward's dO pass: quant_transpose_perm_delta's work written into the query-side stage images
// q_img (B, H, n_pad / 64, BwdImg<D>::Q_STAGE bytes), delta also into `delta`. grid (n_pad / 64, H, B), block 2 * D.
template <typename T, int D, int MODE>
__global__ void __launch_bounds__(2 * D, 1)
bwd_do_image(const T* __restrict__ x, long long sb, long long sh, long long sn, int n, int n_pad,
             char* __restrict__ q_img, const T* __restrict__ o, long long osb, long long osh, long long osn,
             float* __restrict__ delta) {
  quant_transpose_perm_body<T, D, MODE, true, 1>(x, sb, sh, sn, n, n_pad, nullptr, nullptr,
                                                    reinterpret_cast<signed char*>(q_img), 1, o, osb, osh, osn, delta,
                                                    blockIdx.x, blockIdx.y, blockIdx.z, gridDim.y);
}

// bwd_do_image for the configs whose backward reads no dO codes (ds_int8=False): dO and delta only (IMG 3).
template <typename T, int D>
__global__ void __launch_bounds__(2 * D, 1)
bwd_do16_image(const T* __restrict__ x, long long sb, long long sh, long long sn, int n, int n_pad,
               char* __restrict__ q_img, const T* __restrict__ o, long long osb, long long osh, long long osn,
               float* __restrict__ delta) {
  quant_transpose_perm_body<T, D, 1, true, 3>(x, sb, sh, sn, n, n_pad, nullptr, nullptr,
                                              reinterpret_cast<signed char*>(q_img), 1, o, osb, osh, osn, delta,
                                              blockIdx.x, blockIdx.y, blockIdx.z, gridDim.y);
}

// Tokens tok0 .. tok0 + 63 of a 16-bit [token][channel] tensor (token t at src + t * sn; those from n on zero) as one
// 64 x D block stored in 128-byte pieces (bwd_img.cuh k128_offset) at img, by the CTA's 256 threads: V in the
// backward's key-side images and in the 16-bit P.V forward's V images.
template <typename T, int D>
__device__ __forceinline__ void store_rows_k128(char* img, const T* __restrict__ src, long long sn, int tok0, int n) {
  static_assert((8 * D) % 256 == 0, "whole passes of 256 threads");
#pragma unroll
  for (int i = 0; i < 8 * D / 256; ++i) {
    const int idx = threadIdx.x + 256 * i, r = idx / (D / 8), c = idx % (D / 8), tok = tok0 + r;
    const uint4 val = tok < n ? *reinterpret_cast<const uint4*>(src + tok * sn + 8 * c) : make_uint4(0u, 0u, 0u, 0u);
    *reinterpret_cast<uint4*>(img + k128_offset(r, c)) = val;
  }
}

// The 16-bit V of the wgmma forward with pv_int8=False (int8/fwd.cuh PV16): per (b, h, 64-key tile) 64 x D elements
// of V as they are (the caller's layout), stored [key][channel] in 128-byte pieces (bwd_img.cuh k128_offset), keys
// past n zero (a masked key's P~ is 0, and 0 times a stale value could be NaN). out (B, H, n_pad / 64, 128 D bytes).
// grid (n_pad / 64, H, B), block 256.
template <typename T, int D>
__global__ void __launch_bounds__(256)
fwd_v16_image(const T* __restrict__ v, long long sb, long long sh, long long sn, int n, int n_pad,
              char* __restrict__ out) {
  const int blk = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
  char* img = out + ((static_cast<long long>(b) * gridDim.y + h) * (n_pad / 64) + blk) * (128 * D);
  store_rows_k128<T, D>(img, v + b * sb + h * sh, sn, blk * 64, n);
}

// The mma.sync backward's dO pass for the configs whose dV reads no dO codes (dv_int8=False): delta = rowsum(dO * O)
// alone, by quant_transpose_perm_delta's code (the same sums, bit for bit). grid (n_pad / 64, H, B), block 2 * D.
template <typename T, int D>
__global__ void __launch_bounds__(2 * D, 1)
bwd_delta(const T* __restrict__ x, long long sb, long long sh, long long sn, int n, int n_pad, const T* __restrict__ o,
          long long osb, long long osh, long long osn, float* __restrict__ delta) {
  quant_transpose_perm_body<T, D, 1, true, 4>(x, sb, sh, sn, n, n_pad, nullptr, nullptr, nullptr, 1, o, osb, osh, osn,
                                              delta, blockIdx.x, blockIdx.y, blockIdx.z, gridDim.y);
}

template <int D>
using CodeWords = unsigned[64][D / 4 + 1];  // a staged block: 32-bit words, one word of row padding

// Stage 64 rows of D code bytes (16-byte coalesced loads) as words; with `img`, also store the block's swizzled
// image (swz<D>, the kernels' tile layout) from the same loads. Block 256.
template <int D>
__device__ __forceinline__ void stage_code_words(CodeWords<D>& tile, const signed char* __restrict__ src, char* img) {
  constexpr int PIECES = 64 * D / 16;  // 16-byte pieces of the block
  static_assert(PIECES % 256 == 0, "whole passes of 256 threads");
  uint4 ld[PIECES / 256];
#pragma unroll
  for (int i = 0; i < PIECES / 256; ++i) ld[i] = *reinterpret_cast<const uint4*>(src + (threadIdx.x + 256 * i) * 16);
#pragma unroll
  for (int i = 0; i < PIECES / 256; ++i) {
    const int idx = threadIdx.x + 256 * i, r = idx / (D / 16), c = idx % (D / 16), w = 4 * c;
    if (img) *reinterpret_cast<uint4*>(img + swz<D>(r, c)) = ld[i];
    tile[r][w] = ld[i].x;
    tile[r][w + 1] = ld[i].y;
    tile[r][w + 2] = ld[i].z;
    tile[r][w + 3] = ld[i].w;
  }
}

// The staged block transposed, 4 positions x 4 channels per unit: this thread's units (tg = tid % 16: positions
// 4 tg .. 4 tg + 3; channels 4 cq .. 4 cq + 3) go to store(cq, out), out[e] = channel 4 cq + e's 4 tokens (one
// word). PERM: position 16 hf + 4 t + k of a 32-group holds token 16 hf + 2 t + (k & 1) + 8 (k >> 1) (hf = tg / 4,
// t = tg % 4), as quant_transpose_perm writes V and dO. Eight byte permutes per unit.
template <int D, bool PERM, typename F>
__device__ __forceinline__ void transposed_code_units(const CodeWords<D>& tile, F&& store) {
  constexpr int UNITS = 16 * (D / 4);
  static_assert(UNITS % 256 == 0, "whole passes of 256 threads");
  const int tg = threadIdx.x % 16, hf = tg / 4, t = tg % 4;
#pragma unroll
  for (int j = 0; j < UNITS / 256; ++j) {
    const int cq = threadIdx.x / 16 + 16 * j;
    unsigned w[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) w[k] = tile[PERM ? 16 * hf + 2 * t + (k & 1) + 8 * (k >> 1) : 4 * tg + k][cq];
    // 4 x 4 bytes: word k holds token k's channels; output word e holds channel e's tokens.
    const unsigned a = __byte_perm(w[0], w[1], 0x5140), bb = __byte_perm(w[0], w[1], 0x7362);
    const unsigned c = __byte_perm(w[2], w[3], 0x5140), d = __byte_perm(w[2], w[3], 0x7362);
    const unsigned out[4] = {__byte_perm(a, c, 0x5410), __byte_perm(a, c, 0x7632), __byte_perm(bb, d, 0x5410),
                             __byte_perm(bb, d, 0x7632)};
    store(cq, out);
  }
}

// int8 transpose of 64 tokens of (B*H, n_pad, D) codes into the tile-major (B*H, n_pad / 64, D, 64), optionally
// mma-permuting the token order within each 32-token group; block 256. (The byte-wise version before the staged
// words and the register transpose: 64 us at B = 4, H = 16, N = 4K, D = 128, 37% of DRAM bandwidth, ALU-bound.)
template <int D, bool PERM>
__device__ __forceinline__ void transpose_i8_body(const signed char* __restrict__ in, int n_pad,
                                                  signed char* __restrict__ out, int blk, long long bh) {
  __shared__ CodeWords<D> tile;
  stage_code_words<D>(tile, in + (bh * n_pad + blk * 64) * D, nullptr);
  __syncthreads();
  signed char* dst = out + (bh * (n_pad / 64) + blk) * D * 64 + 4 * (threadIdx.x % 16);
  transposed_code_units<D, PERM>(tile, [&](int cq, const unsigned (&o)[4]) {
    unsigned* row = reinterpret_cast<unsigned*>(dst + 4 * cq * 64);  // 16 threads per 64-byte output row
    row[0] = o[0];
    row[16] = o[1];
    row[32] = o[2];
    row[48] = o[3];
  });
}

// The wgmma backward's stage images from the forward's residuals (int8/bwd_img.cuh): heads y < Hq fill the
// query side of q_img (Q^, Q^^T, q scales, lse2; bwd_do_image adds dO's parts), the others k_img (K^, K^^T, V
// with zero rows beyond nk, key scales). Codes as in transpose_i8_body; the untransposed tile is stored swizzled
// from the same loads. DS16 (ds_int8=False): the codes as bf16 (Q_Q16, K_K16) in place of the transposed ones.
// grid (max(nq_pad, nk_pad) / 64, Hq + Hkv, B), block 256; V's rows 16-byte aligned.
template <typename T, int D, bool DS16>
__device__ __forceinline__ void bwd_qk_images_body(const signed char* __restrict__ qc, const float* __restrict__ qs,
                                                   const float* __restrict__ lse2, int nq_pad, char* __restrict__ q_img,
                                                   const signed char* __restrict__ kc, const float* __restrict__ ks,
                                                   int nk_pad, const T* __restrict__ v, long long vsb, long long vsh,
                                                   long long vsn, int nk, char* __restrict__ k_img, int Hq, int Hkv,
                                                   int blk, int y, int b) {
  using Img = BwdImg<D, DS16>;
  static_assert((8 * D) % 256 == 0, "whole passes of 256 threads");
  __shared__ CodeWords<D> tile;
  const bool qside = y < Hq;
  const int n_pad = qside ? nq_pad : nk_pad, hk = y - Hq;
  if (blk * 64 >= n_pad) return;
  const long long bh = qside ? static_cast<long long>(b) * Hq + y : static_cast<long long>(b) * Hkv + hk;
  const long long tile_idx = bh * (n_pad / 64) + blk;
  char* img = qside ? q_img + tile_idx * Img::Q_STAGE : k_img + tile_idx * Img::K_STAGE;
  stage_code_words<D>(tile, (qside ? qc : kc) + (bh * n_pad + blk * 64) * D, img);  // Q^ / K^ at offset 0
  // The tile's vectors: q scales and lse2, or key scales.
  const float* vec = qside ? (threadIdx.x < 16 ? qs : lse2) : ks;
  if (threadIdx.x < (qside ? 32 : 16)) {
    const int j = threadIdx.x % 16;
    reinterpret_cast<float4*>(img + (qside ? (threadIdx.x < 16 ? Img::Q_QS : Img::Q_LSE) : Img::K_KS))[j] =
        reinterpret_cast<const float4*>(vec + bh * n_pad + blk * 64)[j];
  }
  if (!qside)  // V (16-bit, the caller's layout) as the dQ stage's K128 operand
    store_rows_k128<T, D>(img + Img::K_V, v + b * vsb + hk * vsh, vsn, blk * 64, nk);
  __syncthreads();
  if constexpr (DS16) {  // 8 codes (two staged words) per 16-byte chunk of bf16
#pragma unroll
    for (int i = 0; i < 8 * D / 256; ++i) {
      const int idx = threadIdx.x + 256 * i, r = idx / (D / 8), c = idx % (D / 8);
      *reinterpret_cast<uint4*>(img + (qside ? Img::Q_Q16 : Img::K_K16) + k128_offset(r, c)) =
          s8x8_to_bf16(tile[r][2 * c], tile[r][2 * c + 1]);
    }
    return;
  }
  const int tg = threadIdx.x % 16, hf = tg / 4, t = tg % 4;
  char* dst_t = img + (qside ? Img::Q_QT : Img::K_KT) + 4 * t;
  transposed_code_units<D, true>(tile, [&](int cq, const unsigned (&o)[4]) {
#pragma unroll
    for (int e = 0; e < 4; ++e)  // row 4 cq + e of the transposed tile; positions 4 tg .. 4 tg + 3 = 16-byte chunk hf
      *reinterpret_cast<unsigned*>(dst_t + swz<64>(4 * cq + e, hf)) = o[e];
  });
}

template <typename T, int D, bool DS16>
__global__ void __launch_bounds__(256)
bwd_qk_images(const signed char* __restrict__ qc, const float* __restrict__ qs, const float* __restrict__ lse2,
              int nq_pad, char* __restrict__ q_img, const signed char* __restrict__ kc, const float* __restrict__ ks,
              int nk_pad, const T* __restrict__ v, long long vsb, long long vsh, long long vsn, int nk,
              char* __restrict__ k_img, int Hq, int Hkv) {
  bwd_qk_images_body<T, D, DS16>(qc, qs, lse2, nq_pad, q_img, kc, ks, nk_pad, v, vsb, vsh, vsn, nk, k_img, Hq, Hkv,
                           blockIdx.x, blockIdx.y, blockIdx.z);
}

// The backward's two transposes (Q codes: heads y < Hq, K codes: the others) in one launch.
// grid (max(nq_pad, nk_pad) / 64, Hq + Hkv, B), block 256.
template <int D, bool PERM>
__global__ void transpose_i8_qk(const signed char* __restrict__ qc, int nq_pad, signed char* __restrict__ qt,
                                const signed char* __restrict__ kc, int nk_pad, signed char* __restrict__ kt, int Hq,
                                int Hkv) {
  const int y = blockIdx.y, blk = blockIdx.x;
  if (y < Hq) {
    if (blk * 64 < nq_pad) transpose_i8_body<D, PERM>(qc, nq_pad, qt, blk, static_cast<long long>(blockIdx.z) * Hq + y);
  } else if (blk * 64 < nk_pad) {
    transpose_i8_body<D, PERM>(kc, nk_pad, kt, blk, static_cast<long long>(blockIdx.z) * Hkv + (y - Hq));
  }
}

// quant_rows_qk and fwd_v_image in one launch where both take 256 threads (D = 128, 64-row CTAs): heads y < Hq
// are Q's rows, then Hkv of K's rows, then Hkv of V's 64-token blocks (fwd_v_image's MODE 0 or 2 work into
// kv_img). The same bodies, so the same bytes; one launch and one kernel boundary fewer (the forward pre-pass measured
// the same at 4K and 2% faster at 16K: the host's launch is what it saves; docs/experiments.md). The host launches it
// wherever it applies (wgmma engine, D = 128, per-token Q and K). grid (max(nq_pad, nk_pad) / 64, Hq + 2 Hkv, B),
// block 256.
template <typename T, int D, int RPW, int MODE>
__global__ void __launch_bounds__(256, kQrowsQkMinCtas)
quant_qkv(const T* __restrict__ q, long long qsb, long long qsh, long long qsn, int nq, int nq_pad, float q_mult,
          signed char* __restrict__ q_codes, float* __restrict__ q_scales, float q_scale_mult,
          float* __restrict__ qmk, const T* __restrict__ k, long long ksb, long long ksh, long long ksn, int nk,
          int nk_pad, signed char* __restrict__ k_codes, float* __restrict__ k_scales,
          const float* __restrict__ mu_k, int Hq, int Hkv, char* __restrict__ kv_img, const T* __restrict__ v,
          long long vsb, long long vsh, long long vsn, const float* __restrict__ v_scale_in,
          float* __restrict__ v_scale_out) {
  static_assert(2 * D == 256 && 8 * RPW == 64, "V's 64-token blocks on 256 threads, 64 Q / K rows per CTA");
  grid_dep_wait();
  grid_dep_launch_dependents();
  const int y = blockIdx.y, bx = blockIdx.x, rows = 8 * RPW;
  if (y < Hq) {
    if (bx * rows >= nq_pad) return;
    quant_rows_body<T, D, RPW, false, true>(q, qsb, qsh, qsn, nq, nq_pad, nullptr, 1, q_mult, q_codes, q_scales,
                                            q_scale_mult, mu_k, Hq / Hkv, q_mult, qmk, bx, y, blockIdx.z, Hq);
  } else if (y < Hq + Hkv) {
    if (bx * rows >= nk_pad) return;
    quant_rows_body<T, D, RPW, false, false>(k, ksb, ksh, ksn, nk, nk_pad, mu_k, 1, 1.f, k_codes, k_scales, 1.f,
                                             nullptr, 1, 0.f, nullptr, bx, y - Hq, blockIdx.z, Hkv, kv_img);
  } else {
    if (bx * 64 >= nk_pad) return;
    quant_transpose_perm_body<T, D, MODE, false, 2>(v, vsb, vsh, vsn, nk, nk_pad, v_scale_in, v_scale_out,
                                                    reinterpret_cast<signed char*>(kv_img), 1, nullptr, 0, 0, 0,
                                                    nullptr, bx, y - Hq - Hkv, blockIdx.z, Hkv);
  }
}
