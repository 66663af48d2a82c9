"""A small autograd shim: ops in the ``custom_vjp`` shape and a minimal tape that chains them.

An op is a pair of functions::

    forward(*inputs, **options) -> (out, residuals)
    backward(residuals, d_out)   -> tuple of gradients, one per input (None where there is none)

which is what ``jax.custom_vjp`` and ``torch.autograd.Function`` want, so the same pair wraps into
either. :class:`Variable` records the ops applied to it and :meth:`Variable.backward` runs the
backward functions in reverse topological order, summing gradients where a value is used twice.

Everything is array-namespace generic: NumPy arrays run on the CPU (the reference attention and the
SageBwd simulator, float64 — this is how CI tests the shim), CuPy arrays on the GPU (full-precision
attention through cuBLAS, or the INT8 SageBwd kernels).

    x = Variable(x_array)
    q = rms_norm(linear(x, wq), gq)          # QK-norm
    ...
    o = attention(q, k, v, causal=True, impl="sagebwd")
    loss = mse_loss(linear(o, wo), target)
    loss.backward()                           # .grad on every Variable created with requires_grad=True
"""
from __future__ import annotations

import math

__all__ = ["Variable", "apply", "linear", "rms_norm", "attention", "mse_loss", "cross_entropy", "split_heads",
           "merge_heads", "take", "cast", "fpa_forward", "fpa_backward", "Adam", "OPS"]


def _xp(x):
    try:
        import cupy

        return cupy.get_array_module(getattr(x, "bits", x))  # (a BF16Array's memory is its uint16 bits)
    except ImportError:
        import numpy

        return numpy


# --------------------------------------------------------------------------------------------------
# the tape
# --------------------------------------------------------------------------------------------------


class Variable:
    """An array with an optional gradient and the op that produced it."""

    def __init__(self, value, requires_grad=True, _parents=(), _backward=None, _residuals=None, name=None):
        self.value = value
        self.requires_grad = bool(requires_grad)
        self.grad = None
        self._parents = tuple(_parents)
        self._backward = _backward
        self._residuals = _residuals
        self.name = name

    @property
    def shape(self):
        return self.value.shape

    def __repr__(self):
        return f"Variable({self.name or ''} shape={tuple(self.shape)}, requires_grad={self.requires_grad})"

    def backward(self, d_out=None):
        """Backpropagate from this variable (a scalar unless ``d_out`` is given)."""
        xp = _xp(self.value)
        if d_out is None:
            if self.value.size != 1:
                raise ValueError(f"backward() without d_out needs a scalar, this variable has shape {self.shape}")
            d_out = xp.ones_like(self.value)
        order, seen = [], set()

        def visit(v):
            if id(v) in seen:
                return
            seen.add(id(v))
            for p in v._parents:
                visit(p)
            order.append(v)

        visit(self)
        grads = {id(self): d_out}
        for v in reversed(order):
            g = grads.pop(id(v), None)
            if g is None:
                continue
            if v.requires_grad and not v._parents:
                v.grad = g if v.grad is None else v.grad + g
            if v._backward is None:
                continue
            for p, gp in zip(v._parents, v._backward(v._residuals, g)):
                if gp is None or not p.requires_grad:
                    continue
                grads[id(p)] = gp if id(p) not in grads else grads[id(p)] + gp


def apply(op_forward, op_backward, *inputs, **options):
    """Run ``op_forward`` on the values of ``inputs`` (Variables or plain arrays) and record it on the tape."""
    vars_ = [x if isinstance(x, Variable) else Variable(x, requires_grad=False) for x in inputs]
    out, res = op_forward(*(v.value for v in vars_), **options)
    # A result needs a gradient iff an input does (for results, requires_grad means exactly that).
    return Variable(out, requires_grad=any(v.requires_grad for v in vars_), _parents=vars_,
                    _backward=op_backward, _residuals=res)


# --------------------------------------------------------------------------------------------------
# ops (each a forward/backward pair)
# --------------------------------------------------------------------------------------------------


def linear_forward(x, w, b=None):
    """``y = x @ w (+ b)``; x (..., din), w (din, dout)."""
    y = x @ w
    if b is not None:
        y = y + b
    return y, (x, w, b is not None)


def linear_backward(res, dy):
    x, w, has_b = res
    xp = _xp(dy)
    dx = dy @ w.T
    dw = xp.tensordot(x, dy, axes=(tuple(range(x.ndim - 1)), tuple(range(dy.ndim - 1))))
    db = dy.reshape(-1, dy.shape[-1]).sum(axis=0) if has_b else None
    return (dx, dw, db) if has_b else (dx, dw)


def rms_norm_forward(x, weight, eps=1e-6):
    """``y = x / rms(x) * weight`` over the last axis (QK-norm)."""
    xp = _xp(x)
    inv = 1.0 / xp.sqrt((x * x).mean(axis=-1, keepdims=True) + eps)
    xn = x * inv
    return xn * weight, (xn, inv, weight)


def rms_norm_backward(res, dy):
    xn, inv, weight = res
    gxn = dy * weight
    n = xn.shape[-1]
    dx = inv * (gxn - xn * (gxn * xn).sum(axis=-1, keepdims=True) / n)
    dw = (dy * xn).reshape(-1, n).sum(axis=0)
    return dx, dw


def mse_forward(pred, target):
    d = pred - target
    return (d * d).mean(), (d,)


def mse_backward(res, dl):
    (d,) = res
    return 2.0 * d / d.size * dl, None


def cross_entropy_forward(logits, labels):
    """Mean cross-entropy over all positions; logits (..., C), integer labels (...)."""
    xp = _xp(logits)
    m = logits.max(axis=-1, keepdims=True)
    z = logits - m
    lse = xp.log(xp.exp(z).sum(axis=-1, keepdims=True))
    logp = z - lse
    flat = logp.reshape(-1, logp.shape[-1])
    idx = labels.reshape(-1)
    loss = -flat[xp.arange(flat.shape[0]), idx].mean()
    return loss, (logp, labels)


def cross_entropy_backward(res, dl):
    logp, labels = res
    xp = _xp(logp)
    g = xp.exp(logp)
    flat = g.reshape(-1, g.shape[-1])
    flat[xp.arange(flat.shape[0]), labels.reshape(-1)] -= 1.0
    return g / flat.shape[0] * dl, None


def fpa_forward(q, k, v, *, causal=False, sm_scale=None, window=None, cu_seqlens_q=None, cu_seqlens_k=None):
    """Full-precision attention on any array library (cuBLAS through CuPy, BLAS through NumPy), HND,
    GQA, bottom-right causal, in the inputs' float dtype: the FPA baseline. Materializes the N x N
    scores (a baseline, not a kernel). ``window=(left, right)``: the sliding window of docs/algorithms.md §1.8.
    ``cu_seqlens_q/k``: packed sequences, q ``(total_q, Hq, D)``, k and v ``(total_k, Hkv, D)``, one call per
    sequence."""
    if cu_seqlens_q is not None or cu_seqlens_k is not None:
        return _fpa_packed_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, causal=causal, sm_scale=sm_scale,
                                   window=window)
    if window is None:
        left, right = (-1, 0) if causal else (-1, -1)
    else:
        from .reference.attention import resolve_window

        left, right = resolve_window(causal, window)
    xp = _xp(q)
    B, Hq, Nq, D = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    g = Hq // Hkv
    scale = 1.0 / math.sqrt(D) if sm_scale is None else sm_scale
    kk = xp.repeat(k, g, axis=1) if g > 1 else k
    vv = xp.repeat(v, g, axis=1) if g > 1 else v
    s = (q @ xp.swapaxes(kk, -1, -2)) * scale
    if (left, right) != (-1, -1):
        i = xp.arange(Nq)[:, None]
        j = xp.arange(Nk)[None, :]
        seen = xp.ones((Nq, Nk), dtype=bool)
        if right != -1:
            seen &= j <= i + (Nk - Nq) + right
        if left != -1:
            seen &= j >= i + (Nk - Nq) - left
        s = xp.where(seen, s, -xp.inf)
    m = s.max(axis=-1, keepdims=True)
    m = xp.where(xp.isfinite(m), m, 0.0)
    p = xp.exp(s - m)
    denom = p.sum(axis=-1, keepdims=True)
    p = p / xp.where(denom > 0, denom, 1.0)
    o = p @ vv
    return o, (q, kk, vv, p, o, scale, g)


def _host_offsets(cu):
    """Packed offsets as host ints (a device array is read back: the FPA baseline loops over the sequences)."""
    import numpy

    return numpy.asarray(cu.get() if hasattr(cu, "get") else cu).astype(numpy.int64)


def _fpa_packed_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, **kw):
    """:func:`fpa_forward` over packed sequences ((total, H, D) arrays, docs/algorithms.md §1.8): each sequence as a
    batch-1 HND call; a sequence without queries or keys gives O = 0."""
    xp = _xp(q)
    cq, ck = _host_offsets(cu_seqlens_q), _host_offsets(cu_seqlens_k)
    if cq.ndim != 1 or cq.shape != ck.shape or cq.size < 2:
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must be 1-D with the same S + 1 >= 2 offsets, got shapes "
                         f"{cq.shape} and {ck.shape}")
    o = xp.zeros(q.shape, dtype=q.dtype)
    seqs = []
    for s in range(cq.size - 1):
        (q0, q1), (k0, k1) = (int(cq[s]), int(cq[s + 1])), (int(ck[s]), int(ck[s + 1]))
        r = None
        if q1 > q0 and k1 > k0:
            hnd = [xp.swapaxes(x[a:b], 0, 1)[None] for x, a, b in ((q, q0, q1), (k, k0, k1), (v, k0, k1))]
            o_s, r = fpa_forward(*hnd, **kw)
            o[q0:q1] = xp.swapaxes(o_s[0], 0, 1)
        seqs.append((q0, q1, k0, k1, r))
    return o, ("packed", seqs, q.shape, k.shape)


def fpa_backward(res, do):
    if isinstance(res[0], str) and res[0] == "packed":  # _fpa_packed_forward's
        _, seqs, q_shape, k_shape = res
        xp = _xp(do)
        dq, dk, dv = (xp.zeros(shape, dtype=do.dtype) for shape in (q_shape, k_shape, k_shape))
        for q0, q1, k0, k1, r in seqs:
            if r is not None:
                g = fpa_backward(r, xp.swapaxes(do[q0:q1], 0, 1)[None])
                for out, grad, a, b in zip((dq, dk, dv), g, (q0, k0, k0), (q1, k1, k1)):
                    out[a:b] = xp.swapaxes(grad[0], 0, 1)
        return dq, dk, dv
    q, kk, vv, p, o, scale, g = res
    xp = _xp(do)
    dv = xp.swapaxes(p, -1, -2) @ do
    dp = do @ xp.swapaxes(vv, -1, -2)
    delta = (do * o).sum(axis=-1, keepdims=True)
    ds = p * (dp - delta)
    dq = (ds @ kk) * scale
    dk = (xp.swapaxes(ds, -1, -2) @ q) * scale
    if g > 1:
        B, H, N, D = dk.shape
        dk = dk.reshape(B, H // g, g, N, D).sum(axis=2)
        dv = dv.reshape(B, H // g, g, N, D).sum(axis=2)
    return dq, dk, dv


def _attention_forward(q, k, v, *, impl="fpa", causal=False, sm_scale=None, config=None, window=None, layout="HND",
                       **packed):
    if impl == "fpa":
        if layout == "THD":
            out, res = fpa_forward(q, k, v, causal=causal, sm_scale=sm_scale, window=window,
                                   cu_seqlens_q=packed.get("cu_seqlens_q"), cu_seqlens_k=packed.get("cu_seqlens_k"))
        elif layout != "HND" or any(x is not None for x in packed.values()):
            raise ValueError(f"impl='fpa' takes layout='HND' or 'THD' (with cu_seqlens_q/k), got layout={layout!r}")
        else:
            out, res = fpa_forward(q, k, v, causal=causal, sm_scale=sm_scale, window=window)
        return out, ("fpa", res)
    if impl == "sagebwd":
        xp = _xp(q)
        if xp.__name__ == "numpy":  # the float64 simulator: the same function the GPU kernels compute
            from .reference import sagebwd as ref

            o, res = ref.forward(q, k, v, causal=causal, sm_scale=sm_scale, config=config or "default",
                                 window=window, layout=layout, **packed)
            return o, ("sagebwd-ref", res)
        from . import int8

        o, res = int8.forward(q, k, v, causal=causal, sm_scale=sm_scale, config=config, window=window, layout=layout,
                              **packed)
        return o, ("sagebwd-gpu", res)
    raise ValueError(f"impl={impl!r} is not supported; supported: 'fpa', 'sagebwd'")


def _attention_backward(res, do):
    kind, r = res
    if kind == "fpa":
        return fpa_backward(r, do)
    if kind == "sagebwd-ref":
        from .reference import sagebwd as ref

        return ref.backward(r, do)
    from . import int8

    return int8.backward(r, do)


def linear(x, w, b=None):
    return apply(linear_forward, linear_backward, x, w, *(() if b is None else (b,)))


def rms_norm(x, weight, eps=1e-6):
    return apply(rms_norm_forward, rms_norm_backward, x, weight, eps=eps)


def attention(q, k, v, *, impl="fpa", causal=False, sm_scale=None, config=None, window=None, layout="HND",
              cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None):
    """Attention on the tape, HND layout. ``impl``: ``"fpa"`` (full precision, any array library) or
    ``"sagebwd"`` (INT8 SageBwd: the GPU kernels for CuPy arrays, the float64 simulator for NumPy).
    ``window=(left, right)``: a sliding window (docs/algorithms.md §1.8; ``causal=True`` is ``(-1, 0)``).
    ``layout="THD"`` with ``cu_seqlens_q/k`` (and optionally ``max_seqlen_q/k``): packed variable-length sequences,
    q ``(total_q, Hq, D)``, k and v ``(total_k, Hkv, D)``, as :func:`sagecupy.int8.forward` takes them."""
    packed = {name: value for name, value in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k),
                                              ("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k))
              if value is not None}
    return apply(_attention_forward, _attention_backward, q, k, v, impl=impl, causal=causal, sm_scale=sm_scale,
                 config=config, window=window, layout=layout, **packed)


def split_heads(x, heads):
    """(B, N, H*D) -> (B, H, N, D)."""
    def fwd(a):
        B, N, C = a.shape
        return a.reshape(B, N, heads, C // heads).transpose(0, 2, 1, 3), a.shape

    def bwd(shape, g):
        return (g.transpose(0, 2, 1, 3).reshape(shape),)

    return apply(fwd, bwd, x)


def merge_heads(x):
    """(B, H, N, D) -> (B, N, H*D)."""
    def fwd(a):
        B, H, N, D = a.shape
        return a.transpose(0, 2, 1, 3).reshape(B, N, H * D), a.shape

    def bwd(shape, g):
        B, H, N, D = shape
        return (g.reshape(B, N, H, D).transpose(0, 2, 1, 3),)

    return apply(fwd, bwd, x)


def cast(x, dtype):
    """``x`` as ``dtype`` (e.g. float16 into the INT8 kernels); the gradient is cast back. ``"bfloat16"`` (device
    arrays): a CuPy bfloat16 array where CuPy has that dtype, else a BF16Array, rounded to nearest even; a bf16
    value (either form) is widened exactly before any other cast."""
    from .adapters import bf16

    def fwd(a):
        src = a if bf16.is_bf16(a) else None  # (a bf16 source's gradient goes back in its form)
        if dtype == "bfloat16":
            return bf16.from_float(a), (a.dtype, src)
        return (bf16.to_float32(a) if src is not None else a).astype(dtype), (a.dtype, src)

    def bwd(saved, g):
        src_dtype, src = saved
        g = bf16.to_float32(g) if bf16.is_bf16(g) else g
        return (bf16.from_float(g, like=src) if src is not None else g.astype(src_dtype),)

    return apply(fwd, bwd, x)


def take(x, index, axis):
    """``x`` at one position along ``axis`` (that axis removed)."""
    def fwd(a):
        return a.take(index, axis=axis), a.shape

    def bwd(shape, g):
        xp = _xp(g)
        out = xp.zeros(shape, dtype=g.dtype)
        sl = [slice(None)] * len(shape)
        sl[axis] = index
        out[tuple(sl)] = g
        return (out,)

    return apply(fwd, bwd, x)


def mse_loss(pred, target):
    return apply(mse_forward, mse_backward, pred, target)


def cross_entropy(logits, labels):
    return apply(cross_entropy_forward, cross_entropy_backward, logits, labels)


class Adam:
    """Adam on Variables (in place on ``.value``; the gradients are cleared after each step)."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8):
        self.params, self.lr, self.b1, self.b2, self.eps = list(params), lr, betas[0], betas[1], eps
        self.m = [None] * len(self.params)
        self.v = [None] * len(self.params)
        self.t = 0

    def step(self):
        self.t += 1
        for i, p in enumerate(self.params):
            if p.grad is None:
                continue
            g = p.grad
            self.m[i] = (1 - self.b1) * g if self.m[i] is None else self.b1 * self.m[i] + (1 - self.b1) * g
            self.v[i] = (1 - self.b2) * g * g if self.v[i] is None else self.b2 * self.v[i] + (1 - self.b2) * g * g
            mh = self.m[i] / (1 - self.b1 ** self.t)
            vh = self.v[i] / (1 - self.b2 ** self.t)
            p.value = p.value - self.lr * mh / (_xp(g).sqrt(vh) + self.eps)
            p.grad = None


#: name -> (forward, backward) for wrapping into other frameworks.
OPS = {
    "linear": (linear_forward, linear_backward),
    "rms_norm": (rms_norm_forward, rms_norm_backward),
    "attention": (_attention_forward, _attention_backward),
    "mse": (mse_forward, mse_backward),
    "cross_entropy": (cross_entropy_forward, cross_entropy_backward),
}
