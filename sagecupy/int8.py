"""SageBwd on the GPU: INT8 attention forward and backward (docs/algorithms.md §2-4).

Data flow: validate -> pre-process (K-smoothing mean, INT8 quantization of Q, K, V) -> attention
kernel -> (O, LSE, residuals). The backward pre-processes dO (delta = rowsum(dO * O), INT8 dO^T)
and transposes the saved codes, then runs one kernel per 64-key block.

Conventions (as in the reference, ``sagecupy.reference.sagebwd``):

* ``causal=True`` is bottom-right aligned: query row ``i`` sees key ``j`` iff ``j <= i + Nk - Nq``::

      Nq=3, Nk=5      keys ->  0 1 2 3 4
                row 0          x x x . .
                row 1          x x x x .
                row 2          x x x x x

  A row that sees no key gives ``O = 0``, ``LSE = -inf`` and zero gradients.
* ``window=(left, right)`` (docs/algorithms.md §1.8; -1: unbounded): row ``i`` sees key ``j`` iff
  ``i + Nk - Nq - left <= j <= i + Nk - Nq + right``; ``causal=True`` is ``window=(-1, 0)``. The kernels visit only
  the tiles inside the window; K's smoothing mean and V's scales stay those of all the keys.
* ``sm_scale=None`` means ``1/sqrt(D)``; the LSE is float32, natural log, of the *unsmoothed* logits.
* Granularities come from a :class:`~sagecupy.config.SageBwdConfig` (``"default"``, ``"paper"``, ``"bkv64"`` or
  ``"pv16"``).
  The kernels implement ``block_q=128, bwd_block_q=64, bwd_block_kv=64`` and ``block_kv`` 64 or 128 (the
  forward's P tile; 128, the default, with per-token K and per-channel V only).
* Inputs are never modified.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

from . import _checks, _layout

from ._loader import device_capability, get_function
from ._program import Plan, Plans, Program, Ref, env_key, scale_key, signature
from .config import SageBwdConfig, get_config

__all__ = ["forward", "backward", "sage_attention", "is_supported", "Residuals", "check_residuals"]

LOG2E = 1.4426950408889634
_FWD_BQ, _FWD_BKV = 128, 128  # padding granularity of Q rows (pre-pass groups) and of keys (forward tiles)
_BLOCK_KV = (64, 128)  # forward key tiles the kernels implement (SageBwdConfig.block_kv)
# Warps per forward CTA (16 query rows each): on the wgmma engine with block_kv=64 three such CTAs fit an SM at D=128
# and four at D=64. 8-warp CTAs measured 3-7% slower on the mma.sync kernel and 1.05x (D=128, 128-key tiles) to 1.4x
# (D=64) slower on the wgmma one (docs/experiments.md, E-I8F-WARPS).
_FWD_WARPS = 4
_T = {"float16": "__half", "bfloat16": "__nv_bfloat16"}


def _unsupported_config(cfg: SageBwdConfig) -> str | None:
    if (cfg.block_q, cfg.bwd_block_q, cfg.bwd_block_kv) != (128, 64, 64) or cfg.block_kv not in _BLOCK_KV:
        return (f"tile sizes (block_q, block_kv, bwd_block_q, bwd_block_kv)="
                f"{(cfg.block_q, cfg.block_kv, cfg.bwd_block_q, cfg.bwd_block_kv)} are not supported by the "
                f"kernels; supported: (128, 64 or 128, 64, 64)")
    if cfg.block_kv != 64 and (cfg.k_granularity, cfg.v_granularity) != ("token", "channel"):
        return (f"block_kv={cfg.block_kv} needs k_granularity='token' and v_granularity='channel' in the kernels "
                f"(got {cfg.k_granularity!r}, {cfg.v_granularity!r}); per-block K and V need block_kv=64, e.g. "
                f"config.replace(block_kv=64)")
    if cfg.q_smoothing:
        return "q_smoothing=True is not implemented in the GPU kernels yet (reference only)"
    if cfg.ds_rowsum_correction:
        return "ds_rowsum_correction=True is not implemented in the GPU kernels yet (reference only)"
    if not cfg.quantize:
        return "quantize=False is a reference-only switch"
    if cfg.dv_int8 and not cfg.ds_int8:
        return ("ds_int8=False needs dv_int8=False in the kernels (the bf16 codes of Q take the stage bytes of the "
                "INT8 dV's operands); use dv_int8=False, or ds_int8=True as well")
    if not cfg.pv_int8 and cfg.v_granularity != "channel":
        return (f"pv_int8=False leaves V unquantized, so v_granularity={cfg.v_granularity!r} would not be applied; "
                f"use v_granularity='channel' (the default) with it")
    return None


def _unsupported_pv16(cfg: SageBwdConfig, engine: str) -> str | None:
    """Why the forward kernels cannot run ``cfg.pv_int8=False`` on ``engine`` (resolved), or None."""
    if cfg.pv_int8 or engine == "wgmma":
        return None
    return (f"pv_int8=False (P.V in 16 bits) is implemented on the wgmma engine (sm_90) only, not on "
            f"engine={engine!r}; use pv_int8=True (the default)")


def is_supported(q, k, v, *, causal=False, sm_scale=None, layout="HND", config=None, window=None, cu_seqlens_q=None,
                 cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None) -> tuple[bool, str]:
    """(True, "") if :func:`forward` accepts these arguments on the current device, else (False, the reason).
    Never raises. Packed sequences (``layout="THD"``): device offsets are checked by their metadata only (see
    :func:`forward`)."""
    try:
        q, k, v = (_checks.as_cupy(x, n) for x, n in ((q, "q"), (k, "k"), (v, "v")))
        if _varlen.is_packed(layout, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k):
            _varlen.check_args(q, k, v, causal=causal, sm_scale=sm_scale, layout=layout, window=window,
                               cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
                               max_seqlen_k=max_seqlen_k)
        else:
            _checks.check_attention_args(q, k, v, causal=causal, sm_scale=sm_scale, layout=layout, window=window)
        cfg = get_config(config)
        _check_device()
        why = _unsupported_config(cfg) or _unsupported_pv16(cfg, forward_engine(None))
    except Exception as exc:  # the contract is (False, reason), whatever is wrong
        return False, str(exc)
    return (False, why) if why else (True, "")


def _check_device():
    cc = device_capability()
    if cc < (8, 0):
        raise ValueError(f"the INT8 kernels need compute capability 8.0 or newer (mma.sync INT8); this device is "
                         f"{cc[0]}.{cc[1]}")


_QK_RPW = 8  # rows per warp of the fused Q/K quantization (8 * 8 = 64 rows per CTA: more loads in flight than 4)


@functools.lru_cache(maxsize=None)
def _quant_names(T, D):
    return (
        f"column_partial<{T}, {D}, false>", f"column_partial<{T}, {D}, true>", "column_finish<false>",
        "column_finish<true>", f"column_partial_kv<{T}, {D}>", "column_finish_kv", f"quant_rows_qk<{T}, {D}, {_QK_RPW}>",
        f"quant_rows<{T}, {D}, 4, false>", f"quant_rows<{T}, {D}, 8, true>", f"quant_rows<{T}, {D}, 16, true>",
        f"quant_transpose_perm<{T}, {D}, 0>", f"quant_transpose_perm<{T}, {D}, 2>",
        f"quant_transpose_perm_delta<{T}, {D}, 1>", f"quant_transpose_perm_delta<{T}, {D}, 2>",
        f"bwd_do_image<{T}, {D}, 1>", f"bwd_do_image<{T}, {D}, 2>", f"bwd_do16_image<{T}, {D}>", f"bwd_delta<{T}, {D}>",
        f"bwd_qk_images<{T}, {D}, false>", f"bwd_qk_images<{T}, {D}, true>",
        f"fwd_v_image<{T}, {D}, 0>", f"fwd_v_image<{T}, {D}, 2>", f"fwd_v16_image<{T}, {D}>",
        f"transpose_i8_qk<{D}, true>",
    ) + ((f"quant_qkv<{T}, {D}, {_QK_RPW}, 0>", f"quant_qkv<{T}, {D}, {_QK_RPW}, 2>") if D == 128 else ())


_QUANT_SRC = "int8/int8_quant.cu"
#: The backward's source and compile target per engine.
_BWD_SOURCES = {"mma": ("int8/int8_attn_bwd.cu", None), "wgmma": ("int8/int8_attn_bwd_sm90.cu", "sm_90a")}
#: The (dv_int8, ds_int8) pairs the backward kernels implement (SageBwdConfig; _unsupported_config).
_BWD_MODES = ((True, True), (False, True), (False, False))


def kernel_window(p) -> tuple:
    """``(left, right)`` as the kernels take them (kernels_cu/common/rows.cuh ``Window``; -1: unbounded) for problem
    ``p``: its window, or causal's ``(-1, 0)``. A side that reaches past the sequence (``left >= Nk``, ``right >=
    Nq``) bounds no row and is passed as -1, so the kernels' index sums stay within 32 bits."""
    left, right = p.bounds
    return (-1 if left >= p.nk else left, -1 if right >= p.nq else right)


def kernel_mask(p, mask=None) -> tuple:
    """``(left, right, shift)`` the dense kernels take: row ``i`` sees key ``j`` iff ``i + shift - left <= j <= i +
    shift + right``. ``mask`` None: :func:`kernel_window` and the bottom-right ``shift = nk - nq``; else a block's
    own triple (sagecupy/context_parallel.py ``block_mask``), checked to be three ints."""
    if mask is None:
        return (*kernel_window(p), p.nk - p.nq)
    if (not isinstance(mask, tuple) or len(mask) != 3
            or any(type(x) is not int or abs(x) >= 2 ** 29 for x in mask) or min(mask[:2]) < -1):
        # (below 2^29 each, the kernels' row + shift + right stays within int32 for any supported length)
        raise ValueError(f"mask={mask!r} must be (left, right, shift): ints below 2^29 in magnitude, left and "
                         f"right >= -1")
    return mask


def _fwd_kernel(T, D, bkv, engine, pv16=False):
    """(source, instance, arch) of the forward's attention kernel on ``engine`` (a resolved one); each instance
    compiles in a module of its own. ``pv16``: P.V in the inputs' 16-bit type (config ``pv_int8=False``; wgmma)."""
    if engine == "wgmma":
        return ("int8/int8_attn_fwd_sm90.cu",
                f"int8_attn_fwd_sm90<{T}, {D}, {_FWD_WARPS}, {bkv}, {'true' if pv16 else 'false'}>", "sm_90a")
    return "int8/int8_attn_fwd.cu", f"int8_attn_fwd<{T}, {D}, {_FWD_WARPS}, {bkv}>", None


def kernel_names() -> dict:
    """Every template instantiation this module launches, per source file (CI compiles them all)."""
    out = {f: [] for f in (_QUANT_SRC, "int8/int8_attn_fwd.cu", "int8/int8_attn_fwd_sm90.cu",
                           *(src for src, _ in _BWD_SOURCES.values()))}
    for T in _T.values():
        for D in _checks.SUPPORTED_HEAD_DIMS:
            out[_QUANT_SRC] += [n for n in _quant_names(T, D) if n not in out[_QUANT_SRC]]
            for engine in _BWD_SOURCES:  # ("mma", "wgmma")
                for bkv in _BLOCK_KV:
                    for pv16 in ((False, True) if engine == "wgmma" else (False,)):
                        src, name, _ = _fwd_kernel(T, D, bkv, engine, pv16)
                        out[src].append(name)
                for dv_int8, ds_int8 in _BWD_MODES:
                    out[_BWD_SOURCES[engine][0]] += [n for n in _bwd_names(T, D, engine, dv_int8, ds_int8)
                                                     if n not in out[_BWD_SOURCES[engine][0]]]
            for f, names in _varlen.kernel_names(T, D).items():
                out.setdefault(f, []).extend(n for n in names if n not in out[f])
    return out


def quant_requests(T, D) -> list:
    """The pre-pass kernels' :func:`kernel_requests` for element type ``T`` (C++) and head dim ``D``: one module."""
    names = _quant_names(T, D)
    return [(_QUANT_SRC, n, names, None) for n in names]


def kernel_requests(dtype: str, D: int, engine: str) -> list:
    """What this family's calls on ``dtype`` inputs of head dim ``D`` pass to
    :func:`~sagecupy._loader.get_function` on ``engine`` (``"mma"`` or ``"wgmma"``), under every config the kernels
    implement: ``(source, instance, all_names, arch)`` tuples, built by the functions the launches use
    (:func:`sagecupy.warmup` compiles their modules)."""
    T = _T[dtype]
    out = quant_requests(T, D)
    for bkv in _BLOCK_KV:
        for pv16 in ((False, True) if engine == "wgmma" else (False,)):
            src, name, arch = _fwd_kernel(T, D, bkv, engine, pv16)
            out.append((src, name, None, arch))
    src, arch = _BWD_SOURCES[engine]
    for dv_int8, ds_int8 in _BWD_MODES:
        names = _bwd_names(T, D, engine, dv_int8, ds_int8)
        out += [(src, n, names, arch) for n in names]
    return out + _varlen.kernel_requests(T, D, engine)


def forward_engine(engine: str | None = None) -> str:
    """The tensor-core path the forward uses: ``"wgmma"`` (Hopper, sm_90) or ``"mma"`` (mma.sync, sm_80+).

    ``engine``: ``None`` or ``"auto"`` (the default) picks ``"wgmma"`` on sm_90 (D = 64 and 128), where the
    pipelined wgmma kernel measured 1.25-1.34x (D = 64) and 1.75-1.88x (D = 128) the mma.sync kernel's speed on the
    H200, causal or not, N 4K/16K (docs/experiments.md), and ``"mma"`` elsewhere; ``"mma"`` asks for the mma.sync
    kernel on Hopper too. Both compute the same function: their int32 products are exact and every float operation
    after them is the same, so O and the LSE agree bit for bit (tested).
    """
    return _layout.pick_engine(engine)


def backward_engine(engine: str | None = None) -> str:
    """The tensor-core path the backward uses: ``"wgmma"`` (Hopper, sm_90) or ``"mma"`` (mma.sync, sm_80+).

    ``engine``: ``None`` or ``"auto"`` (the default) picks
    ``"wgmma"`` on sm_90 (1.55-1.91x the mma.sync kernels' speed on the H200, D 64/128, N 4K/16K,
    docs/experiments.md) and ``"mma"`` elsewhere. The two run the same algorithm with the same element-wise
    float operations (``kernels_cu/int8/bwd.cuh``) and exact int32 products; they can differ only
    through the fp32 accumulation order of the fp16/bf16 ``dP = dO V^T`` inside the tensor cores (tested).
    """
    return _layout.pick_engine(engine)


def _bwd_names(T, D, engine, dv_int8, ds_int8):
    """(dK/dV kernel, dQ kernel) instantiations; their DV16 and DS16 arguments are ``not dv_int8`` and ``not
    ds_int8`` (config). The dK/dV kernel compiles with the dQ kernel of the same DS16 in one module."""
    sfx = "_sm90" if engine == "wgmma" else ""
    dv16, ds16 = ("false" if x else "true" for x in (dv_int8, ds_int8))
    return (f"int8_attn_bwd{sfx}<{T}, {D}, {dv16}, {ds16}>", f"int8_attn_bwd_dq{sfx}<{T}, {D}, {ds16}>")


def _bwd90_smem(D, ds_int8=True):
    """Dynamic shared memory of the wgmma backward kernels (BwdSm90 / BwdDqSm90 in int8/int8_attn_bwd_sm90.cu):
    (dK/dV, dQ) bytes, each with 1024 bytes of slack for the 1024-byte alignment wgmma tiles need."""
    stage = -(-bwd_images(D)[0] // 1024) * 1024
    stage_dq = -(-bwd_images(D, ds_int8)[1] // 1024) * 1024
    return 1024 + 192 * D + 2 * stage, 1024 + 192 * D + 2 * stage_dq


def bwd_smem(D, engine, ds_int8):
    """(dK/dV, dQ) dynamic shared memory of the backward kernels on ``engine`` (a resolved one)."""
    if engine == "wgmma":
        return _bwd90_smem(D, ds_int8)
    # dQ: Q^, dO, two stages of K^, K^^T, V, key scales; ds_int8=False: the stages without K^^T, and the bf16 K^
    # (the same bytes). dK/dV: ds_int8=False puts the bf16 Q^ over the Q^^T and dO^^T it does not read.
    return _bwd_smem(D), 704 * D + 2 * 64 * 4


def _fwd_smem(D, bkv, stages, pv16=False):
    """Dynamic shared memory of a forward CTA: Q, the K/V ring (V in 16 bits with ``pv16``), the key scales of each
    stage, and alignment of the tiles to 1024 bytes."""
    return (16 * _FWD_WARPS + (3 if pv16 else 2) * stages * bkv) * D + stages * bkv * 4 + 1024


def _fwd90_stages(D, bkv, pv16=False):
    """Stages of the wgmma forward's K/V ring (FwdSm90<D, BKV, PV16>::NST): the CTAs per SM the kernel's registers
    are budgeted for must fit in shared memory (with block_kv=64: three 4-warp CTAs at D=128, four at D=64;
    with block_kv=128: three at D=128, four at D=64). With the 16-bit V (``pv16``), and with 128-key tiles (the
    serial loop), two stages, the next tile loading during a tile."""
    if pv16 or bkv == 128:
        return 2
    return 4


def kernel_constants() -> dict:
    """Host values that kernel sources define too, per source file: [(C++ expression, value)]. CI compiles
    ``static_assert(expression == value)`` beside each file (``.ci/compile_kernels.py``)."""
    out = []
    for D in _checks.SUPPORTED_HEAD_DIMS:
        kv, dq = _bwd90_smem(D)
        out += [(f"BwdSm90<{D}>::SMEM", kv), (f"BwdDqSm90<{D}>::SMEM", dq),
                (f"BwdDqSm90<{D}, true>::SMEM", _bwd90_smem(D, False)[1])]
        out += [(f"BwdImg<{D}>::Q_STAGE", bwd_images(D)[0]), (f"BwdImg<{D}>::K_STAGE", bwd_images(D)[1]),
                (f"BwdImg<{D}, true>::K_STAGE", bwd_images(D, False)[1])]
    fwd = [(f"FwdSm90<{D}, {bkv}, {'true' if pv16 else 'false'}>::NST", _fwd90_stages(D, bkv, pv16))
           for D in _checks.SUPPORTED_HEAD_DIMS for bkv in _BLOCK_KV for pv16 in (False, True)]
    fwd += [(f"FwdImg<{D}>::STAGE", fwd_image(D)) for D in _checks.SUPPORTED_HEAD_DIMS]
    return {"int8/int8_attn_bwd_sm90.cu": out, "int8/int8_attn_fwd_sm90.cu": fwd}


def _qfn(name, T, D):
    return get_function(_QUANT_SRC, name, all_names=_quant_names(T, D))


@dataclass
class Residuals:
    """What :func:`backward` needs, all on the device (docs/algorithms.md §3.5). Treat as opaque.

    ``o`` is the very buffer :func:`forward` returned and ``v`` the caller's V (unless it had to be copied):
    like every autograd system that saves tensors, modifying them in place before :func:`backward`
    changes the gradients."""

    problem: _checks.Problem
    config: SageBwdConfig
    q_codes: object  # (B, Hq, nq_pad, D) int8 of psi(sm_scale * Q); q_scale carries an extra log2(e)
    q_scale: object  # (B, Hq, nq_pad) float32, per row
    k_codes: object  # (B, Hkv, nk_pad, D) int8 of psi(K - mu_K)
    k_scale: object  # (B, Hkv, nk_pad) float32, per row
    v: object        # caller's V (prepared raw view)
    o: object        # forward output (caller layout, raw)
    lse2: object     # (B, Hq, nq_pad) float32, base-2 LSE of the kernel's logits; +inf where no key is seen
    mu_k: object     # (B, Hkv, D) float32 or None
    # Packed sequences (layout "THD", sagecupy/_varlen.py): the per-call table of sequence offsets (int32), and the
    # buffers above in the packed padded layout (sequence s's (H, n_pad_s) block at row H * pad(s)); None otherwise.
    packed: object = None
    # A block of a longer sequence (sagecupy/context_parallel.py): (left, right, shift) as the kernels take them
    # (kernel_mask); None: the problem's own mask.
    mask: tuple | None = None

    @property
    def nq_pad(self):
        return self.q_codes.shape[2]

    @property
    def nk_pad(self):
        return self.k_codes.shape[2]


def column_stat(x, strides, T, shape, absmax):
    """Mean (``absmax=False``: summed in float64, rounded to float32) or psi scale (``True``) of every channel
    of ``x`` (raw (B, H, N, D) memory with 16-byte aligned rows, element ``strides`` (batch, head, token))
    over its N tokens: (B, H, D) float32. Two kernels, no host round trip. NVFP4's K-smoothing takes its mean here
    too (one definition of the statistic for both families)."""
    prog = Program()
    record_column_stat(prog, "out", Ref("x"), strides, T, shape, absmax)
    return prog.run({"x": x})["out"]


def _column_stats_kv(prog, T, shape, strides_k, strides_v, mu_arena=None):
    """Record :func:`column_stat` of K (mean) and of V (psi scale) in one pair of launches: refs (mu_k, v_scale),
    (B, H, D) float32 each. Inputs ``"k"``, ``"v"`` of the program's namespace. The partials and V's scales are
    scratch (arena ``_layout.TMP``); K's mean goes to ``mu_arena`` (None: an array of its own, a residual)."""
    import cupy

    B, H, n, D = shape
    i32, i64 = cupy.int32, cupy.int64
    nchunk = (n + 255) // 256
    part_k = prog.empty("part_k", (B, H, nchunk, D), cupy.float64, arena=_layout.TMP)
    part_v = prog.empty("part_v", (B, H, nchunk, D), cupy.float32, arena=_layout.TMP)
    prog.launch(_qfn(f"column_partial_kv<{T}, {D}>", T, D), (nchunk, H, 2 * B), (256,),
                (Ref("k"), *(i64(s) for s in strides_k), Ref("v"), *(i64(s) for s in strides_v), i32(n), part_k,
                 part_v))
    mu_k = prog.empty("mu_k", (B, H, D), cupy.float32, arena=mu_arena)
    v_scale = prog.empty("v_scale", (B, H, D), cupy.float32, arena=_layout.TMP)
    prog.launch(_qfn("column_finish_kv", T, D), (2 * B * H,), (D,),
                (part_k, part_v, i32(nchunk), i32(n), i32(D), mu_k, v_scale), pdl=True)
    return mu_k, v_scale


def record_column_stat(prog, name, x, strides, T, shape, absmax, arena=None):
    """Record :func:`column_stat` of input ``x`` (a Ref) into ``name`` (in ``arena``, or an array of its own);
    the partials are scratch (arena ``_layout.TMP``)."""
    import cupy

    B, H, n, D = shape
    i32, i64 = cupy.int32, cupy.int64
    nchunk = (n + 255) // 256
    part = prog.empty(name + "_part", (B, H, nchunk, D), cupy.float32 if absmax else cupy.float64, arena=_layout.TMP)
    flag = "true" if absmax else "false"
    prog.launch(_qfn(f"column_partial<{T}, {D}, {flag}>", T, D), (nchunk, H, B), (256,),
                (x, *(i64(s) for s in strides), i32(n), part))
    out = prog.empty(name, (B, H, D), cupy.float32, arena=arena)
    prog.launch(_qfn(f"column_finish<{flag}>", T, D), (B * H,), (D,), (part, i32(nchunk), i32(n), i32(D), out))
    return out


_FWD_PLANS = Plans()
_PRE_NAMES = ("q_codes", "q_scale", "k_codes", "k_scale", "v_t", "v_scale", "qmk", "mu_k", "v", "kv_img", "packed")


def _preprocess_forward(q, k, v, *, causal, sm_scale, layout, config, engine=None, inference=False, window=None,
                        **packed):
    """Validation and the INT8 pre-passes (smoothing mean, Q/K/V quantization): (problem, config, state).
    The first call with a signature validates and records its program (sagecupy/_program.py); later ones replay
    it. ``inference=True`` (:func:`sage_attention`): no residuals are kept, so on the wgmma engine K's plain codes
    and scales are not written (the kernel reads K from the stage images); ``pre["k_codes"]`` is then None."""
    plan, pre = _prepass(q, k, v, causal=causal, sm_scale=sm_scale, layout=layout, config=config, engine=engine,
                         inference=inference, window=window, **packed)
    for n in _PRE_NAMES:  # scratch buffers as arrays (views of the arena), for the tests and tools that read them
        if type(pre[n]) is int:
            pre[n] = plan.prog.member_array(pre, n)
    return plan.p, plan.cfg, pre


def _window_key(window):
    """``window`` in a plan's key, with the type of each side (``(5.0, 0)`` hashes as ``(5, 0)`` but is refused)."""
    return window if window is None else (type(window), tuple((type(x), x) for x in window))


def _prepass(q, k, v, *, causal, sm_scale, layout, config, engine=None, inference=False, window=None,
             cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None, statistics=None):
    """:func:`_preprocess_forward` for the public calls: (plan, pre), scratch buffers as addresses (ints; the arena
    array that holds them is ``pre[_layout.TMP]``, which the caller keeps until the attention kernel is launched)."""
    if _varlen.is_packed(layout, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k):
        if statistics is not None:
            raise ValueError("statistics= is for dense layouts; packed sequences take each sequence's own")
        return _varlen.prepass(q, k, v, causal=causal, sm_scale=sm_scale, layout=layout, config=config, engine=engine,
                               inference=inference, window=window, cu_seqlens_q=cu_seqlens_q,
                               cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k)
    q, k, v = (_checks.as_cupy(x, n) for x, n in ((q, "q"), (k, "k"), (v, "v")))
    plan = _FWD_PLANS.get_or_build(
        lambda: (signature(q), signature(k), signature(v), causal, type(causal), scale_key(sm_scale), type(sm_scale),
                 layout, config, engine, bool(inference), _window_key(window), _stats_key(statistics), env_key()),
        lambda: _forward_plan(q, k, v, causal=causal, sm_scale=sm_scale, layout=layout, config=config,
                              engine=engine, inference=bool(inference), window=window, statistics=statistics))
    ns = _layout.input_ns(plan, plan.p.layout, q=q, k=k, v=v)
    if statistics is not None:
        ns.update(statistics)
    return plan, _run_prepass(plan, ns, q)


def _run_prepass(plan, ns, like):
    """Replay ``plan``'s pre-pass program into ``ns`` (the per-call inputs by name): the pre-pass state the attention
    launch takes (``like``: the input whose bf16 form, CuPy bfloat16 or BF16Array, the output takes; None for callers
    that take the raw output)."""
    ns = plan.prog.run(ns)
    pre = {n: ns.get(n) for n in _PRE_NAMES}
    pre[_layout.TMP], pre["engine"], pre["plan"], pre["like"] = ns.get(_layout.TMP), plan.engine, plan, like
    return pre


def _stats_key(statistics):
    """``statistics`` in a plan's key: None, or the signature of each array and its device (their values are per-call
    inputs; the device, because a replayed plan skips :func:`check_statistics`, which refuses another device's)."""
    if statistics is None:
        return None
    try:
        return tuple(sorted((n, signature(x), x.data.device_id) for n, x in statistics.items()))
    except AttributeError:
        raise TypeError(f"statistics must be None or a dict {{'mu_k': ..., 'v_scale': ...}} of float32 CuPy arrays "
                        f"of shape (B, Hkv, D), got {type(statistics).__name__}") from None


#: The statistics over the whole sequence that :func:`forward` takes from its caller (``statistics=``).
STATISTICS = ("mu_k", "v_scale")


def check_statistics(statistics, p, cfg) -> None:
    """TypeError/ValueError unless ``statistics`` is a dict of exactly :data:`STATISTICS`: float32 CuPy arrays
    ``(B, Hkv, D)`` (C-contiguous, 16-byte aligned, on the current device), for a config whose only statistics over
    the whole sequence are these two (K-smoothing's mean, V's per-channel scales)."""
    if not isinstance(statistics, dict) or set(statistics) != set(STATISTICS):
        got = sorted(statistics) if isinstance(statistics, dict) else type(statistics).__name__
        raise TypeError(f"statistics must be a dict with exactly the keys {STATISTICS} "
                        f"(sagecupy.context_parallel.reduce_statistics), got {got!r}")
    if not cfg.k_smoothing or cfg.v_granularity != "channel":
        raise ValueError(f"statistics= needs a config with k_smoothing=True and v_granularity='channel' (the two "
                         f"statistics it carries), got k_smoothing={cfg.k_smoothing}, "
                         f"v_granularity={cfg.v_granularity!r}")
    import cupy

    for n in STATISTICS:
        _checks.check_buffer(statistics[n], f"statistics[{n!r}]", (p.batch, p.heads_kv, p.head_dim), cupy.float32)


def _forward_plan(q, k, v, *, causal, sm_scale, layout, config, engine, inference=False, window=None,
                  statistics=None):
    """Validate a forward call (CuPy arrays, bfloat16 ones included, or BF16Arrays) and record its pre-pass
    program: a :class:`Plan` (``inference``: see :func:`_preprocess_forward`). The pre-pass does not depend on the
    window: K's mean and V's scales are taken over all the keys, as the reference's simulator takes them."""
    import cupy

    p = _checks.check_attention_args(q, k, v, causal=causal, sm_scale=sm_scale, layout=layout, window=window)
    cfg = get_config(config)
    why = _unsupported_config(cfg)
    if why:
        raise ValueError(f"config: {why}")
    _check_device()
    engine = forward_engine(engine)  # validate before any work
    pv16 = not cfg.pv_int8
    why = _unsupported_pv16(cfg, engine)
    if why:
        raise ValueError(f"config: {why}")
    # the pre-passes read rows with 16-byte loads: strided or misaligned inputs are copied (per call)
    copy = tuple(_layout.needs_copy(_checks.raw(x), True) for x in (q, k, v))
    T, D = _T[p.dtype], p.head_dim
    B, Hq, Hkv, nq, nk = p.batch, p.heads_q, p.heads_kv, p.nq, p.nk
    nq_pad, nk_pad = _layout.roundup(nq, _FWD_BQ), _layout.roundup(nk, _FWD_BKV)
    (qsb, qsh, qsn), (ksb, ksh, ksn), (vsb, vsh, vsn) = (_layout.run_strides(x, c, layout) for x, c in zip((q, k, v), copy))
    i32, i64, f32 = cupy.int32, cupy.int64, cupy.float32
    prog = Program()
    rq, rk, rv = Ref("q"), Ref("k"), Ref("v")

    # K's channel mean (K-smoothing) and V's channel scales: one pair of launches when both are needed. With the
    # 16-bit P.V V is not quantized.
    v_channel = cfg.v_granularity == "channel" and not pv16
    # Buffers: the backward's residuals (Q^, K^, their scales, mu_K) are arrays of their own in the training forward;
    # everything else (and, in the inference forward, everything) is scratch in one arena (_layout.TMP): one allocation per
    # call instead of up to eight, ~2 us of host time each, one of them before the first launch (a synchronized
    # call waits for that time; docs/experiments.md).
    res = _layout.TMP if inference else None
    if statistics is not None:  # the caller's (a block of a longer sequence: the sequence's)
        check_statistics(statistics, p, cfg)
        mu_k, v_scale = Ref("mu_k"), Ref("v_scale")
    elif cfg.k_smoothing and v_channel:
        mu_k, v_scale = _column_stats_kv(prog, T, (B, Hkv, nk, D), (ksb, ksh, ksn), (vsb, vsh, vsn), mu_arena=res)
    else:
        mu_k = (record_column_stat(prog, "mu_k", rk, (ksb, ksh, ksn), T, (B, Hkv, nk, D), False, arena=res)
                if cfg.k_smoothing else None)
        v_scale = (record_column_stat(prog, "v_scale", rv, (vsb, vsh, vsn), T, (B, Hkv, nk, D), True, arena=_layout.TMP)
                   if v_channel else None)
    # Q: psi(sm_scale * Q) per token or per 128-row block, scale stored x log2(e) (the kernels use exp2);
    # qmk = sm_scale * q . mu_K for the LSE. K: psi(K - mu_K) per token or per 64-row block.
    q_codes = prog.empty("q_codes", (B, Hq, nq_pad, D), cupy.int8, arena=res)
    q_scale = prog.empty("q_scale", (B, Hq, nq_pad), f32, arena=res)
    qmk = prog.empty("qmk", (B, Hq, nq_pad), f32, arena=_layout.TMP) if mu_k is not None else None
    # K's plain codes and scales are residuals of the backward (and the mma.sync kernel's operands); the wgmma kernel
    # reads K from the stage images, so the inference forward leaves them out: 32 MB fewer writes at B = 4, H = 16,
    # N = 4K, D = 128 (quant_rows_body skips null outputs).
    plain_k = not (inference and engine == "wgmma")
    k_codes = prog.empty("k_codes", (B, Hkv, nk_pad, D), cupy.int8, arena=res) if plain_k else None
    k_scale = prog.empty("k_scale", (B, Hkv, nk_pad), f32, arena=res) if plain_k else None
    # The wgmma kernel copies each K/V stage from per-64-key images (K^ swizzled, V^T, key scales:
    # kernels_cu/int8/bwd_img.cuh FwdImg; a 128-key tile is two) with bulk copies; the K pass and the V pass
    # write them.
    kv_img = (prog.empty("kv_img", (B, Hkv, nk_pad // 64, fwd_image(D)), cupy.uint8, arena=_layout.TMP)
              if engine == "wgmma" else None)
    mode = 0 if v_channel else 2  # V's scales: per channel, or per 64-token block (computed by the V pass)
    if not v_channel and not pv16:
        v_scale = prog.empty("v_scale", (B, Hkv, nk_pad // 64, D), f32, arena=_layout.TMP)
    qk_args = (rq, i64(qsb), i64(qsh), i64(qsn), i32(nq), i32(nq_pad), f32(p.sm_scale), q_codes, q_scale, f32(LOG2E),
               qmk, rk, i64(ksb), i64(ksh), i64(ksn), i32(nk), i32(nk_pad), k_codes, k_scale, mu_k, i32(Hq), i32(Hkv),
               kv_img)
    # Q, K and V in one launch where V's 64-token blocks take 256 = 2 D threads, as the Q and K rows do (the same
    # bytes as quant_rows_qk then fwd_v_image, one launch fewer; docs/experiments.md)
    if cfg.q_granularity == "token" and cfg.k_granularity == "token" and kv_img is not None and D == 128 and not pv16:
        prog.launch(_qfn(f"quant_qkv<{T}, {D}, {_QK_RPW}, {mode}>", T, D),
                    (max(nq_pad, nk_pad) // (8 * _QK_RPW), Hq + 2 * Hkv, B), (256,),
                    qk_args + (rv, i64(vsb), i64(vsh), i64(vsn), v_scale, v_scale), pdl=True)
        return Plan(p, cfg, engine, copy, prog)
    if cfg.q_granularity == "token" and cfg.k_granularity == "token":  # both in one launch
        prog.launch(_qfn(f"quant_rows_qk<{T}, {D}, {_QK_RPW}>", T, D),
                    (max(nq_pad, nk_pad) // (8 * _QK_RPW), Hq + Hkv, B), (256,), qk_args)
    else:
        rpw, grouped = (4, "false") if cfg.q_granularity == "token" else (16, "true")
        prog.launch(_qfn(f"quant_rows<{T}, {D}, {rpw}, {grouped}>", T, D), (nq_pad // (8 * rpw), Hq, B), (256,),
                    (rq, i64(qsb), i64(qsh), i64(qsn), i32(nq), i32(nq_pad), None, i32(1), f32(p.sm_scale),
                     q_codes, q_scale, f32(LOG2E), mu_k, i32(p.group), f32(p.sm_scale), qmk, None))
        rpw, grouped = (4, "false") if cfg.k_granularity == "token" else (8, "true")
        prog.launch(_qfn(f"quant_rows<{T}, {D}, {rpw}, {grouped}>", T, D), (nk_pad // (8 * rpw), Hkv, B), (256,),
                    (rk, i64(ksb), i64(ksh), i64(ksn), i32(nk), i32(nk_pad), mu_k, i32(1), f32(1.0),
                     k_codes, k_scale, f32(1.0), None, i32(1), f32(0.0), None, kv_img))
    # V: psi(V) per channel (whole sequence) or per 64-token block, transposed and mma-permuted. The wgmma engine
    # (kv_img) gets the codes in the images; the mma.sync engine gets v_t, tile-major (B, Hkv, nk_pad / 64, D, 64)
    # for 64-key tiles (whole 128-byte lines per copied tile row pair: 1.02x forward kernel on the H200,
    # docs/experiments.md) or (B, Hkv, D, nk_pad) for 128-key tiles.
    tile_major = cfg.block_kv == 64
    if pv16:  # V as it is, in the 16-bit images the kernel reads through v_t
        v_t = prog.empty("v_t", (B, Hkv, nk_pad // 64, 128 * D), cupy.uint8, arena=_layout.TMP)
        prog.launch(_qfn(f"fwd_v16_image<{T}, {D}>", T, D), (nk_pad // 64, Hkv, B), (256,),
                    (rv, i64(vsb), i64(vsh), i64(vsn), i32(nk), i32(nk_pad), v_t))
    elif kv_img is not None:
        prog.launch(_qfn(f"fwd_v_image<{T}, {D}, {mode}>", T, D), (nk_pad // 64, Hkv, B), (2 * D,),
                    (rv, i64(vsb), i64(vsh), i64(vsn), i32(nk), i32(nk_pad), v_scale, v_scale, kv_img))
    else:
        v_t = prog.empty("v_t", (B, Hkv, nk_pad // 64, D, 64) if tile_major else (B, Hkv, D, nk_pad), cupy.int8,
                         arena=_layout.TMP)
        prog.launch(_qfn(f"quant_transpose_perm<{T}, {D}, {mode}>", T, D), (nk_pad // 64, Hkv, B), (2 * D,),
                    (rv, i64(vsb), i64(vsh), i64(vsn), i32(nk), i32(nk_pad), v_scale, v_scale, v_t,
                     i32(int(tile_major))))
    return Plan(p, cfg, engine, copy, prog)


def v_t_channels(v_t):
    """The forward's V^ codes (``pre["v_t"]``) as (B, Hkv, D, nk_pad), channel rows over the whole sequence (tokens
    still mma-permuted in 32-groups), whichever of its two layouts it has: a view or a copy."""
    if v_t.ndim == 4:
        return v_t
    B, H, nblk, D, w = v_t.shape
    return v_t.transpose(0, 1, 3, 2, 4).reshape(B, H, D, nblk * w)


def _launch_forward(p, cfg, pre, engine=None, mask=None, o_out=None):
    """The attention kernel alone (after :func:`_preprocess_forward`): (o, lse, lse2). The launch program is
    recorded once per (pre-pass plan, engine, mask, :func:`~sagecupy._program.env_key`); ``mask``: see
    :func:`kernel_mask` (dense layouts only). ``o_out``: a buffer the kernel writes O into (:func:`_forward_into`)."""
    prog = pre["plan"].launch_program(p, cfg, lambda: (engine, mask, env_key()),
                                      lambda: _forward_launch_program(p, cfg, pre, engine, mask))
    ns = {n: pre[n] for n in _PRE_NAMES}
    if o_out is not None:
        ns["o"] = o_out
    prog.run(ns)
    _check_written(ns, {"o": o_out})
    return ns["o"], ns["lse"], ns["lse2"]


def _check_written(ns, out):
    """RuntimeError unless each given output buffer is the array a program left under its name (a program that
    allocates under another name would leave the buffer unwritten)."""
    for name, buf in out.items():
        if buf is not None and ns[name] is not buf:
            raise RuntimeError(f"the launch program did not write {name!r} into the given buffer")


def _forward_into(o_out, q, k, v, *, inference, **kw):
    """The forward behind :func:`sage_attention` (``inference``: no residuals) and :func:`forward`: ``(o, lse,
    residuals or None)``. ``o_out``: None, or a buffer the kernel writes O into (raw fp16, or bf16's uint16 bits: a
    C-contiguous array of q's shape), for adapters whose framework allocated the output (the JAX adapter: XLA's
    buffer, instead of a copy into it); ``o`` is then over ``o_out``'s memory."""
    plan, pre = _prepass(q, k, v, inference=inference, **kw)
    p, cfg = plan.p, plan.cfg
    o, lse, lse2 = _launch_forward(p, cfg, pre, kw.get("engine"), o_out=o_out)
    res = None if inference else Residuals(p, cfg, pre["q_codes"], pre["q_scale"], pre["k_codes"], pre["k_scale"],
                                           pre["v"], o, lse2, pre["mu_k"], pre["packed"])
    return _checks.wrap(o, p.dtype, pre["like"]), lse, res


def _forward_launch_program(p, cfg, pre, engine, mask=None):
    import cupy

    T, D = _T[p.dtype], p.head_dim
    B, Hq, Hkv, nq, nk, layout = p.batch, p.heads_q, p.heads_kv, p.nq, p.nk, p.layout
    nq_pad, nk_pad = _layout.roundup(nq, _FWD_BQ), _layout.roundup(nk, _FWD_BKV)  # as the pre-pass padded them
    i32, i64, f32 = cupy.int32, cupy.int64, cupy.float32
    w, bkv = _FWD_WARPS, cfg.block_kv
    engine_arg, engine = engine, pre["engine"]  # the engine the pre-pass prepared for (wgmma: its K/V images)
    if engine_arg and forward_engine(engine_arg) != engine:
        raise ValueError(f"engine={engine_arg!r}: the pre-pass was prepared for engine={engine!r}; "
                         f"call _preprocess_forward(..., engine={engine_arg!r})")
    if engine == "wgmma" and pre["kv_img"] is None:
        raise ValueError("the pre-pass has no K/V stage images (kv_img), which the wgmma kernel reads; call "
                         "_preprocess_forward(..., engine='wgmma')")
    if p.layout == _layout.PACKED:
        if mask is not None:
            raise ValueError("a block mask is for dense layouts; packed sequences keep their own")
        return _varlen.forward_launch_program(p, cfg, pre, engine)
    pv16 = not cfg.pv_int8
    src, name, arch = _fwd_kernel(T, D, bkv, engine, pv16)
    fn = get_function(src, name, arch=arch)
    stages = _fwd90_stages(D, bkv, pv16) if engine == "wgmma" else 2
    smem = _fwd_smem(D, bkv, stages, pv16)
    if smem > 48 * 1024:
        fn.max_dynamic_shared_size_bytes = smem
    prog = Program()
    o_shape = _layout.layout_shape((B, Hq, nq, D), layout)
    o = prog.empty("o", o_shape, _layout.bits_dtype(p.dtype))
    osb, osh, osn = _layout.c_strides(o_shape, layout)
    lse = prog.empty("lse", (B, Hq, nq), f32)
    # lse2 (the backward's residual) is written by the inference forward too: with a null lse2 the kernel's LSE came out
    # 1 ulp off in some rows (the epilogue compiles differently around the skipped store), and it is 4 bytes per row
    lse2 = prog.empty("lse2", (B, Hq, nq_pad), f32)

    def arg(name):  # a pre-pass array (None stays None: the kernel ignores it)
        return Ref(name) if pre[name] is not None else None

    prog.launch(fn, (nq_pad // (16 * w), Hq, B), (32 * w,),
                (arg("q_codes"), arg("q_scale"), arg("k_codes"), arg("k_scale"), arg("v_t"), arg("v_scale"),
                 arg("qmk"), o, i64(osb), i64(osh), i64(osn), lse, lse2,
                 i32(Hq), i32(Hkv), i32(nq), i32(nk), i32(nq_pad), i32(nk_pad), f32(cfg.p_max),
                 *(i32(w) for w in kernel_mask(p, mask)), i32(int(cfg.v_granularity == "block")))
                + ((arg("kv_img"),) if engine == "wgmma" else ()),
                shared_mem=smem, pdl=engine == "wgmma")
    return prog


def forward(q, k, v, *, causal=False, sm_scale=None, layout="HND", config=None, return_lse=False, engine=None,
            window=None, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None,
            statistics=None):
    """SageBwd forward. Returns ``(o, residuals)`` (``(o, lse, residuals)`` with ``return_lse``).

    q: ``(B, Hq, Nq, D)`` (``layout="HND"``) or ``(B, Nq, Hq, D)`` (``"NHD"``); k, v: same with Hkv, Nk.
    fp16 or bf16; D in (64, 128); ``Hq % Hkv == 0``. ``o`` has q's shape and dtype; ``lse`` is
    float32 ``(B, Hq, Nq)``. ``engine``: see :func:`forward_engine`. bf16: CuPy arrays of ``ml_dtypes.bfloat16``
    or :class:`~sagecupy.adapters.bf16.BF16Array` (no copy either way); ``o`` takes q's form. ``window``: None or
    ``(left, right)`` (module docstring); the residuals carry it to :func:`backward`.

    Packed variable-length sequences, ``layout="THD"`` (docs/algorithms.md §1.8, FlashAttention's varlen API):
    q ``(total_q, Hq, D)``, k, v ``(total_k, Hkv, D)``, ``cu_seqlens_q``/``cu_seqlens_k`` the ``S + 1`` int32 prefix
    sums (CuPy arrays: nothing is read back; NumPy arrays or lists: checked, then copied per call), ``max_seqlen_q/k``
    optional ints. ``o`` ``(total_q, Hq, D)``, ``lse`` ``(Hq, total_q)``. Causal masks and windows are per sequence,
    and so is every quantization statistic: the result is the separate calls' (sagecupy/_varlen.py).

    ``statistics``: None (K's mean and V's scales over these keys), or ``{"mu_k", "v_scale"}`` given by the caller
    (:func:`check_statistics`; dense layouts, configs with K-smoothing and per-channel V): the keys are then
    quantized with them, as a block of a longer sequence must be (sagecupy/context_parallel.py).
    """
    o, lse, res = _forward_into(None, q, k, v, inference=False, causal=causal, sm_scale=sm_scale, layout=layout,
                                config=config, engine=engine, window=window, cu_seqlens_q=cu_seqlens_q,
                                cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
                                statistics=statistics)
    return (o, lse, res) if return_lse else (o, res)


def sage_attention(q, k, v, *, causal=False, sm_scale=None, layout="HND", return_lse=False, config=None,
                   engine=None, window=None, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None,
                   max_seqlen_k=None, statistics=None):
    """Inference entry point: INT8 attention forward; ``o`` or ``(o, lse)``, bitwise :func:`forward`'s. It keeps no
    residuals, so its pre-pass writes less (on the wgmma engine no plain K codes or scales: they are the backward's).
    ``engine``: see :func:`forward_engine`; ``window`` and packed sequences (``layout="THD"``, ``cu_seqlens_q/k``,
    ``max_seqlen_q/k``), ``statistics``: see :func:`forward`."""
    o, lse, _ = _forward_into(None, q, k, v, inference=True, causal=causal, sm_scale=sm_scale, layout=layout,
                              config=config, engine=engine, window=window, cu_seqlens_q=cu_seqlens_q,
                              cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
                              statistics=statistics)
    return (o, lse) if return_lse else o


def _replayed(q, k, v, plan, inference, kw):
    """``(plan, pre)`` of the forward's pre-pass: :func:`_prepass` (``plan`` None), or ``plan`` replayed on the inputs
    an adapter hands over (:func:`_inference`, :func:`_training`)."""
    if plan is None:
        return _prepass(q, k, v, inference=inference, **kw)
    return plan, _run_prepass(plan, {"q": q, "k": k, "v": v}, None)


def _inference(q, k, v, plan=None, o_out=None, **kw):
    """The inference forward for adapters that replay its plan themselves: ``(o, lse, plan)``, ``o`` raw (bfloat16
    as its uint16 bits). ``plan=None``: :func:`sage_attention` on CuPy arrays q, k, v (validated, the plan looked up
    or recorded), keyword arguments as it takes them. Else ``plan`` is one this function returned for inputs of the
    same signature and keyword arguments, of a dense layout whose inputs needed no copy (``not any(plan.copy)``), and
    q, k, v are the device addresses (ints) of such inputs: the plan is replayed on them, on the current device and
    stream, with no argument checks or plan lookup; the caller keys its plans by everything the lookup keys by
    (sagecupy/adapters/torch_ops.py, sagecupy/adapters/jax.py). The same launches, so the same bits. ``o_out``: as
    for :func:`_forward_into`."""
    plan, pre = _replayed(q, k, v, plan, True, kw)
    o, lse, _ = _launch_forward(plan.p, plan.cfg, pre, kw.get("engine"), o_out=o_out)
    return o, lse, plan


def _training(q, k, v, plan=None, o_out=None, **kw):
    """:func:`_inference` for the training forward (:func:`forward`): ``(o, lse, residuals, plan)``, ``o`` raw. With
    a plan, q and k are addresses and v is the raw CuPy array of the input (bfloat16's uint16 bits, as the pre-pass
    takes it), which the residuals keep for the backward, as :func:`forward`'s keep theirs; or v's address, for a
    caller that rebuilds the residuals' v itself (the JAX adapter)."""
    plan, pre = _replayed(q, k, v, plan, False, kw)
    p, cfg = plan.p, plan.cfg
    o, lse, lse2 = _launch_forward(p, cfg, pre, kw.get("engine"), o_out=o_out)
    res = Residuals(p, cfg, pre["q_codes"], pre["q_scale"], pre["k_codes"], pre["k_scale"], pre["v"], o, lse2,
                    pre["mu_k"], pre["packed"])
    return o, lse, res, plan


def _bwd_smem(D):
    """Dynamic shared memory of the dK/dV kernel: K^, V, Q^, dO tiles; two buffers of Q^^T, dO^^T, the
    per-query q scale, lse2, delta and the query tile's dO scales; 4 floats of scratch."""
    return 6 * 64 * D + 2 * (2 * D * 64 + (3 * 64 + D) * 4) + 16


def fwd_image(D):
    """Bytes of one K/V stage image of the wgmma forward (FwdImg<D> in kernels_cu/int8/bwd_img.cuh): K^, V^T and
    the key scales of 64 keys (a 128-key tile is two images)."""
    return 128 * D + 256


def bwd_images(D, ds_int8=True):
    """Bytes of one query-side and one key-side stage image of the wgmma backward (BwdImg<D, not ds_int8> in
    kernels_cu/int8/bwd_img.cuh): (Q_STAGE, K_STAGE). With ds_int8=False the key side holds K's codes as bf16
    (128 D bytes) in place of their transpose (64 D)."""
    return 320 * D + (192 + D) * 4, (256 if ds_int8 else 320) * D + 256


_BWD_PLANS = Plans()
_RES_NAMES = ("q_codes", "q_scale", "k_codes", "k_scale", "v", "o", "lse2", "packed")
_BPRE_NAMES = ("do", "delta", "q_img", "k_img", "do_t", "do_scale", "q_t", "k_t")


def check_residuals(r) -> None:
    """TypeError/ValueError naming the field unless ``r`` is a :class:`Residuals` whose arrays are what
    :func:`forward` makes for the problem it claims (``r.problem``): shapes (with the forward's padding: query rows
    and keys to multiples of 128), dtypes, the current device, C-contiguous 16-byte aligned buffers, V and O with
    16-byte aligned rows in the problem's layout, and a config the kernels implement. The backward kernels index
    every residual from the problem's sizes, so a residual of another problem would make them read past its end.
    Metadata only (no device work); :func:`backward` runs it once per residual signature."""
    if not isinstance(r, Residuals):
        raise TypeError(f"residuals must be the Residuals returned by sagecupy.int8.forward, got {type(r).__name__}")
    _checks.check_problem(r.problem, "residuals.problem")
    if not isinstance(r.config, SageBwdConfig):
        raise TypeError(f"residuals.config must be a SageBwdConfig, got {type(r.config).__name__}")
    why = _unsupported_config(r.config)
    if why:
        raise ValueError(f"residuals.config: {why}")
    import cupy

    p = r.problem
    mask = getattr(r, "mask", None)
    if p.layout == _layout.PACKED:
        if mask is not None:
            raise ValueError("residuals.mask is for dense layouts; packed sequences keep their own")
        return _varlen.check_residuals(r)
    kernel_mask(p, mask)
    if getattr(r, "packed", None) is not None:
        raise ValueError(f"residuals.packed is the table of packed sequences (layout='THD'); it must be None for "
                         f"layout={p.layout!r}")
    B, Hq, Hkv, D = p.batch, p.heads_q, p.heads_kv, p.head_dim
    nq_pad, nk_pad = _layout.roundup(p.nq, _FWD_BQ), _layout.roundup(p.nk, _FWD_BKV)  # as _forward_plan pads
    f32 = cupy.float32
    for name, shape, dtype in (("q_codes", (B, Hq, nq_pad, D), cupy.int8), ("q_scale", (B, Hq, nq_pad), f32),
                               ("k_codes", (B, Hkv, nk_pad, D), cupy.int8), ("k_scale", (B, Hkv, nk_pad), f32),
                               ("lse2", (B, Hq, nq_pad), f32)):
        _checks.check_buffer(getattr(r, name), f"residuals.{name}", shape, dtype)
    if r.mu_k is not None:  # (not read by the backward; the adapters may leave it out)
        _checks.check_buffer(r.mu_k, "residuals.mu_k", (B, Hkv, D), f32)
    bits = _layout.bits_dtype(p.dtype)
    _checks.check_rows(r.v, "residuals.v", _layout.layout_shape((B, Hkv, p.nk, D), p.layout), bits)
    _checks.check_rows(r.o, "residuals.o", _layout.layout_shape((B, Hq, p.nq, D), p.layout), bits)


def _res_sig(x):
    """What :func:`check_residuals` reads of a residual array (its device included), or None for None."""
    return None if x is None else (type(x), x.shape, x.strides, x.dtype, x.data.ptr & 15, x.data.device_id)


def _bwd_key(r, do, engine):
    """The backward plan's key: the residuals' problem, config and every residual array's metadata, so that a plan
    (recorded after :func:`check_residuals` passed) is only ever replayed for residuals that pass it too (a problem
    equal by value to a checked one, ``nq=100.0`` for ``100``, shares its plan and launches). A field that is not an
    array raises TypeError: the call then takes the uncached path, whose validation names it."""
    try:
        arrays = tuple(_res_sig(getattr(r, n)) for n in _RES_NAMES) + (_res_sig(r.mu_k),)
    except AttributeError:
        raise TypeError("a residual is not an array") from None
    return r.problem, r.config, arrays, r.mask, signature(do), engine, env_key()


def _preprocess_backward(residuals, do, engine=None):
    """Validation, delta = rowsum(dO * O), INT8 dO^T (INT8 dV only), transposed (mma-permuted) Q and K codes (INT8 dK
    and dQ only). On the wgmma engine
    they go, with Q^, K^, dO, V and the per-token vectors, into per-tile stage images (kernels_cu/int8/bwd_img.cuh)
    that the kernels copy with one bulk copy per stage; with ds_int8=False the images hold Q's and K's codes as bf16
    instead of their transposes, and no dO codes. Recorded once per call signature (sagecupy/_program.py),
    the residuals' metadata included (:func:`_bwd_key`)."""
    if not isinstance(residuals, Residuals):
        raise TypeError(f"residuals must be the Residuals returned by sagecupy.int8.forward, got "
                        f"{type(residuals).__name__}")
    r = residuals
    do = _checks.as_cupy(do, "do")
    plan = _BWD_PLANS.get_or_build(lambda: _bwd_key(r, do, engine), lambda: _backward_plan(r, do, engine))
    ns = _layout.input_ns(plan, plan.p.layout, do=do)
    ns.update((n, getattr(r, n)) for n in _RES_NAMES)
    plan.prog.run(ns)
    pre = {n: ns[n] for n in _BPRE_NAMES if n in ns}
    pre["engine"], pre["plan"], pre["like"] = plan.engine, plan, do  # (the gradients take do's bf16 form)
    return pre


def _backward_plan(r, do, engine):
    import cupy

    check_residuals(r)
    p, cfg = r.problem, r.config
    if tuple(do.shape) != tuple(r.o.shape):
        raise ValueError(f"do.shape={tuple(do.shape)} must equal the output's shape {tuple(r.o.shape)}")
    if _checks.dtype_name(do.dtype) != p.dtype:
        raise TypeError(f"do.dtype={_checks.dtype_name(do.dtype)} must equal the input dtype {p.dtype}")
    copy = (_layout.needs_copy(_checks.raw(do), True),)
    if p.layout == _layout.PACKED:
        return _varlen.backward_plan(r, do, engine, copy)
    T, D = _T[p.dtype], p.head_dim
    B, Hq, Hkv, nq = p.batch, p.heads_q, p.heads_kv, p.nq
    nq_pad, nk_pad = r.nq_pad, r.nk_pad
    i32, i64, f32 = cupy.int32, cupy.int64, cupy.float32
    dsb, dsh, dsn = _layout.run_strides(do, copy[0], p.layout)
    osb, osh, osn = _layout.strides(r.o, p.layout)
    engine = backward_engine(engine)
    prog = Program()
    rdo, ro = Ref("do"), Ref("o")
    delta = prog.empty("delta", (B, Hq, nq_pad), f32)
    mode = 1 if cfg.do_granularity == "channel" else 2
    if engine == "wgmma":
        qst, kst = bwd_images(D, cfg.ds_int8)
        q_img = prog.empty("q_img", (B, Hq, nq_pad // 64, qst), cupy.uint8)
        k_img = prog.empty("k_img", (B, Hkv, nk_pad // 64, kst), cupy.uint8)
        vsb, vsh, vsn = _layout.strides(r.v, p.layout)
        ds16 = "false" if cfg.ds_int8 else "true"
        prog.launch(_qfn(f"bwd_qk_images<{T}, {D}, {ds16}>", T, D), (max(nq_pad, nk_pad) // 64, Hq + Hkv, B), (256,),
                    (Ref("q_codes"), Ref("q_scale"), Ref("lse2"), i32(nq_pad), q_img, Ref("k_codes"), Ref("k_scale"),
                     i32(nk_pad), Ref("v"), i64(vsb), i64(vsh), i64(vsn), i32(p.nk), k_img, i32(Hq), i32(Hkv)))
        # (ds_int8=False: dV and dK read no dO codes, so the pass writes dO and delta only)
        do_name = f"bwd_do_image<{T}, {D}, {mode}>" if cfg.ds_int8 else f"bwd_do16_image<{T}, {D}>"
        prog.launch(_qfn(do_name, T, D), (nq_pad // 64, Hq, B), (2 * D,),
                    (rdo, i64(dsb), i64(dsh), i64(dsn), i32(nq), i32(nq_pad), q_img, ro, i64(osb), i64(osh), i64(osn),
                     delta))
        return Plan(p, cfg, engine, copy, prog)
    # dO^T, Q^T and K^T codes tile-major, (B, H, n_pad / 64, D, 64): the backward kernels copy 64-token tiles of
    # D rows x 64 bytes, which then read whole 128-byte lines (as V^T in the forward). delta = rowsum(dO * O) in
    # the same pass over dO. The INT8 dV alone reads dO's codes, the INT8 dK alone Q^T and the INT8 dQ alone K^T:
    # the 16-bit forms (dv_int8=False, ds_int8=False) skip them (delta alone, no transposes).
    if cfg.dv_int8:
        do_t = prog.empty("do_t", (B, Hq, nq_pad // 64, D, 64), cupy.int8)
        do_scale = prog.empty("do_scale", (B, Hq, nq_pad // 64, D), f32)
        prog.launch(_qfn(f"quant_transpose_perm_delta<{T}, {D}, {mode}>", T, D), (nq_pad // 64, Hq, B), (2 * D,),
                    (rdo, i64(dsb), i64(dsh), i64(dsn), i32(nq), i32(nq_pad), do_scale, do_t,
                     ro, i64(osb), i64(osh), i64(osn), delta))
    else:
        prog.launch(_qfn(f"bwd_delta<{T}, {D}>", T, D), (nq_pad // 64, Hq, B), (2 * D,),
                    (rdo, i64(dsb), i64(dsh), i64(dsn), i32(nq), i32(nq_pad), ro, i64(osb), i64(osh), i64(osn), delta))
    if cfg.ds_int8:
        q_t = prog.empty("q_t", (B, Hq, nq_pad // 64, D, 64), cupy.int8)
        k_t = prog.empty("k_t", (B, Hkv, nk_pad // 64, D, 64), cupy.int8)
        prog.launch(_qfn(f"transpose_i8_qk<{D}, true>", T, D), (max(nq_pad, nk_pad) // 64, Hq + Hkv, B), (256,),
                    (Ref("q_codes"), i32(nq_pad), q_t, Ref("k_codes"), i32(nk_pad), k_t, i32(Hq), i32(Hkv)))
    return Plan(p, cfg, engine, copy, prog)


def _backward_program(r, pre, engine=None, kernels=("dkdv", "dq")):
    """The launch program of :func:`_launch_backward`, recorded once per (pre-pass plan, engine, kernels)."""
    return pre["plan"].launch_program(  # V's and dO's strides are in the mma.sync kernels' launches: in the key
        r.problem, r.config,
        lambda: (engine, "dkdv" in kernels, "dq" in kernels, signature(r.v), signature(pre["do"]), r.mask, env_key()),
        lambda: _backward_launch_program(r, pre, engine, kernels))


def _run_backward(r, pre, prog, given=None):
    """Run the launch program ``prog`` on the residuals and the pre-pass state ``pre``: the raw namespace."""
    ns = {n: getattr(r, n) for n in _RES_NAMES}
    ns.update((n, pre[n]) for n in _BPRE_NAMES if n in pre)
    if given:
        ns.update((n, b) for n, b in given.items() if b is not None)
    return prog.run(ns)


def _launch_backward(r, pre, engine=None, kernels=("dkdv", "dq"), out=None):
    """The two backward kernels alone (dK/dV, then dQ), after :func:`_preprocess_backward`. No atomics: the
    gradients are bitwise repeatable. ``kernels`` (benchmarks): launch only some of them; the gradients of
    a kernel not launched are left uninitialized. Recorded once per (pre-pass plan, engine, kernels). ``out``:
    buffers the kernels write dQ, dK, dV into (:func:`_backward_into`)."""
    given = dict(zip(("dq", "dk", "dv"), out or (None,) * 3))
    ns = _run_backward(r, pre, _backward_program(r, pre, engine, kernels), given)
    _check_written(ns, given)
    dt, like = r.problem.dtype, pre.get("like")
    return tuple(_checks.wrap(ns[n], dt, like) for n in ("dq", "dk", "dv"))


def _backward_launch_program(r, pre, engine, kernels):
    import cupy

    p, cfg = r.problem, r.config
    T, D = _T[p.dtype], p.head_dim
    B, Hq, Hkv, nq, nk, layout = p.batch, p.heads_q, p.heads_kv, p.nq, p.nk, p.layout
    engine_arg, engine = engine, pre["engine"]  # the engine the pre-pass prepared for (wgmma: its stage images)
    if engine_arg and backward_engine(engine_arg) != engine:
        raise ValueError(f"engine={engine_arg!r}: the pre-pass was prepared for engine={engine!r}; "
                         f"call _preprocess_backward(..., engine={engine_arg!r})")
    if layout == _layout.PACKED:
        return _varlen.backward_launch_program(r, pre, engine, kernels)
    nq_pad, nk_pad = r.nq_pad, r.nk_pad
    i32, i64, f32 = cupy.int32, cupy.int64, cupy.float32
    dsb, dsh, dsn = _layout.strides(pre["do"], layout)
    vsb, vsh, vsn = _layout.strides(r.v, layout)
    prog = Program()
    bits = _layout.bits_dtype(p.dtype)
    kv_shape, q_shape = _layout.layout_shape((B, Hkv, nk, D), layout), _layout.layout_shape((B, Hq, nq, D), layout)
    dk, dv, dq = prog.empty("dk", kv_shape, bits), prog.empty("dv", kv_shape, bits), prog.empty("dq", q_shape, bits)
    ksb_, ksh_, ksn_ = _layout.c_strides(kv_shape, layout)
    vvb, vvh, vvn = ksb_, ksh_, ksn_
    qsb, qsh, qsn = _layout.c_strides(q_shape, layout)
    ds_rowcol = i32(int(cfg.ds_granularity == "rowcol"))
    win = tuple(i32(w) for w in kernel_mask(p, r.mask))
    names = _bwd_names(T, D, engine, cfg.dv_int8, cfg.ds_int8)
    src, arch = _BWD_SOURCES[engine]
    smem, smem_q = bwd_smem(D, engine, cfg.ds_int8)
    fn = get_function(src, names[0], all_names=names, arch=arch)
    if smem > 48 * 1024:
        fn.max_dynamic_shared_size_bytes = smem
    R = Ref
    if "dkdv" in kernels and engine == "wgmma":
        prog.launch(fn, (nk_pad // 64, Hkv, B), (128,),
                    (R("q_img"), R("k_img"), R("k_scale"),
                     dk, i64(ksb_), i64(ksh_), i64(ksn_), dv, i64(vvb), i64(vvh), i64(vvn),
                     i32(Hq), i32(Hkv), i32(nq), i32(nk), i32(nq_pad), i32(nk_pad), f32(cfg.p_max),
                     *win, i32(int(cfg.p_bwd_granularity == "column")), ds_rowcol),
                    shared_mem=smem)
    elif "dkdv" in kernels:
        prog.launch(fn, (nk_pad // 64, Hkv, B), (128,),
                    (R("q_codes"), R("q_scale"), R("q_t") if cfg.ds_int8 else None, R("k_codes"), R("k_scale"),
                     R("v"), i64(vsb), i64(vsh), i64(vsn), R("do"), i64(dsb), i64(dsh), i64(dsn),
                     R("do_t") if cfg.dv_int8 else None, R("do_scale") if cfg.dv_int8 else None, R("lse2"), R("delta"),
                     dk, i64(ksb_), i64(ksh_), i64(ksn_), dv, i64(vvb), i64(vvh), i64(vvn),
                     i32(Hq), i32(Hkv), i32(nq), i32(nk), i32(nq_pad), i32(nk_pad), f32(cfg.p_max),
                     *win, i32(int(cfg.p_bwd_granularity == "column")), ds_rowcol),
                    shared_mem=smem)
    fq = get_function(src, names[1], all_names=names, arch=arch)
    if smem_q > 48 * 1024:
        fq.max_dynamic_shared_size_bytes = smem_q
    if "dq" in kernels and engine == "wgmma":
        prog.launch(fq, (nq_pad // 64, Hq, B), (128,),
                    (R("q_img"), R("k_img"), R("q_scale"), R("lse2"), R("delta"),
                     dq, i64(qsb), i64(qsh), i64(qsn),
                     i32(Hq), i32(Hkv), i32(nq), i32(nk), i32(nq_pad), i32(nk_pad), f32(p.sm_scale),
                     *win, ds_rowcol),
                    shared_mem=smem_q)
    elif "dq" in kernels:
        prog.launch(fq, (nq_pad // 64, Hq, B), (128,),
                    (R("q_codes"), R("q_scale"), R("k_codes"), R("k_scale"), R("k_t") if cfg.ds_int8 else None,
                     R("v"), i64(vsb), i64(vsh), i64(vsn), R("do"), i64(dsb), i64(dsh), i64(dsn), R("lse2"),
                     R("delta"), dq, i64(qsb), i64(qsh), i64(qsn),
                     i32(Hq), i32(Hkv), i32(nq), i32(nk), i32(nq_pad), i32(nk_pad), f32(p.sm_scale),
                     *win, ds_rowcol),
                    shared_mem=smem_q)
    return prog


def backward(residuals: Residuals, do, *, engine=None):
    """SageBwd backward: ``(dq, dk, dv)`` in the forward's layout and dtype (fp32 accumulation inside); for bf16,
    in ``do``'s form (a CuPy bfloat16 array or a :class:`~sagecupy.adapters.bf16.BF16Array`).
    ``engine``: see :func:`backward_engine`. ``residuals`` are checked against the problem they claim
    (:func:`check_residuals`) before any launch."""
    return _backward_into(None, residuals, do, engine=engine)


def _backward_replay(r, do, replay=None):
    """The backward for adapters that replay its programs themselves: ``(dq, dk, dv, replay)``, the gradients raw
    (bfloat16 as its uint16 bits). ``replay=None``: :func:`backward` on the residuals ``r`` and the CuPy array ``do``
    (validated, the programs looked up or recorded); ``replay`` is then None where ``do`` needed a copy, else the
    pre-pass plan and the launch program. Else ``replay`` is such a pair from an earlier call on residuals of the same
    forward plan (so of the same metadata) and a ``do`` of the same signature, now its raw array: both programs run
    again with no checks or lookups (sagecupy/adapters/torch_ops.py). The same launches, so the same bits."""
    if replay is None:
        pre = _preprocess_backward(r, do)
        plan, prog = pre["plan"], _backward_program(r, pre)
    else:
        plan, prog = replay
        ns = {n: getattr(r, n) for n in _RES_NAMES}
        ns["do"] = do
        plan.prog.run(ns)
        pre = {n: ns[n] for n in _BPRE_NAMES if n in ns}
    ns = _run_backward(r, pre, prog)
    return ns["dq"], ns["dk"], ns["dv"], (None if any(plan.copy) else (plan, prog))


def _backward_into(out, residuals, do, *, engine=None):
    """:func:`backward`, with ``out`` None or three buffers the kernels write dQ, dK, dV into (in the raw form of
    :func:`_forward_into`'s ``o_out``, of q's, k's and v's shapes), for adapters whose framework allocated the
    gradients (the JAX adapter: XLA's buffers, instead of three copies into them)."""
    backward_engine(engine)  # validate before any work
    return _launch_backward(residuals, _preprocess_backward(residuals, do, engine), engine, out=out)


# (at the end: _varlen imports this module's names)
from . import _varlen  # noqa: E402
