"""README table of the NVFP4 forward and the FP4 QAT pair from bench JSON lines: every ratio is against the SDPA
rows of the same file (the same run).

    python bench/tools/fp4_table.py NVFP4_RUN.jsonl [QAT_RUN.jsonl]

A family absent from a file (e.g. a run with --families int8,qat) prints "–" in its columns.
"""
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # sagecupy from this checkout when not installed
from sagecupy._bench_common import median_rows  # noqa: E402


def load(path):
    """The JSON rows of a benchmark file, the rounds of a run with ``--rounds`` merged into their median."""
    return median_rows([json.loads(line) for line in open(path) if line.strip().startswith("{")])


def pick(rows, **kw):
    for r in rows:
        if all(r.get(k) == v for k, v in kw.items()):
            return r
    return None


def main():
    nv = load(sys.argv[1])
    qa = load(sys.argv[2]) if len(sys.argv) > 2 else nv
    print("| D | N | causal | NVFP4 fwd kernel TFLOPS | fwd e2e TFLOPS | fwd e2e × flash | fwd e2e × cuDNN "
          "| QAT fwd × flash | QAT bwd × flash | QAT fwd+bwd TFLOPS | × flash | × cuDNN | NVFP4 fwd × flash, b2b "
          "| QAT fwd+bwd × flash, b2b |")
    print("|---:|---:|:---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for D in (64, 128):
        for N in (4096, 16384):
            for c in (False, True):
                s = dict(D=D, N=N, causal=c)
                k = pick(nv, impl="sagecupy-nvfp4", mode="fwd", scope="kernel", **s)
                e = pick(nv, impl="sagecupy-nvfp4", mode="fwd", scope="e2e", **s)
                fl, cu = (pick(nv, impl=f"sdpa-{b}", mode="fwd", scope="e2e", **s) for b in ("flash", "cudnn"))
                q = pick(qa, impl="sagecupy-qat", mode="fwdbwd", scope="e2e", **s)
                qf, qb = (pick(qa, impl="sagecupy-qat", mode=m, scope="e2e", **s) for m in ("fwd", "bwd"))
                qff, qbf = (pick(qa, impl="sdpa-flash", mode=m, scope="e2e", **s) for m in ("fwd", "bwd"))
                qfl, qcu = (pick(qa, impl=f"sdpa-{b}", mode="fwdbwd", scope="e2e", **s) for b in ("flash", "cudnn"))
                # back to back (bench.time_ms_b2b): absent from older runs' files, printed as a dash
                eb, qbb = (pick(rows, impl=i, mode=m, scope="e2e-b2b", **s)
                           for rows, i, m in ((nv, "sagecupy-nvfp4", "fwd"), (qa, "sagecupy-qat", "fwdbwd")))
                flb, qflb = (pick(rows, impl="sdpa-flash", mode=m, scope="e2e-b2b", **s)
                             for rows, m in ((nv, "fwd"), (qa, "fwdbwd")))
                b2b = " ".join(f"{f['ms'] / x['ms']:.2f} |" if f and x else "– |" for f, x in ((flb, eb), (qflb, qbb)))
                tops = lambda r: f"{r['tops']:.0f}" if r else "–"  # noqa: E731  (a family absent from the run)
                ratio = lambda a, b: f"{a['ms'] / b['ms']:.2f}" if a and b else "–"  # noqa: E731
                print(f"| {D} | {N // 1024}K | {'yes' if c else 'no'} | {tops(k)} | {tops(e)} | "
                      f"{ratio(fl, e)} | {ratio(cu, e)} | {ratio(qff, qf)} | "
                      f"{ratio(qbf, qb)} | {tops(q)} | "
                      f"{ratio(qfl, q)} | {ratio(qcu, q)} | {b2b}")


if __name__ == "__main__":
    main()
