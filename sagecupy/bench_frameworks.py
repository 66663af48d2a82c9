"""The rows of the benchmark that need another framework: PyTorch's SDPA and cuDNN's FP8 attention (the baselines,
:data:`sagecupy.bench.BASELINES`) and sagecupy's INT8 calls through the PyTorch and JAX adapters
(:data:`sagecupy.bench.ADAPTERS`), with the timers those frameworks need. :mod:`sagecupy.bench` describes the rows,
scopes and timing; it imports this module only when a run asks for a baseline or an adapter."""
from __future__ import annotations

import statistics
import time

from ._bench_common import (ADAPTERS, BASELINES, VARLEN_BASELINES, _config_name, _inputs, _shape, _warm_up,
                            case_fields, case_shape, flops, pair_flops, time_ms, time_ms_b2b)

__all__ = ["bench_sdpa", "bench_cudnn_fp8", "bench_int8_torch", "bench_int8_jax", "baseline_unavailable",
           "adapter_unavailable", "time_ms_torch", "time_ms_b2b_torch", "varlen_baseline_unavailable",
           "bench_varlen_baseline"]


def _jax_environment():
    """Keep JAX from taking 75% of the GPU when its backend starts: the CuPy rows and PyTorch need that memory.
    A process that started JAX's GPU backend earlier keeps what it chose."""
    import os

    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")


def _torch_cuda_reason():
    """Why PyTorch cannot reach a CUDA device here, or None."""
    try:
        import torch
    except Exception as exc:
        return f"PyTorch is not importable ({type(exc).__name__}: {exc})"
    try:
        if not torch.cuda.is_available():
            return "no CUDA device visible to PyTorch"
    except Exception as exc:
        return f"CUDA is not usable from PyTorch ({type(exc).__name__}: {exc})"
    return None


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
    why = _torch_cuda_reason()
    if why is not None:
        return why
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
    why = _torch_cuda_reason()
    if why is not None:
        return why
    import torch

    if name != "sdpa":
        try:
            from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: F401
        except Exception as exc:
            return f"PyTorch {torch.__version__} cannot force an SDPA backend ({type(exc).__name__}: {exc})"
    return None


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


# -- the packed and window cases' baselines ------------------------------------------------------------------------
def _torch_varlen_attn():
    """``torch.nn.attention.varlen.varlen_attn`` and whether it takes ``window_size`` (PyTorch 2.10 has
    ``is_causal`` only; later releases take ``window_size=(left, right)``, ``(-1, 0)`` causal)."""
    import inspect

    from torch.nn.attention.varlen import varlen_attn

    return varlen_attn, "window_size" in inspect.signature(varlen_attn).parameters


def varlen_baseline_unavailable(name):
    """Why baseline ``name`` of :data:`VARLEN_BASELINES` cannot run in this process, or None."""
    if name not in VARLEN_BASELINES:
        raise ValueError(f"baseline {name!r} is not one of {', '.join(VARLEN_BASELINES)}")
    if name == "cudnn":
        from . import _cudnn_varlen

        return _cudnn_varlen.unavailable_reason()
    why = _torch_cuda_reason()
    if why is not None:
        return why
    import torch

    if name == "torch-varlen":
        try:
            _torch_varlen_attn()
        except Exception as exc:
            return (f"PyTorch {torch.__version__} has no variable-length attention "
                    f"(torch.nn.attention.varlen.varlen_attn: {type(exc).__name__}: {exc})")
    if name == "flex":
        try:
            from torch.nn.attention.flex_attention import create_block_mask, flex_attention  # noqa: F401
        except Exception as exc:
            return f"PyTorch {torch.__version__} has no FlexAttention ({type(exc).__name__}: {exc})"
        if not hasattr(torch, "compile"):
            return f"PyTorch {torch.__version__} has no torch.compile (FlexAttention runs compiled)"
    return None


def _varlen_reason(name):
    """:func:`varlen_baseline_unavailable`, never raising (a probe that breaks is a reason too)."""
    try:
        return varlen_baseline_unavailable(name)
    except Exception as exc:
        return f"availability check failed ({type(exc).__name__}: {exc})"


class _VarlenRows:
    """Rows of one baseline on one packed or window case: ``fwd`` and ``fwdbwd``, ``e2e`` and ``e2e-b2b``, TFLOPS
    over ``pairs`` visible query-key pairs; ``error`` rows for a stage that fails."""

    def __init__(self, name, case, shape, dtype, pairs=None, **extra):
        self.impl, self.case, self.shape, self.dtype = VARLEN_BASELINES[name], case, shape, dtype
        self.pairs = shape["pairs"] if pairs is None else pairs
        self.extra, self.rows = extra, []

    def row(self, mode, scope, ms):
        s = self.shape
        self.rows.append(dict(impl=self.impl, config="", mode=mode, scope=scope, **case_fields(self.case, s),
                              dtype=self.dtype, ms=ms, tops=pair_flops(self.pairs, s["H"], self.case["D"], mode)
                              / ms / 1e9, pairs=self.pairs, **self.extra))

    def error(self, stage, exc):
        self.rows.append(dict(impl=self.impl, mode="error", **case_fields(self.case, self.shape),
                              error=f"{stage}: {type(exc).__name__}: {exc}"[:400]))

    def note(self, reason):
        self.rows.append(dict(impl=self.impl, mode="note", **case_fields(self.case, self.shape), reason=reason))

    def timed(self, fwd, fwdbwd, warmup, rep, no_grad=True):
        """Time ``fwd`` (under ``torch.no_grad()`` unless told otherwise) and ``fwdbwd``, each stage apart."""
        import contextlib

        import torch

        try:
            with torch.no_grad() if no_grad else contextlib.nullcontext():
                self.row("fwd", "e2e", time_ms_torch(fwd, warmup, rep))
                self.row("fwd", "e2e-b2b", time_ms_b2b_torch(fwd, warmup))
        except Exception as exc:
            self.error("forward", exc)
            return
        try:
            self.row("fwdbwd", "e2e", time_ms_torch(fwdbwd, warmup, rep))
            self.row("fwdbwd", "e2e-b2b", time_ms_b2b_torch(fwdbwd, warmup))
        except Exception as exc:
            self.error("forward+backward", exc)


def _thd_inputs(T, H, D, dtype):
    """Standard-normal ``(T, H, D)`` q, k, v, dO (seed 0) in ``dtype`` on PyTorch's device, and q, k, v requiring
    grad (the same values)."""
    import torch

    dt = torch.bfloat16 if dtype == "bfloat16" else torch.float16
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, do = (torch.randn((T, H, D), device="cuda", dtype=dt, generator=g) for _ in range(4))
    return (q, k, v, do), tuple(x.detach().requires_grad_() for x in (q, k, v))


def _bench_cudnn_varlen(case, shape, dtype, warmup, rep):
    """cuDNN's graphs: packed cases as ragged THD with the padding mask, window cases as a dense batch with the
    diagonal band's left bound. Where the installed cuDNN declines the window, its causal call is timed instead, its
    rows say ``window_applied=False`` (TFLOPS over the causal pairs it computes) and a ``note`` row says why."""
    from . import _cudnn_varlen

    packed = case["kind"] == "packed"
    wl = None if packed else shape["window"][0]
    note = None
    try:
        att = _cudnn_varlen.get(shape["lengths"], shape["H"], case["D"], window_left=wl, packed=packed, dtype=dtype)
    except _cudnn_varlen.Unavailable as exc:
        if wl is None:
            raise
        note = f"the sliding window is not available in cuDNN here; its causal call is timed beside ({exc})"[:600]
        att = _cudnn_varlen.get(shape["lengths"], shape["H"], case["D"], window_left=None, packed=False, dtype=dtype)
    extra = dict(plan=att.fwd_plan)
    pairs = None
    if not packed:
        extra["window_applied"] = note is None
        if note:
            pairs = sum(L * (L + 1) // 2 for L in shape["lengths"])  # what the causal call computes
    out = _VarlenRows("cudnn", case, shape, dtype, pairs=pairs, **extra)
    if note:
        out.note(note)

    def fb():
        att.forward()
        att.backward()
    try:
        out.timed(att.forward, fb, warmup, rep, no_grad=False)
        for r in out.rows:
            if r.get("mode") == "fwdbwd":
                r["plan"] = f"{att.fwd_plan}+{att.bwd_plan}"
    finally:
        att = None
        _cudnn_varlen.clear()  # the graphs' buffers go before the next case's CuPy kernels
        import torch

        torch.cuda.empty_cache()
    return out.rows


def _bench_sdpa_docs(case, shape, dtype, warmup, rep):
    """PyTorch's SDPA (no backend forced) called once per document, causal, on ``(1, H, L, D)`` views of the packed
    ``(T, H, D)`` tensors; forward+backward takes the gradients of all documents' outputs in one autograd call."""
    import torch

    F = torch.nn.functional.scaled_dot_product_attention
    (q, k, v, do), (qg, kg, vg) = _thd_inputs(sum(shape["lengths"]), shape["H"], case["D"], dtype)
    spans, a = [], 0
    for n in shape["lengths"]:
        spans.append((a, a + n))
        a += n

    def view(x, a, b):
        return x[a:b].transpose(0, 1).unsqueeze(0)

    def fwd():
        return [F(view(q, a, b), view(k, a, b), view(v, a, b), is_causal=True) for a, b in spans]

    def fb():
        outs = [F(view(qg, a, b), view(kg, a, b), view(vg, a, b), is_causal=True) for a, b in spans]
        torch.autograd.grad(outs, (qg, kg, vg), [view(do, a, b) for a, b in spans])
    out = _VarlenRows("sdpa-docs", case, shape, dtype)
    out.timed(fwd, fb, warmup, rep)
    return out.rows


def _bench_torch_varlen(case, shape, dtype, warmup, rep):
    """``torch.nn.attention.varlen.varlen_attn`` on the packed ``(T, H, D)`` tensors and ``cu_seqlens`` (a window
    case: B sequences of N, window ``(W, 0)`` where the installed PyTorch takes ``window_size``)."""
    import itertools

    import torch

    varlen_attn, has_window = _torch_varlen_attn()
    out = _VarlenRows("torch-varlen", case, shape, dtype)
    if case["kind"] == "window" and not has_window:
        out.rows.append(dict(impl=out.impl, mode="skip", **case_fields(case, shape),
                             reason=f"PyTorch {torch.__version__}'s varlen_attn has no window_size"))
        return out.rows
    lengths = shape["lengths"]
    (q, k, v, do), (qg, kg, vg) = _thd_inputs(sum(lengths), shape["H"], case["D"], dtype)
    cu = torch.tensor([0] + list(itertools.accumulate(lengths)), device="cuda", dtype=torch.int32)
    L = max(lengths)
    mask = dict(window_size=(-1, 0) if shape["window"] is None else tuple(shape["window"])) if has_window \
        else dict(is_causal=True)

    def fwd():
        return varlen_attn(q, k, v, cu, cu, L, L, **mask)

    def fb():
        torch.autograd.grad(varlen_attn(qg, kg, vg, cu, cu, L, L, **mask), (qg, kg, vg), do)
    out.timed(fwd, fb, warmup, rep)
    return out.rows


_FLEX = {}


def _bench_flex(case, shape, dtype, warmup, rep):
    """FlexAttention compiled (``torch.compile(flex_attention)``) with a block mask: causal within each document of
    the packed sequence (document ids), or causal with window ``(W, 0)``; ``(B, H, N, D)`` contiguous inputs."""
    import torch
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    if "fn" not in _FLEX:
        _FLEX["fn"] = torch.compile(flex_attention, dynamic=False)
    flex = _FLEX["fn"]
    lengths, H, D = shape["lengths"], shape["H"], case["D"]
    if case["kind"] == "packed":
        B, N = 1, sum(lengths)
        doc = torch.repeat_interleave(torch.arange(len(lengths), device="cuda"),
                                      torch.tensor(lengths, device="cuda"))

        def mask_mod(b, h, qi, ki):
            return (doc[qi] == doc[ki]) & (qi >= ki)
    else:
        B, N, W = shape["B"], case["N"], shape["window"][0]

        def mask_mod(b, h, qi, ki):
            return (qi >= ki) & (qi - ki <= W)
    block_mask = create_block_mask(mask_mod, B=None, H=None, Q_LEN=N, KV_LEN=N, device="cuda")
    dt = torch.bfloat16 if dtype == "bfloat16" else torch.float16
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, do = (torch.randn((B, H, N, D), device="cuda", dtype=dt, generator=g) for _ in range(4))
    qg, kg, vg = (x.detach().requires_grad_() for x in (q, k, v))

    def fwd():
        return flex(q, k, v, block_mask=block_mask)

    def fb():
        torch.autograd.grad(flex(qg, kg, vg, block_mask=block_mask), (qg, kg, vg), do)
    out = _VarlenRows("flex", case, shape, dtype)
    out.timed(fwd, fb, warmup, rep)
    return out.rows


#: The function timing each packed/window baseline (looked up at call time, so that tests can stand in for them).
_VARLEN_BENCH = {"cudnn": "_bench_cudnn_varlen", "sdpa-docs": "_bench_sdpa_docs", "torch-varlen": "_bench_torch_varlen",
                 "flex": "_bench_flex"}
#: The case kinds each baseline can time; another kind gets one ``skip`` row per case saying why.
VARLEN_KINDS = {"cudnn": ("packed", "window"), "sdpa-docs": ("packed",), "torch-varlen": ("packed", "window"),
                "flex": ("packed", "window")}


def bench_varlen_baseline(name, case, *, warmup=3, rep=10, dtype="bfloat16"):
    """One packed/window baseline's rows for one case (``VARLEN_BASELINES``): a graph the installed cuDNN does not
    support for the case (e.g. ragged offsets before Hopper) gives a ``skip`` row with cuDNN's reason, whatever else
    it raises an ``error`` row (the sweep goes on)."""
    from ._cudnn_fp8 import Unavailable  # (imports neither torch nor the frontend)

    shape = case_shape(case)
    if case["kind"] not in VARLEN_KINDS[name]:
        return [dict(impl=VARLEN_BASELINES[name], mode="skip", **case_fields(case, shape),
                     reason=f"no {case['kind']} form (SDPA has no sliding window)")]
    try:
        return globals()[_VARLEN_BENCH[name]](case, shape, dtype, warmup, rep)
    except Unavailable as exc:
        return [dict(impl=VARLEN_BASELINES[name], mode="skip", **case_fields(case, shape), reason=str(exc)[:400])]
    except Exception as exc:
        return [dict(impl=VARLEN_BASELINES[name], mode="error", **case_fields(case, shape),
                     error=f"{type(exc).__name__}: {exc}"[:400])]
