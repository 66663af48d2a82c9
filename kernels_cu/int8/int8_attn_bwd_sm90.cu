// SageBwd backward on Hopper tensor cores (sm_90a only): the algorithm, operands and CTA shapes of
// int8_attn_bwd.cu (see there), with every product on wgmma. One CTA = one warpgroup (4 warps, 64 rows of
// the M dimension); operands are read through shared-memory descriptors, the re-quantized P^ / Y^ / X^ codes
// from registers:
//   dK/dV kernel, per (head, 64-query tile):
//     S^T  = K^ Q^^T          m64n64k32 s8.s8      (K^, Q^ shared)
//     dP^T = V dO^T           m64n64k16 f32.T.T    (V, dO shared: 16-bit, K-major in 128-byte pieces)
//     dV  += P^^T dO^         m64n64k32 u8.s8      (P^ registers, dO^^T shared), D / 64 products; or, with DV16
//                                                  (config dv_int8=False), dV += P^T dO in T: m64nDk16 f32.T.T,
//                                                  P rounded to T in registers, dO the dP product's tile read
//                                                  N-major, accumulated in acc_dv itself (no int32 fold)
//     dK  += Y^^T Q^          m64n64k32 s8.s8      (Y^ registers, Q^^T shared), D / 64 products; or, with DS16
//                                                  (config ds_int8=False, which needs DV16), dK += Y^T Q^ in bf16:
//                                                  m64nDk16 f32.bf16.bf16, Y rounded to bf16 in registers, Q^'s
//                                                  codes as bf16 (exact) read N-major, accumulated in acc_dk
//   dQ kernel, per 64-key tile:
//     S = Q^ K^^T, dP = dO V^T as above;  dQ += X^ K^   m64nDk32 s8.s8 (X^ registers, K^^T shared); or, with DS16,
//                                                  dQ += X K^ in bf16 as dK (K^'s codes as bf16 in the stage)
// The element-wise steps are int8/bwd.cuh's, shared with the mma.sync kernels: the int32 products
// are exact either way, so the two engines differ only through the fp32 accumulation order of the 16-bit products
// inside the tensor cores (dP, and dV, dK, dQ with DV16 / DS16). Every wait is unconditional and no accumulator is touched while its product is in
// flight (ptxas would serialize all wgmma otherwise: warning C7514, which CI treats as an error).
// Operand tiles are double-buffered: each stage is a pre-built image of the tile's operands in global memory
// (int8/bwd_img.cuh), copied by one thread with one cp.async.bulk whose completion the others wait for on an
// mbarrier; the next iteration's arrives during this one.
#include "int8/bwd_img.cuh"
#include "int8/bwd.cuh"
#include "int8/packed.cuh"
#include "common/rows.cuh"
#include "common/tile.cuh"
#include "common/wgmma.cuh"

using namespace sage;

// 64 x 64 S (s8.s8, D / 32 k-steps) and dP (16-bit, D / 16 k-steps) issued as two commit groups.
template <typename T, int D>
__device__ __forceinline__ void issue_s_dp(int (&acc_s)[32], float (&acc_dp)[32], const char* sA8, const char* sB8,
                                           const char* sA16, const char* sB16) {
  const unsigned long long da = gmma_desc<D>(sA8), db = gmma_desc<D>(sB8);
  wgmma_fence();
#pragma unroll
  for (int ks = 0; ks < D / 32; ++ks)
    wgmma_m64n64k32_ss_s8(acc_s, gmma_desc_advance(da, 32 * ks), gmma_desc_advance(db, 32 * ks), ks);
  wgmma_commit();
#pragma unroll
  for (int ks = 0; ks < D / 16; ++ks) wgmma_ss<T>(acc_dp, desc_k16<64>(sA16, ks), desc_k16<64>(sB16, ks), ks);
  wgmma_commit();
}

// acc (+)= A(64 x 64 codes, registers a[0]: k 0..31, a[1]: 32..63) * B, B = columns 64 h .. 64 h + 63 of a
// tile stored [N][64 k bytes] (64-byte swizzled rows), s8 or u8 A.
template <bool A_UNSIGNED>
__device__ __forceinline__ void issue_a64_n64(int (&acc)[32], const unsigned (&a)[2][4], const char* tile, int h) {
  const unsigned long long d = gmma_desc<64>(tile + h * 64 * 64);
  if constexpr (A_UNSIGNED) {
    wgmma_m64n64k32_rs_u8s8(acc, a[0], d, 0);
    wgmma_m64n64k32_rs_u8s8(acc, a[1], gmma_desc_advance(d, 32), 1);
  } else {
    wgmma_m64n64k32_rs_s8s8(acc, a[0], d, 0);
    wgmma_m64n64k32_rs_s8s8(acc, a[1], gmma_desc_advance(d, 32), 1);
  }
}

// acc (the warpgroup's 64 x D fp32 accumulators) += A * B in T, one commit group (not waited for): A from registers
// (a[kk]: k16 chunk kk of 64, pack_acc_as_a16), B a 64 x D tile of T stored [k][n] in 128-byte pieces, read N-major.
// The 16-bit dV (P^T dO), and with DS16 dK (Y^T Q^) and dQ (X K^) in bf16.
template <typename T, int D>
__device__ __forceinline__ void issue_a16_k64(float (&acc)[D / 8][4], const unsigned (&a)[4][4], const char* tile) {
  wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < 4; ++kk)
    wgmma_rs<T, true>(reinterpret_cast<float(&)[D / 2]>(acc), a[kk], desc_mn16<64>(tile, kk), 1);
  wgmma_commit();
}

// dK/dV: grid (nk_pad / 64, Hkv, B), block 128, dynamic shared memory BwdSm90<D>::SMEM (host: _bwd90_smem(D)[0]).
template <int D>
struct BwdSm90 {
  // K^ (64 x D int8), V (64 x D 16-bit), then two stages of Q^ (64 x D), dO (64 x D 16-bit), Q^^T and dO^^T
  // (D x 64 int8, mma-permuted), q scales, lse2, delta (64 each) and the tile's dO scales (D): fp32.
  static constexpr int STAGE = ((320 * D + (192 + D) * 4) + 1023) / 1024 * 1024;
  static constexpr int SMEM = 1024 + 192 * D + 2 * STAGE;
};

// CTAs per SM the D = 64 kernels' registers are budgeted for (__launch_bounds__): three, 168 registers (dK/dV
// 203 -> 168 with 64 bytes of spills, dQ 181 -> 168 with 16; with the stage images dK/dV spills 140 bytes and dQ
// fits 158 registers), instead of two: both kernels together 1.13-1.20x on the H200 (docs/experiments.md; bitwise
// the same gradients). D = 128 is held to two CTAs by its shared memory anyway.
constexpr int BWD90_D64_MIN_CTAS = 3;
// D = 128 dK/dV: the last dK product's fold (int32 -> fp32 into acc_dk's columns 64..127) is done in the next
// iteration, while that iteration's S and dP run on the tensor cores, instead of before its barrier. Each
// accumulator element still receives the tiles in order: the gradients are bitwise the same. Measured 1.04-1.05x
// on the dK/dV kernel at N = 4K and 16K, 1.02-1.03x causal (docs/experiments.md).
// D = 64 dK/dV: S and dP are issued first after the barrier, the next stage's copy after them: 1.04x on the kernel,
// 0.98-1.01x at D = 128, which keeps the copy first (docs/experiments.md; bitwise the same).

template <typename T, int D, bool DV16, bool DS16, bool PACKED = false>
__device__ __forceinline__ void int8_attn_bwd_sm90_impl(const char* __restrict__ q_img, const char* __restrict__ k_img,
                   const float* __restrict__ ks,
                   T* __restrict__ dk, long long ksb, long long ksh, long long ksn,
                   T* __restrict__ dv, long long vvb, long long vvh, long long vvn,
                   int Hq, int Hkv, int nq, int nk, int nq_pad, int nk_pad, float p_max,
                   int left, int right, int shift, int p_col, int ds_rowcol, const int* __restrict__ meta = nullptr, int S = 0,
                   int nbq = 0) {
  static_assert(D == 64 || D == 128, "wgmma tiles of 64 columns");
  static_assert(DV16 || !DS16, "the bf16 Q^ takes the stage bytes of the INT8 dV's operands");
  using Img = BwdImg<D, DS16>;
  const bool P_COL = p_col != 0, DS_ROWCOL = ds_rowcol != 0;
  Window win{left, right};
  constexpr bool LOAD_AFTER_S = D == 64;  // (see above)
  constexpr int STAGE = BwdSm90<D>::STAGE;
  static_assert(Img::Q_STAGE <= STAGE && Img::Q_QS == 320 * D, "a stage image is the stage's layout");
  extern __shared__ __align__(128) char smem_raw[];
  char* smem = smem_raw + ((1024u - (smem_u32(smem_raw) & 1023u)) & 1023u);  // wgmma tiles: 1024-byte aligned
  char* sK = smem;
  char* sV = sK + BWD_BKV * D;
  char* sStage = sV + BWD_BKV * D * 2;
  __shared__ float sRed[4];
  __shared__ __align__(8) unsigned long long full[2];  // stage s resident (bulk copies complete)

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, t4 = lane % 4;
  int kb = blockIdx.x, b = blockIdx.z;
  int bk = b;  // the caller's dk, dv: batch b, or (packed) the sequence's first key
  const int hk = blockIdx.y;
  if constexpr (PACKED) {  // grid x: the 64-key blocks of the padded k axis (int8/packed.cuh)
    const int s = packed_seq_of(meta, S, nbq, gridDim.x, true, static_cast<long long>(kb) * BWD_BKV);
    if (s < 0) return;  // past the last sequence
    const PackedSeq p = packed_seq(meta, S, s);
    kb -= p.kp / BWD_BKV, b = 0, bk = p.k0;
    nq = p.nq, nk = p.nk, nq_pad = p.nq_pad, nk_pad = p.nk_pad;
    packed_window(win.left, win.right, nq, nk);
    shift = nk - nq;  // (bottom-right aligned per sequence)
    const long long qr = static_cast<long long>(Hq) * p.qp, kr = static_cast<long long>(Hkv) * p.kp;
    q_img += qr / BWD_BQ * Img::Q_STAGE, k_img += kr / BWD_BKV * Img::K_STAGE, ks += kr;
  }
  const int group = Hq / Hkv;
  const long long bhk = static_cast<long long>(b) * Hkv + hk;
  const int k0 = kb * BWD_BKV;
  const float inv_p_max = 1.f / p_max;
  if (k0 >= nk) return;  // a block of padding keys only (nk_pad is a multiple of 128): no key, no output

  const int key_lo = k0 + warp * 16 + g;  // this thread's keys (accumulator rows): key_lo, key_lo + 8
  const int2 qv[2] = {win.rows(key_lo, shift, nq, nk), win.rows(key_lo + 8, shift, nq, nk)};  // rows that see them
  const float sk[2] = {ks[bhk * nk_pad + key_lo], ks[bhk * nk_pad + key_lo + 8]};
  float acc_dv[D / 8][4], acc_dk[D / 8][4];
#pragma unroll
  for (int i = 0; i < D / 8; ++i)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc_dv[i][e] = acc_dk[i][e] = 0.f;

  const QueryTiles qtl = query_tiles(k0, BWD_BKV, BWD_BQ, nq, nk, win, group, shift);  // (head in group, query tile) pairs
  const int first_qt = qtl.first, n_qt = qtl.n, n_it_q = qtl.per_head, n_it = qtl.iters;
  // Stage it is the image of its (query head, query tile) (int8/bwd_img.cuh: Q^, dO, Q^^T, dO^^T, the per-query
  // vectors over the whole padded tile, the tile's dO scales), copied by thread 0 with one bulk copy; its
  // completion is phase it / 2 of full[it % 2]. K^ and V of this block (its key-side image) come with stage 0.
  if (tid == 0) {
    mbar_init(&full[0], 1);
    mbar_init(&full[1], 1);
    fence_mbar_init();
  }
  __syncthreads();
  // Packed: what the loop reads of the sequence, which the dense build reads from its parameters, kept out of the
  // registers the loop holds (at D = 128 the kernel is at 255): thread 0's image base and tile count in shared memory
  // (re-read at each copy), and the mask test as two bounds on the query tile's first row (the dense test below:
  // Window::crosses and the tails).
  __shared__ const char* s_qimg;
  __shared__ int s_qtiles;
  int mask_lo = 0, mask_hi = 0;
  if constexpr (PACKED) {
    if (tid == 0) s_qimg = q_img, s_qtiles = nq_pad / BWD_BQ;
    constexpr int NONE_BELOW = -0x7fffffff - 1, NONE_ABOVE = 0x7fffffff;
    mask_lo = k0 + BWD_BKV > nk ? NONE_ABOVE
                                : (win.right >= 0 ? k0 + BWD_BKV - 1 - shift - win.right : NONE_BELOW);
    mask_hi = min(win.left >= 0 ? k0 - (BWD_BQ - 1) - shift + win.left : NONE_ABOVE, nq - BWD_BQ);
  }
  int ld_h = hk * group, ld_t = first_qt;  // (query head, query tile) of the next stage to load
  auto load_stage = [&](int it) {          // thread 0
    const char* qi = q_img;
    int qtiles = nq_pad / BWD_BQ;
    if constexpr (PACKED) {
      qi = *reinterpret_cast<const char* const volatile*>(&s_qimg);
      qtiles = *reinterpret_cast<const volatile int*>(&s_qtiles);
    }
    const long long tile = (static_cast<long long>(b) * Hq + ld_h) * qtiles + ld_t;
    bulk_copy_g2s(sStage + (it & 1) * STAGE, qi + tile * Img::Q_STAGE, Img::Q_STAGE, &full[it & 1]);
    if (++ld_t == n_qt) {
      ld_t = first_qt;
      ++ld_h;
    }
  };
  if (tid == 0 && n_it > 0) {  // (no query tile: nothing is copied, the outputs are zeros)
    const char* kimg = k_img + (bhk * (nk_pad / BWD_BKV) + kb) * Img::K_STAGE;
    mbar_arrive_expect_tx(&full[0], Img::Q_STAGE + 192 * D);
    bulk_copy_g2s(sK, kimg + Img::K_K, 64 * D, &full[0]);
    bulk_copy_g2s(sV, kimg + Img::K_V, 128 * D, &full[0]);
    load_stage(0);
  }

  // D = 128: dk_prev holds the previous iteration's last dK product (waited for, not yet
  // folded; zeros before the first), s_y_prev its scales. A copy, not acc_b itself: ptxas would otherwise wait
  // for every wgmma in flight before the fold (C7517: it does not track the wait across the loop's back edge).
  int dk_prev[32];
  float s_y_prev[2] = {0.f, 0.f};
#pragma unroll
  for (int i = 0; i < 32; ++i) dk_prev[i] = 0;
  auto add_dk = [&](const int (&acc)[32], int h, const float (&sy)[2]) {  // dK += Y^^T Q^ * s_Y[key]
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc_dk[8 * h + j][e] += i2f_small(acc[4 * j + e]) * sy[e >> 1];
  };
  // D = 128: waits for the last dK product (acc_b) and keeps it and its scales for the next iteration's fold.
  auto keep_last_dk = [&](int (&acc_b)[32], unsigned (&ya)[2][4], const float (&s_y)[2]) {
    wgmma_wait<0>();
    fence_regs(acc_b);
    hold_regs(ya);
#pragma unroll
    for (int i = 0; i < 32; ++i) asm volatile("mov.b32 %0, %1;" : "=r"(dk_prev[i]) : "r"(acc_b[i]));
    s_y_prev[0] = s_y[0];
    s_y_prev[1] = s_y[1];
  };
  int cur_t = first_qt;  // query tile of iteration it
  for (int it = 0; it < n_it; ++it) {
    const int q0 = cur_t * BWD_BQ;
    cur_t = cur_t + 1 == n_qt ? first_qt : cur_t + 1;
    mbar_wait(&full[it & 1], (it >> 1) & 1);  // stage it resident (visible to this thread and its wgmma)
    __syncthreads();                          // every warp is done with stage it - 1, refilled next
    auto issue_next = [&]() {
      if (tid == 0 && it + 1 < n_it) {
        mbar_arrive_expect_tx(&full[(it + 1) & 1], Img::Q_STAGE);
        load_stage(it + 1);
      }
    };
    if constexpr (!LOAD_AFTER_S) issue_next();
    const char* st = sStage + (it & 1) * STAGE;
    const char* sQ = st;
    const char* sdO = st + 64 * D;
    const char* sQt = st + 192 * D;
    const char* sdOt = st + 256 * D;
    const float* sQs = reinterpret_cast<const float*>(st + 320 * D);
    const float* sL = sQs + BWD_BQ;
    const float* sDel = sL + BWD_BQ;
    const float* sDos = sDel + BWD_BQ;
    const bool need_mask = PACKED ? q0 < mask_lo || q0 > mask_hi
                                  : win.crosses(q0, BWD_BQ, k0, BWD_BKV, shift) || (k0 + BWD_BKV > nk) || (q0 + BWD_BQ > nq);

    int acc_s[32];
    float acc_dp[32];
    issue_s_dp<T, D>(acc_s, acc_dp, sK, sQ, sV, sdO);  // S^T = K^ Q^^T, dP^T = V dO^T
    if constexpr (LOAD_AFTER_S) issue_next();  // the next stage's copy is issued while S and dP run
    if constexpr (D == 128 && !DS16) add_dk(dk_prev, 1, s_y_prev);  // the last iteration's, see above
    wgmma_wait<1>();
    fence_regs(acc_s);
    if constexpr (DV16) {
      float p[8][4], pmax[2];
      bwd_pt_tile(p, pmax, acc_s, sk, sQs, sL, q0, t4, need_mask, qv);
      // dV += P^T dO in T (P rounded to T, fp32 accumulation in acc_dv itself): P^T as the A operand, k = the tile's
      // 64 queries in their natural order (the dO tile's rows, read N-major).
      unsigned pa[4][4];
      pack_acc_as_a16<T>(pa, p);
      issue_a16_k64<T, D>(acc_dv, pa, sdO);
      wgmma_wait<1>();  // dP (dV may still run)
      fence_regs(acc_dp);
#pragma unroll
      for (int nt = 0; nt < 8; ++nt) bwd_ds_ntile(p[nt], acc_dp + 4 * nt, sDel, nt, t4);
      float ymax[2], s_y[2], inv_y[2];
      bwd_y_tile(p, ymax, sQs, t4);  // Y = diag(s_Q) dS in place of dS^T
      if constexpr (DS16) {  // dK += Y^T Q^ in bf16 (k = the tile's queries in order: Q^'s bf16 rows, read N-major)
        unsigned yb[4][4];
        pack_acc_as_a16<__nv_bfloat16>(yb, p);
        issue_a16_k64<__nv_bfloat16, D>(acc_dk, yb, st + Img::Q_Q16);
        wgmma_wait<0>();
        hold_regs(pa);
        hold_regs(yb);
        continue;
      }
      bwd_group_scale(s_y, inv_y, ymax, DS_ROWCOL, 127.f, 1.f / 127.f, sRed, warp, lane);
      unsigned ya[2][4];
      quantize_acc_as_a(ya, p, inv_y);
      int acc_a[32];
      if constexpr (D == 128) {
        int acc_b[32];
        wgmma_fence();
        issue_a64_n64<false>(acc_a, ya, sQt, 0);  // dK, columns 0..63
        wgmma_commit();
        issue_a64_n64<false>(acc_b, ya, sQt, 1);  // dK, columns 64..127
        wgmma_commit();
        wgmma_wait<1>();
        fence_regs(acc_a);
        hold_regs(pa);
        add_dk(acc_a, 0, s_y);
        keep_last_dk(acc_b, ya, s_y);
      } else {
        wgmma_fence();
        issue_a64_n64<false>(acc_a, ya, sQt, 0);
        wgmma_commit();
        wgmma_wait<0>();
        fence_regs(acc_a);
        hold_regs(pa);
        hold_regs(ya);
        add_dk(acc_a, 0, s_y);
      }
    } else {
      float p[8][4], pmax[2], s_p[2], inv_p[2];
      bwd_pt_tile(p, pmax, acc_s, sk, sQs, sL, q0, t4, need_mask, qv);
      bwd_group_scale(s_p, inv_p, pmax, P_COL, p_max, inv_p_max, sRed, warp, lane);
      unsigned pa[2][4];
      quantize_acc_as_a(pa, p, inv_p);
      wgmma_wait<0>();
      fence_regs(acc_dp);
#pragma unroll
      for (int nt = 0; nt < 8; ++nt) bwd_ds_ntile(p[nt], acc_dp + 4 * nt, sDel, nt, t4);

      auto add_dv = [&](const int (&acc)[32], int h) {  // dV += P^^T dO^ * s_P[key] * s_dO[qtile, d]
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          const int nt = 8 * h + j;
          const float2 sd = *reinterpret_cast<const float2*>(sDos + nt * 8 + 2 * t4);
#pragma unroll
          for (int e = 0; e < 4; ++e)
            acc_dv[nt][e] += i2f_small(acc[4 * j + e]) * s_p[e >> 1] * ((e & 1) ? sd.y : sd.x);
        }
      };
      // Products of 64 columns of D each, two buffers: the first dV product runs while Y^ is formed (dS is
      // live until then, so the second waits for it); each buffer is re-issued as soon as it is consumed.
      int acc_a[32], acc_b[32];
      wgmma_fence();
      issue_a64_n64<true>(acc_a, pa, sdOt, 0);  // dV, columns 0..63
      wgmma_commit();
      float ymax[2], s_y[2], inv_y[2];
      bwd_y_tile(p, ymax, sQs, t4);  // Y = diag(s_Q) dS in place of dS^T
      bwd_group_scale(s_y, inv_y, ymax, DS_ROWCOL, 127.f, 1.f / 127.f, sRed, warp, lane);
      unsigned ya[2][4];
      quantize_acc_as_a(ya, p, inv_y);
      if constexpr (D == 128) {
        wgmma_fence();
        issue_a64_n64<true>(acc_b, pa, sdOt, 1);  // dV, columns 64..127
        wgmma_commit();
        wgmma_wait<1>();
        fence_regs(acc_a);
        add_dv(acc_a, 0);
        wgmma_fence();
        issue_a64_n64<false>(acc_a, ya, sQt, 0);  // dK, columns 0..63
        wgmma_commit();
        wgmma_wait<1>();
        fence_regs(acc_b);
        hold_regs(pa);
        add_dv(acc_b, 1);
        wgmma_fence();
        issue_a64_n64<false>(acc_b, ya, sQt, 1);  // dK, columns 64..127
        wgmma_commit();
        wgmma_wait<1>();
        fence_regs(acc_a);
        add_dk(acc_a, 0, s_y);
        keep_last_dk(acc_b, ya, s_y);
      } else {
        wgmma_wait<0>();
        fence_regs(acc_a);
        hold_regs(pa);
        add_dv(acc_a, 0);
        wgmma_fence();
        issue_a64_n64<false>(acc_a, ya, sQt, 0);
        wgmma_commit();
        wgmma_wait<0>();
        fence_regs(acc_a);
        hold_regs(ya);
        add_dk(acc_a, 0, s_y);
      }
    }
  }
  if constexpr (DV16) fence_regs(reinterpret_cast<float(&)[D / 2]>(acc_dv));
  if constexpr (DS16) fence_regs(reinterpret_cast<float(&)[D / 2]>(acc_dk));
  if constexpr (D == 128 && !DS16) add_dk(dk_prev, 1, s_y_prev);  // the last iteration's

  // Epilogue: dV, dK (x ln 2: Q^ carried log2 e) in the caller's layout.
  store_acc_rows<T, D>(dv + bk * vvb + hk * vvh, vvn, acc_dv, key_lo, t4, nk, 1.f);
  store_acc_rows<T, D>(dk + bk * ksb + hk * ksh, ksn, acc_dk, key_lo, t4, nk, 0.6931471805599453f);
}

template <typename T, int D, bool DV16, bool DS16>
__global__ void __launch_bounds__(BWD_THREADS, D == 64 ? BWD90_D64_MIN_CTAS : 1)
int8_attn_bwd_sm90(const char* __restrict__ q_img, const char* __restrict__ k_img, const float* __restrict__ ks,
                   T* __restrict__ dk, long long ksb, long long ksh, long long ksn,
                   T* __restrict__ dv, long long vvb, long long vvh, long long vvn,
                   int Hq, int Hkv, int nq, int nk, int nq_pad, int nk_pad, float p_max,
                   int left, int right, int shift, int p_col, int ds_rowcol) {
  int8_attn_bwd_sm90_impl<T, D, DV16, DS16>(q_img, k_img, ks, dk, ksb, ksh, ksn, dv, vvb, vvh, vvn, Hq, Hkv, nq, nk,
                                            nq_pad, nk_pad, p_max, left, right, shift, p_col, ds_rowcol);
}

// Packed sequences (layout "THD", int8/packed.cuh): grid (padded k rows / 64, Hkv, 1); dk, dv (total_k, Hkv, D) at
// the given strides; the images and key scales in the packed padded layout.
template <typename T, int D, bool DV16, bool DS16>
__global__ void __launch_bounds__(BWD_THREADS, D == 64 ? BWD90_D64_MIN_CTAS : 1)
int8_attn_bwd_sm90_packed(const char* __restrict__ q_img, const char* __restrict__ k_img,
                          const float* __restrict__ ks, T* __restrict__ dk, long long ksh, long long ksn,
                          T* __restrict__ dv, long long vvh, long long vvn, int Hq, int Hkv, float p_max, int left,
                          int right, int p_col, int ds_rowcol, const int* __restrict__ meta, int S, int nbq) {
  // (the token strides as the batch strides: the impl's batch index is then the sequence's first key)
  int8_attn_bwd_sm90_impl<T, D, DV16, DS16, true>(q_img, k_img, ks, dk, ksn, ksh, ksn, dv, vvn, vvh, vvn, Hq, Hkv, 0, 0,
                                                  0, 0, p_max, left, right, 0, p_col, ds_rowcol, meta, S, nbq);
}

// dQ: grid (nq_pad / 64, Hq, B), block 128, dynamic shared memory BwdDqSm90<D, DS16>::SMEM (host: _bwd90_smem).
template <int D, bool DS16 = false>
struct BwdDqSm90 {
  // Q^ (64 x D int8), dO (64 x D 16-bit), then two stages of K^ (64 x D), K^^T (D x 64, mma-permuted) or with DS16
  // K^ in bf16 (64 x D), V (64 x D 16-bit) and the 64 key scales: a key-side image (int8/bwd_img.cuh).
  static constexpr int STAGE = (BwdImg<D, DS16>::K_STAGE + 1023) / 1024 * 1024;
  static constexpr int SMEM = 1024 + 192 * D + 2 * STAGE;
};

template <typename T, int D, bool DS16, bool PACKED = false>
__device__ __forceinline__ void int8_attn_bwd_dq_sm90_impl(const char* __restrict__ q_img,
                      const char* __restrict__ k_img, const float* __restrict__ qs,
                      const float* __restrict__ lse2, const float* __restrict__ delta,
                      T* __restrict__ dq, long long qsb, long long qsh, long long qsn,
                      int Hq, int Hkv, int nq, int nk, int nq_pad, int nk_pad, float sm_scale, int left,
                      int right, int shift, int ds_rowcol, const int* __restrict__ meta = nullptr, int S = 0) {
  static_assert(D == 64 || D == 128, "wgmma tiles of 64 columns");
  using Img = BwdImg<D, DS16>;
  const bool DS_ROWCOL = ds_rowcol != 0;
  Window win{left, right};
  constexpr int STAGE = BwdDqSm90<D, DS16>::STAGE;
  static_assert(Img::K_STAGE <= STAGE && Img::Q_DO == 64 * D, "images are the stages' layout");
  extern __shared__ __align__(128) char smem_raw[];
  char* smem = smem_raw + ((1024u - (smem_u32(smem_raw) & 1023u)) & 1023u);
  char* sQ = smem;
  char* sdO = sQ + BWD_BQ * D;
  char* sStage = sdO + BWD_BQ * D * 2;
  __shared__ float sRed[4];
  __shared__ __align__(8) unsigned long long full[2];  // stage s resident (bulk copies complete)

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, t4 = lane % 4;
  QueryBlock qb = query_block(BWD_BQ, win.causal_shape(), Hq, Hkv);
  int bq = qb.b;  // the caller's dq: batch b, or (packed) the sequence's first row
  if constexpr (PACKED) {  // grid x: the 64-row blocks of the padded q axis (int8/packed.cuh)
    PackedSeq p;
    int s;
    if (!packed_query_seq(meta, S, qb, Hq, Hkv, nq, nk, nq_pad, nk_pad, win, shift, p, s)) return;  // past the last
    const long long qr = static_cast<long long>(Hq) * p.qp, kr = static_cast<long long>(Hkv) * p.kp;
    q_img += qr / BWD_BQ * Img::Q_STAGE, k_img += kr / BWD_BKV * Img::K_STAGE, qs += qr, lse2 += qr, delta += qr;
    bq = p.q0;
  }
  const int q0 = qb.q0, h = qb.h, b = qb.b, hk = h / (Hq / Hkv);
  const long long bh = qb.bh, bhk = qb.bhk;
  const KeyRange tl = key_range(q0, BWD_BQ, nq, nk, win, shift);
  const int n_tiles = max(0, tl.n - tl.first);  // key tiles tl.first + j, j = 0 .. n_tiles - 1

  // The j-th key tile's stage is its key-side image (int8/bwd_img.cuh: K^, K^^T, V, key scales), copied by thread 0
  // with one bulk copy; its completion is phase j / 2 of full[j % 2]. Q^ and dO (the first 192 D bytes of this query
  // tile's image, laid out as sQ, sdO) come with the first.
  if (tid == 0) {
    mbar_init(&full[0], 1);
    mbar_init(&full[1], 1);
    fence_mbar_init();
  }
  __syncthreads();
  auto load_kv = [&](int j) {  // thread 0, after its mbar_arrive_expect_tx
    bulk_copy_g2s(sStage + (j & 1) * STAGE, k_img + (bhk * (nk_pad / BWD_BKV) + tl.first + j) * Img::K_STAGE,
                  Img::K_STAGE, &full[j & 1]);
  };
  if (tid == 0) {
    mbar_arrive_expect_tx(&full[0], 192 * D + (n_tiles > 0 ? Img::K_STAGE : 0));
    bulk_copy_g2s(sQ, q_img + (bh * (nq_pad / BWD_BQ) + q0 / BWD_BQ) * Img::Q_STAGE, 192 * D, &full[0]);
    if (n_tiles > 0) load_kv(0);
    if (n_tiles > 1) {
      mbar_arrive_expect_tx(&full[1], Img::K_STAGE);
      load_kv(1);
    }
  }

  const int r_lo = q0 + warp * 16 + g;  // this thread's rows: r_lo, r_lo + 8
  const int2 rk[2] = {win.row_keys(r_lo, shift, nq, nk), win.row_keys(r_lo + 8, shift, nq, nk)};  // the keys they see
  float sq[2], lse_r[2], del[2];
  bwd_dq_rows(sq, lse_r, del, qs + bh * nq_pad, lse2 + bh * nq_pad, delta + bh * nq_pad, r_lo, nq);
  float acc_dq[D / 8][4];
#pragma unroll
  for (int i = 0; i < D / 8; ++i) acc_dq[i][0] = acc_dq[i][1] = acc_dq[i][2] = acc_dq[i][3] = 0.f;

  // Software pipeline: S and dP of tile j + 1 run on the tensor cores while dQ(j) is converted. S, dP of
  // the first tile are issued here (on whatever the stage holds when the CTA has no tile: waited for, dropped).
  int acc_s[32];
  float acc_dp[32];
  mbar_wait(&full[0], 0);  // Q^, dO, the first tile resident
  issue_s_dp<T, D>(acc_s, acc_dp, sQ, sStage, sdO, sStage + Img::K_V);  // S = Q^ K^^T, dP = dO V^T
  wgmma_wait<1>();
  fence_regs(acc_s);
  // Across the loop's back edge only dP is in flight (one commit group): with more, ptxas can no longer
  // prove which registers are free and serializes every wgmma (C7514).
  for (int j = 0; j < n_tiles; ++j) {
    const int tile = tl.first + j;
    const char* cK = sStage + (j & 1) * STAGE;
    const char* cKt = cK + Img::K_KT;
    const float* cKs = reinterpret_cast<const float*>(cK + Img::K_KS);
    const int k0 = tile * BWD_BKV;
    const bool need_mask = tl.need_mask(tile) || q0 + BWD_BQ > nq;
    float p[8][4], skk[8][2];  // skk: s_K of this thread's keys
    bwd_dq_p_tile(p, skk, acc_s, cKs, sq, lse_r, k0, t4, need_mask, rk);
    wgmma_wait<0>();
    fence_regs(acc_dp);
#pragma unroll
    for (int nt = 0; nt < 8; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) p[nt][e] *= acc_dp[4 * nt + e] - del[e >> 1];  // dS = P o (dP - delta)
    float xmax[2], s_x[2], inv[2];
    bwd_dq_x_tile(p, xmax, skk);  // X = dS diag(s_K)
    unsigned xb[4][4];  // DS16: X in bf16 (k = the tile's keys in order: K^'s bf16 rows, read N-major)
    unsigned xa[2][4];  // else: X^'s codes
    float fx[2];
    int acc_t[D / 2];
    if constexpr (DS16) {  // dQ += X K^ in bf16, into acc_dq itself
      pack_acc_as_a16<__nv_bfloat16>(xb, p);
      issue_a16_k64<__nv_bfloat16, D>(acc_dq, xb, cK + Img::K_K16);
    } else {
      bwd_group_scale(s_x, inv, xmax, DS_ROWCOL, 127.f, 1.f / 127.f, sRed, warp, lane);
      quantize_acc_as_a(xa, p, inv);
      fx[0] = s_x[0] * sm_scale;
      fx[1] = s_x[1] * sm_scale;
      // dQ += X^ K^ * s_X * sm_scale (B = K^^T, keys mma-permuted like X^'s columns).
      const unsigned long long d = gmma_desc<64>(cKt);
      wgmma_fence();
      if constexpr (D == 128) {
        wgmma_m64n128k32_rs_s8s8(acc_t, xa[0], d, 0);
        wgmma_m64n128k32_rs_s8s8(acc_t, xa[1], gmma_desc_advance(d, 32), 1);
      } else {
        wgmma_m64n64k32_rs_s8s8(acc_t, xa[0], d, 0);
        wgmma_m64n64k32_rs_s8s8(acc_t, xa[1], gmma_desc_advance(d, 32), 1);
      }
      wgmma_commit();
    }
    // Tile j + 1 resident (its copy was issued an iteration ago): S and dP of it in flight during the
    // conversion below (DS16: while dQ(j) runs). On the last tile they multiply a stale stage (no copy in flight
    // to it); the result is dropped.
    if (j + 1 < n_tiles) mbar_wait(&full[(j + 1) & 1], ((j + 1) >> 1) & 1);
    {
      const char* nK = sStage + ((j + 1) & 1) * STAGE;
      issue_s_dp<T, D>(acc_s, acc_dp, sQ, nK, sdO, nK + Img::K_V);
    }
    if constexpr (DS16) {
      wgmma_wait<1>();  // dQ(j) and S(j + 1) done (dP(j + 1) may still run)
      hold_regs(xb);
    } else {
      wgmma_wait<2>();  // dQ(j) done
      fence_regs(acc_t);
      hold_regs(xa);
#pragma unroll
      for (int nt = 0; nt < D / 8; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc_dq[nt][e] += i2f_small(acc_t[4 * nt + e]) * fx[e >> 1];
      wgmma_wait<1>();  // S(j + 1) done (dP(j + 1) may still run)
    }
    fence_regs(acc_s);
    __syncthreads();  // every warp past dQ(j): its stage is free for tile j + 2
    if (tid == 0 && j + 2 < n_tiles) {
      mbar_arrive_expect_tx(&full[j & 1], Img::K_STAGE);
      load_kv(j + 2);
    }
  }
  wgmma_wait<0>();  // the last (dropped) S and dP
  fence_regs(acc_s);
  fence_regs(acc_dp);
  if constexpr (DS16) fence_regs(reinterpret_cast<float(&)[D / 2]>(acc_dq));

  // (DS16: X carried no scale to fold per tile, so sm_scale multiplies the sum)
  store_acc_rows<T, D>(dq + bq * qsb + h * qsh, qsn, acc_dq, r_lo, t4, nq, DS16 ? sm_scale : 1.f);
}

template <typename T, int D, bool DS16>
__global__ void __launch_bounds__(BWD_THREADS, D == 64 ? BWD90_D64_MIN_CTAS : 1)
int8_attn_bwd_dq_sm90(const char* __restrict__ q_img, const char* __restrict__ k_img, const float* __restrict__ qs,
                      const float* __restrict__ lse2, const float* __restrict__ delta,
                      T* __restrict__ dq, long long qsb, long long qsh, long long qsn,
                      int Hq, int Hkv, int nq, int nk, int nq_pad, int nk_pad, float sm_scale, int left,
                      int right, int shift, int ds_rowcol) {
  int8_attn_bwd_dq_sm90_impl<T, D, DS16>(q_img, k_img, qs, lse2, delta, dq, qsb, qsh, qsn, Hq, Hkv, nq, nk, nq_pad,
                                         nk_pad, sm_scale, left, right, shift, ds_rowcol);
}

// Packed sequences (layout "THD", int8/packed.cuh): grid (padded q rows / 64, Hq, 1).
template <typename T, int D, bool DS16>
__global__ void __launch_bounds__(BWD_THREADS, D == 64 ? BWD90_D64_MIN_CTAS : 1)
int8_attn_bwd_dq_sm90_packed(const char* __restrict__ q_img, const char* __restrict__ k_img,
                             const float* __restrict__ qs, const float* __restrict__ lse2,
                             const float* __restrict__ delta, T* __restrict__ dq, long long qsh, long long qsn, int Hq,
                             int Hkv, float sm_scale, int left, int right, int ds_rowcol,
                             const int* __restrict__ meta, int S) {
  // (the token strides as the batch strides: the impl's batch index is then the sequence's first row)
  int8_attn_bwd_dq_sm90_impl<T, D, DS16, true>(q_img, k_img, qs, lse2, delta, dq, qsn, qsh, qsn, Hq, Hkv, 0, 0, 0, 0,
                                               sm_scale, left, right, 0, ds_rowcol, meta, S);
}
