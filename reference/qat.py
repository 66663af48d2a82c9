"""FP4 quantization-aware attention (Attn-QAT-style), float64 simulator (docs/algorithms.md §6).

``fq`` is NVFP4 fake quantization (:func:`sagecupy.reference.fp4.nvfp4_fake_quantize`,
quantize then dequantize) with a straight-through gradient.

Forward (:func:`forward`), in HND:

* ``Q̃ = fq(Q)``, ``K̃ = fq(K)`` along D (16-blocks of channels);
  ``Ṽ = fq(V)`` along the tokens (16 consecutive tokens per channel, ``Nk``
  zero-padded to a multiple of 16, padding dropped afterwards). No per-tensor
  scale (``QATConfig`` has none).
* ``S = sm_scale · Q̃ K̃ᵀ`` (masked ``-inf``), ``P = softmax(S)`` with the row
  sum of the unquantized probabilities, ``LSE`` its natural-log normalizer.
* ``O = fq_P(P) Ṽ`` where ``fq_P`` is
  :func:`~sagecupy.reference.fp4.two_level_p_fake_quantize` with
  ``config.block_kv`` when ``config.two_level_p``, else plain NVFP4 of ``P``
  along the keys (16-blocks aligned at key 0, zero-padded). Also the
  high-precision ``O′ = P Ṽ``, which the backward needs.

Why the fused kernel's two-level quantization *is* ``fq_P`` of the normalized
``P``: the kernel only has the unnormalized ``P̃_t = exp(S − m_t)`` of tile
``t`` (``m_t`` the running max). It scales each row of the tile by
``s1 = max_tile(P̃_t) / (448·6)``, so it quantizes
``P̃_t / s1 = 448·6 · exp(S − r_t)`` with ``r_t`` the row's max over the tile —
a quantity that depends neither on ``m_t`` nor on the final normalization.
The normalized ``P = exp(S − LSE)`` scaled by its own tile max gives the very
same ``448·6 · exp(S − r_t)``, hence the same E4M3 scales and E2M1 codes; and
the kernel's final factor ``s1 · e^{m_t − m_last} / l = exp(r_t − LSE) / 2688``
is exactly the normalized tile's ``s1``. So ``O_kernel = fq_P(P) Ṽ`` up to the
rounding of the float arithmetic. (Without two-level P this is *not* so: the
E4M3 block scale of ``max/6`` is not scale invariant, so quantizing
``exp(S − m_t)`` and quantizing ``P`` give different codes. The reference
defines single-level ``fq_P`` on the normalized ``P``.)

Backward (:func:`backward`): recompute ``P = exp(S − LSE)`` from ``Q̃, K̃`` (the
forward's quantization, not the full-precision inputs);
``dV = fq_P(P)ᵀ dO``; ``dP = dO Ṽᵀ``; ``δ = rowsum(dO ∘ O′)``;
``dS = P ∘ (dP − δ)``; ``dQ = sm_scale · dS K̃``; ``dK = sm_scale · dSᵀ Q̃``;
GQA sums ``dK``, ``dV`` over each group; the gradients pass straight through
``fq`` to ``Q, K, V``. With ``δ`` from ``O′``, ``dQ`` and ``dK`` are the exact
gradients of ``⟨dO, O′⟩`` with respect to ``Q̃`` and ``K̃`` (straight-through
for ``fq_P``), and ``dV`` is the exact gradient of ``⟨dO, O⟩`` with respect to
``Ṽ``. ``δ`` from ``O`` (``delta_from="o"``, offered only so tests can show the
difference) breaks the identity ``rowsum(P ∘ dP) = rowsum(dO ∘ O)`` that holds
only for ``O = P Ṽ``: the rows of ``dS`` then no longer sum to zero and ``dQ``,
``dK`` are wrong.

``config.quantize=False`` makes every ``fq`` the identity: forward and backward
equal :mod:`sagecupy.reference.attention`'s exact ones.
"""
from __future__ import annotations

import numpy as np

from sagecupy.config import QATConfig

from . import fp4
from .attention import (
    as_float64,
    check_memory,
    check_qkv,
    dense_bytes,
    expand_kv_heads,
    from_hnd,
    masked_softmax,
    packed_sequences,
    resolve_sm_scale,
    resolve_window,
    sum_kv_groups,
    to_hnd,
    visible_mask,
)

__all__ = ["forward", "backward", "fake_quantize_inputs", "fake_quantize_p", "peak_bytes"]

# Peak bytes per (B, Hq, Nq, Nk) entry (keys padded to the tiles) of :func:`forward` and of :func:`backward`, which
# work on whole score tensors (S, P, fq_P(P) and its quantizer's temporaries; the backward's dP and dS); an upper
# bound of tracemalloc's peak with a margin (tests/cpu/test_ref_chunked.py).
_SCORE_BYTES = 144


def peak_bytes(B: int, Hq: int, Nq: int, Nk: int, D: int, config=QATConfig()) -> int:
    """Bytes :func:`forward` or :func:`backward` holds at its peak for this size, what each compares with
    :data:`sagecupy.reference.attention.MEMORY_LIMIT` before any work."""
    tile = max(config.block_kv, fp4.NVFP4_BLOCK)
    return dense_bytes(B, Hq, Nq, -(-Nk // tile) * tile, D, scores=_SCORE_BYTES, rows=16)


def _check_memory(B, Hq, Nq, Nk, D, config):
    check_memory(f"the float64 QAT simulator (B={B}, Hq={Hq}, Nq={Nq}, Nk={Nk}, D={D}, dense (B, Hq, Nq, Nk) "
                 f"tensors)", peak_bytes(B, Hq, Nq, Nk, D, config))

_RESIDUAL_KEYS = ("q_t", "k_t", "v_t", "o_prime", "o", "lse", "causal", "sm_scale", "layout", "config", "Hq", "Hkv")


def _check_config(config) -> QATConfig:
    if not isinstance(config, QATConfig):
        raise TypeError(f"config must be a QATConfig, got {type(config).__name__}")
    return config


def fake_quantize_inputs(qh, kh, vh, config: QATConfig):
    """``(Q̃, K̃, Ṽ)`` of HND float64 operands: NVFP4 along D for Q, K; along tokens for V.

    Identity copies when ``config.quantize`` is False. ValueError if D is not a
    multiple of 16 while quantizing.
    """
    config = _check_config(config)
    if not config.quantize:
        return qh.copy(), kh.copy(), vh.copy()
    D = qh.shape[-1]
    if D % fp4.NVFP4_BLOCK:
        raise ValueError(f"head dim D={D} is not supported by NVFP4 (1x16 blocks along D): it must be a multiple of 16")
    q_t = fp4.nvfp4_fake_quantize(qh, axis=-1)
    k_t = fp4.nvfp4_fake_quantize(kh, axis=-1)
    nk = vh.shape[2]
    v_t = fp4.nvfp4_fake_quantize(fp4.pad_to_multiple(vh, fp4.NVFP4_BLOCK, axis=2), axis=2)[:, :, :nk]
    return q_t, k_t, v_t


def fake_quantize_p(p: np.ndarray, config: QATConfig) -> np.ndarray:
    """``fq_P(P)`` along the last axis (the keys); see the module docstring."""
    config = _check_config(config)
    if not config.quantize:
        return p.copy()
    if config.two_level_p:
        return fp4.two_level_p_fake_quantize(p, config.block_kv, axis=-1)
    nk = p.shape[-1]
    return fp4.nvfp4_fake_quantize(fp4.pad_to_multiple(p, fp4.NVFP4_BLOCK, axis=-1), axis=-1)[..., :nk]


def _scores(q_t, k_t, Hq, scale, mask):
    s = scale * np.matmul(q_t, np.swapaxes(expand_kv_heads(k_t, Hq), -1, -2))
    return np.where(mask, s, -np.inf)


def forward(q, k, v, *, causal=False, sm_scale=None, layout="HND", config=QATConfig(), return_intermediates=False,
            window=None, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None):
    """QAT forward; returns ``(o, residuals)`` (``(o, residuals, intermediates)`` when asked).

    ``o`` float64 in ``layout``. ``residuals`` (everything :func:`backward`
    needs): ``"q_t"`` ``(B,Hq,Nq,D)``, ``"k_t"``, ``"v_t"`` ``(B,Hkv,Nk,D)``
    (fake-quantized, HND), ``"o_prime"`` (``P Ṽ``, HND), ``"o"`` (``fq_P(P) Ṽ``,
    HND), ``"lse"`` ``(B,Hq,Nq)`` natural log, ``"causal"``, ``"sm_scale"``
    (resolved float), ``"layout"``, ``"config"``, ``"Hq"``, ``"Hkv"``.
    ``intermediates``: ``"S"``, ``"P"``, ``"P_q"`` (``fq_P(P)``), all
    ``(B,Hq,Nq,Nk)``.

    ``window``: a sliding window (docs/algorithms.md §1.8), a mask on ``S``; the
    fake quantization of Q, K, V (16-blocks, V's along all the keys) and
    ``fq_P``'s blocks are unchanged (masked ``P`` is 0). Packed
    (``layout="THD"``, ``cu_seqlens_q/k``): ``o`` ``(total_q, Hq, D)`` and
    residuals ``{"layout": "THD", "sequences": [each sequence's residuals or
    None], "spans", "shape", "lse" (Hq, total_q)}``; intermediates a list per
    sequence.
    """
    config = _check_config(config)
    if not isinstance(causal, (bool, np.bool_)):
        raise TypeError(f"causal must be a bool, got {causal!r}")
    if not isinstance(return_intermediates, (bool, np.bool_)):
        raise TypeError(f"return_intermediates must be a bool, got {return_intermediates!r}")
    resolve_window(causal, window)
    packed = packed_sequences(q, k, v, layout, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    if packed is not None:
        (Hq, Hkv, Tq, Tk, D), spans = packed
        o, lse, seqs, inters = np.zeros((Tq, Hq, D)), np.full((Hq, Tq), -np.inf), [], []
        for q0, q1, k0, k1 in spans:
            if q1 == q0 or k1 == k0:
                seqs.append(None)
                inters.append(None)
                continue
            r = forward(q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], causal=causal, sm_scale=sm_scale,
                        layout="NHD", config=config, return_intermediates=return_intermediates, window=window)
            o[q0:q1], lse[:, q0:q1] = r[0][0], r[1]["lse"][0]
            seqs.append(r[1])
            inters.append(r[2] if return_intermediates else None)
        res = {"layout": "THD", "sequences": seqs, "spans": spans, "shape": (Hq, Hkv, Tq, Tk, D), "lse": lse}
        return (o, res, inters) if return_intermediates else (o, res)
    B, Hq, Hkv, Nq, Nk, D = check_qkv(q, k, v, layout)
    _check_memory(B, Hq, Nq, Nk, D, config)
    scale = resolve_sm_scale(sm_scale, D)
    qh = as_float64(to_hnd(q, layout), "q")
    kh = as_float64(to_hnd(k, layout), "k")
    vh = as_float64(to_hnd(v, layout), "v")
    q_t, k_t, v_t = fake_quantize_inputs(qh, kh, vh, config)
    s = _scores(q_t, k_t, Hq, scale, visible_mask(Nq, Nk, bool(causal), window))
    p, _, l, lse = masked_softmax(s)
    # A row with a NaN logit (a NaN block of Q~ or K~) has a NaN row sum, which masked_softmax counts as seeing no
    # key (LSE -inf); its LSE is NaN, as the kernels store it, so that the backward's P of that row is NaN as well.
    lse = np.where(np.isnan(l), np.nan, lse)
    p_q = fake_quantize_p(p, config)
    v_x = expand_kv_heads(v_t, Hq)
    o = np.matmul(p_q, v_x)
    o_prime = np.matmul(p, v_x)
    residuals = {
        "q_t": q_t,
        "k_t": k_t,
        "v_t": v_t,
        "o_prime": o_prime,
        "o": o,
        "lse": lse,
        "causal": bool(causal),
        "window": window,
        "sm_scale": scale,
        "layout": layout,
        "config": config,
        "Hq": Hq,
        "Hkv": Hkv,
    }
    if return_intermediates:
        return from_hnd(o, layout), residuals, {"S": s, "P": p, "P_q": p_q}
    return from_hnd(o, layout), residuals


def backward(residuals: dict, do, *, delta_from: str = "o_prime"):
    """QAT backward (see the module docstring); returns ``(dq, dk, dv)`` in the forward's layout.

    ``delta_from="o_prime"`` (default, correct) or ``"o"`` (wrong on purpose:
    exists so the tests can show the difference). Packed residuals
    (``layout="THD"``): ``do`` ``(total_q, Hq, D)``, gradients packed
    (``dk``, ``dv`` ``(total_k, Hkv, D)``), sequence by sequence.
    """
    if isinstance(residuals, dict) and residuals.get("layout") == "THD":
        Hq, Hkv, Tq, Tk, D = residuals["shape"]
        if not hasattr(do, "shape") or tuple(do.shape) != (Tq, Hq, D):
            raise ValueError(f"do must have shape {(Tq, Hq, D)} (layout='THD'), got "
                             f"{tuple(getattr(do, 'shape', ()))}")
        dq, dk, dv = np.zeros((Tq, Hq, D)), np.zeros((Tk, Hkv, D)), np.zeros((Tk, Hkv, D))
        for res, (q0, q1, k0, k1) in zip(residuals["sequences"], residuals["spans"]):
            if res is not None:
                g = backward(res, do[None, q0:q1], delta_from=delta_from)
                dq[q0:q1], dk[k0:k1], dv[k0:k1] = g[0][0], g[1][0], g[2][0]
        return dq, dk, dv
    if not isinstance(residuals, dict) or any(key not in residuals for key in _RESIDUAL_KEYS):
        missing = [key for key in _RESIDUAL_KEYS if not isinstance(residuals, dict) or key not in residuals]
        raise ValueError(f"residuals must be the dict returned by qat.forward; missing {missing}")
    if delta_from not in ("o_prime", "o"):
        raise ValueError(f"delta_from={delta_from!r} is not supported; supported: 'o_prime', 'o'")
    r = residuals
    config = _check_config(r["config"])
    q_t, k_t, v_t, scale, layout = r["q_t"], r["k_t"], r["v_t"], r["sm_scale"], r["layout"]
    B, Hq, Nq, D = q_t.shape
    Hkv, Nk = k_t.shape[1], k_t.shape[2]
    _check_memory(B, Hq, Nq, Nk, D, config)
    if not hasattr(do, "ndim") or do.ndim != 4:
        raise ValueError(f"do must be a 4-D array in layout {layout!r}")
    doh = as_float64(to_hnd(do, layout), "do")
    if doh.shape != (B, Hq, Nq, D):
        raise ValueError(f"do must have HND shape {(B, Hq, Nq, D)} ({layout=}), got shape {tuple(do.shape)}")

    s = _scores(q_t, k_t, Hq, scale, visible_mask(Nq, Nk, r["causal"], r.get("window")))
    lse = r["lse"]
    # P = 0 where a row sees no key (LSE -inf) and where S is masked; a NaN LSE (the row has a NaN logit) makes the
    # row's visible P NaN, hence fq_P(P) NaN in every tile where the row sees a key and dV of those keys NaN, as the
    # kernels give (their tile maxima propagate NaN; qat/bwd.cuh). (np.isfinite(lse) would take a NaN row for
    # one that sees nothing: P = 0 and a silent finite dV.)
    row_ok = lse != -np.inf
    p = np.where(row_ok[..., None] & (s != -np.inf), np.exp(s - np.where(row_ok, lse, 0.0)[..., None]), 0.0)
    p_q = fake_quantize_p(p, config)
    v_x = expand_kv_heads(v_t, Hq)
    dv = sum_kv_groups(np.matmul(np.swapaxes(p_q, -1, -2), doh), Hkv)
    dp = np.matmul(doh, np.swapaxes(v_x, -1, -2))
    delta = np.sum(doh * r[delta_from], axis=-1)
    ds = p * (dp - delta[..., None])
    dq = scale * np.matmul(ds, expand_kv_heads(k_t, Hq))
    dk = sum_kv_groups(scale * np.matmul(np.swapaxes(ds, -1, -2), q_t), Hkv)
    return from_hnd(dq, layout), from_hnd(dk, layout), from_hnd(dv, layout)
