#!/usr/bin/env bash
# The 4K experiments of the twenty-ninth session, queued for a device call (written when no GPU was lent):
# the warp-specialized kernel's idle-warpgroup skip (SAGE_FP4_WS_IDLE_SKIP) and Q / tile-0 load overlap
# (SAGE_FP4_WS_QOVL), the fused pre-pass (SAGECUPY_FP4_PREPASS=fused) and the persistent kernel
# (SAGECUPY_FP4_PERSIST=1). All default off until this runs.
#   bash bench/fp4_4k_run.sh time    # fp4_floor.py with every variant's kernel and whole call, the launch probe
#   bash bench/fp4_4k_run.sh tests   # the tests that exercise them (shards; the WS ones with both defines on)
# Files in $OUT: floor.txt, probe_split.txt, probe_fused.txt, tests_*.txt.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/sagecupy_out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
what=${1:-time}
if [ "$what" = time ]; then
  nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv,noheader
  (cd bench && timeout ${FLOOR_TIMEOUT:-420} python3 fp4_floor.py --shapes ${SHAPES:-4:4096,1:16384} --causal 0,1 \
    --diags 0 --e2e --extra "SAGE_FP4_WS_IDLE_SKIP=1;SAGE_FP4_WS_QOVL=1;SAGECUPY_FP4_PREPASS=fused;\
SAGECUPY_FP4_PERSIST=1;SAGECUPY_FP4_PERSIST=1,SAGE_FP4_WS_IDLE_SKIP=1;\
SAGE_FP4_WS_IDLE_SKIP=1,SAGE_FP4_WS_QOVL=1,SAGECUPY_FP4_PREPASS=fused;\
SAGECUPY_FP4_PERSIST=1,SAGE_FP4_WS_IDLE_SKIP=1,SAGECUPY_FP4_PREPASS=fused") 2>&1 | tee "$OUT/floor.txt"
  (cd bench && timeout 60 python3 fp4_prepass_probe.py) 2>&1 | tee "$OUT/probe_split.txt"
  (cd bench && SAGECUPY_FP4_PREPASS=fused timeout 60 python3 fp4_prepass_probe.py) 2>&1 | tee "$OUT/probe_fused.txt"
else
  SHARDS=${SHARDS:-6} TIMEOUT=${TIMEOUT:-250} bash bench/gpu_shards.sh tests/gpu/test_fp4_attn.py \
    tests/gpu/test_nvfp4_quant.py -k "fused_prepass or back_to_back or quant or persistent" 2>&1 \
    | tee "$OUT/tests_prepass.txt"
  SAGECUPY_DEFINES=SAGE_FP4_WS_IDLE_SKIP=1,SAGE_FP4_WS_QOVL=1 SHARDS=${SHARDS:-6} TIMEOUT=${TIMEOUT:-250} \
    bash bench/gpu_shards.sh tests/gpu/test_fp4_attn.py \
    -k "warp_specialized or back_to_back or nvfp4_vs_references or persistent" \
    2>&1 | tee "$OUT/tests_ws_defines.txt"
fi
