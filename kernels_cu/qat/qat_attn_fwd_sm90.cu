// FP4 QAT forward (Attn-QAT-style, docs/algorithms.md §6) on Hopper tensor cores (sm_90a only): the numerics of
// qat_attn_fwd (fp4_attn_fwd.cu: the same per-tile softmax, P quantization and P~, common/fp4_fwd.cuh), with every
// product on wgmma (fp16, fp32 accumulation):
//   S  = Q~ K~^T      m64n64k16 SS   (Q~, K~ K-major tiles)
//   O  += P^ V~       m64nDk16 RS    (P^: NVFP4 of x, exact fp16 A fragments; V~^T K-major tile)
//   O' += P~ V~       m64nDk16 RS    (P~ = beta x rounded to fp16, as the mma.sync kernel)
// CTA = two warpgroups (8 warps, 128 query rows), one per m64 product. K~ and V~^T tiles arrive by cp.async
// (each thread copies its share) in 4-stage rings handed over with mbarriers (full: every thread's copies of the
// tile landed; k_empty / v_empty: every thread's products on the stage retired). Per key tile t, per warpgroup:
// softmax(t); issue the O, O' products of t; copy tile t+3 into the stage tile t-1 held (once it is free); this
// thread's copies of t+2 landed -> arrive on full(t+2); wait for full(t+1), issue S(t+1); retire (D = 64: retire
// the O, O' products first, then issue S(t+1): RETIRE_PV_FIRST below). A warpgroup thus waits for the other only a
// tile behind.
//
// Registers: O and O' take D / 2 each per thread; a separate accumulator for P^ V~ (which the mma.sync and the
// NVFP4 wgmma kernels keep, to form O = alpha O + beta P^V~) does not fit beside them. So O is accumulated in
// place in the frame of the last tile it took: O_f = O / beta_f with beta_f = 2^(r_f - m) / 2688 (r_f: that
// tile's row max, m the running max). Taking tile t (row max r_t) is O_f = 2^(r_f - r_t) O_f + P^_t V~ (alpha
// cancels), then r_f = r_t; the end multiplies by 2^(r_f - m) / 2688. The products stay exact. What differs
// from the mma.sync kernel's O = alpha O + beta acc is the fp32 scaling: the frame changes on nearly every tile
// (each tile's max differs), and each change is an ex2.approx (~2^-22 relative) applied to everything taken so
// far, so an early tile's weight drifts by up to T 2^-22 after T tiles (about sqrt(T) 2^-22 for unbiased
// errors): <= 6e-5 at 16K keys, ~5e-4 at 128K (the mma.sync kernel makes one such error per tile, not compounded;
// tests/cpu/test_ref_fp4.py emulates the rule). A row skips a tile whose max is more than FP4_FRAME_GAP (base 2)
// below its running max: its P^ weights are below 2^-FP4_FRAME_GAP of the row's largest (the mma.sync kernel adds
// them, below fp32 resolution unless O cancels to < 2^-36 of its terms). Bound: |O_f| <= 2^FP4_FRAME_GAP (largest
// frame change kept) x 2688 (largest P^) x 2688 (largest |V~|: NVFP4 saturates at 448 x 6) x N, below fp32's
// maximum for any N < 2^45. The row sum l and O' keep every tile.
//
// Operands as qat_attn_fwd's: q16 (BHq, nq_pad, D), k16 (BHkv, nk_pad, D), vt16 (BHkv, D, nk_pad) fp16, zero
// beyond nq / nk (nq_pad a multiple of 128, nk_pad of 64). Outputs and the window (left, right) as qat_attn_fwd's: a
// CTA visits the key tiles its rows see (common/rows.cuh key_range), taken as tiles 0, 1, .. of the keys from the
// range's first one on (operand pointers relative to that key; the masks take absolute keys), so that the ring's
// stages and mbarrier phases run as for a range that starts at key 0.
#include "common/fp4_fwd.cuh"
#include "common/rows.cuh"
#include "common/tile.cuh"
#include "common/wgmma.cuh"

// CTAs per SM the D = 64 kernel's registers are budgeted for (__launch_bounds__): two, 128 registers (166 -> 128,
// 56 bytes of spills), instead of one: QAT forward 1.00-1.08x end to end on the H200 (bitwise the same outputs;
// docs/experiments.md).
#ifndef SAGE_QAT_FWD_MIN_CTAS
#define SAGE_QAT_FWD_MIN_CTAS 2
#endif

using namespace sage;

namespace {

constexpr int QF_BKV = 64, QF_THREADS = 256, QF_BQ = 128, QF_NST = 4;

// D = 64: O and O' of tile t retired before Q.K^T(t+1) is issued (RETIRE_PV_FIRST), instead of all three in flight
// together: at the 2-CTA budget (128 registers) ptxas otherwise serializes every wgmma (C7512, flagged by
// .ci/compile_kernels.py). QAT forward 1.065-1.083x end to end at D = 64 (the same float operations, so the same
// outputs; docs/experiments.md).

template <int D>
struct QatFwdSm90 {
  static constexpr bool RETIRE_PV_FIRST = D == 64;
  static constexpr int Q_BYTES = QF_BQ * 2 * D, K_BYTES = QF_BKV * 2 * D, V_BYTES = D * QF_BKV * 2;
  static constexpr int BARS = 3 * QF_NST * 8;
  // Q~, the K~ and V~^T rings, the mbarriers; + 1024 for the tiles' alignment (host: nvfp4.qat_fwd_sm90_smem_bytes)
  static constexpr int SMEM = Q_BYTES + QF_NST * (K_BYTES + V_BYTES) + BARS + 1024;
};

}  // namespace

// Grid (nq_pad / 128, Hq, B), block 256, dynamic shared memory QatFwdSm90<D>::SMEM. CG: as nvfp4_attn_fwd_sm90's
// (dispatch groups for windows of the causal work shape; the host instantiates FP4_CAUSAL_GROUP for those calls, 1
// otherwise).
template <typename T, int D, int CG = 1>
__global__ void __launch_bounds__(QF_THREADS, D == 64 ? SAGE_QAT_FWD_MIN_CTAS : 1)
qat_attn_fwd_sm90(const __half* __restrict__ q16, const __half* __restrict__ k16, const __half* __restrict__ vt16,
                  T* __restrict__ o, long long osb, long long osh, long long osn,
                  float* __restrict__ lse, float* __restrict__ lse2, float* __restrict__ oprime,
                  int Hq, int Hkv, int nq, int nk, int nq_pad, int nk_pad, float scale_log2, int left, int right) {
  using S = QatFwdSm90<D>;
  static_assert(D == 64 || D == 128, "head dim 64 or 128 (wgmma N = D)");
  const Window win{left, right};
  extern __shared__ __align__(128) char smem_raw[];
  char* smem = smem_raw + ((1024u - (smem_u32(smem_raw) & 1023u)) & 1023u);
  char* sQ = smem;                        // D / 64 pieces x 128 rows x 128 B
  char* sK = sQ + S::Q_BYTES;             // NST stages x D / 64 pieces x 64 rows x 128 B
  char* sV = sK + QF_NST * S::K_BYTES;    // NST stages x D rows (channels) x 64 tokens
  unsigned long long* bars = reinterpret_cast<unsigned long long*>(sV + QF_NST * S::V_BYTES);
  unsigned long long* full = bars;
  unsigned long long* k_empty = bars + QF_NST;
  unsigned long long* v_empty = bars + 2 * QF_NST;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, t4 = lane % 4;
  const QueryBlock qb = query_block<CG>(QF_BQ, win.causal_shape(), Hq, Hkv);
  const int q0 = qb.q0, h = qb.h, b = qb.b;
  const long long bh = qb.bh, bhk = qb.bhk;
  const int shift = nk - nq;
  const KeyRange tl = key_range<QF_BKV>(q0, QF_BQ, nq, nk, win);
  // tile t (0 .. ntl - 1) below is key tile tl.first + t: keys from kb on
  const int ntl = tl.n - tl.first, kb = tl.first * QF_BKV;
  const int fm = tl.first_masked - tl.first, mb = tl.masked_below - tl.first;  // tiles t >= fm or < mb: masked
  if (tid < 3 * QF_NST) mbar_init(bars + tid, QF_THREADS);

  const TileCopy<QF_BQ, 2 * D, QF_THREADS, true> cq(tid);
  const TileCopy<QF_BKV, 2 * D, QF_THREADS, true> ck(tid);
  const TileCopy<D, 2 * QF_BKV, QF_THREADS, true> cv(tid);
  const char* gK = reinterpret_cast<const char*>(k16 + (bhk * nk_pad + kb) * D);
  const char* gV = reinterpret_cast<const char*>(vt16 + bhk * D * nk_pad + kb);
  auto load_tile = [&](int t, int st) {  // this thread's share of tile t -> stage st
    ck.copy(sK + st * S::K_BYTES, gK + static_cast<long long>(t) * QF_BKV * 2 * D, 2 * D);
    cv.copy(sV + st * S::V_BYTES, gV + static_cast<long long>(t) * QF_BKV * 2, static_cast<long long>(nk_pad) * 2);
  };
  cq.copy(sQ, reinterpret_cast<const char*>(q16 + (bh * nq_pad + q0) * D), 2 * D);
#pragma unroll
  for (int t = 0; t < 3; ++t) {  // commit groups: {Q~, tile 0}, {tile 1}, {tile 2} (possibly empty)
    if (t < ntl) load_tile(t, t);
    cp_async_commit();
  }
  cp_async_wait<2>();   // Q~ and tile 0: this thread's copies landed
  fence_proxy_async();  // -> the tensor cores' reads
  __syncthreads();      // every thread's Q~ copies; the mbarriers initialized
  if (ntl > 0) mbar_arrive(full);
  cp_async_wait<1>();
  fence_proxy_async();
  if (ntl > 1) mbar_arrive(full + 1);

  const int r_lo = q0 + warp * 16 + g;  // this thread's rows: r_lo, r_lo + 8
  Fp4Rows rs = {{-INFINITY, -INFINITY}, {0.f, 0.f}};
  Fp4Frame fr = {{-INFINITY, -INFINITY}};  // the frame of O: row max of the last tile taken
  float acc_o[D / 8][4], acc_op[D / 8][4];
#pragma unroll
  for (int i = 0; i < D / 8; ++i)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc_o[i][e] = acc_op[i][e] = 0.f;
  float acc_s[8][4];
  float(&accs)[32] = reinterpret_cast<float(&)[32]>(acc_s);
  const char* sQw = sQ + (warp / 4) * 64 * 128;  // this warpgroup's 64 rows, in every piece
  static_assert(QF_BKV == 64, "64-key tiles");
  auto issue_qk = [&](int kst) { wgmma_qk16<D, QF_BQ>(accs, sQw, sK, kst * S::K_BYTES); };
  const unsigned long long dv0 = gmma_desc<128>(sV);
  if (ntl > 0) {
    mbar_wait(full, 0);
    wgmma_fence();
    issue_qk(0);
    wgmma_wait<0>();
    fence_regs(accs);
    mbar_arrive(k_empty);
  }

  // Tile j lives in stage j % NST; its barriers' phase parity is (j / NST) & 1.
  static_assert(QF_NST == 4, "stage and parity by shifts");
  for (int tile = 0; tile < ntl; ++tile) {
    unsigned pa[4][4], pp[4][4];
    const Fp4TileScale ts = fp4_softmax_tile<true, true, true>(acc_s, rs, pa, pp, tl.first + tile,
                                                               tile >= fm || tile < mb, win, r_lo, t4, nk, shift,
                                                               scale_log2);
    fp4_frame_step<true>(acc_o, fr, ts);  // the frame change of O (see the top)
    if (ts.rescale) {  // O' = alpha O' + P~ V~ (the mma.sync kernel's order)
#pragma unroll
      for (int j = 0; j < D / 8; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc_op[j][e] *= ts.alpha[e >> 1];
    }
    const int st0 = tile & 3, st1 = (tile + 1) & 3;
    wgmma_fence();
    {  // O += P^ V~(t), O' += P~ V~(t)
      const unsigned long long dv = gmma_desc_advance(dv0, st0 * S::V_BYTES);
#pragma unroll
      for (int kk = 0; kk < 4; ++kk)
        wgmma_rs<__half, false>(reinterpret_cast<float(&)[D / 2]>(acc_o), pa[kk], gmma_desc_advance(dv, 32 * kk), 1);
#pragma unroll
      for (int kk = 0; kk < 4; ++kk)
        wgmma_rs<__half, false>(reinterpret_cast<float(&)[D / 2]>(acc_op), pp[kk], gmma_desc_advance(dv, 32 * kk), 1);
      wgmma_commit();
    }
    // While they run: this thread's copies of tile t+3 into the stage of tile t-1 once every thread is done with
    // it; then this thread's copies of tile t+2 (the older pending group) have landed: arrive on full(t+2).
    if (tile + 3 < ntl) {
      if (tile >= 1) {
        const unsigned par = ((tile - 1) >> 2) & 1;
        mbar_wait(k_empty + ((tile - 1) & 3), par);
        mbar_wait(v_empty + ((tile - 1) & 3), par);
      }
      load_tile(tile + 3, (tile + 3) & 3);
    }
    cp_async_commit();
    cp_async_wait<1>();
    if (tile + 2 < ntl) {
      fence_proxy_async();
      mbar_arrive(full + ((tile + 2) & 3));
    }
    const bool more = tile + 1 < ntl;
    if constexpr (QatFwdSm90<D>::RETIRE_PV_FIRST) {
      // O, O' of tile t retired before S(t+1) is issued: P^ / P~ (32 registers) are free for S(t+1)'s accumulator
      wgmma_wait<0>();
      fence_regs(reinterpret_cast<float(&)[D / 2]>(acc_o));
      fence_regs(reinterpret_cast<float(&)[D / 2]>(acc_op));
      hold_regs(pa);
      hold_regs(pp);
      mbar_arrive(v_empty + st0);
      if (more) mbar_wait(full + st1, ((tile + 1) >> 2) & 1);
      wgmma_fence();
      issue_qk(st1);    // S(t+1) (after the last tile: a stale or never-written stage, no copy in flight; dropped)
      wgmma_wait<0>();  // S(t+1) done
      fence_regs(accs);
    } else {
      if (more) mbar_wait(full + st1, ((tile + 1) >> 2) & 1);
      wgmma_fence();
      issue_qk(st1);    // S(t+1) (after the last tile: a stale or never-written stage, no copy in flight; dropped)
      wgmma_wait<1>();  // O, O' products of tile t done
      fence_regs(reinterpret_cast<float(&)[D / 2]>(acc_o));
      fence_regs(reinterpret_cast<float(&)[D / 2]>(acc_op));
      hold_regs(pa);
      hold_regs(pp);
      mbar_arrive(v_empty + st0);
      wgmma_wait<0>();  // S(t+1) done
      fence_regs(accs);
    }
    if (more) mbar_arrive(k_empty + st1);
  }
  cp_async_wait<0>();  // nothing may land in shared memory after the CTA exits

  fp4_frame_finish<true>(acc_o, fr, rs);  // O = O_f 2^(r_f - m) / 2688
  fp4_fwd_epilogue<T, D, true>(acc_o, acc_op, rs, o + b * osb + h * osh, osn, oprime + bh * nq_pad * D, lse + bh * nq,
                               lse2 + bh * nq_pad, nullptr, r_lo, t4, nq, nq_pad);
}
