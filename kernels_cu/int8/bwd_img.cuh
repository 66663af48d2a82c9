// Stage images of the wgmma kernels (int8_attn_bwd_sm90.cu, and the forward's K/V: int8/fwd.cuh): each 64-token
// tile's operands laid out in global memory exactly as one stage of the kernel's shared memory (swizzled tiles, then
// the tile's fp32 vectors), so that one thread copies a stage with one bulk copy (cp.async.bulk + mbarrier) instead
// of every thread issuing ~20 cp.async with their addressing: that code was ~15% of both kernels' instructions
// (docs/experiments.md). The pre-passes (int8_quant.cu: bwd_qk_images, bwd_do_image, fwd_v_image, quant_qkv, and
// quant_rows_body's K rows) write them.
#pragma once
#include "common/tile.cuh"

namespace sage {

template <int D, bool DS16 = false>
struct BwdImg {
  // Query side, per (b, h, 64-query tile), the dK/dV kernel's stage: Q^ (64 x D codes, swizzled D-byte rows) | dO
  // (64 x D 16-bit, K-major 128-byte pieces) | Q^^T and dO^^T (D x 64 codes, queries mma-permuted, swizzled 64-byte
  // rows) | q scales, lse2, delta (64 fp32 each) | the tile's dO scales (D fp32). DS16 (config ds_int8=False, which
  // needs dv_int8=False): Q^'s codes as bf16 (64 x D, laid out as dO) in the 128 D bytes of Q^^T and dO^^T (Q_Q16),
  // which that config does not read, and the dO scales zero.
  static constexpr int Q_Q = 0, Q_DO = 64 * D, Q_QT = 192 * D, Q_Q16 = Q_QT, Q_DOT = 256 * D, Q_QS = 320 * D,
                       Q_LSE = Q_QS + 256, Q_DELTA = Q_QS + 512, Q_DOS = Q_QS + 768, Q_STAGE = Q_DOS + 4 * D;
  // Key side, per (b, hk, 64-key tile), the dQ kernel's stage: K^ | K^^T (D x 64, keys mma-permuted), or with DS16
  // K^'s codes as bf16 (64 x D, laid out as V: K_K16) | V (16-bit, K-major 128-byte pieces; rows beyond nk zero) |
  // key scales (64 fp32).
  static constexpr int K_K = 0, K_KT = 64 * D, K_K16 = 64 * D, K_V = (DS16 ? 192 : 128) * D, K_KS = K_V + 128 * D,
                       K_STAGE = K_KS + 256;
};

// The wgmma forward's K/V stage, per (b, hk, 64-key tile) (block_kv = 64): K^ (64 x D codes, swizzled D-byte rows) |
// V^^T (D x 64 codes, keys mma-permuted, swizzled 64-byte rows) | key scales (64 fp32). The kernel keeps K, V and
// the scales in three rings, so one stage is three bulk copies from one image.
template <int D>
struct FwdImg {
  static constexpr int K = 0, VT = 64 * D, KS = 128 * D, STAGE = KS + 256;
};

// Byte offset of 16-byte chunk c of row r in a 64-row 16-bit operand stored K-major in 128-byte pieces (the
// layout of TileCopy<64, 2 D, ..., true>: piece c / 8 is its own swizzled 64 x 128-byte tile).
__device__ __forceinline__ int k128_offset(int r, int c) { return (c / 8) * 64 * 128 + swz<128>(r, c % 8); }

}  // namespace sage
