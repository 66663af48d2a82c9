"""Does running the INT8 backward's two kernels (dK/dV and dQ, independent of each other) concurrently pay?
Times, in one process, the kernels one after the other (as `int8._launch_backward` does) against dK/dV on
the current stream with dQ on a second stream (joined by events), in both orders. On the GPU machine:

    python bench/bwd_overlap_probe.py [--d 128] [--n 4096,16384]
"""
import argparse

import cupy

from sagecupy import bench, int8


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", default="4096,16384")
    ap.add_argument("--d", type=int, default=128)
    a = ap.parse_args()
    side = cupy.cuda.Stream(non_blocking=True)

    for n in map(int, a.n.split(",")):
        for causal in (False, True):
            B, H, (q, k, v, do) = bench._inputs(a.d, n, "bfloat16")
            _, res = int8.forward(q, k, v, causal=causal)
            pre = int8._preprocess_backward(res, do)

            def seq():
                int8._launch_backward(res, pre, "wgmma")

            def two_streams(first, second):
                def run():
                    cur = cupy.cuda.get_current_stream()
                    side.wait_event(cur.record())
                    int8._launch_backward(res, pre, "wgmma", kernels=(first,))
                    with side:
                        int8._launch_backward(res, pre, "wgmma", kernels=(second,))
                    cur.wait_event(side.record())
                return run

            t = {}
            for rnd in range(2):  # interleaved rounds, back-to-back timing (the device's time per call)
                for name, fn in (("sequential", seq), ("dkdv || dq", two_streams("dkdv", "dq")),
                                 ("dq || dkdv", two_streams("dq", "dkdv"))):
                    ms = bench.time_ms_b2b(fn)
                    t[name] = min(t.get(name, ms), ms)
            print(f"D={a.d} N={n:5d} causal={int(causal)} " + " | ".join(f"{k} {v:.3f} ms" for k, v in t.items()),
                  flush=True)


if __name__ == "__main__":
    main()
