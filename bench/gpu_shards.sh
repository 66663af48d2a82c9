#!/usr/bin/env bash
# The GPU tests of the given files in SHARDS parallel pytest processes (one GPU; the time is mostly kernel compiles,
# which run on the CPUs), each cut at TIMEOUT seconds; a summary line per shard and the failures at the end. Logs in
# $OUT/shard_*.log. On the GPU machine:
#   SHARDS=4 TIMEOUT=450 bash bench/gpu_shards.sh tests/gpu/test_fp4_attn.py tests/gpu/test_nvfp4_quant.py
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/sagecupy_out}; mkdir -p "$OUT"
SHARDS=${SHARDS:-4}; TIMEOUT=${TIMEOUT:-450}
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
python3 -m pytest --require-gpu -q -p no:cacheprovider --collect-only "$@" 2>/dev/null | grep "::" > /tmp/ids.txt
echo "collected $(wc -l < /tmp/ids.txt) tests"
for i in $(seq 0 $((SHARDS - 1))); do
  awk -v n="$SHARDS" -v i="$i" 'NR % n == i' /tmp/ids.txt > /tmp/ids_$i.txt
  timeout "$TIMEOUT" python3 -m pytest --require-gpu -q -p no:cacheprovider $(cat /tmp/ids_$i.txt) \
    > "$OUT/shard_$i.log" 2>&1 &
done
wait
for i in $(seq 0 $((SHARDS - 1))); do echo "shard $i: $(tail -1 "$OUT/shard_$i.log")"; done
grep -hE "^(FAILED|ERROR)" "$OUT"/shard_*.log | head -30
