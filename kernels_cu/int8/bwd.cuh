// Element-wise steps of the SageBwd backward shared by the mma.sync kernels (int8_attn_bwd.cu) and the
// Hopper wgmma kernels (int8_attn_bwd_sm90.cu): the same float operations in the same order, so the two
// engines differ only where the fp16/bf16 dP product is accumulated by different tensor-core instructions.
// Tiles are 16 x 64 per warp in the accumulator layout of mma.cuh / wgmma.cuh: x[nt][e] is row g + 8(e>>1),
// column 8 nt + 2 t4 + (e&1) of the warp's 16 rows.
#pragma once
#include "common/mma.cuh"
#include "common/numeric.cuh"
#include "common/rows.cuh"
#include "common/tile.cuh"

namespace sage {

constexpr int BWD_BQ = 64, BWD_BKV = 64, BWD_THREADS = 128;

// Max over the CTA (4 warps) of v; every thread gets the result. Uses scratch[4]; two barriers.
__device__ __forceinline__ float cta_max4(float v, float* scratch, int warp, int lane) {
  v = warp_max_xor(v, 1, 16);
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  const float r = nan_max(nan_max(scratch[0], scratch[1]), nan_max(scratch[2], scratch[3]));
  __syncthreads();
  return r;
}

// rint(x[nt][e] * inv[row]) of a 16 x 64 accumulator-layout tile as 8-bit codes (signed or unsigned: the
// low byte either way), packed as m16n8k32 A fragments with columns in the mma-permuted order.
__device__ __forceinline__ void quantize_acc_as_a(unsigned (&a)[2][4], const float (&x)[8][4], const float (&inv)[2]) {
#pragma unroll
  for (int np = 0; np < 4; ++np) {
    unsigned c[2][4];
#pragma unroll
    for (int j = 0; j < 2; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) c[j][e] = rn_fma_bits(x[2 * np + j][e], inv[e >> 1]);
    pack_acc_pair_as_a(a, np, c[0], c[1]);
  }
}

// x (a 16 x 64 accumulator-layout tile) rounded to T, as the A operands a[kk] (k16 chunk kk: columns 16 kk ..
// 16 kk + 15 in their natural order) of a product that contracts over its 64 columns (dV += P^T dO, config
// dv_int8=False).
template <typename T>
__device__ __forceinline__ void pack_acc_as_a16(unsigned (&a)[4][4], const float (&x)[8][4]) {
#pragma unroll
  for (int kk = 0; kk < 4; ++kk)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      a[kk][2 * h] = pack2<T>(x[2 * kk + h][0], x[2 * kk + h][1]);
      a[kk][2 * h + 1] = pack2<T>(x[2 * kk + h][2], x[2 * kk + h][3]);
    }
}

// A 64 x D tile of int8 codes (swizzled D-byte rows, load_tile_async's layout) as bf16 (exact) in a 64 x D tile of
// swizzled 2 D-byte rows (load_rows_async's, which mma_acc_a64 reads): the mma.sync kernels' dK and dQ operands when
// ds_int8=False. Every thread of the CTA takes part; the caller synchronizes before and after.
template <int D>
__device__ __forceinline__ void codes_as_bf16_tile(char* dst, const char* src, int tid) {
  constexpr int CPR = D / 16;  // 16-byte chunks of codes per row
#pragma unroll 2
  for (int i = tid; i < 64 * CPR; i += BWD_THREADS) {
    const int r = i / CPR, c = i % CPR;
    const uint4 w = *reinterpret_cast<const uint4*>(src + swz<D>(r, c));
    *reinterpret_cast<uint4*>(dst + swz<2 * D>(r, 2 * c)) = s8x8_to_bf16(w.x, w.y);
    *reinterpret_cast<uint4*>(dst + swz<2 * D>(r, 2 * c + 1)) = s8x8_to_bf16(w.z, w.w);
  }
}

// Scale of one quantization group: its max over the thread's row (per row: quad max, DS/P per token) or over
// the whole 64 x 64 tile (the CTA), times 1 / (the code range). Returns the scales and the inverses the codes
// are rounded with (0 for a max of 0, NaN or Inf: see below). A NaN max gives s = NaN, an Inf max (an infinite dO
// makes dS ±Inf) s = +Inf: the codes are then integers, and code * s is NaN or ±Inf, never finite.
// s = max * (1 / range) and inv = range * rcp.approx(max), both within two ulps of max / range and range / max, with
// no IEEE division on the loop's critical path (each division compiled to a checked fast path with a branch: 14% of
// the dK/dV kernel's stall samples in a profile; docs/experiments.md). The largest element still maps to `range`:
// max * inv <= range (1 + 2^-21) rounds to range. Limits (CuPy compiles with -ftz=true, so max is never denormal):
// - max < range * 2^-126: range * rcp(max) would overflow to inf (and 0 * inf = NaN bits as a code), so inv is
//   capped at 2^126; the codes are then below `range`, and s = max / range flushes to 0 as the IEEE quotient
//   does, so the group contributes 0 either way.
// - max > 2^126 (~8.5e37; only Y = s_Q dS or X = dS s_K near fp32 overflow, never P <= 1): rcp.approx.ftz(max)
//   would flush to 0 (all-zero codes). The reciprocal is taken of max / 16 and range / 16 multiplies it, which keeps
//   it normal up to FLT_MAX and leaves every other product as it was.
// The codes differ from those of the IEEE quotient and reciprocal only where max / range or x * inv lands within an
// ulp of a rounding boundary; both engines share this function, so they agree bit for bit.
__device__ __forceinline__ void bwd_group_scale(float (&s)[2], float (&inv)[2], const float (&mx)[2], bool per_row,
                                                float range, float inv_range, float* scratch, int warp, int lane) {
  float m[2];
  if (per_row) {
    m[0] = quad_max(mx[0]);
    m[1] = quad_max(mx[1]);
  } else {
    m[0] = m[1] = cta_max4(nan_max(mx[0], mx[1]), scratch, warp, lane);
  }
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    s[r] = m[r] * inv_range;
    // (range / 16) * rcp(max / 16): the same product as range * rcp(max) (both factors scaled by exact powers of
    // two) for max >= 2^-122, and a normal rcp up to fp32's largest max (rcp(max) alone flushes to 0 above 2^126).
    inv[r] = m[r] > 0.f ? fminf((range * 0x1p-4f) * fast_rcp(m[r] * 0x1p-4f), 0x1p126f) : 0.f;  // NaN, 0 -> 0
  }
}

// dK/dV kernel: P^T = exp2(S^T * s_K[key] * s_Q[query] - lse2[query]) masked to 0, and its row (key) maxima.
// sQs, sL: the query tile's q scales and lse2 (shared); q0: the tile's first query; qv[r]: the query rows that see
// this thread's key key_lo + 8 r (Window::rows).
__device__ __forceinline__ void bwd_pt_tile(float (&p)[8][4], float (&pmax)[2], const int* acc_s, const float (&sk)[2],
                                            const float* sQs, const float* sL, int q0, int t4, bool need_mask,
                                            const int2 (&qv)[2]) {
  pmax[0] = pmax[1] = 0.f;
#pragma unroll
  for (int nt = 0; nt < 8; ++nt) {
    const int qc0 = nt * 8 + 2 * t4;
    const float2 qs2 = *reinterpret_cast<const float2*>(sQs + qc0), l2 = *reinterpret_cast<const float2*>(sL + qc0);
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int qi = qc0 + (e & 1);
      float val = fast_exp2(i2f_small(acc_s[4 * nt + e]) * sk[e >> 1] * ((e & 1) ? qs2.y : qs2.x) -
                            ((e & 1) ? l2.y : l2.x));
      if (need_mask) {
        const int qrow = q0 + qi;
        if ((qrow < qv[e >> 1].x) | (qrow > qv[e >> 1].y)) val = 0.f;
      }
      p[nt][e] = val;
      pmax[e >> 1] = nan_max(pmax[e >> 1], val);
    }
  }
}

// dS^T = P^T o (dP^T - delta[query]) in place, columns 8 nt .. 8 nt + 7 (dp: that n-tile's 4 accumulators).
__device__ __forceinline__ void bwd_ds_ntile(float (&p)[4], const float* dp, const float* sDel, int nt, int t4) {
  const float2 d2 = *reinterpret_cast<const float2*>(sDel + nt * 8 + 2 * t4);
#pragma unroll
  for (int e = 0; e < 4; ++e) p[e] *= dp[e] - ((e & 1) ? d2.y : d2.x);
}

// dK/dV kernel: Y = diag(s_Q) dS in place of dS^T, and its row (key) maxima of |Y|.
__device__ __forceinline__ void bwd_y_tile(float (&p)[8][4], float (&ymax)[2], const float* sQs, int t4) {
  ymax[0] = ymax[1] = 0.f;
#pragma unroll
  for (int nt = 0; nt < 8; ++nt) {
    const float2 qs2 = *reinterpret_cast<const float2*>(sQs + nt * 8 + 2 * t4);
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      p[nt][e] *= (e & 1) ? qs2.y : qs2.x;
      ymax[e >> 1] = nan_max(ymax[e >> 1], fabsf(p[nt][e]));
    }
  }
}

// dQ kernel: the per-row operands of this thread's rows r_lo, r_lo + 8 (q scale, lse2, delta of the (b, h)
// row arrays; rows >= nq see no key: lse2 = +inf, delta = 0).
__device__ __forceinline__ void bwd_dq_rows(float (&sq)[2], float (&lse_r)[2], float (&del)[2], const float* qs_bh,
                                            const float* lse2_bh, const float* delta_bh, int r_lo, int nq) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = r_lo + 8 * r;
    sq[r] = qs_bh[row];
    lse_r[r] = row < nq ? lse2_bh[row] : INFINITY;
    del[r] = row < nq ? delta_bh[row] : 0.f;
  }
}

// dQ kernel: P = exp2(S * s_K[key] * s_Q[row] - lse2[row]) masked to 0; skk: the keys' scales (kept for X); rk[r]:
// the keys row r_lo + 8 r sees (Window::row_keys).
__device__ __forceinline__ void bwd_dq_p_tile(float (&p)[8][4], float (&skk)[8][2], const int* acc_s, const float* cKs,
                                              const float (&sq)[2], const float (&lse_r)[2], int k0, int t4,
                                              bool need_mask, const int2 (&rk)[2]) {
#pragma unroll
  for (int nt = 0; nt < 8; ++nt) {
    const int key = k0 + nt * 8 + 2 * t4;
    const float2 sk2 = *reinterpret_cast<const float2*>(cKs + nt * 8 + 2 * t4);
    skk[nt][0] = sk2.x;
    skk[nt][1] = sk2.y;
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      float val = fast_exp2(i2f_small(acc_s[4 * nt + e]) * skk[nt][e & 1] * sq[e >> 1] - lse_r[e >> 1]);
      if (need_mask) {
        const int kk = key + (e & 1);
        if ((kk < rk[e >> 1].x) | (kk > rk[e >> 1].y)) val = 0.f;
      }
      p[nt][e] = val;
    }
  }
}

// dQ kernel: X = dS diag(s_K) in place, and its row maxima of |X|.
__device__ __forceinline__ void bwd_dq_x_tile(float (&p)[8][4], float (&xmax)[2], const float (&skk)[8][2]) {
  xmax[0] = xmax[1] = 0.f;
#pragma unroll
  for (int nt = 0; nt < 8; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      p[nt][e] *= skk[nt][e & 1];
      xmax[e >> 1] = nan_max(xmax[e >> 1], fabsf(p[nt][e]));
    }
}

}  // namespace sage
