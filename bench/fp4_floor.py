"""Where the NVFP4 wgmma forward's time goes, by taking one part out at a time (kernel diagnostics
``SAGE_FP4_DIAG``, wrong results): 1 no tensor-core products, 2 no softmax / P quantization, 3 no K/V
dequantization in the loop. Also the quantization pre-pass (``nvfp4.quantize_inputs``), the whole call
(``nvfp4.attention``) and SDPA's flash and cuDNN backends on the same shapes. Kernel times back to back (``bench.time_ms_b2b``), D = 128,
bf16, the benchmark's shapes unless ``--shapes B:N,...``. On the GPU machine:

    python bench/fp4_floor.py [--shapes 4:4096,1:16384,16:4096] [--diags 0,1,2,3] [--extra "SAGE_X=1;SAGECUPY_Y=0,SAGE_Z=2"]
                              [--e2e]

--e2e: each variant's whole call (``nvfp4.attention``, pre-pass included) too, for variants that change the pre-pass
(e.g. ``SAGECUPY_FP4_PREPASS=fused``); with it the kernel alone is still timed on the base variant's packed operands.

Variants are ';'-separated lists of ','-separated tokens: SAGECUPY_* set environment variables, the others kernel
defines. The diagnostics apply to the kernel chosen by default (``--base`` tokens are added to every variant).
"""
import argparse

import cupy

from sagecupy import _checks, bench, nvfp4
from variant_env import set_variant
from sagecupy.bf16 import BF16Array

ap = argparse.ArgumentParser()
ap.add_argument("--shapes", default="4:4096,1:16384")
ap.add_argument("--diags", default="0,1,2,3")
ap.add_argument("--extra", default="", help="';'-separated define sets timed as further variants (kernel defines)")
ap.add_argument("--causal", default="0,1")
ap.add_argument("--base", default="", help="tokens added to every variant (e.g. SAGECUPY_FP4_WS=0)")
ap.add_argument("--e2e", action="store_true", help="also time each variant's whole call (nvfp4.attention)")
a = ap.parse_args()
D, H = 128, 16
variants = [(f"diag{d}", f"SAGE_FP4_DIAG={d}" if d != "0" else "") for d in a.diags.split(",") if d]
variants += [(e, e.replace(" ", "")) for e in a.extra.split(";") if e]
variants = [(label, ",".join(x for x in (a.base, defs) if x)) for label, defs in variants]
for shp in a.shapes.split(","):
    B, N = (int(x) for x in shp.split(":"))
    rng = cupy.random.default_rng(0)
    q, k, v = (BF16Array.from_float(rng.standard_normal((B, H, N, D), dtype=cupy.float32)) for _ in range(3))
    set_variant(a.base)
    pre = bench.time_ms_b2b(lambda: nvfp4.quantize_inputs(q, k, v))
    ops = nvfp4.quantize_inputs(q, k, v)
    for causal in (c == "1" for c in a.causal.split(",")):
        fl = bench.flops(B, H, N, N, D, causal)
        set_variant(a.base)
        e2e = bench.time_ms_b2b(lambda: nvfp4.attention(q, k, v, causal=causal))
        w_base = _checks.raw(nvfp4.attention(q, k, v, causal=causal)).astype(cupy.float32)
        sdpa = {}
        for backend in ("FLASH_ATTENTION", "CUDNN_ATTENTION"):
            try:
                import torch
                import torch.nn.functional as F
                tq, tk, tv = (torch.randn(B, H, N, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
                with torch.nn.attention.sdpa_kernel(getattr(torch.nn.attention.SDPBackend, backend)):
                    fn = lambda: F.scaled_dot_product_attention(tq, tk, tv, is_causal=causal)  # noqa: E731
                    ev = torch.cuda.Event
                    sdpa[backend] = bench.time_ms_b2b(fn, event=lambda: ev(enable_timing=True),
                                                      sync=torch.cuda.synchronize)
            except Exception as exc:  # noqa: BLE001
                print(f"SDPA {backend} unavailable:", exc)
                sdpa[backend] = float("nan")
        flash, cudnn = sdpa["FLASH_ATTENTION"], sdpa["CUDNN_ATTENTION"]
        print(f"B={B} N={N} causal={causal!s:<5} pre-pass {pre:.3f} ms, nvfp4.attention {e2e:.3f} ms "
              f"({fl / e2e / 1e9:.0f} TFLOPS, {flash / e2e:.2f}x flash, {cudnn / e2e:.2f}x cuDNN), "
              f"flash {flash:.3f} ms ({fl / flash / 1e9:.0f}), cuDNN {cudnn:.3f} ms ({fl / cudnn / 1e9:.0f})",
              flush=True)
        ref = None
        for label, defs in variants:
            set_variant(defs)
            run = lambda: nvfp4.attention_packed(ops, causal=causal, out_dtype="bfloat16")  # noqa: E731
            try:
                got = _checks.raw(run()).astype(cupy.float32)
                ms = bench.time_ms_b2b(run)
            except Exception as exc:  # noqa: BLE001
                print(f"  {label:<24} failed: {type(exc).__name__}: {exc}"[:300], flush=True)
                continue
            if ref is None:
                ref, diff = got, ""
            elif bool((got == ref).all()):
                diff = "  O bitwise equal"
            else:
                diff = f"  O rel_l2 {float(cupy.linalg.norm(got - ref) / cupy.linalg.norm(ref)):.2e}"
            print(f"  {label:<24} kernel {ms:7.3f} ms {fl / ms / 1e9:6.0f} TFLOPS  (+pre-pass {ms + pre:.3f} ms: "
                  f"{flash / (ms + pre):.2f}x flash){diff}", flush=True)
            if a.e2e:
                whole = lambda: nvfp4.attention(q, k, v, causal=causal)  # noqa: E731
                w_got = _checks.raw(whole()).astype(cupy.float32)
                w_ms = bench.time_ms_b2b(whole)
                same = "O bitwise equal" if bool((w_got == w_base).all()) else "O differs from the base variant's"
                print(f"  {label:<24} whole call {w_ms:7.3f} ms: {flash / w_ms:.2f}x flash, {cudnn / w_ms:.2f}x "
                      f"cuDNN (base variant's {e2e:.3f} ms; {same})", flush=True)
set_variant(None)
