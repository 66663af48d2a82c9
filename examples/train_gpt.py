"""Train a small GPT on bytes of Python source with its attention through PyTorch's SDPA or sagecupy's INT8 kernels.

The model is a decoder as modern ones are built: pre-norm RMSNorm blocks, QK-norm (RMSNorm over each head's q and
k, which also bounds what the INT8 quantizer sees), rotary positions, a GELU MLP, no biases; byte-level vocabulary
(256). It trains in bf16 autocast (float32 master weights) with AdamW (fused on CUDA), a linear warm-up and a cosine
decay, gradient clipping; the data are the bytes of the ``.py`` files under ``--data`` (default: the installed
sagecupy package), split by position into train (first part) and validation (last part).

Attention (causal), on the same bf16 q, k, v (QK-normed and rotated; (B, H, N, D) views of the projections):

* ``sdpa``: ``torch.nn.functional.scaled_dot_product_attention(..., is_causal=True)`` (on Hopper PyTorch picks
  cuDNN or flash for bf16);
* ``sagecupy``: ``sagecupy.torch.sage_attention(q, k, v, causal=True, layout="HND")`` (``--entry op``, the default;
  ``--layout NHD`` hands the kernels (B, N, H, D) views instead), or the drop-in
  ``sagecupy.torch.scaled_dot_product_attention(..., is_causal=True, fallback="error")`` (``--entry dropin``; an
  error rather than a silent PyTorch fallback, so the run measures the kernels).

``--pack`` trains with document masking instead: each step's batch is one packed sequence of the same token budget
(``--batch`` x ``--seq`` next-byte pairs) made of whole documents (the corpus's files; a file longer than ``--seq``
pairs is cut into pieces of at most ``--seq``, and the last document of a step continues as the first of the next),
in an order drawn from ``--seed``; positions (the rotary angles) restart at every document, and attention is causal
within each document only:

* ``sdpa``: ``scaled_dot_product_attention`` with the block-diagonal causal mask of the step's documents (one boolean
  mask per step, shared by the layers; PyTorch then runs its memory-efficient or math kernel, not flash);
* ``sagecupy``: ``sagecupy.torch.sage_attention(q, k, v, layout="THD", cu_seqlens_q=cu, cu_seqlens_k=cu,
  max_seqlen_q=m, max_seqlen_k=m, causal=True)`` on (total, H, D) views, ``cu`` the int32 document offsets on the
  GPU (``--entry op`` only; ``--layout`` does not apply).

Validation then packs the validation split's documents in order into sequences of ``--seq`` pairs.

``--context-parallel N`` (launched as ``torchrun --nproc-per-node N examples/train_gpt.py --context-parallel N``)
spreads every sequence over N GPUs (examples/gpt_cp.py): each rank holds the zigzag shard of the plan of
``sagecupy.torch.shard_sequence`` and runs embeddings, MLPs and norms on its tokens with their global rotary
positions; attention is ``sagecupy.torch.context_parallel_attention(..., causal=True)`` (``sagecupy``) or SDPA on
all-gathered K/V with the global causal mask (``sdpa``). The model is replicated (gradients summed over the ranks
every step), the loss is the mean over all ranks' tokens, rank 0 prints and writes ``--out``. ``--seq`` must be a
multiple of 2N chunks of sagecupy's tile alignment; ``--pack`` is refused.

Throughput is tokens per second over the steps after ``--timing-warmup`` (CUDA events around every step; the first
steps, compilation and the kernels' first compilation are left out). ``--compare`` trains both from the same
initialization on the same batches and prints the ratio of their tokens/s and the relative difference of their
final losses (the speed target: sagecupy at least 1.15x SDPA's tokens/s, final loss within 1%). Two runs that differ
only in their attention's rounding drift apart as training amplifies the difference, so one seed's loss difference
can be far from what the attention costs: ``--seeds N`` repeats the comparison for seeds ``--seed`` ..
``--seed + N - 1`` and judges the loss target on the mean paired difference, with a 95% confidence interval
(Student's t over the seeds): met when the interval lies within 1%, not met when it lies outside, else not resolved.

    python examples/train_gpt.py --compare --steps 300 --out gpt.json          # the default config, both
    python examples/train_gpt.py --compare --steps 300 --seeds 5               # five paired runs, pooled
    python examples/train_gpt.py --attn sagecupy --preset small --steps 100    # a quick run
    python examples/train_gpt.py --compare --compile --seq 16384               # torch.compile, longer sequences
    python examples/train_gpt.py --compare --pack --steps 300                  # document masking, both

``--out FILE.json`` writes the config, the environment (GPU, versions, commit) and per run the loss curve, step
times, tokens/s, final train loss (mean of the last ``--final-window`` steps) and validation loss.
"""
import argparse
import dataclasses
import importlib.util
import json
import math
import sys
import time
from pathlib import Path

ATTNS = ("sdpa", "sagecupy")
ENTRIES = ("op", "dropin")
LAYOUTS = ("HND", "NHD")
#: Model shapes by name. ``default`` is attention-heavy: at N = 8192 and D = 128 the causal attention's
#: forward+backward FLOPs (3.5 * 2 N^2 H D per layer) are about three quarters of the matmuls' (6 N * 12 d^2).
PRESETS = {
    "default": dict(seq=8192, d_head=128, heads=8, layers=4, d_model=1024, batch=1),
    "small": dict(seq=1024, d_head=64, heads=4, layers=2, d_model=256, batch=4),
}
VOCAB = 256  # bytes
#: The target --compare checks: sagecupy's tokens/s over SDPA's, and the largest relative difference of the final
#: (train and validation) losses.
TARGET_SPEEDUP, TARGET_LOSS_REL = 1.15, 0.01


@dataclasses.dataclass
class RunConfig:
    """Everything that defines one training run (the model, the optimizer, the data, the measurement)."""
    seq: int = 8192
    d_head: int = 128
    heads: int = 8
    layers: int = 4
    d_model: int = 1024
    batch: int = 1
    mlp_ratio: int = 4
    steps: int = 300
    lr: float = 1e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 0  # 0: 5% of the steps
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    seed: int = 0
    compile: bool = False
    entry: str = "op"
    layout: str = "HND"
    pack: bool = False
    timing_warmup: int = 10
    log_every: int = 10
    val_windows: int = 16
    val_fraction: float = 0.1
    final_window: int = 10
    data: str = ""  # "" means the installed sagecupy package


# --------------------------------------------------------------------------------------------------
# data
# --------------------------------------------------------------------------------------------------


def default_data_dir() -> Path:
    """The installed sagecupy package's folder (its own Python source is the corpus), else the checkout's."""
    spec = importlib.util.find_spec("sagecupy")
    if spec is not None and spec.submodule_search_locations:
        return Path(list(spec.submodule_search_locations)[0])
    return Path(__file__).resolve().parents[1] / "sagecupy"


def load_documents(data_dir) -> list:
    """The bytes of every ``.py`` file under ``data_dir`` (a document each), in sorted path order (reproducible),
    caches skipped. ValueError when there is none."""
    root = Path(data_dir)
    if not root.is_dir():
        raise ValueError(f"--data {root}: not a directory")
    files = sorted(p for p in root.rglob("*.py") if "__pycache__" not in p.parts)
    if not files:
        raise ValueError(f"--data {root}: no .py files under it")
    return [p.read_bytes() for p in files]


def load_bytes(data_dir) -> bytes:
    """The documents of :func:`load_documents`, concatenated."""
    return b"".join(load_documents(data_dir))


def document_starts(documents) -> list:
    """Where each document begins in their concatenation."""
    starts, at = [], 0
    for doc in documents:
        starts.append(at)
        at += len(doc)
    return starts


def split_starts(starts, cut):
    """The document starts of the two parts of :func:`split_bytes` (the bytes before ``cut``, the bytes from it), each
    relative to its part; a document that the cut splits becomes one document in each part."""
    train = [s for s in starts if s < cut]
    val = [s - cut for s in starts if s >= cut]
    if not val or val[0] != 0:
        val.insert(0, 0)
    return train, val


def split_bytes(data: bytes, val_fraction: float, seq: int):
    """(train, validation) by position: the last ``val_fraction`` of the bytes validate. ValueError when either part
    cannot hold one sequence of ``seq`` + 1 bytes (inputs and their next-byte targets)."""
    cut = int(len(data) * (1.0 - val_fraction))
    train, val = data[:cut], data[cut:]
    for name, part in (("train", train), ("validation", val)):
        if len(part) < seq + 1:
            raise ValueError(f"the {name} split has {len(part)} bytes, fewer than --seq {seq} + 1: give --data a "
                             f"larger source tree, a smaller --seq, or another --val-fraction")
    return train, val


def load_data(data_dir, val_fraction, seq):
    """(train bytes, validation bytes, (train document starts, validation document starts)) of the corpus under
    ``data_dir`` (:func:`load_documents`, :func:`split_bytes`, :func:`split_starts`)."""
    documents = load_documents(data_dir)
    data = b"".join(documents)
    train, val = split_bytes(data, val_fraction, seq)
    return train, val, split_starts(document_starts(documents), len(train))


def document_pieces(starts, n_bytes, seq):
    """(start, end) byte spans of the documents of a part of ``n_bytes`` bytes whose documents begin at ``starts``:
    a document of n bytes holds n - 1 next-byte pairs (input byte, target byte); one of more than ``seq`` pairs is cut
    into pieces of at most ``seq`` pairs that share their boundary byte, so that no pair is lost and none exceeds the
    rotary tables; documents of one byte (no pair) are left out."""
    bounds = list(starts) + [n_bytes]
    pieces = []
    for a, b in zip(bounds[:-1], bounds[1:]):
        while b - a >= 2:
            end = min(b, a + seq + 1)
            pieces.append((a, end))
            a = end - 1
    return pieces


def pack_plan(pieces, budget, steps, seed=None):
    """Packed sequences of ``budget`` next-byte pairs each, for ``steps`` steps, from the document ``pieces`` of
    :func:`document_pieces`: their pairs in a stream, the pieces in an order drawn from ``seed`` (a new order each time
    the stream has used them all; None: in order), cut every ``budget`` pairs. The document a cut splits continues as
    the first document of the next sequence. NumPy arrays (host):

    * ``inputs``: ``(steps * budget,)`` byte offsets of the inputs (the targets are the next bytes);
    * ``positions``: each input's position in its document (restarting at every document and every sequence);
    * ``cu_seqlens``: the int32 document offsets of every sequence, one after the other; sequence ``i``'s are
      ``cu_seqlens[cu_index[i]:cu_index[i + 1]]`` (from 0 to ``budget``);
    * ``max_seqlen``: each sequence's longest document, as a list of ints."""
    import numpy as np

    lengths = [b - a - 1 for a, b in pieces]
    if not pieces or min(lengths) < 1:
        raise ValueError("pack_plan needs document pieces of at least one next-byte pair each")
    rng = np.random.default_rng(seed) if seed is not None else None
    need = steps * budget
    chunks, starts, n = [], [], 0
    while n < need:
        order = rng.permutation(len(pieces)) if rng is not None else range(len(pieces))
        for j in order:
            a, b = pieces[j]
            chunks.append(np.arange(a, b - 1, dtype=np.int64))
            starts.append(n)
            n += b - a - 1
            if n >= need:
                break
    inputs = np.concatenate(chunks)[:need]
    starts = np.asarray(starts, dtype=np.int64)
    index = np.arange(need, dtype=np.int64)
    doc_start = starts[np.searchsorted(starts, index, side="right") - 1]
    positions = (index - np.maximum(doc_start, index // budget * budget)).astype(np.int32)
    cu, cu_index, max_seqlen = [], [0], []
    for i in range(steps):
        s0 = i * budget
        inner = starts[(starts > s0) & (starts < s0 + budget)] - s0
        offsets = np.concatenate([[0], inner, [budget]]).astype(np.int32)
        cu.append(offsets)
        cu_index.append(cu_index[-1] + offsets.size)
        max_seqlen.append(int(np.diff(offsets).max()))
    return dict(inputs=inputs, positions=positions, cu_seqlens=np.concatenate(cu), cu_index=cu_index,
                max_seqlen=max_seqlen)


# --------------------------------------------------------------------------------------------------
# model (PyTorch is imported when a model is built, so that the command line works without it)
# --------------------------------------------------------------------------------------------------


def _rms(x, weight, eps=1e-6):
    """RMSNorm in float32 (the statistics of bf16 activations lose digits otherwise)."""
    import torch

    xf = x.float()
    return xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight


def _rope_tables(seq, d_head, device, base=10000.0):
    """cos and sin of the rotary angles, float32, (seq, 1, d_head / 2): broadcast over (B, N, H, D / 2)."""
    import torch

    inv = base ** (-torch.arange(0, d_head, 2, dtype=torch.float32, device=device) / d_head)
    ang = torch.arange(seq, dtype=torch.float32, device=device)[:, None] * inv[None, :]
    return ang.cos()[:, None, :], ang.sin()[:, None, :]


def _rope(x, cos, sin):
    """Rotate the halves of the last axis of x (B, N, H, D), float32."""
    import torch

    h = x.shape[-1] // 2
    x1, x2 = x[..., :h], x[..., h:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def block_causal_mask(cu_seqlens, n):
    """The block-diagonal causal mask of a packed sequence of ``n`` tokens whose documents have the offsets
    ``cu_seqlens``: ``(n, n)`` bool, True where query ``i`` may see key ``j`` (same document, ``j <= i``)."""
    import torch

    index = torch.arange(n, device=cu_seqlens.device)
    doc = torch.searchsorted(cu_seqlens[1:].long(), index, right=True)  # each token's document
    return (doc[:, None] == doc[None, :]) & (index[None, :] <= index[:, None])


def attention_fn(attn, entry="op", layout="HND", pack=False):
    """``f(q, k, v, docs=None) -> o`` on (B, N, H, D) bf16 tensors (views of the projections), causal, o (B, N, H, D).

    SDPA and sagecupy's HND entry take (B, H, N, D) views of the same memory (no copy: both read strided
    inputs); their output is then viewed back. ``pack``: B = 1 and ``docs`` is ``(cu_seqlens, positions, max_seqlen,
    mask)`` of the packed sequence (:func:`build_model`): causal within each document, SDPA through ``mask`` (the
    block-diagonal causal mask), sagecupy through ``layout="THD"`` with the offsets."""
    import torch.nn.functional as F

    if attn not in ATTNS:
        raise ValueError(f"attn={attn!r} is not one of {', '.join(ATTNS)}")
    if pack and attn == "sdpa":
        def f(q, k, v, docs):
            return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                  attn_mask=docs[3]).transpose(1, 2)
        return f
    if attn == "sdpa":
        def f(q, k, v, docs=None):
            return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                  is_causal=True).transpose(1, 2)
        return f
    import sagecupy.torch as st

    if pack:
        if entry != "op":
            raise ValueError("--pack runs sagecupy through sage_attention (--entry op): the drop-in SDPA takes no "
                             "document offsets")

        def f(q, k, v, docs):
            cu, _, longest, _ = docs
            return st.sage_attention(q[0], k[0], v[0], layout="THD", cu_seqlens_q=cu, cu_seqlens_k=cu,
                                     max_seqlen_q=longest, max_seqlen_k=longest, causal=True)[None]
        return f
    if entry == "dropin":
        def f(q, k, v, docs=None):
            # fallback="error": a call the kernels would not compute raises instead of timing PyTorch's SDPA
            return st.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                   is_causal=True, fallback="error").transpose(1, 2)
        return f
    if layout == "NHD":
        def f(q, k, v, docs=None):
            return st.sage_attention(q, k, v, causal=True, layout="NHD")
        return f

    def f(q, k, v, docs=None):
        return st.sage_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=True,
                                 layout="HND").transpose(1, 2)
    return f


def build_model(cfg: RunConfig, attn, device="cpu", att=None):
    """The GPT for ``cfg`` with ``attn``'s attention, initialized from ``cfg.seed`` alone (the same weights for
    every attention and device), on ``device``. ``att``: an attention function of :func:`attention_fn`'s signature
    to use instead (context parallelism's, examples/gpt_cp.py)."""
    import torch
    from torch import nn

    att = att or attention_fn(attn, cfg.entry, cfg.layout, cfg.pack)
    width = cfg.heads * cfg.d_head
    resid_std = 0.02 / math.sqrt(2 * cfg.layers)  # residual branches scaled so the stream's variance stays put

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm1 = nn.Parameter(torch.ones(cfg.d_model))
            self.qkv = nn.Linear(cfg.d_model, 3 * width, bias=False)
            self.q_norm = nn.Parameter(torch.ones(cfg.d_head))
            self.k_norm = nn.Parameter(torch.ones(cfg.d_head))
            self.proj = nn.Linear(width, cfg.d_model, bias=False)
            self.norm2 = nn.Parameter(torch.ones(cfg.d_model))
            self.up = nn.Linear(cfg.d_model, cfg.mlp_ratio * cfg.d_model, bias=False)
            self.down = nn.Linear(cfg.mlp_ratio * cfg.d_model, cfg.d_model, bias=False)

        def forward(self, x, cos, sin, docs=None):
            B, N, _ = x.shape
            h = self.qkv(_rms(x, self.norm1))  # autocast runs the projection in bf16
            q, k, v = h.view(B, N, 3, cfg.heads, cfg.d_head).unbind(2)  # (B, N, H, D) views
            # QK-norm, then the rotation, in float32; the attention takes bf16 (v's dtype)
            q = _rope(_rms(q, self.q_norm), cos, sin).to(v.dtype)
            k = _rope(_rms(k, self.k_norm), cos, sin).to(v.dtype)
            o = att(q, k, v, docs)
            x = x + self.proj(o.reshape(B, N, width))
            h = self.up(_rms(x, self.norm2))
            return x + self.down(nn.functional.gelu(h, approximate="tanh"))

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(VOCAB, cfg.d_model)
            self.blocks = nn.ModuleList(Block() for _ in range(cfg.layers))
            self.norm = nn.Parameter(torch.ones(cfg.d_model))
            self.head = nn.Linear(cfg.d_model, VOCAB, bias=False)
            cos, sin = _rope_tables(cfg.seq, cfg.d_head, "cpu")
            self.register_buffer("cos", cos, persistent=False)
            self.register_buffer("sin", sin, persistent=False)

        def forward(self, idx, targets, docs=None):
            """``docs``: None, or a packed sequence's ``(cu_seqlens, positions, max_seqlen)`` (``idx`` (1, N))."""
            N = idx.shape[1]
            x = self.emb(idx)
            if docs is None:
                cos, sin = self.cos[:N], self.sin[:N]
            else:  # positions restart at every document; the mask only where the attention takes one
                cu, positions, longest = docs
                cos, sin = self.cos[positions], self.sin[positions]
                docs = (cu, positions, longest, block_causal_mask(cu, N) if attn == "sdpa" else None)
            for blk in self.blocks:
                x = blk(x, cos, sin, docs)
            logits = self.head(_rms(x, self.norm))
            return nn.functional.cross_entropy(logits.float().view(-1, VOCAB), targets.reshape(-1))

    gen = torch.Generator().manual_seed(cfg.seed)
    model = GPT()
    for name, p in model.named_parameters():
        if p.dim() < 2:
            continue  # norm weights stay at one
        std = resid_std if name.endswith(("proj.weight", "down.weight")) else 0.02
        with torch.no_grad():
            p.copy_(torch.randn(p.shape, generator=gen) * std)
    return model.to(device)


# --------------------------------------------------------------------------------------------------
# training
# --------------------------------------------------------------------------------------------------


class _Clock:
    """Step boundaries: CUDA events on the current stream (no synchronization until read), or the host clock."""

    def __init__(self, device):
        import torch

        self.torch, self.cuda = torch, device.type == "cuda"

    def mark(self):
        if self.cuda:
            ev = self.torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def ms(self, start, end):
        if self.cuda:
            end.synchronize()
            return start.elapsed_time(end)
        return (end - start) * 1e3


def lr_factor(step, steps, warmup, min_ratio):
    """Linear warm-up over ``warmup`` steps, then a cosine from 1 to ``min_ratio`` at the last step."""
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - 1 - warmup)
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


def _batches(train_bytes, cfg, device, starts=None):
    """The training data on ``device`` and a function giving step ``i``'s (inputs, targets, docs): the window offsets
    (or, with ``cfg.pack``, the packed sequences of :func:`pack_plan` over the documents beginning at ``starts``) are
    drawn once from ``cfg.seed`` (the same batches, in the same order, for every attention) and put on the device
    once, so that a step reads no host data. ``docs``: None, or the packed sequence's ``(cu_seqlens, positions,
    max_seqlen)`` (``max_seqlen`` a host int, as FlashAttention takes it)."""
    import torch

    data = torch.frombuffer(bytearray(train_bytes), dtype=torch.uint8).to(device)
    if cfg.pack:
        budget = cfg.batch * cfg.seq
        plan = pack_plan(document_pieces(starts or [0], len(train_bytes), cfg.seq), budget, cfg.steps, cfg.seed + 1)
        inputs, positions, cu = (torch.from_numpy(plan[n]).to(device) for n in ("inputs", "positions", "cu_seqlens"))
        cu_index, longest = plan["cu_index"], plan["max_seqlen"]

        def batch(i):
            at = inputs[i * budget:(i + 1) * budget]
            docs = (cu[cu_index[i]:cu_index[i + 1]], positions[i * budget:(i + 1) * budget].long(), longest[i])
            return data[at][None].long(), data[at + 1][None].long(), docs

        batch.documents_per_step = (len(plan["cu_seqlens"]) - cfg.steps) / cfg.steps
        return batch
    gen = torch.Generator().manual_seed(cfg.seed + 1)
    offsets = torch.randint(0, len(train_bytes) - cfg.seq, (cfg.steps, cfg.batch), generator=gen).to(device)
    span = torch.arange(cfg.seq + 1, device=device)

    def batch(i):
        tok = data[offsets[i][:, None] + span[None, :]].long()
        return tok[:, :-1], tok[:, 1:], None

    return batch


def evaluate(model, val_bytes, cfg, device, autocast, starts=None):
    """Mean next-byte loss over the first ``cfg.val_windows`` non-overlapping windows of the validation split; with
    ``cfg.pack``, over as many packed sequences of ``cfg.seq`` pairs of its documents (beginning at ``starts``), taken
    in order."""
    import torch

    data = torch.frombuffer(bytearray(val_bytes), dtype=torch.uint8).to(device)
    total = torch.zeros((), dtype=torch.float64, device=device)
    model.eval()
    with torch.no_grad():
        if cfg.pack:
            pieces = document_pieces(starts or [0], len(val_bytes), cfg.seq)
            count = max(1, min(cfg.val_windows, sum(b - a - 1 for a, b in pieces) // cfg.seq))
            plan = pack_plan(pieces, cfg.seq, count)
            for i in range(count):
                at = torch.from_numpy(plan["inputs"][i * cfg.seq:(i + 1) * cfg.seq]).to(device)
                cu = torch.from_numpy(plan["cu_seqlens"][plan["cu_index"][i]:plan["cu_index"][i + 1]]).to(device)
                pos = torch.from_numpy(plan["positions"][i * cfg.seq:(i + 1) * cfg.seq]).to(device).long()
                with autocast():
                    total += model(data[at][None].long(), data[at + 1][None].long(),
                                   (cu, pos, plan["max_seqlen"][i])).double()
        else:
            windows = list(range(0, len(val_bytes) - cfg.seq, cfg.seq))[:cfg.val_windows]
            count = len(windows)
            span = torch.arange(cfg.seq + 1, device=device)
            for i in range(0, len(windows), cfg.batch):
                chunk = torch.tensor(windows[i:i + cfg.batch], device=device)
                tok = data[chunk[:, None] + span[None, :]].long()
                with autocast():
                    total += model(tok[:, :-1], tok[:, 1:]).double() * len(chunk)
    model.train()
    return (total / count).item()


def train(cfg: RunConfig, attn, *, device="cuda", data=None, log=print) -> dict:
    """Train one model; returns its record (JSON-ready): the curve, step times, tokens/s, final losses.

    ``data``: (train bytes, validation bytes[, (train document starts, validation document starts)]), else read from
    ``cfg.data`` (:func:`load_data`); without the starts, ``cfg.pack`` takes each part as one document (cut into
    pieces of ``cfg.seq`` pairs). ``device``: a PyTorch device (``"cpu"`` runs SDPA only, in bf16 autocast as on the
    GPU; for tests and trying options)."""
    import torch

    device = torch.device(device)
    if data is None:
        data = load_data(cfg.data or default_data_dir(), cfg.val_fraction, cfg.seq)
    train_bytes, val_bytes, *doc_starts = data
    train_starts, val_starts = doc_starts[0] if doc_starts else ([0], [0])
    if cfg.compile:
        torch._dynamo.reset()  # each run compiles its own model from scratch
    model = build_model(cfg, attn, device)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8,
                            **({"fused": True} if device.type == "cuda" else {}))
    warmup = cfg.warmup_steps or max(1, cfg.steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: lr_factor(s, cfg.steps, warmup, cfg.min_lr_ratio))
    step_model = torch.compile(model) if cfg.compile else model

    def autocast():
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)

    batch = _batches(train_bytes, cfg, device, train_starts)
    clock = _Clock(device)
    tokens_per_step = cfg.batch * cfg.seq
    losses, lrs, marks = [], [], [clock.mark()]
    last_log = 0
    for step in range(cfg.steps):
        x, y, docs = batch(step)
        with autocast():
            loss = step_model(x, y, docs)
        loss.backward()
        if cfg.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        lrs.append(sched.get_last_lr()[0])
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())  # read at the log steps only: no synchronization in between
        marks.append(clock.mark())
        last_log = log_progress(log, f"{attn:<9}", step, cfg, clock, marks, last_log, losses, lrs, tokens_per_step)
    record = dict(attn=attn, entry=cfg.entry if attn == "sagecupy" else None,
                  layout=("THD" if cfg.pack else cfg.layout) if attn == "sagecupy" and cfg.entry == "op" else None,
                  pack=cfg.pack, documents_per_step=getattr(batch, "documents_per_step", None),
                  compiled=cfg.compile, **run_summary(cfg, clock, marks, losses, lrs, tokens_per_step,
                                                      lambda: evaluate(model, val_bytes, cfg, device, autocast,
                                                                       val_starts)))
    if device.type == "cuda":
        record["torch_peak_bytes"] = torch.cuda.max_memory_allocated(device)
        cupy = sys.modules.get("cupy")
        if cupy is not None:  # sagecupy's buffers live in CuPy's pool, which PyTorch does not count
            record["cupy_pool_total_bytes"] = cupy.get_default_memory_pool().total_bytes()
    return record


def log_progress(log, label, step, cfg, clock, marks, last_log, losses, lrs, tokens_per_step):
    """Log a line at every ``--log-every`` step and the last (tokens/s since the previous line); returns the step the
    next line counts from. ``log`` None: no line (and no synchronization: the loss is read only here)."""
    if log and (step % cfg.log_every == 0 or step == cfg.steps - 1):
        ms = clock.ms(marks[last_log], marks[-1])
        rate = tokens_per_step * (step + 1 - last_log) / (ms / 1e3) if ms > 0 else float("nan")
        log(f"{label} step {step:5d}  loss {losses[-1].item():.4f}  lr {lrs[-1]:.2e}  {rate:,.0f} tok/s")
        return step + 1
    return last_log


def run_summary(cfg, clock, marks, losses, lrs, tokens_per_step, val_loss):
    """A run's measured fields: step times from the marks (the first ``--timing-warmup`` steps not timed), tokens/s,
    the loss curve and its final window, and ``val_loss()`` (called after the curve is read)."""
    import torch

    step_ms = [clock.ms(a, b) for a, b in zip(marks[:-1], marks[1:])]
    timed_from = min(cfg.timing_warmup, cfg.steps - 1)
    timed_ms = sum(step_ms[timed_from:])
    curve = torch.stack(losses).float().cpu().tolist()
    window = curve[-min(cfg.final_window, len(curve)):]
    return dict(steps=cfg.steps, tokens_per_step=tokens_per_step, timed_steps=cfg.steps - timed_from,
                tokens_per_s=tokens_per_step * (cfg.steps - timed_from) / (timed_ms / 1e3) if timed_ms > 0 else None,
                median_step_ms=sorted(step_ms[timed_from:])[(cfg.steps - timed_from) // 2],
                final_train_loss=sum(window) / len(window), last_loss=curve[-1], val_loss=val_loss(),
                curve=[dict(step=i, loss=v, lr=lr) for i, (v, lr) in enumerate(zip(curve, lrs))], step_ms=step_ms)


def _release(device):
    """Give the cached memory of one run back before the next run starts (both frameworks' pools)."""
    import gc

    import torch

    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        cupy = sys.modules.get("cupy")
        if cupy is not None:
            cupy.get_default_memory_pool().free_all_blocks()


def compare_summary(sdpa: dict, sage: dict) -> dict:
    """sagecupy against SDPA: tokens/s ratio and relative differences of the final losses ((sagecupy - sdpa) /
    sdpa), and whether each meets the target."""
    ratio = sage["tokens_per_s"] / sdpa["tokens_per_s"] if sdpa.get("tokens_per_s") and sage.get("tokens_per_s") \
        else None
    rel_train = (sage["final_train_loss"] - sdpa["final_train_loss"]) / sdpa["final_train_loss"]
    rel_val = (sage["val_loss"] - sdpa["val_loss"]) / sdpa["val_loss"]
    return dict(tokens_per_s_ratio=ratio, train_loss_rel_diff=rel_train, val_loss_rel_diff=rel_val,
                target_speedup=TARGET_SPEEDUP, target_loss_rel=TARGET_LOSS_REL,
                speed_target_met=ratio is not None and ratio >= TARGET_SPEEDUP,
                loss_target_met=abs(rel_train) <= TARGET_LOSS_REL and abs(rel_val) <= TARGET_LOSS_REL)


def format_summary(sdpa: dict, sage: dict, s: dict) -> str:
    def rate(r):
        return f"{r['tokens_per_s']:,.0f}" if r.get("tokens_per_s") else "-"

    ratio = f"{s['tokens_per_s_ratio']:.3f}x" if s["tokens_per_s_ratio"] is not None else "-"
    return "\n".join([
        f"tokens/s       sdpa {rate(sdpa)}  sagecupy {rate(sage)}  ratio {ratio} "
        f"(target >= {TARGET_SPEEDUP:.2f}x: {'met' if s['speed_target_met'] else 'not met'})",
        f"train loss     sdpa {sdpa['final_train_loss']:.4f}  sagecupy {sage['final_train_loss']:.4f}  "
        f"{s['train_loss_rel_diff']:+.2%}",
        f"val loss       sdpa {sdpa['val_loss']:.4f}  sagecupy {sage['val_loss']:.4f}  {s['val_loss_rel_diff']:+.2%} "
        f"(target within {TARGET_LOSS_REL:.0%} for both: {'met' if s['loss_target_met'] else 'not met'})",
    ])


# Student's t, two-sided 95%, by degrees of freedom (1.96 beyond the table)
_T95 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
        2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)


def _interval(values: list) -> tuple:
    """(mean, low, high): the mean of ``values`` and its two-sided 95% confidence interval (Student's t)."""
    n = len(values)
    mean = sum(values) / n
    sd = math.sqrt(sum((x - mean) ** 2 for x in values) / (n - 1))
    half = (_T95[n - 2] if n - 1 <= len(_T95) else 1.96) * sd / math.sqrt(n)
    return mean, mean - half, mean + half


def _verdict(low: float, high: float) -> str:
    """The loss target on a confidence interval of a relative difference."""
    if -TARGET_LOSS_REL <= low and high <= TARGET_LOSS_REL:
        return "met"
    if high < -TARGET_LOSS_REL or low > TARGET_LOSS_REL:
        return "not met"
    return "not resolved"


def pooled_summary(per_seed: list) -> dict:
    """compare_summary's results of two or more seeds pooled: the tokens/s ratio's mean and range, and per loss the
    mean paired relative difference with its 95% interval. The loss target is met when both intervals lie within
    TARGET_LOSS_REL, not met when either lies outside it, else not resolved by this many seeds."""
    if len(per_seed) < 2:
        raise ValueError("pooled_summary needs two seeds or more")
    ratios = [s["tokens_per_s_ratio"] for s in per_seed if s["tokens_per_s_ratio"] is not None]
    out = dict(seeds=len(per_seed), target_speedup=TARGET_SPEEDUP, target_loss_rel=TARGET_LOSS_REL,
               tokens_per_s_ratio=sum(ratios) / len(ratios) if ratios else None,
               tokens_per_s_ratio_range=[min(ratios), max(ratios)] if ratios else None)
    out["speed_target_met"] = out["tokens_per_s_ratio"] is not None and out["tokens_per_s_ratio"] >= TARGET_SPEEDUP
    verdicts = []
    for key in ("train_loss_rel_diff", "val_loss_rel_diff"):
        mean, low, high = _interval([s[key] for s in per_seed])
        out[key] = mean
        out[key + "_interval95"] = [low, high]
        verdicts.append(_verdict(low, high))
    out["loss_target"] = ("not met" if "not met" in verdicts else
                          "met" if verdicts == ["met", "met"] else "not resolved")
    return out


def format_pooled(per_seed: list, seeds: list, p: dict) -> str:
    """One line per seed, then pooled_summary's result."""
    lines = []
    for seed, s in zip(seeds, per_seed):
        ratio = f"{s['tokens_per_s_ratio']:.3f}x" if s["tokens_per_s_ratio"] is not None else "-"
        lines.append(f"seed {seed:<5d} tokens/s ratio {ratio}  train loss {s['train_loss_rel_diff']:+.2%}  "
                     f"val loss {s['val_loss_rel_diff']:+.2%}")
    if p["tokens_per_s_ratio"] is not None:
        lo, hi = p["tokens_per_s_ratio_range"]
        speed = f"{p['tokens_per_s_ratio']:.3f}x ({lo:.3f}-{hi:.3f})"
    else:
        speed = "-"
    lines.append(f"{p['seeds']} seeds    tokens/s ratio {speed} (target >= {TARGET_SPEEDUP:.2f}x: "
                 f"{'met' if p['speed_target_met'] else 'not met'})")
    for name, key in (("train loss", "train_loss_rel_diff"), ("val loss", "val_loss_rel_diff")):
        lo, hi = p[key + "_interval95"]
        lines.append(f"{name:<14s} mean {p[key]:+.2%}, 95% interval {lo:+.2%} .. {hi:+.2%}")
    lines[-1] += f" (target within {TARGET_LOSS_REL:.0%} for both: {p['loss_target']})"
    return "\n".join(lines)


def environment(device="cuda") -> dict:
    """GPU, versions and commit (sagecupy's own header where it can be built), never raising."""
    import platform

    env = {"python": platform.python_version()}
    try:
        import torch

        env.update(torch=torch.__version__, torch_cuda=torch.version.cuda)
        if torch.device(device).type == "cuda" and torch.cuda.is_available():
            env.update(gpu=torch.cuda.get_device_name(), compute_capability=".".join(
                map(str, torch.cuda.get_device_capability())), cudnn=torch.backends.cudnn.version())
    except Exception as exc:
        env["torch_error"] = f"{type(exc).__name__}: {exc}"
    try:
        from sagecupy._env import environment as sagecupy_environment

        env["sagecupy"] = sagecupy_environment()
    except Exception as exc:
        env["sagecupy_error"] = f"{type(exc).__name__}: {exc}"
    return env


# --------------------------------------------------------------------------------------------------
# command line
# --------------------------------------------------------------------------------------------------


def _positive(text):
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text} is not a positive integer")
    return value


def _non_negative(text):
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text} is not a non-negative integer")
    return value


def _fraction(text):
    value = float(text)
    if not 0.0 < value < 1.0:
        raise argparse.ArgumentTypeError(f"{text} is not between 0 and 1")
    return value


def build_parser():
    d = RunConfig()
    ap = argparse.ArgumentParser(prog=Path(__file__).name, description=__doc__.splitlines()[0])
    ap.add_argument("--attn", choices=ATTNS, default="sagecupy",
                    help="attention: sdpa (PyTorch's scaled_dot_product_attention) or sagecupy (INT8 SageBwd "
                         "through sagecupy.torch)")
    ap.add_argument("--compare", action="store_true",
                    help="train with both attentions (same initialization, same batches) and print the tokens/s "
                         "ratio and the relative difference of the final losses; --attn is ignored")
    ap.add_argument("--entry", choices=ENTRIES, default=d.entry,
                    help="sagecupy's way in: op (sagecupy.torch.sage_attention) or dropin "
                         "(sagecupy.torch.scaled_dot_product_attention with fallback='error')")
    ap.add_argument("--layout", choices=LAYOUTS, default=d.layout,
                    help="layout sage_attention is called with (--entry op): HND takes (B, H, N, D) views, NHD "
                         "the (B, N, H, D) projections as they are")
    ap.add_argument("--pack", action="store_true",
                    help="document masking: each step is one packed sequence of --batch x --seq tokens made of whole "
                         "documents (the corpus's files, cut into pieces of at most --seq), positions restarting "
                         "and attention causal within each document; sdpa with a block-diagonal causal mask, "
                         "sagecupy with layout='THD' and cu_seqlens (--entry op)")
    ap.add_argument("--context-parallel", type=_positive, default=None, metavar="N",
                    help="spread every sequence over N ranks (launch with torchrun --nproc-per-node N): zigzag "
                         "shards, context_parallel_attention (sagecupy) or all-gathered K/V (sdpa), gradients "
                         "summed over the ranks; not with --pack")
    ap.add_argument("--preset", choices=tuple(PRESETS), default="default",
                    help="model shape: default " + " ".join(f"--{k.replace('_', '-')} {v}"
                                                            for k, v in PRESETS["default"].items())
                         + "; small " + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in PRESETS["small"].items())
                         + " (the options below override it)")
    for name, text in (("seq", "sequence length (tokens = bytes)"), ("d_head", "head dimension (sagecupy: 64 or 128)"),
                       ("heads", "attention heads"), ("layers", "transformer blocks"),
                       ("d_model", "width of the residual stream"), ("batch", "sequences per step")):
        ap.add_argument(f"--{name.replace('_', '-')}", dest=name, type=_positive, default=None,
                        help=f"{text} [default: from --preset]")
    ap.add_argument("--mlp-ratio", type=_positive, default=d.mlp_ratio, help="MLP hidden width / d_model")
    ap.add_argument("--steps", type=_positive, default=d.steps, help="optimizer steps per run")
    ap.add_argument("--lr", type=float, default=d.lr, help="peak learning rate (AdamW)")
    ap.add_argument("--min-lr-ratio", type=float, default=d.min_lr_ratio,
                    help="learning rate at the last step, as a fraction of --lr (cosine decay)")
    ap.add_argument("--warmup-steps", type=_non_negative, default=d.warmup_steps,
                    help="linear learning-rate warm-up steps (0: 5%% of --steps)")
    ap.add_argument("--weight-decay", type=float, default=d.weight_decay, help="AdamW weight decay of the matrices")
    ap.add_argument("--grad-clip", type=float, default=d.grad_clip, help="gradient norm clip (0: none)")
    ap.add_argument("--seed", type=int, default=d.seed, help="seed of the initialization and of the batch order")
    ap.add_argument("--seeds", type=_positive, default=1,
                    help="with --compare: compare for this many seeds from --seed on and judge the loss target on "
                         "the mean paired difference and its 95%% interval")
    ap.add_argument("--compile", action="store_true", help="torch.compile the model")
    ap.add_argument("--timing-warmup", type=_non_negative, default=d.timing_warmup,
                    help="first steps left out of tokens/s (compilation, the kernels' first build, clocks)")
    ap.add_argument("--log-every", type=_positive, default=d.log_every,
                    help="print the loss and tokens/s every this many steps")
    ap.add_argument("--data", default=None, metavar="DIR",
                    help="train on the .py files under DIR [default: the installed sagecupy package]")
    ap.add_argument("--val-fraction", type=_fraction, default=d.val_fraction,
                    help="last fraction of the bytes kept for validation")
    ap.add_argument("--val-windows", type=_positive, default=d.val_windows,
                    help="validation windows of --seq bytes at most (non-overlapping, from the split's start)")
    ap.add_argument("--final-window", type=_positive, default=d.final_window,
                    help="final train loss = mean of the last this many steps' losses")
    ap.add_argument("--out", default=None, metavar="FILE.json",
                    help="write the config, the environment and each run's curve, step times, tokens/s and final "
                         "losses as JSON")
    for action in ap._actions:
        if action.default is not None and action.default is not False and action.default != argparse.SUPPRESS \
                and "default" not in action.help:
            action.help += " [default: %(default)s]"
    return ap


def config_from_args(a) -> RunConfig:
    shape = dict(PRESETS[a.preset])
    shape.update({k: getattr(a, k) for k in shape if getattr(a, k) is not None})
    return RunConfig(**shape, mlp_ratio=a.mlp_ratio, steps=a.steps, lr=a.lr, min_lr_ratio=a.min_lr_ratio,
                     warmup_steps=a.warmup_steps, weight_decay=a.weight_decay, grad_clip=a.grad_clip, seed=a.seed,
                     compile=a.compile, entry=a.entry, layout=a.layout, pack=a.pack, timing_warmup=a.timing_warmup,
                     log_every=a.log_every, val_windows=a.val_windows, val_fraction=a.val_fraction,
                     final_window=a.final_window, data=a.data or "")


def _fail(ap, message):
    """One line on stderr, exit status 1 (a machine that cannot run the request; not a malformed command line)."""
    print(f"{ap.prog}: error: {message}", file=sys.stderr)
    sys.exit(1)


def _check_machine(ap, attns):
    """Exit with one line when this machine lacks what the run needs: PyTorch, a CUDA device with bf16, and for
    sagecupy its PyTorch adapter, CuPy and a device the kernels run on."""
    try:
        import torch
    except ImportError as exc:
        _fail(ap, f"needs PyTorch ({exc}): pip install torch")
    if not torch.cuda.is_available():
        _fail(ap, "PyTorch sees no CUDA device; this example trains on a GPU")
    if not torch.cuda.is_bf16_supported():
        _fail(ap, f"{torch.cuda.get_device_name()} has no bf16 support; this example trains in bf16")
    if "sagecupy" in attns:
        try:
            import sagecupy.torch  # noqa: F401
            from sagecupy._loader import gpu_status
        except Exception as exc:  # ImportError, or an adapter that refuses this PyTorch
            _fail(ap, f"--attn sagecupy needs sagecupy's PyTorch adapter ({type(exc).__name__}: {exc})")
        ok, why = gpu_status()
        if not ok:
            _fail(ap, f"--attn sagecupy needs CuPy and a CUDA device: {why}")


def _importable_sagecupy():
    """Put the checkout beside this file on sys.path when sagecupy is not installed (running from a clone)."""
    root = Path(__file__).resolve().parents[1]
    if importlib.util.find_spec("sagecupy") is None and (root / "sagecupy" / "__init__.py").is_file():
        sys.path.insert(0, str(root))


def _gpt_cp():
    """examples/gpt_cp.py (beside this file; loaded by path, as examples/ is not a package)."""
    spec = importlib.util.spec_from_file_location("gpt_cp", Path(__file__).with_name("gpt_cp.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def main(argv=None):
    ap = build_parser()
    a = ap.parse_args(argv)
    cfg = config_from_args(a)
    attns = ATTNS if a.compare else (a.attn,)
    if "sagecupy" in attns and cfg.d_head not in (64, 128):
        ap.error(f"--d-head {cfg.d_head}: sagecupy's kernels take head dimensions 64 and 128")
    if not 0.0 <= cfg.min_lr_ratio <= 1.0:
        ap.error(f"--min-lr-ratio {cfg.min_lr_ratio} is not between 0 and 1")
    if cfg.pack and "sagecupy" in attns and cfg.entry != "op":
        ap.error("--pack runs sagecupy through sage_attention (--entry op): the drop-in SDPA takes no document "
                 "offsets")
    if a.seeds > 1 and not a.compare:
        ap.error("--seeds N compares over N seeds: it needs --compare")
    if a.seeds > 1 and a.context_parallel is not None:
        ap.error("--seeds is not supported with --context-parallel")
    if a.context_parallel is not None:
        # this module's names as a namespace: it runs as __main__ or is loaded by path, under no importable name
        return _gpt_cp().main(argparse.Namespace(**globals()), ap, a, cfg)
    _importable_sagecupy()
    _check_machine(ap, attns)
    cfg.data = str(cfg.data or default_data_dir())  # the record names the corpus it was trained on
    try:
        data = load_data(cfg.data, cfg.val_fraction, cfg.seq)
    except (OSError, ValueError) as exc:
        _fail(ap, str(exc))
    print(f"data: {len(data[0]):,} train bytes, {len(data[1]):,} validation bytes from {cfg.data}; "
          f"model: {cfg.layers} x (d_model {cfg.d_model}, {cfg.heads} heads x {cfg.d_head}), seq {cfg.seq}, "
          f"batch {cfg.batch}" + (f", packed documents ({cfg.batch * cfg.seq} tokens per step)" if cfg.pack else ""),
          flush=True)
    runs, seeds, per_seed = [], [cfg.seed + i for i in range(a.seeds)], []
    for seed in seeds:
        seed_cfg = dataclasses.replace(cfg, seed=seed)
        pair = []
        for attn in attns:
            r = train(seed_cfg, attn, device="cuda", data=data)
            r["seed"] = seed
            pair.append(r)
            rate = f"{r['tokens_per_s']:,.0f}" if r["tokens_per_s"] else "-"
            print(f"{attn}{f' (seed {seed})' if a.seeds > 1 else ''}: {rate} tokens/s over {r['timed_steps']} steps, "
                  f"final train loss {r['final_train_loss']:.4f}, val loss {r['val_loss']:.4f}", flush=True)
            _release("cuda")
        runs += pair
        if a.compare:
            per_seed.append(compare_summary(pair[0], pair[1]))
    result = dict(config=dataclasses.asdict(cfg), data_bytes=dict(train=len(data[0]), validation=len(data[1])),
                  environment=environment("cuda"), runs=runs)
    if a.compare and a.seeds == 1:
        result["compare"] = per_seed[0]
        print(format_summary(runs[0], runs[1], result["compare"]))
    elif a.compare:
        result["compare"] = pooled_summary(per_seed)
        result["compare_per_seed"] = [dict(seed=seed, **s) for seed, s in zip(seeds, per_seed)]
        print(format_pooled(per_seed, seeds, result["compare"]))
    if a.out:
        with open(a.out, "w") as fh:
            json.dump(result, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
