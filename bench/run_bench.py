"""Run the speed sweep and print a table with ratios to the baselines (SDPA, cuDNN FP8) from the same run.

    python bench/run_bench.py [--quick] [--memory] [--out FILE.jsonl] [--configs default,paper] [--families int8,nvfp4,qat]
        [--ds 128] [--ns 8192,32768] [--baselines sdpa,cudnn-fp8,flash] [--adapters [torch,jax]]
        [--dtype bfloat16|float16] [--packed [8,32]] [--windows [1024,4096]] [--varlen-baselines cudnn,sdpa-docs,...]
        [--no-dense] [--rounds 3]

(--adapters adds the INT8 rows through sagecupy.torch and sagecupy.jax, each with its ratio to the CuPy call in
the table's last column, `x cupy`.)

(--packed adds 16K tokens as S causal documents of seeded random lengths in one packed call; --windows the sweep's
shapes causal with window (W, 0); both with their own baselines and table, TFLOPS over the visible pairs; --no-dense
leaves the dense sweep out. bench/tools/varlen_table.py prints their ratios from --out's file.)

(`sagecupy bench` is the same with CLI conventions; this script also logs every row to stderr.)
"""
import argparse
import json
import sys

from sagecupy import bench
from sagecupy._env import environment


def select_cases(a, docs, windows):
    """The dense sweep's (D, N, causal) cases narrowed by --quick, --ds and --ns, and the packed (--packed: 16K tokens
    whatever --ns says) and window cases (--windows: on the sweep's N) for the same head dims."""
    cases = bench.default_cases(quick=a.quick)
    if a.ds:
        cases = [c for c in cases if c[0] in {int(x) for x in a.ds.split(",")}]
    if a.ns:
        cases = [c for c in cases if c[1] in {int(x) for x in a.ns.split(",")}]
    ds = sorted({int(x) for x in a.ds.split(",")} if a.ds else {c[0] for c in bench.default_cases()})
    ns = sorted({c[1] for c in cases})
    varlen = (bench.packed_cases(ds, docs) if docs else []) + (bench.window_cases(ds, ns, windows) if windows else [])
    return cases, varlen


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="N in {4K, 16K} only")
    ap.add_argument("--out", default=None)
    ap.add_argument("--configs", default="default")
    ap.add_argument("--families", default="int8,nvfp4,qat", help="kernel families to time: int8,nvfp4,qat")
    ap.add_argument("--rep", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=1,
                    help="run the whole sweep this many times, one round after another, and report each row's "
                         "median over the rounds (with its min and max in the JSON lines' merged form: "
                         "sagecupy._bench_common.median_rows) [default: 1]")
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
    ap.add_argument("--packed", nargs="?", const=",".join(map(str, bench.DEFAULT_PACKED)), default="",
                    help="also time packed batches: 16K tokens as S causal documents of random lengths (seeded, each "
                         ">= 64 tokens) in one call, for each S given, comma-separated; the flag alone means 8,32 "
                         "[default: none]")
    ap.add_argument("--windows", nargs="?", const=",".join(map(str, bench.DEFAULT_WINDOWS)), default="",
                    help="also time sliding windows: the sweep's shapes causal with window (W, 0), for each W given, "
                         "comma-separated; the flag alone means 1024,4096 [default: none]")
    ap.add_argument("--varlen-baselines", default=",".join(bench.DEFAULT_VARLEN_BASELINES),
                    help="baselines of the packed and window cases, comma-separated: cudnn (cuDNN's bf16 SDPA through "
                         "the cuDNN frontend, ragged THD / diagonal band), sdpa-docs (PyTorch SDPA once per "
                         "document), torch-varlen (torch.nn.attention.varlen), flex (FlexAttention, compiled); '' for "
                         "none. One that cannot run here is skipped with a line saying why")
    ap.add_argument("--no-dense", action="store_true", help="leave the dense sweep out (with --packed/--windows)")
    a = ap.parse_args(argv)
    if a.rounds < 1:
        ap.error(f"--rounds: a whole number >= 1 is needed, got {a.rounds}")
    try:
        baselines = bench.parse_baselines(a.baselines)
        adapters = bench.parse_adapters(a.adapters)
        varlen_baselines = bench.parse_varlen_baselines(a.varlen_baselines)
        docs = bench.parse_int_list(a.packed, "--packed")
        windows = bench.parse_int_list(a.windows, "--windows")
    except ValueError as exc:
        ap.error(str(exc))
    out = open(a.out, "w") if a.out else None
    if out:
        out.write(json.dumps(dict(type="env", **environment())) + "\n")
    cases, varlen_cases = select_cases(a, docs, windows)
    log = lambda r: print(json.dumps(r), file=sys.stderr)  # noqa: E731
    rows = []
    if not a.no_dense:
        rows += bench.run_suite(cases, configs=tuple(a.configs.split(",")), out=out,
                                baselines=baselines, adapters=adapters,
                                rep=a.rep, dtype=a.dtype, families=tuple(a.families.split(",")), log=log,
                                rounds=a.rounds)
    if varlen_cases:
        rows += bench.run_varlen_suite(varlen_cases, configs=tuple(a.configs.split(",")), out=out,
                                       baselines=varlen_baselines, rep=a.rep, dtype=a.dtype,
                                       families=tuple(a.families.split(",")), log=log, rounds=a.rounds)
    if a.memory:
        mem = bench.peak_memory(dtype=a.dtype)
        rows += mem
        if out:
            for r in mem:
                out.write(json.dumps(r) + "\n")
    print(bench.format_rows(rows))


if __name__ == "__main__":
    main()
