"""`sagecupy bench`'s analysis-style options without a GPU: the sweep narrowed by --d/--n/--causal, --dtype passed
through, --format table|json|csv on stdout, one progress line per case on stderr (bench.run_suite faked)."""
import csv
import io
import json

import pytest
from click.testing import CliRunner

from sagecupy import bench
from sagecupy.cli import bench_cases, main


def test_cases_are_narrowed():
    full = bench.default_cases()
    assert bench_cases(quick=False, d=None, n=None, causal=None) == full
    assert bench_cases(quick=True, d=128, n=None, causal=True) == [(128, 4096, True), (128, 16384, True)]
    assert bench_cases(quick=False, d=None, n=8192, causal=False) == [(64, 8192, False), (128, 8192, False)]
    assert bench_cases(quick=True, d=64, n=3000, causal=None) == [(64, 3000, False), (64, 3000, True)]  # any N


@pytest.fixture
def fake_suite(monkeypatch):
    """A usable "GPU" and a run_suite that records its arguments and returns one row per case."""
    seen = {}

    def run_suite(cases, *, configs, baselines, out, rep, families, dtype, progress, rounds):
        seen.update(cases=list(cases), dtype=dtype, families=families, rounds=rounds)
        rows = [dict(impl="sdpa-flash", mode="skip", baseline="flash", reason="test")]
        for rnd in range(rounds):
            for d, n, causal in cases:
                row = dict(impl="sagecupy-int8", config="default", mode="fwd", scope="e2e", D=d, N=n, B=1, H=16,
                           causal=causal, dtype=dtype, ms=1.0 + rnd, tops=100.0)
                rows.append(row if rounds == 1 else dict(row, round=rnd))
                progress((d, n, causal))
        return rows

    monkeypatch.setattr("sagecupy.cli.gpu_status", lambda: (True, "Fake GPU (sm_90)"))
    monkeypatch.setattr(bench, "run_suite", run_suite)
    return seen


def test_bench_table_with_progress(fake_suite):
    r = CliRunner().invoke(main, ["bench", "--quick", "--d", "128", "--no-causal", "--dtype", "fp16"])
    assert r.exit_code == 0, r.output
    assert fake_suite["cases"] == [(128, 4096, False), (128, 16384, False)] and fake_suite["dtype"] == "float16"
    progress = [line for line in r.stderr.splitlines() if line.startswith("sagecupy: D=")]
    assert [line.split(" done")[0] for line in progress] == ["sagecupy: D=128 N=4096 full",
                                                             "sagecupy: D=128 N=16384 full"]
    assert "(1/2," in progress[0] and "(2/2," in progress[1]
    assert r.stdout.splitlines()[0].split()[:3] == ["impl", "cfg", "mode"]  # bench.format_rows' table
    assert "skipped: test" in r.stdout


def test_bench_json_and_csv(fake_suite):
    r = CliRunner().invoke(main, ["bench", "--n", "2048", "--d", "64", "--causal", "--format", "json"])
    assert r.exit_code == 0, r.output
    lines = [json.loads(line) for line in r.stdout.splitlines()]
    assert lines[0]["type"] == "env" and "nvrtc" in lines[0]
    assert [(x["D"], x["N"], x["causal"], x["dtype"]) for x in lines[2:]] == [(64, 2048, True, "bfloat16")]
    r = CliRunner().invoke(main, ["bench", "--n", "2048", "--d", "64", "--format", "csv"])
    assert r.exit_code == 0, r.output
    rows = list(csv.DictReader(io.StringIO(r.stdout)))
    assert [(x["impl"], x["N"], x["causal"]) for x in rows[1:]] == [("sagecupy-int8", "2048", "False"),
                                                                    ("sagecupy-int8", "2048", "True")]


def test_bench_out_file_keeps_json_lines(fake_suite, tmp_path):
    path = tmp_path / "b.jsonl"
    r = CliRunner().invoke(main, ["bench", "--quick", "--d", "64", "--causal", "--out", str(path)])
    assert r.exit_code == 0, r.output
    first = json.loads(path.read_text().splitlines()[0])
    assert first["type"] == "env"  # the rows themselves go to the file from run_suite (faked here)


def test_bench_rounds_show_one_median_row_and_count_progress(fake_suite):
    """--rounds R: run_suite gets R, the progress counts every case of every round, and the table shows each row once
    with its median over the rounds (the fake times round r at 1 + r ms: the median of 1, 2, 3 is 2)."""
    r = CliRunner().invoke(main, ["bench", "--n", "2048", "--d", "64", "--causal", "--rounds", "3"])
    assert r.exit_code == 0, r.output
    assert fake_suite["rounds"] == 3
    progress = [line for line in r.stderr.splitlines() if line.startswith("sagecupy: D=")]
    assert len(progress) == 3 and "(3/3," in progress[-1]
    ours = [line for line in r.stdout.splitlines() if line.startswith("sagecupy-int8")]
    assert len(ours) == 1 and ours[0].split()[7] == "2.000"
    r = CliRunner().invoke(main, ["bench", "--n", "2048", "--d", "64", "--causal", "--rounds", "3", "--format", "json"])
    assert r.exit_code == 0, r.output
    rows = [json.loads(line) for line in r.stdout.splitlines()][2:]
    assert [x["round"] for x in rows] == [0, 1, 2]  # the raw rows, every round's


def test_bench_bad_options_are_usage_errors(monkeypatch):
    monkeypatch.setattr("sagecupy.cli.gpu_status", lambda: (False, "no CUDA device"))
    for args in (["--d", "96"], ["--dtype", "fp32"], ["--n", "0"], ["--format", "xml"], ["--rounds", "0"]):
        r = CliRunner().invoke(main, ["bench", *args])
        assert r.exit_code == 2 and "needs a CUDA device" not in r.output, (args, r.output)
