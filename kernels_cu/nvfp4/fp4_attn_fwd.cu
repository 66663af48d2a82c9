// FP4 attention forwards on fp16 tensor cores (docs/algorithms.md §5-6), FlashAttention-2 structure: one CTA = 16 *
// WARPS query rows (one warp per 16 rows), KV tiles of 64 keys, online softmax in base 2, mma.sync m16n8k16 fp16 with
// fp32 accumulation for Q.K^T and P.V.
//
// nvfp4_attn_fwd (SageAttention3-style inference): Q, K, V arrive packed (two E2M1 codes per byte + one
// E4M3 scale per 16 along the contraction axis, the exchange format of sagecupy.nvfp4). Each 16-block
// is dequantized to fp16 (exactly: fp4.cuh dequant16_half) into shared memory, once per CTA and tile:
// fp16 K and V double-buffered; tile t+2's packed bytes are copied (cp.async) into a staging area while
// tile t is computed, and dequantized into the free buffer at the start of iteration t+1.
// qc/qs (BHq, nq, D/2 | D/16); kc/ks (BHkv, nk, D/2 | D/16) of K - mu_K; vc/vs (BHkv, D, n16/2 | n16/16)
// (V^T, tokens zero-padded to n16 = nk rounded up to 16).
//
// qat_attn_fwd (Attn-QAT-style training forward): Q~, K~, V~^T = fq(Q), fq(K), fq(V)^T arrive as fp16
// (exact: every NVFP4 value is an fp16 value), zero-padded to 64 rows (q16 (BHq, nq_pad, D), k16
// (BHkv, nk_pad, D), vt16 (BHkv, D, nk_pad)), loaded with cp.async (2 stages). It also accumulates the
// high-precision O' = P V~ (P rounded to fp16 as the A operand) and writes it in fp32 for the backward.
//
// P (both): with row max r_t of tile t and running max m_t,
//   TWO_LEVEL:  x = 2688 * exp(S - r_t)  (so the tile's row max is 448 * 6),  beta = exp(r_t - m_t) / 2688
//   otherwise:  x = exp(S - m_t),                                            beta = 1
//   P^ = nvfp4(x) in 16-key blocks (E4M3 block scale of max/6, E2M1 codes; fp4.cuh), dequantized in
//   registers straight into the fp16 A operand (exact), and per 8-column output tile
//   O = alpha * O + beta * (P^ V^), l = alpha * l + beta * rowsum(x)  (the unquantized P~ = beta * x).
// The division by the block scale uses the fp32 reciprocal (not a correctly rounded quotient): P is
// itself an fp32 approximation of the float64 simulator's, so a code at a rounding boundary can differ
// from the simulator's either way (the tests bound the effect).
//
// Outputs: O in T with caller strides; lse (BHq, nq) natural-log LSE of the unsmoothed logits (adds
// qmk = sm_scale * q . mu_K when given); lse2 (BHq, nq_pad) base-2 LSE of the logits computed (+inf for
// rows that see no key); QAT: oprime (BHq, nq_pad, D) fp32. The mask is a window (left, right) (common/rows.cuh
// Window; causal is (-1, 0), full attention (-1, -1)), bottom-right aligned: a CTA visits only the key tiles its rows
// see (key_range) and masks those that cross an edge of the window or hold the partial tail.
#include "common/fp4.cuh"
#include "common/fp4_fwd.cuh"
#include "common/mma.cuh"
#include "common/numeric.cuh"
#include "common/rows.cuh"
#include "common/tile.cuh"

using namespace sage;

namespace {

constexpr int BKV = 64;

template <int D, int WARPS>
struct Fp4FwdShape {
  static constexpr int BQ = 16 * WARPS, THREADS = 32 * WARPS;
  static constexpr int ROWB = 2 * D;               // bytes per fp16 row of Q / K tiles
  static constexpr int Q_BYTES = BQ * ROWB;
  static constexpr int K_BYTES = BKV * ROWB;       // one stage
  static constexpr int V_BYTES = D * BKV * 2;      // one stage (V^T: D rows x 64 tokens, 128 B rows)
  static constexpr int KSTG = BKV * D / 2, VSTG = D * BKV / 2;  // packed staging (nvfp4)
  static constexpr int SMEM = Q_BYTES + 2 * (K_BYTES + V_BYTES) + KSTG + VSTG;
};

// Packed operands travel in 16-element units (8 code bytes + 1 scale byte). Thread `tid` owns units
// u = tid + j * THREADS of every tile: it copies their code bytes into its own slots of a staging area
// with cp.async (so no barrier is needed between the copy and the dequantization: the same thread does
// both) and keeps their scale bytes in registers, one per unit, so that nothing waits for those loads
// before the dequantization a tile later.
template <int NU>
struct UnitScales {
  unsigned b[NU];
};

// K tile `tile` (units: key x 16-channel block), zero beyond nk. Returns the scale bytes (byte j: unit j).
// (kc, ks point at this head's rows; the tile's rows start at tile * BKV; within a tile the offsets fit int.)
template <int D, int THREADS, int NU>
__device__ __forceinline__ UnitScales<NU> stage_k_packed(char* stg, const unsigned char* kc, const unsigned char* ks,
                                                         int tile, int nk, int tid) {
  constexpr int BPR = D / 16;
  const unsigned char* kct = kc + static_cast<long long>(tile) * (BKV * D / 2);
  const unsigned char* kst = ks + static_cast<long long>(tile) * (BKV * BPR);
  const int rows_left = nk - tile * BKV;
  UnitScales<NU> sc;
#pragma unroll
  for (int j = 0; j < NU; ++j) {
    const int u = tid + j * THREADS, row = u / BPR;
    const bool ok = row < rows_left;
    cp_async_8_zfill(smem_u32(stg + u * 8), kct + (ok ? u * 8 : 0), ok);  // unit u = row * BPR + blk: bytes 8u
    sc.b[j] = ok ? static_cast<unsigned>(__ldg(kst + u)) : 0u;
  }
  return sc;
}

// V^T tile `tile` (units: channel x 16-token block; rows of n16 tokens), zero beyond token `toks` (n16 counted from
// the first token of vc's rows).
template <int D, int THREADS, int NU>
__device__ __forceinline__ UnitScales<NU> stage_v_packed(char* stg, const unsigned char* vc, const unsigned char* vs,
                                                         int tile, int n16, int toks, int tid) {
  UnitScales<NU> sc;
  const unsigned char* vct = vc + tile * (BKV / 2);
  const unsigned char* vst = vs + tile * (BKV / 16);
  const int toks_left = toks - tile * BKV;
#pragma unroll
  for (int j = 0; j < NU; ++j) {
    const int u = tid + j * THREADS, ch = u / 4, tb = u % 4;
    const bool ok = tb * 16 < toks_left;
    cp_async_8_zfill(smem_u32(stg + u * 8), vct + (ok ? static_cast<long long>(ch) * (n16 / 2) + tb * 8 : 0), ok);
    sc.b[j] = ok ? static_cast<unsigned>(__ldg(vst + static_cast<long long>(ch) * (n16 / 16) + tb)) : 0u;
  }
  return sc;
}

// Dequantize this thread's staged units into a swizzled fp16 tile whose rows hold ROW_UNITS units.
template <int ROWB, int ROW_UNITS, int THREADS, int NU>
__device__ __forceinline__ void store_dequant(char* tile, const char* stg, const UnitScales<NU>& scales, int tid) {
#pragma unroll
  for (int j = 0; j < NU; ++j) {
    const int u = tid + j * THREADS, row = u / ROW_UNITS, blk = u % ROW_UNITS;
    unsigned h[8];
    dequant16_half(*reinterpret_cast<const uint2*>(stg + u * 8), scales.b[j], h);
    *reinterpret_cast<uint4*>(tile + swz<ROWB>(row, 2 * blk)) = make_uint4(h[0], h[1], h[2], h[3]);
    *reinterpret_cast<uint4*>(tile + swz<ROWB>(row, 2 * blk + 1)) = make_uint4(h[4], h[5], h[6], h[7]);
  }
}

}  // namespace

template <typename T, int D, int WARPS, bool PACKED, bool QAT, bool TWO_LEVEL>
__device__ __forceinline__ void fp4_attn_fwd_impl(
    const unsigned char* __restrict__ qc, const unsigned char* __restrict__ qs,
    const unsigned char* __restrict__ kc, const unsigned char* __restrict__ ks,
    const unsigned char* __restrict__ vc, const unsigned char* __restrict__ vs,
    const __half* __restrict__ q16, const __half* __restrict__ k16, const __half* __restrict__ vt16,
    const float* __restrict__ qmk, T* __restrict__ o, long long osb, long long osh, long long osn,
    float* __restrict__ lse, float* __restrict__ lse2, float* __restrict__ oprime,
    int Hq, int Hkv, int nq, int nk, int nq_pad, int nk_pad, int n16, float scale_log2, int left, int right) {
  using S = Fp4FwdShape<D, WARPS>;
  constexpr int BQ = S::BQ, THREADS = S::THREADS, ROWB = S::ROWB;
  static_assert(D == 64 || D == 128, "head dim 64 or 128");
  static_assert(BKV == KEY_TILE, "key tiles of 64");
  const Window win{left, right};
  extern __shared__ __align__(128) char smem_raw[];
  char* smem = smem_raw + ((128u - (smem_u32(smem_raw) & 127u)) & 127u);  // stays a shared-memory pointer (LDS/STS)
  char* sQ = smem;
  char* sK = sQ + S::Q_BYTES;          // 2 stages
  char* sV = sK + 2 * S::K_BYTES;      // 2 stages
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, t4 = lane % 4;
  const int nblk = gridDim.x;
  const int qblk = win.causal_shape() ? (nblk - 1 - blockIdx.x) : blockIdx.x;  // heavy (causal-shaped) blocks first
  const int h = blockIdx.y, b = blockIdx.z, hk = h / (Hq / Hkv);
  const long long bh = static_cast<long long>(b) * Hq + h, bhk = static_cast<long long>(b) * Hkv + hk;
  const int q0 = qblk * BQ, shift = nk - nq;
  // The key tiles the rows see, tl.first .. tl.n - 1 (the grid's blocks start below nq), as tiles 0 .. n_tiles - 1 of
  // the keys from kb on: the operands' pointers and key counts are relative to key kb, so that the loop and its
  // stages run as for a range that starts at key 0 (the masks take the absolute key: nk and shift stay kernel
  // arguments, which ptxas reads from the constant bank, where values relative to kb took registers).
  const KeyRange tl = key_range<BKV>(q0, BQ, nq, nk, win);
  const int n_tiles = tl.n - tl.first, kb = tl.first * BKV, nkr = nk - kb;
  const int fm = tl.first_masked - tl.first, mb = tl.masked_below - tl.first;  // tiles t >= fm or < mb: masked

  // ---- operand pipelines ----
  constexpr int NU_Q = BQ * (D / 16) / THREADS, NU_K = BKV * (D / 16) / THREADS, NU_V = D * 4 / THREADS;
  static_assert(NU_Q * THREADS == BQ * D / 16 && NU_K * THREADS == BKV * D / 16 && NU_V * THREADS == 4 * D, "units");
  char* sKstg = sV + 2 * S::V_BYTES;   // packed staging (nvfp4)
  char* sVstg = sKstg + S::KSTG;
  UnitScales<NU_K> ksc = {};  // scale bytes of the staged K / V units
  UnitScales<NU_V> vsc = {};
  const unsigned char *gkc = nullptr, *gks = nullptr, *gvc = nullptr, *gvs = nullptr;
  const char *gK16 = nullptr, *gV16 = nullptr;
  if constexpr (PACKED) {
    gkc = kc + (bhk * nk + kb) * (D / 2);
    gks = ks + (bhk * nk + kb) * (D / 16);
    gvc = vc + bhk * D * (n16 / 2) + kb / 2;
    gvs = vs + bhk * D * (n16 / 16) + kb / 16;
    {  // Q: packed rows -> fp16 tile (rows >= nq zero), through the K (and V) staging slots
      constexpr int BPR = D / 16;
      UnitScales<NU_Q> qsc;
#pragma unroll
      for (int j = 0; j < NU_Q; ++j) {
        const int u = tid + j * THREADS, row = u / BPR, blk = u % BPR, qr = q0 + row;
        const bool ok = qr < nq;
        cp_async_8_zfill(smem_u32(sKstg + u * 8), qc + (ok ? (bh * nq + qr) * (D / 2) + blk * 8 : 0), ok);
        qsc.b[j] = ok ? static_cast<unsigned>(__ldg(qs + (bh * nq + qr) * BPR + blk)) : 0u;
      }
      cp_async_commit();
      cp_async_wait<0>();
      asm volatile("" ::: "memory");  // the plain loads of the staging area below must not move above the wait
      static_assert(NU_Q * THREADS * 8 <= S::KSTG + S::VSTG, "Q units fit the (contiguous) K and V staging areas");
      store_dequant<ROWB, D / 16, THREADS, NU_Q>(sQ, sKstg, qsc, tid);
    }
    if (n_tiles > 0) {
      ksc = stage_k_packed<D, THREADS, NU_K>(sKstg, gkc, gks, 0, nkr, tid);
      vsc = stage_v_packed<D, THREADS, NU_V>(sVstg, gvc, gvs, 0, n16, n16 - kb, tid);
      cp_async_commit();
      cp_async_wait<0>();
      asm volatile("" ::: "memory");
      store_dequant<ROWB, D / 16, THREADS, NU_K>(sK, sKstg, ksc, tid);
      store_dequant<BKV * 2, 4, THREADS, NU_V>(sV, sVstg, vsc, tid);
    }
    if (n_tiles > 1) {
      ksc = stage_k_packed<D, THREADS, NU_K>(sKstg, gkc, gks, 1, nkr, tid);
      vsc = stage_v_packed<D, THREADS, NU_V>(sVstg, gvc, gvs, 1, n16, n16 - kb, tid);
      cp_async_commit();
    }
  } else {
    gK16 = reinterpret_cast<const char*>(k16 + (bhk * nk_pad + kb) * D);
    gV16 = reinterpret_cast<const char*>(vt16 + bhk * D * nk_pad + kb);
    load_tile_async<BQ, ROWB, THREADS>(sQ, reinterpret_cast<const char*>(q16 + (bh * nq_pad + q0) * D), ROWB, tid);
    if (n_tiles > 0) {
      load_tile_async<BKV, ROWB, THREADS>(sK, gK16, ROWB, tid);
      load_tile_async<D, BKV * 2, THREADS>(sV, gV16, static_cast<long long>(nk_pad) * 2, tid);
    }
    cp_async_commit();
  }

  const int r_lo = q0 + warp * 16 + g;  // this thread's rows: r_lo, r_lo + 8
  Fp4Rows rs = {{-INFINITY, -INFINITY}, {0.f, 0.f}};
  float acc_o[D / 8][4];
  float acc_p[QAT ? D / 8 : 1][4];  // O' (QAT)
#pragma unroll
  for (int i = 0; i < D / 8; ++i) acc_o[i][0] = acc_o[i][1] = acc_o[i][2] = acc_o[i][3] = 0.f;
  if constexpr (QAT) {
#pragma unroll
    for (int i = 0; i < D / 8; ++i) acc_p[i][0] = acc_p[i][1] = acc_p[i][2] = acc_p[i][3] = 0.f;
  }
  for (int tile = 0; tile < n_tiles; ++tile) {
    const int st = tile & 1;
    if constexpr (!PACKED) cp_async_wait<0>();
    __syncthreads();  // tile `tile` is in stage st; every warp is done with stage st ^ 1 (tile - 1)
    if (tile + 1 < n_tiles) {
      if constexpr (PACKED) {
        cp_async_wait<0>();  // this thread's staged units of tile + 1
        asm volatile("" ::: "memory");
        store_dequant<ROWB, D / 16, THREADS, NU_K>(sK + (st ^ 1) * S::K_BYTES, sKstg, ksc, tid);
        store_dequant<BKV * 2, 4, THREADS, NU_V>(sV + (st ^ 1) * S::V_BYTES, sVstg, vsc, tid);
        if (tile + 2 < n_tiles) {
          ksc = stage_k_packed<D, THREADS, NU_K>(sKstg, gkc, gks, tile + 2, nkr, tid);
          vsc = stage_v_packed<D, THREADS, NU_V>(sVstg, gvc, gvs, tile + 2, n16, n16 - kb, tid);
          cp_async_commit();
        }
      } else {
        load_tile_async<BKV, ROWB, THREADS>(sK + (st ^ 1) * S::K_BYTES,
                                            gK16 + static_cast<long long>(tile + 1) * BKV * ROWB, ROWB, tid);
        load_tile_async<D, BKV * 2, THREADS>(sV + (st ^ 1) * S::V_BYTES,
                                             gV16 + static_cast<long long>(tile + 1) * BKV * 2,
                                             static_cast<long long>(nk_pad) * 2, tid);
      }
    }
    if constexpr (!PACKED) cp_async_commit();
    const char* cK = sK + st * S::K_BYTES;
    const char* cV = sV + st * S::V_BYTES;

    // S = Q^ K^T (fp32), 16 rows x 64 keys per warp.
    float s[8][4];
#pragma unroll
    for (int i = 0; i < 8; ++i) s[i][0] = s[i][1] = s[i][2] = s[i][3] = 0.f;
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      unsigned qf[4];  // Q fragments are re-read from shared memory every tile (registers go to O, O', P)
      ldsm_x4<ROWB, true>(qf, sQ, warp * 16, 2 * kk, lane);
#pragma unroll
      for (int np = 0; np < 4; ++np) {
        unsigned bk[4];
        ldsm_x4<ROWB, false>(bk, cK, np * 16, 2 * kk, lane);
        const unsigned b0[2] = {bk[0], bk[1]}, b1[2] = {bk[2], bk[3]};
        mma_f16<__half>(s[2 * np], qf, b0);
        mma_f16<__half>(s[2 * np + 1], qf, b1);
      }
    }
    unsigned pa[4][4], pp[QAT ? 4 : 1][4];
    const Fp4TileScale ts = fp4_softmax_tile<TWO_LEVEL, QAT>(s, rs, pa, pp, tl.first + tile, tile >= fm || tile < mb,
                                                             win, r_lo, t4, nk, shift, scale_log2);

    // O = alpha * O + beta * (P^ V^) per 8-channel output tile; QAT: O' = alpha * O' + P~ V~.
#pragma unroll
    for (int dp = 0; dp < D / 16; ++dp) {
      float acc[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) {
        unsigned bv[4];
        ldsm_x4<BKV * 2, false>(bv, cV, dp * 16, 2 * kk, lane);
        const unsigned b0[2] = {bv[0], bv[1]}, b1[2] = {bv[2], bv[3]};
        mma_f16<__half>(acc[0], pa[kk], b0);
        mma_f16<__half>(acc[1], pa[kk], b1);
        if constexpr (QAT) {
          // alpha applied first, then accumulated in place
          if (kk == 0 && ts.rescale) {
#pragma unroll
            for (int jj = 0; jj < 2; ++jj)
#pragma unroll
              for (int e = 0; e < 4; ++e) acc_p[2 * dp + jj][e] *= ts.alpha[e >> 1];
          }
          mma_f16<__half>(acc_p[2 * dp], pp[kk], b0);
          mma_f16<__half>(acc_p[2 * dp + 1], pp[kk], b1);
        }
      }
      fp4_pv_update<2>(reinterpret_cast<float(&)[2][4]>(acc_o[2 * dp]), acc, ts);
    }
  }

  if constexpr (!PACKED) cp_async_wait<0>();  // (a CTA that skipped every tile still has its Q copy pending)
  fp4_fwd_epilogue<T, D, QAT>(acc_o, QAT ? acc_p : nullptr, rs, o + b * osb + h * osh, osn,
                         QAT ? oprime + bh * nq_pad * D : nullptr, lse + bh * nq, lse2 ? lse2 + bh * nq_pad : nullptr,
                         qmk ? qmk + bh * nq : nullptr, r_lo, t4, nq, nq_pad);
}

template <typename T, int D, int WARPS, bool TWO_LEVEL>
__global__ void __launch_bounds__(32 * WARPS)
nvfp4_attn_fwd(const unsigned char* __restrict__ qc, const unsigned char* __restrict__ qs,
               const unsigned char* __restrict__ kc, const unsigned char* __restrict__ ks,
               const unsigned char* __restrict__ vc, const unsigned char* __restrict__ vs,
               const float* __restrict__ qmk, T* __restrict__ o, long long osb, long long osh, long long osn,
               float* __restrict__ lse, int Hq, int Hkv, int nq, int nk, int n16, float scale_log2, int left,
               int right) {
  grid_dep_wait();  // (launched as a programmatic dependent of the pre-pass)
  fp4_attn_fwd_impl<T, D, WARPS, true, false, TWO_LEVEL>(qc, qs, kc, ks, vc, vs, nullptr, nullptr, nullptr, qmk, o, osb,
                                                          osh, osn, lse, nullptr, nullptr, Hq, Hkv, nq, nk, 0, 0, n16,
                                                          scale_log2, left, right);
}

template <typename T, int D, int WARPS>
__global__ void __launch_bounds__(32 * WARPS)
qat_attn_fwd(const __half* __restrict__ q16, const __half* __restrict__ k16, const __half* __restrict__ vt16,
             T* __restrict__ o, long long osb, long long osh, long long osn,
             float* __restrict__ lse, float* __restrict__ lse2, float* __restrict__ oprime,
             int Hq, int Hkv, int nq, int nk, int nq_pad, int nk_pad, float scale_log2, int left, int right) {
  fp4_attn_fwd_impl<T, D, WARPS, false, true, true>(nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, q16, k16, vt16,
                                                    nullptr, o, osb, osh, osn, lse, lse2, oprime, Hq, Hkv, nq, nk,
                                                    nq_pad, nk_pad, 0, scale_log2, left, right);
}
