// NVFP4 attention forward on Hopper tensor cores (sm_90a only): the numerics of nvfp4_attn_fwd (fp4_attn_fwd.cu,
// docs/algorithms.md §5: the same per-tile softmax and P quantization, common/fp4_fwd.cuh), with both products on
// wgmma:
//   S   = Q^ K^T   m64n64k16 f32.f16.f16   (dequantized Q^ and K^ tiles in shared memory)
//   P.V = P^ V^    m64nDk16 f32.f16.f16    (P^ from registers: its fp16 values are exact; V^^T shared)
// Two kernels (the host picks by head dim; nvfp4.py):
// * nvfp4_attn_fwd_sm90 (D = 64): one warpgroup (4 warps, 64 query rows) per CTA, every thread dequantizing a share
//   of each K/V tile (below);
// * nvfp4_attn_fwd_ws_img (D = 128): warp-specialized, one producer warpgroup copying K/V stage images
//   (nvfp4/ws_images.cuh) into a ring, three consumer warpgroups multiplying (below), the grid's last items split
//   along their keys on calls in the plain dispatch order (nvfp4/ws_split.cuh).
// Operands stay packed in device memory and are staged and dequantized in 64-element tasks (nvfp4/sm90_common.cuh).
//
// Inputs: qc/qs (BHq, nq, D/2 | D/16), kc/ks (BHkv, nk, D/2 | D/16) of K - mu_K, vc/vs (BHkv, D, *) V^T with
// rows of vcs code bytes / vcs / 8 scale bytes (vcs a multiple of 32: tokens padded to 64 by the host; tokens
// >= n16 are zero-filled here). Outputs and the window (left, right) as nvfp4_attn_fwd's: a CTA visits the key tiles
// its rows see (common/rows.cuh key_range), taken as tiles 0, 1, .. of the keys from the range's first one on
// (operand pointers and key counts relative to that key; the masks take absolute keys), so that the rings' stages and
// mbarrier phases run as for a range that starts at key 0.
#include "common/rows.cuh"
#include "nvfp4/sm90_common.cuh"
#include "nvfp4/ws_images.cuh"
#include "nvfp4/ws_split.cuh"

// CTAs per SM the D = 64 kernel's registers are budgeted for (__launch_bounds__): 3 measured 1.08-1.19x the
// unbounded build (164-165 registers either way), 4 (128 registers, 144 bytes of spills) 1.02-1.10x (bitwise the
// same O; docs/experiments.md).
#ifndef SAGE_FP4_MIN_CTAS
#define SAGE_FP4_MIN_CTAS 3
#endif
// The warp-specialized kernel's producer: its suspend hint (ns) while it waits for a free stage (0: the hardware's
// default limit, which polls ~50 instructions per consumer warp and tile): 2000 measured 1.01-1.02x, bitwise the same
// (docs/experiments.md).
#ifndef SAGE_FP4_WS_WAIT_NS
#define SAGE_FP4_WS_WAIT_NS 2000
#endif

// ---- D = 64: nvfp4_attn_fwd_sm90 ----
//
// Every thread copies its share of each K/V tile's tasks and dequantizes them into 3-stage rings handed over with
// mbarriers (no CTA-wide barrier per tile): full[s] (every thread has dequantized its share of the tile in stage s),
// k_empty[s] / v_empty[s] (every thread's Q.K^T / P.V on it has retired). Per key tile t:
//   softmax(t) -> P^ (fp16 A fragments); issue P.V(t);
//   while it runs: wait until tile t-1's stage is free, dequantize tile t+2 into it, arrive on full, stage tile
//   t+3's packed bytes; wait for full(t+1); issue Q.K^T(t+1);
//   wait for P.V(t), arrive on v_empty, fold it into O (O = alpha O + beta P^V^, the mma.sync kernel's order);
//   wait for Q.K^T(t+1), arrive on k_empty.
// Every wgmma issue and wait is unconditional (after the last tile a stale stage is multiplied and dropped), so ptxas
// sees straight-line pipelines (warning C7514 otherwise, which CI fails on). The template keeps the CTA size WARPS
// (the instance's name); the host launches 4 warps (nvfp4.WGMMA_D64_WARPS).
namespace {

template <int D, int WARPS>
struct Nv90 {
  static constexpr int BQ = 16 * WARPS, THREADS = 32 * WARPS;
  static constexpr int NST = 3;  // K and V ring stages
  static constexpr int Q_BYTES = BQ * 2 * D, K_BYTES = BKV * 2 * D, V_BYTES = D * BKV * 2;
  static constexpr int KTASKS = BKV * D / 64, TASKS = KTASKS + D;  // per key tile: K quarter-rows, V channels
  static constexpr int QTASKS = BQ * D / 64;
  static constexpr int SLOTS = QTASKS > TASKS ? QTASKS : TASKS;  // staging slots (the Q tasks use them first)
  static constexpr int NJ = (TASKS + THREADS - 1) / THREADS;  // tasks per thread and tile
  static constexpr int STG_CODES = 32 * SLOTS, STG = 36 * SLOTS;
  static constexpr int BARS = 3 * NST * 8;  // mbarriers: full[NST], k_empty[NST], v_empty[NST]
  // Q, the K and V rings, the staging area, the mbarriers; + 1024 for the alignment of the tiles
  // (host: nvfp4.fwd_smem_bytes)
  static constexpr int SMEM = Q_BYTES + NST * (K_BYTES + V_BYTES) + STG + BARS + 1024;
};

// The packed bytes of key tile `tile` -> this thread's staging slots.
template <int D, int WARPS>
__device__ __forceinline__ void stage_tile(char* stg, const unsigned char* gkc, const unsigned char* gks,
                                           const unsigned char* gvc, const unsigned char* gvs, int vcs, int tile,
                                           int nk, int n16, int tid) {
  using S = Nv90<D, WARPS>;
#pragma unroll
  for (int j = 0; j < S::NJ; ++j) {
    const int i = tid + j * S::THREADS;
    if (S::TASKS % S::THREADS != 0 && i >= S::TASKS) break;
    // (j + 1) * THREADS <= KTASKS: a K task for every thread (known at compile time), and so on
    if ((j + 1) * S::THREADS <= S::KTASKS || (j * S::THREADS < S::KTASKS && i < S::KTASKS)) {
      const int row = i % BKV, piece = i / BKV, key = tile * BKV + row;  // (8 consecutive threads: 8 rows of a
                                                                         // piece, conflict-free 16-byte stores)
      const bool ok = key < nk;
      const long long off = ok ? static_cast<long long>(key) * (D / 2) + piece * 32 : 0;
      stage_task(stg, i, gkc + off, gks + (ok ? static_cast<long long>(key) * (D / 16) + piece * 4 : 0), ok ? 32 : 0,
                 ok ? 4 : 0, S::STG_CODES);
    } else {
      const int ch = i - S::KTASKS, toks = n16 - tile * BKV;  // tokens of this tile that exist (may be <= 0)
      stage_task(stg, i, gvc + static_cast<long long>(ch) * vcs + tile * 32,
                 gvs + static_cast<long long>(ch) * (vcs / 8) + tile * 4, toks / 2, toks / 16, S::STG_CODES);
    }
  }
}

template <int D, int WARPS>
__device__ __forceinline__ void dequant_tile(char* sKst, char* sVst, const char* stg, int tid) {
  using S = Nv90<D, WARPS>;
#pragma unroll
  for (int j = 0; j < S::NJ; ++j) {
    const int i = tid + j * S::THREADS;
    if (S::TASKS % S::THREADS != 0 && i >= S::TASKS) break;
    if ((j + 1) * S::THREADS <= S::KTASKS || (j * S::THREADS < S::KTASKS && i < S::KTASKS))
      dequant_task(sKst + (i / BKV) * BKV * 128, i % BKV, stg, i, S::STG_CODES);
    else
      dequant_task(sVst, i - S::KTASKS, stg, i, S::STG_CODES);
  }
}

}  // namespace

// Grid (ceil(nq / (16 WARPS)), Hq, B), block 32 WARPS, dynamic shared memory Nv90<D, WARPS>::SMEM.
// CG: grids of the causal work shape (Window::causal_shape) dispatched heaviest block first across groups of CG
// (batch, head) pairs (common/rows.cuh query_block); the host instantiates CG = FP4_CAUSAL_GROUP for those calls and
// CG = 1 (the plain order) otherwise.
template <typename T, int D, int WARPS, bool TWO_LEVEL, int CG = 1>
__global__ void __launch_bounds__(32 * WARPS, (D == 64 && WARPS == 4) ? SAGE_FP4_MIN_CTAS : 1)
nvfp4_attn_fwd_sm90(const unsigned char* __restrict__ qc, const unsigned char* __restrict__ qs,
                    const unsigned char* __restrict__ kc, const unsigned char* __restrict__ ks,
                    const unsigned char* __restrict__ vc, const unsigned char* __restrict__ vs, int vcs,
                    const float* __restrict__ qmk, T* __restrict__ o, long long osb, long long osh, long long osn,
                    float* __restrict__ lse, int Hq, int Hkv, int nq, int nk, int n16, float scale_log2, int left,
                    int right) {
  using S = Nv90<D, WARPS>;
  static_assert(D == 64 && WARPS == 4, "one warpgroup at D = 64 (D = 128: nvfp4_attn_fwd_ws_img)");
  constexpr int BQ = S::BQ;
  const Window win{left, right};
  grid_dep_wait();  // (launched as a programmatic dependent of the pre-pass: nothing global is touched before this)
  extern __shared__ __align__(128) char smem_raw[];
  // Tiles aligned to 1024 bytes (8 swizzled rows of 128 B), as wgmma descriptors require; pointer arithmetic
  // keeps the compiler aware that this is shared memory.
  char* smem = smem_raw + ((1024u - (smem_u32(smem_raw) & 1023u)) & 1023u);
  char* sQ = smem;                          // D / 64 pieces x BQ rows x 128 B
  char* sK = sQ + S::Q_BYTES;               // NST stages x D / 64 pieces x 64 rows x 128 B
  char* sV = sK + S::NST * S::K_BYTES;      // NST stages x D rows x 128 B
  char* stg = sV + S::NST * S::V_BYTES;     // staging: 32 code bytes per task, then 4 scale bytes per task
  unsigned long long* bars = reinterpret_cast<unsigned long long*>(stg + S::STG);
  unsigned long long* full = bars;               // tile in stage s dequantized by every thread
  unsigned long long* k_empty = bars + S::NST;   // every thread's Q.K^T on K stage s retired
  unsigned long long* v_empty = bars + 2 * S::NST;  // every thread's P.V on V stage s retired
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, t4 = lane % 4;
  const QueryBlock qb = query_block<CG>(BQ, win.causal_shape(), Hq, Hkv);
  const int q0 = qb.q0, h = qb.h, b = qb.b;
  const long long bh = qb.bh, bhk = qb.bhk;
  const int shift = nk - nq;
  const KeyRange tl = key_range<BKV>(q0, BQ, nq, nk, win);
  // tile t (0 .. ntl - 1) below is key tile tl.first + t: keys from kb on, nkr and n16r of them (K's rows, V's tokens)
  const int ntl = tl.n - tl.first, kb = tl.first * BKV, nkr = nk - kb, n16r = n16 - kb;
  const int fm = tl.first_masked - tl.first, mb = tl.masked_below - tl.first;  // tiles t >= fm or < mb: masked

  const unsigned char* gkc = kc + (bhk * nk + kb) * (D / 2);
  const unsigned char* gks = ks + (bhk * nk + kb) * (D / 16);
  const unsigned char* gvc = vc + bhk * D * vcs + kb / 2;
  const unsigned char* gvs = vs + bhk * D * (vcs / 8) + kb / 16;
  if (tid < 3 * S::NST) mbar_init(bars + tid, S::THREADS);

  // Prologue: Q (rows >= nq zero) dequantized by its owners; the range's tiles 0 and 1 dequantized (full[0],
  // full[1]); its tile 2 staged.
#pragma unroll
  for (int j = 0; j < (S::QTASKS + S::THREADS - 1) / S::THREADS; ++j) {
    const int i = tid + j * S::THREADS;
    if (S::QTASKS % S::THREADS != 0 && i >= S::QTASKS) break;
    const int row = i % BQ, piece = i / BQ, qr = q0 + row;
    const bool ok = qr < nq;
    const long long r = bh * nq + qr;
    stage_task(stg, i, qc + (ok ? r * (D / 2) + piece * 32 : 0), qs + (ok ? r * (D / 16) + piece * 4 : 0), ok ? 32 : 0,
               ok ? 4 : 0, S::STG_CODES);
  }
  cp_async_commit();
  cp_async_wait<0>();
  asm volatile("" ::: "memory");  // the plain loads of the staging area below must not move above the wait
#pragma unroll
  for (int j = 0; j < (S::QTASKS + S::THREADS - 1) / S::THREADS; ++j) {
    const int i = tid + j * S::THREADS;
    if (S::QTASKS % S::THREADS != 0 && i >= S::QTASKS) break;
    dequant_task(sQ + (i / BQ) * BQ * 128, i % BQ, stg, i, S::STG_CODES);
  }
  fence_proxy_async();  // this thread's generic-proxy writes (Q) -> the tensor cores' reads
  __syncthreads();      // Q complete; the mbarriers initialized
#pragma unroll
  for (int t = 0; t < 3; ++t) {
    if (t < ntl) {
      stage_tile<D, WARPS>(stg, gkc, gks, gvc, gvs, vcs, t, nkr, n16r, tid);
      cp_async_commit();
      if (t < 2) {
        cp_async_wait<0>();
        asm volatile("" ::: "memory");
        dequant_tile<D, WARPS>(sK + t * S::K_BYTES, sV + t * S::V_BYTES, stg, tid);
        fence_proxy_async();
        mbar_arrive(full + t);
      }
    }
  }

  const int r_lo = q0 + warp * 16 + g;  // this thread's rows: r_lo, r_lo + 8
  Fp4Rows rs = {{-INFINITY, -INFINITY}, {0.f, 0.f}};
  float acc_o[D / 8][4];
#pragma unroll
  for (int i = 0; i < D / 8; ++i) acc_o[i][0] = acc_o[i][1] = acc_o[i][2] = acc_o[i][3] = 0.f;
  float acc_s[8][4];   // S of the tile being softmaxed; then Q.K^T of the next one, in flight
  float acc_pv[D / 2];  // P^.V^ of this tile
  float(&accs)[32] = reinterpret_cast<float(&)[32]>(acc_s);
  const char* sQw = sQ + (warp / 4) * 64 * 128;  // this warpgroup's 64 rows, in every piece
  static_assert(BKV == 64, "64-key tiles");
  auto issue_qk = [&](int kst) { wgmma_qk16<D, BQ>(accs, sQw, sK, kst * S::K_BYTES); };
  const unsigned long long dv0 = gmma_desc<128>(sV);

  if (ntl > 0) {
    mbar_wait(full, 0);
    wgmma_fence();
    issue_qk(0);
    wgmma_wait<0>();
    fence_regs(accs);
    mbar_arrive(k_empty);
  }

  // Tile j lives in stage j % NST; its barriers' phase parity is (j / NST) & 1. Kept incrementally: st0 = stage
  // of tile t, st1 / ph1 = stage / parity of t+1, st2 / ph2 of t+2 (the tile t-1 it held had parity ph2 ^ 1).
  static_assert(S::NST == 3, "the stage bookkeeping below");
  int st0 = 0, st1 = 1, st2 = 2;
  unsigned ph1 = 0, ph2 = 0;
  for (int tile = 0; tile < ntl; ++tile) {
    unsigned pa[4][4], pp_unused[1][4];
    const Fp4TileScale ts = fp4_softmax_tile<TWO_LEVEL, false>(
        acc_s, rs, pa, pp_unused, tl.first + tile, tile >= fm || tile < mb, win, r_lo, t4, nk, shift, scale_log2);
    wgmma_fence();
    {  // P.V(t)
      const unsigned long long dv = gmma_desc_advance(dv0, st0 * S::V_BYTES);
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) wgmma_rs<__half, false>(acc_pv, pa[kk], gmma_desc_advance(dv, 32 * kk), kk);
      wgmma_commit();
    }
    // While P.V(t) runs: tile t+2 from this thread's staging slots into stage (t+2) % NST, once every thread is
    // done with the tile it held (t-1); then stage tile t+3's packed bytes.
    const int nxt = tile + 2;
    if (nxt < ntl) {
      const int st = st2;
      if (nxt >= S::NST) {
        mbar_wait(k_empty + st, ph2 ^ 1);
        mbar_wait(v_empty + st, ph2 ^ 1);
      }
      cp_async_wait<0>();
      asm volatile("" ::: "memory");
      dequant_tile<D, WARPS>(sK + st * S::K_BYTES, sV + st * S::V_BYTES, stg, tid);
      fence_proxy_async();
      mbar_arrive(full + st);
      if (nxt + 1 < ntl) stage_tile<D, WARPS>(stg, gkc, gks, gvc, gvs, vcs, nxt + 1, nkr, n16r, tid);
      cp_async_commit();
    }
    // Q.K^T(t+1) once every thread has dequantized tile t+1 (after the last tile: a stale stage, dropped).
    const bool more = tile + 1 < ntl;
    if (more) mbar_wait(full + st1, ph1);
    wgmma_fence();
    issue_qk(st1);
    wgmma_wait<1>();  // P.V(t) done (Q.K^T(t+1) may still run)
    fence_regs(acc_pv);
    hold_regs(pa);  // P.V(t)'s A operand stays untouched until here
    mbar_arrive(v_empty + st0);
    fp4_pv_update<D / 8>(acc_o, reinterpret_cast<const float(&)[D / 8][4]>(acc_pv), ts);
    wgmma_wait<0>();  // Q.K^T(t+1) done
    fence_regs(accs);
    if (more) mbar_arrive(k_empty + st1);
    st0 = st1;
    st1 = st2;
    ph1 = ph2;
    st2 = st2 == 2 ? 0 : st2 + 1;
    ph2 ^= st2 == 0 ? 1u : 0u;
  }
  cp_async_wait<0>();  // nothing may land in shared memory after the CTA exits
  fp4_fwd_epilogue<T, D, false>(acc_o, nullptr, rs, o + b * osb + h * osh, osn, nullptr, lse + bh * nq, nullptr,
                         qmk ? qmk + bh * nq : nullptr, r_lo, t4, nq, 0);
}

// ---- D = 128: nvfp4_attn_fwd_ws_img, warp-specialized ----
//
// Warpgroup 0 (the producer) copies each key tile's K/V stage image (nvfp4/ws_images.cuh) into a 4-stage ring with
// two bulk copies (full / empty mbarriers) and stages and dequantizes Q; the NC = 3 consumer warpgroups (64 query rows
// each, 192 rows and 16 warps per CTA: four per scheduler) only multiply and quantize P, and drift apart freely within
// the ring. A kernel whose every thread dequantizes a share of each tile (as the D = 64 one) runs its warpgroups in
// step, meeting on every tile's mbarriers: their softmax phases coincide, and the tensor cores and the ALUs take
// turns instead of overlapping. The producer gives up registers (setmaxnreg: 56), the consumers take them (152, one
// S tile): softmax(t), P.V(t), Q.K^T(t+1), wait for both. Three consumers measured 1.04-1.08x a 12-warp kernel of
// the D = 64 kind on the H200, two consumers (224 registers, two S tiles) 0.99-1.04x (docs/experiments.md).
// O is kept in the frame of its last tile (common/fp4_fwd.cuh fp4_frame_step; the wgmma QAT forward's rule): D / 2
// fewer registers than a separate P^.V^ accumulator. Thread-owned P blocks (fp4_softmax_tile's TBLK): each tile's keys
// are stored in FP4_TBLK_KEY order, so that each consumer thread's 16 logits of a row are one whole 16-key block of P
// (no shuffles for the block maxima, one block scale per row): 1.04-1.06x. Every element of P^ is the same number as in
// the key order, and the products and row sums add the keys of a tile in another order (the tensor cores' k16 steps
// then mix 16-key blocks of different scales: O within relative L2 1.6e-4 of the key-order kernel at 4K).
namespace {

// Registers per thread after setmaxnreg: the producer's, and the consumers' share of what the producer gives back
// from the launch's allocation (65536 / threads, in multiples of 8): 128 x 56 + 384 x 152 = 512 x 128.
constexpr int WS_PREG = 56;
template <int NC>
__host__ __device__ constexpr int ws_consumer_regs() {
  constexpr int threads = 128 * (NC + 1), launch = 65536 / threads / 8 * 8;
  return (launch * threads - 128 * WS_PREG) / (128 * NC) / 8 * 8;
}

__device__ __forceinline__ void setmaxnreg_dec_producer() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(WS_PREG));
}
template <int NC>
__device__ __forceinline__ void setmaxnreg_inc_consumer() {
  static_assert(ws_consumer_regs<NC>() == 152, "the budget the kernel was measured with");
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(ws_consumer_regs<NC>()));
}

// Producer: Q's packed bytes of the CTA's BQ rows from q0 (head bh; rows >= nq zero-filled) -> staging buffer stq
// (this thread's tasks ptid + j * 128, all issued at once); then, once they have landed, dequantized into sQ.
template <int D, int NC>
__device__ __forceinline__ void ws_stage_q_all(char* stq, int q0, long long bh, const unsigned char* qc,
                                               const unsigned char* qs, int nq, int ptid) {
  using S = NvWs<D, NC>;
#pragma unroll
  for (int j = 0; j < S::QTASKS / S::PTHREADS; ++j) {
    const int i = ptid + j * S::PTHREADS, row = i % S::BQ, piece = i / S::BQ, qr = q0 + row;
    const bool ok = qr < nq;
    const long long r = bh * nq + qr;
    stage_task(stq, i, qc + (ok ? r * (D / 2) + piece * 32 : 0), qs + (ok ? r * (D / 16) + piece * 4 : 0),
               ok ? 32 : 0, ok ? 4 : 0, S::STG_CODES);
  }
}
template <int D, int NC>
__device__ __forceinline__ void ws_dequant_q(char* sQ, const char* stq, int ptid) {
  using S = NvWs<D, NC>;
#pragma unroll
  for (int j = 0; j < S::QTASKS / S::PTHREADS; ++j) {
    const int i = ptid + j * S::PTHREADS;
    dequant_task(sQ + (i / S::BQ) * S::BQ * 128, i % S::BQ, stq, i, S::STG_CODES);
  }
}

}  // namespace

// Grid (ceil(nq / (64 NC)), Hq, B), or with SPLIT a 1-D grid (nvfp4/ws_split.cuh: whole, nsplit, nblk, part_ws,
// counters; CG = 1), block 128 (NC + 1), dynamic shared memory NvWs<D, NC>::SMEM. qc, qs, qmk, o, lse, the sizes and
// the window (left, right) as nvfp4_attn_fwd_sm90's (a SPLIT part takes its share of its item's tiles); kvimg: the
// K/V stage images, (B, Hkv, ceil(nk / 64)) of WS_IMG_STAGE<D> bytes, in place of the packed K and V (nk still gives
// the masks). The signature keeps the arguments of a form that quantized Q in the kernel (q, qsb, qsh, qsn, mu,
// qmk_scale: unused, the host passes nulls and zeros; QIN must be false), so that the instances' symbols stay what
// they were measured and tested as.
template <typename T, int D, bool TWO_LEVEL, int CG, int NC, bool QIN, bool SPLIT>
__global__ void __launch_bounds__(128 * (NC + 1), 1)
nvfp4_attn_fwd_ws_img(const unsigned char* __restrict__ qc, const unsigned char* __restrict__ qs,
                      const T* __restrict__ q, long long qsb, long long qsh, long long qsn,
                      const float* __restrict__ mu, float qmk_scale, const unsigned char* __restrict__ kvimg,
                      const float* __restrict__ qmk, T* __restrict__ o, long long osb, long long osh, long long osn,
                      float* __restrict__ lse, int Hq, int Hkv, int nq, int nk, int n16, float scale_log2,
                      int left, int right, int whole, int nsplit, int nblk, float* __restrict__ part_ws,
                      int* __restrict__ counters) {
  static_assert(!QIN, "Q from the pre-pass's packed bytes (qc, qs)");
  static_assert(!SPLIT || (TWO_LEVEL && CG == 1), "the split grid: two-level P, the plain dispatch order");
  using S = NvWs<D, NC>;
  static_assert(D == 128 && NC == 3, "three consumer warpgroups at D = 128 (D = 64: nvfp4_attn_fwd_sm90)");
  constexpr int BQ = S::BQ, NST = S::NST;
  const Window win{left, right};
  grid_dep_wait();  // (launched as a programmatic dependent of the pre-pass: nothing global is touched before this)
  extern __shared__ __align__(128) char smem_raw[];
  char* smem = smem_raw + ((1024u - (smem_u32(smem_raw) & 1023u)) & 1023u);
  char* sQ = smem;                       // D / 64 pieces x BQ rows x 128 B
  char* sK = sQ + S::Q_BYTES;            // NST stages x D / 64 pieces x 64 rows x 128 B
  char* sV = sK + NST * S::K_BYTES;      // NST stages x D rows x 128 B
  char* stg0 = sV + NST * S::V_BYTES;    // two staging buffers (Q's bytes take the first)
  unsigned long long* bars = reinterpret_cast<unsigned long long*>(stg0 + 2 * S::STG);
  unsigned long long* full = bars;              // stage s holds its tile (the producer's bulk copies landed)
  unsigned long long* empty = bars + NST;       // every consumer thread's products on stage s retired
  unsigned long long* q_full = bars + 2 * NST;  // Q dequantized
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, t4 = lane % 4;
  WsSplit sp = {0, 1, -1};  // (SPLIT: this CTA's part of its item's keys)
  QueryBlock qb;
  if constexpr (SPLIT)
    qb = ws_split_item(BQ, Hq, Hkv, whole, nsplit, nblk, sp);
  else
    qb = query_block<CG>(BQ, win.causal_shape(), Hq, Hkv);
  const int q0 = qb.q0, h = qb.h, b = qb.b;
  const long long bh = qb.bh, bhk = qb.bhk;
  const int shift = nk - nq;
  const KeyRange kr = key_range<BKV>(q0, BQ, nq, nk, win);
  // Tile t (0 .. ntl - 1) of the loops below is key tile t0 + t: the rows' range, or a SPLIT part's share of it; the
  // ring's stages and phases go by t (tiles t >= fm or < mb need the mask).
  int t0 = kr.first, ntl = kr.n - kr.first;
  if constexpr (SPLIT) {
    if (sp.nparts > 1) {
      const int a = sp.part * ntl / sp.nparts, e = (sp.part + 1) * ntl / sp.nparts;
      t0 += a;
      ntl = e - a;
    }
  }
  const int fm = kr.first_masked - t0, mb = kr.masked_below - t0;
  if (tid < NST) {
    mbar_init(full + tid, 1);  // (thread 0's arrival and the bulk copies' bytes)
    mbar_init(empty + tid, S::CTHREADS);
    fence_mbar_init();
  }
  if (tid == NST) mbar_init(q_full, S::PTHREADS);
  __syncthreads();

  if (warp < 4) {  // ---- producer ----
    setmaxnreg_dec_producer();
    const int ptid = tid;
    // Thread 0 copies tile t's K^ and V^^T with two bulk copies completing on full[t % NST]; the first NST tiles
    // before Q's work. (Image t0 + t: SPLIT parts start at their first tile.)
    const char* gi = reinterpret_cast<const char*>(kvimg) +
                     (bhk * ((nk + BKV - 1) / BKV) + t0) * static_cast<long long>(WS_IMG_STAGE<D>);
    auto copy_tile = [&](int t) {
      const int st = t % NST;
      const char* src = gi + t * static_cast<long long>(WS_IMG_STAGE<D>);
      mbar_arrive_expect_tx(full + st, S::K_BYTES + S::V_BYTES);
      bulk_copy_g2s(sK + st * S::K_BYTES, src, S::K_BYTES, full + st);
      bulk_copy_g2s(sV + st * S::V_BYTES, src + S::K_BYTES, S::V_BYTES, full + st);
    };
    if (ptid == 0)
      for (int t = 0; t < NST && t < ntl; ++t) copy_tile(t);
    // Q (rows >= nq zero): staging buffer 0, every producer thread
    ws_stage_q_all<D, NC>(stg0, q0, bh, qc, qs, nq, ptid);
    cp_async_commit();
    cp_async_wait<0>();
    asm volatile("" ::: "memory");
    ws_dequant_q<D, NC>(sQ, stg0, ptid);
    fence_proxy_async();
    mbar_arrive(q_full);
    if (ptid == 0) {
      for (int t = NST; t < ntl; ++t) {
        const int st = t % NST;
        if constexpr (SAGE_FP4_WS_WAIT_NS > 0)
          mbar_wait_hint<SAGE_FP4_WS_WAIT_NS>(empty + st, ((t / NST) - 1) & 1);
        else
          mbar_wait(empty + st, ((t / NST) - 1) & 1);
        copy_tile(t);
      }
    }
    return;
  }

  // ---- consumers: warpgroups 1 .. NC ----
  setmaxnreg_inc_consumer<NC>();
  const int cw = warp - 4;                   // 0 .. 4 NC - 1
  const int r_lo = q0 + cw * 16 + g;         // this thread's rows: r_lo, r_lo + 8
  const char* sQw = sQ + (cw / 4) * 64 * 128;
  Fp4Rows rs = {{-INFINITY, -INFINITY}, {0.f, 0.f}};
  Fp4Frame fr = {{-INFINITY, -INFINITY}};
  float acc_o[D / 8][4];
#pragma unroll
  for (int i = 0; i < D / 8; ++i) acc_o[i][0] = acc_o[i][1] = acc_o[i][2] = acc_o[i][3] = 0.f;
  float s0[8][4];
  unsigned pa0[4][4];
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j) pa0[i][j] = 0u;
  const unsigned long long dv0 = gmma_desc<128>(sV);
  float(&o_flat)[D / 2] = reinterpret_cast<float(&)[D / 2]>(acc_o);

  mbar_wait(q_full, 0);
  if (ntl > 0) {
    mbar_wait(full, 0);
    wgmma_fence();
    wgmma_qk16<D, BQ>(reinterpret_cast<float(&)[32]>(s0), sQw, sK, 0);
    wgmma_wait<0>();
    fence_regs(reinterpret_cast<float(&)[32]>(s0));
  }
  for (int t = 0; t < ntl; ++t) {
    unsigned pp_unused[1][4];
    const Fp4TileScale ts = fp4_softmax_tile<TWO_LEVEL, false, true, true>(
        s0, rs, pa0, pp_unused, t0 + t, t >= fm || t < mb, win, r_lo, t4, nk, shift, scale_log2);
    fp4_frame_step<TWO_LEVEL>(acc_o, fr, ts);
    wgmma_fence();
    const unsigned long long dv = gmma_desc_advance(dv0, (t % NST) * S::V_BYTES);
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) wgmma_rs<__half, false>(o_flat, pa0[kk], gmma_desc_advance(dv, 32 * kk), 1);
    wgmma_commit();
    const int stn = (t + 1) % NST;
    if (t + 1 < ntl) mbar_wait(full + stn, ((t + 1) / NST) & 1);
    wgmma_fence();
    // (after the last tile: a stale stage, dropped; every issue unconditional, as in nvfp4_attn_fwd_sm90)
    wgmma_qk16<D, BQ>(reinterpret_cast<float(&)[32]>(s0), sQw, sK, stn * S::K_BYTES);
    wgmma_wait<1>();  // P.V(t) done
    fence_regs(o_flat);
    hold_regs(pa0);
    mbar_arrive(empty + t % NST);  // (tile t's K and V: Q.K^T(t) retired a tile ago)
    wgmma_wait<0>();  // Q.K^T(t+1) done
    fence_regs(reinterpret_cast<float(&)[32]>(s0));
  }
  wgmma_wait<0>();
  fence_regs(o_flat);
  hold_regs(pa0);
  fp4_frame_finish<TWO_LEVEL>(acc_o, fr, rs);
  if constexpr (SPLIT) {
    if (sp.nparts > 1) {
      ws_split_epilogue<T, D, NC>(acc_o, rs, o + b * osb + h * osh, osn, lse + bh * nq, qmk ? qmk + bh * nq : nullptr,
                                  r_lo, t4, nq, part_ws, counters, sp, cw, lane);
      return;
    }
  }
  fp4_fwd_epilogue<T, D, false>(acc_o, nullptr, rs, o + b * osb + h * osh, osn, nullptr, lse + bh * nq, nullptr,
                                qmk ? qmk + bh * nq : nullptr, r_lo, t4, nq, 0);
}
