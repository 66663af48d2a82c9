// INT8 pre-processing of packed variable-length sequences (layout "THD", docs/algorithms.md §1.8): the per-call
// table of sequence offsets (int8/packed.cuh), then int8_quant.cu's passes per (sequence, head). Each kernel looks
// its CTA's sequence up in the table, moves the base pointers to that sequence (the caller's (T, H, D) arrays to its
// first row, the padded buffers to its block) and runs the dense body with b = 0 and the sequence's lengths, so the
// statistics (K's mean, V's channel scales) are the sequence's own and every byte is that of a batch-1 dense call.
//
// Grids: x runs over the padded rows of the axis in units of the CTA's rows (64 = PACK_BLOCK unless said), or over
// the column statistics' chunks, up to the host's bounds; CTAs past the last sequence return at once. y is the head
// (Q heads, then K heads, then V heads where one launch does several), z 1 (the column statistics: K, then V).
// Every kernel takes (meta, S, nbq, nbk): the table and the sizes of its q and k block tables.
#include "int8/int8_quant.cu"
#include "int8/packed.cuh"

namespace sage {

// Inclusive scan over the 1024 threads of the block (op: max or +; identity 0 for the values here, all >= 0).
template <typename Op>
__device__ __forceinline__ int block_scan_1024(int v, int* red, Op op) {
  const int t = threadIdx.x, lane = t % 32, warp = t / 32;
#pragma unroll
  for (int d = 1; d < 32; d <<= 1) {
    const int u = __shfl_up_sync(0xffffffffu, v, d);
    if (lane >= d) v = op(v, u);
  }
  if (lane == 31) red[warp] = v;
  __syncthreads();
  if (warp == 0) {
    int w = red[lane];
#pragma unroll
    for (int d = 1; d < 32; d <<= 1) {
      const int u = __shfl_up_sync(0xffffffffu, w, d);
      if (lane >= d) w = op(w, u);
    }
    red[lane] = w;
  }
  __syncthreads();
  if (warp > 0) v = op(v, red[warp - 1]);
  __syncthreads();  // (red is reused by the next scan)
  return v;
}
struct ScanMax {
  __device__ int operator()(int a, int b) const { return max(a, b); }
};
struct ScanAdd {
  __device__ int operator()(int a, int b) const { return a + b; }
};

// The pointers and lengths of a CTA of R padded rows at grid x on one axis: the sequence (s < 0: none) and the CTA's
// row block within it.
struct PackedRows {
  int s, bx;
  PackedSide side;
};
__device__ __forceinline__ PackedRows packed_rows(const int* __restrict__ meta, int S, int nbq, int nbk, bool kside,
                                                  int x, int R) {
  PackedRows r;
  const long long row = static_cast<long long>(x) * R;
  r.s = packed_seq_of(meta, S, nbq, nbk, kside, row);
  if (r.s >= 0) {
    r.side = packed_side(meta, S, r.s, kside);
    r.bx = static_cast<int>((row - r.side.pad0) / R);
  }
  return r;
}

// quant_rows_body on a packed sequence's rows (H heads of the axis; mu and dot_vec: (S, H / group, D) per sequence).
template <typename T, int D, int RPW, bool GROUPED, bool EXACT>
__device__ __forceinline__ void packed_quant_rows(const T* __restrict__ x, long long sh, long long sn,
                                                  const PackedRows& r, int H, const float* __restrict__ mu,
                                                  int mu_group, float mult, signed char* __restrict__ codes,
                                                  float* __restrict__ scales, float scale_mult,
                                                  const float* __restrict__ dot_vec, int dot_group, float dot_mult,
                                                  float* __restrict__ dot, int h, char* __restrict__ kv_img) {
  const long long rows = static_cast<long long>(H) * r.side.pad0;  // the sequence's first row in the buffers
  quant_rows_body<T, D, RPW, GROUPED, EXACT>(
      x + r.side.start * sn, 0, sh, sn, r.side.n, r.side.n_pad,
      mu ? mu + static_cast<long long>(r.s) * (H / mu_group) * D : nullptr, mu_group, mult,
      codes ? codes + rows * D : nullptr, scales ? scales + rows : nullptr, scale_mult,
      dot_vec ? dot_vec + static_cast<long long>(r.s) * (H / dot_group) * D : nullptr, dot_group, dot_mult,
      dot ? dot + rows : nullptr, r.bx, h, 0, H, kv_img ? kv_img + rows / 64 * FwdImg<D>::STAGE : nullptr);
}

// quant_transpose_perm_body (V: MODE 0 with the sequence's channel scales (S, H, D), or 2) on a packed sequence's
// 64-key block: IMG 0 into v_t, 2 into the forward's K/V stage images.
template <typename T, int D, int MODE, int IMG>
__device__ __forceinline__ void packed_v_block(const T* __restrict__ v, long long vsh, long long vsn,
                                               const PackedRows& r, int H, const float* __restrict__ scale_in,
                                               float* __restrict__ scale_out, signed char* __restrict__ out,
                                               int tile_major, int h) {
  const long long rows = static_cast<long long>(H) * r.side.pad0;
  quant_transpose_perm_body<T, D, MODE, false, IMG>(
      v + r.side.start * vsn, 0, vsh, vsn, r.side.n, r.side.n_pad,
      MODE == 0 ? scale_in + static_cast<long long>(r.s) * H * D : nullptr,
      MODE == 0 ? nullptr : scale_out + rows / 64 * D, out + (IMG ? rows / 64 * FwdImg<D>::STAGE : rows * D),
      tile_major, nullptr, 0, 0, 0, nullptr, r.bx, h, 0, H);
}

// quant_transpose_perm_body's dO pass with delta (MODE 1 or 2) on a packed sequence's 64-row block: IMG 0 into do_t
// and do_scale (tile-major), 1 into the backward's query-side stage images, 3 the same without dO's codes, 4 delta
// alone.
template <typename T, int D, int MODE, int IMG>
__device__ __forceinline__ void packed_do_block(const T* __restrict__ dout, long long dsh, long long dsn,
                                                const PackedRows& r, int H, float* __restrict__ scale_out,
                                                signed char* __restrict__ out, const T* __restrict__ o, long long osh,
                                                long long osn, float* __restrict__ delta, int h) {
  const long long rows = static_cast<long long>(H) * r.side.pad0;
  quant_transpose_perm_body<T, D, MODE, true, IMG>(
      dout + r.side.start * dsn, 0, dsh, dsn, r.side.n, r.side.n_pad, nullptr,
      IMG ? nullptr : scale_out + rows / 64 * D,
      IMG == 4 ? nullptr : out + (IMG ? rows / 64 * BwdImg<D>::Q_STAGE : rows * D), 1,
      o + r.side.start * osn, 0, osh, osn, delta + rows, r.bx, h, 0, H);
}

// Sequence s's keys and column-statistics chunks.
struct PackedChunks {
  int k0, nk, c0, nchunk;
};
__device__ __forceinline__ PackedChunks packed_chunks(const int* __restrict__ meta, int S, int s) {
  const int n1 = S + 1;
  PackedChunks c;
  c.k0 = __ldg(meta + n1 + s);
  c.nk = __ldg(meta + n1 + s + 1) - c.k0;
  c.c0 = __ldg(meta + 4 * n1 + s);
  c.nchunk = __ldg(meta + 4 * n1 + s + 1) - c.c0;
  return c;
}

// column_finish_body for block i of S * H (sequence i / H, head i % H): part (H * chunks, d) in the packed chunk
// layout, out (S, H, d). A sequence without keys gets 0 (no smoothing; V's scale 0, its codes 0).
template <bool ABSMAX>
__device__ __forceinline__ void packed_finish(const typename StatAcc<ABSMAX>::type* __restrict__ part, int d,
                                              float* __restrict__ out, const int* __restrict__ meta, int S, int H,
                                              int i) {
  const int s = i / H, h = i - s * H;
  const PackedChunks c = packed_chunks(meta, S, s);
  float* o = out + static_cast<long long>(s) * H * d;
  if (c.nk == 0) {
    o[h * d + threadIdx.x] = 0.f;
    return;
  }
  column_finish_body<ABSMAX>(part + static_cast<long long>(H) * c.c0 * d, c.nchunk, c.nk, d, o, h);
}

}  // namespace sage

// meta's offsets (int8/packed.cuh) from the caller's cu_seqlens (element strides sq, sk): one CTA of 1024 threads,
// 1024 offsets per step. Each offset is clamped to [0, total] and raised to the largest before it (a decrease
// becomes an empty sequence), so that the kernels stay inside the arrays whatever the offsets hold.
__global__ void __launch_bounds__(1024) packed_offsets(const int* __restrict__ cu_q, long long sq,
                                                       const int* __restrict__ cu_k, long long sk, int S, int total_q,
                                                       int total_k, int* __restrict__ meta) {
  __shared__ int red[32], cur[2][1024], carry[5];
  const int n1 = S + 1, t = threadIdx.x;
  if (t < 5) carry[t] = 0;  // the last clamped q and k offsets, and the three sums, of the steps before
  __syncthreads();
  for (int base = 0; base < n1; base += 1024) {
    const int i = base + t;
    const bool in = i < n1;
    int cq = in ? min(max(cu_q[i * sq], 0), total_q) : 0;
    int ck = in ? min(max(cu_k[i * sk], 0), total_k) : 0;
    cq = max(block_scan_1024(cq, red, ScanMax()), carry[0]);
    ck = max(block_scan_1024(ck, red, ScanMax()), carry[1]);
    cur[0][t] = cq;
    cur[1][t] = ck;
    __syncthreads();
    // the lengths of sequence i - 1 (none before offset 0)
    const int lq = in && i > 0 ? cq - (t ? cur[0][t - 1] : carry[0]) : 0;
    const int lk = in && i > 0 ? ck - (t ? cur[1][t - 1] : carry[1]) : 0;
    const int pq = block_scan_1024((lq + PACK_PAD - 1) / PACK_PAD * PACK_PAD, red, ScanAdd()) + carry[2];
    const int pk = block_scan_1024((lk + PACK_PAD - 1) / PACK_PAD * PACK_PAD, red, ScanAdd()) + carry[3];
    const int pc = block_scan_1024((lk + PACK_CHUNK - 1) / PACK_CHUNK, red, ScanAdd()) + carry[4];
    if (in) {
      meta[i] = cq;
      meta[n1 + i] = ck;
      meta[2 * n1 + i] = pq;
      meta[3 * n1 + i] = pk;
      meta[4 * n1 + i] = pc;
    }
    __syncthreads();  // every thread has read carry and cur
    if (t == 1023) {
      carry[0] = cq;
      carry[1] = ck;
      carry[2] = pq;
      carry[3] = pk;
      carry[4] = pc;
    }
    __syncthreads();
  }
}

// meta's tables: entry e of blk_q (e < nbq), blk_k (the next nbk) and chk (the next nchk), the sequence whose padded
// rows (chunks) hold it, found by binary search in pad_q, pad_k, pad_c. grid ceil((nbq + nbk + nchk) / 256), block 256.
__global__ void __launch_bounds__(256) packed_tables(int* __restrict__ meta, int S, int nbq, int nbk, int nchk) {
  const int e = blockIdx.x * 256 + threadIdx.x, n1 = S + 1;
  if (e >= nbq + nbk + nchk) return;
  const int sec = e < nbq ? 2 : e < nbq + nbk ? 3 : 4;  // pad_q, pad_k, pad_c
  const long long pos = sec == 2 ? static_cast<long long>(e) * PACK_BLOCK
                        : sec == 3 ? static_cast<long long>(e - nbq) * PACK_BLOCK : e - nbq - nbk;
  const int* pad = meta + sec * n1;
  int lo = 0, hi = S;  // the last s with pad[s] <= pos (pad[0] = 0); s = S: past the last sequence
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (pad[mid] <= pos) lo = mid;
    else hi = mid - 1;
  }
  meta[packed_tq(S) + e] = lo < S ? lo : -1;
}

// ---- column statistics: partials per chunk of the sequence (column_partial_body), then per (sequence, head) ----

// K's channel sums (z = 0) and V's channel maxima (z = 1). grid (chunk bound, H, 2), block 256; parts (H * chunks, D)
// in the packed chunk layout.
template <typename T, int D>
__global__ void __launch_bounds__(256, kStatMinCtas)
column_partial_kv_packed(const T* __restrict__ k, long long ksh, long long ksn, const T* __restrict__ v, long long vsh,
                         long long vsn, double* __restrict__ part_k, float* __restrict__ part_v,
                         const int* __restrict__ meta, int S, int nbq, int nbk) {
  grid_dep_wait();
  grid_dep_launch_dependents();
  const int s = __ldg(meta + packed_tq(S) + nbq + nbk + blockIdx.x);
  if (s < 0) return;
  const PackedChunks c = packed_chunks(meta, S, s);
  const int H = gridDim.y, h = blockIdx.y, chunk = blockIdx.x - c.c0;
  const long long off = static_cast<long long>(H) * c.c0 * D;
  __shared__ StatRed<D> red;
  if (blockIdx.z == 0)
    column_partial_body<T, D, false>(k + c.k0 * ksn, 0, ksh, ksn, c.nk, part_k + off, chunk, h, 0, H, c.nchunk, red);
  else
    column_partial_body<T, D, true>(v + c.k0 * vsn, 0, vsh, vsn, c.nk, part_v + off, chunk, h, 0, H, c.nchunk, red);
}

// One statistic: K's mean (ABSMAX false) or V's psi scale. grid (chunk bound, H, 1), block 256.
template <typename T, int D, bool ABSMAX>
__global__ void __launch_bounds__(256, 1)
column_partial_packed(const T* __restrict__ x, long long sh, long long sn,
                      typename StatAcc<ABSMAX>::type* __restrict__ part, const int* __restrict__ meta, int S, int nbq,
                      int nbk) {
  const int s = __ldg(meta + packed_tq(S) + nbq + nbk + blockIdx.x);
  if (s < 0) return;
  const PackedChunks c = packed_chunks(meta, S, s);
  const int H = gridDim.y;
  __shared__ StatRed<D, typename StatAcc<ABSMAX>::type> red;
  column_partial_body<T, D, ABSMAX>(x + c.k0 * sn, 0, sh, sn, c.nk, part + static_cast<long long>(H) * c.c0 * D,
                                    blockIdx.x - c.c0, blockIdx.y, 0, H, c.nchunk, red);
}

// mu_k and v_scale (S, H, d) from column_partial_kv_packed's parts. grid (2 S H), block d.
__global__ void column_finish_kv_packed(const double* __restrict__ part_k, const float* __restrict__ part_v, int d,
                                        float* __restrict__ mu_k, float* __restrict__ v_scale,
                                        const int* __restrict__ meta, int S, int H) {
  grid_dep_wait();
  grid_dep_launch_dependents();
  const int sh = S * H, i = blockIdx.x;
  if (i < sh) packed_finish<false>(part_k, d, mu_k, meta, S, H, i);
  else packed_finish<true>(part_v, d, v_scale, meta, S, H, i - sh);
}

// out (S, H, d) from column_partial_packed's part. grid (S H), block d.
template <bool ABSMAX>
__global__ void column_finish_packed(const typename StatAcc<ABSMAX>::type* __restrict__ part, int d,
                                     float* __restrict__ out, const int* __restrict__ meta, int S, int H) {
  packed_finish<ABSMAX>(part, d, out, meta, S, H, blockIdx.x);
}

// ---- Q, K, V quantization (quant_rows_qk, quant_qkv, quant_rows, quant_transpose_perm, fwd_v_image) ----

// grid (max(nbq, nbk), Hq + Hkv, 1) with 64-row CTAs.
template <typename T, int D, int RPW>
__global__ void __launch_bounds__(256, kQrowsQkMinCtas)
quant_rows_qk_packed(const T* __restrict__ q, long long qsh, long long qsn, float q_mult,
                     signed char* __restrict__ q_codes, float* __restrict__ q_scales, float q_scale_mult,
                     float* __restrict__ qmk, const T* __restrict__ k, long long ksh, long long ksn,
                     signed char* __restrict__ k_codes, float* __restrict__ k_scales, const float* __restrict__ mu_k,
                     int Hq, int Hkv, char* __restrict__ kv_img, const int* __restrict__ meta, int S, int nbq,
                     int nbk) {
  const int y = blockIdx.y, rows = 8 * RPW;
  const bool kside = y >= Hq;
  const PackedRows r = packed_rows(meta, S, nbq, nbk, kside, blockIdx.x, rows);
  if (r.s < 0) return;
  if (!kside)
    packed_quant_rows<T, D, RPW, false, true>(q, qsh, qsn, r, Hq, nullptr, 1, q_mult, q_codes, q_scales, q_scale_mult,
                                              mu_k, Hq / Hkv, q_mult, qmk, y, nullptr);
  else
    packed_quant_rows<T, D, RPW, false, false>(k, ksh, ksn, r, Hkv, mu_k, 1, 1.f, k_codes, k_scales, 1.f, nullptr, 1,
                                               0.f, nullptr, y - Hq, kv_img);
}

// quant_rows_qk_packed and fwd_v_image_packed in one launch (D = 128). grid (max(nbq, nbk), Hq + 2 Hkv, 1).
template <typename T, int D, int RPW, int MODE>
__global__ void __launch_bounds__(256, kQrowsQkMinCtas)
quant_qkv_packed(const T* __restrict__ q, long long qsh, long long qsn, float q_mult, signed char* __restrict__ q_codes,
                 float* __restrict__ q_scales, float q_scale_mult, float* __restrict__ qmk, const T* __restrict__ k,
                 long long ksh, long long ksn, signed char* __restrict__ k_codes, float* __restrict__ k_scales,
                 const float* __restrict__ mu_k, int Hq, int Hkv, char* __restrict__ kv_img, const T* __restrict__ v,
                 long long vsh, long long vsn, const float* __restrict__ v_scale_in, float* __restrict__ v_scale_out,
                 const int* __restrict__ meta, int S, int nbq, int nbk) {
  static_assert(2 * D == 256 && 8 * RPW == 64, "V's 64-token blocks on 256 threads, 64 Q / K rows per CTA");
  grid_dep_wait();
  grid_dep_launch_dependents();
  const int y = blockIdx.y;
  const bool kside = y >= Hq;
  const PackedRows r = packed_rows(meta, S, nbq, nbk, kside, blockIdx.x, 64);
  if (r.s < 0) return;
  if (!kside)
    packed_quant_rows<T, D, RPW, false, true>(q, qsh, qsn, r, Hq, nullptr, 1, q_mult, q_codes, q_scales, q_scale_mult,
                                              mu_k, Hq / Hkv, q_mult, qmk, y, nullptr);
  else if (y < Hq + Hkv)
    packed_quant_rows<T, D, RPW, false, false>(k, ksh, ksn, r, Hkv, mu_k, 1, 1.f, k_codes, k_scales, 1.f, nullptr, 1,
                                               0.f, nullptr, y - Hq, kv_img);
  else
    packed_v_block<T, D, MODE, 2>(v, vsh, vsn, r, Hkv, v_scale_in, v_scale_out, reinterpret_cast<signed char*>(kv_img),
                                  1, y - Hq - Hkv);
}

// quant_rows on one axis (kside: K's rows, else Q's; table blk_k or blk_q). grid (bound / (8 RPW), H, 1).
template <typename T, int D, int RPW, bool GROUPED>
__global__ void __launch_bounds__(256, 1)
quant_rows_packed(const T* __restrict__ x, long long sh, long long sn, const float* __restrict__ mu, int mu_group,
                  float mult, signed char* __restrict__ codes, float* __restrict__ scales, float scale_mult,
                  const float* __restrict__ dot_vec, int dot_group, float dot_mult, float* __restrict__ dot,
                  char* __restrict__ kv_img, int kside, const int* __restrict__ meta, int S, int nbq, int nbk) {
  const PackedRows r = packed_rows(meta, S, nbq, nbk, kside != 0, blockIdx.x, 8 * RPW);
  if (r.s < 0) return;
  packed_quant_rows<T, D, RPW, GROUPED, false>(x, sh, sn, r, gridDim.y, mu, mu_group, mult, codes, scales, scale_mult,
                                               dot_vec, dot_group, dot_mult, dot, blockIdx.y, kv_img);
}

// V^^T codes (mma.sync engine): quant_transpose_perm. grid (nbk, Hkv, 1), block 2 D.
template <typename T, int D, int MODE>
__global__ void __launch_bounds__(2 * D)
quant_transpose_perm_packed(const T* __restrict__ x, long long sh, long long sn, const float* __restrict__ scale_in,
                            float* __restrict__ scale_out, signed char* __restrict__ out, int tile_major,
                            const int* __restrict__ meta, int S, int nbq, int nbk) {
  const PackedRows r = packed_rows(meta, S, nbq, nbk, true, blockIdx.x, 64);
  if (r.s < 0) return;
  packed_v_block<T, D, MODE, 0>(x, sh, sn, r, gridDim.y, scale_in, scale_out, out, tile_major, blockIdx.y);
}

// V into the wgmma forward's K/V stage images: fwd_v_image. grid (nbk, Hkv, 1), block 2 D.
template <typename T, int D, int MODE>
__global__ void __launch_bounds__(2 * D, 1)
fwd_v_image_packed(const T* __restrict__ x, long long sh, long long sn, const float* __restrict__ scale_in,
                   float* __restrict__ scale_out, char* __restrict__ kv_img, const int* __restrict__ meta, int S,
                   int nbq, int nbk) {
  const PackedRows r = packed_rows(meta, S, nbq, nbk, true, blockIdx.x, 64);
  if (r.s < 0) return;
  packed_v_block<T, D, MODE, 2>(x, sh, sn, r, gridDim.y, scale_in, scale_out, reinterpret_cast<signed char*>(kv_img),
                                1, blockIdx.y);
}

// The 16-bit V images of the forward with pv_int8=False (fwd_v16_image) for a packed sequence's 64-key block, in the
// packed padded layout (the sequence's (H, n_pad) blocks from row H * pad0). grid (nbk, Hkv, 1), block 256.
template <typename T, int D>
__global__ void __launch_bounds__(256)
fwd_v16_image_packed(const T* __restrict__ v, long long vsh, long long vsn, char* __restrict__ out,
                     const int* __restrict__ meta, int S, int nbq, int nbk) {
  const PackedRows r = packed_rows(meta, S, nbq, nbk, true, blockIdx.x, 64);
  if (r.s < 0) return;
  const int h = blockIdx.y, H = gridDim.y;
  const long long blocks = (static_cast<long long>(H) * r.side.pad0 + static_cast<long long>(h) * r.side.n_pad) / 64;
  store_rows_k128<T, D>(out + (blocks + r.bx) * (128 * D), v + static_cast<long long>(r.side.start) * vsn + h * vsh,
                        vsn, r.bx * 64, r.side.n);
}

// ---- the backward's pre-passes ----

// dO^T codes, scales and delta (mma.sync engine): quant_transpose_perm_delta. grid (nbq, Hq, 1), block 2 D.
template <typename T, int D, int MODE>
__global__ void __launch_bounds__(2 * D, 1)
quant_transpose_perm_delta_packed(const T* __restrict__ x, long long sh, long long sn, float* __restrict__ scale_out,
                                  signed char* __restrict__ out, const T* __restrict__ o, long long osh, long long osn,
                                  float* __restrict__ delta, const int* __restrict__ meta, int S, int nbq, int nbk) {
  const PackedRows r = packed_rows(meta, S, nbq, nbk, false, blockIdx.x, 64);
  if (r.s < 0) return;
  packed_do_block<T, D, MODE, 0>(x, sh, sn, r, gridDim.y, scale_out, out, o, osh, osn, delta, blockIdx.y);
}

// dO's parts of the query-side stage images (wgmma engine): bwd_do_image. grid (nbq, Hq, 1), block 2 D.
template <typename T, int D, int MODE>
__global__ void __launch_bounds__(2 * D, 1)
bwd_do_image_packed(const T* __restrict__ x, long long sh, long long sn, char* __restrict__ q_img,
                    const T* __restrict__ o, long long osh, long long osn, float* __restrict__ delta,
                    const int* __restrict__ meta, int S, int nbq, int nbk) {
  const PackedRows r = packed_rows(meta, S, nbq, nbk, false, blockIdx.x, 64);
  if (r.s < 0) return;
  packed_do_block<T, D, MODE, 1>(x, sh, sn, r, gridDim.y, nullptr, reinterpret_cast<signed char*>(q_img), o, osh,
                                 osn, delta, blockIdx.y);
}

// bwd_do16_image: dO and delta only (ds_int8=False). grid (nbq, Hq, 1), block 2 D.
template <typename T, int D>
__global__ void __launch_bounds__(2 * D, 1)
bwd_do16_image_packed(const T* __restrict__ x, long long sh, long long sn, char* __restrict__ q_img,
                      const T* __restrict__ o, long long osh, long long osn, float* __restrict__ delta,
                      const int* __restrict__ meta, int S, int nbq, int nbk) {
  const PackedRows r = packed_rows(meta, S, nbq, nbk, false, blockIdx.x, 64);
  if (r.s < 0) return;
  packed_do_block<T, D, 1, 3>(x, sh, sn, r, gridDim.y, nullptr, reinterpret_cast<signed char*>(q_img), o, osh, osn,
                              delta, blockIdx.y);
}

// delta alone (mma.sync engine, dv_int8=False): bwd_delta. grid (nbq, Hq, 1), block 2 D.
template <typename T, int D>
__global__ void __launch_bounds__(2 * D, 1)
bwd_delta_packed(const T* __restrict__ x, long long sh, long long sn, const T* __restrict__ o, long long osh,
                 long long osn, float* __restrict__ delta, const int* __restrict__ meta, int S, int nbq, int nbk) {
  const PackedRows r = packed_rows(meta, S, nbq, nbk, false, blockIdx.x, 64);
  if (r.s < 0) return;
  packed_do_block<T, D, 1, 4>(x, sh, sn, r, gridDim.y, nullptr, nullptr, o, osh, osn, delta, blockIdx.y);
}

// Q^T and K^T codes, tile-major (mma.sync engine): transpose_i8_qk. grid (max(nbq, nbk), Hq + Hkv, 1), block 256.
template <int D, bool PERM>
__global__ void transpose_i8_qk_packed(const signed char* __restrict__ qc, signed char* __restrict__ qt,
                                       const signed char* __restrict__ kc, signed char* __restrict__ kt, int Hq,
                                       int Hkv, const int* __restrict__ meta, int S, int nbq, int nbk) {
  const int y = blockIdx.y;
  const bool kside = y >= Hq;
  const PackedRows r = packed_rows(meta, S, nbq, nbk, kside, blockIdx.x, 64);
  if (r.s < 0) return;
  const long long off = static_cast<long long>(kside ? Hkv : Hq) * r.side.pad0 * D;
  transpose_i8_body<D, PERM>((kside ? kc : qc) + off, r.side.n_pad, (kside ? kt : qt) + off, r.bx,
                             kside ? y - Hq : y);
}

// The backward's stage images from the forward's residuals (wgmma engine): bwd_qk_images. grid (max(nbq, nbk),
// Hq + Hkv, 1), block 256.
template <typename T, int D, bool DS16>
__global__ void __launch_bounds__(256)
bwd_qk_images_packed(const signed char* __restrict__ qc, const float* __restrict__ qs, const float* __restrict__ lse2,
                     char* __restrict__ q_img, const signed char* __restrict__ kc, const float* __restrict__ ks,
                     const T* __restrict__ v, long long vsh, long long vsn, char* __restrict__ k_img, int Hq, int Hkv,
                     const int* __restrict__ meta, int S, int nbq, int nbk) {
  using Img = BwdImg<D, DS16>;
  const int y = blockIdx.y;
  const bool kside = y >= Hq;
  const PackedRows r = packed_rows(meta, S, nbq, nbk, kside, blockIdx.x, 64);
  if (r.s < 0) return;
  if (!kside) {
    const long long rows = static_cast<long long>(Hq) * r.side.pad0;
    bwd_qk_images_body<T, D, DS16>(qc + rows * D, qs + rows, lse2 + rows, r.side.n_pad,
                                   q_img + rows / 64 * Img::Q_STAGE, nullptr, nullptr, 0, nullptr, 0, 0, 0, 0,
                                   nullptr, Hq, Hkv, r.bx, y, 0);
  } else {
    const long long rows = static_cast<long long>(Hkv) * r.side.pad0;
    bwd_qk_images_body<T, D, DS16>(nullptr, nullptr, nullptr, 0, nullptr, kc + rows * D, ks + rows, r.side.n_pad,
                                   v + r.side.start * vsn, 0, vsh, vsn, r.side.n, k_img + rows / 64 * Img::K_STAGE,
                                   Hq, Hkv, r.bx, y, 0);
  }
}
