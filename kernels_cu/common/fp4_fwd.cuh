// The FP4 attention forwards' per-tile softmax and P quantization, shared by the mma.sync kernels
// (nvfp4/fp4_attn_fwd.cu) and the Hopper wgmma kernels (nvfp4/fp4_attn_fwd_sm90.cu, qat/qat_attn_fwd_sm90.cu): the
// same float operations in the same order, so the engines differ only through the fp32 accumulation order inside the
// tensor cores (and where a kernel keeps O in the frame of its last tile or thread-owned P blocks: below).
// See nvfp4/fp4_attn_fwd.cu for the algorithm (x, beta, two-level P).
#pragma once
#include "common/fp4.cuh"
#include "common/numeric.cuh"
#include "common/rows.cuh"

namespace sage {

// How fp4_softmax_tile computes (each measured against its alternative; docs/experiments.md):
// * The 16-key blocks' maxima are taken on the logits (before exp2) and the row max from them. exp2 and the FFMA
//   before it are monotone, so the block maxima of x are the same numbers as after the exponentials (O bitwise
//   equal), but the block scales do not wait for the exponentials and the row max needs no pass of its own: the NVFP4
//   wgmma forward 1.05-1.08x.
// * Each 16-key block's scale s enters the exponent, y = 2^(S - r + log2 2688 - log2 s) (one FFMA with a per-block
//   constant, then ex2), instead of y = x * (1/s) per element; the row sum takes s * (the block's sum of y). Per
//   element one FMUL fewer, per block a lg2 for a reciprocal (and its zero test): y is the same quotient as
//   x * rcp(s) within fp32 error (the special-function unit's, and one rounding of the per-block constant
//   base - log2 s, ~|base| ulps), which moves an element of P across an E2M1 midpoint only within ~1e-6 of it, as the
//   rcp form's error does (tests: _ambiguous_rows). A zero scale (the block's max x at most 6 * 2^-10) takes
//   s = 2^-10 in the exponent (finite y, so the row sum still counts the block) and zeroes P^ through its fp16 scale.
// * With two-level P the running max moves only when a tile's max exceeds it by more than FP4_RESCALE_SLACK (base-2
//   logit units; below).

// Per-thread row state of the online softmax: rows r_lo and r_lo + 8 of the warp's 16.
struct Fp4Rows {
  float m[2];  // running max of the base-2 logits
  float l[2];  // running sum of the unquantized P~ (this thread's columns; quad-summed at the end)
};

// What one tile hands to the P.V update: O = alpha * O + beta * (P^ V^); rescale = any alpha != 1 in the warp;
// rmax = the tile's row maxima of the base-2 logits (-inf: the row sees no key in it).
// take (two-level P): the frame rule's decision per row (fp4_frame_step), made before P^ is built so that for FRAME
// callers a skipped row's P^ is zero through its block scales.
struct Fp4TileScale {
  float alpha[2], beta[2], rmax[2];
  bool rescale, take[2];
};

constexpr float FP4_FRAME_GAP = 60.f;  // tiles more than this (log2) below the running max are skipped for O
constexpr int FP4_RESCALE_SLACK = 8;   // two-level P: how far (log2) a tile's max may exceed the running max unmoved

__device__ __forceinline__ unsigned half2_bits(float a, float b) {
  __half2 h = __floats2half2_rn(a, b);
  return *reinterpret_cast<unsigned*>(&h);
}

// Two E2M1 values q0, q1 (e2m1_round_nonneg_unsat: not yet saturated) times their block scale s2 (both halves) as
// one half2 of P^: saturated at 6 (six2) two at a time in fp16, the product exact (at most 6 significant bits).
__device__ __forceinline__ unsigned fp4_p_pair(float q0, float q1, __half2 s2, __half2 six2) {
  const __half2 p = __hmul2(__hmin2(__floats2half2_rn(q0, q1), six2), s2);
  return *reinterpret_cast<const unsigned*>(&p);
}

// TBLK's storage order of a 64-key tile: row (K^) or token column (V^T) c holds key FP4_TBLK_KEY(c), so that the
// wgmma accumulator's column c = 8 nt + 2 t4 + e (thread t4's columns) is key 16 t4 + 2 nt + e.
__host__ __device__ constexpr int FP4_TBLK_KEY(int c) { return 16 * ((c & 7) >> 1) + 2 * (c >> 3) + (c & 1); }

// One 16 x 64 tile of raw logits s (fp32 products of the dequantized operands, accumulator layout: s[nt][e]
// is row r_lo + 8 (e >> 1), key tile * 64 + 8 nt + 2 t4 + (e & 1)): mask (in place; need_mask: the keys outside
// window w of each row, shift = nk - nq, keys >= nk; their bounds, common/rows.cuh Window::keys, are computed once per
// row and tile, from registers the kernel holds anyway, so that a masked element costs two compares and a select, not
// a test of each window edge, and no register is held across the loop for them), online max (the raw
// products' max: scale_log2 > 0 commutes with it; the scale is applied inside the exponent, one FFMA per
// element), x, the row sums, and the NVFP4 P^ as fp16 A operands pa[kk] (keys 16 kk .. 16 kk + 15: one
// 16-block per k16 step), dequantized exactly. QAT: also the fp16 A operands pp of P~ = beta * x.
// FRAME (callers that keep O in the frame of its last tile, fp4_frame_step): a skipped row's P^ is 0.
// TBLK (thread-owned blocks): the tile's K^ rows and V^ tokens are stored in the order FP4_TBLK_KEY (below), so that
// s[nt][e] is key tile * 64 + 16 t4 + 2 nt + (e & 1): each thread's 16 values of a row are one whole 16-key block.
// Its block max and scale need no shuffles (one per row instead of four), the row max one quad reduction. The
// products are the same sums over another order of the keys (fp32 accumulation order only).
template <bool TWO_LEVEL, bool QAT, bool FRAME = false, bool TBLK = false>
__device__ __forceinline__ Fp4TileScale fp4_softmax_tile(float (&s)[8][4], Fp4Rows& rs, unsigned (&pa)[4][4],
                                                         unsigned (&pp)[QAT ? 4 : 1][4], int tile, bool need_mask,
                                                         Window w, int r_lo, int t4, int nk, int shift,
                                                         float scale_log2) {
  constexpr float LOG2_X_MAX = 11.392317422778761f;  // log2(2688), 2688 = 448 * 6
  static_assert(!TBLK || !QAT, "thread-owned blocks: NVFP4 only");
  if (need_mask) {
    // Element (nt, e) is key k0 + c with c = 8 nt + (e & 1) (TBLK: 2 nt + (e & 1)), a constant after unrolling: the
    // rows' bounds are taken relative to k0, and each element compares c with them.
    const int k0 = tile * 64 + (TBLK ? 16 * t4 : 2 * t4);
    int lo[2], hi[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int2 kr = w.keys(r_lo + 8 * r, shift, nk);
      lo[r] = kr.x - k0;
      hi[r] = kr.y - k0;
    }
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int c = (TBLK ? 2 * nt : 8 * nt) + (e & 1);
        if ((c < lo[e >> 1]) | (c > hi[e >> 1])) s[nt][e] = -INFINITY;
      }
    }
  }
  // Row maxima as trees (short dependency chains). fmaxf drops a NaN logit unless all of a reduction's inputs are
  // NaN (quad_max propagates one), so the row and block maxima may or may not be NaN; either way an unmasked NaN
  // logit reaches O through its x and the row sum.
  // Each 16-key block's max logit (quad-reduced), the row max as their max: exp2 is monotone, so the block maxima
  // of x follow from these without a pass over x (below). TBLK: bt[r], this thread's block of row r, and the row
  // max over the quad.
  float bm[4][2], bt[2], rmax[2];
  if constexpr (TBLK) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float t[8];
#pragma unroll
      for (int nt = 0; nt < 8; ++nt) t[nt] = fmaxf(s[nt][2 * r], s[nt][2 * r + 1]);
      bt[r] = fmaxf(fmaxf(fmaxf(t[0], t[1]), fmaxf(t[2], t[3])), fmaxf(fmaxf(t[4], t[5]), fmaxf(t[6], t[7])));
      rmax[r] = quad_max(bt[r]);
    }
  } else {
#pragma unroll
    for (int kk = 0; kk < 4; ++kk)
#pragma unroll
      for (int r = 0; r < 2; ++r)
        bm[kk][r] = quad_max(fmaxf(fmaxf(s[2 * kk][2 * r], s[2 * kk][2 * r + 1]),
                                   fmaxf(s[2 * kk + 1][2 * r], s[2 * kk + 1][2 * r + 1])));
#pragma unroll
    for (int r = 0; r < 2; ++r) rmax[r] = fmaxf(fmaxf(bm[0][r], bm[1][r]), fmaxf(bm[2][r], bm[3][r]));
  }
  Fp4TileScale ts;
  float base[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    rmax[r] *= scale_log2;  // (TBLK: bt[r] stays raw, scaled in its exponent below)
    ts.rmax[r] = rmax[r];
    // Two-level P is relative to the tile's own max, so the running max may lag (lazy frame, as the INT8 forward:
    // int8/fwd.cuh): it moves only when a tile's max exceeds it by more than FP4_RESCALE_SLACK, and
    // O' (QAT) / O (alpha-beta kernels) skip their rescale on almost every tile. Single-level P quantizes
    // 2^(S - m) itself, whose E4M3 scales depend on m: there m stays the exact running max.
    const float m_new = TWO_LEVEL
                            ? (rmax[r] > rs.m[r] + static_cast<float>(FP4_RESCALE_SLACK) ? rmax[r] : rs.m[r])
                            : fmaxf(rs.m[r], rmax[r]);
    const float m_use = m_new == -INFINITY ? 0.f : m_new;
    ts.alpha[r] = fast_exp2(rs.m[r] - m_use);  // exp2(0) = 1 exactly: the rescale test below stays exact
    if (TWO_LEVEL) {
      // x = 2^(S - r + log2 2688); a row that sees no key in this tile (r = -inf) contributes 0.
      // beta = 2^(r - m) / 2688 as one exponent (no division).
      const bool seen = rmax[r] != -INFINITY;
      base[r] = seen ? LOG2_X_MAX - rmax[r] : 0.f;
      ts.beta[r] = seen ? fast_exp2(rmax[r] - m_use - LOG2_X_MAX) : 0.f;
    } else {
      base[r] = -m_use;
      ts.beta[r] = 1.f;
    }
    rs.m[r] = m_new;
    // (a NaN logit: taken, so that the NaN reaches O)
    ts.take[r] = !TWO_LEVEL || (rmax[r] != -INFINITY && !(rmax[r] < m_new - FP4_FRAME_GAP));
  }
  // FRAME: the fp16 block scales of a skipped row are zeroed (row r_lo in the low half of each half2 of scales).
  const unsigned keep = (FRAME && TWO_LEVEL) ? (ts.take[0] ? 0x0000FFFFu : 0u) | (ts.take[1] ? 0xFFFF0000u : 0u)
                                             : 0xFFFFFFFFu;
  const __half2 six2 = __float2half2_rn(6.f);
  float lsum[2] = {0.f, 0.f};
  if constexpr (TBLK) {
    // One block per row and thread: its scale (folded into the exponent, as below), then the
    // 16 values; P^'s A fragment of k16 chunk kk takes the values of n8 tiles 2 kk and 2 kk + 1 as before.
    float sc[2], sf[2], bb[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) sc[r] = fast_exp2(fmaf(bt[r], scale_log2, base[r]));
    __half2 sch = e4m3_block_scale_fast2(sc[0], sc[1], sc);
    {
      const unsigned kb = *reinterpret_cast<const unsigned*>(&sch) & keep;
      sch = *reinterpret_cast<const __half2*>(&kb);
    }
    const __half2 s2[2] = {__low2half2(sch), __high2half2(sch)};
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      sf[r] = fmaxf(sc[r], 0x1p-10f);
      bb[r] = base[r] - fast_log2(sf[r]);
    }
#pragma unroll
    for (int nt = 0; nt < 8; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[nt][e] = fast_exp2(fmaf(s[nt][e], scale_log2, bb[e >> 1]));  // y, in place
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float t[8];  // the row's 16 values of y summed as a tree
#pragma unroll
      for (int nt = 0; nt < 8; ++nt) t[nt] = s[nt][2 * r] + s[nt][2 * r + 1];
      lsum[r] = sf[r] * (((t[0] + t[1]) + (t[2] + t[3])) + ((t[4] + t[5]) + (t[6] + t[7])));
    }
#pragma unroll
    for (int nt = 0; nt < 8; ++nt)
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        pa[nt >> 1][(nt & 1) * 2 + r] =
            fp4_p_pair(e2m1_round_nonneg_unsat(s[nt][2 * r]), e2m1_round_nonneg_unsat(s[nt][2 * r + 1]), s2[r],
                       six2);
      }
  } else {
    // x, row sums, and the NVFP4 P^ as fp16 A operands (16-key blocks = k16 chunks kk).
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
      float sc[2], sf[2], bb[2];
#pragma unroll
      for (int r = 0; r < 2; ++r) sc[r] = fast_exp2(fmaf(bm[kk][r], scale_log2, base[r]));  // the block maxima of x
      __half2 sch = e4m3_block_scale_fast2(sc[0], sc[1], sc);
      {
        const unsigned kb = *reinterpret_cast<const unsigned*>(&sch) & keep;
        sch = *reinterpret_cast<const __half2*>(&kb);
      }
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        sf[r] = fmaxf(sc[r], 0x1p-10f);  // (a NaN scale: 2^-10 here; P^ is NaN through sch)
        bb[r] = base[r] - fast_log2(sf[r]);
      }
      float y[2][4], ys[2] = {0.f, 0.f};  // y = x / s; the block's sum of y per row
#pragma unroll
      for (int j = 0; j < 2; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int r = e >> 1;
          const float yv = fast_exp2(fmaf(s[2 * kk + j][e], scale_log2, bb[r]));
          y[r][2 * j + (e & 1)] = yv;
          ys[r] += yv;
        }
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        lsum[r] = fmaf(sf[r], ys[r], lsum[r]);
        const __half2 s2 = r == 0 ? __low2half2(sch) : __high2half2(sch);
        float qv[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) qv[i] = e2m1_round_nonneg_unsat(y[r][i]);
        // A fragment: a0 (row g, k 2t..) a1 (row g+8, k 2t..) a2 (row g, k 2t+8..) a3 (row g+8, k 2t+8..)
        pa[kk][r] = fp4_p_pair(qv[0], qv[1], s2, six2);
        pa[kk][2 + r] = fp4_p_pair(qv[2], qv[3], s2, six2);
        if constexpr (QAT) {
          const float sb = sf[r] * ts.beta[r];  // P~ = beta * x = beta * s * y
          pp[kk][r] = half2_bits(y[r][0] * sb, y[r][1] * sb);
          pp[kk][2 + r] = half2_bits(y[r][2] * sb, y[r][3] * sb);
        }
      }
    }
  }
  rs.l[0] = fmaf(rs.l[0], ts.alpha[0], lsum[0] * ts.beta[0]);
  rs.l[1] = fmaf(rs.l[1], ts.alpha[1], lsum[1] * ts.beta[1]);
  // Rescale O (and O') by alpha only when some row's max moved (warp-uniform; alpha == 1 exactly otherwise).
  ts.rescale = __any_sync(0xffffffffu, ts.alpha[0] != 1.f || ts.alpha[1] != 1.f);
  return ts;
}

// O accumulated in place in the frame of the last tile it took (two-level P; the wgmma QAT forward and the NVFP4
// warp-specialized forward): O_f = O / beta_f, beta_f = 2^(r_f - m) / 2688. See qat/qat_attn_fwd_sm90.cu
// for the rule, its error and its bounds. Per row: r_f (-inf until a tile is taken).
struct Fp4Frame {
  float r[2];
};

// Before tile t's P^ V product accumulates into O: per row, take the tile (O_f *= 2^(r_f - r_t), r_f = r_t) or
// skip it (ts.take false: its P^ row is zero already, fp4_softmax_tile<.., FRAME = true>). TWO_LEVEL = false
// (beta = 1): plain O *= alpha when some row's max moved.
template <bool TWO_LEVEL, int N>
__device__ __forceinline__ void fp4_frame_step(float (&o)[N][4], Fp4Frame& fr, const Fp4TileScale& ts) {
  float c[2];
  bool any_c = false;
  if constexpr (TWO_LEVEL) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const float r_t = ts.rmax[r];
      const bool take = ts.take[r];
      c[r] = take ? (fr.r[r] == -INFINITY ? 0.f : fast_exp2(fr.r[r] - r_t)) : 1.f;
      if (take) fr.r[r] = r_t;
      any_c |= c[r] != 1.f;
    }
  } else {
    c[0] = ts.alpha[0];
    c[1] = ts.alpha[1];
    any_c = ts.rescale;
  }
  if (__any_sync(0xffffffffu, any_c)) {
#pragma unroll
    for (int j = 0; j < N; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) o[j][e] *= c[e >> 1];
  }
}

// After the last tile: O = O_f 2^(r_f - m) / 2688 (rows that took no tile: O_f = 0). TWO_LEVEL = false: nothing.
template <bool TWO_LEVEL, int N>
__device__ __forceinline__ void fp4_frame_finish(float (&o)[N][4], const Fp4Frame& fr, const Fp4Rows& rs) {
  if constexpr (TWO_LEVEL) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const float f = fr.r[r] == -INFINITY ? 0.f : fast_exp2(fr.r[r] - rs.m[r] - 11.392317422778761f);
#pragma unroll
      for (int j = 0; j < N; ++j) {
        o[j][2 * r] *= f;
        o[j][2 * r + 1] *= f;
      }
    }
  }
}

// N 8-column tiles of O (accumulator layout): O = alpha * O + beta * acc, alpha only when ts.rescale (tested
// once for all N: per tile, ptxas allocated the mma.sync kernel's registers far worse, 52 -> 312 spilled bytes).
template <int N>
__device__ __forceinline__ void fp4_pv_update(float (&o)[N][4], const float (&acc)[N][4], const Fp4TileScale& ts) {
  if (ts.rescale) {
#pragma unroll
    for (int j = 0; j < N; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) o[j][e] = fmaf(o[j][e], ts.alpha[e >> 1], acc[j][e] * ts.beta[e >> 1]);
  } else {
#pragma unroll
    for (int j = 0; j < N; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) o[j][e] = fmaf(acc[j][e], ts.beta[e >> 1], o[j][e]);
  }
}

// Epilogue: normalize and store O (T), O' (fp32, QAT only), LSE (+ qmk_bh[row] when given). A row that sees no key
// (l == 0) stores exact zeros (not acc * 0: a NaN of V reaches acc through 0 * NaN in the MMA even for rows
// that do not see it).
template <typename T, int D, bool QAT>
__device__ __forceinline__ void fp4_fwd_epilogue(const float (&acc_o)[D / 8][4], const float (*acc_p)[4], Fp4Rows& rs,
                                                 T* __restrict__ o_bh, long long osn, float* __restrict__ oprime_bh,
                                                 float* __restrict__ lse_bh, float* __restrict__ lse2_bh,
                                                 const float* __restrict__ qmk_bh, int r_lo, int t4, int nq,
                                                 int nq_pad) {
#pragma unroll
  for (int r = 0; r < 2; ++r) rs.l[r] = quad_sum(rs.l[r]);
  const float inv_l[2] = {rs.l[0] == 0.f ? 0.f : 1.f / rs.l[0], rs.l[1] == 0.f ? 0.f : 1.f / rs.l[1]};
  const bool none[2] = {rs.l[0] == 0.f, rs.l[1] == 0.f};
#pragma unroll
  for (int nt = 0; nt < D / 8; ++nt) {
    const int col = nt * 8 + 2 * t4;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = r_lo + 8 * r;
      if (row < nq) {
        *reinterpret_cast<unsigned*>(o_bh + row * osn + col) =
            none[r] ? 0u : pack2<T>(acc_o[nt][2 * r] * inv_l[r], acc_o[nt][2 * r + 1] * inv_l[r]);
        if constexpr (QAT)
          *reinterpret_cast<float2*>(oprime_bh + static_cast<long long>(row) * D + col) =
              none[r] ? make_float2(0.f, 0.f) : make_float2(acc_p[nt][2 * r] * inv_l[r], acc_p[nt][2 * r + 1] * inv_l[r]);
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

}  // namespace sage
