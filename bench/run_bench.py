"""Run the speed sweep and print a table with ratios to SDPA (flash, cuDNN) from the same run.

    python bench/run_bench.py [--quick] [--out FILE.jsonl] [--configs default,paper]
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
    ap.add_argument("--rep", type=int, default=10)
    ap.add_argument("--memory", action="store_true", help="also measure peak memory of fwd+bwd at N=32K, D=128")
    ap.add_argument("--baselines", default="flash,cudnn", help="SDPA backends to time beside ('' for none)")
    a = ap.parse_args(argv)
    out = open(a.out, "w") if a.out else None
    if out:
        out.write(json.dumps(dict(type="env", **environment())) + "\n")
    rows = bench.run_suite(bench.default_cases(quick=a.quick), configs=tuple(a.configs.split(",")), out=out,
                           baselines=tuple(b for b in a.baselines.split(",") if b),
                           rep=a.rep, log=lambda r: print(json.dumps(r), file=sys.stderr))
    print_table(rows)
    if a.memory:
        for r in bench.peak_memory():
            if out:
                out.write(json.dumps(r) + "\n")
            print(f"peak memory fwd+bwd D={r['D']} N={r['N']} B={r['B']} H={r['H']}: {r['impl']:<14} "
                  f"{r['bytes'] / 2**30:.2f} GiB")


def print_table(rows):
    base = {(r["impl"], r["mode"], r["D"], r["N"], r["causal"]): r["ms"] for r in rows if "ms" in r}
    print(f"{'impl':<16}{'cfg':<9}{'mode':<8}{'scope':<8}{'D':>4}{'N':>7}{'causal':>7}{'ms':>9}{'TOPS':>8}"
          f"{'x flash':>9}{'x cudnn':>9}")
    for r in rows:
        if "ms" not in r:
            print(f"{r['impl']:<16} error D={r['D']} N={r['N']} causal={r['causal']}: {r.get('error')}")
            continue
        key = (r["mode"], r["D"], r["N"], r["causal"])
        fl, cu = base.get(("sdpa-flash",) + key), base.get(("sdpa-cudnn",) + key)
        rf = f"{fl / r['ms']:.2f}" if fl else "-"
        rc = f"{cu / r['ms']:.2f}" if cu else "-"
        print(f"{r['impl']:<16}{r.get('config', ''):<9}{r['mode']:<8}{r['scope']:<8}{r['D']:>4}{r['N']:>7}"
              f"{str(r['causal']):>7}{r['ms']:>9.3f}{r['tops']:>8.1f}{rf:>9}{rc:>9}")


if __name__ == "__main__":
    main()
