"""Launch programs: a call's allocations and kernel launches recorded once per call signature and replayed.

A public call (``int8.forward``, ``int8.backward``) validates its arguments, derives shapes, strides, padded
sizes, kernel names and launch geometry, looks the kernels up and converts the scalar arguments; that host work
depends only on the *signature* of the call (shapes, strides, dtypes, 16-byte alignment of the inputs, the keyword
arguments, the device and the ``SAGECUPY_*`` environment variables that choose kernels), not on the data. So the
first call with a signature records a :class:`Program` (the arrays to allocate, by name and shape, and the launches
with their constant arguments and the names of the arrays they take) and later calls with the same signature
replay it: allocations and launches only. On the H200 the synchronized 4K INT8 forward spent more host time before
and between its launches than its pre-pass kernels take on the device (docs/experiments.md, E-HOST-PROGRAM).

Every call, the first one included, runs the recorded program, so the tests exercise the replay path.

Launches are replayed through the driver (``cuLaunchKernel`` via ``cupy.cuda.driver.launchKernel``; on sm_90 and up,
launches recorded with ``pdl=True`` through ``cuLaunchKernelEx`` as programmatic dependents, see :func:`pdl_enabled`) with the
kernel's parameter block packed when the launch is recorded: a replay writes only the per-call array pointers into
it. CuPy's own kernel call converts every argument on every call (9.4-10.9 us for a launch with 25 arguments on
the H200 machine's CPU against 6.5-7.0 us replayed this way; docs/experiments.md, E-HOST-DRIVER). ``SAGECUPY_LAUNCH=cupy``
(read when a program is recorded) keeps CuPy's call instead, for A/B timing.
"""
from __future__ import annotations

import ctypes
import functools
import os
import threading

import numpy as np

__all__ = ["Ref", "Program", "Plan", "Plans", "signature", "scale_key", "env_key", "NOT_KERNEL_CHOOSING"]

_ALLOC, _VIEW, _LAUNCH, _CALL, _ARENA = 0, 1, 2, 3, 4
#: Byte alignment of the buffers inside an arena (cudaMalloc's; the kernels need at most 128 for bulk copies).
ARENA_ALIGN = 256

#: Environment variables (development aids, docs/design.md) that change what the kernels are or how they launch:
#: part of every program's key, so that changing one between calls takes effect as it did before programs. A new
#: ``SAGECUPY_*`` switch read by the package must be added here (``tests/cpu/test_program.py`` checks the package's
#: sources for names missing from this list and from ``NOT_KERNEL_CHOOSING``).
_ENV_VARS = ("SAGECUPY_DEFINES", "SAGECUPY_KERNELS_DIR", "SAGECUPY_PDL")
#: Variables the package reads that do not change which kernels run or how (debug output only).
NOT_KERNEL_CHOOSING = ("SAGECUPY_DEBUG", "SAGECUPY_JIT_DEBUG", "SAGECUPY_LAUNCH")


class Ref:
    """A per-call array in a recorded launch's arguments: the name it has in the program's namespace."""

    __slots__ = ("name",)

    def __init__(self, name: str):
        self.name = name

    def __repr__(self):
        return f"Ref({self.name!r})"


#: cuLaunchKernelEx's launch attribute for programmatic dependent launch (CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION).
_PDL_ATTRIBUTE = 6


def env_switch(name: str, default: str = "0") -> bool:
    """An on/off environment variable: ``"1"`` on, ``"0"`` off, unset ``default``; any other value a ValueError."""
    env = os.environ.get(name, default)
    if env not in ("0", "1"):
        raise ValueError(f"{name}={env!r} is not supported; supported: '0', '1'")
    return env == "1"


def pdl_enabled() -> bool:
    """Whether launches recorded with ``pdl=True`` use programmatic dependent launch: on devices of compute
    capability 9.0 and up (the feature's), unless ``SAGECUPY_PDL=0`` (read when a program is recorded, and part of
    every program's key; "1" or unset: on). The kernels' waits (``grid_dep_wait``) are compiled in for
    ``__CUDA_ARCH__ >= 900``, which is what the loader builds for such a device (CuPy's target is the device's own
    architecture unless a kernel asks for another, as the sm_90a kernels do)."""
    if not env_switch("SAGECUPY_PDL", "1"):
        return False
    import cupy

    return int(cupy.cuda.Device().compute_capability) >= 90


@functools.lru_cache(maxsize=None)
def _launch_ex():
    """(cuLaunchKernelEx, CUlaunchConfig, CUlaunchAttribute) through ctypes from the driver library, or None."""
    class Attr(ctypes.Structure):  # CUlaunchAttribute: id, 4 bytes of padding, a 64-byte value union
        _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_int * 16)]

    class Config(ctypes.Structure):  # CUlaunchConfig
        _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("smem", ctypes.c_uint),
                    ("stream", ctypes.c_void_p), ("attrs", ctypes.POINTER(Attr)), ("num_attrs", ctypes.c_uint)]

    assert ctypes.sizeof(Attr) == 72 and ctypes.sizeof(Config) == 56
    try:
        fn = ctypes.CDLL("libcuda.so.1").cuLaunchKernelEx
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.POINTER(Config), ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    fn.restype = ctypes.c_int
    return fn, Config, Attr


class _Packed:
    """A recorded launch's kernel parameters, packed for ``cuLaunchKernel``: one 8-byte slot per parameter (every
    parameter of our kernels is a pointer or a 4- or 8-byte scalar; the driver copies each one's own size from the
    start of its slot) and the array of the slots' addresses (``addrs``, kept alive with ``vals``). ``refs``: (slot,
    name) of the per-call arrays. A replay fills those slots and launches under ``lock`` (the block is shared by the
    program's callers)."""

    __slots__ = ("fptr", "grid", "block", "smem", "vals", "addrs", "params", "refs", "lock", "ex")

    def __init__(self, fptr, grid, block, smem, vals, refs, pdl=False):
        self.fptr, self.smem, self.vals, self.refs = fptr, smem, vals, refs
        self.grid = tuple(grid) + (1,) * (3 - len(grid))
        self.block = tuple(block) + (1,) * (3 - len(block))
        self.addrs = np.arange(len(vals), dtype=np.uint64) * np.uint64(8) + np.uint64(vals.ctypes.data)
        self.params = int(self.addrs.ctypes.data) if len(vals) else 0
        self.lock = threading.Lock()
        # programmatic dependent launch: cuLaunchKernelEx with its attribute; (function, config, attribute), the
        # config's stream set per launch
        self.ex = None
        lx = _launch_ex() if pdl else None
        if lx is not None:
            fn, Config, Attr = lx
            attr = Attr(id=_PDL_ATTRIBUTE)
            attr.value[0] = 1
            cfg = Config()
            cfg.grid[:], cfg.block[:], cfg.smem, cfg.num_attrs = self.grid, self.block, smem, 1
            cfg.attrs = ctypes.pointer(attr)
            self.ex = (fn, ctypes.byref(cfg), cfg, attr)


def _pack(fn, grid, block, template, refs, smem, pdl=False):
    """A :class:`_Packed` launch of ``fn`` (a CuPy RawKernel), or None where the fast path does not apply: a kernel
    object without a driver handle (a stand-in in tests), a constant argument other than None or a numpy scalar
    CuPy passes as itself (a Python scalar, whose C type CuPy chooses; an array: the package passes arrays per call,
    as Refs), or ``SAGECUPY_LAUNCH=cupy``."""
    if os.environ.get("SAGECUPY_LAUNCH", "") == "cupy" or len(grid) > 3 or len(block) > 3:
        return None
    fptr = getattr(getattr(fn, "kernel", None), "ptr", None)
    if type(fptr) is not int:
        return None
    ref_slots = {i for i, _ in refs}
    vals = np.zeros(len(template), dtype=np.uint64)
    raw = vals.view(np.uint8)
    for i, a in enumerate(template):
        if i in ref_slots or a is None:
            continue
        if isinstance(a, np.generic) and a.dtype.char in _SCALAR_CHARS:
            b = np.frombuffer(a.tobytes(), dtype=np.uint8)
            raw[8 * i:8 * i + b.size] = b
            continue
        return None
    return _Packed(fptr, grid, block, smem, vals, refs, pdl and pdl_enabled())


#: numpy scalar types CuPy's kernel call passes as themselves (bool, integers, float16/32/64), all <= 8 bytes.
_SCALAR_CHARS = frozenset("?bhilqBHILQefd")

_TLS = threading.local()


def _ensure_context(device):
    """Make ``device``'s context current on this thread before its first driver launch: a thread whose first CUDA
    call is a replayed launch has none yet (cuLaunchKernel: CUDA_ERROR_INVALID_CONTEXT), where CuPy's own kernel
    call would have set it up. One runtime call per thread and device, as CuPy does."""
    import cupy

    done = getattr(_TLS, "devices", None)
    if done is None:
        done = _TLS.devices = set()
    if device not in done:
        cupy.cuda.runtime.memGetInfo()
        done.add(device)


def _slot(a):
    """A per-call argument's slot value: an array's device pointer, an arena buffer's address (an int), 0 for
    None."""
    return 0 if a is None else a if type(a) is int else a.data.ptr


class _Arena:
    """Buffers recorded with :meth:`Program.empty` ``(..., arena=name)``: one allocation per run (``nbytes``, a
    float32 array, so that the GPU tests' NaN poisoning of ``cupy.empty`` fills it) holding every member at its
    ``ARENA_ALIGN``-aligned offset. A run puts each member's address (an int) in the namespace, not an array: the
    launches need only the address, and the host time of an allocation or of a view (~2 us each on the H200
    machine's CPU) is what the arena saves. The arena array itself is kept under ``name``: whoever keeps a member's
    address past the run must keep it too (the memory pool reuses a freed buffer on the same stream at once)."""

    __slots__ = ("name", "nbytes", "members", "layout")

    def __init__(self, name: str):
        self.name, self.nbytes, self.members = name, 0, []  # members: (name, offset), what a run walks
        self.layout = {}  # name -> (offset, shape, dtype): what a member's address stands for

    def add(self, name: str, shape, dtype):
        off = -(-self.nbytes // ARENA_ALIGN) * ARENA_ALIGN
        self.members.append((name, off))
        self.layout[name] = (off, shape, dtype)
        self.nbytes = off + int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize


class Program:
    """Allocations and launches, replayed by :meth:`run` into a namespace (a dict of arrays by name)."""

    __slots__ = ("steps", "arenas")

    def __init__(self):
        self.steps = []
        self.arenas = {}

    def empty(self, name: str, shape, dtype, arena: str | None = None) -> Ref:
        """Record ``cupy.empty(shape, dtype)`` under ``name``; with ``arena``, a buffer inside that arena (see
        :class:`_Arena`: the run's namespace then holds its address, an int, under ``name``). The arena is
        allocated where its first member was recorded."""
        shape = tuple(int(s) for s in shape)
        if arena is None:
            self.steps.append((_ALLOC, name, shape, dtype))
        else:
            a = self.arenas.get(arena)
            if a is None:
                a = self.arenas[arena] = _Arena(arena)
                self.steps.append((_ARENA, a))
            a.add(name, shape, dtype)
        return Ref(name)

    def member_array(self, ns: dict, name: str):
        """A member of an arena as a CuPy array (a view of the arena array in ``ns``), for host code that needs an
        array rather than an address."""
        import cupy

        for a in self.arenas.values():
            if name in a.layout:
                off, shape, dtype = a.layout[name]
                return cupy.ndarray(shape, dtype, memptr=ns[a.name].data + off)
        raise KeyError(name)

    def view(self, name: str, parent: Ref, index) -> Ref:
        """Record ``name = parent[index]`` (a view)."""
        self.steps.append((_VIEW, name, parent.name, index))
        return Ref(name)

    def launch(self, fn, grid, block, args, shared_mem: int = 0, pdl: bool = False):
        """Record ``fn(grid, block, args, shared_mem=shared_mem)``; :class:`Ref` arguments are looked up per run,
        the others (numpy scalars, None) are used as they are. ``pdl``: the kernel calls ``grid_dep_wait()``
        (kernels_cu/common/numeric.cuh) before it touches global memory, so it may be launched as a programmatic
        dependent of the launch before it (where :func:`pdl_enabled` and the driver has ``cuLaunchKernelEx``)."""
        template = list(args)
        refs = tuple((i, a.name) for i, a in enumerate(template) if type(a) is Ref)
        for i, _ in refs:
            template[i] = None
        packed = _pack(fn, tuple(grid), tuple(block), template, refs, int(shared_mem), pdl)
        self.steps.append((_LAUNCH, fn, tuple(grid), tuple(block), template, refs, int(shared_mem), packed))

    def call(self, names, fn, args) -> tuple:
        """Record ``names = fn(*args)`` (host glue that is neither an allocation nor a launch; ``args``: Refs or
        constants); returns Refs to the results."""
        self.steps.append((_CALL, tuple(names), fn, tuple(args)))
        return tuple(Ref(n) for n in names)

    def run(self, ns: dict) -> dict:
        """Replay into ``ns`` (which holds the per-call inputs by name); returns ``ns``. A recorded allocation whose
        name ``ns`` already holds takes that array instead (checked to be what the allocation would make): an output
        written in place into a caller's buffer."""
        import cupy

        empty = cupy.empty  # looked up per run: the GPU tests' NaN poisoning replaces it
        stream = None
        for step in self.steps:
            kind = step[0]
            if kind == _LAUNCH:
                _, fn, grid, block, template, refs, smem, packed = step
                if packed is not None:
                    try:
                        slots = [(i, _slot(ns[name])) for i, name in packed.refs]
                    except AttributeError:  # a per-call argument that is not an array: CuPy's call converts it
                        slots = None
                    if slots is not None:
                        if stream is None:
                            stream = cupy.cuda.get_current_stream().ptr
                            _ensure_context(cupy.cuda.runtime.getDevice())
                        vals = packed.vals
                        with packed.lock:
                            for i, ptr in slots:
                                vals[i] = ptr
                            if packed.ex is None:
                                cupy.cuda.driver.launchKernel(packed.fptr, *packed.grid, *packed.block, packed.smem,
                                                              stream, packed.params, 0)
                            else:
                                fn_ex, cfg_ref, cfg, _ = packed.ex
                                cfg.stream = stream
                                err = fn_ex(cfg_ref, packed.fptr, packed.params, None)
                                if err:
                                    raise cupy.cuda.driver.CUDADriverError(err)
                        continue
                args = template.copy()
                for i, name in refs:
                    a = ns[name]
                    args[i] = np.uint64(a) if type(a) is int else a  # an arena buffer's address: 8 bytes
                fn(grid, block, tuple(args), shared_mem=smem)
            elif kind == _ALLOC:
                given = ns.get(step[1])
                if given is None:
                    ns[step[1]] = empty(step[2], dtype=step[3])
                else:  # an output buffer the caller passed in (an adapter's own buffer): written in place
                    _check_given(given, step[1], step[2], step[3])
            elif kind == _ARENA:
                a = step[1]
                base = ns[a.name] = empty((max(1, -(-a.nbytes // 4)),), dtype=np.float32)
                ptr = base.data.ptr
                for name, off in a.members:
                    ns[name] = ptr + off
            elif kind == _VIEW:
                ns[step[1]] = ns[step[2]][step[3]]
            else:
                _, names, fn, args = step
                out = fn(*(ns[a.name] if type(a) is Ref else a for a in args))
                ns.update(zip(names, out))
        return ns


def _check_given(a, name, shape, dtype):
    """A caller's buffer for the recorded allocation ``name``: it must be what ``cupy.empty(shape, dtype)`` would
    have made (C-contiguous, that shape and dtype, on the current device), since the launches index it so."""
    import cupy

    if not isinstance(a, cupy.ndarray):
        raise TypeError(f"output buffer {name!r} must be a CuPy array, got {type(a).__name__}")
    if (tuple(a.shape) != shape or a.dtype != np.dtype(dtype) or not a.flags.c_contiguous
            or a.data.device_id != cupy.cuda.runtime.getDevice()):
        raise ValueError(f"output buffer {name!r} must be a C-contiguous {np.dtype(dtype)} array of shape {shape} on "
                         f"the current device, got {a.dtype} {tuple(a.shape)} (C-contiguous: {a.flags.c_contiguous}, "
                         f"device {a.data.device_id})")


def scale_key(sm_scale):
    """``sm_scale`` as a key: its float value (what the validation keeps), None as None. Raises TypeError or
    ValueError when it is not a number (the caller then takes the uncached path, whose validation names it)."""
    return None if sm_scale is None else float(sm_scale)


def signature(x):
    """What a program depends on in an input array (CuPy array or BF16Array): its type, shape, strides, dtype and
    the 16-byte alignment of its address (a misaligned input is copied first)."""
    r = getattr(x, "bits", x)
    return type(x), r.shape, r.strides, r.dtype, r.data.ptr & 15


# os.environ.get encodes the name and decodes the value on every call (~1 us each on the H200 machine's CPU, 16 per
# forward call); where os.environ keeps its POSIX bytes dict (CPython), env_key reads that dict directly.
_ENV_BYTES = tuple(os.fsencode(n) for n in _ENV_VARS) if os.name == "posix" else None


def env_key() -> tuple:
    """The current device and the kernel-choosing environment variables (values as bytes where os.environ keeps
    bytes, else str: only compared with each other)."""
    import cupy

    data = getattr(os.environ, "_data", None)
    if _ENV_BYTES is not None and type(data) is dict:
        return (cupy.cuda.runtime.getDevice(),) + tuple(map(data.get, _ENV_BYTES))
    return (cupy.cuda.runtime.getDevice(),) + tuple(map(os.environ.get, _ENV_VARS))


class Plans(dict):
    """A bounded cache of plans (or programs) by key: when full, the oldest entry goes (insertion order)."""

    def __init__(self, cap: int = 256):
        super().__init__()
        self.cap = cap

    def put(self, key, plan):
        while len(self) >= self.cap:  # (pop with a default: a thread beside this one may evict the same entry)
            self.pop(next(iter(self), None), None)
        self[key] = plan
        return plan

    def get_or_build(self, make_key, build):
        """The entry under ``make_key()``, built by ``build()`` (which validates) on a miss. A key that cannot be made
        or hashed (an argument of the wrong type: ``build`` then raises the error that names it) is not cached."""
        try:
            key = make_key()
            hit = self.get(key)
        except (TypeError, ValueError):
            key = hit = None
        if hit is None:
            hit = build()
            if key is not None:
                self.put(key, hit)
        return hit


class Plan:
    """What a call signature determines: the problem (``p``), the config, the engine, which inputs are copied per
    call (``copy``: strided or misaligned), the recorded program, and the programs recorded after it by launch
    options (``launches``)."""

    __slots__ = ("p", "cfg", "engine", "copy", "prog", "launches")

    def __init__(self, p, cfg, engine, copy, prog):
        self.p, self.cfg, self.engine, self.copy, self.prog = p, cfg, engine, copy, prog
        self.launches = Plans(cap=16)

    def launch_program(self, p, cfg, make_key, build):
        """The launch program for ``make_key()``, recorded by ``build()`` once, when the caller's problem and config
        are this plan's (by value: the adapters rebuild equal objects); else built for this call only."""
        if (self.p is p or self.p == p) and (self.cfg is cfg or self.cfg == cfg):
            return self.launches.get_or_build(make_key, build)
        return build()
