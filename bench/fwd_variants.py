"""Forward kernel time of the INT8 variants that compute the same function (warps per CTA, engine) or a
near one (block_kv 64/128), in one process: which to make the default. On the GPU machine:

    python bench/fwd_variants.py
"""
from sagecupy import bench, int8
from sagecupy.config import BKV128, DEFAULT

for D, N in ((128, 4096), (128, 16384), (64, 16384)):
    B, H, (q, k, v, _) = bench._inputs(D, N, "bfloat16")
    for causal in (False, True):
        for cfg in (DEFAULT, BKV128):
            p, c, pre = int8._preprocess_forward(q, k, v, causal=causal, sm_scale=None, layout="HND", config=cfg)
            for engine in ("wgmma", "mma"):
                for warps in (4, 8):
                    ms = bench.time_ms(lambda: int8._launch_forward(p, c, pre, engine, warps), 3, 10)
                    tops = bench.flops(B, H, N, N, D, causal) / ms / 1e9
                    print(f"D={D:<4} N={N:<6} causal={causal!s:<5} block_kv={c.block_kv:<4} {engine:<6} warps={warps} "
                          f"{ms:7.3f} ms {tops:6.1f} TOPS", flush=True)
