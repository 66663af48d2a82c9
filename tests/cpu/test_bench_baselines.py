"""The benchmark's baselines without a GPU: names, soft skips, FP8 scale rule, and the ratio columns of the table."""
import math
import sys

import pytest

from sagecupy import _cudnn_fp8, bench
from sagecupy import bench_frameworks as fw

COLS = ("x sdpa", "x fp8", "x flash", "x cudnn")


def _row(impl, mode, scope, ms, **kw):
    base = dict(impl=impl, config="default" if impl.startswith("sagecupy") else "", mode=mode, scope=scope, D=128,
                N=4096, B=4, H=16, causal=False, dtype="bfloat16", ms=ms, tops=1.0)
    base.update(kw)
    return base


def _ratios(line):
    """The four ratio columns (x sdpa, x fp8, x flash, x cudnn) of a table line."""
    return line.split()[-4:]


def _table(rows):
    lines = bench.format_rows(rows).splitlines()
    assert all(c in lines[0] for c in COLS)
    return lines


# -- baseline names ----------------------------------------------------------------------------------------------
def test_default_baselines_are_default_sdpa_cudnn_fp8_and_flash():
    assert bench.DEFAULT_BASELINES == ("sdpa", "cudnn-fp8", "flash")
    assert set(bench.DEFAULT_BASELINES) <= set(bench.BASELINES)
    assert bench.BASELINES["sdpa"] == "sdpa-default" and bench.BASELINES["cudnn-fp8"] == "cudnn-fp8"


@pytest.mark.parametrize("spec, want", [
    ("sdpa,cudnn-fp8,flash", ("sdpa", "cudnn-fp8", "flash")),
    ("", ()),
    (" flash , sdpa ,", ("flash", "sdpa")),
    ("cudnn,cudnn", ("cudnn",)),
    (("sdpa", "cudnn-fp8"), ("sdpa", "cudnn-fp8")),
    ((), ()),
])
def test_parse_baselines(spec, want):
    assert bench.parse_baselines(spec) == want


@pytest.mark.parametrize("bad", ["fp8", "sdpa,cudnn_fp8", "default", "FLASH"])
def test_parse_baselines_names_the_unknown_one(bad):
    with pytest.raises(ValueError) as exc:
        bench.parse_baselines(bad)
    msg = str(exc.value)
    assert "--baselines" in msg and "cudnn-fp8" in msg and "sdpa" in msg


def test_run_bench_rejects_unknown_baseline(capsys):
    mod = _run_bench_module()
    with pytest.raises(SystemExit) as exc:
        mod.main(["--baselines", "sdpa,nope"])
    assert exc.value.code == 2
    assert "'nope' is not one of" in capsys.readouterr().err


# -- soft skips --------------------------------------------------------------------------------------------------
def test_run_suite_skips_an_unavailable_baseline_with_one_row(monkeypatch):
    """A baseline that cannot run gives one ``skip`` row (first, once, also to ``log``) and is never timed."""
    monkeypatch.setattr(fw, "baseline_unavailable", lambda name: f"{name} is not here")
    called = []
    monkeypatch.setattr(fw, "bench_sdpa", lambda *a, **k: called.append(a) or [])
    monkeypatch.setattr(fw, "bench_cudnn_fp8", lambda *a, **k: called.append(a) or [])
    logged = []
    rows = bench.run_suite([(128, 4096, False), (128, 4096, True)], baselines="sdpa,cudnn-fp8", families=(),
                           log=logged.append)
    assert called == []
    assert [r["mode"] for r in rows] == ["skip", "skip"]
    assert [r["impl"] for r in rows] == ["sdpa-default", "cudnn-fp8"]
    assert rows[1]["reason"] == "cudnn-fp8 is not here"
    assert logged == rows
    text = bench.format_rows(rows)
    assert "skipped: cudnn-fp8 is not here" in text and "Traceback" not in text


def test_run_suite_turns_a_failing_baseline_into_an_error_row(monkeypatch):
    """Whatever a baseline raises on one case becomes that case's ``error`` row; the sweep goes on."""
    monkeypatch.setattr(fw, "baseline_unavailable", lambda name: None)

    def boom(D, N, causal, **kw):
        raise RuntimeError(f"no FP8 graph at D={D}")

    seen = []
    monkeypatch.setattr(fw, "bench_cudnn_fp8", boom)
    monkeypatch.setattr(fw, "bench_sdpa", lambda D, N, c, be, **kw: seen.append(be) or [
        _row(f"sdpa-{be}", "fwd", "e2e", 1.0, D=D, N=N, causal=c)])
    rows = bench.run_suite([(64, 4096, False), (128, 4096, False)], baselines=("cudnn-fp8", "sdpa", "flash"),
                           families=())
    assert seen == ["default", "flash", "default", "flash"]
    errors = [r for r in rows if r["mode"] == "error"]
    assert [r["D"] for r in errors] == [64, 128] and all(r["impl"] == "cudnn-fp8" for r in errors)
    assert "no FP8 graph at D=64" in errors[0]["error"]
    assert "error D=64" in bench.format_rows(rows)


def test_run_suite_availability_probe_that_raises_is_a_skip(monkeypatch):
    def probe(name):
        raise OSError("driver gone")

    monkeypatch.setattr(fw, "baseline_unavailable", probe)
    rows = bench.run_suite([], baselines="cudnn-fp8")
    assert len(rows) == 1 and rows[0]["mode"] == "skip" and "driver gone" in rows[0]["reason"]


def skip_with_cuda():
    """Skip a test of the answers without a GPU where PyTorch sees a CUDA device."""
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except Exception:
        has_cuda = False
    if has_cuda:
        pytest.skip("a CUDA device is visible")


def test_baseline_unavailable_answers_without_a_gpu():
    """On a machine without CUDA (CI), every baseline says why instead of raising."""
    skip_with_cuda()
    for name in bench.BASELINES:
        why = fw.baseline_unavailable(name)
        assert isinstance(why, str) and why


def test_cudnn_fp8_unavailable_is_a_reason_not_a_crash():
    """The module imports without torch; where the FP8 path cannot run, calling it raises Unavailable with the
    reason."""
    why = _cudnn_fp8.unavailable_reason()
    assert why is None or (isinstance(why, str) and why)
    if why:
        with pytest.raises(_cudnn_fp8.Unavailable) as exc:
            _cudnn_fp8.cudnn_fp8_attention(None, None, None, None)
        assert str(exc.value) == why


# -- FP8 scale rule and layout -----------------------------------------------------------------------------------
@pytest.mark.parametrize("amax", [1e-30, 1e-3, 0.5, 0.75, 1.0, 1.0 + 2**-20, 1.5, 2.0, 3.999, 4.0, 5.0, 31.9, 32.0,
                                  33.0, 64.0, 65.0, 448.0, 1e6, 3.0e38])
def test_pow2_scale_brings_amax_into_32_64(amax):
    s = _cudnn_fp8.pow2_scale(amax)
    assert math.frexp(s)[0] == 0.5  # a power of two: scaling is exact
    assert 32.0 < amax * s <= 64.0


@pytest.mark.parametrize("amax, want", [(1.0, 64.0), (1.5, 32.0), (2.0, 32.0), (64.0, 1.0), (0.25, 256.0)])
def test_pow2_scale_values(amax, want):
    assert _cudnn_fp8.pow2_scale(amax) == want
    assert _cudnn_fp8.pow2_scale(amax) == 2.0 ** (6 - math.ceil(math.log2(amax)))


@pytest.mark.parametrize("amax", [0.0, -1.0, float("inf"), float("nan")])
def test_pow2_scale_of_nothing_to_scale_is_one(amax):
    assert _cudnn_fp8.pow2_scale(amax) == 1.0


def test_bnhd_strides_declare_bnhd_storage():
    B, H, N, D = 2, 3, 5, 16
    st = _cudnn_fp8.bnhd_strides(B, H, N, D)
    # element (b, h, n, d) of the logical [B, H, N, D] view sits at ((b * N + n) * H + h) * D + d of [B, N, H, D]
    for b, h, n, d in ((1, 2, 4, 15), (0, 1, 3, 7), (1, 0, 0, 0)):
        assert sum(i * s for i, s in zip((b, h, n, d), st)) == ((b * N + n) * H + h) * D + d


# -- table ratios ------------------------------------------------------------------------------------------------
def test_format_rows_ratios_to_default_sdpa_and_cudnn_fp8():
    rows = [_row("sdpa-default", "fwd", "e2e", 2.0), _row("sdpa-default", "fwd", "e2e-b2b", 1.8),
            _row("cudnn-fp8", "fwd", "kernel", 0.5), _row("cudnn-fp8", "fwd", "e2e", 0.8),
            _row("cudnn-fp8", "fwd", "e2e-b2b", 0.6), _row("sdpa-flash", "fwd", "e2e", 3.0),
            _row("sagecupy-int8", "fwd", "kernel", 0.4), _row("sagecupy-int8", "fwd", "e2e", 1.0),
            _row("sagecupy-int8", "fwd", "e2e-b2b", 0.9), _row("sagecupy-int8", "fwd", "train", 1.6),
            _row("sagecupy-int8", "fwd", "kernel-wgmma", 0.25)]
    lines = _table(rows)
    mine = {ln.split()[3]: _ratios(ln) for ln in lines[1:] if ln.startswith("sagecupy-int8")}
    assert mine["kernel"] == ["5.00", "1.25", "7.50", "-"]        # SDPA e2e / 0.4; FP8 kernel / 0.4; flash e2e / 0.4
    assert mine["e2e"] == ["2.00", "0.80", "3.00", "-"]
    assert mine["e2e-b2b"] == ["2.00", "0.67", "-", "-"]          # back to back against back to back only
    assert mine["train"] == ["1.25", "0.50", "1.88", "-"]
    assert mine["kernel-wgmma"] == ["8.00", "2.00", "12.00", "-"]


def test_format_rows_fwdbwd_compares_with_the_baselines_fwdbwd():
    rows = [_row("cudnn-fp8", "fwd", "e2e", 1.0), _row("cudnn-fp8", "fwdbwd", "e2e", 4.0),
            _row("sdpa-default", "fwdbwd", "e2e", 6.0), _row("sdpa-default", "bwd", "e2e", 5.0),
            _row("cudnn-fp8", "bwd", "e2e", 2.5), _row("sagecupy-int8", "fwdbwd", "e2e", 2.0),
            _row("sagecupy-int8", "bwd", "e2e", 2.5)]
    lines = _table(rows)
    fb = next(ln for ln in lines if ln.startswith("sagecupy-int8") and " fwdbwd " in ln)
    bw = next(ln for ln in lines if ln.startswith("sagecupy-int8") and " bwd " in ln)
    assert _ratios(fb) == ["3.00", "2.00", "-", "-"]
    assert _ratios(bw) == ["2.00", "1.00", "-", "-"]


def test_format_rows_without_baselines_prints_dashes():
    rows = [_row("sagecupy-int8", m, s, 1.0) for m, s in (("fwd", "kernel"), ("bwd", "e2e"), ("fwdbwd", "e2e-b2b"))]
    rows.append(_row("sagecupy-nvfp4", "fwd", "e2e", 0.5, qkv_bytes_per_elem=0.5625))
    lines = _table(rows)
    assert len(lines) == 1 + len(rows)
    for ln in lines[1:]:
        assert _ratios(ln) == ["-", "-", "-", "-"]


def test_format_rows_other_case_or_mask_does_not_match():
    rows = [_row("cudnn-fp8", "fwd", "e2e", 1.0, N=8192), _row("sdpa-default", "fwd", "e2e", 1.0, causal=True),
            _row("sagecupy-int8", "fwd", "e2e", 1.0)]
    assert _ratios(_table(rows)[-1]) == ["-", "-", "-", "-"]


def test_format_rows_tolerates_skip_error_and_memory_rows():
    rows = [dict(impl="cudnn-fp8", mode="skip", baseline="cudnn-fp8", reason="no CUDA device visible to PyTorch"),
            dict(impl="cudnn-fp8", mode="error", D=64, N=1024, causal=True, error="forward: Unavailable: D=64"),
            dict(impl="sdpa-default", mode="error", error="RuntimeError: out of memory"),
            dict(impl="sagecupy-int8", mode="peak_mem", D=128, N=32768, B=1, H=16, bytes=3 * 2**30),
            _row("sagecupy-int8", "fwd", "e2e", 1.0)]
    lines = _table(rows)
    assert "skipped: no CUDA device" in lines[1]
    assert "error D=64 N=1024 causal=True: forward: Unavailable: D=64" in lines[2]
    assert "out of memory" in lines[3]
    assert "3.00 GiB" in lines[4]
    assert _ratios(lines[5]) == ["-", "-", "-", "-"]


def test_baseline_rows_get_ratios_too():
    """The FP8 row against the bf16 default: how much the FP8 path buys on the same case."""
    rows = [_row("sdpa-default", "fwd", "e2e", 2.0), _row("cudnn-fp8", "fwd", "kernel", 0.5),
            _row("cudnn-fp8", "fwd", "e2e", 1.0)]
    lines = _table(rows)
    assert _ratios(lines[1])[:2] == ["1.00", "0.50"]
    assert _ratios(lines[2])[:2] == ["4.00", "1.00"]
    assert _ratios(lines[3])[:2] == ["2.00", "1.00"]


def test_flops_of_cudnn_fp8_rows_use_the_shared_convention():
    B, H = bench._shape(128, 4096)
    assert (B, H) == (4, 16)
    f = bench.flops(B, H, 4096, 4096, 128, True, "fwdbwd")
    assert f == 3.5 * 4 * B * H * 4096 * 4096 * 128 / 2


def test_default_cases_cover_the_speed_target():
    cases = bench.default_cases()
    assert {(128, n) for n in (1024, 2048, 4096, 8192, 16384, 32768)} <= {(d, n) for d, n, _ in cases}
    assert {(64, n) for n in (4096, 8192, 16384, 32768)} <= {(d, n) for d, n, _ in cases}
    for d, n, _ in cases:
        B, H = bench._shape(d, n)
        assert B * n == max(16384, n) and H * d == 2048  # 16K tokens (one sequence from 16K on)
    assert {n for _, n, _ in bench.default_cases(quick=True)} == {4096, 16384}


# -- framework adapters ------------------------------------------------------------------------------------------
ADAPTER_ROWS = ("sagecupy-int8-torch", "sagecupy-int8-jax")


def test_adapters_name_their_rows():
    assert bench.ADAPTERS == {"torch": "sagecupy-int8-torch", "jax": "sagecupy-int8-jax"}


@pytest.mark.parametrize("spec, want", [
    ("torch,jax", ("torch", "jax")), ("", ()), (" jax , torch ,jax", ("jax", "torch")), (("torch",), ("torch",)),
])
def test_parse_adapters(spec, want):
    assert bench.parse_adapters(spec) == want


@pytest.mark.parametrize("bad", ["pytorch", "torch,flax", "sdpa"])
def test_parse_adapters_names_the_unknown_one(bad):
    with pytest.raises(ValueError) as exc:
        bench.parse_adapters(bad)
    assert "--adapters" in str(exc.value) and "torch, jax" in str(exc.value)


def test_adapter_unavailable_answers_without_a_gpu(monkeypatch):
    """Without PyTorch/JAX, CUDA or CuPy, each adapter says why instead of raising (JAX is told not to preallocate
    before anything starts its backend)."""
    monkeypatch.setenv("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # restored after the test
    try:
        from sagecupy._loader import gpu_status

        usable = gpu_status()[0]
    except Exception:
        usable = False
    if usable:
        pytest.skip("a usable CUDA device is visible")
    for name in bench.ADAPTERS:
        why = fw.adapter_unavailable(name)
        assert isinstance(why, str) and why


def test_adapter_unavailable_without_torch_names_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)
    assert fw.adapter_unavailable("torch").startswith("PyTorch is not importable")


def test_run_suite_skips_an_unavailable_adapter_with_one_row(monkeypatch):
    monkeypatch.setattr(fw, "adapter_unavailable", lambda name: f"no {name} here")
    monkeypatch.setattr(bench, "bench_int8", lambda D, N, c, **kw: [_row("sagecupy-int8", "fwd", "e2e", 1.0)])
    called = []
    monkeypatch.setattr(fw, "bench_int8_torch", lambda *a, **k: called.append(a) or [])
    monkeypatch.setattr(fw, "bench_int8_jax", lambda *a, **k: called.append(a) or [])
    rows = bench.run_suite([(128, 4096, False)], baselines="", adapters="torch,jax")
    assert called == []
    assert [(r["impl"], r["mode"]) for r in rows] == [("sagecupy-int8-torch", "skip"), ("sagecupy-int8-jax", "skip"),
                                                      ("sagecupy-int8", "fwd")]
    assert rows[1]["reason"] == "no jax here"
    text = bench.format_rows(rows)
    assert "skipped: no torch here" in text and "skipped: no jax here" in text


def test_run_suite_adapter_rows_follow_each_configs_int8_rows(monkeypatch):
    monkeypatch.setattr(fw, "adapter_unavailable", lambda name: None)
    order = []

    def cupy_rows(D, N, causal, *, config, dtype, **kw):
        order.append(("cupy", config, dtype))
        return [_row("sagecupy-int8", "fwd", "e2e", 1.0, config=config, dtype=dtype)]

    def torch_rows(D, N, causal, *, config, dtype, **kw):
        order.append(("torch", config, dtype))
        return [_row("sagecupy-int8-torch", "fwd", "e2e", 1.25, config=config, dtype=dtype)]

    def jax_rows(D, N, causal, **kw):
        raise RuntimeError("XLA said no")

    monkeypatch.setattr(bench, "bench_int8", cupy_rows)
    monkeypatch.setattr(fw, "bench_int8_torch", torch_rows)
    monkeypatch.setattr(fw, "bench_int8_jax", jax_rows)
    rows = bench.run_suite([(128, 4096, False)], configs=("default", "paper"), baselines="", adapters=("torch", "jax"),
                           dtype="float16")
    assert order == [("cupy", "default", "float16"), ("torch", "default", "float16"),
                     ("cupy", "paper", "float16"), ("torch", "paper", "float16")]
    assert [r["impl"] for r in rows] == ["sagecupy-int8", "sagecupy-int8-torch", "sagecupy-int8-jax"] * 2
    errors = [r for r in rows if r["mode"] == "error"]
    assert [r["config"] for r in errors] == ["default", "paper"] and "XLA said no" in errors[0]["error"]
    lines = bench.format_rows(rows).splitlines()
    torch_lines = [ln for ln in lines if ln.startswith("sagecupy-int8-torch ")]
    assert [ln.split()[-1] for ln in torch_lines] == ["0.80", "0.80"]  # 1.0 ms / 1.25 ms, each against its config


def test_run_suite_without_adapters_calls_none(monkeypatch):
    monkeypatch.setattr(fw, "adapter_unavailable", lambda name: pytest.fail("probed an adapter"))
    monkeypatch.setattr(bench, "bench_int8", lambda D, N, c, **kw: [_row("sagecupy-int8", "fwd", "e2e", 1.0)])
    rows = bench.run_suite([(128, 4096, False)], baselines="")
    assert [r["impl"] for r in rows] == ["sagecupy-int8"]


def _adapter_table(rows):
    lines = bench.format_rows(rows).splitlines()
    assert lines[0].split()[-2:] == ["x", "cupy"] and all(c in lines[0] for c in COLS)
    return lines


def test_format_rows_adapter_ratio_to_the_cupy_row_of_the_same_case_mode_and_scope():
    rows = [_row("sagecupy-int8", "fwd", "e2e", 1.0), _row("sagecupy-int8", "fwd", "train", 2.0),
            _row("sagecupy-int8", "fwd", "e2e-b2b", 0.9), _row("sagecupy-int8", "fwdbwd", "e2e", 4.0),
            _row("sdpa-default", "fwd", "e2e", 2.0),
            _row("sagecupy-int8-torch", "fwd", "e2e", 1.25), _row("sagecupy-int8-torch", "fwd", "train", 2.0),
            _row("sagecupy-int8-torch", "fwd", "e2e-b2b", 0.87), _row("sagecupy-int8-torch", "fwdbwd", "e2e", 5.0),
            _row("sagecupy-int8-jax", "fwd", "e2e", 1.0, timer="host"),
            _row("sagecupy-int8-jax", "fwdbwd", "e2e", 4.12, timer="host"),
            _row("sagecupy-int8-jax", "bwd", "e2e", 3.0)]  # no CuPy bwd row in this run
    lines = _adapter_table(rows)
    got = {(ln.split()[0], ln.split()[2], ln.split()[3]): ln.split()[-1] for ln in lines[1:]}
    assert got[("sagecupy-int8-torch", "fwd", "e2e")] == "0.80"
    assert got[("sagecupy-int8-torch", "fwd", "train")] == "1.00"
    assert got[("sagecupy-int8-torch", "fwd", "e2e-b2b")] == "1.03"
    assert got[("sagecupy-int8-torch", "fwdbwd", "e2e")] == "0.80"
    assert got[("sagecupy-int8-jax", "fwd", "e2e")] == "1.00"
    assert got[("sagecupy-int8-jax", "fwdbwd", "e2e")] == "0.97"
    assert got[("sagecupy-int8-jax", "bwd", "e2e")] == "-"
    # the CuPy and baseline rows have no x cupy; every row keeps its baseline ratios before it
    assert got[("sagecupy-int8", "fwd", "e2e")] == "-"
    assert next(ln for ln in lines if ln.startswith("sdpa-default")).split()[-1] == "-"
    torch_e2e = next(ln for ln in lines if ln.startswith("sagecupy-int8-torch ") and " train " not in ln)
    assert torch_e2e.split()[-5:-1] == ["1.60", "-", "-", "-"]  # SDPA 2.0 ms / 1.25 ms


def test_format_rows_adapter_rows_match_config_case_and_dtype_only():
    rows = [_row("sagecupy-int8", "fwd", "e2e", 1.0, config="paper"), _row("sagecupy-int8", "fwd", "e2e", 1.0, N=8192),
            _row("sagecupy-int8", "fwd", "e2e", 1.0, causal=True), _row("sagecupy-int8", "fwd", "e2e", 1.0,
                                                                        dtype="float16"),
            _row("sagecupy-int8", "fwd", "kernel", 1.0), _row("sagecupy-int8-torch", "fwd", "e2e", 1.0)]
    assert _adapter_table(rows)[-1].split()[-1] == "-"


def test_format_rows_adapter_column_is_aligned_and_absent_without_adapter_rows():
    plain = [_row("sagecupy-int8", "fwd", "e2e", 1.0), _row("sdpa-default", "fwd", "e2e", 2.0)]
    before = bench.format_rows(plain)
    assert "x cupy" not in before and before.splitlines()[0].startswith(f"{'impl':<16}cfg")
    rows = plain + [_row("sagecupy-int8-torch", "fwd", "e2e", 1.1),
                    dict(impl="sagecupy-int8-jax", mode="skip", adapter="jax", reason="no JAX"),
                    dict(impl="sagecupy-int8-jax", mode="error", D=128, N=4096, causal=False, error="boom")]
    lines = bench.format_rows(rows).splitlines()
    assert lines[0].startswith(f"{'impl':<20}cfg")  # the longest impl name and a space
    table = [ln for ln in lines if " skipped: " not in ln and " error " not in ln]
    assert len({len(ln) for ln in table}) == 1  # every column lines up, the new one included
    assert lines[4].startswith(f"{'sagecupy-int8-jax':<20} skipped: no JAX")
    assert lines[5].startswith(f"{'sagecupy-int8-jax':<20} error D=128")


# -- timing functions with other clocks --------------------------------------------------------------------------
class _FakeEvent:
    """A PyTorch-like event on a fake device clock that advances 2 ms per call of the timed function."""
    now = 0.0

    def record(self):
        self.t = _FakeEvent.now

    def synchronize(self):
        pass

    def elapsed_time(self, end):
        return end.t - self.t


def test_time_ms_and_b2b_take_a_frameworks_events():
    calls, syncs = [], []

    def fn():
        calls.append(1)
        _FakeEvent.now += 2.0

    assert bench.time_ms(fn, 3, 5, event=_FakeEvent, sync=lambda: syncs.append(1)) == pytest.approx(2.0)
    assert len(calls) >= 3 + 5 and syncs
    assert bench.time_ms_b2b(fn, 3, calls=4, rounds=3, event=_FakeEvent, sync=lambda: None) == pytest.approx(2.0)


def test_host_clock_waits_for_the_last_tracked_result():
    """The JAX rows' clock: an event's synchronize blocks on the last result handed to track, then reads the clock;
    the time between a start and an end includes that wait."""
    import time

    blocked = []

    def block(x):
        blocked.append(x)
        time.sleep(0.002)

    clock = fw._HostClock(block)
    n = iter(range(10**6))
    ms = bench.time_ms(lambda: clock.track(next(n)), 1, 3, event=clock.event, sync=clock.sync)
    assert ms >= 2.0 and blocked == sorted(blocked) and len(set(blocked)) == len(blocked)
    blocked.clear()
    per_call = bench.time_ms_b2b(lambda: clock.track(next(n)), 1, calls=4, rounds=2, event=clock.event,
                                 sync=clock.sync)
    assert 0.5 <= per_call < 2.0  # one 2 ms wait per round, shared by its 4 calls
    waited = len(blocked)
    clock.sync()  # nothing pending: no wait
    assert len(blocked) == waited


def _run_bench_module():
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).resolve().parents[2] / "bench" / "run_bench.py"
    spec = importlib.util.spec_from_file_location("run_bench_under_test", path)
    mod = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(mod)
    except ImportError as exc:  # the script's imports need what the package needs
        pytest.skip(f"bench/run_bench.py not importable here: {exc}")
    return mod


@pytest.mark.parametrize("argv, want", [([], ()), (["--adapters"], ("torch", "jax")),
                                        (["--adapters", "jax"], ("jax",)), (["--adapters", ""], ())])
def test_run_bench_adapters_flag(monkeypatch, capsys, argv, want):
    mod = _run_bench_module()
    seen = {}

    def suite(cases, **kw):
        seen.update(kw)
        return []

    monkeypatch.setattr(mod.bench, "run_suite", suite)
    mod.main(["--quick", "--baselines", ""] + argv)
    assert seen["adapters"] == want and seen["dtype"] == "bfloat16"
    assert capsys.readouterr().out.startswith("impl")


def test_run_bench_rejects_unknown_adapter_and_takes_a_dtype(monkeypatch, capsys):
    mod = _run_bench_module()
    with pytest.raises(SystemExit) as exc:
        mod.main(["--adapters", "torch,flax"])
    assert exc.value.code == 2 and "'flax' is not one of" in capsys.readouterr().err
    seen = {}
    monkeypatch.setattr(mod.bench, "run_suite", lambda cases, **kw: seen.update(kw) or [])
    mod.main(["--dtype", "float16", "--adapters", "torch", "--baselines", ""])
    assert seen["dtype"] == "float16" and seen["adapters"] == ("torch",)


def test_clear_destroys_each_cached_handle_once(monkeypatch):
    """clear() closes every cached graph pair: its graphs dropped, then its cuDNN handle destroyed, once."""
    import types

    from sagecupy import _cudnn_fp8, _cudnn_varlen

    destroyed = []
    fake = types.SimpleNamespace(destroy_handle=destroyed.append)
    for mod in (_cudnn_fp8, _cudnn_varlen):
        pair = object.__new__(_cudnn_fp8.GraphPair)
        pair.cudnn, pair.handle, pair._fwd = fake, f"handle of {mod.__name__}", "graph"
        monkeypatch.setitem(mod._CACHE, "key", pair)
        mod.clear()
        assert mod._CACHE == {} and pair.handle is None and pair._fwd is None
        pair.close()  # a second close destroys nothing
    assert destroyed == ["handle of sagecupy._cudnn_fp8", "handle of sagecupy._cudnn_varlen"]


# -- rounds ------------------------------------------------------------------------------------------------------
def test_run_suite_rounds_run_the_whole_sweep_again_and_tag_each_row(monkeypatch):
    """rounds=2: every case once, then every case again (not each case twice in a row), each row with its round."""
    monkeypatch.setattr(fw, "baseline_unavailable", lambda name: None)
    calls = []
    monkeypatch.setattr(fw, "bench_sdpa", lambda D, N, c, be, **kw: calls.append((D, N, c)) or [
        _row("sdpa-default", "fwd", "e2e", float(len(calls)), D=D, N=N, causal=c)])
    cases = [(64, 4096, False), (128, 4096, True)]
    rows = bench.run_suite(cases, baselines="sdpa", families=(), rounds=2)
    assert calls == cases + cases
    assert [(r["D"], r["round"], r["ms"]) for r in rows] == [(64, 0, 1.0), (128, 0, 2.0), (64, 1, 3.0), (128, 1, 4.0)]
    one = bench.run_suite(cases[:1], baselines="sdpa", families=())
    assert "round" not in one[0]  # a single round's rows are as they always were


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "2"])
def test_run_suite_rounds_must_be_a_whole_number_of_at_least_one(bad):
    with pytest.raises(ValueError, match="rounds"):
        bench.run_suite([], baselines="", rounds=bad)
    with pytest.raises(ValueError, match="rounds"):
        bench.run_varlen_suite([], baselines="", rounds=bad)


def test_median_rows_merges_the_rounds_of_each_row():
    from sagecupy._bench_common import median_rows

    skip = dict(impl="sdpa-flash", mode="skip", baseline="flash", reason="test")
    rows = [skip]
    for rnd, (a, b) in enumerate([(1.0, 5.0), (3.0, 4.0), (2.0, 9.0)]):
        rows += [dict(_row("sagecupy-int8", "fwd", "e2e", a, tops=10 * a), round=rnd),
                 dict(_row("sagecupy-int8", "fwd", "e2e", b, causal=True, window=[4096, 0]), round=rnd)]
    err = dict(impl="cudnn-fp8", mode="error", D=128, N=4096, causal=False, error="x", round=1)
    rows.insert(2, err)  # between the first round's two rows
    got = median_rows(rows)
    assert got[0] is skip and got[2] is err  # rows without times pass, in their place
    full, causal = got[1], got[3]
    assert (full["ms"], full["tops"], full["rounds"], full["ms_min"], full["ms_max"]) == (2.0, 20.0, 3, 1.0, 3.0)
    assert (causal["ms"], causal["ms_min"], causal["ms_max"], causal["window"]) == (5.0, 4.0, 9.0, [4096, 0])
    assert "round" not in full and len(got) == 4
    plain = [_row("sagecupy-int8", "fwd", "e2e", 1.0)]
    assert median_rows(plain) == plain  # rows of a single round are left as they are
    assert median_rows(got) == got      # and merged rows stay merged


def test_format_rows_shows_the_median_of_the_rounds():
    rows = [dict(r, round=i) for i, pair in enumerate([(1.0, 2.0), (1.0, 4.0), (1.0, 3.0)])
            for r in (_row("sdpa-default", "fwd", "e2e", pair[0]), _row("sagecupy-int8", "fwd", "e2e", pair[1]))]
    lines = _table(rows)
    ours = [line for line in lines if line.startswith("sagecupy-int8")]
    assert len(ours) == 1 and _ratios(ours[0])[0] == "0.33"  # 1.0 / median(2, 4, 3)


def test_table_tools_load_the_median_of_the_rounds(tmp_path):
    import json
    from pathlib import Path

    tools = str(Path(__file__).resolve().parents[2] / "bench" / "tools")
    sys.path.insert(0, tools)
    try:
        import fp4_table
    finally:
        sys.path.remove(tools)
    path = tmp_path / "run.jsonl"
    path.write_text("".join(json.dumps(dict(_row("sagecupy-int8", "fwd", "e2e", ms), round=i)) + "\n"
                            for i, ms in enumerate((2.0, 8.0, 3.0))))
    rows = fp4_table.load(path)
    assert len(rows) == 1 and rows[0]["ms"] == 3.0 and rows[0]["rounds"] == 3
