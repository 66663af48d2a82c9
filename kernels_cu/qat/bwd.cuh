// The element-wise steps of the FP4 QAT backward (docs/algorithms.md §6), shared by the mma.sync kernels
// (qat_attn_bwd.cu) and the wgmma kernels (qat_attn_bwd_sm90.cu): both hold their 64 x 64 score tiles in the same
// per-warp layout (warp w: rows 16w + g and 16w + g + 8; float acc[nt][e] is row g + 8 (e >> 1), column 8 nt + 2 t4 +
// (e & 1)), so one definition of the masking, of P and fq(P), and of dS serves both engines and their results differ
// only through the fp32 accumulation order inside the tensor cores.
#pragma once
#include "common/fp4.cuh"
#include "common/mma.cuh"
#include "common/numeric.cuh"
#include "common/rows.cuh"

namespace sage {

constexpr float QAT_LOG2_X_MAX = 11.392317422778761f, QAT_X_MAX = 2688.f;

// dK/dV kernels (transposed tiles: rows = this warp's 16 keys key_lo, key_lo + 8, columns = 64 queries from q0).
// Masks S^T (raw products) in place (need_mask: queries outside window w of each key, shift = nk - nq, rows >= nq,
// keys >= nk; the rows that see key key_lo + 8 r are computed once per key and tile, common/rows.cuh Window::rows, so
// that a masked element costs two compares and a select, and no register is held across the kernel's loop for them)
// and returns, per query column of this thread, the maximum over the warp's 16 keys: the 16-key block of fq(P).
// The maximum propagates NaN (nan_max). With fmaxf (fmaxf(NaN, -inf) = -inf), a query whose visible logits are NaN
// (a NaN row of Q~) beside masked ones would get the block and tile max -inf, which qat_block_scales takes for "sees
// no key of the tile" (beta = 0, a zero block scale): P_q = 6 (E2M1 of NaN) * 0, a silent finite 0 in dV of the keys
// the query sees. Kept, the NaN makes that query's (k, s beta) and its P_q in the tile NaN. For finite and masked
// logits the maxima are fmaxf's: max.NaN differs from max only for a NaN operand, and the logits are never subnormal
// (sums of products of fake-quantized values, multiples of 2^-20), so the ftz build's flush of max's operands has
// nothing to flush.
__device__ __forceinline__ void qat_mask_colmax(float (&s)[8][4], float (&cmax)[8][2], bool need_mask, Window w,
                                                int key_lo, int q0, int t4, int nq, int nk, int shift) {
  const int2 qv[2] = {w.rows(key_lo, shift, nq, nk), w.rows(key_lo + 8, shift, nq, nk)};
#pragma unroll
  for (int nt = 0; nt < 8; ++nt) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      float v = s[nt][e];  // raw products; scale_log2 is applied inside the exponents (as the forward)
      if (need_mask) {
        const int qrow = q0 + nt * 8 + 2 * t4 + (e & 1);
        if ((qrow < qv[e >> 1].x) | (qrow > qv[e >> 1].y)) v = -INFINITY;
      }
      s[nt][e] = v;
    }
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      float c = nan_max(s[nt][j], s[nt][2 + j]);
      c = nan_max(c, __shfl_xor_sync(0xffffffffu, c, 4));
      c = nan_max(c, __shfl_xor_sync(0xffffffffu, c, 8));
      cmax[nt][j] = nan_max(c, __shfl_xor_sync(0xffffffffu, c, 16));
    }
  }
}

// The 16-key blocks of fq(P) for this key tile, after the warps' column maxima are in sCmax (4 x BQ: warp w's
// 16 keys = one block per query), computed once per block here rather than by each of the 8 lanes that hold a
// block's values (that per-column form spent ~300 of ~1200 instructions per warp and tile on it, and most of
// its MUFU and shared-memory latency; docs/experiments.md). Thread tid handles query q = tid % BQ
// and the blocks of warps 2 (tid / BQ) and 2 (tid / BQ) + 1 (THREADS = 2 BQ). Per query: r = the tile's max logit (as the forward
// computes it), beta = exp2(r - lse2) / 2688 (0 for a query that sees no key of the tile). Per block: the E4M3
// scale s of its x = 2688 exp2(S - r) (from the block's max), and sKS[w BQ + q] = (k, s beta) with
// k = 2688 exp2(lse2 - r) / s, so that qat_pq_ds_tile forms x / s = P k from P = exp2(S - lse2) with one product
// instead of a second exponent (x / s within a few ulps of the forward's x (1/s) where it matters -- more, tens of
// ulps, only where lse2 - r is ~100 and the values are ~2^-100: a value within that of an E2M1 midpoint, ~1e-6 of
// them, may round the other way; S^T here already differs from the forward's S by the tensor cores' accumulation
// order), and P_q = E2M1 (s beta) rounds once more than (E2M1 s) beta did for the levels 1.5, 3 and 6 (the last
// fp32 bit, before P_q is rounded to T). A query whose c = 2688 exp2(lse2 - r) overflows (lse2 - r > ~116:
// beta < 2^-127) has its blocks dropped (k = s beta = 0). k = c / s itself can still overflow for a block far below
// r (s < 1); then P k is +inf (or NaN where P = 0), E2M1 saturates it to 6 and s beta is below 2^-126, which the
// kernels' flush-to-zero build (CuPy always compiles with -ftz=true) makes 0, as the old per-column form gave.
// NaN stays NaN: r is the NaN-propagating max of the block maxima (qat_mask_colmax), so a query with a NaN logit in
// the tile has r = NaN, "seen", and NaN beta, c and scales: (k, s beta) NaN for every block, P_q NaN (E2M1 turns a
// NaN into 6; the NaN factor s beta carries it). Only a query that sees no key of the tile (r = -inf) gets 0.
template <int BQ, int THREADS>
__device__ __forceinline__ void qat_block_scales(float2* sKS, const float* sCmax, const float* sL, int tid,
                                                 float scale_log2) {
  static_assert(THREADS == 2 * BQ, "two blocks per thread");
  const int q = tid % BQ, w0 = 2 * (tid / BQ);
  const float r = nan_max(nan_max(sCmax[q], sCmax[BQ + q]), nan_max(sCmax[2 * BQ + q], sCmax[3 * BQ + q])) * scale_log2;
  const float l2 = sL[q];
  const bool seen = r != -INFINITY;
  const float base = seen ? QAT_LOG2_X_MAX - r : 0.f;
  const float beta = seen ? exp2f(r - l2) / QAT_X_MAX : 0.f;
  const float c = seen ? fast_exp2(l2 + base) : 0.f;  // 2688 exp2(lse2 - r); +inf: dropped
  const bool drop = c == INFINITY;
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int w = w0 + i;
    const float amax = fast_exp2(fmaf(sCmax[w * BQ + q], scale_log2, base));
    const float sc = e4m3_block_scale_fast(amax);
    const float inv = rcp_approx(sc);
    sKS[w * BQ + q] = drop ? make_float2(0.f, 0.f) : make_float2(c * inv, sc * beta);
  }
}

// One pass over a warp's 16 keys x 64 queries (transposed tiles, accumulator layout) once S^T and dP^T are both in:
// P^T = exp2(S^T scale_log2 - lse2); P_q^T = fq_P(P)^T: E2M1(P k) (s beta) with the block's (k, s beta) from
// qat_block_scales (sKSw: this warp's row of sKS), packed as the A operand (k = queries) of dV += P_q^T dO; and
// dS^T = P^T o (dP^T - delta), rounded to T as FlashAttention does (fp16 dS can overflow when |dP - delta|
// approaches 65504; bf16 cannot), packed as the A operand of dK += dS^T Q~. Accumulator n-tile nt -> A fragment
// of k16 chunk nt / 2 (a0/a1 from the even tile, a2/a3 from the odd one). S^T and dP^T die as the operands fill.
// VEC: one vector load per two columns (sKSw, sL and sDel then 16-, 8- and 8-byte aligned): the wgmma kernel at
// D = 128 measured 1.02-1.03x with them in three of four cases (1.00x at 16K causal) although ptxas spills 20-24
// bytes there at 255 registers (none without), at D = 64 0.98-0.99x (more live registers, more spills at its 168);
// docs/experiments.md.
template <typename T, bool VEC = false>
__device__ __forceinline__ void qat_pq_ds_tile(unsigned (&pa)[4][4], unsigned (&da)[4][4], const float (&s)[8][4],
                                               const float (&dpt)[8][4], const float2* sKSw, const float* sL,
                                               const float* sDel, int t4, float scale_log2) {
#pragma unroll
  for (int nt = 0; nt < 8; ++nt) {
    float pq[4], ds[4];
    const int qc = nt * 8 + 2 * t4;  // this thread's two query columns qc, qc + 1 (qc is even)
    float4 ks2 = make_float4(0.f, 0.f, 0.f, 0.f);
    float2 l22 = make_float2(0.f, 0.f), d2 = make_float2(0.f, 0.f);
    if constexpr (VEC) {
      ks2 = *reinterpret_cast<const float4*>(sKSw + qc);
      l22 = *reinterpret_cast<const float2*>(sL + qc);
      d2 = *reinterpret_cast<const float2*>(sDel + qc);
    }
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const float2 ks = VEC ? (j == 0 ? make_float2(ks2.x, ks2.y) : make_float2(ks2.z, ks2.w)) : sKSw[qc + j];
      const float l2 = VEC ? (j == 0 ? l22.x : l22.y) : sL[qc + j], d = VEC ? (j == 0 ? d2.x : d2.y) : sDel[qc + j];
#pragma unroll
      for (int hi = 0; hi < 2; ++hi) {
        const int e = 2 * hi + j;
        const float p = fast_exp2(fmaf(s[nt][e], scale_log2, -l2));
        pq[e] = e2m1_round_nonneg(p * ks.x) * ks.y;
        ds[e] = p * (dpt[nt][e] - d);
      }
    }
    const int kk = nt >> 1, h2 = nt & 1;
    pa[kk][2 * h2] = pack2<T>(pq[0], pq[1]);
    pa[kk][2 * h2 + 1] = pack2<T>(pq[2], pq[3]);
    da[kk][2 * h2] = pack2<T>(ds[0], ds[1]);
    da[kk][2 * h2 + 1] = pack2<T>(ds[2], ds[3]);
  }
}

// dQ kernels: the base-2 LSE and delta of this thread's rows r_lo, r_lo + 8 (+inf and 0 beyond nq).
__device__ __forceinline__ void qat_dq_rows(float (&l2)[2], float (&del)[2], const float* __restrict__ lse2_bh,
                                            const float* __restrict__ delta_bh, int r_lo, int nq) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = r_lo + 8 * r;
    l2[r] = row < nq ? lse2_bh[row] : INFINITY;
    del[r] = row < nq ? delta_bh[row] : 0.f;
  }
}

// dQ kernels (rows = this warp's queries r_lo, r_lo + 8, columns = 64 keys from k0): P = exp2(S scale_log2 -
// lse2) (masked: need_mask, the keys outside window w of each row, rows >= nq, keys >= nk; the keys a row sees,
// Window::row_keys, computed per row and tile as qat_mask_colmax's bounds), dS = P o (dP - delta) rounded to T,
// packed as the A operand (k = keys) of dQ += dS K~.
template <typename T>
__device__ __forceinline__ void qat_ds_tile(unsigned (&da)[4][4], const float (&s)[8][4], const float (&dpv)[8][4],
                                            bool need_mask, int k0, int r_lo, int t4, const float (&l2)[2],
                                            const float (&del)[2], Window w, int nq, int nk, int shift,
                                            float scale_log2) {
  const int2 rk[2] = {w.row_keys(r_lo, shift, nq, nk), w.row_keys(r_lo + 8, shift, nq, nk)};
#pragma unroll
  for (int nt = 0; nt < 8; ++nt) {
    float ds[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      float sv = s[nt][e];
      if (need_mask) {
        const int key = k0 + nt * 8 + 2 * t4 + (e & 1);
        if ((key < rk[e >> 1].x) | (key > rk[e >> 1].y)) sv = -INFINITY;
      }
      const float p = fast_exp2(fmaf(sv, scale_log2, -l2[e >> 1]));
      ds[e] = p * (dpv[nt][e] - del[e >> 1]);
    }
    const int kk = nt >> 1, h2 = nt & 1;
    da[kk][2 * h2] = pack2<T>(ds[0], ds[1]);
    da[kk][2 * h2 + 1] = pack2<T>(ds[2], ds[3]);
  }
}

}  // namespace sage
