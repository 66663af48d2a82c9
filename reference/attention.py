"""Exact attention in float64: the ground truth every sagecupy family is measured against.

docs/algorithms.md §1 in code. Everything here is computed in float64 with plain vectorized
NumPy. Two forms: the dense one (:func:`attention_forward`,
:func:`attention_backward`, :func:`attention_intermediates`) holds whole
``(B, Hq, Nq, Nk)`` score matrices; the chunked one (:func:`attention_chunked`,
:func:`attention_forward_chunked`, :func:`attention_backward_chunked`) walks
key and query blocks with an online softmax and holds ``O(N·D)`` per head plus
one block, for long sequences. They agree to float64 rounding (~1e-15
relative; tested to 1e-12). The dense functions, and the dense simulators of
the other reference modules, refuse a call whose arrays would exceed
:data:`MEMORY_LIMIT` (:func:`check_memory`). Inputs of any real dtype are
accepted and converted to float64; the caller's arrays are never modified.

Conventions
-----------
* Layout ``"HND"`` (default): ``q`` is ``(B, Hq, Nq, D)``, ``k`` and ``v`` are
  ``(B, Hkv, Nk, D)``. Layout ``"NHD"``: ``(B, N, H, D)``. Outputs follow the
  caller's layout; the LSE is always ``(B, Hq, Nq)``.
* GQA / MQA: ``Hq % Hkv == 0`` and query head ``h`` reads kv head
  ``h // (Hq // Hkv)`` (so a group is a run of consecutive query heads).
* ``sm_scale=None`` means ``1 / sqrt(D)``.
* ``causal=True`` is bottom-right aligned (FlashAttention's convention): query
  row ``i`` sees key ``j`` iff ``j <= i + (Nk - Nq)``. For ``Nq=2, Nk=5``
  (``1`` = visible)::

      1 1 1 1 0
      1 1 1 1 1

  and for ``Nq=5, Nk=2``::

      0 0
      0 0
      0 0
      1 0
      1 1

  A row that sees no key (the first ``Nq - Nk`` rows when ``Nq > Nk``) gives
  ``O = 0``, ``LSE = -inf`` and zero gradients, never NaN and never a
  floating-point warning.

Public helpers shared by the other reference modules: :func:`check_qkv`,
:func:`to_hnd` / :func:`from_hnd`, :func:`visible_mask`, :func:`kv_head_index`,
:func:`expand_kv_heads` / :func:`sum_kv_groups`, :func:`default_sm_scale` /
:func:`resolve_sm_scale`, :func:`as_float64` and :func:`masked_softmax`.
"""
from __future__ import annotations

import numbers

import numpy as np

__all__ = [
    "LAYOUTS",
    "to_hnd",
    "from_hnd",
    "check_layout",
    "check_qkv",
    "as_float64",
    "visible_mask",
    "kv_head_index",
    "expand_kv_heads",
    "sum_kv_groups",
    "default_sm_scale",
    "resolve_sm_scale",
    "masked_softmax",
    "attention_forward",
    "attention_backward",
    "attention_intermediates",
    "attention_chunked",
    "attention_forward_chunked",
    "attention_backward_chunked",
    "MEMORY_LIMIT",
    "check_memory",
    "dense_bytes",
    "dense_peak_bytes",
]

LAYOUTS = ("HND", "NHD")

#: Bytes a dense float64 reference call (exact attention with whole score matrices, or one of the quantization
#: simulators) may hold at once; a call that would need more raises ValueError up front, naming what it would need
#: (:func:`check_memory`), instead of exhausting the machine's memory. Read at call time: assign a larger value
#: (``sagecupy.reference.attention.MEMORY_LIMIT = 32 << 30``) on a machine that has it. The chunked exact functions
#: need no such limit.
MEMORY_LIMIT = 8 << 30
# Peak bytes per (B, Hq, Nq, Nk) score entry of the dense functions (scores, P, and NumPy's temporaries; the
# intermediates keep S, P, dP, dS): upper bounds of tracemalloc's peak with a margin (tests/cpu/test_ref_chunked.py).
_DENSE_FWD, _DENSE_BWD, _DENSE_INTERMEDIATES = 32, 48, 48


def _gb(nbytes: float) -> str:
    return f"{nbytes / 2**30:.1f} GiB"


def check_memory(what: str, nbytes: int) -> None:
    """ValueError if ``nbytes`` (what the dense computation ``what`` would hold at its peak) exceeds
    :data:`MEMORY_LIMIT`; the message gives both, so a caller (the ``sagecupy`` CLI prints it on one line) can
    say how far over the limit a problem is."""
    limit = MEMORY_LIMIT
    if nbytes > limit:
        raise ValueError(
            f"{what} would need about {_gb(nbytes)} of memory, more than the reference's limit of {_gb(limit)} "
            f"(sagecupy.reference.attention.MEMORY_LIMIT): use a shorter sequence or fewer heads, or raise the limit"
        )


def dense_bytes(B: int, Hq: int, Nq: int, Nk: int, D: int, *, scores: float, head_scores: float = 0.0,
                rows: float = 8.0) -> int:
    """Peak bytes of a dense float64 reference computation: ``scores`` bytes per entry of the whole ``(B, Hq, Nq,
    Nk)`` score tensor it holds at once, ``head_scores`` bytes per entry of one head's ``(Nq, Nk)`` (computations
    that loop over heads), and ``rows`` float64 ``(B, Hq, max(Nq, Nk), D)`` arrays (inputs, outputs, gradients).
    The per-function coefficients are upper bounds of tracemalloc's peak (tests/cpu/test_ref_chunked.py)."""
    return int(scores * B * Hq * Nq * Nk + head_scores * Nq * Nk + rows * 8 * B * Hq * max(Nq, Nk) * D)


def dense_peak_bytes(B: int, Hq: int, Nq: int, Nk: int, D: int, *, kind: str = "intermediates") -> int:
    """What :func:`check_memory` holds a dense exact call to: ``kind`` ``"forward"`` (:func:`attention_forward`),
    ``"backward"`` (:func:`attention_backward`) or ``"intermediates"`` (:func:`attention_intermediates`)."""
    scores = {"forward": _DENSE_FWD, "backward": _DENSE_BWD, "intermediates": _DENSE_INTERMEDIATES}[kind]
    return dense_bytes(B, Hq, Nq, Nk, D, scores=scores)


# ----------------------------------------------------------------------------
# layouts and argument checks
# ----------------------------------------------------------------------------


def check_layout(layout) -> str:
    """Return ``layout`` if it is ``"HND"`` or ``"NHD"``, else raise ValueError."""
    if not isinstance(layout, str) or layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r} is not supported; supported: {LAYOUTS}")
    return layout


def _check_4d(x, name: str) -> None:
    if not hasattr(x, "ndim") or not hasattr(x, "shape"):
        raise TypeError(f"{name} must be a NumPy array, got {type(x).__name__}")
    if x.ndim != 4:
        raise ValueError(f"{name} must be 4-D ((B, H, N, D) or (B, N, H, D)), got shape {tuple(x.shape)}")


def to_hnd(x, layout: str = "HND"):
    """View ``x`` (4-D, in ``layout``) as ``(B, H, N, D)``. No copy, dtype kept."""
    check_layout(layout)
    _check_4d(x, "x")
    return x if layout == "HND" else np.swapaxes(x, 1, 2)


def from_hnd(x, layout: str = "HND"):
    """Inverse of :func:`to_hnd`: view an HND array in ``layout``. No copy."""
    check_layout(layout)
    _check_4d(x, "x")
    return x if layout == "HND" else np.swapaxes(x, 1, 2)


def as_float64(x, name: str) -> np.ndarray:
    """A float64 copy of ``x`` (real floating or integer; ml_dtypes' bfloat16 works too).

    Raises TypeError for bool, complex, object and string arrays, naming ``name``.
    Always returns a new array, so callers may modify the result freely.
    """
    arr = np.asarray(x)
    if arr.dtype.kind in "bcOUSMm":
        raise TypeError(f"{name} must have a real numeric dtype, got {arr.dtype}")
    try:
        return np.array(arr, dtype=np.float64, copy=True)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"{name} with dtype {arr.dtype} cannot be converted to float64") from exc


def check_qkv(q, k, v, layout: str = "HND"):
    """Validate attention operands; return ``(B, Hq, Hkv, Nq, Nk, D)``.

    Requirements: all three 4-D in ``layout``; same batch; ``k`` and ``v`` of
    identical shape; the same head dim ``D`` everywhere; every dimension >= 1;
    ``Hq % Hkv == 0``. Raises ValueError (TypeError for a non-array) naming the
    offending argument and its shape.
    """
    check_layout(layout)
    for name, x in (("q", q), ("k", k), ("v", v)):
        _check_4d(x, name)
        if min(x.shape) < 1:
            raise ValueError(f"{name} has an empty dimension: shape {tuple(x.shape)}")
    qh, kh, vh = (to_hnd(x, layout) for x in (q, k, v))
    B, Hq, Nq, D = qh.shape
    Bk, Hkv, Nk, Dk = kh.shape
    if tuple(vh.shape) != tuple(kh.shape):
        raise ValueError(
            f"k and v must have the same shape, got k {tuple(k.shape)} and v {tuple(v.shape)} ({layout=})"
        )
    if Bk != B:
        raise ValueError(f"q and k must have the same batch size, got {B} and {Bk} ({layout=})")
    if Dk != D:
        raise ValueError(f"q and k must have the same head dim, got {D} and {Dk} ({layout=})")
    if Hq % Hkv:
        raise ValueError(f"the number of query heads ({Hq}) must be a multiple of the kv heads ({Hkv}) ({layout=})")
    return B, Hq, Hkv, Nq, Nk, D


def _check_like(x, name: str, shape_hnd, layout: str) -> np.ndarray:
    """Check that ``x`` (in ``layout``) has the HND shape ``shape_hnd``; return its HND float64 copy."""
    _check_4d(x, name)
    xh = to_hnd(x, layout)
    if tuple(xh.shape) != tuple(shape_hnd):
        raise ValueError(
            f"{name} must have HND shape {tuple(shape_hnd)} ({layout=}), got shape {tuple(x.shape)}"
        )
    return as_float64(xh, name)


def default_sm_scale(D: int) -> float:
    """``1 / sqrt(D)``, the softmax scale used when ``sm_scale`` is None."""
    if not isinstance(D, numbers.Integral) or isinstance(D, bool) or D < 1:
        raise ValueError(f"head dim D={D!r} must be a positive integer")
    return 1.0 / float(np.sqrt(float(D)))


def resolve_sm_scale(sm_scale, D: int) -> float:
    """``sm_scale`` as a Python float; None -> :func:`default_sm_scale` ``(D)``.

    Raises TypeError for a non-real value (a bool counts as non-real) and
    ValueError for a non-finite one. Zero and negative scales are accepted:
    the math is defined for them.
    """
    if sm_scale is None:
        return default_sm_scale(D)
    if isinstance(sm_scale, bool) or not isinstance(sm_scale, numbers.Real):
        raise TypeError(f"sm_scale must be a real number or None, got {sm_scale!r}")
    value = float(sm_scale)
    if not np.isfinite(value):
        raise ValueError(f"sm_scale={sm_scale!r} must be finite")
    return value


# ----------------------------------------------------------------------------
# masks and GQA
# ----------------------------------------------------------------------------


def visible_mask(nq: int, nk: int, causal: bool) -> np.ndarray:
    """Boolean ``(nq, nk)``: ``True`` where query row ``i`` may attend key ``j``.

    Causal is bottom-right aligned: ``j <= i + (nk - nq)``. Not causal: all True.
    """
    for name, n in (("nq", nq), ("nk", nk)):
        if not isinstance(n, numbers.Integral) or isinstance(n, bool) or n < 1:
            raise ValueError(f"{name}={n!r} must be a positive integer")
    if not isinstance(causal, (bool, np.bool_)):
        raise TypeError(f"causal must be a bool, got {causal!r}")
    if not causal:
        return np.ones((nq, nk), dtype=bool)
    i = np.arange(nq)[:, None]
    j = np.arange(nk)[None, :]
    return j <= i + (nk - nq)


def kv_head_index(Hq: int, Hkv: int) -> np.ndarray:
    """int64 ``(Hq,)``: the kv head read by each query head, ``h // (Hq // Hkv)``."""
    for name, n in (("Hq", Hq), ("Hkv", Hkv)):
        if not isinstance(n, numbers.Integral) or isinstance(n, bool) or n < 1:
            raise ValueError(f"{name}={n!r} must be a positive integer")
    if Hq % Hkv:
        raise ValueError(f"Hq={Hq} must be a multiple of Hkv={Hkv}")
    return np.arange(Hq, dtype=np.int64) // (Hq // Hkv)


def expand_kv_heads(x: np.ndarray, Hq: int) -> np.ndarray:
    """Repeat the kv heads of an HND array ``(B, Hkv, N, D)`` to ``(B, Hq, N, D)`` (a copy)."""
    return x[:, kv_head_index(Hq, x.shape[1])]


def sum_kv_groups(x: np.ndarray, Hkv: int) -> np.ndarray:
    """Sum an HND per-query-head array ``(B, Hq, N, D)`` over each GQA group -> ``(B, Hkv, N, D)``."""
    B, Hq = x.shape[:2]
    if Hq % Hkv:
        raise ValueError(f"Hq={Hq} must be a multiple of Hkv={Hkv}")
    return x.reshape(B, Hkv, Hq // Hkv, *x.shape[2:]).sum(axis=2)


# ----------------------------------------------------------------------------
# softmax
# ----------------------------------------------------------------------------


def masked_softmax(s: np.ndarray):
    """Row softmax over the last axis of float64 scores with ``-inf`` for masked entries.

    Returns ``(P, m, l, lse)``: ``m`` the row max (``-inf`` for a row with no
    finite entry), ``l = Σ_j exp(s_ij − m_i)``, ``P = exp(s − m) / l`` and
    ``lse = m + log l`` (natural log). A row with no visible key gets ``P = 0``,
    ``l = 0`` and ``lse = -inf`` without NaN or warnings (``m`` is replaced by 0
    before the subtraction so ``-inf − -inf`` never happens).
    """
    m = s.max(axis=-1)
    m_safe = np.where(np.isfinite(m), m, 0.0)
    e = np.exp(s - m_safe[..., None])  # exp(-inf) = 0 for masked entries
    l = e.sum(axis=-1)
    seen = l > 0
    p = e / np.where(seen, l, 1.0)[..., None]
    lse = np.where(seen, m_safe + np.log(np.where(seen, l, 1.0)), -np.inf)
    return p, m, l, lse


# ----------------------------------------------------------------------------
# exact attention
# ----------------------------------------------------------------------------


def _prepare(q, k, v, causal, sm_scale, layout):
    """Validate and convert: HND float64 q (B,Hq,Nq,D) and GQA-expanded k, v (B,Hq,Nk,D)."""
    B, Hq, Hkv, Nq, Nk, D = check_qkv(q, k, v, layout)
    scale = resolve_sm_scale(sm_scale, D)
    mask = visible_mask(Nq, Nk, causal)
    qh = as_float64(to_hnd(q, layout), "q")
    kh = expand_kv_heads(as_float64(to_hnd(k, layout), "k"), Hq)
    vh = expand_kv_heads(as_float64(to_hnd(v, layout), "v"), Hq)
    return (B, Hq, Hkv, Nq, Nk, D), scale, mask, qh, kh, vh


def _scores(qh, kh, scale, mask):
    """``S = scale · Q Kᵀ`` (HND float64) with masked entries set to ``-inf``."""
    s = scale * np.matmul(qh, np.swapaxes(kh, -1, -2))
    return np.where(mask, s, -np.inf)


def _backward_core(qh, kh, vh, p, oh, doh, scale, Hkv):
    """Exact backward (docs/algorithms.md §1) on HND float64 operands with GQA-expanded k, v.

    Returns ``dict(dP, delta, dS, dQ, dK, dV)`` with dK/dV summed over GQA groups.
    """
    dp = np.matmul(doh, np.swapaxes(vh, -1, -2))
    delta = np.sum(doh * oh, axis=-1)
    ds = p * (dp - delta[..., None])
    dq = scale * np.matmul(ds, kh)
    dk = sum_kv_groups(scale * np.matmul(np.swapaxes(ds, -1, -2), qh), Hkv)
    dv = sum_kv_groups(np.matmul(np.swapaxes(p, -1, -2), doh), Hkv)
    return {"dP": dp, "delta": delta, "dS": ds, "dQ": dq, "dK": dk, "dV": dv}


def attention_forward(q, k, v, *, causal=False, sm_scale=None, layout="HND"):
    """Exact attention ``O = softmax(sm_scale · Q Kᵀ) V`` in float64.

    Returns ``(o, lse)``: ``o`` float64 in ``layout`` and ``lse`` float64
    ``(B, Hq, Nq)``, the natural-log log-sum-exp of each row's visible scores.
    Fully masked rows: ``o = 0``, ``lse = -inf``.
    """
    (B, Hq, _, Nq, Nk, D) = check_qkv(q, k, v, layout)
    check_memory(f"dense exact attention (B={B}, Hq={Hq}, Nq={Nq}, Nk={Nk}; attention_forward_chunked needs none)",
                 dense_peak_bytes(B, Hq, Nq, Nk, D, kind="forward"))
    _, scale, mask, qh, kh, vh = _prepare(q, k, v, causal, sm_scale, layout)
    p, _, _, lse = masked_softmax(_scores(qh, kh, scale, mask))
    return from_hnd(np.matmul(p, vh), layout), lse


def attention_backward(q, k, v, o, lse, do, *, causal=False, sm_scale=None, layout="HND"):
    """Exact attention backward (docs/algorithms.md §1); returns ``(dq, dk, dv)`` in ``layout``, float64.

    ``P`` is recomputed as ``exp(S − lse)`` from the given ``lse`` (as the
    FlashAttention backward does) and ``δ = rowsum(dO ∘ O)`` from the given
    ``o``; pass the outputs of :func:`attention_forward` for the exact
    gradient. Entries that are masked, and rows whose ``lse`` is ``-inf``
    (they see no key), get ``P = 0`` and therefore zero gradients.
    ``dk``/``dv`` of a kv head sum over its GQA group.
    """
    (B, Hq, _, Nq, Nk, D) = check_qkv(q, k, v, layout)
    check_memory(f"dense exact attention backward (B={B}, Hq={Hq}, Nq={Nq}, Nk={Nk}; attention_backward_chunked "
                 f"needs none)", dense_peak_bytes(B, Hq, Nq, Nk, D, kind="backward"))
    (B, Hq, Hkv, Nq, Nk, D), scale, mask, qh, kh, vh = _prepare(q, k, v, causal, sm_scale, layout)
    oh = _check_like(o, "o", (B, Hq, Nq, D), layout)
    doh = _check_like(do, "do", (B, Hq, Nq, D), layout)
    lse64 = as_float64(lse, "lse")
    if lse64.shape != (B, Hq, Nq):
        raise ValueError(f"lse must have shape {(B, Hq, Nq)}, got {lse64.shape}")
    s = _scores(qh, kh, scale, mask)
    row_ok = np.isfinite(lse64)
    lse_safe = np.where(row_ok, lse64, 0.0)
    p = np.where(row_ok[..., None], np.exp(s - lse_safe[..., None]), 0.0)
    g = _backward_core(qh, kh, vh, p, oh, doh, scale, Hkv)
    return tuple(from_hnd(g[name], layout) for name in ("dQ", "dK", "dV"))


def attention_intermediates(q, k, v, do, *, causal=False, sm_scale=None, layout="HND") -> dict:
    """Every tensor of the exact forward and backward, as HND float64 arrays.

    Keys: ``"S"`` (scaled scores, masked entries ``-inf``), ``"P"``, ``"dP"``,
    ``"dS"`` (all ``(B, Hq, Nq, Nk)``), ``"delta"`` and ``"lse"``
    (``(B, Hq, Nq)``), ``"O"``, ``"dQ"`` (``(B, Hq, Nq, D)``), ``"dK"``, ``"dV"``
    (``(B, Hkv, Nk, D)``, GQA-summed). Note the layout: HND whatever ``layout``
    the inputs use (``layout`` only says how to read ``q, k, v, do``).
    """
    (B, Hq, _, Nq, Nk, D) = check_qkv(q, k, v, layout)
    check_memory(f"the exact intermediates (B={B}, Hq={Hq}, Nq={Nq}, Nk={Nk}: S, P, dP, dS whole)",
                 dense_peak_bytes(B, Hq, Nq, Nk, D, kind="intermediates"))
    (B, Hq, Hkv, Nq, Nk, D), scale, mask, qh, kh, vh = _prepare(q, k, v, causal, sm_scale, layout)
    doh = _check_like(do, "do", (B, Hq, Nq, D), layout)
    s = _scores(qh, kh, scale, mask)
    p, _, _, lse = masked_softmax(s)
    oh = np.matmul(p, vh)
    out = {"S": s, "P": p, "O": oh, "lse": lse}
    out.update(_backward_core(qh, kh, vh, p, oh, doh, scale, Hkv))
    return out


# ----------------------------------------------------------------------------
# chunked exact attention: O(N·D) per head plus one block
# ----------------------------------------------------------------------------

#: Query rows and keys per block of the chunked functions: a (1024, 1024) float64 block is 8 MB (a few live at once).
#: On a 2-core machine at N = 2048-4096, D = 128 these blocks ran as fast as wider ones and faster than 256 or 512
#: (fewer Python steps per product) and than the dense form.
CHUNK = 1024


def _check_block(value, name: str) -> int:
    if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name}={value!r} must be a positive integer")
    return int(value)


def _chunked_args(q, k, v, causal, sm_scale, layout, block_q, block_k):
    """Validation and HND float64 copies (K and V per kv head, not expanded over the GQA group)."""
    B, Hq, Hkv, Nq, Nk, D = check_qkv(q, k, v, layout)
    if not isinstance(causal, (bool, np.bool_)):
        raise TypeError(f"causal must be a bool, got {causal!r}")
    scale = resolve_sm_scale(sm_scale, D)
    bq, bk = _check_block(block_q, "block_q"), _check_block(block_k, "block_k")
    qh, kh, vh = (as_float64(to_hnd(x, layout), n) for x, n in ((q, "q"), (k, "k"), (v, "v")))
    return (B, Hq, Hkv, Nq, Nk, D), scale, bool(causal), bq, bk, qh, kh, vh


def _block_scores(qb, kb, scale, causal, i0, j0, shift):
    """``scale · q_blk k_blkᵀ`` with ``-inf`` where a row may not see a key (bottom-right causal mask)."""
    s = scale * (qb @ kb.T)
    if causal and j0 + kb.shape[0] - 1 > i0 + shift:  # (the block reaches past some row's last visible key)
        i = np.arange(i0, i0 + qb.shape[0])[:, None]
        j = np.arange(j0, j0 + kb.shape[0])[None, :]
        s = np.where(j <= i + shift, s, -np.inf)
    return s


def _forward_head(qh, kh, vh, scale, causal, bq, bk):
    """One head's O and LSE by key blocks with an online softmax (running max ``m``, sum ``l``, accumulator)."""
    Nq, D = qh.shape
    Nk = kh.shape[0]
    shift = Nk - Nq
    o = np.zeros((Nq, D))
    lse = np.full(Nq, -np.inf)
    for i0 in range(0, Nq, bq):
        qb = qh[i0:i0 + bq]
        n = qb.shape[0]
        last = Nk if not causal else min(Nk, i0 + n + shift)  # keys any row of the block sees: j < last
        m = np.full(n, -np.inf)
        l = np.zeros(n)
        acc = np.zeros((n, D))
        for j0 in range(0, max(last, 0), bk):
            s = _block_scores(qb, kh[j0:j0 + bk], scale, causal, i0, j0, shift)
            m_new = np.maximum(m, s.max(axis=1))
            m_safe = np.where(m_new == -np.inf, 0.0, m_new)  # (a row that has seen no key yet: no −inf − −inf)
            alpha = np.exp(m - m_safe)
            p = np.exp(s - m_safe[:, None])
            l = alpha * l + p.sum(axis=1)
            acc = alpha[:, None] * acc + p @ vh[j0:j0 + bk]
            m = m_new
        seen = l > 0
        m_safe = np.where(seen, m, 0.0)
        o[i0:i0 + n] = acc / np.where(seen, l, 1.0)[:, None]
        lse[i0:i0 + n] = np.where(seen, m_safe + np.log(np.where(seen, l, 1.0)), -np.inf)
    return o, lse


def _backward_head(qh, kh, vh, lse, doh, delta, scale, causal, bq, bk, dq, dk, dv):
    """One head's gradients by key blocks (outer: dK, dV of the block) and query blocks (inner: dQ accumulated in
    ``dq``), ``P = exp(S − lse)`` recomputed per block; ``dk``, ``dv`` (the kv head's) are added to."""
    Nq = qh.shape[0]
    Nk = kh.shape[0]
    shift = Nk - Nq
    row_ok = lse != -np.inf
    lse_safe = np.where(row_ok, lse, 0.0)
    for j0 in range(0, Nk, bk):
        kb, vb = kh[j0:j0 + bk], vh[j0:j0 + bk]
        first = 0 if not causal else max(0, j0 - shift)  # the first row that sees key j0
        for i0 in range(first // bq * bq, Nq, bq):
            sl = slice(i0, i0 + bq)
            s = _block_scores(qh[sl], kb, scale, causal, i0, j0, shift)
            p = np.where(row_ok[sl, None], np.exp(s - lse_safe[sl, None]), 0.0)
            dv[j0:j0 + bk] += p.T @ doh[sl]
            ds = p * (doh[sl] @ vb.T - delta[sl, None])
            dq[sl] += scale * (ds @ kb)
            dk[j0:j0 + bk] += scale * (ds.T @ qh[sl])


def attention_chunked(q, k, v, do=None, *, causal=False, sm_scale=None, layout="HND", block_q=CHUNK,
                      block_k=CHUNK) -> dict:
    """Exact attention in float64 by blocks of ``block_q`` query rows and ``block_k`` keys: memory ``O(N·D)`` per
    head plus one ``(block_q, block_k)`` block, whatever N.

    Returns HND float64 arrays under the keys of :func:`attention_intermediates` that need no ``(Nq, Nk)``
    matrix: ``"O"``, ``"lse"`` and, when ``do`` is given, ``"delta"``, ``"dQ"``, ``"dK"``, ``"dV"`` (dK, dV
    summed over each GQA group). Equal to the dense functions up to float64 rounding. The forward is an online
    softmax over key blocks in float64 (running row max and sum, docs/algorithms.md §1.3); the backward recomputes
    ``P = exp(S − LSE)`` per block (§1.7). Conventions as the dense functions (causal bottom-right; a row that sees
    no key: ``O = 0``, ``LSE = −inf``, zero gradients, no warning).
    """
    (B, Hq, Hkv, Nq, Nk, D), scale, causal, bq, bk, qh, kh, vh = _chunked_args(q, k, v, causal, sm_scale, layout,
                                                                              block_q, block_k)
    doh = None if do is None else _check_like(do, "do", (B, Hq, Nq, D), layout)
    group = Hq // Hkv
    o = np.zeros((B, Hq, Nq, D))
    lse = np.full((B, Hq, Nq), -np.inf)
    out = {"O": o, "lse": lse}
    if doh is not None:
        out.update(delta=np.zeros((B, Hq, Nq)), dQ=np.zeros((B, Hq, Nq, D)), dK=np.zeros((B, Hkv, Nk, D)),
                   dV=np.zeros((B, Hkv, Nk, D)))
    with np.errstate(under="ignore"):  # (exp of very negative logits: 0, as in the dense form)
        for b in range(B):
            for h in range(Hq):
                g = h // group
                o[b, h], lse[b, h] = _forward_head(qh[b, h], kh[b, g], vh[b, g], scale, causal, bq, bk)
                if doh is not None:
                    out["delta"][b, h] = np.sum(doh[b, h] * o[b, h], axis=-1)
                    _backward_head(qh[b, h], kh[b, g], vh[b, g], lse[b, h], doh[b, h], out["delta"][b, h], scale,
                                   causal, bq, bk, out["dQ"][b, h], out["dK"][b, g], out["dV"][b, g])
    return out


def attention_forward_chunked(q, k, v, *, causal=False, sm_scale=None, layout="HND", block_q=CHUNK, block_k=CHUNK):
    """:func:`attention_forward` by blocks (:func:`attention_chunked`): ``(o, lse)``, ``o`` in ``layout``."""
    out = attention_chunked(q, k, v, causal=causal, sm_scale=sm_scale, layout=layout, block_q=block_q,
                            block_k=block_k)
    return from_hnd(out["O"], layout), out["lse"]


def attention_backward_chunked(q, k, v, o, lse, do, *, causal=False, sm_scale=None, layout="HND", block_q=CHUNK,
                               block_k=CHUNK):
    """:func:`attention_backward` by blocks: ``(dq, dk, dv)`` in ``layout`` from the given ``o`` (for δ) and
    ``lse`` (for P), as the dense one; memory ``O(N·D)`` per head plus one block."""
    (B, Hq, Hkv, Nq, Nk, D), scale, causal, bq, bk, qh, kh, vh = _chunked_args(q, k, v, causal, sm_scale, layout,
                                                                              block_q, block_k)
    oh = _check_like(o, "o", (B, Hq, Nq, D), layout)
    doh = _check_like(do, "do", (B, Hq, Nq, D), layout)
    lse64 = as_float64(lse, "lse")
    if lse64.shape != (B, Hq, Nq):
        raise ValueError(f"lse must have shape {(B, Hq, Nq)}, got {lse64.shape}")
    group = Hq // Hkv
    dq, dk, dv = np.zeros((B, Hq, Nq, D)), np.zeros((B, Hkv, Nk, D)), np.zeros((B, Hkv, Nk, D))
    lse64 = np.where(np.isfinite(lse64), lse64, -np.inf)  # (a row whose LSE is not finite sees nothing: P = 0)
    with np.errstate(under="ignore"):
        for b in range(B):
            for h in range(Hq):
                g = h // group
                delta = np.sum(doh[b, h] * oh[b, h], axis=-1)
                _backward_head(qh[b, h], kh[b, g], vh[b, g], lse64[b, h], doh[b, h], delta, scale, causal, bq, bk,
                               dq[b, h], dk[b, g], dv[b, g])
    return tuple(from_hnd(x, layout) for x in (dq, dk, dv))
