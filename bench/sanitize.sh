#!/usr/bin/env bash
# compute-sanitizer over every family's kernels (bench/tools/sanitize_driver.py: forward and backward once per
# family, config and engine, on small odd shapes): memcheck (out-of-bounds and misaligned accesses), racecheck
# (shared-memory hazards), synccheck (barrier misuse) and initcheck (reads of device memory nothing wrote). Prints one
# line per tool ("memcheck: N errors", "racecheck: N hazards (E errors, W warnings)") and exits 1 if any tool found
# something, or did not finish; each tool's full report is in $OUT/sanitize_<tool>.log (or --out DIR; default
# /tmp/sagecupy_out). On the GPU machine, from the checkout:
#
#   bash bench/sanitize.sh [--tools memcheck,racecheck,synccheck,initcheck] [--timeout 240] [--out DIR]
#
# The driver runs once without a tool first: it compiles every kernel it launches (NVRTC), and CuPy's disk cache
# keeps them for the runs under the tools, which then spend their time in the kernels alone. --timeout cuts each
# tool's run (seconds; a cut run counts as a failure).
set -u -o pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/sagecupy_out}
tools=memcheck,racecheck,synccheck,initcheck; per_tool=240
while [ $# -gt 0 ]; do
  case $1 in
    --tools) tools=$2; shift 2 ;;
    --timeout) per_tool=$2; shift 2 ;;
    --out) OUT=$2; shift 2 ;;
    -h|--help) awk 'NR > 1 && !/^#/ {exit} NR > 1' "$0"; exit 0 ;;
    *) echo "sanitize.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
OUT=$(mkdir -p "$OUT" && cd "$OUT" && pwd)
# The checkout's package first (not an installed copy of another tree).
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
CS=$(command -v compute-sanitizer || true)
for c in "${CUDA_HOME:-/usr/local/cuda}/bin/compute-sanitizer" /usr/local/cuda/compute-sanitizer/compute-sanitizer; do
  [ -n "$CS" ] || { [ -x "$c" ] && CS=$c; }
done
[ -n "$CS" ] || { echo "sanitize.sh: compute-sanitizer not found (PATH, \$CUDA_HOME/bin, /usr/local/cuda)" >&2; exit 2; }

t0=$SECONDS
if ! python3 bench/tools/sanitize_driver.py >"$OUT/sanitize_warmup.log" 2>&1; then
  echo "the driver failed without a tool:"; tail -20 "$OUT/sanitize_warmup.log"; exit 1
fi
echo "warm-up (compiles): $((SECONDS - t0)) s, $(tail -1 "$OUT/sanitize_warmup.log")"

status=0
IFS=, read -r -a tool_list <<< "$tools"
for tool in "${tool_list[@]}"; do
  case $tool in memcheck|racecheck|synccheck|initcheck) ;; *) echo "sanitize.sh: unknown tool $tool" >&2; exit 2 ;; esac
  log="$OUT/sanitize_$tool.log"
  t1=$SECONDS
  timeout -k 10 "$per_tool" "$CS" --tool "$tool" --print-limit 50 python3 bench/tools/sanitize_driver.py >"$log" 2>&1
  rc=$?
  took=$((SECONDS - t1))
  errors=$(grep -oE "ERROR SUMMARY: [0-9]+ error" "$log" | tail -1 | grep -oE "[0-9]+")
  if [ "$tool" = racecheck ]; then
    line=$(grep -oE "RACECHECK SUMMARY: [0-9]+ hazards? displayed \([0-9]+ errors?, [0-9]+ warnings?\)" "$log" | tail -1)
    hazards=$(echo "$line" | grep -oE "[0-9]+ hazard" | grep -oE "[0-9]+")
    detail=$(echo "$line" | grep -oE "\(.*\)")
    if [ -z "$hazards" ] && [ "$errors" = 0 ]; then hazards=0; detail="(0 errors)"; fi
    result="${hazards:-?} hazards $detail"
    count=${hazards:-}
  else
    result="${errors:-?} errors"
    count=${errors:-}
  fi
  if [ "$rc" = 124 ]; then
    echo "$tool: cut at ${per_tool} s ($result so far)"; status=1
  elif [ -z "$count" ]; then
    echo "$tool: no summary (exit status $rc, ${took} s)"; tail -5 "$log"; status=1
  else
    echo "$tool: $result (${took} s)"
    if [ "$count" != 0 ] || [ "$rc" != 0 ]; then
      status=1
      grep -m 5 -E "^========= (Invalid|Program hit|Error|Race|Barrier|Uninitialized|.*hazard)" "$log"
      [ "$rc" != 0 ] && echo "  (exit status $rc)"
    fi
  fi
done
echo "total $((SECONDS - t0)) s; reports in $OUT/sanitize_*.log"
exit $status
