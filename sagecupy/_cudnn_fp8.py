"""cuDNN's FP8 (E4M3) attention, forward and backward, as a baseline beside sagecupy's kernels.

It runs through the cuDNN frontend's Python graph API (``nvidia-cudnn-frontend``: ``cudnn.pygraph``,
``graph.sdpa_fp8`` and ``graph.sdpa_fp8_backward``) on PyTorch tensors in the same process as the CuPy kernels.
Hopper's FP8 attention takes E4M3 Q, K, V (and O, dO for the backward) with one FP32 scale per tensor and writes
E4M3 O, dQ, dK, dV; half-precision outputs of the FP8 path exist on Blackwell only.

Layout: the graphs declare logical ``[B, H, N, D]`` dims with the strides of ``[B, N, H, D]`` storage (what a QKV
projection writes, and what the frontend's FP8 attention tests declare); every buffer here is allocated that way and
viewed as ``[B, H, N, D]``.

Scales (per tensor, amax-derived as the frontend's FP8 tests do; ``descale = 1 / scale``):

- Q, K, V, dO: :func:`pow2_scale` of the input's amax, ``2 ** (6 - ceil(log2(amax)))``, so ``amax * scale`` lies in
  (32, 64]: a power of two (scaling is exact) with 7x headroom under E4M3's 448. In the end-to-end path the amax pass
  and the scaling run on the device on every call (:meth:`CudnnFp8Attention.forward_from`).
- O, dQ, dK, dV, dP: the same rule applied to the amax cuDNN reports (it measures them in FP32 before quantizing) in a
  calibration pass with that scale at 1 (:meth:`CudnnFp8Attention.calibrate`); they then stay fixed, as in delayed
  scaling. dP is calibrated before dQ and dK, whose inputs it quantizes (at scale 1, dP's small values flush to 0).
- P (cuDNN's "S", the softmax probabilities, at most 1): the bound the frontend documents instead of an amax,
  ``scale_s = 448`` for E4M3 without dropout (it deprecates the Amax_S output, which on Hopper reports the largest
  normalized probability, e.g. 0.12 for a full 1K-key row, not a bound on what is quantized).

Plans: only cuDNN's native engines are built (:func:`_build_native`). The frontend can also rank Python engines
of its own, which need packages (the CuTe DSL, cuda-python) a plain install of the wheel lacks; a plan list of
those alone is reported as unavailable rather than imported.

Everything fails softly: :func:`unavailable_reason` answers why the baseline cannot run here (no torch, no CUDA
device, no frontend, no cuDNN library, a GPU older than Hopper) without raising, and a graph the installed cuDNN
does not support raises :class:`Unavailable` with cuDNN's message.
"""
from __future__ import annotations

import logging
import math

__all__ = ["Unavailable", "unavailable_reason", "pow2_scale", "bnhd_strides", "GraphPair", "CudnnFp8Attention", "get", "clear",
           "cudnn_fp8_attention", "E4M3_MAX"]

#: Largest finite E4M3 value.
E4M3_MAX = 448.0
#: ``amax * scale`` is brought into (2 ** (TARGET_EXP - 1), 2 ** TARGET_EXP] = (32, 64].
TARGET_EXP = 6


class Unavailable(RuntimeError):
    """cuDNN's FP8 attention cannot run here; the message says why."""


def pow2_scale(amax) -> float:
    """``2 ** (6 - ceil(log2(amax)))``: the power of two that brings ``amax`` into (32, 64]; 1.0 for an amax that is
    0, negative or not finite (nothing to scale). ``frexp`` keeps ``ceil(log2(.))`` exact at powers of two."""
    amax = float(amax)
    if not (amax > 0.0 and math.isfinite(amax)):
        return 1.0
    m, e = math.frexp(amax)  # amax = m * 2**e, 0.5 <= m < 1
    ceil_log2 = e - 1 if m == 0.5 else e
    return math.ldexp(1.0, TARGET_EXP - ceil_log2)


def bnhd_strides(B, H, N, D):
    """Element strides of logical ``[B, H, N, D]`` dims over ``[B, N, H, D]`` storage."""
    return (N * H * D, D, H * D, 1)


def _modules():
    """(torch, cudnn), or :class:`Unavailable` with the reason. torch first: the frontend then binds the cuDNN
    library torch has already loaded (same path) instead of searching for one."""
    try:
        import torch
    except Exception as exc:  # ImportError or a broken install
        raise Unavailable(f"PyTorch is not importable ({type(exc).__name__}: {exc})") from None
    try:
        import cudnn
    except Exception as exc:
        raise Unavailable(f"the cuDNN frontend (nvidia-cudnn-frontend) is not importable "
                          f"({type(exc).__name__}: {exc})") from None
    log = logging.getLogger("cudnn")
    if not log.handlers:
        # The frontend logs a declined graph as a warning; that reason reaches the caller in Unavailable already, so
        # without a handler of the caller's own it is not printed a second time.
        log.addHandler(logging.NullHandler())
    return torch, cudnn


def frontend_reason(min_cc, needs, ops, min_backend, too_old, check_torch=None):
    """Why a cuDNN frontend graph family cannot run in this process, or None: PyTorch with a CUDA device of compute
    capability ``min_cc`` or newer (``needs``: what to call the requirement), ``check_torch(torch)`` (a reason or
    None), the frontend's graph API with the ``pygraph`` methods ``ops``, and a cuDNN library of version
    ``min_backend`` or newer (``too_old``: the sentence's end, e.g. "9.0")."""
    try:
        torch, cudnn = _modules()
    except Unavailable as exc:
        return str(exc)
    try:
        if not torch.cuda.is_available():
            return "no CUDA device visible to PyTorch"
        cc = torch.cuda.get_device_capability()
    except Exception as exc:
        return f"CUDA is not usable from PyTorch ({type(exc).__name__}: {exc})"
    if tuple(cc) < min_cc:
        return f"{needs}; this GPU is sm_{cc[0]}{cc[1]}"
    why = check_torch(torch) if check_torch else None
    if why:
        return why
    version = getattr(cudnn, "__version__", "?")
    for name in ("pygraph", "data_type", "heur_mode", "create_handle"):
        if not hasattr(cudnn, name):
            return f"cuDNN frontend {version} has no cudnn.{name}"
    for name in ops:
        if not hasattr(cudnn.pygraph, name):
            return f"cuDNN frontend {version} has no pygraph.{name}"
    try:
        backend = cudnn.backend_version()
    except Exception as exc:  # the frontend found no cuDNN library to bind
        return f"the cuDNN frontend has no cuDNN library ({type(exc).__name__}: {exc})"
    if backend < min_backend:
        return f"cuDNN {backend} is older than {too_old}"
    return None


def unavailable_reason():
    """Why cuDNN's FP8 attention cannot run in this process, or None when it may (a graph can still be unsupported
    for one shape: that surfaces when it is built)."""
    return frontend_reason(
        (9, 0), "FP8 attention needs Hopper (sm_90) or newer", ("sdpa_fp8", "sdpa_fp8_backward"),
        90100, "9.1, the first with FP8 attention",  # FP8 attention's first release
        lambda torch: None if hasattr(torch, "float8_e4m3fn") else
        f"PyTorch {torch.__version__} has no float8_e4m3fn dtype")


def _mask_kwargs(cudnn, causal, style):
    """The causal mask as the frontend spells it: ``diagonal_alignment`` top-left with right bound 0 (the spelling
    its FP8 graphs prefer), or the older ``use_causal_mask`` flag (same mask)."""
    if not causal:
        return {}
    if style == "band":
        return dict(diagonal_alignment=cudnn.diagonal_alignment.TOP_LEFT, right_bound=0)
    return dict(use_causal_mask=True)


def _build_native(graph, cudnn):
    """Validate and plan ``graph``, then build the first plan of cuDNN's own engines (the frontend's Python engines
    are skipped); returns the plan's name."""
    graph.validate()
    graph.build_operation_graph()
    graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    try:
        from cudnn.engines.engine_ids import is_python_engine
        plans = list(graph.plans)
    except (ImportError, AttributeError):  # a frontend that ranks cuDNN's engines only
        graph.check_support()
        graph.build_plans()
        return "cudnn"
    failures = []
    for i, cfg in enumerate(plans):
        if is_python_engine(cfg.engine_id):
            continue
        try:
            graph.build_plan_at_index(i)
        except Exception as exc:  # this plan declined: try the next one
            failures.append(f"[{i}] {type(exc).__name__}: {exc}")
            continue
        try:
            return graph.get_plan_name_at_index(i)
        except Exception:
            return f"plan {i}"
    n_python = sum(1 for cfg in plans if is_python_engine(cfg.engine_id))
    raise Unavailable("no native cuDNN plan could be built"
                      + (f" ({n_python} of the frontend's Python-engine plans skipped)" if n_python else "")
                      + (": " + "; ".join(failures) if failures else ""))


class GraphPair:
    """A forward graph built at once and a backward graph built on first use, on one cuDNN handle and one workspace
    (also the base of :class:`sagecupy._cudnn_varlen.CudnnSdpa`). A subclass calls :meth:`_open` first, allocates and
    binds its buffers, then calls :meth:`_start`; it gives ``_graph(kind, style)`` -> ``(graph, pack)``,
    ``_styles()`` (the mask spellings to try when none is known yet) and ``_describe()`` (the shape, for errors), and
    names its precision in ``label``."""

    label = ""

    def _open(self, torch, cudnn):
        self.torch, self.cudnn = torch, cudnn
        self.device = torch.device("cuda", torch.cuda.current_device())
        self.handle = cudnn.create_handle()
        if getattr(self.handle, "_ordinal", 0) is None:
            # The frontend asks cuda-python for the device when it was not told; say it, so that package is not needed.
            self.handle._ordinal = self.device.index

    def close(self):
        """Destroy the cuDNN handle (once; the graphs and buffers go with the object). Explicit rather than in
        ``__del__``, which could run at interpreter exit after the library is gone."""
        handle, self.handle = getattr(self, "handle", None), None
        self._fwd = self._bwd = self._fwd_pack = self._bwd_pack = None  # (the graphs before the handle they use)
        destroy = getattr(self.cudnn, "destroy_handle", None)
        if handle is not None and destroy is not None:
            destroy(handle)

    def _start(self):
        self.mask_style = None
        self.fwd_plan = self.bwd_plan = None
        self._fwd, self._fwd_pack = self._build("fwd")
        self._bwd = self._bwd_pack = None
        self.workspace = None
        self._grow_workspace(self._fwd)

    def _build(self, kind):
        """Build ``kind``'s graph with the mask spelling that works (the first that does is kept for the other
        graph); :class:`Unavailable` with cuDNN's messages when none does."""
        styles = [self.mask_style] if self.mask_style else self._styles()
        errors = []
        for style in styles:
            try:
                g, pack = self._graph(kind, style)
                name = _build_native(g, self.cudnn)
            except Exception as exc:
                msg = f"{type(exc).__name__}: {exc}"
                if msg not in errors:
                    errors.append(msg)
                continue
            self.mask_style = style
            if kind == "fwd":
                self.fwd_plan = name
            else:
                self.bwd_plan = name
            return g, pack
        raise Unavailable(f"cuDNN {self.label} {'forward' if kind == 'fwd' else 'backward'} graph not supported for "
                          f"{self._describe()}: " + " | ".join(e[:400] for e in errors))

    def _grow_workspace(self, graph):
        need = int(graph.get_workspace_size())
        if self.workspace is None or self.workspace.numel() < need:
            self.workspace = self.torch.empty(max(need, 1), device=self.device, dtype=self.torch.uint8)

    def _ensure_backward(self):
        if self._bwd is None:
            self._bwd, self._bwd_pack = self._build("bwd")
            self._grow_workspace(self._bwd)

    def _execute(self, graph, pack):
        # The handle launches on its stream: follow PyTorch's current one, where the caller times and synchronizes.
        self.cudnn.set_stream(self.handle, self.torch.cuda.current_stream(self.device).cuda_stream)
        graph.execute(pack, self.workspace, handle=self.handle)


class CudnnFp8Attention(GraphPair):
    """The FP8 forward and backward graphs of one shape, their FP8 buffers, scales and one workspace.

    Buffers are allocated once and bound to the graphs, so repeated calls launch on the same pointers. The backward
    graph is built on first use, so a forward-only caller never pays for it (nor fails on it).
    """

    def __init__(self, B, H, N, D, causal, *, attn_scale=None):
        why = unavailable_reason()
        if why is not None:
            raise Unavailable(why)
        torch, cudnn = _modules()
        self._open(torch, cudnn)
        self.B, self.H, self.N, self.D, self.causal = int(B), int(H), int(N), int(D), bool(causal)
        self.attn_scale = float(attn_scale) if attn_scale is not None else 1.0 / math.sqrt(D)
        dev, f8 = self.device, torch.float8_e4m3fn

        def fp8():
            return torch.empty((B, N, H, D), device=dev, dtype=f8).permute(0, 2, 1, 3)

        def scalar(value):
            return torch.full((1, 1, 1, 1), float(value), device=dev, dtype=torch.float32)

        self.q8, self.k8, self.v8, self.o8, self.do8 = fp8(), fp8(), fp8(), fp8(), fp8()
        self.dq8, self.dk8, self.dv8 = fp8(), fp8(), fp8()
        self.stats = torch.empty((B, H, N, 1), device=dev, dtype=torch.float32)
        # Scale buffers the graphs read on the device at every execute: changing a value needs no rebuild.
        self.s = {n: scalar(1.0) for n in ("descale_q", "descale_k", "descale_v", "descale_s", "scale_s", "scale_o",
                                           "descale_o", "descale_dO", "descale_dP", "scale_dQ", "scale_dK",
                                           "scale_dV", "scale_dP")}
        self.amax = {n: scalar(0.0) for n in ("S", "O", "dQ", "dK", "dV", "dP")}
        self._start()
        self._set_scale("s", E4M3_MAX)  # P <= 1: the frontend's documented bound for E4M3 without dropout
        self.calibrated_fwd = self.calibrated_bwd = False

    # -- graphs -------------------------------------------------------------------------------------------------
    def _graph(self, kind, style):
        cudnn = self.cudnn
        B, H, N, D = self.B, self.H, self.N, self.D
        dims, strides = (B, H, N, D), bnhd_strides(B, H, N, D)
        e4m3, f32 = cudnn.data_type.FP8_E4M3, cudnn.data_type.FLOAT
        g = cudnn.pygraph(io_data_type=e4m3, intermediate_data_type=f32, compute_data_type=f32, handle=self.handle)

        def t(name):
            return g.tensor(name=name, dim=dims, stride=strides, data_type=e4m3)

        def sc(name):
            return g.tensor(name=name, dim=(1, 1, 1, 1), stride=(1, 1, 1, 1), data_type=f32)

        def out(x, dim, stride, dtype):
            x.set_output(True).set_dim(dim).set_stride(stride).set_data_type(dtype)

        q, k, v = t("q"), t("k"), t("v")
        scales = {n: sc(n) for n in self.s}
        stats_dim, stats_stride = (B, H, N, 1), (H * N, N, 1, 1)
        one, one_st = (1, 1, 1, 1), (1, 1, 1, 1)
        mask = _mask_kwargs(cudnn, self.causal, style)
        if kind == "fwd":
            o, stats, amax_s, amax_o = g.sdpa_fp8(
                q=q, k=k, v=v, descale_q=scales["descale_q"], descale_k=scales["descale_k"],
                descale_v=scales["descale_v"], descale_s=scales["descale_s"], scale_s=scales["scale_s"],
                scale_o=scales["scale_o"], generate_stats=True, attn_scale=self.attn_scale, **mask)
            out(o, dims, strides, e4m3)
            out(stats, stats_dim, stats_stride, f32)
            # Amax_S as an output keeps the graph on cuDNN's own engines (those are the ones timed) and reports P's
            # amax; Amax_O calibrates O's scale.
            out(amax_s, one, one_st, f32)
            out(amax_o, one, one_st, f32)
            pack = {q: self.q8, k: self.k8, v: self.v8, o: self.o8, stats: self.stats,
                    amax_s: self.amax["S"], amax_o: self.amax["O"]}
            for n in ("descale_q", "descale_k", "descale_v", "descale_s", "scale_s", "scale_o"):
                pack[scales[n]] = self.s[n]
            return g, pack
        o, do = t("o"), t("dO")
        stats = g.tensor(name="stats", dim=stats_dim, stride=stats_stride, data_type=f32)
        dq, dk, dv, amax_dq, amax_dk, amax_dv, amax_dp = g.sdpa_fp8_backward(
            q=q, k=k, v=v, o=o, dO=do, stats=stats, descale_q=scales["descale_q"], descale_k=scales["descale_k"],
            descale_v=scales["descale_v"], descale_o=scales["descale_o"], descale_dO=scales["descale_dO"],
            descale_s=scales["descale_s"], descale_dP=scales["descale_dP"], scale_s=scales["scale_s"],
            scale_dQ=scales["scale_dQ"], scale_dK=scales["scale_dK"], scale_dV=scales["scale_dV"],
            scale_dP=scales["scale_dP"], attn_scale=self.attn_scale, **mask)
        for x in (dq, dk, dv):
            out(x, dims, strides, e4m3)
        for x in (amax_dq, amax_dk, amax_dv, amax_dp):
            out(x, one, one_st, f32)
        pack = {q: self.q8, k: self.k8, v: self.v8, o: self.o8, do: self.do8, stats: self.stats,
                dq: self.dq8, dk: self.dk8, dv: self.dv8, amax_dq: self.amax["dQ"], amax_dk: self.amax["dK"],
                amax_dv: self.amax["dV"], amax_dp: self.amax["dP"]}
        for n in ("descale_q", "descale_k", "descale_v", "descale_o", "descale_dO", "descale_s", "descale_dP",
                  "scale_s", "scale_dQ", "scale_dK", "scale_dV", "scale_dP"):
            pack[scales[n]] = self.s[n]
        return g, pack

    label = "FP8"

    def _styles(self):
        return ["band", "flag"] if self.causal else ["band"]

    def _describe(self):
        return f"B={self.B} H={self.H} N={self.N} D={self.D} causal={self.causal}"

    # -- scales ------------------------------------------------------------------------------------------------
    def _set_scale(self, name, scale):
        """``scale_<name>`` = scale and ``descale_<name>`` = 1 / scale, in the buffers that exist for ``name``."""
        if f"scale_{name}" in self.s:
            self.s[f"scale_{name}"].fill_(float(scale))
        if f"descale_{name}" in self.s:
            self.s[f"descale_{name}"].fill_(1.0 / float(scale))

    def _quantize(self, x, out8, descale):
        """``out8 = E4M3(x * scale)`` and ``descale = 1 / scale`` with ``scale = 2 ** (6 - ceil(log2(amax(x))))``,
        all on the device (no host synchronization): the amax pass and the cast an FP8 caller pays per call."""
        torch = self.torch
        amax = torch.linalg.vector_norm(x, float("inf")).float()
        scale = torch.exp2(float(TARGET_EXP) - torch.ceil(torch.log2(amax.clamp_min(2.0 ** -100))))
        out8.copy_(x * scale)  # a power of two: exact in x's dtype; one rounding, to E4M3
        torch.reciprocal(scale, out=descale.view(()))

    def _quantize_inputs(self, q, k, v):
        self._quantize(q, self.q8, self.s["descale_q"])
        self._quantize(k, self.k8, self.s["descale_k"])
        self._quantize(v, self.v8, self.s["descale_v"])

    # -- calls -------------------------------------------------------------------------------------------------
    def forward(self):
        """The FP8 forward on the FP8 buffers (Q, K, V as cuDNN receives them): O (E4M3) and the softmax stats."""
        self._execute(self._fwd, self._fwd_pack)

    def forward_from(self, q, k, v):
        """Amax and E4M3 casts of ``q, k, v`` (``[B, H, N, D]``, any float dtype and strides), then the forward."""
        self._quantize_inputs(q, k, v)
        self.forward()

    def backward(self):
        """The FP8 backward on the FP8 buffers (Q, K, V, O, dO): dQ, dK, dV (E4M3)."""
        self._ensure_backward()
        self._execute(self._bwd, self._bwd_pack)

    def backward_from(self, do):
        """Amax and E4M3 cast of ``do``, then the backward."""
        self._ensure_backward()
        self._quantize(do, self.do8, self.s["descale_dO"])
        self.backward()

    def calibrate(self, q, k, v, do=None):
        """Set the output scales from the amax cuDNN measures (synchronizes): O from a forward at scale_o = 1; with
        ``do``, dP from a backward at scale_dP = 1, then dQ, dK, dV from one at the calibrated dP scale. Leaves the
        buffers holding the calibrated forward (and backward) of these inputs."""
        torch = self.torch
        self._quantize_inputs(q, k, v)
        self._set_scale("o", 1.0)
        self.forward()
        torch.cuda.synchronize(self.device)
        amax_o = float(self.amax["O"].item())
        self._set_scale("o", pow2_scale(amax_o))
        self.forward()
        self.calibrated_fwd = True
        if do is None:
            return
        self._ensure_backward()
        self._quantize(do, self.do8, self.s["descale_dO"])
        for name in ("dP", "dQ", "dK", "dV"):
            self._set_scale(name, 1.0)
        self.backward()
        torch.cuda.synchronize(self.device)
        self._set_scale("dP", pow2_scale(self.amax["dP"].item()))
        self.backward()
        torch.cuda.synchronize(self.device)
        for name in ("dQ", "dK", "dV"):
            self._set_scale(name, pow2_scale(self.amax[name].item()))
        self.backward()
        self.calibrated_bwd = True

    def scales(self) -> dict:
        """Host copies of every scale and descale in use (synchronizes)."""
        return {n: float(t.item()) for n, t in self.s.items()}

    def dequantized(self, grads=True):
        """(o, dq, dk, dv) from the FP8 buffers as float32 ``[B, H, N, D]`` contiguous tensors (descaled); the
        gradients are None with ``grads=False``."""
        o = (self.o8.float() * self.s["descale_o"].view(())).contiguous()
        if not grads:
            return o, None, None, None
        g = [(x.float() / self.s[f"scale_{n}"].view(())).contiguous()
             for x, n in ((self.dq8, "dQ"), (self.dk8, "dK"), (self.dv8, "dV"))]
        return (o, *g)


_CACHE = {}


def get(B, H, N, D, causal, *, attn_scale=None) -> CudnnFp8Attention:
    """The cached :class:`CudnnFp8Attention` of this shape on the current device (graphs are built once)."""
    torch, _ = _modules()
    key = (int(B), int(H), int(N), int(D), bool(causal), attn_scale, torch.cuda.current_device())
    att = _CACHE.get(key)
    if att is None:
        att = _CACHE[key] = CudnnFp8Attention(B, H, N, D, causal, attn_scale=attn_scale)
    return att


def clear():
    """Drop the cached graphs and their buffers, and destroy their cuDNN handles."""
    for att in _CACHE.values():
        att.close()
    _CACHE.clear()


def _as_torch(x, torch):
    if isinstance(x, torch.Tensor):
        return x if x.is_cuda else x.cuda()
    from .adapters import bf16

    if bf16.is_bf16(x):  # a CuPy bfloat16 array or a BF16Array: its values as float32 (exact)
        x = bf16.to_float32(x)
    return torch.as_tensor(x, device="cuda")


def cudnn_fp8_attention(q, k, v, do=None, causal=False, *, sm_scale=None):
    """cuDNN's FP8 attention forward and backward of ``q, k, v`` (``[B, H, N, D]``, one head count, Nq == Nk) and
    output gradient ``do``, with the amax-derived scales of this module (calibrated on these inputs).

    Inputs: torch tensors, or arrays ``torch.as_tensor`` takes (CuPy, NumPy; bfloat16 CuPy arrays and sagecupy's
    BF16Array through their float32 values), in any float dtype. Returns ``(o, dq, dk, dv)`` as float32
    ``[B, H, N, D]`` torch tensors, dequantized from cuDNN's E4M3 outputs; with ``do=None`` the forward alone
    (``dq, dk, dv`` None: on Hopper cuDNN has an FP8 forward at D = 64 but its FP8 backward needs D = 128). Raises
    :class:`Unavailable` where cuDNN's FP8 attention cannot run (that shape included).
    """
    why = unavailable_reason()
    if why is not None:
        raise Unavailable(why)
    torch, _ = _modules()
    xs = [_as_torch(x, torch) for x in ((q, k, v) if do is None else (q, k, v, do))]
    if xs[0].dim() != 4 or any(x.shape != xs[0].shape for x in xs):
        raise ValueError("q, k, v, do must share one [B, H, N, D] shape; got "
                         + ", ".join(str(tuple(x.shape)) for x in xs))
    if not all(x.is_floating_point() for x in xs):
        raise ValueError(f"inputs must be floating-point tensors; got {', '.join(str(x.dtype) for x in xs)}")
    # float64 inputs are rounded once to float32 before the E4M3 cast (a power-of-two scale is exact in both)
    xs = [x.float() if x.dtype == torch.float64 else x for x in xs]
    B, H, N, D = xs[0].shape
    att = get(B, H, N, D, causal, attn_scale=sm_scale)
    att.calibrate(*xs)
    torch.cuda.synchronize()
    return att.dequantized(grads=do is not None)
