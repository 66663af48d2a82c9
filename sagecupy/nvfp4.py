"""NVFP4 on the GPU (docs/algorithms.md §5): quantization into the exchange format and the attention forward.

* :func:`attention` -- SageAttention3-style NVFP4 attention forward (quantize Q, K - mu_K, V, then the
  fused kernel); :func:`attention_packed` -- the same kernel on operands already in the exchange format
  (a quantized KV cache); :func:`quantize_inputs` and friends -- the quantization pre-passes.
* On Hopper there are no FP4 tensor cores: the kernel keeps Q, K, V packed in device memory, dequantizes
  each 16-block to fp16 (exact, docs/algorithms.md §5.7) and multiplies on fp16 tensor cores with fp32
  accumulation. P is quantized to NVFP4 in registers (two-level by default) and dequantized the same way.

Exchange format (what DLPack can carry): packed ``uint8`` E2M1 codes, two per byte, element ``2i`` in
the low nibble, and ``uint8`` E4M3 scales, one per 16 elements along the contraction axis:

* Q and K: blocks along D -> codes ``(B, H, N, D/2)``, scales ``(B, H, N, D/16)``;
* V: blocks of 16 tokens (V transposed) -> codes ``(B, H, D, N16/2)``, scales ``(B, H, D, N16/16)``
  with ``N16`` = N rounded up to a multiple of 16 (zero tokens).

Bit-exact with :mod:`sagecupy.reference.fp4` (every code and scale byte), including ties, saturation,
subnormal scales, zero blocks (scale 0, codes +0) and blocks holding NaN/Inf (scale 0x7F, NaN).

The forward's kernels, per engine (:func:`fp4_engine`) and head dim: mma.sync ``nvfp4_attn_fwd`` (8 warps); wgmma
at D=64 ``nvfp4_attn_fwd_sm90`` (4 warps); wgmma at D=128 the warp-specialized ``nvfp4_attn_fwd_ws_img`` (one
producer warpgroup, :data:`WS_CONSUMERS` consumer warpgroups) on K/V stage images (:func:`ws_img_bytes`), with
the tail split (:func:`_tail_split`) on calls in the plain dispatch order with two-level P. The variants measured no
better
(other CTA sizes, two consumers, a persistent kernel, Q quantized in the kernel, a producer that dequantizes every
tile, fused or pipelined pre-passes) are gone from the tree (git history keeps them; docs/experiments.md records
their numbers).

``window=(left, right)`` (docs/algorithms.md §1.8; -1: unbounded): row ``i`` sees key ``j`` iff
``i + Nk - Nq - left <= j <= i + Nk - Nq + right``; ``causal=True`` is ``window=(-1, 0)``. The kernels visit only the
64-key tiles inside the window (:func:`kernel_window`: the two ints they take); K's smoothing mean and V's 16-token
blocks stay those of all the keys, as in the simulator (``sagecupy.reference.nvfp4.forward``). A row that sees no
key gives ``O = 0`` and ``LSE = -inf``.
"""
from __future__ import annotations

import functools

from . import _checks, _layout
from ._loader import device_capability, get_function
from ._program import Plan, Plans, Program, Ref, env_key, scale_key, signature
from .config import NVFP4Config

__all__ = ["attention", "attention_packed", "forward", "is_supported", "quantize_rows", "quantize_tokens", "quantize_inputs",
           "kernel_names", "fp4_engine"]

_T = {"float16": "__half", "bfloat16": "__nv_bfloat16"}
LOG2E = 1.4426950408889634
_BKV = 64

#: Warps per CTA of the mma.sync FP4 forwards (NVFP4 and QAT): K/V tiles dequantized once per 128 query rows,
#: 17% faster than 4 warps on the H200 (docs/experiments.md).
MMA_WARPS = 8
#: Warps per CTA of the wgmma NVFP4 forward at D=64 (within a few percent of 8 and 12 there; docs/experiments.md).
WGMMA_D64_WARPS = 4
#: Consumer warpgroups (64 query rows each) of the warp-specialized wgmma NVFP4 forward at D=128: 1.04-1.08x the
#: 12-warp kernel it replaced, two consumers 0.99-1.04x (docs/experiments.md).
WS_CONSUMERS = 3

#: Causal calls of the wgmma FP4 forwards (NVFP4, QAT) dispatch their query blocks heaviest first across groups of
#: this many (batch, head) pairs (kernels_cu/common/rows.cuh query_block), not one pair after another: then the last
#: wave does not hold the heavy blocks of the last heads alone (H200, D=128, end to end: NVFP4 causal 1.06x at 4K,
#: 1.04x at 16K; QAT forward causal 1.06x / 1.03x; docs/experiments.md). The kernels are template instances (CG);
#: calls without the mask keep the plain order (CG = 1).
FP4_CAUSAL_GROUP = 16


def fp4_causal_group(causal: bool) -> int:
    """The dispatch group (CG template argument) of a wgmma FP4 forward launch: :data:`FP4_CAUSAL_GROUP` with the
    causal work shape (:func:`causal_shape`), else 1 (the plain order)."""
    return FP4_CAUSAL_GROUP if causal else 1


def kernel_window(p) -> tuple:
    """``(left, right)`` as the FP4 kernels take them (kernels_cu/common/rows.cuh ``Window``; -1: unbounded) for
    problem ``p`` (a :class:`sagecupy._checks.Problem`): its window or causal's ``(-1, 0)``, as
    :func:`sagecupy.int8.kernel_window`, with every side that bounds no row passed as -1: ``left >= Nk - 1`` (row
    ``Nq - 1`` sees key 0) and ``right >= Nq - 1`` (row 0 sees key ``Nk - 1``; a right edge of 0, causal's, is kept:
    with Nq = 1 it hides nothing either, and causal calls keep their launch). The launch's dispatch order and tail
    split follow the window's shape (:func:`causal_shape`), so a window that hides nothing must launch as full or
    causal attention to give their results bit for bit; the index sums stay within 32 bits."""
    left, right = p.bounds
    return (-1 if left >= p.nk - 1 else left, -1 if right >= max(p.nq - 1, 1) else right)


def causal_shape(window: tuple) -> bool:
    """Whether kernel window ``(left, right)`` has the causal work shape (rows further down see more keys: an unbounded
    left edge and a bounded right one; kernels_cu/common/rows.cuh ``Window::causal_shape``): such grids run their
    heavy blocks first (:func:`fp4_causal_group`) and keep whole items (no tail split)."""
    return window[0] < 0 and window[1] >= 0


def _window_key(window):
    """``window`` in a plan's key, with the type of each side (``(5.0, 0)`` hashes as ``(5, 0)`` but is refused)."""
    return window if window is None else (type(window), tuple((type(x), x) for x in window))


def causal_group_suffix(cg: int) -> str:
    """The template arguments' tail for dispatch group ``cg`` (none for 1, the default argument)."""
    return "" if cg == 1 else f", {cg}"


def fp4_warps(engine: str = "mma", head_dim: int = 128) -> int:
    """Warps per CTA (16 query rows each) of the FP4 forwards that are not warp-specialized: :data:`MMA_WARPS` on
    the mma.sync engine, :data:`WGMMA_D64_WARPS` for the wgmma NVFP4 kernel (which runs at D=64 only; at D=128
    :func:`fp4_ws` applies)."""
    return WGMMA_D64_WARPS if engine == "wgmma" else MMA_WARPS


def fp4_ws(engine: str = "wgmma", head_dim: int = 128) -> int:
    """Consumer warpgroups of the warp-specialized wgmma NVFP4 forward (``nvfp4_attn_fwd_ws_img`` in
    ``kernels_cu/nvfp4/fp4_attn_fwd_sm90.cu``: one warpgroup copies the K/V stage images into a ring of stages, the
    consumers multiply and quantize P, 64 query rows each), where it runs: :data:`WS_CONSUMERS` at D=128 on the
    wgmma engine; else 0."""
    return WS_CONSUMERS if engine == "wgmma" and head_dim == 128 else 0


def ws_smem_bytes(D: int, nc: int = WS_CONSUMERS) -> int:
    """Dynamic shared memory of the warp-specialized NVFP4 forward (``NvWs<D, nc>``): fp16 Q (64 nc rows), 4 stages
    of K and V, two staging buffers of 36 bytes per 64-element task, 9 mbarriers, 1024 for alignment."""
    slots = max(64 * nc * D // 64, _BKV * D // 64 + D)
    return 64 * nc * 2 * D + 4 * (_BKV * 2 * D + D * _BKV * 2) + 2 * 36 * slots + 9 * 8 + 1024


def ws_img_bytes(D: int) -> int:
    """Bytes of one K/V stage image (``WS_IMG_STAGE<D>``): a 64-key fp16 K^ tile and its D x 64 fp16 V^^T tile,
    laid out as the warp-specialized kernel's shared-memory stage. Each key tile is dequantized once, into its image
    (scratch of 4x the packed K and V), which the kernel's producer copies with two bulk copies per tile: on the H200
    at B 4, 4K, D 128 the kernel 1.56 -> 1.36 ms against a producer that dequantizes every tile once per query block
    (docs/experiments.md)."""
    return 2 * _BKV * 2 * D


def ws_img_raw_smem_bytes(D: int) -> int:
    """Dynamic shared memory of ``nvfp4_kv_images_raw`` (``WS_IMG_RAW_SMEM<D>``): one image, V's 64-token tile
    (rows of D + 8 16-bit values) and K's mean (D floats)."""
    return ws_img_bytes(D) + 64 * (D + 8) * 2 + D * 4


#: Parts a split item's keys go to at most (the kernel's combination reads at most this many).
_SPLIT_MAX = 4


def _tail_split(items: int, sms: int, ntiles: int):
    """``(whole, nsplit)``: the first ``whole`` items of the grid run whole (full waves of one CTA per SM), the
    ``items - whole = items % sms`` after them in ``nsplit`` parts of their key tiles each; or None where that gains
    nothing. ``nsplit`` in 2..4 with at least 4 key tiles per part, the one that makes the tail shortest in item
    times, ceil(rest * nsplit / sms) / nsplit (1 unsplit), the smaller on a tie; None unless that is at most 0.8
    (e.g. 1,408 items on 132 SMs: 88 split in 3, 10 2/3 item times instead of 11; H200, 4K: 1.468 -> 1.450 ms,
    docs/experiments.md)."""
    rest = items % sms
    if rest == 0:
        return None
    best = None
    for nsplit in range(2, _SPLIT_MAX + 1):
        if ntiles < 4 * nsplit:
            break
        tail = -(-rest * nsplit // sms) / nsplit
        if best is None or tail < best[0]:
            best = (tail, nsplit)
    if best is None or best[0] > 0.8:
        return None
    return items - rest, best[1]


def _zero_ints(counters):
    """Program glue: an int32 array to 0 on the current stream (the split kernel's counters: recorded first in a
    call, before its launches)."""
    counters.data.memset_async(0, counters.size * 4)
    return ()


def _split_setup(prog, engine, D, B, Hq, nq, nk, window, two_level):
    """Record the tail split's scratch (the parts' partials, and their counters, zeroed first in the call) where it
    applies (kernel windows ``window`` without the causal work shape, :func:`causal_shape`, with two-level P where the
    warp-specialized kernel runs; with single-level P the parts would quantize P against another running max) and
    :func:`_tail_split` splits; returns ``(whole, nsplit, nblk, part_ws, counters)`` for :func:`_record_launch`, else
    None. A part takes its share of the key tiles its item's rows see; :func:`_tail_split` is given the most an item
    sees (a window bounded on both sides: its rows' span of keys)."""
    import cupy

    if not _splits(engine, D, causal_shape(window), two_level):
        return None
    nc = fp4_ws(engine, D)  # (consumer warpgroups of 64 query rows)
    nblk = (nq + 64 * nc - 1) // (64 * nc)
    ntiles = (nk + _BKV - 1) // _BKV
    if window[0] >= 0 and window[1] >= 0:  # keys q0 + shift - left .. q0 + 64 nc - 1 + shift + right: at most
        ntiles = min(ntiles, (64 * nc + window[0] + window[1] + _BKV - 1) // _BKV + 1)
    plan = _tail_split(nblk * Hq * B, _sm_count(cupy.cuda.Device().id), ntiles)
    if plan is None:
        return None
    whole, nsplit = plan
    rest = nblk * Hq * B - whole
    warps = 4 * nc  # (consumer warps: a counter and a slot of 17 x 32 float4 each, per split item and part)
    counters = prog.empty("fp4_split_cnt", (rest * warps,), cupy.int32)
    prog.call((), _zero_ints, (counters,))
    part_ws = prog.empty("fp4_split_ws", (rest * nsplit * warps * (D // 8 + 1) * 32 * 4,), cupy.float32, arena=_layout.TMP)
    return whole, nsplit, nblk, part_ws, counters


@functools.lru_cache(maxsize=None)
def _sm_count(device_id: int) -> int:
    import cupy

    return int(cupy.cuda.runtime.getDeviceProperties(device_id)["multiProcessorCount"])


def fp4_engine(engine: str | None = None) -> str:
    """The tensor-core path of the NVFP4 forward: ``"wgmma"`` (Hopper, sm_90a: both products on warpgroup MMA,
    ``kernels_cu/nvfp4/fp4_attn_fwd_sm90.cu``) or ``"mma"`` (mma.sync, sm_80+). ``engine``: ``None`` or ``"auto"``
    (the default: ``"wgmma"`` on sm_90, ``"mma"`` elsewhere), ``"mma"`` or ``"wgmma"``, as the INT8 engines. The two
    share the per-tile softmax and P quantization (``kernels_cu/common/fp4_fwd.cuh``) and differ through the fp32
    accumulation order inside the tensor cores and, for the warp-specialized kernel (D=128), the order of O's fp32
    rescaling (O kept in the frame of its last tile) and of the keys within a tile (each thread's 16 logits of a row
    one whole 16-key block of P); tested against the simulator. The QAT forward (``sagecupy.qat.forward``) follows
    the same choice (wgmma: ``kernels_cu/qat/qat_attn_fwd_sm90.cu``); there the wgmma kernel also keeps O in the
    frame of its last tile and skips, for O only, tiles whose weights are below 2^-60 of the row's largest."""
    return _layout.pick_engine(engine)


def kernel_names() -> dict:
    """Every template instantiation this module (and sagecupy.qat) launches, per source file (CI compiles them; the
    loader compiles a file's list at its first use). Single-level P on the warp-specialized kernel (a config field)
    compiles on first use."""
    quant = [f"nvfp4_quant_rows<{T}, {dt}>" for T in _T.values() for dt in _ROWS_DT]
    quant += [f"{k}<{T}>" for T in _T.values()
              for k in ("nvfp4_quant_tokens", "nvfp4_quant_tokens_tiled", "nvfp4_fq_rows",
                        "nvfp4_fq_rows_any", "nvfp4_fq_tokens", "row_mu_dot", "qat_delta")]
    attn = []
    for T in _T.values():
        for D in (64, 128):
            attn += [f"nvfp4_attn_fwd<{T}, {D}, {MMA_WARPS}, {tl}>" for tl in ("true", "false")]
            attn.append(f"qat_attn_fwd<{T}, {D}, {MMA_WARPS}>")
    # wgmma, D=64: plain and causal dispatch orders
    attn90 = [f"nvfp4_attn_fwd_sm90<{T}, 64, {WGMMA_D64_WARPS}, {tl}>" for T in _T.values() for tl in ("true", "false")]
    attn90 += [f"nvfp4_attn_fwd_sm90<{T}, 64, {WGMMA_D64_WARPS}, {tl}, {FP4_CAUSAL_GROUP}>"
               for T in _T.values() for tl in ("true", "false")]
    # wgmma, D=128: the K/V stage images (from the packed or the raw K and V) and the warp-specialized kernel on
    # them (two-level P), whole items (both dispatch orders) or the tail split
    attn90 += ["nvfp4_kv_images<128>"] + [f"nvfp4_kv_images_raw<{T}, 128>" for T in _T.values()]
    attn90 += [_ws_img_name(T, 128, "true", cg, False) for T in _T.values() for cg in (1, FP4_CAUSAL_GROUP)]
    attn90 += [_ws_img_name(T, 128, "true", 1, True) for T in _T.values()]
    qat90 = [f"qat_attn_fwd_sm90<{T}, {D}{causal_group_suffix(cg)}>" for T in _T.values() for D in (64, 128)
             for cg in (1, FP4_CAUSAL_GROUP)]
    return {"nvfp4/nvfp4_quant.cu": quant, "nvfp4/fp4_attn_fwd.cu": attn, "nvfp4/fp4_attn_fwd_sm90.cu": attn90,
            "qat/qat_attn_fwd_sm90.cu": qat90}


def qat_fwd_sm90_smem_bytes(D: int) -> int:
    """Dynamic shared memory of the wgmma QAT forward (QatFwdSm90<D> in qat/qat_attn_fwd_sm90.cu): fp16 Q~ (128 rows),
    4 stages of K~ and V~^T tiles (64 keys), 12 mbarriers, 1024 for the tiles' alignment."""
    return 128 * 2 * D + 4 * (_BKV * 2 * D + D * _BKV * 2) + 12 * 8 + 1024


def kernel_constants() -> dict:
    """Host values the kernel sources define too ([(C++ expression, value)] per file; CI static_asserts them)."""
    return {"nvfp4/fp4_attn_fwd_sm90.cu": [(f"Nv90<64, {WGMMA_D64_WARPS}>::SMEM",
                                            fwd_smem_bytes(64, WGMMA_D64_WARPS, "wgmma")),
                                           (f"NvWs<128, {WS_CONSUMERS}>::SMEM", ws_smem_bytes(128)),
                                           ("WS_SPLIT_MAX", _SPLIT_MAX), ("WS_IMG_STAGE<128>", ws_img_bytes(128)),
                                           ("WS_IMG_RAW_SMEM<128>", ws_img_raw_smem_bytes(128))],
            "qat/qat_attn_fwd_sm90.cu": [(f"QatFwdSm90<{D}>::SMEM", qat_fwd_sm90_smem_bytes(D)) for D in (64, 128)]}


def _ws_img_name(T: str, D: int, tl: str, cg: int, split: bool) -> str:
    """The warp-specialized kernel's instance (:data:`WS_CONSUMERS` consumers; ``split``: the tail-splitting grid).
    Its sixth template argument (once a Q-quantizing form) is always false."""
    return f"nvfp4_attn_fwd_ws_img<{T}, {D}, {tl}, {cg}, {WS_CONSUMERS}, false, {'true' if split else 'false'}>"


@functools.lru_cache(maxsize=None)
def compile_list(filename: str) -> tuple:
    """kernel_names()[filename] as a tuple, built once (launches pass it on every call)."""
    return tuple(kernel_names()[filename])


_QUANT_SRC, _FWD_SRC, _FWD90_SRC = "nvfp4/nvfp4_quant.cu", "nvfp4/fp4_attn_fwd.cu", "nvfp4/fp4_attn_fwd_sm90.cu"
#: How the instances of each FP4 forward source (this family's and the QAT forward's) are compiled: (in their file's
#: :func:`compile_list` module, arch). fp4_attn_fwd.cu's compile one per module.
_FETCH = {_QUANT_SRC: (True, None), _FWD_SRC: (False, None), _FWD90_SRC: (True, "sm_90a"),
          "qat/qat_attn_fwd_sm90.cu": (True, "sm_90a")}


def kernel_request(filename: str, name: str) -> tuple:
    """``(filename, name, all_names, arch)``: what the launches pass to get_function for instance ``name`` of an FP4
    forward source (a name outside its file's list then compiles alone, as get_function does)."""
    listed, arch = _FETCH[filename]
    return filename, name, compile_list(filename) if listed else None, arch


def _kernel(filename: str, name: str):
    filename, name, all_names, arch = kernel_request(filename, name)
    return get_function(filename, name, all_names=all_names, arch=arch)


def quant_function(kind, T):
    """The ``nvfp4_quant.cu`` kernel ``kind<T>`` (the QAT family's fake quantizers too)."""
    return _kernel(_QUANT_SRC, f"{kind}<{T}>")


def _attn_kernel(T: str, D: int, engine: str, two_level: bool, causal: bool, split: bool = False) -> tuple:
    """(source, instance) of the NVFP4 attention kernel for a call on ``engine`` (resolved): mma.sync
    (:data:`MMA_WARPS`), wgmma at D=64 (:data:`WGMMA_D64_WARPS`, the causal dispatch group), or the warp-specialized
    kernel where :func:`fp4_ws` says (``split``: its tail-splitting grid). ``causal``: the kernel window's causal work
    shape (:func:`causal_shape`)."""
    tl = "true" if two_level else "false"
    if engine != "wgmma":
        return _FWD_SRC, f"nvfp4_attn_fwd<{T}, {D}, {fp4_warps(engine, D)}, {tl}>"
    if fp4_ws(engine, D):
        return _FWD90_SRC, _ws_img_name(T, D, tl, 1 if split else fp4_causal_group(causal), split)
    return _FWD90_SRC, (f"nvfp4_attn_fwd_sm90<{T}, {D}, {fp4_warps(engine, D)}, {tl}"
                        f"{causal_group_suffix(fp4_causal_group(causal))}>")


def _splits(engine: str, D: int, causal: bool, two_level: bool) -> bool:
    """Whether the tail split may apply: calls without the causal work shape (``causal``: :func:`causal_shape` of
    the kernel window) with two-level P where the warp-specialized kernel runs (with single-level P the parts would
    quantize P against another running max)."""
    return not causal and two_level and fp4_ws(engine, D) > 0


def kernel_requests(dtype: str, D: int, engine: str) -> list:
    """What this family's calls on ``dtype`` inputs of head dim ``D`` pass to get_function on ``engine`` (``"mma"``
    or ``"wgmma"``), under every config, mask and window: ``(source, instance, all_names, arch)`` tuples, K's mean (the INT8
    pre-pass's column kernels) included (:func:`sagecupy.warmup` compiles their modules)."""
    from .int8 import quant_requests

    T = _T[dtype]
    kernels = {_attn_kernel(T, D, engine, tl, causal, split) for tl in (True, False) for causal in (False, True)
               for split in (False, True) if not split or _splits(engine, D, causal, tl)}
    if fp4_ws(engine, D):  # the K/V stage images, from the raw (attention) or the packed K and V (attention_packed)
        kernels |= {(_FWD90_SRC, f"nvfp4_kv_images<{D}>"), (_FWD90_SRC, f"nvfp4_kv_images_raw<{T}, {D}>")}
    return (quant_requests(T, D) + [kernel_request(_QUANT_SRC, n) for n in compile_list(_QUANT_SRC)]
            + [kernel_request(f, n) for f, n in sorted(kernels)])


#: Head dims nvfp4_quant_rows is compiled for with D a constant (0: any D, read at run time).
_ROWS_DT = (0, 64, 128, 256)


def _rows_launch(T, n, D):
    """nvfp4_quant_rows for head dim D (its compile-time instance where there is one: two 16-blocks per thread, one
    otherwise) and the x extent of its grid for n rows."""
    dt = D if D in _ROWS_DT else 0
    bpt = 2 if dt else 1
    return quant_function("nvfp4_quant_rows", f"{T}, {dt}"), (n * D // 16 // bpt + 255) // 256


def fwd_smem_bytes(D: int, warps: int, engine: str = "mma") -> int:
    """Dynamic shared memory of the FP4 forwards. mma.sync: fp16 Q tile, 2 stages of fp16 K and V^T tiles, the
    packed staging area, alignment. wgmma (``Nv90`` in nvfp4/fp4_attn_fwd_sm90.cu): fp16 Q, 3 stages of K and V,
    36 staging bytes per 64-element task (64 D / 64 K tasks + D V tasks, or the Q tile's 16 warps D / 64 tasks
    where those are more: 12 warps), 9 mbarriers, 1024 for alignment."""
    if engine not in ("mma", "wgmma"):
        raise ValueError(f"engine={engine!r}: a resolved engine ('mma' or 'wgmma') is needed here")
    if engine == "wgmma":  # (the staging slots: one per tile task, or per Q task where those are more)
        slots = max(_BKV * D // 64 + D, 16 * warps * D // 64)
        return 16 * warps * 2 * D + 3 * (_BKV * 2 * D + D * _BKV * 2) + 36 * slots + 9 * 8 + 1024
    return 16 * warps * 2 * D + 2 * (_BKV * 2 * D + D * _BKV * 2) + _BKV * D + 128


def prepare_input(x, name, layout):
    """``x`` as a CuPy array the quantizers read (both FP4 families' inputs)."""
    import cupy

    x = _checks.as_cupy(x, name)
    dt = _checks.dtype_name(x.dtype)
    if dt not in _T:
        raise TypeError(f"{name}.dtype={dt} is not supported; supported: {tuple(_T)}{_checks.BF16_FORMS}")
    if len(x.shape) != 4:
        raise ValueError(f"{name} must be 4-D, got shape {tuple(x.shape)}")
    if layout not in ("HND", "NHD"):
        raise ValueError(f"layout={layout!r} is not supported; supported: ('HND', 'NHD')")
    _checks.check_dims(x.shape, name, ("B", "H", "N", "D") if layout == "HND" else ("B", "N", "H", "D"))
    B, a1, a2, D = x.shape
    H, N = (a1, a2) if layout == "HND" else (a2, a1)
    if D % 16:
        raise ValueError(f"head_dim={D} must be a multiple of 16 for NVFP4 (16-element blocks)")
    # (the quantizers' grids are (blocks, H, B) and their offsets within a head 32-bit, as the attention kernels')
    _checks.check_limits(B, H, 0, N, N, D, what=f"{name}: ", names=("N", "N"))
    raw = _checks.raw(x)
    if raw.strides[3] != raw.itemsize:
        raw = cupy.ascontiguousarray(raw)
    s = [st // raw.itemsize for st in raw.strides]
    strides = (s[0], s[1], s[2]) if layout == "HND" else (s[0], s[2], s[1])
    return raw, _T[dt], (B, H, N, D), strides


def quantize_rows(x, *, layout="HND", mean=None):
    """NVFP4 of ``x`` (Q or K) in 16-blocks along D, after subtracting ``mean`` ((B, Hm, D) float32, Hm
    dividing H; K-smoothing) when given. Returns ``(codes (B,H,N,D/2) uint8, scales (B,H,N,D/16) uint8)``."""
    import cupy

    raw, T, (B, H, N, D), (sb, sh, sn) = prepare_input(x, "x", layout)
    group = 1
    if mean is not None:
        mean = cupy.ascontiguousarray(_checks.as_cupy(mean, "mean"), dtype=cupy.float32)
        if mean.ndim != 3 or mean.shape[0] != B or mean.shape[2] != D or mean.shape[1] < 1 or H % mean.shape[1]:
            raise ValueError(f"mean.shape={tuple(mean.shape)} must be (B, Hm, D) = ({B}, Hm, {D}) with Hm dividing {H}")
        group = H // mean.shape[1]
        if mean.data.ptr % 16:  # (the kernel reads it with 16-byte loads; the caller's array is not modified)
            mean = mean.copy()
    codes = cupy.empty((B, H, N, D // 2), dtype=cupy.uint8)
    scales = cupy.empty((B, H, N, D // 16), dtype=cupy.uint8)
    i32, i64 = cupy.int32, cupy.int64
    fn, gx = _rows_launch(T, N, D)
    fn((gx, H, B), (256,),
                               (raw, i64(sb), i64(sh), i64(sn), i32(N), i32(D), mean, i32(group), codes, scales,
                                None, i32(1), cupy.float32(0), None))
    return codes, scales


def quantize_tokens(x, *, layout="HND"):
    """NVFP4 of ``x`` (V) in blocks of 16 consecutive tokens per channel (V transposed, tokens zero-padded
    to N16). Returns ``(codes (B,H,D,N16/2) uint8, scales (B,H,D,N16/16) uint8)``."""
    import cupy

    raw, T, (B, H, N, D), (sb, sh, sn) = prepare_input(x, "x", layout)
    n16 = (N + 15) // 16 * 16
    codes = cupy.empty((B, H, D, n16 // 2), dtype=cupy.uint8)
    scales = cupy.empty((B, H, D, n16 // 16), dtype=cupy.uint8)
    i32, i64 = cupy.int32, cupy.int64

    name, grid, block = _tokens_launch(not _layout.needs_copy(raw, True), B, H, D, n16)
    quant_function(name, T)(grid, block, (raw, i64(sb), i64(sh), i64(sn), i32(N), i32(D), i32(n16), codes, scales))
    return codes, scales


def _tokens_launch(aligned, B, H, D, n16):
    """V's quantizer (kernel name, grid, block): on 16-byte aligned rows one CTA per 64 tokens (a shared-memory
    tile, nvfp4_quant_tokens_tiled: 16-byte loads, each thread writes whole sectors), else one thread per block."""
    if aligned and D % 8 == 0:
        return "nvfp4_quant_tokens_tiled", ((n16 + 63) // 64, H, B), (128,)
    return "nvfp4_quant_tokens", ((D * (n16 // 16) + 255) // 256, H, B), (256,)


def quantize_inputs(q, k, v, *, layout="HND", k_smoothing=True):
    """Q, K (K - mean over tokens when ``k_smoothing``) and V in the exchange format; keys as
    :func:`sagecupy.reference.nvfp4.quantize_inputs` (without Q-smoothing and tensor scales).

    The K mean is computed in float64 and rounded to float32, then subtracted in float32, as the reference does
    with quantization on (so the codes are its codes bit for bit)."""
    import cupy

    out = {}
    mu = None
    if k_smoothing:
        raw, T, shape, _ = prepare_input(k, "k", layout)
        if shape[3] in _checks.SUPPORTED_HEAD_DIMS:  # the INT8 pre-pass's column kernels (16-byte row loads)
            from .int8 import column_stat

            raw = _layout.prepare(raw, "k", layout, True)
            mu = column_stat(raw, _layout.strides(raw, layout), T, shape, False)
        else:
            mu = _as_float32_hnd(raw, layout).astype(cupy.float64).mean(axis=2).astype(cupy.float32)  # (B, H, D)
    out["q_packed"], out["q_scales"] = quantize_rows(q, layout=layout)
    out["k_packed"], out["k_scales"] = quantize_rows(k, layout=layout, mean=mu)
    out["v_packed"], out["v_scales"] = quantize_tokens(v, layout=layout)
    out["mu_k"] = mu
    return out


# ---------------------------------------------------------------------------------------------------------
# Attention


def _unsupported_config(cfg: NVFP4Config) -> str | None:
    # (NVFP4Config checks its tile sizes, not its switches: a non-bool switch is refused here)
    for field in ("two_level_p", "k_smoothing", "q_smoothing", "tensor_scale", "quantize"):
        if not isinstance(getattr(cfg, field), bool):
            return f"{field}={getattr(cfg, field)!r} must be a bool"
    if cfg.block_kv != _BKV:
        return f"block_kv={cfg.block_kv} is not supported by the kernel; supported: {_BKV}"
    if cfg.q_smoothing:
        return "q_smoothing=True is not implemented in the GPU kernel yet (reference only)"
    if cfg.tensor_scale:
        return "tensor_scale=True (the per-tensor second level) is not implemented in the GPU kernel (reference only)"
    if not cfg.quantize:
        return "quantize=False is a reference-only switch"
    return None


def _get_config(config) -> NVFP4Config:
    if config is None:
        return NVFP4Config()
    if not isinstance(config, NVFP4Config):
        raise TypeError(f"config must be an NVFP4Config or None, got {type(config).__name__}")
    return config


def _check_device():
    cc = device_capability()
    if cc < (8, 0):
        raise ValueError(f"the FP4 kernels need compute capability 8.0 or newer (fp16 mma.sync); this device is "
                         f"{cc[0]}.{cc[1]}")


@functools.lru_cache(maxsize=None)
def _smem_optin(device_id: int) -> int:
    """Largest dynamic shared memory a block may opt in to on this device (bytes)."""
    import cupy

    rt = cupy.cuda.runtime
    attr = getattr(rt, "cudaDevAttrMaxSharedMemoryPerBlockOptin", 97)  # 97 in the CUDA runtime's enum
    return int(rt.deviceGetAttribute(attr, device_id))


def check_fwd_smem(D: int, engine: str = "mma", qat: bool = False) -> None:
    """ValueError if the FP4 forward's shared memory (at its CTA size) exceeds what the current
    device allows a block (e.g. D=128 with 8 warps needs ~104 KiB; sm_86/sm_89 allow 99 KiB). ``qat``: the QAT
    forward (on wgmma a kernel of its own, with a fixed CTA size)."""
    import cupy

    have = _smem_optin(cupy.cuda.Device().id)
    if qat and engine == "wgmma":
        need = qat_fwd_sm90_smem_bytes(D)
        if need > have:
            raise ValueError(f"the wgmma QAT forward at head_dim={D} needs {need} bytes of shared memory per "
                             f"block; this device allows {have}")
        return
    if fp4_ws(engine, D):
        need = ws_smem_bytes(D)
        if need > have:
            raise ValueError(f"the warp-specialized NVFP4 forward at head_dim={D} needs {need} bytes of shared "
                             f"memory per block; this device allows {have}")
        return
    w = fp4_warps(engine, D)
    need = fwd_smem_bytes(D, w, engine)
    if need > have:
        raise ValueError(f"the FP4 forward at head_dim={D} with {w} warps per CTA needs {need} bytes of "
                         f"shared memory per block; this device allows {have}")


def validated_problem(q, k, v, causal, sm_scale, layout, config, get_config, unsupported_config, engine=None, qat=False,
                      window=None):
    """The checks of both FP4 families' entry points (:func:`attention`, :func:`sagecupy.qat.forward` with
    ``qat=True``), raising the first failure: ``(q, k, v, problem, config)`` with q, k, v as CuPy arrays.
    ``engine``: the caller's ``engine`` argument (validated and resolved by :func:`fp4_engine`); ``window``: None or
    ``(left, right)``, validated with the reference's ``resolve_window`` (ValueError naming it), kept in the problem."""
    q, k, v = (_checks.as_cupy(x, n) for x, n in ((q, "q"), (k, "k"), (v, "v")))
    p = _checks.check_attention_args(q, k, v, causal=causal, sm_scale=sm_scale, layout=layout, window=window)
    cfg = get_config(config)
    why = unsupported_config(cfg)
    if why:
        raise ValueError(f"config: {why}")
    _check_device()
    check_fwd_smem(p.head_dim, fp4_engine(engine), qat)
    return q, k, v, p, cfg


def check_support(q, k, v, causal, sm_scale, layout, config, get_config, unsupported_config,
                  engine=None, qat=False, window=None) -> tuple[bool, str]:
    """The ``is_supported`` of both FP4 families (this module's and :mod:`sagecupy.qat`'s): never raises."""
    try:
        q, k, v = (_checks.as_cupy(x, n) for x, n in ((q, "q"), (k, "k"), (v, "v")))
        p = _checks.check_attention_args(q, k, v, causal=causal, sm_scale=sm_scale, layout=layout, window=window)
        cfg = get_config(config)
        _check_device()
        check_fwd_smem(p.head_dim, fp4_engine(engine), qat)
    except Exception as exc:
        return False, str(exc)
    why = unsupported_config(cfg)
    return (False, why) if why else (True, "")


def is_supported(q, k, v, *, causal=False, sm_scale=None, layout="HND", config=None,
                 engine=None, window=None) -> tuple[bool, str]:
    """(True, "") if :func:`attention` accepts these arguments (``window`` included) on the current device, else
    (False, why). Never raises."""
    return check_support(q, k, v, causal, sm_scale, layout, config, _get_config, _unsupported_config, engine,
                         window=window)


def _as_float32_hnd(x, layout):
    """float32 copy of a raw (fp16 / bf16 bits) 4-D array, in HND."""
    import cupy

    f = x.astype(cupy.float32) if x.dtype == cupy.float16 else (x.astype(cupy.uint32) << 16).view(cupy.float32)
    return f if layout == "HND" else f.transpose(0, 2, 1, 3)


def _u8(x, name, shape):
    import cupy

    x = _checks.as_cupy(x, name)
    if _checks.dtype_name(x.dtype) != "uint8":
        raise TypeError(f"{name}.dtype={_checks.dtype_name(x.dtype)} is not supported; the exchange format is uint8")
    if tuple(x.shape) != tuple(shape):
        raise ValueError(f"{name}.shape={tuple(x.shape)} must be {tuple(shape)}")
    if not x.flags.c_contiguous or x.data.ptr % 16:  # the kernel copies 8-byte units: aligned, dense rows
        x = cupy.array(x, order="C", copy=True)
    return x


def _pad_tokens64(codes, scales, n16):
    """V^T codes/scales with rows padded to a multiple of 64 tokens (zeros) for the wgmma kernel, which copies
    a tile's 32 code bytes and 4 scale bytes per channel with 16- and 4-byte cp.async (aligned rows). No copy
    when N16 is already a multiple of 64."""
    import cupy

    n64 = (n16 + 63) // 64 * 64
    if n64 == n16:
        return codes, scales
    c = cupy.zeros(codes.shape[:-1] + (n64 // 2,), dtype=cupy.uint8)
    sc = cupy.zeros(scales.shape[:-1] + (n64 // 16,), dtype=cupy.uint8)
    c[..., : n16 // 2] = codes
    sc[..., : n16 // 16] = scales
    return c, sc


def _record_launch(prog, ops, *, B, Hq, Hkv, nq, nk, D, dtype, layout, window, sm_scale, two_level, qmk, engine,
                   split=None, kv_img=None):
    """Record the attention kernel's launch on operands ``ops`` (Refs of the exchange-format arrays, V^T codes and
    scales as (B, Hkv, D, N16/2) and (B, Hkv, D, N16/16)) and ``qmk`` (a Ref or None) into ``prog``, with kernel
    window ``window`` (:func:`kernel_window`): outputs
    ``"o"`` (raw, in ``layout``) and ``"lse"``. Where the warp-specialized kernel runs (:func:`fp4_ws`) it reads K/V
    stage images: ``kv_img``, their Ref where the pre-pass wrote them from the raw K and V (``nvfp4_kv_images_raw``;
    ``ops`` then has no K and V), else ``nvfp4_kv_images`` writes them from the packed K and V first. ``split``:
    :func:`_split_setup`'s (the tail-splitting grid when it is given)."""
    import cupy

    n16 = (nk + 15) // 16 * 16
    ws = fp4_ws(engine, D)  # consumer warpgroups of the warp-specialized kernel (64 query rows each), or 0
    w = None if ws else fp4_warps(engine, D)
    bq = 64 * ws if ws else 16 * w
    o_shape = _layout.layout_shape((B, Hq, nq, D), layout)
    o = prog.empty("o", o_shape, _layout.bits_dtype(dtype))
    osb, osh, osn = _layout.c_strides(o_shape, layout)
    lse = prog.empty("lse", (B, Hq, nq), cupy.float32)
    i32, i64, f32 = cupy.int32, cupy.int64, cupy.float32
    vc, vs = ops.get("v_packed"), ops.get("v_scales")
    img = kv_img
    causal = causal_shape(window)
    assert split is None or _splits(engine, D, causal, two_level)
    fn = _kernel(*_attn_kernel(_T[dtype], D, engine, two_level, causal, split is not None))
    if engine == "wgmma":
        n64 = (n16 + 63) // 64 * 64
        if n64 != n16 and kv_img is None:  # rows padded to whole 64-token tiles (a copy per call)
            vc, vs = prog.call(("v_packed_64", "v_scales_64"), _pad_tokens64, (vc, vs, n16))
        v_args = (vc, vs, i32(n64 // 2))
        if ws and kv_img is None:  # each 64-key tile dequantized once, in the shared-memory layout
            ntile = (nk + _BKV - 1) // _BKV
            img = prog.empty("fp4_kv_img", (B * Hkv * ntile * ws_img_bytes(D),), cupy.uint8, arena=_layout.TMP)
            prog.launch(_kernel(_FWD90_SRC, f"nvfp4_kv_images<{D}>"),
                        (ntile, Hkv, B), (128,), (ops["k_packed"], ops["k_scales"], *v_args, i32(nk), i32(n16), img),
                        pdl=True)  # (it calls grid_dep_wait() first)
    else:
        v_args = (vc, vs)
    smem = ws_smem_bytes(D, ws) if ws else fwd_smem_bytes(D, w, engine)
    grid = ((nq + bq - 1) // bq, Hq, B)
    if smem > 48 * 1024:
        fn.max_dynamic_shared_size_bytes = smem
    extra = ()
    if ws:  # (split: a 1-D grid, whole items first)
        whole, nsplit, nblk, part_ws, counters = split if split is not None else (0, 1, 1, None, None)
        # (the raw Q, its strides, K's mean and sm_scale: null arguments of the kernel's signature)
        head = (ops["q_packed"], ops["q_scales"], None, i64(0), i64(0), i64(0), None, f32(sm_scale), img, qmk)
        if split is not None:
            grid = (whole + (grid[0] * Hq * B - whole) * nsplit,)
        extra = (i32(whole), i32(nsplit), i32(nblk), part_ws, counters)
    else:
        head = (ops["q_packed"], ops["q_scales"], ops["k_packed"], ops["k_scales"], *v_args, qmk)
    prog.launch(fn, grid, (128 * (ws + 1) if ws else 32 * w,),
                (*head, o, i64(osb), i64(osh), i64(osn), lse, i32(Hq), i32(Hkv), i32(nq), i32(nk), i32(n16),
                 f32(sm_scale * LOG2E), i32(window[0]), i32(window[1]), *extra),
                shared_mem=smem, pdl=True)  # (every NVFP4 forward kernel calls grid_dep_wait() first)


_OPS = ("q_packed", "q_scales", "k_packed", "k_scales", "v_packed", "v_scales")


_ATTN_PLANS = Plans()


def attention(q, k, v, *, causal=False, sm_scale=None, layout="HND", return_lse=False, config=None, engine=None,
              window=None):
    """NVFP4 attention forward (SageAttention3-style; docs/algorithms.md §5): ``o`` or ``(o, lse)``.

    q: ``(B, Hq, Nq, D)`` (``layout="HND"``) or ``(B, Nq, Hq, D)`` (``"NHD"``); k, v alike with Hkv, Nk;
    fp16 or bf16 (a CuPy array of ``ml_dtypes.bfloat16`` or a :class:`~sagecupy.adapters.bf16.BF16Array`; ``o``
    takes q's form); D 64 or 128; ``Hq % Hkv == 0``; any Nq, Nk; ``causal`` bottom-right aligned; ``window``: None
    or ``(left, right)`` (module docstring; with ``causal=True`` right must be 0). ``config``:
    :class:`~sagecupy.config.NVFP4Config` (default: two-level P, K-smoothing). ``lse`` float32 ``(B, Hq, Nq)``,
    natural log, of the unsmoothed logits ``sm_scale * q k^T`` as the kernel computes them (from the quantized
    operands). ``engine``: see :func:`fp4_engine`. Inputs are never modified. The first call with a signature
    validates and records its launches (sagecupy/_program.py); later ones replay them.
    """

    q, k, v = (_checks.as_cupy(x, n) for x, n in ((q, "q"), (k, "k"), (v, "v")))
    plan = _ATTN_PLANS.get_or_build(
        lambda: (signature(q), signature(k), signature(v), causal, type(causal), scale_key(sm_scale), type(sm_scale),
                 layout, config, engine, _window_key(window), env_key()),
        lambda: _attention_plan(q, k, v, causal, sm_scale, layout, config, engine, window))
    ns = plan.prog.run(_layout.input_ns(plan, plan.p.layout, q=q, k=k, v=v))
    o = _checks.wrap(ns["o"], plan.p.dtype, q)
    return (o, ns["lse"]) if return_lse else o


def _attention_plan(q, k, v, causal, sm_scale, layout, config, engine, window=None):
    """Validate an :func:`attention` call and record its program: the pre-passes of :func:`quantize_inputs` (on
    16-byte aligned rows: a misaligned input is copied per call; all the keys, whatever the window), qmk = sm_scale *
    q . mu_K for the LSE, and the kernel. Where the warp-specialized kernel runs (:func:`fp4_ws`),
    ``nvfp4_kv_images_raw`` writes the K/V stage images from the raw K and V in place of K's and V's quantizers (the
    same bytes as ``nvfp4_kv_images`` on their outputs)."""
    import cupy

    from .int8 import record_column_stat

    q, k, v, p, cfg = validated_problem(q, k, v, causal, sm_scale, layout, config, _get_config, _unsupported_config, engine,
                                        window=window)
    engine = fp4_engine(engine)  # (validated inside, after the argument and device checks)
    win = kernel_window(p)
    kvimg = fp4_ws(engine, p.head_dim) > 0
    copy = tuple(_layout.needs_copy(_checks.raw(x), True) for x in (q, k, v))
    T = _T[p.dtype]
    B, Hq, Hkv, nq, nk, D = p.batch, p.heads_q, p.heads_kv, p.nq, p.nk, p.head_dim
    (qsb, qsh, qsn), (ksb, ksh, ksn), (vsb, vsh, vsn) = (_layout.run_strides(x, c, layout) for x, c in zip((q, k, v), copy))
    i32, i64, f32, u8 = cupy.int32, cupy.int64, cupy.float32, cupy.uint8
    prog = Program()
    split = _split_setup(prog, engine, D, B, Hq, nq, nk, win, cfg.two_level_p)
    rq, rk, rv = Ref("q"), Ref("k"), Ref("v")
    mu = None
    if cfg.k_smoothing:
        mu = record_column_stat(prog, "mu_k", rk, (ksb, ksh, ksn), T, (B, Hkv, nk, D), False)
    ops = {"q_packed": prog.empty("q_packed", (B, Hq, nq, D // 2), u8),
           "q_scales": prog.empty("q_scales", (B, Hq, nq, D // 16), u8)}
    if not kvimg:
        ops["k_packed"] = prog.empty("k_packed", (B, Hkv, nk, D // 2), u8)
        ops["k_scales"] = prog.empty("k_scales", (B, Hkv, nk, D // 16), u8)
    # qmk = sm_scale * q . mu_K per row (B, Hq, Nq), for the LSE: computed by Q's quantizer where a row's 16-blocks
    # are neighbouring lanes of a warp (D / 16 a power of two), else by row_mu_dot (below)
    qmk = prog.empty("qmk", (B, Hq, nq), f32) if mu is not None else None
    fused = qmk is not None and (D // 16) & (D // 16 - 1) == 0 and D // 16 <= 32
    dot = (mu, i32(Hq // Hkv), f32(p.sm_scale), qmk) if fused else (None, i32(1), f32(0), None)
    (fq, gq), (fk, gk) = _rows_launch(T, nq, D), _rows_launch(T, nk, D)
    n16 = (nk + 15) // 16 * 16
    kv_img = None
    if not kvimg:
        ops["v_packed"] = prog.empty("v_packed", (B, Hkv, D, n16 // 2), u8)
        ops["v_scales"] = prog.empty("v_scales", (B, Hkv, D, n16 // 16), u8)
    # Q's, K's and V's quantizers (or the images) and the kernel are programmatic dependents (pdl=True; each calls
    # grid_dep_wait() before touching global memory): each launches while the one before drains
    prog.launch(fq, (gq, Hq, B), (256,),
                (rq, i64(qsb), i64(qsh), i64(qsn), i32(nq), i32(D), None, i32(1), ops["q_packed"], ops["q_scales"],
                 *dot), pdl=True)
    if kvimg:  # K's and V's quantization and dequantization into the stage images, one pass over the raw K and V
        ntile = (nk + _BKV - 1) // _BKV
        kv_img = prog.empty("fp4_kv_img", (B * Hkv * ntile * ws_img_bytes(D),), u8, arena=_layout.TMP)
        fn = _kernel(_FWD90_SRC, f"nvfp4_kv_images_raw<{T}, {D}>")
        smem = ws_img_raw_smem_bytes(D)
        fn.max_dynamic_shared_size_bytes = smem
        prog.launch(fn, (ntile, Hkv, B), (128,),
                    (rk, i64(ksb), i64(ksh), i64(ksn), mu, rv, i64(vsb), i64(vsh), i64(vsn), i32(nk), i32(n16), kv_img),
                    shared_mem=smem, pdl=True)  # (it calls grid_dep_wait() first)
    else:
        prog.launch(fk, (gk, Hkv, B), (256,),
                    (rk, i64(ksb), i64(ksh), i64(ksn), i32(nk), i32(D), mu, i32(1), ops["k_packed"], ops["k_scales"],
                     None, i32(1), f32(0), None), pdl=True)
        name, grid, block = _tokens_launch(True, B, Hkv, D, n16)  # (rows 16-byte aligned: copied otherwise)
        prog.launch(quant_function(name, T), grid, block,
                    (rv, i64(vsb), i64(vsh), i64(vsn), i32(nk), i32(D), i32(n16), ops["v_packed"], ops["v_scales"]),
                    pdl=True)
    if qmk is not None and not fused:
        prog.launch(quant_function("row_mu_dot", T), ((nq + 7) // 8, Hq, B), (256,),
                    (rq, i64(qsb), i64(qsh), i64(qsn), i32(nq), i32(D), mu, i32(Hq // Hkv), f32(p.sm_scale), qmk))
    _record_launch(prog, ops, B=B, Hq=Hq, Hkv=Hkv, nq=nq, nk=nk, D=D, dtype=p.dtype, layout=layout, window=win,
                   sm_scale=p.sm_scale, two_level=cfg.two_level_p, qmk=qmk, engine=engine, split=split, kv_img=kv_img)
    return Plan(p, cfg, engine, copy, prog)


def attention_packed(packed: dict, *, causal=False, sm_scale=None, layout="HND", out_dtype="float16",
                     return_lse=False, two_level_p=True, lse_offset=None, engine=None, window=None):
    """The NVFP4 attention kernel on operands already in the exchange format (e.g. a quantized KV cache).

    ``packed``: a dict with ``"q_packed"`` uint8 ``(B, Hq, Nq, D/2)``, ``"q_scales"`` uint8 E4M3
    ``(B, Hq, Nq, D/16)``, ``"k_packed"`` ``(B, Hkv, Nk, D/2)``, ``"k_scales"`` ``(B, Hkv, Nk, D/16)``,
    ``"v_packed"`` ``(B, Hkv, D, N16/2)``, ``"v_scales"`` ``(B, Hkv, D, N16/16)`` (V transposed, tokens
    zero-padded to ``N16`` = Nk rounded up to 16) -- what :func:`quantize_inputs` returns (other keys are
    ignored). Always HND-based; ``layout`` is the layout of the returned ``o``; ``out_dtype`` "float16" or
    "bfloat16" (a CuPy bfloat16 array where CuPy has that dtype, else a
    :class:`~sagecupy.adapters.bf16.BF16Array`). ``sm_scale=None`` means ``1/sqrt(D)``. ``lse`` is the LSE of the
    logits of the packed operands; ``lse_offset`` (float32 ``(B, Hq, Nq)``, e.g. ``sm_scale * q . mu_K`` when K was
    smoothed) is added to it. ``engine``: see :func:`fp4_engine`; ``window``: as :func:`attention`'s. Returns ``o``
    or ``(o, lse)``.
    """
    import cupy

    if not isinstance(packed, dict):
        raise TypeError(f"packed must be a dict of exchange-format arrays, got {type(packed).__name__}")
    missing = [key for key in ("q_packed", "q_scales", "k_packed", "k_scales", "v_packed", "v_scales")
               if key not in packed]
    if missing:
        raise ValueError(f"packed is missing {missing}")
    if layout not in ("HND", "NHD"):
        raise ValueError(f"layout={layout!r} is not supported; supported: ('HND', 'NHD')")
    if out_dtype not in _T:
        raise ValueError(f"out_dtype={out_dtype!r} is not supported; supported: {tuple(_T)}")
    if type(causal).__name__ not in ("bool", "bool_") or type(two_level_p).__name__ not in ("bool", "bool_"):
        raise TypeError(f"causal and two_level_p must be bools, got {causal!r}, {two_level_p!r}")
    causal, two_level_p = bool(causal), bool(two_level_p)
    window = _checks.check_window(window, causal)
    qp = _checks.as_cupy(packed["q_packed"], "packed['q_packed']")
    kp = _checks.as_cupy(packed["k_packed"], "packed['k_packed']")
    if len(qp.shape) != 4 or len(kp.shape) != 4:
        raise ValueError("packed['q_packed'] and packed['k_packed'] must be 4-D (B, H, N, D/2)")
    _checks.check_dims(qp.shape, "packed['q_packed']", ("B", "Hq", "Nq", "D/2"))
    _checks.check_dims(kp.shape, "packed['k_packed']", ("B", "Hkv", "Nk", "D/2"))
    B, Hq, nq, d2 = qp.shape
    Bk, Hkv, nk, dk2 = kp.shape
    D = 2 * d2
    if D not in (64, 128):
        raise ValueError(f"head_dim={D} (from packed['q_packed'].shape[-1] * 2) is not supported; supported: (64, 128)")
    if (Bk, dk2) != (B, d2) or Hq % Hkv:
        raise ValueError(f"packed shapes do not match: q_packed {tuple(qp.shape)}, k_packed {tuple(kp.shape)} "
                         f"(same B and D; q heads a multiple of kv heads)")
    _checks.check_limits(B, Hq, Hkv, nq, nk, D, what="packed: ")
    n16 = (nk + 15) // 16 * 16
    ops = {
        "q_packed": _u8(qp, "packed['q_packed']", (B, Hq, nq, D // 2)),
        "q_scales": _u8(packed["q_scales"], "packed['q_scales']", (B, Hq, nq, D // 16)),
        "k_packed": _u8(kp, "packed['k_packed']", (B, Hkv, nk, D // 2)),
        "k_scales": _u8(packed["k_scales"], "packed['k_scales']", (B, Hkv, nk, D // 16)),
        "v_packed": _u8(packed["v_packed"], "packed['v_packed']", (B, Hkv, D, n16 // 2)),
        "v_scales": _u8(packed["v_scales"], "packed['v_scales']", (B, Hkv, D, n16 // 16)),
    }
    sm_scale = _checks.check_sm_scale(sm_scale, D)
    if lse_offset is not None:
        lse_offset = cupy.ascontiguousarray(_checks.as_cupy(lse_offset, "lse_offset"), dtype=cupy.float32)
        if tuple(lse_offset.shape) != (B, Hq, nq):
            raise ValueError(f"lse_offset.shape={tuple(lse_offset.shape)} must be {(B, Hq, nq)}")
    _check_device()
    engine = fp4_engine(engine)
    check_fwd_smem(D, engine)
    win = kernel_window(_checks.Problem(B, Hq, Hkv, nq, nk, D, out_dtype, layout, causal, sm_scale, window))
    prog = Program()
    _record_launch(prog, {n: Ref(n) for n in _OPS}, B=B, Hq=Hq, Hkv=Hkv, nq=nq, nk=nk, D=D, dtype=out_dtype,
                   layout=layout, window=win, sm_scale=sm_scale, two_level=two_level_p,
                   qmk=None if lse_offset is None else Ref("qmk"), engine=engine,
                   split=_split_setup(prog, engine, D, B, Hq, nq, nk, win, two_level_p))
    ns = prog.run({**ops, "qmk": lse_offset})
    o = _checks.wrap(ns["o"], out_dtype)
    return (o, ns["lse"]) if return_lse else o


def forward(q, k, v, *, causal=False, sm_scale=None, layout="HND", config=None, return_lse=False, engine=None,
            window=None):
    """:func:`attention` in the ``forward -> (o, residuals)`` shape the other families share (the NVFP4
    forward is inference-only: residuals is None). ``(o, lse, None)`` with ``return_lse``."""
    o, lse = attention(q, k, v, causal=causal, sm_scale=sm_scale, layout=layout, return_lse=True, config=config,
                       engine=engine, window=window)
    return (o, lse, None) if return_lse else (o, None)
