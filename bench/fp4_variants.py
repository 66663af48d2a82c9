"""NVFP4 forward kernel time per engine and CTA size (they compute the same function), in one process, beside
SDPA's flash backend on the same shapes: which to make the default. On the GPU machine:

    python bench/fp4_variants.py
"""
import os

from sagecupy import _checks, bench, nvfp4

for D, N in ((128, 4096), (128, 16384), (64, 16384)):
    B, H, (q, k, v, _) = bench._inputs(D, N, "bfloat16")
    ops = nvfp4.quantize_inputs(q, k, v)
    for causal in (False, True):
        for engine in ("wgmma", "mma"):
            for warps in ("4", "8"):
                os.environ["SAGECUPY_FP4_WARPS"] = warps
                ms = bench.time_ms(lambda: nvfp4.attention_packed(ops, causal=causal, out_dtype="bfloat16",
                                                                  engine=engine), 3, 10)
                tops = bench.flops(B, H, N, N, D, causal) / ms / 1e9
                print(f"D={D:<4} N={N:<6} causal={causal!s:<5} {engine:<6} warps={warps} {ms:7.3f} ms {tops:6.1f} TOPS",
                      flush=True)
        # Without the warpgroup ping-pong (kernels_cu/fp4_attn_fwd_sm90.cu, SAGE_FP4_PINGPONG; on by default for
        # 8 warps at D=128): same result bitwise.
        want = _checks.raw(nvfp4.attention_packed(ops, causal=causal, out_dtype="bfloat16", engine="wgmma"))
        os.environ["SAGECUPY_DEFINES"] = "SAGE_FP4_PINGPONG=0"
        got = _checks.raw(nvfp4.attention_packed(ops, causal=causal, out_dtype="bfloat16", engine="wgmma"))
        same = bool((got == want).all())
        ms = bench.time_ms(lambda: nvfp4.attention_packed(ops, causal=causal, out_dtype="bfloat16", engine="wgmma"), 3, 10)
        print(f"D={D:<4} N={N:<6} causal={causal!s:<5} wgmma  warps=8 no ping-pong {ms:7.3f} ms "
              f"{bench.flops(B, H, N, N, D, causal) / ms / 1e9:6.1f} TOPS  bitwise equal: {same}", flush=True)
        os.environ.pop("SAGECUPY_DEFINES")
        os.environ.pop("SAGECUPY_FP4_WARPS")
        try:
            r = bench.bench_sdpa(D, N, causal, "flash", modes=("fwd",))[0]
            print(f"D={D:<4} N={N:<6} causal={causal!s:<5} sdpa-flash      {r['ms']:7.3f} ms {r['tops']:6.1f} TOPS",
                  flush=True)
        except Exception as exc:  # no torch
            print("sdpa-flash unavailable:", exc)
