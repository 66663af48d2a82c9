"""PyTorch adapter: sagecupy attention as differentiable PyTorch ops (optional; PyTorch is not a dependency).

``import sagecupy`` never imports PyTorch; ``import sagecupy.torch`` does (it needs PyTorch >= 2.4, for
``torch.library.custom_op``).

    import torch
    from sagecupy.torch import sage_attention

    q = torch.randn(2, 16, 4096, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(2, 4, 4096, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(2, 4, 4096, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    o = sage_attention(q, k, v, causal=True)          # INT8 SageBwd forward, a torch tensor
    o.sum().backward()                                 # INT8 SageBwd backward: q.grad, k.grad, v.grad
    o = sage_attention(q, k, v, window=(1024, 0))      # sliding window: row i sees keys i - 1024 .. i
    o = sage_attention(q_packed, k_packed, v_packed, layout="THD", cu_seqlens_q=cu, cu_seqlens_k=cu,
                       max_seqlen_q=4096, max_seqlen_k=4096, causal=True)   # packed documents, causal per document
    torch.compile(model, fullgraph=True)               # no graph break at the op

    from sagecupy.torch import scaled_dot_product_attention          # torch.nn.functional's, as a drop-in
    o = scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)   # the INT8 kernels run here

Arguments and conventions are those of :func:`sagecupy.int8.forward` (layouts ``"HND"``/``"NHD"``, GQA,
bottom-right causal, ``sm_scale=None`` meaning ``1/sqrt(D)``, fp16 or bf16, D 64 or 128; for INT8 the sliding
``window=(left, right)`` and packed variable-length sequences, ``layout="THD"`` with ``cu_seqlens_q/k``, as
FlashAttention's varlen API takes them).

**Tensors.** Inputs travel to CuPy zero-copy, strides included (the kernels take any strides with a contiguous last
dimension and copy other inputs themselves): a CuPy array over the tensor's memory that holds the tensor. bf16 tensors
travel as their int16 bits and become a CuPy ``ml_dtypes.bfloat16`` view of them where CuPy has that dtype, else a
:class:`~sagecupy.adapters.bf16.BF16Array`. Outputs come back as DLPack capsules (bf16 as int16 bits, DLPack's
bfloat16 code not being read by every CuPy) asked for without a stream, since both sides are on the stream below.
:func:`to_cupy` and :func:`from_cupy` exchange the same way through DLPack with its stream handshake, for code on
other streams.

**Streams.** Every kernel runs on PyTorch's *current stream* of the inputs' device (:func:`on_torch_stream`
makes it CuPy's current stream for the duration of the call). The kernels are therefore ordered after
whatever produced the inputs on that stream and before whatever consumes the outputs on it, exactly like
a native PyTorch op: no host synchronization and no device-wide synchronization happen, and none is
needed. In the backward, PyTorch's autograd engine makes the stream of the forward call current, so the
backward kernels run there too.

**Memory.** Outputs (and the saved residuals) are allocated by CuPy's memory pool, on the stream above,
and handed to PyTorch through DLPack: the PyTorch tensor keeps the CuPy allocation alive and frees it
when it is itself freed. Two consequences: (1) CuPy's pool and PyTorch's caching allocator are separate
pools (``torch.cuda.memory_allocated`` does not count sagecupy's buffers; ``cupy.get_default_memory_pool()``
does); (2) CuPy reuses a freed block only for later allocations on the *same* stream, so the ordering is
safe as long as the output is used on that stream. An output used on another stream must be kept alive
(or that stream synchronized back) until the other stream is done with it: ``Tensor.record_stream`` only
protects memory that PyTorch's allocator owns. The ops cannot be captured in a CUDA graph (CuPy allocates during
the call); they carry PyTorch's ``cudagraph_unsafe`` tag, so ``torch.compile(mode="reduce-overhead")`` with
``torch._inductor.config.graph_partition = True`` captures the rest of a model and runs them between its graphs.

**Two ways in, per family.**

* INT8 SageBwd: :func:`sage_attention` runs, eagerly on plain tensors, ``torch_ops.SageEagerFunction`` (end of
  this item), and otherwise the ``torch.library`` custom ops
  ``sagecupy::sage_attention_fwd`` / ``sagecupy::sage_attention_bwd`` (:mod:`sagecupy.adapters.torch_ops`, with
  the window as two trailing ints, ``(-1, -1)`` for none, then packed sequences' offsets and maxima). The forward
  op returns the output and the residual *tensors* of :class:`sagecupy.int8.Residuals` (the INT8 codes of Q and K,
  their scales, the base-2 LSE, the table of sequence offsets of a packed call); the backward op rebuilds the
  ``Residuals`` from them (and a packed call's offsets) and runs the same backward
  kernels on the same buffers, so the gradients are those of ``int8.forward``/``int8.backward`` called
  directly, bit for bit. The residuals are saved with ``save_for_backward``: freed after the backward,
  and an in-place change of ``v`` or ``o`` before it is an error, as for any PyTorch op. A call that needs
  no gradient (under ``torch.no_grad()`` / ``torch.inference_mode()``, or with no input requiring grad) runs
  ``sagecupy::sage_attention_infer`` instead: :func:`sagecupy.int8.sage_attention`, which keeps no residuals
  and writes less (its output is bitwise the forward op's). Under ``torch.compile``, tracing, a torch-function or
  dispatch mode (``torch.device`` contexts aside), on tensor subclasses, or with saved-tensor hooks active
  (activation checkpointing, ``save_on_cpu``, which see only saved tensors) the ops go through PyTorch's dispatcher;
  any other eager call runs ``torch_ops.SageEagerFunction``, the same forward and backward with the ``Residuals``
  kept on ``ctx`` as CuPy arrays (``v`` and ``o`` saved for the in-place check, the residuals dropped after a
  backward without ``retain_graph``), since the dispatcher's custom-op layer and the residuals' round trip through
  PyTorch took more host time than the CuPy call itself. :class:`SageAttentionFunction` is the plain
  ``torch.autograd.Function`` alternative with positional arguments (eager only), which keeps the residuals the
  same way (out of saved-tensor hooks' reach).
* FP4 QAT (:mod:`sagecupy.qat`, imported when first used): :func:`qat_attention` runs
  :class:`QATAttentionFunction` in eager mode (opaque residuals on ``ctx``, no extra work) and, under
  ``torch.compile`` or with saved-tensor hooks active, the custom ops ``sagecupy::qat_attention_fwd`` /
  ``sagecupy::qat_attention_bwd``, whose backward recomputes the residuals from ``q, k, v`` (the forward is a
  deterministic function of its inputs, so they are the same residuals) because an opaque Python object cannot
  cross a custom-op boundary.
* NVFP4 (:mod:`sagecupy.nvfp4`, inference only): :func:`nvfp4_attention` runs the custom op
  ``sagecupy::nvfp4_attention``; a call that needs a gradient is refused.

``return_lse=True`` makes each entry point also return the natural-log LSE, float32 ``(B, Hq, Nq)`` (packed
sequences: ``(Hq, total_q)``); it carries no gradient (PyTorch treats it as a non-differentiable output).

**Packed sequences** (INT8): ``sage_attention(q, k, v, layout="THD", cu_seqlens_q=..., cu_seqlens_k=...,
max_seqlen_q=None, max_seqlen_k=None)`` with q ``(total_q, Hq, D)``, k, v ``(total_k, Hkv, D)`` and the offsets as
int32 CUDA tensors of ``S + 1`` prefix sums (no gradient), on the inputs' GPU; ``max_seqlen_q/k`` host ints or None,
as FlashAttention takes them (the kernels do not need them). Causal masks, windows and every quantization statistic
are per sequence. The offsets' values are not read on the host (that would synchronize): :func:`sagecupy.int8.forward`
documents what the kernels make of offsets outside the contract. ``qat_attention`` and ``nvfp4_attention`` take
the dense layouts only.

**Drop-in.** :func:`scaled_dot_product_attention` has ``torch.nn.functional.scaled_dot_product_attention``'s
signature and semantics; it runs a family's kernels on the calls they compute exactly as PyTorch defines them and
PyTorch's SDPA on the others, counting each such fallback by reason (:func:`fallback_counts`) and warning once per
reason. :func:`register_hf` makes it an ``attn_implementation`` of Hugging Face transformers.
"""
import inspect
import numbers

import torch
import torch.utils._python_dispatch

from .. import _checks
from ..config import NVFP4Config, QATConfig, get_config
from . import dropin, torch_ops
from .dropin import SageFallbackWarning
# importing torch_ops registers the custom ops
from .torch_ops import (_DTYPES, _as_cupy, _as_torch, _check_inputs, _encode_config, _family, _require_cuda_tensor,
                        backward_from_ctx, from_cupy, on_torch_stream, to_cupy)
from .torch_cp import BlockBackend, context_parallel_attention, shard_sequence, unshard_sequence

__all__ = ["sage_attention", "qat_attention", "nvfp4_attention", "scaled_dot_product_attention", "register_hf",
           "fallback_counts", "reset_fallback_counts", "SageFallbackWarning", "SageAttentionFunction",
           "QATAttentionFunction", "to_cupy", "from_cupy", "on_torch_stream", "context_parallel_attention",
           "shard_sequence", "unshard_sequence", "BlockBackend"]

_LAYOUTS = ("HND", "NHD")
_PACKED = "THD"
_PACKED_ARGS = ("cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k")


def _check_options(causal, layout, who=None):
    """``who``: the entry point's name where it takes the dense layouts only (packed sequences are INT8's)."""
    _checks.check_causal(causal)
    if who is not None and isinstance(layout, str) and layout == _PACKED:
        raise ValueError(f"layout='THD' (packed variable-length sequences) is not supported by {who}: only "
                         f"sage_attention (INT8) takes packed sequences; {who} takes {_LAYOUTS}")
    if layout not in _LAYOUTS + (() if who else (_PACKED,)):
        raise ValueError(f"layout={layout!r} is not supported; supported: {_LAYOUTS + (() if who else (_PACKED,))}")


def _max_seqlen(value, name):
    """A FlashAttention-style ``max_seqlen``: None (-1 for the ops) or a non-negative host int (one that dynamo made
    symbolic stays symbolic: the sign is a guard, and only the error message reads the value)."""
    if value is None:
        return -1
    if not isinstance(value, torch.SymInt) and (_checks.is_bool(value)
                                                or not isinstance(value, numbers.Integral)):
        raise ValueError(f"{name}={value!r} must be a non-negative integer (a host int, as FlashAttention takes it) "
                         f"or None")
    if value < 0:
        raise ValueError(f"{name}={int(value)} must be a non-negative integer or None")
    return value if isinstance(value, torch.SymInt) else int(value)


def _packed_args(q, k, v, layout, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k):
    """The INT8 ops' trailing packed-sequence arguments ``(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)``,
    or ``()`` for a dense layout (which is refused any of them, naming it). The offsets must be 1-D int32 CUDA tensors
    of ``S + 1 >= 2`` entries, one length for both, on q's GPU, and q, k, v 3-D; TypeError/ValueError naming the
    argument. Metadata only (the values are on the GPU): torch.compile traces it without a graph break."""
    values = (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    if not (isinstance(layout, str) and layout == _PACKED):
        for name, value in zip(_PACKED_ARGS, values):
            if value is not None:
                raise ValueError(f"{name} is only for layout='THD' (packed sequences), got layout={layout!r}")
        return ()
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 3:
            raise ValueError(f"{name} must be 3-D (total, H, D) for layout='THD', got shape {tuple(t.shape)}")
    for name, t in zip(_PACKED_ARGS[:2], values[:2]):
        if t is None:
            raise ValueError(f"{name} is required with layout='THD' (int32 prefix sums of the sequence lengths, "
                             f"S + 1 offsets, a CUDA tensor)")
        _require_cuda_tensor(t, name)
        if t.dtype != torch.int32:
            raise TypeError(f"{name}.dtype={t.dtype} must be torch.int32 (the offsets are read on the GPU as they "
                            f"are)")
        if t.dim() != 1:
            raise ValueError(f"{name} must be 1-D (S + 1 offsets), got shape {tuple(t.shape)}")
        if t.shape[0] < 2:
            raise ValueError(f"{name} must hold S + 1 >= 2 offsets, got {t.shape[0]}")
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device} and q on {q.device}; the offsets must be on the inputs' GPU")
    if cu_seqlens_q.shape[0] != cu_seqlens_k.shape[0]:
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must have the same length (S + 1), got "
                         f"{cu_seqlens_q.shape[0]} and {cu_seqlens_k.shape[0]}")
    return (cu_seqlens_q, cu_seqlens_k, _max_seqlen(max_seqlen_q, "max_seqlen_q"),
            _max_seqlen(max_seqlen_k, "max_seqlen_k"))


# --------------------------------------------------------------------------------------------------
# plain autograd.Functions (eager): the residuals object stays on ctx until the backward
# --------------------------------------------------------------------------------------------------


def _function_forward(ctx, family, q, k, v, causal, sm_scale, layout, config, return_lse=False, window=None,
                      packed=None):
    device = _check_inputs(("q", q), ("k", k), ("v", v))
    mod = _family(family)
    # only the INT8 family takes a window and packed sequences (QATAttentionFunction never passes them)
    extra = {} if window is None else {"window": window}
    with on_torch_stream(device):
        for name, value in (packed or {}).items():  # the offsets as CuPy views; int8.forward validates them all
            extra[name] = _as_cupy(value, name) if name.startswith("cu_") and value is not None else value
        # The kernels write the LSE either way: asking for it costs nothing.
        o, lse, res = mod.forward(_as_cupy(q, "q"), _as_cupy(k, "k"), _as_cupy(v, "v"), causal=causal,
                                  sm_scale=sm_scale, layout=layout, config=config, return_lse=True, **extra)
        o, lse = _as_torch(o), _as_torch(lse)
    ctx.family, ctx.device, ctx.res = family, device, res
    # Not needed by the backward (the residuals hold what it needs): saved so that autograd's version
    # counters report an in-place change of v or o before the backward instead of wrong gradients.
    ctx.save_for_backward(v, o)
    if not return_lse:
        return o
    ctx.mark_non_differentiable(lse)  # the backward kernels take dO only
    return o, lse


def _function_backward(ctx, do, *_lse_grad):
    ctx.saved_tensors  # noqa: B018 -- raises if v or o was modified in place since the forward
    # one None per input but q, k, v; autograd accepts the trailing Nones of inputs that were not passed
    return backward_from_ctx(ctx, _family(ctx.family), do) + (None,) * 10


class SageAttentionFunction(torch.autograd.Function):
    """INT8 SageBwd attention as a ``torch.autograd.Function``:
    ``SageAttentionFunction.apply(q, k, v, causal, sm_scale, layout, config)`` (positional; an eighth argument
    ``return_lse=True`` returns ``(o, lse)``, the LSE without gradient; a ninth is the ``window`` of
    :func:`sage_attention`; the tenth to thirteenth are ``cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k``
    for ``layout="THD"``, validated by :func:`sagecupy.int8.forward`).

    Eager only (torch.compile cannot trace into CuPy; use :func:`sage_attention`, whose custom ops it traces, and
    which gives the same results bit for bit). The :class:`sagecupy.int8.Residuals` object stays on ``ctx`` until
    the backward, and after it if that ran with ``retain_graph=True``, as long as the autograd graph lives. Being no
    saved tensor, it is out of reach of saved-tensor hooks (activation checkpointing, ``save_on_cpu``), which
    :func:`sage_attention` leaves to the custom ops."""

    @staticmethod
    def forward(ctx, q, k, v, causal=False, sm_scale=None, layout="HND", config=None, return_lse=False, window=None,
                cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None):
        values = (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
        packed = {n: x for n, x in zip(_PACKED_ARGS, values)} if any(x is not None for x in values) else None
        return _function_forward(ctx, "int8", q, k, v, causal, sm_scale, layout, config, return_lse, window, packed)

    @staticmethod
    def backward(ctx, do, *lse_grad):
        return _function_backward(ctx, do, *lse_grad)


class QATAttentionFunction(torch.autograd.Function):
    """FP4 QAT attention (:mod:`sagecupy.qat`) as a ``torch.autograd.Function``:
    ``QATAttentionFunction.apply(q, k, v, causal, sm_scale, layout, config)`` (positional; ``config`` a
    :class:`~sagecupy.config.QATConfig` or None; ``return_lse`` as :class:`SageAttentionFunction`). Eager only;
    :func:`qat_attention` uses it in eager mode."""

    @staticmethod
    def forward(ctx, q, k, v, causal=False, sm_scale=None, layout="HND", config=None, return_lse=False):
        return _function_forward(ctx, "qat", q, k, v, causal, sm_scale, layout, config, return_lse)

    @staticmethod
    def backward(ctx, do, *lse_grad):
        return _function_backward(ctx, do, *lse_grad)


# --------------------------------------------------------------------------------------------------
# public entry points
# --------------------------------------------------------------------------------------------------


def _compiling():
    return torch.compiler.is_compiling()


def _config_arg(config):
    """``config`` as the INT8 ops' string argument: ``""`` for None and a preset's name as it is (checked to name
    one), which the family resolves as the CuPy call does; a config object encoded field by field. Only objects are
    encoded: that costs host time on every call, which a name does not need."""
    if config is None:
        return ""
    get_config(config)  # names config: ValueError for an unknown name, TypeError for what is not a SageBwdConfig
    return config if isinstance(config, str) else _encode_config(config)


def _needs_grad(*tensors):
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def _window_ints(window, causal):
    """``window`` as the INT8 ops' last two arguments: ``(-1, -1)`` for None (no window: ``causal`` alone decides),
    else the ``(left, right)`` that :func:`sagecupy.int8.forward` takes, validated as it validates it (ValueError
    naming ``window``, and ``causal`` where they contradict). The ops read ``(-1, -1)`` as no window, so
    ``window=(-1, -1)`` with ``causal=True``, which the CuPy API refuses, has to be refused here, before them.
    Metadata and Python ints only: torch.compile traces it (an int that dynamo made symbolic stays symbolic)."""
    if window is None:
        return -1, -1
    return _checks.check_window(window, causal)


def _sage_attention_op(q, k, v, causal, sm_scale, layout, config, return_lse=False, window=(-1, -1), packed=()):
    """The custom ops (what :func:`sage_attention` runs), after argument checks (``window``: the two ints of
    :func:`_window_ints`; ``packed``: :func:`_packed_args`'s, ``()`` for the dense layouts, which then call the ops
    with the arguments they always took): through PyTorch's dispatcher, or their bodies directly where
    :func:`_dispatcher_free` allows. A call that needs no gradient (grad mode off, or no input requires grad) runs
    the inference op, which keeps no residuals."""
    args = (q, k, v, bool(causal), _checks.scale_arg(sm_scale), layout, _config_arg(config), *window, *packed)
    eager = _dispatcher_free(q, k, v, *packed[:2])
    if not _needs_grad(q, k, v):
        # (eager: q, k, v were checked by the caller, sage_attention)
        o, lse = torch_ops.sage_infer_on(q.device, *args) if eager else torch.ops.sagecupy.sage_attention_infer(*args)
    else:
        # (saved-tensor hooks see only what save_for_backward saves: the ops' residual tensors, not a ctx attribute)
        eager = eager and not _saved_tensor_hooks()
        fwd = torch_ops.SageEagerFunction.apply if eager else torch.ops.sagecupy.sage_attention_fwd
        o, lse, *_residuals = fwd(*args)
    return (o, lse) if return_lse else o


_dispatch_mode = getattr(torch.utils._python_dispatch, "_get_current_dispatch_mode", None)
_function_mode = getattr(torch._C, "_is_torch_function_mode_enabled", None)
_function_modes = getattr(torch.overrides, "_get_current_function_mode_stack", None)
_functorch_wrapped = getattr(getattr(torch._C, "_functorch", None), "is_functorch_wrapped_tensor", None)
_default_hooks = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
try:
    from torch.utils._device import DeviceContext as _device_mode  # (the mode a torch.device context pushes)
except ImportError:
    _device_mode = None


def _saved_tensor_hooks():
    """Whether saved-tensor hooks are active (``torch.utils.checkpoint`` without reentrance,
    ``torch.autograd.graph.save_on_cpu``, user hooks), or this PyTorch cannot say. They pack and unpack what
    ``save_for_backward`` saves; residuals kept on ``ctx`` would stay on the GPU past them (and a checkpoint's
    recomputation would be wasted), so such calls take the ops, which save the residuals as tensors."""
    return _default_hooks is None or _default_hooks(False) is not None


def _only_device_modes():
    """Whether the active torch-function modes are only ``torch.device`` contexts (``with torch.device("cuda")``,
    ``torch.set_default_device``), which change where factory functions allocate and nothing the ops compute."""
    if _function_modes is None or _device_mode is None:
        return False
    return all(isinstance(m, _device_mode) for m in _function_modes())


def _dispatcher_free(*tensors):
    """Whether an INT8 call may run the custom ops' Python bodies directly (:class:`torch_ops.SageEagerFunction`):
    eagerly (not compiling, not tracing), with no torch-function mode but ``torch.device`` contexts and no dispatch
    mode active (a mode must see the ops), on plain tensors (no subclass such as a FakeTensor, no functorch wrapper).
    Anything else, or a PyTorch without the private functions this reads, goes through the ops."""
    if None in (_dispatch_mode, _function_mode, _functorch_wrapped):
        return False
    if torch.compiler.is_compiling() or torch.jit.is_tracing() or _dispatch_mode() is not None:
        return False
    if _function_mode() and not _only_device_modes():
        return False
    return all(t is None or (type(t) is torch.Tensor and not _functorch_wrapped(t)) for t in tensors)


def sage_attention(q, k, v, *, causal=False, sm_scale=None, layout="HND", config=None, return_lse=False,
                   window=None, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None):
    """INT8 SageBwd attention on PyTorch tensors, differentiable and ``torch.compile``-able.

    q: ``(B, Hq, Nq, D)`` (``layout="HND"``) or ``(B, Nq, Hq, D)`` (``"NHD"``); k, v: the same with Hkv,
    Nk (``Hq % Hkv == 0``). CUDA tensors, fp16 or bf16 (one dtype), D 64 or 128, any strides. ``causal``
    is bottom-right aligned (query row ``i`` sees key ``j`` iff ``j <= i + Nk - Nq``)::

        Nq=3, Nk=5      keys ->  0 1 2 3 4
                  row 0          x x x . .
                  row 1          x x x x .
                  row 2          x x x x x

    ``window=(left, right)``: a sliding window (docs/algorithms.md §1.8), as :func:`sagecupy.int8.forward` takes it:
    row ``i`` sees key ``j`` iff ``i + Nk - Nq - left <= j <= i + Nk - Nq + right``, ``-1`` leaving a side unbounded;
    ``causal=True`` is ``(-1, 0)`` and allows only windows with ``right == 0``. None: ``causal`` alone decides.

    ``config``: ``"default"`` (None), ``"paper"`` or a :class:`~sagecupy.config.SageBwdConfig`. Returns
    ``o`` with q's shape and dtype (contiguous); ``o.backward`` gives the INT8 SageBwd gradients, equal
    bit for bit to :func:`sagecupy.int8.backward` after :func:`sagecupy.int8.forward` on the same inputs
    (the backward kernels use no atomics). ``return_lse=True``: ``(o, lse)``, ``lse`` float32 ``(B, Hq, Nq)``,
    natural log, without gradient. Runs on PyTorch's current stream (module docstring).

    Packed variable-length sequences (FlashAttention's varlen convention): ``layout="THD"``, q ``(total_q, Hq, D)``,
    k, v ``(total_k, Hkv, D)``; sequence ``s`` is rows ``cu_seqlens_q[s]:cu_seqlens_q[s+1]`` of q and
    ``cu_seqlens_k[s]:cu_seqlens_k[s+1]`` of k and v. ``cu_seqlens_q/k``: 1-D int32 CUDA tensors of the ``S + 1``
    prefix sums of the lengths (one length for both; empty sequences allowed), on the inputs' GPU, never read on the
    host; ``max_seqlen_q/k``: host ints or None (accepted as FlashAttention takes them; the kernels do not need them).
    ``causal`` and ``window`` apply within each sequence (bottom-right aligned per sequence), and each sequence's
    quantization statistics are its own: o, the LSE ``(Hq, total_q)`` and the gradients equal the separate calls on
    the sequences, bit for bit. The other layouts take none of these four arguments (ValueError naming it).
    """
    _check_inputs(("q", q), ("k", k), ("v", v))
    _check_options(causal, layout)
    packed = _packed_args(q, k, v, layout, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    return _sage_attention_op(q, k, v, causal, sm_scale, layout, config, return_lse, _window_ints(window, causal),
                              packed)


def _qat_attention_op(q, k, v, causal, sm_scale, layout, config, return_lse=False):
    """The custom-op path of :func:`qat_attention` (what it runs under torch.compile)."""
    if config is not None and not isinstance(config, QATConfig):
        raise TypeError(f"config must be a QATConfig or None, got {type(config).__name__}")
    o, lse = torch.ops.sagecupy.qat_attention_fwd(q, k, v, bool(causal), _checks.scale_arg(sm_scale), layout,
                                                  _encode_config(config))
    return (o, lse) if return_lse else o


def qat_attention(q, k, v, *, causal=False, sm_scale=None, layout="HND", config=None, return_lse=False):
    """FP4 quantization-aware attention (:mod:`sagecupy.qat`) on PyTorch tensors, differentiable and
    ``torch.compile``-able. Arguments as :func:`sage_attention`; ``config`` a
    :class:`~sagecupy.config.QATConfig` or None. Raises ImportError when this installation has no
    :mod:`sagecupy.qat` kernels.

    Eager calls run :class:`QATAttentionFunction` (the residuals object stays on the autograd ctx);
    under ``torch.compile``, and where saved-tensor hooks are active (activation checkpointing, ``save_on_cpu``),
    the custom ops run, whose backward recomputes the residuals from q, k, v, the only tensors they save.
    Both give the gradients of ``qat.forward``/``qat.backward`` called directly."""
    _check_inputs(("q", q), ("k", k), ("v", v))
    _check_options(causal, layout, "qat_attention")
    if _compiling() or (_needs_grad(q, k, v) and _saved_tensor_hooks()):
        return _qat_attention_op(q, k, v, causal, sm_scale, layout, config, return_lse)
    return QATAttentionFunction.apply(q, k, v, bool(causal), sm_scale, layout, config, bool(return_lse))


def _nvfp4_attention_op(q, k, v, causal, sm_scale, layout, config):
    if config is not None and not isinstance(config, NVFP4Config):
        raise TypeError(f"config must be an NVFP4Config or None, got {type(config).__name__}")
    return torch.ops.sagecupy.nvfp4_attention(q, k, v, bool(causal), _checks.scale_arg(sm_scale), layout,
                                              _encode_config(config))


def nvfp4_attention(q, k, v, *, causal=False, sm_scale=None, layout="HND", config=None, return_lse=False):
    """NVFP4 attention (:func:`sagecupy.nvfp4.attention`) on PyTorch tensors: inference only,
    ``torch.compile``-able. Arguments as :func:`sage_attention`; ``config`` an
    :class:`~sagecupy.config.NVFP4Config` or None.

    NVFP4 has no backward: a call that needs a gradient (grad mode on and an input requiring grad) raises
    ValueError; run it under ``torch.no_grad()`` / ``torch.inference_mode()``. Returns ``o`` (q's shape and dtype,
    contiguous), or ``(o, lse)`` with ``return_lse``."""
    _check_inputs(("q", q), ("k", k), ("v", v))
    _check_options(causal, layout, "nvfp4_attention")
    if _needs_grad(q, k, v):
        raise ValueError("nvfp4_attention is inference-only (NVFP4 has no backward) and this call needs a gradient: "
                         "run it under torch.no_grad() or torch.inference_mode(), or train with sage_attention or "
                         "qat_attention")
    o, lse = _nvfp4_attention_op(q, k, v, causal, sm_scale, layout, config)
    return (o, lse) if return_lse else o


_FAMILY_FUNCTIONS = {"int8": sage_attention, "qat": qat_attention, "nvfp4": nvfp4_attention}


# --------------------------------------------------------------------------------------------------
# drop-in scaled_dot_product_attention
# --------------------------------------------------------------------------------------------------

# Under torch.compile, dynamo calls a function marked assume_constant_result while it traces and puts its
# (constant) result in the graph: the fallback bookkeeping below then runs once per traced graph and leaves no
# graph break (a plain Python side effect would break the graph, so fullgraph=True would fail on a fallback).
_assume_constant_result = getattr(torch.compiler, "assume_constant_result", None) or \
    torch._dynamo.assume_constant_result

_FALLBACKS = dropin.FallbackLog()


def fallback_counts() -> dict:
    """Calls that ran PyTorch's SDPA instead of sagecupy's kernels since the last :func:`reset_fallback_counts`:
    ``{reason: count}`` (empty when every call ran the kernels). Counts :func:`scaled_dot_product_attention` and
    the transformers attention of :func:`register_hf`. Under ``torch.compile`` a fallback is decided, warned and
    counted when the call is traced, once per compiled graph, not at every run of that graph."""
    return _FALLBACKS.counts()


def reset_fallback_counts() -> None:
    """Zero :func:`fallback_counts`; each reason warns again at its next fallback."""
    _FALLBACKS.reset()


@_assume_constant_result
def _note_fallback(reason: str) -> bool:
    # stacklevel: warn at the caller of scaled_dot_product_attention in eager mode
    return _FALLBACKS.record(reason, stacklevel=4)


_ENVIRONMENT: dict = {}


@_assume_constant_result
def _environment_reason(index) -> str:
    """``""`` when the kernels can run on CUDA device ``index`` (None: the current one) in this process, else why
    not: CuPy or its NVRTC missing, or a GPU older than sm_80. Cached: neither changes while the process runs."""
    if index is None:
        index = torch.cuda.current_device()
    if index not in _ENVIRONMENT:
        from .._loader import nvrtc_status

        ok, why = nvrtc_status()
        if not ok:
            reason = f"sagecupy's GPU kernels are unavailable here: {why}"
        else:
            major, minor = torch.cuda.get_device_capability(index)
            reason = "" if (major, minor) >= (8, 0) else \
                f"compute capability {major}.{minor} (the kernels need 8.0 or newer)"
        _ENVIRONMENT[index] = reason
    return _ENVIRONMENT[index]


def _kernel_reason(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, family):
    """None when ``family``'s kernels compute this SDPA call as PyTorch defines it, else why not. Metadata only
    (:func:`sagecupy.adapters.dropin.unsupported_reason`), so torch.compile traces it without a data-dependent
    branch."""
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor):
            return f"{name} is not a torch.Tensor"
    reason = dropin.unsupported_reason(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
                                       family=family, grad_needed=_needs_grad(query, key, value), dtypes=_DTYPES)
    if reason is None:
        reason = _environment_reason(query.device.index) or None
    return reason


def _fall_back(reason, family, fallback, where):
    if fallback == "error":
        raise ValueError(f"{where}: family {family!r} cannot compute this call with sagecupy's kernels: {reason} "
                         f"(fallback='sdpa' runs PyTorch's SDPA instead)")
    _note_fallback(reason)


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                                 enable_gqa=False, *, family="int8", fallback="sdpa"):
    """``torch.nn.functional.scaled_dot_product_attention`` with sagecupy's kernels where they apply.

    The first eight arguments and the result are PyTorch's: ``query (B, Hq, Nq, D)``, ``key``/``value
    (B, Hkv, Nk, D)``, ``is_causal`` top-left aligned (PyTorch's mask), ``scale`` None for ``1/sqrt(D)``,
    ``enable_gqa`` as PyTorch defines it; the output ``(B, Hq, Nq, D)`` in the input dtype.

    ``family``'s kernels (``"int8"`` SageBwd, ``"qat"`` FP4 QAT, ``"nvfp4"`` inference only) run when the call is
    within what they compute exactly as PyTorch defines it: fp16/bf16 CUDA tensors on one device, D 64 or 128, no
    ``attn_mask``, ``dropout_p == 0``, ``is_causal`` only with ``Nq == Nk`` (there top-left and the kernels'
    bottom-right agree), ``Hq == Hkv`` or ``enable_gqa`` with ``Hq % Hkv == 0``, a positive ``scale``, for
    ``"nvfp4"`` no gradient needed; and CuPy with NVRTC on an sm_80+ GPU. The result then carries the family's
    quantization error, and its gradients are the family's backward.

    Any other call runs ``torch.nn.functional.scaled_dot_product_attention`` (``fallback="sdpa"``, the result is
    PyTorch's), with a :class:`SageFallbackWarning` the first time each reason occurs and a count per reason
    (:func:`fallback_counts`); ``fallback="error"`` raises ValueError naming the reason instead. The decision reads
    tensor metadata only, never values: under ``torch.compile(fullgraph=True)`` it is made at trace time and leaves
    no graph break.
    """
    dropin.check_options(family, fallback)
    reason = _kernel_reason(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, family)
    if reason is None:
        return _FAMILY_FUNCTIONS[family](query, key, value, causal=bool(is_causal), sm_scale=scale, layout="HND")
    _fall_back(reason, family, fallback, "sagecupy.torch.scaled_dot_product_attention")
    extra = {"enable_gqa": True} if enable_gqa else {}  # PyTorch before 2.5 has no enable_gqa argument
    return torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p,
                                                            is_causal=is_causal, scale=scale, **extra)


# --------------------------------------------------------------------------------------------------
# Hugging Face transformers
# --------------------------------------------------------------------------------------------------

#: Keyword arguments with which transformers asks attention for math the kernels do not do (logit soft-capping,
#: an additive position bias, attention sinks): such a call runs transformers' own SDPA attention.
_HF_UNSUPPORTED_KWARGS = ("softcap", "position_bias", "s_aux", "sinks")


def _hf_attention(module, query, key, value, attention_mask, dropout, scaling, is_causal, kwargs, *, family,
                  fallback, sdpa_forward):
    """transformers' attention-function contract: ``query (B, Hq, Nq, D)``, ``key``/``value (B, Hkv, Nk, D)``
    (GQA not repeated); returns ``(attn_output (B, Nq, Hq, D), None)``.

    Causality follows transformers' ``sdpa_attention_forward`` exactly: with no mask, ``is_causal`` (the argument,
    else ``module.is_causal``) holds when more than one query row is computed (a single decoding row sees every
    cached key), and keys past Nq are dropped then (a prefill into an empty static cache). The mask comes from
    :func:`_hf_mask`, None only where that causal rule is transformers' mask; any mask runs transformers' SDPA
    attention."""
    reason = None
    if attention_mask is not None:
        reason = ("transformers passed an attention mask (padding, packed sequences, a sliding window, a cache "
                  "longer than the queries, or under torch.compile any 2-D attention_mask)")
    else:
        for name in _HF_UNSUPPORTED_KWARGS:
            if kwargs.get(name) is not None:
                reason = f"transformers passed {name} (the kernels do not compute it)"
                break
    if reason is None:
        causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
        q_len, kv_len = query.shape[2], key.shape[2]
        # the length first: under dynamic shapes `q_len > 1` is a SymBool, which `and` then turns into a guard
        causal = bool(q_len > 1) and bool(causal)
        if causal and kv_len > q_len:
            key, value = key[:, :, :q_len], value[:, :, :q_len]
        reason = _kernel_reason(query, key, value, None, dropout, causal, scaling, True, family)
    if reason is None:
        # NHD views of the same memory: the kernels write O as (B, Nq, Hq, D), the layout transformers returns,
        # so no transpose copy follows.
        o = _FAMILY_FUNCTIONS[family](query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2),
                                      causal=causal, sm_scale=scaling, layout="NHD")
        return o, None
    _fall_back(reason, family, fallback, "the sagecupy transformers attention")
    return sdpa_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                        is_causal=is_causal, **kwargs)


def _hf_mask(batch_size, q_length, kv_length, q_offset=0, kv_offset=0, mask_function=None, attention_mask=None,
             *, sdpa_mask, causal_mask_function, **kwargs):
    """transformers' mask-function contract (``masking_utils.AttentionMaskInterface``) for the sagecupy attention.

    None when transformers asks for its plain causal mask (``causal_mask_function``, no 2-D padding mask, no
    window, and ``allow_is_causal_skip``, which transformers clears for packed sequences, mask overlays and compiled
    static-cache decoding) over sizes where :func:`_hf_attention`'s causal rule is that mask
    (:func:`sagecupy.adapters.dropin.hf_causal_needs_no_mask`). That decision reads sizes and Python ints only, so
    it is the same eagerly and while torch.compile traces (transformers' ``sdpa_mask`` always builds a mask while
    tracing: it would have to read the padding mask's values). Everything else gets ``"sdpa"``'s mask function:
    eagerly it returns None wherever it would for ``"sdpa"`` (an all-ones padding mask included); a mask it builds
    makes the attention fall back, visibly. Under ``torch.jit.trace`` the Python decision would be frozen into the
    trace, so there ``"sdpa"``'s mask function decides alone."""
    if mask_function is None:
        mask_function = causal_mask_function
    if (attention_mask is None and mask_function is causal_mask_function and kwargs.get("allow_is_causal_skip", True)
            and kwargs.get("local_size") is None and not torch.jit.is_tracing()):
        offsets = [None if isinstance(x, torch.Tensor) else x for x in (q_offset, kv_offset)]
        if dropin.hf_causal_needs_no_mask(q_length, kv_length, *offsets):
            return None
    return sdpa_mask(batch_size, q_length, kv_length, q_offset=q_offset, kv_offset=kv_offset,
                     mask_function=mask_function, attention_mask=attention_mask, **kwargs)


def register_hf(name="sagecupy", family="int8", fallback="sdpa"):
    """Register sagecupy attention with Hugging Face transformers as ``attn_implementation=name``.

        import sagecupy.torch as st
        from transformers import AutoModelForCausalLM
        st.register_hf()                                    # "sagecupy": INT8 SageBwd, else transformers' SDPA
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sagecupy")

    Registers the attention function with ``transformers.AttentionInterface`` and, where transformers has one
    (``masking_utils.AttentionMaskInterface``), a mask function under the same name (:func:`_hf_mask`): None when
    attention is purely causal (or one decoding row) with no padding, eagerly and under torch.compile alike, else the
    mask transformers builds for ``"sdpa"``. Maskless calls run ``family``'s kernels (causal through the kernels'
    causal path, GQA without repeating K and V); the others (a padding, packing or window mask, dropout in
    training, an unsupported head dim or dtype, ``family="nvfp4"`` with gradients) run transformers' own SDPA
    attention with :func:`fallback_counts` counting them, or raise ValueError with ``fallback="error"``. Works
    under ``torch.compile(fullgraph=True)``; there, any 2-D ``attention_mask`` (even all ones: its values cannot be
    read while tracing) and a forward without a KV cache (``use_cache=False``: transformers cannot rule out packed
    sequences without reading ``position_ids``) get a mask and fall back. Returns the registered function.
    """
    dropin.check_options(family, fallback)
    try:
        from transformers import AttentionInterface
        from transformers.integrations.sdpa_attention import sdpa_attention_forward
    except ImportError as exc:
        raise ImportError(f"register_hf needs transformers with AttentionInterface: {exc}") from exc

    def attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs):
        return _hf_attention(module, query, key, value, attention_mask, dropout, scaling, is_causal, kwargs,
                             family=family, fallback=fallback, sdpa_forward=sdpa_attention_forward)

    attention.__name__ = attention.__qualname__ = f"sagecupy_{family}_attention"
    AttentionInterface.register(name, attention)
    try:
        from transformers.masking_utils import (ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface,
                                                causal_mask_function)
    except ImportError:  # older transformers: models build their masks themselves
        pass
    else:
        sdpa_mask = ALL_MASK_ATTENTION_FUNCTIONS["sdpa"]

        def mask(*args, **kwargs):
            return _hf_mask(*args, sdpa_mask=sdpa_mask, causal_mask_function=causal_mask_function, **kwargs)

        mask.__name__ = mask.__qualname__ = "sagecupy_mask"
        # _hf_mask speaks the interface that passes q_length / q_offset; earlier ones (cache_position instead) get
        # sdpa's own mask function, which compiled models then turn into a visible fallback.
        q_length = "q_length" in inspect.signature(sdpa_mask).parameters
        AttentionMaskInterface.register(name, mask if q_length else sdpa_mask)
    return attention
