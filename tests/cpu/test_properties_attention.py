"""Property tests (hypothesis) of the float64 attention reference and its simulators: mask algebra, softmax rows,
layout and GQA equivalences, the logit shift that K-smoothing relies on, chunked = dense, packed = per sequence.

Bitwise equality wherever the two sides run the same float64 operations on the same numbers (layouts, GQA against
explicitly repeated heads, causal against its window, packed against separate calls, K-smoothing under an exact
shift of K); a stated tolerance where they do not (1e-12 relative for chunked against dense; 1e-12 for O and LSE
and 1e-11 for gradients where logits are shifted or smoothed without quantization, the operations differing).
Shapes are small and the examples derandomized, so every run draws the same cases; the codec and quantizer
properties are in test_properties.py.
"""
import numpy as np
import pytest

pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from sagecupy.config import DEFAULT, NVFP4Config  # noqa: E402
from sagecupy.reference import attention as A  # noqa: E402
from sagecupy.reference import nvfp4, sagebwd  # noqa: E402

RAISE = dict(divide="raise", invalid="raise", over="raise")  # no division by zero, NaN, or overflow anywhere


def cases(n):
    """Same draws on every run (CI reproducible), no example database written, no per-example deadline."""
    return settings(max_examples=n, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def _nhd(x):
    """An HND array as the contiguous NHD array a caller would pass."""
    return np.ascontiguousarray(np.swapaxes(x, 1, 2))


def _same(a, b):
    """Bit-for-bit equal float arrays (NaN patterns, signed zeros and infinities included)."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert a.shape == b.shape
    np.testing.assert_array_equal(a.view(np.uint64), b.view(np.uint64))


def _close(a, b, rtol=1e-12):
    """|a - b| <= rtol * max(1, max|b|) over the finite entries; -inf exactly where b has -inf."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    np.testing.assert_array_equal(np.isneginf(a), np.isneginf(b))
    fin = np.isfinite(b)
    assert np.all(np.isfinite(a[fin]))
    tol = rtol * max(1.0, float(np.max(np.abs(b[fin]), initial=0.0)))
    assert float(np.max(np.abs(a[fin] - b[fin]), initial=0.0)) <= tol


windows = st.one_of(st.none(), st.tuples(st.integers(-1, 6), st.integers(-1, 6)))


@st.composite
def problems(draw, max_n=9, dims=(1, 2, 3, 5, 8), dyadic=False, nk=None):
    """HND float64 q, k, v, do with GQA, Nq != Nk, a mask (causal and/or a window) and a softmax scale.
    ``dyadic``: entries n/8 with |n| <= 32 (sums and means of a few are exact in float32 and float64)."""
    B, Hkv, group = draw(st.integers(1, 2)), draw(st.integers(1, 2)), draw(st.integers(1, 3))
    Nq = draw(st.integers(1, max_n))
    Nk = draw(nk) if nk is not None else draw(st.integers(1, max_n))
    D = draw(st.sampled_from(dims))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    Hq = Hkv * group
    if dyadic:
        def make(*shape):
            return rng.integers(-32, 33, size=shape) / 8.0
    else:
        sigma = draw(st.sampled_from([0.3, 1.0, 4.0]))

        def make(*shape):
            return rng.standard_normal(shape) * sigma
    causal, window = draw(st.booleans()), draw(windows)
    if causal and window is not None:
        window = (window[0], 0)
    return dict(q=make(B, Hq, Nq, D), k=make(B, Hkv, Nk, D), v=make(B, Hkv, Nk, D), do=make(B, Hq, Nq, D),
                causal=causal, window=window, sm_scale=draw(st.sampled_from([None, 0.5, 1.25])))


def _mask_kw(p):
    return dict(causal=p["causal"], window=p["window"], sm_scale=p["sm_scale"])


def _formula(nq, nk, left, right):
    """The window's definition, entry by entry: i + (nk - nq) - left <= j <= i + (nk - nq) + right, -1 unbounded."""
    out = np.zeros((nq, nk), bool)
    for i in range(nq):
        for j in range(nk):
            out[i, j] = ((left == -1 or i + (nk - nq) - left <= j)
                         and (right == -1 or j <= i + (nk - nq) + right))
    return out


# ----------------------------------------------------------------------------
# masks
# ----------------------------------------------------------------------------


@cases(300)
@given(nq=st.integers(1, 12), nk=st.integers(1, 12), left=st.integers(-1, 14), right=st.integers(-1, 14),
       grow=st.tuples(st.integers(0, 3), st.integers(0, 3)))
def test_window_mask_algebra(nq, nk, left, right, grow):
    m = A.visible_mask(nq, nk, False, (left, right))
    np.testing.assert_array_equal(m, _formula(nq, nk, left, right))
    # causal is the window (-1, 0), bottom-right aligned (j <= i + nk - nq); no window is all keys
    causal = A.visible_mask(nq, nk, True)
    np.testing.assert_array_equal(causal, _formula(nq, nk, -1, 0))
    np.testing.assert_array_equal(causal, A.visible_mask(nq, nk, False, (-1, 0)))
    np.testing.assert_array_equal(A.visible_mask(nq, nk, True, (left, 0)), _formula(nq, nk, left, 0))
    assert A.visible_mask(nq, nk, False).all() and A.visible_mask(nq, nk, False, (-1, -1)).all()
    # a window is the intersection of its two one-sided windows
    np.testing.assert_array_equal(m, A.visible_mask(nq, nk, False, (left, -1)) & A.visible_mask(nq, nk, False,
                                                                                                   (-1, right)))
    # widening a side (or making it unbounded) only adds keys
    wider = (-1 if left == -1 else left + grow[0], -1 if right == -1 else right + grow[1])
    assert np.all(A.visible_mask(nq, nk, False, wider) >= m)
    assert np.all(A.visible_mask(nq, nk, False, (-1, right)) >= m)
    # transposing swaps the roles: keys become queries (offset nq - nk) and left <-> right
    np.testing.assert_array_equal(m.T, A.visible_mask(nk, nq, False, (right, left)))


# ----------------------------------------------------------------------------
# softmax rows
# ----------------------------------------------------------------------------


@cases(200)
@given(rows=st.integers(1, 9).flatmap(lambda n: st.lists(
           st.lists(st.one_of(st.floats(-60, 60), st.just(-np.inf)), min_size=n, max_size=n), min_size=1,
           max_size=6)),
       shift=st.floats(-30, 30))
def test_masked_softmax_rows(rows, shift):
    """Rows that see a key: P >= 0, exactly 0 at -inf, max entry 1 / l, sum 1 to n ulps, lse = m + log l equal to an
    independent log-sum-exp; rows that see none: P = 0, l = 0, lse = -inf, no warning. Adding a constant to a row
    leaves P (to the rounding of the shifted logits) and moves lse by the constant."""
    s = np.array(rows, dtype=np.float64)
    n = s.shape[1]
    with np.errstate(**RAISE):
        p, m, l, lse = A.masked_softmax(s)
    seen = np.isfinite(s).any(axis=1)
    assert np.all(p >= 0) and np.all(p[np.isneginf(s)] == 0)
    assert np.all(p[~seen] == 0) and np.all(l[~seen] == 0) and np.all(np.isneginf(lse[~seen]))
    assert np.all(np.abs(p[seen].sum(axis=1) - 1) <= 2 * n * 2.0**-52)
    assert np.all(p[seen].max(axis=1) == 1 / l[seen])
    for i in np.flatnonzero(seen):
        vis = s[i][np.isfinite(s[i])]
        ref = vis.max() + np.log(np.sum(np.exp(vis - vis.max())))
        assert abs(lse[i] - ref) <= 4 * n * 2.0**-52 * max(1.0, abs(ref))
    with np.errstate(**RAISE):
        p2, _, _, lse2 = A.masked_softmax(s + shift)
    assert np.all(np.abs(p2 - p) <= 2.0**-40 * (1 + abs(shift)) * n)
    _close(lse2, lse + shift, rtol=2.0**-40)


@cases(100)
@given(p=problems())
def test_exact_attention_rows(p):
    """Through the exact reference: S is -inf exactly off the mask; the rows of P that see a key sum to 1, their
    LSE is the log-sum-exp of the visible scaled scores, O = P V; rows that see no key give O = 0, LSE = -inf and
    zero dQ, keys no row sees get zero dK and dV; no warnings."""
    q, k, v, do = p["q"], p["k"], p["v"], p["do"]
    B, Hq, Nq, D = q.shape
    Nk = k.shape[2]
    with np.errstate(**RAISE):
        r = A.attention_intermediates(q, k, v, do, **_mask_kw(p))
    mask = A.visible_mask(Nq, Nk, p["causal"], p["window"])
    np.testing.assert_array_equal(np.isneginf(r["S"]), np.broadcast_to(~mask, r["S"].shape))
    sees = mask.any(axis=1)
    P = r["P"]
    assert np.all(P[..., ~mask] == 0)
    assert np.all(np.abs(P[:, :, sees].sum(-1) - 1) <= 2 * Nk * 2.0**-52)
    assert np.all(r["O"][:, :, ~sees] == 0) and np.all(r["dQ"][:, :, ~sees] == 0)
    assert np.all(np.isneginf(r["lse"][:, :, ~sees]))
    seen_keys = mask.any(axis=0)
    assert np.all(r["dK"][:, :, ~seen_keys] == 0) and np.all(r["dV"][:, :, ~seen_keys] == 0)
    scale = A.resolve_sm_scale(p["sm_scale"], D)
    kx = np.repeat(k, Hq // k.shape[1], axis=1)
    vx = np.repeat(v, Hq // k.shape[1], axis=1)
    for b in range(B):
        for h in range(Hq):
            for i in np.flatnonzero(sees):
                logits = scale * (kx[b, h][mask[i]] @ q[b, h, i])
                mx = logits.max()
                ref = mx + np.log(np.sum(np.exp(logits - mx)))
                assert abs(r["lse"][b, h, i] - ref) <= 1e-13 * max(1.0, abs(ref))
                w = np.exp(logits - ref)
                _close(r["O"][b, h, i], w @ vx[b, h][mask[i]])


# ----------------------------------------------------------------------------
# equivalences: causal = window, layouts, GQA, chunked = dense
# ----------------------------------------------------------------------------


@cases(80)
@given(p=problems(), blocks=st.tuples(st.integers(1, 5), st.integers(1, 5)))
def test_causal_is_the_window_minus1_0(p, blocks):
    """causal=True, window=(-1, 0) and both together give the same O, LSE and gradients bit for bit, dense and
    chunked; no mask at all is window (-1, -1)."""
    q, k, v, do = p["q"], p["k"], p["v"], p["do"]
    s = p["sm_scale"]
    bq, bk = blocks
    ref = A.attention_intermediates(q, k, v, do, causal=True, sm_scale=s)
    ch = A.attention_chunked(q, k, v, do, causal=True, sm_scale=s, block_q=bq, block_k=bk)
    for kw in (dict(causal=False, window=(-1, 0)), dict(causal=True, window=(-1, 0))):
        r = A.attention_intermediates(q, k, v, do, sm_scale=s, **kw)
        c = A.attention_chunked(q, k, v, do, sm_scale=s, block_q=bq, block_k=bk, **kw)
        for key in ("O", "lse", "dQ", "dK", "dV"):
            _same(r[key], ref[key])
            _same(c[key], ch[key])
    o0, l0 = A.attention_forward(q, k, v, sm_scale=s)
    o1, l1 = A.attention_forward(q, k, v, sm_scale=s, window=(-1, -1))
    _same(o0, o1)
    _same(l0, l1)


@cases(80)
@given(p=problems(dims=(16,)), fam=st.sampled_from(["exact", "chunked", "sagebwd", "nvfp4"]))
def test_hnd_and_nhd_layouts_agree_bitwise(p, fam):
    """The same problem in HND and in NHD gives the same outputs bit for bit (NHD outputs transposed back), for the
    exact reference (dense and chunked) and the quantizing simulators."""
    q, k, v, do = p["q"], p["k"], p["v"], p["do"]
    kw = _mask_kw(p)

    def run(layout, conv):
        qq, kk, vv, dd = (conv(x) for x in (q, k, v, do))
        if fam == "exact":
            o, lse = A.attention_forward(qq, kk, vv, layout=layout, **kw)
            return (o, lse, *A.attention_backward(qq, kk, vv, o, lse, dd, layout=layout, **kw))
        if fam == "chunked":
            o, lse = A.attention_forward_chunked(qq, kk, vv, layout=layout, block_q=3, block_k=2, **kw)
            return (o, lse, *A.attention_backward_chunked(qq, kk, vv, o, lse, dd, layout=layout, block_q=3,
                                                          block_k=2, **kw))
        if fam == "sagebwd":
            o, res = sagebwd.forward(qq, kk, vv, layout=layout, **kw)
            return (o, res["lse"], *sagebwd.backward(res, dd))
        o, lse = nvfp4.forward(qq, kk, vv, layout=layout, **kw)
        return o, lse

    hnd = run("HND", lambda x: x)
    nhd = run("NHD", _nhd)
    for i, (a, b) in enumerate(zip(hnd, nhd)):
        _same(a, b if i == 1 else np.swapaxes(b, 1, 2))


@cases(80)
@given(p=problems(dims=(16,)), fam=st.sampled_from(["exact", "sagebwd", "nvfp4"]))
def test_gqa_equals_explicitly_repeated_heads(p, fam):
    """K and V shared by a group of query heads give what repeating each kv head over its group gives, bit for
    bit: O and LSE directly, dK and dV as the group sums of the repeated heads' gradients."""
    q, k, v, do = p["q"], p["k"], p["v"], p["do"]
    Hkv, group = k.shape[1], q.shape[1] // k.shape[1]
    kr, vr = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
    kw = _mask_kw(p)
    if fam == "exact":
        o, lse = A.attention_forward(q, k, v, **kw)
        o2, lse2 = A.attention_forward(q, kr, vr, **kw)
        g = A.attention_backward(q, k, v, o, lse, do, **kw)
        g2 = A.attention_backward(q, kr, vr, o2, lse2, do, **kw)
    elif fam == "sagebwd":
        o, res = sagebwd.forward(q, k, v, **kw)
        o2, res2 = sagebwd.forward(q, kr, vr, **kw)
        lse, lse2 = res["lse"], res2["lse"]
        g, g2 = sagebwd.backward(res, do), sagebwd.backward(res2, do)
    else:
        o, lse = nvfp4.forward(q, k, v, **kw)
        o2, lse2 = nvfp4.forward(q, kr, vr, **kw)
        g = g2 = None
    _same(o, o2)
    _same(lse, lse2)
    if g is not None:
        _same(g[0], g2[0])
        _same(g[1], A.sum_kv_groups(g2[1], Hkv))
        _same(g[2], A.sum_kv_groups(g2[2], Hkv))


@cases(120)
@given(p=problems(max_n=12), blocks=st.tuples(st.integers(1, 6), st.integers(1, 6)))
def test_chunked_equals_dense(p, blocks):
    """The chunked forward and backward (online softmax over key blocks, any block sizes) equal the dense ones to
    1e-12 relative; LSE is -inf on exactly the same rows."""
    q, k, v, do = p["q"], p["k"], p["v"], p["do"]
    kw = _mask_kw(p)
    bq, bk = blocks
    o, lse = A.attention_forward(q, k, v, **kw)
    dq, dk, dv = A.attention_backward(q, k, v, o, lse, do, **kw)
    with np.errstate(**RAISE):
        c = A.attention_chunked(q, k, v, do, block_q=bq, block_k=bk, **kw)
        cg = A.attention_backward_chunked(q, k, v, o, lse, do, block_q=bq, block_k=bk, **kw)
    for got, ref in ((c["O"], o), (c["lse"], lse), (c["dQ"], dq), (c["dK"], dk), (c["dV"], dv),
                     (cg[0], dq), (cg[1], dk), (cg[2], dv)):
        _close(got, ref)


# ----------------------------------------------------------------------------
# shifting the logits of a row: K + c, and K-smoothing
# ----------------------------------------------------------------------------


@cases(80)
@given(p=problems(), c=st.lists(st.floats(-3, 3), min_size=8, max_size=8))
def test_adding_a_vector_to_every_key_shifts_rows_only(p, c):
    """K + c (one vector c for all keys of a kv head) adds sm_scale * q_i . c to every logit of row i: O, dQ, dK and
    dV do not change (dQ through rowsum(dS) = 0) and LSE moves by that constant: O and LSE to 1e-12 relative, the
    gradients to 1e-11 (dS = P (dP - delta) cancels; the shifted logits' rounding is all that differs)."""
    q, k, v, do = p["q"], p["k"], p["v"], p["do"]
    D = q.shape[-1]
    cv = np.array(c[:D])
    kw = _mask_kw(p)
    scale = A.resolve_sm_scale(p["sm_scale"], D)
    o, lse = A.attention_forward(q, k, v, **kw)
    o2, lse2 = A.attention_forward(q, k + cv, v, **kw)
    _close(o2, o, rtol=1e-12)
    _close(lse2, lse + scale * (q @ cv), rtol=1e-12)
    g = A.attention_backward(q, k, v, o, lse, do, **kw)
    g2 = A.attention_backward(q, k + cv, v, o2, lse2, do, **kw)
    for a, b in zip(g2, g):
        _close(a, b, rtol=1e-11)


@cases(80)
@given(p=problems(max_n=20),
       cfg=st.tuples(st.booleans(), st.booleans(), st.booleans(), st.sampled_from([16, 32])))
def test_unquantized_smoothing_is_exact_attention(p, cfg):
    """With quantization off, K-smoothing (and Q-smoothing with its bias, and the dS row-sum correction) only
    shift each row's logits: SageBwd's O, public LSE and gradients and the NVFP4 simulator's O and LSE equal the
    exact reference: O and LSE to 1e-12 relative, the gradients to 1e-11 (dS = P (dP - delta) cancels, and the
    smoothed path sums in another order)."""
    k_sm, q_sm, rowsum, block = cfg
    q, k, v, do = p["q"], p["k"] + 2.5, p["v"], p["do"]   # (an offset the smoothing removes)
    kw = _mask_kw(p)
    o, lse = A.attention_forward(q, k, v, **kw)
    g = A.attention_backward(q, k, v, o, lse, do, **kw)
    sc = DEFAULT.replace(quantize=False, k_smoothing=k_sm, q_smoothing=q_sm, ds_rowsum_correction=rowsum,
                         block_q=block, block_kv=block)
    o2, res = sagebwd.forward(q, k, v, config=sc, **kw)
    _close(o2, o)
    _close(res["lse"], lse)
    for a, b in zip(sagebwd.backward(res, do), g):
        _close(a, b, rtol=1e-11)
    nc = NVFP4Config(quantize=False, k_smoothing=k_sm, q_smoothing=q_sm, block_q=block, block_kv=block)
    o3, lse3 = nvfp4.forward(q, k, v, config=nc, **kw)
    _close(o3, o)
    _close(lse3, lse)


@cases(80)
@given(p=problems(dims=(16,), dyadic=True, nk=st.sampled_from([1, 2, 4, 8, 16])),
       c=st.lists(st.integers(-32, 32), min_size=16, max_size=16), fam=st.sampled_from(["sagebwd", "nvfp4"]))
def test_k_smoothing_makes_quantized_attention_shift_invariant(p, c, fam):
    """With K-smoothing, K + c (one vector c added to every key) leaves the smoothed K, hence every quantized
    operand, bit for bit the same when the mean is exact (dyadic entries, Nk a power of two): O, the internal LSE
    and the gradients are bitwise those of K; the public LSE moves by sm_scale * q_i . c."""
    q, k, v, do = p["q"], p["k"], p["v"], p["do"]
    cv = np.array(c, dtype=np.float64) / 8.0
    kw = _mask_kw(p)
    scale = A.resolve_sm_scale(p["sm_scale"], q.shape[-1])
    if fam == "sagebwd":
        o, res = sagebwd.forward(q, k, v, **kw)
        o2, res2 = sagebwd.forward(q, k + cv, v, **kw)
        _same(o2, o)
        _same(res2["lse_internal"], res["lse_internal"])
        for a, b in zip(sagebwd.backward(res2, do), sagebwd.backward(res, do)):
            _same(a, b)
        lse, lse2 = res["lse"], res2["lse"]
    else:
        o, lse, it = nvfp4.forward(q, k, v, return_intermediates=True, **kw)
        o2, lse2, it2 = nvfp4.forward(q, k + cv, v, return_intermediates=True, **kw)
        _same(o2, o)
        _same(it2["k_hat"], it["k_hat"])
    _close(lse2, lse + scale * (q @ cv), rtol=1e-13)


# ----------------------------------------------------------------------------
# packed (THD + cu_seqlens) = one call per sequence
# ----------------------------------------------------------------------------


@cases(100)
@given(lens=st.lists(st.tuples(st.integers(0, 6), st.integers(0, 6)), min_size=1, max_size=4),
       heads=st.sampled_from([(1, 1), (2, 1), (4, 2)]), seed=st.integers(0, 2**32 - 1),
       causal=st.booleans(), window=windows,
       fam=st.sampled_from(["exact", "chunked", "sagebwd", "nvfp4"]))
def test_packed_equals_per_sequence_calls(lens, heads, seed, causal, window, fam):
    """A packed call is bit for bit the calls on each sequence alone (batch 1, NHD, its own copy); rows of a
    sequence without keys give O = 0, LSE = -inf and dQ = 0; keys of a sequence without queries get dK = dV = 0."""
    if causal and window is not None:
        window = (window[0], 0)
    Hq, Hkv = heads
    D = 16
    rng = np.random.default_rng(seed)
    cq = np.concatenate([[0], np.cumsum([a for a, _ in lens])]).astype(np.int32)
    ck = np.concatenate([[0], np.cumsum([b for _, b in lens])]).astype(np.int32)
    q = rng.standard_normal((cq[-1], Hq, D))
    k = rng.standard_normal((ck[-1], Hkv, D)) + 0.5
    v = rng.standard_normal((ck[-1], Hkv, D))
    do = rng.standard_normal((cq[-1], Hq, D))
    kw = dict(causal=causal, window=window)

    def run(qq, kk, vv, dd, **extra):
        if fam == "exact":
            o, lse = A.attention_forward(qq, kk, vv, **kw, **extra)
            return (o, lse, *A.attention_backward(qq, kk, vv, o, lse, dd, **kw, **extra))
        if fam == "chunked":
            r = A.attention_chunked(qq, kk, vv, dd, block_q=2, block_k=3, **kw, **extra)
            return r["O"], r["lse"], r["dQ"], r["dK"], r["dV"]
        if fam == "sagebwd":
            o, res = sagebwd.forward(qq, kk, vv, **kw, **extra)
            return (o, res["lse"], *sagebwd.backward(res, dd))
        return nvfp4.forward(qq, kk, vv, **kw, **extra)

    packed = run(q, k, v, do, layout="THD", cu_seqlens_q=cq, cu_seqlens_k=ck)
    o, lse = packed[0], packed[1]
    grads = packed[2:]
    for s in range(len(lens)):
        q0, q1, k0, k1 = int(cq[s]), int(cq[s + 1]), int(ck[s]), int(ck[s + 1])
        if q1 > q0 and k1 > k0:
            one = run(*(np.ascontiguousarray(x[a:b])[None] for x, a, b in
                        ((q, q0, q1), (k, k0, k1), (v, k0, k1), (do, q0, q1))), layout="NHD")
            if fam == "chunked":  # (attention_chunked answers in HND whatever the layout)
                one = (np.swapaxes(one[0], 1, 2), one[1], *(np.swapaxes(x, 1, 2) for x in one[2:]))
            _same(o[q0:q1], one[0][0])
            _same(lse[:, q0:q1], one[1][0])
            for gp, g1, (a, b) in zip(grads, one[2:], ((q0, q1), (k0, k1), (k0, k1))):
                _same(gp[a:b], g1[0])
        else:
            assert np.all(o[q0:q1] == 0) and np.all(np.isneginf(lse[:, q0:q1]))
            if grads:
                assert np.all(grads[0][q0:q1] == 0)
                assert np.all(grads[1][k0:k1] == 0) and np.all(grads[2][k0:k1] == 0)
