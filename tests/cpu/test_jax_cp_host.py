"""Context parallelism for JAX (sagecupy/adapters/jax_cp.py), all2all under ``jax.shard_map``, on a CPU mesh.

The attention is an exact float64 jnp attention passed as ``attention=`` (the default, the INT8 kernels, needs one
GPU per device: tests/gpu/test_jax_cp.py), so what is checked is the sharding and the exchanges: O, the LSE and the
gradients of the sharded call, put back in true order, against the same attention called once on the whole arrays.

A CPU mesh of several devices needs ``XLA_FLAGS=--xla_force_host_platform_device_count=4`` before JAX starts, and
another test module may have started JAX in this process already: the mesh checks run in one subprocess (this file
run as a script, ``python tests/cpu/test_jax_cp_host.py``), which prints one JSON line per check; the tests read them.
Argument errors that need no mesh are checked in this process.
"""
import inspect
import json
import os
import subprocess
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# B, Hq, Hkv, Nq, Nk, D, R, plan, causal, window, layout. Lengths: the default config aligns chunks on 64 query rows
# and 128 keys, and shard_map slices evenly, so the plans must deal the tiles out evenly (256 on 2 devices, 512 on 4).
CASES = {
    "r2-zigzag-causal-HND-gqa2": (1, 8, 4, 256, 256, 64, 2, "zigzag", True, None, "HND"),
    "r2-contiguous-full-NHD-gqa2": (1, 8, 4, 256, 256, 64, 2, "contiguous", False, None, "NHD"),
    "r2-zigzag-full-NHD-mha": (2, 4, 4, 256, 256, 64, 2, "zigzag", False, None, "NHD"),
    "r2-contiguous-causal-HND-gqa4": (1, 8, 2, 256, 256, 32, 2, "contiguous", True, None, "HND"),
    "r2-zigzag-causal-HND-nq<nk": (1, 8, 4, 256, 512, 64, 2, "zigzag", True, None, "HND"),
    "r2-zigzag-window-NHD": (1, 4, 2, 256, 256, 64, 2, "zigzag", False, (64, 32), "NHD"),
    "r4-zigzag-causal-NHD-gqa2": (1, 8, 4, 512, 512, 64, 4, "zigzag", True, None, "NHD"),
    "r4-contiguous-causal-HND-gqa2": (1, 8, 4, 512, 512, 64, 4, "contiguous", True, None, "HND"),
    "r4-zigzag-full-HND-gqa2": (1, 8, 4, 512, 512, 64, 4, "zigzag", False, None, "HND"),
    "r4-contiguous-full-NHD-mha": (1, 8, 8, 512, 512, 64, 4, "contiguous", False, None, "NHD"),
}
ROUND_TRIPS = [  # (shape of a global array, layout, which, R, plan)
    ((2, 3, 512, 4), "HND", "q", 4, "zigzag"),
    ((1, 384, 2, 8), "NHD", "q", 2, "zigzag"),
    ((1, 2, 512, 4), "HND", "k", 4, "contiguous"),
    ((1, 256, 2, 4), "NHD", "k", 2, "zigzag"),
    ((2, 3, 512), "HND", "q", 4, "zigzag"),  # an LSE (B, H, N)
]
# The exchanges and permutations only move data, so any difference comes from the attention itself: XLA's CPU
# contractions may split their float64 sums differently for H/R heads than for H (how a dot is cut over threads
# depends on its sizes). Seen here: O and the LSE bit for bit, the gradients within 3e-16 of the largest (bit for bit
# with 2 devices). A misplaced row, head or chunk would differ by O(1). Relative to each array's largest entry.
RTOL = 1e-12


# --------------------------------------------------------------------------------------------------
# the subprocess (this file run as a script)
# --------------------------------------------------------------------------------------------------


def _exact(q, k, v, *, causal=False, sm_scale=None, layout="HND", config=None, window=None, return_lse=False):
    """Exact attention in the arrays' dtype: GQA, bottom-right causal, windows, HND/NHD, the LSE (B, Hq, Nq)."""
    import jax.numpy as jnp

    from sagecupy.reference.attention import visible_mask

    if layout == "NHD":
        q, k, v = (jnp.swapaxes(x, 1, 2) for x in (q, k, v))
    Hq, Nq, D = q.shape[1:]
    Hkv, Nk = k.shape[1:3]
    k, v = (jnp.repeat(x, Hq // Hkv, axis=1) for x in (k, v))
    s = jnp.einsum("bhqd,bhkd->bhqk", q, k) * (D ** -0.5 if sm_scale is None else sm_scale)
    s = jnp.where(visible_mask(Nq, Nk, causal, window), s, -jnp.inf)
    lse = jnp.max(s, axis=-1)
    lse = lse + jnp.log(jnp.sum(jnp.exp(s - lse[..., None]), axis=-1))
    o = jnp.einsum("bhqk,bhkd->bhqd", jnp.exp(s - lse[..., None]), v)
    if layout == "NHD":
        o = jnp.swapaxes(o, 1, 2)
    return (o, lse) if return_lse else o


def _report(name, ok, **detail):
    print(json.dumps({"name": name, "ok": bool(ok), **detail}), flush=True)


def _main():
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4").strip()
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax

    jax.config.update("jax_enable_x64", True)
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from sagecupy import jax as sj
    from sagecupy.reference import context_parallel as ref

    try:
        shard_map = jax.shard_map
    except AttributeError:  # JAX before 0.7
        from jax.experimental.shard_map import shard_map
    devices = jax.devices("cpu")
    _report("devices", len(devices) >= 4, count=len(devices))

    def mesh_of(R):
        return Mesh(np.array(devices[:R]), ("cp",))

    def spec(layout):
        return P(None, None, "cp", None) if layout == "HND" else P(None, "cp", None, None)

    def sharded(mesh, layout, **kw):
        def body(q, k, v):
            return sj.context_parallel_attention(q, k, v, "cp", return_lse=True, attention=_exact, layout=layout,
                                                 **kw)

        return jax.jit(shard_map(body, mesh=mesh, in_specs=(spec(layout),) * 3,
                                 out_specs=(spec(layout), P(None, None, "cp"))))

    for name, (B, Hq, Hkv, Nq, Nk, D, R, plan, causal, window, layout) in CASES.items():
        rng = np.random.default_rng(len(name))

        def draw(h, n):
            return jnp.asarray(rng.standard_normal((B, h, n, D) if layout == "HND" else (B, n, h, D)))

        q, k, v, do = draw(Hq, Nq), draw(Hkv, Nk), draw(Hkv, Nk), draw(Hq, Nq)
        kw = dict(causal=causal, window=window, plan=plan)
        mesh = mesh_of(R)
        put = NamedSharding(mesh, spec(layout))

        def shard(x, which):
            return jax.device_put(sj.shard_sequence(x, R, which=which, plan=plan, layout=layout), put)

        def unshard(x, which, lay=layout):
            return sj.unshard_sequence(x, R, which=which, plan=plan, layout=lay)

        (o_s, lse_s), pull = jax.vjp(sharded(mesh, layout, **kw), shard(q, "q"), shard(k, "k"), shard(v, "k"))
        grads_s = pull((shard(do, "q"), jnp.zeros_like(lse_s)))
        single = jax.jit(lambda q, k, v: _exact(q, k, v, causal=causal, window=window, layout=layout,
                                                return_lse=True))
        (o, lse), pull1 = jax.vjp(single, q, k, v)
        grads = pull1((do, jnp.zeros_like(lse)))
        got_o, got_lse = unshard(o_s, "q"), unshard(lse_s, "q", "HND")
        got_g = [unshard(g, w) for g, w in zip(grads_s, "qkk")]
        for kind, pairs in (("forward", ((got_o, o), (got_lse, lse))), ("grad", tuple(zip(got_g, grads)))):
            rel = [float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b))) for a, b in pairs]
            _report(f"{kind}/{name}", all(a.shape == b.shape for a, b in pairs) and max(rel) <= RTOL,
                    max_rel_diff=rel, bitwise=[bool(jnp.array_equal(a, b)) for a, b in pairs])

    # A sequence sharded over two mesh axes at once: axis_name is their tuple, in the PartitionSpec's order.
    mesh2 = Mesh(np.array(devices[:4]).reshape(2, 2), ("a", "b"))
    spec2 = P(None, None, ("a", "b"), None)
    rng = np.random.default_rng(5)
    q, k, v = (jnp.asarray(rng.standard_normal((1, h, 512, 64))) for h in (8, 4, 4))
    f = jax.jit(shard_map(lambda q, k, v: sj.context_parallel_attention(q, k, v, ("a", "b"), causal=True,
                                                                       attention=_exact),
                          mesh=mesh2, in_specs=(spec2,) * 3, out_specs=spec2))
    xs = [jax.device_put(sj.shard_sequence(x, 4, which=w), NamedSharding(mesh2, spec2))
          for x, w in zip((q, k, v), "qkk")]
    o, want = sj.unshard_sequence(f(*xs), 4), _exact(q, k, v, causal=True)
    rel = float(jnp.max(jnp.abs(o - want)) / jnp.max(jnp.abs(want)))
    _report("forward/tuple-axes", rel <= RTOL, max_rel_diff=rel)

    for i, (shape, layout, which, R, plan) in enumerate(ROUND_TRIPS):
        x = jnp.asarray(np.random.default_rng(i).standard_normal(shape))
        kw = dict(which=which, plan=plan, layout=layout)
        xs = sj.shard_sequence(x, R, **kw)
        back = sj.unshard_sequence(xs, R, **kw)
        # device r's slice of the plan-ordered array must be its plan shard
        axis = 2 if layout == "HND" else 1
        N = shape[axis]
        p = (ref.zigzag_plan if plan == "zigzag" else ref.contiguous_plan)(N, N, R, align_q=64, align_k=128)
        pos = [p.q_positions(r) if which == "q" else p.k_positions(r) for r in range(R)]
        slices = np.split(np.asarray(xs), R, axis=axis)
        shards_ok = all(np.array_equal(s, np.take(np.asarray(x), idx, axis=axis)) for s, idx in zip(slices, pos))
        # the permutation's vjp is the inverse permutation
        g = jnp.asarray(np.random.default_rng(100 + i).standard_normal(xs.shape))
        vjp_ok = bool(jnp.array_equal(jax.vjp(lambda y: sj.shard_sequence(y, R, **kw), x)[1](g)[0],
                                      sj.unshard_sequence(g, R, **kw)))
        _report(f"roundtrip/{i}", bool(jnp.array_equal(back, x)) and shards_ok and vjp_ok, shards=shards_ok,
                vjp=vjp_ok, permuted=not bool(jnp.array_equal(xs, x)))

    # Argument errors that need a mesh axis of several devices.
    def error_of(fn):
        try:
            fn()
        except (ValueError, TypeError) as exc:
            return f"{type(exc).__name__}: {exc}"
        return "no error"

    mesh = mesh_of(4)
    spec_h = spec("HND")

    def under_mesh(Hq, Hkv, n, **kw):
        f = shard_map(lambda q, k, v: sj.context_parallel_attention(q, k, v, "cp", attention=_exact, **kw),
                      mesh=mesh, in_specs=(spec_h,) * 3, out_specs=spec_h)
        q = jax.ShapeDtypeStruct((1, Hq, 4 * n, 64), jnp.float32)
        kv = jax.ShapeDtypeStruct((1, Hkv, 4 * n, 64), jnp.float32)
        return lambda: jax.eval_shape(f, q, kv, kv)

    _report("error/hkv", True, message=error_of(under_mesh(8, 2, 128)))
    _report("error/hq", True, message=error_of(under_mesh(6, 6, 128)))
    _report("error/uneven", True, message=error_of(under_mesh(8, 4, 96)))
    _report("error/axis", True, message=error_of(lambda: jax.eval_shape(shard_map(
        lambda q: sj.context_parallel_attention(q, q, q, "sp", attention=_exact), mesh=mesh, in_specs=spec_h,
        out_specs=spec_h), jax.ShapeDtypeStruct((1, 8, 512, 64), jnp.float32))))
    _report("error/plan-ranks", True, message=error_of(under_mesh(8, 4, 128, plan=ref.zigzag_plan(
        512, 512, 2, align_q=64, align_k=128))))

    # The default attention (the INT8 kernels' buffer callbacks) traces, forward and backward, under a shard_map
    # without the varying-axes check (nothing runs: eval_shape), and is refused, by name, with it.
    def default_attention(**kw):
        body = lambda q, k, v: sj.context_parallel_attention(q, k, v, "cp", causal=True)  # noqa: E731
        f = shard_map(body, mesh=mesh, in_specs=(spec_h,) * 3, out_specs=spec_h, **kw)
        x = jax.ShapeDtypeStruct((1, 8, 512, 64), jnp.float16)
        loss = lambda q, k, v: jnp.sum(f(q, k, v).astype(jnp.float32))  # noqa: E731
        return jax.eval_shape(jax.value_and_grad(loss, argnums=(0, 1, 2)), x, x, x)

    if "check_vma" in inspect.signature(shard_map).parameters:
        _, grads = default_attention(check_vma=False)
        _report("trace/default-attention", [g.shape for g in grads] == [(1, 8, 512, 64)] * 3,
                dtypes=[str(g.dtype) for g in grads])
        _report("error/check-vma", True, message=error_of(default_attention))
    else:  # JAX before 0.7: check_rep, and no varying-axes types to refuse
        _report("trace/default-attention", True, skipped="this shard_map has no check_vma")
        _report("error/check-vma", True, skipped="this shard_map has no check_vma")


# --------------------------------------------------------------------------------------------------
# the tests
# --------------------------------------------------------------------------------------------------

if __name__ == "__main__":
    sys.path.insert(0, ROOT)
    _main()
    sys.exit(0)

jax = pytest.importorskip("jax")


@pytest.fixture(scope="module")
def results():
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([ROOT] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    run = subprocess.run([sys.executable, os.path.abspath(__file__)], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=600)
    lines = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    if run.returncode:
        pytest.fail(f"the mesh checks failed to run (rc {run.returncode}):\n{run.stderr[-4000:]}", pytrace=False)
    out = {r.pop("name"): r for r in lines}
    if not out.get("devices", {}).get("ok"):
        pytest.fail(f"the subprocess did not get 4 CPU devices: {out.get('devices')}", pytrace=False)
    return out


def _check(results, name):
    assert name in results, f"{name}: not reported by the subprocess"
    r = results[name]
    assert r["ok"], f"{name}: {r}"
    return r


@pytest.mark.parametrize("case", list(CASES))
def test_forward_equals_single_call(results, case):
    """O and the LSE, unsharded, are the single call's (RTOL): each head's whole sequence reaches one device in true
    order, and the attention of a head does not depend on the other heads."""
    _check(results, f"forward/{case}")


def test_sequence_over_two_mesh_axes(results):
    _check(results, "forward/tuple-axes")


@pytest.mark.parametrize("case", list(CASES))
def test_gradients_equal_single_call(results, case):
    _check(results, f"grad/{case}")


def test_default_attention_traces_under_shard_map(results):
    """sagecupy.jax.sage_attention inside the exchanges: shapes and dtypes of the gradients, traced on the CPU (the
    kernels themselves run in tests/gpu/test_jax_cp.py)."""
    r = _check(results, "trace/default-attention")
    if "skipped" in r:
        pytest.skip(r["skipped"])
    assert r["dtypes"] == ["float16"] * 3, r


@pytest.mark.parametrize("i", range(len(ROUND_TRIPS)))
def test_shard_unshard_round_trip(results, i):
    r = _check(results, f"roundtrip/{i}")
    assert r["permuted"] or ROUND_TRIPS[i][4] == "contiguous"


@pytest.mark.parametrize("name,words", [
    ("error/hkv", ["ValueError", "Hkv=2", "4 devices"]),
    ("error/hq", ["ValueError", "Hq=6"]),
    ("error/uneven", ["ValueError", "equal slice"]),
    ("error/axis", ["ValueError", "axis_name='sp'"]),
    ("error/plan-ranks", ["ValueError", "plan is for 2 devices"]),
    ("error/check-vma", ["ValueError", "check_vma=False", "vary over cp"]),
])
def test_errors_on_a_mesh(results, name, words):
    if "skipped" in results[name]:
        pytest.skip(results[name]["skipped"])
    message = results[name]["message"]
    assert all(w in message for w in words), message


# --------------------------------------------------------------------------------------------------
# argument errors without a mesh (in this process)
# --------------------------------------------------------------------------------------------------


def _arrays(layout="HND", Hq=4, Hkv=2, n=128):
    import jax.numpy as jnp

    shape = (lambda h: (1, h, n, 64)) if layout == "HND" else (lambda h: (1, n, h, 64))
    return jnp.zeros(shape(Hq), jnp.float32), jnp.zeros(shape(Hkv), jnp.float32), jnp.zeros(shape(Hkv), jnp.float32)


@pytest.mark.parametrize("kwargs,exc,words", [
    (dict(mode="ring"), ValueError, ["mode='ring'", "sagecupy.torch.context_parallel_attention",
                                     "sagecupy.context_parallel.ring_attention"]),
    (dict(layout="BHND"), ValueError, ["layout='BHND'"]),
    (dict(causal="yes"), TypeError, ["causal"]),
    (dict(window=(1,)), ValueError, ["window"]),
    (dict(causal=True, window=(8, 8)), ValueError, ["causal", "window"]),
    (dict(return_lse=1), TypeError, ["return_lse"]),
    (dict(attention="sage"), TypeError, ["attention"]),
])
def test_option_errors(kwargs, exc, words):
    from sagecupy.adapters.jax_cp import context_parallel_attention

    q, k, v = _arrays()
    with pytest.raises(exc) as info:
        context_parallel_attention(q, k, v, "cp", attention=kwargs.pop("attention", _exact), **kwargs)
    assert all(w in str(info.value) for w in words), str(info.value)


def test_shape_errors_and_outside_shard_map():
    from sagecupy.adapters.jax_cp import context_parallel_attention

    q, k, v = _arrays()
    with pytest.raises(ValueError, match="v must have k's shape"):
        context_parallel_attention(q, k, q, "cp", attention=_exact)
    with pytest.raises(ValueError, match="Hq a multiple of Hkv"):
        context_parallel_attention(q[:, :3], k, v, "cp", attention=_exact)
    with pytest.raises(ValueError, match="4-D"):
        context_parallel_attention(q[0], k, v, "cp", attention=_exact)
    with pytest.raises(ValueError, match="inside jax.shard_map"):
        context_parallel_attention(q, k, v, "cp", attention=_exact)


def test_shard_sequence_errors():
    import jax.numpy as jnp

    from sagecupy.adapters.jax_cp import shard_sequence, unshard_sequence
    from sagecupy.reference.context_parallel import zigzag_plan

    x = jnp.zeros((1, 2, 384, 8))
    with pytest.raises(ValueError, match=r"\[128, 256\] positions.*equal slice"):
        shard_sequence(x, 2, which="k")  # 3 key tiles of 128 over 4 zigzag chunks
    with pytest.raises(ValueError, match="which='v'"):
        shard_sequence(x, 2, which="v")
    with pytest.raises(ValueError, match="plan='ring'"):
        unshard_sequence(x, 2, plan="ring")
    with pytest.raises(TypeError, match="plan must be"):
        shard_sequence(x, 2, plan=3)
    with pytest.raises(ValueError, match="R=0"):
        shard_sequence(x, 0)
    with pytest.raises(ValueError, match="layout='THD'"):
        shard_sequence(x, 2, layout="THD")
    with pytest.raises(ValueError, match="the plan's queries 512"):
        shard_sequence(x, 2, plan=zigzag_plan(512, 512, 2, align_q=64, align_k=128))
    with pytest.raises(ValueError, match="no sequence axis"):
        shard_sequence(jnp.zeros((2, 3)), 2)
