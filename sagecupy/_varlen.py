"""Packed variable-length sequences (``layout="THD"``, docs/algorithms.md §1.8) in the INT8 SageBwd path.

``q`` is ``(total_q, Hq, D)``, ``k`` and ``v`` ``(total_k, Hkv, D)``; sequence ``s`` is rows ``cu_seqlens_q[s] :
cu_seqlens_q[s+1]`` of ``q`` and ``cu_seqlens_k[s] : cu_seqlens_k[s+1]`` of ``k, v``. Every statistic is the
sequence's own (K's smoothing mean, V's channel scales, the backward's column statistics, the tiles), so a packed call
equals the separate calls on its sequences, bit for bit (the kernels run the dense bodies per sequence:
kernels_cu/int8/packed.cuh).

The call path reads no device data on the host. ``cu_seqlens`` given as CuPy int32 arrays stay on the device: the first
pre-pass kernel turns them into the per-call table the others read (each sequence's offsets and padded offsets, and
which sequence each 64-row block belongs to), and the buffers and grids are sized by bounds the host knows from the
shapes alone (``_checks.packed_bounds``: every sequence padded to 128 rows, at most ``total + 127 S``). Their contents
are then not checked (that would need a synchronization, as in FlashAttention's varlen API): offsets outside
``[0, total]`` are clamped and a decrease reads as an empty sequence, so that no kernel reads or writes outside the
arrays. Offsets given as host arrays (NumPy, lists; both offsets of one kind) are checked in full, as the reference
checks them (``check_cu_seqlens``), and copied to the device per call. ``max_seqlen_q/k`` are accepted as
FlashAttention takes them (an int, checked against the offsets where those are on the host); the kernels do not
need them.
"""
from __future__ import annotations

import functools
import numbers

import numpy as np

from . import _checks, _layout
from . import int8 as _i8
from ._program import Plan, Program, Ref, env_key, scale_key, signature
from .config import SageBwdConfig, get_config

__all__ = ["is_packed", "check_args", "meta_size", "reference_meta", "device_offsets"]

_SRC = "int8/int8_quant_packed.cu"
_NAMES_ARG = ("cu_seqlens_q", "cu_seqlens_k")


@functools.lru_cache(maxsize=None)
def quant_names(T, D):
    """The packed pre-pass's instantiations for element type ``T`` and head dim ``D`` (one module)."""
    rpw = _i8._QK_RPW
    return (
        f"column_partial_kv_packed<{T}, {D}>", "packed_offsets", "packed_tables", "column_finish_kv_packed",
        f"column_partial_packed<{T}, {D}, false>", f"column_partial_packed<{T}, {D}, true>",
        "column_finish_packed<false>", "column_finish_packed<true>", f"quant_rows_qk_packed<{T}, {D}, {rpw}>",
        f"quant_rows_packed<{T}, {D}, 4, false>", f"quant_rows_packed<{T}, {D}, 8, true>",
        f"quant_rows_packed<{T}, {D}, 16, true>", f"quant_transpose_perm_packed<{T}, {D}, 0>",
        f"quant_transpose_perm_packed<{T}, {D}, 2>", f"fwd_v_image_packed<{T}, {D}, 0>",
        f"fwd_v_image_packed<{T}, {D}, 2>", f"quant_transpose_perm_delta_packed<{T}, {D}, 1>",
        f"quant_transpose_perm_delta_packed<{T}, {D}, 2>", f"bwd_do_image_packed<{T}, {D}, 1>",
        f"bwd_do_image_packed<{T}, {D}, 2>", f"bwd_do16_image_packed<{T}, {D}>", f"bwd_delta_packed<{T}, {D}>",
        f"transpose_i8_qk_packed<{D}, true>",
        f"bwd_qk_images_packed<{T}, {D}, false>", f"bwd_qk_images_packed<{T}, {D}, true>",
        f"fwd_v16_image_packed<{T}, {D}>",
    ) + ((f"quant_qkv_packed<{T}, {D}, {rpw}, 0>", f"quant_qkv_packed<{T}, {D}, {rpw}, 2>") if D == 128 else ())


def _qfn(name, T, D):
    return _i8.get_function(_SRC, name, all_names=quant_names(T, D))


def fwd_kernel(T, D, bkv, engine, pv16=False):
    """(source, instance, arch) of the packed forward kernel (as int8._fwd_kernel)."""
    src, name, arch = _i8._fwd_kernel(T, D, bkv, engine, pv16)
    base, args = name.split("<", 1)
    return src, f"{base}_packed<{args}", arch


def bwd_names(T, D, engine, dv_int8, ds_int8):
    """The packed backward's (dK/dV, dQ) instantiations (as int8._bwd_names)."""
    return tuple(f"{n.split('<')[0]}_packed<{n.split('<', 1)[1]}"
                 for n in _i8._bwd_names(T, D, engine, dv_int8, ds_int8))


def kernel_names(T, D) -> dict:
    """Every packed instantiation for ``T`` and ``D``, per source file."""
    out = {_SRC: list(quant_names(T, D))}
    for engine in ("mma", "wgmma"):
        for bkv in _i8._BLOCK_KV:
            for pv16 in ((False, True) if engine == "wgmma" else (False,)):
                src, name, _ = fwd_kernel(T, D, bkv, engine, pv16)
                out.setdefault(src, []).append(name)
        lst = out.setdefault(_i8._BWD_SOURCES[engine][0], [])
        for dv_int8, ds_int8 in _i8._BWD_MODES:
            lst.extend(n for n in bwd_names(T, D, engine, dv_int8, ds_int8) if n not in lst)
    return out


def kernel_requests(T, D, engine) -> list:
    """:func:`sagecupy.int8.kernel_requests`'s packed part."""
    names = quant_names(T, D)
    out = [(_SRC, n, names, None) for n in names]
    for bkv in _i8._BLOCK_KV:
        for pv16 in ((False, True) if engine == "wgmma" else (False,)):
            src, name, arch = fwd_kernel(T, D, bkv, engine, pv16)
            out.append((src, name, None, arch))
    src, arch = _i8._BWD_SOURCES[engine]
    for dv_int8, ds_int8 in _i8._BWD_MODES:
        names = bwd_names(T, D, engine, dv_int8, ds_int8)
        out += [(src, n, names, arch) for n in names]
    return out


# ---------------------------------------------------------------------------------------------------------------------
# Validation


def is_packed(layout, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k) -> bool:
    """Whether a call is packed (``layout="THD"``); ValueError naming the argument where a dense layout is given
    packed-only arguments."""
    if isinstance(layout, str) and layout == _layout.PACKED:
        return True
    for name, value in zip(_NAMES_ARG + ("max_seqlen_q", "max_seqlen_k"),
                           (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)):
        if value is not None:
            raise ValueError(f"{name} is only for layout='THD' (packed sequences), got layout={layout!r}")
    return False


def _is_int(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, (bool, np.bool_))


def _host_cu(x):
    """``x`` as a NumPy array where it is host data (a NumPy array, list or tuple), else None."""
    if isinstance(x, np.ndarray):
        return x
    if isinstance(x, (list, tuple)):
        return np.asarray(x)
    return None


def _cu_meta(cu, name):
    """``("host", array)`` or ``("device", CuPy array)`` for one of the offsets; TypeError/ValueError naming it for what
    its metadata shows: not an array, not 1-D, fewer than 2 offsets, a device array that is not int32."""
    if cu is None:
        raise ValueError(f"{name} is required with layout='THD' (int32 prefix sums of the sequence lengths, S + 1 "
                         f"offsets)")
    host = _host_cu(cu)
    if host is not None:
        if host.dtype.kind not in "iu" or host.ndim != 1:
            raise ValueError(f"{name} must be a 1-D integer array (int32 prefix sums), got dtype {host.dtype} and "
                             f"shape {host.shape}")
        arr, kind = host, "host"
    else:
        try:
            arr = _checks.as_cupy(cu, name)
        except TypeError:
            raise TypeError(f"{name} must be a CuPy int32 array, a CUDA array with __dlpack__, or a host (NumPy) "
                            f"integer array, got {type(cu).__name__}") from None
        if getattr(arr, "bits", None) is not None or np.dtype(arr.dtype) != np.int32:
            raise TypeError(f"{name}.dtype={_checks.dtype_name(arr.dtype)} must be int32 (a device array is read as "
                            f"it is; host arrays may be any integer dtype)")
        if len(arr.shape) != 1:
            raise ValueError(f"{name} must be 1-D (S + 1 offsets), got shape {tuple(arr.shape)}")
        kind = "device"
    if arr.shape[0] < 2:
        raise ValueError(f"{name} must hold S + 1 >= 2 offsets, got {arr.shape[0]}")
    return kind, arr


def _check_max(value, name):
    if value is not None and (not _is_int(value) or value < 0):
        raise ValueError(f"{name}={value!r} must be a non-negative integer or None")


def check_args(q, k, v, *, causal, sm_scale, layout, window, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
               max_seqlen_k) -> _checks.Problem:
    """Validate a packed call (arrays with .shape/.dtype; the offsets' metadata, and their values where they are on
    the host): the :class:`~sagecupy._checks.Problem` (``batch`` = S, ``nq``/``nk`` the totals)."""
    _checks.check_causal(causal)
    window = _checks.check_window(window, causal)
    dtypes = ("float16", "bfloat16")
    for name, x in (("q", q), ("k", k), ("v", v)):
        if len(x.shape) != 3:
            raise ValueError(f"{name} must be 3-D (total, H, D) for layout='THD', got shape {tuple(x.shape)}")
        _checks.check_dims(x.shape[1:], name, ("H", "D"))
        if _checks.dtype_name(x.dtype) not in dtypes:
            raise TypeError(f"{name}.dtype={_checks.dtype_name(x.dtype)} is not supported; supported: {dtypes}"
                            f"{_checks.BF16_FORMS}")
    if not (_checks.dtype_name(q.dtype) == _checks.dtype_name(k.dtype) == _checks.dtype_name(v.dtype)):
        raise TypeError(f"q, k, v must share one dtype, got {_checks.dtype_name(q.dtype)}, "
                        f"{_checks.dtype_name(k.dtype)}, {_checks.dtype_name(v.dtype)}")
    Tq, Hq, D = q.shape
    Tk, Hkv, Dk = k.shape
    if tuple(v.shape) != tuple(k.shape):
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)} (layout='THD')")
    if D not in _checks.SUPPORTED_HEAD_DIMS:
        raise ValueError(f"head_dim={D} is not supported; supported: {_checks.SUPPORTED_HEAD_DIMS}")
    if Dk != D:
        raise ValueError(f"head_dim mismatch: q has {D}, k/v have {Dk}")
    if Hq % Hkv:
        raise ValueError(f"heads: q has {Hq}, k/v have {Hkv}; q heads must be a multiple of kv heads (GQA/MQA)")
    (kq, cq), (kk, ck) = _cu_meta(cu_seqlens_q, "cu_seqlens_q"), _cu_meta(cu_seqlens_k, "cu_seqlens_k")
    if kq != kk:  # (host offsets are checked against each other, device ones not read)
        raise TypeError(f"cu_seqlens_q and cu_seqlens_k must both be device arrays or both host arrays, got a {kq} "
                        f"and a {kk} array")
    if cq.shape[0] != ck.shape[0]:
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must have the same length (S + 1), got {cq.shape[0]} and "
                         f"{ck.shape[0]}")
    _check_max(max_seqlen_q, "max_seqlen_q")
    _check_max(max_seqlen_k, "max_seqlen_k")
    if kq == "host":  # the values too, as the reference checks them (no device data is read)
        from .reference.attention import check_cu_seqlens

        check_cu_seqlens(cq, ck, Tq, Tk, max_seqlen_q, max_seqlen_k)
    S = cq.shape[0] - 1
    _checks.check_packed_limits(S, Hq, Hkv, Tq, Tk, D)
    sm_scale = _checks.check_sm_scale(sm_scale, D)
    return _checks.Problem(S, Hq, Hkv, Tq, Tk, D, _checks.dtype_name(q.dtype), layout, bool(causal), sm_scale, window)


def _cu_key(cu):
    """The offsets in a plan's key: a device array's signature, or that they come from the host (copied per call)."""
    host = _host_cu(cu)
    if host is not None:
        return ("host", host.shape, host.dtype)
    return signature(_checks.as_cupy(cu, "cu_seqlens"))


def _cu_device(p, cu_q, cu_k, max_q, max_k):
    """The call's offsets on the device: device arrays as they are (their device checked), host ones checked against
    this call's totals and copied."""
    import cupy

    hq, hk = _host_cu(cu_q), _host_cu(cu_k)
    if hq is not None and hk is not None:
        from .reference.attention import check_cu_seqlens

        check_cu_seqlens(hq, hk, p.nq, p.nk, max_q, max_k)
    return tuple(cupy.asarray(h.astype(np.int32)) if h is not None else _checks.as_cupy(c, n)
                 for c, h, n in ((cu_q, hq, "cu_seqlens_q"), (cu_k, hk, "cu_seqlens_k")))


def meta_size(p) -> int:
    """int32 entries of the per-call table (kernels_cu/int8/packed.cuh) of packed problem ``p``."""
    _, _, nbq, nbk, nchk = _checks.packed_bounds(p.batch, p.nq, p.nk)
    return 5 * (p.batch + 1) + nbq + nbk + nchk


def reference_meta(cu_q, cu_k, total_q, total_k):
    """The table the first two packed pre-pass kernels write for these offsets (host arrays, any values), in NumPy:
    int32 of :func:`meta_size`. The tests compare the device's with it; it also shows what unchecked offsets become
    (clamped to [0, total], then a running max)."""
    cq = np.maximum.accumulate(np.clip(np.asarray(cu_q, np.int64), 0, total_q))
    ck = np.maximum.accumulate(np.clip(np.asarray(cu_k, np.int64), 0, total_k))
    S = cq.size - 1
    _, _, nbq, nbk, nchk = _checks.packed_bounds(S, total_q, total_k)

    def pads(lengths, unit, count):
        return np.concatenate([[0], np.cumsum(-(-lengths // unit) * (unit if count is None else 1))])

    pq, pk = pads(np.diff(cq), 128, None), pads(np.diff(ck), 128, None)
    pc = pads(np.diff(ck), 256, True)

    def table(pad, n, unit):
        pos = np.arange(n, dtype=np.int64) * unit
        s = np.searchsorted(pad, pos, side="right") - 1  # the last s with pad[s] <= pos
        return np.where(s < S, s, -1)

    return np.concatenate([cq, ck, pq, pk, pc, table(pq, nbq, 64), table(pk, nbk, 64), table(pc, nchk, 1)]
                          ).astype(np.int32)


def device_offsets(meta, S):
    """The clamped offsets and the padded offsets in a table (a CuPy array, :attr:`Residuals.packed`), for tests and
    tools: a dict of NumPy arrays ``cu_q``, ``cu_k``, ``pad_q``, ``pad_k``, ``pad_c`` (S + 1 each) and the three
    block tables. Reads device memory (synchronizes)."""
    m = meta.get() if hasattr(meta, "get") else np.asarray(meta)
    n1 = S + 1
    out = {n: m[i * n1:(i + 1) * n1] for i, n in enumerate(("cu_q", "cu_k", "pad_q", "pad_k", "pad_c"))}
    out["tables"] = m[5 * n1:]
    return out


# ---------------------------------------------------------------------------------------------------------------------
# Forward


def prepass(q, k, v, *, causal, sm_scale, layout, config, engine, inference, window, cu_seqlens_q, cu_seqlens_k,
            max_seqlen_q, max_seqlen_k):
    """int8._prepass for a packed call: (plan, pre)."""
    q, k, v = (_checks.as_cupy(x, n) for x, n in ((q, "q"), (k, "k"), (v, "v")))
    # (max_seqlen is checked per call, not in the plan's key: it does not change the program, and a training loop's
    # maxima vary from batch to batch)
    _check_max(max_seqlen_q, "max_seqlen_q")
    _check_max(max_seqlen_k, "max_seqlen_k")
    plan = _i8._FWD_PLANS.get_or_build(
        lambda: ("THD", signature(q), signature(k), signature(v), _cu_key(cu_seqlens_q), _cu_key(cu_seqlens_k),
                 causal, type(causal), scale_key(sm_scale), type(sm_scale), layout, config, engine, bool(inference),
                 _i8._window_key(window), env_key()),
        lambda: _forward_plan(q, k, v, causal=causal, sm_scale=sm_scale, layout=layout, config=config, engine=engine,
                              inference=bool(inference), window=window, cu_seqlens_q=cu_seqlens_q,
                              cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k))
    ns = _layout.input_ns(plan, layout, q=q, k=k, v=v)
    ns["cu_q"], ns["cu_k"] = _cu_device(plan.p, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    return plan, _i8._run_prepass(plan, ns, q)


def _forward_plan(q, k, v, *, causal, sm_scale, layout, config, engine, inference, window, cu_seqlens_q,
                  cu_seqlens_k, max_seqlen_q, max_seqlen_k):
    """The packed pre-pass program (int8._forward_plan's, per sequence): the table, K's mean and V's scales per
    (sequence, kv head), Q/K/V codes in the packed padded layout."""
    import cupy

    p = check_args(q, k, v, causal=causal, sm_scale=sm_scale, layout=layout, window=window, cu_seqlens_q=cu_seqlens_q,
                   cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k)
    cfg = get_config(config)
    why = _i8._unsupported_config(cfg)
    if why:
        raise ValueError(f"config: {why}")
    _i8._check_device()
    engine = _i8.forward_engine(engine)
    why = _i8._unsupported_pv16(cfg, engine)
    if why:
        raise ValueError(f"config: {why}")
    copy = tuple(_layout.needs_copy(_checks.raw(x), True) for x in (q, k, v))
    T, D = _i8._T[p.dtype], p.head_dim
    S, Hq, Hkv, Tq, Tk = p.batch, p.heads_q, p.heads_kv, p.nq, p.nk
    tq_pad, tk_pad, nbq, nbk, nchk = _checks.packed_bounds(S, Tq, Tk)
    (_, qsh, qsn), (_, ksh, ksn), (_, vsh, vsn) = (_layout.run_strides(x, c, layout) for x, c in zip((q, k, v), copy))
    i32, i64, f32 = cupy.int32, cupy.int64, cupy.float32
    prog = Program()
    rq, rk, rv = Ref("q"), Ref("k"), Ref("v")
    res = _layout.TMP if inference else None
    meta = record_meta(prog, p, _cu_stride(cu_seqlens_q), _cu_stride(cu_seqlens_k), arena=res)
    tail = (meta, i32(S), i32(nbq), i32(nbk))

    pv16 = not cfg.pv_int8  # (int8._forward_plan: V is not quantized)
    v_channel = cfg.v_granularity == "channel" and not pv16
    if cfg.k_smoothing and v_channel:  # K's mean and V's channel scales, per (sequence, kv head), in one pair
        part_k = prog.empty("part_k", (Hkv * nchk, D), cupy.float64, arena=_layout.TMP)
        part_v = prog.empty("part_v", (Hkv * nchk, D), cupy.float32, arena=_layout.TMP)
        prog.launch(_qfn(f"column_partial_kv_packed<{T}, {D}>", T, D), (nchk, Hkv, 2), (256,),
                    (rk, i64(ksh), i64(ksn), rv, i64(vsh), i64(vsn), part_k, part_v) + tail)
        mu_k = prog.empty("mu_k", (S, Hkv, D), f32, arena=res)
        v_scale = prog.empty("v_scale", (S, Hkv, D), f32, arena=_layout.TMP)
        prog.launch(_qfn("column_finish_kv_packed", T, D), (2 * S * Hkv,), (D,),
                    (part_k, part_v, i32(D), mu_k, v_scale, meta, i32(S), i32(Hkv)), pdl=True)
    else:
        mu_k = (_column_stat(prog, "mu_k", rk, ksh, ksn, p, False, tail, arena=res) if cfg.k_smoothing else None)
        v_scale = _column_stat(prog, "v_scale", rv, vsh, vsn, p, True, tail, arena=_layout.TMP) if v_channel else None
    q_codes = prog.empty("q_codes", (Hq * tq_pad, D), cupy.int8, arena=res)
    q_scale = prog.empty("q_scale", (Hq * tq_pad,), f32, arena=res)
    qmk = prog.empty("qmk", (Hq * tq_pad,), f32, arena=_layout.TMP) if mu_k is not None else None
    plain_k = not (inference and engine == "wgmma")  # (int8._forward_plan: the wgmma kernel reads the images)
    k_codes = prog.empty("k_codes", (Hkv * tk_pad, D), cupy.int8, arena=res) if plain_k else None
    k_scale = prog.empty("k_scale", (Hkv * tk_pad,), f32, arena=res) if plain_k else None
    kv_img = (prog.empty("kv_img", (Hkv * tk_pad // 64, _i8.fwd_image(D)), cupy.uint8, arena=_layout.TMP)
              if engine == "wgmma" else None)
    if res is None:  # residuals the caller keeps: their rows past the padded blocks made defined (_clear_tails)
        tails = [(q_codes, Hq * Tq), (q_scale, Hq * Tq)]
        if plain_k:
            tails += [(k_codes, Hkv * Tk), (k_scale, Hkv * Tk)]
        prog.call((), _clear_tails(tuple(n for _, n in tails)), tuple(b for b, _ in tails))
    mode = 0 if v_channel else 2
    if not v_channel and not pv16:
        v_scale = prog.empty("v_scale", (Hkv * tk_pad // 64, D), f32, arena=_layout.TMP)
    qk_args = (rq, i64(qsh), i64(qsn), f32(p.sm_scale), q_codes, q_scale, f32(_i8.LOG2E), qmk, rk, i64(ksh), i64(ksn),
               k_codes, k_scale, mu_k, i32(Hq), i32(Hkv), kv_img)
    nb = max(nbq, nbk)
    if cfg.q_granularity == "token" and cfg.k_granularity == "token" and kv_img is not None and D == 128 and not pv16:
        prog.launch(_qfn(f"quant_qkv_packed<{T}, {D}, {_i8._QK_RPW}, {mode}>", T, D), (nb, Hq + 2 * Hkv, 1), (256,),
                    qk_args + (rv, i64(vsh), i64(vsn), v_scale, v_scale) + tail, pdl=True)
        return Plan(p, cfg, engine, copy, prog)
    if cfg.q_granularity == "token" and cfg.k_granularity == "token":
        prog.launch(_qfn(f"quant_rows_qk_packed<{T}, {D}, {_i8._QK_RPW}>", T, D), (nb, Hq + Hkv, 1), (256,),
                    qk_args + tail)
    else:
        rpw, grouped = (4, "false") if cfg.q_granularity == "token" else (16, "true")
        prog.launch(_qfn(f"quant_rows_packed<{T}, {D}, {rpw}, {grouped}>", T, D), (tq_pad // (8 * rpw), Hq, 1), (256,),
                    (rq, i64(qsh), i64(qsn), None, i32(1), f32(p.sm_scale), q_codes, q_scale, f32(_i8.LOG2E), mu_k,
                     i32(p.group), f32(p.sm_scale), qmk, None, i32(0)) + tail)
        rpw, grouped = (4, "false") if cfg.k_granularity == "token" else (8, "true")
        prog.launch(_qfn(f"quant_rows_packed<{T}, {D}, {rpw}, {grouped}>", T, D), (tk_pad // (8 * rpw), Hkv, 1),
                    (256,), (rk, i64(ksh), i64(ksn), mu_k, i32(1), f32(1.0), k_codes, k_scale, f32(1.0), None, i32(1),
                             f32(0.0), None, kv_img, i32(1)) + tail)
    if pv16:  # V as it is, in the 16-bit images the kernel reads through v_t
        v_t = prog.empty("v_t", (Hkv * tk_pad // 64, 128 * D), cupy.uint8, arena=_layout.TMP)
        prog.launch(_qfn(f"fwd_v16_image_packed<{T}, {D}>", T, D), (nbk, Hkv, 1), (256,), (rv, i64(vsh), i64(vsn), v_t)
                    + tail)
    elif kv_img is not None:
        prog.launch(_qfn(f"fwd_v_image_packed<{T}, {D}, {mode}>", T, D), (nbk, Hkv, 1), (2 * D,),
                    (rv, i64(vsh), i64(vsn), v_scale, v_scale, kv_img) + tail)
    else:
        v_t = prog.empty("v_t", (Hkv * tk_pad * D,), cupy.int8, arena=_layout.TMP)
        prog.launch(_qfn(f"quant_transpose_perm_packed<{T}, {D}, {mode}>", T, D), (nbk, Hkv, 1), (2 * D,),
                    (rv, i64(vsh), i64(vsn), v_scale, v_scale, v_t, i32(int(cfg.block_kv == 64))) + tail)
    return Plan(p, cfg, engine, copy, prog)


def _clear_tails(first_rows):
    """Host glue that zeroes each array's rows from ``first_rows[i]`` on, before the kernels write.

    The padded buffers are sized by a bound known without reading the offsets (``packed_bounds``: total + 127 S rows
    per head), and the sequences' padded blocks fill only the first ``H · Σ pad(n_s)`` rows of it, at least ``H ·
    total``. The rest is never read, but residuals handed to a caller (PyTorch's ops return them as tensors) must not
    carry whatever memory held before: a rerun would give different bytes (``torch.library.opcheck``'s eager vs
    traced comparison, `3853d3b` on an H100). Rows from ``H · total`` on are cleared first, and the kernels then write
    the padded blocks that reach into them."""
    def clear(*arrays):
        for x, first in zip(arrays, first_rows):
            x[first:].fill(0)
        return ()

    return clear


def _cu_stride(cu):
    """The element stride of a device offsets array (host ones are copied contiguous)."""
    if _host_cu(cu) is not None:
        return 1
    x = _checks.as_cupy(cu, "cu_seqlens")
    return x.strides[0] // x.itemsize


def record_meta(prog, p, stride_q, stride_k, arena=None):
    """Record the table's two kernels (kernels_cu/int8/int8_quant_packed.cu packed_offsets, packed_tables) from the
    program's inputs ``cu_q``, ``cu_k``: a Ref to the int32 table (``arena``: scratch, or an array of its own)."""
    import cupy

    i32, i64 = cupy.int32, cupy.int64
    T, D = _i8._T[p.dtype], p.head_dim
    S = p.batch
    _, _, nbq, nbk, nchk = _checks.packed_bounds(S, p.nq, p.nk)
    meta = prog.empty("packed", (meta_size(p),), cupy.int32, arena=arena)
    prog.launch(_qfn("packed_offsets", T, D), (1,), (1024,),
                (Ref("cu_q"), i64(stride_q), Ref("cu_k"), i64(stride_k), i32(S), i32(p.nq), i32(p.nk), meta))
    n = nbq + nbk + nchk
    prog.launch(_qfn("packed_tables", T, D), (-(-n // 256),), (256,), (meta, i32(S), i32(nbq), i32(nbk), i32(nchk)))
    return meta


def _column_stat(prog, name, x, sh, sn, p, absmax, tail, arena=None):
    """One per-(sequence, kv head) column statistic of input ``x`` (int8.record_column_stat's, packed)."""
    import cupy

    T, D, S, H = _i8._T[p.dtype], p.head_dim, p.batch, p.heads_kv
    nchk = _checks.packed_bounds(S, p.nq, p.nk)[4]
    flag = "true" if absmax else "false"
    part = prog.empty(name + "_part", (H * nchk, D), cupy.float32 if absmax else cupy.float64, arena=_layout.TMP)
    prog.launch(_qfn(f"column_partial_packed<{T}, {D}, {flag}>", T, D), (nchk, H, 1), (256,),
                (x, cupy.int64(sh), cupy.int64(sn), part) + tail)
    out = prog.empty(name, (S, H, D), cupy.float32, arena=arena)
    prog.launch(_qfn(f"column_finish_packed<{flag}>", T, D), (S * H,), (D,),
                (part, cupy.int32(D), out, tail[0], cupy.int32(S), cupy.int32(H)))
    return out


def forward_launch_program(p, cfg, pre, engine):
    """The packed attention kernel's launch (int8._forward_launch_program's): o (total_q, Hq, D), lse (Hq, total_q)."""
    import cupy

    T, D = _i8._T[p.dtype], p.head_dim
    S, Hq, Hkv, Tq = p.batch, p.heads_q, p.heads_kv, p.nq
    tq_pad, _, nbq, _, _ = _checks.packed_bounds(S, Tq, p.nk)
    i32, i64, f32 = cupy.int32, cupy.int64, cupy.float32
    w, bkv, pv16 = _i8._FWD_WARPS, cfg.block_kv, not cfg.pv_int8
    src, name, arch = fwd_kernel(T, D, bkv, engine, pv16)
    fn = _i8.get_function(src, name, arch=arch)  # (int8's name: the tests' stand-in replaces it there)
    smem = _i8._fwd_smem(D, bkv, _i8._fwd90_stages(D, bkv, pv16) if engine == "wgmma" else 2, pv16)
    if smem > 48 * 1024:
        fn.max_dynamic_shared_size_bytes = smem
    prog = Program()
    o_shape = (Tq, Hq, D)
    o = prog.empty("o", o_shape, _layout.bits_dtype(p.dtype))
    _, osh, osn = _layout.c_strides(o_shape, _layout.PACKED)
    lse = prog.empty("lse", (Hq, Tq), f32)
    lse2 = prog.empty("lse2", (Hq * tq_pad,), f32)
    prog.call((), _clear_tails((Hq * Tq,)), (lse2,))  # (a residual: see _clear_tails)

    def arg(name):
        return Ref(name) if pre[name] is not None else None

    left, right = _i8.kernel_window(p)
    common = (o, i64(osh), i64(osn), lse, lse2, i32(Hq), i32(Hkv), f32(cfg.p_max), i32(left), i32(right),
              i32(int(cfg.v_granularity == "block")))
    tail = (Ref("packed"), i32(S), i32(Tq))
    if engine == "wgmma":
        args = ((arg("q_codes"), arg("q_scale"), arg("v_scale"), arg("qmk")) + common + (arg("kv_img"), arg("v_t"))
                + tail)
    else:
        args = (arg("q_codes"), arg("q_scale"), arg("k_codes"), arg("k_scale"), arg("v_t"), arg("v_scale"),
                arg("qmk")) + common + tail
    prog.launch(fn, (nbq, Hq, 1), (32 * w,), args, shared_mem=smem, pdl=engine == "wgmma")
    return prog


# ---------------------------------------------------------------------------------------------------------------------
# Backward


def check_residuals(r) -> None:
    """int8.check_residuals's shapes for packed residuals (its problem and config already checked): the buffers in
    the packed padded layout (int8.Residuals), the table, V and O by rows as (total, H, D)."""
    import cupy

    p = r.problem
    S, Hq, Hkv, D = p.batch, p.heads_q, p.heads_kv, p.head_dim
    tq_pad, tk_pad, _, _, _ = _checks.packed_bounds(S, p.nq, p.nk)
    f32 = cupy.float32
    for name, shape, dtype in (("q_codes", (Hq * tq_pad, D), cupy.int8), ("q_scale", (Hq * tq_pad,), f32),
                               ("k_codes", (Hkv * tk_pad, D), cupy.int8), ("k_scale", (Hkv * tk_pad,), f32),
                               ("lse2", (Hq * tq_pad,), f32), ("packed", (meta_size(p),), cupy.int32)):
        _checks.check_buffer(getattr(r, name), f"residuals.{name}", shape, dtype)
    if r.mu_k is not None:
        _checks.check_buffer(r.mu_k, "residuals.mu_k", (S, Hkv, D), f32)
    bits = _layout.bits_dtype(p.dtype)
    _checks.check_rows(r.v, "residuals.v", (p.nk, Hkv, D), bits)
    _checks.check_rows(r.o, "residuals.o", (p.nq, Hq, D), bits)


def backward_plan(r, do, engine, copy):
    """The packed backward's pre-pass program (int8._backward_plan's, per sequence): delta, dO's codes and the
    transposed (or imaged) Q and K codes in the packed padded layout."""
    import cupy

    p, cfg = r.problem, r.config
    T, D = _i8._T[p.dtype], p.head_dim
    S, Hq, Hkv = p.batch, p.heads_q, p.heads_kv
    tq_pad, tk_pad, nbq, nbk, _ = _checks.packed_bounds(S, p.nq, p.nk)
    i32, i64, f32 = cupy.int32, cupy.int64, cupy.float32
    _, dsh, dsn = _layout.run_strides(do, copy[0], _layout.PACKED)
    _, osh, osn = _layout.strides(r.o, _layout.PACKED)
    engine = _i8.backward_engine(engine)
    prog = Program()
    rdo, ro, R = Ref("do"), Ref("o"), Ref
    tail = (R("packed"), i32(S), i32(nbq), i32(nbk))
    delta = prog.empty("delta", (Hq * tq_pad,), f32)
    mode = 1 if cfg.do_granularity == "channel" else 2
    nb = max(nbq, nbk)
    if engine == "wgmma":
        qst, kst = _i8.bwd_images(D, cfg.ds_int8)
        q_img = prog.empty("q_img", (Hq * tq_pad // 64, qst), cupy.uint8)
        k_img = prog.empty("k_img", (Hkv * tk_pad // 64, kst), cupy.uint8)
        _, vsh, vsn = _layout.strides(r.v, _layout.PACKED)
        ds16 = "false" if cfg.ds_int8 else "true"
        prog.launch(_qfn(f"bwd_qk_images_packed<{T}, {D}, {ds16}>", T, D), (nb, Hq + Hkv, 1), (256,),
                    (R("q_codes"), R("q_scale"), R("lse2"), q_img, R("k_codes"), R("k_scale"), R("v"), i64(vsh),
                     i64(vsn), k_img, i32(Hq), i32(Hkv)) + tail)
        do_name = f"bwd_do_image_packed<{T}, {D}, {mode}>" if cfg.ds_int8 else f"bwd_do16_image_packed<{T}, {D}>"
        prog.launch(_qfn(do_name, T, D), (nbq, Hq, 1), (2 * D,),
                    (rdo, i64(dsh), i64(dsn), q_img, ro, i64(osh), i64(osn), delta) + tail)
        return Plan(p, cfg, engine, copy, prog)
    # (as int8._backward_plan: the 16-bit dV, dK and dQ read no dO codes and no transposed Q or K)
    if cfg.dv_int8:
        do_t = prog.empty("do_t", (Hq * tq_pad // 64, D, 64), cupy.int8)
        do_scale = prog.empty("do_scale", (Hq * tq_pad // 64, D), f32)
        prog.launch(_qfn(f"quant_transpose_perm_delta_packed<{T}, {D}, {mode}>", T, D), (nbq, Hq, 1), (2 * D,),
                    (rdo, i64(dsh), i64(dsn), do_scale, do_t, ro, i64(osh), i64(osn), delta) + tail)
    else:
        prog.launch(_qfn(f"bwd_delta_packed<{T}, {D}>", T, D), (nbq, Hq, 1), (2 * D,),
                    (rdo, i64(dsh), i64(dsn), ro, i64(osh), i64(osn), delta) + tail)
    if cfg.ds_int8:
        q_t = prog.empty("q_t", (Hq * tq_pad // 64, D, 64), cupy.int8)
        k_t = prog.empty("k_t", (Hkv * tk_pad // 64, D, 64), cupy.int8)
        prog.launch(_qfn(f"transpose_i8_qk_packed<{D}, true>", T, D), (nb, Hq + Hkv, 1), (256,),
                    (R("q_codes"), q_t, R("k_codes"), k_t, i32(Hq), i32(Hkv)) + tail)
    return Plan(p, cfg, engine, copy, prog)


def backward_launch_program(r, pre, engine, kernels):
    """The packed backward kernels' launches (int8._backward_launch_program's): dq (total_q, Hq, D), dk and dv
    (total_k, Hkv, D)."""
    import cupy

    p, cfg = r.problem, r.config
    T, D = _i8._T[p.dtype], p.head_dim
    S, Hq, Hkv = p.batch, p.heads_q, p.heads_kv
    _, _, nbq, nbk, _ = _checks.packed_bounds(S, p.nq, p.nk)
    i32, i64, f32 = cupy.int32, cupy.int64, cupy.float32
    _, dsh, dsn = _layout.strides(pre["do"], _layout.PACKED)
    _, vsh, vsn = _layout.strides(r.v, _layout.PACKED)
    prog = Program()
    bits = _layout.bits_dtype(p.dtype)
    kv_shape, q_shape = (p.nk, Hkv, D), (p.nq, Hq, D)
    dk, dv, dq = prog.empty("dk", kv_shape, bits), prog.empty("dv", kv_shape, bits), prog.empty("dq", q_shape, bits)
    _, ksh, ksn = _layout.c_strides(kv_shape, _layout.PACKED)
    _, qsh, qsn = _layout.c_strides(q_shape, _layout.PACKED)
    ds_rowcol = i32(int(cfg.ds_granularity == "rowcol"))
    p_col = i32(int(cfg.p_bwd_granularity == "column"))
    win = tuple(i32(w) for w in _i8.kernel_window(p))
    names = bwd_names(T, D, engine, cfg.dv_int8, cfg.ds_int8)
    src, arch = _i8._BWD_SOURCES[engine]
    smem, smem_q = _i8.bwd_smem(D, engine, cfg.ds_int8)
    R = Ref
    tail_k, tail_q = (R("packed"), i32(S), i32(nbq)), (R("packed"), i32(S))
    if "dkdv" in kernels:
        fn = _i8.get_function(src, names[0], all_names=names, arch=arch)
        if smem > 48 * 1024:
            fn.max_dynamic_shared_size_bytes = smem
        if engine == "wgmma":
            args = (R("q_img"), R("k_img"), R("k_scale"))
        else:
            args = (R("q_codes"), R("q_scale"), R("q_t") if cfg.ds_int8 else None, R("k_codes"), R("k_scale"), R("v"),
                    i64(vsh), i64(vsn), R("do"), i64(dsh), i64(dsn), R("do_t") if cfg.dv_int8 else None,
                    R("do_scale") if cfg.dv_int8 else None, R("lse2"), R("delta"))
        prog.launch(fn, (nbk, Hkv, 1), (128,),
                    args + (dk, i64(ksh), i64(ksn), dv, i64(ksh), i64(ksn), i32(Hq), i32(Hkv), f32(cfg.p_max), *win,
                            p_col, ds_rowcol) + tail_k, shared_mem=smem)
    if "dq" in kernels:
        fq = _i8.get_function(src, names[1], all_names=names, arch=arch)
        if smem_q > 48 * 1024:
            fq.max_dynamic_shared_size_bytes = smem_q
        if engine == "wgmma":
            args = (R("q_img"), R("k_img"), R("q_scale"), R("lse2"), R("delta"))
        else:
            args = (R("q_codes"), R("q_scale"), R("k_codes"), R("k_scale"), R("k_t") if cfg.ds_int8 else None, R("v"),
                    i64(vsh), i64(vsn),
                    R("do"), i64(dsh), i64(dsn), R("lse2"), R("delta"))
        prog.launch(fq, (nbq, Hq, 1), (128,),
                    args + (dq, i64(qsh), i64(qsn), i32(Hq), i32(Hkv), f32(p.sm_scale), *win, ds_rowcol) + tail_q,
                    shared_mem=smem_q)
    return prog
