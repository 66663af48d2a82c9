"""Probe: does the INT8 forward's pre-pass hide behind the attention kernel when both are split by heads?

The pre-pass (K mean and V scales, Q/K/V quantization, ~0.17-0.19 ms at any N with B*N = 16K tokens) is memory-bound
and the attention kernel issue-bound, and every pre-pass quantity is per (batch, head). So the call can run as C
chunks of heads: the pre-pass of chunk c on a side stream, the attention kernel of chunk c on the caller's stream
once that chunk's pre-pass is done, while the pre-pass of chunk c + 1 runs beside it. This probe builds that
schedule from the library's own pieces (``int8._preprocess_forward`` / ``_launch_forward`` on per-chunk views; the
chunk outputs stay separate arrays, so what a real implementation would write in place is not copied here) and
times it against the plain call, synchronized and back to back, for several chunk counts and side-stream
priorities. The outputs of the chunked schedule are compared bit for bit with the plain call's. On the GPU machine:

    python bench/overlap_probe.py [--ns 4096,16384] [--chunks 2,4,8]
"""
import argparse

import cupy
import numpy as np

from sagecupy import _checks, bench, int8


def chunk_slices(B, H, n_chunks):
    """(batch slice, head slice) of each of n_chunks chunks: whole batches while n_chunks <= B, else every batch
    split into n_chunks / B head ranges (each chunk a contiguous block of an HND array)."""
    if n_chunks <= B:
        assert B % n_chunks == 0, (B, n_chunks)
        s = B // n_chunks
        return [(slice(i * s, (i + 1) * s), slice(None)) for i in range(n_chunks)]
    per = n_chunks // B
    assert per * B == n_chunks and H % per == 0, (B, H, n_chunks)
    s = H // per
    return [(slice(b, b + 1), slice(j * s, (j + 1) * s)) for b in range(B) for j in range(per)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ns", default="4096,16384")
    ap.add_argument("--chunks", default="2,4,8")
    ap.add_argument("--d", type=int, default=128)
    a = ap.parse_args()
    lo, hi = 0, -5  # least and greatest stream priority (a smaller number is a higher priority; CUDA clamps to its range)
    main_s = cupy.cuda.Stream(non_blocking=True)
    with main_s:
        for N in (int(x) for x in a.ns.split(",")):
            B, H, (q, k, v, _) = bench._inputs(a.d, N, "bfloat16")
            for causal in (False, True):
                plain = lambda: int8.forward(q, k, v, causal=causal)[0]  # noqa: E731
                ref = _checks.raw(plain()).get()
                t_sync, t_b2b = bench.time_ms(plain, 3, 10), bench.time_ms_b2b(plain, 3, calls=20)
                print(f"N={N:<6} causal={causal!s:<5} plain      synced {t_sync:.3f} ms  b2b {t_b2b:.3f} ms", flush=True)
                for n_chunks in (int(x) for x in a.chunks.split(",")):
                    sl = chunk_slices(B, H, n_chunks)
                    qs, ks, vs = ([x[bs, hs] for bs, hs in sl] for x in (q, k, v))
                    for prio_name, prio in (("same-prio", lo), ("side-high", hi)):
                        side = cupy.cuda.Stream(non_blocking=True, priority=prio)

                        def chunked():
                            side.wait_event(main_s.record())  # after everything the caller queued
                            outs, keep = [], []
                            for qc, kc, vc in zip(qs, ks, vs):
                                with side:
                                    p, cfg, pre = int8._preprocess_forward(qc, kc, vc, causal=causal, sm_scale=None,
                                                                           layout="HND", config=None)
                                    ev = side.record()
                                main_s.wait_event(ev)
                                o, _, _ = int8._launch_forward(p, cfg, pre)
                                outs.append(o)
                                keep.append(pre)
                            main_s.wait_event(side.record())  # (nothing left on the side stream past here)
                            return outs

                        whole = np.zeros_like(ref)
                        for (bs, hs), x in zip(sl, chunked()):
                            whole[bs, hs] = _checks.raw(x).get()
                        same = np.array_equal(whole.view(np.uint16), ref.view(np.uint16))
                        c_sync = bench.time_ms(chunked, 3, 10)
                        c_b2b = bench.time_ms_b2b(chunked, 3, calls=20)
                        print(f"N={N:<6} causal={causal!s:<5} chunks={n_chunks} {prio_name:<9} synced {c_sync:.3f} ms "
                              f"({t_sync / c_sync:.3f}x)  b2b {c_b2b:.3f} ms ({t_b2b / c_b2b:.3f}x)  "
                              f"O {'bitwise equal' if same else 'DIFFERS'}", flush=True)
                try:
                    r = bench.bench_sdpa(a.d, N, causal, "flash", modes=("fwd",))
                    print(f"N={N:<6} causal={causal!s:<5} sdpa-flash " +
                          "  ".join(f"{x['scope']} {x['ms']:.3f} ms" for x in r), flush=True)
                except Exception as exc:  # no torch
                    print("sdpa-flash unavailable:", exc)


if __name__ == "__main__":
    main()
