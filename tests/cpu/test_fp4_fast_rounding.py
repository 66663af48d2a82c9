"""The GPU's fast NVFP4 rounding (kernels_cu/common/fp4.cuh nvfp4_fq8 / nvfp4_block_exact16: multiplication by
1/s and a 16-bit snap instead of division) equals the reference for every fp16 / fp32-normal bf16 input and every
E4M3 scale, emulated exactly in numpy (bench/tools/fp4_fast_rounding_check.py)."""
import importlib.util
from pathlib import Path


def test_fast_rounding_is_exact_for_every_16_bit_input():
    path = Path(__file__).resolve().parents[2] / "bench" / "tools" / "fp4_fast_rounding_check.py"
    spec = importlib.util.spec_from_file_location("fp4_fast_rounding_check", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.check(snap=True) == {"fp16": (0, 0), "bf16": (0, 0)}
