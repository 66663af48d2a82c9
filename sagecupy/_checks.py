"""Argument validation shared by every GPU family: arrays, dtypes, shapes, layouts, GQA.

Every failure is a ``TypeError`` (wrong kind of thing) or ``ValueError`` (right kind, unsupported
value) whose message names the argument, the value, and what is supported.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["Problem", "as_cupy", "raw", "wrap", "check_attention_args", "SUPPORTED_HEAD_DIMS", "dtype_name"]

SUPPORTED_HEAD_DIMS = (64, 128)
_LAYOUTS = ("HND", "NHD")


def dtype_name(dtype) -> str:
    return getattr(dtype, "name", str(dtype))


_ARRAY_TYPES = None  # (cupy.ndarray, BF16Array), set by the first as_cupy call (cupy is imported lazily)


def as_cupy(x, name: str):
    """A CuPy view of ``x`` (CuPy array, :class:`~sagecupy.adapters.bf16.BF16Array`, or any CUDA array with
    ``__dlpack__``), zero-copy."""
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
    """The CuPy array holding x's memory (the uint16 bits of a BF16Array)."""
    return getattr(x, "bits", x)


def wrap(x, dtype: str):
    """A kernel output (raw CuPy array) as the user sees it: BF16Array for bfloat16."""
    if dtype == "bfloat16":
        from .adapters.bf16 import BF16Array

        return BF16Array(x)
    return x


@dataclass(frozen=True)
class Problem:
    """Shapes of one attention call, in HND terms."""

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

    @property
    def group(self) -> int:
        return self.heads_q // self.heads_kv


def _hnd_shape(x, layout):
    b, a1, a2, d = x.shape
    return (b, a1, a2, d) if layout == "HND" else (b, a2, a1, d)


def check_attention_args(q, k, v, *, causal, sm_scale, layout, dtypes=("float16", "bfloat16"),
                         head_dims=SUPPORTED_HEAD_DIMS) -> Problem:
    """Validate q, k, v (array-likes with .shape/.dtype) and the keyword arguments."""
    if layout not in _LAYOUTS:
        raise ValueError(f"layout={layout!r} is not supported; supported: {_LAYOUTS}")
    if not isinstance(causal, (bool,)) and type(causal).__name__ != "bool_":
        raise TypeError(f"causal must be a bool, got {causal!r}")
    for name, x in (("q", q), ("k", k), ("v", v)):
        if len(x.shape) != 4:
            raise ValueError(f"{name} must be 4-D ({'(B, H, N, D)' if layout == 'HND' else '(B, N, H, D)'} for "
                             f"layout={layout!r}), got shape {tuple(x.shape)}")
        if dtype_name(x.dtype) not in dtypes:
            raise TypeError(f"{name}.dtype={dtype_name(x.dtype)} is not supported; supported: {dtypes}")
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
    if Hk < 1 or Hq % Hk:
        raise ValueError(f"heads: q has {Hq}, k/v have {Hk}; q heads must be a multiple of kv heads (GQA/MQA)")
    if min(B, Hq, Nq, Nk) < 1:
        raise ValueError(f"empty input: q shape {tuple(q.shape)}, k shape {tuple(k.shape)}")
    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(D)
    else:
        try:
            sm_scale = float(sm_scale)
        except (TypeError, ValueError):
            raise TypeError(f"sm_scale must be a float or None, got {sm_scale!r}") from None
        if not math.isfinite(sm_scale) or sm_scale <= 0:
            raise ValueError(f"sm_scale={sm_scale} must be finite and > 0")
    return Problem(B, Hq, Hk, Nq, Nk, D, dtype_name(q.dtype), layout, bool(causal), sm_scale)


class _StreamHandle:
    """A raw ``cudaStream_t`` (an int) exposed through the CUDA stream protocol (``__cuda_stream__``)."""

    __slots__ = ("ptr",)

    def __init__(self, ptr: int):
        self.ptr = int(ptr)

    def __cuda_stream__(self):
        return (0, self.ptr)


def external_stream(ptr: int, device_id: int):
    """A CuPy stream object for a stream another framework owns (PyTorch's, XLA's), for ``with`` blocks:
    ``cupy.cuda.Stream.from_external`` on CuPy versions that have it (ExternalStream is deprecated there),
    else ``cupy.cuda.ExternalStream``. The caller keeps the stream alive and makes ``device_id`` current."""
    import cupy

    from_external = getattr(cupy.cuda.Stream, "from_external", None)
    if from_external is not None:
        return from_external(_StreamHandle(ptr))
    return cupy.cuda.ExternalStream(ptr, device_id)
