// Pieces every kernel that owns a block of query rows shares: which (batch, head, rows) a CTA owns, which
// 64-key tiles those rows see, and the store of a warp's fp32 accumulator rows in the caller's layout.
#pragma once
#include "common/numeric.cuh"

namespace sage {

// The CTA's query block: grid (n_blocks, Hq, B); causal grids run the heavy (late) blocks first (the INT8 kernels
// also for windows of the causal work shape, Window::causal_shape).
// G > 1 (causal grids only): the grid is dispatched in groups of G (batch, head) pairs, each group's blocks heaviest
// first across its G heads (block n-1 of the G heads, then block n-2, ...), so the grid ends on light blocks of many
// heads instead of on all the blocks of one head, heavy ones included, and the CTAs that run together read the K/V of
// up to G heads. A bijection of the grid: every CTA computes the same rows, so results do not change. The INT8 wgmma
// forward uses G = 16 (FWD_CAUSAL_GROUP in int8/fwd.cuh; docs/experiments.md); G = 1 everywhere else.
struct QueryBlock {
  int q0, h, b;
  long long bh, bhk;  // (b, h) and (b, kv head of h) flattened
};
template <int G = 1>
__device__ __forceinline__ QueryBlock query_block(int rows, bool causal, int Hq, int Hkv) {
  QueryBlock qb;
  if constexpr (G == 1) {
    const int blk = causal ? (gridDim.x - 1 - blockIdx.x) : blockIdx.x;
    qb.q0 = blk * rows;
    qb.h = blockIdx.y;
    qb.b = blockIdx.z;
  } else {
    int blk = blockIdx.x;
    qb.h = blockIdx.y;
    qb.b = blockIdx.z;
    if (causal) {  // linear dispatch index -> (group, rank in the group) -> (block, head pair)
      const int nblk = gridDim.x, bh_count = gridDim.y * gridDim.z;
      const int lin = blockIdx.x + nblk * (blockIdx.y + gridDim.y * blockIdx.z);
      const int g = lin / (G * nblk), r = lin - g * G * nblk;
      const int gs = min(G, bh_count - g * G);  // the last group may be smaller
      blk = nblk - 1 - r / gs;
      const int bh = g * G + r % gs;
      qb.h = bh % gridDim.y;
      qb.b = bh / gridDim.y;
    }
    qb.q0 = blk * rows;
  }
  qb.bh = static_cast<long long>(qb.b) * Hq + qb.h;
  qb.bhk = static_cast<long long>(qb.b) * Hkv + qb.h / (Hq / Hkv);
  return qb;
}

// Which TILE-key tiles (64 unless said) rows q0 .. q0 + bq - 1 visit, and from which one on they need the
// mask. A block of padding rows only (q0 >= nq: the row padding is a multiple of 128, blocks may be 64)
// visits none.
constexpr int KEY_TILE = 64;
struct KeyTiles {
  int n, first_masked;
};
template <int TILE = KEY_TILE>
__device__ __forceinline__ KeyTiles key_tiles(int q0, int bq, int nq, int nk, bool causal) {
  const int shift = nk - nq;  // bottom-right causal: row i sees key j iff j <= i + shift
  KeyTiles t{q0 < nq ? (nk + TILE - 1) / TILE : 0, nk / TILE};  // first_masked: the partial tail
  if (causal) {
    const int last_key = min(q0 + bq - 1, nq - 1) + shift;  // largest key any real row sees
    t.n = last_key < 0 ? 0 : min(t.n, last_key / TILE + 1);
    const int min_row_key = q0 + shift;  // keys beyond this need the mask for some row
    t.first_masked = min(t.first_masked, min_row_key < 0 ? 0 : (min_row_key + 1) / TILE);
  }
  return t;
}

// A sliding window (docs/algorithms.md §1.8): row i sees key j iff i + shift - left <= j <= i + shift + right, with
// shift = nk - nq (bottom-right aligned) and -1 leaving a side unbounded. Causal is (-1, 0), full attention (-1, -1).
// The host passes a side at least as wide as the sequence as -1, so the sums below stay far from int overflow.
struct Window {
  int left, right;
  // Blocks of later rows see more keys (an unbounded left edge, a bounded right one): the causal work shape, which
  // query_block dispatches heaviest first.
  __device__ __forceinline__ bool causal_shape() const { return left < 0 && right >= 0; }
  // The keys lo .. hi row `row` sees, keys >= nk excluded (none when hi < lo): two registers per row for a mask
  // that tests both edges and the sequence's end.
  __device__ __forceinline__ int2 keys(int row, int shift, int nk) const {
    return make_int2(left >= 0 ? row + shift - left : 0, right >= 0 ? min(nk - 1, row + shift + right) : nk - 1);
  }
  // keys() of a row that may lie past nq (none then): the dQ kernels' mask, bounds computed once per row so that a
  // masked element costs two compares and no branch (a per-element test of both edges made the backward kernels
  // 8-11 % slower, unmasked tiles included; docs/experiments.md E-I8B-WINMASK).
  __device__ __forceinline__ int2 row_keys(int row, int shift, int nq, int nk) const {
    return row < nq ? keys(row, shift, nk) : make_int2(0, -1);
  }
  // The query rows lo .. hi that see key `key`, rows >= nq excluded, none when key >= nk (hi < lo): the dK/dV
  // kernels' mask, as row_keys for the dQ kernels.
  __device__ __forceinline__ int2 rows(int key, int shift, int nq, int nk) const {
    return key < nk ? make_int2(right >= 0 ? key - shift - right : 0,
                                left >= 0 ? min(nq - 1, key - shift + left) : nq - 1)
                    : make_int2(0, -1);
  }
  // Whether row `row` must not see key `key` (keys >= nk and rows >= nq are the caller's tests).
  __device__ __forceinline__ bool hides(int row, int key, int shift) const {
    return (right >= 0 && key > row + shift + right) || (left >= 0 && key < row + shift - left);
  }
  // Whether some pair of rows q0 .. q0 + bq - 1 and keys k0 .. k0 + bk - 1 is hidden (the tile needs the mask).
  __device__ __forceinline__ bool crosses(int q0, int bq, int k0, int bk, int shift) const {
    return (right >= 0 && k0 + bk - 1 > q0 + shift + right) || (left >= 0 && k0 < q0 + bq - 1 + shift - left);
  }
};

// key_tiles for a window: the rows' tiles are first .. n - 1 (a bounded left edge skips the tiles before the first
// key the block's first row sees), and tiles below masked_below cross the lower edge for some row, as tiles from
// first_masked on cross the upper one (or hold the partial tail). With Window{-1, 0} it is key_tiles(.., true),
// with Window{-1, -1} key_tiles(.., false), field for field (first = masked_below = 0).
struct KeyRange {
  int first, n, first_masked, masked_below;
  __device__ __forceinline__ bool need_mask(int tile) const { return tile >= first_masked || tile < masked_below; }
};
// key_range with the diagonal offset given: row i sees key j iff i + shift - left <= j <= i + shift + right. A block
// of a longer sequence (a query run starting at global position qs against a key run at ks, global lengths Nq, Nk;
// sagecupy/context_parallel.py) has shift = qs - ks + Nk - Nq; a whole sequence has nk - nq (the overload below).
template <int TILE = KEY_TILE>
__device__ __forceinline__ KeyRange key_range(int q0, int bq, int nq, int nk, Window w, int shift) {
  KeyRange t{0, 0, nk / TILE, 0};  // first_masked: the partial tail
  if (q0 >= nq) return t;          // padding rows only: no tile
  const int last_row = min(q0 + bq - 1, nq - 1);
  const int lo = w.left >= 0 ? max(0, q0 + shift - w.left) : 0;                  // first key any real row sees
  const int hi = w.right >= 0 ? min(nk - 1, last_row + shift + w.right) : nk - 1;  // and the last
  if (hi < lo) return t;  // no real row sees a key
  t.first = lo / TILE;
  t.n = hi / TILE + 1;
  if (w.right >= 0) {
    const int min_row_key = q0 + shift + w.right;  // keys beyond this need the mask for some row
    t.first_masked = min(t.first_masked, min_row_key < 0 ? 0 : (min_row_key + 1) / TILE);
  }
  if (w.left >= 0) {
    const int max_row_key = last_row + shift - w.left;  // keys below this need the mask for some row
    t.masked_below = max_row_key <= 0 ? 0 : (max_row_key + TILE - 1) / TILE;
  }
  return t;
}
template <int TILE = KEY_TILE>
__device__ __forceinline__ KeyRange key_range(int q0, int bq, int nq, int nk, Window w) {
  return key_range<TILE>(q0, bq, nq, nk, w, nk - nq);
}

// The mirror for a block of keys k0 .. (the dK/dV kernels): the bq-row query tiles first .. n - 1 see them (causal:
// from the first row that sees key k0), for each of the kv head's `group` query heads: per_head tiles, iters pairs.
struct QueryTiles {
  int first, n, per_head, iters;
};
__device__ __forceinline__ QueryTiles query_tiles(int k0, int bq, int nq, int nk, bool causal, int group) {
  const int first_row = causal ? max(0, k0 - (nk - nq)) : 0;
  QueryTiles t;
  t.first = first_row / bq;
  t.n = (nq + bq - 1) / bq;
  t.per_head = max(0, t.n - t.first);
  t.iters = group * t.per_head;
  return t;
}

// query_tiles for a window and a block of bk keys k0 .. (k0 < nk): the query tiles from the one of the first row
// that sees key k0 (a bounded right edge) to the one of the last row that sees the block's last key (a bounded left
// edge). With Window{-1, 0} it is query_tiles(.., true, ..), with Window{-1, -1} query_tiles(.., false, ..). shift: as
// key_range's (nk - nq for a whole sequence).
__device__ __forceinline__ QueryTiles query_tiles(int k0, int bk, int bq, int nq, int nk, Window w, int group,
                                                  int shift) {
  const int k1 = min(k0 + bk - 1, nk - 1);
  const int first_row = w.right >= 0 ? max(0, k0 - shift - w.right) : 0;
  const int last_row = w.left >= 0 ? min(nq - 1, k1 - shift + w.left) : nq - 1;
  QueryTiles t;
  t.first = first_row / bq;
  t.n = last_row / bq + 1;
  t.per_head = first_row > last_row ? 0 : t.n - t.first;
  t.iters = group * t.per_head;
  return t;
}
__device__ __forceinline__ QueryTiles query_tiles(int k0, int bk, int bq, int nq, int nk, Window w, int group) {
  return query_tiles(k0, bk, bq, nq, nk, w, group, nk - nq);
}

// dst[row, col] = acc * mult in T for this thread's rows r_lo, r_lo + 8 (those < n) of a 16 x D
// accumulator tile (mma layout: acc[nt][2r + j] is row r_lo + 8r, column 8nt + 2t4 + j).
template <typename T, int D>
__device__ __forceinline__ void store_acc_rows(T* __restrict__ dst, long long row_stride, const float (&acc)[D / 8][4],
                                               int r_lo, int t4, int n, float mult) {
#pragma unroll
  for (int nt = 0; nt < D / 8; ++nt) {
    const int col = nt * 8 + 2 * t4;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = r_lo + 8 * r;
      if (row < n)
        *reinterpret_cast<unsigned*>(dst + row * row_stride + col) =
            pack2<T>(acc[nt][2 * r] * mult, acc[nt][2 * r + 1] * mult);
    }
  }
}

}  // namespace sage
