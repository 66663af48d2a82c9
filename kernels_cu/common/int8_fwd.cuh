// The SageBwd forward's body, shared by the mma.sync kernel (int8_attn_fwd.cu) and the Hopper wgmma
// kernel (int8_attn_fwd_sm90.cu). See int8_attn_fwd.cu for the algorithm and the operands.
#pragma once
#include "mma.cuh"
#include "numeric.cuh"
#include "tile.cuh"
#include "wgmma.cuh"

namespace sage {

constexpr int FWD_BKV = 64;  // keys per tile (SageBwdConfig.block_kv: P is quantized per token per tile)

// The forward, for both matrix engines: WGMMA = false: mma.sync m16n8k32 per warp (sm_80+);
// WGMMA = true: wgmma m64nNk32 per warpgroup of 4 warps (sm_90a), Q, K, V^T read by the tensor cores
// straight from the swizzled shared tiles. Everything between the two products is shared.
// WARPS warps of 16 query rows each (4: one warpgroup, 64 rows; 8: two, 128 rows).
template <typename T, int D, int WARPS, bool WGMMA>
__device__ __forceinline__ void int8_attn_fwd_impl(const signed char* __restrict__ qc, const float* __restrict__ qs,
              const signed char* __restrict__ kc, const float* __restrict__ ks,
              const signed char* __restrict__ vt, const float* __restrict__ vs,
              const float* __restrict__ qmk,
              T* __restrict__ o, long long osb, long long osh, long long osn,
              float* __restrict__ lse, float* __restrict__ lse2,
              int Hq, int Hkv, int nq, int nk, int nq_pad, int nk_pad, float p_max, int causal, int v_block) {
  static_assert(WARPS == 4 || WARPS == 8, "4 or 8 warps");
  static_assert(D <= 128, "i2f_small is exact for |int32| < 2^22: 127 * 127 * D and 255 * 127 * 64 must stay below");
  constexpr int FWD_BQ = 16 * WARPS, FWD_THREADS = 32 * WARPS;
  const bool CAUSAL = causal != 0, V_BLOCK = v_block != 0;
  extern __shared__ __align__(128) char smem_raw[];
  // Tiles aligned to 1024 bytes (8 swizzled rows of 128 B), as wgmma descriptors require.
  char* smem = reinterpret_cast<char*>((reinterpret_cast<unsigned long long>(smem_raw) + 1023) & ~1023ull);
  char* sQ = smem;                               // FWD_BQ x D
  // K/V ring: 2 stages for mma.sync (prefetch one tile ahead); 3 for wgmma, whose Q.K^T of tile t+1
  // is issued while tile t's softmax runs, so tile t+1 must be resident one iteration earlier.
  constexpr int NST = WGMMA ? 3 : 2;
  char* sK = sQ + FWD_BQ * D;                    // NST stages x FWD_BKV x D
  char* sV = sK + NST * FWD_BKV * D;             // NST stages x D x FWD_BKV
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, t4 = lane % 4;
  const int nblk = gridDim.x;
  const int qblk = CAUSAL ? (nblk - 1 - blockIdx.x) : blockIdx.x;  // heavy causal blocks first
  const int h = blockIdx.y, b = blockIdx.z;
  const int hk = h / (Hq / Hkv);
  const long long bh = static_cast<long long>(b) * Hq + h, bhk = static_cast<long long>(b) * Hkv + hk;
  const int q0 = qblk * FWD_BQ;
  const int shift = nk - nq;  // bottom-right causal: row i sees key j iff j <= i + shift

  int n_tiles = (nk + FWD_BKV - 1) / FWD_BKV;
  int first_masked = nk / FWD_BKV;  // first tile that needs masking (partial tail)
  if (CAUSAL) {
    const int last_key = min(q0 + FWD_BQ - 1, nq - 1) + shift;  // largest key any real row sees
    n_tiles = last_key < 0 ? 0 : min(n_tiles, last_key / FWD_BKV + 1);
    const int min_row_key = q0 + shift;  // keys beyond this need the mask for some row
    first_masked = min(first_masked, min_row_key < 0 ? 0 : (min_row_key + 1) / FWD_BKV);
  }

  const char* gK = reinterpret_cast<const char*>(kc + bhk * nk_pad * D);
  const char* gV = reinterpret_cast<const char*>(vt + bhk * D * nk_pad);
  load_tile_async<FWD_BQ, D, FWD_THREADS>(sQ, reinterpret_cast<const char*>(qc + (bh * nq_pad + q0) * D), D, tid);
  for (int t = 0; t < (WGMMA ? 2 : 1) && t < n_tiles; ++t) {
    load_tile_async<FWD_BKV, D, FWD_THREADS>(sK + t * FWD_BKV * D, gK + t * FWD_BKV * D, D, tid);
    load_tile_async<D, FWD_BKV, FWD_THREADS>(sV + t * D * FWD_BKV, gV + t * FWD_BKV, nk_pad, tid);
  }
  cp_async_commit();

  const int r_lo = q0 + warp * 16 + g;  // this thread's two rows: r_lo, r_lo + 8
  // Row scales; an all-zero row (scale 0) uses a tiny positive scale instead so that a masked logit
  // (-inf) times it stays -inf rather than NaN; its logits are 0 either way. NaN scales stay NaN.
  float sq[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const float x = qs[bh * nq_pad + r_lo + 8 * r];
    sq[r] = (x > 1e-30f || x != x) ? x : 1e-30f;
  }
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
  float acc_o[D / 8][4];
#pragma unroll
  for (int i = 0; i < D / 8; ++i) acc_o[i][0] = acc_o[i][1] = acc_o[i][2] = acc_o[i][3] = 0.f;
  unsigned qf[D / 32][4];
  int acc_s[8][4], acc_n[8][4];  // S of this tile; (wgmma) S of the next one, in flight during the softmax

  for (int tile = 0; tile < n_tiles; ++tile) {
    const int st = tile % NST;
    cp_async_wait<0>();
    if constexpr (WGMMA) fence_proxy_async();  // this thread's cp.async writes -> the tensor cores' reads
    __syncthreads();
    if constexpr (!WGMMA) if (tile == 0) {
#pragma unroll
      for (int kstep = 0; kstep < D / 32; ++kstep) ldsm_x4<D, true>(qf[kstep], sQ, warp * 16, 2 * kstep, lane);
    }
    // Prefetch (the barrier above freed the stage: every warp is done with the tile it held).
    const int pf = tile + NST - 1;
    if (pf < n_tiles) {
      load_tile_async<FWD_BKV, D, FWD_THREADS>(sK + (pf % NST) * FWD_BKV * D, gK + pf * FWD_BKV * D, D, tid);
      load_tile_async<D, FWD_BKV, FWD_THREADS>(sV + (pf % NST) * D * FWD_BKV, gV + pf * FWD_BKV, nk_pad, tid);
    }
    cp_async_commit();
    const char* cK = sK + st * FWD_BKV * D;
    const char* cV = sV + st * D * FWD_BKV;

    // S = Q^ K^T (int32), 16 rows x 64 keys per warp.
    if constexpr (WGMMA) {
      // S of tile 0 here; S of tile t+1 issued now and left in flight while tile t's softmax runs (it
      // completes at the wait after P.V below).
      const unsigned long long dq = gmma_desc<D>(sQ + (warp / 4) * 64 * D);
      if (tile == 0) {
        int(&accf)[32] = reinterpret_cast<int(&)[32]>(acc_s);
        const unsigned long long dk = gmma_desc<D>(cK);
        wgmma_fence();
#pragma unroll
        for (int kstep = 0; kstep < D / 32; ++kstep)
          wgmma_m64n64k32_ss_s8(accf, gmma_desc_advance(dq, 32 * kstep), gmma_desc_advance(dk, 32 * kstep), kstep);
        wgmma_commit();
        wgmma_wait<0>();
        fence_regs(accf);
      }
      if (tile + 1 < n_tiles) {
        int(&accn)[32] = reinterpret_cast<int(&)[32]>(acc_n);
        const unsigned long long dk = gmma_desc<D>(sK + ((tile + 1) % NST) * FWD_BKV * D);
        wgmma_fence();
#pragma unroll
        for (int kstep = 0; kstep < D / 32; ++kstep)
          wgmma_m64n64k32_ss_s8(accn, gmma_desc_advance(dq, 32 * kstep), gmma_desc_advance(dk, 32 * kstep), kstep);
        wgmma_commit();
      }
    } else {
#pragma unroll
      for (int i = 0; i < 8; ++i) acc_s[i][0] = acc_s[i][1] = acc_s[i][2] = acc_s[i][3] = 0;
#pragma unroll
      for (int kstep = 0; kstep < D / 32; ++kstep) {
#pragma unroll
        for (int np = 0; np < 4; ++np) {
          unsigned bk[4];
          ldsm_x4<D, false>(bk, cK, np * 16, 2 * kstep, lane);
          const unsigned b0[2] = {bk[0], bk[1]}, b1[2] = {bk[2], bk[3]};
          mma_s8s8(acc_s[2 * np], qf[kstep], b0);
          mma_s8s8(acc_s[2 * np + 1], qf[kstep], b1);
        }
      }
    }

    // Dequantize by the key scale (u = S / s_Q), mask, row max of u (s_Q > 0, so the max commutes).
    float s[8][4];
    float mx[2] = {-INFINITY, -INFINITY};
    const bool need_mask = tile >= first_masked;
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) {
      const int key = tile * FWD_BKV + nt * 8 + 2 * t4;
      const float2 sk = *reinterpret_cast<const float2*>(ks + bhk * nk_pad + key);
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        float v = i2f_small(acc_s[nt][e]) * ((e & 1) ? sk.y : sk.x);
        if (need_mask) {
          const int kk = key + (e & 1), row = r_lo + 8 * (e >> 1);
          if (kk >= nk || (CAUSAL && kk > row + shift)) v = -INFINITY;
        }
        s[nt][e] = v;
        mx[e >> 1] = fmaxf(mx[e >> 1], v);
      }
    }
    float alpha[2], factor[2], sp[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      mx[r] = quad_max(mx[r]) * sq[r];
      const float m_new = fmaxf(m[r], mx[r]);
      const float m_use = m_new == -INFINITY ? 0.f : m_new;
      alpha[r] = exp2f(m[r] - m_use);
      const float gap = fminf(m_use - mx[r], 64.f);  // >= 0; clamped: such a tile contributes < 2^-64
      factor[r] = p_max * exp2f(gap);
      sp[r] = exp2f(-gap) / p_max;
      m[r] = m_new;
      mx[r] = -m_use;  // reuse: minus the exponent base
    }
    // Rescaling O by alpha only when some row's max moved (warp-uniform; alpha == 1 is exact otherwise).
    const bool rescale = __any_sync(0xffffffffu, alpha[0] != 1.f || alpha[1] != 1.f);
    // P~ = exp2(S - m), row sums of the unquantized P~, P^ = rint(P~ * factor) packed as the A operand.
    unsigned pa[2][4];
    float lsum[2] = {0.f, 0.f};
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) {
      unsigned c[4];
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float p = fast_exp2(fmaf(s[nt][e], sq[e >> 1], mx[e >> 1]));
        lsum[e >> 1] += p;
        c[e] = f2u8_rn_fma(p, factor[e >> 1]);
      }
      pack_acc_bytes_as_a(pa, nt, c);
    }
    l[0] = fmaf(l[0], alpha[0], lsum[0]);
    l[1] = fmaf(l[1], alpha[1], lsum[1]);
    float spv[2] = {sp[0], sp[1]};
    if (V_BLOCK) {
      const float sv = vs[(bhk * (nk_pad / FWD_BKV) + tile) * D];  // block scale, repeated over D
      spv[0] *= sv;
      spv[1] *= sv;
    }

    // O = alpha * O + (P^ V^) * s_P (* s_V per block).
    if constexpr (WGMMA) {
      int acc_pv[D / 2];
      const unsigned long long dv = gmma_desc<FWD_BKV>(cV);
      wgmma_fence();
      if constexpr (D == 128) {
        wgmma_m64n128k32_rs_u8s8(acc_pv, pa[0], dv, 0);
        wgmma_m64n128k32_rs_u8s8(acc_pv, pa[1], gmma_desc_advance(dv, 32), 1);
      } else {
        wgmma_m64n64k32_rs_u8s8(acc_pv, pa[0], dv, 0);
        wgmma_m64n64k32_rs_u8s8(acc_pv, pa[1], gmma_desc_advance(dv, 32), 1);
      }
      wgmma_commit();
      wgmma_wait<0>();  // P.V of this tile and Q.K^T of the next
      fence_regs(acc_pv);
      fence_regs(reinterpret_cast<int(&)[32]>(acc_n));
      if (rescale) {
#pragma unroll
        for (int nt = 0; nt < D / 8; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e)
            acc_o[nt][e] = fmaf(acc_o[nt][e], alpha[e >> 1], i2f_small(acc_pv[4 * nt + e]) * spv[e >> 1]);
      } else {
#pragma unroll
        for (int nt = 0; nt < D / 8; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e) acc_o[nt][e] = fmaf(i2f_small(acc_pv[4 * nt + e]), spv[e >> 1], acc_o[nt][e]);
      }
#pragma unroll
      for (int i = 0; i < 8; ++i)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc_s[i][e] = acc_n[i][e];
    } else {
#pragma unroll
      for (int dp = 0; dp < D / 16; ++dp) {
        int acc[2][4] = {{0, 0, 0, 0}, {0, 0, 0, 0}};
#pragma unroll
        for (int kst = 0; kst < 2; ++kst) {
          unsigned bv[4];
          ldsm_x4<FWD_BKV, false>(bv, cV, dp * 16, 2 * kst, lane);
          const unsigned b0[2] = {bv[0], bv[1]}, b1[2] = {bv[2], bv[3]};
          mma_u8s8(acc[0], pa[kst], b0);
          mma_u8s8(acc[1], pa[kst], b1);
        }
        if (rescale) {
#pragma unroll
          for (int j = 0; j < 2; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e)
              acc_o[2 * dp + j][e] = fmaf(acc_o[2 * dp + j][e], alpha[e >> 1], i2f_small(acc[j][e]) * spv[e >> 1]);
        } else {
#pragma unroll
          for (int j = 0; j < 2; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e)
              acc_o[2 * dp + j][e] = fmaf(i2f_small(acc[j][e]), spv[e >> 1], acc_o[2 * dp + j][e]);
        }
      }
    }
  }

  // Epilogue: normalize, per-channel V scale, store O (T), LSE.
#pragma unroll
  for (int r = 0; r < 2; ++r) l[r] = quad_sum(l[r]);
  // l == 0: the row sees no key (O = 0, LSE = -inf). A NaN l (NaN or Inf among the inputs) stays NaN.
  const float inv_l[2] = {l[0] == 0.f ? 0.f : 1.f / l[0], l[1] == 0.f ? 0.f : 1.f / l[1]};
#pragma unroll
  for (int nt = 0; nt < D / 8; ++nt) {
    const int col = nt * 8 + 2 * t4;
    float2 sv = make_float2(1.f, 1.f);
    if (!V_BLOCK) sv = *reinterpret_cast<const float2*>(vs + bhk * D + col);
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = r_lo + 8 * r;
      if (row < nq) {
        const unsigned packed = pack2<T>(acc_o[nt][2 * r] * sv.x * inv_l[r], acc_o[nt][2 * r + 1] * sv.y * inv_l[r]);
        *reinterpret_cast<unsigned*>(o + b * osb + h * osh + row * osn + col) = packed;
      }
    }
  }
  if (t4 == 0) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = r_lo + 8 * r;
      const float l2 = l[r] == 0.f ? INFINITY : m[r] + log2f(l[r]);
      if (row < nq)
        lse[bh * nq + row] = l[r] == 0.f ? -INFINITY : l2 * 0.6931471805599453f + (qmk ? qmk[bh * nq_pad + row] : 0.f);
      if (lse2 && row < nq_pad) lse2[bh * nq_pad + row] = row < nq ? l2 : INFINITY;
    }
  }
}

}  // namespace sage
