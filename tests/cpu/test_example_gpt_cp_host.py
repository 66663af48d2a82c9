"""examples/gpt_cp.py (train_gpt.py --context-parallel N) without a GPU: the plan's global positions per rank, the
refusals of the command line, and on two gloo processes: sharding then unsharding the token batch, and one forward
and backward of a tiny model whose attention is context_parallel_attention(..., backend="exact") or the all-gathered
SDPA baseline, against the single-process model on the full sequence; then two training steps keeping the ranks'
weights identical. The NCCL/GPU path (the INT8 ring, torchrun) is not run here."""
import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
np = pytest.importorskip("numpy")

_EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _load(name, file):
    spec = importlib.util.spec_from_file_location(name, _EXAMPLES / file)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def tg():
    return _load("train_gpt_example", "train_gpt.py")


@pytest.fixture(scope="module")
def cp():
    return _load("gpt_cp_example", "gpt_cp.py")


def _tiny(tg, **kw):
    base = dict(seq=512, d_head=16, heads=2, layers=2, d_model=32, batch=2, mlp_ratio=2, steps=2, timing_warmup=1,
                log_every=1, val_windows=2, grad_clip=1.0)
    base.update(kw)
    return tg.RunConfig(**base)


# -- the plan -----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("ranks", [1, 2, 4])
def test_positions_per_rank_are_the_plans(cp, ranks):
    from sagecupy.reference.context_parallel import sagebwd_alignment, zigzag_plan

    unit = cp.plan_unit(ranks)
    seq = 2 * unit
    plan = cp.make_plan(seq, ranks)
    align_q, align_k = sagebwd_alignment()
    assert plan == zigzag_plan(seq, seq, ranks, align_q=align_q, align_k=align_k)
    seen = []
    for r in range(ranks):
        pos = cp.local_positions(plan, r)
        assert np.array_equal(pos, plan.q_positions(r)) and np.array_equal(pos, plan.k_positions(r))
        assert len(pos) == seq // ranks  # every rank holds as many tokens
        chunk = seq // (2 * ranks)
        assert np.array_equal(pos[:chunk], np.arange(r * chunk, (r + 1) * chunk))  # zigzag: chunk r ...
        assert pos[-1] == seq - 1 - r * chunk  # ... and chunk 2R - 1 - r
        seen.append(pos)
    assert np.array_equal(np.sort(np.concatenate(seen)), np.arange(seq))


def test_unaligned_lengths_are_refused(cp):
    unit = cp.plan_unit(2)
    with pytest.raises(ValueError, match=f"--seq {unit + 64} does not split .* multiple of {unit}"):
        cp.make_plan(unit + 64, 2)


# -- the command line ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("argv, world, text", [
    (["--context-parallel", "2"], None, "launch with torchrun --nproc-per-node 2"),
    (["--context-parallel", "2"], "4", "--context-parallel 2 but the launch has 4 processes"),
    (["--context-parallel", "2", "--pack"], "2", "--pack with --context-parallel is not supported"),
    (["--context-parallel", "2", "--entry", "dropin"], "2", "--entry op"),
    (["--context-parallel", "2", "--seq", "1000"], "2", "--seq 1000 does not split"),
    (["--context-parallel", "0"], "2", "not a positive integer"),
])
def test_refusals_are_usage_errors(tg, capsys, monkeypatch, argv, world, text):
    if world is None:
        monkeypatch.delenv("WORLD_SIZE", raising=False)
    else:
        monkeypatch.setenv("WORLD_SIZE", world)
    with pytest.raises(SystemExit) as exc:
        tg.main(argv)
    assert exc.value.code == 2
    assert text in capsys.readouterr().err


def test_option_is_described(tg):
    text = tg.build_parser().format_help()
    assert "--context-parallel N" in text and "torchrun" in text


# -- two gloo processes -------------------------------------------------------------------------------------------
_WORKER = textwrap.dedent("""
    import importlib.util, json, sys
    from pathlib import Path
    import torch, torch.distributed as dist

    examples, store, out, rank = Path(sys.argv[1]), sys.argv[2], Path(sys.argv[3]), int(sys.argv[4])
    def load(name, file):
        spec = importlib.util.spec_from_file_location(name, examples / file)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod
    tg, cp = load("train_gpt_example", "train_gpt.py"), load("gpt_cp_example", "gpt_cp.py")
    import sagecupy.torch as st

    dist.init_process_group("gloo", init_method="file://" + store, rank=rank, world_size=2)
    cfg = tg.RunConfig(**json.loads(sys.argv[5]))
    plan = cp.make_plan(cfg.seq, 2)
    pos = torch.from_numpy(cp.local_positions(plan, rank))
    tok = torch.randint(0, 256, (cfg.batch, cfg.seq + 1), generator=torch.Generator().manual_seed(7))
    x, y = tok[:, :-1], tok[:, 1:]
    # the token batch: shard_sequence's shard is the plan's columns, and unsharding gives the batch back
    shard = st.shard_sequence(x, which="q", plan="zigzag", layout="NHD")
    res = dict(shard_is_columns=torch.equal(shard, x[:, pos]),
               roundtrip=torch.equal(st.unshard_sequence(shard, which="q", plan="zigzag", layout="NHD"), x))
    for attn, backend in (("sagecupy", "exact"), ("sdpa", None)):
        model = cp.build(tg, cfg, attn, plan, rank, device="cpu", backend=backend)
        share = cp.loss_share(tg, model, x[:, pos], y[:, pos], pos, cfg.batch * cfg.seq)
        share.backward()
        cp.all_reduce_grads(model.parameters())
        loss = share.detach().clone()
        dist.all_reduce(loss)
        res[attn] = dict(loss=loss.item(), grads={n: p.grad.tolist() for n, p in model.named_parameters()})
    rec, model = cp.train_cp(tg, cfg, "sagecupy", device="cpu", data=(bytes(range(256)) * 40, bytes(range(256)) * 8),
                             log=None, backend="exact", return_model=True)
    res["train"] = dict(curve=[c["loss"] for c in rec["curve"]], val=rec["val_loss"])
    res["weights"] = {n: p.detach().tolist() for n, p in model.named_parameters()}
    out.write_text(json.dumps(res))
    dist.destroy_process_group()
""")


@pytest.fixture(scope="module")
def two_ranks(tg, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gpt_cp")
    script = tmp / "worker.py"
    script.write_text(_WORKER)
    cfg = _tiny(tg)
    fields = {k: getattr(cfg, k) for k in ("seq", "d_head", "heads", "layers", "d_model", "batch", "mlp_ratio",
                                           "steps", "timing_warmup", "log_every", "val_windows", "grad_clip")}
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join([str(_EXAMPLES.parent)] + [p for p in [env.get("PYTHONPATH")] if p])
    procs = [subprocess.Popen([sys.executable, str(script), str(_EXAMPLES), str(tmp / "store"), str(tmp / f"{r}.json"),
                               str(r), json.dumps(fields)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True) for r in range(2)]
    outs = [p.communicate(timeout=600)[0] for p in procs]
    for p, text in zip(procs, outs):
        assert p.returncode == 0, text
    return cfg, [json.loads((tmp / f"{r}.json").read_text()) for r in range(2)]


def test_token_batch_shards_and_unshards(two_ranks):
    _, res = two_ranks
    for r in res:
        assert r["shard_is_columns"] and r["roundtrip"]


@pytest.mark.parametrize("attn", ["sagecupy", "sdpa"])
def test_two_ranks_match_one_process(tg, two_ranks, attn):
    """Loss and (summed) gradients of the sharded model equal the single-process model's on the full sequence.
    Everything runs in float32 outside the attention (the exact backend computes in float64, SDPA in float32), and
    the sums run in another order (per shard, then across ranks): a few float32 units apart, hence rtol 1e-5 on the
    loss and 1e-4 relative to each gradient's largest entry."""
    cfg, res = two_ranks
    tok = torch.randint(0, 256, (cfg.batch, cfg.seq + 1), generator=torch.Generator().manual_seed(7))
    model = tg.build_model(cfg, "sdpa")
    loss = model(tok[:, :-1], tok[:, 1:])
    loss.backward()
    for r in res:
        assert r[attn]["loss"] == pytest.approx(loss.item(), rel=1e-5)
        for name, p in model.named_parameters():
            got = torch.tensor(r[attn]["grads"][name])
            scale = p.grad.abs().max().item()
            assert (got - p.grad).abs().max().item() <= 1e-4 * scale, name
    assert res[0][attn]["grads"] == res[1][attn]["grads"]  # summed: every rank steps with the same gradients


def test_two_training_steps_keep_the_ranks_identical(two_ranks):
    _, res = two_ranks
    a, b = res
    assert a["train"] == b["train"]  # the loss rank 0 prints is every rank's (all_reduce)
    assert a["weights"] == b["weights"]  # the summed gradients keep the replicas identical, bit for bit
    assert len(a["train"]["curve"]) == 2 and all(np.isfinite(a["train"]["curve"])) and np.isfinite(a["train"]["val"])
    assert abs(a["train"]["curve"][0] - np.log(256)) < 0.5  # a fresh model is about uniform over the bytes
