"""The public GPU entry points refuse, before any launch and with the argument named, what the kernels cannot index:
lengths whose padded size times D would overflow their 32-bit offsets, grids beyond CUDA's extents, zero-size
dimensions, a non-finite or non-positive sm_scale, and a float or bool where an int (or a bool) is needed. Runs on the
stand-in cupy of test_host_paths (arrays carry only metadata, so huge shapes cost nothing)."""
import re

import numpy as np
import pytest

from test_host_paths import FakeArray, gpu  # noqa: F401  (gpu: the fixture)


@pytest.fixture(autouse=True)
def _fresh_plans(gpu):
    """Recorded programs hold the stand-in kernels of the test that recorded them: start without any."""
    from sagecupy import int8, nvfp4

    for plans in (int8._FWD_PLANS, int8._BWD_PLANS, nvfp4._ATTN_PLANS):
        plans.clear()


def _qkv(B=1, Hq=2, Hkv=1, Nq=128, Nk=128, D=128, dtype=np.float16):
    return FakeArray((B, Hq, Nq, D), dtype), FakeArray((B, Hkv, Nk, D), dtype), FakeArray((B, Hkv, Nk, D), dtype)


def _entry_points():
    """(name, call(q, k, v, **kw)) of every forward entry point that takes q, k, v; and the is_supported that must
    say the same without raising."""
    from sagecupy import int8, nvfp4, qat

    return {
        "int8.forward": int8.forward, "int8.sage_attention": int8.sage_attention, "nvfp4.attention": nvfp4.attention,
        "nvfp4.forward": nvfp4.forward, "qat.forward": qat.forward, "qat.qat_attention": qat.qat_attention,
    }, {"int8": int8.is_supported, "nvfp4": nvfp4.is_supported, "qat": qat.is_supported}


def _refused(gpu, q, k, v, exc, words, **kw):
    """Every entry point raises ``exc`` matching ``words`` without launching; every is_supported says why."""
    calls, supported = _entry_points()
    start = len(gpu)
    for name, fn in calls.items():
        with pytest.raises(exc, match=words):
            fn(q, k, v, **kw)
    for name, fn in supported.items():
        ok, why = fn(q, k, v, **kw)
        assert not ok and why, name
    assert len(gpu) == start


def test_the_length_limit_follows_the_kernels_int32_offsets(gpu):
    """The longest N: its padded length times D is at most 2^31 - 1 (offsets within a head are 32-bit ints)."""
    from sagecupy import _checks

    assert _checks.max_seq_len(128) == 16_777_088 == 2**24 - 128
    assert _checks.max_seq_len(64) == 33_554_304 == 2**25 - 128
    for d in (64, 128):
        n = _checks.max_seq_len(d)
        assert n % _checks.PAD_MAX == 0 and n * d <= _checks.INT32_MAX < (n + _checks.PAD_MAX) * d


@pytest.mark.parametrize("d", [64, 128])
def test_sequence_lengths_beyond_the_limit_are_refused(gpu, d):
    from sagecupy import _checks, int8

    n = _checks.max_seq_len(d)
    _refused(gpu, *_qkv(Nq=n + 1, D=d), ValueError, rf"Nq={n + 1} exceeds the kernels' limit of {n} at head_dim={d}")
    _refused(gpu, *_qkv(Nk=n + 1, D=d), ValueError, rf"Nk={n + 1} exceeds the kernels' limit of {n}")
    # at the limit the call goes through (the stand-in arrays hold no memory)
    start = len(gpu)
    int8.forward(*_qkv(B=1, Hq=1, Nq=n, Nk=n, D=d))
    assert len(gpu) > start


def test_grid_extents_are_refused(gpu):
    """Heads and batch are grid extents (at most 65535; the INT8 pre-pass launches Hq + 2 Hkv and 2 B), and the causal
    dispatch order indexes a CTA in a 32-bit int (batch * heads * query blocks)."""
    _refused(gpu, *_qkv(Hq=65534, Hkv=1, Nq=16, Nk=16), ValueError,
             r"Hq \+ 2 \* Hkv = 65536 exceeds the kernels' limit of 65535")
    _refused(gpu, *_qkv(B=32768, Hq=1, Nq=16, Nk=16), ValueError, r"batch=32768 exceeds the kernels' limit of 32767")
    _refused(gpu, *_qkv(B=1024, Hq=1024, Hkv=1, Nq=131072, Nk=16), ValueError,
             r"query blocks exceeds the kernels' limit of 2147483647")


@pytest.mark.parametrize("which, dim, label", [("q", 0, "B"), ("q", 1, "H"), ("q", 2, "N"), ("q", 3, "D"),
                                               ("k", 1, "H"), ("k", 2, "N"), ("v", 2, "N"), ("v", 3, "D")])
def test_zero_size_dimensions_are_refused_by_name(gpu, which, dim, label):
    q, k, v = _qkv()
    arrays = {"q": q, "k": k, "v": v}
    x = arrays[which]
    shape = list(x.shape)
    shape[dim] = 0
    arrays[which] = FakeArray(shape, x.dtype)
    _refused(gpu, arrays["q"], arrays["k"], arrays["v"], ValueError,
             rf"{which} has a zero-size dimension {label}=0 \(shape {re.escape(str(tuple(shape)))}\)")


def test_zero_size_dimensions_in_nhd_are_named_in_its_order(gpu):
    q, k, v = (FakeArray((1, n, h, 128), np.float16) for n, h in ((128, 0), (128, 1), (128, 1)))
    _refused(gpu, q, k, v, ValueError, r"q has a zero-size dimension H=0", layout="NHD")


@pytest.mark.parametrize("sm_scale, exc, words", [
    (float("nan"), ValueError, r"sm_scale=nan must be finite and > 0"),
    (float("inf"), ValueError, r"sm_scale=inf must be finite and > 0"),
    (0.0, ValueError, r"sm_scale=0.0 must be finite and > 0"),
    (-0.125, ValueError, r"sm_scale=-0.125 must be finite and > 0"),
    # finite in float64 but not a normal float32 (the kernels' type), or whose product with log2(e) overflows it
    (1e39, ValueError, r"sm_scale=1e\+39 must be finite and > 0, within"),
    (1e-46, ValueError, r"sm_scale=1e-46 must be finite and > 0, within"),
    (3e38, ValueError, r"sm_scale=3e\+38 must be finite and > 0, within"),
    (True, TypeError, r"sm_scale must be a float or None, got True"),
    ("0.125", TypeError, r"sm_scale must be a float or None, got '0.125'"),
    (1j, TypeError, r"sm_scale must be a float or None"),
])
def test_bad_sm_scale_is_refused(gpu, sm_scale, exc, words):
    from sagecupy import int8

    q, k, v = _qkv()
    int8.forward(q, k, v, sm_scale=0.125)  # (a recorded plan for 0.125: a bool or a string of it is not that call)
    _refused(gpu, q, k, v, exc, words, sm_scale=sm_scale)


def test_good_sm_scales_pass(gpu):
    from sagecupy import int8

    q, k, v = _qkv()
    for s in (None, 0.125, 2, np.float32(0.5), np.float64(1e-3), 1e-37, 1e38):
        int8.forward(q, k, v, sm_scale=s)
        assert int8.is_supported(q, k, v, sm_scale=s) == (True, "")


def test_ints_and_bools_of_configs_are_type_checked(gpu):
    """A float or bool where the kernels take an int, or a non-bool switch, is refused (the config classes of NVFP4
    and QAT do not check these types themselves)."""
    from sagecupy import nvfp4, qat
    from sagecupy.config import NVFP4Config, QATConfig

    q, k, v = _qkv()
    for cfg, words in ((QATConfig(block_kv=64.0), r"config: block_kv=64.0 must be an int"),
                       (QATConfig(block_kv=True), r"config: block_kv=True must be an int"),
                       (QATConfig(two_level_p=1), r"config: two_level_p=1 must be a bool"),
                       (QATConfig(quantize="yes"), r"config: quantize='yes' must be a bool")):
        with pytest.raises(ValueError, match=words):
            qat.forward(q, k, v, config=cfg)
        assert qat.is_supported(q, k, v, config=cfg)[0] is False
    for field in ("two_level_p", "k_smoothing", "q_smoothing", "tensor_scale", "quantize"):
        cfg = NVFP4Config(**{field: 1})
        with pytest.raises(ValueError, match=rf"config: {field}=1 must be a bool"):
            nvfp4.attention(q, k, v, config=cfg)
    for n_pad in (True, 128.0, 64, "128"):
        with pytest.raises(ValueError, match="n_pad"):
            qat.fake_quantize(q, n_pad=n_pad)
    with pytest.raises(TypeError, match="causal must be a bool"):
        nvfp4.attention(q, k, v, causal=1)


def test_another_familys_config_is_a_type_error_in_each_family(gpu):
    """Each family names config with TypeError for an object of the wrong class (an unknown preset name: ValueError)."""
    from sagecupy import int8, nvfp4, qat
    from sagecupy.config import DEFAULT, NVFP4Config, QATConfig

    q, k, v = _qkv()
    start = len(gpu)
    for fn, cfg in ((int8.forward, QATConfig()), (int8.sage_attention, NVFP4Config()), (int8.forward, {}),
                    (qat.forward, DEFAULT), (nvfp4.attention, QATConfig())):
        with pytest.raises(TypeError, match="config"):
            fn(q, k, v, config=cfg)
    with pytest.raises(ValueError, match="config='fast' is not supported"):
        int8.forward(q, k, v, config="fast")
    assert len(gpu) == start


def _packed(B=1, Hq=2, Hkv=1, nq=128, nk=128, D=128):
    n16 = (nk + 15) // 16 * 16
    shapes = {"q_packed": (B, Hq, nq, D // 2), "q_scales": (B, Hq, nq, D // 16), "k_packed": (B, Hkv, nk, D // 2),
              "k_scales": (B, Hkv, nk, D // 16), "v_packed": (B, Hkv, D, n16 // 2), "v_scales": (B, Hkv, D, n16 // 16)}
    return {n: FakeArray(s, np.uint8) for n, s in shapes.items()}


def test_attention_packed_limits(gpu):
    from sagecupy import _checks, nvfp4

    start = len(gpu)
    n = _checks.max_seq_len(128)
    cases = [
        (_packed(nq=n + 1), ValueError, rf"packed: Nq={n + 1} exceeds the kernels' limit of {n}"),
        (_packed(nk=n + 1), ValueError, rf"packed: Nk={n + 1} exceeds"),
        (_packed(nq=0), ValueError, r"packed\['q_packed'\] has a zero-size dimension Nq=0"),
        (_packed(Hkv=0), ValueError, r"packed\['k_packed'\] has a zero-size dimension Hkv=0"),
        (_packed(B=0), ValueError, r"packed\['q_packed'\] has a zero-size dimension B=0"),
        (_packed(D=0), ValueError, r"packed\['q_packed'\] has a zero-size dimension D/2=0"),
        (_packed(B=32768), ValueError, r"packed: batch=32768 exceeds"),
    ]
    for packed, exc, words in cases:
        with pytest.raises(exc, match=words):
            nvfp4.attention_packed(packed)
    for s, exc in ((0.0, ValueError), (float("nan"), ValueError), (-1.0, ValueError), (True, TypeError),
                   ("1", TypeError)):
        with pytest.raises(exc, match="sm_scale"):
            nvfp4.attention_packed(_packed(), sm_scale=s)
    with pytest.raises(TypeError, match="two_level_p"):
        nvfp4.attention_packed(_packed(), two_level_p=1)
    assert len(gpu) == start


@pytest.mark.parametrize("fn", ["quantize_rows", "quantize_tokens", "fake_quantize"])
def test_quantizers_limits(gpu, fn):
    from sagecupy import _checks, nvfp4, qat

    call = getattr(qat if fn == "fake_quantize" else nvfp4, fn)
    start = len(gpu)
    for shape, words in (((0, 2, 64, 128), r"x has a zero-size dimension B=0"),
                         ((1, 0, 64, 128), r"x has a zero-size dimension H=0"),
                         ((1, 2, 0, 128), r"x has a zero-size dimension N=0"),
                         ((1, 2, 64, 0), r"x has a zero-size dimension D=0"),
                         ((1, 2, _checks.max_seq_len(128) + 1, 128), r"x: N=16777089 exceeds the kernels' limit"),
                         ((1, 65536, 16, 128), r"x: heads: Hq \+ 2 \* Hkv = 65536 exceeds")):
        with pytest.raises(ValueError, match=words):
            call(FakeArray(shape, np.float16))
    if fn == "quantize_rows":  # (a mean with no heads: named, not a division by zero)
        with pytest.raises(ValueError, match=r"mean\.shape=\(1, 0, 128\) must be \(B, Hm, D\)"):
            call(FakeArray((1, 2, 64, 128), np.float16), mean=FakeArray((1, 0, 128), np.float32))
    with pytest.raises(ValueError, match=r"k has a zero-size dimension N=0"):
        nvfp4.quantize_inputs(*(FakeArray(s, np.float16) for s in ((1, 2, 64, 128), (1, 1, 0, 128), (1, 1, 0, 128))))
    assert len(gpu) == start
