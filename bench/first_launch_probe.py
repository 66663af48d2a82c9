"""When the host issues each launch of one INT8 forward call (on the GPU machine): microseconds from the call's start
to each driver launch and to its return, median over calls, with and without a synchronization before each call (a
synchronized call's device time starts at its first launch: everything before it is idle device time that the
"e2e" benchmark rows count), then a cProfile of the calls by own time.

    python bench/first_launch_probe.py [--ns 4096] [--call infer|train] [--calls 200]
"""
import argparse
import cProfile
import pstats
import statistics
import time

import cupy

from sagecupy import bench, int8


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ns", default="4096")
    ap.add_argument("--call", default="infer", choices=("infer", "train"))
    ap.add_argument("--calls", type=int, default=200)
    a = ap.parse_args()
    drv = cupy.cuda.driver
    orig = drv.launchKernel
    stamps = []

    def stamped(*args):
        stamps.append(time.perf_counter())
        return orig(*args)

    sync = cupy.cuda.get_current_stream().synchronize
    for N in (int(x) for x in a.ns.split(",")):
        B, H, (q, k, v, _) = bench._inputs(128, N, "bfloat16")
        for causal in (False, True):
            fn = ((lambda: int8.sage_attention(q, k, v, causal=causal)) if a.call == "infer"
                  else (lambda: int8.forward(q, k, v, causal=causal)))
            for _ in range(5):
                fn()
            sync()
            drv.launchKernel = stamped
            try:
                for synced in (True, False):
                    offs = []
                    for i in range(a.calls):
                        if synced or i % 10 == 0:  # unsynchronized: the queue is drained every 10 calls
                            sync()
                        stamps.clear()
                        t0 = time.perf_counter()
                        fn()
                        t1 = time.perf_counter()
                        offs.append([(s - t0) * 1e6 for s in stamps] + [(t1 - t0) * 1e6])
                    med = [statistics.median(c) for c in zip(*offs)]
                    print(f"{a.call} N={N} causal={int(causal)} {'synced  ' if synced else 'unsynced'}: launches at "
                          + " ".join(f"{m:.1f}" for m in med[:-1]) + f" us; returns at {med[-1]:.1f} us", flush=True)
            finally:
                drv.launchKernel = orig
            sync()
            if N == int(a.ns.split(",")[0]) and not causal:
                pr = cProfile.Profile()
                for _ in range(a.calls):
                    sync()
                    pr.enable()
                    fn()
                    pr.disable()
                sync()
                pstats.Stats(pr).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
