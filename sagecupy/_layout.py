"""Layout, buffer and launch helpers every family uses: element strides of the HND/NHD layouts, aligned views or
copies of the caller's arrays, raw output buffers, the tensor-core engine choice, and the name of the per-call
scratch arena (sagecupy/_program.py ``_Arena``)."""
from __future__ import annotations

from . import _checks
from ._loader import device_capability

#: Source files that only build for one architecture (CI compiles them for that target alone).
KERNEL_ARCHS = {"int8/int8_attn_fwd_sm90.cu": ("sm_90a",), "int8/int8_attn_bwd_sm90.cu": ("sm_90a",),
                "nvfp4/fp4_attn_fwd_sm90.cu": ("sm_90a",), "qat/qat_attn_bwd_sm90.cu": ("sm_90a",),
                "qat/qat_attn_fwd_sm90.cu": ("sm_90a",)}

ENGINES = ("auto", "mma", "wgmma")
#: The scratch arena of a call's recorded program: buffers no caller keeps past the call.
TMP = "tmp"


#: The packed variable-length layout: (total, H, D) arrays with cu_seqlens (docs/algorithms.md §1.8).
PACKED = "THD"


def strides(x, layout):
    """Element strides (batch, head, token) of a 4-D array in `layout`; of a packed (total, H, D) array (``"THD"``),
    (0, head, token): the kernels move to a sequence's first token themselves."""
    s = [st // x.itemsize for st in x.strides]
    if layout == PACKED:
        return (0, s[1], s[0])
    return (s[0], s[1], s[2]) if layout == "HND" else (s[0], s[2], s[1])


def prepare(x, name, layout, need_aligned):
    """x's memory as a CuPy array (bits for bf16) whose last dim is contiguous (16-byte aligned rows when
    needed): a view when it already is, else a copy; the caller's buffer is never modified."""
    import cupy

    x = _checks.raw(_checks.as_cupy(x, name))
    if not needs_copy(x, need_aligned):
        return x
    y = cupy.ascontiguousarray(x)
    # ascontiguousarray returns a C-contiguous array itself, even at a misaligned address (a view at an odd
    # offset): copy then, since a misaligned 16-byte load would fault and take the CUDA context with it.
    return y.copy() if need_aligned and y.data.ptr % 16 else y


def roundup(n, m):
    return (n + m - 1) // m * m


def layout_shape(shape, layout):
    """An HND shape ``(B, H, N, D)`` in ``layout``'s order."""
    b, h, n, d = shape
    return (b, h, n, d) if layout == "HND" else (b, n, h, d)


def bits_dtype(dtype: str):
    """The CuPy dtype holding ``dtype``'s values (uint16 bits for bfloat16)."""
    import cupy

    return cupy.float16 if dtype == "float16" else cupy.uint16


def empty(shape, layout, dtype: str):
    """Raw output buffer (uint16 bits for bfloat16) in the caller's layout."""
    import cupy

    return cupy.empty(layout_shape(shape, layout), dtype=bits_dtype(dtype))


def pick_engine(engine):
    """``engine`` validated, ``None`` and ``"auto"`` resolved: wgmma on sm_90, mma.sync elsewhere."""
    if engine is None:
        engine = "auto"
    if engine not in ENGINES:
        raise ValueError(f"engine={engine!r} is not supported; supported: {ENGINES}")
    if engine == "auto":
        return "wgmma" if device_capability() == (9, 0) else "mma"
    if engine == "wgmma" and device_capability() != (9, 0):
        raise ValueError(f"engine='wgmma' needs compute capability 9.0 (Hopper), this device is "
                         f"{device_capability()}")
    return engine


def c_strides(shape, layout):
    """:func:`strides` of a C-contiguous array of ``shape`` (the layout's own order)."""
    if layout == PACKED:
        _, h, d = shape
        return (0, d, h * d)
    _, a1, a2, d = shape
    s = (a1 * a2 * d, a2 * d, d)
    return s if layout == "HND" else (s[0], s[2], s[1])


def run_strides(x, copied, layout):
    """:func:`strides` of what a run passes for input ``x``: its own, or a C-contiguous copy's (:func:`prepare`)."""
    raw = _checks.raw(x)
    return c_strides(raw.shape, layout) if copied else strides(raw, layout)


def needs_copy(x, need_aligned):
    """Whether :func:`prepare` copies the raw CuPy array ``x`` (4-D, or 3-D packed)."""
    ok = x.strides[-1] == x.itemsize
    if ok and need_aligned:
        ok = x.data.ptr % 16 == 0 and all((st % 16 == 0) for st in x.strides[:-1])
    return not ok


def input_ns(plan, layout, **inputs):
    """A run's namespace: each input as it is (raw) or, where ``plan.copy`` says so, its aligned copy."""
    return {n: (prepare(x, n, layout, True) if c else _checks.raw(x)) for (n, x), c in zip(inputs.items(), plan.copy)}
