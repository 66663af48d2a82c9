#!/usr/bin/env bash
# Device check of the clustered forward pre-pass (SAGECUPY_FWD_PREPASS=cluster) and of programmatic dependent launch
# (SAGECUPY_PDL=1): bitwise equality and device time of the pre-pass against the merged one, their tests, and the
# end-to-end 4K call under each combination.
set -u -o pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/sagecupy_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
python3 -m pip install -e . --no-deps --no-build-isolation -q >/tmp/pip.log 2>&1 || tail -5 /tmp/pip.log
python3 -m pytest -q tests/gpu/test_int8.py -k "merged_prepass or sage_attention_matches" --require-gpu -x \
  -p no:cacheprovider 2>&1 | tail -3 | tee "$OUT/tests.txt"
SAGECUPY_PDL=1 python3 -m pytest -q tests/gpu/test_int8.py -k "merged_prepass or sage_attention_matches or replay" \
  --require-gpu -x -p no:cacheprovider 2>&1 | tail -3 | tee -a "$OUT/tests.txt"
(cd bench && python3 prepass_variants.py --forward-only --inference --defines "${PREPASS_VARIANTS:-;SAGECUPY_FWD_PREPASS=cluster;SAGECUPY_PDL=1;SAGECUPY_FWD_PREPASS=cluster,SAGECUPY_PDL=1}") 2>&1 | tee "$OUT/prepass.txt"
for combo in ${E2E_COMBOS:-merged,0 cluster,1 merged,1 cluster,0 merged,0 cluster,1}; do
  m=${combo%,*}; pdl=${combo#*,}
  echo "== SAGECUPY_FWD_PREPASS=$m SAGECUPY_PDL=$pdl python3 bench/e2e_probe.py --ns 4096"
  SAGECUPY_FWD_PREPASS=$m SAGECUPY_PDL=$pdl timeout 120 python3 bench/e2e_probe.py --ns 4096 2>&1 | tail -3
done 2>&1 | tee "$OUT/e2e.txt"
