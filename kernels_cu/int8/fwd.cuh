// The SageBwd forward's body, shared by the mma.sync kernel (int8_attn_fwd.cu) and the Hopper wgmma
// kernel (int8_attn_fwd_sm90.cu). See int8_attn_fwd.cu for the algorithm and the operands.
#pragma once
#include "common/mma.cuh"
#include "common/numeric.cuh"
#include "int8/bwd_img.cuh"
#include "int8/packed.cuh"
#include "common/rows.cuh"
#include "common/tile.cuh"
#include "common/wgmma.cuh"

namespace sage {

// Keys per tile, BKV (a template parameter of the kernels): SageBwdConfig.block_kv, 64 or 128. P is
// quantized per token per tile, so it changes the numbers (the reference mirrors it).

// ---- Pieces shared by the two engines (the same float operations in the same order, so the engines
// agree bit for bit) ----

// How far (base-2 logit units) a tile's max may exceed the running max before the softmax frame moves
// (fwd_softmax_tile); against 0 (the running max follows every tile max) see docs/experiments.md.
constexpr float FWD_RESCALE_SLACK = 8.f;

// Where key tile t of V^^T starts and the distance between its D channel rows (the mma.sync engine; the wgmma engine
// reads the pre-pass's K/V stage images instead). With 64-key tiles V^^T is stored
// tile-major (the pre-pass, quant_transpose_perm tile_major = 1: each tile's D x 64 bytes contiguous), so a warp's
// cp.async rows read whole 128-byte lines; 128-key tiles read 128-byte rows of the (D, nk_pad) layout.
template <int D, int BKV>
struct FwdVt {
  __device__ static long long offset(int t) { return static_cast<long long>(t) * (BKV == 64 ? D * BKV : BKV); }
  __device__ static long long stride(int nk_pad) { return BKV == 64 ? BKV : nk_pad; }
};

// Per-thread row state of the online softmax: rows r_lo and r_lo + 8 of the warp's 16.
struct FwdRows {
  float sq[2];     // Q row scales (times log2 e)
  float m[2];      // running max of the base-2 logits
  float l[2];      // running sum of the unquantized P~ (this thread's columns; quad-summed at the end)
};

// What one tile's softmax hands to the P.V update: O = alpha * O + (P^ V^) * spv, rescale = any alpha != 1.
struct FwdTileScale {
  float alpha[2], spv[2];
  bool rescale;
};

// Softmax of one 16 x BKV tile of S (BKV = 8 NT keys: 64 or 128; int32 from the tensor cores, acc layout
// of mma.cuh): dequantize by the key scale, mask, online max, P~ = exp2(S - m), row sums,
// P^ = rint(P~ * factor) packed as the A operand of P.V (pa[kstep]: keys 32 kstep .. 32 kstep + 31). P is
// quantized per row over the whole tile (SageBwdConfig.block_kv). ks_tile: the tile's BKV key scales
// (shared memory); vs_blk: V's scale of this 64-key block (per-block V, BKV = 64 only) or null;
// need_mask: mask keys outside rk[r] (Window::keys of this thread's rows r_lo + 8 r);
// inv_p_max = 1 / p_max. Maxima and sums are trees (short dependency chains).
// The tile's logits s (dequantized by the key scales, masked to -inf) and this thread's maxima of its two rows (before
// the quad's max), for both forms of P.V (fwd_softmax_tile, fwd_frame16).
template <int NT>
__device__ __forceinline__ void fwd_tile_logits(const int (&acc_s)[NT][4], float (&s)[NT][4], float (&mx)[2],
                                                const float* ks_tile, int tile, bool need_mask, const int2 (&rk)[2],
                                                int t4) {
  static_assert(NT == 8 || NT == 16, "tiles of 64 or 128 keys");
  // This thread's key scales: columns 8 nt + 2 t4, 8 nt + 2 t4 + 1 of the tile, one 8-byte shared load each at an
  // immediate offset from one address (in the build CuPy runs, ks_tile[kt] took two address instructions per
  // load). The loads are plain asm (the compiler schedules them: volatile ones measured the forward kernel 10%
  // slower) on an address that after_barriers keeps behind the stage's barriers. Kernel 1.01-1.02x
  // (docs/experiments.md).
  const unsigned ks_addr = after_barriers(smem_u32(ks_tile) + 8 * t4);
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
    const int kt = nt * 8 + 2 * t4, key = tile * (8 * NT) + kt;
    const float2 sk = lds_f2(ks_addr + 32 * nt);
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      float v = i2f_small(acc_s[nt][e]) * ((e & 1) ? sk.y : sk.x);
      if (need_mask) {
        const int kk = key + (e & 1);
        if (kk < rk[e >> 1].x || kk > rk[e >> 1].y) v = -INFINITY;
      }
      s[nt][e] = v;
    }
  }
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float t[NT];
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) t[nt] = fmaxf(s[nt][2 * r], s[nt][2 * r + 1]);
    tree_fold(t, FMaxOp());
    mx[r] = t[0];
  }
}

template <int NT>
__device__ __forceinline__ FwdTileScale fwd_softmax_tile(const int (&acc_s)[NT][4], FwdRows& rs,
                                                         unsigned (&pa)[NT / 4][4], const float* ks_tile,
                                                         const float* __restrict__ vs_blk, int tile, bool need_mask,
                                                         const int2 (&rk)[2], int t4, float p_max, float inv_p_max) {
  float s[NT][4], mx[2];
  fwd_tile_logits<NT>(acc_s, s, mx, ks_tile, tile, need_mask, rk, t4);
  FwdTileScale ts;
  float factor[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    mx[r] = quad_max(mx[r]) * rs.sq[r];  // s_Q > 0, so the max commutes with the row scale
    // Lazy frame: the running max m moves only when a tile's max exceeds it by more than the slack, so
    // P~ = exp2(S - m) <= 2^SLACK and O's rescale (an FMUL per O element) is skipped on almost every tile.
    // P^ does not depend on m (its factor carries exp2(m - tile max)), and O / l and LSE = m + log2 l are
    // the same numbers up to fp32 rounding.
    const float m_new = mx[r] > rs.m[r] + FWD_RESCALE_SLACK ? mx[r] : rs.m[r];
    const float m_use = m_new == -INFINITY ? 0.f : m_new;
    ts.alpha[r] = fast_exp2(rs.m[r] - m_use);  // exp2(0) = 1 exactly: the rescale test below stays exact
    // >= -SLACK; clamped above: such a tile contributes < 2^-64
    const float gap = fminf(m_use - mx[r], 64.f);
    factor[r] = p_max * fast_exp2(gap);
    ts.spv[r] = fast_exp2(-gap) * inv_p_max;
    rs.m[r] = m_new;
    mx[r] = -m_use;  // reuse: minus the exponent base
  }
  // Rescaling O by alpha only when some row's max moved (warp-uniform; alpha == 1 is exact otherwise).
  ts.rescale = __any_sync(0xffffffffu, ts.alpha[0] != 1.f || ts.alpha[1] != 1.f);
  // -0 + p is p for every p (0 + p needs an FADD: the compiler cannot assume p != -0)
  float lsum[2][4] = {{-0.f, -0.f, -0.f, -0.f}, {-0.f, -0.f, -0.f, -0.f}};
#pragma unroll
  for (int np = 0; np < NT / 2; ++np) {
    unsigned c[2][4];
#pragma unroll
    for (int j = 0; j < 2; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float p = fast_exp2(fmaf(s[2 * np + j][e], rs.sq[e >> 1], mx[e >> 1]));
        lsum[e >> 1][2 * j + (e & 1)] += p;
        c[j][e] = rn_fma_bits(p, factor[e >> 1]);
      }
    pack_acc_pair_as_a(pa, np, c[0], c[1]);
  }
  rs.l[0] = fmaf(rs.l[0], ts.alpha[0], (lsum[0][0] + lsum[0][1]) + (lsum[0][2] + lsum[0][3]));
  rs.l[1] = fmaf(rs.l[1], ts.alpha[1], (lsum[1][0] + lsum[1][1]) + (lsum[1][2] + lsum[1][3]));
  if (vs_blk) {
    const float sv = *vs_blk;  // V per 64-token block: its scale (repeated over D)
    ts.spv[0] *= sv;
    ts.spv[1] *= sv;
  }
  return ts;
}

// fwd_softmax_tile for the 16-bit P.V (SageBwdConfig.pv_int8=False), in pieces (fwd_frame16, fwd_exp16, fwd_lsum16):
// the same logits, mask, tile max and lazy frame, then P~ = exp2(S - m) in the running frame m itself
// (<= 2^FWD_RESCALE_SLACK), rounded to T pairwise as the A operand of P.V in T (pa[kk]: keys 16 kk .. 16 kk + 15,
// bwd.cuh pack_acc_as_a16's layout); the row sums add the unrounded P~. O is accumulated by the tensor cores in the
// frame: the caller rescales it by alpha before P.V(t).
template <int NT>
__device__ __forceinline__ FwdTileScale fwd_frame16(const int (&acc_s)[NT][4], float (&s)[NT][4], float (&mx)[2],
                                                    FwdRows& rs, const float* ks_tile, int tile, bool need_mask,
                                                    const int2 (&rk)[2], int t4) {
  fwd_tile_logits<NT>(acc_s, s, mx, ks_tile, tile, need_mask, rk, t4);
  FwdTileScale ts;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    mx[r] = quad_max(mx[r]) * rs.sq[r];
    const float m_new = mx[r] > rs.m[r] + FWD_RESCALE_SLACK ? mx[r] : rs.m[r];
    const float m_use = m_new == -INFINITY ? 0.f : m_new;
    ts.alpha[r] = fast_exp2(rs.m[r] - m_use);
    ts.spv[r] = 1.f;
    rs.m[r] = m_new;
    mx[r] = -m_use;
  }
  ts.rescale = __any_sync(0xffffffffu, ts.alpha[0] != 1.f || ts.alpha[1] != 1.f);
  return ts;
}

// P~ of n-tiles NT0 .. NT1 - 1 of the tile (fwd_frame16's logits s and exponent base mx) into pa, their sums into lsum.
template <typename T, int NT, int NT0, int NT1>
__device__ __forceinline__ void fwd_exp16(const float (&s)[NT][4], const float (&mx)[2], const FwdRows& rs,
                                          unsigned (&pa)[NT / 2][4], float (&lsum)[2][4]) {
#pragma unroll
  for (int nt = NT0; nt < NT1; ++nt) {
    float p[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      p[e] = fast_exp2(fmaf(s[nt][e], rs.sq[e >> 1], mx[e >> 1]));
      lsum[e >> 1][(nt & 1) * 2 + (e & 1)] += p[e];
    }
    pa[nt / 2][2 * (nt & 1)] = pack2<T>(p[0], p[1]);
    pa[nt / 2][2 * (nt & 1) + 1] = pack2<T>(p[2], p[3]);
  }
}

__device__ __forceinline__ void fwd_lsum16(FwdRows& rs, const FwdTileScale& ts, const float (&lsum)[2][4]) {
  rs.l[0] = fmaf(rs.l[0], ts.alpha[0], (lsum[0][0] + lsum[0][1]) + (lsum[0][2] + lsum[0][3]));
  rs.l[1] = fmaf(rs.l[1], ts.alpha[1], (lsum[1][0] + lsum[1][1]) + (lsum[1][2] + lsum[1][3]));
}

// O columns 8 nt .. 8 nt + 7 (acc layout): O = alpha * O + (P^ V^) * spv.
__device__ __forceinline__ void fwd_pv_update(float (&o)[4], const int* pv, const FwdTileScale& ts) {
  if (ts.rescale) {
#pragma unroll
    for (int e = 0; e < 4; ++e) o[e] = fmaf(o[e], ts.alpha[e >> 1], i2f_small(pv[e]) * ts.spv[e >> 1]);
  } else {
#pragma unroll
    for (int e = 0; e < 4; ++e) o[e] = fmaf(i2f_small(pv[e]), ts.spv[e >> 1], o[e]);
  }
}

// fwd_pv_update over all D / 8 column groups of O (pv: D / 2 accumulators), the rescale test taken once.
template <int D>
__device__ __forceinline__ void fwd_pv_update_all(float (&o)[D / 8][4], const int* pv, const FwdTileScale& ts) {
  if (ts.rescale) {
#pragma unroll
    for (int nt = 0; nt < D / 8; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e)
        o[nt][e] = fmaf(o[nt][e], ts.alpha[e >> 1], i2f_small(pv[4 * nt + e]) * ts.spv[e >> 1]);
  } else {
#pragma unroll
    for (int nt = 0; nt < D / 8; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) o[nt][e] = fmaf(i2f_small(pv[4 * nt + e]), ts.spv[e >> 1], o[nt][e]);
  }
}

// Epilogue: normalize, per-channel V scale, store O (T), LSE and the base-2 LSE the backward reads.
template <typename T, int D>
__device__ __forceinline__ void fwd_epilogue(float (&acc_o)[D / 8][4], FwdRows& rs, const float* __restrict__ vs_ch,
                                             T* __restrict__ o_bh, long long osn, float* __restrict__ lse_bh,
                                             float* __restrict__ lse2_bh, const float* __restrict__ qmk_bh, int r_lo,
                                             int t4, int nq, int nq_pad) {
#pragma unroll
  for (int r = 0; r < 2; ++r) rs.l[r] = quad_sum(rs.l[r]);
  // l == 0: the row sees no key (O = 0, LSE = -inf). A NaN l (NaN or Inf among the inputs) stays NaN.
  const float inv_l[2] = {rs.l[0] == 0.f ? 0.f : 1.f / rs.l[0], rs.l[1] == 0.f ? 0.f : 1.f / rs.l[1]};
#pragma unroll
  for (int nt = 0; nt < D / 8; ++nt) {
    const int col = nt * 8 + 2 * t4;
    float2 sv = make_float2(1.f, 1.f);
    if (vs_ch) sv = *reinterpret_cast<const float2*>(vs_ch + col);
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = r_lo + 8 * r;
      if (row < nq) {
        const unsigned packed = pack2<T>(acc_o[nt][2 * r] * sv.x * inv_l[r], acc_o[nt][2 * r + 1] * sv.y * inv_l[r]);
        *reinterpret_cast<unsigned*>(o_bh + row * osn + col) = packed;
      }
    }
  }
  if (t4 == 0) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = r_lo + 8 * r;
      const float l2 = rs.l[r] == 0.f ? INFINITY : rs.m[r] + log2f(rs.l[r]);
      if (row < nq)
        lse_bh[row] = rs.l[r] == 0.f ? -INFINITY : l2 * 0.6931471805599453f + (qmk_bh ? qmk_bh[row] : 0.f);
      if (lse2_bh && row < nq_pad) lse2_bh[row] = row < nq ? l2 : INFINITY;
    }
  }
}

// Row scales; an all-zero row (scale 0) uses a tiny positive scale instead so that a masked logit
// (-inf) times it stays -inf rather than NaN; its logits are 0 either way. NaN scales stay NaN.
__device__ __forceinline__ FwdRows fwd_rows_init(const float* __restrict__ qs_bh, int r_lo) {
  FwdRows rs;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const float x = qs_bh[r_lo + 8 * r];
    rs.sq[r] = (x > 1e-30f || x != x) ? x : 1e-30f;
    rs.m[r] = -INFINITY;
    rs.l[r] = 0.f;
  }
  return rs;
}

// S = Q^ K^T (int32) of a warp's 16 rows (A fragments qf) against a tile of 8 NT keys of K^ codes
// (swizzled rows of D bytes), with mma.sync m16n8k32.
template <int D, int NT = 8>
__device__ __forceinline__ void qk_s8(int (&acc_s)[NT][4], const unsigned (&qf)[D / 32][4], const char* cK, int lane) {
#pragma unroll
  for (int i = 0; i < NT; ++i) acc_s[i][0] = acc_s[i][1] = acc_s[i][2] = acc_s[i][3] = 0;
#pragma unroll
  for (int kstep = 0; kstep < D / 32; ++kstep) {
#pragma unroll
    for (int np = 0; np < NT / 2; ++np) {
      unsigned bk[4];
      ldsm_x4<D, false>(bk, cK, np * 16, 2 * kstep, lane);
      const unsigned b0[2] = {bk[0], bk[1]}, b1[2] = {bk[2], bk[3]};
      mma_s8s8(acc_s[2 * np], qf[kstep], b0);
      mma_s8s8(acc_s[2 * np + 1], qf[kstep], b1);
    }
  }
}

// ---- mma.sync forward (sm_80+) ----
// WARPS = 4 warps of 16 query rows each (64 rows; int8.py _FWD_WARPS); tiles of BKV keys (64 or 128); K/V tiles
// double-buffered with cp.async.
template <typename T, int D, int WARPS, int BKV, bool PACKED = false>
__device__ __forceinline__ void int8_attn_fwd_impl(const signed char* __restrict__ qc, const float* __restrict__ qs,
              const signed char* __restrict__ kc, const float* __restrict__ ks,
              const signed char* __restrict__ vt, const float* __restrict__ vs,
              const float* __restrict__ qmk,
              T* __restrict__ o, long long osb, long long osh, long long osn,
              float* __restrict__ lse, float* __restrict__ lse2,
              int Hq, int Hkv, int nq, int nk, int nq_pad, int nk_pad, float p_max, int left, int right,
              int shift, int v_block, const int* __restrict__ meta = nullptr, int S = 0, int total_q = 0) {
  static_assert(WARPS == 4, "4 warps");
  static_assert(BKV == 64 || BKV == 128, "tiles of 64 or 128 keys");
  static_assert(D <= 128, "i2f_small is exact for |int32| < 2^22: 127 * 127 * D and 255 * 127 * BKV must stay below");
  constexpr int FWD_BQ = 16 * WARPS, FWD_THREADS = 32 * WARPS, NT = BKV / 8;
  const bool V_BLOCK = BKV == 64 && v_block != 0;  // per-block V: 64-key tiles (host)
  Window win{left, right};
  extern __shared__ __align__(128) char smem_raw[];
  // Pointer arithmetic (not an integer cast) keeps the compiler aware that this is shared memory, so plain
  // reads of it compile to LDS rather than generic loads.
  char* smem = smem_raw + ((1024u - (smem_u32(smem_raw) & 1023u)) & 1023u);
  char* sQ = smem;                               // FWD_BQ x D
  char* sK = sQ + FWD_BQ * D;                    // 2 stages x BKV x D
  char* sV = sK + 2 * BKV * D;                   // 2 stages x D x BKV
  float* sKs = reinterpret_cast<float*>(sV + 2 * D * BKV);  // 2 stages x BKV key scales
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, t4 = lane % 4;
  QueryBlock qb = query_block(FWD_BQ, win.causal_shape(), Hq, Hkv);
  int lse_n = nq;  // the LSE's row length: (B, Hq, nq), packed (Hq, total_q)
  if constexpr (PACKED) {  // grid x: the 64-row blocks of the padded q axis (int8/packed.cuh)
    PackedSeq p;
    int s;
    if (!packed_query_seq(meta, S, qb, Hq, Hkv, nq, nk, nq_pad, nk_pad, win, shift, p, s)) return;  // past the last
    lse_n = total_q;
    const long long qr = static_cast<long long>(Hq) * p.qp, kr = static_cast<long long>(Hkv) * p.kp;
    qc += qr * D, qs += qr, kc += kr * D, ks += kr, vt += kr * D, o += p.q0 * osn, lse += p.q0;
    vs += V_BLOCK ? kr / 64 * D : static_cast<long long>(s) * Hkv * D;  // per 64-key block, or per sequence
    if (qmk) qmk += qr;
    if (lse2) lse2 += qr;
  }
  const int q0 = qb.q0, h = qb.h, b = qb.b;
  const long long bh = qb.bh, bhk = qb.bhk;
  const KeyRange tl = key_range<BKV>(q0, FWD_BQ, nq, nk, win, shift);  // tiles tl.first .. tl.n - 1

  const char* gK = reinterpret_cast<const char*>(kc + bhk * nk_pad * D);
  const char* gV = reinterpret_cast<const char*>(vt + bhk * D * nk_pad);
  load_tile_async<FWD_BQ, D, FWD_THREADS>(sQ, reinterpret_cast<const char*>(qc + (bh * nq_pad + q0) * D), D, tid);
  const float* gKs = ks + bhk * nk_pad;
  if (tl.n > tl.first) {
    load_tile_async<BKV, D, FWD_THREADS>(sK, gK + tl.first * BKV * D, D, tid);
    load_tile_async<D, BKV, FWD_THREADS>(sV, gV + FwdVt<D, BKV>::offset(tl.first), FwdVt<D, BKV>::stride(nk_pad),
                                         tid);
    load_vec_async<FWD_THREADS>(sKs, gKs + tl.first * BKV, BKV / 4, tid);
  }
  cp_async_commit();
  const float inv_p_max = 1.f / p_max;

  const int r_lo = q0 + warp * 16 + g;  // this thread's two rows: r_lo, r_lo + 8
  const int2 rk[2] = {win.keys(r_lo, shift, nk), win.keys(r_lo + 8, shift, nk)};  // the keys they see
  FwdRows rs = fwd_rows_init(qs + bh * nq_pad, r_lo);
  float acc_o[D / 8][4];
#pragma unroll
  for (int i = 0; i < D / 8; ++i) acc_o[i][0] = acc_o[i][1] = acc_o[i][2] = acc_o[i][3] = 0.f;
  unsigned qf[D / 32][4];

  for (int tile = tl.first; tile < tl.n; ++tile) {
    const int st = (tile - tl.first) & 1;  // stages by position in the range: the first tile is in stage 0
    cp_async_wait<0>();
    __syncthreads();
    if (tile == tl.first) {
#pragma unroll
      for (int kstep = 0; kstep < D / 32; ++kstep) ldsm_x4<D, true>(qf[kstep], sQ, warp * 16, 2 * kstep, lane);
    }
    // Prefetch (the barrier above freed the stage: every warp is done with the tile it held).
    if (tile + 1 < tl.n) {
      load_tile_async<BKV, D, FWD_THREADS>(sK + (st ^ 1) * BKV * D, gK + (tile + 1) * BKV * D, D, tid);
      load_tile_async<D, BKV, FWD_THREADS>(sV + (st ^ 1) * D * BKV, gV + FwdVt<D, BKV>::offset(tile + 1),
                                           FwdVt<D, BKV>::stride(nk_pad), tid);
      load_vec_async<FWD_THREADS>(sKs + (st ^ 1) * BKV, gKs + (tile + 1) * BKV, BKV / 4, tid);
    }
    cp_async_commit();
    const char* cK = sK + st * BKV * D;
    const char* cV = sV + st * D * BKV;

    // S = Q^ K^T (int32), 16 rows x BKV keys per warp.
    int acc_s[NT][4];
    qk_s8<D, NT>(acc_s, qf, cK, lane);
    unsigned pa[NT / 4][4];
    const FwdTileScale ts = fwd_softmax_tile<NT>(acc_s, rs, pa, sKs + st * BKV,
                                                 V_BLOCK ? vs + (bhk * (nk_pad / BKV) + tile) * D : nullptr, tile,
                                                 tl.need_mask(tile), rk, t4, p_max, inv_p_max);
    // O = alpha * O + (P^ V^) * s_P (* s_V per block), 16 output columns at a time.
#pragma unroll
    for (int dp = 0; dp < D / 16; ++dp) {
      int acc[2][4];
      mma_a64_tile16<true, BKV>(acc, pa, cV, dp, lane);
      fwd_pv_update(acc_o[2 * dp], acc[0], ts);
      fwd_pv_update(acc_o[2 * dp + 1], acc[1], ts);
    }
  }
  cp_async_wait<0>();  // a CTA that visits no tile still has Q in flight
  fwd_epilogue<T, D>(acc_o, rs, V_BLOCK ? nullptr : vs + bhk * D, o + b * osb + h * osh, osn, lse + bh * lse_n,
                     lse2 ? lse2 + bh * nq_pad : nullptr, qmk ? qmk + bh * nq_pad : nullptr, r_lo, t4, nq, nq_pad);
}

// ---- wgmma forward (sm_90a) ----
// Q.K^T as wgmma m64nBKVk32 s8.s8 per warpgroup (Q and K through shared-memory descriptors), P.V as
// wgmma m64nDk32 u8.s8 (P^ from registers, V^T from shared memory). Per tile t, inside the warpgroup (FwdSm90::SERIAL
// below runs the products one after the other instead):
//   softmax(t) -> P^ codes; issue P.V(t), then Q.K^T(t+1);
//   wait for P.V(t) and fold it into O (float) while Q.K^T(t+1) runs; wait for Q.K^T(t+1).
// P.V(t) is retired in the iteration that issued it, so no instruction ever writes a register a wgmma in
// flight reads (its A operand: P^), and nothing is in flight across the loop's back edge (ptxas
// serializes every wgmma otherwise: warning C7514, which CI fails on). The CTAs an SM holds (MIN_CTAS below: with
// 64-key tiles three at D = 128 and four at D = 64, with 128-key tiles three) fill each other's tensor-core
// gaps. The float operations on O keep the mma.sync kernel's order, so the two engines agree bit for bit.
// K/V: a ring of NST tiles, each copied from the pre-pass's per-64-key stage images by thread 0 with bulk copies (tile
// t+NST-1 loads while t+1 is read by Q.K^T(t+1) and t by P.V(t)).
// PV_HALVES (D = 128, BKV = 64): P.V(t) as two m64n64 products into one
// 32-register accumulator: the first half is folded into O while Q.K^T(t+1) runs, then the second is issued,
// waited for (with Q.K^T(t+1)) and folded. With 64 fewer live registers the 4-warp kernel is built for three
// CTAs per SM (168 registers, __launch_bounds__) instead of two (254): 1.00-1.07x on the H200 (docs/experiments.md).
// The float operations per element are the same: bitwise the same O. At D = 64 (BKV = 64) the 4-warp kernel is
// built for four CTAs per SM (128 registers instead of 185, 12 bytes of spills): 1.14-1.22x (three: 1.10-1.13x).
//
// Causal grids dispatched heaviest first across groups of this many (batch, head) pairs (common/rows.cuh
// query_block): forward kernel 1.05x (4K) and 1.07x (16K) causal at D = 128 with 16, 1.07x / 1.07x with 64, against
// one head at a time (docs/experiments.md; O bitwise the same). 16 keeps the K/V of fewer heads in flight for large
// batch x heads.
constexpr int FWD_CAUSAL_GROUP = 16;
template <int D, int BKV, bool PV16 = false>
struct FwdSm90 {
  static constexpr bool PV_HALVES = D == 128 && BKV == 64 && !PV16;
  // D = 128 with 128-key tiles and the INT8 P.V: S, P.V's int32 accumulator and O would take 192 registers at once
  // in the pipelined loop, so its CTA ran alone on each scheduler's half (two CTAs per SM, 253 registers). SERIAL runs
  // P.V(t) in the registers that held S(t) and Q.K^T(t+1) in those that held P.V(t), each waited for in turn: 64
  // registers fewer, three CTAs per SM, whose softmax stretches fill each other's tensor-core waits: 1.06-1.10x on the
  // whole forward call, bitwise the same O (docs/experiments.md E-I8F-OCC128). At D = 64 the same loop (P.V in the
  // first 32 of S's registers) fits 128 registers with 16 bytes of spills: four CTAs per SM instead of the pipelined
  // loop's three, 1.04-1.05x on the whole forward call, bitwise the same O (E-I8F-SERIAL64).
  static constexpr bool SERIAL = BKV == 128 && !PV16;
  // K/V ring stages: the CTAs MIN_CTAS budgets for fit in shared memory (three with PV_HALVES or SERIAL at D = 128:
  // 75,776 bytes each; four with SERIAL at D = 64: 38,912). PV16 (16-bit V, twice the bytes) and SERIAL: two stages,
  // tile t+1 loaded while tile t is softmaxed (the loops below).
  static constexpr int NST = (PV16 || SERIAL) ? 2 : 4;
  // CTAs per SM the registers of a 4-warp CTA are budgeted for (__launch_bounds__): SERIAL at D = 64 four (above),
  // at D = 128 three. D = 64 with 64-key tiles and the INT8 P.V: four (E-I8F-OCC64). The 16-bit P.V needs 154
  // registers, three CTAs already.
  static constexpr int MIN_CTAS = (SERIAL && D == 64) ? 4 : (PV_HALVES || SERIAL) ? 3
                                  : (D == 64 && BKV == 64 && !PV16) ? 4 : 1;
};
template <typename T, int D, int WARPS, int BKV, bool PACKED = false, bool PV16 = false>
__device__ __forceinline__ void int8_attn_fwd_wgmma_impl(const signed char* __restrict__ qc, const float* __restrict__ qs,
              const signed char* __restrict__ kc, const float* __restrict__ ks,
              const signed char* __restrict__ vt, const float* __restrict__ vs,
              const float* __restrict__ qmk,
              T* __restrict__ o, long long osb, long long osh, long long osn,
              float* __restrict__ lse, float* __restrict__ lse2,
              int Hq, int Hkv, int nq, int nk, int nq_pad, int nk_pad, float p_max, int left, int right,
              int shift, int v_block, const char* __restrict__ kv_img, const int* __restrict__ meta = nullptr, int S = 0,
              int total_q = 0) {
  static_assert(WARPS == 4, "one warpgroup");
  static_assert(D == 64 || D == 128, "wgmma N = D");
  // Each stage is its tile's K/V images (int8/bwd_img.cuh FwdImg: K^, V^^T, key scales of 64 keys; NI = BKV / 64
  // of them), three bulk copies per image by thread 0, completing on full[stage]; kc, vt and ks are not read.
  // In a stage, the NI images' K^ rows follow each other (one BKV-row swizzled tile, as Q.K^T reads it), and so do
  // their key scales; image i's V^^T (D rows of 64 keys, 64-byte swizzled rows) is P.V's k-steps 2 i, 2 i + 1.
  using KvImg = FwdImg<D>;
  static_assert(BKV == 64 || BKV == 128, "tiles of 64 or 128 keys");
  constexpr int NI = BKV / 64;
  constexpr int FWD_BQ = 16 * WARPS, FWD_THREADS = 32 * WARPS, NST = FwdSm90<D, BKV, PV16>::NST, NT = BKV / 8;
  // PV16 (SageBwdConfig.pv_int8=False): V in the inputs' 16-bit type T, from `vt`: per 64-key tile one image of
  // 64 x D elements stored [key][channel] in 128-byte pieces (bwd_img.cuh k128_offset), which P.V reads N-major.
  constexpr int V_TILE = (PV16 ? 2 : 1) * 64 * D;  // bytes of one 64-key V tile in a stage
  const bool V_BLOCK = !PV16 && BKV == 64 && v_block != 0;  // per-block V: 64-key tiles (host)
  Window win{left, right};
  extern __shared__ __align__(128) char smem_raw[];
  // Tiles aligned to 1024 bytes (8 swizzled rows of 128 B), as wgmma descriptors require.
  // Pointer arithmetic (not an integer cast) keeps the compiler aware that this is shared memory, so plain
  // reads of it compile to LDS rather than generic loads.
  char* smem = smem_raw + ((1024u - (smem_u32(smem_raw) & 1023u)) & 1023u);
  char* sQ = smem;                               // FWD_BQ x D
  char* sK = sQ + FWD_BQ * D;                    // NST stages x BKV x D
  char* sV = sK + NST * BKV * D;                 // NST stages x D x BKV (x 2 bytes with PV16)
  float* sKs = reinterpret_cast<float*>(sV + NST * NI * V_TILE);  // NST stages x BKV key scales
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, t4 = lane % 4;
  QueryBlock qb = query_block<FWD_CAUSAL_GROUP>(FWD_BQ, win.causal_shape(), Hq, Hkv);
  int lse_n = nq;  // the LSE's row length: (B, Hq, nq), packed (Hq, total_q)
  if constexpr (PACKED) {
    grid_dep_wait();  // the table (a launch with SAGECUPY_PDL may start before the pre-pass ends)
    PackedSeq p;
    int s;
    if (!packed_query_seq(meta, S, qb, Hq, Hkv, nq, nk, nq_pad, nk_pad, win, shift, p, s)) return;  // past the last
    lse_n = total_q;
    const long long qr = static_cast<long long>(Hq) * p.qp, kr = static_cast<long long>(Hkv) * p.kp;
    qc += qr * D, qs += qr, o += p.q0 * osn, lse += p.q0, kv_img += kr / 64 * KvImg::STAGE;
    if constexpr (PV16) vt += kr / 64 * V_TILE;
    vs += V_BLOCK ? kr / 64 * D : static_cast<long long>(s) * Hkv * D;  // per 64-key block, or per sequence
    if (qmk) qmk += qr;
    if (lse2) lse2 += qr;
  }
  const int q0 = qb.q0, h = qb.h, b = qb.b;
  const long long bh = qb.bh, bhk = qb.bhk;
  const KeyRange tl = key_range<BKV>(q0, FWD_BQ, nq, nk, win, shift);
  // The ring is indexed by a tile's position j in the CTA's range (tile tl.first + j), so the pipeline below is the
  // one of a range that starts at tile 0.
  const int n_tiles = max(0, tl.n - tl.first);

  __shared__ __align__(8) unsigned long long full[NST];  // stage s resident
  const char* gImg = kv_img + bhk * (nk_pad / 64) * static_cast<long long>(KvImg::STAGE);
  const char* gV16 = PV16 ? reinterpret_cast<const char*>(vt) + bhk * (nk_pad / 64) * static_cast<long long>(V_TILE)
                          : nullptr;
  auto load_stage = [&](int j) {  // thread 0: tile tl.first + j (its NI images) into stage j % NST
    const int st = j % NST, t = tl.first + j;
    mbar_arrive_expect_tx(&full[st], NI * (PV16 ? 64 * D + V_TILE + 256 : KvImg::STAGE));
#pragma unroll
    for (int i = 0; i < NI; ++i) {
      const char* src = gImg + (NI * t + i) * static_cast<long long>(KvImg::STAGE);
      bulk_copy_g2s(sK + st * BKV * D + i * 64 * D, src + KvImg::K, 64 * D, &full[st]);
      if constexpr (PV16)
        bulk_copy_g2s(sV + (st * NI + i) * V_TILE, gV16 + (NI * t + i) * static_cast<long long>(V_TILE), V_TILE,
                      &full[st]);
      else
        bulk_copy_g2s(sV + st * D * BKV + i * 64 * D, src + KvImg::VT, 64 * D, &full[st]);
      bulk_copy_g2s(sKs + st * BKV + 64 * i, src + KvImg::KS, 256, &full[st]);
    }
  };
  if (tid == 0) {
#pragma unroll
    for (int s = 0; s < NST; ++s) mbar_init(&full[s], 1);
    fence_mbar_init();
  }
  __syncthreads();
  grid_dep_wait();  // the pre-pass's outputs (a launch with SAGECUPY_PDL may start before the pre-pass ends)
  // Prologue: Q (one cp.async group), the range's tiles 0 .. NST-2 (bulk copies).
  load_tile_async<FWD_BQ, D, FWD_THREADS, true>(sQ, reinterpret_cast<const char*>(qc + (bh * nq_pad + q0) * D), D, tid);
  cp_async_commit();
  if (tid == 0) {
#pragma unroll
    for (int j = 0; j < NST - 1; ++j)
      if (j < n_tiles) load_stage(j);
  }
  const float inv_p_max = 1.f / p_max;

  const int r_lo = q0 + warp * 16 + g;  // this thread's two rows: r_lo, r_lo + 8
  const int2 rk[2] = {win.keys(r_lo, shift, nk), win.keys(r_lo + 8, shift, nk)};  // the keys they see
  FwdRows rs = fwd_rows_init(qs + bh * nq_pad, r_lo);
  float acc_o[D / 8][4];
#pragma unroll
  for (int i = 0; i < D / 8; ++i) acc_o[i][0] = acc_o[i][1] = acc_o[i][2] = acc_o[i][3] = 0.f;
  constexpr bool PV_HALVES = FwdSm90<D, BKV>::PV_HALVES;
  int acc_s[NT][4];  // S of the tile being softmaxed; then Q.K^T of the next one, in flight
  // P.V of this tile (of half its columns with PV_HALVES; SERIAL: acc_s holds it)
  int acc_pv[FwdSm90<D, BKV>::SERIAL ? 1 : PV_HALVES ? D / 4 : D / 2];
  int(&accs)[4 * NT] = reinterpret_cast<int(&)[4 * NT]>(acc_s);
  const unsigned long long dq = gmma_desc<D>(sQ + (warp / 4) * 64 * D);
  auto issue_qk = [&](int stage) {
    const unsigned long long dk = gmma_desc<D>(sK + stage * BKV * D);
#pragma unroll
    for (int kstep = 0; kstep < D / 32; ++kstep) {
      if constexpr (BKV == 128)
        wgmma_m64n128k32_ss_s8(accs, gmma_desc_advance(dq, 32 * kstep), gmma_desc_advance(dk, 32 * kstep), kstep);
      else
        wgmma_m64n64k32_ss_s8(accs, gmma_desc_advance(dq, 32 * kstep), gmma_desc_advance(dk, 32 * kstep), kstep);
    }
    wgmma_commit();
  };

  if (n_tiles > 0) {
    cp_async_wait<0>();  // Q
    fence_proxy_async();  // this thread's cp.async writes -> the tensor cores' reads
    mbar_wait(&full[0], 0);  // the first tile
    __syncthreads();
    wgmma_fence();
    issue_qk(0);
    wgmma_wait<0>();
    fence_regs(accs);
  }

  if constexpr (PV16) {
    // O accumulates P~ V in the running frame on the tensor cores (fp32), so there is no P.V accumulator and no
    // per-tile fold; O is rescaled by alpha in registers when the frame moves, before P.V(t) is issued. Stage of
    // tile j: j % 2. Tile j+1 is loaded at the top of iteration j (its stage held tile j-1, whose Q.K^T and P.V
    // every warp has waited for by the barrier) and waited for just before Q.K^T(j+1) is issued, after softmax(j).
    for (int j = 0; j < n_tiles; ++j) {
      const int tile = tl.first + j;
      __syncthreads();
      if (tid == 0 && j + 1 < n_tiles) load_stage(j + 1);
      unsigned pa[NT / 2][4];
      float sv[NT][4], mx[2];
      float lsum[2][4] = {{-0.f, -0.f, -0.f, -0.f}, {-0.f, -0.f, -0.f, -0.f}};
      const FwdTileScale ts = fwd_frame16<NT>(acc_s, sv, mx, rs, sKs + (j % NST) * BKV, tile, tl.need_mask(tile),
                                              rk, t4);
      if (ts.rescale) {
#pragma unroll
        for (int nt = 0; nt < D / 8; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e) acc_o[nt][e] *= ts.alpha[e >> 1];
      }
      fwd_exp16<T, NT, 0, NT>(sv, mx, rs, pa, lsum);
      fwd_lsum16(rs, ts, lsum);
      if (j + 1 < n_tiles) mbar_wait(&full[(j + 1) % NST], ((j + 1) / NST) & 1);
      wgmma_fence();
      const char* cV = sV + (j % NST) * NI * V_TILE;
#pragma unroll
      for (int kk = 0; kk < NT / 2; ++kk)  // k-steps of 16 keys: image kk / 4, its k-step kk % 4
        wgmma_rs<T, true>(reinterpret_cast<float(&)[D / 2]>(acc_o), pa[kk],
                          desc_mn16<64>(cV + (kk / 4) * V_TILE, kk % 4), 1);
      wgmma_commit();
      // Q.K^T(t+1); on the last tile a stale stage (no copy in flight), the result dropped
      issue_qk((j + 1) % NST);
      wgmma_wait<0>();
      fence_regs(reinterpret_cast<float(&)[D / 2]>(acc_o));
      fence_regs(accs);
      hold_regs(pa);
    }
  } else if constexpr (FwdSm90<D, BKV>::SERIAL) {
    // One accumulator: S(t) -> softmax(t) -> P.V(t) in the same registers -> fold into O -> Q.K^T(t+1) in them again.
    // Stage of tile j: j % 2; tile j+1 is loaded at the top of iteration j (its stage held tile j-1, whose P.V every
    // warp has waited for by the barrier) and waited for after the fold, before Q.K^T(j+1).
    static_assert(NST == 2 && BKV == 128, "the serial loop's ring and products");
    for (int j = 0; j < n_tiles; ++j) {
      const int tile = tl.first + j;
      __syncthreads();
      if (tid == 0 && j + 1 < n_tiles) load_stage(j + 1);
      unsigned pa[NT / 4][4];
      const FwdTileScale ts = fwd_softmax_tile<NT>(acc_s, rs, pa, sKs + (j % NST) * BKV, nullptr, tile,
                                                   tl.need_mask(tile), rk, t4, p_max, inv_p_max);
      wgmma_fence();
      const char* cV = sV + (j % NST) * D * BKV;
      if constexpr (D == 128) {
        wgmma_m64n128k32_rs_u8s8_first(accs, pa[0], gmma_desc<64>(cV));
#pragma unroll
        for (int kstep = 1; kstep < BKV / 32; ++kstep)  // k-steps 2 i, 2 i + 1 read image i's V^^T
          wgmma_m64n128k32_rs_u8s8(accs, pa[kstep], gmma_desc_advance(gmma_desc<64>(cV + (kstep / 2) * 64 * D),
                                                                       32 * (kstep % 2)), 1);
      } else {  // D = 64: P.V in the first 32 of S's registers
        int(&pv)[32] = *reinterpret_cast<int(*)[32]>(&accs[0]);
        wgmma_m64n64k32_rs_u8s8_first(pv, pa[0], gmma_desc<64>(cV));
#pragma unroll
        for (int kstep = 1; kstep < BKV / 32; ++kstep)
          wgmma_m64n64k32_rs_u8s8(pv, pa[kstep], gmma_desc_advance(gmma_desc<64>(cV + (kstep / 2) * 64 * D),
                                                                    32 * (kstep % 2)), 1);
      }
      wgmma_commit();
      wgmma_wait<0>();
      fence_regs(accs);
      hold_regs(pa);
      fwd_pv_update_all<D>(acc_o, accs, ts);
      if (j + 1 < n_tiles) mbar_wait(&full[(j + 1) % NST], ((j + 1) / NST) & 1);
      wgmma_fence();
      // Q.K^T(t+1); on the last tile a stale stage (no copy in flight), the result dropped
      const unsigned long long dk = gmma_desc<D>(sK + ((j + 1) % NST) * BKV * D);
      wgmma_m64n128k32_ss_s8_first(accs, dq, dk);
#pragma unroll
      for (int kstep = 1; kstep < D / 32; ++kstep)
        wgmma_m64n128k32_ss_s8(accs, gmma_desc_advance(dq, 32 * kstep), gmma_desc_advance(dk, 32 * kstep), 1);
      wgmma_commit();
      wgmma_wait<0>();
      fence_regs(accs);
    }
  } else
  for (int j = 0; j < n_tiles; ++j) {
    const int tile = tl.first + j;
    // Tile j+1 resident and visible to the tensor cores; every warp past P.V(j-1), whose stage the
    // prefetch below overwrites.
    if (j + 1 < n_tiles) mbar_wait(&full[(j + 1) % NST], ((j + 1) / NST) & 1);
    __syncthreads();
    if (tid == 0 && j + NST - 1 < n_tiles) load_stage(j + NST - 1);

    unsigned pa[NT / 4][4];
    const FwdTileScale ts = fwd_softmax_tile<NT>(acc_s, rs, pa, sKs + (j % NST) * BKV,
                                                 V_BLOCK ? vs + (bhk * (nk_pad / BKV) + tile) * D : nullptr, tile,
                                                 tl.need_mask(tile), rk, t4, p_max, inv_p_max);
    // The waits and issues below are unconditional: ptxas proves the accumulators are not read while
    // in flight only on straight-line pipelines (else it serializes every wgmma, warning C7514).
    if constexpr (PV_HALVES) {
      // P.V(t) columns 0..63 and Q.K^T(t+1); fold the first half, then P.V(t) columns 64..127.
      const char* cV = sV + (j % NST) * D * BKV;
      auto issue_pv_half = [&](int h) {
        const unsigned long long dv = gmma_desc<BKV>(cV + h * 64 * BKV);
        wgmma_m64n64k32_rs_u8s8(acc_pv, pa[0], dv, 0);
        wgmma_m64n64k32_rs_u8s8(acc_pv, pa[1], gmma_desc_advance(dv, 32), 1);
        wgmma_commit();
      };
      wgmma_fence();
      issue_pv_half(0);
      issue_qk((j + 1) % NST);
      wgmma_wait<1>();  // P.V(t) columns 0..63 done
      fence_regs(acc_pv);
#pragma unroll
      for (int j = 0; j < 8; ++j) fwd_pv_update(acc_o[j], acc_pv + 4 * j, ts);
      wgmma_fence();
      issue_pv_half(1);
      wgmma_wait<0>();  // Q.K^T(t+1) and P.V(t) columns 64..127 done
      fence_regs(acc_pv);
      fence_regs(accs);
      hold_regs(pa);
#pragma unroll
      for (int j = 0; j < 8; ++j) fwd_pv_update(acc_o[8 + j], acc_pv + 4 * j, ts);
    } else {
    // D = 64 with 64-key tiles: D = 128 takes PV_HALVES (64-key tiles) or SERIAL (128), as 128-key tiles at D = 64 do
    static_assert(D == 64 && BKV == 64, "the pipelined loop's P.V products");
    wgmma_fence();
    {  // P.V(t): the two k-steps of the tile's one V^^T image
      const char* cV = sV + (j % NST) * D * BKV;
#pragma unroll
      for (int kstep = 0; kstep < BKV / 32; ++kstep)
        wgmma_m64n64k32_rs_u8s8(acc_pv, pa[kstep], gmma_desc_advance(gmma_desc<64>(cV), 32 * kstep), kstep);
      wgmma_commit();
    }
    // Q.K^T(t+1). On the last tile it multiplies a stale stage (no bulk copy is in flight then: the last tile's
    // was waited for before this iteration) and the result is dropped.
    issue_qk((j + 1) % NST);
    wgmma_wait<1>();  // P.V(t) done (Q.K^T(t+1) may still run)
    fence_regs(acc_pv);
    hold_regs(pa);  // P.V(t)'s A operand stays untouched until here
    fwd_pv_update_all<D>(acc_o, acc_pv, ts);
    wgmma_wait<0>();  // Q.K^T(t+1) done
    fence_regs(accs);
    }
  }
  cp_async_wait<0>();  // a CTA that visits no tile (rows past nq, or rows that see no key) still has Q in flight
  fwd_epilogue<T, D>(acc_o, rs, (V_BLOCK || PV16) ? nullptr : vs + bhk * D, o + b * osb + h * osh, osn,
                     lse + bh * lse_n, lse2 ? lse2 + bh * nq_pad : nullptr, qmk ? qmk + bh * nq_pad : nullptr, r_lo,
                     t4, nq, nq_pad);
}

}  // namespace sage
