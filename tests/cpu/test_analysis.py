"""sagecupy.analysis on tiny shapes: inputs, dtype rounding, backends, the three protocols."""
from __future__ import annotations

import dataclasses
import sys
import types

import numpy as np
import pytest

from sagecupy import analysis
from sagecupy.config import DEFAULT, PAPER, NVFP4Config, QATConfig

TINY = analysis.Shape(batch=1, heads=2, n=40, d=32)


def _spec(**kw):
    kw.setdefault("shape", TINY)
    return analysis.RunSpec(**kw)


# ----------------------------------------------------------------------------
# dtype rounding
# ----------------------------------------------------------------------------


def test_fp16_rounding_matches_numpy():
    x = np.random.default_rng(1).standard_normal(1000) * 100
    assert np.array_equal(analysis.round_to_dtype(x, "fp16"), x.astype(np.float16).astype(np.float64))


def _bf16_nearest_even(x: float) -> float:
    """Brute force: the two bfloat16 neighbours of a normal float64, nearest, ties to even."""
    f = np.float32(x)  # only used to find a neighbour: the exact pick is done in float64 below
    bits = int(np.array([f]).view(np.uint32)[0]) & 0xFFFF0000
    cands = set()
    for b in (bits - 0x10000, bits, bits + 0x10000):
        cands.add(float(np.array([b & 0xFFFFFFFF], dtype=np.uint32).view(np.float32)[0]))
    cands = sorted(c for c in cands if np.isfinite(c))
    best = min(cands, key=lambda c: (abs(c - x), int(np.array([c], np.float32).view(np.uint32)[0] >> 16) & 1))
    return best


def test_bf16_rounding_is_nearest_even_from_float64():
    rng = np.random.default_rng(2)
    x = rng.standard_normal(2000) * np.exp(rng.uniform(-20, 20, 2000))
    got = analysis.round_to_dtype(x, "bf16")
    want = np.array([_bf16_nearest_even(v) for v in x])
    assert np.array_equal(got, want)


@pytest.mark.parametrize(
    "x, want",
    [
        (1.0, 1.0),
        (1.0 + 2.0 ** -8, 1.0),  # tie -> even (down)
        (1.0 + 3 * 2.0 ** -8, 1.0 + 2.0 ** -6),  # tie -> even (up)
        (1.0 + 2.0 ** -8 + 2.0 ** -40, 1.0 + 2.0 ** -7),  # via float32 this would round twice, to 1.0
        (-(1.0 + 3 * 2.0 ** -8), -(1.0 + 2.0 ** -6)),
        (0.0, 0.0),
        (2.0 ** 128 - 2.0 ** 119 - 2.0 ** 100, 2.0 ** 128 - 2.0 ** 120),  # just below halfway: the largest bf16
        ((2.0 - 2.0 ** -8) * 2.0 ** 127, np.inf),  # exactly halfway: ties to even = infinity
        (-1e39, -np.inf),
        (2.0 ** -133, 2.0 ** -133),  # smallest bf16 subnormal
        (2.0 ** -134, 0.0),  # halfway to 0: even
        (3 * 2.0 ** -134, 2.0 ** -132),
    ],
)
def test_bf16_rounding_cases(x, want):
    assert analysis.round_to_dtype(np.array([x]), "bf16")[0] == want


def test_bf16_nan_and_bits():
    assert np.isnan(analysis.round_to_dtype(np.array([np.nan]), "bf16")[0])
    assert analysis.bf16_bits(np.array([1.0, -2.0, 0.0]))[:].tolist() == [0x3F80, 0xC000, 0x0000]


def test_round_rejects_unknown_dtype():
    with pytest.raises(ValueError, match="dtype='fp8'"):
        analysis.round_to_dtype(np.ones(2), "fp8")


# ----------------------------------------------------------------------------
# inputs
# ----------------------------------------------------------------------------


def test_make_inputs_deterministic_sigma_scaled_and_representable():
    a = analysis.make_inputs(TINY, 1.0, seed=3)
    b = analysis.make_inputs(TINY, 1.0, seed=3)
    c = analysis.make_inputs(TINY, 4.0, seed=3)
    for key in analysis.LOAD_KEYS:
        assert a[key].shape == TINY.hnd and a[key].dtype == np.float64
        assert np.array_equal(a[key], b[key])
        assert np.array_equal(a[key], analysis.round_to_dtype(a[key], "fp16"))
    # same draw for every sigma: only q, k scale (4 = a power of two keeps fp16 rounding
    # exact outside the subnormals)
    normal = np.abs(a["q"]) >= 2.0 ** -14
    assert np.array_equal(c["q"][normal], 4 * a["q"][normal]) and np.array_equal(c["v"], a["v"])
    assert not np.array_equal(a["q"], analysis.make_inputs(TINY, 1.0, seed=4)["q"])
    bf = analysis.make_inputs(TINY, 1.0, seed=3, dtype="bf16")
    assert np.array_equal(bf["q"], analysis.round_to_dtype(bf["q"], "bf16"))


@pytest.mark.parametrize("sigma", [0, -1, float("nan"), float("inf"), True])
def test_make_inputs_rejects_bad_sigma(sigma):
    with pytest.raises(ValueError, match="sigma"):
        analysis.make_inputs(TINY, sigma, seed=0)


@pytest.mark.parametrize("field", ["batch", "heads", "n", "d"])
def test_shape_rejects_non_positive(field):
    with pytest.raises(ValueError, match=field):
        analysis.Shape(**{field: 0})


def _save(tmp_path, name="acts.npz", **arrays):
    path = tmp_path / name
    np.savez(path, **arrays)
    return path


def test_load_inputs_gqa_nhd_roundtrip(tmp_path):
    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, 5, 4, 16))  # NHD: N=5, Hq=4
    k = rng.standard_normal((1, 7, 2, 16))  # Nk=7, Hkv=2
    v = rng.standard_normal((1, 7, 2, 16))
    do = rng.standard_normal((1, 5, 4, 16))
    path = _save(tmp_path, q=q, k=k, v=v, do=do, extra=np.ones(3))
    got = analysis.load_inputs(path, layout="NHD")
    assert got["q"].shape == (1, 4, 5, 16) and got["k"].shape == (1, 2, 7, 16)
    assert np.array_equal(got["k"], analysis.round_to_dtype(np.swapaxes(k, 1, 2), "fp16"))


@pytest.mark.parametrize(
    "arrays, match",
    [
        (dict(q=np.ones((1, 1, 4, 8)), k=np.ones((1, 1, 4, 8)), v=np.ones((1, 1, 4, 8))), "lacks the key.*do"),
        (dict(q=np.ones((1, 1, 4, 8)), k=np.ones((1, 1, 4, 8)), v=np.ones((1, 1, 4, 8)), dO=np.ones((1, 1, 4, 8))),
         "found: .*dO"),
        (dict(q=np.ones((1, 4, 8)), k=np.ones((1, 1, 4, 8)), v=np.ones((1, 1, 4, 8)), do=np.ones((1, 4, 8))),
         "4-D"),
        (dict(q=np.ones((1, 1, 4, 8)), k=np.ones((1, 1, 4, 16)), v=np.ones((1, 1, 4, 16)), do=np.ones((1, 1, 4, 8))),
         "head dim"),
        (dict(q=np.ones((1, 1, 4, 8)), k=np.ones((1, 1, 4, 8)), v=np.ones((1, 1, 4, 8)), do=np.ones((1, 1, 3, 8))),
         "do must have q's shape"),
        (dict(q=np.full((1, 1, 4, 8), np.nan), k=np.ones((1, 1, 4, 8)), v=np.ones((1, 1, 4, 8)),
              do=np.ones((1, 1, 4, 8))), "NaN"),
        (dict(q=np.full((1, 1, 4, 8), 1e6), k=np.ones((1, 1, 4, 8)), v=np.ones((1, 1, 4, 8)),
              do=np.ones((1, 1, 4, 8))), "outside the fp16 range"),
        (dict(q=np.ones((1, 1, 4, 8), dtype=complex), k=np.ones((1, 1, 4, 8)), v=np.ones((1, 1, 4, 8)),
              do=np.ones((1, 1, 4, 8))), "real numbers"),
    ],
)
def test_load_inputs_errors(tmp_path, arrays, match):
    with pytest.raises(ValueError, match=match):
        analysis.load_inputs(_save(tmp_path, **arrays))


def test_load_inputs_bad_files(tmp_path):
    with pytest.raises(ValueError, match="no such file"):
        analysis.load_inputs(tmp_path / "missing.npz")
    npy = tmp_path / "one.npy"
    np.save(npy, np.ones(3))
    with pytest.raises(ValueError, match="single array"):
        analysis.load_inputs(npy)
    junk = tmp_path / "junk.npz"
    junk.write_text("not a zip")
    with pytest.raises(ValueError, match="not a readable"):
        analysis.load_inputs(junk)


# ----------------------------------------------------------------------------
# configs and backends
# ----------------------------------------------------------------------------


def test_resolve_config():
    assert analysis.resolve_config("int8", "paper") is PAPER
    assert analysis.resolve_config("int8", "default") is DEFAULT
    assert isinstance(analysis.resolve_config("nvfp4", "default"), NVFP4Config)
    assert isinstance(analysis.resolve_config("qat", None), QATConfig)
    with pytest.raises(ValueError, match="family 'nvfp4'"):
        analysis.resolve_config("nvfp4", "paper")
    cfg = analysis.resolve_config("nvfp4", "plain")
    assert (cfg.two_level_p, cfg.k_smoothing) == (False, False)
    assert analysis.resolve_config("nvfp4", "single-level-p").k_smoothing is True
    with pytest.raises(ValueError, match="family 'qat'"):
        analysis.resolve_config("qat", "plain")
    with pytest.raises(ValueError, match="family='fp8'"):
        analysis.resolve_config("fp8", "default")


@pytest.fixture
def no_gpu(monkeypatch):
    monkeypatch.setattr(analysis, "gpu_status", lambda: (False, "no CUDA device (test)"))


def test_backend_resolution_without_gpu(no_gpu):
    assert analysis.resolve_backend("reference", "int8")[0] == "reference"
    backend, reason = analysis.resolve_backend("auto", "int8")
    assert backend == "reference" and "no CUDA device" in reason
    with pytest.raises(analysis.BackendUnavailable, match="no CUDA device"):
        analysis.resolve_backend("gpu", "int8")
    with pytest.raises(ValueError, match="backend='cuda'"):
        analysis.resolve_backend("cuda", "int8")
    assert analysis.default_n("reference") == analysis.CPU_DEFAULT_N
    assert analysis.default_n("gpu") == analysis.GPU_DEFAULT_N == 4096


def test_backend_resolution_by_head_dim(monkeypatch):
    monkeypatch.setattr(analysis, "gpu_status", lambda: (True, "fake device"))
    monkeypatch.setattr(analysis, "_gpu_module", lambda fam: (object(), None))
    for d in analysis.GPU_HEAD_DIMS:
        assert analysis.resolve_backend("gpu", "int8", head_dim=d)[0] == "gpu"
    backend, reason = analysis.resolve_backend("auto", "int8", head_dim=96)
    assert backend == "reference" and "head dims 64 and 128, not D=96" in reason
    with pytest.raises(analysis.BackendUnavailable, match="not D=96"):
        analysis.resolve_backend("gpu", "int8", head_dim=96)
    assert analysis.resolve_backend("reference", "int8", head_dim=96)[0] == "reference"


def test_worst_case():
    records = [dict(type="accuracy", sigma=s, tensor=t, cos=c, rel_l2=r)
               for s, t, c, r in ((1.0, "O", 0.999, 0.01), (1.0, "dQ", 0.99, 0.1), (5.0, "O", 0.99, 0.05),
                                  (5.0, "dQ", 0.995, float("nan")))]
    worst = analysis.worst_case(records)
    assert [w["tensor"] for w in worst] == ["O", "dQ"]
    assert (worst[0]["cos"], worst[0]["cos_sigma"], worst[0]["rel_l2"], worst[0]["rel_l2_sigma"]) == (0.99, 5.0,
                                                                                                      0.05, 5.0)
    assert worst[1]["cos"] == 0.99 and worst[1]["cos_sigma"] == 1.0
    assert np.isnan(worst[1]["rel_l2"]) and worst[1]["rel_l2_sigma"] == 5.0  # NaN is the worst value


def test_gpu_status_without_loader(monkeypatch):
    monkeypatch.setitem(sys.modules, "sagecupy._loader", None)  # import raises ImportError
    ok, reason = analysis.gpu_status()
    assert not ok and "loader" in reason


def test_family_status_reports_every_family(no_gpu):
    for name in analysis.FAMILIES:
        status = analysis.family_status(name)
        assert status["family"] == name and status["gpu"] is False
        assert status["reference"] in (True, False)
    assert analysis.family_status("int8")["reference"] is True


def test_runspec_validation():
    with pytest.raises(ValueError, match="resolve 'auto'"):
        analysis.RunSpec(backend="auto")
    with pytest.raises(ValueError, match="seed"):
        analysis.RunSpec(seed=-1)
    with pytest.raises(TypeError, match="causal"):
        analysis.RunSpec(causal=1)
    assert analysis.RunSpec(config="paper").config is PAPER


# ----------------------------------------------------------------------------
# the protocols on the reference backend
# ----------------------------------------------------------------------------


def test_accuracy_sweep_records():
    steps = []
    records = analysis.accuracy_sweep(_spec(), sigmas=(1, 8), progress=steps.append)
    assert steps == [1, 1]
    assert [(r["sigma"], r["tensor"]) for r in records] == [
        (s, t) for s in (1.0, 8.0) for t in analysis.ACCURACY_TENSORS
    ]
    for r in records:
        assert r["type"] == "accuracy"
        assert set(r) == {"type", "sigma", "tensor", "cos", "rel_l2", "rel_l1", "rmse"}
        assert 0.9 < r["cos"] <= 1.0 and 0.0 < r["rel_l2"] < 0.5
    # larger sigma: larger error in the gradients (docs/algorithms.md §4.5)
    dq = {r["sigma"]: r["rel_l2"] for r in records if r["tensor"] == "dQ"}
    assert dq[8.0] > dq[1.0]


def test_accuracy_sweep_unquantized_is_exact():
    """With every quantizer off the pipeline measures exact attention against itself."""
    spec = _spec(config=DEFAULT.replace(quantize=False), causal=True)
    for r in analysis.accuracy_sweep(spec, sigmas=(3,)):
        assert r["rel_l2"] < 1e-12, r


def test_accuracy_sweep_rejects_empty_sigmas():
    with pytest.raises(ValueError, match="empty"):
        analysis.accuracy_sweep(_spec(), sigmas=())


def test_intermediates_records():
    steps = []
    records = analysis.intermediates(_spec(causal=True), sigma=5.0, progress=steps.append)
    assert steps == [1, 1]
    inter = [r for r in records if r["type"] == "intermediate"]
    assert [r["tensor"] for r in inter] == list(analysis.INTERMEDIATE_TENSORS)
    for r in inter:
        assert r["source"] == analysis.SOURCE_REFERENCE
        assert {"cos", "rel_l2", "rms", "rms_exact"} <= set(r)
    (bound,) = [r for r in records if r["type"] == "ds_bound"]
    assert bound["bound_holds"] is True
    assert bound["ds_row_rms_max"] <= bound["bound_max"]
    assert 0 < bound["tightness_mean"] <= 1
    rms = {r["tensor"]: r["rms_exact"] for r in inter}
    assert rms["dS"] < rms["dP"]  # dS is the small one


def test_intermediates_on_loaded_gqa_inputs(tmp_path):
    rng = np.random.default_rng(0)
    path = _save(tmp_path, q=rng.standard_normal((1, 4, 24, 16)), k=rng.standard_normal((1, 2, 40, 16)),
                 v=rng.standard_normal((1, 2, 40, 16)), do=rng.standard_normal((1, 4, 24, 16)))
    inputs = analysis.load_inputs(path)
    records = analysis.intermediates(_spec(causal=True), inputs=inputs)
    by = {r["tensor"]: r for r in records if r["type"] == "intermediate"}
    assert set(by) == set(analysis.INTERMEDIATE_TENSORS)
    assert all(np.isfinite(r["rel_l2"]) for r in by.values())
    head = analysis.header("intermediates", _spec(causal=True), inputs=inputs, source=f"file {path}")
    assert (head["heads"], head["heads_kv"], head["n_q"], head["n_k"]) == (4, 2, 24, 40)


def test_accuracy_sweep_exact_side_is_chunked(monkeypatch):
    """The σ-sweep's exact side needs no (N, N) matrix: it runs by blocks (the dense intermediates are never called)
    and gives what the dense form gives."""
    from sagecupy.reference import attention as A

    spec = _spec(config=DEFAULT.replace(quantize=False), causal=True)
    inputs = analysis.make_inputs(spec.shape, 3.0, spec.seed, spec.dtype)
    dense = A.attention_intermediates(inputs["q"], inputs["k"], inputs["v"], inputs["do"], causal=True)

    def refuse(*a, **kw):
        raise AssertionError("the dense intermediates were called")

    monkeypatch.setattr(A, "attention_intermediates", refuse)
    exact = analysis._exact(inputs, True, analysis.ACCURACY_TENSORS)
    for key in analysis.ACCURACY_TENSORS:
        assert np.abs(exact[key] - dense[key]).max() <= 1e-12 * np.abs(dense[key]).max(), key
    for r in analysis.accuracy_sweep(spec, sigmas=(3,)):  # (quantizers off: exact against exact)
        assert r["rel_l2"] < 1e-12, r
    with pytest.raises(AssertionError, match="dense intermediates"):  # (P, dP, dS need the dense form)
        analysis._exact(inputs, True, analysis.INTERMEDIATE_TENSORS)


def test_reference_memory_is_checked_before_anything_runs(monkeypatch):
    """A reference run whose dense simulator (or, for the intermediates, simulator plus dense exact intermediates)
    would exceed MEMORY_LIMIT is refused up front, before any input is drawn, with the bytes it would need."""
    from sagecupy.reference import attention as A
    from sagecupy.reference import sagebwd

    def no_inputs(*a, **kw):
        raise AssertionError("inputs were drawn")

    monkeypatch.setattr(analysis, "make_inputs", no_inputs)
    big = _spec(shape=analysis.Shape(batch=1, heads=1, n=32768, d=128))
    need = sagebwd.peak_bytes(1, 1, 32768, 32768, 128, DEFAULT)
    assert need > A.MEMORY_LIMIT and analysis.reference_peak_bytes(big) == need
    with pytest.raises(ValueError, match=r"the float64 int8 simulator \(dense \(N, N\) matrices\) at B=1, H=1, "
                                         r"Nq=32768, Nk=32768, D=128 would need about [0-9.]+ GiB of memory, more "
                                         r"than the reference's limit"):
        analysis.accuracy_sweep(big, sigmas=(1,))
    with pytest.raises(ValueError, match="would need about"):
        analysis.smoothing_ablation(big, sigmas=(1,))
    # the intermediates keep every head's (N, N) tensors, simulated and exact: both count
    both = analysis.reference_peak_bytes(_spec(), intermediates=True)
    assert both == (sagebwd.peak_bytes(1, 2, 40, 40, 32, DEFAULT, intermediates=True)
                    + A.dense_peak_bytes(1, 2, 40, 40, 32, kind="intermediates"))
    monkeypatch.setattr(A, "MEMORY_LIMIT", both - 1)
    with pytest.raises(ValueError, match=r"int8 simulator \(dense \(N, N\) matrices\) and the dense exact "
                                         r"intermediates at B=1, H=2"):
        analysis.intermediates(_spec())
    # the GPU backend's sweep runs no simulator and a chunked exact side: nothing to refuse
    assert analysis.reference_peak_bytes(dataclasses.replace(big, backend="gpu")) == 0


def test_cli_refuses_a_simulation_beyond_the_memory_limit_in_one_line():
    """`sagecupy accuracy --backend reference --n 32768 --heads 1 --sigmas 1`: one `Error:` line with the memory
    the dense simulator would need and the limit; no traceback, nothing on stdout."""
    from click.testing import CliRunner

    from sagecupy.cli import main

    result = CliRunner().invoke(main, ["accuracy", "--backend", "reference", "--n", "32768", "--heads", "1",
                                       "--sigmas", "1"])
    assert result.exit_code == 1 and result.stdout == "" and "Traceback" not in result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("Error: the float64 int8 simulator (dense (N, N) matrices) at B=1, H=1, Nq=32768")
    assert "would need about" in lines[0] and "GiB of memory, more than the reference's limit of 8.0 GiB" in lines[0]


def test_smoothing_ablation():
    steps = []
    records = analysis.smoothing_ablation(_spec(config="paper"), sigmas=(5,), progress=steps.append)
    assert len(steps) == len(analysis.SMOOTHING_VARIANTS)
    assert [r["smoothing"] for r in records] == [v[0] for v in analysis.SMOOTHING_VARIANTS for _ in range(4)]
    for r in records:
        assert r["type"] == "smoothing" and 0 < r["rel_l2"] < 1
    flags = {(r["smoothing"], r["k_smoothing"], r["q_smoothing"]) for r in records}
    assert flags == set(analysis.SMOOTHING_VARIANTS)


def test_smoothing_rejects_family_without_smoothing():
    with pytest.raises(ValueError, match="no smoothing"):
        analysis.smoothing_ablation(_spec(family="qat"), sigmas=(1,))


@pytest.mark.parametrize("fam", ["nvfp4", "qat"])
def test_fp4_families_on_the_reference(fam):
    pytest.importorskip(f"sagecupy.reference.{fam}")
    shape = analysis.Shape(batch=1, heads=1, n=32, d=32)
    records = analysis.accuracy_sweep(_spec(family=fam, shape=shape), sigmas=(1,))
    want = analysis.ACCURACY_TENSORS if fam == "qat" else ("O",)
    assert [r["tensor"] for r in records] == list(want)
    assert all(0.8 < r["cos"] <= 1 for r in records)
    inter = analysis.intermediates(_spec(family=fam, shape=shape))
    assert {r["tensor"] for r in inter if r["type"] == "intermediate"} >= set(want)


def test_header_has_environment_and_config():
    head = analysis.header("accuracy", _spec(config="paper"), backend_requested="auto",
                           backend_reason="no GPU", sigmas=(1, 3))
    assert head["type"] == "env" and head["command"] == "accuracy"
    for key in ("sagecupy", "git_commit", "numpy", "cupy", "gpu", "backend", "dtype", "seed", "config"):
        assert key in head
    assert head["config"] == "paper" and head["config_fields"] == dataclasses.asdict(PAPER)
    assert (head["batch"], head["heads"], head["n_q"], head["d"]) == (1, 2, 40, 32)
    assert head["backend_requested"] == "auto" and head["sigmas"] == [1, 3]


# ----------------------------------------------------------------------------
# the GPU backend's plumbing, with a fake device
# ----------------------------------------------------------------------------


@pytest.fixture
def fake_gpu(monkeypatch):
    """A fake ``sagecupy._loader`` and ``sagecupy.int8`` backed by the reference simulator.

    The device copies are NumPy arrays of the input dtype, so the test checks
    what the GPU backend does around the kernels: dtype handling, which tensors
    it reports and where each one came from.
    """
    from sagecupy.reference import sagebwd

    calls = {}
    loader = types.ModuleType("sagecupy._loader")
    loader.gpu_status = lambda: (True, "fake device")
    loader.get_function = lambda *a, **k: None  # the family modules import these; the fake never launches
    loader.device_capability = lambda: (9, 0)
    int8 = types.ModuleType("sagecupy.int8")

    def forward(q, k, v, *, causal, sm_scale, layout, config):
        calls["dtype"] = q.dtype
        o, res = sagebwd.forward(q, k, v, causal=causal, sm_scale=sm_scale, layout=layout, config=config)
        return o.astype(np.float16), res

    def backward(residuals, do):
        return tuple(g.astype(np.float16) for g in sagebwd.backward(residuals, do))

    int8.forward, int8.backward = forward, backward
    monkeypatch.setitem(sys.modules, "sagecupy._loader", loader)
    monkeypatch.setitem(sys.modules, "sagecupy.int8", int8)
    monkeypatch.setattr(analysis, "_to_device", lambda x, dtype: x.astype(np.float16))
    monkeypatch.setattr(analysis, "_to_host", lambda x: np.asarray(x, dtype=np.float64))
    return calls


def test_fake_gpu_backend(fake_gpu):
    assert analysis.resolve_backend("auto", "int8")[0] == "gpu"
    assert analysis.resolve_backend("auto", "nvfp4")[0] == "gpu"  # every family has kernels
    assert analysis.resolve_backend("gpu", "qat")[0] == "gpu"
    assert analysis.family_status("int8")["gpu"] is True
    spec = _spec(backend="gpu")
    records = analysis.accuracy_sweep(spec, sigmas=(1,))
    assert fake_gpu["dtype"] == np.float16
    assert [r["tensor"] for r in records] == list(analysis.ACCURACY_TENSORS)
    assert all(r["cos"] > 0.99 for r in records)
    inter = analysis.intermediates(spec)
    sources = {r["tensor"]: r["source"] for r in inter if r["type"] == "intermediate"}
    assert sources == {"delta": "reference-sim", "P": "reference-sim", "dP": "reference-sim",
                       "dS": "reference-sim", "O": "gpu", "dQ": "gpu", "dK": "gpu", "dV": "gpu"}


def test_to_host_reads_bf16_through_the_bits():
    class FakeBF16:  # the shape of sagecupy.adapters.bf16.BF16Array: raw bits in .bits, dtype named bfloat16
        dtype = "bfloat16"

        def __init__(self, bits):
            self.bits = bits

    x = np.array([1.0, -2.5, 3.0e38, 2.0 ** -130])
    got = analysis._to_host(FakeBF16(analysis.bf16_bits(x)))
    assert np.array_equal(got, analysis.round_to_dtype(x, "bf16"))
    assert analysis._to_host(np.float16([1.5])).dtype == np.float64


def test_environment_records_kernel_source_hashes():
    from sagecupy import _env
    from sagecupy._loader import kernel_dir

    hashes = _env.kernel_hashes()
    assert set(hashes) == {p.relative_to(kernel_dir()).as_posix() for p in kernel_dir().glob("*/*.cu")}
    assert all(len(h) == 16 and int(h, 16) >= 0 for h in hashes.values())
