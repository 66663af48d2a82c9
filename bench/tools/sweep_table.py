"""README table of speed against N (1K…32K) from one full sweep's JSON lines (`python3 bench/run_bench.py --families
int8,nvfp4,qat --out full.jsonl`): every ratio is end to end against SDPA flash in the same file; the INT8 columns
also give the back-to-back ratio.

    python bench/tools/sweep_table.py full.jsonl
"""
import sys

from fp4_table import load, pick


def ratio(rows, impl, mode, scope, t, **cfg):
    mine = pick(rows, impl=impl, mode=mode, scope=scope, **cfg, **t)
    base = pick(rows, impl="sdpa-flash", mode=mode, scope=scope, **t)
    return f"{base['ms'] / mine['ms']:.2f}" if mine and base else "–"


def main():
    rows = load(sys.argv[1])
    ns = sorted({r["N"] for r in rows if r.get("impl") == "sagecupy-int8"})
    print("| D | causal | N | INT8 fwd × flash, e2e / b2b | INT8 fwd+bwd × flash, e2e / b2b | NVFP4 fwd × flash "
          "| QAT fwd+bwd × flash |")
    print("|---:|:---:|---:|---:|---:|---:|---:|")
    for D in (64, 128):
        for c in (False, True):
            for N in ns:
                t = dict(D=D, N=N, causal=c)
                i8 = dict(config="default")
                fwd = " / ".join(ratio(rows, "sagecupy-int8", "fwd", sc, t, **i8) for sc in ("e2e", "e2e-b2b"))
                fb = " / ".join(ratio(rows, "sagecupy-int8", "fwdbwd", sc, t, **i8) for sc in ("e2e", "e2e-b2b"))
                nv = ratio(rows, "sagecupy-nvfp4", "fwd", "e2e", t)
                qa = ratio(rows, "sagecupy-qat", "fwdbwd", "e2e", t)
                print(f"| {D} | {'yes' if c else 'no'} | {N // 1024}K | {fwd} | {fb} | {nv} | {qa} |")


if __name__ == "__main__":
    main()
