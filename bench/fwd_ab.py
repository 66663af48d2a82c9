"""INT8 forward of the package on PYTHONPATH: the public call (synchronized and back to back), the attention kernel
alone, and a hash of O's and the LSE's bits, for A/B against another tree in a separate process:

    git archive REV sagecupy kernels_cu | tar -x -C old
    PYTHONPATH=old python bench/fwd_ab.py --tag old; PYTHONPATH=. python bench/fwd_ab.py --tag new
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
            B, H, (q, k, v, _) = bench._inputs(d, n, "bfloat16")
            for causal in (False, True):
                p, c, pre = int8._preprocess_forward(q, k, v, causal=causal, sm_scale=None, layout="HND", config=None)
                kern = min(bench.time_ms(lambda: int8._launch_forward(p, c, pre)) for _ in range(2))
                call = min(bench.time_ms(lambda: int8.forward(q, k, v, causal=causal)) for _ in range(2))
                b2b = bench.time_ms_b2b(lambda: int8.forward(q, k, v, causal=causal), 3, calls=20)
                o, lse, _ = int8.forward(q, k, v, causal=causal, return_lse=True)
                h = hashlib.sha1(getattr(o, "bits", o).get().tobytes() + lse.get().tobytes()).hexdigest()[:12]
                print(f"{a.tag:<4} D={d} N={n:<6} causal={int(causal)} | kernel {kern:.3f} ms | call {call:.3f} ms "
                      f"| b2b {b2b:.3f} ms | out {h}", flush=True)


if __name__ == "__main__":
    main()
