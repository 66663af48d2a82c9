"""Per-kernel times of a packed INT8 forward+backward against the dense calls over the same tokens, under ncu.

16K tokens, H = 2048 / D, causal, the `default` config: S documents of sagecupy.bench's random lengths
(``doc_lengths``) as one packed call, the same tokens as one 16K sequence, and as 8 sequences of 2K; each call twice
(the first compiles). On the GPU machine, from the repository root:

    ncu --clock-control none --metrics gpu__time_duration.sum --csv python3 bench/tools/packed_kernels.py 32 > pk.csv
    python3 bench/tools/packed_kernels.py --sum pk.csv      # one line of kernel=us per call kind

    ncu --clock-control none --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum --csv \\
        python3 bench/tools/packed_kernels.py 8 --d 128 --dtype bfloat16 > pk.csv
    python3 bench/tools/packed_kernels.py --sum pk.csv --table   # the second call of each kind, one kernel a row

--d: 128 (default) or 64; --dtype: float16 (default) or bfloat16.
"""
import argparse


def run(S, D=128, dtype="float16"):
    import cupy as cp
    import numpy as np

    import sagecupy.int8 as s8
    from sagecupy._bench_common import doc_lengths
    from sagecupy.adapters.bf16 import from_float

    H, N = 2048 // D, 16384
    lens = doc_lengths(N, S)
    rng = cp.random.default_rng(0)

    def mk():
        x = rng.standard_normal((N, H, D), dtype=cp.float32)
        return x.astype(cp.float16) if dtype == "float16" else from_float(x)

    q, k, v, do = (mk() for _ in range(4))
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


def read_kernels(path):
    """[(kernel, {metric: value})] in launch order from ncu's ``--csv`` output (one row per kernel and metric)."""
    import csv

    lines = open(path).read().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith('"ID"'))
    rows = list(csv.reader(lines[start:]))
    hdr = rows[0]
    iid, name, metric, value = (hdr.index(c) for c in ("ID", "Kernel Name", "Metric Name", "Metric Value"))
    out, where = [], {}
    for r in rows[1:]:
        if r[iid] not in where:
            where[r[iid]] = len(out)
            out.append((r[name].split("(")[0].replace("void ", ""), {}))
        out[where[r[iid]]][1][r[metric]] = float(r[value].replace(",", ""))
    skip = ("cupy", "init_curand", "execute")  # the inputs' generation
    return [(n, m) for n, m in out if not n.startswith(skip)]


def calls(kernels):
    """[(label, [(kernel, metrics)])]: the launches split into the script's six calls (a call starts at its first
    pre-pass kernel), labelled packed, packed, 16K, 16K, 8x2K, 8x2K."""
    starts = [i for i, (n, _) in enumerate(kernels) if n.startswith("packed_offsets")
              or (n.startswith("column_partial") and "packed" not in n)]
    bounds = starts + [len(kernels)]
    labels = ("packed", "packed", "16K", "16K", "8x2K", "8x2K")
    return [(labels[j] if j < len(labels) else f"call{j}", kernels[a:b]) for j, (a, b) in enumerate(zip(bounds,
                                                                                                          bounds[1:]))]


def summarize(path, table=False):
    groups = calls(read_kernels(path))
    if not table:
        for label, ks in groups:
            print(label, " ".join(f"{n.split('<')[0]}={m['gpu__time_duration.sum'] / 1e3:.1f}" for n, m in ks))
        return
    last = {}
    for label, ks in groups:  # the second call of each kind
        last[label] = ks
    for label, ks in last.items():
        print(f"== {label}")
        total = pre = 0.0
        for n, m in ks:
            us = m["gpu__time_duration.sum"] / 1e3
            total += us
            pre += 0.0 if "attn" in n else us
            mb = "".join(f"  {k.split('__')[1].split('.')[0]} {m[k] / 1e6:7.1f} MB" for k in
                         ("dram__bytes_read.sum", "dram__bytes_write.sum") if k in m)
            print(f"{us:8.1f} us{mb}  {n}")
        print(f"total {total:.1f} us, pre-passes {pre:.1f} us ({100 * pre / total:.1f} %)")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("S", nargs="?", type=int, default=8, help="documents in the packed call")
    ap.add_argument("--d", type=int, default=128, choices=(64, 128))
    ap.add_argument("--dtype", default="float16", choices=("float16", "bfloat16"))
    ap.add_argument("--sum", metavar="CSV", help="summarize ncu's CSV of a run instead of running")
    ap.add_argument("--table", action="store_true", help="with --sum: one kernel a row, with DRAM bytes if measured")
    a = ap.parse_args()
    if a.sum:
        summarize(a.sum, a.table)
    else:
        run(a.S, a.d, a.dtype)
