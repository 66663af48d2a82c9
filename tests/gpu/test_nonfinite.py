"""NaN and ±Inf in q, k, v and dO, per family, engine and dtype, and dS beyond fp16's range.

README and docs/algorithms.md §1.6: a NaN or Inf in an input shows up as NaN in every output it flows into, never as a
silent finite value; a row that sees no key gives O = 0 and LSE = -inf. test_int8.py and test_fp4_attn.py check NaN
in each INT8 input (fp16, one engine, not causal), NaN in V for NVFP4 and QAT's forward, and NaN / Inf in K without
K-smoothing for the NVFP4 stage images. Here every family gets NaN, +Inf and -Inf in each of its inputs, on both
engines, in fp16 (D 64, HND) and bf16 (D 128, NHD), with the causal mask, so that some rows see the poisoned key and
some do not:

    B 2, Hq 4, Hkv 2, Nq 150, Nk 100: row i sees keys 0 .. i - 50; rows 0-49 see none
    poisoned: query row 130 of head 3 (batch 1), key 70 of kv head 1 (its query heads 2, 3), channel 5

Where the value flows (every family quantizes every input of its forward, and a block holding NaN or Inf gets a NaN
scale, docs/algorithms.md §2.1 and §5.3, so the forward's outputs are NaN there, never Inf):

* q: O and the LSE of that row; dQ of that row; dK and dV of every key the row sees.
* k, with K-smoothing (INT8 default, NVFP4 default): K's channel mean, hence every key of the kv head: O and the LSE
  of every row of its query heads that sees a key; dK and dV of the key, dQ of the rows that see it.
* k without K-smoothing (INT8 k_smoothing=False, NVFP4 k_smoothing=False, QAT): the key alone: O and the LSE of the
  rows that see it. Rows that see keys but not this one stay finite: the kernels mask a logit by replacing it with
  -inf before any max or sum (int8/fwd.cuh, common/fp4_fwd.cuh), so the key's NaN logit never reaches them.
* v: the channel (INT8: V's scale per channel over the whole sequence; FP4: 16-token blocks of the channel): O of the
  rows that see the key, in that channel; every other channel and the LSE stay finite. dV = P^T dO has no V in it and
  stays finite; dK of the key and dQ of the rows that see it do not.
* dO: the forward is untouched; dQ of that row, dK of every key the row sees, dV of those keys in that channel (dO's
  INT8 scales are per channel of each 64-row tile; QAT multiplies dO as it is), every other channel of dV finite.

Everywhere else (the other batch element, the other kv head's query heads) every output stays finite and rows that
see no key keep O = 0 and LSE = -inf. The gradients are NaN too, except with an infinite dO, where ±Inf may come out
and the gradients are asserted non-finite instead:

* QAT: it multiplies the raw dO (and dS rounded to 16 bits) on tensor cores, so an Inf may come out as ±Inf.
* INT8, dK of the keys the row sees: dP = dO V^T takes the raw 16-bit dO and delta = rowsum(dO o O) is fp32, both
  ±Inf in that row (NaN where the channel's V or O is 0), so its dS = P o (dP - delta) is NaN (Inf - Inf; P = 0 at a
  masked key) or ±Inf, never finite. dK quantizes Y = diag(s_Q) dS per key over a 64-query tile (int8/bwd.cuh,
  bwd_group_scale, a NaN-propagating max): a key whose one non-finite Y is ±Inf gets the scale +Inf / 127 = +Inf
  and the inverse 0, so its codes are integers (the Inf's is the low byte of fma(±Inf, 0, 1.5 * 2^23) = NaN) and
  that tile adds integer * Inf to dK: ±Inf, or NaN for a zero integer. The default (config ds_int8=False) multiplies
  Y rounded to bf16 by Q's codes: ±Inf or NaN the same way. dQ of the row stays NaN: the row's last key tile
  holds keys it does not see (P = 0: 0 * Inf = NaN, so that tile's X, and its X scale with ds_int8=True, is NaN).
  dV in the channel: the default multiplies P rounded to 16 bits by the raw dO (config dv_int8=False), so ±Inf where
  P > 0 and NaN where P = 0; with an INT8 dV (dv_int8=True) dO's block of the channel has the NaN scale and dV is
  NaN there.

One documented behaviour the INT8 forward does not have: with a non-finite value in V, rows that see no key get NaN,
not 0, in that channel (test_int8_nonfinite_v_rows_that_see_no_key; a strict expected failure). Then dS: the INT8
backward keeps dS in fp32 and rounds its folded forms to bf16 (fp32's range; INT8 codes with fp32 scales when
ds_int8=True), so a dS far beyond fp16's range gives finite gradients equal to the simulator's; QAT rounds dS to the input's 16-bit type for its tensor-core products (as FlashAttention
does), so in fp16 such a dS overflows to ±Inf and dQ and dK come out non-finite (never finite and wrong), and in bf16
it does not (docs/design.md, Limits).
"""
import numpy as np
import pytest

from sagecupy.config import DEFAULT, NVFP4Config
from sagecupy.reference import attention as ref_attn

# Helpers and tolerances of the existing suite (same folder).
import test_fp4_attn as tf  # noqa: E402
import test_int8 as t8  # noqa: E402

pytestmark = pytest.mark.gpu

B, HQ, HKV, NQ, NK = 2, 4, 2, 150, 100
SHIFT = NK - NQ                      # causal, bottom-right: row i sees key j iff j <= i + SHIFT
B0, H0, I0, J0, C0 = 1, 3, 130, 70, 5
G0 = H0 // (HQ // HKV)               # the kv head of query head H0 (and the one whose key J0 is poisoned)
GROUP = [h for h in range(HQ) if h // (HQ // HKV) == G0]
NO_KEY = -SHIFT                      # rows 0 .. NO_KEY - 1 see no key
SEE_J0 = J0 - SHIFT                  # rows SEE_J0 .. NQ - 1 see key J0
I0_KEYS = I0 + SHIFT + 1             # keys 0 .. I0_KEYS - 1 are seen by row I0
VALUES = {"nan": float("nan"), "+inf": float("inf"), "-inf": float("-inf")}
BF16_BITS = {"nan": 0x7FC0, "+inf": 0x7F80, "-inf": 0xFF80}
COMBOS = [("float16", 64, "HND"), ("bfloat16", 128, "NHD")]
COMBO_IDS = ["fp16-d64-HND", "bf16-d128-NHD"]
NOSMOOTH = DEFAULT.replace(name="default-nosmooth", k_smoothing=False)


@pytest.fixture(params=["mma", "wgmma"])
def engine(request):
    if request.param == "wgmma":
        from sagecupy._loader import device_capability

        if device_capability() != (9, 0):
            pytest.skip("the wgmma engine needs sm_90")
    return request.param


def _poison(x, where, layout, value):
    """Write ``value`` into input ``x`` (in place) at the poisoned element of ``where``."""
    b, h, n = (B0, H0, I0) if where in ("q", "do") else (B0, G0, J0)
    raw = t8._raw(x)
    idx = (b, h, n, C0) if layout == "HND" else (b, n, h, C0)
    raw[idx] = VALUES[value] if raw.dtype == t8._cupy().float16 else BF16_BITS[value]


def _run(family, where, value, dtype, D, layout, engine):
    """The family's outputs for inputs with ``value`` at ``where``, on the host as HND float64 (LSE (B, Hq, Nq))."""
    (q, k, v, do), _ = t8._inputs(71, B, HQ, HKV, NQ, NK, D, layout, dtype)
    _poison({"q": q, "k": k, "k-nosmooth": k, "v": v, "do": do}[where], where, layout, value)
    if family == "int8":
        import sagecupy.int8 as s8

        cfg = NOSMOOTH if where == "k-nosmooth" else DEFAULT
        o, lse, res = s8.forward(q, k, v, causal=True, layout=layout, config=cfg, return_lse=True, engine=engine)
        grads = s8.backward(res, do, engine=engine)
    elif family == "qat":
        from sagecupy import qat

        o, lse, res = qat.forward(q, k, v, causal=True, layout=layout, return_lse=True, engine=engine)
        grads = qat.backward(res, do, engine=engine)
    else:
        from sagecupy import nvfp4

        cfg = NVFP4Config(k_smoothing=where != "k-nosmooth")
        o, lse = nvfp4.attention(q, k, v, causal=True, layout=layout, config=cfg, return_lse=True, engine=engine)
        grads = None
    out = {"O": ref_attn.to_hnd(t8._to_host(o), layout), "LSE": lse.get().astype(np.float64)}
    if grads is not None:
        for name, g in zip(("dQ", "dK", "dV"), grads):
            out[name] = ref_attn.to_hnd(t8._to_host(g), layout)
    return out


def _nan(x, what):
    assert np.isnan(x).all(), f"{what}: {int((~np.isnan(x)).sum())} of {x.size} values are not NaN"


def _nonfinite(x, what):
    assert not np.isfinite(x).any(), f"{what}: {int(np.isfinite(x).sum())} of {x.size} values are finite"


def _finite(x, what):
    assert np.isfinite(x).all(), f"{what}: {int((~np.isfinite(x)).sum())} of {x.size} values are not finite"


def _lse_ok(lse, what):
    """LSE of rows (last axis) that nothing non-finite reaches: finite where the row sees a key, -inf where not."""
    _finite(lse[..., NO_KEY:], what)
    assert np.isneginf(lse[..., :NO_KEY]).all(), f"{what}: a row that sees no key must have LSE = -inf"


def _outside(x, kv=False):
    """The values of every (batch, head) pair but batch B0's kv head G0 (kv=True) or its query heads."""
    keep = np.ones(x.shape[:2], bool)
    keep[B0, [G0] if kv else GROUP] = False
    return x[keep]


def _check(family, where, value, out):
    bad = _nan
    if family == "qat" and where == "do" and value != "nan":
        bad = _nonfinite  # (the raw dO in QAT's fp16/bf16 products: ±Inf possible)
    bad_dk = bad_dv = bad
    if family == "int8" and where == "do" and value != "nan":
        bad_dk = _nonfinite  # (an Inf in the raw dO makes dS ±Inf, and a key's dK scale +Inf: module docstring)
        bad_dv = _nonfinite  # (the default's dV = P^T dO in 16 bits: P * ±Inf = ±Inf: module docstring)
    o, lse = out["O"], out["LSE"]
    grads = "dQ" in out
    # Nothing reaches the other (batch, head) pairs.
    _finite(_outside(o), "O of the other pairs")
    assert not _outside(o)[:, :NO_KEY].any(), "O of rows that see no key (other pairs) must be 0"
    _lse_ok(_outside(lse), "LSE of the other pairs")
    if grads:
        _finite(_outside(out["dQ"]), "dQ of the other pairs")
        _finite(_outside(out["dK"], kv=True), "dK of the other kv heads")
        _finite(_outside(out["dV"], kv=True), "dV of the other kv heads")
    og, lg = o[B0, GROUP], lse[B0, GROUP]  # (2, Nq, D), (2, Nq): the poisoned kv head's query heads
    if where == "q":
        _nan(o[B0, H0, I0], "O of the poisoned row")
        _nan(lse[B0, H0, I0], "LSE of the poisoned row")
        og_rest, lg_rest = og.copy(), lg.copy()
        og_rest[GROUP.index(H0), I0], lg_rest[GROUP.index(H0), I0] = 0.0, 0.0  # (the poisoned row: NaN, above)
        _finite(og_rest, "O of the group's other rows")
        assert not og_rest[:, :NO_KEY].any(), "O of rows that see no key must be 0"
        _lse_ok(lg_rest, "LSE of the group's other rows")
        if grads:
            bad(out["dQ"][B0, H0, I0], "dQ of the poisoned row")
            dq_rest = out["dQ"][B0].copy()
            dq_rest[H0, I0] = 0.0
            _finite(dq_rest, "dQ of every other row")
            bad(out["dK"][B0, G0, :I0_KEYS], "dK of the keys the poisoned row sees")
            bad(out["dV"][B0, G0, :I0_KEYS], "dV of the keys the poisoned row sees")
    elif where == "k":  # with K-smoothing: K's mean, so every key of the kv head
        _nan(og[:, NO_KEY:], "O of the rows that see a key")
        _nan(lg[:, NO_KEY:], "LSE of the rows that see a key")
        assert not og[:, :NO_KEY].any(), "O of rows that see no key must be 0"
        assert np.isneginf(lg[:, :NO_KEY]).all(), "LSE of rows that see no key must be -inf"
    elif where == "k-nosmooth":  # the key alone
        _nan(og[:, SEE_J0:], "O of the rows that see the key")
        _nan(lg[:, SEE_J0:], "LSE of the rows that see the key")
        _finite(og[:, NO_KEY:SEE_J0], "O of the rows that see keys but not this one")
        _finite(lg[:, NO_KEY:SEE_J0], "LSE of the rows that see keys but not this one")
        assert not og[:, :NO_KEY].any(), "O of rows that see no key must be 0"
        assert np.isneginf(lg[:, :NO_KEY]).all(), "LSE of rows that see no key must be -inf"
    elif where == "v":
        _nan(og[:, SEE_J0:, C0], "O of the rows that see the key, in the poisoned channel")
        other = np.delete(og, C0, axis=-1)
        _finite(other, "O in the other channels")
        assert not other[:, :NO_KEY].any(), "O of rows that see no key (other channels) must be 0"
        if family != "int8":  # (INT8: test_int8_nonfinite_v_rows_that_see_no_key)
            assert not og[:, :NO_KEY].any(), "O of rows that see no key must be 0"
        _lse_ok(lg, "LSE (V does not enter it)")
    else:  # do
        _finite(o, "O (dO does not enter the forward)")
        _lse_ok(lse, "LSE (dO does not enter the forward)")
    if grads and where in ("k", "k-nosmooth", "v"):
        bad(out["dK"][B0, G0, J0], "dK of the poisoned key")
        bad(out["dQ"][B0, GROUP, SEE_J0:], "dQ of the rows that see the poisoned key")
        if where == "v":
            _finite(out["dV"], "dV (dV = P^T dO: V does not enter it)")
        else:
            bad(out["dV"][B0, G0, J0], "dV of the poisoned key")
    if grads and where == "do":
        bad(out["dQ"][B0, H0, I0], "dQ of the poisoned row")
        dq_rest = out["dQ"][B0].copy()
        dq_rest[H0, I0] = 0.0
        _finite(dq_rest, "dQ of every other row")
        bad_dk(out["dK"][B0, G0, :I0_KEYS], "dK of the keys the poisoned row sees")
        bad_dv(out["dV"][B0, G0, :I0_KEYS, C0], "dV of the keys the poisoned row sees, in the poisoned channel")
        _finite(np.delete(out["dV"], C0, axis=-1), "dV in the other channels")


@pytest.mark.parametrize("dtype,D,layout", COMBOS, ids=COMBO_IDS)
@pytest.mark.parametrize("value", list(VALUES))
@pytest.mark.parametrize("where", ["q", "k", "k-nosmooth", "v", "do"])
def test_int8_nonfinite(where, value, dtype, D, layout, engine):
    _check("int8", where, value, _run("int8", where, value, dtype, D, layout, engine))


@pytest.mark.parametrize("dtype,D,layout", COMBOS, ids=COMBO_IDS)
@pytest.mark.parametrize("value", list(VALUES))
@pytest.mark.parametrize("where", ["q", "k", "v", "do"])
def test_qat_nonfinite(where, value, dtype, D, layout, engine):
    out = _run("qat", where, value, dtype, D, layout, engine)
    # QAT has no K-smoothing: a key's non-finite value stays in that key
    _check("qat", "k-nosmooth" if where == "k" else where, value, out)


@pytest.mark.parametrize("dtype,D,layout", COMBOS, ids=COMBO_IDS)
@pytest.mark.parametrize("value", list(VALUES))
@pytest.mark.parametrize("where", ["q", "k", "k-nosmooth", "v"])
def test_nvfp4_nonfinite(where, value, dtype, D, layout, engine):
    _check("nvfp4", where, value, _run("nvfp4", where, value, dtype, D, layout, engine))


class MaskedRowNotZero(AssertionError):
    """The one assertion of the expected failure below."""


@pytest.mark.xfail(raises=MaskedRowNotZero, strict=True,
                   reason="the INT8 forward's epilogue (int8/fwd.cuh fwd_epilogue) stores O * s_V * (1 / l) with "
                          "1 / l = 0 for a row that sees no key, and a non-finite value in V makes its channel's "
                          "scale s_V NaN: 0 * NaN = NaN in that channel instead of O = 0 (the FP4 epilogue stores "
                          "exact zeros for such rows; the INT8 simulator gives 0)")
@pytest.mark.parametrize("value", ["nan", "+inf"])
def test_int8_nonfinite_v_rows_that_see_no_key(value, engine):
    """README: a row that sees no key gives O = 0; a non-finite V never reaches it. Default config (V per channel)."""
    out = _run("int8", "v", value, "float16", 64, "HND", engine)
    o = out["O"][B0, GROUP, :NO_KEY]
    assert np.isfinite(np.delete(o, C0, axis=-1)).all()  # (the rest of the row is 0: test_int8_nonfinite)
    if o[..., C0].any() or np.isnan(o[..., C0]).any():
        raise MaskedRowNotZero(f"O of rows that see no key, channel {C0}: {int(np.isnan(o[..., C0]).sum())} NaN of "
                               f"{o[..., C0].size}")


# ------------------------------------------------------------------------------------- dS beyond fp16's range


def _big_ds(D, dtype):
    """Inputs whose dS = P o (dP - delta) is far beyond fp16's range while every output fits it: Q, K ~ 0.01 N(0, 1)
    (P nearly uniform over 64 keys), V ~ 200 N(0, 1), dO ~ 8000 N(0, 1) (dP ~ 1e7), non-causal, B 1, H 2, N 64.
    Returns device and host inputs and the case. Checks the premise on the exact intermediates: in every row and
    every key column of dS some |value| exceeds 4 x 65504, and every exact output stays below 65504 / 4."""
    rng = np.random.default_rng(61)
    shape = (1, 2, 64, D)
    x = [s * rng.standard_normal(shape) for s in (0.01, 0.01, 200.0, 8000.0)]
    dev = [t8._to_dev(a, dtype) for a in x]
    host = [t8._to_host(a) for a in dev]
    it = ref_attn.attention_intermediates(*host)
    ds = np.abs(it["dS"])
    assert (ds.max(-1) > 4 * 65504).all() and (ds.max(-2) > 4 * 65504).all(), "premise: dS beyond fp16"
    assert all(np.abs(it[n]).max() < 65504 / 4 for n in ("O", "dQ", "dK", "dV")), "premise: outputs within fp16"
    return dev, host, dict(test="dS beyond fp16's range", D=D, dtype=dtype)


@pytest.mark.parametrize("D", [64, 128])
def test_int8_ds_beyond_fp16_range_stays_in_fp32(D, engine):
    """int8/bwd.cuh keeps dS in the fp32 accumulators and rounds diag(s_Q) dS and dS diag(s_K) to bf16, which has
    fp32's exponent range (the default, ds_int8=False; with ds_int8=True they are quantized with fp32 scales valid up
    to FLT_MAX), so fp16 inputs whose dS reaches ~5e5 give finite gradients that match the simulator and exact
    attention as in test_int8 (test_int8._check, its tolerances)."""
    import sagecupy.int8 as s8
    from sagecupy.reference import sagebwd as ref_sage

    (q, k, v, do), (qh, kh, vh, doh), case = _big_ds(D, "float16")
    o, lse, res = s8.forward(q, k, v, return_lse=True, engine=engine)
    o_h = t8._to_host(o)
    o_sim, r_sim = ref_sage.forward(qh, kh, vh, dtype="float16")
    o_ex, lse_ex = ref_attn.attention_forward(qh, kh, vh)
    t8._check("O", o_h, o_sim, o_ex, "float16", case)
    grads = s8.backward(res, do, engine=engine)
    sims = ref_sage.backward(dict(r_sim, o=o_h), doh)
    exact = ref_attn.attention_backward(qh, kh, vh, o_ex, lse_ex, doh)
    for name, got, sim, ex in zip(("dQ", "dK", "dV"), grads, sims, exact):
        t8._check(name, t8._to_host(got), sim, ex, "float16", case)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("D", [64, 128])
def test_qat_ds_beyond_fp16_range(D, dtype, engine):
    """qat/bwd.cuh rounds dS to the input's 16-bit type as the A operand of dQ += dS K~ and dK += dS^T Q~ (as
    FlashAttention does). fp16: a dS beyond 65504 becomes ±Inf, so every element of dQ and dK is non-finite -- never
    a finite wrong value -- while dV (P_q^T dO, no dS in it) matches the simulator. bf16 has fp32's range: every
    gradient matches the simulator (test_fp4_attn._check, TOL_GRAD; against the simulator alone, whose bound
    includes the output's rounding: here the simulator's own error, 2e-4 for dV, is below bf16's rounding)."""
    from sagecupy import qat
    from sagecupy.reference import qat as ref_qat

    (q, k, v, do), (qh, kh, vh, doh), case = _big_ds(D, dtype)
    o, res = qat.forward(q, k, v, engine=engine)
    o_sim, r_sim, inter = ref_qat.forward(qh, kh, vh, return_intermediates=True)
    amb = tf._ambiguous_rows(inter["S"], True)
    if amb.any():  # as test_qat_backward_vs_reference: those rows' dO = 0 on both sides
        doh = doh * (~amb)[..., None]
        do = t8._to_dev(doh, dtype)
    dq, dk, dv = (t8._to_host(g) for g in qat.backward(res, do, engine=engine))
    dq_s, dk_s, dv_s = ref_qat.backward(r_sim, doh)
    tf._check("dV", dv, dv_s, None, dtype, case, tol=tf.TOL_GRAD)
    if dtype == "float16":
        _nonfinite(dq, "dQ (fp16 dS overflows)")
        _nonfinite(dk, "dK (fp16 dS overflows)")
    else:
        tf._check("dQ", dq, dq_s, None, dtype, case, tol=tf.TOL_GRAD)
        tf._check("dK", dk, dk_s, None, dtype, case, tol=tf.TOL_GRAD)
