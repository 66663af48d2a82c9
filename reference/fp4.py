"""FP4 / FP8 codecs and block quantizers in float64 (docs/algorithms.md §5).

Formats
-------
* **E2M1** (FP4): 4-bit code ``sign << 3 | i`` where ``i`` indexes the magnitudes
  ``{0, 0.5, 1, 1.5, 2, 3, 4, 6}``. Encoding rounds to nearest, ties to the
  even code (= even mantissa bit: 0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2,
  2.5 -> 2, 3.5 -> 4, 5 -> 4) and saturates at ±6, as PTX
  ``cvt.rn.satfinite.e2m1x2.f32`` does. E2M1 has no NaN: the PTX ISA converts
  NaN to **positive MAX_NORM** under ``.satfinite``, so ``e2m1_encode(nan)`` is
  code 7 (+6) whatever the NaN's sign; ``±inf`` saturates to ``±6``. The sign
  of zero is kept (``-0.0`` and negative values that round to zero give code 8,
  "-0"), as an IEEE conversion does.
* **E4M3** (OCP FP8 E4M3FN): bias 7, largest finite 448, subnormals
  ``k · 2^-9``, round to nearest even, saturating to ±448 (also ``±inf``),
  no infinities; NaN encodes as ``0x7F`` and ``0x7F``/``0xFF`` decode to NaN.
  Sign of zero kept (``-0.0 -> 0x80``).
* **E8M0** (MX scales): code ``c`` is ``2^(c − 127)``, ``0xFF`` is NaN.

Both the E2M1 and E4M3 encoders are the same exact procedure: the non-negative
values of a format, in code order, are increasing, so the magnitude's code is
found with ``searchsorted`` and compared against the *exact* midpoint to the
next code (midpoints have at most 6 significant bits, so they are exact float64
values and the comparison involves no rounding); a tie goes to the even code,
which is the even mantissa.

NVFP4 (:func:`nvfp4_quantize`)
------------------------------
16 consecutive elements along ``axis`` share one E4M3 scale:
``s = e4m3(max|x| / 6)``, ``x̂ = e2m1(x / s)``, value ``s · x̂``. ``max|x| / 6``
is computed in float64 and rounded **once** to E4M3; ``x / s`` uses the rounded
``s``. Choices:

* A block whose scale is 0 (an all-zero block, or ``max|x| / 6 < 2^-10`` so the
  scale underflows) gets all codes 0 (``+0``, never ``-0``) and dequantizes to
  0. The GPU quantizer must write code 0 there too (not ``x / 0``).
* **NaN / Inf**: a block containing a NaN or ``±inf`` gets the NaN scale code
  ``0x7F``, so all 16 of its dequantized values are NaN: a bad input never turns
  into a silent finite value. (Plain saturation would map ``inf`` to scale 448.)
  Its element codes are what ``x / NaN`` encodes to, i.e. 7; they carry no
  information. Other blocks of the same tensor are unaffected, except with
  ``tensor_scale=True``: then a single non-finite value makes the per-tensor
  scale NaN and every block's scale ``0x7F``.
* ``tensor_scale=True`` (the optional second level): ``s_T = fp32(amax / 2688)``
  over the whole tensor (2688 = 448·6), kept as a float32 value because the
  format stores it in fp32 (for fp16/bf16/fp32 ``amax`` the float64 quotient
  rounded to fp32 equals the fp32 division: ``amax/2688`` is ``amax/(21·2^7)``,
  whose binary expansion is exact or periodic with period 6, so it never lies
  within float64 rounding of an fp32 midpoint). Then
  ``s = e4m3(max|x| / (6 · s_T))`` (float64, ``6 · s_T`` is exact), element
  codes ``e2m1(x / (s · s_T))`` (``s · s_T`` exact) and value ``s · s_T · x̂``.
  An all-zero tensor has ``s_T = 0`` and all scales 0.

float64 here vs fp32 on the GPU (block scales without a tensor scale)
-----------------------------------------------------------------------
The GPU computes ``max|x| / 6`` in fp32. This can change the E4M3 result only
if the fp32 rounding of ``m / 6`` moves it onto or across an E4M3 rounding
midpoint ``μ`` (a midpoint between two adjacent codes, ``μ`` has at most 5
significant bits and is exactly representable in fp32 and float64). Rounding is
monotone and ``μ`` is representable, so the fp32 value stays on ``m/6``'s side
of ``μ`` unless it lands exactly on ``μ`` while ``m/6 ≠ μ``. Two cases:

* ``m = 6μ``: then ``m / 6 = μ`` exactly in every precision and both round the
  tie to even.
* ``m ≠ 6μ``: ``6μ`` has at most 7 significant bits, so for fp16 (11 bits) and
  bf16 (8 bits) ``m`` the two are distinct points of ``m``'s own grid and
  ``|m − 6μ| >= 1 ulp`` — a relative gap of at least about ``2^-12``. Any fp32
  evaluation whose relative error is below ``2^-13`` (a correctly rounded
  division, ``2^-24``, or ``m * (1/6.0f)``, about ``2^-23``) cannot close it.
  Even for fp32 ``m`` a correctly rounded fp32 division (``div.rn``) is safe:
  ``m ≈ 6μ`` sits at least two binades above ``μ``, so ``ulp(m) >= 4 ulp(μ)``
  and ``|m/6 − μ| >= (2/3) ulp(μ)`` exceeds the half-ulp that rounding can move.

So for fp16/bf16 inputs the float64 and fp32 scales are identical; the tests
check this exhaustively over every positive fp16 and bf16 value.

Element codes: for a fp16/bf16 ``x`` and an E4M3 ``s`` the same argument
(``μ · s`` has at most 7 bits) shows ``x / s`` is at least about ``2^-12``
(relative) from every E2M1 midpoint unless it *is* one. At such exact ties the
GPU must divide with a correctly rounded ``x / s`` (``__fdiv_rn``), not
``x * (1/s)``, whose two roundings can push the tie off the midpoint.
With ``tensor_scale`` the products ``6 μ s_T`` and ``μ s s_T`` carry up to ~31
significant bits, so fp32 arithmetic can disagree with this reference on rare
inputs; a bit-exact GPU quantizer computes the per-block target and the element
quotients of that path in double.

MXFP4 (:func:`mxfp4_quantize`)
------------------------------
OCP MX v1.0: 32 elements share an E8M0 scale ``X = 2^(floor(log2(max|x|)) − 2)``
(2 = emax of E2M1) and elements are ``e2m1(x / X)``, saturating (so values in
``(6, 8) · X`` clip to 6). The exponent is clamped to E8M0's ``[-127, 127]``.
An all-zero block gets exponent code 0 (``2^-127``) and codes 0; a block with
NaN/Inf gets the NaN scale ``0xFF``.

Two-level P (:func:`two_level_p_fake_quantize`)
-----------------------------------------------
See that function.

All functions accept any real array (converted to float64) and never modify
their inputs. Unpacked codes are ``uint8`` arrays of the input's shape.
"""
from __future__ import annotations

import numbers

import numpy as np

from .attention import as_float64

__all__ = [
    "E2M1_MAGNITUDES",
    "E2M1_VALUES",
    "E2M1_MAX",
    "E4M3_MAX",
    "E4M3_NAN_CODE",
    "E4M3_VALUES",
    "E8M0_NAN_CODE",
    "NVFP4_BLOCK",
    "MXFP4_BLOCK",
    "e2m1_encode",
    "e2m1_decode",
    "e2m1_round",
    "e4m3_encode",
    "e4m3_decode",
    "e4m3_round",
    "e8m0_decode",
    "pack_e2m1",
    "unpack_e2m1",
    "pad_to_multiple",
    "nvfp4_quantize",
    "nvfp4_dequantize",
    "nvfp4_fake_quantize",
    "mxfp4_quantize",
    "mxfp4_dequantize",
    "mxfp4_fake_quantize",
    "two_level_p_fake_quantize",
]

NVFP4_BLOCK = 16
MXFP4_BLOCK = 32

#: E2M1 magnitudes in code order (codes 0..7); codes 8..15 are their negatives.
E2M1_MAGNITUDES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
#: The value of each of the 16 E2M1 codes (code 8 is -0.0).
E2M1_VALUES = np.concatenate([E2M1_MAGNITUDES, -E2M1_MAGNITUDES])
E2M1_MAX = 6.0

E4M3_MAX = 448.0
E4M3_NAN_CODE = 0x7F
E8M0_NAN_CODE = 0xFF


def _e4m3_table() -> np.ndarray:
    """The float64 value of each of the 256 E4M3FN codes (NaN for 0x7F, 0xFF)."""
    codes = np.arange(256)
    sign = np.where(codes >> 7, -1.0, 1.0)
    exp = (codes >> 3) & 0xF
    man = (codes & 0x7).astype(np.float64)
    mag = np.where(exp == 0, man * 2.0**-9, (1.0 + man / 8.0) * np.exp2(exp - 7.0))
    values = sign * mag
    values[(codes & 0x7F) == 0x7F] = np.nan
    return values


#: The value of each of the 256 E4M3 codes (index = code; NaN at 0x7F and 0xFF).
E4M3_VALUES = _e4m3_table()
_E4M3_MAGNITUDES = E4M3_VALUES[:0x7F]  # codes 0x00..0x7E: 0 .. 448, increasing


# ----------------------------------------------------------------------------
# argument helpers
# ----------------------------------------------------------------------------


def _as_codes(codes, name: str, limit: int) -> np.ndarray:
    """uint8 view of integer codes, each below ``limit``."""
    arr = np.asarray(codes)
    if arr.dtype.kind not in "ui":
        raise TypeError(f"{name} must be an integer (uint8) array, got dtype {arr.dtype}")
    if arr.size and (arr.min() < 0 or arr.max() >= limit):
        raise ValueError(f"{name} must hold codes in [0, {limit - 1}], got range [{arr.min()}, {arr.max()}]")
    return arr.astype(np.uint8)


def _norm_axis(axis, ndim: int, name: str = "axis") -> int:
    if isinstance(axis, bool) or not isinstance(axis, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {axis!r}")
    if ndim == 0:
        raise ValueError("a 0-d array has no axis to quantize along")
    if not -ndim <= axis < ndim:
        raise ValueError(f"{name}={axis} is out of range for an array with {ndim} dimensions")
    return int(axis) % ndim


def _check_bool(value, name: str) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be a bool, got {value!r}")
    return bool(value)


def pad_to_multiple(x, multiple: int, axis: int = -1) -> np.ndarray:
    """Zero-pad ``x`` at the end of ``axis`` to a length that is a multiple of ``multiple`` (a copy)."""
    x = np.asarray(x)
    ax = _norm_axis(axis, x.ndim)
    if isinstance(multiple, bool) or not isinstance(multiple, numbers.Integral) or multiple < 1:
        raise ValueError(f"multiple={multiple!r} must be a positive integer")
    pad = (-x.shape[ax]) % multiple
    widths = [(0, 0)] * x.ndim
    widths[ax] = (0, pad)
    return np.pad(x, widths)


# ----------------------------------------------------------------------------
# scalar formats
# ----------------------------------------------------------------------------


def _round_to_grid(mag: np.ndarray, grid: np.ndarray) -> np.ndarray:
    """Code (index into the increasing ``grid``) nearest to each ``mag >= 0``; ties to the even code.

    Saturates at the last code. ``mag`` must not contain NaN. Exact: compares
    with the float64-exact midpoints ``(grid[i] + grid[i+1]) / 2``.
    """
    top = len(grid) - 1
    lo = np.clip(np.searchsorted(grid, mag, side="right") - 1, 0, top)
    hi = np.minimum(lo + 1, top)
    mid = (grid[lo] + grid[hi]) / 2.0
    up = (lo < top) & ((mag > mid) | ((mag == mid) & (hi % 2 == 0)))
    return np.where(up, hi, lo).astype(np.uint8)


def e2m1_encode(x) -> np.ndarray:
    """uint8 E2M1 codes of ``x``: nearest, ties to even, saturating at ±6; NaN -> 7 (+6, PTX)."""
    x64 = as_float64(x, "x")
    nan = np.isnan(x64)
    mag = _round_to_grid(np.where(nan, 0.0, np.abs(x64)), E2M1_MAGNITUDES)
    codes = np.where(np.signbit(x64), mag | 0x8, mag).astype(np.uint8)
    return np.where(nan, np.uint8(0x7), codes).astype(np.uint8)


def e2m1_decode(codes) -> np.ndarray:
    """float64 values of E2M1 codes (0..15)."""
    return E2M1_VALUES[_as_codes(codes, "codes", 16)]


def e2m1_round(x) -> np.ndarray:
    """``x`` rounded to E2M1 (float64); NaN becomes +6 as on the GPU."""
    return e2m1_decode(e2m1_encode(x))


def e4m3_encode(x) -> np.ndarray:
    """uint8 E4M3FN codes of ``x``: nearest even, saturating to ±448 (also for ±inf), NaN -> 0x7F."""
    x64 = as_float64(x, "x")
    nan = np.isnan(x64)
    mag = _round_to_grid(np.where(nan, 0.0, np.abs(x64)), _E4M3_MAGNITUDES)
    codes = np.where(np.signbit(x64), mag | 0x80, mag).astype(np.uint8)
    return np.where(nan, np.uint8(E4M3_NAN_CODE), codes).astype(np.uint8)


def e4m3_decode(codes) -> np.ndarray:
    """float64 values of E4M3FN codes (0..255); 0x7F and 0xFF are NaN."""
    return E4M3_VALUES[_as_codes(codes, "codes", 256)]


def e4m3_round(x) -> np.ndarray:
    """``x`` rounded to E4M3FN (float64), saturating; NaN stays NaN."""
    return e4m3_decode(e4m3_encode(x))


def e8m0_decode(codes) -> np.ndarray:
    """float64 values ``2^(c − 127)`` of E8M0 codes; 0xFF is NaN."""
    c = _as_codes(codes, "codes", 256).astype(np.float64)
    return np.where(c == E8M0_NAN_CODE, np.nan, np.exp2(c - 127.0))


# ----------------------------------------------------------------------------
# exchange format
# ----------------------------------------------------------------------------


def pack_e2m1(codes, axis: int = -1) -> np.ndarray:
    """Pack E2M1 codes two per byte along ``axis`` (its length must be even).

    Element ``2i`` goes to the LOW nibble and ``2i + 1`` to the HIGH nibble of
    byte ``i``. (PTX ``cvt.rn.satfinite.e2m1x2.f32 d, a, b`` puts ``a`` in the
    high nibble, so a kernel passes ``a = x[2i+1], b = x[2i]``.)
    """
    c = _as_codes(codes, "codes", 16)
    ax = _norm_axis(axis, c.ndim)
    if c.shape[ax] % 2:
        raise ValueError(f"codes must have an even length along axis {axis}, got {c.shape[ax]}")
    cm = np.moveaxis(c, ax, -1)
    packed = (cm[..., 0::2] | (cm[..., 1::2] << 4)).astype(np.uint8)
    return np.moveaxis(packed, -1, ax)


def unpack_e2m1(packed, axis: int = -1) -> np.ndarray:
    """Inverse of :func:`pack_e2m1`: uint8 codes, twice as long along ``axis``."""
    p = _as_codes(packed, "packed", 256)
    ax = _norm_axis(axis, p.ndim)
    pm = np.moveaxis(p, ax, -1)
    out = np.empty(pm.shape[:-1] + (2 * pm.shape[-1],), dtype=np.uint8)
    out[..., 0::2] = pm & 0xF
    out[..., 1::2] = pm >> 4
    return np.moveaxis(out, -1, ax)


# ----------------------------------------------------------------------------
# NVFP4
# ----------------------------------------------------------------------------


def _blocks(x64: np.ndarray, axis: int, block: int, fmt: str):
    """Move ``axis`` last and split it into ``(n // block, block)``; ValueError if not a multiple."""
    ax = _norm_axis(axis, x64.ndim)
    n = x64.shape[ax]
    if n % block:
        raise ValueError(
            f"{fmt} needs the length along axis {axis} to be a multiple of {block}, got {n} "
            f"(pad with pad_to_multiple first)"
        )
    xm = np.moveaxis(x64, ax, -1)
    return ax, xm.reshape(xm.shape[:-1] + (n // block, block))


def _unblocks(b: np.ndarray, ax: int) -> np.ndarray:
    return np.moveaxis(b.reshape(b.shape[:-2] + (b.shape[-2] * b.shape[-1],)), -1, ax)


def _block_scale_axis(s: np.ndarray, ax: int) -> np.ndarray:
    """Per-block array ``(..., nb)`` (axis moved last) back to the caller's axis position."""
    return np.moveaxis(s, -1, ax)


def _encode_blocks(blocks: np.ndarray, denom: np.ndarray) -> np.ndarray:
    """E2M1 codes of ``blocks / denom`` (denom per block); code 0 wherever ``denom == 0``."""
    zero = denom == 0
    with np.errstate(divide="ignore", invalid="ignore"):
        q = blocks / np.where(zero, 1.0, denom)[..., None]
    codes = e2m1_encode(q)
    return np.where(zero[..., None], np.uint8(0), codes).astype(np.uint8)


def nvfp4_quantize(x, axis: int = -1, tensor_scale: bool = False):
    """NVFP4 quantization in 1x16 blocks along ``axis`` (see the module docstring).

    Returns ``(codes, scales, s_T)``: ``codes`` uint8 E2M1 codes, unpacked, of
    ``x``'s shape; ``scales`` uint8 E4M3 codes with ``x``'s shape except
    ``shape[axis] // 16``; ``s_T`` the per-tensor scale as a Python float
    (a float32 value; NaN if the tensor has a non-finite value) or None when
    ``tensor_scale`` is False. ValueError if the length along ``axis`` is not a
    multiple of 16.
    """
    tensor_scale = _check_bool(tensor_scale, "tensor_scale")
    x64 = as_float64(x, "x")
    ax, b = _blocks(x64, axis, NVFP4_BLOCK, "NVFP4")
    finite = np.isfinite(b).all(axis=-1)
    amax = np.max(np.abs(np.where(np.isfinite(b), b, 0.0)), axis=-1)
    s_t = None
    if not tensor_scale:
        target = amax / E2M1_MAX
    elif not finite.all():
        s_t = float("nan")  # one bad value poisons the per-tensor scale, hence every block
        target = np.full_like(amax, np.nan)
    else:
        with np.errstate(over="ignore", under="ignore"):
            s_t = float(np.float32(amax.max() / (E4M3_MAX * E2M1_MAX)))
        if np.isinf(s_t):
            raise ValueError(f"x has max|x|={amax.max():.6g}: the per-tensor scale overflows fp32")
        # s_T == 0: the tensor is zero (or so tiny that s_T underflows fp32): all scales 0.
        target = amax / (E2M1_MAX * s_t) if s_t > 0 else np.zeros_like(amax)
    target = np.where(finite, target, np.nan)
    scales = e4m3_encode(target)
    denom = e4m3_decode(scales) * (1.0 if s_t is None else s_t)
    codes = _encode_blocks(b, denom)
    return _unblocks(codes, ax), _block_scale_axis(scales, ax), s_t


def _dequantize_blocks(codes, scales, axis, block, fmt, decode_scale):
    """float64 ``scale · e2m1(code)`` for E2M1 codes (unpacked) in blocks of ``block`` along ``axis``,
    with one scale code per block decoded by ``decode_scale``."""
    c = _as_codes(codes, "codes", 16)
    sc = _as_codes(scales, "scales", 256)
    ax = _norm_axis(axis, c.ndim)
    expect = c.shape[:ax] + (c.shape[ax] // block,) + c.shape[ax + 1 :]
    if c.shape[ax] % block or sc.shape != expect:
        raise ValueError(f"scales must have shape {expect} for codes of shape {c.shape} (axis={axis}), got {sc.shape}")
    _, vb = _blocks(e2m1_decode(c), ax, block, fmt)
    return _unblocks(vb * np.moveaxis(decode_scale(sc), ax, -1)[..., None], ax)


def nvfp4_dequantize(codes, scales, tensor_scale=None, axis: int = -1) -> np.ndarray:
    """float64 values ``s_T · s · e2m1(code)`` of NVFP4 data (``s_T`` = 1 when None).

    ``codes`` unpacked (see :func:`unpack_e2m1`), ``scales`` E4M3 codes with
    ``codes.shape[axis] // 16`` entries along ``axis``.
    """
    if tensor_scale is not None and (isinstance(tensor_scale, bool) or not isinstance(tensor_scale, numbers.Real)):
        raise TypeError(f"tensor_scale must be a real number or None, got {tensor_scale!r}")
    t = 1.0 if tensor_scale is None else float(tensor_scale)
    return _dequantize_blocks(codes, scales, axis, NVFP4_BLOCK, "NVFP4", lambda sc: e4m3_decode(sc) * t)


def nvfp4_fake_quantize(x, axis: int = -1, tensor_scale: bool = False) -> np.ndarray:
    """NVFP4 quantize then dequantize (float64, ``x``'s shape)."""
    codes, scales, s_t = nvfp4_quantize(x, axis=axis, tensor_scale=tensor_scale)
    return nvfp4_dequantize(codes, scales, s_t, axis=axis)


# ----------------------------------------------------------------------------
# MXFP4
# ----------------------------------------------------------------------------


def mxfp4_quantize(x, axis: int = -1):
    """MXFP4 (OCP MX v1.0) in blocks of 32 along ``axis``: ``(codes uint8, scales_e8m0 uint8)``.

    ``X = 2^(floor(log2 max|x|) − 2)`` clamped to ``[2^-127, 2^127]``;
    ``codes = e2m1(x / X)`` (saturating). Zero block: scale code 0, codes 0.
    NaN/Inf block: scale code 0xFF (NaN). ValueError unless the length along
    ``axis`` is a multiple of 32.
    """
    x64 = as_float64(x, "x")
    ax, b = _blocks(x64, axis, MXFP4_BLOCK, "MXFP4")
    finite = np.isfinite(b).all(axis=-1)
    amax = np.max(np.abs(np.where(np.isfinite(b), b, 0.0)), axis=-1)
    _, e = np.frexp(amax)  # amax = f · 2^e, f in [0.5, 1): floor(log2 amax) = e − 1 (exact)
    exp = np.clip(e.astype(np.int64) - 1 - 2, -127, 127)
    scales = np.where(amax > 0, exp + 127, 0)
    scales = np.where(finite, scales, E8M0_NAN_CODE).astype(np.uint8)
    denom = np.where(amax > 0, e8m0_decode(scales), 0.0)
    codes = _encode_blocks(b, denom)
    return _unblocks(codes, ax), _block_scale_axis(scales, ax)


def mxfp4_dequantize(codes, scales, axis: int = -1) -> np.ndarray:
    """float64 values ``X · e2m1(code)`` of MXFP4 data."""
    return _dequantize_blocks(codes, scales, axis, MXFP4_BLOCK, "MXFP4", e8m0_decode)


def mxfp4_fake_quantize(x, axis: int = -1) -> np.ndarray:
    """MXFP4 quantize then dequantize (float64, ``x``'s shape)."""
    codes, scales = mxfp4_quantize(x, axis=axis)
    return mxfp4_dequantize(codes, scales, axis=axis)


# ----------------------------------------------------------------------------
# two-level P
# ----------------------------------------------------------------------------


def two_level_p_fake_quantize(p, block_kv: int, axis: int = -1) -> np.ndarray:
    """Two-level NVFP4 fake quantization of probabilities ``p >= 0`` (docs/algorithms.md §5).

    Along ``axis`` (the keys), the keys are cut into tiles of ``block_kv``
    starting at key 0 (the last tile may be partial). For every row (every
    index of the other axes) and tile: ``s1 = max_tile(p) / (448 · 6)``
    (float64), ``p2 = p / s1`` (so the tile max becomes 2688 and its block scale
    448), then NVFP4 of ``p2`` in 16-blocks along the keys aligned at the tile
    start (a partial tile is zero-padded to a multiple of 16 first; the padding
    is dropped again), and the result is ``nvfp4(p2) · s1``. A tile that is all
    zero (e.g. fully masked) stays zero. ``block_kv`` must be a positive
    multiple of 16 so 16-blocks never straddle tiles. NaN in ``p`` makes its
    row's tile NaN. Returns float64 of ``p``'s shape.
    """
    if isinstance(block_kv, bool) or not isinstance(block_kv, numbers.Integral) or block_kv < 16 or block_kv % 16:
        raise ValueError(f"block_kv={block_kv!r} must be a positive multiple of 16")
    p64 = as_float64(p, "p")
    ax = _norm_axis(axis, p64.ndim)
    if np.any(p64 < 0):
        raise ValueError("p must be non-negative (probabilities)")
    n = p64.shape[ax]
    pm = np.moveaxis(pad_to_multiple(p64, block_kv, ax), ax, -1)
    tiles = pm.reshape(pm.shape[:-1] + (pm.shape[-1] // block_kv, block_kv))
    s1 = tiles.max(axis=-1, initial=0.0) / (E4M3_MAX * E2M1_MAX)
    s1 = np.where(np.isnan(tiles).any(axis=-1), np.nan, s1)
    zero = s1 == 0
    with np.errstate(invalid="ignore"):
        p2 = tiles / np.where(zero, 1.0, s1)[..., None]
    q = nvfp4_fake_quantize(p2, axis=-1) * np.where(zero, 0.0, s1)[..., None]
    q = q.reshape(pm.shape)[..., :n]
    return np.moveaxis(q, -1, ax)
