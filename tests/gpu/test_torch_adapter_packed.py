"""Packed variable-length sequences (``layout="THD"``, ``cu_seqlens_q/k``) through the PyTorch adapter on the GPU.

* Bitwise: O, the LSE and the three gradients of ``sagecupy.torch.sage_attention(layout="THD", ...)`` (the custom
  ops: the forward op's table of offsets saved for the backward op) and of ``SageAttentionFunction`` equal
  ``sagecupy.int8.forward``/``backward`` called directly on CuPy copies of the same values and offsets; the inference
  op (no gradient needed) equals ``sagecupy.int8.sage_attention``. Documents of lengths (17, 0, 300), (128, 129) and
  with Nq != Nk per document, GQA, fp16 and bf16, causal, a window, both.
* ``torch.compile(fullgraph=True)`` (aot_eager, inductor) over a packed call: no graph break, the bits of eager and
  of the direct calls; other document lengths and maxima through the same compiled function.
* ``torch.library.opcheck`` of the INT8 ops with the packed arguments; errors naming the argument.

Neither backward kernel uses atomics, so every gradient is compared bit for bit.
"""
import functools

import numpy as np
import pytest

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")

import sagecupy.torch as st  # noqa: E402  (needs torch: after the skip)
import test_int8 as T  # noqa: E402  the INT8 kernel tests' helpers (same folder)
from test_torch_adapter import DTYPE_NAME, _assert_same_bits, _host, _host_f32, _via_dispatcher  # noqa: E402

LENS = {"17-0-300": [(17, 17), (0, 0), (300, 300)], "128-129": [(128, 128), (129, 129)],
        "unequal": [(40, 70), (0, 5), (9, 0), (200, 64)]}


def _packed(seed, lens, Hq, Hkv, D, dtype):
    """q, k, v, do as packed CUDA tensors (each document's K with a mean of its own) and the int32 CUDA offsets."""
    rng = np.random.default_rng(seed)
    cq = np.concatenate([[0], np.cumsum([a for a, _ in lens])]).astype(np.int32)
    ck = np.concatenate([[0], np.cumsum([b for _, b in lens])]).astype(np.int32)
    q = rng.standard_normal((cq[-1], Hq, D))
    k = rng.standard_normal((ck[-1], Hkv, D))
    for s in range(len(lens)):
        k[ck[s]:ck[s + 1]] += 0.5 * rng.standard_normal((1, 1, D))
    v = rng.standard_normal((ck[-1], Hkv, D))
    do = rng.standard_normal((cq[-1], Hq, D))
    tensors = [torch.from_numpy(x.astype(np.float32)).to("cuda").to(dtype) for x in (q, k, v, do)]
    return tensors, [torch.from_numpy(c).to("cuda") for c in (cq, ck)]


def _direct(q, k, v, do, cu_q, cu_k, **kw):
    """o, lse, dq, dk, dv of sagecupy.int8.forward / backward on CuPy copies (through the host) of the same values."""
    import cupy

    import sagecupy.int8 as s8

    name = DTYPE_NAME[q.dtype]
    cq, ck, cv, cdo = (T._to_dev(_host(x), name) for x in (q, k, v, do))
    offsets = dict(cu_seqlens_q=cupy.asarray(cu_q.cpu().numpy()), cu_seqlens_k=cupy.asarray(cu_k.cpu().numpy()))
    o, lse, res = s8.forward(cq, ck, cv, layout="THD", return_lse=True, **offsets, **kw)
    assert res.packed is not None
    return (o, lse, *s8.backward(res, cdo))


def _function(q, k, v, *, causal=False, window=None, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None,
              max_seqlen_k=None, return_lse=False):
    return st.SageAttentionFunction.apply(q, k, v, causal, None, "THD", None, return_lse, window, cu_seqlens_q,
                                          cu_seqlens_k, max_seqlen_q, max_seqlen_k)


PATHS = {"op": functools.partial(st.sage_attention, layout="THD"), "function": _function,
         "dispatcher": functools.partial(_via_dispatcher, st.sage_attention, layout="THD")}

# lens, Hq, Hkv, D, causal, window
CASES = [("17-0-300", 4, 2, 64, True, None), ("17-0-300", 4, 4, 128, False, (64, 0)),
         ("128-129", 4, 2, 128, True, None), ("128-129", 8, 2, 64, False, (17, 5)),
         ("unequal", 4, 2, 64, True, (40, 0)), ("unequal", 2, 1, 128, False, None)]


def _id(c, dtype):
    lens, Hq, Hkv, D, causal, window = c
    w = "" if window is None else f"-w{window[0]}_{window[1]}"
    return f"{lens}-d{D}-gqa{Hq // Hkv}-{'causal' if causal else 'full'}{w}-{DTYPE_NAME[dtype]}"


ALL = [(c, d) for c in CASES for d in (torch.float16, torch.bfloat16)]


@pytest.mark.parametrize("path", sorted(PATHS))
@pytest.mark.parametrize("case,dtype", ALL, ids=[_id(*c) for c in ALL])
def test_packed_equals_direct_calls_bitwise(path, case, dtype):
    lens, Hq, Hkv, D, causal, window = case
    (q, k, v, do), (cu_q, cu_k) = _packed(11, LENS[lens], Hq, Hkv, D, dtype)
    kw = dict(causal=causal, window=window)
    longest = max(a for a, _ in LENS[lens]), max(b for _, b in LENS[lens])
    q_, k_, v_ = (x.detach().requires_grad_() for x in (q, k, v))
    o, lse = PATHS[path](q_, k_, v_, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=longest[0],
                         max_seqlen_k=longest[1], return_lse=True, **kw)
    o.backward(do)
    o_d, lse_d, *grads_d = _direct(q, k, v, do, cu_q, cu_k, **kw)
    tag = (path, _id(case, dtype))
    _assert_same_bits([o, q_.grad, k_.grad, v_.grad], [o_d, *grads_d], tag)
    assert lse.shape == (Hq, q.shape[0]) and lse.dtype == torch.float32 and not lse.requires_grad
    assert np.array_equal(_host_f32(lse), _host_f32(lse_d), equal_nan=True), tag


@pytest.mark.parametrize("case,dtype", ALL[:4], ids=[_id(*c) for c in ALL[:4]])
def test_packed_inference_op_is_int8_sage_attention(case, dtype):
    import cupy

    import sagecupy.int8 as s8

    lens, Hq, Hkv, D, causal, window = case
    (q, k, v, _), (cu_q, cu_k) = _packed(13, LENS[lens], Hq, Hkv, D, dtype)
    with torch.no_grad():
        o, lse = st.sage_attention(q.requires_grad_(), k, v, layout="THD", cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                                   causal=causal, window=window, return_lse=True)
    cq, ck, cv = (T._to_dev(_host(x), DTYPE_NAME[dtype]) for x in (q, k, v))
    o_d, lse_d = s8.sage_attention(cq, ck, cv, layout="THD", cu_seqlens_q=cupy.asarray(cu_q.cpu().numpy()),
                                   cu_seqlens_k=cupy.asarray(cu_k.cpu().numpy()), causal=causal, window=window,
                                   return_lse=True)
    _assert_same_bits([o], [o_d], _id(case, dtype), names=("O",))
    assert np.array_equal(_host_f32(lse), _host_f32(lse_d), equal_nan=True)
    assert not o.requires_grad


@pytest.mark.parametrize("dtype", sorted(DTYPE_NAME, key=str), ids=lambda d: DTYPE_NAME[d])
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_packed_compiles_fullgraph_bitwise(backend, dtype):
    """fullgraph=True (any graph break fails): the compiled packed call's O and gradients equal eager's and the
    direct calls'; other document lengths (the same S, then another S) and maxima run through the same function."""

    def f(q, k, v, cu_q, cu_k, longest):
        return st.sage_attention(q, k, v, layout="THD", cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=longest,
                                 max_seqlen_k=longest, causal=True, window=(64, 0)) * 2

    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True, backend=backend)
    for lens in (LENS["128-129"], [(100, 100), (157, 157)], LENS["17-0-300"]):
        (q, k, v, do), (cu_q, cu_k) = _packed(17, lens, 4, 2, 64, dtype)
        longest = max(a for a, _ in lens)
        runs = []
        for fn in (compiled, f):
            q_, k_, v_ = (x.detach().requires_grad_() for x in (q, k, v))
            o = fn(q_, k_, v_, cu_q, cu_k, longest)
            o.backward(do)
            runs.append([o.detach(), q_.grad, k_.grad, v_.grad])
        _assert_same_bits(runs[0], runs[1], (backend, lens, "eager"))
        o_d, _, *grads_d = _direct(q, k, v, 2 * do, cu_q, cu_k, causal=True, window=(64, 0))
        _assert_same_bits(runs[0][1:], grads_d, (backend, lens, "direct"), names=("dQ", "dK", "dV"))


def test_packed_opcheck():
    """torch.library's checks of the INT8 ops with the packed arguments (the fakes against the real outputs, the
    table included; autograd registration; AOT dispatch with dynamic shapes)."""
    (q, k, v, do), (cu_q, cu_k) = _packed(19, LENS["17-0-300"], 4, 2, 64, torch.bfloat16)
    args = (q, k, v, True, None, "THD", "", 64, 0, cu_q, cu_k, 300, 300)
    fwd, bwd = torch.ops.sagecupy.sage_attention_fwd.default, torch.ops.sagecupy.sage_attention_bwd.default
    torch.library.opcheck(fwd, args)
    torch.library.opcheck(fwd, (*(x.detach().clone().requires_grad_() for x in (q, k, v)), *args[3:]))
    o, _lse, *residuals = fwd(*args)
    assert residuals[-1].dtype == torch.int32 and residuals[-1].numel() > 0
    torch.library.opcheck(bwd, (do, o, v, *residuals, True, None, "THD", "", 64, 0, cu_q, cu_k))
    torch.library.opcheck(torch.ops.sagecupy.sage_attention_infer.default, args)


def test_packed_errors():
    (q, k, v, _), (cu_q, cu_k) = _packed(23, LENS["unequal"], 2, 2, 64, torch.float16)
    with pytest.raises(TypeError, match=r"cu_seqlens_q is a cpu tensor"):
        st.sage_attention(q, k, v, layout="THD", cu_seqlens_q=cu_q.cpu(), cu_seqlens_k=cu_k)
    with pytest.raises(TypeError, match=r"cu_seqlens_k\.dtype=torch\.int64 must be torch\.int32"):
        st.sage_attention(q, k, v, layout="THD", cu_seqlens_q=cu_q, cu_seqlens_k=cu_k.long())
    with pytest.raises(ValueError, match="cu_seqlens_q is only for layout='THD'"):
        st.sage_attention(q[None], q[None], q[None], layout="NHD", cu_seqlens_q=cu_q)
    with pytest.raises(ValueError, match="cu_seqlens_k is required"):
        st.sage_attention(q, k, v, layout="THD", cu_seqlens_q=cu_q)
    with pytest.raises(ValueError, match=r"not supported by qat_attention"):
        st.qat_attention(q, k, v, layout="THD")
    with pytest.raises(ValueError, match=r"not supported by nvfp4_attention"):
        st.nvfp4_attention(q, k, v, layout="THD")
    bad = cu_q.clone()
    bad[-1] += 1  # device offsets are not read on the host: the kernels clamp them (sagecupy/_varlen.py)
    o = st.sage_attention(q, k, v, layout="THD", cu_seqlens_q=bad, cu_seqlens_k=cu_k)
    assert o.shape == q.shape
