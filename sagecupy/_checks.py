"""Argument validation shared by every GPU family: arrays, dtypes, shapes, layouts, GQA.

Every failure is a ``TypeError`` (wrong kind of thing) or ``ValueError`` (right kind, unsupported
value) whose message names the argument, the value, and what is supported.
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import numpy as _np

__all__ = ["Problem", "as_cupy", "raw", "wrap", "check_attention_args", "check_problem", "check_limits",
           "check_sm_scale", "check_window", "check_dims", "check_buffer", "check_rows", "max_seq_len",
           "SUPPORTED_HEAD_DIMS", "dtype_name", "INT32_MAX", "PAD_MAX", "GRID_YZ_MAX", "BF16_FORMS",
           "check_packed_limits", "packed_bounds"]

SUPPORTED_HEAD_DIMS = (64, 128)
_LAYOUTS = ("HND", "NHD")

# ---------------------------------------------------------------------------------------------------------
# Limits of the kernels' index arithmetic (docs/design.md, "Limits"). The kernels hold a (batch, head) pair's base
# offset in 64 bits, but offsets *within* a head in 32-bit ints: e.g. `gK + (tile + 1) * BKV * D` (int8/fwd.cuh),
# `qq0 * D` and `k0 * D` (int8/int8_attn_bwd.cu), whose largest value is the padded length times D. A longer
# sequence would wrap those offsets and read or write outside the arrays, so the host refuses it first.

#: Largest value of a 32-bit signed index.
INT32_MAX = 2**31 - 1
#: The coarsest padding of a sequence length in any family (the INT8 forward's 128-row blocks, QAT's query rows).
PAD_MAX = 128
#: CUDA's largest grid extent along y and z. The grids are (blocks, heads, batch); the INT8 pre-pass launches
#: (blocks, Hq + 2 Hkv, B) (quant_qkv: Q, K and V heads in one grid) and (chunks, H, 2 B) (column_partial_kv).
GRID_YZ_MAX = 65535
#: Query rows per CTA in the smallest forward CTA: the causal dispatch order (common/rows.cuh query_block<G>)
#: computes a CTA's linear index, blocks x heads x batch, in a 32-bit int.
_MIN_CTA_ROWS = 64


def max_seq_len(head_dim: int) -> int:
    """The longest Nq or Nk the kernels take at ``head_dim``: the largest multiple of :data:`PAD_MAX` whose
    product with ``head_dim`` fits :data:`INT32_MAX` (16,777,088 at D = 128, 33,554,304 at D = 64)."""
    return INT32_MAX // max(int(head_dim), 1) // PAD_MAX * PAD_MAX


def _roundup(n, m):
    return (n + m - 1) // m * m


def check_limits(batch, heads_q, heads_kv, nq, nk, head_dim, *, what="", names=("Nq", "Nk")) -> None:
    """ValueError unless the kernels' 32-bit index arithmetic and grid extents hold every index of this problem
    (module comment above). ``what``: a prefix naming where the sizes came from (e.g. ``"residuals.problem: "``);
    ``names``: what the messages call the two lengths."""
    limit = max_seq_len(head_dim)
    for name, n in zip(names, (nq, nk)):
        if n > limit:
            raise ValueError(f"{what}{name}={n} exceeds the kernels' limit of {limit} at head_dim={head_dim}: the "
                             f"padded length ({PAD_MAX}-multiple) times head_dim must fit a 32-bit index "
                             f"(<= {INT32_MAX})")
    if 2 * batch > GRID_YZ_MAX:
        raise ValueError(f"{what}batch={batch} exceeds the kernels' limit of {GRID_YZ_MAX // 2} (a grid extent of "
                         f"2 * batch, at most {GRID_YZ_MAX})")
    if heads_q + 2 * heads_kv > GRID_YZ_MAX:
        raise ValueError(f"{what}heads: Hq + 2 * Hkv = {heads_q + 2 * heads_kv} exceeds the kernels' limit of "
                         f"{GRID_YZ_MAX} (a grid extent)")
    ctas = batch * heads_q * (_roundup(nq, PAD_MAX) // _MIN_CTA_ROWS)
    if ctas > INT32_MAX:
        raise ValueError(f"{what}batch * Hq * ceil(Nq / {PAD_MAX}) * {PAD_MAX // _MIN_CTA_ROWS} = {ctas} query blocks "
                         f"exceeds the kernels' limit of {INT32_MAX} (a CTA's 32-bit linear index)")


def packed_bounds(S: int, total_q: int, total_k: int) -> tuple:
    """Sizes a packed call's buffers and grids take without reading its offsets (the kernels' table,
    kernels_cu/int8/packed.cuh): padded q and k rows (every sequence padded to :data:`PAD_MAX`: at most
    total + (PAD_MAX - 1) S), their 64-row blocks, and the K/V column statistics' 256-token chunks
    (at most ceil(total_k / 256) + S). ``(tq_pad, tk_pad, nbq, nbk, nchk)``."""
    tq_pad = _roundup(total_q + (PAD_MAX - 1) * S, PAD_MAX)
    tk_pad = _roundup(total_k + (PAD_MAX - 1) * S, PAD_MAX)
    return tq_pad, tk_pad, tq_pad // 64, tk_pad // 64, -(-total_k // 256) + S


def check_packed_limits(S, heads_q, heads_kv, total_q, total_k, head_dim, *, what="") -> None:
    """:func:`check_limits` for packed sequences (``S`` of them, ``total_q``/``total_k`` rows): a sequence is at most
    its total long, the padded offsets and the table are int32 (:func:`packed_bounds`), and the grids run along x over
    the padded rows and along y over the heads."""
    check_limits(1, heads_q, heads_kv, total_q, total_k, head_dim, what=what, names=("total_q", "total_k"))
    tq_pad, tk_pad, nbq, nbk, nchk = packed_bounds(S, total_q, total_k)
    for name, n in (("total_q", tq_pad), ("total_k", tk_pad)):
        if n > INT32_MAX:
            raise ValueError(f"{what}{name} + {PAD_MAX - 1} * S = {n} padded rows with S = {S} sequences exceeds the "
                             f"kernels' limit of {INT32_MAX} (32-bit offsets)")
    for label, n in (("the table of sequence offsets", 5 * (S + 1) + nbq + nbk + nchk),
                     ("64-row blocks x Hq", nbq * heads_q), ("sequences x 2 Hkv", 2 * S * heads_kv)):
        if n > INT32_MAX:
            raise ValueError(f"{what}{label} = {n} exceeds the kernels' limit of {INT32_MAX} (S = {S} sequences, "
                             f"total_q = {total_q}, total_k = {total_k})")


def check_dims(shape, name: str, labels) -> None:
    """ValueError naming ``name`` and the dimension when any of ``shape`` is zero (or negative)."""
    for label, n in zip(labels, shape):
        if n < 1:
            raise ValueError(f"{name} has a zero-size dimension {label}={n} (shape {tuple(shape)}); every "
                             f"dimension must be at least 1")


# The kernels take sm_scale as a float32 and fold sm_scale * log2(e) into their exp2 arguments: both must be finite
# normal float32 numbers, or the kernel would compute with inf or 0 (a float64 check alone lets 1e39 or 1e-46 by).
_F32 = _np.finfo(_np.float32)
_SM_SCALE_MIN, _SM_SCALE_MAX = float(_F32.tiny), float(_F32.max) / 2  # / 2: log2(e) < 2 with rounding room
SM_SCALE_RANGE = (f"finite and > 0, within [{_SM_SCALE_MIN:.4g}, {_SM_SCALE_MAX:.4g}] (the kernels take it and its "
                  f"product with log2(e) as normal float32 numbers)")


def sm_scale_out_of_range(value: float) -> bool:
    return not (math.isfinite(value) and _SM_SCALE_MIN <= value <= _SM_SCALE_MAX)


def is_bool(value) -> bool:
    """A Python or NumPy bool (an int such as 0 or 1 is not: it would also equal a bool as a cache key)."""
    return isinstance(value, bool) or type(value).__name__ == "bool_"


def check_causal(causal) -> bool:
    """``causal`` as a bool; TypeError unless a Python or NumPy bool."""
    if not is_bool(causal):
        raise TypeError(f"causal must be a bool, got {causal!r}")
    return bool(causal)


def scale_arg(sm_scale):
    """An adapter's ``sm_scale`` as a Python float (None stays None; its range is checked by the family, through
    :func:`check_sm_scale`). TypeError for a bool or a string, which ``float()`` would turn into 1.0 or parse, and
    for anything ``float()`` refuses (a traced JAX value among them)."""
    if sm_scale is None:
        return None
    if is_bool(sm_scale) or isinstance(sm_scale, (str, bytes)):
        raise TypeError(f"sm_scale must be a float or None, got {sm_scale!r}")
    try:
        return float(sm_scale)
    except (TypeError, ValueError):  # a traced JAX value raises a TypeError subclass too
        raise TypeError(f"sm_scale must be a float or None, got {sm_scale!r}") from None


def check_sm_scale(sm_scale, head_dim: int) -> float:
    """``sm_scale`` as a float (None: ``1/sqrt(head_dim)``). TypeError unless a real number (bool excluded);
    ValueError unless finite, > 0 and within :data:`SM_SCALE_RANGE` (the kernels take it as a float32 and fold it
    into exp2 arguments and quantization scales)."""
    if sm_scale is None:
        return 1.0 / math.sqrt(head_dim)
    if is_bool(sm_scale) or not isinstance(sm_scale, numbers.Real):
        raise TypeError(f"sm_scale must be a float or None, got {sm_scale!r}")
    value = float(sm_scale)
    if sm_scale_out_of_range(value):
        raise ValueError(f"sm_scale={value} must be {SM_SCALE_RANGE}")
    return value


def dtype_name(dtype) -> str:
    return getattr(dtype, "name", str(dtype))


_ARRAY_TYPES = None  # (cupy.ndarray, BF16Array), set by the first as_cupy call (cupy is imported lazily)
#: What a dtype error adds where bfloat16 is supported: the two forms it is taken in (a plain uint16 array is not).
BF16_FORMS = " (bfloat16: a CuPy array of ml_dtypes.bfloat16, or a sagecupy.adapters.bf16.BF16Array)"


def as_cupy(x, name: str):
    """A CuPy view of ``x`` (CuPy array, bfloat16 ones included, :class:`~sagecupy.adapters.bf16.BF16Array`, or any
    CUDA array with ``__dlpack__``), zero-copy."""
    global _ARRAY_TYPES
    import cupy

    if _ARRAY_TYPES is None or _ARRAY_TYPES[0] is not cupy.ndarray:
        # once per cupy module (tests swap in stand-ins): a function-level relative import runs importlib's package
        # lookup on every call (a measurable share of the first launch's host time in cProfile)
        from .adapters.bf16 import BF16Array

        _ARRAY_TYPES = (cupy.ndarray, BF16Array)
    if isinstance(x, _ARRAY_TYPES):
        # the pointer's device id and the runtime's current device: no Device objects on this per-call path
        dev, cur = getattr(x, "bits", x).data.device_id, cupy.cuda.runtime.getDevice()
        if dev != cur:
            raise ValueError(f"{name} is on CUDA device {dev}, the current device is {cur}; "
                             f"call inside `with cupy.cuda.Device({dev}):`")
        return x
    if hasattr(x, "__dlpack__"):
        try:
            arr = cupy.from_dlpack(x)
        except Exception as exc:
            raise TypeError(f"{name}: cannot import the array through DLPack ({exc}); pass a CUDA array") from exc
        return as_cupy(arr, name)
    raise TypeError(f"{name} must be a CuPy array or a CUDA array with __dlpack__, got {type(x).__name__}")


def raw(x):
    """The CuPy array holding x's memory as the kernels take it: a bfloat16 array's uint16 bits (a BF16Array's
    ``.bits``, or a ``.view`` of a CuPy array of ``ml_dtypes.bfloat16``: no copy), any other array itself."""
    bits = getattr(x, "bits", None)
    if bits is not None:
        return bits
    dt = x.dtype
    # (kind first: the fp16 path pays one attribute read; "V" with the name is ml_dtypes' bfloat16)
    return x.view(_np.uint16) if dt.kind == "V" and dt.name == "bfloat16" else x


def wrap(x, dtype: str, like=None):
    """A kernel output (raw CuPy array) as the user sees it. bfloat16: its uint16 bits as the input ``like``
    holds bfloat16 (a CuPy bfloat16 view, or a BF16Array; with no ``like``, the native dtype where CuPy has it:
    :func:`sagecupy.adapters.bf16.output_kind`), no copy. Other dtypes: ``x`` itself."""
    if dtype == "bfloat16":
        from .adapters.bf16 import from_bits

        return from_bits(x, like)
    return x


@dataclass(frozen=True)
class Problem:
    """Shapes of one attention call, in HND terms. ``window``: None (``causal`` alone decides which keys a row sees)
    or the ``(left, right)`` sliding window (docs/algorithms.md §1.8), a pair of ints >= -1 (-1: unbounded).
    Packed sequences (``layout="THD"``): ``batch`` is the number of sequences S, ``nq`` and ``nk`` the totals."""

    batch: int
    heads_q: int
    heads_kv: int
    nq: int
    nk: int
    head_dim: int
    dtype: str
    layout: str
    causal: bool
    sm_scale: float
    window: tuple | None = None

    @property
    def group(self) -> int:
        return self.heads_q // self.heads_kv

    @property
    def bounds(self) -> tuple:
        """``(left, right)`` of the keys a row sees (-1: unbounded): the window, else causal's ``(-1, 0)``, else
        ``(-1, -1)``."""
        if self.window is not None:
            return self.window
        return (-1, 0) if self.causal else (-1, -1)


def check_window(window, causal: bool):
    """``window`` as a :class:`Problem` holds it: None, or the tuple ``(left, right)`` of Python ints >= -1 (-1:
    unbounded) that the reference's :func:`~sagecupy.reference.attention.resolve_window` accepts with ``causal``
    (which must already be a bool). ValueError naming ``window`` (and ``causal`` where they contradict) otherwise."""
    if window is None:
        return None
    from .reference.attention import resolve_window

    return resolve_window(bool(causal), window)


def _hnd_shape(x, layout):
    b, a1, a2, d = x.shape
    return (b, a1, a2, d) if layout == "HND" else (b, a2, a1, d)


def check_attention_args(q, k, v, *, causal, sm_scale, layout, dtypes=("float16", "bfloat16"),
                         head_dims=SUPPORTED_HEAD_DIMS, window=None) -> Problem:
    """Validate q, k, v (array-likes with .shape/.dtype) and the keyword arguments, the kernels' index limits
    (:func:`check_limits`) included. ``window``: see :func:`check_window`."""
    if not isinstance(layout, str) or layout not in _LAYOUTS:
        raise ValueError(f"layout={layout!r} is not supported; supported: {_LAYOUTS}")
    check_causal(causal)
    window = check_window(window, causal)
    for name, x in (("q", q), ("k", k), ("v", v)):
        if len(x.shape) != 4:
            raise ValueError(f"{name} must be 4-D ({'(B, H, N, D)' if layout == 'HND' else '(B, N, H, D)'} for "
                             f"layout={layout!r}), got shape {tuple(x.shape)}")
        check_dims(x.shape, name, ("B", "H", "N", "D") if layout == "HND" else ("B", "N", "H", "D"))
        if dtype_name(x.dtype) not in dtypes:
            raise TypeError(f"{name}.dtype={dtype_name(x.dtype)} is not supported; supported: {dtypes}"
                            f"{BF16_FORMS if 'bfloat16' in dtypes else ''}")
    if not (dtype_name(q.dtype) == dtype_name(k.dtype) == dtype_name(v.dtype)):
        raise TypeError(f"q, k, v must share one dtype, got {dtype_name(q.dtype)}, {dtype_name(k.dtype)}, "
                        f"{dtype_name(v.dtype)}")
    B, Hq, Nq, D = _hnd_shape(q, layout)
    Bk, Hk, Nk, Dk = _hnd_shape(k, layout)
    Bv, Hv, Nv, Dv = _hnd_shape(v, layout)
    if D not in head_dims:
        raise ValueError(f"head_dim={D} is not supported; supported: {head_dims}")
    if (Bk, Hk, Nk, Dk) != (Bv, Hv, Nv, Dv):
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    if Bk != B:
        raise ValueError(f"batch mismatch: q has {B}, k/v have {Bk}")
    if Dk != D:
        raise ValueError(f"head_dim mismatch: q has {D}, k/v have {Dk}")
    if Hq % Hk:
        raise ValueError(f"heads: q has {Hq}, k/v have {Hk}; q heads must be a multiple of kv heads (GQA/MQA)")
    check_limits(B, Hq, Hk, Nq, Nk, D)
    sm_scale = check_sm_scale(sm_scale, D)
    return Problem(B, Hq, Hk, Nq, Nk, D, dtype_name(q.dtype), layout, bool(causal), sm_scale, window)


def _is_int(x) -> bool:
    return isinstance(x, numbers.Integral) and not is_bool(x)


def check_problem(p, name: str, dtypes=("float16", "bfloat16"), head_dims=SUPPORTED_HEAD_DIMS,
                  layouts=_LAYOUTS + ("THD",)) -> None:
    """Validate a :class:`Problem` that did not come from :func:`check_attention_args` (one carried in a
    ``Residuals``): field types, sizes, GQA, dtype, layout (one of ``layouts``: a family without packed sequences
    passes the dense ones, since its kernels would index a THD problem's buffers with dense strides), ``sm_scale``
    and :func:`check_limits`. ``name`` prefixes every message (e.g. ``"residuals.problem"``)."""
    if not isinstance(p, Problem):
        raise TypeError(f"{name} must be a sagecupy._checks.Problem, got {type(p).__name__}")
    packed = p.layout == "THD"  # batch: the sequences; nq, nk: the totals, which may be 0
    for field in ("batch", "heads_q", "heads_kv", "nq", "nk", "head_dim"):
        value = getattr(p, field)
        if not _is_int(value):
            raise TypeError(f"{name}.{field} must be an int, got {value!r}")
        if value < (0 if packed and field in ("nq", "nk") else 1):
            raise ValueError(f"{name}.{field}={value} must be at least {0 if packed and field in ('nq', 'nk') else 1}")
    if p.head_dim not in head_dims:
        raise ValueError(f"{name}.head_dim={p.head_dim} is not supported; supported: {head_dims}")
    if p.heads_q % p.heads_kv:
        raise ValueError(f"{name}: heads_q={p.heads_q} must be a multiple of heads_kv={p.heads_kv}")
    if p.dtype not in dtypes:
        raise ValueError(f"{name}.dtype={p.dtype!r} is not supported; supported: {dtypes}")
    if not isinstance(p.layout, str) or p.layout not in layouts:
        raise ValueError(f"{name}.layout={p.layout!r} is not supported; supported: {layouts}")
    if not isinstance(p.causal, bool):
        raise TypeError(f"{name}.causal must be a bool, got {p.causal!r}")
    w = p.window
    if w is not None:
        if not (isinstance(w, tuple) and len(w) == 2 and all(_is_int(x) and x >= -1 for x in w)):
            raise ValueError(f"{name}.window={w!r} must be None or a pair (left, right) of ints >= -1 (-1: unbounded)")
        if p.causal and w[1] != 0:
            raise ValueError(f"{name}: causal=True contradicts window={w!r} (causal means right = 0)")
    if not isinstance(p.sm_scale, float) or sm_scale_out_of_range(p.sm_scale):
        raise ValueError(f"{name}.sm_scale={p.sm_scale!r} must be a float, {SM_SCALE_RANGE}")
    if packed:
        check_packed_limits(p.batch, p.heads_q, p.heads_kv, p.nq, p.nk, p.head_dim, what=f"{name}: ")
    else:
        check_limits(p.batch, p.heads_q, p.heads_kv, p.nq, p.nk, p.head_dim, what=f"{name}: ")


def _device_of(x, name: str) -> None:
    import cupy

    dev, cur = x.data.device_id, cupy.cuda.runtime.getDevice()
    if dev != cur:
        raise ValueError(f"{name} is on CUDA device {dev}, the current device is {cur}")


def _array(x, name: str, shape, dtype):
    """``x`` as a CuPy array of ``shape`` and ``dtype`` on the current device, or the TypeError/ValueError that
    names ``name`` and what was expected."""
    import cupy
    import numpy as np

    if not isinstance(x, cupy.ndarray):
        raise TypeError(f"{name} must be a CuPy array of shape {tuple(shape)} and dtype {np.dtype(dtype).name}, "
                        f"got {type(x).__name__}")
    if np.dtype(x.dtype) != np.dtype(dtype):
        raise TypeError(f"{name}.dtype={dtype_name(x.dtype)} must be {np.dtype(dtype).name}")
    if tuple(x.shape) != tuple(shape):
        raise ValueError(f"{name}.shape={tuple(x.shape)} must be {tuple(shape)}")
    _device_of(x, name)
    return x


def check_buffer(x, name: str, shape, dtype) -> None:
    """A buffer the kernels index from its base address alone (residual codes, scales, LSEs): a CuPy array of
    exactly ``shape`` and ``dtype``, C-contiguous, 16-byte aligned (vector loads and bulk copies), on the current
    device. Metadata only: no device work."""
    _array(x, name, shape, dtype)
    if not x.flags.c_contiguous:
        raise ValueError(f"{name} must be C-contiguous (the kernels index it from its base address), got strides "
                         f"{tuple(x.strides)}")
    if x.data.ptr % 16:
        raise ValueError(f"{name} must be 16-byte aligned (the kernels read it with 16-byte loads), got address "
                         f"{x.data.ptr:#x}")


def check_rows(x, name: str, shape, dtype) -> None:
    """An array the kernels read by rows at its own strides (a residual V or O): exactly ``shape`` and ``dtype``,
    on the current device, the last dimension contiguous and every row 16-byte aligned (16-byte loads)."""
    _array(x, name, shape, dtype)
    if x.strides[-1] != x.itemsize:
        raise ValueError(f"{name} must have a contiguous last dimension, got strides {tuple(x.strides)}")
    if x.data.ptr % 16 or any(st % 16 for st in x.strides[:-1]):
        raise ValueError(f"{name} must have 16-byte aligned rows (the kernels read them with 16-byte loads), got "
                         f"address {x.data.ptr:#x} and strides {tuple(x.strides)}")


class _StreamHandle:
    """A raw ``cudaStream_t`` (an int) exposed through the CUDA stream protocol (``__cuda_stream__``)."""

    __slots__ = ("ptr",)

    def __init__(self, ptr: int):
        self.ptr = int(ptr)

    def __cuda_stream__(self):
        return (0, self.ptr)


#: CuPy stream objects over other frameworks' streams, by (handle, device): such an object only names the handle, so
#: one serves every call on that stream, and building it took ~5 us of host time per call (docs/experiments.md,
#: E-ADAPT-DIRECT). Cleared when full: streams come and go (a pool of side streams).
_EXTERNAL_STREAMS = {}


def external_stream(ptr: int, device_id: int):
    """A CuPy stream object for a stream another framework owns (PyTorch's, XLA's), for ``with`` blocks:
    ``cupy.cuda.Stream.from_external`` on CuPy versions that have it (ExternalStream is deprecated there),
    else ``cupy.cuda.ExternalStream``; the same object for the same handle and device. The caller keeps the stream
    alive and makes ``device_id`` current."""
    key = (ptr, device_id)
    stream = _EXTERNAL_STREAMS.get(key)
    if stream is not None:
        return stream
    import cupy

    from_external = getattr(cupy.cuda.Stream, "from_external", None)
    if from_external is not None:
        stream = from_external(_StreamHandle(ptr))
    else:
        stream = cupy.cuda.ExternalStream(ptr, device_id)
    if len(_EXTERNAL_STREAMS) >= 64:
        _EXTERNAL_STREAMS.clear()
    _EXTERNAL_STREAMS[key] = stream
    return stream
