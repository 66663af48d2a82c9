"""Driver of bench/prepass_kernels.sh: three INT8 forward+backward calls at D, N (argv)."""
import sys
from sagecupy import bench, int8
D, N = int(sys.argv[1]), int(sys.argv[2])
B, H, (q, k, v, do) = bench._inputs(D, N, "bfloat16")
for _ in range(3):
    o, res = int8.forward(q, k, v)
    int8.backward(res, do)
import cupy; cupy.cuda.Device().synchronize()
