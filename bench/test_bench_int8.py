"""pytest-benchmark suite for the SageBwd kernels (GPU only; skipped without a device).

    pytest bench/ --benchmark-only [--benchmark-json out.json]

pytest-benchmark's own timer is a host clock: every timed callable synchronizes the device, and the
GPU time measured with CUDA events (median, sagecupy.bench.time_ms) and the TOPS are put in
``benchmark.extra_info``. Speed targets are read from these numbers, never asserted.
"""
import pytest

pytestmark = pytest.mark.gpu

CASES = [(64, 4096, False), (128, 4096, False), (128, 4096, True), (128, 16384, False), (128, 16384, True)]


def _inputs(D, N):
    import cupy

    from sagecupy.bench import _shape
    from sagecupy.adapters.bf16 import BF16Array

    B, H = _shape(D, N)
    rng = cupy.random.default_rng(0)
    return B, H, [BF16Array.from_float(rng.standard_normal((B, H, N, D), dtype=cupy.float32)) for _ in range(4)]


@pytest.mark.parametrize("mode", ["fwd", "fwdtrain", "bwd", "fwdbwd"])
@pytest.mark.parametrize("D,N,causal", CASES, ids=[f"d{d}-n{n}-{'causal' if c else 'full'}" for d, n, c in CASES])
def test_int8_speed(benchmark, D, N, causal, mode):
    import cupy

    from sagecupy import bench, int8

    B, H, (q, k, v, do) = _inputs(D, N)
    _, res = int8.forward(q, k, v, causal=causal)

    def run():
        if mode == "fwd":  # the inference call (no residuals), as SDPA's forward is timed
            int8.sage_attention(q, k, v, causal=causal)
        elif mode == "fwdtrain":  # the training forward (keeps the backward's residuals)
            int8.forward(q, k, v, causal=causal)
        elif mode == "bwd":
            int8.backward(res, do)
        else:
            _, r = int8.forward(q, k, v, causal=causal)
            int8.backward(r, do)
        cupy.cuda.get_current_stream().synchronize()

    benchmark.pedantic(run, rounds=10, warmup_rounds=2)
    ms = bench.time_ms(run, warmup=1, rep=10)
    fl = bench.flops(B, H, N, N, D, causal, "fwd" if mode == "fwdtrain" else mode)
    benchmark.extra_info.update(device_ms=ms, tops=fl / ms / 1e9,
                                B=B, H=H, N=N, D=D, causal=causal, mode=mode, scope="e2e")
