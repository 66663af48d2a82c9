"""Host time of the pieces of an INT8 forward call (on the GPU machine): what a synchronized call spends before and
between its launches, per operation, in microseconds (best of 5 rounds of 2000 calls, no synchronization inside a
round; 20 calls of the public functions, whose launches queue on the device).

    python bench/host_costs.py

Rows: CuPy allocations, views into one buffer, a launch of a kernel with 1 and with 25 arguments (arrays and numpy
scalars, or Python ints and raw pointers; a recorded program's packed driver launch), the validation helpers, and the
public calls' pre-pass and launch halves (the forward also with CuPy's kernel call, ``SAGECUPY_LAUNCH=cupy``).
"""
import time

import cupy

from sagecupy import _checks, bench, int8, nvfp4
from sagecupy.config import DEFAULT

_SRC = r"""
extern "C" __global__ void k1(float* x) {}
extern "C" __global__ void k25(const char* a0, const float* a1, long long a2, long long a3, long long a4, int a5,
    int a6, float a7, char* a8, float* a9, float a10, float* a11, const char* a12, long long a13, long long a14,
    long long a15, int a16, int a17, char* a18, float* a19, const float* a20, int a21, int a22, char* a23, int a24) {}
"""


def per_call_us(fn, n=2000, rounds=5):
    best = float("inf")
    for _ in range(rounds):
        cupy.cuda.get_current_stream().synchronize()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter() - t0) / n)
        cupy.cuda.get_current_stream().synchronize()
    return best * 1e6


def main():
    mod = cupy.RawModule(code=_SRC)
    k1, k25 = mod.get_function("k1"), mod.get_function("k25")
    buf = cupy.empty(1 << 20, dtype=cupy.uint8)
    x = cupy.empty(256, dtype=cupy.float32)
    i32, i64, f32 = cupy.int32, cupy.int64, cupy.float32
    p = buf.data.ptr
    rows = {}
    rows["cupy.empty (4, 16, 4096, 128) int8"] = per_call_us(lambda: cupy.empty((4, 16, 4096, 128), dtype=cupy.int8))
    rows["cupy.empty (4, 16, 4096) float32"] = per_call_us(lambda: cupy.empty((4, 16, 4096), dtype=cupy.float32))
    rows["cupy.ndarray (4, 16, 4096) float32"] = per_call_us(
        lambda: cupy.ndarray((4, 16, 4096), cupy.float32))
    rows["cupy.ndarray view at an offset"] = per_call_us(
        lambda: cupy.ndarray((4, 16, 64), cupy.float32, cupy.cuda.MemoryPointer(buf.data.mem, 4096)))
    rows["buf[a:b].view(float32).reshape"] = per_call_us(lambda: buf[4096:4096 + 16384].view(cupy.float32).reshape(4, 16, 64))
    rows["launch, 1 array arg"] = per_call_us(lambda: k1((1,), (32,), (x,)))
    rows["launch, 1 int pointer arg"] = per_call_us(lambda: k1((1,), (32,), (x.data.ptr,)))
    args_np = (buf, x, i64(1), i64(2), i64(3), i32(4), i32(5), f32(1.0), buf, x, f32(2.0), x, buf, i64(1), i64(2),
               i64(3), i32(4), i32(5), buf, x, x, i32(6), i32(7), buf, i32(8))
    rows["launch, 25 args (arrays, numpy scalars, prebuilt)"] = per_call_us(lambda: k25((1,), (32,), args_np))
    rows["launch, 25 args (numpy scalars built per call)"] = per_call_us(lambda: k25((1,), (32,), (
        buf, x, i64(1), i64(2), i64(3), i32(4), i32(5), f32(1.0), buf, x, f32(2.0), x, buf, i64(1), i64(2),
        i64(3), i32(4), i32(5), buf, x, x, i32(6), i32(7), buf, i32(8))))
    from sagecupy._program import Program, Ref
    prog = Program()
    prog.launch(k25, (1,), (32,), (Ref("a"), Ref("b"), i64(1), i64(2), i64(3), i32(4), i32(5), f32(1.0), Ref("c"),
                                   Ref("d"), f32(2.0), x, buf, i64(1), i64(2), i64(3), i32(4), i32(5), Ref("e"),
                                   Ref("f"), x, i32(6), i32(7), Ref("g"), i32(8)))
    ns = dict(a=buf, b=x, c=buf, d=x, e=buf, f=x, g=buf)
    rows["Program.run: one packed driver launch, 25 args (7 per call)"] = per_call_us(lambda: prog.run(ns))
    rows["cupy.cuda.alloc(64 MB)"] = per_call_us(lambda: cupy.cuda.alloc(1 << 26))
    rows["numpy scalar cupy.int32(5)"] = per_call_us(lambda: i32(5))
    rows["set max_dynamic_shared_size_bytes"] = per_call_us(lambda: setattr(k1, "max_dynamic_shared_size_bytes", 1024))
    rows["cupy.cuda.Device().id"] = per_call_us(lambda: cupy.cuda.Device().id)
    rows["cupy.cuda.runtime.getDevice()"] = per_call_us(cupy.cuda.runtime.getDevice)
    del p

    B, H, (q, k, v, do) = bench._inputs(128, 4096, "bfloat16")
    rows["_checks.as_cupy(BF16Array)"] = per_call_us(lambda: _checks.as_cupy(q, "q"))
    rows["check_attention_args"] = per_call_us(
        lambda: _checks.check_attention_args(q, k, v, causal=False, sm_scale=None, layout="HND"))
    rows["int8._prepare"] = per_call_us(lambda: int8._prepare(q, "q", "HND", True))
    from sagecupy import _program

    def plan_key():
        key = (_program.signature(q), _program.signature(k), _program.signature(v), False, bool,
               _program.scale_key(None), "HND", None, None, None, type(None), _program.env_key())
        return int8._FWD_PLANS.get(key)

    rows["forward plan lookup (3 signatures, env_key, hash)"] = per_call_us(plan_key)
    rows["signature(BF16Array)"] = per_call_us(lambda: _program.signature(q))
    rows["env_key()"] = per_call_us(_program.env_key)
    int8.forward(q, k, v)
    plan = next(iter(int8._FWD_PLANS.values()))
    rows["int8._input_ns"] = per_call_us(lambda: int8._input_ns(plan, "HND", q=q, k=k, v=v))
    n = 20  # several launches per call: stay well under the device's queue of pending launches
    rows["int8._preprocess_forward"] = per_call_us(lambda: int8._preprocess_forward(
        q, k, v, causal=False, sm_scale=None, layout="HND", config=DEFAULT), n)
    pp, cfg, pre = int8._preprocess_forward(q, k, v, causal=False, sm_scale=None, layout="HND", config=DEFAULT)
    rows["int8._launch_forward"] = per_call_us(lambda: int8._launch_forward(pp, cfg, pre), n)
    rows["int8.forward"] = per_call_us(lambda: int8.forward(q, k, v), n)
    rows["int8.forward causal"] = per_call_us(lambda: int8.forward(q, k, v, causal=True), n)
    import os
    os.environ["SAGECUPY_LAUNCH"] = "cupy"  # read when a program is recorded: record afresh
    int8._FWD_PLANS.clear()
    rows["int8.forward (SAGECUPY_LAUNCH=cupy)"] = per_call_us(lambda: int8.forward(q, k, v), n)
    del os.environ["SAGECUPY_LAUNCH"]
    int8._FWD_PLANS.clear()
    _, res = int8.forward(q, k, v)
    rows["int8._preprocess_backward"] = per_call_us(lambda: int8._preprocess_backward(res, do), n)
    pb = int8._preprocess_backward(res, do)
    rows["int8._launch_backward"] = per_call_us(lambda: int8._launch_backward(res, pb), n)
    rows["int8.backward"] = per_call_us(lambda: int8.backward(res, do), n)
    rows["nvfp4.attention"] = per_call_us(lambda: nvfp4.attention(q, k, v), n)
    w = max(len(k_) for k_ in rows)
    for k_, v_ in rows.items():
        print(f"{k_:<{w}}  {v_:8.2f} us")


if __name__ == "__main__":
    main()
