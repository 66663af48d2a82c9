"""sagecupy.warmup and ``sagecupy warmup`` without a GPU: on the stand-in cupy of test_host_paths, with the loader's
module compile (``_loader._module``) replaced by a recorder behind the real ``get_function``. The warm-up must
compile exactly the (file, name expressions, arch) modules that the families' calls compile, or the cache keys
differ and the later calls compile again."""
import os

import numpy as np
import pytest
from click.testing import CliRunner

from test_host_paths import FakeArray, Kernel, gpu, stub_views  # noqa: F401  (gpu: the stand-in cupy fixture)

COMBOS = [(family, dtype, d, engine) for family in ("int8", "nvfp4", "qat") for dtype in ("float16", "bfloat16")
          for d in (64, 128) for engine in ("mma", "wgmma")]


@pytest.fixture
def built(gpu, monkeypatch, tmp_path):
    """The modules compiled, as (filename, names, arch), in order; each writes a .cubin into CuPy's cache folder
    (CUPY_CACHE_DIR, a temporary one). ``built.fail``: filenames whose compile raises."""
    from sagecupy import _loader, _program, int8, nvfp4, qat

    class Built(list):
        pass

    log = Built()
    log.fail = set()
    cache = tmp_path / "kernel_cache"
    cache.mkdir()
    monkeypatch.setenv("CUPY_CACHE_DIR", str(cache))
    monkeypatch.delenv("CUPY_CACHE_IN_MEMORY", raising=False)

    class Module:
        def __init__(self, names):
            self.names = names

        def get_function(self, name):
            assert name in self.names
            return Kernel(name, gpu)

    def module(filename, names, arch=None):
        if filename in log.fail:
            raise RuntimeError(f"sagecupy: compiling {filename} failed (test):\nline 1\nline 2")
        log.append((filename, tuple(names), arch))
        (cache / f"{len(log)}.cubin").write_bytes(b"")
        return Module(names)

    monkeypatch.setattr(_loader, "_module", module)
    monkeypatch.setattr(_loader, "_functions", {})
    monkeypatch.setattr(_loader, "device_capability", lambda: (9, 0))
    for mod in (int8, nvfp4, qat):  # the real get_function (the fixture's stub bypasses the loader)
        monkeypatch.setattr(mod, "get_function", _loader.get_function)
    for mod, name in ((int8, "_FWD_PLANS"), (int8, "_BWD_PLANS"), (nvfp4, "_ATTN_PLANS")):
        monkeypatch.setattr(mod, name, _program.Plans())  # (a plan recorded elsewhere would skip get_function)

    stub_views(monkeypatch)
    return log


def _array(shape, dtype):
    from sagecupy.adapters import bf16

    return FakeArray(shape, np.float16) if dtype == "float16" else bf16.BF16Array(FakeArray(shape, np.uint16))


def _run_calls(family, dtype, d, engine, monkeypatch):
    """Every entry point of ``family`` on inputs of ``dtype`` and head dim ``d`` on ``engine``: each config the
    kernels implement, causal or not, forward and backward (INT8: dense and packed sequences, the named configs and
    every (dv_int8, ds_int8) pair the kernels accept; NVFP4: with and without the tail split, and on packed
    operands)."""
    from sagecupy import int8, nvfp4, qat
    from sagecupy.config import DEFAULT, NVFP4Config

    nq, nk = (400, 1024) if family == "nvfp4" else (128, 128)  # (no padding: the stand-in arrays cannot zero one)
    q, k, v = _array((2, 4, nq, d), dtype), _array((2, 2, nk, d), dtype), _array((2, 2, nk, d), dtype)
    do = _array((2, 4, nq, d), dtype)
    # packed sequences (layout "THD"): 3 sequences whose offsets stay on the (stand-in) device
    packed = dict(layout="THD", cu_seqlens_q=FakeArray((4,), np.int32), cu_seqlens_k=FakeArray((4,), np.int32))
    qp, kp, vp, dop = (_array(shape, dtype) for shape in ((300, 4, d), (200, 2, d), (200, 2, d), (300, 4, d)))
    # (the pairs come from the config check, not from the list the warm-up compiles from: a pair missing there
    # must fail here)
    bwd_modes = [DEFAULT.replace(dv_int8=dv, ds_int8=ds) for dv in (True, False) for ds in (True, False)
                 if int8._unsupported_config(DEFAULT.replace(dv_int8=dv, ds_int8=ds)) is None]
    for causal in (False, True):
        if family == "int8":
            for config in ("default", "paper", "bkv64", *bwd_modes):
                o, res = int8.forward(q, k, v, causal=causal, config=config, engine=engine)
                int8.backward(res, do, engine=engine)
                int8.sage_attention(q, k, v, causal=causal, config=config, engine=engine)
                o, res = int8.forward(qp, kp, vp, causal=causal, config=config, engine=engine, **packed)
                int8.backward(res, dop, engine=engine)
                int8.sage_attention(qp, kp, vp, causal=causal, config=config, engine=engine, **packed)
            for bkv in (64, 128):  # the 16-bit P.V (wgmma only)
                config = DEFAULT.replace(pv_int8=False, block_kv=bkv)
                if int8._unsupported_pv16(config, int8.forward_engine(engine)) is None:
                    o, res = int8.forward(q, k, v, causal=causal, config=config, engine=engine)
                    int8.sage_attention(q, k, v, causal=causal, config=config, engine=engine)
                    o, res = int8.forward(qp, kp, vp, causal=causal, config=config, engine=engine, **packed)
                    int8.sage_attention(qp, kp, vp, causal=causal, config=config, engine=engine, **packed)
        elif family == "qat":
            o, res = qat.forward(q, k, v, causal=causal, engine=engine)
            qat.backward(res, do, engine=engine)
        else:
            packed = {n: FakeArray(shape, np.uint8) for n, shape in (
                ("q_packed", (2, 4, nq, d // 2)), ("q_scales", (2, 4, nq, d // 16)),
                ("k_packed", (2, 2, nk, d // 2)), ("k_scales", (2, 2, nk, d // 16)),
                ("v_packed", (2, 2, d, nk // 2)), ("v_scales", (2, 2, d, nk // 16)))}
            monkeypatch.setattr(nvfp4, "_zero_ints", lambda counters: ())  # (the split's counters: no memory here)
            for sms in (8, 7):  # 24 items: whole waves on 8 SMs, the tail split on 7
                monkeypatch.setattr(nvfp4, "_sm_count", lambda device_id, sms=sms: sms)
                for two_level in (True, False):
                    nvfp4._ATTN_PLANS.clear()  # (the SM count is not part of a plan's key)
                    nvfp4.attention(q, k, v, causal=causal, config=NVFP4Config(two_level_p=two_level), engine=engine)
                    nvfp4.attention_packed(packed, causal=causal, two_level_p=two_level, engine=engine,
                                           out_dtype=dtype)
            nvfp4.quantize_inputs(q, k, v)


def test_choices_are_the_families_own():
    from sagecupy import _checks, _layout, _warmup, int8, nvfp4, qat

    assert _warmup.HEAD_DIMS == _checks.SUPPORTED_HEAD_DIMS and _warmup.ENGINES == _layout.ENGINES[1:]
    assert all(tuple(m._T) == _warmup.DTYPES for m in (int8, nvfp4, qat))


@pytest.mark.parametrize("family, dtype, d, engine", COMBOS)
def test_warmup_compiles_the_modules_the_calls_compile(built, monkeypatch, family, dtype, d, engine):
    from sagecupy import _warmup

    _run_calls(family, dtype, d, engine, monkeypatch)
    calls = set(built)  # (get_function asks for a function's module once; _module builds each module once)
    modules, skipped = _warmup.plan(families=family, dtypes=dtype, head_dims=d, engines=engine)
    assert skipped == []
    assert {(m.filename, m.names, m.arch) for m in modules} == calls
    arch = {m.arch for m in modules if m.filename.endswith("_sm90.cu")}
    assert arch <= {"sm_90a"} and all(m.arch is None for m in modules if not m.filename.endswith("_sm90.cu"))


@pytest.mark.parametrize("family, d, engine", [("int8", 128, "wgmma"), ("nvfp4", 128, "wgmma"), ("qat", 64, "mma")])
def test_with_defines_every_instance_compiles_alone_in_both(built, monkeypatch, family, d, engine):
    """SAGECUPY_DEFINES (tuning experiments): get_function compiles each instance alone, and so does the warm-up;
    every module a call compiles is among the warm-up's."""
    from sagecupy import _warmup

    monkeypatch.setenv("SAGECUPY_DEFINES", "X=1")
    _run_calls(family, "float16", d, engine, monkeypatch)
    modules, _ = _warmup.plan(families=family, dtypes="float16", head_dims=d, engines=engine)
    planned = {(m.filename, m.names, m.arch) for m in modules}
    assert all(len(m.names) == 1 for m in modules)
    assert set(built) <= planned


def test_warmup_runs_each_module_once_and_reports_per_file(built):
    from sagecupy import _warmup, warmup

    modules, _ = _warmup.plan()
    files = []
    summary = warmup(on_file=lambda filename, results: files.append((filename, len(results))))
    assert built == [(m.filename, m.names, m.arch) for m in modules]  # in order of first use, each once
    assert len(set(built)) == len(built) == len(summary.results) == len(summary.compiled)
    assert summary.failures == [] and summary.skipped == [] and summary.jobs == 1
    assert summary.cache_files_added == len(built) and summary.cache_note is None
    assert sorted(files) == sorted((f, sum(m.filename == f for m in modules)) for f in {m.filename for m in modules})
    # every file a family launches from, both engines on sm_90, and the INT8 pre-pass K's mean of NVFP4 takes
    assert {f for f, _ in files} == {
        "int8/int8_quant.cu", "int8/int8_quant_packed.cu", "int8/int8_attn_fwd.cu", "int8/int8_attn_fwd_sm90.cu", "int8/int8_attn_bwd.cu",
        "int8/int8_attn_bwd_sm90.cu", "nvfp4/nvfp4_quant.cu", "nvfp4/fp4_attn_fwd.cu", "nvfp4/fp4_attn_fwd_sm90.cu",
        "qat/qat_attn_fwd_sm90.cu", "qat/qat_attn_bwd.cu", "qat/qat_attn_bwd_sm90.cu"}


def test_a_failing_module_is_reported_not_raised(built):
    from sagecupy import warmup

    built.fail.add("int8/int8_attn_bwd.cu")
    summary = warmup(families="int8", dtypes="float16", head_dims=64, engines="mma")
    # the dense and the packed backward modules of each (dv_int8, ds_int8) pair the kernels implement: (INT8, INT8),
    # (16-bit, INT8) and (16-bit, bf16); a module holds the pair's dK/dV kernel (templated on both) with its dQ
    # kernel (on ds_int8), so no two pairs share one: 2 * 3
    assert [r.module.filename for r in summary.failures] == ["int8/int8_attn_bwd.cu"] * 6
    error = summary.failures[0].error
    assert "compiling int8/int8_attn_bwd.cu failed" in error and "line 2" in error
    # the pre-pass modules (dense, packed) and the forward instances (64- and 128-key tiles, dense and packed): 2 + 4
    assert len(summary.compiled) == 6
    with pytest.raises(RuntimeError, match="6 of 12 modules failed"):
        warmup(families="int8", dtypes="float16", head_dims=64, engines="mma", strict=True)


def test_engines_follow_the_device(built, monkeypatch):
    from sagecupy import _loader, _warmup, nvfp4

    def engines(cc, given=None):
        monkeypatch.setattr(_loader, "device_capability", lambda: cc)
        return _warmup.device_engines(given)

    assert engines((9, 0)) == ("mma", "wgmma") and engines((8, 0)) == ("mma",) and engines((10, 0)) == ("mma",)
    with pytest.raises(ValueError, match=r"'wgmma' needs compute capability 9.0 \(Hopper\); this device is 8.9"):
        engines((8, 9), ("wgmma",))
    with pytest.raises(ValueError, match="compute capability 8.0 or newer; this device is 7.5"):
        engines((7, 5))
    # sm_89 (99 KiB of shared memory a block): the FP4 forwards' calls at D=128 are refused before any launch, so
    # the warm-up leaves them out and says why
    engines((8, 9))
    monkeypatch.setattr(nvfp4, "_smem_optin", lambda device_id: 99 * 1024)
    modules, skipped = _warmup.plan(families=("nvfp4", "qat"))
    assert [(f, d, e) for f, d, e, _ in skipped] == [("nvfp4", 128, "mma"), ("qat", 128, "mma")]
    assert "needs 106624 bytes of shared memory" in skipped[0][3]
    assert not any("128" in m.names[0] and "nvfp4_attn_fwd" in m.names[0] for m in modules)


@pytest.mark.parametrize("kwargs, match", [
    (dict(families=("int8", "int4")), r"families: 'int4' is not supported; supported: int8, nvfp4, qat"),
    (dict(dtypes="fp32"), r"dtypes: 'fp32' is not supported; supported: float16, bfloat16"),
    (dict(head_dims=(64, 96)), r"head_dims: 96 is not supported; supported: 64, 128"),
    (dict(engines="auto"), r"engines: 'auto' is not supported; supported: mma, wgmma"),
    (dict(families=()), r"families: nothing given"),
    (dict(jobs=0), r"jobs: 0 is not supported; a positive integer is"),
])
def test_bad_arguments_name_the_argument_and_what_is_supported(kwargs, match):
    from sagecupy import warmup

    with pytest.raises(ValueError, match=match):  # (before any device query: no cupy needed)
        warmup(**kwargs)


@pytest.mark.parametrize("args, match", [
    (["--families", "int8,fp8"], "--families: 'fp8' is not supported; supported: int8, nvfp4, qat"),
    (["--dtype", "fp32"], "--dtype: 'fp32' is not supported; supported: float16, bfloat16 (or fp16, bf16)"),
    (["--d", "96"], "--d: 96 is not supported; supported: 64, 128"),
    (["--d", "x"], "--d: 'x' is not supported; supported: 64, 128"),
    (["--engines", "tensor"], "--engines: 'tensor' is not supported; supported: mma, wgmma"),
    (["--jobs", "0"], "'--jobs': 0 is not in the range x>=1"),
])
def test_cli_argument_errors(args, match, monkeypatch):
    from sagecupy import cli

    monkeypatch.setattr(cli, "gpu_status", lambda: (True, "test"))  # (arguments are checked first either way)
    result = CliRunner().invoke(cli.main, ["warmup", *args])
    assert result.exit_code == 2 and result.stdout == "" and "Traceback" not in result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: ") and match in lines[0], result.stderr


def test_cli_without_a_gpu_says_so(monkeypatch):
    from sagecupy import cli

    monkeypatch.setattr(cli, "gpu_status", lambda: (False, "no CUDA device (test)"))
    result = CliRunner().invoke(cli.main, ["warmup", "--d", "64"])
    assert result.exit_code == 1
    assert result.stderr.strip() == "Error: warmup needs a CUDA device: no CUDA device (test)"


def test_cli_prints_a_line_per_file_and_the_total(built, monkeypatch):
    from sagecupy import cli

    monkeypatch.setattr(cli, "gpu_status", lambda: (True, "test"))
    result = CliRunner().invoke(cli.main, ["warmup", "--families", "int8", "--dtype", "bf16", "--d", "128"])
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    files = sorted(line.split()[0] for line in lines[:-1])
    assert files == ["int8/int8_attn_bwd.cu", "int8/int8_attn_bwd_sm90.cu", "int8/int8_attn_fwd.cu",
                     "int8/int8_attn_fwd_sm90.cu", "int8/int8_quant.cu", "int8/int8_quant_packed.cu"]
    # the two pre-pass modules, and on each of the two engines the forward's four (64- and 128-key tiles, dense and
    # packed) and the backward's six (three (dv_int8, ds_int8) pairs, dense and packed), and on the wgmma engine the
    # 16-bit P.V forward's four (64- and 128-key tiles, dense and packed): 2 + 2 * (4 + 6) + 4
    assert lines[-1].startswith("warmup: 26 modules ready, 26 new in CuPy's cache, 0 failed, ")
    assert lines[-1].endswith(f"cache {os.environ['CUPY_CACHE_DIR']}")
    assert all("__nv_bfloat16, 128" in names[0] or names[0].startswith("transpose") for _, names, _ in built)
    built.fail.add("int8/int8_attn_fwd_sm90.cu")
    result = CliRunner().invoke(cli.main, ["warmup", "--families", "int8", "--d", "64", "--engines", "wgmma"])
    assert result.exit_code == 1
    assert "int8/int8_attn_fwd_sm90.cu" in result.stdout and "16 FAILED" in result.stdout  # two P.V forms
    assert "    line 2" in result.stdout and ", 16 failed, " in result.stdout.splitlines()[-1]


def test_jobs_compile_in_spawned_processes_and_report_their_failures(built, monkeypatch, tmp_path):
    """--jobs N: the modules go to N spawned worker processes (picklable work, one result each, per-file reports as
    files finish). The workers have no stand-in CuPy and an empty kernel folder, so every module fails there, with
    the worker's error text (no CuPy on this machine, or no source file), and nothing is raised."""
    from sagecupy import _warmup, warmup

    monkeypatch.setenv("SAGECUPY_KERNELS_DIR", str(tmp_path))  # (inherited by the workers)
    files = []
    summary = warmup(families="int8", dtypes="float16", head_dims=64, engines="mma", jobs=2,
                     on_file=lambda filename, results: files.append((filename, len(results))))
    modules, _ = _warmup.plan(families="int8", dtypes="float16", head_dims=64, engines="mma")
    assert summary.jobs == 2 and built == []  # (nothing compiled in this process)
    assert sorted((r.module for r in summary.results), key=str) == sorted(modules, key=str)
    assert all(r.error.startswith(("ModuleNotFoundError", "FileNotFoundError")) for r in summary.failures)
    # dense and packed: the pre-pass module, the forward's two (64- and 128-key tiles) and the backward's three
    # ((dv_int8, ds_int8) pairs) each: 2 * (1 + 2 + 3)
    assert len(summary.failures) == len(modules) == 12
    assert sorted(files) == [("int8/int8_attn_bwd.cu", 6), ("int8/int8_attn_fwd.cu", 4), ("int8/int8_quant.cu", 1),
                             ("int8/int8_quant_packed.cu", 1)]
