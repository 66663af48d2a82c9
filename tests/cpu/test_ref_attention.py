"""Exact float64 attention reference (``sagecupy.reference.attention``) and metrics.

The forward is checked against an independent per-row loop, the backward
against central finite differences of ``L = <dO, O>`` (relative error < 1e-6).
"""
import numpy as np
import pytest

from sagecupy.reference import attention as A
from sagecupy.reference import metrics as M
from fd import fd_grad


def _rand(rng, *shape):
    return rng.standard_normal(shape)


def _inputs(seed, B, Hq, Hkv, Nq, Nk, D, layout="HND", scale=1.0):
    rng = np.random.default_rng(seed)
    q = scale * _rand(rng, B, Hq, Nq, D)
    k = scale * _rand(rng, B, Hkv, Nk, D)
    v = _rand(rng, B, Hkv, Nk, D)
    do = _rand(rng, B, Hq, Nq, D)
    if layout == "NHD":
        q, k, v, do = (np.ascontiguousarray(x.swapaxes(1, 2)) for x in (q, k, v, do))
    return q, k, v, do


def _naive_forward(q, k, v, causal, sm_scale):
    """Per-row loop over HND inputs: an independent transcription of softmax attention."""
    B, Hq, Nq, D = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    o = np.zeros((B, Hq, Nq, D))
    lse = np.full((B, Hq, Nq), -np.inf)
    for b in range(B):
        for h in range(Hq):
            hk = h // (Hq // Hkv)
            for i in range(Nq):
                keys = [j for j in range(Nk) if not causal or j <= i + (Nk - Nq)]
                if not keys:
                    continue
                s = np.array([sm_scale * np.dot(q[b, h, i], k[b, hk, j]) for j in keys])
                m = s.max()
                w = np.exp(s - m)
                lse[b, h, i] = m + np.log(w.sum())
                o[b, h, i] = (w / w.sum()) @ v[b, hk, keys]
    return o, lse




# (B, Hq, Hkv, Nq, Nk, D, causal, layout)
GRID = [
    (1, 2, 2, 5, 5, 4, False, "HND"),
    (1, 2, 2, 5, 5, 4, True, "HND"),
    (1, 2, 1, 3, 7, 4, True, "HND"),  # Nq < Nk, MQA
    (1, 4, 2, 7, 3, 4, True, "HND"),  # Nq > Nk: four fully masked rows, GQA
    (2, 3, 1, 4, 6, 3, True, "NHD"),
    (1, 4, 2, 6, 4, 5, False, "NHD"),
    (1, 1, 1, 1, 1, 2, True, "HND"),
]


def _grid_id(p):
    B, Hq, Hkv, Nq, Nk, D, causal, layout = p
    return f"B{B}-Hq{Hq}-Hkv{Hkv}-Nq{Nq}-Nk{Nk}-D{D}-{'causal' if causal else 'full'}-{layout}"


def test_visible_mask_bottom_right():
    assert A.visible_mask(2, 5, True).astype(int).tolist() == [[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]]
    assert A.visible_mask(5, 2, True).astype(int).tolist() == [[0, 0], [0, 0], [0, 0], [1, 0], [1, 1]]
    assert np.array_equal(A.visible_mask(4, 4, True), np.tril(np.ones((4, 4), dtype=bool)))
    assert A.visible_mask(3, 2, False).all() and A.visible_mask(3, 2, False).shape == (3, 2)


def test_kv_head_index_and_group_sum():
    assert A.kv_head_index(6, 2).tolist() == [0, 0, 0, 1, 1, 1]
    assert A.kv_head_index(4, 4).tolist() == [0, 1, 2, 3]
    x = np.arange(2 * 6 * 3 * 2, dtype=float).reshape(2, 6, 3, 2)
    s = A.sum_kv_groups(x, 2)
    assert np.array_equal(s[:, 1], x[:, 3:6].sum(axis=1))
    e = A.expand_kv_heads(np.arange(2.0).reshape(1, 2, 1, 1), 6)
    assert e.ravel().tolist() == [0, 0, 0, 1, 1, 1]


def test_default_sm_scale():
    assert A.default_sm_scale(64) == 0.125
    assert A.resolve_sm_scale(None, 16) == 0.25
    assert A.resolve_sm_scale(0.3, 16) == 0.3


@pytest.mark.parametrize("p", GRID, ids=_grid_id)
def test_forward_matches_naive_loop(p):
    B, Hq, Hkv, Nq, Nk, D, causal, layout = p
    q, k, v, _ = _inputs(1, B, Hq, Hkv, Nq, Nk, D, layout, scale=2.0)
    o, lse = A.attention_forward(q, k, v, causal=causal, layout=layout)
    qh, kh, vh = (A.to_hnd(x, layout) for x in (q, k, v))
    o_ref, lse_ref = _naive_forward(qh, kh, vh, causal, 1 / np.sqrt(D))
    assert o.shape == q.shape and o.dtype == np.float64 and lse.shape == (B, Hq, Nq)
    np.testing.assert_allclose(A.to_hnd(o, layout), o_ref, rtol=1e-12, atol=1e-13)
    np.testing.assert_array_equal(np.isinf(lse), np.isinf(lse_ref))
    fin = np.isfinite(lse_ref)
    np.testing.assert_allclose(lse[fin], lse_ref[fin], rtol=1e-12, atol=1e-13)


@pytest.mark.parametrize("p", GRID, ids=_grid_id)
def test_backward_matches_finite_differences(p):
    B, Hq, Hkv, Nq, Nk, D, causal, layout = p
    q, k, v, do = _inputs(2, B, Hq, Hkv, Nq, Nk, D, layout)
    sm = 0.7

    def loss(qq, kk, vv):
        o, _ = A.attention_forward(qq, kk, vv, causal=causal, sm_scale=sm, layout=layout)
        return float(np.sum(o * do))

    o, lse = A.attention_forward(q, k, v, causal=causal, sm_scale=sm, layout=layout)
    dq, dk, dv = A.attention_backward(q, k, v, o, lse, do, causal=causal, sm_scale=sm, layout=layout)
    fd = {
        "dq": fd_grad(lambda x: loss(x, k, v), q),
        "dk": fd_grad(lambda x: loss(q, x, v), k),
        "dv": fd_grad(lambda x: loss(q, k, x), v),
    }
    for name, got in (("dq", dq), ("dk", dk), ("dv", dv)):
        ref = fd[name]
        assert got.shape == ref.shape
        if not np.any(ref):  # e.g. a single row with a single key: dq, dk are exactly 0
            assert np.max(np.abs(got)) < 1e-12, (name, p)
            continue
        err = M.rel_l2(got, ref)
        assert err < 1e-6, (name, p, err, M.worst_element(got, ref))


def test_fully_masked_rows_no_nan_no_warning():
    B, Hq, Hkv, Nq, Nk, D = 1, 2, 1, 6, 2, 4  # rows 0..3 see no key
    q, k, v, do = _inputs(3, B, Hq, Hkv, Nq, Nk, D)
    with np.errstate(all="raise"):
        o, lse = A.attention_forward(q, k, v, causal=True)
        dq, dk, dv = A.attention_backward(q, k, v, o, lse, do, causal=True)
        inter = A.attention_intermediates(q, k, v, do, causal=True)
    assert np.all(o[:, :, :4] == 0) and np.all(lse[:, :, :4] == -np.inf)
    assert np.all(np.isfinite(lse[:, :, 4:]))
    assert np.all(dq[:, :, :4] == 0)
    for x in (o, dq, dk, dv, *[inter[key] for key in ("P", "dP", "dS", "O", "dQ", "dK", "dV", "delta")]):
        assert not np.isnan(x).any()
    assert np.all(inter["P"][:, :, :4] == 0) and np.all(inter["dS"][:, :, :4] == 0)
    # Rows 4, 5 are unaffected by the masked rows: compare with attention over those rows only.
    o2, lse2 = A.attention_forward(q[:, :, 4:], k, v, causal=True)
    np.testing.assert_allclose(o[:, :, 4:], o2, rtol=1e-14)
    np.testing.assert_allclose(lse[:, :, 4:], lse2, rtol=1e-14)


def test_layouts_agree():
    q, k, v, do = _inputs(4, 2, 4, 2, 5, 7, 8)
    sw = [np.ascontiguousarray(x.swapaxes(1, 2)) for x in (q, k, v, do)]
    o, lse = A.attention_forward(q, k, v, causal=True)
    on, lsen = A.attention_forward(*sw[:3], causal=True, layout="NHD")
    np.testing.assert_array_equal(on.swapaxes(1, 2), o)
    np.testing.assert_array_equal(lsen, lse)
    g = A.attention_backward(q, k, v, o, lse, do, causal=True)
    gn = A.attention_backward(*sw[:3], on, lsen, sw[3], causal=True, layout="NHD")
    for a, b in zip(g, gn):
        np.testing.assert_array_equal(b.swapaxes(1, 2), a)


def test_intermediates_consistent():
    B, Hq, Hkv, Nq, Nk, D = 1, 4, 2, 6, 9, 8
    q, k, v, do = _inputs(5, B, Hq, Hkv, Nq, Nk, D, layout="NHD")
    it = A.attention_intermediates(q, k, v, do, causal=True, layout="NHD")
    assert set(it) == {"S", "P", "dP", "delta", "dS", "O", "lse", "dQ", "dK", "dV"}
    for key in ("S", "P", "dP", "dS"):
        assert it[key].shape == (B, Hq, Nq, Nk) and it[key].dtype == np.float64
    mask = A.visible_mask(Nq, Nk, True)
    assert np.all(it["S"][..., ~mask] == -np.inf) and np.all(np.isfinite(it["S"][..., mask]))
    np.testing.assert_allclose(it["P"].sum(-1), 1.0, rtol=1e-14)
    np.testing.assert_allclose(it["dS"].sum(-1), 0.0, atol=1e-13)  # rows of dS sum to zero
    o, lse = A.attention_forward(q, k, v, causal=True, layout="NHD")
    dq, dk, dv = A.attention_backward(q, k, v, o, lse, do, causal=True, layout="NHD")
    np.testing.assert_allclose(it["O"], o.swapaxes(1, 2), rtol=1e-13, atol=1e-15)
    np.testing.assert_allclose(it["lse"], lse, rtol=1e-14)
    for key, ref in (("dQ", dq), ("dK", dk), ("dV", dv)):
        np.testing.assert_allclose(it[key], ref.swapaxes(1, 2), rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(it["delta"], np.sum(do.swapaxes(1, 2) * it["O"], -1), rtol=1e-13)


def test_inputs_not_modified_and_low_precision_accepted():
    q, k, v, do = _inputs(6, 1, 2, 1, 4, 4, 8)
    q16, k16, v16, do16 = (x.astype(np.float16) for x in (q, k, v, do))
    copies = [x.copy() for x in (q, k, v, do, q16, k16, v16, do16)]
    o, lse = A.attention_forward(q, k, v, causal=True)
    A.attention_backward(q, k, v, o, lse, do, causal=True)
    A.attention_intermediates(q, k, v, do)
    o16, _ = A.attention_forward(q16, k16, v16)
    A.attention_backward(q16, k16, v16, o16, lse, do16)
    for x, c in zip((q, k, v, do, q16, k16, v16, do16), copies):
        np.testing.assert_array_equal(x, c)
    assert o16.dtype == np.float64
    o_ref, _ = A.attention_forward(*(x.astype(np.float64) for x in (q16, k16, v16)))
    np.testing.assert_array_equal(o16, o_ref)


def test_error_paths():
    q, k, v, do = _inputs(7, 1, 4, 2, 4, 5, 8)
    with pytest.raises(ValueError, match="layout"):
        A.attention_forward(q, k, v, layout="BHSD")
    with pytest.raises(ValueError, match="layout"):
        A.to_hnd(q, "nhd")
    with pytest.raises(ValueError, match="4-D"):
        A.to_hnd(q[0], "HND")
    with pytest.raises(ValueError, match="q must be 4-D"):
        A.attention_forward(q[0], k, v)
    with pytest.raises(ValueError, match="k and v"):
        A.attention_forward(q, k, v[:, :, :3])
    with pytest.raises(ValueError, match="batch"):
        A.attention_forward(q, np.concatenate([k, k]), np.concatenate([v, v]))
    with pytest.raises(ValueError, match="head dim"):
        A.attention_forward(q[..., :4], k, v)
    with pytest.raises(ValueError, match="multiple"):
        A.attention_forward(q[:, :3], k, v)
    with pytest.raises(ValueError, match="empty"):
        A.attention_forward(q[:, :, :0], k, v)
    with pytest.raises(TypeError, match="sm_scale"):
        A.attention_forward(q, k, v, sm_scale="0.1")
    with pytest.raises(ValueError, match="sm_scale"):
        A.attention_forward(q, k, v, sm_scale=float("nan"))
    with pytest.raises(TypeError, match="causal"):
        A.attention_forward(q, k, v, causal="yes")
    with pytest.raises(TypeError, match="q"):
        A.attention_forward(q.astype(complex), k, v)
    with pytest.raises(TypeError, match="q must be a NumPy array"):
        A.attention_forward(q.tolist(), k, v)
    o, lse = A.attention_forward(q, k, v)
    with pytest.raises(ValueError, match="do must have HND shape"):
        A.attention_backward(q, k, v, o, lse, do[:, :, :2])
    with pytest.raises(ValueError, match="o must have HND shape"):
        A.attention_backward(q, k, v, o[..., :2], lse, do)
    with pytest.raises(ValueError, match="lse"):
        A.attention_backward(q, k, v, o, lse[..., :2], do)
    with pytest.raises(ValueError, match="Hkv"):
        A.kv_head_index(4, 3)


# ----------------------------------------------------------------------------
# metrics
# ----------------------------------------------------------------------------


def test_metrics_values():
    a = np.array([1.0, 2.0, 2.0])
    b = np.array([1.0, 2.0, 3.0])
    assert M.cos(a, a) == pytest.approx(1.0)
    assert M.cos(a, -a) == pytest.approx(-1.0)
    assert M.cos(a, b) == pytest.approx(11 / (3 * np.sqrt(14)))
    assert M.rel_l2(a, b) == pytest.approx(1 / np.sqrt(14))
    assert M.rel_l1(a, b) == pytest.approx(1 / 6)
    assert M.rmse(a, b) == pytest.approx(np.sqrt(1 / 3))
    assert M.rms(b) == pytest.approx(np.sqrt(14 / 3))
    c = M.compare(a, b)
    assert set(c) == {"cos", "rel_l2", "rel_l1", "rmse"} and all(isinstance(x, float) for x in c.values())


def test_metrics_zero_norms_without_warnings():
    z = np.zeros(4)
    with np.errstate(all="raise"):
        assert M.cos(z, z) == 1.0
        assert M.cos(z, np.ones(4)) == 0.0
        assert M.rel_l2(z, z) == 0.0 and M.rel_l1(z, z) == 0.0
        assert M.rel_l2(np.ones(4), z) == np.inf and M.rel_l1(np.ones(4), z) == np.inf
        assert M.rmse(z, z) == 0.0 and M.rms(z) == 0.0
    assert np.isnan(M.rel_l2(np.array([np.nan, 1.0]), np.ones(2)))
    assert np.isnan(M.cos(np.array([np.nan, 1.0]), np.ones(2)))


def test_metrics_errors():
    with pytest.raises(ValueError, match="same shape"):
        M.rel_l2(np.ones(3), np.ones(4))
    with pytest.raises(ValueError, match="empty"):
        M.rms(np.ones(0))
    with pytest.raises(TypeError):
        M.cos(np.ones(2, dtype=complex), np.ones(2))


def test_worst_element():
    a = np.zeros((2, 3))
    ref = np.zeros((2, 3))
    a[1, 2] = 0.5
    a[0, 1] = -2.0
    assert M.worst_element(a, ref) == ((0, 1), -2.0, 0.0)
    a[1, 0] = np.nan
    idx, av, rv = M.worst_element(a, ref)
    assert idx == (1, 0) and np.isnan(av) and rv == 0.0
    both = np.full(3, np.nan)
    assert M.worst_element(both, both)[0] == (0,)


def test_ds_rms_bound_holds():
    B, Hq, Hkv, Nq, Nk, D = 1, 2, 2, 8, 6, 16
    q, k, v, do = _inputs(8, B, Hq, Hkv, Nq, Nk, D, scale=3.0)
    it = A.attention_intermediates(q, k, v, do, causal=True)
    vis = A.visible_mask(Nq, Nk, True)
    bound = M.ds_rms_bound(it["dP"], it["delta"], vis)
    assert bound.shape == (B, Hq, Nq)
    n = vis.sum(-1)
    rms_rows = np.sqrt(np.sum(it["dS"] ** 2, -1) / np.maximum(n, 1))
    assert np.all(rms_rows <= bound * (1 + 1e-12))
    assert np.all(bound[..., n == 0] == 0)
    # explicit value on one row
    i = Nq - 1
    expect = np.max(np.abs(it["dP"][0, 1, i] - it["delta"][0, 1, i])) / np.sqrt(Nk)
    assert bound[0, 1, i] == pytest.approx(expect, rel=1e-14)
    with pytest.raises(ValueError, match="delta"):
        M.ds_rms_bound(it["dP"], it["delta"][..., :3], vis)
    with pytest.raises(TypeError, match="visible"):
        M.ds_rms_bound(it["dP"], it["delta"], vis.astype(int))
