#!/usr/bin/env bash
# One call on the GPU machine: install, run the whole GPU test suite, run the key benchmarks,
# print a short table last. Logs go to $OUT (the device tool brings them back).
#   bash bench/gpu_check.sh [quick|full|all|tests|bench|examples|tests+examples]
#   quick: tests + N in {4K, 16K};  full: tests + N 1K..32K;  all: full + GPU accuracy sweeps (SPEC §7)
#   SAGECUPY_BENCH_FAMILIES=int8,nvfp4,qat (default: all) picks the kernel families timed;
#   SAGECUPY_TESTS="tests/gpu/x.py ..." narrows the test run (SAGECUPY_K="qat or poisoned": a pytest -k expression,
#   spaces allowed); SAGECUPY_ACCURACY=1 adds the INT8 σ-sweep to any mode
#   (SAGECUPY_ACC_CONFIGS="default paper" by default); SAGECUPY_BENCH_CONFIGS=default,bkv64 picks the INT8 configs timed.
set -u -o pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/sagecupy_out}; mkdir -p "$OUT"
what=${1:-quick}
export PYTHONUNBUFFERED=1
python3 -m pip install -e . --no-deps --no-build-isolation -q >/tmp/sagecupy_pip.log 2>&1 || { tail -20 /tmp/sagecupy_pip.log; exit 1; }
python3 - <<'PY'
import cupy, sagecupy
from sagecupy._loader import gpu_status, cuda_include_dir
print("cupy", cupy.__version__, "bfloat16:", hasattr(cupy, "bfloat16"), "gpu:", gpu_status(), "inc:", cuda_include_dir())
PY
status=0
if [ "$what" != bench ] && [ "$what" != examples ]; then
  kexpr=(); [ -n "${SAGECUPY_K:-}" ] && kexpr=(-k "$SAGECUPY_K")
  timeout ${SAGECUPY_TEST_TIMEOUT:-570} python3 -m pytest ${SAGECUPY_TESTS:-tests/gpu} ${kexpr[@]+"${kexpr[@]}"} --require-gpu -q -p no:cacheprovider 2>&1 | tee "$OUT/pytest_gpu.log" | tail -40
  status=${PIPESTATUS[0]}
fi
if [ "$what" = all ] || [ -n "${SAGECUPY_ACCURACY:-}" ]; then  # INT8 σ-sweep (SPEC §7) on the GPU kernels
  for cfg in ${SAGECUPY_ACC_CONFIGS:-default paper}; do
    echo "== sagecupy accuracy --backend gpu --config $cfg"
    timeout 200 sagecupy accuracy --backend gpu --config $cfg --format json --out "$OUT/acc_$cfg.jsonl"
    python3 - "$OUT/acc_$cfg.jsonl" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
for r in rows:
    if r.get("type") != "env":
        print(f"sigma={r['sigma']:>4} {r['tensor']:<3} cos={r['cos']:.6f} rel_l2={r['rel_l2']:.4f}")
PY
  done
fi
if [ "$what" != tests ] && [ "$what" != examples ] && [ "$what" != tests+examples ]; then
  flag="--quick --memory"; { [ "$what" = full ] || [ "$what" = all ]; } && flag=--memory
  timeout 400 python3 bench/run_bench.py $flag --families "${SAGECUPY_BENCH_FAMILIES:-int8,nvfp4,qat}" \
    --configs "${SAGECUPY_BENCH_CONFIGS:-default}" \
    --out "$OUT/bench.jsonl" 2>"$OUT/bench.err" | tee "$OUT/bench_table.txt"
  tail -3 "$OUT/bench.err"
  if [ -n "${SAGECUPY_EXPERIMENT:-}" ]; then  # the same sweep with extra kernel defines, for comparison
    echo "== experiment: SAGECUPY_DEFINES=$SAGECUPY_EXPERIMENT"
    SAGECUPY_DEFINES=$SAGECUPY_EXPERIMENT timeout 300 python3 bench/run_bench.py $flag --baselines "" \
      --families "${SAGECUPY_BENCH_FAMILIES:-int8,nvfp4,qat}" --out "$OUT/bench_exp.jsonl" \
      2>"$OUT/bench_exp.err" | grep sagecupy | tee "$OUT/bench_exp_table.txt"
  fi
fi
if [ "$what" = examples ] || [ "$what" = tests+examples ]; then  # issue 5's training examples (loss curves as JSON)
  export XLA_PYTHON_CLIENT_PREALLOCATE=false
  for ex in "recall.py --backend cupy" recall_torch.py recall_jax.py; do
    name=$(echo "$ex" | cut -d' ' -f1 | sed 's/.py//')
    echo "== python examples/$ex --steps 300"
    /usr/bin/time -f "%e s" timeout 240 python3 examples/$ex --steps 300 --out "$OUT/$name.json" 2>&1 | tail -6
  done
fi
echo "== pytest summary:"; tail -1 "$OUT/pytest_gpu.log" 2>/dev/null
exit $status
