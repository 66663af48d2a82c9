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
* ``window=(left, right)`` (``-1``: unbounded on that side; docs/algorithms.md
  §1.8): query row ``i`` sees key ``j`` iff
  ``i + (Nk - Nq) - left <= j <= i + (Nk - Nq) + right``. ``causal=True`` is
  ``window=(-1, 0)``; a window with ``causal=True`` must have ``right = 0``.
* Layout ``"THD"`` (packed variable-length sequences): ``q`` is
  ``(total_q, Hq, D)``, ``k`` and ``v`` ``(total_k, Hkv, D)``; sequence ``s``
  is rows ``cu_seqlens_q[s]:cu_seqlens_q[s+1]`` of ``q`` and
  ``cu_seqlens_k[s]:cu_seqlens_k[s+1]`` of ``k, v``; masks and windows are
  aligned per sequence; the LSE is ``(Hq, total_q)``. A packed call is the
  loop over its sequences of the 4-D call (:func:`packed_sequences`).

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
    "PACKED_LAYOUT",
    "resolve_window",
    "packed_sequences",
    "check_cu_seqlens",
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
#: The packed variable-length layout (docs/algorithms.md §1.8). Not in :data:`LAYOUTS`: :func:`to_hnd` and the 4-D
#: helpers do not take it; each public function that accepts it splits it into 4-D calls, one per sequence.
PACKED_LAYOUT = "THD"

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


def resolve_window(causal, window=None) -> tuple:
    """``(left, right)`` of the attention window (``-1``: unbounded) from ``causal`` and ``window``.

    ``window=None`` gives ``(-1, 0)`` when causal, else ``(-1, -1)``. ``window`` must be a pair of integers
    ``>= -1``. ``causal=True`` with a window whose ``right`` is not 0 contradicts it: ValueError naming both.
    """
    if not isinstance(causal, (bool, np.bool_)):
        raise TypeError(f"causal must be a bool, got {causal!r}")
    if window is None:
        return (-1, 0) if causal else (-1, -1)
    if (not isinstance(window, (tuple, list)) or len(window) != 2
            or any(isinstance(w, (bool, np.bool_)) or not isinstance(w, numbers.Integral) or w < -1
                   for w in window)):
        raise ValueError(f"window={window!r} must be a pair (left, right) of integers >= -1 (-1: unbounded)")
    left, right = int(window[0]), int(window[1])
    if causal and right != 0:
        raise ValueError(f"causal=True contradicts window={window!r}: causal means right = 0 "
                         f"(pass window=({left}, 0), or causal=False)")
    return left, right


def visible_mask(nq: int, nk: int, causal: bool, window=None) -> np.ndarray:
    """Boolean ``(nq, nk)``: ``True`` where query row ``i`` may attend key ``j``.

    Causal is bottom-right aligned: ``j <= i + (nk - nq)``. Not causal: all True.
    ``window=(left, right)`` (:func:`resolve_window`): ``i + (nk - nq) - left <= j <= i + (nk - nq) + right``,
    ``-1`` leaving a side unbounded.
    """
    for name, n in (("nq", nq), ("nk", nk)):
        if not isinstance(n, numbers.Integral) or isinstance(n, bool) or n < 1:
            raise ValueError(f"{name}={n!r} must be a positive integer")
    left, right = resolve_window(causal, window)
    if left == -1 and right == -1:
        return np.ones((nq, nk), dtype=bool)
    i = np.arange(nq)[:, None]
    j = np.arange(nk)[None, :]
    mask = np.ones((nq, nk), dtype=bool)
    if right != -1:
        mask &= j <= i + (nk - nq) + right
    if left != -1:
        mask &= j >= i + (nk - nq) - left
    return mask


# ----------------------------------------------------------------------------
# packed variable-length sequences (layout "THD")
# ----------------------------------------------------------------------------

_INT32 = np.iinfo(np.int32)


def _check_offsets(cu, name: str, total: int) -> np.ndarray:
    if cu is None:
        raise ValueError(f"{name} is required with layout='THD'")
    arr = np.asarray(cu)
    if arr.dtype.kind not in "iu" or arr.ndim != 1:
        raise ValueError(f"{name} must be a 1-D integer array (int32 prefix sums), got dtype {arr.dtype} and "
                         f"shape {arr.shape}")
    if arr.size < 2:
        raise ValueError(f"{name} must hold S + 1 >= 2 offsets, got {arr.size}")
    arr = arr.astype(np.int64)
    if arr.min() < _INT32.min or arr.max() > _INT32.max:
        raise ValueError(f"{name} must fit in int32")
    if arr[0] != 0:
        raise ValueError(f"{name} must start at 0, got {int(arr[0])}")
    drops = np.flatnonzero(np.diff(arr) < 0)
    if drops.size:
        raise ValueError(f"{name} must be non-decreasing, but {name}[{drops[0] + 1}] = {int(arr[drops[0] + 1])} < "
                         f"{name}[{drops[0]}] = {int(arr[drops[0]])}")
    if arr[-1] != total:
        raise ValueError(f"{name} must end at the packed length {total}, got {int(arr[-1])}")
    return arr


def check_cu_seqlens(cu_seqlens_q, cu_seqlens_k, total_q: int, total_k: int, max_seqlen_q=None,
                     max_seqlen_k=None) -> list:
    """Validate the packed offsets; return the spans ``[(q0, q1, k0, k1), ...]`` of the S sequences.

    Each of ``cu_seqlens_q`` (``total_q``) and ``cu_seqlens_k`` (``total_k``) must be a 1-D integer array of S + 1
    int32 values, non-decreasing, starting at 0 and ending at the total; both of one length. ``max_seqlen_q/k``,
    if given, must be an integer at least the longest sequence (a bound, as the kernels use it to size their grid).
    ValueError naming the argument.
    """
    cq = _check_offsets(cu_seqlens_q, "cu_seqlens_q", total_q)
    ck = _check_offsets(cu_seqlens_k, "cu_seqlens_k", total_k)
    if cq.size != ck.size:
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must have the same length (S + 1), got {cq.size} and "
                         f"{ck.size}")
    for name, bound, cu in (("max_seqlen_q", max_seqlen_q, cq), ("max_seqlen_k", max_seqlen_k, ck)):
        if bound is None:
            continue
        if isinstance(bound, (bool, np.bool_)) or not isinstance(bound, numbers.Integral):
            raise ValueError(f"{name}={bound!r} must be an integer or None")
        longest = int(np.diff(cu).max())
        if bound < longest:
            raise ValueError(f"{name}={bound} is less than the longest sequence ({longest})")
    return [(int(cq[s]), int(cq[s + 1]), int(ck[s]), int(ck[s + 1])) for s in range(cq.size - 1)]


def packed_sequences(q, k, v, layout, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None):
    """None for a 4-D ``layout`` (which then takes no ``cu_seqlens``); for ``"THD"`` ``((Hq, Hkv, total_q,
    total_k, D), spans)`` after validating the packed operands (:func:`check_cu_seqlens`).

    Sequence ``s`` of a packed array ``x`` is the NHD array ``x[None, a:b]`` (batch 1), which is how every
    public function runs a packed call: the 4-D path once per non-empty sequence, so that each sequence's
    statistics (masks, smoothing means, scales) are its own and a packed call equals the separate calls.
    """
    if not isinstance(layout, str) or layout != PACKED_LAYOUT:
        for name, value in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k),
                            ("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
            if value is not None:
                raise ValueError(f"{name} is only for layout='THD' (packed sequences), got layout={layout!r}")
        return None
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not hasattr(x, "ndim") or not hasattr(x, "shape"):
            raise TypeError(f"{name} must be a NumPy array, got {type(x).__name__}")
        if x.ndim != 3 or min(x.shape[1:]) < 1:
            raise ValueError(f"{name} must be 3-D (total, H, D) with H, D >= 1 for layout='THD', got shape "
                             f"{tuple(x.shape)}")
    Tq, Hq, D = q.shape
    Tk, Hkv, Dk = k.shape
    if tuple(v.shape) != tuple(k.shape):
        raise ValueError(f"k and v must have the same shape, got k {tuple(k.shape)} and v {tuple(v.shape)} "
                         f"(layout='THD')")
    if Dk != D:
        raise ValueError(f"q and k must have the same head dim, got {D} and {Dk} (layout='THD')")
    if Hq % Hkv:
        raise ValueError(f"the number of query heads ({Hq}) must be a multiple of the kv heads ({Hkv}) "
                         f"(layout='THD')")
    spans = check_cu_seqlens(cu_seqlens_q, cu_seqlens_k, Tq, Tk, max_seqlen_q, max_seqlen_k)
    return (Hq, Hkv, Tq, Tk, D), spans


def check_packed_like(x, name: str, shape) -> None:
    """ValueError unless ``x`` (a packed array) has ``shape``."""
    if not hasattr(x, "ndim") or not hasattr(x, "shape"):
        raise TypeError(f"{name} must be a NumPy array, got {type(x).__name__}")
    if tuple(x.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)} (layout='THD'), got {tuple(x.shape)}")


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


def _prepare(q, k, v, causal, sm_scale, layout, window=None):
    """Validate and convert: HND float64 q (B,Hq,Nq,D) and GQA-expanded k, v (B,Hq,Nk,D)."""
    B, Hq, Hkv, Nq, Nk, D = check_qkv(q, k, v, layout)
    scale = resolve_sm_scale(sm_scale, D)
    mask = visible_mask(Nq, Nk, causal, window)
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


def _packed_forward(fn, q, k, v, packed, **kw):
    """``fn`` (a 4-D ``(o, lse)`` function) over the sequences of a packed call; ``(o (Tq, Hq, D), lse (Hq, Tq))``.

    A sequence without queries has nothing to compute; one without keys keeps ``O = 0``, ``LSE = −inf``
    (its rows see no key), which is why those are skipped rather than passed on (the 4-D path wants N >= 1).
    """
    (Hq, _, Tq, _, D), spans = packed
    resolve_window(kw["causal"], kw["window"])  # (a bad argument fails even when every sequence is empty)
    resolve_sm_scale(kw["sm_scale"], D)
    o = np.zeros((Tq, Hq, D))
    lse = np.full((Hq, Tq), -np.inf)
    for q0, q1, k0, k1 in spans:
        if q1 > q0 and k1 > k0:
            o_s, lse_s = fn(q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], layout="NHD", **kw)
            o[q0:q1], lse[:, q0:q1] = o_s[0], lse_s[0]
    return o, lse


def _packed_backward(fn, q, k, v, o, lse, do, packed, **kw):
    """``fn`` (a 4-D ``(dq, dk, dv)`` function) over the sequences of a packed call; packed gradients."""
    (Hq, Hkv, Tq, Tk, D), spans = packed
    resolve_window(kw["causal"], kw["window"])
    resolve_sm_scale(kw["sm_scale"], D)
    check_packed_like(o, "o", (Tq, Hq, D))
    check_packed_like(do, "do", (Tq, Hq, D))
    check_packed_like(lse, "lse", (Hq, Tq))
    dq, dk, dv = np.zeros((Tq, Hq, D)), np.zeros((Tk, Hkv, D)), np.zeros((Tk, Hkv, D))
    for q0, q1, k0, k1 in spans:
        if q1 > q0 and k1 > k0:
            g = fn(q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], o[None, q0:q1], lse[None, :, q0:q1],
                   do[None, q0:q1], layout="NHD", **kw)
            dq[q0:q1], dk[k0:k1], dv[k0:k1] = g[0][0], g[1][0], g[2][0]
    return dq, dk, dv


def _packed_intermediates(fn, q, k, v, do, packed, **kw) -> dict:
    """``fn`` (:func:`attention_intermediates`) over the sequences of a packed call (its docstring: the keys)."""
    (Hq, Hkv, Tq, Tk, D), spans = packed
    resolve_window(kw["causal"], kw["window"])
    resolve_sm_scale(kw["sm_scale"], D)
    check_packed_like(do, "do", (Tq, Hq, D))
    out = {"O": np.zeros((Tq, Hq, D)), "dQ": np.zeros((Tq, Hq, D)), "dK": np.zeros((Tk, Hkv, D)),
           "dV": np.zeros((Tk, Hkv, D)), "lse": np.full((Hq, Tq), -np.inf), "delta": np.zeros((Hq, Tq)),
           "S": [], "P": [], "dP": [], "dS": []}
    for q0, q1, k0, k1 in spans:
        nq, nk = q1 - q0, k1 - k0
        if nq and nk:
            r = fn(q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], do[None, q0:q1], layout="NHD", **kw)
            for key in ("O", "dQ"):
                out[key][q0:q1] = np.swapaxes(r[key][0], 0, 1)
            for key in ("dK", "dV"):
                out[key][k0:k1] = np.swapaxes(r[key][0], 0, 1)
            for key in ("lse", "delta"):
                out[key][:, q0:q1] = r[key][0]
            for key in ("S", "P", "dP", "dS"):
                out[key].append(r[key][0])
        else:
            out["S"].append(np.full((Hq, nq, nk), -np.inf))
            for key in ("P", "dP", "dS"):
                out[key].append(np.zeros((Hq, nq, nk)))
    return out


def attention_forward(q, k, v, *, causal=False, sm_scale=None, layout="HND", window=None,
        cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None):
    """Exact attention ``O = softmax(sm_scale · Q Kᵀ) V`` in float64.

    Returns ``(o, lse)``: ``o`` float64 in ``layout`` and ``lse`` float64
    ``(B, Hq, Nq)``, the natural-log log-sum-exp of each row's visible scores.
    Fully masked rows: ``o = 0``, ``lse = -inf``. ``window``: a sliding window
    (module docstring). ``layout="THD"`` with ``cu_seqlens_q/k``: packed
    sequences; ``o`` ``(total_q, Hq, D)``, ``lse`` ``(Hq, total_q)``.
    """
    packed = packed_sequences(q, k, v, layout, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    if packed is not None:
        return _packed_forward(attention_forward, q, k, v, packed, causal=causal, sm_scale=sm_scale, window=window)
    (B, Hq, _, Nq, Nk, D) = check_qkv(q, k, v, layout)
    check_memory(f"dense exact attention (B={B}, Hq={Hq}, Nq={Nq}, Nk={Nk}; attention_forward_chunked needs none)",
                 dense_peak_bytes(B, Hq, Nq, Nk, D, kind="forward"))
    _, scale, mask, qh, kh, vh = _prepare(q, k, v, causal, sm_scale, layout, window)
    p, _, _, lse = masked_softmax(_scores(qh, kh, scale, mask))
    return from_hnd(np.matmul(p, vh), layout), lse


def attention_backward(q, k, v, o, lse, do, *, causal=False, sm_scale=None, layout="HND", window=None,
        cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None):
    """Exact attention backward (docs/algorithms.md §1); returns ``(dq, dk, dv)`` in ``layout``, float64.

    ``P`` is recomputed as ``exp(S − lse)`` from the given ``lse`` (as the
    FlashAttention backward does) and ``δ = rowsum(dO ∘ O)`` from the given
    ``o``; pass the outputs of :func:`attention_forward` for the exact
    gradient. Entries that are masked, and rows whose ``lse`` is ``-inf``
    (they see no key), get ``P = 0`` and therefore zero gradients.
    ``dk``/``dv`` of a kv head sum over its GQA group. Packed (``layout="THD"``):
    ``o``, ``do`` ``(total_q, Hq, D)``, ``lse`` ``(Hq, total_q)``; ``dk``, ``dv``
    ``(total_k, Hkv, D)``.
    """
    packed = packed_sequences(q, k, v, layout, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    if packed is not None:
        return _packed_backward(attention_backward, q, k, v, o, lse, do, packed, causal=causal, sm_scale=sm_scale,
                                window=window)
    (B, Hq, _, Nq, Nk, D) = check_qkv(q, k, v, layout)
    check_memory(f"dense exact attention backward (B={B}, Hq={Hq}, Nq={Nq}, Nk={Nk}; attention_backward_chunked "
                 f"needs none)", dense_peak_bytes(B, Hq, Nq, Nk, D, kind="backward"))
    (B, Hq, Hkv, Nq, Nk, D), scale, mask, qh, kh, vh = _prepare(q, k, v, causal, sm_scale, layout, window)
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


def attention_intermediates(q, k, v, do, *, causal=False, sm_scale=None, layout="HND", window=None,
        cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None) -> dict:
    """Every tensor of the exact forward and backward, as HND float64 arrays.

    Keys: ``"S"`` (scaled scores, masked entries ``-inf``), ``"P"``, ``"dP"``,
    ``"dS"`` (all ``(B, Hq, Nq, Nk)``), ``"delta"`` and ``"lse"``
    (``(B, Hq, Nq)``), ``"O"``, ``"dQ"`` (``(B, Hq, Nq, D)``), ``"dK"``, ``"dV"``
    (``(B, Hkv, Nk, D)``, GQA-summed). Note the layout: HND whatever ``layout``
    the inputs use (``layout`` only says how to read ``q, k, v, do``).

    Packed (``layout="THD"``): ``"O"``, ``"dQ"`` ``(total_q, Hq, D)``, ``"dK"``,
    ``"dV"`` ``(total_k, Hkv, D)``, ``"lse"``, ``"delta"`` ``(Hq, total_q)``, and
    ``"S"``, ``"P"``, ``"dP"``, ``"dS"`` lists of one ``(Hq, nq_s, nk_s)`` array
    per sequence (no single array holds matrices of different shapes).
    """
    packed = packed_sequences(q, k, v, layout, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    if packed is not None:
        return _packed_intermediates(attention_intermediates, q, k, v, do, packed, causal=causal,
                                     sm_scale=sm_scale, window=window)
    (B, Hq, _, Nq, Nk, D) = check_qkv(q, k, v, layout)
    check_memory(f"the exact intermediates (B={B}, Hq={Hq}, Nq={Nq}, Nk={Nk}: S, P, dP, dS whole)",
                 dense_peak_bytes(B, Hq, Nq, Nk, D, kind="intermediates"))
    (B, Hq, Hkv, Nq, Nk, D), scale, mask, qh, kh, vh = _prepare(q, k, v, causal, sm_scale, layout, window)
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


def _chunked_args(q, k, v, causal, sm_scale, layout, block_q, block_k, window=None):
    """Validation and HND float64 copies (K and V per kv head, not expanded over the GQA group); the window as
    ``(left, right)`` (:func:`resolve_window`)."""
    B, Hq, Hkv, Nq, Nk, D = check_qkv(q, k, v, layout)
    win = resolve_window(causal, window)
    scale = resolve_sm_scale(sm_scale, D)
    bq, bk = _check_block(block_q, "block_q"), _check_block(block_k, "block_k")
    qh, kh, vh = (as_float64(to_hnd(x, layout), n) for x, n in ((q, "q"), (k, "k"), (v, "v")))
    return (B, Hq, Hkv, Nq, Nk, D), scale, win, bq, bk, qh, kh, vh


def _block_scores(qb, kb, scale, win, i0, j0, shift):
    """``scale · q_blk k_blkᵀ`` with ``-inf`` where a row may not see a key (the window ``win = (left, right)``,
    bottom-right aligned; causal is ``(-1, 0)``). A block wholly inside every row's window is not masked."""
    s = scale * (qb @ kb.T)
    left, right = win
    n, nk = qb.shape[0], kb.shape[0]
    past_right = right != -1 and j0 + nk - 1 > i0 + shift + right      # (some key after some row's last visible)
    before_left = left != -1 and j0 < i0 + n - 1 + shift - left        # (some key before some row's first visible)
    if past_right or before_left:
        i = np.arange(i0, i0 + n)[:, None]
        j = np.arange(j0, j0 + nk)[None, :]
        ok = np.ones((n, nk), dtype=bool)
        if right != -1:
            ok &= j <= i + shift + right
        if left != -1:
            ok &= j >= i + shift - left
        s = np.where(ok, s, -np.inf)
    return s


def _forward_head(qh, kh, vh, scale, win, bq, bk):
    """One head's O and LSE by key blocks with an online softmax (running max ``m``, sum ``l``, accumulator)."""
    Nq, D = qh.shape
    Nk = kh.shape[0]
    shift = Nk - Nq
    o = np.zeros((Nq, D))
    lse = np.full(Nq, -np.inf)
    for i0 in range(0, Nq, bq):
        qb = qh[i0:i0 + bq]
        n = qb.shape[0]
        # Keys some row of the block sees: first <= j < last; key blocks stay aligned at key 0 (as the kernels').
        last = Nk if win[1] == -1 else min(Nk, i0 + n + shift + win[1])
        first = 0 if win[0] == -1 else max(0, i0 + shift - win[0])
        m = np.full(n, -np.inf)
        l = np.zeros(n)
        acc = np.zeros((n, D))
        for j0 in range(first // bk * bk, max(last, 0), bk):
            s = _block_scores(qb, kh[j0:j0 + bk], scale, win, i0, j0, shift)
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


def _backward_head(qh, kh, vh, lse, doh, delta, scale, win, bq, bk, dq, dk, dv):
    """One head's gradients by key blocks (outer: dK, dV of the block) and query blocks (inner: dQ accumulated in
    ``dq``), ``P = exp(S − lse)`` recomputed per block; ``dk``, ``dv`` (the kv head's) are added to."""
    Nq = qh.shape[0]
    Nk = kh.shape[0]
    shift = Nk - Nq
    row_ok = lse != -np.inf
    lse_safe = np.where(row_ok, lse, 0.0)
    for j0 in range(0, Nk, bk):
        kb, vb = kh[j0:j0 + bk], vh[j0:j0 + bk]
        # Rows that see some key of the block: first <= i < last (query blocks aligned at row 0).
        first = 0 if win[1] == -1 else max(0, j0 - shift - win[1])
        last = Nq if win[0] == -1 else min(Nq, j0 + kb.shape[0] - shift + win[0])
        for i0 in range(first // bq * bq, last, bq):
            sl = slice(i0, i0 + bq)
            s = _block_scores(qh[sl], kb, scale, win, i0, j0, shift)
            p = np.where(row_ok[sl, None], np.exp(s - lse_safe[sl, None]), 0.0)
            dv[j0:j0 + bk] += p.T @ doh[sl]
            ds = p * (doh[sl] @ vb.T - delta[sl, None])
            dq[sl] += scale * (ds @ kb)
            dk[j0:j0 + bk] += scale * (ds.T @ qh[sl])


def attention_chunked(q, k, v, do=None, *, causal=False, sm_scale=None, layout="HND", block_q=CHUNK,
                      block_k=CHUNK, window=None, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None,
                      max_seqlen_k=None) -> dict:
    """Exact attention in float64 by blocks of ``block_q`` query rows and ``block_k`` keys: memory ``O(N·D)`` per
    head plus one ``(block_q, block_k)`` block, whatever N.

    Returns HND float64 arrays under the keys of :func:`attention_intermediates` that need no ``(Nq, Nk)``
    matrix: ``"O"``, ``"lse"`` and, when ``do`` is given, ``"delta"``, ``"dQ"``, ``"dK"``, ``"dV"`` (dK, dV
    summed over each GQA group). Equal to the dense functions up to float64 rounding. The forward is an online
    softmax over key blocks in float64 (running row max and sum, docs/algorithms.md §1.3); the backward recomputes
    ``P = exp(S − LSE)`` per block (§1.7). Conventions as the dense functions (causal bottom-right; a row that sees
    no key: ``O = 0``, ``LSE = −inf``, zero gradients, no warning); ``window`` and packed sequences
    (``layout="THD"``) as :func:`attention_intermediates` (the packed keys: ``"O"``, ``"dQ"`` ``(total_q, Hq, D)``,
    ``"dK"``, ``"dV"`` ``(total_k, Hkv, D)``, ``"lse"``, ``"delta"`` ``(Hq, total_q)``).
    """
    packed = packed_sequences(q, k, v, layout, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    if packed is not None:
        return _packed_chunked(q, k, v, do, packed, causal=causal, sm_scale=sm_scale, block_q=block_q,
                               block_k=block_k, window=window)
    (B, Hq, Hkv, Nq, Nk, D), scale, win, bq, bk, qh, kh, vh = _chunked_args(q, k, v, causal, sm_scale, layout,
                                                                           block_q, block_k, window)
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
                o[b, h], lse[b, h] = _forward_head(qh[b, h], kh[b, g], vh[b, g], scale, win, bq, bk)
                if doh is not None:
                    out["delta"][b, h] = np.sum(doh[b, h] * o[b, h], axis=-1)
                    _backward_head(qh[b, h], kh[b, g], vh[b, g], lse[b, h], doh[b, h], out["delta"][b, h], scale,
                                   win, bq, bk, out["dQ"][b, h], out["dK"][b, g], out["dV"][b, g])
    return out


def attention_forward_chunked(q, k, v, *, causal=False, sm_scale=None, layout="HND", block_q=CHUNK, block_k=CHUNK,
                              window=None, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None,
                              max_seqlen_k=None):
    """:func:`attention_forward` by blocks (:func:`attention_chunked`): ``(o, lse)``, ``o`` in ``layout``."""
    out = attention_chunked(q, k, v, causal=causal, sm_scale=sm_scale, layout=layout, block_q=block_q,
                            block_k=block_k, window=window, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                            max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k)
    if layout == PACKED_LAYOUT:
        return out["O"], out["lse"]
    return from_hnd(out["O"], layout), out["lse"]


def attention_backward_chunked(q, k, v, o, lse, do, *, causal=False, sm_scale=None, layout="HND", block_q=CHUNK,
                               block_k=CHUNK, window=None, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None,
                               max_seqlen_k=None):
    """:func:`attention_backward` by blocks: ``(dq, dk, dv)`` in ``layout`` from the given ``o`` (for δ) and
    ``lse`` (for P), as the dense one; memory ``O(N·D)`` per head plus one block. ``window`` and packed
    sequences as :func:`attention_backward`."""
    packed = packed_sequences(q, k, v, layout, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    if packed is not None:
        return _packed_backward(attention_backward_chunked, q, k, v, o, lse, do, packed, causal=causal,
                                sm_scale=sm_scale, window=window, block_q=block_q, block_k=block_k)
    (B, Hq, Hkv, Nq, Nk, D), scale, win, bq, bk, qh, kh, vh = _chunked_args(q, k, v, causal, sm_scale, layout,
                                                                           block_q, block_k, window)
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
                _backward_head(qh[b, h], kh[b, g], vh[b, g], lse64[b, h], doh[b, h], delta, scale, win, bq, bk,
                               dq[b, h], dk[b, g], dv[b, g])
    return tuple(from_hnd(x, layout) for x in (dq, dk, dv))


def _packed_chunked(q, k, v, do, packed, **kw) -> dict:
    """:func:`attention_chunked` over the sequences of a packed call (its docstring: the keys)."""
    (Hq, Hkv, Tq, Tk, D), spans = packed
    resolve_window(kw["causal"], kw["window"])
    resolve_sm_scale(kw["sm_scale"], D)
    out = {"O": np.zeros((Tq, Hq, D)), "lse": np.full((Hq, Tq), -np.inf)}
    if do is not None:
        check_packed_like(do, "do", (Tq, Hq, D))
        out.update(dQ=np.zeros((Tq, Hq, D)), dK=np.zeros((Tk, Hkv, D)), dV=np.zeros((Tk, Hkv, D)),
                   delta=np.zeros((Hq, Tq)))
    for q0, q1, k0, k1 in spans:
        if q1 > q0 and k1 > k0:
            r = attention_chunked(q[None, q0:q1], k[None, k0:k1], v[None, k0:k1],
                                  None if do is None else do[None, q0:q1], layout="NHD", **kw)
            for key, value in r.items():
                if key in ("lse", "delta"):
                    out[key][:, q0:q1] = value[0]
                else:
                    out[key][slice(q0, q1) if key in ("O", "dQ") else slice(k0, k1)] = np.swapaxes(value[0], 0, 1)
    return out
