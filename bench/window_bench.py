"""INT8 sliding windows and packed sequences against the causal call, one process, back to back (GPU time per call).

At B = 1, H = 16, N = 16K, D = 128, fp16, the INT8 `default` config: the causal call, windows (4096, 0) and (1024, 0),
full attention; then the same 16K tokens as 8 documents of random lengths (at least 256 each), causal per document,
as one packed call (layout "THD", cu_seqlens) and as 8 dense calls one after another. Each row gives the forward
(inference call) and forward+backward ms and their ratio to the causal call's.

    python3 bench/window_bench.py
"""
import cupy as cp
import numpy as np
import sagecupy.int8 as s8
from sagecupy._bench_common import time_ms_b2b

B, H, N, D = 1, 16, 16384, 128
rng = cp.random.default_rng(0)
q, k, v, do = (rng.standard_normal((B, H, N, D), dtype=cp.float32).astype(cp.float16) for _ in range(4))


def fwdbwd(**kw):
    def f():
        o, lse, res = s8.forward(q, k, v, return_lse=True, **kw)
        s8.backward(res, do)
    return f


def fwd(**kw):
    return lambda: s8.sage_attention(q, k, v, **kw)


rows = []
for name, kw in (("causal", dict(causal=True)), ("window(4096,0)", dict(causal=True, window=(4096, 0))),
                 ("window(1024,0)", dict(causal=True, window=(1024, 0))), ("full", dict())):
    t_fb = time_ms_b2b(fwdbwd(**kw), warmup=2, calls=5, rounds=3)
    t_f = time_ms_b2b(fwd(**kw), warmup=2, calls=5, rounds=3)
    rows.append((name, t_f, t_fb))
# packed: 8 documents of random lengths summing to N, causal per document
lens = np.random.default_rng(1).multinomial(N - 8 * 256, [1 / 8] * 8) + 256
cu = cp.asarray(np.concatenate([[0], np.cumsum(lens)]).astype(np.int32))
qp, kp, vp, dop = (x[0].transpose(1, 0, 2).copy() for x in (q, k, v, do))  # (N, H, D)
pk = dict(layout="THD", cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=int(lens.max()), max_seqlen_k=int(lens.max()),
          causal=True)


def fwdbwd_p():
    o, lse, res = s8.forward(qp, kp, vp, return_lse=True, **pk)
    s8.backward(res, dop)


try:
    rows.append(("packed 8 docs", time_ms_b2b(lambda: s8.sage_attention(qp, kp, vp, **pk), warmup=2, calls=5, rounds=3),
                 time_ms_b2b(fwdbwd_p, warmup=2, calls=5, rounds=3)))
    # the same documents as separate dense calls, one after another
    offs = np.concatenate([[0], np.cumsum(lens)])
    docs = [(qp[a:b][None], kp[a:b][None], vp[a:b][None], dop[a:b][None]) for a, b in zip(offs[:-1], offs[1:])]

    def sep_fb():
        for dq_, dk_, dv_, ddo in docs:
            o, lse, res = s8.forward(dq_, dk_, dv_, return_lse=True, layout="NHD", causal=True)
            s8.backward(res, ddo)
    rows.append(("8 dense calls", time_ms_b2b(lambda: [s8.sage_attention(a, b, c, layout="NHD", causal=True)
                                                     for a, b, c, _ in docs], warmup=2, calls=5, rounds=3),
                 time_ms_b2b(sep_fb, warmup=2, calls=5, rounds=3)))
except Exception as e:  # noqa: BLE001
    print("packed timing failed:", type(e).__name__, e)
base_f, base_fb = rows[0][1], rows[0][2]
print(f"INT8 default, fp16, B={B} H={H} N={N} D={D}, b2b ms (x causal)")
for name, t_f, t_fb in rows:
    print(f"{name:16s} fwd {t_f:8.3f} ({t_f / base_f:.3f})  fwd+bwd {t_fb:8.3f} ({t_fb / base_fb:.3f})")
