"""The NVFP4 call's launches one by one on the device (on the GPU machine): every kernel launch of
``nvfp4.attention`` wrapped with an event after it, calls back to back, median device time of each launch (from the
previous launch's event), D = 128, bf16, the benchmark's shapes:

    python bench/fp4_prepass_probe.py [--n 4096] [--reps 20]

PDL is switched off here (``SAGECUPY_PDL=0``, set before sagecupy is imported): the probe's hook sees launches made
through CuPy's kernel call, not the cuLaunchKernelEx path that programmatic dependent launch takes, so with PDL on it
would count only the two launches that stay plain (the K mean). Per-launch times without PDL are what it measures;
the PDL overlap is visible in the whole call's time (``bench/fp4_floor.py``).
"""
import argparse
import os
import statistics

os.environ["SAGECUPY_PDL"] = "0"  # noqa: E402  (before sagecupy reads it; see the docstring)

import cupy  # noqa: E402

from sagecupy import bench, nvfp4  # noqa: E402
from sync_probe import record_launches  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=4096)
    ap.add_argument("--reps", type=int, default=20)
    a = ap.parse_args()
    marks = []
    B, H, (q, k, v, _) = bench._inputs(128, a.n, "bfloat16")
    for causal in (False, True):
        call = lambda: nvfp4.attention(q, k, v, causal=causal)  # noqa: E731
        for _ in range(5):
            call()
        restore = record_launches(marks)
        runs = []
        for _ in range(a.reps):
            del marks[:]
            e0 = cupy.cuda.Event()
            e0.record()
            call()
            runs.append([e0] + [e for _, e in marks])
        cupy.cuda.Device().synchronize()
        restore()
        n = min(len(r) for r in runs)
        per = [statistics.median(cupy.cuda.get_elapsed_time(r[i], r[i + 1]) * 1e3 for r in runs) for i in range(n - 1)]
        print(f"N={a.n} causal={causal}: {n - 1} launches, us each: " + " | ".join(f"{x:.1f}" for x in per)
              + f"  (sum {sum(per):.1f})", flush=True)


if __name__ == "__main__":
    main()
