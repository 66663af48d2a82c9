"""Exact attention in float64: the ground truth every sagecupy family is measured against.

docs/algorithms.md §1 in code. Everything here is computed in float64 with plain vectorized
NumPy (whole ``(Nq, Nk)`` score matrices; there is no memory constraint on the
reference). Inputs of any real dtype are accepted and converted to float64; the
caller's arrays are never modified.

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
]

LAYOUTS = ("HND", "NHD")


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
    (B, Hq, Hkv, Nq, Nk, D), scale, mask, qh, kh, vh = _prepare(q, k, v, causal, sm_scale, layout)
    doh = _check_like(do, "do", (B, Hq, Nq, D), layout)
    s = _scores(qh, kh, scale, mask)
    p, _, _, lse = masked_softmax(s)
    oh = np.matmul(p, vh)
    out = {"S": s, "P": p, "O": oh, "lse": lse}
    out.update(_backward_core(qh, kh, vh, p, oh, doh, scale, Hkv))
    return out
