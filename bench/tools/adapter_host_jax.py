"""Host time of the JAX adapter against the CuPy call. On the GPU machine (TAG marks the lines, to compare two
checkouts: run it once with each on PYTHONPATH):

    python3 bench/tools/adapter_host_jax.py [TAG] [tiny]

At B = H = 1, N = 128 (D = 128, causal, bf16), host microseconds per call with the GPU keeping up (median of 5 runs
of 200 calls): the CuPy call, ``sagecupy.jax.sage_attention`` under ``jax.jit``, a jitted ``buffer_callback`` that
does nothing (the floor of JAX's callback dispatch), forward and forward+backward; ``inside`` gives the median
microseconds inside the adapter's forward (``cb``) and backward (``bcb``) callbacks and inside the int8 entry
points they call. Without ``tiny``, then the milliseconds of synchronized calls (median of 60) at B = 16, N = 1K and
B = 4, N = 4K (H = 16), with the ratio CuPy ms / JAX ms.
"""
import os
import statistics
import sys
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import cupy as cp  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental.buffer_callback import buffer_callback  # noqa: E402

import sagecupy.int8 as s8  # noqa: E402
from sagecupy.adapters import jax as sj  # noqa: E402
from sagecupy.adapters.bf16 import from_bits  # noqa: E402

inside = {"cb": [], "bcb": []}


def _timed_factory(factory, key):
    def make(*a, **kw):
        callback = factory(*a, **kw)

        def timed(ctx, out, *args):
            t = time.perf_counter()
            callback(ctx, out, *args)
            inside[key].append(time.perf_counter() - t)

        return timed

    return make


def _timed(module, name):
    real = getattr(module, name)
    inside[name] = []

    def timed(*a, **kw):
        t = time.perf_counter()
        try:
            return real(*a, **kw)
        finally:
            inside[name].append(time.perf_counter() - t)

    setattr(module, name, timed)


def host_us(f, n=200):
    for _ in range(10):
        f()
    cp.cuda.runtime.deviceSynchronize()
    runs = []
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(n):
            f()
        runs.append((time.perf_counter() - t) / n * 1e6)
        cp.cuda.runtime.deviceSynchronize()
    return statistics.median(runs)


def sync_ms(f, n=60):
    for _ in range(5):
        f()
    cp.cuda.runtime.deviceSynchronize()
    runs = []
    for _ in range(n):
        t = time.perf_counter()
        f()
        cp.cuda.runtime.deviceSynchronize()
        runs.append(time.perf_counter() - t)
    return statistics.median(runs) * 1e3


def main(tag="", *flags):
    sj._int8_forward_callback = _timed_factory(sj._int8_forward_callback, "cb")
    sj._int8_backward_callback = _timed_factory(sj._int8_backward_callback, "bcb")
    sj._int8_op.cache_clear()
    for name in ("_forward_into", "_backward_into", "_inference", "_training"):
        if hasattr(s8, name):
            _timed(s8, name)
    shapes = ((1, 1, 128),) if "tiny" in flags else ((1, 1, 128), (16, 16, 1024), (4, 16, 4096))
    for B, H, N in shapes:
        rng = np.random.default_rng(0)
        qj, kj, vj, doj = (jnp.asarray(rng.standard_normal((B, H, N, 128), np.float32), dtype=jnp.bfloat16)
                           for _ in range(4))
        qc, kc, vc, doc = (from_bits(cp.asarray(np.asarray(x).view(np.uint16))) for x in (qj, kj, vj, doj))
        fwd = jax.jit(lambda q, k, v: sj.sage_attention(q, k, v, causal=True))

        def loss(q, k, v):
            return jnp.sum(sj.sage_attention(q, k, v, causal=True).astype(jnp.float32) * doj.astype(jnp.float32))

        grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
        spec = {"o": jax.ShapeDtypeStruct(qj.shape, np.uint16)}
        nothing = jax.jit(lambda q, k, v: buffer_callback(lambda ctx, out, *x: None, spec)(
            sj._bits(q), sj._bits(k), sj._bits(v))["o"])

        def cupy_fwdbwd():
            _, res = s8.forward(qc, kc, vc, causal=True)
            return s8.backward(res, doc)

        cases = (("cupy fwd", lambda: s8.sage_attention(qc, kc, vc, causal=True)),
                 ("jax fwd", lambda: fwd(qj, kj, vj)), ("empty callback", lambda: nothing(qj, kj, vj)),
                 ("cupy fwdbwd", cupy_fwdbwd), ("jax fwdbwd", lambda: grad(qj, kj, vj)))
        print(tag, f"B={B} H={H} N={N} D=128 causal bf16", flush=True)
        if N == 128:
            for name, f in cases:
                for v in inside.values():
                    v.clear()
                us = host_us(f)
                within = " ".join(f"{k} {statistics.median(v) * 1e6:.1f}" for k, v in inside.items() if v)
                print(tag, f"host us/call {name:15s} {us:7.1f}   inside: {within}", flush=True)
        else:
            ms = {name: sync_ms(f) for name, f in cases}
            ratios = (ms["cupy fwd"] / ms["jax fwd"], ms["cupy fwdbwd"] / ms["jax fwdbwd"])
            print(tag, "sync ms " + "  ".join(f"{k} {v:.3f}" for k, v in ms.items()),
                  "| cupy/jax fwd {:.3f} fwdbwd {:.3f}".format(*ratios), flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
