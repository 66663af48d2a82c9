"""examples/train_gpt.py without a GPU: its command line (every option described, presets, refusals), the one-line
errors of a machine that cannot run it, the data split, the --compare summary, --pack's documents and packed
sequences (boundaries, positions, no next-byte pair lost), and (where PyTorch is importable) two-step training runs of
the model on the CPU with SDPA, dense and packed (the block-diagonal causal mask against per-document calls; the
sagecupy path's sage_attention call, with a stand-in)."""
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
    (["--seeds", "0"], "not a positive integer"),
    (["--seeds", "3"], "--seeds N compares over N seeds: it needs --compare"),
    (["--compare", "--seeds", "2", "--context-parallel", "2"], "--seeds is not supported with --context-parallel"),
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


def test_pooled_summary_intervals_and_verdicts(tg):
    def per(train, val, ratio=1.2):
        return dict(tokens_per_s_ratio=ratio, train_loss_rel_diff=train, val_loss_rel_diff=val)

    # mean 0.002, sample sd 0.001, 3 seeds: half width t(2) * 0.001 / sqrt(3)
    p = tg.pooled_summary([per(0.001, 0.0), per(0.002, 0.0), per(0.003, 0.0, 1.1)])
    half = 4.303 * 0.001 / math.sqrt(3)
    assert p["seeds"] == 3 and p["train_loss_rel_diff"] == pytest.approx(0.002)
    assert p["train_loss_rel_diff_interval95"] == pytest.approx([0.002 - half, 0.002 + half])
    assert p["val_loss_rel_diff_interval95"] == pytest.approx([0.0, 0.0])
    assert p["tokens_per_s_ratio"] == pytest.approx((1.2 + 1.2 + 1.1) / 3)
    assert p["tokens_per_s_ratio_range"] == pytest.approx([1.1, 1.2]) and p["speed_target_met"]  # mean 1.167
    assert not tg.pooled_summary([per(0.0, 0.0, 1.1), per(0.0, 0.0, 1.19)])["speed_target_met"]  # mean 1.145
    assert p["loss_target"] == "met"  # 0.002 + 0.0025 < 0.01
    # an interval across the 1 % edge is not resolved, one beyond it is not met (either loss decides)
    assert tg.pooled_summary([per(0.0, 0.0), per(0.03, 0.0)])["loss_target"] == "not resolved"
    assert tg.pooled_summary([per(0.05, 0.0), per(0.051, 0.0)])["loss_target"] == "not met"
    assert tg.pooled_summary([per(0.0, -0.05), per(0.0, -0.051)])["loss_target"] == "not met"
    # beyond the t table: 1.96
    p = tg.pooled_summary([per(0.001 * (i % 2), 0.0) for i in range(40)])
    sd = math.sqrt(sum((0.001 * (i % 2) - 0.0005) ** 2 for i in range(40)) / 39)
    assert p["train_loss_rel_diff_interval95"][1] == pytest.approx(0.0005 + 1.96 * sd / math.sqrt(40))
    with pytest.raises(ValueError, match="two seeds or more"):
        tg.pooled_summary([per(0.0, 0.0)])
    text = tg.format_pooled([per(0.0, 0.0), per(0.03, 0.0)], [7, 8], tg.pooled_summary([per(0.0, 0.0),
                                                                                         per(0.03, 0.0)]))
    lines = text.splitlines()
    assert lines[0].startswith("seed 7") and lines[1].startswith("seed 8") and "+3.00%" in lines[1]
    assert lines[2].startswith("2 seeds") and "1.200x (1.200-1.200)" in lines[2] and lines[2].endswith(": met)")
    assert "mean +1.50%" in lines[3] and lines[-1].endswith("(target within 1% for both: not resolved)")


def test_compare_over_seeds_pairs_each_seed_and_pools(tg, capsys, monkeypatch, tmp_path):
    seen = []

    def fake_train(cfg, attn, *, device, data, log=print):
        seen.append((attn, cfg.seed))
        return _record(attn, 1000.0 if attn == "sdpa" else 1100.0 + cfg.seed, 2.0, 2.5 + 0.01 * (attn != "sdpa"))

    monkeypatch.setattr(tg, "_check_machine", lambda ap, attns: None)
    monkeypatch.setattr(tg, "train", fake_train)
    monkeypatch.setattr(tg, "_release", lambda device: None)
    monkeypatch.setattr(tg, "environment", lambda device: {"gpu": "Fake GPU"})
    out = tmp_path / "gpt.json"
    assert tg.main(["--compare", "--preset", "small", "--steps", "3", "--seed", "5", "--seeds", "3",
                    "--out", str(out)]) == 0
    assert seen == [("sdpa", 5), ("sagecupy", 5), ("sdpa", 6), ("sagecupy", 6), ("sdpa", 7), ("sagecupy", 7)]
    text = capsys.readouterr().out
    assert "sagecupy (seed 6):" in text and "3 seeds    tokens/s ratio 1.106x (1.105-1.107)" in text
    result = json.loads(out.read_text())
    assert [(r["attn"], r["seed"]) for r in result["runs"]] == seen
    assert result["config"]["seed"] == 5
    assert [c["seed"] for c in result["compare_per_seed"]] == [5, 6, 7]
    assert result["compare"]["seeds"] == 3 and result["compare"]["val_loss_rel_diff"] == pytest.approx(0.004)
    assert result["compare"]["loss_target"] == "met"  # the same +0.4 % for every seed: a zero-width interval


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


# -- --pack: document masking ---------------------------------------------------------------------------------------
def _corpus(tmp_path):
    """Four documents: a long one, a one-byte one (no next-byte pair), two short ones."""
    docs = {"a.py": bytes(range(40, 40 + 70)), "b.py": b"Z", "c.py": b"x = 1\n" * 3, "d.py": b"def f():\n    pass\n"}
    for name, text in docs.items():
        (tmp_path / name).write_bytes(text)
    return [docs[n] for n in sorted(docs)]


def test_documents_and_their_split(tg, tmp_path):
    docs = _corpus(tmp_path)
    assert tg.load_documents(tmp_path) == docs and tg.load_bytes(tmp_path) == b"".join(docs)
    starts = tg.document_starts(docs)
    assert starts == [0, 70, 71, 89]
    assert tg.split_starts(starts, 80) == ([0, 70, 71], [0, 9])  # c.py is cut: its tail starts the validation part
    assert tg.split_starts(starts, 89) == ([0, 70, 71], [0])
    train, val, (ts, vs) = tg.load_data(tmp_path, 0.2, 8)
    assert train + val == b"".join(docs) and len(train) == 85 and (ts, vs) == ([0, 70, 71], [0, 4])


def test_document_pieces_lose_no_pair(tg):
    """A document of n bytes is n - 1 next-byte pairs; a long one is cut into pieces of at most seq pairs sharing
    their boundary byte; a one-byte document has none."""
    pieces = tg.document_pieces([0, 70, 71, 89], 107, 16)
    assert pieces[:5] == [(0, 17), (16, 33), (32, 49), (48, 65), (64, 70)] and (70, 71) not in pieces
    assert pieces[5:] == [(71, 88), (87, 89), (89, 106), (105, 107)]
    pairs = [p for a, b in pieces for p in range(a, b - 1)]
    assert sorted(pairs) == [p for p in range(106) if p not in (69, 70, 88)]  # no pair crosses a document boundary
    assert max(b - a - 1 for a, b in pieces) == 16


@pytest.mark.parametrize("budget,steps", [(32, 3), (101, 1), (7, 40)])
def test_pack_plan_boundaries_positions_and_no_pair_lost(tg, budget, steps):
    import numpy as np

    pieces = tg.document_pieces([0, 70, 71, 89], 107, 16)
    plan = tg.pack_plan(pieces, budget, steps, seed=3)
    inputs, positions, cu, index = plan["inputs"], plan["positions"], plan["cu_seqlens"], plan["cu_index"]
    assert inputs.shape == positions.shape == (budget * steps,) and len(index) == steps + 1
    # the stream: the pieces' pairs in a drawn order, every pair of an epoch once
    total = sum(b - a - 1 for a, b in pieces)
    epoch = inputs[:min(total, budget * steps)]
    assert len(set(epoch.tolist())) == epoch.size
    if budget * steps >= total:
        assert sorted(epoch.tolist()) == sorted(p for a, b in pieces for p in range(a, b - 1))
    starts = {a for a, _ in pieces}
    for i in range(steps):
        c = cu[index[i]:index[i + 1]]
        assert c.dtype == np.int32 and c[0] == 0 and c[-1] == budget and np.all(np.diff(c) > 0)
        assert plan["max_seqlen"][i] == int(np.diff(c).max()) <= 16
        x, pos = inputs[i * budget:(i + 1) * budget], positions[i * budget:(i + 1) * budget]
        for s in range(len(c) - 1):
            a, b = c[s], c[s + 1]
            assert np.array_equal(pos[a:b], np.arange(b - a)), (i, s)  # positions restart at every document
            assert np.all(np.diff(x[a:b]) == 1), (i, s)  # a document is consecutive bytes
            if s > 0:
                assert x[a] in starts, (i, s)  # inside a sequence, a document begins where a piece does
    # a document a cut splits continues in the next sequence, as a new document
    for i in range(1, steps):
        prev, first = inputs[i * budget - 1], inputs[i * budget]
        if first not in starts:
            assert first == prev + 1 and positions[i * budget] == 0
    again = tg.pack_plan(pieces, budget, steps, seed=3)
    assert np.array_equal(again["inputs"], inputs) and np.array_equal(again["cu_seqlens"], cu)
    if steps * budget > 32:
        assert not np.array_equal(tg.pack_plan(pieces, budget, steps, seed=4)["inputs"], inputs)
    ordered = tg.pack_plan(pieces, 15, 2)  # no seed: the pieces in order (validation)
    assert ordered["inputs"].tolist() == list(range(30))  # pieces of a document share their boundary byte
    assert ordered["positions"][[14, 15, 16]].tolist() == [14, 0, 0]  # a cut, then the next piece
    assert ordered["cu_seqlens"].tolist() == [0, 15, 0, 1, 15]


def test_pack_refuses_the_dropin_and_is_parsed(tg, capsys):
    cfg = tg.config_from_args(tg.build_parser().parse_args(["--pack", "--preset", "small"]))
    assert cfg.pack and not tg.RunConfig().pack
    with pytest.raises(SystemExit) as exc:
        tg.main(["--pack", "--entry", "dropin"])
    assert exc.value.code == 2 and "--pack runs sagecupy through sage_attention" in capsys.readouterr().err


def test_block_causal_mask_is_per_document_sdpa(tg):
    torch = pytest.importorskip("torch")
    cu = torch.tensor([0, 3, 4, 9], dtype=torch.int32)
    mask = tg.block_causal_mask(cu, 9)
    doc = [0, 0, 0, 1, 2, 2, 2, 2, 2]
    assert mask.tolist() == [[doc[i] == doc[j] and j <= i for j in range(9)] for i in range(9)]
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 9, 2, 16, generator=g) for _ in range(3))
    docs = (cu, None, 5, mask)
    got = tg.attention_fn("sdpa", pack=True)(q, k, v, docs)
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        want = tg.attention_fn("sdpa")(q[:, a:b], k[:, a:b], v[:, a:b])
        assert torch.allclose(got[:, a:b], want, atol=1e-6), (a, b)


def _pack_run(tg, attn, **kw):
    cfg = _tiny(tg, pack=True, **kw)
    data = tg.load_data(tg.default_data_dir(), cfg.val_fraction, cfg.seq)
    return cfg, tg.train(cfg, attn, device="cpu", data=data, log=None)


def test_two_cpu_steps_packed_with_sdpa(tg):
    pytest.importorskip("torch")
    cfg, rec = _pack_run(tg, "sdpa")
    json.dumps(rec)
    assert rec["pack"] and rec["tokens_per_step"] == cfg.batch * cfg.seq == 64 and rec["tokens_per_s"] > 0
    assert rec["documents_per_step"] >= 2  # 64 tokens of documents of at most 32 pairs
    assert all(math.isfinite(p["loss"]) for p in rec["curve"]) and math.isfinite(rec["val_loss"])
    assert abs(rec["curve"][0]["loss"] - math.log(256)) < 0.5
    _, again = _pack_run(tg, "sdpa")
    assert [p["loss"] for p in again["curve"]] == [p["loss"] for p in rec["curve"]]


def test_packed_sagecupy_calls_sage_attention_with_the_offsets(tg, monkeypatch):
    """--attn sagecupy --pack hands sage_attention (T, H, D) views, layout='THD', the step's int32 offsets and its
    longest document as a host int, causal; with a stand-in computing each document's causal SDPA, the run's losses
    are the masked-SDPA run's."""
    torch = pytest.importorskip("torch")
    try:
        import sagecupy.torch as st
    except Exception as exc:
        pytest.skip(f"sagecupy.torch not importable here: {exc}")
    calls = []

    def stand_in(q, k, v, *, layout, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal):
        calls.append((layout, tuple(q.shape), cu_seqlens_q.dtype, max_seqlen_q, causal))
        assert cu_seqlens_q is cu_seqlens_k and max_seqlen_q == max_seqlen_k
        assert isinstance(max_seqlen_q, int) and max_seqlen_q == int(cu_seqlens_q.diff().max())
        out = torch.empty_like(q)
        for a, b in zip(cu_seqlens_q[:-1].tolist(), cu_seqlens_q[1:].tolist()):
            out[a:b] = torch.nn.functional.scaled_dot_product_attention(
                *(x[a:b].transpose(0, 1) for x in (q, k, v)), is_causal=True).transpose(0, 1)
        return out

    monkeypatch.setattr(st, "sage_attention", stand_in)
    cfg, rec = _pack_run(tg, "sagecupy", d_head=64, heads=1, d_model=64)
    assert rec["layout"] == "THD" and rec["pack"]
    assert {c[0] for c in calls} == {"THD"} and {c[1] for c in calls} == {(64, 1, 64), (32, 1, 64)}  # train, val
    assert {c[2] for c in calls} == {torch.int32} and all(c[4] is True for c in calls)
    _, sdpa = _pack_run(tg, "sdpa", d_head=64, heads=1, d_model=64)
    for a, b in zip(rec["curve"], sdpa["curve"]):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-2)
    assert rec["val_loss"] == pytest.approx(sdpa["val_loss"], rel=1e-2)
