"""Sliding-window attention (``window=(left, right)``, docs/algorithms.md §1.8) in the SageBwd GPU kernels.

The comparisons of tests/gpu/test_int8.py (its ``_check``: tight against the quantization-aware simulator run with
the same window, no worse than 1.1x the simulator's own error against exact float64 attention), over windows that
end inside a tile, on a tile edge and past the sequence, both edges bounded or one, Nq == Nk and Nq != Nk (rows that
see no key), lengths off the tile sizes, GQA, fp16 and bf16, HND and NHD, both engines (wgmma on sm_90 only), and
causal=True with a left edge. Then the identities the kernels must keep bit for bit: window=(-1, 0) is causal=True,
window=(-1, -1) is causal=False, and a window wider than the sequence is full attention.
"""

import numpy as np
import pytest

from sagecupy.config import DEFAULT, PAPER

PV16 = DEFAULT.replace(name="default-pv16", pv_int8=False)  # P.V in the inputs' 16-bit type (the wgmma engine)
from sagecupy.reference import attention as ref_attn
from sagecupy.reference import sagebwd as ref_sage
from test_int8 import BKV64, _check, _inputs, _raw, _to_host
# A window of one key per row makes the exact gradients identically 0 while the kernels' carry the format's
# quantization noise (dP - delta = dO . (V - V^)); the fuzz harness's routing of that case to the simulator applies.
from test_fuzz import _check_degenerate

pytestmark = pytest.mark.gpu

ENGINES = ("mma", "wgmma")


def _engine_or_skip(engine):
    from sagecupy._loader import device_capability

    if engine == "wgmma" and device_capability() != (9, 0):
        pytest.skip("the wgmma kernels need sm_90")


def _run_window_case(B, Hq, Hkv, Nq, Nk, D, causal, window, layout, dtype_name, config, engine, seed=0):
    import sagecupy.int8 as s8

    case = dict(B=B, Hq=Hq, Hkv=Hkv, Nq=Nq, Nk=Nk, D=D, causal=causal, window=window, layout=layout,
                dtype=dtype_name, config=config.name, engine=engine)
    (q, k, v, do), (qh, kh, vh, doh) = _inputs(seed, B, Hq, Hkv, Nq, Nk, D, layout, dtype_name)
    before = [_raw(x).copy() for x in (q, k, v, do)]
    o, lse, res = s8.forward(q, k, v, causal=causal, window=window, layout=layout, config=config, return_lse=True,
                             engine=engine)
    o_h = _to_host(o)
    o_sim, r_sim = ref_sage.forward(qh, kh, vh, causal=causal, window=window, layout=layout, config=config,
                                    dtype=dtype_name)
    o_ex, lse_ex = ref_attn.attention_forward(qh, kh, vh, causal=causal, window=window, layout=layout)
    _check("O", o_h, o_sim, o_ex, dtype_name, case)
    lse_h = lse.get().astype(np.float64)
    fin = np.isfinite(r_sim["lse"])
    assert np.array_equal(np.isfinite(lse_h), fin), f"LSE -inf pattern differs {case}"
    assert np.all(np.isneginf(lse_h[~fin])), f"a row that sees no key must have LSE = -inf {case}"
    # as in test_int8._run_case: a quantization tie flipped by fp32 rounding moves a row's LSE by ~1e-3 at most
    d_lse = np.abs(lse_h[fin] - r_sim["lse"][fin])
    if d_lse.size:
        assert np.quantile(d_lse, 0.99) < 1e-4 and d_lse.max() < 1e-2, (
            f"LSE vs simulator: p99 {np.quantile(d_lse, 0.99):.2e}, max {d_lse.max():.2e} {case}")
    none = ~fin  # (B, Hq, Nq): rows that see no key
    o_hnd = ref_attn.to_hnd(o_h, layout)
    assert np.all(o_hnd[none] == 0), f"O of a row that sees no key must be 0 {case}"
    dq, dk, dv = s8.backward(res, do, engine=engine)
    r_sim = dict(r_sim, o=o_hnd)  # the kernel's delta uses the kernel's O (rounded to the dtype)
    dq_s, dk_s, dv_s = ref_sage.backward(r_sim, doh)
    dq_e, dk_e, dv_e = ref_attn.attention_backward(qh, kh, vh, o_ex, lse_ex, doh, causal=causal, window=window,
                                                   layout=layout)
    for name, got, sim, ex in (("dQ", dq, dq_s, dq_e), ("dK", dk, dk_s, dk_e), ("dV", dv, dv_s, dv_e)):
        _check_degenerate(_check, name, _to_host(got), sim, ex, dtype_name, case)
    assert np.all(ref_attn.to_hnd(_to_host(dq), layout)[none] == 0), f"dQ of a row that sees no key must be 0 {case}"
    for x, x0 in zip((q, k, v, do), before):
        assert bool((_raw(x) == x0).all()), f"an input was modified {case}"


# window, causal, B, Hq, Hkv, Nq, Nk, D, layout, dtype, config: every window of the list below with Nq == Nk and
# Nq != Nk (Nq > Nk: rows that see no key), lengths off the 64/128 tiles, GQA, both layouts, dtypes, forward tiles of
# 64 (BKV64, PAPER) and 128 (DEFAULT) keys.
CASES = [
    ((0, 0), False, 1, 2, 2, 257, 257, 128, "HND", "float16", DEFAULT),
    ((0, 0), True, 1, 4, 2, 200, 333, 64, "NHD", "bfloat16", BKV64),
    ((0, 0), False, 1, 2, 2, 333, 200, 128, "HND", "bfloat16", DEFAULT),
    ((1, 0), False, 1, 2, 2, 129, 129, 64, "HND", "bfloat16", DEFAULT),
    ((1, 0), True, 1, 4, 2, 333, 200, 128, "NHD", "float16", PAPER),
    ((1, 0), False, 1, 2, 2, 1, 1, 64, "HND", "float16", DEFAULT),
    ((17, 0), False, 1, 2, 1, 1000, 1000, 128, "HND", "float16", DEFAULT),
    ((17, 0), True, 1, 2, 2, 17, 1, 64, "NHD", "float16", DEFAULT),
    ((17, 0), False, 1, 2, 2, 127, 129, 64, "HND", "bfloat16", BKV64),
    ((64, 0), True, 1, 4, 2, 1000, 1000, 64, "HND", "bfloat16", BKV64),
    ((64, 0), False, 1, 2, 2, 200, 333, 128, "NHD", "float16", DEFAULT),
    ((64, 0), False, 1, 2, 2, 1, 1000, 128, "NHD", "bfloat16", DEFAULT),
    ((127, 0), False, 1, 2, 2, 257, 257, 128, "HND", "bfloat16", DEFAULT),
    ((127, 0), True, 1, 2, 2, 333, 200, 64, "HND", "float16", BKV64),
    ((128, 0), False, 1, 4, 2, 1000, 1000, 128, "NHD", "bfloat16", PAPER),
    ((128, 0), True, 1, 2, 2, 129, 257, 64, "HND", "float16", DEFAULT),
    ((300, 0), False, 1, 2, 2, 1000, 1000, 64, "HND", "float16", DEFAULT),
    ((300, 0), True, 1, 2, 1, 200, 333, 128, "HND", "bfloat16", BKV64),
    ((5, 5), False, 1, 2, 2, 257, 257, 128, "HND", "float16", DEFAULT),
    ((5, 5), False, 1, 4, 2, 333, 200, 64, "NHD", "bfloat16", BKV64),
    ((5, 5), False, 1, 2, 2, 1, 17, 128, "HND", "float16", DEFAULT),
    ((-1, 3), False, 1, 2, 2, 200, 333, 128, "HND", "bfloat16", DEFAULT),
    ((-1, 3), False, 1, 4, 2, 1000, 1000, 64, "NHD", "float16", PAPER),
    ((100, -1), False, 1, 2, 2, 333, 200, 128, "HND", "float16", DEFAULT),
    ((100, -1), False, 1, 2, 2, 1000, 1000, 64, "HND", "bfloat16", BKV64),
    ((0, -1), False, 1, 2, 2, 129, 129, 64, "NHD", "float16", DEFAULT),
    ((0, -1), False, 1, 4, 2, 200, 333, 128, "HND", "bfloat16", BKV64),
    ((0, -1), False, 1, 2, 2, 17, 1, 128, "HND", "float16", DEFAULT),
    ((1, 0), False, 1, 2, 2, 129, 129, 128, "HND", "bfloat16", PV16),
    ((17, 0), True, 1, 4, 2, 200, 333, 64, "NHD", "float16", PV16),
    ((127, 0), False, 1, 2, 2, 257, 257, 128, "HND", "float16", PV16),
    ((300, 0), True, 1, 2, 1, 1000, 1000, 64, "HND", "bfloat16", PV16),
    ((5, 5), False, 1, 2, 2, 333, 200, 128, "NHD", "bfloat16", PV16),
    ((100, -1), False, 1, 2, 2, 1000, 1000, 128, "HND", "float16", PV16),
]


def _case_id(c):
    w, causal, B, Hq, Hkv, Nq, Nk, D, layout, dtype, config = c
    return (f"w{w[0]}_{w[1]}{'-causal' if causal else ''}-{Nq}x{Nk}-d{D}-{layout}-{dtype}-{config.name}"
            f"-gqa{Hq // Hkv}")


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("window,causal,B,Hq,Hkv,Nq,Nk,D,layout,dtype,config", CASES, ids=[_case_id(c) for c in CASES])
def test_window_forward_backward_vs_references(window, causal, B, Hq, Hkv, Nq, Nk, D, layout, dtype, config, engine):
    _engine_or_skip(engine)
    if not config.pv_int8 and engine != "wgmma":
        pytest.skip("pv_int8=False runs on the wgmma engine only")
    _run_window_case(B, Hq, Hkv, Nq, Nk, D, causal, window, layout, dtype, config, engine)


def _outputs(q, k, v, do, engine, **kw):
    """O, LSE, lse2 and the three gradients as host bytes."""
    import sagecupy.int8 as s8

    o, lse, res = s8.forward(q, k, v, return_lse=True, engine=engine, **kw)
    grads = s8.backward(res, do, engine=engine)
    return [np.ascontiguousarray(x).view(np.uint8)
            for x in (_raw(o).get(), lse.get(), res.lse2.get(), *(_raw(g).get() for g in grads))]


def _assert_same_bytes(a, b, what):
    for name, x, y in zip(("O", "LSE", "lse2", "dQ", "dK", "dV"), a, b):
        same = x == y
        assert same.all(), f"{what}: {name} differs in {int((~same).sum())} bytes"


SAME_SHAPES = [(1, 4, 2, 333, 200, 128, "HND", "bfloat16", DEFAULT), (1, 2, 2, 200, 333, 64, "NHD", "float16", BKV64),
               (1, 2, 1, 257, 257, 128, "HND", "float16", PAPER)]


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("B,Hq,Hkv,Nq,Nk,D,layout,dtype,config", SAME_SHAPES,
                         ids=lambda c: c.name if hasattr(c, "name") else str(c))
def test_causal_and_full_windows_are_bitwise_causal_and_full(B, Hq, Hkv, Nq, Nk, D, layout, dtype, config, engine):
    """window=(-1, 0) is causal=True (with or without causal=True beside it) and window=(-1, -1) is causal=False, bit
    for bit: the kernels get the same (left, right) either way."""
    _engine_or_skip(engine)
    (q, k, v, do), _ = _inputs(31, B, Hq, Hkv, Nq, Nk, D, layout, dtype, sigma=2.0)
    kw = dict(layout=layout, config=config)
    causal = _outputs(q, k, v, do, engine, causal=True, **kw)
    _assert_same_bytes(causal, _outputs(q, k, v, do, engine, window=(-1, 0), **kw), "window=(-1, 0)")
    _assert_same_bytes(causal, _outputs(q, k, v, do, engine, causal=True, window=(-1, 0), **kw),
                       "causal=True, window=(-1, 0)")
    full = _outputs(q, k, v, do, engine, **kw)
    _assert_same_bytes(full, _outputs(q, k, v, do, engine, window=(-1, -1), **kw), "window=(-1, -1)")


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("B,Hq,Hkv,Nq,Nk,D,layout,dtype,config", SAME_SHAPES,
                         ids=lambda c: c.name if hasattr(c, "name") else str(c))
def test_window_wider_than_the_sequence_is_full_attention(B, Hq, Hkv, Nq, Nk, D, layout, dtype, config, engine):
    """Windows that bound no row give full attention bit for bit: (Nk - 1, Nq - 1) (the narrowest such window, passed
    to the kernels as it is: masks that hide nothing), (Nk, Nq) and far wider ones (passed as unbounded), and one-sided
    ones; with causal=True, a left edge past the sequence gives causal attention."""
    _engine_or_skip(engine)
    (q, k, v, do), _ = _inputs(37, B, Hq, Hkv, Nq, Nk, D, layout, dtype, sigma=2.0)
    kw = dict(layout=layout, config=config)
    full = _outputs(q, k, v, do, engine, **kw)
    for window in ((Nk - 1, Nq - 1), (Nk, Nq), (10**9, 10**9), (Nk - 1, -1), (-1, Nq - 1)):
        _assert_same_bytes(full, _outputs(q, k, v, do, engine, window=window, **kw), f"window={window}")
    causal = _outputs(q, k, v, do, engine, causal=True, **kw)
    for window in ((Nk - 1, 0), (10**9, 0)):
        _assert_same_bytes(causal, _outputs(q, k, v, do, engine, causal=True, window=window, **kw),
                           f"causal=True, window={window}")


ENGINE_CASES = [((17, 0), True, 1, 4, 2, 1000, 1000, 128, "HND", "bfloat16", DEFAULT),
                ((5, 5), False, 1, 2, 2, 333, 200, 64, "NHD", "float16", BKV64),
                ((100, -1), False, 1, 2, 1, 200, 333, 128, "HND", "float16", PAPER)]


@pytest.mark.parametrize("window,causal,B,Hq,Hkv,Nq,Nk,D,layout,dtype,config", ENGINE_CASES,
                         ids=[_case_id(c) for c in ENGINE_CASES])
def test_window_engines_agree(window, causal, B, Hq, Hkv, Nq, Nk, D, layout, dtype, config):
    """As test_int8's engine tests: the forward bit for bit (the same float operations after exact int32 products),
    the backward within relative L2 1e-5 (only dP's fp32 accumulation order differs)."""
    from sagecupy.reference import metrics

    _engine_or_skip("wgmma")
    (q, k, v, do), _ = _inputs(41, B, Hq, Hkv, Nq, Nk, D, layout, dtype, sigma=2.0)
    kw = dict(causal=causal, window=window, layout=layout, config=config)
    mma, wgmma = (_outputs(q, k, v, do, e, **kw) for e in ENGINES)
    _assert_same_bytes(mma[:3], wgmma[:3], "wgmma forward vs mma.sync")
    dt = np.float16 if dtype == "float16" else np.uint16
    for name, a, b in zip(("dQ", "dK", "dV"), mma[3:], wgmma[3:]):
        a, b = a.view(dt), b.view(dt)
        if dtype == "bfloat16":  # bf16 bits -> float32
            a, b = ((x.astype(np.uint32) << 16).view(np.float32) for x in (a, b))
        err = metrics.rel_l2(b.astype(np.float64), a.astype(np.float64))
        assert err <= 1e-5, f"{name}: wgmma vs mma.sync relative L2 {err:.3e}"
