"""The bench tools on CPU: the README's table tools (bench/tools/*.py) on synthetic benchmark rows (every ratio is
SDPA flash's time over sagecupy's from the same file, and a missing row prints a dash instead of failing), the A/B
harness's variants (bench/ab.py) and the cubin comparison's list of sources (bench/tools/cubin_cmp.py)."""
import json
import subprocess
import sys
from pathlib import Path

TOOLS = Path(__file__).resolve().parents[2] / "bench" / "tools"


def _row(impl, mode, scope, ms, D=128, N=4096, causal=False, config=None):
    r = dict(impl=impl, mode=mode, scope=scope, D=D, N=N, B=4, H=16, causal=causal, dtype="bfloat16", ms=ms, tops=1.0)
    if config is not None:
        r["config"] = config
    return r


def _run(tool, rows, tmp_path, *args, opts=()):
    """The tool's stdout on a file of ``rows``: ``opts`` go before the file (targets_table.py), ``args`` after it."""
    path = tmp_path / "run.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in [{"type": "env"}] + rows) + "\n")
    out = subprocess.run([sys.executable, str(TOOLS / tool), *opts, str(path), *args], capture_output=True, text=True,
                         cwd=TOOLS, check=True)
    return out.stdout


def test_sweep_table_ratios_and_missing_rows(tmp_path):
    rows = [
        _row("sagecupy-int8", "fwd", "e2e", 1.0, config="default"),
        _row("sagecupy-int8", "fwd", "e2e-b2b", 0.8, config="default"),
        _row("sdpa-flash", "fwd", "e2e", 1.5),
        _row("sdpa-flash", "fwd", "e2e-b2b", 1.6),
        _row("sagecupy-int8", "fwdbwd", "e2e", 4.0, config="default"),
        _row("sdpa-flash", "fwdbwd", "e2e", 5.0),
        _row("sagecupy-qat", "fwdbwd", "e2e", 6.25),
    ]
    out = _run("sweep_table.py", rows, tmp_path)
    line = next(x for x in out.splitlines() if x.startswith("| 128 | no | 4K |"))
    cells = [c.strip() for c in line.strip("|").split("|")]
    # INT8 fwd e2e / b2b, INT8 fwd+bwd e2e / b2b (no b2b rows: dash), NVFP4 (absent: dash), QAT
    assert cells[3:] == ["1.50 / 2.00", "1.25 / –", "–", "0.80"]


def test_int8_table_engines(tmp_path):
    rows = []
    for D in (64, 128):
        for N in (4096, 16384):
            for causal in (False, True):
                kw = dict(D=D, N=N, causal=causal, config="default")
                rows += [_row("sagecupy-int8", "fwd", "kernel-mma", 2.0, **kw),
                         _row("sagecupy-int8", "fwd", "kernel-wgmma", 1.0, **kw),
                         _row("sagecupy-int8", "bwd", "kernel-mma", 9.0, **kw),
                         _row("sagecupy-int8", "bwd", "kernel-wgmma", 4.5, **kw)]
    out = _run("int8_table.py", rows, tmp_path, "--engines")
    body = [x for x in out.splitlines() if x.startswith("| 64") or x.startswith("| 128")]
    assert len(body) == 8
    assert all(x.endswith("| 2.00 | 1.00 | 2.00 | 9.00 | 4.50 | 2.00 |") for x in body)


def test_sweep_table_families_alone_and_peak_memory(tmp_path):
    """A run without INT8 rows (--families nvfp4,qat) still lists its shapes; the peak-memory rows follow as a line."""
    rows = [
        _row("sagecupy-nvfp4", "fwd", "e2e", 2.0, D=64, N=16384),
        _row("sdpa-flash", "fwd", "e2e", 1.0, D=64, N=16384),
        dict(impl="sagecupy-int8", mode="peak_mem", D=128, N=32768, B=1, H=16, causal=False, bytes=2 * 2**30),
        dict(impl="sdpa-flash", mode="peak_mem", D=128, N=32768, B=1, H=16, causal=False, bytes=2**30),
    ]
    out = _run("sweep_table.py", rows, tmp_path)
    line = next(x for x in out.splitlines() if x.startswith("| 64 | no | 16K |"))
    assert [c.strip() for c in line.strip("|").split("|")][3:] == ["– / –", "– / –", "0.50", "–"]
    assert not any(x.startswith("| 128") for x in out.splitlines())
    assert out.rstrip().splitlines()[-1] == ("peak memory of one forward+backward, D=128 N=32K: sagecupy-int8 2.00 GiB, "
                                             "sdpa-flash 1.00 GiB")


def _import_bench(name):
    sys.path.insert(0, str(TOOLS.parent))
    try:
        sys.modules.pop(name, None)
        return __import__(name)
    finally:
        sys.path.remove(str(TOOLS.parent))


def test_ab_variants_set_only_the_loaders_variables(monkeypatch, tmp_path):
    """bench/ab.py: a variant's defines go to SAGECUPY_DEFINES (with the variant's own tag, so that the loader compiles
    only the launched instances and keeps each variant apart), kernels=PATH to SAGECUPY_KERNELS_DIR; the next variant
    starts from neither; other SAGECUPY_* tokens are refused."""
    import os

    import pytest

    ab = _import_bench("ab")
    monkeypatch.delenv("SAGECUPY_DEFINES", raising=False)
    monkeypatch.delenv("SAGECUPY_KERNELS_DIR", raising=False)
    ab.set_variant(1, f"A=1, B ,kernels={tmp_path}")
    assert os.environ["SAGECUPY_DEFINES"] == "SAGE_AB_VARIANT=1,A=1,B"
    assert os.environ["SAGECUPY_KERNELS_DIR"] == str(tmp_path)
    ab.set_variant(0, "")
    assert os.environ["SAGECUPY_DEFINES"] == "SAGE_AB_VARIANT=0" and "SAGECUPY_KERNELS_DIR" not in os.environ
    ab.set_variant(None, None)
    assert "SAGECUPY_DEFINES" not in os.environ
    with pytest.raises(SystemExit, match="SAGECUPY_UNKNOWN_SWITCH"):
        ab.parse_variant("A=1,SAGECUPY_UNKNOWN_SWITCH=0")
    assert set(ab.SDPA_MODE.values()) == {"fwd", "bwd", "fwdbwd"}


def test_ab_config_tokens_change_the_int8_config_only():
    """bench/ab.py: config.FIELD=VALUE tokens give the INT8 calls DEFAULT with those fields (bools, ints, words
    parsed), are not kernel defines, and a variant without them leaves the calls' own default (None)."""
    import pytest

    from sagecupy.config import DEFAULT

    ab = _import_bench("ab")
    assert ab.parse_variant("A=1, config.ds_int8=true") == (["A=1"], None)
    cfg = ab.variant_config("config.ds_int8=true, config.block_kv=64, config.ds_granularity=block, B")
    assert cfg == DEFAULT.replace(name=cfg.name, ds_int8=True, block_kv=64, ds_granularity="block")
    assert ab.variant_config("A=1") is None and ab.variant_config("") is None
    with pytest.raises(SystemExit, match="config.FIELD=VALUE"):
        ab.variant_config("config.ds_int8")
    with pytest.raises(TypeError):
        ab.variant_config("config.nonexistent=1")
    assert ab.variant_config("config.name=mine, config.ds_int8=true").name == "mine"
    with pytest.raises(SystemExit, match="ds_int8=False needs dv_int8=False"):  # refused before any compile
        ab.main(["--calls", "int8_bwd", "--variants", "config.dv_int8=true;"])
    with pytest.raises(SystemExit, match="INT8 calls only"):
        ab.main(["--calls", "int8_bwd,nvfp4", "--variants", "config.ds_int8=true;"])


def test_cubin_cmp_reads_the_ci_list_and_old_layouts(tmp_path):
    """bench/tools/cubin_cmp.py compares what .ci/compile_kernels.py compiles: every source it lists is a file of the
    checkout's kernels_cu; an old tree is read at the listed path, or at the top of a tree from before the sources
    moved into family folders."""
    import importlib.util

    saved = list(sys.path)
    spec = importlib.util.spec_from_file_location("cubin_cmp", TOOLS / "cubin_cmp.py")
    cc = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(cc)  # (a script: it puts the checkout and .ci on sys.path)
    finally:
        sys.path[:] = saved
    names = cc.ck.all_names()
    assert names and all((cc.ROOT / "kernels_cu" / f).is_file() for f in names)
    assert all(cc.ck.archs_for(f) for f in names)
    (tmp_path / "fam").mkdir()
    (tmp_path / "fam" / "a.cu").write_text("")
    (tmp_path / "b.cu").write_text("")
    assert cc.source_path(tmp_path, "fam/a.cu") == tmp_path / "fam" / "a.cu"
    assert cc.source_path(tmp_path, "fam/b.cu") == tmp_path / "b.cu"  # (the layout before the move)
    assert cc.source_path(tmp_path, "fam/c.cu") == tmp_path / "fam" / "c.cu"  # (missing: nvcc says so)


def test_sweep_table_against_another_baseline(tmp_path):
    """--vs sdpa: the ratios are against PyTorch's default SDPA rows (impl sdpa-default) of the same file."""
    rows = [
        _row("sagecupy-int8", "fwd", "e2e", 1.0, config="default"),
        _row("sdpa-flash", "fwd", "e2e", 1.5),
        _row("sdpa-default", "fwd", "e2e", 0.8),
    ]
    out = _run("sweep_table.py", rows, tmp_path, "--vs", "sdpa")
    assert "INT8 fwd × sdpa" in out.splitlines()[0]
    line = next(x for x in out.splitlines() if x.startswith("| 128 | no | 4K |"))
    assert [c.strip() for c in line.strip("|").split("|")][3] == "0.80 / –"


def _targets_rows():
    rows = []
    for causal in (False, True):
        kw = dict(D=128, N=4096, causal=causal)
        rows += [_row("sagecupy-int8", "fwd", "e2e", 1.0, config="default", **kw),
                 _row("sagecupy-int8", "fwdbwd", "e2e", 4.0, config="default", **kw),
                 _row("sdpa-default", "fwd", "e2e", 1.6, **kw),
                 _row("sdpa-default", "fwdbwd", "e2e", 5.0 if causal else 6.0, **kw)]
        fp8 = [_row("cudnn-fp8", "fwd", "e2e", 0.9, **kw), _row("cudnn-fp8", "fwd", "kernel", 0.5, **kw)]
        rows += [dict(r, dtype="float8_e4m3fn" if r["scope"] == "kernel" else "bfloat16") for r in fp8]
    return rows


def test_targets_table_lowest_ratio_decides(tmp_path):
    out = _run("targets_table.py", _targets_rows(), tmp_path)
    lines = {x.split("|")[1].strip(): [c.strip() for c in x.strip("|").split("|")] for x in out.splitlines()
             if x.startswith("| fwd")}
    assert lines["fwd, D=128, N ≥ 4K, × cuDNN bf16 (SDPA default)"][1:4] == ["1.60", "1.60", "≥ 1.50"]
    assert lines["fwd, D=128, N ≥ 4K, × cuDNN bf16 (SDPA default)"][4].startswith("met")
    # fwd+bwd: 1.25 causal, 1.50 not causal; the lowest (causal) is below 1.35
    assert lines["fwd+bwd, D=128, N ≥ 4K, × cuDNN bf16"][1:3] == ["1.25", "1.50"]
    assert lines["fwd+bwd, D=128, N ≥ 4K, × cuDNN bf16"][4] == "not met (lowest: D=128/4K causal bfloat16)"
    assert lines["fwd, D=128, N ≥ 4K, × cuDNN FP8 kernel alone"][1] == "0.50"
    assert lines["fwd+bwd, D=128, N ≥ 4K, × cuDNN FP8 with casts"][4] == "not timed"


def test_targets_table_shapes(tmp_path):
    out = _run("targets_table.py", _targets_rows(), tmp_path, opts=("--shapes",))
    body = [x for x in out.splitlines() if x.startswith("| 128")]
    # fwd × SDPA, fwd × FP8 (with casts), fwd+bwd × SDPA, fwd+bwd × FP8 (not timed: a dash)
    assert body == ["| 128 | no | 4K | 1.60 | 0.90 | 1.50 | – |", "| 128 | yes | 4K | 1.60 | 0.90 | 1.25 | – |"]
