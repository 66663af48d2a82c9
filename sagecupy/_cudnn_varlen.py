"""cuDNN's bf16 attention on packed variable-length batches and sliding windows, forward and backward, as a baseline
beside sagecupy's INT8 kernels.

It runs through the cuDNN frontend's Python graph API (``nvidia-cudnn-frontend``: ``cudnn.pygraph``, ``graph.sdpa``
and ``graph.sdpa_backward``) on PyTorch tensors in the same process as the CuPy kernels, as :mod:`sagecupy._cudnn_fp8`
does for FP8 (whose plan building, import order and soft failures this module shares).

Layouts. Every buffer is ``(T, H, D)`` token-major storage (what FlashAttention's varlen API and sagecupy's
``layout="THD"`` take), declared to cuDNN as logical ``[B, H, S_max, D]`` dims with the strides of ``[B, S_max, H, D]``:

- packed (``packed=True``): B = the number of documents, ``S_max`` the longest; Q, K, V, O, dO, dQ, dK, dV carry a
  ragged offset each (``(B + 1, 1, 1, 1)`` int32, the element offset ``cu_seqlens * H * D`` of each document), and the
  padding mask with ``seq_len_q`` / ``seq_len_kv`` (``(B, 1, 1, 1)`` int32, the documents' lengths) bounds every
  document's rows and keys. The softmax stats are a plain ``[B, H, S_max, 1]`` float32 tensor (rows past a document's
  end unused), the form every cuDNN release with ragged attention takes.
- dense (``packed=False``): B sequences of one length, ``(B * N, H, D)`` storage, no ragged offsets or padding mask
  (the window cases).

Masks. cuDNN's diagonal band: ``diagonal_alignment=TOP_LEFT`` with ``diagonal_band_right_bound=0`` is causal, and
``diagonal_band_left_bound=lb`` keeps key ``j`` for row ``i`` iff ``j > i - lb``, so sagecupy's window ``(W, 0)``
(``i - W <= j <= i``, W + 1 keys) is ``lb = W + 1``. With the padding mask the band is applied within each document
(its own row and key indices). Top-left and bottom-right alignment agree where a document's query and key lengths are
equal, which is every case here; sagecupy's causal mask is bottom-right per sequence, so the two masks match. A
frontend without those arguments is tried with the older spellings (``use_causal_mask=True``,
``sliding_window_length=lb``: the same mask).

Everything fails softly: :func:`unavailable_reason` answers why this cannot run here (no torch, no CUDA device, no
frontend, no cuDNN library, a GPU older than Ampere, a frontend without ``sdpa_backward``) without raising, and a graph
the installed cuDNN does not support raises :class:`Unavailable` with cuDNN's messages.
"""
from __future__ import annotations

import math

from ._cudnn_fp8 import GraphPair, Unavailable, _modules, frontend_reason

__all__ = ["Unavailable", "unavailable_reason", "ragged_offsets", "thd_dims_strides", "mask_kwargs",
           "CudnnSdpa", "get", "clear"]


def unavailable_reason():
    """Why cuDNN's bf16 SDPA graphs cannot run in this process, or None when they may (a graph can still be
    unsupported for one shape or mask: that surfaces when it is built)."""
    # ragged (THD) offsets with the padding mask in the fused bf16 kernels: cuDNN 9
    return frontend_reason((8, 0), "cuDNN's fused attention needs Ampere (sm_80) or newer", ("sdpa", "sdpa_backward"),
                           90000, "9.0")


def ragged_offsets(lengths, H, D) -> list:
    """The ``B + 1`` element offsets of each document's first token in ``(T, H, D)`` storage: ``cu_seqlens * H * D``."""
    out, acc = [0], 0
    for n in lengths:
        acc += int(n)
        out.append(acc * int(H) * int(D))
    return out


def thd_dims_strides(B, H, S_max, D):
    """Logical ``[B, H, S_max, D]`` dims and the element strides of ``[B, S_max, H, D]`` storage (token-major)."""
    return (B, H, S_max, D), (S_max * H * D, D, H * D, 1)


def mask_kwargs(cudnn, window_left, style) -> dict:
    """The causal mask, with a left bound for window ``(window_left, 0)`` (None: none), as ``graph.sdpa`` and
    ``graph.sdpa_backward`` spell it: ``"band"`` (the diagonal band: top-left alignment, right bound 0, left bound
    ``window_left + 1``) or ``"flag"`` (``use_causal_mask`` and ``sliding_window_length``: the older spelling)."""
    if style == "band":
        kw = dict(diagonal_alignment=cudnn.diagonal_alignment.TOP_LEFT, diagonal_band_right_bound=0)
        if window_left is not None:
            kw["diagonal_band_left_bound"] = int(window_left) + 1
        return kw
    if style == "flag":
        kw = dict(use_causal_mask=True)
        if window_left is not None:
            kw["sliding_window_length"] = int(window_left) + 1
        return kw
    raise ValueError(f"mask style {style!r} is not 'band' or 'flag'")


class CudnnSdpa(GraphPair):
    """cuDNN's bf16 forward and backward graphs of one batch of causal sequences (their lengths, H, D, window), their
    buffers and one workspace.

    ``lengths``: the documents' token counts; ``packed=False`` needs them equal (a dense batch). ``window_left``:
    window ``(window_left, 0)``, None for plain causal. Inputs are standard normal (seed 0); buffers are allocated once
    and bound to the graphs, so repeated calls launch on the same pointers. The backward graph is built on first use.
    """

    def __init__(self, lengths, H, D, *, window_left=None, packed=True, dtype="bfloat16", attn_scale=None):
        why = unavailable_reason()
        if why is not None:
            raise Unavailable(why)
        torch, cudnn = _modules()
        self._open(torch, cudnn)
        self.lengths = [int(n) for n in lengths]
        if not self.lengths or min(self.lengths) < 1:
            raise ValueError(f"lengths must be positive token counts; got {lengths!r}")
        self.packed = bool(packed)
        if not self.packed and len(set(self.lengths)) != 1:
            raise ValueError("packed=False needs sequences of one length")
        self.H, self.D = int(H), int(D)
        self.B, self.T, self.S_max = len(self.lengths), sum(self.lengths), max(self.lengths)
        self.window_left = None if window_left is None else int(window_left)
        self.attn_scale = float(attn_scale) if attn_scale is not None else 1.0 / math.sqrt(self.D)
        self.dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
        self.io_type = {"bfloat16": cudnn.data_type.BFLOAT16, "float16": cudnn.data_type.HALF}[dtype]
        dev = self.device
        g = torch.Generator(device=dev).manual_seed(0)
        shape = (self.T, self.H, self.D)
        self.q, self.k, self.v, self.do = (torch.randn(shape, device=dev, dtype=self.dtype, generator=g)
                                           for _ in range(4))
        self.o, self.dq, self.dk, self.dv = (torch.empty(shape, device=dev, dtype=self.dtype) for _ in range(4))
        self.stats = torch.empty((self.B, self.H, self.S_max, 1), device=dev, dtype=torch.float32)
        self.offsets = torch.tensor(ragged_offsets(self.lengths, self.H, self.D), device=dev,
                                    dtype=torch.int32).view(-1, 1, 1, 1)
        self.seq_len = torch.tensor(self.lengths, device=dev, dtype=torch.int32).view(-1, 1, 1, 1)
        self._start()

    # -- graphs -------------------------------------------------------------------------------------------------
    def _graph(self, kind, style):
        cudnn = self.cudnn
        dims, strides = thd_dims_strides(self.B, self.H, self.S_max, self.D)
        i32, f32 = cudnn.data_type.INT32, cudnn.data_type.FLOAT
        g = cudnn.pygraph(io_data_type=self.io_type, intermediate_data_type=f32, compute_data_type=f32,
                          handle=self.handle)
        pack = {}
        col = (self.B, 1, 1, 1)

        def ragged(x, name, buf):
            """Declare ``x``'s storage ragged: its own offsets tensor, bound to the shared offsets buffer."""
            if self.packed:
                off = g.tensor(name=f"{name}_offsets", dim=(self.B + 1, 1, 1, 1), stride=(1, 1, 1, 1),
                               data_type=i32)
                x.set_ragged_offset(off)
                pack[off] = self.offsets
            pack[x] = buf
            return x

        def t(name, buf):
            return ragged(g.tensor(name=name, dim=dims, stride=strides, data_type=self.io_type), name, buf)

        def out(x, name, buf):
            x.set_output(True).set_dim(dims).set_stride(strides).set_data_type(self.io_type)
            x.set_name(name)
            return ragged(x, name, buf)

        q, k, v = t("q", self.q), t("k", self.k), t("v", self.v)
        opts = dict(attn_scale=self.attn_scale, **mask_kwargs(cudnn, self.window_left, style))
        if self.packed:
            sq = g.tensor(name="seq_len_q", dim=col, stride=(1, 1, 1, 1), data_type=i32)
            skv = g.tensor(name="seq_len_kv", dim=col, stride=(1, 1, 1, 1), data_type=i32)
            pack[sq] = pack[skv] = self.seq_len
            opts.update(use_padding_mask=True, seq_len_q=sq, seq_len_kv=skv)
        stats_dim = (self.B, self.H, self.S_max, 1)
        stats_stride = (self.H * self.S_max, self.S_max, 1, 1)
        if kind == "fwd":
            o, stats = g.sdpa(name="sdpa", q=q, k=k, v=v, generate_stats=True, **opts)
            out(o, "o", self.o)
            stats.set_output(True).set_dim(stats_dim).set_stride(stats_stride).set_data_type(f32)
            pack[stats] = self.stats
            return g, pack
        o, do = t("o", self.o), t("dO", self.do)
        stats = g.tensor(name="stats", dim=stats_dim, stride=stats_stride, data_type=f32)
        pack[stats] = self.stats
        if self.packed:
            # bounds the backward's workspace by the packed token count instead of B * S_max
            opts.update(max_total_seq_len_q=self.T, max_total_seq_len_kv=self.T)
        dq, dk, dv = g.sdpa_backward(name="sdpa_backward", q=q, k=k, v=v, o=o, dO=do, stats=stats, **opts)
        out(dq, "dQ", self.dq)
        out(dk, "dK", self.dk)
        out(dv, "dV", self.dv)
        return g, pack

    label = "bf16"

    def _styles(self):
        return ["band", "flag"]

    def _describe(self):
        return (f"{'packed' if self.packed else 'dense'} B={self.B} T={self.T} S_max={self.S_max} H={self.H} "
                f"D={self.D} causal" + (f" window=({self.window_left}, 0)" if self.window_left is not None else ""))

    # -- calls -------------------------------------------------------------------------------------------------
    def forward(self):
        """O and the softmax stats of the bound Q, K, V (the training forward)."""
        self._execute(self._fwd, self._fwd_pack)

    def backward(self):
        """dQ, dK, dV from the bound Q, K, V, O, dO and stats (run :meth:`forward` first)."""
        self._ensure_backward()
        self._execute(self._bwd, self._bwd_pack)

    def outputs(self):
        """(o, dq, dk, dv), ``(T, H, D)`` tensors of the last calls."""
        return self.o, self.dq, self.dk, self.dv


_CACHE = {}


def get(lengths, H, D, *, window_left=None, packed=True, dtype="bfloat16") -> CudnnSdpa:
    """The cached :class:`CudnnSdpa` of these lengths, heads, head dim, window and layout on the current device."""
    torch, _ = _modules()
    key = (tuple(int(n) for n in lengths), int(H), int(D), window_left, bool(packed), dtype,
           torch.cuda.current_device())
    att = _CACHE.get(key)
    if att is None:
        att = _CACHE[key] = CudnnSdpa(lengths, H, D, window_left=window_left, packed=packed, dtype=dtype)
    return att


def clear():
    """Drop the cached graphs and their buffers, and destroy their cuDNN handles."""
    for att in _CACHE.values():
        att.close()
    _CACHE.clear()
