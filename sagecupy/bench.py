"""Speed measurements: sagecupy kernels beside the attention baselines that count on Hopper, in the same process.

Baselines (``BASELINES``; each one that cannot run here is skipped with one row saying why):

- ``sdpa``: PyTorch's ``scaled_dot_product_attention`` as a user calls it, no backend forced (on Hopper it picks
  cuDNN for bf16); rows ``sdpa-default``.
- ``flash`` / ``cudnn``: the same with that backend forced; rows ``sdpa-flash`` / ``sdpa-cudnn``.
- ``cudnn-fp8``: cuDNN's FP8 (E4M3) attention forward and backward through the cuDNN frontend's graph API
  (:mod:`sagecupy._cudnn_fp8`); rows ``cudnn-fp8``, scope ``kernel`` on FP8 inputs as cuDNN receives them, ``e2e``
  with the amax passes and bf16-to-FP8 casts of Q, K, V (and dO for the backward) included.

Everything is timed with CUDA events on the current stream after warm-up; the median of
``rep`` runs is reported in milliseconds (``ms``). FLOPs follow docs/algorithms.md §8 (FlashAttention's
convention): forward ``4 B Hq Nq Nk D``, halved for causal with ``Nq == Nk``; backward 2.5x,
forward+backward 3.5x. INT8 rates are TOPS, the others TFLOPS; the ``tops`` field holds either.

Modes: ``fwd`` / ``bwd`` / ``fwdbwd``; ``scope``: ``kernel`` (the attention kernel alone, inputs
already quantized) or ``e2e`` (what a user calls: validation, smoothing, quantization, kernel), each call
synchronized; ``e2e-b2b``: the same call issued back to back (:func:`time_ms_b2b`), the GPU time per call
when the host keeps ahead (as in a training or serving loop). The INT8 forward's ``e2e`` / ``e2e-b2b`` rows time the
inference call (``int8.sage_attention``), as SDPA's forward is timed under ``torch.no_grad()``; ``train`` /
``train-b2b`` time the training forward (``int8.forward``, which also keeps the backward's residuals), compared with
the same no-grad SDPA forward.

Packed batches and sliding windows (:func:`run_varlen_suite`; off unless a run asks for them): ``packed`` cases, 16K
tokens as S causal documents of seeded random lengths (``_bench_common.doc_lengths``) in one ``layout="THD"`` call,
and ``window`` cases, the sweep's shapes causal with window ``(W, 0)``. Rows carry ``case`` (``packed`` /
``window``), ``S``, ``seed`` and ``lengths`` or ``W``, and ``pairs``, the visible query-key pairs summed over the
documents: their FLOPs (``4 pairs H D``, x2.5 backward, x3.5 forward+backward) give ``tops``, comparable with the
dense rows. INT8 rows are ``sagecupy-int8-packed`` / ``sagecupy-int8-window`` (forward: the inference call;
forward+backward; ``e2e`` and ``e2e-b2b``), their baselines ``VARLEN_BASELINES`` (cuDNN's bf16 SDPA with ragged
offsets or its diagonal band, SDPA per document, PyTorch's varlen attention, FlexAttention), with the same scopes.

Adapters (``ADAPTERS``; off unless ``run_suite`` is given ``adapters``; each one that cannot run here is skipped with
one row saying why): the same INT8 calls through ``sagecupy.torch.sage_attention`` on PyTorch tensors (rows
``sagecupy-int8-torch``) and through ``sagecupy.jax.sage_attention`` inside ``jax.jit`` (rows
``sagecupy-int8-jax``), on the inputs of the CuPy rows, scopes named as theirs (``e2e``, ``e2e-b2b``, ``train``,
``train-b2b``): what a framework user pays over the CuPy call. PyTorch rows are timed with PyTorch's events on its
current stream, where the adapter launches the kernels. XLA computes on a stream of its own that no event recorded
from outside can be ordered with, so the JAX rows read the host clock around the calls and
``jax.block_until_ready`` (field ``timer="host"``): their back-to-back rows measure what the event-timed rows
measure (the last call's wait is shared by ``calls`` calls); their synchronized rows also count the wait for the
result to reach the host (tens of microseconds).
"""
from __future__ import annotations

import json

__all__ = ["flops", "time_ms", "time_ms_b2b", "bench_int8", "bench_fp4", "default_cases", "run_suite",
           "peak_memory", "format_rows", "plot", "BASELINES", "DEFAULT_BASELINES", "parse_baselines", "ADAPTERS",
           "parse_adapters", "VARLEN_BASELINES", "DEFAULT_VARLEN_BASELINES", "parse_varlen_baselines",
           "packed_cases", "window_cases", "bench_int8_varlen", "run_varlen_suite", "format_varlen_rows"]

# The shared pieces keep their public names here (sagecupy.bench.flops, .time_ms, .BASELINES, ...).
from ._bench_common import (ADAPTERS, BASELINES, DEFAULT_BASELINES, DEFAULT_VARLEN_BASELINES, VARLEN_BASELINES,
                            _config_name, _inputs, _shape, case_fields, case_name, case_shape, default_cases, flops,
                            median_rows, packed_cases, pair_flops, parse_adapters, parse_baselines, parse_int_list,
                            parse_varlen_baselines, time_ms, time_ms_b2b, window_cases, DEFAULT_PACKED,
                            DEFAULT_WINDOWS)


def bench_int8(D, N, causal, *, config=None, dtype="bfloat16", warmup=3, rep=10, modes=("fwd", "bwd", "fwdbwd")):
    """Rows for the SageBwd kernels, kernel-only and end-to-end."""
    from . import int8
    from ._loader import device_capability

    B, H, (q, k, v, do) = _inputs(D, N, dtype)
    rows = []

    def row(mode, scope, ms):
        rows.append(dict(impl="sagecupy-int8", config=_config_name(config), mode=mode, scope=scope, D=D, N=N, B=B,
                         H=H, causal=causal, dtype=dtype, ms=ms, tops=flops(B, H, N, N, D, causal, mode) / ms / 1e9))

    p, cfg, pre = int8._preprocess_forward(q, k, v, causal=causal, sm_scale=None, layout="HND", config=config)
    if "fwd" in modes:
        row("fwd", "kernel", time_ms(lambda: int8._launch_forward(p, cfg, pre), warmup, rep))
        # Both engines explicitly, for comparison in the same run ("kernel" is the automatic choice), where the
        # config runs on both (pv_int8=False: the wgmma engine only).
        if int8._unsupported_pv16(cfg, "mma") is None:
            pre_m = int8._preprocess_forward(q, k, v, causal=causal, sm_scale=None, layout="HND", config=config,
                                             engine="mma")[2]  # each engine's own pre-pass outputs
            row("fwd", "kernel-mma", time_ms(lambda: int8._launch_forward(p, cfg, pre_m, "mma"), warmup, rep))
            del pre_m
        if device_capability() == (9, 0):
            row("fwd", "kernel-wgmma", time_ms(lambda: int8._launch_forward(p, cfg, pre, "wgmma"), warmup, rep))
        # "e2e": the inference call (sage_attention: no residuals kept), as SDPA's forward is timed (torch.no_grad);
        # "train": the training forward (int8.forward, which also keeps the backward's residuals)
        row("fwd", "e2e", time_ms(lambda: int8.sage_attention(q, k, v, causal=causal, config=config), warmup, rep))
        row("fwd", "e2e-b2b", time_ms_b2b(lambda: int8.sage_attention(q, k, v, causal=causal, config=config), warmup))
        row("fwd", "train", time_ms(lambda: int8.forward(q, k, v, causal=causal, config=config), warmup, rep))
        row("fwd", "train-b2b", time_ms_b2b(lambda: int8.forward(q, k, v, causal=causal, config=config), warmup))
    o, res = int8.forward(q, k, v, causal=causal, config=config)
    if "bwd" in modes:
        bpre = int8._preprocess_backward(res, do)
        row("bwd", "kernel", time_ms(lambda: int8._launch_backward(res, bpre), warmup, rep))
        bpre_m = int8._preprocess_backward(res, do, "mma")  # each engine's own pre-pass outputs
        row("bwd", "kernel-mma", time_ms(lambda: int8._launch_backward(res, bpre_m, "mma"), warmup, rep))
        del bpre_m
        if device_capability() == (9, 0):
            row("bwd", "kernel-wgmma", time_ms(lambda: int8._launch_backward(res, bpre, "wgmma"), warmup, rep))
        row("bwd", "e2e", time_ms(lambda: int8.backward(res, do), warmup, rep))
    if "fwdbwd" in modes:
        def fb():
            _, r = int8.forward(q, k, v, causal=causal, config=config)
            int8.backward(r, do)
        row("fwdbwd", "e2e", time_ms(fb, warmup, rep))
        row("fwdbwd", "e2e-b2b", time_ms_b2b(fb, warmup))
    return rows


def bench_fp4(D, N, causal, *, family="nvfp4", dtype="bfloat16", warmup=3, rep=10):
    """Rows for the NVFP4 inference forward (kernel alone on packed operands, and end to end) or the FP4 QAT
    training pair (forward, backward, forward+backward, end to end). NVFP4 rows carry the bytes per element
    that packed Q, K, V occupy (fp16/bf16: 2)."""
    from . import nvfp4, qat
    from ._loader import device_capability

    B, H, (q, k, v, do) = _inputs(D, N, dtype)
    rows = []

    def row(impl, mode, scope, ms, **extra):
        rows.append(dict(impl=impl, config="default", mode=mode, scope=scope, D=D, N=N, B=B, H=H, causal=causal,
                         dtype=dtype, ms=ms, tops=flops(B, H, N, N, D, causal, mode) / ms / 1e9, **extra))

    if family == "nvfp4":
        ops = nvfp4.quantize_inputs(q, k, v)
        nbytes = sum(ops[f"{n}_{w}"].nbytes for n in "qkv" for w in ("packed", "scales"))
        bpe = nbytes / (q.size + k.size + v.size)
        row("sagecupy-nvfp4", "fwd", "kernel",
            time_ms(lambda: nvfp4.attention_packed(ops, causal=causal, out_dtype=dtype), warmup, rep),
            qkv_bytes_per_elem=bpe)
        # Both engines explicitly, for comparison in the same run ("kernel" is the automatic choice).
        for eng in ("mma", "wgmma") if device_capability() == (9, 0) else ("mma",):
            row("sagecupy-nvfp4", "fwd", f"kernel-{eng}",
                time_ms(lambda: nvfp4.attention_packed(ops, causal=causal, out_dtype=dtype, engine=eng), warmup, rep),
                qkv_bytes_per_elem=bpe)
        row("sagecupy-nvfp4", "fwd", "e2e", time_ms(lambda: nvfp4.attention(q, k, v, causal=causal), warmup, rep),
            qkv_bytes_per_elem=bpe)
        row("sagecupy-nvfp4", "fwd", "e2e-b2b", time_ms_b2b(lambda: nvfp4.attention(q, k, v, causal=causal), warmup),
            qkv_bytes_per_elem=bpe)
    elif family == "qat":
        row("sagecupy-qat", "fwd", "e2e", time_ms(lambda: qat.forward(q, k, v, causal=causal), warmup, rep))
        for eng in ("mma", "wgmma") if device_capability() == (9, 0) else ("mma",):
            row("sagecupy-qat", "fwd", f"e2e-{eng}",
                time_ms(lambda: qat.forward(q, k, v, causal=causal, engine=eng), warmup, rep))
        _, res = qat.forward(q, k, v, causal=causal)
        row("sagecupy-qat", "bwd", "e2e", time_ms(lambda: qat.backward(res, do), warmup, rep))
        # Both backward engines explicitly (end to end: the delta pass and operand conversions included).
        for eng in ("mma", "wgmma") if device_capability() == (9, 0) else ("mma",):
            row("sagecupy-qat", "bwd", f"e2e-{eng}", time_ms(lambda: qat.backward(res, do, engine=eng), warmup, rep))
            row("sagecupy-qat", "bwd", f"kernel-{eng}", time_ms(qat._bwd_kernels_only(res, do, eng), warmup, rep))

        def fb():
            _, r = qat.forward(q, k, v, causal=causal)
            qat.backward(r, do)
        row("sagecupy-qat", "fwdbwd", "e2e", time_ms(fb, warmup, rep))
        row("sagecupy-qat", "fwdbwd", "e2e-b2b", time_ms_b2b(fb, warmup))
    else:
        raise ValueError(f"family={family!r} is not supported; supported: 'nvfp4', 'qat'")
    return rows


def _emitter(rows, out, log):
    """``emit(batch)``: each row as a JSON line to ``out`` (flushed) and to ``log``, then onto ``rows``."""
    def emit(batch):
        for r in batch:
            if out is not None:
                out.write(json.dumps(r) + "\n")
                out.flush()
            if log is not None:
                log(r)
        rows.extend(batch)
    return emit


def _runnable(names, reason, impls, field):
    """``(names that can run here, one skip row for each of the others)``; ``reason(name)`` says why not, or None."""
    active, skipped = [], []
    for name in names:
        why = reason(name)
        if why is None:
            active.append(name)
        else:
            skipped.append({"impl": impls[name], "mode": "skip", field: name, "reason": why})
    return active, skipped


def run_suite(cases, *, configs=("default",), baselines=DEFAULT_BASELINES, out=None, warmup=3, rep=10, log=None,
              families=("int8",), dtype="bfloat16", progress=None, adapters=(), rounds=1):
    """Every case for every family (int8 with each config, nvfp4, qat) and baseline; JSON lines to ``out`` (a
    file object) as they come. ``dtype``: ``"bfloat16"`` or ``"float16"`` inputs; ``progress(case)`` is called
    after each case's rows.

    ``baselines``: names of ``BASELINES`` (a comma-separated string or an iterable). One that cannot run in this
    process gives a single ``mode="skip"`` row saying why, first, and is not timed; one that fails on a case gives an
    ``error`` row for that case. Neither stops the sweep.

    ``adapters``: names of ``ADAPTERS`` (none by default): their rows follow each config's INT8 rows, with the
    same config; skipped and failing adapters are treated as baselines are.

    ``rounds``: how many times the whole sweep runs, one case after another, each round after the last (a slow
    stretch of the machine then falls on one round's rows, not on every row of one case). With more than one, each
    row carries its ``round`` (0, 1, ...); :func:`median_rows` (which :func:`format_rows` and the bench/tools tables
    apply) keeps the median.
    """
    rounds = _check_rounds(rounds)  # before anything is timed
    from . import bench_frameworks as fw  # PyTorch, JAX and cuDNN are imported only when a run uses them

    rows = []
    emit = _emitter(rows, out, log)

    active, skipped = _runnable(parse_baselines(baselines), fw._baseline_reason, BASELINES, "baseline")
    active_adapters, skipped_adapters = _runnable(parse_adapters(adapters), fw._adapter_reason, ADAPTERS, "adapter")
    skipped += skipped_adapters
    emit(skipped)
    for rnd in range(rounds):
        for D, N, causal in cases:
            batch = []
            for cfg in configs if "int8" in families or active_adapters else ():
                if "int8" in families:
                    batch += bench_int8(D, N, causal, config=cfg, dtype=dtype, warmup=warmup, rep=rep)
                for ad in active_adapters:
                    batch += fw._bench_adapter(ad, D, N, causal, config=cfg, dtype=dtype, warmup=warmup, rep=rep)
            for fam in ("nvfp4", "qat"):
                if fam in families:
                    batch += bench_fp4(D, N, causal, family=fam, dtype=dtype, warmup=warmup, rep=rep)
            for be in active:
                batch += fw._bench_baseline(be, D, N, causal, warmup=warmup, rep=rep, dtype=dtype)
            emit(_tag_round(batch, rnd, rounds))
            if progress is not None:
                progress((D, N, causal))
    return rows


def _check_rounds(rounds) -> int:
    """``rounds`` as an int >= 1, else ValueError naming it."""
    if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 1:
        raise ValueError(f"rounds: a whole number >= 1 is needed, got {rounds!r}")
    return rounds


def _tag_round(batch, rnd, rounds):
    """The batch's rows with ``round=rnd`` where the sweep runs more than one round (else as they are)."""
    return batch if rounds == 1 else [dict(r, round=rnd) for r in batch]


def _varlen_inputs(case, shape, dtype):
    """q, k, v, dO of a packed case (``(T, H, D)``, seed 0) or a window case (the dense sweep's ``(B, H, N, D)``
    inputs), and the keyword arguments of the INT8 calls."""
    import cupy
    import numpy as np

    from .adapters.bf16 import from_float

    if case["kind"] == "window":
        _, _, xs = _inputs(case["D"], case["N"], dtype)
        return xs, dict(causal=True, window=shape["window"])
    rng = cupy.random.default_rng(0)

    def mk():
        x = rng.standard_normal((case["N"], shape["H"], case["D"]), dtype=cupy.float32)
        return x.astype(cupy.float16) if dtype == "float16" else from_float(x)

    xs = (mk(), mk(), mk(), mk())
    cu = cupy.asarray(np.concatenate([[0], np.cumsum(shape["lengths"])]).astype(np.int32))
    L = max(shape["lengths"])
    return xs, dict(causal=True, layout="THD", cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=L, max_seqlen_k=L)


def bench_int8_varlen(case, *, config=None, dtype="bfloat16", warmup=3, rep=10, modes=("fwd", "fwdbwd")):
    """Rows ``sagecupy-int8-packed`` / ``sagecupy-int8-window`` for one case of :func:`packed_cases` /
    :func:`window_cases`: the inference forward (``int8.sage_attention``) and forward+backward (``int8.forward`` then
    ``int8.backward``), each synchronized (``e2e``) and back to back (``e2e-b2b``), as the dense INT8 rows time them;
    TOPS over the case's visible pairs."""
    from . import int8

    shape = case_shape(case)
    (q, k, v, do), kw = _varlen_inputs(case, shape, dtype)
    fields = case_fields(case, shape)
    rows = []

    def row(mode, scope, ms):
        rows.append(dict(impl=f"sagecupy-int8-{case['kind']}", config=_config_name(config), mode=mode, scope=scope,
                         **fields, dtype=dtype, ms=ms, tops=pair_flops(shape["pairs"], shape["H"], case["D"], mode)
                         / ms / 1e9, pairs=shape["pairs"]))

    if "fwd" in modes:
        row("fwd", "e2e", time_ms(lambda: int8.sage_attention(q, k, v, config=config, **kw), warmup, rep))
        row("fwd", "e2e-b2b", time_ms_b2b(lambda: int8.sage_attention(q, k, v, config=config, **kw), warmup))
    if "fwdbwd" in modes:
        def fb():
            _, r = int8.forward(q, k, v, config=config, **kw)
            int8.backward(r, do)
        row("fwdbwd", "e2e", time_ms(fb, warmup, rep))
        row("fwdbwd", "e2e-b2b", time_ms_b2b(fb, warmup))
    return rows


def run_varlen_suite(cases, *, configs=("default",), baselines=DEFAULT_VARLEN_BASELINES, out=None, warmup=3,
                     rep=10, log=None, families=("int8",), dtype="bfloat16", progress=None, rounds=1):
    """Every packed or window case (:func:`packed_cases`, :func:`window_cases`) for INT8 with each config (where
    ``families`` has int8) and each baseline of ``VARLEN_BASELINES`` (``baselines``: names, a comma-separated string
    or an iterable); JSON lines to ``out`` as they come, ``progress(case)`` after each case. As in
    :func:`run_suite`, a baseline that cannot run here gives one ``skip`` row saying why and is not timed, one that
    fails on a case an ``error`` row; neither stops the sweep. ``rounds``: as :func:`run_suite` takes it."""
    rounds = _check_rounds(rounds)  # before anything is timed
    from . import bench_frameworks as fw  # PyTorch and cuDNN are imported only when a run uses them

    rows = []
    emit = _emitter(rows, out, log)

    active, skipped = _runnable(parse_varlen_baselines(baselines), fw._varlen_reason, VARLEN_BASELINES, "baseline")
    emit(skipped)
    for rnd in range(rounds):
        for case in cases:
            batch = []
            if "int8" in families:
                for cfg in configs:
                    batch += bench_int8_varlen(case, config=cfg, dtype=dtype, warmup=warmup, rep=rep)
            for be in active:
                batch += fw.bench_varlen_baseline(be, case, warmup=warmup, rep=rep, dtype=dtype)
            emit(_tag_round(batch, rnd, rounds))
            if progress is not None:
                progress(case)
    return rows


def peak_memory(D=128, N=32768, causal=False, *, dtype="bfloat16", config=None) -> list:
    """Peak device memory (bytes) of one forward+backward, inputs included, for sagecupy and SDPA.

    sagecupy: the CuPy memory pool's high-water mark of bytes in use (a memory hook); SDPA:
    ``torch.cuda.max_memory_allocated``. Both count q, k, v, dO and everything the call allocates.
    """
    import cupy
    from cupy.cuda import memory_hook

    from . import int8
    from .adapters.bf16 import from_float

    B, H = _shape(D, N)
    pool = cupy.get_default_memory_pool()

    class Peak(memory_hook.MemoryHook):
        name = "sagecupy-peak"

        def __init__(self):
            self.peak = 0

        def malloc_postprocess(self, **kw):
            self.peak = max(self.peak, pool.used_bytes())

    rows = []
    rng = cupy.random.default_rng(0)

    def mk():
        x = rng.standard_normal((B, H, N, D), dtype=cupy.float32)
        return x.astype(cupy.float16) if dtype == "float16" else from_float(x)

    q, k, v, do = mk(), mk(), mk(), mk()
    cupy.cuda.get_current_stream().synchronize()
    hook = Peak()
    hook.peak = pool.used_bytes()
    with hook:
        _, res = int8.forward(q, k, v, causal=causal, config=config)
        grads = int8.backward(res, do)
        cupy.cuda.get_current_stream().synchronize()
    rows.append(dict(impl="sagecupy-int8", mode="peak_mem", D=D, N=N, B=B, H=H, causal=causal, bytes=hook.peak))
    del q, k, v, do, res, grads
    pool.free_all_blocks()
    try:
        import torch

        dt = torch.bfloat16 if dtype == "bfloat16" else torch.float16
        for backend in ("flash", "cudnn"):
            from torch.nn.attention import SDPBackend, sdpa_kernel

            be = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}[backend]
            torch.cuda.empty_cache()
            qt, kt, vt, dot = (torch.randn((B, H, N, D), device="cuda", dtype=dt) for _ in range(4))
            qt.requires_grad_(), kt.requires_grad_(), vt.requires_grad_()
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            with sdpa_kernel([be]):
                out = torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
                out.backward(dot)
            torch.cuda.synchronize()
            rows.append(dict(impl=f"sdpa-{backend}", mode="peak_mem", D=D, N=N, B=B, H=H, causal=causal,
                             bytes=torch.cuda.max_memory_allocated()))
            del qt, kt, vt, dot, out
    except ImportError:
        pass
    return rows


def _compared_scopes(scope):
    """(SDPA scope, cuDNN FP8 scope) a row of ``scope`` is divided into: back-to-back rows into back-to-back rows;
    rows on operands already quantized (``kernel*``) into cuDNN FP8's ``kernel`` rows (FP8 operands); everything
    else into the synchronized ``e2e`` rows (SDPA has no kernel-only rows)."""
    if scope.endswith("b2b"):
        return "e2e-b2b", "e2e-b2b"
    return "e2e", ("kernel" if scope.startswith("kernel") else "e2e")


def _cupy_key(r):
    """What an adapter row and its CuPy row share: config, mode, scope, case and dtype."""
    return (r.get("config", ""), r["mode"], r.get("scope", "e2e"), r["D"], r["N"], r["causal"], r.get("dtype"))


def format_rows(rows) -> str:
    """An aligned table of benchmark rows with each row's speedup over the baselines of the same run and case
    (baseline ms / row ms; same mode, so fwd+bwd against the baselines' fwd+bwd): ``x sdpa`` PyTorch's default
    SDPA (cuDNN bf16 on Hopper), ``x fp8`` cuDNN's FP8 attention, ``x flash`` / ``x cudnn`` SDPA with that backend
    forced. ``-`` where the run has no such row; skipped baselines and errors get a line each.

    Where the rows include adapter rows (``ADAPTERS``), the impl column widens to their names and a last column
    ``x cupy`` gives each adapter row's CuPy ms / its ms for the ``sagecupy-int8`` row of the same config, mode,
    scope, case and dtype: 1.00 is no cost over the CuPy call, 0.97 a 3% slower call through the framework.

    Rows of the packed and window cases (a ``case`` field, or a baseline of theirs) follow in a table of their own,
    :func:`format_varlen_rows`. Rows of several rounds are shown once, with their median (:func:`median_rows`)."""
    rows = median_rows(rows)
    vimpls = set(VARLEN_BASELINES.values())
    varlen = [r for r in rows if r.get("case") or r.get("impl") in vimpls]
    if varlen:
        rows = [r for r in rows if not (r.get("case") or r.get("impl") in vimpls)]
        tail = format_varlen_rows(varlen)
        return tail if not rows else format_rows(rows) + "\n\n" + tail
    base = {(r["impl"], r.get("scope", "e2e"), r["mode"], r["D"], r["N"], r["causal"]): r["ms"] for r in rows
            if "ms" in r and (r["impl"].startswith("sdpa-") or r["impl"] == "cudnn-fp8")}
    adapter_impls = set(ADAPTERS.values())
    with_adapters = any(r.get("impl") in adapter_impls for r in rows)
    cupy_ms = {_cupy_key(r): r["ms"] for r in rows if with_adapters and "ms" in r and r["impl"] == "sagecupy-int8"}
    w = max([16] + [len(str(r.get("impl", ""))) + 1 for r in rows]) if with_adapters else 16
    lines = [f"{'impl':<{w}}{'cfg':<9}{'mode':<8}{'scope':<13}{'D':>4}{'N':>7}{'causal':>7}{'ms':>9}{'TOPS':>8}"
             f"{'x sdpa':>8}{'x fp8':>8}{'x flash':>9}{'x cudnn':>9}" + (f"{'x cupy':>8}" if with_adapters else "")]
    for r in rows:
        mode = r.get("mode")
        if mode == "peak_mem":
            lines.append(f"{r['impl']:<{w}}peak memory fwd+bwd D={r['D']} N={r['N']} B={r['B']} H={r['H']}: "
                         f"{r['bytes'] / 2**30:.2f} GiB")
            continue
        if mode == "skip":
            lines.append(f"{r.get('impl', '?'):<{w}} skipped: {r.get('reason', '')}")
            continue
        if "ms" not in r:
            lines.append(f"{r.get('impl', '?'):<{w}} error D={r.get('D')} N={r.get('N')} causal={r.get('causal')}: "
                         f"{r.get('error')}")
            continue
        scope = r.get("scope", "e2e")
        sdpa_scope, fp8_scope = _compared_scopes(scope)
        case = (r["mode"], r["D"], r["N"], r["causal"])

        def ratio(impl, sc):
            ms = base.get((impl, sc) + case)
            return f"{ms / r['ms']:.2f}" if ms and r["ms"] else "-"

        tops = r.get("tops")
        line = (f"{r['impl']:<{w}}{r.get('config', ''):<9}{r['mode']:<8}{scope:<13}{r['D']:>4}{r['N']:>7}"
                f"{str(r['causal']):>7}{r['ms']:>9.3f}" + (f"{tops:>8.1f}" if tops is not None else f"{'-':>8}")
                + f"{ratio('sdpa-default', sdpa_scope):>8}{ratio('cudnn-fp8', fp8_scope):>8}"
                f"{ratio('sdpa-flash', sdpa_scope):>9}{ratio('sdpa-cudnn', sdpa_scope):>9}")
        if with_adapters:
            ms = cupy_ms.get(_cupy_key(r)) if r["impl"] in adapter_impls else None
            line += f"{ms / r['ms']:>8.2f}" if ms and r["ms"] else f"{'-':>8}"
        lines.append(line)
    return "\n".join(lines)


#: The ratio columns of :func:`format_varlen_rows`: header, baseline impl.
VARLEN_COLUMNS = (("x cudnn", "cudnn-bf16"), ("x docs", "sdpa-per-doc"), ("x varlen", "torch-varlen"),
                  ("x flex", "flex-attention"))


def _varlen_key(r):
    """What a packed/window row and the baseline rows it is compared with share."""
    return (r["case"], r["D"], r["N"], r.get("S"), r.get("W"), r["mode"], r.get("scope", "e2e"))


def format_varlen_rows(rows) -> str:
    """An aligned table of packed and window rows (:func:`run_varlen_suite`): ms, TFLOPS (TOPS for INT8) over the
    visible pairs, and each sagecupy row's speedup over every baseline of the same case, mode and scope (baseline ms /
    row ms): ``x cudnn`` cuDNN's bf16 SDPA (ragged THD, or its diagonal band), ``x docs`` SDPA once per document,
    ``x varlen`` PyTorch's varlen attention, ``x flex`` FlexAttention; ``-`` where the run has no such row. A cuDNN
    row timed causal because its window was declined is marked ``(causal)``; skipped baselines, notes and errors get
    a line each. Rows of several rounds are shown once, with their median (:func:`median_rows`)."""
    rows = median_rows(rows)
    base = {(r["impl"],) + _varlen_key(r): r["ms"] for r in rows
            if "ms" in r and not str(r["impl"]).startswith("sagecupy-")}
    w = max([22] + [len(str(r.get("impl", ""))) + 1 for r in rows])
    lines = [f"{'case':<8}{'D':>4}{'N':>7}{'S/W':>6}  {'impl':<{w}}{'cfg':<9}{'mode':<8}{'scope':<9}{'ms':>9}"
             f"{'TFLOPS':>8}" + "".join(f"{h:>10}" for h, _ in VARLEN_COLUMNS)]
    for r in rows:
        mode = r.get("mode")
        where = (f"{r.get('case', '?')} D={r.get('D')} N={r.get('N')}"
                 + (f" S={r['S']}" if "S" in r else f" W={r['W']}" if "W" in r else ""))
        if mode == "skip":
            at = f" ({where})" if "D" in r else ""
            lines.append(f"{r.get('impl', '?')} skipped{at}: {r.get('reason', '')}")
            continue
        if mode == "note":
            lines.append(f"{r.get('impl', '?')} note ({where}): {r.get('reason', '')}")
            continue
        if "ms" not in r:
            lines.append(f"{r.get('impl', '?')} error ({where}): {r.get('error')}")
            continue
        sw = r.get("S") if r["case"] == "packed" else r.get("W")
        impl = r["impl"] + (" (causal)" if r.get("window_applied") is False else "")
        tops = r.get("tops")
        line = (f"{r['case']:<8}{r['D']:>4}{r['N']:>7}{str(sw):>6}  {impl:<{w}}{r.get('config', ''):<9}{mode:<8}"
                f"{r.get('scope', 'e2e'):<9}{r['ms']:>9.3f}" + (f"{tops:>8.1f}" if tops is not None else f"{'-':>8}"))
        for _, bimpl in VARLEN_COLUMNS:
            ms = base.get((bimpl,) + _varlen_key(r)) if str(r["impl"]).startswith("sagecupy-") else None
            line += f"{ms / r['ms']:>10.2f}" if ms and r["ms"] else f"{'-':>10}"
        lines.append(line)
    return "\n".join(lines)


def plot(results_path, outdir) -> list:
    """PNG figures (matplotlib, Agg): TOPS vs N, one line per implementation/config/scope, one figure per
    (head dim, mask, mode). Returns the written paths."""
    import os

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = []
    with open(results_path) as fh:
        for line in fh:
            line = line.strip()
            if not line:
                continue
            r = json.loads(line)
            if r.get("type") == "env" or "tops" not in r or r.get("case"):
                continue  # the packed and window rows have no N axis to plot along
            rows.append(r)
    if not rows:
        raise ValueError(f"{results_path}: no benchmark rows (expected the JSON lines of `sagecupy bench --out`)")
    os.makedirs(outdir, exist_ok=True)
    paths = []
    for key in sorted({(r["D"], r["causal"], r["mode"]) for r in rows}):
        D, causal, mode = key
        sel = [r for r in rows if (r["D"], r["causal"], r["mode"]) == key]
        fig, ax = plt.subplots(figsize=(6, 4))
        for line in sorted({(r["impl"], r.get("config", ""), r["scope"]) for r in sel}):
            pts = sorted((r["N"], r["tops"]) for r in sel if (r["impl"], r.get("config", ""), r["scope"]) == line)
            label = " ".join(x for x in line if x)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("sequence length N")
        ax.set_ylabel("TOPS (INT8) / TFLOPS (bf16)")
        ax.set_title(f"{mode}, D={D}, {'causal' if causal else 'full'}")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
        path = os.path.join(outdir, f"speed_d{D}_{'causal' if causal else 'full'}_{mode}.png")
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths
