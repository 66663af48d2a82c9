"""ml_dtypes as an independent check of the reference codecs: bfloat16 (sagecupy.analysis.bf16_bits /
round_to_dtype, the device rounding of BF16Array.from_float, the bit-level widenings), FP8 E4M3 and FP4 E2M1
(sagecupy.reference.fp4), and E8M0 scales.

Every code is decoded and compared; encoding is compared on every representable value, every midpoint between
neighbours and its float64 neighbours (ties and near-ties), random values over the whole exponent range,
subnormals, and the overflow range. Independence from how ml_dtypes converts float64: each float64 is first
rounded to float32 *to odd* (:func:`_f32_odd`), after which ml_dtypes' round-to-nearest-even float32 conversion
is the correctly rounded value of the float64 itself.

Where the project's semantics differ from ml_dtypes', the difference is tested exactly as documented:

* bf16 from float64: NaN becomes the one quiet NaN 0x7FC0 (ml_dtypes keeps the sign);
* bf16 from float32 on the device (BF16Array.from_float): a NaN keeps its sign and top payload bits with the quiet
  bit set (ml_dtypes: the canonical quiet NaN of that sign); a float64 input is rounded to float32 first;
* E4M3: saturation to +-448 for |x| >= 464 and +-inf (ml_dtypes' E4M3FN conversion gives NaN there); every NaN
  encodes as 0x7F, positive;
* E2M1: NaN encodes as +6 (code 7, PTX ``cvt.rn.satfinite``), a format ml_dtypes gives no NaN at all.
"""
import sys
import types

import numpy as np
import pytest

from sagecupy import analysis
from sagecupy.adapters import bf16
from sagecupy.reference import fp4 as F
from sagecupy.reference.attention import as_float64

md = pytest.importorskip("ml_dtypes", minversion="0.5")

BF16, E4M3, E2M1 = np.dtype(md.bfloat16), np.dtype(md.float8_e4m3fn), np.dtype(md.float4_e2m1fn)


def _f32_odd(x):
    """float64 -> float32 rounded to odd (truncate toward zero, set the last bit when inexact). float32 carries at
    least two more significand bits than bfloat16, E4M3 and E2M1 at every exponent they reach, so rounding this to
    nearest even gives the correctly rounded value of ``x`` (one rounding, whatever float64 paths ml_dtypes has)."""
    x = np.asarray(x, np.float64)
    with np.errstate(over="ignore"):
        f = x.astype(np.float32)
    away = np.abs(f.astype(np.float64)) > np.abs(x)  # the nearest float32 lies beyond x (or overflowed): step back
    f = np.where(away, np.nextafter(f, np.float32(0)), f)
    inexact = f.astype(np.float64) != x
    return (f.view(np.uint32) | inexact.astype(np.uint32)).view(np.float32)


def _ml_codes(x, dtype):
    """ml_dtypes' codes of the float64 ``x`` in ``dtype`` (one rounding, through :func:`_f32_odd`)."""
    with np.errstate(over="ignore", invalid="ignore"):
        return _f32_odd(x).astype(dtype).view(np.uint16 if dtype.itemsize == 2 else np.uint8)


def _probes(values, rng, n_random, lo_exp, hi_exp):
    """Every value of a format (``values``: its finite non-negative values, increasing), each midpoint between
    neighbours and the float64 next to it on each side, the midpoints moved by 2^-30 relative (which a float32 step
    would round onto the tie), random magnitudes 2^[lo_exp, hi_exp), all with both signs."""
    v = np.asarray(values, np.float64)
    mid = (v[1:] + v[:-1]) / 2
    near = np.concatenate([mid, np.nextafter(mid, np.inf), np.nextafter(mid, -np.inf), mid * (1 + 2.0 ** -30),
                           mid * (1 - 2.0 ** -30)])
    rand = np.exp2(rng.uniform(lo_exp, hi_exp, n_random)) * rng.uniform(1, 2, n_random)
    mag = np.concatenate([v, near, rand])
    return np.concatenate([mag, -mag])


# ----------------------------------------------------------------------------
# bfloat16
# ----------------------------------------------------------------------------

ALL16 = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)


@pytest.fixture
def host_cupy(monkeypatch):
    """NumPy standing in for CuPy: BF16Array's device code (from_float, to_float32) runs on the host."""
    fake = types.SimpleNamespace(ndarray=np.ndarray, uint16=np.uint16, uint32=np.uint32, float32=np.float32,
                                 ascontiguousarray=np.ascontiguousarray, isnan=np.isnan, where=np.where)
    monkeypatch.setitem(sys.modules, "cupy", fake)


def test_bf16_decode_every_pattern(host_cupy):
    """Every bf16 pattern widened: the exact float32 (NaN payloads included) in all of the project's widenings."""
    want = ALL16.view(BF16).astype(np.float32).view(np.uint32)
    assert np.array_equal(want, ALL16.astype(np.uint32) << 16)  # (ml_dtypes' own widening is the bit shift)
    assert np.array_equal(bf16.to_float32(ALL16.view(BF16)).view(np.uint32), want)
    assert np.array_equal(bf16.BF16Array(ALL16.copy()).to_float32().view(np.uint32), want)
    with np.errstate(invalid="ignore"):  # (signalling NaNs widened to float64)
        wide = ALL16.view(BF16).astype(np.float64)
        assert np.array_equal(analysis._to_host(ALL16.view(BF16)), wide, equal_nan=True)
        assert np.array_equal(as_float64(ALL16.view(BF16), "x"), wide, equal_nan=True)


def test_bf16_every_value_round_trips():
    with np.errstate(invalid="ignore"):
        v = ALL16.view(BF16).astype(np.float64)
    ok = ~np.isnan(v)
    assert np.array_equal(analysis.bf16_bits(v[ok]), ALL16[ok])
    assert np.array_equal(v[ok].astype(BF16).view(np.uint16), ALL16[ok])
    r = analysis.round_to_dtype(v[ok], "bf16")
    assert np.array_equal(r, v[ok]) and np.array_equal(np.signbit(r), np.signbit(v[ok]))


def test_bf16_rounding_from_float64_matches_ml_dtypes():
    """Ties to even, near-ties (where rounding through float32 first would round twice), subnormals down to half
    the smallest, the overflow boundary (half an ulp past the largest finite value rounds to inf) and beyond."""
    v = ALL16[:0x7F81].view(BF16).astype(np.float64)  # +0 .. +inf, increasing
    x = _probes(v, np.random.default_rng(0), 20000, -140, 128)
    x = np.concatenate([x, [0.0, -0.0, 1e39, -1e39, 1e300, 2.0 ** -134, 2.0 ** -150, 1e-300, -1e-300]])
    got = analysis.bf16_bits(x)
    want = _ml_codes(x, BF16)
    bad = np.flatnonzero(got != want)
    assert bad.size == 0, f"{bad.size} differ, first x={x[bad[0]]!r}: {got[bad[0]]:#06x} vs {want[bad[0]]:#06x}"
    # the overflow boundary itself: (2 - 2^-8) 2^127 is a tie whose even neighbour is inf
    top = (2.0 - 2.0 ** -8) * 2.0 ** 127
    assert analysis.bf16_bits(np.array([top, np.nextafter(top, 0)])).tolist() == [0x7F80, 0x7F7F]


def test_bf16_rounding_of_float32_values_matches_ml_dtypes_directly():
    """float32 inputs: no intermediate rounding on either side, so ml_dtypes' own conversion is compared."""
    u = np.random.default_rng(1).integers(0, 1 << 32, 200000, dtype=np.uint64).astype(np.uint32)
    f = u.view(np.float32)
    f = f[~np.isnan(f)]
    assert np.array_equal(analysis.bf16_bits(f.astype(np.float64)), f.astype(BF16).view(np.uint16))


def test_bf16_nan_from_float64_is_one_quiet_nan():
    payloads = np.array([0x7FF0000000000001, 0xFFF8000000000123, 0x7FF4000000000000], np.uint64)
    nans = np.concatenate([[np.nan, -np.nan], payloads.view(np.float64)])
    assert np.isnan(nans).all()
    assert analysis.bf16_bits(nans).tolist() == [0x7FC0] * len(nans)  # sign and payload dropped
    assert np.isnan(nans.astype(BF16).astype(np.float64)).all()  # (ml_dtypes: NaN too, its sign kept)


def _device_probe_bits():
    """float32 bit patterns: every upper half with lower halves at 0, 1, just below, at and just above the tie, the
    top, and two random ones; every NaN and infinity pattern class included."""
    hi = np.arange(1 << 16, dtype=np.uint32) << 16
    lows = np.array([0x0000, 0x0001, 0x7FFF, 0x8000, 0x8001, 0xFFFF], np.uint32)
    rnd = np.random.default_rng(2).integers(0, 1 << 16, (2, 1 << 16)).astype(np.uint32)
    return np.concatenate([(hi[:, None] | lows[None, :]).ravel(), hi | rnd[0], hi | rnd[1]])


def test_bf16_device_rounding_of_float32_matches_ml_dtypes(host_cupy):
    """BF16Array.from_float (the device path's rounding, on NumPy): round to nearest even from float32, as ml_dtypes
    converts; NaN: quiet, with the input's sign and top payload bits (ml_dtypes: the canonical quiet NaN)."""
    u = _device_probe_bits()
    f = u.view(np.float32)
    with np.errstate(over="ignore", invalid="ignore"):
        got = bf16.BF16Array.from_float(f).bits
        want = f.astype(BF16).view(np.uint16)
    nan = np.isnan(f)
    assert np.array_equal(got[~nan], want[~nan])
    assert np.array_equal(got[nan], ((u[nan] >> 16) | 0x40).astype(np.uint16))
    assert np.isnan(got[nan].view(BF16).astype(np.float32)).all()
    assert np.array_equal(got[nan] >> 15, want[nan] >> 15)  # the same sign as ml_dtypes' NaN
    assert np.array_equal(bf16.to_float32(bf16.from_float(f, like=np.zeros(1, BF16))).view(np.uint32),
                          got.astype(np.uint32) << 16)  # (from_float: the same bits, as a bfloat16 view)


def test_bf16_device_rounding_of_float64_rounds_through_float32(host_cupy):
    """from_float takes float64 as float32 first (documented: two roundings), unlike bf16_bits (one)."""
    x = _probes(ALL16[:0x7F80].view(BF16).astype(np.float64), np.random.default_rng(3), 20000, -130, 127)
    with np.errstate(over="ignore"):
        assert np.array_equal(bf16.BF16Array.from_float(x).bits, x.astype(np.float32).astype(BF16).view(np.uint16))
    tie_plus = np.array([1.0 + 2.0 ** -8 + 2.0 ** -40])  # above a tie by less than float32 can hold
    assert bf16.BF16Array.from_float(tie_plus).bits.tolist() == [0x3F80]
    assert analysis.bf16_bits(tie_plus).tolist() == [0x3F81] == _ml_codes(tie_plus, BF16).tolist()


# ----------------------------------------------------------------------------
# FP8 E4M3 (E4M3FN)
# ----------------------------------------------------------------------------

ALL8 = np.arange(256, dtype=np.uint8)


def test_e4m3_decode_every_code():
    want = ALL8.view(E4M3).astype(np.float64)
    got = F.e4m3_decode(ALL8)
    assert np.array_equal(got, want, equal_nan=True)
    ok = ~np.isnan(want)
    assert np.array_equal(np.signbit(got[ok]), np.signbit(want[ok]))  # (signed zeros; a NaN's sign is not a value)
    assert np.isnan(got).sum() == 2 and np.isnan(got[[0x7F, 0xFF]]).all()
    assert np.array_equal(F.E4M3_VALUES, want, equal_nan=True)


def test_e4m3_encoding_matches_ml_dtypes_below_the_overflow():
    """Every value, every midpoint and its neighbours, random values from below the smallest subnormal to 464
    (where ml_dtypes' conversion leaves the finite range), signed zeros."""
    v = F.E4M3_VALUES[:0x7F]  # 0 .. 448
    x = _probes(np.append(v, 480.0), np.random.default_rng(4), 20000, -12, 8.857)  # (2^8.857 < 464)
    x = x[np.abs(x) < 464]
    x = np.concatenate([x, [0.0, -0.0, 2.0 ** -11, -(2.0 ** -11), 1e-300, 464.0, -464.0]])  # (464: a tie -> 448)
    got = F.e4m3_encode(x)
    want = _ml_codes(x, E4M3)
    bad = np.flatnonzero(got != want)
    assert bad.size == 0, f"{bad.size} differ, first x={x[bad[0]]!r}: {got[bad[0]]:#04x} vs {want[bad[0]]:#04x}"
    assert np.array_equal(F.e4m3_round(x), want.view(E4M3).astype(np.float64))
    ok = ~np.isnan(F.E4M3_VALUES)
    assert np.array_equal(F.e4m3_encode(F.E4M3_VALUES[ok]), ALL8[ok])  # every code round-trips


def test_e4m3_saturates_where_ml_dtypes_overflows_to_nan():
    big = np.array([np.nextafter(464.0, np.inf), 465.0, 480.0, 1e4, 3.4e38, 1e300, np.inf])
    x = np.concatenate([big, -big])
    assert F.e4m3_encode(x).tolist() == [0x7E] * len(big) + [0xFE] * len(big)  # +-448
    with np.errstate(over="ignore"):
        assert np.isnan(_ml_codes(x, E4M3).view(E4M3).astype(np.float64)).all()


def test_e4m3_nan_encodes_as_positive_nan():
    nans = np.array([np.nan, -np.nan, np.uint64(0xFFF8000000000001).view(np.float64)])
    assert F.e4m3_encode(nans).tolist() == [0x7F] * 3
    assert (_ml_codes(nans, E4M3) & 0x7F == 0x7F).all()  # (ml_dtypes: NaN of the input's sign)


# ----------------------------------------------------------------------------
# FP4 E2M1
# ----------------------------------------------------------------------------


def test_e2m1_decode_every_code():
    codes = np.arange(16, dtype=np.uint8)
    want = codes.view(E2M1).astype(np.float64)
    got = F.e2m1_decode(codes)
    assert np.array_equal(got, want) and np.array_equal(np.signbit(got), np.signbit(want))
    assert np.array_equal(F.E2M1_VALUES, want)


def test_e2m1_encoding_matches_ml_dtypes():
    """Every value, midpoints and their neighbours, random values from far below 0.25 past the saturation at 6,
    signed zeros, infinities (both saturate: E2M1 has no infinity)."""
    x = _probes(F.E2M1_MAGNITUDES, np.random.default_rng(5), 20000, -6, 4)
    x = np.concatenate([x, [0.0, -0.0, 7.0, -7.0, 1e300, -1e300, np.inf, -np.inf, 1e-300, -1e-300]])
    got = F.e2m1_encode(x)
    want = _ml_codes(x, E2M1)
    bad = np.flatnonzero(got != want)
    assert bad.size == 0, f"{bad.size} differ, first x={x[bad[0]]!r}: {got[bad[0]]} vs {want[bad[0]]}"
    assert np.array_equal(F.e2m1_encode(F.E2M1_VALUES), np.arange(16))


def test_e2m1_nan_encodes_as_plus_six():
    nans = np.array([np.nan, -np.nan])
    assert F.e2m1_encode(nans).tolist() == [7, 7] and F.e2m1_round(nans).tolist() == [6.0, 6.0]
    with np.errstate(invalid="ignore"):
        assert np.isfinite(nans.astype(np.float32).astype(E2M1).astype(np.float64)).all()  # (no NaN in ml_dtypes' E2M1)


# ----------------------------------------------------------------------------
# E8M0 (MX scales)
# ----------------------------------------------------------------------------


def test_e8m0_decode_every_code():
    e8m0 = getattr(md, "float8_e8m0fnu", None)
    if e8m0 is None:
        pytest.skip("this ml_dtypes has no float8_e8m0fnu")
    want = ALL8.view(np.dtype(e8m0)).astype(np.float64)
    assert np.array_equal(F.e8m0_decode(ALL8), want, equal_nan=True)


def test_sagebwd_round16_matches_ml_dtypes_through_float32():
    """reference.sagebwd._round16 (P's rounding for the 16-bit dV): float64 -> float32 -> fp16 / bf16, each round to
    nearest even, as the kernels' conversions of their fp32 P. ml_dtypes rounds float32 to bf16 the same way, so on
    float32 values (every midpoint of bf16 neighbours included) the two agree bit for bit; NaN stays NaN."""
    from sagecupy.reference.sagebwd import _round16

    rng = np.random.default_rng(5)
    base = rng.random(4096).astype(np.float32)  # P's range [0, 1)
    lo = np.array(base.astype(md.bfloat16), dtype=np.float32)
    hi = np.nextafter(lo, np.float32(2)).astype(md.bfloat16).astype(np.float32)
    mid = ((lo.astype(np.float64) + hi.astype(np.float64)) / 2).astype(np.float32)  # exact in float32: ties
    x32 = np.concatenate([base, mid, np.nextafter(mid, np.float32(0)), np.nextafter(mid, np.float32(2)),
                          np.float32([0.0, 1.0, 1e-30, 3e38])])
    got = _round16(x32.astype(np.float64), "bfloat16")
    want = x32.astype(md.bfloat16).astype(np.float64)
    np.testing.assert_array_equal(got, want)
    with np.errstate(over="ignore"):  # (3e38 overflows fp16 to inf, as in _round16)
        want16 = x32.astype(np.float16).astype(np.float64)
    np.testing.assert_array_equal(_round16(x32.astype(np.float64), "float16"), want16)
    assert np.isnan(_round16(np.array([np.nan]), "bfloat16")).all()
    x = rng.random(8)
    assert _round16(x, None) is x
