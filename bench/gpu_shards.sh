#!/usr/bin/env bash
# The GPU tests of the given files (default tests/gpu) in parallel pytest processes on one GPU: most of the suite's
# time is kernel compiles, which run on the CPUs, so parallel shards shorten the run several times over. Each shard
# is cut at --timeout seconds, so the whole run ends within a known time. Prints one line per shard, a total, and
# the failures; logs in $OUT/shard_*.log. Exit status 1 if a test failed or errored, a shard was cut, or a file
# could not be collected.
#   bash bench/gpu_shards.sh [--shards 12] [--timeout 480] [--k EXPR] [--out DIR] [FILE_OR_TEST_ID ...]
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/sagecupy_out}
shards=12; timeout_s=480; kexpr=""; files=()
while [ $# -gt 0 ]; do
  case $1 in
    --shards) shards=$2; shift 2 ;;
    --timeout) timeout_s=$2; shift 2 ;;
    --k) kexpr=$2; shift 2 ;;
    --out) OUT=$2; shift 2 ;;
    -h|--help) awk 'NR > 1 && !/^#/ {exit} NR > 1' "$0"; exit 0 ;;
    *) files+=("$1"); shift ;;
  esac
done
[ ${#files[@]} -gt 0 ] || files=(tests/gpu)
mkdir -p "$OUT"
# The checkout's package first (not an installed copy of another tree); JAX must not take the GPU's memory up front
# while other shards run beside it.
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
# one BLAS thread per process: the shards already fill the cores, and OpenBLAS's default (a spinning thread per core in
# every process) made the float64 references ~6x slower with 2 processes on 2 cores (docs/experiments.md E-METH-BLAS)
export OPENBLAS_NUM_THREADS=${OPENBLAS_NUM_THREADS:-1} OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} MKL_NUM_THREADS=${MKL_NUM_THREADS:-1}
kargs=(); [ -n "$kexpr" ] && kargs=(-k "$kexpr")
ids=$(mktemp -d)
python3 -m pytest --require-gpu -q -p no:cacheprovider --collect-only "${kargs[@]}" "${files[@]}" >"$ids/collect.txt" 2>&1
grep "::" "$ids/collect.txt" > "$ids/all.txt"
total=$(wc -l < "$ids/all.txt")
echo "collected $total tests"
collect_status=0
# A file that fails to import lists none of its tests: say so instead of passing without them.
if grep -qiE "^ERROR|[0-9]+ errors? " "$ids/collect.txt" || [ "$total" = 0 ]; then
  grep -vF "::" "$ids/collect.txt" | tail -20; collect_status=1
  [ "$total" = 0 ] && exit 1
fi
# Round-robin over the collected order: the parameters of one test (the same kernels, compiled once per process)
# spread over the shards, so no shard gets a whole slow file.
pids=()
for i in $(seq 0 $((shards - 1))); do
  awk -v n="$shards" -v i="$i" 'NR % n == i' "$ids/all.txt" > "$ids/$i.txt"
  [ -s "$ids/$i.txt" ] || continue
  mapfile -t mine < "$ids/$i.txt"
  ( timeout "$timeout_s" python3 -m pytest --require-gpu -q -p no:cacheprovider "${mine[@]}" > "$OUT/shard_$i.log" 2>&1
    echo $? > "$ids/$i.rc" ) &
  pids+=($!)
done
wait "${pids[@]}"
status=$collect_status; cut=""
passed=0; failed=0; skipped=0; errors=0; xfailed=0; xpassed=0
for i in $(seq 0 $((shards - 1))); do
  [ -f "$ids/$i.rc" ] || continue
  rc=$(cat "$ids/$i.rc"); last=$(tail -1 "$OUT/shard_$i.log")
  if [ "$rc" = 124 ] || [ "$rc" = 137 ]; then cut="$cut $i"; last="cut at ${timeout_s} s, its tests not counted"; fi
  [ "$rc" = 0 ] || status=1
  echo "shard $i (rc $rc): $last"
  for kind in passed failed skipped error xfailed xpassed; do
    n=$(echo "$last" | grep -oE "(^|[^a-z])[0-9]+ $kind" | grep -oE "[0-9]+" || true)
    case $kind in passed) passed=$((passed + ${n:-0})) ;; failed) failed=$((failed + ${n:-0})) ;;
      skipped) skipped=$((skipped + ${n:-0})) ;; error) errors=$((errors + ${n:-0})) ;;
      xfailed) xfailed=$((xfailed + ${n:-0})) ;; xpassed) xpassed=$((xpassed + ${n:-0})) ;; esac
  done
done
left=$((total - passed - skipped - failed - errors - xfailed - xpassed))
echo "# total: $passed passed, $skipped skipped, $failed failed, $errors errors, $xfailed xfailed, $xpassed xpassed" \
  "of $total collected ($left not finished; shards cut:${cut:- none})"
[ "$left" = 0 ] || status=1
grep -hE "^(FAILED|ERROR)" "$OUT"/shard_*.log | head -30
rm -rf "$ids"
exit $status
