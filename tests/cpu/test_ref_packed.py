"""Packed variable-length sequences (layout "THD") and sliding windows in the float64 reference
(docs/algorithms.md §1.8): a packed call equals the separate per-sequence calls bit for bit, in the exact
reference and in each simulator; ``window=(-1, 0)`` is ``causal=True``; a window is the dense computation under
the boolean mask of its formula; bad arguments are refused by name."""
import dataclasses

import numpy as np
import pytest

from sagecupy.config import DEFAULT, NVFP4Config, QATConfig
from sagecupy.reference import attention as A
from sagecupy.reference import nvfp4, qat, sagebwd

HQ, HKV, D = 4, 2, 16
# Odd document lengths (a tile is 64 or 128 keys), Nq != Nk inside a sequence, an empty sequence and one whose
# queries have no key at all.
LENS_Q = [1, 17, 127, 128, 129, 0, 3]
LENS_K = [9, 17, 100, 131, 129, 0, 0]


def _cu(lens):
    return np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)


def _packed(seed=0):
    rng = np.random.default_rng(seed)
    tq, tk = sum(LENS_Q), sum(LENS_K)
    q = rng.standard_normal((tq, HQ, D))
    k = rng.standard_normal((tk, HKV, D)) + 0.5   # (a K offset the smoothing mean must remove per sequence)
    v = rng.standard_normal((tk, HKV, D))
    do = rng.standard_normal((tq, HQ, D))
    return q, k, v, do, _cu(LENS_Q), _cu(LENS_K)


def _seqs(cq, ck):
    """The spans of the non-empty sequences (both lengths >= 1)."""
    return [(int(cq[s]), int(cq[s + 1]), int(ck[s]), int(ck[s + 1])) for s in range(len(cq) - 1)
            if cq[s + 1] > cq[s] and ck[s + 1] > ck[s]]


def _one(x, a, b):
    """One sequence as its own (1, N, H, D) NHD array, not a view of the packed one."""
    return np.ascontiguousarray(x[a:b])[None]


def _no_key_rows(cq, ck):
    """Packed query rows of sequences without keys."""
    return np.concatenate([np.arange(cq[s], cq[s + 1]) for s in range(len(cq) - 1) if ck[s + 1] == ck[s]])


@pytest.mark.parametrize("causal", [False, True])
def test_exact_packed_equals_separate(causal):
    q, k, v, do, cq, ck = _packed()
    kw = dict(causal=causal, layout="THD", cu_seqlens_q=cq, cu_seqlens_k=ck, max_seqlen_q=129, max_seqlen_k=131)
    o, lse = A.attention_forward(q, k, v, **kw)
    grads = A.attention_backward(q, k, v, o, lse, do, **kw)
    inter = A.attention_intermediates(q, k, v, do, **kw)
    ch = A.attention_chunked(q, k, v, do, block_q=32, block_k=48, **kw)
    cgrads = A.attention_backward_chunked(q, k, v, o, lse, do, block_q=32, block_k=48, **kw)
    assert o.shape == (q.shape[0], HQ, D) and lse.shape == (HQ, q.shape[0])
    assert grads[1].shape == k.shape and ch["dV"].shape == v.shape
    for q0, q1, k0, k1 in _seqs(cq, ck):
        args = (_one(q, q0, q1), _one(k, k0, k1), _one(v, k0, k1))
        o_s, lse_s = A.attention_forward(*args, causal=causal, layout="NHD")
        assert np.array_equal(o[q0:q1], o_s[0]) and np.array_equal(lse[:, q0:q1], lse_s[0])
        g_s = A.attention_backward(*args, o_s, lse_s, _one(do, q0, q1), causal=causal, layout="NHD")
        for g, gs, (a, b) in zip(grads, g_s, [(q0, q1), (k0, k1), (k0, k1)]):
            assert np.array_equal(g[a:b], gs[0])
        i_s = A.attention_intermediates(*args, _one(do, q0, q1), causal=causal, layout="NHD")
        assert np.array_equal(inter["dK"][k0:k1], np.swapaxes(i_s["dK"][0], 0, 1))
        assert np.array_equal(inter["delta"][:, q0:q1], i_s["delta"][0])
        c_s = A.attention_chunked(*args, _one(do, q0, q1), causal=causal, layout="NHD", block_q=32, block_k=48)
        for key in ("O", "dQ"):
            assert np.array_equal(ch[key][q0:q1], np.swapaxes(c_s[key][0], 0, 1))
        assert np.array_equal(ch["dK"][k0:k1], np.swapaxes(c_s["dK"][0], 0, 1))
        assert np.array_equal(ch["lse"][:, q0:q1], c_s["lse"][0])
        cg_s = A.attention_backward_chunked(*args, o_s, lse_s, _one(do, q0, q1), causal=causal, layout="NHD",
                                            block_q=32, block_k=48)
        assert np.array_equal(cgrads[2][k0:k1], cg_s[2][0])
    assert [s.shape for s in inter["S"]] == [(HQ, a, b) for a, b in zip(LENS_Q, LENS_K)]
    # Queries of a sequence without keys: O = 0, LSE = −inf, zero gradients (every form).
    rows = _no_key_rows(cq, ck)
    for out_o, out_lse, dq in ((o, lse, grads[0]), (ch["O"], ch["lse"], ch["dQ"]), (inter["O"], inter["lse"],
                                                                                    inter["dQ"])):
        assert not out_o[rows].any() and np.all(out_lse[:, rows] == -np.inf) and not dq[rows].any()
    # The packed exact forms agree with each other.
    np.testing.assert_allclose(ch["O"], o, rtol=0, atol=1e-12)
    np.testing.assert_allclose(cgrads[1], grads[1], rtol=0, atol=1e-12)


@pytest.mark.parametrize("causal", [False, True])
def test_sagebwd_packed_equals_separate(causal):
    q, k, v, do, cq, ck = _packed(1)
    kw = dict(causal=causal, layout="THD", cu_seqlens_q=cq, cu_seqlens_k=ck)
    o, res = sagebwd.forward(q, k, v, **kw)
    dq, dk, dv = sagebwd.backward(res, do)
    qi = sagebwd.quantize_inputs(q, k, v, layout="THD", cu_seqlens_q=cq, cu_seqlens_k=ck)
    for s, (q0, q1, k0, k1) in enumerate(_seqs(cq, ck)):
        o_s, res_s = sagebwd.forward(_one(q, q0, q1), _one(k, k0, k1), _one(v, k0, k1), causal=causal, layout="NHD")
        g_s = sagebwd.backward(res_s, _one(do, q0, q1))
        assert np.array_equal(o[q0:q1], o_s[0]) and np.array_equal(res["lse"][:, q0:q1], res_s["lse"][0])
        assert np.array_equal(dq[q0:q1], g_s[0][0])
        assert np.array_equal(dk[k0:k1], g_s[1][0]) and np.array_equal(dv[k0:k1], g_s[2][0])
    # μ_K is each sequence's own mean over its keys.
    for s, (q0, q1, k0, k1) in enumerate(zip(cq[:-1], cq[1:], ck[:-1], ck[1:])):
        if qi[s] is not None:
            assert np.allclose(qi[s]["mu_k"][0], k[k0:k1].mean(axis=0), atol=1e-6)
    rows = _no_key_rows(cq, ck)
    assert not o[rows].any() and not dq[rows].any() and np.all(res["lse"][:, rows] == -np.inf)
    assert np.isfinite(dk).all() and np.isfinite(dv).all()


@pytest.mark.parametrize("causal", [False, True])
def test_nvfp4_and_qat_packed_equal_separate(causal):
    q, k, v, do, cq, ck = _packed(2)
    kw = dict(causal=causal, layout="THD", cu_seqlens_q=cq, cu_seqlens_k=ck)
    cfg = NVFP4Config(tensor_scale=True)
    o4, lse4 = nvfp4.forward(q, k, v, config=cfg, **kw)
    oq, res = qat.forward(q, k, v, **kw)
    dq, dk, dv = qat.backward(res, do)
    for q0, q1, k0, k1 in _seqs(cq, ck):
        args = (_one(q, q0, q1), _one(k, k0, k1), _one(v, k0, k1))
        o_s, lse_s = nvfp4.forward(*args, causal=causal, layout="NHD", config=cfg)
        assert np.array_equal(o4[q0:q1], o_s[0]) and np.array_equal(lse4[:, q0:q1], lse_s[0])
        oq_s, res_s = qat.forward(*args, causal=causal, layout="NHD")
        g_s = qat.backward(res_s, _one(do, q0, q1))
        assert np.array_equal(oq[q0:q1], oq_s[0])
        assert np.array_equal(dq[q0:q1], g_s[0][0]) and np.array_equal(dk[k0:k1], g_s[1][0])
        assert np.array_equal(dv[k0:k1], g_s[2][0])
    rows = _no_key_rows(cq, ck)
    assert not o4[rows].any() and not oq[rows].any() and not dq[rows].any()
    assert np.all(lse4[:, rows] == -np.inf)


# ----------------------------------------------------------------------------
# windows
# ----------------------------------------------------------------------------


def _dense(seed, B, Hq, Hkv, Nq, Nk, Dh):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((B, Hq, Nq, Dh)), rng.standard_normal((B, Hkv, Nk, Dh)),
            rng.standard_normal((B, Hkv, Nk, Dh)), rng.standard_normal((B, Hq, Nq, Dh)))


def _masked_attention(q, k, v, do, mask):
    """Exact attention under an explicit boolean mask, written out independently: (O, lse, dQ, dK, dV)."""
    B, Hq, Nq, Dh = q.shape
    g = Hq // k.shape[1]
    kx, vx = np.repeat(k, g, axis=1), np.repeat(v, g, axis=1)
    scale = 1.0 / np.sqrt(Dh)
    s = np.where(mask, scale * q @ np.swapaxes(kx, -1, -2), -np.inf)
    m = s.max(axis=-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    e = np.exp(s - m)
    l = e.sum(axis=-1, keepdims=True)
    p = np.where(l > 0, e / np.where(l > 0, l, 1.0), 0.0)
    o = p @ vx
    lse = np.where(l[..., 0] > 0, m[..., 0] + np.log(np.where(l > 0, l, 1.0))[..., 0], -np.inf)
    ds = p * (do @ np.swapaxes(vx, -1, -2) - np.sum(do * o, axis=-1, keepdims=True))
    dk = (scale * np.swapaxes(ds, -1, -2) @ q).reshape(B, -1, g, k.shape[2], Dh).sum(axis=2)
    dv = (np.swapaxes(p, -1, -2) @ do).reshape(B, -1, g, k.shape[2], Dh).sum(axis=2)
    return o, lse, scale * ds @ kx, dk, dv


def _formula_mask(nq, nk, left, right):
    i, j = np.arange(nq)[:, None], np.arange(nk)[None, :]
    ok = np.ones((nq, nk), dtype=bool)
    if left != -1:
        ok &= i + (nk - nq) - left <= j
    if right != -1:
        ok &= j <= i + (nk - nq) + right
    return ok


@pytest.mark.parametrize("nq,nk", [(37, 53), (53, 37), (40, 40)])
@pytest.mark.parametrize("window", [(3, 2), (0, 0), (5, -1), (-1, 4), (2, 0), (-1, -1)])
def test_window_equals_explicit_mask(nq, nk, window):
    q, k, v, do = _dense(3, 1, 4, 2, nq, nk, 8)
    ref = _masked_attention(q, k, v, do, _formula_mask(nq, nk, *window))
    assert np.array_equal(A.visible_mask(nq, nk, False, window), _formula_mask(nq, nk, *window))
    o, lse = A.attention_forward(q, k, v, window=window)
    grads = A.attention_backward(q, k, v, o, lse, do, window=window)
    # Blocks of 8 and 16: windows narrower than a block, so blocks are partly masked, partly skipped.
    ch = A.attention_chunked(q, k, v, do, window=window, block_q=8, block_k=16)
    for got in ((o, lse, *grads), (ch["O"], ch["lse"], ch["dQ"], ch["dK"], ch["dV"])):
        for x, y in zip(got, ref):
            assert np.array_equal(np.isinf(x), np.isinf(y))
            np.testing.assert_allclose(np.where(np.isinf(x), 0, x), np.where(np.isinf(y), 0, y), rtol=0, atol=1e-12)
    inter = A.attention_intermediates(q, k, v, do, window=window)
    np.testing.assert_allclose(inter["dV"], ref[4], rtol=0, atol=1e-12)
    # The unquantized simulators are the exact function under the same mask.
    off = dataclasses.replace(DEFAULT, quantize=False)
    o_s, res = sagebwd.forward(q, k, v, window=window, config=off)
    np.testing.assert_allclose(o_s, ref[0], rtol=0, atol=1e-12)
    np.testing.assert_allclose(sagebwd.backward(res, do)[1], ref[3], rtol=0, atol=1e-12)
    q16, k16, v16, do16 = _dense(4, 1, 2, 1, nq, nk, 16)
    ref16 = _masked_attention(q16, k16, v16, do16, _formula_mask(nq, nk, *window))
    np.testing.assert_allclose(nvfp4.forward(q16, k16, v16, window=window, config=NVFP4Config(quantize=False))[0],
                               ref16[0], rtol=0, atol=1e-12)
    oq, rq = qat.forward(q16, k16, v16, window=window, config=QATConfig(quantize=False))
    np.testing.assert_allclose(qat.backward(rq, do16)[0], ref16[2], rtol=0, atol=1e-12)


def test_causal_window_is_causal_bitwise():
    q, k, v, do = _dense(5, 1, 4, 2, 45, 70, 16)
    for kw_a, kw_b in (({"causal": True}, {"window": (-1, 0)}), ({"causal": True}, {"causal": True, "window": (-1, 0)})):
        o_a, l_a = A.attention_forward(q, k, v, **kw_a)
        o_b, l_b = A.attention_forward(q, k, v, **kw_b)
        assert np.array_equal(o_a, o_b) and np.array_equal(l_a, l_b)
        assert all(np.array_equal(x, y) for x, y in zip(A.attention_backward(q, k, v, o_a, l_a, do, **kw_a),
                                                        A.attention_backward(q, k, v, o_a, l_a, do, **kw_b)))
        c_a = A.attention_chunked(q, k, v, do, block_q=16, block_k=16, **kw_a)
        c_b = A.attention_chunked(q, k, v, do, block_q=16, block_k=16, **kw_b)
        assert all(np.array_equal(c_a[key], c_b[key]) for key in c_a)
        s_a, r_a = sagebwd.forward(q, k, v, **kw_a)
        s_b, r_b = sagebwd.forward(q, k, v, **kw_b)
        assert np.array_equal(s_a, s_b)
        assert all(np.array_equal(x, y) for x, y in zip(sagebwd.backward(r_a, do), sagebwd.backward(r_b, do)))
        assert all(np.array_equal(x, y) for x, y in zip(nvfp4.forward(q, k, v, **kw_a), nvfp4.forward(q, k, v, **kw_b)))
        qa, qra = qat.forward(q, k, v, **kw_a)
        qb, qrb = qat.forward(q, k, v, **kw_b)
        assert np.array_equal(qa, qb)
        assert all(np.array_equal(x, y) for x, y in zip(qat.backward(qra, do), qat.backward(qrb, do)))


def test_window_smaller_than_a_tile_in_the_quantized_simulators():
    # A 7-key band in 64-key tiles: most tiles are fully outside a row's window and contribute nothing; rows that
    # see no key (Nq > Nk, right = 0) stay O = 0, LSE = −inf, zero dQ.
    q, k, v, do = _dense(6, 1, 2, 1, 150, 130, 16)
    window = (6, 0)
    mask = _formula_mask(150, 130, *window)
    blind = ~mask.any(axis=1)
    assert blind.any()
    ref = _masked_attention(q, k, v, do, mask)
    o, res = sagebwd.forward(q, k, v, window=window)
    dq, dk, dv = sagebwd.backward(res, do)
    o4, lse4 = nvfp4.forward(q, k, v, window=window)
    oq, rq = qat.forward(q, k, v, window=window)
    dqq = qat.backward(rq, do)[0]
    for out, tol in ((o, 0.05), (o4, 0.3), (oq, 0.3)):
        assert not out[:, :, blind].any()
        assert np.abs(out - ref[0]).max() < tol * np.abs(ref[0]).max()
    assert not dq[:, :, blind].any() and not dqq[:, :, blind].any()
    assert np.all(res["lse"][:, :, blind] == -np.inf) and np.all(lse4[:, :, blind] == -np.inf)
    assert np.isfinite(dk).all() and np.abs(dv - ref[4]).max() < 0.05 * np.abs(ref[4]).max()


# ----------------------------------------------------------------------------
# validation
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("cq,ck,extra,name", [
    ([1, 3, 5], [0, 2, 4], {}, "cu_seqlens_q"),            # does not start at 0
    ([0, 3, 2, 5], [0, 2, 3, 4], {}, "cu_seqlens_q"),      # decreasing
    ([0, 2, 5], [0, 2, 3], {}, "cu_seqlens_k"),            # does not end at total_k
    ([0, 2, 5], [0, 4], {}, "cu_seqlens_q and cu_seqlens_k"),
    (np.array([0.0, 2.0, 5.0]), [0, 2, 4], {}, "cu_seqlens_q"),
    ([0, 2, 5], [0, 2, 4], {"max_seqlen_q": 2}, "max_seqlen_q"),
    ([0, 2, 5], [0, 2, 4], {"max_seqlen_k": 1.5}, "max_seqlen_k"),
    (None, [0, 2, 4], {}, "cu_seqlens_q"),
])
def test_bad_cu_seqlens_named(cq, ck, extra, name):
    rng = np.random.default_rng(7)
    q, k, v = rng.standard_normal((5, 2, 16)), rng.standard_normal((4, 1, 16)), rng.standard_normal((4, 1, 16))
    for fn in (A.attention_forward, A.attention_forward_chunked, sagebwd.forward, nvfp4.forward, qat.forward):
        with pytest.raises(ValueError, match=name):
            fn(q, k, v, layout="THD", cu_seqlens_q=cq, cu_seqlens_k=ck, **extra)


def test_bad_window_and_layout_named():
    q, k, v, do = _dense(8, 1, 2, 1, 6, 6, 16)
    for fn in (A.attention_forward, A.attention_forward_chunked, sagebwd.forward, nvfp4.forward, qat.forward):
        for window in ((-1, -1), (3, 1), (-1, 2)):
            with pytest.raises(ValueError, match="causal=True contradicts window"):
                fn(q, k, v, causal=True, window=window)
        for window in ((-2, 0), (1,), (1.0, 2), "full", (True, 0)):
            with pytest.raises(ValueError, match="window="):
                fn(q, k, v, window=window)
        with pytest.raises(ValueError, match="cu_seqlens_q is only for layout='THD'"):
            fn(q, k, v, cu_seqlens_q=np.array([0, 6], np.int32))
    # causal with a right bound of 0 is the window it names.
    o_a = A.attention_forward(q, k, v, causal=True, window=(2, 0))[0]
    assert np.array_equal(o_a, A.attention_forward(q, k, v, window=(2, 0))[0])
    with pytest.raises(ValueError, match="do must have shape"):
        q3, k3, v3, *_ = _packed()
        res = sagebwd.forward(q3, k3, v3, layout="THD", cu_seqlens_q=_cu(LENS_Q), cu_seqlens_k=_cu(LENS_K))[1]
        sagebwd.backward(res, np.zeros((2, HQ, D)))
