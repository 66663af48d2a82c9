"""examples/train_gpt.py without a GPU: its command line (every option described, presets, refusals), the one-line
errors of a machine that cannot run it, the data split, the --compare summary, and (where PyTorch is importable) a
two-step training run of the model on the CPU with SDPA."""
import importlib.util
import json
import math
import sys
import types
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[2] / "examples" / "train_gpt.py"


@pytest.fixture(scope="module")
def tg():
    spec = importlib.util.spec_from_file_location("train_gpt_example", _PATH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_importing_needs_no_torch(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)
    spec = importlib.util.spec_from_file_location("train_gpt_no_torch", _PATH)
    spec.loader.exec_module(importlib.util.module_from_spec(spec))


# -- command line -------------------------------------------------------------------------------------------------
def test_help_describes_every_option(tg, capsys):
    ap = tg.build_parser()
    for action in ap._actions:
        assert action.help and action.help != "==SUPPRESS==", f"{action.option_strings} has no help text"
    with pytest.raises(SystemExit) as exc:
        tg.main(["--help"])
    assert exc.value.code == 0
    text = capsys.readouterr().out
    for action in ap._actions:
        for opt in action.option_strings:
            assert opt in text
    for word in ("sdpa", "sagecupy", "--compare", "torch.compile", "8192", "FILE.json"):
        assert word in text


def test_presets_and_overrides(tg):
    ap = tg.build_parser()
    cfg = tg.config_from_args(ap.parse_args([]))
    assert (cfg.seq, cfg.d_head, cfg.heads, cfg.layers, cfg.d_model, cfg.batch) == (8192, 128, 8, 4, 1024, 1)
    assert (cfg.entry, cfg.layout, cfg.compile, cfg.data) == ("op", "HND", False, "")
    cfg = tg.config_from_args(ap.parse_args(["--preset", "small", "--seq", "256", "--layers", "3", "--compile",
                                             "--entry", "dropin", "--steps", "7", "--seed", "3", "--data", "/x"]))
    assert (cfg.seq, cfg.d_head, cfg.heads, cfg.layers, cfg.d_model, cfg.batch) == (256, 64, 4, 3, 256, 4)
    assert (cfg.entry, cfg.compile, cfg.steps, cfg.seed, cfg.data) == ("dropin", True, 7, 3, "/x")
    assert set(tg.PRESETS["small"]) == set(tg.PRESETS["default"])


@pytest.mark.parametrize("argv, text", [
    (["--steps", "0"], "not a positive integer"),
    (["--attn", "flash"], "invalid choice"),
    (["--layout", "BHND"], "invalid choice"),
    (["--val-fraction", "1.5"], "not between 0 and 1"),
    (["--d-head", "32"], "--d-head 32: sagecupy's kernels take head dimensions 64 and 128"),
    (["--compare", "--d-head", "96"], "--d-head 96"),
    (["--min-lr-ratio", "2"], "--min-lr-ratio"),
])
def test_malformed_command_lines_are_usage_errors(tg, capsys, argv, text):
    with pytest.raises(SystemExit) as exc:
        tg.main(argv)
    assert exc.value.code == 2
    assert text in capsys.readouterr().err


def _one_error_line(tg, capsys, argv):
    with pytest.raises(SystemExit) as exc:
        tg.main(argv)
    assert exc.value.code == 1
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("train_gpt.py: error: ") and "Traceback" not in err, err
    return lines[0]


def _fake_torch(cuda=True, bf16=True):
    fake = types.ModuleType("torch")
    fake.cuda = types.SimpleNamespace(is_available=lambda: cuda, is_bf16_supported=lambda: bf16,
                                      get_device_name=lambda *a: "Fake GPU")
    return fake


def test_without_torch_one_line(tg, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)
    assert "needs PyTorch" in _one_error_line(tg, capsys, ["--attn", "sdpa", "--d-head", "32"])


def test_without_cuda_one_line(tg, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", _fake_torch(cuda=False))
    assert "PyTorch sees no CUDA device" in _one_error_line(tg, capsys, ["--compare"])
    monkeypatch.setitem(sys.modules, "torch", _fake_torch(bf16=False))
    assert "Fake GPU has no bf16 support" in _one_error_line(tg, capsys, ["--attn", "sdpa"])


def test_without_cupy_one_line(tg, capsys, monkeypatch):
    """--attn sagecupy on a machine whose PyTorch sees a GPU but where the kernels cannot run (here: no CuPy, or a
    stand-in PyTorch the adapter refuses)."""
    monkeypatch.setitem(sys.modules, "torch", _fake_torch())
    monkeypatch.setattr("sagecupy._loader.gpu_status", lambda: (False, "CuPy is not importable (test)"))
    line = _one_error_line(tg, capsys, ["--attn", "sagecupy"])
    assert "--attn sagecupy needs" in line


# -- data ---------------------------------------------------------------------------------------------------------
def test_data_split_and_refusals(tg, tmp_path):
    (tmp_path / "pkg" / "__pycache__").mkdir(parents=True)
    (tmp_path / "pkg" / "b.py").write_bytes(b"B" * 60)
    (tmp_path / "a.py").write_bytes(b"A" * 40)
    (tmp_path / "pkg" / "__pycache__" / "c.py").write_bytes(b"C" * 1000)
    (tmp_path / "notes.txt").write_bytes(b"T" * 1000)
    data = tg.load_bytes(tmp_path)
    assert data == b"A" * 40 + b"B" * 60  # sorted paths, caches and other files left out
    train, val = tg.split_bytes(data, 0.2, 16)
    assert train == data[:80] and val == data[80:]
    with pytest.raises(ValueError, match="validation split has 20 bytes, fewer than --seq 32"):
        tg.split_bytes(data, 0.2, 32)
    with pytest.raises(ValueError, match="no .py files"):
        tg.load_bytes(_empty(tmp_path))
    with pytest.raises(ValueError, match="not a directory"):
        tg.load_bytes(tmp_path / "missing")


def _empty(tmp_path):
    d = tmp_path / "empty"
    d.mkdir()
    return d


def test_default_data_is_the_sagecupy_package(tg):
    d = tg.default_data_dir()
    assert (d / "__init__.py").is_file() and (d / "bench.py").is_file()
    train, val = tg.split_bytes(tg.load_bytes(d), 0.1, 8192)  # the default preset fits the default data
    assert len(train) > 9 * len(val) - 10


def test_lr_schedule(tg):
    f = [tg.lr_factor(s, 100, 5, 0.1) for s in range(100)]
    assert f[:5] == pytest.approx([0.2, 0.4, 0.6, 0.8, 1.0])
    assert f[5] == pytest.approx(1.0) and f[-1] == pytest.approx(0.1)
    assert all(a >= b for a, b in zip(f[5:], f[6:]))


# -- --compare ----------------------------------------------------------------------------------------------------
def _record(attn, rate, train_loss, val_loss):
    return dict(attn=attn, tokens_per_s=rate, final_train_loss=train_loss, val_loss=val_loss, timed_steps=5,
                curve=[dict(step=0, loss=train_loss, lr=1e-3)], step_ms=[1.0])


def test_compare_summary(tg):
    s = tg.compare_summary(_record("sdpa", 1000.0, 2.0, 2.5), _record("sagecupy", 1200.0, 2.01, 2.52))
    assert s["tokens_per_s_ratio"] == pytest.approx(1.2) and s["speed_target_met"]
    assert s["train_loss_rel_diff"] == pytest.approx(0.005) and s["val_loss_rel_diff"] == pytest.approx(0.008)
    assert s["loss_target_met"]
    s = tg.compare_summary(_record("sdpa", 1000.0, 2.0, 2.5), _record("sagecupy", 1100.0, 2.0, 2.6))
    assert not s["speed_target_met"] and not s["loss_target_met"]
    text = tg.format_summary(_record("sdpa", 1000.0, 2.0, 2.5), _record("sagecupy", 1100.0, 2.0, 2.6), s)
    assert "ratio 1.100x" in text and "+4.00%" in text and "not met" in text


def test_compare_runs_both_from_one_config_and_writes_json(tg, capsys, monkeypatch, tmp_path):
    seen = []

    def fake_train(cfg, attn, *, device, data, log=print):
        seen.append((attn, cfg.seed, cfg.steps, len(data[0]), len(data[1])))
        return _record(attn, 1000.0 if attn == "sdpa" else 1250.0, 2.0, 2.5)

    monkeypatch.setattr(tg, "_check_machine", lambda ap, attns: None)
    monkeypatch.setattr(tg, "train", fake_train)
    monkeypatch.setattr(tg, "_release", lambda device: None)
    monkeypatch.setattr(tg, "environment", lambda device: {"gpu": "Fake GPU"})
    out = tmp_path / "gpt.json"
    assert tg.main(["--compare", "--preset", "small", "--steps", "3", "--seed", "5", "--out", str(out)]) == 0
    assert [s[:3] for s in seen] == [("sdpa", 5, 3), ("sagecupy", 5, 3)] and seen[0][3:] == seen[1][3:]
    text = capsys.readouterr().out
    assert "ratio 1.250x" in text and "met" in text
    result = json.loads(out.read_text())
    assert [r["attn"] for r in result["runs"]] == ["sdpa", "sagecupy"]
    assert result["compare"]["tokens_per_s_ratio"] == pytest.approx(1.25)
    assert result["config"]["seq"] == 1024 and result["environment"] == {"gpu": "Fake GPU"}


# -- the model on the CPU -----------------------------------------------------------------------------------------
def _tiny(tg, **kw):
    return tg.RunConfig(**dict(dict(seq=32, d_head=16, heads=2, layers=2, d_model=32, batch=2, steps=2, log_every=1,
                                    timing_warmup=1, val_windows=2), **kw))


def test_two_cpu_steps_with_sdpa(tg):
    torch = pytest.importorskip("torch")
    cfg = _tiny(tg)
    data = tg.split_bytes(tg.load_bytes(tg.default_data_dir()), cfg.val_fraction, cfg.seq)
    logged = []
    rec = tg.train(cfg, "sdpa", device="cpu", data=data, log=logged.append)
    json.dumps(rec)
    assert len(rec["curve"]) == 2 and len(rec["step_ms"]) == 2 and len(logged) == 2
    assert all(math.isfinite(p["loss"]) for p in rec["curve"]) and math.isfinite(rec["val_loss"])
    assert abs(rec["curve"][0]["loss"] - math.log(256)) < 0.5  # a fresh model is about uniform over the bytes
    assert rec["timed_steps"] == 1 and rec["tokens_per_s"] > 0 and rec["tokens_per_step"] == 64
    assert rec["final_train_loss"] == pytest.approx(sum(p["loss"] for p in rec["curve"]) / 2)
    # the same seed gives the same run: what --compare relies on for the same initialization and batches
    again = tg.train(cfg, "sdpa", device="cpu", data=data, log=None)
    assert [p["loss"] for p in again["curve"]] == [p["loss"] for p in rec["curve"]]
    a, b = tg.build_model(cfg, "sdpa"), tg.build_model(_tiny(tg, seed=1), "sdpa")
    assert not torch.equal(a.blocks[0].qkv.weight, b.blocks[0].qkv.weight)


def test_qk_norm_bounds_what_attention_sees(tg):
    """The attention receives RMS-normalized q and k (per head; the rotation keeps the norm), in bf16."""
    torch = pytest.importorskip("torch")
    cfg = _tiny(tg)
    model = tg.build_model(cfg, "sdpa")
    seen = []
    blk = model.blocks[0]
    real = torch.nn.functional.scaled_dot_product_attention

    def spy(q, k, v, **kw):
        seen.append((q, k, v, kw))
        return real(q, k, v, **kw)

    idx = torch.randint(0, 256, (2, cfg.seq))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        torch.nn.functional.scaled_dot_product_attention = spy
        try:
            blk(model.emb(idx), model.cos[:cfg.seq], model.sin[:cfg.seq])
        finally:
            torch.nn.functional.scaled_dot_product_attention = real
    q, k, v, kw = seen[0]
    assert kw == {"is_causal": True} and q.shape == (2, cfg.heads, cfg.seq, cfg.d_head)
    assert q.dtype == k.dtype == v.dtype == torch.bfloat16
    rms = q.float().pow(2).mean(-1).sqrt()
    assert torch.allclose(rms, torch.ones_like(rms), atol=0.02)


def test_sagecupy_attention_is_refused_on_the_cpu_device(tg):
    """sagecupy runs on CUDA tensors: the adapter says so (no silent fallback) when the CPU model calls it."""
    pytest.importorskip("torch")
    try:
        import sagecupy.torch  # noqa: F401
    except Exception as exc:
        pytest.skip(f"sagecupy.torch not importable here: {exc}")
    cfg = _tiny(tg, d_head=64, heads=1, d_model=64, steps=1)
    data = tg.split_bytes(tg.load_bytes(tg.default_data_dir()), cfg.val_fraction, cfg.seq)
    with pytest.raises(TypeError, match="cuda"):
        tg.train(cfg, "sagecupy", device="cpu", data=data, log=None)


def test_unusable_data_is_one_line(tg, capsys, monkeypatch, tmp_path):
    monkeypatch.setattr(tg, "_check_machine", lambda ap, attns: None)
    assert "not a directory" in _one_error_line(tg, capsys, ["--attn", "sdpa", "--data", str(tmp_path / "nope")])
    (tmp_path / "a.py").write_bytes(b"x = 1\n" * 100)
    line = _one_error_line(tg, capsys, ["--attn", "sdpa", "--data", str(tmp_path)])
    assert "fewer than --seq 8192 + 1" in line
