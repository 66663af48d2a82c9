"""The loader's source inlining (what NVRTC compiles), checked without a GPU."""
import re

from sagecupy import _loader


def test_every_kernel_source_inlines_all_quoted_includes():
    files = sorted(p.name for p in _loader.kernel_dir().glob("*.cu"))
    assert "int8_attn_bwd.cu" in files
    for name in files:
        src = _loader.kernel_source(name)
        left = re.findall(r'^\s*#\s*include\s+"[^"]+"', src, re.MULTILINE)
        assert not left, f"{name}: NVRTC would have to find {left}"


def test_include_with_trailing_comment_is_inlined(tmp_path):
    (tmp_path / "h.cuh").write_text("#pragma once\nint from_header;\n")
    (tmp_path / "k.cu").write_text('#include "h.cuh"  // why it is needed\n#include "h.cuh"\nint body;\n')
    out = _loader._inline(tmp_path / "k.cu", set())
    assert out.count("int from_header;") == 1 and "int body;" in out and '#include "' not in out
