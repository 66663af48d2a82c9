// SageBwd forward on Hopper tensor cores (sm_90a only): the same algorithm and operands as
// int8_attn_fwd.cu, with Q.K^T and P.V on wgmma (one m64nNk32 per warpgroup of 4 warps; Q, K and V^T
// read from the swizzled shared tiles through descriptors, P from registers), software-pipelined
// (int8/fwd.cuh). Each stage is copied by one thread with bulk copies from the pre-pass's K/V stage images
// (kv_img: one per 64 keys; kc, vt and ks are not read). Compile with --gpu-architecture=sm_90a.
#include "int8/fwd.cuh"

using namespace sage;

// Dynamic shared memory: (16 * WARPS + (2 or 3 with PV16) * NST * BKV) * D + 4 * NST * BKV bytes + 1024 (alignment):
// a ring of NST = FwdSm90<D, BKV, PV16>::NST stages of K, V and the key scales.
// PV16 (SageBwdConfig.pv_int8=False): P.V in T on the 16-bit V images in `vt` (int8/fwd.cuh); vs is not read.
template <typename T, int D, int WARPS, int BKV, bool PV16>
__global__ void __launch_bounds__(32 * WARPS, (FwdSm90<D, BKV, PV16>::MIN_CTAS))
int8_attn_fwd_sm90(const signed char* __restrict__ qc, const float* __restrict__ qs,
                   const signed char* __restrict__ kc, const float* __restrict__ ks,
                   const signed char* __restrict__ vt, const float* __restrict__ vs,
                   const float* __restrict__ qmk,
                   T* __restrict__ o, long long osb, long long osh, long long osn,
                   float* __restrict__ lse, float* __restrict__ lse2,
                   int Hq, int Hkv, int nq, int nk, int nq_pad, int nk_pad, float p_max, int left, int right,
                   int shift, int v_block, const char* __restrict__ kv_img) {
  int8_attn_fwd_wgmma_impl<T, D, WARPS, BKV, false, PV16>(qc, qs, kc, ks, vt, vs, qmk, o, osb, osh, osn, lse, lse2, Hq,
                                                         Hkv, nq, nk, nq_pad, nk_pad, p_max, left, right, shift,
                                                         v_block, kv_img);
}

// Packed sequences (layout "THD", int8/packed.cuh): grid (padded q rows / 64, Hq, 1); o (total_q, Hq, D) at the given
// strides, lse (Hq, total_q); the pre-pass buffers in the packed padded layout. PV16: the 16-bit V images in v16
// (the packed padded layout's 64-key blocks); null otherwise.
template <typename T, int D, int WARPS, int BKV, bool PV16>
__global__ void __launch_bounds__(32 * WARPS, (FwdSm90<D, BKV, PV16>::MIN_CTAS))
int8_attn_fwd_sm90_packed(const signed char* __restrict__ qc, const float* __restrict__ qs,
                          const float* __restrict__ vs, const float* __restrict__ qmk,
                          T* __restrict__ o, long long osh, long long osn,
                          float* __restrict__ lse, float* __restrict__ lse2,
                          int Hq, int Hkv, float p_max, int left, int right, int v_block,
                          const char* __restrict__ kv_img, const char* __restrict__ v16, const int* __restrict__ meta,
                          int S, int total_q) {
  int8_attn_fwd_wgmma_impl<T, D, WARPS, BKV, true, PV16>(qc, qs, nullptr, nullptr,
                                                         reinterpret_cast<const signed char*>(v16), vs, qmk, o, 0, osh,
                                                         osn, lse, lse2, Hq, Hkv, 0, 0, 0, 0, p_max, left, right, 0,
                                                         v_block, kv_img, meta, S, total_q);
}
