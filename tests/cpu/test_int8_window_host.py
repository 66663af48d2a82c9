"""The sliding window (``window=(left, right)``, docs/algorithms.md §1.8) on the INT8 host paths without a GPU (the
stand-in cupy of test_host_paths): validation on every entry point, the residuals that carry it to the backward, and
the two ints every attention kernel launch passes for it. The autograd shim's window on NumPy (FPA and the simulator)
against the float64 references."""
import dataclasses

import numpy as np
import pytest

from test_host_paths import FakeArray, _inputs, gpu  # noqa: F401  (gpu: the fixture)


@pytest.fixture(autouse=True)
def _fresh_plans():
    """Recorded programs hold the kernels of the test that recorded them: start every test without any."""
    from sagecupy import int8

    for plans in (int8._FWD_PLANS, int8._BWD_PLANS):
        plans.clear()


BAD_WINDOWS = [
    ((1,), "window"), ((1, 2, 3), "window"), ((-2, 0), "window"), ((0, -5), "window"), ((1.5, 0), "window"),
    ((True, 0), "window"), ("ab", "window"), (5, "window"), ((None, 0), "window"),
]


@pytest.mark.parametrize("window,words", BAD_WINDOWS, ids=[repr(w) for w, _ in BAD_WINDOWS])
def test_bad_windows_are_refused_naming_window(gpu, window, words):
    from sagecupy import int8

    q, k, v = _inputs()
    for call in (int8.forward, int8.sage_attention):
        with pytest.raises(ValueError, match=words):
            call(q, k, v, window=window)
    ok, why = int8.is_supported(q, k, v, window=window)
    assert not ok and "window" in why
    assert gpu == []  # refused before any launch


def test_causal_with_a_right_edge_is_refused_naming_both(gpu):
    from sagecupy import int8

    q, k, v = _inputs()
    with pytest.raises(ValueError, match=r"causal=True contradicts window=\(3, 1\)"):
        int8.forward(q, k, v, causal=True, window=(3, 1))
    ok, why = int8.is_supported(q, k, v, causal=True, window=(3, 1))
    assert not ok and "causal" in why and "window" in why
    assert int8.is_supported(q, k, v, causal=True, window=(3, 0)) == (True, "")
    assert int8.is_supported(q, k, v, window=[-1, 7]) == (True, "")


def test_a_refused_window_is_not_taken_from_the_plan_cache(gpu):
    """(5.0, 0) hashes as (5, 0): the plan recorded for (5, 0) must not make it pass."""
    from sagecupy import int8

    q, k, v = _inputs()
    int8.forward(q, k, v, window=(5, 0))
    int8.forward(q, k, v, window=(5, 0))  # replayed
    with pytest.raises(ValueError, match="window"):
        int8.forward(q, k, v, window=(5.0, 0))


def _window_args(launch, scalar):
    """The two ints after the launch's first float32 scalar (p_max or sm_scale): the kernel's (left, right)."""
    args = launch[3]
    i = next(n for n, a in enumerate(args) if isinstance(a, np.float32))
    assert isinstance(args[i + 1], np.int32) and isinstance(args[i + 2], np.int32), launch[0]
    assert args[i].item() == pytest.approx(scalar), launch[0]
    return int(args[i + 1]), int(args[i + 2])


# (causal, window) -> what the kernels get for nq = 100, nk = 70: causal is (-1, 0); a side wider than the sequence
# (left >= nk, right >= nq) is unbounded (-1).
KERNEL_WINDOWS = [
    (False, None, (-1, -1)), (True, None, (-1, 0)), (False, (-1, 0), (-1, 0)), (False, (-1, -1), (-1, -1)),
    (False, (17, 0), (17, 0)), (True, (17, 0), (17, 0)), (False, (5, 5), (5, 5)), (False, (0, 0), (0, 0)),
    (False, (69, 99), (69, 99)), (False, (70, 100), (-1, -1)), (False, (10**12, 3), (-1, 3)),
    (False, (np.int64(4), 2), (4, 2)),
]


@pytest.mark.parametrize("engine", ["wgmma", "mma"])
@pytest.mark.parametrize("causal,window,want", KERNEL_WINDOWS, ids=[f"{c}-{w}" for c, w, _ in KERNEL_WINDOWS])
def test_every_attention_launch_passes_the_window(gpu, engine, causal, window, want):
    from sagecupy import int8
    from sagecupy.config import get_config

    q, k, v = _inputs(nq=100, nk=70)
    do = FakeArray(q.shape, q.dtype)
    p_max = get_config(None).p_max
    for _ in range(2):  # recorded, then replayed
        start = len(gpu)
        o, res = int8.forward(q, k, v, causal=causal, window=window, engine=engine)
        want_problem = None if window is None else tuple(int(w) for w in window)
        assert res.problem.window == want_problem and res.problem.causal is causal
        assert int8.kernel_window(res.problem) == want
        int8.backward(res, do, engine=engine)
        int8.sage_attention(q, k, v, causal=causal, window=window, engine=engine)
        launches = gpu[start:]
        attn = [x for x in launches if x[0].startswith("int8_attn")]
        sfx = "_sm90" if engine == "wgmma" else ""
        assert [x[0].split("<")[0] for x in attn] == [f"int8_attn_fwd{sfx}", f"int8_attn_bwd{sfx}",
                                                      f"int8_attn_bwd_dq{sfx}", f"int8_attn_fwd{sfx}"]
        fwd, dkdv, dq, infer = attn
        for launch in (fwd, dkdv, infer):
            assert _window_args(launch, p_max) == want
        assert _window_args(dq, res.problem.sm_scale) == want


def test_window_changes_the_launch_not_the_pre_pass(gpu):
    """Two windows: the same pre-pass launches (K's mean and V's scales over all the keys, as the simulator takes
    them: grids and scalars equal), and attention kernels that differ in the window's ints."""
    from sagecupy import int8
    from sagecupy.config import get_config

    q, k, v = _inputs()
    runs = []
    for window in ((3, 0), (40, 2)):
        start = len(gpu)
        int8.forward(q, k, v, window=window, engine="mma")
        runs.append(gpu[start:])

    def pre_pass(launches):
        return [(n, g, b, [a.item() for a in args if isinstance(a, np.generic) and not isinstance(a, np.uint64)])
                for n, g, b, args, _ in launches if not n.startswith("int8_attn")]

    assert pre_pass(runs[0]) == pre_pass(runs[1]) != []
    assert [_window_args(r[-1], get_config(None).p_max) for r in runs] == [(3, 0), (40, 2)]


# Forged windows in a causal=True forward's residuals (window=(9, 0)) and what the backward's error says (also
# test_fp4_window_host's)
BAD_RESIDUAL_WINDOWS = (((3, 1), r"residuals\.problem: causal=True contradicts window=\(3, 1\)"),
                        ([9, 0], r"residuals\.problem\.window=\[9, 0\] must be None or a pair"),
                        ((9.0, 0), r"residuals\.problem\.window=\(9\.0, 0\)"),
                        ((-2, 0), r"residuals\.problem\.window=\(-2, 0\)"), ((1, 2, 3), "window"))


def test_residual_window_is_checked(gpu):
    from sagecupy import int8

    q, k, v = _inputs()
    _, res = int8.forward(q, k, v, causal=True, window=(9, 0))
    do = FakeArray(q.shape, q.dtype)
    p = res.problem
    start = len(gpu)
    for window, words in BAD_RESIDUAL_WINDOWS:
        with pytest.raises(ValueError, match=words):
            int8.backward(dataclasses.replace(res, problem=dataclasses.replace(p, window=window)), do)
    assert len(gpu) == start
    int8.backward(res, do)  # the forward's own residuals pass


# ---- the autograd shim on NumPy ----

SHIM_CASES = [(4, 2, 9, 13, False, (3, 0)), (2, 2, 13, 9, True, (2, 0)), (2, 1, 8, 8, False, (1, 2)),
              (2, 2, 7, 11, False, (-1, 1)), (2, 2, 11, 7, False, (0, -1))]


@pytest.mark.parametrize("Hq,Hkv,Nq,Nk,causal,window", SHIM_CASES)
def test_fpa_window_matches_reference(Hq, Hkv, Nq, Nk, causal, window):
    from sagecupy import autograd as ag
    from sagecupy.reference import attention as A

    r = np.random.default_rng(1)
    q, k, v = r.standard_normal((1, Hq, Nq, 8)), r.standard_normal((1, Hkv, Nk, 8)), r.standard_normal((1, Hkv, Nk, 8))
    o, res = ag.fpa_forward(q, k, v, causal=causal, window=window)
    o_ref, lse = A.attention_forward(q, k, v, causal=causal, window=window)
    np.testing.assert_allclose(o, o_ref, rtol=1e-12, atol=1e-12)
    do = r.standard_normal(o.shape)
    want = A.attention_backward(q, k, v, o_ref, lse, do, causal=causal, window=window)
    for got, w in zip(ag.fpa_backward(res, do), want):
        np.testing.assert_allclose(got, w, rtol=1e-10, atol=1e-12)
    with pytest.raises(ValueError, match="window"):
        ag.fpa_forward(q, k, v, window=(-3, 0))


def test_sagebwd_op_with_a_window_is_the_simulator():
    from sagecupy import autograd as ag
    from sagecupy.reference import sagebwd as S

    r = np.random.default_rng(2)
    q, k, v, do = (r.standard_normal((1, 2, 90, 64)) for _ in range(4))
    qv, kv, vv = (ag.Variable(t) for t in (q, k, v))
    o = ag.attention(qv, kv, vv, impl="sagebwd", causal=True, window=(20, 0))
    o.backward(do)
    o_ref, res = S.forward(q, k, v, causal=True, window=(20, 0))
    np.testing.assert_array_equal(o.value, o_ref)
    for got, want in zip((qv.grad, kv.grad, vv.grad), S.backward(res, do)):
        np.testing.assert_array_equal(got, want)
