#!/usr/bin/env bash
# Device check of the clustered forward pre-pass (SAGECUPY_FWD_PREPASS=cluster): bitwise equality and device time of
# the pre-pass against the merged one, its tests, and the end-to-end 4K call both ways.
set -u -o pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/sagecupy_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
python3 -m pip install -e . --no-deps --no-build-isolation -q >/tmp/pip.log 2>&1 || tail -5 /tmp/pip.log
(cd bench && python3 prepass_variants.py --forward-only --inference \
  --defines "${PREPASS_VARIANTS:-;SAGECUPY_FWD_PREPASS=cluster;;SAGECUPY_FWD_PREPASS=cluster}") 2>&1 | tee "$OUT/prepass.txt"
python3 -m pytest -q tests/gpu/test_int8.py -k "merged_prepass or sage_attention_matches" --require-gpu -x \
  -p no:cacheprovider 2>&1 | tail -4 | tee "$OUT/tests.txt"
for m in cluster merged cluster merged; do
  echo "== SAGECUPY_FWD_PREPASS=$m python3 bench/e2e_probe.py --ns 4096"
  SAGECUPY_FWD_PREPASS=$m python3 bench/e2e_probe.py --ns 4096 2>&1 | tail -4
done 2>&1 | tee "$OUT/e2e.txt"
