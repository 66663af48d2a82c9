"""NVFP4 attention forward (SageAttention3-style microscaling), float64 simulator (docs/algorithms.md §5).

This is the function the GPU kernel computes, written with whole matrices.
Every quantizer is :mod:`sagecupy.reference.fp4`'s NVFP4 (1x16 blocks, E4M3
scales, E2M1 values); everything else is float64. With ``config.quantize=False``
every quantizer is the identity and :func:`forward` equals
:func:`sagecupy.reference.attention.attention_forward` to float64 rounding.

The computation, for each (batch, query head), in HND:

1. **K-smoothing** (``config.k_smoothing``): ``μ_K`` = mean of ``K`` over the
   tokens, per (batch, kv head, channel); ``Ks = K − μ_K``. With quantization on,
   as the GPU computes them: the float64 mean rounded to float32, ``Ks`` in
   float32 (the codes of ``Ks`` then match the kernel's bit for bit).
2. **Q-smoothing** (``config.q_smoothing``): the query rows are cut into blocks
   of ``config.block_q`` starting at row 0 (the last may be partial);
   ``μ_Qb`` = mean of block ``b``'s rows; ``Qs = Q − μ_Qb``;
   ``bias_b[j] = sm_scale · μ_Qb · Ks_j`` (float64, added to the scores of every
   row of block ``b``).
3. ``Q̂ = nvfp4(Qs)`` and ``K̂ = nvfp4(Ks)`` along D; ``V̂ = nvfp4(V)`` along the
   tokens (16 consecutive tokens per channel; ``Nk`` zero-padded to a multiple
   of 16). Q and K are quantized **unscaled** and ``sm_scale`` is applied after
   the product, because E4M3 rounding is not scale invariant (folding
   ``sm_scale`` into Q first would change the codes). ``config.tensor_scale``
   adds the per-tensor fp32 second level to each of the three quantizations
   (the "tensor" is the whole smoothed Q, K or V, all batches and heads).
4. ``S = sm_scale · Q̂ K̂ᵀ + bias``, masked entries ``-inf``.
5. Online softmax over KV tiles of ``config.block_kv`` keys, in increasing
   order: ``r_t = rowmax_t(S)``, ``m_t = max(m_{t−1}, r_t)`` (``m_{-1} = -inf``),
   ``P̃_t = exp(S_t − m_t)``; ``l_t = e^{m_{t−1} − m_t} l_{t−1} + rowsum(P̃_t)``
   with the **unquantized** ``P̃``.

   * ``two_level_p``: ``s1 = exp(r_t − m_t) / (448·6)``, ``P̂ = nvfp4(P̃_t / s1)``
     along the keys in 16-blocks inside the tile, and
     ``O_t = e^{m_{t−1} − m_t} O_{t−1} + (P̂ V̂_t) · s1``.
   * otherwise ``P̂ = nvfp4(P̃_t)`` directly (16-blocks along the keys) and
     ``O_t = e^{m_{t−1} − m_t} O_{t−1} + P̂ V̂_t``. This depends on the running
     max ``m_t``, hence on the tile order: increasing order is mirrored.

   A tile in which a row sees no key contributes nothing to that row (the
   ``-inf − -inf`` of a row that has seen no key yet is guarded).
6. ``O = O_last / l_last``; the returned LSE is the natural-log LSE of the
   **unsmoothed** logits: ``m_last + log l_last + sm_scale · q_i · μ_K``
   (``q_i`` the original query row). Fully masked rows: ``O = 0``,
   ``LSE = -inf``.

Vectorization: the running max is ``np.maximum.accumulate`` over the tile
maxima; unrolling the recurrences gives
``l_last = Σ_t e^{m_t − m_last} rowsum(P̃_t)`` and
``O_last = Σ_t e^{m_t − m_last} (s1_t P̂_t) V̂_t``, computed as one product.
``s1_t P̂_t`` is exactly :func:`sagecupy.reference.fp4.two_level_p_fake_quantize`
of ``P̃`` with ``block_kv`` (its ``max_tile(P̃_t) / 2688`` *is*
``exp(r_t − m_t) / 2688``: ``exp`` and the subtraction are monotone).
"""
from __future__ import annotations

import numpy as np

from sagecupy.config import NVFP4Config

from . import fp4
from .attention import (
    as_float64,
    check_memory,
    check_qkv,
    dense_bytes,
    expand_kv_heads,
    from_hnd,
    packed_sequences,
    resolve_sm_scale,
    resolve_window,
    to_hnd,
    visible_mask,
)

__all__ = ["forward", "quantize_inputs", "smooth", "peak_bytes"]

# Peak bytes per (B, Hq, Nq, Nk) entry (keys padded to the tiles) of :func:`forward`, which works on whole score
# tensors: S, its tiles, the running maxima per key, P̃, the two-level quantization's temporaries, P̂; an upper bound of
# tracemalloc's peak with a margin (tests/cpu/test_ref_chunked.py).
_SCORE_BYTES = 160


def peak_bytes(B: int, Hq: int, Nq: int, Nk: int, D: int, config=NVFP4Config()) -> int:
    """Bytes :func:`forward` holds at its peak for this size, what it compares with
    :data:`sagecupy.reference.attention.MEMORY_LIMIT` before any work."""
    tile = max(config.block_kv, fp4.NVFP4_BLOCK)
    return dense_bytes(B, Hq, Nq, -(-Nk // tile) * tile, D, scores=_SCORE_BYTES, rows=16)


def _check_config(config) -> NVFP4Config:
    if not isinstance(config, NVFP4Config):
        raise TypeError(f"config must be an NVFP4Config, got {type(config).__name__}")
    return config


def _check_bool(value, name):
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be a bool, got {value!r}")
    return bool(value)


def smooth(qh: np.ndarray, kh: np.ndarray, sm_scale: float, config: NVFP4Config) -> dict:
    """Steps 1-2 on HND float64 ``qh (B,Hq,Nq,D)``, ``kh (B,Hkv,Nk,D)``.

    Returns ``dict(qs, ks, mu_k, mu_q, bias)``: the smoothed operands, ``μ_K``
    ``(B,Hkv,1,D)`` (zeros when K-smoothing is off), ``μ_Q`` ``(B,Hq,nqb,D)``
    per query block (None when off) and the compact bias ``(B,Hq,nqb,Nk)``
    (``bias[..., b, j]`` applies to every row of query block ``b``; None when
    off). ``nqb = ceil(Nq / config.block_q)``.
    """
    B, Hq, Nq, D = qh.shape
    if config.k_smoothing:
        mu_k = kh.mean(axis=2, keepdims=True)
    else:
        mu_k = np.zeros(kh.shape[:2] + (1, D))
    if config.k_smoothing and config.quantize:
        # As the GPU does it: the float64 mean rounded to float32, subtracted in float32. K - μ_K decides the codes of
        # K, and a value within an fp32 rounding of a midpoint between two of them rounds to one code in float64 and
        # to the other in float32 (two of 2,000 NVFP4 fuzz cases, rows off by 15 %, `d33c279`).
        mu_k = mu_k.astype(np.float32)
        ks = (kh.astype(np.float32) - mu_k).astype(np.float64)
        mu_k = mu_k.astype(np.float64)
    else:
        ks = kh - mu_k
    mu_q = bias = None
    qs = qh
    if config.q_smoothing:
        bq = config.block_q
        nqb = -(-Nq // bq)
        block_of_row = np.arange(Nq) // bq
        sums = np.zeros((B, Hq, nqb, D))
        np.add.at(sums, (slice(None), slice(None), block_of_row), qh)
        counts = np.bincount(block_of_row, minlength=nqb).astype(np.float64)
        mu_q = sums / counts[:, None]
        qs = qh - mu_q[:, :, block_of_row]
        bias = sm_scale * np.matmul(mu_q, np.swapaxes(expand_kv_heads(ks, Hq), -1, -2))
    return {"qs": qs, "ks": ks, "mu_k": mu_k, "mu_q": mu_q, "bias": bias}


def _quantize_operands(qs, ks, vh, config: NVFP4Config):
    """Step 3: NVFP4 of Qs, Ks (along D) and V (along tokens, zero-padded to a multiple of 16).

    Returns ``(q_hat, k_hat, v_hat, codes)``; the hats are float64 HND arrays of
    the operands' shapes (padding dropped), ``codes`` the raw quantizer outputs.
    """
    ts = config.tensor_scale
    qc, qsc, qst = fp4.nvfp4_quantize(qs, axis=-1, tensor_scale=ts)
    kc, ksc, kst = fp4.nvfp4_quantize(ks, axis=-1, tensor_scale=ts)
    vt = fp4.pad_to_multiple(np.swapaxes(vh, -1, -2), fp4.NVFP4_BLOCK, axis=-1)  # (B,Hkv,D,Nk_pad)
    vc, vsc, vst = fp4.nvfp4_quantize(vt, axis=-1, tensor_scale=ts)
    nk = vh.shape[2]
    q_hat = fp4.nvfp4_dequantize(qc, qsc, qst)
    k_hat = fp4.nvfp4_dequantize(kc, ksc, kst)
    v_hat = np.swapaxes(fp4.nvfp4_dequantize(vc, vsc, vst)[..., :nk], -1, -2)
    codes = {"q": (qc, qsc, qst), "k": (kc, ksc, kst), "v": (vc, vsc, vst)}
    return q_hat, k_hat, v_hat, codes


def _validate(q, k, v, causal, sm_scale, layout, config):
    config = _check_config(config)
    _check_bool(causal, "causal")
    B, Hq, Hkv, Nq, Nk, D = check_qkv(q, k, v, layout)
    if config.quantize and D % fp4.NVFP4_BLOCK:
        raise ValueError(f"head dim D={D} is not supported by NVFP4 (1x16 blocks along D): it must be a multiple of 16")
    scale = resolve_sm_scale(sm_scale, D)
    qh = as_float64(to_hnd(q, layout), "q")
    kh = as_float64(to_hnd(k, layout), "k")
    vh = as_float64(to_hnd(v, layout), "v")
    return config, (B, Hq, Hkv, Nq, Nk, D), scale, qh, kh, vh


def quantize_inputs(q, k, v, *, sm_scale=None, layout="HND", config=NVFP4Config(), cu_seqlens_q=None,
                    cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None):
    """Smoothing + NVFP4 quantization of Q, K, V in the exchange format (steps 1-3).

    The GPU quantizers are tested bit-exact against this. Returns a dict (all
    arrays HND-based, whatever ``layout`` the inputs use):

    * ``"q_packed"`` uint8 ``(B,Hq,Nq,D/2)``, ``"q_scales"`` uint8 E4M3
      ``(B,Hq,Nq,D/16)``, ``"q_tensor_scale"`` (float or None) — of ``Qs``;
    * ``"k_packed"`` ``(B,Hkv,Nk,D/2)``, ``"k_scales"`` ``(B,Hkv,Nk,D/16)``,
      ``"k_tensor_scale"`` — of ``Ks``;
    * ``"v_packed"`` ``(B,Hkv,D,Nk16/2)``, ``"v_scales"`` ``(B,Hkv,D,Nk16/16)``,
      ``"v_tensor_scale"`` — of ``Vᵀ`` (V transposed so that the contraction
      axis, the tokens, is last), ``Nk16`` = ``Nk`` rounded up to a multiple of
      16 with zero tokens;
    * ``"mu_k"`` float64 ``(B,Hkv,1,D)`` (zeros when K-smoothing is off),
      ``"mu_q"`` ``(B,Hq,nqb,D)`` and ``"bias"`` ``(B,Hq,nqb,Nk)`` (None when
      Q-smoothing is off; see :func:`smooth`), ``"sm_scale"``.

    Packing: element ``2i`` in the low nibble (:func:`sagecupy.reference.fp4.pack_e2m1`).
    ``sm_scale`` matters only for the bias. ValueError if ``config.quantize`` is
    False (there is nothing to quantize) or ``D`` is not a multiple of 16.
    Packed (``layout="THD"``): a list with one such dict (batch 1) per sequence,
    None for a sequence without queries or keys (per-sequence μ_K, μ_Q and
    tensor scales).
    """
    packed = packed_sequences(q, k, v, layout, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    if packed is not None:
        return [quantize_inputs(q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], sm_scale=sm_scale, layout="NHD",
                                config=config) if q1 > q0 and k1 > k0 else None for q0, q1, k0, k1 in packed[1]]
    config, _, scale, qh, kh, vh = _validate(q, k, v, False, sm_scale, layout, config)
    if not config.quantize:
        raise ValueError("config.quantize is False: quantize_inputs needs a quantizing NVFP4Config")
    sm = smooth(qh, kh, scale, config)
    _, _, _, codes = _quantize_operands(sm["qs"], sm["ks"], vh, config)
    out = {}
    for name in ("q", "k", "v"):
        c, s, t = codes[name]
        out[f"{name}_packed"] = fp4.pack_e2m1(c, axis=-1)
        out[f"{name}_scales"] = s
        out[f"{name}_tensor_scale"] = t
    out.update(mu_k=sm["mu_k"], mu_q=sm["mu_q"], bias=sm["bias"], sm_scale=scale)
    return out


def forward(
    q, k, v, *, causal=False, sm_scale=None, layout="HND", config=NVFP4Config(), return_intermediates=False,
    window=None, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None,
):
    """NVFP4 attention forward (see the module docstring). Returns ``(o, lse)``.

    ``o`` float64 in ``layout``; ``lse`` float64 ``(B, Hq, Nq)``, natural log,
    of the unsmoothed logits. With ``return_intermediates=True`` returns
    ``(o, lse, dict)`` with HND float64 arrays: ``"q_hat"``, ``"k_hat"``
    (``(B,Hkv,Nk,D)``), ``"v_hat"``, ``"mu_k"``, ``"mu_q"``, ``"bias"`` (as in
    :func:`smooth`), ``"S"`` (the scores actually used, with bias, masked
    ``-inf``), ``"m_tiles"`` ``(B,Hq,Nq,T)`` (running max after each tile),
    ``"m"``, ``"l"`` ``(B,Hq,Nq)`` (final max and unquantized row sum),
    ``"P_hat"`` ``(B,Hq,Nq,Nk)`` (the quantized probabilities as they multiply
    ``V̂``, already rescaled to the final max: ``O = P_hat V̂ / l``), ``"O"``.

    ``window``: a sliding window (docs/algorithms.md §1.8): scores are masked;
    μ_K, V's 16-token blocks and the tile order stay those of all the keys.
    Packed (``layout="THD"``, ``cu_seqlens_q/k``): ``o`` ``(total_q, Hq, D)``,
    ``lse`` ``(Hq, total_q)``, each sequence computed on its own (its own μ_K,
    μ_Q and, with ``tensor_scale``, its own tensor scales); the intermediates a
    list per sequence (None for one without queries or keys).
    """
    return_intermediates = _check_bool(return_intermediates, "return_intermediates")
    _check_bool(causal, "causal")
    resolve_window(causal, window)
    packed = packed_sequences(q, k, v, layout, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    if packed is not None:
        (Hq, _, Tq, _, D), spans = packed
        o, lse, inters = np.zeros((Tq, Hq, D)), np.full((Hq, Tq), -np.inf), []
        for q0, q1, k0, k1 in spans:
            if q1 == q0 or k1 == k0:
                inters.append(None)
                continue
            r = forward(q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], causal=causal, sm_scale=sm_scale,
                        layout="NHD", config=config, return_intermediates=return_intermediates, window=window)
            o[q0:q1], lse[:, q0:q1] = r[0][0], r[1][0]
            inters.append(r[2] if return_intermediates else None)
        return (o, lse, inters) if return_intermediates else (o, lse)
    config, (B, Hq, Hkv, Nq, Nk, D), scale, qh, kh, vh = _validate(q, k, v, causal, sm_scale, layout, config)
    check_memory(f"the float64 NVFP4 simulator (B={B}, Hq={Hq}, Nq={Nq}, Nk={Nk}, D={D}, dense (B, Hq, Nq, Nk) "
                 f"tensors)", peak_bytes(B, Hq, Nq, Nk, D, config))
    sm = smooth(qh, kh, scale, config)
    if config.quantize:
        q_hat, k_hat, v_hat, _ = _quantize_operands(sm["qs"], sm["ks"], vh, config)
    else:
        q_hat, k_hat, v_hat = sm["qs"], sm["ks"], vh

    # step 4: scores
    s = scale * np.matmul(q_hat, np.swapaxes(expand_kv_heads(k_hat, Hq), -1, -2))
    if sm["bias"] is not None:
        s = s + sm["bias"][:, :, np.arange(Nq) // config.block_q]
    mask = visible_mask(Nq, Nk, causal, window)
    s = np.where(mask, s, -np.inf)

    # step 5: online softmax over KV tiles, vectorized
    bkv = config.block_kv
    ntiles = -(-Nk // bkv)
    tile_of_key = np.arange(Nk) // bkv
    s_tiles = fp4.pad_to_multiple(s, bkv, axis=-1)
    s_tiles[..., Nk:] = -np.inf
    r = s_tiles.reshape(B, Hq, Nq, ntiles, bkv).max(axis=-1)  # r_t, -inf where a tile is masked
    m_tiles = np.maximum.accumulate(r, axis=-1)  # m_t
    m_last = m_tiles[..., -1]
    m_key = m_tiles[..., tile_of_key]  # m_t of each key's tile
    seen = np.isfinite(m_key)  # the row has seen a key by this tile
    p_tilde = np.exp(s - np.where(seen, m_key, 0.0))  # masked keys: exp(-inf) = 0
    p_tilde = np.where(seen, p_tilde, 0.0)
    if not config.quantize:
        p_hat = p_tilde
    elif config.two_level_p:
        p_hat = fp4.two_level_p_fake_quantize(p_tilde, bkv, axis=-1)  # s1 · P̂ per tile
    else:
        padded = fp4.pad_to_multiple(p_tilde, fp4.NVFP4_BLOCK, axis=-1)
        p_hat = fp4.nvfp4_fake_quantize(padded, axis=-1)[..., :Nk]
    row_seen = np.isfinite(m_last)
    m_last_safe = np.where(row_seen, m_last, 0.0)
    rescale = np.where(seen, np.exp(np.where(seen, m_key, 0.0) - m_last_safe[..., None]), 0.0)  # e^{m_t − m_last}
    l = np.sum(p_tilde * rescale, axis=-1)
    p_final = p_hat * rescale
    o_last = np.matmul(p_final, expand_kv_heads(v_hat, Hq))

    # step 6
    ok = row_seen & (l > 0)
    o = o_last / np.where(ok, l, 1.0)[..., None]
    o = np.where(ok[..., None], o, 0.0)
    q_mu_k = scale * np.sum(qh * expand_kv_heads(sm["mu_k"], Hq), axis=-1)
    lse = np.where(ok, m_last_safe + np.log(np.where(ok, l, 1.0)) + q_mu_k, -np.inf)
    o_out = from_hnd(o, layout)
    if not return_intermediates:
        return o_out, lse
    inter = {
        "q_hat": q_hat,
        "k_hat": k_hat,
        "v_hat": v_hat,
        "mu_k": sm["mu_k"],
        "mu_q": sm["mu_q"],
        "bias": sm["bias"],
        "S": s,
        "m_tiles": m_tiles,
        "m": m_last,
        "l": l,
        "P_hat": p_final,
        "O": o,
    }
    return o_out, lse, inter
