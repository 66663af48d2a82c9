// K/V stage images of the warp-specialized NVFP4 forward (nvfp4_attn_fwd_ws_img in fp4_attn_fwd_sm90.cu): each
// 64-key tile of K and V dequantized once, into the bytes of the kernel's shared-memory stage, K^ (D / 64 swizzled
// 64 x 128-byte pieces, rows in FP4_TBLK_KEY order) then V^^T (D swizzled 128-byte rows, tokens in that order), one
// WS_IMG_STAGE-byte image per (b, hk, 64-key tile); the kernel's producer copies each tile's image into its ring stage
// with two bulk copies (thread 0). A producer that dequantizes every key tile once per query block did so 22 times
// per head at 4096 rows, ~18% of the kernel's instructions, issue slots its consumers share: on the H200 at B 4, 4K,
// D 128 the images took the kernel from 1.56 to 1.36 ms and the whole call from 1.68 to 1.47 ms (docs/experiments.md).
// Costs: the images (fp16: 4x the packed bytes, scratch per call) and their pass. nvfp4_kv_images writes them from the
// packed K and V (attention_packed), nvfp4_kv_images_raw from the raw ones (attention: in place of K's and V's
// quantizers), the same bytes. Part of fp4_attn_fwd_sm90.cu (included by it only).
#pragma once
#include "nvfp4/sm90_common.cuh"

namespace {

// The producer's task split the images are made with: 128 threads, the consumer count's NvWs (its K_BYTES, STG).
constexpr int WS_IMG_NC = 3;

// The packed bytes of key tile `tile` -> staging buffer `stg` (thread ptid's tasks ptid + j * 128: K tasks first,
// known per j at compile time, then V's). A K task is a 64-element piece of a K row (8 consecutive tasks are 8 rows of
// a piece, conflict-free 16-byte stores); K row r % BKV of the stage holds key FP4_TBLK_KEY(r % BKV) of the tile. A V
// task is one channel of the V^T tile (tokens >= n16 zero).
template <int D>
__device__ __forceinline__ void ws_stage_tile(char* stg, const unsigned char* gkc, const unsigned char* gks,
                                              const unsigned char* gvc, const unsigned char* gvs, int vcs, int tile,
                                              int nk, int n16, int ptid) {
  using S = NvWs<D, WS_IMG_NC>;
#pragma unroll
  for (int j = 0; j < S::NJ; ++j) {
    const int i = ptid + j * S::PTHREADS;
    if ((j + 1) * S::PTHREADS <= S::KTASKS) {
      const int row = i % BKV, piece = i / BKV, key = tile * BKV + FP4_TBLK_KEY(row);
      const bool ok = key < nk;
      const long long off = ok ? static_cast<long long>(key) * (D / 2) + piece * 32 : 0;
      stage_task(stg, i, gkc + off, gks + (ok ? static_cast<long long>(key) * (D / 16) + piece * 4 : 0), ok ? 32 : 0,
                 ok ? 4 : 0, S::STG_CODES);
    } else {
      const int ch = i - S::KTASKS, toks = n16 - tile * BKV;  // tokens of this tile that exist (may be <= 0)
      stage_task(stg, i, gvc + static_cast<long long>(ch) * vcs + tile * 32,
                 gvs + static_cast<long long>(ch) * (vcs / 8) + tile * 4, toks / 2, toks / 16, S::STG_CODES);
    }
  }
}

// This thread's staged tasks (as ws_stage_tile) dequantized into the stage (sKst, sVst): V^^T's tokens in
// FP4_TBLK_KEY order.
template <int D>
__device__ __forceinline__ void ws_dequant_tile(char* sKst, char* sVst, const char* stg, int ptid) {
  using S = NvWs<D, WS_IMG_NC>;
#pragma unroll
  for (int j = 0; j < S::NJ; ++j) {
    const int i = ptid + j * S::PTHREADS;
    if ((j + 1) * S::PTHREADS <= S::KTASKS)
      dequant_task(sKst + (i / BKV) * BKV * 128, i % BKV, stg, i, S::STG_CODES);
    else
      dequant_task_tblk(sVst, i - BKV * D / 64, stg, i, S::STG_CODES);
  }
}

template <int D>
constexpr int WS_IMG_STAGE = BKV * 2 * D + D * BKV * 2;

// Grid (ceil(nk / 64), Hkv, B), block 128 (the producer's thread count: its task split). Arguments as the
// warp-specialized kernel's K/V ones (V^T rows padded to whole 64-token tiles, vcs code bytes each); img: (B, Hkv,
// ceil(nk / 64)) images of WS_IMG_STAGE<D> bytes.
template <int D>
__global__ void __launch_bounds__(128) nvfp4_kv_images(const unsigned char* __restrict__ kc,
                                                       const unsigned char* __restrict__ ks,
                                                       const unsigned char* __restrict__ vc,
                                                       const unsigned char* __restrict__ vs, int vcs, int nk, int n16,
                                                       unsigned char* __restrict__ img) {
  using S = NvWs<D, WS_IMG_NC>;
  static_assert(S::PTHREADS == 128 && S::KTASKS % S::PTHREADS == 0, "the producer's task split (D = 128)");
  __shared__ __align__(16) char sm[WS_IMG_STAGE<D> + S::STG];
  grid_dep_wait();  // (the pre-pass's K and V: nothing global is touched before this)
  grid_dep_launch_dependents();
  const int tile = blockIdx.x, ptid = threadIdx.x;
  const long long bhk = static_cast<long long>(blockIdx.z) * gridDim.y + blockIdx.y;
  char* stg = sm + WS_IMG_STAGE<D>;
  ws_stage_tile<D>(stg, kc + bhk * nk * (D / 2), ks + bhk * nk * (D / 16), vc + bhk * D * vcs,
                   vs + bhk * D * (vcs / 8), vcs, tile, nk, n16, ptid);
  cp_async_commit();
  cp_async_wait<0>();  // (this thread's own slots: it dequantizes them)
  asm volatile("" ::: "memory");
  ws_dequant_tile<D>(sm, sm + S::K_BYTES, stg, ptid);
  __syncthreads();
  uint4* dst = reinterpret_cast<uint4*>(img + (bhk * gridDim.x + tile) * static_cast<long long>(WS_IMG_STAGE<D>));
#pragma unroll 4
  for (int i = ptid; i < WS_IMG_STAGE<D> / 16; i += 128) dst[i] = reinterpret_cast<const uint4*>(sm)[i];
}

// Shared-memory layout of nvfp4_kv_images_raw: the image (K^ then V^^T), then the 64-token V tile (rows of D + 8
// 16-bit values: conflict-free column reads), then K's mean (D floats).
template <int D>
using KvTile = unsigned short[64][D + 8];

// The images straight from the raw K and V (nvfp4.attention): K's and V's pre-pass quantizers, their packed bytes and
// nvfp4_kv_images in one pass. Each 16-block is quantized by the function the pre-pass applies to it (K: its mean
// subtracted in fp32, then nvfp4_block_cmp, as nvfp4_quant_rows with mu; without a mean nvfp4_block_exact16; V:
// nvfp4_block_exact16 on the 64-token tile as nvfp4_quant_tokens_tiled reads it, tokens >= nk zero), and the codes and
// scale bytes, in a thread's registers exactly as ws_stage_tile would stage them (K keys >= nk and V blocks past n16:
// zero bytes, as its zero-filled copies), are dequantized by ws_dequant_tile's functions: the images of nvfp4_kv_images
// on the pre-pass's outputs, bit for bit. Thread i: K's task i (row i % 64 of piece i / 64), then V^T's channel i. k,
// v: (B, Hkv, nk, D) at element strides (rows 16-byte aligned); mu: K's mean (B, Hkv, D) fp32 or null. Grid (ceil(nk /
// 64), Hkv, B), block 128, dynamic shared memory WS_IMG_RAW_SMEM<D>.
template <int D>
constexpr int WS_IMG_RAW_SMEM = WS_IMG_STAGE<D> + 64 * (D + 8) * 2 + D * 4;

// nvfp4_kv_images_raw's pieces. A thread's K task of a tile: row tid % 64 of piece tid / 64, 64 elements as 8 x 16
// bytes (keys >= nk zero), into registers.
template <typename T, int D>
__device__ __forceinline__ void kv_raw_load_k(uint4 (&kw)[4][2], const T* __restrict__ k_bh, long long ksn, int nk,
                                              int tile, int tid) {
  const int row = tid % 64, piece = tid / 64, key = tile * 64 + FP4_TBLK_KEY(row);
  const uint4* src = reinterpret_cast<const uint4*>(k_bh + (key < nk ? key : 0) * ksn + piece * 64);
#pragma unroll
  for (int i = 0; i < 8; ++i) kw[i / 2][i % 2] = key < nk ? __ldg(src + i) : make_uint4(0u, 0u, 0u, 0u);
}

// One tile's image (every thread of the CTA): with the tile's V in shared memory vt (this thread's share written, not
// yet synchronized) and K's task in registers kw: K's mean of channel tid to shared memory, a barrier, then K's task
// and V^T's channel tid quantized by the pre-pass's functions and dequantized by ws_dequant_tile's into the image in
// shared memory, a barrier, the image stored to img_t (coalesced). The next call's first barrier orders its writes of
// the image after this call's reads of it.
template <typename T, int D>
__device__ __forceinline__ void kv_raw_image(const uint4 (&kw)[4][2], const KvTile<D>& vt, float mu_c, char* sm,
                                             float* smu, bool smooth, int nk, int n16, int tile, int tid,
                                             unsigned char* __restrict__ img_t) {
  using S = NvWs<D, WS_IMG_NC>;
  char* sK = sm;               // K^ (D / 64 pieces x 64 rows x 128 B)
  char* sV = sm + S::K_BYTES;  // V^^T (D rows x 128 B)
  smu[tid] = mu_c;  // (D = 128 threads: one channel each)
  __syncthreads();
  {  // K's task tid (values as nvfp4_quant_rows's 16-byte loads give them)
    const int row = tid % 64, piece = tid / 64, key = tile * 64 + FP4_TBLK_KEY(row);
    StagedTask t = {{make_uint2(0u, 0u), make_uint2(0u, 0u), make_uint2(0u, 0u), make_uint2(0u, 0u)}, 0u};
    if (key < nk) {
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        float x[16];
        unsigned packed[2], sc;
        unpack16<T>(kw[u], x);
        if (smooth) {
#pragma unroll
          for (int i = 0; i < 16; ++i) x[i] -= smu[piece * 64 + 16 * u + i];
          sc = nvfp4_block_cmp(x, packed);
        } else {
          sc = nvfp4_block_exact16(x, packed);
        }
        t.w[u] = make_uint2(packed[0], packed[1]);
        t.sc |= sc << (8 * u);
      }
    }
    dequant_staged(sK + piece * 64 * 128, row, t);
  }
  {  // V^T's channel tid: the tile's 16-token blocks below n16
    const int nb = min(4, (n16 - tile * 64) / 16);
    StagedTask t = {{make_uint2(0u, 0u), make_uint2(0u, 0u), make_uint2(0u, 0u), make_uint2(0u, 0u)}, 0u};
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      if (u < nb) {
        float x[16];
        unsigned packed[2];
#pragma unroll
        for (int i = 0; i < 16; ++i) x[i] = to_float(bits_to<T>(vt[16 * u + i][tid]));
        const unsigned sc = nvfp4_block_exact16(x, packed);
        t.w[u] = make_uint2(packed[0], packed[1]);
        t.sc |= sc << (8 * u);
      }
    }
    dequant_staged_tblk(sV, tid, t);
  }
  __syncthreads();
  uint4* dst = reinterpret_cast<uint4*>(img_t);
#pragma unroll 4
  for (int i = tid; i < WS_IMG_STAGE<D> / 16; i += 128) dst[i] = reinterpret_cast<const uint4*>(sm)[i];
}

template <typename T, int D>
__global__ void __launch_bounds__(128) nvfp4_kv_images_raw(const T* __restrict__ k, long long ksb, long long ksh,
                                                           long long ksn, const float* __restrict__ mu,
                                                           const T* __restrict__ v, long long vsb, long long vsh,
                                                           long long vsn, int nk, int n16,
                                                           unsigned char* __restrict__ img) {
  static_assert(D == 128, "one K task and one V^T channel per thread (the producer's split at D = 128)");
  extern __shared__ __align__(16) char sm[];
  KvTile<D>& vt = *reinterpret_cast<KvTile<D>*>(sm + WS_IMG_STAGE<D>);
  float* smu = reinterpret_cast<float*>(sm + WS_IMG_STAGE<D> + sizeof(KvTile<D>));
  grid_dep_wait();  // (the mean's pass before; nothing global is touched before this)
  grid_dep_launch_dependents();
  const int tile = blockIdx.x, tid = threadIdx.x, h = blockIdx.y, b = blockIdx.z;
  const long long bhk = static_cast<long long>(b) * gridDim.y + h;
  // Every load first: K's task, V's tile (8 x 16 bytes per thread; tokens >= nk zero), the mean.
  uint4 kw[4][2];
  kv_raw_load_k<T, D>(kw, k + b * ksb + h * ksh, ksn, nk, tile, tid);
  const T* vsrc = v + b * vsb + h * vsh;
  uint4 vw[64 * (D / 8) / 128];
#pragma unroll
  for (int j = 0; j < 64 * (D / 8) / 128; ++j) {
    const int idx = tid + 128 * j, r = idx / (D / 8), seg = idx % (D / 8), tok = tile * 64 + r;
    vw[j] = tok < nk ? __ldg(reinterpret_cast<const uint4*>(vsrc + tok * vsn + seg * 8)) : make_uint4(0u, 0u, 0u, 0u);
  }
  const float mu_c = mu ? __ldg(mu + bhk * D + tid) : 0.f;
#pragma unroll
  for (int j = 0; j < 64 * (D / 8) / 128; ++j) {
    const int idx = tid + 128 * j;
    *reinterpret_cast<uint4*>(&vt[idx / (D / 8)][(idx % (D / 8)) * 8]) = vw[j];
  }
  kv_raw_image<T, D>(kw, vt, mu_c, sm, smu, mu != nullptr, nk, n16, tile, tid,
                     img + (bhk * gridDim.x + tile) * static_cast<long long>(WS_IMG_STAGE<D>));
}

}  // namespace
