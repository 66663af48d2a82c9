"""Context parallelism for JAX (sagecupy.jax.context_parallel_attention, all2all under jax.shard_map) with the INT8
kernels, against sagecupy.jax.sage_attention on the whole, unsharded inputs.

* One GPU, a mesh of one device (R = 1): the exchanges are identities and the plan's order is the true order, so
  O, the LSE and dQ, dK, dV must equal the single call's bit for bit, whatever the lengths.
* Two GPUs (skipped with fewer): every head's whole sequence reaches one device in true order and the device makes
  the single call on its half of the heads; the kernels work per (batch, head) pair (tests/gpu/test_invariance.py), so
  the outputs, put back in true order, equal the single call's on one GPU bit for bit.

The shard_map runs with ``check_vma=False`` (``check_rep=False`` on JAX's older ``jax.experimental.shard_map``): the
adapter's buffer callbacks give outputs without varying mesh axes (sagecupy/adapters/jax_cp.py). Needs JAX with its
CUDA plugin, as tests/gpu/test_jax_adapter.py, whose skip conventions this module follows.
"""
import functools
import inspect
import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import numpy as np  # noqa: E402
import pytest  # noqa: E402

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import sagecupy.jax as sj  # noqa: E402
from test_jax_adapter import _adapter_usable, _inputs  # noqa: E402,F401  (_adapter_usable: the module's skip)

pytestmark = pytest.mark.gpu


def _shard_map(f, mesh, in_specs, out_specs):
    """shard_map without the varying-axes (replication) check, on either JAX API."""
    try:
        sm = jax.shard_map
    except AttributeError:  # JAX before 0.7
        from jax.experimental.shard_map import shard_map as sm
    params = inspect.signature(sm).parameters
    off = {"check_vma": False} if "check_vma" in params else {"check_rep": False}
    return sm(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, **off)


def _assert_bitwise(name, got, want, case):
    g, w = np.asarray(got), np.asarray(want)
    assert g.shape == w.shape and g.dtype == w.dtype, f"{name}: {g.shape} {g.dtype} vs {w.shape} {w.dtype} {case}"
    bits = np.dtype(f"uint{8 * g.dtype.itemsize}")
    g, w = g.view(bits), w.view(bits)
    diff = np.flatnonzero(g != w)
    assert diff.size == 0, (f"{name}: {diff.size} of {g.size} elements differ bitwise {case}; first at "
                            f"{np.unravel_index(diff[0], g.shape)}: {g.flat[diff[0]]:#x} vs {w.flat[diff[0]]:#x}")


def _single_call(q, k, v, do, **kw):
    """o, lse, dq, dk, dv of sage_attention on the whole inputs (jax.vjp under jit)."""
    def run(q, k, v, do):
        (o, lse), pull = jax.vjp(functools.partial(sj.sage_attention, return_lse=True, **kw), q, k, v)
        return (o, lse, *pull((do, jnp.zeros_like(lse))))

    return jax.jit(run)(q, k, v, do)


def _context_parallel(devices, q, k, v, do, *, plan, layout, config, **kw):
    """The same through context_parallel_attention on a mesh of ``devices``, outputs unsharded (true order)."""
    R = len(devices)
    mesh = Mesh(np.array(devices), ("cp",))
    spec = P(None, None, "cp", None) if layout == "HND" else P(None, "cp", None, None)
    lse_spec = P(None, None, "cp")
    f = _shard_map(functools.partial(sj.context_parallel_attention, axis_name="cp", return_lse=True, plan=plan,
                                     layout=layout, config=config, **kw), mesh, (spec,) * 3, (spec, lse_spec))
    # the plan's chunks are aligned on the config's tiles: shard and unshard with the call's config

    def shard(x, which):
        return jax.device_put(sj.shard_sequence(x, R, which=which, plan=plan, layout=layout, config=config),
                              NamedSharding(mesh, spec))

    def unshard(x, which, lay=layout):
        return sj.unshard_sequence(jax.device_put(x, devices[0]), R, which=which, plan=plan, layout=lay,
                                   config=config)

    def run(q, k, v, do):
        (o, lse), pull = jax.vjp(f, q, k, v)
        return (o, lse, *pull((do, jnp.zeros_like(lse))))

    o, lse, dq, dk, dv = jax.jit(run)(shard(q, "q"), shard(k, "k"), shard(v, "k"), shard(do, "q"))
    return unshard(o, "q"), unshard(lse, "q", "HND"), unshard(dq, "q"), unshard(dk, "k"), unshard(dv, "k")


def _compare(devices, B, Hq, Hkv, Nq, Nk, D, causal, window, layout, dtype, plan, config):
    case = dict(R=len(devices), B=B, Hq=Hq, Hkv=Hkv, Nq=Nq, Nk=Nk, D=D, causal=causal, window=window, layout=layout,
                dtype=dtype, plan=plan, config=config)
    q, k, v, do = (jax.device_put(x, devices[0]) for x in _inputs(7, B, Hq, Hkv, Nq, Nk, D, layout, dtype))
    kw = dict(causal=causal, window=window, layout=layout, config=config)
    want = _single_call(q, k, v, do, **kw)
    got = _context_parallel(devices, q, k, v, do, plan=plan, **kw)
    for name, g, w in zip(("O", "LSE", "dQ", "dK", "dV"), got, want):
        _assert_bitwise(name, g, w, case)


ONE = {  # name -> (B, Hq, Hkv, Nq, Nk, D, causal, window, layout, dtype, plan, config)
    "zigzag-causal-gqa-fp16": (1, 4, 2, 512, 512, 128, True, None, "HND", "float16", "zigzag", None),
    "contiguous-full-nhd-bf16": (2, 4, 4, 300, 300, 64, False, None, "NHD", "bfloat16", "contiguous", None),
    "zigzag-causal-nq<nk-paper": (1, 4, 1, 200, 333, 64, True, None, "HND", "bfloat16", "zigzag", "paper"),
    "zigzag-window-fp16": (1, 2, 2, 384, 384, 64, False, (100, 20), "NHD", "float16", "zigzag", None),
}


@pytest.mark.parametrize("name", list(ONE))
def test_one_device_equals_sage_attention(name):
    _compare(jax.devices("gpu")[:1], *ONE[name])


TWO = {  # lengths the plans deal out evenly in 64-row / 128-key tiles (shard_map slices evenly)
    "zigzag-causal-gqa-fp16": (1, 8, 4, 1024, 1024, 128, True, None, "HND", "float16", "zigzag", None),
    "contiguous-full-nhd-bf16": (2, 4, 2, 512, 512, 64, False, None, "NHD", "bfloat16", "contiguous", None),
    "zigzag-window-nq<nk-bf16": (1, 4, 2, 512, 1024, 64, False, (300, 40), "HND", "bfloat16", "zigzag", None),
}


@pytest.mark.parametrize("name", list(TWO))
def test_two_devices_equal_sage_attention(name):
    gpus = jax.devices("gpu")
    if len(gpus) < 2:
        pytest.skip(f"needs 2 GPUs visible to JAX, found {len(gpus)}")
    _compare(gpus[:2], *TWO[name])
