"""NVFP4 quantization pre-passes vs the reference: every code and every scale byte identical."""
import numpy as np
import pytest

from sagecupy.reference import fp4 as F
from sagecupy.reference.attention import to_hnd
from sagecupy.reference import nvfp4 as RN
from sagecupy.config import NVFP4Config

pytestmark = pytest.mark.gpu


def _dev(x, dtype):
    import cupy as cp

    from sagecupy.adapters.bf16 import BF16Array

    x32 = cp.asarray(np.asarray(x, dtype=np.float32))
    return x32.astype(cp.float16) if dtype == "float16" else BF16Array.from_float(x32)


def _host(x):
    return (x.to_float32() if hasattr(x, "to_float32") else x.astype("float32")).get().astype(np.float64)


def _adversarial(rng, shape):
    """Random values plus, block by block, the cases that break quantizers: E2M1 ties (x/s on a midpoint),
    saturation, tiny blocks whose E4M3 scale is subnormal or underflows, all-zero blocks, NaN, Inf."""
    x = rng.standard_normal(shape) * np.exp(rng.uniform(-6, 6, size=shape[:-1] + (1,)))
    flat = x.reshape(-1, 16)
    mids = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0])
    for i in range(0, flat.shape[0], 7):          # exact ties at scale 1 (max 6 -> scale e4m3(1) = 1)
        flat[i, :8] = mids * rng.choice([-1, 1], 8)
        flat[i, 8:] = 0.0
    flat[3::11] *= 1e-5                            # subnormal / underflowing scales
    flat[5::13] = 0.0                              # zero blocks
    return x


def _ties_at_every_scale(rng, shape):
    """_adversarial plus blocks whose scale is s = f 2^e for every E4M3 mantissa f (1/s inexact unless f = 1):
    one element 6 s (so the scale is exactly s), the others E2M1 midpoints times s (exact ties)."""
    x = _adversarial(rng, shape)
    flat = x.reshape(-1, 16)
    mids = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    for i in range(1, flat.shape[0], 5):
        s = (1 + rng.integers(0, 8) / 8) * 2.0 ** rng.integers(-8, 6)
        flat[i] = np.concatenate([[6.0], rng.choice(mids, 15)]) * s * rng.choice([-1, 1], 16)
    return x


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("layout", ["HND", "NHD"])
def test_rows_bit_exact(dtype, layout):
    from sagecupy import nvfp4

    rng = np.random.default_rng(0)
    shape = (2, 3, 37, 64) if layout == "HND" else (2, 37, 3, 64)
    x = _ties_at_every_scale(rng, shape) if layout == "HND" else _adversarial(rng, shape)
    x.reshape(-1)[[5, 77]] = np.nan, -np.inf  # NaN-scale blocks: every code 7
    xd = _dev(x, dtype)
    xh = _host(xd)  # the exact values the kernel sees
    codes, scales = nvfp4.quantize_rows(xd, layout=layout)
    ref_c, ref_s, _ = F.nvfp4_quantize(to_hnd(xh, layout), axis=-1)
    np.testing.assert_array_equal(scales.get(), ref_s)
    np.testing.assert_array_equal(codes.get(), F.pack_e2m1(ref_c, axis=-1))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_tokens_bit_exact_with_padding(dtype):
    from sagecupy import nvfp4

    rng = np.random.default_rng(1)
    # adversarial along the tokens (the quantization axis of V), then N = 45: the last block is zero-padded
    x = np.ascontiguousarray(_ties_at_every_scale(rng, (1, 2, 128, 48)).swapaxes(-1, -2)[:, :, :45])
    x[0, 0, 3, 5], x[0, 1, 40, 7] = np.nan, -np.inf
    xd = _dev(x, dtype)
    xh = _host(xd)
    codes, scales = nvfp4.quantize_tokens(xd)
    vt = F.pad_to_multiple(np.swapaxes(xh, -1, -2), 16, axis=-1)
    ref_c, ref_s, _ = F.nvfp4_quantize(vt, axis=-1)
    np.testing.assert_array_equal(scales.get(), ref_s)
    np.testing.assert_array_equal(codes.get(), F.pack_e2m1(ref_c, axis=-1))


@pytest.mark.parametrize("N,D,layout,offset", [(200, 64, "HND", 0), (77, 128, "NHD", 0), (130, 64, "HND", 1),
                                                (64, 256, "HND", 0)])
def test_tokens_bit_exact_tiled_and_fallback(N, D, layout, offset):
    """V's quantizer on more shapes: whole and partial 64-token tiles, D = 64 (half the tile's channels idle),
    D = 256 (two channel chunks), NHD strides (the tiled kernel), and rows that start 2 bytes off a 16-byte
    boundary (offset = 1: the one-thread-per-block kernel)."""
    from sagecupy import nvfp4

    rng = np.random.default_rng(N + D)
    x = np.ascontiguousarray(_adversarial(rng, (2, 3, D, N + 3)).swapaxes(-1, -2)[:, :, :N])  # (B, H, N, D)
    x[1, 2, N - 1, 5] = np.nan
    xs = x if layout == "HND" else np.ascontiguousarray(x.swapaxes(1, 2))
    dtype = "float16" if offset else "bfloat16"  # (a CuPy float16 array can be sliced off its allocation's start)
    xd = _dev(xs, dtype)
    if offset:  # the same values one element into a larger buffer: rows 2 bytes past a 16-byte boundary
        flat = _dev(np.concatenate([np.zeros(offset), xs.reshape(-1)]), dtype)
        xd = flat[offset:].reshape(xs.shape)
    xh = to_hnd(_host(xd), layout)
    codes, scales = nvfp4.quantize_tokens(xd, layout=layout)
    vt = F.pad_to_multiple(np.swapaxes(xh, -1, -2), 16, axis=-1)
    ref_c, ref_s, _ = F.nvfp4_quantize(vt, axis=-1)
    np.testing.assert_array_equal(scales.get(), ref_s)
    np.testing.assert_array_equal(codes.get(), F.pack_e2m1(ref_c, axis=-1))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_rows_with_mean_bit_exact_on_the_fp32_difference(dtype):
    """K's quantizer after the mean's subtraction (general fp32 values, nvfp4_block_cmp): bit-exact with the
    reference on the same fp32 values x - mean. Channels 0..31 (mean 0) keep _ties_at_every_scale's exact E2M1 ties;
    in rows 0 and 1 (x = 0) channels 32..63 are x - mean = -mean = one fp32 ulp beside a midpoint times the block's
    scale (s = 6 s / 6, set by channels 32 and 48) at random E4M3 mantissas: each comparison's strict or non-strict
    side (ties to the even code) is decided by one ulp."""
    import cupy as cp

    from sagecupy import nvfp4

    rng = np.random.default_rng(7)
    shape = (2, 4, 45, 64)
    x = _ties_at_every_scale(rng, shape)
    x.reshape(-1)[[9, 300]] = np.nan, np.inf
    x[:, :, :2, 32:] = 0.0
    xd = _dev(x, dtype)
    xh = _host(xd)
    mean = (rng.standard_normal((2, 2, 64)) * 0.1).astype(np.float32)
    mean[:, :, :32] = 0.0  # the first two blocks of every row keep their exact ties
    mids = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], dtype=np.float32)
    for blk in (32, 48):
        for b in range(2):
            for hm in range(2):
                s = np.float32((1 + rng.integers(0, 8) / 8) * 2.0 ** rng.integers(-6, 6))
                t = mids[rng.integers(0, 7, 15)] * s  # exact in fp32
                t = np.nextafter(t, np.where(rng.random(15) < 0.5, np.inf, -np.inf).astype(np.float32))
                sign = np.where(rng.random(16) < 0.5, -1, 1).astype(np.float32)
                mean[b, hm, blk:blk + 16] = -sign * np.concatenate([[np.float32(6) * s], t]).astype(np.float32)
    codes, scales = nvfp4.quantize_rows(xd, mean=cp.asarray(mean))
    diff = (xh.astype(np.float32) - np.repeat(mean, 2, axis=1)[:, :, None, :]).astype(np.float64)  # (GQA group 2)
    ref_c, ref_s, _ = F.nvfp4_quantize(diff, axis=-1)
    np.testing.assert_array_equal(scales.get(), ref_s)
    np.testing.assert_array_equal(codes.get(), F.pack_e2m1(ref_c, axis=-1))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("along", ["channels", "tokens"])
def test_fake_quantize_bit_exact(dtype, along):
    """qat.fake_quantize (the QAT forward's fq(Q), fq(K), fq(V)^T: multiplication by 1/s with a 16-bit snap
    instead of division, kernels_cu/common/fp4.cuh nvfp4_fq8) equals the reference's quantize-then-dequantize
    bit for bit, ties at scales with inexact reciprocals and NaN/Inf blocks included; padding is zero. Both
    outputs (fp16, and the bf16 bits the QAT forward keeps for the backward), and for rows both kernels (16-byte
    half blocks; one thread per block for rows that are not 16-byte aligned)."""
    import cupy as cp

    from sagecupy import qat

    rng = np.random.default_rng(3)
    if along == "channels":
        x = _ties_at_every_scale(rng, (2, 3, 45, 64))
    else:  # blocks along the tokens: build them along the last axis, then swap
        x = np.ascontiguousarray(_ties_at_every_scale(rng, (2, 3, 64, 48)).swapaxes(-1, -2)[:, :, :45])
    x.reshape(-1)[7] = np.nan
    x.reshape(-1)[300] = -np.inf
    xd = _dev(x, dtype)
    xh = _host(xd)
    fp16, bf16 = qat._fake_quantize(xd, "HND", along, 64, True)
    outs = {"fp16": fp16.astype(cp.float32).get().astype(np.float64),
            "bf16": (bf16.get().astype(np.uint32) << 16).view(np.float32).astype(np.float64),
            "public": qat.fake_quantize(xd, along=along, n_pad=64).astype(cp.float32).get().astype(np.float64)}
    if along == "channels" and dtype == "float16":  # rows not 16-byte aligned: the one-thread-per-block kernel
        wide = cp.zeros((2, 3, 45, 68), dtype=cp.float16)
        wide[..., :64] = xd
        outs["strided"] = qat.fake_quantize(wide[..., :64], n_pad=64).astype(cp.float32).get().astype(np.float64)
    if along == "channels":
        want = np.zeros((2, 3, 64, 64))
        want[:, :, :45] = F.nvfp4_fake_quantize(xh, axis=-1)
    else:
        want = np.zeros((2, 3, 64, 64))
        want[..., :48] = F.nvfp4_fake_quantize(F.pad_to_multiple(np.swapaxes(xh, -1, -2), 16, axis=-1), axis=-1)
    for name, got in outs.items():
        same = (got == want) | (np.isnan(got) & np.isnan(want))
        assert same.all(), f"{name}: {(~same).sum()} values differ, first at {np.argwhere(~same)[:3].tolist()}"
        z = same & (got == 0)
        assert np.array_equal(np.signbit(got[z]), np.signbit(want[z])), f"{name}: signs of zeros"


def test_nan_and_inf_blocks_get_nan_scales():
    from sagecupy import nvfp4

    x = np.random.default_rng(2).standard_normal((1, 1, 2, 32))
    x[0, 0, 0, 3] = np.nan
    x[0, 0, 1, 20] = np.inf
    codes, scales = nvfp4.quantize_rows(_dev(x, "float16"))
    s = scales.get()[0, 0]
    assert s[0, 0] == 0x7F and s[1, 1] == 0x7F and s[0, 1] != 0x7F and s[1, 0] != 0x7F


def test_quantize_inputs_matches_reference_without_smoothing():
    from sagecupy import nvfp4

    rng = np.random.default_rng(3)
    q, k, v = (rng.standard_normal((1, 2, 50, 64)) * 3 for _ in range(3))
    qd, kd, vd = (_dev(t, "float16") for t in (q, k, v))
    got = nvfp4.quantize_inputs(qd, kd, vd, k_smoothing=False)
    ref = RN.quantize_inputs(*(_host(t) for t in (qd, kd, vd)), config=NVFP4Config(k_smoothing=False))
    for key in ("q_packed", "q_scales", "k_packed", "k_scales", "v_packed", "v_scales"):
        np.testing.assert_array_equal(got[key].get(), ref[key], err_msg=key)


def test_quantize_inputs_with_smoothing_nearly_identical():
    """With K-smoothing the GPU subtracts the (float32-rounded) mean in float32 and the reference in
    float64: codes may differ only where K - mean lands on a rounding tie, so at most 0.1% of them."""
    from sagecupy import nvfp4

    rng = np.random.default_rng(4)
    q, k, v = (rng.standard_normal((1, 2, 200, 64)) + 2.0 for _ in range(3))
    qd, kd, vd = (_dev(t, "float16") for t in (q, k, v))
    got = nvfp4.quantize_inputs(qd, kd, vd)
    ref = RN.quantize_inputs(*(_host(t) for t in (qd, kd, vd)), config=NVFP4Config())
    np.testing.assert_allclose(got["mu_k"].get(), ref["mu_k"][:, :, 0, :], rtol=1e-6)
    diff = np.mean(got["k_packed"].get() != ref["k_packed"])
    assert diff <= 1e-3, f"{diff:.2e} of the packed K bytes differ"
    np.testing.assert_array_equal(got["v_packed"].get(), ref["v_packed"])


def test_errors():
    import cupy as cp

    from sagecupy import nvfp4

    with pytest.raises(ValueError, match="multiple of 16"):
        nvfp4.quantize_rows(cp.zeros((1, 1, 4, 24), cp.float16))
    with pytest.raises(TypeError, match="dtype"):
        nvfp4.quantize_rows(cp.zeros((1, 1, 4, 32), cp.float32))
    with pytest.raises(ValueError, match="mean.shape"):
        nvfp4.quantize_rows(cp.zeros((1, 2, 4, 32), cp.float16), mean=cp.zeros((1, 3, 32), cp.float32))
