"""Context parallelism for JAX: one attention call whose sequence is spread over the devices of a ``jax.shard_map``
mesh axis, each device holding a shard of the query rows and of the keys (:func:`context_parallel_attention`).

    import jax, numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    from sagecupy.jax import context_parallel_attention, shard_sequence, unshard_sequence

    R = len(jax.devices()); mesh = Mesh(np.array(jax.devices()), ("cp",))
    spec = P(None, None, "cp", None)                       # HND: the sequence axis over the devices
    attn = jax.shard_map(lambda q, k, v: context_parallel_attention(q, k, v, "cp", causal=True),
                         mesh=mesh, in_specs=(spec, spec, spec), out_specs=spec, check_vma=False)
    qs, ks, vs = (jax.device_put(shard_sequence(x, R, which=w), NamedSharding(mesh, spec))
                  for x, w in ((q, "q"), (k, "k"), (v, "k")))
    o = unshard_sequence(jax.jit(attn)(qs, ks, vs), R)     # o of the whole sequence, in its true order

Sharding. The plans are those of :func:`sagecupy.torch.context_parallel_attention`
(:mod:`sagecupy.reference.context_parallel`): ``"zigzag"`` (the default: the sequence cut into ``2R`` chunks,
device ``r`` holding chunks ``r`` and ``2R - 1 - r``, which evens out causal work in a ring), ``"contiguous"``, or a
``ShardPlan``; chunk boundaries fall on ``sagebwd_alignment(config)``. A device's shard is its chunks concatenated.
``shard_map`` hands every device an equal contiguous slice of the global array, so the global array is first put in
*plan order* (device 0's shard, then device 1's, ...) by :func:`shard_sequence`; an ordinary ``PartitionSpec`` over
the sequence axis then gives each device its plan shard, and :func:`unshard_sequence` puts a plan-ordered array
(an output, a gradient) back in true order. Both are permutations of the sequence axis (static index arrays turned
into slices), differentiable, and take any array with the sequence on the layout's axis. Because the slices are
equal, the plan must give every device as many positions: with the default config's alignment (64 query rows, 128
keys) zigzag needs e.g. N = 256 on 2 devices, 512 on 4; otherwise a ValueError says which shards differ.

Exchanges (all2all, "Ulysses"). In the ``shard_map`` body each device holds (B, H, n, D) (HND; NHD likewise):
``jax.lax.all_to_all`` over ``axis_name`` trades the sequence shard of every head for the whole sequence of H/R
heads (head group ``g`` to device ``g``), in plan order; a static permutation puts it in true order; the device makes
the ordinary single-device call (``attention=``, by default :func:`sagecupy.jax.sage_attention`) with the call's
options, which sees the whole sequence (causal masks, windows and the quantization statistics are those of one
call); the output is permuted back to plan order and a second ``all_to_all`` returns it to sequence shards (the
LSE likewise). Differentiation is JAX's: ``all_to_all`` transposes to the reverse ``all_to_all`` and each
permutation's backward is the inverse permutation. Both exchanges move data only. GQA: device ``g`` gets query heads
``g*Hq/R ..`` and kv heads ``g*Hkv/R ..``; query head ``h`` reads kv head ``h // (Hq/Hkv)``, which lies in the
device's kv group exactly when ``Hkv % R == 0``, hence the requirement (and ``Hq % R == 0``).

Precision. Every head gets the single call's result: the exchanges and permutations move data only, and with
sagecupy's attention the kernels work per (batch, head) pair, so a call on H/R heads computes each as the call on
all H does (tests/gpu/test_invariance.py): O, the LSE and the gradients are meant to be bit for bit what
``sage_attention`` gives on the whole, unsharded inputs (tests/gpu/test_jax_cp.py checks it).

Practice. The default attention runs the CUDA kernels through buffer callbacks, so each device of the mesh is one
GPU (a CPU mesh runs only with another ``attention=``, e.g. an exact jnp attention for tests). JAX types a buffer
callback's outputs as equal on every device (no varying manual axes), which shard_map's type check (``check_vma``,
on by default) rejects in the backward and would otherwise treat as replicated, summing cotangents over the axis:
with the default attention, call ``jax.shard_map(..., check_vma=False)`` (``check_rep=False`` in JAX's older
``jax.experimental.shard_map``); a ValueError says so otherwise. A jnp ``attention=`` works either way. The ring mode of
:func:`sagecupy.torch.context_parallel_attention` (and :func:`sagecupy.context_parallel.ring_attention`, its one-GPU
simulation) has no JAX counterpart: all2all needs H/R heads per device, the ring does not.
"""
from __future__ import annotations

import functools
import numbers

import jax
import jax.numpy as jnp
import numpy as np

from ..config import get_config
from ..reference import attention as _attn
from ..reference import context_parallel as _ref

__all__ = ["context_parallel_attention", "shard_sequence", "unshard_sequence"]

_LAYOUTS = ("HND", "NHD")


# --------------------------------------------------------------------------------------------------
# plans and permutations
# --------------------------------------------------------------------------------------------------


def _check_layout(layout):
    if not isinstance(layout, str) or layout not in _LAYOUTS:
        raise ValueError(f"layout={layout!r} must be 'HND' (B, H, N, D) or 'NHD' (B, N, H, D)")
    return layout


def _seq_axis(layout):
    return 2 if layout == "HND" else 1


def _head_axis(layout):
    return 1 if layout == "HND" else 2


def _devices(R):
    if isinstance(R, (bool, np.bool_)) or not isinstance(R, numbers.Integral) or R < 1:
        raise ValueError(f"R={R!r} must be a positive int (the size of the mesh axis the sequence is sharded over)")
    return int(R)


def _side(which):
    if not isinstance(which, str) or which not in ("q", "k"):
        raise ValueError(f"which={which!r} must be 'q' (query rows, the output, dO, the LSE) or 'k' (keys and values)")
    return which


def _make_plan(plan, Nq, Nk, R, config):
    """The ShardPlan of (Nq, Nk) over R devices, its chunks on the config's SageBwd tiles (one plan for every
    attention, so that shards made for one serve another)."""
    return _ref.make_plan(plan, Nq, Nk, R, _ref.sagebwd_alignment(get_config(config)), "devices",
                          "the mesh axis")


def _side_plan(plan, N, which, R, config):
    """A plan whose ``which`` side has N positions: a name is built for (N, N) (each side's chunks depend on its own
    length only); a ShardPlan is checked against N."""
    if isinstance(plan, _ref.ShardPlan):
        have = plan.Nq if which == "q" else plan.Nk
        if have != N:
            raise ValueError(f"the sequence axis has {N} positions, the plan's {'queries' if which == 'q' else 'keys'} "
                             f"{have}")
        return _make_plan(plan, plan.Nq, plan.Nk, R, config)
    return _make_plan(plan, N, N, R, config)


def _order(plan, which, config):
    """The plan order of one side: position ``i`` of the plan-ordered sequence holds global position
    ``order[i]`` (device 0's chunks, then device 1's, ...). ValueError unless every device holds as many."""
    chunks = plan.q_chunks if which == "q" else plan.k_chunks
    lens = [sum(b - a for a, b in c) for c in chunks]
    if len(set(lens)) != 1:
        N = plan.Nq if which == "q" else plan.Nk
        tile = _ref.sagebwd_alignment(get_config(config))[0 if which == "q" else 1]
        raise ValueError(
            f"the {plan.kind} plan of {N} {'query rows' if which == 'q' else 'keys'} over {plan.ranks} devices gives "
            f"them {lens} positions, but shard_map gives every device an equal slice: choose a length that the plan "
            f"deals out evenly in tiles of {tile} (sagebwd_alignment(config)), e.g. a multiple of 2R tiles for "
            f"zigzag, of R tiles for contiguous")
    return np.concatenate([np.arange(a, b, dtype=np.int64) for c in chunks for a, b in c])


def _runs(order):
    """A permutation (an index array) as the tuple of (start, stop) source slices whose concatenation it is."""
    order = np.asarray(order, dtype=np.int64)
    cuts = np.flatnonzero(np.diff(order) != 1) + 1
    return tuple((int(s[0]), int(s[-1]) + 1) for s in np.split(order, cuts) if s.size)


def _take(x, runs, axis):
    if len(runs) == 1 and runs[0] == (0, x.shape[axis]):
        return x
    return jnp.concatenate([jax.lax.slice_in_dim(x, a, b, axis=axis) for a, b in runs], axis=axis)


# The adjoint of a permutation is its inverse. Left to itself JAX would transpose the concatenation of slices into
# zero-padded slices summed together: the same values for more memory and adds, and -0.0 + 0.0 turns a negative
# zero of the cotangent into +0.0, which would break the bit-for-bit equality of the gradients with the single call.
@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3))
def _permute(x, runs, inverse, axis):
    return _take(x, runs, axis)


def _permute_fwd(x, runs, inverse, axis):
    return _take(x, runs, axis), None


def _permute_bwd(runs, inverse, axis, _, g):
    return (_take(g, inverse, axis),)


_permute.defvjp(_permute_fwd, _permute_bwd)


def _permutations(order):
    """(to plan order, to true order) as run tuples for :func:`_permute`."""
    return _runs(order), _runs(np.argsort(order, kind="stable"))


def _shard_axis(x, layout, name="x"):
    axis = _seq_axis(layout)
    if len(x.shape) <= axis:
        raise ValueError(f"{name} has shape {tuple(x.shape)}: no sequence axis {axis} for layout={layout!r}")
    return axis


def shard_sequence(x, R, *, which="q", plan="zigzag", layout="HND", config=None):
    """The global array ``x`` with its sequence axis in plan order, so that an even ``PartitionSpec`` over that axis
    (``P(None, None, axis, None)`` for HND, ``P(None, axis)`` for NHD) gives device ``r`` of the ``R`` its plan shard.

    ``x``: (B, H, N, D) (``layout="HND"``) or (B, N, H, D) (``"NHD"``), or any array with the sequence on that axis
    (an LSE (B, H, N) is ``"HND"``). ``which="q"`` for query rows (and dO), ``"k"`` for keys and values. ``plan`` and
    ``config`` (whose tiles align the chunks) must be the call's. A differentiable jnp permutation, no
    communication; :func:`unshard_sequence` is its inverse."""
    _side(which), _check_layout(layout)
    R = _devices(R)
    axis = _shard_axis(x, layout)
    to_plan, to_true = _permutations(_order(_side_plan(plan, int(x.shape[axis]), which, R, config), which, config))
    return _permute(jnp.asarray(x), to_plan, to_true, axis)


def unshard_sequence(x, R, *, which="q", plan="zigzag", layout="HND", config=None):
    """The inverse of :func:`shard_sequence`: a global array in plan order (what ``shard_map`` assembles from the
    devices' shards, e.g. the output or a gradient) back in true order. Same arguments."""
    _side(which), _check_layout(layout)
    R = _devices(R)
    axis = _shard_axis(x, layout)
    to_plan, to_true = _permutations(_order(_side_plan(plan, int(x.shape[axis]), which, R, config), which, config))
    return _permute(jnp.asarray(x), to_true, to_plan, axis)


# --------------------------------------------------------------------------------------------------
# the call
# --------------------------------------------------------------------------------------------------


def _axis_size(axis_name):
    """The static size of the mesh axis (or axes) ``axis_name``; ValueError outside a ``shard_map`` over it."""
    size = getattr(jax.lax, "axis_size", None)
    try:
        R = size(axis_name) if size is not None else jax.lax.psum(1, axis_name)
    except NameError as exc:
        raise ValueError(f"axis_name={axis_name!r} is not a mesh axis here ({exc}): call context_parallel_attention "
                         f"inside jax.shard_map over a mesh with that axis, the sequence sharded over it") from None
    return int(R)


def _varying_axes(x):
    """The manual mesh axes along which shard_map's type check (``check_vma``) has ``x`` vary; empty with the check
    off, and on JAX versions before those types."""
    typeof = getattr(jax, "typeof", None)
    if typeof is None:
        return frozenset()
    aval = typeof(x)
    mat = getattr(aval, "manual_axis_type", None)  # JAX 0.10 and later; aval.vma before
    return frozenset((getattr(mat, "varying", None) if mat is not None else getattr(aval, "vma", None)) or ())


def _check_arrays(q, k, v, layout):
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not hasattr(x, "shape") or len(x.shape) != 4:
            raise ValueError(f"{name} must be a 4-D array ({layout}), got "
                             f"{tuple(x.shape) if hasattr(x, 'shape') else type(x).__name__}")
    if tuple(v.shape) != tuple(k.shape):
        raise ValueError(f"v must have k's shape {tuple(k.shape)}, got {tuple(v.shape)}")
    h, s = _head_axis(layout), _seq_axis(layout)
    B, Hq, nq, D = q.shape[0], q.shape[h], q.shape[s], q.shape[3]
    Bk, Hkv, nk, Dk = k.shape[0], k.shape[h], k.shape[s], k.shape[3]
    if (Bk, Dk) != (B, D) or Hq % Hkv:
        raise ValueError(f"q (B, Hq, D) = {(B, Hq, D)} and k (B, Hkv, D) = {(Bk, Hkv, Dk)} must share B and D, with "
                         f"Hq a multiple of Hkv ({layout=})")
    return Hq, Hkv, nq, nk


def context_parallel_attention(q, k, v, axis_name, *, causal=False, window=None, sm_scale=None, layout="HND",
                               config=None, plan="zigzag", mode="all2all", return_lse=False, attention=None):
    """Attention of one sequence sharded over the mesh axis ``axis_name`` (module docstring); call it inside
    ``jax.shard_map``, differentiable.

    Each device passes its shard, as an even ``PartitionSpec`` over the sequence axis hands it out of arrays that
    :func:`shard_sequence` put in plan order: ``q`` (B, Hq, nq, D) (``layout="HND"``) or (B, nq, Hq, D) (``"NHD"``),
    ``k, v`` the same with Hkv, nk; the global lengths are ``R * nq`` and ``R * nk`` (R: the axis' size). ``Hq`` and
    ``Hkv`` must divide by R (each device computes Hq/R query heads with their Hkv/R kv heads). ``causal`` (bottom-right
    aligned), ``window``, ``sm_scale`` and ``config`` are those of :func:`sagecupy.jax.sage_attention` over the *global*
    sequence; ``config`` also aligns the plan's chunks. ``plan``: ``"zigzag"``, ``"contiguous"`` or a ShardPlan for R
    devices, the one the inputs were sharded with. ``mode``: ``"all2all"`` only. ``axis_name``: the mesh axis (or
    tuple of axes, in the ``PartitionSpec``'s order) of the sequence. ``attention``: the single-device call, default
    :func:`sagecupy.jax.sage_attention`; any function taking ``(q, k, v, causal=, sm_scale=, layout=, config=,
    window=, return_lse=)`` and returning o or ``(o, lse)`` with lse (B, H, N).

    With the default attention the enclosing ``jax.shard_map`` needs ``check_vma=False`` (module docstring).

    Returns this device's rows of ``o`` (its plan shard, as ``q``), with ``return_lse`` also ``lse`` (B, Hq, nq)
    without gradient."""
    if mode != "all2all":
        raise ValueError(f"mode={mode!r}: the JAX side has mode='all2all' only; the ring runs over torch.distributed "
                         f"(sagecupy.torch.context_parallel_attention(mode='ring')) and as a one-GPU simulation "
                         f"(sagecupy.context_parallel.ring_attention)")
    _check_layout(layout)
    _attn.resolve_window(causal, window)  # TypeError naming causal, ValueError naming window, before any tracing
    if not isinstance(return_lse, (bool, np.bool_)):
        raise TypeError(f"return_lse must be a bool, got {return_lse!r}")
    if attention is None:
        from .jax import sage_attention as attention  # lazily: sagecupy.adapters.jax imports this module

        varying = sorted({str(a) for x in (q, k, v) for a in _varying_axes(x)})
        if varying:
            raise ValueError(
                f"attention=None runs sagecupy.jax.sage_attention, whose buffer callbacks give outputs that JAX "
                f"types as equal on every device, but q, k, v vary over {', '.join(varying)} (shard_map's check_vma): "
                f"call jax.shard_map(..., check_vma=False) around context_parallel_attention")
    elif not callable(attention):
        raise TypeError(f"attention must be None or a function like sagecupy.jax.sage_attention, got "
                        f"{type(attention).__name__}")
    Hq, Hkv, nq, nk = _check_arrays(q, k, v, layout)
    R = _axis_size(axis_name)
    if Hq % R or Hkv % R:
        raise ValueError(f"mode='all2all' gives each device Hq/R query heads and Hkv/R key/value heads: Hq={Hq} and "
                         f"Hkv={Hkv} must divide by the {R} devices of axis_name={axis_name!r}")
    p = _make_plan(plan, R * nq, R * nk, R, config)
    perms = {which: _permutations(_order(p, which, config)) for which in ("q", "k")}
    h, s = _head_axis(layout), _seq_axis(layout)

    def to_heads(x, which):
        # (.., all heads, .., n) -> (.., H/R heads, .., R*n): the devices' shards concatenated in axis-index order,
        # i.e. plan order; then true order for the attention
        x = jax.lax.all_to_all(x, axis_name, h, s, tiled=True)
        to_plan, to_true = perms[which]
        return _permute(x, to_true, to_plan, s)

    def to_seq(y, head_axis, seq_axis):
        to_plan, to_true = perms["q"]
        y = _permute(y, to_plan, to_true, seq_axis)
        return jax.lax.all_to_all(y, axis_name, seq_axis, head_axis, tiled=True)

    out = attention(to_heads(q, "q"), to_heads(k, "k"), to_heads(v, "k"), causal=causal, sm_scale=sm_scale,
                    layout=layout, config=config, window=window, return_lse=bool(return_lse))
    if not return_lse:
        return to_seq(out, h, s)
    o, lse = out
    return to_seq(o, h, s), to_seq(jax.lax.stop_gradient(lse), 1, 2)
