"""Launch programs (sagecupy/_program.py) without a GPU: recording, replay, keys, the cache bound, and the rule that
every kernel-choosing SAGECUPY_* variable the package reads is part of the key."""
import re
import sys
import types
from pathlib import Path

import numpy as np
import pytest

from sagecupy import _layout, _program
from sagecupy._program import Plans, Program, Ref


@pytest.fixture
def fake_cupy(monkeypatch):
    """A stand-in `cupy` module: empty() gives numpy arrays, the device is 0."""
    mod = types.SimpleNamespace(empty=lambda shape, dtype: np.zeros(shape, dtype=dtype),
                                cuda=types.SimpleNamespace(runtime=types.SimpleNamespace(getDevice=lambda: 0)))
    monkeypatch.setitem(sys.modules, "cupy", mod)
    return mod


class _Kernel:
    """Records each launch's arguments (a stand-in RawKernel)."""

    def __init__(self):
        self.calls = []

    def __call__(self, grid, block, args, shared_mem=0):
        assert isinstance(args, tuple)
        self.calls.append((grid, block, args, shared_mem))


def test_replay_substitutes_per_call_arrays(fake_cupy):
    k = _Kernel()
    prog = Program()
    out = prog.empty("out", (2, 3), np.float32)
    half = prog.view("half", out, 0)
    prog.launch(k, (4, 1, 1), (128,), (Ref("x"), np.int32(7), None, out, half), shared_mem=1024)
    (y,) = prog.call(("y",), lambda a, c: (a * c,), (Ref("x"), 2))
    prog.launch(k, (1,), (32,), (y,))
    for x in (np.arange(3.0), np.ones(3)):
        ns = prog.run({"x": x})
        grid, block, args, smem = k.calls[-2]
        assert (grid, block, smem) == ((4, 1, 1), (128,), 1024)
        assert args[0] is x and args[1] == 7 and args[2] is None
        assert args[3] is ns["out"] and ns["out"].shape == (2, 3)
        assert np.shares_memory(ns["half"], ns["out"]) and ns["half"].shape == (3,)
        np.testing.assert_array_equal(k.calls[-1][2][0], 2 * x)
    # each run allocates its own outputs: nothing is shared between calls
    assert k.calls[0][2][3] is not k.calls[2][2][3]


def test_template_is_not_mutated_by_runs(fake_cupy):
    k = _Kernel()
    prog = Program()
    prog.launch(k, (1,), (1,), (Ref("a"), Ref("b")))
    prog.run({"a": 1, "b": 2})
    prog.run({"a": 3, "b": 4})
    assert [c[2] for c in k.calls] == [(1, 2), (3, 4)]


def test_scale_key():
    assert _program.scale_key(None) is None
    assert _program.scale_key(1) == _program.scale_key(1.0) == _program.scale_key(np.float32(1.0))
    for bad in ("x", [1.0]):
        with pytest.raises((TypeError, ValueError)):
            _program.scale_key(bad)


def test_plans_drop_the_oldest_when_full():
    plans = Plans(cap=3)
    for i in range(5):
        plans.put(i, str(i))
    assert list(plans) == [2, 3, 4]


def test_env_key_holds_every_kernel_choosing_variable(fake_cupy):
    """A SAGECUPY_* variable read by the package either chooses kernels (then the program key must hold it, else a
    change after the first call of a signature would be ignored) or is listed as not doing so."""
    src = Path(_program.__file__).parent
    names = set()
    for f in src.glob("*.py"):
        names |= set(re.findall(r"SAGECUPY_[A-Z0-9_]+", f.read_text()))
    missing = names - set(_program._ENV_VARS) - set(_program.NOT_KERNEL_CHOOSING)
    assert not missing, f"add to sagecupy._program._ENV_VARS (or NOT_KERNEL_CHOOSING): {sorted(missing)}"
    assert len(_program.env_key()) == 1 + len(_program._ENV_VARS)


def test_env_key_follows_os_environ(fake_cupy, monkeypatch):
    """env_key reads os.environ's own store where it can (a fast path): a variable set, changed or removed through
    os.environ (as monkeypatch and users do) changes the key, and an unrelated one does not."""
    monkeypatch.delenv("SAGECUPY_DEFINES", raising=False)
    k0 = _program.env_key()
    monkeypatch.setenv("SAGECUPY_DEFINES", "X=8")
    k1 = _program.env_key()
    monkeypatch.setenv("SAGECUPY_DEFINES", "X=4")
    k2 = _program.env_key()
    monkeypatch.setenv("SAGECUPY_UNRELATED_TEST_VARIABLE", "1")
    assert len({k0, k1, k2}) == 3 and _program.env_key() == k2
    monkeypatch.delenv("SAGECUPY_DEFINES")
    assert _program.env_key() == k0


def test_signature_sees_alignment_and_strides():
    class Arr:  # the attributes signature() reads from a CuPy array
        def __init__(self, ptr, strides):
            self.shape, self.strides, self.dtype = (1, 2, 3, 8), strides, np.dtype(np.float16)
            self.data = types.SimpleNamespace(ptr=ptr)

    a, b, c = Arr(4096, (96, 48, 16, 2)), Arr(4098, (96, 48, 16, 2)), Arr(4096, (96, 16, 32, 2))
    assert _program.signature(a) != _program.signature(b)  # misaligned: copied per call
    assert _program.signature(a) != _program.signature(c)  # other strides
    assert _program.signature(a) == _program.signature(Arr(8192, (96, 48, 16, 2)))


@pytest.mark.parametrize("layout", ["HND", "NHD"])
@pytest.mark.parametrize("shape", [(2, 3, 5, 64), (1, 1, 1, 128), (4, 16, 7, 64)])
def test_c_strides_match_strides_of_a_fresh_array(shape, layout):
    """_layout.c_strides (what a recorded launch passes for an output it allocates, or for an input it copies) equals
    _layout.strides of a C-contiguous array of that shape."""
    assert _layout.c_strides(shape, layout) == _layout.strides(np.empty(shape, dtype=np.float16), layout)


class _DevArray:
    """A stand-in device array: what the packed launch path reads (``.data.ptr``, ``.shape``)."""

    _next = [0x7F0000001000]

    def __init__(self, shape, dtype=np.float32):
        self.shape, self.dtype = tuple(shape), np.dtype(dtype)
        self.data = types.SimpleNamespace(ptr=_DevArray._next[0])
        _DevArray._next[0] += 0x10000


class _DrvKernel(_Kernel):
    """A stand-in RawKernel with a driver handle (``.kernel.ptr``), so that programs pack its launches."""

    def __init__(self, ptr=0x1234):
        super().__init__()
        self.kernel = types.SimpleNamespace(ptr=ptr)


@pytest.fixture
def fake_driver(monkeypatch):
    """A stand-in `cupy` whose driver's launchKernel decodes the packed parameter block (every slot 8 bytes)."""
    import ctypes

    launches = []

    def launch_kernel(f, gx, gy, gz, bx, by, bz, smem, stream, params, extra):
        n = launches_n[0]
        addrs = (ctypes.c_uint64 * n).from_address(params) if n else []
        slots = [bytes((ctypes.c_uint8 * 8).from_address(a)) for a in addrs]
        launches.append(dict(f=f, grid=(gx, gy, gz), block=(bx, by, bz), smem=smem, stream=stream, slots=slots,
                             extra=extra))

    launches_n = [0]
    mod = types.SimpleNamespace(
        empty=lambda shape, dtype: _DevArray(shape, dtype),
        cuda=types.SimpleNamespace(runtime=types.SimpleNamespace(getDevice=lambda: 0),
                                   driver=types.SimpleNamespace(launchKernel=launch_kernel),
                                   get_current_stream=lambda: types.SimpleNamespace(ptr=stream[0])))
    stream = [77]
    mod.cuda.runtime.memGetInfo = lambda: (1, 1)
    monkeypatch.setitem(sys.modules, "cupy", mod)
    monkeypatch.delenv("SAGECUPY_LAUNCH", raising=False)
    return launches, launches_n, stream


def _slot_bytes(value, dtype):
    return np.array(value, dtype=dtype).tobytes().ljust(8, b"\0")


def test_packed_launch_passes_the_same_arguments(fake_driver):
    """The driver path's parameter block holds, per slot, exactly the bytes CuPy would pass: numpy scalars in their
    own type, array pointers per call, NULL for None; grid and block padded to 3-D; the current stream."""
    launches, launches_n, stream = fake_driver
    k = _DrvKernel()
    prog = Program()
    out = prog.empty("out", (2, 3), np.float32)
    args = (Ref("x"), np.int32(-7), np.float32(1.5), None, np.int64(2 ** 40 + 3), out, np.uint8(200), Ref("y"))
    prog.launch(k, (4, 2), (128,), args, shared_mem=4096)
    launches_n[0] = len(args)
    for run in range(2):
        stream[0] = 77 + run  # the stream current at each run, not at recording
        x, y = _DevArray((3,)), _DevArray((5,))
        ns = prog.run({"x": x, "y": y})
        got = launches[-1]
        assert not k.calls  # CuPy's call was not used
        assert (got["f"], got["grid"], got["block"], got["smem"], got["stream"], got["extra"]) == (
            0x1234, (4, 2, 1), (128, 1, 1), 4096, 77 + run, 0)
        want = [_slot_bytes(x.data.ptr, np.uint64), _slot_bytes(-7, np.int32), _slot_bytes(1.5, np.float32),
                bytes(8), _slot_bytes(2 ** 40 + 3, np.int64), _slot_bytes(ns["out"].data.ptr, np.uint64),
                _slot_bytes(200, np.uint8), _slot_bytes(y.data.ptr, np.uint64)]
        assert got["slots"] == want
    # per-call None in a Ref slot is NULL
    prog.run({"x": None, "y": _DevArray((1,))})
    assert launches[-1]["slots"][0] == bytes(8)


def test_packed_launch_falls_back_to_cupy_call(fake_driver, monkeypatch):
    """Where packing does not apply (a Python scalar, whose C type CuPy chooses; a per-call argument that is not a
    device array; SAGECUPY_LAUNCH=cupy when recorded) the launch goes through the kernel object's own call."""
    launches, launches_n, _ = fake_driver
    k = _DrvKernel()
    prog = Program()
    prog.launch(k, (1,), (32,), (Ref("x"), 5))  # Python int
    prog.run({"x": _DevArray((1,))})
    assert len(k.calls) == 1 and not launches
    prog = Program()
    prog.launch(k, (1,), (32,), (Ref("x"), np.int32(5)))
    launches_n[0] = 2
    prog.run({"x": np.arange(3)})  # a host array: not a device pointer
    assert len(k.calls) == 2 and not launches
    prog.run({"x": _DevArray((1,))})
    assert len(launches) == 1
    monkeypatch.setenv("SAGECUPY_LAUNCH", "cupy")
    prog = Program()
    prog.launch(k, (1,), (32,), (Ref("x"), np.int32(5)))
    prog.run({"x": _DevArray((1,))})
    assert len(k.calls) == 3 and len(launches) == 1


def test_packed_launch_sets_up_each_threads_context_once(fake_driver):
    """A thread whose first CUDA call is a replayed driver launch has no current context; the replay makes the
    device's context current first (one runtime call per thread and device, as CuPy's kernel call does)."""
    import threading

    launches, launches_n, _ = fake_driver
    calls = []
    sys.modules["cupy"].cuda.runtime.memGetInfo = lambda: calls.append(threading.get_ident()) or (1, 1)
    k = _DrvKernel()
    prog = Program()
    prog.launch(k, (1,), (32,), (Ref("x"),))
    launches_n[0] = 1
    prog.run({"x": _DevArray((1,))})
    prog.run({"x": _DevArray((1,))})
    t = threading.Thread(target=lambda: prog.run({"x": _DevArray((1,))}))
    t.start()
    t.join()
    assert len(launches) == 3
    assert len(calls) == len(set(calls)) and t.ident in calls  # once per thread, the new thread included


def test_arena_members_share_one_allocation(fake_cupy, monkeypatch):
    """Buffers recorded into an arena: one allocation per run (float32, so NaN poisoning of cupy.empty reaches it),
    each member's address aligned and inside it, no two members overlapping; a launch gets the addresses, and
    member_array gives a member back as an array of its shape and dtype."""
    allocs = []

    class Dev:
        _next = [1 << 16]

        def __init__(self, shape, dtype):
            self.shape, self.dtype = shape, np.dtype(dtype)
            self.nbytes = int(np.prod(shape)) * self.dtype.itemsize
            self.data = types.SimpleNamespace(ptr=Dev._next[0])
            Dev._next[0] += -(-self.nbytes // 512) * 512 + 512
            allocs.append(self)

    monkeypatch.setattr(fake_cupy, "empty", lambda shape, dtype: Dev(shape, dtype))
    k = _Kernel()
    prog = Program()
    a = prog.empty("a", (3, 5), np.float64, arena="tmp")
    own = prog.empty("own", (7,), np.int8)
    b = prog.empty("b", (17,), np.int8, arena="tmp")
    c = prog.empty("c", (2, 9), np.float32, arena="tmp")
    prog.launch(k, (1,), (32,), (a, own, b, c, Ref("x")))
    for _ in range(2):
        allocs.clear()
        ns = prog.run({"x": None})
        assert len(allocs) == 2 and allocs[0].dtype == np.float32  # the arena (first member's place), then "own"
        base = ns["tmp"]
        assert base is allocs[0] and ns["own"] is allocs[1]
        spans = []
        for name, nbytes in (("a", 120), ("b", 17), ("c", 72)):
            ptr = ns[name]
            assert type(ptr) is int and ptr % _program.ARENA_ALIGN == 0
            assert base.data.ptr <= ptr and ptr + nbytes <= base.data.ptr + base.nbytes
            spans.append((ptr, ptr + nbytes))
        spans.sort()
        assert all(e <= s for (_, e), (s, _) in zip(spans, spans[1:]))
        args = k.calls[-1][2]  # CuPy's call (no driver handle): addresses as 8-byte unsigned scalars
        assert [type(x) for x in args] == [np.uint64, Dev, np.uint64, np.uint64, type(None)]
        assert [int(x) for x in (args[0], args[2], args[3])] == [ns["a"], ns["b"], ns["c"]]
    views = []
    fake_cupy.ndarray = lambda shape, dtype, memptr: views.append((shape, np.dtype(dtype), memptr)) or views[-1]
    ptr0 = base.data.ptr
    base.data = 1000  # member_array offsets the arena's MemoryPointer; an int stands in for it here
    assert prog.member_array(ns, "c") == ((2, 9), np.dtype(np.float32), 1000 + ns["c"] - ptr0)
    with pytest.raises(KeyError):
        prog.member_array(ns, "own")
