// What the wgmma NVFP4 forward's kernels (fp4_attn_fwd_sm90.cu) share: packed operands staged in "tasks" of 64
// elements (4 units of 16: 32 code bytes and 4 E4M3 scale bytes, contiguous in memory), a 64-element piece of one K
// or Q row or one channel of a 64-token V^T tile. A thread copies its tasks' bytes with cp.async into its own
// 16-byte slots of a staging area, waits for its own copies (no barrier: the same thread dequantizes them), and writes
// the exact fp16 values (common/fp4.cuh dequant16_half) as one 128-byte row of a swizzled K-major tile, the layout
// wgmma reads through a descriptor. Also the shared-memory shape of the warp-specialized kernel (NvWs), which the
// K/V stage images (nvfp4/ws_images.cuh) reproduce byte for byte. Part of fp4_attn_fwd_sm90.cu (included by it and
// its headers only).
#pragma once
#include "common/fp4_fwd.cuh"
#include "common/tile.cuh"
#include "common/wgmma.cuh"

using namespace sage;

namespace {

constexpr int BKV = 64;

// Copy one task: 32 code bytes (two 16-byte halves, stored stg_codes / 2 apart) of which the first `code_bytes` are
// valid, 4 scale bytes of which `scale_bytes` (the rest zero-filled: zero scales dequantize to exact zeros). Invalid
// tasks read nothing.
__device__ __forceinline__ void stage_task(char* stg, int task, const unsigned char* codes, const unsigned char* scales,
                                           int code_bytes, int scale_bytes, int stg_codes) {
  const unsigned s = smem_u32(stg + task * 16);  // first halves of all tasks, then the second halves
  cp_async_16_n(s, codes, max(0, min(code_bytes, 16)));
  cp_async_16_n(s + stg_codes / 2, codes + 16, max(0, min(code_bytes - 16, 16)));
  cp_async_4_n(smem_u32(stg + stg_codes + task * 4), scales, max(0, min(scale_bytes, 4)));
}

// A staged task's bytes: the four 16-element units' code words and their scale bytes (sc: unit u in byte u).
struct StagedTask {
  uint2 w[4];
  unsigned sc;
};
__device__ __forceinline__ StagedTask load_task(const char* stg, int task, int stg_codes) {
  const uint4 c0 = *reinterpret_cast<const uint4*>(stg + task * 16);  // (16-byte slots: no bank conflicts)
  const uint4 c1 = *reinterpret_cast<const uint4*>(stg + stg_codes / 2 + task * 16);
  const unsigned sc = *reinterpret_cast<const unsigned*>(stg + stg_codes + task * 4);
  return {{make_uint2(c0.x, c0.y), make_uint2(c0.z, c0.w), make_uint2(c1.x, c1.y), make_uint2(c1.z, c1.w)}, sc};
}

// A task's bytes t (as load_task returns them) dequantized into row `r` of a swizzled 128-byte-row tile (64 fp16
// values).
__device__ __forceinline__ void dequant_staged(char* tile, int r, const StagedTask& t) {
  const uint2(&w)[4] = t.w;
  const unsigned sc = t.sc;
#pragma unroll
  for (int u = 0; u < 4; ++u) {
    unsigned h[8];
    dequant16_half(w[u], (sc >> (8 * u)) & 0xFFu, h);
    *reinterpret_cast<uint4*>(tile + swz<128>(r, 2 * u)) = make_uint4(h[0], h[1], h[2], h[3]);
    *reinterpret_cast<uint4*>(tile + swz<128>(r, 2 * u + 1)) = make_uint4(h[4], h[5], h[6], h[7]);
  }
}

// Dequantize staged task `task` into row `r` of a swizzled 128-byte-row tile (64 fp16 values).
__device__ __forceinline__ void dequant_task(char* tile, int r, const char* stg, int task, int stg_codes) {
  dequant_staged(tile, r, load_task(stg, task, stg_codes));
}

// A 64-token row of V^T (t: its bytes) dequantized into row `r` of a swizzled 128-byte-row tile with its tokens in
// TBLK order (common/fp4_fwd.cuh FP4_TBLK_KEY): 16-byte chunk j holds pair j of each of the four 16-token units
// (column 8 j + 2 u + e is token 16 u + 2 j + e), half the pairs at a time.
__device__ __forceinline__ void dequant_staged_tblk(char* tile, int r, const StagedTask& t) {
  __half2 s64[4];
#pragma unroll
  for (int u = 0; u < 4; ++u) s64[u] = e4m3_scale_x64((t.sc >> (8 * u)) & 0xFFu);
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    unsigned h[4][4];
#pragma unroll
    for (int u = 0; u < 4; ++u) dequant8_half(hh ? t.w[u].y : t.w[u].x, s64[u], h[u]);
#pragma unroll
    for (int jj = 0; jj < 4; ++jj)
      *reinterpret_cast<uint4*>(tile + swz<128>(r, 4 * hh + jj)) = make_uint4(h[0][jj], h[1][jj], h[2][jj], h[3][jj]);
  }
}

// Dequantize staged task `task`, a 64-token row of V^T, as dequant_staged_tblk.
__device__ __forceinline__ void dequant_task_tblk(char* tile, int r, const char* stg, int task, int stg_codes) {
  dequant_staged_tblk(tile, r, load_task(stg, task, stg_codes));
}

// The warp-specialized kernel's shared memory (nvfp4_attn_fwd_ws_img): Q^ of NC consumer warpgroups (64 rows each),
// a ring of NST K^ / V^^T stages, two staging buffers (Q's packed bytes use the first), the mbarriers; + 1024 for
// the tiles' 1024-byte alignment (host: nvfp4.ws_smem_bytes).
template <int D, int NC>
struct NvWs {
  static constexpr int BQ = 64 * NC, THREADS = 128 * (NC + 1), PTHREADS = 128, CTHREADS = 128 * NC;
  static constexpr int NST = 4;  // K/V ring stages
  static constexpr int Q_BYTES = BQ * 2 * D, K_BYTES = BKV * 2 * D, V_BYTES = D * BKV * 2;
  static constexpr int KTASKS = BKV * D / 64, TASKS = KTASKS + D;  // per key tile: K quarter-rows, V channels
  static constexpr int QTASKS = BQ * D / 64;
  static constexpr int NJ = TASKS / PTHREADS;  // tasks per producer thread and tile (2 at D = 128, 1 at 64)
  static constexpr int SLOTS = QTASKS > TASKS ? QTASKS : TASKS;  // per staging buffer
  static constexpr int STG_CODES = 32 * SLOTS, STG = 36 * SLOTS;
  static constexpr int BARS = (2 * NST + 1) * 8;  // full[NST], empty[NST], q_full
  static constexpr int SMEM = Q_BYTES + NST * (K_BYTES + V_BYTES) + 2 * STG + BARS + 1024;
  static_assert(TASKS % PTHREADS == 0 && QTASKS % PTHREADS == 0, "whole tasks per producer thread");
};

}  // namespace
