#!/usr/bin/env bash
# The one script to run on a fresh GPU machine: installs the checkout, runs the whole GPU test suite in parallel
# shards (bench/gpu_shards.sh), times the key benchmarks against run_bench.py's default baselines (PyTorch SDPA,
# cuDNN FP8, SDPA forced to flash) and prints a short table last. The whole call stays within --budget seconds
# (default 570), for machines that cut a command at 10 minutes. Logs and JSON lines go to $OUT (or --out DIR;
# default /tmp/sagecupy_out).
#
#   bash bench/gpu_check.sh [all|tests|fuzz|bench|targets|accuracy|examples] [options]
#
#   all        (the default) tests, then bench. Kernel compiles dominate a fresh machine's first run; if shards
#              are cut for time, run `tests` and `bench` as two calls on the same machine (CuPy's disk cache keeps
#              the compiled kernels between calls).
#   tests      the GPU suite: tests/gpu, or --files; --k EXPR selects tests as pytest -k does. `sagecupy warmup`
#              first compiles every kernel once, over all cores, into CuPy's disk cache (log $OUT/warmup.log), which
#              the shards then load from instead of each compiling what it meets. Then compute-sanitizer over
#              every family's kernels (bench/sanitize.sh: memcheck, racecheck, synccheck, initcheck; one line each),
#              when at least 60 s are left.
#   fuzz       the seeded fuzz run (bench/fuzz.sh --fuzz N per family, default 3400) in the time left.
#   bench      the benchmark over D 64/128, N 4K/16K, causal and not, peak memory at 32K (--full: N 1K...32K,
#              which may need more than one call's time: narrow --families);
#              the table is bench/tools/sweep_table.py's (× SDPA flash; `--vs sdpa` on $OUT/bench.jsonl gives
#              PyTorch's default SDPA), the run's every row in $OUT/bench_table.txt.
#   targets    the INT8 speed targets' sweep (D 64/128, N 4K...32K, causal and not, bf16) against PyTorch's default
#              SDPA and cuDNN FP8 (--wheels for its frontend), --rounds times; bench/tools/targets_table.py's table.
#   accuracy   the GPU σ-sweeps behind the README's accuracy tables (INT8 default and paper, NVFP4's four
#              configs, QAT) and the baselines' on the same inputs (bench/accuracy_baselines.py: cuDNN FP8,
#              PyTorch's SDPA), run side by side; a table of relative L2 errors.
#   examples   the training examples (examples/recall*.py, 300 steps each); loss curves as JSON in $OUT.
#
#   --families int8,nvfp4,qat   families benchmarked (default all three)
#   --configs default,paper     INT8 configs benchmarked (default: default)
#   --files "tests/gpu/a.py"    test files or ids (default tests/gpu)
#   --shards N                  parallel test processes (default 12)
#   --budget S                  seconds for the whole call (default 570)
#   --bench-time S              seconds kept for the benchmark in `all` (default 240)
#   --fuzz N                    fuzz cases per family for `fuzz` (default 3400)
#   --rounds R                  sweeps of `bench` and `targets`, each row's median kept (default 1)
#   --wheels DIR                install the wheels in DIR first (no index, no dependencies) into $OUT/site, on
#                               PYTHONPATH: e.g. nvidia-cudnn-frontend, for the cuDNN FP8 baseline on a machine
#                               without a package index
set -u -o pipefail
cd "$(dirname "$0")/.."
t0=$SECONDS
what=all
case ${1:-} in all|tests|fuzz|bench|targets|accuracy|examples) what=$1; shift ;; esac
OUT=${OUT:-/tmp/sagecupy_out}
kexpr=""; files="tests/gpu"; families="int8,nvfp4,qat"; configs="default"; shards=12; budget=570; bench_time=240; full=0; fuzz_n=3400
wheels=""; rounds=1
while [ $# -gt 0 ]; do
  case $1 in
    --k) kexpr=$2; shift 2 ;;
    --files) files=$2; shift 2 ;;
    --families) families=$2; shift 2 ;;
    --configs) configs=$2; shift 2 ;;
    --shards) shards=$2; shift 2 ;;
    --budget) budget=$2; shift 2 ;;
    --bench-time) bench_time=$2; shift 2 ;;
    --full) full=1; shift ;;
    --fuzz) fuzz_n=$2; shift 2 ;;
    --out) OUT=$2; shift 2 ;;
    --wheels) wheels=$2; shift 2 ;;
    --rounds) rounds=$2; shift 2 ;;
    -h|--help) awk 'NR > 1 && !/^#/ {exit} NR > 1' "$0"; exit 0 ;;
    *) echo "gpu_check.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
OUT=$(mkdir -p "$OUT" && cd "$OUT" && pwd)  # (absolute: the table tool runs from bench/tools)
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
left() { echo $((budget - (SECONDS - t0) - ${1:-0})); }  # seconds left, less a reserve

python3 -m pip install -e . --no-deps --no-build-isolation -q >"$OUT/pip.log" 2>&1 || { tail -20 "$OUT/pip.log"; exit 1; }
if [ -n "$wheels" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$OUT/site" "$wheels"/*.whl \
    >>"$OUT/pip.log" 2>&1 || { tail -20 "$OUT/pip.log"; exit 1; }
  export PYTHONPATH="$OUT/site${PYTHONPATH:+:$PYTHONPATH}"
fi
sagecupy info 2>&1 | grep -E "cupy|torch|gpu|cuda" | head -8

status=0
if [ "$what" = all ] || [ "$what" = tests ]; then
  reserve=15; [ "$what" = all ] && reserve=$bench_time
  echo "== warmup: sagecupy warmup --jobs $(nproc)"
  # at most half of what is left, so that a slow or hung compile cannot take the tests' time; running out of it is
  # not a failure (the shards compile what is missing), a compile error is
  w=$(( $(left $reserve) / 2 ))
  if [ "$w" -ge 30 ]; then
    timeout "$w" sagecupy warmup --jobs "$(nproc)" >"$OUT/warmup.log" 2>&1; rc=$?
    head -n -1 "$OUT/warmup.log" | grep -E "FAILED|^(Error|note|skipped)" | head -10; tail -1 "$OUT/warmup.log"
    if [ "$rc" = 124 ]; then echo "warmup: cut at $w s; the shards compile the rest"
    elif [ "$rc" != 0 ]; then status=1; fi
  else
    echo "warmup: skipped ($w s would be left for it)"
  fi
  echo "== GPU tests: $files${kexpr:+ -k \"$kexpr\"}, $shards shards, each cut at $(left $reserve) s"
  read -r -a file_args <<< "$files"
  bash bench/gpu_shards.sh --shards "$shards" --timeout "$(left $reserve)" --out "$OUT" ${kexpr:+--k "$kexpr"} \
    "${file_args[@]}" | tee "$OUT/tests_summary.txt"
  [ "${PIPESTATUS[0]}" = 0 ] || status=1
  if [ "$(left $reserve)" -ge 60 ]; then
    echo "== compute-sanitizer: bash bench/sanitize.sh"
    bash bench/sanitize.sh --timeout $(( $(left $reserve) / 5 )) --out "$OUT" | tee "$OUT/sanitize_summary.txt"
    [ "${PIPESTATUS[0]}" = 0 ] || status=1
  else
    echo "compute-sanitizer: skipped ($(left $reserve) s left; bash bench/sanitize.sh runs it alone)"
  fi
fi

if [ "$what" = fuzz ]; then
  bash bench/fuzz.sh "$fuzz_n" --budget "$(left 10)" --out "$OUT"; rc=$?
  # (124: the budget ran out, the cases that ran are reported above)
  [ "$rc" = 0 ] || [ "$rc" = 124 ] || status=1
  ! grep -q "^FAILED" "$OUT/fuzz.log" || status=1
fi

if [ "$what" = all ] || [ "$what" = bench ]; then
  quick=--quick; [ "$full" = 1 ] && quick=
  echo "== benchmark: python3 bench/run_bench.py $quick --memory --families $families --configs $configs" \
    "--rounds $rounds"
  timeout "$(left 10)" python3 bench/run_bench.py $quick --memory --families "$families" --configs "$configs" \
    --rounds "$rounds" --out "$OUT/bench.jsonl" >"$OUT/bench_table.txt" 2>"$OUT/bench.err"
  rc=$?
  if [ $rc != 0 ]; then echo "run_bench.py: exit status $rc (124: out of time)"; tail -5 "$OUT/bench.err"; status=1; fi
fi

if [ "$what" = targets ]; then
  echo "== targets: python3 bench/run_bench.py --families int8 --ds 128,64 --ns 4096,8192,16384,32768" \
    "--baselines sdpa,cudnn-fp8 --rounds $rounds"
  timeout "$(left 10)" python3 bench/run_bench.py --families int8 --ds 128,64 --ns 4096,8192,16384,32768 \
    --baselines sdpa,cudnn-fp8 --rounds "$rounds" --out "$OUT/targets.jsonl" >"$OUT/targets_rows.txt" \
    2>"$OUT/targets.err"
  rc=$?
  if [ $rc != 0 ]; then
    echo "run_bench.py: exit status $rc (124: out of time)"; tail -5 "$OUT/targets.err"; status=1
  fi
fi

if [ "$what" = accuracy ]; then
  runs=("int8 default" "int8 paper" "nvfp4 default" "nvfp4 single-level-p" "nvfp4 no-smoothing" "nvfp4 plain"
        "qat default")
  for r in "${runs[@]}"; do
    set -- $r
    timeout "$(left 10)" sagecupy accuracy --backend gpu --family "$1" --config "$2" --format json \
      --out "$OUT/acc_$1_$2.jsonl" 2>"$OUT/acc_$1_$2.err" &
  done
  # the baselines on the same inputs: cuDNN FP8 (needs nvidia-cudnn-frontend) and PyTorch's SDPA
  timeout "$(left 10)" python3 bench/accuracy_baselines.py --out "$OUT/acc_baselines.jsonl" \
    >"$OUT/acc_baselines.txt" 2>"$OUT/acc_baselines.err" &
  wait
fi

if [ "$what" = examples ]; then
  for ex in "recall.py --backend cupy" recall_torch.py recall_jax.py; do
    name=${ex%%.py*}
    echo "== python3 examples/$ex --steps 300"
    timeout "$(left 10)" python3 examples/$ex --steps 300 --out "$OUT/$name.json" 2>&1 | tail -4
    [ "${PIPESTATUS[0]}" = 0 ] || status=1
  done
fi

echo "== summary ($((SECONDS - t0)) s; files in $OUT)"
[ "$what" = all ] || [ "$what" = tests ] && grep "^# total" "$OUT/tests_summary.txt"
if [ "$what" = all ] || [ "$what" = bench ]; then
  [ -s "$OUT/bench.jsonl" ] && (cd bench/tools && python3 sweep_table.py "$OUT/bench.jsonl")
fi
if [ "$what" = targets ] && [ -s "$OUT/targets.jsonl" ]; then
  python3 bench/tools/targets_table.py "$OUT/targets.jsonl"
fi
if [ "$what" = accuracy ]; then
  python3 - "$OUT" <<'PY'
import glob, json, os, sys
print("| family config | σ | O rel_l2 | dQ rel_l2 | dK rel_l2 | dV rel_l2 |")
print("|---|---:|---:|---:|---:|---:|")
for path in sorted(glob.glob(os.path.join(sys.argv[1], "acc_*.jsonl"))):
    name = os.path.basename(path)[4:-6].replace("_", " ", 1)
    rows = [json.loads(l) for l in open(path) if l.strip()]
    by = {}
    for r in rows:  # acc_baselines.jsonl holds one sweep per baseline (its impl)
        if r.get("type") != "env" and "sigma" in r:
            who = r["impl"] if "impl" in r else name
            by.setdefault((who, r["sigma"]), {})[r["tensor"]] = r["rel_l2"]
    for (who, s), t in sorted(by.items()):
        print(f"| {who} | {s:g} | " + " | ".join(f"{t[x]:.4f}" if x in t else "–" for x in ("O", "dQ", "dK", "dV")) + " |")
PY
fi
exit $status
