"""A/B timing of kernel variants in one process: kernel define sets, or another kernel tree, each timed on the
public calls, interleaved over rounds (A B A B ...; the best of each kept), with every variant's outputs compared
bitwise against the first variant's. On the GPU machine, from the repository root:

    python3 bench/ab.py --calls nvfp4,int8_infer --variants ";SAGE_X=1"           # the default build against -DSAGE_X=1
    git archive REV kernels_cu | tar -x -C /tmp/old                               # an earlier commit's kernels
    python3 bench/ab.py --calls int8_bwd --variants ";kernels=/tmp/old/kernels_cu" --timing both
    python3 bench/ab.py --calls nvfp4 --ns 4096,8192,16384,32768 --sdpa flash,cudnn   # beside SDPA, same shapes
    python3 bench/ab.py --calls int8_bwd --variants "config.ds_int8=true;"        # two INT8 configs

Variants are ';'-separated; a variant is ','-separated tokens: ``NAME=VALUE`` (or ``NAME``) is a kernel define, passed
to every compile through SAGECUPY_DEFINES; ``kernels=PATH`` compiles the sources of another ``kernels_cu`` folder
through SAGECUPY_KERNELS_DIR (it must have the file layout the host code expects); ``config.FIELD=VALUE`` runs the INT8
calls with the ``default`` config so changed (VALUE true/false, an integer or a word: ``config.ds_int8=true``);
``env.NAME=VALUE`` sets a host development switch (docs/design.md) for the variant, e.g. ``env.SAGECUPY_PDL=0``. The
empty variant is the tree's own kernels without defines, on the default config. Host code is not switched: to compare two trees of Python code, run this once per tree
(``PYTHONPATH=TREE python3 bench/ab.py --hash ...``) and compare the printed times and output hashes.

Shapes are the benchmark's (sagecupy.bench: bf16, batch x N = 16K tokens, heads x D = 2048). Calls (--calls):
  int8_infer, int8_fwd, int8_bwd, int8_fwdbwd   the INT8 inference call, training forward, backward, both
  qat_fwd, qat_bwd, qat_fwdbwd                   the FP4 QAT pair
  nvfp4                                          the NVFP4 forward, whole call (quantization included)
  nvfp4_packed                                   the NVFP4 kernel alone, on operands packed under the same variant
Each row: per variant its time (ms), its speed against the first variant (> 1: faster) and its outputs against the
first variant's ('=' bitwise the same, else the relative L2 difference of the first output); with --sdpa, SDPA's time
on the same shape and each variant's speed against SDPA flash. --timing: b2b (calls back to back, the device's time
when the host keeps ahead, bench.time_ms_b2b), sync (one call between two events, host time before the first launch
included, bench.time_ms), or both.

--once: each call twice per variant and no timing, for a profiler (the first call compiles and records the launches,
so profile from the second: e.g. ncu --launch-skip, bench/tools/profile.sh).
"""
import argparse
import hashlib
import os
import sys

# Forward calls are compared with SDPA's forward, backward calls with its backward (bench_frameworks.bench_sdpa's modes).
SDPA_MODE = {"int8_infer": "fwd", "int8_fwd": "fwd", "int8_bwd": "bwd", "int8_fwdbwd": "fwdbwd", "qat_fwd": "fwd",
             "qat_bwd": "bwd", "qat_fwdbwd": "fwdbwd", "nvfp4": "fwd", "nvfp4_packed": "fwd"}


def parse_variant(text):
    """(defines, kernels dir or None) of one variant's text."""
    defines, kernels = [], None
    for tok in (t.strip() for t in text.split(",")):
        if not tok:
            continue
        if tok.startswith("kernels="):
            kernels = os.path.abspath(os.path.expanduser(tok[len("kernels="):]))
        elif tok.startswith(("config.", "env.")):
            continue  # (variant_config, variant_env)
        elif tok.startswith("SAGECUPY_"):
            raise SystemExit(f"variant token {tok!r}: only kernel defines and kernels=PATH are switched per variant")
        else:
            defines.append(tok)
    return defines, kernels


def variant_config(text):
    """The INT8 config of one variant's text: DEFAULT with its ``config.FIELD=VALUE`` tokens applied, or None when it
    has none (the calls' own default). A field SageBwdConfig does not have, or a value it refuses, raises there."""
    from sagecupy.config import DEFAULT

    changes = {}
    for tok in (t.strip() for t in (text or "").split(",")):
        if not tok.startswith("config."):
            continue
        field, sep, value = tok[len("config."):].partition("=")
        if not sep:
            raise SystemExit(f"variant token {tok!r}: expected config.FIELD=VALUE")
        low = value.strip().lower()
        changes[field.strip()] = (low == "true" if low in ("true", "false")
                                  else int(low) if low.lstrip("-").isdigit() else value.strip())
    if not changes:
        return None
    changes.setdefault("name", "+".join(f"{k}={v}" for k, v in changes.items()))
    return DEFAULT.replace(**changes)


def variant_env(text):
    """{NAME: VALUE} of one variant's ``env.NAME=VALUE`` tokens: host-side development switches (docs/design.md),
    which the launch programs' keys include, so variants of one process record programs of their own."""
    out = {}
    for tok in (t.strip() for t in (text or "").split(",")):
        if tok.startswith("env."):
            name, sep, value = tok[len("env."):].partition("=")
            if not sep or not name.startswith("SAGECUPY_"):
                raise SystemExit(f"variant token {tok!r}: expected env.SAGECUPY_NAME=VALUE")
            out[name] = value
    return out


_CONFIG = None  # the INT8 config of the variant set (set_variant)
_ENV_SET = []  # the environment variables the variant set put there


def set_variant(index, text):
    """Puts variant ``index`` (its text) into the environment the loader reads at every launch; ``text=None`` restores
    the tree's own kernels. Each variant also gets the define SAGE_AB_VARIANT=index, which no kernel reads: with any
    define set the loader compiles only the instances a call launches, not a file's whole list (the NVFP4 forward's
    list takes minutes), and each variant keeps a cache entry of its own."""
    global _CONFIG
    os.environ.pop("SAGECUPY_DEFINES", None)
    os.environ.pop("SAGECUPY_KERNELS_DIR", None)
    while _ENV_SET:
        os.environ.pop(_ENV_SET.pop(), None)
    _CONFIG = variant_config(text)
    if text is None:
        return
    for name, value in variant_env(text).items():
        os.environ[name] = value
        _ENV_SET.append(name)
    defines, kernels = parse_variant(text)
    os.environ["SAGECUPY_DEFINES"] = ",".join([f"SAGE_AB_VARIANT={index}"] + defines)
    if kernels:
        os.environ["SAGECUPY_KERNELS_DIR"] = kernels


def make_call(what, q, k, v, do, causal):
    """(fn timed, fn returning the outputs to compare): the call's state (residuals, packed operands) is made here,
    under the variant set at the time, since a define may change what the pre-passes write."""
    from sagecupy import int8, nvfp4, qat

    if _CONFIG is not None and not what.startswith("int8"):
        raise SystemExit(f"config.FIELD tokens are for the INT8 calls; {what!r} takes none")
    kw = {} if _CONFIG is None else {"config": _CONFIG}
    if what == "int8_infer":
        return (lambda: int8.sage_attention(q, k, v, causal=causal, **kw),
                lambda: int8.sage_attention(q, k, v, causal=causal, return_lse=True, **kw))
    if what == "int8_fwd":
        return (lambda: int8.forward(q, k, v, causal=causal, **kw),
                lambda: int8.forward(q, k, v, causal=causal, return_lse=True, **kw)[:2])
    if what in ("int8_bwd", "qat_bwd"):
        mod = int8 if what == "int8_bwd" else qat
        _, res = mod.forward(q, k, v, causal=causal, **kw)
        return lambda: mod.backward(res, do), lambda: mod.backward(res, do)
    if what in ("int8_fwdbwd", "qat_fwdbwd"):
        mod = int8 if what == "int8_fwdbwd" else qat

        def fwdbwd():
            o, r = mod.forward(q, k, v, causal=causal, **kw)
            return (o,) + tuple(mod.backward(r, do))
        return fwdbwd, fwdbwd
    if what == "qat_fwd":
        return (lambda: qat.forward(q, k, v, causal=causal),
                lambda: qat.forward(q, k, v, causal=causal, return_lse=True)[:2])
    if what == "nvfp4":
        return (lambda: nvfp4.attention(q, k, v, causal=causal),
                lambda: nvfp4.attention(q, k, v, causal=causal, return_lse=True))
    if what == "nvfp4_packed":
        ops = nvfp4.quantize_inputs(q, k, v)
        run = lambda: nvfp4.attention_packed(ops, causal=causal, out_dtype="bfloat16", return_lse=True)  # noqa: E731
        return run, run
    raise SystemExit(f"unknown call {what!r}; known: {', '.join(SDPA_MODE)}")


def _arrays(outs):
    from sagecupy import _checks

    outs = outs if isinstance(outs, tuple) else (outs,)
    return [_checks.raw(x) for x in outs]  # (a BF16Array as its raw bits: bitwise comparison)


def _as_float(x):
    import cupy

    if x.dtype == cupy.uint16:  # bf16 bits -> fp32 values
        return (x.astype(cupy.uint32) << 16).view(cupy.float32)
    return x.astype(cupy.float32)


def compare(ref, got):
    """'=' when every output is bitwise the reference's, else the first differing output's relative L2 difference."""
    import cupy

    for a, b in zip(ref, got):
        if a.shape != b.shape or a.dtype != b.dtype:
            return f"outputs differ in shape or type: {a.shape} {a.dtype} against {b.shape} {b.dtype}"
        if not bool((a == b).all()):
            fa, fb = _as_float(a), _as_float(b)
            return f"rel_l2 {float(cupy.linalg.norm(fb - fa) / max(float(cupy.linalg.norm(fa)), 1e-30)):.1e}"
    return "="


def digest(arrays):
    return hashlib.sha1(b"".join(x.get().tobytes() for x in arrays)).hexdigest()[:12]


def sdpa_times(D, N, causal, backends):
    """{(backend, mode, 'sync' | 'b2b'): ms} from bench_frameworks.bench_sdpa on the same shape (no b2b row for its
    backward)."""
    from sagecupy import bench_frameworks

    out = {}
    for be in backends:
        for r in bench_frameworks.bench_sdpa(D, N, causal, be):
            if r.get("mode") != "error":
                out[(be, r["mode"], "b2b" if r["scope"] == "e2e-b2b" else "sync")] = r["ms"]
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", default="int8_infer,int8_bwd", help="comma-separated: " + ", ".join(SDPA_MODE))
    ap.add_argument("--variants", default=";", help="';'-separated variants (see above); the first is the reference")
    ap.add_argument("--ns", default="4096,16384")
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--causal", default="0,1")
    ap.add_argument("--rounds", type=int, default=2, help="interleaved rounds; each variant's best time is kept")
    ap.add_argument("--timing", default="b2b", choices=("b2b", "sync", "both"))
    ap.add_argument("--sdpa", default="", help="SDPA timed beside, comma-separated: flash, cudnn (that backend forced), "
                                               "default (PyTorch's choice); '' none")
    ap.add_argument("--hash", action="store_true", help="print a hash of each variant's outputs")
    ap.add_argument("--once", action="store_true", help="run each call twice per variant, no timing (profilers)")
    a = ap.parse_args(argv)

    from sagecupy import bench

    variants = a.variants.split(";")
    calls = [c for c in a.calls.split(",") if c]
    for text in variants:  # (reject a bad token, or a config the kernels or a call do not take, before any compile)
        parse_variant(text)
        cfg = variant_config(text)
        if cfg is not None:
            from sagecupy.int8 import _unsupported_config

            why = _unsupported_config(cfg)
            if why:
                raise SystemExit(f"variant {text!r}: {why}")
            if any(not c.startswith("int8") for c in calls):
                raise SystemExit(f"variant {text!r}: config.FIELD tokens are for the INT8 calls only")
    timings = ("b2b", "sync") if a.timing == "both" else (a.timing,)
    timer = {"b2b": lambda fn: bench.time_ms_b2b(fn), "sync": lambda fn: bench.time_ms(fn)}
    for n in map(int, a.ns.split(",")):
        B, H, (q, k, v, do) = bench._inputs(a.d, n, "bfloat16")
        for causal in (c.strip() == "1" for c in a.causal.split(",")):
            sdpa = sdpa_times(a.d, n, causal, [b for b in a.sdpa.split(",") if b]) if a.sdpa and not a.once else {}
            for what in calls:
                best, outs = {}, {}
                for _ in range(1 if a.once else a.rounds):
                    for i, text in enumerate(variants):
                        set_variant(i, text)
                        fn, result = make_call(what, q, k, v, do, causal)
                        if a.once:
                            fn()
                            fn()
                            continue
                        for t in timings:
                            ms = timer[t](fn)
                            best[i, t] = min(best.get((i, t), ms), ms)
                        if i not in outs:
                            outs[i] = _arrays(result())
                set_variant(None, None)
                if a.once:
                    print(f"{what} D={a.d} N={n} causal={int(causal)}: ran", flush=True)
                    continue
                line = f"{what:<12} D={a.d} N={n:<6} B={B} causal={int(causal)}"
                for t in timings:
                    cells = []
                    for i, text in enumerate(variants):
                        ms = best[i, t]
                        cell = f"[{text or 'default'}] {ms:.3f} ms"
                        if i:
                            cell += f" {best[0, t] / ms:.3f}x {compare(outs[0], outs[i])}"
                        flash = sdpa.get(("flash", SDPA_MODE[what], t))
                        if flash:
                            cell += f" ({flash / ms:.2f}x flash)"
                        if a.hash:
                            cell += f" #{digest(outs[i])}"
                        cells.append(cell)
                    base = " ".join(f"{be} {ms:.3f} ms" for (be, mode, tt), ms in sdpa.items()
                                    if mode == SDPA_MODE[what] and tt == t)
                    print(f"{line} {t:<4} | " + " | ".join(cells) + (f" | sdpa: {base}" if base else ""), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
