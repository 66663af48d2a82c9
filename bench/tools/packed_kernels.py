"""Per-kernel times of a packed INT8 forward+backward against the dense calls over the same tokens, under ncu.

16K tokens, H = 16, D = 128, fp16, causal: S documents of sagecupy.bench's random lengths (``doc_lengths``) as one
packed call, the same tokens as one 16K sequence, and as 8 sequences of 2K; each call twice (the first compiles).
On the GPU machine, from the repository root:

    ncu --clock-control none --metrics gpu__time_duration.sum --csv python3 bench/tools/packed_kernels.py 32 > pk.csv
    python3 bench/tools/packed_kernels.py --sum pk.csv      # one line of kernel=us per call kind
"""
import sys


def run(S):
    import cupy as cp
    import numpy as np

    import sagecupy.int8 as s8
    from sagecupy._bench_common import doc_lengths

    H, D, N = 16, 128, 16384
    lens = doc_lengths(N, S)
    rng = cp.random.default_rng(0)
    q, k, v, do = (rng.standard_normal((N, H, D), dtype=cp.float32).astype(cp.float16) for _ in range(4))
    cu = cp.asarray(np.concatenate([[0], np.cumsum(lens)]).astype(np.int32))
    pk = dict(layout="THD", cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max(lens), max_seqlen_k=max(lens),
              causal=True)
    for _ in range(2):
        o, lse, res = s8.forward(q, k, v, return_lse=True, **pk)
        s8.backward(res, do)
    for B in (1, 8):  # one 16K sequence, 8 of 2K
        qb, kb, vb, dob = (x.reshape(B, N // B, H, D).transpose(0, 2, 1, 3).copy() for x in (q, k, v, do))
        for _ in range(2):
            o, lse, res = s8.forward(qb, kb, vb, return_lse=True, causal=True)
            s8.backward(res, dob)
    cp.cuda.runtime.deviceSynchronize()
    print("lengths", lens)


def summarize(path):
    import csv

    lines = open(path).read().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith('"ID"'))
    rows = list(csv.reader(lines[start:]))
    name, value = rows[0].index("Kernel Name"), rows[0].index("Metric Value")
    kernels = [(r[name].split("(")[0].replace("void ", "").split("<")[0], float(r[value].replace(",", "")) / 1e3)
               for r in rows[1:]]
    skip = ("cupy", "init_curand", "execute")  # the inputs' generation
    for label, keep in (("packed", lambda n: "packed" in n),
                        ("dense", lambda n: "packed" not in n and not n.startswith(skip))):
        print(label, " ".join(f"{n}={t:.1f}" for n, t in kernels if keep(n)))


if __name__ == "__main__":
    if sys.argv[1:2] == ["--sum"]:
        summarize(sys.argv[2])
    else:
        run(int(sys.argv[1]) if len(sys.argv) > 1 else 8)
