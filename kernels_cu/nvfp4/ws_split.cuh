// The tail split of the warp-specialized NVFP4 forward (nvfp4_attn_fwd_ws_img<..., SPLIT = true> in
// fp4_attn_fwd_sm90.cu): a 1-D grid of whole + (items - whole) nsplit CTAs, items in the plain grid's order (query
// block fastest, then head, then batch; nblk query blocks per head); CTA c < whole runs item c whole, the others part
// (c - whole) % nsplit of item whole + (c - whole) / nsplit, its share of the key tiles the item's rows see (all of
// them, or a window's: common/rows.cuh key_range), so that the items past the
// grid's last full wave do not leave most SMs idle (host: nvfp4._tail_split; H200, 4K: the call 1.468 -> 1.450 ms,
// docs/experiments.md). Parts write fp32 partials to part_ws ((items - whole) nsplit x 4 NC warps x 17 x 32 float4)
// and count on counters ((items - whole) x 4 NC ints, zeroed before the launch); per item and consumer warp, the last
// part to finish combines them. With two-level P each tile's P^ depends only on its own row maxima, so the parts
// quantize P as the whole item does; O and LSE differ from the whole item's by fp32 rounding (the combination's
// weights and sums). Part of fp4_attn_fwd_sm90.cu (included by it only).
#pragma once
#include "common/rows.cuh"
#include "nvfp4/sm90_common.cuh"

namespace {

// Parts an item's keys go to at most (host: nvfp4._SPLIT_MAX, checked by CI) and which item (and part of it) CTA
// blockIdx.x runs.
constexpr int WS_SPLIT_MAX = 4;
struct WsSplit {
  int part, nparts, tail;  // tail: the item's index among the split ones (-1: a whole item)
};
__device__ __forceinline__ QueryBlock ws_split_item(int rows, int Hq, int Hkv, int whole, int nsplit, int nblk,
                                                    WsSplit& sp) {
  const int c = blockIdx.x;
  int it = c;
  if (c >= whole) {
    sp.tail = (c - whole) / nsplit;
    sp.part = c - whole - sp.tail * nsplit;
    sp.nparts = nsplit;
    it = whole + sp.tail;
  }
  const int bhi = it / nblk;
  QueryBlock qb;
  qb.q0 = (it - bhi * nblk) * rows;
  qb.h = bhi % Hq;
  qb.b = bhi / Hq;
  qb.bh = static_cast<long long>(qb.b) * Hq + qb.h;
  qb.bhk = static_cast<long long>(qb.b) * Hkv + qb.h / (Hq / Hkv);
  return qb;
}

// Epilogue of a part (after fp4_frame_finish): this thread's O values normalized by the part's own row sums
// (fp32) and the part's base-2 LSE (m + log2 l; -inf where the row saw no key here) to its slot, 17 float4 with a
// stride of 32 (a warp's stores are 512 contiguous bytes); then per consumer warp a counter shared by the item's
// parts: the warp that counts last reads every part's slot (parts in order, whoever finishes last: deterministic)
// and stores O = sum_p w_p O_p / sum_p w_p, w_p = 2^(lse_p - max_p lse_p), and the LSE (natural log, + qmk as the
// plain epilogue). A part that saw no key for a row has w_p = 0; a NaN anywhere reaches O and LSE as in the plain
// epilogue. Memory order: stores, __threadfence, the counter (lane 0); the last warp: __threadfence, L2 loads.
template <typename T, int D, int NC>
__device__ __forceinline__ void ws_split_epilogue(const float (&acc_o)[D / 8][4], Fp4Rows& rs,
                                                  T* __restrict__ o_bh, long long osn, float* __restrict__ lse_bh,
                                                  const float* __restrict__ qmk_bh, int r_lo, int t4, int nq,
                                                  float* __restrict__ part_ws, int* __restrict__ counters,
                                                  const WsSplit& sp, int cw, int lane) {
  constexpr int NV4 = D / 8 + 1;  // float4 per thread: O's D / 2 values, then the two LSEs
  constexpr int MAXP = WS_SPLIT_MAX;
  float4* ws4 = reinterpret_cast<float4*>(part_ws);
  auto slot = [&](int p) {  // this thread's first float4 in part p's slot
    return ws4 + ((static_cast<long long>(sp.tail) * sp.nparts + p) * (4 * NC) + cw) * (NV4 * 32) + lane;
  };
#pragma unroll
  for (int r = 0; r < 2; ++r) rs.l[r] = quad_sum(rs.l[r]);
  float lse2[2], inv_l[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    lse2[r] = rs.l[r] == 0.f ? -INFINITY : rs.m[r] + log2f(rs.l[r]);
    inv_l[r] = rs.l[r] == 0.f ? 0.f : 1.f / rs.l[r];
  }
  float4* mine = slot(sp.part);
#pragma unroll
  for (int nt = 0; nt < D / 8; ++nt)
    __stcg(mine + 32 * nt, make_float4(acc_o[nt][0] * inv_l[0], acc_o[nt][1] * inv_l[0], acc_o[nt][2] * inv_l[1],
                                       acc_o[nt][3] * inv_l[1]));
  __stcg(mine + 32 * (D / 8), make_float4(lse2[0], lse2[1], 0.f, 0.f));
  __threadfence();
  __syncwarp();
  int prev = 0;
  if (lane == 0) {
    prev = atomicAdd(counters + static_cast<long long>(sp.tail) * (4 * NC) + cw, 1);
    __threadfence();  // (acquire: the other parts' stores before the loads below; then passed on by __syncwarp)
  }
  __syncwarp();
  prev = __shfl_sync(0xffffffffu, prev, 0);
  if (prev != sp.nparts - 1) return;  // (another part combines these rows)
  __threadfence();
  float lp[MAXP][2], top[2] = {-INFINITY, -INFINITY};
#pragma unroll
  for (int p = 0; p < MAXP; ++p) {
    if (p < sp.nparts) {
      const float4 x = __ldcg(slot(p) + 32 * (D / 8));
      lp[p][0] = x.x;
      lp[p][1] = x.y;
      top[0] = fmaxf(top[0], x.x);  // (fmaxf drops a NaN: w_p below carries it)
      top[1] = fmaxf(top[1], x.y);
    }
  }
  float w[MAXP][2], den[2] = {0.f, 0.f};
#pragma unroll
  for (int p = 0; p < MAXP; ++p)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      w[p][r] = p < sp.nparts && lp[p][r] != -INFINITY ? exp2f(lp[p][r] - top[r]) : 0.f;
      den[r] += w[p][r];
    }
  const float inv_den[2] = {den[0] == 0.f ? 0.f : 1.f / den[0], den[1] == 0.f ? 0.f : 1.f / den[1]};
#pragma unroll
  for (int nt = 0; nt < D / 8; ++nt) {
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
    for (int p = 0; p < MAXP; ++p) {
      if (p < sp.nparts) {
        const float4 x = __ldcg(slot(p) + 32 * nt);
        acc.x = fmaf(w[p][0], x.x, acc.x);
        acc.y = fmaf(w[p][0], x.y, acc.y);
        acc.z = fmaf(w[p][1], x.z, acc.z);
        acc.w = fmaf(w[p][1], x.w, acc.w);
      }
    }
    const int col = nt * 8 + 2 * t4;
    if (r_lo < nq)
      *reinterpret_cast<unsigned*>(o_bh + r_lo * osn + col) =
          den[0] == 0.f ? 0u : pack2<T>(acc.x * inv_den[0], acc.y * inv_den[0]);
    if (r_lo + 8 < nq)
      *reinterpret_cast<unsigned*>(o_bh + (r_lo + 8) * osn + col) =
          den[1] == 0.f ? 0u : pack2<T>(acc.z * inv_den[1], acc.w * inv_den[1]);
  }
  if (t4 == 0) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = r_lo + 8 * r;
      if (row < nq)
        lse_bh[row] = den[r] == 0.f ? -INFINITY
                                    : __fadd_rn(__fmul_rn(top[r] + log2f(den[r]), 0.6931471805599453f),
                                                qmk_bh ? qmk_bh[row] : 0.f);
    }
  }
}

}  // namespace
