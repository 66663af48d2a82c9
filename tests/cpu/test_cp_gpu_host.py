"""The GPU side of context parallelism (sagecupy/context_parallel.py) without a GPU: the block masks the kernels take
(against the reference's global-position masks), the statistics ``int8.forward`` takes from its caller (validation,
and the launches that then read them instead of computing them), the ``(left, right, shift)`` every INT8 attention
launch passes (the ordinary call's ``nk - nq``, a block's own), the plans, and the fp32 merge and roundings on NumPy."""
import dataclasses
import sys

import numpy as np
import pytest

from test_host_paths import FakeArray, _inputs, gpu  # noqa: F401  (gpu: the fixture)


@pytest.fixture(autouse=True)
def _fresh_plans():
    from sagecupy import int8

    for plans in (int8._FWD_PLANS, int8._BWD_PLANS):
        plans.clear()


def _local_mask(mask, nq, nk):
    """The visible set the kernels compute from (left, right, shift) (rows.cuh Window::keys)."""
    left, right, shift = mask
    i, j = np.arange(nq)[:, None], np.arange(nk)[None, :]
    ok = np.ones((nq, nk), dtype=bool)
    if right != -1:
        ok &= j <= i + shift + right
    if left != -1:
        ok &= j >= i + shift - left
    return ok


@pytest.mark.parametrize("causal,window", [(False, None), (True, None), (False, (5, 3)), (True, (7, 0)),
                                           (False, (0, -1)), (False, (-1, 2))])
def test_block_mask_is_the_reference_pair_mask(causal, window):
    from sagecupy.context_parallel import block_mask
    from sagecupy.reference.context_parallel import pair_mask, pair_visible

    r = np.random.default_rng(3)
    for _ in range(300):
        Nq, Nk = int(r.integers(1, 60)), int(r.integers(1, 60))
        qa = int(r.integers(0, Nq)); qb = int(r.integers(qa + 1, Nq + 1))
        ka = int(r.integers(0, Nk)); kb = int(r.integers(ka + 1, Nk + 1))
        mask = block_mask((qa, qb), (ka, kb), Nq, Nk, causal, window)
        want = pair_mask(np.arange(qa, qb), np.arange(ka, kb), Nq, Nk, causal, window)
        np.testing.assert_array_equal(_local_mask(mask, qb - qa, kb - ka), want)
        assert want.any() == pair_visible((qa, qb), (ka, kb), Nq, Nk, causal, window)
        if (qa, qb, ka, kb) == (0, Nq, 0, Nk) and window is None:  # the whole call: the kernels' own values
            assert mask[2] == Nk - Nq


@pytest.mark.parametrize("bad", [(0, 0), (3, 2), (-1, 4), (0, 101), [0, 4], (0.0, 4)])
def test_block_mask_refuses_bad_ranges(bad):
    from sagecupy.context_parallel import block_mask

    with pytest.raises(ValueError, match="q_range"):
        block_mask(bad, (0, 10), 100, 70)


def _stats(B=2, H=2, D=128, dtype=np.float32):
    return {"mu_k": FakeArray((B, H, D), dtype), "v_scale": FakeArray((B, H, D), dtype)}


def _mask_args(launch, scalar):
    """The three ints after the launch's first float32 scalar (p_max or sm_scale): (left, right, shift)."""
    args = launch[3]
    i = next(n for n, a in enumerate(args) if isinstance(a, np.float32))
    assert args[i].item() == pytest.approx(scalar), launch[0]
    assert all(isinstance(a, np.int32) for a in args[i + 1:i + 4]), launch[0]
    return tuple(int(a) for a in args[i + 1:i + 4])


@pytest.mark.parametrize("engine", ["wgmma", "mma"])
def test_given_statistics_replace_the_statistics_launches(gpu, engine):
    from sagecupy import int8

    q, k, v = _inputs(nq=100, nk=70)
    st = _stats()
    for call in (int8.forward, int8.sage_attention):
        for _ in range(2):  # recorded, replayed
            start = len(gpu)
            call(q, k, v, statistics=st, engine=engine)
            names = [x[0].split("<")[0] for x in gpu[start:]]
            assert "column_partial_kv" not in names and "column_finish_kv" not in names, names
            quant = [x for x in gpu[start:] if x[0].startswith("quant_")]
            assert any(st["mu_k"] in x[3] for x in quant)  # K smoothed with the caller's mean
            assert any(st["v_scale"] in x[3] for x in quant)  # V quantized with the caller's scales
    _, res = int8.forward(q, k, v, statistics=st, engine=engine)
    assert res.mu_k is st["mu_k"] and res.mask is None
    start = len(gpu)
    int8.forward(q, k, v, engine=engine)  # without: computed again
    assert [x[0].split("<")[0] for x in gpu[start:start + 2]] == ["column_partial_kv", "column_finish_kv"]


BAD_STATS = [
    ({"mu_k": None}, TypeError, "exactly the keys"),
    ("mu_k", TypeError, "statistics"),
    ({**_stats(), "extra": 1}, TypeError, "exactly the keys"),
    ({"mu_k": FakeArray((2, 2, 128), np.float32), "v_scale": FakeArray((2, 2, 64), np.float32)}, ValueError,
     r"statistics\['v_scale'\]"),
    ({"mu_k": FakeArray((2, 4, 128), np.float32), "v_scale": FakeArray((2, 2, 128), np.float32)}, ValueError,
     r"statistics\['mu_k'\]"),
    ({"mu_k": FakeArray((2, 2, 128), np.float16), "v_scale": FakeArray((2, 2, 128), np.float32)}, (TypeError,
                                                                                                 ValueError),
     r"statistics\['mu_k'\]"),
]


@pytest.mark.parametrize("stats,exc,words", BAD_STATS)
def test_bad_statistics_are_refused_before_any_launch(gpu, stats, exc, words):
    from sagecupy import int8

    q, k, v = _inputs()
    for call in (int8.forward, int8.sage_attention):
        with pytest.raises(exc, match=words):
            call(q, k, v, statistics=stats)
    assert gpu == []


def test_statistics_on_another_device_are_refused_after_a_recorded_call(gpu):
    """The recorded plan is keyed by the statistics' devices too: a replay skips check_statistics."""
    from sagecupy import int8

    q, k, v = _inputs()
    for call in (int8.forward, int8.sage_attention):
        call(q, k, v, statistics=_stats())  # recorded
        elsewhere = _stats()
        elsewhere["mu_k"].data.device_id = 1
        start = len(gpu)
        with pytest.raises(ValueError, match=r"statistics\['mu_k'\].*device"):
            call(q, k, v, statistics=elsewhere)
        assert len(gpu) == start


@pytest.mark.parametrize("config,words", [("paper", "v_granularity"),
                                          (dict(k_smoothing=False), "k_smoothing")])
def test_statistics_need_a_config_with_exactly_these_two(gpu, config, words):
    from sagecupy import int8
    from sagecupy.config import get_config

    cfg = get_config("default").replace(**config) if isinstance(config, dict) else get_config(config)
    if cfg.v_granularity == "channel" and cfg.k_smoothing:
        pytest.skip("config carries both statistics")
    q, k, v = _inputs()
    with pytest.raises(ValueError, match=words):
        int8.forward(q, k, v, statistics=_stats(), config=cfg)
    assert gpu == []


def test_statistics_are_refused_for_packed_sequences(gpu):
    from sagecupy import int8

    q, k, v = (FakeArray((50, 2, 64), np.float16) for _ in range(3))
    with pytest.raises(ValueError, match="packed"):
        int8.forward(q, k, v, layout="THD", cu_seqlens_q=[0, 20, 50], cu_seqlens_k=[0, 20, 50],
                     statistics=_stats(D=64))


@pytest.mark.parametrize("engine", ["wgmma", "mma"])
@pytest.mark.parametrize("causal,window", [(False, None), (True, None), (False, (9, 2))])
def test_ordinary_launches_pass_nk_minus_nq(gpu, engine, causal, window):
    from sagecupy import int8
    from sagecupy.config import get_config

    q, k, v = _inputs(nq=100, nk=70)
    do = FakeArray(q.shape, q.dtype)
    _, res = int8.forward(q, k, v, causal=causal, window=window, engine=engine)
    int8.backward(res, do, engine=engine)
    attn = [x for x in gpu if x[0].startswith("int8_attn")]
    assert len(attn) == 3
    want = (*int8.kernel_window(res.problem), 70 - 100)
    p_max = get_config(None).p_max
    assert _mask_args(attn[0], p_max) == want and _mask_args(attn[1], p_max) == want
    assert _mask_args(attn[2], res.problem.sm_scale) == want


@pytest.mark.parametrize("engine", ["wgmma", "mma"])
def test_a_block_mask_reaches_every_attention_launch(gpu, engine):
    """A block's (left, right, shift) through the private launch (as context_parallel.block_forward calls it) and
    through Residuals.mask to both backward kernels; the launch programs are keyed on it."""
    from sagecupy import int8
    from sagecupy.config import get_config
    from sagecupy.context_parallel import block_mask

    q, k, v = _inputs(nq=100, nk=70)
    do = FakeArray(q.shape, q.dtype)
    p_max = get_config(None).p_max
    for mask in (block_mask((128, 228), (64, 134), 356, 198, True), block_mask((0, 100), (128, 198), 356, 198, True),
                 (-1, -1, 5)):
        for _ in range(2):  # recorded, replayed
            plan, pre = int8._prepass(q, k, v, causal=True, sm_scale=None, layout="HND", config=None, engine=engine,
                                      statistics=_stats())
            start = len(gpu)
            int8._launch_forward(plan.p, plan.cfg, pre, engine, mask)
            assert _mask_args(gpu[start], p_max) == mask
        _, res = int8.forward(q, k, v, causal=True, engine=engine)
        res = dataclasses.replace(res, mask=mask)
        for _ in range(2):
            start = len(gpu)
            int8.backward(res, do, engine=engine)
            dkdv, dq = [x for x in gpu[start:] if x[0].startswith("int8_attn")]
            assert _mask_args(dkdv, p_max) == mask and _mask_args(dq, res.problem.sm_scale) == mask
    assert block_mask((128, 228), (64, 134), 356, 198, True) == (-1, 0, 128 - 64 + 198 - 356)
    assert block_mask((256, 356), (0, 70), 356, 198, True) == (-1, -1, 256 + 198 - 356)  # sees every key


@pytest.mark.parametrize("mask", [(0, 0), (-2, 0, 0), (0, 0, 2 ** 31), (0.0, 0, 0), [0, 0, 0]])
def test_a_bad_block_mask_is_refused(gpu, mask):
    from sagecupy import int8

    q, k, v = _inputs()
    _, res = int8.forward(q, k, v)
    start = len(gpu)
    with pytest.raises((ValueError, TypeError), match="mask"):
        int8.backward(dataclasses.replace(res, mask=mask), FakeArray(q.shape, q.dtype))
    assert len(gpu) == start


@pytest.mark.parametrize("kind", ["zigzag", "contiguous"])
@pytest.mark.parametrize("ranks,Nq,Nk", [(2, 1000, 1000), (3, 777, 1301), (3, 200, 90)])
def test_plans_are_the_reference_plans_aligned(kind, ranks, Nq, Nk):
    from sagecupy import context_parallel as cp
    from sagecupy.reference import context_parallel as ref

    aq, ak = ref.sagebwd_alignment("default")
    plan = cp.make_plan(kind, Nq, Nk, ranks)
    build = ref.zigzag_plan if kind == "zigzag" else ref.contiguous_plan
    assert plan == build(Nq, Nk, ranks, align_q=aq, align_k=ak)
    for r in range(ranks):
        for a, b in plan.q_chunks[r]:
            assert a % aq == 0 and (b % aq == 0 or b == Nq)
    assert cp.make_plan(plan, Nq, Nk, ranks) is plan
    with pytest.raises(ValueError, match="cuts a tile"):
        cp.make_plan(ref.contiguous_plan(1000, 1000, 2), 1000, 1000, 2)  # (boundary 500)
    with pytest.raises(ValueError, match="plan="):
        cp.make_plan("ring", Nq, Nk, ranks)


def test_configs_without_the_two_statistics_are_refused():
    from sagecupy import context_parallel as cp

    with pytest.raises(ValueError, match="v_granularity"):
        cp.make_plan("zigzag", 256, 256, 2, config="paper")


# ---- the fp32 merge and the roundings, with NumPy standing in for CuPy ----


@pytest.fixture
def numpy_cupy(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", np)


def test_merge_is_the_reference_merge_in_fp32(numpy_cupy):
    from sagecupy import context_parallel as cp
    from sagecupy.reference.context_parallel import merge_partials

    r = np.random.default_rng(5)
    o_a, o_b = (r.standard_normal((2, 3, 40, 16)).astype(np.float32) for _ in range(2))
    l_a, l_b = (r.standard_normal((2, 3, 40)).astype(np.float32) * 30 for _ in range(2))
    l_a[0, 0, :5] = -np.inf
    l_b[0, 0, 3:8] = -np.inf
    o_a[0, 0, :5] = 0  # (a row that saw no key has o = 0)
    o_b[0, 0, 3:8] = 0
    with np.errstate(invalid="ignore", over="ignore"):
        o, lse = cp._merge(o_a, l_a, o_b, l_b, False)
        o2, lse2 = cp._merge(o_a, l_a / np.float32(np.log(2)), o_b, l_b / np.float32(np.log(2)), True)
    o_ref, lse_ref = merge_partials(o_a, l_a, o_b, l_b)
    assert o.dtype == np.float32 and lse.dtype == np.float32
    np.testing.assert_allclose(o, o_ref, rtol=2e-6, atol=2e-6)
    np.testing.assert_allclose(lse, lse_ref, rtol=2e-6, atol=2e-6)
    np.testing.assert_allclose(o2, o_ref, rtol=2e-6, atol=2e-6)
    np.testing.assert_allclose(lse2 * np.log(2), lse_ref, rtol=2e-6, atol=2e-6)
    assert np.all(lse[0, 0, 3:5] == -np.inf) and np.all(o[0, 0, 3:5] == 0)
    # a partial that saw nothing leaves the other one bit for bit (the ring's first merge)
    o3, l3 = cp._merge(np.zeros_like(o_a), np.full_like(l_a, -np.inf), o_b, l_b, True)
    np.testing.assert_array_equal(o3, o_b)
    np.testing.assert_array_equal(l3, l_b)


def test_roundings_are_round_to_nearest_even(numpy_cupy):
    ml_dtypes = pytest.importorskip("ml_dtypes")  # (a test extra, setup.cfg)

    from sagecupy import context_parallel as cp

    r = np.random.default_rng(6)
    x = (r.standard_normal(10000) * np.exp(r.uniform(-20, 20, 10000))).astype(np.float32)
    x[:4] = [np.inf, -np.inf, np.nan, 0.0]
    with np.errstate(over="ignore"):
        np.testing.assert_array_equal(cp._to_dtype(x, "float16"), x.astype(np.float16))
    want = x.astype(ml_dtypes.bfloat16).view(np.uint16)
    got = cp._to_dtype(x, "bfloat16")
    np.testing.assert_array_equal(got[3:], want[3:])
    assert np.isnan(got.view(ml_dtypes.bfloat16)[2].astype(np.float32))
    back = cp._as_f32(want)
    np.testing.assert_array_equal(back, want.view(ml_dtypes.bfloat16).astype(np.float32))
