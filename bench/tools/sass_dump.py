"""One kernel's SASS from an ncu source export (see sass_stats.py), one line per instruction with its executed
count and its stall samples, for reading a loop body:

    python bench/tools/sass_dump.py nv_sass.csv.gz --kernel int8_attn_fwd_sm90 [--per 1048576] > fwd.sass.txt
"""
import argparse

from sass_stats import kernels, num


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("path")
    ap.add_argument("--kernel", required=True, help="substring of the kernel name (first match)")
    ap.add_argument("--per", type=float, default=1.0)
    a = ap.parse_args()
    for name, rows in kernels(a.path):
        if a.kernel not in name:
            continue
        print("==", name[:160])
        for r in rows:
            print(f"{r['Address'][-5:]} {num(r['Instructions Executed']) / a.per:9.3f} "
                  f"{num(r['Warp Stall Sampling (All Samples)']):7.0f}  {r['Source'].strip()}")
        break


if __name__ == "__main__":
    main()
