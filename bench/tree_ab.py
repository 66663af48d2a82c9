"""Times of the INT8 calls of the package on PYTHONPATH, with hashes of their outputs' bits, for A/B against another
tree in a separate process (an older commit's `git archive REV sagecupy kernels_cu | tar -x -C old`):

    PYTHONPATH=old python bench/tree_ab.py --tag old --what bwd; PYTHONPATH=. python bench/tree_ab.py --tag new --what bwd

--what (comma-separated):
  fwd      the forward: the attention kernel alone, the public call (synchronized and back to back), hash of O and LSE;
  bwd      the backward: both kernels alone, the public call both ways, hash of the gradients;
  prepass  device time of the forward's and the backward's pre-passes, calls back to back.
Equal hashes: bitwise the same results. Run it before `pip install -e .` on the device: an editable install makes an
older tree on PYTHONPATH compile the installed tree's kernels (sagecupy.kernels_cu resolves through it).
"""
import argparse
import hashlib

from sagecupy import bench, int8


def _hash(*arrays):
    return hashlib.sha1(b"".join(getattr(x, "bits", x).get().tobytes() for x in arrays)).hexdigest()[:12]


def fwd(q, k, v, causal):
    p, c, pre = int8._preprocess_forward(q, k, v, causal=causal, sm_scale=None, layout="HND", config=None)
    kern = min(bench.time_ms(lambda: int8._launch_forward(p, c, pre)) for _ in range(2))
    call = min(bench.time_ms(lambda: int8.forward(q, k, v, causal=causal)) for _ in range(2))
    b2b = bench.time_ms_b2b(lambda: int8.forward(q, k, v, causal=causal), 3, calls=20)
    o, lse, _ = int8.forward(q, k, v, causal=causal, return_lse=True)
    return f"kernel {kern:.3f} ms | call {call:.3f} ms | b2b {b2b:.3f} ms | out {_hash(o, lse)}"


def bwd(q, k, v, do, causal):
    _, res = int8.forward(q, k, v, causal=causal)
    pre = int8._preprocess_backward(res, do)
    kern = min(bench.time_ms(lambda: int8._launch_backward(res, pre)) for _ in range(2))
    call = min(bench.time_ms(lambda: int8.backward(res, do)) for _ in range(2))
    b2b = bench.time_ms_b2b(lambda: int8.backward(res, do), 3, calls=10)
    return f"kernels {kern:.3f} ms | call {call:.3f} ms | b2b {b2b:.3f} ms | grads {_hash(*int8.backward(res, do))}"


def prepass(q, k, v, do):
    _, res = int8.forward(q, k, v)
    f = min(bench.time_ms_b2b(lambda: int8._preprocess_forward(q, k, v, causal=False, sm_scale=None, layout="HND",
                                                                config=None), 3, calls=20) for _ in range(2))
    b = min(bench.time_ms_b2b(lambda: int8._preprocess_backward(res, do), 3, calls=20) for _ in range(2))
    return f"forward pre-passes {f * 1e3:7.1f} us | backward {b * 1e3:7.1f} us"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tag", default="")
    ap.add_argument("--what", default="fwd,bwd,prepass")
    ap.add_argument("--ds", default="128,64")
    ap.add_argument("--ns", default="4096,16384")
    a = ap.parse_args()
    whats = a.what.split(",")
    for d in map(int, a.ds.split(",")):
        for n in map(int, a.ns.split(",")):
            B, H, (q, k, v, do) = bench._inputs(d, n, "bfloat16")
            if "prepass" in whats:
                print(f"{a.tag:<4} prepass D={d} N={n:<6} | {prepass(q, k, v, do)}", flush=True)
            for causal in (False, True):
                for w in ("fwd", "bwd"):
                    if w in whats:
                        line = fwd(q, k, v, causal) if w == "fwd" else bwd(q, k, v, do, causal)
                        print(f"{a.tag:<4} {w} D={d} N={n:<6} causal={int(causal)} | {line}", flush=True)


if __name__ == "__main__":
    main()
