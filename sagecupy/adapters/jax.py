"""JAX adapter: sagecupy's attention kernels as ``jax.custom_vjp`` functions that run inside ``jax.jit``.

    import os
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")   # before JAX touches the GPU, see below
    import jax, jax.numpy as jnp
    from sagecupy.jax import sage_attention

    def loss(q, k, v):                       # q (B, Hq, Nq, D), k/v (B, Hkv, Nk, D): float16 or bfloat16
        return sage_attention(q, k, v, causal=True).astype(jnp.float32).sum()

    dq, dk, dv = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)

``sage_attention`` is INT8 SageBwd (:mod:`sagecupy.int8`), ``qat_attention`` FP4 QAT (:mod:`sagecupy.qat`),
``nvfp4_attention`` NVFP4 attention (:mod:`sagecupy.nvfp4`, inference only: differentiating it raises).
Both take the keyword arguments of the CuPy API (``causal``, ``sm_scale``, ``layout``, ``config``; INT8 also
the sliding ``window=(left, right)``, ``return_lse`` and packed variable-length sequences) and work eagerly and
under ``jax.jit``, ``jax.grad`` and ``jax.vjp``.

Packed sequences (INT8, FlashAttention's varlen convention)::

    # q (total_q, Hq, D), k/v (total_k, Hkv, D); cu (S + 1,) int32 prefix sums of the document lengths
    o = sage_attention(q, k, v, layout="THD", cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=512,
                       max_seqlen_k=512, causal=True)

The offsets are (non-differentiable) array arguments, traced like q, k, v and never read on the host; the layout and
``max_seqlen_q/k`` (Python ints or None, as FlashAttention takes them) are static like ``causal``.

How the kernels run
-------------------
Through ``jax.experimental.buffer_callback`` (JAX 0.7 or newer; :func:`is_available` says whether this
JAX has it): XLA calls a Python function in the middle of its executable with the CUDA stream it
computes on (``ExecutionContext.stream``) and its own device buffers (``Buffer``, with
``__cuda_array_interface__``). The function wraps the stream as a CuPy stream (``Stream.from_external``), views the
buffers as CuPy arrays (zero-copy) and runs the sagecupy kernels on that stream; INT8's attention kernels write
O and the gradients into the output buffers XLA allocated, and the other results are copied into theirs on the
same stream. The kernels are therefore ordered after whatever
produced q, k, v and before whatever reads the outputs, with no synchronization.

* **Memory.** CuPy allocates its temporaries from its own pool, beside XLA's allocator. JAX takes 75% of
  the GPU at start-up unless ``XLA_PYTHON_CLIENT_PREALLOCATE=false`` (or a smaller
  ``XLA_PYTHON_CLIENT_MEM_FRACTION``) is in the environment before JAX initializes its GPU backend.
* **bfloat16.** bf16 arrays cross into the callback as their uint16 bits (``jax.lax.bitcast_convert_type``, free)
  and become a CuPy ``ml_dtypes.bfloat16`` view of them there where CuPy has that dtype, else a
  :class:`~sagecupy.adapters.bf16.BF16Array`.
* **Residuals.** INT8: the forward callback also writes every array of :class:`sagecupy.int8.Residuals`
  (Q and K codes and scales, base-2 LSE, K mean; packed sequences' table of offsets) into XLA outputs, which become
  the ``custom_vjp`` residuals with ``v``, ``o`` and the offsets; the backward callback rebuilds the same
  ``Residuals`` from them. The
  backward kernels read the very bytes a direct ``sagecupy.int8.backward(sagecupy.int8.forward(...))``
  reads, so the gradients are bitwise those of the direct calls (the backward kernels use no atomics).
  Outside differentiation (a plain call, also under ``jax.jit``) the callback runs
  :func:`sagecupy.int8.sage_attention` instead, which keeps no residuals (its o is bitwise the forward's).
  FP4 QAT: q, k, v are the residuals and the backward
  callback reruns ``sagecupy.qat.forward`` (deterministic) before ``sagecupy.qat.backward``.

Limits: one device (no sharding rule), no ``jax.vmap`` (the kernels batch over B and heads already),
reverse mode only (``custom_vjp``), CUDA devices only. Importing :mod:`sagecupy` never imports JAX;
importing this module does.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import math

try:
    import jax
    import jax.numpy as jnp
except ImportError as _exc:  # pragma: no cover - depends on the environment
    raise ImportError("sagecupy.jax needs JAX with its CUDA plugin, e.g. pip install 'jax[cuda13]' "
                      f"({_exc})") from _exc
import numpy as np

from .. import _checks, _layout, _varlen, int8
from .._program import Plans, env_key
from ..config import SageBwdConfig, get_config
from .jax_cp import context_parallel_attention, shard_sequence, unshard_sequence

__all__ = ["sage_attention", "qat_attention", "nvfp4_attention", "is_available", "context_parallel_attention",
           "shard_sequence", "unshard_sequence"]

_KDL_CUDA = 2  # DLPack DLDeviceType of CUDA device memory
_NO_BUFFER_CALLBACK = (
    "sagecupy.jax runs the CuPy kernels on XLA's stream through jax.experimental.buffer_callback, which the "
    "installed JAX {version} does not have ({why}); install JAX 0.7 or newer (pip install -U 'jax[cuda13]')")


# --------------------------------------------------------------------------------------------------
# feature detection
# --------------------------------------------------------------------------------------------------


def _buffer_callback():
    """``jax.experimental.buffer_callback.buffer_callback``, or the one error this module raises without it."""
    try:
        from jax.experimental.buffer_callback import buffer_callback
    except ImportError as exc:
        raise RuntimeError(_NO_BUFFER_CALLBACK.format(version=jax.__version__, why=exc)) from None
    return buffer_callback


def is_available() -> tuple[bool, str]:
    """(True, "") when the adapter can run here (JAX with ``buffer_callback`` and a GPU backend, CuPy with a
    device), else (False, why). Never raises."""
    from .._loader import gpu_status

    try:
        _buffer_callback()
    except RuntimeError as exc:
        return False, str(exc)
    try:
        gpus = jax.devices("gpu")
    except Exception as exc:  # RuntimeError without a GPU backend; anything else is as fatal here
        return False, f"JAX has no GPU backend ({exc}); install the CUDA plugin, e.g. pip install 'jax[cuda13]'"
    if not gpus:
        return False, "JAX lists no GPU device"
    ok, why = gpu_status()
    return (True, "") if ok else (False, f"the CuPy side cannot run: {why}")


# --------------------------------------------------------------------------------------------------
# inside the callback: XLA buffers and stream as CuPy objects
# --------------------------------------------------------------------------------------------------


def _stream_ptr(ctx) -> int:
    """The ``cudaStream_t`` XLA runs this callback's work on (a property; a method in early versions)."""
    stream = ctx.stream
    return int(stream() if callable(stream) else stream)


@contextlib.contextmanager
def _on_xla_stream(ctx, buf):
    """Make ``buf``'s device and XLA's stream CuPy's current device and stream; yields the device id."""
    import cupy

    dev_type, dev = (int(x) for x in buf.__dlpack_device__())
    if dev_type != _KDL_CUDA:
        raise RuntimeError(f"sagecupy.jax runs CUDA kernels, but this computation runs on DLPack device type "
                           f"{dev_type}, not CUDA ({_KDL_CUDA}); put the arrays on a GPU (is JAX on its CPU "
                           f"backend?)")
    with cupy.cuda.Device(dev), _checks.external_stream(_stream_ptr(ctx), dev):
        yield dev


def _ptr(buf) -> int:
    """An XLA buffer's device address."""
    return int(buf.__cuda_array_interface__["data"][0])


def _view(buf, dev):
    """A CuPy array over an XLA buffer's memory (zero-copy, C order; valid during the callback only)."""
    import cupy

    shape = tuple(int(s) for s in buf.shape)
    dtype = np.dtype(buf.dtype)
    ptr = _ptr(buf)
    mem = cupy.cuda.UnownedMemory(ptr, dtype.itemsize * math.prod(shape), buf, dev)
    return cupy.ndarray(shape, dtype, cupy.cuda.MemoryPointer(mem, 0))


def _kernel_input(arr, dtype: str):
    """What the sagecupy API takes for ``dtype``: the CuPy array, or for bfloat16 its uint16 bits as a CuPy
    bfloat16 view where CuPy has that dtype, else as a BF16Array (no copy either way)."""
    if dtype == "bfloat16":
        from .bf16 import from_bits

        return from_bits(arr)
    return arr


def _write(buf, src, name, dev):
    """Copy a kernel result (raw CuPy array) into the XLA output buffer ``buf``, on the current stream: one
    device-to-device copy for a C-contiguous result (the residuals, the LSE), with no element-wise kernel to
    dispatch; an element-wise copy otherwise."""
    import cupy

    shape, dtype = tuple(int(s) for s in buf.shape), np.dtype(buf.dtype)
    if shape != src.shape or dtype != src.dtype:
        raise RuntimeError(f"sagecupy.jax: {name}: the kernels returned {src.dtype} {tuple(src.shape)} but XLA "
                           f"expects {dtype} {shape}")
    if not src.flags.c_contiguous:
        _view(buf, dev)[...] = src
    elif src.nbytes:
        rt = cupy.cuda.runtime
        rt.memcpyAsync(_ptr(buf), src.data.ptr, src.nbytes, rt.memcpyDeviceToDevice, cupy.cuda.get_current_stream().ptr)


# --------------------------------------------------------------------------------------------------
# outside the callback: JAX arrays
# --------------------------------------------------------------------------------------------------


def _bits(x):
    """bfloat16 as its uint16 bits (the callback's buffers are read as uint16 whatever CuPy has); other dtypes
    unchanged."""
    return jax.lax.bitcast_convert_type(x, jnp.uint16) if x.dtype == jnp.bfloat16 else x


def _unbits(x, dtype):
    return jax.lax.bitcast_convert_type(x, jnp.bfloat16) if dtype == jnp.bfloat16 else x


def _exchange_dtype(p: _checks.Problem):
    """dtype of q/k/v/o/gradients inside the callback."""
    return np.dtype(np.uint16) if p.dtype == "bfloat16" else np.dtype(np.float16)


def _problem(q, k, v, causal, sm_scale, layout, window=None) -> _checks.Problem:
    """Validate at trace time (shapes, dtypes, layout, GQA, window): errors name the argument, as in the CuPy API."""
    return _checks.check_attention_args(q, k, v, causal=causal, sm_scale=sm_scale, layout=layout, window=window)


def _hashable(name, value, supported):
    try:
        hash(value)
    except TypeError:
        raise TypeError(f"{name}={value!r} is not supported; supported: {supported}") from None
    return value


# --------------------------------------------------------------------------------------------------
# INT8 SageBwd
# --------------------------------------------------------------------------------------------------

#: int8.Residuals fields the forward callback hands to JAX as arrays (those a call does not have stay out of its
#: specs and must be None: mu_k without K-smoothing, packed for the dense layouts), and those rebuilt from the call.
_INT8_SAVED = ("q_codes", "q_scale", "k_codes", "k_scale", "lse2", "mu_k", "packed")
_INT8_FROM_CALL = ("problem", "config", "v", "o")


def _int8_residual_specs(p: _checks.Problem, cfg: SageBwdConfig) -> dict:
    """name -> (shape, dtype) of the arrays :func:`sagecupy.int8.forward` keeps in its Residuals (known at
    trace time: XLA allocates them). Checked against the real arrays at run time (:func:`_int8_saved`). Packed
    sequences: the buffers in the packed padded layout and the table of offsets, sized from the shapes alone
    (sagecupy/_varlen.py)."""
    B, Hq, Hkv, D = p.batch, p.heads_q, p.heads_kv, p.head_dim
    if p.layout == _layout.PACKED:
        tq_pad, tk_pad, _, _, _ = _checks.packed_bounds(p.batch, p.nq, p.nk)
        i8, f32 = np.dtype(np.int8), np.dtype(np.float32)
        specs = {"q_codes": ((Hq * tq_pad, D), i8), "q_scale": ((Hq * tq_pad,), f32),
                 "k_codes": ((Hkv * tk_pad, D), i8), "k_scale": ((Hkv * tk_pad,), f32), "lse2": ((Hq * tq_pad,), f32),
                 "packed": ((_varlen.meta_size(p),), np.dtype(np.int32))}
        if cfg.k_smoothing:
            specs["mu_k"] = ((B, Hkv, D), f32)  # (S, Hkv, D): per sequence
        return specs
    nq_pad, nk_pad = _layout.roundup(p.nq, int8._FWD_BQ), _layout.roundup(p.nk, int8._FWD_BKV)
    specs = {
        "q_codes": ((B, Hq, nq_pad, D), np.dtype(np.int8)),
        "q_scale": ((B, Hq, nq_pad), np.dtype(np.float32)),
        "k_codes": ((B, Hkv, nk_pad, D), np.dtype(np.int8)),
        "k_scale": ((B, Hkv, nk_pad), np.dtype(np.float32)),
        "lse2": ((B, Hq, nq_pad), np.dtype(np.float32)),
    }
    if cfg.k_smoothing:
        specs["mu_k"] = ((B, Hkv, D), np.dtype(np.float32))
    return specs


def _int8_saved(res, p, cfg) -> dict:
    """The arrays of ``res`` to save, after checking that they are what :func:`_int8_residual_specs` told
    XLA (a changed ``int8.Residuals`` fails here, loudly, instead of giving wrong gradients)."""
    fields = {f.name for f in dataclasses.fields(res)}
    carried = set(_INT8_SAVED + _INT8_FROM_CALL)
    if not carried <= fields:
        raise RuntimeError(f"sagecupy.int8.Residuals has the fields {sorted(fields)}, the JAX adapter carries "
                           f"{sorted(carried)}: update sagecupy/adapters/jax.py with int8.py")
    # A field the adapter does not carry is left at its default (None) when the backward rebuilds the Residuals:
    # only a call that leaves it None may pass.
    for name in sorted(fields - carried):
        if getattr(res, name) is not None:
            raise RuntimeError(f"sagecupy.jax: int8.Residuals.{name} is set but the adapter does not carry it: "
                               f"update sagecupy/adapters/jax.py with int8.py")
    specs = _int8_residual_specs(p, cfg)
    saved = {}
    for name in _INT8_SAVED:
        arr = getattr(res, name)
        if name not in specs:
            if arr is not None:
                raise RuntimeError(f"sagecupy.jax: int8.Residuals.{name} is set but the adapter did not expect it")
            continue
        shape, dtype = specs[name]
        if arr is None or tuple(arr.shape) != shape or arr.dtype != dtype:
            got = "None" if arr is None else f"{arr.dtype} {tuple(arr.shape)}"
            raise RuntimeError(f"sagecupy.jax: int8.Residuals.{name} is {got}, the adapter expected {dtype} {shape}: "
                               f"update _int8_residual_specs with int8.py")
        saved[name] = arr
    return saved


@functools.lru_cache(maxsize=None)
def _int8_forward_callback(p: _checks.Problem, cfg: SageBwdConfig, keep: bool, lse: bool = False,
                           max_seqlen=None):
    """The buffer_callback body of the forward: ``out`` holds ``o``, with ``lse`` the LSE, and with ``keep`` the
    residual arrays. Packed sequences (``p.layout == "THD"``): the offsets follow q, k, v (device arrays, read by the
    kernels only), ``max_seqlen`` is ``(max_seqlen_q, max_seqlen_k)``. Cached per problem so that eager calls reuse
    one compiled XLA program."""

    # The forward's plans by what can still differ between calls of this problem: the device, the 16-byte alignment
    # of the buffers' addresses and the kernel-choosing environment (env_key); the rest of int8's own lookup key
    # (shapes, dtypes, strides, options) is this callback's problem and config. A hit replays the plan on the buffers'
    # addresses, without CuPy views of q, k, v or the lookup (docs/experiments.md, E-ADAPT-TRAIN). Dense layouts only.
    plans = Plans(cap=16)
    replayable = p.layout != _layout.PACKED and p.batch * p.nq * p.nk > 0

    def callback(ctx, out, q, k, v, *offsets):
        with _on_xla_stream(ctx, q) as dev:
            o_buf = _view(out["o"], dev)
            plan = None
            if replayable:
                ptrs = tuple(_ptr(b) for b in (q, k, v))
                key = (ptrs[0] & 15, ptrs[1] & 15, ptrs[2] & 15, env_key())
                plan = plans.get(key)
            if plan is not None:
                # (with keep, the residuals' v is an address: the backward rebuilds v from its own buffer)
                _, lse_arr, *res = (int8._training if keep else int8._inference)(*ptrs, plan, o_out=o_buf)
                saved = {n: getattr(res[0], n) for n in out if n not in ("o", "lse")} if keep else {}
            else:
                qc, kc, vc = (_kernel_input(_view(b, dev), p.dtype) for b in (q, k, v))
                kw = dict(causal=p.causal, sm_scale=p.sm_scale, layout=p.layout, config=cfg, window=p.window)
                if offsets:
                    kw.update(cu_seqlens_q=_view(offsets[0], dev), cu_seqlens_k=_view(offsets[1], dev),
                              max_seqlen_q=max_seqlen[0], max_seqlen_k=max_seqlen[1])
                # The kernel writes O into XLA's buffer. Outside a vjp (keep False) this is the inference forward (no
                # residuals; o bitwise int8.forward's).
                if replayable:
                    _, lse_arr, *res = (int8._training if keep else int8._inference)(qc, kc, vc, o_out=o_buf, **kw)
                    if not any(res[-1].copy):  # (the pre-pass copies an input it cannot read as it is: not replayed)
                        plans.put(key, res[-1])
                else:
                    _, lse_arr, *res = int8._forward_into(o_buf, qc, kc, vc, inference=not keep, **kw)
                saved = _int8_saved(res[0], p, cfg) if keep else {}
            for name, arr in saved.items():
                _write(out[name], arr, name, dev)
            if lse:
                _write(out["lse"], lse_arr, "lse", dev)

    return callback


@functools.lru_cache(maxsize=None)
def _int8_backward_callback(p: _checks.Problem, cfg: SageBwdConfig):
    """The buffer_callback body of the backward: rebuild the forward's Residuals, run int8.backward."""

    def callback(ctx, out, saved, v, o, do):
        with _on_xla_stream(ctx, do) as dev:
            arrays = {name: _view(buf, dev) for name, buf in saved.items()}
            arrays.setdefault("mu_k", None)
            arrays.setdefault("packed", None)  # (the dense layouts; int8.backward checks a packed call's table)
            # int8.forward keeps `_layout.prepare(v)` (a view of the caller's V, or an aligned copy) and its raw O.
            res = int8.Residuals(problem=p, config=cfg, v=_layout.prepare(_view(v, dev), "v", p.layout, True),
                                 o=_view(o, dev), **arrays)
            # the kernels write dQ, dK, dV into XLA's buffers
            int8._backward_into(tuple(_view(b, dev) for b in out), res, _kernel_input(_view(do, dev), p.dtype))

    return callback


def _lse_shape(p: _checks.Problem):
    """The forward's LSE: ``(B, Hq, Nq)``; packed sequences ``(Hq, total_q)``."""
    return (p.heads_q, p.nq) if p.layout == _layout.PACKED else (p.batch, p.heads_q, p.nq)


@functools.lru_cache(maxsize=None)
def _int8_op(causal, sm_scale, layout, config, window=None, return_lse=False, max_seqlen=None):
    """The custom_vjp function for one set of keyword arguments (cached: one object per set). They are static: the
    closure holds them (``window``: None or the tuple of Python ints :func:`_window` made; ``max_seqlen``: packed
    sequences' ``(max_seqlen_q, max_seqlen_k)``), the differentiated arguments are q, k, v alone, and the backward
    rebuilds the forward's Problem, window included, from them. ``offsets``: ``()``, or packed sequences' device
    offsets ``(cu_seqlens_q, cu_seqlens_k)``, inputs of both callbacks' problems and of the forward callback, saved
    with the residuals and given no cotangent. ``return_lse``: the op returns ``(o, lse)``; the LSE's cotangent is
    ignored (:func:`sage_attention` stops its gradient)."""
    cfg = get_config(config)
    why = int8._unsupported_config(cfg)
    if why:
        raise ValueError(f"config: {why}")

    def problem(q, k, v, offsets):
        if offsets:
            return _packed_problem(q, k, v, *offsets, causal, sm_scale, window)
        return _problem(q, k, v, causal, sm_scale, layout, window)

    def forward_call(q, k, v, offsets, keep):
        p = problem(q, k, v, offsets)
        ex = _exchange_dtype(p)
        specs = {"o": jax.ShapeDtypeStruct(q.shape, ex)}
        if return_lse:
            specs["lse"] = jax.ShapeDtypeStruct(_lse_shape(p), np.dtype(np.float32))
        if keep:
            specs.update({n: jax.ShapeDtypeStruct(s, d) for n, (s, d) in _int8_residual_specs(p, cfg).items()})
        callback = _int8_forward_callback(p, cfg, keep, return_lse, max_seqlen)
        out = _buffer_callback()(callback, specs)(_bits(q), _bits(k), _bits(v), *offsets)
        o = _unbits(out.pop("o"), q.dtype)
        result = (o, out.pop("lse")) if return_lse else o
        return result, o, out

    @jax.custom_vjp
    def op(q, k, v, offsets):
        return forward_call(q, k, v, offsets, False)[0]

    def op_fwd(q, k, v, offsets):
        result, o, saved = forward_call(q, k, v, offsets, True)
        return result, (saved, v, o, offsets)

    def op_bwd(residuals, ct):
        saved, v, o, offsets = residuals
        do = ct[0] if return_lse else ct
        # o has q's shape and dtype and v has k's: the forward's Problem, rebuilt without q and k.
        p = problem(o, v, v, offsets)
        ex = _exchange_dtype(p)
        specs = (jax.ShapeDtypeStruct(o.shape, ex), jax.ShapeDtypeStruct(v.shape, ex),
                 jax.ShapeDtypeStruct(v.shape, ex))
        dq, dk, dv = _buffer_callback()(_int8_backward_callback(p, cfg), specs)(
            saved, _bits(v), _bits(o), _bits(do.astype(o.dtype)))
        # the offsets are integers: no cotangent (None is JAX's zero)
        return (*(_unbits(g, o.dtype) for g in (dq, dk, dv)), tuple(None for _ in offsets))

    op.defvjp(op_fwd, op_bwd)
    return op


def _window(window, causal):
    """``window`` as :func:`_int8_op` caches it: None, or the tuple of Python ints that the CuPy API makes of it
    (validated here, before the cache: ``(5.0, 0)`` equals ``(5, 0)`` as a key and would find the op built for it).
    ValueError naming ``window`` (and ``causal`` where they contradict), as :func:`sagecupy.int8.forward` raises."""
    if window is None:
        return None
    return _checks.check_window(window, causal)  # (causal: already checked by the caller)


_PACKED_ARGS = ("cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k")


def _offsets(layout, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k):
    """Packed sequences' arguments as :func:`_int8_op` takes them: ``((cu_seqlens_q, cu_seqlens_k), (max_seqlen_q,
    max_seqlen_k))`` for ``layout="THD"``, ``((), None)`` for a dense layout (which is refused any of them, naming
    it). The offsets: 1-D int32 JAX arrays (traced or not; their values are not read) of ``S + 1 >= 2`` entries, one
    length for both, or NumPy integer arrays, whose values are checked in full at trace time as the CuPy API checks
    host offsets (then passed as int32 constants). The maxima: None or non-negative Python ints (static; a cache key,
    so ``5.0`` is refused rather than taken for ``5``). TypeError/ValueError naming the argument."""
    values = (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    if not (isinstance(layout, str) and layout == _layout.PACKED):
        for name, value in zip(_PACKED_ARGS, values):
            if value is not None:
                raise ValueError(f"{name} is only for layout='THD' (packed sequences), got layout={layout!r}")
        return (), None
    offsets = []
    for name, cu in zip(_PACKED_ARGS[:2], values[:2]):
        if cu is None:
            raise ValueError(f"{name} is required with layout='THD' (int32 prefix sums of the sequence lengths, "
                             f"S + 1 offsets)")
        if isinstance(cu, np.ndarray):
            if cu.dtype.kind not in "iu" or cu.ndim != 1:
                raise ValueError(f"{name} must be a 1-D integer array (int32 prefix sums), got dtype {cu.dtype} and "
                                 f"shape {cu.shape}")
        elif not isinstance(cu, jax.Array):
            raise TypeError(f"{name} must be a JAX int32 array (or a NumPy integer array), got {type(cu).__name__}")
        elif cu.dtype != jnp.int32:
            raise TypeError(f"{name}.dtype={cu.dtype} must be int32 (a device array is read as it is)")
        elif cu.ndim != 1:
            raise ValueError(f"{name} must be 1-D (S + 1 offsets), got shape {tuple(cu.shape)}")
        if cu.shape[0] < 2:
            raise ValueError(f"{name} must hold S + 1 >= 2 offsets, got {cu.shape[0]}")
        offsets.append(cu)
    if offsets[0].shape[0] != offsets[1].shape[0]:
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must have the same length (S + 1), got "
                         f"{offsets[0].shape[0]} and {offsets[1].shape[0]}")
    maxima = []
    for name, m in zip(_PACKED_ARGS[2:], values[2:]):
        if m is not None and (isinstance(m, (bool, np.bool_)) or not isinstance(m, (int, np.integer)) or m < 0):
            raise ValueError(f"{name}={m!r} must be a non-negative Python int (static, as FlashAttention takes it) "
                             f"or None")
        maxima.append(None if m is None else int(m))
    return tuple(offsets), tuple(maxima)


def _host_offsets(offsets, q, k, max_seqlen):
    """NumPy offsets checked against q's and k's totals (and the maxima) as the CuPy API checks host offsets, then as
    int32 JAX arrays; device offsets as they are."""
    if not any(isinstance(cu, np.ndarray) for cu in offsets):
        return offsets
    if not all(isinstance(cu, np.ndarray) for cu in offsets):
        raise TypeError("cu_seqlens_q and cu_seqlens_k must both be JAX arrays or both NumPy arrays")
    from ..reference.attention import check_cu_seqlens

    if len(q.shape) == 3 and len(k.shape) == 3:  # (other shapes: _packed_problem names the argument)
        check_cu_seqlens(*offsets, q.shape[0], k.shape[0], *max_seqlen)
    return tuple(jnp.asarray(cu.astype(np.int32)) for cu in offsets)


def _packed_problem(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, sm_scale, window) -> _checks.Problem:
    """Validate a packed call at trace time: the Problem :func:`sagecupy._varlen.check_args` makes (S sequences,
    the totals). The offsets' values are on the device (and traced): what their metadata shows was checked by
    :func:`_offsets`; here a host stand-in of the same length and totals lets ``check_args`` check all the rest (shapes,
    dtypes, GQA, head dim, the kernels' limits, ``sm_scale``, ``window``) as the CuPy API does."""
    n = int(cu_seqlens_q.shape[0])
    for name, x in (("q", q), ("k", k), ("v", v)):
        if len(x.shape) != 3:
            raise ValueError(f"{name} must be 3-D (total, H, D) for layout='THD', got shape {tuple(x.shape)}")
    stand_in_q = np.array([0] * (n - 1) + [q.shape[0]], np.int64)
    stand_in_k = np.array([0] * (n - 1) + [k.shape[0]], np.int64)
    return _varlen.check_args(q, k, v, causal=causal, sm_scale=sm_scale, layout=_layout.PACKED, window=window,
                              cu_seqlens_q=stand_in_q, cu_seqlens_k=stand_in_k, max_seqlen_q=None, max_seqlen_k=None)


def sage_attention(q, k, v, *, causal=False, sm_scale=None, layout="HND", config=None, window=None,
                   return_lse=False, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None):
    """INT8 SageBwd attention (:mod:`sagecupy.int8`) as a differentiable JAX function.

    q: ``(B, Hq, Nq, D)`` (``layout="HND"``) or ``(B, Nq, Hq, D)`` (``"NHD"``); k, v: the same with Hkv, Nk.
    float16 or bfloat16, D 64 or 128, ``Hq % Hkv == 0``; ``causal`` is bottom-right aligned; ``sm_scale``
    (a Python float) defaults to ``1/sqrt(D)``; ``config``: ``None``/``"default"``, ``"paper"`` or a
    :class:`~sagecupy.config.SageBwdConfig`. ``window=(left, right)`` (Python ints, static like ``causal``): the
    sliding window of :func:`sagecupy.int8.forward`, row ``i`` seeing key ``j`` iff ``i + Nk - Nq - left <= j <=
    i + Nk - Nq + right`` (-1: unbounded; ``causal=True`` is ``(-1, 0)``). Returns o with q's shape and dtype;
    ``return_lse=True``: ``(o, lse)``, lse float32 ``(B, Hq, Nq)``, natural log, without gradient.
    ``jax.grad`` gives the gradients of :func:`sagecupy.int8.backward`, bit for bit (see the module docstring).

    Packed variable-length sequences (FlashAttention's varlen convention): ``layout="THD"``, q ``(total_q, Hq, D)``,
    k, v ``(total_k, Hkv, D)``, ``cu_seqlens_q/k`` the ``S + 1`` int32 prefix sums of the lengths (JAX arrays, never
    read on the host, and without gradient; NumPy arrays are checked in full), ``max_seqlen_q/k`` Python ints or
    None. ``causal`` and ``window`` apply within each sequence, each sequence's quantization statistics are its own;
    the LSE is ``(Hq, total_q)``. The dense layouts take none of these four arguments (ValueError naming it).
    """
    _buffer_callback()
    # causal is checked before it keys the cached op: 0 == False as a key, so an int would find (or leave behind)
    # the op built for a bool, and the trace-time check inside it would then refuse a later valid call
    causal = _checks.check_causal(causal)
    layout = _hashable("layout", layout, "'HND', 'NHD', 'THD'")
    config = _hashable("config", config, "None, 'default', 'paper' or a SageBwdConfig")
    if not isinstance(return_lse, (bool, np.bool_)):
        raise TypeError(f"return_lse must be a bool, got {return_lse!r}")
    offsets, max_seqlen = _offsets(layout, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    offsets = _host_offsets(offsets, q, k, max_seqlen)
    # The maxima are checked (above, and against NumPy offsets); the kernels do not read them, so they stay out of the
    # op's and the callback's caches: a training loop whose longest document changes every step reuses one program.
    max_seqlen = (None, None) if offsets else None
    out = _int8_op(causal, _checks.scale_arg(sm_scale), layout, config, _window(window, causal),
                   bool(return_lse), max_seqlen)(q, k, v, offsets)
    if return_lse:
        o, lse = out
        return o, jax.lax.stop_gradient(lse)  # the backward kernels take dO only
    return out


# --------------------------------------------------------------------------------------------------
# FP4 QAT
# --------------------------------------------------------------------------------------------------


def _qat():
    """:mod:`sagecupy.qat` with its forward/backward pair, or an ImportError that says what is missing."""
    from . import qat_module

    return qat_module("qat_attention")


@functools.lru_cache(maxsize=None)
def _qat_forward_callback(p: _checks.Problem, config):
    def callback(ctx, out, q, k, v):
        with _on_xla_stream(ctx, q) as dev:
            qc, kc, vc = (_kernel_input(_view(b, dev), p.dtype) for b in (q, k, v))
            o, _ = _qat().forward(qc, kc, vc, causal=p.causal, sm_scale=p.sm_scale, layout=p.layout, config=config)
            _write(out, _checks.raw(o), "o", dev)

    return callback


@functools.lru_cache(maxsize=None)
def _qat_backward_callback(p: _checks.Problem, config):
    """Rerun the (deterministic) QAT forward for its residuals, then the backward: the gradients are those
    of the direct calls on the same inputs, at the cost of one more forward."""

    def callback(ctx, out, q, k, v, do):
        with _on_xla_stream(ctx, do) as dev:
            qat = _qat()
            qc, kc, vc, doc = (_kernel_input(_view(b, dev), p.dtype) for b in (q, k, v, do))
            _, res = qat.forward(qc, kc, vc, causal=p.causal, sm_scale=p.sm_scale, layout=p.layout, config=config)
            for buf, g, name in zip(out, qat.backward(res, doc), ("dq", "dk", "dv")):
                _write(buf, _checks.raw(g), name, dev)

    return callback


def _dense_options(who, causal, layout):
    """``causal`` and ``layout`` of a family without packed sequences, checked (hashable; THD refused by name)."""
    if isinstance(layout, str) and layout == _layout.PACKED:
        raise ValueError(f"layout='THD' (packed variable-length sequences) is not supported by {who}: only "
                         f"sage_attention (INT8) takes packed sequences; {who} takes 'HND' or 'NHD'")
    # causal checked before it keys the cached op, as in sage_attention
    return _checks.check_causal(causal), _hashable("layout", layout, "'HND', 'NHD'")


@functools.lru_cache(maxsize=None)
def _qat_op(causal, sm_scale, layout, config):
    qat = _qat()  # the config checked here, before tracing, as _int8_op checks its own (not first in the callback)
    why = qat._unsupported_config(qat._get_config(config))
    if why:
        raise ValueError(f"config: {why}")

    def forward_call(q, k, v):
        p = _problem(q, k, v, causal, sm_scale, layout)
        spec = jax.ShapeDtypeStruct(q.shape, _exchange_dtype(p))
        o = _buffer_callback()(_qat_forward_callback(p, config), spec)(_bits(q), _bits(k), _bits(v))
        return _unbits(o, q.dtype)

    @jax.custom_vjp
    def op(q, k, v):
        return forward_call(q, k, v)

    def op_fwd(q, k, v):
        return forward_call(q, k, v), (q, k, v)

    def op_bwd(residuals, do):
        q, k, v = residuals
        p = _problem(q, k, v, causal, sm_scale, layout)
        ex = _exchange_dtype(p)
        specs = tuple(jax.ShapeDtypeStruct(x.shape, ex) for x in (q, k, v))
        grads = _buffer_callback()(_qat_backward_callback(p, config), specs)(
            _bits(q), _bits(k), _bits(v), _bits(do.astype(q.dtype)))
        return tuple(_unbits(g, q.dtype) for g in grads)

    op.defvjp(op_fwd, op_bwd)
    return op


def qat_attention(q, k, v, *, causal=False, sm_scale=None, layout="HND", config=None):
    """FP4 quantization-aware attention (:mod:`sagecupy.qat`) as a differentiable JAX function: NVFP4
    fake-quantized forward, straight-through backward. Same arguments and conventions as
    :func:`sage_attention`; ``config``: ``None`` or a :class:`~sagecupy.config.QATConfig`."""
    _buffer_callback()
    _qat()
    causal, layout = _dense_options("qat_attention", causal, layout)
    config = _hashable("config", config, "None or a QATConfig")
    return _qat_op(causal, _checks.scale_arg(sm_scale), layout, config)(q, k, v)


@functools.lru_cache(maxsize=None)
def _nvfp4_callback(p: _checks.Problem, config):
    def callback(ctx, out, q, k, v):
        from .. import nvfp4

        with _on_xla_stream(ctx, q) as dev:
            qc, kc, vc = (_kernel_input(_view(b, dev), p.dtype) for b in (q, k, v))
            o, lse = nvfp4.attention(qc, kc, vc, causal=p.causal, sm_scale=p.sm_scale, layout=p.layout, config=config,
                                     return_lse=True)
            _write(out["o"], _checks.raw(o), "o", dev)
            _write(out["lse"], lse, "lse", dev)

    return callback


@functools.lru_cache(maxsize=None)
def _nvfp4_op(causal, sm_scale, layout, config):
    """A custom_vjp whose backward refuses: NVFP4 has no backward, and a zero gradient (what stop_gradient would
    give) would silently train nothing. The config is checked here, before tracing, as :func:`_int8_op` checks its
    own."""
    from .. import nvfp4

    why = nvfp4._unsupported_config(nvfp4._get_config(config))
    if why:
        raise ValueError(f"config: {why}")

    def forward_call(q, k, v):
        p = _problem(q, k, v, causal, sm_scale, layout)
        specs = {"o": jax.ShapeDtypeStruct(q.shape, _exchange_dtype(p)),
                 "lse": jax.ShapeDtypeStruct(_lse_shape(p), np.dtype(np.float32))}
        out = _buffer_callback()(_nvfp4_callback(p, config), specs)(_bits(q), _bits(k), _bits(v))
        return _unbits(out["o"], q.dtype), out["lse"]

    @jax.custom_vjp
    def op(q, k, v):
        return forward_call(q, k, v)

    def op_fwd(q, k, v):
        return forward_call(q, k, v), None

    def op_bwd(_, ct):
        raise ValueError("nvfp4_attention is inference-only (NVFP4 has no backward) and was differentiated: train "
                         "with sage_attention or qat_attention")

    op.defvjp(op_fwd, op_bwd)
    return op


def nvfp4_attention(q, k, v, *, causal=False, sm_scale=None, layout="HND", config=None, return_lse=False):
    """NVFP4 attention (:func:`sagecupy.nvfp4.attention`) as a JAX function, eager or under ``jax.jit``: inference
    only (differentiating it raises ValueError). Arguments as :func:`sage_attention` for the dense layouts;
    ``config``: ``None`` or an :class:`~sagecupy.config.NVFP4Config`. Returns ``o`` (q's shape and dtype), or
    ``(o, lse)`` with ``return_lse`` (``(B, Hq, Nq)`` float32, natural log)."""
    _buffer_callback()
    causal, layout = _dense_options("nvfp4_attention", causal, layout)
    config = _hashable("config", config, "None or an NVFP4Config")
    if not isinstance(return_lse, bool):
        raise TypeError(f"return_lse must be a bool, got {return_lse!r}")
    o, lse = _nvfp4_op(causal, _checks.scale_arg(sm_scale), layout, config)(q, k, v)
    return (o, lse) if return_lse else o
