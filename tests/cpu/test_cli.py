"""The ``sagecupy`` command line through click's CliRunner, on tiny shapes, without a GPU."""
from __future__ import annotations

import csv
import io
import json

import numpy as np
import pytest
from click.testing import CliRunner

from sagecupy import analysis
from sagecupy.cli import main

TINY = ["--n", "32", "--heads", "1", "--d", "32"]


@pytest.fixture
def runner():
    return CliRunner()


@pytest.fixture(autouse=True)
def no_gpu(monkeypatch):
    """Every test here sees a machine without a usable GPU (also on a GPU machine)."""
    monkeypatch.setattr(analysis, "gpu_status", lambda: (False, "no CUDA device (test)"))


def _ok(result):
    assert result.exit_code == 0, (result.stdout, result.stderr, result.exception)
    assert "Traceback" not in result.output
    return result


def _one_line_error(result):
    assert result.exit_code != 0
    assert "Traceback" not in result.output
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: "), result.stderr
    return lines[0]


def _json_lines(text):
    records = [json.loads(line) for line in text.splitlines()]
    assert records and records[0]["type"] == "env"
    return records[0], records[1:]


# ----------------------------------------------------------------------------
# the happy paths
# ----------------------------------------------------------------------------


def test_help_lists_the_commands(runner):
    out = _ok(runner.invoke(main, ["--help"])).stdout
    for command in ("info", "accuracy", "intermediates", "smoothing"):
        assert command in out
    assert "--backend" in _ok(runner.invoke(main, ["accuracy", "--help"])).stdout


def test_version(runner):
    import sagecupy

    assert _ok(runner.invoke(main, ["--version"])).stdout == f"sagecupy, version {sagecupy.__version__}\n"


@pytest.mark.parametrize("module", ["sagecupy", "sagecupy.cli"])
def test_python_m_version_from_the_checkout(module):
    """`python -m sagecupy` and `python -m sagecupy.cli` work without installing (no distribution metadata)."""
    import subprocess
    import sys
    from pathlib import Path

    import sagecupy

    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, "-m", module, "--version"], cwd=root, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == f"sagecupy, version {sagecupy.__version__}"


def test_setup_cfg_reads_the_one_version_statically():
    """setup.cfg takes ``sagecupy.__version__`` by reading the source: no import, so no NumPy / CuPy at build."""
    import configparser
    import subprocess
    import sys
    from pathlib import Path

    import sagecupy

    root = Path(__file__).resolve().parents[2]
    cfg = configparser.ConfigParser()
    cfg.read(root / "setup.cfg")
    assert cfg["metadata"]["version"].strip() == "attr: sagecupy.__version__"
    script = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in ('numpy', 'cupy', 'sagecupy'):\n"
        "            raise ImportError(name)\n"
        "sys.meta_path.insert(0, Block())\n"
        "from setuptools.config.expand import read_attr\n"
        "print(read_attr('sagecupy.__version__', {'sagecupy': 'sagecupy'}, '.'))\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], cwd=root, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == sagecupy.__version__


def test_info_table_and_json(runner):
    out = _ok(runner.invoke(main, ["info"])).stdout
    assert "numpy" in out and "gpu" in out
    for family in analysis.FAMILIES:
        assert family in out
    lines = [json.loads(line) for line in _ok(runner.invoke(main, ["info", "--format", "json"])).stdout.splitlines()]
    assert lines[0]["type"] == "env"
    assert [line["family"] for line in lines[1:]] == list(analysis.FAMILIES)
    assert all(line["gpu"] is False for line in lines[1:])


def test_accuracy_table(runner):
    result = _ok(runner.invoke(main, ["accuracy", *TINY, "--sigmas", "1,5"]))
    lines = result.stdout.splitlines()
    assert lines[0].startswith("# sagecupy accuracy: family int8, config default, backend reference")
    header = next(line for line in lines if line.startswith("sigma"))
    assert header.split() == ["sigma", "tensor", "cos", "rel_l2", "rel_l1", "rmse"]
    rows = [line.split() for line in lines if line[:5].strip() in ("1", "5")]
    assert [(r[0], r[1]) for r in rows] == [(s, t) for s in ("1", "5") for t in analysis.ACCURACY_TENSORS]
    # auto fell back to the reference and said so in one stderr line
    assert "--backend auto -> reference: no CUDA device (test)" in result.stderr


def test_accuracy_default_n_is_printed(runner, monkeypatch):
    monkeypatch.setattr(analysis, "CPU_DEFAULT_N", 24)
    result = _ok(runner.invoke(main, ["accuracy", "--heads", "1", "--d", "16", "--sigmas", "1"]))
    assert "N=24 (the reference backend's default" in result.stderr
    assert "N=24 D=16" in result.stdout


def test_accuracy_json(runner):
    result = _ok(runner.invoke(main, ["accuracy", *TINY, "--sigmas", "1,3", "--format", "json", "--config", "paper",
                                      "--causal", "--seed", "7", "--backend", "reference"]))
    head, records = _json_lines(result.stdout)
    assert head["config"] == "paper" and head["causal"] is True and head["seed"] == 7
    assert head["backend"] == "reference" and head["sigmas"] == [1.0, 3.0]
    assert head["config_fields"]["ds_granularity"] == "block"
    assert len(records) == 8
    for rec in records:
        assert {"sigma", "tensor", "cos", "rel_l2"} <= set(rec)
    assert "--backend auto" not in result.stderr  # only auto announces its choice


def test_accuracy_csv_and_out(runner, tmp_path):
    out = tmp_path / "acc.csv"
    result = _ok(runner.invoke(main, ["accuracy", *TINY, "--sigmas", "2", "--format", "csv", "--out", str(out)]))
    assert result.stdout == ""
    assert f"wrote 4 records to {out}" in result.stderr
    rows = list(csv.DictReader(io.StringIO(out.read_text())))
    assert [r["tensor"] for r in rows] == list(analysis.ACCURACY_TENSORS)
    assert all(float(r["sigma"]) == 2.0 and 0 < float(r["cos"]) <= 1 for r in rows)


def test_accuracy_bf16(runner):
    result = _ok(runner.invoke(main, ["accuracy", *TINY, "--sigmas", "1", "--dtype", "bf16", "--format", "json"]))
    head, records = _json_lines(result.stdout)
    assert head["dtype"] == "bf16" and len(records) == 4


def test_intermediates_table_json_csv(runner, tmp_path):
    table = _ok(runner.invoke(main, ["intermediates", *TINY, "--sigma", "5"])).stdout
    assert "reference-sim" in table and "dS RMS bound" in table
    for name in analysis.INTERMEDIATE_TENSORS:
        assert any(line.split()[:1] == [name] for line in table.splitlines())
    head, records = _json_lines(_ok(runner.invoke(main, ["intermediates", *TINY, "--format", "json"])).stdout)
    assert head["sigma"] == 1.0 and head["inputs"] == "random"
    inter = [r for r in records if r["type"] == "intermediate"]
    assert [r["tensor"] for r in inter] == list(analysis.INTERMEDIATE_TENSORS)
    for rec in inter:
        assert {"tensor", "cos", "rel_l2", "rms", "source"} <= set(rec)
    assert [r["type"] for r in records].count("ds_bound") == 1
    out = tmp_path / "inter.csv"
    _ok(runner.invoke(main, ["intermediates", *TINY, "--format", "csv", "--out", str(out)]))
    rows = list(csv.DictReader(io.StringIO(out.read_text())))
    assert len(rows) == len(analysis.INTERMEDIATE_TENSORS) + 1


def test_intermediates_load(runner, tmp_path):
    rng = np.random.default_rng(0)
    path = tmp_path / "acts.npz"
    np.savez(path, q=rng.standard_normal((1, 2, 20, 16)), k=rng.standard_normal((1, 1, 30, 16)),
             v=rng.standard_normal((1, 1, 30, 16)), do=rng.standard_normal((1, 2, 20, 16)))
    result = _ok(runner.invoke(main, ["intermediates", "--load", str(path), "--causal", "--format", "json"]))
    head, records = _json_lines(result.stdout)
    assert (head["heads"], head["heads_kv"], head["n_q"], head["n_k"], head["d"]) == (2, 1, 20, 30, 16)
    assert head["inputs"] == f"file {path}" and "sigma" not in head
    assert len([r for r in records if r["type"] == "intermediate"]) == len(analysis.INTERMEDIATE_TENSORS)
    table = _ok(runner.invoke(main, ["intermediates", "--load", str(path)])).stdout
    assert "Hkv=1 Nq=20 Nk=30 D=16" in table


def test_smoothing_table_and_json(runner):
    table = _ok(runner.invoke(main, ["smoothing", *TINY, "--sigmas", "3"])).stdout
    for variant, _, _ in analysis.SMOOTHING_VARIANTS:
        assert any(line.split()[:1] == [variant] for line in table.splitlines())
    head, records = _json_lines(_ok(runner.invoke(main, ["smoothing", *TINY, "--sigmas", "3",
                                                         "--format", "json"])).stdout)
    assert len(records) == 4 * len(analysis.SMOOTHING_VARIANTS)
    assert {r["smoothing"] for r in records} == {v[0] for v in analysis.SMOOTHING_VARIANTS}


# ----------------------------------------------------------------------------
# stderr: progress without a terminal, and the closing summary line
# ----------------------------------------------------------------------------


def test_progress_lines_without_a_terminal(runner):
    result = _ok(runner.invoke(main, ["accuracy", *TINY, "--sigmas", "1,3"]))
    lines = result.stderr.splitlines()
    assert lines[1].startswith("sagecupy: sigma 1 done (1/2, ") and lines[1].endswith(" s)")
    assert lines[2].startswith("sagecupy: sigma 3 done (2/2, ")
    assert "sigma sweep" not in result.stderr  # click's bar (its label) is for terminals
    smoothing = _ok(runner.invoke(main, ["smoothing", *TINY, "--sigmas", "3"])).stderr
    assert "sagecupy: Q+K smoothing, sigma 3 done (3/3, " in smoothing
    inter = _ok(runner.invoke(main, ["intermediates", *TINY])).stderr
    assert "sagecupy: reference run done (1/2, " in inter and "float64 exact run done (2/2, " in inter


def test_progress_bar_on_a_terminal(runner, monkeypatch):
    from sagecupy import cli

    monkeypatch.setattr(cli, "_isatty", lambda stream: True)
    result = _ok(runner.invoke(main, ["accuracy", *TINY, "--sigmas", "1,3"]))
    assert "sigma sweep" in result.stderr and " done (" not in result.stderr


def test_accuracy_ends_with_the_worst_errors(runner):
    result = _ok(runner.invoke(main, ["accuracy", *TINY, "--sigmas", "1,5", "--format", "json", "--causal"]))
    _, records = _json_lines(result.stdout)  # stdout: the records only
    last = result.stderr.splitlines()[-1]
    assert last.startswith("sagecupy: worst over sigma 1,5")
    for tensor in analysis.ACCURACY_TENSORS:
        rows = [r for r in records if r["tensor"] == tensor]
        worst_cos = min(r["cos"] for r in rows)
        worst_l2 = max(r["rel_l2"] for r in rows)
        assert f"{tensor} cos {worst_cos:.6f}" in last and f"rel_l2 {worst_l2:.3g}" in last
    # the comparison is a command to run (with the options given here), not a second sweep
    assert last.endswith("the published SageBwd granularities: sagecupy accuracy --n 32 --d 32 --heads 1 "
                         "--causal --sigmas 1,5 --config paper")
    assert "worst" not in result.stdout


@pytest.mark.parametrize("args, suggestion", [
    (["--config", "paper"], "the project default: sagecupy accuracy --n 32 --d 32 --heads 1 --sigmas 3 "
                            "--config default"),
    (["--config", "bkv64"], "--config paper"),
    (["--family", "nvfp4"], "without two-level P and K-smoothing: sagecupy accuracy --family nvfp4 --n 32 "
                            "--d 32 --heads 1 --sigmas 3 --config plain"),
    (["--family", "nvfp4", "--config", "plain"], "the NVFP4 default: sagecupy accuracy --family nvfp4 --n 32 "
                                                 "--d 32 --heads 1 --sigmas 3 --config default"),
    (["--family", "qat"], "INT8 SageBwd on the same inputs: sagecupy accuracy --n 32 --d 32 --heads 1 "
                          "--sigmas 3 --family int8 --config default"),
])
def test_accuracy_summary_names_the_comparison(runner, tmp_path, args, suggestion):
    out = tmp_path / "acc.json"
    result = _ok(runner.invoke(main, ["accuracy", *TINY, "--sigmas", "3", *args, "--out", str(out)]))
    last = result.stderr.splitlines()[-1]
    assert last.startswith("sagecupy: worst over sigma 3: O cos ") and last.endswith(suggestion)
    assert str(out) not in last  # the suggested run would not overwrite this one's file


# ----------------------------------------------------------------------------
# head dims and configs
# ----------------------------------------------------------------------------


@pytest.fixture
def fake_gpu(monkeypatch):
    """A usable device with kernels for every family (nothing here may run on it)."""
    monkeypatch.setattr(analysis, "gpu_status", lambda: (True, "Fake GPU (sm_90)"))
    monkeypatch.setattr(analysis, "_gpu_module", lambda fam: (object(), None))


def test_unsupported_head_dim_on_the_gpu_backend(runner, fake_gpu):
    line = _one_line_error(runner.invoke(main, ["accuracy", "--backend", "gpu", "--d", "96"]))
    assert "head dims 64 and 128, not D=96" in line and "--backend reference" in line


def test_unsupported_head_dim_auto_runs_the_reference(runner, fake_gpu, tmp_path):
    result = _ok(runner.invoke(main, ["accuracy", "--n", "32", "--heads", "1", "--d", "24", "--sigmas", "1"]))
    assert "--backend auto -> reference: the GPU kernels take head dims 64 and 128, not D=24" in result.stderr
    assert "backend reference" in result.stdout and "D=24" in result.stdout
    path = tmp_path / "acts.npz"  # --load: the file's head dim decides
    np.savez(path, **{name: np.ones((1, 1, 8, 16)) for name in ("q", "k", "v", "do")})
    result = _ok(runner.invoke(main, ["intermediates", "--load", str(path)]))
    assert "not D=16" in result.stderr and "backend reference" in result.stdout


def test_any_head_dim_on_the_reference(runner):
    result = _ok(runner.invoke(main, ["accuracy", "--backend", "reference", "--n", "32", "--heads", "1", "--d", "96",
                                      "--sigmas", "1"]))
    assert "D=96" in result.stdout
    assert "64 or 128" in _ok(runner.invoke(main, ["accuracy", "--help"])).stdout


def test_config_help_names_every_config_of_every_family(runner):
    from sagecupy.cli import _config_help

    text = _config_help()
    for fam, names in analysis.FAMILY_CONFIGS.items():
        section = text.split(f"{fam}: ", 1)[1].split(";")[0]
        assert all(name in section for name in names), (fam, section)
    assert "bkv64" in _ok(runner.invoke(main, ["accuracy", "--help"])).stdout


# ----------------------------------------------------------------------------
# bad arguments: one line, non-zero exit, no traceback
# ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "args, match",
    [
        (["accuracy", "--family", "fp8"], "--family"),
        (["accuracy", "--backend", "cuda"], "--backend"),
        (["accuracy", "--config", "fast"], "--config"),
        (["accuracy", "--format", "xml"], "--format"),
        (["accuracy", "--dtype", "fp32"], "--dtype"),
        (["accuracy", "--n", "0"], "--n"),
        (["accuracy", "--n", "many"], "--n"),
        (["accuracy", "--d", "0"], "--d"),
        (["accuracy", "--heads", "-2"], "--heads"),
        (["accuracy", "--batch", "0"], "--batch"),
        (["accuracy", "--seed", "-1"], "--seed"),
        (["accuracy", "--sigmas", "1,x"], "--sigmas"),
        (["accuracy", "--sigmas", "1,-3"], "--sigmas"),
        (["accuracy", "--sigmas", ","], "--sigmas"),
        (["accuracy", "--bogus"], "--bogus"),
        (["accuracy", "--family", "nvfp4", "--config", "paper"], "family 'nvfp4'"),
        (["intermediates", "--sigma", "0"], "--sigma"),
        (["intermediates", "--load", "/nonexistent/acts.npz"], "--load"),
        (["intermediates", "--load", "__FILE__", "--n", "64"], "--n cannot be combined with --load"),
        (["smoothing", "--family", "qat", *TINY], "no smoothing"),
        (["nosuchcommand"], "nosuchcommand"),
        (["accuracy", "--backend", "gpu", *TINY], "--backend gpu"),
        (["intermediates", "--backend", "gpu", *TINY], "no CUDA device"),
    ],
)
def test_bad_arguments(runner, tmp_path, args, match):
    path = tmp_path / "ok.npz"
    np.savez(path, q=np.ones((1, 1, 4, 8)), k=np.ones((1, 1, 4, 8)), v=np.ones((1, 1, 4, 8)),
             do=np.ones((1, 1, 4, 8)))
    args = [str(path) if a == "__FILE__" else a for a in args]
    line = _one_line_error(runner.invoke(main, args))
    assert match in line


@pytest.mark.parametrize(
    "arrays, match",
    [
        (dict(q=np.ones((1, 1, 4, 8)), k=np.ones((1, 1, 4, 8)), v=np.ones((1, 1, 4, 8))), "lacks the key(s) do"),
        (dict(q=np.ones((1, 1, 4, 8)), k=np.ones((1, 3, 4, 8)), v=np.ones((1, 3, 4, 8)), do=np.ones((1, 1, 4, 8))),
         "multiple of the kv heads"),
        (dict(q=np.ones((4, 8)), k=np.ones((4, 8)), v=np.ones((4, 8)), do=np.ones((4, 8))), "must be 4-D"),
    ],
)
def test_bad_npz(runner, tmp_path, arrays, match):
    path = tmp_path / "bad.npz"
    np.savez(path, **arrays)
    assert match in _one_line_error(runner.invoke(main, ["intermediates", "--load", str(path)]))


def test_npy_file_is_refused(runner, tmp_path):
    path = tmp_path / "q.npy"
    np.save(path, np.ones((1, 1, 4, 8)))
    assert "single array (.npy)" in _one_line_error(runner.invoke(main, ["intermediates", "--load", str(path)]))


def test_unwritable_out(runner, tmp_path):
    out = tmp_path / "no" / "such" / "dir.json"
    line = _one_line_error(runner.invoke(main, ["accuracy", *TINY, "--sigmas", "1", "--out", str(out)]))
    assert "cannot write" in line


def test_debug_env_shows_the_traceback(runner, monkeypatch):
    monkeypatch.setenv("SAGECUPY_DEBUG", "1")
    result = runner.invoke(main, ["smoothing", "--family", "qat", *TINY])
    assert result.exit_code != 0 and isinstance(result.exception, ValueError)


# ----------------------------------------------------------------------------
# CuPy installed, no usable driver: CuPy's "driver version is insufficient" is not what the user reads
# ----------------------------------------------------------------------------


def _fake_cupy(monkeypatch, *, driver_loads, driver_version=0, runtime_version=13000):
    """A stand-in ``cupy`` whose device queries fail with cudaErrorInsufficientDriver, and a fake driver library."""
    import ctypes
    import importlib.machinery
    import sys
    import types

    class CUDARuntimeError(RuntimeError):
        def __init__(self, status):
            self.status = status
            super().__init__("cudaErrorInsufficientDriver: CUDA driver version is insufficient for CUDA runtime "
                             "version")

    def insufficient(*_):
        raise CUDARuntimeError(35)

    runtime = types.ModuleType("cupy.cuda.runtime")
    runtime.CUDARuntimeError = CUDARuntimeError
    runtime.getDeviceCount = insufficient
    runtime.getDeviceProperties = insufficient
    runtime.runtimeGetVersion = lambda: runtime_version
    runtime.driverGetVersion = lambda: driver_version
    cuda = types.ModuleType("cupy.cuda")
    cuda.runtime = runtime
    cupy = types.ModuleType("cupy")
    cupy.cuda = cuda
    for name, module in (("cupy", cupy), ("cupy.cuda", cuda), ("cupy.cuda.runtime", runtime)):
        module.__spec__ = importlib.machinery.ModuleSpec(name, None)
        monkeypatch.setitem(sys.modules, name, module)
    real_cdll = ctypes.CDLL

    def cdll(name, *args, **kwargs):
        if "libcuda" in str(name) or "nvcuda" in str(name):
            if not driver_loads:
                raise OSError(f"{name}: cannot open shared object file: No such file or directory")
            return object()
        return real_cdll(name, *args, **kwargs)

    monkeypatch.setattr(ctypes, "CDLL", cdll)


def test_no_driver_says_no_driver(monkeypatch, runner):
    from sagecupy import _env, _loader

    _fake_cupy(monkeypatch, driver_loads=False)
    ok, why = _loader.gpu_status()
    assert not ok and why == "no NVIDIA driver found (libcuda.so.1 is not installed)"
    info = _env.gpu_info()
    assert info["gpu"] is None and info["gpu_reason"] == why and info["cuda_driver"] is None
    out = _ok(runner.invoke(main, ["info"])).stdout
    assert "no NVIDIA driver found" in out and "insufficient" not in out


def test_old_driver_says_which_cuda(monkeypatch):
    from sagecupy import _env, _loader

    _fake_cupy(monkeypatch, driver_loads=True, driver_version=12040, runtime_version=13000)
    ok, why = _loader.gpu_status()
    assert not ok and why.startswith("the NVIDIA driver is older than CUDA 13.0 needs (the driver supports CUDA 12.4)")
    assert "sagecupy[cuda12]" in why and "insufficient" not in why
    assert _env.gpu_info()["gpu_reason"] == why


def test_other_cuda_errors_keep_their_text(monkeypatch):
    from sagecupy import _loader

    assert _loader.cuda_error_reason(RuntimeError("cudaErrorNoDevice: no CUDA-capable device is detected")) is None
