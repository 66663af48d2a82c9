"""Shared pytest setup.

Tests marked ``gpu`` need CuPy and a CUDA device. Without one they are skipped
(CI has no GPU); ``--require-gpu`` turns those skips into failures so a run on a
GPU machine cannot pass by skipping.
"""
import functools
import os

import pytest

# JAX grabs 75% of the GPU's memory at its first use unless told not to; the CuPy kernels in the same
# process need it (tests/gpu/test_jax_adapter.py sets this too, but another module may start JAX first).
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")


def pytest_addoption(parser):
    parser.addoption(
        "--require-gpu",
        action="store_true",
        default=False,
        help="fail (instead of skip) the gpu-marked tests when no CUDA device is usable",
    )
    parser.addoption(
        "--fuzz-cases",
        type=int,
        default=None,
        help="cases per family in tests/gpu/test_fuzz.py (default its FULL_CASES; past QUICK_CASES they need -m slow)",
    )


@functools.lru_cache(maxsize=None)
def _gpu_status():
    # the package's own check (CuPy, a device, NVRTC: every kernel compiles through it, so without it skip, not fail)
    from sagecupy._loader import gpu_status

    return gpu_status()


def pytest_runtest_setup(item):
    if item.get_closest_marker("gpu") is None:
        return
    ok, reason = _gpu_status()
    if ok:
        return
    if item.config.getoption("--require-gpu"):
        pytest.fail(f"--require-gpu given but {reason}", pytrace=False)
    pytest.skip(f"gpu test: {reason}")
