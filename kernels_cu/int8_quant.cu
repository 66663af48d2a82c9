// INT8 pre-processing for SageBwd (SPEC §2-4): K-smoothing mean, per-token / per-block row
// quantization of Q and K, transposed (mma-permuted) quantization of V and dO, delta = rowsum(dO*O),
// and int8 transposes of the saved Q/K codes for the backward.
//
// psi over a block: s = max|x| / 127, code = clamp(rint(x / s), -127, 127); a zero block has s = 0
// and codes 0; a block holding NaN or +-Inf gets s = NaN and codes 0 (never a silent finite value).
// All outputs are padded: rows (tokens) up to a multiple of the attention tile, padding rows have
// code 0 and scale 0.
#include "common/numeric.cuh"

namespace sage {

__device__ __forceinline__ float absmax_or_nan(float m, float x) {
  // NaN-propagating running max of |x| (fmaxf would drop the NaN).
  float a = fabsf(x);
  return (a != a || m != m) ? __int_as_float(0x7fffffff) : fmaxf(m, a);
}

__device__ __forceinline__ float psi_scale(float amax, float qmax) {
  if (amax != amax || amax == INFINITY) return __int_as_float(0x7fffffff);
  return amax / qmax;
}

__device__ __forceinline__ int psi_code(float x, float s, float qmax) {
  if (!(s > 0.0f) || s == INFINITY) return 0;  // zero block or NaN scale
  float c = rintf(__fdiv_rn(x, s));
  return static_cast<int>(fminf(fmaxf(c, -qmax), qmax));
}

}  // namespace sage

using namespace sage;

// Column statistics over tokens in two deterministic passes (no atomics on sums, so the mean and the
// codes that depend on it are bitwise repeatable). Pass 1: CTA (chunk, h, b) reduces CHUNK tokens into
// part[b, h, chunk, d] (sum, or NaN-propagating absmax when ABSMAX). Pass 2 reduces the chunks in order.
constexpr int STAT_CHUNK = 256;

// Sums accumulate in double (the mean is then rounded once to fp32, as the reference does), maxima in float.
template <bool ABSMAX> struct StatAcc { using type = double; };
template <> struct StatAcc<true> { using type = float; };

template <typename T, bool ABSMAX>
__global__ void column_partial(const T* __restrict__ x, long long sb, long long sh, long long sn, int n, int d,
                               typename StatAcc<ABSMAX>::type* __restrict__ part) {
  using Acc = typename StatAcc<ABSMAX>::type;
  extern __shared__ __align__(8) char red_raw[];
  Acc* red = reinterpret_cast<Acc*>(red_raw);
  const int chunk = blockIdx.x, h = blockIdx.y, b = blockIdx.z, H = gridDim.y, nchunk = gridDim.x;
  const int col = threadIdx.x % d, lanes = blockDim.x / d, row0 = threadIdx.x / d;
  const int t0 = chunk * STAT_CHUNK, t1 = min(n, t0 + STAT_CHUNK);
  Acc acc = 0;
  if (row0 < lanes) {
    const T* base = x + b * sb + h * sh + col;
    for (int i = t0 + row0; i < t1; i += lanes) {
      const float v = to_float(base[i * sn]);
      if (ABSMAX) acc = absmax_or_nan(static_cast<float>(acc), v);
      else acc += static_cast<Acc>(v);
    }
  }
  red[threadIdx.x] = acc;
  __syncthreads();
  if (threadIdx.x < d) {
    Acc s = 0;
    for (int r = 0; r < lanes; ++r) {
      if (ABSMAX) s = absmax_or_nan(static_cast<float>(s), static_cast<float>(red[r * d + threadIdx.x]));
      else s += red[r * d + threadIdx.x];
    }
    part[((static_cast<long long>(b) * H + h) * nchunk + chunk) * d + threadIdx.x] = s;
  }
}

// out[bh, d] = mean (sum / n) or psi scale (absmax / 127) of the chunk partials. grid (BH), block d.
template <bool ABSMAX>
__global__ void column_finish(const typename StatAcc<ABSMAX>::type* __restrict__ part, int nchunk, int n, int d,
                              float* __restrict__ out) {
  using Acc = typename StatAcc<ABSMAX>::type;
  const long long bh = blockIdx.x;
  const int c = threadIdx.x;
  Acc s = 0;
  for (int k = 0; k < nchunk; ++k) {
    const Acc v = part[(bh * nchunk + k) * d + c];
    if (ABSMAX) s = absmax_or_nan(static_cast<float>(s), static_cast<float>(v));
    else s += v;
  }
  out[bh * d + c] = ABSMAX ? psi_scale(static_cast<float>(s), 127.f) : static_cast<float>(s / static_cast<double>(n));
}

// Row quantization: codes[b, h, r, :] = psi(mult * (x[b, h, r, :] - mu[b, h_mu, :])) over groups of
// GROUP rows, all in fp32 (the reference's fp32 mode gives the same codes); the stored scale is
// s * scale_mult (log2 e for Q, so the attention kernels work in base 2), and
// groups are GROUP rows (GROUP = 1: per token; GROUP = 8 * RPW: the CTA's rows share one scale).
// Each of the 8 warps owns RPW rows; each lane owns D/32 consecutive columns.
// Optional: dot[b, h, r] = dot_mult * <x[b, h, r, :], dot_vec[b, h_dot, :]> (the LSE correction of K-smoothing).
// grid (ceil(n_pad / (8 * RPW)), H, B), block 256. Rows >= n are written as padding.
template <typename T, int D, int RPW, bool GROUPED>
__global__ void quant_rows(const T* __restrict__ x, long long sb, long long sh, long long sn, int n, int n_pad,
                           const float* __restrict__ mu, int mu_group, float mult,
                           signed char* __restrict__ codes, float* __restrict__ scales, float scale_mult,
                           const float* __restrict__ dot_vec, int dot_group, float dot_mult, float* __restrict__ dot) {
  constexpr int C = D / 32;  // columns per lane
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int h = blockIdx.y, b = blockIdx.z, H = gridDim.y;
  const int row_base = blockIdx.x * 8 * RPW + warp * RPW;
  const long long bh = static_cast<long long>(b) * H + h;
  float v[RPW][C];
  float amax[RPW];
  float muv[C], dv[C];  // this lane's columns of mu and of dot_vec, loaded once for all its rows
  const int hm = h / mu_group;
#pragma unroll
  for (int c = 0; c < C; ++c) {
    muv[c] = mu ? mu[(static_cast<long long>(b) * (H / mu_group) + hm) * D + lane * C + c] : 0.f;
    dv[c] = dot_vec ? dot_vec[(static_cast<long long>(b) * (H / dot_group) + h / dot_group) * D + lane * C + c] : 0.f;
  }
#pragma unroll
  for (int r = 0; r < RPW; ++r) {
    const int row = row_base + r;
    amax[r] = 0.f;
    float dacc = 0.f;
#pragma unroll
    for (int c = 0; c < C; ++c) {
      float xv = 0.f;
      if (row < n) xv = to_float(x[b * sb + h * sh + row * sn + lane * C + c]);
      if (dot_vec) dacc += xv * dv[c];  // xv = 0 beyond n
      v[r][c] = row < n ? (xv - muv[c]) * mult : 0.f;
      amax[r] = absmax_or_nan(amax[r], v[r][c]);
    }
    if (dot) {
      for (int m = 16; m >= 1; m >>= 1) dacc += __shfl_xor_sync(0xffffffffu, dacc, m);
      if (lane == 0 && row < n_pad) dot[bh * n_pad + row] = row < n ? dacc * dot_mult : 0.f;
    }
    for (int m = 16; m >= 1; m >>= 1) {
      float o = __shfl_xor_sync(0xffffffffu, amax[r], m);
      amax[r] = (o != o || amax[r] != amax[r]) ? o + amax[r] : fmaxf(amax[r], o);
    }
  }
  if (GROUPED) {
    __shared__ float wmax[8];
    float a = amax[0];
#pragma unroll
    for (int r = 1; r < RPW; ++r) a = (a != a || amax[r] != amax[r]) ? a + amax[r] : fmaxf(a, amax[r]);
    if (lane == 0) wmax[warp] = a;
    __syncthreads();
    a = wmax[0];
    for (int w = 1; w < 8; ++w) a = (a != a || wmax[w] != wmax[w]) ? a + wmax[w] : fmaxf(a, wmax[w]);
#pragma unroll
    for (int r = 0; r < RPW; ++r) amax[r] = a;
  }
#pragma unroll
  for (int r = 0; r < RPW; ++r) {
    const int row = row_base + r;
    if (row >= n_pad) continue;
    const float s = psi_scale(amax[r], 127.f);
    unsigned packed = 0;
#pragma unroll
    for (int c = 0; c < C; ++c) packed |= (static_cast<unsigned>(psi_code(v[r][c], s, 127.f)) & 0xFFu) << (8 * c);
    signed char* dst = codes + (bh * n_pad + row) * D + lane * C;
    if (C == 4) *reinterpret_cast<unsigned*>(dst) = packed;
    else *reinterpret_cast<unsigned short*>(dst) = static_cast<unsigned short>(packed);
    if (lane == 0) scales[bh * n_pad + row] = row < n ? s * scale_mult : 0.f;
  }
}

// Transposed, mma-permuted quantization of a (tokens x D) operand that meets a re-packed
// accumulator along the token dimension (V in P.V, dO in P^T.dO):
//   out[b, h, d, blk*64 + mma_perm32-position of token] = psi(x[b, h, token, d]) for 64-token blocks.
// MODE 0: per-channel scale given in `scale_in` (b, h, d) (computed over the whole sequence);
// MODE 1: per (64-token block, channel) scale, computed here;  MODE 2: one scale per 64-token block.
// Scales written to scale_out[b, h, blk, d] (MODE 1, 2; MODE 2 repeats the block scale over d).
// grid (n_pad / 64, H, B), block 256.
template <typename T, int D, int MODE>
__global__ void quant_transpose_perm(const T* __restrict__ x, long long sb, long long sh, long long sn, int n, int n_pad,
                                     const float* __restrict__ scale_in, float* __restrict__ scale_out,
                                     signed char* __restrict__ out) {
  __shared__ float tile[64][D + 1];
  __shared__ float cscale[D];
  __shared__ float wmax[8];
  const int blk = blockIdx.x, h = blockIdx.y, b = blockIdx.z, H = gridDim.y;
  const long long bh = static_cast<long long>(b) * H + h;
  for (int i = threadIdx.x; i < 64 * D; i += blockDim.x) {
    const int r = i / D, c = i % D, tok = blk * 64 + r;
    tile[r][c] = tok < n ? to_float(x[b * sb + h * sh + tok * sn + c]) : 0.f;
  }
  __syncthreads();
  if (MODE == 0) {
    for (int c = threadIdx.x; c < D; c += blockDim.x) cscale[c] = scale_in[bh * D + c];
  } else if (MODE == 1) {
    for (int c = threadIdx.x; c < D; c += blockDim.x) {
      float a = 0.f;
      for (int r = 0; r < 64; ++r) a = absmax_or_nan(a, tile[r][c]);
      cscale[c] = psi_scale(a, 127.f);
    }
  } else {
    float a = 0.f;
    for (int i = threadIdx.x; i < 64 * D; i += blockDim.x) a = absmax_or_nan(a, tile[i / D][i % D]);
    for (int m = 16; m >= 1; m >>= 1) {
      float o = __shfl_xor_sync(0xffffffffu, a, m);
      a = (o != o || a != a) ? o + a : fmaxf(a, o);
    }
    if (threadIdx.x % 32 == 0) wmax[threadIdx.x / 32] = a;
    __syncthreads();
    if (threadIdx.x < D) {
      float s = wmax[0];
      for (int w = 1; w < 8; ++w) s = (s != s || wmax[w] != wmax[w]) ? s + wmax[w] : fmaxf(s, wmax[w]);
      cscale[threadIdx.x] = psi_scale(s, 127.f);
    }
  }
  __syncthreads();
  if (MODE != 0)
    for (int c = threadIdx.x; c < D; c += blockDim.x) scale_out[(bh * (n_pad / 64) + blk) * D + c] = cscale[c];
  // Each thread writes 4 consecutive output bytes (positions p..p+3 of one channel row).
  for (int i = threadIdx.x; i < D * 16; i += blockDim.x) {
    const int c = i / 16, p0 = (i % 16) * 4;
    unsigned packed = 0;
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      const int p = p0 + q;
      const int tok = (p & ~31) | mma_perm32_inv(p & 31);
      packed |= (static_cast<unsigned>(psi_code(tile[tok][c], cscale[c], 127.f)) & 0xFFu) << (8 * q);
    }
    *reinterpret_cast<unsigned*>(out + (bh * D + c) * n_pad + blk * 64 + p0) = packed;
  }
}

// delta[b, h, r] = sum_d dO[b,h,r,d] * O[b,h,r,d] in fp32 (0 for padding rows r >= n).
// One warp per row. grid (ceil(n_pad / 8), H, B), block 256.
template <typename T>
__global__ void rowdot(const T* __restrict__ a, long long asb, long long ash, long long asn,
                       const T* __restrict__ c, long long csb, long long csh, long long csn,
                       int n, int n_pad, int d, float* __restrict__ out) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int row = blockIdx.x * 8 + warp, h = blockIdx.y, b = blockIdx.z, H = gridDim.y;
  if (row >= n_pad) return;
  float acc = 0.f;
  if (row < n)
    for (int i = lane; i < d; i += 32)
      acc += to_float(a[b * asb + h * ash + row * asn + i]) * to_float(c[b * csb + h * csh + row * csn + i]);
  for (int m = 16; m >= 1; m >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, m);
  if (lane == 0) out[(static_cast<long long>(b) * H + h) * n_pad + row] = acc;
}

// int8 transpose of (B*H, n_pad, D) codes into (B*H, D, n_pad), optionally mma-permuting the token order
// within each 32-token group. grid (n_pad / 64, H, B), block 256.
template <int D, bool PERM>
__global__ void transpose_i8(const signed char* __restrict__ in, int n_pad, signed char* __restrict__ out) {
  __shared__ signed char tile[64][D + 4];
  const int blk = blockIdx.x;
  const long long bh = static_cast<long long>(blockIdx.z) * gridDim.y + blockIdx.y;
  for (int i = threadIdx.x; i < 64 * D / 4; i += blockDim.x) {
    const int r = i / (D / 4), c4 = (i % (D / 4)) * 4;
    const unsigned v = *reinterpret_cast<const unsigned*>(in + (bh * n_pad + blk * 64 + r) * D + c4);
#pragma unroll
    for (int q = 0; q < 4; ++q) tile[r][c4 + q] = static_cast<signed char>((v >> (8 * q)) & 0xFF);
  }
  __syncthreads();
  for (int i = threadIdx.x; i < D * 16; i += blockDim.x) {
    const int c = i / 16, p0 = (i % 16) * 4;
    unsigned packed = 0;
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      const int p = p0 + q;
      const int tok = PERM ? ((p & ~31) | mma_perm32_inv(p & 31)) : p;
      packed |= (static_cast<unsigned>(static_cast<unsigned char>(tile[tok][c]))) << (8 * q);
    }
    *reinterpret_cast<unsigned*>(out + (bh * D + c) * n_pad + blk * 64 + p0) = packed;
  }
}
