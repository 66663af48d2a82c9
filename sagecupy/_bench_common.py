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


# -- packed variable-length batches and sliding windows -----------------------------------------------------------
#: Baselines the packed and window cases are timed against (``run_varlen_suite``'s ``baselines``), and the ``impl`` of
#: their rows: cuDNN's bf16 SDPA through the cuDNN frontend's graph API (ragged THD tensors for the packed cases, its
#: diagonal band for the windows; :mod:`sagecupy._cudnn_varlen`), PyTorch's SDPA called once per document, PyTorch's
#: variable-length attention (``torch.nn.attention.varlen.varlen_attn``), and FlexAttention with a document or
#: sliding-window block mask, compiled.
VARLEN_BASELINES = {"cudnn": "cudnn-bf16", "sdpa-docs": "sdpa-per-doc", "torch-varlen": "torch-varlen",
                    "flex": "flex-attention"}
DEFAULT_VARLEN_BASELINES = tuple(VARLEN_BASELINES)
#: Document counts of ``--packed`` given alone, and the sliding windows ``W`` (window ``(W, 0)``) of ``--windows``.
DEFAULT_PACKED = (8, 32)
DEFAULT_WINDOWS = (1024, 4096)
#: The packed cases' token budget: the dense sweep's batch * N.
PACKED_TOKENS = 16384
#: The shortest document of a packed case, and the seed its lengths are drawn with.
MIN_DOC_LEN = 64
PACKED_SEED = 0


def _parse_names(spec, known, option):
    names = spec.split(",") if isinstance(spec, str) else list(spec)
    out = []
    for name in (n.strip() for n in names):
        if not name:
            continue
        if name not in known:
            raise ValueError(f"{option}: {name!r} is not one of {', '.join(known)}")
        if name not in out:
            out.append(name)
    return tuple(out)


def parse_varlen_baselines(spec) -> tuple:
    """Names of ``VARLEN_BASELINES`` from ``"cudnn,flex"`` (or an iterable), in order, without repeats; ``""`` is
    none. ``ValueError`` names an unknown one."""
    return _parse_names(spec, VARLEN_BASELINES, "--varlen-baselines")


def parse_int_list(spec, option, *, minimum=1) -> tuple:
    """``"8,32"`` (or an iterable of ints) as a sorted tuple of distinct ints ``>= minimum``; ``""`` or None is
    none. ``ValueError`` names the option and the bad entry."""
    if spec is None:
        return ()
    items = spec.split(",") if isinstance(spec, str) else list(spec)
    out = set()
    for item in items:
        if isinstance(item, str):
            item = item.strip()
            if not item:
                continue
        try:
            value = int(item)
        except (TypeError, ValueError):
            raise ValueError(f"{option}: {item!r} is not an integer") from None
        if isinstance(item, float) and item != value:
            raise ValueError(f"{option}: {item!r} is not an integer")
        if value < minimum:
            raise ValueError(f"{option}: {value} is below {minimum}")
        out.add(value)
    return tuple(sorted(out))


def doc_lengths(n_tokens, n_docs, seed=PACKED_SEED, min_len=MIN_DOC_LEN) -> list:
    """``n_docs`` document lengths, each ``>= min_len``, summing to ``n_tokens``: ``min_len`` each plus the rest cut at
    ``n_docs - 1`` points drawn uniformly (with repeats) by NumPy's ``default_rng(seed)``, so lengths vary widely (a
    document may get ``min_len`` alone) and a seed gives the same lengths on every machine."""
    import numpy as np

    n_tokens, n_docs, min_len = int(n_tokens), int(n_docs), int(min_len)
    if n_docs < 1 or min_len < 1:
        raise ValueError(f"need at least one document of at least one token; got n_docs={n_docs}, min_len={min_len}")
    rest = n_tokens - n_docs * min_len
    if rest < 0:
        raise ValueError(f"{n_docs} documents of at least {min_len} tokens need {n_docs * min_len} tokens; "
                         f"got {n_tokens}")
    cuts = np.sort(np.random.default_rng(seed).integers(0, rest + 1, n_docs - 1))
    extra = np.diff(np.concatenate([[0], cuts, [rest]]))
    return [int(min_len + e) for e in extra]


def visible_pairs(nq, nk, causal=True, window=None) -> int:
    """Query-key pairs one sequence attends: the ``True`` entries of ``reference.attention.visible_mask(nq, nk,
    causal, window)`` (bottom-right causal; ``window=(left, right)``, -1 unbounded), counted row by row."""
    import numpy as np

    left, right = (-1, 0 if causal else -1) if window is None else (int(window[0]), int(window[1]))
    if causal and right != 0:
        raise ValueError(f"causal=True contradicts window={window!r}")
    i = np.arange(int(nq), dtype=np.int64) + (int(nk) - int(nq))  # each row's diagonal key
    lo = np.zeros_like(i) if left == -1 else np.maximum(i - left, 0)
    hi = np.full_like(i, int(nk) - 1) if right == -1 else np.minimum(i + right, int(nk) - 1)
    return int(np.clip(hi - lo + 1, 0, None).sum())


def pair_flops(pairs, H, D, mode="fwd") -> float:
    """FLOPs over ``pairs`` visible query-key pairs per head (all sequences of the batch): ``4 pairs H D`` for the
    forward (two matmuls), 2.5x backward, 3.5x forward+backward, as :func:`flops` counts a dense problem."""
    return 4.0 * pairs * H * D * {"fwd": 1.0, "bwd": 2.5, "fwdbwd": 3.5}[mode]


def packed_cases(ds=(64, 128), docs=DEFAULT_PACKED, *, n_tokens=PACKED_TOKENS, seed=PACKED_SEED) -> list:
    """The packed cases: ``n_tokens`` tokens (one sequence of the sweep's token budget) as ``S`` causal documents of
    :func:`doc_lengths`, for each head dim and document count; H * D = 2048 as in the dense sweep."""
    return [dict(kind="packed", D=int(d), N=int(n_tokens), S=int(s), seed=int(seed)) for d in ds for s in docs]


def window_cases(ds=(64, 128), ns=(16384,), windows=DEFAULT_WINDOWS) -> list:
    """The window cases: causal with window ``(W, 0)`` on the sweep's shapes (batch * N = 16K, H * D = 2048); a window
    as wide as the sequence (``W >= N - 1``) is plain causal and left out."""
    return [dict(kind="window", D=int(d), N=int(n), W=int(w)) for d in ds for n in ns for w in windows
            if int(w) < int(n) - 1]


def case_shape(case) -> dict:
    """What a packed or window case's rows record besides the timing: ``B``, ``H``, the documents' ``lengths`` (a
    window case: ``B`` sequences of ``N``), ``window`` (None: causal) and ``pairs``, the visible query-key pairs
    summed over documents (or sequences), whose FLOPs (:func:`pair_flops`) give the rows' ``tops``."""
    D, N = case["D"], case["N"]
    if case["kind"] == "packed":
        lengths = doc_lengths(N, case["S"], case.get("seed", PACKED_SEED))
        B, H, window = 1, 2048 // D, None
        extra = dict(S=case["S"], seed=case.get("seed", PACKED_SEED))
    elif case["kind"] == "window":
        B, H = _shape(D, N)
        lengths, window = [N] * B, (case["W"], 0)
        extra = dict(W=case["W"])
    else:
        raise ValueError(f"case kind {case['kind']!r} is not 'packed' or 'window'")
    pairs = sum(visible_pairs(L, L, True, window) for L in lengths)
    return dict(B=B, H=H, lengths=lengths, window=window, pairs=pairs, **extra)


def case_fields(case, shape) -> dict:
    """The fields that say which packed or window case a row belongs to (``shape``: :func:`case_shape`)."""
    f = dict(case=case["kind"], D=case["D"], N=case["N"], B=shape["B"], H=shape["H"], causal=True)
    if case["kind"] == "packed":
        f.update(S=shape["S"], seed=shape["seed"], lengths=shape["lengths"])
    else:
        f.update(W=shape["W"], window=list(shape["window"]))
    return f


def case_name(case) -> str:
    """``packed D=128 N=16384 S=8`` / ``window D=128 N=16384 W=1024``: a case in progress lines and tables."""
    tail = f"S={case['S']}" if case["kind"] == "packed" else f"W={case['W']}"
    return f"{case['kind']} D={case['D']} N={case['N']} {tail}"


#: Fields of a timed row that vary between the rounds of one sweep (``run_suite(..., rounds=R)``); every other field
#: names what was timed.
_ROUND_FIELDS = ("ms", "tops", "round", "rounds", "ms_min", "ms_max")


def median_rows(rows) -> list:
    """Rows timed in several rounds of one sweep (``round`` fields; ``run_suite(..., rounds=R)``) as one row each: the
    median ``ms`` and ``tops`` over the rounds, with ``rounds`` (how many), ``ms_min`` and ``ms_max``, in the order
    of each row's first round. Rows without ``ms`` (skip, error, memory) and rows of a single round pass unchanged.

    A slow stretch of one round (a clock dip, another process on the host) moves the median of three rounds less than
    it moves a single run; ``ms_min`` and ``ms_max`` show how far the rounds spread."""
    groups, order = {}, []  # order: each pass-through row itself, or the key of a group where its first round was
    for r in rows:
        if "ms" not in r or "round" not in r:
            order.append(r)
            continue
        key = tuple(sorted((k, _json_key(v)) for k, v in r.items() if k not in _ROUND_FIELDS))
        if key not in groups:
            groups[key] = []
            order.append(key)
        groups[key].append(r)
    return [x if isinstance(x, dict) else _median_row(groups[x]) for x in order]


def _median_row(rs):
    """One row of a group of rounds (:func:`median_rows`)."""
    row = {k: v for k, v in rs[0].items() if k not in _ROUND_FIELDS}
    ms = [r["ms"] for r in rs]
    row["ms"] = statistics.median(ms)
    if all("tops" in r for r in rs):
        row["tops"] = statistics.median(r["tops"] for r in rs)
    row.update(rounds=len(rs), ms_min=min(ms), ms_max=max(ms))
    return row


def _json_key(v):
    """A hashable stand-in for a JSON value (lists, e.g. a window, become tuples)."""
    if isinstance(v, list):
        return tuple(_json_key(x) for x in v)
    if isinstance(v, dict):
        return tuple(sorted((k, _json_key(x)) for k, x in v.items()))
    return v
