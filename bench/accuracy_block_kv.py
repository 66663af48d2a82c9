"""CPU (float64 reference) cost in accuracy of quantizing the forward's P per token over 128-key tiles
instead of 64 (SageBwdConfig.block_kv): the σ-sweep of O at B=1, H=4, N=2048, D=128. ~100 s on 2 cores.

    python bench/accuracy_block_kv.py [OUT.json]
"""
import dataclasses
import json
import sys

from sagecupy import analysis
from sagecupy.config import SageBwdConfig

rows = []
for bkv in (64, 128):
    spec = analysis.RunSpec(family="int8", config=dataclasses.replace(SageBwdConfig(), block_kv=bkv),
                            backend="reference", shape=analysis.Shape(batch=1, heads=4, n=2048, d=128))
    for r in analysis.accuracy_sweep(spec):
        rows.append(dict(block_kv=bkv, **r))
        print(f"block_kv={bkv:>3} sigma={r['sigma']:>4} {r['tensor']:<2} rel_l2={r['rel_l2']:.5f}", flush=True)
if len(sys.argv) > 1:
    with open(sys.argv[1], "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
