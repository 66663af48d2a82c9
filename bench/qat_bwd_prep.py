"""Time the QAT backward's passes before its two kernels (delta; the operands are the forward's residuals as they are) one by one, beside the
kernels, at the benchmark's D = 128, N = 4K shape (bf16): where the backward's end-to-end time goes.
    python bench/qat_bwd_prep.py [--n 4096] [--dtype bfloat16]"""
import argparse

import cupy

from sagecupy import _qat_bwd, bench, qat
from sagecupy.int8 import _prepare


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=4096)
    ap.add_argument("--dtype", default="bfloat16")
    a = ap.parse_args()
    B, H, (q, k, v, do) = bench._inputs(128, a.n, a.dtype)
    _, res = qat.forward(q, k, v)
    rows = {
        "backward e2e (wgmma)": lambda: qat.backward(res, do, engine="wgmma"),
        "kernels only (wgmma)": _qat_bwd._kernels_only(res, do, "wgmma"),
        "operands (delta)": lambda: _qat_bwd._operands(res, _prepare(bench_do(do), "do", "HND", True), "wgmma"),
        "forward e2e (wgmma)": lambda: qat.forward(q, k, v, engine="wgmma"),
        "fake_quantize q": lambda: qat.fake_quantize(q, n_pad=res.q_t.shape[2]),
        "fake_quantize v": lambda: qat.fake_quantize(v, along="tokens", n_pad=res.k_t.shape[2]),
    }
    for name, fn in rows.items():
        print(f"{name:<34} {bench.time_ms(fn, 3, 20):8.3f} ms")
    cupy.cuda.Device().synchronize()


def bench_do(do):
    from sagecupy import _checks

    return _checks.as_cupy(do, "do")


if __name__ == "__main__":
    main()
