"""README tables of the INT8 SageBwd kernels from bench JSON lines: every ratio is against the SDPA rows of the same
file (the same run).

    python bench/tools/int8_table.py RUN.jsonl            # speed table (default config)
    python bench/tools/int8_table.py RUN.jsonl --engines  # kernel time of the mma.sync and wgmma engines
    python bench/tools/int8_table.py RUN.jsonl --all-n    # every N the run has (default: 4K and 16K)

"fwd e2e" is the inference call (``sage_attention``, as SDPA's forward is timed under ``torch.no_grad()``); the
training forward (``int8.forward``, which also keeps the backward's residuals) has its own column.
"fwd kernel" is the ``kernel-wgmma`` row on sm_90 (the kernel the default call runs; the ``kernel`` row times
the same call first in each case, after the inputs are made, and reads a few percent slower), else ``kernel``.
"""
import sys

from fp4_table import load, pick


def ratio(base, ours):
    """base / ours as a table cell, or '–' when either row is missing (a baseline the run did not time, e.g.
    --baselines flash; back-to-back or training-forward rows, absent from older runs' files)."""
    return f"{base['ms'] / ours['ms']:.2f}" if base and ours else "–"


def main():
    rows = load(sys.argv[1])
    sm90 = any(r.get("scope") == "kernel-wgmma" for r in rows)
    if "--engines" in sys.argv:
        print("| D | N | causal | fwd mma ms | fwd wgmma ms | × | bwd mma ms | bwd wgmma ms | × |")
        print("|---:|---:|:---:|---:|---:|---:|---:|---:|---:|")
    else:
        print("| D | N | causal | fwd kernel TOPS | fwd e2e TOPS | fwd × flash | fwd × cuDNN | bwd e2e TOPS | bwd × flash "
              "| fwd+bwd TOPS | fwd+bwd × flash | fwd+bwd × cuDNN | fwd × flash, b2b | fwd+bwd × flash, b2b "
              "| training fwd × flash, e2e / b2b |")
        print("|---:|---:|:---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    present = {(r.get("D"), r.get("N")) for r in rows
               if r.get("impl") == "sagecupy-int8" and r.get("mode") == "fwd"}  # not the peak-memory rows
    ns = sorted({n for _, n in present}) if "--all-n" in sys.argv else (4096, 16384)
    for D in (64, 128):
        for N in ns:
            if (D, N) not in present:  # a run that timed other shapes (e.g. run_bench.py --ds/--ns)
                continue
            for c in (False, True):
                s = dict(impl="sagecupy-int8", config="default", D=D, N=N, causal=c)
                t = dict(D=D, N=N, causal=c)
                head = f"| {D} | {N // 1024}K | {'yes' if c else 'no'} |"
                if "--engines" in sys.argv:
                    fm, fw, bm, bw = (pick(rows, mode=m, scope=sc, **s)["ms"] for m, sc in
                                      (("fwd", "kernel-mma"), ("fwd", "kernel-wgmma"), ("bwd", "kernel-mma"),
                                       ("bwd", "kernel-wgmma")))
                    print(f"{head} {fm:.2f} | {fw:.2f} | {fm / fw:.2f} | {bm:.2f} | {bw:.2f} | {bm / bw:.2f} |")
                    continue
                k = pick(rows, mode="fwd", scope="kernel-wgmma" if sm90 else "kernel", **s)
                fe, be, fb = (pick(rows, mode=m, scope="e2e", **s) for m in ("fwd", "bwd", "fwdbwd"))
                ff, fc = (pick(rows, impl=f"sdpa-{b}", mode="fwd", scope="e2e", **t) for b in ("flash", "cudnn"))
                bf = pick(rows, impl="sdpa-flash", mode="bwd", scope="e2e", **t)
                xf, xc = (pick(rows, impl=f"sdpa-{b}", mode="fwdbwd", scope="e2e", **t) for b in ("flash", "cudnn"))
                # back to back (bench.time_ms_b2b)
                fbb, xbb = (pick(rows, mode=m, scope="e2e-b2b", **s) for m in ("fwd", "fwdbwd"))
                ffb, xfb = (pick(rows, impl="sdpa-flash", mode=m, scope="e2e-b2b", **t) for m in ("fwd", "fwdbwd"))
                # the training forward (int8.forward, residuals kept); in older files the "e2e" forward rows timed it
                tr, trb = (pick(rows, mode="fwd", scope=sc, **s) for sc in ("train", "train-b2b"))
                x = ratio
                print(f"{head} {k['tops']:.0f} | {fe['tops']:.0f} | {x(ff, fe)} | {x(fc, fe)} | "
                      f"{be['tops']:.0f} | {x(bf, be)} | {fb['tops']:.0f} | {x(xf, fb)} | {x(xc, fb)} | "
                      f"{x(ffb, fbb)} | {x(xfb, xbb)} | {x(ff, tr)} / {x(ffb, trb)} |")


if __name__ == "__main__":
    main()
