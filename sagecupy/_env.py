"""The environment a measurement was taken in: versions, git commit, GPU or none.

Every analysis result carries this header (``sagecupy accuracy --format json``
writes it as its first line), so numbers can be traced to the code and machine
that produced them. Nothing here needs a GPU, and nothing here raises: a fact
that cannot be found is ``None``.
"""
from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import platform
import subprocess
import sys

__all__ = ["environment", "baseline_versions", "git_commit", "gpu_info", "nvrtc_info", "kernel_hashes",
           "package_version"]

# The CuPy distributions sagecupy's extras install (cuda12 / cuda13), then the source build.
_CUPY_DISTRIBUTIONS = ("cupy-cuda13x", "cupy-cuda12x", "cupy")


def package_version(distribution: str) -> str | None:
    """Installed version of a distribution, ``None`` if it is not installed."""
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def git_commit() -> str | None:
    """Commit of the checkout sagecupy is imported from, ``None`` when it is not a git checkout.

    A plain (non-editable) install copies the package out of the checkout, so it
    has no commit; an editable install reports the checkout's ``HEAD``, with a
    ``-dirty`` suffix when tracked files have uncommitted changes.
    """
    package_dir = os.path.dirname(os.path.abspath(__file__))
    root = os.path.dirname(package_dir)
    if not os.path.exists(os.path.join(root, ".git")):
        return None
    try:
        commit = subprocess.run(
            ["git", "-C", root, "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", root, "status", "--porcelain", "--untracked-files=no"],
            capture_output=True, text=True, timeout=10, check=True,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return f"{commit}-dirty" if dirty else commit


def _cupy_distribution() -> tuple[str | None, str | None]:
    for name in _CUPY_DISTRIBUTIONS:
        version = package_version(name)
        if version is not None:
            return name, version
    return None, None


def gpu_info() -> dict:
    """``{"gpu": name or None, "gpu_reason": why not, "cuda_runtime": ..., "cuda_driver": ...}``.

    Imports CuPy only when it is installed; a machine without a driver or device
    gives ``gpu=None`` and the reason, never an exception.
    """
    info = {"gpu": None, "gpu_count": 0, "compute_capability": None, "cuda_runtime": None, "cuda_driver": None,
            "gpu_reason": None}
    if importlib.util.find_spec("cupy") is None:
        info["gpu_reason"] = "CuPy is not installed"
        return info
    try:
        from cupy.cuda import runtime
    except Exception as exc:  # a broken CuPy install must not break `sagecupy info`
        info["gpu_reason"] = f"CuPy failed to import: {type(exc).__name__}: {exc}"
        return info
    try:
        info["cuda_runtime"] = runtime.runtimeGetVersion()
    except Exception:
        pass
    try:
        info["cuda_driver"] = runtime.driverGetVersion() or None  # 0: no driver
        count = runtime.getDeviceCount()
    except Exception as exc:
        from ._loader import cuda_error_reason

        info["gpu_reason"] = cuda_error_reason(exc) or f"no CUDA device: {type(exc).__name__}: {exc}".strip()
        return info
    if count < 1:
        info["gpu_reason"] = "no CUDA device"
        return info
    try:
        props = runtime.getDeviceProperties(0)
        name = props["name"]
        info["gpu"] = name.decode() if isinstance(name, bytes) else str(name)
        info["compute_capability"] = f"{props['major']}.{props['minor']}"
        info["gpu_count"] = count
    except Exception as exc:
        info["gpu_reason"] = f"device query failed: {type(exc).__name__}: {exc}"
    return info


def nvrtc_info() -> dict:
    """``{"nvrtc": version or None, "nvrtc_reason": what is missing or None}``: whether CuPy's NVRTC, which
    compiles every kernel at first use, loads here (:func:`sagecupy._loader.nvrtc_status`). Needs no GPU."""
    if importlib.util.find_spec("cupy") is None:  # not imported: a missing CuPy must stay cheap to report
        return {"nvrtc": None, "nvrtc_reason": "CuPy is not installed: pip install 'sagecupy[cuda13]' (or "
                                              "'sagecupy[cuda12]' for a CUDA 12 driver)"}
    try:
        from ._loader import nvrtc_status

        ok, text = nvrtc_status()
    except Exception as exc:  # never let the header break a run
        return {"nvrtc": None, "nvrtc_reason": f"NVRTC probe failed: {type(exc).__name__}: {exc}"}
    return {"nvrtc": text, "nvrtc_reason": None} if ok else {"nvrtc": None, "nvrtc_reason": text}


def environment() -> dict:
    """Versions, commit, machine and GPU (or ``None``) as a flat, JSON-ready dict."""
    from . import __version__

    cupy_dist, cupy_version = _cupy_distribution()
    env = {
        "sagecupy": __version__,
        "git_commit": git_commit(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "numpy": package_version("numpy"),
        "scipy": package_version("scipy"),
        "click": package_version("click"),
        "cupy": cupy_version,
        "cupy_distribution": cupy_dist,
        "kernel_sources": kernel_hashes(),
        "kernel_env": kernel_env(),
    }
    env.update(gpu_info())
    env.update(nvrtc_info())
    env.update(baseline_versions())
    return env


def baseline_versions() -> dict:
    """Versions of what the baselines run on: PyTorch, Triton, the cuDNN frontend (package metadata, no import) and
    the cuDNN library PyTorch loaded (only when PyTorch is already imported, as in a benchmark with baselines: the
    header must not import it)."""
    out = {"torch": package_version("torch"), "triton": package_version("triton"),
           "cudnn_frontend": package_version("nvidia-cudnn-frontend"), "cudnn": None}
    torch = sys.modules.get("torch")
    if torch is not None:
        try:
            out["cudnn"] = torch.backends.cudnn.version()
        except Exception:  # a CPU-only build, or no cuDNN: the header stays None
            pass
    return out


def kernel_env() -> dict:
    """The kernel-choosing environment variables that are set (``SAGECUPY_*``, e.g. an opt-in switch a benchmark
    ran with), name -> value."""
    from ._program import _ENV_VARS

    return {name: os.environ[name] for name in _ENV_VARS if name in os.environ}


def kernel_hashes() -> dict:
    """``{file: sha256 prefix}`` of every kernel source as compiled (headers inlined): identifies the kernels a
    result came from even where ``git_commit`` cannot (an installed copy, a machine with a stale ``.git``)."""
    try:
        from ._loader import kernel_dir, kernel_source

        root = kernel_dir()
        return {p.relative_to(root).as_posix(): kernel_source(p.relative_to(root).as_posix()).split("sha256:", 1)[1].split()[0]
                for p in sorted(root.glob("*/*.cu"))}
    except Exception:  # never let the header break a run
        return {}
