"""Packed variable-length sequences (``layout="THD"``, ``cu_seqlens_q/k``, ``max_seqlen_q/k``) through the PyTorch and
JAX adapters, without a GPU (each half skipped without its framework).

PyTorch: the custom ops run on CPU tensors with stand-ins for what needs a GPU (DLPack views, the stream, and
``sagecupy.int8``'s forward, sage_attention and backward: float64 exact attention per sequence rounded to float16,
residuals of the packed shapes with the NumPy model of the device's table of offsets, ``_varlen.reference_meta``), so
the wiring is checked end to end: argument checks before any op, naming the argument; the ops' schemas and fake
implementations; the offsets and maxima reaching the forward; the table and the offsets reaching the backward through
the saved residuals, eagerly and under ``torch.compile(fullgraph=True)``. JAX: ``jax.make_jaxpr`` traces the
custom_vjp (no callback runs) and records the Problems the callbacks would get. The kernels themselves:
tests/gpu/test_torch_adapter_packed.py and test_jax_adapter.py.
"""
import contextlib
import functools

import numpy as np
import pytest

from sagecupy import _checks, _varlen
from sagecupy.reference import attention as A

from test_adapter_window import install_stand_ins
from test_adapter_window import jax_traced  # noqa: F401 (a fixture: the callbacks' Problems at trace time)

# (q length, k length) per sequence: an empty sequence, sequences across the 128-row blocks, Nq != Nk
LENS = {"17-0-300": [(17, 17), (0, 0), (300, 300)], "128-129": [(128, 128), (129, 129)],
        "unequal": [(40, 70), (0, 5), (9, 0)]}


def _offsets(lens):
    return (np.concatenate([[0], np.cumsum([a for a, _ in lens])]).astype(np.int32),
            np.concatenate([[0], np.cumsum([b for _, b in lens])]).astype(np.int32))


def _host(seed, lens, Hq=4, Hkv=2, D=64):
    """q, k, v, do (float16, packed) and the offsets (int32)."""
    r = np.random.default_rng(seed)
    cq, ck = _offsets(lens)
    tq, tk = int(cq[-1]), int(ck[-1])
    arrays = [r.standard_normal(s).astype(np.float16) for s in ((tq, Hq, D), (tk, Hkv, D), (tk, Hkv, D), (tq, Hq, D))]
    return arrays, (cq, ck)


def _exact(q, k, v, do, cq, ck, **kw):
    """o, lse, dq, dk, dv of float64 exact attention per sequence (o and the gradients rounded to float16)."""
    o, lse = A.attention_forward(q, k, v, layout="THD", cu_seqlens_q=cq, cu_seqlens_k=ck, **kw)
    grads = A.attention_backward(q, k, v, o, lse, do, layout="THD", cu_seqlens_q=cq, cu_seqlens_k=ck, **kw)
    return o.astype(np.float16), lse.astype(np.float32), [g.astype(np.float16) for g in grads]


# --------------------------------------------------------------------------------------------------
# PyTorch
# --------------------------------------------------------------------------------------------------


@pytest.fixture
def torch_mods():
    torch = pytest.importorskip("torch")
    st = pytest.importorskip("sagecupy.torch")  # ImportError on PyTorch < 2.4
    from sagecupy.adapters import torch_ops

    return torch, st, torch_ops


class _Calls(list):
    """The stand-ins' record: ``(entry point, Problem, packed keywords)`` per call."""


@pytest.fixture
def kernels(torch_mods, monkeypatch):
    """CPU stand-ins for the GPU side of the INT8 ops; returns the list of ``(entry point, Problem, packed keywords)``
    they got. The stand-in backward checks that the table it gets is the one its forward made."""
    torch, st, ops = torch_mods
    from sagecupy import _layout
    from sagecupy import int8 as s8
    from sagecupy.config import get_config

    calls, saved = _Calls(), {}
    calls.real_require = ops._require_cuda_tensor  # (for the test that needs the real check)

    def require_tensor(t, name):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")

    for mod in (st, ops):
        for name in ("to_cupy", "_as_cupy"):  # (the public exchange and the adapter's own)
            monkeypatch.setattr(mod, name, lambda t, name="tensor": t.detach().numpy())
        for name in ("from_cupy", "_as_torch"):
            monkeypatch.setattr(mod, name, lambda x: torch.from_numpy(np.ascontiguousarray(x)))
        monkeypatch.setattr(mod, "on_torch_stream", lambda device: contextlib.nullcontext())
        monkeypatch.setattr(mod, "_require_cuda_tensor", require_tensor)
    monkeypatch.setattr(_layout, "prepare", lambda x, name, layout, aligned: x)

    def problem(q, k, v, kw):
        names = ("cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k")
        packed = {n: kw.pop(n) for n in names if n in kw}
        if _varlen.is_packed(kw["layout"], *(packed.get(n) for n in names)):
            # host offsets: _varlen checks their values in full (what the op handed on must be the caller's)
            return _varlen.check_args(q, k, v, **kw, **{n: packed.get(n) for n in names}), packed
        return _checks.check_attention_args(q, k, v, **kw), packed

    def exact(q, k, v, p, packed):
        kw = dict(causal=p.causal, sm_scale=p.sm_scale, window=p.window)
        if p.layout == "THD":
            return A.attention_forward(q, k, v, layout="THD", cu_seqlens_q=packed["cu_seqlens_q"],
                                       cu_seqlens_k=packed["cu_seqlens_k"], **kw)
        return A.attention_forward(q, k, v, layout=p.layout, **kw)

    def forward(q, k, v, *, causal=False, sm_scale=None, layout="HND", config=None, return_lse=False, window=None,
                **packed_kw):
        p, packed = problem(q, k, v, dict(causal=causal, sm_scale=sm_scale, layout=layout, window=window, **packed_kw))
        calls.append(("forward", p, packed))
        o, lse = exact(q, k, v, p, packed)
        saved.update(q=q, k=k, v=v, o=o, lse=lse, packed=packed)
        shapes = ops._int8_residual_shapes(q.shape, k.shape, layout, packed.get("cu_seqlens_q"))
        arrays = [np.zeros(s, dt) for s, dt in zip(shapes[:5], (np.int8, np.float32, np.int8, np.float32, np.float32))]
        table = (_varlen.reference_meta(packed["cu_seqlens_q"], packed["cu_seqlens_k"], p.nq, p.nk)
                 if layout == "THD" else None)
        res = s8.Residuals(p, get_config(config), *arrays[:4], v, o.astype(np.float16), arrays[4], None, table)
        out = (o.astype(np.float16), lse.astype(np.float32), res)
        return out if return_lse else (out[0], res)

    def sage_attention(q, k, v, *, causal=False, sm_scale=None, layout="HND", config=None, return_lse=False,
                       window=None, **packed_kw):
        p, packed = problem(q, k, v, dict(causal=causal, sm_scale=sm_scale, layout=layout, window=window, **packed_kw))
        calls.append(("sage_attention", p, packed))
        o, lse = exact(q, k, v, p, packed)
        return (o.astype(np.float16), lse.astype(np.float32)) if return_lse else o.astype(np.float16)

    def backward(res, do):
        p = res.problem
        _checks.check_problem(p, "residuals.problem")
        calls.append(("backward", p, None))
        s = saved
        if p.layout == "THD":
            want = _varlen.reference_meta(s["packed"]["cu_seqlens_q"], s["packed"]["cu_seqlens_k"], p.nq, p.nk)
            assert res.packed is not None and np.array_equal(res.packed, want), "the table did not come back"
            kw = dict(layout="THD", cu_seqlens_q=s["packed"]["cu_seqlens_q"], cu_seqlens_k=s["packed"]["cu_seqlens_k"])
        else:
            assert res.packed is None
            kw = dict(layout=p.layout)
        grads = A.attention_backward(s["q"], s["k"], s["v"], s["o"], s["lse"], do, causal=p.causal,
                                     sm_scale=p.sm_scale, window=p.window, **kw)
        return tuple(g.astype(np.float16) for g in grads)

    install_stand_ins(monkeypatch, s8, ops, forward, sage_attention, backward,
                      lambda x: torch.from_numpy(np.ascontiguousarray(x)))
    return calls


def _tensors(torch, seed, lens, **kw):
    (q, k, v, do), (cq, ck) = _host(seed, lens, **kw)
    return [torch.from_numpy(x) for x in (q, k, v, do)], [torch.from_numpy(c) for c in (cq, ck)]


def _assert_bits(got, want, case):
    for name, g, w in zip(("O", "dQ", "dK", "dV"), got, want):
        g = g.detach().numpy() if hasattr(g, "detach") else g
        assert g.dtype == w.dtype and g.shape == w.shape, (name, case, g.shape, w.shape)
        assert np.array_equal(g.view(np.uint16), w.view(np.uint16)), (name, case)


def _through(torch, fn, qkvd, **kw):
    q, k, v, do = qkvd
    q, k, v = (x.detach().clone().requires_grad_() for x in (q, k, v))
    o = fn(q, k, v, **kw)
    o.backward(do)
    return [x.detach().numpy() for x in (o, q.grad, k.grad, v.grad)]


def test_int8_op_schemas_take_the_packed_arguments_last(torch_mods):
    torch, _, _ = torch_mods
    ops = torch.ops.sagecupy
    tail = ["window_left", "window_right", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k"]
    for name in ("sage_attention_fwd", "sage_attention_infer"):
        args = getattr(ops, name).default._schema.arguments
        assert [a.name for a in args[-6:]] == tail, name
        assert [a.default_value for a in args[-6:]] == [-1, -1, None, None, -1, -1], name
        assert [str(a.type) for a in args[-4:-2]] == ["Optional[Tensor]"] * 2, name
        assert all(str(a.type) in ("int", "SymInt") for a in args[-2:]), name
    assert len(ops.sage_attention_fwd.default._schema.returns) == 8
    args = ops.sage_attention_bwd.default._schema.arguments
    names = [a.name for a in args]
    assert names[:10] == ["do", "o", "v", "q_codes", "q_scale", "k_codes", "k_scale", "lse2", "packed", "causal"]
    assert names[-4:] == tail[:4] and [a.default_value for a in args[-2:]] == [None, None]


@pytest.mark.parametrize("lens", sorted(LENS), ids=str)
def test_fake_implementations_give_the_packed_shapes(torch_mods, lens):
    torch, _, ops = torch_mods
    from torch._subclasses.fake_tensor import FakeTensorMode

    lens = LENS[lens]
    cq, ck = _offsets(lens)
    tq, tk, S = int(cq[-1]), int(ck[-1]), len(lens)
    tq_pad, tk_pad, _, _, _ = _checks.packed_bounds(S, tq, tk)
    meta = _varlen.meta_size(_checks.Problem(S, 8, 2, tq, tk, 128, "bfloat16", "THD", True, 1.0))
    with FakeTensorMode():
        q, k = torch.empty(tq, 8, 128, dtype=torch.bfloat16), torch.empty(tk, 2, 128, dtype=torch.bfloat16)
        cu_q, cu_k = torch.empty(S + 1, dtype=torch.int32), torch.empty(S + 1, dtype=torch.int32)
        args = (q, k, k, True, None, "THD", "", -1, -1, cu_q, cu_k, 300, -1)
        o, lse = torch.ops.sagecupy.sage_attention_infer(*args)
        assert (o.shape, o.dtype, lse.shape, lse.dtype) == (q.shape, q.dtype, (8, tq), torch.float32)
        o, lse, *res = torch.ops.sagecupy.sage_attention_fwd(*args)
        assert (o.shape, lse.shape, lse.dtype) == (q.shape, (8, tq), torch.float32)
        want = [((8 * tq_pad, 128), torch.int8), ((8 * tq_pad,), torch.float32), ((2 * tk_pad, 128), torch.int8),
                ((2 * tk_pad,), torch.float32), ((8 * tq_pad,), torch.float32), ((meta,), torch.int32)]
        assert [(tuple(x.shape), x.dtype) for x in res] == want
        grads = torch.ops.sagecupy.sage_attention_bwd(o, o, k, *res, True, None, "THD", "", -1, -1, cu_q, cu_k)
        assert [g.shape for g in grads] == [q.shape, k.shape, k.shape]
        dense = torch.empty(2, 4, 100, 64, dtype=torch.float16)
        *_, table = torch.ops.sagecupy.sage_attention_fwd(dense, dense, dense, False, None, "HND", "")
        assert table.shape == (0,) and table.dtype == torch.int32
    with pytest.raises(ValueError, match="cu_seqlens_q is required"):
        ops._int8_residual_shapes((tq, 8, 128), (tk, 2, 128), "THD")


CASES = [("17-0-300", False, None), ("17-0-300", True, None), ("128-129", True, (40, 0)), ("unequal", False, (9, 5)),
         ("128-129", False, None)]


@pytest.mark.parametrize("path", ["op", "function"])
@pytest.mark.parametrize("lens,causal,window", CASES, ids=[f"{n}-{c}-{w}" for n, c, w in CASES])
def test_packed_call_reaches_the_forward_and_the_backward(kernels, torch_mods, path, lens, causal, window):
    """The forward gets the offsets and the maxima; the backward a Problem equal to the forward's and the table the
    forward made (checked by the stand-in); O and the gradients are the stand-ins' called directly."""
    torch, st, _ = torch_mods
    qkvd, (cu_q, cu_k) = _tensors(torch, 1, LENS[lens])
    mq, mk = max(a for a, _ in LENS[lens]), None
    kw = dict(causal=causal, window=window, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=mq, max_seqlen_k=mk)

    def function(q, k, v, **kw):
        return st.SageAttentionFunction.apply(q, k, v, kw["causal"], None, "THD", None, False, kw["window"],
                                              kw["cu_seqlens_q"], kw["cu_seqlens_k"], kw["max_seqlen_q"],
                                              kw["max_seqlen_k"])

    fn = {"op": functools.partial(st.sage_attention, layout="THD"), "function": function}[path]
    got = _through(torch, fn, qkvd, **kw)
    assert [c for c, _, _ in kernels] == ["forward", "backward"]
    (_, fwd, packed), (_, bwd, _) = kernels
    S, tq = len(LENS[lens]), int(cu_q[-1])
    assert (fwd.layout, fwd.batch, fwd.nq, fwd.causal) == ("THD", S, tq, causal) and bwd == fwd
    assert fwd.window == (None if window is None else tuple(window))
    assert np.array_equal(packed["cu_seqlens_q"], cu_q.numpy()) and np.array_equal(packed["cu_seqlens_k"], cu_k.numpy())
    assert (packed["max_seqlen_q"], packed["max_seqlen_k"]) == (mq, mk)
    o, _, grads = _exact(*(x.numpy() for x in qkvd), cu_q.numpy(), cu_k.numpy(), causal=causal, window=window)
    _assert_bits(got, [o, *grads], (path, lens))


def test_calls_without_gradient_run_the_inference_op_packed(kernels, torch_mods):
    torch, st, _ = torch_mods
    (q, k, v, do), (cu_q, cu_k) = _tensors(torch, 2, LENS["17-0-300"])
    o, lse = st.sage_attention(q, k, v, layout="THD", cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, causal=True,
                               return_lse=True)
    assert [(c, p.layout, p.batch) for c, p, _ in kernels] == [("sage_attention", "THD", 3)]
    assert kernels[0][2]["max_seqlen_q"] is None and kernels[0][2]["max_seqlen_k"] is None
    o_ref, lse_ref, _ = _exact(q.numpy(), k.numpy(), v.numpy(), do.numpy(), cu_q.numpy(), cu_k.numpy(), causal=True)
    assert lse.shape == (4, 317) and lse.dtype == torch.float32 and not lse.requires_grad
    assert np.array_equal(o.numpy(), o_ref) and np.array_equal(lse.numpy(), lse_ref)
    with torch.no_grad():
        st.sage_attention(q.requires_grad_(), k, v, layout="THD", cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    assert [c for c, _, _ in kernels] == ["sage_attention"] * 2


def test_ops_called_directly_with_offsets(kernels, torch_mods):
    """The forward op's residuals, table last, go to the backward op as they come, followed by the offsets; a packed
    backward without them, or a dense one given them, is refused naming them."""
    torch, _, _ = torch_mods
    (q, k, v, do), (cu_q, cu_k) = _tensors(torch, 3, LENS["128-129"])
    ops = torch.ops.sagecupy
    o, lse, *residuals = ops.sage_attention_fwd(q, k, v, True, None, "THD", "", -1, -1, cu_q, cu_k, 129, 129)
    assert len(residuals) == 6 and residuals[-1].dtype == torch.int32 and lse.shape == (4, 257)
    grads = ops.sage_attention_bwd(do, o, v, *residuals, True, None, "THD", "", -1, -1, cu_q, cu_k)
    _, _, want = _exact(q.numpy(), k.numpy(), v.numpy(), do.numpy(), cu_q.numpy(), cu_k.numpy(), causal=True)
    _assert_bits([o, *grads], [o.numpy(), *want], "direct")
    with pytest.raises(ValueError, match="cu_seqlens_q is required"):
        ops.sage_attention_bwd(do, o, v, *residuals, True, None, "THD", "")
    dense = [x[None] for x in (q, k, v)]
    o, _, *residuals = ops.sage_attention_fwd(*dense, True, None, "NHD", "")
    assert residuals[-1].shape == (0,)
    with pytest.raises(ValueError, match="cu_seqlens_q is only for layout='THD'"):
        ops.sage_attention_bwd(do[None], o, dense[2], *residuals, True, None, "NHD", "", -1, -1, cu_q, cu_k)
    with pytest.raises(ValueError, match="cu_seqlens_k is only for layout='THD'"):
        ops.sage_attention_infer(*dense, True, None, "NHD", "", -1, -1, None, cu_k)


def test_residuals_take_the_table_as_the_layout_needs_it(kernels, torch_mods):
    """A dense call's table is None; one on a dense layout is handed on for int8.check_residuals to refuse
    (residuals.packed must be None there); a packed call without its table is refused naming it."""
    torch, _, ops = torch_mods
    q = np.zeros((1, 4, 16, 64), np.float16)
    z = np.zeros(1, np.float32)
    kw = dict(causal=False, sm_scale=None, config=None, window=None)
    assert ops._int8_residuals(q, q, z, z, z, z, z, None, layout="HND", **kw).packed is None
    res = ops._int8_residuals(q, q, z, z, z, z, z, np.ones(3, np.int32), layout="HND", **kw)
    assert res.packed is not None and res.problem.layout == "HND"
    cu = np.array([0, 16], np.int32)
    with pytest.raises(ValueError, match=r"packed \(the forward op's last residual"):
        t = np.zeros((16, 4, 64), np.float16)
        ops._int8_residuals(t, t, z, z, z, z, z, None, layout="THD", cu_seqlens_q=cu, cu_seqlens_k=cu, **kw)
    (q, k, v, do), (cu_q, cu_k) = _tensors(torch, 3, LENS["128-129"])
    o, _, *residuals = torch.ops.sagecupy.sage_attention_fwd(q, k, v, True, None, "THD", "", -1, -1, cu_q, cu_k)
    with pytest.raises(ValueError, match="the backward of packed sequences needs the table"):
        torch.ops.sagecupy.sage_attention_bwd(do, o, v, *residuals[:-1], residuals[-1][:0], True, None, "THD", "",
                                              -1, -1, cu_q, cu_k)


def _bad_torch_calls(torch):
    (q, k, v, _), (cu_q, cu_k) = _tensors(torch, 4, LENS["unequal"])
    dense = q[None]
    kw = dict(layout="THD", cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    return [
        ((dense, dense, dense), dict(cu_seqlens_q=cu_q), ValueError, "cu_seqlens_q is only for layout='THD'"),
        ((dense, dense, dense), dict(layout="NHD", max_seqlen_k=3), ValueError, "max_seqlen_k is only for layout="),
        ((q, k, v), dict(layout="THD"), ValueError, "cu_seqlens_q is required with layout='THD'"),
        ((q, k, v), dict(kw, cu_seqlens_k=None), ValueError, "cu_seqlens_k is required"),
        ((q, k, v), dict(kw, cu_seqlens_q=cu_q.long()), TypeError,
         r"cu_seqlens_q\.dtype=torch\.int64 must be torch\.int32"),
        ((q, k, v), dict(kw, cu_seqlens_k=cu_k.float()), TypeError, r"cu_seqlens_k\.dtype=torch\.float32"),
        ((q, k, v), dict(kw, cu_seqlens_q=cu_q[None]), ValueError, "cu_seqlens_q must be 1-D"),
        ((q, k, v), dict(kw, cu_seqlens_q=cu_q[:1], cu_seqlens_k=cu_k[:1]), ValueError, r"S \+ 1 >= 2 offsets"),
        ((q, k, v), dict(kw, cu_seqlens_k=cu_k[:3]), ValueError, "must have the same length"),
        ((q, k, v), dict(kw, cu_seqlens_q=[0, 40, 40, 49]), TypeError, "cu_seqlens_q must be a torch.Tensor"),
        ((q, k, v), dict(kw, max_seqlen_q=3.5), ValueError, r"max_seqlen_q=3\.5 must be a non-negative integer"),
        ((q, k, v), dict(kw, max_seqlen_k=True), ValueError, "max_seqlen_k=True"),
        ((q, k, v), dict(kw, max_seqlen_k=-2), ValueError, "max_seqlen_k=-2"),
        ((dense, k, v), kw, ValueError, r"q must be 3-D \(total, H, D\) for layout='THD'"),
        ((q, k, v), dict(kw, layout="BTHD"), ValueError, "supported: \\('HND', 'NHD', 'THD'\\)"),
    ]


def test_bad_packed_arguments_are_refused_before_the_ops(kernels, torch_mods):
    torch, st, _ = torch_mods
    for args, kw, exc, words in _bad_torch_calls(torch):
        for grad in (False, True):
            with pytest.raises(exc, match=words):
                st.sage_attention(args[0].detach().requires_grad_(grad), *args[1:], **kw)
    assert kernels == []


def test_cpu_offsets_are_refused_naming_them(kernels, torch_mods, monkeypatch):
    """(q, k, v pass as GPU tensors here; the offsets meet the real check.)"""
    torch, st, _ = torch_mods
    monkeypatch.setattr(st, "_require_cuda_tensor", kernels.real_require)
    (q, k, v, _), (cu_q, cu_k) = _tensors(torch, 5, LENS["unequal"])
    with pytest.raises(TypeError, match=r"cu_seqlens_q is a cpu tensor.*cu_seqlens_q\.cuda\(\)"):
        st.sage_attention(q, k, v, layout="THD", cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    assert kernels == []


def test_qat_and_nvfp4_say_they_take_no_packed_sequences(kernels, torch_mods):
    torch, st, _ = torch_mods
    (q, k, v, _), _ = _tensors(torch, 6, LENS["unequal"])
    for fn in (st.qat_attention, st.nvfp4_attention):
        with pytest.raises(ValueError, match=rf"layout='THD' \(packed variable-length sequences\) is not supported by "
                                             rf"{fn.__name__}: only sage_attention \(INT8\)"):
            fn(q, k, v, layout="THD")
    assert kernels == []


def test_compile_fullgraph_over_a_packed_call(kernels, torch_mods):
    """No graph break; the compiled packed call's O and gradients equal eager's; other document lengths (the same S,
    then another S: dynamic shapes) and other maxima (symbolic once they change) run through the compiled function."""
    torch, st, _ = torch_mods

    def f(q, k, v, cu_q, cu_k, max_q):
        return st.sage_attention(q, k, v, layout="THD", cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max_q,
                                 max_seqlen_k=max_q, causal=True, window=(40, 0)) * 2

    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    for lens in (LENS["128-129"], [(100, 100), (157, 157)], LENS["17-0-300"], [(5, 5), (6, 6), (7, 7)]):
        qkvd, (cu_q, cu_k) = _tensors(torch, 7, lens)
        longest = max(a for a, _ in lens)
        del kernels[:]
        got = _through(torch, functools.partial(compiled, cu_q=cu_q, cu_k=cu_k, max_q=longest), qkvd)
        want = [("forward", len(lens), (40, 0)), ("backward", len(lens), (40, 0))]
        assert [(c, p.batch, p.window) for c, p, _ in kernels] == want
        assert kernels[0][2]["max_seqlen_q"] == longest
        want = _through(torch, functools.partial(f, cu_q=cu_q, cu_k=cu_k, max_q=longest), qkvd)
        _assert_bits(got, want, lens)
    # (fullgraph: dynamo reports the ValueError raised while tracing as an unsupported exception, message included)
    with pytest.raises(Exception, match="max_seqlen_q=-5 must be a non-negative integer"):
        compiled(*qkvd[:3], cu_q, cu_k, -5)


# --------------------------------------------------------------------------------------------------
# JAX
# --------------------------------------------------------------------------------------------------


def _jax_packed(lens, dtype="float16", **kw):
    import jax.numpy as jnp

    (q, k, v, do), (cq, ck) = _host(8, lens, **kw)
    return [jnp.asarray(x.astype(np.float32), dtype=dtype) for x in (q, k, v, do)], [jnp.asarray(c) for c in (cq, ck)]


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("lens,causal,window", CASES[:3], ids=[f"{n}-{c}-{w}" for n, c, w in CASES[:3]])
def test_jax_packed_call_traces_with_static_layout_and_traced_offsets(jax_traced, lens, causal, window, dtype):
    import jax
    import jax.numpy as jnp

    sj, seen = jax_traced
    (q, k, v, _), (cu_q, cu_k) = _jax_packed(LENS[lens], dtype)
    S, tq = len(LENS[lens]), q.shape[0]

    def loss(q, k, v, cu_q, cu_k):
        o = sj.sage_attention(q, k, v, layout="THD", cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=300,
                              causal=causal, window=window)
        return o.astype(jnp.float32).sum()

    jaxpr = jax.make_jaxpr(jax.jit(jax.grad(loss, argnums=(0, 1, 2))))(q, k, v, cu_q, cu_k)
    assert [kind for kind, _, _ in seen] == ["forward", "backward"]
    (_, fwd, extra), (_, bwd, _) = seen
    assert (fwd.layout, fwd.batch, fwd.nq, fwd.causal, fwd.window) == ("THD", S, tq, causal, window) and bwd == fwd
    # max_seqlen_q=300 is checked but not passed on: the kernels do not read it, and a key of the op's caches would
    # build a new program for every longest document a training loop meets
    assert extra == (get_default_config(), True, False, (None, None))
    assert len(jaxpr.out_avals) == 3 and [a.shape for a in jaxpr.out_avals] == [q.shape, k.shape, v.shape]
    del seen[:]
    o, lse = jax.eval_shape(functools.partial(sj.sage_attention, layout="THD", causal=causal, window=window,
                                              return_lse=True), q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    assert (o.shape, o.dtype, lse.shape, lse.dtype) == (q.shape, q.dtype, (4, tq), jnp.float32)
    assert [(kind, p.batch, extra[1:]) for kind, p, extra in seen] == [("forward", S, (False, True, (None, None)))]


def get_default_config():
    from sagecupy.config import get_config

    return get_config(None)


def test_jax_packed_residual_specs_and_saved_table(jax_traced):
    """The specs XLA allocates for a packed call (the padded packed buffers, K's mean per sequence, the table) and the
    check of the arrays the forward keeps against them: a packed call must keep its table."""
    import dataclasses

    from sagecupy import int8 as s8

    sj, _ = jax_traced
    (q, k, v, _), (cq, ck) = _host(9, LENS["17-0-300"])
    p = _varlen.check_args(q, k, v, causal=True, sm_scale=None, layout="THD", window=None, cu_seqlens_q=cq,
                           cu_seqlens_k=ck, max_seqlen_q=None, max_seqlen_k=None)
    cfg = get_default_config()
    specs = sj._int8_residual_specs(p, cfg)
    tq_pad, tk_pad, _, _, _ = _checks.packed_bounds(3, 317, 317)
    assert specs["q_codes"][0] == (4 * tq_pad, 64) and specs["k_scale"][0] == (2 * tk_pad,)
    assert specs["mu_k"][0] == (3, 2, 64) and specs["packed"] == ((_varlen.meta_size(p),), np.dtype(np.int32))
    arrays = {name: np.zeros(shape, dtype) for name, (shape, dtype) in specs.items()}
    res = s8.Residuals(problem=p, config=cfg, v=v, o=q, **arrays)
    assert sorted(sj._int8_saved(res, p, cfg)) == sorted(specs)
    with pytest.raises(RuntimeError, match="packed is None"):
        sj._int8_saved(dataclasses.replace(res, packed=None), p, cfg)
    # a field the adapter does not carry (the backward leaves it at None) must be None
    extra = dataclasses.make_dataclass("WithExtra", [("extra", object, dataclasses.field(default=None))],
                                       bases=(s8.Residuals,))
    with_extra = extra(**{f.name: getattr(res, f.name) for f in dataclasses.fields(res)})
    assert sorted(sj._int8_saved(with_extra, p, cfg)) == sorted(specs)
    with pytest.raises(RuntimeError, match="extra is set but the adapter does not carry it"):
        sj._int8_saved(dataclasses.replace(with_extra, extra=(1, 2, 3)), p, cfg)
    assert sj._lse_shape(p) == (4, 317)


def test_jax_host_offsets_are_checked_in_full(jax_traced):
    import jax

    sj, seen = jax_traced
    (q, k, v, _), _ = _jax_packed(LENS["unequal"])
    cq, ck = _offsets(LENS["unequal"])
    f = functools.partial(sj.sage_attention, layout="THD", cu_seqlens_q=cq, cu_seqlens_k=ck)
    jax.make_jaxpr(f)(q, k, v)
    assert [(kind, p.batch) for kind, p, _ in seen] == [("forward", 3)]
    bad = cq.copy()
    bad[-1] -= 1
    with pytest.raises(ValueError, match="cu_seqlens_q must end at the packed length 49"):
        sj.sage_attention(q, k, v, layout="THD", cu_seqlens_q=bad, cu_seqlens_k=ck)
    with pytest.raises(ValueError, match=r"max_seqlen_k=4 is less than the longest sequence \(70\)"):
        sj.sage_attention(q, k, v, layout="THD", cu_seqlens_q=cq, cu_seqlens_k=ck, max_seqlen_k=4)
    with pytest.raises(TypeError, match="both be JAX arrays or both NumPy arrays"):
        sj.sage_attention(q, k, v, layout="THD", cu_seqlens_q=cq, cu_seqlens_k=jax.numpy.asarray(ck))


def test_jax_bad_packed_arguments(jax_traced):
    import jax.numpy as jnp

    sj, seen = jax_traced
    (q, k, v, _), (cu_q, cu_k) = _jax_packed(LENS["unequal"])
    kw = dict(layout="THD", cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    dense = q[None]
    bad = [
        ((dense, dense, dense), dict(cu_seqlens_q=cu_q), ValueError, "cu_seqlens_q is only for layout='THD'"),
        ((dense, dense, dense), dict(layout="NHD", max_seqlen_q=4), ValueError, "max_seqlen_q is only for"),
        ((q, k, v), dict(layout="THD"), ValueError, "cu_seqlens_q is required with layout='THD'"),
        ((q, k, v), dict(kw, cu_seqlens_k=None), ValueError, "cu_seqlens_k is required"),
        ((q, k, v), dict(kw, cu_seqlens_q=cu_q.astype(jnp.float32)), TypeError,
         r"cu_seqlens_q\.dtype=float32 must be int32"),
        ((q, k, v), dict(kw, cu_seqlens_k=cu_k[None]), ValueError, "cu_seqlens_k must be 1-D"),
        ((q, k, v), dict(kw, cu_seqlens_q=cu_q[:1], cu_seqlens_k=cu_k[:1]), ValueError, r"S \+ 1 >= 2 offsets"),
        ((q, k, v), dict(kw, cu_seqlens_k=cu_k[:3]), ValueError, "must have the same length"),
        ((q, k, v), dict(kw, cu_seqlens_q=[0, 40, 40, 49]), TypeError, "cu_seqlens_q must be a JAX int32 array"),
        ((q, k, v), dict(kw, max_seqlen_q=5.0), ValueError, r"max_seqlen_q=5\.0 must be a non-negative Python int"),
        ((q, k, v), dict(kw, max_seqlen_k=-1), ValueError, "max_seqlen_k=-1"),
        ((dense, k, v), kw, ValueError, r"q must be 3-D \(total, H, D\) for layout='THD'"),
        ((q, k[..., :32], v[..., :32]), kw, ValueError, "head_dim"),
        ((q, k, v), dict(kw, causal=True, window=(3, 2)), ValueError, "causal=True contradicts window"),
        ((q, k, v), dict(kw, return_lse=1), TypeError, "return_lse must be a bool"),
    ]
    for args, kw_, exc, words in bad:
        with pytest.raises(exc, match=words):
            sj.sage_attention(*args, **kw_)
    assert seen == []
    with pytest.raises(ValueError, match=r"layout='THD' \(packed variable-length sequences\) is not supported by "
                                         r"qat_attention"):
        try:
            sj.qat_attention(q, k, v, layout="THD")
        except ImportError as exc:  # no QAT kernels here: the layout is checked after the module
            pytest.skip(str(exc))


def test_jax_return_lse_on_dense_layouts(jax_traced):
    """(return_lse is new on the JAX entry point for every layout: the LSE's shape, and no gradient through it.)"""
    import jax
    import jax.numpy as jnp

    sj, seen = jax_traced
    q = jnp.zeros((2, 4, 37, 64), jnp.float16)
    k = jnp.zeros((2, 2, 53, 64), jnp.float16)
    o, lse = jax.eval_shape(functools.partial(sj.sage_attention, return_lse=True), q, k, k)
    assert (o.shape, lse.shape, lse.dtype) == (q.shape, (2, 4, 37), jnp.float32)

    def loss(q):
        o, lse = sj.sage_attention(q, k, k, causal=True, return_lse=True)
        return o.astype(jnp.float32).sum() + lse.sum()

    jax.make_jaxpr(jax.grad(loss))(q)
    assert [(kind, p.layout) for kind, p, _ in seen][-2:] == [("forward", "HND"), ("backward", "HND")]


def test_jax_max_seqlen_changes_do_not_build_new_ops():
    """Two calls that differ only in max_seqlen_q/k share one custom_vjp op (and so one XLA program)."""
    jax = pytest.importorskip("jax")

    import sagecupy.jax as sj

    (q, k, v, _), (cu_q, cu_k) = _jax_packed(LENS[list(LENS)[0]], "float16")
    before = sj._int8_op.cache_info().currsize
    for m in (129, 300, 1000):
        jax.eval_shape(lambda q, k, v: sj.sage_attention(q, k, v, layout="THD", cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                                                         max_seqlen_q=m, max_seqlen_k=m), q, k, v)
    assert sj._int8_op.cache_info().currsize - before <= 1
