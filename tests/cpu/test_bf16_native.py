"""bfloat16 in its two device forms, CuPy arrays of ``ml_dtypes.bfloat16`` and ``BF16Array``
(sagecupy/adapters/bf16.py).

Without a GPU: the decision of which form an output takes (pure functions), the zero-copy bit views, the dtype
errors, and the INT8 / NVFP4 / QAT host paths on the stand-in ``cupy`` of test_host_paths.py: a bfloat16 input
launches exactly what the same bits as a BF16Array launch (its own memory, no copy), and the outputs take the form
of the input they follow (q in a forward, do in a backward)."""
import sys
import types

import numpy as np
import pytest

from sagecupy._checks import BF16_FORMS, check_attention_args, raw, wrap
from sagecupy.adapters import bf16

from test_host_paths import FakeArray, _arena_base, gpu, stub_views  # noqa: F401  (gpu: the stand-in cupy fixture)


def _ml_dtypes():
    return pytest.importorskip("ml_dtypes", minversion="0.5")


def _wrapped(bits):
    """A BF16Array around ``bits`` without importing CuPy (the class's own check needs a CuPy array)."""
    x = bf16.BF16Array.__new__(bf16.BF16Array)
    x.bits = bits
    return x


@pytest.fixture
def host_cupy(monkeypatch):
    """NumPy standing in for CuPy (BF16Array takes NumPy uint16 bits), of a version without bfloat16 arrays."""
    fake = types.SimpleNamespace(ndarray=np.ndarray, uint16=np.uint16, uint32=np.uint32, float32=np.float32,
                                 ascontiguousarray=np.ascontiguousarray, isnan=np.isnan, where=np.where,
                                 __version__="13.6.0")
    monkeypatch.setitem(sys.modules, "cupy", fake)
    return fake


# ----------------------------------------------------------------------------
# the decision
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("cupy_version, numpy_version, have, want", [
    ("14.2.0", "2.5.0", True, True),
    ("14.0.0rc1", "2.1.2", True, True),   # the first CuPy with bfloat16 arrays, the first NumPy it enables them with
    ("15.0.0a1", "2.2.0", True, True),
    ("14.2.0", "2.1.1", True, False),     # CuPy leaves bfloat16 out beside an older NumPy
    ("14.2.0", "1.26.4", True, False),
    ("13.6.0", "2.5.0", True, False),
    ("14.2.0", "2.5.0", False, False),    # no ml_dtypes, no bfloat16 dtype
    ("", "2.5.0", True, False),           # a stand-in module without a version
    ("14.2.0", "not a version", True, False),
])
def test_native_supported(cupy_version, numpy_version, have, want):
    assert bf16.native_supported(cupy_version, numpy_version, have) is want


def test_output_kind_follows_the_input_form():
    md = _ml_dtypes()
    native = np.zeros((2, 3), dtype=md.bfloat16)
    wrapped = _wrapped(np.zeros((2, 3), np.uint16))
    for available in (True, False):
        assert bf16.output_kind(native, available) == bf16.NATIVE  # an input's form wins either way
        assert bf16.output_kind(wrapped, available) == bf16.WRAPPED
    # nothing to follow (None, or a non-bf16 array): the native dtype where CuPy has it
    for like in (None, np.zeros(3, np.float16), np.zeros(3, np.uint16)):
        assert bf16.output_kind(like, True) == bf16.NATIVE
        assert bf16.output_kind(like, False) == bf16.WRAPPED


def test_is_native_is_bfloat16_alone():
    md = _ml_dtypes()
    assert bf16.is_native(np.zeros(2, md.bfloat16))
    for x in (np.zeros(2, np.float16), np.zeros(2, np.uint16), np.zeros(2, md.float8_e4m3fn),
              np.zeros(2, md.float4_e2m1fn), _wrapped(np.zeros(2, np.uint16)),
              types.SimpleNamespace(dtype="bfloat16"), None):
        assert not bf16.is_native(x), x
    assert bf16.is_bf16(_wrapped(np.zeros(2, np.uint16))) and bf16.is_bf16(np.zeros(2, md.bfloat16))
    assert not bf16.is_bf16(np.zeros(2, np.uint16))


def test_native_dtype_probe(monkeypatch):
    md = _ml_dtypes()
    for version, want in (("14.2.0", np.dtype(md.bfloat16)), ("13.6.0", None), ("14.2.0", np.dtype(md.bfloat16))):
        # (a new module object each time: the probe is redone per imported cupy module)
        monkeypatch.setitem(sys.modules, "cupy", types.SimpleNamespace(__version__=version))
        if np.lib.NumpyVersion(np.__version__) < bf16.NUMPY_MIN:
            want = None
        assert bf16.native_dtype() == want
    monkeypatch.setitem(sys.modules, "cupy", None)  # CuPy not importable
    assert bf16.native_dtype() is None


# ----------------------------------------------------------------------------
# bit views: no copy
# ----------------------------------------------------------------------------


def test_raw_views_bfloat16_as_its_bits():
    md = _ml_dtypes()
    x = np.arange(-6, 6, dtype=np.float32).reshape(3, 4).astype(md.bfloat16)[:, ::2]  # strided: a view too
    r = raw(x)
    assert r.dtype == np.uint16 and r.shape == x.shape and r.strides == x.strides and np.shares_memory(r, x)
    assert np.array_equal(r, np.asarray(x).view(np.uint16))
    h = np.zeros(4, np.float16)
    assert raw(h) is h
    bits = np.zeros(4, np.uint16)
    assert raw(_wrapped(bits)) is bits
    assert raw(bits) is bits


def test_wrap_gives_the_form_of_like(host_cupy):
    md = _ml_dtypes()
    bits = np.arange(8, dtype=np.uint16)
    out = wrap(bits, "bfloat16", np.zeros(1, md.bfloat16))
    assert out.dtype == np.dtype(md.bfloat16) and np.shares_memory(out, bits)
    out = wrap(bits, "bfloat16", _wrapped(np.zeros(1, np.uint16)))
    assert isinstance(out, bf16.BF16Array) and out.bits is bits
    # no input to follow, on a CuPy without bfloat16 arrays (host_cupy says 13.6.0): a BF16Array
    out = wrap(bits, "bfloat16")
    assert isinstance(out, bf16.BF16Array) and out.bits is bits
    h = np.zeros(2, np.float16)
    assert wrap(h, "float16", np.zeros(1, md.bfloat16)) is h


def test_from_bits_and_to_float32_on_the_host(host_cupy):
    md = _ml_dtypes()
    bits = np.array([0x3F80, 0xC020, 0x7F80, 0x0001], np.uint16)
    want = (bits.astype(np.uint32) << 16).view(np.float32)
    for x in (bits.view(md.bfloat16), _wrapped(bits)):
        assert np.array_equal(bf16.to_float32(x).view(np.uint32), want.view(np.uint32))
        assert bf16.bits_of(x) is bits or np.shares_memory(bf16.bits_of(x), bits)
    with pytest.raises(TypeError, match="bfloat16 array"):
        bf16.bits_of(bits)


@pytest.mark.parametrize("dtype", [np.float16, np.int16, np.uint8, np.float32])
def test_from_bits_refuses_anything_but_uint16(dtype):
    # a view would silently reinterpret these as bfloat16 (or change the shape)
    with pytest.raises(TypeError, match="from_bits: bits must be a uint16 array"):
        bf16.from_bits(np.zeros(4, dtype))


def test_dtype_errors_name_the_argument_and_both_bf16_forms():
    md = _ml_dtypes()
    ok = np.zeros((1, 2, 8, 64), md.bfloat16)
    for bad in (np.uint16, np.float32, md.float8_e4m3fn):
        with pytest.raises(TypeError) as info:
            check_attention_args(ok, np.zeros(ok.shape, bad), ok, causal=False, sm_scale=None, layout="HND")
        msg = str(info.value)
        assert msg.startswith(f"k.dtype={np.dtype(bad).name} is not supported; supported: ('float16', 'bfloat16')")
        assert BF16_FORMS in msg and "ml_dtypes.bfloat16" in msg and "BF16Array" in msg
    p = check_attention_args(ok, ok, ok, causal=False, sm_scale=None, layout="HND")
    assert p.dtype == "bfloat16"


# ----------------------------------------------------------------------------
# host paths on the stand-in cupy
# ----------------------------------------------------------------------------


@pytest.fixture
def views(monkeypatch):
    """FakeArray.view and .transpose (test_host_paths.stub_views)."""
    stub_views(monkeypatch)


def _bf16_inputs(nq=128, nk=128, d=128):
    """q, k, v, do as native bfloat16 FakeArrays and the same memory as BF16Arrays of uint16 FakeArrays."""
    md = _ml_dtypes()
    shapes = ((2, 4, nq, d), (2, 2, nk, d), (2, 2, nk, d), (2, 4, nq, d))
    native = [FakeArray(s, md.bfloat16) for s in shapes]
    wrapped = [bf16.BF16Array(FakeArray(x.shape, np.uint16, x.strides, x.data.ptr)) for x in native]
    return native, wrapped


def _summary(launches, inputs):
    """The launches with each array as (shape, dtype, the input whose memory it is, or None) and arena addresses
    as offsets from the launches' lowest: equal summaries launch the same kernels on the same input memory."""
    base = _arena_base(launches)
    ptrs = {x.data.ptr: n for n, x in inputs.items()}

    def arg(a):
        if isinstance(a, FakeArray):
            return ("array", a.shape, a.dtype.str, ptrs.get(a.data.ptr))
        if isinstance(a, np.uint64):
            return ("arena", int(a) - base)
        return a if a is None else (type(a).__name__, a.item())

    return [(name, grid, block, tuple(arg(a) for a in args), smem) for name, grid, block, args, smem in launches]


def _form(x):
    return "native" if bf16.is_native(x) else "wrapped" if isinstance(x, bf16.BF16Array) else type(x).__name__


def _run_both(gpu, call):
    """``call(q, k, v, do)`` on the native inputs and on the wrapped ones: (summaries, outputs) of each."""
    native, wrapped = _bf16_inputs()
    got = []
    for xs in (native, wrapped):
        start = len(gpu)
        out = call(*xs)
        got.append((_summary(gpu[start:], dict(zip("qkvd", native))), out))
    return got


@pytest.mark.parametrize("engine", ["wgmma", "mma"])
def test_int8_native_bf16_launches_what_bf16array_launches(gpu, views, engine):
    from sagecupy import int8

    def call(q, k, v, do):
        o, res = int8.forward(q, k, v, causal=True, engine=engine)
        return (o, *int8.backward(res, do, engine=engine), int8.sage_attention(q, k, v, engine=engine))

    (s_nat, out_nat), (s_wr, out_wr) = _run_both(gpu, call)
    assert s_nat == s_wr
    assert all("__nv_bfloat16" in name for name, *_ in s_nat if "<" in name and "transpose_i8" not in name)
    used = {a[3] for launch in s_nat for a in launch[3] if isinstance(a, tuple) and a[0] == "array"}
    assert {"q", "k", "v", "d"} <= used  # the inputs' own memory: no copy
    md = _ml_dtypes()
    assert [_form(x) for x in out_nat] == ["native"] * 5 and all(x.dtype == md.bfloat16 for x in out_nat)
    assert [_form(x) for x in out_wr] == ["wrapped"] * 5
    assert [raw(x).shape for x in out_nat] == [raw(x).shape for x in out_wr]


def test_int8_gradients_take_the_form_of_do(gpu, views):
    from sagecupy import int8

    native, wrapped = _bf16_inputs()
    for xs, do, form in ((native, wrapped[3], "wrapped"), (wrapped, native[3], "native")):
        o, res = int8.forward(*xs[:3])
        assert _form(o) == _form(xs[0])
        assert [_form(g) for g in int8.backward(res, do)] == [form] * 3
    with pytest.raises(TypeError, match="do.dtype=float16 must equal the input dtype bfloat16"):
        int8.backward(res, FakeArray(native[3].shape, np.float16))


def test_nvfp4_native_bf16_launches_what_bf16array_launches(gpu, views):
    from sagecupy import nvfp4

    (s_nat, o_nat), (s_wr, o_wr) = _run_both(gpu, lambda q, k, v, do: nvfp4.attention(q, k, v, causal=True))
    assert s_nat == s_wr
    assert _form(o_nat) == "native" and _form(o_wr) == "wrapped"


@pytest.mark.parametrize("engine", ["wgmma", "mma"])
def test_qat_native_bf16_launches_what_bf16array_launches(gpu, views, engine):
    from sagecupy import qat

    def call(q, k, v, do):
        o, res = qat.forward(q, k, v, causal=True, engine=engine)
        return (o, *qat.backward(res, do, engine=engine))

    (s_nat, out_nat), (s_wr, out_wr) = _run_both(gpu, call)
    assert s_nat == s_wr
    assert [_form(x) for x in out_nat] == ["native"] * 4
    assert [_form(x) for x in out_wr] == ["wrapped"] * 4


def test_int8_replays_keep_native_and_wrapped_apart(gpu, views):
    """The two forms have different call signatures (a plan per form): alternating calls keep each output's form."""
    from sagecupy import int8

    native, wrapped = _bf16_inputs()
    for xs in (native, wrapped, native, wrapped):
        assert _form(int8.sage_attention(*xs[:3])) == _form(xs[0])
