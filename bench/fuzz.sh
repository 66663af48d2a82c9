#!/usr/bin/env bash
# Long fuzz runs on the GPU machine: N seeded cases per family (INT8, NVFP4, QAT; tests/gpu/test_fuzz.py, FUZZ_SEED
# there) over all CPU cores (pytest-xdist; the float64 references dominate), each case against its simulator and
# against exact attention. Prints the case count, the seed, the failures (each with the command that reruns it alone)
# and pytest's summary line; the full log is $OUT/fuzz.log (or --out DIR; default /tmp/sagecupy_out).
#
#   bash bench/fuzz.sh [N] [--workers W] [--budget S] [--out DIR]   # N per family, default 3400 (10,200 in all)
#
# --budget S interrupts the run after S seconds the way Ctrl-C does, so pytest still reports the cases that ran and
# the failures among them (a run killed outright prints neither). Cases run in order, INT8's first. A fresh machine
# ran 1.4-1.7 cases per second on 16 cores, each worker compiling every kernel variant it meets (the float64
# references take ~0.05 s per case and core).
set -u -o pipefail
cd "$(dirname "$0")/.."
n=3400; workers=auto; budget=0; OUT=${OUT:-/tmp/sagecupy_out}
while [ $# -gt 0 ]; do
  case $1 in
    --workers) workers=$2; shift 2 ;;
    --budget) budget=$2; shift 2 ;;
    --out) OUT=$2; shift 2 ;;
    -h|--help) awk 'NR > 1 && !/^#/ {exit} NR > 1' "$0"; exit 0 ;;
    [0-9]*) n=$1; shift ;;
    *) echo "fuzz.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
mkdir -p "$OUT"
seed=$(sed -n 's/^FUZZ_SEED = \([0-9]*\).*/\1/p' tests/gpu/test_fuzz.py)
echo "== fuzz: $n cases per family ($((3 * n)) in all), FUZZ_SEED=$seed, workers $workers"
t0=$SECONDS
cut=(); [ "$budget" -gt 0 ] && cut=(timeout -s INT "$budget")
"${cut[@]}" python3 -m pytest tests/gpu/test_fuzz.py -q -p no:cacheprovider -m "gpu or slow" --fuzz-cases "$n" --require-gpu \
  -n "$workers" -rf --tb=short >"$OUT/fuzz.log" 2>&1
rc=$?
grep -E "^FAILED|rerun:" "$OUT/fuzz.log" | head -40
tail -1 "$OUT/fuzz.log"
echo "== fuzz: $((SECONDS - t0)) s, exit $rc"
exit $rc
