"""O of the default (INT8 P.V) and of ``pv_int8=False`` (config ``pv16``) against exact attention (fp32 on the
GPU), the two LSEs compared, and a ``pv16`` forward+backward's gradients checked finite, over a few shapes, both
dtypes and head dims. On the GPU machine, from the repository root::

    python3 bench/tools/pv16_vs_exact.py
"""
import cupy as cp
import ml_dtypes
import numpy as np

from sagecupy import int8


def exact(q, k, v, causal):
    """fp32 attention with 1/sqrt(D) scaling, GQA by repetition, bottom-right causal mask: (O, LSE)."""
    q, k, v = (x.astype(cp.float32) for x in (q, k, v))
    g = q.shape[1] // k.shape[1]
    k, v = cp.repeat(k, g, axis=1), cp.repeat(v, g, axis=1)
    s = q @ k.transpose(0, 1, 3, 2) / np.sqrt(q.shape[-1])
    nq, nk = s.shape[-2:]
    if causal:
        i, j = cp.arange(nq)[:, None], cp.arange(nk)[None, :]
        s = cp.where(j <= i + nk - nq, s, -cp.inf)
    m = s.max(-1, keepdims=True)
    p = cp.exp(s - m)
    l = p.sum(-1, keepdims=True)
    return (p / l) @ v, (m + cp.log(l))[..., 0]


def rel(a, b):
    return float(cp.linalg.norm((a.astype(cp.float32) - b).ravel()) / cp.linalg.norm(b.ravel()))


def main():
    rs = cp.random.RandomState(0)
    shapes = ((1, 8, 8, 4096, 4096, False, 1.0), (1, 8, 8, 4096, 4096, True, 3.0), (2, 8, 2, 1000, 1377, True, 1.0),
              (1, 4, 4, 129, 77, False, 5.0), (1, 4, 4, 300, 300, False, 1.0))
    for dt in ("float16", "bfloat16"):
        if dt == "float16":
            cast, conv = (lambda x: x.astype(cp.float16)), (lambda x: x)
        else:
            cast = lambda x: cp.asarray(cp.asnumpy(x).astype(ml_dtypes.bfloat16))  # noqa: E731
            conv = lambda x: cp.asarray(cp.asnumpy(x).astype(np.float32))  # noqa: E731
        for D in (128, 64):
            for B, Hq, Hkv, nq, nk, causal, sig in shapes:
                q = cast(rs.standard_normal((B, Hq, nq, D), dtype=cp.float32) * sig)
                k = cast(rs.standard_normal((B, Hkv, nk, D), dtype=cp.float32) * sig)
                v = cast(rs.standard_normal((B, Hkv, nk, D), dtype=cp.float32))
                oe, le = exact(conv(q), conv(k), conv(v), causal)
                o8, l8, _ = int8.forward(q, k, v, causal=causal, return_lse=True)
                o16, l16, r16 = int8.forward(q, k, v, causal=causal, config="pv16", return_lse=True)
                oi = int8.sage_attention(q, k, v, causal=causal, config="pv16")
                do = cast(rs.standard_normal(o8.shape, dtype=cp.float32))
                fin = all(bool(cp.isfinite(conv(g)).all()) for g in int8.backward(r16, do))
                print(f"{dt:8s} D={D} B={B} H={Hq}/{Hkv} {nq}x{nk} c={int(causal)} sig={sig}: O err default "
                      f"{rel(conv(o8), oe):.5f} pv16 {rel(conv(o16), oe):.5f}  infer==train "
                      f"{bool((conv(oi) == conv(o16)).all())}  lse max|d| {float(cp.abs(l16 - l8).max()):.2e} "
                      f"vs exact {float(cp.abs(l16 - le).max()):.2e}  grads finite {fin}", flush=True)


if __name__ == "__main__":
    main()
