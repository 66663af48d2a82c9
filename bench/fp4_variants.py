"""NVFP4 forward kernel time per variant (engine, CTA size, kernel defines), in one process, beside SDPA's flash
backend on the same shapes: which to make the default. Each variant's output is compared with the default's
(``bitwise`` or the relative L2 difference: the variants differ only in fp32 accumulation order). On the GPU machine:

    python bench/fp4_variants.py            # wgmma: the default, 12 warps with the O-frame rule, without ping-pong
    python bench/fp4_variants.py --all      # also the O-frame rule at 8 and 4 warps
    python bench/fp4_variants.py --mma      # also the mma.sync kernels
    python bench/fp4_variants.py --causal-group   # also the causal dispatch one head at a time and across 64
"""
import os
import sys

import cupy

from sagecupy import _checks, bench, nvfp4

# (label, engine, SAGECUPY_FP4_WARPS or None for the default, SAGECUPY_DEFINES)
VARIANTS = [
    ("default", "wgmma", None, ""),
    ("oframe-w12", "wgmma", "12", "SAGE_FP4_OFRAME=1"),
    ("oframe-w12-nopp", "wgmma", "12", "SAGE_FP4_OFRAME=1,SAGE_FP4_PINGPONG=0"),
]
if "--all" in sys.argv:  # (the ninth session measured these: O-frame rule at 8 warps 0.92x the default at D=128)
    VARIANTS += [("oframe-w8", "wgmma", "8", "SAGE_FP4_OFRAME=1"), ("oframe-w4", "wgmma", "4", "SAGE_FP4_OFRAME=1")]
if "--mma" in sys.argv:
    VARIANTS += [("mma-w8", "mma", "8", ""), ("mma-w4", "mma", "4", "")]
if "--causal-group" in sys.argv:  # causal grids heaviest first across G heads (nvfp4.FP4_CAUSAL_GROUP); O bitwise equal
    VARIANTS += [("causal-group1", "wgmma", None, "SAGECUPY_FP4_CAUSAL_GROUP=1"),
                 ("causal-group64", "wgmma", None, "SAGECUPY_FP4_CAUSAL_GROUP=64")]


def _set(warps, defines):
    """SAGECUPY_FP4_WARPS, and the defines: SAGECUPY_* tokens as environment variables, the others as kernel
    defines (SAGECUPY_DEFINES)."""
    toks = [t for t in defines.split(",") if t]
    env = dict(t.split("=", 1) for t in toks if t.startswith("SAGECUPY_"))
    kernel_defines = ",".join(t for t in toks if not t.startswith("SAGECUPY_"))
    os.environ.pop("SAGECUPY_FP4_CAUSAL_GROUP", None)
    os.environ.update(env)
    for key, val in (("SAGECUPY_FP4_WARPS", warps), ("SAGECUPY_DEFINES", kernel_defines)):
        if val:
            os.environ[key] = val
        else:
            os.environ.pop(key, None)


for D, N in ((128, 4096), (128, 16384), (64, 16384)):
    B, H, (q, k, v, _) = bench._inputs(D, N, "bfloat16")
    ops = nvfp4.quantize_inputs(q, k, v)
    for causal in (False, True):
        ref = None
        for label, engine, warps, defines in VARIANTS:
            _set(warps, defines)
            run = lambda: nvfp4.attention_packed(ops, causal=causal, out_dtype="bfloat16", engine=engine)  # noqa: E731
            try:
                got = _checks.raw(run()).astype(cupy.float32)
                ms = bench.time_ms(run, 3, 10)
            except Exception as exc:  # a variant that does not fit (shared memory, registers) or fails to compile
                print(f"D={D:<4} N={N:<6} causal={causal!s:<5} {label:<16} failed: {type(exc).__name__}: {exc}"[:300],
                      flush=True)
                continue
            if ref is None:
                ref, diff = got, "reference"
            elif bool((got == ref).all()):
                diff = "bitwise equal"
            else:
                diff = f"rel_l2 vs default {float(cupy.linalg.norm(got - ref) / cupy.linalg.norm(ref)):.2e}"
            tops = bench.flops(B, H, N, N, D, causal) / ms / 1e9
            print(f"D={D:<4} N={N:<6} causal={causal!s:<5} {label:<16} {ms:7.3f} ms {tops:6.1f} TOPS  {diff}",
                  flush=True)
        _set(None, "")
        try:
            r = bench.bench_sdpa(D, N, causal, "flash", modes=("fwd",))[0]
            print(f"D={D:<4} N={N:<6} causal={causal!s:<5} {'sdpa-flash':<16} {r['ms']:7.3f} ms {r['tops']:6.1f} TOPS",
                  flush=True)
        except Exception as exc:  # no torch
            print("sdpa-flash unavailable:", exc)
