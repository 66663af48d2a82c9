"""Context parallelism over torch.distributed (sagecupy/adapters/torch_cp.py) on the CPU: 1, 2 and 3 gloo processes
(torch.multiprocessing, "spawn") running ``context_parallel_attention`` with the float64 reference backends on their
shards, the results gathered (``unshard_sequence``) and compared in this process with the single-process reference.

What each comparison asserts, and why:

* ``"reference64"`` (SageBwd blocks, float64 merges and accumulators) and ``"exact"`` (exact attention, float64):
  O, LSE, dQ, dK, dV equal the reference ring (``reference.context_parallel.ring_forward``/``ring_backward``, same
  plan) bit for bit. Both compute the same blocks (every chunk quantized with the same global statistics: float64
  sums of fp16-valued inputs are exact in any order) and merge and sum them in the same order, so any difference
  is a communication or ordering error: a shard sent to the wrong rank, a pair skipped or repeated, an accumulator
  that does not come home.
* ``"reference"`` (fp32 partials, merges and accumulators, the GPU ring's structure): O and the LSE within fp32
  rounding of the float64 ring (a few merges of a few units of 2⁻²⁴ each: ``rtol=2e-6`` on O against its
  largest entry, ``atol=2e-5`` on LSEs of magnitude ~10). Its gradients are compared with ``quantize=False``: with
  INT8 codes, an LSE that moved by one fp32 unit moves the backward's P across a rounding boundary somewhere among
  the ~10⁵ entries (a code flip, an O(1/255) change of one entry), which says nothing about the ring.
* ``mode="all2all"``: each rank runs the reference single call on its heads, so O, LSE and the gradients equal the
  single call on the whole problem (``reference.sagebwd.forward``/``backward``), head for head, bit for bit.
* A ring of one rank (a singleton subgroup) is the reference ring of one rank; a subgroup of 2 in a world of 3
  checks that ring neighbours are addressed by their global ranks.
"""
import datetime
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
if not torch.distributed.is_available():
    pytest.skip("this PyTorch has no torch.distributed", allow_module_level=True)

from sagecupy.config import DEFAULT  # noqa: E402
from sagecupy.reference import attention as A  # noqa: E402
from sagecupy.reference import context_parallel as ref  # noqa: E402
from sagecupy.reference import sagebwd  # noqa: E402

# Small tiles so that a 300-token sequence holds several chunks per rank (rows aligned on 16, keys on 32).
SMALL = DEFAULT.replace(block_q=32, block_kv=16, bwd_block_q=16, bwd_block_kv=32)

# name -> case. B=1, D=64; lengths that leave some chunks (and in "tiny_q" a whole query shard) empty.
CASES = {
    "causal_zigzag": dict(Hq=4, Hkv=2, Nq=300, Nk=300, causal=True, backend="reference64", config=SMALL),
    "cross_nhd": dict(Hq=2, Hkv=1, Nq=200, Nk=333, layout="NHD", backend="reference64", config=SMALL),
    "window_contiguous": dict(Hq=4, Hkv=2, Nq=300, Nk=300, window=(70, 30), plan="contiguous",
                              backend="reference64", config=SMALL),
    "causal_window_default": dict(Hq=2, Hkv=2, Nq=300, Nk=300, causal=True, window=(100, 0),
                                  backend="reference64", config=DEFAULT, seq_lens=True),
    "exact_tiny_q": dict(Hq=4, Hkv=1, Nq=50, Nk=333, causal=True, backend="exact", config=DEFAULT),
    "fp32_forward": dict(Hq=4, Hkv=2, Nq=300, Nk=300, causal=True, backend="reference", config=SMALL,
                         dtype="float32", grads=False),
    "fp32_unquantized": dict(Hq=2, Hkv=1, Nq=200, Nk=333, backend="reference", dtype="float32",
                             config=SMALL.replace(quantize=False)),
    "all2all_causal": dict(Hq=4, Hkv=2, Nq=300, Nk=300, causal=True, mode="all2all", backend="reference64",
                           config=SMALL),
    "all2all_cross_nhd": dict(Hq=2, Hkv=2, Nq=200, Nk=333, layout="NHD", mode="all2all", backend="exact",
                              config=DEFAULT),
    "all2all_3": dict(Hq=6, Hkv=3, Nq=300, Nk=300, causal=True, mode="all2all", backend="reference64",
                      config=SMALL),
}
RUNS = {  # world size -> [(case, the ranks of a subgroup to run it on, or None for the whole world)]
    1: [("causal_zigzag", None)],
    2: [(name, None) for name in CASES if name != "all2all_3"] + [("cross_nhd", [0]), ("cross_nhd", [1])],
    3: [("causal_zigzag", None), ("cross_nhd", None), ("all2all_3", None), ("exact_tiny_q", [1, 2])],
}


def _case(name):
    c = dict(layout="HND", causal=False, window=None, plan="zigzag", mode="ring", dtype="float64", grads=True,
             seq_lens=False, seed=sum(map(ord, name)))
    c.update(CASES[name])
    return c


def _problem(c):
    """fp16-valued float64 q, k, v, do (HND): K with a mean the smoothing removes, dO at half scale."""
    rng = np.random.default_rng(c["seed"])
    f16 = lambda *s: rng.standard_normal(s).astype(np.float16).astype(np.float64)  # noqa: E731
    return (f16(1, c["Hq"], c["Nq"], 64), f16(1, c["Hkv"], c["Nk"], 64) + 0.5, f16(1, c["Hkv"], c["Nk"], 64),
            0.5 * f16(1, c["Hq"], c["Nq"], 64))


def _plan(c, R):
    align = ref.sagebwd_alignment(c["config"])
    make = ref.zigzag_plan if c["plan"] == "zigzag" else ref.contiguous_plan
    return make(c["Nq"], c["Nk"], R, align_q=align[0], align_k=align[1])


# ---------------------------------------------------------------- the processes


def _run_case(c, group):
    """This rank's part of one case; the gathered (full) results, the same on every rank."""
    from sagecupy.torch import context_parallel_attention, shard_sequence, unshard_sequence

    L, dtype = c["layout"], getattr(torch, c["dtype"])
    kw = dict(plan=c["plan"], layout=L, config=c["config"])
    full = [torch.from_numpy(A.from_hnd(x, L)).to(dtype) for x in _problem(c)]
    q, k, v, do = (shard_sequence(x, group, which=w, **kw) for x, w in zip(full, "qkkq"))
    for x in (q, k, v):
        x.requires_grad_(c["grads"])
    o, lse = context_parallel_attention(
        q, k, v, group, causal=c["causal"], window=c["window"], config=c["config"], plan=c["plan"], layout=L,
        mode=c["mode"], backend=c["backend"], seq_lens=(c["Nq"], c["Nk"]) if c["seq_lens"] else None,
        return_lse=True)
    assert o.dtype == dtype and o.shape == q.shape and lse.shape == (1, c["Hq"], q.shape[2 if L == "HND" else 1])
    out = {"o": unshard_sequence(o, group, which="q", **kw),
           "lse": unshard_sequence(lse, group, which="q", plan=c["plan"], layout="HND", config=c["config"])}
    if c["grads"]:
        o.backward(do)
        out.update({n: unshard_sequence(x.grad, group, which=w, **kw) for n, x, w in zip(
            ("dq", "dk", "dv"), (q, k, v), "qkk")})
    return {n: x.detach().to(torch.float64).numpy() for n, x in out.items()}


def _errors(group):
    """(exception type name, message) of calls every rank makes wrongly in the same way."""
    from sagecupy.torch import context_parallel_attention, shard_sequence, unshard_sequence

    R = torch.distributed.get_world_size(group)
    q, k = torch.zeros(1, 4, 128 // R, 64, dtype=torch.float64), torch.zeros(1, 2, 128 // R, 64, dtype=torch.float64)
    ok = dict(backend="reference64", config=SMALL)
    calls = {
        "layout": lambda: context_parallel_attention(q, k, k, group, layout="BHND", **ok),
        "mode": lambda: context_parallel_attention(q, k, k, group, mode="ulysses", **ok),
        "backend": lambda: context_parallel_attention(q, k, k, group, backend="cupy"),
        "cuda": lambda: context_parallel_attention(q.half(), k.half(), k.half(), group),
        "dtype": lambda: context_parallel_attention(q.int(), k.int(), k.int(), group, **ok),
        "k dtype": lambda: context_parallel_attention(q, k.float(), k.float(), group, **ok),
        "shape": lambda: context_parallel_attention(q, k[:, :, :, :32], k[:, :, :, :32], group, **ok),
        "heads": lambda: context_parallel_attention(q[:, :3], k, k, group, **ok),
        "window": lambda: context_parallel_attention(q, k, k, group, causal=True, window=(8, 8), **ok),
        "plan ranks": lambda: context_parallel_attention(q, k, k, group, plan=ref.zigzag_plan(128, 128, R + 1),
                                                         **ok),
        "plan name": lambda: context_parallel_attention(q, k, k, group, plan="ring", **ok),
        "shard": lambda: context_parallel_attention(q, k, k, group, seq_lens=(128 * R, 128 * R), **ok),
        "gathered shard": lambda: context_parallel_attention(q[:, :, :1], k, k, group, **ok),
        "seq_lens": lambda: context_parallel_attention(q, k, k, group, seq_lens=128, **ok),
        "all2all heads": lambda: context_parallel_attention(q[:, :R + 1], k[:, :1], k[:, :1], group,
                                                            mode="all2all", **ok),
        "which": lambda: shard_sequence(q, group, which="v"),
        "unshard": lambda: unshard_sequence(q, group, which="q", seq_len=3 * 128),
    }
    out = {}
    for name, call in calls.items():
        try:
            call()
        except (TypeError, ValueError) as exc:
            out[name] = (type(exc).__name__, str(exc))
        else:
            out[name] = ("no error", "")
    return out


def _worker(rank, world, store, out_dir):
    dist = torch.distributed
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))  # (a hang fails the test instead of blocking)
    try:
        groups = {}
        for name, ranks in RUNS[world]:
            key = tuple(ranks) if ranks else None
            if key not in groups:  # (new_group is collective: every rank creates every group)
                groups[key] = dist.new_group(list(key)) if key else None
            if ranks and rank not in ranks:
                continue
            res = _run_case(_case(name), groups[key])
            if rank == (ranks[0] if ranks else 0):
                np.savez(os.path.join(out_dir, f"{name}-{'-'.join(map(str, ranks or []))}.npz"), **res)
        if world == 2:
            errs = _errors(None)
            if rank == 0:
                np.save(os.path.join(out_dir, "errors.npy"), np.array(errs, dtype=object), allow_pickle=True)
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Spawn each world once (its cases run in a row in the same processes); {world: results dir}."""
    import torch.multiprocessing as mp

    dirs = {}
    for world in RUNS:
        d = tmp_path_factory.mktemp(f"cp{world}")
        mp.spawn(_worker, args=(world, str(d / "store"), str(d)), nprocs=world, join=True)
        dirs[world] = d
    return dirs


# ---------------------------------------------------------------- the comparisons


def _ring_reference(c, R):
    q, k, v, do = _problem(c)
    L = c["layout"]
    config = None if c["backend"] == "exact" else c["config"]
    o, lse, state = ref.ring_forward(*(A.from_hnd(x, L) for x in (q, k, v)), _plan(c, R), causal=c["causal"],
                                     window=c["window"], layout=L, config=config)
    return dict(zip(("o", "lse", "dq", "dk", "dv"), (o, lse, *ref.ring_backward(state, A.from_hnd(do, L)))))


def _single_reference(c):
    q, k, v, do = _problem(c)
    kw = dict(causal=c["causal"], window=c["window"])
    if c["backend"] == "exact":
        o, lse = A.attention_forward(q, k, v, **kw)
        grads = A.attention_backward(q, k, v, o, lse, do, **kw)
    else:
        o, res = sagebwd.forward(q, k, v, config=c["config"], **kw)
        lse, grads = res["lse"], sagebwd.backward(res, do)
    L = c["layout"]
    return {"o": A.from_hnd(o, L), "lse": lse, **{n: A.from_hnd(g, L) for n, g in zip(("dq", "dk", "dv"), grads)}}


def _load(runs, world, name, ranks=None):
    return dict(np.load(runs[world] / f"{name}-{'-'.join(map(str, ranks or []))}.npz"))


PARAMS = [(w, n, r) for w, items in RUNS.items() for n, r in items]


@pytest.mark.parametrize("world, name, ranks", PARAMS, ids=[f"R{w}-{n}-{r or 'all'}" for w, n, r in PARAMS])
def test_matches_the_reference(runs, world, name, ranks):
    c = _case(name)
    got = _load(runs, world, name, ranks)
    R = len(ranks) if ranks else world
    want = _single_reference(c) if c["mode"] == "all2all" else _ring_reference(c, R)
    assert set(got) == ({"o", "lse", "dq", "dk", "dv"} if c["grads"] else {"o", "lse"})
    for n in got:
        assert got[n].shape == want[n].shape, n
        if c["backend"] != "reference":  # bit for bit (module docstring)
            np.testing.assert_array_equal(got[n], want[n], err_msg=n)
        elif n == "lse":
            np.testing.assert_allclose(got[n], want[n], rtol=0, atol=2e-5, err_msg=n)
        else:  # fp32 merges / accumulators: relative to the array's scale (see the module docstring)
            np.testing.assert_allclose(got[n], want[n], rtol=0, atol=2e-6 * np.abs(want[n]).max(), err_msg=n)
    if c["causal"] and c["mode"] == "ring":
        assert np.isfinite(got["o"]).all()


def test_the_fp32_ring_is_not_the_float64_one(runs):
    """The fp32 backend really rounds (else the tolerance above would test nothing)."""
    got = _load(runs, 2, "fp32_forward")
    want = _ring_reference(_case("fp32_forward"), 2)
    assert not np.array_equal(got["o"], want["o"])


ERRORS = {  # call -> (exception, words the message must hold)
    "layout": ("ValueError", "layout='BHND'"),
    "mode": ("ValueError", "mode='ulysses'"),
    "backend": ("ValueError", "backend='cupy'"),
    "cuda": ("TypeError", "cuda tensors"),
    "dtype": ("TypeError", "q.dtype=torch.int32"),
    "k dtype": ("TypeError", "q and k must share one dtype"),
    "shape": ("ValueError", "must share B and D"),
    "heads": ("ValueError", "Hq a multiple of Hkv"),
    "window": ("ValueError", "window=(8, 8)"),
    "plan ranks": ("ValueError", "plan is for 3 ranks but the process group has 2"),
    "plan name": ("ValueError", "plan='ring'"),
    "shard": ("ValueError", "shard lengths: rank"),
    "gathered shard": ("ValueError", "shard lengths: rank 0 passed 1 query rows"),
    "seq_lens": ("ValueError", "seq_lens=128"),
    "all2all heads": ("ValueError", "Hq=3 and Hkv=1 must divide by the group's 2 ranks"),
    "which": ("ValueError", "which='v'"),
    "unshard": ("ValueError", "x_local: rank"),
}


@pytest.mark.parametrize("call", list(ERRORS))
def test_argument_errors(runs, call):
    errs = np.load(runs[2] / "errors.npy", allow_pickle=True).item()
    kind, words = ERRORS[call]
    assert errs[call][0] == kind and words in errs[call][1], errs[call]


def test_without_an_initialized_process_group():
    from sagecupy.torch import context_parallel_attention

    if torch.distributed.is_initialized():
        pytest.skip("a process group is initialized in this process")
    q = torch.zeros(1, 2, 64, 64, dtype=torch.float64)
    with pytest.raises(RuntimeError, match="torch.distributed is not initialized"):
        context_parallel_attention(q, q, q, backend="reference64")
