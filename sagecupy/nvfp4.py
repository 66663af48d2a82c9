"""NVFP4 on the GPU (SPEC §5): quantization into the exchange format.

Status: the quantization pre-passes are written and compiled in CI but **have not run on a GPU yet**
(the session that wrote them had no device time left); their bit-exact tests are in
``tests/gpu/test_nvfp4_quant.py``. The NVFP4 attention forward and FP4 QAT kernels are not written.

Exchange format (what DLPack can carry): packed ``uint8`` E2M1 codes, two per byte, element ``2i`` in
the low nibble, and ``uint8`` E4M3 scales, one per 16 elements along the contraction axis:

* Q and K: blocks along D -> codes ``(B, H, N, D/2)``, scales ``(B, H, N, D/16)``;
* V: blocks of 16 tokens (V transposed) -> codes ``(B, H, D, N16/2)``, scales ``(B, H, D, N16/16)``
  with ``N16`` = N rounded up to a multiple of 16 (zero tokens).

Bit-exact with :mod:`sagecupy.reference.fp4` (every code and scale byte), including ties, saturation,
subnormal scales, zero blocks (scale 0, codes +0) and blocks holding NaN/Inf (scale 0x7F, NaN).
"""
from __future__ import annotations

from . import _checks
from ._loader import get_function

__all__ = ["quantize_rows", "quantize_tokens", "quantize_inputs", "kernel_names"]

_T = {"float16": "__half", "bfloat16": "__nv_bfloat16"}


def kernel_names() -> dict:
    """Every template instantiation this module launches, per source file (CI compiles them all)."""
    return {"nvfp4_quant.cu": [f"{k}<{T}>" for T in _T.values() for k in ("nvfp4_quant_rows", "nvfp4_quant_tokens")]}


def _fn(kind, T):
    names = tuple(kernel_names()["nvfp4_quant.cu"])
    return get_function("nvfp4_quant.cu", f"{kind}<{T}>", all_names=names)


def _prep(x, name, layout):
    import cupy

    x = _checks.as_cupy(x, name)
    dt = _checks.dtype_name(x.dtype)
    if dt not in _T:
        raise TypeError(f"{name}.dtype={dt} is not supported; supported: {tuple(_T)}")
    if len(x.shape) != 4:
        raise ValueError(f"{name} must be 4-D, got shape {tuple(x.shape)}")
    if layout not in ("HND", "NHD"):
        raise ValueError(f"layout={layout!r} is not supported; supported: ('HND', 'NHD')")
    raw = _checks.raw(x)
    if raw.strides[3] != raw.itemsize:
        raw = cupy.ascontiguousarray(raw)
    s = [st // raw.itemsize for st in raw.strides]
    B, a1, a2, D = raw.shape
    H, N = (a1, a2) if layout == "HND" else (a2, a1)
    strides = (s[0], s[1], s[2]) if layout == "HND" else (s[0], s[2], s[1])
    if D % 16:
        raise ValueError(f"head_dim={D} must be a multiple of 16 for NVFP4 (16-element blocks)")
    return raw, _T[dt], (B, H, N, D), strides


def quantize_rows(x, *, layout="HND", mean=None):
    """NVFP4 of ``x`` (Q or K) in 16-blocks along D, after subtracting ``mean`` ((B, Hm, D) float32, Hm
    dividing H; K-smoothing) when given. Returns ``(codes (B,H,N,D/2) uint8, scales (B,H,N,D/16) uint8)``."""
    import cupy

    raw, T, (B, H, N, D), (sb, sh, sn) = _prep(x, "x", layout)
    group = 1
    if mean is not None:
        mean = cupy.ascontiguousarray(_checks.as_cupy(mean, "mean"), dtype=cupy.float32)
        if mean.ndim != 3 or mean.shape[0] != B or mean.shape[2] != D or H % mean.shape[1]:
            raise ValueError(f"mean.shape={tuple(mean.shape)} must be (B, Hm, D) = ({B}, Hm, {D}) with Hm dividing {H}")
        group = H // mean.shape[1]
    codes = cupy.empty((B, H, N, D // 2), dtype=cupy.uint8)
    scales = cupy.empty((B, H, N, D // 16), dtype=cupy.uint8)
    nblk = N * D // 16
    i32, i64 = cupy.int32, cupy.int64
    _fn("nvfp4_quant_rows", T)(((nblk + 255) // 256, H, B), (256,),
                               (raw, i64(sb), i64(sh), i64(sn), i32(N), i32(D), mean, i32(group), codes, scales))
    return codes, scales


def quantize_tokens(x, *, layout="HND"):
    """NVFP4 of ``x`` (V) in blocks of 16 consecutive tokens per channel (V transposed, tokens zero-padded
    to N16). Returns ``(codes (B,H,D,N16/2) uint8, scales (B,H,D,N16/16) uint8)``."""
    import cupy

    raw, T, (B, H, N, D), (sb, sh, sn) = _prep(x, "x", layout)
    n16 = (N + 15) // 16 * 16
    codes = cupy.empty((B, H, D, n16 // 2), dtype=cupy.uint8)
    scales = cupy.empty((B, H, D, n16 // 16), dtype=cupy.uint8)
    work = D * (n16 // 16)
    i32, i64 = cupy.int32, cupy.int64
    _fn("nvfp4_quant_tokens", T)(((work + 255) // 256, H, B), (256,),
                                 (raw, i64(sb), i64(sh), i64(sn), i32(N), i32(D), i32(n16), codes, scales))
    return codes, scales


def quantize_inputs(q, k, v, *, layout="HND", k_smoothing=True):
    """Q, K (K - mean over tokens when ``k_smoothing``) and V in the exchange format; keys as
    :func:`sagecupy.reference.nvfp4.quantize_inputs` (without Q-smoothing and tensor scales).

    The K mean is computed in float64 and rounded to float32, then subtracted in float32 (the reference
    subtracts in float64, so a code can differ where K - mean lands on a rounding tie)."""
    import cupy

    out = {}
    mu = None
    if k_smoothing:
        raw, _, (B, H, N, D), _ = _prep(k, "k", layout)
        axis = 2 if layout == "HND" else 1
        if raw.dtype == cupy.float16:
            f64 = raw.astype(cupy.float64)
        else:  # bfloat16 bits
            f64 = (raw.astype(cupy.uint32) << 16).view(cupy.float32).astype(cupy.float64)
        mu = f64.mean(axis=axis).astype(cupy.float32)  # (B, H, D)
    out["q_packed"], out["q_scales"] = quantize_rows(q, layout=layout)
    out["k_packed"], out["k_scales"] = quantize_rows(k, layout=layout, mean=mu)
    out["v_packed"], out["v_scales"] = quantize_tokens(v, layout=layout)
    out["mu_k"] = mu
    return out
