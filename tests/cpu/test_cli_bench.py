"""`sagecupy bench` and `sagecupy plot` without a GPU: clean errors, and figures from saved results."""
import json

import pytest
from click.testing import CliRunner

from sagecupy import bench
from sagecupy.cli import main


def test_flops_convention():
    assert bench.flops(2, 3, 5, 7, 64, False) == 4 * 2 * 3 * 5 * 7 * 64
    assert bench.flops(1, 1, 8, 8, 64, True) == 4 * 8 * 8 * 64 / 2          # causal, Nq == Nk: halved
    assert bench.flops(1, 1, 8, 9, 64, True) == 4 * 8 * 9 * 64              # Nq != Nk: not halved
    assert bench.flops(1, 1, 8, 8, 64, False, "bwd") == 2.5 * bench.flops(1, 1, 8, 8, 64, False)
    assert bench.flops(1, 1, 8, 8, 64, False, "fwdbwd") == 3.5 * bench.flops(1, 1, 8, 8, 64, False)


def test_bench_without_gpu_is_one_line_error(monkeypatch):
    monkeypatch.setattr("sagecupy.cli.gpu_status", lambda: (False, "no CUDA device"))
    r = CliRunner().invoke(main, ["bench", "--quick"])
    assert r.exit_code != 0 and "needs a CUDA device" in r.output and "Traceback" not in r.output


def _rows():
    out = [dict(type="env", gpu="test")]
    for impl, tops in (("sagecupy-int8", 200.0), ("sdpa-flash", 300.0)):
        for n in (1024, 4096):
            out.append(dict(impl=impl, config="default" if "int8" in impl else "", mode="fwd", scope="e2e", D=128,
                            N=n, B=1, H=16, causal=False, dtype="bfloat16", ms=1.0, tops=tops))
    return out


def test_format_rows_ratios():
    rows = [r for r in _rows() if "impl" in r]
    rows[0]["ms"] = 0.5  # twice as fast as flash at N=1024
    text = bench.format_rows(rows)
    assert "2.00" in text.splitlines()[1]


def test_plot_writes_pngs(tmp_path):
    pytest.importorskip("matplotlib")
    res = tmp_path / "r.jsonl"
    res.write_text("\n".join(json.dumps(r) for r in _rows()) + "\n")
    r = CliRunner().invoke(main, ["plot", str(res), "--out", str(tmp_path / "p")])
    assert r.exit_code == 0, r.output
    assert (tmp_path / "p" / "speed_d128_full_fwd.png").is_file()


def test_plot_rejects_non_bench_file(tmp_path):
    pytest.importorskip("matplotlib")
    bad = tmp_path / "x.jsonl"
    bad.write_text('{"type": "env"}\n')
    r = CliRunner().invoke(main, ["plot", str(bad)])
    assert r.exit_code != 0 and "no benchmark rows" in r.output and "Traceback" not in r.output


def test_format_rows_compares_back_to_back_rows_with_back_to_back_baselines():
    """An ``e2e-b2b`` row is divided into SDPA's ``e2e-b2b`` time, every other row into SDPA's ``e2e`` time."""
    common = dict(mode="fwd", D=128, N=4096, B=4, H=16, causal=False, dtype="bfloat16", tops=1.0)
    rows = [dict(impl="sdpa-flash", config="", scope="e2e", ms=1.0, **common),
            dict(impl="sdpa-flash", config="", scope="e2e-b2b", ms=3.0, **common),
            dict(impl="sagecupy-int8", config="default", scope="e2e", ms=0.5, **common),
            dict(impl="sagecupy-int8", config="default", scope="e2e-b2b", ms=1.5, **common)]
    lines = bench.format_rows(rows).splitlines()
    assert lines[3].split()[-2] == "2.00"  # e2e: 1.0 / 0.5
    assert lines[4].split()[-2] == "2.00"  # e2e-b2b: 3.0 / 1.5 (not 1.0 / 1.5)


def test_time_ms_b2b_divides_each_round_by_its_calls():
    """time_ms_b2b records one event pair around ``calls`` calls per round and returns the median per-call time
    (fake events: each round's elapsed time is the number of calls made inside it, in ms)."""
    calls = []

    class FakeEvent:
        def record(self):
            self.at = len(calls)

        def synchronize(self):
            pass

        def elapsed_time(self, end):
            return float(end.at - self.at)

    ms = bench.time_ms_b2b(lambda: calls.append(1), warmup=2, calls=7, rounds=3, event=FakeEvent, sync=lambda: None)
    assert ms == 1.0
    assert len(calls) >= 2 + 7 * 3


def test_bench_baselines_option_matches_bench(monkeypatch):
    """`--baselines` takes bench.BASELINES, its help states bench.DEFAULT_BASELINES, and a bad name is a usage
    error before any GPU check."""
    monkeypatch.setattr("sagecupy.cli.gpu_status", lambda: (False, "no CUDA device"))
    text = " ".join(CliRunner().invoke(main, ["bench", "--help"]).stdout.split())
    for name in bench.BASELINES:
        assert name in text
    assert f"[default: {','.join(bench.DEFAULT_BASELINES)}]" in text.replace("- ", "-")
    r = CliRunner().invoke(main, ["bench", "--baselines", "sdpa,nope"])
    assert r.exit_code == 2 and "'nope' is not one of" in r.stderr and "needs a CUDA device" not in r.output
    r = CliRunner().invoke(main, ["bench", "--configs", "bkv64", "--baselines", "cudnn-fp8"])
    assert r.exit_code == 1 and "needs a CUDA device" in r.stderr  # valid arguments: only the GPU is missing
