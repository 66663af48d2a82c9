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
synchronized; ``e2e-b2b``: the same call issued back to back (:func:`time_ms_b2b`), the device time per call
when the host keeps ahead (as in a training or serving loop). The INT8 forward's ``e2e`` / ``e2e-b2b`` rows time the
inference call (``int8.sage_attention``), as SDPA's forward is timed under ``torch.no_grad()``; ``train`` /
``train-b2b`` time the training forward (``int8.forward``, which also keeps the backward's residuals), compared with
the same no-grad SDPA forward.

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
import statistics
import time

__all__ = ["flops", "time_ms", "time_ms_b2b", "time_ms_torch", "bench_int8", "bench_int8_torch", "bench_int8_jax",
           "bench_fp4", "bench_sdpa", "bench_cudnn_fp8", "default_cases", "run_suite", "peak_memory", "format_rows",
           "plot", "BASELINES", "DEFAULT_BASELINES", "parse_baselines", "baseline_unavailable", "ADAPTERS",
           "parse_adapters", "adapter_unavailable"]

#: Baselines ``run_suite`` can time beside sagecupy, and the ``impl`` of their rows.
BASELINES = {"sdpa": "sdpa-default", "flash": "sdpa-flash", "cudnn": "sdpa-cudnn", "cudnn-fp8": "cudnn-fp8"}
#: What a plain run times: PyTorch's default SDPA (cuDNN bf16 on Hopper), cuDNN's FP8 attention and flash.
DEFAULT_BASELINES = ("sdpa", "cudnn-fp8", "flash")
#: Framework adapters ``run_suite`` can time beside the CuPy INT8 rows (``adapters=``), and the ``impl`` of their rows.
ADAPTERS = {"torch": "sagecupy-int8-torch", "jax": "sagecupy-int8-jax"}


def parse_baselines(spec) -> tuple:
    """Baseline names from ``"sdpa,cudnn-fp8"`` (or an iterable of names), in order, without repeats; ``""`` is
    none. ``ValueError`` names an unknown one."""
    names = spec.split(",") if isinstance(spec, str) else list(spec)
    out = []
    for name in (n.strip() for n in names):
        if not name:
            continue
        if name not in BASELINES:
            raise ValueError(f"--baselines: {name!r} is not one of {', '.join(BASELINES)}")
        if name not in out:
            out.append(name)
    return tuple(out)


def parse_adapters(spec) -> tuple:
    """Adapter names from ``"torch,jax"`` (or an iterable of names), in order, without repeats; ``""`` is none.
    ``ValueError`` names an unknown one."""
    names = spec.split(",") if isinstance(spec, str) else list(spec)
    out = []
    for name in (n.strip() for n in names):
        if not name:
            continue
        if name not in ADAPTERS:
            raise ValueError(f"--adapters: {name!r} is not one of {', '.join(ADAPTERS)}")
        if name not in out:
            out.append(name)
    return tuple(out)


def _jax_environment():
    """Keep JAX from taking 75% of the GPU when its backend starts: the CuPy rows and PyTorch need that memory.
    A process that started JAX's GPU backend earlier keeps what it chose."""
    import os

    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")


def adapter_unavailable(name):
    """Why adapter ``name`` (``"torch"``, ``"jax"``) cannot run in this process, or None."""
    if name == "jax":
        _jax_environment()
        try:
            from .adapters import jax as sj
        except Exception as exc:
            return f"sagecupy.jax is not importable ({type(exc).__name__}: {exc})"
        ok, why = sj.is_available()
        return None if ok else why
    if name != "torch":
        raise ValueError(f"adapter {name!r} is not one of {', '.join(ADAPTERS)}")
    try:
        import torch
    except Exception as exc:
        return f"PyTorch is not importable ({type(exc).__name__}: {exc})"
    try:
        if not torch.cuda.is_available():
            return "no CUDA device visible to PyTorch"
    except Exception as exc:
        return f"CUDA is not usable from PyTorch ({type(exc).__name__}: {exc})"
    try:
        from .adapters import torch as _st  # noqa: F401
    except Exception as exc:
        return f"sagecupy.torch is not importable ({type(exc).__name__}: {exc})"
    from ._loader import gpu_status

    ok, why = gpu_status()
    return None if ok else f"the CuPy side cannot run: {why}"


def baseline_unavailable(name):
    """Why baseline ``name`` cannot run in this process, or None."""
    if name == "cudnn-fp8":
        from . import _cudnn_fp8

        return _cudnn_fp8.unavailable_reason()
    try:
        import torch
    except Exception as exc:
        return f"PyTorch is not importable ({type(exc).__name__}: {exc})"
    try:
        if not torch.cuda.is_available():
            return "no CUDA device visible to PyTorch"
    except Exception as exc:
        return f"CUDA is not usable from PyTorch ({type(exc).__name__}: {exc})"
    if name != "sdpa":
        try:
            from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: F401
        except Exception as exc:
            return f"PyTorch {torch.__version__} cannot force an SDPA backend ({type(exc).__name__}: {exc})"
    return None


def flops(B, Hq, Nq, Nk, D, causal, mode="fwd") -> float:
    f = 4.0 * B * Hq * Nq * Nk * D
    if causal and Nq == Nk:
        f /= 2
    return f * {"fwd": 1.0, "bwd": 2.5, "fwdbwd": 3.5}[mode]


#: Warm-up before timing lasts at least this long as well as ``warmup`` calls: after host-side work (making the
#: inputs, the pre-passes) the first case's kernel row read 1-16% slower than the same call timed next
#: (measured with commit 5257c62), as if the GPU had not reached its clocks after 3 calls of ~1 ms.
MIN_WARMUP_S = 0.025


def _warm_up(fn, warmup, sync):
    """Call ``fn`` at least ``warmup`` times and for at least MIN_WARMUP_S seconds (synchronized by ``sync``)."""
    t0, n = time.perf_counter(), 0
    while n < warmup or time.perf_counter() - t0 < MIN_WARMUP_S:
        fn()
        n += 1
        if n >= warmup:
            sync()


def time_ms(fn, warmup=3, rep=10, *, event=None, sync=None) -> float:
    """Median wall time of ``fn()`` on the device, in milliseconds (CUDA events), after :func:`_warm_up`.
    ``event``/``sync``: the framework's event class and synchronize (default CuPy's, on its current stream)."""
    if event is None:
        import cupy

        event, sync = cupy.cuda.Event, cupy.cuda.get_current_stream().synchronize
    _warm_up(fn, warmup, sync)
    sync()
    times = []
    for _ in range(rep):
        start, end = event(), event()
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(_elapsed_ms(start, end))
    return statistics.median(times)


def time_ms_b2b(fn, warmup=3, calls=10, rounds=5, *, event=None, sync=None) -> float:
    """Device time per call of ``fn()`` issued ``calls`` times back to back (no synchronization between the calls:
    the host issues ahead while the device works, as in a training or serving loop and as ``triton.testing.do_bench``
    measures), the median over ``rounds``, in milliseconds. :func:`time_ms` synchronizes after every call, so the
    host time spent before a call's first launch counts there (the ``e2e`` rows); here it overlaps the previous
    call (the ``e2e-b2b`` rows). ``event``/``sync``: the framework's event class and synchronize (default CuPy)."""
    if event is None:
        import cupy

        event, sync = cupy.cuda.Event, cupy.cuda.get_current_stream().synchronize
    _warm_up(fn, warmup, sync)
    sync()
    out = []
    for _ in range(rounds):
        start, end = event(), event()
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        out.append(_elapsed_ms(start, end) / calls)
    return statistics.median(out)


def _elapsed_ms(start, end):
    """Milliseconds between two recorded events: PyTorch's (and :class:`_HostClock`'s) ``elapsed_time``, CuPy's
    ``get_elapsed_time``."""
    if hasattr(start, "elapsed_time"):
        return start.elapsed_time(end)
    import cupy

    return cupy.cuda.get_elapsed_time(start, end)


class _HostClock:
    """Stand-ins for CUDA events where the timed work runs on a stream that events recorded from outside cannot be
    ordered with (XLA's): ``fn`` hands its result to :meth:`track`; an event's ``synchronize`` waits for the last
    tracked result (``block``) and then reads the host clock, ``record`` reads it at once. Calls issued in order on
    one device finish in order, so the last result's completion is the completion of all."""

    def __init__(self, block):
        self._block, self._pending = block, None

    def track(self, result):
        self._pending = result
        return result

    def sync(self):
        pending, self._pending = self._pending, None
        if pending is not None:
            self._block(pending)

    def event(self):
        return _HostEvent(self)


class _HostEvent:
    def __init__(self, clock):
        self._clock, self.t = clock, None

    def record(self):
        self.t = time.perf_counter()

    def synchronize(self):
        self._clock.sync()
        self.t = time.perf_counter()

    def elapsed_time(self, end):
        return (end.t - self.t) * 1e3


def time_ms_torch(fn, warmup=3, rep=10) -> float:
    """:func:`time_ms` with PyTorch's events and synchronize, on PyTorch's current stream (for the baselines, whose
    work PyTorch launches)."""
    import torch

    _warm_up(fn, warmup, torch.cuda.synchronize)
    torch.cuda.synchronize()
    times = []
    for _ in range(rep):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def time_ms_b2b_torch(fn, warmup=3):
    """:func:`time_ms_b2b` with PyTorch's events and synchronize."""
    import torch

    return time_ms_b2b(fn, warmup, event=lambda: torch.cuda.Event(enable_timing=True), sync=torch.cuda.synchronize)


def default_cases(quick=False):
    """(D, N, causal) with batch * N = 16K tokens and H * D = 2048 (H = 16 at D = 128), D in {64, 128}, N from 1K
    to 32K, causal and not (docs/algorithms.md §8.1); ``quick``: N in {4K, 16K}."""
    ns = (4096, 16384) if quick else (1024, 2048, 4096, 8192, 16384, 32768)
    return [(d, n, c) for d in (64, 128) for n in ns for c in (False, True)]


def _shape(D, N):
    return max(1, 16384 // N), 2048 // D


def _inputs(D, N, dtype):
    """B, H and standard-normal q, k, v, dO of the sweep's shape (seed 0) in ``dtype`` (fp16, or bf16 as
    ``BF16Array``)."""
    import cupy

    from .adapters.bf16 import BF16Array

    B, H = _shape(D, N)
    rng = cupy.random.default_rng(0)

    def mk():
        x = rng.standard_normal((B, H, N, D), dtype=cupy.float32)
        return x.astype(cupy.float16) if dtype == "float16" else BF16Array.from_float(x)

    return B, H, (mk(), mk(), mk(), mk())


def _config_name(config):
    """The ``config`` field of an INT8 row: the preset's name, or the config object's ``name``."""
    return (config or "default") if isinstance(config, (str, type(None))) else config.name


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
        # Both engines explicitly, for comparison in the same run ("kernel" is the automatic choice).
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


def bench_int8_torch(D, N, causal, *, config=None, dtype="bfloat16", warmup=3, rep=10,
                     modes=("fwd", "bwd", "fwdbwd")):
    """Rows ``sagecupy-int8-torch``: the INT8 calls of :func:`bench_int8`'s end-to-end rows through
    ``sagecupy.torch.sage_attention`` on PyTorch tensors holding the same values (copied into PyTorch's allocator,
    as a model's activations are). ``fwd`` ``e2e``/``e2e-b2b``: under ``torch.no_grad()`` (the adapter's inference
    op, :func:`sagecupy.int8.sage_attention`); ``train``/``train-b2b``: inputs requiring grad (the forward op, which
    keeps the residuals: :func:`sagecupy.int8.forward`); ``bwd``: ``torch.autograd.grad`` through a kept graph
    (:func:`sagecupy.int8.backward`); ``fwdbwd``: both. Timed by :func:`time_ms` / :func:`time_ms_b2b` with
    PyTorch's events on its current stream, where the adapter launches the kernels."""
    import cupy
    import torch

    from .adapters import torch as st

    B, H, cupy_inputs = _inputs(D, N, dtype)
    cupy.cuda.get_current_stream().synchronize()  # the values are written before PyTorch's stream copies them
    q, k, v, do = (st.from_cupy(x).clone() for x in cupy_inputs)
    del cupy_inputs
    rows = []

    def row(mode, scope, ms):
        rows.append(dict(impl=ADAPTERS["torch"], config=_config_name(config), mode=mode, scope=scope, D=D, N=N,
                         B=B, H=H, causal=causal, dtype=dtype, ms=ms,
                         tops=flops(B, H, N, N, D, causal, mode) / ms / 1e9))

    def event():
        return torch.cuda.Event(enable_timing=True)

    def timed(fn):
        return time_ms(fn, warmup, rep, event=event, sync=torch.cuda.synchronize)

    def b2b(fn):
        return time_ms_b2b(fn, warmup, event=event, sync=torch.cuda.synchronize)

    def att(a, b, c):
        return st.sage_attention(a, b, c, causal=causal, config=config)

    qg, kg, vg = (x.detach().requires_grad_() for x in (q, k, v))
    try:
        if "fwd" in modes:
            with torch.no_grad():
                row("fwd", "e2e", timed(lambda: att(q, k, v)))
                row("fwd", "e2e-b2b", b2b(lambda: att(q, k, v)))
            row("fwd", "train", timed(lambda: att(qg, kg, vg)))
            row("fwd", "train-b2b", b2b(lambda: att(qg, kg, vg)))
        if "bwd" in modes:
            out = att(qg, kg, vg)
            row("bwd", "e2e", timed(lambda: torch.autograd.grad(out, (qg, kg, vg), do, retain_graph=True)))
            del out
        if "fwdbwd" in modes:
            def fb():
                torch.autograd.grad(att(qg, kg, vg), (qg, kg, vg), do)
            row("fwdbwd", "e2e", timed(fb))
            row("fwdbwd", "e2e-b2b", b2b(fb))
    finally:
        q = k = v = do = qg = kg = vg = None  # drop the inputs before emptying the cache
        torch.cuda.empty_cache()  # hand PyTorch's cached blocks back before the next case's CuPy kernels
    return rows


def bench_int8_jax(D, N, causal, *, config=None, dtype="bfloat16", warmup=3, rep=10, modes=("fwd", "bwd", "fwdbwd")):
    """Rows ``sagecupy-int8-jax``: the INT8 calls of :func:`bench_int8`'s end-to-end rows through
    ``sagecupy.jax.sage_attention`` inside ``jax.jit``, on JAX arrays holding the same values. ``fwd``
    ``e2e``/``e2e-b2b``: the jitted call (the adapter's inference forward outside differentiation,
    :func:`sagecupy.int8.sage_attention`); ``train``/``train-b2b``: ``jax.vjp`` jitted, returning the output and the
    residuals (:func:`sagecupy.int8.forward`); ``bwd``: the jitted pullback of a forward run once, untimed;
    ``fwdbwd``: forward and pullback in one jitted function. Timed by :func:`time_ms` / :func:`time_ms_b2b` on the
    host clock (:class:`_HostClock`, rows ``timer="host"``): XLA runs the kernels on a stream of its own."""
    _jax_environment()
    import cupy
    import jax
    import jax.numpy as jnp

    from . import _checks
    from .adapters import jax as sj

    B, H, cupy_inputs = _inputs(D, N, dtype)

    def to_jax(x):
        # through the host, once per case (untimed): fp16 values, or bf16's bits reinterpreted on the device
        a = jax.device_put(cupy.asnumpy(_checks.raw(x)))
        return jax.lax.bitcast_convert_type(a, jnp.bfloat16) if dtype == "bfloat16" else a

    q, k, v, do = (to_jax(x) for x in cupy_inputs)
    del cupy_inputs
    jax.block_until_ready((q, k, v, do))
    rows = []

    def row(mode, scope, ms):
        rows.append(dict(impl=ADAPTERS["jax"], config=_config_name(config), mode=mode, scope=scope, D=D, N=N, B=B,
                         H=H, causal=causal, dtype=dtype, ms=ms, tops=flops(B, H, N, N, D, causal, mode) / ms / 1e9,
                         timer="host"))

    clock = _HostClock(jax.block_until_ready)

    def timed(fn):
        return time_ms(lambda: clock.track(fn()), warmup, rep, event=clock.event, sync=clock.sync)

    def b2b(fn):
        return time_ms_b2b(lambda: clock.track(fn()), warmup, event=clock.event, sync=clock.sync)

    def att(a, b, c):
        return sj.sage_attention(a, b, c, causal=causal, config=config)

    def train_forward(a, b, c):
        o, pullback = jax.vjp(att, a, b, c)
        return o, jax.tree_util.tree_leaves(pullback)  # the residuals, as arrays: all of them are written

    infer = jax.jit(att)
    train = jax.jit(train_forward)
    pull = jax.jit(lambda pullback, g: pullback(g))
    fwdbwd = jax.jit(lambda a, b, c, g: jax.vjp(att, a, b, c)[1](g))
    if "fwd" in modes:
        row("fwd", "e2e", timed(lambda: infer(q, k, v)))
        row("fwd", "e2e-b2b", b2b(lambda: infer(q, k, v)))
        row("fwd", "train", timed(lambda: train(q, k, v)))
        row("fwd", "train-b2b", b2b(lambda: train(q, k, v)))
    if "bwd" in modes:
        _, pullback = jax.vjp(att, q, k, v)
        row("bwd", "e2e", timed(lambda: pull(pullback, do)))
        del pullback
    if "fwdbwd" in modes:
        row("fwdbwd", "e2e", timed(lambda: fwdbwd(q, k, v, do)))
        row("fwdbwd", "e2e-b2b", b2b(lambda: fwdbwd(q, k, v, do)))
    return rows


#: The function timing each adapter's rows (looked up at call time, so that tests can stand in for them).
_ADAPTER_BENCH = {"torch": "bench_int8_torch", "jax": "bench_int8_jax"}


def _adapter_reason(name):
    """:func:`adapter_unavailable`, never raising (a probe that breaks is a reason too)."""
    try:
        return adapter_unavailable(name)
    except Exception as exc:
        return f"availability check failed ({type(exc).__name__}: {exc})"


def _bench_adapter(name, D, N, causal, *, config, dtype, warmup, rep):
    """One adapter's rows for one case and config; whatever it raises becomes an ``error`` row (the sweep goes on)."""
    try:
        return globals()[_ADAPTER_BENCH[name]](D, N, causal, config=config, dtype=dtype, warmup=warmup, rep=rep)
    except Exception as exc:
        return [dict(impl=ADAPTERS[name], mode="error", D=D, N=N, causal=causal, config=_config_name(config),
                     error=f"{type(exc).__name__}: {exc}"[:400])]


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


def bench_sdpa(D, N, causal, backend, *, dtype="bfloat16", warmup=3, rep=10, modes=("fwd", "bwd", "fwdbwd")):
    """Rows for torch.nn.functional.scaled_dot_product_attention: ``backend`` ``"default"`` calls it as a user does
    (PyTorch picks the backend: cuDNN for bf16 on Hopper), ``"flash"`` / ``"cudnn"`` force that backend."""
    import contextlib

    import torch

    B, H = _shape(D, N)
    dt = torch.bfloat16 if dtype == "bfloat16" else torch.float16
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, do = (torch.randn((B, H, N, D), device="cuda", dtype=dt, generator=g) for _ in range(4))
    if backend == "default":
        ctx = contextlib.nullcontext
    else:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        be = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}[backend]

        def ctx():
            return sdpa_kernel([be])
    F = torch.nn.functional.scaled_dot_product_attention
    rows = []

    def timed(fn):
        with ctx():
            return time_ms_torch(fn, warmup, rep)

    def b2b(fn):
        with ctx():
            return time_ms_b2b_torch(fn, warmup)

    def row(mode, ms, scope="e2e"):
        rows.append(dict(impl=f"sdpa-{backend}", config="", mode=mode, scope=scope, D=D, N=N, B=B, H=H,
                         causal=causal, dtype=dtype, ms=ms, tops=flops(B, H, N, N, D, causal, mode) / ms / 1e9))

    try:
        if "fwd" in modes:
            with torch.no_grad():
                row("fwd", timed(lambda: F(q, k, v, is_causal=causal)))
                row("fwd", b2b(lambda: F(q, k, v, is_causal=causal)), "e2e-b2b")
        qg, kg, vg = (x.detach().requires_grad_() for x in (q, k, v))
        if "bwd" in modes:
            with ctx():
                out = F(qg, kg, vg, is_causal=causal)
            row("bwd", timed(lambda: torch.autograd.grad(out, (qg, kg, vg), do, retain_graph=True)))
        if "fwdbwd" in modes:
            def fb():
                out = F(qg, kg, vg, is_causal=causal)
                torch.autograd.grad(out, (qg, kg, vg), do)
            row("fwdbwd", timed(fb))
            row("fwdbwd", b2b(fb), "e2e-b2b")
    except RuntimeError as exc:  # backend unavailable for this shape
        rows.append(dict(impl=f"sdpa-{backend}", mode="error", D=D, N=N, causal=causal, error=str(exc)[:200]))
    return rows


def bench_cudnn_fp8(D, N, causal, *, warmup=3, rep=10, modes=("fwd", "bwd", "fwdbwd")):
    """Rows for cuDNN's FP8 (E4M3) attention (:mod:`sagecupy._cudnn_fp8`), impl ``cudnn-fp8``.

    ``kernel``: the cuDNN graph alone, on FP8 operands as cuDNN receives them (Q, K, V; also O and dO for the
    backward), scales set. ``e2e`` / ``e2e-b2b``: also the amax pass and the bf16-to-E4M3 cast of Q, K, V (forward)
    and dO (backward) with their power-of-two scales, what a caller holding bf16 tensors pays; the outputs stay E4M3
    (a per-tensor descale the consumer folds in). The forward writes the softmax stats (the training forward). The
    bf16 inputs are standard normal (seed 0) in ``[B, N, H, D]`` storage, the layout the graphs declare; the output
    scales are calibrated once on them, untimed. A stage cuDNN cannot run gives an ``error`` row with its reason;
    the rows of the stages before it stay.
    """
    from . import _cudnn_fp8

    B, H = _shape(D, N)
    rows = []

    def row(mode, scope, ms):
        # plan: cuDNN's engine for the forward and, where timed, the backward
        plan = att.fwd_plan if mode == "fwd" else f"{att.fwd_plan}+{att.bwd_plan}" if mode == "fwdbwd" else att.bwd_plan
        rows.append(dict(impl="cudnn-fp8", config="", mode=mode, scope=scope, D=D, N=N, B=B, H=H, causal=causal,
                         dtype="float8_e4m3fn" if scope == "kernel" else "bfloat16", ms=ms,
                         tops=flops(B, H, N, N, D, causal, mode) / ms / 1e9, plan=plan))

    def error(stage, exc):
        rows.append(dict(impl="cudnn-fp8", mode="error", D=D, N=N, B=B, H=H, causal=causal,
                         error=f"{stage}: {type(exc).__name__}: {exc}"[:400]))

    att = None
    try:
        import torch

        g = torch.Generator(device="cuda").manual_seed(0)
        q, k, v, do = (torch.randn((B, N, H, D), device="cuda", dtype=torch.bfloat16, generator=g).transpose(1, 2)
                       for _ in range(4))
        att = _cudnn_fp8.CudnnFp8Attention(B, H, N, D, causal)
        att.calibrate(q, k, v)
        if "fwd" in modes:
            row("fwd", "kernel", time_ms_torch(att.forward, warmup, rep))
            row("fwd", "e2e", time_ms_torch(lambda: att.forward_from(q, k, v), warmup, rep))
            row("fwd", "e2e-b2b", time_ms_b2b_torch(lambda: att.forward_from(q, k, v), warmup))
    except Exception as exc:
        error("forward", exc)
        return rows
    try:
        if "bwd" in modes or "fwdbwd" in modes:
            att.calibrate(q, k, v, do)
        if "bwd" in modes:
            row("bwd", "kernel", time_ms_torch(att.backward, warmup, rep))
            row("bwd", "e2e", time_ms_torch(lambda: att.backward_from(do), warmup, rep))
        if "fwdbwd" in modes:
            def fb_kernel():
                att.forward()
                att.backward()

            def fb():
                att.forward_from(q, k, v)
                att.backward_from(do)
            row("fwdbwd", "kernel", time_ms_torch(fb_kernel, warmup, rep))
            row("fwdbwd", "e2e", time_ms_torch(fb, warmup, rep))
            row("fwdbwd", "e2e-b2b", time_ms_b2b_torch(fb, warmup))
    except Exception as exc:
        error("backward", exc)
    finally:
        att = q = k = v = do = None  # drop the buffers before emptying the cache
        torch.cuda.empty_cache()  # hand the cached blocks back before the next case's CuPy kernels
    return rows


def _baseline_reason(name):
    """:func:`baseline_unavailable`, never raising (a probe that breaks is a reason too)."""
    try:
        return baseline_unavailable(name)
    except Exception as exc:
        return f"availability check failed ({type(exc).__name__}: {exc})"


def _bench_baseline(name, D, N, causal, *, warmup, rep, dtype="bfloat16"):
    """One baseline's rows for one case; whatever it raises becomes an ``error`` row (the sweep goes on). cuDNN FP8
    casts from bf16 whatever ``dtype`` is (its rows say so)."""
    try:
        if name == "cudnn-fp8":
            return bench_cudnn_fp8(D, N, causal, warmup=warmup, rep=rep)
        return bench_sdpa(D, N, causal, "default" if name == "sdpa" else name, dtype=dtype, warmup=warmup, rep=rep)
    except Exception as exc:
        return [dict(impl=BASELINES[name], mode="error", D=D, N=N, causal=causal,
                     error=f"{type(exc).__name__}: {exc}"[:400])]


def run_suite(cases, *, configs=("default",), baselines=DEFAULT_BASELINES, out=None, warmup=3, rep=10, log=None,
              families=("int8",), dtype="bfloat16", progress=None, adapters=()):
    """Every case for every family (int8 with each config, nvfp4, qat) and baseline; JSON lines to ``out`` (a
    file object) as they come. ``dtype``: ``"bfloat16"`` or ``"float16"`` inputs; ``progress(case)`` is called
    after each case's rows.

    ``baselines``: names of ``BASELINES`` (a comma-separated string or an iterable). One that cannot run in this
    process gives a single ``mode="skip"`` row saying why, first, and is not timed; one that fails on a case gives an
    ``error`` row for that case. Neither stops the sweep.

    ``adapters``: names of ``ADAPTERS`` (none by default): their rows follow each config's INT8 rows, with the
    same config; skipped and failing adapters are treated as baselines are.
    """
    rows = []

    def emit(batch):
        for r in batch:
            if out is not None:
                out.write(json.dumps(r) + "\n")
                out.flush()
            if log is not None:
                log(r)
        rows.extend(batch)

    active, skipped = [], []
    for be in parse_baselines(baselines):
        why = _baseline_reason(be)
        if why is None:
            active.append(be)
        else:
            skipped.append(dict(impl=BASELINES[be], mode="skip", baseline=be, reason=why))
    active_adapters = []
    for ad in parse_adapters(adapters):
        why = _adapter_reason(ad)
        if why is None:
            active_adapters.append(ad)
        else:
            skipped.append(dict(impl=ADAPTERS[ad], mode="skip", adapter=ad, reason=why))
    emit(skipped)
    for D, N, causal in cases:
        batch = []
        for cfg in configs if "int8" in families or active_adapters else ():
            if "int8" in families:
                batch += bench_int8(D, N, causal, config=cfg, dtype=dtype, warmup=warmup, rep=rep)
            for ad in active_adapters:
                batch += _bench_adapter(ad, D, N, causal, config=cfg, dtype=dtype, warmup=warmup, rep=rep)
        for fam in ("nvfp4", "qat"):
            if fam in families:
                batch += bench_fp4(D, N, causal, family=fam, dtype=dtype, warmup=warmup, rep=rep)
        for be in active:
            batch += _bench_baseline(be, D, N, causal, warmup=warmup, rep=rep, dtype=dtype)
        emit(batch)
        if progress is not None:
            progress((D, N, causal))
    return rows


def peak_memory(D=128, N=32768, causal=False, *, dtype="bfloat16", config=None) -> list:
    """Peak device memory (bytes) of one forward+backward, inputs included, for sagecupy and SDPA.

    sagecupy: the CuPy memory pool's high-water mark of bytes in use (a memory hook); SDPA:
    ``torch.cuda.max_memory_allocated``. Both count q, k, v, dO and everything the call allocates.
    """
    import cupy
    from cupy.cuda import memory_hook

    from . import int8
    from .adapters.bf16 import BF16Array

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
        return x.astype(cupy.float16) if dtype == "float16" else BF16Array.from_float(x)

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
    scope, case and dtype: 1.00 is no cost over the CuPy call, 0.97 a 3% slower call through the framework."""
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
            if r.get("type") == "env" or "tops" not in r:
                continue
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
