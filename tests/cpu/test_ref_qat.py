"""FP4 QAT simulator (``sagecupy.reference.qat``): gradients vs finite differences."""
import numpy as np
import pytest

from sagecupy.config import NVFP4Config, QATConfig
from sagecupy.reference import attention as A
from sagecupy.reference import fp4 as F
from sagecupy.reference import metrics as M
from sagecupy.reference import nvfp4 as N
from sagecupy.reference import qat as Q
from fd import fd_grad


def _inputs(seed, B, Hq, Hkv, Nq, Nk, D, layout="HND", scale=1.5):
    rng = np.random.default_rng(seed)
    q = scale * rng.standard_normal((B, Hq, Nq, D))
    k = scale * rng.standard_normal((B, Hkv, Nk, D))
    v = rng.standard_normal((B, Hkv, Nk, D))
    do = rng.standard_normal((B, Hq, Nq, D))
    if layout == "NHD":
        q, k, v, do = (np.ascontiguousarray(x.swapaxes(1, 2)) for x in (q, k, v, do))
    return q, k, v, do




# (B, Hq, Hkv, Nq, Nk, D, causal, layout)
SHAPES = [
    (1, 2, 2, 5, 5, 16, True, "HND"),
    (1, 2, 1, 3, 7, 16, True, "HND"),  # Nq < Nk, MQA
    (1, 4, 2, 6, 3, 16, True, "NHD"),  # Nq > Nk: fully masked rows, GQA
    (2, 2, 2, 4, 19, 16, False, "HND"),  # Nk not a multiple of 16
]
CONFIGS = {"two_level": QATConfig(block_kv=16), "single_level": QATConfig(two_level_p=False)}


def _sid(p):
    return "B{}-Hq{}-Hkv{}-Nq{}-Nk{}-D{}-{}-{}".format(*p[:6], "causal" if p[6] else "full", p[7])


@pytest.mark.parametrize("cfg_name", list(CONFIGS))
@pytest.mark.parametrize("shape", SHAPES, ids=_sid)
def test_gradients_match_finite_differences(shape, cfg_name):
    B, Hq, Hkv, Nq, Nk, D, causal, layout = shape
    q, k, v, do = _inputs(1, B, Hq, Hkv, Nq, Nk, D, layout)
    cfg = CONFIGS[cfg_name]
    sm = 0.3
    with np.errstate(all="raise"):
        o, res = Q.forward(q, k, v, causal=causal, sm_scale=sm, layout=layout, config=cfg)
        dq, dk, dv = Q.backward(res, do)
    q_t, k_t, v_t = (A.from_hnd(res[name], layout) for name in ("q_t", "k_t", "v_t"))

    def loss_prime(qq, kk):  # <dO, O'> with O' = P(Q~, K~) V~, as a function of Q~ and K~
        o_prime, _ = A.attention_forward(qq, kk, v_t, causal=causal, sm_scale=sm, layout=layout)
        return float(np.sum(o_prime * do))

    for name, got, ref in (
        ("dq", dq, fd_grad(lambda x: loss_prime(x, k_t), q_t)),
        ("dk", dk, fd_grad(lambda x: loss_prime(q_t, x), k_t)),
    ):
        err = M.rel_l2(got, ref)
        assert err < 1e-6, (name, shape, cfg_name, err, M.worst_element(got, ref))
    # dV = fq_P(P)^T dO, summed over the GQA group
    it = A.attention_intermediates(q_t, k_t, v_t, do, causal=causal, sm_scale=sm, layout=layout)
    p_q = Q.fake_quantize_p(it["P"], cfg)
    dv_ref = A.sum_kv_groups(p_q.swapaxes(-1, -2) @ A.to_hnd(do, layout), Hkv)
    np.testing.assert_allclose(A.to_hnd(dv, layout), dv_ref, rtol=1e-12, atol=1e-14)
    # and O = fq_P(P) V~, O' = P V~
    np.testing.assert_allclose(A.to_hnd(o, layout), p_q @ A.expand_kv_heads(res["v_t"], Hq), rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(res["o_prime"], it["O"], rtol=1e-12, atol=1e-14)


def test_delta_from_o_is_wrong():
    B, Hq, Hkv, Nq, Nk, D = 1, 2, 1, 6, 8, 16
    q, k, v, do = _inputs(2, B, Hq, Hkv, Nq, Nk, D)
    sm = 0.3
    _, res = Q.forward(q, k, v, causal=True, sm_scale=sm)
    assert M.rel_l2(res["o"], res["o_prime"]) > 1e-2  # P is quantized coarsely enough to matter

    def loss_prime(qq):
        o_prime, _ = A.attention_forward(qq, res["k_t"], res["v_t"], causal=True, sm_scale=sm)
        return float(np.sum(o_prime * do))

    ref = fd_grad(loss_prime, res["q_t"])
    good, _, _ = Q.backward(res, do)
    bad, _, dv_bad = Q.backward(res, do, delta_from="o")
    err_good, err_bad = M.rel_l2(good, ref), M.rel_l2(bad, ref)
    assert err_good < 1e-6
    assert err_bad > 1e-3, err_bad
    np.testing.assert_array_equal(dv_bad, Q.backward(res, do)[2])  # dV does not involve delta


@pytest.mark.parametrize("shape", SHAPES, ids=_sid)
def test_unquantized_equals_exact(shape):
    B, Hq, Hkv, Nq, Nk, D, causal, layout = shape
    q, k, v, do = _inputs(3, B, Hq, Hkv, Nq, Nk, D, layout)
    for cfg in (QATConfig(quantize=False), QATConfig(quantize=False, two_level_p=False)):
        with np.errstate(all="raise"):
            o, res = Q.forward(q, k, v, causal=causal, layout=layout, config=cfg)
            grads = Q.backward(res, do)
        o_ref, lse_ref = A.attention_forward(q, k, v, causal=causal, layout=layout)
        grads_ref = A.attention_backward(q, k, v, o_ref, lse_ref, do, causal=causal, layout=layout)
        np.testing.assert_allclose(o, o_ref, rtol=0, atol=1e-12)
        np.testing.assert_array_equal(np.isneginf(res["lse"]), np.isneginf(lse_ref))
        fin = np.isfinite(lse_ref)
        np.testing.assert_allclose(res["lse"][fin], lse_ref[fin], rtol=1e-12)
        for g, g_ref in zip(grads, grads_ref):
            np.testing.assert_allclose(g, g_ref, rtol=0, atol=1e-12)


def test_two_level_equals_fused_online_quantization():
    """The NVFP4 forward quantizes exp(S - m_t) tile by tile; with two-level P that is fq_P of the normalized P."""
    q, k, v, _ = _inputs(4, 1, 2, 2, 40, 90, 32)
    cfg = QATConfig(block_kv=32)
    o_qat, _ = Q.forward(q, k, v, causal=True, config=cfg)
    nv = NVFP4Config(block_kv=32, k_smoothing=False, q_smoothing=False, two_level_p=True)
    o_nv, _ = N.forward(q, k, v, causal=True, config=nv)
    np.testing.assert_allclose(o_nv, o_qat, rtol=1e-12, atol=1e-13)
    # single-level P is not normalization invariant: the fused quantization differs from fq(P)
    o_qat1, _ = Q.forward(q, k, v, causal=True, config=QATConfig(block_kv=32, two_level_p=False))
    o_nv1, _ = N.forward(q, k, v, causal=True, config=nv.replace(two_level_p=False))
    assert M.rel_l2(o_nv1, o_qat1) > 1e-4


def test_residuals_and_masked_rows():
    B, Hq, Hkv, Nq, Nk, D = 1, 2, 1, 7, 4, 32
    q, k, v, do = _inputs(5, B, Hq, Hkv, Nq, Nk, D, layout="NHD")
    copies = [x.copy() for x in (q, k, v, do)]
    with np.errstate(all="raise"):
        o, res, it = Q.forward(q, k, v, causal=True, layout="NHD", return_intermediates=True)
        dq, dk, dv = Q.backward(res, do)
    for x, c in zip((q, k, v, do), copies):
        np.testing.assert_array_equal(x, c)
    assert res["q_t"].shape == (B, Hq, Nq, D) and res["k_t"].shape == (B, Hkv, Nk, D)
    assert res["lse"].shape == (B, Hq, Nq) and res["o_prime"].shape == (B, Hq, Nq, D)
    assert res["layout"] == "NHD" and res["Hq"] == Hq and res["Hkv"] == Hkv and res["causal"] is True
    assert res["sm_scale"] == 1 / np.sqrt(D)
    np.testing.assert_array_equal(res["q_t"], F.nvfp4_fake_quantize(A.to_hnd(q, "NHD")))
    vt = F.nvfp4_fake_quantize(F.pad_to_multiple(A.to_hnd(v, "NHD"), 16, axis=2), axis=2)[:, :, :Nk]
    np.testing.assert_array_equal(res["v_t"], vt)
    assert set(it) == {"S", "P", "P_q"}
    masked = slice(0, Nq - Nk)  # rows 0..2 see no key
    assert np.all(o[:, masked] == 0) and np.all(res["lse"][:, :, masked] == -np.inf)
    assert np.all(dq[:, masked] == 0)
    for x in (o, dq, dk, dv):
        assert not np.isnan(x).any()


@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
def test_nonfinite_q_row(value):
    """A non-finite q (a NaN block of Q~) makes its row's logits NaN: LSE NaN (as the kernels store it, not -inf),
    and P, fq_P(P) NaN in every 64-key tile where the row sees a key, so dV of those keys is NaN, as the kernels'
    NaN-propagating tile maxima give (tests/gpu/test_nonfinite.py); a tile the row does not see, other rows' outputs
    and dV of the other kv head stay finite."""
    B, Hq, Hkv, Nq, Nk, D = 1, 2, 2, 40, 160, 16  # causal, bottom-right: row i sees keys 0 .. i + 120
    q, k, v, do = _inputs(9, B, Hq, Hkv, Nq, Nk, D)
    q[0, 1, 3, 5] = value  # row 3 of head 1 sees keys 0 .. 123: tiles 0 (keys 0-63) and 1 (64-127), not 2 (128-159)
    o, res = Q.forward(q, k, v, causal=True, config=QATConfig())
    dq, dk, dv = Q.backward(res, do)
    assert np.isnan(o[0, 1, 3]).all() and np.isnan(res["lse"][0, 1, 3])
    assert np.isnan(dv[0, 1, :128]).all(), "dV of the keys in the tiles the row sees"
    assert np.isfinite(dv[0, 1, 128:]).all(), "dV of a tile the row does not see"
    assert np.isnan(dq[0, 1, 3]).all() and np.isnan(dk[0, 1, :124]).all()
    rest = np.ones((Hq, Nq), bool)
    rest[1, 3] = False
    assert np.isfinite(o[0][rest]).all() and np.isfinite(res["lse"][0][rest]).all() and np.isfinite(dq[0][rest]).all()
    assert np.isfinite(dv[0, 0]).all() and np.isfinite(dk[0, 0]).all()


def test_errors():
    q, k, v, do = _inputs(6, 1, 2, 1, 4, 4, 16)
    _, res = Q.forward(q, k, v)
    with pytest.raises(ValueError, match="multiple of 16"):
        Q.forward(q[..., :8], k[..., :8], v[..., :8])
    with pytest.raises(TypeError, match="QATConfig"):
        Q.forward(q, k, v, config=NVFP4Config())
    with pytest.raises(TypeError, match="causal"):
        Q.forward(q, k, v, causal=None)
    with pytest.raises(ValueError, match="block_kv"):
        Q.forward(q, k, v, config=QATConfig(block_kv=20))
    with pytest.raises(ValueError, match="delta_from"):
        Q.backward(res, do, delta_from="O")
    with pytest.raises(ValueError, match="residuals"):
        Q.backward({"q_t": res["q_t"]}, do)
    with pytest.raises(ValueError, match="do"):
        Q.backward(res, do[:, :, :2])
