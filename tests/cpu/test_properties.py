"""Property tests (hypothesis) of the codecs and quantizers: E2M1, E4M3, E8M0, bfloat16 bits, the INT8 quantizers
of ``reference/quant.py`` and NVFP4 / MXFP4 blocks (``reference/fp4.py``).

Each property states what the module promises, checked against a definition that does not reuse the module's
procedure: "nearest" is checked with exact rational distances (``fractions.Fraction``) to every value of the
format, error bounds with the bound written out. Equalities are exact wherever the arithmetic is exact
(power-of-two scaling, permutations, block independence); the error bounds' small margins for float64 rounding
are derived where they are used. Examples are derandomized so every run draws the same cases; the reference attention
invariants are in test_properties_attention.py.
"""
import math
from fractions import Fraction

import numpy as np
import pytest

pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, assume, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from hypothesis.extra import numpy as hnp  # noqa: E402

from sagecupy import analysis  # noqa: E402
from sagecupy.reference import fp4 as F  # noqa: E402
from sagecupy.reference import quant as Q  # noqa: E402


def cases(n):
    """Same draws on every run (CI reproducible), no example database written, no per-example deadline."""
    return settings(max_examples=n, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


# ----------------------------------------------------------------------------
# scalar codecs: E2M1, E4M3
# ----------------------------------------------------------------------------

E4M3_MAGS = F.E4M3_VALUES[:0x7F]  # codes 0x00..0x7E, increasing: 0 .. 448
E2M1_MAGS = F.E2M1_MAGNITUDES
# name -> (encode, decode, non-negative magnitudes in code order, sign bit, code every NaN encodes to)
FORMATS = {
    "e2m1": (F.e2m1_encode, F.e2m1_decode, E2M1_MAGS, 0x8, 0x7),
    "e4m3": (F.e4m3_encode, F.e4m3_decode, E4M3_MAGS, 0x80, F.E4M3_NAN_CODE),
}


def _near_points(mags):
    """Every magnitude of a format, every midpoint between neighbours and past the top, and the float64 on each
    side of each: the inputs where a tie rule or a saturation rule decides."""
    pts = set(mags.tolist()) | set(((mags[1:] + mags[:-1]) / 2).tolist()) | {mags[-1] * 1.0625, mags[-1] * 2}
    return sorted(p2 for p in pts for p2 in (p, np.nextafter(p, -np.inf), np.nextafter(p, np.inf)) if p2 >= 0)


def _inputs(mags):
    """Any float64 but NaN (infinities, subnormals, huge values) or one near a tie, with either sign."""
    near = st.tuples(st.sampled_from(_near_points(mags)), st.booleans()).map(lambda t: -t[0] if t[1] else t[0])
    return st.one_of(st.floats(allow_nan=False), st.floats(-2 * mags[-1], 2 * mags[-1]), near)


def _assert_nearest(x, code, mags, sign):
    """``code`` encodes a nearest magnitude of ``|x|`` among ``mags`` (exact rational distances; so ``|x|`` past the
    top saturates to it, ``inf`` included), a tie between two magnitudes goes to the even code (even mantissa), and
    the sign bit is ``x``'s (``-0.0`` included). ``x``: a float, or a ``(Fraction magnitude, negative)`` pair."""
    ax, negative = (x if isinstance(x, tuple) else
                    (None if math.isinf(x) else Fraction(abs(x)), math.copysign(1.0, x) < 0))
    code = int(code)
    assert bool(code & sign) == negative, (x, code)
    idx = code & ~sign
    assert 0 <= idx < len(mags)
    if ax is None:  # an infinity
        assert idx == len(mags) - 1, (x, code)
        return
    dist = [abs(ax - Fraction(float(m))) for m in mags]
    best = min(dist)
    assert dist[idx] == best, (x, code, float(best))
    if dist.count(best) > 1:
        assert idx % 2 == 0, ("tie not to the even code", x, code)


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_every_code_round_trips(fmt):
    """encode(decode(c)) == c for every code that is a number (both zeros included); NaN codes decode to NaN and
    encode back to the one NaN code."""
    enc, dec, mags, sign, nan_code = FORMATS[fmt]
    codes = np.arange(2 * sign, dtype=np.uint8)
    values = dec(codes)
    is_nan = np.isnan(values)
    np.testing.assert_array_equal(enc(values[~is_nan]), codes[~is_nan])
    assert np.all(enc(values[is_nan]) == nan_code)
    assert is_nan.sum() == (2 if fmt == "e4m3" else 0)
    # magnitudes strictly increase in code order, the negative half mirrors the positive one bit for bit
    assert np.all(np.diff(mags) > 0)
    num = ~is_nan[:sign]
    np.testing.assert_array_equal(values[sign:][num].view(np.uint64), (-values[:sign][num]).view(np.uint64))


@pytest.mark.parametrize("fmt", sorted(FORMATS))
@cases(150)
@given(data=st.data())
def test_encode_is_nearest_ties_even_saturating(fmt, data):
    """Any non-NaN float64 (near ties and past the top included) encodes to a nearest value (module docstring of
    fp4.py: ties to even, saturating at +-6 / +-448, +-inf too, sign of zero kept)."""
    enc, dec, mags, sign, _ = FORMATS[fmt]
    xs = data.draw(st.lists(_inputs(mags), min_size=1, max_size=8))
    codes = enc(np.array(xs, dtype=np.float64))
    for x, c in zip(xs, codes):
        _assert_nearest(x, c, mags, sign)
    # decode(encode(x)) is the value of that code: idempotent
    np.testing.assert_array_equal(enc(dec(codes)), codes)


@pytest.mark.parametrize("fmt", sorted(FORMATS))
@cases(150)
@given(data=st.data())
def test_encode_monotone_and_sign_symmetric(fmt, data):
    """x <= y gives round(x) <= round(y); encode(-x) is encode(x) with the sign bit flipped."""
    enc, dec, mags, sign, _ = FORMATS[fmt]
    x = np.array(data.draw(st.lists(_inputs(mags), min_size=2, max_size=10)), dtype=np.float64)
    r = dec(enc(np.sort(x)))
    assert np.all(r[1:] >= r[:-1]), (np.sort(x), r)
    # exact sign symmetry: the code of -x is the code of x with the sign bit flipped (+-0 and +-inf included)
    np.testing.assert_array_equal(enc(-x), enc(x) ^ np.uint8(sign))


@pytest.mark.parametrize("fmt", sorted(FORMATS))
@cases(60)
@given(payload=st.integers(1, 2**52 - 1), negative=st.booleans())
def test_every_nan_encodes_to_the_nan_rule(fmt, payload, negative):
    """Any NaN (either sign, any payload): E2M1 gives +6 (code 7, PTX satfinite), E4M3 the NaN code 0x7F."""
    enc, _, _, _, nan_code = FORMATS[fmt]
    bits = np.uint64(0x7FF0_0000_0000_0000 | payload | (1 << 63 if negative else 0))
    x = np.array([bits], dtype=np.uint64).view(np.float64)
    assert np.isnan(x[0])
    assert enc(x)[0] == nan_code


@cases(60)
@given(data=st.data(), axis=st.sampled_from([0, 1, -1]))
def test_pack_unpack_round_trip(data, axis):
    """unpack(pack(codes)) == codes along any axis; pack(unpack(byte)) == byte for all 256 bytes."""
    shape = [data.draw(st.integers(1, 4)), data.draw(st.integers(1, 4))]
    shape[axis] *= 2
    codes = data.draw(hnp.arrays(np.uint8, tuple(shape), elements=st.integers(0, 15)))
    packed = F.pack_e2m1(codes, axis=axis)
    assert packed.shape[axis] == shape[axis] // 2
    np.testing.assert_array_equal(F.unpack_e2m1(packed, axis=axis), codes)
    every_byte = np.arange(256, dtype=np.uint8)
    np.testing.assert_array_equal(F.pack_e2m1(F.unpack_e2m1(every_byte)), every_byte)


def test_e8m0_every_code():
    """Code c is exactly 2^(c - 127) (a float64 power of two: zero mantissa bits), strictly increasing; 0xFF NaN.
    MXFP4's scale selection is E8M0's encoder: a block whose max|x| is anywhere in [4, 8) * 2^(c - 127) gets code c
    back, for every code (both ends of the interval tried)."""
    c = np.arange(255, dtype=np.uint8)
    v = F.e8m0_decode(c)
    np.testing.assert_array_equal(v, [math.ldexp(1.0, int(i) - 127) for i in c])
    assert np.all(v.view(np.uint64) & np.uint64((1 << 52) - 1) == 0)
    assert np.all(np.diff(v) > 0)
    assert np.isnan(F.e8m0_decode(np.array([0xFF], np.uint8))[0])
    for top in (4 * v, np.nextafter(8 * v, 0)):
        x = np.zeros((255, F.MXFP4_BLOCK))
        x[:, 3] = -top
        _, scales = F.mxfp4_quantize(x)
        np.testing.assert_array_equal(scales[:, 0], c)


# ----------------------------------------------------------------------------
# bfloat16 bits (sagecupy.analysis)
# ----------------------------------------------------------------------------


def _bf16_value(bits):
    """float64 value of bfloat16 bit patterns (the top half of a float32)."""
    f = (np.asarray(bits, np.uint16).astype(np.uint32) << np.uint32(16)).view(np.float32)
    with np.errstate(invalid="ignore"):  # (widening a signalling NaN pattern)
        return f.astype(np.float64)


def test_bf16_every_pattern_round_trips():
    """bf16_bits(value(b)) == b for each of the 65536 patterns that is a number (+-0, subnormals, +-inf); every NaN
    pattern gives the one quiet NaN 0x7FC0; round_to_dtype leaves each value as it is."""
    b = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    v = _bf16_value(b)
    nan = np.isnan(v)
    np.testing.assert_array_equal(analysis.bf16_bits(v[~nan]), b[~nan])
    assert np.all(analysis.bf16_bits(v[nan]) == 0x7FC0)
    r = analysis.round_to_dtype(v[~nan], "bf16")
    np.testing.assert_array_equal(r.view(np.uint64), v[~nan].view(np.uint64))


def test_bf16_adapter_bits_round_trip():
    """The adapter's zero-copy views: bits_of gives back the pattern, to_float32 its exact float32 value."""
    md = pytest.importorskip("ml_dtypes")
    from sagecupy.adapters import bf16

    b = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    x = b.view(md.bfloat16)
    assert bf16.is_native(x) and bf16.is_bf16(x)
    np.testing.assert_array_equal(bf16.bits_of(x), b)
    np.testing.assert_array_equal(bf16.to_float32(x).view(np.uint32), b.astype(np.uint32) << np.uint32(16))


@cases(300)
@given(xs=st.lists(st.one_of(st.floats(allow_nan=False), st.floats(-4.0, 4.0),
                             st.floats(-2.0**-120, 2.0**-120),
                             st.floats(2.0**127, 2.0**129), st.floats(-(2.0**129), -(2.0**127))),
                   min_size=1, max_size=8))
def test_bf16_is_nearest_ties_even_overflow_to_inf(xs):
    """round_to_dtype(x, "bf16") is a nearest bfloat16 of x, ties to the even pattern, rounding from float64 once;
    past the largest finite value IEEE's rule (round as if 2^128 were representable, then that is inf); the sign is
    x's. Checked against both neighbouring patterns with exact rational distances."""
    x = np.array(xs, dtype=np.float64)
    bits = analysis.bf16_bits(x)
    r = analysis.round_to_dtype(x, "bf16")
    np.testing.assert_array_equal(r.view(np.uint64), _bf16_value(bits).view(np.uint64))

    def mag_value(m):  # magnitude pattern -> exact value, 0x7F80 (inf) standing for 2^128
        return Fraction(2) ** 128 if m == 0x7F80 else Fraction(float(_bf16_value(m)))

    for xi, b in zip(xs, bits):
        b = int(b)
        assert bool(b & 0x8000) == (math.copysign(1.0, xi) < 0)
        m = b & 0x7FFF
        assert m <= 0x7F80
        if math.isinf(xi):
            assert m == 0x7F80
            continue
        ax = Fraction(abs(xi))
        d = abs(ax - mag_value(m))
        for nb in (m - 1, m + 1):
            if 0 <= nb <= 0x7F80:
                dn = abs(ax - mag_value(nb))
                assert d <= dn, (xi, hex(b))
                if d == dn:
                    assert m % 2 == 0, ("tie not to even", xi, hex(b))


@cases(150)
@given(xs=st.lists(st.floats(allow_nan=False), min_size=2, max_size=10))
def test_bf16_monotone_and_sign_symmetric(xs):
    """x <= y gives bf16(x) <= bf16(y) (infinities included); the bits of -x are those of x with the sign flipped."""
    x = np.array(xs, dtype=np.float64)
    r = analysis.round_to_dtype(np.sort(x), "bf16")
    assert np.all(r[1:] >= r[:-1])
    np.testing.assert_array_equal(analysis.bf16_bits(-x), analysis.bf16_bits(x) ^ np.uint16(0x8000))


# ----------------------------------------------------------------------------
# INT8 quantizers (reference/quant.py)
# ----------------------------------------------------------------------------

_finite = st.floats(-1e6, 1e6, allow_nan=False, allow_infinity=False)
# no magnitudes where a power-of-two rescaling would leave float64's (or float32's) normal range
_scalable = _finite.map(lambda v: 0.0 if abs(v) < 1e-20 else v)
matrices = hnp.arrays(np.float64, st.tuples(st.integers(1, 7), st.integers(1, 9)), elements=_finite)
GRANULARITIES = ("token", "block", "channel", "rows_in_tiles", "cols_in_tiles", "tiles")


def _quantize(x, gran, r, c, **kw):
    return {
        "token": lambda: Q.quantize_per_token(x, **kw),
        "block": lambda: Q.quantize_per_block(x, r, **kw),
        "channel": lambda: Q.quantize_per_channel(x, **kw),
        "rows_in_tiles": lambda: Q.quantize_rows_in_tiles(x, c, **kw),
        "cols_in_tiles": lambda: Q.quantize_cols_in_tiles(x, r, **kw),
        "tiles": lambda: Q.quantize_tiles(x, r, c, **kw),
    }[gran]()


def _tile_shape(gran, r, c):
    """Rows x columns one scale covers (None: all)."""
    return {"token": (1, None), "block": (r, None), "channel": (None, 1), "rows_in_tiles": (1, c),
            "cols_in_tiles": (r, 1), "tiles": (r, c)}[gran]


@cases(200)
@given(x=matrices, gran=st.sampled_from(GRANULARITIES), r=st.integers(1, 4), c=st.integers(1, 4),
       unsigned=st.booleans(), fp32=st.booleans())
def test_int8_codes_in_range_and_error_within_half_a_step(x, gran, r, c, unsigned, fp32):
    """Codes on [-127, 127] (unsigned: [0, 255] of |x|); |x - code * s| <= s / 2 in exact arithmetic, here
    s * (1/2 + 2^-40): the float64 quotient x / s and product code * s each round by at most 2^-53 relative of
    values <= 255 s. The element of largest magnitude in each block gets the top code. Both wherever the scale is
    zero or a normal float64 (a subnormal max|x| / qmax is rounded coarsely, and inputs from fp16, bf16 or fp32
    never give one); fp32: codes in range only, the input itself being rounded to float32 first."""
    if unsigned:
        x = np.abs(x)
    qmax = 255 if unsigned else 127
    kw = dict(qmax=qmax, unsigned=unsigned)
    codes, scale = (Q.quantize_tiles(x, *_tile_shape(gran, r, c), fp32=True, **kw) if fp32
                    else _quantize(x, gran, r, c, **kw))
    assert codes.dtype == np.int16 and codes.shape == x.shape
    assert codes.min() >= (0 if unsigned else -qmax) and codes.max() <= qmax
    s = np.broadcast_to(scale, x.shape)
    assert np.all(s >= 0)
    if fp32:
        return
    ok = (s == 0) | (s >= np.finfo(np.float64).tiny)
    err = np.abs(x - Q.dequantize(codes, scale))
    assert np.all((err <= s * (0.5 + 2.0**-40))[ok])
    # per block: the element of largest |x| has code +-qmax (or the block is zero)
    tr, tc = _tile_shape(gran, r, c)
    tr, tc = tr or x.shape[0], tc or x.shape[1]
    for i0 in range(0, x.shape[0], tr):
        for j0 in range(0, x.shape[1], tc):
            blk, cb = x[i0:i0 + tr, j0:j0 + tc], codes[i0:i0 + tr, j0:j0 + tc]
            at = np.unravel_index(np.argmax(np.abs(blk)), blk.shape)
            if ok[i0, j0]:
                assert abs(int(cb[at])) == (qmax if blk[at] != 0 else 0)


@cases(150)
@given(x=hnp.arrays(np.float64, st.tuples(st.integers(1, 6), st.integers(1, 8)), elements=_scalable),
       k=st.integers(-30, 30), gran=st.sampled_from(GRANULARITIES), r=st.integers(1, 4), c=st.integers(1, 4),
       fp32=st.booleans())
def test_int8_power_of_two_scale_invariance(x, k, gran, r, c, fp32):
    """quantize(2^k x) has the same codes and exactly 2^k times the scales (float64 and float32 paths)."""
    tr, tc = _tile_shape(gran, r, c)
    c0, s0 = Q.quantize_tiles(x, tr, tc, fp32=fp32)
    c1, s1 = Q.quantize_tiles(np.ldexp(x, k), tr, tc, fp32=fp32)
    np.testing.assert_array_equal(c1, c0)
    np.testing.assert_array_equal(s1, np.ldexp(s0, k))


@cases(150)
@given(x=matrices, gran=st.sampled_from(GRANULARITIES), r=st.integers(1, 4), c=st.integers(1, 4),
       data=st.data())
def test_int8_blocks_are_independent_and_zero_blocks_give_zero(x, gran, r, c, data):
    """Each tile's codes and scale are psi over that tile alone (bitwise); a tile set to all +-0 gets scale 0 and
    codes 0 without touching the others; a tile holding NaN or inf gets scale NaN and codes 0."""
    tr, tc = _tile_shape(gran, r, c)
    tr, tc = tr or x.shape[0], tc or x.shape[1]
    tiles = [(i0, j0) for i0 in range(0, x.shape[0], tr) for j0 in range(0, x.shape[1], tc)]
    zeroed = data.draw(st.sets(st.sampled_from(tiles), max_size=len(tiles)))
    poisoned = data.draw(st.sets(st.sampled_from(tiles), max_size=len(tiles)).map(lambda s: s - zeroed))
    x = x.copy()
    for i0, j0 in zeroed:
        x[i0:i0 + tr, j0:j0 + tc] = data.draw(st.sampled_from([0.0, -0.0]))
    for i0, j0 in poisoned:
        x[i0 + data.draw(st.integers(0, min(tr, x.shape[0] - i0) - 1)),
          j0 + data.draw(st.integers(0, min(tc, x.shape[1] - j0) - 1))] = data.draw(
            st.sampled_from([np.nan, np.inf, -np.inf]))
    with np.errstate(divide="raise", invalid="raise", over="raise"):
        codes, scale = _quantize(x, gran, r, c)
    s = np.broadcast_to(scale, x.shape)
    for i0, j0 in tiles:
        sl = np.s_[i0:i0 + tr, j0:j0 + tc]
        c1, s1 = Q.psi(x[sl], axes=None)
        np.testing.assert_array_equal(codes[sl], np.broadcast_to(c1, codes[sl].shape))
        np.testing.assert_array_equal(s[sl], np.broadcast_to(s1, s[sl].shape))
        if (i0, j0) in zeroed:
            assert np.all(codes[sl] == 0) and np.all(s[sl] == 0) and np.all(Q.dequantize(codes, scale)[sl] == 0)
        if (i0, j0) in poisoned:
            assert np.all(codes[sl] == 0) and np.all(np.isnan(s[sl]))


@cases(150)
@given(x=matrices, data=st.data())
def test_int8_permutation_equivariance(x, data):
    """Per token: permuting rows and columns permutes codes (and rows of the scales). Per channel: the same with
    the scales' columns. Per block of r rows: permuting rows inside each block leaves every scale in place."""
    n, d = x.shape
    rows = np.array(data.draw(st.permutations(range(n))), dtype=int)
    cols = np.array(data.draw(st.permutations(range(d))), dtype=int)
    y = x[rows][:, cols]
    ct, st_ = Q.quantize_per_token(x)
    c2, s2 = Q.quantize_per_token(y)
    np.testing.assert_array_equal(c2, ct[rows][:, cols])
    np.testing.assert_array_equal(s2, st_[rows])
    cc, sc = Q.quantize_per_channel(x)
    c2, s2 = Q.quantize_per_channel(y)
    np.testing.assert_array_equal(c2, cc[rows][:, cols])
    np.testing.assert_array_equal(s2, sc[:, cols])
    r = data.draw(st.integers(1, 4))
    inside = np.concatenate([i0 + np.array(data.draw(st.permutations(range(min(r, n - i0)))), dtype=int)
                             for i0 in range(0, n, r)])
    cb, sb = Q.quantize_per_block(x, r)
    c2, s2 = Q.quantize_per_block(x[inside][:, cols], r)
    np.testing.assert_array_equal(c2, cb[inside][:, cols])
    np.testing.assert_array_equal(s2, sb)


# ----------------------------------------------------------------------------
# NVFP4 / MXFP4 blocks (reference/fp4.py)
# ----------------------------------------------------------------------------

# For each E2M1 magnitude, half the larger gap to its neighbours (at 6: to 4): the most an input that rounds to it
# can be away from it, in units of the block scale, as long as it is not past 6 by more than 1.
_HALF_GAP = {0.0: 0.25, 0.5: 0.25, 1.0: 0.25, 1.5: 0.25, 2.0: 0.5, 3.0: 0.5, 4.0: 1.0, 6.0: 1.0}

blocks16 = hnp.arrays(np.float64, st.tuples(st.integers(1, 3), st.integers(1, 3).map(lambda b: 16 * b)),
                      elements=st.one_of(st.floats(-4000, 4000), st.floats(-0.1, 0.1)))


def _in_normal_range(x, t=1.0):
    """Per 16-block: whether its scale target max|x| / (6 t) lies in E4M3's normal range [2^-6, 448], where the
    E4M3 rounding moves it by at most 2^-4 relative (below it the subnormal grid, above it saturation at 448)."""
    target = np.abs(x).reshape(*x.shape[:-1], -1, 16).max(-1) / (6.0 * t)
    return (target >= 2.0**-6) & (target <= 448.0)


@cases(150)
@given(x=blocks16, tensor_scale=st.booleans())
def test_nvfp4_codes_scales_and_error_bound(x, tensor_scale):
    """Codes are E2M1 codes, scale codes non-negative finite E4M3; every element is within half an E2M1 gap of the
    block scale of its value, |x - s x_hat| <= s * halfgap(|x_hat|) (exact: s x_hat has few significant bits, the
    only rounding is the final subtraction, hence the 2^-50 margin) and the largest element uses the top code 6,
    in every block whose scale target is in E4M3's normal range (then max|x| / s <= 6 * (1 + 2^-4)). With
    ``tensor_scale``: s_T = fp32(max|x| / 2688), and the block holding the tensor's max gets the scale 448."""
    codes, scales, s_t = F.nvfp4_quantize(x, axis=-1, tensor_scale=tensor_scale)
    assert codes.dtype == np.uint8 and codes.shape == x.shape and codes.max() <= 15
    assert scales.shape == (x.shape[0], x.shape[1] // 16) and scales.max() <= 0x7E
    t = 1.0 if s_t is None else s_t
    deq = F.nvfp4_dequantize(codes, scales, s_t)
    s = np.repeat(F.e4m3_decode(scales) * t, 16, axis=-1)
    half = np.vectorize(_HALF_GAP.get)(np.abs(F.e2m1_decode(codes)))
    ok = _in_normal_range(x, t) if t > 0 else np.zeros(scales.shape, bool)
    err = np.abs(x - deq)
    assert np.all((err <= s * half * (1 + 2.0**-50))[np.repeat(ok, 16, axis=-1)])
    xb = np.abs(x).reshape(x.shape[0], -1, 16)
    top = np.abs(F.e2m1_decode(codes)).reshape(xb.shape)[np.arange(x.shape[0])[:, None],
                                                         np.arange(xb.shape[1])[None, :], xb.argmax(-1)]
    assert np.all(top[ok] == 6.0)
    if tensor_scale and np.abs(x).max() > 1e-30:
        amax = np.abs(x).max()
        assert s_t == float(np.float32(amax / 2688.0))
        # the fp32 rounding of s_T moves the top block's target 448 by 2^-24 relative, far inside half a step
        assert scales.reshape(-1)[np.argmax(xb.max(-1))] == 0x7E


_E2M1_TIES = sorted(set(E2M1_MAGS.tolist()) | set(((E2M1_MAGS[1:] + E2M1_MAGS[:-1]) / 2).tolist()))


@cases(120)
@given(data=st.data(), dtype=st.sampled_from(["fp16", "bf16"]), tensor_scale=st.booleans())
def test_nvfp4_element_codes_are_nearest_to_the_exact_quotient(data, dtype, tensor_scale):
    """For fp16 / bf16 inputs (what the kernels quantize) each element's code is the E2M1 value nearest to the exact
    rational x / (s s_T), ties to the even code, saturating at 6, with x's sign: the float64 quotient can't cross an
    E2M1 midpoint it is not on (fp4.py's argument). Blocks are drawn so that exact ties occur: a block holding
    6 * 2^k gets the scale 2^k, and its other elements are E2M1 values and midpoints times 2^k."""
    rows = data.draw(st.integers(1, 3))
    x = analysis.round_to_dtype(data.draw(hnp.arrays(np.float64, (rows, 32), elements=st.floats(-500, 500))),
                                dtype)
    for i in range(rows):
        for b in range(2):
            if data.draw(st.booleans()):
                k = data.draw(st.integers(-6, 6))
                vals = data.draw(st.lists(st.tuples(st.sampled_from(_E2M1_TIES), st.booleans()), min_size=16,
                                          max_size=16))
                x[i, 16 * b:16 * b + 16] = [math.ldexp(-v if neg else v, k) for v, neg in vals]
                x[i, 16 * b + data.draw(st.integers(0, 15))] = math.ldexp(6.0, k)
    codes, scales, s_t = F.nvfp4_quantize(x, tensor_scale=tensor_scale)
    t = Fraction(1) if s_t is None else Fraction(s_t)
    for i in range(rows):
        for b in range(2):
            s = Fraction(float(F.e4m3_decode(scales[i, b]))) * t
            if s == 0:
                continue
            for j in range(16 * b, 16 * b + 16):
                xi = float(x[i, j])
                _assert_nearest((Fraction(abs(xi)) / s, math.copysign(1.0, xi) < 0), codes[i, j], E2M1_MAGS, 0x8)


@cases(150)
@given(x=hnp.arrays(np.float64, st.tuples(st.integers(1, 3), st.just(32)), elements=st.floats(-1e3, 1e3)),
       k=st.integers(-12, 12))
def test_nvfp4_power_of_two_scale_invariance(x, k):
    """NVFP4(2^k x): the same element codes and each block scale exactly 2^k times, for the blocks whose scale
    target is in E4M3's normal range before and after (E4M3's grid is scale-free only there); others not compared."""
    c0, s0, _ = F.nvfp4_quantize(x)
    c1, s1, _ = F.nvfp4_quantize(np.ldexp(x, k))
    ok = _in_normal_range(x) & _in_normal_range(np.ldexp(x, k))
    assume(ok.any())
    np.testing.assert_array_equal(F.e4m3_decode(s1)[ok], np.ldexp(F.e4m3_decode(s0), k)[ok])
    okx = np.repeat(ok, 16, axis=-1)
    np.testing.assert_array_equal(c1[okx], c0[okx])


@cases(150)
@given(x=blocks16, data=st.data())
def test_nvfp4_blocks_independent_zero_underflow_and_nonfinite(x, data):
    """Blocks are independent: setting some blocks to all +-0 (scale 0, codes +0, never -0's code 8), to values with
    max|x|/6 <= 2^-10 (the scale underflows to 0, the tie at 2^-10 going to the even code 0, so codes 0), or
    poisoning one element with NaN/inf (scale 0x7F, all 16 dequantize to NaN) leaves every other block's codes and
    scale exactly those of quantizing it alone; any block with max|x|/6 > 2^-10 has a non-zero scale."""
    rows, nb = x.shape[0], x.shape[1] // 16
    blocks = [(i, b) for i in range(rows) for b in range(nb)]
    kind = {blk: data.draw(st.sampled_from(["keep", "zero", "tiny", "bad"])) for blk in blocks}
    x = x.copy()
    for (i, b), what in kind.items():
        sl = np.s_[i, 16 * b:16 * b + 16]
        if what == "zero":
            x[sl] = data.draw(st.sampled_from([0.0, -0.0]))
        elif what == "tiny":
            x[sl] = data.draw(hnp.arrays(np.float64, 16, elements=st.floats(-6 * 2.0**-10, 6 * 2.0**-10)))
        elif what == "bad":
            x[i, 16 * b + data.draw(st.integers(0, 15))] = data.draw(st.sampled_from([np.nan, np.inf, -np.inf]))
    codes, scales, _ = F.nvfp4_quantize(x)
    deq = F.nvfp4_dequantize(codes, scales)
    for (i, b), what in kind.items():
        sl = np.s_[i, 16 * b:16 * b + 16]
        c1, s1, _ = F.nvfp4_quantize(x[sl])
        np.testing.assert_array_equal(codes[sl], c1)
        assert scales[i, b] == s1[0]
        amax = np.max(np.abs(x[sl]))
        if what == "bad":
            assert scales[i, b] == F.E4M3_NAN_CODE and np.all(np.isnan(deq[sl]))
        elif amax / 6 <= 2.0**-10:
            assert scales[i, b] == 0 and np.all(codes[sl] == 0) and np.all(deq[sl] == 0)
        else:
            assert scales[i, b] != 0


@cases(150)
@given(x=blocks16, data=st.data())
def test_nvfp4_permutation_equivariance(x, data):
    """Permuting the 16 elements inside each block permutes the codes and keeps the scales; permuting whole blocks
    (and rows) permutes both; quantizing along axis 0 of the transpose is the same."""
    rows, nb = x.shape[0], x.shape[1] // 16
    inside = np.concatenate([16 * b + np.array(data.draw(st.permutations(range(16))), dtype=int)
                             for b in range(nb)])
    order = np.array(data.draw(st.permutations(range(nb))), dtype=int)
    cols = (16 * order[:, None] + np.arange(16)[None, :]).reshape(-1)[inside]
    row_order = np.array(data.draw(st.permutations(range(rows))), dtype=int)
    c0, s0, _ = F.nvfp4_quantize(x)
    c1, s1, _ = F.nvfp4_quantize(x[row_order][:, cols])
    np.testing.assert_array_equal(c1, c0[row_order][:, cols])
    np.testing.assert_array_equal(s1, s0[row_order][:, order])
    ct, stt, _ = F.nvfp4_quantize(x.T, axis=0)
    np.testing.assert_array_equal(ct, c0.T)
    np.testing.assert_array_equal(stt, s0.T)


@cases(150)
@given(x=hnp.arrays(np.float64, st.tuples(st.integers(1, 3), st.just(32)),
                    elements=st.one_of(st.floats(-1e30, 1e30), st.floats(-1e-30, 1e-30))))
def test_mxfp4_scale_is_the_e8m0_power_of_two(x):
    """The E8M0 scale is X = 2^(floor(log2 max|x|) - 2) (so max|x| / X is in [4, 8) and saturates at 6 past it)
    when that exponent fits [-127, 127]; a zero block gets code 0 and codes 0; the error is within half an E2M1
    gap of X, or the clipping of (6, 8) X."""
    codes, scales = F.mxfp4_quantize(x)
    X = F.e8m0_decode(scales)
    for i in range(x.shape[0]):
        amax = float(np.max(np.abs(x[i])))
        if amax == 0:
            assert scales[i, 0] == 0 and np.all(codes[i] == 0)
            continue
        e = math.frexp(amax)[1] - 1  # floor(log2 amax), exactly
        assert X[i, 0] == math.ldexp(1.0, min(max(e - 2, -127), 127))
        if -127 <= e - 2 <= 127:
            assert 4 <= amax / X[i, 0] < 8
            deq = F.e2m1_decode(codes[i]) * X[i, 0]
            half = np.vectorize(_HALF_GAP.get)(np.abs(F.e2m1_decode(codes[i])))
            bound = np.where(np.abs(x[i]) > 6 * X[i, 0], np.abs(x[i]) - 6 * X[i, 0], half * X[i, 0])
            assert np.all(np.abs(x[i] - deq) <= bound * (1 + 2.0**-50))
