"""INT8 backward of the package on PYTHONPATH: the public call (synchronized and back to back), the two kernels
alone, and a hash of the gradients' bits, for A/B against another tree in a separate process:

    git archive REV sagecupy kernels_cu | tar -x -C old
    PYTHONPATH=old python bench/bwd_ab.py --tag old; PYTHONPATH=. python bench/bwd_ab.py --tag new

Equal hashes: bitwise the same gradients.
"""
import argparse
import hashlib

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
            for causal in (False, True):
                _, res = int8.forward(q, k, v, causal=causal)
                pre = int8._preprocess_backward(res, do)
                kern = min(bench.time_ms(lambda: int8._launch_backward(res, pre)) for _ in range(2))
                call = min(bench.time_ms(lambda: int8.backward(res, do)) for _ in range(2))
                b2b = bench.time_ms_b2b(lambda: int8.backward(res, do), 3, calls=10)
                grads = int8.backward(res, do)
                h = hashlib.sha1(b"".join(getattr(x, "bits", x).get().tobytes() for x in grads)).hexdigest()[:12]
                print(f"{a.tag:<4} D={d} N={n:<6} causal={int(causal)} | kernels {kern:.3f} ms | call {call:.3f} ms "
                      f"| b2b {b2b:.3f} ms | grads {h}", flush=True)


if __name__ == "__main__":
    main()
