// The element-wise steps of the FP4 QAT backward (SPEC §6), shared by the mma.sync kernels (qat_attn_bwd.cu)
// and the wgmma kernels (qat_attn_bwd_sm90.cu): both hold their 64 x 64 score tiles in the same per-warp
// layout (warp w: rows 16w + g and 16w + g + 8; float acc[nt][e] is row g + 8 (e >> 1), column 8 nt + 2 t4 +
// (e & 1)), so one definition of the masking, of P and fq(P), and of dS serves both engines and their
// results differ only through the fp32 accumulation order inside the tensor cores.
#pragma once
#include "fp4.cuh"
#include "mma.cuh"
#include "numeric.cuh"

namespace sage {

constexpr float QAT_LOG2_X_MAX = 11.392317422778761f, QAT_X_MAX = 2688.f;

// dK/dV kernels (transposed tiles: rows = this warp's 16 keys key_lo, key_lo + 8, columns = 64 queries from q0).
// Masks S^T (raw products) in place and returns, per query column of this thread, the maximum over the warp's
// 16 keys: the 16-key block of fq(P).
__device__ __forceinline__ void qat_mask_colmax(float (&s)[8][4], float (&cmax)[8][2], bool need_mask, int key_lo,
                                                int q0, int t4, int nq, int nk, bool causal, int shift) {
#pragma unroll
  for (int nt = 0; nt < 8; ++nt) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      float v = s[nt][e];  // raw products; scale_log2 is applied inside the exponents (as the forward)
      if (need_mask) {
        const int qrow = q0 + nt * 8 + 2 * t4 + (e & 1), key = key_lo + 8 * (e >> 1);
        if (key >= nk || qrow >= nq || (causal && key > qrow + shift)) v = -INFINITY;
      }
      s[nt][e] = v;
    }
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      // fmaxf: a NaN logit reaches the gradients through P itself
      float c = fmaxf(s[nt][j], s[nt][2 + j]);
      c = fmaxf(c, __shfl_xor_sync(0xffffffffu, c, 4));
      c = fmaxf(c, __shfl_xor_sync(0xffffffffu, c, 8));
      cmax[nt][j] = fmaxf(c, __shfl_xor_sync(0xffffffffu, c, 16));
    }
  }
}

// The per-query values of fq(P) for this key tile, after the warps' column maxima are in sCmax (4 x BQ): thread
// tid < BQ writes sR[tid] = r, the tile's max logit of query tid, and beta = exp2(r - lse2) / 2688 (0 for a query
// that sees no key of the tile) over sCmax[tid]: until the barrier that follows, only this thread reads that slot;
// after it every thread reads beta there (qat_pt_tile's sB), and the next writes to sCmax come after the loop's
// next barrier. Once per query and tile here rather than by every thread for each of its 16 columns inside
// qat_pt_tile (an exp2f and an IEEE division each, with its checked slow path). The same float operations, so
// the same bits with the ptxas of CUDA 13.0 (checked in SASS: FMUL, store, FADD, as before); r - lse2 is not
// written with __fsub_rn, so a compiler that contracted r's product into it would change them.
template <int BQ>
__device__ __forceinline__ void qat_tile_rows(float* sR, float* sCmax, const float* sL, int tid, float scale_log2) {
  if (tid < BQ) {
    const float r = fmaxf(fmaxf(sCmax[tid], sCmax[BQ + tid]), fmaxf(sCmax[2 * BQ + tid], sCmax[3 * BQ + tid])) *
                    scale_log2;
    sR[tid] = r;
    sCmax[tid] = r != -INFINITY ? exp2f(r - sL[tid]) / QAT_X_MAX : 0.f;
  }
}

// P^T = exp2(S^T scale_log2 - lse2) and P_q^T = fq_P(P)^T: per query and 64-key tile, x = 2688 exp2(S - r) with
// r the tile's max logit (sR, as the forward computes it), NVFP4 of x in 16-key blocks, times
// beta = exp2(r - lse2) / 2688 (sB, from qat_tile_rows). P_q^T is packed as the A operand (k = queries) of
// dV += P_q^T dO: accumulator n-tile nt -> A fragment of k16 chunk nt / 2 (a0/a1 from the even tile, a2/a3 from
// the odd one).
template <typename T>
__device__ __forceinline__ void qat_pt_tile(float (&p)[8][4], unsigned (&pa)[4][4], const float (&s)[8][4],
                                            const float (&cmax)[8][2], const float* sR, const float* sB,
                                            const float* sL, int t4, float scale_log2) {
#pragma unroll
  for (int nt = 0; nt < 8; ++nt) {
    float pq[4];
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const int qi = nt * 8 + 2 * t4 + j;
      const float r = sR[qi], l2 = sL[qi];
      const bool seen = r != -INFINITY;
      const float base = seen ? QAT_LOG2_X_MAX - r : 0.f;
      const float beta = sB[qi];
      const float amax = fast_exp2(fmaf(cmax[nt][j], scale_log2, base));
      const float sc = e4m3_block_scale_fast(amax);
      const float inv = rcp_approx(sc);
#pragma unroll
      for (int hi = 0; hi < 2; ++hi) {
        const float sv = s[nt][2 * hi + j];
        const float x = fast_exp2(fmaf(sv, scale_log2, base));
        pq[2 * hi + j] = e2m1_round_nonneg(x * inv) * sc * beta;
        p[nt][2 * hi + j] = fast_exp2(fmaf(sv, scale_log2, -l2));
      }
    }
    const int kk = nt >> 1, hi = nt & 1;
    pa[kk][2 * hi] = pack2<T>(pq[0], pq[1]);
    pa[kk][2 * hi + 1] = pack2<T>(pq[2], pq[3]);
  }
}

// dS^T = P^T o (dP^T - delta), rounded to T as FlashAttention does (fp16 dS can overflow when |dP - delta|
// approaches 65504; bf16 cannot), packed as the A operand (k = queries) of dK += dS^T Q~.
template <typename T>
__device__ __forceinline__ void qat_dst_tile(unsigned (&da)[4][4], const float (&p)[8][4], const float (&dpt)[8][4],
                                             const float* sDel, int t4) {
#pragma unroll
  for (int nt = 0; nt < 8; ++nt) {
    const int qc = nt * 8 + 2 * t4;
    const float d0 = sDel[qc], d1 = sDel[qc + 1];
    const unsigned lo = pack2<T>(p[nt][0] * (dpt[nt][0] - d0), p[nt][1] * (dpt[nt][1] - d1));
    const unsigned hi = pack2<T>(p[nt][2] * (dpt[nt][2] - d0), p[nt][3] * (dpt[nt][3] - d1));
    const int kk = nt >> 1, h2 = nt & 1;
    da[kk][2 * h2] = lo;
    da[kk][2 * h2 + 1] = hi;
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
// lse2) (masked), dS = P o (dP - delta) rounded to T, packed as the A operand (k = keys) of dQ += dS K~.
template <typename T>
__device__ __forceinline__ void qat_ds_tile(unsigned (&da)[4][4], const float (&s)[8][4], const float (&dpv)[8][4],
                                            bool need_mask, int k0, int r_lo, int t4, const float (&l2)[2],
                                            const float (&del)[2], int nq, int nk, bool causal, int shift,
                                            float scale_log2) {
#pragma unroll
  for (int nt = 0; nt < 8; ++nt) {
    float ds[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      float sv = s[nt][e];
      if (need_mask) {
        const int key = k0 + nt * 8 + 2 * t4 + (e & 1), row = r_lo + 8 * (e >> 1);
        if (key >= nk || row >= nq || (causal && key > row + shift)) sv = -INFINITY;
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
