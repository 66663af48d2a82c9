// FP4 QAT backward (docs/algorithms.md §6) on Hopper tensor cores (sm_90a only): the algorithm, CTA shapes and
// element-wise steps of qat_attn_bwd.cu (see there; the steps are qat/bwd.cuh's, shared), with every product on
// wgmma (fp16/bf16 operands, fp32 accumulation). One CTA = one warpgroup (4 warps, 64 rows of M):
//   dK/dV kernel, per (query head of the kv head, 64-query tile):
//     S^T  = K~ Q~^T        m64n64k16 SS   (K~, Q~ K-major)
//     dP^T = V~ dO^T        m64n64k16 SS   (V~ read M-major from its V~^T tile, dO K-major)
//     dV  += P_q^T dO       m64nDk16 RS    (P_q^T registers; dO read N-major: the same tile)
//     dK  += dS^T Q~        m64nDk16 RS    (dS^T registers; Q~ read N-major)
//   dQ kernel, per 64-key tile: S = Q~ K~^T, dP = dO V~^T (SS; V~^T read N-major), dQ += dS K~ (RS, K~ read
//   N-major).
// Every 16-bit tile is stored once as it lies in memory ([rows][D] in 128-byte pieces, TileCopy<..., true>; V~ as
// the forward saved it, V~^T [D][keys]) and read K-major or MN-major through its descriptor (desc_k16 /
// desc_mn16), so no transposed copy exists. dV, dK and dQ
// accumulate in the wgmma accumulators themselves. Operand tiles are double-buffered with cp.async.
// Every wait is unconditional and no accumulator is touched while its product is in flight (C7514).
// Operands: q (BHq, nq_pad, D), k (BHkv, nk_pad, D), vt = V~^T (BHkv, D, nk_pad) in T (zero beyond nq / nk);
// dout (caller strides, rows >= nq zero-filled); lse2, delta (BHq, nq_pad: +inf and 0 on padded rows). The window
// (left, right) as qat_attn_bwd.cu's.
#include "qat/bwd.cuh"
#include "common/rows.cuh"
#include "common/tile.cuh"
#include "common/wgmma.cuh"

// CTAs per SM the D = 64 dK/dV kernel's registers are budgeted for (__launch_bounds__): three, 168 registers
// (191 -> 168, 76 bytes of spills then; 28 since the one-pass element step of qat/bwd.cuh, which also ended ptxas's
// serialization of the kernel's wgmma, C7512), instead of two: QAT backward 1.11-1.15x end to end on the H200
// (bitwise the same gradients; docs/experiments.md). The D = 64 dQ kernel already fits four (124 registers).
#ifndef SAGE_QAT_BWD_KV_MIN_CTAS
#define SAGE_QAT_BWD_KV_MIN_CTAS 3
#endif

using namespace sage;

namespace {
constexpr int QB_BQ = 64, QB_BKV = 64, QB_THREADS = 128;
}

// S (64 x 64) = A B^T and dP (64 x 64) = C E^T over D: two commit groups. A, B: K-major 64 x D tiles; C, E too,
// except the V~^T tile [D][64 keys], read M-major as C (V_IS_C) or N-major as E.
template <typename T, int D, bool V_IS_C>
__device__ __forceinline__ void qat_issue_s_dp(float (&acc_s)[8][4], float (&acc_dp)[8][4], const char* sA,
                                               const char* sB, const char* sC, const char* sE) {
  wgmma_fence();
#pragma unroll
  for (int ks = 0; ks < D / 16; ++ks)
    wgmma_ss<T>(reinterpret_cast<float(&)[32]>(acc_s), desc_k16<64>(sA, ks), desc_k16<64>(sB, ks), ks);
  wgmma_commit();
#pragma unroll
  for (int ks = 0; ks < D / 16; ++ks)
    wgmma_ss<T, V_IS_C, !V_IS_C>(reinterpret_cast<float(&)[32]>(acc_dp), V_IS_C ? desc_mn16<D>(sC, ks) : desc_k16<64>(sC, ks),
                                 V_IS_C ? desc_k16<64>(sE, ks) : desc_mn16<D>(sE, ks), ks);
  wgmma_commit();
}

// acc (64 x D) += A (64 x 64 in registers, k = the 64 rows of `tile`) * tile (64 x D, read N-major).
template <typename T, int D>
__device__ __forceinline__ void qat_issue_rs(float (&acc)[D / 8][4], const unsigned (&a)[4][4], const char* tile) {
  wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < 4; ++kk) wgmma_rs<T, true>(reinterpret_cast<float(&)[D / 2]>(acc), a[kk], desc_mn16<64>(tile, kk), 1);
  wgmma_commit();
}

// dK/dV: grid (nk_pad / 64, Hkv, B), block 128, dynamic shared memory QatBwdSm90<D>::SMEM (host:
// _qat_bwd.sm90_smem_bytes(D)[0]).
template <int D>
struct QatBwdSm90 {
  // K~ (64 x D), V~^T (D x 64), then two stages of Q~, dO (64 x D each) and lse2, delta (64 fp32 each), then the
  // 4 x 64 per-warp column maxima (fp32) and the 4 x 64 block values of fq(P) (float2).
  static constexpr int TILE = 128 * D;
  static constexpr int STAGE = (2 * TILE + 512 + 1023) / 1024 * 1024;
  static constexpr int SMEM = 1024 + 2 * TILE + 2 * STAGE + 12 * 64 * 4;
};

template <typename T, int D>
__global__ void __launch_bounds__(QB_THREADS, D == 64 ? SAGE_QAT_BWD_KV_MIN_CTAS : 1)
qat_attn_bwd_sm90(const T* __restrict__ qt, const T* __restrict__ kt, const T* __restrict__ vt,
                  const T* __restrict__ dout, long long dsb, long long dsh, long long dsn,
                  const float* __restrict__ lse2, const float* __restrict__ delta,
                  T* __restrict__ dk, long long ksb, long long ksh, long long ksn,
                  T* __restrict__ dv, long long vvb, long long vvh, long long vvn,
                  int Hq, int Hkv, int nq, int nk, int nq_pad, int nk_pad, float scale_log2, float sm_scale,
                  int left, int right) {
  static_assert(D == 64 || D == 128, "head dim 64 or 128");
  using S = QatBwdSm90<D>;
  const Window win{left, right};
  extern __shared__ __align__(128) char smem_raw[];
  char* smem = smem_raw + ((1024u - (smem_u32(smem_raw) & 1023u)) & 1023u);  // wgmma tiles: 1024-byte aligned
  char* sK = smem;
  char* sV = sK + S::TILE;
  char* sStage = sV + S::TILE;
  float* sCmax = reinterpret_cast<float*>(sStage + 2 * S::STAGE);  // 4 warps x 64 queries: column maxima
  float2* sKS = reinterpret_cast<float2*>(sCmax + 4 * QB_BQ);      // 4 x 64 blocks of fq(P): (k, s beta)

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, t4 = lane % 4;
  const int kb = blockIdx.x, hk = blockIdx.y, b = blockIdx.z;
  const int group = Hq / Hkv;
  const long long bhk = static_cast<long long>(b) * Hkv + hk;
  const int k0 = kb * QB_BKV, shift = nk - nq;

  const TileCopy<64, 2 * D, QB_THREADS, true> cp(tid);
  const TileCopy<D, 2 * 64, QB_THREADS, true> cpv(tid);  // V~^T: D rows of 64 keys
  cp.copy(sK, reinterpret_cast<const char*>(kt + (bhk * nk_pad + k0) * D), 2 * D);
  cpv.copy(sV, reinterpret_cast<const char*>(vt + bhk * D * nk_pad + k0), static_cast<long long>(nk_pad) * 2);

  const int key_lo = k0 + warp * 16 + g;  // this thread's keys (accumulator rows): key_lo, key_lo + 8
  float acc_dv[D / 8][4], acc_dk[D / 8][4];
#pragma unroll
  for (int i = 0; i < D / 8; ++i)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc_dv[i][e] = acc_dk[i][e] = 0.f;

  // (head in group, query tile) pairs; none where no row sees the block's keys (the epilogue stores zeros)
  const QueryTiles qtl = query_tiles(k0, QB_BKV, QB_BQ, nq, nk, win, group);
  const int first_qt = qtl.first, n_qt = qtl.n, n_it_q = qtl.per_head, n_it = qtl.iters;
  int ld_h = hk * group, ld_t = first_qt;  // (query head, query tile) of the next stage to load
  auto load_stage = [&](int it) {
    const int qq0 = ld_t * QB_BQ;
    const long long bhh = static_cast<long long>(b) * Hq + ld_h;
    char* st = sStage + (it & 1) * S::STAGE;
    cp.copy(st, reinterpret_cast<const char*>(qt + (bhh * nq_pad + qq0) * D), 2 * D);
    cp.copy_rows(st + S::TILE, reinterpret_cast<const char*>(dout + b * dsb + ld_h * dsh + qq0 * dsn), dsn * 2,
                 nq - qq0);
    float* fb = reinterpret_cast<float*>(st + 2 * S::TILE);
    load_vec_async<QB_THREADS>(fb, lse2 + bhh * nq_pad + qq0, QB_BQ / 4, tid);
    load_vec_async<QB_THREADS>(fb + QB_BQ, delta + bhh * nq_pad + qq0, QB_BQ / 4, tid);
    if (++ld_t == n_qt) {
      ld_t = first_qt;
      ++ld_h;
    }
  };
  if (n_it > 0) load_stage(0);
  cp_async_commit();

  int cur_t = first_qt;  // query tile of iteration it
  for (int it = 0; it < n_it; ++it) {
    const int q0 = cur_t * QB_BQ;
    cur_t = cur_t + 1 == n_qt ? first_qt : cur_t + 1;
    cp_async_wait<0>();
    fence_proxy_async();  // this thread's cp.async writes -> the tensor cores' reads
    __syncthreads();      // stage it resident; every warp is done with stage it - 1 (refilled next) and sKS
    if (it + 1 < n_it) load_stage(it + 1);
    cp_async_commit();
    const char* st = sStage + (it & 1) * S::STAGE;
    const char* sQ = st;
    const char* sdO = st + S::TILE;
    const float* sL = reinterpret_cast<const float*>(st + 2 * S::TILE);
    const float* sDel = sL + QB_BQ;
    const bool need_mask = win.crosses(q0, QB_BQ, k0, QB_BKV, shift) || (k0 + QB_BKV > nk) || (q0 + QB_BQ > nq);

    float acc_s[8][4], acc_dp[8][4];
    qat_issue_s_dp<T, D, true>(acc_s, acc_dp, sK, sQ, sV, sdO);  // S^T = K~ Q~^T, dP^T = V~ dO^T
    wgmma_wait<1>();
    fence_regs(reinterpret_cast<float(&)[32]>(acc_s));
    float cmax[8][2];
    qat_mask_colmax(acc_s, cmax, need_mask, win, key_lo, q0, t4, nq, nk, shift);
    if (g == 0) {
#pragma unroll
      for (int nt = 0; nt < 8; ++nt)
        *reinterpret_cast<float2*>(sCmax + warp * QB_BQ + nt * 8 + 2 * t4) = make_float2(cmax[nt][0], cmax[nt][1]);
    }
    __syncthreads();
    qat_block_scales<QB_BQ, QB_THREADS>(sKS, sCmax, sL, tid, scale_log2);
    __syncthreads();
    wgmma_wait<0>();  // dP^T done
    fence_regs(reinterpret_cast<float(&)[32]>(acc_dp));
    unsigned pa[4][4], da[4][4];
    qat_pq_ds_tile<T, D == 128>(pa, da, acc_s, acc_dp, sKS + warp * QB_BQ, sL, sDel, t4, scale_log2);
    qat_issue_rs<T, D>(acc_dv, pa, sdO);  // dV += P_q^T dO
    qat_issue_rs<T, D>(acc_dk, da, sQ);   // dK += dS^T Q~
    wgmma_wait<0>();
    hold_regs(pa);
    hold_regs(da);
  }
  cp_async_wait<0>();  // (n_it is 0 for a key block that no row of a window sees)
  fence_regs(reinterpret_cast<float(&)[D / 2]>(acc_dv));
  fence_regs(reinterpret_cast<float(&)[D / 2]>(acc_dk));

  // Epilogue: dK * sm_scale, dV, in T with the caller's strides.
  store_acc_rows<T, D>(dk + b * ksb + hk * ksh, ksn, acc_dk, key_lo, t4, nk, sm_scale);
  store_acc_rows<T, D>(dv + b * vvb + hk * vvh, vvn, acc_dv, key_lo, t4, nk, 1.f);
}

// dQ: grid (nq_pad / 64, Hq, B), block 128, dynamic shared memory QatBwdDqSm90<D>::SMEM (host:
// _qat_bwd.sm90_smem_bytes(D)[1]).
template <int D>
struct QatBwdDqSm90 {
  // Q~, dO (64 x D each), then two stages of K~ (64 x D) and V~^T (D x 64).
  static constexpr int TILE = 128 * D;
  static constexpr int SMEM = 1024 + 2 * TILE + 2 * 2 * TILE;
};

template <typename T, int D>
__global__ void __launch_bounds__(QB_THREADS)
qat_attn_bwd_dq_sm90(const T* __restrict__ qt, const T* __restrict__ kt, const T* __restrict__ vt,
                     const T* __restrict__ dout, long long dsb, long long dsh, long long dsn,
                     const float* __restrict__ lse2, const float* __restrict__ delta,
                     T* __restrict__ dq, long long qsb, long long qsh, long long qsn,
                     int Hq, int Hkv, int nq, int nk, int nq_pad, int nk_pad, float scale_log2, float sm_scale,
                     int left, int right) {
  static_assert(D == 64 || D == 128, "head dim 64 or 128");
  static_assert(QB_BKV == KEY_TILE, "key tiles of 64");
  constexpr int TILE = QatBwdDqSm90<D>::TILE;
  const Window win{left, right};
  extern __shared__ __align__(128) char smem_raw[];
  char* smem = smem_raw + ((1024u - (smem_u32(smem_raw) & 1023u)) & 1023u);
  char* sQ = smem;
  char* sdO = sQ + TILE;
  char* sStage = sdO + TILE;  // stage s: K~ at sStage + 2 s TILE, V~^T after it

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, t4 = lane % 4;
  const QueryBlock qb = query_block(QB_BQ, win.causal_shape(), Hq, Hkv);
  const int q0 = qb.q0, h = qb.h, b = qb.b, shift = nk - nq;
  const long long bh = qb.bh, bhk = qb.bhk;
  const KeyRange tl = key_range(q0, QB_BQ, nq, nk, win);  // tiles tl.first .. tl.n - 1

  const TileCopy<64, 2 * D, QB_THREADS, true> cp(tid);
  const TileCopy<D, 2 * 64, QB_THREADS, true> cpv(tid);  // V~^T: D rows of 64 keys
  auto load_kv = [&](int tile) {  // (a tile's stage by its parity: the loads and the loop below agree for any first)
    char* st = sStage + (tile & 1) * 2 * TILE;
    cp.copy(st, reinterpret_cast<const char*>(kt + (bhk * nk_pad + tile * QB_BKV) * D), 2 * D);
    cpv.copy(st + TILE, reinterpret_cast<const char*>(vt + bhk * D * nk_pad + tile * QB_BKV),
             static_cast<long long>(nk_pad) * 2);
  };
  cp.copy(sQ, reinterpret_cast<const char*>(qt + (bh * nq_pad + q0) * D), 2 * D);
  cp.copy_rows(sdO, reinterpret_cast<const char*>(dout + b * dsb + h * dsh + q0 * dsn), dsn * 2, nq - q0);
  if (tl.n > tl.first) load_kv(tl.first);
  cp_async_commit();

  const int r_lo = q0 + warp * 16 + g;  // this thread's rows: r_lo, r_lo + 8
  float l2[2], del[2];
  qat_dq_rows(l2, del, lse2 + bh * nq_pad, delta + bh * nq_pad, r_lo, nq);
  float acc_dq[D / 8][4];
#pragma unroll
  for (int i = 0; i < D / 8; ++i) acc_dq[i][0] = acc_dq[i][1] = acc_dq[i][2] = acc_dq[i][3] = 0.f;

  for (int tile = tl.first; tile < tl.n; ++tile) {
    cp_async_wait<0>();
    fence_proxy_async();
    __syncthreads();  // tile resident; every warp is done with the stage the prefetch below overwrites
    if (tile + 1 < tl.n) load_kv(tile + 1);
    cp_async_commit();
    const char* cK = sStage + (tile & 1) * 2 * TILE;
    const char* cV = cK + TILE;
    const int k0 = tile * QB_BKV;
    const bool need_mask = tl.need_mask(tile) || q0 + QB_BQ > nq;  // both window edges (and the tails)

    float acc_s[8][4], acc_dp[8][4];
    qat_issue_s_dp<T, D, false>(acc_s, acc_dp, sQ, cK, sdO, cV);  // S = Q~ K~^T, dP = dO V~^T
    wgmma_wait<0>();
    fence_regs(reinterpret_cast<float(&)[32]>(acc_s));
    fence_regs(reinterpret_cast<float(&)[32]>(acc_dp));
    unsigned da[4][4];
    qat_ds_tile<T>(da, acc_s, acc_dp, need_mask, k0, r_lo, t4, l2, del, win, nq, nk, shift, scale_log2);
    qat_issue_rs<T, D>(acc_dq, da, cK);  // dQ += dS K~
    wgmma_wait<0>();
    hold_regs(da);
  }
  cp_async_wait<0>();  // a CTA without key tiles still has its Q~, dO copies in flight
  fence_regs(reinterpret_cast<float(&)[D / 2]>(acc_dq));

  // Epilogue: dQ * sm_scale in T with the caller's strides (rows that see no key get 0).
  store_acc_rows<T, D>(dq + b * qsb + h * qsh, qsn, acc_dq, r_lo, t4, nq, sm_scale);
}
