#!/usr/bin/env bash
# One device call: ncu stall reasons (WarpStateStats), SASS-level sampling (SourceCounters) of the INT8
# kernels and the FP4 ones (PROFILE_FP4=0: INT8 only), written to $OUT. bash bench/profile_run.sh
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/sagecupy_out}; mkdir -p "$OUT"
NCU=/usr/local/cuda/bin/ncu
python3 -m pip install -e . --no-deps --no-build-isolation -q >/tmp/pip.log 2>&1 || { tail /tmp/pip.log; exit 1; }
export PYTHONUNBUFFERED=1
$NCU --clock-control none --kernel-name regex:"attn_" --launch-skip 4 --launch-count 4 \
  --section SpeedOfLight --section WarpStateStats --section SourceCounters --section Occupancy \
  -o "$OUT/int8" python3 bench/profile_int8.py >"$OUT/ncu_int8.log" 2>&1 || tail -20 "$OUT/ncu_int8.log"
$NCU --import "$OUT/int8.ncu-rep" --page details >"$OUT/int8_details.txt" 2>&1
$NCU --import "$OUT/int8.ncu-rep" --page source --csv --print-source sass >"$OUT/int8_sass.csv" 2>&1
gzip -f "$OUT/int8_sass.csv"
rm -f "$OUT/int8.ncu-rep"
# Pre-pass kernels: durations and DRAM throughput of one forward + backward's quantization work.
$NCU --clock-control none --kernel-name regex:"column|quant|rowdot|transpose" --launch-skip 0 --launch-count 14 \
  --section SpeedOfLight python3 bench/profile_int8.py 2>&1 | grep -E "^  [a-z_]|Duration|DRAM Throughput" \
  | sed -E 's/\(const .*//' >"$OUT/prepass.txt"
[ -n "${PROFILE_FP4:-1}" ] && [ "${PROFILE_FP4:-1}" != 0 ] || { ls -la "$OUT"; exit 0; }
$NCU --clock-control none --kernel-name regex:"attn" --launch-skip 5 --launch-count 5 \
  --section SpeedOfLight --section WarpStateStats --section SourceCounters \
  -o "$OUT/fp4" python3 bench/profile_fp4.py >"$OUT/ncu_fp4.log" 2>&1 || tail -20 "$OUT/ncu_fp4.log"
$NCU --import "$OUT/fp4.ncu-rep" --page details >"$OUT/fp4_details.txt" 2>&1
$NCU --import "$OUT/fp4.ncu-rep" --page source --csv --print-source sass >"$OUT/fp4_sass.csv" 2>&1
gzip -f "$OUT/fp4_sass.csv"
rm -f "$OUT"/*.ncu-rep
ls -la "$OUT"
grep -E "^  [a-z_0-9]+|Duration|Stall|stall" "$OUT/int8_details.txt" | head -60
