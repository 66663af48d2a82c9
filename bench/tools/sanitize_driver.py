"""Every family's kernels once, on small odd shapes, for compute-sanitizer (bench/sanitize.sh runs it under each
tool).

Calls, per engine the device has (mma.sync everywhere, wgmma on sm_90): INT8 forward + backward with the default,
paper and bkv64 configs and the inference forward (sage_attention); NVFP4 attention with two-level and single-level P
and attention_packed on quantize_inputs' operands; QAT forward + backward. The shapes are small (a handful of CTAs:
racecheck instruments every shared-memory access) and odd: lengths off every tile size, Nq != Nk both ways, rows that
see no key, GQA, both dtypes and layouts, and one NVFP4 call whose key tiles the tail split divides (D = 128, wgmma,
not causal, 9 key tiles). INT8 also with sliding windows (both edges bounded, a window narrower than a tile, one
whose first tile is not tile 0) and with packed sequences (layout "THD": documents of 17, 0 and 130 queries against
33, 5 and 70 keys, one empty, causal and windowed).

CuPy's memory pool is turned off, so that each array is an allocation of its own and memcheck sees an access past
its end (inside a pool block it would land in another array and pass). Each call is synchronized, so that an error
is reported against it. Prints one line per call and exits 0 when every call returned.

    python3 bench/tools/sanitize_driver.py            # (bench/sanitize.sh: the same under compute-sanitizer)
"""
from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

# (family, D, dtype, layout, causal, Nq, Nk, config[, options]); options: window=(left, right), or docs=(the query and
# key lengths of each packed document) for layout "THD"
CASES = [
    ("int8", 64, "float16", "HND", True, 77, 131, "default"),
    ("int8", 128, "bfloat16", "NHD", False, 77, 131, "default"),
    ("int8", 128, "float16", "HND", True, 130, 70, "paper"),     # per-block Q, K, V; rows that see no key
    ("int8", 64, "bfloat16", "HND", False, 1, 33, "bkv64"),
    ("int8", 128, "float16", "NHD", False, 200, 333, "default", dict(window=(5, 7))),
    ("int8", 64, "bfloat16", "HND", True, 333, 200, "bkv64", dict(window=(100, 0))),
    ("int8", 128, "float16", "THD", True, 147, 108, "default", dict(docs=((17, 33), (0, 5), (130, 70)))),
    ("int8", 64, "float16", "THD", False, 147, 108, "paper", dict(docs=((17, 33), (0, 5), (130, 70)), window=(3, 2))),
    ("nvfp4", 64, "float16", "HND", True, 77, 131, "two-level"),
    ("nvfp4", 128, "bfloat16", "NHD", False, 77, 520, "two-level"),  # wgmma: the tail split (2 items in 2 parts)
    ("nvfp4", 128, "float16", "HND", True, 200, 90, "single-level"),
    ("qat", 64, "bfloat16", "HND", True, 77, 131, None),
    ("qat", 128, "float16", "NHD", False, 130, 70, None),
]
B, HQ, HKV = 1, 2, 1


def _inputs(cp, D, dtype, layout, nq, nk, seed):
    from sagecupy.adapters.bf16 import BF16Array

    rs = cp.random.RandomState(seed)

    def make(h, n):
        shape = (B, h, n, D) if layout == "HND" else (B, n, h, D)
        x = rs.standard_normal(shape, dtype=cp.float32)
        return x.astype(cp.float16) if dtype == "float16" else BF16Array.from_float(x)

    return make(HQ, nq), make(HKV, nk), make(HKV, nk), make(HQ, nq)


def _packed_inputs(cp, D, docs, seed):
    """(total, H, D) float16 operands of the documents' lengths and their int32 cu_seqlens (device arrays)."""
    import numpy as np

    rs = cp.random.RandomState(seed)
    lq, lk = (np.array([d[i] for d in docs]) for i in (0, 1))
    make = lambda n, h: rs.standard_normal((int(n), h, D), dtype=cp.float32).astype(cp.float16)  # noqa: E731
    cu = [cp.asarray(np.concatenate([[0], np.cumsum(x)]).astype(np.int32)) for x in (lq, lk)]
    return (make(lq.sum(), HQ), make(lk.sum(), HKV), make(lk.sum(), HKV), make(lq.sum(), HQ)), dict(
        cu_seqlens_q=cu[0], cu_seqlens_k=cu[1], max_seqlen_q=int(lq.max()), max_seqlen_k=int(lk.max()))


def _run(case, engine, cp):
    from sagecupy import int8, nvfp4, qat
    from sagecupy.config import NVFP4Config

    family, D, dtype, layout, causal, nq, nk, config = case[:8]
    opts = dict(case[8]) if len(case) > 8 else {}
    docs = opts.pop("docs", None)
    if docs:
        (q, k, v, do), packed = _packed_inputs(cp, D, docs, seed=nq * 1000 + nk)
        opts.update(packed)
    else:
        q, k, v, do = _inputs(cp, D, dtype, layout, nq, nk, seed=nq * 1000 + nk)
    kw = dict(causal=causal, layout=layout, engine=engine, **opts)
    if family == "int8":
        o, res = int8.forward(q, k, v, config=config, **kw)
        int8.backward(res, do, engine=engine)
        int8.sage_attention(q, k, v, config=config, **kw)
    elif family == "nvfp4":
        cfg = NVFP4Config(two_level_p=config == "two-level")
        nvfp4.attention(q, k, v, config=cfg, **kw)
        if layout == "HND":  # attention_packed takes HND operands
            ops = nvfp4.quantize_inputs(q, k, v, layout=layout, k_smoothing=False)
            nvfp4.attention_packed(ops, causal=causal, out_dtype=dtype, two_level_p=cfg.two_level_p, engine=engine)
    else:
        o, res = qat.forward(q, k, v, **kw)
        qat.backward(res, do, engine=engine)
    cp.cuda.Device().synchronize()


def main() -> int:
    import cupy as cp

    from sagecupy._loader import device_capability

    cp.cuda.set_allocator(None)  # an allocation per array: memcheck sees accesses past an array's end
    engines = ("mma", "wgmma") if device_capability() == (9, 0) else ("mma",)
    n = 0
    for case in CASES:
        for engine in engines:
            t0 = time.perf_counter()
            _run(case, engine, cp)
            n += 1
            family, D, dtype, layout, causal, nq, nk, config = case[:8]
            print(f"{family:5s} {engine:5s} D={D} {dtype} {layout} {'causal' if causal else 'full':6s} "
                  f"Nq={nq} Nk={nk} {config or ''} {case[8] if len(case) > 8 else ''}: "
                  f"{time.perf_counter() - t0:.2f} s", flush=True)
    print(f"sanitize_driver: {n} calls returned", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
