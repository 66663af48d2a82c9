"""Where a synchronized INT8 forward call's time goes on the device (on the GPU machine):

    python bench/sync_probe.py [--n 4096] [--reps 20]

Per case (D = 128, causal and not): events before the call, between the pre-pass and the attention kernel, and
after it, in two modes: synchronized (one call, then wait for the device, as ``bench.time_ms``) and back to back
(the same three events around every call of 20, no waits between calls). Also the host's own time from the call's
start to each half's return (perf_counter), so a device waiting on the host shows as pre-pass time beyond its
back-to-back value. Medians in microseconds.

``--per-launch``: also an event and a host timestamp after every kernel launch of the call (the driver launches of
sagecupy/_program.py, wrapped): for each launch, when the host had issued it and when the device had finished it,
from the call's start, synchronized and back to back.
"""
import argparse
import statistics
import time

import cupy

from sagecupy import bench, int8


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=4096)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--per-launch", action="store_true")
    a = ap.parse_args()
    if a.per_launch:
        per_launch(a)
        return
    D, N = 128, a.n
    B, H, (q, k, v, _) = bench._inputs(D, N, "bfloat16")
    Ev = cupy.cuda.Event
    for causal in (False, True):
        def halves():
            p, c, pre = int8._preprocess_forward(q, k, v, causal=causal, sm_scale=None, layout="HND", config=None)
            t1 = time.perf_counter()
            e1.record()
            int8._launch_forward(p, c, pre)
            return t1

        for _ in range(5):
            e1 = Ev()
            halves()
        cupy.cuda.Device().synchronize()
        rows = {}
        for mode in ("synced", "b2b", "synced+sleep1ms"):
            pre_us, ker_us, host_pre, host_all = [], [], [], []
            evs = []
            for _ in range(a.reps):
                e0, e1, e2 = Ev(), Ev(), Ev()
                if mode.startswith("synced"):
                    cupy.cuda.Device().synchronize()
                    if mode.endswith("sleep1ms"):
                        time.sleep(1e-3)
                t0 = time.perf_counter()
                e0.record()
                t1 = halves()
                e2.record()
                t2 = time.perf_counter()
                host_pre.append((t1 - t0) * 1e6)
                host_all.append((t2 - t0) * 1e6)
                evs.append((e0, e1, e2))
                if mode.startswith("synced"):
                    e2.synchronize()
            cupy.cuda.Device().synchronize()
            for e0, e1_, e2 in evs:
                pre_us.append(cupy.cuda.get_elapsed_time(e0, e1_) * 1e3)
                ker_us.append(cupy.cuda.get_elapsed_time(e1_, e2) * 1e3)
            rows[mode] = (statistics.median(pre_us), statistics.median(ker_us), statistics.median(host_pre),
                          statistics.median(host_all))
        for mode, (p_, k_, hp, ha) in rows.items():
            print(f"N={N} causal={causal} {mode:<16} device: pre-pass {p_:7.1f} kernel {k_:7.1f} total {p_ + k_:7.1f}"
                  f" | host: pre-pass issued {hp:6.1f} call issued {ha:6.1f}")


def record_launches(marks):
    """Wrap the driver launches of sagecupy/_program.py: after each, append (host perf_counter, an event recorded
    behind it) to ``marks``. Returns the function that restores the unwrapped launch."""
    drv = cupy.cuda.driver
    orig = drv.launchKernel

    def wrapped(*args):
        orig(*args)
        e = cupy.cuda.Event()
        e.record()
        marks.append((time.perf_counter(), e))

    drv.launchKernel = wrapped

    def restore():
        drv.launchKernel = orig

    return restore


def per_launch(a):
    marks = []
    restore = record_launches(marks)
    D, N = 128, a.n
    B, H, (q, k, v, _) = bench._inputs(D, N, "bfloat16")
    for causal in (False, True):
        call = lambda: int8.forward(q, k, v, causal=causal)  # noqa: E731
        for _ in range(5):
            call()
        for mode in ("synced", "b2b"):
            host, dev = [], []
            cupy.cuda.Device().synchronize()
            for _ in range(a.reps):
                if mode == "synced":
                    cupy.cuda.Device().synchronize()
                del marks[:]
                e0 = cupy.cuda.Event()
                t0 = time.perf_counter()
                e0.record()
                call()
                host.append([(t - t0) * 1e6 for t, _ in marks])
                dev.append((e0, [e for _, e in marks]))
                if mode == "synced":
                    marks[-1][1].synchronize()
            cupy.cuda.Device().synchronize()
            devs = [[cupy.cuda.get_elapsed_time(e0, e) * 1e3 for e in es] for e0, es in dev]
            n = min(len(h) for h in host)
            hs = [statistics.median(h[i] for h in host) for i in range(n)]
            ds = [statistics.median(d[i] for d in devs) for i in range(n)]
            print(f"N={N} causal={causal} {mode:<7} per launch, us from the call's start: "
                  + " | ".join(f"host {h:6.1f} dev {d:7.1f}" for h, d in zip(hs, ds)))
    restore()


if __name__ == "__main__":
    main()
