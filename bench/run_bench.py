"""Run the speed sweep and print a table with ratios to the baselines (SDPA, cuDNN FP8) from the same run.

    python bench/run_bench.py [--quick] [--memory] [--out FILE.jsonl] [--configs default,paper] [--families int8,nvfp4,qat]
        [--ds 128] [--ns 8192,32768] [--baselines sdpa,cudnn-fp8,flash] [--adapters [torch,jax]]
        [--dtype bfloat16|float16]

(--adapters adds the INT8 rows through sagecupy.torch and sagecupy.jax, each with its ratio to the CuPy call in
the table's last column, `x cupy`.)

(`sagecupy bench` is the same with CLI conventions; this script also logs every row to stderr.)
"""
import argparse
import json
import sys

from sagecupy import bench
from sagecupy._env import environment


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="N in {4K, 16K} only")
    ap.add_argument("--out", default=None)
    ap.add_argument("--configs", default="default")
    ap.add_argument("--families", default="int8,nvfp4,qat", help="kernel families to time: int8,nvfp4,qat")
    ap.add_argument("--rep", type=int, default=10)
    ap.add_argument("--memory", action="store_true", help="also measure peak memory of fwd+bwd at N=32K, D=128")
    ap.add_argument("--baselines", default=",".join(bench.DEFAULT_BASELINES),
                    help="baselines timed beside, comma-separated: sdpa (PyTorch's default SDPA, cuDNN bf16 on "
                         "Hopper), flash / cudnn (SDPA with that backend forced), cudnn-fp8 (cuDNN's FP8 attention "
                         "through the cuDNN frontend); '' for none. One that cannot run here is skipped with a line "
                         "saying why")
    ap.add_argument("--adapters", nargs="?", const=",".join(bench.ADAPTERS), default="",
                    help="also time the INT8 calls through the framework adapters, comma-separated: torch "
                         "(sagecupy.torch.sage_attention on PyTorch tensors), jax (sagecupy.jax.sage_attention in "
                         "jax.jit); the flag alone means torch,jax [default: none]. The table's 'x cupy' column is "
                         "the CuPy call's ms over the adapter's. One that cannot run here is skipped with a line "
                         "saying why")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16"),
                    help="input dtype of the sagecupy, adapter and SDPA rows (cuDNN FP8 casts from bfloat16) "
                         "[default: bfloat16]")
    ap.add_argument("--ds", default=None, help="head dims to keep (e.g. 128; default: all of the sweep's)")
    ap.add_argument("--ns", default=None, help="sequence lengths to keep (e.g. 8192,32768; default: all)")
    a = ap.parse_args(argv)
    try:
        baselines = bench.parse_baselines(a.baselines)
        adapters = bench.parse_adapters(a.adapters)
    except ValueError as exc:
        ap.error(str(exc))
    out = open(a.out, "w") if a.out else None
    if out:
        out.write(json.dumps(dict(type="env", **environment())) + "\n")
    cases = bench.default_cases(quick=a.quick)
    if a.ds:
        cases = [c for c in cases if c[0] in {int(x) for x in a.ds.split(",")}]
    if a.ns:
        cases = [c for c in cases if c[1] in {int(x) for x in a.ns.split(",")}]
    rows = bench.run_suite(cases, configs=tuple(a.configs.split(",")), out=out,
                           baselines=baselines, adapters=adapters,
                           rep=a.rep, dtype=a.dtype, families=tuple(a.families.split(",")), log=lambda r: print(json.dumps(r), file=sys.stderr))
    if a.memory:
        mem = bench.peak_memory(dtype=a.dtype)
        rows += mem
        if out:
            for r in mem:
                out.write(json.dumps(r) + "\n")
    print(bench.format_rows(rows))


if __name__ == "__main__":
    main()
