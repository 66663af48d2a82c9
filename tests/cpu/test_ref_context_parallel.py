"""Context parallelism in the float64 reference (reference/context_parallel.py, docs/algorithms.md §9).

Exact attention: the ring over R ranks equals the single call to 1e-12 (O, LSE, dQ, dK, dV), and one rank is the
single call bit for bit.

SageBwd, with the statistics reduced from the blocks' partials:

* bit for bit (asserted with ``array_equal``): the reduced statistics (V's channel max in any case; K's mean
  because the inputs are fp16-valued, so its float64 sums are exact); every quantized operand of every shard
  and block (Q, K, V codes and scales, the Q-smoothing means); each block's logits S (integer code products are
  exact in float64, the scales are element-wise) and forward P codes; and, given the same global LSE_internal
  and δ, every backward tile operand: P, its codes and column scales, dO's codes and scales, dP (fp16-valued dO
  and V with Σ_d |dO||V| < 2⁵: every partial sum is a multiple of 2⁻⁴⁸ below 2⁵, exact in any order), dS and the
  folded X, Y with their codes and scales. One rank (R = 1, contiguous) is the single call bit for bit.
* float64 rounding only: O and the LSEs (each block's closed form has its own row max, then the merge), dQ
  (summed over key blocks), dK and dV (summed over query shards). They are held to the worst-case bounds of a
  first-order rounding analysis (:func:`_forward_tol`, :func:`_backward_tol`), 1e-13 to 6e-13 of each element's
  magnitude at these sizes (the observed differences stay below a tenth of the bound). The backward's bound adds
  the propagation of the forward's measured LSE and O differences through P, δ and the tile scales, which moves
  no code (asserted). With Q-smoothing the bias is a float64 product over D of non-representable means, so S
  itself agrees only to its rounding, which the bounds include.

Local statistics (each rank's own K mean and V scales) give a different result, far outside those bounds: the
check that passes for the global statistics fails for them.
"""
import numpy as np
import pytest

from sagecupy.config import DEFAULT, PAPER
from sagecupy.reference import attention as A
from sagecupy.reference import context_parallel as cp
from sagecupy.reference import sagebwd
from sagecupy.reference.metrics import rel_l2
from sagecupy.reference.quant import quantize_tiles

U = 2.0 ** -53  # unit roundoff of float64

# Small tiles so that short sequences hold several: Q rows aligned on 16, keys on 32 (16-key P tiles in 32-key
# backward tiles); the paper's per-block granularities; Q-smoothing (Q blocks of 32) with the dS row-sum term.
SMALL = DEFAULT.replace(block_q=32, block_kv=16, bwd_block_q=16, bwd_block_kv=32)
PAPER_SMALL = PAPER.replace(block_q=32, block_kv=32, bwd_block_q=16, bwd_block_kv=16)
QSMOOTH = SMALL.replace(q_smoothing=True, q_granularity="block", ds_rowsum_correction=True)
# The default's INT8 dQ and dK (X per query row, Y per key; the default rounds them to bf16 instead).
SMALL_DS8 = SMALL.replace(ds_int8=True)

# (Nq, Nk, Hq, Hkv): equal lengths, Nq < Nk and Nq > Nk (the first Nq − Nk rows see no key when causal); lengths
# that do not divide by 2R; GQA with groups of 2 and 3 and MQA.
EXACT_SHAPES = [(37, 37, 4, 2), (29, 45, 6, 2), (45, 29, 3, 1)]


def _inputs(B, Hq, Hkv, Nq, Nk, D=16, *, seed=0, k_mean=0.5):
    """fp16-valued float64 q, k, v, do (HND); K with a mean the smoothing must remove, dO at half scale (so
    that Σ_d |dO||V| stays below 2⁵ and dP is exact, see the module docstring)."""
    rng = np.random.default_rng(seed)
    f16 = lambda *s: rng.standard_normal(s).astype(np.float16).astype(np.float64)  # noqa: E731
    return f16(B, Hq, Nq, D), f16(B, Hkv, Nk, D) + k_mean, f16(B, Hkv, Nk, D), 0.5 * f16(B, Hq, Nq, D)


def _plan(kind, Nq, Nk, R, config=None):
    align = (1, 1) if config is None else cp.sagebwd_alignment(config)
    make = cp.zigzag_plan if kind == "zigzag" else cp.contiguous_plan
    return make(Nq, Nk, R, align_q=align[0], align_k=align[1])


def _gamma(n):
    return n * U / (1 - n * U)


# ---------------------------------------------------------------- plans and masks


@pytest.mark.parametrize("R", [1, 2, 3, 4])
@pytest.mark.parametrize("n, align", [(37, 1), (64, 1), (100, 16), (7, 1), (40, 32)])
def test_plans_partition_the_sequence(R, n, align):
    for make in (cp.contiguous_plan, cp.zigzag_plan):
        plan = make(n, n + 5, R, align_q=align)
        q = np.sort(np.concatenate([plan.q_positions(r) for r in range(R)]))
        k = np.sort(np.concatenate([plan.k_positions(r) for r in range(R)]))
        assert np.array_equal(q, np.arange(n)) and np.array_equal(k, np.arange(n + 5))
        for a, b in (c for r in plan.q_chunks for c in r):
            assert a % align == 0 and (b % align == 0 or b == n)
        sizes = [b - a for a, b in cp.chunk_bounds(n, 2 * R if plan.kind == "zigzag" else R, align)]
        assert max(sizes) - min(sizes) <= align  # as even as the tiles allow
    assert cp.zigzag_chunks(R) == tuple((r, 2 * R - 1 - r) for r in range(R))
    zz = cp.zigzag_plan(n, n, R, align_q=align, align_k=align)
    bounds = cp.chunk_bounds(n, 2 * R, align)
    assert zz.q_chunks == tuple((bounds[r], bounds[2 * R - 1 - r]) for r in range(R)) == zz.k_chunks


def test_zigzag_balances_causal_work():
    for R in (2, 3, 4):
        n = 2 * R * 8
        zz = cp.rank_work(cp.zigzag_plan(n, n, R), causal=True)
        cont = cp.rank_work(cp.contiguous_plan(n, n, R), causal=True)
        assert zz.sum() == cont.sum() == n * (n + 1) // 2 == A.visible_mask(n, n, True).sum()
        assert np.all(zz == zz[0]) and cont[-1] > 2 * cont[0]
        assert np.array_equal(cp.rank_work(cp.zigzag_plan(n, n, R)), np.full(R, n * n // R))


@pytest.mark.parametrize("Nq, Nk", [(37, 37), (20, 45), (45, 20)])
@pytest.mark.parametrize("causal, window", [(False, None), (True, None), (False, (5, 3)), (True, (4, 0)),
                                            (False, (-1, 2))])
def test_pair_masks_are_the_visible_mask(Nq, Nk, causal, window):
    full = A.visible_mask(Nq, Nk, causal, window)
    assert np.array_equal(cp.pair_mask(np.arange(Nq), np.arange(Nk), Nq, Nk, causal, window), full)
    plan = cp.zigzag_plan(Nq, Nk, 3)
    for r in range(3):
        qp = plan.q_positions(r)
        for s in range(3):
            kp = plan.k_positions(s)
            assert np.array_equal(cp.pair_mask(qp, kp, Nq, Nk, causal, window), full[np.ix_(qp, kp)])
    bounds_q, bounds_k = cp.chunk_bounds(Nq, 5), cp.chunk_bounds(Nk, 4)
    for qr in bounds_q:
        for kr in bounds_k:
            assert cp.pair_visible(qr, kr, Nq, Nk, causal, window) == bool(full[qr[0]:qr[1], kr[0]:kr[1]].any())


# ---------------------------------------------------------------- the merge


def test_merge_is_the_softmax_of_the_union():
    rng = np.random.default_rng(3)
    q, k, v = rng.standard_normal((2, 3, 9, 8)), rng.standard_normal((2, 3, 30, 8)), rng.standard_normal((2, 3, 30, 8))
    o, lse = A.attention_forward(q, k, v)
    parts = [cp.exact_block_forward(q, k[:, :, a:b], v[:, :, a:b], np.arange(9), np.arange(a, b), 9, 30)
             for a, b in ((0, 7), (7, 8), (8, 30))]
    for order in ((0, 1, 2), (2, 0, 1), (1, 2, 0)):
        om, lm = cp.merge_all(parts[i] for i in order)
        np.testing.assert_allclose(om, o, rtol=0, atol=1e-14)
        np.testing.assert_allclose(lm, lse, rtol=0, atol=1e-14)
    # Commutative bit for bit; a partial that saw no key leaves the other unchanged bit for bit.
    ab, ba = cp.merge_partials(*parts[0], *parts[2]), cp.merge_partials(*parts[2], *parts[0])
    assert np.array_equal(ab[0], ba[0]) and np.array_equal(ab[1], ba[1])
    empty = (np.zeros_like(o), np.full(lse.shape, -np.inf))
    for x, y in ((parts[1], empty), (empty, parts[1])):
        m = cp.merge_partials(*x, *y)
        assert np.array_equal(m[0], parts[1][0]) and np.array_equal(m[1], parts[1][1])
    m = cp.merge_partials(*empty, *empty)
    assert not m[0].any() and np.all(m[1] == -np.inf)


def test_merge_numerics_at_large_lse_and_nan():
    o_a, o_b = np.array([[1.0, -2.0]]), np.array([[3.0, 4.0]])
    for base in (0.0, 1e4, -1e4, 800.0):  # (e^{lse} would overflow or underflow; the merge never forms it)
        lse_a, lse_b = np.array([base]), np.array([base + np.log(3.0)])
        d = float(lse_b[0] - lse_a[0])        # exact (Sterbenz): the weights' accuracy does not depend on |lse|
        w_a = 1 / (1 + np.exp(d))
        o, lse = cp.merge_partials(o_a, lse_a, o_b, lse_b)
        np.testing.assert_allclose(o, w_a * o_a + (1 - w_a) * o_b, rtol=8 * U, atol=0)
        np.testing.assert_allclose(lse, lse_b + np.log1p(np.exp(-d)), rtol=2 * U, atol=4 * U)
    o, lse = cp.merge_partials(o_a, np.array([np.nan]), o_b, np.array([0.0]))
    assert np.isnan(lse).all() and np.isnan(o).all()
    with pytest.raises(ValueError, match="matching shapes"):
        cp.merge_partials(o_a, np.zeros(1), o_b, np.zeros(2))


# ---------------------------------------------------------------- exact attention


@pytest.mark.parametrize("kind", ["contiguous", "zigzag"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("R", [1, 2, 3, 4])
@pytest.mark.parametrize("shape", EXACT_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_exact_ring_equals_single_call(shape, R, causal, kind):
    Nq, Nk, Hq, Hkv = shape
    q, k, v, do = _inputs(2, Hq, Hkv, Nq, Nk, seed=R)
    plan = _plan(kind, Nq, Nk, R)
    o, lse, state = cp.ring_forward(q, k, v, plan, causal=causal)
    grads = cp.ring_backward(state, do)
    o1, lse1 = A.attention_forward(q, k, v, causal=causal)
    grads1 = A.attention_backward(q, k, v, o1, lse1, do, causal=causal)
    np.testing.assert_allclose(o, o1, rtol=0, atol=1e-12)
    assert np.array_equal(np.isfinite(lse), np.isfinite(lse1))
    np.testing.assert_allclose(lse[np.isfinite(lse1)], lse1[np.isfinite(lse1)], rtol=0, atol=1e-12)
    for g, g1 in zip(grads, grads1):
        np.testing.assert_allclose(g, g1, rtol=0, atol=1e-12)
    if R == 1 and kind == "contiguous":  # one block is the single call's computation
        assert np.array_equal(o, o1) and np.array_equal(lse, lse1)
        assert all(np.array_equal(g, g1) for g, g1 in zip(grads, grads1))
    n_pairs = sum(len(plan.q_chunks[r]) * len(plan.k_chunks[s]) for r in range(R) for s in range(R))
    empty = sum(1 for r in range(R) for s in range(R) for a, b in plan.q_chunks[r] for c, d in plan.k_chunks[s]
                if a == b or c == d)
    assert len(state["schedule"]) + state["skipped"] + empty == n_pairs
    if causal and kind == "zigzag" and R > 1:
        assert state["skipped"] > 0


@pytest.mark.parametrize("window", [(3, 2), (6, 0)])
def test_exact_ring_with_window_and_nhd(window):
    q, k, v, do = _inputs(1, 4, 2, 30, 41, seed=7)
    args = [np.ascontiguousarray(np.swapaxes(x, 1, 2)) for x in (q, k, v, do)]
    state = None
    for R in (2, 3):
        o, lse, state = cp.ring_forward(*args[:3], cp.zigzag_plan(30, 41, R), window=window, layout="NHD")
        o1, lse1 = A.attention_forward(*args[:3], window=window, layout="NHD")
        np.testing.assert_allclose(o, o1, rtol=0, atol=1e-12)
        for g, g1 in zip(cp.ring_backward(state, args[3]),
                         A.attention_backward(*args[:3], o1, lse1, args[3], window=window, layout="NHD")):
            np.testing.assert_allclose(g, g1, rtol=0, atol=1e-12)
    assert state["skipped"] > 0  # the band leaves whole chunk pairs out


# ---------------------------------------------------------------- SageBwd: statistics and operands


def _shard_stats(k, v, plan, config):
    return [cp.block_statistics(k[:, :, plan.k_positions(s)], v[:, :, plan.k_positions(s)], config=config)
            for s in range(plan.ranks)]


@pytest.mark.parametrize("config", [SMALL, PAPER_SMALL, QSMOOTH, DEFAULT], ids=["small", "paper", "qsmooth", "default"])
def test_reduced_statistics_quantize_as_the_single_call(config):
    Nq, Nk = (300, 520) if config is DEFAULT else (70, 150)
    q, k, v, _ = _inputs(2, 4, 2, Nq, Nk, seed=11)
    plan = _plan("zigzag", Nq, Nk, 3, config)
    stats = cp.reduce_statistics(_shard_stats(k, v, plan, config))
    qi = sagebwd.quantize_inputs(q, k, v, config=config)
    assert stats["k_count"] == Nk
    assert np.array_equal(stats["mu_k"], k.mean(axis=-2))
    if config.v_granularity == "channel":
        assert np.array_equal(stats["v_amax"], np.abs(v).max(axis=-2))
    else:
        assert stats["v_amax"] is None
    bq, bkv = config.block_q, config.block_kv
    for a, b in (c for r in plan.q_chunks for c in r if c[1] > c[0]):
        qb = cp.sagebwd_quantize_q(q[:, :, a:b], config=config)
        for key in ("q_codes", "q_scale"):
            assert np.array_equal(qb[key], qi[key][:, :, a:b]), key
        assert np.array_equal(qb["mu_q"], qi["mu_q"][:, :, a // bq:-(-b // bq)])
    for c, d in (c for r in plan.k_chunks for c in r if c[1] > c[0]):
        kvb = cp.sagebwd_quantize_kv(k[:, :, c:d], v[:, :, c:d], stats, config=config)
        for key in ("k_codes", "k_scale", "v_codes"):
            assert np.array_equal(kvb[key], qi[key][:, :, c:d]), key
        v_scale = qi["v_scale"] if config.v_granularity == "channel" else qi["v_scale"][:, :, c // bkv:-(-d // bkv)]
        assert np.array_equal(kvb["v_scale"], v_scale) and np.array_equal(kvb["mu_k"], qi["mu_k"])


def test_given_statistics_equal_to_its_own_change_nothing():
    q, k, v, _ = _inputs(1, 4, 2, 40, 50, seed=12)
    for config in (DEFAULT, PAPER, QSMOOTH, SMALL.replace(quantize=False)):
        own = sagebwd.quantize_inputs(q, k, v, config=config)
        kw = {"mu_k": k.mean(axis=-2)}
        if config.v_granularity == "channel":
            kw["v_amax"] = np.abs(v).max(axis=-2)
        given = sagebwd.quantize_inputs(q, k, v, config=config, **kw)
        for key, value in own.items():
            assert np.array_equal(given[key], value), (config.name, key)


# ---------------------------------------------------------------- SageBwd: blocks are the single call's tiles


@pytest.mark.parametrize("config", [SMALL, SMALL_DS8, PAPER_SMALL], ids=["small", "small-ds8", "paper"])
@pytest.mark.parametrize("causal", [False, True])
def test_sagebwd_blocks_are_the_single_calls_tiles(config, causal):
    Nq, Nk = 70, 150
    q, k, v, do = _inputs(1, 4, 2, Nq, Nk, seed=13)
    assert (np.abs(do) @ np.swapaxes(np.abs(A.expand_kv_heads(v, 4)), -1, -2)).max() < 32  # dP is exact
    run = sagebwd.run(q, k, v, do, causal=causal, config=config)
    plan = _plan("zigzag", Nq, Nk, 3, config)
    stats = cp.reduce_statistics(_shard_stats(k, v, plan, config))
    delta = np.sum(do * run["O"], axis=-1)   # the single call's own δ: the block backward takes the global one
    seen = 0
    for a, b in (c for r in plan.q_chunks for c in r if c[1] > c[0]):
        qb = cp.sagebwd_quantize_q(q[:, :, a:b], config=config)
        for c, d in (c for r in plan.k_chunks for c in r if c[1] > c[0]):
            pos = (np.arange(a, b), np.arange(c, d), Nq, Nk)
            if not cp.pair_visible((a, b), (c, d), Nq, Nk, causal):
                assert not run["P"][:, :, a:b, c:d].any()  # a skipped pair would have added nothing
                continue
            kvb = cp.sagebwd_quantize_kv(k[:, :, c:d], v[:, :, c:d], stats, config=config)
            *_, fwd = cp.sagebwd_block_forward(qb, kvb, *pos, causal=causal, return_intermediates=True)
            for key in ("S", "P_fwd_codes"):
                assert np.array_equal(fwd[key], run[key][:, :, a:b, c:d]), key
            t0, t1 = c // config.block_kv, -(-d // config.block_kv)
            assert np.array_equal(fwd["tile_max"], run["tile_max"][:, :, a:b, t0:t1])
            *_, bwd = cp.sagebwd_block_backward(qb, kvb, do[:, :, a:b], run["lse_internal"][:, :, a:b],
                                                delta[:, :, a:b], *pos, causal=causal, return_intermediates=True)
            for key in ("P", "dP", "dS", "P_bwd_codes", "P_bwd_scale", "X_codes", "X_scale", "Y_codes", "Y_scale"):
                assert np.array_equal(bwd[key], run[key][:, :, a:b, c:d]), key
            for key in ("dO_codes", "dO_scale"):
                assert np.array_equal(bwd[key], run[key][:, :, a:b]), key
            seen += 1
    assert seen >= 8


# ---------------------------------------------------------------- SageBwd: the ring


def _bias_tol(qi, k, config):
    """Bound on |ΔS| from the Q-smoothing bias (a float64 product over D, computed for the whole sequence in the
    single call and per block in the ring): 2·γ(D + 2)·sm_scale·|μ_Q|·|K − μ_K|, per (row, key)."""
    if not config.q_smoothing:
        return 0.0
    B, Hq, Nq, D = qi["q_codes"].shape
    ks = A.expand_kv_heads(np.abs(k - qi["mu_k"][..., None, :]), Hq)
    mag = qi["sm_scale"] * np.matmul(np.abs(qi["mu_q"]), np.swapaxes(ks, -1, -2))
    return 2 * _gamma(D + 2) * np.repeat(mag, config.block_q, axis=-2)[..., :Nq, :]


def _forward_tol(run, qi, config, n_blocks, dS):
    """Worst-case |Δ| between the ring's and the single call's O and LSEs (first-order rounding analysis).

    Both compute ``O = Σ_j a_ij pv_j / l_i`` (``a = P̂ · e^{r_t − M} / p_max``, ``pv = V̂ s_V``, ``l = Σ_j
    e^{S_ij − M}``) with identical codes: each is within γ(2·Nk + W + 2|LSE| + 10·n_blocks + 16) of the exact
    value relative to ``mag = Σ_j a_ij |pv_j| / l_i`` (the two n-term sums; ``W`` the largest exponent argument,
    an argument's rounding being relative error in its exp; a block's LSE's own rounding, carried into the merge
    weights; a few units per merge), and the LSEs within γ(Nk + W + 10·n_blocks + 16)·(1 + |LSE|). Logits that
    each side has within ``dS`` of the exact ones add 4·dS relative to O (through the weights and l) and 2·dS
    to the LSE."""
    B, Hq, Nq, Nk = run["S"].shape
    bkv = config.block_kv
    w = np.repeat(run["P_fwd_weight"], bkv, axis=-1)[..., :Nk]
    v_scale = qi["v_scale"] if config.v_granularity == "channel" else np.repeat(qi["v_scale"], bkv, axis=-2)
    pv = A.expand_kv_heads(qi["v_codes"] * v_scale[..., :Nk, :], Hq)
    l = np.where(run["l"] > 0, run["l"], 1.0)
    mag = np.matmul(run["P_fwd_codes"] * w, np.abs(pv)) / l[..., None]
    vis = run["S"] != -np.inf
    m = np.where(np.isfinite(run["m"]), run["m"], 0.0)
    W = np.max(np.where(vis, m[..., None] - run["S"], 0.0))
    L = max(np.max(np.abs(np.where(np.isfinite(x), x, 0.0))) for x in (run["lse"], run["lse_internal"]))
    dS = float(np.max(dS))
    tol_o = (2 * _gamma(2 * Nk + W + 2 * L + 10 * n_blocks + 16) + 4 * dS) * mag
    tol_lse = 2 * _gamma(Nk + W + 10 * n_blocks + 16) * (1 + L) + 2 * dS
    return tol_o, tol_lse


def _tile_max(x, rows, cols):
    """max|x| over tiles of ``rows × cols`` (None: all), repeated on the tile's entries (quantize_tiles with
    qmax = 1 returns exactly that as its scale)."""
    return np.broadcast_to(quantize_tiles(x, rows, cols, qmax=1)[1], x.shape)


def _backward_tol(run, qi, do, config, dL, d_o, dS, n_q, n_k):
    """Worst-case |Δ| between the ring's and the single call's dQ, dK, dV.

    Base: with identical operands the three products (and the smoothing corrections) differ only by their
    accumulation order, each within γ(n) of ``mag = Σ|a||b|`` over its n terms. Propagation: the ring's
    LSE_internal (``dL``, measured) and O (``d_o``, measured, into δ) move P by the relative ``dL + dS + 2u(1 +
    |S − L|)`` and dS by ``P·(rel_P·|dP − δ| + |Δδ|)``; codes do not move (asserted by the caller), so a tile's
    dequantized values move by at most its scale's change, ``max|Δ|`` over the tile / qmax per code unit. With
    ``ds_int8=False`` X's and Y's codes are their bf16 values at scale 1 (no tile scale), so unmoved codes leave
    dQ's and dK's operands exactly as they were: dS's movement reaches those only through the smoothing terms."""
    B, Hq, Nq, Nk = run["S"].shape
    Hkv, D = qi["k_codes"].shape[1], qi["k_codes"].shape[-1]
    G = Hq // Hkv
    bq, bkv, scale = config.bwd_block_q, config.bwd_block_kv, qi["sm_scale"]
    P, dP, dSm, delta = run["P"], run["dP"], run["dS"], run["delta"]
    kc = A.expand_kv_heads(np.abs(qi["k_codes"].astype(np.float64)), Hq)
    qc = np.abs(qi["q_codes"].astype(np.float64))
    ks = A.expand_kv_heads(qi["k_scale"], Hq)
    mu_q = np.abs(np.repeat(qi["mu_q"], config.block_q, axis=-2)[..., :Nq, :])
    mu_k = A.expand_kv_heads(np.abs(qi["mu_k"])[..., None, :], Hq)
    if config.dv_int8:
        ps, dos = run["P_bwd_codes"] * run["P_bwd_scale"], np.abs(run["dO_codes"] * run["dO_scale"])
    else:  # dV = P^T dO with P itself (no dtype given: unrounded) and dO as given
        ps, dos = run["P_bwd_codes"], np.abs(do)
    xs, ys = np.abs(run["X_codes"] * run["X_scale"]), np.abs(run["Y_codes"] * run["Y_scale"])
    T = np.swapaxes
    # base: the same products summed in another order
    mag_v = A.sum_kv_groups(np.matmul(T(ps, -1, -2), dos), Hkv)
    mag_k = np.matmul(T(ys, -1, -2), qc)
    if config.q_smoothing:
        mag_k = mag_k + scale * np.matmul(T(np.abs(dSm), -1, -2), mu_q)
    mag_k = A.sum_kv_groups(mag_k, Hkv)
    mag_q = scale * np.matmul(xs, kc) + (scale * np.abs(dSm).sum(-1)[..., None] * mu_k
                                         if config.ds_rowsum_correction else 0)
    tol_v = 2 * _gamma(Nq * G + 2 * n_q + 4) * mag_v
    tol_k = 2 * _gamma(2 * Nq * G + 2 * n_q + 4) * mag_k
    tol_q = 2 * _gamma(2 * Nk + 2 * n_k + 4) * mag_q
    # propagation of the forward's differences
    L = np.where(np.isfinite(run["lse_internal"]), run["lse_internal"], 0.0)
    vis = P > 0
    rel_p = np.where(vis, dL[..., None] + dS + 2 * U * (2 + np.abs(np.where(vis, run["S"], 0.0) - L[..., None])), 0.0)
    o = run["O"]
    d_delta = np.sum(np.abs(do) * d_o, axis=-1) + 2 * _gamma(D) * np.sum(np.abs(do * o), axis=-1)
    d_ds = P * (rel_p * np.abs(dP - delta[..., None]) + d_delta[..., None]) + 2 * U * np.abs(dSm)
    col = 1 if config.p_bwd_granularity == "column" else bkv
    # (quantized: a code moves by its scale's change, the tile's largest; else each P by its own)
    d_ps = ps * ((_tile_max(rel_p, bq, col) if config.dv_int8 else rel_p) + 2 * U)
    tol_v = tol_v + A.sum_kv_groups(np.matmul(T(d_ps, -1, -2), dos), Hkv)
    if config.ds_int8:
        rowcol = config.ds_granularity == "rowcol"
        d_x = d_ds * ks[..., None, :]
        d_xs = np.abs(run["X_codes"]) * (_tile_max(d_x, 1 if rowcol else bq, bkv) / 127 + 2 * U * run["X_scale"])
        d_y = qi["q_scale"][..., None] * d_ds
        d_ys = np.abs(run["Y_codes"]) * (_tile_max(d_y, bq, 1 if rowcol else bkv) / 127 + 2 * U * run["Y_scale"])
    else:  # X and Y are their bf16 roundings at the exact scale 1: the unmoved codes are the values themselves
        d_xs = d_ys = np.zeros_like(dSm)
    tol_q = tol_q + scale * np.matmul(d_xs, kc)
    pk = np.matmul(T(d_ys, -1, -2), qc) + (scale * np.matmul(T(d_ds, -1, -2), mu_q) if config.q_smoothing else 0)
    tol_k = tol_k + A.sum_kv_groups(pk, Hkv)
    if config.ds_rowsum_correction:
        tol_q = tol_q + scale * d_ds.sum(-1)[..., None] * mu_k
    return tol_q, tol_k, tol_v


def _within(x, ref, tol):
    return bool(np.all(np.abs(x - ref) <= tol))


def _assert_codes_unmoved(q, k, v, do, causal, config, state, o, run):
    """The backward at the ring's LSE and O moves no code of the single call's (the premise of _backward_tol)."""
    res = sagebwd.forward(q, k, v, causal=causal, config=config)[1]
    res.update(lse_internal=state["lse_internal"], o=o)
    moved = sagebwd.backward(res, do, return_intermediates=True)[3]
    for key in ("P_bwd_codes", "X_codes", "Y_codes", "dO_codes"):
        if key == "P_bwd_codes" and not config.dv_int8:
            continue  # (P itself, not codes: it moves with the LSE, within rel_p of _backward_tol)
        assert np.array_equal(moved[key], run[key]), key


def _sagebwd_case(config, Nq, Nk, R, causal, kind, seed, statistics="global"):
    q, k, v, do = _inputs(1, 4, 2, Nq, Nk, seed=seed)
    plan = _plan(kind, Nq, Nk, R, config)
    o, lse, state = cp.ring_forward(q, k, v, plan, causal=causal, config=config, statistics=statistics)
    grads = cp.ring_backward(state, do)
    return (q, k, v, do), plan, (o, lse, state, grads)


SAGE_CONFIGS = {"small": SMALL, "small-ds8": SMALL_DS8, "paper": PAPER_SMALL, "qsmooth": QSMOOTH}
SAGE_CASES = [(name, R, kind) for name in SAGE_CONFIGS for R in (1, 2, 3, 4) for kind in ("contiguous", "zigzag")]


@pytest.mark.parametrize("Nq, Nk", [(100, 100), (70, 150), (150, 70)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("name, R, kind", SAGE_CASES, ids=[f"{n}-R{R}-{k}" for n, R, k in SAGE_CASES])
def test_sagebwd_ring_equals_single_call(name, R, kind, causal, Nq, Nk):
    config = SAGE_CONFIGS[name]
    (q, k, v, do), plan, (o, lse, state, grads) = _sagebwd_case(config, Nq, Nk, R, causal, kind, seed=R + 3 * Nq)
    run = sagebwd.run(q, k, v, do, causal=causal, config=config)
    qi = sagebwd.quantize_inputs(q, k, v, config=config)
    n_k = max(len(c) for c in plan.k_chunks) * R
    n_q = max(len(c) for c in plan.q_chunks) * R
    dS = _bias_tol(qi, k, config)
    tol_o, tol_lse = _forward_tol(run, qi, config, n_k, dS)
    fin = np.isfinite(run["lse"])
    assert np.array_equal(np.isfinite(lse), fin) and not o[~fin].any()
    assert _within(o, run["O"], tol_o), np.max(np.abs(o - run["O"]) / np.maximum(tol_o, 1e-300))
    assert _within(lse[fin], run["lse"][fin], tol_lse)
    assert _within(state["lse_internal"][fin], run["lse_internal"][fin], tol_lse)
    _assert_codes_unmoved(q, k, v, do, causal, config, state, o, run)
    dL = np.where(fin, np.abs(state["lse_internal"] - np.where(fin, run["lse_internal"], 0.0)), 0.0)
    tols = _backward_tol(run, qi, do, config, dL, np.abs(o - run["O"]), dS, n_q, n_k)
    for what, g, ref, tol in zip(("dQ", "dK", "dV"), grads, (run["dQ"], run["dK"], run["dV"]), tols):
        assert _within(g, ref, tol), (what, float(np.max(np.abs(g - ref) / np.maximum(tol, 1e-300))))
    if R == 1 and kind == "contiguous":  # one block is the single call's computation
        assert np.array_equal(o, run["O"]) and np.array_equal(lse, run["lse"])
        assert all(np.array_equal(g, ref) for g, ref in zip(grads, (run["dQ"], run["dK"], run["dV"])))


def test_sagebwd_ring_default_config():
    """The project default at its own tiles (forward 128 × 128, backward 64 × 64): 2 ranks, zig-zag."""
    for causal in (False, True):
        (q, k, v, do), plan, (o, lse, state, grads) = _sagebwd_case(DEFAULT, 300, 520, 2, causal, "zigzag", 21)
        assert all(a % 64 == 0 for r in plan.q_chunks for a, _ in r)
        assert all(a % 128 == 0 for r in plan.k_chunks for a, _ in r)
        run = sagebwd.run(q, k, v, do, causal=causal, config=DEFAULT)
        qi = sagebwd.quantize_inputs(q, k, v, config=DEFAULT)
        tol_o, tol_lse = _forward_tol(run, qi, DEFAULT, 4, 0.0)
        assert _within(o, run["O"], tol_o) and _within(lse, run["lse"], tol_lse)
        _assert_codes_unmoved(q, k, v, do, causal, DEFAULT, state, o, run)
        dL = np.abs(state["lse_internal"] - run["lse_internal"])
        tols = _backward_tol(run, qi, do, DEFAULT, dL, np.abs(o - run["O"]), 0.0, 4, 4)
        for g, ref, tol in zip(grads, (run["dQ"], run["dK"], run["dV"]), tols):
            assert _within(g, ref, tol)


@pytest.mark.parametrize("causal", [False, True])
def test_local_statistics_are_caught(causal):
    """Each rank quantizing its K/V block with its own mean and V scales (what unmodified single-device calls
    would do) is a different function: outside the rounding bounds by orders of magnitude. dQ suffers most: the
    kernel's dQ omits ``sm_scale · rowsum(dS_i) · μ_K`` because a row of dS sums to zero over *all* keys (§4.4);
    with a mean per block the omitted terms ``Σ_b rowsum_b(dS_i) · μ_b`` no longer cancel."""
    Nq = Nk = 256
    config = SMALL
    (q, k, v, do), plan, (o, lse, state, grads) = _sagebwd_case(config, Nq, Nk, 4, causal, "zigzag", 5, "local")
    *_, (og, lseg, stg, gg) = _sagebwd_case(config, Nq, Nk, 4, causal, "zigzag", 5, "global")
    run = sagebwd.run(q, k, v, do, causal=causal, config=config)
    qi = sagebwd.quantize_inputs(q, k, v, config=config)
    tol_o, _ = _forward_tol(run, qi, config, 8, 0.0)
    assert _within(og, run["O"], tol_o) and not _within(o, run["O"], tol_o)
    assert np.max(np.abs(o - run["O"]) / np.maximum(tol_o, 1e-300)) > 1e6
    kvb = stg["kvb"][1, 0]
    local_kvb = state["kvb"][1, 0]
    a, b = plan.k_chunks[1][0]
    assert np.array_equal(kvb["k_codes"], qi["k_codes"][:, :, a:b])
    assert not np.array_equal(local_kvb["k_codes"], qi["k_codes"][:, :, a:b])
    assert not np.array_equal(local_kvb["v_scale"], qi["v_scale"])
    _assert_codes_unmoved(q, k, v, do, causal, config, stg, og, run)
    dL = np.abs(stg["lse_internal"] - run["lse_internal"])
    dL = np.where(np.isfinite(dL), dL, 0.0)
    tols = _backward_tol(run, qi, do, config, dL, np.abs(og - run["O"]), 0.0, 8, 8)
    for g_local, g_global, ref, tol in zip(grads, gg, (run["dQ"], run["dK"], run["dV"]), tols):
        assert _within(g_global, ref, tol) and not _within(g_local, ref, tol)
    oe, lse_e = A.attention_forward(q, k, v, causal=causal)
    dq_exact = A.attention_backward(q, k, v, oe, lse_e, do, causal=causal)[0]
    assert rel_l2(grads[0], dq_exact) > 3 * rel_l2(gg[0], dq_exact)


# ---------------------------------------------------------------- refusals


def test_refusals_name_the_problem():
    q, k, v, do = _inputs(1, 4, 2, 64, 64)
    with pytest.raises(ValueError, match="cuts a tile"):
        cp.ring_forward(q, k, v, cp.zigzag_plan(64, 64, 3), config=SMALL)
    with pytest.raises(ValueError, match="the plan is for"):
        cp.ring_forward(q, k, v, cp.zigzag_plan(60, 64, 2))
    with pytest.raises(ValueError, match="statistics='local' is for a SageBwd"):
        cp.ring_forward(q, k, v, cp.zigzag_plan(64, 64, 2), statistics="local")
    stats = cp.reduce_statistics([cp.block_statistics(k, v, config=SMALL)])
    qb = cp.sagebwd_quantize_q(q[:, :, 8:40], config=SMALL)
    kvb = cp.sagebwd_quantize_kv(k[:, :, :32], v[:, :, :32], stats, config=SMALL)
    with pytest.raises(ValueError, match="q_pos run \\[8, 40\\) cuts a tile"):
        cp.sagebwd_block_forward(qb, kvb, np.arange(8, 40), np.arange(32), 64, 64)
    with pytest.raises(ValueError, match="v_amax is below"):
        sagebwd.quantize_inputs(q, k, v, config=SMALL, v_amax=np.abs(v).max(axis=-2) / 2)
    with pytest.raises(ValueError, match="k_smoothing is off"):
        sagebwd.quantize_inputs(q, k, v, config=SMALL.replace(k_smoothing=False), mu_k=k.mean(axis=-2))
    with pytest.raises(ValueError, match="v_granularity is 'block'"):
        sagebwd.quantize_inputs(q, k, v, config=PAPER, v_amax=np.abs(v).max(axis=-2))
    with pytest.raises(ValueError, match="mu_k must have shape"):
        sagebwd.quantize_inputs(q, k, v, config=SMALL, mu_k=np.zeros(3))
    cu = np.array([0, 64], dtype=np.int32)
    with pytest.raises(ValueError, match="a packed call takes each sequence's own"):
        sagebwd.quantize_inputs(q[0].swapaxes(0, 1), k[0].swapaxes(0, 1), v[0].swapaxes(0, 1), layout="THD",
                                cu_seqlens_q=cu, cu_seqlens_k=cu, mu_k=np.zeros((1, 2, 16)))
    with pytest.raises(TypeError, match="reduce_statistics"):
        cp.sagebwd_quantize_kv(k, v, None, config=SMALL)
    with pytest.raises(ValueError, match="strictly increasing"):
        cp.pair_mask(np.array([3, 2]), np.arange(4), 4, 4)
