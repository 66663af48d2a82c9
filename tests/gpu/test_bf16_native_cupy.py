"""bfloat16 as CuPy arrays of ``ml_dtypes.bfloat16`` (CuPy 14 with ml_dtypes) through the GPU families: the same
memory as a BF16Array gives bitwise the same outputs, in the input's form, and the inputs are left as they were.

The host paths (which kernels launch on which memory, the form of every output) are tested without a GPU in
tests/cpu/test_bf16_native.py; here the kernels run.
"""
import numpy as np
import pytest

from test_int8 import _cupy, _inputs  # noqa: E402  (the INT8 kernel tests' helpers, same folder)

pytestmark = pytest.mark.gpu


@pytest.fixture
def native():
    """ml_dtypes' bfloat16 as a NumPy dtype, where this CuPy holds arrays of it (else the test is skipped)."""
    pytest.importorskip("ml_dtypes")
    _cupy()
    from sagecupy.adapters import bf16

    dt = bf16.native_dtype()
    if dt is None:
        pytest.skip("this CuPy has no ml_dtypes.bfloat16 arrays")
    return dt


@pytest.fixture(params=["mma", "wgmma"])
def engine(request):
    if request.param == "wgmma":
        from sagecupy._loader import device_capability

        if device_capability() != (9, 0):
            pytest.skip("the wgmma kernels need compute capability 9.0")
    return request.param


def _both(native, seed=0, B=1, Hq=4, Hkv=2, Nq=200, Nk=333, D=128, layout="HND"):
    """(q, k, v, do) as BF16Arrays and as CuPy bfloat16 views of the same memory."""
    (q, k, v, do), _ = _inputs(seed, B, Hq, Hkv, Nq, Nk, D, layout, "bfloat16")
    wrapped = (q, k, v, do)
    return wrapped, tuple(x.bits.view(native) for x in wrapped)


def _host_bits(x):
    """Host uint16 bits of a bf16 output (either form)."""
    from sagecupy.adapters import bf16

    return bf16.bits_of(x).get()


def _assert_same(got, want, native, names):
    from sagecupy.adapters import bf16

    for name, g, w in zip(names, got, want):
        assert g.dtype == native and bf16.is_native(g), f"{name}: {type(g).__name__} {g.dtype}"
        assert isinstance(w, bf16.BF16Array), name
        gb, wb = _host_bits(g), _host_bits(w)
        assert gb.shape == wb.shape, name
        diff = np.flatnonzero(gb != wb)
        assert diff.size == 0, f"{name}: {diff.size} of {gb.size} elements differ"


def _snapshot(xs):
    from sagecupy.adapters import bf16

    return [bf16.bits_of(x).get() for x in xs]


@pytest.mark.parametrize("layout", ["HND", "NHD"])
def test_int8_sage_attention_native_is_bf16array_bitwise(native, engine, layout):
    import sagecupy.int8 as s8

    wrapped, nat = _both(native, layout=layout)
    before = _snapshot(nat)
    o_w, lse_w = s8.sage_attention(*wrapped[:3], causal=True, layout=layout, return_lse=True, engine=engine)
    o_n, lse_n = s8.sage_attention(*nat[:3], causal=True, layout=layout, return_lse=True, engine=engine)
    _assert_same([o_n], [o_w], native, ["O"])
    assert np.array_equal(lse_n.get(), lse_w.get(), equal_nan=True)
    assert all(np.array_equal(a, b) for a, b in zip(before, _snapshot(nat))), "an input was modified"


def test_int8_forward_backward_native_is_bf16array_bitwise(native, engine):
    import sagecupy.int8 as s8

    wrapped, nat = _both(native, seed=1)
    before = _snapshot(nat)
    outs = []
    for q, k, v, do in (wrapped, nat):
        o, res = s8.forward(q, k, v, causal=True, engine=engine)
        outs.append((o, *s8.backward(res, do, engine=engine)))
    _assert_same(outs[1], outs[0], native, ["O", "dQ", "dK", "dV"])
    assert all(np.array_equal(a, b) for a, b in zip(before, _snapshot(nat))), "an input was modified"


def test_int8_native_strided_and_misaligned_inputs(native):
    """A bfloat16 view whose rows are not 16-byte aligned is copied (as a BF16Array's bits are): same outputs."""
    import sagecupy.int8 as s8

    cp = _cupy()
    wrapped, nat = _both(native, seed=2, layout="NHD")
    d = nat[1].shape[-1]
    wide = cp.zeros(nat[1].shape[:-1] + (d + 4,), dtype=cp.uint16)  # rows of 264 bytes
    wide[..., :d] = nat[1].view(cp.uint16)
    k_odd = wide.view(native)[..., :d]
    o_n = s8.sage_attention(nat[0], k_odd, nat[2], layout="NHD")
    o_w = s8.sage_attention(*wrapped[:3], layout="NHD")
    _assert_same([o_n], [o_w], native, ["O (misaligned k)"])


def test_nvfp4_attention_native_is_bf16array_bitwise(native, engine):
    from sagecupy import nvfp4

    wrapped, nat = _both(native, seed=3)
    before = _snapshot(nat)
    o_w, lse_w = nvfp4.attention(*wrapped[:3], causal=True, return_lse=True, engine=engine)
    o_n, lse_n = nvfp4.attention(*nat[:3], causal=True, return_lse=True, engine=engine)
    _assert_same([o_n], [o_w], native, ["O"])
    assert np.array_equal(lse_n.get(), lse_w.get(), equal_nan=True)
    assert all(np.array_equal(a, b) for a, b in zip(before, _snapshot(nat))), "an input was modified"
    # no input to follow: the native dtype where CuPy has it
    ops = nvfp4.quantize_inputs(*nat[:3])
    packed = nvfp4.attention_packed(ops, out_dtype="bfloat16", engine=engine)
    assert packed.dtype == native


def test_qat_native_is_bf16array_bitwise(native, engine):
    from sagecupy import qat

    wrapped, nat = _both(native, seed=4)
    outs = []
    for q, k, v, do in (wrapped, nat):
        o, res = qat.forward(q, k, v, causal=True, engine=engine)
        outs.append((o, *qat.backward(res, do, engine=engine)))
    _assert_same(outs[1], outs[0], native, ["O", "dQ", "dK", "dV"])


def test_autograd_cast_to_bfloat16_runs_the_int8_kernels(native):
    """autograd.cast(..., "bfloat16") gives CuPy bfloat16 values, which the tape's attention sends to the INT8
    kernels (a BF16Array would have looked like a NumPy value to the tape); gradients come back as float32."""
    from sagecupy import autograd as ag

    cp = _cupy()
    rng = cp.random.default_rng(5)
    xs = [ag.Variable(rng.standard_normal((1, 2, 64, 64), dtype=cp.float32)) for _ in range(3)]
    q, k, v = (ag.cast(x, "bfloat16") for x in xs)
    assert all(t.value.dtype == native for t in (q, k, v))
    o = ag.attention(q, k, v, impl="sagebwd", causal=True)
    assert o.value.dtype == native
    loss = ag.mse_loss(ag.cast(o, "float32"), cp.zeros((1, 2, 64, 64), cp.float32))
    loss.backward()
    assert all(x.grad.dtype == cp.float32 and bool(cp.isfinite(x.grad).all()) for x in xs)
