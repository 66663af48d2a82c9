// SageBwd forward (docs/algorithms.md §3): INT8 Q.K^T and P.V on mma.sync m16n8k32 with int32 accumulation,
// FlashAttention-2 structure (one CTA = 64 query rows, 4 warps x 16 rows; KV tiles of BKV = 64 or 128 keys
// (SageBwdConfig.block_kv), cp.async double-buffered), online softmax in base 2, P quantized per
// token per KV tile:
//   P^ = rint(p_max * exp2(S - rowmax_tile(S)))   computed as rint(P~ * factor) with
//   P~ = exp2(S - m_new), factor = p_max * exp2(m_new - rowmax_tile)   (one exp2 per element).
// Inputs are the pre-processed codes of int8_quant.cu:
//   qc (BHq, nq_pad, D) int8 of psi(sm_scale * Q), qs per row (times log2(e): the kernels use exp2);
//   kc (BHkv, nk_pad, D) int8 of psi(K - mu_K), ks per row;
//   vt int8 of psi(V), tokens mma-permuted in 32-groups (numeric.cuh: mma_perm32): (BHkv, nk_pad / 64, D, 64)
//      (tile-major) for BKV = 64, (BHkv, D, nk_pad) for BKV = 128 (int8/fwd.cuh FwdVt);
//   vs: per channel (BHkv, D) or, V_BLOCK, per 64-token block (BHkv, nk_pad / 64, D) (repeated over D).
// Outputs: O in T with caller strides; lse (BHq, nq) natural log of the unsmoothed logits
// (adds qmk = sm_scale * q . mu_K); lse2 (BHq, nq_pad) base-2 LSE of the logits the kernel computed
// (+inf for rows that see no key, so the backward's exp2(S - lse2) is 0 there).
// left, right: the attention window (common/rows.cuh Window; causal is (-1, 0), full attention (-1, -1)). A CTA
// visits only the key tiles its rows see, and masks those that cross an edge of the window for some row.
#include "int8/fwd.cuh"

using namespace sage;

// Only the thread count bounds the registers: a minimum of 2 CTAs per SM measured 4-11% slower at D = 128 (388 bytes
// of spills) and no faster at D = 64 (docs/experiments.md).
// Dynamic shared memory: (16 * WARPS + 2 * stages * BKV) * D + 4 * stages * BKV (key scales) bytes
// + 1024 (alignment); 2 stages here.

template <typename T, int D, int WARPS, int BKV>
__global__ void __launch_bounds__(32 * WARPS)
int8_attn_fwd(const signed char* __restrict__ qc, const float* __restrict__ qs,
              const signed char* __restrict__ kc, const float* __restrict__ ks,
              const signed char* __restrict__ vt, const float* __restrict__ vs,
              const float* __restrict__ qmk,
              T* __restrict__ o, long long osb, long long osh, long long osn,
              float* __restrict__ lse, float* __restrict__ lse2,
              int Hq, int Hkv, int nq, int nk, int nq_pad, int nk_pad, float p_max, int left, int right,
              int shift, int v_block) {
  int8_attn_fwd_impl<T, D, WARPS, BKV>(qc, qs, kc, ks, vt, vs, qmk, o, osb, osh, osn, lse, lse2, Hq, Hkv, nq, nk, nq_pad,
                                  nk_pad, p_max, left, right, shift, v_block);
}

// Packed sequences (layout "THD", int8/packed.cuh): grid (padded q rows / 64, Hq, 1); o (total_q, Hq, D) at the given
// strides, lse (Hq, total_q); the pre-pass buffers in the packed padded layout.
template <typename T, int D, int WARPS, int BKV>
__global__ void __launch_bounds__(32 * WARPS)
int8_attn_fwd_packed(const signed char* __restrict__ qc, const float* __restrict__ qs,
                     const signed char* __restrict__ kc, const float* __restrict__ ks,
                     const signed char* __restrict__ vt, const float* __restrict__ vs,
                     const float* __restrict__ qmk,
                     T* __restrict__ o, long long osh, long long osn,
                     float* __restrict__ lse, float* __restrict__ lse2,
                     int Hq, int Hkv, float p_max, int left, int right, int v_block,
                     const int* __restrict__ meta, int S, int total_q) {
  int8_attn_fwd_impl<T, D, WARPS, BKV, true>(qc, qs, kc, ks, vt, vs, qmk, o, 0, osh, osn, lse, lse2, Hq, Hkv, 0, 0, 0,
                                             0, p_max, left, right, 0, v_block, meta, S, total_q);
}
