// SageBwd backward (docs/algorithms.md §4), two kernels that share no state, so neither needs atomics and all three
// gradients are bitwise repeatable:
//
// int8_attn_bwd (dK, dV): one CTA = one KV block of 64 keys, 4 warps x 16 keys; it loops over the query
// heads of its kv head (GQA: dK, dV summed in registers) and over the query tiles of 64 rows that can see
// its keys. Everything is computed transposed (keys as the mma M dimension), so P^T and dS^T re-pack from
// accumulators into A operands for dV and dK directly:
//   S^T  = K^ Q^^T                  INT8 (s8 x s8)
//   P^T  = exp2(S^T - lse2)         fp32;  P^ = psi(P) per key (P_COL) or per tile, on [0, p_max]
//   dV  += P^^T dO^                 INT8 (u8 x s8), dO^ transposed + mma-permuted (int8_quant.cu); or, with DV16
//                                   (config dv_int8=False), dV += P^T dO in fp16/bf16 (P rounded to it)
//   dP^T = V dO^T                   fp16/bf16 mma, fp32 accumulation (never quantized)
//   dS^T = P^T o (dP^T - delta)     fp32
//   dK  += Y^^T Q^ ,  Y = diag(s_Q) dS quantized per key (DS_ROWCOL) or per tile     INT8; or, with DS16 (config
//                                   ds_int8=False), dK += Y^T Q^ in bf16 (Y rounded to it, Q^'s codes converted,
//                                   exactly, into a bf16 tile in shared memory each iteration)
//
// int8_attn_bwd_dq (dQ): one CTA = 64 query rows, 4 warps x 16 rows, looping over the KV tiles its rows
// see in key order (dQ summed in registers). It recomputes S, P, dP, dS of its rows:
//   S = Q^ K^^T, P = exp2(S - lse2), dP = dO V^T, dS = P o (dP - delta)   (the same operations as above)
//   dQ += X^ K^ * s_X * sm_scale,  X = dS diag(s_K) quantized per query over the tile's 64 keys
//         (DS_ROWCOL) or per 64 x 64 tile    INT8; X^ re-packs from accumulators, K^^T is mma-permuted. With DS16,
//         dQ += X K^ * sm_scale in bf16 (X rounded to it, K^'s codes converted to a bf16 tile per key tile).
// The recomputation costs two of the five products again (S in INT8, dP in fp16/bf16); in exchange the
// dK/dV kernel carries no dQ state (registers, shared memory, barriers, atomics).
// Kernel units: qs carries sm_scale * log2(e), so dK is multiplied by ln 2 at the end. The dQ kernel
// shares the forward's Q.K^T (int8/fwd.cuh) and its choice of KV tiles (common/rows.cuh).
#include "int8/bwd.cuh"
#include "int8/fwd.cuh"
#include "int8/packed.cuh"
#include "common/tile.cuh"

using namespace sage;

template <typename T, int D, bool DV16, bool DS16, bool PACKED = false>
__device__ __forceinline__ void int8_attn_bwd_impl(
              const signed char* __restrict__ qc, const float* __restrict__ qs, const signed char* __restrict__ qt,
              const signed char* __restrict__ kc, const float* __restrict__ ks,
              const T* __restrict__ v, long long vsb, long long vsh, long long vsn,
              const T* __restrict__ dout, long long dsb, long long dsh, long long dsn,
              const signed char* __restrict__ dot, const float* __restrict__ dos,
              const float* __restrict__ lse2, const float* __restrict__ delta,
              T* __restrict__ dk, long long ksb, long long ksh, long long ksn,
              T* __restrict__ dv, long long vvb, long long vvh, long long vvn,
              int Hq, int Hkv, int nq, int nk, int nq_pad, int nk_pad, float p_max,
              int left, int right, int shift, int p_col, int ds_rowcol, const int* __restrict__ meta = nullptr, int S = 0,
              int nbq = 0) {
  const bool P_COL = p_col != 0, DS_ROWCOL = ds_rowcol != 0;
  Window win{left, right};
  static_assert(D <= 128, "i2f_small is exact for |int32| < 2^22 (127 * 127 * D must stay below)");
  extern __shared__ __align__(128) char smem[];
  char* sK = smem;                          // 64 keys x D        int8
  char* sV = sK + BWD_BKV * D;              // 64 keys x D        T
  char* sQ = sV + BWD_BKV * D * 2;          // 64 queries x D     int8
  char* sdO = sQ + BWD_BQ * D;              // 64 queries x D     T
  // Two buffers (iteration parity) of what the end of an iteration reads, so the next one's loads can be
  // in flight meanwhile: Q^^T, dO^^T (D x 64 queries, int8, mma-permuted), per-query q scale, lse2, delta,
  // and the query tile's per-channel dO scales.
  // DV16 reads no dO^^T nor dO scales, DS16 no Q^^T: those are not loaded, and with DS16 (which the host pairs with
  // DV16) Q^ as bf16 (64 queries x D, swizzled 2 D-byte rows) takes the current buffer's Q^^T and dO^^T bytes, so the
  // CTA needs no more shared memory than the INT8 dK's (two CTAs per SM at D = 64 on GPUs with 100 KB per SM).
  char* sBuf = sdO + BWD_BQ * D * 2;
  constexpr int BUF = 2 * D * BWD_BQ + (3 * BWD_BQ + D) * 4;
  static_assert(!DS16 || DV16, "the bf16 Q^ takes dO^^T's bytes too");
  float* sRed = reinterpret_cast<float*>(sBuf + 2 * BUF);  // 4 floats of scratch

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, t4 = lane % 4;
  int kb = blockIdx.x, b = blockIdx.z;
  int bq = b, bk = b;  // the caller's q- and k-side arrays: batch b, or (packed) a sequence's first row
  // Packed: the first row of the sequence's block in the query-side buffers, added where the loop reads them (moved
  // pointers would be seven more 64-bit registers held across it; the dense build reads its parameters)
  long long qrow = 0;
  const int hk = blockIdx.y;
  if constexpr (PACKED) {  // grid x: the 64-key blocks of the padded k axis (int8/packed.cuh)
    const int s = packed_seq_of(meta, S, nbq, gridDim.x, true, static_cast<long long>(kb) * BWD_BKV);
    if (s < 0) return;  // past the last sequence
    const PackedSeq p = packed_seq(meta, S, s);
    kb -= p.kp / BWD_BKV, b = 0, bq = p.q0, bk = p.k0;
    nq = p.nq, nk = p.nk, nq_pad = p.nq_pad, nk_pad = p.nk_pad;
    packed_window(win.left, win.right, nq, nk);
    shift = nk - nq;  // (bottom-right aligned per sequence)
    const long long kr = static_cast<long long>(Hkv) * p.kp;
    qrow = static_cast<long long>(Hq) * p.qp, kc += kr * D, ks += kr;
  }
  const int group = Hq / Hkv;
  const long long bhk = static_cast<long long>(b) * Hkv + hk;
  const int k0 = kb * BWD_BKV;
  const float inv_p_max = 1.f / p_max;
  if (k0 >= nk) return;  // a block of padding keys only (nk_pad is a multiple of 128): no key, no output

  // Per-CTA operands: K^ (A of S^T), V (A of dP^T).
  load_tile_async<BWD_BKV, D, BWD_THREADS>(sK, reinterpret_cast<const char*>(kc + (bhk * nk_pad + k0) * D), D, tid);
  load_rows_async<BWD_BKV, 2 * D, BWD_THREADS>(sV, reinterpret_cast<const char*>(v + bk * vsb + hk * vsh + k0 * vsn),
                                              vsn * 2, nk - k0, tid);
  cp_async_commit();

  const int key_lo = k0 + warp * 16 + g;  // this thread's keys (accumulator rows): key_lo, key_lo + 8
  const int2 qv[2] = {win.rows(key_lo, shift, nq, nk), win.rows(key_lo + 8, shift, nq, nk)};  // rows that see them
  const float sk[2] = {ks[bhk * nk_pad + key_lo], ks[bhk * nk_pad + key_lo + 8]};

  float acc_dv[D / 8][4], acc_dk[D / 8][4];
#pragma unroll
  for (int i = 0; i < D / 8; ++i)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc_dv[i][e] = acc_dk[i][e] = 0.f;

  const QueryTiles qtl = query_tiles(k0, BWD_BKV, BWD_BQ, nq, nk, win, group, shift);  // (head in group, query tile) pairs
  const int first_qt = qtl.first;

  // Flattened (head in group, query tile) iterations. Q^ and dO of iteration it+1 are prefetched during
  // iteration it (issued once every warp is past S and dP); Q^^T, dO^^T and the per-query arrays of it+1
  // into the other buffer at the top of iteration it (load_t).
  const int n_it_q = qtl.per_head, n_it = qtl.iters;
  auto load_q_do = [&](int it) {
    const int hh = hk * group + it / n_it_q, qq0 = (first_qt + it % n_it_q) * BWD_BQ;
    const long long bhh = static_cast<long long>(b) * Hq + hh;
    load_tile_async<BWD_BQ, D, BWD_THREADS>(sQ, reinterpret_cast<const char*>(qc + qrow * D + (bhh * nq_pad + qq0) * D), D,
                                            tid);
    load_rows_async<BWD_BQ, 2 * D, BWD_THREADS>(
        sdO, reinterpret_cast<const char*>(dout + bq * dsb + hh * dsh + qq0 * dsn), dsn * 2, nq - qq0, tid);
  };
  // The per-query arrays are copied over the whole padded tile (every padded row of q scales, lse2 and
  // delta is written by the forward and the pre-passes); P of rows >= nq is zeroed by need_mask below.
  auto load_t = [&](int it) {
    const int hh = hk * group + it / n_it_q, qtile = first_qt + it % n_it_q, qq0 = qtile * BWD_BQ;
    const long long bhh = static_cast<long long>(b) * Hq + hh;
    char* buf = sBuf + (it & 1) * BUF;
    float* fb = reinterpret_cast<float*>(buf + 2 * D * BWD_BQ);
    // Q^^T and dO^^T are tile-major (each 64-query block's D x 64 bytes contiguous: int8_quant.cu)
    if constexpr (!DS16)
      load_tile_async<D, BWD_BQ, BWD_THREADS>(buf,
                                              reinterpret_cast<const char*>(qt + qrow * D + bhh * D * nq_pad + qq0 * D),
                                              BWD_BQ, tid);
    if constexpr (!DV16)
      load_tile_async<D, BWD_BQ, BWD_THREADS>(buf + D * BWD_BQ,
                                              reinterpret_cast<const char*>(dot + qrow * D + bhh * D * nq_pad + qq0 * D),
                                              BWD_BQ, tid);
    load_vec_async<BWD_THREADS>(fb, qs + qrow + bhh * nq_pad + qq0, BWD_BQ / 4, tid);
    load_vec_async<BWD_THREADS>(fb + BWD_BQ, lse2 + qrow + bhh * nq_pad + qq0, BWD_BQ / 4, tid);
    load_vec_async<BWD_THREADS>(fb + 2 * BWD_BQ, delta + qrow + bhh * nq_pad + qq0, BWD_BQ / 4, tid);
    if constexpr (!DV16)
      load_vec_async<BWD_THREADS>(fb + 3 * BWD_BQ, dos + qrow / BWD_BQ * D + (bhh * (nq_pad / BWD_BQ) + qtile) * D,
                                  D / 4, tid);
  };
  if (n_it > 0) {
    load_q_do(0);
    load_t(0);
  }
  cp_async_commit();
  // Packed: the mask test as two bounds on the query tile's first row (Window::crosses and the tails below; the
  // dense build reads nq, nk and the window from its parameters)
  int mask_lo = 0, mask_hi = 0;
  if constexpr (PACKED) {
    constexpr int NONE_BELOW = -0x7fffffff - 1, NONE_ABOVE = 0x7fffffff;
    mask_lo = k0 + BWD_BKV > nk ? NONE_ABOVE
                                : (win.right >= 0 ? k0 + BWD_BKV - 1 - shift - win.right : NONE_BELOW);
    mask_hi = min(win.left >= 0 ? k0 - (BWD_BQ - 1) - shift + win.left : NONE_ABOVE, nq - BWD_BQ);
  }

  for (int it = 0; it < n_it; ++it) {
    const int qtile = first_qt + it % n_it_q;
    {
      const int q0 = qtile * BWD_BQ;
      cp_async_wait<0>();
      __syncthreads();  // this iteration's operands resident
      const char* sQt = sBuf + (it & 1) * BUF;
      const char* sdOt = sQt + D * BWD_BQ;
      const float* sQs = reinterpret_cast<const float*>(sdOt + D * BWD_BQ);
      const float* sL = sQs + BWD_BQ;
      const float* sDel = sL + BWD_BQ;
      const float* sDos = sDel + BWD_BQ;
      if (it + 1 < n_it) load_t(it + 1);  // the other buffer: its readers finished in the last iteration
      char* sQ16 = sBuf + (it & 1) * BUF;  // DS16: over this buffer's (unloaded) Q^^T and dO^^T
      if constexpr (DS16) codes_as_bf16_tile<D>(sQ16, sQ, tid);  // read by dK after the barrier below
      const bool need_mask = PACKED ? q0 < mask_lo || q0 > mask_hi
                                    : win.crosses(q0, BWD_BQ, k0, BWD_BKV, shift) || (k0 + BWD_BKV > nk) ||
                                          (q0 + BWD_BQ > nq);

      // S^T (16 keys x 64 queries per warp).
      int acc_s[8][4];
#pragma unroll
      for (int i = 0; i < 8; ++i) acc_s[i][0] = acc_s[i][1] = acc_s[i][2] = acc_s[i][3] = 0;
#pragma unroll
      for (int kstep = 0; kstep < D / 32; ++kstep) {
        unsigned a[4];
        ldsm_x4<D, true>(a, sK, warp * 16, 2 * kstep, lane);
#pragma unroll
        for (int np = 0; np < 4; ++np) {
          unsigned bq[4];
          ldsm_x4<D, false>(bq, sQ, np * 16, 2 * kstep, lane);
          const unsigned b0[2] = {bq[0], bq[1]}, b1[2] = {bq[2], bq[3]};
          mma_s8s8(acc_s[2 * np], a, b0);
          mma_s8s8(acc_s[2 * np + 1], a, b1);
        }
      }
      // P^T = exp2(S^T - lse2[query]), masked to 0; P^ per key (row of P^T) or per tile.
      float p[8][4], pmax[2], s_p[2], inv_p[2];
      bwd_pt_tile(p, pmax, &acc_s[0][0], sk, sQs, sL, q0, t4, need_mask, qv);
      if constexpr (DV16) {  // dV += P^T dO in T (P rounded to T; B = dO stored [query][d]: transposed ldmatrix)
        unsigned pa[4][4];
        pack_acc_as_a16<T>(pa, p);
        mma_acc_a64<T, D>(acc_dv, pa, sdO, lane);
      } else {  // packed as the A operand of dV (k = queries, mma-permuted)
        bwd_group_scale(s_p, inv_p, pmax, P_COL, p_max, inv_p_max, sRed, warp, lane);
        unsigned pa[2][4];
        quantize_acc_as_a(pa, p, inv_p);
        // dV += P^^T dO^ * s_P[key] * s_dO[qtile, d]
#pragma unroll
        for (int dp = 0; dp < D / 16; ++dp) {
          int acc[2][4];
          mma_a64_tile16<true>(acc, pa, sdOt, dp, lane);
#pragma unroll
          for (int j = 0; j < 2; ++j) {
            const int col = (2 * dp + j) * 8 + 2 * t4;
            const float2 sd = *reinterpret_cast<const float2*>(sDos + col);
#pragma unroll
            for (int e = 0; e < 4; ++e)
              acc_dv[2 * dp + j][e] += i2f_small(acc[j][e]) * s_p[e >> 1] * ((e & 1) ? sd.y : sd.x);
          }
        }
      }
      // dP^T = V dO^T (fp16/bf16, fp32 accumulation), 16 queries per pass over V's fragments, then
      // dS^T = P^T o (dP^T - delta) in place. (Four 16-query groups per pass, a quarter of the V ldmatrix and fewer
      // spills, measured 1.02x on the backward kernel: noise level; docs/experiments.md.)
#pragma unroll
      for (int np = 0; np < 4; ++np) {
        float acc[2][4];
#pragma unroll
        for (int j = 0; j < 2; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;
#pragma unroll
        for (int kstep = 0; kstep < D / 16; ++kstep) {
          unsigned a[4];
          ldsm_x4<2 * D, true>(a, sV, warp * 16, 2 * kstep, lane);
          unsigned bo[4];
          ldsm_x4<2 * D, false>(bo, sdO, np * 16, 2 * kstep, lane);
          const unsigned b0[2] = {bo[0], bo[1]}, b1[2] = {bo[2], bo[3]};
          mma_f16<T>(acc[0], a, b0);
          mma_f16<T>(acc[1], a, b1);
        }
#pragma unroll
        for (int j = 0; j < 2; ++j) bwd_ds_ntile(p[2 * np + j], acc[j], sDel, 2 * np + j, t4);
      }
      // dK path: Y = diag(s_Q) dS, quantized per key (row here) or per tile.
      if constexpr (DS16) {  // dK += Y^T Q^ in bf16
        float ymax[2];
        bwd_y_tile(p, ymax, sQs, t4);
        unsigned ya[4][4];
        pack_acc_as_a16<__nv_bfloat16>(ya, p);
        __syncthreads();  // sQ16 written by every warp
        mma_acc_a64<__nv_bfloat16, D>(acc_dk, ya, sQ16, lane);
      } else {
        // Y in place of dS (dS has no other use in this kernel).
        float ymax[2], s_y[2], inv[2];
        bwd_y_tile(p, ymax, sQs, t4);
        bwd_group_scale(s_y, inv, ymax, DS_ROWCOL, 127.f, 1.f / 127.f, sRed, warp, lane);
        unsigned ya[2][4];
        quantize_acc_as_a(ya, p, inv);
#pragma unroll
        for (int dp = 0; dp < D / 16; ++dp) {
          int acc[2][4];
          mma_a64_tile16<false>(acc, ya, sQt, dp, lane);
#pragma unroll
          for (int j = 0; j < 2; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc_dk[2 * dp + j][e] += i2f_small(acc[j][e]) * s_y[e >> 1];
        }
      }
      __syncthreads();  // every warp is past S (sQ) and dP (sdO): prefetch the next iteration's
      if (it + 1 < n_it) load_q_do(it + 1);
      cp_async_commit();
    }
  }

  // Epilogue: dV, dK (x ln 2: Q^ carried log2 e) in the caller's layout.
  store_acc_rows<T, D>(dv + bk * vvb + hk * vvh, vvn, acc_dv, key_lo, t4, nk, 1.f);
  store_acc_rows<T, D>(dk + bk * ksb + hk * ksh, ksn, acc_dk, key_lo, t4, nk, 0.6931471805599453f);
}

// dK/dV: grid (nk_pad / 64, Hkv, B), block 128; dynamic shared memory: int8.py bwd_smem.
template <typename T, int D, bool DV16, bool DS16>
__global__ void __launch_bounds__(BWD_THREADS)
int8_attn_bwd(const signed char* __restrict__ qc, const float* __restrict__ qs, const signed char* __restrict__ qt,
              const signed char* __restrict__ kc, const float* __restrict__ ks,
              const T* __restrict__ v, long long vsb, long long vsh, long long vsn,
              const T* __restrict__ dout, long long dsb, long long dsh, long long dsn,
              const signed char* __restrict__ dot, const float* __restrict__ dos,
              const float* __restrict__ lse2, const float* __restrict__ delta,
              T* __restrict__ dk, long long ksb, long long ksh, long long ksn,
              T* __restrict__ dv, long long vvb, long long vvh, long long vvn,
              int Hq, int Hkv, int nq, int nk, int nq_pad, int nk_pad, float p_max,
              int left, int right, int shift, int p_col, int ds_rowcol) {
  int8_attn_bwd_impl<T, D, DV16, DS16>(qc, qs, qt, kc, ks, v, vsb, vsh, vsn, dout, dsb, dsh, dsn, dot, dos, lse2, delta,
                                       dk, ksb, ksh, ksn, dv, vvb, vvh, vvn, Hq, Hkv, nq, nk, nq_pad, nk_pad, p_max,
                                       left, right, shift, p_col, ds_rowcol);
}

// Packed sequences (layout "THD", int8/packed.cuh): grid (padded k rows / 64, Hkv, 1); v, dout, dk, dv (total, H, D)
// at the given strides; the residuals and the pre-pass buffers in the packed padded layout.
template <typename T, int D, bool DV16, bool DS16>
__global__ void __launch_bounds__(BWD_THREADS)
int8_attn_bwd_packed(const signed char* __restrict__ qc, const float* __restrict__ qs,
                     const signed char* __restrict__ qt, const signed char* __restrict__ kc,
                     const float* __restrict__ ks, const T* __restrict__ v, long long vsh, long long vsn,
                     const T* __restrict__ dout, long long dsh, long long dsn, const signed char* __restrict__ dot,
                     const float* __restrict__ dos, const float* __restrict__ lse2, const float* __restrict__ delta,
                     T* __restrict__ dk, long long ksh, long long ksn, T* __restrict__ dv, long long vvh,
                     long long vvn, int Hq, int Hkv, float p_max, int left, int right, int p_col, int ds_rowcol,
                     const int* __restrict__ meta, int S, int nbq) {
  // (the token strides as the batch strides: the impl's batch index is then the sequence's first row)
  int8_attn_bwd_impl<T, D, DV16, DS16, true>(qc, qs, qt, kc, ks, v, vsn, vsh, vsn, dout, dsn, dsh, dsn, dot, dos, lse2,
                                             delta, dk, ksn, ksh, ksn, dv, vvn, vvh, vvn, Hq, Hkv, 0, 0, 0, 0, p_max,
                                             left, right, 0, p_col, ds_rowcol, meta, S, nbq);
}

// dQ: see the top of the file. grid (nq_pad / 64, Hq, B), block 128; dynamic shared memory 704 * D + 512
// bytes: Q^ and dO of the CTA's rows, then two stages of K^, K^^T, V and the key scales; with DS16 the stages
// hold no K^^T, and the key tile's K^ as bf16 follows them (the same total: it stays within the 99 KB a block may
// have on sm_86 / sm_89 at D = 128).
template <typename T, int D, bool DS16, bool PACKED = false>
__device__ __forceinline__ void int8_attn_bwd_dq_impl(const signed char* __restrict__ qc, const float* __restrict__ qs,
                 const signed char* __restrict__ kc, const float* __restrict__ ks, const signed char* __restrict__ ktp,
                 const T* __restrict__ v, long long vsb, long long vsh, long long vsn,
                 const T* __restrict__ dout, long long dsb, long long dsh, long long dsn,
                 const float* __restrict__ lse2, const float* __restrict__ delta,
                 T* __restrict__ dq, long long qsb, long long qsh, long long qsn,
                 int Hq, int Hkv, int nq, int nk, int nq_pad, int nk_pad, float sm_scale, int left, int right,
                 int shift, int ds_rowcol, const int* __restrict__ meta = nullptr, int S = 0) {
  const bool DS_ROWCOL = ds_rowcol != 0;
  Window win{left, right};
  static_assert(D <= 128, "i2f_small is exact for |int32| < 2^22 (127 * 127 * D must stay below)");
  extern __shared__ __align__(128) char smem[];
  constexpr int KT_BYTES = DS16 ? 0 : D * BWD_BKV;  // K^^T (not read with DS16)
  constexpr int STAGE = BWD_BKV * D + KT_BYTES + BWD_BKV * D * 2 + BWD_BKV * 4;
  char* sQ = smem;                          // 64 queries x D     int8
  char* sdO = sQ + BWD_BQ * D;              // 64 queries x D     T
  // 2 x (K^ 64 keys x D int8, K^^T D x 64 keys int8 mma-permuted (not with DS16), V 64 keys x D T, 64 key scales)
  char* sStage = sdO + BWD_BQ * D * 2;
  char* sK16 = sStage + 2 * STAGE;  // DS16: the key tile's K^ as bf16, 64 keys x D (swizzled 2 D-byte rows)
  __shared__ float sRed[4];

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, t4 = lane % 4;
  QueryBlock qb = query_block(BWD_BQ, win.causal_shape(), Hq, Hkv);
  int bq = qb.b, bk = qb.b;  // the caller's q- and k-side arrays: batch b, or (packed) a sequence's first row
  if constexpr (PACKED) {  // grid x: the 64-row blocks of the padded q axis (int8/packed.cuh)
    PackedSeq p;
    int s;
    if (!packed_query_seq(meta, S, qb, Hq, Hkv, nq, nk, nq_pad, nk_pad, win, shift, p, s)) return;  // past the last
    const long long qr = static_cast<long long>(Hq) * p.qp, kr = static_cast<long long>(Hkv) * p.kp;
    qc += qr * D, qs += qr, lse2 += qr, delta += qr, kc += kr * D, ks += kr, ktp += kr * D;
    bq = p.q0, bk = p.k0;
  }
  const int q0 = qb.q0, h = qb.h, b = qb.b, hk = h / (Hq / Hkv);
  const long long bh = qb.bh, bhk = qb.bhk;
  const KeyRange tl = key_range(q0, BWD_BQ, nq, nk, win, shift);  // tiles tl.first .. tl.n - 1

  auto load_kv = [&](int tile) {  // into the stage of its position in the range
    char* st = sStage + ((tile - tl.first) & 1) * STAGE;
    const int k0 = tile * BWD_BKV;
    load_tile_async<BWD_BKV, D, BWD_THREADS>(st, reinterpret_cast<const char*>(kc + (bhk * nk_pad + k0) * D), D, tid);
    if constexpr (!DS16)
      load_tile_async<D, BWD_BKV, BWD_THREADS>(st + BWD_BKV * D,  // K^^T: tile-major
                                               reinterpret_cast<const char*>(ktp + bhk * D * nk_pad + k0 * D), BWD_BKV,
                                               tid);
    load_rows_async<BWD_BKV, 2 * D, BWD_THREADS>(st + BWD_BKV * D + KT_BYTES,
                                                reinterpret_cast<const char*>(v + bk * vsb + hk * vsh + k0 * vsn),
                                                vsn * 2, nk - k0, tid);
    load_vec_async<BWD_THREADS>(st + 3 * BWD_BKV * D + KT_BYTES, ks + bhk * nk_pad + k0, BWD_BKV / 4, tid);
  };
  load_tile_async<BWD_BQ, D, BWD_THREADS>(sQ, reinterpret_cast<const char*>(qc + (bh * nq_pad + q0) * D), D, tid);
  load_rows_async<BWD_BQ, 2 * D, BWD_THREADS>(sdO, reinterpret_cast<const char*>(dout + bq * dsb + h * dsh + q0 * dsn),
                                             dsn * 2, nq - q0, tid);
  if (tl.n > tl.first) load_kv(tl.first);
  cp_async_commit();

  const int r_lo = q0 + warp * 16 + g;  // this thread's rows: r_lo, r_lo + 8
  const int2 rk[2] = {win.row_keys(r_lo, shift, nq, nk), win.row_keys(r_lo + 8, shift, nq, nk)};  // the keys they see
  float sq[2], lse_r[2], del[2];
  bwd_dq_rows(sq, lse_r, del, qs + bh * nq_pad, lse2 + bh * nq_pad, delta + bh * nq_pad, r_lo, nq);
  float acc_dq[D / 8][4];
#pragma unroll
  for (int i = 0; i < D / 8; ++i) acc_dq[i][0] = acc_dq[i][1] = acc_dq[i][2] = acc_dq[i][3] = 0.f;
  unsigned qf[D / 32][4];   // Q^ rows of this warp: A of S (m16n8k32)
  unsigned of[D / 16][4];   // dO rows of this warp: A of dP (m16n8k16)

  for (int tile = tl.first; tile < tl.n; ++tile) {
    cp_async_wait<0>();
    __syncthreads();  // tile resident; every warp is done with the stage the prefetch below overwrites
    if (tile == tl.first) {
#pragma unroll
      for (int kstep = 0; kstep < D / 32; ++kstep) ldsm_x4<D, true>(qf[kstep], sQ, warp * 16, 2 * kstep, lane);
#pragma unroll
      for (int kstep = 0; kstep < D / 16; ++kstep) ldsm_x4<2 * D, true>(of[kstep], sdO, warp * 16, 2 * kstep, lane);
    }
    if (tile + 1 < tl.n) load_kv(tile + 1);
    cp_async_commit();
    const char* cK = sStage + ((tile - tl.first) & 1) * STAGE;
    const char* cKt = cK + BWD_BKV * D;
    const char* cV = cKt + KT_BYTES;
    const float* cKs = reinterpret_cast<const float*>(cV + BWD_BKV * D * 2);
    const int k0 = tile * BWD_BKV;
    if constexpr (DS16) codes_as_bf16_tile<D>(sK16, cK, tid);  // read by dQ after the barrier below

    // S = Q^ K^^T (int32), 16 rows x 64 keys per warp.
    int acc_s[8][4];
    qk_s8<D>(acc_s, qf, cK, lane);
    // P = exp2(S - lse2[row]), masked to 0 (the operations of the dK/dV kernel, in the same order).
    const bool need_mask = tl.need_mask(tile) || q0 + BWD_BQ > nq;
    float p[8][4], skk[8][2];  // skk: s_K of this thread's keys
    bwd_dq_p_tile(p, skk, &acc_s[0][0], cKs, sq, lse_r, k0, t4, need_mask, rk);
    // dP = dO V^T (fp16/bf16, fp32 accumulation); dS = P o (dP - delta) in place.
#pragma unroll
    for (int np = 0; np < 4; ++np) {
      float acc[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
#pragma unroll
      for (int kstep = 0; kstep < D / 16; ++kstep) {
        unsigned bv[4];
        ldsm_x4<2 * D, false>(bv, cV, np * 16, 2 * kstep, lane);
        const unsigned b0[2] = {bv[0], bv[1]}, b1[2] = {bv[2], bv[3]};
        mma_f16<T>(acc[0], of[kstep], b0);
        mma_f16<T>(acc[1], of[kstep], b1);
      }
#pragma unroll
      for (int j = 0; j < 2; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) p[2 * np + j][e] *= acc[j][e] - del[e >> 1];
    }
    // X = dS diag(s_K), quantized per query row over the tile's keys, or per 64 x 64 tile.
    float xmax[2], s_x[2], inv[2];
    bwd_dq_x_tile(p, xmax, skk);
    if constexpr (DS16) {  // dQ += X K^ in bf16 (sm_scale at the end)
      unsigned xb[4][4];
      pack_acc_as_a16<__nv_bfloat16>(xb, p);
      __syncthreads();  // sK16 written by every warp
      mma_acc_a64<__nv_bfloat16, D>(acc_dq, xb, sK16, lane);
      continue;
    }
    bwd_group_scale(s_x, inv, xmax, DS_ROWCOL, 127.f, 1.f / 127.f, sRed, warp, lane);
    unsigned xa[2][4];
    quantize_acc_as_a(xa, p, inv);
    // dQ += X^ K^ * s_X * sm_scale (B = K^^T, keys mma-permuted like X^'s columns).
    const float fx[2] = {s_x[0] * sm_scale, s_x[1] * sm_scale};
#pragma unroll
    for (int dp = 0; dp < D / 16; ++dp) {
      int acc[2][4];
      mma_a64_tile16<false>(acc, xa, cKt, dp, lane);
#pragma unroll
      for (int j = 0; j < 2; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc_dq[2 * dp + j][e] += i2f_small(acc[j][e]) * fx[e >> 1];
    }
  }

  // Epilogue: dQ in the caller's layout and dtype (rows that see no key get 0).
  store_acc_rows<T, D>(dq + bq * qsb + h * qsh, qsn, acc_dq, r_lo, t4, nq, DS16 ? sm_scale : 1.f);
}

template <typename T, int D, bool DS16>
__global__ void __launch_bounds__(BWD_THREADS)
int8_attn_bwd_dq(const signed char* __restrict__ qc, const float* __restrict__ qs,
                 const signed char* __restrict__ kc, const float* __restrict__ ks, const signed char* __restrict__ ktp,
                 const T* __restrict__ v, long long vsb, long long vsh, long long vsn,
                 const T* __restrict__ dout, long long dsb, long long dsh, long long dsn,
                 const float* __restrict__ lse2, const float* __restrict__ delta,
                 T* __restrict__ dq, long long qsb, long long qsh, long long qsn,
                 int Hq, int Hkv, int nq, int nk, int nq_pad, int nk_pad, float sm_scale, int left, int right,
                 int shift, int ds_rowcol) {
  int8_attn_bwd_dq_impl<T, D, DS16>(qc, qs, kc, ks, ktp, v, vsb, vsh, vsn, dout, dsb, dsh, dsn, lse2, delta, dq, qsb,
                                    qsh, qsn, Hq, Hkv, nq, nk, nq_pad, nk_pad, sm_scale, left, right, shift, ds_rowcol);
}

// Packed sequences (layout "THD", int8/packed.cuh): grid (padded q rows / 64, Hq, 1).
template <typename T, int D, bool DS16>
__global__ void __launch_bounds__(BWD_THREADS)
int8_attn_bwd_dq_packed(const signed char* __restrict__ qc, const float* __restrict__ qs,
                        const signed char* __restrict__ kc, const float* __restrict__ ks,
                        const signed char* __restrict__ ktp, const T* __restrict__ v, long long vsh, long long vsn,
                        const T* __restrict__ dout, long long dsh, long long dsn, const float* __restrict__ lse2,
                        const float* __restrict__ delta, T* __restrict__ dq, long long qsh, long long qsn, int Hq,
                        int Hkv, float sm_scale, int left, int right, int ds_rowcol, const int* __restrict__ meta,
                        int S) {
  // (the token strides as the batch strides: the impl's batch index is then the sequence's first row)
  int8_attn_bwd_dq_impl<T, D, DS16, true>(qc, qs, kc, ks, ktp, v, vsn, vsh, vsn, dout, dsn, dsh, dsn, lse2, delta, dq,
                                          qsn, qsh, qsn, Hq, Hkv, 0, 0, 0, 0, sm_scale, left, right, 0, ds_rowcol, meta,
                                          S);
}
