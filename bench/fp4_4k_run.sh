#!/usr/bin/env bash
# The 4K experiments of the twenty-ninth session, queued for a device call (written when no GPU was lent):
# the warp-specialized kernel's idle-warpgroup skip (SAGE_FP4_WS_IDLE_SKIP) and Q / tile-0 load overlap
# (SAGE_FP4_WS_QOVL), the fused pre-pass (SAGECUPY_FP4_PREPASS=fused) and its pipelined form (=pipe, thirtieth
# session), K's binary-search block quantizer (SAGE_NVFP4_CMP_BSEARCH, thirtieth), the persistent kernel
# (SAGECUPY_FP4_PERSIST=1), Q quantized in the warp-specialized kernel (SAGECUPY_FP4_QIN=1, thirty-first) and the
# last wave's items split along the keys (SAGECUPY_FP4_TAIL_SPLIT=1, thirty-first), K/V tiles dequantized once into
# stage images (SAGECUPY_FP4_KVIMG=1, thirty-second). All added off by default; the thirty-second session's run made
# SAGECUPY_FP4_KVIMG=1, SAGECUPY_FP4_TAIL_SPLIT=1 and SAGE_NVFP4_CMP_BSEARCH=1 the defaults (its floor's base variant
# now has them; `suite` without CANDIDATE tests the defaults).
#   bash bench/fp4_4k_run.sh time    # a persistent-kernel smoke check (capped: a hang must not eat the call), then
#                                    # fp4_floor.py at 4K (SHAPES=4:4096,1:16384 adds 16K): every variant's kernel
#                                    # and whole call; the pipelined pre-pass's launches with SAGECUPY_FP4_QIN,
#                                    # the pipelined images' pass and the kernel on them (probes); ~9.5 minutes
#   bash bench/fp4_4k_run.sh tests   # the tests that exercise them (shards; then again with the three defines on)
#   CANDIDATE="SAGECUPY_FP4_PREPASS=pipe SAGECUPY_FP4_QIN=1 SAGECUPY_FP4_TAIL_SPLIT=1 SAGECUPY_DEFINES=..." \
#     bash bench/fp4_4k_run.sh suite # the whole NVFP4 / QAT GPU suite (and the adapters') and the benchmark with the
#                                    # switches that gained set in the environment: once the code's defaults are
#                                    # flipped to them (the same cubins: bench/tools/cubin_cmp.py), this run is the
#                                    # suite and the benchmark of the final kernels; ~9 minutes
# Files in $OUT: smoke.txt, floor.txt, floor_persist.txt, probe_qin.txt, probe_kvimg.txt,
# tests_*.txt; suite:
# suite_fp4.txt, shard_*.log, bench.jsonl, bench_table.txt.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/sagecupy_out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
what=${1:-time}
if [ "$what" = time ]; then
  nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv,noheader
  timeout 150 python3 - <<'PY' 2>&1 | tee "$OUT/smoke.txt"  # (the first compile of the kernels is in here)
import os
import cupy
import numpy as np
from sagecupy import _checks, bench, nvfp4
ok = True
for switch, on in (("SAGECUPY_FP4_KVIMG", "1"), ("SAGECUPY_FP4_KVIMG", "pipe"), ("SAGECUPY_FP4_PERSIST", "1"),
                   ("SAGECUPY_FP4_QIN", "1"), ("SAGECUPY_FP4_TAIL_SPLIT", "1")):
    for N, causal in ((1024, False), (4096, True), (4096, False)):
        _, _, (q, k, v, _) = bench._inputs(128, N, "bfloat16")
        outs = []
        for flag in ("0", on):
            os.environ[switch] = flag
            o, lse = nvfp4.attention(q, k, v, causal=causal, return_lse=True)
            cupy.cuda.Device().synchronize()
            outs.append((cupy.asnumpy(_checks.raw(o)), cupy.asnumpy(lse)))
        os.environ.pop(switch)
        same = all((a == b).all() for a, b in zip(*outs))
        o0, o1 = (x[0].view(np.uint16).astype(np.uint32) << 16 for x in outs)  # (bf16 bits -> fp32 values)
        o0, o1 = o0.view(np.float32), o1.view(np.float32)
        rel = float(np.linalg.norm(o1 - o0) / np.linalg.norm(o0))
        if switch != "SAGECUPY_FP4_TAIL_SPLIT":
            ok &= bool(same)  # (bitwise by construction; the split only within rounding)
        else:
            ok &= rel < 1e-3
        print(f"{switch}={on} smoke N={N} causal={causal}: {'bitwise equal' if same else f'differs, rel_l2 {rel:.1e}'}",
              flush=True)
print("SMOKE_OK" if ok else "SMOKE_FAIL")
PY
  # (the combinations first: a timeout cuts the last variants; SAGE_FP4_WS_QOVL alone at the end. With
  # SAGECUPY_FP4_KVIMG=1 the pre-pass is K's mean, [Q], the images: SAGECUPY_FP4_PREPASS does not apply)
  (cd bench && timeout ${FLOOR_TIMEOUT:-300} python3 fp4_floor.py --shapes ${SHAPES:-4:4096} --causal 0,1 \
    --diags 0 --e2e --extra "SAGE_FP4_WS_IDLE_SKIP=1,SAGE_NVFP4_CMP_BSEARCH=1,SAGE_FP4_WS_UNIFORM_WG=1,\
SAGECUPY_FP4_QIN=1,SAGECUPY_FP4_TAIL_SPLIT=1,SAGECUPY_FP4_KVIMG=1;SAGE_FP4_WS_IDLE_SKIP=1,SAGE_NVFP4_CMP_BSEARCH=1,\
SAGE_FP4_WS_UNIFORM_WG=1,SAGECUPY_FP4_QIN=1,SAGECUPY_FP4_TAIL_SPLIT=1,SAGECUPY_FP4_KVIMG=pipe;\
SAGE_FP4_WS_IDLE_SKIP=1,SAGE_NVFP4_CMP_BSEARCH=1,\
SAGECUPY_FP4_PREPASS=pipe,SAGECUPY_FP4_QIN=1,SAGECUPY_FP4_TAIL_SPLIT=1;SAGECUPY_FP4_KVIMG=1;SAGECUPY_FP4_KVIMG=pipe;\
SAGE_FP4_WS_IDLE_SKIP=1,SAGE_NVFP4_CMP_BSEARCH=1,SAGECUPY_FP4_PREPASS=pipe;SAGE_FP4_WS_IDLE_SKIP=1;\
SAGECUPY_FP4_PREPASS=fused;SAGECUPY_FP4_PREPASS=pipe;SAGECUPY_FP4_QIN=1;SAGECUPY_FP4_TAIL_SPLIT=1;\
SAGE_FP4_WS_UNIFORM_WG=1;SAGE_FP4_WS_QOVL=1") 2>&1 | tee "$OUT/floor.txt"
  if grep -q SMOKE_OK "$OUT/smoke.txt"; then
    (cd bench && timeout ${PERSIST_TIMEOUT:-60} python3 fp4_floor.py --shapes ${SHAPES:-4:4096} --causal 0,1 \
      --diags 0 --e2e --extra "SAGECUPY_FP4_PERSIST=1,SAGE_FP4_WS_IDLE_SKIP=1,SAGE_NVFP4_CMP_BSEARCH=1,\
SAGECUPY_FP4_PREPASS=pipe") 2>&1 | tee "$OUT/floor_persist.txt"
  fi
  (cd bench && SAGECUPY_FP4_PREPASS=pipe SAGECUPY_FP4_QIN=1 SAGECUPY_DEFINES=SAGE_NVFP4_CMP_BSEARCH=1 timeout 35 \
    python3 fp4_prepass_probe.py) 2>&1 | tee "$OUT/probe_qin.txt"
  # (the images' pass and the kernel on them, each launch's time: the last two launches)
  (cd bench && SAGECUPY_FP4_KVIMG=pipe SAGECUPY_FP4_QIN=1 SAGECUPY_DEFINES=SAGE_NVFP4_CMP_BSEARCH=1 timeout 35 \
    python3 fp4_prepass_probe.py) 2>&1 | tee "$OUT/probe_kvimg.txt"
elif [ "$what" = suite ]; then
  echo "candidate defaults: ${CANDIDATE:-none}"
  env ${CANDIDATE:-} SHARDS=${SHARDS:-8} TIMEOUT=${TIMEOUT:-390} bash bench/gpu_shards.sh tests/gpu/test_fp4_attn.py \
    tests/gpu/test_nvfp4_quant.py tests/gpu/test_torch_adapter.py tests/gpu/test_jax_adapter.py 2>&1 \
    | tee "$OUT/suite_fp4.txt"
  env ${CANDIDATE:-} timeout ${BENCH_TIMEOUT:-170} python3 bench/run_bench.py --quick --memory --families nvfp4,qat \
    --out "$OUT/bench.jsonl" 2>/dev/null | tee "$OUT/bench_table.txt"
else
  SHARDS=${SHARDS:-6} TIMEOUT=${TIMEOUT:-230} bash bench/gpu_shards.sh tests/gpu/test_fp4_attn.py \
    tests/gpu/test_nvfp4_quant.py -k "fused_prepass or back_to_back or quant or persistent or q_in or tail_split or kv_images" 2>&1 \
    | tee "$OUT/tests_prepass.txt"
  SAGECUPY_DEFINES=SAGE_FP4_WS_IDLE_SKIP=1,SAGE_FP4_WS_QOVL=1,SAGE_NVFP4_CMP_BSEARCH=1,SAGE_FP4_WS_UNIFORM_WG=1 \
    SHARDS=${SHARDS:-6} \
    TIMEOUT=${TIMEOUT:-230} bash bench/gpu_shards.sh tests/gpu/test_fp4_attn.py tests/gpu/test_nvfp4_quant.py \
    -k "warp_specialized or back_to_back or nvfp4_vs_references or persistent or fused_prepass or quant or q_in or tail_split or kv_images" \
    2>&1 | tee "$OUT/tests_ws_defines.txt"
fi
