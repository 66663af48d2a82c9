"""The INT8 backward with 128-query dK/dV groups (``bwd_block_q=128``, the two-warpgroup dK/dV kernel) against the
default 64-query groups, in one process on the GPU: per shape the whole backward call and the dK/dV kernel alone
(after the pre-pass), back to back (bench.time_ms_b2b), interleaved over rounds, the best of each kept; ratios > 1
mean the 128-query groups are faster. Also the relative L2 between the two configs' gradients (different groups
quantize differently: a few 1e-3, not 0).

    python3 bench/tools/bwd_groups_ab.py [--ds 64,128] [--ns 4096,16384] [--causal 0,1] [--dtype bfloat16]

Shapes are the benchmark's: batch x N = 16K tokens, heads x D = 2048.
"""
import argparse


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ds", default="64,128")
    ap.add_argument("--ns", default="4096,16384")
    ap.add_argument("--causal", default="0,1")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16"))
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    import cupy

    import sagecupy.int8 as s8
    from sagecupy._bench_common import _inputs, time_ms_b2b
    from sagecupy.adapters.bf16 import to_float32
    from sagecupy.config import DEFAULT

    cfgs = {"q64": DEFAULT, "q128": DEFAULT.replace(name="q128", bwd_block_q=128)}
    print(f"# {cupy.cuda.runtime.getDeviceProperties(0)['name'].decode()}, {a.dtype}, back to back, best of "
          f"{a.rounds} rounds; ratio = q64 ms / q128 ms")
    print(f"{'D':>4} {'N':>6} {'causal':>6} | {'bwd q64':>8} {'bwd q128':>8} {'ratio':>6} | {'dkdv q64':>8} "
          f"{'dkdv q128':>9} {'ratio':>6} | rel-L2 dQ dK dV (q128 vs q64)")
    for D in map(int, a.ds.split(",")):
        for N in map(int, a.ns.split(",")):
            for causal in map(int, a.causal.split(",")):
                B, H, (q, k, v, do) = _inputs(D, N, a.dtype)
                res = {n: s8.forward(q, k, v, causal=bool(causal), config=c)[1] for n, c in cfgs.items()}
                grads = {n: [g.astype(cupy.float32) if a.dtype == "float16" else to_float32(g)
                             for g in s8.backward(res[n], do)] for n in cfgs}
                pre = {n: s8._preprocess_backward(res[n], do) for n in cfgs}
                best = {}
                for _ in range(a.rounds):
                    for n in cfgs:
                        t_b = time_ms_b2b(lambda: s8.backward(res[n], do))
                        t_k = time_ms_b2b(lambda: s8._launch_backward(res[n], pre[n], kernels=("dkdv",)))
                        b0, k0 = best.get(n, (1e9, 1e9))
                        best[n] = (min(b0, t_b), min(k0, t_k))
                errs = []
                for g1, g0 in zip(grads["q128"], grads["q64"]):
                    g1, g0 = (cupy.asarray(x, dtype=cupy.float64) for x in (g1, g0))
                    errs.append(float(cupy.linalg.norm(g1 - g0) / cupy.linalg.norm(g0)))
                (b64, k64), (b128, k128) = best["q64"], best["q128"]
                print(f"{D:>4} {N:>6} {causal:>6} | {b64:8.3f} {b128:8.3f} {b64 / b128:6.3f} | {k64:8.3f} {k128:9.3f} "
                      f"{k64 / k128:6.3f} | " + " ".join(f"{e:.2e}" for e in errs), flush=True)


if __name__ == "__main__":
    main()
