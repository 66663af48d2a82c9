"""The INT8 speed targets against one benchmark run's JSON lines, every ratio from the same file (baselines timed in
the same process): the smallest and largest ratio over each row's shapes, the target, and whether the smallest meets
it. Ratios are the baseline's ms over sagecupy's INT8 `default` call, end to end (quantization included); cuDNN FP8
is shown with its bf16 -> FP8 casts and amax (`e2e`) and on FP8 operands alone (`kernel`); the adapter rows are the
CuPy call's ms over the adapter's (1.0: no overhead). Several files (one per dtype) may be given; files that
time the same shape are refused (give them in separate calls).

    python3 bench/run_bench.py --families int8 --ds 64,128 --baselines sdpa,cudnn-fp8 --adapters --out bf16.jsonl
    python3 bench/run_bench.py --families int8 --ds 64,128 --baselines sdpa --adapters --dtype float16 --out fp16.jsonl
    python bench/tools/targets_table.py bf16.jsonl fp16.jsonl
    python bench/tools/targets_table.py --config pv16 run.jsonl     # another INT8 config of the same run
    python bench/tools/targets_table.py --shapes bf16.jsonl         # the ratios shape by shape (the README's table)
"""
import sys

from fp4_table import load

OURS = "sagecupy-int8"
SDPA, FP8 = "sdpa-default", "cudnn-fp8"
ADAPTER_IMPLS = ("sagecupy-int8-torch", "sagecupy-int8-jax")


def _index(rows, config="default"):
    """(impl, mode, scope, D, N, causal, dtype) -> ms, INT8 rows of `config` only."""
    out = {}
    for r in rows:
        if "ms" not in r or not r.get("impl"):
            continue
        if str(r["impl"]).startswith(OURS) and r.get("config", "default") != config:
            continue
        # cuDNN FP8 is timed from bf16 inputs whatever the run's dtype (its kernel rows say float8_e4m3fn)
        dt = "*" if r["impl"] == FP8 else r.get("dtype", "bfloat16")
        out[(r["impl"], r["mode"], r["scope"], r["D"], r["N"], r["causal"], dt)] = r["ms"]
    return out


def _ratios(ix, mode, base, base_scope, keep, base_dtype=None):
    """Baseline ms / INT8 e2e ms over the shapes `keep(D, N)` accepts."""
    out = []
    for (impl, m, scope, D, N, c, dt), ms in ix.items():
        if impl != OURS or m != mode or scope != "e2e" or not keep(D, N):
            continue
        b = ix.get((base, mode, base_scope, D, N, c, base_dtype or dt))
        if b:
            out.append((b / ms, D, N, c, dt))
    return out


def _adapter_ratios(ix, impl, mode):
    out = []
    for (i, m, scope, D, N, c, dt), ms in ix.items():
        if i == impl and m == mode and scope == "e2e":
            mine = ix.get((OURS, mode, "e2e", D, N, c, dt))
            if mine:
                out.append((mine / ms, D, N, c, dt))
    return out


def _fmt(rs, target):
    if not rs:
        return "– | – | " + f"≥ {target:.2f} | not timed"
    lo, hi = min(rs)[0], max(rs)[0]
    worst = min(rs)
    where = f"{worst[1]}/{worst[2] // 1024}K{' causal' if worst[3] else ''} {worst[4]}"
    return f"{lo:.2f} | {hi:.2f} | ≥ {target:.2f} | {'met' if lo >= target else 'not met'} (lowest: D={where})"


def shapes_table(ix):
    """One line per (D, causal, N) of the INT8 e2e rows: forward and forward+backward against both baselines."""
    cols = (("fwd", SDPA, None), ("fwd", FP8, "*"), ("fwdbwd", SDPA, None), ("fwdbwd", FP8, "*"))
    keys = sorted({(k[3], k[5], k[4], k[6]) for k in ix if k[0] == OURS and k[2] == "e2e"},
                  key=lambda k: (-k[0], k[1], k[2], k[3]))
    multi = len({k[3] for k in keys}) > 1
    print("| D | causal | N |" + (" dtype |" if multi else "") + " fwd × SDPA (cuDNN bf16) | fwd × cuDNN FP8 |"
          " fwd+bwd × SDPA (cuDNN bf16) | fwd+bwd × cuDNN FP8 |")
    print("|---:|:---:|---:|" + ("---|" if multi else "") + "---:|---:|---:|---:|")
    for D, c, N, dt in keys:
        cells = []
        for mode, base, bdt in cols:
            mine, b = ix.get((OURS, mode, "e2e", D, N, c, dt)), ix.get((base, mode, "e2e", D, N, c, bdt or dt))
            cells.append(f"{b / mine:.2f}" if mine and b else "–")
        print(f"| {D} | {'yes' if c else 'no'} | {N // 1024}K |" + (f" {dt} |" if multi else "")
              + "".join(f" {x} |" for x in cells))


def main(paths, config="default", shapes=False):
    rows, ix = [], {}
    for path in paths:  # one index per file, merged: a shape timed in two files would otherwise keep the last silently
        file_rows = load(path)
        for key, ms in _index(file_rows, config).items():
            if key in ix:
                impl, mode, scope, D, N, c, dt = key
                sys.exit(f"targets_table.py: {path} times {impl} {mode} {scope} D={D} N={N} causal={c} {dt} again; "
                         f"give runs over the same shapes in separate calls")
            ix[key] = ms
        rows += file_rows
    dtypes = sorted({k[6] for k in ix if k[0] == OURS})
    gpus = sorted({r["gpu"] for r in rows if r.get("type") == "env" and r.get("gpu")})
    rounds = sorted({r["rounds"] for r in rows if "rounds" in r})  # load() keeps the median of a --rounds run
    print(f"GPU: {', '.join(gpus) or 'unknown'}; INT8 config: {config}; dtypes: {', '.join(dtypes)}; "
          f"files: {', '.join(paths)}" + (f"; medians over {'/'.join(map(str, rounds))} rounds" if rounds else ""))
    if shapes:
        shapes_table(ix)
        return
    big = lambda D, N: D == 128 and N >= 4096  # noqa: E731
    d64 = lambda D, N: D == 64 and N >= 4096  # noqa: E731
    short = lambda D, N: N <= 2048  # noqa: E731
    fp8dt = "*"
    table = [
        ("fwd, D=128, N ≥ 4K, × cuDNN bf16 (SDPA default)", _ratios(ix, "fwd", SDPA, "e2e", big), 1.5),
        ("fwd, D=128, N ≥ 4K, × cuDNN FP8 with casts", _ratios(ix, "fwd", FP8, "e2e", big, fp8dt), 1.0),
        ("fwd, D=128, N ≥ 4K, × cuDNN FP8 kernel alone", _ratios(ix, "fwd", FP8, "kernel", big, fp8dt), 1.0),
        ("fwd+bwd, D=128, N ≥ 4K, × cuDNN bf16", _ratios(ix, "fwdbwd", SDPA, "e2e", big), 1.35),
        ("fwd+bwd, D=128, N ≥ 4K, × cuDNN FP8 with casts", _ratios(ix, "fwdbwd", FP8, "e2e", big, fp8dt), 1.0),
        ("fwd+bwd, D=128, N ≥ 4K, × cuDNN FP8 kernels alone", _ratios(ix, "fwdbwd", FP8, "kernel", big, fp8dt), 1.0),
        ("fwd, D=64, N ≥ 4K, × cuDNN bf16", _ratios(ix, "fwd", SDPA, "e2e", d64), 1.3),
        ("fwd+bwd, D=64, N ≥ 4K, × cuDNN bf16", _ratios(ix, "fwdbwd", SDPA, "e2e", d64), 1.2),
        ("fwd+bwd, N ≤ 2K, × cuDNN bf16", _ratios(ix, "fwdbwd", SDPA, "e2e", short), 1.2),
    ]
    for impl in ADAPTER_IMPLS:
        for mode in ("fwd", "fwdbwd"):
            table.append((f"{impl.rsplit('-', 1)[1]} adapter {mode}: CuPy ms / adapter ms",
                          _adapter_ratios(ix, impl, mode), 0.97))
    print("| target | lowest | highest | target | status |")
    print("|---|---:|---:|---:|---|")
    for name, rs, target in table:
        print(f"| {name} | {_fmt(rs, target)} |")


if __name__ == "__main__":
    if len(sys.argv) < 2 or sys.argv[1] in ("-h", "--help"):
        print(__doc__)
        sys.exit(0 if len(sys.argv) > 1 else 2)
    args = sys.argv[1:]
    config, shapes = "default", False
    while args and args[0] in ("--shapes", "--config"):  # the options, in either order, before the files
        if args[0] == "--shapes":
            shapes, args = True, args[1:]
        elif len(args) < 2:
            sys.exit("targets_table.py: --config NAME needs a name")
        else:
            config, args = args[1], args[2:]
    if not args:
        sys.exit("targets_table.py: no file given")
    main(args, config, shapes)
