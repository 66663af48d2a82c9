"""Packed variable-length sequences (``layout="THD"``, docs/algorithms.md §1.8) in the SageBwd GPU kernels.

1. Against the references, with tests/gpu/test_int8.py's ``_check`` (tight against the quantization-aware simulator
   run on the same packed sequences, whose statistics are per sequence; no worse than 1.1x the simulator's own error
   against exact float64 attention): forward O and LSE, backward dQ, dK, dV, over documents of 1, 17, 127, 128, 129,
   1000 tokens, sequences empty in q, in k or both, Nq != Nk per sequence, GQA, fp16 and bf16, causal or not, windows
   narrower than a tile, the three configs, both engines (wgmma on sm_90 only). Rows that see no key: O = 0,
   LSE = -inf, dQ = 0; keys no query sees: dK = dV = 0.
2. A packed call equals the separate dense calls on its sequences **bit for bit**: O, LSE, dQ, dK and dV. Every
   statistic the kernels take (K's mean and V's channel scales over the sequence's keys, the tiles and blocks from
   its first row and key, the backward's per-tile column statistics) is the sequence's own, and each packed CTA runs
   the dense kernel body on its sequence with the same lengths and window, so nothing can differ. (The exception is
   none: the statistics of a sequence never mix with another's.)
3. The device's table of offsets equals its NumPy model (``_varlen.reference_meta``), offsets outside the contract
   included; offsets from the host or the device, contiguous or strided, give the same bits; every output element is
   written (poisoned buffers).
"""

import numpy as np
import pytest

from sagecupy.config import DEFAULT, PAPER
from sagecupy.reference import attention as ref_attn
from sagecupy.reference import sagebwd as ref_sage
from test_int8 import BKV64, PV16, PV16_64, _check, _raw, _to_dev, _to_host, poison_new_buffers

pytestmark = pytest.mark.gpu

ENGINES = ("mma", "wgmma")


def _cupy():
    import cupy

    return cupy


def _engine_or_skip(engine):
    from sagecupy._loader import device_capability

    if engine == "wgmma" and device_capability() != (9, 0):
        pytest.skip("the wgmma kernels need sm_90")


def _offsets(lens):
    cq = np.concatenate([[0], np.cumsum([a for a, _ in lens])]).astype(np.int32)
    ck = np.concatenate([[0], np.cumsum([b for _, b in lens])]).astype(np.int32)
    return cq, ck


def _packed_inputs(seed, lens, Hq, Hkv, D, dtype):
    """Device (q, k, v, do) of the packed shapes and their float64 host values; each sequence's K gets a mean of its
    own (a statistic the kernels must take per sequence)."""
    rng = np.random.default_rng(seed)
    cq, ck = _offsets(lens)
    tq, tk = int(cq[-1]), int(ck[-1])
    q = rng.standard_normal((tq, Hq, D))
    k = rng.standard_normal((tk, Hkv, D))
    for s in range(len(lens)):
        k[ck[s]:ck[s + 1]] += 0.5 * rng.standard_normal((1, 1, D))
    v = rng.standard_normal((tk, Hkv, D))
    do = rng.standard_normal((tq, Hq, D))
    dev = [_to_dev(x, dtype) for x in (q, k, v, do)]
    return dev, [_to_host(x) for x in dev]


def _with_kernel_o(r_sim, o_h, spans):
    """The simulator's packed residuals with each sequence's O replaced by the kernel's (the kernel's delta uses it)."""
    seqs = []
    for res, (q0, q1, _, _) in zip(r_sim["sequences"], spans):
        seqs.append(None if res is None else dict(res, o=np.swapaxes(o_h[None, q0:q1], 1, 2)))
    return dict(r_sim, sequences=seqs)


def _run(lens, Hq, Hkv, D, dtype, causal, window, config, engine, seed=0, check_grad=_check):
    import sagecupy.int8 as s8

    case = dict(lens=lens, Hq=Hq, Hkv=Hkv, D=D, dtype=dtype, causal=causal, window=window, config=config.name,
                engine=engine)
    (q, k, v, do), (qh, kh, vh, doh) = _packed_inputs(seed, lens, Hq, Hkv, D, dtype)
    cq, ck = _offsets(lens)
    cp = _cupy()
    packed = dict(layout="THD", cu_seqlens_q=cp.asarray(cq), cu_seqlens_k=cp.asarray(ck),
                  max_seqlen_q=max(a for a, _ in lens), max_seqlen_k=max(b for _, b in lens))
    host = dict(layout="THD", cu_seqlens_q=cq, cu_seqlens_k=ck)
    before = [_raw(x).copy() for x in (q, k, v, do)]
    o, lse, res = s8.forward(q, k, v, causal=causal, window=window, config=config, return_lse=True, engine=engine,
                             **packed)
    o_h = _to_host(o)
    o_sim, r_sim = ref_sage.forward(qh, kh, vh, causal=causal, window=window, config=config, dtype=dtype,
                                    **host)
    o_ex, lse_ex = ref_attn.attention_forward(qh, kh, vh, causal=causal, window=window, **host)
    _check("O", o_h, o_sim, o_ex, dtype, case)
    lse_h = lse.get().astype(np.float64)
    fin = np.isfinite(r_sim["lse"])
    assert lse_h.shape == fin.shape and np.array_equal(np.isfinite(lse_h), fin), f"LSE -inf pattern differs {case}"
    assert np.all(np.isneginf(lse_h[~fin])), f"a row that sees no key must have LSE = -inf {case}"
    d_lse = np.abs(lse_h[fin] - r_sim["lse"][fin])
    if d_lse.size:  # as in test_int8._run_case: a flipped quantization tie moves a row's LSE by ~1e-3 at most
        assert np.quantile(d_lse, 0.99) < 1e-4 and d_lse.max() < 1e-2, (
            f"LSE vs simulator: p99 {np.quantile(d_lse, 0.99):.2e}, max {d_lse.max():.2e} {case}")
    none = ~fin.T  # (total_q, Hq): rows that see no key
    assert np.all(o_h[none] == 0), f"O of a row that sees no key must be 0 {case}"
    dq, dk, dv = s8.backward(res, do, engine=engine)
    spans = [(int(cq[s]), int(cq[s + 1]), int(ck[s]), int(ck[s + 1])) for s in range(len(lens))]
    dq_s, dk_s, dv_s = ref_sage.backward(_with_kernel_o(r_sim, o_h, spans), doh)
    dq_e, dk_e, dv_e = ref_attn.attention_backward(qh, kh, vh, o_ex, lse_ex, doh, causal=causal, window=window, **host)
    grads = [_to_host(x) for x in (dq, dk, dv)]
    for name, got, sim, ex in zip(("dQ", "dK", "dV"), grads, (dq_s, dk_s, dv_s), (dq_e, dk_e, dv_e)):
        check_grad(name, got, sim, ex, dtype, case)
    assert np.all(grads[0][none] == 0), f"dQ of a row that sees no key must be 0 {case}"
    for q0, q1, k0, k1 in spans:
        if q1 == q0:  # keys no query sees
            assert np.all(grads[1][k0:k1] == 0) and np.all(grads[2][k0:k1] == 0), f"dK, dV of unseen keys {case}"
    for x, x0 in zip((q, k, v, do), before):
        assert bool((_raw(x) == x0).all()), f"an input was modified {case}"


DOCS = [(1, 1), (17, 17), (127, 127), (128, 128), (129, 129), (1000, 1000)]
EMPTY = [(0, 5), (17, 0), (0, 0), (129, 300), (300, 129), (1, 1000)]
UNEQUAL = [(1000, 17), (64, 200), (200, 64), (128, 1), (0, 0)]

# lens, Hq, Hkv, D, dtype, causal, window, config
CASES = [
    (DOCS, 4, 2, 128, "float16", True, None, DEFAULT),
    (DOCS, 2, 2, 64, "bfloat16", False, None, DEFAULT),
    (DOCS, 4, 2, 64, "float16", True, (17, 0), BKV64),
    (EMPTY, 4, 2, 64, "float16", True, None, BKV64),
    (EMPTY, 4, 2, 128, "bfloat16", False, None, DEFAULT),
    (EMPTY, 2, 1, 128, "float16", True, (5, 0), DEFAULT),
    (UNEQUAL, 2, 1, 128, "bfloat16", True, (17, 0), DEFAULT),
    (UNEQUAL, 4, 2, 64, "float16", False, (5, 5), BKV64),
    (UNEQUAL, 2, 2, 64, "bfloat16", False, (-1, 3), DEFAULT),
    (EMPTY, 2, 2, 128, "float16", True, None, PAPER),
    (DOCS[:4] + EMPTY[:2], 4, 2, 64, "bfloat16", False, (40, -1), PAPER),
    ([(333, 333)], 4, 4, 128, "float16", False, None, DEFAULT),  # one sequence: the dense call's shape
    (DOCS, 4, 2, 128, "bfloat16", True, None, PV16),  # (the 16-bit P.V: the wgmma engine only)
    (EMPTY, 2, 2, 64, "float16", False, (17, 0), PV16_64),
    (UNEQUAL, 2, 1, 128, "float16", False, (5, 5), PV16),
]


def _case_id(c):
    lens, Hq, Hkv, D, dtype, causal, window, config = c
    name = {id(DOCS): "docs", id(EMPTY): "empty", id(UNEQUAL): "unequal"}.get(id(lens), f"{len(lens)}seq")
    w = "" if window is None else f"-w{window[0]}_{window[1]}"
    return f"{name}-d{D}-{dtype}-{'causal' if causal else 'full'}{w}-{config.name}-gqa{Hq // Hkv}"


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("lens,Hq,Hkv,D,dtype,causal,window,config", CASES, ids=[_case_id(c) for c in CASES])
def test_packed_vs_references(lens, Hq, Hkv, D, dtype, causal, window, config, engine):
    _engine_or_skip(engine)
    if not config.pv_int8 and engine != "wgmma":
        pytest.skip("pv_int8=False runs on the wgmma engine only")
    _run(lens, Hq, Hkv, D, dtype, causal, window, config, engine)


# ---- a packed call is the separate calls, bit for bit ----

def _bits(x):
    return _raw(x).get().view(np.uint16) if hasattr(_raw(x), "get") else x


EQUAL_CASES = [
    (DOCS, 4, 2, 128, "bfloat16", True, None, DEFAULT),
    (DOCS, 2, 2, 64, "float16", False, (17, 0), BKV64),
    (EMPTY, 4, 2, 128, "float16", False, None, DEFAULT),
    (EMPTY, 2, 1, 64, "bfloat16", True, (5, 0), PAPER),
    (UNEQUAL, 4, 2, 64, "float16", True, None, DEFAULT),
    (UNEQUAL, 2, 2, 128, "bfloat16", False, (40, 3), BKV64),
    (DOCS, 4, 2, 64, "bfloat16", True, None, PV16),
    (EMPTY, 2, 1, 128, "float16", False, (5, 0), PV16_64),
    (UNEQUAL, 4, 2, 128, "bfloat16", True, None, PV16),
]


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("lens,Hq,Hkv,D,dtype,causal,window,config", EQUAL_CASES,
                         ids=[_case_id(c) for c in EQUAL_CASES])
def test_packed_equals_separate_calls(lens, Hq, Hkv, D, dtype, causal, window, config, engine):
    import sagecupy.int8 as s8

    _engine_or_skip(engine)
    if not config.pv_int8 and engine != "wgmma":
        pytest.skip("pv_int8=False runs on the wgmma engine only")
    cp = _cupy()
    (q, k, v, do), (qh, kh, vh, doh) = _packed_inputs(1, lens, Hq, Hkv, D, dtype)
    cq, ck = _offsets(lens)
    kw = dict(causal=causal, window=window, config=config, engine=engine)
    packed = dict(layout="THD", cu_seqlens_q=cp.asarray(cq), cu_seqlens_k=cp.asarray(ck))
    o, lse, res = s8.forward(q, k, v, return_lse=True, **kw, **packed)
    dq, dk, dv = s8.backward(res, do, engine=engine)
    o_i, lse_i = s8.sage_attention(q, k, v, return_lse=True, **kw, **packed)
    assert np.array_equal(_bits(o_i), _bits(o)) and np.array_equal(lse_i.get(), lse.get()), "sage_attention differs"
    o_b, lse_b, dq_b, dk_b, dv_b = (_bits(x) for x in (o, lse, dq, dk, dv))
    lse_b = lse.get()
    for s, (nq, nk) in enumerate(lens):
        q0, q1, k0, k1 = int(cq[s]), int(cq[s + 1]), int(ck[s]), int(ck[s + 1])
        if nq == 0:
            assert np.all(dk_b[k0:k1] == 0) and np.all(dv_b[k0:k1] == 0), f"sequence {s}: keys without queries"
            continue
        if nk == 0:
            assert np.all(o_b[q0:q1] == 0) and np.all(np.isneginf(lse_b[:, q0:q1])), f"sequence {s}: no keys"
            assert np.all(dq_b[q0:q1] == 0), f"sequence {s}: no keys"
            continue
        # the same values as batch-1 NHD arrays of their own
        qs, ks, vs, dos = (_to_dev(x[None, a:b], dtype) for x, a, b in ((qh, q0, q1), (kh, k0, k1), (vh, k0, k1),
                                                                      (doh, q0, q1)))
        o_s, lse_s, res_s = s8.forward(qs, ks, vs, layout="NHD", return_lse=True, **kw)
        dq_s, dk_s, dv_s = s8.backward(res_s, dos, engine=engine)
        for name, got, want in (("O", o_b[q0:q1], _bits(o_s)[0]), ("LSE", lse_b[:, q0:q1], lse_s.get()[0]),
                                ("dQ", dq_b[q0:q1], _bits(dq_s)[0]), ("dK", dk_b[k0:k1], _bits(dk_s)[0]),
                                ("dV", dv_b[k0:k1], _bits(dv_s)[0])):
            assert np.array_equal(got.view(np.uint8), np.ascontiguousarray(want).view(np.uint8)), (
                f"{name} of sequence {s} ({nq} x {nk}) differs from its separate call")


# ---- the table, the offsets' forms, every element written ----

@pytest.mark.parametrize("cu", ["valid", "unchecked"])
def test_device_table_matches_its_model(cu):
    """The first two pre-pass kernels' table (residuals.packed) against _varlen.reference_meta, for valid offsets and
    for offsets a device array may hold unchecked (negative, past the total, decreasing): clamped, never outside."""
    import sagecupy.int8 as s8
    from sagecupy import _varlen

    cp = _cupy()
    lens = EMPTY + DOCS
    (q, k, v, _), _ = _packed_inputs(2, lens, 2, 2, 64, "float16")
    cq, ck = _offsets(lens)
    if cu == "unchecked":
        cq = cq.copy()
        ck = ck.copy()
        cq[3], cq[5], ck[2], ck[-1] = -7, cq[-1] + 100, ck[4] + 50, ck[-1] - 3
    _, res = s8.forward(q, k, v, layout="THD", cu_seqlens_q=cp.asarray(cq), cu_seqlens_k=cp.asarray(ck))
    want = _varlen.reference_meta(cq, ck, q.shape[0], k.shape[0])
    np.testing.assert_array_equal(res.packed.get(), want)


def test_host_device_and_strided_offsets_agree():
    import sagecupy.int8 as s8

    cp = _cupy()
    lens = UNEQUAL
    (q, k, v, do), _ = _packed_inputs(3, lens, 4, 2, 128, "bfloat16")
    cq, ck = _offsets(lens)
    wide = cp.zeros((2 * cq.size,), cp.int32)
    wide[::2] = cp.asarray(cq)
    outs = []
    for cu_q, cu_k in ((cq, ck), (list(cq), tuple(ck)), (cp.asarray(cq), cp.asarray(ck)), (wide[::2], cp.asarray(ck))):
        o, lse, res = s8.forward(q, k, v, causal=True, layout="THD", cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                                 return_lse=True)
        outs.append([_bits(o), lse.get()] + [_bits(g) for g in s8.backward(res, do)])
    for other in outs[1:]:
        for a, b in zip(outs[0], other):
            assert np.array_equal(a, b)


def test_poisoned_outputs_are_overwritten(monkeypatch):
    """Every fresh buffer filled with NaN: an output element the packed kernels forget (a sequence's padding, an
    empty sequence, the bounds' slack) cannot pass."""
    import sagecupy.int8 as s8

    cp = _cupy()
    poison_new_buffers(monkeypatch)
    lens = EMPTY
    cq, ck = _offsets(lens)
    for dtype in ("float16", "bfloat16"):
        for engine in ENGINES:
            from sagecupy._loader import device_capability

            if engine == "wgmma" and device_capability() != (9, 0):
                continue
            (q, k, v, do), _ = _packed_inputs(4, lens, 4, 2, 64, dtype)
            o, lse, res = s8.forward(q, k, v, causal=True, layout="THD", cu_seqlens_q=cp.asarray(cq),
                                     cu_seqlens_k=cp.asarray(ck), return_lse=True, engine=engine)
            grads = s8.backward(res, do, engine=engine)
            for name, x in zip(("o", "dq", "dk", "dv"), (o, *grads)):
                assert not np.isnan(_to_host(x)).any(), f"{name} ({dtype}, {engine}) has unwritten elements"
            assert not np.isnan(lse.get()).any()


def test_errors_on_the_device():
    import sagecupy.int8 as s8

    cp = _cupy()
    (q, k, v, do), _ = _packed_inputs(5, DOCS, 2, 2, 64, "float16")
    cq, ck = _offsets(DOCS)
    with pytest.raises(TypeError, match=r"cu_seqlens_q\.dtype=int64 must be int32"):
        s8.forward(q, k, v, layout="THD", cu_seqlens_q=cp.asarray(cq, dtype=cp.int64), cu_seqlens_k=cp.asarray(ck))
    with pytest.raises(ValueError, match="cu_seqlens_k must end at the packed length"):
        s8.forward(q, k, v, layout="THD", cu_seqlens_q=cq, cu_seqlens_k=ck[:-1].tolist() + [int(ck[-1]) - 1])
    with pytest.raises(ValueError, match="only for layout='THD'"):
        s8.forward(q[None], k[None], v[None], layout="NHD", cu_seqlens_q=cp.asarray(cq))
    _, res = s8.forward(q, k, v, layout="THD", cu_seqlens_q=cp.asarray(cq), cu_seqlens_k=cp.asarray(ck))
    with pytest.raises(ValueError, match=r"do\.shape"):
        s8.backward(res, do[:-1])
