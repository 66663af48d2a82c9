#!/usr/bin/env bash
# One device call: the NVFP4 attention call's launches one by one (bench/fp4_prepass_probe.py) and an ncu profile of
# its pre-pass kernels (speed of light, occupancy, launch statistics, memory, stall reasons, SASS counters) at
# D = 128, N = 4K, B = 4, H = 16, bf16. Files in $OUT: prepass_probe.txt, pp_details.txt, pp_sass.csv.gz.
#   bash bench/profile_prepass_fp4.sh
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/sagecupy_out}; mkdir -p "$OUT"
NCU=/usr/local/cuda/bin/ncu
python3 -m pip install -e . --no-deps --no-build-isolation -q >/tmp/pip.log 2>&1 || { tail /tmp/pip.log; exit 1; }
export PYTHONUNBUFFERED=1
(cd bench && timeout 120 python3 fp4_prepass_probe.py) 2>&1 | tee "$OUT/prepass_probe.txt"
cat > /tmp/pp_driver.py <<'PY'
from sagecupy import bench, nvfp4
import cupy
B, H, (q, k, v, _) = bench._inputs(128, 4096, "bfloat16")
for _ in range(2):
    nvfp4.attention(q, k, v)
cupy.cuda.Device().synchronize()
PY
$NCU --clock-control none --kernel-name regex:"column|nvfp4_quant" --launch-skip 5 --launch-count 5 \
  --section SpeedOfLight --section Occupancy --section LaunchStats --section MemoryWorkloadAnalysis \
  --section WarpStateStats --section SourceCounters --section InstructionStats \
  -o "$OUT/pp" python3 /tmp/pp_driver.py >"$OUT/ncu_pp.log" 2>&1 || tail -20 "$OUT/ncu_pp.log"
$NCU --import "$OUT/pp.ncu-rep" --page details >"$OUT/pp_details.txt" 2>&1
$NCU --import "$OUT/pp.ncu-rep" --page source --csv --print-source sass 2>&1 | gzip >"$OUT/pp_sass.csv.gz"
rm -f "$OUT"/*.ncu-rep
grep -E "^  [a-z_]+.*\(|Duration|DRAM Throughput|Memory Throughput|Issue Slots Busy|Registers Per|Achieved Occupancy|Theoretical Occupancy|Block Limit" "$OUT/pp_details.txt" | head -80
