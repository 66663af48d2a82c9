"""Driver of bench/prepass_kernels.sh (and of bench/profile_sass.sh with SCRIPT=bench/ncu_prepass_driver.py): three
INT8 forward+backward calls at D, N (argv; default 128 4096)."""
import sys
from sagecupy import bench, int8
D, N = (int(sys.argv[1]), int(sys.argv[2])) if len(sys.argv) > 2 else (128, 4096)
B, H, (q, k, v, do) = bench._inputs(D, N, "bfloat16")
for _ in range(3):
    o, res = int8.forward(q, k, v)
    int8.backward(res, do)
import cupy; cupy.cuda.Device().synchronize()
