"""Context parallelism on several GPUs: ``sagecupy.torch.context_parallel_attention`` (INT8 SageBwd; ring and
all2all) against PyTorch's own context parallelism over SDPA (``torch.distributed.tensor.experimental.
context_parallel``, a ring of the bf16 flash/cuDNN kernels), causal, D = 128, forward + backward.

One launch measures one world size; scaling is read across launches (each row names its world size):

    torchrun --nproc-per-node 1 bench/cp_bench.py
    torchrun --nproc-per-node 8 bench/cp_bench.py --scaling strong --seq 65536,262144

* weak scaling: ``--tokens-per-gpu`` tokens on every GPU, so N = tokens × GPUs;
* strong scaling: the total lengths ``--seq``, whatever the number of GPUs.

Per row: GPUs, N, milliseconds per forward+backward (the slowest rank's median), tokens/s per GPU and attention
TFLOPS per GPU (matmul FLOPs of causal attention: forward 4·B·H·N²·D/2, backward 2.5× that).
"""
import argparse
import statistics

import torch
import torch.distributed as dist
import torch.nn.functional as F

from sagecupy.context_parallel import make_plan
from sagecupy.torch import context_parallel_attention


def parse():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--scaling", choices=("weak", "strong", "both"), default="both")
    p.add_argument("--tokens-per-gpu", default="8192,32768", help="weak scaling: tokens per GPU (comma list)")
    p.add_argument("--seq", default="32768,131072,262144", help="strong scaling: total lengths (comma list)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--dtype", choices=("bfloat16", "float16"), default="bfloat16")
    p.add_argument("--modes", default="ring,all2all,torch", help="which of ring, all2all, torch (PyTorch's CP)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=5)
    return p.parse_args()


def timed(step, warmup, iters):
    """Median ms of ``step()`` over ``iters`` calls, the slowest rank's (a barrier before each call)."""
    for _ in range(warmup):
        step()
    times = []
    for _ in range(iters):
        dist.barrier()
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop))
    t = torch.tensor([statistics.median(times)], device="cuda")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def sage_step(mode, N, a, dtype):
    """fwd+bwd of context_parallel_attention on this rank's zig-zag shard (random values: timing only)."""
    R, rank = dist.get_world_size(), dist.get_rank()
    plan = make_plan("zigzag", N, N, R)
    nq, nk = (sum(b - x for x, b in c[rank]) for c in (plan.q_chunks, plan.k_chunks))
    q, do = (torch.randn(a.batch, a.heads, nq, 128, device="cuda", dtype=dtype) for _ in range(2))
    k, v = (torch.randn(a.batch, a.heads, nk, 128, device="cuda", dtype=dtype) for _ in range(2))
    for x in (q, k, v):
        x.requires_grad_(True)

    def step():
        o = context_parallel_attention(q, k, v, causal=True, mode=mode, seq_lens=(N, N))
        torch.autograd.grad(o, (q, k, v), do)  # (no accumulation into .grad: the same work as the baseline's)
    return step


def torch_cp_step(N, a, dtype, mesh):
    """fwd+bwd of SDPA under PyTorch's context_parallel (it shards the full buffers in place, load-balanced)."""
    from torch.distributed.tensor.experimental import context_parallel

    q, k, v, do = (torch.randn(a.batch, a.heads, N, 128, device="cuda", dtype=dtype) for _ in range(4))
    ctx = context_parallel(mesh, buffers=[q, k, v, do], buffer_seq_dims=[2, 2, 2, 2], no_restore_buffers={q, k, v, do})
    ctx.__enter__()  # (left open: the patched SDPA serves every call of the timing loop)
    for x in (q, k, v):
        x.requires_grad_(True)

    def step():
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        torch.autograd.grad(o, (q, k, v), do)
    return step, ctx


def main():
    a = parse()
    dist.init_process_group("nccl")
    rank, R = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(rank % torch.cuda.device_count())
    dtype = getattr(torch, a.dtype)
    modes = a.modes.split(",")
    mesh, why_not = None, None
    if "torch" in modes:
        try:
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.tensor.experimental import context_parallel  # noqa: F401

            mesh = init_device_mesh("cuda", (R,))
        except ImportError as exc:
            why_not = f"PyTorch {torch.__version__} has no context_parallel ({exc}): baseline not measured"
    if rank == 0:
        print(f"# {R} GPU(s) ({torch.cuda.get_device_name()}), B={a.batch}, H={a.heads}, D=128, {a.dtype}, causal")
        if why_not:
            print(f"# {why_not}")
        print(f"{'scaling':8} {'mode':8} {'GPUs':>4} {'N':>8} {'ms':>10} {'tok/s/GPU':>12} {'TFLOPS/GPU':>11}")
    lengths = []
    if a.scaling in ("weak", "both"):
        lengths += [("weak", int(t) * R) for t in a.tokens_per_gpu.split(",")]
    if a.scaling in ("strong", "both"):
        lengths += [("strong", int(n)) for n in a.seq.split(",")]
    for scaling, N in lengths:
        for mode in modes:
            if mode == "torch" and mesh is None or mode == "all2all" and a.heads % R:
                continue
            ctx = None
            try:
                if mode == "torch":
                    step, ctx = torch_cp_step(N, a, dtype, mesh)
                else:
                    step = sage_step(mode, N, a, dtype)
                ms = timed(step, a.warmup, a.iters)
                line = f"{ms:10.2f}"
                flops = 3.5 * 4 * a.batch * a.heads * N * N * 128 / 2
                line += f" {a.batch * N / (ms / 1e3) / R:12.0f} {flops / (ms / 1e3) / R / 1e12:11.1f}"
            except torch.cuda.OutOfMemoryError:
                line = f"{'out of memory':>35}"
            finally:
                if ctx is not None:
                    ctx.__exit__(None, None, None)
            torch.cuda.empty_cache()
            if rank == 0:
                print(f"{scaling:8} {mode:8} {R:4d} {N:8d} {line}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
