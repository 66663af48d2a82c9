"""NVFP4 attention forward simulator (``sagecupy.reference.nvfp4``)."""
import numpy as np
import pytest

from sagecupy.config import NVFP4Config
from sagecupy.reference import attention as A
from sagecupy.reference import fp4 as F
from sagecupy.reference import metrics as M
from sagecupy.reference import nvfp4 as N


def _inputs(seed, B, Hq, Hkv, Nq, Nk, D, layout="HND", q_shift=0.0, k_shift=0.0):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, Hq, Nq, D)) + q_shift
    k = rng.standard_normal((B, Hkv, Nk, D)) + k_shift
    v = rng.standard_normal((B, Hkv, Nk, D))
    if layout == "NHD":
        q, k, v = (np.ascontiguousarray(x.swapaxes(1, 2)) for x in (q, k, v))
    return q, k, v


def _assert_lse_close(lse, ref, rtol):
    assert not np.isnan(lse).any()
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(ref))
    fin = np.isfinite(ref)
    np.testing.assert_allclose(lse[fin], ref[fin], rtol=rtol, atol=rtol)


def _loop_forward(q, k, v, causal, sm, cfg):
    """Literal tile-by-tile online softmax (HND inputs), quantizing with fp4 directly."""
    B, Hq, Nq, D = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    sm_parts = N.smooth(q, k, sm, cfg)
    qs, ks = sm_parts["qs"], sm_parts["ks"]
    fq = F.nvfp4_fake_quantize if cfg.quantize else (lambda x, axis=-1, tensor_scale=False: x)
    ts = cfg.tensor_scale
    qh = fq(qs, axis=-1, tensor_scale=ts)
    kh = A.expand_kv_heads(fq(ks, axis=-1, tensor_scale=ts), Hq)
    vpad = F.pad_to_multiple(v, 16, axis=2)
    vh = A.expand_kv_heads(fq(vpad, axis=2, tensor_scale=ts)[:, :, :Nk], Hq)
    s = sm * qh @ kh.swapaxes(-1, -2)
    if sm_parts["bias"] is not None:
        s = s + sm_parts["bias"][:, :, np.arange(Nq) // cfg.block_q]
    s = np.where(A.visible_mask(Nq, Nk, causal), s, -np.inf)
    m = np.full((B, Hq, Nq), -np.inf)
    l = np.zeros((B, Hq, Nq))
    o = np.zeros((B, Hq, Nq, D))
    for t0 in range(0, Nk, cfg.block_kv):
        st = s[..., t0 : t0 + cfg.block_kv]
        r = st.max(-1)
        m_new = np.maximum(m, r)
        ok = np.isfinite(m_new)
        mn = np.where(ok, m_new, 0.0)
        pt = np.where(ok[..., None], np.exp(st - mn[..., None]), 0.0)
        alpha = np.where(np.isfinite(m), np.exp(np.where(np.isfinite(m), m, 0.0) - mn), 0.0)
        l = alpha * l + pt.sum(-1)
        if not cfg.quantize:
            pq = pt
        elif cfg.two_level_p:
            s1 = np.where(np.isfinite(r), np.exp(np.where(np.isfinite(r), r, 0.0) - mn), 0.0) / 2688
            safe = np.where(s1 > 0, s1, 1.0)[..., None]
            p2 = F.pad_to_multiple(pt / safe, 16, axis=-1)
            pq = F.nvfp4_fake_quantize(p2)[..., : st.shape[-1]] * np.where(s1 > 0, s1, 0.0)[..., None]
        else:
            pq = F.nvfp4_fake_quantize(F.pad_to_multiple(pt, 16, axis=-1))[..., : st.shape[-1]]
        o = alpha[..., None] * o + pq @ vh[:, :, t0 : t0 + cfg.block_kv]
        m = m_new
    seen = np.isfinite(m)
    o = np.where(seen[..., None], o / np.where(seen, l, 1.0)[..., None], 0.0)
    lse = np.where(seen, np.where(seen, m, 0.0) + np.log(np.where(seen, l, 1.0)), -np.inf)
    lse = lse + sm * np.sum(q * A.expand_kv_heads(sm_parts["mu_k"], Hq), -1)
    return o, lse


# (B, Hq, Hkv, Nq, Nk, D, causal, layout)
SHAPES = [
    (1, 2, 2, 40, 40, 32, True, "HND"),
    (1, 4, 2, 19, 53, 16, True, "HND"),  # Nq < Nk, GQA, partial tiles
    (2, 2, 1, 45, 21, 32, True, "NHD"),  # Nq > Nk: 24 fully masked rows, MQA
    (1, 3, 3, 33, 70, 32, False, "HND"),
]

CONFIGS = {
    "default": NVFP4Config(block_q=16, block_kv=32),
    "single_level_p": NVFP4Config(block_q=16, block_kv=16, two_level_p=False),
    "q_smoothing": NVFP4Config(block_q=16, block_kv=32, q_smoothing=True),
    "no_smoothing": NVFP4Config(block_kv=64, k_smoothing=False),
    "tensor_scale": NVFP4Config(block_q=32, block_kv=16, tensor_scale=True, q_smoothing=True),
}


def _sid(p):
    return "B{}-Hq{}-Hkv{}-Nq{}-Nk{}-D{}-{}-{}".format(*p[:6], "causal" if p[6] else "full", p[7])


@pytest.mark.parametrize("cfg_name", list(CONFIGS))
@pytest.mark.parametrize("shape", SHAPES, ids=_sid)
def test_unquantized_equals_exact_attention(shape, cfg_name):
    B, Hq, Hkv, Nq, Nk, D, causal, layout = shape
    q, k, v = _inputs(1, B, Hq, Hkv, Nq, Nk, D, layout, q_shift=0.7, k_shift=-1.3)
    cfg = CONFIGS[cfg_name].replace(quantize=False)
    with np.errstate(all="raise"):
        o, lse = N.forward(q, k, v, causal=causal, layout=layout, config=cfg)
    o_ref, lse_ref = A.attention_forward(q, k, v, causal=causal, layout=layout)
    np.testing.assert_allclose(o, o_ref, rtol=0, atol=1e-12)
    _assert_lse_close(lse, lse_ref, 1e-12)


@pytest.mark.parametrize("cfg_name", list(CONFIGS))
@pytest.mark.parametrize("shape", SHAPES, ids=_sid)
def test_vectorized_matches_literal_tile_loop(shape, cfg_name):
    B, Hq, Hkv, Nq, Nk, D, causal, layout = shape
    q, k, v = _inputs(2, B, Hq, Hkv, Nq, Nk, D, layout, q_shift=0.3, k_shift=0.5)
    cfg = CONFIGS[cfg_name]
    sm = 0.21
    with np.errstate(all="raise"):
        o, lse = N.forward(q, k, v, causal=causal, sm_scale=sm, layout=layout, config=cfg)
    qh, kh, vh = (A.to_hnd(x, layout) for x in (q, k, v))
    o_ref, lse_ref = _loop_forward(qh, kh, vh, causal, sm, cfg)
    np.testing.assert_allclose(A.to_hnd(o, layout), o_ref, rtol=1e-12, atol=1e-13)
    _assert_lse_close(lse, lse_ref, 1e-12)
    # and it is a reasonable approximation of exact attention
    o_ex, _ = A.attention_forward(q, k, v, causal=causal, sm_scale=sm, layout=layout)
    assert M.cos(o, o_ex) > 0.97, (M.cos(o, o_ex), shape, cfg_name)


def test_fully_masked_rows_with_quantization():
    q, k, v = _inputs(3, 1, 2, 1, 20, 4, 16)
    with np.errstate(all="raise"):
        o, lse, it = N.forward(q, k, v, causal=True, config=NVFP4Config(q_smoothing=True), return_intermediates=True)
    assert np.all(o[:, :, :16] == 0) and np.all(lse[:, :, :16] == -np.inf)
    assert np.all(np.isfinite(lse[:, :, 16:])) and not np.isnan(o).any()
    assert not np.isnan(it["P_hat"]).any() and np.all(it["P_hat"][:, :, :16] == 0)


def test_intermediates_consistent():
    B, Hq, Hkv, Nq, Nk, D = 1, 4, 2, 24, 50, 32
    q, k, v = _inputs(4, B, Hq, Hkv, Nq, Nk, D, k_shift=2.0)
    sm = 0.3
    cfg = NVFP4Config(block_q=16, block_kv=16, q_smoothing=True)
    o, lse, it = N.forward(q, k, v, causal=True, sm_scale=sm, config=cfg, return_intermediates=True)
    vh = A.expand_kv_heads(it["v_hat"], Hq)
    np.testing.assert_allclose(it["O"], it["P_hat"] @ vh / it["l"][..., None], rtol=1e-13)
    np.testing.assert_array_equal(it["O"], o)
    assert it["m_tiles"].shape == (B, Hq, Nq, 4)
    assert np.all(np.diff(it["m_tiles"], axis=-1) >= 0)
    # LSE = logsumexp of the scores used + sm_scale q . mu_K
    s = it["S"]
    mx = s.max(-1, keepdims=True)
    lse_s = mx[..., 0] + np.log(np.sum(np.exp(s - mx), -1))
    np.testing.assert_allclose(lse, lse_s + sm * np.sum(q * A.expand_kv_heads(it["mu_k"], Hq), -1), rtol=1e-13)
    # the GPU's K-smoothing: the float64 mean rounded to float32, K - mean in float32
    np.testing.assert_array_equal(it["mu_k"], k.mean(axis=2, keepdims=True).astype(np.float32))
    ks = (k.astype(np.float32) - it["mu_k"].astype(np.float32)).astype(np.float64)
    np.testing.assert_allclose(it["mu_q"][:, :, 1], q[:, :, 16:24].mean(axis=2), rtol=1e-14)
    np.testing.assert_allclose(
        it["bias"][:, :, 0],
        sm * np.einsum("bhd,bhkd->bhk", it["mu_q"][:, :, 0], A.expand_kv_heads(ks, Hq)),
        rtol=1e-12,
    )
    np.testing.assert_array_equal(it["q_hat"], F.nvfp4_fake_quantize(q - np.repeat(it["mu_q"], 16, axis=2)[:, :, :Nq]))


def test_quantize_inputs_exchange_format():
    B, Hq, Hkv, Nq, Nk, D = 2, 4, 2, 20, 37, 32
    q, k, v = _inputs(5, B, Hq, Hkv, Nq, Nk, D, layout="NHD", k_shift=1.0)
    cfg = NVFP4Config(block_q=16, q_smoothing=True, tensor_scale=True)
    ex = N.quantize_inputs(q, k, v, sm_scale=0.2, layout="NHD", config=cfg)
    assert ex["q_packed"].shape == (B, Hq, Nq, D // 2) and ex["q_scales"].shape == (B, Hq, Nq, D // 16)
    assert ex["k_packed"].shape == (B, Hkv, Nk, D // 2) and ex["k_scales"].shape == (B, Hkv, Nk, D // 16)
    assert ex["v_packed"].shape == (B, Hkv, D, 48 // 2) and ex["v_scales"].shape == (B, Hkv, D, 3)
    assert ex["mu_q"].shape == (B, Hq, 2, D) and ex["bias"].shape == (B, Hq, 2, Nk) and ex["mu_k"].shape == (B, Hkv, 1, D)
    for key in ("q_packed", "q_scales", "k_packed", "v_packed", "v_scales"):
        assert ex[key].dtype == np.uint8
    _, _, it = N.forward(q, k, v, sm_scale=0.2, layout="NHD", config=cfg, return_intermediates=True)
    deq = {
        name: F.nvfp4_dequantize(F.unpack_e2m1(ex[f"{name}_packed"]), ex[f"{name}_scales"], ex[f"{name}_tensor_scale"])
        for name in ("q", "k", "v")
    }
    np.testing.assert_array_equal(deq["q"], it["q_hat"])
    np.testing.assert_array_equal(deq["k"], it["k_hat"])
    np.testing.assert_array_equal(deq["v"][..., :Nk].swapaxes(-1, -2), it["v_hat"])
    assert np.all(deq["v"][..., Nk:] == 0)
    np.testing.assert_array_equal(ex["bias"], it["bias"])
    # the codes themselves are the fp4 quantizer's (V transposed, zero-padded to 48 tokens)
    vt = F.pad_to_multiple(A.to_hnd(v, "NHD").swapaxes(-1, -2), 16)
    codes, scales, st = F.nvfp4_quantize(vt, tensor_scale=True)
    np.testing.assert_array_equal(ex["v_packed"], F.pack_e2m1(codes))
    np.testing.assert_array_equal(ex["v_scales"], scales)
    assert ex["v_tensor_scale"] == st


def test_smoothing_and_two_level_help():
    B, Hq, Hkv, Nq, Nk, D = 1, 2, 2, 64, 128, 64
    q, k, v = _inputs(6, B, Hq, Hkv, Nq, Nk, D, k_shift=4.0)
    o_ex, _ = A.attention_forward(q, k, v)

    def err(**kw):
        o, _ = N.forward(q, k, v, config=NVFP4Config(**kw))
        return M.rel_l2(o, o_ex)

    assert err() < 0.5 * err(k_smoothing=False)
    q2, k2, v2 = _inputs(7, B, Hq, Hkv, Nq, Nk, D)
    o2, _ = A.attention_forward(q2, k2, v2)
    e_two = M.rel_l2(N.forward(q2, k2, v2)[0], o2)
    e_one = M.rel_l2(N.forward(q2, k2, v2, config=NVFP4Config(two_level_p=False))[0], o2)
    assert e_two < e_one


def test_inputs_not_modified_and_errors():
    q, k, v = _inputs(8, 1, 2, 1, 16, 16, 32)
    copies = [x.copy() for x in (q, k, v)]
    N.forward(q, k, v, causal=True, config=NVFP4Config(q_smoothing=True, tensor_scale=True))
    N.quantize_inputs(q, k, v)
    for x, c in zip((q, k, v), copies):
        np.testing.assert_array_equal(x, c)
    with pytest.raises(ValueError, match="multiple of 16"):
        N.forward(q[..., :24], k[..., :24], v[..., :24])
    N.forward(q[..., :24], k[..., :24], v[..., :24], config=NVFP4Config(quantize=False))  # fine unquantized
    with pytest.raises(TypeError, match="NVFP4Config"):
        N.forward(q, k, v, config="nvfp4")
    with pytest.raises(TypeError, match="causal"):
        N.forward(q, k, v, causal=1)
    with pytest.raises(TypeError, match="return_intermediates"):
        N.forward(q, k, v, return_intermediates="yes")
    with pytest.raises(ValueError, match="layout"):
        N.forward(q, k, v, layout="BHND")
    with pytest.raises(ValueError, match="quantize"):
        N.quantize_inputs(q, k, v, config=NVFP4Config(quantize=False))
