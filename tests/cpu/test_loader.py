"""The loader's source inlining (what NVRTC compiles), checked without a GPU."""
import re

from sagecupy import _loader


def test_every_kernel_source_inlines_all_quoted_includes():
    files = sorted(p.relative_to(_loader.kernel_dir()).as_posix() for p in _loader.kernel_dir().glob("*/*.cu"))
    assert "int8/int8_attn_bwd.cu" in files
    for name in files:
        src = _loader.kernel_source(name)
        left = re.findall(r'^\s*#\s*include\s+"[^"]+"', src, re.MULTILINE)
        assert not left, f"{name}: NVRTC would have to find {left}"


def test_include_with_trailing_comment_is_inlined(tmp_path):
    (tmp_path / "h.cuh").write_text("#pragma once\nint from_header;\n")
    (tmp_path / "k.cu").write_text('#include "h.cuh"  // why it is needed\n#include "h.cuh"\nint body;\n')
    out = _loader._inline(tmp_path / "k.cu", set(), tmp_path)
    assert out.count("int from_header;") == 1 and "int body;" in out and '#include "' not in out


def test_engine_names_are_validated_before_any_device_query(monkeypatch):
    """A bad engine name is a ValueError naming the argument and what is supported; this needs no GPU (the device
    is asked only to resolve "auto" and to check "wgmma")."""
    import pytest

    from sagecupy import int8, nvfp4

    with pytest.raises(ValueError, match=r"engine='tensor' is not supported; supported: \('auto', 'mma', 'wgmma'\)"):
        nvfp4.fp4_engine("tensor")
    with pytest.raises(ValueError, match=r"engine='x'"):
        int8.forward_engine("x")
    with pytest.raises(ValueError, match=r"engine='x'"):
        int8.backward_engine("x")
    assert nvfp4.fp4_engine("mma") == "mma"


def test_fp4_shared_memory_sizes_and_kernel_lists():
    """The host's shared-memory formula needs a resolved engine; the lists CI compiles (and the loader at a file's
    first use) hold exactly the FP4 forward instances the defaults launch: mma.sync 8 warps; wgmma at D=64 4 warps
    (both P modes, plain and causal dispatch order); at D=128 the K/V stage images' kernels and the warp-specialized
    kernel on them (two-level P: plain and causal order, and the tail split)."""
    import pytest

    from sagecupy import nvfp4

    with pytest.raises(ValueError, match="resolved engine"):
        nvfp4.fwd_smem_bytes(128, 8, "auto")
    lists = nvfp4.kernel_names()
    T2 = ("__half", "__nv_bfloat16")
    names = lists["nvfp4/fp4_attn_fwd_sm90.cu"]
    assert len(names) == len(set(names)) == 8 + 1 + 2 + 6
    assert set(names) == {f"nvfp4_attn_fwd_sm90<{T}, 64, 4, {tl}{cg}>" for T in T2 for tl in ("true", "false")
                          for cg in ("", ", 16")} | {"nvfp4_kv_images<128>"} | {
        f"nvfp4_kv_images_raw<{T}, 128>" for T in T2} | {
        f"nvfp4_attn_fwd_ws_img<{T}, 128, true, {cg}, 3, false, {split}>" for T in T2
        for cg, split in ((1, "false"), (16, "false"), (1, "true"))}
    assert set(lists["nvfp4/fp4_attn_fwd.cu"]) == {f"nvfp4_attn_fwd<{T}, {D}, 8, {tl}>" for T in T2 for D in (64, 128)
                                                   for tl in ("true", "false")} | {
        f"qat_attn_fwd<{T}, {D}, 8>" for T in T2 for D in (64, 128)}
    assert not any(n.startswith(("nvfp4_quant_v_kpart", "nvfp4_quant_qk_rows", "nvfp4_kmean_finish"))
                   for n in lists["nvfp4/nvfp4_quant.cu"])
    assert nvfp4.fp4_warps() == nvfp4.fp4_warps("mma", 64) == 8 and nvfp4.fp4_warps("wgmma", 64) == 4
    assert nvfp4.fp4_ws("wgmma", 128) == 3 and nvfp4.fp4_ws("wgmma", 64) == 0 and nvfp4.fp4_ws("mma", 128) == 0
    assert nvfp4.fp4_causal_group(False) == 1 and nvfp4.fp4_causal_group(True) == nvfp4.FP4_CAUSAL_GROUP == 16
    # shared memory: D=64 with 4 warps (Q's 64 rows, 3 stages of K and V, a staging slot per tile task); the
    # warp-specialized kernel (64 rows of Q per consumer, 4 stages, two staging buffers): one CTA per SM on Hopper
    assert nvfp4.fwd_smem_bytes(64, 4, "wgmma") == 64 * 128 + 3 * 2 * 8192 + 36 * 128 + 72 + 1024
    assert nvfp4.ws_smem_bytes(128) == 192 * 256 + 4 * 2 * 16384 + 2 * 36 * 384 + 72 + 1024 < 227 * 1024
    assert nvfp4.ws_img_bytes(128) == 32768  # (a 64-key fp16 K^ tile and its 128 x 64 fp16 V^^T tile)
    assert nvfp4.ws_img_raw_smem_bytes(128) == 32768 + 64 * 136 * 2 + 512 <= 227 * 1024


def test_qat_backward_engines_and_kernel_lists(monkeypatch):
    """The QAT backward's engine is validated like the INT8 backward's; both engines' kernels are in the lists CI
    compiles; the wgmma kernels' shared memory lets two CTAs share an SM (228 KiB, 1 KiB each
    reserved)."""
    import pytest

    from sagecupy import _layout, qat

    with pytest.raises(ValueError, match=r"engine='tensor' is not supported"):
        qat.backward_engine("tensor")
    assert qat.backward_engine("mma") == "mma"
    names = qat.kernel_names()
    assert names["qat/qat_attn_bwd.cu"] and len(names["qat/qat_attn_bwd_sm90.cu"]) == len(set(names["qat/qat_attn_bwd_sm90.cu"])) == 8
    assert _layout.KERNEL_ARCHS["qat/qat_attn_bwd_sm90.cu"] == _layout.KERNEL_ARCHS["qat/qat_attn_fwd_sm90.cu"] == ("sm_90a",)
    from sagecupy import nvfp4

    assert len(nvfp4.kernel_names()["qat/qat_attn_fwd_sm90.cu"]) == 8  # 2 dtypes x D 64/128 x plain / causal dispatch
    assert nvfp4.qat_fwd_sm90_smem_bytes(128) <= 227 * 1024  # one CTA per SM
    for D in (64, 128):
        for smem in qat.bwd_sm90_smem_bytes(D):
            assert 2 * (smem + 1024) <= 228 * 1024


def test_v_t_channels_undoes_the_tile_major_layout():
    """int8.v_t_channels maps the forward's tile-major V^T codes (B, H, n_pad / 64, D, 64) back to channel rows
    (B, H, D, n_pad): element (b, h, d, t) is tile t // 64, position t % 64 of channel d (NumPy stands in for
    CuPy: the same transpose and reshape)."""
    import numpy as np

    from sagecupy.int8 import v_t_channels

    B, H, D, n_pad = 2, 3, 8, 192
    chan = np.arange(B * H * D * n_pad, dtype=np.int64).reshape(B, H, D, n_pad)
    tiles = np.empty((B, H, n_pad // 64, D, 64), dtype=np.int64)
    for t in range(n_pad // 64):
        tiles[:, :, t] = chan[:, :, :, 64 * t:64 * (t + 1)]
    assert np.array_equal(v_t_channels(tiles), chan)
    assert v_t_channels(chan) is chan  # the (B, H, D, n_pad) layout of 128-key tiles passes through


def test_kernels_dir_override_compiles_another_tree(tmp_path, monkeypatch):
    """SAGECUPY_KERNELS_DIR (A/B timing of two kernel trees in one process) switches the sources the loader reads, and
    the hash on their first line (part of the module cache key) follows the text."""
    base = _loader.kernel_source("int8/int8_quant.cu")
    alt = tmp_path / "kernels_cu"
    for p in _loader.kernel_dir().glob("*/*.cu*"):
        (alt / p.parent.name).mkdir(parents=True, exist_ok=True)
        (alt / p.parent.name / p.name).write_text(p.read_text())
    (alt / "int8/int8_quant.cu").write_text((_loader.kernel_dir() / "int8/int8_quant.cu").read_text() + "\n// edited\n")
    monkeypatch.setenv("SAGECUPY_KERNELS_DIR", str(alt))
    assert _loader.kernel_dir() == alt
    other = _loader.kernel_source("int8/int8_quant.cu")
    assert other.rstrip().endswith("// edited") and other.splitlines()[0] != base.splitlines()[0]
    monkeypatch.delenv("SAGECUPY_KERNELS_DIR")
    assert _loader.kernel_source("int8/int8_quant.cu") == base


def test_instance_outside_the_list_compiles_alone(monkeypatch):
    """get_function compiles its list of instances as one module; a name outside the list (single-level P's
    warp-specialized kernels, a non-default CTA size) compiles in a module of its own, not the whole list again with
    it (a file's whole list can take minutes to compile: a test that recompiled it for each of its single-level-P
    kernels ran past its time limit, 1257590). SAGECUPY_DEFINES: only the name, listed or not. A fake cupy records the
    modules built."""
    import sys
    import types

    built = []

    class RawModule:
        def __init__(self, code, options, name_expressions):
            self.names = tuple(name_expressions)

        def compile(self):
            built.append(self.names)

        def get_function(self, name):
            assert name in self.names
            return (name, self.names)

    fake = types.SimpleNamespace(RawModule=RawModule,
                                 cuda=types.SimpleNamespace(Device=lambda *a: types.SimpleNamespace(id=0),
                                                            runtime=types.SimpleNamespace(getDevice=lambda: 0)))
    monkeypatch.setitem(sys.modules, "cupy", fake)
    monkeypatch.setattr(_loader, "_modules", {})
    monkeypatch.setattr(_loader, "_functions", {})
    monkeypatch.delenv("SAGECUPY_DEFINES", raising=False)
    listed = ("k<1>", "k<2>", "k<3>")
    assert _loader.get_function("int8/int8_quant.cu", "k<2>", all_names=listed) == ("k<2>", listed)
    assert _loader.get_function("int8/int8_quant.cu", "k<3>", all_names=list(listed)) == ("k<3>", listed)
    assert built == [listed]  # (one module for the listed instances)
    assert _loader.get_function("int8/int8_quant.cu", "k<9>", all_names=listed) == ("k<9>", ("k<9>",))
    assert _loader.get_function("int8/int8_quant.cu", "k<8>", all_names=listed) == ("k<8>", ("k<8>",))
    assert _loader.get_function("int8/int8_quant.cu", "k<9>", all_names=listed) == ("k<9>", ("k<9>",))
    assert built == [listed, ("k<9>",), ("k<8>",)]
    monkeypatch.setenv("SAGECUPY_DEFINES", "X=1")
    assert _loader.get_function("int8/int8_quant.cu", "k<1>", all_names=listed) == ("k<1>", ("k<1>",))
    assert built[-1] == ("k<1>",) and len(built) == 4
