"""Forward kernel time of the INT8 variants that compute the same function (warps per CTA, engine, kernel
defines) or a near one (block_kv 64/128), in one process: which to make the default. On the GPU machine:

    python bench/fwd_variants.py                       # engines x warps x block_kv
    python bench/fwd_variants.py --defines "SAGE_FWD_PV_HALVES=0;"   # wgmma, 4 warps, default config, per define set

Defines of one variant are comma-separated, variants semicolon-separated ("" = the default build; SAGECUPY_* tokens
are environment variables: bench/variant_env.py); each row also prints the CTAs per SM the driver reports for that build.
"""
import argparse

from sagecupy import bench, int8
from sagecupy.config import BKV64, DEFAULT
from variant_env import set_variant


def engines_warps():
    for D, N in ((128, 4096), (128, 16384), (64, 16384)):
        B, H, (q, k, v, _) = bench._inputs(D, N, "bfloat16")
        for causal in (False, True):
            for cfg in (BKV64, DEFAULT):
                for engine in ("wgmma", "mma"):
                    p, c, pre = int8._preprocess_forward(q, k, v, causal=causal, sm_scale=None, layout="HND",
                                                         config=cfg, engine=engine)  # the engine's own operands
                    for warps in (4, 8):
                        ms = bench.time_ms(lambda: int8._launch_forward(p, c, pre, engine, warps), 3, 10)
                        tops = bench.flops(B, H, N, N, D, causal) / ms / 1e9
                        print(f"D={D:<4} N={N:<6} causal={causal!s:<5} block_kv={c.block_kv:<4} {engine:<6} "
                              f"warps={warps} {ms:7.3f} ms {tops:6.1f} TOPS", flush=True)


def occupancy(D, dtype="__nv_bfloat16", warps=4, bkv=DEFAULT.block_kv):
    import cupy

    from sagecupy._loader import get_function

    name = f"int8_attn_fwd_sm90<{dtype}, {D}, {warps}, {bkv}>"
    names = tuple(int8.kernel_names()["int8_attn_fwd_sm90.cu"])
    fn = get_function("int8_attn_fwd_sm90.cu", name, all_names=names, arch="sm_90a")
    smem = int8._fwd_smem(D, warps, bkv, int8._fwd90_stages(D, bkv))
    fn.max_dynamic_shared_size_bytes = smem
    ptr = fn.kernel.ptr if hasattr(fn, "kernel") else fn.ptr
    return cupy.cuda.driver.occupancyMaxActiveBlocksPerMultiprocessor(ptr, 32 * warps, smem), fn.num_regs


def defines(variants, ns=(4096, 16384), D=128, rounds=2):
    """Each variant timed ``rounds`` times, interleaved (A B A B), best kept; the pre-pass is rerun per variant (a
    define may change what it writes). Prints bitwise equality with the first variant, else the largest
    |difference| of O (bf16) relative to max |O|."""
    import numpy as np

    from sagecupy.bench import _inputs

    for N in ns:
        B, H, (q, k, v, _) = _inputs(D, N, "bfloat16")
        for causal in (False, True):
            best = {}
            outs = {}
            for _ in range(rounds):
                for dfn in variants:
                    set_variant(dfn)
                    p, c, pre = int8._preprocess_forward(q, k, v, causal=causal, sm_scale=None, layout="HND",
                                                         config=DEFAULT)
                    ms = bench.time_ms(lambda: int8._launch_forward(p, c, pre, "wgmma", 4), 3, 10)
                    best[dfn] = min(ms, best.get(dfn, ms))
                    if dfn not in outs:
                        bits = np.asarray(int8._launch_forward(p, c, pre, "wgmma", 4)[0].get())  # raw bf16 bits
                        outs[dfn] = (bits, (bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64))
                        outs[dfn] += occupancy(D)  # under this variant's defines
            set_variant(None)
            line = f"D={D} N={N:<6} causal={causal!s:<5}"
            ref = outs[variants[0]]
            for dfn in variants:
                bits, of, ctas, regs = outs[dfn]
                if dfn == variants[0]:
                    same = ""
                elif np.array_equal(bits, ref[0]):
                    same = " ="
                else:
                    same = f" diff {np.max(np.abs(of - ref[1])) / max(np.max(np.abs(ref[1])), 1e-30):.1e}"
                ms = best[dfn]
                line += (f" | [{dfn or 'default'}] {ms:.3f} ms {bench.flops(B, H, N, N, D, causal) / ms / 1e9:.0f} TOPS"
                         f" {ctas} CTA/SM {regs} regs{same}")
            print(line, flush=True)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--defines", default=None)
    ap.add_argument("--d", type=int, default=128)
    a = ap.parse_args()
    if a.defines is None:
        engines_warps()
    else:
        defines(a.defines.split(";"), D=a.d)
