"""Device time of the INT8 pre-passes (backward: delta, dO quantization, transposes or stage images; forward:
smoothing mean, Q/K/V quantization, qmk: the LSE's K-smoothing term) under kernel defines, calls issued back to back, with the codes compared bitwise
against the first variant's (the backward's delta, also inside the wgmma stage images, to fp32 rounding: its
summation order may differ). On the GPU
machine:

    python bench/prepass_variants.py --defines ";NAME=1"   # the default build against one with -DNAME=1

(SAGECUPY_* tokens of a variant are environment variables: bench/variant_env.py.)
"""
import argparse

import numpy as np

from sagecupy import bench, int8
from sagecupy.config import DEFAULT
from variant_env import set_variant


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--defines", default="")
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16"))
    ap.add_argument("--forward-only", action="store_true", help="skip the backward's pre-passes")
    ap.add_argument("--inference", action="store_true",
                    help="also time the inference forward's pre-pass (sage_attention's: no plain K codes / scales), its "
                         "outputs compared with the training pre-pass's of the first variant")
    a = ap.parse_args()
    variants = a.defines.split(";")
    for N in (4096, 16384):
        B, H, (q, k, v, do) = bench._inputs(a.d, N, a.dtype)
        _, res = int8.forward(q, k, v)
        line, ref = f"backward D={a.d} N={N:<6}", None
        for dfn in ([] if a.forward_only else variants):  # the backward's pre-passes: images bitwise, delta to fp32 rounding
            set_variant(dfn)
            ms = min(bench.time_ms_b2b(lambda: int8._preprocess_backward(res, do), 3, calls=20) for _ in range(2))
            pre = int8._preprocess_backward(res, do)
            got = [np.asarray(pre[n].get()) for n in ("q_img", "k_img", "do_t", "q_t", "k_t", "do_scale") if n in pre]
            if "q_img" in pre:  # the images hold delta too (BwdImg Q_DELTA): compared below to fp32 rounding
                got[0][..., 320 * a.d + 512:320 * a.d + 768] = 0
            dl = np.asarray(pre["delta"].get())
            if ref is None:
                same = ""
            else:
                img_same = all(np.array_equal(x, y) for x, y in zip(got, ref[0]))
                same = f" {'=' if img_same else 'DIFFERS'} delta max diff / max {np.max(np.abs(dl - ref[1])) / np.max(np.abs(ref[1])):.1e}"
            ref = (got, dl) if ref is None else ref
            line += f" | [{dfn or 'default'}] {ms * 1e3:.1f} us{same}"
        set_variant(None)
        if not a.forward_only:
            print(line, flush=True)
        ref = None
        for inference in ((False, True) if a.inference else (False,)):
            line = f"forward{'-infer' if inference else ''}  D={a.d} N={N:<6} {a.dtype}"
            for dfn in variants:
                set_variant(dfn)

                def prep():
                    return int8._preprocess_forward(q, k, v, causal=False, sm_scale=None, layout="HND", config=DEFAULT,
                                                    inference=inference)

                ms = min(bench.time_ms_b2b(prep, 3, calls=20) for _ in range(2))
                pre = prep()[2]
                names = ("q_codes", "q_scale", "k_codes", "k_scale", "v_t", "kv_img", "v_scale", "qmk")
                # (wgmma, 64-key tiles: V^T lives in the K/V images, no v_t; inference: no plain K codes / scales)
                got = {n: np.asarray(pre[n].get()) for n in names if pre[n] is not None}
                same = "" if ref is None else (" =" if all(np.array_equal(x, ref[n]) for n, x in got.items())
                                               else " DIFFERS")
                ref = got if ref is None else ref
                line += f" | [{dfn or 'default'}] {ms * 1e3:.1f} us{same}"
            set_variant(None)
            print(line, flush=True)


if __name__ == "__main__":
    main()
