"""The σ-sweep (docs/algorithms.md §7.1) of the baselines sagecupy is compared with: cuDNN's FP8 attention and
PyTorch's default SDPA in the inputs' dtype, on exactly the inputs `sagecupy accuracy` draws (same shape, σ, seed,
dtype rounding), relative L2 and cosine of O, dQ, dK, dV against float64 exact attention.

    python bench/accuracy_baselines.py [--n 4096] [--heads 8] [--sigmas 1,3,5,8,10] [--causal] [--out FILE.jsonl]

Needs torch and a CUDA device; cuDNN FP8 also needs `nvidia-cudnn-frontend` (skipped with a line saying why).
"""
import argparse
import json
import sys

import numpy as np


def _torch(x, dtype):
    import torch

    return torch.from_numpy(np.ascontiguousarray(x)).to("cuda").to(dtype)


def run_sdpa(inputs, causal, dtype):
    import torch.nn.functional as F

    q, k, v = (_torch(inputs[n], dtype).requires_grad_() for n in ("q", "k", "v"))
    o = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    o.backward(_torch(inputs["do"], dtype))
    return {"O": o, "dQ": q.grad, "dK": k.grad, "dV": v.grad}


def run_cudnn_fp8(inputs, causal, dtype):
    from sagecupy import _cudnn_fp8

    q, k, v, do = (_torch(inputs[n], dtype) for n in ("q", "k", "v", "do"))
    o, dq, dk, dv = _cudnn_fp8.cudnn_fp8_attention(q, k, v, do, causal=causal)
    return {"O": o, "dQ": dq, "dK": dk, "dV": dv}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=4096, help="sequence length (Nq = Nk)")
    ap.add_argument("--heads", type=int, default=8, help="heads (B = 1, D = 128)")
    ap.add_argument("--sigmas", default="1,3,5,8,10", help="comma-separated σ of Q and K")
    ap.add_argument("--dtype", default="fp16", choices=("fp16", "bf16"), help="the inputs' dtype")
    ap.add_argument("--causal", action="store_true", help="bottom-right causal mask (Nq = Nk: the same as top-left)")
    ap.add_argument("--out", default=None, help="write JSON lines here")
    a = ap.parse_args(argv)

    import torch

    from sagecupy import _cudnn_fp8, analysis
    from sagecupy.reference.attention import attention_intermediates
    from sagecupy.reference.metrics import compare

    tdtype = torch.float16 if a.dtype == "fp16" else torch.bfloat16
    shape = analysis.Shape(batch=1, heads=a.heads, n=a.n, d=128)
    impls = {"sdpa-default": run_sdpa}
    why = _cudnn_fp8.unavailable_reason()
    if why:
        print(f"cudnn-fp8: skipped ({why})", file=sys.stderr)
    else:
        impls["cudnn-fp8"] = run_cudnn_fp8
    rows = []
    for sigma in (float(s) for s in a.sigmas.split(",")):
        inputs = analysis.make_inputs(shape, sigma, 0, a.dtype)
        exact = attention_intermediates(inputs["q"], inputs["k"], inputs["v"], inputs["do"], causal=a.causal)
        for name, fn in impls.items():
            try:
                got = fn(inputs, a.causal, tdtype)
            except Exception as exc:  # a baseline that cannot run this case is reported, not fatal
                print(f"{name} sigma={sigma:g}: {type(exc).__name__}: {exc}", file=sys.stderr)
                continue
            for t in analysis.ACCURACY_TENSORS:
                m = compare(got[t].detach().float().cpu().numpy().astype(np.float64), exact[t])
                rows.append(dict(type="accuracy", impl=name, sigma=sigma, tensor=t, dtype=a.dtype, causal=a.causal,
                                 n=a.n, heads=a.heads, **m))
    if a.out:
        with open(a.out, "w") as fh:
            fh.writelines(json.dumps(r) + "\n" for r in rows)
    print(f"{'impl':<13} {'sigma':>5}  " + "  ".join(f"{t + ' rel_l2':>10}" for t in analysis.ACCURACY_TENSORS))
    for name in impls:
        for sigma in sorted({r["sigma"] for r in rows if r["impl"] == name}):
            vals = {r["tensor"]: r["rel_l2"] for r in rows if r["impl"] == name and r["sigma"] == sigma}
            print(f"{name:<13} {sigma:>5g}  " + "  ".join(f"{vals.get(t, float('nan')):>10.4f}"
                                                         for t in analysis.ACCURACY_TENSORS))


if __name__ == "__main__":
    main()
