"""The INT8 backward's gradients on the GPU against the float64 simulator (relative L2, default config, a few odd
shapes, fp16): dQ, dV, and dK against the simulator as it is and against one that rounds Y on the plain grid (Y
itself instead of the kernels' base-2 log2(e) Y, as the simulator did before commit a92218c). On the GPU machine:

    python3 bench/tools/int8_grads_vs_sim.py
"""
import numpy as np

import cupy as cp
from sagecupy import int8 as s8
from sagecupy.reference import sagebwd as rs
from sagecupy.reference.metrics import rel_l2

SHAPES = [(1, 2, 256, 128, False), (1, 4, 239, 128, True), (2, 2, 300, 64, False), (1, 2, 512, 128, True)]


def main():
    print(cp.cuda.runtime.getDeviceProperties(0)["name"].decode())
    rng = np.random.default_rng(0)
    for B, H, N, D, causal in SHAPES:
        q, k, v, do = (rng.standard_normal((B, H, N, D)).astype(np.float16) for _ in range(4))
        o, res = s8.forward(*(cp.asarray(x) for x in (q, k, v)), causal=causal)
        dq, dk, dv = (x.get().astype(np.float64) for x in s8.backward(res, cp.asarray(do)))
        new = rs.run(q, k, v, do, causal=causal)
        saved = rs._LOG2E
        rs._LOG2E = 1.0  # the plain grid: Y itself rounded, and dK then carries no ln 2 (undone below)
        try:
            old = rs.run(q, k, v, do, causal=causal)
        finally:
            rs._LOG2E = saved
        print(f"B={B} H={H} N={N} D={D} causal={int(causal)}: dQ {rel_l2(dq, new['dQ']):.2e}  "
              f"dK vs base-2 sim {rel_l2(dk, new['dK']):.2e}  "
              f"dK vs plain-grid sim {rel_l2(dk, old['dK'] / np.log(2.0)):.2e}  dV {rel_l2(dv, new['dV']):.2e}",
              flush=True)


if __name__ == "__main__":
    main()
