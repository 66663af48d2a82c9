"""SageBwd GPU kernels against the float64 references.

Two comparisons per case (docs/algorithms.md):
* against the quantization-aware simulator run with the kernel's own config (tight: what remains is
  fp32 vs float64 accumulation, fp32 rounding at quantization ties, and the rounding of the outputs
  to fp16/bf16);
* against exact float64 attention: no worse than 1.1x the simulator's own error + 1e-4.
"""

import math

import numpy as np
import pytest

from sagecupy.config import DEFAULT, PAPER

# The default granularities with P quantized per token over 64-key forward tiles instead of the default 128.
BKV64 = DEFAULT.replace(name="default-bkv64", block_kv=64)
# The default's granularities with dV = P^T dO, dQ = X^ K^ and dK = Y^^T Q^ as integer matmuls (P^ per key column,
# dO^ per channel, X^ per query row, Y^ per key).
DV8 = DEFAULT.replace(name="default-dv8", dv_int8=True, ds_int8=True)
# The default's 16-bit dV with dQ and dK as integer matmuls.
DS8 = DEFAULT.replace(name="default-ds8", ds_int8=True)
# P.V in the inputs' 16-bit type (config pv_int8=False): the wgmma engine only; block_kv moves only the frame's steps
PV16 = DEFAULT.replace(name="default-pv16", pv_int8=False)
PV16_64 = DEFAULT.replace(name="default-pv16-bkv64", pv_int8=False, block_kv=64)
from sagecupy.reference import attention as ref_attn
from sagecupy.reference import metrics
from sagecupy.reference import sagebwd as ref_sage

from draws import qkv_do

pytestmark = pytest.mark.gpu

# Tight bounds (relative L2 vs the simulator): O and dV 1e-3, dQ and dK 5e-3.
TOL = {"O": 1e-3, "dV": 1e-3, "dQ": 5e-3, "dK": 5e-3}
# Unit roundoff of the output formats: the kernel must round its fp32 result to the output dtype, and
# the simulator does not, so the bound adds the simulator's own error when rounded to that dtype
# (measured per case, never a constant).
DTYPES = ("float16", "bfloat16")


def _cupy():
    import cupy

    return cupy


def _to_dev(x, dtype_name):
    cp = _cupy()
    from sagecupy.adapters.bf16 import BF16Array

    x32 = cp.asarray(np.asarray(x, dtype=np.float32))
    return x32.astype(cp.float16) if dtype_name == "float16" else BF16Array.from_float(x32)


def _f32(x):
    """Device float32 copy of a float16 CuPy array or a BF16Array."""
    return x.to_float32() if hasattr(x, "to_float32") else x.astype(_cupy().float32)


def _to_host(x):
    return _f32(x).get().astype(np.float64)


def _raw(x):
    return getattr(x, "bits", x)


def _round_to(x, dtype_name):
    return _to_host(_to_dev(x, dtype_name))


def _inputs(seed, B, Hq, Hkv, Nq, Nk, D, layout, dtype_name, sigma=1.0):
    dev = [_to_dev(x, dtype_name) for x in qkv_do(seed, B, Hq, Hkv, Nq, Nk, D, layout, sigma)]
    host = [_to_host(x) for x in dev]  # the exact values the kernel sees
    return dev, host


def _check(name, got, sim, exact, dtype_name, case, extra=0.0):
    assert np.isfinite(got).all(), f"{name}: non-finite output {case}"
    if not np.any(exact):
        # The exact gradient is identically zero (e.g. a single visible key: softmax over one logit has
        # no gradient). The kernel's dP - delta is then rounding noise of O's output format: require it tiny.
        assert np.abs(got).max() < 1e-3, f"{name}: exact gradient is 0, kernel max |.| {np.abs(got).max():.2e} {case}"
        return
    tol = TOL[name] + metrics.rel_l2(_round_to(sim, dtype_name), sim) + extra  # (extra: the caller's own reason)
    err_sim = metrics.rel_l2(got, sim)
    assert np.isfinite(got).all(), f"{name}: non-finite output {case}"
    where = metrics.worst_element(got, sim)
    assert err_sim <= tol, f"{name}: rel_l2 vs simulator {err_sim:.3e} > {tol:.3e} {case}; worst {where}"
    e_kernel = metrics.rel_l2(got, exact)
    e_sim = metrics.rel_l2(sim, exact)
    # The kernel returns the output format; the float64 simulator does not. Where the simulator equals exact
    # attention (one visible key: P = 1 and dO's codes are exact, so its dV error is ~1e-8), the output's own
    # rounding (~2.8e-4 in fp16) is all the kernel can be. That rounding is independent of the quantization
    # error, so the two add in quadrature. The kernel rounds its own result, which is the simulator's, not the exact
    # one: where the exact result is representable and the simulator's is not (one visible key with dO quantized:
    # dV = dO exactly, fuzz case int8-376), only the simulator's rounding measures it, so the larger of the two.
    out_round = max(metrics.rel_l2(_round_to(exact, dtype_name), exact),
                    metrics.rel_l2(_round_to(sim, dtype_name), sim))
    assert e_kernel <= 1.1 * math.hypot(e_sim, out_round) + 1e-4, (
        f"{name}: vs exact {e_kernel:.4e} > 1.1 x hypot(simulator's {e_sim:.4e}, output rounding "
        f"{out_round:.1e}) + 1e-4 {case}")


def _run_case(B, Hq, Hkv, Nq, Nk, D, causal, layout, dtype_name, config, backward=True, seed=0, sigma=1.0):
    import sagecupy.int8 as s8

    case = dict(B=B, Hq=Hq, Hkv=Hkv, Nq=Nq, Nk=Nk, D=D, causal=causal, layout=layout, dtype=dtype_name,
                config=config.name)
    (q, k, v, do), (qh, kh, vh, doh) = _inputs(seed, B, Hq, Hkv, Nq, Nk, D, layout, dtype_name, sigma)
    before = [_raw(x).copy() for x in (q, k, v, do)]
    o, lse, res = s8.forward(q, k, v, causal=causal, layout=layout, config=config, return_lse=True)
    o_h = _to_host(o)
    o_sim, r_sim = ref_sage.forward(qh, kh, vh, causal=causal, layout=layout, config=config,
                                    dtype=dtype_name)
    o_ex, lse_ex = ref_attn.attention_forward(qh, kh, vh, causal=causal, layout=layout)
    _check("O", o_h, o_sim, o_ex, dtype_name, case)
    lse_h = lse.get().astype(np.float64)
    fin = np.isfinite(r_sim["lse"])
    assert np.array_equal(np.isfinite(lse_h), fin), f"LSE -inf pattern differs {case}"
    # fp32 vs float64 rounding can flip a Q or K code at an exact quantization tie; such a row's logits
    # move by one quantization step, so its LSE may differ by ~1e-3. All other rows must agree to fp32
    # accuracy: at least 99% of rows within 1e-4, and every row within 1e-2.
    d_lse = np.abs(lse_h[fin] - r_sim["lse"][fin])
    if d_lse.size:
        assert np.quantile(d_lse, 0.99) < 1e-4 and d_lse.max() < 1e-2, (
            f"LSE vs simulator: p99 {np.quantile(d_lse, 0.99):.2e}, max {d_lse.max():.2e} {case}")
    if backward:
        dq, dk, dv = s8.backward(res, do)
        # The kernel's delta uses the kernel's O (rounded to the dtype): give the simulator that O.
        r_sim = dict(r_sim, o=ref_attn.to_hnd(o_h, layout))
        dq_s, dk_s, dv_s = ref_sage.backward(r_sim, doh)
        dq_e, dk_e, dv_e = ref_attn.attention_backward(qh, kh, vh, o_ex, lse_ex, doh, causal=causal, layout=layout)
        for name, got, sim, ex in (("dQ", dq, dq_s, dq_e), ("dK", dk, dk_s, dk_e), ("dV", dv, dv_s, dv_e)):
            _check(name, _to_host(got), sim, ex, dtype_name, case)
    for x, x0 in zip((q, k, v, do), before):
        assert bool((_raw(x) == x0).all()), f"an input was modified {case}"


# A sampled grid: odd lengths, Nq != Nk with causal, GQA, both layouts and dtypes, both configs.
CASES = [
    # B, Hq, Hkv, Nq, Nk, D, causal, layout, dtype, config
    (1, 2, 2, 128, 128, 128, False, "HND", "float16", DEFAULT),
    (1, 2, 2, 128, 128, 64, True, "HND", "float16", DEFAULT),
    (2, 4, 2, 113, 239, 64, False, "NHD", "float16", DEFAULT),
    (1, 4, 1, 239, 113, 128, True, "HND", "bfloat16", DEFAULT),
    (1, 2, 2, 1, 17, 128, False, "HND", "float16", DEFAULT),
    (1, 2, 2, 17, 1, 64, True, "NHD", "bfloat16", DEFAULT),
    (1, 2, 1, 1000, 1000, 128, True, "NHD", "float16", PAPER),
    (1, 2, 2, 300, 1000, 64, True, "HND", "bfloat16", PAPER),
    (1, 3, 3, 1000, 300, 128, False, "HND", "float16", PAPER),
    (1, 1, 1, 4224, 4224, 64, True, "HND", "float16", DEFAULT),
    (2, 4, 2, 113, 239, 64, False, "NHD", "float16", BKV64),
    (1, 4, 1, 239, 113, 128, True, "HND", "bfloat16", BKV64),
    (1, 2, 2, 1, 17, 128, False, "HND", "float16", BKV64),
    (1, 2, 2, 300, 1000, 128, True, "NHD", "float16", BKV64),
    (1, 1, 1, 4224, 4224, 64, True, "HND", "bfloat16", BKV64),
    (1, 4, 1, 239, 113, 128, True, "HND", "bfloat16", DV8),
    (2, 4, 2, 113, 239, 64, False, "NHD", "float16", DV8),
    (1, 2, 2, 1000, 1000, 128, False, "HND", "float16", DV8),
    (1, 4, 1, 239, 113, 128, True, "NHD", "bfloat16", DS8),
    (2, 4, 2, 113, 239, 64, False, "HND", "float16", DS8),
    (1, 2, 2, 1000, 1000, 64, True, "HND", "bfloat16", DS8),
    (1, 2, 2, 128, 128, 128, False, "HND", "float16", PV16),
    (2, 4, 2, 113, 239, 64, False, "NHD", "bfloat16", PV16),
    (1, 4, 1, 239, 113, 128, True, "HND", "bfloat16", PV16),
    (1, 2, 2, 1, 17, 128, False, "NHD", "float16", PV16),
    (1, 2, 2, 17, 1, 64, True, "HND", "float16", PV16),
    (1, 2, 2, 300, 1000, 128, True, "NHD", "bfloat16", PV16),
    (1, 1, 1, 4224, 4224, 64, True, "HND", "float16", PV16),
    (1, 4, 1, 239, 113, 128, True, "NHD", "float16", PV16_64),
    (1, 3, 3, 1000, 300, 64, False, "HND", "bfloat16", PV16_64),
]


@pytest.mark.parametrize("B,Hq,Hkv,Nq,Nk,D,causal,layout,dtype,config", CASES,
                         ids=[f"{c[3]}x{c[4]}-d{c[5]}-{'causal' if c[6] else 'full'}-{c[7]}-{c[8]}-{c[9].name}-gqa{c[1]//c[2]}"
                              for c in CASES])
def test_forward_backward_vs_references(B, Hq, Hkv, Nq, Nk, D, causal, layout, dtype, config):
    if not config.pv_int8:
        _need_pv16()
    _run_case(B, Hq, Hkv, Nq, Nk, D, causal, layout, dtype, config)


def _need_pv16():
    from sagecupy.int8 import forward_engine

    if forward_engine(None) != "wgmma":
        pytest.skip("pv_int8=False runs on the wgmma engine (sm_90) only")


@pytest.mark.parametrize("config", [PV16, PV16_64], ids=lambda c: c.name)
def test_pv16_sigma_sweep_beats_int8_pv(config):
    """O of pv_int8=False against exact attention: no worse than the INT8 P.V's at any sigma (fewer roundings of P
    and none of V), and the LSE the same to the bit (both sum the same unrounded P~)."""
    import sagecupy.int8 as s8

    _need_pv16()
    for sigma in (1.0, 3.0, 8.0):
        (q, k, v, _), (qh, kh, vh, _) = _inputs(5, 1, 4, 4, 1024, 1024, 128, "HND", "bfloat16", sigma)
        o_ex, _ = ref_attn.attention_forward(qh, kh, vh)
        o8, lse8, _ = s8.forward(q, k, v, config=config.replace(pv_int8=True), return_lse=True)
        o16, lse16, _ = s8.forward(q, k, v, config=config, return_lse=True)
        e8, e16 = metrics.rel_l2(_to_host(o8), o_ex), metrics.rel_l2(_to_host(o16), o_ex)
        assert e16 <= e8, (sigma, e8, e16)
        assert bool((lse8 == lse16).all()), sigma


def test_pv16_refusals():
    """pv_int8=False names what it needs where the kernels do not implement it."""
    import sagecupy.int8 as s8

    (q, k, v, _), _ = _inputs(0, 1, 2, 2, 128, 128, 64, "HND", "float16")
    with pytest.raises(ValueError, match="pv_int8=False.*wgmma"):
        s8.forward(q, k, v, config=PV16, engine="mma")
    with pytest.raises(ValueError, match="v_granularity"):
        s8.forward(q, k, v, config=PV16.replace(v_granularity="block", block_kv=64))
    ok, why = s8.is_supported(q, k, v, config=PV16.replace(v_granularity="block", block_kv=64))
    assert not ok and "v_granularity" in why


@pytest.mark.parametrize("sigma", [1.0, 8.0])
def test_large_logits(sigma):
    _run_case(1, 2, 2, 256, 256, 128, False, "HND", "float16", DEFAULT, sigma=sigma, seed=3)


def test_fully_masked_rows_zero_and_no_nan():
    import sagecupy.int8 as s8

    # Nq > Nk with causal: the first Nq - Nk rows see no key.
    (q, k, v, do), _ = _inputs(5, 1, 2, 2, 70, 20, 64, "HND", "float16")
    o, lse, res = s8.forward(q, k, v, causal=True, return_lse=True)
    dq, dk, dv = s8.backward(res, do)
    o_h, lse_h, dq_h = _to_host(o), lse.get(), _to_host(dq)
    assert np.all(o_h[:, :, :50] == 0) and np.all(np.isneginf(lse_h[:, :, :50]))
    assert np.all(dq_h[:, :, :50] == 0)
    for x in (o, dq, dk, dv):
        assert bool(_cupy().isfinite(_f32(x)).all())


def poison_new_buffers(monkeypatch):
    """Every buffer cupy.empty returns from now on filled with NaN (bfloat16 bits: a NaN pattern), so that an output
    element the kernels forget to write cannot pass."""
    cp = _cupy()
    real_empty = cp.empty

    def nan_empty(shape, dtype=float, order="C"):
        out = real_empty(shape, dtype=dtype, order=order)
        if cp.dtype(dtype).kind == "f":
            out.fill(float("nan"))
        elif cp.dtype(dtype) == cp.uint16:
            out.fill(0x7FC0)
        return out

    monkeypatch.setattr(cp, "empty", nan_empty)


def test_poisoned_outputs_are_overwritten(monkeypatch):
    """Fill every fresh output buffer with NaN: an element the kernels forget to write cannot pass."""
    cp = _cupy()
    import sagecupy.int8 as s8

    poison_new_buffers(monkeypatch)
    for dtype in DTYPES:
        (q, k, v, do), _ = _inputs(7, 1, 2, 1, 200, 77, 128, "HND", dtype)
        o, lse, res = s8.forward(q, k, v, causal=True, return_lse=True)
        dq, dk, dv = s8.backward(res, do)
        for name, x in (("o", o), ("lse", lse), ("dq", dq), ("dk", dk), ("dv", dv)):
            assert not bool(cp.isnan(_f32(x)).any()), f"{name} ({dtype}) has unwritten (NaN) elements"


@pytest.mark.parametrize("config", ["default", "paper"])
@pytest.mark.parametrize("causal", [False, True])
def test_backward_is_bitwise_repeatable(causal, config):
    """No atomics anywhere (dQ has its own kernel, summed in registers in key order): two runs agree bit for
    bit, with many key blocks per query (Nk = 517) and GQA."""
    import sagecupy.int8 as s8

    (q, k, v, do), _ = _inputs(9, 1, 4, 2, 300, 517, 128, "HND", "bfloat16")
    _, res = s8.forward(q, k, v, causal=causal, config=config)
    a = [_to_host(x) for x in s8.backward(res, do)]
    b = [_to_host(x) for x in s8.backward(res, do)]
    for name, x, y in zip(("dQ", "dK", "dV"), a, b):
        assert np.array_equal(x.view(np.uint8), y.view(np.uint8)), f"{name} differs between two runs"


@pytest.mark.parametrize("D,dtype,layout,config,causal,Hq,Hkv,Nq,Nk,engine", [
    (64, "float16", "HND", "default", True, 2, 2, 100, 100, None),
    (128, "bfloat16", "HND", "default", True, 4, 2, 113, 1000, None),   # wgmma: quant_qkv (one pre-pass launch), GQA
    (128, "bfloat16", "HND", "default", True, 4, 2, 113, 1000, "mma"),  # quant_rows_qk + quant_transpose_perm
    (128, "float16", "NHD", "default", False, 2, 1, 1000, 17, None),
    (128, "bfloat16", "HND", "paper", True, 2, 2, 300, 517, None),      # per-block Q / K / V: quant_rows passes
    (64, "bfloat16", "NHD", BKV64, False, 4, 4, 17, 300, None),
])
def test_sage_attention_matches_forward(D, dtype, layout, config, causal, Hq, Hkv, Nq, Nk, engine):
    """sage_attention keeps no residuals (on the wgmma engine its pre-pass writes no plain K codes or scales): O and
    the LSE are bitwise forward's, and so is every pre-pass output it keeps. ``engine=None``: the device's default;
    "mma": the mma.sync engine, asked for by argument (on Hopper too)."""
    import sagecupy.int8 as s8

    (q, k, v, _), _ = _inputs(11, 1, Hq, Hkv, Nq, Nk, D, layout, dtype)
    o1 = s8.sage_attention(q, k, v, causal=causal, layout=layout, config=config, engine=engine)
    o2, lse_i = s8.sage_attention(q, k, v, causal=causal, layout=layout, config=config, return_lse=True,
                                  engine=engine)
    o3, lse_t, _ = s8.forward(q, k, v, causal=causal, layout=layout, config=config, return_lse=True, engine=engine)
    for o in (o1, o2):
        assert np.array_equal(_raw(o).get(), _raw(o3).get()), "sage_attention's O differs from forward's"
    assert np.array_equal(lse_i.get(), lse_t.get()), "sage_attention's LSE differs from forward's"
    kw = dict(causal=causal, sm_scale=None, layout=layout, config=config, engine=engine)
    _, _, pre_t = s8._preprocess_forward(q, k, v, **kw)
    _, _, pre_i = s8._preprocess_forward(q, k, v, inference=True, **kw)
    assert pre_i["plan"] is not pre_t["plan"]  # a program of its own
    assert engine is None or pre_i["engine"] == engine
    if pre_i["engine"] == "wgmma":
        assert pre_i["k_codes"] is None and pre_i["k_scale"] is None
    for name, x in pre_i.items():
        if name in s8._PRE_NAMES and x is not None:
            assert np.array_equal(_raw(x).get(), _raw(pre_t[name]).get()), f"inference pre-pass: {name} differs"


def test_uint16_is_not_taken_for_bfloat16():
    cp = _cupy()
    import sagecupy.int8 as s8

    x = cp.zeros((1, 1, 16, 64), dtype=cp.uint16)
    with pytest.raises(TypeError, match="dtype"):
        s8.forward(x, x, x)


def test_error_paths():
    cp = _cupy()
    import sagecupy.int8 as s8

    q = cp.zeros((1, 2, 16, 64), dtype=cp.float16)
    with pytest.raises(ValueError, match="head_dim"):
        s8.forward(cp.zeros((1, 2, 16, 96), cp.float16), cp.zeros((1, 2, 16, 96), cp.float16),
                   cp.zeros((1, 2, 16, 96), cp.float16))
    with pytest.raises(TypeError, match="dtype"):
        s8.forward(q.astype(cp.float32), q.astype(cp.float32), q.astype(cp.float32))
    from sagecupy.adapters.bf16 import BF16Array

    with pytest.raises(TypeError, match="one dtype"):
        s8.forward(q, q, BF16Array.from_float(q.astype(cp.float32)))
    with pytest.raises(ValueError, match="layout"):
        s8.forward(q, q, q, layout="BHSD")
    with pytest.raises(ValueError, match="multiple of kv heads"):
        s8.forward(cp.zeros((1, 3, 16, 64), cp.float16), q, q)
    with pytest.raises(ValueError, match="4-D"):
        s8.forward(q[0], q, q)
    with pytest.raises(ValueError, match="same shape"):
        s8.forward(q, q, cp.zeros((1, 2, 17, 64), cp.float16))
    with pytest.raises(ValueError, match="config"):
        s8.forward(q, q, q, config=DEFAULT.replace(q_smoothing=True))
    with pytest.raises(ValueError, match="config"):
        s8.forward(q, q, q, config="fast")
    with pytest.raises(TypeError, match="CUDA array"):
        s8.forward(np.zeros((1, 2, 16, 64), np.float16), q, q)
    with pytest.raises(ValueError, match="sm_scale"):
        s8.forward(q, q, q, sm_scale=-1.0)
    _, res = s8.forward(q, q, q)
    with pytest.raises(ValueError, match="do.shape"):
        s8.backward(res, cp.zeros((1, 2, 15, 64), cp.float16))
    with pytest.raises(TypeError, match="residuals"):
        s8.backward({"o": q}, q)
    ok, why = s8.is_supported(q, q, q, config=DEFAULT.replace(block_kv=32))
    assert not ok and "block_kv" in why
    ok, why = s8.is_supported(q, q, q, config=PAPER.replace(block_kv=128))  # per-block K/V: 64-key tiles only
    assert not ok and "block_kv" in why
    assert s8.is_supported(q, q, q, config=BKV64) == (True, "")
    ok, why = s8.is_supported(q, q, q, config=DEFAULT.replace(dv_int8=True))  # 16-bit dQ, dK with an INT8 dV
    assert not ok and "ds_int8" in why
    assert s8.is_supported(q, q, q) == (True, "")
    ok, why = s8.is_supported(np.zeros((1, 2, 16, 64), np.float16), q, q)  # host arrays: not supported, no raise
    assert not ok and "CUDA" in why
    assert s8.is_supported(None, q, q)[0] is False


def test_noncontiguous_and_strided_inputs_match_contiguous():
    cp = _cupy()
    import sagecupy.int8 as s8

    (q, k, v, do), _ = _inputs(13, 1, 2, 2, 96, 96, 64, "HND", "float16")
    big = cp.zeros((1, 2, 96, 128), cp.float16)
    big[..., 4:68] = v
    v_view = big[..., 4:68]  # base not 16-byte aligned: must be copied, not misread
    o1, _ = s8.forward(q, k, v)
    o2, _ = s8.forward(q, k, v_view)
    assert bool((o1 == o2).all())
    qt = cp.ascontiguousarray(q.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)  # HND view of NHD memory
    o3, _ = s8.forward(qt, k, v)
    assert bool((o1 == o3).all())
    # C-contiguous views at a 2-byte offset (every input, and dO): copied, not read with misaligned
    # 16-byte loads.
    def shifted(x):
        buf = cp.zeros(x.size + 1, x.dtype)
        y = buf[1:].reshape(x.shape)
        y[...] = x
        assert y.flags.c_contiguous and y.data.ptr % 16
        return y
    o4, res4 = s8.forward(shifted(q), shifted(k), shifted(v))
    assert bool((o1 == o4).all())
    _, res1 = s8.forward(q, k, v)
    for g1, g4 in zip(s8.backward(res1, do), s8.backward(res4, shifted(do))):
        assert bool((g1 == g4).all())


def _unpermute_tokens(x_t, n):
    """(…, D, n_pad) mma-permuted token order -> (…, n, D) natural order."""
    p = np.arange(x_t.shape[-1])
    q = p & 31
    tok = (p & ~31) | ((q >> 4) << 4) | (((q & 3) >> 1) << 3) | (((q & 15) >> 2) << 1) | (q & 1)
    out = np.empty_like(x_t)
    out[..., tok] = x_t
    return np.swapaxes(out, -1, -2)[..., :n, :]


def _v_channels(pre):
    """The forward pre-pass's V^T codes as (B, Hkv, D, nk_pad) channel rows (tokens mma-permuted), from its v_t array
    or, on the wgmma engine, from its K/V stage images (which must then also hold K^ and the key
    scales exactly)."""
    from sagecupy.int8 import v_t_channels

    if pre["v_t"] is not None:
        return v_t_channels(pre["v_t"]).get()
    ki = pre["kv_img"].get()
    D = pre["k_codes"].shape[-1]
    ntk = ki.shape[2]
    kc = _unswizzle(ki[..., :64 * D], 64, D).view(np.int8).reshape(*ki.shape[:2], ntk * 64, D)
    assert np.array_equal(kc, pre["k_codes"].get()), "K^ in the K/V images differs from the codes"
    ks = np.ascontiguousarray(ki[..., 128 * D:128 * D + 256]).view(np.float32).reshape(*ki.shape[:2], -1)
    same = np.array_equal(ks.view(np.uint32), pre["k_scale"].get().view(np.uint32))  # bitwise: NaN scales too
    assert same, "key scales in the K/V images differ"
    return v_t_channels(_unswizzle(ki[..., 64 * D:128 * D], D, 64).view(np.int8))


def _assert_same_codes(pre, ref, nq, nk):
    """The pre-pass's Q, K, V codes (unpadded, V back in natural token order) equal the reference's."""
    qc = pre["q_codes"].get()[:, :, :nq]
    kc = pre["k_codes"].get()[:, :, :nk]
    vc = _unpermute_tokens(_v_channels(pre), nk)
    for name, got, want in (("Q", qc, ref["q_codes"]), ("K", kc, ref["k_codes"]), ("V", vc, ref["v_codes"])):
        diff = np.argwhere(got.astype(np.int32) != want.astype(np.int32))
        assert diff.size == 0, f"{name} codes differ at {len(diff)} places, first {tuple(diff[0])}"


QUANT_SHAPES = [(2, 4, 2, 200, 333, 128, "NHD"),
                # D = 64, HND, 4 query heads per kv head, lengths around the 64-token blocks; one token
                # against a sequence longer than a 256-token statistics chunk.
                (1, 8, 2, 17, 65, 64, "HND"),
                (1, 2, 1, 1, 4100, 64, "NHD")]


@pytest.mark.parametrize("shape", QUANT_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("config", [DEFAULT, PAPER], ids=["default", "paper"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_quantized_operands_bit_identical_to_reference(config, dtype, shape):
    """The pre-passes and the reference's fp32-mode quantizers give the same codes, bit for bit."""
    import sagecupy.int8 as s8

    B, Hq, Hkv, Nq, Nk, D, layout = shape
    (q, k, v, _), (qh, kh, vh, _) = _inputs(17, B, Hq, Hkv, Nq, Nk, D, layout, dtype, sigma=3.0)
    p, cfg, pre = s8._preprocess_forward(q, k, v, causal=False, sm_scale=None, layout=layout, config=config)
    ref = ref_sage.quantize_inputs(qh, kh, vh, layout=layout, config=config)
    _assert_same_codes(pre, ref, Nq, Nk)
    qs = pre["q_scale"].get()[:, :, :Nq] / np.float32(s8.LOG2E)
    np.testing.assert_allclose(qs, ref["q_scale"], rtol=2e-7)
    np.testing.assert_array_equal(pre["k_scale"].get()[:, :, :Nk], ref["k_scale"].astype(np.float32))
    # Padding rows and tokens (up to the tile multiples) hold code 0 and scale 0.
    assert not pre["q_codes"].get()[:, :, Nq:].any() and not pre["q_scale"].get()[:, :, Nq:].any()
    assert not pre["k_codes"].get()[:, :, Nk:].any() and not pre["k_scale"].get()[:, :, Nk:].any()
    vt = _v_channels(pre)
    assert not _unpermute_tokens(vt, vt.shape[-1])[:, :, Nk:].any()
    if config.k_smoothing:
        np.testing.assert_array_equal(pre["mu_k"].get(), ref["mu_k"].astype(np.float32))


BWD_PREP_SHAPES = [(2, 4, 2, 200, 333, 128, "NHD"), (1, 8, 2, 17, 65, 64, "HND"), (1, 2, 1, 130, 4100, 128, "HND")]


def _unswizzle(x, rows, row_bytes):
    """(..., rows * row_bytes) bytes of a swizzled shared-memory tile (kernels_cu/common/tile.cuh swz) -> (..., rows,
    row_bytes) in row order."""
    cpr = row_bytes // 16
    r, c = np.arange(rows)[:, None], np.arange(cpr)[None, :]
    pc = c ^ ((r >> 1) & 3) if cpr == 4 else c ^ (r & 7)
    idx = (r * row_bytes + pc * 16)[..., None] + np.arange(16)
    return np.ascontiguousarray(x[..., idx.reshape(rows, row_bytes)])


def _unk128(x, rows, row_bytes):
    """A 16-bit operand stored K-major in swizzled 128-byte pieces (TileCopy K128) -> (..., rows, row_bytes)."""
    n = rows * 128
    return np.concatenate([_unswizzle(x[..., a * n:(a + 1) * n], rows, 128) for a in range(row_bytes // 128)], -1)


def _bf16_values(bits):
    """uint16 bf16 patterns -> their float32 values."""
    return (bits.astype(np.uint32) << 16).view(np.float32)


def _image_views(pre, res, D, ds_int8=True):
    """The wgmma pre-pass's stage images (kernels_cu/int8/bwd_img.cuh) decoded into the mma.sync pre-pass's
    arrays (q_t, k_t, do_t tile-major, do_scale, delta), plus what only the images hold. ds_int8=False: the images
    hold Q's and K's codes as bf16 (q16, k16: float32 values) in place of q_t, do_t and k_t, and V 64 D bytes later."""
    qi, ki = pre["q_img"].get(), pre["k_img"].get()
    B, Hq, ntq, _ = qi.shape
    Hkv, ntk = ki.shape[1], ki.shape[2]
    rows = lambda x, n: x.reshape(*x.shape[:2], n * 64, -1)  # (B, H, ntiles, 64, X) -> (B, H, N_pad, X)
    out = dict(delta=pre["delta"])
    out["q_codes"] = rows(_unswizzle(qi[..., :64 * D], 64, D).view(np.int8), ntq)
    out["k_codes"] = rows(_unswizzle(ki[..., :64 * D], 64, D).view(np.int8), ntk)
    kv = 128 * D if ds_int8 else 192 * D  # V's offset in the key-side image
    if ds_int8:
        out["q_t"] = _unswizzle(qi[..., 192 * D:256 * D], D, 64).view(np.int8)
        out["do_t"] = _unswizzle(qi[..., 256 * D:320 * D], D, 64).view(np.int8)
        out["k_t"] = _unswizzle(ki[..., 64 * D:128 * D], D, 64).view(np.int8)
    else:
        out["q16"] = rows(_bf16_values(_unk128(qi[..., 192 * D:320 * D], 64, 2 * D).view(np.uint16)), ntq)
        out["k16"] = rows(_bf16_values(_unk128(ki[..., 64 * D:192 * D], 64, 2 * D).view(np.uint16)), ntk)
    out["do_bits"] = rows(_unk128(qi[..., 64 * D:192 * D], 64, 2 * D).view(np.uint16), ntq)
    out["v_bits"] = rows(_unk128(ki[..., kv:kv + 128 * D], 64, 2 * D).view(np.uint16), ntk)
    f = 320 * D
    vec = lambda x, a, n: np.ascontiguousarray(x[..., a:a + 4 * n]).view(np.float32)
    out["q_scale"] = vec(qi, f, 64).reshape(B, Hq, -1)
    out["lse2"] = vec(qi, f + 256, 64).reshape(B, Hq, -1)
    out["delta_img"] = vec(qi, f + 512, 64).reshape(B, Hq, -1)
    out["do_scale"] = vec(qi, f + 768, D)
    out["k_scale"] = vec(ki, kv + 128 * D, 64).reshape(B, Hkv, -1)
    return out


def _host_bits(x, layout):
    """A device fp16/bf16 array's raw 16-bit patterns on the host, as (B, H, N, D)."""
    return ref_attn.to_hnd(_raw(x).get().view(np.uint16), layout)


@pytest.mark.parametrize("engine", ["mma", "wgmma"])
@pytest.mark.parametrize("shape", BWD_PREP_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("config", [DEFAULT, PAPER], ids=["default", "paper"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_backward_preprocess_matches_reference(config, dtype, shape, engine):
    """The backward's pre-pass: dO's codes and scales bit-identical to the reference's fp32-mode quantizer (per
    64-token tile and channel, or per tile); delta = rowsum(dO * O) within fp32 rounding of the float64 sum (the
    kernel sums each 16-byte chunk's 8 products in order, then the row's chunks by a shuffle tree: a different order
    than numpy's, so not bitwise) and 0 on padding rows; Q^T and K^T exactly the forward's codes, transposed
    tile-major and mma-permuted. wgmma: the same read back from the stage images, which also hold Q^, K^, dO, V (zero
    rows beyond N) and the per-token vectors exactly; with ds_int8=False they hold Q's and K's codes as bf16 (exact)
    instead of Q^T, K^T and dO's codes, and zero dO scales."""
    import sagecupy.int8 as s8
    from sagecupy._loader import device_capability
    from sagecupy.reference.quant import quantize_tiles

    if engine == "wgmma" and device_capability() != (9, 0):
        pytest.skip("the wgmma engine needs sm_90")
    B, Hq, Hkv, Nq, Nk, D, layout = shape
    (q, k, v, do), (_, _, _, doh) = _inputs(23, B, Hq, Hkv, Nq, Nk, D, layout, dtype, sigma=3.0)
    o, res = s8.forward(q, k, v, layout=layout, config=config)
    pre = s8._preprocess_backward(res, do, engine)
    if engine == "wgmma":
        got = _image_views(pre, res, D, config.ds_int8)
        for name in ("q_codes", "k_codes", "q_scale", "k_scale", "lse2"):
            assert np.array_equal(got[name], getattr(res, name).get()), f"{name} in the stage images differs"
        assert np.array_equal(got["delta_img"], pre["delta"].get()), "delta in the images differs"
        for name, x, n in (("do_bits", do, Nq), ("v_bits", v, Nk)):
            want = _host_bits(x, layout)
            assert np.array_equal(got[name][:, :, :n], want), f"{name}: the images' copy differs"
            assert not got[name][:, :, n:].any(), f"{name}: rows beyond N must be zero"
        if not config.ds_int8:  # (no dO codes: the 16-bit dV and the bf16 dK read none)
            for name, codes in (("q16", res.q_codes), ("k16", res.k_codes)):
                assert np.array_equal(got[name], codes.get().astype(np.float32)), f"{name} is not the codes in bf16"
            assert not got["do_scale"].any(), "the dO scales of a ds_int8=False image must be zero"
            return
    else:  # mma.sync: dO's codes for an INT8 dV only, the transposed Q and K codes for an INT8 dK and dQ only
        got = {n: pre.get(n) for n in ("q_t", "k_t", "do_t", "do_scale")}
        assert [got[n] is None for n in got] == [not config.ds_int8] * 2 + [not config.dv_int8] * 2, (
            {n: x is None for n, x in got.items()})
        got = {n: x.get() for n, x in got.items() if x is not None}
        got["delta"] = pre["delta"]
    if "q_t" in got:
        for name, codes, n_pad in (("Q^T", res.q_codes, res.nq_pad), ("K^T", res.k_codes, res.nk_pad)):
            x_t = got[name[0].lower() + "_t"]
            tt = _unpermute_tokens(s8.v_t_channels(x_t), n_pad)
            assert np.array_equal(tt, codes.get()), f"{name} is not the transposed codes"
    do64 = ref_attn.to_hnd(doh, layout)
    if "do_t" not in got:
        _check_delta(got["delta"], do64, o, layout, Nq)
        return
    per_channel = config.do_granularity == "channel"
    want_codes, want_scale = quantize_tiles(do64, 64, 1 if per_channel else None, fp32=True)
    got_codes = _unpermute_tokens(s8.v_t_channels(got["do_t"]), Nq)
    diff = np.argwhere(got_codes.astype(np.int32) != want_codes.astype(np.int32))
    assert diff.size == 0, f"dO codes differ at {len(diff)} places, first {tuple(diff[0])}"
    ntile = -(-Nq // 64)
    got_scale = got["do_scale"][:, :, :ntile, :]
    np.testing.assert_array_equal(got_scale, np.broadcast_to(want_scale[:, :, ::64, :], got_scale.shape).astype(np.float32))
    _check_delta(got["delta"], do64, o, layout, Nq)


def _check_delta(delta, do64, o, layout, Nq):
    o64 = ref_attn.to_hnd(_to_host(o), layout)
    prod = do64 * o64
    want = prod.sum(axis=-1)
    dl = delta.get()
    bound = 1e-5 * np.abs(prod).sum(axis=-1) + 1e-30  # D = 128 fp32 additions: <= 128 * 2^-24 relative to sum|.|
    err = np.abs(dl[:, :, :Nq] - want)
    assert (err <= bound).all(), f"delta off by {float((err / bound).max()):.2f}x its fp32 bound"
    assert not dl[:, :, Nq:].any(), "delta on padding rows must be 0"


@pytest.mark.parametrize("dtype", DTYPES)
def test_quantizer_ties_and_tiny_scales_bit_identical(dtype):
    """Rows (and V's channels) built so that x / s lands exactly on k + 0.5 for many elements (the row max is
    127 * 2^e, so s = 2^e): rint must break every tie to even as the reference does. K's rows are divided by
    multiplying with 1/s and re-divided only near a tie (Q's rows and V's blocks take the exact quotient), so this is
    the case that tells the two apart. In bf16 one row sits at 2^-110 (1/s = 2^113). Not below: CuPy compiles every
    kernel with -ftz=true, so fp32 subnormals (|x| < 2^-126, e.g. a 2^-130 row: its codes come out 0, the
    reference's do not) are flushed; the codes are bit-identical wherever the fp32 values involved are normal numbers
    (a 2^-130 row differed in 63 codes)."""
    import sagecupy.int8 as s8

    D, N = 64, 64  # sm_scale = 1/8: Q's products stay exact, and its ties with them
    exps = [-6, -3, -1, 0, 1, 2, 4] * 10
    exps = exps[:N]
    # s = 127 f 2^e / 127 = f 2^e. f = 1 makes 1/s exact (x * (1/s) lands on the tie itself); f = 1.75,
    # 1.625, 1.875 do not (1/s rounds, so x * (1/s) falls beside the tie and only the exact re-division gets
    # it right: without it 864 of K's codes differ, in a numpy emulation). Those are exact in fp16 only.
    mults = [1.0, 1.75, 1.625, 1.875] if dtype == "float16" else [1.0]
    if dtype == "bfloat16":
        exps[5] = -110
    j = np.arange(D)
    m = np.empty((N, D))
    for r, e in enumerate(exps):
        row = (j + 0.5) * np.where((j + r) % 2 == 0, 1.0, -1.0)
        row[-1] = 127.0
        m[r] = np.roll(row, r) * 2.0 ** e * mults[r % len(mults)]
    q, k, v = m[None, None], m[None, None][..., ::-1].copy(), m.T[None, None].copy()
    devs = [_to_dev(x, dtype) for x in (q, k, v)]
    hosts = [_to_host(x) for x in devs]
    assert np.array_equal(hosts[0], q), "the test values must be exact in the dtype"
    cfg = DEFAULT.replace(name="no-smoothing", k_smoothing=False)
    _, _, pre = s8._preprocess_forward(*devs, causal=False, sm_scale=None, layout="HND", config=cfg)
    ref = ref_sage.quantize_inputs(*hosts, layout="HND", config=cfg)
    _assert_same_codes(pre, ref, N, N)
    quotient = hosts[1][0, 0] / ref["k_scale"][0, 0][:, None]  # K's x / s (exact here): ties must be there
    assert (np.abs(quotient - np.trunc(quotient)) == 0.5).sum() >= N * (D - 2), "the constructed ties are missing"


ENGINE_CASES = [(1, 4, 2, 300, 517, 128, True, "HND", "bfloat16", DEFAULT),
                (2, 2, 2, 128, 64, 64, False, "NHD", "float16", PAPER),
                (1, 2, 1, 1, 200, 128, False, "HND", "float16", DEFAULT),
                (1, 2, 2, 1000, 1000, 64, True, "HND", "bfloat16", DEFAULT),
                # Long enough for the race the wgmma pipeline once had (P codes overwritten while their
                # P.V was in flight): it showed at N = 4096 in ~5% of rows, not at the shorter shapes.
                (1, 8, 8, 4096, 4096, 128, False, "HND", "float16", DEFAULT),
                (1, 4, 2, 300, 517, 128, True, "HND", "bfloat16", BKV64),
                (1, 2, 2, 1000, 1000, 64, True, "HND", "bfloat16", BKV64),
                (1, 8, 8, 4096, 4096, 128, False, "HND", "float16", BKV64)]


@pytest.mark.parametrize("B,Hq,Hkv,Nq,Nk,D,causal,layout,dtype,config", ENGINE_CASES)
def test_forward_engines_agree_bitwise(B, Hq, Hkv, Nq, Nk, D, causal, layout, dtype, config):
    """wgmma (Hopper) and mma.sync compute the same int32 products and the same float operations after them: O,
    LSE and the saved base-2 LSE must be identical bit for bit (and repeatable: each engine runs twice)."""
    import sagecupy.int8 as s8
    from sagecupy._loader import device_capability

    engines = ("mma", "wgmma") if device_capability() == (9, 0) else ("mma",)  # wgmma: Hopper only
    (q, k, v, _), _ = _inputs(21, B, Hq, Hkv, Nq, Nk, D, layout, dtype, sigma=2.0)
    outs = {}
    for engine in engines:
        for run in range(2):
            o, lse, res = s8.forward(q, k, v, causal=causal, layout=layout, config=config, return_lse=True,
                                     engine=engine)
            outs[engine, run] = (_raw(o).get(), lse.get(), res.lse2.get())
    ref = outs["mma", 0]
    for key, got in outs.items():
        for name, a, b in zip(("O", "LSE", "lse2"), ref, got):
            same = np.ascontiguousarray(a).view(np.uint8) == np.ascontiguousarray(b).view(np.uint8)
            assert same.all(), f"{name} of {key} differs from mma.sync's in {int((~same).sum())} bytes"


BWD_ENGINE_CASES = ENGINE_CASES + [(1, 4, 1, 239, 113, 128, True, "NHD", "bfloat16", PAPER),
                                   (2, 2, 2, 1000, 300, 64, False, "HND", "float16", PAPER),
                                   (1, 4, 2, 300, 517, 128, True, "HND", "bfloat16", DV8),
                                   (2, 2, 2, 1000, 300, 64, False, "HND", "float16", DV8),
                                   (1, 4, 2, 300, 517, 64, True, "NHD", "float16", DS8),
                                   (2, 2, 2, 1000, 300, 128, False, "HND", "bfloat16", DS8)]


@pytest.mark.parametrize("B,Hq,Hkv,Nq,Nk,D,causal,layout,dtype,config", BWD_ENGINE_CASES)
def test_backward_engines_agree(B, Hq, Hkv, Nq, Nk, D, causal, layout, dtype, config):
    """The wgmma backward (Hopper) and the mma.sync one run the same element-wise float code on exact int32
    products; only the fp16/bf16 products (dP = dO V^T, and in the default dV = P^T dO, dK and dQ) are accumulated
    in fp32 by different instructions, whose summation order inside the tensor core may differ (an ulp of dP, of a
    tile's share of dV, dK or dQ). That can move dS by an ulp and, at an
    exact rounding tie, one dS code by one step; the bound (relative L2 <= 1e-5 between the engines, 100x
    below the kernel-vs-simulator tolerance) allows that and nothing else: a wrong tile, a wrong scale or a
    layout error shows as >= 1e-3."""
    import sagecupy.int8 as s8
    from sagecupy._loader import device_capability

    if device_capability() != (9, 0):
        pytest.skip("the wgmma backward needs sm_90")
    (q, k, v, do), _ = _inputs(22, B, Hq, Hkv, Nq, Nk, D, layout, dtype, sigma=2.0)
    _, res = s8.forward(q, k, v, causal=causal, layout=layout, config=config)
    got = {e: [_to_host(x) for x in s8.backward(res, do, engine=e)] for e in ("mma", "wgmma")}
    for name, a, b in zip(("dQ", "dK", "dV"), got["mma"], got["wgmma"]):
        assert np.isfinite(b).all(), f"{name}: non-finite values from the wgmma engine"
        err = metrics.rel_l2(b, a)
        assert err <= 1e-5, f"{name}: wgmma vs mma.sync relative L2 {err:.3e} ({(a != b).mean():.2%} differ)"


def test_engine_argument_errors():
    import sagecupy.int8 as s8

    with pytest.raises(ValueError, match="engine"):
        s8.forward_engine("fast")
    with pytest.raises(ValueError, match="engine"):
        s8.backward_engine("fast")
    with pytest.raises(ValueError, match="engine"):
        s8.sage_attention(*(_cupy().zeros((1, 1, 16, 64), _cupy().float16),) * 3, engine="fast")


def test_pre_pass_of_another_engine_is_refused():
    """The wgmma kernels read stage images that only the wgmma pre-passes write (and the mma.sync kernels arrays that
    only theirs write): launching one engine on the other's pre-pass is a ValueError, not a bad memory access."""
    import sagecupy.int8 as s8
    from sagecupy._loader import device_capability

    if device_capability() != (9, 0):
        pytest.skip("both engines run only on sm_90")
    (q, k, v, do), _ = _inputs(5, 1, 2, 2, 130, 130, 64, "HND", "float16")
    p, cfg, pre = s8._preprocess_forward(q, k, v, causal=False, sm_scale=None, layout="HND", config=None,
                                         engine="wgmma")
    with pytest.raises(ValueError, match="prepared for engine='wgmma'"):
        s8._launch_forward(p, cfg, pre, "mma")
    _, res = s8.forward(q, k, v)
    bpre = s8._preprocess_backward(res, do, "mma")
    with pytest.raises(ValueError, match="prepared for engine='mma'"):
        s8._launch_backward(res, bpre, "wgmma")


@pytest.mark.parametrize("where", ["q", "k", "v", "do"])
def test_nan_input_reaches_the_outputs(where):
    """A NaN in an input must show up as NaN where it flows, never as a silent finite value (or a zero
    row that looks like a masked one)."""
    import sagecupy.int8 as s8

    cp = _cupy()
    (q, k, v, do), _ = _inputs(23, 1, 2, 2, 130, 150, 64, "HND", "float16")
    x = {"q": q, "k": k, "v": v, "do": do}[where]
    x[0, 1, 7, 5] = cp.nan
    o, lse, res = s8.forward(q, k, v, return_lse=True)
    dq, dk, dv = s8.backward(res, do)
    o_h, lse_h = _to_host(o), lse.get()
    grads = [_to_host(t) for t in (dq, dk, dv)]
    if where == "q":  # query row 7 of head 1
        assert np.isnan(o_h[0, 1, 7]).all() and np.isnan(lse_h[0, 1, 7])
        assert np.isfinite(o_h[0, 0]).all()
    elif where == "k":  # the K mean of kv head 1 is NaN: all of head 1
        assert np.isnan(o_h[0, 1]).all() and np.isnan(lse_h[0, 1]).all()
    elif where == "v":  # channel 5 of head 1 (per-channel V scale)
        assert np.isnan(o_h[0, 1, :, 5]).all()
    if where != "v":
        assert any(np.isnan(g[0, 1]).any() for g in grads), "the NaN must reach the gradients"
    if where == "do":
        assert np.isfinite(o_h).all()
        assert np.isnan(grads[2][0, 1]).any() and np.isnan(grads[0][0, 1, 7]).any()


_PRE_COMPARED = ("q_codes", "q_scale", "k_codes", "k_scale", "v_t", "v_scale", "qmk", "mu_k", "kv_img")


def _pre_host(pre):
    return {n: pre[n].get() for n in _PRE_COMPARED if pre.get(n) is not None}


VBLOCK = DEFAULT.replace(name="default-vblock", v_granularity="block", block_kv=64)  # quant_qkv<.., MODE 2>
NOSMOOTH = DEFAULT.replace(name="default-nosmooth", k_smoothing=False)  # mu_k = None: K's rows unshifted, no qmk


def _launched(pre):
    """Names of the kernels the pre-pass program of ``pre`` launches."""
    return [step[1].name for step in pre["plan"].prog.steps if step[0] == 2]


@pytest.mark.parametrize("case", [
    (2, 4, 2, 200, 333, 128, "NHD", "bfloat16", None),
    (1, 8, 2, 17, 65, 64, "HND", "float16", None),          # D = 64: quant_rows_qk + fwd_v_image on the wgmma engine
    (1, 2, 1, 1, 4100, 128, "HND", "float16", "k"),          # 17 chunks; NaN in K: the mean of that head is NaN
    (2, 2, 2, 1000, 1000, 128, "HND", "bfloat16", "v"),      # NaN in V: that channel's scale
    (1, 4, 4, 4224, 513, 128, "NHD", "bfloat16", None),
], ids=lambda c: "x".join(map(str, c)))
@pytest.mark.parametrize("config", [DEFAULT, PAPER, VBLOCK, NOSMOOTH], ids=["default", "paper", "vblock", "nosmooth"])
def test_forward_prepass_engines_agree_bitwise(case, config):
    """The wgmma engine's forward pre-pass (at D = 128 with per-token Q and K: Q, K and V quantized in one launch,
    quant_qkv, into the K/V stage images) writes bitwise the codes, scales, means and qmk of the mma.sync engine's
    (quant_rows_qk or quant_rows, then quant_transpose_perm), V's codes and K's in the images included, on every
    call, on the default stream and on another one. Without sm_90: the mma.sync pre-pass against itself."""
    import sagecupy.int8 as s8
    from sagecupy._loader import device_capability

    cp = _cupy()
    B, Hq, Hkv, Nq, Nk, D, layout, dtype, nan_in = case
    (q, k, v, _), _ = _inputs(31, B, Hq, Hkv, Nq, Nk, D, layout, dtype, sigma=2.0)
    if nan_in:
        x = _raw(k if nan_in == "k" else v)
        x[(0, 3, 0, 5) if layout == "NHD" else (0, 0, 3, 5)] = cp.nan if x.dtype == cp.float16 else 0x7FC0
    cp.cuda.Device().synchronize()  # the inputs are written on the null stream; the second stream does not wait
    engines = ("mma", "wgmma", "wgmma") if device_capability() == (9, 0) else ("mma", "mma")
    runs = []
    for engine in engines:
        for stream in (None, cp.cuda.Stream(non_blocking=True)):
            with stream if stream is not None else cp.cuda.Stream.null:
                _, _, pre = s8._preprocess_forward(q, k, v, causal=False, sm_scale=None, layout=layout,
                                                   config=config, engine=engine)
                assert pre["engine"] == engine
                merged = any("quant_qkv" in n for n in _launched(pre))
                assert merged == (engine == "wgmma" and D == 128
                                  and config.q_granularity == config.k_granularity == "token"), _launched(pre)
                got = {n: x for n, x in _pre_host(pre).items() if n not in ("v_t", "kv_img")}
                got["v_codes"] = np.asarray(_v_channels(pre))  # (from the images: K^ and the key scales checked there)
                runs.append((engine, got))
            cp.cuda.Device().synchronize()
    want = runs[0][1]
    for engine, got in runs:
        assert got.keys() == want.keys(), engine
        for n in want:
            np.testing.assert_array_equal(got[n].view(np.uint8), want[n].view(np.uint8), err_msg=f"{engine}: {n}")
    if nan_in == "k" and config.k_smoothing:
        assert np.isnan(want["mu_k"][0, 0, 5]) and np.isfinite(np.delete(want["mu_k"][0, 0], 5)).all()


def test_replay_on_a_fresh_thread():
    """A recorded program replayed on a thread whose first CUDA call is that replay (its launches go straight to the
    driver) gives the same outputs as on the recording thread."""
    import threading

    import sagecupy.int8 as s8

    (q, k, v, do), _ = _inputs(41, 1, 4, 2, 300, 260, 128, "HND", "bfloat16")
    o1, res1 = s8.forward(q, k, v, causal=True)
    dq1, dk1, dv1 = s8.backward(res1, do)
    want = [_raw(x).get() for x in (o1, dq1, dk1, dv1)]
    out, err = [], []

    def work():
        try:
            o2, res2 = s8.forward(q, k, v, causal=True)
            grads = s8.backward(res2, do)
            out.extend(_raw(x).get() for x in (o2, *grads))
        except Exception as exc:  # reported below, in the test's thread
            err.append(exc)

    t = threading.Thread(target=work)
    t.start()
    t.join()
    assert not err, err
    for a, b in zip(out, want):
        np.testing.assert_array_equal(a, b)


def test_psi_exact_matches_division():
    """int8/int8_quant.cu's exact code path (psi_quot: div.rn's arithmetic with the reciprocal refined once per scale and
    without div.rn's range check) gives __fdiv_rn's quotient, hence the same codes, for every scale psi_exact_ok lets
    through: generic values over that whole exponent range, values within 8 ulps of a tie (k + 0.5) s, bf16 rows
    whose values sit at max / 2 and other bf16 grid points (the ties the tie test used to re-divide), and scales at
    both ends of the range. 2^24 pairs per kind."""
    from pathlib import Path

    from sagecupy import _loader

    cp = _cupy()
    src = _loader.inline_file(Path(__file__).with_name("psi_exact.cu"))
    mod = cp.RawModule(code=src, options=_loader._options())
    fn = mod.get_function("psi_quot_vs_div")
    rs = cp.random.RandomState(7)
    n = 1 << 24

    def scale(lo, hi):
        return (rs.uniform(1.0, 2.0, n) * cp.exp2(rs.randint(lo, hi + 1, n).astype(cp.float64))).astype(cp.float32)

    def near_ties(s):
        k = rs.randint(0, 127, n).astype(cp.float64)
        sign = cp.where(rs.randint(0, 2, n) == 0, -1.0, 1.0)
        t = (sign * (k + 0.5) * s.astype(cp.float64)).astype(cp.float32)
        return (t.view(cp.int32) + rs.randint(-8, 9, n).astype(cp.int32)).view(cp.float32)

    def bf16(x):
        return (x.astype(cp.float32).view(cp.uint32) & cp.uint32(0xFFFF0000)).view(cp.float32)

    amax = bf16(scale(-60, 60) * cp.float32(127.0))
    s_bf = (amax / cp.float32(127.0)).astype(cp.float32)
    halves = amax * cp.where(rs.randint(0, 2, n) == 0, cp.float32(-0.5), cp.float32(0.5))
    grid = bf16(amax * rs.uniform(-1.0, 1.0, n).astype(cp.float32))
    s_gen = scale(-79, 98)
    s_edge = cp.where(rs.randint(0, 2, n) == 0, scale(-79, -72), scale(92, 98))
    kinds = {
        "generic": (s_gen * rs.uniform(-127.5, 127.5, n).astype(cp.float32), s_gen),
        "near ties": (near_ties(s_gen), s_gen),
        "bf16 at max / 2": (halves, s_bf),
        "bf16 grid": (grid, s_bf),
        "range ends, near ties": (near_ties(s_edge), s_edge),
    }
    for name, (x, s) in kinds.items():
        x, s = cp.ascontiguousarray(x, dtype=cp.float32), cp.ascontiguousarray(s, dtype=cp.float32)
        bad = cp.zeros(3, dtype=cp.uint64)
        first = cp.full(2, -1, dtype=cp.int64)
        fn((1024,), (256,), (x, s, np.int64(n), bad, first))
        codes, bits, seen = (int(b) for b in bad.get())
        assert seen == n, (name, seen)
        assert codes == 0 and bits == 0, (name, codes, bits, [(float(x[i]), float(s[i])) for i in first.get() if i >= 0])
    quotient = (halves / s_bf).get()
    assert (np.abs(np.abs(quotient) - 63.5) < 1e-4).mean() > 0.99, "the bf16 half-max values must sit at a tie"


def _ex_launched(prog):
    """Names of the kernels a program launches through cuLaunchKernelEx (programmatic dependent launch)."""
    from sagecupy import _program

    return [step[1].name for step in prog.steps
            if step[0] == _program._LAUNCH and step[7] is not None and step[7].ex is not None]


_SPIN_SRC = r"""
extern "C" __global__ void sagecupy_test_spin(long long cycles) {
  const long long t0 = clock64();
  while (clock64() - t0 < cycles) {
  }
}
"""


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("call", ["infer", "train"])
def test_programmatic_dependent_launch_is_bitwise_the_plain_launch(monkeypatch, causal, call):
    """With programmatic dependent launch (SAGECUPY_PDL, on by default from sm_90) the forward's pre-pass kernels
    after the first and the attention kernel go through cuLaunchKernelEx: each may start while its predecessor runs
    and waits (grid_dep_wait) before it touches global memory. O, the LSE and the residuals are bitwise those of plain
    launches, call after call back to back over changing inputs (a kernel that read before its wait would see the
    previous call's buffers, which the memory pool hands out again at once). Each call is queued behind a ~2 ms spin
    kernel, so that its launches reach the device before the first of them runs and then run back to back: at these
    sizes each kernel takes less time than the host needs between two launches, and without the spin every
    predecessor would have finished before its dependent was submitted (on the H200, without the spin the test
    passed with every grid_dep_wait deleted; with it, 9 of 9 calls differed)."""
    import sagecupy.int8 as s8
    from sagecupy import _program

    cp = _cupy()
    if int(cp.cuda.Device().compute_capability) < 90:
        pytest.skip("programmatic dependent launch needs sm_90")
    if _program._launch_ex() is None:
        pytest.skip("the driver has no cuLaunchKernelEx")
    sets = [_inputs(60 + i, 2, 4, 2, 1000 + 37 * i, 1100, 128, "HND", "bfloat16")[0][:3] for i in range(3)]
    spin = cp.RawKernel(_SPIN_SRC, "sagecupy_test_spin")
    got = {}
    for pdl in ("0", "1", "0"):
        monkeypatch.setenv("SAGECUPY_PDL", pdl)
        outs = []
        for _ in range(3):
            for q, k, v in sets:
                spin((1,), (1,), (np.int64(4_000_000),))  # ~2 ms at the H200's ~2 GHz
                if call == "infer":
                    o, lse = s8.sage_attention(q, k, v, causal=causal, return_lse=True)
                    outs.append((o, lse))
                else:
                    o, lse, res = s8.forward(q, k, v, causal=causal, return_lse=True)
                    outs.append((o, lse, res.q_codes, res.k_codes, res.k_scale, res.mu_k, res.lse2))
        got.setdefault(pdl, []).append([[_raw(x).get() for x in out] for out in outs])
        # which launches were programmatic dependents
        _, _, pre = s8._preprocess_forward(*sets[0], causal=causal, sm_scale=None, layout="HND", config=None,
                                           inference=call == "infer")
        launch_progs = list(pre["plan"].launches.values())
        assert launch_progs
        dependents = _ex_launched(pre["plan"].prog) + _ex_launched(launch_progs[-1])
        want = ["column_finish_kv", "quant_qkv", "int8_attn_fwd_sm90"] if pdl == "1" else []
        assert len(dependents) == len(want) and all(w in n for w, n in zip(want, dependents)), dependents
    ref = got["0"][0]
    for pdl, runs in got.items():
        for run in runs:
            for i, (a, b) in enumerate(zip(run, ref)):
                for x, y in zip(a, b):
                    np.testing.assert_array_equal(x.view(np.uint8), y.view(np.uint8), err_msg=f"PDL={pdl} call {i}")
