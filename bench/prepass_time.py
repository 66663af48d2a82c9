"""Device time of the INT8 pre-passes (forward: smoothing mean, Q/K/V quantization; backward: delta, dO
quantization, Q^T/K^T), calls issued back to back, for the kernel tree and package on PYTHONPATH. To compare two
trees, run it once per tree (e.g. an earlier commit's `git archive REV sagecupy kernels_cu | tar -x -C old`):

    PYTHONPATH=old python bench/prepass_time.py; PYTHONPATH=. python bench/prepass_time.py
"""
import argparse

from sagecupy import bench, int8


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tag", default="")
    ap.add_argument("--ds", default="128,64")
    ap.add_argument("--ns", default="4096,16384")
    a = ap.parse_args()
    for d in map(int, a.ds.split(",")):
        for n in map(int, a.ns.split(",")):
            B, H, (q, k, v, do) = bench._inputs(d, n, "bfloat16")
            _, res = int8.forward(q, k, v)
            fwd = min(bench.time_ms_b2b(lambda: int8._preprocess_forward(q, k, v, causal=False, sm_scale=None,
                                                                          layout="HND", config=None), 3, calls=20)
                      for _ in range(2))
            bwd = min(bench.time_ms_b2b(lambda: int8._preprocess_backward(res, do), 3, calls=20) for _ in range(2))
            print(f"{a.tag:<6} D={d} N={n:<6} forward pre-passes {fwd * 1e3:7.1f} us | backward {bwd * 1e3:7.1f} us",
                  flush=True)


if __name__ == "__main__":
    main()
