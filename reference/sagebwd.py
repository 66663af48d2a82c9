"""SageBwd — INT8 trainable attention — simulated in float64: docs/algorithms.md §3-4 in code.

This is the function the GPU kernels (``sagecupy.int8``) are held to: the same
quantized operands (codes and scales, bit for bit), the same integer products,
the same tiles, the same softmax bookkeeping. Only the accumulators differ:
here everything is float64 (integer products of int8 codes are exact in
float64), on the GPU int32 / fp32. Every choice is read from a
:class:`~sagecupy.config.SageBwdConfig` (``PAPER`` or ``DEFAULT`` or your own).

Public API
----------
``quantize_inputs(q, k, v, *, sm_scale=None, layout="HND", config=DEFAULT)``
    The forward's quantized operands (smoothing included), HND.
``forward(q, k, v, *, causal=False, sm_scale=None, layout="HND", config=DEFAULT, return_intermediates=False)``
    ``(o, residuals)`` (``+ intermediates``), ``o`` float64 in ``layout``.
``backward(residuals, do, *, return_intermediates=False)``
    ``(dq, dk, dv)`` float64 in the forward's ``layout`` (``+ intermediates``).
``run(q, k, v, do, *, causal=False, sm_scale=None, layout="HND", config=DEFAULT)``
    Forward + backward; one dict of everything, HND (for the analysis CLI).

Shapes (HND; ``nqb = ceil(Nq / block_q)``, ``nkb = ceil(Nk / block_kv)``)
------------------------------------------------------------------------
=============  =====================  =========================================
key            shape                  meaning
=============  =====================  =========================================
q_codes        (B, Hq, Nq, D) int16   ``Q̂`` of ``sm_scale · (Q − μ_Q)``
q_scale        (B, Hq, Nq)            ``s_Q`` per row (a block scale repeated
                                      on its ``block_q`` rows); carries sm_scale
k_codes        (B, Hkv, Nk, D) int16  ``K̂`` of ``K − μ_K``
k_scale        (B, Hkv, Nk)           ``s_K`` per row (block scale repeated)
v_codes        (B, Hkv, Nk, D) int16  ``V̂``
v_scale        (B, Hkv, nv, D)        ``"channel"``: ``nv = 1``, one scale per
                                      column; ``"block"``: ``nv = nkb``, row
                                      ``t`` is block ``t``'s scale repeated on D
mu_k           (B, Hkv, D)            K mean over all Nk tokens (0 if off)
mu_q           (B, Hq, nqb, D)        Q mean of each ``block_q`` block (0 if off)
bias           (B, Hq, nqb, Nk)       ``sm_scale · μ_Qi · (K_j − μ_K)`` (0 if off)
sm_scale       float                  the resolved softmax scale
=============  =====================  =========================================

With ``config.quantize=False`` every ψ is the identity: the "codes" are the
float64 values themselves and the scales are 1 (same shapes), and the
simulator computes exact attention (tests check 1e-12).

Forward (per batch ``b``, query head ``h``, kv head ``h // (Hq / Hkv)``)
-----------------------------------------------------------------------
1. Smoothing. ``μ_K`` = mean of K over its Nk tokens (``config.k_smoothing``),
   ``Ks = K − μ_K``. With ``config.q_smoothing``: for each block ``i`` of
   ``block_q`` query rows (from row 0, last partial) ``μ_Qi`` = mean of its
   rows, ``Qs = Q − μ_Qi`` and ``bias_i[j] = sm_scale · μ_Qi · Ks_jᵀ``.
2. ``Q̂, s_Q = ψ(sm_scale · Qs)`` per token or per ``block_q`` rows;
   ``K̂, s_K = ψ(Ks)`` per token or per ``block_kv`` rows; ``V̂, s_V = ψ(V)``
   per channel over all Nk or per ``block_kv`` rows × D.
3. ``S_ij = ((Q̂ K̂ᵀ)_ij · s_Q[i]) · s_K[j] + bias_i[j]``, ``−inf`` where
   query ``i`` may not see key ``j`` (bottom-right causal mask)::

       Nq=3, Nk=5, causal      1 1 1 0 0
       (1 = visible)           1 1 1 1 0
                               1 1 1 1 1

4. Online softmax over KV tiles ``t`` (keys ``[t·block_kv, (t+1)·block_kv)``,
   aligned at key 0), ``r_t = rowmax`` of the visible ``S`` in tile ``t``
   (a tile with no visible key in a row contributes nothing to it)::

       m_t  = max(m_{t−1}, r_t)
       l_t  = e^{m_{t−1} − m_t} l_{t−1} + Σ_j e^{S_j − m_t}           (unquantized P̃)
       P̂_t  = rint(p_max · e^{S − r_t})                                (per token per tile)
       s_P  = e^{r_t − m_t} / p_max
       O_t  = e^{m_{t−1} − m_t} O_{t−1} + (P̂_t V̂_t) · s_P · s_V
       O    = O_last / l_last,   lse_internal = m_last + log l_last

   ``p_max`` is ``config.p_max`` (255 unsigned, 127 paper).

   **Implemented non-tiled.** ``P̂_t`` depends only on ``S`` and ``r_t``, not on
   the running max, so it is the same whichever order the tiles are visited
   in. Unrolling the recurrence with ``M = m_last = max_t r_t`` (the row max),
   the rescale factors telescope, ``Π_{u>t} e^{m_{u−1} − m_u} = e^{m_t − M}``::

       O_last = Σ_t e^{m_t − M} · e^{r_t − m_t} / p_max · (P̂_t V̂_t) s_V
              = Σ_t (e^{r_t − M} / p_max) · (P̂_t V̂_t) s_V
       l_last = Σ_t e^{m_t − M} Σ_{j∈t} e^{S_j − m_t} = Σ_j e^{S_j − M}

   so ``O = [Σ_t w_t P̂_t (V̂_t s_V)] / Σ_j e^{S_j − M}`` with the per-(row, tile)
   weight ``w_t = e^{r_t − M} / p_max`` and ``lse_internal = M + log l``: the
   online algorithm and this closed form are the same function up to float
   rounding. The code forms the matrix ``A_ij = P̂_ij · w_{t(j)}`` and does one
   matmul ``A · (V̂ ⊙ s_V)``. (A test checks it against a literal tile loop.)
   Fully masked rows (``M = −inf``): ``O = 0``, ``lse = −inf``, no NaN.

   ``config.pv_int8=False`` (P·V in the inputs' 16-bit type): V is not quantized and P̃ is not coded per tile;
   the kernels keep O in a *lazy frame* ``f_t`` (base-2 logit units, ``S₂ = S · log₂e``): ``f_t = r₂_t`` if
   ``r₂_t > f_{t−1} + 8`` (:data:`FWD_RESCALE_SLACK`), else ``f_{t−1}`` (``f_{−1} = −inf``), round
   ``P̃_t = 2^{S₂ − f_t}`` to the 16-bit type and accumulate ``O_t = 2^{f_{t−1} − f_t} O_{t−1} + P̃_t V`` in
   fp32. The rounding depends on the frame, so the closed form keeps it: the "codes" are the rounded
   ``2^{S₂ − f_t}`` and ``w_t = 2^{f_t − M₂}``, and ``A · V`` with the unquantized V as above; ``l`` and the
   LSE are the same as with ``pv_int8=True`` (the kernels sum the unrounded P̃ either way).

5. The public LSE is that of the *unsmoothed* logits ``sm_scale · q_i · k_j``:
   since ``S_ij ≈ sm_scale · q_i · (k_j − μ_K)`` (the Q-smoothing bias restores
   ``q_i`` exactly), ``lse = lse_internal + sm_scale · q_i · μ_K`` with the
   unsmoothed ``q_i``. The backward uses ``lse_internal``.

Backward (tiles of ``bwd_block_q`` query rows × ``bwd_block_kv`` keys, aligned at 0)
-----------------------------------------------------------------------------------
1. ``δ_i = rowsum(dO ∘ O)`` with the forward's ``O``. ``dÔ, s_dO = ψ(dO)``:
   ``do_granularity="block"`` one scale per ``bwd_block_q`` rows × D,
   ``"channel"`` one per (row block, column).
2. Per tile: ``S`` recomputed exactly as in the forward; ``P = exp(S − lse_internal)``
   (0 where invisible or in a fully masked row). ``P̂, s_P = ψ(P, qmax=p_max,
   unsigned=p_unsigned)``: ``p_bwd_granularity="column"`` one scale per key
   column over the tile's rows, ``"block"`` one per tile.
   ``dV_j += (P̂ᵀ dÔ_i) · s_P[col] · s_dO[i, d]``; with ``dv_int8=False``
   ``dV = P₁₆ᵀ dO`` instead, ``P₁₆`` being P rounded (through fp32) to the
   inputs' 16-bit type (``dtype``; unrounded when that is not known). ``dP =
   dO Vᵀ`` (exact, never quantized), ``dS = P ∘ (dP − δ)``.
   dQ: ``X = dS · diag(s_K)``, ``X̂, s_X = ψ(X)`` per query row over the tile's
   columns (``ds_granularity="rowcol"``) or per tile (``"block"``);
   ``dQ_i += sm_scale · (X̂ K̂_j) · s_X``.
   dK: ``Y = diag(s_Q) · dS``, ``Ŷ, s_Y = ψ(Y)`` per key column over the tile's
   rows (``"rowcol"``) or per tile (``"block"``); ``dK_j += (Ŷᵀ Q̂_i) · s_Y``.
   With ``ds_int8=False``, X and Y are rounded (through fp32) to bf16 instead:
   ``dQ_i += sm_scale · X₁₆ K̂_j``, ``dK_j += ln 2 · Y'₁₆ᵀ Q̂_i`` with ``Y' =
   diag(fp32(s_Q · log2 e)) · dS`` (the kernels' base-2 scale of Q), so
   ``Y_codes`` is ``Y'₁₆`` and ``Y_scale`` is ln 2.
3. ``q_smoothing``: ``dK_j += sm_scale · Σ_i colsum(dS_ij)ᵀ ⊗ μ_Qi`` (computed
   as ``sm_scale · dSᵀ M_Q`` with ``M_Q`` the per-row block means).
   ``ds_rowsum_correction``: ``dQ_i += sm_scale · rowsum(dS_i) · μ_K``.
   GQA: dK, dV summed over the query heads of each kv head.

Every scale is constant along the contraction of the product it multiplies,
so a tile sum ``Σ_tiles (Â_t B̂_t) s_t`` equals ``(Â ⊙ s_A)(B̂ ⊙ s_B)`` of the
dequantized operands; the code uses that form (one matmul per product and
head), which again differs from the kernels only in accumulation order.

The simulator loops over (batch, query head) and holds whole ``(Nq, Nk)``
matrices per head (and, for the intermediates, every head's): :func:`peak_bytes`
says how much, and every entry point refuses up front (ValueError) a call that
would exceed :data:`sagecupy.reference.attention.MEMORY_LIMIT`. The kernels'
index limits do not apply here.
"""
from __future__ import annotations

import numpy as np

from sagecupy.config import DEFAULT, SageBwdConfig, get_config

from .attention import (
    as_float64,
    check_memory,
    check_qkv,
    dense_bytes,
    from_hnd,
    kv_head_index,
    packed_sequences,
    resolve_sm_scale,
    resolve_window,
    sum_kv_groups,
    to_hnd,
    visible_mask,
)
from .quant import INT8_QMAX, quantize_tiles

__all__ = ["quantize_inputs", "forward", "backward", "run", "peak_bytes", "RESIDUAL_KEYS"]

#: Keys of the ``residuals`` dict returned by :func:`forward` (docs/algorithms.md §3.5).
RESIDUAL_KEYS = (
    "q_codes",       # (B, Hq, Nq, D) int16
    "q_scale",       # (B, Hq, Nq)
    "k_codes",       # (B, Hkv, Nk, D) int16
    "k_scale",       # (B, Hkv, Nk)
    "v",             # (B, Hkv, Nk, D) float64, the unquantized V (dP = dO Vᵀ)
    "o",             # (B, Hq, Nq, D) float64, the forward output
    "lse_internal",  # (B, Hq, Nq), LSE of the smoothed quantized logits S (backward's P)
    "lse",           # (B, Hq, Nq), public LSE of the unsmoothed logits
    "mu_k",          # (B, Hkv, D)
    "mu_q",          # (B, Hq, nqb, D)
    "bias",          # (B, Hq, nqb, Nk)
    "causal",        # bool
    "window",        # None or (left, right) as given to forward (docs/algorithms.md §1.8)
    "sm_scale",      # float
    "layout",        # "HND" | "NHD" (the layout of the caller's arrays)
    "config",        # SageBwdConfig
    "dtype",         # "float16" | "bfloat16" | None: the inputs' 16-bit type (P's rounding for dv_int8=False)
)

_DTYPES16 = ("float16", "bfloat16")
# The kernels work in base 2: Q's stored scale is s_Q * log2(e) in float32 (sagecupy/int8.py LOG2E), and dK is
# multiplied by ln 2 at the end. Wherever a value is rounded on that grid (Y in bf16, ds_int8=False), the simulator
# rounds the same float32 products.
_LOG2E = 1.4426950408889634
#: How far (base-2 logit units) a tile's max may exceed the running frame before the forward's frame moves (the
#: kernels' FWD_RESCALE_SLACK); with ``pv_int8=False`` the rounding of P̃ depends on the frame (module docstring).
FWD_RESCALE_SLACK = 8.0


def _dtype16(dtype, q):
    """``dtype`` checked, or q's dtype name when it is a 16-bit float (ml_dtypes' bfloat16 included), else None."""
    if dtype is None:
        name = getattr(getattr(q, "dtype", None), "name", None)
        return name if name in _DTYPES16 else None
    if dtype not in _DTYPES16:
        raise ValueError(f"dtype={dtype!r} is not supported; supported: 'float16', 'bfloat16', or None (q's dtype "
                         f"when it is one of those, else no rounding)")
    return dtype


def _round16(x: np.ndarray, dtype) -> np.ndarray:
    """``x`` rounded to fp32 and then to ``dtype`` (round to nearest even each time, as the kernels' conversions of
    their fp32 values), as float64; ``dtype=None``: ``x`` unchanged."""
    if dtype is None:
        return x
    from sagecupy.analysis import round_to_dtype

    # (fp32 values are exact in float64, so rounding them from float64 is rounding from fp32)
    return round_to_dtype(np.asarray(x, dtype=np.float32), "fp16" if dtype == "float16" else "bf16")


# Peak bytes per (query row, key) entry, both padded to the config's tiles: one head's working set (the backward's,
# the larger: S, P, its codes and scales, dP, dS, the folded X and Y with theirs, NumPy's temporaries), and what the
# intermediates keep of every head (forward and backward). Upper bounds of tracemalloc's peak with a margin
# (tests/cpu/test_ref_chunked.py).
_HEAD_BYTES, _KEPT_BYTES = 144, 96


def peak_bytes(B: int, Hq: int, Nq: int, Nk: int, D: int, config=DEFAULT, *, intermediates: bool = False) -> int:
    """Bytes a :func:`forward` + :func:`backward` of this size holds at its peak (``intermediates``: as :func:`run`
    does, every head's ``(Nq, Nk)`` intermediates kept), what :func:`check_memory` compares with the limit."""
    cfg = get_config(config)
    nq = -(-Nq // max(cfg.block_q, cfg.bwd_block_q)) * max(cfg.block_q, cfg.bwd_block_q)
    nk = -(-Nk // max(cfg.block_kv, cfg.bwd_block_kv)) * max(cfg.block_kv, cfg.bwd_block_kv)
    return dense_bytes(B, Hq, nq, nk, D, scores=_KEPT_BYTES if intermediates else 0, head_scores=_HEAD_BYTES,
                       rows=16)


def _check_memory(B, Hq, Nq, Nk, D, cfg, intermediates):
    check_memory(f"the float64 SageBwd simulator (B={B}, Hq={Hq}, Nq={Nq}, Nk={Nk}, D={D}, dense (Nq, Nk) matrices"
                 f"{' of every head' if intermediates else ' per head'})",
                 peak_bytes(B, Hq, Nq, Nk, D, cfg, intermediates=intermediates))


# ----------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------


def _quant(cfg: SageBwdConfig, x, tile_rows, tile_cols, *, qmax=INT8_QMAX, unsigned=False, fp32=False):
    """:func:`quantize_tiles`, or the identity (values, unit scales of the same shape) if not ``cfg.quantize``."""
    if cfg.quantize:
        return quantize_tiles(x, tile_rows, tile_cols, qmax=qmax, unsigned=unsigned, fp32=fp32)
    N, D = x.shape[-2:]
    shape = (*x.shape[:-2], 1 if tile_rows is None else N, 1 if tile_cols is None else D)
    return np.array(x, dtype=np.float64), np.ones(shape)


def _rows(blocks: np.ndarray, block: int, n: int) -> np.ndarray:
    """Repeat per-block rows ``(..., nblocks, X)`` on their ``block`` rows -> ``(..., n, X)``."""
    return np.repeat(blocks, block, axis=-2)[..., :n, :]


def _check_bool(value, name: str) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be a bool, got {value!r}")
    return bool(value)


def _logits(qc, qs, kc, ks, bias_rows, mask) -> np.ndarray:
    """``S = ((Q̂ K̂ᵀ) · s_Q[i]) · s_K[j] + bias``, ``−inf`` where ``mask`` is False.

    ``qc (Nq, D)``, ``kc (Nk, D)`` codes; ``qs (Nq,)``, ``ks (Nk,)`` per-row
    scales; ``bias_rows (Nq, Nk)``. The code product is computed in float64,
    which is exact for int8 codes (|Σ| <= 255·127·D << 2^53).
    """
    s = (np.asarray(qc, np.float64) @ np.asarray(kc, np.float64).T) * qs[:, None] * ks[None, :]
    return np.where(mask, s + bias_rows, -np.inf)


def _forward_head(S, pv_rhs, cfg: SageBwdConfig, dtype=None):
    """The closed form of the online softmax (module docstring, step 4) for one head.

    ``S (Nq, Nk)`` logits (``−inf`` = invisible), ``pv_rhs = V̂ ⊙ s_V`` per row
    ``(Nk, D)``. Returns ``o, lse_internal, tile_max (Nq, T), m (Nq,), l (Nq,),
    p_codes (Nq, Nk), p_weight (Nq, T)``. "No visible key" is tested as
    ``== −inf`` (not ``isfinite``) so that a NaN input propagates into ``O``.
    """
    Nq, Nk = S.shape
    bkv = cfg.block_kv
    T = -(-Nk // bkv)
    padded = np.full((Nq, T * bkv), -np.inf)
    padded[:, :Nk] = S
    tiles = padded.reshape(Nq, T, bkv)
    tile_max = tiles.max(axis=-1)                       # r_t, −inf for a tile with no visible key
    tile_seen = tile_max != -np.inf
    r_safe = np.where(tile_seen, tile_max, 0.0)         # avoids −inf − (−inf)
    m = tile_max.max(axis=-1)                           # M, the row max
    row_seen = m != -np.inf
    m_safe = np.where(row_seen, m, 0.0)
    if not cfg.pv_int8:  # the 16-bit P.V: P~ in the lazy frame f_t, rounded to the 16-bit type (module docstring)
        r2 = tile_max * _LOG2E
        frame = np.empty_like(r2)
        f = np.full(Nq, -np.inf)
        for t in range(T):
            f = np.where(r2[:, t] > f + FWD_RESCALE_SLACK, r2[:, t], f)
            frame[:, t] = f
        f_safe = np.where(frame == -np.inf, 0.0, frame)
        p_codes = np.exp2(tiles * _LOG2E - f_safe[..., None])   # 0 where invisible
        if cfg.quantize:
            p_codes = _round16(p_codes, dtype)
        p_weight = np.where(frame == -np.inf, 0.0, np.exp2(f_safe - (m_safe * _LOG2E)[:, None]))
    else:
        p_tilde = np.exp(tiles - r_safe[..., None])     # e^{S − r_t} in [0, 1], 0 where invisible
        p_codes = p_tilde * cfg.p_max
        if cfg.quantize:
            p_codes = np.rint(p_codes)                  # P̂ = rint(p_max · e^{S − r_t})
        p_weight = np.where(tile_seen, np.exp(r_safe - m_safe[:, None]), 0.0) / cfg.p_max   # w_t
    a = (p_codes * p_weight[..., None]).reshape(Nq, T * bkv)[:, :Nk]
    o_num = a @ pv_rhs
    l = np.exp(S - m_safe[:, None]).sum(axis=-1)        # unquantized row sum
    l_safe = np.where(row_seen, l, 1.0)
    o = np.where(row_seen[:, None], o_num / l_safe[:, None], 0.0)
    lse = np.where(row_seen, m_safe + np.log(l_safe), -np.inf)
    p_codes = p_codes.reshape(Nq, T * bkv)[:, :Nk]
    return o, lse, tile_max, m, l, p_codes, p_weight


def _backward_head(S, lse, o, do, v, qc, qs, kc, ks, mu_q_rows, mu_k, sm_scale, cfg: SageBwdConfig, delta=None,
                   dtype=None):
    """docs/algorithms.md §4 for one head; returns ``(dq, dk, dv, intermediates)`` (module docstring, Backward).

    ``delta``: the rows' ``δ`` when it comes from elsewhere (a key block of a longer sequence takes the δ of the
    whole row, docs/algorithms.md §9); None computes it from ``o``. ``dtype``: the inputs' 16-bit type, which P
    is rounded to for ``dV`` when ``cfg.dv_int8`` is False."""
    bq, bkv = cfg.bwd_block_q, cfg.bwd_block_kv
    if delta is None:
        delta = np.sum(do * o, axis=-1)
    do_codes, do_scale = _quant(cfg, do, bq, None if cfg.do_granularity == "block" else 1, fp32=cfg.quantize)
    row_ok = lse != -np.inf
    lse_safe = np.where(row_ok, lse, 0.0)
    p = np.where(row_ok[:, None], np.exp(S - lse_safe[:, None]), 0.0)   # 0 where S = −inf
    if cfg.dv_int8:
        p_codes, p_scale = _quant(
            cfg, p, bq, 1 if cfg.p_bwd_granularity == "column" else bkv, qmax=cfg.p_max, unsigned=cfg.p_unsigned
        )
        dv = (p_codes * p_scale).T @ (do_codes * do_scale)
    else:  # (P in the inputs' 16-bit type, or itself without quantize: its "codes" are those values, at unit scale)
        p_codes = _round16(p, dtype) if cfg.quantize else p
        p_scale = np.ones_like(p_codes)
        dv = p_codes.T @ do
    dp = do @ v.T
    ds = p * (dp - delta[:, None])
    x = ds * ks[None, :]                                 # fold s_K into dS (dQ path)
    y = qs[:, None] * ds                                 # fold s_Q into dS (dK path)
    if cfg.ds_int8:
        x_codes, x_scale = _quant(cfg, x, 1 if cfg.ds_granularity == "rowcol" else bq, bkv)
        y_codes, y_scale = _quant(cfg, y, bq, 1 if cfg.ds_granularity == "rowcol" else bkv)
    elif cfg.quantize:  # X, Y in bf16: X at unit scale; Y as the kernels round it, log2(e) s_Q dS, at scale ln 2
        x_codes, x_scale = _round16(x, "bfloat16"), np.ones_like(x)
        qs2 = (np.asarray(qs, np.float32) * np.float32(_LOG2E)).astype(np.float64)
        y_codes, y_scale = _round16(qs2[:, None] * ds, "bfloat16"), np.full_like(y, np.log(2.0))
    else:  # (without quantize: X and Y themselves, at unit scale)
        x_codes, y_codes, x_scale, y_scale = x, y, np.ones_like(x), np.ones_like(y)
    dq = sm_scale * ((x_codes * x_scale) @ np.asarray(kc, np.float64))
    dk = (y_codes * y_scale).T @ np.asarray(qc, np.float64)
    if cfg.q_smoothing:
        dk = dk + sm_scale * (ds.T @ mu_q_rows)
    if cfg.ds_rowsum_correction:
        dq = dq + sm_scale * ds.sum(axis=-1)[:, None] * mu_k[None, :]
    inter = {
        "delta": delta, "P": p, "dP": dp, "dS": ds,
        "dO_codes": do_codes, "dO_scale": do_scale,
        "P_bwd_codes": p_codes, "P_bwd_scale": p_scale,
        "X_codes": x_codes, "X_scale": x_scale,
        "Y_codes": y_codes, "Y_scale": y_scale,
    }
    return dq, dk, dv, inter


# ----------------------------------------------------------------------------
# public API
# ----------------------------------------------------------------------------


def quantize_inputs(q, k, v, *, sm_scale=None, layout="HND", config=DEFAULT, cu_seqlens_q=None, cu_seqlens_k=None,
                    max_seqlen_q=None, max_seqlen_k=None, mu_k=None, v_amax=None):
    """Smoothing and quantization of the forward's operands (steps 1-2); a dict of HND arrays.

    Keys and shapes are in the module docstring's table: ``q_codes, q_scale,
    k_codes, k_scale, v_codes, v_scale, mu_k, mu_q, bias, sm_scale``. Packed
    (``layout="THD"``): a list with one such dict (batch 1) per sequence, None
    for a sequence without queries or keys; every statistic is the sequence's own.

    ``mu_k`` (``(B, Hkv, D)``, with ``k_smoothing``) and ``v_amax`` (``(B, Hkv, D)``, the per-channel
    ``max|V|``, with ``v_granularity="channel"``) replace the statistics this call would take over its own
    keys: ``k, v`` are then one block of a longer sequence whose statistics were reduced over all its blocks
    (docs/algorithms.md §9, ``reference/context_parallel.py``). Given the values this call computes itself,
    the result is bit for bit the same.
    """
    packed = packed_sequences(q, k, v, layout, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    if packed is not None and (mu_k is not None or v_amax is not None):
        raise ValueError("mu_k and v_amax are statistics of one sequence; a packed call takes each sequence's own")
    if packed is not None:
        return [quantize_inputs(q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], sm_scale=sm_scale, layout="NHD",
                                config=config) if q1 > q0 and k1 > k0 else None for q0, q1, k0, k1 in packed[1]]
    cfg = get_config(config)
    B, Hq, Hkv, Nq, Nk, D = check_qkv(q, k, v, layout)
    scale = resolve_sm_scale(sm_scale, D)
    qh = as_float64(to_hnd(q, layout), "q")
    kh = as_float64(to_hnd(k, layout), "k")
    vh = as_float64(to_hnd(v, layout), "v")

    # With quantization on, the input quantizers run in IEEE float32 exactly as the GPU pre-passes do
    # (the K mean rounded to float32, K - mu_K and sm_scale * Q rounded to float32, psi in float32), so
    # the codes of Q, K, V (and dO) are bit-identical to the kernels'. Off, everything is float64.
    f32 = cfg.quantize and not cfg.q_smoothing
    if mu_k is None:
        mu_k = kh.mean(axis=-2) if cfg.k_smoothing else np.zeros((B, Hkv, D))
    else:
        mu_k = _given_stat(mu_k, "mu_k", (B, Hkv, D), cfg.k_smoothing, "k_smoothing is off")
    if f32:
        mu_k = mu_k.astype(np.float32).astype(np.float64)
        ks = (kh.astype(np.float32) - mu_k[..., None, :].astype(np.float32)).astype(np.float64)
    else:
        ks = kh - mu_k[..., None, :]
    nqb = -(-Nq // cfg.block_q)
    if cfg.q_smoothing:
        padded = np.zeros((B, Hq, nqb * cfg.block_q, D))
        padded[..., :Nq, :] = qh
        sums = padded.reshape(B, Hq, nqb, cfg.block_q, D).sum(axis=-2)
        counts = np.minimum(cfg.block_q, Nq - cfg.block_q * np.arange(nqb))   # last block partial
        mu_q = sums / counts[:, None]
        ks_q = ks[:, kv_head_index(Hq, Hkv)]                                  # (B, Hq, Nk, D)
        bias = scale * (mu_q @ np.swapaxes(ks_q, -1, -2))                     # (B, Hq, nqb, Nk)
    else:
        mu_q = np.zeros((B, Hq, nqb, D))
        bias = np.zeros((B, Hq, nqb, Nk))
    qs = qh - _rows(mu_q, cfg.block_q, Nq)

    q_rows = 1 if cfg.q_granularity == "token" else cfg.block_q
    k_rows = 1 if cfg.k_granularity == "token" else cfg.block_kv
    q_in = (qs.astype(np.float32) * np.float32(scale)).astype(np.float64) if f32 else scale * qs
    q_codes, q_scale = _quant(cfg, q_in, q_rows, None, fp32=f32)
    k_codes, k_scale = _quant(cfg, ks, k_rows, None, fp32=f32)
    if v_amax is not None:
        v_amax = _given_stat(v_amax, "v_amax", (B, Hkv, D), cfg.v_granularity == "channel",
                             "v_granularity is 'block' (v_amax is a per-channel statistic)")
        with np.errstate(invalid="ignore"):
            if (np.abs(vh).max(axis=-2) > v_amax).any():
                raise ValueError("v_amax is below this block's own max|v| in some channel: it must be the max "
                                 "over every block, this one included")
    if cfg.v_granularity == "channel" and v_amax is not None:
        # psi takes a block's scale from its own max|x|: one extra row holding the global max makes that max
        # the block's, so the real rows get the codes and scales of the whole sequence.
        v_codes, v_scale = _quant(cfg, np.concatenate([vh, v_amax[..., None, :]], axis=-2), None, 1, fp32=f32)
        v_codes = np.ascontiguousarray(v_codes[..., :-1, :])
    elif cfg.v_granularity == "channel":
        v_codes, v_scale = _quant(cfg, vh, None, 1, fp32=f32)                 # (B, Hkv, 1, D)
    else:
        v_codes, v_scale = _quant(cfg, vh, cfg.block_kv, None, fp32=f32)      # per row (B, Hkv, Nk, 1)
        v_scale = np.ascontiguousarray(np.broadcast_to(v_scale[..., :: cfg.block_kv, :],
                                                       (B, Hkv, -(-Nk // cfg.block_kv), D)))
    return {
        "q_codes": q_codes, "q_scale": q_scale[..., 0],
        "k_codes": k_codes, "k_scale": k_scale[..., 0],
        "v_codes": v_codes, "v_scale": v_scale,
        "mu_k": mu_k, "mu_q": mu_q, "bias": bias, "sm_scale": scale,
    }


def _given_stat(x, name: str, shape, used: bool, why_unused: str) -> np.ndarray:
    """A statistic passed to :func:`quantize_inputs`, as float64 of ``shape``."""
    if not used:
        raise ValueError(f"{name} was given, but config.{why_unused}")
    arr = as_float64(x, name)
    if arr.shape != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {arr.shape}")
    return arr


def _v_rows(v_scale: np.ndarray, cfg: SageBwdConfig, Nk: int) -> np.ndarray:
    """One head's ``v_scale (nv, D)`` as per-row scales ``(Nk, D)`` or ``(1, D)``."""
    if cfg.v_granularity == "channel":
        return v_scale
    return _rows(v_scale, cfg.block_kv, Nk)


def forward(q, k, v, *, causal=False, sm_scale=None, layout="HND", config=DEFAULT, return_intermediates=False,
            window=None, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None, dtype=None):
    """SageBwd forward. Returns ``(o, residuals)`` or ``(o, residuals, intermediates)``.

    ``o``: float64 in ``layout``. ``residuals``: dict with :data:`RESIDUAL_KEYS`
    (HND arrays, see the module docstring). ``intermediates`` (HND float64):

    * ``"S"`` ``(B, Hq, Nq, Nk)``: the smoothed quantized logits (``−inf`` invisible);
    * ``"tile_max"`` ``(B, Hq, Nq, T)``, ``T = ceil(Nk / block_kv)``: ``r_t``
      (``−inf`` where a row sees no key of tile ``t``);
    * ``"m"``, ``"l"`` ``(B, Hq, Nq)``: the row max ``M`` and ``Σ_j e^{S_j − M}``;
    * ``"P_fwd_codes"`` ``(B, Hq, Nq, Nk)``: ``P̂`` (int16; float64 if not
      quantizing, or with ``pv_int8=False`` the rounded ``2^{S₂ − f_t}``); ``"P_fwd_weight"``
      ``(B, Hq, Nq, T)``: ``w_t = e^{r_t − M}/p_max`` (``2^{f_t − M₂}`` with ``pv_int8=False``),
      the online ``s_P`` of tile ``t`` rescaled to the final max;
    * ``"P"`` ``(B, Hq, Nq, Nk)``: ``exp(S − lse_internal)``, the softmax of ``S``.

    ``window``: a sliding window (docs/algorithms.md §1.8); tiles are masked, the
    quantization statistics stay those of all the keys. Packed (``layout="THD"``,
    ``cu_seqlens_q/k``): :func:`_packed_forward`. ``dtype``: the 16-bit type the kernels compute in
    (``"float16"``, ``"bfloat16"``), which the backward rounds P to where a product keeps 16 bits
    (``config.dv_int8=False``); None: q's dtype when it is one of those, else P stays unrounded.
    """
    cfg = get_config(config)
    dtype = _dtype16(dtype, q)
    causal = _check_bool(causal, "causal")
    resolve_window(causal, window)
    return_intermediates = _check_bool(return_intermediates, "return_intermediates")
    packed = packed_sequences(q, k, v, layout, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    if packed is not None:
        return _packed_forward(q, k, v, packed, return_intermediates, causal=causal, sm_scale=sm_scale,
                               config=cfg, window=window, dtype=dtype)
    B, Hq, Hkv, Nq, Nk, D = check_qkv(q, k, v, layout)
    _check_memory(B, Hq, Nq, Nk, D, cfg, return_intermediates)
    qi = quantize_inputs(q, k, v, sm_scale=sm_scale, layout=layout, config=cfg)
    scale = qi["sm_scale"]
    qh = as_float64(to_hnd(q, layout), "q")
    vh = as_float64(to_hnd(v, layout), "v")
    mask = visible_mask(Nq, Nk, causal, window)
    kv_of = kv_head_index(Hq, Hkv)
    T = -(-Nk // cfg.block_kv)

    o = np.zeros((B, Hq, Nq, D))
    lse_int = np.zeros((B, Hq, Nq))
    if return_intermediates:
        inter = {
            "S": np.zeros((B, Hq, Nq, Nk)), "tile_max": np.zeros((B, Hq, Nq, T)),
            "m": np.zeros((B, Hq, Nq)), "l": np.zeros((B, Hq, Nq)),
            "P_fwd_codes": np.zeros((B, Hq, Nq, Nk), dtype=np.int16 if cfg.quantize and cfg.pv_int8 else np.float64),
            "P_fwd_weight": np.zeros((B, Hq, Nq, T)), "P": np.zeros((B, Hq, Nq, Nk)),
        }
    for b in range(B):
        for h in range(Hq):
            g = kv_of[h]
            S = _logits(qi["q_codes"][b, h], qi["q_scale"][b, h], qi["k_codes"][b, g], qi["k_scale"][b, g],
                        _rows(qi["bias"][b, h], cfg.block_q, Nq), mask)
            pv_rhs = vh[b, g] if not cfg.pv_int8 else qi["v_codes"][b, g] * _v_rows(qi["v_scale"][b, g], cfg, Nk)
            o[b, h], lse_int[b, h], tmax, m, l, pc, pw = _forward_head(S, pv_rhs, cfg, dtype)
            if return_intermediates:
                inter["S"][b, h], inter["tile_max"][b, h], inter["m"][b, h], inter["l"][b, h] = S, tmax, m, l
                inter["P_fwd_codes"][b, h], inter["P_fwd_weight"][b, h] = pc, pw
                seen = lse_int[b, h] != -np.inf
                lse_safe = np.where(seen, lse_int[b, h], 0.0)
                inter["P"][b, h] = np.where(seen[:, None], np.exp(S - lse_safe[:, None]), 0.0)
            del S, pc  # (else this head's (Nq, Nk) arrays live on while the next head's are made)

    # Public LSE: add back sm_scale · q_i · μ_K with the unsmoothed q (step 5).
    q_dot_mu = np.einsum("bhnd,bhd->bhn", qh, qi["mu_k"][:, kv_of])
    lse = np.where(lse_int != -np.inf, lse_int + scale * q_dot_mu, -np.inf)
    residuals = {
        "q_codes": qi["q_codes"], "q_scale": qi["q_scale"],
        "k_codes": qi["k_codes"], "k_scale": qi["k_scale"],
        "v": vh, "o": o, "lse_internal": lse_int, "lse": lse,
        "mu_k": qi["mu_k"], "mu_q": qi["mu_q"], "bias": qi["bias"],
        "causal": causal, "window": window, "sm_scale": scale, "layout": layout, "config": cfg, "dtype": dtype,
    }
    out = from_hnd(o, layout)
    if return_intermediates:
        return out, residuals, inter
    return out, residuals


def _check_residuals(residuals) -> None:
    if not isinstance(residuals, dict):
        raise TypeError(f"residuals must be the dict returned by forward(), got {type(residuals).__name__}")
    optional = ("window", "dtype")  # (None if absent)
    missing = [key for key in RESIDUAL_KEYS if key not in residuals and key not in optional]
    if missing:
        raise ValueError(f"residuals is missing keys {missing}; pass the dict returned by forward()")
    if not isinstance(residuals["config"], SageBwdConfig):
        raise TypeError(f"residuals['config'] must be a SageBwdConfig, got {type(residuals['config']).__name__}")


def backward(residuals, do, *, return_intermediates=False):
    """SageBwd backward. Returns ``(dq, dk, dv)`` float64 in the forward's layout (``+ intermediates``).

    ``do`` has the shape of the forward output (in the forward's ``layout``).
    ``intermediates`` (HND float64 unless noted):

    * ``"delta"`` ``(B, Hq, Nq)``; ``"P"``, ``"dP"``, ``"dS"`` ``(B, Hq, Nq, Nk)``
      (``dS`` in exact arithmetic from the simulated ``P``; the tensor that is
      then folded and quantized);
    * ``"dO_codes"`` ``(B, Hq, Nq, D)`` int16, ``"dO_scale"`` ``(B, Hq, Nq, 1)``
      (``"block"``: a row block's scale repeated on its rows) or
      ``(B, Hq, Nq, D)`` (``"channel"``);
    * ``"P_bwd_codes"``, ``"X_codes"`` (``dS·diag(s_K)``), ``"Y_codes"``
      (``diag(s_Q)·dS``) ``(B, Hq, Nq, Nk)`` int16 and their ``*_scale``
      ``(B, Hq, Nq, Nk)`` (each tile's scale repeated over the entries it covers);
      with ``dv_int8=False`` ``"P_bwd_codes"`` is the 16-bit P (float64) at scale 1, with ``ds_int8=False``
      ``"X_codes"`` is X in bf16 at scale 1 and ``"Y_codes"`` log2(e)·Y in bf16 at scale ln 2 (float64).

    With ``config.quantize=False`` the codes are float64 values and scales 1.
    Packed residuals (``layout="THD"``): ``do`` ``(total_q, Hq, D)``; ``dq``
    ``(total_q, Hq, D)``, ``dk``, ``dv`` ``(total_k, Hkv, D)``; intermediates a
    list per sequence (None for an empty one).
    """
    return_intermediates = _check_bool(return_intermediates, "return_intermediates")
    if isinstance(residuals, dict) and residuals.get("layout") == "THD":
        return _packed_backward(residuals, do, return_intermediates)
    _check_residuals(residuals)
    cfg: SageBwdConfig = residuals["config"]
    layout = residuals["layout"]
    scale = residuals["sm_scale"]
    B, Hq, Nq, D = residuals["o"].shape
    Hkv, Nk = residuals["k_codes"].shape[1:3]
    if not hasattr(do, "ndim") or not hasattr(do, "shape"):
        raise TypeError(f"do must be a NumPy array, got {type(do).__name__}")
    if do.ndim != 4 or tuple(to_hnd(do, layout).shape) != (B, Hq, Nq, D):
        raise ValueError(f"do must have the output's HND shape {(B, Hq, Nq, D)} ({layout=}), got shape {tuple(do.shape)}")
    _check_memory(B, Hq, Nq, Nk, D, cfg, return_intermediates)
    doh = as_float64(to_hnd(do, layout), "do")
    mask = visible_mask(Nq, Nk, residuals["causal"], residuals.get("window"))
    kv_of = kv_head_index(Hq, Hkv)

    dq = np.zeros((B, Hq, Nq, D))
    dk = np.zeros((B, Hq, Nk, D))   # per query head; summed over GQA groups at the end
    dv = np.zeros((B, Hq, Nk, D))
    inter = {}
    for b in range(B):
        for h in range(Hq):
            g = kv_of[h]
            qc, qs = residuals["q_codes"][b, h], residuals["q_scale"][b, h]
            kc, ks = residuals["k_codes"][b, g], residuals["k_scale"][b, g]
            S = _logits(qc, qs, kc, ks, _rows(residuals["bias"][b, h], cfg.block_q, Nq), mask)
            dq[b, h], dk[b, h], dv[b, h], head = _backward_head(
                S, residuals["lse_internal"][b, h], residuals["o"][b, h], doh[b, h], residuals["v"][b, g],
                qc, qs, kc, ks, _rows(residuals["mu_q"][b, h], cfg.block_q, Nq), residuals["mu_k"][b, g],
                scale, cfg, dtype=residuals.get("dtype"),
            )
            if return_intermediates:
                for key, value in head.items():
                    if key not in inter:
                        inter[key] = np.zeros((B, Hq, *value.shape), dtype=value.dtype)
                    inter[key][b, h] = value
            del S, head  # (else this head's (Nq, Nk) arrays live on while the next head's are made)
    grads = (dq, sum_kv_groups(dk, Hkv), sum_kv_groups(dv, Hkv))
    grads = tuple(from_hnd(x, layout) for x in grads)
    if return_intermediates:
        return (*grads, inter)
    return grads


def run(q, k, v, do, *, causal=False, sm_scale=None, layout="HND", config=DEFAULT, window=None, cu_seqlens_q=None,
        cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None, dtype=None) -> dict:
    """Forward and backward with every intermediate, as one dict of HND float64 arrays.

    The keys shared with :func:`sagecupy.reference.attention.attention_intermediates`
    mean the same thing: ``"O"``, ``"lse"`` (public), ``"dQ"``, ``"dK"``, ``"dV"``
    (HND whatever ``layout`` the inputs use), ``"S"``, ``"P"``, ``"dP"``,
    ``"dS"`` ``(B, Hq, Nq, Nk)``, ``"delta"`` ``(B, Hq, Nq)``. Also
    ``"lse_internal"`` and the forward's and backward's other intermediates
    (see :func:`forward` and :func:`backward`; the backward's ``"P"`` is
    reported, which equals the forward's).

    Packed (``layout="THD"``): ``"O"``, ``"dQ"`` ``(total_q, Hq, D)``, ``"dK"``,
    ``"dV"`` ``(total_k, Hkv, D)``, ``"lse"``, ``"lse_internal"`` ``(Hq, total_q)``
    and ``"sequences"``, the list of each sequence's own dict (None if empty). ``dtype``: as :func:`forward`'s.
    """
    packed = packed_sequences(q, k, v, layout, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    if packed is not None:
        o, res = forward(q, k, v, causal=causal, sm_scale=sm_scale, layout=layout, config=config, window=window,
                         cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, dtype=dtype)
        dq, dk, dv = backward(res, do)
        seqs = [None if r is None else run(q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], do[None, q0:q1],
                                           causal=causal, sm_scale=sm_scale, layout="NHD", config=config,
                                           window=window, dtype=dtype)
                for r, (q0, q1, k0, k1) in zip(res["sequences"], packed[1])]
        return {"O": o, "lse": res["lse"], "lse_internal": res["lse_internal"], "dQ": dq, "dK": dk, "dV": dv,
                "sequences": seqs}
    B, Hq, _, Nq, Nk, D = check_qkv(q, k, v, layout)
    _check_memory(B, Hq, Nq, Nk, D, get_config(config), True)  # (before the forward: the backward's keep too)
    o, residuals, fwd = forward(q, k, v, causal=causal, sm_scale=sm_scale, layout=layout, config=config,
                                return_intermediates=True, window=window, dtype=dtype)
    dq, dk, dv, bwd = backward(residuals, do, return_intermediates=True)
    out = dict(fwd)
    out.update(bwd)
    out.update({
        "O": residuals["o"], "lse": residuals["lse"], "lse_internal": residuals["lse_internal"],
        "dQ": to_hnd(dq, layout), "dK": to_hnd(dk, layout), "dV": to_hnd(dv, layout),
    })
    return out


# ----------------------------------------------------------------------------
# packed sequences (layout "THD", docs/algorithms.md §1.8)
# ----------------------------------------------------------------------------


def _packed_forward(q, k, v, packed, return_intermediates, **kw):
    """:func:`forward` once per sequence (batch 1, NHD views), so that μ_K, the V channel scales and every other
    statistic are the sequence's own and a packed call equals the separate calls.

    Returns ``o`` ``(total_q, Hq, D)`` and residuals ``{"layout": "THD", "sequences": [one forward's residuals,
    or None for a sequence without queries or keys], "spans", "shape", "o", "lse", "lse_internal"}`` (the LSEs
    ``(Hq, total_q)``, ``−inf`` in rows that see no key); with ``return_intermediates`` also the list of each
    sequence's intermediates (None where empty).
    """
    (Hq, Hkv, Tq, Tk, D), spans = packed
    resolve_sm_scale(kw["sm_scale"], D)
    o = np.zeros((Tq, Hq, D))
    lse, lse_int = np.full((Hq, Tq), -np.inf), np.full((Hq, Tq), -np.inf)
    seqs, inters = [], []
    for q0, q1, k0, k1 in spans:
        if q1 == q0 or k1 == k0:
            seqs.append(None)
            inters.append(None)
            continue
        r = forward(q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], layout="NHD",
                    return_intermediates=return_intermediates, **kw)
        o[q0:q1] = r[0][0]
        lse[:, q0:q1], lse_int[:, q0:q1] = r[1]["lse"][0], r[1]["lse_internal"][0]
        seqs.append(r[1])
        inters.append(r[2] if return_intermediates else None)
    residuals = {"layout": "THD", "sequences": seqs, "spans": spans, "shape": (Hq, Hkv, Tq, Tk, D), "o": o,
                 "lse": lse, "lse_internal": lse_int}
    return (o, residuals, inters) if return_intermediates else (o, residuals)


def _packed_backward(residuals, do, return_intermediates):
    """:func:`backward` of :func:`_packed_forward`'s residuals, sequence by sequence."""
    for key in ("sequences", "spans", "shape"):
        if key not in residuals:
            raise ValueError(f"packed residuals are missing {key!r}; pass the dict returned by forward()")
    Hq, Hkv, Tq, Tk, D = residuals["shape"]
    if not hasattr(do, "shape") or tuple(do.shape) != (Tq, Hq, D):
        raise ValueError(f"do must have shape {(Tq, Hq, D)} (layout='THD'), got {tuple(getattr(do, 'shape', ()))}")
    dq, dk, dv = np.zeros((Tq, Hq, D)), np.zeros((Tk, Hkv, D)), np.zeros((Tk, Hkv, D))
    inters = []
    for res, (q0, q1, k0, k1) in zip(residuals["sequences"], residuals["spans"]):
        if res is None:
            inters.append(None)
            continue
        g = backward(res, do[None, q0:q1], return_intermediates=return_intermediates)
        dq[q0:q1], dk[k0:k1], dv[k0:k1] = g[0][0], g[1][0], g[2][0]
        inters.append(g[3] if return_intermediates else None)
    return (dq, dk, dv, inters) if return_intermediates else (dq, dk, dv)
