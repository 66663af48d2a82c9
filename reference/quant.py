"""Symmetric INT8 quantization in float64: docs/algorithms.md §2 in code.

The one quantizer is :func:`psi` (``ψ`` of docs/algorithms.md §2.1). Over one *block* (the
elements that share a scale)::

    s = max|x| / qmax
    x̂ = clip(rint(x / s), -qmax, qmax)        (signed,   qmax = 127)
    x̂ = clip(rint(x / s), 0, qmax)            (unsigned, qmax = 255 or 127)
    dequantized value = s · x̂

``rint`` rounds half to even, like CUDA's ``__float2int_rn``: on the grid
``x / s``, 0.5 -> 0, 1.5 -> 2, 2.5 -> 2, -0.5 -> -0. The division is literally
``x / s`` (not ``x · (qmax / max)``, which can round a tie differently): the
kernels must compute the same expression.

The edge cases (docs/algorithms.md §2.1) and the conventions of this module:

* **Zero block** (``max|x| = 0``): ``s = 0`` and every code 0; no division by
  zero, no NaN, no floating-point warning. (A block whose max is so tiny that
  ``max / qmax`` underflows to 0 is treated the same way: it dequantizes to 0.
  This cannot happen for fp16/bf16/fp32 inputs in float64.)
* **Non-finite block** (a NaN or ±Inf anywhere in it): the block's scale is
  NaN and its codes are 0, so its dequantized values are all NaN. A broken
  input never turns into a silent finite value; the other blocks are unaffected.
* **Unsigned mode** is for tensors that are non-negative by construction
  (``P = exp(·)``). Any element ``< 0`` raises ValueError — there is no
  tolerance, because no rounding of ``exp`` produces a negative number and a
  negative value means the caller fed the wrong tensor. ``-0.0`` is allowed
  (it is not ``< 0``); NaN is handled as a non-finite block, and ``-inf``,
  being negative, raises.
* Codes are returned as **int16** so that unsigned codes up to 255 fit; the
  kernels store them as int8/uint8. Scales are float64 with the block axes
  kept (``keepdims``), so ``codes * scale`` broadcasts back to ``x``.

Granularity helpers act on the last two axes ``(..., N, D)`` of an array
(rows = tokens, columns = head dim or keys). All are special cases of
:func:`quantize_tiles`, which cuts the matrix into tiles of ``tile_rows`` ×
``tile_cols`` aligned at row 0 and column 0 (the last tile along an axis may be
partial) and gives each tile one scale. Every helper returns
``(codes, scale)`` with ``codes`` int16 of ``x.shape`` and ``scale`` float64
of shape ``(..., R, C)`` where ``R = 1`` if the scale is constant over all rows
and ``R = N`` otherwise (a tile scale repeated on each of its rows), and
likewise ``C = 1`` or ``D``; ``codes * scale`` is always the dequantized array.

=============================  =========================  ================
helper                         block a scale covers       scale shape
=============================  =========================  ================
quantize_per_token(x)          one row, all D             (..., N, 1)
quantize_per_block(x, r)       r rows, all D              (..., N, 1)
quantize_per_channel(x)        one column, all N rows     (..., 1, D)
quantize_rows_in_tiles(x, c)   one row × c columns        (..., N, D)
quantize_cols_in_tiles(x, r)   r rows × one column        (..., N, D)
quantize_tiles(x, r, c)        r rows × c columns         (..., N or 1, D or 1)
=============================  =========================  ================
"""
from __future__ import annotations

import numbers

import numpy as np

from .attention import as_float64

__all__ = [
    "psi",
    "dequantize",
    "quantize_tiles",
    "quantize_per_token",
    "quantize_per_block",
    "quantize_per_channel",
    "quantize_rows_in_tiles",
    "quantize_cols_in_tiles",
]

#: Largest code a signed INT8 quantizer uses (the grid is symmetric, -128 unused).
INT8_QMAX = 127
#: Largest code of unsigned 8-bit P.
UINT8_QMAX = 255


def _check_qmax(qmax) -> int:
    if isinstance(qmax, bool) or not isinstance(qmax, numbers.Integral):
        raise TypeError(f"qmax must be an integer, got {qmax!r}")
    if not 1 <= qmax <= 32767:
        raise ValueError(f"qmax={qmax!r} must be in [1, 32767] (codes are int16)")
    return int(qmax)


def _check_axes(axes, ndim: int) -> tuple:
    """Normalize ``axes`` (int, tuple of ints, or None = all) to sorted non-negative ints."""
    if axes is None:
        return tuple(range(ndim))
    if isinstance(axes, numbers.Integral) and not isinstance(axes, bool):
        axes = (axes,)
    if not isinstance(axes, (tuple, list)) or not all(
        isinstance(a, numbers.Integral) and not isinstance(a, bool) for a in axes
    ):
        raise TypeError(f"axes must be an int, a tuple of ints or None, got {axes!r}")
    out = []
    for a in axes:
        if not -ndim <= a < ndim:
            raise ValueError(f"axes={tuple(axes)!r} out of range for an array with {ndim} dimensions")
        out.append(int(a) % ndim)
    if len(set(out)) != len(out):
        raise ValueError(f"axes={tuple(axes)!r} has repeated axes")
    return tuple(sorted(out))


def psi(x, axes, qmax: int = INT8_QMAX, unsigned: bool = False, fp32: bool = False):
    """Symmetric quantizer ``ψ`` over the blocks made by reducing ``axes``.

    Parameters
    ----------
    x : array_like, real
        Converted to float64 (never modified).
    axes : int, tuple of ints or None
        The axes one scale covers (``None``: the whole array is one block).
    qmax : int
        Largest code: 127 for INT8, 255 for unsigned 8-bit P.
    unsigned : bool
        Codes on ``[0, qmax]`` instead of ``[-qmax, qmax]``; ``x`` must have
        no element ``< 0`` (ValueError).
    fp32 : bool
        Do the two roundings of ψ in IEEE float32, exactly as the GPU kernels do: ``s = fl32(max/qmax)``
        and ``code = rint(fl32(x / s))`` with ``x`` first rounded to float32. Codes are then bit-identical
        to the kernels' (float64 arithmetic differs from it only at the rare ties where ``x/s`` rounds
        across a half-integer). The scale returned is the float32 value, as float64.

    Returns
    -------
    codes : int16 ndarray, ``x.shape``
    scale : float64 ndarray, ``x.shape`` with ``axes`` reduced to length 1.
        ``s = max|x| / qmax`` per block; 0 for an all-zero block; NaN for a
        block holding a NaN or an infinity (whose codes are then 0).
    """
    xf = as_float64(x, "x")
    qmax = _check_qmax(qmax)
    if not isinstance(unsigned, (bool, np.bool_)):
        raise TypeError(f"unsigned must be a bool, got {unsigned!r}")
    if xf.size == 0:
        raise ValueError(f"x is empty (shape {xf.shape}); there is no block to quantize")
    red = _check_axes(axes, xf.ndim)
    if unsigned and np.any(xf < 0):
        raise ValueError(f"unsigned quantization needs x >= 0, got min(x) = {np.nanmin(xf)!r}")
    with np.errstate(invalid="ignore", over="ignore"):
        amax = np.max(np.abs(xf), axis=red, keepdims=True)
    finite = np.isfinite(amax)
    if fp32:
        with np.errstate(invalid="ignore", over="ignore"):
            scale = np.where(finite, (amax.astype(np.float32) / np.float32(qmax)).astype(np.float64), np.nan)
    else:
        scale = np.where(finite, amax / qmax, np.nan)
    usable = finite & (scale > 0)  # zero (or underflowed) blocks and non-finite blocks get code 0
    divisor = np.where(usable, scale, 1.0)
    with np.errstate(invalid="ignore", over="ignore"):
        if fp32:
            grid = np.rint(xf.astype(np.float32) / divisor.astype(np.float32)).astype(np.float64)
        else:
            grid = np.rint(xf / divisor)
    lo = 0 if unsigned else -qmax
    codes = np.where(usable, np.clip(grid, lo, qmax), 0.0)
    # A finite block cannot hold a non-finite grid value; np.where already zeroed the others.
    return codes.astype(np.int16), scale


def dequantize(codes, scale) -> np.ndarray:
    """``codes · scale`` in float64 (the value a quantized tensor stands for)."""
    return np.asarray(codes, dtype=np.float64) * np.asarray(scale, dtype=np.float64)


def _check_tile(n, name: str):
    if n is None:
        return None
    if isinstance(n, bool) or not isinstance(n, numbers.Integral):
        raise TypeError(f"{name} must be a positive integer or None, got {n!r}")
    if n < 1:
        raise ValueError(f"{name}={n!r} must be a positive integer or None")
    return int(n)


def quantize_tiles(x, tile_rows, tile_cols, *, qmax: int = INT8_QMAX, unsigned: bool = False, fp32: bool = False):
    """One scale per ``tile_rows × tile_cols`` tile of the last two axes of ``x``.

    Tiles are aligned at row 0 and column 0; along an axis whose length is not
    a multiple of the tile, the last tile is partial (it is padded with zeros,
    which never change ``max|x|``, and the padding is cropped again).
    ``tile_rows=None`` means all rows, ``tile_cols=None`` all columns.

    Returns ``(codes, scale)``: codes int16 of ``x.shape``; scale float64 of
    shape ``(..., R, C)`` with ``R = 1`` when ``tile_rows is None`` else ``N``
    (each tile's scale repeated on its rows) and ``C = 1`` when
    ``tile_cols is None`` else ``D``. Batch axes ``...`` are independent.
    """
    xf = as_float64(x, "x")
    if xf.ndim < 2:
        raise ValueError(f"x must be at least 2-D (..., N, D), got shape {xf.shape}")
    r_in = _check_tile(tile_rows, "tile_rows")
    c_in = _check_tile(tile_cols, "tile_cols")
    *lead, N, D = xf.shape
    if N == 0 or D == 0:
        raise ValueError(f"x has an empty matrix dimension: shape {xf.shape}")
    r = N if r_in is None else r_in
    c = D if c_in is None else c_in
    nr, nc = -(-N // r), -(-D // c)
    if nr * r != N or nc * c != D:
        padded = np.zeros((*lead, nr * r, nc * c))
        padded[..., :N, :D] = xf
    else:
        padded = xf
    tiles = padded.reshape(*lead, nr, r, nc, c)
    codes, scale = psi(tiles, axes=(-3, -1), qmax=qmax, unsigned=unsigned, fp32=fp32)
    codes = codes.reshape(*lead, nr * r, nc * c)[..., :N, :D]
    scale = np.broadcast_to(scale, tiles.shape).reshape(*lead, nr * r, nc * c)[..., :N, :D]
    if r_in is None:
        scale = scale[..., :1, :]
    if c_in is None:
        scale = scale[..., :, :1]
    return np.ascontiguousarray(codes), np.ascontiguousarray(scale)


def quantize_per_token(x, *, qmax: int = INT8_QMAX, unsigned: bool = False):
    """One scale per row (token) over all D columns; scale ``(..., N, 1)``."""
    return quantize_tiles(x, 1, None, qmax=qmax, unsigned=unsigned)


def quantize_per_block(x, block_rows, *, qmax: int = INT8_QMAX, unsigned: bool = False):
    """One scale per block of ``block_rows`` rows × all D (blocks from row 0, last partial).

    The scale is returned per row, ``(..., N, 1)``: a block's scale repeated on
    each of its rows, which is what the kernels consume.
    """
    if block_rows is None:
        raise TypeError("block_rows must be a positive integer, got None")
    return quantize_tiles(x, block_rows, None, qmax=qmax, unsigned=unsigned)


def quantize_per_channel(x, *, qmax: int = INT8_QMAX, unsigned: bool = False):
    """One scale per column (channel) over all N rows; scale ``(..., 1, D)``."""
    return quantize_tiles(x, None, 1, qmax=qmax, unsigned=unsigned)


def quantize_rows_in_tiles(x, tile_cols, *, qmax: int = INT8_QMAX, unsigned: bool = False):
    """One scale per row within each tile of ``tile_cols`` columns; scale ``(..., N, D)``.

    Exact for a product contracting over the columns of one tile (e.g. the
    folded ``dS · diag(s_K)`` feeding ``dQ``: one scale per query row per KV tile).
    """
    if tile_cols is None:
        raise TypeError("tile_cols must be a positive integer, got None")
    return quantize_tiles(x, 1, tile_cols, qmax=qmax, unsigned=unsigned)


def quantize_cols_in_tiles(x, tile_rows, *, qmax: int = INT8_QMAX, unsigned: bool = False):
    """One scale per column within each tile of ``tile_rows`` rows; scale ``(..., N, D)``.

    Exact for a product contracting over the rows of one tile (e.g. ``P`` or
    ``diag(s_Q) dS`` feeding ``dV`` / ``dK``: one scale per key column per Q tile).
    """
    if tile_rows is None:
        raise TypeError("tile_rows must be a positive integer, got None")
    return quantize_tiles(x, tile_rows, 1, qmax=qmax, unsigned=unsigned)
