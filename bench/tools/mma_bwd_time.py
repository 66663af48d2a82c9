"""The mma.sync backward call (pre-pass and kernels), back to back, best of 3, bf16, B*N = 16K tokens, H*D = 2048,
D = 64 and 128, N = 4K and 16K, causal and not: one line per shape, prefixed by a tag (to compare two trees, run
it once from each; bench/results/3b8c70f/mma_bwd_ab_h100.txt shows how).

    python3 bench/tools/mma_bwd_time.py TAG
"""
import sys

from sagecupy import int8
from sagecupy.bench import _inputs, time_ms_b2b


def main(tag):
    for D in (64, 128):
        for N in (4096, 16384):
            for causal in (False, True):
                _, _, (q, k, v, do) = _inputs(D, N, "bfloat16")
                _, res = int8.forward(q, k, v, causal=causal, engine="mma")
                ms = min(time_ms_b2b(lambda: int8.backward(res, do, engine="mma"), 3) for _ in range(3))
                print(f"{tag} D={D} N={N} causal={int(causal)} bwd_mma_ms {ms:.3f}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "run")
