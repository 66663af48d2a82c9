#!/usr/bin/env bash
# One device call: ncu SASS-level counts and stall samples of the INT8 kernels matching a regex, launched by
# bench/profile_int8.py (D = 128, N = 4096, B = 4, H = 16), written to $OUT; prints the per-opcode summary
# (bench/tools/sass_stats.py), dumps each kernel's SASS with executed counts (bench/tools/sass_dump.py) and its regions
# (bench/tools/sass_regions.py; PER=warps x tiles gives instructions per warp and tile). SECTIONS="--section X ..."
# adds ncu sections (e.g. MemoryWorkloadAnalysis for L2 hit rates and DRAM bytes).
#   KREGEX="int8_attn_fwd_sm90" SKIP=1 COUNT=1 bash bench/profile_sass.sh
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/sagecupy_out}; mkdir -p "$OUT"
KREGEX=${KREGEX:-int8_attn_fwd_sm90}; SKIP=${SKIP:-1}; COUNT=${COUNT:-1}; SCRIPT=${SCRIPT:-bench/profile_int8.py}
TAG=${TAG:-prof}
python3 -m pip install -e . --no-deps --no-build-isolation -q >/tmp/pip.log 2>&1 || { tail /tmp/pip.log; exit 1; }
NCU=/usr/local/cuda/bin/ncu
$NCU --clock-control none --kernel-name regex:"$KREGEX" --launch-skip "$SKIP" --launch-count "$COUNT" \
  --section SpeedOfLight --section ComputeWorkloadAnalysis --section WarpStateStats --section InstructionStats \
  --section SourceCounters --section Occupancy ${SECTIONS:-} -o "$OUT/$TAG" python3 "$SCRIPT" >"$OUT/ncu_$TAG.log" 2>&1 \
  || tail -5 "$OUT/ncu_$TAG.log"
$NCU --import "$OUT/$TAG.ncu-rep" --page details >"$OUT/details_$TAG.txt" 2>&1
$NCU --import "$OUT/$TAG.ncu-rep" --page source --csv --print-source sass >"$OUT/sass_$TAG.csv" 2>&1
rm -f "$OUT/$TAG.ncu-rep"
(cd bench/tools && python3 sass_stats.py "$OUT/sass_$TAG.csv" --top 12 && \
  for k in ${DUMP:-int8_attn_fwd_sm90}; do python3 sass_dump.py "$OUT/sass_$TAG.csv" --kernel "$k" > "$OUT/sass_${TAG}_$(echo "$k" | tr -c "A-Za-z0-9_\n" _).txt";
    echo "== regions of $k (instructions / ${PER:-1})"; python3 sass_regions.py "$OUT/sass_$TAG.csv" --kernel "$k" --per "${PER:-1}" --min-share 2; done)
gzip -f "$OUT/sass_$TAG.csv"
grep -E "^  [a-z_0-9]+|Duration|Issue Slots|Issued Ipc|highest-utilized|Warp Cycles Per Issued" "$OUT/details_$TAG.txt"
