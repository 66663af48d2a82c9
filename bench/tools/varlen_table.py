"""Table of the packed-batch and sliding-window rows of one benchmark run's JSON lines (`python3 bench/run_bench.py
--no-dense --packed --windows --out RUN.jsonl`): per case, the INT8 call's ms and TOPS over the visible query-key pairs
(forward: the inference call; forward+backward), and each baseline's time over INT8's from the same file (cuDNN's
bf16 SDPA on ragged THD tensors or with its diagonal band, SDPA once per document, PyTorch's varlen attention,
FlexAttention). A baseline the run did not time prints a dash; a cuDNN ratio marked `c` is to cuDNN's causal call
(the installed cuDNN declined the window, so it computed the whole causal mask instead). Skipped baselines, notes and
errors follow, one line each.

    python bench/tools/varlen_table.py RUN.jsonl [--scope e2e|e2e-b2b]   (default e2e-b2b: back to back)
"""
import sys

from fp4_table import load

# run_bench.py's --varlen-baselines names and the impl of their rows
BASES = (("cuDNN", "cudnn-bf16"), ("SDPA/doc", "sdpa-per-doc"), ("varlen", "torch-varlen"), ("flex", "flex-attention"))


def key(r):
    return (r["case"], r["D"], r["N"], r.get("S"), r.get("W"), r["mode"], r.get("scope"))


def main():
    scope = sys.argv[sys.argv.index("--scope") + 1] if "--scope" in sys.argv else "e2e-b2b"
    impls = {impl for _, impl in BASES}
    rows = [r for r in load(sys.argv[1]) if r.get("case") or (r.get("mode") == "skip" and r.get("impl") in impls)]
    timed = {(r["impl"],) + key(r): r for r in rows if "ms" in r}
    ours = [r for r in rows if "ms" in r and str(r["impl"]).startswith("sagecupy-int8-")
            and r.get("scope") == scope and r.get("config", "default") == "default"]
    print(f"INT8 (config default) against the baselines, {scope}: baseline ms / INT8 ms; TOPS over visible pairs")
    print("| case | D | N | S / W | mode | INT8 ms | INT8 TOPS | " + " | ".join(f"× {h}" for h, _ in BASES) + " |")
    print("|:---|---:|---:|---:|:---|---:|---:|" + "---:|" * len(BASES))
    for r in sorted(ours, key=lambda r: (r["case"], r["D"], r["N"], r.get("S") or r.get("W") or 0, r["mode"])):
        cells = []
        for _, impl in BASES:
            b = timed.get((impl,) + key(r))
            mark = "c" if b and b.get("window_applied") is False else ""
            cells.append(f"{b['ms'] / r['ms']:.2f}{mark}" if b else "–")
        sw = r.get("S") if r["case"] == "packed" else r.get("W")
        print(f"| {r['case']} | {r['D']} | {r['N'] // 1024}K | {sw} | {r['mode']} | {r['ms']:.3f} | {r['tops']:.0f} | "
              + " | ".join(cells) + " |")
    for r in rows:
        if r.get("mode") in ("skip", "note", "error"):
            where = f" ({r['case']} D={r['D']} N={r['N']})" if "D" in r else ""
            print(f"{r['impl']} {r['mode']}{where}: {r.get('reason') or r.get('error')}")


if __name__ == "__main__":
    main()
