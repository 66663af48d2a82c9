// Packed variable-length sequences (layout "THD", docs/algorithms.md §1.8) in the INT8 kernels: the per-call table
// the first two pre-pass kernels write (int8_quant_packed.cu: packed_offsets, packed_tables) and the lookup every
// packed kernel starts with.
//
// The quantized buffers hold each sequence as the dense layouts hold one batch entry: sequence s is an
// (H, n_pad_s, ...) block at row H * pad(s) of an (H * T_pad, ...) buffer, where n_pad_s is its length rounded up to
// 128 (the dense padding) and pad(s) the sum of the n_pad of the sequences before it. A packed kernel finds its
// sequence, moves its base pointers to that sequence's block (and the caller's arrays to its first row), and runs the
// dense body with b = 0 and the sequence's lengths: its codes, scales, statistics and outputs are then bitwise those
// of a batch-1 dense call on the sequence alone.
//
// meta (int32): cu_q[S + 1] | cu_k[S + 1] | pad_q[S + 1] | pad_k[S + 1] | pad_c[S + 1] | blk_q | blk_k | chk
//   cu_q, cu_k      the caller's prefix sums, each clamped to [0, total] and made non-decreasing (a running max), so
//                   that offsets the host did not read cannot move a kernel outside the arrays
//   pad_q, pad_k    prefix sums of the lengths rounded up to PACK_PAD: rows of the padded buffers
//   pad_c           prefix sums of ceil(nk / PACK_CHUNK): the K/V column statistics' chunks
//   blk_q, blk_k    for each PACK_BLOCK rows of the padded q (k) axis, the sequence that holds them; chk for each
//                   chunk; -1 past the last sequence
// The host sizes the tables and the grids by bounds it knows without reading the offsets (docs/design.md, "Packed
// sequences"): total + (PACK_PAD - 1) S padded rows, ceil(total / PACK_CHUNK) + S chunks.
#pragma once
#include "common/rows.cuh"

namespace sage {

constexpr int PACK_PAD = 128;    // a sequence's padding (int8.py _FWD_BQ, _FWD_BKV)
constexpr int PACK_BLOCK = 64;   // padded rows per table entry: every packed CTA covers 32, 64 or 128 of them
constexpr int PACK_CHUNK = 256;  // tokens per column-statistics chunk (int8_quant.cu STAT_CHUNK)

struct PackedSeq {
  int q0, nq, qp, nq_pad;  // first row in the caller's q, length; first padded row, padded length
  int k0, nk, kp, nk_pad;  // the same for k and v
};

__device__ __forceinline__ PackedSeq packed_seq(const int* __restrict__ meta, int S, int s) {
  const int n1 = S + 1;
  PackedSeq p;
  p.q0 = __ldg(meta + s);
  p.nq = __ldg(meta + s + 1) - p.q0;
  p.k0 = __ldg(meta + n1 + s);
  p.nk = __ldg(meta + n1 + s + 1) - p.k0;
  p.qp = __ldg(meta + 2 * n1 + s);
  p.nq_pad = __ldg(meta + 2 * n1 + s + 1) - p.qp;
  p.kp = __ldg(meta + 3 * n1 + s);
  p.nk_pad = __ldg(meta + 3 * n1 + s + 1) - p.kp;
  return p;
}

// Where meta's tables start: blk_q, then blk_k (nbq entries later), then chk (nbk entries after that).
__device__ __forceinline__ int packed_tq(int S) { return 5 * (S + 1); }

// The sequence of padded row `row` of the q (kside = 0) or k axis, or -1: past the last sequence, or past the table
// (grids that cover both axes run to the longer table).
__device__ __forceinline__ int packed_seq_of(const int* __restrict__ meta, int S, int nbq, int nbk, bool kside,
                                             long long row) {
  const int e = static_cast<int>(row / PACK_BLOCK);
  if (e >= (kside ? nbk : nbq)) return -1;
  return __ldg(meta + packed_tq(S) + (kside ? nbq : 0) + e);
}

// One axis of sequence s: its first row in the caller's array, its length, its first padded row and padded length.
struct PackedSide {
  int start, n, pad0, n_pad;
};
__device__ __forceinline__ PackedSide packed_side(const int* __restrict__ meta, int S, int s, bool kside) {
  const int n1 = S + 1, c = kside ? n1 : 0, p = (kside ? 3 : 2) * n1;
  PackedSide r;
  r.start = __ldg(meta + c + s);
  r.n = __ldg(meta + c + s + 1) - r.start;
  r.pad0 = __ldg(meta + p + s);
  r.n_pad = __ldg(meta + p + s + 1) - r.pad0;
  return r;
}

// A query block found at padded row qb.q0 of the q axis, in the sequence whose block starts at padded row qp: its first
// row within the sequence, and b = 0 (the caller moves its base pointers to the sequence).
__device__ __forceinline__ void packed_rebase(QueryBlock& qb, int qp, int Hq, int Hkv) {
  qb.q0 -= qp;
  qb.b = 0;
  qb.bh = qb.h;
  qb.bhk = qb.h / (Hq / Hkv);
}

// The kernels' window for one sequence, as the host's kernel_window gives it for a dense call of that sequence: a
// side that reaches past the sequence bounds no row and is -1 (the host clamped it against the totals only).
__device__ __forceinline__ void packed_window(int& left, int& right, int nq, int nk) {
  if (left >= nk) left = -1;
  if (right >= nq) right = -1;
}

// A query-side CTA's sequence (grid x over the padded q axis): false past the last one; else qb rebased into it, the
// lengths, window and diagonal offset (bottom-right per sequence) set to the sequence's, and its entry p and index s.
__device__ __forceinline__ bool packed_query_seq(const int* __restrict__ meta, int S, QueryBlock& qb, int Hq, int Hkv,
                                                 int& nq, int& nk, int& nq_pad, int& nk_pad, Window& win, int& shift,
                                                 PackedSeq& p, int& s) {
  s = packed_seq_of(meta, S, gridDim.x, 0, false, qb.q0);
  if (s < 0) return false;
  p = packed_seq(meta, S, s);
  packed_rebase(qb, p.qp, Hq, Hkv);
  nq = p.nq, nk = p.nk, nq_pad = p.nq_pad, nk_pad = p.nk_pad;
  packed_window(win.left, win.right, nq, nk);
  shift = nk - nq;
  return true;
}

}  // namespace sage
