"""The JAX adapter (sagecupy.jax) against direct calls of the CuPy API, eagerly and under jax.jit.

The adapter adds no numerics: it must give what ``sagecupy.int8.forward`` / ``backward`` give on the same
inputs, bit for bit, with or without a sliding window, dense or packed (``layout="THD"``, the offsets traced):
neither the INT8 nor the QAT backward uses atomics, so all three gradients are deterministic and compared bitwise.

Needs JAX with its CUDA plugin (skipped, with the reason, without it; ``--require-gpu`` makes a JAX that is
installed but cannot run the adapter a failure). JAX takes 75% of the GPU at start-up unless told not to,
and CuPy needs that memory: this module sets ``XLA_PYTHON_CLIENT_PREALLOCATE=false`` before JAX initializes
its GPU backend (a test run that used JAX on the GPU before collecting this module must set it itself).
"""
import functools
import os
import sys

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import numpy as np  # noqa: E402
import pytest  # noqa: E402

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

import sagecupy.int8 as s8  # noqa: E402
import sagecupy.jax as sj  # noqa: E402
from sagecupy import _checks  # noqa: E402

from draws import qkv_do  # noqa: E402

pytestmark = pytest.mark.gpu



@pytest.fixture(scope="module", autouse=True)
def _adapter_usable(request):
    ok, why = sj.is_available()
    if ok:
        return
    if request.config.getoption("--require-gpu"):
        pytest.fail(f"--require-gpu given but JAX is installed and cannot run the adapter: {why}", pytrace=False)
    pytest.skip(why)


# --------------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------------


def _inputs(seed, B, Hq, Hkv, Nq, Nk, D, layout, dtype):
    """q, k, v, do as JAX arrays (draws.qkv_do: K with a common offset, so that K-smoothing matters)."""
    jt = jnp.float16 if dtype == "float16" else jnp.bfloat16
    return tuple(jnp.asarray(x.astype(np.float32), dtype=jt) for x in qkv_do(seed, B, Hq, Hkv, Nq, Nk, D, layout))


def _to_cupy(x):
    """The same bits as a CuPy array (BF16Array for bfloat16), through the host: the direct path shares
    nothing with the adapter's zero-copy import."""
    import cupy

    from sagecupy.adapters.bf16 import BF16Array

    h = np.asarray(x)
    if x.dtype == jnp.bfloat16:
        return BF16Array(cupy.asarray(h.view(np.uint16)))
    return cupy.asarray(h)


def _bits(x):
    """uint16 bit patterns on the host of a JAX array or a sagecupy output (fp16 or bf16)."""
    if isinstance(x, jax.Array):
        return np.asarray(x).view(np.uint16)
    return _checks.raw(x).get().view(np.uint16)


def _assert_bitwise(name, got, want, case):
    g, w = _bits(got), _bits(want)
    assert g.shape == w.shape, f"{name}: shape {g.shape} != {w.shape} {case}"
    diff = np.flatnonzero(g != w)
    assert diff.size == 0, (f"{name}: {diff.size} of {g.size} elements differ bitwise {case}; first at "
                            f"{np.unravel_index(diff[0], g.shape)}: {g.flat[diff[0]]:#06x} vs {w.flat[diff[0]]:#06x}")


def _assert_grads(got, want, case):
    """dQ, dK, dV bitwise."""
    for i, name in enumerate(("dQ", "dK", "dV")):
        _assert_bitwise(name, got[i], want[i], case)


def _direct(q, k, v, do, **kw):
    """o and (dq, dk, dv) of sagecupy.int8.forward / backward on the same inputs."""
    o, res = s8.forward(*(_to_cupy(x) for x in (q, k, v)), **kw)
    return o, s8.backward(res, _to_cupy(do))


def _vjp(f):
    """(q, k, v, do) -> (o, (dq, dk, dv)) through jax.vjp."""
    def run(q, k, v, do):
        o, pullback = jax.vjp(f, q, k, v)
        return o, pullback(do)

    return run


# --------------------------------------------------------------------------------------------------
# INT8 SageBwd
# --------------------------------------------------------------------------------------------------

CASES = [
    # B, Hq, Hkv, Nq, Nk, D, causal, layout, dtype, config
    (1, 2, 2, 128, 64, 128, False, "HND", "float16", "default"),   # Nk <= 64: dQ deterministic
    (1, 4, 2, 100, 37, 64, True, "HND", "bfloat16", "default"),    # GQA, causal with rows that see no key
    (2, 4, 1, 113, 239, 64, True, "NHD", "float16", "paper"),      # MQA, NHD, Nq != Nk, paper config
    (1, 4, 2, 256, 256, 128, True, "HND", "bfloat16", "default"),  # GQA, bf16, several key blocks
    (1, 2, 2, 300, 1000, 64, False, "HND", "float16", "default"),
]
IDS = [f"{c[3]}x{c[4]}-d{c[5]}-{'causal' if c[6] else 'full'}-{c[7]}-{c[8]}-{c[9]}-gqa{c[1] // c[2]}" for c in CASES]


@pytest.mark.parametrize("mode", ["eager", "jit"])
@pytest.mark.parametrize("B,Hq,Hkv,Nq,Nk,D,causal,layout,dtype,config", CASES, ids=IDS)
def test_adapter_equals_direct_calls(B, Hq, Hkv, Nq, Nk, D, causal, layout, dtype, config, mode):
    case = dict(B=B, Hq=Hq, Hkv=Hkv, Nq=Nq, Nk=Nk, D=D, causal=causal, layout=layout, dtype=dtype, config=config,
                mode=mode)
    q, k, v, do = _inputs(0, B, Hq, Hkv, Nq, Nk, D, layout, dtype)
    f = functools.partial(sj.sage_attention, causal=causal, layout=layout, config=config)
    run = _vjp(f) if mode == "eager" else jax.jit(_vjp(f))
    o, grads = run(q, k, v, do)
    assert o.dtype == q.dtype and all(g.dtype == q.dtype for g in grads)
    o_d, grads_d = _direct(q, k, v, do, causal=causal, layout=layout, config=config)
    _assert_bitwise("O", o, o_d, case)
    _assert_grads(grads, grads_d, case)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_forward_in_jit_equals_eager_and_direct(dtype):
    q, k, v, _ = _inputs(1, 1, 4, 2, 200, 150, 128, "HND", dtype)
    f = functools.partial(sj.sage_attention, causal=True)
    o_jit, o_eager = jax.jit(f)(q, k, v), f(q, k, v)
    o_direct = s8.sage_attention(*(_to_cupy(x) for x in (q, k, v)), causal=True)
    _assert_bitwise("O (jit vs eager)", o_jit, o_eager, dtype)
    _assert_bitwise("O (jit vs direct)", o_jit, o_direct, dtype)


def test_plain_call_runs_the_inference_forward(monkeypatch):
    """Outside a vjp the forward callback runs the inference forward (no residuals: int8._inference), inside one the
    training forward (int8._training); both write O into XLA's buffer."""
    q, k, v, do = _inputs(4, 1, 2, 2, 70, 90, 64, "HND", "bfloat16")
    calls = []

    def spy(name, real):
        def wrapped(*a, **kw):
            calls.append(name)
            return real(*a, **kw)

        return wrapped

    monkeypatch.setattr(s8, "_inference", spy("sage_attention", s8._inference))
    monkeypatch.setattr(s8, "_training", spy("forward", s8._training))
    f = functools.partial(sj.sage_attention, causal=True)
    o_plain = jax.jit(f)(q, k, v).block_until_ready()
    assert calls == ["sage_attention"]
    o_vjp, _ = _vjp(f)(q, k, v, do)
    assert calls[1:] == ["forward"]
    _assert_bitwise("O (plain vs vjp)", o_plain, o_vjp, "bfloat16")


def _spy_on_replays(monkeypatch, name):
    """Record, per call of int8's ``name`` (the forward callback's entry point), whether it replayed a plan on
    addresses; the callbacks' caches are cleared first, so that no plan from an earlier test is kept."""
    calls = []
    real = getattr(s8, name)

    def spy(q, k, v, plan=None, **kw):
        calls.append(plan is not None and all(type(x) is int for x in (q, k, v)))
        return real(q, k, v, plan, **kw)

    monkeypatch.setattr(s8, name, spy)
    sj._int8_forward_callback.cache_clear()
    sj._int8_op.cache_clear()
    return calls


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_inference_replays_its_plan_on_new_buffers(monkeypatch, dtype):
    """The inference callback records its plan on the first call and replays it on the buffers' addresses after
    (int8._inference given ints and the plan); every call's O and LSE are bitwise the direct call's on its own
    data."""
    calls = _spy_on_replays(monkeypatch, "_inference")
    f = jax.jit(functools.partial(sj.sage_attention, causal=True, return_lse=True))
    for seed in (0, 1, 2):
        q, k, v, _ = _inputs(seed, 2, 4, 2, 190, 210, 128, "HND", dtype)
        o, lse = f(q, k, v)
        o_d, lse_d = s8.sage_attention(*(_to_cupy(x) for x in (q, k, v)), causal=True, return_lse=True)
        _assert_bitwise("O", o, o_d, dict(seed=seed, dtype=dtype))
        np.testing.assert_array_equal(np.asarray(lse), lse_d.get())
    assert calls == [False, True, True], calls


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_training_forward_replays_its_plan_on_new_buffers(monkeypatch, dtype):
    """Inside a vjp the forward callback records its plan on the first call and replays it on the buffers'
    addresses after (int8._training given ints and the plan); O and the gradients stay bitwise the direct calls' on
    each call's own data."""
    calls = _spy_on_replays(monkeypatch, "_training")
    run = jax.jit(_vjp(functools.partial(sj.sage_attention, causal=True)))
    for seed in (3, 4, 5):
        q, k, v, do = _inputs(seed, 2, 4, 2, 190, 210, 128, "HND", dtype)
        o, grads = run(q, k, v, do)
        o_d, grads_d = _direct(q, k, v, do, causal=True)
        case = dict(seed=seed, dtype=dtype)
        _assert_bitwise("O", o, o_d, case)
        _assert_grads(grads, grads_d, case)
    assert calls == [False, True, True], calls


@pytest.mark.parametrize("dtype,Nk", [("float16", 64), ("bfloat16", 50), ("float16", 300)])
def test_jit_grad_equals_eager_grad(dtype, Nk):
    q, k, v, _ = _inputs(2, 2, 4, 2, 96, Nk, 64, "NHD", dtype)
    w = jnp.asarray(np.random.default_rng(3).standard_normal(q.shape), jnp.float32)

    def loss(q, k, v):
        o = sj.sage_attention(q, k, v, causal=True, layout="NHD")
        return jnp.sum(o.astype(jnp.float32) * w)

    grad = jax.grad(loss, argnums=(0, 1, 2))
    eager, jitted = grad(q, k, v), jax.jit(grad)(q, k, v)
    _assert_grads(jitted, eager, dict(dtype=dtype, Nk=Nk))


def test_kernels_run_on_xla_stream(monkeypatch):
    """Every kernel launch of the forward and the backward happens with XLA's stream (the one the
    callback's ExecutionContext reports) as CuPy's current stream."""
    import cupy

    seen = {"xla": [], "fwd": [], "bwd": []}
    real_ptr, real_fwd, real_bwd = sj._stream_ptr, s8._training, s8._backward_into

    def spy_ptr(ctx):
        seen["xla"].append(real_ptr(ctx))
        return seen["xla"][-1]

    def spy(kind, fn):
        def wrapped(*a, **kw):
            seen[kind].append(cupy.cuda.get_current_stream().ptr)
            return fn(*a, **kw)

        return wrapped

    monkeypatch.setattr(sj, "_stream_ptr", spy_ptr)
    monkeypatch.setattr(s8, "_training", spy("fwd", real_fwd))  # the adapter's entry points into int8
    monkeypatch.setattr(s8, "_backward_into", spy("bwd", real_bwd))
    q, k, v, do = _inputs(4, 1, 2, 2, 130, 70, 64, "HND", "float16")
    o, grads = jax.jit(_vjp(sj.sage_attention))(q, k, v, do)
    jax.block_until_ready((o, grads))
    assert len(seen["xla"]) == 2 and len(seen["fwd"]) == 1 and len(seen["bwd"]) == 1, seen
    assert all(p != 0 for p in seen["xla"]), f"XLA reported the legacy default stream: {seen}"
    assert seen["fwd"] + seen["bwd"] == seen["xla"], f"kernels ran on another stream than XLA's: {seen}"


def test_ordered_between_xla_producer_and_consumer():
    """Inside one jit, q, k, v come out of a long XLA computation right before the op and o goes into an
    XLA op right after. Run on another stream, the kernels would read q, k, v before they are written, or
    XLA would read o before the copy into its buffer; either gives another result than the op run on the
    settled inputs."""
    n, shape = 2048, (1, 8, 512, 64)  # 512 x 512 elements per tensor
    x = jax.random.normal(jax.random.key(0), (n, n), jnp.float32) / np.sqrt(n)

    @jax.jit
    def fused(x):
        y = jax.lax.fori_loop(0, 40, lambda i, y: jnp.tanh(y @ x) * 2.0, x)  # tens of ms of matmuls
        q, k, v = (y[512 * i:512 * (i + 1), :512].reshape(shape).astype(jnp.float16) for i in range(3))
        return (q, k, v), sj.sage_attention(q, k, v).astype(jnp.float32) * 2.0

    for _ in range(3):
        (q, k, v), got = fused(x)
        want = sj.sage_attention(q, k, v).astype(jnp.float32) * 2.0
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_errors_at_trace_time():
    q, k, v, _ = _inputs(5, 1, 2, 2, 16, 16, 64, "HND", "float16")
    with pytest.raises(ValueError, match="head_dim=48"):
        sj.sage_attention(q[..., :48], k[..., :48], v[..., :48])
    with pytest.raises(TypeError, match="dtype"):
        sj.sage_attention(q.astype(jnp.float32), k, v)
    with pytest.raises(ValueError, match="config"):
        sj.sage_attention(q, k, v, config="nope")
    with pytest.raises(ValueError, match="q_smoothing"):
        sj.sage_attention(q, k, v, config=s8.get_config("default").replace(q_smoothing=True))
    with pytest.raises(ValueError, match="layout"):
        jax.jit(functools.partial(sj.sage_attention, layout="BHSD"))(q, k, v)


def test_missing_buffer_callback_is_one_clear_error(monkeypatch):
    """A JAX without jax.experimental.buffer_callback (simulated) gets one error that says what to do."""
    q, k, v, _ = _inputs(6, 1, 2, 2, 16, 16, 64, "HND", "float16")
    monkeypatch.setitem(sys.modules, "jax.experimental.buffer_callback", None)
    with pytest.raises(RuntimeError, match=r"buffer_callback.*JAX 0\.7 or newer"):
        sj.sage_attention(q, k, v)
    assert not sj.is_available()[0]


# --------------------------------------------------------------------------------------------------
# the sliding window
# --------------------------------------------------------------------------------------------------

WINDOW_CASES = [
    # B, Hq, Hkv, Nq, Nk, D, causal, layout, dtype, window
    (B, Hq, Hkv, Nq, Nk, D, causal, layout, dtype, window)
    for B, Hq, Hkv, Nq, Nk, D, causal, layout in ((1, 4, 2, 200, 333, 64, False, "HND"),
                                                  (2, 2, 1, 300, 130, 128, False, "NHD"),
                                                  (1, 2, 2, 150, 260, 64, True, "HND"))
    for window in ((64, 0), (17, 5)) if not (causal and window[1])
    for dtype in ("float16", "bfloat16")
]
WINDOW_IDS = [f"{c[3]}x{c[4]}-d{c[5]}-{'causal' if c[6] else 'full'}-{c[7]}-{c[8]}-w{c[9][0]}_{c[9][1]}"
              for c in WINDOW_CASES]


@pytest.mark.parametrize("mode", ["eager", "jit"])
@pytest.mark.parametrize("B,Hq,Hkv,Nq,Nk,D,causal,layout,dtype,window", WINDOW_CASES, ids=WINDOW_IDS)
def test_window_equals_direct_calls(B, Hq, Hkv, Nq, Nk, D, causal, layout, dtype, window, mode):
    """O and the three gradients through jax.vjp with a window, bitwise sagecupy.int8.forward / backward with the
    same window; the plain call (the inference forward) bitwise int8.sage_attention's."""
    case = dict(shape=(B, Hq, Hkv, Nq, Nk, D), causal=causal, layout=layout, dtype=dtype, window=window, mode=mode)
    q, k, v, do = _inputs(8, B, Hq, Hkv, Nq, Nk, D, layout, dtype)
    f = functools.partial(sj.sage_attention, causal=causal, layout=layout, window=window)
    run = _vjp(f) if mode == "eager" else jax.jit(_vjp(f))
    o, grads = run(q, k, v, do)
    o_d, grads_d = _direct(q, k, v, do, causal=causal, layout=layout, window=window)
    _assert_bitwise("O", o, o_d, case)
    _assert_grads(grads, grads_d, case)
    plain = f(q, k, v) if mode == "eager" else jax.jit(f)(q, k, v)
    infer = s8.sage_attention(*(_to_cupy(x) for x in (q, k, v)), causal=causal, layout=layout, window=window)
    _assert_bitwise("O (plain call)", plain, infer, case)
    # the window is in effect: without it the output differs
    assert not np.array_equal(_bits(o), _bits(sj.sage_attention(q, k, v, causal=causal, layout=layout)))


def test_window_errors_at_trace_time():
    q, k, v, _ = _inputs(9, 1, 2, 2, 16, 16, 64, "HND", "float16")
    with pytest.raises(ValueError, match="window"):
        sj.sage_attention(q, k, v, window=(-2, 0))
    with pytest.raises(ValueError, match=r"causal=True contradicts window=\(3, 1\)"):
        jax.jit(functools.partial(sj.sage_attention, causal=True, window=(3, 1)))(q, k, v)


# --------------------------------------------------------------------------------------------------
# packed variable-length sequences (layout="THD")
# --------------------------------------------------------------------------------------------------

PACKED_LENS = {"17-0-300": [(17, 17), (0, 0), (300, 300)], "128-129": [(128, 128), (129, 129)],
               "unequal": [(40, 70), (0, 5), (9, 0), (200, 64)]}
# lens, Hq, Hkv, D, causal, window, dtype
PACKED_CASES = [(lens, Hq, Hkv, D, causal, window, dtype)
                for lens, Hq, Hkv, D, causal, window in (("17-0-300", 4, 2, 64, True, None),
                                                         ("128-129", 4, 2, 128, False, (17, 5)),
                                                         ("unequal", 4, 1, 64, True, (40, 0)),
                                                         ("128-129", 2, 2, 64, False, None))
                for dtype in ("float16", "bfloat16")]
PACKED_IDS = [f"{c[0]}-d{c[3]}-gqa{c[1] // c[2]}-{'causal' if c[4] else 'full'}"
              f"{'' if c[5] is None else f'-w{c[5][0]}_{c[5][1]}'}-{c[6]}" for c in PACKED_CASES]


def _packed_inputs(seed, lens, Hq, Hkv, D, dtype):
    """q, k, v, do as packed JAX arrays (each document's K with a mean of its own) and the int32 offsets."""
    rng = np.random.default_rng(seed)
    cq = np.concatenate([[0], np.cumsum([a for a, _ in lens])]).astype(np.int32)
    ck = np.concatenate([[0], np.cumsum([b for _, b in lens])]).astype(np.int32)
    q, do = rng.standard_normal((cq[-1], Hq, D)), rng.standard_normal((cq[-1], Hq, D))
    k, v = rng.standard_normal((ck[-1], Hkv, D)), rng.standard_normal((ck[-1], Hkv, D))
    for s in range(len(lens)):
        k[ck[s]:ck[s + 1]] += 0.5 * rng.standard_normal((1, 1, D))
    jt = jnp.float16 if dtype == "float16" else jnp.bfloat16
    return tuple(jnp.asarray(x.astype(np.float32), dtype=jt) for x in (q, k, v, do)), (jnp.asarray(cq), jnp.asarray(ck))


def _packed_direct(q, k, v, do, cu_q, cu_k, **kw):
    """o, lse and (dq, dk, dv) of sagecupy.int8.forward / backward on the same values and offsets."""
    import cupy

    offsets = dict(cu_seqlens_q=cupy.asarray(np.asarray(cu_q)), cu_seqlens_k=cupy.asarray(np.asarray(cu_k)))
    o, lse, res = s8.forward(*(_to_cupy(x) for x in (q, k, v)), layout="THD", return_lse=True, **offsets, **kw)
    return o, lse, s8.backward(res, _to_cupy(do))


@pytest.mark.parametrize("mode", ["eager", "jit"])
@pytest.mark.parametrize("lens,Hq,Hkv,D,causal,window,dtype", PACKED_CASES, ids=PACKED_IDS)
def test_packed_equals_direct_calls(lens, Hq, Hkv, D, causal, window, dtype, mode):
    """O, the LSE (return_lse) and the three gradients through jax.vjp of a packed call (the offsets traced like
    q, k, v), bitwise sagecupy.int8.forward / backward on the same offsets; the plain call (the inference forward)
    bitwise int8.sage_attention's."""
    case = dict(lens=lens, Hq=Hq, Hkv=Hkv, D=D, causal=causal, window=window, dtype=dtype, mode=mode)
    (q, k, v, do), (cu_q, cu_k) = _packed_inputs(12, PACKED_LENS[lens], Hq, Hkv, D, dtype)
    longest = max(a for a, _ in PACKED_LENS[lens])

    def f(q, k, v, cu_q, cu_k):
        return sj.sage_attention(q, k, v, layout="THD", cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=longest,
                                 causal=causal, window=window, return_lse=True)

    def run(q, k, v, do, cu_q, cu_k):
        (o, lse), pullback = jax.vjp(lambda q, k, v: f(q, k, v, cu_q, cu_k), q, k, v)
        return o, lse, pullback((do, jnp.zeros_like(lse)))

    run = run if mode == "eager" else jax.jit(run)
    o, lse, grads = run(q, k, v, do, cu_q, cu_k)
    o_d, lse_d, grads_d = _packed_direct(q, k, v, do, cu_q, cu_k, causal=causal, window=window)
    _assert_bitwise("O", o, o_d, case)
    assert lse.shape == (Hq, q.shape[0]) and lse.dtype == jnp.float32
    assert np.array_equal(np.asarray(lse), lse_d.get(), equal_nan=True), f"LSE differs {case}"
    _assert_grads(grads, grads_d, case)
    plain, plain_lse = f(q, k, v, cu_q, cu_k) if mode == "eager" else jax.jit(f)(q, k, v, cu_q, cu_k)
    import cupy

    infer, infer_lse = s8.sage_attention(*(_to_cupy(x) for x in (q, k, v)), layout="THD", causal=causal,
                                         window=window, return_lse=True, cu_seqlens_q=cupy.asarray(np.asarray(cu_q)),
                                         cu_seqlens_k=cupy.asarray(np.asarray(cu_k)))
    _assert_bitwise("O (plain call)", plain, infer, case)
    assert np.array_equal(np.asarray(plain_lse), infer_lse.get(), equal_nan=True), f"LSE (plain call) {case}"


def test_packed_jit_grad_other_documents_same_program():
    """One jitted gradient function over offsets of the same length: other document boundaries are other values of
    a traced argument (no retrace), and each gives the direct calls' gradients."""
    lens_sets = ([(100, 100), (157, 157)], [(128, 128), (129, 129)], [(1, 1), (256, 256)])
    (q, k, v, _), _ = _packed_inputs(13, lens_sets[0], 4, 2, 64, "bfloat16")
    w = jnp.asarray(np.random.default_rng(14).standard_normal(q.shape), jnp.float32)
    traces = []

    def loss(q, k, v, cu):
        traces.append(1)
        o = sj.sage_attention(q, k, v, layout="THD", cu_seqlens_q=cu, cu_seqlens_k=cu, causal=True)
        return jnp.sum(o.astype(jnp.float32) * w)

    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    for lens in lens_sets:
        cu = jnp.asarray(np.concatenate([[0], np.cumsum([a for a, _ in lens])]).astype(np.int32))
        got = grad(q, k, v, cu)
        _, _, want = _packed_direct(q, k, v, (w.astype(q.dtype)), cu, cu, causal=True)
        _assert_grads(got, want, lens)
    assert len(traces) == 1


def test_packed_errors_at_trace_time():
    (q, k, v, _), (cu_q, cu_k) = _packed_inputs(15, PACKED_LENS["unequal"], 2, 2, 64, "float16")
    with pytest.raises(TypeError, match=r"cu_seqlens_q\.dtype=float32 must be int32"):
        sj.sage_attention(q, k, v, layout="THD", cu_seqlens_q=cu_q.astype(jnp.float32), cu_seqlens_k=cu_k)
    with pytest.raises(ValueError, match="cu_seqlens_q is only for layout='THD'"):
        sj.sage_attention(q[None], q[None], q[None], layout="NHD", cu_seqlens_q=cu_q)
    with pytest.raises(ValueError, match="cu_seqlens_k is required"):
        jax.jit(functools.partial(sj.sage_attention, layout="THD"))(q, k, v, cu_seqlens_q=cu_q)
    with pytest.raises(ValueError, match="not supported by qat_attention"):
        try:
            sj.qat_attention(q, k, v, layout="THD")
        except ImportError as exc:
            pytest.skip(str(exc))


# --------------------------------------------------------------------------------------------------
# FP4 QAT
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_qat_adapter_equals_direct_calls(dtype):
    qat = pytest.importorskip("sagecupy.qat")
    if not (hasattr(qat, "forward") and hasattr(qat, "backward")):
        pytest.skip("sagecupy.qat has no forward/backward pair yet")
    q, k, v, do = _inputs(7, 1, 4, 2, 150, 64, 128, "HND", dtype)
    case = dict(dtype=dtype, family="qat")
    qc, kc, vc, doc = (_to_cupy(x) for x in (q, k, v, do))
    o_d, res = qat.forward(qc, kc, vc, causal=True)
    grads_d = qat.backward(res, doc)
    for mode, run in (("eager", _vjp(functools.partial(sj.qat_attention, causal=True))),
                      ("jit", jax.jit(_vjp(functools.partial(sj.qat_attention, causal=True))))):
        o, grads = run(q, k, v, do)
        _assert_bitwise("O", o, o_d, dict(case, mode=mode))
        _assert_grads(grads, grads_d, dict(case, mode=mode))


# --------------------------------------------------------------------------------------------------
# NVFP4 (inference)
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype,layout,causal", [("float16", "HND", True), ("bfloat16", "NHD", False)])
def test_nvfp4_adapter_equals_direct_call(dtype, layout, causal):
    """O and LSE bitwise sagecupy.nvfp4.attention's, eagerly and under jax.jit; differentiating it raises."""
    from sagecupy import nvfp4

    q, k, v, _ = _inputs(11, 1, 4, 2, 150, 200, 128, layout, dtype)
    case = dict(dtype=dtype, layout=layout, causal=causal, family="nvfp4")
    o_d, lse_d = nvfp4.attention(*(_to_cupy(x) for x in (q, k, v)), causal=causal, layout=layout, return_lse=True)
    call = functools.partial(sj.nvfp4_attention, causal=causal, layout=layout, return_lse=True)
    for mode, run in (("eager", call), ("jit", jax.jit(call))):
        o, lse = run(q, k, v)
        _assert_bitwise("O", o, o_d, dict(case, mode=mode))
        assert np.array_equal(np.asarray(lse), lse_d.get()), f"LSE differs {dict(case, mode=mode)}"
    with pytest.raises(ValueError, match="inference-only"):
        jax.grad(lambda q: sj.nvfp4_attention(q, k, v, causal=causal, layout=layout).astype(jnp.float32).sum())(q)
