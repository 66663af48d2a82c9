"""Associative recall in PyTorch: the model of examples/recall.py with its attention through sagecupy.torch.

Same task (n_pairs key-value pairs, then a query key; the model must output the value stored with that
key), same model (one attention layer with QK-norm), same data and same initialization as
``examples/recall.py`` (its ``batch`` and ``make_model`` draw them), trained with ``torch.optim.Adam``
(the same update as the shim's Adam). Attention implementations:

* ``sdpa``: ``torch.nn.functional.scaled_dot_product_attention`` in float32 (full-precision attention);
* ``sagebwd``: ``sagecupy.torch.sage_attention``, INT8 SageBwd with the default config (q, k, v cast to
  fp16 for the kernels; the gradients come back through the cast in float32);
* ``sagebwd-paper``: the same with the published per-block granularities.

    python examples/recall_torch.py --steps 300 --out recall_torch.json
    python examples/recall_torch.py --impl sdpa --device cpu --steps 50    # no GPU: the SDPA baseline only

Prints the loss curve and writes it as JSON with --out: one object per implementation, as recall.py
writes (``backend`` is ``"torch"``, or ``"torch.compile"`` with --compile).
"""
import argparse
import importlib.util
import json
import sys
import time
from pathlib import Path

IMPLS = ("sdpa", "sagebwd", "sagebwd-paper")


def _recall():
    """examples/recall.py, for its data generator and initialization."""
    spec = importlib.util.spec_from_file_location("recall_example", Path(__file__).with_name("recall.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def init_params(recall, seed, vocab, n_values, C, H, device):
    """recall.py's initialization (same draws in the same order), as float32 leaf tensors."""
    import numpy as np
    import torch

    variables = recall.make_model(np, np.random.default_rng(seed), vocab, n_values, C, H)
    return {name: torch.tensor(var.value, dtype=torch.float32, device=device, requires_grad=True)
            for name, var in variables.items()}


def rms_norm(x, weight, eps=1e-6):
    """``x / rms(x) * weight`` over the last axis (QK-norm), as the shim's ``rms_norm``."""
    import torch

    return x * torch.rsqrt((x * x).mean(dim=-1, keepdim=True) + eps) * weight


def loss_of(params, x, labels, impl, H):
    """Cross-entropy of the value predicted at the last (query) position."""
    import torch
    import torch.nn.functional as F

    h = x @ params["emb"]
    B, N, C = h.shape

    def heads(t):  # (B, N, C) -> (B, H, N, D), a view
        return t.view(B, N, H, C // H).transpose(1, 2)

    q = rms_norm(heads(h @ params["wq"]), params["gq"])
    k = rms_norm(heads(h @ params["wk"]), params["gk"])
    v = heads(h @ params["wv"])
    if impl == "sdpa":
        o = F.scaled_dot_product_attention(q, k, v)
    else:
        from sagecupy.torch import sage_attention

        config = "paper" if impl == "sagebwd-paper" else "default"
        o = sage_attention(q.to(torch.float16), k.to(torch.float16), v.to(torch.float16), config=config)
        o = o.to(torch.float32)
    y = o.transpose(1, 2).reshape(B, N, C) @ params["wo"]
    return F.cross_entropy(y[:, -1] @ params["out"], labels)


def train(impl, *, steps=300, bs=32, n_pairs=8, n_keys=16, n_values=16, C=128, H=2, lr=3e-3, seed=0,
          device="cuda", compiled=False, log_every=10, log=print):
    """Train one model; returns the loss curve (one float per step)."""
    import numpy as np
    import torch

    if impl not in IMPLS:
        raise ValueError(f"impl={impl!r} is not supported; supported: {IMPLS}")
    recall = _recall()
    params = init_params(recall, seed, n_keys + n_values, n_values, C, H, device)
    opt = torch.optim.Adam(params.values(), lr=lr)
    step_loss = torch.compile(loss_of, fullgraph=True) if compiled else loss_of
    data_rng = np.random.default_rng(seed + 1)
    curve = []
    t0 = time.time()
    for step in range(steps):
        x, labels = recall.batch(np, data_rng, bs, n_pairs, n_keys, n_values)
        x = torch.as_tensor(x, dtype=torch.float32, device=device)
        labels = torch.as_tensor(labels, device=device)
        loss = step_loss(params, x, labels, impl, H)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        curve.append(loss.item())
        if log and (step % log_every == 0 or step == steps - 1):
            log(f"{impl:<14} step {step:4d}  loss {curve[-1]:.4f}  ({time.time() - t0:.1f} s)")
    return curve


def _positive(text):
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text} is not a positive integer")
    return value


def build_parser():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--impl", default=",".join(IMPLS),
                    help=f"comma-separated attention implementations, from {', '.join(IMPLS)} [default: all]")
    ap.add_argument("--steps", type=_positive, default=300, help="training steps per implementation [default: 300]")
    ap.add_argument("--seed", type=int, default=0, help="seed of the initialization and the data [default: 0]")
    ap.add_argument("--device", default="cuda",
                    help="PyTorch device: cuda (needs a CUDA device) or cpu (sdpa only) [default: cuda]")
    ap.add_argument("--compile", action="store_true", help="torch.compile(fullgraph=True) the loss")
    ap.add_argument("--out", default=None, metavar="FILE.json",
                    help="write the loss curves here as JSON (one object per implementation, as recall.py)")
    return ap


def _fail(ap, message):
    """One line on stderr, exit status 1 (a machine that cannot run the request; not a malformed command line)."""
    print(f"{ap.prog}: error: {message}", file=sys.stderr)
    sys.exit(1)


def _check_machine(ap, impls, device):
    """Exit with one line when this machine lacks what the run needs (PyTorch, a CUDA device, CuPy)."""
    try:
        import torch
    except ImportError as exc:
        _fail(ap, f"needs PyTorch ({exc}): pip install torch")
    if device.startswith("cuda") and not torch.cuda.is_available():
        _fail(ap, f"--device {device}: PyTorch sees no CUDA device; --impl sdpa --device cpu runs on the CPU")
    if any(impl != "sdpa" for impl in impls):
        try:
            from sagecupy._loader import gpu_status

            import sagecupy.torch  # noqa: F401
        except ImportError as exc:
            _fail(ap, f"--impl sagebwd needs sagecupy's PyTorch adapter ({exc})")
        ok, why = gpu_status()
        if not ok:
            _fail(ap, f"--impl sagebwd needs CuPy and a CUDA device: {why}")


def main(argv=None):
    ap = build_parser()
    a = ap.parse_args(argv)
    impls = a.impl.split(",")
    for impl in impls:
        if impl not in IMPLS:
            ap.error(f"--impl: {impl!r} is not one of {', '.join(IMPLS)}")
        if impl != "sdpa" and not a.device.startswith("cuda"):
            ap.error(f"--impl {impl} runs the sagecupy GPU kernels: it needs --device cuda")
    _check_machine(ap, impls, a.device)
    results = []
    for impl in impls:
        curve = train(impl, steps=a.steps, seed=a.seed, device=a.device, compiled=a.compile)
        results.append(dict(impl=impl, backend="torch.compile" if a.compile else "torch", steps=a.steps, seed=a.seed,
                            final_loss=curve[-1], loss=curve))
    print("final losses: " + ", ".join(f"{r['impl']} {r['final_loss']:.4f}" for r in results))
    if a.out:
        with open(a.out, "w") as fh:
            json.dump(results, fh)


if __name__ == "__main__":
    sys.exit(main())
