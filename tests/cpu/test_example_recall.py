"""The recall example trains through the autograd shim on the CPU (float64 reference backends)."""
import importlib.util
from pathlib import Path

import numpy as np
import pytest

_PATH = Path(__file__).resolve().parents[2] / "examples" / "recall.py"


def _example():
    spec = importlib.util.spec_from_file_location("recall_example", _PATH)
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
