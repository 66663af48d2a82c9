"""σ-sweep of the float64 SageBwd simulator with wider backward quantization groups (CPU, no GPU needed).

The backward kernels quantize P̂ and dÔ (for dV), dS (for dK) per 64-query tile and X̂ = dS·diag(s_K) (for dQ) per
64-key tile, and fold each tile's int32 product into fp32 (docs/performance.md, the backward profile). Groups of 128
queries (``bwd_block_q=128``) and 128 keys (``bwd_block_kv=128``) halve those folds; this prints what they cost in
accuracy: the default config and the three wider variants, relative L2 against exact attention, one JSON line per
(variant, σ, tensor). B = 1, H = 8, N = 4096, D = 128, fp16, seed 0 as the GPU sweep (about 10 minutes on 2 cores):

    python bench/accuracy_bwd_groups.py [HEADS N] > rows.jsonl
"""
import json
import sys
import time

from sagecupy import analysis
from sagecupy.config import DEFAULT

heads, n = (int(sys.argv[1]), int(sys.argv[2])) if len(sys.argv) > 2 else (8, 4096)
variants = {"default": DEFAULT, "bq128": DEFAULT.replace(name="bq128", bwd_block_q=128),
            "bkv128": DEFAULT.replace(name="bkv128", bwd_block_kv=128),
            "both128": DEFAULT.replace(name="both128", bwd_block_q=128, bwd_block_kv=128)}
for name, cfg in variants.items():
    t0 = time.time()
    spec = analysis.RunSpec(family="int8", config=cfg, backend="reference",
                            shape=analysis.Shape(batch=1, heads=heads, n=n, d=128))
    for row in analysis.accuracy_sweep(spec):
        print(json.dumps(dict(row, variant=name)), flush=True)
    print(f"# {name}: {time.time() - t0:.0f} s", file=sys.stderr, flush=True)
