"""One launch of each FP4 kernel (and the INT8 forward for comparison) at D=128, N=4096, B=4, H=16, for ncu:

    ncu --clock-control none --kernel-name regex:"attn" --launch-skip 2 --launch-count 6 \\
        --section SpeedOfLight --section WarpStateStats --section Occupancy --section LaunchStats \\
        python bench/profile_fp4.py
"""
import cupy

from sagecupy import int8, nvfp4, qat
from sagecupy.bf16 import BF16Array

B, H, N, D = 4, 16, 4096, 128
rng = cupy.random.default_rng(0)
q, k, v, do = (BF16Array.from_float(rng.standard_normal((B, H, N, D), dtype=cupy.float32)) for _ in range(4))
for _ in range(2):  # warm-up (compiles), then the profiled launches
    nvfp4.attention(q, k, v)
    o, res = qat.forward(q, k, v)
    qat.backward(res, do)
    int8.forward(q, k, v)
cupy.cuda.Device().synchronize()
