"""Host time of the PyTorch adapter against the CuPy call (E-ADAPT-HOST in docs/experiments.md). On the GPU machine:

    python3 bench/tools/adapter_host.py pieces    # B = 1, H = 1, N = 128, D = 128: per call, the GPU keeping up
    python3 bench/tools/adapter_host.py profile   # B = 16, H = 16, N = 1K, causal: synchronized calls and a cProfile
    python3 bench/tools/adapter_host.py e2e [TAG] # the adapter against the CuPy call, forward and forward+backward
    python3 bench/tools/adapter_host.py sync [TAG] # host us per call, and synchronized forwards (median of 80)
    python3 bench/tools/adapter_host.py engine    # the backward's host time: autograd's share, the adapter's body
    python3 bench/tools/adapter_host.py split     # host time inside each of the adapter's functions, fwd+bwd

``e2e`` prints one line per dtype and shape, prefixed by TAG (to compare two checkouts, run it once with each on
PYTHONPATH): at B = H = 1, N = 128 the host microseconds per call (median of 5 runs of 100 calls); at B = 16, N = 1K
and B = 4, N = 4K (H = 16, D = 128, causal) the milliseconds per call synchronized after each call (``e2e``) and back
to back (``b2b``), as the benchmark times them. Gradients are taken with ``torch.autograd.grad``, as the benchmark
takes them: ``.backward()`` would add each call's gradients into the leaves' ``.grad``, three element-wise kernels
over Q, K and V that the CuPy call does not run (the figures of `c7664fe` and `4256f91` include them; the last column,
``.backward()`` into ``.grad``, shows what they cost).

``sync`` prints, per dtype, the host microseconds per call at B = H = 1, N = 128 (the GPU keeping up; median of 5
runs) of the inference call, the training forward and the forward+backward through CuPy and through the adapter, then
the synchronized inference forward at B = 16, N = 1K and B = 4, N = 4K (H = 16, D = 128, causal; median of 80 calls,
each followed by a synchronize) through both, with the ratio CuPy ms / adapter ms.

``engine`` splits a backward's host time (B = H = 1, N = 128, D = 128, causal; us per call, the GPU keeping up):
``torch.autograd.grad`` through a kept graph of a trivial ``autograd.Function`` with three inputs (autograd's own
cost) and of ``sagecupy.torch.sage_attention``; the adapter's backward body (dO's view, ``int8.backward``, the
gradients' exchange) called on the main thread; ``int8.backward`` alone on CuPy arrays; and the forwards likewise.

``split`` times the functions of the adapter's forward+backward, each wrapped by a timer (B = H = 1, N = 128,
D = 128, causal; µs per forward+backward, nested times inside their callers').

``pieces`` times whole calls (CuPy, ``sagecupy.torch``, the ``torch.ops`` op, its Python body, the plain
``SageAttentionFunction``) and the adapter's pieces (``to_cupy``, ``from_cupy``, ``on_torch_stream``, argument checks,
config encoding), each as host microseconds per call over 300 calls, bf16 then fp16.
"""
import cProfile
import io
import pstats
import sys
import time

import cupy as cp
import torch

import sagecupy.int8 as s8
import sagecupy.torch as st
from sagecupy.adapters import torch_ops as ops
from sagecupy.config import get_config


def per_call_us(f, n=300):
    for _ in range(20):
        f()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        f()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / n * 1e6


def pieces():
    for dt in (torch.bfloat16, torch.float16):
        print("==", dt)
        q, k, v, do = (torch.randn(1, 1, 128, 128, device="cuda", dtype=dt) for _ in range(4))
        qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))
        qc, kc, vc, dc = (ops.to_cupy(x) for x in (q, k, v, do))
        cfg = ops._encode_config(get_config(None))
        raw = getattr(ops._sage_infer_op, "_init_fn", None)

        def cupy_fb():
            o, res = s8.forward(qc, kc, vc, causal=True)
            s8.backward(res, dc)

        def torch_fb():
            torch.autograd.grad(st.sage_attention(qg, kg, vg, causal=True), (qg, kg, vg), do)

        def function_fb():
            torch.autograd.grad(st.SageAttentionFunction.apply(qg, kg, vg, True), (qg, kg, vg), do)

        def stream():
            with ops.on_torch_stream(q.device):
                pass

        cases = [("cupy infer", lambda: s8.sage_attention(qc, kc, vc, causal=True)),
                 ("torch infer (st.sage_attention)", lambda: st.sage_attention(q, k, v, causal=True)),
                 ("torch.ops infer", lambda: torch.ops.sagecupy.sage_attention_infer(q, k, v, True, None, "HND", cfg))]
        if raw is not None:
            cases.append(("raw infer fn", lambda: raw(q, k, v, True, None, "HND", cfg)))
        cases += [("cupy fwd+bwd", cupy_fb), ("torch fwd+bwd (st)", torch_fb), ("Function fwd+bwd", function_fb),
                  ("to_cupy", lambda: ops.to_cupy(q)), ("from_cupy", lambda: ops.from_cupy(qc)),
                  ("on_torch_stream", stream),
                  ("_as_cupy", lambda: ops._as_cupy(q, "q")), ("_as_torch", lambda: ops._as_torch(qc)),
                  ("torch.cuda.current_stream", lambda: torch.cuda.current_stream(q.device.index)),
                  ("_dispatcher_free", lambda: st._dispatcher_free(q, k, v)),
                  ("_check_inputs", lambda: ops._check_inputs(("q", q), ("k", k), ("v", v))),
                  ("encode_config", lambda: ops._encode_config(get_config(None))),
                  ("decode_config", lambda: ops._decode_config(cfg)),
                  ("torch.empty", lambda: torch.empty(1, device="cuda")), ("cupy.empty", lambda: cp.empty(1))]
        for name, f in cases:
            print(f"{name:34s} {per_call_us(f):8.1f} us/call")


def profile():
    B, H, N, D = 16, 16, 1024, 128
    for dt in (torch.bfloat16, torch.float16):
        q, k, v, do = (torch.randn(B, H, N, D, device="cuda", dtype=dt, requires_grad=i < 3) for i in range(4))

        def fwd():
            st.sage_attention(q, k, v, causal=True)
            torch.cuda.synchronize()

        def fwdbwd():
            torch.autograd.grad(st.sage_attention(q, k, v, causal=True), (q, k, v), do)
            torch.cuda.synchronize()

        fns = [("torch fwd", fwd), ("torch fwdbwd", fwdbwd)]
        if dt == torch.float16:
            qc, kc, vc = (cp.asarray(x.detach()) for x in (q, k, v))
            fns.append(("cupy fwd", lambda: (s8.sage_attention(qc, kc, vc, causal=True),
                                             cp.cuda.runtime.deviceSynchronize())))
        for name, f in fns:
            ts = []
            for i in range(35):
                t = time.perf_counter()
                f()
                if i >= 5:
                    ts.append(time.perf_counter() - t)
            print(dt, name, "median ms %.3f min %.3f" % (sorted(ts)[15] * 1e3, min(ts) * 1e3))
        torch.cuda.synchronize()
        t = time.process_time()  # the host's CPU time per call, the GPU left to catch up
        for _ in range(50):
            st.sage_attention(q, k, v, causal=True)
        print(dt, "torch fwd nosync cpu ms/call %.3f" % ((time.process_time() - t) / 50 * 1e3))
        torch.cuda.synchronize()
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(50):
            fwdbwd()
        pr.disable()
        out = io.StringIO()
        pstats.Stats(pr, stream=out).sort_stats("tottime").print_stats(25)
        print(out.getvalue()[:6000])


def e2e(tag=""):
    from sagecupy._bench_common import time_ms, time_ms_b2b

    kw = dict(event=lambda: torch.cuda.Event(enable_timing=True), sync=torch.cuda.synchronize)
    for dt in (torch.bfloat16, torch.float16):
        for B, H, N in ((1, 1, 128), (16, 16, 1024), (4, 16, 4096)):
            q, k, v, do = (torch.randn(B, H, N, 128, device="cuda", dtype=dt) for _ in range(4))
            qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))
            qc, kc, vc, dc = (ops.to_cupy(x) for x in (q, k, v, do))

            def cupy_fb():
                o, res = s8.forward(qc, kc, vc, causal=True)
                s8.backward(res, dc)

            cases = (("cupy fwd", lambda: s8.sage_attention(qc, kc, vc, causal=True)),
                     ("torch fwd", lambda: st.sage_attention(q, k, v, causal=True)),
                     ("cupy fwdbwd", cupy_fb),
                     ("torch fwdbwd", lambda: torch.autograd.grad(st.sage_attention(qg, kg, vg, causal=True),
                                                                  (qg, kg, vg), do)),
                     ("torch fwdbwd into .grad", lambda: st.sage_attention(qg, kg, vg, causal=True).backward(do)))
            row = []
            for name, f in cases:
                if N == 128:
                    row.append(f"{name} host {sorted(per_call_us(f, 100) for _ in range(5))[2]:.0f}us")
                else:
                    row.append(f"{name} e2e {time_ms(f, rep=15, **kw):.3f} b2b {time_ms_b2b(f, **kw):.3f}")
            print(tag, str(dt)[6:], f"B={B} N={N} causal=1 |", " | ".join(row), flush=True)


def host_us(f, n, warmup):
    """Host microseconds per call of ``f``, the GPU keeping up: the median of 5 runs of n / 5 calls."""
    for _ in range(warmup):
        f()
    torch.cuda.synchronize()
    ts = []
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(n // 5):
            f()
        ts.append((time.perf_counter() - t) / (n // 5) * 1e6)
        torch.cuda.synchronize()
    return sorted(ts)[2]


def sync(tag=""):
    for dt in (torch.bfloat16, torch.float16):
        q, k, v, do = (torch.randn(1, 1, 128, 128, device="cuda", dtype=dt) for _ in range(4))
        qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))
        qc, kc, vc, dc = (ops.to_cupy(x) for x in (q, k, v, do))

        def cupy_fb():
            o, res = s8.forward(qc, kc, vc, causal=True)
            s8.backward(res, dc)

        cases = [("cupy infer", lambda: s8.sage_attention(qc, kc, vc, causal=True)),
                 ("torch infer", lambda: st.sage_attention(q, k, v, causal=True)),
                 ("cupy fwd(train)", lambda: s8.forward(qc, kc, vc, causal=True)),
                 ("torch fwd(grad)", lambda: st.sage_attention(qg, kg, vg, causal=True)),
                 ("cupy fwdbwd", cupy_fb),
                 ("torch fwdbwd", lambda: torch.autograd.grad(st.sage_attention(qg, kg, vg, causal=True),
                                                              (qg, kg, vg), do))]
        print(tag, str(dt)[6:], " | ".join(f"{n} {host_us(f, 1500, 50):.0f}us" for n, f in cases), flush=True)
    for B, N in ((16, 1024), (4, 4096)):
        for dt in (torch.bfloat16, torch.float16):
            q, k, v = (torch.randn(B, 16, N, 128, device="cuda", dtype=dt) for _ in range(3))
            qc, kc, vc = (ops.to_cupy(x) for x in (q, k, v))
            row = []
            for name, f in (("cupy", lambda: s8.sage_attention(qc, kc, vc, causal=True)),
                            ("torch", lambda: st.sage_attention(q, k, v, causal=True))):
                for _ in range(10):
                    f()
                torch.cuda.synchronize()
                ts = []
                for _ in range(80):
                    t = time.perf_counter()
                    f()
                    torch.cuda.synchronize()
                    ts.append(time.perf_counter() - t)
                row.append((name, sorted(ts)[40] * 1e3))
            print(tag, str(dt)[6:], f"B={B} N={N} causal fwd sync ms: " + " ".join(f"{n} {t:.3f}" for n, t in row)
                  + f" ratio {row[0][1] / row[1][1]:.3f}", flush=True)


class _Ident3(torch.autograd.Function):
    """A trivial three-input Function: what autograd costs around a backward that does nothing."""

    @staticmethod
    def forward(ctx, q, k, v):
        return q.clone()

    @staticmethod
    def backward(ctx, g):
        return g, g, g


def engine():
    for dt in (torch.bfloat16, torch.float16):
        q, k, v, do = (torch.randn(1, 1, 128, 128, device="cuda", dtype=dt) for _ in range(4))
        qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))
        qc, kc, vc, dc = (ops.to_cupy(x) for x in (q, k, v, do))
        out_i = _Ident3.apply(qg, kg, vg)
        out_s = st.sage_attention(qg, kg, vg, causal=True)
        _, res = s8.forward(qc, kc, vc, causal=True)

        def body():  # backward_from_ctx's work, on this thread
            with ops.on_torch_stream(q.device):
                g = s8.backward(res, ops._as_cupy(do.contiguous(), "do"))
                return [ops._as_torch(x) for x in g]

        cases = [("ident3 bwd (engine)", lambda: torch.autograd.grad(out_i, (qg, kg, vg), do, retain_graph=True)),
                 ("sage bwd (engine+body)", lambda: torch.autograd.grad(out_s, (qg, kg, vg), do, retain_graph=True)),
                 ("bwd body on main thread", body),
                 ("cupy s8.backward", lambda: s8.backward(res, dc)),
                 ("ident3 fwd", lambda: _Ident3.apply(qg, kg, vg)),
                 ("sage fwd(grad)", lambda: st.sage_attention(qg, kg, vg, causal=True)),
                 ("cupy s8.forward", lambda: s8.forward(qc, kc, vc, causal=True))]
        print(str(dt)[6:], " | ".join(f"{n} {host_us(f, 600, 30):.0f}us" for n, f in cases), flush=True)


def split():
    """Wall time inside the adapter's functions per forward+backward (B = H = 1, N = 128, D = 128, causal), each
    wrapped by a timer (nested times are inside their callers'): one unwrapped run, then two wrapped runs."""
    import collections

    from sagecupy.adapters import torch as tad

    inside = collections.defaultdict(float)

    def wrap(obj, name, label, static=False):
        f = getattr(obj, name)

        def timed(*a, **kw):
            t = time.perf_counter()
            try:
                return f(*a, **kw)
            finally:
                inside[label] += time.perf_counter() - t

        setattr(obj, name, staticmethod(timed) if static else timed)

    def run(tag, n=400):
        for dt in (torch.bfloat16, torch.float16):
            q, k, v, do = (torch.randn(1, 1, 128, 128, device="cuda", dtype=dt) for _ in range(4))
            qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))

            def fb():
                return torch.autograd.grad(st.sage_attention(qg, kg, vg, causal=True), (qg, kg, vg), do)

            for _ in range(30):
                fb()
            torch.cuda.synchronize()
            inside.clear()
            t = time.perf_counter()
            for _ in range(n):
                fb()
            total = (time.perf_counter() - t) / n * 1e6
            torch.cuda.synchronize()
            print(tag, str(dt)[6:], f"fwdbwd {total:.0f}us |",
                  " | ".join(f"{k} {v / n * 1e6:.1f}" for k, v in inside.items()), flush=True)

    run("plain")
    wrap(tad, "sage_attention", "st.sage_attention")
    wrap(ops.SageEagerFunction, "forward", "Function.forward", static=True)
    wrap(ops.SageEagerFunction, "backward", "Function.backward", static=True)
    for name in ("_int8_forward", "_int8_backward", "_as_cupy", "_as_torch", "_raw_as_torch"):
        wrap(ops, name, name)
    for name in ("_training", "_launch_forward", "_backward_replay", "_run_backward"):
        wrap(s8, name, "int8." + name)
    run("wrapped")
    run("wrapped")


if __name__ == "__main__":
    mode = sys.argv[1] if len(sys.argv) > 1 else "pieces"
    {"pieces": pieces, "profile": profile, "e2e": e2e, "sync": sync, "engine": engine, "split": split}[mode](
        *sys.argv[2:])
