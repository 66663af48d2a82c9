"""The INT8 sliding window (``window=(left, right)``, docs/algorithms.md §1.8) through the PyTorch and JAX adapters,
without a GPU (each half skipped without its framework).

PyTorch: the custom ops run on CPU tensors with stand-ins for what needs a GPU (DLPack views, the stream, and
``sagecupy.int8``'s forward, sage_attention and backward, here float64 exact attention rounded to float16 that
record the Problem they get), so the wiring is checked end to end: validation before any op, the ops' schemas and
fake implementations, the window reaching the forward and, through the residuals, the backward, eagerly and under
``torch.compile(fullgraph=True)``. JAX: ``jax.make_jaxpr`` traces the custom_vjp (no callback runs) and the
Problems the callbacks would get are recorded. The kernels themselves: tests/gpu/test_torch_adapter.py and
test_jax_adapter.py.
"""
import contextlib
import functools
import inspect

import numpy as np
import pytest

from sagecupy import _checks
from sagecupy.reference import attention as A

# (window, causal, what the message names)
BAD_WINDOWS = [((1,), False, "window"), ((1, 2, 3), False, "window"), ((-2, 0), False, "window"),
               ((0, -5), False, "window"), ((1.5, 0), False, "window"), ((True, 0), False, "window"),
               ("ab", False, "window"), (5, False, "window"), ((None, 0), False, "window"),
               ((3, 1), True, r"causal=True contradicts window=\(3, 1\)"),
               ((-1, -1), True, r"causal=True contradicts window=\(-1, -1\)")]
BAD_IDS = [f"{w!r}-{'causal' if c else 'full'}" for w, c, _ in BAD_WINDOWS]


def _host(seed, B=1, Hq=4, Hkv=2, Nq=37, Nk=53, D=64, layout="HND"):
    r = np.random.default_rng(seed)

    def shape(h, n):
        return (B, h, n, D) if layout == "HND" else (B, n, h, D)

    return [r.standard_normal(shape(h, n)).astype(np.float16) for h, n in ((Hq, Nq), (Hkv, Nk), (Hkv, Nk), (Hq, Nq))]


# --------------------------------------------------------------------------------------------------
# PyTorch
# --------------------------------------------------------------------------------------------------


@pytest.fixture
def torch_mods():
    torch = pytest.importorskip("torch")
    st = pytest.importorskip("sagecupy.torch")  # ImportError on PyTorch < 2.4
    from sagecupy.adapters import torch_ops

    return torch, st, torch_ops


def install_stand_ins(monkeypatch, s8, ops, forward, sage_attention, backward, raw_as_torch):
    """Put the stand-ins ``forward``, ``sage_attention`` and ``backward`` in place of int8's entry points, and of the
    adapter's replaying ones (no plan is kept by tensor metadata, so they only ever take the checked path);
    ``raw_as_torch(x)`` turns a stand-in's array into a tensor (also test_adapter_varlen's)."""
    monkeypatch.setattr(s8, "forward", forward)
    monkeypatch.setattr(s8, "sage_attention", sage_attention)
    monkeypatch.setattr(s8, "backward", backward)
    monkeypatch.setattr(s8, "_inference", lambda q, k, v, plan=None, **kw: (
        *sage_attention(q, k, v, return_lse=True, **kw), None))
    monkeypatch.setattr(s8, "_training", lambda q, k, v, plan=None, **kw: (
        *forward(q, k, v, return_lse=True, **kw), None))
    monkeypatch.setattr(s8, "_backward_replay", lambda res, do, replay=None: (*backward(res, do), None))
    monkeypatch.setattr(ops, "_plan_key", lambda *args: None)
    monkeypatch.setattr(ops, "_raw_as_torch", lambda x, dtype: raw_as_torch(x))


@pytest.fixture
def kernels(torch_mods, monkeypatch):
    """CPU stand-ins for the GPU side of the INT8 ops; returns the list of ``(entry point, Problem)`` they got."""
    torch, st, ops = torch_mods
    from sagecupy import _layout
    from sagecupy import int8 as s8
    from sagecupy.config import get_config

    calls, saved = [], {}

    def require_tensor(t, name):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")

    def to_host(t, name="tensor"):
        return t.detach().numpy()

    def from_host(x):
        return torch.from_numpy(np.ascontiguousarray(x))

    for mod in (st, ops):
        for name in ("to_cupy", "_as_cupy"):  # (the public exchange and the adapter's own)
            monkeypatch.setattr(mod, name, to_host)
        for name in ("from_cupy", "_as_torch"):
            monkeypatch.setattr(mod, name, from_host)
        monkeypatch.setattr(mod, "on_torch_stream", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(ops, "_require_cuda_tensor", require_tensor)
    monkeypatch.setattr(_layout, "prepare", lambda x, name, layout, aligned: x)

    def exact(q, k, v, p):
        o, lse = A.attention_forward(q, k, v, causal=p.causal, sm_scale=p.sm_scale, layout=p.layout, window=p.window)
        return o, lse

    def forward(q, k, v, *, causal=False, sm_scale=None, layout="HND", config=None, return_lse=False, window=None):
        p = _checks.check_attention_args(q, k, v, causal=causal, sm_scale=sm_scale, layout=layout, window=window)
        calls.append(("forward", p))
        o, lse = exact(q, k, v, p)
        saved.update(q=q, k=k, v=v, o=o, lse=lse)
        B, Hq, Hkv, D = p.batch, p.heads_q, p.heads_kv, p.head_dim
        nq, nk = _layout.roundup(p.nq, s8._FWD_BQ), _layout.roundup(p.nk, s8._FWD_BKV)
        res = s8.Residuals(problem=p, config=get_config(config), q_codes=np.zeros((B, Hq, nq, D), np.int8),
                           q_scale=np.zeros((B, Hq, nq), np.float32), k_codes=np.zeros((B, Hkv, nk, D), np.int8),
                           k_scale=np.zeros((B, Hkv, nk), np.float32), v=v, o=o.astype(np.float16),
                           lse2=np.zeros((B, Hq, nq), np.float32), mu_k=None)
        out = (o.astype(np.float16), lse.astype(np.float32), res)
        return out if return_lse else (out[0], res)

    def sage_attention(q, k, v, *, causal=False, sm_scale=None, layout="HND", config=None, return_lse=False,
                       window=None):
        p = _checks.check_attention_args(q, k, v, causal=causal, sm_scale=sm_scale, layout=layout, window=window)
        calls.append(("sage_attention", p))
        o, lse = exact(q, k, v, p)
        return (o.astype(np.float16), lse.astype(np.float32)) if return_lse else o.astype(np.float16)

    def backward(res, do):
        p = res.problem
        _checks.check_problem(p, "residuals.problem")
        calls.append(("backward", p))
        s = saved
        grads = A.attention_backward(s["q"], s["k"], s["v"], s["o"], s["lse"], do, causal=p.causal,
                                     sm_scale=p.sm_scale, layout=p.layout, window=p.window)
        return tuple(g.astype(np.float16) for g in grads)

    install_stand_ins(monkeypatch, s8, ops, forward, sage_attention, backward, from_host)
    return calls


def _want(q, k, v, do, *, causal=False, layout="HND", window=None):
    """o, dq, dk, dv of the stand-ins called directly: float64 exact attention rounded to float16."""
    o, lse = A.attention_forward(q, k, v, causal=causal, layout=layout, window=window)
    grads = A.attention_backward(q, k, v, o, lse, do, causal=causal, layout=layout, window=window)
    return [x.astype(np.float16) for x in (o, *grads)]


def _through(torch, fn, host, **kw):
    q, k, v, do = (torch.from_numpy(x) for x in host)
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    o = fn(q, k, v, **kw)
    o.backward(do)
    return [x.detach().numpy() for x in (o, q.grad, k.grad, v.grad)]


def _assert_equal(got, want, case):
    for name, g, w in zip(("O", "dQ", "dK", "dV"), got, want):
        assert g.dtype == w.dtype and np.array_equal(g.view(np.uint16), w.view(np.uint16)), (name, case)


def test_int8_op_schemas_take_the_window_after_the_config_with_no_window_by_default(torch_mods):
    """(Packed sequences' arguments follow the window: tests/cpu/test_adapter_varlen.py.)"""
    torch, _, _ = torch_mods
    for name in ("sage_attention_fwd", "sage_attention_infer", "sage_attention_bwd"):
        args = getattr(torch.ops.sagecupy, name).default._schema.arguments
        names = [a.name for a in args]
        at = names.index("causal")
        assert names[at:at + 6] == ["causal", "sm_scale", "layout", "config", "window_left", "window_right"], name
        window = args[at + 4:at + 6]
        assert [a.default_value for a in window] == [-1, -1], name
        assert all(str(a.type) in ("int", "SymInt") for a in window), name
    for name in ("qat_attention_fwd", "qat_attention_bwd", "nvfp4_attention"):
        args = [a.name for a in getattr(torch.ops.sagecupy, name).default._schema.arguments]
        assert args[-4:] == ["causal", "sm_scale", "layout", "config"], name


def test_only_the_int8_entry_points_take_a_window(torch_mods):
    _, st, _ = torch_mods
    assert inspect.signature(st.sage_attention).parameters["window"].default is None
    assert inspect.signature(st.SageAttentionFunction.forward).parameters["window"].default is None
    for fn in (st.qat_attention, st.nvfp4_attention, st.scaled_dot_product_attention, st.QATAttentionFunction.forward):
        assert "window" not in inspect.signature(fn).parameters, fn


def test_fake_implementations_ignore_the_window(torch_mods):
    torch, _, _ = torch_mods
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q, k = torch.empty(2, 100, 4, 64, dtype=torch.float16), torch.empty(2, 130, 2, 64, dtype=torch.float16)
        for op in ("sage_attention_fwd", "sage_attention_infer"):
            fn = getattr(torch.ops.sagecupy, op)
            plain = fn(q, k, k, False, None, "NHD", "")
            for window in ((17, 5), (-1, 0), (0, -1)):
                got = fn(q, k, k, False, None, "NHD", "", *window)
                assert [(x.shape, x.dtype) for x in got] == [(x.shape, x.dtype) for x in plain], (op, window)
        o, _, *residuals = torch.ops.sagecupy.sage_attention_fwd(q, k, k, False, None, "NHD", "", 17, 5)
        grads = torch.ops.sagecupy.sage_attention_bwd(o, o, k, *residuals, False, None, "NHD", "", 17, 5)
        assert [g.shape for g in grads] == [q.shape, k.shape, k.shape]


@pytest.mark.parametrize("window,causal,words", BAD_WINDOWS, ids=BAD_IDS)
def test_bad_windows_are_refused_before_the_ops(kernels, torch_mods, window, causal, words):
    torch, st, _ = torch_mods
    q, k, v, _ = (torch.from_numpy(x) for x in _host(0))
    for grad in (False, True):
        with pytest.raises(ValueError, match=words):
            st.sage_attention(q.detach().requires_grad_(grad), k, v, causal=causal, window=window)
    assert kernels == []
    with pytest.raises(ValueError, match=words):  # the autograd.Function: refused by int8.forward's own checks
        st.SageAttentionFunction.apply(q, k, v, causal, None, "HND", None, False, window)


# (causal, window, the Problem's window): None and (-1, -1) without causal are both "no window" to the ops
WINDOWS = [(False, (64, 0), (64, 0)), (False, (17, 5), (17, 5)), (True, (17, 0), (17, 0)), (False, None, None),
           (True, None, None), (False, (-1, -1), None), (False, (-1, 0), (-1, 0)), (False, [0, 3], (0, 3)),
           (False, (np.int64(4), 2), (4, 2)), (False, (10**12, 3), (10**12, 3))]


@pytest.mark.parametrize("path", ["op", "function"])
@pytest.mark.parametrize("causal,window,want_window", WINDOWS, ids=[f"{c}-{w}" for c, w, _ in WINDOWS])
def test_window_reaches_the_forward_and_the_backward(kernels, torch_mods, path, causal, window, want_window):
    """The forward gets the window, and the backward a Problem equal to the forward's, field for field; O and the
    gradients are those of the stand-ins called directly with the window."""
    torch, st, _ = torch_mods
    host = _host(1, layout="NHD")

    def function(q, k, v, *, causal, window, layout):
        return st.SageAttentionFunction.apply(q, k, v, causal, None, layout, None, False, window)

    fn = {"op": st.sage_attention, "function": function}[path]
    got = _through(torch, fn, host, causal=causal, window=window, layout="NHD")
    assert [c for c, _ in kernels] == ["forward", "backward"]
    fwd, bwd = (p for _, p in kernels)
    if path == "function":  # int8.forward gets the window as given
        want_window = None if window is None else tuple(int(w) for w in window)
    assert fwd.window == want_window and fwd.causal is causal and bwd == fwd
    from sagecupy.int8 import kernel_window

    direct = _checks.check_attention_args(*host[:3], causal=causal, sm_scale=None, layout="NHD", window=window)
    assert kernel_window(fwd) == kernel_window(direct)
    _assert_equal(got, _want(*host, causal=causal, layout="NHD", window=window), (path, window))


@pytest.mark.parametrize("path", ["op", "function"])
def test_windowed_residuals_live_until_the_last_backward(kernels, torch_mods, path):
    """The eager paths keep the residuals (the windowed Problem among them) on ``ctx``: through a backward that
    retains the graph, which then repeats bitwise, and not after the last one, as autograd frees saved tensors."""
    torch, st, _ = torch_mods
    q, k, v, do = (torch.from_numpy(x) for x in _host(5))
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    if path == "op":
        o = st.sage_attention(q, k, v, causal=True, window=(9, 0))
    else:
        o = st.SageAttentionFunction.apply(q, k, v, True, None, "HND", None, False, (9, 0))
    ctx = o.grad_fn
    assert ctx.res.problem.window == (9, 0)
    first = torch.autograd.grad(o, (q, k, v), do, retain_graph=True)
    assert ctx.res is not None, "dropped by a backward that retains the graph"
    again = torch.autograd.grad(o, (q, k, v), do)
    assert ctx.res is None, "kept after the last backward"
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    with pytest.raises(RuntimeError, match="second time"):
        torch.autograd.grad(o, (q, k, v), do)


def test_saved_tensor_hooks_take_the_ops(kernels, torch_mods):
    """Under saved-tensor hooks the residuals must be saved tensors for the hooks to pack: the windowed call takes the
    custom ops, with the eager path's results. A ``torch.device`` context keeps the eager path."""
    torch, st, _ = torch_mods
    host = _host(6)
    want = _through(torch, st.sage_attention, host, causal=True, window=(9, 0))
    names = []

    def hooked(q, k, v, **kw):
        with torch.autograd.graph.save_on_cpu():
            o = st.sage_attention(q, k, v, **kw)
        names.append(type(o.grad_fn).__name__)
        return o

    got = _through(torch, hooked, host, causal=True, window=(9, 0))
    assert names and not names[0].startswith("SageEagerFunction"), names
    _assert_equal(got, want, "save_on_cpu")
    q = torch.from_numpy(host[0])
    with torch.device("cpu"):
        assert st._dispatcher_free(q, q, q)


def test_calls_without_gradient_take_the_window_to_the_inference_op(kernels, torch_mods):
    torch, st, _ = torch_mods
    q, k, v, _ = (torch.from_numpy(x) for x in _host(2))
    o, lse = st.sage_attention(q, k, v, window=(9, 2), return_lse=True)
    with torch.no_grad():
        o2 = st.sage_attention(q.requires_grad_(), k, v, causal=True, window=(9, 0))
    assert [(c, p.window, p.causal) for c, p in kernels] == [("sage_attention", (9, 2), False),
                                                             ("sage_attention", (9, 0), True)]
    o_ref, lse_ref = A.attention_forward(*(x.numpy() for x in (q.detach(), k, v)), window=(9, 2))
    assert np.array_equal(o.numpy(), o_ref.astype(np.float16)) and lse.shape == (1, 4, 37)
    assert np.array_equal(lse.numpy(), lse_ref.astype(np.float32)) and not o2.requires_grad


def test_ops_called_directly_default_to_no_window(kernels, torch_mods):
    """Calls written without the window args keep their meaning: causal alone decides."""
    torch, _, _ = torch_mods
    q, k, v, _ = (torch.from_numpy(x) for x in _host(3))
    torch.ops.sagecupy.sage_attention_infer(q, k, v, True, None, "HND", "")
    o, _, *residuals = torch.ops.sagecupy.sage_attention_fwd(q, k, v, True, None, "HND", "")
    torch.ops.sagecupy.sage_attention_bwd(o, o, v, *residuals, True, None, "HND", "")
    torch.ops.sagecupy.sage_attention_infer(q, k, v, False, None, "HND", "", 5, -1)
    assert [(c, p.causal, p.window) for c, p in kernels] == [
        ("sage_attention", True, None), ("forward", True, None), ("backward", True, None),
        ("sage_attention", False, (5, -1))]


def test_compile_fullgraph_with_a_window(kernels, torch_mods):
    """No graph break; the compiled function's O and gradients equal eager's; the window reaches the forward and
    the backward. A window side passed as an argument, which dynamo makes symbolic once it changes, also runs."""
    torch, st, _ = torch_mods
    host = _host(4, Nq=40, Nk=70)

    def f(q, k, v):
        return st.sage_attention(q, k, v, causal=True, window=(17, 0)) * 2

    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    _assert_equal(_through(torch, compiled, host), _through(torch, f, host), "compiled")
    assert [(c, p.window) for c, p in kernels] == [("forward", (17, 0)), ("backward", (17, 0))] * 2

    def g(q, k, v, left):
        return st.sage_attention(q, k, v, window=(left, 5))

    compiled = torch.compile(g, fullgraph=True, backend="aot_eager")
    for left in (3, 4, 11):
        del kernels[:]
        got = _through(torch, functools.partial(compiled, left=left), host)
        _assert_equal(got, _want(*host, window=(left, 5)), left)
        assert [(c, p.window) for c, p in kernels] == [("forward", (left, 5)), ("backward", (left, 5))]
    with pytest.raises(Exception, match="window"):
        torch.compile(g, fullgraph=True, backend="aot_eager")(*(torch.from_numpy(x) for x in host[:3]), -3)


# --------------------------------------------------------------------------------------------------
# JAX
# --------------------------------------------------------------------------------------------------


@pytest.fixture
def jax_traced(monkeypatch):
    """sagecupy.jax with the callbacks' Problems recorded at trace time: ``[(kind, Problem, the other arguments of
    the callback's factory), ...]`` (also test_adapter_varlen's)."""
    pytest.importorskip("jax")
    import sagecupy.jax as sj

    try:
        sj._buffer_callback()
    except RuntimeError as exc:
        pytest.skip(str(exc))
    seen = []

    def spy(kind, real):
        def wrapped(p, *args):
            seen.append((kind, p, args))
            return real(p, *args)

        return wrapped

    monkeypatch.setattr(sj, "_int8_forward_callback", spy("forward", sj._int8_forward_callback))
    monkeypatch.setattr(sj, "_int8_backward_callback", spy("backward", sj._int8_backward_callback))
    sj._int8_op.cache_clear()  # ops built before the spies hold no reference to them, but start clean
    return sj, seen


def _jax_inputs(dtype="float16", **kw):
    import jax.numpy as jnp

    return [jnp.asarray(x.astype(np.float32), dtype=dtype) for x in _host(5, **kw)]


@pytest.mark.parametrize("causal,window,want", [(False, (64, 0), (64, 0)), (False, (17, 5), (17, 5)),
                                                (True, (17, 0), (17, 0)), (False, None, None), (True, None, None),
                                                (False, [np.int64(3), -1], (3, -1))])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_jax_window_is_static_and_reaches_both_callbacks(jax_traced, causal, window, want, dtype):
    import jax
    import jax.numpy as jnp

    sj, seen = jax_traced
    q, k, v, _ = _jax_inputs(dtype)

    def loss(q, k, v):
        return sj.sage_attention(q, k, v, causal=causal, window=window).astype(jnp.float32).sum()

    jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
    assert [kind for kind, _, _ in seen] == ["forward", "backward"]
    fwd, bwd = (p for _, p, _ in seen)
    assert fwd.window == want and fwd.causal is causal and bwd == fwd
    del seen[:]
    jax.make_jaxpr(functools.partial(sj.sage_attention, causal=causal, window=window))(q, k, v)
    assert [(kind, p.window) for kind, p, _ in seen] == [("forward", want)]


@pytest.mark.parametrize("window,causal,words", BAD_WINDOWS, ids=BAD_IDS)
def test_jax_bad_windows_are_refused(jax_traced, window, causal, words):
    import jax

    sj, seen = jax_traced
    q, k, v, _ = _jax_inputs()
    with pytest.raises(ValueError, match=words):
        jax.make_jaxpr(functools.partial(sj.sage_attention, causal=causal, window=window))(q, k, v)
    assert seen == []


def test_jax_window_value_types_are_checked_before_the_cache(jax_traced):
    """(5.0, 0) equals (5, 0) as a cache key: it must be refused all the same after (5, 0) built its op."""
    import jax

    sj, _ = jax_traced
    q, k, v, _ = _jax_inputs()
    jax.make_jaxpr(functools.partial(sj.sage_attention, window=(5, 0)))(q, k, v)
    with pytest.raises(ValueError, match="window"):
        jax.make_jaxpr(functools.partial(sj.sage_attention, window=(5.0, 0)))(q, k, v)
    with pytest.raises(TypeError, match="causal"):
        sj.sage_attention(q, k, v, causal="yes", window=(5, 0))
    assert "window" not in inspect.signature(sj.qat_attention).parameters


def test_jax_saves_the_residual_arrays_the_specs_name(jax_traced):
    """int8.Residuals as the JAX forward callback checks them: the arrays of the specs; a field for packed sequences
    (the THD layout, which the adapter does not take) must be None."""
    import dataclasses

    from sagecupy import int8 as s8
    from sagecupy.config import get_config

    sj, _ = jax_traced
    q, k, v, _ = _host(6)
    p = _checks.check_attention_args(q, k, v, causal=False, sm_scale=None, layout="HND", window=(17, 5))
    cfg = get_config(None)
    arrays = {name: np.zeros(shape, dtype) for name, (shape, dtype) in sj._int8_residual_specs(p, cfg).items()}
    res = s8.Residuals(problem=p, config=cfg, v=v, o=q, **dict({"mu_k": None}, **arrays))
    assert sorted(sj._int8_saved(res, p, cfg)) == sorted(arrays)
    if "packed" in {f.name for f in dataclasses.fields(res)}:
        with pytest.raises(RuntimeError, match="packed"):
            sj._int8_saved(dataclasses.replace(res, packed=np.zeros(3, np.int32)), p, cfg)
