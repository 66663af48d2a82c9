"""The README's table tools (bench/tools/*.py) on synthetic benchmark rows: every ratio is SDPA flash's time over
sagecupy's from the same file, and a missing row prints a dash instead of failing."""
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


def _run(tool, rows, tmp_path, *args):
    path = tmp_path / "run.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in [{"type": "env"}] + rows) + "\n")
    out = subprocess.run([sys.executable, str(TOOLS / tool), str(path), *args], capture_output=True, text=True,
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
