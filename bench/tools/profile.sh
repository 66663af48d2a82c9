#!/usr/bin/env bash
# An ncu profile of the kernels matching a regex, launched by any command, on the GPU machine: ncu's details page
# (speed of light, occupancy, warp stalls, instruction statistics), the SASS with each instruction's executed count
# and stall samples (the source page, gzipped CSV), then per matched kernel: the opcode summary
# (sass_stats.py), the SASS listing (sass_dump.py) and its regions between tensor-core issues, barriers and branches
# (sass_regions.py; --per warps x tiles gives instructions per warp and tile). Files in $OUT (or --out DIR).
#
#   bash bench/tools/profile.sh KERNEL_REGEX [--skip N] [--count N] [--per X] [--tag T] [--section S ...] \
#       -- COMMAND ...
#   bash bench/tools/profile.sh int8_attn_fwd_sm90 --skip 1 -- \
#       python3 bench/ab.py --calls int8_infer --ns 4096 --causal 0 --once
#
# --skip: launches of the matching kernels to pass over first (the first call of a signature compiles and records
# its launches; ab.py --once runs each call twice, so --skip 1 profiles the second). Clocks are not locked
# (--clock-control none): the kernels run at the clocks a benchmark sees.
set -u
cd "$(dirname "$0")/../.."
[ $# -ge 1 ] || { awk 'NR > 1 && !/^#/ {exit} NR > 1' "$0"; exit 2; }
kregex=$1; shift
OUT=${OUT:-/tmp/sagecupy_out}; skip=1; count=1; per=1; tag=prof; sections=()
while [ $# -gt 0 ]; do
  case $1 in
    --skip) skip=$2; shift 2 ;;
    --count) count=$2; shift 2 ;;
    --per) per=$2; shift 2 ;;
    --tag) tag=$2; shift 2 ;;
    --section) sections+=(--section "$2"); shift 2 ;;
    --out) OUT=$2; shift 2 ;;
    --) shift; break ;;
    *) echo "profile.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
[ $# -ge 1 ] || { echo "profile.sh: no command after --" >&2; exit 2; }
OUT=$(mkdir -p "$OUT" && cd "$OUT" && pwd)
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
NCU=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
"$NCU" --clock-control none --kernel-name regex:"$kregex" --launch-skip "$skip" --launch-count "$count" \
  --section SpeedOfLight --section ComputeWorkloadAnalysis --section WarpStateStats --section InstructionStats \
  --section SourceCounters --section Occupancy --section LaunchStats "${sections[@]}" -o "$OUT/$tag" "$@" \
  >"$OUT/ncu_$tag.log" 2>&1 || { tail -20 "$OUT/ncu_$tag.log"; exit 1; }
"$NCU" --import "$OUT/$tag.ncu-rep" --page details >"$OUT/details_$tag.txt" 2>&1
"$NCU" --import "$OUT/$tag.ncu-rep" --page source --csv --print-source sass >"$OUT/sass_$tag.csv" 2>&1
rm -f "$OUT/$tag.ncu-rep"  # (large; the two pages above hold what the tools read)
cd bench/tools
python3 sass_stats.py "$OUT/sass_$tag.csv" --per "$per" --top 12
python3 - "$OUT/sass_$tag.csv" <<'PY' | sort -u | while read -r k; do
import re, sys
from sass_stats import kernels
for name, _ in kernels(sys.argv[1]):  # e.g. "void int8_attn_fwd_sm90<__nv_bfloat16, 128, 4, 128, 16>(...)"
    m = re.search(r"(\w+)\s*[<(]", name)
    print(m.group(1) if m else name)
PY
  python3 sass_dump.py "$OUT/sass_$tag.csv" --kernel "$k" --per "$per" >"$OUT/sass_${tag}_$k.txt"
  echo "== regions of $k (instructions / $per)"
  python3 sass_regions.py "$OUT/sass_$tag.csv" --kernel "$k" --per "$per" --min-share 2
done
gzip -f "$OUT/sass_$tag.csv"
grep -E "^  [a-z_0-9]+|Duration|Issue Slots Busy|Issued Ipc|Registers Per|Achieved Occupancy|Warp Cycles Per Issued" \
  "$OUT/details_$tag.txt"
