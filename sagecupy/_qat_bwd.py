"""The FP4 QAT backward launch (kernels_cu/qat_attn_bwd.cu: mma.sync, sm_80+; kernels_cu/qat_attn_bwd_sm90.cu:
wgmma, sm_90a); the public entry is :func:`sagecupy.qat.backward`."""
from __future__ import annotations

from . import _checks
from ._loader import get_function

_T = {"float16": "__half", "bfloat16": "__nv_bfloat16"}


_SOURCES = {"mma": ("qat_attn_bwd.cu", "", None), "wgmma": ("qat_attn_bwd_sm90.cu", "_sm90", "sm_90a")}


def _names(T, D, engine):
    sfx = _SOURCES[engine][1]
    return (f"qat_attn_bwd{sfx}<{T}, {D}>", f"qat_attn_bwd_dq{sfx}<{T}, {D}>")


def kernel_names() -> dict:
    out = {}
    for engine, (src, _, _) in _SOURCES.items():
        out[src] = [n for T in _T.values() for D in (64, 128) for n in _names(T, D, engine)]
    return out


def backward_engine(engine: str | None = None) -> str:
    """The tensor-core path the QAT backward uses: ``"wgmma"`` (Hopper, sm_90) or ``"mma"`` (mma.sync, sm_80+).

    ``engine``: ``"auto"`` (default; the environment variable ``SAGECUPY_BWD_ENGINE`` overrides it, as for the
    INT8 backward) picks ``"wgmma"`` on sm_90 and ``"mma"`` elsewhere. Both run the same element-wise steps
    (``kernels_cu/common/qat_bwd.cuh``) on the same 16-bit operands; they differ only through the fp32
    accumulation order inside the tensor cores (tested)."""
    from .int8 import _pick_engine

    return _pick_engine(engine, "SAGECUPY_BWD_ENGINE")


def smem_bytes(D: int) -> int:
    """The dK/dV kernel's: K~, V~, Q~, dO tiles, column maxima, block values of fq(P), per-query arrays, alignment."""
    return 4 * 64 * 2 * D + (4 * 64 + 8 * 64 + 2 * 64) * 4 + 128


def dq_smem_bytes(D: int) -> int:
    """The dQ kernel's: Q~ and dO tiles, two stages of K~ and V~, alignment."""
    return 6 * 64 * 2 * D + 128


def sm90_smem_bytes(D: int) -> tuple:
    """Dynamic shared memory of the wgmma kernels (QatBwdSm90 / QatBwdDqSm90 in qat_attn_bwd_sm90.cu): (dK/dV,
    dQ) bytes, each with 1024 bytes of slack for the 1024-byte alignment wgmma tiles need."""
    tile = 128 * D
    stage = -(-(2 * tile + 512) // 1024) * 1024
    return 1024 + 2 * tile + 2 * stage + 12 * 64 * 4, 1024 + 2 * tile + 4 * tile


def kernel_constants() -> dict:
    """Host values the kernel sources define too (CI compiles ``static_assert(expression == value)``)."""
    out = []
    for D in (64, 128):
        kv, dq = sm90_smem_bytes(D)
        out += [(f"QatBwdSm90<{D}>::SMEM", kv), (f"QatBwdDqSm90<{D}>::SMEM", dq)]
    return {"qat_attn_bwd_sm90.cu": out}


def backward(res, do, engine=None):
    from .int8 import _prepare
    from .qat import Residuals

    if not isinstance(res, Residuals):
        raise TypeError(f"residuals must be the Residuals returned by sagecupy.qat.forward, got {type(res).__name__}")
    eng = backward_engine(engine)
    p = res.problem
    do = _checks.as_cupy(do, "do")
    shape = (p.batch, p.heads_q, p.nq, p.head_dim) if p.layout == "HND" else (p.batch, p.nq, p.heads_q, p.head_dim)
    if tuple(do.shape) != shape:
        raise ValueError(f"do.shape={tuple(do.shape)} must equal the output's shape {shape}")
    if _checks.dtype_name(do.dtype) != p.dtype:
        raise TypeError(f"do.dtype={_checks.dtype_name(do.dtype)} must equal the input dtype {p.dtype}")
    do = _prepare(do, "do", p.layout, True)
    return _launch(res, _operands(res, do, eng), eng)


def _kernels_only(res, do, engine=None):
    """A function that runs only the two backward kernels of ``backward(res, do, engine=engine)`` on operands
    prepared once (the benchmark's kernel-only rows; ``do`` is not validated: pass what ``backward`` accepts)."""
    from .int8 import _prepare

    eng = backward_engine(engine)
    ops = _operands(res, _prepare(_checks.as_cupy(do, "do"), "do", res.problem.layout, True), eng)
    return lambda: _launch(res, ops, eng)


def _operands(res, do, eng):
    """delta and the kernels' 16-bit operands (the passes before the two kernels)."""
    import cupy

    from .int8 import _strides
    from .nvfp4 import _fn

    p = res.problem
    B, Hq, D = p.batch, p.heads_q, p.head_dim
    nq, nq_pad = p.nq, res.q_t.shape[2]
    T = _T[p.dtype]
    # delta = rowsum(dO o O') (O', not O: SPEC §6)
    dsb, dsh, dsn = _strides(do, p.layout)
    delta = cupy.empty((B, Hq, nq_pad), dtype=cupy.float32)
    _fn("qat_delta", T)(
        (nq_pad // 8, Hq, B), (256,),
        (do, cupy.int64(dsb), cupy.int64(dsh), cupy.int64(dsn), res.o_prime, cupy.int32(nq), cupy.int32(nq_pad),
         cupy.int32(D), delta))
    # the forward keeps fq(Q), fq(K), fq(V)^T in the kernels' operand type (bf16 bits for bf16 inputs)
    q_t = cupy.ascontiguousarray(res.q_t)
    k_t = cupy.ascontiguousarray(res.k_t)
    # V~: the wgmma kernels read the forward's V~^T (B, Hkv, D, nk_pad) as it is; mma.sync wants (B, Hkv, nk_pad, D)
    v_n = cupy.ascontiguousarray(res.vt_t if eng == "wgmma" else res.vt_t.transpose(0, 1, 3, 2))
    return do, delta, q_t, k_t, v_n


def _launch(res, ops, eng):
    """The dK/dV and dQ kernels on prepared operands (_operands)."""
    import cupy

    from .int8 import _empty, _strides

    do, delta, q_t, k_t, v_n = ops
    p = res.problem
    B, Hq, Hkv, nq, nk, D = p.batch, p.heads_q, p.heads_kv, p.nq, p.nk, p.head_dim
    nq_pad, nk_pad = res.q_t.shape[2], res.k_t.shape[2]
    T = _T[p.dtype]
    dsb, dsh, dsn = _strides(do, p.layout)
    dk = _empty((B, Hkv, nk, D), p.layout, p.dtype)
    dv = _empty((B, Hkv, nk, D), p.layout, p.dtype)
    ksb, ksh, ksn = _strides(dk, p.layout)
    vvb, vvh, vvn = _strides(dv, p.layout)
    names = _names(T, D, eng)
    src, _, arch = _SOURCES[eng]
    smem_kv, smem_q = sm90_smem_bytes(D) if eng == "wgmma" else (smem_bytes(D), dq_smem_bytes(D))
    i32, i64, f32 = cupy.int32, cupy.int64, cupy.float32
    log2e = 1.4426950408889634
    fn = get_function(src, names[0], all_names=names, arch=arch)
    if smem_kv > 48 * 1024:
        fn.max_dynamic_shared_size_bytes = smem_kv
    fn((nk_pad // 64, Hkv, B), (128,),
       (q_t, k_t, v_n, do, i64(dsb), i64(dsh), i64(dsn), res.lse2, delta,
        dk, i64(ksb), i64(ksh), i64(ksn), dv, i64(vvb), i64(vvh), i64(vvn),
        i32(Hq), i32(Hkv), i32(nq), i32(nk), i32(nq_pad), i32(nk_pad), f32(p.sm_scale * log2e), f32(p.sm_scale),
        i32(int(p.causal))),
       shared_mem=smem_kv)
    dq = _empty((B, Hq, nq, D), p.layout, p.dtype)
    qsb, qsh, qsn = _strides(dq, p.layout)
    fq = get_function(src, names[1], all_names=names, arch=arch)
    if smem_q > 48 * 1024:
        fq.max_dynamic_shared_size_bytes = smem_q
    fq((nq_pad // 64, Hq, B), (128,),
       (q_t, k_t, v_n, do, i64(dsb), i64(dsh), i64(dsn), res.lse2, delta, dq, i64(qsb), i64(qsh), i64(qsn),
        i32(Hq), i32(Hkv), i32(nq), i32(nk), i32(nq_pad), i32(nk_pad), f32(p.sm_scale * log2e), f32(p.sm_scale),
        i32(int(p.causal))),
       shared_mem=smem_q)
    return tuple(_checks.wrap(x, p.dtype) for x in (dq, dk, dv))
