"""Summaries of an ncu SASS source export (``ncu --import R --page source --csv --print-source sass``, gzipped
or not): per kernel, instructions executed per opcode (per warp per `--tiles` unit if given), stall-reason
totals, and the instructions with the most stall samples.

    python bench/tools/sass_stats.py nv_sass.csv.gz [--per 131072] [--top 25]
"""
import argparse
import collections
import csv
import gzip
import io
import re


def kernels(path):
    raw = gzip.open(path, "rt") if path.endswith(".gz") else open(path)
    name, rows, header = None, [], None
    for line in raw:
        if line.startswith('"Kernel Name"'):
            if name:
                yield name, rows
            name, rows, header = next(csv.reader(io.StringIO(line)))[1], [], None
            continue
        rec = next(csv.reader(io.StringIO(line)))
        if header is None:
            header = rec
            continue
        rows.append(dict(zip(header, rec)))
    if name:
        yield name, rows


def num(x):
    try:
        return float(x)
    except ValueError:
        return 0.0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("path")
    ap.add_argument("--per", type=float, default=0, help="divide instruction counts by this (e.g. warps x tiles)")
    ap.add_argument("--top", type=int, default=25)
    a = ap.parse_args()
    for name, rows in kernels(a.path):
        print("==", name[:120])
        ops = collections.Counter()
        stalls = collections.Counter()
        for r in rows:
            op = re.sub(r"^\s*(@!?U?P\w+\s+)?", "", r["Source"]).split(" ")[0]
            ops[op.split(".")[0]] += num(r["Instructions Executed"])
            for k, v in r.items():
                if k.startswith("stall_") and "Not Issued" not in k:
                    stalls[k] += num(v)
        tot = sum(ops.values())
        div = a.per or 1
        print(f"instructions executed: {tot:.4g} ({tot / div:.1f} per unit)")
        print("  " + "  ".join(f"{o} {c / div:.1f}" for o, c in ops.most_common(30)))
        st = sum(stalls.values())
        print("stalls (% of samples): " + "  ".join(f"{k[6:]} {100 * v / st:.1f}" for k, v in stalls.most_common(12)))
        rows.sort(key=lambda r: -num(r["Warp Stall Sampling (All Samples)"]))
        samp = sum(num(r["Warp Stall Sampling (All Samples)"]) for r in rows)
        for r in rows[: a.top]:
            top = max(((k, num(v)) for k, v in r.items() if k.startswith("stall_") and "Not" not in k), key=lambda x: x[1])
            print(f"  {100 * num(r['Warp Stall Sampling (All Samples)']) / samp:5.2f}%  {r['Address'][-5:]} "
                  f"{r['Source'].strip()[:60]:<60} {top[0][6:]} excess_smem={r.get('L1 Wavefronts Shared Excessive', '-')}")


if __name__ == "__main__":
    main()
