// NVFP4 attention forward on Hopper tensor cores (sm_90a only): the numerics of nvfp4_attn_fwd
// (fp4_attn_fwd.cu, SPEC §5: the same per-tile softmax and P quantization, common/fp4_fwd.cuh), with both
// products on wgmma:
//   S   = Q^ K^T   m64n64k16 f32.f16.f16   (dequantized Q^ and K^ tiles in shared memory)
//   P.V = P^ V^    m64nDk16 f32.f16.f16    (P^ from registers: its fp16 values are exact; V^^T shared)
// one warpgroup (4 warps, 64 query rows) per m64 product; CTAs of WARPS = 4, 8 or 12 warps (12, the default at
// D = 128: with O kept in the frame of its last tile, which leaves room for 168 registers per thread).
//
// Operands stay packed in device memory. Every thread owns "tasks" of 64 elements (4 units of 16: 32 code
// bytes and 4 E4M3 scale bytes, contiguous in memory): a 64-element piece of one K row or one channel of a
// 64-token V^T tile. It copies its tasks' bytes with cp.async into its own 16-byte slots of a staging area,
// waits for its own copies (no barrier: the same thread dequantizes them), and writes the exact fp16 values
// (fp4.cuh dequant16_half) as one 128-byte row of a swizzled K-major tile, the layout wgmma reads through a
// descriptor (K: 64-element pieces of D, each a 64-row tile; V^T: D rows of 64 tokens).
//
// K and V live in 3-stage rings handed over with mbarriers (no CTA-wide barrier per tile): full[s] (every
// thread has dequantized its share of the tile in stage s), k_empty[s] / v_empty[s] (every thread's Q.K^T /
// P.V on it has retired). Per key tile t, in each warpgroup:
//   softmax(t) -> P^ (fp16 A fragments); issue P.V(t);
//   while it runs: wait until tile t-1's stage is free, dequantize tile t+2 into it, arrive on full, stage tile
//   t+3's packed bytes; wait for full(t+1); issue Q.K^T(t+1);
//   wait for P.V(t), arrive on v_empty, fold it into O (O = alpha O + beta P^V^, the mma.sync kernel's order);
//   wait for Q.K^T(t+1), arrive on k_empty.
// With two warpgroups (8 warps) at D = 128 they also take turns issuing their products (ping-pong, named
// barriers), so one's softmax overlaps the other's products. Every wgmma issue and wait is unconditional (after
// the last tile a stale stage is multiplied and dropped), so ptxas sees straight-line pipelines (warning C7514
// otherwise, which CI fails on).
//
// Inputs: qc/qs (BHq, nq, D/2 | D/16), kc/ks (BHkv, nk, D/2 | D/16) of K - mu_K, vc/vs (BHkv, D, *) V^T with
// rows of vcs code bytes / vcs / 8 scale bytes (vcs a multiple of 32: tokens padded to 64 by the host; tokens
// >= n16 are zero-filled here). Outputs as nvfp4_attn_fwd.
#include "common/fp4_fwd.cuh"
#include "common/rows.cuh"
#include "common/tile.cuh"
#include "common/wgmma.cuh"

// CTAs per SM the D = 64 4-warp kernel's registers are budgeted for (__launch_bounds__; SAGE_FP4_MIN_CTAS
// overrides): 3 measured 1.08-1.19x the unbounded build (164-165 registers either way), 4 (128 registers,
// 144 bytes of spills) 1.02-1.10x (bench/fp4_d64_variants.py, tenth session; bitwise the same O).
#ifndef SAGE_FP4_MIN_CTAS
#define SAGE_FP4_MIN_CTAS 3
#endif

using namespace sage;

// Warpgroup ping-pong (two-warpgroup CTAs at D = 128): the warpgroups take turns issuing their products (named
// barriers 1 and 2), so one's softmax overlaps the other's products: 1.03-1.05x on the H200 at D = 128 (two runs of
// bench/fp4_variants.py; the results are bitwise the same). At D = 64 (8 warps) it measured 0.96-0.97x in one
// run, within the ~3% spread that two timings of one and the same kernel showed later: left off there for now.
// SAGE_FP4_PINGPONG=0 turns it off. SAGE_FP4_PINGPONG3=1 turns on the same round robin for three warpgroups (12
// warps): measured 0.95-1.01x of no ping-pong there (bench/NOTES.md, ninth session), so off by default.
#ifndef SAGE_FP4_PINGPONG
#define SAGE_FP4_PINGPONG 1
#endif
#ifndef SAGE_FP4_PINGPONG3
#define SAGE_FP4_PINGPONG3 0
#endif
// O accumulated in place in the frame of its last tile (common/fp4_fwd.cuh fp4_frame_step, the wgmma QAT forward's
// rule) instead of O = alpha O + beta (P^ V^) through a separate P^.V^ accumulator: D / 2 fewer registers per
// thread. Always on for 12-warp CTAs (the default at D = 128: 168 registers per thread, three warpgroups share
// each dequantized K/V tile; 1.01-1.08x the 8-warp kernel on the H200); SAGE_FP4_OFRAME=1 turns it on for 4 and 8
// warps too, where it measured 0.92-1.05x (mostly slower: the fold through a separate accumulator overlaps the
// next Q.K^T, the frame rule's rescale does not).
#ifndef SAGE_FP4_OFRAME
#define SAGE_FP4_OFRAME 0
#endif
// Diagnostics only (wrong results; bench/fp4_floor.py times them): what the kernel costs without one of its parts.
// 1: no tensor-core products (S stays whatever the previous tile left; the ALU, memory and synchronization work
// alone), 2: no softmax or P quantization (P^ is the raw logits in fp16, O is never rescaled), 3: no K/V
// dequantization in the loop (the staged bytes are fetched, the stages hold stale values).
// The warp-specialized kernel (nvfp4_attn_fwd_ws): SAGE_FP4_TBLK (default on with SAGE_FP4_LOGFOLD, which it needs)
// stores each K/V tile in the order of common/fp4_fwd.cuh FP4_TBLK_KEY, so that each consumer thread's 16 logits of a
// row are one whole 16-key block of P (no shuffles for the block maxima, one block scale per row): 1.04-1.06x on the
// H200. SAGE_FP4_WS_WAIT_NS: the producer's suspend hint (ns) while it waits for a free stage (0: the hardware's
// default limit, which polls ~50 instructions per consumer warp and tile): 2000 measured 1.01-1.02x, bitwise the same
// (bench/NOTES.md twenty-seventh session).
#ifndef SAGE_FP4_TBLK
#define SAGE_FP4_TBLK SAGE_FP4_LOGFOLD
#endif
// SAGE_FP4_WS_IDLE_SKIP=1: consumer warpgroups whose 64 rows are all >= nq skip their work (0, the default until it
// is measured and tested on the GPU: they compute on padding rows, as before).
#ifndef SAGE_FP4_WS_IDLE_SKIP
#define SAGE_FP4_WS_IDLE_SKIP 0
#endif
#ifndef SAGE_FP4_WS_WAIT_NS
#define SAGE_FP4_WS_WAIT_NS 2000
#endif
// SAGE_FP4_WS_QOVL=1: the producer puts Q's packed bytes in the second staging buffer and issues key tile 0's
// copies before it waits for Q's, so the two loads' latencies overlap in the CTA's prologue (0: Q, then tile 0).
// SAGE_FP4_WS_UNIFORM_WG (default 0: not yet measured): the consumer warpgroup's index through __shfl_sync (lane 0's),
// which ptxas then knows to be warp-uniform: Q's wgmma descriptors are computed on the uniform datapath instead of in
// regular registers moved over with R2UR before every product (the non-masked tile loop: 597 -> 585 instructions per
// thread in nvcc's static SASS). The same descriptors: bitwise the same O.
#ifndef SAGE_FP4_WS_UNIFORM_WG
#define SAGE_FP4_WS_UNIFORM_WG 0
#endif
#ifndef SAGE_FP4_WS_QOVL
#define SAGE_FP4_WS_QOVL 0
#endif
#ifndef SAGE_FP4_DIAG
#define SAGE_FP4_DIAG 0
#endif

namespace {

constexpr int BKV = 64;

template <int D, int WARPS>
struct Nv90 {
  static constexpr int BQ = 16 * WARPS, THREADS = 32 * WARPS;
  static constexpr int NST = 3;  // K and V ring stages
  static constexpr int Q_BYTES = BQ * 2 * D, K_BYTES = BKV * 2 * D, V_BYTES = D * BKV * 2;
  static constexpr int KTASKS = BKV * D / 64, TASKS = KTASKS + D;  // per key tile: K quarter-rows, V channels
  static constexpr int QTASKS = BQ * D / 64;
  static constexpr int SLOTS = QTASKS > TASKS ? QTASKS : TASKS;  // staging slots (the Q tasks use them first)
  static constexpr int NJ = (TASKS + THREADS - 1) / THREADS;  // tasks per thread (D = 64, 8 warps: half idle)
  static constexpr int STG_CODES = 32 * SLOTS, STG = 36 * SLOTS;
  static constexpr int BARS = 3 * NST * 8;  // mbarriers: full[NST], k_empty[NST], v_empty[NST]
  // Q, the K and V rings, the staging area, the mbarriers; + 1024 for the alignment of the tiles
  // (host: nvfp4.fwd_smem_bytes)
  static constexpr int SMEM = Q_BYTES + NST * (K_BYTES + V_BYTES) + STG + BARS + 1024;
};

// Copy one task: 32 code bytes (two 16-byte halves, stored stg_codes / 2 apart) of which the first `code_bytes` are valid, 4 scale bytes of which `scale_bytes`
// (the rest zero-filled: zero scales dequantize to exact zeros). Invalid tasks read nothing.
__device__ __forceinline__ void stage_task(char* stg, int task, const unsigned char* codes, const unsigned char* scales,
                                           int code_bytes, int scale_bytes, int stg_codes) {
  const unsigned s = smem_u32(stg + task * 16);  // first halves of all tasks, then the second halves
  cp_async_16_n(s, codes, max(0, min(code_bytes, 16)));
  cp_async_16_n(s + stg_codes / 2, codes + 16, max(0, min(code_bytes - 16, 16)));
  cp_async_4_n(smem_u32(stg + stg_codes + task * 4), scales, max(0, min(scale_bytes, 4)));
}

// A staged task's bytes: the four 16-element units' code words and their scale bytes (sc: unit u in byte u).
struct StagedTask {
  uint2 w[4];
  unsigned sc;
};
__device__ __forceinline__ StagedTask load_task(const char* stg, int task, int stg_codes) {
  const uint4 c0 = *reinterpret_cast<const uint4*>(stg + task * 16);  // (16-byte slots: no bank conflicts)
  const uint4 c1 = *reinterpret_cast<const uint4*>(stg + stg_codes / 2 + task * 16);
  const unsigned sc = *reinterpret_cast<const unsigned*>(stg + stg_codes + task * 4);
  return {{make_uint2(c0.x, c0.y), make_uint2(c0.z, c0.w), make_uint2(c1.x, c1.y), make_uint2(c1.z, c1.w)}, sc};
}

// A task's bytes t (as load_task returns them) dequantized into row `r` of a swizzled 128-byte-row tile (64 fp16
// values).
__device__ __forceinline__ void dequant_staged(char* tile, int r, const StagedTask& t) {
  const uint2(&w)[4] = t.w;
  const unsigned sc = t.sc;
#pragma unroll
  for (int u = 0; u < 4; ++u) {
    unsigned h[8];
    dequant16_half(w[u], (sc >> (8 * u)) & 0xFFu, h);
    *reinterpret_cast<uint4*>(tile + swz<128>(r, 2 * u)) = make_uint4(h[0], h[1], h[2], h[3]);
    *reinterpret_cast<uint4*>(tile + swz<128>(r, 2 * u + 1)) = make_uint4(h[4], h[5], h[6], h[7]);
  }
}

// Dequantize staged task `task` into row `r` of a swizzled 128-byte-row tile (64 fp16 values).
__device__ __forceinline__ void dequant_task(char* tile, int r, const char* stg, int task, int stg_codes) {
  dequant_staged(tile, r, load_task(stg, task, stg_codes));
}

// A 64-token row of V^T (t: its bytes) dequantized into row `r` of a swizzled 128-byte-row tile with its tokens in
// TBLK order (common/fp4_fwd.cuh FP4_TBLK_KEY): 16-byte chunk j holds pair j of each of the four 16-token units
// (column 8 j + 2 u + e is token 16 u + 2 j + e), half the pairs at a time.
__device__ __forceinline__ void dequant_staged_tblk(char* tile, int r, const StagedTask& t) {
  __half2 s64[4];
#pragma unroll
  for (int u = 0; u < 4; ++u) s64[u] = e4m3_scale_x64((t.sc >> (8 * u)) & 0xFFu);
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    unsigned h[4][4];
#pragma unroll
    for (int u = 0; u < 4; ++u) dequant8_half(hh ? t.w[u].y : t.w[u].x, s64[u], h[u]);
#pragma unroll
    for (int jj = 0; jj < 4; ++jj)
      *reinterpret_cast<uint4*>(tile + swz<128>(r, 4 * hh + jj)) = make_uint4(h[0][jj], h[1][jj], h[2][jj], h[3][jj]);
  }
}

// Dequantize staged task `task`, a 64-token row of V^T, as dequant_staged_tblk.
__device__ __forceinline__ void dequant_task_tblk(char* tile, int r, const char* stg, int task, int stg_codes) {
  dequant_staged_tblk(tile, r, load_task(stg, task, stg_codes));
}

// Stage task i of key tile `tile`: a 64-element piece of a K row (is_k: the first BKV D / 64 tasks; 8 consecutive
// tasks are 8 rows of a piece, conflict-free 16-byte stores) or one channel of the V^T tile (tokens >= n16 zero).
// (The warp-specialized kernel's; stage_tile below keeps its own copy of these lines: written through these
// helpers, the 4- and 8-warp instances, whose K/V split is not known at compile time, compiled to other code.)
// TBLK: K row i % BKV of the stage holds key FP4_TBLK_KEY(i % BKV) of the tile.
template <int D, bool TBLK>
__device__ __forceinline__ void stage_kv_task(char* stg, int i, bool is_k, const unsigned char* gkc,
                                              const unsigned char* gks, const unsigned char* gvc,
                                              const unsigned char* gvs, int vcs, int tile, int nk, int n16,
                                              int stg_codes) {
  constexpr int KTASKS = BKV * D / 64;
  if (is_k) {
    const int row = i % BKV, piece = i / BKV, key = tile * BKV + (TBLK ? FP4_TBLK_KEY(row) : row);
    const bool ok = key < nk;
    const long long off = ok ? static_cast<long long>(key) * (D / 2) + piece * 32 : 0;
    stage_task(stg, i, gkc + off, gks + (ok ? static_cast<long long>(key) * (D / 16) + piece * 4 : 0), ok ? 32 : 0,
               ok ? 4 : 0, stg_codes);
  } else {
    const int ch = i - KTASKS, toks = n16 - tile * BKV;  // tokens of this tile that exist (may be <= 0)
    stage_task(stg, i, gvc + static_cast<long long>(ch) * vcs + tile * 32,
               gvs + static_cast<long long>(ch) * (vcs / 8) + tile * 4, toks / 2, toks / 16, stg_codes);
  }
}

// Dequantize staged task i (as stage_kv_task) into stage (sKst, sVst).
template <int D, bool TBLK>
__device__ __forceinline__ void dequant_kv_task(char* sKst, char* sVst, const char* stg, int i, bool is_k,
                                                int stg_codes) {
  if (is_k)
    dequant_task(sKst + (i / BKV) * BKV * 128, i % BKV, stg, i, stg_codes);
  else if (TBLK)
    dequant_task_tblk(sVst, i - BKV * D / 64, stg, i, stg_codes);
  else
    dequant_task(sVst, i - BKV * D / 64, stg, i, stg_codes);
}

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

// Named barrier `id` (1..3) of two warpgroups (256 threads): wait on it (SYNC) or arrive. The ids are constants in
// the instructions (a register id would make ptxas reserve all 16 barriers).
template <bool SYNC>
__device__ __forceinline__ void pair_barrier(int id) {
  if (SYNC) {
    if (id == 1) asm volatile("bar.sync 1, 256;\n" ::: "memory");
    else if (id == 2) asm volatile("bar.sync 2, 256;\n" ::: "memory");
    else asm volatile("bar.sync 3, 256;\n" ::: "memory");
  } else {
    if (id == 1) asm volatile("bar.arrive 1, 256;\n" ::: "memory");
    else if (id == 2) asm volatile("bar.arrive 2, 256;\n" ::: "memory");
    else asm volatile("bar.arrive 3, 256;\n" ::: "memory");
  }
}

}  // namespace

// Grid (ceil(nq / (16 WARPS)), Hq, B), block 32 WARPS, dynamic shared memory Nv90<D, WARPS>::SMEM.
// CG: causal grids dispatched heaviest block first across groups of CG (batch, head) pairs (common/rows.cuh
// query_block); the host instantiates CG = FP4_CAUSAL_GROUP for causal calls and CG = 1 (the plain order) otherwise.
template <typename T, int D, int WARPS, bool TWO_LEVEL, int CG = 1>
__global__ void __launch_bounds__(32 * WARPS, (D == 64 && WARPS == 4) ? SAGE_FP4_MIN_CTAS : 1)
nvfp4_attn_fwd_sm90(const unsigned char* __restrict__ qc, const unsigned char* __restrict__ qs,
                    const unsigned char* __restrict__ kc, const unsigned char* __restrict__ ks,
                    const unsigned char* __restrict__ vc, const unsigned char* __restrict__ vs, int vcs,
                    const float* __restrict__ qmk, T* __restrict__ o, long long osb, long long osh, long long osn,
                    float* __restrict__ lse, int Hq, int Hkv, int nq, int nk, int n16, float scale_log2, int causal) {
  using S = Nv90<D, WARPS>;
  static_assert(D == 64 || D == 128, "head dim 64 or 128 (wgmma N = D)");
  static_assert(WARPS == 4 || WARPS == 8 || WARPS == 12, "one, two or three warpgroups");
  constexpr int BQ = S::BQ;
  const bool CAUSAL = causal != 0;
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
  const QueryBlock qb = query_block<CG>(BQ, CAUSAL, Hq, Hkv);
  const int q0 = qb.q0, h = qb.h, b = qb.b;
  const long long bh = qb.bh, bhk = qb.bhk;
  const int shift = nk - nq;
  const KeyTiles tl = key_tiles<BKV>(q0, BQ, nq, nk, CAUSAL);

  const unsigned char* gkc = kc + bhk * nk * (D / 2);
  const unsigned char* gks = ks + bhk * nk * (D / 16);
  const unsigned char* gvc = vc + bhk * D * vcs;
  const unsigned char* gvs = vs + bhk * D * (vcs / 8);
  if (tid < 3 * S::NST) mbar_init(bars + tid, S::THREADS);

  // Prologue: Q (rows >= nq zero) dequantized by its owners; tiles 0 and 1 dequantized (full[0], full[1]);
  // tile 2 staged.
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
    if (t < tl.n) {
      stage_tile<D, WARPS>(stg, gkc, gks, gvc, gvs, vcs, t, nk, n16, tid);
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
  constexpr bool OFRAME = SAGE_FP4_OFRAME || WARPS == 12;
  float acc_pv[OFRAME ? 32 : D / 2];  // P^.V^ of this tile (unused with OFRAME)
  Fp4Frame fr = {{-INFINITY, -INFINITY}};  // OFRAME: the frame of O
  float(&accs)[32] = reinterpret_cast<float(&)[32]>(acc_s);
  const char* sQw = sQ + (warp / 4) * 64 * 128;  // this warpgroup's 64 rows, in every piece
  static_assert(BKV == 64, "64-key tiles");
  auto issue_qk = [&](int kst) {
    if constexpr (SAGE_FP4_DIAG != 1) wgmma_qk16<D, BQ>(accs, sQw, sK, kst * S::K_BYTES);
  };
  if constexpr (SAGE_FP4_DIAG == 1)
#pragma unroll
    for (int i = 0; i < 32; ++i) accs[i] = 0.f;
  const unsigned long long dv0 = gmma_desc<128>(sV);

  // Ping-pong (see SAGE_FP4_PINGPONG): the warpgroups issue in turn 0, 1, .., NWG - 1, 0, ..; warpgroup wg waits
  // on named barrier 1 + wg, which its predecessor arrives on after issuing (the last one lets 0 go first).
  constexpr int NWG = WARPS / 4;
  constexpr bool PING = D == 128 && ((NWG == 2 && SAGE_FP4_PINGPONG) || (NWG == 3 && SAGE_FP4_PINGPONG3));
  const int wg = warp / 4;
  const int my_turn = 1 + wg, next_turn = 1 + (wg + 1 == NWG ? 0 : wg + 1);
  if (PING && wg == NWG - 1 && tl.n > 0) asm volatile("bar.arrive 1, 256;\n" ::: "memory");
  if (tl.n > 0) {
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
  for (int tile = 0; tile < tl.n; ++tile) {
    unsigned pa[4][4], pp_unused[1][4];
#if SAGE_FP4_DIAG == 2
    Fp4TileScale ts = {{1.f, 1.f}, {1.f, 1.f}, {0.f, 0.f}, false};
#pragma unroll
    for (int kk = 0; kk < 4; ++kk)
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        pa[kk][r] = half2_bits(acc_s[2 * kk][2 * r], acc_s[2 * kk][2 * r + 1]);
        pa[kk][2 + r] = half2_bits(acc_s[2 * kk + 1][2 * r], acc_s[2 * kk + 1][2 * r + 1]);
      }
    (void)pp_unused;
    rs.l[0] += 1.f;  // keeps O live (a zero row sum stores zeros)
    rs.l[1] += 1.f;
#else
    const Fp4TileScale ts = fp4_softmax_tile<TWO_LEVEL, false, OFRAME>(
        acc_s, rs, pa, pp_unused, tile, tile >= tl.first_masked, CAUSAL, r_lo, t4, nk, shift, scale_log2);
    if constexpr (OFRAME) fp4_frame_step<TWO_LEVEL>(acc_o, fr, ts);
#endif
    if (PING) pair_barrier<true>(my_turn);  // this warpgroup's turn to issue
    wgmma_fence();
    {  // P.V(t)
      const unsigned long long dv = gmma_desc_advance(dv0, st0 * S::V_BYTES);
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) {
        if constexpr (SAGE_FP4_DIAG == 1) continue;
        if constexpr (OFRAME)
          wgmma_rs<__half, false>(reinterpret_cast<float(&)[D / 2]>(acc_o), pa[kk], gmma_desc_advance(dv, 32 * kk), 1);
        else
          wgmma_rs<__half, false>(acc_pv, pa[kk], gmma_desc_advance(dv, 32 * kk), kk);
      }
      wgmma_commit();
    }
    // While P.V(t) runs: tile t+2 from this thread's staging slots into stage (t+2) % NST, once every thread is
    // done with the tile it held (t-1); then stage tile t+3's packed bytes.
    const int nxt = tile + 2;
    if (nxt < tl.n) {
      const int st = st2;
      if (nxt >= S::NST) {
        mbar_wait(k_empty + st, ph2 ^ 1);
        mbar_wait(v_empty + st, ph2 ^ 1);
      }
      cp_async_wait<0>();
      asm volatile("" ::: "memory");
      if constexpr (SAGE_FP4_DIAG != 3) dequant_tile<D, WARPS>(sK + st * S::K_BYTES, sV + st * S::V_BYTES, stg, tid);
      fence_proxy_async();
      mbar_arrive(full + st);
      if (nxt + 1 < tl.n) stage_tile<D, WARPS>(stg, gkc, gks, gvc, gvs, vcs, nxt + 1, nk, n16, tid);
      cp_async_commit();
    }
    // Q.K^T(t+1) once every thread has dequantized tile t+1 (after the last tile: a stale stage, dropped).
    const bool more = tile + 1 < tl.n;
    if (more) mbar_wait(full + st1, ph1);
    wgmma_fence();
    issue_qk(st1);
    // the next warpgroup's turn (after its last tile, warpgroup NWG - 1 hands none to warpgroup 0, which is done)
    if (PING && (tile + 1 < tl.n || wg != NWG - 1)) pair_barrier<false>(next_turn);
    wgmma_wait<1>();  // P.V(t) done (Q.K^T(t+1) may still run)
    if constexpr (OFRAME)
      fence_regs(reinterpret_cast<float(&)[D / 2]>(acc_o));
    else
      fence_regs(acc_pv);
    hold_regs(pa);  // P.V(t)'s A operand stays untouched until here
    mbar_arrive(v_empty + st0);
    if constexpr (!OFRAME) fp4_pv_update<D / 8>(acc_o, reinterpret_cast<const float(&)[D / 8][4]>(acc_pv), ts);
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
  if constexpr (OFRAME) fp4_frame_finish<TWO_LEVEL>(acc_o, fr, rs);
  fp4_fwd_epilogue<T, D, false>(acc_o, nullptr, rs, o + b * osb + h * osh, osn, nullptr, lse + bh * nq, nullptr,
                         qmk ? qmk + bh * nq : nullptr, r_lo, t4, nq, 0);
}

// ---- Warp-specialized kernel (nvfp4_attn_fwd_ws; the default at D = 128 with NC = 3): one warpgroup
// dequantizes, NC = 2 or 3 multiply ----
//
// The kernel above has every thread dequantize a share of each K/V tile, so its three warpgroups meet on every
// tile's mbarriers and run in step: their softmax phases coincide, and the tensor cores and the ALUs take turns
// instead of overlapping (bench/fp4_floor.py, twenty-sixth session: the kernel without its products and the kernel
// without its softmax add up to the whole). Here warpgroup 0 (the producer) alone stages the packed bytes (cp.async,
// double-buffered staging) and dequantizes K/V tiles into a 4-stage ring (full / empty mbarriers); the NC consumer
// warpgroups (64 query rows each) only multiply and quantize P, and drift apart freely within the ring. The
// producer gives up registers (setmaxnreg: 56), the consumers take them.
//   NC = 3 (192 rows, 16 warps: four per scheduler; consumers at 152 registers, one S tile): the 12-warp kernel's
//   order without the dequantization: softmax(t), P.V(t), Q.K^T(t+1), wait for both. 1.04-1.08x the 12-warp
//   kernel on the H200.
//   NC = 2 (128 rows, consumers at 224 registers, two S tiles and two P^ operands): each consumer overlaps its own
//   products with its softmax: issue Q.K^T(t+1) into the second S buffer; softmax(t) -> P^(t) (while Q.K^T(t+1)
//   and P.V(t-1) run); wait for both, release tile t-1's stage; rescale O to tile t's frame; issue P.V(t). (With
//   wgmma.wait_group 1 there ptxas serialized the products, warning C7514.) 0.99-1.04x the 12-warp kernel: two
//   consumer warps per scheduler hide less latency, and 128-row CTAs dequantize 1.5x as much per query row.
// Numerics: those of the kernel above at 12 warps (the same per-tile softmax and P quantization, O in the frame of
// its last tile, the same wgmma shapes in the same order): with SAGE_FP4_TBLK=0 bitwise the same O and LSE (tested);
// with thread-owned blocks (the default) every element of P^ is the same number, and the products and row sums add
// the keys of a tile in another order (the tensor cores' k16 steps then mix 16-key blocks of different scales: O
// within relative L2 1.6e-4 of the 12-warp kernel at 4K, tested against it within 5e-4).
namespace {

template <int D, int NC>
struct NvWs {
  static constexpr int BQ = 64 * NC, THREADS = 128 * (NC + 1), PTHREADS = 128, CTHREADS = 128 * NC;
  static constexpr int NST = 4;  // K/V ring stages
  static constexpr int Q_BYTES = BQ * 2 * D, K_BYTES = BKV * 2 * D, V_BYTES = D * BKV * 2;
  static constexpr int KTASKS = BKV * D / 64, TASKS = KTASKS + D;  // per key tile: K quarter-rows, V channels
  static constexpr int QTASKS = BQ * D / 64;
  static constexpr int NJ = TASKS / PTHREADS;  // tasks per producer thread and tile (2 at D = 128, 1 at 64)
  static constexpr int SLOTS = QTASKS > TASKS ? QTASKS : TASKS;  // per staging buffer
  static constexpr int STG_CODES = 32 * SLOTS, STG = 36 * SLOTS;
  static constexpr int BARS = (2 * NST + 1) * 8;  // full[NST], empty[NST], q_full
  static constexpr int SMEM = Q_BYTES + NST * (K_BYTES + V_BYTES) + 2 * STG + BARS + 1024;
  static_assert(TASKS % PTHREADS == 0 && QTASKS % PTHREADS == 0, "whole tasks per producer thread");
};

// Registers per thread after setmaxnreg: the producer's, and the consumers' share of what the producer gives back
// from the launch's allocation (65536 / threads, in multiples of 8): NC = 2: 128 x 56 + 256 x 224 = 384 x 168;
// NC = 3: 128 x 56 + 384 x 152 = 512 x 128.
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
  static_assert(ws_consumer_regs<NC>() == (NC == 2 ? 224 : 152), "the budgets the kernel was measured with");
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(ws_consumer_regs<NC>()));
}

// Producer: the packed bytes of key tile `tile` -> staging buffer `stg` (this thread's tasks ptid + j * 128).
template <int D, int NC>
__device__ __forceinline__ void ws_stage_tile(char* stg, const unsigned char* gkc, const unsigned char* gks,
                                              const unsigned char* gvc, const unsigned char* gvs, int vcs, int tile,
                                              int nk, int n16, int ptid) {
  using S = NvWs<D, NC>;
#pragma unroll
  for (int j = 0; j < S::NJ; ++j) {
    const int i = ptid + j * S::PTHREADS;
    // (K tasks first: known per j at compile time)
    stage_kv_task<D, SAGE_FP4_TBLK>(stg, i, (j + 1) * S::PTHREADS <= S::KTASKS, gkc, gks, gvc, gvs, vcs, tile, nk, n16,
                                    S::STG_CODES);
  }
}

template <int D, int NC>
__device__ __forceinline__ void ws_dequant_tile(char* sKst, char* sVst, const char* stg, int ptid) {
  using S = NvWs<D, NC>;
#pragma unroll
  for (int j = 0; j < S::NJ; ++j) {
    const int i = ptid + j * S::PTHREADS;
    dequant_kv_task<D, SAGE_FP4_TBLK>(sKst, sVst, stg, i, (j + 1) * S::PTHREADS <= S::KTASKS, S::STG_CODES);
  }
}

// ---- K/V stage images (opt-in: SAGECUPY_FP4_KVIMG=1) ----
//
// The warp-specialized kernel's producer dequantizes every key tile of a head once per query block: 22 times per
// head at 4096 rows, ~18% of the kernel's instructions (ncu, twenty-seventh session), issue slots its consumers
// share. nvfp4_kv_images does it once per tile: it runs the producer's own staging and dequantization
// (ws_stage_tile, ws_dequant_tile: the same functions, so the same bytes) into shared memory and stores the result,
// K^ (D / 64 swizzled 64 x 128-byte pieces, TBLK row order) then V^^T (D swizzled 128-byte rows), as one
// WS_IMG_STAGE-byte image per (b, hk, 64-key tile); the kernel's producer then only copies each tile's image into
// its ring stage with two bulk copies (thread 0). The same shared-memory bytes reach the products, so O and LSE are
// bitwise those of the dequantizing producer. Costs: the images (fp16: 4x the packed bytes, scratch per call) and
// their pass (it reads the packed K and V and writes the images).
template <int D>
constexpr int WS_IMG_STAGE = BKV * 2 * D + D * BKV * 2;

// Grid (ceil(nk / 64), Hkv, B), block 128 (the producer's thread count: its task split). Arguments as the
// warp-specialized kernel's K/V ones (V^T rows padded to whole 64-token tiles, vcs code bytes each); img: (B, Hkv,
// ceil(nk / 64)) images of WS_IMG_STAGE<D> bytes.
template <int D>
__global__ void __launch_bounds__(128) nvfp4_kv_images(const unsigned char* __restrict__ kc,
                                                       const unsigned char* __restrict__ ks,
                                                       const unsigned char* __restrict__ vc,
                                                       const unsigned char* __restrict__ vs, int vcs, int nk, int n16,
                                                       unsigned char* __restrict__ img) {
  using S = NvWs<D, 3>;
  static_assert(S::PTHREADS == 128 && S::KTASKS % S::PTHREADS == 0, "the producer's task split (D = 128)");
  __shared__ __align__(16) char sm[WS_IMG_STAGE<D> + S::STG];
  grid_dep_wait();  // (the pre-pass's K and V: nothing global is touched before this)
  grid_dep_launch_dependents();
  const int tile = blockIdx.x, ptid = threadIdx.x;
  const long long bhk = static_cast<long long>(blockIdx.z) * gridDim.y + blockIdx.y;
  char* stg = sm + WS_IMG_STAGE<D>;
  ws_stage_tile<D, 3>(stg, kc + bhk * nk * (D / 2), ks + bhk * nk * (D / 16), vc + bhk * D * vcs,
                      vs + bhk * D * (vcs / 8), vcs, tile, nk, n16, ptid);
  cp_async_commit();
  cp_async_wait<0>();  // (this thread's own slots: it dequantizes them, as the producer does)
  asm volatile("" ::: "memory");
  ws_dequant_tile<D, 3>(sm, sm + S::K_BYTES, stg, ptid);
  __syncthreads();
  uint4* dst = reinterpret_cast<uint4*>(img + (bhk * gridDim.x + tile) * static_cast<long long>(WS_IMG_STAGE<D>));
#pragma unroll 4
  for (int i = ptid; i < WS_IMG_STAGE<D> / 16; i += 128) dst[i] = reinterpret_cast<const uint4*>(sm)[i];
}

// Shared-memory layout of nvfp4_kv_images_raw*: the image (K^ then V^^T), then NVT 64-token V tiles (rows of D + 8
// 16-bit values: conflict-free column reads), then K's mean (D floats).
template <int D>
using KvTile = unsigned short[64][D + 8];
template <int D, int NVT>
__host__ __device__ constexpr int kv_raw_smem() { return WS_IMG_STAGE<D> + NVT * 64 * (D + 8) * 2 + D * 4; }

// The images straight from the raw K and V (nvfp4.attention with SAGECUPY_FP4_KVIMG=1): K's and V's pre-pass
// quantizers, their packed bytes and nvfp4_kv_images in one pass. Each 16-block is quantized by the function the
// pre-pass applies to it (K: its mean subtracted in fp32, then nvfp4_block_cmp, as nvfp4_quant_rows with mu;
// without a mean nvfp4_block_exact16; V: nvfp4_block_exact16 on the 64-token tile as nvfp4_quant_tokens_tiled reads
// it, tokens >= nk zero), and the codes and scale bytes, in a thread's registers exactly as the producer would stage
// them (K keys >= nk and V blocks past n16: zero bytes, as its zero-filled copies), are dequantized by the producer's
// functions: the images of nvfp4_kv_images on the pre-pass's outputs, bit for bit. Thread i: K's task i (row
// i % 64 of piece i / 64), then V^T's channel i. k, v: (B, Hkv, nk, D) at element strides (rows 16-byte aligned);
// mu: K's mean (B, Hkv, D) fp32 or null. Grid (ceil(nk / 64), Hkv, B), block 128, dynamic shared memory
// WS_IMG_RAW_SMEM<D>.
template <int D>
constexpr int WS_IMG_RAW_SMEM = kv_raw_smem<D, 1>();

// nvfp4_kv_images_raw*'s pieces. A thread's K task of a tile: row tid % 64 of piece tid / 64, 64 elements as 8 x 16
// bytes (keys >= nk zero), into registers.
template <typename T, int D>
__device__ __forceinline__ void kv_raw_load_k(uint4 (&kw)[4][2], const T* __restrict__ k_bh, long long ksn, int nk,
                                              int tile, int tid) {
  const int row = tid % 64, piece = tid / 64, key = tile * 64 + (SAGE_FP4_TBLK ? FP4_TBLK_KEY(row) : row);
  const uint4* src = reinterpret_cast<const uint4*>(k_bh + (key < nk ? key : 0) * ksn + piece * 64);
#pragma unroll
  for (int i = 0; i < 8; ++i) kw[i / 2][i % 2] = key < nk ? __ldg(src + i) : make_uint4(0u, 0u, 0u, 0u);
}

// One tile's image (every thread of the CTA): with the tile's V in shared memory vt (this thread's share written, not
// yet synchronized) and K's task in registers kw: K's mean of channel tid to shared memory, a barrier, then K's task
// and V^T's channel tid quantized by the pre-pass's functions and dequantized by the producer's into the image in
// shared memory, a barrier, the image stored to img_t (coalesced). The next call's first barrier orders its writes of
// the image after this call's reads of it.
template <typename T, int D>
__device__ __forceinline__ void kv_raw_image(const uint4 (&kw)[4][2], const KvTile<D>& vt, float mu_c, char* sm,
                                             float* smu, bool smooth, int nk, int n16, int tile, int tid,
                                             unsigned char* __restrict__ img_t) {
  using S = NvWs<D, 3>;
  char* sK = sm;               // K^ (D / 64 pieces x 64 rows x 128 B)
  char* sV = sm + S::K_BYTES;  // V^^T (D rows x 128 B)
  smu[tid] = mu_c;  // (D = 128 threads: one channel each)
  __syncthreads();
  {  // K's task tid (values as nvfp4_quant_rows's 16-byte loads give them)
    const int row = tid % 64, piece = tid / 64, key = tile * 64 + (SAGE_FP4_TBLK ? FP4_TBLK_KEY(row) : row);
    StagedTask t = {{make_uint2(0u, 0u), make_uint2(0u, 0u), make_uint2(0u, 0u), make_uint2(0u, 0u)}, 0u};
    if (key < nk) {
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        float x[16];
        unsigned packed[2], sc;
        unpack16<T>(kw[u], x);
        if (smooth) {
#pragma unroll
          for (int i = 0; i < 16; ++i) x[i] -= smu[piece * 64 + 16 * u + i];
          sc = nvfp4_block_cmp(x, packed);
        } else {
          sc = nvfp4_block_exact16(x, packed);
        }
        t.w[u] = make_uint2(packed[0], packed[1]);
        t.sc |= sc << (8 * u);
      }
    }
    dequant_staged(sK + piece * 64 * 128, row, t);
  }
  {  // V^T's channel tid: the tile's 16-token blocks below n16
    const int nb = min(4, (n16 - tile * 64) / 16);
    StagedTask t = {{make_uint2(0u, 0u), make_uint2(0u, 0u), make_uint2(0u, 0u), make_uint2(0u, 0u)}, 0u};
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      if (u < nb) {
        float x[16];
        unsigned packed[2];
#pragma unroll
        for (int i = 0; i < 16; ++i) x[i] = to_float(bits_to<T>(vt[16 * u + i][tid]));
        const unsigned sc = nvfp4_block_exact16(x, packed);
        t.w[u] = make_uint2(packed[0], packed[1]);
        t.sc |= sc << (8 * u);
      }
    }
    if constexpr (SAGE_FP4_TBLK)
      dequant_staged_tblk(sV, tid, t);
    else
      dequant_staged(sV, tid, t);
  }
  __syncthreads();
  uint4* dst = reinterpret_cast<uint4*>(img_t);
#pragma unroll 4
  for (int i = tid; i < WS_IMG_STAGE<D> / 16; i += 128) dst[i] = reinterpret_cast<const uint4*>(sm)[i];
}

template <typename T, int D>
__global__ void __launch_bounds__(128) nvfp4_kv_images_raw(const T* __restrict__ k, long long ksb, long long ksh,
                                                           long long ksn, const float* __restrict__ mu,
                                                           const T* __restrict__ v, long long vsb, long long vsh,
                                                           long long vsn, int nk, int n16,
                                                           unsigned char* __restrict__ img) {
  static_assert(D == 128, "one K task and one V^T channel per thread (the producer's split at D = 128)");
  extern __shared__ __align__(16) char sm[];
  KvTile<D>& vt = *reinterpret_cast<KvTile<D>*>(sm + WS_IMG_STAGE<D>);
  float* smu = reinterpret_cast<float*>(sm + WS_IMG_STAGE<D> + sizeof(KvTile<D>));
  grid_dep_wait();  // (the mean's pass before; nothing global is touched before this)
  grid_dep_launch_dependents();
  const int tile = blockIdx.x, tid = threadIdx.x, h = blockIdx.y, b = blockIdx.z;
  const long long bhk = static_cast<long long>(b) * gridDim.y + h;
  // Every load first: K's task, V's tile (8 x 16 bytes per thread; tokens >= nk zero), the mean.
  uint4 kw[4][2];
  kv_raw_load_k<T, D>(kw, k + b * ksb + h * ksh, ksn, nk, tile, tid);
  const T* vsrc = v + b * vsb + h * vsh;
  uint4 vw[64 * (D / 8) / 128];
#pragma unroll
  for (int j = 0; j < 64 * (D / 8) / 128; ++j) {
    const int idx = tid + 128 * j, r = idx / (D / 8), seg = idx % (D / 8), tok = tile * 64 + r;
    vw[j] = tok < nk ? __ldg(reinterpret_cast<const uint4*>(vsrc + tok * vsn + seg * 8)) : make_uint4(0u, 0u, 0u, 0u);
  }
  const float mu_c = mu ? __ldg(mu + bhk * D + tid) : 0.f;
#pragma unroll
  for (int j = 0; j < 64 * (D / 8) / 128; ++j) {
    const int idx = tid + 128 * j;
    *reinterpret_cast<uint4*>(&vt[idx / (D / 8)][(idx % (D / 8)) * 8]) = vw[j];
  }
  kv_raw_image<T, D>(kw, vt, mu_c, sm, smu, mu != nullptr, nk, n16, tile, tid,
                     img + (bhk * gridDim.x + tile) * static_cast<long long>(WS_IMG_STAGE<D>));
}

// nvfp4_kv_images_raw with as many CTAs as are resident at once (SAGECUPY_FP4_KVIMG=pipe; 3 per SM), each walking
// the images w = blockIdx.x, blockIdx.x + gridDim.x, ... of all heads (w = (b Hkv + h) ntile + tile: the image's own
// index) and loading the next one's operands while it quantizes the current one: V's tile by cp.async into the
// other of two shared tiles, K's task into registers (with one tile per CTA a thread's loads and its arithmetic run
// back to back: the pipelined pre-pass's reason, thirtieth session). The same images, bit for bit. Grid
// (min(B Hkv ntile, 3 SMs)), block 128, dynamic shared memory WS_IMG_RAW_PIPE_SMEM<D>.
template <int D>
constexpr int WS_IMG_RAW_PIPE_SMEM = kv_raw_smem<D, 2>();

template <typename T, int D>
__global__ void __launch_bounds__(128, 3) nvfp4_kv_images_raw_pipe(
    const T* __restrict__ k, long long ksb, long long ksh, long long ksn, const float* __restrict__ mu,
    const T* __restrict__ v, long long vsb, long long vsh, long long vsn, int nk, int n16, int Hkv, int ntile,
    int pieces, unsigned char* __restrict__ img) {
  static_assert(D == 128, "one K task and one V^T channel per thread (the producer's split at D = 128)");
  extern __shared__ __align__(16) char sm[];
  KvTile<D>* vt = reinterpret_cast<KvTile<D>*>(sm + WS_IMG_STAGE<D>);  // two V tiles
  float* smu = reinterpret_cast<float*>(sm + WS_IMG_STAGE<D> + 2 * sizeof(KvTile<D>));
  grid_dep_wait();
  grid_dep_launch_dependents();
  const int tid = threadIdx.x;
  uint4 kw[4][2];
  float mu_c = 0.f;
  // Piece w's loads: V's tile by cp.async into vt[buf] (one group; tokens >= nk zero-filled, nothing read), K's task
  // and the mean into registers.
  auto load = [&](int w, int buf) {
    const int bhk = w / ntile, tile = w - bhk * ntile, b = bhk / Hkv, h = bhk - b * Hkv;
    const T* vsrc = v + b * vsb + h * vsh;
#pragma unroll
    for (int j = 0; j < 64 * (D / 8) / 128; ++j) {
      const int idx = tid + 128 * j, r = idx / (D / 8), seg = idx % (D / 8), tok = tile * 64 + r;
      cp_async_16_n(smem_u32(&vt[buf][r][seg * 8]), vsrc + (tok < nk ? tok : 0) * vsn + seg * 8, tok < nk ? 16 : 0);
    }
    cp_async_commit();
    kv_raw_load_k<T, D>(kw, k + b * ksb + h * ksh, ksn, nk, tile, tid);
    mu_c = mu ? __ldg(mu + static_cast<long long>(bhk) * D + tid) : 0.f;
  };
  int w = blockIdx.x, buf = 0;
  if (w < pieces) load(w, 0);
  for (; w < pieces; w += gridDim.x, buf ^= 1) {
    uint4 kc[4][2];
#pragma unroll
    for (int i = 0; i < 8; ++i) kc[i / 2][i % 2] = kw[i / 2][i % 2];
    const float mc = mu_c;
    if (w + static_cast<int>(gridDim.x) < pieces)
      load(w + gridDim.x, buf ^ 1);  // (vt[buf ^ 1]: its last reads were before the previous tile's second barrier)
    else
      cp_async_commit();  // (an empty group: the wait below is the same either way)
    cp_async_wait<1>();   // this thread's copies of tile w's V (kv_raw_image's first barrier: everyone's)
    kv_raw_image<T, D>(kc, vt[buf], mc, sm, smu, mu != nullptr, nk, n16, w % ntile, tid,
                       img + static_cast<long long>(w) * WS_IMG_STAGE<D>);
  }
  cp_async_wait<0>();  // (nothing may land in shared memory after the CTA exits)
}

// Named barrier 1 + wg of consumer warpgroup wg's 128 threads (constant ids: a register id would make ptxas reserve
// all 16 barriers).
__device__ __forceinline__ void warpgroup_barrier(int wg) {
  if (wg == 0) asm volatile("bar.sync 1, 128;\n" ::: "memory");
  else if (wg == 1) asm volatile("bar.sync 2, 128;\n" ::: "memory");
  else asm volatile("bar.sync 3, 128;\n" ::: "memory");
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

// QIN: a consumer warpgroup's 64 query rows (from row0 = q0 + 64 wg) quantized from the raw input q_bh by the
// pre-pass's block quantizer (nvfp4_block_exact16: nvfp4_quant_rows's codes and scales) and dequantized as the
// producer dequantizes staged bytes (dequant16_half), straight into the swizzled tile sQ: bit for bit the Q^ of
// the pre-pass path; rows >= nq zeros. Lane (g, t4) of consumer warp cw takes rows 16 (cw % 4) + g + 8 j (j = 0, 1),
// columns 32 t4 .. 32 t4 + 31: the rows r_lo, r_lo + 8 whose LSE the thread writes, so qmk stays in registers:
// qmk_r[j] = qmk_scale * (q . mu) in nvfp4_quant_rows's fp32 order (the 32 products in order from 0, then the
// shuffles xor 2 and xor 1 over the lane quad). Every row's 16-byte loads are issued before any arithmetic.
template <typename T, int D, int NC>
__device__ __forceinline__ void ws_quant_q(char* sQ, const T* __restrict__ q_bh, long long qsn, int nq, int row0,
                                           int cw, int lane, const float* __restrict__ mu_bh, float qmk_scale,
                                           float (&qmk_r)[2]) {
  using S = NvWs<D, NC>;
  static_assert(D == 128, "a row's four 32-column quarters are one lane quad (D = 128)");
  const int g = lane / 4, t4 = lane % 4;
  uint4 raw[2][2][2];
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    const int qr = row0 + (cw % 4) * 16 + 8 * j + g;
    const uint4* src = reinterpret_cast<const uint4*>(q_bh + (qr < nq ? qr * qsn + t4 * 32 : 0));
#pragma unroll
    for (int k = 0; k < 4; ++k) raw[j][k / 2][k % 2] = qr < nq ? __ldg(src + k) : make_uint4(0u, 0u, 0u, 0u);
  }
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    const int rl = (cw % 4) * 16 + 8 * j + g, qr = row0 + rl;  // (rl: the row within the warpgroup's 64)
    float v[2][16];
    unpack16<T>(raw[j][0], v[0]);
    unpack16<T>(raw[j][1], v[1]);
    if (mu_bh) {  // (every lane: the shuffles take the whole quad; rows >= nq give zeros, unused)
      float acc = 0.f;
#pragma unroll
      for (int k = 0; k < 2; ++k) {
        float m[16];
        load16f(mu_bh + t4 * 32 + 16 * k, m);
#pragma unroll
        for (int i = 0; i < 16; ++i) acc = fmaf(v[k][i], m[i], acc);
      }
      acc += __shfl_xor_sync(0xffffffffu, acc, 2);
      acc += __shfl_xor_sync(0xffffffffu, acc, 1);
      qmk_r[j] = __fmul_rn(acc, qmk_scale);  // (rounded as the pre-pass's stored qmk: never fused into the LSE's add)
    }
    char* tile = sQ + (t4 / 2) * S::BQ * 128;  // the 64-column piece of columns 32 t4 ..
    const int r = (cw / 4) * 64 + rl;
#pragma unroll
    for (int k = 0; k < 2; ++k) {
      const int u = (t4 % 2) * 2 + k;  // the 16-block within the piece
      unsigned hv[8] = {0u, 0u, 0u, 0u, 0u, 0u, 0u, 0u};
      if (qr < nq) {
        unsigned packed[2];
        const unsigned sc = nvfp4_block_exact16(v[k], packed);
        dequant16_half(make_uint2(packed[0], packed[1]), sc, hv);
      }
      *reinterpret_cast<uint4*>(tile + swz<128>(r, 2 * u)) = make_uint4(hv[0], hv[1], hv[2], hv[3]);
      *reinterpret_cast<uint4*>(tile + swz<128>(r, 2 * u + 1)) = make_uint4(hv[4], hv[5], hv[6], hv[7]);
    }
  }
}

// SPLIT: parts an item's keys go to at most (host: nvfp4._SPLIT_MAX, checked by CI) and which item (and part of it)
// CTA blockIdx.x runs (see nvfp4_attn_fwd_ws_split).
constexpr int WS_SPLIT_MAX = 4;
struct WsSplit {
  int part, nparts, tail;  // tail: the item's index among the split ones (-1: a whole item)
};
__device__ __forceinline__ QueryBlock ws_split_item(int rows, int Hq, int Hkv, int whole, int nsplit, int nblk,
                                                    WsSplit& sp) {
  const int c = blockIdx.x;
  int it = c;
  if (c >= whole) {
    sp.tail = (c - whole) / nsplit;
    sp.part = c - whole - sp.tail * nsplit;
    sp.nparts = nsplit;
    it = whole + sp.tail;
  }
  const int bhi = it / nblk;
  QueryBlock qb;
  qb.q0 = (it - bhi * nblk) * rows;
  qb.h = bhi % Hq;
  qb.b = bhi / Hq;
  qb.bh = static_cast<long long>(qb.b) * Hq + qb.h;
  qb.bhk = static_cast<long long>(qb.b) * Hkv + qb.h / (Hq / Hkv);
  return qb;
}

// SPLIT epilogue of a part (after fp4_frame_finish): this thread's O values normalized by the part's own row sums
// (fp32) and the part's base-2 LSE (m + log2 l; -inf where the row saw no key here) to its slot, 17 float4 with a
// stride of 32 (a warp's stores are 512 contiguous bytes); then per consumer warp a counter shared by the item's
// parts: the warp that counts last reads every part's slot (parts in order, whoever finishes last: deterministic)
// and stores O = sum_p w_p O_p / sum_p w_p, w_p = 2^(lse_p - max_p lse_p), and the LSE (natural log, + qmk as the
// plain epilogue). A part that saw no key for a row has w_p = 0; a NaN anywhere reaches O and LSE as in the plain
// epilogue. Memory order: stores, __threadfence, the counter (lane 0); the last warp: __threadfence, L2 loads.
template <typename T, int D, int NC>
__device__ __forceinline__ void ws_split_epilogue(const float (&acc_o)[D / 8][4], Fp4Rows& rs,
                                                  T* __restrict__ o_bh, long long osn, float* __restrict__ lse_bh,
                                                  const float* __restrict__ qmk_bh, const float* qmk_rows, int r_lo,
                                                  int t4, int nq, float* __restrict__ part_ws,
                                                  int* __restrict__ counters, const WsSplit& sp, int cw, int lane) {
  constexpr int NV4 = D / 8 + 1;  // float4 per thread: O's D / 2 values, then the two LSEs
  constexpr int MAXP = WS_SPLIT_MAX;
  float4* ws4 = reinterpret_cast<float4*>(part_ws);
  auto slot = [&](int p) {  // this thread's first float4 in part p's slot
    return ws4 + ((static_cast<long long>(sp.tail) * sp.nparts + p) * (4 * NC) + cw) * (NV4 * 32) + lane;
  };
#pragma unroll
  for (int r = 0; r < 2; ++r) rs.l[r] = quad_sum(rs.l[r]);
  float lse2[2], inv_l[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    lse2[r] = rs.l[r] == 0.f ? -INFINITY : rs.m[r] + log2f(rs.l[r]);
    inv_l[r] = rs.l[r] == 0.f ? 0.f : 1.f / rs.l[r];
  }
  float4* mine = slot(sp.part);
#pragma unroll
  for (int nt = 0; nt < D / 8; ++nt)
    __stcg(mine + 32 * nt, make_float4(acc_o[nt][0] * inv_l[0], acc_o[nt][1] * inv_l[0], acc_o[nt][2] * inv_l[1],
                                       acc_o[nt][3] * inv_l[1]));
  __stcg(mine + 32 * (D / 8), make_float4(lse2[0], lse2[1], 0.f, 0.f));
  __threadfence();
  __syncwarp();
  int prev = 0;
  if (lane == 0) {
    prev = atomicAdd(counters + static_cast<long long>(sp.tail) * (4 * NC) + cw, 1);
    __threadfence();  // (acquire: the other parts' stores before the loads below; then passed on by __syncwarp)
  }
  __syncwarp();
  prev = __shfl_sync(0xffffffffu, prev, 0);
  if (prev != sp.nparts - 1) return;  // (another part combines these rows)
  __threadfence();
  float lp[MAXP][2], top[2] = {-INFINITY, -INFINITY};
#pragma unroll
  for (int p = 0; p < MAXP; ++p) {
    if (p < sp.nparts) {
      const float4 x = __ldcg(slot(p) + 32 * (D / 8));
      lp[p][0] = x.x;
      lp[p][1] = x.y;
      top[0] = fmaxf(top[0], x.x);  // (fmaxf drops a NaN: w_p below carries it)
      top[1] = fmaxf(top[1], x.y);
    }
  }
  float w[MAXP][2], den[2] = {0.f, 0.f};
#pragma unroll
  for (int p = 0; p < MAXP; ++p)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      w[p][r] = p < sp.nparts && lp[p][r] != -INFINITY ? exp2f(lp[p][r] - top[r]) : 0.f;
      den[r] += w[p][r];
    }
  const float inv_den[2] = {den[0] == 0.f ? 0.f : 1.f / den[0], den[1] == 0.f ? 0.f : 1.f / den[1]};
#pragma unroll
  for (int nt = 0; nt < D / 8; ++nt) {
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
    for (int p = 0; p < MAXP; ++p) {
      if (p < sp.nparts) {
        const float4 x = __ldcg(slot(p) + 32 * nt);
        acc.x = fmaf(w[p][0], x.x, acc.x);
        acc.y = fmaf(w[p][0], x.y, acc.y);
        acc.z = fmaf(w[p][1], x.z, acc.z);
        acc.w = fmaf(w[p][1], x.w, acc.w);
      }
    }
    const int col = nt * 8 + 2 * t4;
    if (r_lo < nq)
      *reinterpret_cast<unsigned*>(o_bh + r_lo * osn + col) =
          den[0] == 0.f ? 0u : pack2<T>(acc.x * inv_den[0], acc.y * inv_den[0]);
    if (r_lo + 8 < nq)
      *reinterpret_cast<unsigned*>(o_bh + (r_lo + 8) * osn + col) =
          den[1] == 0.f ? 0u : pack2<T>(acc.z * inv_den[1], acc.w * inv_den[1]);
  }
  if (t4 == 0) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = r_lo + 8 * r;
      if (row < nq)
        lse_bh[row] = den[r] == 0.f ? -INFINITY
                                    : __fadd_rn(__fmul_rn(top[r] + log2f(den[r]), 0.6931471805599453f),
                                                qmk_rows ? qmk_rows[r] : qmk_bh ? qmk_bh[row] : 0.f);
    }
  }
}

}  // namespace

// The warp-specialized kernel's body. QIN = false: Q^ from the pre-pass's packed bytes (qc, qs), staged and
// dequantized by the producer, qmk (or null) from memory. QIN = true (nvfp4_attn_fwd_ws_qin): Q^ from the raw input
// q (rows qsn elements apart, 16-byte aligned; q_bh = q + b qsb + h qsh), quantized by the consumers (ws_quant_q),
// and qmk = qmk_scale * q . mu_K (mu: (B, Hkv, D) fp32, or null: no qmk) in registers.
// SPLIT (nvfp4_attn_fwd_ws_split): a 1-D grid of items (ws_split_item), the last ones' keys split over nsplit CTAs
// (parts), combined by ws_split_epilogue through part_ws and counters.
template <typename T, int D, bool TWO_LEVEL, int CG, int NC, bool QIN, bool SPLIT = false, bool IMG = false>
__device__ __forceinline__ void nvfp4_attn_fwd_ws_body(
    const unsigned char* __restrict__ qc, const unsigned char* __restrict__ qs, const T* __restrict__ q,
    long long qsb, long long qsh, long long qsn, const float* __restrict__ mu, float qmk_scale,
    const unsigned char* __restrict__ kc, const unsigned char* __restrict__ ks, const unsigned char* __restrict__ vc,
    const unsigned char* __restrict__ vs, int vcs, const float* __restrict__ qmk, T* __restrict__ o, long long osb,
    long long osh, long long osn, float* __restrict__ lse, int Hq, int Hkv, int nq, int nk, int n16,
    float scale_log2, int causal, int whole = 0, int nsplit = 1, int nblk = 1, float* __restrict__ part_ws = nullptr,
    int* __restrict__ counters = nullptr, const unsigned char* __restrict__ kvimg = nullptr) {
  using S = NvWs<D, NC>;
  static_assert(D == 64 || D == 128, "head dim 64 or 128 (wgmma N = D)");
  static_assert(NC == 2 || NC == 3, "two or three consumer warpgroups");
  // (the producer's K/V task split, (j + 1) * 128 <= KTASKS, is decided at compile time: whole K tasks per j need
  // KTASKS = 64 D / 64 to be a multiple of 128, i.e. D = 128; the host runs this kernel at D = 128 only)
  static_assert(S::KTASKS % S::PTHREADS == 0, "D = 128 (the producer's tasks split into K and V per j)");
  constexpr int BQ = S::BQ, NST = S::NST;
  const bool CAUSAL = causal != 0;
  grid_dep_wait();  // (launched as a programmatic dependent of the pre-pass: nothing global is touched before this)
  extern __shared__ __align__(128) char smem_raw[];
  char* smem = smem_raw + ((1024u - (smem_u32(smem_raw) & 1023u)) & 1023u);
  char* sQ = smem;                       // D / 64 pieces x BQ rows x 128 B
  char* sK = sQ + S::Q_BYTES;            // NST stages x D / 64 pieces x 64 rows x 128 B
  char* sV = sK + NST * S::K_BYTES;      // NST stages x D rows x 128 B
  char* stg0 = sV + NST * S::V_BYTES;    // two staging buffers
  unsigned long long* bars = reinterpret_cast<unsigned long long*>(stg0 + 2 * S::STG);
  unsigned long long* full = bars;              // stage s holds its tile, dequantized (producer threads)
  unsigned long long* empty = bars + NST;       // every consumer thread's products on stage s retired
  unsigned long long* q_full = bars + 2 * NST;  // Q dequantized
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, t4 = lane % 4;
  WsSplit sp = {0, 1, -1};  // (SPLIT: this CTA's part of its item's keys)
  QueryBlock qb;
  if constexpr (SPLIT)
    qb = ws_split_item(BQ, Hq, Hkv, whole, nsplit, nblk, sp);
  else
    qb = query_block<CG>(BQ, CAUSAL, Hq, Hkv);
  const int q0 = qb.q0, h = qb.h, b = qb.b;
  const long long bh = qb.bh, bhk = qb.bhk;
  const int shift = nk - nq;
  KeyTiles tl = key_tiles<BKV>(q0, BQ, nq, nk, CAUSAL);
  int t0 = 0;  // the first key tile: tile t of the loops below is key tile t0 + t (SPLIT parts; 0 otherwise)
  if constexpr (SPLIT) {
    if (sp.nparts > 1) {  // (non-causal: first_masked is n - 1 or n, never below a part's first tile)
      t0 = sp.part * tl.n / sp.nparts;
      const int t1 = (sp.part + 1) * tl.n / sp.nparts;
      tl.n = t1 - t0;
      tl.first_masked -= t0;
    }
  }
  if (tid < NST) {
    mbar_init(full + tid, IMG ? 1 : S::PTHREADS);  // (IMG: thread 0's arrival and the bulk copies' bytes)
    mbar_init(empty + tid, S::CTHREADS);
    if constexpr (IMG) fence_mbar_init();
  }
  if (tid == NST) mbar_init(q_full, S::PTHREADS);
  __syncthreads();

  if (warp < 4) {  // ---- producer ----
    setmaxnreg_dec_producer();
    const int ptid = tid;
    if constexpr (IMG) {
      // Stage images (nvfp4_kv_images): thread 0 copies tile t's K^ and V^^T, as the dequantizing producer below
      // would write them, with two bulk copies completing on full[t % NST]; the first NST tiles before Q's work.
      // (Image t0 + t: SPLIT parts start at their first tile.)
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
        for (int t = 0; t < NST && t < tl.n; ++t) copy_tile(t);
      if constexpr (!QIN) {  // Q as below (staging buffer 0), every producer thread
        ws_stage_q_all<D, NC>(stg0, q0, bh, qc, qs, nq, ptid);
        cp_async_commit();
        cp_async_wait<0>();
        asm volatile("" ::: "memory");
        ws_dequant_q<D, NC>(sQ, stg0, ptid);
        fence_proxy_async();
        mbar_arrive(q_full);
      }
      if (ptid == 0) {
        for (int t = NST; t < tl.n; ++t) {
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
    // (from key tile t0 on: tile t below is key tile t0 + t, its keys and tokens bounded by nk_t and n16_t)
    const unsigned char* gkc = kc + bhk * nk * (D / 2) + static_cast<long long>(t0) * BKV * (D / 2);
    const unsigned char* gks = ks + bhk * nk * (D / 16) + static_cast<long long>(t0) * BKV * (D / 16);
    const unsigned char* gvc = vc + bhk * D * vcs + t0 * (BKV / 2);
    const unsigned char* gvs = vs + bhk * D * (vcs / 8) + t0 * (BKV / 16);
    const int nk_t = nk - t0 * BKV, n16_t = n16 - t0 * BKV;
    if constexpr (!QIN) {  // (QIN: the consumers write Q^ themselves)
      // Q's bytes go to staging buffer 1 with SAGE_FP4_WS_QOVL (tile 0's to buffer 0 right after, both in flight),
      // else to buffer 0 before tile 0's. Every staging slot is written and read by the same thread.
      char* stq = SAGE_FP4_WS_QOVL ? stg0 + S::STG : stg0;
      ws_stage_q_all<D, NC>(stq, q0, bh, qc, qs, nq, ptid);  // Q (rows >= nq zero)
      cp_async_commit();
      if constexpr (SAGE_FP4_WS_QOVL) {
        if (tl.n > 0) ws_stage_tile<D, NC>(stg0, gkc, gks, gvc, gvs, vcs, 0, nk_t, n16_t, ptid);
        cp_async_commit();
        cp_async_wait<1>();  // Q's bytes (tile 0's may still be in flight)
      } else {
        cp_async_wait<0>();
      }
      asm volatile("" ::: "memory");
      ws_dequant_q<D, NC>(sQ, stq, ptid);
      fence_proxy_async();
      mbar_arrive(q_full);
    }
    if constexpr (QIN || !SAGE_FP4_WS_QOVL) {
      if (tl.n > 0) ws_stage_tile<D, NC>(stg0, gkc, gks, gvc, gvs, vcs, 0, nk_t, n16_t, ptid);
      cp_async_commit();
    }
    for (int t = 0; t < tl.n; ++t) {
      char* stg = stg0 + (t & 1) * S::STG;
      if (t + 1 < tl.n)
        ws_stage_tile<D, NC>(stg0 + ((t + 1) & 1) * S::STG, gkc, gks, gvc, gvs, vcs, t + 1, nk_t, n16_t, ptid);
      cp_async_commit();
      cp_async_wait<1>();  // tile t's bytes (this thread's own copies)
      asm volatile("" ::: "memory");
      const int st = t % NST;
      if (t >= NST) {
        if constexpr (SAGE_FP4_WS_WAIT_NS > 0)
          mbar_wait_hint<SAGE_FP4_WS_WAIT_NS>(empty + st, ((t / NST) - 1) & 1);
        else
          mbar_wait(empty + st, ((t / NST) - 1) & 1);
      }
      ws_dequant_tile<D, NC>(sK + st * S::K_BYTES, sV + st * S::V_BYTES, stg, ptid);
      fence_proxy_async();
      mbar_arrive(full + st);
    }
    cp_async_wait<0>();
    return;
  }

  // ---- consumers: warpgroups 1 .. NC ----
  setmaxnreg_inc_consumer<NC>();
  const int cw = warp - 4;                   // 0 .. 4 NC - 1
  const int r_lo = q0 + cw * 16 + g;         // this thread's rows: r_lo, r_lo + 8
  const char* sQw = sQ + (SAGE_FP4_WS_UNIFORM_WG ? __shfl_sync(0xffffffffu, cw / 4, 0) : cw / 4) * 64 * 128;
  Fp4Rows rs = {{-INFINITY, -INFINITY}, {0.f, 0.f}};
  Fp4Frame fr = {{-INFINITY, -INFINITY}};
  float acc_o[D / 8][4];
#pragma unroll
  for (int i = 0; i < D / 8; ++i) acc_o[i][0] = acc_o[i][1] = acc_o[i][2] = acc_o[i][3] = 0.f;
  float s0[8][4], s1[8][4];
  unsigned pa0[4][4], pa1[4][4];
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j) pa0[i][j] = pa1[i][j] = 0u;
  const unsigned long long dv0 = gmma_desc<128>(sV);
  float(&o_flat)[D / 2] = reinterpret_cast<float(&)[D / 2]>(acc_o);

  if (SAGE_FP4_WS_IDLE_SKIP && q0 + (cw / 4) * 64 >= nq) {
    // Every row of this warpgroup is padding (the last query block of a head, e.g. 4096 rows = 21 1/3 blocks): no
    // products, no softmax, nothing written; it only releases each stage once it is full, as the empty barriers'
    // counts expect. (Its arrival for tile t comes after full(t): the producer has then seen tile t - NST released,
    // so the arrival counts toward tile t's phase.)
    for (int t = 0; t < tl.n; ++t) {
      mbar_wait(full + t % NST, (t / NST) & 1);
      mbar_arrive(empty + t % NST);
    }
    return;
  }
  float qmk_r[2] = {0.f, 0.f};  // (QIN: qmk of rows r_lo, r_lo + 8)
  if constexpr (QIN) {
    ws_quant_q<T, D, NC>(sQ, q + b * qsb + h * qsh, qsn, nq, q0 + (cw / 4) * 64, cw, lane,
                         mu ? mu + bhk * D : nullptr, qmk_scale, qmk_r);
    fence_proxy_async();  // (this thread's Q^ stores, before the warpgroup's products read them)
    warpgroup_barrier(cw / 4);
  } else {
    mbar_wait(q_full, 0);
  }
  if (tl.n > 0) {
    mbar_wait(full, 0);
    wgmma_fence();
    wgmma_qk16<D, BQ>(reinterpret_cast<float(&)[32]>(s0), sQw, sK, 0);
    wgmma_wait<0>();
    fence_regs(reinterpret_cast<float(&)[32]>(s0));
  }
  if constexpr (NC == 2) {
    // One key tile: sc holds S(t); Q.K^T(t+1) goes into sn; pc receives P^(t); pp is P^(t-1), P.V(t-1)'s operand.
    auto step = [&](float(&sc)[8][4], float(&sn)[8][4], unsigned(&pc)[4][4], unsigned(&pp)[4][4], int t) {
      const int stn = (t + 1) % NST;
      if (t + 1 < tl.n) mbar_wait(full + stn, ((t + 1) / NST) & 1);
      wgmma_fence();
      // (after the last tile: a stale stage, dropped; every issue unconditional, see the kernel above)
      wgmma_qk16<D, BQ>(reinterpret_cast<float(&)[32]>(sn), sQw, sK, stn * S::K_BYTES);
      unsigned pp_unused[1][4];
      const Fp4TileScale ts = fp4_softmax_tile<TWO_LEVEL, false, true, SAGE_FP4_TBLK>(
          sc, rs, pc, pp_unused, t0 + t, t >= tl.first_masked, CAUSAL, r_lo, t4, nk, shift, scale_log2);
      wgmma_wait<0>();  // P.V(t-1) and Q.K^T(t+1) (issued before the softmax: done by now, as a rule)
      fence_regs(o_flat);
      fence_regs(reinterpret_cast<float(&)[32]>(sn));
      hold_regs(pp);
      if (t > 0) mbar_arrive(empty + (t - 1) % NST);
      fp4_frame_step<TWO_LEVEL>(acc_o, fr, ts);
      wgmma_fence();
      const unsigned long long dv = gmma_desc_advance(dv0, (t % NST) * S::V_BYTES);
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) wgmma_rs<__half, false>(o_flat, pc[kk], gmma_desc_advance(dv, 32 * kk), 1);
      wgmma_commit();  // P.V(t) runs on through the next tile's softmax
    };
    for (int t = 0; t < tl.n; t += 2) {
      step(s0, s1, pa0, pa1, t);
      if (t + 1 < tl.n) step(s1, s0, pa1, pa0, t + 1);
    }
  } else {
    for (int t = 0; t < tl.n; ++t) {
      unsigned pp_unused[1][4];
      const Fp4TileScale ts = fp4_softmax_tile<TWO_LEVEL, false, true, SAGE_FP4_TBLK>(
          s0, rs, pa0, pp_unused, t0 + t, t >= tl.first_masked, CAUSAL, r_lo, t4, nk, shift, scale_log2);
      fp4_frame_step<TWO_LEVEL>(acc_o, fr, ts);
      wgmma_fence();
      const unsigned long long dv = gmma_desc_advance(dv0, (t % NST) * S::V_BYTES);
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) wgmma_rs<__half, false>(o_flat, pa0[kk], gmma_desc_advance(dv, 32 * kk), 1);
      wgmma_commit();
      const int stn = (t + 1) % NST;
      if (t + 1 < tl.n) mbar_wait(full + stn, ((t + 1) / NST) & 1);
      wgmma_fence();
      wgmma_qk16<D, BQ>(reinterpret_cast<float(&)[32]>(s0), sQw, sK, stn * S::K_BYTES);  // (stale after the last)
      wgmma_wait<1>();  // P.V(t) done
      fence_regs(o_flat);
      hold_regs(pa0);
      mbar_arrive(empty + t % NST);  // (tile t's K and V: Q.K^T(t) retired a tile ago)
      wgmma_wait<0>();  // Q.K^T(t+1) done
      fence_regs(reinterpret_cast<float(&)[32]>(s0));
    }
  }
  wgmma_wait<0>();
  fence_regs(o_flat);
  hold_regs(pa0);
  hold_regs(pa1);
  fp4_frame_finish<TWO_LEVEL>(acc_o, fr, rs);
  if constexpr (SPLIT) {
    if (sp.nparts > 1) {
      ws_split_epilogue<T, D, NC>(acc_o, rs, o + b * osb + h * osh, osn, lse + bh * nq,
                                  QIN ? nullptr : qmk ? qmk + bh * nq : nullptr, QIN ? qmk_r : nullptr, r_lo, t4, nq,
                                  part_ws, counters, sp, cw, lane);
      return;
    }
  }
  if constexpr (QIN)
    fp4_fwd_epilogue<T, D, false>(acc_o, nullptr, rs, o + b * osb + h * osh, osn, nullptr, lse + bh * nq, nullptr,
                                  nullptr, r_lo, t4, nq, 0, qmk_r);
  else
    fp4_fwd_epilogue<T, D, false>(acc_o, nullptr, rs, o + b * osb + h * osh, osn, nullptr, lse + bh * nq, nullptr,
                                  qmk ? qmk + bh * nq : nullptr, r_lo, t4, nq, 0);
}

// Grid (ceil(nq / (64 NC)), Hq, B), block 128 (NC + 1), dynamic shared memory NvWs<D, NC>::SMEM. Arguments as
// nvfp4_attn_fwd_sm90. NC = 3 consumers (192 rows, 152 registers each) take the 12-warp kernel's order instead
// (one S tile: softmax(t), P.V(t), Q.K^T(t+1), wait for both).
template <typename T, int D, bool TWO_LEVEL, int CG = 1, int NC = 2>
__global__ void __launch_bounds__(128 * (NC + 1), 1)
nvfp4_attn_fwd_ws(const unsigned char* __restrict__ qc, const unsigned char* __restrict__ qs,
                  const unsigned char* __restrict__ kc, const unsigned char* __restrict__ ks,
                  const unsigned char* __restrict__ vc, const unsigned char* __restrict__ vs, int vcs,
                  const float* __restrict__ qmk, T* __restrict__ o, long long osb, long long osh, long long osn,
                  float* __restrict__ lse, int Hq, int Hkv, int nq, int nk, int n16, float scale_log2, int causal) {
  nvfp4_attn_fwd_ws_body<T, D, TWO_LEVEL, CG, NC, false>(qc, qs, nullptr, 0, 0, 0, nullptr, 0.f, kc, ks, vc, vs, vcs,
                                                         qmk, o, osb, osh, osn, lse, Hq, Hkv, nq, nk, n16, scale_log2,
                                                         causal);
}

// nvfp4_attn_fwd_ws with Q quantized in the kernel (opt-in: SAGECUPY_FP4_QIN=1; nvfp4.attention on raw inputs): q
// the raw fp16 / bf16 input (B, Hq, nq, D) at element strides qsb, qsh, qsn (rows 16-byte aligned, D contiguous),
// mu K's mean (B, Hkv, D) fp32 or null (no K-smoothing: no qmk), qmk_scale = sm_scale; no qc, qs, qmk. The same O
// and LSE, bit for bit, as the pre-pass's Q (nvfp4_quant_rows with its qmk) and nvfp4_attn_fwd_ws. Grid, block and
// shared memory as nvfp4_attn_fwd_ws.
template <typename T, int D, bool TWO_LEVEL, int CG = 1, int NC = 3>
__global__ void __launch_bounds__(128 * (NC + 1), 1)
nvfp4_attn_fwd_ws_qin(const T* __restrict__ q, long long qsb, long long qsh, long long qsn,
                      const float* __restrict__ mu, float qmk_scale, const unsigned char* __restrict__ kc,
                      const unsigned char* __restrict__ ks, const unsigned char* __restrict__ vc,
                      const unsigned char* __restrict__ vs, int vcs, T* __restrict__ o, long long osb, long long osh,
                      long long osn, float* __restrict__ lse, int Hq, int Hkv, int nq, int nk, int n16,
                      float scale_log2, int causal) {
  nvfp4_attn_fwd_ws_body<T, D, TWO_LEVEL, CG, NC, true>(nullptr, nullptr, q, qsb, qsh, qsn, mu, qmk_scale, kc, ks, vc,
                                                        vs, vcs, nullptr, o, osb, osh, osn, lse, Hq, Hkv, nq, nk, n16,
                                                        scale_log2, causal);
}

// nvfp4_attn_fwd_ws (QIN = false: Q's bytes qc, qs and qmk) or nvfp4_attn_fwd_ws_qin (QIN = true: the raw q, its
// strides, mu and qmk_scale) with the grid's last items split along the keys (opt-in: SAGECUPY_FP4_TAIL_SPLIT=1;
// non-causal, two-level P): a 1-D grid of whole + (items - whole) nsplit CTAs, items in the plain grid's order (query
// block fastest, then head, then batch; nblk query blocks per head); CTA c < whole runs item c whole, the others part
// (c - whole) % nsplit of item whole + (c - whole) / nsplit, its share of the key tiles. Parts write fp32 partials to
// part_ws ((items - whole) nsplit x 4 NC warps x 17 x 32 float4) and count on counters ((items - whole) x 4 NC ints,
// zeroed before the launch); per item and consumer warp, the last part to finish combines them (ws_split_epilogue).
// With two-level P each tile's P^ depends only on its own row maxima, so the parts quantize P as the whole item
// does; O and LSE differ from the whole item's by fp32 rounding (the combination's weights and sums).
template <typename T, int D, bool TWO_LEVEL, int NC, bool QIN>
__global__ void __launch_bounds__(128 * (NC + 1), 1)
nvfp4_attn_fwd_ws_split(const unsigned char* __restrict__ qc, const unsigned char* __restrict__ qs,
                        const T* __restrict__ q, long long qsb, long long qsh, long long qsn,
                        const float* __restrict__ mu, float qmk_scale, const unsigned char* __restrict__ kc,
                        const unsigned char* __restrict__ ks, const unsigned char* __restrict__ vc,
                        const unsigned char* __restrict__ vs, int vcs, const float* __restrict__ qmk,
                        T* __restrict__ o, long long osb, long long osh, long long osn, float* __restrict__ lse,
                        int Hq, int Hkv, int nq, int nk, int n16, float scale_log2, int causal, int whole, int nsplit,
                        int nblk, float* __restrict__ part_ws, int* __restrict__ counters) {
  static_assert(TWO_LEVEL, "parts quantize P as the whole item does only with two-level P");
  nvfp4_attn_fwd_ws_body<T, D, TWO_LEVEL, 1, NC, QIN, true>(qc, qs, q, qsb, qsh, qsn, mu, qmk_scale, kc, ks, vc, vs,
                                                            vcs, qmk, o, osb, osh, osn, lse, Hq, Hkv, nq, nk, n16,
                                                            scale_log2, causal, whole, nsplit, nblk, part_ws,
                                                            counters);
}

// The warp-specialized kernel on K/V stage images (opt-in: SAGECUPY_FP4_KVIMG=1; nvfp4_kv_images writes kvimg):
// nvfp4_attn_fwd_ws (QIN = false: qc, qs, qmk), nvfp4_attn_fwd_ws_qin (QIN = true: q, its strides, mu, qmk_scale),
// and with SPLIT nvfp4_attn_fwd_ws_split's 1-D grid (whole, nsplit, nblk, part_ws, counters; CG = 1); kvimg in
// place of the packed K and V, whose sizes nk and n16 still give the masks. Bitwise the O and LSE of those kernels.
template <typename T, int D, bool TWO_LEVEL, int CG, int NC, bool QIN, bool SPLIT>
__global__ void __launch_bounds__(128 * (NC + 1), 1)
nvfp4_attn_fwd_ws_img(const unsigned char* __restrict__ qc, const unsigned char* __restrict__ qs,
                      const T* __restrict__ q, long long qsb, long long qsh, long long qsn,
                      const float* __restrict__ mu, float qmk_scale, const unsigned char* __restrict__ kvimg,
                      const float* __restrict__ qmk, T* __restrict__ o, long long osb, long long osh, long long osn,
                      float* __restrict__ lse, int Hq, int Hkv, int nq, int nk, int n16, float scale_log2,
                      int causal, int whole, int nsplit, int nblk, float* __restrict__ part_ws,
                      int* __restrict__ counters) {
  static_assert(!SPLIT || (TWO_LEVEL && CG == 1), "the split grid: two-level P, non-causal");
  nvfp4_attn_fwd_ws_body<T, D, TWO_LEVEL, CG, NC, QIN, SPLIT, true>(
      qc, qs, q, qsb, qsh, qsn, mu, qmk_scale, nullptr, nullptr, nullptr, nullptr, 0, qmk, o, osb, osh, osn, lse, Hq,
      Hkv, nq, nk, n16, scale_log2, causal, whole, nsplit, nblk, part_ws, counters, kvimg);
}

// ---- Persistent warp-specialized kernel (nvfp4_attn_fwd_ws_persist; opt-in: SAGECUPY_FP4_PERSIST=1, three
// consumers at D = 128) ----
//
// nvfp4_attn_fwd_ws's work, with one CTA per SM walking (query block, head, batch) items instead of one CTA per item,
// so that an item's prologue (Q's and the first tiles' loads and dequantization) overlaps the item before it: the
// producer stages the next item's Q and first key tile after the current item's last tile, its K/V ring runs on
// across items (one tile counter for the CTA's whole walk: the next item's first NST - 1 tiles are dequantized while
// the consumers finish the current one), and it writes the next Q into shared memory as soon as every consumer is
// done with the current one (q_empty), while the consumers store the current item's O.
// Items are taken in order from a counter (dynamic: the first gridDim.x by CTA index, then one atomicAdd each; the
// host zeroes the counter before every launch): causal items heaviest first over all heads (query blocks from the
// last one down), non-causal ones head by head. Producer thread 0 takes and decodes the next item into a shared
// slot (two, alternating); the other threads read it there. Each item computes exactly what nvfp4_attn_fwd_ws
// computes for that CTA (the same tiles, products and order): O and LSE bitwise the same.
// Shared memory: NvWs's, plus a third staging buffer (the next Q's bytes), q_empty and the two item slots.
template <int D, int NC>
struct NvWsP {
  using W = NvWs<D, NC>;
  static constexpr int SMEM = W::SMEM + W::STG + 8 + 64;
};
// Registers after setmaxnreg: the producer carries the walk's state through its tile loop, which does not fit in
// nvfp4_attn_fwd_ws's 56 (ptxas: ~100 bytes of spills at 56, none at 64); the consumers' share is then 144 (the
// consumer code compiles without spills at 128 too).
constexpr int WSP_PREG = 64, WSP_CREG = (65536 - 128 * WSP_PREG) / 384 / 8 * 8;
static_assert(WSP_CREG == 144, "the budget the persistent kernel was compiled with");

// An item as its slot holds it: its index (nitems: past the end), query block, head (B Hq), KV head (B Hkv), key tiles
// and the first that needs the mask.
struct WsSlot {
  int item, q0, bh, bhk, n, first_masked;
};

// Item i of the walk (i < nblk Hq B, else the end): causal: query block nblk - 1 - i / (Hq B) of head i % (Hq B);
// else query block i % nblk of head i / nblk.
__device__ __forceinline__ void ws_write_slot(volatile WsSlot* slot, int i, int nitems, int bq, bool causal, int Hq,
                                              int Hkv, int B, int nq, int nk) {
  i = min(i, nitems);
  slot->item = i;
  if (i >= nitems) return;
  const int nblk = (nq + bq - 1) / bq, BH = Hq * B;
  const int blk = causal ? nblk - 1 - i / BH : i % nblk, bh = causal ? i % BH : i / nblk;
  const int b = bh / Hq, h = bh % Hq;
  const KeyTiles tl = key_tiles<BKV>(blk * bq, bq, nq, nk, causal);
  slot->q0 = blk * bq;
  slot->bh = bh;
  slot->bhk = b * Hkv + h / (Hq / Hkv);
  slot->n = tl.n;
  slot->first_masked = tl.first_masked;
}

// Producer: the Q bytes of the query block at q0 of head bh -> staging buffer stq (this thread's tasks; rows >= nq
// zero)
template <int D, int NC>
__device__ __forceinline__ void ws_stage_q(char* stq, int q0, int bh, const unsigned char* qc,
                                           const unsigned char* qs, int nq, int ptid) {
  using S = NvWs<D, NC>;
#pragma unroll 1
  for (int j = 0; j < S::QTASKS / S::PTHREADS; ++j) {  // (one task at a time: the producer's registers)
    const int i = ptid + j * S::PTHREADS, row = i % S::BQ, piece = i / S::BQ, qr = q0 + row;
    const bool ok = qr < nq;
    const long long r = static_cast<long long>(bh) * nq + qr;
    stage_task(stq, i, qc + (ok ? r * (D / 2) + piece * 32 : 0), qs + (ok ? r * (D / 16) + piece * 4 : 0),
               ok ? 32 : 0, ok ? 4 : 0, S::STG_CODES);
  }
}

// Producer: key tile `tile` of KV head bhk -> staging buffer stg
template <int D, int NC>
__device__ __forceinline__ void ws_stage_kv(char* stg, int bhk, const unsigned char* kc, const unsigned char* ks,
                                            const unsigned char* vc, const unsigned char* vs, int vcs, int tile,
                                            int nk, int n16, int ptid) {
  const long long hk = bhk;
  ws_stage_tile<D, NC>(stg, kc + hk * nk * (D / 2), ks + hk * nk * (D / 16), vc + hk * D * vcs,
                       vs + hk * D * (vcs / 8), vcs, tile, nk, n16, ptid);
}

// Grid (min(items, SMs)), block 128 (NC + 1), dynamic shared memory NvWsP<D, NC>::SMEM. Arguments as nvfp4_attn_fwd_ws,
// plus B, counter (an int the host zeroes before the launch) and nitems = ceil(nq / (64 NC)) Hq B.
template <typename T, int D, bool TWO_LEVEL, int NC = 3>
__global__ void __launch_bounds__(128 * (NC + 1), 1)
nvfp4_attn_fwd_ws_persist(const unsigned char* __restrict__ qc, const unsigned char* __restrict__ qs,
                          const unsigned char* __restrict__ kc, const unsigned char* __restrict__ ks,
                          const unsigned char* __restrict__ vc, const unsigned char* __restrict__ vs, int vcs,
                          const float* __restrict__ qmk, T* __restrict__ o, long long osb, long long osh,
                          long long osn, float* __restrict__ lse, int Hq, int Hkv, int nq, int nk, int n16,
                          float scale_log2, int causal, int B, int* __restrict__ counter, int nitems) {
  using S = NvWs<D, NC>;
  static_assert(D == 128 && NC == 3, "the default configuration of nvfp4_attn_fwd_ws: D = 128, three consumers");
  constexpr int BQ = S::BQ, NST = S::NST;
  const bool CAUSAL = causal != 0;
  grid_dep_wait();  // (a programmatic dependent of the pre-pass: nothing global is touched before this)
  extern __shared__ __align__(128) char smem_raw[];
  char* smem = smem_raw + ((1024u - (smem_u32(smem_raw) & 1023u)) & 1023u);
  char* sQ = smem;
  char* sK = sQ + S::Q_BYTES;
  char* sV = sK + NST * S::K_BYTES;
  char* stg0 = sV + NST * S::V_BYTES;  // two staging buffers for key tiles, a third for the next Q
  char* stq = stg0 + 2 * S::STG;
  unsigned long long* bars = reinterpret_cast<unsigned long long*>(stq + S::STG);
  unsigned long long* full = bars;
  unsigned long long* empty = bars + NST;
  unsigned long long* q_full = bars + 2 * NST;       // Q of the CTA's jj-th item dequantized (phase jj & 1)
  unsigned long long* q_empty = bars + 2 * NST + 1;  // every consumer thread done with it
  volatile WsSlot* slots = reinterpret_cast<volatile WsSlot*>(bars + 2 * NST + 2);  // item jj in slot jj & 1
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, t4 = lane % 4;
  if (tid < NST) {
    mbar_init(full + tid, S::PTHREADS);
    mbar_init(empty + tid, S::CTHREADS);
  }
  if (tid == NST) mbar_init(q_full, S::PTHREADS);
  if (tid == NST + 1) mbar_init(q_empty, S::CTHREADS);
  if (tid == 0) ws_write_slot(slots, blockIdx.x, nitems, BQ, CAUSAL, Hq, Hkv, B, nq, nk);
  __syncthreads();

  if (warp < 4) {  // ---- producer ----
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(WSP_PREG));
    const int ptid = tid;
    int item = slots[0].item, n = slots[0].n, bhk = slots[0].bhk;  // the current item (the host's grid <= nitems)
    if (item < nitems) {
      ws_stage_q<D, NC>(stq, slots[0].q0, slots[0].bh, qc, qs, nq, ptid);
      if (n > 0) ws_stage_kv<D, NC>(stg0, bhk, kc, ks, vc, vs, vcs, 0, nk, n16, ptid);
    }
    cp_async_commit();
    int g_tile = 0;  // the CTA's key tiles so far (stage g_tile % NST, staging buffer g_tile & 1)
    for (int jj = 0;; ++jj) {
      // item: the jj-th of this CTA; its Q's and first tile's bytes were staged by this thread's last group
      cp_async_wait<0>();
      asm volatile("" ::: "memory");
      if (item >= nitems) {  // past the end: the consumers' signal to stop, once they are done with the last item
        if (jj > 0) mbar_wait(q_empty, (jj - 1) & 1);
        mbar_arrive(q_full);
        break;
      }
      const long long hk = bhk;
      const unsigned char* gkc = kc + hk * nk * (D / 2);
      const unsigned char* gks = ks + hk * nk * (D / 16);
      const unsigned char* gvc = vc + hk * D * vcs;
      const unsigned char* gvs = vs + hk * D * (vcs / 8);
      // Q goes in before the item's tile NST - 1 (or after its last tile): the tiles before it take the stages of
      // the previous item's tiles before its last one, so they are dequantized while the consumers finish that item;
      // tile NST - 1's stage is the previous item's last tile's, released about when q_empty completes (the first
      // item: Q first)
      const int tq = jj == 0 ? 0 : min(n, NST - 1);
      for (int t = 0;; ++t) {
        if (t == tq) {
          if (jj > 0) mbar_wait(q_empty, (jj - 1) & 1);  // every consumer is done with the previous item (its Q)
#pragma unroll 1
          for (int j = 0; j < S::QTASKS / S::PTHREADS; ++j) {  // (one task at a time: 64 registers)
            const int i = ptid + j * S::PTHREADS;
            dequant_task(sQ + (i / BQ) * BQ * 128, i % BQ, stq, i, S::STG_CODES);
          }
          fence_proxy_async();
          mbar_arrive(q_full);
          if (ptid == 0)  // (the slot's last readers are done: q_empty above, the bar.sync below)
            ws_write_slot(slots + ((jj + 1) & 1), gridDim.x + atomicAdd(counter, 1), nitems, BQ, CAUSAL, Hq, Hkv, B,
                          nq, nk);
        }
        if (t == n) break;
        if (t + 1 < n)
          ws_stage_tile<D, NC>(stg0 + ((g_tile + 1) & 1) * S::STG, gkc, gks, gvc, gvs, vcs, t + 1, nk, n16, ptid);
        cp_async_commit();
        cp_async_wait<1>();  // tile g_tile's bytes (this thread's own copies)
        asm volatile("" ::: "memory");
        const int st = g_tile % NST;
        if (g_tile >= NST) {
          if constexpr (SAGE_FP4_WS_WAIT_NS > 0)
            mbar_wait_hint<SAGE_FP4_WS_WAIT_NS>(empty + st, ((g_tile / NST) - 1) & 1);
          else
            mbar_wait(empty + st, ((g_tile / NST) - 1) & 1);
        }
        ws_dequant_tile<D, NC>(sK + st * S::K_BYTES, sV + st * S::V_BYTES, stg0 + (g_tile & 1) * S::STG, ptid);
        fence_proxy_async();
        mbar_arrive(full + st);
        ++g_tile;
      }
      // the next item's Q and first tile into the free staging buffers (the one after the last tile's), in flight
      // while the consumers finish this item (every producer thread at the same point)
      asm volatile("bar.sync 1, 128;\n" ::: "memory");  // (thread 0's slot is written)
      const volatile WsSlot& nxt = slots[(jj + 1) & 1];
      item = nxt.item;
      n = nxt.n;
      bhk = nxt.bhk;
      if (item < nitems) {
        ws_stage_q<D, NC>(stq, nxt.q0, nxt.bh, qc, qs, nq, ptid);
        if (n > 0) ws_stage_kv<D, NC>(stg0 + (g_tile & 1) * S::STG, bhk, kc, ks, vc, vs, vcs, 0, nk, n16, ptid);
      }
      cp_async_commit();
    }
    cp_async_wait<0>();
    return;
  }

  // ---- consumers: warpgroups 1 .. NC ----
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(WSP_CREG));
  const int cw = warp - 4;
  const char* sQw = sQ + (cw / 4) * 64 * 128;
  const unsigned long long dv0 = gmma_desc<128>(sV);
  const int shift = nk - nq;
  int g_tile = 0;
  for (int jj = 0;; ++jj) {
    mbar_wait(q_full, jj & 1);
    const volatile WsSlot* sl = slots + (jj & 1);
    const int item = sl->item;
    if (item >= nitems) break;
    const int n = sl->n, first_masked = sl->first_masked, q0 = sl->q0, bh = sl->bh;
    const int r_lo = q0 + cw * 16 + g;
    if (SAGE_FP4_WS_IDLE_SKIP && q0 + (cw / 4) * 64 >= nq) {  // every row of this warpgroup (as the WS kernel)
      for (int t = 0; t < n; ++t) {
        mbar_wait(full + (g_tile + t) % NST, ((g_tile + t) / NST) & 1);
        mbar_arrive(empty + (g_tile + t) % NST);
      }
      g_tile += n;
      mbar_arrive(q_empty);
      continue;
    }
    Fp4Rows rs = {{-INFINITY, -INFINITY}, {0.f, 0.f}};
    Fp4Frame fr = {{-INFINITY, -INFINITY}};
    float acc_o[D / 8][4];
#pragma unroll
    for (int i = 0; i < D / 8; ++i) acc_o[i][0] = acc_o[i][1] = acc_o[i][2] = acc_o[i][3] = 0.f;
    float(&o_flat)[D / 2] = reinterpret_cast<float(&)[D / 2]>(acc_o);
    float s0[8][4];
    unsigned pa0[4][4];
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
      for (int j = 0; j < 4; ++j) pa0[i][j] = 0u;
    if (n > 0) {
      mbar_wait(full + g_tile % NST, (g_tile / NST) & 1);
      wgmma_fence();
      wgmma_qk16<D, BQ>(reinterpret_cast<float(&)[32]>(s0), sQw, sK, (g_tile % NST) * S::K_BYTES);
      wgmma_wait<0>();
      fence_regs(reinterpret_cast<float(&)[32]>(s0));
    }
    for (int t = 0; t < n; ++t) {
      const int gt = g_tile + t;
      unsigned pp_unused[1][4];
      const Fp4TileScale ts = fp4_softmax_tile<TWO_LEVEL, false, true, SAGE_FP4_TBLK>(
          s0, rs, pa0, pp_unused, t, t >= first_masked, CAUSAL, r_lo, t4, nk, shift, scale_log2);
      fp4_frame_step<TWO_LEVEL>(acc_o, fr, ts);
      wgmma_fence();
      const unsigned long long dv = gmma_desc_advance(dv0, (gt % NST) * S::V_BYTES);
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) wgmma_rs<__half, false>(o_flat, pa0[kk], gmma_desc_advance(dv, 32 * kk), 1);
      wgmma_commit();
      const int stn = (gt + 1) % NST;
      if (t + 1 < n) mbar_wait(full + stn, ((gt + 1) / NST) & 1);
      wgmma_fence();
      // (after the item's last tile: a stale stage, dropped; the producer may be writing it, and Q is not released
      // before this product has retired)
      wgmma_qk16<D, BQ>(reinterpret_cast<float(&)[32]>(s0), sQw, sK, stn * S::K_BYTES);
      wgmma_wait<1>();  // P.V(t) done
      fence_regs(o_flat);
      hold_regs(pa0);
      mbar_arrive(empty + gt % NST);
      wgmma_wait<0>();  // Q.K^T(t+1) done
      fence_regs(reinterpret_cast<float(&)[32]>(s0));
    }
    wgmma_wait<0>();
    fence_regs(o_flat);
    hold_regs(pa0);
    mbar_arrive(q_empty);  // sQ free for the next item's Q (every product that read it has retired)
    g_tile += n;
    fp4_frame_finish<TWO_LEVEL>(acc_o, fr, rs);
    const int b = bh / Hq, h = bh % Hq;
    fp4_fwd_epilogue<T, D, false, true>(acc_o, nullptr, rs, o + b * osb + h * osh, osn, nullptr,
                                  lse + static_cast<long long>(bh) * nq, nullptr,
                                  qmk ? qmk + static_cast<long long>(bh) * nq : nullptr, r_lo, t4, nq, 0);
  }
}
