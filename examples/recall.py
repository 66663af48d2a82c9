"""Associative recall with a one-layer attention model, trained through sagecupy's autograd shim.

Each sequence holds n_pairs (key, value) pairs — position i carries the sum of its key's and its value's
embeddings — followed by a query key; the model must output the value stored with that key. One
attention layer with QK-norm solves it: the query has to attend to the position holding its key.
Attention implementations compared on the same data and initialization:

* ``fpa``: full-precision attention (cuBLAS through CuPy on the GPU; float64 NumPy on the CPU);
* ``sagebwd``: INT8 SageBwd, default config (the GPU kernels; on the CPU the float64 simulator of them);
* ``sagebwd-paper``: the same with the published per-block granularities.

    python examples/recall.py --backend cupy --steps 300 --out recall.json   # GPU
    python examples/recall.py --backend numpy --steps 100                     # CPU (reference)

Prints the loss curve and writes it as JSON (one object per implementation) with --out.
"""
import argparse
import json
import sys
import time


def make_model(xp, rng, vocab, n_values, C, H):
    from sagecupy.autograd import Variable

    def w(*shape, scale):
        return Variable(xp.asarray(rng.standard_normal(shape) * scale))

    D = C // H
    return {
        "emb": w(vocab, C, scale=1.0), "wq": w(C, C, scale=C ** -0.5), "wk": w(C, C, scale=C ** -0.5),
        "wv": w(C, C, scale=C ** -0.5), "wo": w(C, C, scale=C ** -0.5), "out": w(C, n_values, scale=C ** -0.5),
        "gq": Variable(xp.ones(D) * 2.0), "gk": Variable(xp.ones(D) * 2.0),
    }


def batch(xp, rng, bs, n_pairs, n_keys, n_values):
    """Multi-hot inputs (bs, n_pairs + 1, n_keys + n_values) and the labels (bs,) in [0, n_values)."""
    import numpy as np

    x = np.zeros((bs, n_pairs + 1, n_keys + n_values))
    labels = np.zeros(bs, dtype=np.int64)
    for b in range(bs):
        keys = rng.choice(n_keys, n_pairs, replace=False)
        vals = rng.integers(0, n_values, n_pairs)
        x[b, np.arange(n_pairs), keys] = 1.0
        x[b, np.arange(n_pairs), n_keys + vals] = 1.0
        j = rng.integers(0, n_pairs)
        x[b, n_pairs, keys[j]] = 1.0
        labels[b] = vals[j]
    return xp.asarray(x), xp.asarray(labels)


def loss_of(params, x, labels, impl, H, attn_dtype):
    from sagecupy import autograd as ag

    h = ag.linear(x, params["emb"])
    q = ag.rms_norm(ag.split_heads(ag.linear(h, params["wq"]), H), params["gq"])
    k = ag.rms_norm(ag.split_heads(ag.linear(h, params["wk"]), H), params["gk"])
    v = ag.split_heads(ag.linear(h, params["wv"]), H)
    if attn_dtype is not None:  # the INT8 kernels take fp16 inputs; gradients come back in float32
        q, k, v = (ag.cast(t, attn_dtype) for t in (q, k, v))
    o = ag.attention(q, k, v, impl="fpa" if impl == "fpa" else "sagebwd",
                     config="paper" if impl == "sagebwd-paper" else None)
    if attn_dtype is not None:
        o = ag.cast(o, "float32")
    y = ag.linear(ag.merge_heads(o), params["wo"])
    logits = ag.linear(ag.take(y, -1, axis=1), params["out"])
    return ag.cross_entropy(logits, labels)


def train(impl, *, backend="numpy", steps=100, bs=32, n_pairs=8, n_keys=16, n_values=16, C=128, H=2, lr=3e-3,
          seed=0, log_every=10, log=print):
    import numpy as np

    from sagecupy.autograd import Adam

    if backend == "cupy":
        import cupy as xp

        attn_dtype = "float16" if impl != "fpa" else None
        def to_dev(a):  # float32 on the GPU
            return a.astype(xp.float32)
    else:
        xp = np
        attn_dtype = None

        def to_dev(a):
            return a
    rng = np.random.default_rng(seed)
    params = make_model(np, rng, n_keys + n_values, n_values, C, H)
    for p in params.values():
        p.value = to_dev(xp.asarray(p.value))
    opt = Adam(params.values(), lr=lr)
    data_rng = np.random.default_rng(seed + 1)
    curve = []
    t0 = time.time()
    for step in range(steps):
        x, labels = batch(np, data_rng, bs, n_pairs, n_keys, n_values)
        loss = loss_of(params, to_dev(xp.asarray(x)), xp.asarray(labels), impl, H, attn_dtype)
        loss.backward()
        opt.step()
        curve.append(float(loss.value))
        if log and (step % log_every == 0 or step == steps - 1):
            log(f"{impl:<14} step {step:4d}  loss {curve[-1]:.4f}  ({time.time() - t0:.1f} s)")
    return curve


IMPLS = ("fpa", "sagebwd", "sagebwd-paper")


def _positive(text):
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text} is not a positive integer")
    return value


def build_parser():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", choices=("numpy", "cupy"), default="numpy",
                    help="numpy: float64 on the CPU (the reference attention and the SageBwd simulator); cupy: the "
                         "GPU (cuBLAS and the INT8 kernels; needs CuPy and a CUDA device) [default: numpy]")
    ap.add_argument("--impl", default=",".join(IMPLS),
                    help=f"comma-separated attention implementations, from {', '.join(IMPLS)} [default: all]")
    ap.add_argument("--steps", type=_positive, default=100, help="training steps per implementation [default: 100]")
    ap.add_argument("--seed", type=int, default=0, help="seed of the initialization and the data [default: 0]")
    ap.add_argument("--out", default=None, metavar="FILE.json",
                    help="write the loss curves here as JSON (one object per implementation)")
    return ap


def _fail(ap, message):
    """One line on stderr, exit status 1 (a machine that cannot run the request; not a malformed command line)."""
    print(f"{ap.prog}: error: {message}", file=sys.stderr)
    sys.exit(1)


def main(argv=None):
    ap = build_parser()
    a = ap.parse_args(argv)
    impls = a.impl.split(",")
    for impl in impls:
        if impl not in IMPLS:
            ap.error(f"--impl: {impl!r} is not one of {', '.join(IMPLS)}")
    try:
        from sagecupy._loader import gpu_status
    except ImportError as exc:
        _fail(ap, f"sagecupy is not importable ({exc}); install it: pip install .")
    if a.backend == "cupy":
        ok, why = gpu_status()
        if not ok:
            _fail(ap, f"--backend cupy needs CuPy and a CUDA device: {why}; --backend numpy runs on the CPU")
    results = []
    for impl in impls:
        curve = train(impl, backend=a.backend, steps=a.steps, seed=a.seed)
        results.append(dict(impl=impl, backend=a.backend, steps=a.steps, seed=a.seed, final_loss=curve[-1],
                            loss=curve))
    print("final losses: " + ", ".join(f"{r['impl']} {r['final_loss']:.4f}" for r in results))
    if a.out:
        with open(a.out, "w") as fh:
            json.dump(results, fh)


if __name__ == "__main__":
    sys.exit(main())
