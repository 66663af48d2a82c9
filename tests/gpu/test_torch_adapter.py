"""The PyTorch adapter (``sagecupy.torch``) on the GPU.

* Bitwise: output and gradients through the adapter (its custom-op path, what ``sage_attention`` runs,
  and its plain ``autograd.Function``) equal ``sagecupy.int8.forward``/``backward`` called directly on
  CuPy copies of the same values, bit for bit.
* Accuracy: the adapter's output and gradients against the float64 references, with the bounds of
  ``test_int8.py`` (simulator: tight; exact: at most 1.1x the simulator's own error + 1e-4).
* ``torch.compile(fullgraph=True)``: no graph break at the op, the same bits as eager.
* Streams: the kernels run on PyTorch's current stream, ordered after the producer, with no sync.
* Error paths, and the FP4 QAT op when ``sagecupy.qat`` has its kernels.
* ``return_lse``, the NVFP4 inference op, and the drop-in ``scaled_dot_product_attention``: bitwise the family
  entry points where the kernels apply, bitwise PyTorch's SDPA where they do not, no graph break under compile.
* The sliding window (``window=(left, right)``): output, LSE and gradients bitwise the CuPy calls with the same
  window, training and inference ops, eagerly and under ``torch.compile(fullgraph=True)``.

Neither the INT8 nor the QAT backward uses atomics (dQ has its own kernel), so every gradient is compared
bit for bit, also with many key blocks (Nk = 517).
"""
import functools
import importlib.util
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")

import sagecupy.torch as st  # noqa: E402  (needs torch: after the skip)
import test_int8 as T  # noqa: E402  the INT8 kernel tests' helpers (same folder)
from draws import qkv_do  # noqa: E402
from sagecupy.config import DEFAULT, PAPER  # noqa: E402
from sagecupy.reference import attention as ref_attn  # noqa: E402
from sagecupy.reference import metrics  # noqa: E402
from sagecupy.reference import sagebwd as ref_sage  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
DTYPE_NAME = {torch.float16: "float16", torch.bfloat16: "bfloat16"}


def _inputs(seed, B, Hq, Hkv, Nq, Nk, D, layout, dtype, sigma=1.0):
    """q, k, v, do as CUDA tensors: the float64 draws of test_int8._inputs (draws.qkv_do) rounded to ``dtype``."""
    return [torch.from_numpy(x.astype(np.float32)).to("cuda").to(dtype)
            for x in qkv_do(seed, B, Hq, Hkv, Nq, Nk, D, layout, sigma)]


def _host(t):
    """The exact values of a tensor, float64 on the host."""
    return t.detach().float().cpu().numpy().astype(np.float64)


def _bits(x):
    """The 16-bit patterns of a torch tensor, a CuPy array or a BF16Array, as host int16."""
    if isinstance(x, torch.Tensor):
        return x.detach().contiguous().view(torch.int16).cpu().numpy()
    return np.ascontiguousarray(T._raw(x).get()).view(np.int16)


def _assert_same_bits(got, want, case, names=("O", "dQ", "dK", "dV")):
    for name, g, w in zip(names, got, want):
        gb, wb = _bits(g), _bits(w)
        assert gb.shape == wb.shape, f"{name}: shape {gb.shape} != {wb.shape} {case}"
        diff = np.argwhere(gb != wb)
        assert diff.size == 0, f"{name}: {len(diff)} of {gb.size} elements differ, first at {tuple(diff[0])} {case}"


def _through(fn, q, k, v, do, **kw):
    """(o, dq, dk, dv) of ``fn`` on fresh leaves sharing q, k, v's memory and strides, backpropagating ``do``."""
    q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
    o = fn(q, k, v, **kw)
    o.backward(do)
    return o.detach(), q.grad, k.grad, v.grad


def _function(q, k, v, *, causal=False, sm_scale=None, layout="HND", config=None, window=None):
    if window is None:
        return st.SageAttentionFunction.apply(q, k, v, causal, sm_scale, layout, config)
    return st.SageAttentionFunction.apply(q, k, v, causal, sm_scale, layout, config, False, window)


def _dispatcher(q, k, v, **kw):
    """sage_attention through PyTorch's dispatcher (the custom ops), as under torch.compile, a mode or a tensor
    subclass: the eager shortcut (SageEagerFunction) refused for this call."""
    return _via_dispatcher(st.sage_attention, q, k, v, **kw)


def _via_dispatcher(fn, *args, **kw):
    real = st._dispatcher_free
    st._dispatcher_free = lambda *tensors: False
    try:
        return fn(*args, **kw)
    finally:
        st._dispatcher_free = real


# "op": sage_attention as an eager call runs it; "dispatcher": the same ops through PyTorch's dispatcher
PATHS = {"op": st.sage_attention, "dispatcher": _dispatcher, "function": _function}


def _direct(family, q, k, v, do, **kw):
    """``family.forward``/``backward`` on CuPy arrays holding the same values (built from the host
    values, not through the adapter's conversions)."""
    name = DTYPE_NAME[q.dtype]
    cq, ck, cv, cdo = (T._to_dev(_host(x), name) for x in (q, k, v, do))
    o, res = family.forward(cq, ck, cv, **kw)
    return (o, *family.backward(res, cdo))


def _case_id(c):
    B, Hq, Hkv, Nq, Nk, D, causal, layout, dtype = c[:9]
    tail = f"-{c[9].name}" if len(c) > 9 else ""
    return (f"{Nq}x{Nk}-d{D}-{'causal' if causal else 'full'}-{layout}-{DTYPE_NAME[dtype]}-gqa{Hq // Hkv}"
            f"-b{B}{tail}")


# --------------------------------------------------------------------------------------------------
# (a) bitwise against the direct calls
# --------------------------------------------------------------------------------------------------

BITWISE_CASES = [
    # B, Hq, Hkv, Nq, Nk, D, causal, layout, dtype, config
    (1, 2, 2, 100, 128, 64, False, "HND", torch.float16, DEFAULT),
    (2, 4, 2, 77, 128, 128, True, "HND", torch.bfloat16, DEFAULT),
    (1, 4, 1, 128, 60, 64, True, "NHD", torch.float16, PAPER),  # MQA; Nq > Nk: fully masked rows
    (1, 2, 2, 33, 100, 128, False, "NHD", torch.bfloat16, PAPER),
    (1, 2, 1, 1, 17, 64, True, "HND", torch.bfloat16, DEFAULT),
]


@pytest.mark.parametrize("path", sorted(PATHS))
@pytest.mark.parametrize("case", BITWISE_CASES, ids=[_case_id(c) for c in BITWISE_CASES])
def test_gradients_equal_direct_calls_bitwise(path, case):
    import sagecupy.int8 as s8

    B, Hq, Hkv, Nq, Nk, D, causal, layout, dtype, config = case
    q, k, v, do = _inputs(1, B, Hq, Hkv, Nq, Nk, D, layout, dtype)
    before = [x.clone() for x in (q, k, v, do)]
    kw = dict(causal=causal, layout=layout, config=config)
    got = _through(PATHS[path], q, k, v, do, **kw)
    want = _direct(s8, q, k, v, do, **kw)
    _assert_same_bits(got, want, (path, _case_id(case)))
    for x, x0 in zip((q, k, v, do), before):
        assert torch.equal(x, x0), "an input was modified"


def test_calls_without_gradient_run_the_inference_op(monkeypatch):
    """Under no_grad, or with no input requiring grad, sage_attention runs the inference forward (int8._inference,
    int8.sage_attention's: no residuals), whose output is bitwise the training forward's; with grad it runs the
    training forward (int8._training, int8.forward's)."""
    import sagecupy.int8 as s8

    q, k, v, _ = _inputs(5, 1, 4, 2, 90, 130, 128, "HND", torch.bfloat16)
    calls = []
    for name in ("_training", "_inference"):
        real = getattr(s8, name)
        monkeypatch.setattr(s8, name, functools.partial(lambda real, name, *a, **kw: calls.append(name) or
                                                        real(*a, **kw), real, name))
    with torch.no_grad():
        o_no_grad = st.sage_attention(q.detach().requires_grad_(), k, v, causal=True)
    o_plain = st.sage_attention(q.detach(), k, v, causal=True)
    assert calls == ["_inference", "_inference"]
    o_grad = st.sage_attention(q.detach().requires_grad_(), k, v, causal=True)
    assert calls[2:] == ["_training"] and o_grad.requires_grad and not o_plain.requires_grad
    _assert_same_bits([o_no_grad, o_plain], [o_grad.detach()] * 2, "no grad", names=("O (no_grad)", "O (plain)"))


@pytest.mark.parametrize("path", sorted(PATHS))
def test_long_sequence_bitwise(path):
    """Nk = 517 (9 key blocks), causal, GQA: O and every gradient bitwise (no atomics in the INT8 backward)."""
    import sagecupy.int8 as s8

    q, k, v, do = _inputs(3, 1, 4, 2, 300, 517, 128, "HND", torch.bfloat16)
    got = _through(PATHS[path], q, k, v, do, causal=True)
    want = _direct(s8, q, k, v, do, causal=True)
    _assert_same_bits(list(got), list(want), path, names=("O", "dQ", "dK", "dV"))


def test_strided_inputs_match_contiguous():
    """Non-contiguous tensors travel with their strides (an HND view of NHD memory) or are copied by the
    kernels' host code (a V whose rows are not 16-byte aligned): same bits as contiguous inputs."""
    q, k, v, do = _inputs(5, 1, 2, 2, 96, 96, 64, "HND", torch.float16)
    q_view = q.transpose(1, 2).contiguous().transpose(1, 2)
    big = torch.zeros(1, 2, 96, 128, device="cuda", dtype=torch.float16)
    big[..., 4:68] = v
    v_view = big[..., 4:68]
    assert not q_view.is_contiguous() and v_view.data_ptr() % 16
    want = _through(st.sage_attention, q, k, v, do)
    got = _through(st.sage_attention, q_view, k, v_view, do)
    _assert_same_bits(got, want, "strided")
    do_view = do.transpose(1, 2).contiguous().transpose(1, 2)  # a non-contiguous gradient
    _assert_same_bits(_through(st.sage_attention, q, k, v, do_view), want, "strided do")


# --------------------------------------------------------------------------------------------------
# (b) against the float64 references, with the INT8 kernel tests' bounds
# --------------------------------------------------------------------------------------------------

REF_CASES = [
    (1, 2, 2, 128, 128, 128, False, "HND", torch.float16, DEFAULT),
    (1, 4, 2, 239, 113, 64, True, "NHD", torch.bfloat16, DEFAULT),
    (1, 2, 1, 300, 1000, 64, True, "HND", torch.float16, PAPER),
]


@pytest.mark.parametrize("case", REF_CASES, ids=[_case_id(c) for c in REF_CASES])
def test_gradients_vs_float64_references(case):
    B, Hq, Hkv, Nq, Nk, D, causal, layout, dtype, config = case
    name = DTYPE_NAME[dtype]
    q, k, v, do = _inputs(7, B, Hq, Hkv, Nq, Nk, D, layout, dtype)
    o, dq, dk, dv = _through(st.sage_attention, q, k, v, do, causal=causal, layout=layout, config=config)
    qh, kh, vh, doh = (_host(x) for x in (q, k, v, do))
    o_sim, r_sim = ref_sage.forward(qh, kh, vh, causal=causal, layout=layout, config=config, dtype=name)
    o_ex, lse_ex = ref_attn.attention_forward(qh, kh, vh, causal=causal, layout=layout)
    o_h = _host(o)
    T._check("O", o_h, o_sim, o_ex, name, case)
    r_sim = dict(r_sim, o=ref_attn.to_hnd(o_h, layout))  # the kernel's delta uses the kernel's (rounded) O
    sims = ref_sage.backward(r_sim, doh)
    exact = ref_attn.attention_backward(qh, kh, vh, o_ex, lse_ex, doh, causal=causal, layout=layout)
    for tensor, got, sim, ex in zip(("dQ", "dK", "dV"), (dq, dk, dv), sims, exact):
        T._check(tensor, _host(got), sim, ex, name, case)


# --------------------------------------------------------------------------------------------------
# (c) torch.compile
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", sorted(DTYPE_NAME, key=str), ids=lambda d: DTYPE_NAME[d])
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compile_fullgraph_matches_eager_bitwise(backend, dtype):
    """fullgraph=True fails on any graph break. The loss sum(o * w) is fused by Inductor (its rounding
    may differ: compared to 1e-5), but its gradient dO = w is exact in the input dtype, so O and every
    gradient must match eager bit for bit. A SageBwdConfig object crosses the op boundary too."""
    config = DEFAULT.replace(k_smoothing=False)
    q, k, v, _ = _inputs(11, 2, 4, 2, 100, 128, 64, "NHD", dtype)
    w = torch.randn(q.shape, device="cuda").to(dtype).float()

    def f(q, k, v):
        o = st.sage_attention(q, k, v, causal=True, layout="NHD", config=config)
        return (o.float() * w).sum(), o

    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True, backend=backend)
    outs = {}
    for name, fn in (("eager", f), ("compiled", compiled)):
        qq, kk, vv = (x.detach().clone().requires_grad_() for x in (q, k, v))
        loss, o = fn(qq, kk, vv)
        loss.backward()
        outs[name] = (loss.detach(), o.detach(), qq.grad, kk.grad, vv.grad)
    eager, comp = outs["eager"], outs["compiled"]
    _assert_same_bits(comp[1:], eager[1:], (backend, DTYPE_NAME[dtype]))
    # The loss is an fp32 sum of 51,200 terms of both signs that cancel (|sum| is a small fraction of
    # sum |terms|), and Inductor sums in another order: the rounding difference scales with the sum of the
    # magnitudes, not with |sum| (a bound of 1e-5 |sum| failed once, at 1.05e-5). One fp32 epsilon of the
    # magnitudes is well below the worst case of reordering (2 (n - 1) eps sum |terms|).
    magnitude = (eager[1].float() * w).abs().sum().item()
    assert abs(comp[0].item() - eager[0].item()) <= torch.finfo(torch.float32).eps * magnitude


def test_compile_dynamic_shapes_bitwise():
    """The fake implementations compute the padded residual shapes from symbolic sizes."""
    def f(q, k, v):
        return st.sage_attention(q, k, v, causal=True)

    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True, dynamic=True, backend="aot_eager")
    for n in (77, 120):
        q, k, v, do = _inputs(13 + n, 1, 2, 2, n, n + 3, 64, "HND", torch.float16)
        _assert_same_bits(_through(compiled, q, k, v, do), _through(f, q, k, v, do), f"dynamic n={n}")


class _QKNormAttention(torch.nn.Module):
    """Linear -> QK-norm -> INT8 attention (fp16) -> linear, NHD throughout."""

    def __init__(self, C=128, H=2):
        super().__init__()
        self.H = H
        self.wqkv = torch.nn.Linear(C, 3 * C, bias=False)
        self.wo = torch.nn.Linear(C, C, bias=False)
        self.gq = torch.nn.Parameter(torch.full((C // H,), 2.0))
        self.gk = torch.nn.Parameter(torch.full((C // H,), 2.0))

    @staticmethod
    def _rms(x, g):
        return x * torch.rsqrt((x * x).mean(dim=-1, keepdim=True) + 1e-6) * g

    def forward(self, x):
        B, N, C = x.shape
        q, k, v = self.wqkv(x).view(B, N, 3, self.H, C // self.H).unbind(2)
        q, k = self._rms(q, self.gq), self._rms(k, self.gk)
        o = st.sage_attention(q.half(), k.half(), v.half(), causal=True, layout="NHD")
        return self.wo(o.float().reshape(B, N, C))


def test_compile_module_with_inductor():
    """A module around the op, compiled by Inductor with fullgraph=True. Inductor fuses the RMSNorm and
    rounds it differently in the last fp32 bit, which can move an fp16 input by one ulp and so an INT8
    code or scale: the comparison is relative L2 <= 1e-2, below the INT8 kernels' own error against
    exact attention (about 1.4e-2 for O at sigma = 1), and far below what a wiring error (a gradient
    routed to the wrong input, a lost scale) would give."""
    torch.manual_seed(0)
    model = _QKNormAttention().cuda()
    x = torch.randn(2, 100, 128, device="cuda")
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True)
    results = []
    for fn in (model, compiled):
        model.zero_grad(set_to_none=True)
        y = fn(x)
        y.square().mean().backward()
        results.append((y.detach(), *(p.grad.clone() for p in model.parameters())))
    for i, (a, b) in enumerate(zip(*results)):
        err = metrics.rel_l2(_host(b), _host(a))
        assert err <= 1e-2, f"output/gradient {i}: compiled vs eager rel_l2 {err:.2e}"


def test_reduce_overhead_with_graph_partition():
    """CUDA graphs around the ops: they cannot be captured (CuPy allocates during the call), so they carry the
    cudagraph_unsafe tag and inductor's graph partitioning captures the RMSNorm and projections and runs the ops
    between its graphs. Replays (the third call and later) must give what eager gives, output and gradients, to the
    same bound as test_compile_module_with_inductor (inductor's own fp32 rounding)."""
    tag = getattr(torch.Tag, "cudagraph_unsafe", None)
    if tag is None:
        pytest.skip("this PyTorch has no cudagraph_unsafe tag")
    assert tag in torch.ops.sagecupy.sage_attention_fwd.default.tags
    import torch._inductor.config as icfg

    torch.manual_seed(0)
    model = _QKNormAttention().cuda()
    x = torch.randn(2, 100, 128, device="cuda")
    torch._dynamo.reset()
    with icfg.patch(graph_partition=True):
        compiled = torch.compile(model, mode="reduce-overhead")
        results = []
        for fn, calls in ((model, 1), (compiled, 3)):
            for _ in range(calls):
                model.zero_grad(set_to_none=True)
                y = fn(x)
                y.square().mean().backward()
            results.append((y.detach().clone(), *(p.grad.clone() for p in model.parameters())))
    for i, (a, b) in enumerate(zip(*results)):
        err = metrics.rel_l2(_host(b), _host(a))
        assert err <= 1e-2, f"output/gradient {i}: reduce-overhead vs eager rel_l2 {err:.2e}"


def test_opcheck():
    """torch.library's own checks: schema (no mutation, no aliasing), fake tensors against the real
    outputs (shapes, strides, dtypes), autograd registration, AOT dispatch with dynamic shapes."""
    q, k, v, do = _inputs(17, 1, 4, 2, 100, 128, 64, "HND", torch.bfloat16)
    cfg = st._encode_config(PAPER)
    args = (q, k, v, True, None, "HND", cfg)
    fwd, bwd = torch.ops.sagecupy.sage_attention_fwd.default, torch.ops.sagecupy.sage_attention_bwd.default
    torch.library.opcheck(fwd, args)
    torch.library.opcheck(fwd, (*(x.detach().clone().requires_grad_() for x in (q, k, v)), *args[3:]))
    o, _lse, *residuals = fwd(*args)
    torch.library.opcheck(bwd, (do, o, v, *residuals, True, None, "HND", cfg))
    torch.library.opcheck(torch.ops.sagecupy.sage_attention_infer.default, args)
    torch.library.opcheck(torch.ops.sagecupy.nvfp4_attention.default, (q, k, v, True, None, "HND", ""))
    if importlib.util.find_spec("sagecupy.qat") is not None:
        torch.library.opcheck(torch.ops.sagecupy.qat_attention_fwd.default, (q, k, v, True, None, "HND", ""))


# --------------------------------------------------------------------------------------------------
# (d) streams
# --------------------------------------------------------------------------------------------------


def _busy():
    """Keep the current stream busy for tens of milliseconds (a chain of 8192^2 fp16 matmuls)."""
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.float16) * (0.5 / n ** 0.5)
    x = a
    for _ in range(40):
        x = a @ x
    return x


def _spy_on_launch_streams(monkeypatch):
    """Record CuPy's current stream at every attention kernel launch (_run_backward: the backward kernels, replayed
    or not)."""
    import cupy

    import sagecupy.int8 as s8

    seen = []
    for name in ("_launch_forward", "_run_backward"):
        real = getattr(s8, name)

        def spy(*args, _real=real, _name=name, **kwargs):
            seen.append((_name, cupy.cuda.get_current_stream().ptr))
            return _real(*args, **kwargs)

        monkeypatch.setattr(s8, name, spy)
    return seen


def _produce_late(sources):
    """NaN-filled tensors that the current stream overwrites with ``sources`` after a long busy chain:
    a kernel that reads them too early sees NaN (which propagates to every output it reaches)."""
    dst = [torch.full_like(x, float("nan")) for x in sources]
    _busy()
    for d, s in zip(dst, sources):
        d.copy_(s)
    return dst


def test_side_stream_producer_no_sync(monkeypatch):
    """Inputs produced on a side stream that is still busy; the op called on that stream without any
    synchronization. The kernels must run on that stream (checked at each launch), the call must
    return before the stream is done (no host synchronization), and the results must be those computed
    after a full sync."""
    import cupy

    q0, k0, v0, do0 = _inputs(19, 1, 4, 2, 100, 128, 64, "HND", torch.float16)
    want = _through(st.sage_attention, q0, k0, v0, do0)  # also compiles the kernels
    torch.cuda.synchronize()
    cupy_stream_before = cupy.cuda.get_current_stream().ptr
    seen = _spy_on_launch_streams(monkeypatch)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        q, k, v, do = _produce_late((q0, k0, v0, do0))
        for x in (q, k, v):
            x.requires_grad_()
        o = st.sage_attention(q, k, v)
        pending = not side.query()
        o.backward(do)
    torch.cuda.current_stream().wait_stream(side)
    got = (o.detach(), q.grad, k.grad, v.grad)
    _assert_same_bits(got, want, "side stream")
    assert pending, "the call synchronized with the producer's stream (it was idle when the call returned)"
    assert seen == [("_launch_forward", side.cuda_stream), ("_run_backward", side.cuda_stream)], seen
    assert cupy.cuda.get_current_stream().ptr == cupy_stream_before, "CuPy's current stream was not restored"


def test_current_stream_producer_no_sync(monkeypatch):
    """The same with the producer on the (default) current stream."""
    q0, k0, v0, do0 = _inputs(23, 2, 2, 1, 64, 128, 128, "NHD", torch.bfloat16)
    want = _through(st.sage_attention, q0, k0, v0, do0, layout="NHD")
    torch.cuda.synchronize()
    seen = _spy_on_launch_streams(monkeypatch)
    q, k, v, do = _produce_late((q0, k0, v0, do0))
    for x in (q, k, v):
        x.requires_grad_()
    o = st.sage_attention(q, k, v, layout="NHD")
    pending = not torch.cuda.current_stream().query()
    o.backward(do)
    _assert_same_bits((o.detach(), q.grad, k.grad, v.grad), want, "current stream")
    assert pending, "the call synchronized with the producer's stream"
    ptr = torch.cuda.current_stream().cuda_stream
    assert [p for _, p in seen] == [ptr, ptr], seen


def test_function_path_runs_on_side_stream(monkeypatch):
    q0, k0, v0, do0 = _inputs(29, 1, 2, 2, 50, 70, 64, "HND", torch.float16)
    want = _through(_function, q0, k0, v0, do0)
    torch.cuda.synchronize()
    seen = _spy_on_launch_streams(monkeypatch)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        q, k, v, do = _produce_late((q0, k0, v0, do0))
        got = _through(_function, q, k, v, do)
    torch.cuda.current_stream().wait_stream(side)
    _assert_same_bits(got, want, "function path, side stream")
    assert [p for _, p in seen] == [side.cuda_stream] * 2, seen


def test_second_gpu():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    q, k, v, do = _inputs(31, 1, 2, 2, 64, 64, 64, "HND", torch.float16)
    want = _through(st.sage_attention, q, k, v, do)
    on1 = [x.to("cuda:1") for x in (q, k, v, do)]
    got = _through(st.sage_attention, *on1)
    assert all(x.device.index == 1 for x in got)
    _assert_same_bits(got, want, "cuda:1")
    with pytest.raises(ValueError, match="one GPU"):
        st.sage_attention(q, on1[1], on1[2])


# --------------------------------------------------------------------------------------------------
# (e) errors, import isolation
# --------------------------------------------------------------------------------------------------


def test_error_paths():
    q = torch.zeros(1, 2, 16, 64, device="cuda", dtype=torch.float16)
    q96 = torch.zeros(1, 2, 16, 96, device="cuda", dtype=torch.float16)
    for fn in (st.sage_attention, _function):
        with pytest.raises(TypeError, match="q is a cpu tensor"):
            fn(q.cpu(), q, q)
        with pytest.raises(TypeError, match="v is a cpu tensor"):
            fn(q, q, q.cpu())
        with pytest.raises(TypeError, match=r"q\.dtype=torch\.float32 is not supported"):
            fn(q.float(), q.float(), q.float())
        with pytest.raises(TypeError, match="share one dtype"):
            fn(q, q, q.bfloat16())
        with pytest.raises(TypeError, match="q must be a torch.Tensor"):
            fn(np.zeros((1, 2, 16, 64), np.float16), q, q)
        with pytest.raises(ValueError, match="head_dim"):
            fn(q96, q96, q96)
        with pytest.raises(ValueError, match="layout"):
            fn(q, q, q, layout="BHSD")
        with pytest.raises(ValueError, match="config"):
            fn(q, q, q, config="fast")
        with pytest.raises(ValueError, match="sm_scale"):
            fn(q, q, q, sm_scale=-1.0)
        with pytest.raises(ValueError, match="multiple of kv heads"):
            fn(torch.zeros(1, 3, 16, 64, device="cuda", dtype=torch.float16), q, q)
    with pytest.raises(TypeError, match="causal"):
        st.sage_attention(q, q, q, causal="yes")
    with pytest.raises(TypeError, match="sm_scale"):
        st.sage_attention(q, q, q, sm_scale="large")


def test_qat_op_without_qat_module_raises_import_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "sagecupy.qat", None)  # as if the module did not exist
    q = torch.zeros(1, 2, 16, 64, device="cuda", dtype=torch.float16)
    with pytest.raises(ImportError, match="sagecupy.qat"):
        st.qat_attention(q, q, q)


def test_importing_sagecupy_does_not_import_torch():
    code = "import sys, sagecupy, sagecupy.int8, sagecupy.autograd; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


# --------------------------------------------------------------------------------------------------
# (f) FP4 QAT
# --------------------------------------------------------------------------------------------------


def _qat_module():
    if importlib.util.find_spec("sagecupy.qat") is None:
        pytest.skip("sagecupy.qat is not in this installation")
    import sagecupy.qat as qat  # an import error here is a failure, not a skip

    if not (callable(getattr(qat, "forward", None)) and callable(getattr(qat, "backward", None))):
        pytest.skip("sagecupy.qat has no forward/backward yet")
    return qat


QAT_CASES = [
    (1, 2, 2, 100, 128, 64, False, "HND", torch.float16),
    (2, 4, 2, 77, 128, 128, True, "NHD", torch.bfloat16),
    (1, 4, 1, 128, 60, 64, True, "HND", torch.bfloat16),
]


@pytest.mark.parametrize("path", ["function", "op", "compiled"])
@pytest.mark.parametrize("case", QAT_CASES, ids=[_case_id(c) for c in QAT_CASES])
def test_qat_gradients_equal_direct_calls_bitwise(path, case):
    """Eager (QATAttentionFunction), the custom ops in eager mode, and the custom ops under
    torch.compile (whose backward recomputes the residuals: bitwise only if the QAT forward is a
    deterministic function of q, k, v) against sagecupy.qat.forward/backward called directly."""
    qat = _qat_module()
    B, Hq, Hkv, Nq, Nk, D, causal, layout, dtype = case
    q, k, v, do = _inputs(37, B, Hq, Hkv, Nq, Nk, D, layout, dtype)
    kw = dict(causal=causal, layout=layout)

    def op(q, k, v):
        return st._qat_attention_op(q, k, v, causal, None, layout, None)

    def eager(q, k, v):
        return st.qat_attention(q, k, v, **kw)

    if path == "compiled":
        torch._dynamo.reset()
        fn = torch.compile(eager, fullgraph=True, backend="aot_eager")
    else:
        fn = {"function": eager, "op": op}[path]
    try:
        want = _direct(qat, q, k, v, do, **kw)
    except ImportError as exc:  # qat.backward imports its implementation when called
        pytest.skip(f"sagecupy.qat.backward is not available here: {exc}")
    got = _through(fn, q, k, v, do)
    _assert_same_bits(got, want, (path, _case_id(case)))


# --------------------------------------------------------------------------------------------------
# the example
# --------------------------------------------------------------------------------------------------


def test_recall_example_trains():
    spec = importlib.util.spec_from_file_location("recall_torch_example", ROOT / "examples" / "recall_torch.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    for impl in ("sdpa", "sagebwd"):
        curve = mod.train(impl, steps=60, log=None)
        assert np.all(np.isfinite(curve))
        assert np.mean(curve[-5:]) < 0.8 * curve[0], f"{impl}: loss {curve[0]:.3f} -> {np.mean(curve[-5:]):.3f}"


# --------------------------------------------------------------------------------------------------
# (g) return_lse and NVFP4
# --------------------------------------------------------------------------------------------------


def _host_f32(x):
    return x.detach().cpu().numpy() if isinstance(x, torch.Tensor) else T._raw(x).get()


@pytest.mark.parametrize("grad", [False, True], ids=["infer", "train"])
def test_return_lse_is_the_forwards(grad):
    """sage_attention(return_lse=True): the LSE of the direct call bit for bit (int8.sage_attention for the inference
    op, int8.forward for the training op), without gradient; O unchanged."""
    import sagecupy.int8 as s8

    q, k, v, do = _inputs(41, 1, 4, 2, 90, 130, 64, "NHD", torch.bfloat16)
    q = q.detach().requires_grad_(grad)
    o, lse = st.sage_attention(q, k, v, causal=True, layout="NHD", return_lse=True)
    cq, ck, cv = (T._to_dev(_host(x), "bfloat16") for x in (q, k, v))
    if grad:
        o_ref, lse_ref, _ = s8.forward(cq, ck, cv, causal=True, layout="NHD", return_lse=True)
    else:
        o_ref, lse_ref = s8.sage_attention(cq, ck, cv, causal=True, layout="NHD", return_lse=True)
    _assert_same_bits([o], [o_ref], "return_lse", names=("O",))
    assert lse.shape == (1, 4, 90) and lse.dtype == torch.float32 and not lse.requires_grad
    assert np.array_equal(_host_f32(lse), _host_f32(lse_ref), equal_nan=True)
    if grad:
        o.backward(do)  # the LSE output does not get in the way of the backward
        assert q.grad is not None


def test_inference_replays_its_plan_on_new_tensors():
    """The inference call keeps its plan by tensor metadata and replays it on the next tensors of the same shapes,
    strides and alignment (sagecupy/adapters/torch_ops.py, _PLANS): O and the LSE stay the direct call's, bit
    for bit, over new data, a strided view (copied by the pre-pass, so not kept), a misaligned view and a new config."""
    import sagecupy.int8 as s8
    from sagecupy.adapters import torch_ops

    def check(q, k, v, case, **kw):
        o, lse = st.sage_attention(q, k, v, return_lse=True, **kw)
        cq, ck, cv = (T._to_dev(_host(x), "bfloat16") for x in (q, k, v))
        o_ref, lse_ref = s8.sage_attention(cq, ck, cv, return_lse=True, **kw)
        _assert_same_bits([o], [o_ref], case, names=("O",))
        assert np.array_equal(_host_f32(lse), _host_f32(lse_ref), equal_nan=True), case

    torch_ops._PLANS.clear()
    shape = (2, 4, 2, 150, 90, 128, "HND", torch.bfloat16)
    for seed in (61, 62, 63):  # the first call records, the next ones replay
        q, k, v, _ = _inputs(seed, *shape)
        check(q, k, v, f"seed {seed}", causal=True)
    assert len(torch_ops._PLANS) == 1
    q, k, v, _ = _inputs(64, *shape)
    check(q, k, v, "not causal")  # a new key
    check(q, k, v, "paper", causal=True, config="paper")
    assert len(torch_ops._PLANS) == 3
    wide = torch.zeros(2, 4, 150, 129, device="cuda", dtype=torch.bfloat16)
    # rows of 129 elements: q as a view at an odd element offset is misaligned, and the pre-pass copies it
    for seed in (65, 66):
        wide[..., 1:] = _inputs(seed, *shape)[0]
        check(wide[..., 1:], k, v, f"misaligned q {seed}", causal=True)
    assert len(torch_ops._PLANS) == 3
    check(q.transpose(2, 3).contiguous().transpose(2, 3), k, v, "column-major q", causal=True)
    assert len(torch_ops._PLANS) == 3


def test_training_forward_replays_its_plan_on_new_tensors():
    """The training forward keeps its plan as the inference call does, and the backward its programs under the
    forward's key and dO's metadata: O and the gradients stay the direct calls' (int8.forward, int8.backward), bit
    for bit, over new data on the recorded plans, for an input the pre-pass copies (a column-major v: neither plan
    kept) and for a dO the backward's pre-pass copies (misaligned: its programs not kept)."""
    import sagecupy.int8 as s8
    from sagecupy.adapters import torch_ops

    replayed = []  # per call of int8._training / int8._backward_replay: whether it replayed
    real_training, real_backward = s8._training, s8._backward_replay

    def training(q, k, v, plan=None, **kw):
        replayed.append(("fwd", plan is not None and type(q) is int))
        return real_training(q, k, v, plan, **kw)

    def backward_replay(r, do, replay=None):
        replayed.append(("bwd", replay is not None))
        return real_backward(r, do, replay)

    def check(q, k, v, do, case, twice=False):
        q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
        o = st.sage_attention(q, k, v, causal=True)
        o.backward(do, retain_graph=twice)
        cq, ck, cv, cdo = (T._to_dev(_host(x), "bfloat16") for x in (q, k, v, do))
        o_ref, res = s8.forward(cq, ck, cv, causal=True)
        want = [o_ref, *s8.backward(res, cdo)]
        _assert_same_bits([o, q.grad, k.grad, v.grad], want, case)
        if twice:  # a second backward through the retained graph: the same replay, the same gradients
            _assert_same_bits(torch.autograd.grad(o, (q, k, v), do), want[1:], case + " (second backward)",
                              names=("dQ", "dK", "dV"))

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(s8, "_training", training)
        mp.setattr(s8, "_backward_replay", backward_replay)
        torch_ops._PLANS.clear()
        torch_ops._BWD_REPLAYS.clear()
        shape = (2, 4, 2, 150, 90, 128, "HND", torch.bfloat16)
        for seed in (71, 72, 73):  # the first call records, the next ones replay
            check(*_inputs(seed, *shape), f"seed {seed}", twice=seed == 73)
    assert replayed == [("fwd", False), ("bwd", False), ("fwd", True), ("bwd", True), ("fwd", True), ("bwd", True),
                        ("bwd", True)], replayed
    assert len(torch_ops._PLANS) == 1 and len(torch_ops._BWD_REPLAYS) == 1
    q, k, v, do = _inputs(74, *shape)
    check(q, k, v.transpose(2, 3).contiguous().transpose(2, 3), do, "column-major v")
    assert len(torch_ops._PLANS) == 1 and len(torch_ops._BWD_REPLAYS) == 1
    for seed in (75, 76):  # a contiguous dO 2 bytes past an aligned address: a new key, and copied
        flat = torch.empty(do.numel() + 1, device="cuda", dtype=do.dtype)
        misaligned = flat[1:].view(do.shape)
        misaligned.copy_(_inputs(seed, *shape)[3])
        check(q, k, v, misaligned, f"misaligned dO {seed}")
    assert len(torch_ops._PLANS) == 1 and len(torch_ops._BWD_REPLAYS) == 1


def test_inference_and_training_plans_are_kept_apart():
    """A call without gradient and a call with one on the same tensors key two plans (the inference pre-pass keeps
    no plain K codes, which the backward reads): each replays its own, and the gradients stay the direct call's."""
    import sagecupy.int8 as s8
    from sagecupy.adapters import torch_ops

    torch_ops._PLANS.clear()
    shape = (1, 4, 4, 200, 200, 64, "HND", torch.float16)
    for seed in (81, 82):
        q, k, v, do = _inputs(seed, *shape)
        with torch.no_grad():
            o_plain = st.sage_attention(q, k, v, causal=True)
        qg, kg, vg = (x.detach().requires_grad_() for x in (q, k, v))
        o = st.sage_attention(qg, kg, vg, causal=True)
        o.backward(do)
        cq, ck, cv, cdo = (T._to_dev(_host(x), "float16") for x in (q, k, v, do))
        o_ref, res = s8.forward(cq, ck, cv, causal=True)
        _assert_same_bits([o_plain, o, qg.grad, kg.grad, vg.grad], [o_ref, o_ref, *s8.backward(res, cdo)],
                          f"seed {seed}", names=("O (no grad)", "O", "dQ", "dK", "dV"))
    assert len(torch_ops._PLANS) == 2


def test_nvfp4_op_is_the_direct_call():
    import sagecupy.nvfp4 as nv

    for layout, causal in (("HND", True), ("NHD", False)):
        q, k, v, _ = _inputs(43, 1, 4, 2, 100, 200, 128, layout, torch.float16)
        o, lse = st.nvfp4_attention(q, k, v, causal=causal, layout=layout, return_lse=True)
        cq, ck, cv = (T._to_dev(_host(x), "float16") for x in (q, k, v))
        o_ref, lse_ref = nv.attention(cq, ck, cv, causal=causal, layout=layout, return_lse=True)
        _assert_same_bits([o], [o_ref], ("nvfp4", layout), names=("O",))
        assert np.array_equal(_host_f32(lse), _host_f32(lse_ref), equal_nan=True)
    # (q, k, v are the last loop's NHD tensors: the layout goes with them)
    with pytest.raises(ValueError, match="inference-only"):
        st.nvfp4_attention(q.detach().requires_grad_(), k, v, layout=layout)
    with torch.no_grad():
        st.nvfp4_attention(q.detach().requires_grad_(), k, v, layout=layout)  # no gradient needed: runs
    with pytest.raises(TypeError, match="NVFP4Config"):
        st.nvfp4_attention(q, k, v, config=DEFAULT)


def test_nvfp4_compiles_fullgraph():
    q, k, v, _ = _inputs(47, 1, 4, 4, 128, 128, 64, "HND", torch.bfloat16)

    def f(q, k, v):
        return st.nvfp4_attention(q, k, v, causal=True) * 2

    torch._dynamo.reset()
    with torch.no_grad():
        got = torch.compile(f, fullgraph=True, backend="aot_eager")(q, k, v)
        _assert_same_bits([got], [f(q, k, v)], "nvfp4 compiled", names=("O",))


# --------------------------------------------------------------------------------------------------
# (h) the drop-in scaled_dot_product_attention
# --------------------------------------------------------------------------------------------------

F = torch.nn.functional

SDPA_CASES = [
    # B, Hq, Hkv, Nq, Nk, D, is_causal, dtype
    (2, 4, 4, 128, 128, 64, True, torch.bfloat16),
    (1, 8, 2, 200, 200, 128, True, torch.float16),  # GQA (enable_gqa)
    (1, 4, 4, 100, 300, 64, False, torch.bfloat16),  # Nq != Nk without a mask: the kernels' too
]


@pytest.fixture
def counts():
    st.reset_fallback_counts()
    yield st.fallback_counts
    st.reset_fallback_counts()


@pytest.mark.parametrize("case", SDPA_CASES, ids=[f"{c[3]}x{c[4]}-d{c[5]}-{'causal' if c[6] else 'full'}-gqa{c[1] // c[2]}"
                                                  for c in SDPA_CASES])
def test_sdpa_dropin_runs_the_kernels(case, counts):
    """Output and gradients bitwise those of sage_attention (PyTorch's top-left causal equals the kernels'
    bottom-right on square masks); within the INT8 error of PyTorch's own SDPA; nothing falls back."""
    B, Hq, Hkv, Nq, Nk, D, causal, dtype = case
    q, k, v, do = _inputs(53, B, Hq, Hkv, Nq, Nk, D, "HND", dtype)

    def dropin(q, k, v):
        return st.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=Hq != Hkv)

    got = _through(dropin, q, k, v, do)
    _assert_same_bits(got, _through(st.sage_attention, q, k, v, do, causal=causal), "drop-in")
    assert counts() == {}
    ref = F.scaled_dot_product_attention(*(x.float() for x in (q, k, v)), is_causal=causal, enable_gqa=Hq != Hkv)
    err = metrics.rel_l2(_host(got[0]), _host(ref))
    # INT8 SageBwd's O is ~1.5e-2 from exact attention at sigma 1 (README); a wrong mask or head mapping is O(1)
    assert err <= 3e-2, err
    assert st._environment_reason(q.device.index) == ""


def test_sdpa_dropin_falls_back_bitwise(counts):
    """What the kernels do not compute is PyTorch's SDPA, bit for bit, counted once per call by reason."""
    q, k, v, _ = _inputs(59, 1, 4, 4, 64, 64, 64, "HND", torch.float16)
    q96, k96, v96, _ = _inputs(59, 1, 4, 4, 64, 64, 96, "HND", torch.float16)
    mask = torch.ones(64, 64, device="cuda", dtype=torch.bool).tril()
    calls = [((q, k[:, :, :40], v[:, :, :40]), dict(is_causal=True)),  # top-left causal, Nq != Nk
             ((q, k, v), dict(attn_mask=mask)),
             ((q96, k96, v96), {}),
             ((q.float(), k.float(), v.float()), {})]
    with pytest.warns(st.SageFallbackWarning):
        for args, kw in calls:
            assert torch.equal(st.scaled_dot_product_attention(*args, **kw), F.scaled_dot_product_attention(*args, **kw))
    assert sorted(counts().values()) == [1, 1, 1, 1]
    torch.manual_seed(0)
    got = st.scaled_dot_product_attention(q, k, v, dropout_p=0.5)
    torch.manual_seed(0)
    assert torch.equal(got, F.scaled_dot_product_attention(q, k, v, dropout_p=0.5))
    with pytest.raises(ValueError, match="attn_mask"):
        st.scaled_dot_product_attention(q, k, v, attn_mask=mask, fallback="error")


def test_sdpa_dropin_families(counts):
    q, k, v, do = _inputs(61, 1, 4, 2, 128, 128, 128, "HND", torch.bfloat16)
    with torch.no_grad():
        _assert_same_bits([st.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True, family="nvfp4")],
                          [st.nvfp4_attention(q, k, v, causal=True)], "nvfp4", names=("O",))
    with pytest.warns(st.SageFallbackWarning, match="inference-only"):
        st.scaled_dot_product_attention(q.detach().requires_grad_(), k, v, enable_gqa=True, family="nvfp4")
    assert len(counts()) == 1
    if importlib.util.find_spec("sagecupy.qat") is not None:
        def dropin(q, k, v):
            return st.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True, family="qat")

        _assert_same_bits(_through(dropin, q, k, v, do), _through(st.qat_attention, q, k, v, do, causal=True), "qat")
    assert len(counts()) == 1


def test_sdpa_dropin_compiles_fullgraph(counts):
    q, k, v, do = _inputs(67, 2, 4, 2, 100, 100, 64, "HND", torch.float16)

    def f(q, k, v):
        return st.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    _assert_same_bits(_through(compiled, q, k, v, do), _through(f, q, k, v, do), "drop-in compiled")
    assert counts() == {}


# --------------------------------------------------------------------------------------------------
# (i) the sliding window
# --------------------------------------------------------------------------------------------------

WINDOW_SHAPES = [
    # B, Hq, Hkv, Nq, Nk, D, causal, layout
    (1, 4, 2, 200, 333, 64, False, "HND"),   # Nq < Nk: the window's diagonal is shifted by Nk - Nq
    (2, 2, 1, 300, 130, 128, False, "NHD"),  # Nq > Nk: rows that see no key
]
WINDOWS = [(64, 0), (17, 5)]


def _window_id(shape, window, dtype):
    B, Hq, Hkv, Nq, Nk, D, _, layout = shape
    return f"{Nq}x{Nk}-d{D}-{layout}-gqa{Hq // Hkv}-w{window[0]}_{window[1]}-{DTYPE_NAME[dtype]}"


WINDOW_CASES = [(s, w, d) for s in WINDOW_SHAPES for w in WINDOWS for d in (torch.float16, torch.bfloat16)]


@pytest.mark.parametrize("path", sorted(PATHS))
@pytest.mark.parametrize("shape,window,dtype", WINDOW_CASES, ids=[_window_id(*c) for c in WINDOW_CASES])
def test_window_gradients_equal_direct_calls_bitwise(path, shape, window, dtype):
    import sagecupy.int8 as s8

    B, Hq, Hkv, Nq, Nk, D, causal, layout = shape
    q, k, v, do = _inputs(71, B, Hq, Hkv, Nq, Nk, D, layout, dtype)
    kw = dict(causal=causal, layout=layout, window=window)
    got = _through(PATHS[path], q, k, v, do, **kw)
    _assert_same_bits(got, _direct(s8, q, k, v, do, **kw), (path, _window_id(shape, window, dtype)))
    # the window is in effect: without it the output differs
    plain = st.sage_attention(q, k, v, causal=causal, layout=layout)
    assert not torch.equal(plain, got[0])


@pytest.mark.parametrize("grad", [False, True], ids=["infer", "train"])
@pytest.mark.parametrize("shape,window,dtype", WINDOW_CASES, ids=[_window_id(*c) for c in WINDOW_CASES])
def test_window_return_lse_is_the_forwards(shape, window, dtype, grad):
    """O and LSE of the inference op (int8.sage_attention) and of the training op (int8.forward) with a window,
    bitwise the direct calls'; the training op's backward gets the window through the residuals."""
    import sagecupy.int8 as s8

    B, Hq, Hkv, Nq, Nk, D, causal, layout = shape
    q, k, v, do = _inputs(73, B, Hq, Hkv, Nq, Nk, D, layout, dtype)
    q = q.detach().requires_grad_(grad)
    o, lse = st.sage_attention(q, k, v, causal=causal, layout=layout, window=window, return_lse=True)
    cq, ck, cv = (T._to_dev(_host(x), DTYPE_NAME[dtype]) for x in (q, k, v))
    kw = dict(causal=causal, layout=layout, window=window, return_lse=True)
    if grad:
        o_ref, lse_ref, res = s8.forward(cq, ck, cv, **kw)
        assert res.problem.window == window
    else:
        o_ref, lse_ref = s8.sage_attention(cq, ck, cv, **kw)
    case = (grad, _window_id(shape, window, dtype))
    _assert_same_bits([o], [o_ref], case, names=("O",))
    assert lse.shape == (B, Hq, Nq) and lse.dtype == torch.float32 and not lse.requires_grad
    assert np.array_equal(_host_f32(lse), _host_f32(lse_ref), equal_nan=True), case
    if grad:
        o.backward(do)
        want = s8.backward(res, T._to_dev(_host(do), DTYPE_NAME[dtype]))
        _assert_same_bits([q.grad], [want[0]], case, names=("dQ",))


@pytest.mark.parametrize("dtype", sorted(DTYPE_NAME, key=str), ids=lambda d: DTYPE_NAME[d])
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_window_compiles_fullgraph_bitwise(backend, dtype):
    """fullgraph=True (any graph break fails): O and gradients of the compiled call with a window equal eager's and
    the direct calls', bit for bit; a window side passed as an argument (symbolic once it changes) too."""
    import sagecupy.int8 as s8

    q, k, v, do = _inputs(79, 1, 4, 2, 150, 260, 64, "HND", dtype)

    def f(q, k, v):
        return st.sage_attention(q, k, v, causal=True, window=(64, 0))

    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True, backend=backend)
    got = _through(compiled, q, k, v, do)
    _assert_same_bits(got, _through(f, q, k, v, do), (backend, "eager"))
    _assert_same_bits(got, _direct(s8, q, k, v, do, causal=True, window=(64, 0)), (backend, "direct"))

    def g(q, k, v, left):
        return st.sage_attention(q, k, v, window=(left, 5))

    compiled = torch.compile(g, fullgraph=True, backend=backend)
    for left in (17, 40, 3):
        got = _through(functools.partial(compiled, left=left), q, k, v, do)
        _assert_same_bits(got, _direct(s8, q, k, v, do, window=(left, 5)), (backend, left))


def test_window_opcheck():
    """torch.library's checks of the INT8 ops with the window arguments (the fake implementations against the real
    outputs, autograd registration, AOT dispatch)."""
    q, k, v, do = _inputs(83, 1, 4, 2, 100, 170, 64, "HND", torch.float16)
    args = (q, k, v, False, None, "HND", "", 17, 5)
    fwd, bwd = torch.ops.sagecupy.sage_attention_fwd.default, torch.ops.sagecupy.sage_attention_bwd.default
    torch.library.opcheck(fwd, args)
    torch.library.opcheck(fwd, (*(x.detach().clone().requires_grad_() for x in (q, k, v)), *args[3:]))
    o, _lse, *residuals = fwd(*args)
    torch.library.opcheck(bwd, (do, o, v, *residuals, False, None, "HND", "", 17, 5))
    torch.library.opcheck(torch.ops.sagecupy.sage_attention_infer.default, args)


def test_window_errors():
    q = torch.zeros(1, 2, 16, 64, device="cuda", dtype=torch.float16)
    for fn in (st.sage_attention, _function):
        with pytest.raises(ValueError, match="window"):
            fn(q, q, q, window=(-2, 0))
        with pytest.raises(ValueError, match=r"causal=True contradicts window=\(3, 1\)"):
            fn(q, q, q, causal=True, window=(3, 1))
        with pytest.raises(ValueError, match=r"causal=True contradicts window=\(-1, -1\)"):
            fn(q, q, q, causal=True, window=(-1, -1))
