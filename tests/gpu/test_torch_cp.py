"""Context parallelism over torch.distributed with the INT8 kernels (sagecupy/adapters/torch_cp.py) on CUDA tensors.

* One rank (a world of one, NCCL): the ring still runs its whole code path (statistics
  gathered, pairs scheduled, merged, accumulators). With the contiguous plan the ring is one block, the whole call:
  O and the gradients equal ``sagecupy.torch.sage_attention``'s bit for bit in fp16 (the statistics of one block
  are the pre-pass's, float64 sums of fp16 values being exact; the merge of one partial into the empty accumulator
  is exact; each result is rounded once, as the kernels round it). The LSE goes through ``l2·ln2 + q·μ_K`` in fp32
  outside the kernel, so it is held to a few fp32 units instead. With the zig-zag plan (four blocks) every output
  equals the one-GPU simulation ``sagecupy.context_parallel.ring_attention(ranks=1)`` bit for bit.
* Two ranks, two GPUs, NCCL (skipped with fewer GPUs): every output of every rank, gathered, equals
  ``ring_attention(ranks=2)`` on one GPU bit for bit (the same blocks in the same order, the same fp32 merges and
  sums, the same gathered statistics); ``mode="all2all"`` equals ``sage_attention`` on the whole problem (made on
  contiguous HND copies, as the exchange hands them to each rank) bit for bit: the kernels work per (batch, head)
  pair, so a call on some of the heads computes them as the whole call does (tests/gpu/test_invariance.py).
"""
import datetime
import os

import numpy as np
import pytest

from draws import qkv_do

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")
dist = torch.distributed


def _cuda():
    if not torch.cuda.is_available():
        pytest.skip("this PyTorch has no CUDA")
    if not dist.is_available():
        pytest.skip("this PyTorch has no torch.distributed")


def _problem(seed, B, Hq, Hkv, Nq, Nk, D, layout, dtype, device):
    """q, k, v, do as tensors on ``device``: seeded float64 draws (draws.qkv_do, K with a mean) rounded to ``dtype``."""
    return [torch.from_numpy(x.astype(np.float32)).to(device).to(getattr(torch, dtype))
            for x in qkv_do(seed, B, Hq, Hkv, Nq, Nk, D, layout)]


def _simulated_ring(q, k, v, do, ranks, plan, **kw):
    """``ring_attention`` and its backward on one GPU, as tensors: (o, lse, dq, dk, dv)."""
    from sagecupy import context_parallel as cp
    from sagecupy.torch import from_cupy, on_torch_stream, to_cupy

    with on_torch_stream(q.device):
        o, lse, state = cp.ring_attention(to_cupy(q), to_cupy(k), to_cupy(v), ranks, plan, **kw)
        grads = cp.ring_attention_backward(state, to_cupy(do))
        return tuple(from_cupy(x) for x in (o, lse, *grads))


def _single_call(q, k, v, do, *, layout, as_hnd=False, **kw):
    """``sage_attention`` (the custom-op path) and its gradients: (o, lse, dq, dk, dv) in ``layout``. ``as_hnd``: the
    call made on contiguous HND copies, as ``mode="all2all"`` makes it on the exchanged heads."""
    from sagecupy.torch import sage_attention

    def hnd(x):
        return x if layout == "HND" else x.transpose(1, 2)

    if as_hnd:
        q, k, v, do = (hnd(x).contiguous() for x in (q, k, v, do))
    q, k, v = (x.detach().clone().requires_grad_(True) for x in (q, k, v))
    o, lse = sage_attention(q, k, v, return_lse=True, layout="HND" if as_hnd else layout, **kw)
    o.backward(do)
    out = (o.detach(), q.grad, k.grad, v.grad)
    if as_hnd:
        out = tuple(hnd(x) for x in out)
    return out[0], lse, *out[1:]


def _equal(name, got, want, case):
    got, want = got.detach(), want.detach()
    assert got.shape == want.shape and got.dtype == want.dtype, f"{name}: {got.shape} {got.dtype} vs {want.shape} " \
                                                                f"{want.dtype} {case}"
    same = (got == want) | (torch.isnan(got) & torch.isnan(want))
    assert bool(same.all()), (f"{name}: {int((~same).sum())} of {same.numel()} elements differ {case}; worst "
                              f"|diff| {float((got.float() - want.float()).abs().nan_to_num().max()):.3e}")


# ---------------------------------------------------------------- one rank


@pytest.fixture(scope="module")
def world_of_one(tmp_path_factory):
    _cuda()
    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    if not dist.is_nccl_available():
        pytest.skip("this PyTorch has no NCCL")
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method=f"file://{tmp_path_factory.mktemp('cp1') / 'store'}", rank=0,
                            world_size=1)
    yield
    dist.destroy_process_group()


ONE_RANK = [  # B, Hq, Hkv, Nq, Nk, D, causal, window, layout, dtype
    (1, 4, 2, 1000, 1000, 128, True, None, "HND", "float16"),
    (2, 2, 1, 700, 1301, 64, False, None, "NHD", "float16"),
    (1, 4, 4, 1024, 1024, 128, True, (300, 0), "HND", "bfloat16"),
]


@pytest.mark.parametrize("B,Hq,Hkv,Nq,Nk,D,causal,window,layout,dtype", ONE_RANK)
def test_one_rank(world_of_one, B, Hq, Hkv, Nq, Nk, D, causal, window, layout, dtype):
    from sagecupy.torch import context_parallel_attention

    q, k, v, do = _problem(1, B, Hq, Hkv, Nq, Nk, D, layout, dtype, "cuda")
    kw = dict(causal=causal, window=window, layout=layout)
    case = f"{(B, Hq, Hkv, Nq, Nk, D, causal, window, layout, dtype)}"
    for plan in ("contiguous", "zigzag"):
        qq, kk, vv = (x.clone().requires_grad_(True) for x in (q, k, v))
        o, lse = context_parallel_attention(qq, kk, vv, plan=plan, return_lse=True, **kw)
        o.backward(do)
        got = (o, lse, qq.grad, kk.grad, vv.grad)
        want = _simulated_ring(q, k, v, do, 1, plan, **kw)
        for name, a, b in zip(("o", "lse", "dq", "dk", "dv"), got, want):
            _equal(name, a, b, f"{case} plan={plan} vs ring_attention")
        if plan == "contiguous" and dtype == "float16":  # (bf16: K's mean is summed in another order)
            single = _single_call(q, k, v, do, **kw)
            for name, a, b in zip(("o", "lse", "dq", "dk", "dv"), got, single):
                if name == "lse":  # (fp32 l2·ln2 + q·μ_K outside the kernel: a few units of 2^-24 of |lse|)
                    torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-5)
                else:
                    _equal(name, a, b, f"{case} vs sage_attention")
    # all2all with one rank: the exchange is the identity, the call the single call
    qq, kk, vv = (x.clone().requires_grad_(True) for x in (q, k, v))
    o, lse = context_parallel_attention(qq, kk, vv, mode="all2all", return_lse=True, **kw)
    o.backward(do)
    for name, a, b in zip(("o", "lse", "dq", "dk", "dv"), (o, lse, qq.grad, kk.grad, vv.grad),
                          _single_call(q, k, v, do, as_hnd=True, **kw)):
        _equal(name, a, b, f"{case} all2all vs sage_attention")


# ---------------------------------------------------------------- two GPUs


TWO_RANKS = {  # name -> (B, Hq, Hkv, Nq, Nk, D, causal, window, layout, dtype, plan, mode)
    "zigzag_causal": (1, 4, 2, 2048, 2048, 128, True, None, "HND", "float16", "zigzag", "ring"),
    "contiguous_cross": (1, 4, 1, 1000, 1301, 64, False, None, "NHD", "bfloat16", "contiguous", "ring"),
    "zigzag_window": (2, 2, 2, 1500, 1500, 128, True, (400, 0), "HND", "bfloat16", "zigzag", "ring"),
    "all2all_causal": (1, 4, 2, 2048, 2048, 128, True, None, "NHD", "float16", "zigzag", "all2all"),
}


def _two_rank_worker(rank, world, store, out_dir):
    from sagecupy.torch import context_parallel_attention, shard_sequence, unshard_sequence

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=300))
    try:
        for name, (B, Hq, Hkv, Nq, Nk, D, causal, window, layout, dtype, plan, mode) in TWO_RANKS.items():
            full = _problem(2, B, Hq, Hkv, Nq, Nk, D, layout, dtype, f"cuda:{rank}")
            sk = dict(plan=plan, layout=layout)
            q, k, v, do = (shard_sequence(x, which=w, **sk) for x, w in zip(full, "qkkq"))
            for x in (q, k, v):
                x.requires_grad_(True)
            o, lse = context_parallel_attention(q, k, v, causal=causal, window=window, layout=layout, plan=plan,
                                                mode=mode, return_lse=True)
            o.backward(do)
            out = {"o": unshard_sequence(o, which="q", **sk),
                   "lse": unshard_sequence(lse, which="q", plan=plan, layout="HND")}
            out.update({n: unshard_sequence(x.grad, which=w, **sk) for n, x, w in zip(("dq", "dk", "dv"),
                                                                                     (q, k, v), "qkk")})
            if rank == 0:  # (float32 holds fp16/bf16 values exactly)
                np.savez(os.path.join(out_dir, f"{name}.npz"), **{n: x.float().cpu().numpy() for n, x in out.items()})
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    _cuda()
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    if not dist.is_nccl_available():
        pytest.skip("this PyTorch has no NCCL")
    import torch.multiprocessing as mp

    d = tmp_path_factory.mktemp("cp2")
    mp.spawn(_two_rank_worker, args=(2, str(d / "store"), str(d)), nprocs=2, join=True)
    return d


@pytest.mark.parametrize("name", list(TWO_RANKS))
def test_two_ranks(two_ranks, name):
    B, Hq, Hkv, Nq, Nk, D, causal, window, layout, dtype, plan, mode = TWO_RANKS[name]
    q, k, v, do = _problem(2, B, Hq, Hkv, Nq, Nk, D, layout, dtype, "cuda:0")
    kw = dict(causal=causal, window=window, layout=layout)
    want = (_single_call(q, k, v, do, as_hnd=True, **kw) if mode == "all2all"
            else _simulated_ring(q, k, v, do, 2, plan, **kw))
    got = np.load(two_ranks / f"{name}.npz")
    for n, w in zip(("o", "lse", "dq", "dk", "dv"), want):
        _equal(n, torch.from_numpy(got[n]).to("cuda:0"), w.detach().float(),
               f"{name} vs {'sage_attention' if mode == 'all2all' else 'ring_attention(ranks=2)'}")
