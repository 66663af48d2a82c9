"""FP4 quantization-aware training attention on the GPU (Attn-QAT-style, SPEC §6).

``forward(q, k, v, ...) -> (o, residuals)`` and ``backward(residuals, do) -> (dq, dk, dv)``, the same shape
as :mod:`sagecupy.int8`. The math is :mod:`sagecupy.reference.qat`'s:

* forward: ``Q~, K~, V~ = fq(Q), fq(K), fq(V)`` (NVFP4 fake quantization; 16-blocks along D for Q and K,
  along the tokens for V), ``S = sm_scale Q~ K~^T``, ``P = softmax(S)``, ``O = fq_P(P) V~`` with the
  two-level P quantization over 64-key tiles, and the high-precision ``O' = P V~`` the backward needs;
* backward: ``P`` recomputed from ``Q~, K~`` and the LSE; ``dV = fq_P(P)^T dO``; ``dP = dO V~^T``;
  ``delta = rowsum(dO o O')`` -- **O', not O**; ``dS = P o (dP - delta)``; ``dQ = sm_scale dS K~``,
  ``dK = sm_scale dS^T Q~``; straight-through to ``Q, K, V``.

The fake-quantized operands are materialized once, in fp16 (exact: every NVFP4 value is an fp16 value) and
zero-padded: ``Q~`` ``(B, Hq, nq_pad, D)``, ``K~`` ``(B, Hkv, nk_pad, D)``, ``V~^T`` ``(B, Hkv, D, nk_pad)``;
they are the saved residuals (with ``O'`` in fp32 and the base-2 LSE), so the backward sees exactly the
forward's quantization. All matmuls run on fp16 tensor cores with fp32 accumulation.

GPU support: ``QATConfig(two_level_p=True, block_kv=64)`` (the default). Single-level P quantizes the
*normalized* P (reference), which a one-pass forward cannot know; it is reference-only.
"""
from __future__ import annotations

from dataclasses import dataclass

from . import _checks
from ._loader import get_function
from .config import QATConfig
from .nvfp4 import _cg_suffix, _fn, _is_supported, _names, _prep, _validated, fp4_causal_group

__all__ = ["forward", "backward", "qat_attention", "is_supported", "Residuals", "fake_quantize"]

LOG2E = 1.4426950408889634
_BQ_PAD, _BKV = 128, 64
_T = {"float16": "__half", "bfloat16": "__nv_bfloat16"}


def _get_config(config) -> QATConfig:
    if config is None:
        return QATConfig()
    if not isinstance(config, QATConfig):
        raise TypeError(f"config must be a QATConfig or None, got {type(config).__name__}")
    return config


def _unsupported_config(cfg: QATConfig) -> str | None:
    if cfg.block_kv != _BKV:
        return f"block_kv={cfg.block_kv} is not supported by the kernels; supported: {_BKV}"
    if not cfg.two_level_p:
        return ("two_level_p=False is reference-only: single-level fq_P quantizes the normalized P, which the "
                "one-pass forward kernel cannot know")
    if not cfg.quantize:
        return "quantize=False is a reference-only switch"
    return None


def is_supported(q, k, v, *, causal=False, sm_scale=None, layout="HND", config=None,
                 engine=None) -> tuple[bool, str]:
    """(True, "") if :func:`forward` accepts these arguments (``engine`` included) on the current device, else
    (False, why). Never raises."""
    return _is_supported(q, k, v, causal, sm_scale, layout, config, _get_config, _unsupported_config, engine,
                         qat=True)


def _roundup(n, m):
    return (n + m - 1) // m * m


def fake_quantize(x, *, layout="HND", along="channels", n_pad=None):
    """``fq(x)`` in fp16, zero-padded: ``along="channels"`` -> ``(B, H, n_pad, D)`` (Q, K);
    ``along="tokens"`` -> ``fq(x)^T`` ``(B, H, D, n_pad)`` (V). ``n_pad`` defaults to N rounded up to 64."""
    return _fake_quantize(x, layout, along, n_pad, False)[0]


def _fake_quantize(x, layout, along, n_pad, bf16_too):
    """fake_quantize's work: ``(fp16 array, None)``, or with ``bf16_too`` also the same values as bf16 bits
    (uint16, same shape), written by the same kernel (the QAT backward's operands for bf16 inputs)."""
    import cupy

    if along not in ("channels", "tokens"):
        raise ValueError(f"along={along!r} is not supported; supported: 'channels', 'tokens'")
    raw, T, (B, H, N, D), (sb, sh, sn) = _prep(x, "x", layout)
    need = N if along == "channels" else _roundup(N, 16)
    if n_pad is None:
        n_pad = _roundup(N, _BKV)
    elif (isinstance(n_pad, bool) or not isinstance(n_pad, int) or n_pad < need
          or (along == "tokens" and n_pad % 8)):  # tokens: 16-byte stores into rows of n_pad halves
        raise ValueError(f"n_pad={n_pad!r} must be an int >= {need} (N{' rounded up to 16' if along == 'tokens' else ''})"
                         f"{' and a multiple of 8' if along == 'tokens' else ''}")
    i32, i64 = cupy.int32, cupy.int64
    shape = (B, H, n_pad, D) if along == "channels" else (B, H, D, n_pad)
    out = cupy.empty(shape, dtype=cupy.float16)
    out_b = cupy.empty(shape, dtype=cupy.uint16) if bf16_too else None
    # The kernels write rows < N (channels) / tokens < N rounded up to 16 (tokens); only the rest is zeroed here.
    for o in (out, out_b) if bf16_too else (out,):
        if along == "channels" and n_pad > N:
            o[:, :, N:] = 0
        elif along == "tokens" and n_pad > need:
            o[..., need:] = 0
    if along == "channels":
        if raw.data.ptr % 16 == 0 and sb % 8 == 0 and sh % 8 == 0 and sn % 8 == 0 and N * D // 8 < 2 ** 31:
            halves = N * D // 8  # one thread per 8 channels, 16-byte loads
            _fn("nvfp4_fq_rows", T)(((halves + 255) // 256, H, B), (256,),
                                    (raw, i64(sb), i64(sh), i64(sn), i32(N), i32(D), i32(n_pad), out, out_b))
        else:
            nblk = N * D // 16
            _fn("nvfp4_fq_rows_any", T)(((nblk + 255) // 256, H, B), (256,),
                                        (raw, i64(sb), i64(sh), i64(sn), i32(N), i32(D), i32(n_pad), out, out_b))
    else:  # tokens
        work = D * (need // 16)
        _fn("nvfp4_fq_tokens", T)(((work + 255) // 256, H, B), (256,),
                                  (raw, i64(sb), i64(sh), i64(sn), i32(N), i32(D), i32(need), i32(n_pad), out, out_b))
    return out, out_b


@dataclass
class Residuals:
    """What :func:`backward` needs (device arrays). Treat as opaque."""

    problem: _checks.Problem
    config: QATConfig
    # fq(Q), fq(K), fq(V)^T in the backward's operand type: fp16 for fp16 inputs, bf16 bits (uint16) for bf16
    q_t: object       # (B, Hq, nq_pad, D) fq(Q), zero rows beyond Nq
    k_t: object       # (B, Hkv, nk_pad, D) fq(K)
    vt_t: object      # (B, Hkv, D, nk_pad) fq(V)^T
    o_prime: object   # (B, Hq, nq_pad, D) fp32 P V~ (rows beyond Nq unwritten)
    lse2: object      # (B, Hq, nq_pad) fp32 base-2 LSE of the logits (+inf where no key is seen)


def _fwd_fn(T, D, w):
    return get_function("fp4_attn_fwd.cu", f"qat_attn_fwd<{T}, {D}, {w}>")


def _fwd_fn_sm90(T, D, causal):
    return get_function("qat_attn_fwd_sm90.cu", f"qat_attn_fwd_sm90<{T}, {D}{_cg_suffix(fp4_causal_group(causal))}>",
                        all_names=_names("qat_attn_fwd_sm90.cu"), arch="sm_90a")


def forward(q, k, v, *, causal=False, sm_scale=None, layout="HND", config=None, return_lse=False, engine=None):
    """QAT forward. Returns ``(o, residuals)`` (``(o, lse, residuals)`` with ``return_lse``).

    Arguments as :func:`sagecupy.int8.forward`: fp16 or bf16, D 64 or 128, GQA, both layouts, causal
    bottom-right aligned, any N. ``o = fq_P(P) V~`` in q's dtype and layout; ``lse`` float32 (B, Hq, Nq)
    natural log. Inputs are never modified. ``engine``: as :func:`sagecupy.nvfp4.fp4_engine` (``"auto"``:
    wgmma on sm_90, mma.sync elsewhere; ``SAGECUPY_FP4_ENGINE`` overrides the default).
    """
    import cupy

    from .int8 import _empty, _strides
    from .nvfp4 import fp4_engine, fp4_warps, fwd_smem_bytes, qat_fwd_sm90_smem_bytes

    q, k, v, p, cfg = _validated(q, k, v, causal, sm_scale, layout, config, _get_config, _unsupported_config, engine,
                                 qat=True)
    eng = fp4_engine(engine)
    B, Hq, Hkv, nq, nk, D = p.batch, p.heads_q, p.heads_kv, p.nq, p.nk, p.head_dim
    nq_pad, nk_pad = _roundup(nq, _BQ_PAD), _roundup(nk, _BKV)
    # fp16 operands for the forward kernel; for bf16 inputs the same values as bf16 in the same passes, kept for
    # the backward (whose products need dO's type), and the fp16 copies freed when this returns
    bf = p.dtype == "bfloat16"
    q_t, q_b = _fake_quantize(q, layout, "channels", nq_pad, bf)
    k_t, k_b = _fake_quantize(k, layout, "channels", nk_pad, bf)
    vt_t, vt_b = _fake_quantize(v, layout, "tokens", nk_pad, bf)
    o = _empty((B, Hq, nq, D), layout, p.dtype)
    osb, osh, osn = _strides(o, layout)
    lse = cupy.empty((B, Hq, nq), dtype=cupy.float32)
    lse2 = cupy.empty((B, Hq, nq_pad), dtype=cupy.float32)
    o_prime = cupy.empty((B, Hq, nq_pad, D), dtype=cupy.float32)
    if eng == "wgmma":
        fn, smem, w = _fwd_fn_sm90(_T[p.dtype], D, p.causal), qat_fwd_sm90_smem_bytes(D), 8
    else:
        w = fp4_warps()
        fn, smem = _fwd_fn(_T[p.dtype], D, w), fwd_smem_bytes(D, w)
    if smem > 48 * 1024:
        fn.max_dynamic_shared_size_bytes = smem
    i32, i64, f32 = cupy.int32, cupy.int64, cupy.float32
    fn((nq_pad // (16 * w), Hq, B), (32 * w,),
       (q_t, k_t, vt_t, o, i64(osb), i64(osh), i64(osn), lse, lse2, o_prime,
        i32(Hq), i32(Hkv), i32(nq), i32(nk), i32(nq_pad), i32(nk_pad), f32(p.sm_scale * LOG2E), i32(int(p.causal))),
       shared_mem=smem)
    res = Residuals(p, cfg, q_b, k_b, vt_b, o_prime, lse2) if bf else Residuals(p, cfg, q_t, k_t, vt_t, o_prime, lse2)
    o = _checks.wrap(o, p.dtype)
    return (o, lse, res) if return_lse else (o, res)


def qat_attention(q, k, v, *, causal=False, sm_scale=None, layout="HND", return_lse=False, config=None, engine=None):
    """The QAT forward alone (``o`` or ``(o, lse)``), e.g. to evaluate a QAT-trained model."""
    out = forward(q, k, v, causal=causal, sm_scale=sm_scale, layout=layout, config=config, return_lse=True,
                  engine=engine)
    return (out[0], out[1]) if return_lse else out[0]


def backward(residuals: Residuals, do, *, engine=None):
    """QAT backward: ``(dq, dk, dv)`` in the forward's layout and dtype.

    ``engine``: ``"auto"`` (default: wgmma on sm_90, mma.sync elsewhere; ``SAGECUPY_BWD_ENGINE`` overrides the
    default), ``"mma"`` or ``"wgmma"`` (see :func:`sagecupy._qat_bwd.backward_engine`)."""
    from . import _qat_bwd

    return _qat_bwd.backward(residuals, do, engine=engine)
