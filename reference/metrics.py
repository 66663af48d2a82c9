"""Scale-free error metrics (docs/algorithms.md §7), all in float64.

Every metric converts its arguments to float64 first and returns a Python
``float``. Arguments compared with each other must have the same shape
(ValueError otherwise: silent broadcasting would hide a transposed operand).

Zero norms, chosen so that an exact match never produces NaN or a warning:

* ``cos(a, b)``: 1.0 when both are all zero (identical), 0.0 when exactly one is.
* ``rel_l2(a, ref)`` / ``rel_l1(a, ref)``: when ``ref`` is all zero the result
  is 0.0 if ``a`` equals ``ref`` and ``inf`` otherwise.

NaN or Inf in the inputs propagate into the result (a metric must not make a
broken output look good); no warning is emitted for them.
"""
from __future__ import annotations

import numpy as np

__all__ = ["cos", "rel_l2", "rel_l1", "rmse", "rms", "compare", "ds_rms_bound", "worst_element"]


def _f64(x, name: str) -> np.ndarray:
    arr = np.asarray(x)
    if arr.dtype.kind in "bcOUSMm":
        raise TypeError(f"{name} must have a real numeric dtype, got {arr.dtype}")
    return arr.astype(np.float64)


def _pair(a, b, names=("a", "ref")):
    a64, b64 = _f64(a, names[0]), _f64(b, names[1])
    if a64.shape != b64.shape:
        raise ValueError(f"{names[0]} and {names[1]} must have the same shape, got {a64.shape} and {b64.shape}")
    if a64.size == 0:
        raise ValueError(f"{names[0]} and {names[1]} are empty")
    return a64, b64


def _relative(num: float, den: float) -> float:
    """``num / den`` with ``0/0 -> 0`` and ``x/0 -> inf``; NaN propagates."""
    if np.isnan(num) or np.isnan(den):
        return float("nan")
    if den == 0.0:
        return 0.0 if num == 0.0 else float("inf")
    return float(num / den)


def cos(a, b) -> float:
    """Cosine similarity ``Σab / sqrt(Σa² Σb²)`` over all elements (see module docstring for zeros)."""
    a64, b64 = _pair(a, b, ("a", "b"))
    with np.errstate(all="ignore"):
        na = float(np.sqrt(np.sum(a64 * a64)))
        nb = float(np.sqrt(np.sum(b64 * b64)))
        dot = float(np.sum(a64 * b64))
    if np.isnan(na) or np.isnan(nb) or np.isnan(dot):
        return float("nan")
    if na == 0.0 and nb == 0.0:
        return 1.0
    if na == 0.0 or nb == 0.0:
        return 0.0
    return float(dot / (na * nb))


def rel_l2(a, ref) -> float:
    """``‖a − ref‖₂ / ‖ref‖₂`` (0.0 for an exact match, also of an all-zero ``ref``)."""
    a64, r64 = _pair(a, ref)
    with np.errstate(all="ignore"):
        return _relative(float(np.linalg.norm((a64 - r64).ravel())), float(np.linalg.norm(r64.ravel())))


def rel_l1(a, ref) -> float:
    """``Σ|a − ref| / Σ|ref|`` (0.0 for an exact match, also of an all-zero ``ref``)."""
    a64, r64 = _pair(a, ref)
    with np.errstate(all="ignore"):
        return _relative(float(np.sum(np.abs(a64 - r64))), float(np.sum(np.abs(r64))))


def rmse(a, ref) -> float:
    """Root mean squared error ``sqrt(mean((a − ref)²))``."""
    a64, r64 = _pair(a, ref)
    with np.errstate(all="ignore"):
        return float(np.sqrt(np.mean((a64 - r64) ** 2)))


def rms(a) -> float:
    """Root mean square ``sqrt(mean(a²))`` of all elements (ValueError for an empty array)."""
    a64 = _f64(a, "a")
    if a64.size == 0:
        raise ValueError("a is empty")
    with np.errstate(all="ignore"):
        return float(np.sqrt(np.mean(a64 * a64)))


def compare(a, ref) -> dict:
    """``dict(cos, rel_l2, rel_l1, rmse)`` of ``a`` against ``ref``."""
    return {"cos": cos(a, ref), "rel_l2": rel_l2(a, ref), "rel_l1": rel_l1(a, ref), "rmse": rmse(a, ref)}


def ds_rms_bound(dP, delta, visible) -> np.ndarray:
    """Per-row bound on ``RMS(dS_i)`` (docs/algorithms.md §4.5): ``max_j |dP_ij − δ_i| / sqrt(n_i)``.

    ``dP`` is ``(..., Nq, Nk)``, ``delta`` ``(..., Nq)`` and ``visible`` a bool
    mask broadcastable to ``dP`` (e.g. the ``(Nq, Nk)`` output of
    :func:`sagecupy.reference.attention.visible_mask`). The max runs over the
    visible keys only, ``n_i`` is the number of visible keys of row ``i``, and
    ``RMS(dS_i)`` is taken over those same keys (masked entries of dS are 0 and
    would only lower it). Since ``P_i`` sums to 1, ``Σ_j P_ij² (dP_ij − δ_i)²
    <= max_j (dP_ij − δ_i)²``, which gives the bound. Rows with no visible key
    get 0. Returns float64 of shape ``dP.shape[:-1]``.
    """
    dp = _f64(dP, "dP")
    d = _f64(delta, "delta")
    if dp.ndim < 2:
        raise ValueError(f"dP must be at least 2-D (..., Nq, Nk), got shape {dp.shape}")
    if d.shape != dp.shape[:-1]:
        raise ValueError(f"delta must have shape {dp.shape[:-1]} (dP's without the key axis), got {d.shape}")
    vis = np.asarray(visible)
    if vis.dtype != bool:
        raise TypeError(f"visible must be a bool array, got dtype {vis.dtype}")
    try:
        vis = np.broadcast_to(vis, dp.shape)
    except ValueError as exc:
        raise ValueError(f"visible of shape {vis.shape} does not broadcast to dP's shape {dp.shape}") from exc
    dev = np.where(vis, np.abs(dp - d[..., None]), 0.0)
    n = vis.sum(axis=-1)
    return np.where(n > 0, dev.max(axis=-1) / np.sqrt(np.maximum(n, 1)), 0.0)


def worst_element(a, ref):
    """``(index, a_value, ref_value)`` of the largest ``|a − ref|``, for failure messages.

    A position where exactly one of the two is NaN, or where they differ in
    infinity, counts as the worst (the first such position in C order); two
    NaNs or two equal infinities at a position count as agreeing. ``index`` is
    a tuple of Python ints; the values are Python floats.
    """
    a64, r64 = _pair(a, ref)
    with np.errstate(all="ignore"):
        diff = np.abs(a64 - r64)
    both_nan = np.isnan(a64) & np.isnan(r64)
    same_inf = np.isinf(a64) & (a64 == r64)
    diff = np.where(both_nan | same_inf, 0.0, diff)
    bad = np.isnan(diff)
    flat = int(np.argmax(bad)) if bad.any() else int(np.argmax(diff))
    idx = tuple(int(i) for i in np.unravel_index(flat, a64.shape))
    return idx, float(a64[idx]), float(r64[idx])
