// NVFP4 quantization pre-passes (SPEC §5) into the exchange format: packed E2M1 codes (two per byte,
// element 2i in the low nibble) and one E4M3 scale byte per 16 elements along the contraction axis.
//   nvfp4_quant_rows:   x (B, H, N, D), blocks of 16 along D   -> codes (B, H, N, D/2), scales (B, H, N, D/16)
//   nvfp4_quant_tokens: x (B, H, N, D), blocks of 16 tokens    -> codes (B, H, D, N16/2), scales (B, H, D, N16/16)
//                       (V^T: the tokens are P.V's contraction axis; tokens >= N are zeros)
// An optional fp32 mean (B, H / mu_group, D) is subtracted first (K-smoothing), in fp32.
#include "common/fp4.cuh"
#include "common/mma.cuh"
#include "common/numeric.cuh"

using namespace sage;

// One thread's work of nvfp4_quant_rows after its loads: v = its BPT 16-blocks of row `row` from column c0 (zeros
// when !valid; every thread of a row's group runs this, valid or not, for the dot's shuffles).
template <typename T, int DT>
__device__ __forceinline__ void quant_rows_finish(float (&v)[DT ? 2 : 1][16], bool valid, long long row, int c0,
                                                  int n, int d, const float* __restrict__ mu, int mu_group,
                                                  unsigned char* __restrict__ codes,
                                                  unsigned char* __restrict__ scales,
                                                  const float* __restrict__ dot_mu, int dot_group, float dot_scale,
                                                  float* __restrict__ dot_out, int h, int b, int H) {
  constexpr int BPT = DT ? 2 : 1;
  const int D = DT ? DT : d, nblk_row = D / 16, tpr = nblk_row / BPT;  // tpr: threads per row
  const long long bh = static_cast<long long>(b) * H + h;
  if (dot_mu) {
    const float* dm = dot_mu + (static_cast<long long>(b) * (H / dot_group) + h / dot_group) * D + c0;
    float acc = 0.f;
#pragma unroll
    for (int k = 0; k < BPT; ++k) {
      float m[16];
      load16f(dm + 16 * k, m);
#pragma unroll
      for (int i = 0; i < 16; ++i) acc = fmaf(v[k][i], m[i], acc);  // (v = 0 on invalid rows)
    }
    for (int o = tpr / 2; o >= 1; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
    if (valid && c0 == 0) dot_out[bh * n + row] = acc * dot_scale;
    if (!valid) return;
  }
  unsigned packed[BPT][2], sc[BPT];
#pragma unroll
  for (int k = 0; k < BPT; ++k) {
    if (mu) {
      float m[16];
      load16f(mu + (static_cast<long long>(b) * (H / mu_group) + h / mu_group) * D + c0 + 16 * k, m);
#pragma unroll
      for (int i = 0; i < 16; ++i) v[k][i] -= m[i];
      sc[k] = nvfp4_block_cmp(v[k], packed[k]);  // (after a mean's subtraction: general fp32 numbers)
    } else {
      sc[k] = nvfp4_block_exact16(v[k], packed[k]);
    }
  }
  const long long r = bh * n + row;
  if constexpr (BPT == 2) {  // 16 code bytes (16-byte aligned: D / 2 and c0 / 2 are multiples of 16), 2 scale bytes
    *reinterpret_cast<uint4*>(codes + r * (D / 2) + c0 / 2) =
        make_uint4(packed[0][0], packed[0][1], packed[1][0], packed[1][1]);
    *reinterpret_cast<unsigned short*>(scales + r * nblk_row + c0 / 16) =
        static_cast<unsigned short>(sc[0] | (sc[1] << 8));
  } else {
    *reinterpret_cast<uint2*>(codes + r * (D / 2) + c0 / 2) = make_uint2(packed[0][0], packed[0][1]);
    scales[r * nblk_row + c0 / 16] = static_cast<unsigned char>(sc[0]);
  }
}

// BPT = 2 neighbouring 16-blocks of a row per thread (1 when D is read at run time). grid (ceil(N * D / 16 / BPT /
// 256), H, B), block 256. DT: D as a compile-time constant (64, 128 or 256: a row's blocks from shifts), or 0 for D = d
// at run time (a 64-bit division per thread).
// mu (optional, K-smoothing): (B, H / mu_group, D) fp32, 16-byte aligned, subtracted in fp32 first.
// dot_mu (optional; D / 16 / BPT a power of two up to 32, so that a row's threads are neighbouring lanes of one warp;
// 16-byte aligned): also dot_out[b, h, row] = dot_scale * sum_c x[row, c] * dot_mu[b, h / dot_group, c] in fp32 (the
// LSE correction of K-smoothing, sm_scale * q . mu_K, that row_mu_dot computes in a pass of its own): each thread's
// 16 BPT products in order, then a shuffle tree over the row's threads.
template <typename T, int DT>
__device__ __forceinline__ void quant_rows_body(const T* __restrict__ x, long long sb, long long sh, long long sn,
                                                int n, int d, const float* __restrict__ mu, int mu_group,
                                                unsigned char* __restrict__ codes, unsigned char* __restrict__ scales,
                                                const float* __restrict__ dot_mu, int dot_group, float dot_scale,
                                                float* __restrict__ dot_out, unsigned bx, int h, int b, int H) {
  static_assert(DT == 0 || DT == 64 || DT == 128 || DT == 256, "DT: 0 (run time), 64, 128 or 256");
  constexpr int BPT = DT ? 2 : 1;
  const int D = DT ? DT : d, nblk_row = D / 16, tpr = nblk_row / BPT;  // tpr: threads per row
  const long long t = static_cast<long long>(bx) * blockDim.x + threadIdx.x;
  const bool valid = t < static_cast<long long>(n) * tpr;  // (a row's threads are all valid or all not)
  if (!dot_mu && !valid) return;
  const long long row = valid ? t / tpr : 0;  // (a shift when DT is given)
  const int c0 = static_cast<int>(t % tpr) * 16 * BPT;
  float v[BPT][16];
#pragma unroll
  for (int k = 0; k < BPT; ++k) {
    if (valid) {
      load16(x + b * sb + h * sh + row * sn + c0 + 16 * k, v[k]);
    } else {
#pragma unroll
      for (int i = 0; i < 16; ++i) v[k][i] = 0.f;
    }
  }
  quant_rows_finish<T, DT>(v, valid, row, c0, n, d, mu, mu_group, codes, scales, dot_mu, dot_group, dot_scale,
                           dot_out, h, b, H);
}

template <typename T, int DT>
__global__ void __launch_bounds__(256) nvfp4_quant_rows(const T* __restrict__ x, long long sb, long long sh,
                                                        long long sn, int n, int d, const float* __restrict__ mu,
                                                        int mu_group, unsigned char* __restrict__ codes,
                                                        unsigned char* __restrict__ scales,
                                                        const float* __restrict__ dot_mu, int dot_group,
                                                        float dot_scale, float* __restrict__ dot_out) {
  grid_dep_wait();  // (programmatic dependent launch in nvfp4.attention: the mean's pass before, WAR on the outputs)
  grid_dep_launch_dependents();
  quant_rows_body<T, DT>(x, sb, sh, sn, n, d, mu, mu_group, codes, scales, dot_mu, dot_group, dot_scale, dot_out,
                         blockIdx.x, blockIdx.y, blockIdx.z, gridDim.y);
}

// Q's and K's row quantizers in one launch (nvfp4.attention with SAGECUPY_FP4_PREPASS=fused): blocks [0, gq Hq) are
// nvfp4_quant_rows's blocks of Q (head bx / gq, with the dot: qmk), the rest those of K (head bx / gk, K's mean
// subtracted); each block does exactly what it does there. grid (gq Hq + gk Hkv, 1, B), block 256.
template <typename T, int DT>
__global__ void __launch_bounds__(256) nvfp4_quant_qk_rows(
    const T* __restrict__ q, long long qsb, long long qsh, long long qsn, int nq, int Hq, int gq,
    unsigned char* __restrict__ q_codes, unsigned char* __restrict__ q_scales, const float* __restrict__ dot_mu,
    int dot_group, float dot_scale, float* __restrict__ dot_out, const T* __restrict__ k, long long ksb,
    long long ksh, long long ksn, int nk, int Hkv, int gk, const float* __restrict__ mu,
    unsigned char* __restrict__ k_codes, unsigned char* __restrict__ k_scales, int d) {
  static_assert(DT != 0, "D a compile-time constant");
  grid_dep_wait();  // (K's mean, written by the launch before)
  grid_dep_launch_dependents();
  const int b = blockIdx.z, bx = blockIdx.x, nqb = gq * Hq;
  if (bx < nqb)
    quant_rows_body<T, DT>(q, qsb, qsh, qsn, nq, d, nullptr, 1, q_codes, q_scales, dot_mu, dot_group, dot_scale,
                           dot_out, bx % gq, bx / gq, b, Hq);
  else
    quant_rows_body<T, DT>(k, ksb, ksh, ksn, nk, d, mu, 1, k_codes, k_scales, nullptr, 1, 0.f, nullptr,
                           (bx - nqb) % gk, (bx - nqb) / gk, b, Hkv);
}

// One thread per (channel, 16-token block). grid (ceil(D * N16 / 16 / 256), H, B), block 256.
template <typename T>
__global__ void nvfp4_quant_tokens(const T* __restrict__ x, long long sb, long long sh, long long sn, int n, int d,
                                   int n16, unsigned char* __restrict__ codes, unsigned char* __restrict__ scales) {
  const int h = blockIdx.y, b = blockIdx.z, H = gridDim.y;
  const long long id = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int tblocks = n16 / 16;
  if (id >= static_cast<long long>(d) * tblocks) return;
  const int c = static_cast<int>(id % d), tb = static_cast<int>(id / d);  // neighbouring threads: channels
  const T* src = x + b * sb + h * sh + c;
  float v[16];
#pragma unroll
  for (int i = 0; i < 16; ++i) {
    const int tok = tb * 16 + i;
    v[i] = tok < n ? to_float(src[tok * sn]) : 0.f;
  }
  unsigned packed[2];
  const unsigned sc = nvfp4_block_exact16(v, packed);
  const long long bh = static_cast<long long>(b) * H + h;
  *reinterpret_cast<uint2*>(codes + ((bh * d + c) * n16 + tb * 16) / 2) = make_uint2(packed[0], packed[1]);
  scales[(bh * d + c) * tblocks + tb] = static_cast<unsigned char>(sc);
}

// nvfp4_quant_tokens on a tile of 64 tokens x 128 channels per CTA (128 threads), for 16-byte aligned rows and D a
// multiple of 8: the tile is read with 16-byte loads into shared memory, and each thread quantizes one channel's
// four 16-token blocks and writes its 32 code bytes and 4 scale bytes itself: two 16-byte stores and one 4-byte
// store when N16 is a multiple of 64 (8 one-block stores before, one L2 request each: the L2 was the limit), else
// 8-byte and 1-byte stores per block (rows of N16 / 2 bytes are 8-byte aligned in general).
// (nvfp4_quant_tokens: one thread per block, 16 scalar loads, and the four 8-byte pieces of a sector written by
// four CTAs.) grid (ceil(N16 / 64), H, B), block 128.
using TokenTile = unsigned short[64][128 + 8];  // tokens x channels (+16 bytes: conflict-free rows)

// The quantization half of quant_tokens_tile_body: channels c0 .. c0 + dc - 1 of the tile of 64 tokens from t0 in
// `tile` (tokens >= n zero) -> their codes and scales (thread tid: channel c0 + tid).
template <typename T>
__device__ __forceinline__ void quant_tokens_tile_store(const TokenTile& tile, int tid, int t0, int c0, int dc, int d,
                                                        int n16, long long bh, unsigned char* __restrict__ codes,
                                                        unsigned char* __restrict__ scales) {
  if (tid < dc) {
    const long long row = bh * d + c0 + tid;
    unsigned char* crow = codes + row * (n16 / 2) + t0 / 2;
    unsigned char* srow = scales + row * (n16 / 16) + t0 / 16;
    const int nb = min(4, (n16 - t0) / 16);  // this tile's 16-token blocks
    unsigned packed[4][2], sc[4];
#pragma unroll
    for (int tb = 0; tb < 4; ++tb) {
      float v[16];
#pragma unroll
      for (int i = 0; i < 16; ++i) v[i] = to_float(bits_to<T>(tile[tb * 16 + i][tid]));  // (zeros past n)
      sc[tb] = nvfp4_block_exact16(v, packed[tb]);
    }
    if (nb == 4 && n16 % 64 == 0) {  // whole tile, 16-byte aligned code rows, 4-byte aligned scale rows
      uint4* c4 = reinterpret_cast<uint4*>(crow);
      c4[0] = make_uint4(packed[0][0], packed[0][1], packed[1][0], packed[1][1]);
      c4[1] = make_uint4(packed[2][0], packed[2][1], packed[3][0], packed[3][1]);
      *reinterpret_cast<unsigned*>(srow) = sc[0] | (sc[1] << 8) | (sc[2] << 16) | (sc[3] << 24);
    } else {
#pragma unroll
      for (int tb = 0; tb < 4; ++tb) {
        if (tb >= nb) break;
        *reinterpret_cast<uint2*>(crow + tb * 8) = make_uint2(packed[tb][0], packed[tb][1]);  // (n16 / 2: 8k)
        srow[tb] = static_cast<unsigned char>(sc[tb]);
      }
    }
  }
}

template <typename T>
__device__ __forceinline__ void quant_tokens_tile_body(const T* __restrict__ x, long long sb, long long sh,
                                                       long long sn, int n, int d, int n16,
                                                       unsigned char* __restrict__ codes,
                                                       unsigned char* __restrict__ scales, TokenTile& tile, unsigned bx,
                                                       int h, int b, int H) {
  const int tid = threadIdx.x, t0 = bx * 64;
  const long long bh = static_cast<long long>(b) * H + h;
  const T* src = x + b * sb + h * sh;
  for (int c0 = 0; c0 < d; c0 += 128) {
    const int dc = min(128, d - c0);
#pragma unroll 4
    for (int idx = tid; idx < 64 * 16; idx += 128) {
      const int r = idx >> 4, seg = idx & 15, tok = t0 + r;
      uint4 w = make_uint4(0u, 0u, 0u, 0u);
      if (seg * 8 < dc && tok < n) w = __ldg(reinterpret_cast<const uint4*>(src + tok * sn + c0 + seg * 8));
      *reinterpret_cast<uint4*>(&tile[r][seg * 8]) = w;
    }
    __syncthreads();
    quant_tokens_tile_store<T>(tile, tid, t0, c0, dc, d, n16, bh, codes, scales);
    __syncthreads();
  }
}


template <typename T>
__global__ void __launch_bounds__(128) nvfp4_quant_tokens_tiled(const T* __restrict__ x, long long sb, long long sh,
                                                               long long sn, int n, int d, int n16,
                                                               unsigned char* __restrict__ codes,
                                                               unsigned char* __restrict__ scales) {
  __shared__ __align__(16) TokenTile tile;
  grid_dep_wait();  // (a programmatic dependent launch in nvfp4.attention)
  grid_dep_launch_dependents();
  quant_tokens_tile_body<T>(x, sb, sh, sn, n, d, n16, codes, scales, tile, blockIdx.x, blockIdx.y, blockIdx.z,
                            gridDim.y);
}

// K's float64 column sums of a 64-token tile from this thread's 16-byte loads kw[i] (channels 8 seg .. 8 seg + 7 of
// tokens r0 + R i, tid = r0 LPR + seg): each thread's tokens in order, the R token rows over lanes LPR apart, then the
// four warps' partial sums into red (red[warp][c]; after the __syncthreads here, channel c's tile sum is
// ((red[0][c] + red[1][c]) + red[2][c]) + red[3][c]). 128 threads.
template <typename T, int D>
__device__ __forceinline__ void kpart_tile_sums(const uint4 (&kw)[64 / (128 / (D / 8))], double (&red)[4][D], int tid) {
  constexpr int LPR = D / 8, TPT = 64 / (128 / LPR);
  const int seg = tid % LPR;
  double acc[8];
#pragma unroll
  for (int j = 0; j < 8; ++j) acc[j] = 0.0;
#pragma unroll
  for (int i = 0; i < TPT; ++i) {
    const unsigned u[4] = {kw[i].x, kw[i].y, kw[i].z, kw[i].w};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      acc[2 * j] += static_cast<double>(to_float(bits_to<T>(static_cast<unsigned short>(u[j] & 0xFFFFu))));
      acc[2 * j + 1] += static_cast<double>(to_float(bits_to<T>(static_cast<unsigned short>(u[j] >> 16))));
    }
  }
#pragma unroll
  for (int o = LPR; o < 32; o <<= 1)
#pragma unroll
    for (int j = 0; j < 8; ++j) acc[j] += __shfl_xor_sync(0xffffffffu, acc[j], o);
  if (tid % 32 < LPR)
#pragma unroll
    for (int j = 0; j < 8; ++j) red[tid / 32][seg * 8 + j] = acc[j];
  __syncthreads();
}

// V's tiled quantizer and K's column sums over the same 64 tokens in one CTA (nvfp4.attention with
// SAGECUPY_FP4_PREPASS=fused): the tile's V as nvfp4_quant_tokens_tiled, and part_k[b, h, bx, c] = the sum of
// K[b, h, t, c] over the tile's tokens t < n in float64 (K's mean: nvfp4_kmean_finish). K's 16-byte loads are issued
// first and summed after V's work. A float64 sum of n fp16 values is exact while their binades span at most
// 53 - 11 - log2(n) (27 at 32K tokens; bf16: 30), so the mean is then that of column_partial / column_finish (other
// chunks, another order); beyond, the two sums may differ in their last bits, rarely the float32 mean.
// D = 64 or 128; K's and V's rows 16-byte aligned. grid (ceil(n16 / 64), H, B), block 128.
template <typename T, int D>
__global__ void __launch_bounds__(128, 4) nvfp4_quant_v_kpart(const T* __restrict__ v, long long vsb, long long vsh,
                                                          long long vsn, const T* __restrict__ k, long long ksb,
                                                          long long ksh, long long ksn, int n, int n16,
                                                          unsigned char* __restrict__ codes,
                                                          unsigned char* __restrict__ scales,
                                                          double* __restrict__ part_k) {
  static_assert(D == 64 || D == 128, "head dim 64 or 128");
  constexpr int LPR = D / 8, R = 128 / LPR, TPT = 64 / R;  // threads per token, tokens at once, tokens per thread
  __shared__ __align__(16) TokenTile tile;
  __shared__ double red[4][D];
  grid_dep_wait();
  grid_dep_launch_dependents();
  const int h = blockIdx.y, b = blockIdx.z, H = gridDim.y, tid = threadIdx.x, t0 = blockIdx.x * 64;
  const int seg = tid % LPR, r0 = tid / LPR;  // channels 8 seg .. 8 seg + 7 of tokens t0 + r0 + R i
  uint4 kw[TPT];
  const T* ksrc = k + b * ksb + h * ksh + seg * 8;
#pragma unroll
  for (int i = 0; i < TPT; ++i) {
    const int tok = t0 + r0 + R * i;
    kw[i] = tok < n ? __ldg(reinterpret_cast<const uint4*>(ksrc + tok * ksn)) : make_uint4(0u, 0u, 0u, 0u);
  }
  quant_tokens_tile_body<T>(v, vsb, vsh, vsn, n, D, n16, codes, scales, tile, blockIdx.x, h, b, H);
  kpart_tile_sums<T, D>(kw, red, tid);
  if (tid < D) {
    const long long bh = static_cast<long long>(b) * H + h;
    part_k[(bh * gridDim.x + blockIdx.x) * D + tid] = ((red[0][tid] + red[1][tid]) + red[2][tid]) + red[3][tid];
  }
}

// K's mean from nvfp4_quant_v_kpart's column sums: mu[bh, c] = (the ntile sums in order) / n, float64 rounded to
// float32 (as column_finish). grid (B H), block D.
template <int D>
__global__ void __launch_bounds__(D) nvfp4_kmean_finish(const double* __restrict__ part_k, int ntile, int n,
                                                        float* __restrict__ mu) {
  grid_dep_wait();  // (a programmatic dependent of nvfp4_quant_v_kpart)
  grid_dep_launch_dependents();
  const long long bh = blockIdx.x;
  const int c = threadIdx.x;
  double s = 0.0;
#pragma unroll 8
  for (int t = 0; t < ntile; ++t) s += part_k[(bh * ntile + t) * D + c];
  mu[bh * D + c] = static_cast<float>(s / static_cast<double>(n));
}

// ---- The pipelined pre-pass of nvfp4.attention (SAGECUPY_FP4_PREPASS=pipe) ----
// nvfp4_quant_v_kpart's and nvfp4_quant_qk_rows's work with as many CTAs as are resident at once, each walking the
// pieces (64-token tiles; row chunks) w = blockIdx.x, blockIdx.x + gridDim.x, ... of one flat list over all heads,
// and loading the next piece while it quantizes the current one. With one piece per CTA a thread's loads and its
// quantization ran back to back: Q's quantizer took 44 us at 4K (B 4, H 16, D 128) where its 82 MB alone take ~18 us
// and its ~16 M warp instructions ~17 us. The flat list keeps every CTA within a piece of the others whatever the
// heads, batch and lengths (also Q's few chunks beside K's many when Nq << Nk). Each piece is quantized exactly as
// there (the same functions on the same values): the same codes, scales, qmk and K column sums.

// n / d for 0 <= n < 2^31 and d >= 1 by a multiply and a shift: q = (hi(n m) + n) >> l (the sum < 2^32 for n < 2^31),
// with the round-up multiplier m = floor(2^32 (2^l - d) / d) + 1, l = ceil(log2 d) from the host (nvfp4._fast_div:
// l << 32 | m), so that no thread divides 64-bit numbers. The pieces' indices, once per piece.
struct FastDiv {
  unsigned m, l;
  __device__ __forceinline__ explicit FastDiv(long long ml)
      : m(static_cast<unsigned>(ml)), l(static_cast<unsigned>(ml >> 32)) {}
  __device__ __forceinline__ unsigned div(unsigned n) const { return (__umulhi(n, m) + n) >> l; }
};

// V's tiled quantizer and K's column sums (nvfp4_quant_v_kpart) over the pieces w = (b, h, t) (t fastest: tiles of
// 64 tokens, ntile = ceil(n16 / 64) per head; B H ntile < 2^31): the next piece's V tile goes by cp.async into the
// second of two shared tiles while the current one is quantized; K's loads for the tile are issued first (registers,
// summed after V's work, as there). part_k[b, h, t, c] as there. D = 64 or 128; rows 16-byte aligned.
// grid (min(pieces, 4 per SM)), block 128.
template <typename T, int D>
__global__ void __launch_bounds__(128, 4) nvfp4_quant_v_kpart_pipe(const T* __restrict__ v, long long vsb,
                                                               long long vsh, long long vsn,
                                                               const T* __restrict__ k, long long ksb,
                                                               long long ksh, long long ksn, int n, int n16,
                                                               int ntile, int H, int B, long long div_tile,
                                                               long long div_head,
                                                               unsigned char* __restrict__ codes,
                                                               unsigned char* __restrict__ scales,
                                                               double* __restrict__ part_k) {
  static_assert(D == 64 || D == 128, "head dim 64 or 128");
  constexpr int LPR = D / 8, R = 128 / LPR, TPT = 64 / R;  // threads per token, tokens at once, tokens per thread
  __shared__ __align__(16) TokenTile tiles[2];
  __shared__ double red[4][D];
  static_assert(4 * (sizeof(TokenTile) * 2 + sizeof(double) * 4 * D) <= 227 * 1024, "4 CTAs per SM (the host's)");
  grid_dep_wait();
  grid_dep_launch_dependents();
  const int tid = threadIdx.x, seg = tid % LPR, r0 = tid / LPR;  // K: channels 8 seg .. of tokens t0 + r0 + R i
  const FastDiv by_tile(div_tile), by_head(div_head);  // (/ ntile, / H)
  const int pieces = B * H * ntile;
  // piece w: (batch b, head h, tile t), bh = b H + h
  auto stage = [&](int w, TokenTile& tl) {  // its V tile -> tl (channels >= D never read; tokens >= n zero-filled)
    const int bh = by_tile.div(w), t = w - bh * ntile, b = by_head.div(bh), h = bh - b * H;
    const T* vsrc = v + b * vsb + h * vsh;
#pragma unroll
    for (int j = 0; j < 64 * (D / 8) / 128; ++j) {
      const int idx = tid + 128 * j, r = idx / (D / 8), sg = idx % (D / 8), tok = t * 64 + r;
      const bool ok = tok < n;
      cp_async_16_n(smem_u32(&tl[r][sg * 8]), ok ? vsrc + tok * vsn + sg * 8 : vsrc, ok ? 16 : 0);
    }
  };
  if (static_cast<int>(blockIdx.x) < pieces) stage(blockIdx.x, tiles[0]);
  cp_async_commit();
  int it = 0;
  for (int w = blockIdx.x; w < pieces; w += gridDim.x, ++it) {
    const int bh = by_tile.div(w), t = w - bh * ntile, b = by_head.div(bh), h = bh - b * H, t0 = t * 64;
    const T* ksrc = k + b * ksb + h * ksh + seg * 8;
    uint4 kw[TPT];
#pragma unroll
    for (int i = 0; i < TPT; ++i) {
      const int tok = t0 + r0 + R * i;
      kw[i] = tok < n ? __ldg(reinterpret_cast<const uint4*>(ksrc + tok * ksn)) : make_uint4(0u, 0u, 0u, 0u);
    }
    if (w + static_cast<int>(gridDim.x) < pieces) stage(w + gridDim.x, tiles[(it + 1) & 1]);
    cp_async_commit();
    cp_async_wait<1>();  // this thread's copies of tile t
    __syncthreads();     // everyone's
    quant_tokens_tile_store<T>(tiles[it & 1], tid, t0, 0, D, D, n16, bh, codes, scales);
    kpart_tile_sums<T, D>(kw, red, tid);  // (its __syncthreads: every thread is done with tiles[it & 1] before the
                                          // next stage() refills it)
    if (tid < D)
      part_k[(static_cast<long long>(bh) * ntile + t) * D + tid] =
          ((red[0][tid] + red[1][tid]) + red[2][tid]) + red[3][tid];
  }
  cp_async_wait<0>();
}

// Q's and K's row quantizers (nvfp4_quant_qk_rows) over the pieces w: first Q's (b, h, chunk) (chunk fastest, cq
// chunks per head: 256 threads x two 16-blocks, 64 rows at D = 128; with the dot: qmk), then K's (ck per head; K's
// mean subtracted) from the last to the first: V's kernel before read K's tiles first to last, so the last of them
// may still be in L2 when this one starts (without Q's pieces: SAGECUPY_FP4_QIN). Each thread loads its 64 bytes of the next piece into registers before it quantizes the current
// one. Rows 16-byte aligned; B (Hq cq + Hkv ck) < 2^31 and N D / 32 < 2^31. grid (min(pieces, 3 per SM)), block 256.
template <typename T, int D>
__global__ void __launch_bounds__(256, 3) nvfp4_quant_qk_rows_pipe(
    const T* __restrict__ q, long long qsb, long long qsh, long long qsn, int nq, int Hq,
    unsigned char* __restrict__ q_codes, unsigned char* __restrict__ q_scales, const float* __restrict__ dot_mu,
    int dot_group, float dot_scale, float* __restrict__ dot_out, const T* __restrict__ k, long long ksb,
    long long ksh, long long ksn, int nk, int Hkv, const float* __restrict__ mu, unsigned char* __restrict__ k_codes,
    unsigned char* __restrict__ k_scales, int B, long long div_cq, long long div_ck, long long div_hq,
    long long div_hk) {
  static_assert(D == 64 || D == 128, "head dim 64 or 128");
  constexpr int TPR = D / 32;  // threads per row
  grid_dep_wait();  // (K's mean, written by the launch before)
  grid_dep_launch_dependents();
  const int tid = threadIdx.x, cq = (nq * TPR + 255) / 256, ck = (nk * TPR + 255) / 256;
  const FastDiv by_cq(div_cq), by_ck(div_ck), by_hq(div_hq), by_hk(div_hk);  // (/ cq, / ck, / Hq, / Hkv)
  const int q_pieces = B * Hq * cq, pieces = q_pieces + B * Hkv * ck;
  struct Piece {
    const T* x;     // the head's first row
    long long sn;
    int b, h, n;    // batch, head, rows
    int u;          // this thread's unit: row u / TPR, columns (u % TPR) 32 ..
    bool is_q;
  };
  auto piece = [&](int w) {
    Piece pc;
    pc.is_q = w < q_pieces;
    const int wl = pc.is_q ? w : pieces - 1 - w;  // (K's pieces last to first)
    const int bh = pc.is_q ? by_cq.div(wl) : by_ck.div(wl), chunk = wl - bh * (pc.is_q ? cq : ck);
    pc.b = pc.is_q ? by_hq.div(bh) : by_hk.div(bh);
    pc.h = bh - pc.b * (pc.is_q ? Hq : Hkv);
    pc.n = pc.is_q ? nq : nk;
    pc.x = pc.is_q ? q + pc.b * qsb + pc.h * qsh : k + pc.b * ksb + pc.h * ksh;
    pc.sn = pc.is_q ? qsn : ksn;
    pc.u = chunk * 256 + tid;
    return pc;
  };
  auto load = [&](const Piece& pc, uint4 (&w)[2][2]) {
    const bool ok = pc.u < pc.n * TPR;
    const uint4* src = reinterpret_cast<const uint4*>(pc.x + (ok ? (pc.u / TPR) * pc.sn + (pc.u % TPR) * 32 : 0));
#pragma unroll
    for (int j = 0; j < 4; ++j) w[j / 2][j % 2] = ok ? __ldg(src + j) : make_uint4(0u, 0u, 0u, 0u);
  };
  uint4 raw[2][2];
  if (static_cast<int>(blockIdx.x) < pieces) load(piece(blockIdx.x), raw);
  for (int w = blockIdx.x; w < pieces; w += gridDim.x) {
    const Piece pc = piece(w);
    float vals[2][16];
    unpack16<T>(raw[0], vals[0]);
    unpack16<T>(raw[1], vals[1]);
    if (w + static_cast<int>(gridDim.x) < pieces) load(piece(w + gridDim.x), raw);  // (in flight from here)
    const bool valid = pc.u < pc.n * TPR;  // (a row's threads are all valid or all not)
    const long long row = valid ? pc.u / TPR : 0;
    const int c0 = (pc.u % TPR) * 32;
    if (pc.is_q) {
      if (valid || dot_mu)  // (the dot's shuffles take every thread of a row)
        quant_rows_finish<T, D>(vals, valid, row, c0, nq, D, nullptr, 1, q_codes, q_scales, dot_mu, dot_group,
                                dot_scale, dot_out, pc.h, pc.b, Hq);
    } else if (valid) {
      quant_rows_finish<T, D>(vals, valid, row, c0, nk, D, mu, 1, k_codes, k_scales, nullptr, 1, 0.f, nullptr, pc.h,
                              pc.b, Hkv);
    }
  }
}

// Fake quantization (quantize, then dequantize; SPEC §6) into fp16, for the FP4 QAT kernels. Every NVFP4
// value (at most 6 significant bits in [2^-10, 2688]) is an fp16 value, so the output is exact; so is the same
// value in bf16, which these kernels also write when out_bf16 is not null (the QAT backward's operands for bf16
// inputs: one more store here instead of a conversion pass in the backward). Values by nvfp4_fq8 (fp4.cuh).
//   nvfp4_fq_rows:     x (B, H, N, D) -> out (B, H, n_pad, D), 16-blocks along D (rows >= N untouched). One thread
//                      per half block (8 channels: one 16-byte load and store; lanes 2j and 2j+1 share a block
//                      and exchange their maxima). Rows 16-byte aligned (host-checked); N D / 8 < 2^31.
//                      grid (ceil(N * D / 8 / 256), H, B), block 256.
//   nvfp4_fq_rows_any: the same for any strides, one thread per block; grid (ceil(N * D / 16 / 256), H, B).
//   nvfp4_fq_tokens:   x (B, H, N, D) -> out (B, H, D, n_pad) (V~ transposed), 16-token blocks (tokens >= N are
//                      zeros; columns >= n16 untouched); grid as nvfp4_quant_tokens.
template <typename T>
__global__ void nvfp4_fq_rows(const T* __restrict__ x, long long sb, long long sh, long long sn, int n, int d,
                              int n_pad, __half* __restrict__ out, unsigned short* __restrict__ out_bf16) {
  const int h = blockIdx.y, b = blockIdx.z, H = gridDim.y;
  const int halves = d / 8, i = blockIdx.x * blockDim.x + threadIdx.x;
  const bool ok = i < n * halves;
  const int row = ok ? i / halves : 0, c0 = ok ? (i % halves) * 8 : 0;
  uint4 raw = make_uint4(0u, 0u, 0u, 0u);
  if (ok) raw = __ldg(reinterpret_cast<const uint4*>(x + b * sb + h * sh + row * sn + c0));
  const T* e = reinterpret_cast<const T*>(&raw);
  float v[8], amax = 0.f;
  bool bad = false;
#pragma unroll
  for (int k = 0; k < 8; ++k) {
    v[k] = to_float(e[k]);
    bad |= (v[k] != v[k]);
    amax = fmaxf(amax, fabsf(v[k]));
  }
  amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 1));  // the other half of the block (every lane takes part)
  bad = __shfl_xor_sync(0xffffffffu, static_cast<int>(bad), 1) != 0 || bad;
  if (!ok) return;
  unsigned hv[4];
  nvfp4_fq8(v, nvfp4_fq_scale(amax, bad), hv);
  const long long o = ((static_cast<long long>(b) * H + h) * n_pad + row) * d + c0;
  *reinterpret_cast<uint4*>(out + o) = make_uint4(hv[0], hv[1], hv[2], hv[3]);
  if (out_bf16)
    *reinterpret_cast<uint4*>(out_bf16 + o) = make_uint4(half2_to_bf16x2_exact(hv[0]), half2_to_bf16x2_exact(hv[1]),
                                                         half2_to_bf16x2_exact(hv[2]), half2_to_bf16x2_exact(hv[3]));
}

// 16 fp16 values (8 half2 words) -> two 16-byte stores at dst (and their bf16 bits at dst_bf16 unless null).
__device__ __forceinline__ void store_fq16(__half* dst, unsigned short* dst_bf16, const unsigned (&hv)[8]) {
  uint4* d = reinterpret_cast<uint4*>(dst);
  d[0] = make_uint4(hv[0], hv[1], hv[2], hv[3]);
  d[1] = make_uint4(hv[4], hv[5], hv[6], hv[7]);
  if (dst_bf16) {
    unsigned w[8];
#pragma unroll
    for (int k = 0; k < 8; ++k) w[k] = half2_to_bf16x2_exact(hv[k]);
    uint4* db = reinterpret_cast<uint4*>(dst_bf16);
    db[0] = make_uint4(w[0], w[1], w[2], w[3]);
    db[1] = make_uint4(w[4], w[5], w[6], w[7]);
  }
}

template <typename T>
__global__ void nvfp4_fq_rows_any(const T* __restrict__ x, long long sb, long long sh, long long sn, int n, int d,
                                  int n_pad, __half* __restrict__ out, unsigned short* __restrict__ out_bf16) {
  const int h = blockIdx.y, b = blockIdx.z, H = gridDim.y;
  const long long blk = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int nblk_row = d / 16;
  if (blk >= static_cast<long long>(n) * nblk_row) return;
  const int row = static_cast<int>(blk / nblk_row), c0 = static_cast<int>(blk % nblk_row) * 16;
  const T* src = x + b * sb + h * sh + row * sn + c0;
  float v[16];
#pragma unroll
  for (int i = 0; i < 16; ++i) v[i] = to_float(src[i]);
  unsigned hv[8];
  nvfp4_fq16(v, hv);
  const long long o = ((static_cast<long long>(b) * H + h) * n_pad + row) * d + c0;
  store_fq16(out + o, out_bf16 ? out_bf16 + o : nullptr, hv);
}

template <typename T>
__global__ void nvfp4_fq_tokens(const T* __restrict__ x, long long sb, long long sh, long long sn, int n, int d,
                                int n16, int n_pad, __half* __restrict__ out, unsigned short* __restrict__ out_bf16) {
  const int h = blockIdx.y, b = blockIdx.z, H = gridDim.y;
  const long long id = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int tblocks = n16 / 16;
  if (id >= static_cast<long long>(d) * tblocks) return;
  const int c = static_cast<int>(id % d), tb = static_cast<int>(id / d);
  const T* src = x + b * sb + h * sh + c;
  float v[16];
#pragma unroll
  for (int i = 0; i < 16; ++i) {
    const int tok = tb * 16 + i;
    v[i] = tok < n ? to_float(src[tok * sn]) : 0.f;
  }
  unsigned hv[8];
  nvfp4_fq16(v, hv);
  const long long o = ((static_cast<long long>(b) * H + h) * d + c) * n_pad + tb * 16;
  store_fq16(out + o, out_bf16 ? out_bf16 + o : nullptr, hv);
}

// out[b, h, row] = scale * sum_c x[b, h, row, c] * mu[b, h / mu_group, c] in fp32 (the LSE correction of
// K-smoothing: sm_scale * q . mu_K). One warp per row, lanes over channels, a shuffle tree at the end.
// grid (ceil(N / 8), H, B), block 256.
template <typename T>
__global__ void row_mu_dot(const T* __restrict__ x, long long sb, long long sh, long long sn, int n, int d,
                           const float* __restrict__ mu, int mu_group, float scale, float* __restrict__ out) {
  const int h = blockIdx.y, b = blockIdx.z, H = gridDim.y;
  const int row = blockIdx.x * 8 + threadIdx.x / 32, lane = threadIdx.x % 32;
  if (row >= n) return;
  const T* src = x + b * sb + h * sh + row * sn;
  const float* m = mu + (static_cast<long long>(b) * (H / mu_group) + h / mu_group) * d;
  float acc = 0.f;
  for (int c = lane; c < d; c += 32) acc = fmaf(to_float(src[c]), m[c], acc);
#pragma unroll
  for (int o = 16; o >= 1; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
  if (lane == 0) out[(static_cast<long long>(b) * H + h) * n + row] = acc * scale;
}

// QAT backward: delta[b, h, row] = sum_c dO[b, h, row, c] * O'[b, h, row, c] in fp32 (SPEC §6: O' = P V~,
// fp32 (B, H, n_pad, D) contiguous); 0 for padded rows >= n. One warp per row. grid (n_pad / 8, H, B), block 256.
template <typename T>
__global__ void qat_delta(const T* __restrict__ dout, long long sb, long long sh, long long sn,
                          const float* __restrict__ o_prime, int n, int n_pad, int d, float* __restrict__ out) {
  const int h = blockIdx.y, b = blockIdx.z, H = gridDim.y;
  const int row = blockIdx.x * 8 + threadIdx.x / 32, lane = threadIdx.x % 32;
  if (row >= n_pad) return;
  const long long bh = static_cast<long long>(b) * H + h;
  float acc = 0.f;
  if (row < n) {
    const T* g = dout + b * sb + h * sh + row * sn;
    const float* o = o_prime + (bh * n_pad + row) * d;
    for (int c = lane; c < d; c += 32) acc = fmaf(to_float(g[c]), o[c], acc);
  }
#pragma unroll
  for (int m = 16; m >= 1; m >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, m);
  if (lane == 0) out[bh * n_pad + row] = acc;
}
