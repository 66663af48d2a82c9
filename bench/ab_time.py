"""End-to-end times of the public calls under variants (kernel defines, or another kernel tree through
SAGECUPY_KERNELS_DIR: bench/variant_env.py), interleaved over rounds, the best kept, in one process:

    git archive HEAD kernels_cu | tar -x -C /tmp/base
    python bench/ab_time.py --what int8_fwd,int8_infer,int8_bwd,qat_fwd,qat_bwd,nvfp4 \\
        --variants ";SAGECUPY_KERNELS_DIR=/tmp/base/kernels_cu"

Each row: the call, the shape, then per variant its time (ms) and its ratio to the first variant (> 1: faster than
the first). bf16, B*N = 16K tokens, H = 16 (the benchmark's shapes, sagecupy.bench._inputs).
"""
import argparse

from sagecupy import bench, int8, nvfp4, qat
from variant_env import set_variant


def calls(what, q, k, v, do, causal):
    if what == "int8_fwd":
        return lambda: int8.forward(q, k, v, causal=causal)
    if what == "int8_infer":  # the inference call (no residuals)
        return lambda: int8.sage_attention(q, k, v, causal=causal)
    if what == "int8_bwd":
        _, res = int8.forward(q, k, v, causal=causal)
        return lambda: int8.backward(res, do)
    if what == "qat_fwd":
        return lambda: qat.forward(q, k, v, causal=causal)
    if what == "qat_bwd":
        _, res = qat.forward(q, k, v, causal=causal)
        return lambda: qat.backward(res, do)
    if what == "nvfp4":
        return lambda: nvfp4.attention(q, k, v, causal=causal)
    raise ValueError(f"unknown call {what!r}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--what", default="int8_bwd,qat_bwd")
    ap.add_argument("--variants", default=";")
    ap.add_argument("--n", default="4096,16384")
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args()
    variants = a.variants.split(";")
    for n in map(int, a.n.split(",")):
        B, H, (q, k, v, do) = bench._inputs(a.d, n, "bfloat16")
        for causal in (False, True):
            for what in a.what.split(","):
                best = {}
                for _ in range(a.rounds):
                    for dfn in variants:
                        set_variant(dfn)
                        fn = calls(what, q, k, v, do, causal)  # residuals made under the variant too
                        best[dfn] = min(best.get(dfn, 1e30), bench.time_ms(fn))
                set_variant(None)
                ref = best[variants[0]]
                print(f"{what:<9} D={a.d} N={n:<6} causal={int(causal)} | "
                      + " | ".join(f"[{dfn or 'default'}] {best[dfn]:.3f} ms {ref / best[dfn]:.3f}x" for dfn in variants),
                      flush=True)


if __name__ == "__main__":
    main()
