"""Host (Python) time of one call of each public entry point, on the GPU machine: where the CPU time
between kernel launches goes (it is the end-to-end overhead when the GPU work is short).

    python bench/profile_host.py [NAME]     # table of per-call host time, then cProfile of NAME (default: the slowest)
"""
import cProfile
import pstats
import sys
import time

import cupy

from sagecupy import int8, nvfp4, qat
from sagecupy.bf16 import BF16Array

B, H, N, D = 4, 16, 4096, 128
rng = cupy.random.default_rng(0)
q, k, v, do = (BF16Array.from_float(rng.standard_normal((B, H, N, D), dtype=cupy.float32)) for _ in range(4))
_, res = int8.forward(q, k, v)
_, qres = qat.forward(q, k, v)
calls = {
    "int8.forward": lambda: int8.forward(q, k, v),
    "int8.backward": lambda: int8.backward(res, do),
    "nvfp4.attention": lambda: nvfp4.attention(q, k, v),
    "qat.forward": lambda: qat.forward(q, k, v),
    "qat.backward": lambda: qat.backward(qres, do),
}
worst, worst_t = None, 0.0
for name, fn in calls.items():
    for _ in range(3):
        fn()
    cupy.cuda.Device().synchronize()
    t0 = time.perf_counter()
    for _ in range(20):
        fn()
    t = (time.perf_counter() - t0) / 20  # host time per call (launches are asynchronous)
    cupy.cuda.Device().synchronize()
    print(f"{name:<18} host {t * 1e3:7.3f} ms per call")
    if t > worst_t:
        worst, worst_t = name, t
if len(sys.argv) > 1:
    worst = sys.argv[1]
prof = cProfile.Profile()
prof.enable()
for _ in range(20):
    calls[worst]()
prof.disable()
cupy.cuda.Device().synchronize()
print(f"== cProfile of {worst} (20 calls)")
pstats.Stats(prof).sort_stats("tottime").print_stats(25)
