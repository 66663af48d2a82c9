"""The CI's kernel compile report (.ci/compile_kernels.py): what it reads from ptxas -v."""
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _ck():
    sys.path.insert(0, str(ROOT / ".ci"))
    try:
        import compile_kernels
    finally:
        sys.path.remove(str(ROOT / ".ci"))
    return compile_kernels


def test_parse_ptxas_reads_registers_spills_and_stack_frames():
    """A frame without spills (a local array indexed at run time, as a max tree left as a loop once was) is reported
    apart from spills, per function, and the counters restart for the next function."""
    log = """ptxas info    : Compiling entry function '_Z1aPf' for 'sm_90a'
ptxas info    : Function properties for _Z1aPf
    64 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 253 registers, used 1 barriers, 128 bytes smem
ptxas info    : Compiling entry function '_Z1bPf' for 'sm_90a'
ptxas info    : Function properties for _Z1bPf
    184 bytes stack frame, 508 bytes spill stores, 660 bytes spill loads
ptxas info    : Used 168 registers, used 1 barriers
ptxas info    : Compiling entry function '_Z1cPf' for 'sm_90a'
ptxas info    : Used 40 registers
"""
    assert _ck().parse_ptxas(log) == [("_Z1aPf", 253, 0, 0, 64), ("_Z1bPf", 168, 508, 660, 184), ("_Z1cPf", 40, 0, 0, 0)]


def test_test_module_basenames_are_unique():
    # The test folders have no __init__.py, so pytest imports each module by its basename: two files of one name
    # (tests/cpu/x.py and tests/gpu/x.py) stop the whole run at collection.
    from collections import Counter
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    names = Counter(p.name for p in root.rglob("test_*.py"))
    assert [n for n, c in names.items() if c > 1] == []
