"""One launch of each INT8 kernel (forward mma.sync and wgmma, backward dK/dV and dQ) at D=128, N=4096, B=4, H=16,
for ncu:

    ncu --clock-control none --kernel-name regex:"attn" --launch-skip 4 --launch-count 4 \\
        --section SpeedOfLight --section WarpStateStats --section ComputeWorkloadAnalysis --section Occupancy \\
        python bench/profile_int8.py
"""
import os

import cupy

from sagecupy import config, int8
from sagecupy.bf16 import BF16Array

B, H, N, D = 4, 16, 4096, 128
rng = cupy.random.default_rng(0)
q, k, v, do = (BF16Array.from_float(rng.standard_normal((B, H, N, D), dtype=cupy.float32)) for _ in range(4))
cfg = {"default": config.DEFAULT, "bkv64": config.BKV64}[os.environ.get("PROF_CFG", "default")]  # SageBwdConfig
for _ in range(2):  # warm-up (compiles), then the profiled launches
    int8.forward(q, k, v, engine="mma", config=cfg)
    o, res = int8.forward(q, k, v, engine="wgmma", config=cfg)
    int8.backward(res, do)
cupy.cuda.Device().synchronize()
