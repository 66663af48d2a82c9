"""Time the INT8 backward's kernels (wgmma engine) under kernel defines (SAGECUPY_DEFINES) in one process:
which register budget / occupancy to make the default.

    python bench/bwd_variants.py --d 64 --defines ";SAGE_BWD_KV_MIN_CTAS=1,SAGE_BWD_DQ_MIN_CTAS=1"

Defines of one variant are comma-separated, variants semicolon-separated ("" = the default build); tokens named
SAGECUPY_* are environment variables of that variant (on branch exp/ws-dkdv, `--defines ";SAGECUPY_BWD_WS=1"` times
its warp-specialized dK/dV kernel against the default one). Prints
the dK/dV and dQ kernels' times (variants interleaved over --rounds rounds, the best kept: identical builds
read up to 3% apart in one pass) and whether the gradients are bitwise those of the first variant.
"""
import argparse

import numpy as np

from sagecupy import bench, int8
from variant_env import set_variant




def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", default="4096,16384")
    ap.add_argument("--d", type=int, default=64)
    ap.add_argument("--defines", default=";SAGE_BWD_KV_MIN_CTAS=1,SAGE_BWD_DQ_MIN_CTAS=1")
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args()
    for n in map(int, a.n.split(",")):
        for causal in (False, True):
            B, H, (q, k, v, do) = bench._inputs(a.d, n, "bfloat16")
            _, res = int8.forward(q, k, v, causal=causal)
            pre = int8._preprocess_backward(res, do)
            line, ref = f"D={a.d} N={n:5d} causal={int(causal)}", None
            variants = a.defines.split(";")
            best, same = {}, {}
            for rnd in range(a.rounds):  # variants interleaved, the best of the rounds kept (cross-build noise)
                for dfn in variants:
                    set_variant(dfn)
                    for w in (("dkdv",), ("dq",), ("dkdv", "dq")):
                        ms = bench.time_ms(lambda: int8._launch_backward(res, pre, "wgmma", kernels=w))
                        best[dfn, w] = min(best.get((dfn, w), ms), ms)
                    if rnd == 0:
                        g = [np.asarray(getattr(x, "bits", x).get()) for x in int8._launch_backward(res, pre, "wgmma")]
                        same[dfn] = "" if ref is None else (
                            " =" if all(np.array_equal(x, y) for x, y in zip(g, ref)) else " DIFFERS")
                        ref = g if ref is None else ref
            for dfn in variants:
                t = {w: best[dfn, w] for w in (("dkdv",), ("dq",), ("dkdv", "dq"))}
                line += (f" | [{dfn or 'default'}] dK/dV {t[('dkdv',)]:.3f} dQ {t[('dq',)]:.3f} "
                         f"both {t[('dkdv', 'dq')]:.3f} ms{same[dfn]}")
            set_variant(None)
            print(line, flush=True)


if __name__ == "__main__":
    main()
