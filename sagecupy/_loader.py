"""The one place that turns ``kernels_cu/*.cu`` into cached CuPy modules.

* Sources are read as text; every ``#include "common/..."`` is inlined (once per file, honouring
  ``#pragma once``), so the string CuPy compiles holds every header it uses and an edited ``.cuh``
  can never reuse a stale binary. The source starts with a comment holding a SHA-256 of the inlined
  text, which is part of the cache key and names the build in debug dumps. CuPy's disk cache keys on
  the same string and options (observed to persist across processes with CuPy 14.2).
* Template variants are instantiated through ``name_expressions``.
* Modules are cached in memory, per process, per (device, source hash, options, name expressions).
  ``sagecupy.warmup`` (sagecupy/_warmup.py) compiles every module the families use ahead of their calls.
* ``SAGECUPY_DEFINES="A=1,B=2"`` adds ``-DA=1 -DB=2`` to every compile (tuning experiments; the
  defines are part of the cache key).
* ``SAGECUPY_KERNELS_DIR=/path/kernels_cu`` compiles the sources of another folder instead (A/B timing of two
  kernel trees in one process: ``bench/ab.py`` against a copy of an earlier commit's kernels).
* ``SAGECUPY_JIT_DEBUG=1`` writes the generated source and compiler options to a temporary
  folder (and prints where) for every compile; a compile failure always says how to get them.
"""
from __future__ import annotations

import functools
import hashlib
import os
import re
import sys
import tempfile
from importlib import resources
from pathlib import Path

__all__ = ["gpu_status", "nvrtc_status", "cuda_error_reason", "kernel_dir", "kernel_source", "get_function",
           "module_names", "cuda_include_dir"]

_INCLUDE_RE = re.compile(r'^\s*#\s*include\s+"([^"]+)"[ \t]*(?://[^\n]*)?$', re.MULTILINE)  # a trailing // comment too


def kernel_dir() -> Path:
    """Folder of the CUDA sources (``sagecupy/kernels_cu`` when installed, ``kernels_cu/`` in a checkout;
    ``SAGECUPY_KERNELS_DIR`` overrides both)."""
    if os.environ.get("SAGECUPY_KERNELS_DIR"):
        return Path(os.environ["SAGECUPY_KERNELS_DIR"]).resolve()  # absolute: the caches key on it
    try:
        base = resources.files("sagecupy.kernels_cu")
        path = Path(str(base))
        if (path / "int8" / "int8_attn_fwd.cu").is_file():
            return path
    except (ModuleNotFoundError, TypeError):
        pass
    return Path(__file__).resolve().parent.parent / "kernels_cu"


def _inline(path: Path, seen: set, root: Path) -> str:
    text = path.read_text()
    if "#pragma once" in text:
        if path in seen:
            return ""
        seen.add(path)
        text = text.replace("#pragma once", "")

    def repl(m):
        # Every include names its header from the kernel root ("common/mma.cuh", "int8/fwd.cuh"), as nvcc sees
        # them with -I <kernel root>: one rule, whichever folder the including file is in.
        inc = (root / m.group(1)).resolve()
        if not inc.is_file():
            raise FileNotFoundError(f"{path}: #include \"{m.group(1)}\" is not a file under {root}")
        return f"// ---- begin {m.group(1)}\n{_inline(inc, seen, root)}\n// ---- end {m.group(1)}"

    return _INCLUDE_RE.sub(repl, text)


def inline_file(path) -> str:
    """A CUDA file outside the kernel tree (a test's harness) with its ``#include "…"`` lines inlined, each named from
    the kernel root as in the tree's own files."""
    return _inline(Path(path).resolve(), set(), kernel_dir().resolve())


def kernel_source(filename: str) -> str:
    """The self-contained source of ``kernels_cu/<filename>`` with a content hash on its first line."""
    return _kernel_source(str(kernel_dir()), filename)


@functools.lru_cache(maxsize=None)
def _kernel_source(folder: str, filename: str) -> str:
    body = _inline((Path(folder) / filename).resolve(), set(), Path(folder).resolve())
    digest = hashlib.sha256(body.encode()).hexdigest()[:16]
    return f"// sagecupy {filename} sha256:{digest}\n{body}"


@functools.lru_cache(maxsize=None)
def cuda_include_dir() -> str | None:
    """A folder holding ``cuda_fp16.h`` for NVRTC, or None (then NVRTC's own search path is used)."""
    candidates = []
    for var in ("CUDA_PATH", "CUDA_HOME"):
        if os.environ.get(var):
            candidates.append(Path(os.environ[var]) / "include")
    try:
        import cupy

        candidates.append(Path(cupy.cuda.get_cuda_path() or "") / "include")
    except Exception:
        pass
    candidates += [Path("/usr/local/cuda/include")]
    for site in sys.path:
        nv = Path(site) / "nvidia"
        if nv.is_dir():
            candidates += sorted(nv.glob("*/include"))
    for c in candidates:
        if (c / "cuda_fp16.h").is_file():
            return str(c)
    return None


#: cudaErrorInsufficientDriver. CuPy words it "CUDA driver version is insufficient for CUDA runtime version",
#: and it is also what the runtime reports when no driver is installed at all.
_INSUFFICIENT_DRIVER = 35


def _driver_library() -> str:
    return "nvcuda.dll" if sys.platform == "win32" else "libcuda.so.1"


def _driver_loads() -> bool:
    """Whether the NVIDIA driver's user-space library can be loaded."""
    import ctypes

    try:
        ctypes.CDLL(_driver_library())
    except OSError:
        return False
    return True


def _cuda_version(encoded) -> str | None:
    """``12040`` -> ``"12.4"`` (CUDA's version encoding); None for 0 (no driver) or a non-number."""
    try:
        encoded = int(encoded)
    except (TypeError, ValueError):
        return None
    return f"{encoded // 1000}.{encoded % 1000 // 10}" if encoded > 0 else None


def cuda_error_reason(exc: BaseException) -> str | None:
    """What a CUDA runtime error means for the user, where CuPy's own text would mislead; else None.

    cudaErrorInsufficientDriver: "no NVIDIA driver found" when the driver library does not load, else which
    CUDA the driver supports against the one this CuPy needs.
    """
    if getattr(exc, "status", None) != _INSUFFICIENT_DRIVER and "cudaErrorInsufficientDriver" not in str(exc):
        return None
    if not _driver_loads():
        return f"no NVIDIA driver found ({_driver_library()} is not installed)"
    need = have = None
    try:
        import cupy

        need = _cuda_version(cupy.cuda.runtime.runtimeGetVersion())
        have = _cuda_version(cupy.cuda.runtime.driverGetVersion())
    except Exception:
        pass
    text = f"the NVIDIA driver is older than CUDA {need} needs" if need else \
        "the NVIDIA driver is older than this CuPy's CUDA runtime needs"
    if have:
        text += f" (the driver supports CUDA {have})"
    text += ": update the driver"
    if have and need and have.split(".")[0] == "12" and need.split(".")[0] != "12":
        text += " or install CuPy for CUDA 12 (pip install 'sagecupy[cuda12]')"
    return text


def gpu_status() -> tuple[bool, str]:
    """(True, device name) when CuPy imports, a CUDA device answers and NVRTC loads (:func:`nvrtc_status`: every
    kernel is compiled at first use), else (False, why)."""
    try:
        import cupy
    except Exception as exc:
        return False, f"CuPy is not importable ({type(exc).__name__}: {exc})"
    try:
        n = cupy.cuda.runtime.getDeviceCount()
        if n < 1:
            return False, "no CUDA device"
        props = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)
        name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
        device = f"{name} (sm_{props['major']}{props['minor']})"
    except Exception as exc:
        return False, cuda_error_reason(exc) or f"no usable CUDA device ({type(exc).__name__}: {exc})"
    ok, nvrtc = nvrtc_status()
    if not ok:
        return False, f"{device} found, but the kernels cannot be compiled: {nvrtc}"
    return True, device


#: What to install when NVRTC is missing: CuPy's [ctk] extra (through sagecupy's) brings NVRTC and the CUDA headers.
_NVRTC_HINT = "pip install 'sagecupy[cuda13]' (or 'sagecupy[cuda12]' for a CUDA 12 driver), or a CUDA toolkit"


def nvrtc_status() -> tuple[bool, str]:
    """(True, NVRTC's version as "13.0") when CuPy imports and its NVRTC library loads, else (False, what is missing).

    Every kernel is compiled at first use by NVRTC, which CuPy loads lazily: a CuPy wheel installed without its CUDA
    toolkit wheels imports and sees the GPU, then fails at the first compile. Needs no GPU."""
    try:
        import cupy
    except Exception as exc:
        return False, f"CuPy is not importable ({type(exc).__name__}: {exc}): {_NVRTC_HINT}"
    try:
        major, minor = cupy.cuda.nvrtc.getVersion()
    except Exception as exc:  # CuPy raises RuntimeError naming the library it could not load
        return False, f"NVRTC does not load ({type(exc).__name__}: {' '.join(str(exc).split())}): {_NVRTC_HINT}"
    return True, f"{major}.{minor}"


def _options(arch: str | None = None) -> tuple:
    opts = ["--std=c++17"]
    if arch:
        opts.append(f"--gpu-architecture={arch}")
    inc = cuda_include_dir()
    if inc:
        opts.append(f"-I{inc}")
    for d in filter(None, os.environ.get("SAGECUPY_DEFINES", "").split(",")):
        opts.append(f"-D{d.strip()}")
    return tuple(opts)


_modules: dict = {}


def _dump(source: str, options: tuple, names: tuple, error: str | None = None) -> str:
    folder = Path(tempfile.mkdtemp(prefix="sagecupy_jit_"))
    (folder / "source.cu").write_text(source)
    (folder / "options.txt").write_text("\n".join(options) + "\n\nname_expressions:\n" + "\n".join(names) + "\n")
    if error:
        (folder / "error.txt").write_text(error)
    return str(folder)


def _module(filename: str, names: tuple, arch: str | None = None):
    import cupy

    dev = cupy.cuda.Device().id
    source = kernel_source(filename)
    options = _options(arch)
    # The source's first line carries its hash: the key (every launch computes it, so no pass over the
    # ~100 KB source here: splitting it costs ~0.1 ms per kernel launch).
    key = (dev, source[:source.find("\n")], options, names)
    mod = _modules.get(key)
    if mod is not None:
        return mod
    debug = os.environ.get("SAGECUPY_JIT_DEBUG", "") not in ("", "0")
    if debug:
        print(f"sagecupy: JIT {filename} -> {_dump(source, options, names)}", file=sys.stderr)
    try:
        mod = cupy.RawModule(code=source, options=options, name_expressions=names)
        mod.compile()
    except Exception as exc:
        where = _dump(source, options, names, error=str(exc)) if debug else "set SAGECUPY_JIT_DEBUG=1 to dump it"
        raise RuntimeError(f"sagecupy: compiling {filename} failed ({where}):\n{exc}") from exc
    _modules[key] = mod
    return mod


_functions: dict = {}


def get_function(filename: str, name: str, *, all_names: tuple | None = None, arch: str | None = None):
    """The compiled kernel ``name`` (a template instantiation such as ``"f<__half, 128>"``) of ``filename``.

    ``all_names``: instantiate these together in one module (one compile for several variants); a ``name`` not
    among them (an instance left out of the list: single-level P, a non-default CTA size) compiles alone, in a
    module of its own: adding it to the list would compile every listed instance again for each such name (a file
    such as nvfp4/fp4_attn_fwd_sm90.cu takes minutes), and would not reuse the list's module either.
    ``arch``: a target such as ``"sm_90a"`` for kernels that need architecture-specific instructions
    (wgmma); default: CuPy's choice for the current device.
    Every launch asks, so the answer is cached per (device, arguments, ``SAGECUPY_DEFINES``,
    ``SAGECUPY_KERNELS_DIR``) in front of the module cache. With ``SAGECUPY_DEFINES`` set (experiments, which time a
    kernel or two per define set on a fresh machine) only ``name`` is compiled, not ``all_names``.
    """
    import cupy

    if all_names is not None and not isinstance(all_names, tuple):
        all_names = tuple(all_names)
    defines = os.environ.get("SAGECUPY_DEFINES", "")
    key = (cupy.cuda.runtime.getDevice(), filename, name, all_names, arch, defines,
           os.environ.get("SAGECUPY_KERNELS_DIR", ""))
    fn = _functions.get(key)
    if fn is None:
        fn = _functions[key] = _module(filename, module_names(name, all_names), arch).get_function(name)
    return fn


def module_names(name: str, all_names=None) -> tuple:
    """The name expressions of the module that ``get_function(filename, name, all_names=all_names)`` compiles:
    ``all_names`` where ``name`` is among them and ``SAGECUPY_DEFINES`` is unset, else ``name`` alone. With the
    file, this tuple and ``arch`` it is the module's cache key in this process and (with the source and the compile
    options) in CuPy's disk cache, so :mod:`sagecupy.warmup` compiles through it too."""
    if all_names is not None and not isinstance(all_names, tuple):
        all_names = tuple(all_names)
    if all_names and name in all_names and not os.environ.get("SAGECUPY_DEFINES", ""):
        return all_names
    return (name,)


def device_capability() -> tuple[int, int]:
    """(major, minor) of the current CUDA device (cached per device: every kernel call asks)."""
    import cupy

    return _capability(cupy.cuda.Device().id)


@functools.lru_cache(maxsize=None)
def _capability(device_id: int) -> tuple[int, int]:
    import cupy

    props = cupy.cuda.runtime.getDeviceProperties(device_id)
    return int(props["major"]), int(props["minor"])
