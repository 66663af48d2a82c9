// NVFP4 quantization pre-passes (docs/algorithms.md §5) into the exchange format: packed E2M1 codes (two per byte,
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

// Fake quantization (quantize, then dequantize; docs/algorithms.md §6) into fp16, for the FP4 QAT kernels. Every NVFP4
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

// QAT backward: delta[b, h, row] = sum_c dO[b, h, row, c] * O'[b, h, row, c] in fp32 (docs/algorithms.md §6.2: O' = P V~,
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
