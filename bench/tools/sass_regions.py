"""Where a kernel's loop spends its instructions and stall samples, by region: the SASS of one kernel (an ncu source
export, see sass_stats.py, or a text dump from sass_dump.py) cut at every tensor-core issue or wait, barrier, mbarrier
operation and branch, with each region's instructions per unit (``--per``: e.g. warps x tiles), its share of the
kernel's stall samples and its most frequent opcodes (executed counts): a loop's costly stretch shows as one region
(the QAT backward's per-column fq(P) work was found so: 633 instructions per warp and tile, 58% of the samples).

    python bench/tools/sass_regions.py sass.csv.gz --kernel qat_attn_bwd_sm90 --per 2097152 [--min-share 0.5]
    python bench/tools/sass_regions.py sass_dump.txt --per 2097152
"""
import argparse
import collections
import re

from sass_stats import kernels, num

CUT = re.compile(r"HGMMA|BAR\.SYNC|WARPGROUP\.DEPBAR|SYNCS|BRA|EXIT")


def rows_of(path, kernel):
    """[(address, executed, samples, instruction text)] of the first kernel whose name contains ``kernel``."""
    if path.endswith((".csv", ".csv.gz")):
        for name, rows in kernels(path):
            if kernel is None or kernel in name:
                return [(r["Address"][-5:], num(r["Instructions Executed"]), num(r["Warp Stall Sampling (All Samples)"]),
                         r["Source"].strip()) for r in rows]
        raise SystemExit(f"no kernel matching {kernel!r} in {path}")
    out = []
    for line in open(path):
        f = line.split(None, 3)  # sass_dump.py's lines: address, executed / per, samples, instruction
        if len(f) == 4 and not line.startswith("=="):
            out.append((f[0], float(f[1]), float(f[2]), f[3].strip()))
    return out


def opcode(text):
    words = text.split()
    w = words[1] if words and words[0].startswith("@") and len(words) > 1 else (words[0] if words else "")
    return w.split(".")[0]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("path")
    ap.add_argument("--kernel", default=None, help="substring of the kernel name (first match; csv input)")
    ap.add_argument("--per", type=float, default=1.0, help="divide executed counts by this (e.g. warps x tiles)")
    ap.add_argument("--min-share", type=float, default=0.5, help="print regions with at least this %% of samples")
    ap.add_argument("--top", type=int, default=6, help="opcodes listed per region")
    a = ap.parse_args()
    rows = rows_of(a.path, a.kernel)
    total = sum(r[2] for r in rows) or 1.0
    start, ops, ins, smp = 0, collections.Counter(), 0.0, 0.0
    print(f"{'lines':>11} {'end':>6} {'instr/unit':>10} {'samples%':>8}  ends with / top opcodes")
    for i, (addr, ex, s, text) in enumerate(rows):
        ops[opcode(text)] += ex
        ins += ex
        smp += s
        if CUT.search(text) or i == len(rows) - 1:
            if 100 * smp / total >= a.min_share:
                top = ", ".join(f"{o} {c / a.per:.0f}" for o, c in ops.most_common(a.top) if c)
                print(f"{start:>5}-{i:<5} {addr:>6} {ins / a.per:10.1f} {100 * smp / total:8.1f}  {text[:40]} | {top}")
            start, ops, ins, smp = i + 1, collections.Counter(), 0.0, 0.0


if __name__ == "__main__":
    main()
