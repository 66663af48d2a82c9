"""The packed-batch and sliding-window benchmark without a GPU: the cases (document lengths, seeds, visible-pair FLOPs
against reference.attention.visible_mask), the options of run_bench.py and `sagecupy bench`, the suite's soft skips
with stand-ins for the timed functions, the tables, and the cuDNN varlen module's clean refusal."""
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from reference.attention import visible_mask
from sagecupy import _bench_common as common
from sagecupy import _cudnn_varlen, bench
from sagecupy import bench_frameworks as fw
from sagecupy.cli import main
from test_bench_baselines import skip_with_cuda

ROOT = Path(__file__).resolve().parents[2]


# -- cases ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("n, s, seed", [(16384, 8, 0), (16384, 32, 0), (16384, 32, 7), (4096, 64, 3), (640, 10, 1),
                                        (16384, 1, 0)])
def test_doc_lengths_sum_to_n_with_min_length_and_are_seeded(n, s, seed):
    lengths = common.doc_lengths(n, s, seed)
    assert len(lengths) == s and sum(lengths) == n and min(lengths) >= common.MIN_DOC_LEN
    assert all(isinstance(x, int) for x in lengths)
    assert common.doc_lengths(n, s, seed) == lengths


def test_doc_lengths_vary_with_the_seed_and_widely():
    a, b = common.doc_lengths(16384, 32, 0), common.doc_lengths(16384, 32, 1)
    assert a != b
    assert max(a) > 2 * min(a)  # random cut points: not near-equal lengths


def test_doc_lengths_fixed_values():
    """The seed fixes the lengths on every machine (NumPy's default_rng): a run's rows can be reproduced."""
    rest = 16384 - 8 * 64
    cuts = np.sort(np.random.default_rng(0).integers(0, rest + 1, 7))
    want = [64 + int(e) for e in np.diff(np.concatenate([[0], cuts, [rest]]))]
    assert common.doc_lengths(16384, 8, 0) == want


def test_doc_lengths_refuses_too_few_tokens():
    with pytest.raises(ValueError, match="need 2048 tokens"):
        common.doc_lengths(2000, 32, 0)
    with pytest.raises(ValueError):
        common.doc_lengths(100, 0)


@pytest.mark.parametrize("nq, nk, causal, window", [
    (1, 1, True, None), (7, 7, True, None), (64, 64, True, None), (50, 50, False, None), (33, 70, True, None),
    (70, 33, True, None), (64, 64, True, (8, 0)), (64, 64, True, (0, 0)), (64, 64, True, (63, 0)),
    (64, 64, True, (200, 0)), (40, 90, False, (5, 3)), (90, 40, False, (-1, 4)), (17, 17, False, (3, -1)),
])
def test_visible_pairs_match_the_reference_mask(nq, nk, causal, window):
    assert common.visible_pairs(nq, nk, causal, window) == int(visible_mask(nq, nk, causal, window).sum())


@pytest.mark.parametrize("case", [dict(kind="packed", D=128, N=16384, S=8, seed=0),
                                  dict(kind="packed", D=64, N=16384, S=32, seed=0),
                                  dict(kind="window", D=128, N=4096, W=1024),
                                  dict(kind="window", D=64, N=16384, W=4096)])
def test_case_flops_count_the_visible_pairs(case):
    """FLOPs of a packed case are over each document's causal pairs, of a window case over the windowed pairs of
    every sequence: NumPy's count of reference.attention.visible_mask, document by document."""
    shape = common.case_shape(case)
    assert sum(shape["lengths"]) == (shape["B"] * case["N"] if case["kind"] == "window" else case["N"])
    assert shape["H"] * case["D"] == 2048
    want = 0
    for L in shape["lengths"]:
        if case["kind"] == "window" and L > 4096:  # the mask of a 16K sequence is 256M booleans: count one row band
            want += _window_pairs_by_blocks(L, case["W"])
        else:
            want += int(visible_mask(L, L, True, shape["window"]).sum())
    assert shape["pairs"] == want
    for mode, k in (("fwd", 1.0), ("bwd", 2.5), ("fwdbwd", 3.5)):
        assert common.pair_flops(shape["pairs"], shape["H"], case["D"], mode) == 4.0 * want * 2048 * k


def _window_pairs_by_blocks(L, W, block=2048):
    """visible_mask's count for a long sequence, a block of rows at a time (same mask, less memory)."""
    total = 0
    for a in range(0, L, block):
        b = min(L, a + block)
        i = np.arange(a, b)[:, None]
        j = np.arange(L)[None, :]
        total += int(((j <= i) & (j >= i - W)).sum())
    return total


def test_packed_causal_pairs_are_about_half_of_the_dense_counts():
    """One document of N tokens is the dense causal case: its pairs N(N+1)/2 and the dense convention N^2/2 differ by
    N/2, so TFLOPS of the two kinds of rows compare."""
    shape = common.case_shape(dict(kind="packed", D=128, N=16384, S=1, seed=0))
    assert shape["pairs"] == 16384 * 16385 // 2
    dense = common.flops(1, 16, 16384, 16384, 128, True)
    assert abs(common.pair_flops(shape["pairs"], 16, 128) / dense - 1) < 1e-3


def test_case_lists():
    assert common.packed_cases((128,), (8, 32)) == [dict(kind="packed", D=128, N=16384, S=8, seed=0),
                                                    dict(kind="packed", D=128, N=16384, S=32, seed=0)]
    ws = common.window_cases((64, 128), (1024, 16384), (1024, 4096))
    assert [(c["D"], c["N"], c["W"]) for c in ws] == [(64, 16384, 1024), (64, 16384, 4096), (128, 16384, 1024),
                                                      (128, 16384, 4096)]  # W >= N - 1 is plain causal: left out
    assert common.case_name(ws[0]) == "window D=64 N=16384 W=1024"
    assert common.case_name(common.packed_cases((128,), (8,))[0]) == "packed D=128 N=16384 S=8"


# -- option parsing ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("spec, want", [("8,32", (8, 32)), ("32, 8,8", (8, 32)), ("", ()), (None, ()),
                                        ((1024, 4096), (1024, 4096))])
def test_parse_int_list(spec, want):
    assert common.parse_int_list(spec, "--packed") == want


@pytest.mark.parametrize("bad", ["8,x", "0", "-4", "1.5"])
def test_parse_int_list_names_the_option(bad):
    with pytest.raises(ValueError, match="--windows"):
        common.parse_int_list(bad, "--windows")


def test_parse_varlen_baselines():
    assert bench.parse_varlen_baselines("flex, cudnn,flex") == ("flex", "cudnn")
    assert bench.parse_varlen_baselines("") == ()
    assert bench.DEFAULT_VARLEN_BASELINES == ("cudnn", "sdpa-docs", "torch-varlen", "flex")
    with pytest.raises(ValueError, match="--varlen-baselines: 'sdpa' is not one of"):
        bench.parse_varlen_baselines("sdpa")


def _run_bench():
    spec = importlib.util.spec_from_file_location("run_bench_varlen", ROOT / "bench" / "run_bench.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class _Args:
    def __init__(self, **kw):
        self.quick, self.ds, self.ns = kw.get("quick", False), kw.get("ds"), kw.get("ns")


def test_run_bench_cases():
    mod = _run_bench()
    dense, varlen = mod.select_cases(_Args(quick=True, ds="128"), (8,), (1024,))
    assert {c[0] for c in dense} == {128}
    assert [common.case_name(c) for c in varlen] == ["packed D=128 N=16384 S=8", "window D=128 N=4096 W=1024",
                                                     "window D=128 N=16384 W=1024"]
    assert mod.select_cases(_Args(quick=True), (), ())[1] == []


def test_run_bench_varlen_options(monkeypatch, capsys):
    mod = _run_bench()
    seen = {}
    monkeypatch.setattr(bench, "run_suite", lambda cases, **kw: seen.setdefault("dense", list(cases)) and [])
    monkeypatch.setattr(bench, "run_varlen_suite", lambda cases, **kw: seen.update(
        varlen=list(cases), baselines=kw["baselines"], rounds=kw["rounds"]) or [])
    mod.main(["--no-dense", "--packed", "--windows", "4096", "--ds", "64", "--ns", "16384",
              "--varlen-baselines", "cudnn", "--rounds", "2"])
    assert "dense" not in seen and seen["baselines"] == ("cudnn",) and seen["rounds"] == 2
    assert [common.case_name(c) for c in seen["varlen"]] == ["packed D=64 N=16384 S=8", "packed D=64 N=16384 S=32",
                                                             "window D=64 N=16384 W=4096"]
    for bad in (["--packed", "8,zero"], ["--varlen-baselines", "nope"], ["--windows", "0"], ["--rounds", "0"]):
        with pytest.raises(SystemExit) as exc:
            mod.main(bad)
        assert exc.value.code == 2
    assert "'nope' is not one of" in capsys.readouterr().err


@pytest.fixture
def fake_suites(monkeypatch):
    seen = {}

    def run_suite(cases, *, configs, baselines, out, rep, families, dtype, progress, rounds):
        seen.update(dense=list(cases), rounds=rounds)
        for c in cases:
            progress(c)
        return []

    def run_varlen_suite(cases, *, configs, baselines, out, rep, families, dtype, progress, rounds):
        seen.update(varlen=list(cases), baselines=baselines, varlen_rounds=rounds)
        rows = []
        for c in cases:
            rows.append(dict(impl=f"sagecupy-int8-{c['kind']}", config="default", mode="fwd", scope="e2e",
                             case=c["kind"], D=c["D"], N=c["N"], S=c.get("S"), W=c.get("W"), B=1, H=16,
                             causal=True, dtype=dtype, ms=1.0, tops=100.0))
            progress(c)
        return rows

    monkeypatch.setattr("sagecupy.cli.gpu_status", lambda: (True, "Fake GPU (sm_90)"))
    monkeypatch.setattr(bench, "run_suite", run_suite)
    monkeypatch.setattr(bench, "run_varlen_suite", run_varlen_suite)
    return seen


def test_cli_bench_packed_and_windows(fake_suites):
    r = CliRunner().invoke(main, ["bench", "--quick", "--d", "128", "--packed", "--windows", "1024",
                                  "--varlen-baselines", "cudnn,flex"])
    assert r.exit_code == 0, r.output
    assert fake_suites["dense"] and fake_suites["baselines"] == ("cudnn", "flex")
    assert [common.case_name(c) for c in fake_suites["varlen"]] == [
        "packed D=128 N=16384 S=8", "packed D=128 N=16384 S=32", "window D=128 N=4096 W=1024",
        "window D=128 N=16384 W=1024"]
    progress = [ln for ln in r.stderr.splitlines() if ln.startswith("sagecupy: ")]
    assert len(progress) == 4 + 4 and "packed D=128 N=16384 S=8 done" in progress[4]
    assert "x cudnn" in r.stdout and "sagecupy-int8-packed" in r.stdout


def test_cli_bench_default_run_has_no_varlen_cases(fake_suites):
    r = CliRunner().invoke(main, ["bench", "--quick", "--d", "64"])
    assert r.exit_code == 0, r.output
    assert "varlen" not in fake_suites and len(fake_suites["dense"]) == 4


def test_cli_bench_no_dense(fake_suites):
    r = CliRunner().invoke(main, ["bench", "--no-dense", "--packed", "8", "--d", "64"])
    assert r.exit_code == 0, r.output
    assert "dense" not in fake_suites and [c["S"] for c in fake_suites["varlen"]] == [8]
    r = CliRunner().invoke(main, ["bench", "--no-dense"])
    assert r.exit_code == 2 and "--no-dense leaves nothing" in r.output


@pytest.mark.parametrize("args", [["--packed", "8,x"], ["--windows", "-3"], ["--varlen-baselines", "sdpa"]])
def test_cli_bench_bad_varlen_options_are_usage_errors(monkeypatch, args):
    monkeypatch.setattr("sagecupy.cli.gpu_status", lambda: (False, "no CUDA device"))
    r = CliRunner().invoke(main, ["bench", *args])
    assert r.exit_code == 2 and "needs a CUDA device" not in r.output, r.output


# -- the suite with stand-ins --------------------------------------------------------------------------------------
def test_run_varlen_suite_skips_and_errors(monkeypatch):
    monkeypatch.setattr(fw, "varlen_baseline_unavailable", lambda name: "no torch" if name != "cudnn" else None)
    monkeypatch.setattr(bench, "bench_int8_varlen", lambda case, **kw: [dict(
        impl=f"sagecupy-int8-{case['kind']}", config="default", mode="fwd", scope="e2e", case=case["kind"],
        D=case["D"], N=case["N"], S=case.get("S"), W=case.get("W"), ms=2.0, tops=1.0)])

    def cudnn(case, shape, dtype, warmup, rep):
        if case["kind"] == "window":
            raise RuntimeError("graph declined")
        return [dict(impl="cudnn-bf16", config="", mode="fwd", scope="e2e", **common.case_fields(case, shape),
                     ms=3.0, tops=1.0)]
    monkeypatch.setattr(fw, "_bench_cudnn_varlen", cudnn)
    cases = common.packed_cases((128,), (8,)) + common.window_cases((128,), (16384,), (1024,))
    out, logged = [], []

    class F:
        def write(self, s):
            out.append(s)

        def flush(self):
            pass
    rows = bench.run_varlen_suite(cases, out=F(), log=logged.append)
    assert [r["mode"] for r in rows[:3]] == ["skip"] * 3 and {r["impl"] for r in rows[:3]} == {
        "sdpa-per-doc", "torch-varlen", "flex-attention"}
    errors = [r for r in rows if r["mode"] == "error"]
    assert len(errors) == 1 and errors[0]["case"] == "window" and "graph declined" in errors[0]["error"]
    assert logged == rows and [json.loads(s) for s in "".join(out).splitlines()] == rows
    text = bench.format_rows(rows)
    line = next(ln for ln in text.splitlines() if "sagecupy-int8-packed" in ln)
    assert line.split()[-4:] == ["1.50", "-", "-", "-"]
    assert "skipped: no torch" in text and "error (window D=128 N=16384 W=1024)" in text


def test_a_graph_cudnn_declines_is_a_skip_not_an_error(monkeypatch):
    from sagecupy._cudnn_fp8 import Unavailable

    def declined(case, shape, dtype, warmup, rep):
        raise Unavailable("cuDNN bf16 forward graph not supported for packed B=8: ragged offsets need sm_90")
    monkeypatch.setattr(fw, "_bench_cudnn_varlen", declined)
    rows = fw.bench_varlen_baseline("cudnn", common.packed_cases((128,), (8,))[0])
    assert len(rows) == 1 and rows[0]["mode"] == "skip" and "ragged offsets need sm_90" in rows[0]["reason"]
    assert rows[0]["impl"] == "cudnn-bf16" and rows[0]["case"] == "packed"


def test_sdpa_docs_has_no_window_form():
    case = common.window_cases((128,), (16384,), (1024,))[0]
    rows = fw.bench_varlen_baseline("sdpa-docs", case)
    assert len(rows) == 1 and rows[0]["mode"] == "skip" and "sliding window" in rows[0]["reason"]


def test_varlen_baselines_answer_without_a_gpu():
    skip_with_cuda()
    for name in bench.VARLEN_BASELINES:
        why = fw._varlen_reason(name)
        assert isinstance(why, str) and why


# -- tables --------------------------------------------------------------------------------------------------------
def _vrow(impl, mode, scope, ms, case="packed", **kw):
    r = dict(impl=impl, config="default" if impl.startswith("sagecupy") else "", mode=mode, scope=scope, case=case,
             D=128, N=16384, B=1, H=16, causal=True, dtype="bfloat16", ms=ms, tops=1.0)
    r.update(dict(S=8, seed=0) if case == "packed" else dict(W=1024, window=[1024, 0]))
    r.update(kw)
    return r


def _varlen_rows():
    return [
        dict(impl="torch-varlen", mode="skip", baseline="torch-varlen", reason="PyTorch 2.5 has none"),
        _vrow("sagecupy-int8-packed", "fwd", "e2e-b2b", 1.0), _vrow("cudnn-bf16", "fwd", "e2e-b2b", 1.5),
        _vrow("sdpa-per-doc", "fwd", "e2e-b2b", 4.0), _vrow("flex-attention", "fwd", "e2e-b2b", 2.0),
        _vrow("sagecupy-int8-packed", "fwd", "e2e", 1.0), _vrow("cudnn-bf16", "fwd", "e2e", 1.2),
        _vrow("sagecupy-int8-window", "fwdbwd", "e2e-b2b", 2.0, case="window"),
        _vrow("cudnn-bf16", "fwdbwd", "e2e-b2b", 5.0, case="window", window_applied=False),
        dict(impl="cudnn-bf16", mode="note", case="window", D=128, N=16384, W=1024, reason="no band"),
        # a dense row of the same D, N, causal: never a varlen row's baseline
        dict(impl="sdpa-default", config="", mode="fwd", scope="e2e-b2b", D=128, N=16384, B=1, H=16, causal=True,
             dtype="bfloat16", ms=0.1, tops=1.0),
    ]


def test_format_varlen_rows_ratios():
    text = bench.format_rows(_varlen_rows())
    dense, varlen = text.split("\n\n")
    assert "sagecupy-int8" not in dense and "sdpa-default" in dense
    lines = varlen.splitlines()
    assert all(h in lines[0] for h in ("x cudnn", "x docs", "x varlen", "x flex"))
    b2b = next(ln for ln in lines if "sagecupy-int8-packed" in ln and "e2e-b2b" in ln)
    assert b2b.split()[-4:] == ["1.50", "4.00", "-", "2.00"]
    e2e = next(ln for ln in lines if "sagecupy-int8-packed" in ln and " e2e " in ln)
    assert e2e.split()[-4:] == ["1.20", "-", "-", "-"]
    win = next(ln for ln in lines if "sagecupy-int8-window" in ln)
    assert win.split()[-4:] == ["2.50", "-", "-", "-"]
    assert any("cudnn-bf16 (causal)" in ln for ln in lines)
    assert any(ln.startswith("cudnn-bf16 note (window D=128 N=16384 W=1024): no band") for ln in lines)
    assert any(ln.startswith("torch-varlen skipped: PyTorch 2.5 has none") for ln in lines)


def test_varlen_table_tool_and_sweep_table_ignore_each_other(tmp_path):
    tools = ROOT / "bench" / "tools"
    path = tmp_path / "run.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in [{"type": "env"}] + _varlen_rows()) + "\n")
    out = subprocess.run([sys.executable, str(tools / "varlen_table.py"), str(path)], capture_output=True, text=True,
                         cwd=tools, check=True).stdout
    fwd = next(ln for ln in out.splitlines() if ln.startswith("| packed | 128 | 16K | 8 | fwd |"))
    cells = [c.strip() for c in fwd.strip("|").split("|")]
    assert cells[5:] == ["1.000", "1", "1.50", "4.00", "–", "2.00"]
    win = next(ln for ln in out.splitlines() if ln.startswith("| window |"))
    assert [c.strip() for c in win.strip("|").split("|")][7] == "2.50c"
    assert "torch-varlen skip: PyTorch 2.5 has none" in out and "cudnn-bf16 note" in out
    out = subprocess.run([sys.executable, str(tools / "varlen_table.py"), str(path), "--scope", "e2e"],
                         capture_output=True, text=True, cwd=tools, check=True).stdout
    assert "| packed | 128 | 16K | 8 | fwd | 1.000 | 1 | 1.20 | – | – | – |" in out
    sweep = subprocess.run([sys.executable, str(tools / "sweep_table.py"), str(path)], capture_output=True, text=True,
                           cwd=tools, check=True).stdout
    assert "packed" not in sweep and "| 128 |" not in sweep  # no dense sagecupy rows in this file


# -- cuDNN varlen module -------------------------------------------------------------------------------------------
def test_cudnn_varlen_refuses_cleanly_without_the_frontend():
    why = _cudnn_varlen.unavailable_reason()
    assert why is None or (isinstance(why, str) and why)
    if why:
        with pytest.raises(_cudnn_varlen.Unavailable) as exc:
            _cudnn_varlen.CudnnSdpa([64, 128], 16, 128)
        assert str(exc.value) == why


def test_cudnn_varlen_offsets_layout_and_masks():
    assert _cudnn_varlen.ragged_offsets([3, 5, 2], 4, 8) == [0, 96, 256, 320]
    dims, strides = _cudnn_varlen.thd_dims_strides(3, 4, 5, 8)
    assert dims == (3, 4, 5, 8) and strides == (160, 8, 32, 1)
    # element (b, h, s, d) of document b sits at offsets[b] + (s * H + h) * D + d of (T, H, D) storage
    offs = _cudnn_varlen.ragged_offsets([3, 5, 2], 4, 8)
    assert offs[1] + sum(i * st for i, st in zip((0, 2, 4, 7), strides)) == ((3 + 4) * 4 + 2) * 8 + 7

    class Align:
        TOP_LEFT = "TL"

    class FakeCudnn:
        diagonal_alignment = Align

    assert _cudnn_varlen.mask_kwargs(FakeCudnn, None, "band") == dict(diagonal_alignment="TL",
                                                                     diagonal_band_right_bound=0)
    # sagecupy's window (W, 0) sees W + 1 keys; cuDNN's left bound lb keeps j > i - lb: lb = W + 1
    assert _cudnn_varlen.mask_kwargs(FakeCudnn, 1024, "band")["diagonal_band_left_bound"] == 1025
    assert _cudnn_varlen.mask_kwargs(FakeCudnn, 1024, "flag") == dict(use_causal_mask=True,
                                                                     sliding_window_length=1025)
    with pytest.raises(ValueError):
        _cudnn_varlen.mask_kwargs(FakeCudnn, None, "other")


def test_cudnn_left_bound_matches_our_window():
    """cuDNN's band (j > i - lb, j <= i) with lb = W + 1 is visible_mask's window (W, 0)."""
    n, W = 40, 6
    lb = _cudnn_varlen.mask_kwargs(type("C", (), {"diagonal_alignment": type("A", (), {"TOP_LEFT": 0})}), W,
                                   "band")["diagonal_band_left_bound"]
    i, j = np.arange(n)[:, None], np.arange(n)[None, :]
    assert np.array_equal((j > i - lb) & (j <= i), visible_mask(n, n, True, (W, 0)))
