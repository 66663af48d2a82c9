"""Context parallelism for INT8 SageBwd on the GPU: attention by blocks, and the ring simulated on one GPU.

The float64 decomposition is ``sagecupy.reference.context_parallel`` (docs/algorithms.md §9); this module is its
GPU counterpart for the INT8 kernels (dense ``"HND"``/``"NHD"`` layouts, configs with K-smoothing and per-channel V,
such as ``"default"``).

* A *block* is one query run (global rows ``q_range = (a, b)``) against one key run (``k_range``), of a call of
  global lengths ``Nq, Nk``. Its mask is the call's in global positions: the kernels take the diagonal offset
  ``shift = a_q - a_k + Nk - Nq`` (:func:`block_mask`) instead of their own ``nk - nq``.
* Statistics: K-smoothing's mean and V's per-channel scale span every key, so each block is quantized with the
  sequence's (:func:`block_statistics` per K/V block, :func:`reduce_statistics` over all of them, as an
  all-reduce would), passed to ``int8.forward(..., statistics=)``.
* :func:`block_forward`: the block's partial ``(o, lse)`` and its residuals; :func:`merge_partials` merges partials
  exactly through their LSEs; :func:`block_backward` takes the block's residuals with the rows' *global* LSE and
  merged output (``δ = rowsum(dO ∘ O_merged)``) and returns the block's shares of dQ, dK, dV.
* :func:`ring_attention` / :func:`ring_attention_backward`: the ring of ``ranks`` ranks over the reference's plans
  (``zigzag_plan``/``contiguous_plan`` aligned to ``sagebwd_alignment``), run in sequence on one GPU.

Precision: with aligned chunks every tile of a block is the single call's tile, so the blocks compute the single
call's function; what differs is rounding. The kernels write each partial O (and each gradient share) in the
input dtype, the merges run in fp32 and the shares are summed in fp32, so the ring's O carries one fp16/bf16
rounding per visible block instead of one in all, and its gradients one per share; the LSE merge adds a few fp32
units. The statistics are the single call's bit for bit under the condition of
``reference.context_parallel.reduce_statistics`` (e.g. fp16 inputs, ``Nk · max|k| <= 2^29``).
"""
from __future__ import annotations

import dataclasses

from . import _checks, _layout, int8
from .config import get_config
from .reference import context_parallel as _ref
from .reference.context_parallel import ShardPlan, contiguous_plan, sagebwd_alignment, zigzag_plan

__all__ = ["block_mask", "block_statistics", "reduce_statistics", "block_forward", "block_backward",
           "merge_partials", "make_plan", "ring_attention", "ring_attention_backward", "ShardPlan",
           "contiguous_plan", "zigzag_plan", "sagebwd_alignment"]

LN2 = 0.6931471805599453


def _check_config(config):
    cfg = get_config(config)
    why = int8._unsupported_config(cfg)
    if why:
        raise ValueError(f"config: {why}")
    if not cfg.k_smoothing or cfg.v_granularity != "channel":
        raise ValueError(f"context parallelism here needs a config whose statistics over the whole sequence are "
                         f"K-smoothing's mean and V's per-channel scale (k_smoothing=True, v_granularity='channel'), "
                         f"got k_smoothing={cfg.k_smoothing}, v_granularity={cfg.v_granularity!r}")
    return cfg


def _run(r, N, name):
    if (not isinstance(r, tuple) or len(r) != 2 or any(type(x) is not int for x in r)
            or not 0 <= r[0] < r[1] <= N):
        raise ValueError(f"{name}={r!r} must be a non-empty (start, stop) tuple of ints within [0, {N}]")
    return r


def block_mask(q_range, k_range, Nq: int, Nk: int, causal=False, window=None) -> tuple:
    """``(left, right, shift)`` as the dense kernels take them (``int8.kernel_mask``) for query rows ``q_range``
    against keys ``k_range`` of a call of lengths ``Nq, Nk``: local row ``i`` sees local key ``j`` iff ``i + shift
    - left <= j <= i + shift + right`` with ``shift = q_range[0] - k_range[0] + Nk - Nq`` (the bottom-right rule
    of ``reference.context_parallel.pair_mask``). A side that excludes no key of the block is passed as -1 (as
    ``int8.kernel_window`` does), which keeps the kernels' index sums small."""
    (qa, qb), (ka, kb) = _run(q_range, Nq, "q_range"), _run(k_range, Nk, "k_range")
    left, right = _checks.check_window(window, causal) or ((-1, 0) if causal else (-1, -1))
    nq, nk, shift = qb - qa, kb - ka, qa - ka + Nk - Nq
    if right != -1 and shift + right >= nk - 1:  # row 0 already sees the last key
        right = -1
    if left != -1 and nq - 1 + shift - left <= 0:  # the last row still sees key 0
        left = -1
    return int(left), int(right), int(shift)


# ----------------------------------------------------------------------------
# statistics
# ----------------------------------------------------------------------------


def block_statistics(k, v, *, layout="HND", config=None) -> dict:
    """One K/V block's partials of the sequence's statistics (``reference.context_parallel.block_statistics``):
    ``"k_sum"`` (B, Hkv, D) float64 (K's channel sums, summed in float64 by the pre-pass's kernel), ``"k_count"``
    (the block's keys), ``"v_amax"`` (B, Hkv, D) float32 (max|V| per channel; NaN where V holds one). CuPy arrays;
    one launch of the pre-pass's statistics kernel, partial sums of 256-key chunks added by CuPy."""
    import cupy

    _check_config(config)
    k, v = _checks.as_cupy(k, "k"), _checks.as_cupy(v, "v")
    p = _checks.check_attention_args(k, k, v, causal=False, sm_scale=None, layout=layout)
    B, H, n, D, T = p.batch, p.heads_kv, p.nk, p.head_dim, int8._T[p.dtype]
    kr, vr = (_layout.prepare(x, nm, layout, True) for x, nm in ((k, "k"), (v, "v")))
    nchunk = (n + 255) // 256
    part_k = cupy.empty((B, H, nchunk, D), cupy.float64)
    part_v = cupy.empty((B, H, nchunk, D), cupy.float32)
    i32, i64 = cupy.int32, cupy.int64
    fn = int8._qfn(f"column_partial_kv<{T}, {D}>", T, D)
    fn((nchunk, H, 2 * B), (256,), (kr, *(i64(s) for s in _layout.strides(kr, layout)), vr,
                                    *(i64(s) for s in _layout.strides(vr, layout)), i32(n), part_k, part_v))
    return {"k_sum": part_k.sum(axis=2), "k_count": int(n), "v_amax": part_v.max(axis=2)}


def reduce_statistics(parts) -> dict:
    """The all-reduce of :func:`block_statistics` over K/V blocks that partition the keys: ``"k_sum"`` added in
    the order given (float64), ``"k_count"`` added, ``"v_amax"`` maxima; and what ``int8.forward(statistics=)``
    takes: ``"mu_k"`` = float32(k_sum / count) and ``"v_scale"`` = v_amax / 127 in float32 (NaN where v_amax is NaN
    or +inf), the pre-pass kernel's expressions (``column_finish_body``). The max is exact in any order; the sums
    are the single call's whenever float64 adds them exactly (``reference.context_parallel.reduce_statistics``)."""
    import cupy

    parts = list(parts)
    if not parts:
        raise ValueError("reduce_statistics needs the statistics of at least one block")
    count = sum(int(p["k_count"]) for p in parts)
    if count < 1:
        raise ValueError("the blocks hold no key: there is no K mean")
    k_sum, v_amax = parts[0]["k_sum"], parts[0]["v_amax"]
    for p in parts[1:]:
        k_sum = k_sum + p["k_sum"]
        v_amax = cupy.maximum(v_amax, p["v_amax"])  # (NaN propagates, as the kernel's max.NaN)
    mu_k = cupy.ascontiguousarray((k_sum / float(count)).astype(cupy.float32))
    bad = cupy.isnan(v_amax) | cupy.isinf(v_amax)
    v_scale = cupy.where(bad, cupy.float32("nan"), v_amax / cupy.float32(127.0)).astype(cupy.float32)
    return {"k_sum": k_sum, "k_count": count, "v_amax": v_amax, "mu_k": mu_k,
            "v_scale": cupy.ascontiguousarray(v_scale)}


def _kernel_statistics(statistics) -> dict:
    if not isinstance(statistics, dict) or not set(int8.STATISTICS) <= set(statistics):
        raise TypeError("statistics must be the dict of reduce_statistics (with 'mu_k' and 'v_scale')")
    return {n: statistics[n] for n in int8.STATISTICS}


# ----------------------------------------------------------------------------
# blocks
# ----------------------------------------------------------------------------


@dataclasses.dataclass
class Block:
    """A block forward's result: ``o`` (the partial output over the block's keys, input dtype and layout), ``lse``
    ((B, Hq, n) float32, natural log, public: ``+ sm_scale q·μ_K``; -inf where a row sees no key of the block),
    ``lse2`` ((B, Hq, nq_pad) float32, the kernel's base-2 LSE of its smoothed logits, +inf where no key: what the
    ring merges, every block sharing one μ_K), ``qmk`` ((B, Hq, n) float32, ``sm_scale q·μ_K``) and the residuals
    :func:`block_backward` needs."""

    o: object
    lse: object
    lse2: object
    qmk: object
    residuals: int8.Residuals


def block_forward(q, k, v, statistics, q_range, k_range, Nq: int, Nk: int, *, causal=False, sm_scale=None,
                  window=None, layout="HND", config=None, engine=None) -> Block:
    """The INT8 forward of query rows ``q_range`` (``q``: those rows) against keys ``k_range`` (``k, v``) of a call
    of lengths ``Nq, Nk``, with the sequence's ``statistics`` (:func:`reduce_statistics`): a :class:`Block`. The
    counterpart of ``reference.context_parallel.sagebwd_block_forward`` (o, lse, lse_internal = lse2 · ln 2).
    A block whose rows see none of its keys gives ``o = 0``, ``lse = -inf``."""
    cfg = _check_config(config)
    q, k, v = (_checks.as_cupy(x, n) for x, n in ((q, "q"), (k, "k"), (v, "v")))
    mask = block_mask(q_range, k_range, Nq, Nk, causal, window)
    p, cfg, pre = int8._preprocess_forward(q, k, v, causal=causal, sm_scale=sm_scale, layout=layout, config=cfg,
                                           engine=engine, window=window, statistics=_kernel_statistics(statistics))
    if (p.nq, p.nk) != (q_range[1] - q_range[0], k_range[1] - k_range[0]):
        raise ValueError(f"q has {p.nq} rows and k {p.nk} keys; q_range={q_range} and k_range={k_range} say "
                         f"{q_range[1] - q_range[0]} and {k_range[1] - k_range[0]}")
    qmk = pre["qmk"][:, :, :p.nq].copy()  # (scratch of this call's arena)
    o, lse, lse2 = int8._launch_forward(p, cfg, pre, engine, mask)
    res = int8.Residuals(p, cfg, pre["q_codes"], pre["q_scale"], pre["k_codes"], pre["k_scale"], pre["v"], o, lse2,
                         pre["mu_k"], None, mask)
    return Block(_checks.wrap(o, p.dtype, pre["like"]), lse, lse2, qmk, res)


def block_backward(residuals, do, o, lse2, *, engine=None):
    """The block's shares ``(dq, dk, dv)`` (input dtype and layout) of the gradients, from its forward's
    ``residuals`` (:attr:`Block.residuals`) and the rows' *global* values: ``o`` the merged output of the block's
    query rows (input dtype and layout: the backward's pre-pass forms ``δ = rowsum(dO ∘ O)`` from it, as the single
    call's does from its O) and ``lse2`` their merged base-2 internal LSE ((B, Hq, n) or padded (B, Hq, nq_pad)
    float32, +inf or -inf where a row sees no key at all). dq shares add over key blocks, dk and dv shares over
    query runs (and are already summed over each GQA group)."""
    import cupy

    if not isinstance(residuals, int8.Residuals) or residuals.mask is None:
        raise TypeError("residuals must be a block forward's (block_forward(...).residuals)")
    p = residuals.problem
    lse2 = _checks.as_cupy(lse2, "lse2")
    if lse2.dtype != cupy.float32 or tuple(lse2.shape[:2]) != (p.batch, p.heads_q) or lse2.ndim != 3 or \
            lse2.shape[2] not in (p.nq, residuals.nq_pad):
        raise ValueError(f"lse2 must be float32 (B, Hq, n) = {(p.batch, p.heads_q, p.nq)} or padded to "
                         f"{residuals.nq_pad}, got {lse2.dtype} {tuple(lse2.shape)}")
    padded = cupy.full((p.batch, p.heads_q, residuals.nq_pad), cupy.inf, dtype=cupy.float32)
    padded[:, :, :p.nq] = cupy.where(lse2[:, :, :p.nq] == -cupy.inf, cupy.float32(cupy.inf), lse2[:, :, :p.nq])
    o = _layout.prepare(o, "o", p.layout, True)
    r = dataclasses.replace(residuals, o=o, lse2=padded)
    return int8.backward(r, do, engine=engine)


# ----------------------------------------------------------------------------
# the merge
# ----------------------------------------------------------------------------


def _merge(o_a, l_a, o_b, l_b, base2: bool):
    """merge_partials in fp32 on the GPU; ``base2``: the LSEs are base-2 (exp2/log2), else natural."""
    import cupy

    f32 = cupy.float32
    l_a, l_b = l_a.astype(f32, copy=False), l_b.astype(f32, copy=False)
    hi, lo = cupy.maximum(l_a, l_b), cupy.minimum(l_a, l_b)
    seen = hi != -cupy.inf
    hi_safe = cupy.where(seen, hi, f32(0))
    x = (cupy.exp2 if base2 else cupy.exp)(lo - hi_safe)  # in [0, 1]; 0 where lo = -inf
    lg = cupy.log1p(x) * f32(1.4426950408889634) if base2 else cupy.log1p(x)
    lse = cupy.where(seen, hi_safe + lg, f32(-cupy.inf)).astype(f32)
    w_hi, w_lo = f32(1) / (f32(1) + x), x / (f32(1) + x)
    a_hi = l_a >= l_b
    w_a, w_b = cupy.where(a_hi, w_hi, w_lo), cupy.where(a_hi, w_lo, w_hi)
    return (w_a[..., None] * o_a + w_b[..., None] * o_b).astype(f32), lse


def merge_partials(o_a, lse_a, o_b, lse_b):
    """``(o, lse)`` over the union of two disjoint key sets from the partials over each, in fp32 on the GPU:
    ``reference.context_parallel.merge_partials``'s formulas (weights ``1/(1+x)``, ``x/(1+x)`` with ``x =
    e^{lo - hi}``), exact up to fp32 rounding. ``o_*`` (..., n, D) (any float dtype; the result is float32),
    ``lse_*`` (..., n) natural log, -inf for a row that saw no key (it leaves the other partial unchanged)."""
    import cupy

    f32 = cupy.float32
    o_a, o_b = (_as_f32(_checks.as_cupy(x, n)) for x, n in ((o_a, "o_a"), (o_b, "o_b")))
    lse_a, lse_b = _checks.as_cupy(lse_a, "lse_a"), _checks.as_cupy(lse_b, "lse_b")
    if lse_a.shape != lse_b.shape or o_a.shape != o_b.shape or o_a.shape[:-1] != lse_a.shape:
        raise ValueError(f"the partials must have matching shapes (o (..., n, D), lse (..., n)), got o "
                         f"{o_a.shape} and {o_b.shape}, lse {lse_a.shape} and {lse_b.shape}")
    return _merge(o_a.astype(f32, copy=False), lse_a, o_b.astype(f32, copy=False), lse_b, False)


def _as_f32(x):
    """A float16/bfloat16/float32 CuPy array (or BF16Array) as float32."""
    import cupy

    r = _checks.raw(x)
    if r.dtype == cupy.uint16:  # bfloat16 bits
        return (r.astype(cupy.uint32) << 16).view(cupy.float32)
    return r.astype(cupy.float32)


def _to_dtype(x, dtype: str):
    """float32 -> the kernels' raw form of ``dtype`` (float16, or bfloat16 bits), rounded to nearest even."""
    import cupy

    if dtype == "float16":
        return x.astype(cupy.float16)
    bits = cupy.ascontiguousarray(x, dtype=cupy.float32).view(cupy.uint32)
    rounded = (bits + cupy.uint32(0x7FFF) + ((bits >> 16) & cupy.uint32(1))) >> 16
    nan = (bits & cupy.uint32(0x7FFFFFFF)) > cupy.uint32(0x7F800000)
    return cupy.where(nan, (bits >> 16) | cupy.uint32(0x40), rounded).astype(cupy.uint16)


# ----------------------------------------------------------------------------
# the ring, on one GPU
# ----------------------------------------------------------------------------


def make_plan(plan, Nq: int, Nk: int, ranks, config=None) -> ShardPlan:
    """``plan``: ``"zigzag"``, ``"contiguous"`` (built for ``ranks`` with ``sagebwd_alignment(config)``) or a
    :class:`ShardPlan`, checked to cover the sequence and cut no SageBwd tile."""
    align = sagebwd_alignment(_check_config(config))
    if ranks is None and not isinstance(plan, str):
        ranks = getattr(plan, "ranks", None)
    return _ref.make_plan(plan, Nq, Nk, ranks, align, "ranks", "the argument ranks")


def _rows(x, a, b, layout):
    """Rows (tokens) a .. b - 1 of a (B, H, N, D) / (B, N, H, D) CuPy array: a view."""
    return x[:, :, a:b] if layout == "HND" else x[:, a:b]


def _slice(x, a, b, layout, dtype):
    """:func:`_rows` of an input in the form it came in (bfloat16: a view of its bits in ``x``'s form)."""
    return _checks.wrap(_rows(_checks.raw(x), a, b, layout), dtype, x)


def _hnd(x, layout):
    return x if layout == "HND" else x.transpose(0, 2, 1, 3)


def ring_attention(q, k, v, ranks=None, plan="zigzag", *, causal=False, window=None, sm_scale=None, layout="HND",
                   config=None, engine=None):
    """Ring attention over ``ranks`` simulated ranks, run in sequence on one GPU: ``(o, lse, state)``.

    The counterpart of ``reference.context_parallel.ring_forward`` with ``statistics="global"``: each rank's K/V
    block gives its :func:`block_statistics` (one per key chunk), reduced once (:func:`reduce_statistics`); then at
    step ``t`` rank ``r`` holds the K/V block of rank ``(r - t) mod R`` and every visible (query chunk, key chunk)
    pair (the reference's schedule) runs :func:`block_forward`, its partial merged into the chunk's running
    ``(o, lse2)`` in fp32 (base 2, on the internal LSE: every block has the global μ_K). ``o`` in q's dtype and
    ``layout``, ``lse`` (B, Hq, Nq) float32 as ``int8.forward`` returns it; ``state`` for
    :func:`ring_attention_backward`."""
    import cupy

    cfg = _check_config(config)
    q, k, v = (_checks.as_cupy(x, n) for x, n in ((q, "q"), (k, "k"), (v, "v")))
    p = _checks.check_attention_args(q, k, v, causal=causal, sm_scale=sm_scale, layout=layout, window=window)
    if layout not in ("HND", "NHD"):
        raise ValueError(f"layout={layout!r}: the ring takes the dense layouts 'HND' and 'NHD'")
    B, Hq, Nq, Nk, D = p.batch, p.heads_q, p.nq, p.nk, p.head_dim
    shard = make_plan(plan, Nq, Nk, ranks, cfg)
    R = shard.ranks
    qspan = {(r, i): c for r in range(R) for i, c in enumerate(shard.q_chunks[r]) if c[1] > c[0]}
    kspan = {(s, j): c for s in range(R) for j, c in enumerate(shard.k_chunks[s]) if c[1] > c[0]}
    dt = p.dtype
    stats = reduce_statistics([block_statistics(_slice(k, a, b, layout, dt), _slice(v, a, b, layout, dt),
                                                layout=layout, config=cfg) for (a, b) in kspan.values()])
    pairs, skipped = _ref._ring_pairs(shard, causal, window)
    acc = {key: (cupy.zeros((B, Hq, b - a, D), cupy.float32), cupy.full((B, Hq, b - a), -cupy.inf, cupy.float32))
           for key, (a, b) in qspan.items()}
    qmk, blocks = {}, {}
    for t, r, s, i, j in pairs:
        (qa, qz), (ka, kz) = qspan[r, i], kspan[s, j]
        blk = block_forward(_slice(q, qa, qz, layout, dt), _slice(k, ka, kz, layout, dt),
                            _slice(v, ka, kz, layout, dt), stats,
                            (qa, qz), (ka, kz), Nq, Nk, causal=causal, sm_scale=sm_scale, window=window,
                            layout=layout, config=cfg, engine=engine)
        l2 = blk.lse2[:, :, :qz - qa]
        l2 = cupy.where(l2 == cupy.inf, cupy.float32(-cupy.inf), l2)  # (the kernel's "no key" is +inf)
        acc[r, i] = _merge(acc[r, i][0], acc[r, i][1], _hnd(_as_f32(blk.o), layout), l2, True)
        qmk.setdefault((r, i), blk.qmk)
        blocks[t, r, s, i, j] = blk.residuals
    bits = _layout.bits_dtype(p.dtype)
    o = cupy.empty(_layout.layout_shape((B, Hq, Nq, D), layout), bits)
    lse = cupy.full((B, Hq, Nq), -cupy.inf, cupy.float32)
    lse2 = cupy.full((B, Hq, Nq), -cupy.inf, cupy.float32)
    for key, (a, b) in qspan.items():
        o_acc, l2 = acc[key]
        _hnd(o, layout)[:, :, a:b] = _to_dtype(o_acc, p.dtype)
        lse2[:, :, a:b] = l2
        if key in qmk:  # (the kernel's expression: l2 ln 2 + q·μ_K)
            lse[:, :, a:b] = cupy.where(l2 == -cupy.inf, cupy.float32(-cupy.inf),
                                        l2 * cupy.float32(LN2) + qmk[key]).astype(cupy.float32)
    state = {"plan": shard, "problem": p, "config": cfg, "schedule": pairs, "skipped": skipped, "blocks": blocks,
             "o": o, "lse2": lse2, "qspan": qspan, "kspan": kspan, "statistics": stats}
    return _checks.wrap(o, p.dtype, q), lse, state


def ring_attention_backward(state, do, *, engine=None):
    """The backward of :func:`ring_attention`'s ring: ``(dq, dk, dv)`` in its layout and dtype.

    Every pair of the forward's schedule runs :func:`block_backward` with its query chunk's merged output and
    global LSE; dq shares are summed per query chunk, dk and dv shares per key chunk, in fp32 in the schedule's
    order (in a ring the dK/dV accumulators travel with the K/V block back to its owner), then rounded to the
    input dtype once."""
    import cupy

    if not isinstance(state, dict) or "blocks" not in state:
        raise TypeError("state must be the third value returned by ring_attention")
    p, layout = state["problem"], state["problem"].layout
    do = _checks.as_cupy(do, "do")
    if tuple(do.shape) != tuple(state["o"].shape):
        raise ValueError(f"do.shape={tuple(do.shape)} must equal the output's shape {tuple(state['o'].shape)}")
    B, Hq, Hkv, D = p.batch, p.heads_q, p.heads_kv, p.head_dim
    qspan, kspan = state["qspan"], state["kspan"]
    dq = {key: cupy.zeros((B, Hq, b - a, D), cupy.float32) for key, (a, b) in qspan.items()}
    dk = {key: cupy.zeros((B, Hkv, b - a, D), cupy.float32) for key, (a, b) in kspan.items()}
    dv = {key: cupy.zeros((B, Hkv, b - a, D), cupy.float32) for key, (a, b) in kspan.items()}
    for (t, r, s, i, j), res in state["blocks"].items():
        (qa, qz) = qspan[r, i]
        g = block_backward(res, _slice(do, qa, qz, layout, p.dtype), _rows(state["o"], qa, qz, layout),
                           state["lse2"][:, :, qa:qz], engine=engine)
        dq[r, i] += _hnd(_as_f32(g[0]), layout)
        dk[s, j] += _hnd(_as_f32(g[1]), layout)
        dv[s, j] += _hnd(_as_f32(g[2]), layout)
    bits = _layout.bits_dtype(p.dtype)
    out = tuple(cupy.empty(_layout.layout_shape(shape, layout), bits)
                for shape in ((B, Hq, p.nq, D), (B, Hkv, p.nk, D), (B, Hkv, p.nk, D)))
    for key, (a, b) in qspan.items():
        _hnd(out[0], layout)[:, :, a:b] = _to_dtype(dq[key], p.dtype)
    for key, (a, b) in kspan.items():
        _hnd(out[1], layout)[:, :, a:b] = _to_dtype(dk[key], p.dtype)
        _hnd(out[2], layout)[:, :, a:b] = _to_dtype(dv[key], p.dtype)
    return tuple(_checks.wrap(x, p.dtype, do) for x in out)

