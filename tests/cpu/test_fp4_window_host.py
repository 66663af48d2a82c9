"""The sliding window (``window=(left, right)``, docs/algorithms.md §1.8) on the NVFP4 and FP4 QAT host paths without a
GPU (the stand-in cupy of test_host_paths): validation on every entry point (naming ``window``), the residuals that
carry it to the QAT backward, the two ints every attention kernel launch passes for it, the dispatch order and tail
split it selects, and a pre-pass that does not depend on it."""
import dataclasses

import numpy as np
import pytest

from test_host_paths import FakeArray, _inputs, gpu, stub_views  # noqa: F401  (gpu: the fixture)
from test_int8_window_host import BAD_RESIDUAL_WINDOWS


@pytest.fixture(autouse=True)
def _fresh_plans():
    """Recorded programs hold the kernels of the test that recorded them: start every test without any."""
    from sagecupy import nvfp4

    nvfp4._ATTN_PLANS.clear()


BAD_WINDOWS = [
    ((1,), "window"), ((1, 2, 3), "window"), ((-2, 0), "window"), ((0, -5), "window"), ((1.5, 0), "window"),
    ((True, 0), "window"), ("ab", "window"), (5, "window"), ((None, 0), "window"),
]


def _packed_ops(nq=100, nk=128, d=128):
    """Exchange-format operands of the shapes attention_packed takes (B 2, Hq 4, Hkv 2)."""
    n16 = (nk + 15) // 16 * 16
    return {n: FakeArray(sh, np.uint8) for n, sh in (
        ("q_packed", (2, 4, nq, d // 2)), ("q_scales", (2, 4, nq, d // 16)), ("k_packed", (2, 2, nk, d // 2)),
        ("k_scales", (2, 2, nk, d // 16)), ("v_packed", (2, 2, d, n16 // 2)), ("v_scales", (2, 2, d, n16 // 16)))}


@pytest.mark.parametrize("window,words", BAD_WINDOWS, ids=[repr(w) for w, _ in BAD_WINDOWS])
def test_bad_windows_are_refused_naming_window(gpu, window, words):
    from sagecupy import nvfp4, qat

    q, k, v = _inputs(nk=128)
    for call in (nvfp4.attention, nvfp4.forward, qat.forward, qat.qat_attention):
        with pytest.raises(ValueError, match=words):
            call(q, k, v, window=window)
    with pytest.raises(ValueError, match=words):
        nvfp4.attention_packed(_packed_ops(), window=window)
    for mod in (nvfp4, qat):
        ok, why = mod.is_supported(q, k, v, window=window)
        assert not ok and "window" in why
    assert gpu == []  # refused before any launch


def test_causal_with_a_right_edge_is_refused_naming_both(gpu):
    from sagecupy import nvfp4, qat

    q, k, v = _inputs(nk=128)
    for call in (nvfp4.attention, qat.forward):
        with pytest.raises(ValueError, match=r"causal=True contradicts window=\(3, 1\)"):
            call(q, k, v, causal=True, window=(3, 1))
    with pytest.raises(ValueError, match=r"causal=True contradicts window=\(3, 1\)"):
        nvfp4.attention_packed(_packed_ops(), causal=True, window=(3, 1))
    for mod in (nvfp4, qat):
        ok, why = mod.is_supported(q, k, v, causal=True, window=(3, 1))
        assert not ok and "causal" in why and "window" in why
        assert mod.is_supported(q, k, v, causal=True, window=(3, 0)) == (True, "")
        assert mod.is_supported(q, k, v, window=[-1, 7]) == (True, "")
    assert gpu == []


def test_a_refused_window_is_not_taken_from_the_plan_cache(gpu):
    """(5.0, 0) hashes as (5, 0): the plan recorded for (5, 0) must not make it pass."""
    from sagecupy import nvfp4

    q, k, v = _inputs(nk=128)
    nvfp4.attention(q, k, v, window=(5, 0))
    nvfp4.attention(q, k, v, window=(5, 0))  # replayed
    with pytest.raises(ValueError, match="window"):
        nvfp4.attention(q, k, v, window=(5.0, 0))


def _window_args(launch, scalar):
    """The two ints right after the launch's float32 scalar equal to ``scalar`` (scale_log2 or sm_scale): the kernel's
    (left, right)."""
    args = launch[3]
    i = next(n for n, a in enumerate(args) if isinstance(a, np.float32) and a.item() == pytest.approx(scalar))
    assert isinstance(args[i + 1], np.int32) and isinstance(args[i + 2], np.int32), launch[0]
    return int(args[i + 1]), int(args[i + 2])


def test_kernel_window_and_causal_shape():
    from sagecupy import nvfp4
    from sagecupy._checks import Problem

    def p(nq, nk, causal, window):
        return Problem(1, 1, 1, nq, nk, 64, "float16", "HND", causal, 0.125, window)

    assert nvfp4.kernel_window(p(100, 70, False, None)) == (-1, -1)
    assert nvfp4.kernel_window(p(100, 70, True, None)) == (-1, 0)
    assert nvfp4.kernel_window(p(100, 70, False, (68, 98))) == (68, 98)
    assert nvfp4.kernel_window(p(100, 70, False, (69, 99))) == (-1, -1)  # (the narrowest window that hides nothing)
    assert nvfp4.kernel_window(p(100, 70, False, (70, 100))) == (-1, -1)
    assert nvfp4.kernel_window(p(100, 70, True, (69, 0))) == (-1, 0)
    assert nvfp4.kernel_window(p(70, 100, False, (99, 5))) == (-1, 5)
    # one row: every right edge hides nothing, 0 (causal's) kept
    assert [nvfp4.kernel_window(p(1, 9, c, w)) for c, w in ((False, (0, 0)), (True, None), (False, (2, 1)))] == [
        (0, 0), (-1, 0), (2, -1)]
    assert [nvfp4.causal_shape(w) for w in ((-1, 0), (-1, 5), (-1, -1), (3, 0), (3, -1), (0, 0))] == [
        True, True, False, False, False, False]


# (causal, window) -> what the kernels get for nq = 100, nk = 128: causal is (-1, 0); a side that bounds no row
# (left >= nk - 1, right >= nq - 1) is unbounded (-1).
NV_WINDOWS = [
    (False, None, (-1, -1)), (True, None, (-1, 0)), (False, (-1, 0), (-1, 0)), (False, (-1, -1), (-1, -1)),
    (False, (17, 0), (17, 0)), (True, (17, 0), (17, 0)), (False, (5, 5), (5, 5)), (False, (0, 0), (0, 0)),
    (False, (126, 98), (126, 98)), (False, (127, 99), (-1, -1)), (True, (127, 0), (-1, 0)),
    (False, (10**12, 3), (-1, 3)), (False, (np.int64(4), 2), (4, 2)), (False, [3, 1], (3, 1)),
]


@pytest.mark.parametrize("engine,d", [("mma", 64), ("mma", 128), ("wgmma", 64), ("wgmma", 128)])
@pytest.mark.parametrize("causal,window,want", NV_WINDOWS, ids=[f"{c}-{w}" for c, w, _ in NV_WINDOWS])
def test_every_nvfp4_launch_passes_the_window(gpu, engine, d, causal, window, want):
    """attention (recorded, then replayed) and attention_packed: the kernel's (left, right) after scale_log2; the
    wgmma kernels' causal dispatch group (CG 16) exactly for the causal work shape (an unbounded left edge, a bounded
    right one), so that window=(-1, 0) launches what causal=True does."""
    from sagecupy import nvfp4

    q, k, v = _inputs(nk=128, d=d)
    scale = 0.125
    launches = []
    for _ in range(2):
        start = len(gpu)
        nvfp4.attention(q, k, v, causal=causal, window=window, engine=engine, sm_scale=scale)
        launches.append(gpu[-1])
        assert len(gpu) > start
    start = len(gpu)
    nvfp4.attention_packed(_packed_ops(d=d), causal=causal, window=window, engine=engine, sm_scale=scale)
    launches.append(gpu[-1])
    cg16 = nvfp4.causal_shape(want)
    for name, grid, block, args, smem in launches:
        assert name.startswith("nvfp4_attn_fwd")
        assert _window_args((name, grid, block, args, smem), scale * nvfp4.LOG2E) == want
        if engine == "wgmma":
            assert (", 16" in name) == cg16, name
    assert launches[0][0] == launches[1][0] == launches[2][0]


def test_windowed_calls_launch_what_causal_and_full_calls_launch(gpu):
    """window=(-1, 0) is causal=True and window=(-1, -1) (or wider than the sequence) causal=False, launch for launch:
    the same instances, grids and scalars (the outputs' addresses aside)."""
    from sagecupy import nvfp4

    q, k, v = _inputs(nk=128)

    def run(**kw):
        start = len(gpu)
        nvfp4.attention(q, k, v, engine="wgmma", **kw)
        return [(n, g, b, [a.item() for a in args if isinstance(a, np.generic) and not isinstance(a, np.uint64)])
                for n, g, b, args, _ in gpu[start:]]

    assert run(causal=True) == run(window=(-1, 0)) == run(causal=True, window=(127, 0)) == run(window=(500, 0))
    assert run() == run(window=(-1, -1)) == run(window=(127, 99)) == run(window=(10**9, 10**9))
    assert run() == run(window=(127, -1)) == run(window=(-1, 99))
    assert run(window=(126, 99)) != run()


def test_window_changes_the_kernel_launch_not_the_pre_pass(gpu):
    """Two windows: the same pre-pass launches (K's mean and V's 16-token blocks over all the keys, as the simulator
    takes them: names, grids and scalars equal), and attention kernels that differ in the window's ints."""
    from sagecupy import nvfp4

    q, k, v = _inputs(nk=128)
    runs = []
    for window in ((3, 0), (40, 2)):
        start = len(gpu)
        nvfp4.attention(q, k, v, window=window, engine="mma", sm_scale=0.125)
        runs.append(gpu[start:])

    def pre_pass(launches):
        return [(n, g, b, [a.item() for a in args if isinstance(a, np.generic) and not isinstance(a, np.uint64)])
                for n, g, b, args, _ in launches if not n.startswith("nvfp4_attn")]

    assert pre_pass(runs[0]) == pre_pass(runs[1]) != []
    assert [_window_args(r[-1], 0.125 * nvfp4.LOG2E) for r in runs] == [(3, 0), (40, 2)]


@pytest.mark.parametrize("window,split", [(None, 2), ((100, 100), 2), ((5, 5), None), ((300, -1), 2), ((-1, 3), None),
                                          ((-1, 0), None), ((10**6, 10**6), 2)])
def test_tail_split_of_windowed_calls(gpu, monkeypatch, window, split):
    """The tail split (D=128, wgmma, two-level P) where the grid keeps the plain order, as for causal=False: B 2 x Hq 4
    x 3 items of 192 rows on 7 SMs leave 3 items, split in 2 parts where an item may see 8 key tiles or more (a window
    bounded on both sides: 192 rows + left + right keys, (100, 100) 8 tiles, (5, 5) 5); windows of the causal shape
    keep whole items (the causal dispatch group). The parts split each item's own range of tiles (in the kernel)."""
    from sagecupy import nvfp4

    monkeypatch.setattr(nvfp4, "_zero_ints", lambda c: gpu.append(("zero", c)) or ())
    monkeypatch.setattr(nvfp4, "_sm_count", lambda device_id: 7)
    q, k, v = _inputs(nq=400, nk=1024)
    nvfp4.attention(q, k, v, window=window)
    name, grid, block, args, smem = gpu[-1]
    want = nvfp4.kernel_window(dataclasses.replace(_problem(400, 1024), window=window))
    assert _window_args(gpu[-1], nvfp4.LOG2E / np.sqrt(128)) == want
    if split is None:
        assert name.endswith(", false>") and not any(x[0] == "zero" for x in gpu)
        assert (", 16, 3," in name) == nvfp4.causal_shape(want)
    else:
        assert name == "nvfp4_attn_fwd_ws_img<__half, 128, true, 1, 3, false, true>"
        assert grid == (21 + 3 * split,) and args[-5:-2] == (np.int32(21), np.int32(split), np.int32(3))


def _problem(nq, nk):
    from sagecupy._checks import Problem

    return Problem(2, 4, 2, nq, nk, 128, "float16", "HND", False, 128 ** -0.5, None)


# (causal, window) -> what the QAT kernels get for nq = 128, nk = 64 (padded lengths: the fake arrays cannot zero a
# padding)
QAT_WINDOWS = [
    (False, None, (-1, -1)), (True, None, (-1, 0)), (False, (-1, 0), (-1, 0)), (False, (17, 0), (17, 0)),
    (True, (17, 0), (17, 0)), (False, (5, 5), (5, 5)), (False, (0, 0), (0, 0)), (False, (62, 126), (62, 126)),
    (False, (63, 127), (-1, -1)), (False, (10**12, 3), (-1, 3)), (False, (0, -1), (0, -1)),
]


@pytest.mark.parametrize("engine", ["wgmma", "mma"])
@pytest.mark.parametrize("causal,window,want", QAT_WINDOWS, ids=[f"{c}-{w}" for c, w, _ in QAT_WINDOWS])
def test_every_qat_launch_passes_the_window(gpu, monkeypatch, engine, causal, window, want):
    """qat.forward keeps the window in the residuals' problem; its kernel and the backward's dK/dV and dQ kernels get
    (left, right) after their float scalars (scale_log2; sm_scale); the wgmma forward's causal dispatch group exactly
    for the causal work shape."""
    from sagecupy import nvfp4, qat

    stub_views(monkeypatch)
    q, k, v = _inputs(nq=128, nk=64)
    scale = 0.125
    del gpu[:]
    o, res = qat.forward(q, k, v, causal=causal, window=window, engine=engine, sm_scale=scale)
    want_problem = None if window is None else tuple(int(w) for w in window)
    assert res.problem.window == want_problem and res.problem.causal is causal
    assert nvfp4.kernel_window(res.problem) == want
    fwd = gpu[-1]
    assert fwd[0].startswith("qat_attn_fwd") and _window_args(fwd, scale * nvfp4.LOG2E) == want
    if engine == "wgmma":
        assert fwd[0].endswith(", 16>") == nvfp4.causal_shape(want), fwd[0]
    del gpu[:]
    qat.backward(res, FakeArray(q.shape, q.dtype), engine=engine)
    sfx = "_sm90" if engine == "wgmma" else ""
    assert [x[0].split("<")[0] for x in gpu] == ["qat_delta", f"qat_attn_bwd{sfx}", f"qat_attn_bwd_dq{sfx}"]
    for launch in gpu[1:]:
        assert _window_args(launch, scale) == want


def test_qat_residual_window_is_checked(gpu, monkeypatch):
    from sagecupy import qat

    stub_views(monkeypatch)
    q, k, v = _inputs(nq=128, nk=64)
    _, res = qat.forward(q, k, v, causal=True, window=(9, 0))
    do = FakeArray(q.shape, q.dtype)
    p = res.problem
    start = len(gpu)
    for window, words in BAD_RESIDUAL_WINDOWS:
        with pytest.raises(ValueError, match=words):
            qat.backward(dataclasses.replace(res, problem=dataclasses.replace(p, window=window)), do)
    assert len(gpu) == start
    qat.backward(res, do)  # the forward's own residuals pass
