"""Launch programs: a call's allocations and kernel launches recorded once per call signature and replayed.

A public call (``int8.forward``, ``int8.backward``) validates its arguments, derives shapes, strides, padded
sizes, kernel names and launch geometry, looks the kernels up and converts the scalar arguments; that host work
depends only on the *signature* of the call (shapes, strides, dtypes, 16-byte alignment of the inputs, the keyword
arguments, the device and the ``SAGECUPY_*`` environment variables that choose kernels), not on the data. So the
first call with a signature records a :class:`Program` (the arrays to allocate, by name and shape, and the launches
with their constant arguments and the names of the arrays they take) and later calls with the same signature
replay it: allocations and launches only. On the H200 the synchronized 4K INT8 forward spent more host time before
and between its launches than its pre-pass kernels take on the device (``bench/host_costs.py``; bench/NOTES.md,
fifteenth session).

Every call, the first one included, runs the recorded program, so the tests exercise the replay path.
"""
from __future__ import annotations

import os

__all__ = ["Ref", "Program", "Plan", "Plans", "signature", "scale_key", "env_key", "NOT_KERNEL_CHOOSING"]

_ALLOC, _VIEW, _LAUNCH, _CALL = 0, 1, 2, 3

#: Environment variables that choose kernels (engines, CTA sizes, compile-time defines, another kernel tree):
#: part of every program's key, so that changing one between calls takes effect as it did before programs. A new
#: ``SAGECUPY_*`` switch read by the package must be added here (``tests/cpu/test_program.py`` checks the package's
#: sources for names missing from this list and from ``NOT_KERNEL_CHOOSING``).
_ENV_VARS = ("SAGECUPY_FWD_ENGINE", "SAGECUPY_BWD_ENGINE", "SAGECUPY_FWD_WARPS", "SAGECUPY_FP4_ENGINE",
             "SAGECUPY_FP4_WARPS", "SAGECUPY_FP4_CAUSAL_GROUP", "SAGECUPY_DEFINES", "SAGECUPY_KERNELS_DIR")
#: Variables the package reads that do not change which kernels run or how (debug output only).
NOT_KERNEL_CHOOSING = ("SAGECUPY_DEBUG", "SAGECUPY_JIT_DEBUG")


class Ref:
    """A per-call array in a recorded launch's arguments: the name it has in the program's namespace."""

    __slots__ = ("name",)

    def __init__(self, name: str):
        self.name = name

    def __repr__(self):
        return f"Ref({self.name!r})"


class Program:
    """Allocations and launches, replayed by :meth:`run` into a namespace (a dict of arrays by name)."""

    __slots__ = ("steps",)

    def __init__(self):
        self.steps = []

    def empty(self, name: str, shape, dtype) -> Ref:
        """Record ``cupy.empty(shape, dtype)`` under ``name``."""
        self.steps.append((_ALLOC, name, tuple(int(s) for s in shape), dtype))
        return Ref(name)

    def view(self, name: str, parent: Ref, index) -> Ref:
        """Record ``name = parent[index]`` (a view)."""
        self.steps.append((_VIEW, name, parent.name, index))
        return Ref(name)

    def launch(self, fn, grid, block, args, shared_mem: int = 0):
        """Record ``fn(grid, block, args, shared_mem=shared_mem)``; :class:`Ref` arguments are looked up per run,
        the others (numpy scalars, None) are used as they are."""
        template = list(args)
        refs = tuple((i, a.name) for i, a in enumerate(template) if type(a) is Ref)
        for i, _ in refs:
            template[i] = None
        self.steps.append((_LAUNCH, fn, tuple(grid), tuple(block), template, refs, int(shared_mem)))

    def call(self, names, fn, args) -> tuple:
        """Record ``names = fn(*args)`` (host glue that is neither an allocation nor a launch; ``args``: Refs or
        constants); returns Refs to the results."""
        self.steps.append((_CALL, tuple(names), fn, tuple(args)))
        return tuple(Ref(n) for n in names)

    def run(self, ns: dict) -> dict:
        """Replay into ``ns`` (which holds the per-call inputs by name); returns ``ns``."""
        import cupy

        empty = cupy.empty
        for step in self.steps:
            kind = step[0]
            if kind == _LAUNCH:
                _, fn, grid, block, template, refs, smem = step
                args = template.copy()
                for i, name in refs:
                    args[i] = ns[name]
                fn(grid, block, tuple(args), shared_mem=smem)
            elif kind == _ALLOC:
                ns[step[1]] = empty(step[2], dtype=step[3])
            elif kind == _VIEW:
                ns[step[1]] = ns[step[2]][step[3]]
            else:
                _, names, fn, args = step
                out = fn(*(ns[a.name] if type(a) is Ref else a for a in args))
                ns.update(zip(names, out))
        return ns


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
        while len(self) >= self.cap:
            del self[next(iter(self))]
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
        if self.p == p and self.cfg == cfg:
            return self.launches.get_or_build(make_key, build)
        return build()
