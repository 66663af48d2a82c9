"""Where the INT8 forward's synchronized (e2e) time goes beyond its device time (on the GPU machine):

    python bench/host_probe.py

For D = 128, N = 4K (causal and not): synchronized and back-to-back times of the whole call, of the pre-passes
alone and of the attention kernel alone; then a cProfile of the forward (own and cumulative time).
"""
import cProfile
import pstats
import time

import cupy

from sagecupy import bench, int8


def main():
    D, N = 128, 4096
    B, H, (q, k, v, _) = bench._inputs(D, N, "bfloat16")
    for causal in (False, True):
        call = lambda: int8.forward(q, k, v, causal=causal)  # noqa: E731
        p, c, pre = int8._preprocess_forward(q, k, v, causal=causal, sm_scale=None, layout="HND", config=None)
        kern = lambda: int8._launch_forward(p, c, pre)  # noqa: E731
        prep = lambda: int8._preprocess_forward(q, k, v, causal=causal, sm_scale=None, layout="HND",  # noqa: E731
                                                config=None)
        out = []
        for name, fn in (("call", call), ("kernel", kern), ("prepass", prep)):
            s = bench.time_ms(fn, 3, 20)
            b = bench.time_ms_b2b(fn, 3, calls=20)
            cupy.cuda.get_current_stream().synchronize()
            t0 = time.perf_counter()
            for _ in range(50):
                fn()
            h = (time.perf_counter() - t0) / 50 * 1e3
            cupy.cuda.get_current_stream().synchronize()
            out.append(f"{name}: synced {s:.3f} b2b {b:.3f} host {h:.3f}")
        print(f"causal={causal}: " + " | ".join(out), flush=True)
    call = lambda: int8.forward(q, k, v, causal=True)  # noqa: E731
    for sort in ("tottime", "cumulative"):
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(200):
            call()
        pr.disable()
        cupy.cuda.get_current_stream().synchronize()
        pstats.Stats(pr).sort_stats(sort).print_stats(28)


if __name__ == "__main__":
    main()
