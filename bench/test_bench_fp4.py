"""pytest-benchmark suite for the NVFP4 forward and the FP4 QAT pair (GPU only; skipped without a device).

    pytest bench/test_bench_fp4.py --benchmark-only [--benchmark-json out.json]

As in test_bench_int8.py: the callables synchronize, the CUDA-event GPU time (median) and the TFLOPS
go to ``benchmark.extra_info``; speed targets are read from these numbers, never asserted.
"""
import pytest

pytestmark = pytest.mark.gpu

from test_bench_int8 import CASES, _inputs  # noqa: E402  same shapes and inputs as the INT8 suite (same folder)


@pytest.mark.parametrize("what", ["nvfp4-fwd-kernel", "nvfp4-fwd", "qat-fwd", "qat-bwd", "qat-fwdbwd"])
@pytest.mark.parametrize("D,N,causal", CASES, ids=[f"d{d}-n{n}-{'causal' if c else 'full'}" for d, n, c in CASES])
def test_fp4_speed(benchmark, D, N, causal, what):
    import cupy

    from sagecupy import bench, nvfp4, qat

    B, H, (q, k, v, do) = _inputs(D, N)
    ops = nvfp4.quantize_inputs(q, k, v)
    _, res = qat.forward(q, k, v, causal=causal)
    mode = {"nvfp4-fwd-kernel": "fwd", "nvfp4-fwd": "fwd", "qat-fwd": "fwd", "qat-bwd": "bwd",
            "qat-fwdbwd": "fwdbwd"}[what]

    def run():
        if what == "nvfp4-fwd-kernel":
            nvfp4.attention_packed(ops, causal=causal, out_dtype="bfloat16")
        elif what == "nvfp4-fwd":
            nvfp4.attention(q, k, v, causal=causal)
        elif what == "qat-fwd":
            qat.forward(q, k, v, causal=causal)
        elif what == "qat-bwd":
            qat.backward(res, do)
        else:
            _, r = qat.forward(q, k, v, causal=causal)
            qat.backward(r, do)
        cupy.cuda.get_current_stream().synchronize()

    benchmark.pedantic(run, rounds=10, warmup_rounds=2)
    ms = bench.time_ms(run, warmup=1, rep=10)
    benchmark.extra_info.update(device_ms=ms, tflops=bench.flops(B, H, N, N, D, causal, mode) / ms / 1e9,
                                B=B, H=H, N=N, D=D, causal=causal, mode=mode, what=what)
