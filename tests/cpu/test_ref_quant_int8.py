"""The float64 INT8 quantizers (reference/quant.py, docs/algorithms.md §2)."""
import warnings

import numpy as np
import pytest

from sagecupy.reference.quant import (
    dequantize,
    psi,
    quantize_cols_in_tiles,
    quantize_per_block,
    quantize_per_channel,
    quantize_per_token,
    quantize_rows_in_tiles,
    quantize_tiles,
)


# ---------------------------------------------------------------- psi itself


def test_ties_round_half_to_even():
    # max|x| = 127 -> s = 1, so x / s is x itself.
    x = np.array([127.0, 0.5, 1.5, 2.5, 3.5, -0.5, -1.5, -2.5, 126.5, -126.5])
    codes, scale = psi(x, 0)
    assert scale.shape == (1,) and scale[0] == 1.0
    np.testing.assert_array_equal(codes, [127, 0, 2, 2, 4, 0, -2, -2, 126, -126])


def test_basic_formula_and_error_bound():
    rng = np.random.default_rng(1)
    x = rng.normal(size=(6, 50)) * np.array([1e-3, 1, 7, 1e4, 0.2, 3])[:, None]
    codes, scale = psi(x, 1)
    assert codes.dtype == np.int16 and scale.dtype == np.float64 and scale.shape == (6, 1)
    np.testing.assert_array_equal(scale, np.abs(x).max(axis=1, keepdims=True) / 127)
    np.testing.assert_array_equal(codes, np.rint(x / scale))
    # the max of every block lands on +-127, and the error is at most half a step
    np.testing.assert_array_equal(np.abs(codes).max(axis=1), 127)
    assert np.all(np.abs(dequantize(codes, scale) - x) <= 0.5 * scale * (1 + 1e-12))


def test_clamp_never_exceeds_qmax():
    rng = np.random.default_rng(2)
    for qmax in (127, 255, 7):
        x = rng.normal(size=(200, 33)) * 10.0 ** rng.uniform(-30, 30, size=(200, 1))
        codes, _ = psi(x, 1, qmax=qmax)
        assert np.abs(codes).max() == qmax
    # a value that rounds above qmax after the division is clipped (x / s = 127.0000...1)
    x = np.array([1.0, -1.0, 0.1])
    codes, _ = psi(x, 0)
    np.testing.assert_array_equal(codes, [127, -127, 13])


def test_zero_block_has_zero_scale_and_codes_without_warnings():
    x = np.zeros((3, 4))
    x[1] = [0.0, -2.0, 1.0, 0.5]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no division-by-zero or invalid-value warning
        codes, scale = psi(x, 1)
    np.testing.assert_array_equal(scale[:, 0], [0.0, 2.0 / 127, 0.0])
    np.testing.assert_array_equal(codes[0], 0)
    np.testing.assert_array_equal(codes[2], 0)
    assert np.all(np.isfinite(dequantize(codes, scale)))


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_block_gets_nan_scale(bad):
    x = np.array([[1.0, 2.0, bad, 4.0], [1.0, -2.0, 3.0, 4.0]])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no division-by-zero or invalid-value warning
        codes, scale = psi(x, 1)
    assert np.isnan(scale[0, 0])
    np.testing.assert_array_equal(codes[0], 0)
    assert np.all(np.isnan(dequantize(codes, scale)[0]))  # never a silent finite value
    assert scale[1, 0] == 4.0 / 127  # the other block is unaffected
    np.testing.assert_array_equal(codes[1], np.rint(x[1] / (4.0 / 127)))


def test_unsigned_mode():
    rng = np.random.default_rng(3)
    p = rng.uniform(size=(8, 40))
    p[0, 0] = -0.0  # negative zero is allowed
    codes, scale = psi(p, 1, qmax=255, unsigned=True)
    np.testing.assert_array_equal(scale, p.max(axis=1, keepdims=True) / 255)
    assert codes.min() >= 0 and np.all(codes.max(axis=1) == 255)
    np.testing.assert_array_equal(codes, np.rint(p / scale))
    # paper mode: [0, 127]
    codes, scale = psi(p, 1, qmax=127, unsigned=True)
    assert codes.min() >= 0 and codes.max() == 127
    # ties to even on the unsigned grid too
    codes, _ = psi(np.array([255.0, 0.5, 1.5, 2.5]), 0, qmax=255, unsigned=True)
    np.testing.assert_array_equal(codes, [255, 0, 2, 2])
    with pytest.raises(ValueError, match="unsigned"):
        psi(np.array([1.0, -1e-300]), 0, unsigned=True)
    with pytest.raises(ValueError, match="unsigned"):
        psi(np.array([1.0, -np.inf]), 0, unsigned=True)
    codes, scale = psi(np.array([1.0, np.nan]), 0, unsigned=True)
    assert np.isnan(scale[0])


def test_axes_forms_and_input_untouched():
    rng = np.random.default_rng(4)
    x = rng.normal(size=(2, 3, 4)).astype(np.float16)
    before = x.copy()
    c_all, s_all = psi(x, None)
    assert s_all.shape == (1, 1, 1)
    c_t, s_t = psi(x, (0, -1))
    assert s_t.shape == (1, 3, 1)
    c_l, s_l = psi(x, [2, 0])
    np.testing.assert_array_equal(c_t, c_l)
    np.testing.assert_array_equal(s_t, s_l)
    np.testing.assert_array_equal(x, before)


def test_psi_error_paths():
    x = np.ones((2, 3))
    with pytest.raises(TypeError, match="qmax"):
        psi(x, 1, qmax=127.0)
    with pytest.raises(ValueError, match="qmax"):
        psi(x, 1, qmax=0)
    with pytest.raises(ValueError, match="qmax"):
        psi(x, 1, qmax=40000)
    with pytest.raises(ValueError, match="axes"):
        psi(x, 2)
    with pytest.raises(ValueError, match="axes"):
        psi(x, (1, -1))
    with pytest.raises(TypeError, match="axes"):
        psi(x, "rows")
    with pytest.raises(TypeError, match="unsigned"):
        psi(x, 1, unsigned=1)
    with pytest.raises(TypeError, match="x"):
        psi(np.ones(3, dtype=complex), 0)
    with pytest.raises(TypeError, match="x"):
        psi(np.ones(3, dtype=bool), 0)
    with pytest.raises(ValueError, match="empty"):
        psi(np.ones((0, 3)), 1)


# ---------------------------------------------------------------- granularities


def _manual_tiles(x, r, c, qmax=127, unsigned=False):
    """Literal loop over tiles with psi on each: the expected codes and full-shape scales."""
    N, D = x.shape[-2:]
    r = N if r is None else r
    c = D if c is None else c
    codes = np.zeros(x.shape, dtype=np.int16)
    scale = np.zeros(x.shape)
    for i0 in range(0, N, r):
        for j0 in range(0, D, c):
            blk = x[..., i0:i0 + r, j0:j0 + c]
            cb, sb = psi(blk, (-2, -1), qmax=qmax, unsigned=unsigned)
            codes[..., i0:i0 + r, j0:j0 + c] = cb
            scale[..., i0:i0 + r, j0:j0 + c] = sb
    return codes, scale


@pytest.mark.parametrize("N, D", [(37, 16), (16, 16), (1, 5), (5, 1), (64, 40)])
def test_granularity_helpers_match_tile_loop(N, D):
    rng = np.random.default_rng(N * 100 + D)
    x = rng.normal(size=(2, 3, N, D)) * rng.uniform(0.1, 10, size=(2, 3, N, D))
    x[0, 0, : min(N, 16)] = 0.0  # a zero block at the start
    cases = [
        (quantize_per_token(x), 1, None, (2, 3, N, 1)),
        (quantize_per_block(x, 16), 16, None, (2, 3, N, 1)),
        (quantize_per_channel(x), None, 1, (2, 3, 1, D)),
        (quantize_rows_in_tiles(x, 8), 1, 8, (2, 3, N, D)),
        (quantize_cols_in_tiles(x, 16), 16, 1, (2, 3, N, D)),
        (quantize_tiles(x, 16, 8), 16, 8, (2, 3, N, D)),
        (quantize_tiles(x, None, None), None, None, (2, 3, 1, 1)),
    ]
    for (codes, scale), r, c, shape in cases:
        exp_codes, exp_scale = _manual_tiles(x, r, c)
        assert codes.dtype == np.int16 and codes.shape == x.shape
        assert scale.shape == shape, (r, c)
        np.testing.assert_array_equal(codes, exp_codes, err_msg=f"tile {r}x{c}")
        np.testing.assert_array_equal(np.broadcast_to(scale, x.shape), exp_scale, err_msg=f"tile {r}x{c}")


def test_block_boundaries_partial_last_block():
    # 37 rows in blocks of 16: [0, 16), [16, 32), [32, 37). Put a distinct max in each.
    x = np.ones((37, 4))
    x[3, 0], x[20, 1], x[36, 2] = 127.0, -254.0, 63.5
    codes, scale = quantize_per_block(x, 16)
    np.testing.assert_array_equal(scale[:16, 0], 1.0)
    np.testing.assert_array_equal(scale[16:32, 0], 2.0)
    np.testing.assert_array_equal(scale[32:, 0], 0.5)
    assert codes[3, 0] == 127 and codes[20, 1] == -127 and codes[36, 2] == 127
    assert codes[0, 0] == 1 and codes[16, 0] == 0 and codes[32, 0] == 2  # 1/2 = 0.5 -> 0 (tie to even)
    # a block larger than N is one block
    codes, scale = quantize_per_block(x, 64)
    np.testing.assert_array_equal(scale, 2.0)


def test_unsigned_tiles_and_nan_tile():
    rng = np.random.default_rng(5)
    p = rng.uniform(size=(20, 24))
    p[:8, :8] = 0.0
    codes, scale = quantize_cols_in_tiles(p, 8, qmax=255, unsigned=True)
    exp_codes, exp_scale = _manual_tiles(p, 8, 1, qmax=255, unsigned=True)
    np.testing.assert_array_equal(codes, exp_codes)
    np.testing.assert_array_equal(scale, exp_scale)
    p[10, 10] = np.nan
    codes, scale = quantize_tiles(p, 8, 8)
    assert np.all(np.isnan(scale[8:16, 8:16])) and np.all(codes[8:16, 8:16] == 0)
    assert np.all(np.isfinite(scale[:8])) and np.all(np.isfinite(scale[16:]))


def test_tile_helper_error_paths():
    x = np.ones((4, 4))
    with pytest.raises(ValueError, match="2-D"):
        quantize_per_token(np.ones(4))
    with pytest.raises(ValueError, match="tile_rows"):
        quantize_per_block(x, 0)
    with pytest.raises(TypeError, match="block_rows"):
        quantize_per_block(x, None)
    with pytest.raises(TypeError, match="tile_rows"):
        quantize_tiles(x, 2.0, None)
    with pytest.raises(TypeError, match="tile_cols"):
        quantize_rows_in_tiles(x, None)
    with pytest.raises(TypeError, match="tile_rows"):
        quantize_cols_in_tiles(x, None)
    with pytest.raises(ValueError, match="empty"):
        quantize_per_token(np.ones((0, 4)))
