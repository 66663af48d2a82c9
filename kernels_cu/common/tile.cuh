// Shared-memory tile helpers: XOR-swizzled addressing of int8/fp16 tiles whose rows are 64 or
// 128 (or 256) bytes, so that ldmatrix over 8 consecutive rows of one 16-byte column is
// bank-conflict free, and cp.async loaders for such tiles.
#pragma once
#include "common/mma.cuh"

namespace sage {

// Byte offset of 16-byte chunk `c` of row `r` in a tile whose rows are ROW_BYTES long.
template <int ROW_BYTES>
__device__ __forceinline__ int swz(int r, int c) {
  constexpr int CPR = ROW_BYTES / 16;  // chunks per row
  static_assert(CPR == 4 || CPR == 8 || CPR == 16, "row of 64, 128 or 256 bytes");
  const int pc = (CPR == 4) ? (c ^ ((r >> 1) & 3)) : (c ^ (r & 7));
  return r * ROW_BYTES + pc * 16;
}

// f(i) for the 16-byte chunks i = tid, tid + NTHREADS, ... < TOTAL of a tile copy. UNROLL: fully unrolled
// (no loop branches: the wgmma forward, where it costs no registers) or the loop (the default: in the
// mma.sync and backward kernels the unrolled form raised registers and spills).
template <int TOTAL, int NTHREADS, bool UNROLL, typename F>
__device__ __forceinline__ void for_each_chunk(int tid, F&& f) {
  static_assert(TOTAL % NTHREADS == 0, "whole passes");
  if constexpr (UNROLL) {
#pragma unroll
    for (int j = 0; j < TOTAL / NTHREADS; ++j) f(tid + j * NTHREADS);
  } else {
#pragma unroll
    for (int i = tid; i < TOTAL; i += NTHREADS) f(i);
  }
}

// Copy ROWS x ROW_BYTES from global (row stride `gstride` bytes) into a swizzled shared tile.
template <int ROWS, int ROW_BYTES, int NTHREADS, bool UNROLL = false>
__device__ __forceinline__ void load_tile_async(char* smem, const char* gmem, long long gstride, int tid) {
  constexpr int CPR = ROW_BYTES / 16;
  for_each_chunk<ROWS * CPR, NTHREADS, UNROLL>(tid, [&](int i) {
    const int r = i / CPR, c = i % CPR;
    cp_async_16(smem_u32(smem + swz<ROW_BYTES>(r, c)), gmem + r * gstride + c * 16);
  });
}

// As load_tile_async, for rows of a strided tensor: rows >= valid_rows are zero-filled.
template <int ROWS, int ROW_BYTES, int NTHREADS, bool UNROLL = false>
__device__ __forceinline__ void load_rows_async(char* smem, const char* gmem, long long gstride, int valid_rows, int tid) {
  constexpr int CPR = ROW_BYTES / 16;
  for_each_chunk<ROWS * CPR, NTHREADS, UNROLL>(tid, [&](int i) {
    const int r = i / CPR, c = i % CPR;
    const bool ok = r < valid_rows;
    cp_async_16_zfill(smem_u32(smem + swz<ROW_BYTES>(r, c)), gmem + (ok ? r * gstride + c * 16 : 0), ok);
  });
}

// The same copies as load_tile_async / load_rows_async, for loops that copy a tile of the same shape every
// iteration: the per-thread addressing is computed once. K128 = true stores the layout 16-bit wgmma operands
// read (K-major, 128-byte swizzle): the rows are cut into 128-byte pieces and piece a of every row forms its
// own swizzled ROWS x 128 tile at smem + a * ROWS * 128 (64 elements of K per piece; the tile must be
// 1024-byte aligned).
// Thread tid copies chunks tid + j * NTHREADS; each pass j covers RPP = NTHREADS / CPR whole rows, a multiple
// of the swizzles' 8-row period, so pass j is pass 0 shifted by j * RPP rows in both memories (one address
// add per chunk instead of a division, a swizzle and a multiply: the copies were ~1/3 of the wgmma
// backward's instructions).
template <int ROWS, int ROW_BYTES, int NTHREADS, bool K128 = false>
struct TileCopy {
  static constexpr int CPR = ROW_BYTES / 16, PASSES = ROWS * CPR / NTHREADS, RPP = NTHREADS / CPR;
  static constexpr int SROW = K128 ? 128 : ROW_BYTES;  // shared-memory bytes between consecutive rows
  static_assert(NTHREADS % CPR == 0 && (ROWS * CPR) % NTHREADS == 0 && RPP % 8 == 0, "whole passes of 8-row groups");
  static_assert(!K128 || ROW_BYTES % 128 == 0, "whole 128-byte pieces");
  int soff, r0, goff;
  __device__ __forceinline__ explicit TileCopy(int tid) {
    r0 = tid / CPR;
    const int c = tid % CPR;
    goff = c * 16;
    soff = K128 ? (c / 8) * ROWS * 128 + swz<128>(r0, c % 8) : swz<ROW_BYTES>(r0, c);
  }
  __device__ __forceinline__ void copy(char* smem, const char* gmem, long long gstride) const {
    const unsigned s = smem_u32(smem) + soff;
    const char* g = gmem + r0 * gstride + goff;
#pragma unroll
    for (int j = 0; j < PASSES; ++j) cp_async_16(s + j * RPP * SROW, g + j * RPP * gstride);
  }
  // Rows >= valid_rows are zero-filled.
  __device__ __forceinline__ void copy_rows(char* smem, const char* gmem, long long gstride, int valid_rows) const {
    const unsigned s = smem_u32(smem) + soff;
    const char* g = gmem + r0 * gstride + goff;
#pragma unroll
    for (int j = 0; j < PASSES; ++j) {
      const bool ok = r0 + j * RPP < valid_rows;
      cp_async_16_zfill(s + j * RPP * SROW, ok ? g + j * RPP * gstride : gmem, ok);
    }
  }
  // copy_rows with a branch: a whole tile (valid_rows >= ROWS: all but a sequence's last) takes copy()'s path,
  // without copy_rows' predicate and select per chunk. Measured on the INT8 dQ kernel's per-tile V copy: 1.02-1.06x
  // on that kernel; on the dK/dV kernel's per-stage dO copy 0.97-1.02x, so that one keeps copy_rows
  // (docs/experiments.md, E-I8B-COPYROWS).
  __device__ __forceinline__ void copy_rows_split(char* smem, const char* gmem, long long gstride,
                                                  int valid_rows) const {
    if (valid_rows >= ROWS)
      copy(smem, gmem, gstride);
    else
      copy_rows(smem, gmem, gstride, valid_rows);
  }
};

// Copy n4 * 16 bytes (n4 <= NTHREADS) from global to shared, both 16-byte aligned: a tile's per-row scales.
template <int NTHREADS>
__device__ __forceinline__ void load_vec_async(void* smem, const void* gmem, int n4, int tid) {
  if (tid < n4) cp_async_16(smem_u32(static_cast<char*>(smem) + 16 * tid), static_cast<const char*>(gmem) + 16 * tid);
}

// ldmatrix.x4 over a swizzled tile: matrices (rows r0..r0+7, chunk c0), (r0..+7, c0+1),
// (r0+8..+15, c0), (r0+8..+15, c0+1) when ROW_MAJOR_K is false (the B-operand / "n" order:
// results b0,b1 of n-tile r0/8 then b0,b1 of n-tile r0/8+1), or (r0..+7, c0), (r0+8..+15, c0),
// (r0..+7, c0+1), (r0+8..+15, c0+1) when true (the A-operand order a0..a3).
template <int ROW_BYTES, bool A_ORDER>
__device__ __forceinline__ void ldsm_x4(unsigned (&r)[4], const char* smem, int r0, int c0, int lane) {
  const int mi = lane >> 3, ri = lane & 7;
  int row, chunk;
  if (A_ORDER) {
    row = r0 + ri + (mi & 1) * 8;
    chunk = c0 + (mi >> 1);
  } else {
    row = r0 + ri + (mi >> 1) * 8;
    chunk = c0 + (mi & 1);
  }
  ldmatrix_x4(r, smem_u32(smem + swz<ROW_BYTES>(row, chunk)));
}

// ldmatrix.x4.trans over a swizzled b16 tile, same addressing as ldsm_x4<ROW_BYTES, A_ADDR>. Uses:
// * A_ADDR = true on a tile stored [k][n] (k rows): the B operand (b0, b1 of n-tile c0, then of c0 + 1)
//   of a product whose B is that tile, k16 chunk starting at row r0;
// * A_ADDR = false on a tile stored [k][m]: the A operand a0..a3 of rows (m) c0*8..c0*8+15, k16 chunk at r0.
template <int ROW_BYTES, bool A_ADDR>
__device__ __forceinline__ void ldsm_x4_trans(unsigned (&r)[4], const char* smem, int r0, int c0, int lane) {
  const int mi = lane >> 3, ri = lane & 7;
  int row, chunk;
  if (A_ADDR) {
    row = r0 + ri + (mi & 1) * 8;
    chunk = c0 + (mi >> 1);
  } else {
    row = r0 + ri + (mi >> 1) * 8;
    chunk = c0 + (mi & 1);
  }
  ldmatrix_x4_trans(r, smem_u32(smem + swz<ROW_BYTES>(row, chunk)));
}

// int32 products of a warp's 16 x KB A fragments a[KB / 32] (k = KB bytes: m16n8k32 steps) with 16 columns
// dp*16 .. dp*16 + 15 of a tile stored [n][KB k bytes] (swizzled KB-byte rows): acc[0] columns +0..7,
// acc[1] +8..15, zeroed first. A_UNSIGNED: A holds u8 codes (P), else s8.
template <bool A_UNSIGNED, int KB = 64>
__device__ __forceinline__ void mma_a64_tile16(int (&acc)[2][4], const unsigned (&a)[KB / 32][4], const char* tile,
                                               int dp, int lane) {
#pragma unroll
  for (int j = 0; j < 2; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0;
#pragma unroll
  for (int kst = 0; kst < KB / 32; ++kst) {
    unsigned bt[4];
    ldsm_x4<KB, false>(bt, tile, dp * 16, 2 * kst, lane);
    const unsigned b0[2] = {bt[0], bt[1]}, b1[2] = {bt[2], bt[3]};
    if constexpr (A_UNSIGNED) {
      mma_u8s8(acc[0], a[kst], b0);
      mma_u8s8(acc[1], a[kst], b1);
    } else {
      mma_s8s8(acc[0], a[kst], b0);
      mma_s8s8(acc[1], a[kst], b1);
    }
  }
}

// acc (a warp's 16 rows x D, fp32 accumulator tiles) += A (16 x 64: a[kk] the A operand of k16 chunk kk) * B, B a
// 64 x D tile of T stored [k][d] in shared memory (2 D-byte rows: read with transposed ldmatrix).
template <typename T, int D>
__device__ __forceinline__ void mma_acc_a64(float (&acc)[D / 8][4], const unsigned (&a)[4][4], const char* sB,
                                            int lane) {
#pragma unroll
  for (int dp = 0; dp < D / 16; ++dp) {
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
      unsigned b[4];
      ldsm_x4_trans<2 * D, true>(b, sB, kk * 16, 2 * dp, lane);
      const unsigned b0[2] = {b[0], b[1]}, b1[2] = {b[2], b[3]};
      mma_f16<T>(acc[2 * dp], a[kk], b0);
      mma_f16<T>(acc[2 * dp + 1], a[kk], b1);
    }
  }
}

}  // namespace sage
