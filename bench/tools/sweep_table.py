"""Table of speed against a baseline from one benchmark run's JSON lines (`python3 bench/run_bench.py [--quick]
--families int8,nvfp4,qat --out RUN.jsonl`): every ratio is the baseline's time over sagecupy's from the same file,
end to end, and for INT8 also back to back; a family or baseline the run did not time prints a dash. The peak-memory
rows, if the run has them, follow as one line. bench/gpu_check.sh prints this table last.

    python bench/tools/sweep_table.py RUN.jsonl [--vs flash|sdpa|cudnn|cudnn-fp8]   (default flash: SDPA's flash backend)
"""
import sys

from fp4_table import load, pick


# run_bench.py's --baselines names and the impl of their rows
BASE_IMPL = {"flash": "sdpa-flash", "sdpa": "sdpa-default", "cudnn": "sdpa-cudnn", "cudnn-fp8": "cudnn-fp8"}


def ratio(rows, impl, mode, scope, t, base_impl="sdpa-flash", **cfg):
    mine = pick(rows, impl=impl, mode=mode, scope=scope, **cfg, **t)
    base = pick(rows, impl=base_impl, mode=mode, scope=scope, **t)
    return f"{base['ms'] / mine['ms']:.2f}" if mine and base else "–"


def main():
    vs = sys.argv[sys.argv.index("--vs") + 1] if "--vs" in sys.argv else "flash"
    b = BASE_IMPL[vs]
    rows = load(sys.argv[1])
    rows = [r for r in rows if not r.get("case")]  # the packed and window rows: bench/tools/varlen_table.py
    ours = [r for r in rows if str(r.get("impl", "")).startswith("sagecupy-") and r.get("mode") != "peak_mem"]
    print(f"| D | causal | N | INT8 fwd × {vs}, e2e / b2b | INT8 fwd+bwd × {vs}, e2e / b2b | NVFP4 fwd × {vs} "
          f"| QAT fwd+bwd × {vs} |")
    print("|---:|:---:|---:|---:|---:|---:|---:|")
    for D in sorted({r["D"] for r in ours}):
        for c in (False, True):
            for N in sorted({r["N"] for r in ours if r["D"] == D}):
                t = dict(D=D, N=N, causal=c)
                i8 = dict(config="default")
                fwd = " / ".join(ratio(rows, "sagecupy-int8", "fwd", sc, t, b, **i8) for sc in ("e2e", "e2e-b2b"))
                fb = " / ".join(ratio(rows, "sagecupy-int8", "fwdbwd", sc, t, b, **i8) for sc in ("e2e", "e2e-b2b"))
                nv = ratio(rows, "sagecupy-nvfp4", "fwd", "e2e", t, b)
                qa = ratio(rows, "sagecupy-qat", "fwdbwd", "e2e", t, b)
                print(f"| {D} | {'yes' if c else 'no'} | {N // 1024}K | {fwd} | {fb} | {nv} | {qa} |")
    mem = [r for r in rows if r.get("mode") == "peak_mem" and "bytes" in r]
    if mem:
        r0 = mem[0]
        print(f"peak memory of one forward+backward, D={r0['D']} N={r0['N'] // 1024}K: "
              + ", ".join(f"{r['impl']} {r['bytes'] / 2**30:.2f} GiB" for r in mem))


if __name__ == "__main__":
    main()
