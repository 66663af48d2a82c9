"""The float64 SageBwd simulator (reference/sagebwd.py, docs/algorithms.md §3-4)."""
import numpy as np
import pytest

from sagecupy.analysis import round_to_dtype
from sagecupy.int8 import LOG2E
from sagecupy.config import DEFAULT, PAPER, SageBwdConfig
from sagecupy.reference import sagebwd
from sagecupy.reference.attention import (
    attention_backward,
    attention_forward,
    kv_head_index,
    visible_mask,
)
from sagecupy.reference.metrics import ds_rms_bound, rel_l2, worst_element
from sagecupy.reference.quant import psi

# Small tiles so that tiny shapes still cross several tile boundaries.
SMALL = dict(block_q=16, block_kv=16, bwd_block_q=16, bwd_block_kv=32)


def _inputs(B, Hq, Hkv, Nq, Nk, D, *, sigma=1.0, k_mean=0.0, seed=0, layout="HND"):
    """fp16-valued float64 q, k, v, do (in ``layout``)."""
    rng = np.random.default_rng(seed)
    q = (rng.normal(size=(B, Hq, Nq, D)) * sigma).astype(np.float16)
    k = (rng.normal(size=(B, Hkv, Nk, D)) * sigma + k_mean).astype(np.float16)
    v = rng.normal(size=(B, Hkv, Nk, D)).astype(np.float16)
    do = rng.normal(size=(B, Hq, Nq, D)).astype(np.float16)
    if layout == "NHD":
        q, k, v, do = (np.ascontiguousarray(np.swapaxes(x, 1, 2)) for x in (q, k, v, do))
    return q, k, v, do


def _close(a, ref, tol, what):
    err = rel_l2(a, ref)
    assert err <= tol, f"{what}: rel_l2={err:.3e} > {tol:g}; worst {worst_element(a, ref)}"


def _errors(q, k, v, do, config, causal=False):
    """rel_l2 of O, dQ, dK, dV of the simulator against exact attention."""
    o, res = sagebwd.forward(q, k, v, causal=causal, config=config)
    g = sagebwd.backward(res, do)
    oe, lse = attention_forward(q, k, v, causal=causal)
    ge = attention_backward(q, k, v, oe, lse, do, causal=causal)
    return {name: rel_l2(a, b) for name, a, b in zip(("O", "dQ", "dK", "dV"), (o, *g), (oe, *ge))}


# ---------------------------------------------------------------- quantize=False is exact attention


EXACT_CASES = [
    # (causal, Nq, Nk, Hq, Hkv, layout, k_smoothing, q_smoothing, ds_rowsum_correction)
    (False, 37, 45, 2, 2, "HND", False, False, False),
    (False, 37, 45, 4, 2, "NHD", True, False, False),
    (True, 37, 45, 4, 1, "HND", True, True, False),
    (True, 45, 37, 4, 2, "HND", True, True, True),   # first 8 rows fully masked
    (True, 45, 37, 2, 1, "NHD", False, True, False),
    (True, 37, 45, 2, 2, "NHD", True, False, True),
    (False, 1, 1, 1, 1, "HND", True, True, True),
    (True, 70, 3, 2, 1, "HND", True, True, False),   # most rows fully masked
]


@pytest.mark.parametrize("causal, Nq, Nk, Hq, Hkv, layout, ks, qs, corr", EXACT_CASES)
@pytest.mark.parametrize("base", [PAPER, DEFAULT], ids=["paper", "default"])
def test_without_quantization_equals_exact_attention(base, causal, Nq, Nk, Hq, Hkv, layout, ks, qs, corr):
    cfg = base.replace(quantize=False, k_smoothing=ks, q_smoothing=qs, ds_rowsum_correction=corr, **SMALL)
    q, k, v, do = _inputs(2, Hq, Hkv, Nq, Nk, 16, k_mean=1.5, seed=Nq + Nk, layout=layout)
    o, res = sagebwd.forward(q, k, v, causal=causal, layout=layout, config=cfg)
    dq, dk, dv = sagebwd.backward(res, do)
    oe, lse = attention_forward(q, k, v, causal=causal, layout=layout)
    dqe, dke, dve = attention_backward(q, k, v, oe, lse, do, causal=causal, layout=layout)
    assert o.shape == q.shape and dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape
    for name, a, ref in (("O", o, oe), ("dQ", dq, dqe), ("dK", dk, dke), ("dV", dv, dve)):
        assert np.all(np.isfinite(a)), name
        _close(a, ref, 1e-12, name)
    seen = np.isfinite(lse)
    np.testing.assert_array_equal(np.isfinite(res["lse"]), seen)
    np.testing.assert_allclose(res["lse"][seen], lse[seen], rtol=1e-12, atol=1e-12)
    if causal and Nq > Nk:  # fully masked rows: O = 0, lse = -inf, zero gradients
        dead = slice(0, Nq - Nk)
        oh = o if layout == "HND" else np.swapaxes(o, 1, 2)
        dqh = dq if layout == "HND" else np.swapaxes(dq, 1, 2)
        assert np.all(oh[:, :, dead] == 0) and np.all(dqh[:, :, dead] == 0)
        assert np.all(res["lse"][:, :, dead] == -np.inf)
        assert np.all(res["lse_internal"][:, :, dead] == -np.inf)


# ---------------------------------------------------------------- literal tile loops


def _literal_forward(qi, cfg, causal):
    """The online softmax of docs/algorithms.md §3 written as a plain loop over rows and KV tiles."""
    B, Hq, Nq, D = qi["q_codes"].shape
    Hkv, Nk = qi["k_codes"].shape[1:3]
    mask = visible_mask(Nq, Nk, causal)
    kv_of = kv_head_index(Hq, Hkv)
    o = np.zeros((B, Hq, Nq, D))
    lse = np.zeros((B, Hq, Nq))
    for b in range(B):
        for h in range(Hq):
            g = kv_of[h]
            for i in range(Nq):
                m, l, acc = -np.inf, 0.0, np.zeros(D)
                for t, j0 in enumerate(range(0, Nk, cfg.block_kv)):
                    js = np.arange(j0, min(j0 + cfg.block_kv, Nk))
                    vis = mask[i, js]
                    if not vis.any():
                        continue
                    s = np.full(len(js), -np.inf)
                    for a, j in enumerate(js):
                        if vis[a]:
                            dot = float(np.dot(qi["q_codes"][b, h, i].astype(float), qi["k_codes"][b, g, j].astype(float)))
                            s[a] = dot * qi["q_scale"][b, h, i] * qi["k_scale"][b, g, j] + qi["bias"][b, h, i // cfg.block_q, j]
                    r = s.max()
                    m_new = max(m, r)
                    alpha = np.exp(m - m_new) if m != -np.inf else 0.0
                    l = alpha * l + np.exp(s - m_new).sum()
                    s_p = np.exp(r - m_new) / cfg.p_max
                    p_hat = np.rint(cfg.p_max * np.exp(s - r))
                    s_v = qi["v_scale"][b, g, 0 if cfg.v_granularity == "channel" else t]
                    acc = alpha * acc + (p_hat @ qi["v_codes"][b, g, js].astype(float)) * s_p * s_v
                    m = m_new
                if m == -np.inf:
                    o[b, h, i], lse[b, h, i] = 0.0, -np.inf
                else:
                    o[b, h, i], lse[b, h, i] = acc / l, m + np.log(l)
    return o, lse


def _literal_backward(res, do, cfg):
    """docs/algorithms.md §4 as a loop over (bwd_block_q x bwd_block_kv) tiles with psi on each tile (dS's X and Y
    only with ``ds_int8``; without it they are rounded to bf16 element by element)."""
    qc, qs, kc, ks = res["q_codes"], res["q_scale"], res["k_codes"], res["k_scale"]
    B, Hq, Nq, D = qc.shape
    Hkv, Nk = kc.shape[1:3]
    sm = res["sm_scale"]
    mask = visible_mask(Nq, Nk, res["causal"])
    kv_of = kv_head_index(Hq, Hkv)
    bq, bkv = cfg.bwd_block_q, cfg.bwd_block_kv
    dq = np.zeros((B, Hq, Nq, D))
    dk = np.zeros((B, Hkv, Nk, D))
    dv = np.zeros((B, Hkv, Nk, D))
    for b in range(B):
        for h in range(Hq):
            g = kv_of[h]
            o, lse = res["o"][b, h], res["lse_internal"][b, h]
            for i0 in range(0, Nq, bq):
                I = slice(i0, min(i0 + bq, Nq))
                do_i = do[b, h, I]
                delta = np.sum(do_i * o[I], axis=-1)
                do_c, do_s = psi(do_i, None if cfg.do_granularity == "block" else 0, fp32=True)  # as the GPU
                mu_q_rows = res["mu_q"][b, h, np.arange(I.start, I.stop) // cfg.block_q]
                for j0 in range(0, Nk, bkv):
                    J = slice(j0, min(j0 + bkv, Nk))
                    s = (qc[b, h, I].astype(float) @ kc[b, g, J].astype(float).T) * qs[b, h, I][:, None] * ks[b, g, J][None, :]
                    s = s + res["bias"][b, h, np.arange(I.start, I.stop) // cfg.block_q][:, J]
                    s = np.where(mask[I, J], s, -np.inf)
                    ok = lse[I] != -np.inf
                    p = np.where(ok[:, None], np.exp(s - np.where(ok, lse[I], 0.0)[:, None]), 0.0)
                    if cfg.dv_int8:
                        p_c, p_s = psi(p, 0 if cfg.p_bwd_granularity == "column" else None, qmax=cfg.p_max,
                                       unsigned=cfg.p_unsigned)
                        dv[b, g, J] += (p_c.T.astype(float) @ do_c.astype(float)) * p_s.T * do_s
                    else:  # P rounded through fp32 to the inputs' fp16 (_inputs), dO as given
                        p16 = p.astype(np.float32).astype(np.float16).astype(float)
                        dv[b, g, J] += p16.T @ do_i
                    dp = do_i @ res["v"][b, g, J].T
                    ds = p * (dp - delta[:, None])
                    x = ds * ks[b, g, J][None, :]
                    y = qs[b, h, I][:, None] * ds
                    if cfg.ds_int8:
                        x_c, x_s = psi(x, 1 if cfg.ds_granularity == "rowcol" else None)
                        dq[b, h, I] += sm * (x_c.astype(float) @ kc[b, g, J].astype(float)) * x_s
                        y_c, y_s = psi(y, 0 if cfg.ds_granularity == "rowcol" else None)
                        dk[b, g, J] += (y_c.T.astype(float) @ qc[b, h, I].astype(float)) * y_s.T
                    else:  # X, and Y on the kernels' base-2 grid (log2 e in Q's float32 scale, ln 2 after),
                        # rounded through fp32 to bf16, against the exact K and Q codes
                        qs2 = (np.float32(qs[b, h, I]) * np.float32(LOG2E)).astype(float)
                        y2 = qs2[:, None] * ds
                        x16, y16 = (round_to_dtype(a.astype(np.float32), "bf16") for a in (x, y2))
                        dq[b, h, I] += sm * (x16 @ kc[b, g, J].astype(float))
                        dk[b, g, J] += np.log(2.0) * (y16.T @ qc[b, h, I].astype(float))
                    if cfg.q_smoothing:
                        dk[b, g, J] += sm * ds.T @ mu_q_rows
                    if cfg.ds_rowsum_correction:
                        dq[b, h, I] += sm * ds.sum(axis=1)[:, None] * res["mu_k"][b, g][None, :]
    return dq, dk, dv


LOOP_CONFIGS = {
    "default": DEFAULT.replace(**SMALL),
    "paper": PAPER.replace(**SMALL),
    "default+qsmooth+corr": DEFAULT.replace(q_smoothing=True, ds_rowsum_correction=True, **SMALL),
    "paper-bigbwd": PAPER.replace(block_q=16, block_kv=32, bwd_block_q=32, bwd_block_kv=16, q_smoothing=True),
    # INT8 dV (per-column P, per-channel dO), dQ and dK (X per query row, Y per key)
    "default-dv8": DEFAULT.replace(dv_int8=True, ds_int8=True, **SMALL),
    "default-ds8": DEFAULT.replace(ds_int8=True, **SMALL),  # 16-bit dV, INT8 dQ and dK
    # INT8 dV with dQ and dK from bf16 X and Y: a combination only the reference implements (the kernels refuse it)
    "mixed": DEFAULT.replace(k_granularity="block", v_granularity="block", p_bwd_granularity="block",
                             do_granularity="block", p_unsigned=False, dv_int8=True, ds_int8=False, **SMALL),
}


@pytest.mark.parametrize("name", list(LOOP_CONFIGS))
@pytest.mark.parametrize("causal, Nq, Nk", [(False, 37, 45), (True, 45, 37)])
def test_vectorized_equals_literal_tile_loops(name, causal, Nq, Nk):
    cfg = LOOP_CONFIGS[name]
    q, k, v, do = _inputs(1, 2, 1, Nq, Nk, 8, sigma=2.0, k_mean=1.0, seed=7)
    qi = sagebwd.quantize_inputs(q, k, v, config=cfg)
    o, res = sagebwd.forward(q, k, v, causal=causal, config=cfg)
    o_lit, lse_lit = _literal_forward(qi, cfg, causal)
    _close(o, o_lit, 1e-12, f"O ({name})")
    seen = lse_lit != -np.inf
    np.testing.assert_array_equal(res["lse_internal"] != -np.inf, seen)
    np.testing.assert_allclose(res["lse_internal"][seen], lse_lit[seen], rtol=1e-13, atol=1e-13)
    grads = sagebwd.backward(res, do)
    lit = _literal_backward(res, do.astype(np.float64), cfg)
    for gname, a, ref in zip(("dQ", "dK", "dV"), grads, lit):
        _close(a, ref, 1e-12, f"{gname} ({name})")


def _literal_forward_pv16(q, k, v, qi, cfg, causal, dtype):
    """The 16-bit P.V forward (pv_int8=False) as the kernels run it, row by row and tile by tile: base-2 logits, the
    lazy frame (moved only by more than the slack), P~ in the frame rounded to ``dtype``, O accumulated in the frame
    and rescaled when it moves, the unrounded row sum."""
    B, Hq, Nq, D = qi["q_codes"].shape
    Hkv, Nk = qi["k_codes"].shape[1:3]
    mask = visible_mask(Nq, Nk, causal)
    kv_of = kv_head_index(Hq, Hkv)
    o = np.zeros((B, Hq, Nq, D))
    for b in range(B):
        for h in range(Hq):
            g = kv_of[h]
            s_all = ((qi["q_codes"][b, h].astype(float) @ qi["k_codes"][b, g].astype(float).T)
                     * qi["q_scale"][b, h][:, None] * qi["k_scale"][b, g][None, :])
            for i in range(Nq):
                f, l, acc = -np.inf, 0.0, np.zeros(D)
                for j0 in range(0, Nk, cfg.block_kv):
                    js = np.arange(j0, min(j0 + cfg.block_kv, Nk))
                    s2 = np.where(mask[i, js], s_all[i, js] * LOG2E, -np.inf)
                    r2 = s2.max()
                    f_new = r2 if r2 > f + sagebwd.FWD_RESCALE_SLACK else f
                    if f_new == -np.inf:
                        continue
                    alpha = 2.0 ** (f - f_new) if f != -np.inf else 0.0
                    p = 2.0 ** (s2 - f_new)
                    l = alpha * l + p.sum()
                    acc = alpha * acc + round_to_dtype(p.astype(np.float32), "bf16") @ v[b, g, js].astype(float)
                    f = f_new
                o[b, h, i] = acc / l if f != -np.inf else 0.0
    return o


@pytest.mark.parametrize("causal, Nq, Nk", [(False, 37, 45), (True, 45, 37)])
def test_pv16_vectorized_equals_literal_tile_loop(causal, Nq, Nk):
    """pv_int8=False: the closed form with the frame's weights (reference/sagebwd.py) is the kernels' tile loop."""
    import ml_dtypes

    cfg = DEFAULT.replace(pv_int8=False, **SMALL)
    q, k, v, _ = (x.astype(ml_dtypes.bfloat16) for x in _inputs(1, 2, 1, Nq, Nk, 8, sigma=4.0, k_mean=1.0, seed=7))
    qi = sagebwd.quantize_inputs(q, k, v, config=cfg)
    o, res = sagebwd.forward(q, k, v, causal=causal, config=cfg)
    _close(o, _literal_forward_pv16(q, k, v, qi, cfg, causal, "bfloat16"), 1e-12, "O (pv_int8=False)")
    _, res8 = sagebwd.forward(q, k, v, causal=causal, config=cfg.replace(pv_int8=True))
    np.testing.assert_array_equal(res["lse_internal"], res8["lse_internal"])  # the row sums are the same


@pytest.mark.parametrize("sigma", [1.0, 4.0])
def test_pv16_is_more_accurate(sigma):
    """V unquantized and P~ with 8 or 11 significant bits everywhere: O nearer exact attention than the INT8 P.V's."""
    q, k, v, _ = _inputs(1, 2, 2, 256, 256, 64, sigma=sigma, seed=3)
    exact = attention_forward(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64))
    exact = exact[0] if isinstance(exact, tuple) else exact
    err = {pv: rel_l2(sagebwd.forward(q, k, v, config=DEFAULT.replace(pv_int8=pv))[0], exact) for pv in (True, False)}
    assert err[False] < err[True], err


# ---------------------------------------------------------------- accuracy and bookkeeping


def test_paper_and_default_run_and_default_is_more_accurate():
    q, k, v, do = _inputs(1, 2, 2, 256, 256, 64, sigma=5.0, seed=11)
    err = {cfg.name: _errors(q, k, v, do, cfg) for cfg in (PAPER, DEFAULT)}
    for name in ("O", "dQ", "dK", "dV"):
        assert 0 < err["default"][name] < err["paper"][name], (name, err)
    # sanity: quantization error of the order of a few percent, not garbage
    assert err["default"]["O"] < 0.1 and err["paper"]["O"] < 0.2, err


@pytest.mark.parametrize("sigma", [1.0, 5.0])
def test_dv_in_16_bits_leaves_dq_dk_and_is_closer_to_exact(sigma):
    q, k, v, do = _inputs(1, 2, 1, 200, 230, 32, sigma=sigma, seed=5)
    _, res8 = sagebwd.forward(q, k, v, causal=True, config=DEFAULT.replace(dv_int8=True))
    _, res16 = sagebwd.forward(q, k, v, causal=True)  # (the default)
    assert res16["dtype"] == "float16"  # (q's dtype)
    g8, g16 = sagebwd.backward(res8, do), sagebwd.backward(res16, do)
    np.testing.assert_array_equal(g8[0], g16[0])
    np.testing.assert_array_equal(g8[1], g16[1])
    oe, lse = attention_forward(q, k, v, causal=True)
    dv_exact = attention_backward(q, k, v, oe, lse, do, causal=True)[2]
    assert rel_l2(g16[2], dv_exact) < rel_l2(g8[2], dv_exact)
    # bf16 rounds P more coarsely than fp16; unrounded P (float64 inputs, dtype unknown) not at all
    _, res_bf = sagebwd.forward(q, k, v, causal=True, config=DEFAULT.replace(dv_int8=False), dtype="bfloat16")
    _, res_64 = sagebwd.forward(*(x.astype(np.float64) for x in (q, k, v)), causal=True,
                                config=DEFAULT.replace(dv_int8=False))
    assert res_64["dtype"] is None
    dv_bf, dv_64 = sagebwd.backward(res_bf, do)[2], sagebwd.backward(res_64, do)[2]
    assert rel_l2(dv_64, g16[2]) < rel_l2(dv_64, dv_bf) < 1e-2
    with pytest.raises(ValueError, match="dtype"):
        sagebwd.forward(q, k, v, dtype="float32")


def _x_y(res, inter):
    """X = dS diag(s_K) and Y' = diag(fp32(s_Q log2 e)) dS (the kernels' base-2 Y, ln 2 times Y) of the backward's
    dS, unrounded."""
    Hq = res["q_scale"].shape[1]
    ks = res["k_scale"][:, kv_head_index(Hq, res["k_scale"].shape[1])]
    qs2 = (res["q_scale"].astype(np.float32) * np.float32(LOG2E)).astype(np.float64)
    return inter["dS"] * ks[:, :, None, :], qs2[..., None] * inter["dS"]


@pytest.mark.parametrize("causal", [False, True])
def test_ds_in_bf16_is_x_and_y_rounded_at_unit_scale(causal):
    """ds_int8=False: X's "codes" are X rounded to bf16 at scale 1, Y's are Y' = log2(e) Y (the kernels' base-2
    scale of Q) rounded to bf16 at scale ln 2 (fp32 bit patterns whose low 16 bits are zero, within bf16's relative
    half-ulp), with no tile in them, so ds_granularity changes nothing; with ds_int8=True it does (the switch reaches
    the quantizer)."""
    cfg = DEFAULT.replace(**SMALL)
    assert not cfg.ds_int8
    q, k, v, do = _inputs(1, 4, 2, 45, 37, 16, sigma=2.0, k_mean=1.0, seed=12)
    ress, grads, inter = {}, {}, {}
    for gran in ("rowcol", "block"):
        for ds8 in (False, True):
            _, res = sagebwd.forward(q, k, v, causal=causal, config=cfg.replace(ds_granularity=gran, ds_int8=ds8))
            ress[gran, ds8] = res
            *grads[gran, ds8], inter[gran, ds8] = sagebwd.backward(res, do, return_intermediates=True)
    it = inter["rowcol", False]
    x, y = _x_y(ress["rowcol", False], it)
    for name, exact, unit in (("X", x, 1.0), ("Y", y, np.log(2.0))):
        codes = it[f"{name}_codes"]
        assert np.all(it[f"{name}_scale"] == unit), name
        f32 = codes.astype(np.float32)
        np.testing.assert_array_equal(f32.astype(np.float64), codes)   # fp32 values ...
        assert not np.any(f32.view(np.uint32) & 0xFFFF), name          # ... with bf16's 8 significant bits
        # round to nearest: within half a unit in the last place, 2^-8 relative (2^-134 absolute below bf16's
        # normal range, where its spacing is 2^-133)
        assert np.all(np.abs(codes - exact) <= 2.0 ** -8 * np.abs(exact) + 2.0 ** -134), name
        assert np.any(codes != exact), name  # (the rounding happened)
    for key in ("X_codes", "X_scale", "Y_codes", "Y_scale"):
        np.testing.assert_array_equal(inter["block", False][key], it[key])
    for a, b in zip(grads["rowcol", False], grads["block", False]):
        np.testing.assert_array_equal(a, b)
    assert not np.array_equal(grads["rowcol", True][0], grads["block", True][0])  # dQ
    assert not np.array_equal(grads["rowcol", True][1], grads["block", True][1])  # dK
    np.testing.assert_array_equal(grads["rowcol", True][2], grads["rowcol", False][2])  # dV: dS plays no part


def test_ds_in_bf16_leaves_o_and_dv_and_is_closer_to_exact():
    """At sigma = 1 dS's own quantization is a visible part of dQ's and dK's error (bf16: 1.0e-2 against INT8 per
    row / key: 1.6e-2 here); at sigma = 5 the forward's errors dominate and the two agree to ~0.2 %."""
    q, k, v, do = _inputs(1, 2, 1, 200, 230, 32, sigma=1.0, seed=5)
    e16 = _errors(q, k, v, do, DEFAULT, causal=True)
    e8 = _errors(q, k, v, do, DEFAULT.replace(ds_int8=True), causal=True)
    assert e16["O"] == e8["O"] and e16["dV"] == e8["dV"]
    assert e16["dQ"] < e8["dQ"] and e16["dK"] < e8["dK"], (e16, e8)


def test_ds_in_bf16_matches_ml_dtypes():
    """The bf16 X and Y' (Y on the kernels' base-2 grid) are ml_dtypes' round to nearest even of their fp32 values
    (they are fp32 in the kernels; rounding the float64 ones straight to bf16 would differ where the fp32 step rounds
    onto a bf16 tie)."""
    md = pytest.importorskip("ml_dtypes")
    q, k, v, do = _inputs(1, 2, 1, 64, 80, 32, sigma=3.0, seed=14)
    _, res = sagebwd.forward(q, k, v, causal=True)
    *_, it = sagebwd.backward(res, do, return_intermediates=True)
    for name, exact in zip(("X", "Y"), _x_y(res, it)):
        want = exact.astype(np.float32).astype(md.bfloat16).astype(np.float64)
        np.testing.assert_array_equal(it[f"{name}_codes"], want, err_msg=name)


def test_loop_configs_cover_every_backward_mode():
    """The literal loops check each (dv_int8, ds_int8) pair: the three the kernels implement and the one only the
    reference does."""
    from sagecupy import int8

    modes = {(c.dv_int8, c.ds_int8) for c in LOOP_CONFIGS.values()}
    assert modes == set(int8._BWD_MODES) | {(True, False)}


def test_public_lse_matches_exact_lse():
    # a large K mean makes the internal (smoothed) LSE far from the public one
    for cfg in (DEFAULT, PAPER.replace(k_smoothing=True, q_smoothing=True)):
        q, k, v, do = _inputs(1, 2, 1, 64, 80, 32, k_mean=4.0, seed=3)
        _, res = sagebwd.forward(q, k, v, causal=True, config=cfg)
        _, lse = attention_forward(q, k, v, causal=True)
        assert np.max(np.abs(res["lse"] - lse)) < 0.05, cfg.name
        assert np.max(np.abs(res["lse_internal"] - lse)) > 1.0  # the bookkeeping actually mattered


def test_k_smoothing_improves_accuracy_for_large_mean_k():
    q, k, v, do = _inputs(1, 2, 2, 128, 128, 64, sigma=1.0, k_mean=8.0, seed=5)
    on = _errors(q, k, v, do, DEFAULT)
    off = _errors(q, k, v, do, DEFAULT.replace(k_smoothing=False))
    assert on["O"] < 0.5 * off["O"], (on, off)
    # and the codes really differ: the mean is removed before quantizing
    qi_on = sagebwd.quantize_inputs(q, k, v, config=DEFAULT)
    qi_off = sagebwd.quantize_inputs(q, k, v, config=DEFAULT.replace(k_smoothing=False))
    assert not np.array_equal(qi_on["k_codes"], qi_off["k_codes"])
    np.testing.assert_allclose(qi_on["mu_k"], k.astype(np.float64).mean(axis=2), rtol=1e-14)
    assert np.all(qi_off["mu_k"] == 0)


def test_ds_rms_bound_holds_for_simulated_ds():
    q, k, v, do = _inputs(1, 2, 1, 45, 37, 16, sigma=3.0, seed=9)
    for causal in (False, True):
        out = sagebwd.run(q, k, v, do, causal=causal, config=DEFAULT.replace(**SMALL))
        mask = visible_mask(45, 37, causal)
        bound = ds_rms_bound(out["dP"], out["delta"], mask)
        n = mask.sum(axis=-1)
        rms_rows = np.sqrt(np.sum(out["dS"] ** 2, axis=-1) / np.maximum(n, 1))
        assert np.all(rms_rows <= bound * (1 + 1e-12) + 1e-300)
        assert np.all(bound[..., n > 0] > 0)
        # P rows sum to one (the bound relies on it)
        seen = np.isfinite(out["lse"])
        np.testing.assert_allclose(out["P"].sum(axis=-1)[seen], 1.0, rtol=1e-12)


# ---------------------------------------------------------------- shapes and contents


@pytest.mark.parametrize("cfg", [DEFAULT, PAPER, DEFAULT.replace(q_smoothing=True, v_granularity="block")],
                         ids=["default", "paper", "qsmooth-vblock"])
def test_quantize_inputs_shapes_and_granularity(cfg):
    B, Hq, Hkv, Nq, Nk, D = 2, 4, 2, 150, 70, 16
    q, k, v, _ = _inputs(B, Hq, Hkv, Nq, Nk, D, sigma=2.0, k_mean=0.5, seed=1)
    qi = sagebwd.quantize_inputs(q, k, v, config=cfg)
    nqb, nkb = -(-Nq // cfg.block_q), -(-Nk // cfg.block_kv)
    nv = 1 if cfg.v_granularity == "channel" else nkb
    shapes = {
        "q_codes": (B, Hq, Nq, D), "q_scale": (B, Hq, Nq), "k_codes": (B, Hkv, Nk, D), "k_scale": (B, Hkv, Nk),
        "v_codes": (B, Hkv, Nk, D), "v_scale": (B, Hkv, nv, D), "mu_k": (B, Hkv, D),
        "mu_q": (B, Hq, nqb, D), "bias": (B, Hq, nqb, Nk),
    }
    for key, shape in shapes.items():
        assert qi[key].shape == shape, key
    for key in ("q_codes", "k_codes", "v_codes"):
        assert qi[key].dtype == np.int16 and np.abs(qi[key]).max() <= 127
    assert qi["sm_scale"] == 1 / np.sqrt(D)
    if cfg.q_granularity == "block":  # a block scale repeated on its rows
        blocks = qi["q_scale"][..., : (Nq // cfg.block_q) * cfg.block_q].reshape(B, Hq, -1, cfg.block_q)
        assert np.all(blocks == blocks[..., :1])
    else:
        assert not np.all(qi["q_scale"][..., :16] == qi["q_scale"][..., :1])
    if cfg.v_granularity == "block":
        assert np.all(qi["v_scale"] == qi["v_scale"][..., :1])
    # dequantized values reproduce the smoothed inputs to INT8 accuracy
    q64, k64 = q.astype(np.float64), k.astype(np.float64)
    mu_q_rows = np.repeat(qi["mu_q"], cfg.block_q, axis=2)[:, :, :Nq]
    qs_deq = qi["q_codes"] * qi["q_scale"][..., None]
    assert rel_l2(qs_deq, qi["sm_scale"] * (q64 - mu_q_rows)) < 0.02
    ks_deq = qi["k_codes"] * qi["k_scale"][..., None]
    assert rel_l2(ks_deq, k64 - qi["mu_k"][:, :, None]) < 0.02
    if cfg.q_smoothing:
        np.testing.assert_allclose(qi["mu_q"][:, :, 0], q64[:, :, : cfg.block_q].mean(axis=2), rtol=1e-13)
        np.testing.assert_allclose(qi["mu_q"][:, :, -1], q64[:, :, (nqb - 1) * cfg.block_q:].mean(axis=2), rtol=1e-13)
        ks_full = (k64 - qi["mu_k"][:, :, None])[:, kv_head_index(Hq, Hkv)]
        np.testing.assert_allclose(qi["bias"], qi["sm_scale"] * qi["mu_q"] @ np.swapaxes(ks_full, -1, -2), rtol=1e-12)
    else:
        assert np.all(qi["mu_q"] == 0) and np.all(qi["bias"] == 0)


def test_residuals_and_intermediate_shapes():
    B, Hq, Hkv, Nq, Nk, D = 1, 4, 2, 45, 37, 16
    cfg = DEFAULT.replace(**SMALL)
    q, k, v, do = _inputs(B, Hq, Hkv, Nq, Nk, D, seed=2, layout="NHD")
    o, res, fwd = sagebwd.forward(q, k, v, causal=True, layout="NHD", config=cfg, return_intermediates=True)
    assert set(res) == set(sagebwd.RESIDUAL_KEYS)
    assert res["layout"] == "NHD" and res["causal"] is True and res["config"] is cfg
    assert res["o"].shape == (B, Hq, Nq, D) and res["v"].shape == (B, Hkv, Nk, D)
    assert res["lse"].shape == res["lse_internal"].shape == (B, Hq, Nq)
    T = -(-Nk // cfg.block_kv)
    assert {k_: fwd[k_].shape for k_ in fwd} == {
        "S": (B, Hq, Nq, Nk), "tile_max": (B, Hq, Nq, T), "m": (B, Hq, Nq), "l": (B, Hq, Nq),
        "P_fwd_codes": (B, Hq, Nq, Nk), "P_fwd_weight": (B, Hq, Nq, T), "P": (B, Hq, Nq, Nk),
    }
    assert fwd["P_fwd_codes"].dtype == np.int16 and fwd["P_fwd_codes"].max() == cfg.p_max
    dq, dk, dv, bwd = sagebwd.backward(res, do, return_intermediates=True)
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape
    nn = (B, Hq, Nq, Nk)
    assert {k_: bwd[k_].shape for k_ in bwd} == {
        "delta": (B, Hq, Nq), "P": nn, "dP": nn, "dS": nn, "dO_codes": (B, Hq, Nq, D), "dO_scale": (B, Hq, Nq, D),
        "P_bwd_codes": nn, "P_bwd_scale": nn, "X_codes": nn, "X_scale": nn, "Y_codes": nn, "Y_scale": nn,
    }
    np.testing.assert_allclose(bwd["P"], fwd["P"], rtol=0, atol=0)
    _, res_p = sagebwd.forward(q, k, v, layout="NHD", config=PAPER)
    *_, bwd_p = sagebwd.backward(res_p, do, return_intermediates=True)
    assert bwd_p["dO_scale"].shape == (B, Hq, Nq, 1)

    out = sagebwd.run(q, k, v, do, causal=True, layout="NHD", config=cfg)
    for key in ("O", "lse", "dQ", "dK", "dV", "delta", "P", "dP", "dS", "S", "lse_internal"):
        assert key in out, key
    np.testing.assert_array_equal(out["O"], np.swapaxes(o, 1, 2))
    np.testing.assert_array_equal(out["dK"], np.swapaxes(dk, 1, 2))
    assert out["P"].shape == nn and out["dQ"].shape == (B, Hq, Nq, D)


def test_inputs_not_modified_and_nan_propagates():
    q, k, v, do = _inputs(1, 2, 2, 20, 20, 8, seed=4)
    copies = [x.copy() for x in (q, k, v, do)]
    out = sagebwd.run(q, k, v, do, config=DEFAULT.replace(q_smoothing=True))
    for x, c in zip((q, k, v, do), copies):
        np.testing.assert_array_equal(x, c)
    assert all(np.all(np.isfinite(out[key])) for key in ("O", "dQ", "dK", "dV"))
    q_bad = q.astype(np.float64)
    q_bad[0, 1, 3, 2] = np.nan
    o, _ = sagebwd.forward(q_bad, k, v)
    assert np.all(np.isnan(o[0, 1, 3]))  # never silently finite
    assert np.all(np.isfinite(o[0, 0]))


def test_error_paths():
    q, k, v, do = _inputs(1, 2, 2, 8, 8, 8)
    with pytest.raises(ValueError, match="layout"):
        sagebwd.forward(q, k, v, layout="BHSD")
    with pytest.raises(ValueError, match="k and v"):
        sagebwd.forward(q, k, v[:, :, :4])
    with pytest.raises(ValueError, match="query heads"):
        sagebwd.forward(q[:, :1], k, v)
    with pytest.raises(TypeError, match="q must be"):
        sagebwd.forward(q.tolist(), k, v)
    with pytest.raises(TypeError, match="q must have a real"):
        sagebwd.forward(q.astype(complex), k, v)
    with pytest.raises(ValueError, match="config"):
        sagebwd.forward(q, k, v, config="fast")
    with pytest.raises(TypeError, match="causal"):
        sagebwd.forward(q, k, v, causal=1)
    with pytest.raises(TypeError, match="sm_scale"):
        sagebwd.forward(q, k, v, sm_scale="0.1")
    with pytest.raises(ValueError, match="sm_scale"):
        sagebwd.forward(q, k, v, sm_scale=float("inf"))
    with pytest.raises(TypeError, match="return_intermediates"):
        sagebwd.forward(q, k, v, return_intermediates=None)
    _, res = sagebwd.forward(q, k, v)
    with pytest.raises(ValueError, match="do must have"):
        sagebwd.backward(res, do[:, :, :4])
    with pytest.raises(TypeError, match="do must be"):
        sagebwd.backward(res, do.tolist())
    with pytest.raises(TypeError, match="residuals"):
        sagebwd.backward([res], do)
    with pytest.raises(ValueError, match="missing keys"):
        sagebwd.backward({key: res[key] for key in res if key != "lse_internal"}, do)
    with pytest.raises(ValueError, match="block_q"):
        SageBwdConfig(block_q=24)
