"""Context parallelism over ``torch.distributed``: one attention call whose sequence is spread over the ranks of a
process group, each rank holding a shard of the query rows and of the keys (:func:`context_parallel_attention`).

Sharding. A :class:`~sagecupy.reference.context_parallel.ShardPlan` (``"zigzag"``, the default: the sequence cut
into ``2R`` chunks, rank ``r`` holding chunks ``r`` and ``2R - 1 - r`` of the queries and of the keys, which evens
out the causal work; ``"contiguous"``; or a plan of one's own) says which global rows each rank owns; chunk
boundaries fall on ``sagebwd_alignment(config)`` so that no SageBwd tile is cut. A rank's shard is its chunks
concatenated in the plan's order: :func:`shard_sequence` cuts it from the full tensor, :func:`unshard_sequence`
puts the shards back together (``all_gather``). The global lengths are the sums of the shards' lengths, gathered
once per call (``seq_lens=None``, which also checks that the ranks agree on shapes and options) or given.

``mode="ring"`` (sagecupy/context_parallel.py's ``ring_attention``, run for real):

* Statistics: K-smoothing's mean and V's per-channel scale span every key. Each rank computes the partial
  statistics of its key chunks; one ``all_gather`` gives every rank every chunk's partials, reduced in the plan's
  chunk order exactly as ``ring_attention`` reduces them (a few KB per chunk), so all ranks quantize with the
  single call's statistics.
* Forward: at step ``t`` rank ``r`` holds the K/V shard of rank ``(r - t) mod R``. Before computing with it, the
  rank posts (``batch_isend_irecv``) the send of that shard to rank ``r + 1`` and the receive of the next one from
  ``r - 1``, so the transfer overlaps the step's compute. Every visible (query chunk, key chunk) pair (the
  reference's ``_ring_pairs``: pairs the causal mask or window hides are skipped) gives a partial output merged
  into its query chunk's running ``(O, LSE)`` in fp32, in ``ring_attention``'s order with its formula.
* Backward: the ring runs again; each K/V shard travels with fp32 dK/dV accumulators (starting at the owner, so
  that every shard's shares are summed in ``ring_attention_backward``'s order). The K/V of the next step is
  prefetched as in the forward. The accumulator a rank needs at step ``t`` is finished by the previous rank at the
  end of step ``t - 1``, so it travels during step ``t``'s compute: the rank computes its shares first and adds
  them, in the pairs' order, once it has arrived. dQ shares stay on the rank. After the R steps each accumulator
  sits one rank past its owner: one last hop (fp32 dK/dV only) brings it home. Gradients are rounded to the input
  dtype once, at the end. Nothing of the remote blocks is kept between the forward and the backward (which
  would cost every rank the whole sequence's K codes and V): the backward quantizes each pair again (a pre-pass,
  not the attention kernel).

``mode="all2all"`` (Ulysses): an ``all_to_all`` trades the sequence shard of every head for the whole sequence of
``Hq/R`` query heads and ``Hkv/R`` key/value heads (both must divide by ``R``); each rank makes the ordinary
single-device call on them (statistics over the whole sequence by construction), and a second ``all_to_all`` brings
the output back to sequence shards. The backward is autograd's through the exchanges, each the other's inverse.

Precision (ring, GPU), as ``ring_attention``'s: with aligned chunks every tile of a block is the single call's
tile, so the blocks compute the single call's function; the kernels write each partial O and each gradient share in
the input dtype, merges run in fp32 and shares are summed in fp32, so O carries one fp16/bf16 rounding per visible
block instead of one in all, the gradients one per share, and the LSE merge a few fp32 units. The distributed ring
computes the same blocks in the same order with the same merges as ``ring_attention(q, k, v, ranks=R, plan=...)``
on one GPU, and gathers the same statistics, so it is meant to equal it bit for bit. ``all2all`` is the single
call's result on each head, bit for bit.

Backends (``backend=``): the per-block compute is pluggable, so that the communication runs and is tested on the
CPU. ``None``: the INT8 kernels (``sagecupy.context_parallel``) on zero-copy CuPy views of CUDA tensors, on
PyTorch's current stream; one GPU per rank, an NCCL process group (the transfers are CUDA tensors). The float64
reference (``sagecupy.reference.context_parallel``) on CPU tensors, with a gloo group: ``"reference"`` (SageBwd
blocks, fp32 partials, merges and accumulators as on the GPU), ``"reference64"`` (float64 throughout: the
reference's ``ring_forward``/``ring_backward`` bit for bit, where float64 sums the keys exactly, e.g. fp16-valued
inputs: the statistics are summed per chunk here, per rank there) and ``"exact"`` (exact attention in float64, no
config). Or a :class:`BlockBackend` subclass.

Every rank of the group must make each call (the collectives pair up in call order). The call runs eagerly: the
collectives and CuPy views are not traceable by ``torch.compile``, which breaks the graph around it.
"""
from __future__ import annotations

import contextlib
import dataclasses
import numbers

import numpy as np
import torch
import torch.distributed as dist

from ..config import get_config
from ..reference import attention as _attn
from ..reference import context_parallel as _ref
from ..reference import sagebwd as _sb

# The 16-bit input types the reference rounds P to for a 16-bit dV (config dv_int8=False), by torch dtype.
_DTYPE16 = {torch.float16: "float16", torch.bfloat16: "bfloat16"}

__all__ = ["context_parallel_attention", "shard_sequence", "unshard_sequence", "BlockBackend"]

_LAYOUTS = ("HND", "NHD")
_MODES = ("ring", "all2all")
LN2 = 0.6931471805599453
LOG2E = 1.4426950408889634
# gloo matches messages between two ranks by tag; the four kinds a ring step may exchange get their own
_TAG_K, _TAG_V, _TAG_DK, _TAG_DV = 0, 1, 2, 3


# --------------------------------------------------------------------------------------------------
# small helpers (torch tensors in "HND" (B, H, N, D) or "NHD" (B, N, H, D))
# --------------------------------------------------------------------------------------------------


def _seq_dim(layout):
    return 2 if layout == "HND" else 1


def _rows(x, a, b, layout):
    """Rows (tokens) a .. b - 1 of x: a view."""
    return x.narrow(_seq_dim(layout), a, b - a)


def _hnd(x, layout):
    """x as (B, H, N, D): a view."""
    return x if layout == "HND" else x.transpose(1, 2)


def _layout_shape(B, H, N, D, layout):
    return (B, H, N, D) if layout == "HND" else (B, N, H, D)


def _np64(x, layout):
    """A CPU tensor as a contiguous float64 HND NumPy array (a copy: the reference never sees the caller's memory)."""
    return np.ascontiguousarray(_hnd(x.detach(), layout).to(torch.float64).numpy())


def _positions(r):
    return np.arange(r[0], r[1], dtype=np.int64)


# --------------------------------------------------------------------------------------------------
# backends: the per-block compute
# --------------------------------------------------------------------------------------------------


class BlockBackend:
    """The per-block compute of :func:`context_parallel_attention`; the communication is the caller's.

    Built once per call with the call's options (``causal, window, sm_scale, layout, config``). Tensors go in as
    the caller's views (``layout``, rows of one chunk); what comes out is HND. ``lse`` below is the backend's
    *merge LSE*, opaque to the caller: it is only merged, returned to :meth:`backward` and turned into the public
    LSE by :meth:`public_lse`. A subclass sets ``dtypes`` and ``device_type`` (checked on the inputs),
    ``acc_dtype`` (partial outputs, merge LSEs, gradient accumulators), ``needs_statistics``, and implements:

    * ``statistics(k, v) -> (k_sum, v_amax)``: one key chunk's partials, float64-exact tensors (B, Hkv, D);
    * ``reduce(parts) -> stats``: ``parts`` = ``[(k_sum, k_count, v_amax), ...]`` over every key chunk of the
      sequence in the plan's order (float64 tensors and an int), the global statistics (anything);
    * ``forward(q, k, v, stats, q_range, k_range, Nq, Nk) -> (o, lse, shift)``: the pair's partial (o (B, Hq, n,
      D) and lse (B, Hq, n), -inf where a row sees no key of the block) and what :meth:`public_lse` needs;
    * ``merge(o, lse, o_part, lse_part) -> (o, lse)``; ``public_lse(lse, shift) -> lse`` (natural log, as the
      single call returns it);
    * ``backward(q, k, v, stats, q_range, k_range, Nq, Nk, do, o, lse) -> (dq, dk, dv)``: the pair's shares from
      the rows' merged output (input dtype and layout) and merge LSE, in ``acc_dtype``, HND, dk and dv summed over
      each GQA group;
    * ``attention(q, k, v) -> (o, lse)``: the single call on whole sequences (HND, differentiable), for all2all.
    """

    dtypes: tuple = ()
    device_type = "cpu"
    acc_dtype = torch.float32
    needs_statistics = True

    def __init__(self, *, causal, window, sm_scale, layout, config):
        self.causal, self.window, self.sm_scale, self.layout, self.config = causal, window, sm_scale, layout, config

    def scope(self, device):
        """A context around a call's compute (the GPU backend: PyTorch's current stream as CuPy's)."""
        return contextlib.nullcontext()


def _merge_f32(o_a, l_a, o_b, l_b):
    """``sagecupy.context_parallel._merge`` (base 2) in torch fp32, its operations in its order: the merge of the
    GPU ring, for backends that run on the CPU."""
    f32, ninf = torch.float32, float("-inf")
    hi, lo = torch.maximum(l_a, l_b), torch.minimum(l_a, l_b)
    seen = hi != ninf
    hi_safe = torch.where(seen, hi, torch.zeros((), dtype=f32))
    x = torch.exp2(lo - hi_safe)  # in [0, 1]; 0 where lo = -inf
    lg = torch.log1p(x) * torch.tensor(LOG2E, dtype=f32)
    lse = torch.where(seen, hi_safe + lg, torch.full((), ninf, dtype=f32))
    one = torch.ones((), dtype=f32)
    w_hi, w_lo = one / (one + x), x / (one + x)
    a_hi = l_a >= l_b
    w_a, w_b = torch.where(a_hi, w_hi, w_lo), torch.where(a_hi, w_lo, w_hi)
    return w_a[..., None] * o_a + w_b[..., None] * o_b, lse


class CudaBackend(BlockBackend):
    """The INT8 kernels (``sagecupy.context_parallel``) on CUDA tensors: exactly ``ring_attention``'s blocks,
    merge (CuPy's fp32 ``_merge``, base 2 on the kernels' internal LSE) and public LSE."""

    dtypes = (torch.float16, torch.bfloat16)
    device_type = "cuda"

    def __init__(self, **options):
        super().__init__(**options)
        from .. import context_parallel as cp

        self.cp, self.cfg = cp, cp._check_config(self.config)

    def scope(self, device):
        from .torch_ops import on_torch_stream

        return on_torch_stream(device)

    @staticmethod
    def _io():
        from .torch_ops import from_cupy, to_cupy

        return to_cupy, from_cupy

    def statistics(self, k, v):
        to_cupy, from_cupy = self._io()
        part = self.cp.block_statistics(to_cupy(k, "k"), to_cupy(v, "v"), layout=self.layout, config=self.cfg)
        return from_cupy(part["k_sum"]), from_cupy(part["v_amax"])

    def reduce(self, parts):
        to_cupy, _ = self._io()
        # v_amax travelled as float64; it was float32, so this is its value bit for bit
        return self.cp.reduce_statistics([{"k_sum": to_cupy(s), "k_count": n, "v_amax": to_cupy(a.float())}
                                          for s, n, a in parts])

    def forward(self, q, k, v, stats, q_range, k_range, Nq, Nk):
        import cupy

        to_cupy, from_cupy = self._io()
        cp = self.cp
        blk = cp.block_forward(to_cupy(q, "q"), to_cupy(k, "k"), to_cupy(v, "v"), stats, q_range, k_range, Nq, Nk,
                               causal=self.causal, sm_scale=self.sm_scale, window=self.window, layout=self.layout,
                               config=self.cfg)
        l2 = blk.lse2[:, :, :q_range[1] - q_range[0]]
        l2 = cupy.where(l2 == cupy.inf, cupy.float32(-cupy.inf), l2)  # (the kernel's "no key" is +inf)
        return from_cupy(cp._hnd(cp._as_f32(blk.o), self.layout)), from_cupy(l2), from_cupy(blk.qmk)

    def merge(self, o, lse, o_part, lse_part):
        to_cupy, from_cupy = self._io()
        o, lse = self.cp._merge(to_cupy(o), to_cupy(lse), to_cupy(o_part), to_cupy(lse_part), True)
        return from_cupy(o), from_cupy(lse)

    def public_lse(self, lse, shift):
        import cupy

        to_cupy, from_cupy = self._io()
        l2, qmk = to_cupy(lse), to_cupy(shift)
        return from_cupy(cupy.where(l2 == -cupy.inf, cupy.float32(-cupy.inf),
                                    l2 * cupy.float32(LN2) + qmk).astype(cupy.float32))

    def backward(self, q, k, v, stats, q_range, k_range, Nq, Nk, do, o, lse):
        from .. import int8

        to_cupy, from_cupy = self._io()
        cp = self.cp
        # block_forward's pre-pass without its attention kernel: the quantized operands are a deterministic
        # function of the inputs and statistics, and block_backward replaces the residuals' O and LSE with the
        # merged ones, so these residuals are those block_forward made in the forward
        p, cfg, pre = int8._preprocess_forward(to_cupy(q, "q"), to_cupy(k, "k"), to_cupy(v, "v"), causal=self.causal,
                                               sm_scale=self.sm_scale, layout=self.layout, config=self.cfg,
                                               window=self.window, statistics=cp._kernel_statistics(stats))
        mask = cp.block_mask(q_range, k_range, Nq, Nk, self.causal, self.window)
        res = int8.Residuals(p, cfg, pre["q_codes"], pre["q_scale"], pre["k_codes"], pre["k_scale"], pre["v"], None,
                             None, pre["mu_k"], None, mask)
        g = cp.block_backward(res, to_cupy(do, "do"), to_cupy(o, "o"), to_cupy(lse, "lse"))
        return tuple(from_cupy(cp._hnd(cp._as_f32(x), self.layout)) for x in g)

    def attention(self, q, k, v):
        from .torch import sage_attention

        return sage_attention(q, k, v, causal=self.causal, sm_scale=self.sm_scale, layout="HND", config=self.cfg,
                              return_lse=True, window=self.window)


class ReferenceBackend(BlockBackend):
    """The float64 reference on CPU tensors. ``exact``: exact attention (no statistics, no config); else SageBwd
    blocks (``sagebwd_quantize_q/kv``, ``sagebwd_block_forward/backward``). ``float64``: partials, merges (the
    reference's ``merge_partials`` on the natural internal LSE) and accumulators in float64, which makes the
    result the reference ring's (``ring_forward``/``ring_backward``) bit for bit; else fp32 with the GPU ring's
    merge (:func:`_merge_f32` on the base-2 internal LSE), the GPU's rounding structure on exact blocks."""

    dtypes = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
    exact = False
    float64 = False

    def __init__(self, **options):
        super().__init__(**options)
        self.cfg = None if self.exact else get_config(self.config)
        self.needs_statistics = not self.exact
        self.acc_dtype = torch.float64 if self.float64 else torch.float32

    def statistics(self, k, v):
        kh = _np64(k, self.layout)
        st = _ref.block_statistics(kh, _np64(v, self.layout), config=self.cfg)
        zero = np.zeros((kh.shape[0], kh.shape[1], kh.shape[3]))  # (a statistic the config does not use)
        return tuple(torch.from_numpy(zero if st[n] is None else st[n]) for n in ("k_sum", "v_amax"))

    def reduce(self, parts):
        cfg = self.cfg
        return _ref.reduce_statistics([{"k_sum": s.numpy() if cfg.k_smoothing else None, "k_count": n,
                                        "v_amax": a.numpy() if cfg.v_granularity == "channel" else None}
                                       for s, n, a in parts])

    def _blocks(self, q, k, v, stats):
        L = self.layout
        qb = _ref.sagebwd_quantize_q(_np64(q, L), sm_scale=self.sm_scale, config=self.cfg,
                                     dtype=_DTYPE16.get(q.dtype))
        kvb = _ref.sagebwd_quantize_kv(_np64(k, L), _np64(v, L), stats, sm_scale=self.sm_scale, config=self.cfg)
        return qb, kvb

    def forward(self, q, k, v, stats, q_range, k_range, Nq, Nk):
        pos = (_positions(q_range), _positions(k_range), Nq, Nk)
        if self.exact:
            L = self.layout
            o, lse = _ref.exact_block_forward(_np64(q, L), _np64(k, L), _np64(v, L), *pos, causal=self.causal,
                                              sm_scale=self.sm_scale, window=self.window)
            shift = np.zeros_like(lse)
        else:
            qb, kvb = self._blocks(q, k, v, stats)
            o, _, lse = _ref.sagebwd_block_forward(qb, kvb, *pos, causal=self.causal, window=self.window)
            Hq, Hkv = qb["q"].shape[1], kvb["k"].shape[1]
            shift = _ref._q_dot_mu(qb, kvb["mu_k"], _attn.kv_head_index(Hq, Hkv))  # (sm_scale q·μ_K)
        if not self.float64:
            lse = np.where(lse == -np.inf, -np.inf, lse * LOG2E)  # (base 2, as the kernels' internal LSE)
        return tuple(torch.from_numpy(np.asarray(x)).to(self.acc_dtype) for x in (o, lse, shift))

    def merge(self, o, lse, o_part, lse_part):
        if self.float64:
            return tuple(torch.from_numpy(x) for x in _ref.merge_partials(o.numpy(), lse.numpy(), o_part.numpy(),
                                                                         lse_part.numpy()))
        return _merge_f32(o, lse, o_part, lse_part)

    def public_lse(self, lse, shift):
        if self.float64:  # (ring_forward's expression)
            return torch.where(lse != float("-inf"), lse + shift, lse)
        f32 = torch.float32
        return torch.where(lse == float("-inf"), lse, lse * torch.tensor(LN2, dtype=f32) + shift).to(f32)

    def backward(self, q, k, v, stats, q_range, k_range, Nq, Nk, do, o, lse):
        L = self.layout
        pos = (_positions(q_range), _positions(k_range), Nq, Nk)
        doh = _np64(do, L)
        delta = _ref.row_delta(doh, _np64(o, L))
        lse = lse.numpy().astype(np.float64)
        if not self.float64:
            lse = np.where(lse == -np.inf, -np.inf, lse * LN2)
        if self.exact:
            g = _ref.exact_block_backward(_np64(q, L), _np64(k, L), _np64(v, L), doh, lse, delta, *pos,
                                          causal=self.causal, sm_scale=self.sm_scale, window=self.window)
        else:
            qb, kvb = self._blocks(q, k, v, stats)
            g = _ref.sagebwd_block_backward(qb, kvb, doh, lse, delta, *pos, causal=self.causal, window=self.window)
        return tuple(torch.from_numpy(x).to(self.acc_dtype) for x in g)

    def attention(self, q, k, v):
        return _ReferenceCall.apply(q, k, v, self)


class _ReferenceCall(torch.autograd.Function):
    """The reference's single call (SageBwd or exact, float64) on HND CPU tensors, differentiable: all2all's
    per-rank call for the reference backends. The output takes q's dtype, the LSE the backend's ``acc_dtype``."""

    @staticmethod
    def forward(ctx, q, k, v, be):
        qh, kh, vh = (_np64(x, "HND") for x in (q, k, v))
        kw = dict(causal=be.causal, sm_scale=be.sm_scale, window=be.window)
        if be.exact:
            o, lse = _attn.attention_forward(qh, kh, vh, **kw)
            ctx.state = (qh, kh, vh, o, lse)
        else:
            o, res = _sb.forward(qh, kh, vh, config=be.cfg, dtype=_DTYPE16.get(q.dtype), **kw)
            lse, ctx.state = res["lse"], res
        ctx.be, ctx.dtypes = be, (q.dtype, k.dtype, v.dtype)
        lse_t = torch.from_numpy(lse).to(be.acc_dtype)
        ctx.mark_non_differentiable(lse_t)
        return torch.from_numpy(o).to(q.dtype), lse_t

    @staticmethod
    def backward(ctx, do, _dlse):
        be, doh = ctx.be, _np64(do, "HND")
        if be.exact:
            g = _attn.attention_backward(*ctx.state, doh, causal=be.causal, sm_scale=be.sm_scale, window=be.window)
        else:
            g = _sb.backward(ctx.state, doh)
        return (*(torch.from_numpy(x).to(dt) for x, dt in zip(g, ctx.dtypes)), None)


class _SageReference64(ReferenceBackend):
    float64 = True


class _ExactReference(ReferenceBackend):
    exact = True
    float64 = True


_BACKENDS = {None: CudaBackend, "cuda": CudaBackend, "reference": ReferenceBackend, "reference64": _SageReference64,
             "exact": _ExactReference}


def _backend(backend, **options):
    if isinstance(backend, type) and issubclass(backend, BlockBackend):
        cls = backend
    elif isinstance(backend, (str, type(None))) and backend in _BACKENDS:
        cls = _BACKENDS[backend]
    else:
        raise ValueError(f"backend={backend!r} must be None (the INT8 kernels on CUDA tensors), 'reference', "
                         f"'reference64', 'exact' (the float64 reference on CPU tensors) or a BlockBackend subclass")
    return cls(**options)


# --------------------------------------------------------------------------------------------------
# groups, plans, shards
# --------------------------------------------------------------------------------------------------


def _group_info(group):
    """(R, rank in the group): RuntimeError/ValueError if torch.distributed cannot serve the call."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialized: call torch.distributed.init_process_group "
                           "(NCCL for CUDA tensors, gloo for CPU ones) before context parallel attention")
    R, rank = dist.get_world_size(group), dist.get_rank(group)
    if rank < 0:
        raise ValueError("group: this process is not a member of the process group passed")
    return R, rank


def _global_rank(group, r):
    return r if group is None else dist.get_global_rank(group, r)


def _alignment(config):
    """The plan's chunk alignment: the config's SageBwd tiles, for every backend (so that one plan serves all)."""
    return _ref.sagebwd_alignment(get_config(config))


def _make_plan(plan, Nq, Nk, R, config):
    return _ref.make_plan(plan, Nq, Nk, R, _alignment(config), "ranks", "the process group")


def _shard_len(chunks):
    return sum(b - a for a, b in chunks)


def _with_offsets(chunks):
    """[(index, (a, b), offset in the shard)] of the non-empty chunks of one rank's shard."""
    out, off = [], 0
    for j, (a, b) in enumerate(chunks):
        if b > a:
            out.append((j, (a, b), off))
        off += b - a
    return out


def _side(which):
    if which not in ("q", "k"):
        raise ValueError(f"which={which!r} must be 'q' (query rows, and the output) or 'k' (keys and values)")
    return which


def _check_layout(layout):
    if layout not in _LAYOUTS:
        raise ValueError(f"layout={layout!r} must be 'HND' (B, H, N, D) or 'NHD' (B, N, H, D)")
    return layout


def _side_chunks(plan, which):
    return plan.q_chunks if which == "q" else plan.k_chunks


def _side_plan(plan, N, which, R, config):
    """The plan whose ``which`` side has ``N`` positions: built for (N, N) from a name (each side's chunks depend on
    its own length only), or a ShardPlan checked against N and the group's size."""
    if isinstance(plan, str):
        return _make_plan(plan, N, N, R, config)
    if not isinstance(plan, _ref.ShardPlan):
        raise TypeError(f"plan must be 'zigzag', 'contiguous' or a ShardPlan, got {type(plan).__name__}")
    if (plan.Nq if which == "q" else plan.Nk) != N:
        raise ValueError(f"the sequence has {N} positions, the plan's {'queries' if which == 'q' else 'keys'} "
                         f"{plan.Nq if which == 'q' else plan.Nk}")
    return _make_plan(plan, plan.Nq, plan.Nk, R, config)


def shard_sequence(x, group=None, *, which="q", plan="zigzag", layout="HND", config=None):
    """This rank's shard of the full tensor ``x`` (every rank passing the same one): its chunks of the plan,
    concatenated in the plan's order, as :func:`context_parallel_attention` takes them. ``which="q"`` for the query
    rows (and ``do``), ``"k"`` for keys and values; ``x`` is (B, H, N, D) (``"HND"``) or (B, N, H, D) (``"NHD"``),
    or any tensor with the sequence in that dimension (an LSE (B, H, N) is ``"HND"``). ``plan`` and ``config``
    (whose tiles align the chunks) must be the call's. A copy; no communication."""
    _side(which), _check_layout(layout)
    R, rank = _group_info(group)
    dim = _seq_dim(layout)
    p = _side_plan(plan, x.shape[dim], which, R, config)
    chunks = _side_chunks(p, which)[rank]
    return torch.cat([_rows(x, a, b, layout) for a, b in chunks] + [x.narrow(dim, 0, 0)], dim=dim).contiguous()


def _gather_ints(values, group, device):
    """all_gather of a few ints per rank: (R, len(values)) nested lists (one host read)."""
    R = dist.get_world_size(group)
    mine = torch.tensor(values, dtype=torch.int64, device=device)
    out = [torch.empty_like(mine) for _ in range(R)]
    dist.all_gather(out, mine, group=group)
    return torch.stack(out).tolist()


def unshard_sequence(x_local, group=None, *, which="q", plan="zigzag", layout="HND", config=None, seq_len=None):
    """The full tensor from every rank's shard (:func:`shard_sequence`'s inverse), on every rank, by one
    ``all_gather`` (shards padded to the longest). ``seq_len=None``: the global length is the sum of the shards'
    lengths (one more small ``all_gather``). Not differentiable (the result is detached)."""
    _side(which), _check_layout(layout)
    R, rank = _group_info(group)
    dim = _seq_dim(layout)
    x_local = x_local.detach()
    n = x_local.shape[dim]
    lens = [row[0] for row in _gather_ints([n], group, x_local.device)] if seq_len is None else None
    N = sum(lens) if seq_len is None else seq_len
    p = _side_plan(plan, N, which, R, config)
    chunks = _side_chunks(p, which)
    for r in ([rank] if lens is None else range(R)):
        got = n if lens is None else lens[r]
        if got != _shard_len(chunks[r]):
            raise ValueError(f"x_local: rank {r} holds {got} positions, the plan gives it {_shard_len(chunks[r])} "
                             f"of {N} (shard with shard_sequence)")
    width = max(_shard_len(c) for c in chunks)
    pad = list(x_local.shape)
    pad[dim] = width - n
    padded = torch.cat([x_local, x_local.new_zeros(pad)], dim=dim).contiguous()
    parts = [torch.empty_like(padded) for _ in range(R)]
    dist.all_gather(parts, padded, group=group)
    pieces = sorted(((a, parts[r].narrow(dim, off, b - a)) for r in range(R) for _, (a, b), off in
                     _with_offsets(chunks[r])), key=lambda t: t[0])
    return torch.cat([t for _, t in pieces], dim=dim)


# --------------------------------------------------------------------------------------------------
# the ring
# --------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class _Ring:
    """One call's ring: who this rank is, the plan, the pairs it computes at each step."""

    group: object
    R: int
    rank: int
    plan: object
    backend: BlockBackend
    layout: str
    shapes: tuple  # (B, Hq, Hkv, D)

    def __post_init__(self):
        pairs, _ = _ref._ring_pairs(self.plan, self.backend.causal, self.backend.window)
        self.steps = [[(i, j) for t2, r, _, i, j in pairs if t2 == t and r == self.rank] for t in range(self.R)]
        self.q_chunks = {i: (rng, off) for i, rng, off in _with_offsets(self.plan.q_chunks[self.rank])}
        self.k_chunks = [{j: (rng, off) for j, rng, off in _with_offsets(c)} for c in self.plan.k_chunks]
        self.next = _global_rank(self.group, (self.rank + 1) % self.R)
        self.prev = _global_rank(self.group, (self.rank - 1) % self.R)

    def nk(self, s):
        return _shard_len(self.plan.k_chunks[s])

    def post(self, sends, recvs):
        """Post sends to the next rank and receives from the previous one, ``[(tag, tensor)]`` each; empty
        tensors are left out on both sides (their sizes come from the plan, which every rank shares)."""
        ops = [dist.P2POp(dist.isend, t, self.next, self.group, tag) for tag, t in sends if t.numel()]
        ops += [dist.P2POp(dist.irecv, t, self.prev, self.group, tag) for tag, t in recvs if t.numel()]
        return dist.batch_isend_irecv(ops) if ops else []


def _statistics(ring, k, v):
    """The global statistics: every rank's per-chunk partials through one all_gather, reduced by the backend in
    the plan's chunk order. Gathering the parts (rather than an all_reduce of sums and maxima) keeps the order of
    the float64 additions that of ring_attention, so the statistics are its bit for bit on every rank; the parts
    are 2·B·Hkv·D float64 per chunk, a few KB."""
    be, L, (B, _, Hkv, D) = ring.backend, ring.layout, ring.shapes
    if not be.needs_statistics:
        return None
    width = B * Hkv * D
    slots = max(len(c) for c in ring.plan.k_chunks)
    mine = torch.zeros((slots, 2 * width), dtype=torch.float64, device=k.device)
    for j, ((a, b), off) in ring.k_chunks[ring.rank].items():
        k_sum, v_amax = be.statistics(_rows(k, off, off + b - a, L), _rows(v, off, off + b - a, L))
        mine[j, :width] = k_sum.reshape(-1).to(torch.float64)
        mine[j, width:] = v_amax.reshape(-1).to(torch.float64)
    every = [torch.empty_like(mine) for _ in range(ring.R)]
    dist.all_gather(every, mine, group=ring.group)
    parts = [(every[s][j, :width].view(B, Hkv, D), b - a, every[s][j, width:].view(B, Hkv, D))
             for s in range(ring.R) for j, ((a, b), _) in ring.k_chunks[s].items()]
    return be.reduce(parts)


def _ring_forward(ring, q, k, v):
    """(o in q's dtype and layout, public lse, merge lse (B, Hq, nq), statistics)."""
    be, L, R, me = ring.backend, ring.layout, ring.R, ring.rank
    B, Hq, Hkv, D = ring.shapes
    Nq, Nk = ring.plan.Nq, ring.plan.Nk
    dev, acc_t = q.device, be.acc_dtype
    stats = _statistics(ring, k, v)
    acc = {i: (torch.zeros((B, Hq, b - a, D), dtype=acc_t, device=dev),
               torch.full((B, Hq, b - a), float("-inf"), dtype=acc_t, device=dev))
           for i, ((a, b), _) in ring.q_chunks.items()}
    shift = {}
    cur = (k.contiguous(), v.contiguous()) if R > 1 else (k, v)
    for t in range(R):
        s, works = (me - t) % R, []
        if t < R - 1:  # the next step's K/V travels while this step computes
            n = ring.nk((s - 1) % R)
            buf = tuple(torch.empty(_layout_shape(B, Hkv, n, D, L), dtype=k.dtype, device=dev) for _ in range(2))
            works = ring.post([(_TAG_K, cur[0]), (_TAG_V, cur[1])], [(_TAG_K, buf[0]), (_TAG_V, buf[1])])
        for i, j in ring.steps[t]:
            (qr, qo), (kr, ko) = ring.q_chunks[i], ring.k_chunks[s][j]
            o_p, l_p, sh = be.forward(_rows(q, qo, qo + qr[1] - qr[0], L), _rows(cur[0], ko, ko + kr[1] - kr[0], L),
                                      _rows(cur[1], ko, ko + kr[1] - kr[0], L), stats, qr, kr, Nq, Nk)
            acc[i] = be.merge(*acc[i], o_p, l_p)
            shift.setdefault(i, sh)
        for w in works:
            w.wait()
        if t < R - 1:
            cur = buf
    nq = q.shape[_seq_dim(L)]
    o = torch.empty(_layout_shape(B, Hq, nq, D, L), dtype=q.dtype, device=dev)
    lse = torch.full((B, Hq, nq), float("-inf"), dtype=acc_t, device=dev)
    lse_m = lse.clone()
    for i, ((a, b), off) in ring.q_chunks.items():
        o_acc, l_acc = acc[i]
        _hnd(o, L)[:, :, off:off + b - a] = o_acc.to(q.dtype)  # (the one rounding to the input dtype)
        lse_m[:, :, off:off + b - a] = l_acc
        if i in shift:  # (a chunk that saw no key keeps -inf)
            lse[:, :, off:off + b - a] = be.public_lse(l_acc, shift[i])
    return o, lse, lse_m, stats


def _ring_backward(ring, stats, q, k, v, o, lse_m, do):
    """(dq, dk, dv) of this rank's shards, in the inputs' dtypes and layout."""
    be, L, R, me = ring.backend, ring.layout, ring.R, ring.rank
    B, Hq, Hkv, D = ring.shapes
    Nq, Nk = ring.plan.Nq, ring.plan.Nk
    dev, acc_t = q.device, be.acc_dtype

    def zeros(n):
        return torch.zeros((B, Hkv, n, D), dtype=acc_t, device=dev)

    dq = {i: torch.zeros((B, Hq, b - a, D), dtype=acc_t, device=dev) for i, ((a, b), _) in ring.q_chunks.items()}
    cur = (k.contiguous(), v.contiguous()) if R > 1 else (k, v)
    done = None  # the dK/dV accumulators of the shard finished at the previous step
    for t in range(R):
        s = (me - t) % R
        sends, recvs = [], []
        if t < R - 1:  # prefetch the next step's K/V
            n = ring.nk((s - 1) % R)
            buf = tuple(torch.empty(_layout_shape(B, Hkv, n, D, L), dtype=k.dtype, device=dev) for _ in range(2))
            sends += [(_TAG_K, cur[0]), (_TAG_V, cur[1])]
            recvs += [(_TAG_K, buf[0]), (_TAG_V, buf[1])]
        if t > 0:  # pass on the accumulators finished at t - 1; receive those of the shard held now
            acc_in = (zeros(ring.nk(s)), zeros(ring.nk(s)))
            sends += [(_TAG_DK, done[0]), (_TAG_DV, done[1])]
            recvs += [(_TAG_DK, acc_in[0]), (_TAG_DV, acc_in[1])]
        works = ring.post(sends, recvs)
        shares = []
        for i, j in ring.steps[t]:
            (qr, qo), (kr, ko) = ring.q_chunks[i], ring.k_chunks[s][j]
            rq = (qo, qo + qr[1] - qr[0])
            g = be.backward(_rows(q, *rq, L), _rows(cur[0], ko, ko + kr[1] - kr[0], L),
                            _rows(cur[1], ko, ko + kr[1] - kr[0], L), stats, qr, kr, Nq, Nk,
                            _rows(do, *rq, L), _rows(o, *rq, L), lse_m[:, :, rq[0]:rq[1]])
            dq[i] += g[0]
            shares.append((ko, kr[1] - kr[0], g[1], g[2]))
        for w in works:
            w.wait()
        acc = (zeros(ring.nk(s)), zeros(ring.nk(s))) if t == 0 else acc_in
        for ko, n, dk_s, dv_s in shares:  # (in the pairs' order: ring_attention_backward's sums)
            acc[0][:, :, ko:ko + n] += dk_s
            acc[1][:, :, ko:ko + n] += dv_s
        done = acc
        if t < R - 1:
            cur = buf
    if R > 1:  # the accumulators sit one rank past their owner: the last hop
        home = (zeros(ring.nk(me)), zeros(ring.nk(me)))
        for w in ring.post([(_TAG_DK, done[0]), (_TAG_DV, done[1])], [(_TAG_DK, home[0]), (_TAG_DV, home[1])]):
            w.wait()
        done = home
    dq_out = torch.zeros_like(q, memory_format=torch.contiguous_format)
    for i, ((a, b), off) in ring.q_chunks.items():
        _hnd(dq_out, L)[:, :, off:off + b - a] = dq[i].to(q.dtype)
    dk_out, dv_out = (torch.empty(_layout_shape(B, Hkv, ring.nk(me), D, L), dtype=x.dtype, device=dev)
                      for x in (k, v))
    _hnd(dk_out, L).copy_(done[0].to(k.dtype))
    _hnd(dv_out, L).copy_(done[1].to(v.dtype))
    return dq_out, dk_out, dv_out


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, ring):
        with ring.backend.scope(q.device):
            o, lse, lse_m, stats = _ring_forward(ring, q, k, v)
        ctx.ring, ctx.stats = ring, stats
        ctx.save_for_backward(q, k, v, o, lse_m)
        ctx.mark_non_differentiable(lse)
        return o, lse

    @staticmethod
    def backward(ctx, do, _dlse):
        q, k, v, o, lse_m = ctx.saved_tensors
        with ctx.ring.backend.scope(do.device):
            dq, dk, dv = _ring_backward(ctx.ring, ctx.stats, q, k, v, o, lse_m, do)
        return dq, dk, dv, None


# --------------------------------------------------------------------------------------------------
# all2all (Ulysses)
# --------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class _Exchange:
    """The all_to_all between sequence shards of all H heads, (B, H, n_rank, D), and the whole sequence of this
    rank's H/R heads, (B, H/R, N, D) (HND; head group g goes to rank g)."""

    group: object
    R: int
    rank: int
    chunks: tuple  # the plan's chunks of this side, per rank

    def to_heads(self, x):
        B, H, n, D = x.shape
        h, lens = H // self.R, [_shard_len(c) for c in self.chunks]
        send = x.unflatten(1, (self.R, h)).movedim(1, 0).contiguous().reshape(-1)
        recv = x.new_empty(B * h * D * sum(lens))
        dist.all_to_all_single(recv, send, [B * h * m * D for m in lens], [B * h * n * D] * self.R,
                               group=self.group)
        blocks = recv.split([B * h * m * D for m in lens])
        pieces = sorted(((a, blocks[r].view(B, h, lens[r], D).narrow(2, off, b - a)) for r in range(self.R)
                         for _, (a, b), off in _with_offsets(self.chunks[r])), key=lambda t: t[0])
        return torch.cat([t for _, t in pieces], dim=2) if pieces else x.new_zeros((B, h, 0, D))

    def to_seq(self, y):
        B, h, _, D = y.shape
        n = _shard_len(self.chunks[self.rank])
        send = torch.cat([torch.cat([y[:, :, a:b] for a, b in c] + [y[:, :, :0]], dim=2).reshape(-1)
                          for c in self.chunks])  # (rank r's rows, (B, h, n_r, D) each)
        recv = y.new_empty(self.R * B * h * n * D)
        dist.all_to_all_single(recv, send, [B * h * n * D] * self.R,
                               [B * h * _shard_len(c) * D for c in self.chunks], group=self.group)
        return recv.view(self.R, B, h, n, D).movedim(0, 1).reshape(B, self.R * h, n, D)


class _AllToAll(torch.autograd.Function):
    """One direction of :class:`_Exchange`; its backward is the other direction (the exchange is a permutation
    of elements, so its adjoint is its inverse)."""

    @staticmethod
    def forward(ctx, x, ex, to_heads):
        ctx.ex, ctx.to_heads = ex, to_heads
        return ex.to_heads(x) if to_heads else ex.to_seq(x)

    @staticmethod
    def backward(ctx, g):
        g = g.contiguous()
        return (ctx.ex.to_seq(g) if ctx.to_heads else ctx.ex.to_heads(g)), None, None


def _all2all(group, R, rank, plan, be, q, k, v, layout):
    exq, exk = (_Exchange(group, R, rank, c) for c in (plan.q_chunks, plan.k_chunks))
    qf, kf, vf = (_AllToAll.apply(_hnd(x, layout), ex, True) for x, ex in ((q, exq), (k, exk), (v, exk)))
    with be.scope(q.device):
        o, lse = be.attention(qf, kf, vf)
    o = _hnd(_AllToAll.apply(o, exq, False), layout).contiguous()
    with torch.no_grad():
        lse = exq.to_seq(lse.unsqueeze(-1).contiguous()).squeeze(-1)
    return o, lse


# --------------------------------------------------------------------------------------------------
# the entry point
# --------------------------------------------------------------------------------------------------


def _check_tensors(q, k, v, layout, be):
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D ({layout}), got shape {tuple(t.shape)}")
        if t.dtype not in be.dtypes:
            raise TypeError(f"{name}.dtype={t.dtype} is not supported by the {type(be).__name__} backend; "
                            f"supported: {', '.join(str(d) for d in be.dtypes)}")
        if t.device.type != be.device_type:
            hint = " (backend='reference' runs the float64 reference on CPU tensors)" if be.device_type == "cuda" \
                else ""
            raise TypeError(f"{name} is a {t.device.type} tensor; the {type(be).__name__} backend takes "
                            f"{be.device_type} tensors{hint}")
        if t.dtype != q.dtype or t.device != q.device:
            raise TypeError(f"q and {name} must share one dtype and device, got {q.dtype} on {q.device} and "
                            f"{t.dtype} on {t.device}")
    (B, Hq, nq, D), (Bk, Hkv, nk, Dk) = _hnd(q, layout).shape, _hnd(k, layout).shape
    if tuple(v.shape) != tuple(k.shape):
        raise ValueError(f"v must have k's shape {tuple(k.shape)}, got {tuple(v.shape)}")
    if (Bk, Dk) != (B, D) or Hq % Hkv:
        raise ValueError(f"q (B, Hq, D) = {(B, Hq, D)} and k (B, Hkv, D) = {(Bk, Hkv, Dk)} must share B and D, with "
                         f"Hq a multiple of Hkv ({layout=})")
    return (B, Hq, Hkv, D), nq, nk


def _seq_lens(seq_lens):
    if (not isinstance(seq_lens, (tuple, list)) or len(seq_lens) != 2
            or any(isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < 1 for n in seq_lens)):
        raise ValueError(f"seq_lens={seq_lens!r} must be None or (Nq, Nk), the global lengths (positive ints)")
    return int(seq_lens[0]), int(seq_lens[1])


def _agree(group, device, nq, nk, meta):
    """All ranks' (nq, nk) after checking that they agree on ``meta`` (shapes and options): one all_gather."""
    rows = _gather_ints([nq, nk, *meta], group, device)
    names = ("B", "Hq", "Hkv", "D", "dtype", "layout", "causal", "window left", "window right", "mode")
    for r, row in enumerate(rows):
        for name, mine, theirs in zip(names, meta, row[2:]):
            if mine != theirs:
                raise ValueError(f"the ranks disagree on {name}: rank {r} has {theirs}, this rank {mine} (every rank "
                                 f"passes its shard of one call, with the same options)")
    return [row[:2] for row in rows]


def context_parallel_attention(q, k, v, group=None, *, causal=False, window=None, sm_scale=None, layout="HND",
                               config=None, plan="zigzag", mode="ring", backend=None, seq_lens=None,
                               return_lse=False):
    """Attention of one sequence spread over the ranks of ``group`` (module docstring), differentiable.

    Each rank passes its shard (:func:`shard_sequence`): ``q`` its query rows, ``k, v`` its keys, (B, H, n, D)
    (``layout="HND"``) or (B, n, H, D) (``"NHD"``); GQA (``Hq % Hkv == 0``). ``causal``, ``window``, ``sm_scale``
    and ``config`` are those of :func:`sagecupy.torch.sage_attention` over the *global* sequence (bottom-right
    aligned). ``plan``: ``"zigzag"``, ``"contiguous"`` or a ShardPlan for the group's size. ``mode``: ``"ring"`` or
    ``"all2all"``. ``backend``: None (INT8 kernels, CUDA tensors, one GPU per rank, NCCL) or a reference backend
    on CPU tensors (module docstring). ``seq_lens``: ``(Nq, Nk)``, the global lengths; None gathers every rank's
    shard lengths (one small all_gather, a host read) and checks that the ranks agree on shapes and options; given,
    each rank checks its own shard only (nothing is read back to the host). Returns ``o`` (this rank's rows, q's
    dtype and layout), with ``return_lse`` also ``lse`` (B, Hq, n), natural log, without gradient.
    Every rank must make the call (collectives); a ValueError raised after the length check is raised on all."""
    if mode not in _MODES:
        raise ValueError(f"mode={mode!r} must be 'ring' or 'all2all'")
    _check_layout(layout)
    _attn.resolve_window(causal, window)  # (TypeError naming causal, ValueError naming window)
    be = _backend(backend, causal=causal, window=window, sm_scale=sm_scale, layout=layout, config=config)
    shapes, nq, nk = _check_tensors(q, k, v, layout, be)
    R, rank = _group_info(group)
    if mode == "all2all" and (shapes[1] % R or shapes[2] % R):
        raise ValueError(f"mode='all2all' gives each rank Hq/R query heads and Hkv/R key/value heads: Hq={shapes[1]} "
                         f"and Hkv={shapes[2]} must divide by the group's {R} ranks (or use mode='ring')")
    if isinstance(plan, _ref.ShardPlan) and plan.ranks != R:
        raise ValueError(f"plan is for {plan.ranks} ranks but the process group has {R}")
    if seq_lens is None:
        w = window or (-2, -2)
        meta = [*shapes, be.dtypes.index(q.dtype), _LAYOUTS.index(layout), int(causal), *w, _MODES.index(mode)]
        lens = _agree(group, q.device, nq, nk, meta)
        Nq, Nk = sum(r[0] for r in lens), sum(r[1] for r in lens)
    else:
        (Nq, Nk), lens = _seq_lens(seq_lens), None
    p = _make_plan(plan, Nq, Nk, R, config)
    for r in ([rank] if lens is None else range(R)):
        got = (nq, nk) if lens is None else tuple(lens[r])
        want = (_shard_len(p.q_chunks[r]), _shard_len(p.k_chunks[r]))
        if got != want:
            raise ValueError(f"shard lengths: rank {r} passed {got[0]} query rows and {got[1]} keys; the {p.kind} "
                             f"plan of Nq={Nq}, Nk={Nk} over {R} ranks gives it {want[0]} and {want[1]} (shard the "
                             f"full tensors with shard_sequence)")
    if mode == "all2all":
        o, lse = _all2all(group, R, rank, p, be, q, k, v, layout)
    else:
        o, lse = _RingAttention.apply(q, k, v, _Ring(group, R, rank, p, be, layout, shapes))
    return (o, lse) if return_lse else o

