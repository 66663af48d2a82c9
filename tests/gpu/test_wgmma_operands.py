"""The 16-bit wgmma products with an MN-major B operand (common/wgmma.cuh: wgmma_rs<T, true>, desc_mn16), checked
exactly against numpy on small integers (every product and sum is exact in fp32). They are the building block
of the QAT backward's wgmma kernels; a layout error shows here as a plain wrong matrix."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

_SRC = Path(__file__).with_name("wgmma_operands.cu")
_TYPES = {"float16": "__half", "bfloat16": "__nv_bfloat16"}


def _names():
    return (tuple(f"wgmma_rs_mn_product<{T}, {n}>" for T in _TYPES.values() for n in (64, 128))
            + tuple(f"wgmma_ss_mn_product<{T}, {f}>" for T in _TYPES.values() for f in ("true", "false")))


@pytest.fixture(scope="module")
def module():
    cupy = pytest.importorskip("cupy")
    from sagecupy import _loader

    if _loader.device_capability() != (9, 0):
        pytest.skip("wgmma needs compute capability 9.0")
    source = _loader.inline_file(_SRC)
    mod = cupy.RawModule(code=source, options=_loader._options("sm_90a"), name_expressions=_names())
    mod.compile()
    return mod


def _dev(dtype, *xs):
    import cupy

    from sagecupy.adapters.bf16 import BF16Array

    if dtype == "float16":
        return [cupy.asarray(x.astype(np.float16)) for x in xs]
    return [BF16Array.from_float(cupy.asarray(x)).bits for x in xs]  # small integers: exact


def _run(module, dtype, n, a, b):
    import cupy

    T = _TYPES[dtype]
    fn = module.get_function(f"wgmma_rs_mn_product<{T}, {n}>")
    da, db = _dev(dtype, a, b)
    c = cupy.full((64, n), np.nan, dtype=cupy.float32)
    smem = 1024 + 8192 + 64 * 2 * n
    fn.max_dynamic_shared_size_bytes = smem
    fn((1,), (128,), (da, db, c), shared_mem=smem)
    return cupy.asnumpy(c)


@pytest.mark.parametrize("dtype", list(_TYPES))
@pytest.mark.parametrize("n", [64, 128])
def test_register_a_times_mn_major_b_is_exact(module, dtype, n):
    rng = np.random.default_rng(n)
    a = rng.integers(-8, 9, size=(64, 64)).astype(np.float32)
    b = rng.integers(-8, 9, size=(64, n)).astype(np.float32)
    want = a.astype(np.float64) @ b.astype(np.float64)
    got = _run(module, dtype, n, a, b)
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("dtype", list(_TYPES))
@pytest.mark.parametrize("a_mn", [True, False])
def test_shared_a_and_b_with_one_mn_major_operand_is_exact(module, dtype, a_mn):
    """wgmma_ss with an M-major A (from A^T in memory) or an N-major B (from B as it lies), the QAT backward's
    two dP products, against numpy."""
    import cupy

    rng = np.random.default_rng(7 + a_mn)
    a = rng.integers(-8, 9, size=(64, 64)).astype(np.float32)
    b = rng.integers(-8, 9, size=(64, 64)).astype(np.float32)
    want = a.astype(np.float64) @ b.astype(np.float64)
    da, db = _dev(dtype, np.ascontiguousarray(a.T) if a_mn else a, np.ascontiguousarray(b.T) if a_mn else b)
    fn = module.get_function(f"wgmma_ss_mn_product<{_TYPES[dtype]}, {'true' if a_mn else 'false'}>")
    c = cupy.full((64, 64), np.nan, dtype=cupy.float32)
    smem = 1024 + 2 * 8192
    fn((1,), (128,), (da, db, c), shared_mem=smem)
    np.testing.assert_array_equal(cupy.asnumpy(c), want)
