"""NVFP4 forward kernel and FP4 QAT forward / backward times under kernel defines (SAGECUPY_DEFINES), D = 64 by
default: the register budgets (CTAs per SM) of the D = 64 kernels. Outputs are compared bitwise with the first
variant's (the knobs change register allocation only).

    python bench/fp4_d64_variants.py --defines ";SAGE_FP4_MIN_CTAS=1,SAGE_QAT_FWD_MIN_CTAS=1,SAGE_QAT_BWD_KV_MIN_CTAS=1"

(the default build against the budgets before the tenth session). Variants are timed interleaved over --rounds
rounds, the best kept; SAGECUPY_* tokens of a variant are environment variables (bench/variant_env.py).
"""
import argparse

import numpy as np

from sagecupy import bench, nvfp4, qat
from variant_env import set_variant


def _bits(x):
    return np.asarray(getattr(x, "bits", x).get())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--d", type=int, default=64)
    ap.add_argument("--n", default="4096,16384")
    ap.add_argument("--defines", default=";SAGE_FP4_MIN_CTAS=1,SAGE_QAT_FWD_MIN_CTAS=1,SAGE_QAT_BWD_KV_MIN_CTAS=1")
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args()
    for n in map(int, a.n.split(",")):
        B, H, (q, k, v, do) = bench._inputs(a.d, n, "bfloat16")
        ops = nvfp4.quantize_inputs(q, k, v)
        for causal in (False, True):
            out = {}
            for rnd in range(a.rounds):  # variants interleaved, the best of the rounds kept (cross-build noise)
                for dfn in a.defines.split(";"):
                    set_variant(dfn)
                    fp4 = lambda: nvfp4.attention_packed(ops, causal=causal, out_dtype="bfloat16")  # noqa: E731
                    o, res = qat.forward(q, k, v, causal=causal)
                    t = dict(nvfp4=bench.time_ms(fp4),
                             qat_fwd=bench.time_ms(lambda: qat.forward(q, k, v, causal=causal)),
                             qat_bwd=bench.time_ms(lambda: qat.backward(res, do)))
                    if rnd == 0:
                        res_bits = [_bits(fp4()), _bits(o)] + [_bits(g) for g in qat.backward(res, do)]
                        out[dfn] = (t, res_bits)
                    else:
                        out[dfn] = ({k: min(v, t[k]) for k, v in out[dfn][0].items()}, out[dfn][1])
            base_t, base_b = out[a.defines.split(";")[0]]
            for dfn, (t, b) in out.items():
                same = all(np.array_equal(x, y) for x, y in zip(b, base_b))
                print(f"D={a.d} N={n:5d} causal={int(causal)} [{dfn or 'default'}] "
                      + " ".join(f"{k} {v:.3f} ms ({base_t[k] / v:.2f}x)" for k, v in t.items())
                      + ("" if same else " OUTPUTS DIFFER"), flush=True)
    set_variant(None)


if __name__ == "__main__":
    main()
