"""One launch of each FP4 kernel (and the INT8 forward for comparison) at the benchmark's shapes (B·N = 16K tokens,
H·D = 2048; N = 4096), for ncu. Environment: PROF_D (128 or 64, default 128), PROF_WHAT (comma list of nvfp4, qat,
int8; default all):

    ncu --clock-control none --kernel-name regex:"attn" --launch-skip 2 --launch-count 6 \\
        --section SpeedOfLight --section WarpStateStats --section Occupancy --section LaunchStats \\
        python bench/profile_fp4.py
    SCRIPT=bench/profile_fp4.py PROF_D=64 PROF_WHAT=qat KREGEX="qat_attn" SKIP=3 COUNT=3 bash bench/profile_sass.sh
"""
import os

import cupy

from sagecupy import int8, nvfp4, qat
from sagecupy.bf16 import BF16Array

D = int(os.environ.get("PROF_D", "128"))
WHAT = os.environ.get("PROF_WHAT", "nvfp4,qat,int8").split(",")
B, N = 4, 4096
H = 2048 // D
rng = cupy.random.default_rng(0)
q, k, v, do = (BF16Array.from_float(rng.standard_normal((B, H, N, D), dtype=cupy.float32)) for _ in range(4))
for _ in range(2):  # warm-up (compiles), then the profiled launches
    if "nvfp4" in WHAT:
        nvfp4.attention(q, k, v)
    if "qat" in WHAT:
        o, res = qat.forward(q, k, v)
        qat.backward(res, do)
    if "int8" in WHAT:
        int8.forward(q, k, v)
cupy.cuda.Device().synchronize()
