"""FP4 quantization-aware training attention on the GPU (Attn-QAT-style, docs/algorithms.md §6).

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

``window=(left, right)`` (docs/algorithms.md §1.8; -1: unbounded; ``causal=True`` is ``(-1, 0)``) masks ``S``: row
``i`` sees key ``j`` iff ``i + Nk - Nq - left <= j <= i + Nk - Nq + right``. The fake quantization (V's 16-token
blocks along all the keys) and fq_P's 64-key tiles are unchanged, as in ``sagecupy.reference.qat``; the kernels visit
only the tiles inside the window, and the residuals carry it to the backward. A row that sees no key gives ``O = 0``,
``LSE = -inf`` and zero gradients.
"""
from __future__ import annotations

from dataclasses import dataclass

from . import _checks, _layout
from ._loader import get_function
from .config import QATConfig
from .nvfp4 import (MMA_WARPS, causal_group_suffix, causal_shape, check_support, compile_list, fp4_causal_group,
                    kernel_request, kernel_window, prepare_input, quant_function, validated_problem)

__all__ = ["forward", "backward", "qat_attention", "is_supported", "Residuals", "fake_quantize", "check_residuals"]

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
    # (QATConfig does not check its field types; a float or bool where the kernels take an int is refused here)
    if isinstance(cfg.block_kv, bool) or not isinstance(cfg.block_kv, int):
        return f"block_kv={cfg.block_kv!r} must be an int ({_BKV})"
    for field in ("two_level_p", "quantize"):
        if not isinstance(getattr(cfg, field), bool):
            return f"{field}={getattr(cfg, field)!r} must be a bool"
    if cfg.block_kv != _BKV:
        return f"block_kv={cfg.block_kv} is not supported by the kernels; supported: {_BKV}"
    if not cfg.two_level_p:
        return ("two_level_p=False is reference-only: single-level fq_P quantizes the normalized P, which the "
                "one-pass forward kernel cannot know")
    if not cfg.quantize:
        return "quantize=False is a reference-only switch"
    return None


def is_supported(q, k, v, *, causal=False, sm_scale=None, layout="HND", config=None,
                 engine=None, window=None) -> tuple[bool, str]:
    """(True, "") if :func:`forward` accepts these arguments (``engine`` and ``window`` included) on the current
    device, else (False, why). Never raises."""
    return check_support(q, k, v, causal, sm_scale, layout, config, _get_config, _unsupported_config, engine,
                         qat=True, window=window)


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
    raw, T, (B, H, N, D), (sb, sh, sn) = prepare_input(x, "x", layout)
    need = N if along == "channels" else _layout.roundup(N, 16)
    if n_pad is None:
        n_pad = _layout.roundup(N, _BKV)
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
            quant_function("nvfp4_fq_rows", T)(((halves + 255) // 256, H, B), (256,),
                                    (raw, i64(sb), i64(sh), i64(sn), i32(N), i32(D), i32(n_pad), out, out_b))
        else:
            nblk = N * D // 16
            quant_function("nvfp4_fq_rows_any", T)(((nblk + 255) // 256, H, B), (256,),
                                        (raw, i64(sb), i64(sh), i64(sn), i32(N), i32(D), i32(n_pad), out, out_b))
    else:  # tokens
        work = D * (need // 16)
        quant_function("nvfp4_fq_tokens", T)(((work + 255) // 256, H, B), (256,),
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


def _fwd_request(T, D, engine, causal):
    """get_function's arguments ``(source, instance, all_names, arch)`` for the forward kernel on ``engine``
    (resolved): mma.sync with :data:`~sagecupy.nvfp4.MMA_WARPS` warps (in the NVFP4 forward's source), or the wgmma
    kernel with the causal dispatch group (``causal``: the kernel window's causal work shape,
    :func:`sagecupy.nvfp4.causal_shape`)."""
    if engine == "wgmma":
        return kernel_request("qat/qat_attn_fwd_sm90.cu",
                              f"qat_attn_fwd_sm90<{T}, {D}{causal_group_suffix(fp4_causal_group(causal))}>")
    return kernel_request("nvfp4/fp4_attn_fwd.cu", f"qat_attn_fwd<{T}, {D}, {MMA_WARPS}>")


def _fwd_fn(T, D, engine, causal):
    filename, name, all_names, arch = _fwd_request(T, D, engine, causal)
    return get_function(filename, name, all_names=all_names, arch=arch)


def forward(q, k, v, *, causal=False, sm_scale=None, layout="HND", config=None, return_lse=False, engine=None,
            window=None):
    """QAT forward. Returns ``(o, residuals)`` (``(o, lse, residuals)`` with ``return_lse``).

    Arguments as :func:`sagecupy.int8.forward`: fp16 or bf16, D 64 or 128, GQA, both layouts, causal
    bottom-right aligned, ``window`` None or ``(left, right)`` (module docstring; kept in the residuals), any N
    (bf16: CuPy arrays of ``ml_dtypes.bfloat16`` or BF16Arrays; ``o`` takes q's form, the backward's gradients
    ``do``'s). ``o = fq_P(P) V~`` in q's dtype and layout; ``lse`` float32 (B, Hq, Nq) natural log. Inputs are never
    modified. ``engine``: as :func:`sagecupy.nvfp4.fp4_engine` (``None`` or ``"auto"``: wgmma on sm_90, mma.sync
    elsewhere).
    """
    import cupy

    from .nvfp4 import fp4_engine, fwd_smem_bytes, qat_fwd_sm90_smem_bytes

    q, k, v, p, cfg = validated_problem(q, k, v, causal, sm_scale, layout, config, _get_config, _unsupported_config, engine,
                                        qat=True, window=window)
    eng = fp4_engine(engine)
    win = kernel_window(p)
    B, Hq, Hkv, nq, nk, D = p.batch, p.heads_q, p.heads_kv, p.nq, p.nk, p.head_dim
    nq_pad, nk_pad = _layout.roundup(nq, _BQ_PAD), _layout.roundup(nk, _BKV)
    # fp16 operands for the forward kernel; for bf16 inputs the same values as bf16 in the same passes, kept for
    # the backward (whose products need dO's type), and the fp16 copies freed when this returns
    bf = p.dtype == "bfloat16"
    q_t, q_b = _fake_quantize(q, layout, "channels", nq_pad, bf)
    k_t, k_b = _fake_quantize(k, layout, "channels", nk_pad, bf)
    vt_t, vt_b = _fake_quantize(v, layout, "tokens", nk_pad, bf)
    o = _layout.empty((B, Hq, nq, D), layout, p.dtype)
    osb, osh, osn = _layout.strides(o, layout)
    lse = cupy.empty((B, Hq, nq), dtype=cupy.float32)
    lse2 = cupy.empty((B, Hq, nq_pad), dtype=cupy.float32)
    o_prime = cupy.empty((B, Hq, nq_pad, D), dtype=cupy.float32)
    fn = _fwd_fn(_T[p.dtype], D, eng, causal_shape(win))
    if eng == "wgmma":  # (two warpgroups: 128 query rows)
        smem, w = qat_fwd_sm90_smem_bytes(D), 8
    else:
        w = MMA_WARPS
        smem = fwd_smem_bytes(D, w)
    if smem > 48 * 1024:
        fn.max_dynamic_shared_size_bytes = smem
    i32, i64, f32 = cupy.int32, cupy.int64, cupy.float32
    fn((nq_pad // (16 * w), Hq, B), (32 * w,),
       (q_t, k_t, vt_t, o, i64(osb), i64(osh), i64(osn), lse, lse2, o_prime,
        i32(Hq), i32(Hkv), i32(nq), i32(nk), i32(nq_pad), i32(nk_pad), f32(p.sm_scale * LOG2E), i32(win[0]),
        i32(win[1])),
       shared_mem=smem)
    res = Residuals(p, cfg, q_b, k_b, vt_b, o_prime, lse2) if bf else Residuals(p, cfg, q_t, k_t, vt_t, o_prime, lse2)
    o = _checks.wrap(o, p.dtype, q)
    return (o, lse, res) if return_lse else (o, res)


def qat_attention(q, k, v, *, causal=False, sm_scale=None, layout="HND", return_lse=False, config=None, engine=None,
                  window=None):
    """The QAT forward alone (``o`` or ``(o, lse)``), e.g. to evaluate a QAT-trained model."""
    out = forward(q, k, v, causal=causal, sm_scale=sm_scale, layout=layout, config=config, return_lse=True,
                  engine=engine, window=window)
    return (out[0], out[1]) if return_lse else out[0]


def backward(residuals: Residuals, do, *, engine=None):
    """QAT backward: ``(dq, dk, dv)`` in the forward's layout and dtype, over the forward's window (the residuals'
    ``problem.window``). ``residuals`` are checked against the problem they claim (:func:`check_residuals`) before any
    launch.

    ``engine``: ``None`` or ``"auto"`` (the default: wgmma on sm_90, mma.sync elsewhere), ``"mma"`` or
    ``"wgmma"`` (see :func:`backward_engine`)."""
    return _backward(residuals, do, engine=engine)


# The backward's launches (kernels_cu/qat/qat_attn_bwd.cu: mma.sync, sm_80+; kernels_cu/qat/qat_attn_bwd_sm90.cu:
# wgmma, sm_90a).
_BWD_SOURCES = {"mma": ("qat/qat_attn_bwd.cu", "", None), "wgmma": ("qat/qat_attn_bwd_sm90.cu", "_sm90", "sm_90a")}


def _bwd_names(T, D, engine):
    sfx = _BWD_SOURCES[engine][1]
    return (f"qat_attn_bwd{sfx}<{T}, {D}>", f"qat_attn_bwd_dq{sfx}<{T}, {D}>")


def kernel_names() -> dict:
    out = {}
    for engine, (src, _, _) in _BWD_SOURCES.items():
        out[src] = [n for T in _T.values() for D in (64, 128) for n in _bwd_names(T, D, engine)]
    return out


def kernel_requests(dtype: str, D: int, engine: str) -> list:
    """What this family's calls on ``dtype`` inputs of head dim ``D`` pass to get_function on ``engine`` (``"mma"``
    or ``"wgmma"``), causal or not (any window), forward and backward: ``(source, instance, all_names, arch)`` tuples
    (:func:`sagecupy.warmup` compiles their modules). The fake quantizers and delta are in the NVFP4 quantizers'
    module."""
    T = _T[dtype]
    quant = compile_list("nvfp4/nvfp4_quant.cu")
    fwd = {_fwd_request(T, D, engine, causal) for causal in (False, True)}
    src, _, arch = _BWD_SOURCES[engine]
    names = _bwd_names(T, D, engine)
    return ([kernel_request("nvfp4/nvfp4_quant.cu", n) for n in quant] + sorted(fwd, key=str)
            + [(src, n, names, arch) for n in names])


def backward_engine(engine: str | None = None) -> str:
    """The tensor-core path the QAT backward uses: ``"wgmma"`` (Hopper, sm_90) or ``"mma"`` (mma.sync, sm_80+).

    ``engine``: ``None`` or ``"auto"`` (the default) picks ``"wgmma"`` on sm_90 and ``"mma"`` elsewhere. Both run the same element-wise steps
    (``kernels_cu/qat/bwd.cuh``) on the same 16-bit operands; they differ only through the fp32
    accumulation order inside the tensor cores (tested)."""
    return _layout.pick_engine(engine)


def bwd_smem_bytes(D: int) -> int:
    """The dK/dV kernel's: K~, V~, Q~, dO tiles, column maxima, block values of fq(P), per-query arrays, alignment."""
    return 4 * 64 * 2 * D + (4 * 64 + 8 * 64 + 2 * 64) * 4 + 128


def bwd_dq_smem_bytes(D: int) -> int:
    """The dQ kernel's: Q~ and dO tiles, two stages of K~ and V~, alignment."""
    return 6 * 64 * 2 * D + 128


def bwd_sm90_smem_bytes(D: int) -> tuple:
    """Dynamic shared memory of the wgmma kernels (QatBwdSm90 / QatBwdDqSm90 in qat/qat_attn_bwd_sm90.cu): (dK/dV,
    dQ) bytes, each with 1024 bytes of slack for the 1024-byte alignment wgmma tiles need."""
    tile = 128 * D
    stage = -(-(2 * tile + 512) // 1024) * 1024
    return 1024 + 2 * tile + 2 * stage + 12 * 64 * 4, 1024 + 2 * tile + 4 * tile


def kernel_constants() -> dict:
    """Host values the kernel sources define too (CI compiles ``static_assert(expression == value)``)."""
    out = []
    for D in (64, 128):
        kv, dq = bwd_sm90_smem_bytes(D)
        out += [(f"QatBwdSm90<{D}>::SMEM", kv), (f"QatBwdDqSm90<{D}>::SMEM", dq)]
    return {"qat/qat_attn_bwd_sm90.cu": out}


def check_residuals(res) -> None:
    """TypeError/ValueError naming the field unless ``res`` is a :class:`Residuals` whose arrays are what
    :func:`forward` makes for the problem it claims (``res.problem``): fq(Q) ``(B, Hq, nq_pad, D)`` and fq(K)
    ``(B, Hkv, nk_pad, D)``, fq(V)^T ``(B, Hkv, D, nk_pad)`` in the backward's operand type (fp16, or bf16 bits for
    bf16 inputs), O' ``(B, Hq, nq_pad, D)`` and the base-2 LSE ``(B, Hq, nq_pad)`` in float32, with the forward's
    padding (query rows to a multiple of 128, keys of 64); C-contiguous, 16-byte aligned, on the current device;
    and a config the kernels implement. The kernels index every residual from the problem's sizes, so a residual
    of another problem would make them read past its end. Metadata only (no device work)."""
    import cupy

    if not isinstance(res, Residuals):
        raise TypeError(f"residuals must be the Residuals returned by sagecupy.qat.forward, got {type(res).__name__}")
    _checks.check_problem(res.problem, "residuals.problem", layouts=("HND", "NHD"))  # QAT takes no packed sequences
    if not isinstance(res.config, QATConfig):
        raise TypeError(f"residuals.config must be a QATConfig, got {type(res.config).__name__}")
    why = _unsupported_config(res.config)
    if why:
        raise ValueError(f"residuals.config: {why}")
    p = res.problem
    B, Hq, Hkv, D = p.batch, p.heads_q, p.heads_kv, p.head_dim
    nq_pad, nk_pad = _layout.roundup(p.nq, _BQ_PAD), _layout.roundup(p.nk, _BKV)  # as forward pads them
    op = _layout.bits_dtype(p.dtype)  # (fp16 values for fp16 inputs, bf16 bits for bf16 ones)
    for name, shape, dtype in (("q_t", (B, Hq, nq_pad, D), op), ("k_t", (B, Hkv, nk_pad, D), op),
                               ("vt_t", (B, Hkv, D, nk_pad), op), ("o_prime", (B, Hq, nq_pad, D), cupy.float32),
                               ("lse2", (B, Hq, nq_pad), cupy.float32)):
        _checks.check_buffer(getattr(res, name), f"residuals.{name}", shape, dtype)


def _backward(res, do, engine=None):
    check_residuals(res)
    eng = backward_engine(engine)
    p = res.problem
    do = _checks.as_cupy(do, "do")
    shape = (p.batch, p.heads_q, p.nq, p.head_dim) if p.layout == "HND" else (p.batch, p.nq, p.heads_q, p.head_dim)
    if tuple(do.shape) != shape:
        raise ValueError(f"do.shape={tuple(do.shape)} must equal the output's shape {shape}")
    if _checks.dtype_name(do.dtype) != p.dtype:
        raise TypeError(f"do.dtype={_checks.dtype_name(do.dtype)} must equal the input dtype {p.dtype}")
    like = do  # (the gradients take do's bf16 form)
    do = _layout.prepare(do, "do", p.layout, True)
    return _bwd_launch(res, _bwd_operands(res, do, eng), eng, like)


def _bwd_kernels_only(res, do, engine=None):
    """A function that runs only the two backward kernels of ``_backward(res, do, engine=engine)`` on operands
    prepared once (the benchmark's kernel-only rows; ``do`` is not validated: pass what ``_backward`` accepts)."""

    check_residuals(res)
    eng = backward_engine(engine)
    ops = _bwd_operands(res, _layout.prepare(_checks.as_cupy(do, "do"), "do", res.problem.layout, True), eng)
    return lambda: _bwd_launch(res, ops, eng)


def _bwd_operands(res, do, eng):
    """delta and the kernels' 16-bit operands (the passes before the two kernels)."""
    import cupy

    from .nvfp4 import quant_function

    p = res.problem
    B, Hq, D = p.batch, p.heads_q, p.head_dim
    nq, nq_pad = p.nq, res.q_t.shape[2]
    T = _T[p.dtype]
    # delta = rowsum(dO o O') (O', not O: docs/algorithms.md §6.2)
    dsb, dsh, dsn = _layout.strides(do, p.layout)
    delta = cupy.empty((B, Hq, nq_pad), dtype=cupy.float32)
    quant_function("qat_delta", T)(
        (nq_pad // 8, Hq, B), (256,),
        (do, cupy.int64(dsb), cupy.int64(dsh), cupy.int64(dsn), res.o_prime, cupy.int32(nq), cupy.int32(nq_pad),
         cupy.int32(D), delta))
    # the forward keeps fq(Q), fq(K), fq(V)^T in the kernels' operand type (bf16 bits for bf16 inputs)
    q_t = cupy.ascontiguousarray(res.q_t)
    k_t = cupy.ascontiguousarray(res.k_t)
    # V~: the wgmma kernels read the forward's V~^T (B, Hkv, D, nk_pad) as it is; mma.sync wants (B, Hkv, nk_pad, D)
    v_n = cupy.ascontiguousarray(res.vt_t if eng == "wgmma" else res.vt_t.transpose(0, 1, 3, 2))
    return do, delta, q_t, k_t, v_n


def _bwd_launch(res, ops, eng, like=None):
    """The dK/dV and dQ kernels on prepared operands (_bwd_operands); bf16 gradients in ``like``'s form
    (:func:`sagecupy._checks.wrap`)."""
    import cupy


    do, delta, q_t, k_t, v_n = ops
    p = res.problem
    B, Hq, Hkv, nq, nk, D = p.batch, p.heads_q, p.heads_kv, p.nq, p.nk, p.head_dim
    nq_pad, nk_pad = res.q_t.shape[2], res.k_t.shape[2]
    T = _T[p.dtype]
    win = tuple(cupy.int32(w) for w in kernel_window(p))
    dsb, dsh, dsn = _layout.strides(do, p.layout)
    dk = _layout.empty((B, Hkv, nk, D), p.layout, p.dtype)
    dv = _layout.empty((B, Hkv, nk, D), p.layout, p.dtype)
    ksb, ksh, ksn = _layout.strides(dk, p.layout)
    vvb, vvh, vvn = _layout.strides(dv, p.layout)
    names = _bwd_names(T, D, eng)
    src, _, arch = _BWD_SOURCES[eng]
    smem_kv, smem_q = bwd_sm90_smem_bytes(D) if eng == "wgmma" else (bwd_smem_bytes(D), bwd_dq_smem_bytes(D))
    i32, i64, f32 = cupy.int32, cupy.int64, cupy.float32
    log2e = 1.4426950408889634
    fn = get_function(src, names[0], all_names=names, arch=arch)
    if smem_kv > 48 * 1024:
        fn.max_dynamic_shared_size_bytes = smem_kv
    fn((nk_pad // 64, Hkv, B), (128,),
       (q_t, k_t, v_n, do, i64(dsb), i64(dsh), i64(dsn), res.lse2, delta,
        dk, i64(ksb), i64(ksh), i64(ksn), dv, i64(vvb), i64(vvh), i64(vvn),
        i32(Hq), i32(Hkv), i32(nq), i32(nk), i32(nq_pad), i32(nk_pad), f32(p.sm_scale * log2e), f32(p.sm_scale),
        *win),
       shared_mem=smem_kv)
    dq = _layout.empty((B, Hq, nq, D), p.layout, p.dtype)
    qsb, qsh, qsn = _layout.strides(dq, p.layout)
    fq = get_function(src, names[1], all_names=names, arch=arch)
    if smem_q > 48 * 1024:
        fq.max_dynamic_shared_size_bytes = smem_q
    fq((nq_pad // 64, Hq, B), (128,),
       (q_t, k_t, v_n, do, i64(dsb), i64(dsh), i64(dsn), res.lse2, delta, dq, i64(qsb), i64(qsh), i64(qsn),
        i32(Hq), i32(Hkv), i32(nq), i32(nk), i32(nq_pad), i32(nk_pad), f32(p.sm_scale * log2e), f32(p.sm_scale),
        *win),
       shared_mem=smem_q)
    return tuple(_checks.wrap(x, p.dtype, like) for x in (dq, dk, dv))
