#!/usr/bin/env bash
# Long fuzz runs on the GPU machine: N seeded cases per family (INT8, NVFP4, QAT, INT8 with windows, INT8 packed; tests/gpu/test_fuzz.py, FUZZ_SEED
# there) over all CPU cores (pytest-xdist), each case against its simulator and against exact attention. Prints the
# case count, the seed, the failures (each with the command that reruns it alone) and pytest's summary line; the full
# log is $OUT/fuzz.log (or --out DIR; default /tmp/sagecupy_out).
#
#   bash bench/fuzz.sh [N] [--workers W] [--budget S] [--out DIR]   # N per family, default 3400 (17,000 in all)
#
# First `sagecupy warmup` compiles every kernel variant once, over all cores, into CuPy's disk cache, which the
# workers then load from instead of each compiling every variant it meets. Its log is $OUT/warmup.log. The workers run
# with one BLAS thread each: with OpenBLAS's default, 16 workers on an H100 machine's 16 cores ran 1.5 cases per second
# with every kernel already compiled, where the float64 references take ~0.08 s per case on one core
# (docs/experiments.md E-METH-BLAS).
# --budget S (seconds, the warm-up included) interrupts the run the way Ctrl-C does, so pytest still reports the
# cases that ran and the failures among them (a run killed outright prints neither). Cases run in order, INT8's first.
set -u -o pipefail
cd "$(dirname "$0")/.."
n=3400; workers=auto; budget=0; OUT=${OUT:-/tmp/sagecupy_out}
need() { [ $# -ge 2 ] || { echo "fuzz.sh: $1 needs a value" >&2; exit 2; }; }
while [ $# -gt 0 ]; do
  case $1 in
    --workers) need "$@"; workers=$2; shift 2 ;;
    --budget) need "$@"; budget=$2; shift 2 ;;
    --out) need "$@"; OUT=$2; shift 2 ;;
    -h|--help) awk 'NR > 1 && !/^#/ {exit} NR > 1' "$0"; exit 0 ;;
    *) if [[ $1 =~ ^[0-9]+$ ]] && [ "$1" -ge 1 ]; then n=$1; shift
       else echo "fuzz.sh: unknown argument $1 (N must be a positive integer; see --help)" >&2; exit 2; fi ;;
  esac
done
[[ $budget =~ ^[0-9]+$ ]] || { echo "fuzz.sh: --budget takes whole seconds, got $budget" >&2; exit 2; }
python3 -c "import xdist" 2>/dev/null || { echo "fuzz.sh: needs pytest-xdist (pip install pytest-xdist)" >&2; exit 2; }
mkdir -p "$OUT"
seed=$(sed -n 's/^FUZZ_SEED = \([0-9]*\).*/\1/p' tests/gpu/test_fuzz.py)
echo "== fuzz: $n cases per family ($((5 * n)) in all), FUZZ_SEED=$seed, workers $workers"
t0=$SECONDS
export PYTHONUNBUFFERED=1  # (a warm-up cut by timeout keeps its log)
# one BLAS thread per worker (the workers fill the cores; see gpu_shards.sh and docs/experiments.md E-METH-BLAS)
export OPENBLAS_NUM_THREADS=${OPENBLAS_NUM_THREADS:-1} OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} MKL_NUM_THREADS=${MKL_NUM_THREADS:-1}
wcmd=(python3 -m sagecupy warmup --jobs "$(nproc)")
# the warm-up gets at most half of a budget, so that the cases keep the rest
if [ "$budget" -gt 0 ]; then timeout "$(( budget / 2 > 1 ? budget / 2 : 1 ))" "${wcmd[@]}" >"$OUT/warmup.log" 2>&1
else "${wcmd[@]}" >"$OUT/warmup.log" 2>&1; fi
wrc=$?
head -n -1 "$OUT/warmup.log" | grep -E "FAILED|^(Error|note|skipped)" | head -10; tail -1 "$OUT/warmup.log"
[ "$wrc" = 0 ] || echo "warmup exit $wrc$([ "$wrc" = 124 ] && echo ' (out of time: the workers compile the rest)')"
if [ "$budget" -gt 0 ]; then budget=$((budget - (SECONDS - t0))); [ "$budget" -ge 1 ] || budget=1; fi
cmd=(python3 -m pytest tests/gpu/test_fuzz.py -q -p no:cacheprovider -m "gpu or slow" --fuzz-cases "$n" --require-gpu
     -n "$workers" -rf --tb=short)
if [ "$budget" -gt 0 ]; then timeout -s INT "$budget" "${cmd[@]}" >"$OUT/fuzz.log" 2>&1
else "${cmd[@]}" >"$OUT/fuzz.log" 2>&1; fi
rc=$?
grep -E "^FAILED|rerun:" "$OUT/fuzz.log" | head -40
tail -1 "$OUT/fuzz.log"
echo "== fuzz: $((SECONDS - t0)) s, exit $rc"
exit $rc
