"""128-query backward groups (``SageBwdConfig.bwd_block_q=128``) on the INT8 host paths without a GPU (the stand-in
cupy of test_host_paths): what the backward launches (dO's group scales, the images quantized with them, the
two-warpgroup dK/dV kernel with its shared memory), and the refusals where the kernels do not implement it."""
import numpy as np
import pytest

from test_host_paths import FakeArray, _inputs, gpu  # noqa: F401  (gpu: the fixture)
from test_int8_varlen_host import _packed

from sagecupy.config import DEFAULT

Q128 = DEFAULT.replace(name="q128", bwd_block_q=128)


@pytest.fixture(autouse=True)
def _fresh_plans():
    from sagecupy import int8

    for plans in (int8._FWD_PLANS, int8._BWD_PLANS):
        plans.clear()


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("do_granularity,mode", [("channel", 1), ("block", 2)])
def test_backward_launches(gpu, d, do_granularity, mode):
    from sagecupy import int8

    cfg = Q128.replace(do_granularity=do_granularity)
    q, k, v = _inputs(nq=300, nk=70, d=d)  # B = 2, Hq = 4, Hkv = 2; nq_pad = 384, nk_pad = 128
    do = FakeArray(q.shape, q.dtype)
    o, res = int8.forward(q, k, v, causal=True, config=cfg, engine="wgmma")
    start = len(gpu)
    int8.backward(res, do, engine="wgmma")
    names = [x[0] for x in gpu[start:]]
    T = "__half"
    assert names == [f"bwd_qk_images<{T}, {d}>", f"bwd_do_scales128<{T}, {d}, {mode}>", f"bwd_do_image_g128<{T}, {d}>",
                     f"int8_attn_bwd_q128_sm90<{T}, {d}>", f"int8_attn_bwd_dq_sm90<{T}, {d}>"]
    scales, image, dkdv = gpu[start + 1], gpu[start + 2], gpu[start + 3]
    assert scales[1:3] == ((3, 4, 2), (d,))  # one CTA per 128-query group, a thread per channel
    written = scales[3][-1]  # (a scratch buffer of the call's arena: its address)
    assert image[1:3] == ((6, 4, 2), (2 * d,)) and image[3][6] == written  # the images read the group scales
    assert dkdv[1:3] == ((2, 2, 2), (256,)) and dkdv[4] == int8._bwd90_q128_smem(d)
    assert int8._bwd90_q128_smem(128) <= 227 * 1024  # (an H100's opt-in limit)


def test_the_64_query_default_is_unchanged(gpu):
    from sagecupy import int8

    q, k, v = _inputs()
    o, res = int8.forward(q, k, v, engine="wgmma")
    start = len(gpu)
    int8.backward(res, FakeArray(q.shape, q.dtype), engine="wgmma")
    names = [x[0].split("<")[0] for x in gpu[start:]]
    assert names == ["bwd_qk_images", "bwd_do_image", "int8_attn_bwd_sm90", "int8_attn_bwd_dq_sm90"]


def test_mma_engine_is_refused_naming_it(gpu):
    from sagecupy import int8

    q, k, v = _inputs()
    o, res = int8.forward(q, k, v, config=Q128, engine="mma")  # (the forward does not depend on bwd_block_q)
    with pytest.raises(ValueError, match="bwd_block_q=128.*engine='wgmma'"):
        int8.backward(res, FakeArray(q.shape, q.dtype), engine="mma")


def test_pre_hopper_devices_are_refused(gpu, monkeypatch):
    from sagecupy import _layout, int8

    for mod in (int8, _layout):
        monkeypatch.setattr(mod, "device_capability", lambda: (8, 0))
    q, k, v = _inputs()
    ok, why = int8.is_supported(q, k, v, config=Q128)
    assert not ok and "bwd_block_q=128" in why and "9.0" in why
    with pytest.raises(ValueError, match="bwd_block_q=128"):
        int8.forward(q, k, v, config=Q128)
    assert int8.is_supported(q, k, v) == (True, "")
    assert gpu == []


@pytest.mark.parametrize("change,words", [
    (dict(p_bwd_granularity="block"), "p_bwd_granularity"),
    (dict(ds_granularity="block"), "ds_granularity"),
    (dict(bwd_block_q=256), "tile sizes"),
])
def test_unimplemented_combinations_are_refused(gpu, change, words):
    from sagecupy import int8

    q, k, v = _inputs()
    cfg = Q128.replace(**change)
    ok, why = int8.is_supported(q, k, v, config=cfg)
    assert not ok and words in why
    with pytest.raises(ValueError, match=words):
        int8.forward(q, k, v, config=cfg)


def test_packed_sequences_are_refused(gpu):
    from sagecupy import int8

    q, k, v, kw = _packed()
    ok, why = int8.is_supported(q, k, v, config=Q128, **kw)
    assert not ok and "layout='THD'" in why
    with pytest.raises(ValueError, match="layout='THD'"):
        int8.forward(q, k, v, config=Q128, **kw)
    assert gpu == []
