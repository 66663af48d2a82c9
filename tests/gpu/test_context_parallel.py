"""Context parallelism for INT8 SageBwd on the GPU (sagecupy/context_parallel.py).

Bitwise (fp16): the statistics of one block are the pre-pass's (the same kernel, float64 sums exact for fp16), so
``forward(statistics=reduce_statistics([block_statistics(k, v)]))`` is ``forward`` bit for bit, and a block that is
the whole call (shift = nk - nq) is the single call bit for bit, forward and backward. The ring against the single
call is at the simulator tolerances of test_int8.py (``_check``), with room for the roundings of the partial outputs
and gradient shares, which are rounded to the input dtype per block and merged in fp32; the block forward against the
float64 reference block at the simulator tolerances.
"""
import math

import numpy as np
import pytest
from sagecupy.reference.metrics import rel_l2

from test_int8 import _check, _inputs, _round_to, _to_host

pytestmark = pytest.mark.gpu


def _cupy():
    import cupy

    return cupy


def _hnd(x, layout):
    return x if layout == "HND" else np.swapaxes(x, 1, 2)


def _rows(x, a, b, layout):
    return x[:, :, a:b] if layout == "HND" else x[:, a:b]


def _stats(k, v, layout="HND"):
    from sagecupy import context_parallel as cp

    return cp.reduce_statistics([cp.block_statistics(k, v, layout=layout)])


@pytest.mark.parametrize("layout", ["HND", "NHD"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_statistics_match_the_reference(layout, dtype):
    from sagecupy import context_parallel as cp
    from sagecupy.reference import context_parallel as ref

    (q, k, v, do), (qh, kh, vh, doh) = _inputs(0, 2, 4, 2, 300, 700, 128, layout, dtype)
    chunks = [(0, 128), (128, 512), (512, 700)]
    parts = [cp.block_statistics(_rows(k, a, b, layout), _rows(v, a, b, layout), layout=layout) for a, b in chunks]
    got = cp.reduce_statistics(parts)
    want = ref.reduce_statistics([ref.block_statistics(_hnd(kh, layout)[:, :, a:b], _hnd(vh, layout)[:, :, a:b])
                                  for a, b in chunks])
    np.testing.assert_array_equal(got["v_amax"].get(), want["v_amax"].astype(np.float32))
    np.testing.assert_array_equal(got["v_scale"].get(), want["v_amax"].astype(np.float32) / np.float32(127))
    if dtype == "float16":  # float64 sums of fp16 values are exact: bit for bit
        np.testing.assert_array_equal(got["k_sum"].get(), want["k_sum"])
        np.testing.assert_array_equal(got["mu_k"].get(), want["mu_k"].astype(np.float32))
    else:
        np.testing.assert_allclose(got["mu_k"].get(), want["mu_k"], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("engine", ["mma", "wgmma"])
@pytest.mark.parametrize("causal", [False, True])
def test_given_statistics_and_a_whole_block_are_the_single_call_bitwise(engine, causal):
    from sagecupy import context_parallel as cp
    from sagecupy import int8

    if engine == "wgmma" and int8.forward_engine() != "wgmma":
        pytest.skip("wgmma needs sm_90")
    (q, k, v, do), _ = _inputs(1, 2, 4, 2, 333, 517, 128, "HND", "float16")
    o, lse, res = int8.forward(q, k, v, causal=causal, return_lse=True, engine=engine)
    st = _stats(k, v)
    o2, lse2, res2 = int8.forward(q, k, v, causal=causal, return_lse=True, engine=engine,
                                  statistics={n: st[n] for n in ("mu_k", "v_scale")})
    assert (o == o2).all() and (lse == lse2).all()
    np.testing.assert_array_equal(res.mu_k.get(), st["mu_k"].get())
    blk = cp.block_forward(q, k, v, st, (0, 333), (0, 517), 333, 517, causal=causal, engine=engine)
    assert blk.residuals.mask[2] == 517 - 333
    assert (blk.o == o).all() and (blk.lse == lse).all() and (blk.lse2 == res.lse2).all()
    want = int8.backward(res, do, engine=engine)
    got = cp.block_backward(blk.residuals, do, blk.o, blk.lse2, engine=engine)
    for g, w in zip(got, want):
        assert (g == w).all()


def test_a_block_that_sees_nothing_gives_zero_and_minus_inf():
    from sagecupy import context_parallel as cp

    (q, k, v, do), _ = _inputs(2, 1, 2, 2, 512, 512, 64, "HND", "float16")
    st = _stats(k, v)
    # queries 0..127 against keys 256..383 under a causal mask: none visible
    blk = cp.block_forward(q[:, :, :128], k[:, :, 256:384], v[:, :, 256:384], st, (0, 128), (256, 384), 512, 512,
                           causal=True)
    assert (blk.o == 0).all() and bool((blk.lse == -_cupy().inf).all())
    g = cp.block_backward(blk.residuals, do[:, :, :128], q[:, :, :128] * 0, blk.lse2)
    assert all(bool((x == 0).all()) for x in g)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("causal", [False, True])
def test_block_forward_matches_the_reference_block(dtype, causal):
    from sagecupy import context_parallel as cp
    from sagecupy.reference import context_parallel as ref

    Nq, Nk = 400, 600
    (q, k, v, do), (qh, kh, vh, doh) = _inputs(3, 2, 4, 2, Nq, Nk, 128, "HND", dtype)
    st = _stats(k, v)
    ref_st = ref.reduce_statistics([ref.block_statistics(kh, vh)])
    (qa, qz), (ka, kz) = (256, 400), (128, 384)
    blk = cp.block_forward(q[:, :, qa:qz], k[:, :, ka:kz], v[:, :, ka:kz], st, (qa, qz), (ka, kz), Nq, Nk,
                           causal=causal)
    qb = ref.sagebwd_quantize_q(qh[:, :, qa:qz])
    kvb = ref.sagebwd_quantize_kv(kh[:, :, ka:kz], vh[:, :, ka:kz], ref_st)
    pos = (np.arange(qa, qz), np.arange(ka, kz), Nq, Nk)
    o_ref, lse_ref, lse_int = ref.sagebwd_block_forward(qb, kvb, *pos, causal=causal)
    o_exact, _ = ref.exact_block_forward(qh[:, :, qa:qz], kh[:, :, ka:kz], vh[:, :, ka:kz], *pos, causal=causal)
    _check("O", _to_host(blk.o), o_ref, o_exact, dtype, f"block {dtype} causal={causal}")
    lse = blk.lse.get()
    assert np.array_equal(lse == -np.inf, lse_ref == -np.inf)
    fin = np.isfinite(lse_ref)
    np.testing.assert_allclose(lse[fin], lse_ref[fin], rtol=1e-4, atol=1e-3)
    l2 = blk.lse2.get()[:, :, :qz - qa] * math.log(2)
    np.testing.assert_allclose(l2[fin], lse_int[fin], rtol=1e-4, atol=1e-3)


RING_CASES = [  # B, Hq, Hkv, Nq, Nk, D, causal, ranks, plan, layout, dtype
    (1, 2, 2, 1024, 1024, 128, True, 2, "zigzag", "HND", "float16"),
    (2, 4, 2, 1000, 1000, 64, True, 3, "zigzag", "NHD", "bfloat16"),
    (1, 4, 1, 777, 1301, 128, False, 3, "contiguous", "HND", "float16"),
    (1, 2, 2, 1301, 777, 64, True, 2, "contiguous", "HND", "bfloat16"),
    (1, 4, 2, 700, 900, 128, True, 3, "zigzag", "HND", "float16"),
    (2, 2, 1, 513, 513, 64, False, 2, "zigzag", "NHD", "float16"),
]


@pytest.mark.parametrize("B,Hq,Hkv,Nq,Nk,D,causal,ranks,plan,layout,dtype", RING_CASES)
def test_ring_equals_the_single_call(B, Hq, Hkv, Nq, Nk, D, causal, ranks, plan, layout, dtype):
    from sagecupy import context_parallel as cp
    from sagecupy import int8
    from sagecupy.reference import attention as A

    (q, k, v, do), (qh, kh, vh, doh) = _inputs(4, B, Hq, Hkv, Nq, Nk, D, layout, dtype)
    case = f"{(B, Hq, Hkv, Nq, Nk, D, causal, ranks, plan, layout, dtype)}"
    o1, lse1, res = int8.forward(q, k, v, causal=causal, layout=layout, return_lse=True)
    g1 = int8.backward(res, do)
    o, lse, state = cp.ring_attention(q, k, v, ranks, plan, causal=causal, layout=layout)
    g = cp.ring_attention_backward(state, do)
    o_ex, lse_ex = A.attention_forward(qh, kh, vh, causal=causal, layout=layout)
    g_ex = A.attention_backward(qh, kh, vh, o_ex, lse_ex, doh, causal=causal, layout=layout)
    # The single call rounds its fp32 O (gradients) to the output dtype once; the ring rounds every block's partial O
    # (gradient share), merges (sums) them in fp32 and rounds the result. The partials' rounding errors, weighted by
    # their shares of the result, come to about one more rounding of the result in rms, so against the single call's
    # output the ring differs by about sqrt(3) roundings: 2 u on top of the simulator tolerance, u the dtype's
    # rounding measured on the exact result (bf16 at R = 3: 1.6e-3 against the single call, `3853d3b` on an H100).
    for name, a, b, ex in zip(("O", "dQ", "dK", "dV"), (o, *g), (o1, *g1), (o_ex, *g_ex)):
        u = rel_l2(_round_to(ex, dtype), ex)
        _check(name, _to_host(a), _to_host(b), ex, dtype, case, extra=2 * u)
    lse, lse1 = lse.get(), lse1.get()
    assert np.array_equal(lse == -np.inf, lse1 == -np.inf)
    fin = np.isfinite(lse1)
    np.testing.assert_allclose(lse[fin], lse1[fin], rtol=1e-4, atol=1e-3)
    assert state["skipped"] >= 0 and len(state["schedule"]) == len(state["blocks"])
