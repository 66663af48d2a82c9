"""Sliding-window attention (``window=(left, right)``, docs/algorithms.md §1.8) in the NVFP4 forward and the FP4 QAT
forward and backward GPU kernels.

The comparisons of tests/gpu/test_fp4_attn.py (its ``_check``: tight against the simulator run with the same window,
rows whose P quantization is ambiguous in fp32 excluded, and no worse than 1.1x the simulator's own error against
exact float64 attention; ``_check_lse``; ``TOL_GRAD`` for the QAT gradients), over windows that end inside a tile, on
a tile edge and past the sequence, both edges bounded or one, Nq == Nk and Nq != Nk (rows that see no key, keys no row
sees), lengths off the tile sizes, GQA, fp16 and bf16, HND and NHD, both engines (wgmma on sm_90 only: at D = 64 the
one-warpgroup kernel, at D = 128 the warp-specialized one), single-level P and no K-smoothing on some NVFP4 cases, and
causal=True with a left edge. A window of one key per row makes the exact dQ and dK identically 0 while the kernels'
carry the format's noise: the fuzz harness's routing (_check_degenerate) applies. Then the identities the kernels must
keep bit for bit: window=(-1, 0) is causal=True, window=(-1, -1) is causal=False, and a window that hides nothing is
full (causal) attention; and the NVFP4 tail split over a window's tiles against whole items.
"""
import numpy as np
import pytest

from sagecupy.reference import attention as ref_attn
from sagecupy.reference import nvfp4 as ref_nv
from sagecupy.reference import qat as ref_qat
from test_fp4_attn import NV_CONFIGS, TOL_GRAD, _ambiguous_rows, _check, _check_lse, _host, _inputs, _raw, _to_dev
from test_fuzz import _check_degenerate

pytestmark = pytest.mark.gpu

ENGINES = ("mma", "wgmma")


def _engine_or_skip(engine):
    from sagecupy._loader import device_capability

    if engine == "wgmma" and device_capability() != (9, 0):
        pytest.skip("the wgmma kernels need sm_90")


def _no_key_rows(o_h, lse_h, lse_sim, layout, case):
    """Rows that see no key (the simulator's LSE -inf): O exactly 0 and LSE -inf. Returns them (B, Hq, Nq)."""
    none = ~np.isfinite(lse_sim)
    assert np.all(np.isneginf(lse_h[none])), f"a row that sees no key must have LSE = -inf {case}"
    assert np.all(ref_attn.to_hnd(o_h, layout)[none] == 0), f"O of a row that sees no key must be 0 {case}"
    return none


def _nvfp4_case(B, Hq, Hkv, Nq, Nk, D, causal, window, layout, dtype, cfg, engine, seed=0):
    from sagecupy import nvfp4

    case = dict(B=B, Hq=Hq, Hkv=Hkv, Nq=Nq, Nk=Nk, D=D, causal=causal, window=window, layout=layout, dtype=dtype,
                cfg=cfg, engine=engine)
    (q, k, v, _), (qh, kh, vh, _) = _inputs(seed, B, Hq, Hkv, Nq, Nk, D, layout, dtype)
    before = [_raw(x).copy() for x in (q, k, v)]
    o, lse = nvfp4.attention(q, k, v, causal=causal, window=window, layout=layout, config=cfg, return_lse=True,
                             engine=engine)
    o_sim, lse_sim, inter = ref_nv.forward(qh, kh, vh, causal=causal, window=window, layout=layout, config=cfg,
                                           return_intermediates=True)
    o_ex, _ = ref_attn.attention_forward(qh, kh, vh, causal=causal, window=window, layout=layout)
    amb = _ambiguous_rows(inter["S"], cfg.two_level_p)
    o_h, lse_h = _host(o), lse.get().astype(np.float64)
    _check("O", o_h, o_sim, o_ex, dtype, case, ambiguous=amb, layout=layout)
    _check_lse(lse_h, lse_sim, case)
    _no_key_rows(o_h, lse_h, lse_sim, layout, case)
    for x, x0 in zip((q, k, v), before):
        assert bool((_raw(x) == x0).all()), f"an input was modified {case}"


def _qat_case(B, Hq, Hkv, Nq, Nk, D, causal, window, layout, dtype, engine, seed=0):
    from sagecupy import qat

    case = dict(B=B, Hq=Hq, Hkv=Hkv, Nq=Nq, Nk=Nk, D=D, causal=causal, window=window, layout=layout, dtype=dtype,
                engine=engine)
    (q, k, v, do), (qh, kh, vh, doh) = _inputs(seed, B, Hq, Hkv, Nq, Nk, D, layout, dtype)
    before = [_raw(x).copy() for x in (q, k, v)]
    o, lse, res = qat.forward(q, k, v, causal=causal, window=window, layout=layout, return_lse=True, engine=engine)
    assert res.problem.window == (None if window is None else tuple(window)), case
    o_sim, r_sim, inter = ref_qat.forward(qh, kh, vh, causal=causal, window=window, layout=layout,
                                          return_intermediates=True)
    o_ex, lse_ex = ref_attn.attention_forward(qh, kh, vh, causal=causal, window=window, layout=layout)
    amb = _ambiguous_rows(inter["S"], True)
    o_h, lse_h = _host(o), lse.get().astype(np.float64)
    _check("O", o_h, o_sim, o_ex, dtype, case, ambiguous=amb, layout=layout)
    _check_lse(lse_h, r_sim["lse"], case)
    none = _no_key_rows(o_h, lse_h, r_sim["lse"], layout, case)
    # O' (fp32, P rounded to fp16 as the mma operand) against the simulator's P V~
    _check("O'", res.o_prime.get()[:, :, :Nq].astype(np.float64), r_sim["o_prime"], None, "float16", case)
    # rows whose P quantization is ambiguous in fp32 get dO = 0 on both sides (test_qat_backward_vs_reference)
    if amb.any():
        doh = doh * ref_attn.from_hnd((~amb)[..., None].astype(np.float64), layout)
        do = _to_dev(doh, dtype)
    do0 = _raw(do).copy()
    dq, dk, dv = qat.backward(res, do, engine=engine)
    sims = ref_qat.backward(r_sim, doh)
    exact = ref_attn.attention_backward(qh, kh, vh, o_ex, lse_ex, doh, causal=causal, window=window, layout=layout)
    for name, got, sim, ex in zip(("dQ", "dK", "dV"), (dq, dk, dv), sims, exact):
        got = _host(got)
        if not np.any(sim):
            assert np.abs(got).max() < 1e-3, f"{name}: reference gradient is 0 {case}"
            continue
        _check_degenerate(_check, name, got, sim, ex, dtype, case, tol=TOL_GRAD)
    assert np.all(ref_attn.to_hnd(_host(dq), layout)[none] == 0), f"dQ of a row that sees no key must be 0 {case}"
    for x, x0 in zip((q, k, v, do), before + [do0]):
        assert bool((_raw(x) == x0).all()), f"an input was modified {case}"


# window, causal, B, Hq, Hkv, Nq, Nk, D, layout, dtype, NVFP4 config (NV_CONFIGS; the QAT runs take the default):
# every window of the list with Nq == Nk and Nq != Nk (Nq > Nk: rows that see no key; Nq < Nk with a bounded left edge:
# keys no row sees, whole key tiles skipped before a CTA's first), lengths off the 64-key tiles and the 64/128/192-row
# CTAs, GQA, both layouts and dtypes, D 64 and 128 on each window's pair of cases.
CASES = [
    ((0, 0), False, 1, 2, 2, 257, 257, 128, "HND", "float16", "two-level"),
    ((0, 0), True, 1, 4, 2, 200, 333, 64, "NHD", "bfloat16", "single-level"),
    ((1, 0), False, 1, 2, 2, 333, 200, 128, "HND", "bfloat16", "two-level"),
    ((1, 0), True, 1, 2, 2, 1, 1, 64, "HND", "float16", "two-level"),
    ((17, 0), False, 1, 2, 1, 1000, 1000, 128, "HND", "float16", "no-smoothing"),
    ((17, 0), True, 1, 2, 2, 127, 129, 64, "NHD", "bfloat16", "two-level"),
    ((64, 0), False, 1, 4, 2, 200, 333, 128, "NHD", "float16", "two-level"),
    ((64, 0), True, 1, 2, 2, 1000, 1000, 64, "HND", "bfloat16", "two-level"),
    ((127, 0), False, 1, 2, 2, 257, 257, 64, "HND", "bfloat16", "single-level"),
    ((128, 0), True, 1, 4, 2, 1000, 1000, 128, "NHD", "bfloat16", "two-level"),
    ((300, 0), False, 1, 2, 2, 1000, 1000, 128, "HND", "float16", "single-level"),
    ((300, 0), True, 1, 2, 1, 200, 333, 64, "HND", "bfloat16", "two-level"),
    ((5, 5), False, 1, 2, 2, 257, 257, 128, "HND", "float16", "two-level"),
    ((5, 5), False, 1, 4, 2, 333, 200, 64, "NHD", "bfloat16", "no-smoothing"),
    ((-1, 3), False, 1, 2, 2, 200, 333, 128, "HND", "bfloat16", "two-level"),
    ((-1, 3), False, 1, 4, 2, 1000, 1000, 64, "NHD", "float16", "two-level"),
    ((100, -1), False, 1, 2, 2, 333, 200, 128, "HND", "float16", "two-level"),
    ((100, -1), False, 1, 2, 2, 1000, 1000, 64, "HND", "bfloat16", "single-level"),
    ((0, -1), False, 1, 2, 2, 129, 129, 64, "NHD", "float16", "two-level"),
    ((0, -1), False, 1, 4, 2, 200, 333, 128, "HND", "bfloat16", "two-level"),
]


def _case_id(c, nvfp4=True):
    w, causal, B, Hq, Hkv, Nq, Nk, D, layout, dtype, cfg = c
    return (f"w{w[0]}_{w[1]}{'-causal' if causal else ''}-{Nq}x{Nk}-d{D}-{layout}-{dtype}{'-' + cfg if nvfp4 else ''}"
            f"-gqa{Hq // Hkv}")


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("window,causal,B,Hq,Hkv,Nq,Nk,D,layout,dtype,cfg", CASES, ids=[_case_id(c) for c in CASES])
def test_nvfp4_window_vs_references(window, causal, B, Hq, Hkv, Nq, Nk, D, layout, dtype, cfg, engine):
    _engine_or_skip(engine)
    _nvfp4_case(B, Hq, Hkv, Nq, Nk, D, causal, window, layout, dtype, NV_CONFIGS[cfg], engine)


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("window,causal,B,Hq,Hkv,Nq,Nk,D,layout,dtype,cfg", CASES,
                         ids=[_case_id(c, False) for c in CASES])
def test_qat_window_forward_backward_vs_references(window, causal, B, Hq, Hkv, Nq, Nk, D, layout, dtype, cfg,
                                                   engine):
    _engine_or_skip(engine)
    _qat_case(B, Hq, Hkv, Nq, Nk, D, causal, window, layout, dtype, engine)


def _nv_outputs(q, k, v, do, engine, **kw):
    """NVFP4's O and LSE as host bytes."""
    from sagecupy import nvfp4

    o, lse = nvfp4.attention(q, k, v, return_lse=True, engine=engine, **kw)
    return [np.ascontiguousarray(x).view(np.uint8) for x in (_raw(o).get(), lse.get())]


def _qat_outputs(q, k, v, do, engine, **kw):
    """QAT's O, LSE, lse2, O' and the three gradients as host bytes."""
    from sagecupy import qat

    o, lse, res = qat.forward(q, k, v, return_lse=True, engine=engine, **kw)
    grads = qat.backward(res, do, engine=engine)
    return [np.ascontiguousarray(x).view(np.uint8)
            for x in (_raw(o).get(), lse.get(), res.lse2.get(), res.o_prime.get(), *(_raw(g).get() for g in grads))]


def _assert_same_bytes(a, b, what):
    assert len(a) == len(b)
    for i, (x, y) in enumerate(zip(a, b)):
        same = x == y
        assert same.all(), f"{what}: output {i} differs in {int((~same).sum())} bytes"


SAME_SHAPES = [(1, 4, 2, 333, 200, 128, "HND", "bfloat16"), (1, 2, 2, 200, 333, 64, "NHD", "float16"),
               (1, 2, 1, 257, 257, 128, "HND", "float16")]
FAMILIES = {"nvfp4": _nv_outputs, "qat": _qat_outputs}


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("B,Hq,Hkv,Nq,Nk,D,layout,dtype", SAME_SHAPES, ids=lambda c: str(c))
def test_causal_and_full_windows_are_bitwise_causal_and_full(B, Hq, Hkv, Nq, Nk, D, layout, dtype, engine):
    """window=(-1, 0) is causal=True (with or without causal=True beside it) and window=(-1, -1) is causal=False, bit
    for bit, in both families: the kernels get the same (left, right) and the same launch either way."""
    _engine_or_skip(engine)
    (q, k, v, do), _ = _inputs(31, B, Hq, Hkv, Nq, Nk, D, layout, dtype, sigma=2.0)
    for family, run in FAMILIES.items():
        kw = dict(layout=layout)
        causal = run(q, k, v, do, engine, causal=True, **kw)
        _assert_same_bytes(causal, run(q, k, v, do, engine, window=(-1, 0), **kw), f"{family} window=(-1, 0)")
        _assert_same_bytes(causal, run(q, k, v, do, engine, causal=True, window=(-1, 0), **kw),
                           f"{family} causal=True, window=(-1, 0)")
        full = run(q, k, v, do, engine, **kw)
        _assert_same_bytes(full, run(q, k, v, do, engine, window=(-1, -1), **kw), f"{family} window=(-1, -1)")


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("B,Hq,Hkv,Nq,Nk,D,layout,dtype", SAME_SHAPES, ids=lambda c: str(c))
def test_window_wider_than_the_sequence_is_full_attention(B, Hq, Hkv, Nq, Nk, D, layout, dtype, engine):
    """Windows that bound no row give full attention bit for bit in both families: (Nk - 1, Nq - 1) (the narrowest
    such window), (Nk, Nq) and far wider ones, and one-sided ones (all launched as unbounded: nvfp4.kernel_window);
    with causal=True, a left edge that reaches key 0 from every row gives causal attention."""
    _engine_or_skip(engine)
    (q, k, v, do), _ = _inputs(37, B, Hq, Hkv, Nq, Nk, D, layout, dtype, sigma=2.0)
    for family, run in FAMILIES.items():
        kw = dict(layout=layout)
        full = run(q, k, v, do, engine, **kw)
        for window in ((Nk - 1, Nq - 1), (Nk, Nq), (10**9, 10**9), (Nk - 1, -1), (-1, Nq - 1)):
            _assert_same_bytes(full, run(q, k, v, do, engine, window=window, **kw), f"{family} window={window}")
        causal = run(q, k, v, do, engine, causal=True, **kw)
        for window in ((Nk - 1, 0), (10**9, 0)):
            _assert_same_bytes(causal, run(q, k, v, do, engine, causal=True, window=window, **kw),
                               f"{family} causal=True, window={window}")


# shape, window, forced split (whole items, parts) or None (the SM count below decides)
SPLIT_CASES = [((1, 2, 2, 1000, 1000, "HND", "bfloat16"), (100, 100), None),
               ((1, 3, 1, 700, 600, "NHD", "float16"), (300, -1), None),
               ((1, 2, 2, 1000, 700, "HND", "bfloat16"), (0, 40), 4)]


@pytest.mark.parametrize("shape,window,parts", SPLIT_CASES,
                         ids=[f"{s[3]}x{s[4]}-w{w[0]}_{w[1]}-parts{p}" for s, w, p in SPLIT_CASES])
def test_nvfp4_window_tail_split_matches_whole_items(monkeypatch, shape, window, parts):
    """The tail split (D=128, wgmma, two-level P) on windowed calls: each split item's parts take their shares of the
    key tiles its rows see, combined by the last part, against the same calls on whole items (nvfp4._tail_split
    patched to split nothing), as test_fp4_attn's split test (O within two units in the last place of the output
    format, the LSE within 1e-5, equal -inf patterns). SM count 5: (100, 100) on 1000 x 1000 splits 2 of 12 items in 2
    parts (an item sees at most 8 key tiles); (300, -1) keys from 300 before each row to the end; a forced plan of 4
    parts of every item for (0, 40) with Nq - Nk = 300, so that parts see no tile and the first item no key at all
    (rows 0..259: LSE -inf, O = 0 from the parts' combination)."""
    from test_fp4_attn import _cp, _need_sm90

    from sagecupy import nvfp4

    _need_sm90()
    monkeypatch.setattr(nvfp4, "_sm_count", lambda device_id: 5)
    B, Hq, Hkv, nq, nk, layout, dtype = shape
    (q, k, v, _), _ = _inputs(23, B, Hq, Hkv, nq, nk, 128, layout, dtype)
    rtol = 2.0 ** -7 if dtype == "bfloat16" else 2.0 ** -10
    real_plan, plans = nvfp4._tail_split, []

    def plan_fn(items, sms, ntiles):  # (parts given: every item in that many parts)
        plans.append(real_plan(items, sms, ntiles) if parts is None else (0, parts))
        return plans[-1]

    outs = []
    for split in (False, True):
        monkeypatch.setattr(nvfp4, "_tail_split", plan_fn if split else lambda items, sms, ntiles: None)
        nvfp4._ATTN_PLANS.clear()  # (the split is not part of a plan's key)
        o, lse = nvfp4.attention(q, k, v, layout=layout, window=window, return_lse=True, engine="wgmma")
        _cp().cuda.Device().synchronize()
        outs.append((_host(o), lse.get().astype(np.float64)))
    nvfp4._ATTN_PLANS.clear()
    assert plans and plans[-1] is not None, f"the call must split for this test to test anything: {plans}"
    (o0, l0), (o1, l1) = outs
    case = f"(window {window}, whole/nsplit {plans[-1]})"
    assert np.array_equal(np.isfinite(l0), np.isfinite(l1)), f"LSE -inf pattern {case}"
    fin = np.isfinite(l0)
    assert np.allclose(l1[fin], l0[fin], rtol=1e-6, atol=1e-5), f"LSE {case}"
    assert np.allclose(o1, o0, rtol=rtol, atol=1e-6), f"O {case}"
    if parts is not None:
        assert (~fin).any() and np.all(ref_attn.to_hnd(o1, layout)[~fin] == 0), f"rows that see no key {case}"
