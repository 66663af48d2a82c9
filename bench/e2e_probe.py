"""Where an end-to-end call's time goes beyond its attention kernel (INT8 forward by default; on the GPU machine):

    python bench/e2e_probe.py [--family int8|nvfp4|qat] [--call infer|train] [--profile]

(``--call``, INT8 only: the inference call ``sage_attention``, the default since the twenty-third session, or the
training forward ``int8.forward``, which also keeps the backward's residuals; earlier sessions' figures are the
training forward's.)

Per case (D = 128, N = 4K and 16K, causal and not): the call timed as ``bench.time_ms`` does (events around one
call, synchronized after each: host time before the first launch counts), the same call back to back (20 calls
between two events, no synchronization between them: the device's time when the host keeps ahead, as
``triton.testing.do_bench`` and ``torch.utils.benchmark`` measure), the kernel alone, the pre-passes alone, the
host's own time per call (wall time of issuing 20 calls), and SDPA flash both ways; the kernel and the pre-passes
are also timed synchronized (their share of the call's synchronization overhead). ``--profile``: cProfile of 100
calls, the 20 functions with the most own time and the 20 with the most cumulative time.
"""
import argparse
import cProfile
import pstats
import time

import cupy

from sagecupy import bench, int8, nvfp4, qat


def back_to_back_ms(fn):
    """bench.time_ms_b2b with 20 calls per round (CuPy events)."""
    return bench.time_ms_b2b(fn, 3, calls=20)


def host_ms(fn, n=20):
    cupy.cuda.get_current_stream().synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    t1 = time.perf_counter()
    cupy.cuda.get_current_stream().synchronize()
    return (t1 - t0) * 1e3 / n


def sdpa_ms(D, N, causal):
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    B, H = bench._shape(D, N)
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn((B, H, N, D), device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
    F = torch.nn.functional.scaled_dot_product_attention
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]), torch.no_grad():
        fn = lambda: F(q, k, v, is_causal=causal)  # noqa: E731
        synced = bench.time_ms(fn, 3, 10)  # torch and cupy share the default (legacy) stream here
        b2b = bench.time_ms_b2b(fn, 3, calls=20, event=lambda: torch.cuda.Event(enable_timing=True),
                                sync=torch.cuda.synchronize)
    return synced, b2b


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--family", default="int8", choices=("int8", "nvfp4", "qat"))
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--ns", default="4096,16384")
    ap.add_argument("--call", default="infer", choices=("infer", "train"),
                    help="int8: the inference call (sage_attention, default) or the training forward (forward)")
    a = ap.parse_args()
    D = 128
    for N in (int(x) for x in a.ns.split(",")):
        B, H, (q, k, v, _) = bench._inputs(D, N, "bfloat16")
        for causal in (False, True):
            if a.family == "int8":
                inf = a.call == "infer"
                call = ((lambda: int8.sage_attention(q, k, v, causal=causal)) if inf  # noqa: E731
                        else (lambda: int8.forward(q, k, v, causal=causal)))
                p, c, pre = int8._preprocess_forward(q, k, v, causal=causal, sm_scale=None, layout="HND",
                                                     config=None, inference=inf)
                kern = lambda: int8._launch_forward(p, c, pre)  # noqa: E731
                prep = lambda: int8._preprocess_forward(q, k, v, causal=causal, sm_scale=None,  # noqa: E731
                                                        layout="HND", config=None, inference=inf)
            elif a.family == "nvfp4":
                call = lambda: nvfp4.attention(q, k, v, causal=causal)  # noqa: E731
                kern = prep = None
            else:
                call = lambda: qat.forward(q, k, v, causal=causal)  # noqa: E731
                kern = prep = None
            r = dict(synced=bench.time_ms(call, 3, 10), b2b=back_to_back_ms(call), host=host_ms(call))
            if kern is not None:
                r.update(kernel=back_to_back_ms(kern), kernel_synced=bench.time_ms(kern, 3, 10),
                         prepass=back_to_back_ms(prep), prepass_synced=bench.time_ms(prep, 3, 10),
                         prepass_host=host_ms(prep))
            try:
                r["flash_synced"], r["flash_b2b"] = sdpa_ms(D, N, causal)
                r["x_flash_synced"] = r["flash_synced"] / r["synced"]
                r["x_flash_b2b"] = r["flash_b2b"] / r["b2b"]
            except Exception as exc:  # noqa: BLE001  (no torch on this machine)
                r["flash"] = f"unavailable: {exc}"[:80]
            print(f"{a.family} D={D} N={N} causal={causal}: " +
                  " ".join(f"{k_}={v_:.3f}" if isinstance(v_, float) else f"{k_}={v_}" for k_, v_ in r.items()),
                  flush=True)
            if a.profile and N == 4096 and not causal:
                pr = cProfile.Profile()
                pr.enable()
                for _ in range(100):
                    call()
                pr.disable()
                cupy.cuda.get_current_stream().synchronize()
                for order in ("tottime", "cumulative"):
                    pstats.Stats(pr).sort_stats(order).print_stats(20)


if __name__ == "__main__":
    main()
