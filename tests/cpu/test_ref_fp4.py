"""FP4 / FP8 codecs and block quantizers (``sagecupy.reference.fp4``)."""
import numpy as np
import pytest

from sagecupy.reference import fp4 as F


def _e4m3_arith(x):
    """Independent E4M3 rounding by arithmetic: quantum 2^(e-3) with e = max(floor(log2|x|), -6), RNE, clip 448."""
    x = np.asarray(x, dtype=np.float64)
    mag = np.abs(x)
    with np.errstate(divide="ignore"):
        e = np.floor(np.log2(np.where(mag > 0, mag, 1.0)))
    q = np.exp2(np.maximum(e, -6.0) - 3.0)
    r = np.minimum(np.rint(mag / q) * q, 448.0)
    return np.copysign(r, x)


def _nearest_even(values, grid):
    """Slow reference: nearest grid point by distance, ties to the even index."""
    out = []
    for v in values:
        d = np.abs(grid - v)
        best = np.flatnonzero(d == d.min())
        out.append(grid[best[0]] if len(best) == 1 or best[0] % 2 == 0 else grid[best[1]])
    return np.array(out)


# ----------------------------------------------------------------------------
# E2M1
# ----------------------------------------------------------------------------


def test_e2m1_table_and_round_trip():
    assert F.E2M1_VALUES.tolist() == [0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6]
    assert np.signbit(F.E2M1_VALUES[8])
    codes = np.arange(16, dtype=np.uint8)
    np.testing.assert_array_equal(F.e2m1_encode(F.e2m1_decode(codes)), codes)


def test_e2m1_ties_to_even_and_saturation():
    x = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, 7.0, 1e30, np.inf]
    expect = [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, 6.0, 6.0, 6.0]
    np.testing.assert_array_equal(F.e2m1_round(x), expect)
    np.testing.assert_array_equal(F.e2m1_round(-np.array(x)), -np.array(expect))
    mags = F.E2M1_MAGNITUDES
    mids = (mags[:-1] + mags[1:]) / 2
    below, above = np.nextafter(mids, 0), np.nextafter(mids, 10)
    np.testing.assert_array_equal(F.e2m1_round(below), mags[:-1])
    np.testing.assert_array_equal(F.e2m1_round(above), mags[1:])


def test_e2m1_nan_and_signed_zero():
    # PTX cvt.rn.satfinite.e2m1x2.f32: NaN -> positive MAX_NORM (+6), whatever its sign.
    np.testing.assert_array_equal(F.e2m1_encode([np.nan, -np.nan]), [7, 7])
    np.testing.assert_array_equal(F.e2m1_encode([0.0, -0.0, -0.2, 0.2, -np.inf]), [0, 8, 8, 0, 15])


def test_e2m1_matches_slow_nearest_even():
    rng = np.random.default_rng(0)
    grid = np.concatenate([F.E2M1_MAGNITUDES, [1e300]])
    v = np.concatenate([rng.uniform(0, 7, 2000), np.arange(0, 6.5, 0.125)])
    np.testing.assert_array_equal(F.e2m1_round(v), np.minimum(_nearest_even(v, grid), 6.0))


# ----------------------------------------------------------------------------
# E4M3
# ----------------------------------------------------------------------------


def test_e4m3_table():
    v = F.E4M3_VALUES
    assert v.shape == (256,)
    assert v[0x00] == 0 and v[0x01] == 2.0**-9 and v[0x07] == 7 * 2.0**-9 and v[0x08] == 2.0**-6
    assert v[0x38] == 1.0 and v[0x7E] == 448.0 and v[0xFE] == -448.0 and v[0x80] == 0 and np.signbit(v[0x80])
    assert np.flatnonzero(np.isnan(v)).tolist() == [0x7F, 0xFF]
    assert np.all(np.diff(v[:0x7F]) > 0)
    np.testing.assert_array_equal(v[0x80:0xFF], -v[:0x7F])


def test_e4m3_exhaustive_round_trip():
    codes = np.arange(256, dtype=np.uint8)
    back = F.e4m3_encode(F.e4m3_decode(codes))
    finite = np.isfinite(F.E4M3_VALUES)
    np.testing.assert_array_equal(back[finite], codes[finite])
    assert np.all(back[~finite] == F.E4M3_NAN_CODE)  # NaN codes decode to NaN, which encodes as 0x7F


def test_e4m3_ties_to_even_between_every_adjacent_pair():
    mags = F.E4M3_VALUES[:0x7F]
    mids = (mags[:-1] + mags[1:]) / 2
    lo, hi = np.arange(0x7E), np.arange(1, 0x7F)
    even = np.where(lo % 2 == 0, lo, hi)
    for sign, bit in ((1.0, 0), (-1.0, 0x80)):
        np.testing.assert_array_equal(F.e4m3_encode(sign * mids), even | bit)
        np.testing.assert_array_equal(F.e4m3_encode(sign * np.nextafter(mids, 0)), lo | bit)
        np.testing.assert_array_equal(F.e4m3_encode(sign * np.nextafter(mids, 1e9)), hi | bit)


def test_e4m3_saturation_subnormals_nan():
    np.testing.assert_array_equal(
        F.e4m3_encode([448, 460, 464, 480, 1e30, np.inf, -np.inf, -1e9]), [0x7E] * 6 + [0xFE] * 2
    )
    # subnormals: 2^-10 is the tie between 0 and 2^-9 -> 0 (even); just above -> 2^-9
    np.testing.assert_array_equal(
        F.e4m3_round([2.0**-10, np.nextafter(2.0**-10, 1), 3 * 2.0**-10, 2.0**-12, 15 * 2.0**-10]),
        [0, 2.0**-9, 2 * 2.0**-9, 0, 8 * 2.0**-9],
    )
    np.testing.assert_array_equal(F.e4m3_encode([np.nan, -np.nan]), [0x7F, 0x7F])
    assert F.e4m3_encode(-0.0) == 0x80 and F.e4m3_encode(-1e-9) == 0x80


def test_e4m3_matches_arithmetic_rounding():
    rng = np.random.default_rng(1)
    x = np.concatenate(
        [rng.standard_normal(5000) * np.exp2(rng.uniform(-12, 10, 5000)), rng.uniform(-500, 500, 2000)]
    )
    np.testing.assert_array_equal(F.e4m3_round(x), _e4m3_arith(x))


# ----------------------------------------------------------------------------
# packing
# ----------------------------------------------------------------------------


def test_pack_unpack():
    codes = np.array([[1, 2, 3, 4, 15, 0]], dtype=np.uint8)
    packed = F.pack_e2m1(codes)
    assert packed.tolist() == [[0x21, 0x43, 0x0F]]
    np.testing.assert_array_equal(F.unpack_e2m1(packed), codes)
    rng = np.random.default_rng(2)
    c = rng.integers(0, 16, (3, 8, 5), dtype=np.uint8)
    np.testing.assert_array_equal(F.unpack_e2m1(F.pack_e2m1(c, axis=1), axis=1), c)
    assert F.pack_e2m1(c, axis=1).shape == (3, 4, 5)
    with pytest.raises(ValueError, match="even"):
        F.pack_e2m1(c)
    with pytest.raises(ValueError, match="codes"):
        F.pack_e2m1(np.array([16, 0], dtype=np.uint8))
    with pytest.raises(TypeError, match="codes"):
        F.pack_e2m1(np.array([1.0, 0.0]))


# ----------------------------------------------------------------------------
# NVFP4
# ----------------------------------------------------------------------------


def _nvfp4_loop(x):
    """Per-block loop over the last axis: the formula of docs/algorithms.md §5.3, literally."""
    out = np.empty_like(x)
    for idx in np.ndindex(x.shape[:-1]):
        for j in range(0, x.shape[-1], 16):
            blk = x[idx][j : j + 16]
            s = F.e4m3_round(np.max(np.abs(blk)) / 6)
            out[idx][j : j + 16] = 0.0 if s == 0 else s * F.e2m1_round(blk / s)
    return out


def test_nvfp4_matches_block_loop_and_axis():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((3, 5, 48)) * np.exp2(rng.integers(-8, 8, (3, 5, 1)))
    fq = F.nvfp4_fake_quantize(x)
    np.testing.assert_array_equal(fq, _nvfp4_loop(x))
    codes, scales, s_t = F.nvfp4_quantize(x)
    assert codes.shape == x.shape and codes.dtype == np.uint8 and scales.shape == (3, 5, 3) and s_t is None
    # along another axis == along the last axis of the transposed array
    np.testing.assert_array_equal(F.nvfp4_fake_quantize(x.swapaxes(1, 2), axis=1), fq.swapaxes(1, 2))
    c1, s1, _ = F.nvfp4_quantize(x.swapaxes(1, 2), axis=1)
    assert s1.shape == (3, 3, 5)
    np.testing.assert_array_equal(c1, codes.swapaxes(1, 2))
    # error bound for normal E4M3 scales: |x - fq| <= s (half the widest E2M1 gap; saturation
    # above 6 s costs < 0.4 s since s rounds max/6 by < 1/16). Subnormal scales round coarser.
    s = np.repeat(F.e4m3_decode(scales), 16, axis=-1)
    normal = s >= 2.0**-6
    assert normal.mean() > 0.5
    assert np.all(np.abs(fq - x)[normal] <= s[normal])


def test_nvfp4_hand_example():
    x = np.zeros(16)
    x[:4] = [6.0, -3.0, 0.7, 0.2]
    codes, scales, _ = F.nvfp4_quantize(x)
    assert scales.tolist() == [F.e4m3_encode(1.0)]
    assert codes[:4].tolist() == [7, 13, 1, 0]
    x2 = x * 0.5  # max 3 -> s = 0.5, same codes
    c2, s2, _ = F.nvfp4_quantize(x2)
    assert F.e4m3_decode(s2).tolist() == [0.5] and c2[:4].tolist() == [7, 13, 1, 0]


def test_nvfp4_zero_and_underflow_blocks():
    x = np.zeros((2, 32))
    x[0, :16] = -0.0
    x[1, :16] = 1e-5  # max/6 < 2^-10: the scale underflows to 0
    x[1, 16] = 6.0  # max 6 -> scale 1, exact
    codes, scales, _ = F.nvfp4_quantize(x)
    assert scales[0].tolist() == [0, 0] and scales[1, 0] == 0 and scales[1, 1] != 0
    assert np.all(codes[0] == 0) and np.all(codes[1, :16] == 0)
    fq = F.nvfp4_dequantize(codes, scales)
    assert np.all(fq[:, :16] == 0) and fq[1, 16] == 6.0


def test_nvfp4_nan_inf_blocks_are_nan_not_finite():
    x = np.random.default_rng(4).standard_normal((3, 32))
    x[0, 3] = np.nan
    x[1, 20] = np.inf
    x[2, 0] = -np.inf
    codes, scales, _ = F.nvfp4_quantize(x)
    assert scales[0, 0] == F.E4M3_NAN_CODE and scales[1, 1] == F.E4M3_NAN_CODE and scales[2, 0] == 0x7F
    assert scales[0, 1] != 0x7F and scales[1, 0] != 0x7F and scales[2, 1] != 0x7F
    fq = F.nvfp4_dequantize(codes, scales)
    assert np.all(np.isnan(fq[0, :16])) and np.all(np.isnan(fq[1, 16:])) and np.all(np.isnan(fq[2, :16]))
    assert np.all(np.isfinite(fq[0, 16:])) and np.all(np.isfinite(fq[1, :16])) and np.all(np.isfinite(fq[2, 16:]))
    # with a tensor scale one bad value poisons every block
    codes_t, scales_t, s_t = F.nvfp4_quantize(x, tensor_scale=True)
    assert np.isnan(s_t) and np.all(scales_t == 0x7F)
    assert np.all(np.isnan(F.nvfp4_dequantize(codes_t, scales_t, s_t)))


def test_nvfp4_tensor_scale():
    rng = np.random.default_rng(5)
    x = rng.standard_normal((4, 64)) * 1e-4  # without a tensor scale many block scales are subnormal / zero
    codes, scales, s_t = F.nvfp4_quantize(x, tensor_scale=True)
    amax = np.max(np.abs(x))
    assert s_t == float(np.float32(amax / 2688)) and float(np.float32(s_t)) == s_t
    blk = np.argmax(np.max(np.abs(x.reshape(4, 4, 16)), -1).ravel())
    assert scales.ravel()[blk] == 0x7E  # the block holding the tensor max gets scale 448
    fq_t = F.nvfp4_dequantize(codes, scales, s_t)
    np.testing.assert_array_equal(fq_t, F.nvfp4_fake_quantize(x, tensor_scale=True))
    err_t = np.linalg.norm(fq_t - x) / np.linalg.norm(x)
    err = np.linalg.norm(F.nvfp4_fake_quantize(x) - x) / np.linalg.norm(x)
    assert err_t < 0.12 < err
    # zero tensor: s_T = 0, everything zero
    c0, sc0, st0 = F.nvfp4_quantize(np.zeros((2, 16)), tensor_scale=True)
    assert st0 == 0.0 and not c0.any() and not sc0.any()


def test_nvfp4_inputs_and_errors():
    x = np.random.default_rng(6).standard_normal((2, 32)).astype(np.float16)
    keep = x.copy()
    F.nvfp4_fake_quantize(x, tensor_scale=True)
    F.mxfp4_fake_quantize(x)
    F.two_level_p_fake_quantize(np.abs(x), 16)
    np.testing.assert_array_equal(x, keep)
    with pytest.raises(ValueError, match="multiple of 16"):
        F.nvfp4_quantize(np.zeros((2, 20)))
    with pytest.raises(ValueError, match="axis"):
        F.nvfp4_quantize(np.zeros((2, 16)), axis=2)
    with pytest.raises(TypeError, match="axis"):
        F.nvfp4_quantize(np.zeros((2, 16)), axis=1.0)
    with pytest.raises(TypeError, match="tensor_scale"):
        F.nvfp4_quantize(np.zeros((2, 16)), tensor_scale=1)
    with pytest.raises(TypeError, match="x"):
        F.nvfp4_quantize(np.zeros((2, 16), dtype=complex))
    with pytest.raises(ValueError, match="scales"):
        F.nvfp4_dequantize(np.zeros((2, 32), dtype=np.uint8), np.zeros((2, 3), dtype=np.uint8))


# --- float64 vs fp32 computation of the block scale (see the module docstring) ---


def _positive_fp16():
    return np.arange(1, 0x7C00, dtype=np.uint16).view(np.float16)


def _positive_bf16_as_f32():
    bits = np.arange(1, 0x7F80, dtype=np.uint32) << 16
    return bits.view(np.float32)


@pytest.mark.parametrize("kind", ["fp16", "bf16"])
def test_block_scale_fp32_equals_float64_exhaustive(kind):
    m32 = _positive_fp16().astype(np.float32) if kind == "fp16" else _positive_bf16_as_f32()
    exact = F.e4m3_encode(m32.astype(np.float64) / 6)
    div = F.e4m3_encode(m32 / np.float32(6))
    mul = F.e4m3_encode(m32 * (np.float32(1) / np.float32(6)))
    np.testing.assert_array_equal(div, exact)
    np.testing.assert_array_equal(mul, exact)


def test_block_scale_fp32_division_safe_even_for_fp32_inputs():
    mags = F.E4M3_VALUES[:0x7F]
    mids = ((mags[:-1] + mags[1:]) / 2).astype(np.float32)
    m = np.float32(6) * mids  # exact: at most 7 significant bits
    assert np.all(m.astype(np.float64) == 6 * mids.astype(np.float64))
    cands = [m]
    for direction in (np.float32(np.inf), np.float32(0)):
        x = m
        for _ in range(4):
            x = np.nextafter(x, direction)
            cands.append(x)
    c = np.concatenate(cands)
    np.testing.assert_array_equal(F.e4m3_encode(c / np.float32(6)), F.e4m3_encode(c.astype(np.float64) / 6))


def test_element_codes_fp32_division_exact_but_reciprocal_is_not():
    x = _positive_fp16()[::3].astype(np.float64)[:, None]
    s = F.E4M3_VALUES[1:0x7F][None, :]
    exact = F.e2m1_encode(x / s)
    x32, s32 = x.astype(np.float32), s.astype(np.float32)
    np.testing.assert_array_equal(F.e2m1_encode(x32 / s32), exact)
    rcp = F.e2m1_encode(x32 * (np.float32(1) / s32))
    bad = rcp != exact
    assert bad.any()  # x * (1/s) does differ ...
    q = (x / s)[bad]
    assert np.all(np.isin(q, [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]))  # ... and only at exact ties


# ----------------------------------------------------------------------------
# MXFP4
# ----------------------------------------------------------------------------


def test_mxfp4():
    rng = np.random.default_rng(7)
    x = rng.standard_normal((3, 64)) * np.exp2(rng.integers(-20, 20, (3, 1)))
    codes, scales = F.mxfp4_quantize(x)
    assert codes.shape == x.shape and scales.shape == (3, 2)
    amax = np.max(np.abs(x.reshape(3, 2, 32)), -1)
    np.testing.assert_array_equal(scales.astype(int) - 127, np.floor(np.log2(amax)).astype(int) - 2)
    xs = np.repeat(np.exp2(scales.astype(float) - 127), 32, -1)
    np.testing.assert_array_equal(F.mxfp4_fake_quantize(x), xs * F.e2m1_round(x / xs))
    one = np.zeros(32)
    one[:3] = [7.0, 6.0, -1.0]  # floor(log2 7) = 2 -> X = 1; 7 saturates to 6
    c, s = F.mxfp4_quantize(one)
    assert s.tolist() == [127] and c[:3].tolist() == [7, 7, 10]
    c0, s0 = F.mxfp4_quantize(np.full(32, -0.0))
    assert s0.tolist() == [0] and not c0.any()
    bad = np.ones(64)
    bad[40] = np.nan
    cb, sb = F.mxfp4_quantize(bad)
    assert sb.tolist() == [127 - 2, F.E8M0_NAN_CODE]
    deq = F.mxfp4_dequantize(cb, sb)
    assert np.all(np.isnan(deq[32:])) and np.all(deq[:32] == 1.0)
    with pytest.raises(ValueError, match="multiple of 32"):
        F.mxfp4_quantize(np.zeros(48))


# ----------------------------------------------------------------------------
# two-level P
# ----------------------------------------------------------------------------


def _two_level_loop(p, block_kv):
    out = np.zeros_like(p)
    for r in range(p.shape[0]):
        for t0 in range(0, p.shape[1], block_kv):
            tile = p[r, t0 : t0 + block_kv]
            s1 = tile.max() / 2688
            if s1 == 0:
                continue
            padded = np.zeros(-(-len(tile) // 16) * 16)
            padded[: len(tile)] = tile / s1
            out[r, t0 : t0 + block_kv] = _nvfp4_loop(padded[None])[0, : len(tile)] * s1
    return out


def test_two_level_p():
    rng = np.random.default_rng(8)
    s = rng.standard_normal((6, 83)) * 3
    s[2, :40] = -np.inf  # a row whose first tile is masked
    s[4] = -np.inf  # a fully masked row
    p = np.exp(s - np.max(np.where(np.isfinite(s), s, -1e300), -1, keepdims=True))
    q = F.two_level_p_fake_quantize(p, 32)
    np.testing.assert_allclose(q, _two_level_loop(p, 32), rtol=1e-15, atol=0)
    assert np.all(q[4] == 0) and np.all(q[2, :32] == 0)
    # each tile's max survives (scale 448, code 6)
    for t0 in range(0, 83, 32):
        tile = p[:, t0 : t0 + 32]
        rows = tile.max(-1) > 0
        np.testing.assert_allclose(q[:, t0 : t0 + 32].max(-1)[rows], tile.max(-1)[rows], rtol=1e-15)
    # invariant to the row normalization (up to float64 rounding)
    np.testing.assert_allclose(F.two_level_p_fake_quantize(p * 0.37, 32), q * 0.37, rtol=1e-13)
    # along another axis
    np.testing.assert_array_equal(F.two_level_p_fake_quantize(p.T.copy(), 32, axis=0), q.T)
    # better than plain NVFP4 on small probabilities
    small = p[:, :80] * 1e-3
    e2 = np.linalg.norm(F.two_level_p_fake_quantize(small, 32) - small)
    e1 = np.linalg.norm(F.nvfp4_fake_quantize(small) - small)
    assert e2 < 0.5 * e1
    with pytest.raises(ValueError, match="block_kv"):
        F.two_level_p_fake_quantize(p, 24)
    with pytest.raises(ValueError, match="non-negative"):
        F.two_level_p_fake_quantize(-p, 32)


def _kernel_e2m1_round(a):
    """numpy emulation (float32 arithmetic, round to nearest even) of kernels_cu/common/fp4.cuh's
    e2m1_round_nonneg: a + M - M with M = 2^(22 + max(e, 0)) from a's exponent field, then min(., 6)."""
    a = np.asarray(a, dtype=np.float32)
    bits = a.view(np.uint32)
    m = (bits & np.uint32(0x7F800000)).astype(np.int64) + (22 << 23)
    m = np.where(m > 0x7FFFFFFF, m - 2 ** 32, m)  # the kernel's int32 wraps for an Inf/NaN exponent field
    m = np.maximum(m, 0x4A800000).astype(np.uint32).view(np.float32)
    with np.errstate(invalid="ignore", over="ignore"):
        return np.fmin((a + m) - m, np.float32(6.0))


def test_kernel_e2m1_rounding_matches_the_reference():
    """The P quantizer's E2M1 rounding in the attention kernels (one magic add per binade) is the reference's
    nearest-even E2M1 rounding for every non-negative fp32 input it sees: every value of a dense sample of
    [0, 64) (every 97th fp32 bit pattern), every grid point and midpoint with its fp32 neighbours, large values
    and Inf/NaN (which give 6, as the kernel documents)."""
    from sagecupy.reference import fp4

    hi = int(np.float32(64.0).view(np.uint32))
    sample = np.arange(0, hi, 97, dtype=np.uint32).view(np.float32)
    grid = fp4.E2M1_MAGNITUDES
    pts = np.concatenate([grid, (grid[1:] + grid[:-1]) / 2]).astype(np.float32)
    near = np.concatenate([np.nextafter(pts, np.float32(0)), pts, np.nextafter(pts, np.float32(np.inf))])
    big = np.array([6.5, 7.0, 7.5, 8.0, 100.0, 1e30, 3.4e38], dtype=np.float32)
    x = np.concatenate([sample, near, big])
    np.testing.assert_array_equal(_kernel_e2m1_round(x).astype(np.float64), fp4.e2m1_round(x.astype(np.float64)))
    special = _kernel_e2m1_round(np.array([np.inf, np.nan], dtype=np.float32))
    assert special.tolist() == [6.0, 6.0]


def _o_frame_emulation(r, a, gap=60.0):
    """The QAT wgmma forward's O accumulation for one row (kernels_cu/qat_attn_fwd_sm90.cu), in fp32: tile t has
    row max r[t] (base-2 logits; -inf: the row sees no key in it) and product a[t] = P^_t V~ (a vector). O_f is kept
    in the frame of the last tile taken; returns O = O_f 2^(r_f - m) / 2688 and how many tiles were skipped."""
    f32 = np.float32
    m, r_f = -np.inf, -np.inf
    o_f = np.zeros(a.shape[1], dtype=f32)
    skipped = 0
    for t in range(len(r)):
        m = max(m, r[t])
        take = r[t] != -np.inf and not r[t] < m - gap
        c = (f32(0.0) if r_f == -np.inf else np.exp2(f32(r_f - r[t]))) if take else f32(1.0)
        o_f = o_f * c + (a[t].astype(f32) if take else f32(0.0))
        skipped += int(r[t] != -np.inf and not take)
        if take:
            r_f = r[t]
    fin = f32(0.0) if r_f == -np.inf else np.exp2(f32(r_f - m - np.log2(2688.0)))
    return o_f * fin, skipped


def test_qat_forward_o_frame_rule():
    """The frame rule equals the two-level sum O = sum_t 2^(r_t - m) / 2688 * (P^_t V~) (what the mma.sync kernel
    accumulates as O = alpha O + beta acc) to fp32 rounding when no tile is skipped; a skipped tile (max more
    than 60 below the running max) changes O by less than its weight 2^-60; O_f stays finite for the largest
    products a tile can give (64 keys x 2688 x 65504) with tile maxima that fall by up to the gap and climb
    back (the comment's overflow bound); rows that see no key give exact zeros."""
    rng = np.random.default_rng(0)
    big = 64 * 2688.0 * 65504.0
    for trial in range(200):
        n = int(rng.integers(1, 40))
        r = rng.uniform(-50, 5, n) + rng.normal(0, 2)  # tile maxima within 55 of each other: nothing skipped
        r[rng.random(n) < 0.1] = -np.inf
        a = rng.normal(0, 1, (n, 8)) * 2688 * 64
        want, size = np.zeros(8), 0.0
        m = np.max(r)
        if m != -np.inf:
            for t in range(n):
                if r[t] != -np.inf:
                    want += np.exp2(r[t] - m) / 2688 * a[t]
                    size += np.exp2(r[t] - m) / 2688 * np.abs(a[t]).max()
        got, skipped = _o_frame_emulation(r, a)
        assert skipped == 0
        # fp32 rounding, relative to partial sums bounded by the terms' total size (not to a sum that may cancel):
        # per tile a multiply and an add (2^-24 each) and an exp2 whose fp32 argument (up to the spread of the
        # tile maxima, + log2 2688 at the end) is itself rounded: 2^-24 (1 + ln 2 |argument|)
        fin = r[np.isfinite(r)]
        spread = (fin.max() - fin.min() if fin.size else 0.0) + 12
        tol = n * 2.0 ** -24 * (4 + np.log(2) * spread) * size
        assert np.all(np.isfinite(got)) and np.abs(got - want).max() <= tol, trial
    # a tile far below the running max is skipped; its weight bounds the change
    r = np.array([0.0, -61.0, -1.0])
    a = np.ones((3, 4)) * big
    got, skipped = _o_frame_emulation(r, a)
    want = (np.exp2(0.0) + np.exp2(-1.0)) / 2688 * big
    assert skipped == 1 and np.allclose(got, want, rtol=1e-6)
    # adversarial for overflow: each tile's max is just within the gap below the running max, then a new max
    r = np.array([0.0] + [-59.9, 0.0] * 50 + [-59.9] * 100)
    got, _ = _o_frame_emulation(r, np.full((len(r), 2), big))
    assert np.all(np.isfinite(got))
    # no key seen anywhere: exact zeros (no inf * 0)
    got, _ = _o_frame_emulation(np.array([-np.inf, -np.inf]), np.ones((2, 3)))
    assert np.array_equal(got, np.zeros(3, dtype=np.float32))
