"""Associative recall in JAX: the model of examples/recall.py, attention through sagecupy.jax.

The task, the model (one attention layer with QK-norm, C=128, two heads of D=64), the data stream, the
initialization and the optimizer (Adam, lr 3e-3) are those of ``examples/recall.py``; here the model is
plain ``jax.numpy``, each training step is one ``jax.jit``-compiled function, and the attention is

* ``fpa``: full-precision attention in float32 (``jnp``, matmuls at ``precision="highest"``);
* ``sagebwd``: INT8 SageBwd through :func:`sagecupy.jax.sage_attention` (fp16 inputs, default config);
* ``sagebwd-paper``: the same with the published per-block granularities.

    python examples/recall_jax.py --steps 300 --out recall_jax.json

Needs JAX with its CUDA plugin, CuPy and a GPU for the sagebwd implementations (``fpa`` runs anywhere).
Prints the loss curve and writes it as JSON with --out, in recall.py's format (``backend`` is ``"jax"``).
The first sagebwd step also compiles the INT8 kernels (NVRTC), unless CuPy's disk cache has them.
"""
import argparse
import functools
import json
import os
import sys
import time

# CuPy's kernels allocate beside XLA: keep JAX from taking 75% of the GPU at start-up.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import numpy as np  # noqa: E402

IMPLS = ("fpa", "sagebwd", "sagebwd-paper")


def init_params(rng, vocab, n_values, C, H):
    """The parameters of recall.make_model, drawn in the same order with the same scales (float32)."""
    D = C // H
    shapes = (("emb", (vocab, C), 1.0), ("wq", (C, C), C ** -0.5), ("wk", (C, C), C ** -0.5),
              ("wv", (C, C), C ** -0.5), ("wo", (C, C), C ** -0.5), ("out", (C, n_values), C ** -0.5))
    params = {name: (rng.standard_normal(shape) * scale).astype(np.float32) for name, shape, scale in shapes}
    params["gq"] = np.full(D, 2.0, np.float32)
    params["gk"] = np.full(D, 2.0, np.float32)
    return params


def batch(rng, bs, n_pairs, n_keys, n_values):
    """Multi-hot inputs (bs, n_pairs + 1, n_keys + n_values) and labels (bs,): recall.batch, same draws."""
    x = np.zeros((bs, n_pairs + 1, n_keys + n_values), np.float32)
    labels = np.zeros(bs, dtype=np.int32)
    for b in range(bs):
        keys = rng.choice(n_keys, n_pairs, replace=False)
        vals = rng.integers(0, n_values, n_pairs)
        x[b, np.arange(n_pairs), keys] = 1.0
        x[b, np.arange(n_pairs), n_keys + vals] = 1.0
        j = rng.integers(0, n_pairs)
        x[b, n_pairs, keys[j]] = 1.0
        labels[b] = vals[j]
    return x, labels


def rms_norm(x, weight, eps=1e-6):
    import jax.numpy as jnp

    return x / jnp.sqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps) * weight


def fpa(q, k, v):
    """softmax(q k^T / sqrt(D)) v in float32, (B, H, N, D)."""
    import jax
    import jax.numpy as jnp

    s = jnp.einsum("bhqd,bhkd->bhqk", q, k, precision="highest") / jnp.sqrt(jnp.float32(q.shape[-1]))
    return jnp.einsum("bhqk,bhkd->bhqd", jax.nn.softmax(s, axis=-1), v, precision="highest")


def attention(q, k, v, impl):
    if impl == "fpa":
        return fpa(q, k, v)
    import jax.numpy as jnp

    from sagecupy.jax import sage_attention

    o = sage_attention(*(t.astype(jnp.float16) for t in (q, k, v)),
                       config="paper" if impl == "sagebwd-paper" else None)
    return o.astype(jnp.float32)


def loss_fn(params, x, labels, impl, H):
    import jax
    import jax.numpy as jnp

    def linear(a, w):
        return jnp.matmul(a, w, precision="highest")

    def heads(a):  # (B, N, H*D) -> (B, H, N, D)
        B, N, C = a.shape
        return a.reshape(B, N, H, C // H).transpose(0, 2, 1, 3)

    h = linear(x, params["emb"])
    q = rms_norm(heads(linear(h, params["wq"])), params["gq"])
    k = rms_norm(heads(linear(h, params["wk"])), params["gk"])
    v = heads(linear(h, params["wv"]))
    o = attention(q, k, v, impl)
    B, _, N, D = o.shape
    y = linear(o.transpose(0, 2, 1, 3).reshape(B, N, H * D), params["wo"])
    logp = jax.nn.log_softmax(linear(y[:, -1], params["out"]), axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, labels[:, None], axis=-1))


def adam_update(params, grads, state, lr, b1=0.9, b2=0.999, eps=1e-8):
    """One Adam step (bias-corrected, as sagecupy.autograd.Adam): (new params, new state)."""
    import jax
    import jax.numpy as jnp

    m, v, t = state
    t = t + 1
    m = jax.tree.map(lambda m_, g: b1 * m_ + (1 - b1) * g, m, grads)
    v = jax.tree.map(lambda v_, g: b2 * v_ + (1 - b2) * g * g, v, grads)
    c1, c2 = 1 - b1 ** t, 1 - b2 ** t
    params = jax.tree.map(lambda p, m_, v_: p - lr * (m_ / c1) / (jnp.sqrt(v_ / c2) + eps), params, m, v)
    return params, (m, v, t)


def train(impl, *, steps=300, bs=32, n_pairs=8, n_keys=16, n_values=16, C=128, H=2, lr=3e-3, seed=0,
          log_every=10, log=print):
    """Train one model with attention ``impl``; returns the loss curve (one float per step)."""
    import jax
    import jax.numpy as jnp

    rng = np.random.default_rng(seed)
    params = jax.tree.map(jnp.asarray, init_params(rng, n_keys + n_values, n_values, C, H))
    zeros = jax.tree.map(jnp.zeros_like, params)
    state = (zeros, zeros, jnp.zeros((), jnp.float32))

    @jax.jit
    def step(params, state, x, labels):
        loss, grads = jax.value_and_grad(functools.partial(loss_fn, impl=impl, H=H))(params, x, labels)
        params, state = adam_update(params, grads, state, lr)
        return params, state, loss

    data_rng = np.random.default_rng(seed + 1)
    curve = []
    t0 = time.time()
    for i in range(steps):
        x, labels = batch(data_rng, bs, n_pairs, n_keys, n_values)
        params, state, loss = step(params, state, jnp.asarray(x), jnp.asarray(labels))
        curve.append(float(loss))
        if log and (i % log_every == 0 or i == steps - 1):
            log(f"{impl:<14} step {i:4d}  loss {curve[-1]:.4f}  ({time.time() - t0:.1f} s)")
    return curve


def _positive(text):
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text} is not a positive integer")
    return value


def build_parser():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--impl", default=",".join(IMPLS),
                    help=f"comma-separated attention implementations, from {', '.join(IMPLS)} [default: all]; "
                         f"the sagebwd ones need JAX's CUDA plugin, CuPy and a GPU")
    ap.add_argument("--steps", type=_positive, default=300, help="training steps per implementation [default: 300]")
    ap.add_argument("--seed", type=int, default=0, help="seed of the initialization and the data [default: 0]")
    ap.add_argument("--out", default=None, metavar="FILE.json",
                    help="write the loss curves here as JSON (one object per implementation, as recall.py)")
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
        import jax
    except ImportError as exc:
        _fail(ap, f"needs JAX ({exc}): pip install jax ('jax[cuda13]' with the GPU plugin)")
    if any(impl != "fpa" for impl in impls):
        try:
            from sagecupy.jax import is_available
        except ImportError as exc:
            _fail(ap, f"--impl sagebwd needs sagecupy's JAX adapter ({exc})")
        ok, why = is_available()
        if not ok:
            _fail(ap, f"--impl sagebwd needs the JAX adapter: {why}")
    print(f"jax {jax.__version__} on {jax.devices()[0]}", file=sys.stderr)
    results = []
    for impl in impls:
        curve = train(impl, steps=a.steps, seed=a.seed)
        results.append(dict(impl=impl, backend="jax", steps=a.steps, seed=a.seed, final_loss=curve[-1], loss=curve))
    print("final losses: " + ", ".join(f"{r['impl']} {r['final_loss']:.4f}" for r in results))
    if a.out:
        with open(a.out, "w") as fh:
            json.dump(results, fh)


if __name__ == "__main__":
    sys.exit(main())
