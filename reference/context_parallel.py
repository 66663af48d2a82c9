"""Context parallelism in float64: one attention call split into blocks over ranks (docs/algorithms.md §9 in code).

A sequence is cut into *chunks* of query rows and of keys. Each of ``R`` ranks owns a *Q shard* (its query
chunks) and a *K/V block* (its key chunks, with their values). Attention of a Q shard against one K/V block
gives a *partial* output and LSE over those keys only; partials over disjoint key sets merge exactly through
their LSEs (:func:`merge_partials`), so the merge of every block equals the single call. The backward of a
block takes the *global* LSE and ``δ = rowsum(dO ∘ O)`` (of the merged forward) and gives that block's share of
dQ, dK, dV; the shares sum to the single call's gradients.

Pieces
------
* Plans: :func:`contiguous_plan`, :func:`zigzag_plan` (:class:`ShardPlan`), :func:`chunk_bounds`,
  :func:`zigzag_chunks`, :func:`sagebwd_alignment`, :func:`rank_work`.
* Masks in global positions: :func:`pair_mask`, :func:`pair_visible` (bottom-right aligned, §1.4, §1.8).
* The merge: :func:`merge_partials`, :func:`merge_all`.
* Exact attention by blocks: :func:`exact_block_forward`, :func:`exact_block_backward`, :func:`row_delta`.
* The SageBwd simulator by blocks: :func:`block_statistics` and :func:`reduce_statistics` (the whole-sequence
  statistics, reduced as an all-reduce would), :func:`sagebwd_quantize_q`, :func:`sagebwd_quantize_kv`,
  :func:`sagebwd_block_forward`, :func:`sagebwd_block_backward`.
* The ring, simulated in one process: :func:`ring_forward`, :func:`ring_backward`.

Conventions: block arrays are HND, ``q`` ``(B, Hq, n, D)`` and ``k, v`` ``(B, Hkv, m, D)`` (GQA as in
``attention.py``); ``q_pos``, ``k_pos`` are the rows' and keys' global positions (strictly increasing) and
``Nq``, ``Nk`` the global lengths, which the bottom-right causal alignment needs. LSEs are ``(B, Hq, n)``,
natural log, ``−inf`` for a row that sees no key of the block.

SageBwd blocks compute the function of the single call only if they cut its tiles nowhere: every run of
consecutive positions must start on a multiple of :func:`sagebwd_alignment` and end on one or at the end of the
sequence. Then every tile statistic (the forward's P tiles, the block granularities, the backward's
``bwd_block_q × bwd_block_kv`` tiles with their column and row scales) covers the same entries as in the single
call, and the only statistics that span more than a tile are the two that :func:`reduce_statistics` makes global:
K-smoothing's mean over all keys and V's per-channel scale.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import numbers

import numpy as np

from sagecupy.config import DEFAULT, get_config

from . import sagebwd as _sb
from .attention import (
    as_float64,
    check_layout,
    check_qkv,
    expand_kv_heads,
    from_hnd,
    kv_head_index,
    masked_softmax,
    resolve_sm_scale,
    resolve_window,
    sum_kv_groups,
    to_hnd,
)

__all__ = [
    "ShardPlan",
    "chunk_bounds",
    "zigzag_chunks",
    "contiguous_plan",
    "zigzag_plan",
    "sagebwd_alignment",
    "rank_work",
    "pair_mask",
    "pair_visible",
    "merge_partials",
    "merge_all",
    "row_delta",
    "exact_block_forward",
    "exact_block_backward",
    "block_statistics",
    "reduce_statistics",
    "sagebwd_quantize_q",
    "sagebwd_quantize_kv",
    "sagebwd_block_forward",
    "sagebwd_block_backward",
    "ring_forward",
    "ring_backward",
]


# ----------------------------------------------------------------------------
# plans
# ----------------------------------------------------------------------------


def _positive_int(value, name: str) -> int:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"{name}={value!r} must be a positive integer")
    return int(value)


@dataclasses.dataclass(frozen=True)
class ShardPlan:
    """Which query rows and keys each rank owns.

    ``q_chunks[r]`` and ``k_chunks[r]`` are rank ``r``'s chunks as ``(start, stop)`` ranges of global positions
    (possibly empty); over all ranks the chunks partition ``[0, Nq)`` and ``[0, Nk)``. ``kind`` is
    ``"contiguous"`` or ``"zigzag"``.
    """

    kind: str
    ranks: int
    Nq: int
    Nk: int
    q_chunks: tuple
    k_chunks: tuple

    def q_positions(self, rank: int) -> np.ndarray:
        """Rank ``rank``'s query rows, increasing (int64)."""
        return _positions(self.q_chunks[rank])

    def k_positions(self, rank: int) -> np.ndarray:
        """Rank ``rank``'s keys, increasing (int64)."""
        return _positions(self.k_chunks[rank])


def _positions(chunks) -> np.ndarray:
    parts = [np.arange(a, b, dtype=np.int64) for a, b in sorted(chunks)]
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


def chunk_bounds(n: int, parts: int, align: int = 1) -> tuple:
    """``parts`` consecutive ``(start, stop)`` chunks covering ``[0, n)``, every boundary a multiple of ``align``
    (or ``n``): the ``ceil(n / align)`` tiles are dealt out as evenly as possible, the last chunks taking one
    more when they do not divide (the last tile may be partial, so sizes then differ by at most ``align``); a
    chunk gets none (is empty) when there are fewer tiles than chunks."""
    n = _positive_int(n, "n")
    parts = _positive_int(parts, "parts")
    align = _positive_int(align, "align")
    tiles = -(-n // align)
    counts = [tiles // parts + (c >= parts - tiles % parts) for c in range(parts)]
    edges = np.minimum(np.concatenate([[0], np.cumsum(counts)]) * align, n)
    return tuple((int(edges[c]), int(edges[c + 1])) for c in range(parts))


def zigzag_chunks(ranks: int) -> tuple:
    """The chunk indices of each rank in the zig-zag plan: ``2R`` chunks, rank ``r`` holds ``r`` and
    ``2R − 1 − r`` (an early and a late chunk, so that under a causal mask every rank sees as many keys)."""
    R = _positive_int(ranks, "ranks")
    return tuple((r, 2 * R - 1 - r) for r in range(R))


def contiguous_plan(Nq: int, Nk: int, ranks: int, *, align_q: int = 1, align_k: int = 1) -> ShardPlan:
    """Rank ``r`` owns the ``r``-th of ``R`` consecutive chunks of the queries and of the keys."""
    R = _positive_int(ranks, "ranks")
    qb, kb = chunk_bounds(Nq, R, align_q), chunk_bounds(Nk, R, align_k)
    return ShardPlan("contiguous", R, int(Nq), int(Nk), tuple((qb[r],) for r in range(R)),
                     tuple((kb[r],) for r in range(R)))


def zigzag_plan(Nq: int, Nk: int, ranks: int, *, align_q: int = 1, align_k: int = 1) -> ShardPlan:
    """Load-balanced causal sharding: queries and keys each cut into ``2R`` chunks (:func:`chunk_bounds`), rank
    ``r`` owning chunks ``r`` and ``2R − 1 − r`` of both (:func:`zigzag_chunks`)."""
    R = _positive_int(ranks, "ranks")
    qb, kb = chunk_bounds(Nq, 2 * R, align_q), chunk_bounds(Nk, 2 * R, align_k)
    ids = zigzag_chunks(R)
    return ShardPlan("zigzag", R, int(Nq), int(Nk), tuple(tuple(qb[c] for c in ids[r]) for r in range(R)),
                     tuple(tuple(kb[c] for c in ids[r]) for r in range(R)))


def sagebwd_alignment(config=DEFAULT) -> tuple:
    """``(align_q, align_k)``: the multiples on which a SageBwd block may start or end without cutting a tile.

    Query rows: the backward's ``bwd_block_q`` row tiles (dO's scales, the column scales of P and of the
    folded dS), and ``block_q`` when Q is quantized or smoothed per block. Keys: the forward's ``block_kv`` P
    tiles (also K's and V's blocks) and the backward's ``bwd_block_kv`` column tiles.
    """
    cfg = get_config(config)
    q_blocks = cfg.q_granularity == "block" or cfg.q_smoothing
    return math.lcm(cfg.bwd_block_q, cfg.block_q if q_blocks else 1), math.lcm(cfg.block_kv, cfg.bwd_block_kv)


def make_plan(plan, Nq: int, Nk: int, ranks: int, align=(1, 1), unit: str = "ranks",
              where: str = "the call") -> ShardPlan:
    """``plan`` as given to the ring and context-parallel calls: ``"zigzag"`` or ``"contiguous"`` (built for ``ranks``
    with chunks aligned to ``align = (align_q, align_k)``), or a :class:`ShardPlan`, checked to be for ``ranks`` and
    to cover the sequence without cutting an aligned tile. ``unit`` and ``where`` word the error of a plan for another
    count ("plan is for 3 ranks but the process group has 2")."""
    if isinstance(plan, str):
        build = {"zigzag": zigzag_plan, "contiguous": contiguous_plan}.get(plan)
        if build is None:
            raise ValueError(f"plan={plan!r} must be 'zigzag', 'contiguous' or a ShardPlan")
        return build(Nq, Nk, ranks, align_q=align[0], align_k=align[1])
    if not isinstance(plan, ShardPlan):
        raise TypeError(f"plan must be 'zigzag', 'contiguous' or a ShardPlan, got {type(plan).__name__}")
    if plan.ranks != ranks:
        raise ValueError(f"plan is for {plan.ranks} {unit} but {where} has {ranks}")
    return _check_plan(plan, Nq, Nk, *align)


def _check_plan(plan, Nq: int, Nk: int, align_q: int = 1, align_k: int = 1) -> ShardPlan:
    if not isinstance(plan, ShardPlan):
        raise TypeError(f"plan must be a ShardPlan (contiguous_plan, zigzag_plan), got {type(plan).__name__}")
    if (plan.Nq, plan.Nk) != (Nq, Nk):
        raise ValueError(f"the plan is for Nq={plan.Nq}, Nk={plan.Nk}, the inputs have Nq={Nq}, Nk={Nk}")
    if len(plan.q_chunks) != plan.ranks or len(plan.k_chunks) != plan.ranks:
        raise ValueError(f"the plan must give each of its {plan.ranks} ranks its query and key chunks")
    for side, chunks, n, align in (("query", plan.q_chunks, Nq, align_q), ("key", plan.k_chunks, Nk, align_k)):
        spans = sorted((a, b) for rank in chunks for a, b in rank if b > a)
        covered = np.zeros(n, dtype=np.int64)
        for a, b in spans:
            if a < 0 or b > n:
                raise ValueError(f"the plan's {side} chunk ({a}, {b}) is outside [0, {n})")
            covered[a:b] += 1
        if not np.all(covered == 1):
            raise ValueError(f"the plan's {side} chunks must cover [0, {n}) exactly once")
        bad = [(a, b) for a, b in spans if a % align or (b % align and b != n)]
        if bad:
            raise ValueError(f"the plan's {side} chunk {bad[0]} cuts a tile: SageBwd blocks must start and end on "
                             f"multiples of {align} (sagebwd_alignment; build the plan with align_q/align_k)")
    return plan


def rank_work(plan: ShardPlan, *, causal=False, window=None) -> np.ndarray:
    """int64 ``(R,)``: the (query, key) pairs each rank's Q shard attends to over the whole ring, the measure
    of its share of the work (the zig-zag plan evens it out under a causal mask)."""
    left, right = resolve_window(causal, window)
    i = np.arange(plan.Nq) + (plan.Nk - plan.Nq)
    hi = np.full(plan.Nq, plan.Nk - 1) if right == -1 else np.minimum(plan.Nk - 1, i + right)
    lo = np.zeros(plan.Nq, dtype=np.int64) if left == -1 else np.maximum(0, i - left)
    per_row = np.maximum(0, hi - lo + 1)
    return np.array([per_row[plan.q_positions(r)].sum() for r in range(plan.ranks)], dtype=np.int64)


# ----------------------------------------------------------------------------
# masks in global positions
# ----------------------------------------------------------------------------


def _check_pos(pos, n_rows: int, N: int, name: str) -> np.ndarray:
    arr = np.asarray(pos)
    if arr.dtype.kind not in "iu" or arr.ndim != 1:
        raise ValueError(f"{name} must be a 1-D integer array of global positions, got dtype {arr.dtype} and "
                         f"shape {arr.shape}")
    if arr.size != n_rows:
        raise ValueError(f"{name} has {arr.size} positions for {n_rows} rows")
    arr = arr.astype(np.int64)
    if arr.size and (arr[0] < 0 or arr[-1] >= N or np.any(np.diff(arr) <= 0)):
        raise ValueError(f"{name} must be strictly increasing positions in [0, {N})")
    return arr


def pair_mask(q_pos, k_pos, Nq: int, Nk: int, causal=False, window=None) -> np.ndarray:
    """Boolean ``(len(q_pos), len(k_pos))``: True where global query row ``q_pos[a]`` may see global key
    ``k_pos[b]`` in a call of lengths ``Nq, Nk``. The rule of ``attention.visible_mask`` (causal and windows
    bottom-right aligned, §1.4, §1.8) in global positions: ``pair_mask(arange(Nq), arange(Nk), ...)`` is
    ``visible_mask(Nq, Nk, ...)``."""
    Nq, Nk = _positive_int(Nq, "Nq"), _positive_int(Nk, "Nk")
    qp = _check_pos(q_pos, np.size(q_pos), Nq, "q_pos")
    kp = _check_pos(k_pos, np.size(k_pos), Nk, "k_pos")
    left, right = resolve_window(causal, window)
    i = qp[:, None] + (Nk - Nq)
    j = kp[None, :]
    mask = np.ones((qp.size, kp.size), dtype=bool)
    if right != -1:
        mask &= j <= i + right
    if left != -1:
        mask &= j >= i - left
    return mask


def pair_visible(q_range, k_range, Nq: int, Nk: int, causal=False, window=None) -> bool:
    """Whether any row of the query chunk ``q_range = (a, b)`` sees any key of ``k_range`` (``pair_mask(...).any()``
    in O(1)): the keys some row of a run of consecutive rows sees form one interval, each row's being its
    neighbour's shifted by one. A pair that is not visible is skipped; it would add nothing (§1.8)."""
    (qa, qb), (ka, kb) = q_range, k_range
    if qb <= qa or kb <= ka:
        return False
    left, right = resolve_window(causal, window)
    shift = Nk - Nq
    lo = ka if left == -1 else max(ka, qa + shift - left)
    hi = kb - 1 if right == -1 else min(kb - 1, qb - 1 + shift + right)
    return lo <= hi


# ----------------------------------------------------------------------------
# the LSE merge
# ----------------------------------------------------------------------------


def merge_partials(o_a, lse_a, o_b, lse_b):
    """``(o, lse)`` of attention over the union of two disjoint key sets, from the partials over each.

    ``o_*`` ``(..., n, D)`` are each normalized over its own keys, ``lse_*`` ``(..., n)`` their LSEs. Exactly::

        lse = log(e^{lse_a} + e^{lse_b})        o = e^{lse_a − lse} o_a + e^{lse_b − lse} o_b

    Numerics (float64 here, fp32 in a kernel): with ``hi = max(lse_a, lse_b)``, ``lo = min`` and
    ``x = e^{lo − hi}`` in ``[0, 1]`` (no overflow, whatever the LSEs), ``lse = hi + log1p(x)`` and the weights
    are ``1 / (1 + x)`` and ``x / (1 + x)``: each within a few units of rounding of its exact value *relatively*,
    however large ``|lse|`` is (``e^{lse_a − lse}`` from a rounded ``lse`` would carry an error of ``u·|lse|``). So
    one merge adds at most a few ``u`` (unit roundoff) to each element relative to ``w_a|o_a| + w_b|o_b|``, and
    ``u·|lse| + 2u`` to the LSE. Merging is commutative bit for bit and associative up to that rounding. A partial
    whose row saw no key (``lse = −inf``, ``o = 0``) leaves the other unchanged bit for bit (``x = 0``); two such
    give ``o = 0``, ``lse = −inf``. A NaN in either LSE gives NaN.
    """
    lse_a, lse_b = np.asarray(lse_a, np.float64), np.asarray(lse_b, np.float64)
    o_a, o_b = np.asarray(o_a, np.float64), np.asarray(o_b, np.float64)
    if lse_a.shape != lse_b.shape or o_a.shape != o_b.shape or o_a.shape[:-1] != lse_a.shape:
        raise ValueError(f"the partials must have matching shapes (o (..., n, D), lse (..., n)), got o "
                         f"{o_a.shape} and {o_b.shape}, lse {lse_a.shape} and {lse_b.shape}")
    hi = np.maximum(lse_a, lse_b)
    lo = np.minimum(lse_a, lse_b)
    seen = hi != -np.inf
    hi_safe = np.where(seen, hi, 0.0)                 # (no −inf − −inf)
    x = np.exp(lo - hi_safe)                          # e^{lo − hi} in [0, 1]; 0 where lo = −inf
    lse = np.where(seen, hi_safe + np.log1p(x), -np.inf)
    w_hi, w_lo = 1.0 / (1.0 + x), x / (1.0 + x)
    a_hi = lse_a >= lse_b
    w_a, w_b = np.where(a_hi, w_hi, w_lo), np.where(a_hi, w_lo, w_hi)
    return w_a[..., None] * o_a + w_b[..., None] * o_b, lse


def merge_all(partials):
    """Fold :func:`merge_partials` over ``[(o, lse), ...]`` from the left (the order a ring meets its blocks)."""
    partials = list(partials)
    if not partials:
        raise ValueError("merge_all needs at least one partial")
    return functools.reduce(lambda acc, p: merge_partials(*acc, *p), partials[1:], partials[0])


# ----------------------------------------------------------------------------
# exact attention by blocks
# ----------------------------------------------------------------------------


def row_delta(do, o) -> np.ndarray:
    """``δ = rowsum(dO ∘ O)`` ``(..., n)`` from the rows' *global* (merged) output: the one per-row input of a
    block backward besides the global LSE (§1.7); the same expression as the simulators'."""
    return np.sum(np.asarray(do, np.float64) * np.asarray(o, np.float64), axis=-1)


def _block_args(q, k, v, q_pos, k_pos, Nq, Nk, causal, window):
    B, Hq, Hkv, n, m, D = check_qkv(q, k, v, "HND")
    Nq, Nk = _positive_int(Nq, "Nq"), _positive_int(Nk, "Nk")
    qp = _check_pos(q_pos, n, Nq, "q_pos")
    kp = _check_pos(k_pos, m, Nk, "k_pos")
    mask = pair_mask(qp, kp, Nq, Nk, causal, window)
    return (B, Hq, Hkv, n, m, D), mask


def _exact_scores(qh, kh, scale, mask):
    return np.where(mask, scale * np.matmul(qh, np.swapaxes(kh, -1, -2)), -np.inf)


def exact_block_forward(q, k, v, q_pos, k_pos, Nq: int, Nk: int, *, causal=False, sm_scale=None, window=None):
    """Exact attention of the rows ``q`` against the keys ``k, v`` only: the partial ``(o, lse)``, HND float64.

    ``o`` is normalized over the block's visible keys; a row that sees none gets ``o = 0``, ``lse = −inf``
    (``masked_softmax``), which the merge ignores. Merged over blocks that partition the keys
    (:func:`merge_all`), the partials give ``attention_forward``'s ``(o, lse)`` up to float64 rounding.
    """
    (B, Hq, Hkv, n, m, D), mask = _block_args(q, k, v, q_pos, k_pos, Nq, Nk, causal, window)
    scale = resolve_sm_scale(sm_scale, D)
    qh = as_float64(q, "q")
    kh, vh = expand_kv_heads(as_float64(k, "k"), Hq), expand_kv_heads(as_float64(v, "v"), Hq)
    with np.errstate(under="ignore"):
        p, _, _, lse = masked_softmax(_exact_scores(qh, kh, scale, mask))
    return np.matmul(p, vh), lse


def exact_block_backward(q, k, v, do, lse, delta, q_pos, k_pos, Nq: int, Nk: int, *, causal=False, sm_scale=None,
                         window=None):
    """The block's share ``(dq, dk, dv)`` of the exact gradients, from the rows' *global* ``lse`` and ``delta``.

    ``P = exp(S − lse)`` over the block's keys is the global softmax restricted to them, so ``dS = P ∘ (dP − δ)``
    is the block of the global dS and the shares sum (dq over key blocks, dk and dv over Q shards) to
    ``attention_backward``'s gradients. ``dk, dv`` ``(B, Hkv, m, D)`` are summed over each GQA group. Rows whose
    LSE is not finite see nothing (``P = 0``), as in ``attention_backward``.
    """
    (B, Hq, Hkv, n, m, D), mask = _block_args(q, k, v, q_pos, k_pos, Nq, Nk, causal, window)
    scale = resolve_sm_scale(sm_scale, D)
    qh, doh = as_float64(q, "q"), as_float64(do, "do")
    kh, vh = expand_kv_heads(as_float64(k, "k"), Hq), expand_kv_heads(as_float64(v, "v"), Hq)
    lse64, delta64 = as_float64(lse, "lse"), as_float64(delta, "delta")
    if doh.shape != qh.shape or lse64.shape != (B, Hq, n) or delta64.shape != (B, Hq, n):
        raise ValueError(f"do must have q's shape {qh.shape}, lse and delta {(B, Hq, n)}; got {doh.shape}, "
                         f"{lse64.shape}, {delta64.shape}")
    row_ok = np.isfinite(lse64)
    lse_safe = np.where(row_ok, lse64, 0.0)
    with np.errstate(under="ignore"):
        p = np.where(row_ok[..., None], np.exp(_exact_scores(qh, kh, scale, mask) - lse_safe[..., None]), 0.0)
    dv = sum_kv_groups(np.matmul(np.swapaxes(p, -1, -2), doh), Hkv)
    ds = p * (np.matmul(doh, np.swapaxes(vh, -1, -2)) - delta64[..., None])
    dq = scale * np.matmul(ds, kh)
    dk = sum_kv_groups(scale * np.matmul(np.swapaxes(ds, -1, -2), qh), Hkv)
    return dq, dk, dv


# ----------------------------------------------------------------------------
# SageBwd by blocks: global statistics
# ----------------------------------------------------------------------------


def block_statistics(k, v, *, config=DEFAULT) -> dict:
    """One K/V block's partials of the statistics SageBwd takes over the whole sequence (HND ``(B, Hkv, m, D)``).

    ``"k_sum"`` ``(B, Hkv, D)``: Σ of K over the block's keys (K-smoothing's mean is a sum over all keys by a
    count); ``"k_count"``: the number of keys ``m``; ``"v_amax"`` ``(B, Hkv, D)``: max|V| per channel (V's
    per-channel scale is that max over all keys by 127). A statistic the config does not use is None. An empty
    block (``m = 0``) gives zeros, the identity of both reductions.
    """
    cfg = get_config(config)
    kh, vh = as_float64(k, "k"), as_float64(v, "v")
    if kh.ndim != 4 or kh.shape != vh.shape:
        raise ValueError(f"k and v must be HND (B, Hkv, m, D) of one shape, got {kh.shape} and {vh.shape}")
    B, H, m, D = kh.shape
    out = {"k_sum": None, "k_count": int(m), "v_amax": None}
    if cfg.k_smoothing:
        out["k_sum"] = kh.sum(axis=-2)
    if cfg.v_granularity == "channel":
        out["v_amax"] = np.abs(vh).max(axis=-2) if m else np.zeros((B, H, D))
    return out


def reduce_statistics(parts) -> dict:
    """The all-reduce of :func:`block_statistics` over the blocks that partition the keys: sums and counts
    added (in the order given), maxima taken. Adds ``"mu_k"`` ``= k_sum / k_count``, the global K mean.

    The max is exact in any order, so ``v_amax`` (hence V's codes and scales) is the single call's bit for bit.
    ``mu_k`` is the single call's (``mean`` is also a float64 sum divided by the count) whenever the float64
    partial sums are exact, which holds for fp16 inputs: every fp16 value is a multiple of 2⁻²⁴, so any sum of
    them below 2²⁹ in magnitude (``Nk · max|k| <= 2²⁹``, e.g. 2M keys of ``|k| <= 256``) is exact in float64 in
    any order. Otherwise (bf16 with a wide exponent range, float64 inputs) the two means differ by float64
    rounding, which K's float32 mean (§3.1) absorbs unless it lies within that rounding of a float32 tie.
    """
    parts = list(parts)
    if not parts:
        raise ValueError("reduce_statistics needs the statistics of at least one block")
    for key in ("k_sum", "v_amax"):
        if len({p[key] is None for p in parts}) != 1:
            raise ValueError(f"the blocks disagree on whether {key!r} is used (one config for every block)")
    count = sum(int(p["k_count"]) for p in parts)
    k_sum = None if parts[0]["k_sum"] is None else functools.reduce(np.add, (p["k_sum"] for p in parts))
    v_amax = None if parts[0]["v_amax"] is None else functools.reduce(np.maximum, (p["v_amax"] for p in parts))
    if k_sum is not None and count < 1:
        raise ValueError("the blocks hold no key: there is no K mean")
    return {"k_sum": k_sum, "k_count": count, "v_amax": v_amax,
            "mu_k": None if k_sum is None else k_sum / count}


def _stand_in(B: int, H: int, D: int) -> np.ndarray:
    """One zero row: ``quantize_inputs`` quantizes q and k, v together, and this stands for the side not wanted."""
    return np.zeros((B, H, 1, D))


def sagebwd_quantize_q(q, *, sm_scale=None, config=DEFAULT, dtype=None) -> dict:
    """A Q shard's SageBwd operands (HND ``(B, Hq, n, D)``; ``sagebwd.quantize_inputs``): ``"q"`` (float64),
    ``"q_codes"``, ``"q_scale"``, ``"mu_q"``, with ``"sm_scale"``, ``"config"`` and ``"dtype"`` (the inputs' 16-bit
    type, as ``sagebwd.forward``'s: q's own when None). Q has no statistic over the whole sequence (per token, per
    ``block_q`` rows), so nothing global is needed; its rows must start on a multiple of
    ``sagebwd_alignment(config)[0]``."""
    cfg = get_config(config)
    dtype = _sb._dtype16(dtype, q)
    qh = as_float64(q, "q")
    if qh.ndim != 4:
        raise ValueError(f"q must be HND (B, Hq, n, D), got shape {qh.shape}")
    B, Hq, _, D = qh.shape
    stand = _stand_in(B, 1, D)
    qi = _sb.quantize_inputs(qh, stand, stand, sm_scale=sm_scale, config=cfg)
    return {"q": qh, "q_codes": qi["q_codes"], "q_scale": qi["q_scale"], "mu_q": qi["mu_q"],
            "sm_scale": qi["sm_scale"], "config": cfg, "dtype": dtype}


def sagebwd_quantize_kv(k, v, statistics, *, sm_scale=None, config=DEFAULT) -> dict:
    """A K/V block's SageBwd operands with the sequence's ``statistics`` (:func:`reduce_statistics`; HND ``(B,
    Hkv, m, D)``): ``"k"``, ``"v"`` (float64), ``"k_codes"``, ``"k_scale"``, ``"v_codes"``, ``"v_scale"``,
    ``"mu_k"`` (as the single call keeps it: float32-rounded when its pre-pass is), ``"ks"`` (``K − μ_K``,
    for the Q-smoothing bias; None without it), ``"sm_scale"``, ``"config"``. With the global statistics these
    are the single call's operands of these keys bit for bit (``mu_k`` under :func:`reduce_statistics`'s
    condition)."""
    cfg = get_config(config)
    kh, vh = as_float64(k, "k"), as_float64(v, "v")
    if kh.ndim != 4 or kh.shape != vh.shape:
        raise ValueError(f"k and v must be HND (B, Hkv, m, D) of one shape, got {kh.shape} and {vh.shape}")
    if not isinstance(statistics, dict) or not {"mu_k", "v_amax"} <= set(statistics):
        raise TypeError("statistics must be the dict of reduce_statistics (the K/V quantization depends on them)")
    B, Hkv, _, D = kh.shape
    qi = _sb.quantize_inputs(_stand_in(B, Hkv, D), kh, vh, sm_scale=sm_scale, config=cfg,
                             mu_k=statistics["mu_k"], v_amax=statistics["v_amax"])
    mu_k = qi["mu_k"]
    return {"k": kh, "v": vh, "k_codes": qi["k_codes"], "k_scale": qi["k_scale"], "v_codes": qi["v_codes"],
            "v_scale": qi["v_scale"], "mu_k": mu_k, "ks": kh - mu_k[..., None, :] if cfg.q_smoothing else None,
            "sm_scale": qi["sm_scale"], "config": cfg}


def _check_tiles(pos: np.ndarray, N: int, align: int, name: str) -> None:
    """ValueError unless every run of consecutive positions starts on a multiple of ``align`` and ends on one
    or at ``N``: else the block cuts a tile and quantizes differently from the single call."""
    if not pos.size:
        return
    breaks = np.flatnonzero(np.diff(pos) != 1)
    starts = pos[np.concatenate([[0], breaks + 1])]
    stops = pos[np.concatenate([breaks, [pos.size - 1]])] + 1
    bad = (starts % align != 0) | ((stops % align != 0) & (stops != N))
    if bad.any():
        a = int(np.argmax(bad))
        raise ValueError(f"{name} run [{starts[a]}, {stops[a]}) cuts a tile: SageBwd blocks start and end on "
                         f"multiples of {align} (sagebwd_alignment) or at the sequence end ({N})")


def _sagebwd_block_args(qb, kvb, q_pos, k_pos, Nq, Nk, causal, window):
    for name, d, keys in (("qb", qb, ("q_codes", "q_scale", "mu_q")), ("kvb", kvb, ("k_codes", "v_codes", "ks"))):
        if not isinstance(d, dict) or not set(keys) <= set(d):
            raise TypeError(f"{name} must be the dict of sagebwd_quantize_{'q' if name == 'qb' else 'kv'}")
    cfg = qb["config"]
    if kvb["config"] != cfg or kvb["sm_scale"] != qb["sm_scale"]:
        raise ValueError("the Q shard and the K/V block were quantized with different configs or sm_scales")
    B, Hq, n, D = qb["q_codes"].shape
    Bk, Hkv, m, Dk = kvb["k_codes"].shape
    if (Bk, Dk) != (B, D) or Hq % Hkv:
        raise ValueError(f"the Q shard (B, Hq, D) = {(B, Hq, D)} does not fit the K/V block (B, Hkv, D) = "
                         f"{(Bk, Hkv, Dk)}")
    Nq, Nk = _positive_int(Nq, "Nq"), _positive_int(Nk, "Nk")
    qp, kp = _check_pos(q_pos, n, Nq, "q_pos"), _check_pos(k_pos, m, Nk, "k_pos")
    align_q, align_k = sagebwd_alignment(cfg)
    _check_tiles(qp, Nq, align_q, "q_pos")
    _check_tiles(kp, Nk, align_k, "k_pos")
    return cfg, (B, Hq, Hkv, n, m, D), pair_mask(qp, kp, Nq, Nk, causal, window)


def _pair_bias(qb, kvb, kv_of):
    """The Q-smoothing bias of this (Q shard, K/V block) pair (§3.2): ``sm_scale · μ_Qi · (k_j − μ_K)``, the
    single call's ``bias`` restricted to the block's keys (a float64 product over D: equal up to its rounding)."""
    if not qb["config"].q_smoothing:
        return None
    return qb["sm_scale"] * np.matmul(qb["mu_q"], np.swapaxes(kvb["ks"][:, kv_of], -1, -2))


def _stack(dst: dict, head: dict, b: int, h: int, B: int, Hq: int) -> None:
    for key, value in head.items():
        if key not in dst:
            dst[key] = np.zeros((B, Hq, *np.shape(value)), dtype=np.asarray(value).dtype)
        dst[key][b, h] = value


def sagebwd_block_forward(qb, kvb, q_pos, k_pos, Nq: int, Nk: int, *, causal=False, window=None,
                          return_intermediates=False):
    """The SageBwd forward of a Q shard against one K/V block: ``(o, lse, lse_internal)`` (+ intermediates).

    ``qb`` from :func:`sagebwd_quantize_q`, ``kvb`` from :func:`sagebwd_quantize_kv`. The logits and the
    forward's P tiles are the single call's restricted to the block; ``o`` and ``lse_internal`` are the closed
    form of §3.4 over the block's tiles only (``M`` the block's row max), ``lse`` the public LSE (``+ sm_scale ·
    q_i · μ_K``, §3.4). Partials over blocks that partition the keys merge (:func:`merge_partials`) into the
    single call's ``o`` and ``lse_internal``: the quantized P of a tile depends on that tile's max only, so the
    block form is the same function, up to float64 rounding. Merge on ``lse_internal`` when every block was
    quantized with the same (global) μ_K; on ``lse`` otherwise. Intermediates (``(B, Hq, n, ·)``): ``"S"``,
    ``"tile_max"``, ``"P_fwd_codes"``, ``"P_fwd_weight"``, ``"m"``, ``"l"`` as in ``sagebwd.forward``.
    """
    cfg, (B, Hq, Hkv, n, m, D), mask = _sagebwd_block_args(qb, kvb, q_pos, k_pos, Nq, Nk, causal, window)
    kv_of = kv_head_index(Hq, Hkv)
    bias = _pair_bias(qb, kvb, kv_of)
    o, lse_int = np.zeros((B, Hq, n, D)), np.zeros((B, Hq, n))
    inter = {}
    for b in range(B):
        for h in range(Hq):
            g = kv_of[h]
            S = _sb._logits(qb["q_codes"][b, h], qb["q_scale"][b, h], kvb["k_codes"][b, g], kvb["k_scale"][b, g],
                            np.zeros((n, m)) if bias is None else _sb._rows(bias[b, h], cfg.block_q, n), mask)
            pv_rhs = kvb["v_codes"][b, g] * _sb._v_rows(kvb["v_scale"][b, g], cfg, m)
            o[b, h], lse_int[b, h], tmax, mx, l, pc, pw = _sb._forward_head(S, pv_rhs, cfg)
            if return_intermediates:
                _stack(inter, {"S": S, "tile_max": tmax, "m": mx, "l": l, "P_fwd_codes": pc, "P_fwd_weight": pw},
                       b, h, B, Hq)
    lse = np.where(lse_int != -np.inf, lse_int + _q_dot_mu(qb, kvb["mu_k"], kv_of), -np.inf)
    return (o, lse, lse_int, inter) if return_intermediates else (o, lse, lse_int)


def _q_dot_mu(qb, mu_k, kv_of):
    """``sm_scale · q_i · μ_K``, the public LSE's shift over the internal one (§3.4), as ``sagebwd.forward``."""
    return qb["sm_scale"] * np.einsum("bhnd,bhd->bhn", qb["q"], mu_k[:, kv_of])


def sagebwd_block_backward(qb, kvb, do, lse_internal, delta, q_pos, k_pos, Nq: int, Nk: int, *, causal=False,
                           window=None, return_intermediates=False):
    """The SageBwd backward of a Q shard against one K/V block: its shares ``(dq, dk, dv)`` (+ intermediates).

    ``lse_internal`` and ``delta`` ``(B, Hq, n)`` are the rows' *global* values (the merged forward's internal
    LSE and :func:`row_delta` of its output); ``do`` ``(B, Hq, n, D)``. Every tile is the single call's tile
    (§4.2: P, its column scales, dO's scales, the folded dS with theirs), so given the same global LSE and δ
    the quantized operands are the single call's and the shares sum (dq over key blocks, dk and dv over Q shards)
    to its gradients up to float64 rounding. ``dk, dv`` ``(B, Hkv, m, D)``, summed over each GQA group.
    Intermediates as ``sagebwd.backward``'s, ``(B, Hq, n, m)`` (``"delta"`` ``(B, Hq, n)``).
    """
    cfg, (B, Hq, Hkv, n, m, D), mask = _sagebwd_block_args(qb, kvb, q_pos, k_pos, Nq, Nk, causal, window)
    doh = as_float64(do, "do")
    lse64, delta64 = as_float64(lse_internal, "lse_internal"), as_float64(delta, "delta")
    if doh.shape != (B, Hq, n, D) or lse64.shape != (B, Hq, n) or delta64.shape != (B, Hq, n):
        raise ValueError(f"do must be {(B, Hq, n, D)}, lse_internal and delta {(B, Hq, n)}; got {doh.shape}, "
                         f"{lse64.shape}, {delta64.shape}")
    kv_of = kv_head_index(Hq, Hkv)
    bias = _pair_bias(qb, kvb, kv_of)
    scale = qb["sm_scale"]
    dq, dk, dv = np.zeros((B, Hq, n, D)), np.zeros((B, Hq, m, D)), np.zeros((B, Hq, m, D))
    inter = {}
    for b in range(B):
        for h in range(Hq):
            g = kv_of[h]
            qc, qs = qb["q_codes"][b, h], qb["q_scale"][b, h]
            kc, ks = kvb["k_codes"][b, g], kvb["k_scale"][b, g]
            S = _sb._logits(qc, qs, kc, ks, np.zeros((n, m)) if bias is None else
                            _sb._rows(bias[b, h], cfg.block_q, n), mask)
            dq[b, h], dk[b, h], dv[b, h], head = _sb._backward_head(
                S, lse64[b, h], None, doh[b, h], kvb["v"][b, g], qc, qs, kc, ks,
                _sb._rows(qb["mu_q"][b, h], cfg.block_q, n), kvb["mu_k"][b, g], scale, cfg, delta=delta64[b, h],
                dtype=qb.get("dtype"))
            if return_intermediates:
                _stack(inter, head, b, h, B, Hq)
    grads = (dq, sum_kv_groups(dk, Hkv), sum_kv_groups(dv, Hkv))
    return (*grads, inter) if return_intermediates else grads


# ----------------------------------------------------------------------------
# the ring, simulated
# ----------------------------------------------------------------------------


def _ring_pairs(plan: ShardPlan, causal, window):
    """The ring's schedule: ``(step, rank, owner, i, j)`` for every visible (query chunk ``i`` of ``rank``, key
    chunk ``j`` of ``owner``) pair, in order, and the number of pairs skipped as fully masked. At step ``t`` rank
    ``r`` holds the K/V block of rank ``(r − t) mod R`` (each step passes it on to rank ``r + 1``)."""
    pairs, skipped = [], 0
    for t in range(plan.ranks):
        for r in range(plan.ranks):
            s = (r - t) % plan.ranks
            for i, qr in enumerate(plan.q_chunks[r]):
                for j, kr in enumerate(plan.k_chunks[s]):
                    if qr[1] == qr[0] or kr[1] == kr[0]:
                        continue
                    if pair_visible(qr, kr, plan.Nq, plan.Nk, causal, window):
                        pairs.append((t, r, s, i, j))
                    else:
                        skipped += 1
    return pairs, skipped


def ring_forward(q, k, v, plan: ShardPlan, *, causal=False, sm_scale=None, window=None, layout="HND", config=None,
                 statistics="global", dtype=None):
    """Ring attention over ``plan.ranks`` ranks, run in one process: ``(o, lse, state)``.

    Rank ``r`` keeps its Q shard; the K/V blocks travel round the ring (:func:`_ring_pairs`), and each visible
    (query chunk, key chunk) pair gives a partial that is merged into the chunk's running ``(o, LSE)``
    (:func:`merge_partials`). ``config=None``: exact attention (:func:`exact_block_forward`); a SageBwd config
    (or its name): the simulator, every rank quantizing its own shard and block once before the ring
    (:func:`sagebwd_quantize_q`, :func:`sagebwd_quantize_kv`) with ``statistics``:

    * ``"global"``: each rank's :func:`block_statistics` all-reduced (:func:`reduce_statistics`), so every block
      is quantized as in the single call; partials merge on the internal LSE (one μ_K for all blocks) and the
      public LSE is formed after the merge, as ``sagebwd.forward`` forms it.
    * ``"local"``: each rank's own statistics, what unmodified single-device calls would use; partials merge
      on the public LSE (their internal ones are relative to different means). It computes a different
      function and is kept to measure and test that difference.

    The plan must not cut a SageBwd tile (``sagebwd_alignment``; build it with ``align_q``/``align_k``).
    ``o`` is in ``layout``, ``lse`` ``(B, Hq, Nq)``; ``state`` is what :func:`ring_backward` needs, plus
    ``"schedule"`` (the computed pairs) and ``"skipped"`` (the fully masked ones). ``dtype``: as
    ``sagebwd.forward``'s (q's own when None).
    """
    B, Hq, Hkv, Nq, Nk, D = check_qkv(q, k, v, check_layout(layout))
    resolve_window(causal, window)
    scale = resolve_sm_scale(sm_scale, D)
    if statistics not in ("global", "local"):
        raise ValueError(f"statistics={statistics!r} must be 'global' or 'local'")
    cfg = None if config is None else get_config(config)
    if cfg is None and statistics != "global":
        raise ValueError("exact attention has no statistics: statistics='local' is for a SageBwd config")
    _check_plan(plan, Nq, Nk, *((1, 1) if cfg is None else sagebwd_alignment(cfg)))
    dtype = _sb._dtype16(dtype, q)
    qh, kh, vh = (as_float64(to_hnd(x, layout), n) for x, n in ((q, "q"), (k, "k"), (v, "v")))
    R = plan.ranks
    qspan = {(r, i): c for r in range(R) for i, c in enumerate(plan.q_chunks[r])}
    kspan = {(s, j): c for s in range(R) for j, c in enumerate(plan.k_chunks[s])}
    state = {"plan": plan, "config": cfg, "statistics": statistics, "causal": causal, "window": window,
             "sm_scale": scale, "layout": layout, "q": qh, "k": kh, "v": vh, "shape": (B, Hq, Hkv, Nq, Nk, D)}
    if cfg is not None:
        per_rank = [block_statistics(kh[:, :, plan.k_positions(s)], vh[:, :, plan.k_positions(s)], config=cfg)
                    for s in range(R)]
        stats = ([reduce_statistics(per_rank)] * R if statistics == "global"
                 else [reduce_statistics([p]) if p["k_count"] else None for p in per_rank])
        state["qb"] = {key: sagebwd_quantize_q(qh[:, :, a:b], sm_scale=scale, config=cfg, dtype=dtype)
                       for key, (a, b) in qspan.items() if b > a}
        state["kvb"] = {key: sagebwd_quantize_kv(kh[:, :, a:b], vh[:, :, a:b], stats[key[0]], sm_scale=scale,
                                                 config=cfg) for key, (a, b) in kspan.items() if b > a}
    # SageBwd partials are (o, lse, lse_internal): the merge runs on the internal LSE where every block shares
    # one basis (the global μ_K), on the public one where they do not.
    merge_on = 1 if cfg is not None and statistics == "local" else -1
    acc = {key: (np.zeros((B, Hq, b - a, D)), np.full((B, Hq, b - a), -np.inf)) for key, (a, b) in qspan.items()}
    pairs, skipped = _ring_pairs(plan, causal, window)
    for t, r, s, i, j in pairs:
        (qa, qz), (ka, kz) = qspan[r, i], kspan[s, j]
        pos = (np.arange(qa, qz), np.arange(ka, kz), Nq, Nk)
        if cfg is None:
            part = exact_block_forward(qh[:, :, qa:qz], kh[:, :, ka:kz], vh[:, :, ka:kz], *pos, causal=causal,
                                       sm_scale=scale, window=window)
        else:
            part = sagebwd_block_forward(state["qb"][r, i], state["kvb"][s, j], *pos, causal=causal, window=window)
        acc[r, i] = merge_partials(*acc[r, i], part[0], part[merge_on])
    o, lse = np.zeros((B, Hq, Nq, D)), np.full((B, Hq, Nq), -np.inf)
    for key, (a, b) in qspan.items():
        o[:, :, a:b], lse[:, :, a:b] = acc[key]
    if cfg is not None and statistics == "global":
        state["lse_internal"] = lse
        mu_k = next(iter(state["kvb"].values()))["mu_k"]
        c = _q_dot_mu({"sm_scale": scale, "q": qh}, mu_k, kv_head_index(Hq, Hkv))
        lse = np.where(lse != -np.inf, lse + c, -np.inf)
    state.update(o=o, lse=lse, schedule=pairs, skipped=skipped)
    return from_hnd(o, layout), lse, state


def ring_backward(state: dict, do):
    """The backward of :func:`ring_forward`'s ring: ``(dq, dk, dv)`` in the forward's layout.

    Each rank forms ``δ`` of its rows from the merged output (:func:`row_delta`) and keeps the global LSE; the
    K/V blocks travel the same schedule as in the forward. A pair's dq share is added to its rank's dQ, its
    dk, dv shares to the block owner's dK, dV (in a ring the accumulators travel with the block and arrive back
    at the owner). ``statistics="local"``: each block gets the internal LSE relative to its own μ_K (the public
    LSE minus ``sm_scale · q_i · μ_K`` of that block).
    """
    if not isinstance(state, dict) or "schedule" not in state:
        raise TypeError("state must be the third value returned by ring_forward")
    plan, cfg, layout = state["plan"], state["config"], state["layout"]
    B, Hq, Hkv, Nq, Nk, D = state["shape"]
    if not hasattr(do, "shape") or do.ndim != 4 or tuple(to_hnd(do, layout).shape) != (B, Hq, Nq, D):
        raise ValueError(f"do must have the output's HND shape {(B, Hq, Nq, D)} ({layout=}), got "
                         f"{tuple(getattr(do, 'shape', ()))}")
    doh = as_float64(to_hnd(do, layout), "do")
    qh, kh, vh, scale = state["q"], state["k"], state["v"], state["sm_scale"]
    R = plan.ranks
    qspan = {(r, i): c for r in range(R) for i, c in enumerate(plan.q_chunks[r])}
    kspan = {(s, j): c for s in range(R) for j, c in enumerate(plan.k_chunks[s])}
    delta = {key: row_delta(doh[:, :, a:b], state["o"][:, :, a:b]) for key, (a, b) in qspan.items()}
    lse = state["lse_internal"] if cfg is not None and state["statistics"] == "global" else state["lse"]
    dq = {key: np.zeros((B, Hq, b - a, D)) for key, (a, b) in qspan.items()}
    dk = {key: np.zeros((B, Hkv, b - a, D)) for key, (a, b) in kspan.items()}
    dv = {key: np.zeros((B, Hkv, b - a, D)) for key, (a, b) in kspan.items()}
    kv_of = kv_head_index(Hq, Hkv)
    for t, r, s, i, j in state["schedule"]:
        (qa, qz), (ka, kz) = qspan[r, i], kspan[s, j]
        pos = (np.arange(qa, qz), np.arange(ka, kz), Nq, Nk)
        rows = lse[:, :, qa:qz]
        if cfg is None:
            g = exact_block_backward(qh[:, :, qa:qz], kh[:, :, ka:kz], vh[:, :, ka:kz], doh[:, :, qa:qz], rows,
                                     delta[r, i], *pos, causal=state["causal"], sm_scale=scale,
                                     window=state["window"])
        else:
            qb, kvb = state["qb"][r, i], state["kvb"][s, j]
            if state["statistics"] == "local":
                rows = np.where(rows != -np.inf, rows - _q_dot_mu(qb, kvb["mu_k"], kv_of), -np.inf)
            g = sagebwd_block_backward(qb, kvb, doh[:, :, qa:qz], rows, delta[r, i], *pos, causal=state["causal"],
                                       window=state["window"])
        dq[r, i] += g[0]
        dk[s, j] += g[1]
        dv[s, j] += g[2]
    out = (np.zeros((B, Hq, Nq, D)), np.zeros((B, Hkv, Nk, D)), np.zeros((B, Hkv, Nk, D)))
    for key, (a, b) in qspan.items():
        out[0][:, :, a:b] = dq[key]
    for key, (a, b) in kspan.items():
        out[1][:, :, a:b], out[2][:, :, a:b] = dk[key], dv[key]
    return tuple(from_hnd(x, layout) for x in out)
