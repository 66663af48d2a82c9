"""What the drop-in ``scaled_dot_product_attention`` of :mod:`sagecupy.torch` decides, without PyTorch.

:func:`unsupported_reason` says whether sagecupy's kernels can compute a call of
``torch.nn.functional.scaled_dot_product_attention`` exactly as PyTorch defines it, and if not, why. It reads
only metadata (shapes, dtypes, device types, Python scalars; whether a gradient is needed is the caller's
argument), never tensor values: under ``torch.compile`` the decision is made once, when the call is traced,
and is the same one eager mode makes. It takes any objects with ``shape``, ``dtype`` and ``device.type``, so it
is tested without PyTorch.

:class:`FallbackLog` counts the calls that went to PyTorch instead, per reason, and warns once per reason.
"""
from __future__ import annotations

import threading
import warnings

from .. import _checks

__all__ = ["FAMILIES", "FALLBACKS", "HEAD_DIMS", "SageFallbackWarning", "FallbackLog", "check_options",
           "hf_causal_needs_no_mask", "unsupported_reason"]

#: Kernel families the drop-in runs: INT8 SageBwd (training), FP4 QAT (training), NVFP4 (inference only).
FAMILIES = ("int8", "qat", "nvfp4")
#: What a call the kernels cannot take does: run PyTorch's SDPA, or raise ValueError.
FALLBACKS = ("sdpa", "error")
#: Head dims the kernels are built for.
HEAD_DIMS = (64, 128)


class SageFallbackWarning(UserWarning):
    """A call went to PyTorch's SDPA instead of sagecupy's kernels (one warning per distinct reason)."""


def check_options(family, fallback) -> None:
    """ValueError for a ``family`` or ``fallback`` the drop-in does not know (a programming error: never a
    fallback)."""
    if family not in FAMILIES:
        raise ValueError(f"family={family!r} is not supported; supported: {', '.join(map(repr, FAMILIES))}")
    if fallback not in FALLBACKS:
        raise ValueError(f"fallback={fallback!r} is not supported; supported: {', '.join(map(repr, FALLBACKS))}")


def unsupported_reason(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                       enable_gqa=False, *, family="int8", grad_needed=False,
                       dtypes=("float16", "bfloat16")) -> str | None:
    """None when sagecupy's ``family`` kernels compute this SDPA call as PyTorch defines it, else the reason.

    The arguments are PyTorch's (``query (B, Hq, Nq, D)``, ``key``/``value (B, Hkv, Nk, D)``). The kernels take:
    no ``attn_mask``, ``dropout_p == 0``, CUDA inputs on one device, one dtype among ``dtypes``, 4-D inputs with
    one batch size, ``key.shape == value.shape``, one head dim in :data:`HEAD_DIMS`, no empty dimension,
    ``Hq == Hkv`` or (``enable_gqa`` and ``Hq % Hkv == 0``), ``is_causal`` only with ``Nq == Nk`` (PyTorch's causal
    mask is top-left aligned, the kernels' bottom-right: the two agree only on square masks), ``scale`` None or a
    positive finite number; ``family="nvfp4"`` only when no gradient is needed (``grad_needed``: grad mode is on
    and an input requires grad).
    """
    if attn_mask is not None:
        return "attn_mask is given (the kernels take no mask but a causal one)"
    if dropout_p != 0.0:
        return "dropout_p != 0 (the kernels have no dropout)"
    named = (("query", query), ("key", key), ("value", value))
    for name, t in named:
        if t.device.type != "cuda":
            return f"{name} is a {t.device.type} tensor (the kernels run on CUDA tensors)"
    if key.device != query.device or value.device != query.device:
        return "query, key and value are on different devices"
    if query.dtype not in dtypes:
        return f"dtype {query.dtype} (the kernels take {', '.join(str(d) for d in dtypes)})"
    if key.dtype != query.dtype or value.dtype != query.dtype:
        return "query, key and value have different dtypes"
    if len(query.shape) != 4 or len(key.shape) != 4 or len(value.shape) != 4:
        return "the inputs are not 4-D (B, H, N, D)"
    B, Hq, Nq, D = query.shape
    Bk, Hkv, Nk, Dk = key.shape
    if tuple(value.shape) != tuple(key.shape):
        return "value's shape differs from key's (the kernels take one head dim and one kv length)"
    if Bk != B:
        return "query and key have different batch sizes (PyTorch would broadcast them)"
    if Dk != D:
        return "query and key have different head dims"
    if D not in HEAD_DIMS:
        return f"head dim {D} (the kernels take {', '.join(map(str, HEAD_DIMS))})"
    if B == 0 or Hq == 0 or Hkv == 0 or Nq == 0 or Nk == 0:
        return "an input has an empty dimension"
    if Hq != Hkv:
        if not enable_gqa:
            return "query and key have different head counts and enable_gqa is False (PyTorch would broadcast them)"
        if Hq % Hkv != 0:
            return "the query head count is not a multiple of the key/value head count"
    if is_causal and Nq != Nk:
        return ("is_causal with Nq != Nk (PyTorch's causal mask is top-left aligned, the kernels' bottom-right; "
                "they agree only when Nq == Nk)")
    if scale is not None and _checks.sm_scale_out_of_range(scale):
        return f"scale={scale!r} is not {_checks.SM_SCALE_RANGE}"
    if family == "nvfp4" and grad_needed:
        return "family nvfp4 is inference-only and a gradient is required"
    return None


def hf_causal_needs_no_mask(q_length, kv_length, q_offset, kv_offset) -> bool:
    """Whether transformers' plain causal mask (``masking_utils.causal_mask_function``, no padding) over these sizes
    is exactly what the sagecupy transformers attention computes when it is given no mask.

    The arguments are those transformers hands a mask function: query row ``i`` sits at position ``q_offset + i``,
    key ``j`` at ``kv_offset + j``, and the mask lets a row see the keys at or before its position. Given no mask, the
    attention computes, as transformers' SDPA attention does: one query row sees every key; several rows are causal
    with row ``i`` seeing keys ``0..i``. So the mask may be left out when one row's position is at or past every key's,
    or when there are as many keys as rows and both start at the same position. ``q_offset`` / ``kv_offset`` are None
    where they are not known without reading a tensor (a static cache keeps its length in a tensor): then False.

    Sizes and offsets only, never tensor values: under ``torch.compile`` the answer is decided while tracing (a
    guard on the sizes, not a graph break), where transformers' own SDPA mask function, which must also inspect the
    padding mask's values, always builds a mask.
    """
    if q_offset is None or kv_offset is None:
        return False
    if q_length == 1:
        return kv_offset + kv_length <= q_offset + 1
    return kv_length == q_length and q_offset == kv_offset


class FallbackLog:
    """Calls that went to PyTorch instead of the kernels: a count per reason, and one
    :class:`SageFallbackWarning` per distinct reason (until :meth:`reset`)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._counts: dict = {}
        self._warned: set = set()

    def record(self, reason: str, *, stacklevel: int = 2) -> bool:
        """Count one fallback for ``reason``; warn if it is the first since the last reset. Returns True (a
        constant, for ``torch.compiler.assume_constant_result``)."""
        with self._lock:
            self._counts[reason] = self._counts.get(reason, 0) + 1
            first = reason not in self._warned
            self._warned.add(reason)
        if first:
            warnings.warn(f"sagecupy.torch: running PyTorch's scaled_dot_product_attention instead of sagecupy's "
                          f"kernels: {reason} (warned once per reason; sagecupy.torch.fallback_counts() counts them)",
                          SageFallbackWarning, stacklevel=stacklevel + 1)
        return True

    def counts(self) -> dict:
        """A copy: reason -> number of fallbacks since the last reset."""
        with self._lock:
            return dict(self._counts)

    def reset(self) -> None:
        """Forget the counts and the reasons already warned about."""
        with self._lock:
            self._counts.clear()
            self._warned.clear()
