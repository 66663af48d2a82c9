"""Batch invariance and determinism of every family's kernels.

What a (batch, head) pair gets -- O and the LSE of its query heads and, for the training families, dQ of its query
heads and dK, dV of its kv head -- must be bitwise the same whether the pair is computed alone, inside a larger
batch, beside more heads, or beside other sequences in the same call; and two identical calls must agree bit for bit.
The kernels are built for it: every CTA works on one pair's rows or keys, the statistics (K's mean, V's channel
scales, quantization blocks) are per pair, and the backward sums in a fixed order without atomics. A dependence on
the rest of the call would make a model's output for one sequence change with what it is batched with.

One path is known not to be batch invariant: the NVFP4 tail split (sagecupy/nvfp4.py _tail_split; D = 128 on the
wgmma engine, not causal, two-level P). Which items of the grid run whole and which in 2-4 parts of their key tiles
depends on how many items the call has against the SM count, and a split item's O and LSE differ from the whole
item's by the fp32 rounding of the parts' combination. test_nvfp4_tail_split_is_not_batch_invariant records it as a
strict expected failure; within one grid the split path is still invariant to the other sequences and repeatable.
"""
import numpy as np
import pytest

from sagecupy.config import BKV64, DEFAULT, PAPER, NVFP4Config

# Helpers of the existing suite (same folder).
import test_int8 as t8  # noqa: E402

pytestmark = pytest.mark.gpu

B, HQ, HKV, NQ, NK = 3, 4, 2, 300, 517   # GQA 2; several key tiles, partial last tiles, Nq != Nk
ELEM = 1                                  # the batch element computed alone
KV_HEAD = 1                               # the kv head (and its query heads 2, 3) computed alone
INT8_CONFIGS = {"default": DEFAULT, "paper": PAPER, "bkv64": BKV64}
NV_CONFIGS = {"two-level": NVFP4Config(), "single-level": NVFP4Config(two_level_p=False),
              "no-smoothing": NVFP4Config(k_smoothing=False)}


class NotInvariant(AssertionError):
    """Raised by the bitwise comparisons alone, so that the expected failure below cannot pass for another reason."""


CASES = [
    # family, engine, config, causal, dtype, layout, D
    ("int8", "mma", "default", False, "float16", "HND", 128),
    ("int8", "mma", "paper", True, "bfloat16", "NHD", 64),
    ("int8", "wgmma", "default", True, "bfloat16", "HND", 128),
    ("int8", "wgmma", "bkv64", False, "float16", "NHD", 64),
    ("int8", "wgmma", "paper", False, "bfloat16", "HND", 128),
    ("qat", "mma", None, True, "bfloat16", "HND", 128),
    ("qat", "wgmma", None, False, "float16", "NHD", 64),
    ("qat", "wgmma", None, True, "bfloat16", "HND", 128),
    ("nvfp4", "mma", "two-level", False, "float16", "HND", 128),
    ("nvfp4", "wgmma", "two-level", False, "bfloat16", "NHD", 64),    # D = 64: no warp-specialized kernel, no split
    ("nvfp4", "wgmma", "two-level", True, "float16", "HND", 128),     # causal: no split
    ("nvfp4", "wgmma", "single-level", False, "bfloat16", "HND", 128),  # single-level P: no split
    ("nvfp4", "wgmma", "no-smoothing", True, "bfloat16", "NHD", 128),
]
IDS = [f"{c[0]}-{c[1]}-{c[2] or 'qat'}-{'causal' if c[3] else 'full'}-{c[4]}-{c[5]}-d{c[6]}" for c in CASES]


def _need_engine(engine):
    from sagecupy._loader import device_capability

    if engine == "wgmma" and device_capability() != (9, 0):
        pytest.skip("the wgmma engine needs sm_90")


def _host(x):
    """A device output's raw values on the host (bf16 as its uint16 bits, the LSE as float32)."""
    return np.ascontiguousarray(t8._raw(x).get())


def _call(family, q, k, v, do, *, causal, layout, engine, config):
    """Every output of the family's calls, on the host: the training forward and backward (INT8: also the inference
    forward), or the NVFP4 forward."""
    if family == "int8":
        import sagecupy.int8 as s8

        cfg = INT8_CONFIGS[config]
        o, lse, res = s8.forward(q, k, v, causal=causal, layout=layout, config=cfg, return_lse=True, engine=engine)
        dq, dk, dv = s8.backward(res, do, engine=engine)
        oi, lsei = s8.sage_attention(q, k, v, causal=causal, layout=layout, config=cfg, return_lse=True, engine=engine)
        out = {"O": o, "LSE": lse, "dQ": dq, "dK": dk, "dV": dv, "O (inference)": oi, "LSE (inference)": lsei}
    elif family == "qat":
        from sagecupy import qat

        o, lse, res = qat.forward(q, k, v, causal=causal, layout=layout, return_lse=True, engine=engine)
        dq, dk, dv = qat.backward(res, do, engine=engine)
        out = {"O": o, "LSE": lse, "dQ": dq, "dK": dk, "dV": dv}
    else:
        from sagecupy import nvfp4

        o, lse = nvfp4.attention(q, k, v, causal=causal, layout=layout, config=NV_CONFIGS[config], return_lse=True,
                                 engine=engine)
        out = {"O": o, "LSE": lse}
    return {n: _host(x) for n, x in out.items()}


_KV_SIDE = ("dK", "dV")


def _select(name, x, layout, batch=slice(None), qheads=slice(None), kvheads=slice(None)):
    """The part of output ``name`` (host, in ``layout``; the LSE is (B, Hq, Nq)) that belongs to the given batch
    elements and heads: query heads for O, LSE and dQ, kv heads for dK and dV."""
    heads = kvheads if name in _KV_SIDE else qheads
    if name.startswith("LSE") or layout == "HND":
        return x[batch, heads]
    return x[batch, :, heads]


def _take(x, layout, batch=slice(None), heads=slice(None)):
    """A contiguous device copy of part of input ``x``: the pair computed on its own."""
    cp = t8._cupy()
    raw = t8._raw(x)
    part = cp.ascontiguousarray(raw[batch, heads] if layout == "HND" else raw[batch, :, heads])
    if part.dtype == cp.uint16:
        from sagecupy.adapters.bf16 import BF16Array

        return BF16Array(part)
    return part


def _same(name, a, b, what):
    a, b = np.ascontiguousarray(a), np.ascontiguousarray(b)
    assert a.shape == b.shape, (name, a.shape, b.shape, what)
    differ = (a.view(np.uint8).reshape(a.shape + (-1,)) != b.view(np.uint8).reshape(b.shape + (-1,))).any(-1)
    if differ.any():
        raise NotInvariant(f"{name}: {int(differ.sum())} of {differ.size} values differ bitwise ({what}); "
                           f"first at {tuple(int(i) for i in np.argwhere(differ)[0])}")


def _others_replaced(dev, other, keep):
    """Inputs ``dev`` with every batch element but ``keep`` taken from ``other`` (other sequences, same shapes)."""
    cp = t8._cupy()
    out = []
    for x, y in zip(dev, other):
        raw = t8._raw(y).copy()
        raw[keep] = t8._raw(x)[keep]
        if raw.dtype == cp.uint16:
            from sagecupy.adapters.bf16 import BF16Array

            raw = BF16Array(raw)
        out.append(raw)
    return out


@pytest.mark.parametrize("family,engine,config,causal,dtype,layout,D", CASES, ids=IDS)
def test_pair_alone_equals_pair_in_a_larger_call(family, engine, config, causal, dtype, layout, D):
    """Batch element ELEM alone (B = 1), kv head KV_HEAD with its query heads alone (Hq = 2, Hkv = 1), and batch
    element ELEM beside other sequences (every other element drawn anew, sigma 3) give bitwise what the full call
    (B = 3, Hq = 4, Hkv = 2) gives for them."""
    _need_engine(engine)
    kw = dict(causal=causal, layout=layout, engine=engine, config=config)
    (q, k, v, do), _ = t8._inputs(51, B, HQ, HKV, NQ, NK, D, layout, dtype)
    full = _call(family, q, k, v, do, **kw)
    group = HQ // HKV
    qh, kvh = slice(KV_HEAD * group, (KV_HEAD + 1) * group), slice(KV_HEAD, KV_HEAD + 1)
    elem = slice(ELEM, ELEM + 1)
    alone = _call(family, *(_take(x, layout, batch=elem) for x in (q, k, v, do)), **kw)
    for name, x in alone.items():
        _same(name, x, _select(name, full[name], layout, batch=elem), f"batch element {ELEM} alone")
    heads = _call(family, *(_take(x, layout, heads=h) for x, h in zip((q, k, v, do), (qh, kvh, kvh, qh))), **kw)
    for name, x in heads.items():
        _same(name, x, _select(name, full[name], layout, qheads=qh, kvheads=kvh), f"kv head {KV_HEAD} alone")
    (q2, k2, v2, do2), _ = t8._inputs(52, B, HQ, HKV, NQ, NK, D, layout, dtype, sigma=3.0)
    mixed = _call(family, *_others_replaced((q, k, v, do), (q2, k2, v2, do2), ELEM), **kw)
    for name, x in mixed.items():
        _same(name, _select(name, x, layout, batch=elem), _select(name, full[name], layout, batch=elem),
              f"batch element {ELEM} beside other sequences")


@pytest.mark.parametrize("family,engine,config,causal,dtype,layout,D", CASES, ids=IDS)
def test_two_identical_calls_are_bitwise_equal(family, engine, config, causal, dtype, layout, D):
    """The same call twice: every output bit for bit (the backward's dQ, dK and dV included)."""
    _need_engine(engine)
    kw = dict(causal=causal, layout=layout, engine=engine, config=config)
    (q, k, v, do), _ = t8._inputs(53, B, HQ, HKV, NQ, NK, D, layout, dtype)
    first = _call(family, q, k, v, do, **kw)
    second = _call(family, q, k, v, do, **kw)
    for name in first:
        _same(name, second[name], first[name], "two identical calls")


# ------------------------------------------------------------------------------------------ the NVFP4 tail split

SPLIT_HQ, SPLIT_HKV, SPLIT_NQ, SPLIT_NK = 2, 1, 300, 1000   # 16 key tiles: parts of 4 tiles, up to 4 parts


def _split_setup():
    """(nvfp4 module, batch size, items per batch element, SM count) for a call in which batch element 0 runs whole
    (its items come first, and the grid has at least one full wave of items) while alone it runs in parts (fewer
    items than SMs: all of them split). The shape follows the device's SM count."""
    from sagecupy import nvfp4

    from test_fp4_attn import _need_sm90

    _need_sm90()
    cp = t8._cupy()
    sms = nvfp4._sm_count(cp.cuda.Device().id)
    nblk = -(-SPLIT_NQ // (64 * nvfp4.fp4_ws("wgmma", 128)))
    per = nblk * SPLIT_HQ
    batch = sms // per + 2
    ntiles = -(-SPLIT_NK // 64)
    alone, full = nvfp4._tail_split(per, sms, ntiles), nvfp4._tail_split(batch * per, sms, ntiles)
    assert alone is not None and alone[0] == 0, f"alone, element 0 must run in parts: {alone} ({sms} SMs)"
    assert full is None or full[0] >= per, f"batched, element 0 must run whole: {full} ({sms} SMs)"
    return nvfp4, batch, sms


def _split_call(nvfp4, q, k, v):
    return {n: _host(x) for n, x in zip(("O", "LSE"), nvfp4.attention(q, k, v, return_lse=True, engine="wgmma"))}


@pytest.mark.xfail(raises=NotInvariant, strict=True,
                   reason="the NVFP4 tail split (D=128, wgmma, not causal, two-level P) runs an item whole or in parts "
                          "of its key tiles depending on the grid's size against the SM count; the parts' combination "
                          "rounds differently in fp32, so a sequence's O and LSE change with the batch around it")
def test_nvfp4_tail_split_is_not_batch_invariant():
    """Batch element 0 of a batch that fills at least one wave of SMs runs as whole items; alone it runs in 4 parts
    of its key tiles. The combination of the parts changes the fp32 rounding of O and the LSE."""
    nvfp4, batch, _ = _split_setup()
    (q, k, v, _), _ = t8._inputs(54, batch, SPLIT_HQ, SPLIT_HKV, SPLIT_NQ, SPLIT_NK, 128, "HND", "float16")
    full = _split_call(nvfp4, q, k, v)
    alone = _split_call(nvfp4, *(_take(x, "HND", batch=slice(0, 1)) for x in (q, k, v)))
    for name, x in alone.items():
        _same(name, x, full[name][0:1], "batch element 0 alone (split) and in the batch (whole)")


def test_nvfp4_tail_split_same_grid_is_invariant_and_repeatable():
    """Within one grid the tail split is invariant after all: batch element 0 (whole items) and the last element (in
    parts when the batch leaves a partial wave) give bitwise the same O and LSE when every other element is drawn
    anew, and two identical calls agree bit for bit (the last part to finish combines the parts in a fixed order)."""
    nvfp4, batch, sms = _split_setup()
    (q, k, v, _), _ = t8._inputs(55, batch, SPLIT_HQ, SPLIT_HKV, SPLIT_NQ, SPLIT_NK, 128, "HND", "bfloat16")
    (q2, k2, v2, _), _ = t8._inputs(56, batch, SPLIT_HQ, SPLIT_HKV, SPLIT_NQ, SPLIT_NK, 128, "HND", "bfloat16",
                                    sigma=3.0)
    full = _split_call(nvfp4, q, k, v)
    again = _split_call(nvfp4, q, k, v)
    for name in full:
        _same(name, again[name], full[name], "two identical calls")
    for keep in (0, batch - 1):
        mixed = _split_call(nvfp4, *_others_replaced((q, k, v), (q2, k2, v2), keep))
        for name in full:
            _same(name, mixed[name][keep:keep + 1], full[name][keep:keep + 1],
                  f"batch element {keep} of {batch} beside other sequences ({sms} SMs)")
