"""Compile the kernel modules the GPU families launch before the calls that need them (``sagecupy.warmup``, the
``sagecupy warmup`` command).

Every kernel is compiled at its first use (sagecupy/_loader.py). A module's key, in this process and in CuPy's disk
cache, is its source, compile options (target, ``SAGECUPY_DEFINES``) and name expressions; the warm-up compiles the
modules a call would, keyed the same way, so later processes (a training job's first step, parallel test workers)
load them from CuPy's disk cache instead of compiling each its own copy. The list is not kept here: each family's
``kernel_requests(dtype, D, engine)`` gives the ``get_function`` arguments its launches use (built by the functions
the launch sites call), and :func:`sagecupy._loader.module_names` turns them into modules as ``get_function`` does.

CuPy reads a module built with name expressions (every sagecupy module) back from its disk cache from CuPy 14.2 on
; an older CuPy recompiles it in every process, and :func:`cache_note` says so.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

from . import _loader

__all__ = ["warmup", "plan", "Module", "Result", "Summary", "FAMILIES", "DTYPES", "HEAD_DIMS", "ENGINES"]

# (the families' own values, _checks.SUPPORTED_HEAD_DIMS and their dtype tables, which import NumPy: `import sagecupy`
# does not; tests/cpu/test_warmup.py checks they agree)
FAMILIES = ("int8", "nvfp4", "qat")
DTYPES = ("float16", "bfloat16")
HEAD_DIMS = (64, 128)
ENGINES = ("mma", "wgmma")


@dataclass(frozen=True)
class Module:
    """One compiled unit: a source under kernels_cu/, its name expressions, its target (None: CuPy's default for the
    device)."""

    filename: str
    names: tuple
    arch: str | None = None


@dataclass
class Result:
    module: Module
    seconds: float
    error: str | None = None  # the compile error's text, None when it compiled (or came from CuPy's cache)


@dataclass
class Summary:
    """What :func:`warmup` did: a :class:`Result` per module (in the order they finished), the wall time, the
    (family, head_dim, engine, reason) combinations left out because their calls refuse to run on this device, and
    :func:`cache_note`'s text."""

    results: list = field(default_factory=list)
    seconds: float = 0.0
    jobs: int = 1
    skipped: list = field(default_factory=list)
    cache_note: str | None = None
    cache_files_added: int | None = None  # new .cubin files in CuPy's cache folder (None: folder not readable)

    @property
    def failures(self) -> list:
        return [r for r in self.results if r.error is not None]

    @property
    def compiled(self) -> list:
        return [r for r in self.results if r.error is None]

    def __str__(self) -> str:
        added = "" if self.cache_files_added is None else f", {self.cache_files_added} new in CuPy's cache"
        return (f"{len(self.compiled)} modules ready{added}, {len(self.failures)} failed, "
                f"{self.seconds:.1f} s ({self.jobs} job{'s' if self.jobs != 1 else ''})")


def _choices(what: str, values, supported: tuple, aliases: dict | None = None) -> tuple:
    """``values`` (one value or several) checked against ``supported`` (after ``aliases``), duplicates dropped:
    ValueError naming ``what``, the value and the supported ones."""
    if isinstance(values, (str, int)):
        values = (values,)
    out = []
    for v in values:
        v = (aliases or {}).get(v, v)
        if v not in supported or isinstance(v, bool):
            also = f" (or {', '.join(aliases)})" if aliases else ""
            raise ValueError(f"{what}: {v!r} is not supported; supported: {', '.join(map(str, supported))}{also}")
        if v not in out:
            out.append(v)
    if not out:
        raise ValueError(f"{what}: nothing given; supported: {', '.join(map(str, supported))}")
    return tuple(out)


def check_arguments(families=FAMILIES, dtypes=DTYPES, head_dims=HEAD_DIMS, engines=None) -> tuple:
    """The arguments of :func:`warmup` validated (no device needed): ``(families, dtypes, head_dims, engines)``,
    ``engines`` None where not given."""
    return (_choices("families", families, FAMILIES), _choices("dtypes", dtypes, DTYPES),
            _choices("head_dims", head_dims, HEAD_DIMS),
            None if engines is None else _choices("engines", engines, ENGINES))


def device_engines(engines=None) -> tuple:
    """``engines`` for the current device, checked (None: what it runs, the families' ``engine=None`` pick among
    them: wgmma only on sm_90, where ``engine="mma"`` is also accepted)."""
    cc = _loader.device_capability()
    if cc < (8, 0):
        raise ValueError(f"the kernels need compute capability 8.0 or newer; this device is {cc[0]}.{cc[1]}")
    if engines is None:
        return ENGINES if cc == (9, 0) else ("mma",)
    if "wgmma" in engines and cc != (9, 0):
        raise ValueError(f"engines: 'wgmma' needs compute capability 9.0 (Hopper); this device is {cc[0]}.{cc[1]}")
    return tuple(engines)


def _requests(family: str):
    import importlib

    return importlib.import_module(f"sagecupy.{family}").kernel_requests


def _refusal(family: str, head_dim: int, engine: str) -> str | None:
    """Why every call of ``family`` at ``head_dim`` on ``engine`` is refused before any launch on this device (the
    FP4 forwards' shared-memory check, which their entry points run first), or None."""
    if family == "int8":
        return None
    from .nvfp4 import check_fwd_smem

    try:
        check_fwd_smem(head_dim, engine, qat=family == "qat")
    except ValueError as exc:
        return str(exc)
    return None


def plan(families=FAMILIES, dtypes=DTYPES, head_dims=HEAD_DIMS, engines=None) -> tuple:
    """``(modules, skipped)``: the distinct :class:`Module` s the calls of these families compile on the current
    device for these dtypes, head dims and engines (None: :func:`device_engines`), in order of first use; and the
    (family, head_dim, engine, reason) combinations left out (see :func:`_refusal`). Compiles nothing."""
    families, dtypes, head_dims, engines = check_arguments(families, dtypes, head_dims, engines)
    engines = device_engines(engines)
    modules, skipped = {}, []
    for family in families:
        requests = _requests(family)
        for D in head_dims:
            for engine in engines:
                why = _refusal(family, D, engine)
                if why:
                    skipped.append((family, D, engine, why))
                    continue
                for dtype in dtypes:
                    for filename, name, all_names, arch in requests(dtype, D, engine):
                        modules.setdefault(Module(filename, _loader.module_names(name, all_names), arch), None)
    return list(modules), skipped


def _compile(module: Module, device: int | None = None) -> Result:
    """Compile (or load from CuPy's disk cache) one module in this process, as get_function would."""
    t0 = time.perf_counter()
    try:
        if device is not None:  # (a worker process: the parent's device)
            import cupy

            cupy.cuda.Device(device).use()
        _loader._module(module.filename, module.names, module.arch)
    except Exception as exc:  # one bad module is reported, the others still compile
        return Result(module, time.perf_counter() - t0, f"{type(exc).__name__}: {exc}")
    return Result(module, time.perf_counter() - t0)


def cache_dir() -> str:
    """CuPy's kernel cache folder (``CUPY_CACHE_DIR``, default ``~/.cupy/kernel_cache``)."""
    return os.environ.get("CUPY_CACHE_DIR") or os.path.expanduser("~/.cupy/kernel_cache")


def _cubins() -> int | None:
    try:
        return sum(1 for n in os.listdir(cache_dir()) if n.endswith(".cubin"))
    except OSError:
        return None


def cache_note() -> str | None:
    """Why the modules compiled here will not be read back from CuPy's disk cache by other processes, or None."""
    if os.environ.get("CUPY_CACHE_IN_MEMORY", "") not in ("", "0"):
        return "CUPY_CACHE_IN_MEMORY is set: CuPy keeps no disk cache, so only this process gains"
    try:
        import cupy

        version = tuple(int(x) for x in cupy.__version__.split(".")[:2])
    except Exception:
        return None
    # 14.1 matched cached modules by demangled symbol names, which spell out defaulted template arguments that
    # sagecupy's name expressions leave out, so its hits are not to be relied on either
    if version < (14, 2):
        return (f"CuPy {cupy.__version__} does not read modules built with name expressions (all of sagecupy's) "
                f"from its disk cache: every process compiles its own; CuPy >= 14.2 reuses them")
    return None


def warmup(families=FAMILIES, dtypes=DTYPES, head_dims=HEAD_DIMS, engines=None, *, jobs: int = 1,
           strict: bool = False, on_file=None) -> Summary:
    """Compile, for the current device, every kernel module the ``families``' calls (forward, backward, every config
    the kernels implement, causal or not) launch for inputs of ``dtypes`` and ``head_dims`` on ``engines`` (None:
    what the device runs; on sm_90 both, since ``engine="mma"`` is accepted there): later calls in any process then
    load them from CuPy's disk cache (see :func:`cache_note`).

    ``jobs``: modules compiled at once. 1 compiles here (the modules also stay loaded in this process); more start
    that many worker processes (spawned: the parent may hold a CUDA context, which a forked child cannot use; a script
    calling this with ``jobs > 1`` needs the ``if __name__ == "__main__":`` guard), each with a CUDA context of its
    own; NVRTC runs on one core per compile. ``strict``: raise RuntimeError (after compiling the rest) if any module
    failed; by default failures are in the returned :class:`Summary` with their error text. ``on_file(filename,
    results)``: called as each source file's modules are all done. Arguments are checked before the device is asked.
    """
    if isinstance(jobs, bool) or not isinstance(jobs, int) or jobs < 1:
        raise ValueError(f"jobs: {jobs!r} is not supported; a positive integer is")
    t0 = time.perf_counter()
    modules, skipped = plan(families, dtypes, head_dims, engines)
    before = _cubins()
    summary = Summary(jobs=min(jobs, max(len(modules), 1)), skipped=skipped, cache_note=cache_note())
    left = {}
    for m in modules:
        left[m.filename] = left.get(m.filename, 0) + 1
    done = {}

    def finished(result):
        summary.results.append(result)
        name = result.module.filename
        done.setdefault(name, []).append(result)
        left[name] -= 1
        if left[name] == 0 and on_file is not None:
            on_file(name, done[name])

    if summary.jobs == 1:
        for m in modules:
            finished(_compile(m))
    else:
        _parallel(modules, summary.jobs, finished)
    after = _cubins()
    summary.cache_files_added = None if before is None or after is None else after - before
    summary.seconds = time.perf_counter() - t0
    if strict and summary.failures:
        raise RuntimeError(f"sagecupy.warmup: {len(summary.failures)} of {len(modules)} modules failed:\n" + "\n".join(
            f"{r.module.filename} {r.module.names[0]}...: {r.error}" for r in summary.failures))
    return summary


def _parallel(modules: list, jobs: int, finished) -> None:
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor, as_completed

    import cupy

    device = cupy.cuda.Device().id
    # The lists compiled for a Hopper target and the longest lists first: the longest compiles then overlap the rest
    # instead of starting last (a heuristic: compile time is not known ahead).
    order = sorted(modules, key=lambda m: (m.arch is None, -len(m.names)))
    with ProcessPoolExecutor(max_workers=jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = {pool.submit(_compile, m, device): m for m in order}
        for future in as_completed(futures):
            try:
                result = future.result()
            except Exception as exc:  # a worker that died (BrokenProcessPool): its module is a failure
                result = Result(futures[future], 0.0, f"{type(exc).__name__}: {exc}")
            finished(result)
