"""What an install brings, and what `sagecupy info` and `--backend auto` say when part of it is missing.

The CUDA extras must bring NVRTC and the CUDA headers (CuPy's [ctk] extra): the kernels compile at first use, so a
CuPy that imports and sees the GPU but cannot load NVRTC fails at the first call. That case is simulated here with
a fake CuPy whose ``cuda.nvrtc.getVersion`` raises as CuPy does when the library is missing.
"""
import configparser
import importlib.machinery
import json
import sys
import types
from pathlib import Path

import pytest
from click.testing import CliRunner

from sagecupy import _env, _loader, analysis
from sagecupy.cli import main

ROOT = Path(__file__).resolve().parents[2]


def _setup_cfg():
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    return cfg


def _requirements(text):
    return [line.strip() for line in text.strip().splitlines() if line.strip()]


def test_cuda_extras_bring_nvrtc_and_numpy2():
    extras = _setup_cfg()["options.extras_require"]
    for extra, cupy in (("cuda12", "cupy-cuda12x"), ("cuda13", "cupy-cuda13x")):
        reqs = _requirements(extras[extra])
        assert f"{cupy}[ctk]>=14" in reqs, reqs  # [ctk]: NVRTC and the CUDA headers as wheels
        assert "numpy>=2" in reqs, reqs  # CuPy 14 is built against NumPy 2
    assert any(r.startswith("torch>=") for r in _requirements(extras["torch"]))
    assert any(r.startswith("jax>=") for r in _requirements(extras["jax"]))
    assert "cupy" not in _setup_cfg()["options"]["install_requires"]  # a CPU-only install stays possible


def test_package_is_typed():
    assert (ROOT / "sagecupy" / "py.typed").is_file()
    data = _setup_cfg()["options.package_data"]
    assert "py.typed" in data["sagecupy"]


def _fake_cupy(monkeypatch, *, nvrtc_version=None, nvrtc_error=None, devices=1):
    """A CuPy with one sm_90 device whose NVRTC loads (``nvrtc_version``) or fails as CuPy fails (``nvrtc_error``)."""
    runtime = types.ModuleType("cupy.cuda.runtime")
    runtime.getDeviceCount = lambda: devices
    runtime.getDeviceProperties = lambda i: {"name": b"Fake H100", "major": 9, "minor": 0}
    runtime.runtimeGetVersion = lambda: 13000
    runtime.driverGetVersion = lambda: 13000
    nvrtc = types.ModuleType("cupy.cuda.nvrtc")

    def get_version():
        if nvrtc_error is not None:
            raise nvrtc_error
        return nvrtc_version

    nvrtc.getVersion = get_version
    cuda = types.ModuleType("cupy.cuda")
    cuda.runtime, cuda.nvrtc = runtime, nvrtc
    cuda.Device = lambda *a: types.SimpleNamespace(id=0)
    cupy = types.ModuleType("cupy")
    cupy.cuda = cuda
    cupy.__version__ = "14.2.0"
    for name, module in (("cupy", cupy), ("cupy.cuda", cuda), ("cupy.cuda.runtime", runtime),
                         ("cupy.cuda.nvrtc", nvrtc)):
        module.__spec__ = importlib.machinery.ModuleSpec(name, None)
        monkeypatch.setitem(sys.modules, name, module)


_MISSING = RuntimeError("CuPy failed to load libnvrtc.so.13: OSError: libnvrtc.so.13: cannot open shared object "
                        "file: No such file or directory")


def test_nvrtc_status_reports_the_version(monkeypatch):
    _fake_cupy(monkeypatch, nvrtc_version=(13, 0))
    assert _loader.nvrtc_status() == (True, "13.0")
    assert _env.nvrtc_info() == {"nvrtc": "13.0", "nvrtc_reason": None}
    assert _loader.gpu_status() == (True, "Fake H100 (sm_90)")


def test_missing_nvrtc_says_what_to_install(monkeypatch):
    _fake_cupy(monkeypatch, nvrtc_error=_MISSING)
    ok, why = _loader.nvrtc_status()
    assert not ok and "libnvrtc.so.13" in why and "sagecupy[cuda13]" in why
    info = _env.nvrtc_info()
    assert info["nvrtc"] is None and info["nvrtc_reason"] == why
    ok, gpu_why = _loader.gpu_status()  # a device alone is not enough: the kernels cannot compile
    assert not ok and gpu_why.startswith("Fake H100 (sm_90) found, but the kernels cannot be compiled") and why in gpu_why


def test_missing_cupy_is_named(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", None)  # import raises ImportError
    ok, why = _loader.nvrtc_status()
    assert not ok and why.startswith("CuPy is not importable") and "sagecupy[cuda13]" in why


def test_backend_auto_treats_missing_nvrtc_as_no_gpu(monkeypatch):
    _fake_cupy(monkeypatch, nvrtc_error=_MISSING)
    monkeypatch.setattr(analysis, "_gpu_module", lambda fam: (object(), None))  # the family modules need real CuPy
    backend, reason = analysis.resolve_backend("auto", "int8", head_dim=128)
    assert backend == "reference" and "libnvrtc.so.13" in reason and "kernels cannot be compiled" in reason
    with pytest.raises(analysis.BackendUnavailable, match="libnvrtc"):
        analysis.resolve_backend("gpu", "int8", head_dim=128)
    _fake_cupy(monkeypatch, nvrtc_version=(13, 0))
    assert analysis.resolve_backend("auto", "int8", head_dim=128)[0] == "gpu"


def test_info_reports_nvrtc(monkeypatch):
    _fake_cupy(monkeypatch, nvrtc_error=_MISSING)
    monkeypatch.setattr(analysis, "_gpu_module", lambda fam: (object(), None))
    out = CliRunner().invoke(main, ["info"])
    assert out.exit_code == 0, out.output
    lines = {line.split()[0]: line for line in out.stdout.splitlines() if line.strip()}
    assert lines["nvrtc"].split()[1] == "-" and "libnvrtc.so.13" in lines["nvrtc_reason"]
    assert "not usable" in lines["gpu_kernels"] and "libnvrtc.so.13" in lines["gpu_kernels"]
    _fake_cupy(monkeypatch, nvrtc_version=(13, 0))
    out = CliRunner().invoke(main, ["info", "--format", "json"])
    env = json.loads(out.stdout.splitlines()[0])
    assert env["nvrtc"] == "13.0" and env["nvrtc_reason"] is None


def test_info_without_cupy_names_the_extra(monkeypatch):
    monkeypatch.setattr(_env.importlib.util, "find_spec", lambda name, *a: None if name == "cupy" else object())
    info = _env.nvrtc_info()
    assert info["nvrtc"] is None and "sagecupy[cuda13]" in info["nvrtc_reason"]


def test_environment_names_the_baselines_versions(monkeypatch):
    import types

    from sagecupy import _env

    env = _env.environment()
    for key in ("torch", "triton", "cudnn_frontend", "cudnn"):
        assert key in env
    # the cuDNN version comes from an already imported PyTorch only (the header never imports it)
    fake = types.SimpleNamespace(backends=types.SimpleNamespace(cudnn=types.SimpleNamespace(version=lambda: 91002)))
    monkeypatch.setitem(sys.modules, "torch", fake)
    assert _env.baseline_versions()["cudnn"] == 91002
