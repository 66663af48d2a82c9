#!/usr/bin/env bash
# One device call: the NVFP4 forward variants (engine x CTA size, beside SDPA flash) and an ncu profile of the
# wgmma NVFP4 forward (speed of light, stall reasons, SASS-level counters) at D=128, N=4K, B=4, H=16.
#   bash bench/profile_nvfp4.sh        (files in $OUT: variants.txt, nv_details.txt, nv_sass.csv.gz)
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/sagecupy_out}; mkdir -p "$OUT"
NCU=/usr/local/cuda/bin/ncu
python3 -m pip install -e . --no-deps --no-build-isolation -q >/tmp/pip.log 2>&1 || { tail /tmp/pip.log; exit 1; }
export PYTHONUNBUFFERED=1
timeout 300 python3 bench/fp4_variants.py 2>&1 | tee "$OUT/variants.txt"
$NCU --clock-control none --kernel-name regex:"nvfp4_attn_fwd_sm90" --launch-skip 1 --launch-count 1 \
  --section SpeedOfLight --section WarpStateStats --section SourceCounters --section InstructionStats \
  --section Occupancy -o "$OUT/nv" python3 bench/profile_fp4.py >"$OUT/ncu_nv.log" 2>&1 || tail -20 "$OUT/ncu_nv.log"
$NCU --import "$OUT/nv.ncu-rep" --page details >"$OUT/nv_details.txt" 2>&1
$NCU --import "$OUT/nv.ncu-rep" --page source --csv --print-source sass 2>&1 | gzip >"$OUT/nv_sass.csv.gz"
rm -f "$OUT"/*.ncu-rep
grep -E "Duration|Issued Ipc|Warp Cycles Per Issued|Registers|Achieved Occupancy|Stall" "$OUT/nv_details.txt" | head -30
