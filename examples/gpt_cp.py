"""Context parallelism for examples/train_gpt.py (``--context-parallel N``): every sequence spread over N ranks.

Each rank holds the zigzag shard of every sequence of the batch (``sagecupy.reference.context_parallel.zigzag_plan``,
the plan ``sagecupy.torch.shard_sequence`` and ``context_parallel_attention`` use: the sequence cut into ``2N``
chunks, rank ``r`` holding chunks ``r`` and ``2N - 1 - r``, which evens out the causal work). Embeddings, norms and
MLPs run on the local tokens; the rotary angles are those of each token's global position (from the plan);
attention is

* ``sagecupy``: ``sagecupy.torch.context_parallel_attention(q, k, v, group, causal=True, layout="HND")`` (the ring
  of the INT8 kernels; ``backend="exact"`` or ``"reference"`` runs it on CPU tensors over gloo, for tests);
* ``sdpa``: every rank's K and V gathered (``all_gather``), then ``scaled_dot_product_attention`` with the causal
  mask of the global positions: a simple, correct baseline (each rank holds the whole K/V).

The model is replicated: every rank starts from the same seed, draws the same batches and keeps identical weights,
because the gradients are summed over the ranks (one ``all_reduce``) before every optimizer step. Each rank's loss
is the sum over its tokens divided by the batch's global token count, so the summed gradients are those of the
mean over all tokens, which is the loss rank 0 prints (``all_reduce`` of the shares).

The sequence must split into ``2N`` chunks of equal length on multiples of the SageBwd tiles
(``sagebwd_alignment``): every rank then holds as many tokens, and the ring's blocks never cut a tile.

    torchrun --nproc-per-node 2 examples/train_gpt.py --context-parallel 2 --attn sagecupy --steps 300
"""
import dataclasses
import json
import math
import os
import sys


# --------------------------------------------------------------------------------------------------
# the plan (no PyTorch needed)
# --------------------------------------------------------------------------------------------------


def plan_unit(ranks, config=None):
    """The sequence lengths the plan takes are the multiples of this: ``2 * ranks`` chunks, each a multiple of both
    tile alignments (queries and keys are cut alike, as the model's self-attention shares one sequence)."""
    from sagecupy.config import get_config
    from sagecupy.reference.context_parallel import sagebwd_alignment

    align_q, align_k = sagebwd_alignment(get_config(config))
    return 2 * ranks * math.lcm(align_q, align_k)


def make_plan(seq, ranks, config=None):
    """The zigzag ShardPlan of a ``seq``-token self-attention over ``ranks`` ranks; ValueError (naming the lengths
    that would do) when the chunks would not all have one length aligned on the tiles."""
    from sagecupy.config import get_config
    from sagecupy.reference.context_parallel import sagebwd_alignment, zigzag_plan

    unit = plan_unit(ranks, config)
    if seq % unit:
        below, above = seq // unit * unit, (seq // unit + 1) * unit
        raise ValueError(f"--seq {seq} does not split into the zigzag plan's {2 * ranks} equal chunks aligned on "
                         f"sagecupy's tiles for --context-parallel {ranks}: use a multiple of {unit} "
                         f"(e.g. {above}" + (f" or {below})" if below else ")"))
    align_q, align_k = sagebwd_alignment(get_config(config))
    return zigzag_plan(seq, seq, ranks, align_q=align_q, align_k=align_k)


def local_positions(plan, rank):
    """Rank ``rank``'s global positions in the order its shard holds them (its chunks concatenated in the plan's
    order, as ``shard_sequence`` cuts them), int64 NumPy."""
    import numpy as np

    return np.concatenate([np.arange(a, b, dtype=np.int64) for a, b in plan.q_chunks[rank]])


def check_args(a, cfg, world_size):
    """The message refusing ``--context-parallel`` with these arguments, or None."""
    n = a.context_parallel
    if world_size is None:
        return (f"--context-parallel {n} runs one process per rank: launch with torchrun --nproc-per-node {n} "
                f"examples/train_gpt.py --context-parallel {n} ...")
    if world_size != n:
        return f"--context-parallel {n} but the launch has {world_size} processes (torchrun --nproc-per-node {n})"
    if cfg.pack:
        return ("--pack with --context-parallel is not supported: packed documents need document offsets on every "
                "shard, which context_parallel_attention does not take")
    if cfg.entry != "op":
        return "--context-parallel calls context_parallel_attention (--entry op); the drop-in SDPA is one device's"
    try:
        make_plan(cfg.seq, n)
    except ValueError as exc:
        return str(exc)
    return None


# --------------------------------------------------------------------------------------------------
# attention and the model's forward on a shard
# --------------------------------------------------------------------------------------------------


def _gather_function():
    import torch
    import torch.distributed as dist

    class GatherSeq(torch.autograd.Function):
        """all_gather of equal shards along dim 1, differentiable: every rank's gradient of the gathered tensor
        holds shares for every shard, so the backward sums them (all_reduce) and keeps this rank's slice
        (all_reduce rather than reduce_scatter, which gloo lacks)."""

        @staticmethod
        def forward(ctx, x, group):
            R, rank = dist.get_world_size(group), dist.get_rank(group)
            parts = [torch.empty_like(x, memory_format=torch.contiguous_format) for _ in range(R)]
            dist.all_gather(parts, x.contiguous(), group=group)
            ctx.group, ctx.rank, ctx.n = group, rank, x.shape[1]
            return torch.cat(parts, dim=1)

        @staticmethod
        def backward(ctx, g):
            g = g.contiguous()
            dist.all_reduce(g, group=ctx.group)
            return g.narrow(1, ctx.rank * ctx.n, ctx.n), None

    return GatherSeq


def attention_cp(attn, plan, rank, group=None, *, layout="HND", backend=None, device="cpu"):
    """``f(q, k, v, docs=None) -> o`` on this rank's (B, n, H, D) shards (train_gpt.attention_fn's signature), causal
    over the global positions of ``plan``."""
    import numpy as np
    import torch

    if attn == "sdpa":
        import torch.nn.functional as F

        gather = _gather_function()
        qpos = torch.from_numpy(local_positions(plan, rank)).to(device)
        kpos = torch.from_numpy(np.concatenate([local_positions(plan, r) for r in range(plan.ranks)])).to(device)
        mask = kpos[None, :] <= qpos[:, None]  # the gathered keys come in rank order, each shard in its order

        def f(q, k, v, docs=None):
            k_all, v_all = gather.apply(k, group), gather.apply(v, group)
            return F.scaled_dot_product_attention(q.transpose(1, 2), k_all.transpose(1, 2), v_all.transpose(1, 2),
                                                  attn_mask=mask).transpose(1, 2)
        return f
    import sagecupy.torch as st

    # the global lengths are known, so the call gathers no shard lengths (no host read per layer)
    kw = dict(causal=True, plan=plan, backend=backend, seq_lens=(plan.Nq, plan.Nk))
    if layout == "NHD":
        def f(q, k, v, docs=None):
            return st.context_parallel_attention(q, k, v, group, layout="NHD", **kw)
        return f

    def f(q, k, v, docs=None):
        return st.context_parallel_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), group,
                                             layout="HND", **kw).transpose(1, 2)
    return f


def loss_share(tg, model, idx, targets, positions, total_tokens):
    """This rank's share of the mean next-byte loss: the sum of its tokens' losses over ``total_tokens`` (the
    batch's tokens on all ranks). ``positions``: the global positions of ``idx``'s columns (the rotary angles)."""
    import torch.nn.functional as F

    x = model.emb(idx)
    cos, sin = model.cos[positions], model.sin[positions]
    for blk in model.blocks:
        x = blk(x, cos, sin)
    logits = model.head(tg._rms(x, model.norm))
    return F.cross_entropy(logits.float().view(-1, tg.VOCAB), targets.reshape(-1), reduction="sum") / total_tokens


def build(tg, cfg, attn, plan, rank, group=None, *, device="cpu", backend=None):
    """train_gpt's model (the same initialization from ``cfg.seed`` on every rank) with context-parallel
    attention."""
    att = attention_cp(attn, plan, rank, group, layout=cfg.layout, backend=backend, device=device)
    return tg.build_model(cfg, attn, device, att=att)


def all_reduce_grads(params, group=None):
    """Sum the gradients over the ranks, in one flat message (one collective instead of one per tensor)."""
    import torch
    import torch.distributed as dist

    grads = [p.grad for p in params if p.grad is not None]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    at = 0
    for g in grads:
        g.copy_(flat[at:at + g.numel()].view_as(g))
        at += g.numel()


# --------------------------------------------------------------------------------------------------
# training
# --------------------------------------------------------------------------------------------------


def evaluate_cp(tg, model, val_bytes, cfg, device, autocast, pos, group=None):
    """train_gpt.evaluate's windows, each sharded; the mean loss over all ranks' tokens."""
    import torch
    import torch.distributed as dist

    data = torch.frombuffer(bytearray(val_bytes), dtype=torch.uint8).to(device)
    windows = list(range(0, len(val_bytes) - cfg.seq, cfg.seq))[:cfg.val_windows]
    span = torch.arange(cfg.seq + 1, device=device)
    total = torch.zeros((), dtype=torch.float64, device=device)
    model.eval()
    with torch.no_grad():
        for i in range(0, len(windows), cfg.batch):
            chunk = torch.tensor(windows[i:i + cfg.batch], device=device)
            tok = data[chunk[:, None] + span[None, :]].long()
            with autocast():
                total += loss_share(tg, model, tok[:, :-1][:, pos], tok[:, 1:][:, pos], pos,
                                    cfg.seq * len(windows)).double()
    model.train()
    dist.all_reduce(total, group=group)
    return total.item()


def train_cp(tg, cfg, attn, *, group=None, device="cuda", data, log=print, backend=None, return_model=False):
    """One context-parallel run on every rank of ``group`` (train_gpt.train's loop and record, without --compile's
    and --pack's branches); ``log`` is called on rank 0 only. ``return_model``: (record, trained model)."""
    import torch
    import torch.distributed as dist

    device = torch.device(device)
    R, rank = dist.get_world_size(group), dist.get_rank(group)
    plan = make_plan(cfg.seq, R)
    pos = torch.from_numpy(local_positions(plan, rank)).to(device)
    train_bytes, val_bytes, *_ = data
    model = build(tg, cfg, attn, plan, rank, group, device=device, backend=backend)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8,
                            **({"fused": True} if device.type == "cuda" else {}))
    warmup = cfg.warmup_steps or max(1, cfg.steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: tg.lr_factor(s, cfg.steps, warmup, cfg.min_lr_ratio))

    def autocast():
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)

    # every rank draws the same full batches (same seed) and keeps its columns: no data is exchanged
    batch = tg._batches(train_bytes, dataclasses.replace(cfg, pack=False), device)
    clock = tg._Clock(device)
    tokens_per_step = cfg.batch * cfg.seq
    losses, lrs, marks, last_log = [], [], [clock.mark()], 0
    for step in range(cfg.steps):
        x, y, _ = batch(step)
        with autocast():
            loss = loss_share(tg, model, x[:, pos], y[:, pos], pos, tokens_per_step)
        loss.backward()
        all_reduce_grads(model.parameters(), group)
        if cfg.grad_clip > 0:  # on the summed gradients: every rank clips alike
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        lrs.append(sched.get_last_lr()[0])
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        total = loss.detach().clone()
        dist.all_reduce(total, group=group)
        losses.append(total)
        marks.append(clock.mark())
        last_log = tg.log_progress(log if rank == 0 else None, f"{attn:<9} cp {R}", step, cfg, clock, marks, last_log,
                                   losses, lrs, tokens_per_step)
    record = dict(attn=attn, context_parallel=R, plan=plan.kind,
                  **tg.run_summary(cfg, clock, marks, losses, lrs, tokens_per_step,
                                   lambda: evaluate_cp(tg, model, val_bytes, cfg, device, autocast, pos, group)))
    if device.type == "cuda":
        record["torch_peak_bytes"] = torch.cuda.max_memory_allocated(device)
    return (record, model) if return_model else record


def main(tg, ap, a, cfg):
    """``train_gpt.py --context-parallel N`` on one rank (torchrun starts N)."""
    world = os.environ.get("WORLD_SIZE")
    tg._importable_sagecupy()
    message = check_args(a, cfg, int(world) if world else None)
    if message:
        ap.error(message)
    attns = tg.ATTNS if a.compare else (a.attn,)
    tg._check_machine(ap, attns)
    import torch
    import torch.distributed as dist

    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    try:
        rank = dist.get_rank()
        if dist.get_world_size() != a.context_parallel:
            tg._fail(ap, f"--context-parallel {a.context_parallel} but the process group has "
                         f"{dist.get_world_size()} ranks")
        log = print if rank == 0 else None
        cfg.data = str(cfg.data or tg.default_data_dir())
        try:
            data = tg.load_data(cfg.data, cfg.val_fraction, cfg.seq)
        except (OSError, ValueError) as exc:
            tg._fail(ap, str(exc))
        if log:
            log(f"data: {len(data[0]):,} train bytes, {len(data[1]):,} validation bytes from {cfg.data}; model: "
                f"{cfg.layers} x (d_model {cfg.d_model}, {cfg.heads} heads x {cfg.d_head}), seq {cfg.seq} over "
                f"{a.context_parallel} ranks ({cfg.seq // a.context_parallel} tokens each), batch {cfg.batch}")
            sys.stdout.flush()
        runs = []
        for attn in attns:
            r = train_cp(tg, cfg, attn, device="cuda", data=data, log=log)
            runs.append(r)
            if log:
                rate = f"{r['tokens_per_s']:,.0f}" if r["tokens_per_s"] else "-"
                log(f"{attn} (context parallel {a.context_parallel}): {rate} tokens/s over {r['timed_steps']} "
                    f"steps, final train loss {r['final_train_loss']:.4f}, val loss {r['val_loss']:.4f}")
            tg._release("cuda")
        if rank == 0:
            result = dict(config=dataclasses.asdict(cfg), context_parallel=a.context_parallel,
                          data_bytes=dict(train=len(data[0]), validation=len(data[1])),
                          environment=tg.environment("cuda"), runs=runs)
            if a.compare:
                result["compare"] = tg.compare_summary(runs[0], runs[1])
                print(tg.format_summary(runs[0], runs[1], result["compare"]))
            if a.out:
                with open(a.out, "w") as fh:
                    json.dump(result, fh, indent=1)
    finally:
        dist.destroy_process_group()
    return 0
