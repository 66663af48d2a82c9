#!/usr/bin/env bash
# Device time of every INT8 pre-pass kernel (ncu gpu__time_duration, clocks not locked), forward and backward at
# D / N, averaged over the driver's last two calls; with OLD=<kernels_cu dir> also for that tree (same process
# layout, SAGECUPY_KERNELS_DIR). On the GPU machine:
#     D=128 N=4096 OLD=$PWD/_ab_base/kernels_cu bash bench/prepass_kernels.sh
set -u
D=${D:-128}; N=${N:-4096}
NCU=/usr/local/cuda/bin/ncu
REGEX='regex:column|quant|image|transpose'
run() {  # $1: label; env SAGECUPY_KERNELS_DIR as set by the caller
  $NCU --clock-control none --kernel-name "$REGEX" --metrics gpu__time_duration.sum --csv --print-units base --page raw \
    python3 bench/ncu_prepass_driver.py "$D" "$N" 2>/dev/null | python3 -c '
import csv, sys, collections
rows = [r for r in csv.reader(sys.stdin) if len(r) > 5]
h = rows[0]; ki = h.index("Kernel Name"); ti = h.index("gpu__time_duration.sum")
t = collections.defaultdict(list)
for r in rows[2:]:
    t[r[ki].split("(")[0]].append(float(r[ti].replace(",", "")))
print("'"$1"'", " ".join(f"{k}={sum(v[-2:]) / len(v[-2:]) / 1e3:.1f}us" for k, v in t.items()),
      f"total={sum(sum(v[-2:]) / len(v[-2:]) for v in t.values()) / 1e3:.1f}us")'
}
run "tree D=$D N=$N:"
if [ -n "${OLD:-}" ]; then SAGECUPY_KERNELS_DIR=$OLD run "old  D=$D N=$N:"; fi
