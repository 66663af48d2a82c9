"""The recall examples: training through the autograd shim on the CPU (float64 reference backends), and their
command lines (every option described; a machine that cannot run the request gets one error line)."""
import importlib.util
import sys
import types
from pathlib import Path

import numpy as np
import pytest

_EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _example(name="recall"):
    spec = importlib.util.spec_from_file_location(f"{name}_example", _EXAMPLES / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("impl,steps", [("fpa", 80), ("sagebwd", 30)])
def test_loss_goes_down(impl, steps):
    curve = _example().train(impl, backend="numpy", steps=steps, log=None)
    assert np.all(np.isfinite(curve))
    assert np.mean(curve[-5:]) < 0.8 * curve[0], f"{impl}: loss {curve[0]:.3f} -> {np.mean(curve[-5:]):.3f}"


def test_cli_rejects_unknown_impl(capsys):
    with pytest.raises(SystemExit):
        _example().main(["--impl", "flash", "--steps", "1"])
    assert "--impl" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["recall", "recall_torch", "recall_jax"])
def test_help_describes_every_option(name):
    for action in _example(name).build_parser()._actions:
        assert action.help, f"{name}.py: {action.option_strings} has no help text"


def _one_error_line(capsys, run):
    with pytest.raises(SystemExit) as exit_:
        run()
    assert exit_.value.code == 1
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and ": error: " in lines[0], captured.err
    assert "Traceback" not in captured.err
    return lines[0]


def test_recall_cupy_without_a_gpu_is_one_line(capsys, monkeypatch):
    monkeypatch.setattr("sagecupy._loader.gpu_status", lambda: (False, "no NVIDIA driver found (test)"))
    line = _one_error_line(capsys, lambda: _example().main(["--backend", "cupy", "--steps", "1"]))
    assert "--backend cupy needs CuPy and a CUDA device: no NVIDIA driver found (test)" in line


def test_recall_torch_without_torch_or_cuda_is_one_line(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)  # import torch raises ImportError
    assert "needs PyTorch" in _one_error_line(capsys, lambda: _example("recall_torch").main(["--steps", "1"]))
    fake = types.ModuleType("torch")
    fake.cuda = types.SimpleNamespace(is_available=lambda: False)
    monkeypatch.setitem(sys.modules, "torch", fake)
    line = _one_error_line(capsys, lambda: _example("recall_torch").main(["--steps", "1"]))
    assert "--device cuda: PyTorch sees no CUDA device" in line


def test_recall_jax_without_jax_is_one_line(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "jax", None)
    assert "needs JAX" in _one_error_line(capsys, lambda: _example("recall_jax").main(["--steps", "1"]))
