"""The PyTorch custom ops of :mod:`sagecupy.torch` (``torch.ops.sagecupy.*``, registered with ``torch.library`` when
this module is imported) and what crosses their boundary: CUDA tensors as zero-copy CuPy arrays and back, PyTorch's
current stream as CuPy's, configs as strings. The public functions that call the ops, the autograd Functions, the
SDPA drop-in and the transformers registration are :mod:`sagecupy.torch`'s, which re-exports :func:`to_cupy`,
:func:`from_cupy` and :func:`on_torch_stream`; its docstring describes tensors, streams and memory.

Every op takes tensors, Python scalars and strings only, and has a fake implementation (output shapes from input
shapes), so ``torch.compile`` traces a call without running it and leaves no graph break.

Packed variable-length sequences (``layout="THD"``, INT8 only) add four trailing arguments to the INT8 ops:
``cu_seqlens_q``/``cu_seqlens_k`` (optional int32 CUDA tensors, the ``S + 1`` offsets; None for the dense layouts)
and ``max_seqlen_q``/``max_seqlen_k`` (ints, -1 for none). The forward op returns the device table of sequence
offsets (:attr:`sagecupy.int8.Residuals.packed`) as its last residual (an empty int32 tensor for the dense layouts),
which the backward op takes after ``lse2``, with the offsets, to rebuild the residuals."""
import contextlib
import dataclasses
import functools
import inspect
import types
import typing

import torch

from .. import _checks, _layout
from .._program import Plans as _Plans
from .._program import env_key as _env_key
from ..config import NVFP4Config, QATConfig, SageBwdConfig, get_config

if not hasattr(torch.library, "custom_op"):
    raise ImportError(f"sagecupy.torch needs PyTorch >= 2.4 (torch.library.custom_op); this is {torch.__version__}")

_DTYPES = (torch.float16, torch.bfloat16)
Tensor = torch.Tensor


# --------------------------------------------------------------------------------------------------
# tensors and streams
# --------------------------------------------------------------------------------------------------


def _require_cuda_tensor(t, name):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.device.type != "cuda":
        raise TypeError(f"{name} is a {t.device.type} tensor; sagecupy runs on CUDA tensors (move it with "
                        f"{name}.cuda())")


def to_cupy(tensor, name="tensor"):
    """A zero-copy CuPy view of a CUDA tensor, strides kept: a ``cupy.ndarray``; for ``torch.bfloat16``, a CuPy
    ``ml_dtypes.bfloat16`` array where CuPy has that dtype, else a :class:`~sagecupy.adapters.bf16.BF16Array` (the
    bits travel as int16 either way). The view keeps the tensor alive. Call it on the stream that will use the view
    (:func:`on_torch_stream`): DLPack orders that stream after the tensor's current stream."""
    import cupy

    from .bf16 import from_bits

    _require_cuda_tensor(tensor, name)
    t = tensor.detach()  # DLPack refuses tensors that require grad; the memory is the same
    if t.dtype == torch.bfloat16:
        return from_bits(cupy.from_dlpack(t.view(torch.int16)).view(cupy.uint16))
    return cupy.from_dlpack(t)


def from_cupy(x):
    """A zero-copy PyTorch tensor of a CuPy array (``torch.bfloat16`` for a CuPy bfloat16 array or a
    :class:`~sagecupy.adapters.bf16.BF16Array`, through its int16 bits). The tensor keeps the CuPy allocation
    alive."""
    import cupy

    from .bf16 import bits_of, is_bf16

    if is_bf16(x):
        return torch.from_dlpack(bits_of(x).view(cupy.int16)).view(torch.bfloat16)
    return torch.from_dlpack(x)


# The adapter's own exchanges run inside on_torch_stream, where CuPy's current stream is PyTorch's current stream. The
# stream handshake DLPack does on each exchange (PyTorch's __dlpack__ and from_dlpack look the current stream up in
# Python and pass it across) orders nothing there, and it cost 20-45 us per tensor on an H200, against 82 us of host
# time for a whole CuPy inference call at a small shape (docs/experiments.md, E-ADAPT-HOST). Those exchanges use the
# two functions below, which carry no stream; to_cupy and from_cupy keep the handshake for callers on other streams.
_RAW_DTYPES = {torch.float16: "float16", torch.bfloat16: "uint16", torch.float32: "float32", torch.int8: "int8",
               torch.uint8: "uint8", torch.int16: "int16", torch.int32: "int32", torch.int64: "int64"}


def _as_cupy(tensor, name="tensor", bits=False):
    """:func:`to_cupy`'s array without DLPack, for use inside :func:`on_torch_stream` only: a CuPy array over the
    tensor's memory with its shape and strides (bfloat16 as :func:`to_cupy` gives it; with ``bits``, as its uint16
    bits, the form the kernels take), the tensor as the memory's owner, so the array keeps it alive."""
    import cupy

    _require_cuda_tensor(tensor, name)
    raw = _RAW_DTYPES.get(tensor.dtype)
    if raw is None or tensor.numel() == 0:  # (no memory behind an empty tensor: DLPack handles it)
        return to_cupy(tensor, name)
    size = tensor.element_size()
    strides = tensor.stride()
    extent = (1 + sum((n - 1) * st for n, st in zip(tensor.shape, strides))) * size  # bytes up to the last element
    mem = cupy.cuda.UnownedMemory(tensor.data_ptr(), extent, tensor, tensor.get_device())
    wrap = False
    if tensor.dtype == torch.bfloat16 and not bits:  # the form from_bits gives, built at once: one array, not two
        from .bf16 import BF16Array, native_dtype

        native = native_dtype()
        raw, wrap = (native, False) if native is not None else (raw, True)
    arr = cupy.ndarray(tuple(tensor.shape), raw, cupy.cuda.MemoryPointer(mem, 0), tuple(st * size for st in strides))
    return BF16Array(arr) if wrap else arr


def _as_torch(x):
    """:func:`from_cupy`'s tensor for use inside :func:`on_torch_stream` only: the array's DLPack capsule asked for with
    ``stream=-1`` (the array API's "no synchronization") and without ``max_version``, so the unversioned capsule every
    supported PyTorch reads."""
    from .bf16 import bits_of, is_bf16

    if is_bf16(x):
        return _raw_as_torch(bits_of(x), torch.bfloat16)
    return _raw_as_torch(x, None)


@contextlib.contextmanager
def on_torch_stream(device):
    """Make ``device`` CuPy's current device and PyTorch's current stream on it CuPy's current stream.

    Everything CuPy launches or allocates inside the block is then ordered on PyTorch's stream: after
    the kernels that produced the inputs, before those that will consume the outputs; nothing waits
    on the host."""
    import cupy

    device = torch.device(device)
    index = device.index if device.index is not None else torch.cuda.current_device()
    with cupy.cuda.Device(index), _cupy_stream(index):
        yield


# PyTorch's current stream as its raw handle (what torch.cuda.current_stream(i).cuda_stream gives, without building a
# Stream object), where this PyTorch has the function.
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def _cupy_stream(index):
    ptr = _raw_stream(index) if _raw_stream is not None else torch.cuda.current_stream(index).cuda_stream
    return _checks.external_stream(ptr, index)


def _check_inputs(*named):
    """TypeError/ValueError naming the argument for anything the kernels cannot take as a torch tensor:
    not a tensor, not on a GPU, not fp16/bf16, dtypes or devices that differ. Shapes are checked by the
    family itself. Returns the common device. Only tensor metadata is read (traceable by torch.compile)."""
    first_name, first = None, None
    for name, t in named:
        _require_cuda_tensor(t, name)
        if t.dtype not in _DTYPES:
            raise TypeError(f"{name}.dtype={t.dtype} is not supported; supported: torch.float16, torch.bfloat16")
        if first is None:
            first_name, first = name, t
            continue
        if t.dtype != first.dtype:
            raise TypeError(f"{first_name} and {name} must share one dtype, got {first.dtype} and {t.dtype}")
        if t.device != first.device:
            raise ValueError(f"{name} is on {t.device} and {first_name} on {first.device}; all inputs must be on "
                             f"one GPU")
    return first.device


def _hnd(shape, layout):
    """(B, H, N, D) of a 4-D shape in ``layout``."""
    if len(shape) != 4:
        raise ValueError(f"attention inputs must be 4-D, got shape {tuple(shape)}")
    b, a1, a2, d = shape
    return (b, a1, a2, d) if layout == "HND" else (b, a2, a1, d)


def _thd(shape, name):
    """(total, H, D) of a packed (3-D) shape; ValueError naming the argument otherwise."""
    if len(shape) != 3:
        raise ValueError(f"{name} must be 3-D (total, H, D) for layout='THD', got shape {tuple(shape)}")
    return tuple(shape)


def _family(name):
    """The family module: ``sagecupy.int8`` or ``sagecupy.qat`` (imported on first use)."""
    if name == "int8":
        from .. import int8

        return int8
    from . import qat_module

    return qat_module("the FP4 QAT op")


# --------------------------------------------------------------------------------------------------
# configs across the custom-op boundary (custom ops take str, not dataclasses)
# --------------------------------------------------------------------------------------------------


def _field_names(cls):
    """Field names of a config dataclass, ``name`` last (it is free text, so it is parsed last)."""
    names = [f.name for f in dataclasses.fields(cls) if f.name != "name"]
    return tuple(names) + ("name",)


_CONFIG_CLASSES = {"SageBwdConfig": (SageBwdConfig, _field_names(SageBwdConfig)),
                   "QATConfig": (QATConfig, _field_names(QATConfig)),
                   "NVFP4Config": (NVFP4Config, _field_names(NVFP4Config))}


def _encode_config(cfg):
    """A config as the custom ops' ``str`` argument: ``""`` for None, a preset name as is, a config
    dataclass as ``"Class:field=value;...;name=..."``. Written with attribute reads and string
    formatting only, so that torch.compile traces it without a graph break."""
    if cfg is None:
        return ""
    if isinstance(cfg, str):
        return cfg
    if isinstance(cfg, SageBwdConfig):
        tag = "SageBwdConfig"
    elif isinstance(cfg, QATConfig):
        tag = "QATConfig"
    elif isinstance(cfg, NVFP4Config):
        tag = "NVFP4Config"
    else:
        raise TypeError(f"config must be None, a preset name, a SageBwdConfig, a QATConfig or an NVFP4Config, got "
                        f"{type(cfg).__name__}")
    parts = []
    for field in _CONFIG_CLASSES[tag][1]:
        parts.append(f"{field}={getattr(cfg, field)}")
    return tag + ":" + ";".join(parts)


@functools.lru_cache(maxsize=64)
def _decode_config(text):
    """Inverse of :func:`_encode_config`."""
    if text == "":
        return None
    tag, sep, body = text.partition(":")
    if not sep or tag not in _CONFIG_CLASSES:
        return text  # a preset name: the family resolves it
    cls, names = _CONFIG_CLASSES[tag]
    defaults = cls()
    values = {}
    for field, item in zip(names, body.split(";", len(names) - 1)):
        key, _, value = item.partition("=")
        if key != field:
            raise ValueError(f"malformed config string {text!r} (expected field {field!r}, got {key!r})")
        kind = type(getattr(defaults, field))
        values[field] = (value == "True") if kind is bool else kind(value)
    return cls(**values)


# --------------------------------------------------------------------------------------------------
# torch.library custom ops: tensors only across the boundary
# --------------------------------------------------------------------------------------------------


def _int8_residual_shapes(q_shape, k_shape, layout, cu_seqlens_q=None):
    """Shapes of the residual tensors of :class:`sagecupy.int8.Residuals`, in the order the forward op
    returns them: q_codes, q_scale, k_codes, k_scale, lse2, packed. Query rows are padded to the forward's
    128-row blocks, keys to a multiple of 128 (the largest forward key tile); ``packed`` (the table of sequence
    offsets) is empty for the dense layouts. Packed sequences (``"THD"``, ``S = len(cu_seqlens_q) - 1``): the
    buffers in the packed padded layout and the table, sized from the shapes alone (sagecupy/_varlen.py)."""
    if layout == _layout.PACKED:
        from .. import _varlen

        if cu_seqlens_q is None:
            raise ValueError("cu_seqlens_q is required with layout='THD' (int32 prefix sums of the sequence lengths, "
                             "S + 1 offsets)")
        Tq, Hq, D = _thd(q_shape, "q")
        Tk, Hkv, _ = _thd(k_shape, "k")
        S = cu_seqlens_q.shape[0] - 1
        tq_pad, tk_pad, _, _, _ = _checks.packed_bounds(S, Tq, Tk)
        meta = _varlen.meta_size(types.SimpleNamespace(batch=S, nq=Tq, nk=Tk))
        return (Hq * tq_pad, D), (Hq * tq_pad,), (Hkv * tk_pad, D), (Hkv * tk_pad,), (Hq * tq_pad,), (meta,)
    from ..int8 import _FWD_BKV, _FWD_BQ

    B, Hq, Nq, D = _hnd(q_shape, layout)
    _, Hkv, Nk, _ = _hnd(k_shape, layout)
    nq_pad = (Nq + _FWD_BQ - 1) // _FWD_BQ * _FWD_BQ
    nk_pad = (Nk + _FWD_BKV - 1) // _FWD_BKV * _FWD_BKV
    return (B, Hq, nq_pad, D), (B, Hq, nq_pad), (B, Hkv, nk_pad, D), (B, Hkv, nk_pad), (B, Hq, nq_pad), (0,)


_INT8_RESIDUAL_DTYPES = (torch.int8, torch.float32, torch.int8, torch.float32, torch.float32, torch.int32)
_INT8_RESIDUAL_FIELDS = ("q_codes", "q_scale", "k_codes", "k_scale", "lse2", "packed")


def _window(window_left, window_right):
    """The INT8 ops' two window ints as :func:`sagecupy.int8.forward`'s ``window``: ``(-1, -1)`` (unbounded on both
    sides, the ops' default) is None, so that ``causal`` alone decides; any other pair is the window. The entry
    points refuse ``window=(-1, -1)`` with ``causal=True`` before it can get here as "no window"; without causal, None
    and ``(-1, -1)`` give the kernels the same ``(left, right)``."""
    left, right = int(window_left), int(window_right)
    return None if (left, right) == (-1, -1) else (left, right)


def _int8_residuals(o, v, q_codes, q_scale, k_codes, k_scale, lse2, packed, *, causal, sm_scale, layout, config,
                    window, cu_seqlens_q=None, cu_seqlens_k=None):
    """The :class:`sagecupy.int8.Residuals` the forward built, from the tensors it returned (CuPy views).

    ``o`` has q's shape and dtype and ``v`` k's, so :func:`sagecupy._checks.check_attention_args` (packed sequences:
    :func:`sagecupy._varlen.check_args` with the same offsets, read by their metadata only) gives the forward's
    ``Problem`` field for field, ``window`` included (the backward validates it and masks with it); ``v`` is prepared
    exactly as the forward prepared it (a view, or the same copy when its rows were not 16-byte aligned). ``mu_k`` is
    not used by the backward. ``packed``: the forward's table of sequence offsets, or None (the forward op's empty
    table of a dense call); a table on a dense layout is handed on for ``int8.check_residuals`` to refuse. The
    backward checks every array against the Problem, the table's size included, before any launch.
    """
    from .. import int8 as s8

    if layout == _layout.PACKED:
        from .. import _varlen

        p = _varlen.check_args(o, v, v, causal=causal, sm_scale=sm_scale, layout=layout, window=window,
                               cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=None,
                               max_seqlen_k=None)
        if packed is None:
            raise ValueError("packed (the forward op's last residual, the table of sequence offsets) is empty: the "
                             "backward of packed sequences needs the table their forward returned")
    else:
        for name, t in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
            if t is not None:
                raise ValueError(f"{name} is only for layout='THD' (packed sequences), got layout={layout!r}")
        p = _checks.check_attention_args(o, v, v, causal=causal, sm_scale=sm_scale, layout=layout, window=window)
    return s8.Residuals(problem=p, config=get_config(config), q_codes=q_codes, q_scale=q_scale, k_codes=k_codes,
                        k_scale=k_scale, v=_layout.prepare(v, "v", layout, True), o=_checks.raw(o), lse2=lse2,
                        mu_k=None, packed=packed)


def _packed_kwargs(device, layout, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k):
    """The packed-sequence keyword arguments of the INT8 entry points, from the ops' arguments: ``{}`` when none is
    given (a dense call, which then runs with the arguments it always had), else the offsets as CuPy views (CUDA
    tensors on the inputs' device; their dtype, shape and values are :mod:`sagecupy._varlen`'s to check) and the
    maxima as None (-1) or ints. A dense layout given any of them is refused by the INT8 entry points, naming it."""
    if cu_seqlens_q is None and cu_seqlens_k is None and max_seqlen_q == -1 and max_seqlen_k == -1 \
            and layout != _layout.PACKED:
        return {}
    kw = {}
    for name, t in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if t is not None:
            _require_cuda_tensor(t, name)
            if t.device != device:
                raise ValueError(f"{name} is on {t.device} and the inputs on {device}; the offsets must be on the "
                                 f"inputs' GPU")
            t = _as_cupy(t, name)
        kw[name] = t
    for name, m in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        kw[name] = None if int(m) == -1 else int(m)
    return kw


def _custom_op(name):
    """``torch.library.custom_op`` with no mutated arguments, tagged ``cudagraph_unsafe`` where this PyTorch has the
    tag: CuPy allocates outputs and workspaces during the call, which a CUDA graph cannot capture, so inductor's
    graph partitioning (``mode="reduce-overhead"`` with ``torch._inductor.config.graph_partition``) runs the ops
    between the graphs it captures instead of refusing the whole model."""
    tag = getattr(torch.Tag, "cudagraph_unsafe", None)
    if tag is not None and "tags" in inspect.signature(torch.library.custom_op).parameters:
        return torch.library.custom_op(name, mutates_args=(), tags=(tag,))
    return torch.library.custom_op(name, mutates_args=())


def _lse_shape(q_shape, layout):
    """(B, Hq, Nq): the LSE every forward writes for the dense layouts; (Hq, total_q) for packed sequences."""
    if layout == _layout.PACKED:
        Tq, Hq, _ = _thd(q_shape, "q")
        return (Hq, Tq)
    B, Hq, Nq, _ = _hnd(q_shape, layout)
    return (B, Hq, Nq)


# The INT8 ops take the window after the config, as two ints defaulting to (-1, -1) (no window): a call that passes
# no window means what causal says. Packed sequences' offsets (None) and maxima (-1) follow, so a call written without
# them is a dense call as before. PyTorch's dispatcher drops arguments equal to their defaults in places, so every
# function registered for these ops has the same defaults, and the setup context takes the trailing arguments as
# they come.


def _int8_forward(device, q, k, v, causal, sm_scale, layout, config, window_left, window_right, cu_seqlens_q,
                  cu_seqlens_k, max_seqlen_q, max_seqlen_k):
    """:func:`sagecupy.int8.forward` on the forward op's arguments, under the caller's ``on_torch_stream(device)``:
    CuPy ``(o, lse, residuals, key)``, ``o`` raw (:func:`_raw_as_torch`). A dense call replays the plan of an earlier
    call with the same key (:data:`_PLANS`) on q's and k's addresses and a raw view of v, which the residuals keep.
    ``key``: the plan's key where the plan is kept (the residuals' metadata is then the key's alone), else None."""
    from .. import int8 as s8

    kw = _packed_kwargs(device, layout, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    key = None if kw else _plan_key(False, q, k, v, causal, sm_scale, layout, config, window_left, window_right)
    plan = None if key is None else _PLANS.get(key)
    if plan is not None:
        o, lse, res, _ = s8._training(q.data_ptr(), k.data_ptr(), _as_cupy(v, "v", bits=True), plan)
        return o, lse, res, key
    o, lse, res, plan = s8._training(_as_cupy(q, "q"), _as_cupy(k, "k"), _as_cupy(v, "v"), causal=causal,
                                     sm_scale=sm_scale, layout=layout, config=_decode_config(config),
                                     window=_window(window_left, window_right), **kw)
    return o, lse, res, _keep_plan(key, plan, q, k, v)


def _int8_backward(ctx, do):
    """``(dq, dk, dv)`` of :func:`sagecupy.int8.backward` on ``ctx.res``, the residuals of :func:`_int8_forward`, as
    tensors. Where the forward's plan was kept (``ctx.key``), the backward's programs are kept too, under that key and
    dO's metadata (:data:`_BWD_REPLAYS`), and replayed on dO's raw view from then on: no argument checks and no
    lookups by the residuals' signatures (docs/experiments.md, E-ADAPT-TRAIN)."""
    from .. import int8 as s8

    _check_inputs(("do", do))
    do = do.contiguous()
    with on_torch_stream(ctx.device):
        key = ctx.key and (ctx.key, do.dtype, do.shape, do.stride(), do.data_ptr() & 15, do.get_device(), _env_key())
        replay = key and _BWD_REPLAYS.get(key)
        if replay:
            grads = s8._backward_replay(ctx.res, _as_cupy(do, "do", bits=True), replay)
        else:
            grads = s8._backward_replay(ctx.res, _as_cupy(do, "do"))
            if key and grads[3] is not None:
                _BWD_REPLAYS.put(key, grads[3])
        dq, dk, dv = (_raw_as_torch(g, do.dtype) for g in grads[:3])
    release_unless_retained(ctx, "res")
    return dq, dk, dv


_BWD_REPLAYS = _Plans(cap=64)


def _sage_fwd(q: Tensor, k: Tensor, v: Tensor, causal: bool, sm_scale: typing.Optional[float], layout: str,
              config: str, window_left: int = -1, window_right: int = -1,
              cu_seqlens_q: typing.Optional[Tensor] = None, cu_seqlens_k: typing.Optional[Tensor] = None,
              max_seqlen_q: int = -1, max_seqlen_k: int = -1
              ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """INT8 SageBwd forward: (o, lse, q_codes, q_scale, k_codes, k_scale, lse2, packed); the last six are the
    residuals (``packed``, the table of sequence offsets, is empty for the dense layouts)."""
    device = _check_inputs(("q", q), ("k", k), ("v", v))
    with on_torch_stream(device):
        o, lse, res, _ = _int8_forward(device, q, k, v, causal, sm_scale, layout, config, window_left,
                                       window_right, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
        saved = [getattr(res, f) for f in _INT8_RESIDUAL_FIELDS]
        want = _int8_residual_shapes(q.shape, k.shape, layout, cu_seqlens_q)
        for field, x, shape in zip(_INT8_RESIDUAL_FIELDS, saved, want):
            got = (0,) if x is None and field == "packed" else tuple(x.shape)
            if got != shape:  # the fake implementation below would be wrong
                raise RuntimeError(f"sagecupy.int8.Residuals.{field} has shape {got}, the adapter expected {shape}: "
                                   f"sagecupy.torch is out of date with sagecupy.int8")
        table = torch.empty(0, dtype=torch.int32, device=device) if saved[-1] is None else _as_torch(saved[-1])
        return (_raw_as_torch(o, q.dtype), *(_as_torch(x) for x in (lse, *saved[:-1])), table)


_sage_fwd_op = _custom_op("sagecupy::sage_attention_fwd")(_sage_fwd)


def _sage_infer(q: Tensor, k: Tensor, v: Tensor, causal: bool, sm_scale: typing.Optional[float], layout: str,
                config: str, window_left: int = -1, window_right: int = -1,
                cu_seqlens_q: typing.Optional[Tensor] = None, cu_seqlens_k: typing.Optional[Tensor] = None,
                max_seqlen_q: int = -1, max_seqlen_k: int = -1) -> tuple[Tensor, Tensor]:
    """INT8 SageBwd inference forward (:func:`sagecupy.int8.sage_attention`: no residuals; o bitwise the forward
    op's), for calls that need no gradient: (o, lse)."""
    return sage_infer_on(_check_inputs(("q", q), ("k", k), ("v", v)), q, k, v, causal, sm_scale, layout, config,
                         window_left, window_right, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)


def sage_infer_on(device, q, k, v, causal, sm_scale, layout, config, window_left=-1, window_right=-1,
                  cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=-1, max_seqlen_k=-1):
    """:func:`_sage_infer`'s body, for callers that checked q, k, v already (``device``: the device
    :func:`_check_inputs` returned for them)."""
    from .. import int8 as s8

    with on_torch_stream(device):
        kw = _packed_kwargs(device, layout, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
        key = None if kw else _plan_key(True, q, k, v, causal, sm_scale, layout, config, window_left, window_right)
        plan = None if key is None else _PLANS.get(key)
        if plan is not None:  # replayed from the plan of an earlier call with the same key
            o, lse, _ = s8._inference(q.data_ptr(), k.data_ptr(), v.data_ptr(), plan)
            return _raw_as_torch(o, q.dtype), _as_torch(lse)
        o, lse, plan = s8._inference(_as_cupy(q, "q"), _as_cupy(k, "k"), _as_cupy(v, "v"), causal=causal,
                                     sm_scale=sm_scale, layout=layout, config=_decode_config(config),
                                     window=_window(window_left, window_right), **kw)
        _keep_plan(key, plan, q, k, v)
        return _raw_as_torch(o, q.dtype), _as_torch(lse)


# The forward's plans (sagecupy/_program.py: the pre-pass of the inference or the training forward) by what a call
# on torch tensors looks like: the key holds everything int8's own plan lookup keys by (the inputs' dtype, shapes,
# strides and 16-byte alignment, the options as the op received them, the device and the kernel-choosing
# environment), read from tensor metadata. A hit replays the plan on the tensors' addresses: no CuPy views of q and k
# (and of v only the raw one the residuals keep), no lookup by their signatures (docs/experiments.md, E-ADAPT-DIRECT
# and E-ADAPT-TRAIN). Only dense calls whose inputs the pre-pass reads as they are (no copy) are kept.
_PLANS = _Plans(cap=64)


def _plan_key(inference, q, k, v, causal, sm_scale, layout, config, window_left, window_right):
    """A dense call's key in :data:`_PLANS` (inside :func:`on_torch_stream`, whose device
    :func:`~sagecupy._program.env_key` reads)."""
    return (inference, q.dtype, k.dtype, v.dtype, q.shape, q.stride(), k.shape, k.stride(), v.shape, v.stride(),
            q.data_ptr() & 15, k.data_ptr() & 15, v.data_ptr() & 15, causal, sm_scale, layout, config, window_left,
            window_right, _env_key())


def _keep_plan(key, plan, q, k, v):
    """Keep ``plan`` under ``key`` (None: a packed call) when it can be replayed on addresses: no input copied.
    Returns ``key`` if kept, else None."""
    if key is not None and not any(plan.copy) and q.numel() and k.numel() and v.numel():
        _PLANS.put(key, plan)
        return key
    return None


def _raw_as_torch(x, dtype):
    """A raw CuPy array as a tensor, inside :func:`on_torch_stream`: bfloat16's uint16 bits as ``torch.bfloat16``
    (``dtype``), any other array (``dtype`` another value) with its own dtype; the capsule as :func:`_as_torch`
    describes."""
    import cupy

    if dtype == torch.bfloat16:
        return torch.utils.dlpack.from_dlpack(x.view(cupy.int16).__dlpack__(stream=-1)).view(torch.bfloat16)
    return torch.utils.dlpack.from_dlpack(x.__dlpack__(stream=-1))


_sage_infer_op = _custom_op("sagecupy::sage_attention_infer")(_sage_infer)


@_sage_infer_op.register_fake
def _sage_infer_fake(q, k, v, causal, sm_scale, layout, config, window_left=-1, window_right=-1, cu_seqlens_q=None,
                     cu_seqlens_k=None, max_seqlen_q=-1, max_seqlen_k=-1):
    return q.new_empty(q.shape), q.new_empty(_lse_shape(q.shape, layout), dtype=torch.float32)


@_sage_fwd_op.register_fake
def _sage_fwd_fake(q, k, v, causal, sm_scale, layout, config, window_left=-1, window_right=-1, cu_seqlens_q=None,
                   cu_seqlens_k=None, max_seqlen_q=-1, max_seqlen_k=-1):
    shapes = _int8_residual_shapes(q.shape, k.shape, layout, cu_seqlens_q)
    return (q.new_empty(q.shape), q.new_empty(_lse_shape(q.shape, layout), dtype=torch.float32),
            *(q.new_empty(s, dtype=dt) for s, dt in zip(shapes, _INT8_RESIDUAL_DTYPES)))


def _sage_bwd(do: Tensor, o: Tensor, v: Tensor, q_codes: Tensor, q_scale: Tensor, k_codes: Tensor,
              k_scale: Tensor, lse2: Tensor, packed: Tensor, causal: bool, sm_scale: typing.Optional[float],
              layout: str, config: str, window_left: int = -1, window_right: int = -1,
              cu_seqlens_q: typing.Optional[Tensor] = None,
              cu_seqlens_k: typing.Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor]:
    """INT8 SageBwd backward from the forward op's output and residual tensors (``packed`` included, in the order
    the forward op returns them) and, for packed sequences, the forward's offsets: (dq, dk, dv)."""
    from .. import int8 as s8

    device = _check_inputs(("do", do), ("o", o), ("v", v))
    with on_torch_stream(device):
        kw = _packed_kwargs(device, layout, cu_seqlens_q, cu_seqlens_k, -1, -1)
        # an empty table (a dense call's) is None, and is not handed to DLPack (no memory behind it)
        table = None if packed.numel() == 0 else _as_cupy(packed, "packed")
        saved = (_as_cupy(x, f) for x, f in zip((q_codes, q_scale, k_codes, k_scale, lse2), _INT8_RESIDUAL_FIELDS))
        res = _int8_residuals(_as_cupy(o, "o"), _as_cupy(v, "v"), *saved, table,
                              causal=causal, sm_scale=sm_scale, layout=layout, config=_decode_config(config),
                              window=_window(window_left, window_right), cu_seqlens_q=kw.get("cu_seqlens_q"),
                              cu_seqlens_k=kw.get("cu_seqlens_k"))
        return tuple(_as_torch(g) for g in s8.backward(res, _as_cupy(do, "do")))


_sage_bwd_op = _custom_op("sagecupy::sage_attention_bwd")(_sage_bwd)


@_sage_bwd_op.register_fake
def _sage_bwd_fake(do, o, v, q_codes, q_scale, k_codes, k_scale, lse2, packed, causal, sm_scale, layout, config,
                   window_left=-1, window_right=-1, cu_seqlens_q=None, cu_seqlens_k=None):
    return o.new_empty(o.shape), v.new_empty(v.shape), v.new_empty(v.shape)


def _sage_setup_context(ctx, inputs, output):
    q, k, v, causal, sm_scale, layout, config, *rest = inputs
    # rest: the window, then the offsets and the maxima (which the backward does not need)
    window, offsets = rest[:2], (list(rest[2:4]) + [None, None])[:2]
    o, lse, *residuals = output
    # The LSE is an output for the caller, not a differentiable one: the backward kernels take dO only.
    ctx.mark_non_differentiable(lse, *residuals)
    ctx.save_for_backward(o, v, *residuals, *offsets)  # (None where a dense call has no offsets)
    ctx.options = (causal, sm_scale, layout, config, *window)


def _sage_backward_args(ctx, do):
    """The backward op's arguments from what :func:`_sage_setup_context` saved."""
    o, v, *residuals, cu_seqlens_q, cu_seqlens_k = ctx.saved_tensors
    options = ctx.options
    if cu_seqlens_q is not None or cu_seqlens_k is not None:
        options += (-1, -1)[len(options) - 4:] + (cu_seqlens_q, cu_seqlens_k)  # the window's defaults first
    return (do.contiguous(), o, v, *residuals, *options)


def _sage_backward(ctx, do, *_other_grads):
    dq, dk, dv = torch.ops.sagecupy.sage_attention_bwd(*_sage_backward_args(ctx, do))
    # one None per other input (autograd drops trailing Nones for inputs that were not passed)
    return (dq, dk, dv) + (None,) * 10


_sage_fwd_op.register_autograd(_sage_backward, setup_context=_sage_setup_context)


_keep_graph = getattr(torch._C._autograd, "_get_current_graph_task_keep_graph", None)


def backward_from_ctx(ctx, module, do):
    """``(dq, dk, dv)`` of ``module.backward`` on the residuals object ``ctx.res`` (computed on ``ctx.device``), which
    is then dropped unless the graph is retained: the backward of the eager ``autograd.Function`` s that keep their
    residuals on ``ctx``."""
    _check_inputs(("do", do))
    with on_torch_stream(ctx.device):
        grads = module.backward(ctx.res, _as_cupy(do.contiguous(), "do"))
        dq, dk, dv = (_as_torch(g) for g in grads)
    release_unless_retained(ctx, "res")
    return dq, dk, dv


def release_unless_retained(ctx, *names):
    """Drop ``ctx``'s attributes ``names`` at the end of a backward that will not run again (no ``retain_graph``),
    as autograd frees saved tensors then: an opaque residuals object on ``ctx`` would otherwise live as long as the
    graph, which the caller's output keeps. A PyTorch without the private query keeps them."""
    if _keep_graph is not None and not _keep_graph():
        for name in names:
            setattr(ctx, name, None)


class SageEagerFunction(torch.autograd.Function):
    """What :func:`sagecupy.torch.sage_attention` runs in eager mode on plain tensors: the INT8 forward and backward
    without PyTorch's dispatcher. It takes the forward op's arguments (already checked by ``sage_attention``) and
    returns ``(o, lse)``; the :class:`sagecupy.int8.Residuals` stay on ``ctx`` as CuPy arrays, so no residual crosses
    to PyTorch and back and the backward does not rebuild them. The gradients are the ops' bit for bit (the same
    kernels on the same buffers); ``v`` and ``o`` are saved so that an in-place change of either before the backward
    is an error, as for the ops, and the residuals are dropped after a backward without ``retain_graph``. The
    dispatcher's custom-op layer and the residuals' round trip cost more host time per forward+backward than the CuPy
    call itself (docs/experiments.md, E-ADAPT-HOST)."""

    @staticmethod
    def forward(ctx, q, k, v, causal, sm_scale, layout, config, window_left=-1, window_right=-1, cu_seqlens_q=None,
                cu_seqlens_k=None, max_seqlen_q=-1, max_seqlen_k=-1):
        device = q.device
        with on_torch_stream(device):
            o, lse, res, key = _int8_forward(device, q, k, v, causal, sm_scale, layout, config, window_left,
                                             window_right, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
            o, lse = _raw_as_torch(o, q.dtype), _as_torch(lse)
        ctx.res, ctx.device, ctx.key = res, device, key
        ctx.set_materialize_grads(False)  # no zero gradient built for the LSE, which takes none
        ctx.save_for_backward(v, o)
        ctx.mark_non_differentiable(lse)  # the backward kernels take dO only
        return o, lse

    @staticmethod
    @torch.autograd.function.once_differentiable  # (the backward kernels have no derivative: an error, not zeros)
    def backward(ctx, do, _lse_grad):
        ctx.saved_tensors  # noqa: B018 -- raises if v or o was modified in place, or the graph was freed
        if do is None:
            release_unless_retained(ctx, "res")
            return (None,) * 13
        return _int8_backward(ctx, do) + (None,) * 10


@_custom_op("sagecupy::qat_attention_fwd")
def _qat_fwd_op(q: Tensor, k: Tensor, v: Tensor, causal: bool, sm_scale: typing.Optional[float], layout: str,
                config: str) -> tuple[Tensor, Tensor]:
    """FP4 QAT forward: (o, lse) (the residuals are recomputed by the backward op)."""
    mod = _family("qat")
    device = _check_inputs(("q", q), ("k", k), ("v", v))
    with on_torch_stream(device):
        o, lse, _ = mod.forward(_as_cupy(q, "q"), _as_cupy(k, "k"), _as_cupy(v, "v"), causal=causal, sm_scale=sm_scale,
                                layout=layout, config=_decode_config(config), return_lse=True)
        # the fake below promises contiguous outputs (a no-op if they already are)
        return _as_torch(o).contiguous(), _as_torch(lse).contiguous()


@_qat_fwd_op.register_fake
def _qat_fwd_fake(q, k, v, causal, sm_scale, layout, config):
    return q.new_empty(q.shape), q.new_empty(_lse_shape(q.shape, layout), dtype=torch.float32)


@_custom_op("sagecupy::qat_attention_bwd")
def _qat_bwd_op(do: Tensor, q: Tensor, k: Tensor, v: Tensor, causal: bool, sm_scale: typing.Optional[float],
                layout: str, config: str) -> tuple[Tensor, Tensor, Tensor]:
    """FP4 QAT backward: reruns the (deterministic) forward for its residuals, then the backward."""
    mod = _family("qat")
    device = _check_inputs(("do", do), ("q", q), ("k", k), ("v", v))
    with on_torch_stream(device):
        _, res = mod.forward(_as_cupy(q, "q"), _as_cupy(k, "k"), _as_cupy(v, "v"), causal=causal, sm_scale=sm_scale,
                             layout=layout, config=_decode_config(config))
        grads = mod.backward(res, _as_cupy(do, "do"))
        return tuple(_as_torch(g).contiguous() for g in grads)


@_qat_bwd_op.register_fake
def _qat_bwd_fake(do, q, k, v, causal, sm_scale, layout, config):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _qat_setup_context(ctx, inputs, output):
    q, k, v, causal, sm_scale, layout, config = inputs
    ctx.mark_non_differentiable(output[1])  # the LSE: the backward takes dO only
    ctx.save_for_backward(q, k, v)
    ctx.options = (causal, sm_scale, layout, config)


def _qat_backward(ctx, do, _lse_grad):
    q, k, v = ctx.saved_tensors
    dq, dk, dv = torch.ops.sagecupy.qat_attention_bwd(do.contiguous(), q, k, v, *ctx.options)
    return dq, dk, dv, None, None, None, None


_qat_fwd_op.register_autograd(_qat_backward, setup_context=_qat_setup_context)


@_custom_op("sagecupy::nvfp4_attention")
def _nvfp4_op(q: Tensor, k: Tensor, v: Tensor, causal: bool, sm_scale: typing.Optional[float], layout: str,
              config: str) -> tuple[Tensor, Tensor]:
    """NVFP4 attention forward (:func:`sagecupy.nvfp4.attention`, inference only): (o, lse)."""
    from .. import nvfp4

    device = _check_inputs(("q", q), ("k", k), ("v", v))
    with on_torch_stream(device):
        o, lse = nvfp4.attention(_as_cupy(q, "q"), _as_cupy(k, "k"), _as_cupy(v, "v"), causal=causal, sm_scale=sm_scale,
                                 layout=layout, config=_decode_config(config), return_lse=True)
        # the fake below promises contiguous outputs (a no-op if they already are)
        return _as_torch(o).contiguous(), _as_torch(lse).contiguous()


@_nvfp4_op.register_fake
def _nvfp4_fake(q, k, v, causal, sm_scale, layout, config):
    return q.new_empty(q.shape), q.new_empty(_lse_shape(q.shape, layout), dtype=torch.float32)


def _nvfp4_backward(ctx, *grads):
    # nvfp4_attention refuses calls that need a gradient; this is what a direct torch.ops call gets.
    raise RuntimeError("sagecupy::nvfp4_attention is inference-only (NVFP4 has no backward): run it under "
                       "torch.no_grad(), or train with sagecupy.torch.sage_attention or qat_attention")


def _nvfp4_setup_context(ctx, inputs, output):
    pass


_nvfp4_op.register_autograd(_nvfp4_backward, setup_context=_nvfp4_setup_context)
