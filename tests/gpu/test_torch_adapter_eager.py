"""The PyTorch adapter's eager path: ``sage_attention`` on plain tensors runs ``torch_ops.SageEagerFunction`` (the INT8
forward and backward with the residuals on ``ctx`` as CuPy arrays) instead of PyTorch's dispatcher, and the adapter's
own tensor exchanges skip DLPack's stream handshake (``_as_cupy``, ``_as_torch``). The bitwise comparisons of every
path against the CuPy calls are ``test_torch_adapter.py``'s ("op" is this path, "dispatcher" the ops); here: the
exchanges themselves, which calls take the shortcut, and the autograd contract the ops give (residuals freed after
the backward, in-place changes caught, no silent second derivative).
"""
import numpy as np
import pytest

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")

import sagecupy.torch as st  # noqa: E402  (needs torch: after the skip)
from sagecupy.adapters import torch_ops  # noqa: E402
from test_torch_adapter import _assert_same_bits, _inputs, _qat_module, _through, _via_dispatcher  # noqa: E402


_DTYPES = ("float16", "bfloat16", "float32", "int8", "int32", "uint8")
_LAYOUTS = ("contiguous", "transposed", "offset", "broadcast", "empty")


def _tensor(dtype, layout):
    """A CUDA tensor of a dtype the adapter exchanges, in a layout a caller may hand over: contiguous, a transposed
    view, a view at an offset into its storage, a broadcast (stride 0) or an empty one."""
    g = torch.Generator(device="cuda").manual_seed(3)
    x = (torch.rand(3, 5, 70, 64, device="cuda", generator=g) * 100).to(getattr(torch, dtype))
    return {"contiguous": x, "transposed": x.transpose(1, 2), "offset": x[1, 2:, 3:],
            "broadcast": x[0, :1, :1].expand(4, 70, 64), "empty": x[:, :, :0]}[layout]


def _raw(x):
    """A CuPy array's values as comparable numbers (a bfloat16 array, in either form, by its bits)."""
    bits = getattr(x, "bits", None)
    if bits is not None:
        return bits
    return x.view(np.uint16) if x.dtype.kind == "V" else x


def _same_values(view, t):
    """The CuPy view holds the tensor's values, shape and strides (compared with a contiguous copy's DLPack array)."""
    want = _raw(torch_ops.to_cupy(t.contiguous(), "t"))
    got = _raw(view)
    strides = tuple(s * t.element_size() for s in t.stride())
    return got.shape == want.shape and (got.strides == strides or not t.numel()) and bool((got == want).all())


@pytest.mark.parametrize("layout", _LAYOUTS)
@pytest.mark.parametrize("dtype", _DTYPES)
def test_exchanges_match_the_dlpack_ones(dtype, layout):
    t, name = _tensor(dtype, layout), (dtype, layout)
    with torch_ops.on_torch_stream(t.device):
        view = torch_ops._as_cupy(t, "t")
        assert _same_values(view, t), name
        if t.numel():
            assert view.data.ptr == t.data_ptr(), "not a view"
        back = torch_ops._as_torch(view)
    assert back.dtype == t.dtype and back.shape == t.shape, name
    assert back.stride() == t.stride() or not t.numel(), name  # (an empty tensor's strides are not its memory's)
    assert torch.equal(back, t), name


def test_view_keeps_the_tensor_alive():
    """The CuPy view holds the tensor: dropping every other reference and reusing PyTorch's cache frees nothing."""
    t = torch.arange(4096, device="cuda", dtype=torch.float32)
    with torch_ops.on_torch_stream(t.device):
        view = torch_ops._as_cupy(t[7:])
    del t
    torch.cuda.empty_cache()
    scratch = [torch.full((4096,), -1.0, device="cuda") for _ in range(64)]
    assert float(view[0]) == 7.0 and float(view[-1]) == 4095.0 and len(scratch) == 64


def test_eager_calls_skip_the_dispatcher_and_modes_see_the_ops():
    from torch.utils._python_dispatch import TorchDispatchMode

    q, k, v, do = _inputs(41, 1, 2, 2, 64, 96, 64, "HND", torch.bfloat16)
    assert st._dispatcher_free(q, k, v)
    seen = []

    class Log(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(str(func))
            return func(*args, **(kwargs or {}))

    with Log():
        assert not st._dispatcher_free(q, k, v)
        leaves = [x.detach().requires_grad_() for x in (q, k, v)]
        o = st.sage_attention(*leaves)
        st.sage_attention(q, k, v)
    assert any("sage_attention_fwd" in f for f in seen) and any("sage_attention_infer" in f for f in seen), seen
    o_eager = st.sage_attention(*(x.detach().requires_grad_() for x in (q, k, v)))
    assert type(o_eager.grad_fn).__name__.startswith("SageEagerFunction"), o_eager.grad_fn
    _assert_same_bits([o_eager.detach()], [o.detach()], "eager vs under a mode", names=("O",))
    assert not st._dispatcher_free(q.to(torch.float16).as_subclass(_Sub), k, v)


class _Sub(torch.Tensor):
    pass


@pytest.mark.parametrize("path", ["eager", "dispatcher"])
def test_saved_tensors_follow_the_ops_contract(path):
    """Both paths: a second backward without retain_graph is refused, with it the gradients repeat bitwise; an
    in-place change of v after the forward is caught before the backward. The eager path: a second derivative is an
    error (once_differentiable), not zeros."""
    q, k, v, do = _inputs(43, 1, 2, 1, 80, 100, 128, "HND", torch.float16)
    call = st.sage_attention if path == "eager" else (lambda *a, **kw: _via_dispatcher(st.sage_attention, *a, **kw))
    leaves = [x.detach().requires_grad_() for x in (q, k, v)]
    o = call(*leaves, causal=True)
    first = torch.autograd.grad(o, leaves, do, retain_graph=True)
    again = torch.autograd.grad(o, leaves, do)
    _assert_same_bits(list(first), list(again), path, names=("dQ", "dK", "dV"))
    with pytest.raises(RuntimeError):
        torch.autograd.grad(o, leaves, do)
    leaves = [x.detach().requires_grad_() for x in (q, k, v)]
    vv = leaves[2].clone()
    o = call(leaves[0], leaves[1], vv, causal=True)
    with torch.no_grad():
        vv.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        o.backward(do)
    if path != "eager":
        return
    leaves = [x.detach().requires_grad_() for x in (q, k, v)]
    o = call(*leaves, causal=True)
    dq, = torch.autograd.grad(o, leaves[0], do.detach().requires_grad_(), create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable"):
        dq.float().sum().backward()


@pytest.mark.parametrize("function", ["eager", "SageAttentionFunction"])
def test_residuals_are_dropped_after_the_last_backward(function):
    """The residuals on ``ctx`` live until a backward without ``retain_graph``, as saved tensors do: not as long as
    the output that keeps the graph."""
    q, k, v, do = _inputs(45, 1, 2, 2, 64, 96, 64, "HND", torch.float16)
    leaves = [x.detach().requires_grad_() for x in (q, k, v)]
    call = st.sage_attention if function == "eager" else st.SageAttentionFunction.apply
    o = call(*leaves, causal=True) if function == "eager" else call(*leaves, True)
    ctx = o.grad_fn
    assert ctx.res is not None
    torch.autograd.grad(o, leaves, do, retain_graph=True)
    assert ctx.res is not None, "dropped by a backward that retains the graph"
    torch.autograd.grad(o, leaves, do)
    assert ctx.res is None, "kept after the last backward"


def test_eager_path_equals_the_dispatcher_bitwise():
    """The eager path against the dispatcher's on one GQA causal case (the full matrix is test_torch_adapter's)."""
    q, k, v, do = _inputs(47, 2, 4, 2, 130, 200, 64, "NHD", torch.bfloat16)
    got = _through(st.sage_attention, q, k, v, do, causal=True, layout="NHD")
    want = _through(lambda *a, **kw: _via_dispatcher(st.sage_attention, *a, **kw), q, k, v, do, causal=True,
                    layout="NHD")
    _assert_same_bits(got, want, "eager vs dispatcher")


@pytest.mark.parametrize("hooks", ["checkpoint", "save_on_cpu"])
@pytest.mark.parametrize("family", ["int8", "qat"])
def test_saved_tensor_hooks_see_the_residuals(family, hooks):
    """Under saved-tensor hooks (non-reentrant activation checkpointing, save_on_cpu) the calls take the custom ops,
    whose residuals are saved tensors the hooks pack: no residual object on ``ctx``, and the gradients are the eager
    path's bit for bit."""
    from torch.utils.checkpoint import checkpoint

    if family == "qat":
        _qat_module()
    call = st.sage_attention if family == "int8" else st.qat_attention
    q, k, v, do = _inputs(49, 1, 4, 2, 100, 130, 64, "HND", torch.bfloat16)
    want = _through(call, q, k, v, do, causal=True)
    seen = []

    def hooked(q, k, v, causal):
        o = call(q, k, v, causal=causal)
        seen.append(type(o.grad_fn).__name__)
        return o

    if hooks == "checkpoint":
        got = _through(lambda q, k, v, causal: checkpoint(hooked, q, k, v, causal, use_reentrant=False), q, k, v, do,
                       causal=True)
    else:
        with torch.autograd.graph.save_on_cpu():
            got = _through(hooked, q, k, v, do, causal=True)
    assert seen and not any(n.startswith(("SageEagerFunction", "QATAttentionFunction")) for n in seen), seen
    _assert_same_bits(list(got), list(want), (family, hooks))


def test_device_contexts_keep_the_eager_path():
    q, k, v, do = _inputs(51, 1, 2, 2, 64, 64, 64, "HND", torch.float16)
    with torch.device("cuda"):
        assert st._dispatcher_free(q, k, v)
        o = st.sage_attention(*(x.detach().requires_grad_() for x in (q, k, v)))
    assert type(o.grad_fn).__name__.startswith("SageEagerFunction"), o.grad_fn
