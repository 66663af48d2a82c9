"""NVFP4 attention and FP4 QAT kernels against the float64 references (SPEC §5-6).

Per case, two comparisons (as for the INT8 kernels):
* against the quantization-aware simulator with the same config: relative L2 <= 1e-3 plus the output
  format's own rounding of the simulator's result (measured per case). What remains is fp32 vs float64
  arithmetic: fp32 accumulation order, fp32 exp2 and scale arithmetic (which can move an element of P across
  an E2M1 rounding boundary now and then) and the output rounding;
* against exact float64 attention: no worse than 1.1 x the simulator's own error + 1e-4.
"""
import numpy as np
import pytest

from sagecupy.config import NVFP4Config, QATConfig
from sagecupy.reference import attention as ref_attn
from sagecupy.reference import metrics
from sagecupy.reference import nvfp4 as ref_nv
from sagecupy.reference import qat as ref_qat

pytestmark = pytest.mark.gpu

TOL = 1e-3


@pytest.fixture(params=["mma", "wgmma"])
def engine(request, monkeypatch):
    """Runs a test on both engines of the NVFP4 and QAT forwards (SAGECUPY_FP4_ENGINE) and of the QAT backward
    (SAGECUPY_BWD_ENGINE): mma.sync and, on sm_90, wgmma."""
    if request.param == "wgmma":
        from sagecupy._loader import device_capability

        if device_capability() != (9, 0):
            pytest.skip("the wgmma kernels need compute capability 9.0")
    monkeypatch.setenv("SAGECUPY_FP4_ENGINE", request.param)
    monkeypatch.setenv("SAGECUPY_BWD_ENGINE", request.param)
    return request.param


# Device/host helpers shared with the INT8 kernel tests (same folder).
from test_int8 import _cupy as _cp  # noqa: E402
from test_int8 import _f32, _inputs, _raw, _round_to, _to_dev  # noqa: E402,F401
from test_int8 import _to_host as _host  # noqa: E402


_E4M3_MIDS = None


def _ambiguous_rows(s, two_level, block_kv=64):
    """Rows (B, H, Nq) of the simulator whose P quantization has a decision within fp32 reach of a rounding
    boundary: a block's max/6 near an E4M3 midpoint, or an element x/s near an E2M1 midpoint.

    The kernel computes x = exp(S - r) from fp32 logits with ex2.approx; the simulator from float64 ones. A
    relative difference of a few 1e-7 (more for large logits: |S| times a few fp32 ulps) moves a value that
    close to a boundary to the other side, and then a whole 16-block (scale) or one element (code) of P^ is
    quantized differently -- a legitimate difference, large for a row that sees few keys. Those rows are
    compared against the exact reference only; the others must match the simulator tightly.
    """
    global _E4M3_MIDS
    from sagecupy.reference import fp4 as F

    if _E4M3_MIDS is None:
        g = F.e4m3_decode(np.arange(0, 127))
        g = np.unique(g[np.isfinite(g)])
        _E4M3_MIDS = (g[1:] + g[:-1]) / 2
    nk = s.shape[-1]
    nkp = -(-nk // block_kv) * block_kv
    sp = np.full(s.shape[:-1] + (nkp,), -np.inf)
    sp[..., :nk] = s
    tiles = sp.reshape(s.shape[:-1] + (nkp // block_kv, block_kv))
    r = tiles.max(-1, keepdims=True)
    if not two_level:
        r = np.maximum.accumulate(r, axis=-2)  # the running max m_t
    fin = np.isfinite(r)
    scale = 2688.0 if two_level else 1.0
    x = np.where(fin, scale * np.exp(tiles - np.where(fin, r, 0.0)), 0.0)
    blocks = x.reshape(x.shape[:-1] + (block_kv // 16, 16))
    amax = blocks.max(-1)
    # fp32 reach: a few ulps of fp32 relative, plus the absolute fp32 error of the logits (|S| * 2^-20)
    reach = 2e-6 + np.abs(np.where(np.isfinite(s), s, 0.0)).max(-1) * 2 ** -20  # (B, H, Nq)
    m6 = amax / 6
    d_scale = np.min(np.abs(m6[..., None] - _E4M3_MIDS) / _E4M3_MIDS, axis=-1)
    sc = F.e4m3_round(m6)
    y = np.where(sc[..., None] > 0, blocks / np.where(sc > 0, sc, 1.0)[..., None], 0.0)
    mids = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    d_el = np.min(np.abs(y[..., None] - mids) / mids, axis=-1)
    d_el = np.where(y > 0, d_el, np.inf).min(axis=(-1, -2, -3))
    d_sc = np.where(m6 > 0, d_scale, np.inf).min(axis=(-1, -2))
    return np.minimum(d_el, d_sc) < reach


def _check(name, got, sim, exact, dtype, case, tol=TOL, ambiguous=None, layout="HND"):
    """``ambiguous``: (B, H, Nq) rows excluded from the tight comparison (see _ambiguous_rows)."""
    assert np.isfinite(got).all(), f"{name}: non-finite output {case}"
    g, sm = got, sim
    if ambiguous is not None and ambiguous.any():
        keep = ~ambiguous
        assert keep.mean() > 0.9, f"{name}: {ambiguous.sum()} of {ambiguous.size} rows ambiguous {case}"
        gh, sh = ref_attn.to_hnd(got, layout), ref_attn.to_hnd(sim, layout)
        g, sm = gh[keep], sh[keep]
    bound = tol + metrics.rel_l2(_round_to(sm, dtype), sm)
    err = metrics.rel_l2(g, sm)
    assert err <= bound, f"{name}: rel_l2 vs simulator {err:.3e} > {bound:.3e} {case}; worst {metrics.worst_element(g, sm)}"
    if exact is not None and np.any(exact):
        e_k, e_s = metrics.rel_l2(got, exact), metrics.rel_l2(sim, exact)
        assert e_k <= 1.1 * e_s + 1e-4, f"{name}: vs exact {e_k:.4e} > 1.1 x simulator's {e_s:.4e} + 1e-4 {case}"
    return err


def _check_lse(got, ref, case):
    fin = np.isfinite(ref)
    assert np.array_equal(np.isfinite(got), fin), f"LSE -inf pattern differs {case}"
    d = np.abs(got[fin] - ref[fin])
    if d.size:
        assert d.max() < 1e-3, f"LSE vs simulator: max {d.max():.2e} {case}"


CASES = [
    # B, Hq, Hkv, Nq, Nk, D, causal, layout, dtype
    (1, 2, 2, 128, 128, 128, False, "HND", "float16"),
    (1, 2, 2, 128, 128, 64, True, "HND", "bfloat16"),
    (2, 4, 2, 113, 239, 64, False, "NHD", "float16"),
    (1, 4, 1, 239, 113, 128, True, "HND", "bfloat16"),
    (1, 2, 2, 1, 17, 128, False, "HND", "float16"),
    (1, 2, 2, 17, 1, 64, True, "NHD", "bfloat16"),
    (1, 2, 1, 1000, 1000, 128, True, "NHD", "float16"),
    (1, 2, 2, 300, 1000, 64, True, "HND", "bfloat16"),
    (1, 1, 1, 4224, 4224, 128, True, "HND", "float16"),
]
IDS = [f"{c[3]}x{c[4]}-d{c[5]}-{'causal' if c[6] else 'full'}-{c[7]}-{c[8]}-gqa{c[1] // c[2]}" for c in CASES]
NV_CONFIGS = {
    "two-level": NVFP4Config(),
    "single-level": NVFP4Config(two_level_p=False),
    "no-smoothing": NVFP4Config(k_smoothing=False),
}


# ------------------------------------------------------------------------------------------------- NVFP4


def _nvfp4_case(B, Hq, Hkv, Nq, Nk, D, causal, layout, dtype, cfg, seed=0, sigma=1.0):
    from sagecupy import nvfp4

    case = dict(B=B, Hq=Hq, Hkv=Hkv, Nq=Nq, Nk=Nk, D=D, causal=causal, layout=layout, dtype=dtype, cfg=cfg)
    (q, k, v, _), (qh, kh, vh, _) = _inputs(seed, B, Hq, Hkv, Nq, Nk, D, layout, dtype, sigma)
    before = [_raw(x).copy() for x in (q, k, v)]
    o, lse = nvfp4.attention(q, k, v, causal=causal, layout=layout, config=cfg, return_lse=True)
    o_sim, lse_sim, inter = ref_nv.forward(qh, kh, vh, causal=causal, layout=layout, config=cfg,
                                           return_intermediates=True)
    o_ex, _ = ref_attn.attention_forward(qh, kh, vh, causal=causal, layout=layout)
    amb = _ambiguous_rows(inter["S"], cfg.two_level_p)
    err = _check("O", _host(o), o_sim, o_ex, dtype, case, ambiguous=amb, layout=layout)
    _check_lse(lse.get().astype(np.float64), lse_sim, case)
    for x, x0 in zip((q, k, v), before):
        assert bool((_raw(x) == x0).all()), f"an input was modified {case}"
    return err


@pytest.mark.parametrize("B,Hq,Hkv,Nq,Nk,D,causal,layout,dtype", CASES, ids=IDS)
def test_nvfp4_vs_references(B, Hq, Hkv, Nq, Nk, D, causal, layout, dtype, engine):
    _nvfp4_case(B, Hq, Hkv, Nq, Nk, D, causal, layout, dtype, NVFP4Config())


@pytest.mark.parametrize("name", list(NV_CONFIGS))
@pytest.mark.parametrize("sigma", [1.0, 5.0])
def test_nvfp4_configs(name, sigma, engine):
    _nvfp4_case(1, 2, 2, 300, 300, 128, False, "HND", "float16", NV_CONFIGS[name], seed=4, sigma=sigma)
    _nvfp4_case(1, 2, 1, 200, 333, 64, True, "NHD", "bfloat16", NV_CONFIGS[name], seed=5, sigma=sigma)


def test_nvfp4_packed_entry_matches_and_is_small(engine):
    """attention_packed on quantize_inputs' output is the same kernel call (bitwise); the packed operands
    take at most 0.3x the bytes of fp16 (4.5 bits per value)."""
    cp = _cp()
    from sagecupy import nvfp4

    (q, k, v, _), _ = _inputs(11, 1, 4, 2, 257, 300, 128, "HND", "float16")
    o, lse = nvfp4.attention(q, k, v, causal=True, return_lse=True)
    ops = nvfp4.quantize_inputs(q, k, v)
    mu = cp.repeat(ops["mu_k"], 2, axis=1)
    qmk = (cp.einsum("bhnd,bhd->bhn", q.astype(cp.float32), mu) / np.sqrt(128)).astype(cp.float32)
    o2, lse2 = nvfp4.attention_packed(ops, causal=True, return_lse=True, lse_offset=qmk)
    assert bool((o == o2).all())
    assert float(cp.abs(lse - lse2).max()) < 1e-5  # qmk computed twice, same formula
    packed = sum(ops[f"{n}_{w}"].nbytes for n in "qkv" for w in ("packed", "scales"))
    fp16 = 2 * (q.size + k.size + v.size)
    assert packed <= 0.3 * fp16, f"packed {packed} B vs fp16 {fp16} B"


def test_nvfp4_fully_masked_rows(engine):
    from sagecupy import nvfp4

    (q, k, v, _), _ = _inputs(5, 1, 2, 2, 70, 20, 64, "HND", "float16")
    o, lse = nvfp4.attention(q, k, v, causal=True, return_lse=True)
    o_h, lse_h = _host(o), lse.get()
    assert np.all(o_h[:, :, :50] == 0) and np.all(np.isneginf(lse_h[:, :, :50]))
    assert np.isfinite(o_h).all()


def test_nvfp4_nan_input_reaches_output(engine):
    from sagecupy import nvfp4

    (q, k, v, _), _ = _inputs(6, 1, 1, 1, 64, 64, 64, "HND", "float16")
    vv = _raw(v).copy()
    vv[0, 0, 5, 3] = np.nan
    o = nvfp4.attention(q, k, vv)
    assert bool(_cp().isnan(o[0, 0, :, 3]).all())  # every row averages token 5's block


# --------------------------------------------------------------------------------------------------- QAT


def _fq_host(x):
    """A residual fq tensor (fp16, or bf16 bits as uint16) -> float64 on the host."""
    a = x.get()
    if a.dtype == np.uint16:
        return (a.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    return a.astype(np.float64)


def _qat_fwd_case(B, Hq, Hkv, Nq, Nk, D, causal, layout, dtype, seed=0, sigma=1.0):
    from sagecupy import qat

    case = dict(B=B, Hq=Hq, Hkv=Hkv, Nq=Nq, Nk=Nk, D=D, causal=causal, layout=layout, dtype=dtype)
    (q, k, v, do), (qh, kh, vh, doh) = _inputs(seed, B, Hq, Hkv, Nq, Nk, D, layout, dtype, sigma)
    before = [_raw(x).copy() for x in (q, k, v)]
    o, lse, res = qat.forward(q, k, v, causal=causal, layout=layout, return_lse=True)
    o_sim, r_sim, inter = ref_qat.forward(qh, kh, vh, causal=causal, layout=layout, return_intermediates=True)
    o_ex, _ = ref_attn.attention_forward(qh, kh, vh, causal=causal, layout=layout)
    amb = _ambiguous_rows(inter["S"], True)
    _check("O", _host(o), o_sim, o_ex, dtype, case, ambiguous=amb, layout=layout)
    _check_lse(lse.get().astype(np.float64), r_sim["lse"], case)
    # O' (fp32, P rounded to fp16 as the mma operand): against the simulator's P V~.
    op = res.o_prime.get()[:, :, :Nq].astype(np.float64)
    _check("O'", op, r_sim["o_prime"], None, "float16", case)
    # the saved fake-quantized operands are exactly the reference's, in the backward's operand type (bf16 bits
    # written by the fake-quantization kernels beside the forward's fp16 operands, for bf16 inputs)
    want_t = np.uint16 if dtype == "bfloat16" else np.float16
    assert all(x.dtype == want_t for x in (res.q_t, res.k_t, res.vt_t)), case
    q_t = _fq_host(res.q_t)[:, :, :Nq]
    k_t = _fq_host(res.k_t)[:, :, :Nk]
    v_t = np.swapaxes(_fq_host(res.vt_t)[..., :Nk], -1, -2)
    np.testing.assert_array_equal(q_t, r_sim["q_t"])
    np.testing.assert_array_equal(k_t, r_sim["k_t"])
    np.testing.assert_array_equal(v_t, r_sim["v_t"])
    for x, x0 in zip((q, k, v), before):
        assert bool((_raw(x) == x0).all()), f"an input was modified {case}"
    return (q, k, v, do), (qh, kh, vh, doh), o, res, r_sim, case


@pytest.mark.parametrize("B,Hq,Hkv,Nq,Nk,D,causal,layout,dtype", CASES, ids=IDS)
def test_qat_forward_vs_reference(B, Hq, Hkv, Nq, Nk, D, causal, layout, dtype, engine):
    _qat_fwd_case(B, Hq, Hkv, Nq, Nk, D, causal, layout, dtype)


# Gradients against the reference QAT pipeline: relative L2 <= 2e-3 (the bound) plus the output
# format's rounding of the reference gradient. The kernel rounds P_q and dS to fp16/bf16 as mma operands
# (FlashAttention's practice); the reference keeps float64.
TOL_GRAD = 2e-3


@pytest.mark.parametrize("B,Hq,Hkv,Nq,Nk,D,causal,layout,dtype", CASES, ids=IDS)
def test_qat_backward_vs_reference(B, Hq, Hkv, Nq, Nk, D, causal, layout, dtype, engine):
    from sagecupy import qat

    (q, k, v, do), (qh, kh, vh, doh), o, res, r_sim, case = _qat_fwd_case(B, Hq, Hkv, Nq, Nk, D, causal, layout, dtype)
    # Query rows whose P quantization is ambiguous in fp32 (see _ambiguous_rows) get dO = 0 on both sides, so
    # that they contribute nothing to any gradient; every other row is compared tightly.
    _, _, inter = ref_qat.forward(qh, kh, vh, causal=causal, layout=layout, return_intermediates=True)
    amb = _ambiguous_rows(inter["S"], True)
    if amb.any():
        keep = ref_attn.from_hnd((~amb)[..., None].astype(np.float64), layout)
        doh = doh * keep
        do = _to_dev(doh, dtype)
    before = _raw(do).copy()
    dq, dk, dv = qat.backward(res, do)
    g_sim = ref_qat.backward(r_sim, doh)
    o_ex, lse_ex = ref_attn.attention_forward(qh, kh, vh, causal=causal, layout=layout)
    g_ex = ref_attn.attention_backward(qh, kh, vh, o_ex, lse_ex, doh, causal=causal, layout=layout)
    for name, got, sim, ex in zip(("dQ", "dK", "dV"), (dq, dk, dv), g_sim, g_ex):
        if not np.any(sim):
            assert np.abs(_host(got)).max() < 1e-3, f"{name}: reference gradient is 0 {case}"
            continue
        _check(name, _host(got), sim, ex, dtype, case, tol=TOL_GRAD)
    assert bool((_raw(do) == before).all()), "do was modified"


@pytest.mark.parametrize("sigma", [5.0, 10.0])
def test_qat_forward_large_logit_spread(sigma, engine):
    """SPEC §7's larger sigmas: tile row maxima spread over tens of log2 units, so the wgmma forward's O changes
    frame by large factors on most tiles (kernels_cu/qat_attn_fwd_sm90.cu); against the simulator as above."""
    _qat_fwd_case(1, 2, 1, 300, 517, 128, False, "HND", "bfloat16", seed=31, sigma=sigma)
    _qat_fwd_case(1, 2, 2, 517, 300, 64, True, "NHD", "float16", seed=32, sigma=sigma)


def test_qat_forward_tile_far_below_the_row_max(engine):
    """Row 0 sees one key (tile 0) ~92 (log2) above every other: the wgmma forward skips tile 1 for O (weights
    below 2^-60 of the largest) and keeps it for the row sum and O'; row 1 also sees a tile-1 key 40 below its
    max (taken: a 2^40 frame change); row 2 sees flat logits. Against the simulator."""
    from sagecupy import qat

    rng = np.random.default_rng(41)
    q = np.zeros((1, 1, 3, 64))
    k = rng.standard_normal((1, 1, 128, 64)) * 0.01
    v = rng.standard_normal((1, 1, 128, 64))
    k[0, 0, 5, 0] = 32.0   # tile 0; sm_scale = 1/8: logit 16 * 32 / 8 = 64 (natural) = 92 (log2)
    k[0, 0, 70, 1] = 18.0  # tile 1: 16 * 18 / 8 = 36 (natural) = 52 (log2) for a query with q[1] = 16
    q[0, 0, 0, 0] = 16.0
    q[0, 0, 1, 0] = q[0, 0, 1, 1] = 16.0
    qd, kd, vd = (_to_dev(x, "float16") for x in (q, k, v))
    qh, kh, vh = (_host(x) for x in (qd, kd, vd))
    case = dict(test="tile far below the row max", engine=engine)
    o, lse, res = qat.forward(qd, kd, vd, return_lse=True)
    o_sim, r_sim = ref_qat.forward(qh, kh, vh)
    o_ex, _ = ref_attn.attention_forward(qh, kh, vh)
    _check("O", _host(o), o_sim, o_ex, "float16", case)
    _check("O'", res.o_prime.get()[:, :, :3].astype(np.float64), r_sim["o_prime"], None, "float16", case)
    _check_lse(lse.get().astype(np.float64), r_sim["lse"], case)


@pytest.mark.parametrize("D", [128, 64])
def test_qat_ctas_that_see_no_key(engine, D):
    """Causal with Nq - Nk = 610: whole 128-row CTAs of the QAT forward visit no key tile; against the simulator,
    those rows exact zeros with LSE -inf, and their gradients zero."""
    from sagecupy import qat

    (q, k, v, do), _, o, res, _, _ = _qat_fwd_case(1, 2, 1, 700, 90, D, True, "HND", "bfloat16", seed=21)
    _, lse, _ = qat.forward(q, k, v, causal=True, return_lse=True)
    assert np.all(_host(o)[:, :, :610] == 0) and np.all(np.isneginf(lse.get()[:, :, :610]))
    dq, dk, dv = qat.backward(res, do)
    assert np.all(_host(dq)[:, :, :610] == 0)
    for x in (dq, dk, dv):
        assert np.isfinite(_host(x)).all()


def test_qat_delta_must_come_from_o_prime(engine):
    """SPEC §6: delta = rowsum(dO o O'). The same kernel fed O instead of O' gives a dQ that is measurably
    wrong against the reference gradient, while the correct one matches it."""
    import dataclasses

    cp = _cp()
    from sagecupy import qat

    (q, k, v, do), (qh, kh, vh, doh) = _inputs(21, 1, 2, 2, 256, 256, 64, "HND", "float16", sigma=2.0)
    o, res = qat.forward(q, k, v)
    _, r_sim = ref_qat.forward(qh, kh, vh)
    dq_ref = ref_qat.backward(r_sim, doh)[0]
    dq_ok = _host(qat.backward(res, do)[0])
    o_pad = cp.zeros_like(res.o_prime)
    o_pad[:, :, :256] = o.astype(cp.float32)
    dq_bad = _host(qat.backward(dataclasses.replace(res, o_prime=o_pad), do)[0])
    e_ok, e_bad = metrics.rel_l2(dq_ok, dq_ref), metrics.rel_l2(dq_bad, dq_ref)
    assert e_ok <= TOL_GRAD and e_bad > 10 * e_ok, f"dQ error: delta from O' {e_ok:.2e}, from O {e_bad:.2e}"


@pytest.mark.parametrize("causal", [False, True])
def test_qat_backward_is_bitwise_repeatable(causal, engine):
    """No atomics (dQ has its own kernel, summed in registers in key order): two runs agree bit for bit, with
    many key blocks per query (Nk = 517) and GQA."""
    from sagecupy import qat

    (q, k, v, do), _ = _inputs(13, 1, 4, 2, 300, 517, 128, "HND", "bfloat16")
    _, res = qat.forward(q, k, v, causal=causal)
    a = [_host(x) for x in qat.backward(res, do)]
    b = [_host(x) for x in qat.backward(res, do)]
    for name, x, y in zip(("dQ", "dK", "dV"), a, b):
        assert np.array_equal(x.view(np.uint8), y.view(np.uint8)), f"{name} differs between two runs"


def test_qat_fully_masked_rows_have_zero_gradients(engine):
    from sagecupy import qat

    (q, k, v, do), _ = _inputs(5, 1, 2, 2, 70, 20, 64, "HND", "float16")
    o, lse, res = qat.forward(q, k, v, causal=True, return_lse=True)
    dq, dk, dv = qat.backward(res, do)
    assert np.all(_host(o)[:, :, :50] == 0) and np.all(np.isneginf(lse.get()[:, :, :50]))
    assert np.all(_host(dq)[:, :, :50] == 0)
    for x in (dq, dk, dv):
        assert np.isfinite(_host(x)).all()


# ----------------------------------------------------------------------------------------- shared checks


def test_poisoned_outputs_are_overwritten(monkeypatch, engine):
    cp = _cp()
    from sagecupy import nvfp4, qat

    real_empty = cp.empty

    def nan_empty(shape, dtype=float, order="C"):
        out = real_empty(shape, dtype=dtype, order=order)
        if cp.dtype(dtype).kind == "f":
            out.fill(float("nan"))
        elif cp.dtype(dtype) == cp.uint16:
            out.fill(0x7FC0)
        return out

    monkeypatch.setattr(cp, "empty", nan_empty)
    for dtype in ("float16", "bfloat16"):
        (q, k, v, do), _ = _inputs(7, 1, 2, 1, 200, 77, 128, "HND", dtype)
        o, lse = nvfp4.attention(q, k, v, causal=True, return_lse=True)
        o2, lse2, res = qat.forward(q, k, v, causal=True, return_lse=True)
        outs = [("nvfp4 o", o), ("nvfp4 lse", lse), ("qat o", o2), ("qat lse", lse2),
                ("qat o'", res.o_prime[:, :, :200])]
        if hasattr(qat, "backward"):
            try:
                outs += list(zip(("dq", "dk", "dv"), qat.backward(res, do)))
            except ImportError:
                pass
        for name, x in outs:
            assert not bool(cp.isnan(_f32(x)).any()), f"{name} ({dtype}) has unwritten (NaN) elements"


def test_error_paths():
    cp = _cp()
    from sagecupy import nvfp4, qat

    (q, k, v, _), _ = _inputs(1, 1, 2, 2, 32, 32, 64, "HND", "float16")
    with pytest.raises(TypeError, match="config"):
        nvfp4.attention(q, k, v, config=QATConfig())
    with pytest.raises(ValueError, match="engine"):
        nvfp4.attention(q, k, v, engine="tensor")
    assert nvfp4.is_supported(q, k, v, engine="tensor")[0] is False
    with pytest.raises(TypeError, match="config"):
        qat.forward(q, k, v, config=NVFP4Config())
    for bad, what in ((NVFP4Config(q_smoothing=True), "q_smoothing"), (NVFP4Config(tensor_scale=True), "tensor_scale"),
                      (NVFP4Config(block_kv=128), "block_kv"), (NVFP4Config(quantize=False), "quantize")):
        with pytest.raises(ValueError, match=what):
            nvfp4.attention(q, k, v, config=bad)
        ok, why = nvfp4.is_supported(q, k, v, config=bad)
        assert not ok and what in why
    with pytest.raises(ValueError, match="two_level_p"):
        qat.forward(q, k, v, config=QATConfig(two_level_p=False))
    with pytest.raises(TypeError, match="dtype"):
        nvfp4.attention(q.astype(cp.float32), k, v)
    with pytest.raises(ValueError, match="head_dim"):
        qat.forward(q[..., :48], k[..., :48], v[..., :48])
    with pytest.raises(TypeError, match="q"):
        nvfp4.attention(np.zeros((1, 2, 32, 64), np.float16), k, v)
    assert nvfp4.is_supported(q, k, v) == (True, "")
    assert qat.is_supported(q, k, v) == (True, "")
    ops = nvfp4.quantize_inputs(q, k, v)
    with pytest.raises(ValueError, match="missing"):
        nvfp4.attention_packed({"q_packed": ops["q_packed"]})
    bad = dict(ops, v_scales=ops["v_scales"][..., :1])
    with pytest.raises(ValueError, match="v_scales"):
        nvfp4.attention_packed(bad)
    with pytest.raises(TypeError, match="uint8"):
        nvfp4.attention_packed(dict(ops, k_scales=ops["k_scales"].astype(cp.int32)))


@pytest.mark.parametrize("D", [128, 64])
def test_cta_size_does_not_change_the_result(monkeypatch, engine, D):
    """4- and 8-warp CTAs (SAGECUPY_FP4_WARPS) compute every row the same way: bitwise equal outputs (the wgmma
    kernel at D=64 with 8 warps leaves half its threads without a dequantization task). The wgmma QAT forward has
    one CTA size (the variable does not reach it), so its half of the comparison is trivially equal there."""
    cp = _cp()
    from sagecupy import nvfp4, qat

    (q, k, v, do), _ = _inputs(13, 1, 4, 2, 300, 200, D, "NHD", "bfloat16")
    out = {}
    for w in ("4", "8"):
        monkeypatch.setenv("SAGECUPY_FP4_WARPS", w)
        o1, lse1 = nvfp4.attention(q, k, v, causal=True, layout="NHD", return_lse=True)
        o2, lse2, res = qat.forward(q, k, v, causal=True, layout="NHD", return_lse=True)
        out[w] = [_raw(o1), lse1, _raw(o2), lse2, res.o_prime[:, :, :300]]
    for a, b in zip(out["4"], out["8"]):
        assert bool(cp.all((a == b) | (cp.isnan(a) & cp.isnan(b))))


@pytest.mark.parametrize("D", [128, 64])
def test_nvfp4_ctas_that_see_no_key(engine, D):
    """Causal with Nq - Nk = 610: whole CTAs (64 or 128 rows) visit no key tile (the wgmma kernel's prologue and
    loop run zero times); against the simulator, and those rows are exact zeros with LSE -inf."""
    from sagecupy import nvfp4

    _nvfp4_case(1, 2, 1, 700, 90, D, True, "HND", "bfloat16", NVFP4Config(), seed=21)
    (q, k, v, _), _ = _inputs(21, 1, 2, 1, 700, 90, D, "HND", "bfloat16")
    o, lse = nvfp4.attention(q, k, v, causal=True, return_lse=True)
    o_h, lse_h = _host(o), lse.get()
    assert np.all(o_h[:, :, :610] == 0) and np.all(np.isneginf(lse_h[:, :, :610]))


def test_nvfp4_wgmma_pingpong_does_not_change_the_result(monkeypatch):
    """The warpgroup ping-pong (8 warps, D=128) only orders when each warpgroup issues its products: bitwise the
    same output with it compiled out (SAGE_FP4_PINGPONG=0), causal and not, several tile counts."""
    from sagecupy._loader import device_capability

    if device_capability() != (9, 0):
        pytest.skip("the wgmma NVFP4 forward needs compute capability 9.0")
    monkeypatch.setenv("SAGECUPY_FP4_WARPS", "8")  # (the default at D=128 is 12 warps: SAGE_FP4_PINGPONG3)
    _pingpong_is_bitwise_neutral(monkeypatch, "SAGE_FP4_PINGPONG",
                                 ((300, 517, False), (517, 300, True), (128, 64, False), (200, 130, True)))


def _pingpong_is_bitwise_neutral(monkeypatch, define, shapes):
    """The wgmma NVFP4 forward (D=128) with ``define``=1 and =0 (SAGECUPY_DEFINES): bitwise equal O and LSE."""
    from sagecupy import _checks, nvfp4

    cp = _cp()
    for nq, nk, causal in shapes:
        (q, k, v, _), _ = _inputs(23, 1, 2, 1, nq, nk, 128, "HND", "float16")
        ops = nvfp4.quantize_inputs(q, k, v)
        got = {}
        for flag in ("1", "0"):
            monkeypatch.setenv("SAGECUPY_DEFINES", f"{define}={flag}")
            o, lse = nvfp4.attention_packed(ops, causal=causal, return_lse=True, engine="wgmma")
            got[flag] = (_checks.raw(o), lse)
        assert bool((got["1"][0] == got["0"][0]).all()) and bool(cp.array_equal(got["1"][1], got["0"][1])), (
            define, nq, nk, causal)


@pytest.mark.parametrize("warps", ["4", "8", "12"])
def test_nvfp4_wgmma_o_frame(monkeypatch, warps):
    """O accumulated in the frame of its last tile (fp4_frame_step; always on with 12 warps, the default at
    D=128, and SAGE_FP4_OFRAME=1 for 4 and 8) against the simulator on odd shapes, and the 12-warp ping-pong
    (SAGE_FP4_PINGPONG3: three warpgroups taking turns, off by default) bitwise equal to no ping-pong."""
    from sagecupy._loader import device_capability

    if device_capability() != (9, 0):
        pytest.skip("the wgmma NVFP4 forward needs compute capability 9.0")
    monkeypatch.setenv("SAGECUPY_FP4_ENGINE", "wgmma")
    monkeypatch.setenv("SAGECUPY_FP4_WARPS", warps)
    monkeypatch.setenv("SAGECUPY_DEFINES", "SAGE_FP4_OFRAME=1")
    for c in (CASES[1], CASES[3], CASES[6], CASES[7], CASES[8]):
        _nvfp4_case(*c, NVFP4Config())
    _nvfp4_case(1, 2, 1, 700, 90, 128, True, "HND", "bfloat16", NVFP4Config(), seed=21)
    _nvfp4_case(1, 2, 2, 300, 1000, 128, False, "HND", "float16", NVFP4Config(two_level_p=False), seed=3, sigma=5.0)
    if warps == "12":
        _pingpong_is_bitwise_neutral(monkeypatch, "SAGE_FP4_PINGPONG3", ((300, 517, False), (517, 300, True),
                                                                          (200, 130, True)))


@pytest.mark.parametrize("nc", ["2", "3"])
def test_nvfp4_warp_specialized_kernel(monkeypatch, nc):
    """The warp-specialized wgmma forward (SAGECUPY_FP4_WS=2|3: one warpgroup dequantizes, 2 or 3 multiply, 64 rows
    each) against the simulator on odd shapes (GQA, Nq != Nk, causal, rows and keys not multiples of a tile, whole
    CTAs that see no key, single-level P), and against the 12-warp kernel. Built with SAGE_FP4_TBLK=0 it is bitwise
    equal to it: the same per-tile softmax, the same frame rule for O and the same wgmma shapes in the same order,
    so nothing but the CTA's split of the rows differs. By default (thread-owned P blocks) each tile's keys are
    stored in another order: every element of P^ is the same number, but the P.V products and the row sums add the
    keys in another order. The LSE (row sums in fp32) stays within 1e-5. O: the tensor cores add a k16 step's 16
    products aligned to the largest one, dropping low bits, and a step now spans four 16-key blocks of P (scales
    up to 2^11 apart) instead of one, so small products lose more: relative L2 1.6e-4 against the 12-warp kernel
    at 4K with bf16 output (bench/results/session27/floor2.txt, SAGE_FP4_TBLK=0 row). The bound here, 5e-4 on fp16
    output, is that with room; a wrong key order (a V^ column against the wrong P^ element) moves O by ~1/32 or
    more."""
    from sagecupy import _checks, nvfp4
    from sagecupy._loader import device_capability

    if device_capability() != (9, 0):
        pytest.skip("the wgmma NVFP4 forward needs compute capability 9.0")
    cp = _cp()
    monkeypatch.setenv("SAGECUPY_FP4_ENGINE", "wgmma")
    monkeypatch.setenv("SAGECUPY_FP4_WS", nc)
    # (the whole items' kernel: the bitwise comparison below is of the kernels' row split, not of a key split)
    monkeypatch.setenv("SAGECUPY_FP4_TAIL_SPLIT", "0")
    assert nvfp4.fp4_ws("wgmma", 128) == int(nc) and not nvfp4.fp4_ws("wgmma", 64)
    for c in CASES:
        if c[5] == 128:
            _nvfp4_case(*c, NVFP4Config())
    _nvfp4_case(1, 2, 1, 700, 90, 128, True, "HND", "bfloat16", NVFP4Config(), seed=21)
    _nvfp4_case(1, 2, 2, 300, 1000, 128, False, "HND", "float16", NVFP4Config(two_level_p=False), seed=3, sigma=5.0)
    for nq, nk, causal in ((300, 517, False), (517, 300, True), (128, 64, False), (200, 130, True), (1000, 1000, True)):
        (q, k, v, _), _ = _inputs(29, 2, 4, 2, nq, nk, 128, "HND", "bfloat16")
        ops = nvfp4.quantize_inputs(q, k, v)
        got = {}
        for ws, defines in ((nc, "SAGE_FP4_TBLK=0"), (nc, ""), ("0", "")):
            monkeypatch.setenv("SAGECUPY_FP4_WS", ws)
            monkeypatch.setenv("SAGECUPY_DEFINES", defines)
            o, lse = nvfp4.attention_packed(ops, causal=causal, return_lse=True, out_dtype="float16")
            got[ws, defines] = (_checks.raw(o).astype(cp.float32), lse)
        monkeypatch.delenv("SAGECUPY_DEFINES")
        ref_o, ref_lse = got["0", ""]
        o0, lse0 = got[nc, "SAGE_FP4_TBLK=0"]
        assert bool((o0 == ref_o).all()) and bool(cp.array_equal(lse0, ref_lse)), (nq, nk, causal)
        o1, lse1 = got[nc, ""]
        rel = float(cp.linalg.norm(o1 - ref_o) / cp.linalg.norm(ref_o))
        fin = cp.isfinite(ref_lse)
        assert bool(cp.array_equal(cp.isfinite(lse1), fin)), (nq, nk, causal)
        dl = float(cp.abs(lse1[fin] - ref_lse[fin]).max()) if bool(fin.any()) else 0.0
        assert rel <= 5e-4 and dl <= 1e-5, (nq, nk, causal, rel, dl)


def test_misaligned_packed_operands_and_bad_arguments(engine):
    """Exchange-format arrays that start at an odd address (a slice of a byte pool) are copied, not
    handed to the 8-byte copies of the kernel; fake_quantize refuses a padding that would not fit."""
    cp = _cp()
    from sagecupy import nvfp4, qat

    (q, k, v, _), _ = _inputs(17, 1, 2, 1, 40, 70, 64, "HND", "float16")
    ops = nvfp4.quantize_inputs(q, k, v)
    want = nvfp4.attention_packed(ops)
    odd = {}
    for key in ("q_packed", "q_scales", "k_packed", "k_scales", "v_packed", "v_scales"):
        pool = cp.zeros(ops[key].size + 1, dtype=cp.uint8)
        pool[1:] = ops[key].ravel()
        odd[key] = pool[1:].reshape(ops[key].shape)
    assert odd["k_packed"].data.ptr % 16
    got = nvfp4.attention_packed(odd)
    assert bool((got == want).all())
    with pytest.raises(ValueError, match="n_pad"):
        qat.fake_quantize(q, n_pad=32)             # N = 40 rows do not fit
    with pytest.raises(ValueError, match="n_pad"):
        qat.fake_quantize(v, along="tokens", n_pad=76)  # not a multiple of 8
    bad = dict(ops, k_packed=ops["k_packed"][:, :0], k_scales=ops["k_scales"][:, :0])
    with pytest.raises(ValueError):
        nvfp4.attention_packed(bad)


def test_nan_in_v_leaves_rows_that_see_no_key_zero(engine):
    from sagecupy import nvfp4, qat

    (q, k, v, _), _ = _inputs(19, 1, 1, 1, 70, 20, 64, "HND", "float16")
    vv = _raw(v).copy()
    vv[0, 0, 3, 5] = np.nan
    for o in (nvfp4.attention(q, k, vv, causal=True), qat.forward(q, k, vv, causal=True)[0]):
        o_h = _host(o)
        assert np.all(o_h[0, 0, :50] == 0)          # rows 0..49 see no key (Nq - Nk = 50)
        assert np.isnan(o_h[0, 0, 53:, 5]).all()    # rows that see token 3


@pytest.mark.parametrize("prepass, persist", [("split", "0"), ("fused", "0"), ("pipe", "0"), ("split", "1"),
                                              ("split", "qin"), ("pipe", "qin")])
@pytest.mark.parametrize("engine_name", ["mma", "wgmma"])
def test_nvfp4_back_to_back_calls_match_separate_calls(monkeypatch, engine_name, prepass, persist):
    """nvfp4.attention replays one recorded program per signature, and on sm_90 its quantizers and kernel are
    programmatic dependents (each may start while the launch before it drains; each calls grid_dep_wait() before
    touching global memory). Calls issued back to back, without a synchronization, on inputs of the same signature
    (the same scratch buffers) must give bitwise what each gives alone: a kernel that read or wrote a buffer before
    its predecessor finished would mix two calls' operands."""
    from sagecupy import nvfp4
    from sagecupy._loader import device_capability

    if engine_name == "wgmma" and device_capability() != (9, 0):
        pytest.skip("the wgmma kernels need compute capability 9.0")
    cp = _cp()
    monkeypatch.setenv("SAGECUPY_FP4_ENGINE", engine_name)
    monkeypatch.setenv("SAGECUPY_FP4_PREPASS", prepass)
    # (the K/V images, the default, take the split pre-pass's mean and replace K's and V's quantizers: the fused and
    # pipelined pre-passes only run without them)
    monkeypatch.setenv("SAGECUPY_FP4_KVIMG", "1" if prepass == "split" else "0")
    # (the persistent kernel, or Q quantized in the warp-specialized kernel: wgmma engine only)
    monkeypatch.setenv("SAGECUPY_FP4_PERSIST", "1" if persist == "1" else "0")
    monkeypatch.setenv("SAGECUPY_FP4_QIN", "1" if persist == "qin" else "0")
    for causal, (nq, nk) in ((False, (1000, 1000)), (True, (700, 300))):
        ins = [_inputs(40 + i, 2, 4, 2, nq, nk, 128, "HND", "bfloat16")[0][:3] for i in range(3)]
        alone = []
        for q, k, v in ins:
            o, lse = nvfp4.attention(q, k, v, causal=causal, return_lse=True)
            cp.cuda.Device().synchronize()
            alone.append((_host(o), _host(lse)))
        outs = [nvfp4.attention(q, k, v, causal=causal, return_lse=True) for q, k, v in ins]  # no sync between
        cp.cuda.Device().synchronize()
        for i, ((o, lse), (o1, lse1)) in enumerate(zip(outs, alone)):
            assert np.array_equal(_host(o), o1, equal_nan=True), f"O of call {i} (causal={causal})"
            assert np.array_equal(_host(lse), lse1, equal_nan=True), f"LSE of call {i} (causal={causal})"


@pytest.mark.parametrize("shape", [(1, 2, 2, 128, 128, 128, "HND", "bfloat16"),
                                   (2, 4, 2, 1000, 1000, 128, "NHD", "float16"),
                                   (1, 3, 1, 70, 333, 64, "HND", "bfloat16"),
                                   (2, 2, 1, 4224, 4100, 128, "HND", "bfloat16"),
                                   (1, 2, 2, 300, 17, 64, "NHD", "float16")])
def test_nvfp4_fused_prepass_matches_split(monkeypatch, shape):
    """SAGECUPY_FP4_PREPASS=fused (V's quantizer with K's column sums per 64-token tile, K's mean, Q's and K's
    quantizers in one launch) gives bitwise the split pre-pass's O and LSE: the same codes, scales and qmk, and a
    mean summed over other chunks that is the same float64 sum for these inputs (K's values span a few binades).
    So does SAGECUPY_FP4_PREPASS=pipe (the same launches with CTAs that walk one flat list of tiles / row chunks over
    all heads, loading the next while quantizing the current), with its default grid and with one SM's worth of
    CTAs (4 and 3 CTAs then walk every piece: up to 33 tiles and 132 chunks each here, across heads, batches and
    from Q's chunks to K's). Odd key counts (a partial last tile, N16 > N), Nq != Nk both ways, GQA, both layouts,
    D 64 and 128, causal and not."""
    from sagecupy import nvfp4

    B, Hq, Hkv, nq, nk, D, layout, dtype = shape
    (q, k, v, _), _ = _inputs(7, B, Hq, Hkv, nq, nk, D, layout, dtype)
    for causal in (False, True):
        got = {}
        for mode, sms in (("split", None), ("fused", None), ("pipe", None), ("pipe", 1)):
            monkeypatch.setenv("SAGECUPY_FP4_PREPASS", mode)
            # (K's and V's quantizers, not the K/V images, which replace them; no tail split, whose parts depend on
            # the SM count set below and round O differently)
            monkeypatch.setenv("SAGECUPY_FP4_KVIMG", "0")
            monkeypatch.setenv("SAGECUPY_FP4_TAIL_SPLIT", "0")
            if sms is not None:
                nvfp4._ATTN_PLANS.clear()  # (the plans record their grids)
                monkeypatch.setattr(nvfp4, "_sm_count", lambda device_id: sms)
            o, lse = nvfp4.attention(q, k, v, causal=causal, layout=layout, return_lse=True)
            got[mode, sms] = (_host(o), _host(lse))
            if sms is not None:
                monkeypatch.undo()  # (the environment too: set again on the next pass)
                nvfp4._ATTN_PLANS.clear()
        for key in (("fused", None), ("pipe", None), ("pipe", 1)):
            for name, a, b in zip(("O", "LSE"), got["split", None], got[key]):
                assert np.array_equal(a, b, equal_nan=True), f"{name} of {key} differs (causal={causal})"


@pytest.mark.parametrize("shape", [(1, 2, 2, 128, 128, "HND", "bfloat16"),
                                   (2, 4, 2, 1000, 1000, "NHD", "float16"),
                                   (1, 3, 1, 700, 300, "HND", "bfloat16"),
                                   (2, 2, 1, 4224, 4100, "HND", "bfloat16"),
                                   (1, 2, 2, 64, 2000, "NHD", "float16"),
                                   (1, 1, 1, 1, 1, "HND", "float16")])
def test_nvfp4_q_in_kernel_matches_prepass(monkeypatch, shape):
    """SAGECUPY_FP4_QIN=1 (nvfp4_attn_fwd_ws_qin: the consumer warpgroups quantize their rows of the raw Q into
    shared memory and compute their qmk; the pre-pass quantizes only K and V) gives bitwise the O and LSE of Q's
    pre-pass quantizer and the warp-specialized kernel, with the split, fused and pipelined pre-pass, causal or not,
    with and without K-smoothing (qmk or none). Also: rows with Inf and NaN (their blocks' NaN scale), Q as a strided
    view of a packed QKV tensor (read in place, NHD), and Q at an address that is not 16-byte aligned (copied first).
    Last query blocks with 64 real rows of 192, Nq > Nk causal (rows that see no key), GQA, one row."""
    monkeypatch.setenv("SAGECUPY_FP4_KVIMG", "0")  # (the pre-pass modes: K's and V's quantizers, not the images)
    from sagecupy import nvfp4
    from sagecupy._loader import device_capability

    if device_capability() != (9, 0):
        pytest.skip("the wgmma kernels need compute capability 9.0")
    cp = _cp()
    monkeypatch.setenv("SAGECUPY_FP4_ENGINE", "wgmma")
    B, Hq, Hkv, nq, nk, layout, dtype = shape
    (q, k, v, _), _ = _inputs(13, B, Hq, Hkv, nq, nk, 128, layout, dtype)
    cases = [("plain", q, NVFP4Config()), ("no K-smoothing", q, NVFP4Config(k_smoothing=False))]
    if dtype == "float16":
        qh = cp.asarray(_raw(q))
        bad = qh.copy()
        bad.reshape(-1, 128)[min(3, bad.shape[0] * bad.shape[1] * bad.shape[2] - 1), 5] = np.inf
        bad.reshape(-1, 128)[0, 100] = np.nan
        cases.append(("Inf and NaN", bad, NVFP4Config()))
        if layout == "NHD":  # (B, N, 3, H, D): q = qkv[:, :, 0], rows 3 H D elements apart
            qkv = cp.zeros((B, nq, 3, Hq, 128), cp.float16)
            qkv[:, :, 0] = qh
            cases.append(("QKV view", qkv[:, :, 0], NVFP4Config()))
        flat = cp.zeros(qh.size + 8, cp.float16)
        off = flat[1:1 + qh.size].reshape(qh.shape)  # (2 bytes past a 16-byte boundary)
        off[...] = qh
        cases.append(("misaligned", off, NVFP4Config()))
    for mode in ("split", "fused", "pipe"):
        monkeypatch.setenv("SAGECUPY_FP4_PREPASS", mode)
        for causal in (False, True):
            for what, qq, cfg in cases:
                got = []
                for qin in ("0", "1"):
                    monkeypatch.setenv("SAGECUPY_FP4_QIN", qin)
                    o, lse = nvfp4.attention(qq, k, v, causal=causal, layout=layout, config=cfg, return_lse=True)
                    got.append((_host(o), _host(lse)))
                case = f"({what}, {mode}, causal={causal})"
                for name, a, b in zip(("O", "LSE"), *got):
                    assert np.array_equal(a, b, equal_nan=True), f"{name} differs {case}"
                if what == "Inf and NaN":
                    assert np.isnan(got[1][0]).any(), f"the NaN scale reaches O {case}"


@pytest.mark.parametrize("qin", ["0", "1"])
@pytest.mark.parametrize("shape, sms, nsplit", [((1, 2, 2, 1000, 1000, "HND", "bfloat16"), 5, 2),
                                                ((1, 2, 2, 1000, 1000, "HND", "bfloat16"), 7, 4),
                                                ((2, 4, 2, 4096, 4100, "HND", "bfloat16"), None, 3),
                                                ((1, 3, 1, 700, 600, "NHD", "float16"), 5, 2),
                                                ((1, 2, 2, 64, 2000, "NHD", "float16"), 5, 2),
                                                ((1, 2, 2, 64, 2000, "NHD", "float16"), 6, 3),
                                                ((1, 2, 2, 64, 2000, "NHD", "float16"), 8, 4)])
def test_nvfp4_tail_split_matches_whole_items(monkeypatch, shape, sms, nsplit, qin):
    """SAGECUPY_FP4_TAIL_SPLIT=1 (nvfp4_attn_fwd_ws_split: the items past the grid's last full wave run in 2-4
    parts of their key tiles, combined by the last part per consumer warp) against the same calls without it. With
    two-level P each tile's P^ depends only on its own row maxima, so the parts compute what the whole item does up to
    fp32 rounding of the combination; the output's own rounding can then move an element by one unit in its last
    place (bf16 2^-8, fp16 2^-11 relative), hence rtol of two such units, and the LSE (fp32) within 1e-5. The SM
    count is set small where needed so that these shapes split: 10 whole items and 2 in 2 parts, or 7 and 5 in 4
    parts (1000 x 1000), all items in 2, 3 or 4 parts (64 rows: whole = 0), GQA in 2 parts, the default grid at 4096 x
    4100 (132 whole items, 44 in 3 parts on an H200; a partial last key tile in the last part, last query blocks of 64
    rows). Also NaN in V (the same rows NaN) and attention_packed."""
    from sagecupy import nvfp4
    from sagecupy._loader import device_capability

    if device_capability() != (9, 0):
        pytest.skip("the wgmma kernels need compute capability 9.0")
    cp = _cp()
    monkeypatch.setenv("SAGECUPY_FP4_ENGINE", "wgmma")
    monkeypatch.setenv("SAGECUPY_FP4_QIN", qin)
    if sms is not None:
        monkeypatch.setattr(nvfp4, "_sm_count", lambda device_id: sms)
    B, Hq, Hkv, nq, nk, layout, dtype = shape
    real_sms = cp.cuda.Device().attributes["MultiProcessorCount"]
    plan = nvfp4._tail_split(-(-nq // 192) * Hq * B, sms or real_sms, -(-nk // 64))
    if sms is None and real_sms != 132:
        assert plan is not None, "the shape must split for this test to test anything"
    else:
        assert plan is not None and plan[1] == nsplit, f"the shape must split in {nsplit} parts: {plan}"
    (q, k, v, _), _ = _inputs(17, B, Hq, Hkv, nq, nk, 128, layout, dtype)
    vn = cp.asarray(_raw(v)).copy() if dtype == "float16" else None
    if vn is not None:
        vn.reshape(-1, 128)[5, 7] = np.nan
    rtol = 2.0 ** -7 if dtype == "bfloat16" else 2.0 ** -10
    for what, vv in (("plain", v), ("NaN in V", vn)):
        if vv is None:
            continue
        got = []
        for split in ("0", "1"):
            nvfp4._ATTN_PLANS.clear()
            monkeypatch.setenv("SAGECUPY_FP4_TAIL_SPLIT", split)
            o, lse = nvfp4.attention(q, k, vv, layout=layout, return_lse=True)
            got.append((_host(o), _host(lse)))
        (o0, l0), (o1, l1) = got
        case = f"({what}, whole/nsplit {plan})"
        assert np.array_equal(np.isnan(o0), np.isnan(o1)) and np.array_equal(np.isnan(l0), np.isnan(l1)), case
        ok = ~np.isnan(o0)
        assert np.allclose(o1[ok], o0[ok], rtol=rtol, atol=1e-6), f"O {case}"
        ok = ~np.isnan(l0)
        assert np.allclose(l1[ok], l0[ok], rtol=1e-6, atol=1e-5), f"LSE {case}"
    if layout == "HND":  # attention_packed on the same operands: the split kernel too
        ops = nvfp4.quantize_inputs(q, k, v)
        outs = []
        for split in ("0", "1"):
            monkeypatch.setenv("SAGECUPY_FP4_TAIL_SPLIT", split)
            outs.append(_host(nvfp4.attention_packed(ops, out_dtype=dtype)))
        assert np.allclose(outs[1], outs[0], rtol=rtol, atol=1e-6), "attention_packed"


def _kv_images_all(nvfp4, cp, q, k, v, layout, smooth):
    """The K/V stage images of nvfp4_kv_images_raw (from the raw k, v and quantize_inputs's K mean), of
    nvfp4_kv_images_raw_pipe on 3 CTAs (each walks many images: both V buffers, the register hand-over) and of
    nvfp4_kv_images (from quantize_inputs's packed K and V, V padded to whole 64-token tiles), into buffers first
    filled with 0xAB, 0x5A and 0xCD (so that equal images mean every byte written by each), as uint8 host arrays."""
    ops = nvfp4.quantize_inputs(q, k, v, layout=layout, k_smoothing=smooth)
    kr, vr = cp.asarray(_raw(k)), cp.asarray(_raw(v))
    B, Hkv, nk = ops["k_packed"].shape[:3]
    n16 = (nk + 15) // 16 * 16
    ntile, n64 = (nk + 63) // 64, (n16 + 63) // 64 * 64
    size = B * Hkv * ntile * nvfp4.ws_img_bytes(128)
    names = nvfp4._names("nvfp4/fp4_attn_fwd_sm90.cu")
    axes = (0, 1, 2) if layout == "HND" else (0, 2, 1)  # (element strides of the (b, h, n) axes)
    st = lambda x: tuple(np.int64(x.strides[i] // x.itemsize) for i in axes)  # noqa: E731
    raw = cp.full(size, 0xAB, cp.uint8)
    T = "__half" if kr.dtype == cp.float16 else "__nv_bfloat16"
    fn = nvfp4.get_function("nvfp4/fp4_attn_fwd_sm90.cu", f"nvfp4_kv_images_raw<{T}, 128>", all_names=names, arch="sm_90a")
    fn.max_dynamic_shared_size_bytes = nvfp4.ws_img_raw_smem_bytes(128)
    fn((ntile, Hkv, B), (128,), (kr, *st(kr), ops["mu_k"], vr, *st(vr), np.int32(nk), np.int32(n16), raw),
       shared_mem=nvfp4.ws_img_raw_smem_bytes(128))
    pipe = cp.full(size, 0x5A, cp.uint8)
    fn = nvfp4.get_function("nvfp4/fp4_attn_fwd_sm90.cu", f"nvfp4_kv_images_raw_pipe<{T}, 128>", all_names=names,
                            arch="sm_90a")
    fn.max_dynamic_shared_size_bytes = nvfp4.ws_img_raw_smem_bytes(128, True)
    fn((3,), (128,), (kr, *st(kr), ops["mu_k"], vr, *st(vr), np.int32(nk), np.int32(n16), np.int32(Hkv),
                      np.int32(ntile), np.int32(B * Hkv * ntile), pipe), shared_mem=nvfp4.ws_img_raw_smem_bytes(128, True))
    packed = cp.full(size, 0xCD, cp.uint8)
    vc, vs = nvfp4._pad_tokens64(ops["v_packed"], ops["v_scales"], n16)
    fn = nvfp4.get_function("nvfp4/fp4_attn_fwd_sm90.cu", "nvfp4_kv_images<128>", all_names=names, arch="sm_90a")
    fn((ntile, Hkv, B), (128,), (ops["k_packed"], ops["k_scales"], vc, vs, np.int32(n64 // 2), np.int32(nk),
                                 np.int32(n16), packed))
    return raw.get(), pipe.get(), packed.get()


@pytest.mark.parametrize("shape", [(1, 2, 2, 1000, 1000, "HND", "bfloat16"),
                                   (2, 4, 2, 300, 4100, "NHD", "float16"),
                                   (1, 3, 1, 700, 600, "NHD", "float16"),
                                   (1, 2, 2, 1000, 100, "HND", "bfloat16"),
                                   (1, 2, 2, 1, 70, "HND", "bfloat16")])
def test_nvfp4_kv_images_match_dequantizing_producer(monkeypatch, shape):
    """SAGECUPY_FP4_KVIMG=1 (each 64-key tile of K and V dequantized once into an image of the kernel's K/V stage:
    nvfp4_kv_images_raw from the raw K and V in attention, nvfp4_kv_images from the packed ones in attention_packed;
    nvfp4_attn_fwd_ws_img's producer copies the images with bulk copies) gives bitwise the O and LSE of the
    dequantizing producer: with Q from the pre-pass or quantized in the kernel (SAGECUPY_FP4_QIN), whole items or the
    tail split (SM count 5: the shapes with enough key tiles split), causal or not, with and without K-smoothing,
    single-level P, and through attention_packed; SAGECUPY_FP4_KVIMG=pipe (nvfp4_kv_images_raw_pipe) too. First the
    three image kernels' bytes against each other (every byte written, the same bytes: rows past the keys and the
    padded V tokens included; the pipelined one on 3 CTAs that walk many images). Shapes: a last key tile of 4 keys
    (4100), Nq > Nk causal (rows that see no key; at 1000 x 100 whole CTAs without a key tile), GQA, one row; NaN in V
    and NaN / Inf in K without K-smoothing (fp16: their blocks' NaN scale) reach the same elements."""
    from sagecupy import nvfp4
    from sagecupy._loader import device_capability

    if device_capability() != (9, 0):
        pytest.skip("the wgmma kernels need compute capability 9.0")
    cp = _cp()
    monkeypatch.setenv("SAGECUPY_FP4_ENGINE", "wgmma")
    B, Hq, Hkv, nq, nk, layout, dtype = shape
    (q, k, v, _), _ = _inputs(19, B, Hq, Hkv, nq, nk, 128, layout, dtype)
    for smooth in (True, False):
        raw, pipe, packed = _kv_images_all(nvfp4, cp, q, k, v, layout, smooth)
        for what, got in (("raw", raw), ("pipelined", pipe)):
            assert np.array_equal(got, packed), \
                f"{what} images (K-smoothing {smooth}): {int((got != packed).sum())} bytes differ"
    cases = [("plain", k, v, NVFP4Config()), ("no K-smoothing", k, v, NVFP4Config(k_smoothing=False))]
    if dtype == "float16":
        vn = cp.asarray(_raw(v)).copy()
        vn.reshape(-1, 128)[min(9, vn.size // 128 - 1), 3] = np.nan
        cases.append(("NaN in V", k, vn, NVFP4Config()))
        kn = cp.asarray(_raw(k)).copy()
        kn.reshape(-1, 128)[min(5, kn.size // 128 - 1), 40] = np.inf
        kn.reshape(-1, 128)[0, 100] = np.nan
        cases.append(("NaN and Inf in K", kn, v, NVFP4Config(k_smoothing=False)))
    if shape[0] == 1 and nq == 1000 and nk == 1000:
        cases.append(("single-level P", k, v, NVFP4Config(two_level_p=False)))
    ops = nvfp4.quantize_inputs(q, k, v, layout=layout)
    for split in ("0", "1"):
        monkeypatch.setenv("SAGECUPY_FP4_TAIL_SPLIT", split)
        if split == "1":
            monkeypatch.setattr(nvfp4, "_sm_count", lambda device_id: 5)
        for qin in ("0", "1"):
            monkeypatch.setenv("SAGECUPY_FP4_QIN", qin)
            for causal in (False, True):
                for what, kk, vv, cfg in cases:
                    got = []
                    for img in ("0", "1", "pipe"):
                        monkeypatch.setenv("SAGECUPY_FP4_KVIMG", img)
                        nvfp4._ATTN_PLANS.clear()  # (the SM count is not part of a plan's key)
                        o, lse = nvfp4.attention(q, kk, vv, causal=causal, layout=layout, config=cfg,
                                                 return_lse=True)
                        got.append((_host(o), _host(lse)))
                    for img, other in zip(("1", "pipe"), got[1:]):
                        case = f"({what}, KVIMG={img}, split={split}, qin={qin}, causal={causal})"
                        for name, a, b in zip(("O", "LSE"), got[0], other):
                            assert np.array_equal(a, b, equal_nan=True), f"{name} differs {case}"
                    if what.startswith("NaN"):
                        assert np.isnan(got[1][0]).any(), f"the NaN reaches O {case}"
        for causal in (False, True):
            got = []
            for img in ("0", "1"):
                monkeypatch.setenv("SAGECUPY_FP4_KVIMG", img)
                o, lse = nvfp4.attention_packed(ops, causal=causal, layout=layout, out_dtype=dtype, return_lse=True)
                got.append((_host(o), _host(lse)))
            for name, a, b in zip(("O", "LSE"), *got):
                assert np.array_equal(a, b, equal_nan=True), f"attention_packed {name} (split={split}, causal={causal})"


@pytest.mark.parametrize("ctas", [3, None])
@pytest.mark.parametrize("shape", [(1, 2, 2, 128, 128, "HND", "bfloat16"),
                                   (2, 4, 2, 1000, 1000, "NHD", "float16"),
                                   (1, 3, 1, 700, 300, "HND", "bfloat16"),
                                   (2, 8, 2, 4224, 4100, "HND", "bfloat16"),
                                   (1, 2, 2, 64, 2000, "NHD", "float16")])
def test_nvfp4_persistent_kernel_matches_warp_specialized(monkeypatch, shape, ctas):
    """SAGECUPY_FP4_PERSIST=1 (nvfp4_attn_fwd_ws_persist: one CTA per SM walks the items, its K/V ring and Q
    staging running across them) gives bitwise the warp-specialized kernel's O and LSE, causal or not. With 3 CTAs
    every CTA walks many items: heavy and light ones, items whose rows see no key (Nq > Nk, causal), last query blocks
    with 64 real rows of 192; with the default grid (one CTA per SM) 4224 rows x 16 heads x 2 still give ~3 items
    per CTA. Also through attention_packed."""
    from sagecupy import nvfp4
    from sagecupy._loader import device_capability

    if device_capability() != (9, 0):
        pytest.skip("the wgmma kernels need compute capability 9.0")
    monkeypatch.setenv("SAGECUPY_FP4_ENGINE", "wgmma")
    monkeypatch.setenv("SAGECUPY_FP4_TAIL_SPLIT", "0")  # (against the whole items' warp-specialized kernel)
    B, Hq, Hkv, nq, nk, layout, dtype = shape
    (q, k, v, _), _ = _inputs(11, B, Hq, Hkv, nq, nk, 128, layout, dtype)
    if ctas is not None:
        monkeypatch.setattr(nvfp4, "_sm_count", lambda device_id: ctas)
    ops = nvfp4.quantize_inputs(q, k, v, layout=layout)
    for causal in (False, True):
        got = {}
        for persist in ("0", "1"):
            monkeypatch.setenv("SAGECUPY_FP4_PERSIST", persist)
            nvfp4._ATTN_PLANS.clear()  # (the grid size is not part of a plan's key)
            o, lse = nvfp4.attention(q, k, v, causal=causal, layout=layout, return_lse=True)
            op, lsep = nvfp4.attention_packed(ops, causal=causal, layout=layout, out_dtype=dtype, return_lse=True)
            got[persist] = [_host(x) for x in (o, lse, op, lsep)]
        for name, a, b in zip(("O", "LSE", "packed O", "packed LSE"), got["0"], got["1"]):
            assert np.array_equal(a, b, equal_nan=True), f"{name} differs (causal={causal})"
