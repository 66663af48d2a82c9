"""What the benchmark's modules share: the baseline and adapter names, the FLOP count (docs/algorithms.md §8), the
CUDA-event timers, the sweep's shapes and inputs. :mod:`sagecupy.bench` (sagecupy's rows, the sweep, the table) and
:mod:`sagecupy.bench_frameworks` (the rows that need PyTorch, JAX or cuDNN) both build on it."""
from __future__ import annotations

import statistics
import time


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
    """GPU time per call of ``fn()`` issued ``calls`` times back to back (no synchronization between the calls:
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


def default_cases(quick=False):
    """(D, N, causal) with batch * N = 16K tokens and H * D = 2048 (H = 16 at D = 128), D in {64, 128}, N from 1K
    to 32K, causal and not (docs/algorithms.md §8.1); ``quick``: N in {4K, 16K}."""
    ns = (4096, 16384) if quick else (1024, 2048, 4096, 8192, 16384, 32768)
    return [(d, n, c) for d in (64, 128) for n in ns for c in (False, True)]


def _shape(D, N):
    return max(1, 16384 // N), 2048 // D


def _inputs(D, N, dtype):
    """B, H and standard-normal q, k, v, dO of the sweep's shape (seed 0) in ``dtype`` (fp16, or bf16: a CuPy
    bfloat16 array where CuPy has that dtype, else a ``BF16Array``)."""
    import cupy

    from .adapters.bf16 import from_float

    B, H = _shape(D, N)
    rng = cupy.random.default_rng(0)

    def mk():
        x = rng.standard_normal((B, H, N, D), dtype=cupy.float32)
        return x.astype(cupy.float16) if dtype == "float16" else from_float(x)

    return B, H, (mk(), mk(), mk(), mk())


def _config_name(config):
    """The ``config`` field of an INT8 row: the preset's name, or the config object's ``name``."""
    return (config or "default") if isinstance(config, (str, type(None))) else config.name
