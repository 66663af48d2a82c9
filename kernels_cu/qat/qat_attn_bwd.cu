// FP4 QAT backward (Attn-QAT-style, docs/algorithms.md §6) on fp16/bf16 tensor cores with fp32 accumulation.
// One CTA = one block of 64 keys, 4 warps x 16 keys; it loops over the query heads of its kv head (GQA:
// dK, dV summed in registers) and over the query tiles of 64 rows that can see its keys. Computed
// transposed (keys as the mma M dimension) so that P^T and dS^T re-pack from accumulators into A operands:
//   S^T   = K~ Q~^T                                  (Q~, K~, V~ = fq(Q), fq(K), fq(V): exact in fp16 and bf16)
//   P^T   = exp2(S^T - lse2)                         the forward's P (logits S = scale_log2 * products)
//   P_q^T = fq_P(P)^T: per query and 64-key tile, x = 2688 exp2(S - r) with r the tile's max logit (as the
//           forward computes it), NVFP4 of x in 16-key blocks (one warp's 16 keys), times
//           beta = exp2(r - lse2) / 2688
//   dP^T  = V~ dO^T
//   dV   += P_q^T dO                (P_q^T and dS^T formed in one pass once S^T and dP^T are in: qat/bwd.cuh)
//   dS^T  = P^T o (dP^T - delta),   delta = rowsum(dO o O')   (pre-computed)
//   dK   += dS^T Q~                 (times sm_scale at the end)
// dQ has its own kernel (qat_attn_bwd_dq, below: one CTA per 64 query rows, recomputing S, P, dP and dS of
// its rows, summing dQ = sm_scale * dS K~ in registers in key order), so nothing here needs atomics and the
// gradients are bitwise repeatable.
// Operands: q (BHq, nq_pad, D), k, v (BHkv, nk_pad, D) in T (zero rows beyond nq / nk); dout (caller strides,
// rows >= nq zero-filled); lse2, delta (BHq, nq_pad). The window (left, right) as the forward's (common/rows.cuh
// Window; causal is (-1, 0)): each kernel visits only the tiles of the other side that its rows or keys see.
#include "qat/bwd.cuh"
#include "common/rows.cuh"
#include "common/tile.cuh"

using namespace sage;

namespace {
constexpr int BQ = 64, BKV = 64, THREADS = 128;
}

template <typename T, int D>
__global__ void __launch_bounds__(THREADS)
qat_attn_bwd(const T* __restrict__ qt, const T* __restrict__ kt, const T* __restrict__ vt,
             const T* __restrict__ dout, long long dsb, long long dsh, long long dsn,
             const float* __restrict__ lse2, const float* __restrict__ delta,
             T* __restrict__ dk, long long ksb, long long ksh, long long ksn,
             T* __restrict__ dv, long long vvb, long long vvh, long long vvn,
             int Hq, int Hkv, int nq, int nk, int nq_pad, int nk_pad, float scale_log2, float sm_scale, int left,
             int right) {
  static_assert(D == 64 || D == 128, "head dim 64 or 128");
  constexpr int ROWB = 2 * D;
  const Window win{left, right};
  extern __shared__ __align__(128) char smem_raw[];
  char* smem = smem_raw + ((128u - (smem_u32(smem_raw) & 127u)) & 127u);  // stays a shared-memory pointer (LDS/STS)
  char* sK = smem;                       // 64 keys x D
  char* sV = sK + BKV * ROWB;            // 64 keys x D
  char* sQ = sV + BKV * ROWB;            // 64 queries x D
  char* sdO = sQ + BQ * ROWB;            // 64 queries x D
  float* sCmax = reinterpret_cast<float*>(sdO + BQ * ROWB);  // 4 warps x 64 queries: max logits
  float2* sKS = reinterpret_cast<float2*>(sCmax + 4 * BQ);   // 4 x 64 blocks of fq(P): (k, s beta)
  float* sL = reinterpret_cast<float*>(sKS + 4 * BQ);        // per query: lse2
  float* sDel = sL + BQ;                 // per query: delta

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, t4 = lane % 4;
  const int kb = blockIdx.x, hk = blockIdx.y, b = blockIdx.z;
  const int group = Hq / Hkv;
  const long long bhk = static_cast<long long>(b) * Hkv + hk;
  const int k0 = kb * BKV, shift = nk - nq;

  load_tile_async<BKV, ROWB, THREADS>(sK, reinterpret_cast<const char*>(kt + (bhk * nk_pad + k0) * D), ROWB, tid);
  load_tile_async<BKV, ROWB, THREADS>(sV, reinterpret_cast<const char*>(vt + (bhk * nk_pad + k0) * D), ROWB, tid);
  cp_async_commit();

  const int key_lo = k0 + warp * 16 + g;  // this thread's keys (accumulator rows): key_lo, key_lo + 8
  float acc_dv[D / 8][4], acc_dk[D / 8][4];
#pragma unroll
  for (int i = 0; i < D / 8; ++i)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc_dv[i][e] = acc_dk[i][e] = 0.f;

  // (head in group, query tile) pairs; none where no row sees the block's keys (the epilogue stores zeros)
  const QueryTiles qtl = query_tiles(k0, BKV, BQ, nq, nk, win, group);
  const int first_qt = qtl.first, n_it_q = qtl.per_head, n_it = qtl.iters;

  for (int it = 0; it < n_it; ++it) {
    const int h = hk * group + it / n_it_q, q0 = (first_qt + it % n_it_q) * BQ;
    const long long bh = static_cast<long long>(b) * Hq + h;
    __syncthreads();  // the previous iteration's readers of sQ, sdO and the per-query arrays are done
    load_tile_async<BQ, ROWB, THREADS>(sQ, reinterpret_cast<const char*>(qt + (bh * nq_pad + q0) * D), ROWB, tid);
    load_rows_async<BQ, ROWB, THREADS>(sdO, reinterpret_cast<const char*>(dout + b * dsb + h * dsh + q0 * dsn),
                                       dsn * 2, nq - q0, tid);
    cp_async_commit();
    if (tid < BQ) {
      const int qrow = q0 + tid;
      sL[tid] = qrow < nq ? lse2[bh * nq_pad + qrow] : INFINITY;
      sDel[tid] = qrow < nq ? delta[bh * nq_pad + qrow] : 0.f;
    }
    cp_async_wait<0>();
    __syncthreads();
    const bool need_mask = win.crosses(q0, BQ, k0, BKV, shift) || (k0 + BKV > nk) || (q0 + BQ > nq);

    // S^T (16 keys x 64 queries per warp), base-2 logits, masked.
    float s[8][4];
#pragma unroll
    for (int i = 0; i < 8; ++i) s[i][0] = s[i][1] = s[i][2] = s[i][3] = 0.f;
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      unsigned a[4];
      ldsm_x4<ROWB, true>(a, sK, warp * 16, 2 * kk, lane);
#pragma unroll
      for (int np = 0; np < 4; ++np) {
        unsigned bq[4];
        ldsm_x4<ROWB, false>(bq, sQ, np * 16, 2 * kk, lane);
        const unsigned b0[2] = {bq[0], bq[1]}, b1[2] = {bq[2], bq[3]};
        mma_f16<T>(s[2 * np], a, b0);
        mma_f16<T>(s[2 * np + 1], a, b1);
      }
    }
    float cmax[8][2];  // per query column: max logit over this warp's 16 keys (= the 16-key block)
    qat_mask_colmax(s, cmax, need_mask, win, key_lo, q0, t4, nq, nk, shift);
    if (g == 0) {
#pragma unroll
      for (int nt = 0; nt < 8; ++nt)
        *reinterpret_cast<float2*>(sCmax + warp * BQ + nt * 8 + 2 * t4) = make_float2(cmax[nt][0], cmax[nt][1]);
    }
    __syncthreads();
    qat_block_scales<BQ, THREADS>(sKS, sCmax, sL, tid, scale_log2);
    __syncthreads();

    // dP^T = V~ dO^T (16 keys x 64 queries per warp)
    float dpt[8][4];
#pragma unroll
    for (int i = 0; i < 8; ++i) dpt[i][0] = dpt[i][1] = dpt[i][2] = dpt[i][3] = 0.f;
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      unsigned a[4];
      ldsm_x4<ROWB, true>(a, sV, warp * 16, 2 * kk, lane);
#pragma unroll
      for (int np = 0; np < 4; ++np) {
        unsigned bo[4];
        ldsm_x4<ROWB, false>(bo, sdO, np * 16, 2 * kk, lane);
        const unsigned b0[2] = {bo[0], bo[1]}, b1[2] = {bo[2], bo[3]};
        mma_f16<T>(dpt[2 * np], a, b0);
        mma_f16<T>(dpt[2 * np + 1], a, b1);
      }
    }
    // P_q^T (A operand of dV) and dS^T = P^T (dP^T - delta) (A operand of dK), per query column.
    unsigned pa[4][4], da[4][4];
    qat_pq_ds_tile<T>(pa, da, s, dpt, sKS + warp * BQ, sL, sDel, t4, scale_log2);

    // dV += P_q^T dO   (B = dO stored [query][d]: transposed ldmatrix)
    mma_acc_a64<T, D>(acc_dv, pa, sdO, lane);
    // dK += dS^T Q~   (B = Q~ stored [query][d]: transposed ldmatrix)
    mma_acc_a64<T, D>(acc_dk, da, sQ, lane);
  }

  // Epilogue: dK * sm_scale, dV, in T with the caller's strides.
  store_acc_rows<T, D>(dk + b * ksb + hk * ksh, ksn, acc_dk, key_lo, t4, nk, sm_scale);
  store_acc_rows<T, D>(dv + b * vvb + hk * vvh, vvn, acc_dv, key_lo, t4, nk, 1.f);
}

// dQ: grid (nq_pad / 64, Hq, B), block 128, dynamic shared memory qat_dq_smem_bytes(D). One CTA = 64 query
// rows (4 warps x 16) looping over the key tiles they see, in key order:
//   S = Q~ K~^T, P = exp2(S * scale_log2 - lse2) (masked), dP = dO V~^T, dS = P o (dP - delta) rounded to T
//   (the operations of qat_attn_bwd), dQ += dS K~, times sm_scale at the end.
template <typename T, int D>
__global__ void __launch_bounds__(THREADS)
qat_attn_bwd_dq(const T* __restrict__ qt, const T* __restrict__ kt, const T* __restrict__ vt,
                const T* __restrict__ dout, long long dsb, long long dsh, long long dsn,
                const float* __restrict__ lse2, const float* __restrict__ delta,
                T* __restrict__ dq, long long qsb, long long qsh, long long qsn,
                int Hq, int Hkv, int nq, int nk, int nq_pad, int nk_pad, float scale_log2, float sm_scale, int left,
                int right) {
  static_assert(D == 64 || D == 128, "head dim 64 or 128");
  constexpr int ROWB = 2 * D, STAGE = 2 * BKV * ROWB;
  const Window win{left, right};
  extern __shared__ __align__(128) char smem_raw[];
  char* smem = smem_raw + ((128u - (smem_u32(smem_raw) & 127u)) & 127u);  // stays a shared-memory pointer (LDS/STS)
  char* sQ = smem;                       // 64 queries x D
  char* sdO = sQ + BQ * ROWB;            // 64 queries x D
  char* sStage = sdO + BQ * ROWB;        // 2 x (K~ 64 keys x D, V~ 64 keys x D)

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, t4 = lane % 4;
  static_assert(BKV == KEY_TILE, "key tiles of 64");
  const QueryBlock qb = query_block(BQ, win.causal_shape(), Hq, Hkv);
  const int q0 = qb.q0, h = qb.h, b = qb.b, shift = nk - nq;
  const long long bh = qb.bh, bhk = qb.bhk;
  const KeyRange tl = key_range(q0, BQ, nq, nk, win);  // tiles tl.first .. tl.n - 1
  const int n_tiles = tl.n;

  // (a tile's stage by its parity: the loads and the loop below agree for any first tile)
  auto load_kv = [&](int tile) {
    char* st = sStage + (tile & 1) * STAGE;
    const long long off = (bhk * nk_pad + tile * BKV) * D;
    load_tile_async<BKV, ROWB, THREADS>(st, reinterpret_cast<const char*>(kt + off), ROWB, tid);
    load_tile_async<BKV, ROWB, THREADS>(st + BKV * ROWB, reinterpret_cast<const char*>(vt + off), ROWB, tid);
  };
  load_tile_async<BQ, ROWB, THREADS>(sQ, reinterpret_cast<const char*>(qt + (bh * nq_pad + q0) * D), ROWB, tid);
  load_rows_async<BQ, ROWB, THREADS>(sdO, reinterpret_cast<const char*>(dout + b * dsb + h * dsh + q0 * dsn),
                                     dsn * 2, nq - q0, tid);
  if (n_tiles > tl.first) load_kv(tl.first);
  cp_async_commit();

  const int r_lo = q0 + warp * 16 + g;  // this thread's rows: r_lo, r_lo + 8
  float l2[2], del[2];
  qat_dq_rows(l2, del, lse2 + bh * nq_pad, delta + bh * nq_pad, r_lo, nq);
  float acc_dq[D / 8][4];
#pragma unroll
  for (int i = 0; i < D / 8; ++i) acc_dq[i][0] = acc_dq[i][1] = acc_dq[i][2] = acc_dq[i][3] = 0.f;

  for (int tile = tl.first; tile < n_tiles; ++tile) {
    cp_async_wait<0>();
    __syncthreads();  // tile resident; every warp is done with the stage the prefetch below overwrites
    if (tile + 1 < n_tiles) load_kv(tile + 1);
    cp_async_commit();
    const char* cK = sStage + (tile & 1) * STAGE;
    const char* cV = cK + BKV * ROWB;
    const int k0 = tile * BKV;
    const bool need_mask = tl.need_mask(tile) || (q0 + BQ > nq);

    // S = Q~ K~^T and dP = dO V~^T (16 rows x 64 keys per warp), fp32 accumulation.
    float s[8][4], dpv[8][4];
#pragma unroll
    for (int i = 0; i < 8; ++i)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[i][e] = dpv[i][e] = 0.f;
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      unsigned aq[4], ao[4];
      ldsm_x4<ROWB, true>(aq, sQ, warp * 16, 2 * kk, lane);
      ldsm_x4<ROWB, true>(ao, sdO, warp * 16, 2 * kk, lane);
#pragma unroll
      for (int np = 0; np < 4; ++np) {
        unsigned bk[4], bv[4];
        ldsm_x4<ROWB, false>(bk, cK, np * 16, 2 * kk, lane);
        ldsm_x4<ROWB, false>(bv, cV, np * 16, 2 * kk, lane);
        const unsigned k0b[2] = {bk[0], bk[1]}, k1b[2] = {bk[2], bk[3]};
        const unsigned v0b[2] = {bv[0], bv[1]}, v1b[2] = {bv[2], bv[3]};
        mma_f16<T>(s[2 * np], aq, k0b);
        mma_f16<T>(s[2 * np + 1], aq, k1b);
        mma_f16<T>(dpv[2 * np], ao, v0b);
        mma_f16<T>(dpv[2 * np + 1], ao, v1b);
      }
    }
    // dS = P o (dP - delta), rounded to T, packed as the A operand of dQ (k = keys).
    unsigned da[4][4];
    qat_ds_tile<T>(da, s, dpv, need_mask, k0, r_lo, t4, l2, del, win, nq, nk, shift, scale_log2);
    // dQ += dS K~   (B = K~ stored [key][d]: transposed ldmatrix)
    mma_acc_a64<T, D>(acc_dq, da, cK, lane);
  }

  // Epilogue: dQ * sm_scale in T with the caller's strides (rows that see no key get 0).
  store_acc_rows<T, D>(dq + b * qsb + h * qsh, qsn, acc_dq, r_lo, t4, nq, sm_scale);
}
